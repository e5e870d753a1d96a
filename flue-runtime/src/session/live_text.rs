//! A model step's text on its way to the record stream while the step still streams.
//!
//! A step is one append when it completes. A step that streams text or reasoning for longer
//! than [`RuntimeOptions::text_flush`](crate::RuntimeOptions::text_flush) appends its start and
//! what streamed so far before that ([`RecordBody::AssistantTextDelta`],
//! [`RecordBody::AssistantReasoningDelta`], in the order the model streamed them), then what
//! streamed since at most once per interval, so clients of the stream follow it live. The
//! step's completion is still one append, and it alone says what the step's text and
//! reasoning are.

use std::time::Duration;

use tokio::time::Instant;

use crate::lifecycle::thread::ThreadWriter;
use crate::record::{Record, RecordBody};
use crate::store::StoreError;

pub(super) struct LiveText {
    message_id: String,
    /// The conversation's first resource snapshot, when this step carries it.
    snapshot: Option<Record>,
    /// The step's `assistant_message_started`.
    started: Record,
    /// Whether `snapshot` and `started` are in the stream.
    opened: bool,
    /// The step restarted (a retried call) after it was opened: its next append starts it
    /// again, so readers drop what the failed call streamed.
    restarted: bool,
    /// What streamed and is not appended yet, in order: runs of reasoning (`true`) or text.
    pending: Vec<(bool, String)>,
    /// When `pending` is appended: `every` after its first byte. `None` while nothing waits.
    due: Option<Instant>,
    /// `None`: nothing is appended before the step completes.
    every: Option<Duration>,
}

impl LiveText {
    pub(super) fn new(message_id: &str, snapshot: Option<Record>, started: Record, every: Option<Duration>) -> Self {
        Self {
            message_id: message_id.to_owned(),
            snapshot,
            started,
            opened: false,
            restarted: false,
            pending: Vec::new(),
            due: None,
            every,
        }
    }

    /// Takes a text delta the model streamed.
    pub(super) fn push_text(&mut self, delta: &str) {
        self.push(false, delta);
    }

    /// Takes a reasoning delta the model streamed.
    pub(super) fn push_reasoning(&mut self, delta: &str) {
        self.push(true, delta);
    }

    fn push(&mut self, reasoning: bool, delta: &str) {
        let Some(every) = self.every else { return };
        if delta.is_empty() {
            return;
        }
        match self.pending.last_mut() {
            Some((kind, run)) if *kind == reasoning => run.push_str(delta),
            _ => self.pending.push((reasoning, delta.to_owned())),
        }
        if self.due.is_none() {
            // An interval past any instant (`Duration::MAX`, "never") leaves the text for the
            // step's end.
            self.due = Instant::now().checked_add(every);
        }
    }

    /// When the waiting text is due, if any waits.
    pub(super) fn due(&self) -> Option<Instant> {
        self.due
    }

    /// A call failed and is made again: what it streamed and is not appended is forgotten,
    /// and what it appended is left behind (the retry's first append starts the step again).
    pub(super) fn restart(&mut self) {
        self.pending.clear();
        self.due = None;
        self.restarted = self.opened;
    }

    /// The step's start, when it was appended while the step streamed.
    pub(super) fn appended_start(&self) -> Option<&Record> {
        self.opened.then_some(&self.started)
    }

    /// The conversation's first snapshot is not this step's to carry any more (a compaction
    /// wrote a newer one).
    pub(super) fn drop_snapshot(&mut self) {
        if !self.opened {
            self.snapshot = None;
        }
    }

    /// Appends what waits, after the step's start the first time, as one batch of the
    /// attempt. `record` makes a record of the attempt.
    pub(super) async fn flush(
        &mut self,
        writer: &ThreadWriter,
        record: impl Fn(RecordBody) -> Record,
    ) -> Result<(), StoreError> {
        self.due = None;
        if self.pending.is_empty() {
            return Ok(());
        }
        let mut batch = Vec::with_capacity(2 + self.pending.len());
        if !self.opened {
            batch.extend(self.snapshot.clone());
            batch.push(self.started.clone());
        } else if self.restarted {
            // A record of its own (ids are unique), saying what the first start said.
            batch.push(record(self.started.body.clone()));
        }
        for (reasoning, delta) in self.pending.drain(..) {
            let message_id = self.message_id.clone();
            batch.push(record(if reasoning {
                RecordBody::AssistantReasoningDelta { message_id, delta }
            } else {
                RecordBody::AssistantTextDelta { message_id, delta }
            }));
        }
        writer.append(batch.into()).await?;
        self.opened = true;
        self.restarted = false;
        Ok(())
    }

    /// The records that open the step and are not in the stream yet (they go first in the
    /// step's completing batch).
    pub(super) fn into_unappended(self) -> Vec<Record> {
        if self.opened {
            Vec::new()
        } else {
            self.snapshot.into_iter().chain(std::iter::once(self.started)).collect()
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use super::*;

    fn started() -> Record {
        Record {
            id: "record_1".into(),
            submission_id: None,
            attempt_id: None,
            timestamp: "2026-01-01T00:00:00.000Z".into(),
            body: RecordBody::AssistantMessageStarted {
                message_id: "msg_1".into(),
                model: "scripted/x".into(),
                turn_id: None,
                response_metadata: None,
            },
        }
    }

    /// An interval meant as "never" (`Duration::MAX`) leaves the text for the step's end.
    /// (Regression: the instant it made due overflowed, and the response's task panicked.)
    #[tokio::test]
    async fn an_interval_past_any_instant_leaves_the_text_for_the_steps_end() {
        let mut live = LiveText::new("msg_1", None, started(), Some(Duration::MAX));
        live.push_text("Hello");
        assert_eq!(live.due(), None);
        assert_eq!(live.pending, [(false, "Hello".to_owned())]);
    }

    #[tokio::test(start_paused = true)]
    async fn text_waits_one_interval_from_its_first_byte_and_nothing_waits_without_an_interval() {
        let mut live = LiveText::new("msg_1", None, started(), Some(Duration::from_secs(1)));
        assert_eq!(live.due(), None, "nothing streamed yet");
        let start = Instant::now();
        live.push_reasoning("Think");
        tokio::time::advance(Duration::from_millis(400)).await;
        live.push_reasoning("ing.");
        live.push_text("Hel");
        live.push_text("lo");
        assert_eq!(
            live.pending,
            [(true, "Thinking.".to_owned()), (false, "Hello".to_owned())],
            "runs of one kind, in order"
        );
        assert_eq!(
            live.due(),
            Some(start + Duration::from_secs(1)),
            "the first byte sets the clock"
        );
        live.restart();
        assert_eq!(live.due(), None);

        let mut off = LiveText::new("msg_1", None, started(), None);
        off.push_text("Hello");
        assert_eq!(off.due(), None, "no interval: the step's text waits for its completion");
        assert_eq!(off.into_unappended(), vec![started()]);
    }
}
