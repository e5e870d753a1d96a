//! Property tests of the projection: random but valid record streams of one or two
//! submissions, folded by [`Projection`] and by a naive model that recomputes each response's
//! parts from scratch.
//!
//! The generator draws every choice from a byte string, so proptest's shrinking of the bytes
//! (shorter, smaller) shrinks the stream: option 0 of every choice is the simplest one.
//!
//! The model's rules (read from the projection's module docs):
//! - a response's message is its submission's first started step's id; every step's
//!   `reasoning` then `text` part sit where the step started (a step started again moves to
//!   the end), tool parts and data parts are appended when they are called / first written
//!   (a data part of a name written again is updated in place);
//! - a streamed part is `streaming` until the completion (its value is authoritative, an empty
//!   value removes the part), a settlement (closed as it is, `done`) or the response's next
//!   start (removed); streamed reasoning is `done` once the step's text streams;
//! - tool outputs appear at their step's commit, from the outcomes written before it;
//! - `message_updated {content}` sets a step's text part (nothing when it has none), a
//!   non-assistant message's first text part; `message_deleted` removes a step's text and
//!   reasoning parts (nothing when it has none), or a whole non-assistant message;
//! - a `compaction` appends a diagnostic system message (its record's id, the summary as its
//!   text, signal `conversation-summary` with the reason) and changes nothing else: the
//!   transcript before it stays, a part streaming stays streaming, and the response's later
//!   steps still fold into its message (before the summary);
//! - `message_updated {silent}` hides a non-assistant message (`display: hidden`; shown again
//!   as its kind shows it: a signal as classified, else `visible`), and a response while every
//!   step of it that counts (completed and not deleted, or the newest) is silent;
//! - `message_updated {metadata}` on a step deep-merges into its response's metadata (`null`
//!   changes nothing); on another row it replaces the row's (without its `null` members;
//!   `null`, or nothing left, removes it). A first step's start metadata and a non-empty
//!   `message_metadata` (the response's finish) deep-merge into the response's. A response
//!   shows `metadata` once something merged into it (an object of `null`s too: `{}`);
//! - a `signal` appends a system message classified by its type (reference §4.6: purpose,
//!   display, a settlement for the terminal advisories), with `signal` holding its tag name and
//!   attributes when it has either; a `message_injected` appends a message of its role
//!   (`display: hidden` when silent, its metadata when it has any); a `child_session_retained`
//!   shows nothing.
//!
//! The generator writes compactions where the runtime does (`Response::compact`): a threshold
//! one before a step's first call, and an overflow one after a failed call, maybe after the
//! step's start and deltas were appended, before the call is made again. It writes the other
//! rows where the runtime does too: signals as a submission's input, in its start seam's batch
//! (with `agent_start_run`), in a narration batch before a step (with `resource_snapshot`), in
//! a finish cycle's batch between steps (with `agent_finish_cycle`) and as a terminal advisory
//! in an aborted or failed settlement's batch; injected rows in a batch of their own between
//! steps; the response's finish metadata after its last step; a task child's link while the
//! step's calls run.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use flue_core::lifecycle::MessageRole;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{Map, Value, json};

use super::Projection;
use crate::provider::StopReason;
use crate::record::test_records::{record, started};
use crate::record::{Batch, ConversationKind, Outcome, Record, RecordBody};
use crate::store::InstanceKey;

// ---------------------------------------------------------------------------------------------
// Generation

/// The choices of one generated stream: each draw reads the next byte (0 once they run out).
struct Choices<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Choices<'_> {
    fn below(&mut self, n: u32) -> u32 {
        if n <= 1 {
            return 0;
        }
        let byte = self.bytes.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        u32::from(byte) % n
    }

    /// True `percent`% of the time; false when the bytes ran out.
    fn chance(&mut self, percent: u32) -> bool {
        self.below(100) >= 100 - percent
    }

    fn piece(&mut self) -> String {
        ["x", "y", "xy", "yx", "z"][self.below(5) as usize].to_owned()
    }
}

/// Which generated events a stream may hold (to single out one defect at a time).
#[derive(Clone, Copy)]
struct Features {
    /// Edits and deletions of steps that have no text part (empty completions, interrupted
    /// steps) and repeated deletions.
    partless_history_edits: bool,
    /// Data writes anywhere: before the response's first step, in a step's delta or completion
    /// batches. The runtime appends each write as a batch of its own, and only once the
    /// response has a completed step (`Attempt::flush_data`): between steps, or between two
    /// streaming batches of a later step.
    data_anywhere: bool,
}

const ALL: Features = Features {
    partless_history_edits: true,
    data_anywhere: true,
};

/// What the runtime writes.
const REALISTIC: Features = Features {
    partless_history_edits: false,
    data_anywhere: false,
};

/// A generated stream, as batches of record bodies by submission.
type Stream = Vec<Vec<(String, RecordBody)>>;

struct Generator<'a, 'b> {
    choices: &'a mut Choices<'b>,
    features: Features,
    batches: Stream,
    /// Steps completed, and whether their completion has text.
    completed: Vec<(String, bool)>,
    /// Steps that started and never completed, and are not streaming now.
    abandoned: Vec<String>,
    /// The ids of the rows that are not model steps: user messages, signals, injected rows.
    plain: Vec<String>,
    /// The rows of the conversation the model reads, oldest first, that a compaction can keep:
    /// user messages, signals, injected rows, completed steps, and the last compaction's summary
    /// (`None`: its id is its record's, made when the stream is folded).
    rows: Vec<Option<String>>,
    /// Whether the current submission has a completed step.
    stepped: bool,
    /// The current submission's first step, and the metadata its starts carry (its
    /// `use_response_start` callbacks').
    first_step: (String, Option<Map<String, Value>>),
    /// How many signals and injected rows were made (their ids).
    made: u32,
}

impl Generator<'_, '_> {
    fn push(&mut self, batch: Vec<(String, RecordBody)>) {
        if !batch.is_empty() {
            self.batches.push(batch);
        }
    }

    /// Appends `extra` to the last batch, or as a batch of its own.
    fn push_or_join(&mut self, extra: Vec<(String, RecordBody)>) {
        if self.choices.chance(50)
            && let Some(last) = self.batches.last_mut()
        {
            last.extend(extra);
        } else {
            self.push(extra);
        }
    }

    fn data_write(&mut self, sub: &str) -> (String, RecordBody) {
        let name = ["a", "b"][self.choices.below(2) as usize];
        (
            sub.to_owned(),
            RecordBody::MessageDataWrite {
                name: name.to_owned(),
                data: json!(self.choices.below(10)),
            },
        )
    }

    /// A metadata object: 0 to 2 members, numbers or objects; with `nulls`, members that are
    /// `null` (at the top or nested), which a merge skips.
    fn metadata(&mut self, nulls: bool) -> Map<String, Value> {
        let mut metadata = Map::new();
        for _ in 0..self.choices.below(3) {
            let key = ["a", "b"][self.choices.below(2) as usize];
            let n = self.choices.below(3);
            let value = match self.choices.below(if nulls { 4 } else { 2 }) {
                0 => json!(n),
                1 => json!({["x", "y"][self.choices.below(2) as usize]: n}),
                2 => Value::Null,
                _ => json!({"x": null, "y": n}),
            };
            metadata.insert(key.to_owned(), value);
        }
        metadata
    }

    /// The start of `step`: the submission's first step carries the response's start metadata.
    fn start(&self, step: &str) -> RecordBody {
        let mut body = started(step);
        if let RecordBody::AssistantMessageStarted { response_metadata, .. } = &mut body
            && self.first_step.0 == step
        {
            response_metadata.clone_from(&self.first_step.1);
        }
        body
    }

    /// A signal row of type `signal_type`, maybe with attributes and a tag name.
    fn signal(&mut self, sub: &str, signal_type: &str) -> (String, RecordBody) {
        self.made += 1;
        let id = format!("sig_{}", self.made);
        let mut attributes = BTreeMap::new();
        if self.choices.chance(50) {
            attributes.insert("k".to_owned(), format!("v{}", self.choices.below(3)));
        }
        let tag_name = self.choices.chance(50).then(|| "note".to_owned());
        self.plain.push(id.clone());
        self.rows.push(Some(id.clone()));
        (
            sub.to_owned(),
            RecordBody::Signal {
                message_id: id,
                signal_type: signal_type.to_owned(),
                body: format!("signal-{}", self.choices.piece()),
                attributes,
                tag_name,
            },
        )
    }

    /// 1 or 2 signals a callback appends (of an application's types, or of types the runtime
    /// classifies as hidden), then `marker`.
    fn appends(&mut self, sub: &str, marker: RecordBody) -> Vec<(String, RecordBody)> {
        let mut batch = Vec::new();
        for _ in 0..1 + self.choices.below(2) {
            let signal_type =
                ["ticket_opened", "stream_interrupted", "reminder", "stream_continued"][self.choices.below(4) as usize];
            batch.push(self.signal(sub, signal_type));
        }
        batch.push((sub.to_owned(), marker));
        batch
    }

    /// Maybe a narration before a step's model call: a `resources`, `instructions` or
    /// `environment` signal with the resources' snapshot.
    fn narration(&mut self, sub: &str) {
        if !self.choices.chance(10) {
            return;
        }
        let signal_type = ["resources", "instructions", "environment"][self.choices.below(3) as usize];
        let signal = self.signal(sub, signal_type);
        self.push(vec![
            signal,
            (
                sub.to_owned(),
                RecordBody::ResourceSnapshot {
                    snapshot: Default::default(),
                    baseline: None,
                },
            ),
        ]);
    }

    /// Maybe rows written after a step: a row injected through the thread (a batch of its
    /// own, with the update of its name when a hook gave it one), and, when a step follows
    /// (`more`), a finish cycle's appended signals with its marker.
    fn interjection(&mut self, sub: &str, more: bool) {
        if self.choices.chance(15) {
            self.made += 1;
            let id = format!("note_{}", self.made);
            let role = [MessageRole::User, MessageRole::System, MessageRole::Assistant][self.choices.below(3) as usize];
            let silent = self.choices.chance(30);
            let metadata = self.metadata(false);
            let mut batch = vec![(
                sub.to_owned(),
                RecordBody::MessageInjected {
                    message_id: id.clone(),
                    role,
                    content: format!("note-{}", self.choices.piece()),
                    silent,
                    metadata,
                },
            )];
            if self.choices.chance(30) {
                let mut updates = Map::new();
                updates.insert("name".into(), json!("helper"));
                batch.push((
                    sub.to_owned(),
                    RecordBody::MessageUpdated {
                        message_id: id.clone(),
                        updates,
                    },
                ));
            }
            self.plain.push(id.clone());
            self.rows.push(Some(id));
            self.push(batch);
        }
        if more && self.choices.chance(10) {
            let batch = self.appends(sub, RecordBody::AgentFinishCycle);
            self.push(batch);
        }
    }

    /// Maybe a batch or two editing or deleting history rows.
    fn history_edits(&mut self, sub: &str) {
        for _ in 0..2 {
            if !self.choices.chance(30) {
                return;
            }
            self.history_edit(sub);
        }
    }

    /// A batch editing or deleting a history row (or joined to the last batch).
    fn history_edit(&mut self, sub: &str) {
        let partless = self.features.partless_history_edits;
        let mut targets: Vec<String> = self
            .completed
            .iter()
            .filter(|(_, has_text)| partless || *has_text)
            .map(|(step, _)| step.clone())
            .collect();
        if partless {
            targets.extend(self.abandoned.iter().cloned());
        }
        targets.extend(self.plain.iter().cloned());
        if targets.is_empty() {
            return;
        }
        let target = targets[self.choices.below(targets.len() as u32) as usize].clone();
        // The content, the metadata, the display, or some of them (and fields not shown), or a
        // deletion.
        let edit = self.choices.below(5);
        let body = if edit == 1 {
            if !self.features.partless_history_edits {
                // Delete a row only once.
                self.completed.retain(|(step, _)| *step != target);
            }
            self.plain.retain(|row| *row != target);
            self.rows.retain(|row| row.as_ref() != Some(&target));
            RecordBody::MessageDeleted { message_id: target }
        } else {
            let mut updates = serde_json::Map::new();
            if edit == 0 || (edit == 4 && self.choices.chance(50)) {
                updates.insert("content".into(), json!(format!("edited-{}", self.choices.piece())));
            }
            if edit == 2 || (edit == 4 && self.choices.chance(50)) {
                let metadata = if self.choices.chance(20) {
                    Value::Null
                } else {
                    Value::Object(self.metadata(true))
                };
                // Replaced on a plain row (its members that are not `null`; `{}` or only
                // `null`s on a row that had none sends no chunk), merged into a step's response.
                updates.insert("metadata".into(), metadata);
            }
            if edit == 3 || (edit == 4 && self.choices.chance(50)) {
                updates.insert("silent".into(), json!(self.choices.chance(60)));
            }
            if edit == 4 && self.choices.chance(30) {
                updates.insert("status".into(), json!("completed"));
                updates.insert("name".into(), json!("renamed"));
            }
            RecordBody::MessageUpdated {
                message_id: target.clone(),
                updates,
            }
        };
        self.push_or_join(vec![(sub.to_owned(), body)]);
    }

    /// A compaction as `Response::compact` appends it: a batch of its own, the summary and
    /// maybe the resources' new baseline. There is one only when the conversation has a row to
    /// keep after the oldest (`Conversation::compaction_cut`); the rows before the kept one
    /// give way to the summary's.
    fn compaction(&mut self, sub: &str, reason: &str) {
        if self.rows.len() < 2 {
            return;
        }
        let cut = 1 + self.choices.below(self.rows.len() as u32 - 1) as usize;
        let Some(first_kept) = self.rows[cut].clone() else {
            return;
        };
        self.rows.drain(..cut);
        self.rows.insert(0, None);
        let mut batch = vec![(
            sub.to_owned(),
            RecordBody::Compaction {
                summary: format!("summary-{}", self.choices.piece()),
                first_kept_message_id: first_kept,
                tokens_before: 1000,
                reason: reason.to_owned(),
                usage: None,
            },
        )];
        if self.choices.chance(50) {
            batch.push((
                sub.to_owned(),
                RecordBody::ResourceSnapshot {
                    snapshot: Default::default(),
                    baseline: None,
                },
            ));
        }
        self.push(batch);
    }

    /// Maybe a threshold compaction, before a step's first call (`compact_if_needed`).
    fn threshold_compaction(&mut self, sub: &str) {
        if self.choices.chance(20) {
            self.compaction(sub, "threshold");
        }
    }

    /// One step: maybe a threshold compaction, then attempts that may stream, restart, overflow
    /// the context, die; then it completes, or is left streaming (`may_dangle`: it is the
    /// submission's last). The id of the step that ended the response's stream open, if any.
    fn step(&mut self, sub: &str, id_of: &mut dyn FnMut() -> String, may_dangle: bool) -> Option<String> {
        let mut id = id_of();
        self.threshold_compaction(sub);
        let mut opened = false;
        let mut restarted = false;
        // Whether the step's call overflowed the context once already (the next overflow fails
        // the response).
        let mut overflowed = false;
        for _attempt in 0..4 {
            let (mut reasoning, mut text) = (String::new(), String::new());
            for _ in 0..self.choices.below(4) {
                let mut batch = Vec::new();
                if !opened || restarted {
                    batch.push((sub.to_owned(), self.start(&id)));
                    opened = true;
                    restarted = false;
                }
                let kind = self.choices.below(3);
                if kind != 1 && text.is_empty() {
                    let delta = self.choices.piece();
                    reasoning.push_str(&delta);
                    batch.push((
                        sub.to_owned(),
                        RecordBody::AssistantReasoningDelta {
                            message_id: id.clone(),
                            delta,
                        },
                    ));
                }
                if kind != 0 || !text.is_empty() {
                    let delta = self.choices.piece();
                    text.push_str(&delta);
                    batch.push((
                        sub.to_owned(),
                        RecordBody::AssistantTextDelta {
                            message_id: id.clone(),
                            delta,
                        },
                    ));
                }
                if self.features.data_anywhere && self.choices.chance(15) {
                    let write = self.data_write(sub);
                    batch.push(write);
                }
                self.push(batch);
                // Once the response has a completed step, a data write is appended as it is
                // made: between two of a later step's streaming batches too.
                if !self.features.data_anywhere && self.stepped && self.choices.chance(10) {
                    let write = self.data_write(sub);
                    self.push(vec![write]);
                }
            }
            match self.choices.below(5) {
                // A retried call: the same step again (its next append starts it again).
                1 => {
                    restarted = opened;
                    continue;
                }
                // The attempt died: the next attempt's step has a new id (and its model step
                // may compact first).
                2 => {
                    if opened {
                        self.abandoned.push(id.clone());
                    }
                    id = id_of();
                    self.threshold_compaction(sub);
                    opened = false;
                    restarted = false;
                    overflowed = false;
                    continue;
                }
                3 if may_dangle && opened => return Some(id),
                // The call overflowed the context window, maybe after it streamed: an overflow
                // compaction, then the call again, as a retried one (`live.restart()`).
                4 if !overflowed && self.rows.len() >= 2 => {
                    self.compaction(sub, "overflow");
                    overflowed = true;
                    restarted = opened;
                    continue;
                }
                _ => {}
            }
            self.complete(sub, &id, opened, &reasoning, &text);
            return None;
        }
        self.complete(sub, &id, opened, "", "");
        None
    }

    fn final_value(&mut self, streamed: &str) -> String {
        match self.choices.below(4) {
            0 => streamed.to_owned(),
            1 => format!("{streamed}{}", self.choices.piece()),
            2 => self.choices.piece(),
            _ => String::new(),
        }
    }

    fn complete(&mut self, sub: &str, id: &str, opened: bool, reasoning: &str, text: &str) {
        let reasoning = self.final_value(reasoning);
        let text = self.final_value(text);
        let has_text = !text.is_empty();
        let mut batch = Vec::new();
        if !opened {
            batch.push((sub.to_owned(), self.start(id)));
        }
        let calls: Vec<String> = (0..self.choices.below(3)).map(|n| format!("call_{id}_{n}")).collect();
        for (n, call) in calls.iter().enumerate() {
            batch.push((
                sub.to_owned(),
                RecordBody::AssistantToolCall {
                    message_id: id.to_owned(),
                    tool_call_id: call.clone(),
                    name: "lookup".into(),
                    arguments: format!("{{\"n\":{n}}}"),
                },
            ));
        }
        batch.push((
            sub.to_owned(),
            RecordBody::AssistantMessageCompleted {
                message_id: id.to_owned(),
                text,
                reasoning,
                stop_reason: if calls.is_empty() {
                    StopReason::Stop
                } else {
                    StopReason::ToolUse
                },
                usage: Default::default(),
                reasoning_blocks: Vec::new(),
            },
        ));
        // A `before_create_message` hook's row fields, in the creating batch (such agents
        // stream nothing early).
        if !opened && self.choices.chance(15) {
            let mut updates = serde_json::Map::new();
            updates.insert("content".into(), json!(format!("hooked-{}", self.choices.piece())));
            if self.choices.chance(30) {
                updates.insert("silent".into(), json!(true));
            }
            if self.choices.chance(30) {
                updates.insert("metadata".into(), Value::Object(self.metadata(false)));
            }
            batch.push((
                sub.to_owned(),
                RecordBody::MessageUpdated {
                    message_id: id.to_owned(),
                    updates,
                },
            ));
        }
        if self.features.data_anywhere && self.choices.chance(15) {
            let write = self.data_write(sub);
            batch.push(write);
        }
        self.push(batch);
        self.stepped = true;
        if let Some(call) = calls.first()
            && self.choices.chance(15)
        {
            // A `task` call's child, linked while the call runs (its birth record is in its own
            // stream).
            self.push(vec![(
                sub.to_owned(),
                RecordBody::ChildSessionRetained {
                    task_id: format!("task_{call}"),
                    kind: ConversationKind::Task,
                    child: InstanceKey::new("a", format!("i/task_{call}")),
                    parent_tool_call_id: call.clone(),
                },
            )]);
        }
        if !calls.is_empty() {
            let outcomes: Vec<(String, RecordBody)> = calls
                .iter()
                .enumerate()
                .map(|(n, call)| {
                    let is_error = self.choices.chance(30);
                    // A tool that answered a value: clients get the value.
                    let output = (!is_error && self.choices.chance(50)).then(|| json!({"out": n}));
                    (
                        sub.to_owned(),
                        RecordBody::ToolOutcome {
                            output,
                            assistant_message_id: id.to_owned(),
                            tool_call_id: call.clone(),
                            tool_name: "lookup".into(),
                            is_error,
                            content: format!("out-{n}"),
                            terminate: false,
                            duration_ms: n as u64,
                        },
                    )
                })
                .collect();
            let commit = (
                sub.to_owned(),
                RecordBody::ToolResultsCommitted {
                    assistant_message_id: id.to_owned(),
                },
            );
            if self.choices.chance(15) {
                // The attempt died before the commit and its outcomes are answered again (a
                // stream of an earlier build, or a settlement that raced a late append): the
                // first outcome of each call stands.
                self.push(outcomes.clone());
                let again = outcomes
                    .into_iter()
                    .map(|(sub, mut body)| {
                        if let RecordBody::ToolOutcome { content, is_error, .. } = &mut body {
                            *content = format!("again-{content}");
                            *is_error = !*is_error;
                        }
                        (sub, body)
                    })
                    .collect::<Vec<_>>();
                let mut batch = again;
                batch.push(commit);
                self.push(batch);
            } else if self.choices.chance(50) {
                self.push(outcomes);
                self.push(vec![commit]);
            } else {
                let mut batch = outcomes;
                batch.push(commit);
                self.push(batch);
            }
        }
        self.completed.push((id.to_owned(), has_text));
        self.rows.push(Some(id.to_owned()));
    }

    fn submission(&mut self, k: u32, settle: bool) {
        let sub = format!("sub_{k}");
        // The input: a user message, or a signal delivered.
        let input = if self.choices.chance(85) {
            let user = format!("user_{k}");
            self.plain.push(user.clone());
            self.rows.push(Some(user.clone()));
            (
                sub.clone(),
                RecordBody::UserMessage {
                    message_id: user,
                    body: format!("question {k}"),
                    attachments: Vec::new(),
                },
            )
        } else {
            self.signal(&sub, "ticket_opened")
        };
        let mut first = vec![input];
        self.stepped = false;
        let start_metadata = self.choices.chance(20).then(|| self.metadata(false));
        self.first_step = (format!("s{k}_1"), start_metadata);
        if self.features.data_anywhere && self.choices.chance(30) {
            let write = self.data_write(&sub);
            first.push(write);
        }
        self.push(first);
        if self.choices.chance(15) {
            let seam = self.appends(&sub, RecordBody::AgentStartRun);
            self.push(seam);
        }
        let steps = 1 + self.choices.below(3);
        let mut next = 0;
        let mut id_of = move || {
            next += 1;
            format!("s{k}_{next}")
        };
        let mut dangling = None;
        for n in 0..steps {
            self.narration(&sub);
            dangling = self.step(&sub, &mut id_of, n + 1 == steps);
            if dangling.is_none() {
                self.history_edits(&sub);
                self.interjection(&sub, n + 1 < steps);
            }
            if self.features.data_anywhere && self.choices.chance(15) {
                let write = self.data_write(&sub);
                self.push_or_join(vec![write]);
            } else if self.stepped && dangling.is_none() && self.choices.chance(20) {
                let write = self.data_write(&sub);
                self.push(vec![write]);
            }
        }
        if dangling.is_none() && self.choices.chance(40) {
            // The response's finish: its `use_response_finish` callbacks' metadata (empty when
            // they contributed none: it only marks the batch durable).
            let metadata = self.metadata(false);
            self.push(vec![(sub.clone(), RecordBody::MessageMetadata { metadata })]);
        }
        if settle || self.choices.chance(70) {
            let outcome = [Outcome::Completed, Outcome::Aborted, Outcome::Failed][self.choices.below(3) as usize];
            // Why it ended, before the settlement in its batch (`terminal_advisory`).
            let mut batch = Vec::new();
            if outcome != Outcome::Completed && self.choices.chance(50) {
                let signal_type = if outcome == Outcome::Aborted {
                    "submission_aborted"
                } else {
                    "submission_interrupted"
                };
                batch.push(self.signal(&sub, signal_type));
            }
            batch.push((sub.clone(), RecordBody::SubmissionSettled { outcome, error: None }));
            self.push_or_join(batch);
            // A step left streaming is closed: it can be edited from now on.
            if let Some(step) = dangling {
                self.abandoned.push(step);
            }
        }
    }
}

/// A random valid stream of one or two submissions.
fn generate(bytes: &[u8], features: Features) -> Stream {
    let mut choices = Choices { bytes, at: 0 };
    let submissions = 1 + choices.below(2);
    let mut generator = Generator {
        choices: &mut choices,
        features,
        batches: Vec::new(),
        completed: Vec::new(),
        abandoned: Vec::new(),
        plain: Vec::new(),
        rows: Vec::new(),
        stepped: false,
        first_step: (String::new(), None),
        made: 0,
    };
    for k in 1..=submissions {
        generator.submission(k, k < submissions);
    }
    generator.batches
}

fn batches_of(stream: &Stream) -> Vec<Batch> {
    stream
        .iter()
        .enumerate()
        .map(|(offset, bodies)| Batch {
            offset: offset as u64,
            records: bodies.iter().map(|(sub, body)| record(sub, body.clone())).collect(),
        })
        .collect()
}

/// The stream, one line a batch, for failure messages.
fn describe(stream: &Stream) -> String {
    let mut out = String::new();
    for (offset, batch) in stream.iter().enumerate() {
        out.push_str(&format!("batch {offset}:\n"));
        for (sub, body) in batch {
            out.push_str(&format!(
                "  {sub}: {}\n",
                serde_json::to_string(body).unwrap_or_default()
            ));
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The naive model

#[derive(Clone, Debug)]
enum Item {
    /// Where a step's reasoning and text parts go.
    Step(String),
    Tool(String),
    Data(String),
}

#[derive(Default)]
struct Part {
    /// The part (text, state), when the step has one.
    shown: Option<(String, &'static str)>,
    /// What streamed while the step streams it (dropped by the response's next start).
    live: Option<String>,
}

#[derive(Default)]
struct Step {
    submission: String,
    reasoning: Part,
    text: Part,
    calls: Vec<String>,
    /// Whether its row is silent.
    silent: bool,
    /// Whether it completed and its row was not deleted.
    completed: bool,
}

enum Message {
    Plain(Value),
    Response {
        id: String,
        submission: String,
        items: Vec<Item>,
        /// Its metadata, once something merged into it.
        metadata: Option<Map<String, Value>>,
    },
}

/// Deep-merges `patch` into `base` (the reference's rules): later members win, `null` ones are
/// skipped, objects on both sides merge (an object placed whole loses its `null` members).
fn deep_merge(base: &mut Map<String, Value>, patch: &Map<String, Value>) {
    for (key, value) in patch {
        match (base.get_mut(key), value) {
            (_, Value::Null) => {}
            (Some(Value::Object(existing)), Value::Object(incoming)) => deep_merge(existing, incoming),
            (_, Value::Object(incoming)) => {
                let mut placed = Map::new();
                deep_merge(&mut placed, incoming);
                base.insert(key.clone(), Value::Object(placed));
            }
            (_, value) => {
                base.insert(key.clone(), value.clone());
            }
        }
    }
}

/// Deep-merges `patch` into `base` as the reference SDK's client does: later members win,
/// `null` ones included; objects on both sides merge.
fn sdk_merge(base: &mut Map<String, Value>, patch: &Map<String, Value>) {
    for (key, value) in patch {
        match (base.get_mut(key), value) {
            (Some(Value::Object(existing)), Value::Object(incoming)) => sdk_merge(existing, incoming),
            (_, value) => {
                base.insert(key.clone(), value.clone());
            }
        }
    }
}

#[derive(Default)]
struct Model {
    messages: Vec<Message>,
    steps: HashMap<String, Step>,
    tools: HashMap<String, Value>,
    /// (response id, name) → data.
    data: HashMap<(String, String), Value>,
    outcomes: HashMap<String, (bool, Value, u64)>,
    early: HashMap<String, Vec<(String, Value)>>,
    /// Plain message id → its display when it is not silent.
    shown: HashMap<String, &'static str>,
}

impl Model {
    fn response(&mut self, submission: &str) -> Option<(&String, &mut Vec<Item>)> {
        self.messages.iter_mut().find_map(|message| match message {
            Message::Response {
                id,
                submission: of,
                items,
                ..
            } if of == submission => Some((&*id, items)),
            _ => None,
        })
    }

    /// Merges `metadata` into `submission`'s response's, when it has a response.
    fn merge_response_metadata(&mut self, submission: &str, metadata: &Map<String, Value>) {
        for message in &mut self.messages {
            if let Message::Response {
                submission: of,
                metadata: current,
                ..
            } = message
                && of == submission
            {
                deep_merge(current.get_or_insert_with(Map::new), metadata);
            }
        }
    }

    fn plain(&mut self, id: &str) -> Option<&mut Value> {
        self.messages.iter_mut().find_map(|message| match message {
            Message::Plain(message) if message["id"] == id => Some(message),
            _ => None,
        })
    }

    fn set_data(&mut self, submission: &str, name: &str, data: &Value) {
        let Some((id, items)) = self.response(submission) else {
            self.early
                .entry(submission.to_owned())
                .or_default()
                .push((name.to_owned(), data.clone()));
            return;
        };
        let id = id.clone();
        if !items.iter().any(|item| matches!(item, Item::Data(n) if n == name)) {
            items.push(Item::Data(name.to_owned()));
        }
        self.data.insert((id, name.to_owned()), data.clone());
    }

    fn apply(&mut self, record: &Record) {
        let submission = record.submission_id.as_deref().unwrap_or_default();
        match &record.body {
            RecordBody::UserMessage { message_id, body, .. } => {
                self.messages.push(Message::Plain(json!({
                    "id": message_id,
                    "role": "user",
                    "purpose": "user",
                    "display": "visible",
                    "parts": [{"type": "text", "text": body, "state": "done"}],
                    "submissionId": submission,
                })));
            }
            RecordBody::AssistantMessageStarted { message_id, .. } => {
                if self.response(submission).is_none() {
                    self.messages.push(Message::Response {
                        id: message_id.clone(),
                        submission: submission.to_owned(),
                        items: Vec::new(),
                        metadata: None,
                    });
                }
                if let RecordBody::AssistantMessageStarted {
                    response_metadata: Some(metadata),
                    ..
                } = &record.body
                    && !metadata.is_empty()
                {
                    self.merge_response_metadata(submission, metadata);
                }
                // What the response's steps stream and did not complete goes.
                for step in self.steps.values_mut().filter(|step| step.submission == submission) {
                    for part in [&mut step.reasoning, &mut step.text] {
                        if part.live.take().is_some() {
                            part.shown = None;
                        }
                    }
                }
                let (_, items) = self.response(submission).expect("made above");
                items.retain(|item| !matches!(item, Item::Step(step) if step == message_id));
                items.push(Item::Step(message_id.clone()));
                self.steps.insert(
                    message_id.clone(),
                    Step {
                        submission: submission.to_owned(),
                        ..Step::default()
                    },
                );
                for (name, data) in self.early.remove(submission).unwrap_or_default() {
                    self.set_data(submission, &name, &data);
                }
            }
            RecordBody::AssistantReasoningDelta { message_id, delta } => {
                if let Some(step) = self.steps.get_mut(message_id) {
                    let live = step.reasoning.live.get_or_insert_with(String::new);
                    live.push_str(delta);
                    step.reasoning.shown = Some((live.clone(), "streaming"));
                }
            }
            RecordBody::AssistantTextDelta { message_id, delta } => {
                if let Some(step) = self.steps.get_mut(message_id) {
                    let live = step.text.live.get_or_insert_with(String::new);
                    live.push_str(delta);
                    step.text.shown = Some((live.clone(), "streaming"));
                    if let Some((_, state)) = &mut step.reasoning.shown {
                        *state = "done";
                    }
                }
            }
            RecordBody::AssistantMessageCompleted {
                message_id,
                text,
                reasoning,
                ..
            } => {
                if let Some(step) = self.steps.get_mut(message_id) {
                    step.completed = true;
                    for (part, value) in [(&mut step.reasoning, reasoning), (&mut step.text, text)] {
                        part.live = None;
                        part.shown = (!value.is_empty()).then(|| (value.clone(), "done"));
                    }
                }
            }
            RecordBody::AssistantToolCall {
                message_id,
                tool_call_id,
                name,
                arguments,
            } => {
                let Some(step) = self.steps.get_mut(message_id) else {
                    return;
                };
                step.calls.push(tool_call_id.clone());
                let submission = step.submission.clone();
                let input = serde_json::from_str::<Value>(arguments).unwrap_or_else(|_| json!(arguments));
                self.tools.insert(
                    tool_call_id.clone(),
                    json!({
                        "type": "dynamic-tool",
                        "toolCallId": tool_call_id,
                        "toolName": name,
                        "state": "input-available",
                        "input": input,
                    }),
                );
                if let Some((_, items)) = self.response(&submission) {
                    items.push(Item::Tool(tool_call_id.clone()));
                }
            }
            RecordBody::ToolOutcome {
                tool_call_id,
                is_error,
                content,
                output,
                duration_ms,
                ..
            } => {
                // First write wins, as the conversation reads a call's outcomes. A value the
                // tool answered is what clients get; else (and for an error) the text.
                let shown = match output {
                    Some(value) if !*is_error => value.clone(),
                    _ => json!(content),
                };
                self.outcomes
                    .entry(tool_call_id.clone())
                    .or_insert_with(|| (*is_error, shown, *duration_ms));
            }
            RecordBody::ToolResultsCommitted { assistant_message_id } => {
                let calls = self
                    .steps
                    .get(assistant_message_id)
                    .map(|step| step.calls.clone())
                    .unwrap_or_default();
                for call in calls {
                    let (Some((is_error, content, duration)), Some(part)) =
                        (self.outcomes.remove(&call), self.tools.get_mut(&call))
                    else {
                        continue;
                    };
                    if is_error {
                        part["state"] = json!("output-error");
                        part["errorText"] = content;
                    } else {
                        part["state"] = json!("output-available");
                        part["output"] = content;
                    }
                    part["durationMs"] = json!(duration);
                }
            }
            RecordBody::MessageDataWrite { name, data } => self.set_data(submission, name, data),
            RecordBody::SubmissionSettled { .. } => {
                for step in self.steps.values_mut().filter(|step| step.submission == submission) {
                    for part in [&mut step.reasoning, &mut step.text] {
                        if part.live.take().is_some()
                            && let Some((_, state)) = &mut part.shown
                        {
                            *state = "done";
                        }
                    }
                }
            }
            RecordBody::MessageUpdated { message_id, updates } => {
                let content = updates.get("content").and_then(Value::as_str);
                let silent = updates.get("silent").and_then(Value::as_bool);
                let metadata = updates.get("metadata");
                if let Some(step) = self.steps.get_mut(message_id) {
                    if let (Some(content), Some((text, _))) = (content, &mut step.text.shown) {
                        *text = content.to_owned();
                    }
                    if let Some(silent) = silent {
                        step.silent = silent;
                    }
                    // Merged into the response's (with the other steps').
                    if let Some(Value::Object(metadata)) = metadata {
                        let submission = step.submission.clone();
                        self.merge_response_metadata(&submission, metadata);
                    }
                } else if let Some(message) = self.plain(message_id) {
                    if let Some(content) = content
                        && message["parts"][0]["type"] == "text"
                    {
                        message["parts"][0]["text"] = json!(content);
                    }
                    if let Some(metadata @ (Value::Object(_) | Value::Null)) = metadata {
                        // Replaced, as the row's is.
                        let mut replaced = Map::new();
                        if let Value::Object(metadata) = metadata {
                            deep_merge(&mut replaced, metadata);
                        }
                        let fields = message.as_object_mut().expect("a message is an object");
                        if replaced.is_empty() {
                            fields.remove("metadata");
                        } else {
                            fields.insert("metadata".into(), Value::Object(replaced));
                        }
                    }
                    if let Some(silent) = silent {
                        let shown = self.shown.get(message_id.as_str()).copied().unwrap_or("visible");
                        if let Some(message) = self.plain(message_id) {
                            message["display"] = json!(if silent { "hidden" } else { shown });
                        }
                    }
                }
            }
            RecordBody::MessageMetadata { metadata } if !metadata.is_empty() => {
                self.merge_response_metadata(submission, metadata);
            }
            RecordBody::Signal {
                message_id,
                signal_type,
                body,
                attributes,
                tag_name,
            } => {
                // The reference's classification (§4.6).
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
                    "submissionId": submission,
                });
                if tag_name.is_some() || !attributes.is_empty() {
                    let mut signal = json!({});
                    if let Some(tag_name) = tag_name {
                        signal["tagName"] = json!(tag_name);
                    }
                    if !attributes.is_empty() {
                        signal["attributes"] = json!(attributes);
                    }
                    message["signal"] = signal;
                }
                if let Some(outcome) = settlement {
                    message["settlement"] = json!({"outcome": outcome});
                }
                self.shown.insert(message_id.clone(), display);
                self.messages.push(Message::Plain(message));
            }
            RecordBody::MessageInjected {
                message_id,
                role,
                content,
                silent,
                metadata,
            } => {
                let (role, purpose) = match role {
                    MessageRole::Assistant => ("assistant", "assistant"),
                    MessageRole::System => ("system", "advisory"),
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
                self.messages.push(Message::Plain(message));
            }
            RecordBody::Compaction { summary, reason, .. } => {
                // A diagnostic system message of its own, where it happened; nothing shown
                // before it changes.
                self.messages.push(Message::Plain(json!({
                    "id": record.id,
                    "role": "system",
                    "purpose": "advisory",
                    "display": "diagnostic",
                    "signal": {"tagName": "conversation-summary", "attributes": {"reason": reason}},
                    "parts": [{"type": "text", "text": summary, "state": "done"}],
                })));
            }
            RecordBody::MessageDeleted { message_id } => {
                if let Some(step) = self.steps.get_mut(message_id) {
                    step.reasoning.shown = None;
                    step.text.shown = None;
                    step.completed = false;
                } else {
                    self.messages
                        .retain(|message| !matches!(message, Message::Plain(m) if m["id"] == message_id.as_str()));
                }
            }
            _ => {}
        }
    }

    fn messages(&self) -> Value {
        let messages: Vec<Value> = self
            .messages
            .iter()
            .map(|message| match message {
                Message::Plain(message) => message.clone(),
                Message::Response {
                    id,
                    submission,
                    items,
                    metadata,
                } => {
                    let mut parts = Vec::new();
                    for item in items {
                        match item {
                            Item::Step(step) => {
                                let step = &self.steps[step];
                                for (kind, part) in [("reasoning", &step.reasoning), ("text", &step.text)] {
                                    if let Some((text, state)) = &part.shown {
                                        parts.push(json!({"type": kind, "text": text, "state": state}));
                                    }
                                }
                            }
                            Item::Tool(call) => parts.push(self.tools[call].clone()),
                            Item::Data(name) => parts.push(json!({
                                "type": format!("data-{name}"),
                                "data": self.data[&(id.clone(), name.clone())],
                            })),
                        }
                    }
                    // Hidden while every step that counts (completed and not deleted, or the
                    // newest) is silent.
                    let steps: Vec<&String> = items
                        .iter()
                        .filter_map(|item| match item {
                            Item::Step(step) => Some(step),
                            _ => None,
                        })
                        .collect();
                    let counted: Vec<&Step> = steps
                        .iter()
                        .filter(|step| self.steps[**step].completed || steps.last() == Some(*step))
                        .map(|step| &self.steps[*step])
                        .collect();
                    let hidden = !counted.is_empty() && counted.iter().all(|step| step.silent);
                    let mut message = json!({
                        "id": id,
                        "role": "assistant",
                        "purpose": "assistant",
                        "display": if hidden { "hidden" } else { "visible" },
                        "turnId": id,
                        "submissionId": submission,
                        "parts": parts,
                    });
                    if let Some(metadata) = metadata {
                        message["metadata"] = Value::Object(metadata.clone());
                    }
                    message
                }
            })
            .collect();
        Value::Array(messages)
    }
}

// ---------------------------------------------------------------------------------------------
// The properties

/// Folds `stream` batch by batch (with chunks or without), and all at once; checks the
/// snapshots agree with each other and with the model.
fn check(stream: &Stream) -> Result<(), TestCaseError> {
    let batches = batches_of(stream);
    let mut with_chunks = Projection::new("agents/a/i");
    let mut without = Projection::new("agents/a/i");
    let mut model = Model::default();
    for batch in &batches {
        let mut chunks = Vec::new();
        with_chunks.apply(batch, Some(&mut chunks));
        without.apply(batch, None);
    }
    for record in batches.iter().flat_map(|batch| batch.records.iter()) {
        model.apply(record);
    }
    let snapshot = with_chunks.snapshot();
    prop_assert_eq!(
        &snapshot,
        &without.snapshot(),
        "folding with chunks and without differ\n{}",
        describe(stream)
    );
    let expected = model.messages();
    prop_assert_eq!(
        &snapshot["messages"],
        &expected,
        "the snapshot's messages are not the model's\n{}",
        describe(stream)
    );
    let mut whole = Projection::new("agents/a/i");
    let all: Vec<Record> = batches.iter().flat_map(|batch| batch.records.iter().cloned()).collect();
    whole.apply(
        &Batch {
            offset: batches.len().saturating_sub(1) as u64,
            records: Arc::from(all),
        },
        None,
    );
    let whole = whole.snapshot();
    prop_assert_eq!(
        (&whole["messages"], &whole["settlements"]),
        (&snapshot["messages"], &snapshot["settlements"]),
        "folding the stream as one batch differs from folding it batch by batch\n{}",
        describe(stream)
    );
    Ok(())
}

fn run(features: Features, property: fn(&Stream) -> Result<(), TestCaseError>) {
    let mut runner = TestRunner::new(Config {
        cases: std::env::var("PROJECTION_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(3000),
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&prop::collection::vec(any::<u8>(), 0..300), |bytes| {
        property(&generate(&bytes, features))
    });
    if let Err(error) = result {
        panic!("{error}");
    }
}

#[test]
fn projection_snapshots_match_a_naive_model_of_random_streams() {
    run(ALL, check);
}

#[test]
fn projection_snapshots_match_a_naive_model_without_edits_of_partless_steps() {
    run(
        Features {
            partless_history_edits: false,
            ..ALL
        },
        check,
    );
}

/// A client of the updates: applies each batch's chunks to what it shows, extending the last
/// streaming part of a kind with each `message-delta` (the protocol's deltas name no part).
#[derive(Default)]
struct Client {
    messages: Vec<Value>,
    settlements: Vec<Value>,
}

impl Client {
    fn message(&mut self, id: &Value) -> Option<&mut Value> {
        self.messages.iter_mut().find(|message| message["id"] == *id)
    }

    /// `message-completed`: every text and reasoning part is done.
    fn close_streaming(message: &mut Value) {
        for part in message["parts"].as_array_mut().into_iter().flatten() {
            if part["state"] == "streaming" {
                part["state"] = json!("done");
            }
        }
    }

    /// A block boundary closes the part before it, when that is streaming text or reasoning.
    fn close_if_streaming(part: Option<&mut Value>) {
        if let Some(part) = part
            && (part["type"] == "text" || part["type"] == "reasoning")
            && part["state"] == "streaming"
        {
            part["state"] = json!("done");
        }
    }

    /// `message-metadata` (and a `message-started` carrying metadata): deep-merged into the
    /// message's metadata (made when it has none), as the reference SDK's reducer merges it: a
    /// `null` member is a value like any other (only the crate's own merge skips it).
    fn merge_metadata(&mut self, chunk: &Value) {
        let Some(metadata) = chunk["metadata"].as_object() else {
            return;
        };
        if let Some(Value::Object(message)) = self.message(&chunk["messageId"])
            && let Value::Object(target) = message.entry("metadata").or_insert_with(|| json!({}))
        {
            sdk_merge(target, metadata);
        }
    }

    fn apply(&mut self, chunk: &Value) {
        match chunk["type"].as_str().unwrap_or_default() {
            "conversation-reset" => {
                self.messages = chunk["snapshot"]["messages"].as_array().cloned().unwrap_or_default();
                self.settlements = chunk["snapshot"]["settlements"].as_array().cloned().unwrap_or_default();
            }
            "message-appended" => match self.message(&chunk["message"]["id"]) {
                Some(message) => *message = chunk["message"].clone(),
                None => self.messages.push(chunk["message"].clone()),
            },
            "message-started" => {
                if self.message(&chunk["messageId"]).is_none() {
                    let mut message = json!({
                        "id": chunk["messageId"],
                        "role": "assistant",
                        "purpose": "assistant",
                        "display": "visible",
                        "turnId": chunk["turnId"],
                        "parts": [],
                    });
                    if chunk.get("submissionId").is_some() {
                        message["submissionId"] = chunk["submissionId"].clone();
                    }
                    self.messages.push(message);
                }
                self.merge_metadata(chunk);
            }
            "message-metadata" => self.merge_metadata(chunk),
            "message-delta" => {
                let kind = chunk["kind"].as_str().unwrap_or_default().to_owned();
                let delta = chunk["delta"].as_str().unwrap_or_default();
                let Some(parts) = self
                    .message(&chunk["messageId"])
                    .and_then(|message| message["parts"].as_array_mut())
                else {
                    return;
                };
                // As the protocol's reducer does: the delta extends the message's last part
                // when it streams that kind; otherwise it closes that part (a streaming text
                // or reasoning one) and opens a new one.
                match parts.last_mut() {
                    Some(last) if last["type"] == kind.as_str() && last["state"] == "streaming" => {
                        last["text"] = json!(format!("{}{delta}", last["text"].as_str().unwrap_or_default()));
                    }
                    last => {
                        Self::close_if_streaming(last);
                        parts.push(json!({"type": kind, "text": delta, "state": "streaming"}));
                    }
                }
            }
            "message-completed" => {
                if let Some(message) = self.message(&chunk["messageId"]) {
                    Self::close_streaming(message);
                }
            }
            "tool-input" => {
                let part = json!({
                    "type": "dynamic-tool",
                    "toolCallId": chunk["toolCallId"],
                    "toolName": chunk["toolName"],
                    "state": "input-available",
                    "input": chunk["input"],
                });
                if let Some(message) = self.message(&chunk["messageId"])
                    && let Some(parts) = message["parts"].as_array_mut()
                    && !parts
                        .iter()
                        .any(|existing| existing["toolCallId"] == chunk["toolCallId"])
                {
                    // A tool call closes the part before it.
                    Self::close_if_streaming(parts.last_mut());
                    parts.push(part);
                }
            }
            kind @ ("tool-output" | "tool-output-error") => {
                for message in &mut self.messages {
                    for part in message["parts"].as_array_mut().into_iter().flatten() {
                        if part["toolCallId"] == chunk["toolCallId"] {
                            if kind == "tool-output" {
                                part["state"] = json!("output-available");
                                part["output"] = chunk["output"].clone();
                            } else {
                                part["state"] = json!("output-error");
                                part["errorText"] = chunk["errorText"].clone();
                            }
                            part["durationMs"] = chunk["durationMs"].clone();
                        }
                    }
                }
            }
            "data-part" => {
                let part_type = format!("data-{}", chunk["name"].as_str().unwrap_or_default());
                let data = chunk["data"].clone();
                let Some(message) = self.message(&chunk["messageId"]) else {
                    return;
                };
                let Some(parts) = message["parts"].as_array_mut() else {
                    return;
                };
                match parts.iter_mut().find(|part| part["type"] == part_type.as_str()) {
                    Some(part) => part["data"] = data,
                    None => parts.push(json!({"type": part_type, "data": data})),
                }
            }
            "submission-settled" => {
                let mut settlement = chunk.clone();
                if let Value::Object(fields) = &mut settlement {
                    for key in ["type", "timestamp", "conversationId", "position"] {
                        fields.remove(key);
                    }
                }
                // Upserted by submission; it closes no part (a message still streaming is
                // completed by its own chunk).
                match self
                    .settlements
                    .iter_mut()
                    .find(|existing| existing["submissionId"] == chunk["submissionId"])
                {
                    Some(existing) => *existing = settlement,
                    None => self.settlements.push(settlement),
                }
            }
            _ => {}
        }
    }
}

/// A client that applies each batch's chunks shows the snapshot after every batch.
fn check_chunks(stream: &Stream) -> Result<(), TestCaseError> {
    let mut projection = Projection::new("agents/a/i");
    let mut client = Client::default();
    for (offset, batch) in batches_of(stream).iter().enumerate() {
        let mut chunks = Vec::new();
        projection.apply(batch, Some(&mut chunks));
        for chunk in &chunks {
            client.apply(chunk);
        }
        let snapshot = projection.snapshot();
        prop_assert_eq!(
            (
                &Value::Array(client.messages.clone()),
                &Value::Array(client.settlements.clone())
            ),
            (&snapshot["messages"], &snapshot["settlements"]),
            "after batch {}, a client applying the chunks does not show the snapshot (chunks {})\n{}",
            offset,
            Value::Array(chunks),
            describe(stream)
        );
    }
    Ok(())
}

#[test]
fn projection_chunks_applied_by_a_client_show_the_snapshot() {
    run(REALISTIC, check_chunks);
    run(ALL, check_chunks);
}

/// The properties see compactions where the runtime writes them: a threshold one, and an
/// overflow one right after a step's streamed text, followed by the step started again or by
/// its completion without a start.
#[test]
fn generated_streams_hold_compactions_before_steps_and_after_streamed_text() {
    use proptest::strategy::ValueTree;

    let mut runner = TestRunner::deterministic();
    let strategy = prop::collection::vec(any::<u8>(), 0..300);
    let (mut threshold, mut started_again, mut completed_unstarted) = (false, false, false);
    for _ in 0..500 {
        let bytes = strategy.new_tree(&mut runner).unwrap().current();
        let stream = generate(&bytes, REALISTIC);
        for (at, batch) in stream.iter().enumerate() {
            let Some((_, RecordBody::Compaction { reason, .. })) = batch.first() else {
                continue;
            };
            if reason == "threshold" {
                threshold = true;
                continue;
            }
            let streamed = at.checked_sub(1).is_some_and(|before| {
                stream[before]
                    .iter()
                    .any(|(_, body)| matches!(body, RecordBody::AssistantTextDelta { .. }))
            });
            match stream.get(at + 1).and_then(|next| next.first()).map(|(_, body)| body) {
                Some(RecordBody::AssistantMessageStarted { .. }) if streamed => started_again = true,
                Some(RecordBody::AssistantToolCall { .. } | RecordBody::AssistantMessageCompleted { .. })
                    if streamed =>
                {
                    completed_unstarted = true;
                }
                _ => {}
            }
        }
    }
    assert!(threshold, "no threshold compaction");
    assert!(
        started_again,
        "no overflow after streamed text followed by the step's restart"
    );
    assert!(
        completed_unstarted,
        "no overflow after streamed text followed by the step's completion"
    );
}

/// The properties see the rows that are not a response's steps and the edits of their display
/// and metadata: signals of every classification (a delivered one, appended ones, a narration,
/// terminal advisories), injected rows (silent, with metadata), the response's start and
/// finish metadata (and an empty finish record), metadata updates that merge (a step's) or
/// replace (another row's, `null` too, members `null`), silent updates of steps and other rows,
/// a task child's link; and a client gets `message-metadata` chunks for steps and other rows,
/// not only resets.
#[test]
fn generated_streams_hold_signals_injected_rows_metadata_and_silent_updates() {
    use proptest::strategy::ValueTree;

    let mut runner = TestRunner::deterministic();
    let strategy = prop::collection::vec(any::<u8>(), 0..300);
    let mut seen: HashMap<&'static str, usize> = HashMap::new();
    for _ in 0..500 {
        let bytes = strategy.new_tree(&mut runner).unwrap().current();
        let stream = generate(&bytes, REALISTIC);
        let steps: Vec<&str> = stream
            .iter()
            .flatten()
            .filter_map(|(_, body)| match body {
                RecordBody::AssistantMessageStarted { message_id, .. } => Some(message_id.as_str()),
                _ => None,
            })
            .collect();
        let mut note = |kind: &'static str| *seen.entry(kind).or_default() += 1;
        for (at, batch) in stream.iter().enumerate() {
            for (_, body) in batch {
                match body {
                    RecordBody::Signal { signal_type, .. } => note(match signal_type.as_str() {
                        "stream_interrupted" | "stream_continued" => "a hidden signal",
                        "submission_aborted" | "submission_interrupted" => "a terminal advisory",
                        "resources" | "instructions" | "environment" => "a narration signal",
                        _ if at == 0 => "a delivered signal",
                        _ => "an application's signal",
                    }),
                    RecordBody::MessageInjected { silent, metadata, .. } => {
                        note("an injected row");
                        if *silent {
                            note("a silent injected row");
                        }
                        if !metadata.is_empty() {
                            note("an injected row with metadata");
                        }
                    }
                    RecordBody::AssistantMessageStarted {
                        response_metadata: Some(metadata),
                        ..
                    } if !metadata.is_empty() => note("start metadata"),
                    RecordBody::MessageMetadata { metadata } if metadata.is_empty() => note("an empty finish record"),
                    RecordBody::MessageMetadata { .. } => note("finish metadata"),
                    RecordBody::ChildSessionRetained { .. } => note("a child's link"),
                    RecordBody::MessageUpdated { message_id, updates } => {
                        let step = steps.contains(&message_id.as_str());
                        match (updates.get("metadata"), step) {
                            (Some(Value::Object(_)), true) => note("a step's metadata merged"),
                            (Some(Value::Object(metadata)), false) => {
                                note("a row's metadata replaced");
                                let null = |value: &Value| {
                                    value.is_null() || value.as_object().is_some_and(|o| o.values().any(Value::is_null))
                                };
                                if metadata.values().any(null) {
                                    note("a row's metadata with a null member");
                                }
                            }
                            (Some(Value::Null), false) => note("a row's metadata cleared"),
                            _ => {}
                        }
                        match (updates.get("silent"), step) {
                            (Some(Value::Bool(true)), true) => note("a step silenced"),
                            (Some(Value::Bool(false)), true) => note("a step shown"),
                            (Some(Value::Bool(true)), false) => note("a row silenced"),
                            (Some(Value::Bool(false)), false) => note("a row shown"),
                            _ => {}
                        }
                    }
                    _ => {}
                }
            }
        }
        let mut projection = Projection::new("agents/a/i");
        for batch in batches_of(&stream) {
            let mut chunks = Vec::new();
            projection.apply(&batch, Some(&mut chunks));
            for chunk in chunks.iter().filter(|chunk| chunk["type"] == "message-metadata") {
                note(if steps.iter().any(|step| chunk["messageId"] == *step) {
                    "a response's metadata chunk"
                } else {
                    "a row's metadata chunk"
                });
            }
        }
    }
    for kind in [
        "a hidden signal",
        "a terminal advisory",
        "a narration signal",
        "a delivered signal",
        "an application's signal",
        "an injected row",
        "a silent injected row",
        "an injected row with metadata",
        "start metadata",
        "an empty finish record",
        "finish metadata",
        "a child's link",
        "a step's metadata merged",
        "a row's metadata replaced",
        "a row's metadata with a null member",
        "a row's metadata cleared",
        "a step silenced",
        "a step shown",
        "a row silenced",
        "a row shown",
        "a response's metadata chunk",
        "a row's metadata chunk",
    ] {
        assert!(seen.contains_key(kind), "no {kind} in 500 generated streams: {seen:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// The minimal streams of the defects the properties found

fn completed(step: &str, reasoning: &str, text: &str) -> RecordBody {
    RecordBody::AssistantMessageCompleted {
        message_id: step.into(),
        text: text.into(),
        reasoning: reasoning.into(),
        stop_reason: StopReason::Stop,
        usage: Default::default(),
        reasoning_blocks: Vec::new(),
    }
}

fn one_submission(batches: Vec<Vec<RecordBody>>) -> Stream {
    batches
        .into_iter()
        .map(|batch| batch.into_iter().map(|body| ("sub_1".to_owned(), body)).collect())
        .collect()
}

fn assert_model(stream: &Stream) {
    if let Err(error) = check(stream) {
        panic!("{error}");
    }
}

#[test]
fn projection_deleting_a_step_without_reasoning_keeps_the_next_steps_reasoning() {
    assert_model(&one_submission(vec![
        vec![started("s1"), completed("s1", "", "A")],
        vec![started("s2"), completed("s2", "R", "B")],
        vec![RecordBody::MessageDeleted {
            message_id: "s1".into(),
        }],
    ]));
}

#[test]
fn projection_deleting_a_step_that_never_completed_keeps_the_next_steps_parts() {
    assert_model(&one_submission(vec![
        vec![
            started("s1"),
            RecordBody::AssistantTextDelta {
                message_id: "s1".into(),
                delta: "Hal".into(),
            },
        ],
        vec![started("s2"), completed("s2", "R", "B")],
        vec![RecordBody::MessageDeleted {
            message_id: "s1".into(),
        }],
    ]));
}

#[test]
fn projection_editing_a_deleted_step_leaves_the_next_steps_text() {
    let mut updates = serde_json::Map::new();
    updates.insert("content".into(), json!("E"));
    assert_model(&one_submission(vec![
        vec![started("s1"), completed("s1", "", "A")],
        vec![started("s2"), completed("s2", "", "B")],
        vec![RecordBody::MessageDeleted {
            message_id: "s1".into(),
        }],
        vec![RecordBody::MessageUpdated {
            message_id: "s1".into(),
            updates,
        }],
    ]));
}

fn assert_chunks(stream: &Stream) {
    if let Err(error) = check_chunks(stream) {
        panic!("{error}");
    }
}

#[test]
fn projection_reasoning_that_did_not_stream_reaches_a_client_before_the_streamed_text() {
    assert_chunks(&one_submission(vec![
        vec![
            started("s1"),
            RecordBody::AssistantTextDelta {
                message_id: "s1".into(),
                delta: "Hel".into(),
            },
        ],
        vec![completed("s1", "Thought.", "Hello")],
    ]));
}

#[test]
fn projection_reasoning_completed_after_the_text_started_extends_the_clients_reasoning_part() {
    assert_chunks(&one_submission(vec![
        vec![
            started("s1"),
            RecordBody::AssistantReasoningDelta {
                message_id: "s1".into(),
                delta: "Think".into(),
            },
            RecordBody::AssistantTextDelta {
                message_id: "s1".into(),
                delta: "Hel".into(),
            },
        ],
        vec![completed("s1", "Thinking more.", "Hello")],
    ]));
}

#[test]
fn projection_reasoning_streamed_after_the_text_reaches_a_client_where_the_snapshot_shows_it() {
    let text = |delta: &str| RecordBody::AssistantTextDelta {
        message_id: "s1".into(),
        delta: delta.into(),
    };
    let reasoning = |delta: &str| RecordBody::AssistantReasoningDelta {
        message_id: "s1".into(),
        delta: delta.into(),
    };
    // Reasoning that starts after the text, resumes after it, and streams in the text's batch.
    assert_chunks(&one_submission(vec![
        vec![started("s1"), text("Hel")],
        vec![reasoning("Hmm")],
        vec![text("lo")],
        vec![reasoning(", well")],
        vec![text(" there"), reasoning(".")],
        vec![completed("s1", "Hmm, well.", "Hello there")],
    ]));
    // Reasoning that goes on after the text over several batches: the snapshot keeps it
    // before the text, where no delta reaches (a client extends the message's last part),
    // so each of its batches resets, and so does the text's next, which closes it.
    let stream = one_submission(vec![
        vec![started("s1"), text("Hel")],
        vec![reasoning("Hmm")],
        vec![reasoning(", well")],
        vec![reasoning(".")],
        vec![text("lo")],
        vec![completed("s1", "Hmm, well.", "Hello")],
    ]);
    assert_chunks(&stream);
    let mut projection = Projection::new("agents/a/i");
    let resets: Vec<bool> = batches_of(&stream)
        .iter()
        .map(|batch| {
            let mut chunks = Vec::new();
            projection.apply(batch, Some(&mut chunks));
            chunks.iter().any(|chunk| chunk["type"] == "conversation-reset")
        })
        .collect();
    assert_eq!(
        resets,
        [false, true, true, true, true, false],
        "each reasoning batch after the text resets, and so does the text's next (which closes the reasoning behind it)"
    );
    // Reasoning first, then text, then more reasoning.
    assert_chunks(&one_submission(vec![
        vec![started("s1"), reasoning("Think"), text("Hel")],
        vec![reasoning("ing")],
        vec![text("lo")],
        vec![completed("s1", "Thinking", "Hello")],
    ]));
}
