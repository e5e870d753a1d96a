//! What clients see of a conversation: the record stream folded into messages (the history
//! snapshot) and each batch projected into chunks (the updates), as the streaming protocol
//! shapes them.
//!
//! - One assistant message per response: every model step of a submission folds into the
//!   submission's first step's message id; a step's text part comes before its tool parts.
//! - A step's reasoning and text (its completion's, or streamed as appended:
//!   `assistant_reasoning_delta`, `assistant_text_delta`) are a `reasoning` part and a `text`
//!   part, in that order, before its tool parts; whatever did not stream streams before the
//!   step's first tool input. Streamed ones are `streaming` until the completion closes them
//!   (reasoning once the text starts). A step that never completes (an attempt that died, a call
//!   retried) leaves text the conversation does not hold: the response's next step, or a
//!   completion that does not continue what streamed, removes or corrects it, and that batch
//!   projects to a reset (a client may have shown it). A settlement closes a streaming part
//!   as it is (an aborted answer keeps what it showed), with a `message-completed` first.
//! - Tool outputs appear only when their batch commits (`tool_results_committed`), never from
//!   an outcome alone. A call's `output` is the JSON value its tool answered, as the reference
//!   serves it, or else the text the model read (a text result, an older record, a result a
//!   hook rewrote or an edit of its row replaced).
//! - A compaction appends a system message (`purpose: advisory`, `display: diagnostic`, a
//!   `conversation-summary` signal with its reason) holding the summary: clients keep the
//!   whole transcript, and the summary marks where the model's context now starts. Nothing
//!   else changes (a step streaming when an overflow compaction came stays streaming).
//! - A batch holding the instance's birth record, a compaction, or a row's edit or deletion
//!   projects to one `conversation-reset` (the protocol has no chunk that changes a past
//!   message).
//! - Chunks carry the conversation id and their position: the batch's offset and their index
//!   within that batch's projection.
//! - A settlement's error whose text is the application's own or that the reference raises
//!   untyped (a callback's, a render's, a model's resolution, the finish ceiling, a sandbox
//!   factory's, a lifecycle hook's panic: [`SettlementError::is_internal`]) is served
//!   as the reference's generic `internal_error` (§6.4); the records and the server's log keep
//!   it.
//!
//! [`SettlementError::is_internal`]: crate::record::SettlementError::is_internal

use std::collections::{HashMap, HashSet};

use serde_json::{Map, Value, json};

use crate::record::{Batch, Record, RecordBody, format_offset};
use crate::store::{InstanceKey, Store, StoreError};

/// How many batches a fold or a catching-up reader reads from the store at a time: it holds
/// one page, never the whole stream (reference §4.3: store reads are paged).
pub(crate) const READ_PAGE: usize = 256;

/// The wire-only first element of every updates read.
pub(crate) fn checkpoint(incarnation: &str) -> Value {
    json!({"type": "stream-checkpoint", "incarnation": incarnation})
}

/// What a model step streams, each into one part of its response message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Stream {
    Reasoning,
    Text,
}

impl Stream {
    /// The part's type and the `message-delta` chunk's kind.
    fn name(self) -> &'static str {
        match self {
            Self::Reasoning => "reasoning",
            Self::Text => "text",
        }
    }

    /// A `message-delta` chunk.
    fn delta(self, message_id: &str, delta: &str) -> Value {
        json!({"type": "message-delta", "messageId": message_id, "kind": self.name(), "delta": delta})
    }
}

/// A tool outcome waiting for its batch's commit.
#[derive(Clone)]
struct PendingOutcome {
    is_error: bool,
    content: String,
    /// The value the tool answered, served as `output` in place of `content`.
    output: Option<Value>,
    duration_ms: u64,
    timestamp: String,
}

impl PendingOutcome {
    /// What clients get as the call's `output`: the value the tool answered, else the text.
    fn served(&self) -> Value {
        self.output
            .clone()
            .unwrap_or_else(|| Value::String(self.content.clone()))
    }
}

/// The fold of one conversation's records.
#[derive(Clone, Default)]
pub(crate) struct Projection {
    conversation_id: String,
    incarnation: String,
    messages: Vec<Value>,
    /// Message id → index in `messages`.
    index: HashMap<String, usize>,
    settlements: Vec<Value>,
    /// Submission → its response's message id (its first step's).
    responses: HashMap<String, String>,
    /// Step message id → the response message it folds into.
    steps: HashMap<String, String>,
    /// Step message id → the index of its first part in the response message (kept current as
    /// parts of other steps come and go).
    step_parts: HashMap<String, usize>,
    /// Response message id → its steps, in the order they started.
    response_steps: HashMap<String, Vec<String>>,
    /// Step message id → its tool call ids, in call order.
    step_calls: HashMap<String, Vec<String>>,
    /// Tool call id → the response message holding its part.
    calls: HashMap<String, String>,
    /// Tool row id (its outcome record's) → its call id: a row edit or deletion reaches the
    /// call's part.
    tool_rows: HashMap<String, (String, String)>,
    outcomes: HashMap<String, PendingOutcome>,
    /// Data parts written before their response's first step (a start callback's writes),
    /// by submission: they join the response message when it starts.
    early_data: HashMap<String, Vec<(String, Value)>>,
    /// (Step message id, stream) → what the step streamed, while it has not completed.
    streamed: HashMap<(String, Stream), String>,
    /// Steps whose parts start with a reasoning part.
    reasoned: HashSet<String>,
    /// Steps that have a text part.
    texted: HashSet<String>,
    /// Steps whose rows are silent: a response is hidden while every step of it is.
    silent_steps: HashSet<String>,
    /// Steps that completed (and were not deleted): with the newest, the steps whose silence
    /// counts (one a dead attempt left unfinished does not).
    completed_steps: HashSet<String>,
    /// Messages shown other than as visible when not silent (signals, summaries), by id: what
    /// an update that makes them not silent shows them as again.
    classified: HashMap<String, &'static str>,
    /// Whether the batch being folded changed a message already shown (it projects to a
    /// reset).
    rewritten: bool,
    offset: Option<u64>,
    /// Roughly the bytes the fold holds (see [`Projection::weight`]).
    weight: usize,
}

/// Roughly the bytes folding `body` adds to a projection: what the runtime's conversation
/// keeps of it, and the streamed text and data parts the view shows besides.
fn projected_weight(body: &RecordBody) -> usize {
    use crate::json_shape::{NODE_WEIGHT, parsed_weight};
    use crate::session::conversation::{RECORD_WEIGHT, record_weight};
    let shown = match body {
        RecordBody::AssistantTextDelta { delta, .. } | RecordBody::AssistantReasoningDelta { delta, .. } => delta.len(),
        RecordBody::MessageDataWrite { name, data } => NODE_WEIGHT + name.len() + parsed_weight(data),
        RecordBody::MessageMetadata { metadata } => metadata
            .iter()
            .map(|(key, value)| NODE_WEIGHT + key.len() + parsed_weight(value))
            .sum(),
        // The value a tool answered, held beside its text.
        RecordBody::ToolOutcome {
            output: Some(output), ..
        } => parsed_weight(output),
        _ => 0,
    };
    record_weight(body).max(RECORD_WEIGHT) + shown
}

/// Roughly the bytes folding `batch` adds to a projection (what a reader holding it unfolded
/// is counted for).
pub(crate) fn batch_weight(batch: &crate::record::Batch) -> usize {
    batch.records.iter().map(|record| projected_weight(&record.body)).sum()
}

impl Projection {
    /// An empty fold of the conversation `conversation_id`.
    pub(crate) fn new(conversation_id: &str) -> Self {
        Self {
            conversation_id: conversation_id.to_owned(),
            ..Self::default()
        }
    }

    /// Folds the stream `key`'s batches after those folded already, through the batch at
    /// `through` (`u64::MAX`: all there is), reading [`READ_PAGE`] batches at a time (a fold
    /// of a long stream never holds it whole) and asking `room` after each page whether the
    /// fold may hold its weight: when not, the fold stops there (a reader refused for want of
    /// room has folded a page at most, however long the stream). The offset of the last batch
    /// folded, and whether the fold got through.
    pub(crate) async fn fold_stream_within(
        &mut self,
        store: &dyn Store,
        key: &InstanceKey,
        through: u64,
        mut room: impl FnMut(usize) -> bool + Send,
    ) -> Result<(Option<u64>, bool), StoreError> {
        while self.offset.is_none_or(|offset| offset < through) {
            let page = store.read_page(key, self.offset, READ_PAGE).await?;
            let folding = page.iter().take_while(|batch| batch.offset <= through);
            let mut folded = false;
            for batch in folding {
                self.apply(batch, None);
                folded = true;
            }
            if !room(self.weight) {
                return Ok((self.offset, false));
            }
            // A short page is the stream's end; a page past `through` from its first batch (a
            // store whose offsets skip `through`) would be read again for ever.
            if page.len() < READ_PAGE || !folded {
                break;
            }
        }
        Ok((self.offset, true))
    }

    /// Roughly the bytes the fold holds: every record folded counts what it added (an edit or a
    /// deletion too: the count only grows, as the fold's history of a conversation does).
    pub(crate) fn weight(&self) -> usize {
        self.weight
    }

    /// The offset of the last batch folded, in wire format (`-1` before the first).
    pub(crate) fn offset(&self) -> String {
        self.offset.map_or_else(|| "-1".to_owned(), format_offset)
    }

    /// The history snapshot.
    pub(crate) fn snapshot(&self) -> Value {
        json!({
            "v": 1,
            "conversationId": self.conversation_id,
            "offset": self.offset(),
            "incarnation": self.incarnation,
            "messages": self.messages,
            "settlements": self.settlements,
        })
    }

    /// Folds `batch` in, appending its chunks to `chunks` when given.
    pub(crate) fn apply(&mut self, batch: &Batch, chunks: Option<&mut Vec<Value>>) {
        // A batch that rewrites history (a row's text or display edited, a row deleted)
        // projects to a reset too: the protocol has no chunk that changes a past message's
        // parts. A row's metadata goes as a `message-metadata` chunk; its status and name are
        // not shown.
        // A tool row's create hooks' updates go in the batch of its outcome (appended as its
        // tool ends): its creation, not an edit of history.
        let created: HashSet<&str> = batch
            .records
            .iter()
            .filter(|record| matches!(record.body, RecordBody::ToolOutcome { .. }))
            .map(|record| record.id.as_str())
            .collect();
        let resets = batch.records.iter().any(|record| match &record.body {
            RecordBody::ConversationCreated { .. }
            | RecordBody::MessageDeleted { .. }
            | RecordBody::Compaction { .. } => true,
            RecordBody::MessageUpdated { message_id, updates } => {
                !created.contains(message_id.as_str())
                    && (updates.contains_key("content") || updates.contains_key("silent"))
            }
            _ => false,
        });
        let mut out = Vec::new();
        // A step's reasoning and text stream right after its start when both are in this
        // batch: its completion's, by step.
        let mut finals: HashMap<&str, (&str, &str)> = HashMap::new();
        // Steps that start in this batch.
        let mut starts: HashSet<&str> = HashSet::new();
        // A joined delivery settles under its host's attempt, in the host's settlement batch.
        let mut hosts: HashMap<&str, &str> = HashMap::new();
        for record in batch.records.iter() {
            match &record.body {
                RecordBody::AssistantMessageCompleted {
                    message_id,
                    text,
                    reasoning,
                    ..
                } => {
                    finals.insert(message_id, (reasoning, text));
                }
                RecordBody::AssistantMessageStarted { message_id, .. } => {
                    starts.insert(message_id);
                }
                RecordBody::SubmissionSettled { .. } => {
                    if let (Some(attempt), Some(submission)) = (&record.attempt_id, &record.submission_id) {
                        hosts.insert(attempt, submission);
                    }
                }
                _ => {}
            }
        }
        self.rewritten = false;
        for record in batch.records.iter() {
            self.weight += projected_weight(&record.body);
            self.record(record, (&mut finals, &starts), &hosts, &mut out);
        }
        self.offset = Some(batch.offset);
        let Some(chunks) = chunks else { return };
        if resets || self.rewritten {
            out = vec![json!({"type": "conversation-reset", "snapshot": self.snapshot()})];
        }
        for (index, mut chunk) in out.into_iter().enumerate() {
            if let Value::Object(fields) = &mut chunk {
                fields.insert("conversationId".into(), json!(self.conversation_id));
                fields.insert("position".into(), json!({"batch": batch.offset, "index": index}));
            }
            chunks.push(chunk);
        }
    }

    fn record(
        &mut self,
        record: &Record,
        (finals, starts): (&mut HashMap<&str, (&str, &str)>, &HashSet<&str>),
        hosts: &HashMap<&str, &str>,
        out: &mut Vec<Value>,
    ) {
        let submission = record.submission_id.as_deref();
        let timestamp = &*record.timestamp;
        match &record.body {
            RecordBody::ConversationCreated { uid, .. } => {
                let conversation_id = std::mem::take(&mut self.conversation_id);
                *self = Self::new(&conversation_id);
                self.incarnation.clone_from(uid);
            }
            RecordBody::UserMessage {
                message_id,
                body,
                attachments,
            } => {
                let mut parts = vec![json!({"type": "text", "text": body, "state": "done"})];
                parts.extend(attachments.iter().map(|attachment| {
                    let mut part = json!({
                        "type": "file",
                        "mediaType": attachment.media_type,
                        "id": attachment.id,
                        "size": attachment.size,
                    });
                    if let Some(filename) = &attachment.filename {
                        part["filename"] = json!(filename);
                    }
                    part
                }));
                let mut message = json!({
                    "id": message_id,
                    "role": "user",
                    "purpose": "user",
                    "display": "visible",
                    "parts": parts,
                });
                if let Some(submission) = submission {
                    message["submissionId"] = json!(submission);
                }
                self.append_message(message, out);
            }
            RecordBody::Signal {
                message_id,
                signal_type,
                body,
                attributes,
                tag_name,
            } => {
                // Every signal is a system message; its type stays off the wire (the purpose
                // and display say what a client needs), and `signal` holds only its tag name
                // and attributes, when it has either (reference §4.6).
                let (purpose, display, settlement) = match signal_type.as_str() {
                    "stream_interrupted" | "stream_continued" => ("advisory", "hidden", None),
                    "submission_aborted" => ("advisory", "diagnostic", Some("aborted")),
                    "submission_interrupted" => ("advisory", "diagnostic", Some("failed")),
                    "resources" | "instructions" | "environment" => ("advisory", "diagnostic", None),
                    _ => ("dispatch", "diagnostic", None),
                };
                let mut message = json!({
                    "id": message_id,
                    "role": "system",
                    "purpose": purpose,
                    "display": display,
                    "parts": [{"type": "text", "text": body, "state": "done"}],
                });
                self.classified.insert(message_id.clone(), display);
                let mut signal = Map::new();
                if let Some(tag_name) = tag_name {
                    signal.insert("tagName".into(), json!(tag_name));
                }
                if !attributes.is_empty() {
                    signal.insert("attributes".into(), json!(attributes));
                }
                if !signal.is_empty() {
                    message["signal"] = Value::Object(signal);
                }
                if let Some(submission) = submission {
                    message["submissionId"] = json!(submission);
                }
                if let Some(outcome) = settlement {
                    message["settlement"] = json!({"outcome": outcome});
                }
                self.append_message(message, out);
            }
            RecordBody::AssistantMessageStarted {
                message_id,
                response_metadata,
                turn_id,
                ..
            } => {
                // The model call's turn, as the observation events name it (older records
                // have none: the step's id stands in).
                let turn_id = turn_id.as_deref().unwrap_or(message_id);
                let response_id = match submission.and_then(|s| self.responses.get(s)) {
                    Some(response_id) => response_id.clone(),
                    None => {
                        let mut message = json!({
                            "id": message_id,
                            "role": "assistant",
                            "purpose": "assistant",
                            "display": "visible",
                            "turnId": turn_id,
                            "parts": [],
                        });
                        if let Some(submission) = submission {
                            message["submissionId"] = json!(submission);
                            self.responses.insert(submission.to_owned(), message_id.clone());
                        }
                        self.index.insert(message_id.clone(), self.messages.len());
                        self.messages.push(message);
                        message_id.clone()
                    }
                };
                self.drop_interrupted_steps(&response_id);
                self.steps.insert(message_id.clone(), response_id.clone());
                let order = self.response_steps.entry(response_id.clone()).or_default();
                // A step started again (a retried call) is the latest again.
                order.retain(|step| step != message_id);
                order.push(message_id.clone());
                // Not silent (yet): a response every earlier step of which was is shown again.
                self.silent_steps.remove(message_id.as_str());
                self.show_response(&response_id);
                let parts = self.parts_len(&response_id);
                self.step_parts.insert(message_id.clone(), parts);
                let mut chunk = json!({
                    "type": "message-started",
                    "messageId": response_id,
                    "turnId": turn_id,
                    "timestamp": timestamp,
                });
                if let Some(submission) = submission {
                    chunk["submissionId"] = json!(submission);
                }
                if let Some(metadata) = response_metadata.as_ref().filter(|m| !m.is_empty()) {
                    self.merge_metadata(&response_id, metadata);
                    chunk["metadata"] = json!(metadata);
                }
                out.push(chunk);
                for (name, data) in submission.and_then(|s| self.early_data.remove(s)).unwrap_or_default() {
                    self.set_data_part(&response_id, &name, &data);
                    out.push(json!({"type": "data-part", "messageId": response_id, "name": name, "data": data}));
                }
                if let Some((reasoning, text)) = finals.get(message_id.as_str()) {
                    for (stream, streamed) in [(Stream::Reasoning, reasoning), (Stream::Text, text)] {
                        if !streamed.is_empty() {
                            out.push(stream.delta(&response_id, streamed));
                        }
                    }
                }
            }
            RecordBody::AssistantToolCall {
                message_id,
                tool_call_id,
                name,
                arguments,
            } => {
                let Some(response_id) = self.steps.get(message_id).cloned() else {
                    return;
                };
                // The step's reasoning and text come before its tool parts, on the wire too:
                // what did not stream yet streams before its first tool input.
                if let Some((reasoning, text)) = finals.remove(message_id.as_str()) {
                    let shown = starts.contains(message_id.as_str());
                    self.complete_part(&response_id, message_id, Stream::Reasoning, reasoning, shown, out);
                    self.complete_part(&response_id, message_id, Stream::Text, text, shown, out);
                }
                let input = serde_json::from_str::<Value>(arguments).unwrap_or_else(|_| json!(arguments));
                self.push_part(
                    &response_id,
                    json!({
                        "type": "dynamic-tool",
                        "toolCallId": tool_call_id,
                        "toolName": name,
                        "state": "input-available",
                        "input": input,
                    }),
                );
                self.calls.insert(tool_call_id.clone(), response_id.clone());
                self.step_calls
                    .entry(message_id.clone())
                    .or_default()
                    .push(tool_call_id.clone());
                out.push(json!({
                    "type": "tool-input",
                    "messageId": response_id,
                    "toolCallId": tool_call_id,
                    "toolName": name,
                    "input": input,
                    "timestamp": timestamp,
                }));
            }
            RecordBody::AssistantReasoningDelta { message_id, delta } => {
                self.stream_delta(message_id, Stream::Reasoning, delta, out);
            }
            RecordBody::AssistantTextDelta { message_id, delta } => {
                self.stream_delta(message_id, Stream::Text, delta, out);
            }
            RecordBody::AssistantMessageCompleted { message_id, .. } => {
                let Some(response_id) = self.steps.get(message_id).cloned() else {
                    return;
                };
                self.completed_steps.insert(message_id.clone());
                // Unless its first tool call closed them already.
                if let Some((reasoning, text)) = finals.remove(message_id.as_str()) {
                    // Streamed right after its start already when that is in this batch.
                    let shown = starts.contains(message_id.as_str());
                    self.complete_part(&response_id, message_id, Stream::Reasoning, reasoning, shown, out);
                    self.complete_part(&response_id, message_id, Stream::Text, text, shown, out);
                }
                out.push(json!({"type": "message-completed", "messageId": response_id, "timestamp": timestamp}));
            }
            RecordBody::ToolOutcome {
                assistant_message_id,
                tool_call_id,
                is_error,
                content,
                output,
                duration_ms,
                ..
            } => {
                // A call's first outcome stands (its batch is settled with it), as the
                // conversation reads it: a later one (before or after the commit) is no row of
                // the view, and the edits of its row change nothing shown.
                let settled = self.tool_part_mut(tool_call_id, Some(assistant_message_id)).is_some_and(|part| {
                    part["state"]
                        .as_str()
                        .is_some_and(|state| state.starts_with("output-"))
                });
                if !settled && !self.outcomes.contains_key(tool_call_id) {
                    self.tool_rows
                        .insert(record.id.clone(), (tool_call_id.clone(), assistant_message_id.clone()));
                    self.outcomes.insert(
                        tool_call_id.clone(),
                        PendingOutcome {
                            is_error: *is_error,
                            content: content.clone(),
                            output: output.clone().filter(|_| !*is_error),
                            duration_ms: *duration_ms,
                            timestamp: timestamp.to_owned(),
                        },
                    );
                }
            }
            RecordBody::ToolResultsCommitted { assistant_message_id } => {
                let calls = self.step_calls.get(assistant_message_id).cloned().unwrap_or_default();
                for call in calls {
                    let Some(outcome) = self.outcomes.remove(&call) else {
                        continue;
                    };
                    let chunk = if outcome.is_error {
                        json!({
                            "type": "tool-output-error",
                            "toolCallId": call,
                            "errorText": outcome.content,
                            "durationMs": outcome.duration_ms,
                            "timestamp": outcome.timestamp,
                        })
                    } else {
                        json!({
                            "type": "tool-output",
                            "toolCallId": call,
                            "output": outcome.served(),
                            "durationMs": outcome.duration_ms,
                            "timestamp": outcome.timestamp,
                        })
                    };
                    self.settle_tool_part(&call, assistant_message_id, &outcome);
                    out.push(chunk);
                }
            }
            RecordBody::MessageDataWrite { name, data } => {
                let Some(submission) = submission else { return };
                let Some(response_id) = self.responses.get(submission).cloned() else {
                    self.early_data
                        .entry(submission.to_owned())
                        .or_default()
                        .push((name.clone(), data.clone()));
                    return;
                };
                self.set_data_part(&response_id, name, data);
                out.push(json!({"type": "data-part", "messageId": response_id, "name": name, "data": data}));
            }
            RecordBody::MessageMetadata { metadata } => {
                // An empty one only marks a finish batch durable: nothing for a client.
                if metadata.is_empty() {
                    return;
                }
                let Some(response_id) = submission.and_then(|s| self.responses.get(s)).cloned() else {
                    return;
                };
                self.merge_metadata(&response_id, metadata);
                // As merged: a client merges a `null` member as a value, where the merge skips it
                // (an object of `null`s still makes the response's metadata, `{}`, as here).
                let applied = flue_core::metadata::applied_part(metadata);
                out.push(json!({"type": "message-metadata", "messageId": response_id, "metadata": applied}));
            }
            RecordBody::SubmissionSettled { outcome, error } => {
                let Some(submission) = submission else { return };
                if let Some(response_id) = self.responses.get(submission).cloned()
                    && self.close_streaming_steps(&response_id)
                {
                    // A client closes a message's streaming parts at its completion.
                    out.push(json!({"type": "message-completed", "messageId": response_id, "timestamp": timestamp}));
                }
                let mut settlement = json!({"submissionId": submission, "outcome": outcome});
                if let Some(error) = error {
                    // The application's own error text stays on the server (reference §6.4).
                    settlement["error"] = json!(error.for_clients());
                }
                if let Some(host) = record.attempt_id.as_deref().and_then(|attempt| hosts.get(attempt))
                    && *host != submission
                {
                    settlement["answeredBySubmissionId"] = json!(host);
                }
                let mut chunk = settlement.clone();
                if let Value::Object(fields) = &mut chunk {
                    fields.insert("type".into(), json!("submission-settled"));
                    fields.insert("timestamp".into(), json!(timestamp));
                }
                self.settlements.push(settlement);
                out.push(chunk);
            }
            RecordBody::MessageInjected {
                message_id,
                role,
                content,
                silent,
                metadata,
            } => {
                let (role, purpose) = match role {
                    flue_core::lifecycle::MessageRole::Assistant => ("assistant", "assistant"),
                    flue_core::lifecycle::MessageRole::System => ("system", "advisory"),
                    _ => ("user", "user"),
                };
                let mut message = json!({
                    "id": message_id,
                    "role": role,
                    "purpose": purpose,
                    "display": if *silent { "hidden" } else { "visible" },
                    "parts": [{"type": "text", "text": content, "state": "done"}],
                });
                if !metadata.is_empty() {
                    message["metadata"] = json!(metadata);
                }
                self.append_message(message, out);
            }
            RecordBody::MessageUpdated { message_id, updates } => {
                // A client merges the chunk into the message's metadata, making it when there is
                // none: a replacement left with nothing (`{}`, or only `null` members) on a row
                // that had none sends none, as the snapshot then has none either.
                if let Some(shown) = self.update_message(message_id, updates)
                    && let Some(Value::Object(metadata)) = updates.get("metadata")
                    && self
                        .message_mut(&shown)
                        .is_some_and(|message| message.contains_key("metadata"))
                {
                    // As merged: a client merges a `null` member as a value, where the merge
                    // skips it.
                    let applied = flue_core::metadata::applied_part(metadata);
                    out.push(json!({"type": "message-metadata", "messageId": shown, "metadata": applied}));
                }
            }
            RecordBody::MessageDeleted { message_id } => {
                if let Some((call, step)) = self.tool_call_of_row(message_id) {
                    // A tool row: its result goes from the view with the call it answers, as
                    // the model no longer sees the call without it.
                    self.remove_tool_part(&call, step.as_deref());
                } else if let Some(response_id) = self.steps.get(message_id).cloned() {
                    // A model step folded into its response message (the first one's id is the
                    // message's): its text and reasoning go, the other steps' parts stay.
                    self.remove_step_part(&response_id, message_id, Stream::Text);
                    self.remove_step_part(&response_id, message_id, Stream::Reasoning);
                    self.completed_steps.remove(message_id.as_str());
                    self.show_response(&response_id);
                } else if let Some(index) = self.index.remove(message_id.as_str()) {
                    self.messages.remove(index);
                    for at in self.index.values_mut() {
                        if *at > index {
                            *at -= 1;
                        }
                    }
                }
            }
            RecordBody::StateWrite { .. }
            | RecordBody::AgentStartRun
            | RecordBody::AgentFinishCycle
            | RecordBody::ThreadValueSet { .. }
            | RecordBody::ThreadCreatedHooksRan
            | RecordBody::ToolStepSettled { .. }
            // A child's conversation is its own stream: its link projects to nothing (reference
            // §4: records of task children never project).
            | RecordBody::ChildSessionRetained { .. }
            | RecordBody::ResourceSnapshot { .. } => {}
            RecordBody::Compaction { summary, reason, .. } => {
                // Clients keep the whole transcript; the summary marks where the model's
                // context now starts.
                let message = json!({
                    "id": record.id,
                    "role": "system",
                    "purpose": "advisory",
                    "display": "diagnostic",
                    "signal": {"tagName": "conversation-summary", "attributes": {"reason": reason}},
                    "parts": [{"type": "text", "text": summary, "state": "done"}],
                });
                self.classified.insert(record.id.clone(), "diagnostic");
                self.append_message(message, out);
            }
        }
    }

    /// Applies a row's field updates to the message that shows it: content to its text part,
    /// `silent` to its display, metadata merged into a step's response, or replacing another
    /// row's.
    /// Returns the id of the message that shows the row (a step's: its response's), unless
    /// the row is a tool result or not shown.
    fn update_message(&mut self, id: &str, updates: &Map<String, Value>) -> Option<String> {
        if let Some((call, step)) = self.tool_call_of_row(id) {
            // A tool row's content is its call's output (or error text): an edit redacting
            // it reaches the view (and an outcome its batch has not committed yet, which the
            // view shows once it does).
            if let Some(Value::String(content)) = updates.get("content")
                && let Some(pending) = self.outcomes.get_mut(&call)
            {
                // The edited text stands for the value too (a redaction must reach both).
                pending.content.clone_from(content);
                pending.output = None;
            } else if let Some(Value::String(content)) = updates.get("content")
                && let Some(part) = self.tool_part_mut(&call, step.as_deref())
            {
                let field = if part["state"] == "output-error" {
                    "errorText"
                } else {
                    "output"
                };
                part[field] = json!(content);
            }
            return None;
        }
        let message_id = self.steps.get(id).cloned();
        let is_step = message_id.is_some();
        let message_id = message_id.unwrap_or_else(|| id.to_owned());
        if let Some(Value::String(content)) = updates.get("content") {
            let part = if is_step {
                self.step_part(&message_id, id, Stream::Text)
            } else {
                self.parts_mut(&message_id)
                    .and_then(|parts| parts.get_mut(0))
                    .filter(|part| part["type"] == "text")
            };
            if let Some(part) = part {
                part["text"] = json!(content);
            }
        }
        if let Some(Value::Bool(silent)) = updates.get("silent") {
            if is_step {
                // A step's row: the response is hidden only while all its steps are silent.
                if *silent {
                    self.silent_steps.insert(id.to_owned());
                } else {
                    self.silent_steps.remove(id);
                }
                self.show_response(&message_id);
            } else {
                let shown = self.classified.get(id).copied().unwrap_or("visible");
                let display = if *silent { "hidden" } else { shown };
                self.message_mut(&message_id)?.insert("display".into(), json!(display));
            }
        }
        let message = self.message_mut(&message_id)?;
        match updates.get("metadata") {
            // A step's metadata merges with its response's (and the other steps'), as a client
            // merges the `message-metadata` chunk that carries it.
            Some(Value::Object(metadata)) if is_step => self.merge_metadata(&message_id, metadata),
            // Any other row's is replaced, as the row's is (`null`: cleared). The chunk only
            // merges, so a replacement that takes something away resets the view.
            Some(value @ (Value::Object(_) | Value::Null)) if !is_step => {
                let mut replaced = Map::new();
                if let Value::Object(metadata) = value {
                    flue_core::metadata::merge_metadata(&mut replaced, metadata.clone());
                }
                let current = message
                    .get("metadata")
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default();
                let mut merged = current;
                flue_core::metadata::merge_metadata(&mut merged, replaced.clone());
                let takes_away = merged != replaced;
                if replaced.is_empty() {
                    message.remove("metadata");
                } else {
                    message.insert("metadata".into(), Value::Object(replaced));
                }
                self.rewritten |= takes_away;
            }
            _ => {}
        }
        Some(message_id)
    }

    /// Where `step`'s part of `stream` is (or goes) in its response message: its reasoning
    /// first, then its text.
    fn part_index(&self, step: &str, stream: Stream) -> usize {
        let at = self.step_parts.get(step).copied().unwrap_or(0);
        match stream {
            Stream::Reasoning => at,
            Stream::Text => at + usize::from(self.reasoned.contains(step)),
        }
    }

    /// Sets the response message's display from its steps' silence: hidden while every step of
    /// it that counts (completed and not deleted, or the newest, in progress) is silent. A
    /// change of a message already shown resets the view.
    fn show_response(&mut self, response_id: &str) {
        let hidden = self.response_steps.get(response_id).is_some_and(|steps| {
            let newest = steps.last();
            let mut counted = steps
                .iter()
                .filter(|step| self.completed_steps.contains(*step) || Some(*step) == newest)
                .peekable();
            counted.peek().is_some() && counted.all(|step| self.silent_steps.contains(step))
        });
        let display = if hidden { "hidden" } else { "visible" };
        let Some(message) = self.message_mut(response_id) else {
            return;
        };
        if message.get("display").and_then(Value::as_str) != Some(display) {
            message.insert("display".into(), json!(display));
            self.rewritten = true;
        }
    }

    /// `step`'s part of `stream` in `response_id`, if it has one.
    fn step_part(&mut self, response_id: &str, step: &str, stream: Stream) -> Option<&mut Value> {
        let has = match stream {
            Stream::Reasoning => self.reasoned.contains(step),
            Stream::Text => self.texted.contains(step),
        };
        if !has {
            return None;
        }
        let at = self.part_index(step, stream);
        self.parts_mut(response_id)?
            .get_mut(at)
            .filter(|part| part["type"] == stream.name())
    }

    fn add_step_part(&mut self, response_id: &str, step: &str, stream: Stream, text: &str, state: &str) {
        let at = self.part_index(step, stream);
        // A part that lands before others (a data write appended while the step streamed
        // comes after the step's parts): a client appending it would show it after them, so
        // the batch projects to a reset.
        if self.parts_mut(response_id).is_some_and(|parts| at < parts.len()) {
            self.rewritten = true;
        }
        self.insert_part(
            response_id,
            at,
            json!({"type": stream.name(), "text": text, "state": state}),
        );
        self.shift_steps(response_id, step, at, true);
        match stream {
            Stream::Reasoning => self.reasoned.insert(step.to_owned()),
            Stream::Text => self.texted.insert(step.to_owned()),
        };
    }

    fn remove_step_part(&mut self, response_id: &str, step: &str, stream: Stream) {
        let at = self.part_index(step, stream);
        if self.step_part(response_id, step, stream).is_some()
            && let Some(parts) = self.parts_mut(response_id)
        {
            parts.remove(at);
            self.shift_steps(response_id, step, at, false);
            match stream {
                Stream::Reasoning => self.reasoned.remove(step),
                Stream::Text => self.texted.remove(step),
            };
        }
    }

    /// A part of `step` was inserted at (`inserted`) or removed from `at` of `response_id`:
    /// the steps whose parts follow it move with them.
    fn shift_steps(&mut self, response_id: &str, step: &str, at: usize, inserted: bool) {
        let Some(order) = self.response_steps.get(response_id) else {
            return;
        };
        let mine = order.iter().position(|other| other == step);
        for (position, other) in order.iter().enumerate() {
            if other == step {
                continue;
            }
            let Some(start) = self.step_parts.get_mut(other) else {
                continue;
            };
            if inserted {
                // A later step that has no part yet starts where this one's part went.
                if *start > at || (*start == at && mine.is_some_and(|mine| position > mine)) {
                    *start += 1;
                }
            } else if *start > at {
                *start -= 1;
            }
        }
    }

    /// Whether `step`'s part of `stream` is the last part of `response_id`: the one part a
    /// client extends with a delta (the protocol's reducer extends the message's last part
    /// when it streams that kind, and otherwise opens a new part).
    fn is_last_part(&mut self, response_id: &str, step: &str, stream: Stream) -> bool {
        let at = self.part_index(step, stream);
        self.parts_len(response_id) == at + 1
    }

    /// A delta `step` streamed: into its streaming part (made by the first).
    fn stream_delta(&mut self, step: &str, stream: Stream, delta: &str, out: &mut Vec<Value>) {
        let Some(response_id) = self.steps.get(step).cloned() else {
            return;
        };
        // A part that is no longer the message's last (reasoning the snapshot keeps before the
        // step's text, or a part a data write was appended after): a client would open a new
        // part with the delta at the end, so the batch projects to a reset.
        if self.step_part(&response_id, step, stream).is_some() && !self.is_last_part(&response_id, step, stream) {
            self.rewritten = true;
        }
        let key = (step.to_owned(), stream);
        let streamed = self.streamed.entry(key.clone()).or_default();
        let first = streamed.is_empty();
        streamed.push_str(delta);
        let streamed_len = streamed.len();
        if first {
            let text = streamed.clone();
            self.add_step_part(&response_id, step, stream, &text, "streaming");
        } else if let Some(part) = self.step_part(&response_id, step, stream) {
            // The part holds what streamed before this delta: the delta extends it in place
            // (a copy of the whole text per delta made a step of many deltas quadratic).
            part["state"] = json!("streaming");
            let extended = match &mut part["text"] {
                Value::String(text) if text.len() + delta.len() == streamed_len => {
                    text.push_str(delta);
                    true
                }
                _ => false,
            };
            if !extended {
                let text = self.streamed.get(&key).cloned().unwrap_or_default();
                if let Some(part) = self.step_part(&response_id, step, stream) {
                    part["text"] = json!(text);
                }
            }
        }
        if stream == Stream::Text
            && let Some(reasoning) = self.step_part(&response_id, step, Stream::Reasoning)
            && reasoning["state"] == "streaming"
        {
            // The model moved on to its answer. A client closes the reasoning part with the
            // text's delta only while it is the message's last part (before the text's part
            // exists): behind the text, only a reset closes it.
            reasoning["state"] = json!("done");
            if !first {
                self.rewritten = true;
            }
        }
        out.push(stream.delta(&response_id, delta));
    }

    /// `step` completed with `value` for `stream`: what it streamed is closed with the rest
    /// (corrected with a reset when it is not what streamed continued); otherwise the whole
    /// streams now, unless it was `shown` right after the step's start.
    fn complete_part(
        &mut self,
        response_id: &str,
        step: &str,
        stream: Stream,
        value: &str,
        shown: bool,
        out: &mut Vec<Value>,
    ) {
        let Some(streamed) = self.streamed.remove(&(step.to_owned(), stream)) else {
            if !value.is_empty() {
                // Reasoning that did not stream goes before text that did: a client that
                // appends it would show it after, so the batch projects to a reset.
                if stream == Stream::Reasoning && self.step_part(response_id, step, Stream::Text).is_some() {
                    self.rewritten = true;
                }
                self.add_step_part(response_id, step, stream, value, "done");
                if !shown {
                    out.push(stream.delta(response_id, value));
                }
            }
            return;
        };
        match value.strip_prefix(streamed.as_str()) {
            Some("") => {}
            // Reasoning closed when the text started: a client would start a new part with the
            // rest.
            Some(_) if stream == Stream::Reasoning && self.streamed.contains_key(&(step.to_owned(), Stream::Text)) => {
                self.rewritten = true;
            }
            // The rest extends the part only while it is the message's last (see
            // `stream_delta`).
            Some(_) if !self.is_last_part(response_id, step, stream) => self.rewritten = true,
            Some(rest) => out.push(stream.delta(response_id, rest)),
            // Not what streamed, continued (a retried call streamed after a failed one).
            None => self.rewritten = true,
        }
        if value.is_empty() {
            self.remove_step_part(response_id, step, stream);
        } else if let Some(part) = self.step_part(response_id, step, stream) {
            *part = json!({"type": stream.name(), "text": value, "state": "done"});
        }
    }

    /// What `response_id`'s steps are streaming and have not completed.
    fn streaming_parts(&self, response_id: &str) -> Vec<(String, Stream)> {
        let mut parts: Vec<(String, Stream)> = self
            .streamed
            .keys()
            .filter(|(step, _)| self.steps.get(step).is_some_and(|response| response == response_id))
            .cloned()
            .collect();
        // Text before reasoning: removing a part leaves the earlier ones where they are.
        parts.sort_by_key(|(step, stream)| (step.clone(), *stream == Stream::Reasoning));
        parts
    }

    /// A new step of `response_id` began: a step of it still streaming never completes (its
    /// attempt died), and what it streamed, which the conversation does not hold, goes.
    fn drop_interrupted_steps(&mut self, response_id: &str) {
        for (step, stream) in self.streaming_parts(response_id) {
            self.streamed.remove(&(step.clone(), stream));
            self.remove_step_part(response_id, &step, stream);
            self.rewritten = true;
        }
    }

    /// `response_id` settled: what its steps streamed stays, done. Whether anything was
    /// streaming.
    fn close_streaming_steps(&mut self, response_id: &str) -> bool {
        let streaming = self.streaming_parts(response_id);
        for (step, stream) in &streaming {
            self.streamed.remove(&(step.clone(), *stream));
            if let Some(part) = self.step_part(response_id, step, *stream) {
                part["state"] = json!("done");
            }
        }
        !streaming.is_empty()
    }

    fn append_message(&mut self, message: Value, out: &mut Vec<Value>) {
        if let Some(id) = message["id"].as_str() {
            self.index.insert(id.to_owned(), self.messages.len());
        }
        out.push(json!({"type": "message-appended", "message": message}));
        self.messages.push(message);
    }

    fn message_mut(&mut self, id: &str) -> Option<&mut Map<String, Value>> {
        let index = *self.index.get(id)?;
        self.messages.get_mut(index)?.as_object_mut()
    }

    fn parts_mut(&mut self, id: &str) -> Option<&mut Vec<Value>> {
        self.message_mut(id)?.get_mut("parts")?.as_array_mut()
    }

    fn parts_len(&mut self, id: &str) -> usize {
        self.parts_mut(id).map_or(0, |parts| parts.len())
    }

    fn push_part(&mut self, id: &str, part: Value) {
        if let Some(parts) = self.parts_mut(id) {
            parts.push(part);
        }
    }

    fn insert_part(&mut self, id: &str, at: usize, part: Value) {
        if let Some(parts) = self.parts_mut(id) {
            parts.insert(at.min(parts.len()), part);
        }
    }

    /// The call a tool row answers, and the step that made the call when known: rows are named
    /// by their outcome record, or `tool_<call>` for a result the runtime wrote itself (an
    /// interrupted call's).
    fn tool_call_of_row(&self, id: &str) -> Option<(String, Option<String>)> {
        match self.tool_rows.get(id) {
            Some((call, step)) => Some((call.clone(), Some(step.clone()))),
            None => id
                .strip_prefix("tool_")
                .filter(|call| self.calls.contains_key(*call))
                .map(|call| (call.to_owned(), None)),
        }
    }

    /// Where the part of the call `call` that the step `step` made is: its response message and
    /// its index there. A stream written before reused call ids were renamed (`CallIds`) may
    /// have several steps of a response calling one id: the step's own is the first part under
    /// that id from the step's first part on; without a step, the latest.
    fn tool_part_at(&mut self, call: &str, step: Option<&str>) -> Option<(String, usize)> {
        let response_id = step
            .and_then(|step| self.steps.get(step))
            .or_else(|| self.calls.get(call))
            .cloned()?;
        let start = step.and_then(|step| self.step_parts.get(step)).copied();
        let parts = self.parts_mut(&response_id)?;
        let at = match start {
            Some(start) => (start..parts.len()).find(|&at| parts[at]["toolCallId"] == call),
            None => parts.iter().rposition(|part| part["toolCallId"] == call),
        }?;
        Some((response_id, at))
    }

    /// The part of the call `call` the step `step` made (see [`Self::tool_part_at`]).
    fn tool_part_mut(&mut self, call: &str, step: Option<&str>) -> Option<&mut Value> {
        let (response_id, at) = self.tool_part_at(call, step)?;
        self.parts_mut(&response_id)?.get_mut(at)
    }

    /// Removes the part of the call `call` the step `step` made (the steps after it move up).
    fn remove_tool_part(&mut self, call: &str, step: Option<&str>) {
        // Without a step, the latest of the call's response that made it.
        let step = step.map(str::to_owned).or_else(|| {
            let response = self.calls.get(call);
            self.step_calls
                .iter()
                .filter(|(step, calls)| calls.iter().any(|other| other == call) && self.steps.get(*step) == response)
                .max_by_key(|(step, _)| self.step_parts.get(*step).copied())
                .map(|(step, _)| step.clone())
        });
        let Some((response_id, at)) = self.tool_part_at(call, step.as_deref()) else {
            return;
        };
        if let Some(parts) = self.parts_mut(&response_id) {
            parts.remove(at);
        }
        if let Some(step) = step {
            self.shift_steps(&response_id, &step, at, false);
        }
    }

    fn settle_tool_part(&mut self, call: &str, step: &str, outcome: &PendingOutcome) {
        let Some(part) = self.tool_part_mut(call, Some(step)) else {
            return;
        };
        if outcome.is_error {
            part["state"] = json!("output-error");
            part["errorText"] = json!(outcome.content);
        } else {
            part["state"] = json!("output-available");
            part["output"] = outcome.served();
        }
        part["durationMs"] = json!(outcome.duration_ms);
    }

    fn set_data_part(&mut self, id: &str, name: &str, data: &Value) {
        let part_type = format!("data-{name}");
        let Some(parts) = self.parts_mut(id) else { return };
        match parts.iter_mut().find(|part| part["type"] == part_type.as_str()) {
            Some(part) => part["data"] = data.clone(),
            None => parts.push(json!({"type": part_type, "data": data})),
        }
    }

    fn merge_metadata(&mut self, id: &str, metadata: &flue_core::metadata::Metadata) {
        let Some(message) = self.message_mut(id) else { return };
        let target = message.entry("metadata").or_insert_with(|| json!({}));
        if let Value::Object(target) = target {
            let mut merged = std::mem::take(target);
            flue_core::metadata::merge_metadata(&mut merged, metadata.clone());
            *target = merged;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use std::sync::Arc;

    use serde_json::{Value, json};

    use super::Projection;
    use crate::provider::StopReason;
    use crate::record::test_records::{record, started};
    use crate::record::{Batch, Outcome, Record, RecordBody};

    fn delta(step: &str, text: &str) -> RecordBody {
        RecordBody::AssistantTextDelta {
            message_id: step.into(),
            delta: text.into(),
        }
    }

    fn reasoning(step: &str, text: &str) -> RecordBody {
        RecordBody::AssistantReasoningDelta {
            message_id: step.into(),
            delta: text.into(),
        }
    }

    fn completed(step: &str, text: &str) -> RecordBody {
        RecordBody::AssistantMessageCompleted {
            message_id: step.into(),
            text: text.into(),
            reasoning: String::new(),
            stop_reason: StopReason::Stop,
            usage: Default::default(),
            reasoning_blocks: Vec::new(),
        }
    }

    /// Folds one batch per entry of `batches` (records of submission `sub_1`); the chunk types
    /// of each.
    fn fold(projection: &mut Projection, batches: Vec<Vec<RecordBody>>) -> Vec<Vec<String>> {
        batches
            .into_iter()
            .map(|bodies| {
                let records: Vec<Record> = bodies.into_iter().map(|body| record("sub_1", body)).collect();
                let batch = Batch {
                    offset: projection.offset.map_or(0, |last| last + 1),
                    records: Arc::from(records),
                };
                let mut chunks = Vec::new();
                projection.apply(&batch, Some(&mut chunks));
                chunks
                    .iter()
                    .map(|chunk| chunk["type"].as_str().unwrap().to_owned())
                    .collect()
            })
            .collect()
    }

    fn parts(projection: &Projection) -> Value {
        projection.snapshot()["messages"][0]["parts"].clone()
    }

    /// Reference §4.6 (`classifySignal`): each reserved signal type's purpose, display and
    /// settlement; any other signal is a dispatch. The message carries neither the type nor an
    /// empty `signal`.
    #[test]
    fn signals_are_classified_as_the_reference_classifies_them() {
        let cases = [
            ("stream_interrupted", "advisory", "hidden", None),
            ("stream_continued", "advisory", "hidden", None),
            ("submission_aborted", "advisory", "diagnostic", Some("aborted")),
            ("submission_interrupted", "advisory", "diagnostic", Some("failed")),
            ("resources", "advisory", "diagnostic", None),
            ("instructions", "advisory", "diagnostic", None),
            ("environment", "advisory", "diagnostic", None),
            ("compaction", "dispatch", "diagnostic", None),
            ("ticket_opened", "dispatch", "diagnostic", None),
        ];
        for (signal_type, purpose, display, settlement) in cases {
            let mut projection = Projection::new("agents/a/i");
            fold(
                &mut projection,
                vec![vec![RecordBody::Signal {
                    message_id: "m1".into(),
                    signal_type: signal_type.into(),
                    body: "said".into(),
                    attributes: Default::default(),
                    tag_name: None,
                }]],
            );
            let message = &projection.snapshot()["messages"][0];
            let mut expected = json!({
                "id": "m1",
                "role": "system",
                "purpose": purpose,
                "display": display,
                "parts": [{"type": "text", "text": "said", "state": "done"}],
                "submissionId": "sub_1",
            });
            if let Some(outcome) = settlement {
                expected["settlement"] = json!({"outcome": outcome});
            }
            assert_eq!(message, &expected, "{signal_type}");
        }
    }

    #[test]
    fn a_step_that_never_completed_loses_its_streamed_text_to_the_next_step_with_a_reset() {
        let mut projection = Projection::new("agents/a/i");
        let chunks = fold(
            &mut projection,
            vec![
                vec![started("step_1"), delta("step_1", "Hal")],
                vec![reasoning("step_1", "Hmm"), delta("step_1", "f an")],
            ],
        );
        assert_eq!(
            chunks,
            [vec!["message-started", "message-delta"], vec!["conversation-reset"]],
            "reasoning after the text goes before it in the snapshot: a client is reset to it"
        );
        assert_eq!(
            parts(&projection),
            json!([
                {"type": "reasoning", "text": "Hmm", "state": "done"},
                {"type": "text", "text": "Half an", "state": "streaming"},
            ]),
            "reasoning first, whichever streamed first; done once the text streams"
        );
        // The attempt died; the next one's step streams into the same response message.
        let chunks = fold(
            &mut projection,
            vec![
                vec![started("step_2"), delta("step_2", "Whole")],
                vec![completed("step_2", "Whole answer")],
            ],
        );
        assert_eq!(
            chunks,
            [vec!["conversation-reset"], vec!["message-delta", "message-completed"]]
        );
        assert_eq!(
            parts(&projection),
            json!([{"type": "text", "text": "Whole answer", "state": "done"}])
        );
    }

    #[test]
    fn an_empty_finish_metadata_record_projects_to_no_chunk() {
        let mut projection = Projection::new("agents/a/i");
        let stamped: flue_core::metadata::Metadata = serde_json::from_value(json!({"stamped": true})).unwrap();
        let chunks = fold(
            &mut projection,
            vec![
                vec![started("step_1"), completed("step_1", "Done")],
                vec![RecordBody::MessageMetadata {
                    metadata: Default::default(),
                }],
                vec![RecordBody::MessageMetadata { metadata: stamped }],
            ],
        );
        assert_eq!(
            chunks,
            [
                vec!["message-started", "message-delta", "message-completed"],
                vec![],
                vec!["message-metadata"]
            ]
        );
    }

    /// A projection of a step that called `lookup` (`call_1`), and that call's outcome record,
    /// not folded yet.
    fn a_step_calling_lookup() -> (Projection, Record) {
        let mut projection = Projection::new("agents/a/i");
        let call = RecordBody::AssistantToolCall {
            message_id: "step_1".into(),
            tool_call_id: "call_1".into(),
            name: "lookup".into(),
            arguments: "{}".into(),
        };
        fold(
            &mut projection,
            vec![vec![started("step_1"), call, completed("step_1", "")]],
        );
        let outcome = record(
            "sub_1",
            RecordBody::ToolOutcome {
                output: None,
                assistant_message_id: "step_1".into(),
                tool_call_id: "call_1".into(),
                tool_name: "lookup".into(),
                is_error: false,
                content: "card 4242 4242 4242 4242".into(),
                terminate: false,
                duration_ms: 3,
            },
        );
        (projection, outcome)
    }

    /// A tool that answered a value: clients get the value as the call's output, until an
    /// edit of its row (a redaction, before or after the commit) replaces it with the text.
    #[test]
    fn a_tools_value_is_its_output_until_an_edit_of_its_row_replaces_it() {
        let committed = || {
            record(
                "sub_1",
                RecordBody::ToolResultsCommitted {
                    assistant_message_id: "step_1".into(),
                },
            )
        };
        let with_value = |mut outcome: Record| {
            if let RecordBody::ToolOutcome { output, .. } = &mut outcome.body {
                *output = Some(json!({"card": "4242 4242 4242 4242"}));
            }
            outcome
        };
        let redaction = |row: &str| {
            let mut updates = serde_json::Map::new();
            updates.insert("content".into(), json!("card [redacted]"));
            record(
                "sub_1",
                RecordBody::MessageUpdated {
                    message_id: row.to_owned(),
                    updates,
                },
            )
        };
        // Committed as it is: the value, in the chunk and in the history.
        let (mut projection, outcome) = a_step_calling_lookup();
        let mut chunks = Vec::new();
        projection.apply(
            &Batch {
                offset: 1,
                records: Arc::from(vec![with_value(outcome), committed()]),
            },
            Some(&mut chunks),
        );
        let value = json!({"card": "4242 4242 4242 4242"});
        assert_eq!(chunks.last().unwrap()["output"], value);
        assert_eq!(parts(&projection)[0]["output"], value);
        // Redacted before its batch commits: the text, never the value.
        let (mut projection, outcome) = a_step_calling_lookup();
        let row = outcome.id.clone();
        let mut chunks = Vec::new();
        projection.apply(
            &Batch {
                offset: 1,
                records: Arc::from(vec![with_value(outcome), redaction(&row), committed()]),
            },
            Some(&mut chunks),
        );
        assert_eq!(chunks.last().unwrap()["output"], "card [redacted]");
        assert_eq!(parts(&projection)[0]["output"], "card [redacted]");
        // Redacted after: the history shows the text.
        let (mut projection, outcome) = a_step_calling_lookup();
        let row = outcome.id.clone();
        projection.apply(
            &Batch {
                offset: 1,
                records: Arc::from(vec![with_value(outcome), committed()]),
            },
            None,
        );
        projection.apply(
            &Batch {
                offset: 2,
                records: Arc::from(vec![redaction(&row)]),
            },
            None,
        );
        assert_eq!(parts(&projection)[0]["output"], "card [redacted]");
    }

    #[test]
    fn a_tool_rows_edit_and_deletion_reach_its_calls_part() {
        let (mut projection, outcome) = a_step_calling_lookup();
        let row = outcome.id.clone();
        let committed = record(
            "sub_1",
            RecordBody::ToolResultsCommitted {
                assistant_message_id: "step_1".into(),
            },
        );
        projection.apply(
            &Batch {
                offset: 1,
                records: Arc::from(vec![outcome, committed]),
            },
            None,
        );
        assert_eq!(parts(&projection)[0]["output"], "card 4242 4242 4242 4242");
        // A hook redacts the stored result: the view shows what the thread holds.
        let mut updates = serde_json::Map::new();
        updates.insert("content".into(), json!("card [redacted]"));
        let chunks = fold(
            &mut projection,
            vec![vec![RecordBody::MessageUpdated {
                message_id: row.clone(),
                updates,
            }]],
        );
        assert_eq!(chunks, [vec!["conversation-reset"]]);
        assert_eq!(parts(&projection)[0]["output"], "card [redacted]");
        assert_eq!(parts(&projection)[0]["state"], "output-available");
        // An outcome of the call after its batch committed changes nothing (nor do the edits of
        // its own row), and a later edit of the row still reaches the part.
        let (_, late) = a_step_calling_lookup();
        let mut late_edit = serde_json::Map::new();
        late_edit.insert("content".into(), json!("card 4242 [late]"));
        let late_edit = record(
            "sub_1",
            RecordBody::MessageUpdated {
                message_id: late.id.clone(),
                updates: late_edit,
            },
        );
        projection.apply(
            &Batch {
                offset: 3,
                records: Arc::from(vec![late, late_edit]),
            },
            None,
        );
        assert_eq!(parts(&projection)[0]["output"], "card [redacted]");
        let mut updates = serde_json::Map::new();
        updates.insert("content".into(), json!("card [gone]"));
        fold(
            &mut projection,
            vec![vec![RecordBody::MessageUpdated {
                message_id: row.clone(),
                updates,
            }]],
        );
        assert_eq!(parts(&projection)[0]["output"], "card [gone]");
        // Deleted, the result goes, and the call it answered with it.
        fold(
            &mut projection,
            vec![vec![RecordBody::MessageDeleted { message_id: row }]],
        );
        assert_eq!(parts(&projection), json!([]));
    }

    /// A stream written before reused call ids were renamed (`CallIds`): two steps of one
    /// response called `call_0`. Each step's part shows its own outcome, and the edits and
    /// deletions of each step's tool row reach that step's part.
    #[test]
    fn steps_of_a_response_that_reused_a_call_id_each_keep_their_own_outcome() {
        let mut projection = Projection::new("agents/a/i");
        let step = |id: &str, output: &str| {
            vec![
                started(id),
                RecordBody::AssistantToolCall {
                    message_id: id.into(),
                    tool_call_id: "call_0".into(),
                    name: "lookup".into(),
                    arguments: "{}".into(),
                },
                completed(id, ""),
                RecordBody::ToolOutcome {
                    output: None,
                    assistant_message_id: id.into(),
                    tool_call_id: "call_0".into(),
                    tool_name: "lookup".into(),
                    is_error: false,
                    content: output.into(),
                    terminate: false,
                    duration_ms: 1,
                },
                RecordBody::ToolResultsCommitted {
                    assistant_message_id: id.into(),
                },
            ]
        };
        let batches: Vec<Vec<Record>> = [step("step_1", "first"), step("step_2", "second")]
            .into_iter()
            .map(|bodies| bodies.into_iter().map(|body| record("sub_1", body)).collect())
            .collect();
        let rows: Vec<String> = batches.iter().map(|records| records[3].id.clone()).collect();
        for (offset, records) in batches.into_iter().enumerate() {
            let batch = Batch {
                offset: offset as u64,
                records: Arc::from(records),
            };
            projection.apply(&batch, None);
        }
        let shown = |projection: &Projection| -> Vec<(String, String)> {
            parts(projection)
                .as_array()
                .unwrap()
                .iter()
                .filter(|part| part["type"] == "dynamic-tool")
                .map(|part| {
                    let state = part["state"].as_str().unwrap().to_owned();
                    (state, part["output"].as_str().unwrap_or("").to_owned())
                })
                .collect()
        };
        let pair = |state: &str, output: &str| (state.to_owned(), output.to_owned());
        assert_eq!(
            shown(&projection),
            [pair("output-available", "first"), pair("output-available", "second")]
        );
        // An edit of the first step's row reaches its part; a deletion of the second step's
        // row removes its part.
        let mut updates = serde_json::Map::new();
        updates.insert("content".into(), json!("first [redacted]"));
        fold(
            &mut projection,
            vec![
                vec![RecordBody::MessageUpdated {
                    message_id: rows[0].clone(),
                    updates,
                }],
                vec![RecordBody::MessageDeleted {
                    message_id: rows[1].clone(),
                }],
            ],
        );
        assert_eq!(shown(&projection), [pair("output-available", "first [redacted]")]);
    }

    /// A call's outcome is appended as its tool ends, with what its row's create hooks set
    /// (the redacted content, say): that is the row's creation, not a reset, and the view shows
    /// the hooks' content once the batch commits.
    #[test]
    fn a_tool_rows_create_hook_update_beside_its_outcome_is_no_reset() {
        let (mut projection, outcome) = a_step_calling_lookup();
        let mut updates = serde_json::Map::new();
        updates.insert("content".into(), json!("card [redacted]"));
        let update = record(
            "sub_1",
            RecordBody::MessageUpdated {
                message_id: outcome.id.clone(),
                updates,
            },
        );
        let mut chunks = Vec::new();
        projection.apply(
            &Batch {
                offset: 1,
                records: Arc::from(vec![outcome, update]),
            },
            Some(&mut chunks),
        );
        assert!(
            chunks.iter().all(|chunk| chunk["type"] != "conversation-reset"),
            "{chunks:?}"
        );
        assert_eq!(parts(&projection)[0]["state"], "input-available");
        assert!(parts(&projection)[0].get("output").is_none());
        let chunks = fold(
            &mut projection,
            vec![vec![RecordBody::ToolResultsCommitted {
                assistant_message_id: "step_1".into(),
            }]],
        );
        assert_eq!(chunks, [vec!["tool-output"]]);
        assert_eq!(parts(&projection)[0]["output"], "card [redacted]");
    }

    /// A step's row made silent hides its response only while every step of the response is
    /// silent: the next step (the final answer) shows it again. A signal made not silent is
    /// shown as its kind is, not as visible.
    #[test]
    fn a_silent_step_hides_its_response_only_while_every_step_is_silent() {
        let mut projection = Projection::new("agents/a/i");
        let silent = |id: &str, silent: bool| {
            let mut updates = serde_json::Map::new();
            updates.insert("silent".into(), json!(silent));
            RecordBody::MessageUpdated {
                message_id: id.into(),
                updates,
            }
        };
        let display = |projection: &Projection, at: usize| projection.snapshot()["messages"][at]["display"].clone();
        let chunks = fold(
            &mut projection,
            vec![vec![started("step_1"), completed("step_1", ""), silent("step_1", true)]],
        );
        assert_eq!(chunks, [vec!["conversation-reset"]]);
        assert_eq!(display(&projection, 0), "hidden", "its only step is silent");
        let chunks = fold(
            &mut projection,
            vec![vec![started("step_2")], vec![completed("step_2", "Done.")]],
        );
        assert_eq!(chunks[0], ["conversation-reset"], "shown again: a display changed");
        assert_eq!(display(&projection, 0), "visible", "the answer's step is not silent");
        fold(&mut projection, vec![vec![silent("step_2", true)]]);
        assert_eq!(display(&projection, 0), "hidden");
        // A step a dead attempt left unfinished does not count: the one made again, silent,
        // keeps the response hidden.
        fold(&mut projection, vec![vec![started("step_3")]]);
        assert_eq!(display(&projection, 0), "visible", "a step in progress");
        fold(
            &mut projection,
            vec![vec![
                started("step_4"),
                completed("step_4", "Again."),
                silent("step_4", true),
            ]],
        );
        assert_eq!(display(&projection, 0), "hidden", "step_3 never completed");
        fold(&mut projection, vec![vec![silent("step_1", false)]]);
        assert_eq!(display(&projection, 0), "visible");
        fold(
            &mut projection,
            vec![vec![RecordBody::Signal {
                message_id: "sig_1".into(),
                signal_type: "resources".into(),
                body: "Tools changed.".into(),
                attributes: Default::default(),
                tag_name: None,
            }]],
        );
        fold(&mut projection, vec![vec![silent("sig_1", true)]]);
        assert_eq!(display(&projection, 1), "hidden");
        fold(&mut projection, vec![vec![silent("sig_1", false)]]);
        assert_eq!(display(&projection, 1), "diagnostic", "as its kind is shown");
    }

    /// A row that is not a model step has its metadata replaced, as the conversation's row
    /// has: added keys are a metadata chunk; a replacement or a `null` that takes keys away
    /// (an app redacting) resets the view, which shows only what is left.
    #[test]
    fn a_rows_metadata_replaced_without_some_keys_resets_the_view_without_them() {
        let mut projection = Projection::new("agents/a/i");
        let updated = |metadata: Value| {
            let mut updates = serde_json::Map::new();
            updates.insert("metadata".into(), metadata);
            vec![RecordBody::MessageUpdated {
                message_id: "note_1".into(),
                updates,
            }]
        };
        let injected = RecordBody::MessageInjected {
            message_id: "note_1".into(),
            role: flue_core::lifecycle::MessageRole::User,
            content: "a note".into(),
            silent: false,
            metadata: serde_json::from_value(json!({"trace": {"id": "t-1", "host": "internal"}})).unwrap(),
        };
        let metadata = |projection: &Projection| projection.snapshot()["messages"][0].get("metadata").cloned();
        assert_eq!(fold(&mut projection, vec![vec![injected]]), [vec!["message-appended"]]);
        let chunks = fold(
            &mut projection,
            vec![updated(
                json!({"trace": {"id": "t-1", "host": "internal"}, "seen": true}),
            )],
        );
        assert_eq!(chunks, [vec!["message-metadata"]], "keys added: merged by the client");
        let chunks = fold(
            &mut projection,
            vec![updated(json!({"trace": {"id": "t-1"}, "seen": true}))],
        );
        assert_eq!(chunks, [vec!["conversation-reset"]], "a nested key taken away");
        assert_eq!(
            metadata(&projection),
            Some(json!({"trace": {"id": "t-1"}, "seen": true}))
        );
        let chunks = fold(&mut projection, vec![updated(Value::Null)]);
        assert_eq!(chunks, [vec!["conversation-reset"]], "cleared");
        assert_eq!(metadata(&projection), None);
        let chunks = fold(&mut projection, vec![updated(Value::Null)]);
        assert_eq!(chunks, [Vec::<String>::new()], "nothing to take away");
        // Replaced with nothing on a row that holds none: no chunk, which a client would merge
        // into a `metadata: {}` the snapshot does not have.
        for nothing in [json!({}), json!({"seen": null})] {
            let chunks = fold(&mut projection, vec![updated(nothing.clone())]);
            assert_eq!(chunks, [Vec::<String>::new()], "{nothing}");
            assert_eq!(metadata(&projection), None, "{nothing}");
        }
    }

    #[test]
    fn a_rows_metadata_update_is_a_metadata_chunk_and_its_status_nothing_not_a_reset() {
        let mut projection = Projection::new("agents/a/i");
        let mut metadata = serde_json::Map::new();
        metadata.insert("metadata".into(), json!({"cost": {"cents": 3}}));
        let mut status = serde_json::Map::new();
        status.insert("status".into(), json!("completed"));
        status.insert("name".into(), json!("helper"));
        // As a `before_update_message` hook that adds metadata leaves a step: in its batch.
        let chunks = fold(
            &mut projection,
            vec![
                vec![
                    started("step_1"),
                    completed("step_1", "Hi"),
                    RecordBody::MessageUpdated {
                        message_id: "step_1".into(),
                        updates: metadata,
                    },
                ],
                vec![RecordBody::MessageUpdated {
                    message_id: "step_1".into(),
                    updates: status,
                }],
            ],
        );
        assert_eq!(
            chunks,
            [
                vec![
                    "message-started",
                    "message-delta",
                    "message-completed",
                    "message-metadata"
                ],
                Vec::<&str>::new()
            ]
        );
        let snapshot = projection.snapshot();
        assert_eq!(snapshot["messages"][0]["metadata"], json!({"cost": {"cents": 3}}));
        assert_eq!(
            parts(&projection),
            json!([{"type": "text", "text": "Hi", "state": "done"}])
        );
    }

    #[test]
    fn an_internal_settlement_error_is_served_as_the_generic_internal_error() {
        let mut projection = Projection::new("agents/a/i");
        let internal = crate::record::SettlementError::new(
            "agent_start_failed",
            "[flue] A use_agent_start callback (hook #0 in declaration order) threw: postgres://app:hunter2@db refused",
        );
        fold(
            &mut projection,
            vec![vec![RecordBody::SubmissionSettled {
                outcome: Outcome::Failed,
                error: Some(internal),
            }]],
        );
        let settlements = projection.snapshot()["settlements"].clone();
        assert_eq!(
            settlements,
            json!([{"submissionId": "sub_1", "outcome": "failed", "error": {
                "name": "Error",
                "type": "internal_error",
                "message": "The agent submission failed because of an internal error.",
                "details": "The server encountered an unexpected error while processing the agent submission. When reporting this failure, quote the settlement submissionId — server-side logs carry the same id.",
            }}])
        );
        // A lifecycle hook's reason for refusing a message is served; its panic is not.
        for (message, served) in [
            (
                "Messages about refunds go to the billing desk.",
                "Messages about refunds go to the billing desk.",
            ),
            (
                "panicked: cannot reach postgres://app:hunter2@db",
                "The agent submission failed because of an internal error.",
            ),
        ] {
            let mut projection = Projection::new("agents/a/i");
            fold(
                &mut projection,
                vec![vec![RecordBody::SubmissionSettled {
                    outcome: Outcome::Failed,
                    error: Some(crate::record::SettlementError::new("message_hook_error", message)),
                }]],
            );
            assert_eq!(projection.snapshot()["settlements"][0]["error"]["message"], served);
        }
        // A framework's error is served as it is.
        let mut projection = Projection::new("agents/a/i");
        let timeout =
            crate::record::SettlementError::new("submission_timeout", "Submission exceeded the configured timeout.");
        fold(
            &mut projection,
            vec![vec![RecordBody::SubmissionSettled {
                outcome: Outcome::Failed,
                error: Some(timeout),
            }]],
        );
        assert_eq!(
            projection.snapshot()["settlements"][0]["error"]["message"],
            "Submission exceeded the configured timeout."
        );
    }

    #[test]
    fn a_settlement_keeps_the_text_an_unfinished_step_streamed_and_closes_it() {
        let mut projection = Projection::new("agents/a/i");
        let chunks = fold(
            &mut projection,
            vec![
                vec![started("step_1"), delta("step_1", "Partial")],
                vec![RecordBody::SubmissionSettled {
                    outcome: Outcome::Aborted,
                    error: None,
                }],
            ],
        );
        assert_eq!(
            chunks,
            [
                vec!["message-started", "message-delta"],
                vec!["message-completed", "submission-settled"]
            ],
            "a client closes the streaming part as the snapshot does"
        );
        assert_eq!(
            parts(&projection),
            json!([{"type": "text", "text": "Partial", "state": "done"}])
        );
    }

    #[test]
    fn deleting_the_first_step_keeps_the_response_and_edits_still_find_the_later_steps_text() {
        let mut projection = Projection::new("agents/a/i");
        let reasoned = RecordBody::AssistantMessageCompleted {
            message_id: "step_1".into(),
            text: "First.".into(),
            reasoning: "Think.".into(),
            stop_reason: StopReason::Stop,
            usage: Default::default(),
            reasoning_blocks: Vec::new(),
        };
        let mut updates = serde_json::Map::new();
        updates.insert("content".into(), json!("Second, edited."));
        fold(
            &mut projection,
            vec![
                vec![started("step_1"), reasoned],
                vec![started("step_2"), completed("step_2", "Second.")],
                vec![RecordBody::MessageDeleted {
                    message_id: "step_1".into(),
                }],
                vec![RecordBody::MessageUpdated {
                    message_id: "step_2".into(),
                    updates,
                }],
            ],
        );
        assert_eq!(
            parts(&projection),
            json!([{"type": "text", "text": "Second, edited.", "state": "done"}])
        );
    }

    #[test]
    fn a_completion_with_empty_text_removes_what_its_step_streamed() {
        let mut projection = Projection::new("agents/a/i");
        let chunks = fold(
            &mut projection,
            vec![
                vec![started("step_1"), delta("step_1", "Let me")],
                vec![completed("step_1", "")],
            ],
        );
        assert_eq!(
            chunks,
            [vec!["message-started", "message-delta"], vec!["conversation-reset"]]
        );
        assert_eq!(parts(&projection), json!([]));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests assert by unwrapping
mod props;
