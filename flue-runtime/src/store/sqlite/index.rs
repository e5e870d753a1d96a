//! What the SQLite store knows of its own ledger without asking SQLite.
//!
//! The database file belongs to one store of one process (see [`super::SqliteStore::open`]),
//! and every write to the submissions, the instances and the batches goes through the store's
//! own functions, under its connection lock. So the store can keep, beside the file, the few
//! facts its hot paths would otherwise query at every durability point: which attempt runs each
//! unsettled submission (the fence of every append) and, while it runs, the row it wrote (what
//! its settlement reads), how many submissions of an instance wait or have joined (asked at
//! every turn boundary and settlement), where each stream ends (the offset of every append, and
//! whether a reader is up to date) and the next admission's sequence.
//!
//! Each change a transaction makes to the index is logged with the value it replaced, and a
//! transaction that does not commit (an error, a failed `COMMIT`, a panic) puts those values
//! back, so the index only ever describes committed rows. The facts are loaded from the file
//! when the store opens it; a stream the index does not know (it keeps a bounded number) is read
//! from the file.

use std::cell::RefCell;
use std::sync::Arc;

use rusqlite::Connection;

use crate::fast_map::FastMap;
use crate::store::{InstanceKey, StoreError, Submission, SubmissionStatus};

/// The streams whose end the index keeps at most; past it, it forgets them all (at a commit)
/// and reads each again from the file on its next append.
const STREAMS_KEPT: usize = 16_384;

/// The largest running row (its JSON) the index keeps whole: larger ones carry images, which
/// would cost a copy at every write of the row and their size again in memory; they are
/// read from the file when needed.
const ROW_KEPT_BYTES: usize = 64 * 1024;

/// An unsettled submission, as the index knows it.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Unsettled {
    pub(super) key: InstanceKey,
    pub(super) status: SubmissionStatus,
    pub(super) attempt_id: Option<String>,
    /// The whole row, while it runs and this store wrote it, when its JSON is at most
    /// [`ROW_KEPT_BYTES`]: what a settlement or a requeue of the attempt reads (one row per
    /// running attempt, so the queued rows' messages are never held here, nor a running row's
    /// images).
    pub(super) running: Option<Arc<Submission>>,
}

/// Per instance: its unsettled submissions, how many of them are queued, and how many joined
/// (or are joining) a live response.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Counts {
    pub(super) unsettled: u32,
    pub(super) queued: u32,
    pub(super) joins: u32,
}

impl Counts {
    fn adjust(&mut self, status: SubmissionStatus, up: bool) {
        let step = |count: &mut u32| {
            *count = if up { *count + 1 } else { count.saturating_sub(1) };
        };
        step(&mut self.unsettled);
        match status {
            SubmissionStatus::Queued => step(&mut self.queued),
            SubmissionStatus::Joining | SubmissionStatus::Joined => step(&mut self.joins),
            SubmissionStatus::Running | SubmissionStatus::Settled => {}
        }
    }
}

/// The index proper (see the module's documentation).
#[derive(Debug, Default)]
pub(super) struct Index {
    unsettled: FastMap<String, Unsettled>,
    counts: FastMap<InstanceKey, Counts>,
    /// Stream number and next offset.
    streams: FastMap<InstanceKey, (i64, u64)>,
    next_sequence: i64,
}

/// A change to undo when its transaction does not commit: the value it replaced.
#[derive(Debug)]
enum Undo {
    Submission(String, Option<Unsettled>),
    Stream(InstanceKey, Option<(i64, u64)>),
    Sequence(i64),
}

impl Index {
    /// The index of the ledger in `connection`'s file.
    pub(super) fn load(connection: &Connection) -> Result<Self, StoreError> {
        let mut index = Self {
            next_sequence: connection
                .query_row(
                    "SELECT COALESCE(MAX(sequence), 0) + 1 FROM flue_submissions",
                    [],
                    |row| row.get(0),
                )
                .map_err(super::sql)?,
            ..Self::default()
        };
        let mut statement = connection
            .prepare(
                "SELECT id, agent, instance_id, status, attempt_id FROM flue_submissions WHERE status <> 'settled'",
            )
            .map_err(super::sql)?;
        let rows = statement
            .query_map([], |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, String>(2)?,
                    row.get::<_, String>(3)?,
                    row.get::<_, Option<String>>(4)?,
                ))
            })
            .map_err(super::sql)?;
        for row in rows {
            let (id, agent, instance_id, status, attempt_id) = row.map_err(super::sql)?;
            // A status this build does not know (a row a later build wrote) is unsettled work
            // of its instance all the same, so no admission is claimed past it; but no queue's
            // (`claim_next` fails on it where it reads it) and no attempt's this build could
            // run: indexed as running under no attempt, which no write's fence matches.
            let (status, attempt_id) = match super::status_named(&status) {
                Some(status) => (status, attempt_id),
                None => {
                    tracing::warn!(submission = %id, status, "sqlite: a submission has a status this build does not know");
                    (SubmissionStatus::Running, None)
                }
            };
            index.set_submission(
                id,
                Some(Unsettled {
                    key: InstanceKey::new(agent, instance_id),
                    status,
                    attempt_id,
                    running: None,
                }),
            );
        }
        Ok(index)
    }

    /// The unsettled submission `id`, when it is one.
    pub(super) fn unsettled(&self, id: &str) -> Option<&Unsettled> {
        self.unsettled.get(id)
    }

    /// `key`'s counts of unsettled, queued and joined submissions.
    pub(super) fn counts(&self, key: &InstanceKey) -> Counts {
        self.counts.get(key).copied().unwrap_or_default()
    }

    /// `key`'s stream number and next offset, when the index knows them.
    pub(super) fn stream(&self, key: &InstanceKey) -> Option<(i64, u64)> {
        self.streams.get(key).copied()
    }

    /// Replaces what the index holds of submission `id`; returns what it held.
    fn set_submission(&mut self, id: String, entry: Option<Unsettled>) -> Option<Unsettled> {
        let previous = match &entry {
            Some(entry) => self.unsettled.insert(id, entry.clone()),
            None => self.unsettled.remove(&id),
        };
        if let Some(previous) = &previous
            && let Some(counts) = self.counts.get_mut(&previous.key)
        {
            counts.adjust(previous.status, false);
            if counts.unsettled == 0 {
                self.counts.remove(&previous.key);
            }
        }
        if let Some(entry) = entry {
            self.counts.entry(entry.key).or_default().adjust(entry.status, true);
        }
        previous
    }

    fn set_stream(&mut self, key: InstanceKey, end: Option<(i64, u64)>) -> Option<(i64, u64)> {
        match end {
            Some(end) => self.streams.insert(key, end),
            None => self.streams.remove(&key),
        }
    }

    /// After a commit: keeps the streams' ends bounded.
    fn committed(&mut self) {
        if self.streams.len() > STREAMS_KEPT {
            self.streams = FastMap::default();
        }
    }
}

/// The index as one transaction sees and changes it: every change is logged, to be undone
/// unless [`IndexTx::commit`] is called.
pub(super) struct IndexTx<'i> {
    index: RefCell<&'i mut Index>,
    undo: RefCell<Vec<Undo>>,
    committed: bool,
}

impl<'i> IndexTx<'i> {
    pub(super) fn new(index: &'i mut Index) -> Self {
        Self {
            index: RefCell::new(index),
            undo: RefCell::new(Vec::new()),
            committed: false,
        }
    }

    /// Checks (in debug builds: every test) that what this committed transaction changed in
    /// the index is what the file now says: each submission it wrote, each stream it
    /// appended to and the next sequence. Panics on a difference, naming it.
    #[cfg(debug_assertions)]
    pub(super) fn verify(&self, connection: &Connection) {
        use rusqlite::OptionalExtension;
        let index = self.index.borrow();
        for undo in self.undo.borrow().iter() {
            match undo {
                Undo::Submission(id, _) => {
                    let stored = connection
                        .query_row(
                            "SELECT agent, instance_id, status, attempt_id FROM flue_submissions WHERE id = ?1",
                            [id],
                            |row| {
                                Ok((
                                    row.get::<_, String>(0)?,
                                    row.get::<_, String>(1)?,
                                    row.get::<_, String>(2)?,
                                    row.get::<_, Option<String>>(3)?,
                                ))
                            },
                        )
                        .optional()
                        .expect("the index's check reads the submission");
                    let stored = stored.and_then(|(agent, instance, status, attempt_id)| {
                        let status = super::status_named(&status)?;
                        (status != SubmissionStatus::Settled).then(|| Unsettled {
                            key: InstanceKey::new(agent, instance),
                            status,
                            attempt_id,
                            running: None,
                        })
                    });
                    let indexed = index.unsettled(id);
                    let facts = |entry: Option<&Unsettled>| {
                        entry.map(|entry| (entry.key.clone(), entry.status, entry.attempt_id.clone()))
                    };
                    assert_eq!(facts(indexed), facts(stored.as_ref()), "the index of submission {id}");
                    if let Some(running) = indexed.and_then(|entry| entry.running.as_deref()) {
                        assert_eq!(
                            running.status,
                            SubmissionStatus::Running,
                            "the index keeps running rows only"
                        );
                        let row = super::read_submission(connection, id).expect("the index's check reads the row");
                        assert_eq!(row.as_ref(), Some(running), "the index's row of submission {id}");
                    }
                }
                Undo::Stream(key, _) => {
                    let stored = connection
                        .query_row(
                            "SELECT stream FROM flue_instances WHERE agent = ?1 AND id = ?2",
                            [&*key.agent, &*key.id],
                            |row| row.get::<_, i64>(0),
                        )
                        .optional()
                        .expect("the index's check reads the instance")
                        .map(|stream| super::next_offset(connection, stream).map(|next| (stream, next)))
                        .transpose()
                        .expect("the index's check reads the stream");
                    assert_eq!(index.stream(key), stored, "the index of the stream {key}");
                }
                Undo::Sequence(_) => {
                    let next: i64 = connection
                        .query_row(
                            "SELECT COALESCE(MAX(sequence), 0) + 1 FROM flue_submissions",
                            [],
                            |row| row.get(0),
                        )
                        .expect("the index's check reads the sequence");
                    assert_eq!(index.next_sequence, next, "the index's next sequence");
                }
            }
        }
        let mut counts: FastMap<InstanceKey, Counts> = FastMap::default();
        for entry in index.unsettled.values() {
            counts.entry(entry.key.clone()).or_default().adjust(entry.status, true);
        }
        assert_eq!(counts, index.counts, "the index's counts follow its submissions");
    }

    /// Keeps the transaction's changes: its `COMMIT` succeeded.
    pub(super) fn commit(mut self) {
        self.committed = true;
        self.undo.get_mut().clear();
        self.index.get_mut().committed();
    }

    /// The instance of submission `id` while `attempt_id` runs it.
    pub(super) fn running(&self, id: &str, attempt_id: &str) -> Option<InstanceKey> {
        self.index
            .borrow()
            .unsettled(id)
            .filter(|row| row.status == SubmissionStatus::Running && row.attempt_id.as_deref() == Some(attempt_id))
            .map(|row| row.key.clone())
    }

    /// Submission `id`'s row while `attempt_id` runs it, when the index holds it (`None`: the
    /// attempt does not run it, or the row is only in the file).
    pub(super) fn running_row(&self, id: &str, attempt_id: &str) -> Option<Arc<Submission>> {
        self.index
            .borrow()
            .unsettled(id)
            .filter(|row| row.status == SubmissionStatus::Running && row.attempt_id.as_deref() == Some(attempt_id))
            .and_then(|row| row.running.clone())
    }

    /// `key`'s counts of unsettled, queued and joined submissions.
    pub(super) fn counts(&self, key: &InstanceKey) -> Counts {
        self.index.borrow().counts(key)
    }

    /// Notes the row written for `row`, whose JSON is `size` bytes (settled rows leave the
    /// index).
    pub(super) fn wrote(&self, row: &Submission, size: usize) {
        let entry = (row.status != SubmissionStatus::Settled).then(|| Unsettled {
            key: row.key.clone(),
            status: row.status,
            attempt_id: row.attempt_id.clone(),
            running: (row.status == SubmissionStatus::Running && size <= ROW_KEPT_BYTES).then(|| Arc::new(row.clone())),
        });
        let previous = self.index.borrow_mut().set_submission(row.id.clone(), entry);
        self.undo.borrow_mut().push(Undo::Submission(row.id.clone(), previous));
    }

    /// `key`'s stream number and next offset, when the index knows them.
    pub(super) fn stream(&self, key: &InstanceKey) -> Option<(i64, u64)> {
        self.index.borrow().stream(key)
    }

    /// Notes `key`'s stream number and next offset.
    pub(super) fn set_stream(&self, key: &InstanceKey, stream: i64, next_offset: u64) {
        let previous = self
            .index
            .borrow_mut()
            .set_stream(key.clone(), Some((stream, next_offset)));
        self.undo.borrow_mut().push(Undo::Stream(key.clone(), previous));
    }

    /// Takes the next admission's sequence.
    pub(super) fn take_sequence(&self) -> i64 {
        let mut index = self.index.borrow_mut();
        let sequence = index.next_sequence;
        index.next_sequence += 1;
        self.undo.borrow_mut().push(Undo::Sequence(sequence));
        sequence
    }
}

impl Drop for IndexTx<'_> {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        let index = self.index.get_mut();
        for undo in self.undo.get_mut().drain(..).rev() {
            match undo {
                Undo::Submission(id, previous) => {
                    index.set_submission(id, previous);
                }
                Undo::Stream(key, previous) => {
                    index.set_stream(key, previous);
                }
                Undo::Sequence(sequence) => index.next_sequence = sequence,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unsettled(id: &str, status: SubmissionStatus) -> (String, Option<Unsettled>) {
        (
            id.to_owned(),
            Some(Unsettled {
                key: InstanceKey::new("a", "i"),
                status,
                attempt_id: None,
                running: None,
            }),
        )
    }

    #[test]
    fn counts_follow_each_submissions_status_and_settled_ones_leave() {
        let mut index = Index::default();
        let key = InstanceKey::new("a", "i");
        let (id, entry) = unsettled("s1", SubmissionStatus::Queued);
        index.set_submission(id, entry);
        let (id, entry) = unsettled("s2", SubmissionStatus::Joining);
        index.set_submission(id, entry);
        let counts = |unsettled, queued, joins| Counts {
            unsettled,
            queued,
            joins,
        };
        assert_eq!(index.counts[&key], counts(2, 1, 1));
        let (id, entry) = unsettled("s1", SubmissionStatus::Running);
        index.set_submission(id, entry);
        assert_eq!(index.counts[&key], counts(2, 0, 1));
        index.set_submission("s1".into(), None);
        index.set_submission("s2".into(), None);
        assert!(
            index.counts.is_empty(),
            "an instance with nothing unsettled is forgotten"
        );
        assert!(index.unsettled.is_empty());
    }

    #[test]
    fn a_transaction_dropped_without_commit_puts_every_value_back() {
        let mut index = Index {
            next_sequence: 7,
            ..Index::default()
        };
        let key = InstanceKey::new("a", "i");
        let (id, entry) = unsettled("s1", SubmissionStatus::Running);
        index.set_submission(id, entry);
        index.set_stream(key.clone(), Some((3, 10)));
        let before = (
            index.unsettled.clone(),
            index.counts.clone(),
            index.streams.clone(),
            index.next_sequence,
        );
        {
            let tx = IndexTx::new(&mut index);
            assert_eq!(tx.take_sequence(), 7);
            tx.set_stream(&key, 3, 11);
            tx.set_stream(&InstanceKey::new("a", "new"), 8, 1);
            let row: Submission = serde_json::from_value(serde_json::json!({
                "id": "s1", "sequence": 1, "key": {"agent": "a", "id": "i"}, "kind": "direct",
                "message": {"kind": "user", "body": "hi"}, "status": "settled",
                "accepted_at": "2026-12-01T00:00:00.000Z", "attempt_id": null,
                "attempt_count": 1, "max_attempts": 1, "abort_requested": false
            }))
            .expect("a submission");
            tx.wrote(&row, 0);
            assert!(tx.running("s1", "at-1").is_none());
            assert_eq!(tx.stream(&key), Some((3, 11)));
        }
        let after = (
            index.unsettled.clone(),
            index.counts.clone(),
            index.streams.clone(),
            index.next_sequence,
        );
        assert_eq!(after, before);
        let tx = IndexTx::new(&mut index);
        assert_eq!(tx.take_sequence(), 7);
        tx.commit();
        assert_eq!(index.next_sequence, 8, "a committed change stays");
    }
}
