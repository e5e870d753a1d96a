//! The embedded default store: SQLite (compiled in), one file, WAL.
//!
//! Durability setting: WAL journal with `synchronous = NORMAL`. Every durability point is one
//! transaction; a committed transaction survives a crash of the process (the WAL is written
//! before the commit returns), while a power loss may lose the last transactions before the
//! next checkpoint. Statements are prepared once per connection (rusqlite's statement cache).
//!
//! Submission rows keep their full state as JSON beside the columns that queries filter on,
//! so every transition is the same read-modify-write the memory store performs, inside one
//! `BEGIN IMMEDIATE` transaction.

use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use flue_core::BoxFuture;
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use super::{
    Admission, Admitted, AttemptRef, Claim, InstanceInfo, InstanceKey, Store, StoreError, Submission, SubmissionStatus,
};
use crate::record::{Batch, Outcome, Record, SettlementError, new_id};

/// The persisted format this build reads and writes.
pub const FORMAT_VERSION: &str = "1";

/// A [`Store`] in one SQLite file.
pub struct SqliteStore {
    connection: Mutex<Connection>,
}

const SCHEMA: &str = "
CREATE TABLE flue_instances (
    agent TEXT NOT NULL,
    id TEXT NOT NULL,
    uid TEXT NOT NULL,
    next_offset INTEGER NOT NULL,
    PRIMARY KEY (agent, id)
);
CREATE TABLE flue_submissions (
    id TEXT PRIMARY KEY,
    sequence INTEGER NOT NULL UNIQUE,
    agent TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    status TEXT NOT NULL,
    owner_id TEXT,
    lease_until_ms INTEGER NOT NULL DEFAULT 0,
    data TEXT NOT NULL
);
CREATE INDEX flue_submissions_unsettled ON flue_submissions (agent, instance_id, sequence) WHERE status <> 'settled';
CREATE INDEX flue_submissions_by_status ON flue_submissions (status, agent, instance_id);
CREATE INDEX flue_submissions_by_owner ON flue_submissions (owner_id, status);
CREATE TABLE flue_batches (
    agent TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    offset INTEGER NOT NULL,
    records TEXT NOT NULL,
    PRIMARY KEY (agent, instance_id, offset)
);
";

fn sql(error: rusqlite::Error) -> StoreError {
    StoreError::Other(format!("sqlite: {error}"))
}

fn json_error(error: serde_json::Error) -> StoreError {
    StoreError::Other(format!("sqlite: a stored row does not parse: {error}"))
}

fn status_name(status: SubmissionStatus) -> &'static str {
    match status {
        SubmissionStatus::Queued => "queued",
        SubmissionStatus::Running => "running",
        SubmissionStatus::Joining => "joining",
        SubmissionStatus::Joined => "joined",
        SubmissionStatus::Settled => "settled",
    }
}

fn ready<T: Send + 'static>(value: T) -> BoxFuture<'static, T> {
    Box::pin(std::future::ready(value))
}

impl SqliteStore {
    /// Opens (creating if needed) the store at `path`, creating parent directories, and checks
    /// or stamps the persisted format version.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let path = path.as_ref();
        if let Some(parent) = path.parent().filter(|parent| !parent.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .map_err(|error| StoreError::Other(format!("cannot create {}: {error}", parent.display())))?;
        }
        let connection = Connection::open(path).map_err(sql)?;
        Self::with_connection(connection)
    }

    /// The default store of a runtime: `.flue/flue.db` under the working directory.
    pub fn open_default() -> Result<Self, StoreError> {
        Self::open(Path::new(".flue").join("flue.db"))
    }

    /// A private in-memory database (tests).
    pub fn in_memory() -> Result<Self, StoreError> {
        Self::with_connection(Connection::open_in_memory().map_err(sql)?)
    }

    fn with_connection(mut connection: Connection) -> Result<Self, StoreError> {
        connection
            .execute_batch("PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA busy_timeout = 5000;")
            .map_err(sql)?;
        connection.set_prepared_statement_cache_capacity(64);
        migrate(&mut connection)?;
        Ok(Self {
            connection: Mutex::new(connection),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Connection> {
        self.connection.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Runs `f` in one `BEGIN IMMEDIATE` transaction, committing when it succeeds.
    fn transaction<T>(
        &self,
        f: impl FnOnce(&rusqlite::Transaction<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.run(TransactionBehavior::Immediate, f)
    }

    /// Runs a read-only `f` in a deferred transaction (a consistent snapshot, no write lock).
    fn read_transaction<T>(
        &self,
        f: impl FnOnce(&rusqlite::Transaction<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.run(TransactionBehavior::Deferred, f)
    }

    fn run<T>(
        &self,
        behavior: TransactionBehavior,
        f: impl FnOnce(&rusqlite::Transaction<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut connection = self.lock();
        let transaction = connection.transaction_with_behavior(behavior).map_err(sql)?;
        let value = f(&transaction)?;
        transaction.commit().map_err(sql)?;
        Ok(value)
    }
}

/// Format-version rules: a fresh database is stamped before any other table is created; a
/// legacy `schema_version = 8` stamp is relabelled in place; anything else is refused without
/// changing anything.
fn migrate(connection: &mut Connection) -> Result<(), StoreError> {
    let transaction = connection
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(sql)?;
    let tables: Vec<String> = {
        let mut statement = transaction
            .prepare("SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'flue\\_%' ESCAPE '\\'")
            .map_err(sql)?;
        let rows = statement.query_map([], |row| row.get::<_, String>(0)).map_err(sql)?;
        rows.collect::<Result<_, _>>().map_err(sql)?
    };
    if tables.is_empty() {
        transaction
            .execute_batch("CREATE TABLE flue_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);")
            .map_err(sql)?;
        transaction
            .execute(
                "INSERT INTO flue_meta (key, value) VALUES ('format_version', ?1)",
                params![FORMAT_VERSION],
            )
            .map_err(sql)?;
        transaction.execute_batch(SCHEMA).map_err(sql)?;
        return transaction.commit().map_err(sql);
    }
    let stamp = |key: &str| -> Result<Option<String>, StoreError> {
        if !tables.iter().any(|table| table == "flue_meta") {
            return Ok(None);
        }
        transaction
            .query_row("SELECT value FROM flue_meta WHERE key = ?1", params![key], |row| {
                row.get(0)
            })
            .optional()
            .map_err(sql)
    };
    match (stamp("format_version")?, stamp("schema_version")?) {
        (Some(version), _) if version == FORMAT_VERSION => Ok(()),
        (None, Some(legacy)) if legacy == "8" => {
            transaction
                .execute(
                    "UPDATE flue_meta SET key = 'format_version', value = ?1 WHERE key = 'schema_version'",
                    params![FORMAT_VERSION],
                )
                .map_err(sql)?;
            transaction.commit().map_err(sql)
        }
        (Some(version), _) | (None, Some(version)) => Err(StoreError::FormatVersion { stored: version }),
        (None, None) => Err(StoreError::FormatVersion {
            stored: "unversioned".into(),
        }),
    }
}

fn read_submission(transaction: &rusqlite::Transaction<'_>, id: &str) -> Result<Option<Submission>, StoreError> {
    let data: Option<String> = transaction
        .prepare_cached("SELECT data FROM flue_submissions WHERE id = ?1")
        .map_err(sql)?
        .query_row(params![id], |row| row.get(0))
        .optional()
        .map_err(sql)?;
    data.map(|data| serde_json::from_str(&data).map_err(json_error))
        .transpose()
}

fn write_submission(transaction: &rusqlite::Transaction<'_>, row: &Submission) -> Result<(), StoreError> {
    let data = serde_json::to_string(row).map_err(json_error)?;
    transaction
        .prepare_cached(
            "INSERT INTO flue_submissions (id, sequence, agent, instance_id, status, owner_id, lease_until_ms, data)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
             ON CONFLICT (id) DO UPDATE SET status = excluded.status, owner_id = excluded.owner_id,
                 lease_until_ms = excluded.lease_until_ms, data = excluded.data",
        )
        .map_err(sql)?
        .execute(params![
            row.id,
            row.sequence as i64,
            row.key.agent,
            row.key.id,
            status_name(row.status),
            row.owner_id,
            row.lease_until_ms as i64,
            data
        ])
        .map_err(sql)?;
    Ok(())
}

/// The instance's unsettled submissions, in admission order.
fn unsettled(transaction: &rusqlite::Transaction<'_>, key: &InstanceKey) -> Result<Vec<Submission>, StoreError> {
    let mut statement = transaction
        .prepare_cached(
            "SELECT data FROM flue_submissions WHERE agent = ?1 AND instance_id = ?2 AND status <> 'settled' ORDER BY sequence",
        )
        .map_err(sql)?;
    let rows = statement
        .query_map(params![key.agent, key.id], |row| row.get::<_, String>(0))
        .map_err(sql)?;
    rows.map(|data| serde_json::from_str(&data.map_err(sql)?).map_err(json_error))
        .collect()
}

fn owns(transaction: &rusqlite::Transaction<'_>, attempt: &AttemptRef) -> Result<Option<Submission>, StoreError> {
    Ok(read_submission(transaction, &attempt.submission_id)?.filter(|row| {
        row.status == SubmissionStatus::Running && row.attempt_id.as_deref() == Some(attempt.attempt_id.as_str())
    }))
}

fn append_batch(
    transaction: &rusqlite::Transaction<'_>,
    key: &InstanceKey,
    records: &[Record],
) -> Result<u64, StoreError> {
    if records.is_empty() {
        return Err(StoreError::Other("an append batch must not be empty".into()));
    }
    let offset: Option<i64> = transaction
        .prepare_cached("SELECT next_offset FROM flue_instances WHERE agent = ?1 AND id = ?2")
        .map_err(sql)?
        .query_row(params![key.agent, key.id], |row| row.get(0))
        .optional()
        .map_err(sql)?;
    let offset = offset.ok_or_else(|| StoreError::Other(format!("no stream {key}")))?;
    let data = serde_json::to_string(records).map_err(json_error)?;
    transaction
        .prepare_cached("INSERT INTO flue_batches (agent, instance_id, offset, records) VALUES (?1, ?2, ?3, ?4)")
        .map_err(sql)?
        .execute(params![key.agent, key.id, offset, data])
        .map_err(sql)?;
    transaction
        .prepare_cached("UPDATE flue_instances SET next_offset = next_offset + 1 WHERE agent = ?1 AND id = ?2")
        .map_err(sql)?
        .execute(params![key.agent, key.id])
        .map_err(sql)?;
    Ok(offset as u64)
}

fn instance_uid(
    transaction: &rusqlite::Transaction<'_>,
    key: &InstanceKey,
) -> Result<Option<(String, u64)>, StoreError> {
    transaction
        .prepare_cached("SELECT uid, next_offset FROM flue_instances WHERE agent = ?1 AND id = ?2")
        .map_err(sql)?
        .query_row(params![key.agent, key.id], |row| {
            Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)? as u64))
        })
        .optional()
        .map_err(sql)
}

impl Store for SqliteStore {
    fn admit(&self, admission: Admission) -> BoxFuture<'_, Result<Admitted, StoreError>> {
        ready(self.transaction(|tx| {
            if let Some(existing) = read_submission(tx, &admission.submission_id)? {
                if existing.message == admission.message && existing.key == admission.key {
                    let uid = instance_uid(tx, &admission.key)?
                        .map(|(uid, _)| uid)
                        .unwrap_or_default();
                    return Ok(Admitted {
                        submission: existing,
                        uid,
                        deduplicated: true,
                        offset: None,
                    });
                }
                return Err(StoreError::SubmissionConflict(admission.submission_id.clone()));
            }
            let existing_uid = instance_uid(tx, &admission.key)?.map(|(uid, _)| uid);
            super::check_uid(&admission, existing_uid.as_deref())?;
            let uid = match existing_uid {
                Some(uid) => uid,
                None => {
                    let uid = new_id("inst");
                    tx.prepare_cached(
                        "INSERT INTO flue_instances (agent, id, uid, next_offset) VALUES (?1, ?2, ?3, 0)",
                    )
                    .map_err(sql)?
                    .execute(params![admission.key.agent, admission.key.id, uid])
                    .map_err(sql)?;
                    let birth = super::birth_record(&uid, admission.initial_data.clone());
                    append_batch(tx, &admission.key, &[birth])?;
                    uid
                }
            };
            let sequence: i64 = tx
                .query_row(
                    "SELECT COALESCE(MAX(sequence), 0) + 1 FROM flue_submissions",
                    [],
                    |row| row.get(0),
                )
                .map_err(sql)?;
            let key = admission.key.clone();
            let submission = super::queued_submission(admission, sequence as u64);
            write_submission(tx, &submission)?;
            let offset = instance_uid(tx, &key)?.and_then(|(_, next)| next.checked_sub(1));
            Ok(Admitted {
                submission,
                uid,
                deduplicated: false,
                offset,
            })
        }))
    }

    fn instance(&self, key: &InstanceKey) -> BoxFuture<'_, Result<Option<InstanceInfo>, StoreError>> {
        ready(self.read_transaction(|tx| {
            Ok(instance_uid(tx, key)?.map(|(uid, _)| InstanceInfo {
                id: key.id.clone(),
                uid,
            }))
        }))
    }

    fn submission(&self, id: &str) -> BoxFuture<'_, Result<Option<Submission>, StoreError>> {
        ready(self.read_transaction(|tx| read_submission(tx, id)))
    }

    fn has_queued(&self, key: &InstanceKey) -> BoxFuture<'_, Result<bool, StoreError>> {
        ready(self.read_transaction(|tx| {
            tx.prepare_cached(
                "SELECT EXISTS (SELECT 1 FROM flue_submissions WHERE agent = ?1 AND instance_id = ?2 AND status = 'queued')",
            )
            .map_err(sql)?
            .query_row(params![key.agent, key.id], |row| row.get(0))
            .map_err(sql)
        }))
    }

    fn claim_next(&self, key: &InstanceKey, claim: &Claim) -> BoxFuture<'_, Result<Option<Submission>, StoreError>> {
        ready(self.transaction(|tx| {
            let Some(mut head) = unsettled(tx, key)?.into_iter().next() else {
                return Ok(None);
            };
            if head.status != SubmissionStatus::Queued {
                return Ok(None);
            }
            head.status = SubmissionStatus::Running;
            head.attempt_id = Some(claim.attempt_id.clone());
            head.owner_id = Some(claim.owner_id.clone());
            head.lease_until_ms = claim.lease_until_ms;
            head.attempt_count += 1;
            if head.timeout_at_ms == 0 {
                head.timeout_at_ms = super::now_ms() + head.timeout_ms;
            }
            write_submission(tx, &head)?;
            Ok(Some(head))
        }))
    }

    fn renew_leases(&self, owner_id: &str, lease_until_ms: u64) -> BoxFuture<'_, Result<u64, StoreError>> {
        ready(self.transaction(|tx| {
            let ids: Vec<String> = {
                let mut statement = tx
                    .prepare_cached("SELECT id FROM flue_submissions WHERE status = 'running' AND owner_id = ?1")
                    .map_err(sql)?;
                let rows = statement.query_map(params![owner_id], |row| row.get(0)).map_err(sql)?;
                rows.collect::<Result<_, _>>().map_err(sql)?
            };
            for id in &ids {
                if let Some(mut row) = read_submission(tx, id)? {
                    row.lease_until_ms = lease_until_ms;
                    write_submission(tx, &row)?;
                }
            }
            Ok(ids.len() as u64)
        }))
    }

    fn expired(&self, now_ms: u64) -> BoxFuture<'_, Result<Vec<Submission>, StoreError>> {
        ready(self.read_transaction(|tx| {
            let mut statement = tx
                .prepare_cached(
                    "SELECT data FROM flue_submissions WHERE status = 'running' AND lease_until_ms > 0 AND lease_until_ms < ?1 ORDER BY sequence",
                )
                .map_err(sql)?;
            let rows = statement.query_map(params![now_ms as i64], |row| row.get::<_, String>(0)).map_err(sql)?;
            rows.map(|data| serde_json::from_str(&data.map_err(sql)?).map_err(json_error)).collect()
        }))
    }

    fn reclaim(
        &self,
        submission_id: &str,
        stale_attempt_id: &str,
        claim: &Claim,
    ) -> BoxFuture<'_, Result<Option<Submission>, StoreError>> {
        ready(self.transaction(|tx| {
            let Some(mut row) = read_submission(tx, submission_id)? else {
                return Ok(None);
            };
            if row.status != SubmissionStatus::Running || row.attempt_id.as_deref() != Some(stale_attempt_id) {
                return Ok(None);
            }
            row.attempt_id = Some(claim.attempt_id.clone());
            row.owner_id = Some(claim.owner_id.clone());
            row.lease_until_ms = claim.lease_until_ms;
            row.attempt_count += 1;
            write_submission(tx, &row)?;
            Ok(Some(row))
        }))
    }

    fn instances_with_queued(&self) -> BoxFuture<'_, Result<Vec<InstanceKey>, StoreError>> {
        ready(self.read_transaction(|tx| {
            let mut statement = tx
                .prepare_cached("SELECT DISTINCT agent, instance_id FROM flue_submissions WHERE status = 'queued' ORDER BY agent, instance_id")
                .map_err(sql)?;
            let rows = statement
                .query_map([], |row| Ok(InstanceKey::new(row.get::<_, String>(0)?, row.get::<_, String>(1)?)))
                .map_err(sql)?;
            rows.collect::<Result<_, _>>().map_err(sql)
        }))
    }

    fn claim_joinable(&self, host: &AttemptRef) -> BoxFuture<'_, Result<Vec<Submission>, StoreError>> {
        ready(self.transaction(|tx| {
            let Some(host_row) = owns(tx, host)? else {
                return Ok(Vec::new());
            };
            let mut claimed = Vec::new();
            for mut row in unsettled(tx, &host_row.key)?
                .into_iter()
                .filter(|row| row.status == SubmissionStatus::Queued)
            {
                if row.abort_requested {
                    break;
                }
                row.status = SubmissionStatus::Joining;
                row.joined_into = Some(host.submission_id.clone());
                write_submission(tx, &row)?;
                claimed.push(row);
            }
            Ok(claimed)
        }))
    }

    fn finalize_join(&self, host: &AttemptRef, submission_id: &str) -> BoxFuture<'_, Result<bool, StoreError>> {
        ready(self.transaction(|tx| {
            if owns(tx, host)?.is_none() {
                return Ok(false);
            }
            match read_submission(tx, submission_id)? {
                Some(mut row)
                    if row.status == SubmissionStatus::Joining
                        && row.joined_into.as_deref() == Some(host.submission_id.as_str()) =>
                {
                    row.status = SubmissionStatus::Joined;
                    write_submission(tx, &row)?;
                    Ok(true)
                }
                _ => Ok(false),
            }
        }))
    }

    fn settle(
        &self,
        host: &AttemptRef,
        outcome: Outcome,
        error: Option<SettlementError>,
        records: Vec<Record>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        ready(self.transaction(|tx| {
            let Some(mut host_row) = owns(tx, host)? else {
                return Err(StoreError::Fenced(format!(
                    "attempt {} does not own {}",
                    host.attempt_id, host.submission_id
                )));
            };
            if !records.is_empty() {
                append_batch(tx, &host_row.key, &records)?;
            }
            for mut row in unsettled(tx, &host_row.key)? {
                if row.joined_into.as_deref() != Some(host.submission_id.as_str()) {
                    continue;
                }
                match row.status {
                    SubmissionStatus::Joined => {
                        row.status = SubmissionStatus::Settled;
                        row.outcome = Some(outcome);
                        row.error = error.clone();
                    }
                    // A join claimed but never applied goes back to the queue: never lost.
                    SubmissionStatus::Joining => {
                        row.status = SubmissionStatus::Queued;
                        row.joined_into = None;
                    }
                    _ => continue,
                }
                write_submission(tx, &row)?;
            }
            host_row.status = SubmissionStatus::Settled;
            host_row.outcome = Some(outcome);
            host_row.error = error;
            host_row.lease_until_ms = 0;
            write_submission(tx, &host_row)
        }))
    }

    fn requeue(&self, attempt: &AttemptRef) -> BoxFuture<'_, Result<bool, StoreError>> {
        ready(self.transaction(|tx| {
            let Some(mut row) = owns(tx, attempt)? else {
                return Ok(false);
            };
            for mut joining in unsettled(tx, &row.key)? {
                if joining.joined_into.as_deref() == Some(attempt.submission_id.as_str())
                    && joining.status == SubmissionStatus::Joining
                {
                    joining.status = SubmissionStatus::Queued;
                    joining.joined_into = None;
                    write_submission(tx, &joining)?;
                }
            }
            row.status = SubmissionStatus::Queued;
            row.attempt_id = None;
            row.owner_id = None;
            row.lease_until_ms = 0;
            write_submission(tx, &row)?;
            Ok(true)
        }))
    }

    fn request_abort(&self, key: &InstanceKey) -> BoxFuture<'_, Result<Vec<String>, StoreError>> {
        ready(self.transaction(|tx| {
            let mut affected = Vec::new();
            for mut row in unsettled(tx, key)? {
                row.abort_requested = true;
                write_submission(tx, &row)?;
                affected.push(row.id);
            }
            Ok(affected)
        }))
    }

    fn append(
        &self,
        key: &InstanceKey,
        records: Vec<Record>,
        authorization: Option<&AttemptRef>,
    ) -> BoxFuture<'_, Result<u64, StoreError>> {
        ready(self.transaction(|tx| {
            if let Some(attempt) = authorization
                && owns(tx, attempt)?.is_none()
            {
                return Err(StoreError::Fenced(format!(
                    "attempt {} does not own submission {}",
                    attempt.attempt_id, attempt.submission_id
                )));
            }
            append_batch(tx, key, &records)
        }))
    }

    fn read(&self, key: &InstanceKey, after: Option<u64>) -> BoxFuture<'_, Result<Vec<Batch>, StoreError>> {
        ready(self.read_transaction(|tx| {
            let start = after.map_or(0, |after| after as i64 + 1);
            let mut statement = tx
                .prepare_cached(
                    "SELECT offset, records FROM flue_batches WHERE agent = ?1 AND instance_id = ?2 AND offset >= ?3 ORDER BY offset",
                )
                .map_err(sql)?;
            let rows = statement
                .query_map(params![key.agent, key.id, start], |row| Ok((row.get::<_, i64>(0)?, row.get::<_, String>(1)?)))
                .map_err(sql)?;
            rows.map(|row| {
                let (offset, records) = row.map_err(sql)?;
                Ok(Batch { offset: offset as u64, records: serde_json::from_str(&records).map_err(json_error)? })
            })
            .collect()
        }))
    }
}
