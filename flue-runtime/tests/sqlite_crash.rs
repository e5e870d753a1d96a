//! The SQLite store killed (SIGKILL) at arbitrary moments: a child process appends batches of
//! every size (a few bytes, tens of KiB, a few hundred KiB, so commits of one WAL frame to
//! many, spilled and checkpointed), reports each append once it returned, and idles after every
//! other one; the parent kills it, mid-commit or idle, reopens the file, and checks that every
//! append the child saw return is there, whole, in order, with nothing else but the one append
//! in flight, and that the database is intact. Each round reopens the file the last one left,
//! so the store also recovers from its own crashes over and over.
#![cfg(unix)]
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

mod harness;
mod scratch;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use flue_runtime::record::{Record, RecordBody};
use flue_runtime::store::{InstanceKey, SqliteStore, Store};

const CHILD: &str = "FLUE_SQLITE_CRASH_CHILD";

fn key() -> InstanceKey {
    InstanceKey::new("crash", "appender")
}

/// The records of the batch at `offset` (1 and up; 0 is the instance's birth record): sizes
/// cycle through a few bytes, 40 KB and 300 KB (a commit of about 75 WAL frames).
fn batch(offset: u64) -> Vec<Record> {
    let (count, size) = match offset % 5 {
        0 => (3, 10),
        1 => (1, 40_000),
        2 => (1, 300_000),
        3 => (1, 10),
        _ => (2, 2_000),
    };
    (0..count)
        .map(|index| Record {
            id: format!("record_{offset}_{index}"),
            submission_id: None,
            attempt_id: None,
            timestamp: "2026-12-01T00:00:00.000Z".into(),
            body: RecordBody::StateWrite {
                name: format!("value_{index}"),
                value: serde_json::Value::String(format!("{offset}:{}", "x".repeat(size))),
            },
        })
        .collect()
}

/// The child: appends batches until it is killed, printing `ACK <offset>` after each append
/// returned.
#[tokio::test]
#[ignore = "the child process of every_append_that_returned_survives_a_kill_at_any_moment"]
async fn sqlite_crash_child() {
    use std::io::Write;
    // Only as its parent's child (`--include-ignored` runs it alone: nothing to do then).
    let Ok(dir) = std::env::var(CHILD) else { return };
    let store = SqliteStore::open(Path::new(&dir).join("flue.db")).unwrap();
    let key = key();
    if store.instance(&key).await.unwrap().is_none() {
        store
            .admit(harness::admission(&key, "sub_crash", "append"))
            .await
            .unwrap();
    }
    let mut next = store.read(&key, None).await.unwrap().len() as u64;
    let mut stdout = std::io::stdout();
    writeln!(stdout, "READY {next}").unwrap();
    loop {
        let offset = store.append(&key, batch(next).into(), None).await.unwrap();
        assert_eq!(offset, next);
        writeln!(stdout, "ACK {offset}").unwrap();
        stdout.flush().unwrap();
        if offset % 2 == 0 {
            // Idle after every other append: a kill then lands between commits, where nothing
            // but what the last commit left in the files counts.
            std::thread::sleep(Duration::from_millis(2));
        }
        next += 1;
    }
}

#[test]
fn every_append_that_returned_survives_a_kill_at_any_moment() {
    let dir = scratch::dir("sqlite-crash");
    let mut acknowledged = 0;
    // Kills after 1 to 400 more acknowledged appends, then after a pause of 0 to 3 ms: moments
    // spread over commits, spills, checkpoints (every 300 commits) and restarts of the WAL
    // (every 4,000 frames of 1 KiB: about 13 of the 300 KB batches).
    for (round, (appends, pause)) in [
        (1, 0),
        (7, 1),
        (1, 0),
        (13, 0),
        (1, 0),
        (40, 3),
        (2, 2),
        (1, 0),
        (150, 0),
        (1, 0),
        (31, 1),
        (400, 0),
        (1, 0),
        (5, 2),
    ]
    .into_iter()
    .enumerate()
    {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "sqlite_crash_child",
                "--ignored",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(CHILD, &dir)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.join("child-stderr")).unwrap())
            .spawn()
            .unwrap();
        let (lines, received) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if lines.send(line).is_err() {
                    return;
                }
            }
        });
        let mut seen = Vec::new();
        let mut killed = false;
        while let Ok(line) = received.recv_timeout(Duration::from_secs(60)) {
            if let Some(start) = line.strip_prefix("READY ") {
                let start: u64 = start.parse().unwrap();
                assert_eq!(
                    start,
                    acknowledged + 1,
                    "round {round} starts after every acknowledged append"
                );
            } else if let Some(offset) = line.strip_prefix("ACK ") {
                seen.push(offset.parse::<u64>().unwrap());
            }
            if !killed && seen.len() >= appends {
                std::thread::sleep(Duration::from_millis(pause));
                child.kill().unwrap();
                killed = true;
            }
        }
        assert!(
            killed,
            "round {round}: the child stopped before it was killed:\n{}",
            std::fs::read_to_string(dir.join("child-stderr")).unwrap_or_default()
        );
        child.wait().unwrap();
        reader.join().unwrap();
        // What the child saw return, in order.
        for (index, offset) in seen.iter().enumerate() {
            assert_eq!(*offset, acknowledged + 1 + index as u64, "round {round}");
        }
        acknowledged += seen.len() as u64;

        // Judged on a copy: the next round's child opens the files exactly as the kill left
        // them (closing a store here would checkpoint the WAL away).
        let copy = dir.join(format!("copy-{round}"));
        std::fs::create_dir_all(&copy).unwrap();
        for file in ["flue.db", "flue.db-wal"] {
            if dir.join(file).exists() {
                std::fs::copy(dir.join(file), copy.join(file)).unwrap();
            }
        }
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let batches = runtime.block_on(async {
            let store = SqliteStore::open(copy.join("flue.db")).unwrap();
            store.read(&key(), None).await.unwrap()
        });
        // Every acknowledged batch, whole; beyond them at most appends that committed after
        // the last report.
        assert!(
            batches.len() as u64 > acknowledged,
            "round {round}: {} batches, {acknowledged} acknowledged",
            batches.len()
        );
        for (index, stored) in batches.iter().enumerate().skip(1) {
            assert_eq!(stored.offset, index as u64, "round {round}: the stream has no gap");
            assert_eq!(
                *stored.records,
                *batch(stored.offset),
                "round {round}: batch {}",
                stored.offset
            );
        }
        assert!(
            batches.len() as u64 <= acknowledged + 2,
            "round {round}: at most the one append in flight committed unreported"
        );
        acknowledged = batches.len() as u64 - 1;
        let connection = rusqlite::Connection::open_with_flags_and_vfs(
            copy.join("flue.db"),
            rusqlite::OpenFlags::default(),
            c"unix-excl",
        )
        .unwrap();
        let integrity: String = connection
            .query_row("PRAGMA integrity_check", [], |row| row.get(0))
            .unwrap();
        assert_eq!(integrity, "ok", "round {round}");
        drop(connection);
        std::fs::remove_dir_all(&copy).unwrap();
    }
}
