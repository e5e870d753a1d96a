//! Conversation records: the append-only stream of an instance, the only truth about what the
//! model saw, what tools returned, which state was written and how submissions settled.

use std::collections::BTreeMap;
use std::sync::Arc;

use flue_core::lifecycle::MessageRole;
use flue_core::metadata::Metadata;
use flue_core::usage::Usage;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::provider::StopReason;
use crate::store::InstanceKey;

/// One record of an instance's stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Unique id (`record_…`).
    pub id: String,
    /// The submission the record belongs to, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submission_id: Option<Arc<str>>,
    /// The attempt that wrote it, when written by an attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt_id: Option<Arc<str>>,
    /// When it was written (RFC 3339, milliseconds).
    pub timestamp: Arc<str>,
    /// What it says.
    #[serde(flatten)]
    pub body: RecordBody,
}

/// How a submission ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The response completed.
    Completed,
    /// The response failed.
    Failed,
    /// The submission was aborted.
    Aborted,
}

/// The error of a failed or aborted settlement, as serialized on records and the wire:
/// `{type, name, message, details, meta?}`. `name` is derived from the type
/// ([`SettlementError::name`]) when written and ignored when read, so records written before
/// it existed read the same.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct SettlementError {
    /// Stable snake-case type: the contract clients branch on.
    #[serde(rename = "type")]
    pub error_type: String,
    /// One caller-safe sentence.
    pub message: String,
    /// Caller-safe detail beyond the message; empty when there is none (read from `null` too).
    #[serde(default, deserialize_with = "null_as_empty")]
    pub details: String,
    /// Structured facts about the failure (`attemptCount` and `maxAttempts` of an exhausted
    /// retry budget, say), when it has any.
    #[serde(default)]
    pub meta: Option<serde_json::Map<String, Value>>,
}

/// A string that may be `null` (read as empty).
fn null_as_empty<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(deserializer)?.unwrap_or_default())
}

/// The message HTTP clients get in place of an internal error's (reference §6.4).
pub const INTERNAL_ERROR_MESSAGE: &str = "The agent submission failed because of an internal error.";

/// The details HTTP clients get in place of an internal error's (reference §6.4).
pub const INTERNAL_ERROR_DETAILS: &str = "The server encountered an unexpected error while processing the agent submission. When reporting this failure, quote the settlement submissionId — server-side logs carry the same id.";

impl SettlementError {
    /// An error of `error_type` saying `message`, without details or meta.
    pub fn new(error_type: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            error_type: error_type.into(),
            message: message.into(),
            details: String::new(),
            meta: None,
        }
    }

    /// With `meta`.
    #[must_use]
    pub fn with_meta(mut self, meta: serde_json::Map<String, Value>) -> Self {
        self.meta = Some(meta);
        self
    }

    /// Whether HTTP clients are served the reference's generic `internal_error` in its place
    /// ([`SettlementError::for_clients`]), as the reference serves every error that is not one
    /// of its typed errors (§6.4): a start, finish or response callback's failure, a render's
    /// (a panic or an error the agent function returned, an identity change, a missing
    /// `use_model`), a model that does not resolve,
    /// the finish ceiling or a finish append no step can answer, a sandbox factory's failure,
    /// a required MCP server that cannot be used, a skill name conflict, a failed compaction,
    /// a lifecycle hook's panic. Their texts are the application's own (or the framework's
    /// words around them) and may say anything: a connection string, a token in a URL. The
    /// records, the in-process API and the server's log keep them. A lifecycle hook's
    /// `message_hook_error` that is not a panic is the reason the application gives clients
    /// for refusing a message: it stays.
    pub fn is_internal(&self) -> bool {
        match self.error_type.as_str() {
            "render_failed"
            | "render_identity_changed"
            | "model_required"
            | "model_resolution"
            | "agent_finish_ceiling"
            | "agent_finish_unanswerable"
            | "queued_tool_ceiling"
            | "mcp_connection_failed"
            | "skill_name_conflict"
            | "compaction_failed"
            | "agent_start_failed"
            | "agent_finish_failed"
            | "response_hook_failed"
            | "sandbox_unavailable" => true,
            "message_hook_error" => self.message.starts_with("panicked"),
            _ => false,
        }
    }

    /// The error as HTTP clients are served it: the reference's generic `internal_error` for
    /// an [internal](Self::is_internal) one, else itself.
    pub fn for_clients(&self) -> std::borrow::Cow<'_, Self> {
        if !self.is_internal() {
            return std::borrow::Cow::Borrowed(self);
        }
        let mut served = Self::new("internal_error", INTERNAL_ERROR_MESSAGE);
        served.details = INTERNAL_ERROR_DETAILS.to_owned();
        std::borrow::Cow::Owned(served)
    }

    /// The error's class name, as the wire carries it next to the type (not a discriminator):
    /// `Error` for `internal_error`, otherwise the type in PascalCase ending in `Error`
    /// (`submission_timeout` → `SubmissionTimeoutError`, `tool_input_validation` →
    /// `ToolInputValidationError`).
    pub fn name(&self) -> String {
        let stem = self.error_type.strip_suffix("_error").unwrap_or(&self.error_type);
        if stem == "internal" {
            return "Error".to_owned();
        }
        let mut name = String::with_capacity(stem.len() + 5);
        for word in stem.split('_').filter(|word| !word.is_empty()) {
            let mut chars = word.chars();
            name.extend(chars.next().map(|first| first.to_ascii_uppercase()));
            name.push_str(chars.as_str());
        }
        name.push_str("Error");
        name
    }
}

impl Serialize for SettlementError {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(4 + usize::from(self.meta.is_some())))?;
        map.serialize_entry("type", &self.error_type)?;
        map.serialize_entry("name", &self.name())?;
        map.serialize_entry("message", &self.message)?;
        map.serialize_entry("details", &self.details)?;
        if let Some(meta) = &self.meta {
            map.serialize_entry("meta", meta)?;
        }
        map.end()
    }
}

/// Records for tests: of a submission, with a fixed timestamp.
#[cfg(test)]
pub(crate) mod test_records {
    use super::{Record, RecordBody};

    /// A record of `submission` saying `body`.
    pub(crate) fn record(submission: &str, body: RecordBody) -> Record {
        Record {
            id: super::new_id("record"),
            submission_id: Some(submission.into()),
            attempt_id: None,
            timestamp: "2026-01-01T00:00:00.000Z".into(),
            body,
        }
    }

    /// The start of model step `step`.
    pub(crate) fn started(step: &str) -> RecordBody {
        RecordBody::AssistantMessageStarted {
            message_id: step.into(),
            model: "test/model".into(),
            turn_id: None,
            response_metadata: None,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod settlement_error_tests {
    use serde_json::json;

    use super::SettlementError;

    #[test]
    fn a_settlement_error_carries_its_name_and_details_and_reads_the_older_two_field_shape() {
        let error = SettlementError::new("submission_retry_exhausted", "Too many attempts.").with_meta(
            json!({"attemptCount": 3, "maxAttempts": 3})
                .as_object()
                .unwrap()
                .clone(),
        );
        let wire = serde_json::to_value(&error).unwrap();
        assert_eq!(
            wire,
            json!({
                "type": "submission_retry_exhausted",
                "name": "SubmissionRetryExhaustedError",
                "message": "Too many attempts.",
                "details": "",
                "meta": {"attemptCount": 3, "maxAttempts": 3},
            })
        );
        assert_eq!(serde_json::from_value::<SettlementError>(wire).unwrap(), error);
        let older: SettlementError =
            serde_json::from_value(json!({"type": "submission_aborted", "message": "Submission was aborted."}))
                .unwrap();
        assert_eq!(
            older,
            SettlementError::new("submission_aborted", "Submission was aborted.")
        );
        let null_details: SettlementError =
            serde_json::from_value(json!({"type": "submission_aborted", "message": "m", "details": null})).unwrap();
        assert_eq!(null_details.details, "", "a null detail reads as none");
        assert_eq!(SettlementError::new("internal_error", "x").name(), "Error");
    }

    /// Reference §6.4: an error the reference raises as a plain `Error` (a render's identity
    /// change or missing model, a model that does not resolve, the finish ceiling) reaches
    /// clients as `internal_error`; the framework's typed errors reach them as they are.
    #[test]
    fn untyped_framework_errors_reach_clients_as_internal_errors_and_typed_ones_as_themselves() {
        for internal in [
            "render_failed",
            "render_identity_changed",
            "model_required",
            "model_resolution",
            "agent_finish_ceiling",
            "agent_finish_unanswerable",
            "mcp_connection_failed",
            "skill_name_conflict",
            "compaction_failed",
            "agent_start_failed",
            "agent_finish_failed",
            "response_hook_failed",
            "sandbox_unavailable",
        ] {
            let served = SettlementError::new(internal, "detail").for_clients().into_owned();
            assert_eq!(served.error_type, "internal_error", "{internal}");
            assert_eq!(served.message, super::INTERNAL_ERROR_MESSAGE, "{internal}");
        }
        for typed in [
            "submission_timeout",
            "submission_retry_exhausted",
            "submission_aborted",
            "context_overflow",
            "rate_limited",
        ] {
            let error = SettlementError::new(typed, "detail");
            assert_eq!(*error.for_clients(), error, "{typed}");
        }
        assert_eq!(
            SettlementError::new("message_hook_error", "x").name(),
            "MessageHookError"
        );
        assert_eq!(
            SettlementError::new("tool_input_validation", "x").name(),
            "ToolInputValidationError"
        );
    }
}

/// The kinds of records.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RecordBody {
    /// A conversation's birth record: an instance's, written at admission, or a task's child
    /// conversation's, written with its parent's [`RecordBody::ChildSessionRetained`].
    ConversationCreated {
        /// The incarnation id.
        uid: String,
        /// Creation data (`null` given reads back as `Some(Null)`, as every store keeps it).
        #[serde(
            default,
            deserialize_with = "crate::store::present",
            skip_serializing_if = "Option::is_none"
        )]
        initial_data: Option<Value>,
        /// What the conversation is; absent for an instance's (a root conversation, and every
        /// record written before children were recorded).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kind: Option<ConversationKind>,
        /// A child's parent conversation (the stream whose `task` call created it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parent: Option<InstanceKey>,
        /// A child's task id (`task_…`), as the task events name it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        task_id: Option<String>,
        /// A child's delegate: the relationship name the task named.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        agent: Option<String>,
    },
    /// A user message delivered to the instance.
    UserMessage {
        /// Message id.
        message_id: String,
        /// Text.
        body: String,
        /// Its images, kept in the attachment store.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        attachments: Vec<AttachmentRef>,
    },
    /// A signal delivered, appended by a callback, or narrated by the framework.
    Signal {
        /// Message id.
        message_id: String,
        /// Signal type.
        signal_type: String,
        /// Body.
        body: String,
        /// Attributes.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        attributes: BTreeMap<String, String>,
        /// Tag name.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tag_name: Option<String>,
    },
    /// A model step began.
    AssistantMessageStarted {
        /// The step's message id.
        message_id: String,
        /// The model specifier.
        model: String,
        /// The model call's turn id (`turn_…`), as the observation events name it (the
        /// step's first call, when a call was made again after an overflow); none on older
        /// records and on steps no model made.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        turn_id: Option<String>,
        /// `use_response_start` metadata (first step of a response only).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        response_metadata: Option<Metadata>,
    },
    /// Text a model step streamed, appended while the step still streams (coalesced: at most
    /// one append per [`RuntimeOptions::text_flush`](crate::RuntimeOptions::text_flush)), so
    /// clients of the record stream follow a long answer live. Only what
    /// [`RecordBody::AssistantMessageCompleted`] says is the step's text: the model never reads
    /// these, and a step that never completes (a crash, a retried call) leaves them behind.
    AssistantTextDelta {
        /// The step's message id.
        message_id: String,
        /// The text streamed since the step's previous delta record.
        delta: String,
    },
    /// Reasoning a model step streamed, appended while the step still streams, as
    /// [`RecordBody::AssistantTextDelta`] is for its text.
    AssistantReasoningDelta {
        /// The step's message id.
        message_id: String,
        /// The reasoning streamed since the step's previous delta record.
        delta: String,
    },
    /// A tool call the step made.
    AssistantToolCall {
        /// The step's message id.
        message_id: String,
        /// Call id.
        tool_call_id: String,
        /// Tool name.
        name: String,
        /// Argument JSON text.
        arguments: String,
    },
    /// A model step completed.
    AssistantMessageCompleted {
        /// The step's message id.
        message_id: String,
        /// The step's text.
        text: String,
        /// The step's reasoning, when the model streamed any (clients show it; the model
        /// never reads it back).
        #[serde(default, skip_serializing_if = "String::is_empty")]
        reasoning: String,
        /// The step's reasoning as its provider wants it back, sent back to the provider with the
        /// step (see [`ReasoningBlock`](crate::provider::ReasoningBlock)).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        reasoning_blocks: Vec<crate::provider::ReasoningBlock>,
        /// Why it ended.
        stop_reason: StopReason,
        /// Usage.
        usage: Usage,
    },
    /// One tool's outcome, appended as the tool ends (the batch's last with the commit). It
    /// stands once appended: a call with an outcome is never run again, and a batch that never
    /// commits is settled with it (first write wins). The tool's state writes are real only
    /// once the batch commits.
    ToolOutcome {
        /// The step that called it.
        assistant_message_id: String,
        /// Call id.
        tool_call_id: String,
        /// Tool name.
        tool_name: String,
        /// Whether it failed.
        is_error: bool,
        /// The result text the model reads.
        content: String,
        /// The result as the JSON value the tool answered, for clients (the protocol's
        /// `output`): none for a text result, an error, or a result a tool-result hook
        /// rewrote. (Older records have none: clients read `content`.) A tool that answered
        /// `null` has `Some(Null)`, as every store keeps it.
        #[serde(
            default,
            deserialize_with = "crate::store::present",
            skip_serializing_if = "Option::is_none"
        )]
        output: Option<Value>,
        /// Whether it asked to end the turn.
        #[serde(default)]
        terminate: bool,
        /// How long it ran.
        duration_ms: u64,
    },
    /// A step of a durable tool's call settled (`ToolContext::step`): a re-run of the call
    /// after an interruption returns `value` instead of running the step again. Appended as
    /// its own batch while the tool runs.
    ToolStepSettled {
        /// Call id.
        tool_call_id: String,
        /// Tool name.
        tool_name: String,
        /// The step's name (unique within the call).
        step_name: String,
        /// What the step returned.
        value: Value,
    },
    /// The commit marker of a tool batch (same append as the batch's state writes).
    ToolResultsCommitted {
        /// The step whose calls the batch answers.
        assistant_message_id: String,
    },
    /// The link to a child conversation a `task` call created (its own stream, `child`): a
    /// re-run of the call after an interruption reattaches to the child instead of starting a
    /// new one. Appended with the child's birth record, atomically, while the call runs.
    ChildSessionRetained {
        /// The task id (`task_…`).
        task_id: String,
        /// What the child is (`task`).
        kind: ConversationKind,
        /// The child's stream.
        child: InstanceKey,
        /// The `task` call that created it.
        parent_tool_call_id: String,
    },
    /// A persistent state write.
    StateWrite {
        /// Name.
        name: String,
        /// Value.
        value: Value,
    },
    /// A delivery's start seam completed.
    AgentStartRun,
    /// A continued finish cycle.
    AgentFinishCycle,
    /// A data-part write.
    MessageDataWrite {
        /// Part name.
        name: String,
        /// Data.
        data: Value,
    },
    /// `use_response_finish` metadata.
    MessageMetadata {
        /// Metadata.
        metadata: Metadata,
    },
    /// A message row written through `ThreadState::inject_message` (no execution started).
    MessageInjected {
        /// Row id.
        message_id: String,
        /// Author (`user`, `assistant` or `system`).
        role: MessageRole,
        /// Text.
        content: String,
        /// Hidden from clients unless they ask for silent rows.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        silent: bool,
        /// Free-form metadata.
        #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
        metadata: serde_json::Map<String, Value>,
    },
    /// Field updates of a message row (`ThreadState::update_message`, or fields a
    /// `before_create_message` hook set beyond the content, in the creating batch).
    MessageUpdated {
        /// Row id.
        message_id: String,
        /// `content`, `silent`, `metadata`, `name` and `status`.
        updates: serde_json::Map<String, Value>,
    },
    /// A message row deleted from the history (`ThreadState::delete_message`).
    MessageDeleted {
        /// Row id.
        message_id: String,
    },
    /// A durable thread value (`ThreadState::set_value`); null deletes it.
    ThreadValueSet {
        /// Key.
        key: String,
        /// Value.
        value: Value,
    },
    /// The resources last narrated to the model (see `resources`); the first one also freezes
    /// the system prompt's skill catalog and agent roster (`baseline`).
    ResourceSnapshot {
        /// What the model was told about.
        snapshot: std::sync::Arc<crate::resources::ResourceSet>,
        /// The frozen system prompt sections (first snapshot only).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        baseline: Option<String>,
    },
    /// The history before `first_kept_message_id` was summarized (compaction): the model sees
    /// `summary` in its place from here on. The stored records stay.
    Compaction {
        /// The summary that replaces the older messages.
        summary: String,
        /// The first message kept verbatim; empty when none is (the whole history before
        /// this record was summarized: an overflow recovery whose newest tool step was too big
        /// to keep).
        first_kept_message_id: String,
        /// The estimated tokens of the history before.
        tokens_before: u64,
        /// `threshold` or `overflow`.
        reason: String,
        /// What the summary call used (absent in records of earlier builds).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        usage: Option<Usage>,
    },
    /// The `after_thread_created` hooks ran (the thread's first execution; written in a batch
    /// of its own before its first input is stored, so a re-attempt does not run them again).
    ThreadCreatedHooksRan,
    /// A submission settled.
    SubmissionSettled {
        /// How.
        outcome: Outcome,
        /// Why it failed or was aborted.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<SettlementError>,
    },
}

/// What a conversation is: an instance's own (root), or a task's child.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConversationKind {
    /// An instance's conversation.
    Root,
    /// The child conversation of a `task` call.
    Task,
}

/// A batch of records appended atomically, with its offset in the stream.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// Position of the batch in the stream (0-based).
    pub offset: u64,
    /// The records, in order (shared: a batch read from the memory store, the runtime's fold
    /// and the store's copy are one allocation).
    pub records: Arc<[Record]>,
}

/// Formats an offset as the protocol does: `0000000000000000_<16-digit sequence>`.
pub fn format_offset(offset: u64) -> String {
    format!("0000000000000000_{offset:016}")
}

/// An attachment of a user message, as its record names it (the bytes are in the store's
/// attachment store under `id`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachmentRef {
    /// The attachment id.
    pub id: String,
    /// Its media type.
    pub media_type: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its file name, when the sender gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filename: Option<String>,
}

impl AttachmentRef {
    /// The attachment as a message row names it (lifecycle hooks, `ThreadState`).
    pub fn to_message_attachment(&self) -> flue_core::lifecycle::MessageAttachment {
        flue_core::lifecycle::MessageAttachment {
            id: self.id.clone(),
            mime_type: self.media_type.clone(),
            size: self.size,
            name: self.filename.clone(),
        }
    }
}

/// The current time as a record timestamp (RFC 3339, milliseconds). Records written within
/// one millisecond on a thread share one string.
pub(crate) fn now() -> Arc<str> {
    thread_local! {
        static LAST: std::cell::RefCell<Option<(u128, Arc<str>)>> = const { std::cell::RefCell::new(None) };
    }
    let time = std::time::SystemTime::now();
    let millis = time
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis());
    LAST.with_borrow_mut(|last| match last {
        Some((at, text)) if *at == millis => text.clone(),
        _ => {
            let text: Arc<str> = humantime::format_rfc3339_millis(time).to_string().into();
            *last = Some((millis, text.clone()));
            text
        }
    })
}

/// The record bodies of one durable model step, in stream order: its start, its tool calls
/// in call order, its completion (one shape for a response's steps and a task child's).
pub(crate) fn model_step_bodies<'a>(
    message_id: &'a str,
    model: &str,
    response_metadata: Option<Metadata>,
    response: &'a crate::provider::ModelResponse,
) -> impl Iterator<Item = RecordBody> + 'a {
    let started = RecordBody::AssistantMessageStarted {
        message_id: message_id.to_owned(),
        model: model.to_owned(),
        turn_id: None,
        response_metadata,
    };
    std::iter::once(started).chain(model_step_ending(message_id, response))
}

/// The records that end a model step whose start is already in the stream: its calls, then
/// its completion.
pub(crate) fn model_step_ending<'a>(
    message_id: &'a str,
    response: &'a crate::provider::ModelResponse,
) -> impl Iterator<Item = RecordBody> + 'a {
    let calls = response
        .tool_calls
        .iter()
        .map(move |call| RecordBody::AssistantToolCall {
            message_id: message_id.to_owned(),
            tool_call_id: call.id.clone(),
            name: call.name.clone(),
            arguments: call.arguments.clone(),
        });
    let completed = RecordBody::AssistantMessageCompleted {
        message_id: message_id.to_owned(),
        text: response.text.clone(),
        reasoning: response.reasoning.clone(),
        reasoning_blocks: response.reasoning_blocks.clone(),
        stop_reason: response.stop_reason,
        usage: response.usage,
    };
    calls.chain(std::iter::once(completed))
}

/// `<prefix>_<ULID>`, in one allocation of its exact size.
pub(crate) fn new_id(prefix: &str) -> String {
    let mut buffer = [0; ulid::ULID_LEN];
    let ulid = ulid::Ulid::new();
    let ulid = ulid.array_to_str(&mut buffer);
    let mut id = String::with_capacity(prefix.len() + 1 + ulid.len());
    id.push_str(prefix);
    id.push('_');
    id.push_str(ulid);
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_settled_tool_step_serializes_with_its_type_tag_and_snake_case_fields() {
        let record = Record {
            id: "record_1".to_owned(),
            submission_id: Some("sub_1".into()),
            attempt_id: None,
            timestamp: "2026-12-01T00:00:00.000Z".into(),
            body: RecordBody::ToolStepSettled {
                tool_call_id: "call_1".to_owned(),
                tool_name: "charge".to_owned(),
                step_name: "charge-card".to_owned(),
                value: serde_json::json!({"charge": "ch_1"}),
            },
        };
        let json = serde_json::to_value(&record).expect("serializes");
        assert_eq!(
            json,
            serde_json::json!({
                "id": "record_1",
                "submission_id": "sub_1",
                "timestamp": "2026-12-01T00:00:00.000Z",
                "type": "tool_step_settled",
                "tool_call_id": "call_1",
                "tool_name": "charge",
                "step_name": "charge-card",
                "value": {"charge": "ch_1"},
            })
        );
        assert_eq!(serde_json::from_value::<Record>(json).expect("deserializes"), record);
    }

    fn record_of(body: RecordBody) -> Record {
        Record {
            id: "record_1".to_owned(),
            submission_id: None,
            attempt_id: None,
            timestamp: "2026-12-01T00:00:00.000Z".into(),
            body,
        }
    }

    #[test]
    fn a_root_birth_record_keeps_its_shape_and_older_ones_parse_as_root() {
        let root = record_of(RecordBody::ConversationCreated {
            uid: "inst_1".to_owned(),
            initial_data: None,
            kind: None,
            parent: None,
            task_id: None,
            agent: None,
        });
        let stored = serde_json::json!({
            "id": "record_1",
            "timestamp": "2026-12-01T00:00:00.000Z",
            "type": "conversation_created",
            "uid": "inst_1",
        });
        assert_eq!(serde_json::to_value(&root).expect("serializes"), stored);
        assert_eq!(serde_json::from_value::<Record>(stored).expect("parses"), root);
    }

    #[test]
    fn a_task_childs_birth_and_its_parent_link_serialize_with_snake_case_fields() {
        let parent = InstanceKey::new("support", "case-1");
        let child = InstanceKey::new("support:task", "case-1/task_1");
        let birth = record_of(RecordBody::ConversationCreated {
            uid: "inst_2".to_owned(),
            initial_data: None,
            kind: Some(ConversationKind::Task),
            parent: Some(parent),
            task_id: Some("task_1".to_owned()),
            agent: Some("summarizer".to_owned()),
        });
        let link = record_of(RecordBody::ChildSessionRetained {
            task_id: "task_1".to_owned(),
            kind: ConversationKind::Task,
            child,
            parent_tool_call_id: "call_1".to_owned(),
        });
        let (birth_json, link_json) = (
            serde_json::to_value(&birth).expect("serializes"),
            serde_json::to_value(&link).expect("serializes"),
        );
        assert_eq!(
            birth_json,
            serde_json::json!({
                "id": "record_1",
                "timestamp": "2026-12-01T00:00:00.000Z",
                "type": "conversation_created",
                "uid": "inst_2",
                "kind": "task",
                "parent": {"agent": "support", "id": "case-1"},
                "task_id": "task_1",
                "agent": "summarizer",
            })
        );
        assert_eq!(
            link_json,
            serde_json::json!({
                "id": "record_1",
                "timestamp": "2026-12-01T00:00:00.000Z",
                "type": "child_session_retained",
                "task_id": "task_1",
                "kind": "task",
                "child": {"agent": "support:task", "id": "case-1/task_1"},
                "parent_tool_call_id": "call_1",
            })
        );
        assert_eq!(serde_json::from_value::<Record>(birth_json).expect("parses"), birth);
        assert_eq!(serde_json::from_value::<Record>(link_json).expect("parses"), link);
    }

    #[test]
    fn ids_are_the_prefix_and_a_ulid() {
        let id = new_id("record");
        let (prefix, ulid) = id.split_once('_').expect("a separator");
        assert_eq!(prefix, "record");
        assert!(ulid::Ulid::from_string(ulid).is_ok(), "{id}");
        assert_eq!(id.capacity(), id.len(), "one allocation of the exact size");
        assert_ne!(new_id("record"), id);
    }

    #[test]
    fn timestamps_are_rfc3339_milliseconds_in_order_and_shared_within_a_millisecond() {
        let mut last = std::time::UNIX_EPOCH;
        let mut shared = false;
        for _ in 0..10_000 {
            let (first, second) = (now(), now());
            assert_eq!(first.len(), "2026-11-30T12:00:00.000Z".len(), "{first}");
            let at = humantime::parse_rfc3339(&first).expect("RFC 3339");
            assert!(at >= last, "{first} went back in time");
            last = at;
            if first == second {
                assert!(Arc::ptr_eq(&first, &second), "one millisecond, one allocation");
                shared = true;
            }
        }
        assert!(shared, "two calls within one millisecond share one string");
    }
}
