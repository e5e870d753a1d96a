//! The Postgres store: the whole [`Store`] contract in a Postgres database that several runtime
//! processes share.
//!
//! Layout (all in one schema, the connection's current schema):
//! - `flue_meta(key, value)`: the format stamp (`format_version = "1"`).
//! - `flue_instances`: one row per instance: its incarnation (`uid`) and `next_offset`, the
//!   number of batches in its stream.
//! - `flue_batches`: one row per appended batch, keyed by `(agent, instance_id, batch_offset)`;
//!   `records` holds the batch's records as JSON text.
//! - `flue_submissions`: the ledger; `admission_seq` is a global `BIGSERIAL`.
//!
//! Concurrency: every operation that changes more than one row, or that checks a row before
//! changing another, runs in one transaction that first locks the instance row
//! (`FOR NO KEY UPDATE`). So per instance, admissions, claims, joins, settlements, requeues,
//! aborts and appends are serialized across every process sharing the database: two nodes
//! cannot both claim a head, a fenced attempt cannot slip an append past a reclaim, and two
//! writers get distinct consecutive offsets. Transactions that Postgres aborts as deadlock or
//! serialization victims are retried. Each transaction says its isolation, `READ COMMITTED`
//! (each statement sees what committed before it, so what it reads under the instance's lock
//! is current), whatever the server's default: under a `REPEATABLE READ` default, an admission
//! whose snapshot predates the lock would not see one committed meanwhile and claim beside it.
//!
//! A node that stalls inside one of those transactions (a suspended process, a node cut off
//! from the database mid-call) would keep the instance row locked, and every other node's work
//! on the instance, a takeover of the stalled node's lease included, would wait for as long as
//! its connection lived. So each transaction the store opens sets
//! `idle_in_transaction_session_timeout` for itself (`set_config(…, true)`, which is `SET
//! LOCAL`: prepared once per connection, then sent with the transaction's first statement, so
//! it adds no round trip): [`PostgresStore::STALLED_TRANSACTION_TIMEOUT`] by default, under
//! the runtime's default 30 s lease ([`PostgresStore::with_stalled_transaction_timeout`]). The
//! server then ends such a transaction and its session, which releases the locks. The store's
//! transactions wait on the client only between statements it sends back to back. (A
//! transaction-scoped setting, not the connection's: it holds behind a pooler such as PgBouncer
//! in transaction mode, which also refuses such a setting as a startup parameter.)
//!
//! Notices: a node announces the settlements, abort requests and submissions given back to the
//! queue it commits over `LISTEN`/`NOTIFY`, on one more connection of its own (the `notices`
//! module), so the other nodes' waiting sends, running attempts and workers learn of them at
//! once ([`Store::notices`]).
//!
//! Clocks: every time stored in `flue_submissions` (`lease_until_ms`, `timeout_at_ms`) and every
//! time a row is compared with (an expiry scan's or a takeover's `now_ms`) is in the database's
//! clock, so nodes whose clocks disagree still agree on which leases are live. The [`Store`]
//! methods keep taking and returning times in the calling node's clock ([`super::now_ms`]): the
//! store measures how far the database's clock (`clock_timestamp()`) is from the node's when it
//! opens (the best of a few round trips) and again at every expiry scan ([`Store::expired`]) and
//! lease heartbeat ([`Store::renew_leases`]; a claim made between two of them uses the last), and
//! translates each time it writes or compares into database time, and each time it reads back into
//! node time. A new measurement replaces the offset only when the two disagree by more than their
//! measuring error (half a round trip and a millisecond of truncation each): a time written and
//! read back under agreeing measurements is returned exactly, and a node clock that was stepped or
//! drifted is followed from the next scan on. 0 (no time) and `u64::MAX` (never) are kept as they
//! are.

mod notices;

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime, Transaction};
use flue_core::BoxFuture;
use flue_core::lifecycle::{UserValue, UserValuePage, UserValuesQuery};
use flue_core::message::DeliveredMessage;
use tokio_postgres::error::SqlState;
use tokio_postgres::{NoTls, Row};

use super::attachments::conflict;
use super::{
    ATTACHMENT_CHUNK_BYTES, Admission, Admitted, AttachmentPut, AttemptRef, Claim, FORMAT_VERSION, InstanceInfo,
    InstanceKey, Store, StoreError, StoredAttachment, Submission, SubmissionKind, SubmissionStatus, TraceContext,
    UidCondition,
};
use crate::error_chain;
use crate::record::{Batch, Outcome, Record, SettlementError, new_id, now};

/// The legacy stamp that is adopted in place as format 1.
const LEGACY_SCHEMA_VERSION: &str = "8";
/// First key of the advisory lock that serializes concurrent format checks of one schema.
const MIGRATION_LOCK: i32 = 0x666c_7565; // "flue"
/// Connections per store (per process).
const POOL_SIZE: usize = 16;
/// Connections of the heartbeat's own pool (per store), beside [`POOL_SIZE`]: lease renewals
/// never wait behind the node's other work for a connection.
const HEARTBEAT_POOL_SIZE: usize = 1;
/// The least time a lease renewal is given before its connection is taken for dead (see
/// [`PostgresStore`]'s `renew_leases`).
const RENEWAL_DEADLINE_FLOOR: Duration = Duration::from_secs(1);
/// How long to wait for a new connection, or for a free one.
const POOL_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a pooled connection whose server vanished without a reset (a failover that lost
/// the host, a partition, a firewall that drops silently) goes unnoticed, at most: TCP
/// keepalives probe a connection waiting for an answer, and an unacknowledged request fails
/// after as long. Without them a query on such a connection waits out the kernel's
/// retransmissions (about 15 minutes): the node's heartbeat stalls while its leases lapse and
/// its peers take its instances over, and the pool's connections fill with hung calls.
const DEAD_CONNECTION: Duration = Duration::from_secs(20);

/// Bounds how long a pooled connection to a vanished server goes unnoticed
/// ([`DEAD_CONNECTION`]), where the URL set nothing of its own (`keepalives_idle`,
/// `tcp_user_timeout`).
fn bound_dead_connections(config: &mut tokio_postgres::Config) {
    // tokio-postgres's default idle time before the first probe: two hours.
    const LIBRARY_IDLE: Duration = Duration::from_secs(2 * 60 * 60);
    if config.get_keepalives() && config.get_keepalives_idle() == LIBRARY_IDLE {
        config
            .keepalives_idle(DEAD_CONNECTION / 2)
            .keepalives_interval(DEAD_CONNECTION / 6)
            .keepalives_retries(3);
    }
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(DEAD_CONNECTION);
    }
}
/// How often a transaction Postgres aborted as a deadlock or serialization victim is rerun.
const MAX_TRIES: u32 = 8;
/// Round trips measuring the database clock when a store opens; the most precise one counts.
const CLOCK_MEASUREMENTS_AT_OPEN: u32 = 3;
/// The database's clock, in whole milliseconds since the Unix epoch.
const DATABASE_NOW: &str = "SELECT FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT";

/// The `flue_meta` table: created, and stamped, before any other table.
const CREATE_META: &str = "CREATE TABLE flue_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)";

/// The other tables, by name, with their indexes.
const TABLES: [(&str, &str); 5] = [
    (
        "flue_instances",
        "CREATE TABLE flue_instances (
            agent TEXT NOT NULL,
            instance_id TEXT NOT NULL,
            uid TEXT NOT NULL,
            next_offset BIGINT NOT NULL DEFAULT 0,
            created_at TEXT NOT NULL,
            PRIMARY KEY (agent, instance_id)
        )",
    ),
    (
        "flue_batches",
        "CREATE TABLE flue_batches (
            agent TEXT NOT NULL,
            instance_id TEXT NOT NULL,
            batch_offset BIGINT NOT NULL,
            records TEXT NOT NULL,
            PRIMARY KEY (agent, instance_id, batch_offset),
            FOREIGN KEY (agent, instance_id) REFERENCES flue_instances (agent, instance_id)
        )",
    ),
    (
        "flue_submissions",
        "CREATE TABLE flue_submissions (
            id TEXT PRIMARY KEY,
            admission_seq BIGSERIAL NOT NULL UNIQUE,
            agent TEXT NOT NULL,
            instance_id TEXT NOT NULL,
            kind TEXT NOT NULL CHECK (kind IN ('dispatch', 'direct')),
            message TEXT NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('queued', 'running', 'joining', 'joined', 'settled')),
            accepted_at TEXT NOT NULL,
            attempt_id TEXT,
            owner_id TEXT,
            lease_until_ms NUMERIC(20, 0) NOT NULL DEFAULT 0,
            attempt_count BIGINT NOT NULL DEFAULT 0,
            max_attempts BIGINT NOT NULL,
            timeout_ms NUMERIC(20, 0) NOT NULL,
            timeout_at_ms NUMERIC(20, 0) NOT NULL DEFAULT 0,
            abort_requested BOOLEAN NOT NULL DEFAULT FALSE,
            joined_into TEXT,
            outcome TEXT CHECK (outcome IN ('completed', 'failed', 'aborted')),
            error TEXT,
            trace TEXT,
            initial_data TEXT,
            FOREIGN KEY (agent, instance_id) REFERENCES flue_instances (agent, instance_id)
        );
        CREATE INDEX flue_submissions_unsettled ON flue_submissions (agent, instance_id, admission_seq)
            WHERE status <> 'settled';
        CREATE INDEX flue_submissions_queued ON flue_submissions (agent, instance_id) WHERE status = 'queued';
        CREATE INDEX flue_submissions_running ON flue_submissions (owner_id) WHERE status = 'running'",
    ),
    (
        "flue_attachments",
        "CREATE TABLE flue_attachments (
            id TEXT PRIMARY KEY,
            agent TEXT NOT NULL,
            instance_id TEXT NOT NULL,
            media_type TEXT NOT NULL,
            size BIGINT NOT NULL,
            digest TEXT NOT NULL
        );
        CREATE TABLE flue_attachment_chunks (
            id TEXT NOT NULL REFERENCES flue_attachments (id),
            chunk INTEGER NOT NULL,
            bytes BYTEA NOT NULL,
            PRIMARY KEY (id, chunk)
        )",
    ),
    (
        "flue_user_values",
        "CREATE TABLE flue_user_values (
            user_id TEXT NOT NULL,
            key TEXT COLLATE \"C\" NOT NULL,
            value TEXT NOT NULL,
            updated_at BIGINT NOT NULL,
            PRIMARY KEY (user_id, key)
        )",
    ),
];

/// The columns a `flue_submissions` table created by an earlier build may lack (the timeouts,
/// the trace context, the creation data), with their definitions.
const ADDED_SUBMISSION_COLUMNS: [(&str, &str); 4] = [
    ("timeout_ms", "NUMERIC(20, 0) NOT NULL DEFAULT 3600000"),
    ("timeout_at_ms", "NUMERIC(20, 0) NOT NULL DEFAULT 0"),
    ("trace", "TEXT"),
    ("initial_data", "TEXT"),
];

/// The columns [`submission_from_row`] decodes, in its order.
macro_rules! submission_columns {
    () => {
        "id, admission_seq, agent, instance_id, kind, message, status, accepted_at, attempt_id, owner_id, \
         lease_until_ms::TEXT, attempt_count, max_attempts, abort_requested, joined_into, outcome, error, \
         timeout_ms::TEXT, timeout_at_ms::TEXT, trace, initial_data"
    };
}

const SELECT_SUBMISSION: &str = concat!("SELECT ", submission_columns!(), " FROM flue_submissions WHERE id = $1");
const SELECT_UID: &str = "SELECT uid FROM flue_instances WHERE agent = $1 AND instance_id = $2";
const LOCK_INSTANCE: &str =
    "SELECT uid, next_offset FROM flue_instances WHERE agent = $1 AND instance_id = $2 FOR NO KEY UPDATE";
const LOCK_INSTANCE_OF: &str = "SELECT i.agent, i.instance_id FROM flue_submissions s \
     JOIN flue_instances i ON i.agent = s.agent AND i.instance_id = s.instance_id \
     WHERE s.id = $1 FOR NO KEY UPDATE OF i";
const OWNS: &str = "SELECT 1 FROM flue_submissions WHERE id = $1 AND status = 'running' AND attempt_id = $2";
/// [`OWNS`], and no abort of the attempt's submission requested (a host being aborted takes no
/// more deliveries: one admitted after the abort was requested is not part of what it ends).
const OWNS_UNABORTED: &str = "SELECT 1 FROM flue_submissions \
     WHERE id = $1 AND status = 'running' AND attempt_id = $2 AND NOT abort_requested";
/// The attempt's submission's instance, when the attempt runs it (the row held until commit).
const OWNS_SHARED: &str = "SELECT agent, instance_id FROM flue_submissions \
     WHERE id = $1 AND status = 'running' AND attempt_id = $2 FOR SHARE";
const INSERT_INSTANCE: &str = "INSERT INTO flue_instances (agent, instance_id, uid, next_offset, created_at) \
     VALUES ($1, $2, $3, 0, $4) ON CONFLICT DO NOTHING RETURNING uid";
const INSERT_SUBMISSION: &str = concat!(
    "INSERT INTO flue_submissions (id, agent, instance_id, kind, message, status, accepted_at, max_attempts, \
     timeout_ms, trace, initial_data) VALUES ($1, $2, $3, $4, $5, 'queued', $6, $7, $8::TEXT::NUMERIC, $9, $10) \
     ON CONFLICT (id) DO NOTHING RETURNING ",
    submission_columns!()
);
/// Takes the stream's next offset and inserts the batch at it, in one statement (one round
/// trip); no row when the stream does not exist.
const APPEND_BATCH: &str = "WITH bumped AS (UPDATE flue_instances SET next_offset = next_offset + 1 \
     WHERE agent = $1 AND instance_id = $2 RETURNING next_offset - 1 AS batch_offset) \
     INSERT INTO flue_batches (agent, instance_id, batch_offset, records) \
     SELECT $1, $2, batch_offset, $3 FROM bumped RETURNING batch_offset";
/// [`APPEND_BATCH`] fenced by the appending attempt (`$4`, `$5`: the submission and attempt ids,
/// both null for an unfenced append): no row, and nothing written, when the attempt does not
/// own its submission. What lets [`PostgresStore::append`] send its `COMMIT` before it has
/// seen the fence's answer. The check share-locks the submission row itself, so the statement
/// is fenced on its own, whatever ran before it.
/// The submission must also be the stream's instance's, or the stream one of its task children's
/// (see [`InstanceKey::writable_by`]).
const APPEND_BATCH_FENCED: &str = "WITH bumped AS (UPDATE flue_instances SET next_offset = next_offset + 1 \
     WHERE agent = $1 AND instance_id = $2 AND ($4::TEXT IS NULL OR EXISTS (SELECT 1 FROM flue_submissions \
     WHERE id = $4::TEXT AND status = 'running' AND attempt_id = $5::TEXT \
     AND ((agent = $1 AND instance_id = $2) OR ($1 = agent || ':task' AND strpos($2, '/task_') > 0 \
     AND left($2, strpos($2, '/task_') - 1) = instance_id)) \
     FOR SHARE)) \
     RETURNING next_offset - 1 AS batch_offset) \
     INSERT INTO flue_batches (agent, instance_id, batch_offset, records) \
     SELECT $1, $2, batch_offset, $3 FROM bumped RETURNING batch_offset";
/// Whether submission `$1` is a delivery claimed into host `$2`'s response (held until commit).
const JOINED_INTO: &str = "SELECT 1 FROM flue_submissions WHERE id = $1 AND joined_into = $2 \
     AND status IN ('joining', 'joined') FOR SHARE";
/// `$4`: at most that many (`NULL`: all).
const SELECT_BATCHES: &str = "SELECT batch_offset, records FROM flue_batches \
     WHERE agent = $1 AND instance_id = $2 AND batch_offset > $3 ORDER BY batch_offset LIMIT $4";
const LAST_BATCH: &str = "SELECT MAX(batch_offset) FROM flue_batches WHERE agent = $1 AND instance_id = $2";
/// Limits how long the current transaction may wait on the client, in milliseconds (`SET
/// LOCAL`, as a prepared statement).
const LIMIT_STALL: &str = "SELECT set_config('idle_in_transaction_session_timeout', $1, true)";

/// The slowest link the stall limit allows for a large statement's transfer, in bytes per
/// second (see [`PostgresStore::stall_limit_for`]): a 16 MiB admission gets 16 s more.
const SLOW_LINK_BYTES_PER_S: usize = 1 << 20;
/// Whether the host submission's instance has queued work (one round trip, no locks).
const JOINABLE_EXISTS: &str = "SELECT EXISTS (SELECT 1 FROM flue_submissions s JOIN flue_submissions h \
     ON h.id = $1 AND NOT h.abort_requested AND s.agent = h.agent AND s.instance_id = h.instance_id \
     WHERE s.status = 'queued')";
const SETTLED_AMONG: &str = "SELECT id FROM flue_submissions WHERE id = ANY($1) AND outcome IS NOT NULL";
const HAS_QUEUED: &str =
    "SELECT EXISTS (SELECT 1 FROM flue_submissions WHERE agent = $1 AND instance_id = $2 AND status = 'queued')";
const HEAD: &str = "SELECT id, status FROM flue_submissions \
     WHERE agent = $1 AND instance_id = $2 AND status <> 'settled' ORDER BY admission_seq LIMIT 1";
const CLAIM: &str = concat!(
    "UPDATE flue_submissions SET status = 'running', attempt_id = $2, owner_id = $3, \
     lease_until_ms = $4::TEXT::NUMERIC, attempt_count = attempt_count + 1, \
     timeout_at_ms = CASE WHEN timeout_at_ms = 0 THEN LEAST($5::TEXT::NUMERIC + timeout_ms, 18446744073709551615) ELSE timeout_at_ms END \
     WHERE id = $1 AND status = 'queued' RETURNING ",
    submission_columns!()
);
const RENEW: &str = "UPDATE flue_submissions SET lease_until_ms = $2::TEXT::NUMERIC \
     WHERE status = 'running' AND owner_id = $1 AND attempt_id = ANY($3) AND id IN (\
         SELECT id FROM flue_submissions WHERE status = 'running' AND owner_id = $1 AND attempt_id = ANY($3) \
         ORDER BY id FOR UPDATE)";
const EXPIRED: &str = concat!(
    "SELECT ",
    submission_columns!(),
    " FROM flue_submissions WHERE status = 'running' AND lease_until_ms > 0 \
     AND lease_until_ms < $1::TEXT::NUMERIC ORDER BY admission_seq"
);
const RECLAIM: &str = concat!(
    "UPDATE flue_submissions SET attempt_id = $3, owner_id = $4, lease_until_ms = $5::TEXT::NUMERIC, \
     attempt_count = attempt_count + 1 WHERE id = $1 AND status = 'running' AND attempt_id = $2 \
     AND lease_until_ms > 0 AND lease_until_ms < $6::TEXT::NUMERIC RETURNING ",
    submission_columns!()
);
const ABORTS_REQUESTED: &str = "SELECT attempt_id FROM flue_submissions \
     WHERE status = 'running' AND abort_requested AND attempt_id = ANY($1)";
const INSTANCES_WITH_QUEUED: &str = "SELECT agent, instance_id FROM flue_submissions WHERE status <> 'settled' \
     GROUP BY agent, instance_id HAVING bool_or(status = 'queued') AND NOT bool_or(status = 'running') \
     ORDER BY agent COLLATE \"C\", instance_id COLLATE \"C\"";
const QUEUED: &str = "SELECT id, abort_requested FROM flue_submissions \
     WHERE agent = $1 AND instance_id = $2 AND status = 'queued' ORDER BY admission_seq";
const JOIN: &str = concat!(
    "UPDATE flue_submissions SET status = 'joining', joined_into = $2 WHERE id = ANY($1) AND status = 'queued' \
     RETURNING ",
    submission_columns!()
);
const FINALIZE_JOIN: &str = "UPDATE flue_submissions SET status = 'joined' \
     WHERE id = $1 AND status = 'joining' AND joined_into = $2";
const SETTLE_JOINED: &str = "UPDATE flue_submissions SET status = 'settled', outcome = $4, error = $5 \
     WHERE agent = $1 AND instance_id = $2 AND joined_into = $3 AND status = 'joined'";
const REVERT_JOINING: &str = "UPDATE flue_submissions SET status = 'queued', joined_into = NULL \
     WHERE agent = $1 AND instance_id = $2 AND joined_into = $3 AND status = 'joining'";
/// Settles the host and says whether a submission of its instance is still queued (the
/// subquery sees the transaction's earlier statements: a join put back in the queue counts).
const SETTLE_HOST: &str = "UPDATE flue_submissions SET status = 'settled', lease_until_ms = 0, outcome = $2, \
     error = $3 WHERE id = $1 RETURNING EXISTS (SELECT 1 FROM flue_submissions \
     WHERE agent = $4 AND instance_id = $5 AND status = 'queued')";
const REQUEUE_HOST: &str = "UPDATE flue_submissions SET status = 'queued', attempt_id = NULL, owner_id = NULL, \
     lease_until_ms = 0 WHERE id = $1";
const REQUEST_ABORT: &str = "UPDATE flue_submissions SET abort_requested = TRUE \
     WHERE agent = $1 AND instance_id = $2 AND status <> 'settled' RETURNING id, admission_seq";

/// A [`Store`] in a Postgres database, safe for several runtime processes sharing it.
///
/// Cheap to clone (clones share one connection pool of up to 16 connections, and one more
/// connection the heartbeat's lease renewals have to themselves). Connections use no TLS:
/// reach the database over loopback or a trusted network.
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool,
    /// The lease renewals' own connection: a pool its other work holds (slow statements, a
    /// burst of admissions) makes a renewal wait for none, so a busy node's leases do not
    /// lapse and its instances are not taken over while it runs them.
    heartbeat: Pool,
    /// The database clock's offset from this node's.
    clock: Arc<Clock>,
    /// The `idle_in_transaction_session_timeout` each transaction sets for itself, in
    /// milliseconds ([`LIMIT_STALL`]).
    stalled_transaction_ms: Arc<str>,
    /// What this node announces to the others and hears from them ([`Store::notices`]).
    notices: Arc<notices::Notices>,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = self.pool.status();
        f.debug_struct("PostgresStore")
            .field("connections", &status.size)
            .field("max_connections", &status.max_size)
            .field("clock_offset_ms", &self.clock.offset().ms)
            .finish()
    }
}

/// The offset of the database's clock from this node's (see the module doc's clock rule).
struct Clock {
    offset: Mutex<Offset>,
    /// How far this node's clock is made to run off the real one: tests play a node whose
    /// clock is wrong.
    #[cfg(test)]
    skew_ms: std::sync::atomic::AtomicI64,
}

/// One measurement of the database clock's offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Offset {
    /// Database time minus node time, in milliseconds.
    ms: i64,
    /// How far `ms` may be off: half the round trip it was measured in, plus the milliseconds
    /// both clocks' readings were truncated to.
    error_ms: i64,
}

impl Offset {
    /// The offset of a database reading `database` taken between the node readings `before`
    /// and `after` (all in milliseconds since the Unix epoch).
    fn measured(before: i64, database: i64, after: i64) -> Self {
        let round_trip = after.saturating_sub(before).max(0);
        Self {
            ms: database.saturating_sub(before).saturating_sub(round_trip / 2),
            error_ms: (round_trip + 1) / 2 + 1,
        }
    }

    /// Whether this measurement and `other` cannot both be right: the clocks moved apart.
    fn disagrees_with(self, other: Self) -> bool {
        self.ms.abs_diff(other.ms) > self.error_ms.saturating_add(other.error_ms).unsigned_abs()
    }
}

impl Clock {
    fn new(offset: Offset) -> Self {
        Self {
            offset: Mutex::new(offset),
            #[cfg(test)]
            skew_ms: std::sync::atomic::AtomicI64::new(0),
        }
    }

    fn offset(&self) -> Offset {
        *self.offset.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes `measured` when it disagrees with the offset in use (or `always`); keeps the
    /// offset in use otherwise, so times written under it read back unchanged.
    fn update(&self, measured: Offset, always: bool) {
        let mut offset = self.offset.lock().unwrap_or_else(PoisonError::into_inner);
        if always || measured.disagrees_with(*offset) {
            *offset = measured;
        }
    }

    /// Now, on this node's clock.
    fn node_now(&self) -> u64 {
        super::now_ms().saturating_add_signed(self.skew_ms())
    }

    #[cfg(test)]
    fn skew_ms(&self) -> i64 {
        self.skew_ms.load(std::sync::atomic::Ordering::Relaxed)
    }

    #[cfg(not(test))]
    fn skew_ms(&self) -> i64 {
        0
    }

    /// Now, in database time, as this node estimates it.
    fn database_now(&self) -> u64 {
        self.to_database(self.node_now())
    }

    /// A node-clock time in database time.
    fn to_database(&self, node_ms: u64) -> u64 {
        shift(node_ms, self.offset().ms)
    }

    /// A row as read from the database, with its times on this node's clock.
    fn submission_to_node(&self, mut row: Submission) -> Submission {
        let offset = self.offset().ms.saturating_neg();
        row.lease_until_ms = shift(row.lease_until_ms, offset);
        row.timeout_at_ms = shift(row.timeout_at_ms, offset);
        row
    }

    /// `claim` with its lease in database time.
    fn claim_to_database(&self, claim: &Claim) -> Claim {
        Claim {
            lease_until_ms: self.to_database(claim.lease_until_ms),
            ..claim.clone()
        }
    }
}

/// `time` moved by `offset_ms`: 0 (no time) and `u64::MAX` (never) stay, any other time stays a
/// time (at least 1).
fn shift(time: u64, offset_ms: i64) -> u64 {
    match time {
        0 | u64::MAX => time,
        _ => time.saturating_add_signed(offset_ms).max(1),
    }
}

/// Why a step of a store operation failed.
enum Failure {
    /// A refusal or failure to report as is.
    Store(StoreError),
    /// The database failed.
    Db(tokio_postgres::Error),
    /// A concurrent admission committed what this one was about to write: rerun it.
    Restart,
}

impl From<tokio_postgres::Error> for Failure {
    fn from(error: tokio_postgres::Error) -> Self {
        Self::Db(error)
    }
}

impl From<StoreError> for Failure {
    fn from(error: StoreError) -> Self {
        Self::Store(error)
    }
}

impl Failure {
    /// Whether the transaction was rolled back and may simply be rerun.
    fn is_transient(&self) -> bool {
        match self {
            Self::Restart => true,
            Self::Db(error) => matches!(
                error.code(),
                Some(code) if *code == SqlState::T_R_SERIALIZATION_FAILURE || *code == SqlState::T_R_DEADLOCK_DETECTED
            ),
            Self::Store(_) => false,
        }
    }

    fn into_store_error(self) -> StoreError {
        match self {
            Self::Store(error) => error,
            Self::Db(error) => db_error(&error),
            Self::Restart => StoreError::Other("postgres: the operation kept racing concurrent writers".into()),
        }
    }
}

/// A database error as a store error, with its cause chain (the top-level message alone is
/// often just "db error").
fn db_error(error: &tokio_postgres::Error) -> StoreError {
    if let Some(db) = error.as_db_error() {
        return StoreError::Other(format!("postgres: {} (SQLSTATE {})", db.message(), db.code().code()));
    }
    StoreError::Other(format!("postgres: {}", error_chain(error)))
}

fn unsupported(version: &str) -> StoreError {
    StoreError::FormatVersion {
        stored: version.to_owned(),
    }
}

fn corrupt(what: impl fmt::Display) -> StoreError {
    StoreError::Other(format!("postgres: unreadable row: {what}"))
}

/// Runs `$body` (an expression using the transaction `$tx`, yielding `Result<T, Failure>`) in a
/// transaction of a pooled connection and commits it; reruns it when Postgres rolled it back as
/// a deadlock or serialization victim. The transaction first limits how long it may wait on
/// this node (the module's doc): that statement goes out with the body's first one.
macro_rules! in_transaction {
    ($store:expr, |$tx:ident| $body:expr) => {
        in_transaction!($store, 0, |$tx| $body)
    };
    // `$sent`: how many bytes the body's statements send (the limit allows for their transfer).
    ($store:expr, $sent:expr, |$tx:ident| $body:expr) => {
        retrying!(async {
            let mut client = $store.client().await?;
            // Isolation said, not the server's default: each statement sees what committed
            // before it (what the instance's lock serializes), whatever a DBA set.
            let $tx = client
                .build_transaction()
                .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
                .start()
                .await?;
            // Polled first, so sent first (a prepared statement: its Parse goes out once per
            // connection): the body's statements run under the limit.
            let limit = $tx.prepare_cached(LIMIT_STALL).await?;
            let ms = $store.stall_limit_for($sent);
            let ms: &str = &ms;
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&ms];
            let (limited, value) = futures_util::join!($tx.execute(&limit, &params), async { $body });
            limited?;
            let value = value?;
            $tx.commit().await?;
            Ok(value)
        })
    };
}

/// The stall limit `base` (milliseconds) for statements sending `sent` bytes (see
/// [`PostgresStore::stall_limit_for`]).
fn stall_limit_ms(base: &Arc<str>, sent: usize) -> Arc<str> {
    if sent < SLOW_LINK_BYTES_PER_S / 10 {
        return base.clone();
    }
    let ms: u64 = base.parse().unwrap_or(i32::MAX as u64);
    let transfer = (sent as u64).saturating_mul(1000) / SLOW_LINK_BYTES_PER_S as u64;
    ms.saturating_add(transfer).min(i32::MAX as u64).to_string().into()
}

/// Roughly how many bytes an admission's statements send: its message (images included)
/// and its initial data.
fn admission_bytes(admission: &Admission) -> usize {
    let message = match &admission.message {
        flue_core::message::DeliveredMessage::User(message) => {
            message.body.len()
                + message
                    .attachments
                    .iter()
                    .map(|attachment| match attachment {
                        flue_core::message::Attachment::Image { data, .. } => data.len(),
                    })
                    .sum::<usize>()
        }
        flue_core::message::DeliveredMessage::Signal(signal) => {
            signal.body.len()
                + signal
                    .attributes
                    .iter()
                    .map(|(name, value)| name.len() + value.len())
                    .sum::<usize>()
        }
    };
    // Twice when the admission creates the instance: in its birth record and its row.
    message + 2 * admission.initial_data.as_ref().map_or(0, crate::json_shape::json_bytes)
}

/// Awaits `$attempt` (a future of `Result<T, Failure>`, made afresh each time) until it does
/// not fail as a deadlock or serialization victim, at most [`MAX_TRIES`] times.
macro_rules! retrying {
    ($attempt:expr) => {{
        let mut tries = 0u32;
        loop {
            tries += 1;
            let result: Result<_, Failure> = $attempt.await;
            match result {
                Err(failure) if failure.is_transient() && tries < MAX_TRIES => continue,
                other => break other.map_err(Failure::into_store_error),
            }
        }
    }};
}

impl PostgresStore {
    /// How long the server lets a transaction of the store wait on the client, by default,
    /// before it ends the transaction and its session (`idle_in_transaction_session_timeout`):
    /// a node stalled inside one then holds its locks no longer (see the module's doc).
    pub const STALLED_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(10);

    /// Sets how long the server lets a transaction of this store wait on the client before it
    /// ends it ([`Self::STALLED_TRANSACTION_TIMEOUT`] by default). Keep it well under the
    /// runtime's lease, so a node that takes a stalled one's lease over does not wait on its
    /// locks, and well over a pause a healthy node makes mid-transaction. A timeout under a
    /// millisecond counts as one (Postgres reads 0 as no limit), and one over Postgres's
    /// longest (`i32::MAX` ms, about 24.8 days; `Duration::MAX` for "no limit") as that.
    pub fn with_stalled_transaction_timeout(mut self, timeout: Duration) -> Self {
        self.stalled_transaction_ms = timeout.as_millis().clamp(1, i32::MAX as u128).to_string().into();
        self
    }

    /// The stall limit of a transaction whose statements send `sent` bytes: a large one (an
    /// admission with images, a batch of large tool outputs) gets the time it takes to cross
    /// a slow link on top ([`SLOW_LINK_BYTES_PER_S`]), since the server counts a statement
    /// still arriving as the client's wait.
    fn stall_limit_for(&self, sent: usize) -> Arc<str> {
        stall_limit_ms(&self.stalled_transaction_ms, sent)
    }

    /// Connects to the database at `url` (`postgres://user:password@host:port/database`, or a
    /// `key=value` connection string) and uses its current schema (the first existing schema of
    /// the role's `search_path`, usually `public`).
    ///
    /// On first use it stamps the schema with format version 1 and creates the store's tables
    /// (`flue_meta`, `flue_instances`, `flue_batches`, `flue_submissions`, `flue_attachments`,
    /// `flue_attachment_chunks`, `flue_user_values`; a table added to format 1 later is created
    /// when missing). A schema stamped
    /// with the legacy `schema_version = "8"` is adopted in place; any other stamp, or `flue_*`
    /// tables without a stamp, is refused without changing anything
    /// ([`StoreError::FormatVersion`]).
    ///
    /// The server ends a transaction of the store left waiting on the client for
    /// [`Self::STALLED_TRANSACTION_TIMEOUT`] (see the module's doc and
    /// [`Self::with_stalled_transaction_timeout`]).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::open(url, None).await
    }

    /// Like [`PostgresStore::connect`], but keeps everything in `schema`: creates the schema if
    /// it is missing and sets it as the `search_path` of every pooled connection. Tests use it
    /// to give each store a fresh, isolated schema of one database.
    pub async fn connect_with_schema(url: &str, schema: &str) -> Result<Self, StoreError> {
        if schema.is_empty() {
            return Err(StoreError::Other("postgres: the schema name must not be empty".into()));
        }
        Self::open(url, Some(schema)).await
    }

    async fn open(url: &str, schema: Option<&str>) -> Result<Self, StoreError> {
        let mut config: tokio_postgres::Config = url
            .parse()
            .map_err(|error: tokio_postgres::Error| StoreError::Other(format!("postgres: invalid URL: {error}")))?;
        if let Some(schema) = schema {
            let search_path = format!("-c search_path={}", escape_option(&quote_identifier(schema)));
            let options = match config.get_options() {
                Some(existing) if !existing.trim().is_empty() => format!("{existing} {search_path}"),
                _ => search_path,
            };
            config.options(options);
        }
        if config.get_application_name().is_none() {
            config.application_name("flue-runtime");
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(POOL_TIMEOUT);
        }
        let notices = notices::Notices::new(config.clone());
        bound_dead_connections(&mut config);
        let pool_of = |size: usize| {
            let manager = Manager::from_config(
                config.clone(),
                NoTls,
                ManagerConfig {
                    recycling_method: RecyclingMethod::Fast,
                },
            );
            Pool::builder(manager)
                .max_size(size)
                .runtime(Runtime::Tokio1)
                .create_timeout(Some(POOL_TIMEOUT))
                .wait_timeout(Some(POOL_TIMEOUT))
                .build()
                .map_err(|error| StoreError::Other(format!("postgres: cannot build the connection pool: {error}")))
        };
        let store = Self {
            pool: pool_of(POOL_SIZE)?,
            heartbeat: pool_of(HEARTBEAT_POOL_SIZE)?,
            clock: Arc::new(Clock::new(Offset { ms: 0, error_ms: 0 })),
            stalled_transaction_ms: Self::STALLED_TRANSACTION_TIMEOUT.as_millis().to_string().into(),
            notices,
        };
        if let Some(schema) = schema {
            store.create_schema(schema).await?;
        }
        in_transaction!(store, |tx| prepare_format(&tx).await)?;
        store.measure_clock().await?;
        Ok(store)
    }

    /// Sets the database clock's offset from the most precise of a few measurements.
    async fn measure_clock(&self) -> Result<(), StoreError> {
        let mut best = self.clock_offset().await?;
        for _ in 1..CLOCK_MEASUREMENTS_AT_OPEN {
            let measured = self.clock_offset().await?;
            if measured.error_ms < best.error_ms {
                best = measured;
            }
        }
        self.clock.update(best, true);
        Ok(())
    }

    /// Measures the database clock's offset from this node's in one round trip.
    async fn clock_offset(&self) -> Result<Offset, StoreError> {
        let client = self.client().await.map_err(Failure::into_store_error)?;
        self.clock_offset_on(&client).await
    }

    /// [`Self::clock_offset`] on a connection the caller holds.
    async fn clock_offset_on(&self, client: &deadpool_postgres::Client) -> Result<Offset, StoreError> {
        let statement = client
            .prepare_cached(DATABASE_NOW)
            .await
            .map_err(|error| db_error(&error))?;
        let millis = |time: u64| i64::try_from(time).unwrap_or(i64::MAX);
        let before = millis(self.clock.node_now());
        let row = client
            .query_one(&statement, &[])
            .await
            .map_err(|error| db_error(&error))?;
        let after = millis(self.clock.node_now());
        let database: i64 = row.try_get(0).map_err(|error| db_error(&error))?;
        Ok(Offset::measured(before, database, after))
    }

    async fn create_schema(&self, schema: &str) -> Result<(), StoreError> {
        let client = self.client().await.map_err(Failure::into_store_error)?;
        let statement = format!("CREATE SCHEMA IF NOT EXISTS {}", quote_identifier(schema));
        match client.batch_execute(&statement).await {
            Ok(()) => Ok(()),
            // Another process created it at the same moment.
            Err(error)
                if matches!(error.code(), Some(code) if *code == SqlState::UNIQUE_VIOLATION
                    || *code == SqlState::DUPLICATE_SCHEMA) =>
            {
                Ok(())
            }
            Err(error) => Err(db_error(&error)),
        }
    }

    /// [`Store::append`] in one round trip: `BEGIN`, the stall limit, the instance lock, the owner check (which
    /// holds the submission row until the commit), the fenced append and `COMMIT` go out
    /// together, and the server runs them in that order. The fence is in the append statement
    /// itself ([`APPEND_BATCH_FENCED`]), so a commit sent before the check's answer writes
    /// nothing for an attempt that lost its submission; any failed statement aborts the
    /// transaction, whose `COMMIT` then rolls it back. Every statement is sent on the first
    /// poll (the client's request queue is unbounded), so a caller that stops waiting leaves a
    /// whole transaction to run on the connection, never an open one.
    async fn append_in_one_trip(
        &self,
        key: &InstanceKey,
        records: &[Record],
        authorization: Option<&AttemptRef>,
    ) -> Result<u64, Failure> {
        let json = batch_json(records)?;
        let client = self.client().await?;
        let (limit, lock, owner, append) = (
            client.prepare_cached(LIMIT_STALL).await?,
            client.prepare_cached(LOCK_INSTANCE).await?,
            client.prepare_cached(OWNS_SHARED).await?,
            client.prepare_cached(APPEND_BATCH_FENCED).await?,
        );
        let (agent, id) = (&*key.agent, &*key.id);
        let (submission, attempt) = (
            authorization.map(|attempt| attempt.submission_id.as_str()),
            authorization.map(|attempt| attempt.attempt_id.as_str()),
        );
        let owned = async {
            match (submission, attempt) {
                (Some(submission), Some(attempt)) => Ok(client
                    .query_opt(&owner, &[&submission, &attempt])
                    .await?
                    .map(|row| writes(key, &row))),
                _ => Ok::<_, tokio_postgres::Error>(Some(true)),
            }
        };
        let (lock_params, append_params): (
            &[&(dyn tokio_postgres::types::ToSql + Sync)],
            &[&(dyn tokio_postgres::types::ToSql + Sync)],
        ) = (&[&agent, &id], &[&agent, &id, &json, &submission, &attempt]);
        let ms = self.stall_limit_for(json.len());
        let ms: &str = &ms;
        let limit_params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&ms];
        // The stall limit goes out right after `BEGIN`, before the lock: a node cut off once
        // the lock statement reached the server (a batch split across TCP segments) holds the
        // instance only until the server ends the transaction, as in any other.
        let (begun, limited, locked, owned, appended, committed) = futures_util::join!(
            client.batch_execute("BEGIN ISOLATION LEVEL READ COMMITTED"),
            client.execute(&limit, &limit_params),
            client.query_opt(&lock, lock_params),
            owned,
            client.query_opt(&append, append_params),
            client.batch_execute("COMMIT"),
        );
        // The first failure is the cause; the statements after it failed for it.
        begun?;
        limited?;
        let (stream, owned, appended) = (locked?, owned?, appended?);
        committed?;
        append_outcome(key, authorization, stream.is_some(), owned, appended)
    }

    async fn client(&self) -> Result<deadpool_postgres::Client, Failure> {
        self.pool.get().await.map_err(|error| {
            Failure::Store(StoreError::Other(format!(
                "postgres: no database connection: {}",
                error_chain(&error)
            )))
        })
    }

    /// Decodes a row of [`submission_columns!`], its times on this node's clock.
    fn submission_from_row(&self, row: &Row) -> Result<Submission, StoreError> {
        submission_from_row(row)
            .map(|row| self.clock.submission_to_node(row))
            .map_err(Failure::into_store_error)
    }

    /// Runs one read-only statement on a pooled connection.
    async fn query(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        let client = self.client().await.map_err(Failure::into_store_error)?;
        let statement = client.prepare_cached(sql).await.map_err(|error| db_error(&error))?;
        client.query(&statement, params).await.map_err(|error| db_error(&error))
    }
}

/// `name` as a quoted SQL identifier.
fn quote_identifier(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `value` escaped for the `options` startup parameter (split at whitespace, `\` escapes).
fn escape_option(value: &str) -> String {
    let mut escaped = String::with_capacity(value.len());
    for character in value.chars() {
        if character == '\\' || character.is_whitespace() {
            escaped.push('\\');
        }
        escaped.push(character);
    }
    escaped
}

/// Checks the format stamp of the current schema; stamps and creates a fresh one.
async fn prepare_format(tx: &Transaction<'_>) -> Result<(), Failure> {
    // Two processes opening one schema at once: the second waits, then sees the first's tables.
    tx.execute(
        "SELECT pg_advisory_xact_lock($1, hashtext(coalesce(current_schema(), '')))",
        &[&MIGRATION_LOCK],
    )
    .await?;
    let tables: Vec<String> = tx
        .query(
            "SELECT tablename::TEXT FROM pg_catalog.pg_tables \
             WHERE schemaname = current_schema() AND tablename LIKE 'flue\\_%'",
            &[],
        )
        .await?
        .iter()
        .map(|row| row.try_get(0))
        .collect::<Result<_, _>>()?;
    let mut format_version = None;
    let mut schema_version = None;
    if tables.iter().any(|table| table == "flue_meta") {
        for row in tx
            .query(
                "SELECT key, value FROM flue_meta WHERE key IN ('format_version', 'schema_version')",
                &[],
            )
            .await?
        {
            let key: String = row.try_get(0)?;
            let value: String = row.try_get(1)?;
            if key == "format_version" {
                format_version = Some(value);
            } else {
                schema_version = Some(value);
            }
        }
    }
    if crate::store::sqlite::is_fresh(&tables) && format_version.is_none() && schema_version.is_none() {
        // The stamp comes first, before any other table (into an empty `flue_meta` a crash
        // left right after creating it).
        if tables.is_empty() {
            tx.batch_execute(CREATE_META).await?;
        }
        tx.execute(
            "INSERT INTO flue_meta (key, value) VALUES ('format_version', $1)",
            &[&FORMAT_VERSION],
        )
        .await?;
        for (_, ddl) in TABLES {
            tx.batch_execute(ddl).await?;
        }
        return Ok(());
    }
    match (format_version, schema_version) {
        (Some(version), _) if version == FORMAT_VERSION => crate::store::sqlite::check_own_layout(&tables)?,
        (Some(version), _) => return Err(unsupported(&version).into()),
        (None, Some(version)) if version == LEGACY_SCHEMA_VERSION => {
            crate::store::sqlite::check_own_layout(&tables)?;
            tx.execute(
                "UPDATE flue_meta SET key = 'format_version', value = $1 WHERE key = 'schema_version'",
                &[&FORMAT_VERSION],
            )
            .await?;
        }
        (None, Some(version)) => return Err(unsupported(&version).into()),
        (None, None) => return Err(unsupported("unversioned").into()),
    }
    for (name, ddl) in TABLES {
        if !tables.iter().any(|table| table == name) {
            tx.batch_execute(ddl).await?;
        }
    }
    if tables.iter().any(|table| table == "flue_submissions") {
        // Format-1 schemas from before the submission timeout (or the trace context, or the
        // creation data) was stored gain its columns, with the default one-hour budget. Only
        // when one is missing: `ALTER TABLE` takes the table's exclusive lock even when it
        // changes nothing, so a node starting next to busy ones would queue behind their
        // transactions and hold up every query after it.
        let present: Vec<String> = tx
            .query(
                "SELECT attname::TEXT FROM pg_catalog.pg_attribute \
                 WHERE attrelid = 'flue_submissions'::regclass AND attnum > 0 AND NOT attisdropped",
                &[],
            )
            .await?
            .iter()
            .map(|row| row.try_get(0))
            .collect::<Result<_, _>>()?;
        let missing: Vec<String> = ADDED_SUBMISSION_COLUMNS
            .iter()
            .filter(|(name, _)| !present.iter().any(|column| column == name))
            .map(|(name, definition)| format!("ADD COLUMN IF NOT EXISTS {name} {definition}"))
            .collect();
        if !missing.is_empty() {
            tx.batch_execute(&format!("ALTER TABLE flue_submissions {}", missing.join(", ")))
                .await?;
        }
    }
    Ok(())
}

fn kind_text(kind: SubmissionKind) -> &'static str {
    match kind {
        SubmissionKind::Dispatch => "dispatch",
        SubmissionKind::Direct => "direct",
    }
}

fn parse_kind(text: &str) -> Result<SubmissionKind, StoreError> {
    match text {
        "dispatch" => Ok(SubmissionKind::Dispatch),
        "direct" => Ok(SubmissionKind::Direct),
        other => Err(corrupt(format_args!("submission kind {other:?}"))),
    }
}

fn parse_status(text: &str) -> Result<SubmissionStatus, StoreError> {
    match text {
        "queued" => Ok(SubmissionStatus::Queued),
        "running" => Ok(SubmissionStatus::Running),
        "joining" => Ok(SubmissionStatus::Joining),
        "joined" => Ok(SubmissionStatus::Joined),
        "settled" => Ok(SubmissionStatus::Settled),
        other => Err(corrupt(format_args!("submission status {other:?}"))),
    }
}

fn outcome_text(outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::Completed => "completed",
        Outcome::Failed => "failed",
        Outcome::Aborted => "aborted",
    }
}

fn parse_outcome(text: &str) -> Result<Outcome, StoreError> {
    match text {
        "completed" => Ok(Outcome::Completed),
        "failed" => Ok(Outcome::Failed),
        "aborted" => Ok(Outcome::Aborted),
        other => Err(corrupt(format_args!("outcome {other:?}"))),
    }
}

fn to_json<T: serde::Serialize + ?Sized>(value: &T, what: &str) -> Result<String, StoreError> {
    let text = serde_json::to_string(value)
        .map_err(|error| StoreError::Other(format!("cannot serialize the {what}: {error}")))?;
    super::storable(text.as_bytes(), what)?;
    Ok(text)
}

/// Decodes the columns of [`submission_columns!`].
fn submission_from_row(row: &Row) -> Result<Submission, Failure> {
    let sequence: i64 = row.try_get(1)?;
    let message: String = row.try_get(5)?;
    let lease: String = row.try_get(10)?;
    let attempt_count: i64 = row.try_get(11)?;
    let max_attempts: i64 = row.try_get(12)?;
    let outcome: Option<String> = row.try_get(15)?;
    let error: Option<String> = row.try_get(16)?;
    let timeout: String = row.try_get(17)?;
    let timeout_at: String = row.try_get(18)?;
    let trace: Option<String> = row.try_get(19)?;
    let initial_data: Option<String> = row.try_get(20)?;
    Ok(Submission {
        id: row.try_get(0)?,
        sequence: u64::try_from(sequence).map_err(|_| corrupt(format_args!("admission sequence {sequence}")))?,
        key: InstanceKey::new(row.try_get::<_, String>(2)?, row.try_get::<_, String>(3)?),
        kind: parse_kind(row.try_get(4)?)?,
        message: super::from_stored::<DeliveredMessage>(&message)
            .map_err(|error| corrupt(format_args!("message: {error}")))?,
        // A JSON `null` is stored as the text `null`, and read back as `Some(Value::Null)`.
        initial_data: initial_data
            .as_deref()
            .map(super::from_stored::<serde_json::Value>)
            .transpose()
            .map_err(|error| corrupt(format_args!("initial data: {error}")))?,
        status: parse_status(row.try_get(6)?)?,
        accepted_at: row.try_get(7)?,
        attempt_id: row.try_get(8)?,
        owner_id: row.try_get(9)?,
        lease_until_ms: lease.parse().map_err(|_| corrupt(format_args!("lease {lease:?}")))?,
        attempt_count: u32::try_from(attempt_count)
            .map_err(|_| corrupt(format_args!("attempt count {attempt_count}")))?,
        max_attempts: u32::try_from(max_attempts).map_err(|_| corrupt(format_args!("max attempts {max_attempts}")))?,
        timeout_ms: timeout
            .parse()
            .map_err(|_| corrupt(format_args!("timeout {timeout:?}")))?,
        timeout_at_ms: timeout_at
            .parse()
            .map_err(|_| corrupt(format_args!("timeout deadline {timeout_at:?}")))?,
        abort_requested: row.try_get(13)?,
        joined_into: row.try_get(14)?,
        outcome: outcome.as_deref().map(parse_outcome).transpose()?,
        error: error
            .as_deref()
            .map(super::from_stored::<SettlementError>)
            .transpose()
            .map_err(|error| corrupt(format_args!("settlement error: {error}")))?,
        trace: trace
            .as_deref()
            .map(super::from_stored::<TraceContext>)
            .transpose()
            .map_err(|error| corrupt(format_args!("trace context: {error}")))?,
    })
}

fn batch_from_row(row: &Row) -> Result<Batch, StoreError> {
    let offset: i64 = row.try_get(0).map_err(|error| db_error(&error))?;
    let records: String = row.try_get(1).map_err(|error| db_error(&error))?;
    Ok(Batch {
        offset: u64::try_from(offset).map_err(|_| corrupt(format_args!("batch offset {offset}")))?,
        records: super::from_stored(&records).map_err(|error| corrupt(format_args!("batch {offset}: {error}")))?,
    })
}

/// Locks the instance row; its incarnation and batch count, when it exists.
async fn lock_instance(tx: &Transaction<'_>, key: &InstanceKey) -> Result<Option<(String, i64)>, Failure> {
    let statement = tx.prepare_cached(LOCK_INSTANCE).await?;
    match tx.query_opt(&statement, &[&&*key.agent, &&*key.id]).await? {
        Some(row) => Ok(Some((row.try_get(0)?, row.try_get(1)?))),
        None => Ok(None),
    }
}

/// Locks the instance row of a submission; the instance, when the submission exists.
async fn lock_instance_of(tx: &Transaction<'_>, submission_id: &str) -> Result<Option<InstanceKey>, Failure> {
    let statement = tx.prepare_cached(LOCK_INSTANCE_OF).await?;
    match tx.query_opt(&statement, &[&submission_id]).await? {
        Some(row) => Ok(Some(InstanceKey::new(
            row.try_get::<_, String>(0)?,
            row.try_get::<_, String>(1)?,
        ))),
        None => Ok(None),
    }
}

/// Whether `attempt` owns its submission (running under that attempt).
async fn owns(tx: &Transaction<'_>, attempt: &AttemptRef, sql: &str) -> Result<bool, Failure> {
    let statement = tx.prepare_cached(sql).await?;
    Ok(tx
        .query_opt(&statement, &[&attempt.submission_id, &attempt.attempt_id])
        .await?
        .is_some())
}

/// The offset [`APPEND_BATCH`] returned.
/// An append's batch as JSON; an empty batch is refused.
fn batch_json(records: &[Record]) -> Result<String, Failure> {
    if records.is_empty() {
        return Err(super::empty_batch().into());
    }
    Ok(to_json(records, "records")?)
}

/// What an append's statements answered, as its result: a fenced attempt first (nothing was
/// written), then a missing stream, else the batch's offset.
/// Whether the submission of an [`OWNS_SHARED`] row may write the stream `key`.
fn writes(key: &InstanceKey, row: &Row) -> bool {
    match (row.try_get::<_, &str>(0), row.try_get::<_, &str>(1)) {
        (Ok(agent), Ok(id)) => key.writable_by(agent, id),
        _ => false,
    }
}

/// `owned`: `None` when the attempt does not run its submission, else whether that
/// submission may write the stream.
fn append_outcome(
    key: &InstanceKey,
    authorization: Option<&AttemptRef>,
    stream_exists: bool,
    owned: Option<bool>,
    appended: Option<Row>,
) -> Result<u64, Failure> {
    if let Some(attempt) = authorization {
        match owned {
            Some(true) => {}
            Some(false) => {
                return Err(StoreError::Fenced(format!(
                    "submission {} does not write the stream {key}",
                    attempt.submission_id
                ))
                .into());
            }
            None => {
                return Err(StoreError::Fenced(format!(
                    "attempt {} does not own submission {}",
                    attempt.attempt_id, attempt.submission_id
                ))
                .into());
            }
        }
    }
    if !stream_exists {
        return Err(StoreError::Other(format!("no stream {key}")).into());
    }
    appended_offset(key, appended)
}

fn appended_offset(key: &InstanceKey, appended: Option<Row>) -> Result<u64, Failure> {
    let Some(row) = appended else {
        return Err(StoreError::Other(format!("no stream {key}")).into());
    };
    let offset: i64 = row.try_get(0)?;
    u64::try_from(offset).map_err(|_| corrupt(format_args!("batch offset {offset}")).into())
}

/// Admits `admission`; its claim's lease and `now_ms` (which starts a claimed submission's
/// budget) are in database time.
async fn admit_tx(
    tx: &Transaction<'_>,
    admission: &Admission,
    (now_ms, asked): (u64, std::time::Instant),
) -> Result<Admitted, Failure> {
    let key = &admission.key;
    let (agent, id) = (&*key.agent, &*key.id);
    let (select, lock) = (
        tx.prepare_cached(SELECT_SUBMISSION).await?,
        tx.prepare_cached(LOCK_INSTANCE).await?,
    );
    // One round trip: the submission, if this is a replay, and the instance, locked.
    let (replayed, existing) = futures_util::future::try_join(
        async { tx.query_opt(&select, &[&admission.submission_id]).await },
        async { tx.query_opt(&lock, &[&agent, &id]).await },
    )
    .await?;
    let existing = match existing {
        Some(row) => Some((row.try_get::<_, String>(0)?, row.try_get::<_, i64>(1)?)),
        None => None,
    };
    if let Some(row) = replayed {
        let replayed = submission_from_row(&row)?;
        if replayed.admitted_by(admission) {
            return Ok(Admitted {
                submission: replayed,
                uid: existing.map(|(uid, _)| uid).unwrap_or_default(),
                deduplicated: true,
                offset: None,
                claimed: None,
                birth: None,
            });
        }
        return Err(StoreError::SubmissionConflict(admission.submission_id.clone()).into());
    }
    match (&admission.uid, &existing) {
        (UidCondition::Existing(expected), Some((uid, _))) if expected != uid => {
            return Err(StoreError::InstanceNotFound(key.id.to_string()).into());
        }
        (UidCondition::Existing(_), None) => return Err(StoreError::InstanceNotFound(key.id.to_string()).into()),
        (UidCondition::CreateOnly, Some((uid, _))) => {
            return Err(StoreError::InstanceExists {
                id: key.id.to_string(),
                uid: uid.clone(),
            }
            .into());
        }
        _ => {}
    }
    let created = match &existing {
        Some(_) => None,
        None => {
            let uid = new_id("inst");
            let birth = super::birth_record(&uid, admission.initial_data.clone());
            let json = to_json(std::slice::from_ref(&birth), "records")?;
            Some((uid, birth, json))
        }
    };
    let message = to_json(&admission.message, "message")?;
    let max_attempts = i64::from(admission.max_attempts);
    let timeout = admission.timeout_ms.to_string();
    let trace = admission
        .trace
        .as_ref()
        .map(|trace| to_json(trace, "trace context"))
        .transpose()?;
    let initial_data = admission
        .initial_data
        .as_ref()
        .map(|data| to_json(data, "initial data"))
        .transpose()?;
    let created_at = now().to_string();
    let (insert_instance, append, insert_submission, head) = (
        tx.prepare_cached(INSERT_INSTANCE).await?,
        tx.prepare_cached(APPEND_BATCH).await?,
        tx.prepare_cached(INSERT_SUBMISSION).await?,
        tx.prepare_cached(HEAD).await?,
    );
    // One more round trip, run in this order: a new instance and its birth batch, the
    // submission, and the instance's head when the admission claims it. Whatever a conflict
    // interrupts is rolled back with the transaction.
    let (instance, birth, inserted, head) = futures_util::future::try_join4(
        async {
            match &created {
                Some((uid, ..)) => tx
                    .query_opt(&insert_instance, &[&agent, &id, uid, &created_at])
                    .await
                    .map(|row| Some(row.is_some())),
                None => Ok(None),
            }
        },
        async {
            match &created {
                Some((_, _, birth)) => tx.query_opt(&append, &[&agent, &id, birth]).await.map(Some),
                None => Ok(None),
            }
        },
        async {
            tx.query_opt(
                &insert_submission,
                &[
                    &admission.submission_id,
                    &agent,
                    &id,
                    &kind_text(admission.kind),
                    &message,
                    &created_at,
                    &max_attempts,
                    &timeout,
                    &trace,
                    &initial_data,
                ],
            )
            .await
        },
        async {
            match admission.claim {
                Some(_) => tx.query_opt(&head, &[&agent, &id]).await.map(Some),
                None => Ok(None),
            }
        },
    )
    .await?;
    if instance == Some(false) {
        // Another process created the instance meanwhile: rerun against its row.
        return Err(Failure::Restart);
    }
    let (uid, batches, birth) = match (existing, created, birth) {
        (Some((uid, batches)), _, _) => (uid, batches, None),
        (None, Some((uid, record, _)), Some(birth)) => {
            let offset = appended_offset(key, birth)?;
            (
                uid,
                1,
                Some(Batch {
                    offset,
                    records: Arc::new([record]),
                }),
            )
        }
        _ => return Err(corrupt(format_args!("instance {key} neither found nor created")).into()),
    };
    let Some(row) = inserted else {
        // The same submission id was admitted meanwhile (for another instance): rerun to
        // deduplicate or report the conflict.
        return Err(Failure::Restart);
    };
    let submission = submission_from_row(&row)?;
    let claimed = match (&admission.claim, head) {
        (Some(claim), Some(Some(head))) => claim_head(tx, &head, claim, Some(&submission.id), (now_ms, asked)).await?,
        _ => None,
    };
    Ok(Admitted {
        submission,
        uid,
        deduplicated: false,
        offset: u64::try_from(batches - 1).ok(),
        claimed,
        birth,
    })
}

/// Starts an attempt of the instance's head, when it is queued (and is `only`, if given). The
/// claim's lease and `now_ms` are in database time.
async fn claim_next_tx(
    tx: &Transaction<'_>,
    key: &InstanceKey,
    claim: &Claim,
    only: Option<&str>,
    now_ms: (u64, std::time::Instant),
) -> Result<Option<Submission>, Failure> {
    if lock_instance(tx, key).await?.is_none() {
        return Ok(None);
    }
    let statement = tx.prepare_cached(HEAD).await?;
    let Some(head) = tx.query_opt(&statement, &[&&*key.agent, &&*key.id]).await? else {
        return Ok(None);
    };
    claim_head(tx, &head, claim, only, now_ms).await
}

/// A claim's lease and `now_ms` (reckoned when the claim was `asked` for), moved on by the time
/// spent since (waiting for a pooled connection, for the instance's lock, retrying) when that
/// is a sixth of the lease or more, as the claim's statement's parameters: a claim that waited
/// would otherwise hold a lease that much shorter (one that waited past it, none), and compare
/// leases with a `now` that much late. A shorter wait leaves them as asked (the heartbeat,
/// every third of a lease by default, renews it in time), so a claim made at once writes the
/// times its caller gave, as the other stores do.
fn moved_on(claim: &Claim, now_ms: u64, asked: std::time::Instant) -> (String, String) {
    let waited = u64::try_from(asked.elapsed().as_millis()).unwrap_or(u64::MAX);
    let lease = claim.lease_until_ms.saturating_sub(now_ms);
    let waited = if waited.saturating_mul(6) < lease { 0 } else { waited };
    let lease_until_ms = match claim.lease_until_ms {
        0 | u64::MAX => claim.lease_until_ms,
        lease => lease.saturating_add(waited),
    };
    (lease_until_ms.to_string(), now_ms.saturating_add(waited).to_string())
}

/// Claims the instance's head (a [`HEAD`] row, the instance locked) when it is queued (and is
/// `only`, when given); a first claim starts the budget at `now_ms`. The claim's lease and
/// `now_ms` are in database time.
async fn claim_head(
    tx: &Transaction<'_>,
    head: &Row,
    claim: &Claim,
    only: Option<&str>,
    (now_ms, asked): (u64, std::time::Instant),
) -> Result<Option<Submission>, Failure> {
    let id: String = head.try_get(0)?;
    let status: String = head.try_get(1)?;
    if status != "queued" || only.is_some_and(|only| only != id) {
        return Ok(None);
    }
    let statement = tx.prepare_cached(CLAIM).await?;
    let (lease, now) = moved_on(claim, now_ms, asked);
    match tx
        .query_opt(&statement, &[&id, &claim.attempt_id, &claim.owner_id, &lease, &now])
        .await?
    {
        Some(row) => Ok(Some(submission_from_row(&row)?)),
        None => Ok(None),
    }
}

/// Takes an expired submission over; the claim's lease and `now_ms` are in database time.
async fn reclaim_tx(
    tx: &Transaction<'_>,
    submission_id: &str,
    stale_attempt_id: &str,
    claim: &Claim,
    now_ms: u64,
) -> Result<Option<Submission>, Failure> {
    if lock_instance_of(tx, submission_id).await?.is_none() {
        return Ok(None);
    }
    let statement = tx.prepare_cached(RECLAIM).await?;
    let (lease, now) = (claim.lease_until_ms.to_string(), now_ms.to_string());
    match tx
        .query_opt(
            &statement,
            &[
                &submission_id,
                &stale_attempt_id,
                &claim.attempt_id,
                &claim.owner_id,
                &lease,
                &now,
            ],
        )
        .await?
    {
        Some(row) => Ok(Some(submission_from_row(&row)?)),
        None => Ok(None),
    }
}

async fn claim_joinable_tx(tx: &Transaction<'_>, host: &AttemptRef) -> Result<Vec<Submission>, Failure> {
    let Some(key) = lock_instance_of(tx, &host.submission_id).await? else {
        return Ok(Vec::new());
    };
    if !owns(tx, host, OWNS_UNABORTED).await? {
        return Ok(Vec::new());
    }
    let statement = tx.prepare_cached(QUEUED).await?;
    let mut ids = Vec::new();
    for row in tx.query(&statement, &[&&*key.agent, &&*key.id]).await? {
        let abort_requested: bool = row.try_get(1)?;
        if abort_requested {
            break;
        }
        ids.push(row.try_get::<_, String>(0)?);
    }
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let statement = tx.prepare_cached(JOIN).await?;
    let mut claimed = tx
        .query(&statement, &[&ids, &host.submission_id])
        .await?
        .iter()
        .map(submission_from_row)
        .collect::<Result<Vec<_>, _>>()?;
    claimed.sort_by_key(|row| row.sequence);
    Ok(claimed)
}

async fn finalize_join_tx(tx: &Transaction<'_>, host: &AttemptRef, submission_id: &str) -> Result<bool, Failure> {
    if lock_instance_of(tx, &host.submission_id).await?.is_none() || !owns(tx, host, OWNS).await? {
        return Ok(false);
    }
    let statement = tx.prepare_cached(FINALIZE_JOIN).await?;
    Ok(tx.execute(&statement, &[&submission_id, &host.submission_id]).await? > 0)
}

async fn settle_tx(
    tx: &Transaction<'_>,
    host: &AttemptRef,
    outcome: Outcome,
    error: Option<&SettlementError>,
    records: &[Record],
) -> Result<(bool, InstanceKey), Failure> {
    let records = (!records.is_empty()).then(|| to_json(records, "records")).transpose()?;
    let outcome = outcome_text(outcome);
    let error = error.map(|error| to_json(error, "settlement error")).transpose()?;
    let (lock, owner) = (
        tx.prepare_cached(LOCK_INSTANCE_OF).await?,
        tx.prepare_cached(OWNS).await?,
    );
    let (append, joined, joining, settle) = (
        tx.prepare_cached(APPEND_BATCH).await?,
        tx.prepare_cached(SETTLE_JOINED).await?,
        tx.prepare_cached(REVERT_JOINING).await?,
        tx.prepare_cached(SETTLE_HOST).await?,
    );
    // Two round trips; the server runs each one's statements in the order sent. First the
    // instance lock, then the owner check.
    let (locked, owned) =
        futures_util::future::try_join(async { tx.query_opt(&lock, &[&host.submission_id]).await }, async {
            tx.query_opt(&owner, &[&host.submission_id, &host.attempt_id]).await
        })
        .await?;
    let (Some(locked), Some(_)) = (locked, owned) else {
        return Err(fenced_settle(host));
    };
    let key = InstanceKey::new(locked.try_get::<_, String>(0)?, locked.try_get::<_, String>(1)?);
    let (agent, id) = (&*key.agent, &*key.id);
    // Then the settlement records, the joined deliveries, a join claimed but never applied
    // back to the queue (never lost), and the host, whose statement sees the queue after them.
    let (appended, _, _, settled) = futures_util::future::try_join4(
        async {
            match &records {
                Some(json) => tx.query_opt(&append, &[&agent, &id, json]).await.map(Some),
                None => Ok(None),
            }
        },
        async {
            tx.execute(&joined, &[&agent, &id, &host.submission_id, &outcome, &error])
                .await
        },
        async { tx.execute(&joining, &[&agent, &id, &host.submission_id]).await },
        async {
            tx.query_one(&settle, &[&host.submission_id, &outcome, &error, &agent, &id])
                .await
        },
    )
    .await?;
    if let Some(appended) = appended {
        appended_offset(&key, appended)?;
    }
    Ok((settled.try_get(0)?, key))
}

fn fenced_settle(host: &AttemptRef) -> Failure {
    StoreError::Fenced(format!(
        "attempt {} does not own {}",
        host.attempt_id, host.submission_id
    ))
    .into()
}

/// The instance of the submission given back, or `None` when the attempt did not hold it.
async fn requeue_tx(tx: &Transaction<'_>, attempt: &AttemptRef) -> Result<Option<InstanceKey>, Failure> {
    let Some(key) = lock_instance_of(tx, &attempt.submission_id).await? else {
        return Ok(None);
    };
    if !owns(tx, attempt, OWNS).await? {
        return Ok(None);
    }
    let statement = tx.prepare_cached(REVERT_JOINING).await?;
    tx.execute(&statement, &[&&*key.agent, &&*key.id, &attempt.submission_id])
        .await?;
    let statement = tx.prepare_cached(REQUEUE_HOST).await?;
    tx.execute(&statement, &[&attempt.submission_id]).await?;
    Ok(Some(key))
}

async fn revert_joins_tx(tx: &Transaction<'_>, host: &AttemptRef) -> Result<usize, Failure> {
    let Some(key) = lock_instance_of(tx, &host.submission_id).await? else {
        return Ok(0);
    };
    if !owns(tx, host, OWNS).await? {
        return Ok(0);
    }
    let statement = tx.prepare_cached(REVERT_JOINING).await?;
    let reverted = tx
        .execute(&statement, &[&&*key.agent, &&*key.id, &host.submission_id])
        .await?;
    Ok(usize::try_from(reverted).unwrap_or(usize::MAX))
}

async fn request_abort_tx(tx: &Transaction<'_>, key: &InstanceKey) -> Result<Vec<String>, Failure> {
    if lock_instance(tx, key).await?.is_none() {
        return Ok(Vec::new());
    }
    let statement = tx.prepare_cached(REQUEST_ABORT).await?;
    let mut stamped = tx
        .query(&statement, &[&&*key.agent, &&*key.id])
        .await?
        .iter()
        .map(|row| Ok((row.try_get::<_, i64>(1)?, row.try_get::<_, String>(0)?)))
        .collect::<Result<Vec<_>, Failure>>()?;
    stamped.sort();
    Ok(stamped.into_iter().map(|(_, id)| id).collect())
}

/// Checks, after the append of `records` under `host` took the instance lock and held the host's
/// row, that the other submissions they belong to (`joined`, see
/// [`super::joined_submissions_of`]) are deliveries `joining` or `joined` into it; an error rolls
/// the append back with the transaction.
async fn check_joined(tx: &Transaction<'_>, joined: &[&str], host: Option<&AttemptRef>) -> Result<(), Failure> {
    let Some(host) = host else { return Ok(()) };
    if joined.is_empty() {
        return Ok(());
    }
    let statement = tx.prepare_cached(JOINED_INTO).await?;
    for submission in joined {
        if tx
            .query_opt(&statement, &[submission, &host.submission_id])
            .await?
            .is_none()
        {
            return Err(super::not_joined(submission, &host.submission_id).into());
        }
    }
    Ok(())
}

async fn append_tx(
    tx: &Transaction<'_>,
    key: &InstanceKey,
    records: &[Record],
    authorization: Option<&AttemptRef>,
) -> Result<u64, Failure> {
    let json = batch_json(records)?;
    let (lock, owner, append) = (
        tx.prepare_cached(LOCK_INSTANCE).await?,
        tx.prepare_cached(OWNS_SHARED).await?,
        tx.prepare_cached(APPEND_BATCH).await?,
    );
    // One round trip for three statements, which the server runs in the order sent: the
    // instance lock first (the order every writer takes), then the owner check, which also
    // holds the submission row until commit (no reclaim or settlement slips in between), then
    // the append. When the check fails, the append is rolled back with the transaction.
    let (agent, id) = (&*key.agent, &*key.id);
    let locked = async { tx.query_opt(&lock, &[&agent, &id]).await };
    let owned = async {
        match authorization {
            Some(attempt) => Ok(tx
                .query_opt(&owner, &[&attempt.submission_id, &attempt.attempt_id])
                .await?
                .map(|row| writes(key, &row))),
            None => Ok::<_, tokio_postgres::Error>(Some(true)),
        }
    };
    let appended = async { tx.query_opt(&append, &[&agent, &id, &json]).await };
    let (stream, owned, appended) = futures_util::future::try_join3(locked, owned, appended).await?;
    append_outcome(key, authorization, stream.is_some(), owned, appended)
}

/// [`Store::create_child`] in `tx`: the parent's link (fenced), then the child's instance row
/// and birth batch; a child that exists fails the whole transaction.
async fn create_child_tx(
    tx: &Transaction<'_>,
    parent: &InstanceKey,
    link: &[Record],
    child: &InstanceKey,
    birth: &[Record],
    authorization: Option<&AttemptRef>,
) -> Result<u64, Failure> {
    if link.is_empty() || birth.is_empty() {
        return Err(super::empty_batch().into());
    }
    let joined = super::joined_submissions_of(link, authorization)?;
    let offset = append_tx(tx, parent, link, authorization).await?;
    check_joined(tx, &joined, authorization).await?;
    let (agent, id) = (&*child.agent, &*child.id);
    let (uid, created_at) = (super::birth_uid(birth), now().to_string());
    let insert_instance = tx.prepare_cached(INSERT_INSTANCE).await?;
    if tx
        .query_opt(&insert_instance, &[&agent, &id, &uid, &created_at])
        .await?
        .is_none()
    {
        return Err(StoreError::Other(format!("the stream {child} exists")).into());
    }
    let append = tx.prepare_cached(APPEND_BATCH).await?;
    let json = to_json(birth, "records")?;
    appended_offset(child, tx.query_opt(&append, &[&agent, &id, &json]).await?)?;
    Ok(offset)
}

impl Store for PostgresStore {
    fn shared(&self) -> bool {
        true
    }

    /// The other nodes' settlements and abort requests, over `LISTEN`/`NOTIFY` on a connection
    /// of its own (see the `notices` module).
    fn notices(&self) -> Option<tokio::sync::broadcast::Receiver<super::StoreNotice>> {
        self.notices.subscribe()
    }

    fn announce(&self, notice: super::StoreNotice) {
        self.notices.announce(notice);
    }

    fn flush_announcements(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.notices.flush(notices::FLUSH_WITHIN))
    }

    fn admit(&self, mut admission: Admission) -> BoxFuture<'_, Result<Admitted, StoreError>> {
        Box::pin(async move {
            if let Some(claim) = &mut admission.claim {
                claim.lease_until_ms = self.clock.to_database(claim.lease_until_ms);
            }
            let now = (self.clock.database_now(), std::time::Instant::now());
            let sent = admission_bytes(&admission);
            let mut admitted = in_transaction!(self, sent, |tx| admit_tx(&tx, &admission, now).await)?;
            admitted.submission = self.clock.submission_to_node(admitted.submission);
            admitted.claimed = admitted.claimed.map(|row| self.clock.submission_to_node(row));
            Ok(admitted)
        })
    }

    fn instance(&self, key: &InstanceKey) -> BoxFuture<'_, Result<Option<InstanceInfo>, StoreError>> {
        let key = key.clone();
        Box::pin(async move {
            let rows = self.query(SELECT_UID, &[&&*key.agent, &&*key.id]).await?;
            rows.first()
                .map(|row| {
                    Ok(InstanceInfo {
                        id: key.id.to_string(),
                        uid: row.try_get(0).map_err(|error| db_error(&error))?,
                    })
                })
                .transpose()
        })
    }

    fn submission(&self, id: &str) -> BoxFuture<'_, Result<Option<Submission>, StoreError>> {
        let id = id.to_owned();
        Box::pin(async move {
            let rows = self.query(SELECT_SUBMISSION, &[&id]).await?;
            rows.first().map(|row| self.submission_from_row(row)).transpose()
        })
    }

    fn settled_among<'a>(&'a self, ids: &'a [String]) -> BoxFuture<'a, Result<Vec<String>, StoreError>> {
        Box::pin(async move {
            let rows = self.query(SETTLED_AMONG, &[&ids]).await?;
            rows.iter()
                .map(|row| row.try_get(0).map_err(|error| db_error(&error)))
                .collect()
        })
    }

    fn has_queued(&self, key: &InstanceKey) -> BoxFuture<'_, Result<bool, StoreError>> {
        let key = key.clone();
        Box::pin(async move {
            let rows = self.query(HAS_QUEUED, &[&&*key.agent, &&*key.id]).await?;
            match rows.first() {
                Some(row) => row.try_get(0).map_err(|error| db_error(&error)),
                None => Ok(false),
            }
        })
    }

    fn claim_next(&self, key: &InstanceKey, claim: &Claim) -> BoxFuture<'_, Result<Option<Submission>, StoreError>> {
        let key = key.clone();
        let claim = self.clock.claim_to_database(claim);
        Box::pin(async move {
            let now = (self.clock.database_now(), std::time::Instant::now());
            let claimed = in_transaction!(self, |tx| claim_next_tx(&tx, &key, &claim, None, now).await)?;
            Ok(claimed.map(|row| self.clock.submission_to_node(row)))
        })
    }

    fn renew_leases(
        &self,
        owner_id: &str,
        attempt_ids: &[String],
        lease_until_ms: u64,
    ) -> BoxFuture<'_, Result<u64, StoreError>> {
        let owner_id = owner_id.to_owned();
        let attempt_ids = attempt_ids.to_vec();
        // A third of the lease left: a renewal on a connection that died silently fails in
        // time for the next beat to connect afresh and renew before the leases lapse (the dead
        // connection bound alone, `DEAD_CONNECTION`, is as long as the whole margin of the
        // default lease and heartbeat).
        let deadline =
            Duration::from_millis(lease_until_ms.saturating_sub(self.clock.node_now()) / 3).max(RENEWAL_DEADLINE_FLOOR);
        Box::pin(async move {
            // One connection for the measure and the renewal: the heartbeat's own, which the
            // node's other work never holds.
            let mut held = None;
            let renewal = async {
                let client = held.insert(self.heartbeat.get().await.map_err(|error| {
                    StoreError::Other(format!("postgres: no database connection: {}", error_chain(&error)))
                })?);
                // The heartbeat follows the node's clock too if it stepped since the last scan:
                // a lease written under a stale offset would outlive (or undercut) its node by
                // the step, and a node that dies before its next scan would leave it so.
                let measured = self.clock_offset_on(client).await?;
                self.clock.update(measured, false);
                let lease = self.clock.to_database(lease_until_ms).to_string();
                // One statement, atomic on its own: no transaction to open and commit (one
                // round trip, and no transaction a stalled node could leave open between them).
                retrying!(async {
                    let statement = client.prepare_cached(RENEW).await?;
                    Ok::<_, Failure>(client.execute(&statement, &[&owner_id, &lease, &attempt_ids]).await?)
                })
            };
            match tokio::time::timeout(deadline, renewal).await {
                Ok(renewed) => renewed,
                Err(_) => {
                    // The connection may be dead: out of the pool, so the next beat connects.
                    if let Some(client) = held.take() {
                        drop(deadpool_postgres::Object::take(client));
                    }
                    Err(StoreError::Other(format!(
                        "postgres: renewing leases took more than {} ms",
                        deadline.as_millis()
                    )))
                }
            }
        })
    }

    fn expired(&self, now_ms: u64) -> BoxFuture<'_, Result<Vec<Submission>, StoreError>> {
        Box::pin(async move {
            // The scan follows the node's clock if it stepped or drifted since the last one.
            let measured = self.clock_offset().await?;
            self.clock.update(measured, false);
            let now = self.clock.to_database(now_ms).to_string();
            // A row this build cannot read (a newer build's, a damaged one) is left out, with a
            // warning: it must not stop the takeovers of every other instance.
            Ok(self
                .query(EXPIRED, &[&now])
                .await?
                .iter()
                .filter_map(|row| match self.submission_from_row(row) {
                    Ok(submission) => Some(submission),
                    Err(error) => {
                        let id = row.try_get::<_, String>("id").unwrap_or_default();
                        tracing::warn!(submission = %id, "postgres: a submission row this build cannot read is left out of a scan: {error}");
                        None
                    }
                })
                .collect())
        })
    }

    fn reclaim(
        &self,
        submission_id: &str,
        stale_attempt_id: &str,
        claim: &Claim,
        now_ms: u64,
    ) -> BoxFuture<'_, Result<Option<Submission>, StoreError>> {
        let submission_id = submission_id.to_owned();
        let stale_attempt_id = stale_attempt_id.to_owned();
        let claim = self.clock.claim_to_database(claim);
        Box::pin(async move {
            let now = self.clock.to_database(now_ms);
            let reclaimed = in_transaction!(self, |tx| reclaim_tx(
                &tx,
                &submission_id,
                &stale_attempt_id,
                &claim,
                now
            )
            .await)?;
            Ok(reclaimed.map(|row| self.clock.submission_to_node(row)))
        })
    }

    fn aborts_requested(&self, attempt_ids: &[String]) -> BoxFuture<'_, Result<Vec<String>, StoreError>> {
        let attempt_ids = attempt_ids.to_vec();
        Box::pin(async move {
            Ok(self
                .query(ABORTS_REQUESTED, &[&attempt_ids])
                .await?
                .iter()
                .filter_map(|row| row.try_get::<_, String>(0).ok())
                .collect())
        })
    }

    fn instances_with_queued(&self) -> BoxFuture<'_, Result<Vec<InstanceKey>, StoreError>> {
        Box::pin(async move {
            self.query(INSTANCES_WITH_QUEUED, &[])
                .await?
                .iter()
                .map(|row| {
                    Ok(InstanceKey::new(
                        row.try_get::<_, String>(0).map_err(|error| db_error(&error))?,
                        row.try_get::<_, String>(1).map_err(|error| db_error(&error))?,
                    ))
                })
                .collect()
        })
    }

    fn claim_joinable(&self, host: &AttemptRef) -> BoxFuture<'_, Result<Vec<Submission>, StoreError>> {
        let host = host.clone();
        Box::pin(async move {
            // Asked at every turn boundary and nearly always empty: look before locking. A
            // delivery admitted just after the look joins at the next boundary, or runs as the
            // next submission.
            let queued: bool = match self.query(JOINABLE_EXISTS, &[&host.submission_id]).await?.first() {
                Some(row) => row.try_get(0).map_err(|error| db_error(&error))?,
                None => false,
            };
            if !queued {
                return Ok(Vec::new());
            }
            let joined = in_transaction!(self, |tx| claim_joinable_tx(&tx, &host).await)?;
            Ok(joined
                .into_iter()
                .map(|row| self.clock.submission_to_node(row))
                .collect())
        })
    }

    fn finalize_join(&self, host: &AttemptRef, submission_id: &str) -> BoxFuture<'_, Result<bool, StoreError>> {
        let host = host.clone();
        let submission_id = submission_id.to_owned();
        Box::pin(async move { in_transaction!(self, |tx| finalize_join_tx(&tx, &host, &submission_id).await) })
    }

    fn settle(
        &self,
        host: &AttemptRef,
        outcome: Outcome,
        error: Option<SettlementError>,
        records: Vec<Record>,
    ) -> BoxFuture<'_, Result<bool, StoreError>> {
        let host = host.clone();
        Box::pin(async move {
            let sent = crate::session::records_weight(&records);
            let (queued, key) = in_transaction!(self, sent, |tx| settle_tx(
                &tx,
                &host,
                outcome,
                error.as_ref(),
                &records
            )
            .await)?;
            self.notices.announce(super::StoreNotice::Settled(key));
            Ok(queued)
        })
    }

    fn revert_joins(&self, host: &AttemptRef) -> BoxFuture<'_, Result<usize, StoreError>> {
        let host = host.clone();
        Box::pin(async move { in_transaction!(self, |tx| revert_joins_tx(&tx, &host).await) })
    }

    fn requeue(&self, attempt: &AttemptRef) -> BoxFuture<'_, Result<bool, StoreError>> {
        let attempt = attempt.clone();
        Box::pin(async move {
            let requeued = in_transaction!(self, |tx| requeue_tx(&tx, &attempt).await)?;
            Ok(requeued
                .map(|key| self.notices.announce(super::StoreNotice::Queued(key)))
                .is_some())
        })
    }

    fn request_abort(&self, key: &InstanceKey) -> BoxFuture<'_, Result<Vec<String>, StoreError>> {
        let key = key.clone();
        Box::pin(async move {
            let affected = in_transaction!(self, |tx| request_abort_tx(&tx, &key).await)?;
            if !affected.is_empty() {
                self.notices.announce(super::StoreNotice::AbortRequested(key));
            }
            Ok(affected)
        })
    }

    fn append(
        &self,
        key: &InstanceKey,
        records: Arc<[Record]>,
        authorization: Option<&AttemptRef>,
    ) -> BoxFuture<'_, Result<u64, StoreError>> {
        let key = key.clone();
        let authorization = authorization.cloned();
        Box::pin(async move {
            let joined = super::joined_submissions_of(&records, authorization.as_ref())?;
            if joined.is_empty() {
                return retrying!(self.append_in_one_trip(&key, &records, authorization.as_ref()));
            }
            // A host's append for a delivery it joined (rare: once per join): the joins are
            // checked in the transaction, after the append took its locks.
            in_transaction!(self, crate::session::records_weight(&records), |tx| {
                let offset = append_tx(&tx, &key, &records, authorization.as_ref()).await?;
                check_joined(&tx, &joined, authorization.as_ref()).await?;
                Ok::<_, Failure>(offset)
            })
        })
    }

    fn create_child(
        &self,
        parent: &InstanceKey,
        link: Arc<[Record]>,
        child: &InstanceKey,
        birth: Arc<[Record]>,
        authorization: Option<&AttemptRef>,
    ) -> BoxFuture<'_, Result<u64, StoreError>> {
        let (parent, child) = (parent.clone(), child.clone());
        let authorization = authorization.cloned();
        Box::pin(async move {
            let sent = crate::session::records_weight(&link) + crate::session::records_weight(&birth);
            in_transaction!(self, sent, |tx| create_child_tx(
                &tx,
                &parent,
                &link,
                &child,
                &birth,
                authorization.as_ref()
            )
            .await)
        })
    }

    fn read(&self, key: &InstanceKey, after: Option<u64>) -> BoxFuture<'_, Result<Vec<Batch>, StoreError>> {
        self.read_page(key, after, usize::MAX)
    }

    fn read_page(
        &self,
        key: &InstanceKey,
        after: Option<u64>,
        limit: usize,
    ) -> BoxFuture<'_, Result<Vec<Batch>, StoreError>> {
        let key = key.clone();
        // Beyond `i64::MAX`, no limit (no stream holds that many batches).
        let limit = i64::try_from(limit).ok();
        Box::pin(async move {
            let after = match after {
                None => -1,
                Some(after) => match i64::try_from(after) {
                    Ok(after) => after,
                    // No stream reaches that far.
                    Err(_) => return Ok(Vec::new()),
                },
            };
            self.query(SELECT_BATCHES, &[&&*key.agent, &&*key.id, &after, &limit])
                .await?
                .iter()
                .map(batch_from_row)
                .collect()
        })
    }

    fn last_offset(&self, key: &InstanceKey) -> BoxFuture<'_, Result<Option<u64>, StoreError>> {
        let key = key.clone();
        Box::pin(async move {
            let rows = self.query(LAST_BATCH, &[&&*key.agent, &&*key.id]).await?;
            let last: Option<i64> = match rows.first() {
                Some(row) => row.try_get(0).map_err(|error| db_error(&error))?,
                None => None,
            };
            Ok(last.map(|last| last as u64))
        })
    }

    fn put_attachment(&self, key: &InstanceKey, attachment: AttachmentPut) -> BoxFuture<'_, Result<(), StoreError>> {
        let key = key.clone();
        Box::pin(async move {
            attachment.verify()?;
            in_transaction!(self, attachment.bytes.len(), |tx| put_attachment_tx(
                &tx,
                &key,
                &attachment
            )
            .await)
        })
    }

    fn attachment(&self, key: &InstanceKey, id: &str) -> BoxFuture<'_, Result<Option<StoredAttachment>, StoreError>> {
        let key = key.clone();
        let id = id.to_owned();
        Box::pin(async move {
            in_transaction!(self, |tx| {
                async {
                let statement = tx
                    .prepare_cached(
                        "SELECT media_type, size, digest FROM flue_attachments WHERE id = $1 AND agent = $2 AND instance_id = $3",
                    )
                    .await?;
                let Some(row) = tx.query_opt(&statement, &[&id, &&*key.agent, &&*key.id]).await? else {
                    return Ok::<_, Failure>(None);
                };
                let (media_type, size, digest): (String, i64, String) = (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
                let statement = tx
                    .prepare_cached("SELECT bytes FROM flue_attachment_chunks WHERE id = $1 ORDER BY chunk")
                    .await?;
                // A hint only: a damaged size must not reserve its memory.
                let mut bytes = Vec::with_capacity(
                    usize::try_from(size).unwrap_or(0).min(super::attachments::MAX_READ_RESERVATION),
                );
                for row in tx.query(&statement, &[&id]).await? {
                    bytes.extend_from_slice(row.try_get::<_, &[u8]>(0)?);
                }
                Ok(Some(StoredAttachment {
                    id: id.clone(),
                    media_type,
                    size: u64::try_from(size).map_err(|_| corrupt(format_args!("attachment size {size}")))?,
                    digest,
                    bytes,
                }.verified()?))
            }
            .await
            })
        })
    }

    fn user_value(&self, user_id: &str, key: &str) -> BoxFuture<'_, Result<Option<UserValue>, StoreError>> {
        let (user_id, key) = (user_id.to_owned(), key.to_owned());
        Box::pin(async move {
            in_transaction!(self, |tx| {
                async {
                    let statement = tx
                        .prepare_cached(
                            "SELECT value, updated_at FROM flue_user_values WHERE user_id = $1 AND key = $2",
                        )
                        .await?;
                    let Some(row) = tx.query_opt(&statement, &[&user_id, &key]).await? else {
                        return Ok::<_, Failure>(None);
                    };
                    let value: String = row.try_get(0)?;
                    Ok(Some(UserValue {
                        key: key.clone(),
                        value: super::from_stored(&value).map_err(|_| corrupt(format_args!("user value {key:?}")))?,
                        updated_at: row.try_get(1)?,
                    }))
                }
                .await
            })
        })
    }

    fn set_user_value(
        &self,
        user_id: &str,
        key: &str,
        value: Option<serde_json::Value>,
        updated_at: i64,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        let (user_id, key) = (user_id.to_owned(), key.to_owned());
        let value = match value.map(|value| to_json(&value, "user value")).transpose() {
            Ok(value) => value,
            Err(error) => return Box::pin(std::future::ready(Err(error))),
        };
        Box::pin(async move {
            in_transaction!(self, |tx| {
                async {
                    match &value {
                        Some(value) => {
                            let statement = tx
                                .prepare_cached(
                                    "INSERT INTO flue_user_values (user_id, key, value, updated_at) VALUES ($1, $2, $3, $4) \
                                     ON CONFLICT (user_id, key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at",
                                )
                                .await?;
                            tx.execute(&statement, &[&user_id, &key, value, &updated_at]).await?;
                        }
                        None => {
                            let statement = tx
                                .prepare_cached("DELETE FROM flue_user_values WHERE user_id = $1 AND key = $2")
                                .await?;
                            tx.execute(&statement, &[&user_id, &key]).await?;
                        }
                    }
                    Ok::<_, Failure>(())
                }
                .await
            })
        })
    }

    fn list_user_values(
        &self,
        user_id: &str,
        query: &UserValuesQuery,
    ) -> BoxFuture<'_, Result<UserValuePage, StoreError>> {
        let user_id = user_id.to_owned();
        let prefix = query.prefix.clone();
        let limit = query.limit.map(|limit| i64::try_from(limit).unwrap_or(i64::MAX));
        let offset = i64::try_from(query.offset).unwrap_or(i64::MAX);
        Box::pin(async move {
            in_transaction!(self, |tx| {
                async {
                    // `starts_with` compares exactly (`LIKE` would treat `%` and `_` as wildcards);
                    // keys sort bytewise (`COLLATE "C"`), as the other stores order them. One
                    // statement, so one snapshot: the total counts the entries the page is cut
                    // from (two statements would each see the writes committed before them). The
                    // keys alone are counted and cut (from the primary key); only the page's
                    // values are read. An empty page is one row without a key.
                    let statement = tx
                        .prepare_cached(
                            "WITH matching AS (SELECT key FROM flue_user_values \
                                 WHERE user_id = $1 AND starts_with(key, $2)), \
                             page AS (SELECT key FROM matching ORDER BY key LIMIT $3 OFFSET $4) \
                             SELECT (SELECT count(*) FROM matching), v.key, v.value, v.updated_at \
                             FROM (SELECT 1) AS one LEFT JOIN \
                                 (page JOIN flue_user_values v ON v.user_id = $1 AND v.key = page.key) ON true \
                             ORDER BY v.key",
                        )
                        .await?;
                    let mut total = 0i64;
                    let mut entries = Vec::new();
                    for row in tx.query(&statement, &[&user_id, &prefix, &limit, &offset]).await? {
                        total = row.try_get(0)?;
                        let Some(key) = row.try_get::<_, Option<String>>(1)? else {
                            continue;
                        };
                        let value: String = row.try_get(2)?;
                        entries.push(UserValue {
                            value: super::from_stored(&value)
                                .map_err(|_| corrupt(format_args!("user value {key:?}")))?,
                            key,
                            updated_at: row.try_get(3)?,
                        });
                    }
                    Ok::<_, Failure>(UserValuePage {
                        entries,
                        total: usize::try_from(total).unwrap_or(0),
                    })
                }
                .await
            })
        })
    }
}

async fn put_attachment_tx(tx: &Transaction<'_>, key: &InstanceKey, attachment: &AttachmentPut) -> Result<(), Failure> {
    let statement = tx
        .prepare_cached("SELECT agent, instance_id, media_type, size, digest FROM flue_attachments WHERE id = $1")
        .await?;
    if let Some(row) = tx.query_opt(&statement, &[&attachment.id]).await? {
        let owner = InstanceKey::new(row.try_get::<_, String>(0)?, row.try_get::<_, String>(1)?);
        let (media_type, size, digest): (String, i64, String) = (row.try_get(2)?, row.try_get(3)?, row.try_get(4)?);
        let size = u64::try_from(size).map_err(|_| corrupt(format_args!("attachment size {size}")))?;
        return if attachment.is_stored_as(key, &owner, &media_type, size, &digest) {
            Ok(())
        } else {
            Err(conflict(&attachment.id).into())
        };
    }
    let size =
        i64::try_from(attachment.size).map_err(|_| corrupt(format_args!("attachment size {}", attachment.size)))?;
    let statement = tx
        .prepare_cached(
            "INSERT INTO flue_attachments (id, agent, instance_id, media_type, size, digest)
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (id) DO NOTHING RETURNING id",
        )
        .await?;
    if tx
        .query_opt(
            &statement,
            &[
                &attachment.id,
                &&*key.agent,
                &&*key.id,
                &attachment.media_type,
                &size,
                &attachment.digest,
            ],
        )
        .await?
        .is_none()
    {
        // A concurrent put of the same id committed first: rerun to compare with it.
        return Err(Failure::Restart);
    }
    let statement = tx
        .prepare_cached("INSERT INTO flue_attachment_chunks (id, chunk, bytes) VALUES ($1, $2, $3)")
        .await?;
    for (chunk, bytes) in attachment.bytes.chunks(ATTACHMENT_CHUNK_BYTES).enumerate() {
        let chunk = i32::try_from(chunk).map_err(|_| corrupt(format_args!("attachment chunk {chunk}")))?;
        tx.execute(&statement, &[&attachment.id, &chunk, &bytes]).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! Postgres-specific behaviour: the format stamp, several nodes sharing one schema, values
    //! that only a database could get wrong. The shared contract lives in
    //! `tests/store_contract_postgres.rs`.
    #![allow(clippy::unwrap_used)] // tests assert by unwrapping

    use std::collections::BTreeSet;

    use super::*;
    use crate::record::RecordBody;

    /// The test database, or `None` (outside CI) when none is configured.
    fn test_url() -> Option<String> {
        let url = std::env::var("FLUE_TEST_POSTGRES_URL")
            .ok()
            .filter(|url| !url.is_empty());
        if url.is_none() {
            assert!(
                std::env::var_os("CI").is_none(),
                "FLUE_TEST_POSTGRES_URL is not set: under CI the Postgres store tests must run (use .ci/test)"
            );
            eprintln!("note: FLUE_TEST_POSTGRES_URL is not set; skipping a Postgres store test (run .ci/test)");
        }
        url
    }

    fn fresh_schema() -> String {
        format!("flue_test_{}", ulid::Ulid::new().to_string().to_lowercase())
    }

    /// A plain connection whose search path is `schema`.
    async fn raw(url: &str, schema: &str) -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::connect(url, NoTls).await.unwrap();
        tokio::spawn(connection);
        client
            .batch_execute(&format!(
                "CREATE SCHEMA IF NOT EXISTS {schema}; SET search_path TO {schema}",
                schema = quote_identifier(schema)
            ))
            .await
            .unwrap();
        client
    }

    async fn meta(client: &tokio_postgres::Client) -> Vec<(String, String)> {
        client
            .query("SELECT key, value FROM flue_meta ORDER BY key", &[])
            .await
            .unwrap()
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect()
    }

    async fn tables(client: &tokio_postgres::Client) -> Vec<String> {
        client
            .query(
                "SELECT tablename::TEXT FROM pg_catalog.pg_tables WHERE schemaname = current_schema() \
                 ORDER BY tablename",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect()
    }

    fn stamp(key: &str, value: &str) -> Vec<(String, String)> {
        vec![(key.to_owned(), value.to_owned())]
    }

    fn admission(id: &str, agent: &str, instance: &str) -> Admission {
        Admission {
            key: InstanceKey::new(agent, instance),
            submission_id: id.to_owned(),
            keyed: false,
            kind: SubmissionKind::Dispatch,
            message: DeliveredMessage::user(format!("message {id}")),
            initial_data: None,
            uid: UidCondition::Any,
            max_attempts: 10,
            timeout_ms: 3_600_000,
            claim: None,
            trace: None,
        }
    }

    fn claim(attempt: &str, owner: &str) -> Claim {
        Claim {
            attempt_id: attempt.to_owned(),
            owner_id: owner.to_owned(),
            lease_until_ms: super::super::now_ms() + 30_000,
        }
    }

    fn user_record(body: &str) -> Record {
        Record {
            id: new_id("record"),
            submission_id: None,
            attempt_id: None,
            timestamp: now(),
            body: RecordBody::UserMessage {
                message_id: new_id("msg"),
                body: body.to_owned(),
                attachments: Vec::new(),
            },
        }
    }

    #[tokio::test]
    async fn stamps_a_fresh_schema_and_reopens_it_with_its_data() {
        let Some(url) = test_url() else { return };
        let schema = fresh_schema();
        let first = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
        let client = raw(&url, &schema).await;
        assert_eq!(meta(&client).await, stamp("format_version", "1"));
        assert_eq!(
            tables(&client).await,
            [
                "flue_attachment_chunks",
                "flue_attachments",
                "flue_batches",
                "flue_instances",
                "flue_meta",
                "flue_submissions",
                "flue_user_values"
            ]
        );
        let admitted = first.admit(admission("d-1", "assistant", "kept")).await.unwrap();
        drop(first);
        let reopened = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
        assert_eq!(meta(&client).await, stamp("format_version", "1"));
        assert_eq!(reopened.submission("d-1").await.unwrap(), Some(admitted.submission));
        let batches = reopened
            .read(&InstanceKey::new("assistant", "kept"), None)
            .await
            .unwrap();
        assert_eq!(batches.len(), 1);
        assert_eq!(batches[0].offset, 0);
    }

    /// The `idle_in_transaction_session_timeout` a transaction of `store` runs under.
    async fn stall_limit(store: &PostgresStore) -> String {
        in_transaction!(store, |tx| async {
            let row = tx.query_one("SHOW idle_in_transaction_session_timeout", &[]).await?;
            Ok::<String, Failure>(row.get(0))
        }
        .await)
        .unwrap()
    }

    /// Locks the instance `held`, then stalls on the client for `stall`, in a transaction of
    /// `store`.
    async fn lock_and_stall(store: &PostgresStore, stall: Duration) -> Result<(), StoreError> {
        in_transaction!(store, |tx| async {
            let lock =
                "SELECT uid FROM flue_instances WHERE agent = 'assistant' AND instance_id = 'held' FOR NO KEY UPDATE";
            tx.execute(lock, &[]).await?;
            tokio::time::sleep(stall).await;
            tx.execute("SELECT 1", &[]).await?;
            Ok::<(), Failure>(())
        }
        .await)
    }

    #[tokio::test]
    async fn a_transaction_that_stalls_on_the_client_is_ended_by_the_server_and_its_locks_released() {
        let Some(url) = test_url() else { return };
        let default = PostgresStore::connect_with_schema(&url, &fresh_schema()).await.unwrap();
        assert_eq!(stall_limit(&default).await, "10s");
        let store = default.with_stalled_transaction_timeout(Duration::from_millis(300));
        assert_eq!(stall_limit(&store).await, "300ms");
        store.admit(admission("d-1", "assistant", "held")).await.unwrap();
        // A node that stalls holding the instance's row lock, as one suspended mid-call does,
        // holds up another's write to the instance only until the server ends its transaction.
        let key = InstanceKey::new("assistant", "held");
        let other = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            tokio::time::timeout(Duration::from_millis(1500), store.request_abort(&key)).await
        };
        let (stalled, other) = tokio::join!(lock_and_stall(&store, Duration::from_secs(2)), other);
        assert!(stalled.is_err(), "the stalled transaction was not ended");
        let aborted = other.expect("the write waited for the stall to end").unwrap();
        assert_eq!(aborted, ["d-1"]);
    }

    /// A TCP proxy to the database at `url` (the URL through it, returned) that forwards what a
    /// client sends until `marker` shows up in it, then forwards nothing more and keeps the
    /// connection open: a node cut off from the database mid-call. The server's answers go
    /// through.
    async fn cutting_proxy(url: &str, marker: &'static [u8]) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut through = reqwest::Url::parse(url).unwrap();
        let server = format!("{}:{}", through.host_str().unwrap(), through.port().unwrap_or(5432));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        through.set_port(Some(listener.local_addr().unwrap().port())).unwrap();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(upstream) = tokio::net::TcpStream::connect(&server).await else {
                    return;
                };
                tokio::spawn(async move {
                    let (mut client_read, mut client_write) = client.into_split();
                    let (mut server_read, mut server_write) = upstream.into_split();
                    tokio::spawn(async move { tokio::io::copy(&mut server_read, &mut client_write).await });
                    let (mut sent, mut buffer) = (Vec::new(), vec![0; 64 * 1024]);
                    loop {
                        let read = match client_read.read(&mut buffer).await {
                            Ok(0) | Err(_) => return,
                            Ok(read) => read,
                        };
                        let from = sent.len();
                        sent.extend_from_slice(&buffer[..read]);
                        let cut = sent.windows(marker.len()).position(|window| window == marker);
                        let until = cut.map_or(sent.len(), |at| at.max(from));
                        if server_write.write_all(&sent[from..until]).await.is_err() {
                            return;
                        }
                        if cut.is_some() {
                            break;
                        }
                    }
                    // Cut off: the connection stays open, silent.
                    let _held = (client_read, server_write);
                    std::future::pending::<()>().await;
                });
            }
        });
        through.to_string()
    }

    #[tokio::test]
    async fn an_append_cut_off_mid_call_holds_the_instance_only_until_the_server_ends_it() {
        let Some(url) = test_url() else { return };
        let schema = fresh_schema();
        let direct = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
        direct.admit(admission("d-1", "assistant", "held")).await.unwrap();
        let mut through = reqwest::Url::parse(&cutting_proxy(&url, b"cut-off-here").await).unwrap();
        through
            .query_pairs_mut()
            .append_pair("application_name", "flue_cut_off");
        let proxied = PostgresStore::connect_with_schema(through.as_str(), &schema)
            .await
            .unwrap()
            .with_stalled_transaction_timeout(Duration::from_secs(1));
        let key = InstanceKey::new("assistant", "held");
        // The append's statements are cut off inside its batch's JSON: the server has `BEGIN`
        // and the instance's lock, and waits for the rest.
        let cut = tokio::spawn({
            let key = key.clone();
            async move {
                proxied
                    .append(&key, vec![user_record("cut-off-here")].into(), None)
                    .await
            }
        });
        // The server holds the cut-off transaction open (with the instance's lock) before the
        // other write is tried.
        let observer = raw(&url, &schema).await;
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let row = observer
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'flue_cut_off' AND state = 'idle in transaction'",
                        &[],
                    )
                    .await
                    .unwrap();
                if row.get::<_, i64>(0) > 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the cut-off append's transaction is open on the server");
        let aborted = tokio::time::timeout(Duration::from_secs(6), direct.request_abort(&key))
            .await
            .expect("another node's write to the instance waited for the cut-off append's lock");
        assert_eq!(aborted.unwrap(), ["d-1"]);
        assert_eq!(
            direct.read(&key, None).await.unwrap().len(),
            1,
            "the cut-off batch is not in the stream"
        );
        cut.abort();
    }

    /// A renewal whose connection went silent (cut off mid-call, as a failover that lost the
    /// host leaves it) fails within a third of the lease left, and its connection leaves the
    /// heartbeat's pool: the next renewal connects afresh and is answered.
    #[tokio::test]
    async fn a_renewal_cut_off_mid_call_fails_in_time_and_the_next_one_connects_afresh() {
        let Some(url) = test_url() else { return };
        let schema = fresh_schema();
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
        let through = cutting_proxy(&url, b"cut-off-here").await;
        let proxied = PostgresStore::connect_with_schema(&through, &schema).await.unwrap();
        let cut = tokio::time::timeout(
            Duration::from_secs(10),
            proxied.renew_leases("node", &["cut-off-here".into()], super::super::now_ms() + 3_000),
        )
        .await
        .expect("the cut-off renewal ends within its deadline");
        assert!(
            cut.as_ref()
                .is_err_and(|error| error.to_string().contains("renewing leases took more than")),
            "{cut:?}"
        );
        let renewed = tokio::time::timeout(
            Duration::from_secs(10),
            proxied.renew_leases("node", &["another".into()], super::super::now_ms() + 3_000),
        )
        .await
        .expect("the next renewal is answered on a new connection");
        assert_eq!(renewed.unwrap(), 0);
    }

    /// What the store wrote reads back however deep a value in it is nested (127 levels, the
    /// most serde_json parses, two under its record and batch).
    #[tokio::test]
    async fn a_value_nested_as_deep_as_json_parses_reads_back() {
        let Some(url) = test_url() else { return };
        let store = PostgresStore::connect_with_schema(&url, &fresh_schema()).await.unwrap();
        let mut value = serde_json::json!("core");
        for _ in 0..126 {
            value = serde_json::json!([value]);
        }
        let mut created = admission("d-1", "assistant", "deep");
        created.initial_data = Some(value.clone());
        store.admit(created).await.unwrap();
        let key = InstanceKey::new("assistant", "deep");
        let mut record = user_record("deep");
        record.body = RecordBody::StateWrite {
            name: "notes".into(),
            value: value.clone(),
        };
        store.append(&key, vec![record.clone()].into(), None).await.unwrap();
        assert_eq!(store.read(&key, None).await.unwrap().last().unwrap().records[0], record);
        assert_eq!(
            store.submission("d-1").await.unwrap().unwrap().initial_data,
            Some(value)
        );
    }

    /// A transaction sending a large statement is given the time it takes to cross a slow link
    /// on top of the stall limit: the server counts a statement still arriving as a stall, and
    /// a 16 MiB admission would be cut off every time under a limit of a few seconds.
    #[test]
    fn a_large_statement_gets_its_transfer_time_on_top_of_the_stall_limit() {
        let base: Arc<str> = "1000".into();
        assert!(
            Arc::ptr_eq(&stall_limit_ms(&base, 4096), &base),
            "a small one: the limit as set"
        );
        assert_eq!(&*stall_limit_ms(&base, 16 << 20), "17000");
        assert_eq!(&*stall_limit_ms(&"2147483000".into(), 16 << 20), "2147483647");
        let admission = crate::store::Admission {
            key: InstanceKey::new("a", "i"),
            submission_id: "sub_1".into(),
            keyed: false,
            kind: crate::store::SubmissionKind::Dispatch,
            message: flue_core::message::DeliveredMessage::user("x".repeat(3 << 20)),
            initial_data: Some(serde_json::json!({"notes": "y".repeat(1 << 20)})),
            uid: crate::store::UidCondition::Any,
            max_attempts: 1,
            timeout_ms: 1000,
            claim: None,
            trace: None,
        };
        let initial = r#"{"notes":""#.len() + (1 << 20) + 2;
        assert_eq!(admission_bytes(&admission), (3 << 20) + 2 * initial);
    }

    /// Postgres refuses an `idle_in_transaction_session_timeout` over `i32::MAX` ms, and every
    /// transaction would fail with it: a longer timeout is its longest.
    #[tokio::test]
    async fn a_stalled_transaction_timeout_past_postgress_longest_is_its_longest() {
        let Some(url) = test_url() else { return };
        let store = PostgresStore::connect_with_schema(&url, &fresh_schema())
            .await
            .unwrap()
            .with_stalled_transaction_timeout(Duration::MAX);
        store.admit(admission("d-1", "assistant", "patient")).await.unwrap();
        let key = InstanceKey::new("assistant", "patient");
        store
            .append(&key, vec![user_record("appended")].into(), None)
            .await
            .unwrap();
        assert_eq!(store.read(&key, None).await.unwrap().len(), 2);
    }

    #[tokio::test]
    async fn adopts_a_schema_stamped_schema_version_8_in_place() {
        let Some(url) = test_url() else { return };
        let schema = fresh_schema();
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
        let client = raw(&url, &schema).await;
        client
            .batch_execute("UPDATE flue_meta SET key = 'schema_version', value = '8'")
            .await
            .unwrap();
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
        assert_eq!(meta(&client).await, stamp("format_version", "1"));
    }

    /// A store whose submission `d-1` was admitted before `alter` (dropping columns a later
    /// layout added) ran, reopened: the upgrade has run.
    async fn reopened_after(url: &str, alter: &str) -> PostgresStore {
        let schema = fresh_schema();
        let store = PostgresStore::connect_with_schema(url, &schema).await.unwrap();
        store.admit(admission("d-1", "assistant", "older")).await.unwrap();
        drop(store);
        raw(url, &schema).await.batch_execute(alter).await.unwrap();
        PostgresStore::connect_with_schema(url, &schema).await.unwrap()
    }

    #[tokio::test]
    async fn a_submissions_table_without_the_timeout_columns_gains_them_with_the_default_budget() {
        let Some(url) = test_url() else { return };
        let store = reopened_after(
            &url,
            "ALTER TABLE flue_submissions DROP COLUMN timeout_ms, DROP COLUMN timeout_at_ms",
        )
        .await;
        let row = store.submission("d-1").await.unwrap().unwrap();
        assert_eq!((row.timeout_ms, row.timeout_at_ms), (3_600_000, 0));
    }

    #[tokio::test]
    async fn a_submissions_table_without_the_initial_data_column_gains_it_and_older_rows_have_none() {
        let Some(url) = test_url() else { return };
        let store = reopened_after(&url, "ALTER TABLE flue_submissions DROP COLUMN initial_data").await;
        assert_eq!(store.submission("d-1").await.unwrap().unwrap().initial_data, None);
        let mut created = admission("d-2", "assistant", "newer");
        created.initial_data = Some(serde_json::json!({"plan": "pro"}));
        store.admit(created.clone()).await.unwrap();
        assert_eq!(
            store.submission("d-2").await.unwrap().unwrap().initial_data,
            created.initial_data
        );
        assert!(store.admit(created).await.unwrap().deduplicated);
    }

    /// A node opening a current schema changes nothing, so it takes no table lock: it opens
    /// while another node holds a transaction on the submissions (an `ALTER TABLE` would wait
    /// for it, and hold up every query queued behind it).
    #[tokio::test]
    async fn opening_a_current_schema_waits_for_no_other_nodes_transaction() {
        let Some(url) = test_url() else { return };
        let schema = fresh_schema();
        let first = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
        first.admit(admission("d-1", "assistant", "busy")).await.unwrap();
        let mut other = raw(&url, &schema).await;
        let busy = other.transaction().await.unwrap();
        busy.execute("UPDATE flue_submissions SET max_attempts = max_attempts", &[])
            .await
            .unwrap();
        // A hang guard, not a timing assertion: blocked, the open would never return.
        let second = tokio::time::timeout(
            std::time::Duration::from_secs(60),
            PostgresStore::connect_with_schema(&url, &schema),
        )
        .await
        .expect("the open waited for the other transaction")
        .unwrap();
        assert!(second.submission("d-1").await.unwrap().is_some());
        busy.rollback().await.unwrap();
    }

    #[tokio::test]
    async fn an_attachment_whose_stored_bytes_were_damaged_reads_back_as_an_integrity_error() {
        let Some(url) = test_url() else { return };
        let schema = fresh_schema();
        let store = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
        let key = InstanceKey::new("assistant", "pictures");
        let bytes: Vec<u8> = (0..ATTACHMENT_CHUNK_BYTES + 10).map(|i| (i % 251) as u8).collect();
        for id in ["att-flipped", "att-lost", "att-intact"] {
            store
                .put_attachment(&key, AttachmentPut::new(id, "image/png", bytes.clone()))
                .await
                .unwrap();
        }
        let client = raw(&url, &schema).await;
        client
            .batch_execute(
                "UPDATE flue_attachment_chunks SET bytes = decode(repeat('00', length(bytes)), 'hex') \
                 WHERE id = 'att-flipped' AND chunk = 1; \
                 DELETE FROM flue_attachment_chunks WHERE id = 'att-lost' AND chunk = 1",
            )
            .await
            .unwrap();
        for id in ["att-flipped", "att-lost"] {
            let error = store.attachment(&key, id).await.unwrap_err();
            assert!(
                matches!(error, StoreError::AttachmentIntegrity { .. }),
                "{id}: {error:?}"
            );
        }
        assert_eq!(
            store.attachment(&key, "att-intact").await.unwrap().unwrap().bytes,
            bytes
        );
    }

    #[tokio::test]
    async fn adopting_a_bare_legacy_stamp_creates_the_missing_tables() {
        let Some(url) = test_url() else { return };
        let schema = fresh_schema();
        let client = raw(&url, &schema).await;
        client
            .batch_execute(
                "CREATE TABLE flue_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL); \
                 INSERT INTO flue_meta VALUES ('schema_version', '8')",
            )
            .await
            .unwrap();
        let store = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
        assert_eq!(meta(&client).await, stamp("format_version", "1"));
        store.admit(admission("d-1", "assistant", "legacy")).await.unwrap();
        assert_eq!(
            store
                .read(&InstanceKey::new("assistant", "legacy"), None)
                .await
                .unwrap()
                .len(),
            1
        );
    }

    #[tokio::test]
    async fn rejects_a_schema_stamped_schema_version_7_without_adopting_it() {
        let Some(url) = test_url() else { return };
        let schema = fresh_schema();
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
        let client = raw(&url, &schema).await;
        client
            .batch_execute("UPDATE flue_meta SET key = 'schema_version', value = '7'")
            .await
            .unwrap();
        let error = PostgresStore::connect_with_schema(&url, &schema).await.unwrap_err();
        assert_eq!(error, StoreError::FormatVersion { stored: "7".into() });
        assert_eq!(
            error.to_string(),
            "persisted_format_version_unsupported: stored format version \"7\" is not supported (supported: 1)"
        );
        assert_eq!(meta(&client).await, stamp("schema_version", "7"), "nothing changed");
    }

    #[tokio::test]
    async fn rejects_another_format_version() {
        let Some(url) = test_url() else { return };
        let schema = fresh_schema();
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
        let client = raw(&url, &schema).await;
        client
            .batch_execute("UPDATE flue_meta SET value = '2' WHERE key = 'format_version'")
            .await
            .unwrap();
        assert_eq!(
            PostgresStore::connect_with_schema(&url, &schema).await.unwrap_err(),
            StoreError::FormatVersion { stored: "2".into() }
        );
        assert_eq!(meta(&client).await, stamp("format_version", "2"));
    }

    #[tokio::test]
    async fn rejects_unstamped_flue_tables_without_stamping_them() {
        let Some(url) = test_url() else { return };
        let schema = fresh_schema();
        let client = raw(&url, &schema).await;
        client
            .batch_execute("CREATE TABLE flue_legacy (x INTEGER)")
            .await
            .unwrap();
        let error = PostgresStore::connect_with_schema(&url, &schema).await.unwrap_err();
        assert_eq!(
            error,
            StoreError::FormatVersion {
                stored: "unversioned".into()
            }
        );
        assert_eq!(tables(&client).await, ["flue_legacy"], "nothing created");
        // An empty stamp table is unversioned too.
        client
            .batch_execute("CREATE TABLE flue_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            .await
            .unwrap();
        assert_eq!(
            PostgresStore::connect_with_schema(&url, &schema).await.unwrap_err(),
            StoreError::FormatVersion {
                stored: "unversioned".into()
            }
        );
        assert_eq!(tables(&client).await, ["flue_legacy", "flue_meta"]);
    }

    /// Reference §5.1: an empty `flue_meta` alone is fresh; a stamped schema holding another
    /// layout's `flue_` tables is refused without change.
    #[tokio::test]
    async fn stamps_an_empty_flue_meta_as_fresh_and_refuses_another_layouts_tables() {
        let Some(url) = test_url() else { return };
        let schema = fresh_schema();
        let client = raw(&url, &schema).await;
        client.batch_execute(CREATE_META).await.unwrap();
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
        assert_eq!(meta(&client).await, stamp("format_version", "1"));

        let schema = fresh_schema();
        let client = raw(&url, &schema).await;
        client
            .batch_execute(
                "CREATE TABLE flue_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL); \
                 INSERT INTO flue_meta VALUES ('format_version', '1'); \
                 CREATE TABLE flue_conversation_streams (path TEXT PRIMARY KEY)",
            )
            .await
            .unwrap();
        let error = PostgresStore::connect_with_schema(&url, &schema).await.unwrap_err();
        assert!(error.to_string().contains("(flue_conversation_streams)"), "{error}");
        assert_eq!(
            tables(&client).await,
            ["flue_conversation_streams", "flue_meta"],
            "nothing created"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nodes_opening_a_fresh_schema_at_once_agree_on_one_stamp() {
        let Some(url) = test_url() else { return };
        let schema = fresh_schema();
        let opens: Vec<_> = (0..4)
            .map(|_| {
                let (url, schema) = (url.clone(), schema.clone());
                tokio::spawn(async move { PostgresStore::connect_with_schema(&url, &schema).await })
            })
            .collect();
        for open in opens {
            open.await.unwrap().unwrap();
        }
        assert_eq!(meta(&raw(&url, &schema).await).await, stamp("format_version", "1"));
    }

    /// Two stores on one schema: two runtime processes sharing the database.
    async fn two_nodes() -> Option<(PostgresStore, PostgresStore)> {
        let url = test_url()?;
        let schema = fresh_schema();
        let a = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
        let b = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
        Some((a, b))
    }

    /// A claim's lease runs from when the claim is made, not from when it was asked for: one
    /// that waited for the instance's lock (another node's transaction holding it) still holds
    /// its whole lease once made (it held that much less, or none past a long wait).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_that_waited_for_the_instance_holds_its_whole_lease() {
        let Some((a, b)) = two_nodes().await else { return };
        let key = InstanceKey::new("assistant", "waited");
        a.admit(admission("w-1", "assistant", "waited")).await.unwrap();
        // Node b holds the instance's lock for 1.5 s.
        let (locked, holding) = tokio::sync::oneshot::channel();
        let holder = tokio::spawn({
            let (b, key) = (b.clone(), key.clone());
            async move {
                let Ok(mut client) = b.client().await else {
                    panic!("no connection")
                };
                let tx = client.transaction().await.unwrap();
                let Ok(Some(_)) = lock_instance(&tx, &key).await else {
                    panic!("the instance is not locked")
                };
                locked.send(()).unwrap();
                tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
                tx.rollback().await.unwrap();
            }
        });
        holding.await.unwrap();
        // A lease of 6 s: the 1.5 s wait is more than a sixth of it.
        let asked = Claim {
            lease_until_ms: super::super::now_ms() + 6_000,
            ..claim("attempt-a", "node-a")
        };
        let claimed = a.claim_next(&key, &asked).await.unwrap().unwrap();
        holder.await.unwrap();
        let lease = a.submission("w-1").await.unwrap().unwrap().lease_until_ms;
        assert_eq!(claimed.lease_until_ms, lease);
        assert!(
            lease >= asked.lease_until_ms + 1_400,
            "the lease runs {} ms past the one asked for, not the 1.5 s the claim waited",
            i128::from(lease) - i128::from(asked.lease_until_ms)
        );
        assert!(
            near(lease, super::super::now_ms() + 6_000),
            "a whole lease from the claim"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_nodes_never_claim_the_same_head() {
        let Some((a, b)) = two_nodes().await else { return };
        for instance in ["i-1", "i-2", "i-3"] {
            a.admit(admission(&format!("{instance}-first"), "assistant", instance))
                .await
                .unwrap();
            b.admit(admission(&format!("{instance}-second"), "assistant", instance))
                .await
                .unwrap();
        }
        let mut tasks = Vec::new();
        for attempt in 0..24 {
            let node = if attempt % 2 == 0 { a.clone() } else { b.clone() };
            tasks.push(tokio::spawn(async move {
                let instance = format!("i-{}", attempt % 3 + 1);
                node.claim_next(
                    &InstanceKey::new("assistant", instance),
                    &claim(&format!("attempt-{attempt}"), &format!("node-{}", attempt % 2)),
                )
                .await
                .unwrap()
            }));
        }
        let mut claimed = Vec::new();
        for task in tasks {
            if let Some(row) = task.await.unwrap() {
                claimed.push(row.id);
            }
        }
        claimed.sort();
        assert_eq!(
            claimed,
            ["i-1-first", "i-2-first", "i-3-first"],
            "one head per instance, once"
        );
        for instance in ["i-1", "i-2", "i-3"] {
            assert_eq!(
                a.submission(&format!("{instance}-second"))
                    .await
                    .unwrap()
                    .unwrap()
                    .status,
                SubmissionStatus::Queued
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn racing_first_admissions_create_one_instance_and_one_birth_record() {
        let Some((a, b)) = two_nodes().await else { return };
        let mut tasks = Vec::new();
        for n in 0..12 {
            let node = if n % 2 == 0 { a.clone() } else { b.clone() };
            tasks.push(tokio::spawn(async move {
                node.admit(admission(&format!("d-{n}"), "assistant", "raced"))
                    .await
                    .unwrap()
            }));
        }
        // The same keyed submission from both nodes at once: admitted once.
        let mut replays = Vec::new();
        for n in 0..6 {
            let node = if n % 2 == 0 { a.clone() } else { b.clone() };
            replays.push(tokio::spawn(async move {
                node.admit(admission("keyed", "assistant", "raced")).await.unwrap()
            }));
        }
        let mut uids = BTreeSet::new();
        let mut sequences = BTreeSet::new();
        for task in tasks {
            let admitted = task.await.unwrap();
            assert!(!admitted.deduplicated);
            assert_eq!(admitted.offset, Some(0));
            uids.insert(admitted.uid);
            sequences.insert(admitted.submission.sequence);
        }
        let mut fresh = 0;
        for replay in replays {
            let admitted = replay.await.unwrap();
            fresh += usize::from(!admitted.deduplicated);
            uids.insert(admitted.uid);
            sequences.insert(admitted.submission.sequence);
        }
        assert_eq!(fresh, 1, "exactly one admission of the keyed submission");
        assert_eq!(uids.len(), 1, "one incarnation");
        assert_eq!(sequences.len(), 13, "distinct sequences");
        let batches = a.read(&InstanceKey::new("assistant", "raced"), None).await.unwrap();
        assert_eq!(batches.len(), 1, "one birth record");
        assert!(matches!(
            &batches[0].records[0].body,
            RecordBody::ConversationCreated { uid, .. } if uids.contains(uid)
        ));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn appends_from_two_nodes_get_distinct_consecutive_offsets() {
        let Some((a, b)) = two_nodes().await else { return };
        let stream = InstanceKey::new("assistant", "busy");
        a.admit(admission("d-1", "assistant", "busy")).await.unwrap();
        let mut tasks = Vec::new();
        for n in 0..40 {
            let node = if n % 2 == 0 { a.clone() } else { b.clone() };
            let stream = stream.clone();
            tasks.push(tokio::spawn(async move {
                node.append(&stream, vec![user_record(&format!("{n}"))].into(), None)
                    .await
                    .unwrap()
            }));
        }
        let mut offsets = Vec::new();
        for task in tasks {
            offsets.push(task.await.unwrap());
        }
        offsets.sort_unstable();
        assert_eq!(offsets, (1..=40).collect::<Vec<u64>>());
        let batches = b.read(&stream, None).await.unwrap();
        assert_eq!(
            batches.iter().map(|batch| batch.offset).collect::<Vec<_>>(),
            (0..=40).collect::<Vec<u64>>()
        );
    }

    /// Two nodes admitting into one idle instance at once, each claiming its admission if it is
    /// the head, on a server whose default isolation is `REPEATABLE READ` (a DBA's setting): the
    /// second to take the instance's lock sees the first's admission and claims nothing. Under
    /// a snapshot taken before the lock it would not, and both would run.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_server_default_of_repeatable_read_still_claims_one_head_at_a_time() {
        let Some(url) = test_url() else { return };
        let schema = fresh_schema();
        let application = format!("flue_race_{}", ulid::Ulid::new().to_string().to_lowercase());
        let separator = if url.contains('?') { '&' } else { '?' };
        let url = format!(
            "{url}{separator}application_name={application}&options=-c%20default_transaction_isolation%3Drepeatable%5C%20read"
        );
        let (a, b) = (
            PostgresStore::connect_with_schema(&url, &schema).await.unwrap(),
            PostgresStore::connect_with_schema(&url, &schema).await.unwrap(),
        );
        let key = InstanceKey::new("assistant", "raced");
        let claiming = |id: &str, node: &str| Admission {
            claim: Some(claim(&format!("attempt-{id}"), node)),
            ..admission(id, "assistant", "raced")
        };
        let first = a.admit(claiming("d-0", "node-a")).await.unwrap();
        assert!(first.claimed.is_some());
        let attempt = AttemptRef {
            submission_id: "d-0".into(),
            attempt_id: "attempt-d-0".into(),
        };
        a.settle(&attempt, Outcome::Completed, None, Vec::new()).await.unwrap();
        // The instance's row held, so each admission waits for it after its first statement.
        let mut holder = raw(&url, &schema).await;
        let held = holder.transaction().await.unwrap();
        held.execute(LOCK_INSTANCE, &[&"assistant", &"raced"]).await.unwrap();
        let waiting = |count: i64| {
            let (url, schema, application) = (url.clone(), schema.clone(), application.clone());
            async move {
                let watcher = raw(&url, &schema).await;
                // A hang guard, not a timing assertion.
                tokio::time::timeout(Duration::from_secs(60), async {
                    loop {
                        let row = watcher
                            .query_one(
                                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'",
                                &[&application],
                            )
                            .await
                            .unwrap();
                        if row.get::<_, i64>(0) >= count {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                })
                .await
                .expect("the admissions wait for the instance's lock");
            }
        };
        let second = tokio::spawn({
            let b = b.clone();
            let admission = claiming("d-1", "node-b");
            async move { b.admit(admission).await.unwrap() }
        });
        waiting(1).await;
        let third = tokio::spawn({
            let a = a.clone();
            let admission = claiming("d-2", "node-a");
            async move { a.admit(admission).await.unwrap() }
        });
        waiting(2).await;
        held.commit().await.unwrap();
        let (second, third) = (second.await.unwrap(), third.await.unwrap());
        let claimed: Vec<&str> = [&second, &third]
            .iter()
            .filter_map(|admitted| admitted.claimed.as_ref().map(|row| row.id.as_str()))
            .collect();
        assert_eq!(claimed.len(), 1, "one head runs at a time: {claimed:?}");
        let mut running = Vec::new();
        for id in ["d-1", "d-2"] {
            let row = a.submission(id).await.unwrap().unwrap();
            if row.status == SubmissionStatus::Running {
                running.push(id);
            }
        }
        assert_eq!(running, claimed, "the other waits, queued");
        assert!(a.has_queued(&key).await.unwrap());
    }

    #[tokio::test]
    async fn a_reclaim_by_another_node_fences_the_stale_attempt() {
        let Some((a, b)) = two_nodes().await else { return };
        let stream = InstanceKey::new("assistant", "taken-over");
        a.admit(admission("d-1", "assistant", "taken-over")).await.unwrap();
        a.claim_next(&stream, &claim("attempt-a", "node-a"))
            .await
            .unwrap()
            .unwrap();
        let stale = AttemptRef {
            submission_id: "d-1".into(),
            attempt_id: "attempt-a".into(),
        };
        a.append(&stream, vec![user_record("before")].into(), Some(&stale))
            .await
            .unwrap();
        let taken = b
            .reclaim(
                "d-1",
                "attempt-a",
                &claim("attempt-b", "node-b"),
                super::super::now_ms() + 60_000,
            )
            .await
            .unwrap()
            .unwrap();
        assert_eq!((taken.attempt_count, taken.owner_id.as_deref()), (2, Some("node-b")));
        assert!(matches!(
            a.append(&stream, vec![user_record("after")].into(), Some(&stale)).await,
            Err(StoreError::Fenced(_))
        ));
        assert!(matches!(
            a.settle(&stale, Outcome::Completed, None, vec![user_record("settled")])
                .await,
            Err(StoreError::Fenced(_))
        ));
        assert!(!a.requeue(&stale).await.unwrap());
        assert_eq!(
            a.read(&stream, None).await.unwrap().len(),
            2,
            "birth and the first append only"
        );
    }

    /// A node whose clock is `skew_ms` off the database's (and the other node's), next to a
    /// node whose clock is right: two stores on one schema.
    async fn skewed_nodes(skew_ms: i64) -> Option<(PostgresStore, PostgresStore)> {
        let (a, b) = two_nodes().await?;
        b.clock.skew_ms.store(skew_ms, std::sync::atomic::Ordering::Relaxed);
        b.measure_clock().await.unwrap();
        Some((a, b))
    }

    /// Now, on a clock `skew_ms` off.
    fn skewed_now(skew_ms: i64) -> u64 {
        super::super::now_ms().saturating_add_signed(skew_ms)
    }

    /// A claim leased for `lease_ms` from now on a clock `skew_ms` off.
    fn skewed_claim(attempt: &str, owner: &str, skew_ms: i64, lease_ms: u64) -> Claim {
        Claim {
            lease_until_ms: skewed_now(skew_ms) + lease_ms,
            ..claim(attempt, owner)
        }
    }

    /// Whether `time` is `expected` give or take a second (the offset's measuring error is
    /// milliseconds; a skew that leaks through is a minute).
    fn near(time: u64, expected: u64) -> bool {
        time.abs_diff(expected) < 1_000
    }

    #[tokio::test]
    async fn a_node_whose_clock_is_off_neither_sees_a_live_lease_as_expired_nor_takes_it_over() {
        for skew in [60_000, -60_000] {
            let Some((a, b)) = skewed_nodes(skew).await else { return };
            let stream = InstanceKey::new("assistant", "live");
            a.admit(admission("d-1", "assistant", "live")).await.unwrap();
            a.claim_next(&stream, &claim("attempt-a", "node-a"))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(
                a.renew_leases("node-a", &["attempt-a".to_owned()], super::super::now_ms() + 30_000)
                    .await
                    .unwrap(),
                1
            );
            let listed = b.expired(skewed_now(skew)).await.unwrap();
            assert!(
                listed.is_empty(),
                "skew {skew} ms: a lease renewed for 30 s is listed as expired: {listed:?}"
            );
            let taken = b
                .reclaim(
                    "d-1",
                    "attempt-a",
                    &skewed_claim("attempt-b", "node-b", skew, 30_000),
                    skewed_now(skew),
                )
                .await
                .unwrap();
            assert!(
                taken.is_none(),
                "skew {skew} ms: a live lease was taken over: {taken:?}"
            );
            // Each node reads the lease and the budget's deadline in its own clock.
            let (seen_by_a, seen_by_b) = (
                a.submission("d-1").await.unwrap().unwrap(),
                b.submission("d-1").await.unwrap().unwrap(),
            );
            assert_eq!(seen_by_b.attempt_id.as_deref(), Some("attempt-a"));
            for (node, seen, skew) in [("a", &seen_by_a, 0), ("b", &seen_by_b, skew)] {
                assert!(
                    near(seen.lease_until_ms, skewed_now(skew) + 30_000),
                    "node {node} (skew {skew} ms) reads the lease as {} at {}",
                    seen.lease_until_ms,
                    skewed_now(skew)
                );
                assert!(
                    near(seen.timeout_at_ms, skewed_now(skew) + 3_600_000),
                    "node {node} (skew {skew} ms) reads the deadline as {} at {}",
                    seen.timeout_at_ms,
                    skewed_now(skew)
                );
            }
        }
    }

    #[tokio::test]
    async fn a_lease_expired_in_database_time_is_taken_over_whichever_node_claimed_it() {
        for skew in [60_000, -60_000] {
            let Some((a, b)) = skewed_nodes(skew).await else { return };
            let (first, second) = (
                InstanceKey::new("assistant", "i-a"),
                InstanceKey::new("assistant", "i-b"),
            );
            a.admit(admission("d-a", "assistant", "i-a")).await.unwrap();
            b.admit(admission("d-b", "assistant", "i-b")).await.unwrap();
            a.claim_next(&first, &skewed_claim("attempt-a", "node-a", 0, 100))
                .await
                .unwrap()
                .unwrap();
            b.claim_next(&second, &skewed_claim("attempt-b", "node-b", skew, 100))
                .await
                .unwrap()
                .unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
            for (node, store, skew) in [("a", &a, 0), ("b", &b, skew)] {
                let listed: Vec<String> = store
                    .expired(skewed_now(skew))
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|row| row.id)
                    .collect();
                assert_eq!(listed, ["d-a", "d-b"], "node {node} (skew {skew} ms)");
            }
            // Each node takes over the other's dead lease.
            let by_b = b
                .reclaim(
                    "d-a",
                    "attempt-a",
                    &skewed_claim("attempt-b2", "node-b", skew, 30_000),
                    skewed_now(skew),
                )
                .await
                .unwrap();
            assert!(
                by_b.is_some(),
                "skew {skew} ms: node b did not take the expired d-a over"
            );
            let by_a = a
                .reclaim(
                    "d-b",
                    "attempt-b",
                    &skewed_claim("attempt-a2", "node-a", 0, 30_000),
                    super::super::now_ms(),
                )
                .await
                .unwrap();
            assert!(
                by_a.is_some(),
                "skew {skew} ms: node a did not take the expired d-b over"
            );
            // The new leases are live for both.
            assert!(a.expired(super::super::now_ms()).await.unwrap().is_empty());
            assert!(b.expired(skewed_now(skew)).await.unwrap().is_empty());
        }
    }

    #[tokio::test]
    async fn a_heartbeat_after_the_nodes_clock_stepped_writes_the_lease_in_database_time() {
        for step in [3_600_000, -3_600_000] {
            let Some((a, b)) = two_nodes().await else { return };
            let stream = InstanceKey::new("assistant", "stepped");
            a.admit(admission("d-1", "assistant", "stepped")).await.unwrap();
            a.claim_next(&stream, &claim("attempt-a", "node-a"))
                .await
                .unwrap()
                .unwrap();
            // Node a's clock steps after its last measurement; its heartbeat comes first.
            a.clock.skew_ms.store(step, std::sync::atomic::Ordering::Relaxed);
            assert_eq!(
                a.renew_leases("node-a", &["attempt-a".to_owned()], skewed_now(step) + 30_000)
                    .await
                    .unwrap(),
                1
            );
            let seen_by_b = b.submission("d-1").await.unwrap().unwrap();
            assert!(
                near(seen_by_b.lease_until_ms, super::super::now_ms() + 30_000),
                "step {step} ms: the lease was written {} ms from now, not 30 s",
                i128::from(seen_by_b.lease_until_ms) - i128::from(super::super::now_ms())
            );
            assert!(
                near(
                    a.submission("d-1").await.unwrap().unwrap().lease_until_ms,
                    skewed_now(step) + 30_000
                ),
                "node a reads its lease in its own clock"
            );
        }
    }

    /// A node whose pool its other work holds whole (slow statements, a burst of admissions)
    /// still renews its leases at once, on the heartbeat's own connection: they do not lapse
    /// while it waits, and its instances are not taken over while it runs them.
    #[tokio::test]
    async fn leases_are_renewed_while_the_pool_is_held_whole() {
        let Some((store, _)) = two_nodes().await else { return };
        let stream = InstanceKey::new("assistant", "busy");
        store.admit(admission("d-1", "assistant", "busy")).await.unwrap();
        store
            .claim_next(&stream, &claim("attempt-1", "node"))
            .await
            .unwrap()
            .unwrap();
        let mut held = Vec::new();
        for _ in 0..POOL_SIZE {
            held.push(store.client().await.map_err(Failure::into_store_error).unwrap());
        }
        let renewed = tokio::time::timeout(
            Duration::from_secs(5),
            store.renew_leases("node", &["attempt-1".to_owned()], super::super::now_ms() + 60_000),
        )
        .await
        .expect("renewed without waiting for the pool");
        assert_eq!(renewed.unwrap(), 1);
        drop(held);
    }

    #[tokio::test]
    async fn keeps_leases_and_offsets_beyond_the_signed_range_exact() {
        let Some((store, _)) = two_nodes().await else { return };
        let stream = InstanceKey::new("assistant", "forever");
        store.admit(admission("d-1", "assistant", "forever")).await.unwrap();
        store
            .claim_next(&stream, &claim("attempt-1", "node"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            store
                .renew_leases("node", &["attempt-1".to_owned()], u64::MAX)
                .await
                .unwrap(),
            1
        );
        assert_eq!(store.submission("d-1").await.unwrap().unwrap().lease_until_ms, u64::MAX);
        assert!(store.expired(u64::MAX).await.unwrap().is_empty());
        assert!(store.read(&stream, Some(u64::MAX)).await.unwrap().is_empty());
        assert_eq!(store.read(&stream, Some(0)).await.unwrap().len(), 0);
        assert_eq!(store.read(&stream, None).await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn lists_instances_with_queued_work_in_byte_order() {
        let Some((store, _)) = two_nodes().await else { return };
        for (n, agent) in ["b", "B", "a", "é"].into_iter().enumerate() {
            store.admit(admission(&format!("d-{n}"), agent, "x")).await.unwrap();
        }
        let agents: Vec<String> = store
            .instances_with_queued()
            .await
            .unwrap()
            .into_iter()
            .map(|key| key.agent.to_string())
            .collect();
        assert_eq!(agents, ["B", "a", "b", "é"], "the memory store's (byte) order");
    }

    #[tokio::test]
    async fn works_in_a_schema_whose_name_needs_quoting() {
        let Some(url) = test_url() else { return };
        let schema = format!("Flue \"test\" {}", ulid::Ulid::new());
        let store = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
        store.admit(admission("d-1", "assistant", "quoted")).await.unwrap();
        let client = raw(&url, &schema).await;
        assert_eq!(meta(&client).await, stamp("format_version", "1"));
        let submissions: i64 = client
            .query_one("SELECT count(*) FROM flue_submissions", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(submissions, 1);
    }

    #[tokio::test]
    async fn reports_bad_urls_and_unreachable_servers_as_errors() {
        let Err(StoreError::Other(message)) = PostgresStore::connect("postgres://[bad").await else {
            panic!("a malformed URL is an error");
        };
        assert!(message.starts_with("postgres: invalid URL"), "{message}");
        // Nothing listens on port 1 of loopback.
        let Err(StoreError::Other(message)) =
            PostgresStore::connect("postgres://nobody@127.0.0.1:1/none?connect_timeout=5").await
        else {
            panic!("an unreachable server is an error");
        };
        assert!(message.starts_with("postgres: no database connection"), "{message}");
    }

    #[tokio::test]
    async fn connection_errors_never_quote_the_password() {
        // Unreachable (nothing listens on port 1 of loopback) or malformed, the password given
        // in the userinfo, the query or a `key=value` string stays out of the error.
        let urls = [
            "postgres://nobody:hunter2@127.0.0.1:1/none?connect_timeout=5",
            "postgres://nobody@127.0.0.1:1/none?password=hunter2&connect_timeout=5",
            "host=127.0.0.1 port=1 user=nobody password=hunter2 connect_timeout=5",
            "postgres://nobody:hunter2@127.0.0.1:notaport/none",
            "postgres://nobody:hunter2@127.0.0.1:1/none?hunter2=1",
            "postgres://nobody:hunter2@127.0.0.1:1/none?sslmode=hunter2",
            "host=127.0.0.1 user=nobody password='hunter2",
            "host=127.0.0.1 password=hunter2 hunter2",
        ];
        for url in urls {
            let error = PostgresStore::connect(url).await.unwrap_err();
            let (display, debug) = (error.to_string(), format!("{error:?}"));
            assert!(display.contains("postgres: "), "{url}: {display}");
            assert!(!display.contains("hunter2"), "{url}: {display}");
            assert!(!debug.contains("hunter2"), "{url}: {debug}");
        }
    }

    #[tokio::test]
    async fn debug_of_a_store_never_shows_its_connection_url() {
        let Some(url) = test_url() else { return };
        let store = PostgresStore::connect_with_schema(&url, &fresh_schema()).await.unwrap();
        let debug = format!("{store:?}");
        let config: tokio_postgres::Config = url.parse().unwrap();
        assert!(!debug.contains(&url), "{debug}");
        if let Some(password) = config.get_password().filter(|password| !password.is_empty()) {
            assert!(!debug.contains(&*String::from_utf8_lossy(password)), "{debug}");
        }
    }

    #[tokio::test]
    async fn a_rejected_password_is_not_quoted_in_the_error() {
        let Some(url) = test_url() else { return };
        // The same server and role with a wrong password (a later `password` wins).
        let wrong = if !url.contains("://") {
            format!("{url} password=hunter2")
        } else if url.contains('?') {
            format!("{url}&password=hunter2")
        } else {
            format!("{url}?password=hunter2")
        };
        // A server that trusts the role lets any password in: nothing to check then.
        if let Err(error) = PostgresStore::connect_with_schema(&wrong, &fresh_schema()).await {
            let (display, debug) = (error.to_string(), format!("{error:?}"));
            assert!(!display.contains("hunter2"), "{display}");
            assert!(!debug.contains("hunter2"), "{debug}");
        }
    }

    #[test]
    fn pooled_connections_to_a_vanished_server_fail_within_a_bound_unless_the_url_sets_its_own() {
        let mut config: tokio_postgres::Config = "postgres://u@127.0.0.1/db".parse().unwrap();
        bound_dead_connections(&mut config);
        assert_eq!(config.get_keepalives_idle(), DEAD_CONNECTION / 2);
        assert_eq!(config.get_keepalives_interval(), Some(DEAD_CONNECTION / 6));
        assert_eq!(config.get_keepalives_retries(), Some(3));
        assert_eq!(config.get_tcp_user_timeout(), Some(&DEAD_CONNECTION));
        let mut own: tokio_postgres::Config = "postgres://u@127.0.0.1/db?keepalives_idle=60&tcp_user_timeout=90"
            .parse()
            .unwrap();
        bound_dead_connections(&mut own);
        assert_eq!(own.get_keepalives_idle(), Duration::from_secs(60));
        assert_eq!(own.get_tcp_user_timeout(), Some(&Duration::from_secs(90)));
    }

    #[test]
    fn measures_the_clock_offset_within_half_a_round_trip_and_keeps_it_while_measurements_agree() {
        // The database read 1 000 ms past the node's midpoint of a 10 ms round trip.
        let offset = Offset::measured(5_000, 6_005, 5_010);
        assert_eq!(offset, Offset { ms: 1_000, error_ms: 6 });
        assert_eq!(
            Offset::measured(5_000, 3_000, 5_000),
            Offset {
                ms: -2_000,
                error_ms: 1
            }
        );
        // A node clock stepped back after the node read it: no negative round trip.
        assert_eq!(Offset::measured(5_000, 5_000, 4_990).error_ms, 1);
        let clock = Clock::new(offset);
        clock.update(Offset { ms: 1_004, error_ms: 1 }, false);
        assert_eq!(clock.offset(), offset, "within both errors: the offset in use stays");
        let stepped = Offset { ms: 1_008, error_ms: 1 };
        clock.update(stepped, false);
        assert_eq!(clock.offset(), stepped, "further apart: the node's clock moved");
        assert_eq!(clock.to_database(10_000), 11_008);
        let row = clock.submission_to_node(Submission {
            lease_until_ms: 11_008,
            timeout_at_ms: 0,
            ..super::super::queued_submission(admission("d-1", "assistant", "i"), 1)
        });
        assert_eq!((row.lease_until_ms, row.timeout_at_ms), (10_000, 0));
    }

    #[test]
    fn shifting_a_time_keeps_none_and_never_and_keeps_any_other_time_a_time() {
        assert_eq!(shift(0, 5), 0);
        assert_eq!(shift(u64::MAX, -5), u64::MAX);
        assert_eq!(shift(u64::MAX - 1, 5), u64::MAX);
        assert_eq!(shift(1, -5), 1, "an expired lease stays a lease");
        assert_eq!(shift(100, -5), 95);
    }

    #[test]
    fn escapes_identifiers_and_startup_options() {
        assert_eq!(quote_identifier("plain"), "\"plain\"");
        assert_eq!(quote_identifier("a\"b"), "\"a\"\"b\"");
        assert_eq!(escape_option("\"a b\\c\""), "\"a\\ b\\\\c\"");
    }

    // ---- a fenced append racing a takeover, and appends dropped mid-flight -----------------

    /// The bodies of the stream's `A:`-tagged user messages (the racing appenders'), by offset.
    fn racing_bodies(batches: &[Batch]) -> std::collections::BTreeMap<u64, String> {
        batches
            .iter()
            .filter_map(|batch| match &batch.records[0].body {
                RecordBody::UserMessage { body, .. } if body.starts_with("A:") => Some((batch.offset, body.clone())),
                _ => None,
            })
            .collect()
    }

    type Appender = tokio::task::JoinHandle<(Vec<(u64, String)>, String)>;

    /// Six appenders of the attempt `stale` to `stream`, on both nodes, each appending until it
    /// is fenced: what each saw appended, and the body it was fenced with.
    fn stale_appenders(
        a: &PostgresStore,
        b: &PostgresStore,
        stream: &InstanceKey,
        stale: &AttemptRef,
    ) -> Vec<Appender> {
        (0..6)
            .map(|k| {
                let node = if k % 2 == 0 { a.clone() } else { b.clone() };
                let (stream, stale) = (stream.clone(), stale.clone());
                tokio::spawn(async move {
                    let mut appended = Vec::new();
                    for n in 0.. {
                        let body = format!("A:{k}:{n}");
                        match node
                            .append(&stream, vec![user_record(&body)].into(), Some(&stale))
                            .await
                        {
                            Ok(offset) => appended.push((offset, body)),
                            Err(StoreError::Fenced(_)) => return (appended, body),
                            Err(other) => panic!("unexpected append error: {other}"),
                        }
                    }
                    unreachable!("an appender runs until it is fenced")
                })
            })
            .collect()
    }

    /// Ends `stale`'s ownership one of three ways (node b reclaims it, it settles, node b
    /// requeues it); the attempt that owns the submission afterwards, if any.
    async fn end_ownership(a: &PostgresStore, b: &PostgresStore, way: u64, stale: &AttemptRef) -> Option<AttemptRef> {
        let submission = stale.submission_id.as_str();
        match way % 3 {
            0 => {
                let lease = super::super::now_ms() + 60_000;
                b.reclaim(submission, &stale.attempt_id, &claim("attempt-b", "node-b"), lease)
                    .await
                    .unwrap()
                    .unwrap();
                Some(AttemptRef {
                    submission_id: submission.to_owned(),
                    attempt_id: "attempt-b".into(),
                })
            }
            1 => {
                a.settle(stale, Outcome::Completed, None, vec![user_record("settled")])
                    .await
                    .unwrap();
                None
            }
            _ => {
                assert!(b.requeue(stale).await.unwrap());
                None
            }
        }
    }

    /// Exactly the appends reported as appended are in the stream, none reported fenced is,
    /// none lands after `marker` (appended once the ownership ended), and the offsets run on.
    async fn assert_fenced_cleanly(store: &PostgresStore, stream: &InstanceKey, appenders: Vec<Appender>, marker: u64) {
        let (mut reported, mut fenced) = (std::collections::BTreeMap::new(), Vec::new());
        for appender in appenders {
            let (appended, fenced_body) = appender.await.unwrap();
            reported.extend(appended);
            fenced.push(fenced_body);
        }
        let batches = store.read(stream, None).await.unwrap();
        let offsets: Vec<u64> = batches.iter().map(|batch| batch.offset).collect();
        assert_eq!(offsets, (0..batches.len() as u64).collect::<Vec<_>>(), "offsets run on");
        let written = racing_bodies(&batches);
        assert_eq!(
            written, reported,
            "exactly the appends reported as appended are written"
        );
        for body in &fenced {
            assert!(
                !written.values().any(|written| written == body),
                "the fenced append {body} was written"
            );
        }
        assert!(
            written.keys().all(|&offset| offset < marker),
            "a stale batch after the takeover"
        );
    }

    /// `submission`'s attempt `attempt-a` (claimed by node a in the race tests).
    fn running_attempt(submission: &str) -> AttemptRef {
        AttemptRef {
            submission_id: submission.to_owned(),
            attempt_id: "attempt-a".into(),
        }
    }

    /// One round: stale appenders to `stream` while `stale`'s ownership ends (the way chosen
    /// by `round`), then a marker appended by whoever owns the submission after, then the
    /// checks of [`assert_fenced_cleanly`].
    async fn race_a_takeover(
        a: &PostgresStore,
        b: &PostgresStore,
        round: u64,
        stream: &InstanceKey,
        stale: &AttemptRef,
    ) {
        let appenders = stale_appenders(a, b, stream, stale);
        tokio::time::sleep(Duration::from_millis(round % 7)).await;
        let owner = end_ownership(a, b, round, stale).await;
        let marker = b
            .append(stream, vec![user_record("MARK")].into(), owner.as_ref())
            .await
            .unwrap();
        assert_fenced_cleanly(a, stream, appenders, marker).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn stale_appends_racing_a_takeover_are_written_exactly_when_reported_appended() {
        let Some((a, b)) = two_nodes().await else { return };
        for round in 0..40_u64 {
            let instance = format!("race-{round}");
            let stream = InstanceKey::new("assistant", instance.as_str());
            let submission = format!("d-{round}");
            a.admit(admission(&submission, "assistant", &instance)).await.unwrap();
            a.claim_next(&stream, &claim("attempt-a", "node-a"))
                .await
                .unwrap()
                .unwrap();
            race_a_takeover(&a, &b, round, &stream, &running_attempt(&submission)).await;
        }
    }

    /// A task's child stream is another instance than its parent's submission: the instance
    /// lock does not order the append against the takeover; the fence alone does.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn stale_appends_to_a_child_stream_racing_a_takeover_are_written_exactly_when_reported_appended() {
        let Some((a, b)) = two_nodes().await else { return };
        for round in 0..40_u64 {
            let instance = format!("parent-{round}");
            let parent = InstanceKey::new("assistant", instance.as_str());
            let child = InstanceKey::new("assistant:task", format!("{instance}/task_1"));
            let submission = format!("p-{round}");
            a.admit(admission(&submission, "assistant", &instance)).await.unwrap();
            a.claim_next(&parent, &claim("attempt-a", "node-a"))
                .await
                .unwrap()
                .unwrap();
            let stale = running_attempt(&submission);
            a.create_child(
                &parent,
                vec![user_record("link")].into(),
                &child,
                vec![user_record("birth")].into(),
                Some(&stale),
            )
            .await
            .unwrap();
            race_a_takeover(&a, &b, round, &child, &stale).await;
        }
    }

    /// Appends dropped after a few polls: every pooled connection is left outside a
    /// transaction, and the stream stays whole (offsets run on, the next offset counts them).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn appends_dropped_mid_flight_leave_no_connection_in_an_open_transaction() {
        let Some(url) = test_url() else { return };
        let schema = fresh_schema();
        // Its own application name: other tests' connections share the database's activity.
        let application = format!("flue-{schema}");
        let separator = if url.contains('?') { '&' } else { '?' };
        let named = format!("{url}{separator}application_name={application}");
        let store = PostgresStore::connect_with_schema(&named, &schema).await.unwrap();
        let stream = InstanceKey::new("assistant", "dropped");
        store.admit(admission("d-1", "assistant", "dropped")).await.unwrap();
        store
            .claim_next(&stream, &claim("attempt-a", "node-a"))
            .await
            .unwrap()
            .unwrap();
        let owner = AttemptRef {
            submission_id: "d-1".into(),
            attempt_id: "attempt-a".into(),
        };
        let tasks: Vec<_> = (0..8_u32)
            .map(|t| {
                let (store, stream, owner) = (store.clone(), stream.clone(), owner.clone());
                tokio::spawn(async move {
                    let (mut completed, mut dropped) = (0_usize, 0_usize);
                    for n in 0..100_u32 {
                        let mut append =
                            store.append(&stream, vec![user_record(&format!("A:{t}:{n}"))].into(), Some(&owner));
                        let mut done = false;
                        for _ in 0..1 + (n + t) % 6 {
                            if let Some(result) = futures_util::FutureExt::now_or_never(&mut append) {
                                result.unwrap();
                                done = true;
                                break;
                            }
                            tokio::task::yield_now().await;
                        }
                        if done {
                            completed += 1;
                        } else {
                            dropped += 1;
                        }
                        drop(append);
                        // An ordinary transaction, perhaps on a connection a dropped append left.
                        if n % 10 == 0 {
                            store
                                .renew_leases("node-a", &["attempt-a".to_owned()], super::super::now_ms() + 30_000)
                                .await
                                .unwrap();
                        }
                    }
                    // One awaited to its end: the stream holds it whatever the races did.
                    store
                        .append(&stream, vec![user_record(&format!("A:{t}:last"))].into(), Some(&owner))
                        .await
                        .unwrap();
                    (completed + 1, dropped)
                })
            })
            .collect();
        let (mut completed, mut dropped) = (0, 0);
        for task in tasks {
            let (done, gone) = task.await.unwrap();
            completed += done;
            dropped += gone;
        }
        assert!(dropped > 0, "no append was dropped mid-flight: the test raced nothing");
        // A dropped append still queued on a connection runs to its commit.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let raw = raw(&url, &schema).await;
        let open: i64 = raw
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
                 AND state LIKE 'idle in transaction%'",
                &[&application],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(open, 0, "a pooled connection was left in an open transaction");
        let batches = store.read(&stream, None).await.unwrap();
        let offsets: Vec<u64> = batches.iter().map(|batch| batch.offset).collect();
        assert_eq!(offsets, (0..batches.len() as u64).collect::<Vec<_>>(), "offsets run on");
        let next: i64 = raw
            .query_one(
                "SELECT next_offset FROM flue_instances WHERE instance_id = 'dropped'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(usize::try_from(next).unwrap(), batches.len());
        assert!(
            racing_bodies(&batches).len() >= completed,
            "an append reported appended is missing"
        );
    }
}
