//! The stores told apart by random use: sequences of ledger and stream operations (admissions,
//! dispatched or direct, unconditional or conditional on the incarnation, claims, joins,
//! settlements, requeues, aborts, lease renewals and takeovers, appends under a fence, task
//! children created under a fence, paged reads, user values set, read and listed by prefix) are
//! made on the memory store and on
//! SQLite (and on Postgres when `FLUE_TEST_POSTGRES_URL` names one, as the README's test
//! command does), and every answer, and everything a reader sees afterwards, must be the same
//! on each. The contract suite checks chosen cases; this finds the orders of operations nobody
//! wrote down, where one store's ledger drifts from another's.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

mod harness;
mod scratch;

use std::collections::HashMap;
use std::sync::Arc;

use flue_runtime::lifecycle::{UserValue, UserValuePage, UserValuesQuery};
use flue_runtime::message::DeliveredMessage;
use flue_runtime::record::{Batch, ConversationKind, Outcome, Record, RecordBody, SettlementError};
use flue_runtime::store::{
    Admission, AttemptRef, Claim, InstanceKey, MemoryStore, SqliteStore, Store, StoreError, Submission, SubmissionKind,
    SubmissionStatus, UidCondition,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

/// Three instances: two agents' instances sharing an id (keys told apart by the agent alone)
/// and another id.
const INSTANCES: [(&str, &str); 3] = [("alpha", "shared"), ("beta", "shared"), ("alpha", "other")];
/// Few submission ids, so that replays, conflicts and joins happen often.
const SUBMISSIONS: u8 = 4;
/// The lease every claim takes (far in the future: no lease runs out by the clock during a
/// case; the lease operations pass their own `now`).
const LEASE_UNTIL_MS: u64 = 4_000_000_000_000;
/// The `now` of the lease scans and takeovers: past every claim's lease, not past a renewed
/// one's.
const SCAN_AT_MS: u64 = LEASE_UNTIL_MS + 1_000;
/// Task children each instance may have (their streams follow the instances' in [`stream_key`]).
const CHILDREN: usize = 2;
/// The streams: the instances', then their children's.
const STREAMS: usize = INSTANCES.len() * (1 + CHILDREN);

#[derive(Clone, Debug)]
enum Op {
    Admit {
        instance: usize,
        submission: u8,
        text: u8,
        keyed: bool,
        claim: bool,
        /// A direct send (else a dispatch).
        direct: bool,
        /// The conditional-send rule: see [`Driven::uid_condition`].
        uid: u8,
        /// Creation data (which an admission that creates the instance keeps).
        data: bool,
        /// Another attempt budget and timeout.
        budget: bool,
    },
    ClaimNext {
        instance: usize,
    },
    Settle {
        submission: u8,
        outcome: u8,
        /// Settles with an attempt that never owned the submission.
        stale: bool,
    },
    Requeue {
        submission: u8,
    },
    RequestAbort {
        instance: usize,
    },
    Append {
        /// An instance's stream or a child's (see [`stream_key`]).
        stream: usize,
        by: By,
        records: u8,
    },
    /// Creates the task child `child` of the instance with its link in the instance's stream.
    CreateChild {
        parent: usize,
        child: usize,
        by: By,
    },
    /// Reads a page of a stream.
    ReadPage {
        stream: usize,
        after: Option<u64>,
        limit: usize,
    },
    /// Asks which of these submissions settled.
    SettledAmong {
        submissions: Vec<u8>,
    },
    ClaimJoinable {
        host: u8,
    },
    FinalizeJoin {
        host: u8,
        joined: u8,
    },
    RevertJoins {
        host: u8,
    },
    /// Renews the lease of the submission's attempt (past the scans' `now`, or not).
    Renew {
        submission: u8,
        past_the_scan: bool,
    },
    /// Lists the running submissions whose lease expired.
    Expired,
    /// Takes the submission over from its attempt (or from one that never owned it).
    Reclaim {
        submission: u8,
        stale: bool,
    },
    /// Asks which of these submissions' attempts have an abort requested.
    AbortsRequested {
        submissions: Vec<u8>,
    },
    /// Sets (or deletes) a user's value.
    SetUserValue {
        user: u8,
        key: usize,
        value: Option<i64>,
    },
    /// Reads a user's value.
    UserValue {
        user: u8,
        key: usize,
    },
    /// Lists a user's values under a prefix, paged.
    ListUserValues {
        user: u8,
        prefix: usize,
        limit: Option<usize>,
        offset: usize,
    },
}

/// Who authorizes a write.
#[derive(Clone, Debug)]
enum By {
    /// Nobody: an unfenced write.
    Nobody,
    /// The latest attempt of this submission (see [`Driven::attempt`]).
    Submission(u8),
    /// The attempt running on the stream's instance (its root's, for a child's), if any; else
    /// an attempt never made.
    Running,
}

fn by() -> impl Strategy<Value = By> {
    prop_oneof![
        1 => Just(By::Nobody),
        1 => (0..SUBMISSIONS).prop_map(By::Submission),
        1 => Just(By::Running),
    ]
}

/// User-value keys that tell orderings and prefix matches apart: `_` and `%` (wildcards to
/// `LIKE`), case, non-ASCII, a backslash.
const USER_KEYS: [&str; 9] = ["a", "ab", "a_b", "aXb", "a%", "A", "é", "a\\b", "b"];
/// Prefixes the listings ask for.
const PREFIXES: [&str; 6] = ["", "a", "a_", "a%", "A", "é"];

fn op() -> impl Strategy<Value = Op> {
    let instance = 0..INSTANCES.len();
    let submission = 0..SUBMISSIONS;
    prop_oneof![
        4 => (
            instance.clone(),
            submission.clone(),
            0..2u8,
            any::<bool>(),
            any::<bool>(),
            prop::bool::weighted(0.3),
            prop::sample::select(vec![0u8, 0, 1, 2, 3, 4]),
            prop::bool::weighted(0.2),
            prop::bool::weighted(0.2),
        )
            .prop_map(
                |(instance, submission, text, keyed, claim, direct, uid, data, budget)| Op::Admit {
                    instance,
                    submission,
                    text,
                    keyed,
                    claim,
                    direct,
                    uid,
                    data,
                    budget,
                }
            ),
        3 => instance.clone().prop_map(|instance| Op::ClaimNext { instance }),
        3 => (submission.clone(), 0..3u8, prop::bool::weighted(0.2))
            .prop_map(|(submission, outcome, stale)| Op::Settle { submission, outcome, stale }),
        2 => submission.clone().prop_map(|submission| Op::Requeue { submission }),
        1 => instance.clone().prop_map(|instance| Op::RequestAbort { instance }),
        2 => (0..STREAMS, by(), 1..4u8).prop_map(|(stream, by, records)| Op::Append { stream, by, records }),
        2 => (instance.clone(), 0..CHILDREN, by()).prop_map(|(parent, child, by)| Op::CreateChild { parent, child, by }),
        // Children's streams as often as instances'; pages that start in the (short) streams.
        2 => (prop_oneof![instance.clone(), INSTANCES.len()..STREAMS], prop::option::weighted(0.6, 0..3u64), 1..4usize)
            .prop_map(|(stream, after, limit)| Op::ReadPage { stream, after, limit }),
        1 => prop::collection::vec(submission.clone(), 0..4).prop_map(|submissions| Op::SettledAmong { submissions }),
        2 => submission.clone().prop_map(|host| Op::ClaimJoinable { host }),
        2 => (submission.clone(), submission.clone()).prop_map(|(host, joined)| Op::FinalizeJoin { host, joined }),
        2 => submission.clone().prop_map(|host| Op::RevertJoins { host }),
        1 => (submission.clone(), any::<bool>())
            .prop_map(|(submission, past_the_scan)| Op::Renew { submission, past_the_scan }),
        1 => Just(Op::Expired),
        2 => (submission.clone(), prop::bool::weighted(0.2))
            .prop_map(|(submission, stale)| Op::Reclaim { submission, stale }),
        1 => prop::collection::vec(submission, 0..3).prop_map(|submissions| Op::AbortsRequested { submissions }),
        1 => (0..2u8, 0..USER_KEYS.len(), prop::option::weighted(0.8, -3i64..3))
            .prop_map(|(user, key, value)| Op::SetUserValue { user, key, value }),
        1 => (0..2u8, 0..USER_KEYS.len()).prop_map(|(user, key)| Op::UserValue { user, key }),
        1 => (0..2u8, 0..PREFIXES.len(), prop::option::of(0..4usize), 0..3usize).prop_map(
            |(user, prefix, limit, offset)| Op::ListUserValues {
                user,
                prefix,
                limit,
                offset
            }
        ),
    ]
}

fn key(instance: usize) -> InstanceKey {
    let (agent, id) = INSTANCES[instance];
    InstanceKey::new(agent, id)
}

/// A stream: an instance's (`0..INSTANCES.len()`), then each instance's task children's.
fn stream_key(stream: usize) -> InstanceKey {
    if stream < INSTANCES.len() {
        return key(stream);
    }
    let (parent, child) = (
        (stream - INSTANCES.len()) / CHILDREN,
        (stream - INSTANCES.len()) % CHILDREN,
    );
    child_key(parent, child)
}

/// The task child `child` of the instance `parent` (its agent's `:task` key, its id under the
/// instance's).
fn child_key(parent: usize, child: usize) -> InstanceKey {
    let (agent, id) = INSTANCES[parent];
    InstanceKey::new(format!("{agent}:task"), format!("{id}/task_{child}"))
}

fn submission_id(submission: u8) -> String {
    format!("sub_{submission}")
}

/// What a store answered, without what legitimately differs between stores (generated
/// incarnations, timestamps, the birth record's id).
#[derive(Debug, PartialEq)]
#[allow(clippy::large_enum_variant)] // one per store and step, compared and dropped
enum Answer {
    Admitted {
        submission: Row,
        deduplicated: bool,
        offset: Option<u64>,
        claimed: Option<Row>,
        born: bool,
        incarnation: Incarnation,
    },
    Claimed(Option<Row>),
    Joinable(Vec<Row>),
    Rows(Vec<Row>),
    Renewed(u64),
    Ids(Vec<String>),
    Done,
    UserValue(Option<UserValue>),
    UserValues(UserValuePage),
    Flag(bool),
    Count(usize),
    Offset(u64),
    Aborted(Vec<String>),
    Batches(Stream),
    Refused(String),
}

/// The incarnation an admission answered, against those the store gave the instance before
/// (they are generated: each store's own).
#[derive(Debug, PartialEq)]
enum Incarnation {
    /// The instance had none (this admission created it).
    New,
    /// The one it had.
    Kept,
    /// Another than it had: an instance's incarnation never changes.
    Changed,
}

/// A submission row as every store must keep it.
#[derive(Debug, PartialEq)]
struct Row {
    id: String,
    key: InstanceKey,
    kind: SubmissionKind,
    message: DeliveredMessage,
    initial_data: Option<serde_json::Value>,
    status: String,
    attempt_id: Option<String>,
    owner_id: Option<String>,
    lease_until_ms: u64,
    attempt_count: u32,
    max_attempts: u32,
    timeout_ms: u64,
    /// Whether the attempt deadline is stamped (its time is the clock's).
    deadline_stamped: bool,
    abort_requested: bool,
    joined_into: Option<String>,
    outcome: Option<Outcome>,
    error: Option<SettlementError>,
}

impl From<Submission> for Row {
    fn from(row: Submission) -> Self {
        Self {
            id: row.id,
            key: row.key,
            kind: row.kind,
            message: row.message,
            initial_data: row.initial_data,
            status: format!("{:?}", row.status),
            attempt_id: row.attempt_id,
            owner_id: row.owner_id,
            lease_until_ms: row.lease_until_ms,
            attempt_count: row.attempt_count,
            max_attempts: row.max_attempts,
            timeout_ms: row.timeout_ms,
            deadline_stamped: row.timeout_at_ms > 0,
            abort_requested: row.abort_requested,
            joined_into: row.joined_into,
            outcome: row.outcome,
            error: row.error,
        }
    }
}

fn refused(error: StoreError) -> Answer {
    // The variant and its message: the error a caller branches on and shows.
    Answer::Refused(error.to_string())
}

fn answer<T>(result: Result<T, StoreError>, into: impl FnOnce(T) -> Answer) -> Answer {
    result.map_or_else(refused, into)
}

/// A stream as compared: each batch's offset and its records as JSON.
type Stream = Vec<(u64, Vec<serde_json::Value>)>;

/// The stream as every store must hold it, whole (a birth record's id, incarnation and time
/// are generated: they are left out).
fn stream(batches: &[Batch]) -> Stream {
    batches
        .iter()
        .map(|batch| {
            let records = batch
                .records
                .iter()
                .map(|record| {
                    let mut record = serde_json::to_value(record).unwrap();
                    if record["type"] == "conversation_created" {
                        let fields = record.as_object_mut().unwrap();
                        for generated in ["id", "uid", "timestamp"] {
                            fields.remove(generated);
                        }
                    }
                    record
                })
                .collect();
            (batch.offset, records)
        })
        .collect()
}

/// One store driven through a case, with the attempts it handed out.
struct Driven {
    store: Arc<dyn Store>,
    /// The latest attempt each submission was claimed under (by a claim, an admission's claim
    /// or a join's host).
    attempts: HashMap<String, String>,
    /// The incarnation each instance was admitted under.
    uids: HashMap<usize, String>,
}

impl Driven {
    fn attempt(&self, submission: &str) -> AttemptRef {
        AttemptRef {
            submission_id: submission.to_owned(),
            attempt_id: self
                .attempts
                .get(submission)
                .cloned()
                .unwrap_or_else(|| "att_never".to_owned()),
        }
    }

    /// The conditional-send rule `uid` names for `instance`: unconditional (0), create only
    /// (1), continue this store's incarnation of the instance (2), or of the next instance (3:
    /// the first two share an id), or an incarnation no store made (4). An instance never
    /// admitted has no incarnation to name: `inst_unmade`.
    fn uid_condition(&self, instance: usize, uid: u8) -> UidCondition {
        let of = |instance: usize| {
            self.uids
                .get(&instance)
                .cloned()
                .unwrap_or_else(|| "inst_unmade".to_owned())
        };
        match uid {
            0 => UidCondition::Any,
            1 => UidCondition::CreateOnly,
            2 => UidCondition::Existing(of(instance)),
            3 => UidCondition::Existing(of((instance + 1) % INSTANCES.len())),
            _ => UidCondition::Existing("inst_x".to_owned()),
        }
    }

    /// The attempt `by` names for a write to `stream` (none: unfenced).
    async fn authorization(&self, stream: usize, by: &By) -> Option<AttemptRef> {
        match *by {
            By::Nobody => None,
            By::Submission(submission) => Some(self.attempt(&submission_id(submission))),
            By::Running => {
                let root = key(if stream < INSTANCES.len() {
                    stream
                } else {
                    (stream - INSTANCES.len()) / CHILDREN
                });
                for submission in 0..SUBMISSIONS {
                    let row = self.store.submission(&submission_id(submission)).await.unwrap();
                    if let Some(row) = row
                        && row.key == root
                        && row.status == SubmissionStatus::Running
                        && let Some(attempt_id) = row.attempt_id
                    {
                        return Some(AttemptRef {
                            submission_id: row.id,
                            attempt_id,
                        });
                    }
                }
                Some(AttemptRef {
                    submission_id: submission_id(0),
                    attempt_id: "att_never".to_owned(),
                })
            }
        }
    }

    fn note_claim(&mut self, row: &Submission) {
        if let Some(attempt) = &row.attempt_id {
            self.attempts.insert(row.id.clone(), attempt.clone());
        }
    }

    /// Applies `op` (the `step`th of its case); returns the store's answer.
    async fn apply(&mut self, step: usize, op: &Op) -> Answer {
        let claim = || Claim {
            attempt_id: format!("att_{step}"),
            owner_id: "node".to_owned(),
            lease_until_ms: LEASE_UNTIL_MS,
        };
        match op {
            &Op::Admit {
                instance,
                submission,
                text,
                keyed,
                claim: claims,
                direct,
                uid,
                data,
                budget,
            } => {
                let admission = Admission {
                    key: key(instance),
                    submission_id: submission_id(submission),
                    keyed,
                    kind: if direct {
                        SubmissionKind::Direct
                    } else {
                        SubmissionKind::Dispatch
                    },
                    message: DeliveredMessage::user(format!("message {text}")),
                    initial_data: data.then(|| serde_json::json!({"plan": "pro"})),
                    uid: self.uid_condition(instance, uid),
                    max_attempts: if budget { 5 } else { 3 },
                    timeout_ms: if budget { 60_000 } else { 3_600_000 },
                    claim: claims.then(claim),
                    trace: None,
                };
                match self.store.admit(admission).await {
                    Ok(admitted) => {
                        if let Some(claimed) = &admitted.claimed {
                            self.note_claim(claimed);
                        }
                        let incarnation = match self.uids.get(&instance) {
                            None => Incarnation::New,
                            Some(uid) if *uid == admitted.uid => Incarnation::Kept,
                            Some(_) => Incarnation::Changed,
                        };
                        self.uids.entry(instance).or_insert(admitted.uid);
                        Answer::Admitted {
                            submission: admitted.submission.into(),
                            deduplicated: admitted.deduplicated,
                            offset: admitted.offset,
                            claimed: admitted.claimed.map(Row::from),
                            born: admitted.birth.is_some(),
                            incarnation,
                        }
                    }
                    // The incarnation it names is the one the store gave the instance.
                    Err(StoreError::InstanceExists { id, uid }) => Answer::Refused(format!(
                        "{} (its incarnation: {})",
                        StoreError::InstanceExists { id, uid: uid.clone() },
                        self.uids.get(&instance) == Some(&uid)
                    )),
                    Err(error) => refused(error),
                }
            }
            &Op::ClaimNext { instance } => match self.store.claim_next(&key(instance), &claim()).await {
                Ok(claimed) => {
                    if let Some(row) = &claimed {
                        self.note_claim(row);
                    }
                    Answer::Claimed(claimed.map(Row::from))
                }
                Err(error) => refused(error),
            },
            &Op::Settle {
                submission,
                outcome,
                stale,
            } => {
                let id = submission_id(submission);
                let attempt = if stale {
                    AttemptRef {
                        submission_id: id.clone(),
                        attempt_id: "att_stale".to_owned(),
                    }
                } else {
                    self.attempt(&id)
                };
                let (outcome, error) = match outcome {
                    0 => (Outcome::Completed, None),
                    1 => (
                        Outcome::Failed,
                        Some(SettlementError {
                            error_type: "operation_failed".to_owned(),
                            message: "It failed.".to_owned(),
                            details: String::new(),
                            meta: None,
                        }),
                    ),
                    _ => (Outcome::Aborted, None),
                };
                let settled = Record {
                    id: format!("record_submission_settled_{id}_{step}"),
                    submission_id: Some(id.as_str().into()),
                    attempt_id: Some(attempt.attempt_id.as_str().into()),
                    timestamp: "2026-12-04T00:00:00.000Z".into(),
                    body: RecordBody::SubmissionSettled {
                        outcome,
                        error: error.clone(),
                    },
                };
                answer(
                    self.store.settle(&attempt, outcome, error, vec![settled]).await,
                    Answer::Flag,
                )
            }
            &Op::Requeue { submission } => {
                let attempt = self.attempt(&submission_id(submission));
                answer(self.store.requeue(&attempt).await, Answer::Flag)
            }
            &Op::RequestAbort { instance } => answer(self.store.request_abort(&key(instance)).await, |mut ids| {
                ids.sort();
                Answer::Aborted(ids)
            }),
            Op::Append { stream, by, records } => {
                let (stream, records) = (*stream, *records);
                let authorization = self.authorization(stream, by).await;
                let records: Arc<[Record]> = (0..records)
                    .map(|index| Record {
                        id: format!("record_{step}_{index}"),
                        submission_id: authorization.as_ref().map(|by| by.submission_id.as_str().into()),
                        attempt_id: authorization.as_ref().map(|by| by.attempt_id.as_str().into()),
                        timestamp: "2026-12-04T00:00:00.000Z".into(),
                        body: RecordBody::StateWrite {
                            name: "counter".into(),
                            value: serde_json::json!(step),
                        },
                    })
                    .collect();
                answer(
                    self.store
                        .append(&stream_key(stream), records, authorization.as_ref())
                        .await,
                    Answer::Offset,
                )
            }
            Op::CreateChild { parent, child, by } => {
                let (parent, child) = (*parent, *child);
                let authorization = self.authorization(parent, by).await;
                let (parent, child_key) = (key(parent), child_key(parent, child));
                let link = Record {
                    id: format!("record_link_{step}"),
                    submission_id: authorization.as_ref().map(|by| by.submission_id.as_str().into()),
                    attempt_id: authorization.as_ref().map(|by| by.attempt_id.as_str().into()),
                    timestamp: "2026-12-04T00:00:00.000Z".into(),
                    body: RecordBody::ChildSessionRetained {
                        task_id: format!("task_{child}"),
                        kind: ConversationKind::Task,
                        child: child_key.clone(),
                        parent_tool_call_id: format!("call_{step}"),
                    },
                };
                let birth = Record {
                    id: format!("record_birth_{step}"),
                    submission_id: None,
                    attempt_id: None,
                    timestamp: "2026-12-04T00:00:00.000Z".into(),
                    body: RecordBody::ConversationCreated {
                        uid: format!("inst_child_{step}"),
                        initial_data: None,
                        kind: Some(ConversationKind::Task),
                        parent: Some(parent.clone()),
                        task_id: Some(format!("task_{child}")),
                        agent: Some("helper".into()),
                    },
                };
                answer(
                    self.store
                        .create_child(
                            &parent,
                            vec![link].into(),
                            &child_key,
                            vec![birth].into(),
                            authorization.as_ref(),
                        )
                        .await,
                    Answer::Offset,
                )
            }
            &Op::ReadPage { stream, after, limit } => {
                answer(self.store.read_page(&stream_key(stream), after, limit).await, |page| {
                    Answer::Batches(self::stream(&page))
                })
            }
            Op::SettledAmong { submissions } => {
                let mut ids: Vec<String> = submissions
                    .iter()
                    .map(|submission| submission_id(*submission))
                    .collect();
                ids.sort();
                ids.dedup();
                answer(self.store.settled_among(&ids).await, |mut settled| {
                    settled.sort();
                    Answer::Ids(settled)
                })
            }
            &Op::ClaimJoinable { host } => {
                let host = self.attempt(&submission_id(host));
                answer(self.store.claim_joinable(&host).await, |rows| {
                    Answer::Joinable(rows.into_iter().map(Row::from).collect())
                })
            }
            &Op::FinalizeJoin { host, joined } => {
                let host = self.attempt(&submission_id(host));
                answer(
                    self.store.finalize_join(&host, &submission_id(joined)).await,
                    Answer::Flag,
                )
            }
            &Op::RevertJoins { host } => {
                let host = self.attempt(&submission_id(host));
                answer(self.store.revert_joins(&host).await, Answer::Count)
            }
            &Op::Renew {
                submission,
                past_the_scan,
            } => {
                let attempt = self.attempt(&submission_id(submission)).attempt_id;
                let until = if past_the_scan {
                    SCAN_AT_MS + 1_000
                } else {
                    SCAN_AT_MS - 1
                };
                answer(
                    self.store.renew_leases("node", &[attempt], until).await,
                    Answer::Renewed,
                )
            }
            Op::Expired => answer(self.store.expired(SCAN_AT_MS).await, |mut rows| {
                rows.sort_by(|a, b| a.id.cmp(&b.id));
                Answer::Rows(rows.into_iter().map(Row::from).collect())
            }),
            &Op::Reclaim { submission, stale } => {
                let id = submission_id(submission);
                let from = if stale {
                    "att_stale".to_owned()
                } else {
                    self.attempt(&id).attempt_id
                };
                match self.store.reclaim(&id, &from, &claim(), SCAN_AT_MS).await {
                    Ok(taken) => {
                        if let Some(row) = &taken {
                            self.note_claim(row);
                        }
                        Answer::Claimed(taken.map(Row::from))
                    }
                    Err(error) => refused(error),
                }
            }
            &Op::SetUserValue { user, key, value } => answer(
                self.store
                    .set_user_value(
                        &format!("user-{user}"),
                        USER_KEYS[key],
                        value.map(serde_json::Value::from),
                        step as i64,
                    )
                    .await,
                |()| Answer::Done,
            ),
            &Op::UserValue { user, key } => answer(
                self.store.user_value(&format!("user-{user}"), USER_KEYS[key]).await,
                Answer::UserValue,
            ),
            &Op::ListUserValues {
                user,
                prefix,
                limit,
                offset,
            } => {
                let query = UserValuesQuery {
                    prefix: PREFIXES[prefix].to_owned(),
                    limit,
                    offset,
                };
                answer(
                    self.store.list_user_values(&format!("user-{user}"), &query).await,
                    Answer::UserValues,
                )
            }
            Op::AbortsRequested { submissions } => {
                let attempts: Vec<String> = submissions
                    .iter()
                    .map(|submission| self.attempt(&submission_id(*submission)).attempt_id)
                    .collect();
                answer(self.store.aborts_requested(&attempts).await, |mut ids| {
                    ids.sort();
                    Answer::Ids(ids)
                })
            }
        }
    }

    /// Everything a reader can see once the case ends: each submission's row, whether each
    /// stream exists, its queue flag, the stream whole and paged through two batches at a time,
    /// each user's values, the submissions settled.
    async fn observed(&self) -> Vec<String> {
        let mut seen = Vec::new();
        for submission in 0..SUBMISSIONS {
            let row = self.store.submission(&submission_id(submission)).await.unwrap();
            seen.push(format!("{submission}: {:?}", row.map(Row::from)));
        }
        for stream_at in 0..STREAMS {
            let key = stream_key(stream_at);
            let exists = self.store.instance(&key).await.unwrap().is_some();
            let queued = self.store.has_queued(&key).await.unwrap();
            let batches = self.store.read(&key, None).await.unwrap();
            let last = self.store.last_offset(&key).await.unwrap();
            let mut pages = Vec::new();
            let mut after = None;
            loop {
                let page = self.store.read_page(&key, after, 2).await.unwrap();
                pages.push(stream(&page));
                match page.last() {
                    Some(batch) if page.len() == 2 => after = Some(batch.offset),
                    _ => break,
                }
            }
            seen.push(format!(
                "{key}: exists {exists}, queued {queued}, last {last:?}, {:?}, in pages {pages:?}",
                stream(&batches)
            ));
        }
        for user in 0..2 {
            let all = self
                .store
                .list_user_values(&format!("user-{user}"), &UserValuesQuery::default())
                .await
                .unwrap();
            seen.push(format!("user-{user}: {all:?}"));
        }
        let ids: Vec<String> = (0..SUBMISSIONS).map(submission_id).collect();
        let mut settled = self.store.settled_among(&ids).await.unwrap();
        settled.sort();
        seen.push(format!("settled: {settled:?}"));
        let mut with_queued = self.store.instances_with_queued().await.unwrap();
        with_queued.sort();
        seen.push(format!("instances with queued work: {with_queued:?}"));
        seen
    }
}

/// The stores a case runs on: the memory store (the reference), SQLite, and Postgres when a
/// test database is configured.
async fn stores() -> Vec<(&'static str, Arc<dyn Store>)> {
    let sqlite = SqliteStore::open(scratch::dir("model").join("flue.db")).unwrap();
    #[allow(unused_mut)]
    let mut stores: Vec<(&'static str, Arc<dyn Store>)> =
        vec![("memory", Arc::new(MemoryStore::new())), ("sqlite", Arc::new(sqlite))];
    #[cfg(feature = "postgres")]
    if let Some(url) = harness::postgres_url("the store model on Postgres") {
        let schema = harness::fresh_schema("flue_model");
        let store = flue_runtime::store::PostgresStore::connect_with_schema(&url, &schema)
            .await
            .unwrap();
        stores.push(("postgres", Arc::new(store)));
    }
    stores
}

async fn agree(ops: &[Op]) -> Result<(), TestCaseError> {
    let mut driven: Vec<(&str, Driven)> = stores()
        .await
        .into_iter()
        .map(|(name, store)| {
            (
                name,
                Driven {
                    store,
                    attempts: HashMap::new(),
                    uids: HashMap::new(),
                },
            )
        })
        .collect();
    for (step, op) in ops.iter().enumerate() {
        let mut answers = Vec::new();
        for (name, store) in &mut driven {
            answers.push((*name, store.apply(step, op).await));
        }
        let (reference, expected) = &answers[0];
        prop_assert!(
            !matches!(
                expected,
                Answer::Admitted {
                    incarnation: Incarnation::Changed,
                    ..
                }
            ),
            "step {} ({:?}): {} answered another incarnation than the instance had",
            step,
            op,
            reference
        );
        for (name, answer) in &answers[1..] {
            prop_assert_eq!(
                answer,
                expected,
                "step {} ({:?}): {} answered otherwise than {}",
                step,
                op,
                name,
                reference
            );
        }
    }
    let expected = driven[0].1.observed().await;
    for (name, store) in &driven[1..] {
        for (held, expected) in store.observed().await.iter().zip(&expected) {
            prop_assert_eq!(held, expected, "after the case, {} holds otherwise than memory", name);
        }
    }
    Ok(())
}

#[test]
fn every_store_answers_every_sequence_of_ledger_and_stream_operations_alike() {
    harness::check_property(384, &prop::collection::vec(op(), 1..48), "sequence", async |ops| {
        agree(&ops).await
    });
}
