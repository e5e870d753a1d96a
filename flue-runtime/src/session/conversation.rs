//! Folding an instance's record stream into what the next model call needs: the model-facing
//! history, the state snapshot, and each response's reply.

use std::collections::{BTreeMap, HashMap, HashSet};

use flue_core::metadata::{Metadata, merge_metadata};
use flue_core::state::StateSnapshot;
use serde_json::Value;

use crate::provider::{ModelImage, ModelMessage, ModelToolCall};
use crate::record::{AttachmentRef, Batch, Record, RecordBody};

/// The result text of a tool whose outcome never committed.
pub(crate) const INTERRUPTED_TOOL: &str = "Tool execution was interrupted before completion. The outcome is unknown.";

/// An instance's conversation, folded incrementally from its batches.
#[derive(Default)]
pub(crate) struct Conversation {
    pub(crate) uid: String,
    pub(crate) initial_data: Option<Value>,
    pub(crate) state: StateSnapshot,
    pub(crate) messages: Vec<ModelMessage>,
    pub(crate) last_offset: Option<u64>,
    /// Tool calls of the last completed step whose batch has not committed.
    open_calls: Vec<ModelToolCall>,
    open_step: Option<OpenStep>,
    outcomes: Vec<(String, String, String, bool)>,
    /// Submissions whose input record is in the stream.
    inputs: HashSet<String>,
    /// Submissions whose start seam committed.
    started: HashSet<String>,
    /// Submissions with a durable model step.
    stepped: HashSet<String>,
    /// Continued finish cycles per submission.
    finish_cycles: HashMap<String, u32>,
    /// Submissions whose latest durable step is a final answer (no tool calls) with nothing
    /// after it that asks for more.
    answered: HashSet<String>,
    /// User messages with images: their position in `messages` and their attachments.
    image_refs: Vec<(usize, Vec<AttachmentRef>)>,
    /// Images loaded from the attachment store (or kept when stored), by attachment id.
    images: HashMap<String, ModelImage>,
}

struct OpenStep {
    tool_calls: Vec<ModelToolCall>,
}

impl Conversation {
    pub(crate) fn apply(&mut self, batch: &Batch) {
        for record in batch.records.iter() {
            self.apply_record(record);
        }
        self.last_offset = Some(batch.offset);
    }

    /// Whether the submission's input was applied (its record is in the stream).
    pub(crate) fn has_input(&self, submission_id: &str) -> bool {
        self.inputs.contains(submission_id)
    }

    /// Whether the submission's start seam committed.
    pub(crate) fn has_started(&self, submission_id: &str) -> bool {
        self.started.contains(submission_id)
    }

    /// Whether the submission has a durable model step.
    pub(crate) fn has_stepped(&self, submission_id: &str) -> bool {
        self.stepped.contains(submission_id)
    }

    /// Whether the submission's response already ended in a final answer: a resumed attempt
    /// settles it instead of calling the model again (completed work is never redone).
    pub(crate) fn has_final_answer(&self, submission_id: &str) -> bool {
        self.answered.contains(submission_id)
    }

    /// Continued finish cycles the submission committed.
    pub(crate) fn finish_cycles(&self, submission_id: &str) -> u32 {
        self.finish_cycles.get(submission_id).copied().unwrap_or(0)
    }

    fn apply_record(&mut self, record: &Record) {
        let submission = record.submission_id.as_deref();
        match &record.body {
            RecordBody::UserMessage { .. } | RecordBody::Signal { .. } => {
                self.inputs.extend(submission.map(str::to_owned));
                if let Some(id) = submission {
                    self.answered.remove(id);
                }
            }
            RecordBody::AgentStartRun => {
                self.started.extend(submission.map(str::to_owned));
            }
            RecordBody::AssistantMessageStarted { .. } => {
                self.stepped.extend(submission.map(str::to_owned));
            }
            RecordBody::AgentFinishCycle => {
                if let Some(id) = submission {
                    *self.finish_cycles.entry(id.to_owned()).or_default() += 1;
                    self.answered.remove(id);
                }
            }
            RecordBody::AssistantMessageCompleted { stop_reason, .. } => {
                if let Some(id) = submission {
                    let final_answer = self.open_step.as_ref().is_some_and(|step| step.tool_calls.is_empty())
                        && *stop_reason != crate::provider::StopReason::ToolUse;
                    if final_answer {
                        self.answered.insert(id.to_owned());
                    } else {
                        self.answered.remove(id);
                    }
                }
            }
            RecordBody::ToolResultsCommitted { .. } => {
                if let Some(id) = submission {
                    self.answered.remove(id);
                }
            }
            _ => {}
        }
        match &record.body {
            RecordBody::ConversationCreated { uid, initial_data } => {
                self.uid.clone_from(uid);
                self.initial_data.clone_from(initial_data);
            }
            RecordBody::UserMessage { body, attachments, .. } => {
                self.close_dangling_calls();
                self.messages.push(ModelMessage::user(body.clone()));
                if !attachments.is_empty() {
                    self.image_refs.push((self.messages.len() - 1, attachments.clone()));
                }
            }
            RecordBody::Signal {
                signal_type,
                body,
                attributes,
                tag_name,
                ..
            } => {
                self.close_dangling_calls();
                self.messages.push(ModelMessage::user(render_signal(
                    signal_type,
                    body,
                    attributes,
                    tag_name.as_deref(),
                )));
            }
            RecordBody::AssistantMessageStarted { .. } => {
                self.close_dangling_calls();
                self.open_step = Some(OpenStep { tool_calls: Vec::new() });
            }
            RecordBody::AssistantToolCall {
                tool_call_id,
                name,
                arguments,
                ..
            } => {
                if let Some(step) = &mut self.open_step {
                    step.tool_calls.push(ModelToolCall {
                        id: tool_call_id.clone(),
                        name: name.clone(),
                        arguments: arguments.clone(),
                    });
                }
            }
            RecordBody::AssistantMessageCompleted { text, .. } => {
                let tool_calls = self.open_step.take().map(|step| step.tool_calls).unwrap_or_default();
                self.open_calls.clone_from(&tool_calls);
                self.messages.push(ModelMessage::Assistant {
                    text: text.clone(),
                    tool_calls,
                });
            }
            RecordBody::ToolOutcome {
                tool_call_id,
                tool_name,
                content,
                is_error,
                ..
            } => {
                self.outcomes
                    .push((tool_call_id.clone(), tool_name.clone(), content.clone(), *is_error));
            }
            RecordBody::ToolResultsCommitted { .. } => {
                let outcomes = std::mem::take(&mut self.outcomes);
                for call in std::mem::take(&mut self.open_calls) {
                    let outcome = outcomes.iter().find(|(id, ..)| *id == call.id);
                    let (content, is_error) = match outcome {
                        Some((_, _, content, is_error)) => (content.clone(), *is_error),
                        None => (INTERRUPTED_TOOL.to_owned(), true),
                    };
                    self.messages.push(ModelMessage::Tool {
                        tool_call_id: call.id,
                        name: call.name,
                        content,
                        is_error,
                    });
                }
            }
            RecordBody::StateWrite { name, value } => self.state.apply(name.clone(), value.clone()),
            RecordBody::AgentStartRun
            | RecordBody::AgentFinishCycle
            | RecordBody::MessageDataWrite { .. }
            | RecordBody::MessageMetadata { .. }
            | RecordBody::SubmissionSettled { .. } => {}
        }
    }

    /// Calls whose batch never committed (an interrupted attempt) get an outcome-unknown
    /// error result, so the history stays a valid call/result pairing and nothing re-runs.
    fn close_dangling_calls(&mut self) {
        self.outcomes.clear();
        for call in std::mem::take(&mut self.open_calls) {
            self.messages.push(ModelMessage::Tool {
                tool_call_id: call.id,
                name: call.name,
                content: INTERRUPTED_TOOL.to_owned(),
                is_error: true,
            });
        }
    }

    /// Keeps an image for the message that attaches it (stored, or loaded from the store).
    pub(crate) fn keep_image(&mut self, id: String, image: ModelImage) {
        self.images.insert(id, image);
    }

    /// Attachments the history names whose images are not loaded.
    pub(crate) fn missing_images(&self) -> Vec<AttachmentRef> {
        self.image_refs
            .iter()
            .flat_map(|(_, refs)| refs)
            .filter(|attachment| !self.images.contains_key(&attachment.id))
            .cloned()
            .collect()
    }

    /// The history to send: the folded messages (with their images, once loaded) plus
    /// outcome-unknown results for calls of an interrupted batch.
    pub(crate) fn model_messages(&self) -> Vec<ModelMessage> {
        let mut messages = self.messages.clone();
        for (index, refs) in &self.image_refs {
            if let Some(ModelMessage::User { images, .. }) = messages.get_mut(*index) {
                images.extend(
                    refs.iter()
                        .filter_map(|attachment| self.images.get(&attachment.id).cloned()),
                );
            }
        }
        for call in &self.open_calls {
            messages.push(ModelMessage::Tool {
                tool_call_id: call.id.clone(),
                name: call.name.clone(),
                content: INTERRUPTED_TOOL.to_owned(),
                is_error: true,
            });
        }
        messages
    }
}

/// A signal as the model reads it: `<tag type="…" k="v">\nbody\n</tag>` (escaped).
pub(crate) fn render_signal(
    signal_type: &str,
    body: &str,
    attributes: &BTreeMap<String, String>,
    tag_name: Option<&str>,
) -> String {
    let tag = tag_name.unwrap_or("signal");
    let mut out = format!("<{tag} type=\"{}\"", escape(signal_type));
    for (key, value) in attributes {
        out.push_str(&format!(" {key}=\"{}\"", escape(value)));
    }
    out.push_str(&format!(">\n{}\n</{tag}>", escape(body)));
    out
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// What a response produced, read back from its records.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct ReplyParts {
    pub(crate) texts: Vec<String>,
    pub(crate) data: serde_json::Map<String, Value>,
    pub(crate) metadata: Metadata,
}

impl ReplyParts {
    /// Takes in what `record` adds to the reply (the caller knows it belongs to the response).
    pub(crate) fn add(&mut self, record: &Record) {
        match &record.body {
            RecordBody::AssistantMessageStarted {
                response_metadata: Some(metadata),
                ..
            } => merge_metadata(&mut self.metadata, metadata.clone()),
            RecordBody::AssistantMessageCompleted { text, .. } if !text.is_empty() => self.texts.push(text.clone()),
            RecordBody::MessageDataWrite { name, data } => {
                self.data.insert(name.clone(), data.clone());
            }
            RecordBody::MessageMetadata { metadata } => merge_metadata(&mut self.metadata, metadata.clone()),
            _ => {}
        }
    }
}

/// Collects the reply of `submission_id`'s response from the stream.
pub(crate) fn reply_of(batches: &[Batch], submission_id: &str) -> ReplyParts {
    let mut reply = ReplyParts::default();
    // Every attempt that wrote for the submission (a response may span re-attempts; a joined
    // delivery's input carries its host's attempt).
    let attempts: HashSet<&str> = batches
        .iter()
        .flat_map(|batch| batch.records.iter())
        .filter(|record| record.submission_id.as_deref() == Some(submission_id))
        .filter_map(|record| record.attempt_id.as_deref())
        .collect();
    for record in batches.iter().flat_map(|batch| batch.records.iter()) {
        if record
            .attempt_id
            .as_deref()
            .is_some_and(|attempt| attempts.contains(attempt))
        {
            reply.add(record);
        }
    }
    reply
}
