//! Attachment bytes kept beside an instance's stream (reference §5.4): a message's images are
//! stored once under an id, read back exactly, and never handed to another instance.

use sha2::{Digest, Sha256};

use super::{InstanceKey, StoreError};

/// The largest piece a store keeps in one row: bigger attachments are split.
pub const ATTACHMENT_CHUNK_BYTES: usize = 512 * 1024;

/// An attachment to store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachmentPut {
    /// Its id, unique across the store.
    pub id: String,
    /// Its media type (`image/png`, …).
    pub media_type: String,
    /// The declared size in bytes (checked against `bytes`).
    pub size: u64,
    /// The declared SHA-256 of `bytes`, lowercase hex (checked).
    pub digest: String,
    /// The bytes.
    pub bytes: Vec<u8>,
}

impl AttachmentPut {
    /// An attachment of `bytes`, its size and digest computed.
    pub fn new(id: impl Into<String>, media_type: impl Into<String>, bytes: Vec<u8>) -> Self {
        Self {
            id: id.into(),
            media_type: media_type.into(),
            size: bytes.len() as u64,
            digest: sha256_hex(&bytes),
            bytes,
        }
    }

    /// Checks the declared size and digest against the bytes (`AttachmentIntegrityError`).
    pub(crate) fn verify(&self) -> Result<(), StoreError> {
        if self.size != self.bytes.len() as u64 {
            return Err(StoreError::AttachmentIntegrity(format!(
                "attachment \"{}\" declares {} bytes but has {}",
                self.id,
                self.size,
                self.bytes.len()
            )));
        }
        if self.digest != sha256_hex(&self.bytes) {
            return Err(StoreError::AttachmentIntegrity(format!(
                "attachment \"{}\" does not match its declared SHA-256 digest",
                self.id
            )));
        }
        Ok(())
    }

    /// Whether the attachment stored under this id (for `owner`, with that media type, size
    /// and digest) is this very one: then putting it again is an exact retry.
    pub(crate) fn is_stored_as(
        &self,
        key: &InstanceKey,
        owner: &InstanceKey,
        media_type: &str,
        size: u64,
        digest: &str,
    ) -> bool {
        key == owner && self.media_type == media_type && self.size == size && self.digest == digest
    }
}

/// A stored attachment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredAttachment {
    /// Its id.
    pub id: String,
    /// Its media type.
    pub media_type: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its SHA-256, lowercase hex.
    pub digest: String,
    /// The bytes.
    pub bytes: Vec<u8>,
}

/// The conflict of an id already taken by other bytes or another instance.
pub(crate) fn conflict(id: &str) -> StoreError {
    StoreError::AttachmentConflict(id.to_owned())
}

/// Lowercase hex SHA-256.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|byte| format!("{byte:02x}")).collect()
}
