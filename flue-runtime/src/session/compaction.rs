//! The root session's side of compaction (see `crate::compaction`): it publishes as the turn
//! loop does, records the compaction with a new baseline for the system prompt's catalogs,
//! and fails the submission.

use flue_core::abort::AbortSignal;

use super::{Conversation, Failure, Response};
use crate::compaction::{Budget, Compacting, Failed};
use crate::events::{Event, LazyId};
use crate::provider::ModelMessage;
use crate::record::{RecordBody, SettlementError};
use crate::runtime::RuntimeInner;

impl Compacting for Response<'_> {
    type Failure = Failure;

    fn runtime(&self) -> &RuntimeInner {
        self.runtime
    }

    fn signal(&self) -> &AbortSignal {
        &self.attempt.signal
    }

    fn budget(&mut self) -> &mut Budget {
        &mut self.budget
    }

    fn conversation(&self) -> &Conversation {
        self.conversation
    }

    fn publish(&self, event: impl FnOnce() -> Event) {
        self.emit_with(event);
    }

    fn turn(&self, turn: Option<&LazyId>) {
        self.set_turn(turn);
    }

    async fn record_compaction(&mut self, mut compaction: RecordBody) -> Result<(), Failure> {
        // Rows the message hooks wrote while the summary was made come after the history it
        // read: a compaction of the whole history (no first kept row) keeps them, from the
        // first of them on (folded now, they would be drained with the history). A first kept
        // row a hook deleted meanwhile gives way to the next row the summary did not read (a
        // record naming a row that is gone would compact nothing).
        self.fold_thread_writes();
        if let RecordBody::Compaction {
            first_kept_message_id, ..
        } = &mut compaction
            && (first_kept_message_id.is_empty() || !self.conversation.has_row(first_kept_message_id))
        {
            self.conversation
                .first_row_not_in(&self.compaction_summarized)
                .unwrap_or_default()
                .clone_into(first_kept_message_id);
        }
        let mut records = vec![self.record(compaction)];
        // A new baseline for the system prompt's catalogs: what is declared now.
        if let Some((_, snapshot)) = &self.declared {
            records.push(self.record(RecordBody::ResourceSnapshot {
                snapshot: snapshot.clone(),
                baseline: self.framework_sections.text().map(str::to_owned),
            }));
            self.first_snapshot = None;
        }
        self.commit(records, false).await
    }

    async fn summarized(&mut self, from: usize, cut: usize) -> Result<Vec<ModelMessage>, String> {
        self.compaction_summarized = self.conversation.row_ids_before(cut);
        self.older_history(from, cut).await
    }

    fn failure(&self, failed: Failed) -> Failure {
        match failed {
            Failed::Aborted => Failure::aborted(),
            Failed::Summary(message) => Failure::failed("compaction_failed", message),
        }
    }

    fn describe(failure: &Failure) -> SettlementError {
        failure.error.clone()
    }
}
