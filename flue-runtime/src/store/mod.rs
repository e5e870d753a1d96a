//! Durable state: the submission ledger and the per-instance record stream, behind one
//! [`Store`] trait. [`MemoryStore`] implements it in memory (tests, examples); the SQLite and
//! Postgres stores implement the same trait.

mod attachments;
pub(crate) mod depth;
mod memory;
#[cfg(feature = "postgres")]
mod postgres;
mod sqlite;

use std::fmt;
use std::sync::Arc;

use flue_core::BoxFuture;
use flue_core::lifecycle::{UserValue, UserValuePage, UserValuesQuery};
use flue_core::message::DeliveredMessage;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use attachments::{ATTACHMENT_CHUNK_BYTES, AttachmentPut, StoredAttachment, sha256_hex};
pub(crate) use depth::{from_stored, nests_too_deep, storable, too_deep_error};
pub use memory::MemoryStore;
#[cfg(feature = "postgres")]
pub use postgres::PostgresStore;
#[cfg(unix)]
pub(crate) use sqlite::is_store_file;
pub use sqlite::{FORMAT_VERSION, SqliteStore};

use crate::record::{Batch, Outcome, Record, SettlementError};

/// An agent instance: the agent's identity and the instance id. Cheap to clone (the names are
/// shared): the runtime, its stores and every submission carry one.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct InstanceKey {
    /// The agent's name.
    pub agent: Arc<str>,
    /// The instance id.
    pub id: Arc<str>,
}

impl InstanceKey {
    /// The key of `id` of `agent`.
    pub fn new(agent: impl Into<Arc<str>>, id: impl Into<Arc<str>>) -> Self {
        Self {
            agent: agent.into(),
            id: id.into(),
        }
    }

    /// The stream path: `agents/<agent>/<id>`.
    pub fn stream_path(&self) -> String {
        format!("agents/{}/{}", self.agent, self.id)
    }
}

/// What separates a task child's id from its parent's (`subagents::child_key`, task ids are
/// `task_…`). An instance id cannot contain it (`Runtime` refuses one at admission), so a child
/// stream's id names its root instance unambiguously.
pub(crate) const TASK_SEPARATOR: &str = "/task_";

impl InstanceKey {
    /// Whether an attempt of a submission of the instance `agent`/`id` may write this stream:
    /// the instance's own, or one of its task children's (`subagents::child_key`: the agent
    /// with a `:task` suffix, the id followed by `/<task id>` once or more). A write fence
    /// checks it, so an attempt of one agent's instance cannot write another agent's instance
    /// of the same id, nor the children of another instance whose id starts with its own
    /// (`acme` and `acme/eu`): a child's root is the part of its id before the first
    /// [`TASK_SEPARATOR`], which no instance id contains.
    pub(crate) fn writable_by(&self, agent: &str, id: &str) -> bool {
        if *self.agent == *agent {
            return *self.id == *id;
        }
        self.agent.strip_suffix(":task") == Some(agent)
            && self.id.find(TASK_SEPARATOR).is_some_and(|at| self.id[..at] == *id)
    }
}

impl fmt::Display for InstanceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.agent, self.id)
    }
}

/// How a submission was admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SubmissionKind {
    /// `dispatch()` or `use_dispatch_message`.
    Dispatch,
    /// A direct send (`send()`, HTTP `POST /:id`).
    Direct,
}

/// Where a submission is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SubmissionStatus {
    /// Waiting its turn.
    Queued,
    /// Claimed by an attempt.
    Running,
    /// Claimed into a live response at a turn boundary; not yet applied.
    Joining,
    /// Applied into a live response; settles with it.
    Joined,
    /// Done.
    Settled,
}

/// A conditional send.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum UidCondition {
    /// Unconditional: create the instance if needed.
    #[default]
    Any,
    /// Continue only this incarnation (404 otherwise).
    Existing(String),
    /// Create only (409 when the instance exists).
    CreateOnly,
}

/// The W3C trace context of the request that admitted a submission (`traceparent`, with its
/// `tracestate`), carried on the submission so its processing joins the caller's trace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceContext {
    /// `version-traceid-parentid-flags`, lowercase hex.
    pub traceparent: String,
    /// Vendor state, when the caller sent one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
}

impl TraceContext {
    /// The context of a `traceparent` value (and `tracestate`), or `None` when `traceparent`
    /// is not a valid W3C trace parent: as the W3C rules say, an invalid one is ignored, not
    /// an error. A `tracestate` longer than 512 characters is dropped.
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<Self> {
        let traceparent = traceparent.trim();
        let parts: Vec<&str> = traceparent.split('-').collect();
        let hex = |part: &str, len: usize| {
            part.len() == len
                && part
                    .bytes()
                    .all(|byte| byte.is_ascii_digit() || (b'a'..=b'f').contains(&byte))
        };
        let valid = matches!(parts.as_slice(), [version, trace, parent, flags, ..]
            if hex(version, 2) && *version != "ff" && hex(trace, 32) && hex(parent, 16) && hex(flags, 2)
                && trace.bytes().any(|byte| byte != b'0') && parent.bytes().any(|byte| byte != b'0')
                && (parts.len() == 4 || *version != "00"));
        // A later version's parent may carry more fields: only the four this version knows
        // are kept (as W3C Trace Context propagates it), so a request cannot store, and log
        // with every line of its submission, a header of any length.
        valid.then(|| Self {
            traceparent: parts[..4].join("-"),
            tracestate: tracestate
                .map(str::trim)
                .filter(|state| !state.is_empty() && state.len() <= 512)
                .map(str::to_owned),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod submission_tests {
    use serde_json::json;

    use super::Submission;

    fn stored(initial_data: Option<serde_json::Value>) -> serde_json::Value {
        let mut row = json!({
            "id": "sub_1", "sequence": 1, "key": {"agent": "a", "id": "i"}, "kind": "direct",
            "message": {"kind": "user", "body": "hi"}, "status": "queued",
            "accepted_at": "2026-01-01T00:00:00.000Z", "attempt_id": null, "attempt_count": 0,
            "max_attempts": 10, "abort_requested": false, "joined_into": null, "outcome": null,
            "error": null
        });
        if let Some(data) = initial_data {
            row["initial_data"] = data;
        }
        row
    }

    #[test]
    fn a_stored_row_keeps_its_initial_data_a_null_one_included_and_older_rows_have_none() {
        let parse = |row: serde_json::Value| serde_json::from_value::<Submission>(row).unwrap();
        assert_eq!(parse(stored(None)).initial_data, None, "a row stored before the field");
        assert_eq!(parse(stored(Some(json!(null)))).initial_data, Some(json!(null)));
        let row = parse(stored(Some(json!({"plan": "pro"}))));
        assert_eq!(row.initial_data, Some(json!({"plan": "pro"})));
        let mut without = row.clone();
        without.initial_data = None;
        for row in [row, without] {
            let text = serde_json::to_string(&row).unwrap();
            assert_eq!(serde_json::from_str::<Submission>(&text).unwrap(), row, "{text}");
        }
        let mut null = parse(stored(None));
        null.initial_data = Some(json!(null));
        let text = serde_json::to_string(&null).unwrap();
        assert_eq!(serde_json::from_str::<Submission>(&text).unwrap(), null, "{text}");
    }
}

#[cfg(test)]
mod fence_tests {
    use super::InstanceKey;

    #[test]
    fn an_instance_writes_its_own_stream_and_its_task_childrens_only() {
        let writable = |agent: &str, id: &str| InstanceKey::new(agent, id).writable_by("assistant", "acme");
        assert!(writable("assistant", "acme"));
        assert!(writable("assistant:task", "acme/task_1"));
        assert!(writable("assistant:task", "acme/task_1/task_2"), "a child's child");
        assert!(!writable("assistant", "acme/eu"));
        assert!(!writable("assistant:task", "acme/eu/task_1"), "a child of acme/eu");
        assert!(!writable("assistant:task", "acmex/task_1"));
        assert!(!writable("assistant:task", "acme"));
        assert!(!writable("concierge:task", "acme/task_1"));
        assert!(!writable("assistant:task", "acme/other"));
    }
}

#[cfg(test)]
mod trace_tests {
    use super::TraceContext;

    #[test]
    fn a_valid_w3c_traceparent_is_kept_with_its_state_and_an_invalid_one_ignored() {
        let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let trace = TraceContext::parse(parent, Some(" rojo=00f067aa0ba902b7 "));
        assert_eq!(
            trace,
            Some(TraceContext {
                traceparent: parent.to_owned(),
                tracestate: Some("rojo=00f067aa0ba902b7".to_owned()),
            })
        );
        assert_eq!(
            TraceContext::parse(parent, Some(&"x".repeat(513))).map(|trace| trace.tracestate),
            Some(None),
            "an oversized tracestate is dropped, the parent kept"
        );
        // A later version may carry more fields; only the four known ones are kept, however
        // long the rest.
        let later = format!(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-{}",
            "ab".repeat(100_000)
        );
        assert_eq!(
            TraceContext::parse(&later, None).map(|trace| trace.traceparent),
            Some("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned())
        );
        for invalid in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceContext::parse(invalid, Some("a=b")), None, "{invalid:?}");
        }
    }
}

/// A message to admit.
#[derive(Clone, Debug, PartialEq)]
pub struct Admission {
    /// The instance.
    pub key: InstanceKey,
    /// The submission id (derived from an idempotency key, or fresh).
    pub submission_id: String,
    /// Whether the id was derived from an idempotency key (replays converge).
    pub keyed: bool,
    /// How it arrived.
    pub kind: SubmissionKind,
    /// The message.
    pub message: DeliveredMessage,
    /// Creation data (used only when this admission creates the instance).
    pub initial_data: Option<Value>,
    /// The conditional-send rule.
    pub uid: UidCondition,
    /// Attempt budget stamped on the row.
    pub max_attempts: u32,
    /// Wall-clock budget of the submission, from its first claim, in milliseconds.
    pub timeout_ms: u64,
    /// Also claim this submission in the admission's transaction when it is the instance's
    /// head (exactly as [`Store::claim_next`] would right after it), for a caller that runs the
    /// instance's queue at once: one transaction instead of two. Nothing is claimed when
    /// earlier work is unsettled, or for a deduplicated replay.
    pub claim: Option<Claim>,
    /// The admitting request's trace context.
    pub trace: Option<TraceContext>,
}

/// A submission row of the ledger.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Submission {
    /// Id.
    pub id: String,
    /// Admission order across the store.
    pub sequence: u64,
    /// The instance.
    pub key: InstanceKey,
    /// How it arrived.
    pub kind: SubmissionKind,
    /// The message.
    pub message: DeliveredMessage,
    /// The creation data it was admitted with (a JSON `null` kept as sent; `None` when it had
    /// none, and on rows stored before it was).
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "present")]
    pub initial_data: Option<Value>,
    /// Where it is.
    pub status: SubmissionStatus,
    /// When it was accepted (RFC 3339).
    pub accepted_at: String,
    /// The current attempt.
    pub attempt_id: Option<String>,
    /// The node running it.
    #[serde(default)]
    pub owner_id: Option<String>,
    /// When its lease runs out (ms since the epoch; 0 when not running).
    #[serde(default)]
    pub lease_until_ms: u64,
    /// Attempts so far.
    pub attempt_count: u32,
    /// Attempt budget.
    pub max_attempts: u32,
    /// Wall-clock budget, in milliseconds (rows written before it was stored get the default
    /// one hour).
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// When the budget runs out (ms since the epoch), stamped at the first claim and kept
    /// across re-attempts; 0 before that.
    #[serde(default)]
    pub timeout_at_ms: u64,
    /// Whether an abort was requested.
    pub abort_requested: bool,
    /// The host a joined delivery settles with.
    pub joined_into: Option<String>,
    /// How it settled.
    pub outcome: Option<Outcome>,
    /// Why it failed.
    pub error: Option<SettlementError>,
    /// The admitting request's trace context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<TraceContext>,
}

impl Submission {
    /// Whether `admission` admits this same input: the identity a keyed replay must match
    /// (kind, instance, message and creation data), or the store answers
    /// [`StoreError::SubmissionConflict`].
    pub(crate) fn admitted_by(&self, admission: &Admission) -> bool {
        self.kind == admission.kind
            && self.key == admission.key
            && self.message == admission.message
            && self.initial_data == admission.initial_data
    }
}

/// A field that is `Some` whenever it is present, `null` included (`Option` alone reads `null`
/// as `None`).
pub(crate) fn present<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(deserializer).map(Some)
}

/// Whether a lease that runs until `lease_until_ms` (0: none) expired before `now_ms`.
pub(crate) fn lease_expired(lease_until_ms: u64, now_ms: u64) -> bool {
    lease_until_ms > 0 && lease_until_ms < now_ms
}

/// The result of an admission.
#[derive(Clone, Debug, PartialEq)]
pub struct Admitted {
    /// The submission row.
    pub submission: Submission,
    /// The instance incarnation.
    pub uid: String,
    /// Whether an idempotency-keyed replay converged on an earlier admission.
    pub deduplicated: bool,
    /// The stream head after admission (before the input is applied), as an offset.
    pub offset: Option<u64>,
    /// This submission, running under the admission's claim (see [`Admission::claim`]).
    pub claimed: Option<Submission>,
    /// The instance's first batch (its birth record, at offset 0) when this admission created
    /// the instance: all its stream holds yet, so the runtime need not read it back. `None`
    /// is always correct (the runtime then reads the stream).
    pub birth: Option<Batch>,
}

/// An instance that exists.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceInfo {
    /// The instance id.
    pub id: String,
    /// Its incarnation.
    pub uid: String,
}

/// Who claims a submission, and until when its lease runs (milliseconds since the Unix
/// epoch). A lease that is not renewed expires, and another node may take the submission over.
///
/// The [`Store`] methods take and return times on the calling node's clock ([`now_ms`]); a
/// store that several nodes share compares them in one clock of its own (the Postgres store
/// in the database's), so nodes whose clocks disagree still agree on which leases expired.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    /// The new attempt's id.
    pub attempt_id: String,
    /// The claiming node.
    pub owner_id: String,
    /// When the lease runs out.
    pub lease_until_ms: u64,
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64)
}

/// Applies the conditional-send rule of `admission` to the instance's current incarnation.
pub(crate) fn check_uid(admission: &Admission, existing_uid: Option<&str>) -> Result<(), StoreError> {
    match (&admission.uid, existing_uid) {
        (UidCondition::Existing(expected), Some(uid)) if expected != uid => {
            Err(StoreError::InstanceNotFound(admission.key.id.to_string()))
        }
        (UidCondition::Existing(_), None) => Err(StoreError::InstanceNotFound(admission.key.id.to_string())),
        (UidCondition::CreateOnly, Some(uid)) => Err(StoreError::InstanceExists {
            id: admission.key.id.to_string(),
            uid: uid.to_owned(),
        }),
        _ => Ok(()),
    }
}

/// What an append of `records` under `authorization` must find joined into the authorizing
/// submission: the ids of the other submissions its records belong to, each once (reference
/// §5.1, submission authorization for appends). Every record that names a submission or an
/// attempt must be the authorizing attempt's: of its submission, or of a delivery the store
/// finds `joining` or `joined` into it (which the caller checks). Without an authorization,
/// no record may name either. Refused as [`StoreError::Fenced`], before the store is asked.
pub(crate) fn joined_submissions_of<'a>(
    records: &'a [Record],
    authorization: Option<&AttemptRef>,
) -> Result<Vec<&'a str>, StoreError> {
    let mut joined: Vec<&str> = Vec::new();
    for record in records {
        let (submission, attempt) = (record.submission_id.as_deref(), record.attempt_id.as_deref());
        let Some(authorized) = authorization else {
            if submission.is_some() || attempt.is_some() {
                return Err(StoreError::Fenced(format!(
                    "record {} belongs to a submission or an attempt, and the append names no attempt",
                    record.id
                )));
            }
            continue;
        };
        if attempt.is_some_and(|attempt| attempt != authorized.attempt_id) {
            return Err(StoreError::Fenced(format!(
                "record {} was written by another attempt than {}",
                record.id, authorized.attempt_id
            )));
        }
        if let Some(submission) = submission
            && submission != authorized.submission_id
            && !joined.contains(&submission)
        {
            joined.push(submission);
        }
    }
    Ok(joined)
}

/// The refusal of an empty batch: a malformed call, refused by every store before it looks at
/// the fence or the stream.
pub(crate) fn empty_batch() -> StoreError {
    StoreError::Other("an append batch must not be empty".into())
}

/// The refusal of an append with a record of `submission`, which is not a delivery joined into
/// the authorizing `host`.
pub(crate) fn not_joined(submission: &str, host: &str) -> StoreError {
    StoreError::Fenced(format!(
        "submission {submission} is not a delivery joined into submission {host}"
    ))
}

/// What of an attachment did not match its bytes ([`StoreError::AttachmentIntegrity`]; the
/// reference's `reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum IntegrityFailure {
    /// Its size.
    Size,
    /// Its SHA-256 digest.
    Digest,
}

impl IntegrityFailure {
    /// The reference's name of it (`size`, `digest`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Size => "size",
            Self::Digest => "digest",
        }
    }
}

/// The birth record of a new instance: the first batch of its stream.
pub(crate) fn birth_record(uid: &str, initial_data: Option<Value>) -> Record {
    Record {
        id: crate::record::new_id("record"),
        submission_id: None,
        attempt_id: None,
        timestamp: crate::record::now(),
        body: crate::record::RecordBody::ConversationCreated {
            uid: uid.to_owned(),
            initial_data,
            kind: None,
            parent: None,
            task_id: None,
            agent: None,
        },
    }
}

/// The incarnation a child's birth batch names (its `conversation_created` record's uid).
pub(crate) fn birth_uid(birth: &[Record]) -> String {
    birth
        .iter()
        .find_map(|record| match &record.body {
            crate::record::RecordBody::ConversationCreated { uid, .. } => Some(uid.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

/// The submission budget of rows written before the budget was stored: the default one hour.
fn default_timeout_ms() -> u64 {
    flue_core::agent::Durability::DEFAULT.timeout.as_millis() as u64
}

/// Starts an attempt of a queued row under `claim` (every store's claim, in its transaction).
/// The budget's clock starts at the first claim and is kept across attempts.
pub(crate) fn start_attempt(row: &mut Submission, claim: &Claim) {
    row.status = SubmissionStatus::Running;
    row.attempt_id = Some(claim.attempt_id.clone());
    row.owner_id = Some(claim.owner_id.clone());
    row.lease_until_ms = claim.lease_until_ms;
    row.attempt_count += 1;
    if row.timeout_at_ms == 0 {
        // `u64::MAX` (no budget) stays never; nothing overflows.
        row.timeout_at_ms = now_ms().saturating_add(row.timeout_ms);
    }
}

/// The queued row an admission creates.
pub(crate) fn queued_submission(admission: Admission, sequence: u64) -> Submission {
    Submission {
        id: admission.submission_id,
        sequence,
        key: admission.key,
        kind: admission.kind,
        message: admission.message,
        initial_data: admission.initial_data,
        status: SubmissionStatus::Queued,
        accepted_at: crate::record::now().to_string(),
        attempt_id: None,
        owner_id: None,
        lease_until_ms: 0,
        attempt_count: 0,
        max_attempts: admission.max_attempts,
        timeout_ms: admission.timeout_ms,
        timeout_at_ms: 0,
        abort_requested: false,
        joined_into: None,
        outcome: None,
        error: None,
        trace: admission.trace,
    }
}

/// A claim that owns a running submission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttemptRef {
    /// The submission.
    pub submission_id: String,
    /// The attempt.
    pub attempt_id: String,
}

/// A store operation that was refused or failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// `uid` named an incarnation that does not exist.
    #[error("Agent instance \"{0}\" was not found.")]
    InstanceNotFound(String),
    /// `uid: null` (create only) but the instance exists.
    #[error("Agent instance \"{id}\" already exists.")]
    InstanceExists {
        /// The instance id.
        id: String,
        /// Its incarnation.
        uid: String,
    },
    /// The submission id is taken by another payload (kind, instance, message or creation data).
    #[error("Submission \"{0}\" was already admitted with a different message, initial data or kind.")]
    SubmissionConflict(String),
    /// The appending attempt does not own the submission any more.
    #[error("The stream rejected the append: {0}.")]
    Fenced(String),
    /// The database was written by another persisted format (`PersistedFormatVersionError`);
    /// nothing was changed.
    #[error("persisted_format_version_unsupported: stored format version \"{stored}\" is not supported (supported: 1)")]
    FormatVersion {
        /// The stored stamp (`unversioned` when flue tables exist without one).
        stored: String,
    },
    /// An attachment id is taken by other bytes, or by another instance
    /// (`AttachmentConflictError`).
    #[error("Attachment \"{0}\" already exists with different content or for another conversation.")]
    AttachmentConflict(String),
    /// An attachment's declared size or digest does not match its bytes
    /// (`AttachmentIntegrityError`).
    #[error("Attachment integrity check failed: {detail}.")]
    AttachmentIntegrity {
        /// The attachment's id.
        id: String,
        /// What did not match.
        reason: IntegrityFailure,
        /// What was found.
        detail: String,
    },
    /// Anything else.
    #[error("store failure: {0}")]
    Other(String),
}

/// The durable store of a runtime.
pub trait Store: Send + Sync + 'static {
    /// Admits a message: creates the instance (birth record) when needed, checks the
    /// conditional-send rule, and queues the submission. Idempotent by submission id.
    fn admit(&self, admission: Admission) -> BoxFuture<'_, Result<Admitted, StoreError>>;

    /// The instance, if it was ever contacted.
    fn instance(&self, key: &InstanceKey) -> BoxFuture<'_, Result<Option<InstanceInfo>, StoreError>>;

    /// A submission row.
    fn submission(&self, id: &str) -> BoxFuture<'_, Result<Option<Submission>, StoreError>>;

    /// Whether the instance has a queued submission (a cheap look, no claim).
    fn has_queued(&self, key: &InstanceKey) -> BoxFuture<'_, Result<bool, StoreError>>;

    /// Claims the instance's runnable head (the oldest queued submission, when nothing earlier
    /// is unsettled) for `claim`.
    fn claim_next(&self, key: &InstanceKey, claim: &Claim) -> BoxFuture<'_, Result<Option<Submission>, StoreError>>;

    /// Extends to `lease_until_ms` the leases of the running submissions `owner_id` holds under
    /// one of `attempt_ids` (the attempts the node is running); returns how many it renewed.
    /// A submission the node claimed but no longer runs keeps its lease, which then expires
    /// and lets any node take it over.
    fn renew_leases(
        &self,
        owner_id: &str,
        attempt_ids: &[String],
        lease_until_ms: u64,
    ) -> BoxFuture<'_, Result<u64, StoreError>>;

    /// Running submissions whose lease expired before `now_ms` (their owner died or hung).
    fn expired(&self, now_ms: u64) -> BoxFuture<'_, Result<Vec<Submission>, StoreError>>;

    /// Takes over an expired running submission: only while it still runs under
    /// `stale_attempt_id` with its lease expired before `now_ms` (a renewal after the scan
    /// that listed it keeps it with its owner), it gets `claim`'s attempt and owner and one
    /// more attempt counted.
    fn reclaim(
        &self,
        submission_id: &str,
        stale_attempt_id: &str,
        claim: &Claim,
        now_ms: u64,
    ) -> BoxFuture<'_, Result<Option<Submission>, StoreError>>;

    /// Of the attempts `attempt_ids` (the ones this node runs), those whose running
    /// submission has an abort requested: an abort can be requested through any node, and the
    /// node running the attempt learns of it here (its heartbeat asks).
    fn aborts_requested(&self, attempt_ids: &[String]) -> BoxFuture<'_, Result<Vec<String>, StoreError>>;

    /// Instances whose queue waits for a node: a submission is queued and none runs (what a
    /// starting or polling node picks up). One behind a running submission is not listed:
    /// whichever node runs that one carries on with the queue (or takes it over with the
    /// expired lease), and another node's claim would find nothing runnable. (A host given
    /// back to the queue with a delivery it joined counts as waiting: the delivery stays
    /// `joined` until the host settles.)
    fn instances_with_queued(&self) -> BoxFuture<'_, Result<Vec<InstanceKey>, StoreError>>;

    /// Claims the contiguous prefix of queued submissions behind a running host into its live
    /// response (stopping at the first abort-requested row). Claims nothing while the host has
    /// an abort requested: a delivery admitted after the abort is not part of what it ends.
    fn claim_joinable(&self, host: &AttemptRef) -> BoxFuture<'_, Result<Vec<Submission>, StoreError>>;

    /// Marks a claimed join applied (`joining → joined`).
    fn finalize_join(&self, host: &AttemptRef, submission_id: &str) -> BoxFuture<'_, Result<bool, StoreError>>;

    /// Puts back in the queue every delivery still claimed into `host`'s submission but never
    /// applied (`joining`): what an earlier attempt of the response claimed before it died,
    /// whose input is not in the stream (reference §3.9 step 10: such a join reverts) or
    /// whose start seam did not run (it rejoins and runs it, its input already saved). A
    /// resumed attempt calls it after finalizing the joins whose input is in the stream and
    /// before it claims any itself, so the reverted deliveries join again ahead of later ones.
    /// Only the owning attempt can; returns how many went back.
    fn revert_joins(&self, host: &AttemptRef) -> BoxFuture<'_, Result<usize, StoreError>>;

    /// Settles the host (and every delivery joined into it) with `outcome`, appending
    /// `records` (the settlement records) to the stream in the same step.
    ///
    /// Returns whether a submission of the instance is still queued, as the settling
    /// transaction saw it (a join claimed but never applied, put back in the queue, counts).
    /// It spares the settling task a [`Store::has_queued`] read; an admission committed after
    /// the settlement is the admitter's to announce.
    fn settle(
        &self,
        host: &AttemptRef,
        outcome: Outcome,
        error: Option<SettlementError>,
        records: Vec<Record>,
    ) -> BoxFuture<'_, Result<bool, StoreError>>;

    /// Gives a running submission back to the queue for a fresh attempt (its input and every
    /// committed batch stay in the stream; the next attempt resumes from them). Joins claimed
    /// but not applied go back to the queue too. Only the owning attempt can requeue.
    fn requeue(&self, attempt: &AttemptRef) -> BoxFuture<'_, Result<bool, StoreError>>;

    /// Stamps an abort intent on every unsettled submission of the instance; returns their ids.
    fn request_abort(&self, key: &InstanceKey) -> BoxFuture<'_, Result<Vec<String>, StoreError>>;

    /// Appends one batch atomically. With `authorization`, the attempt must still own its
    /// submission, and every record that names a submission or an attempt must be that
    /// attempt's, of its submission or of a delivery `joining` or `joined` into it; without
    /// one, no record may name either (reference §5.1). A
    /// refusal is [`StoreError::Fenced`] and leaves the stream unchanged. Returns the batch's
    /// offset: a stream's offsets are consecutive from 0 (its birth batch), and readers rely
    /// on it (a reader that asked for the batches after n expects n + 1 first).
    ///
    /// Dropping the returned future does not withdraw the batch: once it was polled (the
    /// SQLite and memory stores append before returning it), the batch may be in the stream
    /// whether or not the caller saw its offset. The fence holds either way: an attempt that
    /// no longer owns its submission never appends.
    fn append(
        &self,
        key: &InstanceKey,
        records: Arc<[Record]>,
        authorization: Option<&AttemptRef>,
    ) -> BoxFuture<'_, Result<u64, StoreError>>;

    /// Creates the child conversation `child` (a task's stream, reference §3.3 "child
    /// creation") with `birth` as its first batch, and appends `link` to `parent`'s stream,
    /// atomically: both or neither, so a link never names a missing child. `link` is
    /// authorized as an [`append`](Self::append) is. Returns the offset of the
    /// parent's batch. Fails when `child` exists or `parent` does not.
    ///
    /// A child stream has no submissions: it is never queued, claimed or listed, and it is
    /// read and appended to like any stream.
    fn create_child(
        &self,
        parent: &InstanceKey,
        link: Arc<[Record]>,
        child: &InstanceKey,
        birth: Arc<[Record]>,
        authorization: Option<&AttemptRef>,
    ) -> BoxFuture<'_, Result<u64, StoreError>>;

    /// Batches strictly after `after` (all when `None`).
    fn read(&self, key: &InstanceKey, after: Option<u64>) -> BoxFuture<'_, Result<Vec<Batch>, StoreError>>;

    /// The first `limit` batches strictly after `after` (all of them when fewer), in order: a
    /// reader paging through a long stream (an HTTP catch-up) holds one page at a time. Fewer
    /// than `limit` means the stream has no more for now. The default reads the rest of the
    /// stream and keeps the page: a store of another crate should read only the page (the
    /// stores of this crate do), or paging through a stream of n batches reads about
    /// n² / (2 × limit) of them.
    fn read_page(
        &self,
        key: &InstanceKey,
        after: Option<u64>,
        limit: usize,
    ) -> BoxFuture<'_, Result<Vec<Batch>, StoreError>> {
        let read = self.read(key, after);
        Box::pin(async move {
            let mut batches = read.await?;
            batches.truncate(limit);
            Ok(batches)
        })
    }

    /// The offset of the stream's last batch (`None`: no stream), without reading the stream.
    /// The default reads it whole; the stores of this crate answer from their indexes.
    fn last_offset(&self, key: &InstanceKey) -> BoxFuture<'_, Result<Option<u64>, StoreError>> {
        let read = self.read(key, None);
        Box::pin(async move { Ok(read.await?.last().map(|batch| batch.offset)) })
    }

    /// Stores an attachment of the instance `key` after checking its declared size and digest.
    /// Putting the same attachment again (same id, bytes and instance) succeeds, also
    /// concurrently; the id with other bytes or another instance is a conflict.
    fn put_attachment(&self, key: &InstanceKey, attachment: AttachmentPut) -> BoxFuture<'_, Result<(), StoreError>>;

    /// The attachment `id` of the instance `key`; `None` when absent or another instance's.
    fn attachment(&self, key: &InstanceKey, id: &str) -> BoxFuture<'_, Result<Option<StoredAttachment>, StoreError>>;

    /// The user's value under `key` (`UserState::get_value`): shared by every thread of the
    /// user, durable.
    fn user_value(&self, user_id: &str, key: &str) -> BoxFuture<'_, Result<Option<UserValue>, StoreError>>;

    /// Sets (`Some`) or deletes (`None`) the user's value under `key`, stamped `updated_at`
    /// (milliseconds since the Unix epoch).
    fn set_user_value(
        &self,
        user_id: &str,
        key: &str,
        value: Option<Value>,
        updated_at: i64,
    ) -> BoxFuture<'_, Result<(), StoreError>>;

    /// The user's values whose keys start with `query.prefix`, in key order, paged, with the
    /// number that match.
    fn list_user_values(
        &self,
        user_id: &str,
        query: &UserValuesQuery,
    ) -> BoxFuture<'_, Result<UserValuePage, StoreError>>;

    /// Whether other processes may append to this store's streams (several runtime nodes on
    /// one database). Live readers then also poll, since only this node's appends wake them.
    fn shared(&self) -> bool {
        false
    }

    /// Which of the submissions `ids` (distinct) have settled, in any order; ids of no
    /// submission are left out. On a [shared](Store::shared) store a node's waits for submissions other
    /// nodes may settle look with this, all of them in one read per
    /// [`RuntimeOptions::shared_store_poll`](crate::RuntimeOptions::shared_store_poll), instead
    /// of a read of each row per wait. The default reads each row.
    fn settled_among<'a>(&'a self, ids: &'a [String]) -> BoxFuture<'a, Result<Vec<String>, StoreError>> {
        Box::pin(async move {
            let mut settled = Vec::new();
            for id in ids {
                if self.submission(id).await?.is_some_and(|row| row.outcome.is_some()) {
                    settled.push(id.clone());
                }
            }
            Ok(settled)
        })
    }

    /// Whether one process at a time can use this store (an embedded database the process
    /// holds locked). A submission found running when a runtime starts, under an owner that is
    /// not a runtime of this process, was then left by a process that ended (a crash, a
    /// Ctrl-C): the runtime takes it over at once rather than once its lease ran out.
    fn exclusive(&self) -> bool {
        false
    }

    /// Notices of what other nodes sharing this store did, for a store that announces them
    /// (`None`, the default, for one that does not): a node then wakes the sends waiting on a
    /// submission another node settled, stops an attempt whose abort another node requested,
    /// and claims work another node gave back, at once rather than at its next look
    /// ([`RuntimeOptions::shared_store_poll`], [`RuntimeOptions::heartbeat`],
    /// [`RuntimeOptions::scan_interval`]). A notice is a hint to look again: the store stays the
    /// truth, and a node that may have missed notices receives [`StoreNotice::Resync`].
    ///
    /// Called from within a tokio runtime, once per node.
    ///
    /// [`RuntimeOptions::shared_store_poll`]: crate::RuntimeOptions::shared_store_poll
    /// [`RuntimeOptions::heartbeat`]: crate::RuntimeOptions::heartbeat
    /// [`RuntimeOptions::scan_interval`]: crate::RuntimeOptions::scan_interval
    fn notices(&self) -> Option<tokio::sync::broadcast::Receiver<StoreNotice>> {
        None
    }

    /// Tells the other nodes sharing this store `notice`, on a store that announces what its
    /// nodes do (see [`Store::notices`]; others ignore it). The store announces the changes it
    /// commits itself; the runtime announces what it leaves to the others: the queue of an
    /// instance it stops running ([`StoreNotice::Queued`]).
    fn announce(&self, notice: StoreNotice) {
        let _ = notice;
    }

    /// Waits (a bounded while) until what this node announced went out: what a node about to
    /// exit does last ([`crate::Runtime::release`]).
    fn flush_announcements(&self) -> BoxFuture<'_, ()> {
        Box::pin(std::future::ready(()))
    }
}

/// What a node sharing a store announced it did (see [`Store::notices`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreNotice {
    /// Submissions of this instance settled.
    Settled(InstanceKey),
    /// An abort was requested for this instance's unsettled submissions.
    AbortRequested(InstanceKey),
    /// A submission of this instance went back to the queue (a node gave its work back): a
    /// node that runs the agent may claim it.
    Queued(InstanceKey),
    /// Notices may have been missed (the listening connection was lost and is back, or this
    /// receiver fell behind): look at everything again.
    Resync,
}
