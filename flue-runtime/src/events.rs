//! Live events: what `Runtime::observe` delivers while agents run. Live only, no replay.
//!
//! One submission with one tool-calling turn, in order (reference §7.3):
//!
//! 1. `submission_queued`, `submission_running`;
//! 2. `operation_start`, `agent_start`;
//! 3. `message_start` / `message_end` of the user message;
//! 4. `turn_start`, `turn_request`, then the assistant `message_start` with its `text_delta`,
//!    `thinking_start` / `thinking_delta` / `thinking_end` and `toolcall_delta` events;
//! 5. `turn`, then the assistant `message_end`;
//! 6. per tool `tool_start`, and its result's `message_start` / `message_end` once it ran;
//! 7. the terminal `tool` events once the batch committed, then `turn_messages`;
//! 8. 4–7 again until a turn calls no tool (its `turn_messages` follows its `message_end`);
//! 9. `agent_end`, `operation`, `idle`, `submission_settled`.
//!
//! Our own thread events (`tool_call_started`, `tool_call_done`, `thread_event`) and `log`,
//! `data_part`, `compaction_*` and `task*` events interleave where they happen, and
//! `submission_recovery` whenever a coordination step (a scan, a heartbeat, a claim, a
//! settlement) fails and is deferred. Nothing is built for an event nobody observes.
//!
//! Each [`Observation`] is stamped with the operation it happened in (from `operation_start`
//! to `operation`) and, within a model turn (from `turn_start` to `turn_messages`, or a
//! compaction's summarization call), with the turn's id: how a delta or a tool event, which
//! names no turn itself, is tied to its turn. A `task`'s child session publishes its own
//! `agent_start`, its input's messages (the prompt, the first time it runs), its turns (4–8
//! above) and `agent_end`, between the task's `task_start` and `task`, stamped with the task's
//! id and the child's turn.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use flue_core::model::ThinkingLevel;
use flue_core::usage::Usage;

use crate::provider::{ModelMessage, ModelToolCall};
use crate::record::{Outcome, SettlementError};
use crate::store::SubmissionKind;

/// What an event carries for an image's bytes: events show that a message has images, and
/// their media types, but never carry the bytes (observers and event logs keep no image data;
/// the model still reads the images).
pub const IMAGE_DATA_OMITTED: &str = "[image data omitted from event]";

/// What an event carries for a step's reasoning signatures and encrypted reasoning
/// ([`ReasoningBlock`](crate::provider::ReasoningBlock)): opaque provider data, kept for the
/// provider alone. The reasoning text itself is carried.
pub const REASONING_DATA_OMITTED: &str = "[reasoning data omitted from event]";

/// One observation: an [`Event`] with its correlation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Observation {
    /// The agent's name; absent from a pass-wide `submission_recovery` (a failed scan or
    /// heartbeat concerns no one instance).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// The instance id; absent where `agent` is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    /// The submission, when the event belongs to one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submission_id: Option<String>,
    /// The operation (one submission's processing, `operation_start` to `operation`) the
    /// event happened in; the same id as those two events carry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation_id: Option<String>,
    /// The model turn the event belongs to (from its `turn_start` to its `turn_messages`, or
    /// a compaction's summarization call): how deltas and tool events, which carry no turn
    /// id of their own, are tied to their turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_id: Option<String>,
    /// The `task` whose child session the event happened in (its `task_start`'s `taskId`):
    /// a child's turns, deltas and tool events carry it, and their `turnId` is the child's
    /// turn. Absent for the root session's own events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<String>,
    /// Monotonic per runtime.
    pub event_index: u64,
    /// RFC 3339.
    pub timestamp: String,
    /// What happened.
    pub event: Event,
}

/// An event id (`<prefix>_<ULID>`) made on first use and shared by its clones: an event
/// nobody observes never makes it, and every event that names it gets the same one.
#[derive(Clone)]
pub(crate) struct LazyId {
    prefix: &'static str,
    id: std::sync::Arc<std::sync::OnceLock<String>>,
}

impl LazyId {
    pub(crate) fn new(prefix: &'static str) -> Self {
        Self {
            prefix,
            id: std::sync::Arc::default(),
        }
    }

    /// The id, made now if no event needed it before.
    pub(crate) fn get(&self) -> String {
        self.id.get_or_init(|| crate::record::new_id(self.prefix)).clone()
    }
}

/// What ties a submission's events together while an attempt processes it: its operation
/// and the model turn in progress. Registered with the runtime for the submission's id, so
/// every emitter (the turn loop, tools' logs, thread writers, delegation) stamps the
/// [`Observation`]s it sends without being handed anything.
pub(crate) struct Correlation {
    /// The operation's id, made when an event first needs it.
    operation: std::sync::OnceLock<String>,
    turn: TurnSlot,
}

impl Correlation {
    pub(crate) fn new() -> Self {
        Self {
            operation: std::sync::OnceLock::new(),
            turn: TurnSlot::default(),
        }
    }

    /// The operation's id (`op_…`).
    pub(crate) fn operation_id(&self) -> String {
        self.operation.get_or_init(|| crate::record::new_id("op")).clone()
    }

    /// The turn the events from now on belong to (`None`: no turn is in progress).
    pub(crate) fn set_turn(&self, turn: Option<&LazyId>) {
        self.turn.set(turn);
    }

    /// The ids an observation carries now: the operation's, and the turn's while one runs.
    pub(crate) fn ids(&self) -> (String, Option<String>) {
        (self.operation_id(), self.turn.id())
    }
}

/// The model turn in progress in a session (the root's or a task child's), if any.
#[derive(Default)]
struct TurnSlot(std::sync::Mutex<Option<LazyId>>);

impl TurnSlot {
    fn set(&self, turn: Option<&LazyId>) {
        *self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = turn.cloned();
    }

    /// The turn's id (made now if no event needed it before).
    fn id(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .as_ref()
            .map(LazyId::get)
    }
}

/// A task's child session while it runs: its events are stamped with the task's id, the
/// child's own operation (its prompt, from its `operation_start` to its `idle`) and the
/// child's model turn in progress.
pub(crate) struct TaskScope {
    task_id: String,
    operation_id: String,
    turn: TurnSlot,
}

impl TaskScope {
    pub(crate) fn new(task_id: &str) -> Self {
        Self {
            task_id: task_id.to_owned(),
            operation_id: crate::record::new_id("op"),
            turn: TurnSlot::default(),
        }
    }

    /// The child's operation's id (`op_…`).
    pub(crate) fn operation_id(&self) -> &str {
        &self.operation_id
    }

    /// The child's turn the events from now on belong to (`None`: none is in progress).
    pub(crate) fn set_turn(&self, turn: Option<&LazyId>) {
        self.turn.set(turn);
    }

    /// The task's id and the child's turn in progress.
    pub(crate) fn ids(&self) -> (String, Option<String>) {
        (self.task_id.clone(), self.turn.id())
    }
}

/// What happened. Serialized as the reference names it: a snake_case `type` and camelCase
/// fields (`{"type": "turn_start", "turnId": …}`). Where the payloads differ from the
/// reference's: the turn id of `message_start` and `message_end` is on the [`Observation`],
/// not in the payload; a submission's id is on the [`Observation`], not in the `submission_*`
/// payloads; `toolcall_delta` also carries the call's stream `index`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", rename_all_fields = "camelCase")]
pub enum Event {
    /// A message was admitted.
    SubmissionQueued {
        /// How it arrived.
        kind: SubmissionKind,
    },
    /// An attempt started processing a submission.
    SubmissionRunning {
        /// How the submission arrived (as its `submission_queued` said).
        kind: SubmissionKind,
        /// Attempts so far, this one included.
        attempt_count: u32,
        /// The budget.
        max_attempts: u32,
    },
    /// The processing of one submission began (right before `agent_start`), or a task's child
    /// session began its prompt (its events carry the task's id).
    OperationStart {
        /// The operation's id (`op_…`), shared with its `operation`.
        operation_id: String,
        /// What the operation does.
        operation_kind: OperationKind,
    },
    /// A run of the agent began: right after `operation_start`, and again when the response
    /// goes on after the model would have stopped (a `use_agent_finish` append, a delivery
    /// joined then), as the reference's agent loop runs again (`continue()`).
    AgentStart,
    /// A message began: the applied input (a user message), a model step (an assistant
    /// message, empty while it streams: its deltas follow), or a tool's result once it ran.
    MessageStart {
        /// The message: the input and a tool's result as its `message_end` gives them.
        message: ModelMessage,
    },
    /// A message ended.
    MessageEnd {
        /// The message: the input and a model step as stored (after the message hooks), a
        /// tool's result as stored (after the tool-result hooks, once its call's hook chain
        /// ran; never the tool's own output when a hook changed it). A failed model call ends
        /// with an empty assistant
        /// message. Images carry their media type, and [`IMAGE_DATA_OMITTED`] for their bytes;
        /// signed reasoning carries [`REASONING_DATA_OMITTED`] for its signature or data.
        message: ModelMessage,
    },
    /// An agent model call started (before its assistant `message_start`).
    TurnStart {
        /// The call's id (`turn_…`), shared by its `turn_request`, `turn` and `turn_messages`.
        turn_id: String,
        /// Why the call is made (always [`TurnPurpose::Agent`] here).
        purpose: TurnPurpose,
        /// 1-based step within the response.
        step: u32,
    },
    /// What a model call asks for: right after an agent call's `turn_start`, or before a
    /// compaction's summarization call.
    TurnRequest {
        /// The call's id.
        turn_id: String,
        /// Why the call is made.
        purpose: TurnPurpose,
        /// The model asked for.
        request: TurnRequest,
    },
    /// Streamed answer text. When a selected `before_update_message` or
    /// `before_create_message` hook shapes the assistant rows, the step's text comes once,
    /// as those hooks left it, after the step's stream ended (and its reasoning does not come
    /// at all): observers never see what a hook redacted.
    TextDelta {
        /// The fragment.
        text: String,
    },
    /// Reasoning began streaming in the current assistant message.
    ThinkingStart,
    /// Streamed reasoning text (between `thinking_start` and `thinking_end`).
    ThinkingDelta {
        /// The fragment.
        delta: String,
    },
    /// The reasoning ended: the answer's text or a tool call followed, or the call ended.
    ThinkingEnd {
        /// The reasoning streamed since its `thinking_start`.
        content: String,
    },
    /// A fragment of a tool call's argument text, as the model streams it.
    ToolcallDelta {
        /// The call's position among the response's tool calls.
        index: usize,
        /// The call's id (empty when the stream did not name the call before its arguments).
        tool_call_id: String,
        /// The tool called (empty when the stream did not name the call before its
        /// arguments).
        tool_name: String,
        /// The fragment.
        argument_text_delta: String,
    },
    /// A model call ended.
    Turn {
        /// The call's id.
        turn_id: String,
        /// Why the call was made.
        purpose: TurnPurpose,
        /// 1-based step (for a compaction's call, the step it makes room for).
        step: u32,
        /// How long it took.
        duration_ms: u64,
        /// What the call asked for.
        request: TurnRequest,
        /// What it answered.
        response: TurnResponse,
        /// Whether the call failed.
        is_error: bool,
    },
    /// A tool call appeared in the model's stream (`tool_call_started`: once per call, before
    /// the tool runs; with a progress argument, once that argument's string has streamed).
    ToolCallStarted {
        /// Call id.
        tool_call_id: String,
        /// Tool name.
        tool_name: String,
        /// The progress argument's value, for a tool that declares one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        progress: Option<String>,
    },
    /// An event a hook or tool sent with `ThreadState::emit` (or the runtime's `kv_changed`
    /// after `set_value`), for the thread's connected clients.
    ThreadEvent {
        /// The event's name.
        event_type: String,
        /// Its data.
        data: serde_json::Value,
    },
    /// A tool call finished running (`tool_call_done`), before its batch commits; with status
    /// `error` when the attempt's abort ended it (whatever it returned: its result is never
    /// stored). Also, with status `error`, a call announced (`tool_call_started`) by a model
    /// response that then failed: it will not run (a retried response announces its own
    /// calls); and, with status `error`, a call whose batch an attempt settled with the
    /// outcome-unknown result (its step was stored, and the attempt that was to run it ended
    /// first: a crash, a store failure). No hook runs for such a call: it has no result.
    ToolCallDone {
        /// Call id.
        tool_call_id: String,
        /// Tool name.
        tool_name: String,
        /// `success` or `error`.
        status: String,
    },
    /// A tool started running.
    ToolStart {
        /// Tool name.
        tool_name: String,
        /// Call id.
        tool_call_id: String,
    },
    /// A compaction started.
    CompactionStart {
        /// `threshold` or `overflow`.
        reason: String,
        /// The history's estimated tokens.
        estimated_tokens: u64,
    },
    /// A compaction ended.
    Compaction {
        /// Messages the model read before.
        messages_before: u64,
        /// Messages it reads after.
        messages_after: u64,
        /// How long it took.
        duration_ms: u64,
        /// Whether it failed.
        is_error: bool,
        /// Why it failed (stackless, like a settlement's error).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<SettlementError>,
        /// The usage of the summarization call, when it answered.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        usage: Option<Usage>,
    },
    /// A `task` started: a delegate runs the work in a child session.
    TaskStart {
        /// The task's id.
        task_id: String,
        /// The `task` call that started it (several tasks of one turn run in parallel).
        tool_call_id: String,
        /// The delegate.
        agent: String,
        /// The label the model gave the work.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        description: Option<String>,
        /// The briefing the delegate starts from (its only message).
        prompt: String,
        /// The directory the delegate works in, as the call gave it (relative to the
        /// delegating session's).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cwd: Option<String>,
    },
    /// A `task` ended.
    Task {
        /// The task's id.
        task_id: String,
        /// The delegate.
        agent: String,
        /// Whether it failed.
        is_error: bool,
        /// What returned to the parent: the delegate's final answer, or why the task failed,
        /// before the parent's tool-result hooks (a delegate runs none of its own, and its
        /// answer events show it as it is too): the `task` call's stored form, which a
        /// `before_store_tool_result` hook may have redacted, is in the `tool` event after.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        result: Option<String>,
        /// How long it ran.
        duration_ms: u64,
    },
    /// A tool's result, published when its batch committed.
    Tool {
        /// Tool name.
        tool_name: String,
        /// Call id.
        tool_call_id: String,
        /// Whether it failed.
        is_error: bool,
        /// The result as stored (after the tool-result hooks).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        result: Option<String>,
        /// How long it ran.
        duration_ms: u64,
    },
    /// The messages a turn added, once durable: after its tool batch committed (after the
    /// terminal `tool` events), or for a turn without tool calls after its assistant
    /// `message_end`.
    TurnMessages {
        /// The call's id.
        turn_id: String,
        /// Why the call was made.
        purpose: TurnPurpose,
        /// The assistant message: its text and tool calls, as stored.
        message: ModelMessage,
        /// The results of its tool calls, in call order (as stored: after the tool hooks).
        tool_results: Vec<ModelMessage>,
    },
    /// A data part (a `use_data_writer` write) is durable: published once its record is
    /// appended, never for a write a failed attempt dropped.
    DataPart {
        /// Part name.
        name: String,
        /// The data.
        data: Value,
    },
    /// A progress line from a tool or callback.
    Log {
        /// Level.
        level: String,
        /// The line.
        message: String,
        /// Who logged it: a tool's lines carry `tool` and `toolCallId`, a callback's `hook`
        /// (`use_agent_start`, …) and `hookIndex` (from 0, in declaration order); none for
        /// the framework's own lines.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        attributes: Option<std::sync::Arc<serde_json::Map<String, Value>>>,
    },
    /// A run of the agent ended: where the model would stop (before the finish callbacks
    /// run), or where the response ended otherwise (before its `operation`).
    AgentEnd {
        /// The messages the run added while someone observed, in order:
        /// the input (and joined deliveries) and each completed model step as their
        /// `message_end` gave them, then each step's tool results as stored (after the
        /// tool-result hooks, in call order, an interrupted call's outcome-unknown result
        /// included): their `message_end`s came in completion order.
        messages: Vec<ModelMessage>,
    },
    /// The processing of one submission, or a task child's prompt, ended (after `agent_end`,
    /// before `idle`).
    Operation {
        /// The operation's id, as its `operation_start` gave it.
        operation_id: String,
        /// What the operation did.
        operation_kind: OperationKind,
        /// How long it ran.
        duration_ms: u64,
        /// Whether it failed.
        is_error: bool,
        /// Why it failed (stackless, like a settlement's error).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<SettlementError>,
        /// The usage of the response's durable agent model calls (an earlier attempt's
        /// included; a compaction's summarization calls are on their `compaction` events).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        usage: Option<Usage>,
        /// What the operation returned, when it returns something: a task child's prompt
        /// gives `{text, usage, model}` (its answer, the usage of its model calls in this run
        /// and its model). A submission's processing returns nothing (none).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        result: Option<Value>,
    },
    /// The instance has nothing running (after every response), or a task's child session
    /// ended its prompt (its `taskId` set).
    Idle,
    /// A recovery or coordination step failed, or skipped work, and was contained instead of
    /// settling a submission: the step is tried again at the next scan, heartbeat or wake, and
    /// this is emitted again each time while the condition lasts. A pass-wide failure (listing
    /// expired leases, renewing them) names no instance and no submission.
    SubmissionRecovery {
        /// How the submission arrived, when the step concerned one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kind: Option<SubmissionKind>,
        /// The step.
        operation: RecoveryOperation,
        /// What became of it.
        outcome: RecoveryOutcome,
        /// The submission's attempts so far, when the step concerned one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        attempt_count: Option<u32>,
        /// Its attempt budget.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_attempts: Option<u32>,
        /// What failed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<SettlementError>,
    },
    /// A submission settled.
    SubmissionSettled {
        /// How.
        outcome: Outcome,
        /// Why it failed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<SettlementError>,
    },
}

impl Event {
    /// The `turn_messages` of an agent turn: its assistant message (`text`, `tool_calls`) and
    /// the results of its calls, as stored.
    pub(crate) fn agent_turn_messages(
        turn: &LazyId,
        text: String,
        tool_calls: Vec<ModelToolCall>,
        tool_results: Vec<ModelMessage>,
    ) -> Self {
        Self::TurnMessages {
            turn_id: turn.get(),
            purpose: TurnPurpose::Agent,
            message: ModelMessage::Assistant {
                text,
                tool_calls,
                reasoning: Vec::new(),
            },
            tool_results,
        }
    }
}

/// The recovery or coordination step a `submission_recovery` reports (the reference's
/// vocabulary; `materialize_submission`, which readies a queued row's conversation, has no
/// counterpart here: admission writes the conversation with the row).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryOperation {
    /// Writing a submission's settlement.
    FinalizeSettlement,
    /// Taking over a submission whose owner's lease expired.
    ReconcileSubmission,
    /// Claiming an instance's next submission.
    StartSubmission,
    /// Running a claimed submission: an attempt abandoned for a store failure (the submission
    /// is re-attempted), or keeping the leases of running attempts.
    ProcessSubmission,
    /// A scan: listing expired leases or instances with queued work.
    ReconcilePass,
    /// Carrying an abort requested elsewhere to the attempts this node runs, or settling over
    /// an attempt that did not end within its grace after its abort signal fired.
    EnforceDeadline,
}

/// What became of a step a `submission_recovery` reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryOutcome {
    /// It failed and is tried again later.
    Deferred,
    /// The submission's agent is not registered with this node: it is left to a node that
    /// runs it.
    AgentUnavailable,
    /// The attempt did not end within its grace after its abort signal fired (a timeout or an
    /// abort): it was given up where it hung and the submission settled over it.
    Terminated,
}

/// Why a model call was made (a turn's `purpose`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnPurpose {
    /// The agent's own step.
    Agent,
    /// A compaction's summarization call: reported with `turn_request` and `turn` (between
    /// `compaction_start` and `compaction`), never with `turn_start` or `turn_messages`.
    Compaction,
}

/// What an operation does (an `operation`'s `operationKind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OperationKind {
    /// Processing a delivered message: every submission is one.
    Prompt,
}

/// What a model call asked for (a `turn`'s `request`): the model, not the context — the
/// system prompt, messages and tools stay in process, and nothing of the provider's
/// configuration (keys, headers, endpoints) is in it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TurnRequest {
    /// The provider id (the model specifier's part before the first `/`).
    pub provider: String,
    /// The model id asked for.
    pub model: String,
    /// The reasoning effort asked for.
    pub thinking_level: ThinkingLevel,
}

/// What a model call answered (a `turn`'s `response`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TurnResponse {
    /// Why the call ended, in the reference's finish reasons: `stop`, `toolUse` or `length`;
    /// `error` or `aborted` when the call failed; `contentFilter` when the provider filtered
    /// the output. (A step `prefilter_llm_history` blocked makes no call, so it has no turn:
    /// its assistant message starts and ends on its own.)
    pub finish_reason: String,
    /// The answer text, as the model gave it, or as the selected `before_update_message`
    /// hooks left it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub text: String,
    /// The tool calls, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ModelToolCall>,
    /// The usage of this one call, as the provider counted (absent when it failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Why the call failed: the provider error's kind (`aborted` for an aborted call) and
    /// message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<SettlementError>,
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn events_serialize_with_the_reference_type_names_and_camel_case_fields() {
        let cases = [
            (
                Event::TurnStart {
                    turn_id: "turn_1".into(),
                    purpose: TurnPurpose::Agent,
                    step: 1,
                },
                json!({"type": "turn_start", "turnId": "turn_1", "purpose": "agent", "step": 1}),
            ),
            // Reference §7.2: `submission_running {kind, attemptCount, maxAttempts}` (the
            // submission's id is the observation's), and the finish reason inside the turn's
            // response.
            (
                Event::SubmissionRunning {
                    kind: SubmissionKind::Direct,
                    attempt_count: 1,
                    max_attempts: 10,
                },
                json!({"type": "submission_running", "kind": "direct", "attemptCount": 1, "maxAttempts": 10}),
            ),
            (
                Event::Turn {
                    turn_id: "turn_1".into(),
                    purpose: TurnPurpose::Agent,
                    step: 1,
                    duration_ms: 7,
                    request: TurnRequest {
                        provider: "openai".into(),
                        model: "gpt-x".into(),
                        thinking_level: ThinkingLevel::Off,
                    },
                    response: TurnResponse {
                        finish_reason: "toolUse".into(),
                        ..TurnResponse::default()
                    },
                    is_error: false,
                },
                json!({
                    "type": "turn", "turnId": "turn_1", "purpose": "agent", "step": 1, "durationMs": 7,
                    "request": {"provider": "openai", "model": "gpt-x", "thinkingLevel": "off"},
                    "response": {"finishReason": "toolUse"}, "isError": false,
                }),
            ),
            (
                Event::ToolcallDelta {
                    index: 0,
                    tool_call_id: "call_1".into(),
                    tool_name: "add".into(),
                    argument_text_delta: "{\"a\"".into(),
                },
                json!({"type": "toolcall_delta", "index": 0, "toolCallId": "call_1", "toolName": "add", "argumentTextDelta": "{\"a\""}),
            ),
            (Event::ThinkingStart, json!({"type": "thinking_start"})),
            (
                Event::ThinkingDelta { delta: "hm".into() },
                json!({"type": "thinking_delta", "delta": "hm"}),
            ),
            (
                Event::ThinkingEnd { content: "hm".into() },
                json!({"type": "thinking_end", "content": "hm"}),
            ),
            (
                Event::TextDelta { text: "4".into() },
                json!({"type": "text_delta", "text": "4"}),
            ),
            (
                Event::OperationStart {
                    operation_id: "op_1".into(),
                    operation_kind: OperationKind::Prompt,
                },
                json!({"type": "operation_start", "operationId": "op_1", "operationKind": "prompt"}),
            ),
            (
                Event::Operation {
                    operation_id: "op_1".into(),
                    operation_kind: OperationKind::Prompt,
                    duration_ms: 5,
                    is_error: false,
                    error: None,
                    usage: None,
                    result: None,
                },
                json!({
                    "type": "operation", "operationId": "op_1", "operationKind": "prompt",
                    "durationMs": 5, "isError": false,
                }),
            ),
            (
                Event::TurnMessages {
                    turn_id: "turn_1".into(),
                    purpose: TurnPurpose::Agent,
                    message: ModelMessage::Assistant {
                        text: "4".into(),
                        tool_calls: Vec::new(),
                        reasoning: Vec::new(),
                    },
                    tool_results: Vec::new(),
                },
                json!({
                    "type": "turn_messages", "turnId": "turn_1", "purpose": "agent",
                    "message": {"role": "assistant", "text": "4", "tool_calls": []},
                    "toolResults": [],
                }),
            ),
        ];
        for (event, expected) in cases {
            let value = serde_json::to_value(&event).unwrap_or_default();
            assert_eq!(value, expected);
            let back: Option<Event> = serde_json::from_value(value).ok();
            assert_eq!(back, Some(event));
        }
    }

    /// Events never carry secrets: a turn's request names the model, and nothing of how the
    /// provider is reached.
    #[test]
    fn a_turn_request_names_the_model_and_nothing_else() {
        let event = Event::TurnRequest {
            turn_id: "turn_1".into(),
            purpose: TurnPurpose::Agent,
            request: TurnRequest {
                provider: "openai".into(),
                model: "gpt-x".into(),
                thinking_level: ThinkingLevel::Low,
            },
        };
        assert_eq!(
            serde_json::to_value(&event).unwrap_or_default(),
            json!({
                "type": "turn_request", "turnId": "turn_1", "purpose": "agent",
                "request": {"provider": "openai", "model": "gpt-x", "thinkingLevel": "low"},
            })
        );
    }
}
