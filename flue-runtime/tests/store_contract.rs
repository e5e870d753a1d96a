//! The store contract, run against the memory store and SQLite (Postgres runs it in its own
//! file), plus SQLite's format-version rules.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

mod contract;
mod harness;
mod scratch;

use harness::admission;

use std::sync::Arc;

use flue_runtime::store::{MemoryStore, SqliteStore, Store, StoreError};

contract::store_contract!(memory, || async {
    Some(Arc::new(MemoryStore::new()) as Arc<dyn Store>)
});

contract::store_contract!(sqlite, || async {
    // A real file (WAL needs one): each test its own database.
    let dir = scratch::dir("contract");
    Some(Arc::new(SqliteStore::open(dir.join("flue.db")).unwrap()) as Arc<dyn Store>)
});

/// A record that carries nothing in particular.
fn state_record(i: usize) -> flue_runtime::record::Record {
    flue_runtime::record::Record {
        id: format!("r-{i}"),
        submission_id: None,
        attempt_id: None,
        timestamp: "2026-11-30T00:00:00.000Z".into(),
        body: flue_runtime::record::RecordBody::StateWrite {
            name: "n".into(),
            value: serde_json::json!(i),
        },
    }
}

fn scratch_db() -> std::path::PathBuf {
    scratch::dir("format").join("flue.db")
}

/// A connection of this test's own to the store's file, beside the store's: through the
/// store's VFS (`flue-excl`) once a store has registered it in this process, as every
/// connection of the process must go (another VFS shares the file's lock but not the WAL
/// frames the store holds back), else through `unix-excl`, the VFS under it.
fn raw(path: &std::path::Path) -> rusqlite::Connection {
    // SAFETY: `sqlite3_vfs_find` takes a NUL-terminated name and only looks it up.
    let registered = unsafe { !rusqlite::ffi::sqlite3_vfs_find(c"flue-excl".as_ptr()).is_null() };
    let vfs = if registered { c"flue-excl" } else { c"unix-excl" };
    rusqlite::Connection::open_with_flags_and_vfs(path, rusqlite::OpenFlags::default(), vfs).unwrap()
}

fn meta(path: &std::path::Path) -> Vec<(String, String)> {
    let connection = raw(path);
    let mut statement = connection
        .prepare("SELECT key, value FROM flue_meta ORDER BY key")
        .unwrap();
    statement
        .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

#[test]
fn stamps_a_fresh_store_with_format_version_1() {
    let path = scratch_db();
    SqliteStore::open(&path).unwrap();
    assert_eq!(meta(&path), [("format_version".to_owned(), "1".to_owned())]);
    // Reopening a stamped store works.
    SqliteStore::open(&path).unwrap();
}

#[test]
fn adopts_a_store_stamped_schema_version_8_in_place() {
    let path = scratch_db();
    SqliteStore::open(&path).unwrap();
    let connection = raw(&path);
    connection
        .execute("UPDATE flue_meta SET key = 'schema_version', value = '8'", [])
        .unwrap();
    drop(connection);
    SqliteStore::open(&path).unwrap();
    assert_eq!(meta(&path), [("format_version".to_owned(), "1".to_owned())]);
}

#[tokio::test]
async fn adopting_a_bare_stamp_creates_the_missing_tables() {
    use flue_runtime::store::InstanceKey;
    for (key, value) in [("schema_version", "8"), ("format_version", "1")] {
        let path = scratch_db();
        raw(&path)
            .execute_batch(&format!(
                "CREATE TABLE flue_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL); \
                 INSERT INTO flue_meta VALUES ('{key}', '{value}')"
            ))
            .unwrap();
        let store = SqliteStore::open(&path).unwrap();
        assert_eq!(meta(&path), [("format_version".to_owned(), "1".to_owned())]);
        let instance = InstanceKey::new("assistant", "legacy");
        store.admit(admission(&instance, "d-1", "kept")).await.unwrap();
        assert_eq!(store.read(&instance, None).await.unwrap().len(), 1);
        drop(store);
        // And it opens again as any store does.
        let reopened = SqliteStore::open(&path).unwrap();
        assert!(reopened.submission("d-1").await.unwrap().is_some());
    }
}

#[test]
fn refuses_a_ledger_missing_one_of_its_tables_without_changing_it() {
    // A ledger without its streams is as damaged.
    let path = scratch_db();
    SqliteStore::open(&path).unwrap();
    raw(&path).execute_batch("DROP TABLE flue_batches").unwrap();
    let error = SqliteStore::open(&path).err().expect("refused");
    assert!(
        error.to_string().contains("flue_instances but no flue_batches"),
        "{error}"
    );
    let path = scratch_db();
    SqliteStore::open(&path).unwrap();
    raw(&path).execute_batch("DROP TABLE flue_submissions").unwrap();
    let error = SqliteStore::open(&path).err().expect("refused");
    assert!(
        error.to_string().contains("flue_instances but no flue_submissions"),
        "{error}"
    );
    let tables: i64 = raw(&path)
        .query_row(
            "SELECT COUNT(*) FROM sqlite_master WHERE name = 'flue_submissions'",
            [],
            |row| row.get(0),
        )
        .unwrap();
    assert_eq!(tables, 0, "nothing was made");
}

/// Streams whose ledger was lost (an operator dropped the ledger's tables to clear a queue)
/// are refused as well, and left as they are: a ledger made afresh beside them would drop
/// them, or collide with them at the first new instance.
#[tokio::test]
async fn refuses_batches_without_their_ledger_without_changing_them() {
    use flue_runtime::store::InstanceKey;
    let path = scratch_db();
    let store = SqliteStore::open(&path).unwrap();
    store
        .admit(admission(&InstanceKey::new("assistant", "a"), "d-1", "hi"))
        .await
        .unwrap();
    drop(store);
    raw(&path)
        .execute_batch("DROP TABLE flue_submissions; DROP TABLE flue_instances")
        .unwrap();
    let error = SqliteStore::open(&path).err().expect("refused");
    assert!(
        error.to_string().contains("flue_batches but no flue_instances"),
        "{error}"
    );
    let connection = raw(&path);
    let (tables, batches): (i64, i64) = connection
        .query_row(
            "SELECT (SELECT COUNT(*) FROM sqlite_master WHERE name IN ('flue_instances', 'flue_submissions')), \
                    (SELECT COUNT(*) FROM flue_batches)",
            [],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .unwrap();
    assert_eq!((tables, batches), (0, 1), "nothing was made, nothing dropped");
}

#[test]
fn rejects_a_store_stamped_schema_version_7_without_adopting_it() {
    let path = scratch_db();
    SqliteStore::open(&path).unwrap();
    let connection = raw(&path);
    connection
        .execute("UPDATE flue_meta SET key = 'schema_version', value = '7'", [])
        .unwrap();
    drop(connection);
    let error = SqliteStore::open(&path).err().unwrap();
    assert_eq!(error, StoreError::FormatVersion { stored: "7".into() });
    assert_eq!(
        meta(&path),
        [("schema_version".to_owned(), "7".to_owned())],
        "nothing changed"
    );
}

/// Reference §5.1: only `flue_` tables other than `flue_meta` make an unstamped database
/// unversioned. An empty `flue_meta` alone (a crash right after creating it) is fresh.
#[test]
fn stamps_a_database_holding_only_an_empty_flue_meta_as_fresh() {
    let path = scratch_db();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    raw(&path)
        .execute_batch("CREATE TABLE flue_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);")
        .unwrap();
    SqliteStore::open(&path).unwrap();
    assert_eq!(meta(&path), [("format_version".to_owned(), "1".to_owned())]);
}

/// A database under our stamp whose `flue_` tables are another implementation's layout (its
/// history lives there) is refused without change, not adopted with an empty ledger beside.
#[test]
fn refuses_a_stamped_database_holding_another_layouts_tables_without_changing_it() {
    for (key, value) in [("format_version", "1"), ("schema_version", "8")] {
        let path = scratch_db();
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        raw(&path)
            .execute_batch(&format!(
                "CREATE TABLE flue_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL); \
                 INSERT INTO flue_meta VALUES ('{key}', '{value}'); \
                 CREATE TABLE flue_conversation_streams (path TEXT PRIMARY KEY);"
            ))
            .unwrap();
        let error = SqliteStore::open(&path).err().expect("refused");
        assert!(error.to_string().contains("(flue_conversation_streams)"), "{error}");
        assert_eq!(meta(&path), [(key.to_owned(), value.to_owned())], "nothing changed");
        let tables: i64 = raw(&path)
            .query_row("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table'", [], |row| {
                row.get(0)
            })
            .unwrap();
        assert_eq!(tables, 2, "nothing was made");
    }
}

/// The application's own `flue_`-named tables beside this store's ledger are no other
/// layout: the store opens.
#[test]
fn opens_a_store_beside_the_applications_own_flue_tables() {
    let path = scratch_db();
    SqliteStore::open(&path).unwrap();
    raw(&path)
        .execute_batch("CREATE TABLE flue_sessions (id TEXT);")
        .unwrap();
    SqliteStore::open(&path).unwrap();
}

#[test]
fn rejects_unstamped_flue_tables() {
    let path = scratch_db();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let connection = raw(&path);
    connection
        .execute_batch("CREATE TABLE flue_legacy (x INTEGER);")
        .unwrap();
    drop(connection);
    let error = SqliteStore::open(&path).err().unwrap();
    assert_eq!(
        error,
        StoreError::FormatVersion {
            stored: "unversioned".into()
        }
    );
    assert_eq!(
        error.to_string(),
        "persisted_format_version_unsupported: stored format version \"unversioned\" is not supported (supported: 1)"
    );
}

#[test]
fn a_refused_store_keeps_its_journal_mode() {
    let path = scratch_db();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let connection = raw(&path);
    connection
        .execute_batch(
            "CREATE TABLE flue_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
             INSERT INTO flue_meta (key, value) VALUES ('format_version', '2');",
        )
        .unwrap();
    drop(connection);
    let error = SqliteStore::open(&path).err().unwrap();
    assert_eq!(error, StoreError::FormatVersion { stored: "2".into() });
    let mode: String = raw(&path)
        .query_row("PRAGMA journal_mode", [], |row| row.get(0))
        .unwrap();
    assert_eq!(mode, "delete", "the refused file was switched to WAL");
}

#[tokio::test]
async fn a_claim_reads_only_the_head_of_the_queue() {
    use flue_runtime::store::InstanceKey;
    let path = scratch_db();
    let store = SqliteStore::open(&path).unwrap();
    let key = InstanceKey::new("agent", "queue");
    for id in ["q-1", "q-2", "q-3"] {
        store.admit(admission(&key, id, "hello")).await.unwrap();
    }
    // A row behind the head that no longer parses (hand-edited, or written by a newer build)
    // does not stop the head from being claimed.
    raw(&path)
        .execute("UPDATE flue_submissions SET data = 'not json' WHERE id = 'q-2'", [])
        .unwrap();
    let claim = contract::claim("attempt-1");
    let claimed = store
        .claim_next(&key, &claim)
        .await
        .unwrap()
        .expect("the head is claimed");
    assert_eq!(claimed.id, "q-1");
}

/// A row of a status this build does not know (a later build's, after a rollback) is unsettled
/// work all the same: an admission behind it is queued, not claimed past it.
#[tokio::test]
async fn an_admission_does_not_claim_past_a_row_of_a_status_this_build_does_not_know() {
    use flue_runtime::store::{Admission, InstanceKey};
    let path = scratch_db();
    let key = InstanceKey::new("agent", "later");
    {
        let store = SqliteStore::open(&path).unwrap();
        store.admit(admission(&key, "l-1", "hello")).await.unwrap();
    }
    raw(&path)
        .execute(
            "UPDATE flue_submissions SET status = 'terminalizing' WHERE id = 'l-1'",
            [],
        )
        .unwrap();
    let store = SqliteStore::open(&path).unwrap();
    let claiming = Admission {
        claim: Some(contract::claim("attempt-1")),
        ..admission(&key, "l-2", "again")
    };
    let admitted = store.admit(claiming).await.unwrap();
    assert!(admitted.claimed.is_none(), "{:?}", admitted.claimed);
}

#[tokio::test]
async fn a_conversation_survives_reopening_the_database() {
    use flue_runtime::message::DeliveredMessage;
    use flue_runtime::store::InstanceKey;
    let path = scratch_db();
    let key = InstanceKey::new("assistant", "durable");
    {
        let store = SqliteStore::open(&path).unwrap();
        store.admit(admission(&key, "d-1", "kept")).await.unwrap();
    }
    let reopened = SqliteStore::open(&path).unwrap();
    assert_eq!(
        reopened.submission("d-1").await.unwrap().unwrap().message,
        DeliveredMessage::user("kept")
    );
    assert_eq!(reopened.read(&key, None).await.unwrap().len(), 1);
}

#[tokio::test]
async fn an_attachment_whose_stored_bytes_were_damaged_reads_back_as_an_integrity_error() {
    use flue_runtime::store::{ATTACHMENT_CHUNK_BYTES, AttachmentPut, InstanceKey};
    let path = scratch_db();
    let key = InstanceKey::new("assistant", "pictures");
    let store = SqliteStore::open(&path).unwrap();
    let bytes: Vec<u8> = (0..ATTACHMENT_CHUNK_BYTES + 10).map(|i| (i % 251) as u8).collect();
    for id in ["att-flipped", "att-lost", "att-intact"] {
        store
            .put_attachment(&key, AttachmentPut::new(id, "image/png", bytes.clone()))
            .await
            .unwrap();
    }
    let connection = raw(&path);
    connection
        .execute(
            "UPDATE flue_attachment_chunks SET bytes = zeroblob(length(bytes)) WHERE id = 'att-flipped' AND chunk = 1",
            [],
        )
        .unwrap();
    connection
        .execute(
            "DELETE FROM flue_attachment_chunks WHERE id = 'att-lost' AND chunk = 1",
            [],
        )
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

/// The batches of the current layout in the earlier one, keyed `(agent, instance_id, offset)`.
const KEYED_BATCHES: &str = "
    CREATE TABLE old_batches (agent TEXT NOT NULL, instance_id TEXT NOT NULL,
        offset INTEGER NOT NULL, records TEXT NOT NULL, PRIMARY KEY (agent, instance_id, offset));
    INSERT INTO old_batches SELECT i.agent, i.id, b.position - (i.stream << 32), b.records
        FROM flue_batches b JOIN flue_instances i
            ON b.position >= (i.stream << 32) AND b.position < ((i.stream + 1) << 32);
    DROP TABLE flue_batches;
    ALTER TABLE old_batches RENAME TO flue_batches;";

/// The first format-1 layout: rowid tables beside their keys, two more indexes, an offset
/// counter it maintained (stale here on purpose) and keyed batches.
const FIRST_LAYOUT: &str = "
    CREATE TABLE old_instances (agent TEXT NOT NULL, id TEXT NOT NULL, uid TEXT NOT NULL,
        next_offset INTEGER NOT NULL, PRIMARY KEY (agent, id));
    INSERT INTO old_instances SELECT agent, id, uid, 7 FROM flue_instances;
    CREATE TABLE old_submissions (id TEXT PRIMARY KEY, sequence INTEGER NOT NULL UNIQUE,
        agent TEXT NOT NULL, instance_id TEXT NOT NULL, status TEXT NOT NULL, owner_id TEXT,
        lease_until_ms INTEGER NOT NULL DEFAULT 0, data TEXT NOT NULL);
    INSERT INTO old_submissions SELECT id, sequence, agent, instance_id, status, owner_id,
        lease_until_ms, data FROM flue_submissions;
    DROP TABLE flue_instances; DROP TABLE flue_submissions;
    ALTER TABLE old_instances RENAME TO flue_instances;
    ALTER TABLE old_submissions RENAME TO flue_submissions;
    CREATE INDEX flue_submissions_unsettled ON flue_submissions (agent, instance_id, sequence)
        WHERE status <> 'settled';
    CREATE INDEX flue_submissions_by_status ON flue_submissions (status, agent, instance_id);
    CREATE INDEX flue_submissions_by_owner ON flue_submissions (owner_id, status);";

/// The second: clustered instances without stream numbers, keyed batches.
const SECOND_LAYOUT: &str = "
    CREATE TABLE old_instances (agent TEXT NOT NULL, id TEXT NOT NULL, uid TEXT NOT NULL,
        next_offset INTEGER NOT NULL, PRIMARY KEY (agent, id)) WITHOUT ROWID;
    INSERT INTO old_instances SELECT agent, id, uid, next_offset FROM flue_instances;
    DROP TABLE flue_instances;
    ALTER TABLE old_instances RENAME TO flue_instances;";

#[tokio::test]
async fn reopening_a_store_of_the_first_layout_rebuilds_it_and_keeps_every_row() {
    reopening_an_earlier_layout_keeps_every_row(FIRST_LAYOUT).await;
}

#[tokio::test]
async fn reopening_a_store_with_keyed_batches_numbers_its_streams_and_keeps_every_row() {
    reopening_an_earlier_layout_keeps_every_row(SECOND_LAYOUT).await;
}

async fn reopening_an_earlier_layout_keeps_every_row(layout: &str) {
    use flue_runtime::store::InstanceKey;
    let path = scratch_db();
    let key = InstanceKey::new("assistant", "upgraded");
    let other = InstanceKey::new("assistant", "other");
    {
        let store = SqliteStore::open(&path).unwrap();
        store.admit(admission(&key, "u-1", "hello")).await.unwrap();
        store.admit(admission(&other, "o-1", "hi")).await.unwrap();
        store.append(&other, vec![state_record(9)].into(), None).await.unwrap();
    }
    // Turn the file into what an earlier build of format 1 wrote.
    let connection = raw(&path);
    connection.execute_batch(KEYED_BATCHES).unwrap();
    connection.execute_batch(layout).unwrap();
    drop(connection);

    let reopened = SqliteStore::open(&path).unwrap();
    let connection = raw(&path);
    let names = |kind: &str| -> Vec<String> {
        connection
            .prepare("SELECT name FROM sqlite_master WHERE type = ?1 AND name NOT LIKE 'sqlite_%' ORDER BY name")
            .unwrap()
            .query_map([kind], |row| row.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    };
    assert_eq!(
        names("index"),
        ["flue_submissions_unsettled"],
        "the write-only indexes are gone"
    );
    assert_eq!(
        names("table"),
        [
            "flue_attachment_chunks",
            "flue_attachments",
            "flue_batches",
            "flue_instances",
            "flue_meta",
            "flue_submissions",
            "flue_user_values"
        ],
        "the attachment and user-value tables are added too"
    );
    let clustered: Vec<String> = connection
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table' AND sql LIKE '%WITHOUT ROWID%' ORDER BY name")
        .unwrap()
        .query_map([], |row| row.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(clustered, ["flue_attachments", "flue_instances", "flue_user_values"]);
    let batch_columns: Vec<String> = connection
        .prepare("SELECT name FROM pragma_table_info('flue_batches') ORDER BY cid")
        .unwrap()
        .query_map([], |row| row.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(
        batch_columns,
        ["position", "records"],
        "batches sit at their stream positions"
    );
    assert_eq!(meta(&path), [("format_version".to_owned(), "1".to_owned())]);

    // Every row survived, and the ledger and the streams carry on from them.
    let kept = reopened.submission("u-1").await.unwrap().unwrap();
    assert_eq!(kept.message, flue_runtime::message::DeliveredMessage::user("hello"));
    let admitted = reopened.admit(admission(&key, "u-2", "again")).await.unwrap();
    assert_eq!(admitted.offset, Some(0), "the birth batch is still the last one");
    assert!(
        admitted.submission.sequence > kept.sequence,
        "admission order continues"
    );
    let offset = reopened.append(&key, vec![state_record(1)].into(), None).await.unwrap();
    assert_eq!(offset, 1, "offsets follow the batches, not the stale counter");
    let batches = reopened.read(&key, None).await.unwrap();
    assert_eq!(batches.iter().map(|batch| batch.offset).collect::<Vec<_>>(), [0, 1]);
    let others = reopened.read(&other, None).await.unwrap();
    assert_eq!(
        others.iter().map(|batch| batch.offset).collect::<Vec<_>>(),
        [0, 1],
        "streams stay apart"
    );
    assert_eq!(others[1].records[0].body, state_record(9).body);
    // An instance created after the upgrade gets a stream of its own.
    let newer = InstanceKey::new("assistant", "newer");
    reopened.admit(admission(&newer, "n-1", "new")).await.unwrap();
    assert_eq!(reopened.read(&newer, None).await.unwrap().len(), 1);
    assert_eq!(reopened.read(&key, None).await.unwrap().len(), 2);
    // A second open finds the current layout and changes nothing.
    drop(reopened);
    SqliteStore::open(&path).unwrap();
    assert_eq!(names("index"), ["flue_submissions_unsettled"]);
}

/// The submissions table before it had the `attempt_id` column the append fence reads.
const WITHOUT_ATTEMPT_COLUMN: &str = "
    CREATE TABLE old_submissions (sequence INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE,
        agent TEXT NOT NULL, instance_id TEXT NOT NULL, status TEXT NOT NULL, owner_id TEXT,
        lease_until_ms INTEGER NOT NULL DEFAULT 0, data TEXT NOT NULL);
    INSERT INTO old_submissions SELECT sequence, id, agent, instance_id, status, owner_id,
        lease_until_ms, data FROM flue_submissions;
    DROP TABLE flue_submissions;
    ALTER TABLE old_submissions RENAME TO flue_submissions;
    CREATE INDEX flue_submissions_unsettled ON flue_submissions (agent, instance_id, sequence)
        WHERE status <> 'settled';";

/// Leaves at `path` a store whose submission `run-1` on `key` runs as `attempt-1`.
async fn leave_a_running_attempt(path: &std::path::Path, key: &flue_runtime::store::InstanceKey) {
    let store = SqliteStore::open(path).unwrap();
    store.admit(admission(key, "run-1", "hello")).await.unwrap();
    let claim = contract::claim("attempt-1");
    assert!(store.claim_next(key, &claim).await.unwrap().is_some());
}

/// Reopens the store at `path` and checks that `run-1`'s append fence lets `current` append
/// and fences `stale`.
async fn assert_the_fence_admits_only(
    path: &std::path::Path,
    key: &flue_runtime::store::InstanceKey,
    current: &str,
    stale: &str,
) {
    use flue_runtime::store::AttemptRef;
    let reopened = SqliteStore::open(path).unwrap();
    let attempt = |id: &str| AttemptRef {
        submission_id: "run-1".into(),
        attempt_id: id.into(),
    };
    reopened
        .append(key, vec![state_record(1)].into(), Some(&attempt(current)))
        .await
        .unwrap();
    let fenced = reopened
        .append(key, vec![state_record(2)].into(), Some(&attempt(stale)))
        .await
        .unwrap_err();
    assert!(matches!(fenced, StoreError::Fenced(_)), "{fenced:?}");
}

#[tokio::test]
async fn reopening_a_store_without_the_attempt_column_keeps_a_running_attempts_fence() {
    use flue_runtime::store::InstanceKey;
    // The column missing alone, and the first layout (keyed batches, rowid ledger tables).
    for layouts in [vec![WITHOUT_ATTEMPT_COLUMN], vec![KEYED_BATCHES, FIRST_LAYOUT]] {
        let path = scratch_db();
        let key = InstanceKey::new("assistant", "running");
        leave_a_running_attempt(&path, &key).await;
        let connection = raw(&path);
        for layout in layouts {
            connection.execute_batch(layout).unwrap();
        }
        drop(connection);
        assert_the_fence_admits_only(&path, &key, "attempt-1", "attempt-0").await;
    }
}

#[tokio::test]
async fn reopening_a_store_an_earlier_build_claimed_in_fences_the_attempt_it_recorded() {
    use flue_runtime::store::InstanceKey;
    let path = scratch_db();
    let key = InstanceKey::new("assistant", "reclaimed");
    leave_a_running_attempt(&path, &key).await;
    // A build from before the column takes the submission over: it writes the row's state only.
    let connection = raw(&path);
    let changed = connection
        .execute(
            "UPDATE flue_submissions SET data = json_set(data, '$.attempt_id', 'attempt-2') WHERE id = 'run-1'",
            [],
        )
        .unwrap();
    assert_eq!(changed, 1);
    drop(connection);
    assert_the_fence_admits_only(&path, &key, "attempt-2", "attempt-1").await;
}

/// One transaction larger than the WAL's bound grows the file while it commits; once the WAL
/// restarts, the next commit cuts it back to the bound.
#[tokio::test]
async fn a_wal_grown_by_one_large_commit_is_cut_back_after_its_restart() {
    use flue_runtime::store::InstanceKey;
    let path = scratch_db();
    let key = InstanceKey::new("assistant", "large");
    let store = SqliteStore::open(&path).unwrap();
    let wal = || std::fs::metadata(path.with_extension("db-wal")).unwrap().len();
    let limit = SqliteStore::wal_size_limit(SqliteStore::PAGE_SIZE) as u64;
    store.admit(admission(&key, "l-1", &"x".repeat(8 << 20))).await.unwrap();
    assert!(wal() > limit, "the large commit's WAL is {} bytes", wal());
    // The large commit restarted the WAL; the next commits start it over and cut the file.
    for i in 0..3 {
        store.append(&key, vec![state_record(i)].into(), None).await.unwrap();
    }
    assert!(wal() <= limit, "the WAL is still {} bytes", wal());
    assert_eq!(store.read(&key, None).await.unwrap().len(), 4);
}

#[tokio::test]
async fn the_checkpointer_keeps_the_wal_from_growing_with_every_commit() {
    use flue_runtime::store::InstanceKey;
    let path = scratch_db();
    let key = InstanceKey::new("assistant", "busy");
    let store = SqliteStore::open(&path).unwrap();
    store.admit(admission(&key, "b-1", "hello")).await.unwrap();
    // Past twice the bound at which a commit restarts the WAL, however many frames each adds.
    let commits = 2 * SqliteStore::WAL_RESTART_FRAMES as usize + 100;
    for i in 0..commits {
        store.append(&key, vec![state_record(i)].into(), None).await.unwrap();
    }
    // Each commit adds at least one page frame; without checkpoints the WAL would hold them
    // all. Checkpointed every few hundred commits, it is reused from its start instead.
    let wal = std::fs::metadata(path.with_extension("db-wal")).unwrap().len();
    let unbounded = commits as u64 * u64::from(SqliteStore::PAGE_SIZE);
    assert!(
        wal < unbounded * 2 / 3,
        "the WAL is {wal} bytes after {commits} commits"
    );
    assert_eq!(store.read(&key, None).await.unwrap().len(), commits + 1);
}
