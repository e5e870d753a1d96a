//! Delivered messages: what reaches an agent instance (user messages and signals), with the
//! validation every delivery and append surface shares.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Signal types the framework uses for its own narration and recovery; rejected on every
/// delivery and append surface.
pub const RESERVED_SIGNAL_TYPES: [&str; 9] = [
    "resources",
    "instructions",
    "environment",
    "stream_interrupted",
    "stream_continued",
    "submission_aborted",
    "submission_interrupted",
    "compaction",
    "memory",
];

/// Most attachments one user message may carry. Stricter than the reference, which sets no
/// limit: each attachment is stored on its own and sent with every later model call of the
/// conversation, and providers cap the images of one request (Anthropic's API at 100).
pub const MAX_ATTACHMENTS: usize = 100;

/// Largest base64 image payload accepted in one attachment, in characters.
pub const MAX_IMAGE_DATA_LENGTH: usize = 14 * 1024 * 1024;

/// Whether `text` is empty or white space as JavaScript's `String.prototype.trim` sees it (the
/// reference's rule for blank ids and bodies): Unicode spaces and the byte order mark, but not
/// U+0085, which JavaScript does not count as white space.
pub fn is_blank(text: &str) -> bool {
    text.chars()
        .all(|c| (c.is_whitespace() && c != '\u{85}') || c == '\u{feff}')
}

/// A message delivered to an agent instance: the validated shape every transport admits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum DeliveredMessage {
    /// A user's message.
    User(UserMessage),
    /// A structured signal (an event for the model, rendered as a tagged user-role block).
    Signal(Signal),
}

/// A user message.
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
pub struct UserMessage {
    /// The text.
    pub body: String,
    /// Image attachments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attachments: Vec<Attachment>,
}

/// A signal message.
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
pub struct Signal {
    /// Application-specific signal type (non-empty, not framework-reserved).
    #[serde(rename = "type")]
    pub signal_type: String,
    /// The body text.
    pub body: String,
    /// String attributes rendered on the tag.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attributes: BTreeMap<String, String>,
    /// The XML tag name (default `signal`).
    #[serde(default, rename = "tagName", skip_serializing_if = "Option::is_none")]
    pub tag_name: Option<String>,
}

impl Signal {
    /// A signal of `signal_type` with `body`.
    pub fn new(signal_type: impl Into<String>, body: impl Into<String>) -> Self {
        Self {
            signal_type: signal_type.into(),
            body: body.into(),
            ..Self::default()
        }
    }

    /// Adds an attribute.
    pub fn attribute(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.attributes.insert(key.into(), value.into());
        self
    }

    /// Sets the tag name.
    pub fn tag_name(mut self, tag_name: impl Into<String>) -> Self {
        self.tag_name = Some(tag_name.into());
        self
    }

    /// Checks the signal rules: non-empty type, not reserved, XML-name tag.
    pub fn validate(&self) -> Result<(), MessageError> {
        // Non-empty, as the reference's schema checks it: a type of spaces is a type.
        if self.signal_type.is_empty() {
            return Err(MessageError::EmptySignalType);
        }
        if RESERVED_SIGNAL_TYPES.contains(&self.signal_type.as_str()) {
            return Err(MessageError::ReservedSignalType(self.signal_type.clone()));
        }
        if let Some(tag) = &self.tag_name
            && !is_xml_name(tag)
        {
            return Err(MessageError::InvalidTagName(tag.clone()));
        }
        Ok(())
    }
}

/// An image attachment of a user message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Attachment {
    /// A base64-encoded image.
    Image {
        /// Base64 data (at most [`MAX_IMAGE_DATA_LENGTH`] characters).
        data: String,
        /// MIME type, e.g. `image/png`.
        #[serde(rename = "mimeType")]
        mime_type: String,
        /// Optional file name.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        filename: Option<String>,
    },
}

impl Attachment {
    /// The decoded bytes (standard base64, padded or not, ASCII whitespace anywhere skipped,
    /// unused trailing bits ignored: what a browser's `atob` takes, so line-wrapped output of
    /// `base64` decodes).
    pub fn bytes(&self) -> Result<Vec<u8>, MessageError> {
        use base64::Engine as _;
        let Self::Image { data, .. } = self;
        let engine = base64::engine::GeneralPurpose::new(
            &base64::alphabet::STANDARD,
            base64::engine::GeneralPurposeConfig::new()
                .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent)
                .with_decode_allow_trailing_bits(true),
        );
        let data: std::borrow::Cow<'_, str> = if data.bytes().any(|byte| byte.is_ascii_whitespace()) {
            data.chars()
                .filter(|c| !c.is_ascii_whitespace())
                .collect::<String>()
                .into()
        } else {
            data.into()
        };
        engine.decode(&*data).map_err(|_| MessageError::InvalidImageData)
    }

    /// The MIME type: one of [`IMAGE_TYPES`] as spelled there when it is one in another case
    /// (`IMAGE/PNG` is `image/png`: providers, and clients reading it back, take only that),
    /// else as sent.
    pub fn mime_type(&self) -> &str {
        let Self::Image { mime_type, .. } = self;
        IMAGE_TYPES
            .iter()
            .find(|image| image.eq_ignore_ascii_case(mime_type))
            .copied()
            .unwrap_or(mime_type)
    }

    /// The file name, when given.
    pub fn filename(&self) -> Option<&str> {
        let Self::Image { filename, .. } = self;
        filename.as_deref()
    }
}

impl DeliveredMessage {
    /// A user message with `body`.
    pub fn user(body: impl Into<String>) -> Self {
        Self::User(UserMessage {
            body: body.into(),
            attachments: Vec::new(),
        })
    }

    /// A signal.
    pub fn signal(signal_type: impl Into<String>, body: impl Into<String>) -> Self {
        Self::Signal(Signal::new(signal_type, body))
    }

    /// The message text.
    pub fn body(&self) -> &str {
        match self {
            Self::User(user) => &user.body,
            Self::Signal(signal) => &signal.body,
        }
    }

    /// Checks every rule the delivery surfaces share.
    pub fn validate(&self) -> Result<(), MessageError> {
        match self {
            Self::User(user) => {
                if user.attachments.len() > MAX_ATTACHMENTS {
                    return Err(MessageError::TooManyAttachments(user.attachments.len()));
                }
                for attachment in &user.attachments {
                    let Attachment::Image { data, .. } = attachment;
                    if data.len() > MAX_IMAGE_DATA_LENGTH {
                        return Err(MessageError::ImageTooLarge);
                    }
                    if !is_image_type(attachment.mime_type()) {
                        return Err(MessageError::UnsupportedImageType(attachment.mime_type().to_owned()));
                    }
                    let bytes = attachment.bytes()?;
                    if bytes.is_empty() {
                        return Err(MessageError::EmptyImage);
                    }
                    // Stored as sent and sent to the model with every later request of the
                    // conversation: bytes a provider refuses would fail each of them.
                    let found = image_type_of(&bytes);
                    if found != Some(attachment.mime_type()) {
                        return Err(MessageError::ImageTypeMismatch {
                            declared: attachment.mime_type().to_owned(),
                            found,
                        });
                    }
                }
                Ok(())
            }
            Self::Signal(signal) => signal.validate(),
        }
    }
}

impl From<&str> for DeliveredMessage {
    fn from(body: &str) -> Self {
        Self::user(body)
    }
}

impl From<String> for DeliveredMessage {
    fn from(body: String) -> Self {
        Self::user(body)
    }
}

impl From<Signal> for DeliveredMessage {
    fn from(signal: Signal) -> Self {
        Self::Signal(signal)
    }
}

/// A delivered message that breaks a rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// A signal type that is blank.
    #[error("Signal message \"type\" must not be empty.")]
    EmptySignalType,
    /// A framework-reserved signal type.
    #[error(
        "Signal type \"{0}\" is framework-reserved vocabulary (the runtime's own narration and recovery signals) — use an application-specific type."
    )]
    ReservedSignalType(String),
    /// A tag name that is not an XML name.
    #[error(
        "Signal message \"tagName\" must be a valid XML tag name (letters, digits, \"_\", \"-\", \".\"; must not start with a digit, \"-\", or \".\")."
    )]
    InvalidTagName(String),
    /// An image over the size limit.
    #[error("Image data exceeds the 14680064 character limit.")]
    ImageTooLarge,
    /// Image data that is not base64.
    #[error("Image data must be base64-encoded.")]
    InvalidImageData,
    /// An image of no bytes.
    #[error("Image data must not be empty.")]
    EmptyImage,
    /// More than [`MAX_ATTACHMENTS`] attachments (how many there were).
    #[error("A user message carries at most 100 attachments; this one has {0}.")]
    TooManyAttachments(usize),
    /// A MIME type that is not one of [`IMAGE_TYPES`].
    #[error("Image mimeType \"{0}\" is not supported: send image/png, image/jpeg, image/gif or image/webp.")]
    UnsupportedImageType(String),
    /// Image data whose bytes are not of its declared type.
    #[error("Image data is not of its mimeType \"{declared}\": {}", match found {
        Some(found) => format!("its bytes are {found}."),
        None => "its bytes are none of image/png, image/jpeg, image/gif or image/webp.".to_owned(),
    })]
    ImageTypeMismatch {
        /// The declared type (canonical spelling).
        declared: String,
        /// The type the bytes are, when one of [`IMAGE_TYPES`].
        found: Option<&'static str>,
    },
}

/// The image types an attachment may have: the ones every model provider of the runtime takes.
/// Stricter than the reference, which takes any string: an attachment is served back to
/// clients as the type it was sent with, and a provider refuses any other type anyway.
pub const IMAGE_TYPES: [&str; 4] = ["image/png", "image/jpeg", "image/gif", "image/webp"];

/// Whether `mime_type` is one of [`IMAGE_TYPES`] (ASCII case aside).
pub fn is_image_type(mime_type: &str) -> bool {
    IMAGE_TYPES.iter().any(|image| image.eq_ignore_ascii_case(mime_type))
}

/// The one of [`IMAGE_TYPES`] whose signature `bytes` begin with: PNG's eight bytes, JPEG's
/// start-of-image marker, `GIF87a`/`GIF89a`, or a RIFF container of `WEBP`.
pub fn image_type_of(bytes: &[u8]) -> Option<&'static str> {
    if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some("image/png")
    } else if bytes.starts_with(&[0xff, 0xd8, 0xff]) {
        Some("image/jpeg")
    } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        Some("image/gif")
    } else if bytes.len() >= 12 && bytes.starts_with(b"RIFF") && &bytes[8..12] == b"WEBP" {
        Some("image/webp")
    } else {
        None
    }
}

/// `^[A-Za-z_][A-Za-z0-9_.-]*$`
fn is_xml_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

/// What admission returns for a dispatched message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DispatchReceipt {
    /// The durable submission id.
    pub submission_id: String,
    /// When the submission was accepted (RFC 3339).
    pub accepted_at: String,
    /// The instance incarnation the message was admitted to.
    pub uid: String,
    /// Whether an idempotency-keyed replay converged on an earlier admission.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deduplicated: bool,
}

impl fmt::Display for DeliveredMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::User(user) => write!(f, "user: {}", user.body),
            Self::Signal(signal) => write!(f, "signal {}: {}", signal.signal_type, signal.body),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Attachment, DeliveredMessage, MAX_IMAGE_DATA_LENGTH, MessageError, UserMessage, is_blank};

    /// Reference Appendix A: an image's data is at most 14·1024·1024 characters of base64.
    #[test]
    fn image_data_of_the_limit_is_taken_and_one_character_group_more_is_not() {
        assert_eq!(MAX_IMAGE_DATA_LENGTH, 14 * 1024 * 1024);
        let with_data = |data: String| {
            DeliveredMessage::User(UserMessage {
                body: "look".into(),
                attachments: vec![Attachment::Image {
                    data,
                    mime_type: "image/png".into(),
                    filename: None,
                }],
            })
        };
        // A PNG's signature, then zeros.
        let at_limit = format!("iVBORw0KGgoA{}", "AAAA".repeat(MAX_IMAGE_DATA_LENGTH / 4 - 3));
        assert_eq!(at_limit.len(), MAX_IMAGE_DATA_LENGTH);
        assert_eq!(with_data(at_limit).validate(), Ok(()));
        let past = format!("iVBORw0KGgoA{}", "AAAA".repeat(MAX_IMAGE_DATA_LENGTH / 4 - 2));
        assert_eq!(with_data(past).validate(), Err(MessageError::ImageTooLarge));
    }

    #[test]
    fn a_user_message_has_at_most_100_attachments_none_of_them_empty() {
        let image = |data: &str| Attachment::Image {
            data: data.into(),
            mime_type: "image/png".into(),
            filename: None,
        };
        let message = |attachments: Vec<Attachment>| {
            DeliveredMessage::User(UserMessage {
                body: "hi".into(),
                attachments,
            })
        };
        assert_eq!(message(vec![image("iVBORw0KGgo="); 100]).validate(), Ok(()));
        assert_eq!(
            message(vec![image("iVBORw0KGgo="); 101]).validate(),
            Err(MessageError::TooManyAttachments(101))
        );
        for empty in ["", "  "] {
            assert_eq!(
                message(vec![image(empty)]).validate(),
                Err(MessageError::EmptyImage),
                "{empty:?}"
            );
        }
    }

    /// The reference decodes with `atob`: whitespace anywhere (a `base64` tool wraps lines at
    /// 76 characters) and unused trailing bits are taken.
    #[test]
    fn image_data_decodes_with_whitespace_anywhere_and_trailing_bits() {
        let image = |data: &str| Attachment::Image {
            data: data.into(),
            mime_type: "image/png".into(),
            filename: None,
        };
        let plain = image("iVBORw0KGgo=").bytes();
        assert_eq!(plain, Ok(vec![0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1a, b'\n']));
        assert_eq!(image("iVBO\nRw0K\r\nGgo=").bytes(), plain);
        assert_eq!(image(" iVBORw0KGgo= \n").bytes(), plain);
        // `iVBORw0KGgp=`: the last character's low bits are not zero.
        assert_eq!(image("iVBORw0KGgp=").bytes(), plain);
        assert_eq!(image("iVB*ORw0KGgo=").bytes(), Err(MessageError::InvalidImageData));
    }

    /// A type in another case is admitted as the type it names, and read back as spelled in
    /// [`IMAGE_TYPES`] (providers take only that spelling).
    #[test]
    fn an_image_type_in_another_case_reads_as_its_canonical_spelling() {
        let image = |mime_type: &str| Attachment::Image {
            data: "iVBORw0KGgo=".into(),
            mime_type: mime_type.into(),
            filename: None,
        };
        assert_eq!(image("IMAGE/PNG").mime_type(), "image/png");
        assert_eq!(image("Image/Jpeg").mime_type(), "image/jpeg");
        assert_eq!(image("image/webp").mime_type(), "image/webp");
        assert_eq!(image("image/bmp").mime_type(), "image/bmp");
        let message = DeliveredMessage::User(UserMessage {
            body: "look".into(),
            attachments: vec![image("IMAGE/PNG")],
        });
        assert_eq!(message.validate(), Ok(()));
    }

    /// An image is admitted only as the type its bytes are: a provider refuses a PNG sent as
    /// a JPEG (or bytes that are no image), and the image is in every later request.
    #[test]
    fn an_image_is_admitted_only_as_the_type_its_bytes_are() {
        use base64::Engine as _;
        let image = |mime_type: &str, bytes: &[u8]| {
            DeliveredMessage::User(UserMessage {
                body: "look".into(),
                attachments: vec![Attachment::Image {
                    data: base64::engine::general_purpose::STANDARD.encode(bytes),
                    mime_type: mime_type.into(),
                    filename: None,
                }],
            })
        };
        let png: &[u8] = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR";
        let jpeg: &[u8] = &[0xff, 0xd8, 0xff, 0xe0, 0, 0x10, b'J', b'F', b'I', b'F'];
        let webp: &[u8] = b"RIFF\x24\0\0\0WEBPVP8 ";
        for (mime_type, bytes) in [
            ("image/png", png),
            ("IMAGE/PNG", png),
            ("image/jpeg", jpeg),
            ("image/gif", b"GIF89a\x01\0\x01\0".as_slice()),
            ("image/gif", b"GIF87a\x01\0\x01\0".as_slice()),
            ("image/webp", webp),
        ] {
            assert_eq!(image(mime_type, bytes).validate(), Ok(()), "{mime_type}");
        }
        assert_eq!(
            image("image/jpeg", png).validate(),
            Err(MessageError::ImageTypeMismatch {
                declared: "image/jpeg".into(),
                found: Some("image/png"),
            })
        );
        let mismatch = image("image/png", b"<svg xmlns='http://www.w3.org/2000/svg'/>").validate();
        assert_eq!(
            mismatch,
            Err(MessageError::ImageTypeMismatch {
                declared: "image/png".into(),
                found: None,
            })
        );
        assert_eq!(
            mismatch.map_err(|error| error.to_string()),
            Err("Image data is not of its mimeType \"image/png\": its bytes are none of image/png, image/jpeg, image/gif or image/webp.".to_owned())
        );
        // A RIFF container of something else (a WAV file) is no WebP.
        assert_eq!(
            image("image/webp", b"RIFF\x24\0\0\0WAVEfmt ").validate(),
            Err(MessageError::ImageTypeMismatch {
                declared: "image/webp".into(),
                found: None,
            })
        );
        assert!(image("image/webp", b"RIFF").validate().is_err());
    }

    #[test]
    fn blank_is_what_javascripts_trim_empties() {
        for blank in [
            "",
            " ",
            "\t\n\r\u{b}\u{c}",
            "\u{feff}",
            "\u{a0}\u{2003}\u{2028}\u{2029}\u{3000}",
        ] {
            assert!(is_blank(blank), "{blank:?}");
        }
        // U+0085 is white space to Rust, not to JavaScript.
        for text in ["a", " a ", "\u{85}", "\u{200b}"] {
            assert!(!is_blank(text), "{text:?}");
        }
    }
}
