//! The values lifecycle hooks receive.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Who wrote a message row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MessageRole {
    /// The system prompt or an injected system row.
    System,
    /// A user (or signal) row.
    User,
    /// A model step.
    Assistant,
    /// A tool result.
    Tool,
}

/// Completion state of a message row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MessageStatus {
    /// Still streaming.
    Pending,
    /// Complete.
    Completed,
    /// Failed.
    Failed,
}

/// Outcome of a tool call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolStatus {
    /// The tool succeeded.
    Success,
    /// The tool failed (or its arguments were invalid).
    Error,
}

/// A message row, projected from the record stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// Row id.
    pub id: String,
    /// Author.
    pub role: MessageRole,
    /// Text content.
    pub content: Option<String>,
    /// Tool name (tool rows) or author name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The assistant's tool calls, as JSON text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<String>,
    /// The call a tool row answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Tool outcome of a tool row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_status: Option<ToolStatus>,
    /// Completion state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<MessageStatus>,
    /// Creation time, microseconds since the Unix epoch.
    pub created_at: i64,
    /// Hidden from clients unless they ask for silent rows.
    #[serde(default)]
    pub silent: bool,
    /// Free-form metadata.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub metadata: Map<String, Value>,
    /// The images a user row carries, by reference (their bytes are stored apart). A hook may
    /// leave some out, never add one: a `before_create_message` hook's row stores only those
    /// it keeps (the others are not stored, served or sent), and a `filter_messages` hook's
    /// rows send the model only those they keep (a row rebuilt without them sends none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attachments: Vec<MessageAttachment>,
}

/// An image of a user message row, by reference.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageAttachment {
    /// The attachment id (`att_…`), under which the instance serves its bytes.
    pub id: String,
    /// Its media type, one of [`IMAGE_TYPES`](crate::message::IMAGE_TYPES).
    #[serde(rename = "mimeType")]
    pub mime_type: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its file name, when the sender gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// Field updates of a message row (`before_update_message` may rewrite them).
pub type MessageUpdates = Map<String, Value>;

/// A provider-format request message, as `prefilter_llm_history` sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlmMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// A string or content parts.
    pub content: Value,
    /// The assistant's tool calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Value>,
    /// The call a tool message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Tool name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// A tool call as lifecycle hooks see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call id.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub call_type: String,
    /// Name and argument text.
    pub function: ToolCallFunction,
}

impl ToolCall {
    /// A function call.
    pub fn new(id: impl Into<String>, name: impl Into<String>, arguments: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            call_type: "function".to_owned(),
            function: ToolCallFunction {
                name: name.into(),
                arguments: arguments.into(),
            },
        }
    }
}

/// The function part of a [`ToolCall`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCallFunction {
    /// The tool's name.
    pub name: String,
    /// The arguments as JSON text (possibly partial in `tool_call_started`).
    pub arguments: String,
}

/// A tool result as lifecycle hooks see it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolResult {
    /// Success or error.
    pub status: ToolStatus,
    /// Result text on success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// Error text on failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Machine-readable error code.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    /// Structured error data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_data: Option<Map<String, Value>>,
}

impl ToolResult {
    /// A success result.
    pub fn success(result: impl Into<String>) -> Self {
        Self {
            status: ToolStatus::Success,
            result: Some(result.into()),
            error: None,
            error_code: None,
            error_data: None,
        }
    }

    /// An error result.
    pub fn error(error: impl Into<String>) -> Self {
        Self {
            status: ToolStatus::Error,
            result: None,
            error: Some(error.into()),
            error_code: None,
            error_data: None,
        }
    }
}

/// A lifecycle hook's failure. `block` is honoured by `prefilter_llm_history`: it stops the
/// step with `hook_blocked` instead of continuing with the last good value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HookError {
    /// What went wrong.
    pub message: String,
    /// Whether it blocks the provider request (`prefilter_llm_history` only).
    pub block: bool,
}

impl HookError {
    /// A failure.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            block: false,
        }
    }

    /// A blocking failure (`prefilter_llm_history`).
    pub fn block(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            block: true,
        }
    }
}

impl fmt::Display for HookError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for HookError {
    fn from(error: E) -> Self {
        // The alternate form, as for an error that only displays: a `thiserror` variant that
        // is a transparent `anyhow::Error` shows its causes.
        Self::new(format!("{error:#}"))
    }
}

/// A client of the user event stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientInfo {
    /// Client id.
    pub id: String,
    /// Client kind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
}
