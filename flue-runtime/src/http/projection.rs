//! What clients see of a conversation: the record stream folded into messages (the history
//! snapshot) and each batch projected into chunks (the updates), as the streaming protocol
//! shapes them.
//!
//! - One assistant message per response: every model step of a submission folds into the
//!   submission's first step's message id; a step's text part comes before its tool parts.
//! - A step's text streams as it was appended (`assistant_text_delta`) into a `streaming` text
//!   part that its completion closes. A step that never completes (an attempt that died, a
//!   call retried) leaves text the conversation does not hold: the response's next step, or
//!   a completion whose text is not the streamed text continued, removes or corrects it, and
//!   that batch projects to a reset (a client may have shown it). A settlement closes a
//!   streaming part as it is (an aborted answer keeps what it showed).
//! - Tool outputs appear only when their batch commits (`tool_results_committed`), never from
//!   an outcome alone.
//! - A batch holding the instance's birth record projects to one `conversation-reset`.
//! - Chunks carry the conversation id and their position: the batch's offset and their index
//!   within that batch's projection.

use std::collections::HashMap;

use serde_json::{Map, Value, json};

use crate::record::{Batch, Record, RecordBody, format_offset};

/// The wire-only first element of every updates read.
pub(crate) fn checkpoint(incarnation: &str) -> Value {
    json!({"type": "stream-checkpoint", "incarnation": incarnation})
}

/// A `message-delta` chunk of text.
fn text_delta(message_id: &str, delta: &str) -> Value {
    json!({"type": "message-delta", "messageId": message_id, "kind": "text", "delta": delta})
}

/// A tool outcome waiting for its batch's commit.
struct PendingOutcome {
    is_error: bool,
    content: String,
    duration_ms: u64,
    timestamp: String,
}

/// The fold of one conversation's records.
#[derive(Default)]
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
    /// Step message id → the index of its first part in the response message.
    step_parts: HashMap<String, usize>,
    /// Step message id → its tool call ids, in call order.
    step_calls: HashMap<String, Vec<String>>,
    /// Tool call id → the response message holding its part.
    calls: HashMap<String, String>,
    outcomes: HashMap<String, PendingOutcome>,
    /// Data parts written before their response's first step (a start callback's writes),
    /// by submission: they join the response message when it starts.
    early_data: HashMap<String, Vec<(String, Value)>>,
    /// Step message id → the text it streamed, while the step has not completed.
    streamed: HashMap<String, String>,
    /// Whether the batch being folded changed a message already shown (it projects to a
    /// reset).
    rewritten: bool,
    offset: Option<u64>,
}

impl Projection {
    /// An empty fold of the conversation `conversation_id`.
    pub(crate) fn new(conversation_id: &str) -> Self {
        Self {
            conversation_id: conversation_id.to_owned(),
            ..Self::default()
        }
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
        // A batch that rewrites history (a row edited or deleted) projects to a reset too:
        // the protocol has no chunk that changes a past message.
        let resets = batch.records.iter().any(|record| {
            matches!(
                record.body,
                RecordBody::ConversationCreated { .. }
                    | RecordBody::MessageUpdated { .. }
                    | RecordBody::MessageDeleted { .. }
                    | RecordBody::Compaction { .. }
            )
        });
        let mut out = Vec::new();
        // A step's text streams right after its start when both are in this batch.
        let mut texts: HashMap<&str, &str> = HashMap::new();
        // A joined delivery settles under its host's attempt, in the host's settlement batch.
        let mut hosts: HashMap<&str, &str> = HashMap::new();
        for record in batch.records.iter() {
            match &record.body {
                RecordBody::AssistantMessageCompleted { message_id, text, .. } if !text.is_empty() => {
                    texts.insert(message_id, text);
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
            self.record(record, &texts, &hosts, &mut out);
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
        texts: &HashMap<&str, &str>,
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
                ..
            } => {
                let response_id = match submission.and_then(|s| self.responses.get(s)) {
                    Some(response_id) => response_id.clone(),
                    None => {
                        let mut message = json!({
                            "id": message_id,
                            "role": "assistant",
                            "purpose": "assistant",
                            "display": "visible",
                            "turnId": message_id,
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
                let parts = self.parts_len(&response_id);
                self.step_parts.insert(message_id.clone(), parts);
                let mut chunk = json!({
                    "type": "message-started",
                    "messageId": response_id,
                    "turnId": message_id,
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
                if let Some(text) = texts.get(message_id.as_str()) {
                    out.push(text_delta(&response_id, text));
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
            RecordBody::AssistantTextDelta { message_id, delta } => {
                let Some(response_id) = self.steps.get(message_id).cloned() else {
                    return;
                };
                let at = self.step_parts.get(message_id).copied().unwrap_or(0);
                let streamed = self.streamed.entry(message_id.clone()).or_default();
                let first = streamed.is_empty();
                streamed.push_str(delta);
                let text = streamed.clone();
                if first {
                    self.insert_part(&response_id, at, json!({"type": "text", "text": text, "state": "streaming"}));
                } else if let Some(part) = self.step_text_part(&response_id, at) {
                    part["text"] = json!(text);
                }
                out.push(text_delta(&response_id, delta));
            }
            RecordBody::AssistantMessageCompleted { message_id, text, .. } => {
                let Some(response_id) = self.steps.get(message_id).cloned() else {
                    return;
                };
                if let Some(streamed) = self.streamed.remove(message_id.as_str()) {
                    let at = self.step_parts.get(message_id).copied().unwrap_or(0);
                    match text.strip_prefix(streamed.as_str()) {
                        Some(rest) => {
                            if !rest.is_empty() {
                                out.push(text_delta(&response_id, rest));
                            }
                        }
                        // The step's text is not what it streamed continued (a retried call
                        // streamed after a failed one).
                        None => self.rewritten = true,
                    }
                    if text.is_empty() {
                        self.remove_step_text_part(&response_id, at);
                    } else if let Some(part) = self.step_text_part(&response_id, at) {
                        *part = json!({"type": "text", "text": text, "state": "done"});
                    }
                } else if !text.is_empty() {
                    let at = self.step_parts.get(message_id).copied().unwrap_or(0);
                    self.insert_part(&response_id, at, json!({"type": "text", "text": text, "state": "done"}));
                    if !texts.contains_key(message_id.as_str()) {
                        out.push(
                            text_delta(&response_id, text),
                        );
                    }
                }
                out.push(json!({"type": "message-completed", "messageId": response_id, "timestamp": timestamp}));
            }
            RecordBody::ToolOutcome {
                tool_call_id,
                is_error,
                content,
                duration_ms,
                ..
            } => {
                self.outcomes.insert(
                    tool_call_id.clone(),
                    PendingOutcome {
                        is_error: *is_error,
                        content: content.clone(),
                        duration_ms: *duration_ms,
                        timestamp: timestamp.to_owned(),
                    },
                );
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
                            "output": outcome.content,
                            "durationMs": outcome.duration_ms,
                            "timestamp": outcome.timestamp,
                        })
                    };
                    self.settle_tool_part(&call, &outcome);
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
                let Some(response_id) = submission.and_then(|s| self.responses.get(s)).cloned() else {
                    return;
                };
                self.merge_metadata(&response_id, metadata);
                out.push(json!({"type": "message-metadata", "messageId": response_id, "metadata": metadata}));
            }
            RecordBody::SubmissionSettled { outcome, error } => {
                let Some(submission) = submission else { return };
                if let Some(response_id) = self.responses.get(submission).cloned() {
                    self.close_streaming_steps(&response_id);
                }
                let mut settlement = json!({"submissionId": submission, "outcome": outcome});
                if let Some(error) = error {
                    settlement["error"] = json!(error);
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
            RecordBody::MessageUpdated { message_id, updates } => self.update_message(message_id, updates),
            RecordBody::MessageDeleted { message_id } => {
                if let Some(index) = self.index.remove(message_id.as_str()) {
                    self.messages.remove(index);
                    for at in self.index.values_mut() {
                        if *at > index {
                            *at -= 1;
                        }
                    }
                } else if let Some(response_id) = self.steps.get(message_id).cloned() {
                    // A model step folded into its response message: its text part goes.
                    let at = self.step_parts.get(message_id).copied();
                    if let (Some(at), Some(parts)) = (at, self.parts_mut(&response_id))
                        && parts.get(at).is_some_and(|part| part["type"] == "text")
                    {
                        parts.remove(at);
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
                self.append_message(message, out);
            }
        }
    }

    /// Applies a row's field updates to the message that shows it: content to its text part,
    /// `silent` to its display, metadata merged.
    fn update_message(&mut self, id: &str, updates: &Map<String, Value>) {
        let (message_id, text_at) = match self.steps.get(id) {
            Some(response_id) => (response_id.clone(), self.step_parts.get(id).copied()),
            None => (id.to_owned(), Some(0)),
        };
        if let (Some(Value::String(content)), Some(at)) = (updates.get("content"), text_at)
            && let Some(part) = self.parts_mut(&message_id).and_then(|parts| parts.get_mut(at))
            && part["type"] == "text"
        {
            part["text"] = json!(content);
        }
        let Some(message) = self.message_mut(&message_id) else {
            return;
        };
        if let Some(Value::Bool(silent)) = updates.get("silent") {
            message.insert("display".into(), json!(if *silent { "hidden" } else { "visible" }));
        }
        if let Some(Value::Object(metadata)) = updates.get("metadata") {
            let target = message.entry("metadata").or_insert_with(|| json!({}));
            if let Value::Object(target) = target {
                target.extend(metadata.clone());
            }
        }
    }

    /// The text part of the step whose parts start at `at` in `response_id`, if it has one.
    fn step_text_part(&mut self, response_id: &str, at: usize) -> Option<&mut Value> {
        self.parts_mut(response_id)?
            .get_mut(at)
            .filter(|part| part["type"] == "text")
    }

    fn remove_step_text_part(&mut self, response_id: &str, at: usize) {
        if self.step_text_part(response_id, at).is_some()
            && let Some(parts) = self.parts_mut(response_id)
        {
            parts.remove(at);
        }
    }

    /// The steps of `response_id` that streamed text and never completed.
    fn streaming_steps(&self, response_id: &str) -> Vec<String> {
        self.streamed
            .keys()
            .filter(|step| self.steps.get(*step).is_some_and(|response| response == response_id))
            .cloned()
            .collect()
    }

    /// A new step of `response_id` began: a step of it still streaming never completes (its
    /// attempt died), and its text, which the conversation does not hold, goes.
    fn drop_interrupted_steps(&mut self, response_id: &str) {
        for step in self.streaming_steps(response_id) {
            self.streamed.remove(&step);
            let at = self.step_parts.get(&step).copied().unwrap_or(0);
            self.remove_step_text_part(response_id, at);
            self.rewritten = true;
        }
    }

    /// `response_id` settled: the text its steps streamed stays, done.
    fn close_streaming_steps(&mut self, response_id: &str) {
        for step in self.streaming_steps(response_id) {
            self.streamed.remove(&step);
            let at = self.step_parts.get(&step).copied().unwrap_or(0);
            if let Some(part) = self.step_text_part(response_id, at) {
                part["state"] = json!("done");
            }
        }
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

    fn settle_tool_part(&mut self, call: &str, outcome: &PendingOutcome) {
        let Some(response_id) = self.calls.get(call).cloned() else {
            return;
        };
        let Some(parts) = self.parts_mut(&response_id) else {
            return;
        };
        let Some(part) = parts.iter_mut().find(|part| part["toolCallId"] == call) else {
            return;
        };
        if outcome.is_error {
            part["state"] = json!("output-error");
            part["errorText"] = json!(outcome.content);
        } else {
            part["state"] = json!("output-available");
            part["output"] = json!(outcome.content);
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
    use crate::record::{Batch, Outcome, Record, RecordBody};

    fn record(submission: &str, body: RecordBody) -> Record {
        Record {
            id: crate::record::new_id("record"),
            submission_id: Some(submission.into()),
            attempt_id: None,
            timestamp: "2026-01-01T00:00:00.000Z".into(),
            body,
        }
    }

    fn started(step: &str) -> RecordBody {
        RecordBody::AssistantMessageStarted {
            message_id: step.into(),
            model: "test/model".into(),
            response_metadata: None,
        }
    }

    fn delta(step: &str, text: &str) -> RecordBody {
        RecordBody::AssistantTextDelta {
            message_id: step.into(),
            delta: text.into(),
        }
    }

    fn completed(step: &str, text: &str) -> RecordBody {
        RecordBody::AssistantMessageCompleted {
            message_id: step.into(),
            text: text.into(),
            stop_reason: StopReason::Stop,
            usage: Default::default(),
        }
    }

    /// Folds one batch per entry of `batches` (records of submission `sub_1`); the chunk types
    /// of each.
    fn fold(projection: &mut Projection, offset: &mut u64, batches: Vec<Vec<RecordBody>>) -> Vec<Vec<String>> {
        batches
            .into_iter()
            .map(|bodies| {
                let records: Vec<Record> = bodies.into_iter().map(|body| record("sub_1", body)).collect();
                let batch = Batch {
                    offset: *offset,
                    records: Arc::from(records),
                };
                *offset += 1;
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

    #[test]
    fn a_step_that_never_completed_loses_its_streamed_text_to_the_next_step_with_a_reset() {
        let mut projection = Projection::new("agents/a/i");
        let mut offset = 0;
        let chunks = fold(
            &mut projection,
            &mut offset,
            vec![
                vec![started("step_1"), delta("step_1", "Hal")],
                vec![delta("step_1", "f an")],
            ],
        );
        assert_eq!(
            chunks,
            [vec!["message-started", "message-delta"], vec!["message-delta"]]
        );
        assert_eq!(
            parts(&projection),
            json!([{"type": "text", "text": "Half an", "state": "streaming"}])
        );
        // The attempt died; the next one's step streams into the same response message.
        let chunks = fold(
            &mut projection,
            &mut offset,
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
    fn a_settlement_keeps_the_text_an_unfinished_step_streamed_and_closes_it() {
        let mut projection = Projection::new("agents/a/i");
        let mut offset = 0;
        let chunks = fold(
            &mut projection,
            &mut offset,
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
            [vec!["message-started", "message-delta"], vec!["submission-settled"]]
        );
        assert_eq!(
            parts(&projection),
            json!([{"type": "text", "text": "Partial", "state": "done"}])
        );
    }

    #[test]
    fn a_completion_with_empty_text_removes_what_its_step_streamed() {
        let mut projection = Projection::new("agents/a/i");
        let mut offset = 0;
        let chunks = fold(
            &mut projection,
            &mut offset,
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
