//! The store contract, run against the memory store and SQLite (Postgres runs it in its own
//! file), plus SQLite's format-version rules.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

mod contract;

use std::sync::Arc;

use flue_runtime::store::{MemoryStore, SqliteStore, Store, StoreError};

contract::store_contract!(memory, || async {
    Some(Arc::new(MemoryStore::new()) as Arc<dyn Store>)
});

contract::store_contract!(sqlite, || async {
    // A real file (WAL needs one): each test its own database.
    let dir = std::env::temp_dir().join(format!("flue-contract-{}", ulid_like()));
    Some(Arc::new(SqliteStore::open(dir.join("flue.db")).unwrap()) as Arc<dyn Store>)
});

fn ulid_like() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::SeqCst))
}

fn scratch_db() -> std::path::PathBuf {
    std::env::temp_dir()
        .join(format!("flue-format-{}", ulid_like()))
        .join("flue.db")
}

fn meta(path: &std::path::Path) -> Vec<(String, String)> {
    let connection = rusqlite::Connection::open(path).unwrap();
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
    let connection = rusqlite::Connection::open(&path).unwrap();
    connection
        .execute("UPDATE flue_meta SET key = 'schema_version', value = '8'", [])
        .unwrap();
    drop(connection);
    SqliteStore::open(&path).unwrap();
    assert_eq!(meta(&path), [("format_version".to_owned(), "1".to_owned())]);
}

#[test]
fn rejects_a_store_stamped_schema_version_7_without_adopting_it() {
    let path = scratch_db();
    SqliteStore::open(&path).unwrap();
    let connection = rusqlite::Connection::open(&path).unwrap();
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

#[test]
fn rejects_unstamped_flue_tables() {
    let path = scratch_db();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let connection = rusqlite::Connection::open(&path).unwrap();
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

#[tokio::test]
async fn a_conversation_survives_reopening_the_database() {
    use flue_runtime::message::DeliveredMessage;
    use flue_runtime::store::{Admission, InstanceKey, SubmissionKind, UidCondition};
    let path = scratch_db();
    let key = InstanceKey::new("assistant", "durable");
    {
        let store = SqliteStore::open(&path).unwrap();
        store
            .admit(Admission {
                key: key.clone(),
                submission_id: "d-1".into(),
                keyed: false,
                kind: SubmissionKind::Dispatch,
                message: DeliveredMessage::user("kept"),
                initial_data: None,
                uid: UidCondition::Any,
                max_attempts: 10,
                timeout_ms: 3_600_000,
            })
            .await
            .unwrap();
    }
    let reopened = SqliteStore::open(&path).unwrap();
    assert_eq!(
        reopened.submission("d-1").await.unwrap().unwrap().message,
        DeliveredMessage::user("kept")
    );
    assert_eq!(reopened.read(&key, None).await.unwrap().len(), 1);
}
