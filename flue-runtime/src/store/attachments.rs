//! Attachment bytes kept beside an instance's stream (reference §5.4): a message's images are
//! stored once under an id, read back exactly, and never handed to another instance.

use sha2::{Digest, Sha256};

use super::{InstanceKey, StoreError};

/// The largest piece a store keeps in one row: bigger attachments are split.
pub const ATTACHMENT_CHUNK_BYTES: usize = 512 * 1024;

/// The most bytes a store reserves up front for an attachment it reads back (the size it
/// stored is a hint: a damaged one must not reserve gigabytes).
pub(crate) const MAX_READ_RESERVATION: usize = 32 * 1024 * 1024;

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
        check_integrity(&self.id, self.size, &self.digest, &self.bytes)
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

impl StoredAttachment {
    /// The attachment as read back, once its bytes match the size and digest stored with
    /// them: a lost or damaged chunk is an `AttachmentIntegrityError`, never other bytes.
    pub(crate) fn verified(self) -> Result<Self, StoreError> {
        check_integrity(&self.id, self.size, &self.digest, &self.bytes)?;
        Ok(self)
    }
}

/// Checks `size` and `digest` (SHA-256, lowercase hex) against `bytes`.
fn check_integrity(id: &str, size: u64, digest: &str, bytes: &[u8]) -> Result<(), StoreError> {
    if size != bytes.len() as u64 {
        return Err(StoreError::AttachmentIntegrity {
            id: id.to_owned(),
            reason: super::IntegrityFailure::Size,
            detail: format!("attachment \"{id}\" declares {size} bytes but has {}", bytes.len()),
        });
    }
    if digest != sha256_hex(bytes) {
        return Err(StoreError::AttachmentIntegrity {
            id: id.to_owned(),
            reason: super::IntegrityFailure::Digest,
            detail: format!("attachment \"{id}\" does not match its declared SHA-256 digest"),
        });
    }
    Ok(())
}

/// The conflict of an id already taken by other bytes or another instance.
pub(crate) fn conflict(id: &str) -> StoreError {
    StoreError::AttachmentConflict(id.to_owned())
}

/// Lowercase hex SHA-256.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|byte| format!("{byte:02x}")).collect()
}
