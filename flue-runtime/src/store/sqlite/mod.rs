//! The embedded default store: SQLite (compiled in), one file, WAL.
//!
//! Durability setting: WAL journal with `synchronous = NORMAL`. Every durability point is one
//! transaction; a committed transaction survives a crash of the process (the WAL is written
//! before the commit returns), while a power loss may lose the last transactions before the
//! next checkpoint. Checkpoints fsync (the WAL, then the database file); they run on a
//! checkpointer thread with its own connection, so a commit waits for a disk flush only in the
//! checkpoint the writer runs itself once per [`SqliteStore::WAL_RESTART_FRAMES`] WAL frames
//! (see [`Checkpointer`]), and in the next commit, which starts the WAL over and syncs its new
//! header (SQLite does, so a crash cannot mix the old WAL's frames into the new one): a stall
//! of three fsyncs, a few milliseconds on a virtual disk, about once per 200 exchanges of the
//! `turn_overhead` benchmark. Statements are
//! prepared once per connection (rusqlite's statement cache), `BEGIN` and `COMMIT` included.
//! [`SqliteStore::with_full_sync`] makes every commit wait for its WAL frames to reach the
//! disk (`synchronous = FULL`), so a committed transaction survives a power loss or an OS
//! crash too, at one fsync per durability point.
//!
//! The file belongs to one runtime process: on Unix its connections use SQLite's `unix-excl`
//! VFS, which locks the file exclusively for the process and lets the process's connections
//! coordinate in memory, so a transaction makes no file-lock system calls. The process also
//! holds a `flock` on `<database>-lock` beside it, which survives what releases SQLite's lock
//! (see `ProcessLock`). Another process opening the file meanwhile fails with a clear error;
//! several runtime processes share a Postgres store. Elsewhere the connections use SQLite's
//! default VFS and its usual locking. Code in the same process that opens the file itself must
//! open it through the store's VFS, `flue-excl` (registered once a store is open): a
//! connection through another VFS shares the process's lock but not the WAL frames the store
//! holds back (see `vfs`), which could be written over its commits.
//!
//! Submission rows keep their full state as JSON beside the columns that queries filter on,
//! so every transition is the same read-modify-write the memory store performs, inside one
//! `BEGIN IMMEDIATE` transaction.
//!
//! Beside the file, the store keeps an index of its ledger (`index`): the running attempt of
//! each unsettled submission, each instance's queued and joined counts, each stream's end and
//! the next sequence. Every write keeps it, a transaction that does not commit puts it back,
//! and another connection's commit makes the store read it again. So an append is one
//! statement, its insert, and a turn boundary asks SQLite nothing.

use std::path::Path;
use std::sync::Arc;
use std::sync::{Mutex, MutexGuard};

use flue_core::BoxFuture;
use flue_core::lifecycle::{UserValue, UserValuePage, UserValuesQuery};
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};
use serde_json::Value;

use super::attachments::{MAX_READ_RESERVATION, conflict};
use super::{
    ATTACHMENT_CHUNK_BYTES, Admission, Admitted, AttachmentPut, AttemptRef, Claim, InstanceInfo, InstanceKey, Store,
    StoreError, StoredAttachment, Submission, SubmissionStatus,
};
use crate::record::{Batch, Outcome, Record, SettlementError, new_id};

mod index;
#[cfg(unix)]
mod vfs;

use index::{Index, IndexTx};

/// The persisted format this build reads and writes.
pub const FORMAT_VERSION: &str = "1";

/// The `flue_` tables of this build's layout of the format (SQLite and Postgres alike).
pub(crate) const OWN_TABLES: [&str; 7] = [
    "flue_meta",
    "flue_instances",
    "flue_submissions",
    "flue_batches",
    "flue_attachments",
    "flue_attachment_chunks",
    "flue_user_values",
];

/// Refuses a database stamped with a format this build reads that holds `flue_` tables of
/// another layout instead of this one's ledger (another implementation of the format wrote
/// it, under the same stamp): adopting it would create an empty ledger beside that one's
/// history. Tables of the application's own beside this build's ledger are left alone.
/// Nothing is changed.
pub(crate) fn check_own_layout(tables: &[String]) -> Result<(), StoreError> {
    const LEDGER: [&str; 3] = ["flue_instances", "flue_submissions", "flue_batches"];
    if tables.iter().any(|table| LEDGER.contains(&table.as_str())) {
        return Ok(());
    }
    let foreign: Vec<&str> = tables
        .iter()
        .map(String::as_str)
        .filter(|table| !OWN_TABLES.contains(table))
        .collect();
    if foreign.is_empty() {
        return Ok(());
    }
    Err(StoreError::Other(format!(
        "the database holds tables of another layout of the persisted format ({}): another implementation \
         wrote it, and this store cannot read it; nothing was changed",
        foreign.join(", ")
    )))
}

/// Whether a database with these `flue_` tables and no format stamp is fresh: none but an
/// empty `flue_meta` (a crash right after creating it), which the stamp then goes into.
pub(crate) fn is_fresh(tables: &[String]) -> bool {
    tables.iter().all(|table| table == "flue_meta")
}

/// A [`Store`] in one SQLite file.
pub struct SqliteStore {
    db: Mutex<Db>,
    /// Nudges the checkpointer thread (file databases only); dropping it (after the writing
    /// connection) stops the thread and waits for its last checkpoint, and then closes the
    /// file's last connection, which checkpoints what is left of the WAL: dropping a store
    /// blocks for those (a few milliseconds).
    checkpointer: Option<Checkpointer>,
    /// The file's process lock (file databases on Unix), released after the connections close.
    #[cfg(unix)]
    _process_lock: Option<ProcessLock>,
    /// The database's files, known to this process as a store's (file databases on Unix).
    #[cfg(unix)]
    _files: Option<StoreFiles>,
}

/// The files of the databases this process's stores have open (the database and its WAL), by
/// device and inode, with how many stores hold each.
#[cfg(unix)]
static STORE_FILES: Mutex<Vec<(FileKey, usize)>> = Mutex::new(Vec::new());

/// Whether the file of `device` and `inode` is a database file (or its WAL) a store of this
/// process has open. Code of this process must not open it by other means: its close would
/// release `unix-excl`'s lock (a POSIX lock belongs to the process, and the close of any of
/// its descriptors of the file drops it), and another process (a `sqlite3` shell, a backup
/// tool) could then open the database beside the store. The local sandbox's file tools refuse
/// it.
#[cfg(unix)]
pub(crate) fn is_store_file(device: u64, inode: u64) -> bool {
    locked(&STORE_FILES).iter().any(|(key, _)| *key == (device, inode))
}

/// A store's entries in [`STORE_FILES`], removed when it drops.
#[cfg(unix)]
struct StoreFiles(Vec<FileKey>);

#[cfg(unix)]
impl StoreFiles {
    /// The database at `path` and its WAL (those that exist).
    fn of(path: &Path) -> Self {
        use std::os::unix::fs::MetadataExt;
        let mut wal = path.as_os_str().to_owned();
        wal.push("-wal");
        let keys: Vec<FileKey> = [path.to_path_buf(), std::path::PathBuf::from(wal)]
            .iter()
            .filter_map(|file| std::fs::metadata(file).ok())
            .map(|metadata| (metadata.dev(), metadata.ino()))
            .collect();
        let mut files = locked(&STORE_FILES);
        for key in &keys {
            match files.iter_mut().find(|(held, _)| held == key) {
                Some((_, holders)) => *holders += 1,
                None => files.push((*key, 1)),
            }
        }
        Self(keys)
    }
}

#[cfg(unix)]
impl Drop for StoreFiles {
    fn drop(&mut self) {
        let mut files = locked(&STORE_FILES);
        for key in &self.0 {
            if let Some(index) = files.iter().position(|(held, _)| held == key) {
                files[index].1 -= 1;
                if files[index].1 == 0 {
                    files.swap_remove(index);
                }
            }
        }
    }
}

/// The database file's lock for this process, beside SQLite's own: `flock` on the file
/// `<database>-lock` next to it, through a descriptor the process keeps open while any store
/// of it has the database open (shared by those stores).
///
/// `unix-excl` holds a POSIX lock, which the process loses when it closes *any* descriptor of
/// the database file: code of the process that opens the file by other means and closes it (a
/// sandbox's file tool reading `.flue/flue.db`, a backup that copies it) would let another
/// runtime process open it beside this one, each with a WAL index of its own, and the two
/// would overwrite each other's frames. A `flock` belongs to its open file description, which
/// no other descriptor's close releases, so a second process's store still finds the file
/// taken and says so. It is taken on a file of its own: on the BSDs (macOS included) `flock`
/// and `fcntl` locks of one file conflict, and NFS emulates `flock` with `fcntl` locks, so a
/// `flock` on the database would refuse SQLite its own lock. A filesystem without `flock`
/// leaves the store with SQLite's lock alone (a warning says so).
#[cfg(unix)]
struct ProcessLock {
    /// `None` where the filesystem has no `flock`.
    file: Option<FileKey>,
}

/// A file, by device and inode.
#[cfg(unix)]
type FileKey = (u64, u64);

/// The process locks held, with how many stores hold each.
#[cfg(unix)]
static PROCESS_LOCKS: Mutex<Vec<(FileKey, std::fs::File, usize)>> = Mutex::new(Vec::new());

#[cfg(unix)]
impl ProcessLock {
    /// How long a store waits for a process that holds the file to end.
    const BUSY_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

    /// Takes the lock of the database at `path`, waiting up to [`Self::BUSY_WAIT`] for a
    /// process that holds it; a store of this process that holds it already shares it.
    fn take(path: &Path) -> Result<Self, StoreError> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::MetadataExt;
        let mut lock_path = path.as_os_str().to_owned();
        lock_path.push("-lock");
        let lock_path = std::path::PathBuf::from(lock_path);
        let cannot =
            |error: std::io::Error| StoreError::Other(format!("sqlite: cannot open {}: {error}", lock_path.display()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(cannot)?;
        let metadata = file.metadata().map_err(cannot)?;
        let key = (metadata.dev(), metadata.ino());
        let deadline = std::time::Instant::now() + Self::BUSY_WAIT;
        loop {
            {
                // Held only to look and to try, not while waiting: another store's open or
                // drop in this process does not wait for this one.
                let mut locks = locked(&PROCESS_LOCKS);
                if let Some((_, _, holders)) = locks.iter_mut().find(|(held, ..)| *held == key) {
                    *holders += 1;
                    return Ok(Self { file: Some(key) });
                }
                // SAFETY: a plain call on the descriptor `file` owns.
                if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                    locks.push((key, file, 1));
                    return Ok(Self { file: Some(key) });
                }
            }
            let error = std::io::Error::last_os_error();
            match error.raw_os_error() {
                Some(code) if code == libc::EWOULDBLOCK => {}
                Some(code) if code == libc::EOPNOTSUPP || code == libc::ENOLCK || code == libc::ENOSYS => {
                    tracing::warn!(path = %lock_path.display(), %error, "sqlite: this filesystem has no flock: the store relies on SQLite's lock alone, which code of this process that closes a descriptor of the database file releases");
                    return Ok(Self { file: None });
                }
                _ => return Err(cannot(error)),
            }
            if std::time::Instant::now() >= deadline {
                return Err(StoreError::Other(format!("sqlite: {LOCKED}")));
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}

#[cfg(unix)]
impl Drop for ProcessLock {
    fn drop(&mut self) {
        let Some(file) = self.file else { return };
        let mut locks = locked(&PROCESS_LOCKS);
        if let Some(index) = locks.iter().position(|(held, ..)| *held == file) {
            locks[index].2 -= 1;
            if locks[index].2 == 0 {
                // The last store of the database is closed: closing the descriptor releases
                // the lock.
                locks.swap_remove(index);
            }
        }
    }
}

/// The writing connection and what the store knows of the ledger in it (its [`Index`]),
/// behind one lock.
///
/// Another connection's commit (another store on the same file: a test's, or another
/// process's where the file is not locked for one) makes the index stale; the store notices
/// through SQLite's two data-version counters and reads the index again.
struct Db {
    connection: Connection,
    index: Index,
    /// The pager's data version ([`pager_version`]) when the index was last known true;
    /// `None` after a write transaction failed on SQLite's side (a constraint the index should
    /// have prevented, an I/O error): the next transaction, or the next look outside one
    /// ([`Db::fresh_index`]), reads the index again whatever the version.
    pager_version: Option<u32>,
    /// `PRAGMA data_version` when the index was last known true.
    data_version: i64,
    /// Where rows and batches are written as JSON before they are bound: kept from one
    /// transaction to the next, so a write does not grow a string of its own (SQLite copies
    /// the text it binds).
    json: Vec<u8>,
}

impl Db {
    /// The index, read again from the file first when another connection committed since it
    /// was last known true, or a failed write left it in doubt: for a look outside a
    /// transaction (it then describes the file as of the call).
    fn fresh_index(&mut self) -> Result<&Index, StoreError> {
        let version = data_version(&self.connection)?;
        if version != self.data_version || self.pager_version.is_none() {
            // As at open, the versions are read before the index: a commit in between makes
            // the next look read it again, never miss it.
            let pager = pager_version(&self.connection)?;
            self.index = Index::load(&self.connection)?;
            self.data_version = version;
            self.pager_version = Some(pager);
        }
        Ok(&self.index)
    }
}

/// In a write transaction, after `BEGIN IMMEDIATE` (which read the WAL's header): reads
/// `index` again when the pager's data version moved past `known`. The pager counts its own
/// commits too, so `known` is taken again after each (see [`SqliteStore::run`]).
fn refresh(connection: &Connection, index: &mut Index, known: &mut Option<u32>) -> Result<(), StoreError> {
    let version = pager_version(connection)?;
    if *known != Some(version) {
        *index = Index::load(connection)?;
        *known = Some(version);
    }
    Ok(())
}

/// The connection's `PRAGMA data_version`: changes when another connection commits; read
/// outside a transaction, it looks at the file.
fn data_version(connection: &Connection) -> Result<i64, StoreError> {
    connection
        .prepare_cached("PRAGMA data_version")
        .and_then(|mut statement| statement.query_row([], |row| row.get(0)))
        .map_err(sql)
}

/// The main database pager's data version (`SQLITE_FCNTL_DATA_VERSION`): changes with every
/// commit, this connection's own included, and when a transaction finds that another
/// connection committed. A field read, where `PRAGMA data_version` costs a statement.
fn pager_version(connection: &Connection) -> Result<u32, StoreError> {
    let mut version: u32 = 0;
    // SAFETY: the handle is the connection's open database, used on this thread while the
    // store's lock is held; the file control writes one `unsigned int` through the pointer,
    // which points to `version`, alive for the call.
    let code = unsafe {
        rusqlite::ffi::sqlite3_file_control(
            connection.handle(),
            c"main".as_ptr(),
            rusqlite::ffi::SQLITE_FCNTL_DATA_VERSION,
            (&raw mut version).cast(),
        )
    };
    if code != rusqlite::ffi::SQLITE_OK {
        return Err(StoreError::Other(format!(
            "sqlite: cannot read the data version (code {code})"
        )));
    }
    Ok(version)
}

/// A transaction: its connection (which it derefs to) and its view of the index, whose
/// changes are undone unless the transaction commits.
struct Tx<'c> {
    connection: &'c Connection,
    index: IndexTx<'c>,
    json: std::cell::RefCell<&'c mut Vec<u8>>,
}

/// The JSON buffer's capacity past which it is not kept (a row or batch carrying images).
const JSON_KEPT_BYTES: usize = 256 * 1024;

impl Tx<'_> {
    /// `value` (the `what` being written) as JSON, in the transaction's buffer, handed to
    /// `with`; refused if it nests deeper than a read takes back. (A `with` that asks for JSON
    /// itself gets a buffer of its own.)
    fn with_json<T>(
        &self,
        value: &(impl serde::Serialize + ?Sized),
        what: &str,
        with: impl FnOnce(JsonText<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let Ok(mut buffer) = self.json.try_borrow_mut() else {
            let text = serde_json::to_string(value).map_err(json_error)?;
            super::storable(text.as_bytes(), what)?;
            return with(JsonText(text.as_bytes()));
        };
        buffer.clear();
        let result = serde_json::to_writer(&mut **buffer, value)
            .map_err(json_error)
            .and_then(|()| super::storable(&buffer, what))
            .and_then(|()| with(JsonText(&buffer)));
        if buffer.capacity() > JSON_KEPT_BYTES {
            **buffer = Vec::new();
        }
        result
    }
}

/// JSON that serde_json wrote, bound as SQLite text as it is: serde_json writes UTF-8 only,
/// so the bytes are not checked again on the way in.
#[derive(Clone, Copy)]
struct JsonText<'a>(&'a [u8]);

impl JsonText<'_> {
    fn len(self) -> usize {
        self.0.len()
    }
}

impl rusqlite::ToSql for JsonText<'_> {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        Ok(rusqlite::types::ToSqlOutput::Borrowed(rusqlite::types::ValueRef::Text(
            self.0,
        )))
    }
}

impl std::ops::Deref for Tx<'_> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        self.connection
    }
}

/// Commits between checkpoint requests: roughly 1,000 WAL frames at the three or four frames
/// of an exchange's average commit.
const COMMITS_PER_CHECKPOINT: u32 = 300;

thread_local! {
    /// The WAL's length in frames after the last commit on this thread: the writing
    /// connection's WAL hook, which runs inside `COMMIT`, sets it.
    static WAL_FRAMES: std::cell::Cell<std::ffi::c_int> = const { std::cell::Cell::new(0) };
}

/// Copies the WAL back into the database file off the committing thread.
///
/// Every [`COMMITS_PER_CHECKPOINT`] commits the writing connection asks this thread for a
/// passive checkpoint, which never blocks a writer and does the copying and the fsyncs. SQLite
/// reuses the WAL from its start only after a checkpoint that caught up with its end, which a
/// background checkpoint under steady writes may never do. So when a commit finds the WAL at
/// [`SqliteStore::WAL_RESTART_FRAMES`], the writing connection runs a restart checkpoint itself
/// ([`Checkpointer::committed`]): it waits for a background checkpoint in progress to end (on
/// this thread's connection lock, not in SQLite's sleeping busy handler), copies the frames
/// left and makes the next commit start the WAL over. The WAL stays under that size whatever
/// the threads' timing.
///
/// A background checkpoint beside a writer that starts the WAL over needs SQLite 3.51.3 or
/// later (the bundled one is): before it, a checkpoint that read the WAL index just before the
/// writer started the WAL over could record the old WAL's frames as copied in the new one, and
/// every connection then read later commits' pages stale from the database file (SQLite's
/// "WAL-reset bug"; `vfs`'s tests check the version and the race).
struct Checkpointer {
    /// `None` once dropped: the thread then makes its last checkpoint and ends.
    requests: Option<std::sync::mpsc::SyncSender<()>>,
    commits: std::sync::atomic::AtomicU32,
    /// The checkpointing connection, held while it checkpoints.
    connection: Arc<Mutex<Connection>>,
    /// Joined on drop: a store dropped has closed the file (another process, or a store opened
    /// next in this one, finds it free).
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        drop(self.requests.take());
        if let Some(thread) = self.thread.take() {
            // A panic of the thread (a poisoned lock) was already reported by it.
            let _ = thread.join();
        }
    }
}

impl Checkpointer {
    fn start(path: &Path) -> Result<Self, StoreError> {
        let connection = open_exclusive(path)?;
        connection
            .busy_timeout(std::time::Duration::from_secs(5))
            .map_err(sql)?;
        let connection = Arc::new(Mutex::new(connection));
        let (requests, pending) = std::sync::mpsc::sync_channel::<()>(1);
        let checkpointing = connection.clone();
        let thread = std::thread::Builder::new()
            .name("flue-sqlite-checkpoint".into())
            .spawn(move || {
                // Ends when the store (the sender) is dropped, after a last checkpoint.
                while pending.recv().is_ok() {
                    checkpoint(&locked(&checkpointing), PASSIVE);
                }
                checkpoint(&locked(&checkpointing), PASSIVE);
            })
            .map_err(|error| StoreError::Other(format!("sqlite: cannot start the checkpointer: {error}")))?;
        Ok(Self {
            requests: Some(requests),
            commits: std::sync::atomic::AtomicU32::new(0),
            connection,
            thread: Some(thread),
        })
    }

    /// After each commit of the writing connection (`writer`, still locked by the caller).
    fn committed(&self, writer: &Connection) {
        if WAL_FRAMES.replace(0) >= SqliteStore::WAL_RESTART_FRAMES {
            // No background checkpoint runs while this lock is held.
            let _idle = locked(&self.connection);
            // The commit itself succeeded; a failed restart is retried by the next commit.
            checkpoint(writer, RESTART);
            return;
        }
        let commits = self.commits.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if commits.is_multiple_of(COMMITS_PER_CHECKPOINT) {
            // Full means a request is already pending: that checkpoint covers this one too.
            if let Some(requests) = &self.requests {
                let _ = requests.try_send(());
            }
        }
    }
}

/// Whether the SQLite of `version` ([`rusqlite::version_number`]) may checkpoint on a thread
/// of its own beside the writer: from 3.51.3 on (see [`Checkpointer`]). The bundled SQLite is
/// that new; one linked from the system instead (`LIBSQLITE3_SYS_USE_PKG_CONFIG`, or a crate
/// of the build turning on `libsqlite3-sys`'s `sqlcipher`) may not be.
fn checkpoints_in_background(version: i32) -> bool {
    version >= 3_051_003
}

/// The writing connection's WAL hook: notes the WAL's length for [`Checkpointer::committed`].
fn note_wal_frames(_wal: &rusqlite::hooks::Wal, frames: std::ffi::c_int) -> rusqlite::Result<()> {
    WAL_FRAMES.set(frames);
    Ok(())
}

/// Opens a connection to the file at `path` through SQLite's `unix-excl` VFS (with each
/// commit's WAL frames written in one call, see [`vfs`]): the first lock any connection takes
/// is an exclusive lock on the file for this process, held until its last connection closes,
/// and from then on the connections of this process coordinate in memory (the WAL index lives
/// on the heap, not in a shared `-shm` file). A transaction then makes no `fcntl` lock calls at
/// all, where the default VFS makes six or seven. Another process cannot use the file
/// meanwhile: a second runtime on the same database fails to open it (after the busy timeout)
/// instead of processing its instances beside this one (several nodes share a Postgres store).
/// The lock is a POSIX one, held by the process: code in it that opens the database file by
/// other means and closes it releases the lock (SQLite's own connections do not).
#[cfg(unix)]
fn open_exclusive(path: &Path) -> Result<Connection, StoreError> {
    vfs::register().map_err(StoreError::Other)?;
    Connection::open_with_flags_and_vfs(path, rusqlite::OpenFlags::default(), vfs::NAME).map_err(sql)
}

/// Without `unix-excl`: SQLite's default VFS, whose file locks let several processes share the
/// file (each transaction then pays for its lock calls).
#[cfg(not(unix))]
fn open_exclusive(path: &Path) -> Result<Connection, StoreError> {
    Connection::open(path).map_err(sql)
}

/// How SQLite reports a lock it could not take within the busy timeout.
const LOCKED: &str = "database is locked";

fn locked<T>(value: &Mutex<T>) -> MutexGuard<'_, T> {
    value.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

const PASSIVE: &str = "PRAGMA wal_checkpoint(PASSIVE)";
const RESTART: &str = "PRAGMA wal_checkpoint(RESTART)";

fn checkpoint(connection: &Connection, pragma: &str) {
    if let Err(error) = connection.query_row(pragma, [], |_| Ok(())) {
        tracing::warn!(%error, pragma, "sqlite checkpoint failed; the next one retries");
    }
}

/// The instance and submission tables of format version 1 (`suffix` names them apart while
/// an older layout is rebuilt); with [`BATCHES_TABLE`] and [`UNSETTLED_INDEX`], the schema.
///
/// Every B-tree a commit touches costs a WAL frame (two writes), so the layout keeps them
/// few. Instances are a `WITHOUT ROWID` table clustered on their key (one B-tree, not a table
/// plus a key index). Each instance has a `stream` number (the admission sequence of the
/// submission that created it, so unique), and its batches are the rows of one rowid table
/// keyed `stream << 32 | offset`: an append touches one B-tree, and the rows stay in a table
/// leaf's roomy payload (up to 989 bytes of a row in a 1 KiB page, where a clustered text
/// key's row overflows past about 230).
/// A submission's admission order is its rowid. Settled submissions leave the one partial
/// index (the ledger's queries — an instance's queue, the node-wide scans for queued work and
/// expired leases — read unsettled rows only). An instance's next offset is one past its last
/// batch rather than a counter every append rewrites (`flue_instances.next_offset` is kept for
/// the layout but no longer maintained).
fn ledger_tables(suffix: &str) -> String {
    format!(
        "
CREATE TABLE flue_instances{suffix} (
    agent TEXT NOT NULL,
    id TEXT NOT NULL,
    uid TEXT NOT NULL,
    next_offset INTEGER NOT NULL,
    stream INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (agent, id)
) WITHOUT ROWID;
CREATE TABLE flue_submissions{suffix} (
    sequence INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    agent TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    status TEXT NOT NULL,
    owner_id TEXT,
    lease_until_ms INTEGER NOT NULL DEFAULT 0,
    data TEXT NOT NULL,
    attempt_id TEXT
);
"
    )
}

/// The record streams: one row per batch, at `stream << 32 | offset` (see [`ledger_tables`]).
const BATCHES_TABLE: &str = "
CREATE TABLE flue_batches (
    position INTEGER PRIMARY KEY,
    records TEXT NOT NULL
);
";

/// Where an instance's stream starts among the batches' positions.
fn stream_start(stream: i64) -> i64 {
    stream << 32
}

/// How many batches one instance's stream can hold (its offsets are the position's low bits).
const STREAM_CAPACITY: u64 = 1 << 32;

/// Attachments (what identifies each, and its bytes in chunks of at most
/// [`ATTACHMENT_CHUNK_BYTES`]) and user values (by user, in key order). Added to format 1
/// without changing it (created when missing).
const ATTACHMENT_TABLES: &str = "
CREATE TABLE IF NOT EXISTS flue_attachments (
    id TEXT PRIMARY KEY,
    agent TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    media_type TEXT NOT NULL,
    size INTEGER NOT NULL,
    digest TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS flue_attachment_chunks (
    id TEXT NOT NULL,
    chunk INTEGER NOT NULL,
    bytes BLOB NOT NULL,
    PRIMARY KEY (id, chunk)
);
CREATE TABLE IF NOT EXISTS flue_user_values (
    user_id TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    updated_at INTEGER NOT NULL,
    PRIMARY KEY (user_id, key)
) WITHOUT ROWID;
";

/// The ledger's one index (created once its table has its final name).
const UNSETTLED_INDEX: &str = "CREATE INDEX flue_submissions_unsettled ON flue_submissions (agent, instance_id, sequence) WHERE status <> 'settled';";

/// Brings a format-1 database of an earlier build to the current layout, in place: drops the
/// indexes that only slowed writes, rebuilds the instances and submissions tables of the first
/// layout, gives submissions the `attempt_id` column the append fence reads (filled from each
/// row's state, and refilled for unsettled rows an earlier build may have claimed), and
/// numbers the streams of a layout whose batches were keyed by instance. The rows are kept
/// unchanged.
fn upgrade_layout(transaction: &rusqlite::Transaction<'_>) -> Result<(), StoreError> {
    create_missing_tables(transaction)?;
    transaction
        .execute_batch(
            "DROP INDEX IF EXISTS flue_submissions_by_status; DROP INDEX IF EXISTS flue_submissions_by_owner;",
        )
        .map_err(sql)?;
    transaction.execute_batch(ATTACHMENT_TABLES).map_err(sql)?;
    let rebuilt = !table_sql(transaction, "flue_instances")?.contains("WITHOUT ROWID");
    if rebuilt {
        rebuild_ledger(transaction)?;
    }
    let attempt_column = table_sql(transaction, "flue_submissions")?.contains("attempt_id");
    if !attempt_column {
        transaction
            .execute_batch("ALTER TABLE flue_submissions ADD COLUMN attempt_id TEXT;")
            .map_err(sql)?;
    }
    if rebuilt || !attempt_column {
        // The column the append fence reads, from the rows' own state (a damaged row, whose
        // state SQLite cannot read, gets none: the store reads it as unreadable anyway).
        transaction
            .execute_batch(
                "UPDATE flue_submissions
                 SET attempt_id = CASE WHEN json_valid(data) THEN json_extract(data, '$.attempt_id') END;",
            )
            .map_err(sql)?;
    } else {
        // A build from before the column may have written the file since: it claimed and
        // settled through the rows' state alone. The unsettled rows' fence follows their state.
        // A damaged row is left as it is (`json_extract` fails the statement on text that is
        // not JSON, and the store would not open): the store reads it as unreadable.
        transaction
            .execute_batch(
                "UPDATE flue_submissions
                 SET attempt_id = CASE WHEN json_valid(data) THEN json_extract(data, '$.attempt_id') ELSE attempt_id END
                 WHERE status <> 'settled'
                   AND attempt_id IS NOT CASE WHEN json_valid(data) THEN json_extract(data, '$.attempt_id') ELSE attempt_id END;",
            )
            .map_err(sql)?;
    }
    if table_sql(transaction, "flue_batches")?.contains("position") {
        return Ok(());
    }
    number_streams(transaction)
}

/// A stamped database may lack tables (a bare stamp, or a build that made its tables as it
/// first needed them): the missing ones are made in the current layout, as a fresh database
/// has them; the present ones are upgraded after.
fn create_missing_tables(transaction: &rusqlite::Transaction<'_>) -> Result<(), StoreError> {
    let exists = |table: &str| -> Result<bool, StoreError> {
        transaction
            .query_row(
                "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1)",
                [table],
                |row| row.get(0),
            )
            .map_err(sql)
    };
    let (instances, submissions) = (exists("flue_instances")?, exists("flue_submissions")?);
    let batches = exists("flue_batches")?;
    // Streams without the ledger their batches belong to (every batch is an instance's): the
    // ledger was lost, and a ledger made afresh beside them would drop them (an earlier
    // layout's, renumbered by instance) or collide with them (the first new stream's).
    if !instances && batches {
        let any: bool = transaction
            .query_row("SELECT EXISTS (SELECT 1 FROM flue_batches)", [], |row| row.get(0))
            .map_err(sql)?;
        if any {
            return Err(StoreError::Other(
                "sqlite: the database has batches in flue_batches but no flue_instances: it is not a flue store this build can open; nothing was changed"
                    .into(),
            ));
        }
    }
    match (instances, submissions) {
        (false, false) => {
            transaction.execute_batch(&ledger_tables("")).map_err(sql)?;
            transaction.execute_batch(UNSETTLED_INDEX).map_err(sql)?;
        }
        (true, true) => {}
        // Instances without their submissions (or the reverse) were never written by any
        // build: making the other half would pass off a damaged ledger as a sound one.
        _ => {
            let (present, missing) = if instances {
                ("flue_instances", "flue_submissions")
            } else {
                ("flue_submissions", "flue_instances")
            };
            return Err(StoreError::Other(format!(
                "sqlite: the database has {present} but no {missing}: it is not a flue store this build can open"
            )));
        }
    }
    match (instances, batches) {
        (false, false) => transaction.execute_batch(BATCHES_TABLE).map_err(sql)?,
        // A ledger without its streams: every instance has a birth batch, so they were lost
        // (and an earlier layout's instances would all be given stream 0 here).
        (true, false) => {
            return Err(StoreError::Other(
                "sqlite: the database has flue_instances but no flue_batches: it is not a flue store this build can open"
                    .into(),
            ));
        }
        _ => {}
    }
    Ok(())
}

/// The `CREATE TABLE` statement a table was made with.
fn table_sql(transaction: &rusqlite::Transaction<'_>, table: &str) -> Result<String, StoreError> {
    transaction
        .query_row(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?1",
            [table],
            |row| row.get(0),
        )
        .map_err(sql)
}

/// Rebuilds the instances and submissions tables of the earliest format-1 layout (rowid
/// tables beside their keys) as `WITHOUT ROWID` and rowid-ordered tables.
fn rebuild_ledger(transaction: &rusqlite::Transaction<'_>) -> Result<(), StoreError> {
    transaction.execute_batch(&ledger_tables("_rebuilt")).map_err(sql)?;
    transaction
        .execute_batch(
            "INSERT INTO flue_instances_rebuilt (agent, id, uid, next_offset)
                 SELECT agent, id, uid, next_offset FROM flue_instances;
             INSERT INTO flue_submissions_rebuilt (sequence, id, agent, instance_id, status, owner_id, lease_until_ms, data)
                 SELECT sequence, id, agent, instance_id, status, owner_id, lease_until_ms, data FROM flue_submissions;
             DROP TABLE flue_instances;
             DROP TABLE flue_submissions;
             ALTER TABLE flue_instances_rebuilt RENAME TO flue_instances;
             ALTER TABLE flue_submissions_rebuilt RENAME TO flue_submissions;",
        )
        .map_err(sql)?;
    transaction.execute_batch(UNSETTLED_INDEX).map_err(sql)
}

/// Gives every instance its stream number and moves the batches of the layout keyed by
/// `(agent, instance_id, offset)` to their positions. An instance's number is the sequence of
/// its first submission (what admission gives a new one: the numbers stay unique); an
/// instance without submissions gets a negative number of its own.
fn number_streams(transaction: &rusqlite::Transaction<'_>) -> Result<(), StoreError> {
    if !table_sql(transaction, "flue_instances")?.contains("stream") {
        transaction
            .execute_batch("ALTER TABLE flue_instances ADD COLUMN stream INTEGER NOT NULL DEFAULT 0;")
            .map_err(sql)?;
    }
    transaction
        .execute_batch(
            "UPDATE flue_instances SET stream = COALESCE(
                 (SELECT MIN(s.sequence) FROM flue_submissions s
                     WHERE s.agent = flue_instances.agent AND s.instance_id = flue_instances.id),
                 -(SELECT COUNT(*) FROM flue_instances i
                     WHERE (i.agent, i.id) <= (flue_instances.agent, flue_instances.id)));
             ALTER TABLE flue_batches RENAME TO flue_batches_keyed;
             CREATE TABLE flue_batches (position INTEGER PRIMARY KEY, records TEXT NOT NULL);
             INSERT INTO flue_batches (position, records)
                 SELECT (i.stream << 32) + b.offset, b.records FROM flue_batches_keyed b
                     JOIN flue_instances i ON i.agent = b.agent AND i.id = b.instance_id;
             DROP TABLE flue_batches_keyed;",
        )
        .map_err(sql)
}

/// Puts the deliveries of `key` claimed into `host` but never applied back in the queue.
fn revert_joining(tx: &Tx<'_>, key: &InstanceKey, host: &str) -> Result<usize, StoreError> {
    let mut reverted = 0;
    for mut joining in unsettled_in(tx, key, SubmissionStatus::Joining)? {
        if joining.joined_into.as_deref() == Some(host) {
            joining.status = SubmissionStatus::Queued;
            joining.joined_into = None;
            write_submission(tx, &joining)?;
            reverted += 1;
        }
    }
    Ok(reverted)
}

fn sql(error: rusqlite::Error) -> StoreError {
    StoreError::Other(format!("sqlite: {error}"))
}

/// A user value as the text it is stored as, refused if it nests deeper than a read takes back.
fn user_value_text(value: &Value) -> Result<String, StoreError> {
    let text = value.to_string();
    super::storable(text.as_bytes(), "user value")?;
    Ok(text)
}

/// A value the store could not write as JSON.
fn json_error(error: serde_json::Error) -> StoreError {
    StoreError::Other(format!("sqlite: a row could not be written as JSON: {error}"))
}

/// A stored row, named by `what` (a submission, a stream's batch), that does not parse.
fn unreadable(what: impl std::fmt::Display) -> impl FnOnce(serde_json::Error) -> StoreError {
    move |error| StoreError::Other(format!("sqlite: {what} does not parse: {error}"))
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

/// The status a `status` column names.
fn status_named(name: &str) -> Option<SubmissionStatus> {
    [
        SubmissionStatus::Queued,
        SubmissionStatus::Running,
        SubmissionStatus::Joining,
        SubmissionStatus::Joined,
        SubmissionStatus::Settled,
    ]
    .into_iter()
    .find(|status| status_name(*status) == name)
}

fn ready<T: Send + 'static>(value: T) -> BoxFuture<'static, T> {
    Box::pin(std::future::ready(value))
}

impl SqliteStore {
    /// The WAL's length in frames (pages) at which a commit restarts it: the bound on its size
    /// (about 4 MiB of [`Self::PAGE_SIZE`] pages) between commits, beyond the frames of the
    /// largest transaction (see [`Self::wal_size_limit`]). The commit that restarts the WAL waits for
    /// two fsyncs; a larger bound makes that rarer, but every commit until the WAL first wraps
    /// extends the file, and on ext4 an extending write costs more than overwriting the file in
    /// place. Measured with the `turn_overhead` benchmark at 4 KiB pages, 8,192 frames (32 MiB)
    /// bought 2% on the mean exchange of a long run and lost 10% on the median exchange of a
    /// fresh database; at 1 KiB pages an exchange writes about 20 frames, and 4,000 frames
    /// (a restart about every 200 exchanges) did better than 2,000 (every 100): the SQLite
    /// profile's 20,000 exchanges took 2.4–2.8 s against 2.6–3.4 s.
    pub const WAL_RESTART_FRAMES: i32 = 4000;

    /// The WAL's size in bytes past which the first commit after a restart cuts the file back
    /// to it (`journal_size_limit`), for a database of `page_size` pages (a database made by
    /// an earlier build keeps its 4 KiB pages): [`Self::WAL_RESTART_FRAMES`] frames of a page
    /// and its header, and the WAL's own header. The WAL reaches that size in every cycle, so
    /// cutting it there costs nothing; one transaction larger than that (an admission carrying
    /// a large image) still grows the WAL while it commits, and without the limit the file
    /// kept that size until the store closed.
    pub fn wal_size_limit(page_size: u32) -> i64 {
        i64::from(Self::WAL_RESTART_FRAMES) * (i64::from(page_size) + 24) + 32
    }

    /// The page size of a database this store creates, in bytes (SQLite's default is 4 KiB; a
    /// database created with another size keeps it). A commit writes each page it changed
    /// whole into the WAL, and an exchange's commits each change a few pages (the stream's
    /// last leaf, its submission's row and index entry) by a few hundred bytes: at 1 KiB the
    /// kernel copies and SQLite checksums a quarter of the bytes. Measured with the
    /// `turn_overhead` benchmark's SQLite profile, 1 KiB pages cut the exchange's system time
    /// by about half and its wall time by about a quarter against 4 KiB, and did better than
    /// 2 KiB. A large record spans more overflow pages, which only reads of the whole stream
    /// (a conversation loaded into the cache) follow.
    pub const PAGE_SIZE: u32 = 1024;

    /// Opens (creating if needed) the store at `path`, creating parent directories, and checks
    /// or stamps the persisted format version.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let path = path.as_ref();
        if let Some(parent) = path.parent().filter(|parent| !parent.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .map_err(|error| StoreError::Other(format!("cannot create {}: {error}", parent.display())))?;
        }
        let in_use = |error| match error {
            StoreError::Other(message) if message.ends_with(LOCKED) => StoreError::Other(format!(
                "sqlite: the database {} is in use by another process: the embedded store belongs to one runtime process (several runtime processes share a Postgres store)",
                path.display()
            )),
            other => other,
        };
        // Before any connection: a second process waits here, not in SQLite's busy handler.
        #[cfg(unix)]
        let process_lock = ProcessLock::take(path).map_err(in_use)?;
        let connection = open_exclusive(path)?;
        let mut store = Self::with_connection(connection).map_err(in_use)?;
        #[cfg(unix)]
        {
            store._process_lock = Some(process_lock);
            store._files = Some(StoreFiles::of(path));
        }
        if !checkpoints_in_background(rusqlite::version_number()) {
            // SQLite's own automatic checkpoint, on the committing connection: no checkpoint
            // then runs beside a writer that starts the WAL over.
            tracing::warn!(
                sqlite = rusqlite::version(),
                "the SQLite this build links (not the bundled one) predates 3.51.3, whose fix a background checkpoint needs: checkpoints run on the committing thread"
            );
            return Ok(store);
        }
        // Replaces SQLite's own automatic checkpoint (itself a WAL hook).
        store.lock().connection.wal_hook(Some(note_wal_frames));
        store.checkpointer = Some(Checkpointer::start(path)?);
        Ok(store)
    }

    /// Makes every commit wait for its WAL frames to reach the disk (`synchronous = FULL`).
    /// By default (`NORMAL`) a committed transaction survives a crash of the process, and a
    /// power loss or an OS crash may lose the last ones before the next checkpoint; with full
    /// sync it survives those too, at the cost of an fsync per durability point (about six
    /// per exchange).
    pub fn with_full_sync(self) -> Result<Self, StoreError> {
        self.lock()
            .connection
            .execute_batch("PRAGMA synchronous = FULL;")
            .map_err(sql)?;
        Ok(self)
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
        connection.execute_batch("PRAGMA busy_timeout = 5000;").map_err(sql)?;
        // Takes effect only when the file is created (it changes nothing in an existing one).
        connection
            .execute_batch(&format!("PRAGMA page_size = {};", SqliteStore::PAGE_SIZE))
            .map_err(sql)?;
        // The format is checked before anything else changes the file: a database this build
        // refuses is left exactly as it was, its journal mode included.
        migrate(&mut connection)?;
        let page_size: u32 = connection
            .query_row("PRAGMA page_size", [], |row| row.get(0))
            .map_err(sql)?;
        connection
            .execute_batch(&format!(
                "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA journal_size_limit = {};",
                SqliteStore::wal_size_limit(page_size)
            ))
            .map_err(sql)?;
        connection.set_prepared_statement_cache_capacity(64);
        // The versions first: a commit of another connection after them is seen as a change
        // (the load's own reads move the pager's version too), where one between the load and
        // them would be missed.
        let data_version = data_version(&connection)?;
        let pager_version = pager_version(&connection)?;
        let index = Index::load(&connection)?;
        Ok(Self {
            db: Mutex::new(Db {
                connection,
                index,
                pager_version: Some(pager_version),
                data_version,
                json: Vec::new(),
            }),
            checkpointer: None,
            #[cfg(unix)]
            _process_lock: None,
            #[cfg(unix)]
            _files: None,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Db> {
        locked(&self.db)
    }

    /// Reads the index again from the file (after a test changed rows behind the store).
    #[cfg(test)]
    fn reload_index(&self) {
        let mut db = self.lock();
        db.index = Index::load(&db.connection).expect("the index loads");
    }

    /// Runs `f` in one `BEGIN IMMEDIATE` transaction, committing when it succeeds.
    fn transaction<T>(&self, f: impl FnOnce(&Tx<'_>) -> Result<T, StoreError>) -> Result<T, StoreError> {
        self.run(TransactionBehavior::Immediate, f)
    }

    /// Runs a read-only `f` in a deferred transaction (a consistent snapshot, no write lock).
    fn read_transaction<T>(&self, f: impl FnOnce(&Tx<'_>) -> Result<T, StoreError>) -> Result<T, StoreError> {
        self.run(TransactionBehavior::Deferred, f)
    }

    fn run<T>(
        &self,
        behavior: TransactionBehavior,
        f: impl FnOnce(&Tx<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut db = self.lock();
        let write = matches!(behavior, TransactionBehavior::Immediate);
        let Db {
            connection,
            index,
            pager_version: known,
            json,
            ..
        } = &mut *db;
        let open = Open::begin(connection, write)?;
        // Only a write transaction's `BEGIN` reads the WAL's header (a deferred one reads it
        // at its first statement); read transactions do not use the index.
        if write {
            refresh(connection, index, known)?;
        }
        // Dropped before `open` on an error or a panic: the index is put back, then the
        // transaction rolled back.
        let tx = Tx {
            connection,
            index: IndexTx::new(index),
            json: std::cell::RefCell::new(json),
        };
        // A write that failed on SQLite's side may have met rows the index did not describe:
        // the next transaction reads it again. (A refusal the store made itself, a fence or a
        // conflict, leaves it true.)
        let value = f(&tx).inspect_err(|error| {
            if write && matches!(error, StoreError::Other(_)) {
                *known = None;
            }
        })?;
        // Checked inside the transaction, on the snapshot it commits.
        #[cfg(debug_assertions)]
        tx.index.verify(connection);
        open.commit().inspect_err(|_| *known = None)?;
        tx.index.commit();
        if write {
            // This commit moved the pager's version: the index describes the file after it.
            // (Were the version unreadable, the next transaction would read the index again.)
            *known = pager_version(connection).ok();
            if let Some(checkpointer) = &self.checkpointer {
                checkpointer.committed(connection);
            }
        }
        Ok(value)
    }
}

/// A transaction begun and ended with the connection's cached statements (rusqlite's own
/// `Transaction` prepares `BEGIN` and `COMMIT` afresh every time: a measurable share of a
/// small write). Rolled back when dropped unfinished: an error or a panic in between.
struct Open<'c> {
    connection: &'c Connection,
    finished: bool,
}

impl<'c> Open<'c> {
    fn begin(connection: &'c Connection, write: bool) -> Result<Self, StoreError> {
        let begin = if write { "BEGIN IMMEDIATE" } else { "BEGIN DEFERRED" };
        connection
            .prepare_cached(begin)
            .and_then(|mut statement| statement.execute([]))
            .map_err(sql)?;
        Ok(Self {
            connection,
            finished: false,
        })
    }

    fn commit(mut self) -> Result<(), StoreError> {
        self.connection
            .prepare_cached("COMMIT")
            .and_then(|mut statement| statement.execute([]))
            .map_err(sql)?;
        self.finished = true;
        Ok(())
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        if !self.finished && !self.connection.is_autocommit() {
            let rolled_back = self
                .connection
                .prepare_cached("ROLLBACK")
                .and_then(|mut statement| statement.execute([]));
            if let Err(error) = rolled_back {
                tracing::warn!(%error, "sqlite: rolling back a transaction failed");
            }
        }
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
    let stamps = (stamp("format_version")?, stamp("schema_version")?);
    if is_fresh(&tables) && stamps == (None, None) {
        transaction
            .execute_batch("CREATE TABLE IF NOT EXISTS flue_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);")
            .map_err(sql)?;
        transaction
            .execute(
                "INSERT INTO flue_meta (key, value) VALUES ('format_version', ?1)",
                params![FORMAT_VERSION],
            )
            .map_err(sql)?;
        transaction.execute_batch(&ledger_tables("")).map_err(sql)?;
        transaction.execute_batch(BATCHES_TABLE).map_err(sql)?;
        transaction.execute_batch(ATTACHMENT_TABLES).map_err(sql)?;
        transaction.execute_batch(UNSETTLED_INDEX).map_err(sql)?;
        return transaction.commit().map_err(sql);
    }
    match stamps {
        (Some(version), _) if version == FORMAT_VERSION => {
            check_own_layout(&tables)?;
            upgrade_layout(&transaction)?;
            transaction.commit().map_err(sql)
        }
        (None, Some(legacy)) if legacy == "8" => {
            check_own_layout(&tables)?;
            transaction
                .execute(
                    "UPDATE flue_meta SET key = 'format_version', value = ?1 WHERE key = 'schema_version'",
                    params![FORMAT_VERSION],
                )
                .map_err(sql)?;
            upgrade_layout(&transaction)?;
            transaction.commit().map_err(sql)
        }
        (Some(version), _) | (None, Some(version)) => Err(StoreError::FormatVersion { stored: version }),
        (None, None) => Err(StoreError::FormatVersion {
            stored: "unversioned".into(),
        }),
    }
}

fn read_submission(transaction: &Connection, id: &str) -> Result<Option<Submission>, StoreError> {
    let data: Option<String> = transaction
        .prepare_cached("SELECT data FROM flue_submissions WHERE id = ?1")
        .map_err(sql)?
        .query_row(params![id], |row| row.get(0))
        .optional()
        .map_err(sql)?;
    data.map(|data| crate::store::from_stored(&data).map_err(unreadable(format_args!("the row of submission {id}"))))
        .transpose()
}

/// Writes a transition of a submission row: an update of the row its sequence (the rowid)
/// names (an admission inserts with [`insert_submission`]).
fn write_submission(transaction: &Tx<'_>, row: &Submission) -> Result<(), StoreError> {
    let (updated, size) = transaction.with_json(row, "submission's message and initial data", |data| {
        let updated = transaction
            .prepare_cached(
                "UPDATE flue_submissions SET status = ?2, owner_id = ?3, lease_until_ms = ?4, data = ?5, attempt_id = ?7
                 WHERE sequence = ?1 AND id = ?6",
            )
            .map_err(sql)?
            .execute(params![
                row.sequence as i64,
                status_name(row.status),
                row.owner_id,
                row.lease_until_ms as i64,
                data,
                row.id,
                row.attempt_id
            ])
            .map_err(sql)?;
        Ok((updated, data.len()))
    })?;
    if updated == 0 {
        return Err(StoreError::Other(format!(
            "sqlite: submission {} has no row to update",
            row.id
        )));
    }
    transaction.index.wrote(row, size);
    Ok(())
}

/// Inserts an admitted submission's row.
fn insert_submission(transaction: &Tx<'_>, row: &Submission) -> Result<(), StoreError> {
    let size = transaction.with_json(row, "submission's message and initial data", |data| {
        transaction
            .prepare_cached(
                "INSERT INTO flue_submissions (sequence, id, agent, instance_id, status, owner_id, lease_until_ms, data, attempt_id)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            )
            .map_err(sql)?
            .execute(params![
                row.sequence as i64,
                row.id,
                row.key.agent,
                row.key.id,
                status_name(row.status),
                row.owner_id,
                row.lease_until_ms as i64,
                data,
                row.attempt_id
            ])
            .map_err(sql)?;
        Ok(data.len())
    })?;
    transaction.index.wrote(row, size);
    Ok(())
}

/// The instance's unsettled submissions, in admission order.
fn unsettled(transaction: &Connection, key: &InstanceKey) -> Result<Vec<Submission>, StoreError> {
    submissions(
        transaction,
        "SELECT sequence, data FROM flue_submissions WHERE agent = ?1 AND instance_id = ?2 AND status <> 'settled' ORDER BY sequence",
        params![key.agent, key.id],
    )
}

/// The submissions a query of their `sequence` and `data` returns, in its order.
fn submissions(
    transaction: &Connection,
    query: &str,
    parameters: impl rusqlite::Params,
) -> Result<Vec<Submission>, StoreError> {
    let mut statement = transaction.prepare_cached(query).map_err(sql)?;
    let rows = statement
        .query_map(parameters, |row| Ok((row.get::<_, i64>(0)?, row.get::<_, String>(1)?)))
        .map_err(sql)?;
    rows.map(|row| {
        let (sequence, data) = row.map_err(sql)?;
        crate::store::from_stored(&data).map_err(unreadable(format_args!("the submission row {sequence}")))
    })
    .collect()
}

/// The submissions a node-wide scan's query of their `id` and `data` returns, in its order,
/// leaving out (with a warning) a row whose JSON this build cannot read: one such row (a
/// newer build's, a damaged one) must not stop the scan's work for every other instance. Its
/// own instance's reads still fail on it, saying why.
fn readable_submissions(
    transaction: &Connection,
    query: &str,
    parameters: impl rusqlite::Params,
) -> Result<Vec<Submission>, StoreError> {
    let mut statement = transaction.prepare_cached(query).map_err(sql)?;
    let rows = statement
        .query_map(parameters, |row| {
            Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?))
        })
        .map_err(sql)?;
    let mut readable = Vec::new();
    for row in rows {
        let (id, data) = row.map_err(sql)?;
        match crate::store::from_stored(&data) {
            Ok(submission) => readable.push(submission),
            Err(error) => {
                tracing::warn!(submission = %id, "sqlite: a submission row this build cannot read is left out of a scan: {error}")
            }
        }
    }
    Ok(readable)
}

/// The instance's submissions in `status`, in admission order. (`status <> 'settled'` lets
/// SQLite use the unsettled index, whose condition a query must state.)
fn unsettled_in(
    transaction: &Connection,
    key: &InstanceKey,
    status: SubmissionStatus,
) -> Result<Vec<Submission>, StoreError> {
    submissions(
        transaction,
        "SELECT sequence, data FROM flue_submissions WHERE agent = ?1 AND instance_id = ?2 AND status <> 'settled' AND status = ?3 ORDER BY sequence",
        params![key.agent, key.id, status_name(status)],
    )
}

/// Starts an attempt of the instance's head, when it is queued.
fn claim_head(transaction: &Tx<'_>, key: &InstanceKey, claim: &Claim) -> Result<Option<Submission>, StoreError> {
    // Only the head is read: the rows queued behind it (their messages, images included)
    // are not parsed at every claim.
    let Some(mut head) = submissions(
        transaction,
        "SELECT sequence, data FROM flue_submissions WHERE agent = ?1 AND instance_id = ?2 AND status <> 'settled' ORDER BY sequence LIMIT 1",
        params![key.agent, key.id],
    )?
    .pop() else {
        return Ok(None);
    };
    if head.status != SubmissionStatus::Queued {
        return Ok(None);
    }
    super::start_attempt(&mut head, claim);
    write_submission(transaction, &head)?;
    Ok(Some(head))
}

/// The instance of the submission `attempt` runs, while it runs it (the fence of a write),
/// from the index.
fn owner_of(transaction: &Tx<'_>, attempt: &AttemptRef) -> Option<InstanceKey> {
    transaction.index.running(&attempt.submission_id, &attempt.attempt_id)
}

fn owns(transaction: &Tx<'_>, attempt: &AttemptRef) -> Result<Option<Submission>, StoreError> {
    if owner_of(transaction, attempt).is_none() {
        return Ok(None);
    }
    if let Some(row) = transaction
        .index
        .running_row(&attempt.submission_id, &attempt.attempt_id)
    {
        return Ok(Some(Submission::clone(&row)));
    }
    Ok(read_submission(transaction, &attempt.submission_id)?.filter(|row| {
        row.status == SubmissionStatus::Running && row.attempt_id.as_deref() == Some(attempt.attempt_id.as_str())
    }))
}

/// Checks that `records`, appended through the trait under `authorization`, are that attempt's:
/// of its submission or of a delivery `joining` or `joined` into it (see
/// [`super::joined_submissions_of`]). The joined rows are read from the file: only a host's
/// append for a delivery it joined has any.
fn authorize_records(
    transaction: &Tx<'_>,
    records: &[Record],
    authorization: Option<&AttemptRef>,
) -> Result<(), StoreError> {
    let joined = super::joined_submissions_of(records, authorization)?;
    let Some(host) = authorization else { return Ok(()) };
    for submission in joined {
        let claimed = read_submission(transaction, submission)?.is_some_and(|row| {
            row.joined_into.as_deref() == Some(host.submission_id.as_str())
                && matches!(row.status, SubmissionStatus::Joining | SubmissionStatus::Joined)
        });
        if !claimed {
            return Err(super::not_joined(submission, &host.submission_id));
        }
    }
    Ok(())
}

/// Appends a batch at the end of `key`'s stream; returns its offset. With a `fence`, only
/// while that attempt runs its submission (else [`StoreError::Fenced`]).
///
/// One statement, the insert: the fence and the stream's end come from the index (a stream
/// it does not know is read from the file once). An append is the hot path of every
/// durability point.
fn append_batch(
    transaction: &Tx<'_>,
    key: &InstanceKey,
    records: &[Record],
    fence: Option<&AttemptRef>,
) -> Result<u64, StoreError> {
    // A malformed call first, then the fence, whether or not the stream exists, as the other
    // stores do.
    if records.is_empty() {
        return Err(super::empty_batch());
    }
    if let Some(attempt) = fence {
        let refused = match owner_of(transaction, attempt) {
            Some(owner) if key.writable_by(&owner.agent, &owner.id) => None,
            Some(_) => Some(format!(
                "submission {} does not write the stream {key}",
                attempt.submission_id
            )),
            None => Some(format!(
                "attempt {} does not own submission {}",
                attempt.attempt_id, attempt.submission_id
            )),
        };
        if let Some(refused) = refused {
            return Err(StoreError::Fenced(refused));
        }
    }
    let (stream, offset) = match transaction.index.stream(key) {
        Some(end) => end,
        None => {
            let Some(stream) = instance_row(transaction, key)?.map(|(_, stream)| stream) else {
                return Err(StoreError::Other(format!("no stream {key}")));
            };
            (stream, next_offset(transaction, stream)?)
        }
    };
    if offset >= STREAM_CAPACITY {
        return Err(StoreError::Other(format!(
            "the stream of {key} is full ({STREAM_CAPACITY} batches)"
        )));
    }
    transaction.with_json(records, "records", |data| {
        transaction
            .prepare_cached("INSERT INTO flue_batches (position, records) VALUES (?1, ?2)")
            .map_err(sql)?
            .execute(params![stream_start(stream) + offset as i64, data])
            .map_err(sql)
    })?;
    transaction.index.set_stream(key, stream, offset + 1);
    Ok(offset)
}

/// The offset the stream's next batch takes: one past its last batch.
fn next_offset(transaction: &Connection, stream: i64) -> Result<u64, StoreError> {
    let start = stream_start(stream);
    transaction
        .prepare_cached("SELECT MAX(position) FROM flue_batches WHERE position >= ?1 AND position < ?2")
        .map_err(sql)?
        .query_row(params![start, start + STREAM_CAPACITY as i64], |row| {
            row.get::<_, Option<i64>>(0)
        })
        .map(|last| last.map_or(0, |last| (last - start) as u64 + 1))
        .map_err(sql)
}

/// The admission sequences below this number the streams of the instances their admissions
/// create; the instances created after take numbers from a counter, from this one up.
const SEQUENCE_NUMBERED_STREAMS: i64 = 1 << 30;

/// The stream number of the root instance the admission numbered `sequence` creates: the
/// sequence itself (unique, and at hand: no write) while it is below
/// [`SEQUENCE_NUMBERED_STREAMS`]; past that, the next of the `highest_stream` counter in
/// `flue_meta`, so the numbers (positive ones below 2^31 - 1) run out with instances created,
/// not with admissions. The last, 2^31 - 1, is never given: the end of its batch range,
/// `(stream + 1) << 32`, would not fit in 64 bits.
fn root_stream(transaction: &Connection, sequence: i64) -> Result<i64, StoreError> {
    if sequence < SEQUENCE_NUMBERED_STREAMS {
        return Ok(sequence);
    }
    const SCAN: &str = "SELECT MAX(stream) FROM flue_instances";
    let highest = stream_counter(transaction, "highest_stream", SCAN)?;
    let mut stream = highest.max(SEQUENCE_NUMBERED_STREAMS - 1) + 1;
    if !stream_is_free(transaction, stream)? {
        stream = scanned(transaction, SCAN)?
            .max(highest)
            .max(SEQUENCE_NUMBERED_STREAMS - 1)
            + 1;
    }
    if stream >= (1 << 31) - 1 {
        return Err(StoreError::Other(
            "sqlite: 2^31 - 2 instances were created; no stream number is left for a new one".into(),
        ));
    }
    set_stream_counter(transaction, "highest_stream", stream)?;
    Ok(stream)
}

/// The stream-number counter `name` kept in `flue_meta` (so a creation does not scan every
/// instance); a database without it, or with a value that does not parse, computes it once
/// with `scan` (a `MIN` or `MAX` over the instances; 0 when there are none).
fn stream_counter(transaction: &Connection, name: &str, scan: &str) -> Result<i64, StoreError> {
    let kept: Option<String> = transaction
        .prepare_cached("SELECT value FROM flue_meta WHERE key = ?1")
        .map_err(sql)?
        .query_row([name], |row| row.get(0))
        .optional()
        .map_err(sql)?;
    match kept.and_then(|kept| kept.parse::<i64>().ok()) {
        Some(kept) => Ok(kept),
        None => scanned(transaction, scan),
    }
}

/// What `scan` (a `MIN` or `MAX` of the instances' stream numbers) finds; 0 when there are no
/// instances.
fn scanned(transaction: &Connection, scan: &str) -> Result<i64, StoreError> {
    Ok(transaction
        .prepare_cached(scan)
        .map_err(sql)?
        .query_row([], |row| row.get::<_, Option<i64>>(0))
        .map_err(sql)?
        .unwrap_or(0))
}

/// Whether no stream holds batches under the number `stream` (every stream has its birth
/// batch at offset 0): a counter is trusted only for a number that is free. A build of the
/// same format before the counters (one rolled back to, say) gives numbers without keeping
/// them, and the counter then names a number taken, whose birth batch could never be written
/// again: the numbers are scanned instead. One lookup of the batches' rowid range.
fn stream_is_free(transaction: &Connection, stream: i64) -> Result<bool, StoreError> {
    let start = stream << 32;
    transaction
        .prepare_cached("SELECT 1 FROM flue_batches WHERE position BETWEEN ?1 AND ?2 LIMIT 1")
        .map_err(sql)?
        // The range's last position, which fits in 64 bits also for the last number.
        .query_row(params![start, start + ((1 << 32) - 1)], |_| Ok(()))
        .optional()
        .map(|taken| taken.is_none())
        .map_err(sql)
}

/// Keeps `value` as the stream-number counter `name`.
fn set_stream_counter(transaction: &Connection, name: &str, value: i64) -> Result<(), StoreError> {
    transaction
        .prepare_cached("INSERT OR REPLACE INTO flue_meta (key, value) VALUES (?1, ?2)")
        .map_err(sql)?
        .execute(params![name, value.to_string()])
        .map(drop)
        .map_err(sql)
}

/// The instance's incarnation and stream number, when it exists.
fn instance_row(transaction: &Connection, key: &InstanceKey) -> Result<Option<(String, i64)>, StoreError> {
    transaction
        .prepare_cached("SELECT uid, stream FROM flue_instances WHERE agent = ?1 AND id = ?2")
        .map_err(sql)?
        .query_row(params![key.agent, key.id], |row| {
            Ok((row.get::<_, String>(0)?, row.get(1)?))
        })
        .optional()
        .map_err(sql)
}

fn instance_uid(transaction: &Connection, key: &InstanceKey) -> Result<Option<String>, StoreError> {
    Ok(instance_row(transaction, key)?.map(|(uid, _)| uid))
}

impl Store for SqliteStore {
    /// On Unix the process holds the file locked (`unix-excl`): one process at a time.
    fn exclusive(&self) -> bool {
        cfg!(unix)
    }

    fn admit(&self, admission: Admission) -> BoxFuture<'_, Result<Admitted, StoreError>> {
        ready(self.transaction(|tx| {
            if let Some(existing) = read_submission(tx, &admission.submission_id)? {
                if existing.admitted_by(&admission) {
                    let uid = instance_uid(tx, &admission.key)?.unwrap_or_default();
                    return Ok(Admitted {
                        submission: existing,
                        uid,
                        deduplicated: true,
                        offset: None,
                        claimed: None,
                        birth: None,
                    });
                }
                return Err(StoreError::SubmissionConflict(admission.submission_id.clone()));
            }
            let existing = instance_row(tx, &admission.key)?;
            super::check_uid(&admission, existing.as_ref().map(|(uid, _)| uid.as_str()))?;
            let sequence = tx.index.take_sequence();
            let created = existing.is_none();
            let (uid, offset, birth) = match existing {
                Some((uid, stream)) => {
                    let next = match tx.index.stream(&admission.key) {
                        Some((_, next)) => next,
                        None => next_offset(tx, stream)?,
                    };
                    (uid, next.checked_sub(1), None)
                }
                None => {
                    let stream = root_stream(tx, sequence)?;
                    let uid = new_id("inst");
                    tx.prepare_cached(
                        "INSERT INTO flue_instances (agent, id, uid, next_offset, stream) VALUES (?1, ?2, ?3, 0, ?4)",
                    )
                    .map_err(sql)?
                    .execute(params![admission.key.agent, admission.key.id, uid, stream])
                    .map_err(sql)?;
                    tx.index.set_stream(&admission.key, stream, 0);
                    let birth: Arc<[Record]> = Arc::new([super::birth_record(&uid, admission.initial_data.clone())]);
                    let offset = append_batch(tx, &admission.key, &birth, None)?;
                    (uid, Some(offset), Some(Batch { offset, records: birth }))
                }
            };
            // Claimed with its admission when it is the instance's head (nothing else is
            // unsettled): the row is written once, already running. An instance this admission
            // created has no other submission (instances are never deleted).
            let claim = match &admission.claim {
                Some(claim) if created || tx.index.counts(&admission.key).unsettled == 0 => Some(claim.clone()),
                _ => None,
            };
            let submission = super::queued_submission(admission, sequence as u64);
            let claimed = claim.map(|claim| {
                let mut running = submission.clone();
                super::start_attempt(&mut running, &claim);
                running
            });
            let row = claimed.as_ref().unwrap_or(&submission);
            insert_submission(tx, row)?;
            Ok(Admitted {
                submission,
                uid,
                deduplicated: false,
                offset,
                claimed,
                birth,
            })
        }))
    }

    fn instance(&self, key: &InstanceKey) -> BoxFuture<'_, Result<Option<InstanceInfo>, StoreError>> {
        ready(self.read_transaction(|tx| {
            Ok(instance_uid(tx, key)?.map(|uid| InstanceInfo {
                id: key.id.to_string(),
                uid,
            }))
        }))
    }

    fn submission(&self, id: &str) -> BoxFuture<'_, Result<Option<Submission>, StoreError>> {
        ready(self.read_transaction(|tx| read_submission(tx, id)))
    }

    fn has_queued(&self, key: &InstanceKey) -> BoxFuture<'_, Result<bool, StoreError>> {
        let mut db = self.lock();
        ready(db.fresh_index().map(|index| index.counts(key).queued > 0))
    }

    fn claim_next(&self, key: &InstanceKey, claim: &Claim) -> BoxFuture<'_, Result<Option<Submission>, StoreError>> {
        ready(self.transaction(|tx| claim_head(tx, key, claim)))
    }

    fn renew_leases(
        &self,
        owner_id: &str,
        attempt_ids: &[String],
        lease_until_ms: u64,
    ) -> BoxFuture<'_, Result<u64, StoreError>> {
        ready(self.transaction(|tx| {
            // A row this build cannot read is left out (with a warning), as the node-wide scans
            // leave it: failing here would let every other lease of the node lapse.
            let running = readable_submissions(
                tx,
                "SELECT id, data FROM flue_submissions INDEXED BY flue_submissions_unsettled WHERE status <> 'settled' AND status = 'running' AND owner_id = ?1",
                params![owner_id],
            )?;
            let mut renewed = 0;
            for mut row in running {
                if row.attempt_id.as_ref().is_some_and(|attempt| attempt_ids.contains(attempt)) {
                    row.lease_until_ms = lease_until_ms;
                    write_submission(tx, &row)?;
                    renewed += 1;
                }
            }
            Ok(renewed)
        }))
    }

    fn expired(&self, now_ms: u64) -> BoxFuture<'_, Result<Vec<Submission>, StoreError>> {
        ready(self.read_transaction(|tx| {
            readable_submissions(
                tx,
                "SELECT id, data FROM flue_submissions INDEXED BY flue_submissions_unsettled WHERE status <> 'settled' AND status = 'running' AND lease_until_ms > 0 AND lease_until_ms < ?1 ORDER BY sequence",
                params![now_ms as i64],
            )
        }))
    }

    fn reclaim(
        &self,
        submission_id: &str,
        stale_attempt_id: &str,
        claim: &Claim,
        now_ms: u64,
    ) -> BoxFuture<'_, Result<Option<Submission>, StoreError>> {
        ready(self.transaction(|tx| {
            let Some(mut row) = read_submission(tx, submission_id)? else {
                return Ok(None);
            };
            if row.status != SubmissionStatus::Running
                || row.attempt_id.as_deref() != Some(stale_attempt_id)
                || !super::lease_expired(row.lease_until_ms, now_ms)
            {
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

    fn aborts_requested(&self, attempt_ids: &[String]) -> BoxFuture<'_, Result<Vec<String>, StoreError>> {
        ready(self.read_transaction(|tx| {
            let running = readable_submissions(
                tx,
                "SELECT id, data FROM flue_submissions INDEXED BY flue_submissions_unsettled WHERE status <> 'settled' AND status = 'running' ORDER BY sequence",
                [],
            )?;
            Ok(running
                .into_iter()
                .filter(|row| row.abort_requested)
                .filter_map(|row| row.attempt_id)
                .filter(|attempt| attempt_ids.contains(attempt))
                .collect())
        }))
    }

    fn instances_with_queued(&self) -> BoxFuture<'_, Result<Vec<InstanceKey>, StoreError>> {
        ready(self.read_transaction(|tx| {
            let mut statement = tx
                .prepare_cached("SELECT agent, instance_id FROM flue_submissions INDEXED BY flue_submissions_unsettled WHERE status <> 'settled' GROUP BY agent, instance_id HAVING max(status = 'queued') = 1 AND max(status = 'running') = 0 ORDER BY agent, instance_id")
                .map_err(sql)?;
            let rows = statement
                .query_map([], |row| Ok(InstanceKey::new(row.get::<_, String>(0)?, row.get::<_, String>(1)?)))
                .map_err(sql)?;
            rows.collect::<Result<_, _>>().map_err(sql)
        }))
    }

    fn claim_joinable(&self, host: &AttemptRef) -> BoxFuture<'_, Result<Vec<Submission>, StoreError>> {
        // Asked at every turn boundary and nearly always empty: the index answers that
        // without a transaction.
        let queued = {
            let mut db = self.lock();
            db.fresh_index().map(|index| {
                index
                    .unsettled(&host.submission_id)
                    .is_some_and(|row| index.counts(&row.key).queued > 0)
            })
        };
        match queued {
            Ok(false) => return ready(Ok(Vec::new())),
            Ok(true) => {}
            Err(error) => return ready(Err(error)),
        }
        ready(self.transaction(|tx| {
            // A host being aborted takes no more deliveries: one admitted after the abort was
            // requested is not part of what the abort ends.
            let Some(key) = owns(tx, host)?.filter(|row| !row.abort_requested).map(|row| row.key) else {
                return Ok(Vec::new());
            };
            let mut claimed = Vec::new();
            for mut row in unsettled_in(tx, &key, SubmissionStatus::Queued)? {
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
            if owner_of(tx, host).is_none() {
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
    ) -> BoxFuture<'_, Result<bool, StoreError>> {
        ready(self.transaction(|tx| {
            let Some(mut host_row) = owns(tx, host)? else {
                return Err(StoreError::Fenced(format!(
                    "attempt {} does not own {}",
                    host.attempt_id, host.submission_id
                )));
            };
            if !records.is_empty() {
                append_batch(tx, &host_row.key, &records, None)?;
            }
            // Only the rows that may have joined this response are parsed, and only when the
            // index counts any; the queue behind it is looked at through the index.
            let counts = tx.index.counts(&host_row.key);
            let mut queued = counts.queued > 0;
            let joins = if counts.joins == 0 {
                Vec::new()
            } else {
                [SubmissionStatus::Joined, SubmissionStatus::Joining]
                    .into_iter()
                    .map(|status| unsettled_in(tx, &host_row.key, status))
                    .collect::<Result<Vec<_>, _>>()?
            };
            for mut row in joins.into_iter().flatten() {
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
                        queued = true;
                    }
                    _ => continue,
                }
                write_submission(tx, &row)?;
            }
            host_row.status = SubmissionStatus::Settled;
            host_row.outcome = Some(outcome);
            host_row.error = error;
            host_row.lease_until_ms = 0;
            write_submission(tx, &host_row)?;
            Ok(queued)
        }))
    }

    fn revert_joins(&self, host: &AttemptRef) -> BoxFuture<'_, Result<usize, StoreError>> {
        ready(self.transaction(|tx| match owner_of(tx, host) {
            Some(key) => revert_joining(tx, &key, &host.submission_id),
            None => Ok(0),
        }))
    }

    fn requeue(&self, attempt: &AttemptRef) -> BoxFuture<'_, Result<bool, StoreError>> {
        ready(self.transaction(|tx| {
            let Some(mut row) = owns(tx, attempt)? else {
                return Ok(false);
            };
            revert_joining(tx, &row.key, &attempt.submission_id)?;
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
        records: Arc<[Record]>,
        authorization: Option<&AttemptRef>,
    ) -> BoxFuture<'_, Result<u64, StoreError>> {
        // Refused before a transaction: a failed one makes the next read the index again.
        if records.is_empty() {
            return ready(Err(super::empty_batch()));
        }
        ready(self.transaction(|tx| {
            authorize_records(tx, &records, authorization)?;
            append_batch(tx, key, &records, authorization)
        }))
    }

    fn create_child(
        &self,
        parent: &InstanceKey,
        link: Arc<[Record]>,
        child: &InstanceKey,
        birth: Arc<[Record]>,
        authorization: Option<&AttemptRef>,
    ) -> BoxFuture<'_, Result<u64, StoreError>> {
        if link.is_empty() || birth.is_empty() {
            return ready(Err(super::empty_batch()));
        }
        ready(self.transaction(|tx| {
            // The link first: it checks the fence and the parent's stream.
            authorize_records(tx, &link, authorization)?;
            let offset = append_batch(tx, parent, &link, authorization)?;
            if instance_row(tx, child)?.is_some() {
                return Err(StoreError::Other(format!("the stream {child} exists")));
            }
            // A child has no submission to number its stream with: child streams take the
            // numbers below every other (admitted instances have positive ones, instances
            // migrated without submissions negative ones from -1 down). The lowest number
            // given is kept in `flue_meta`, so a task's creation does not scan every
            // instance; a database without it (or with a value that does not parse) is
            // scanned once.
            const SCAN: &str = "SELECT MIN(stream) FROM flue_instances";
            let lowest = stream_counter(tx, "lowest_stream", SCAN)?;
            let mut stream = lowest.min(0) - 1;
            if !stream_is_free(tx, stream)? {
                stream = scanned(tx, SCAN)?.min(lowest).min(0) - 1;
            }
            if stream <= -(1 << 31) {
                return Err(StoreError::Other(
                    "sqlite: 2^31 child conversations were created; no stream number is left".into(),
                ));
            }
            tx.prepare_cached(
                "INSERT INTO flue_instances (agent, id, uid, next_offset, stream) VALUES (?1, ?2, ?3, 0, ?4)",
            )
            .map_err(sql)?
            .execute(params![child.agent, child.id, super::birth_uid(&birth), stream])
            .map_err(sql)?;
            tx.index.set_stream(child, stream, 0);
            set_stream_counter(tx, "lowest_stream", stream)?;
            append_batch(tx, child, &birth, None)?;
            Ok(offset)
        }))
    }

    fn last_offset(&self, key: &InstanceKey) -> BoxFuture<'_, Result<Option<u64>, StoreError>> {
        // The stream's last position is one seek from its range's end (a bare `MAX`).
        let db = self.lock();
        let last = db
            .connection
            .prepare_cached(
                "SELECT i.stream,
                     (SELECT MAX(position) FROM flue_batches
                         WHERE position >= (i.stream << 32) AND position < ((i.stream + 1) << 32))
                 FROM flue_instances i WHERE i.agent = ?1 AND i.id = ?2",
            )
            .and_then(|mut statement| {
                statement
                    .query_row(params![key.agent, key.id], |row| {
                        Ok((row.get::<_, i64>(0)?, row.get::<_, Option<i64>>(1)?))
                    })
                    .optional()
            })
            .map(|found| found.and_then(|(stream, last)| last.map(|last| (last - stream_start(stream)) as u64)))
            .map_err(sql);
        ready(last)
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
        // SQLite reads a negative limit as none.
        let limit = i64::try_from(limit).unwrap_or(-1);
        // One statement (its own snapshot, so no transaction around it): the instance's stream
        // and its batches after `after`. Every submission and every catching-up reader reads.
        let first = after.map_or(0, |after| after.saturating_add(1)).min(STREAM_CAPACITY) as i64;
        let mut db = self.lock();
        // A reader that is up to date (every submission of a live instance) is told so by
        // the index, without reading the batches (`fresh_index` asks only for the data
        // version).
        match db.fresh_index() {
            Ok(index) if index.stream(key).is_some_and(|(_, next)| first as u64 >= next) => {
                return ready(Ok(Vec::new()));
            }
            Ok(_) => {}
            Err(error) => return ready(Err(error)),
        }
        // The rows' text is taken under the lock, and parsed after it: a long stream read again
        // (an evicted conversation, a reattached child) holds up no write of the process while
        // its records are parsed.
        let rows: Result<Vec<(i64, String)>, StoreError> = db
            .connection
            .prepare_cached(
                "SELECT b.position - (i.stream << 32), b.records
                 FROM flue_instances i JOIN flue_batches b
                     ON b.position >= (i.stream << 32) + ?3 AND b.position < ((i.stream + 1) << 32)
                 WHERE i.agent = ?1 AND i.id = ?2
                 ORDER BY b.position LIMIT ?4",
            )
            .map_err(sql)
            .and_then(|mut statement| {
                statement
                    .query_map(params![key.agent, key.id, first, limit], |row| {
                        Ok((row.get::<_, i64>(0)?, row.get::<_, String>(1)?))
                    })
                    .map_err(sql)?
                    .map(|row| row.map_err(sql))
                    .collect()
            });
        drop(db);
        ready(rows.and_then(|rows| {
            rows.into_iter()
                .map(|(offset, records)| {
                    Ok(Batch {
                        offset: offset as u64,
                        records: crate::store::from_stored::<Vec<Record>>(&records)
                            .map_err(unreadable(format_args!("the batch at offset {offset} of {key}")))?
                            .into(),
                    })
                })
                .collect()
        }))
    }

    fn put_attachment(&self, key: &InstanceKey, attachment: AttachmentPut) -> BoxFuture<'_, Result<(), StoreError>> {
        if let Err(error) = attachment.verify() {
            return ready(Err(error));
        }
        ready(self.transaction(|tx| {
            let stored = tx
                .prepare_cached(
                    "SELECT agent, instance_id, media_type, size, digest FROM flue_attachments WHERE id = ?1",
                )
                .map_err(sql)?
                .query_row(params![attachment.id], |row| {
                    Ok((
                        InstanceKey::new(row.get::<_, String>(0)?, row.get::<_, String>(1)?),
                        row.get::<_, String>(2)?,
                        row.get::<_, i64>(3)? as u64,
                        row.get::<_, String>(4)?,
                    ))
                })
                .optional()
                .map_err(sql)?;
            if let Some((owner, media_type, size, digest)) = stored {
                return if attachment.is_stored_as(key, &owner, &media_type, size, &digest) {
                    Ok(())
                } else {
                    Err(conflict(&attachment.id))
                };
            }
            tx.prepare_cached(
                "INSERT INTO flue_attachments (id, agent, instance_id, media_type, size, digest)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )
            .map_err(sql)?
            .execute(params![
                attachment.id,
                key.agent,
                key.id,
                attachment.media_type,
                attachment.size as i64,
                attachment.digest
            ])
            .map_err(sql)?;
            let mut insert = tx
                .prepare_cached("INSERT INTO flue_attachment_chunks (id, chunk, bytes) VALUES (?1, ?2, ?3)")
                .map_err(sql)?;
            for (chunk, bytes) in attachment.bytes.chunks(ATTACHMENT_CHUNK_BYTES).enumerate() {
                insert
                    .execute(params![attachment.id, chunk as i64, bytes])
                    .map_err(sql)?;
            }
            Ok(())
        }))
    }

    fn attachment(&self, key: &InstanceKey, id: &str) -> BoxFuture<'_, Result<Option<StoredAttachment>, StoreError>> {
        // Checked once read, outside the transaction: hashing an image of megabytes there would
        // hold up every write of the process meanwhile (as parsing a page of batches would).
        let read = self.read_transaction(|tx| {
            let meta = tx
                .prepare_cached(
                    "SELECT media_type, size, digest FROM flue_attachments WHERE id = ?1 AND agent = ?2 AND instance_id = ?3",
                )
                .map_err(sql)?
                .query_row(params![id, key.agent, key.id], |row| {
                    Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)? as u64, row.get::<_, String>(2)?))
                })
                .optional()
                .map_err(sql)?;
            let Some((media_type, size, digest)) = meta else {
                return Ok(None);
            };
            // A hint only: a damaged size must not reserve its memory.
            let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0).min(MAX_READ_RESERVATION));
            let mut statement = tx
                .prepare_cached("SELECT bytes FROM flue_attachment_chunks WHERE id = ?1 ORDER BY chunk")
                .map_err(sql)?;
            let mut rows = statement.query(params![id]).map_err(sql)?;
            while let Some(row) = rows.next().map_err(sql)? {
                bytes.extend_from_slice(row.get_ref(0).map_err(sql)?.as_blob().map_err(|e| sql(e.into()))?);
            }
            Ok(Some(StoredAttachment {
                id: id.to_owned(),
                media_type,
                size,
                digest,
                bytes,
            }))
        });
        ready(read.and_then(|found| found.map(StoredAttachment::verified).transpose()))
    }

    fn user_value(&self, user_id: &str, key: &str) -> BoxFuture<'_, Result<Option<UserValue>, StoreError>> {
        ready(self.read_transaction(|tx| {
            tx.prepare_cached("SELECT value, updated_at FROM flue_user_values WHERE user_id = ?1 AND key = ?2")
                .map_err(sql)?
                .query_row(params![user_id, key], |row| {
                    Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?))
                })
                .optional()
                .map_err(sql)?
                .map(|(value, updated_at)| {
                    Ok(UserValue {
                        key: key.to_owned(),
                        value: crate::store::from_stored(&value)
                            .map_err(unreadable(format_args!("user {user_id:?}'s value {key:?}")))?,
                        updated_at,
                    })
                })
                .transpose()
        }))
    }

    fn set_user_value(
        &self,
        user_id: &str,
        key: &str,
        value: Option<Value>,
        updated_at: i64,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        ready(self.transaction(|tx| {
            match value {
                Some(value) => tx
                    .prepare_cached(
                        "INSERT INTO flue_user_values (user_id, key, value, updated_at) VALUES (?1, ?2, ?3, ?4) \
                         ON CONFLICT (user_id, key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at",
                    )
                    .map_err(sql)?
                    .execute(params![user_id, key, user_value_text(&value)?, updated_at])
                    .map_err(sql)?,
                None => tx
                    .prepare_cached("DELETE FROM flue_user_values WHERE user_id = ?1 AND key = ?2")
                    .map_err(sql)?
                    .execute(params![user_id, key])
                    .map_err(sql)?,
            };
            Ok(())
        }))
    }

    fn list_user_values(
        &self,
        user_id: &str,
        query: &UserValuesQuery,
    ) -> BoxFuture<'_, Result<UserValuePage, StoreError>> {
        let limit = query.limit.map_or(-1, |limit| i64::try_from(limit).unwrap_or(i64::MAX));
        let offset = i64::try_from(query.offset).unwrap_or(i64::MAX);
        let prefix = query.prefix.as_str();
        ready(self.read_transaction(|tx| {
            // `substr` compares characters exactly (`LIKE` would treat `%` and `_` in the prefix
            // as wildcards and ignore case).
            let total: i64 = tx
                .prepare_cached(
                    "SELECT count(*) FROM flue_user_values WHERE user_id = ?1 AND substr(key, 1, length(?2)) = ?2",
                )
                .map_err(sql)?
                .query_row(params![user_id, prefix], |row| row.get(0))
                .map_err(sql)?;
            let mut statement = tx
                .prepare_cached(
                    "SELECT key, value, updated_at FROM flue_user_values \
                     WHERE user_id = ?1 AND substr(key, 1, length(?2)) = ?2 ORDER BY key LIMIT ?3 OFFSET ?4",
                )
                .map_err(sql)?;
            let rows = statement
                .query_map(params![user_id, prefix, limit, offset], |row| {
                    Ok((
                        row.get::<_, String>(0)?,
                        row.get::<_, String>(1)?,
                        row.get::<_, i64>(2)?,
                    ))
                })
                .map_err(sql)?;
            let mut entries = Vec::new();
            for row in rows {
                let (key, value, updated_at) = row.map_err(sql)?;
                let value = crate::store::from_stored(&value)
                    .map_err(unreadable(format_args!("user {user_id:?}'s value {key:?}")))?;
                entries.push(UserValue { key, value, updated_at });
            }
            Ok(UserValuePage {
                entries,
                total: usize::try_from(total).unwrap_or(0),
            })
        }))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use super::*;

    /// Checkpoints run beside the writer only on a SQLite with the WAL-reset fix (3.51.3), as
    /// the bundled one is; a file store checkpoints so when it links one.
    #[test]
    fn only_a_sqlite_with_the_wal_reset_fix_checkpoints_in_the_background() {
        assert!(!checkpoints_in_background(3_051_002));
        assert!(!checkpoints_in_background(3_045_000));
        assert!(checkpoints_in_background(3_051_003));
        assert!(checkpoints_in_background(3_052_000));
        let dir = std::env::temp_dir().join(format!("flue-sqlite-checkpoints-{}", new_id("t")));
        let store = SqliteStore::open(dir.join("flue.db")).unwrap();
        // The bundled SQLite is new enough; a system one linked instead may not be.
        assert_eq!(
            store.checkpointer.is_some(),
            checkpoints_in_background(rusqlite::version_number()),
            "{}",
            rusqlite::version()
        );
        drop(store);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A dropped store has let go of its file: the checkpointer's connection is closed too,
    /// so a connection opened right after can take the file over (leave WAL mode, which needs
    /// every other connection gone).
    #[test]
    fn a_dropped_store_has_closed_its_file() {
        let dir = std::env::temp_dir().join(format!("flue-sqlite-dropped-{}", new_id("t")));
        for round in 0..10 {
            let path = dir.join(format!("flue-{round}.db"));
            let store = SqliteStore::open(&path).unwrap();
            now(store.admit(admission("a", "s-1", None))).unwrap();
            drop(store);
            let next = Connection::open(&path).unwrap();
            let mode: String = next
                .query_row("PRAGMA journal_mode = DELETE", [], |row| row.get(0))
                .unwrap();
            assert_eq!(mode, "delete", "round {round}");
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    fn page_size(store: &SqliteStore) -> i64 {
        pragma(store, "page_size")
    }

    fn pragma(store: &SqliteStore, name: &str) -> i64 {
        store
            .lock()
            .connection
            .query_row(&format!("PRAGMA {name}"), [], |row| row.get(0))
            .unwrap()
    }

    /// A new database gets the store's small pages; one created with other pages (an earlier
    /// build's 4 KiB) keeps them, and its rows read and write as before.
    #[test]
    fn a_new_database_has_small_pages_and_an_existing_one_keeps_its_own() {
        let dir = std::env::temp_dir().join(format!("flue-sqlite-pages-{}", new_id("t")));
        let fresh = SqliteStore::open(dir.join("fresh.db")).unwrap();
        assert_eq!(page_size(&fresh), i64::from(SqliteStore::PAGE_SIZE));
        assert_eq!(
            page_size(&SqliteStore::in_memory().unwrap()),
            i64::from(SqliteStore::PAGE_SIZE)
        );

        let path = dir.join("earlier.db");
        let store = SqliteStore::open(&path).unwrap();
        futures_util::FutureExt::now_or_never(store.admit(admission("kept", "s-1", None)))
            .unwrap()
            .unwrap();
        drop(store);
        // What an earlier build made: the same rows in 4 KiB pages.
        let connection = open_exclusive(&path).unwrap();
        connection
            .execute_batch("PRAGMA busy_timeout = 5000; PRAGMA journal_mode = DELETE; PRAGMA page_size = 4096; VACUUM;")
            .unwrap();
        drop(connection);
        let store = SqliteStore::open(&path).unwrap();
        assert_eq!(page_size(&store), 4096);
        // Its WAL is cut back at the size its pages make in a cycle, not at the small pages'.
        assert_eq!(pragma(&store, "journal_size_limit"), SqliteStore::wal_size_limit(4096));
        assert_eq!(
            pragma(&fresh, "journal_size_limit"),
            SqliteStore::wal_size_limit(SqliteStore::PAGE_SIZE)
        );
        let kept = futures_util::FutureExt::now_or_never(store.submission("s-1"))
            .unwrap()
            .unwrap();
        assert!(kept.is_some());
        futures_util::FutureExt::now_or_never(store.admit(admission("kept", "s-2", None)))
            .unwrap()
            .unwrap();
        drop(store);
        let _ = std::fs::remove_dir_all(dir);
    }

    fn instance_count(store: &SqliteStore) -> i64 {
        store
            .read_transaction(|connection| {
                connection
                    .query_row("SELECT COUNT(*) FROM flue_instances", [], |row| row.get(0))
                    .map_err(sql)
            })
            .unwrap()
    }

    #[test]
    fn full_sync_is_set_on_the_writing_connection_and_normal_is_the_default() {
        let dir = std::env::temp_dir().join(format!("flue-sqlite-sync-{}", new_id("t")));
        let synchronous = |store: &SqliteStore| -> i64 {
            store
                .lock()
                .connection
                .query_row("PRAGMA synchronous", [], |row| row.get(0))
                .unwrap()
        };
        let store = SqliteStore::open(dir.join("default.db")).unwrap();
        assert_eq!(synchronous(&store), 1, "NORMAL");
        let store = SqliteStore::open(dir.join("full.db"))
            .unwrap()
            .with_full_sync()
            .unwrap();
        assert_eq!(synchronous(&store), 2, "FULL");
        drop(store);
        let _ = std::fs::remove_dir_all(dir);
    }

    fn insert_instance(connection: &Connection, id: &str) -> Result<(), StoreError> {
        connection
            .execute(
                "INSERT INTO flue_instances (agent, id, uid, next_offset) VALUES ('a', ?1, 'u', 0)",
                params![id],
            )
            .map(drop)
            .map_err(sql)
    }

    #[test]
    fn a_transaction_that_fails_after_writing_is_rolled_back_and_the_next_one_runs() {
        let store = SqliteStore::in_memory().unwrap();
        let failed = store.transaction(|connection| {
            insert_instance(connection, "written-then-failed")?;
            Err::<(), _>(StoreError::Other("the rest failed".into()))
        });
        assert!(failed.is_err());
        assert_eq!(instance_count(&store), 0, "the failed transaction's write is gone");
        store
            .transaction(|connection| insert_instance(connection, "kept"))
            .unwrap();
        assert_eq!(instance_count(&store), 1);
    }

    #[test]
    fn an_append_lands_after_the_streams_last_batch_and_says_why_when_it_cannot() {
        let store = SqliteStore::in_memory().unwrap();
        let key = |id: &str| InstanceKey::new("a", id.to_owned());
        let batch = [super::super::birth_record("u", None)];
        let outcome =
            |id: &str, fence: Option<&AttemptRef>| store.transaction(|tx| append_batch(tx, &key(id), &batch, fence));
        store
            .transaction(|tx| {
                // A migrated instance's stream is negative; another stream's batches sit just
                // past it; a third stream is one batch from full.
                for (id, stream) in [("migrated", -2_i64), ("neighbour", -1), ("nearly-full", 7)] {
                    tx.execute(
                        "INSERT INTO flue_instances (agent, id, uid, next_offset, stream) VALUES ('a', ?1, 'u', 0, ?2)",
                        params![id, stream],
                    )
                    .map_err(sql)?;
                }
                for position in [stream_start(-1), stream_start(-1) + 5, stream_start(8) - 2] {
                    tx.execute(
                        "INSERT INTO flue_batches (position, records) VALUES (?1, '[]')",
                        params![position],
                    )
                    .map_err(sql)?;
                }
                Ok(())
            })
            .unwrap();
        // The negative stream is empty (the neighbour's batches do not count), then grows.
        assert_eq!(outcome("migrated", None).unwrap(), 0);
        assert_eq!(outcome("migrated", None).unwrap(), 1);
        assert_eq!(outcome("neighbour", None).unwrap(), 6);
        assert_eq!(outcome("nearly-full", None).unwrap(), STREAM_CAPACITY - 1);
        let full = outcome("nearly-full", None).unwrap_err().to_string();
        assert!(full.contains("is full"), "{full}");
        let missing = outcome("missing", None).unwrap_err().to_string();
        assert!(missing.contains("no stream"), "{missing}");
        let stranger = AttemptRef {
            submission_id: "sub_none".into(),
            attempt_id: "attempt_none".into(),
        };
        assert!(matches!(
            outcome("migrated", Some(&stranger)),
            Err(StoreError::Fenced(_))
        ));
        // Nothing the refused appends tried was written.
        let batches: i64 = store
            .read_transaction(|tx| {
                tx.query_row("SELECT COUNT(*) FROM flue_batches", [], |row| row.get(0))
                    .map_err(sql)
            })
            .unwrap();
        assert_eq!(batches, 3 + 4);
    }

    /// Past 2^30 admissions, the instances created take stream numbers from a counter (from
    /// 2^30 up), not their admissions' sequences: the numbers last for 2^30 more instances
    /// however many submissions are admitted.
    #[test]
    fn instances_created_past_a_billion_admissions_are_numbered_by_a_counter() {
        use crate::store::{Admission, SubmissionKind, UidCondition};
        let store = SqliteStore::in_memory().unwrap();
        let admit = |id: &str, submission: &str| {
            futures_util::FutureExt::now_or_never(store.admit(Admission {
                key: InstanceKey::new("a", id.to_owned()),
                submission_id: submission.to_owned(),
                keyed: false,
                kind: SubmissionKind::Dispatch,
                message: flue_core::message::DeliveredMessage::user("hi"),
                initial_data: None,
                uid: UidCondition::Any,
                max_attempts: 10,
                timeout_ms: 60_000,
                claim: None,
                trace: None,
            }))
            .unwrap()
        };
        let stream_of = |id: &str| {
            store
                .transaction(|tx| Ok(instance_row(tx, &InstanceKey::new("a", id.to_owned()))?.map(|(_, s)| s)))
                .unwrap()
                .unwrap()
        };
        admit("early", "s-1").unwrap();
        assert_eq!(stream_of("early"), 1, "its admission's sequence");
        // A billion admissions later.
        store
            .transaction(|tx| {
                tx.execute(
                    "UPDATE flue_submissions SET sequence = ?1 WHERE id = 's-1'",
                    [SEQUENCE_NUMBERED_STREAMS - 1],
                )
                .map(drop)
                .map_err(sql)
            })
            .unwrap();
        store.reload_index();
        admit("late-1", "s-2").unwrap();
        admit("early", "s-3").unwrap();
        admit("late-2", "s-4").unwrap();
        assert_eq!(
            (stream_of("late-1"), stream_of("late-2")),
            (SEQUENCE_NUMBERED_STREAMS, SEQUENCE_NUMBERED_STREAMS + 1),
            "counted, not the admissions' sequences"
        );
        for id in ["early", "late-1", "late-2"] {
            let batches =
                futures_util::FutureExt::now_or_never(store.read(&InstanceKey::new("a", id.to_owned()), None))
                    .unwrap()
                    .unwrap();
            assert_eq!(batches.len(), 1, "{id}: its own birth batch only");
        }
        // The last number given, then none.
        store
            .transaction(|tx| set_stream_counter(tx, "highest_stream", (1 << 31) - 3))
            .unwrap();
        admit("last", "s-5").unwrap();
        assert_eq!(stream_of("last"), (1 << 31) - 2);
        // The last stream holds its batches like any other (its range's end fits in 64 bits).
        let last = InstanceKey::new("a", "last");
        futures_util::FutureExt::now_or_never(store.append(
            &last,
            vec![super::super::birth_record("u", None)].into(),
            None,
        ))
        .unwrap()
        .unwrap();
        let batches = futures_util::FutureExt::now_or_never(store.read(&last, None))
            .unwrap()
            .unwrap();
        assert_eq!(batches.iter().map(|batch| batch.offset).collect::<Vec<_>>(), [0, 1]);
        let error = admit("one-too-many", "s-6").unwrap_err();
        assert!(error.to_string().contains("no stream number is left"), "{error}");
    }

    /// Child streams take numbers below every other, from a counter in `flue_meta` (a database
    /// without it, such as one whose migrated instances hold negative numbers, is scanned).
    #[test]
    fn child_streams_are_numbered_below_every_other_without_scanning_the_instances() {
        let store = SqliteStore::in_memory().unwrap();
        let key = |id: &str| InstanceKey::new("a", id.to_owned());
        store
            .transaction(|tx| {
                insert_instance(tx, "parent")?;
                tx.execute(
                    "INSERT INTO flue_instances (agent, id, uid, next_offset, stream) VALUES ('a', 'migrated', 'u', 0, -3)",
                    [],
                )
                .map_err(sql)?;
                append_batch(tx, &key("parent"), &[super::super::birth_record("u", None)], None).map(drop)
            })
            .unwrap();
        let stream_of = |id: &str| {
            store
                .transaction(|tx| Ok(instance_row(tx, &key(id))?.map(|(_, stream)| stream)))
                .unwrap()
        };
        let kept = || {
            store
                .transaction(|tx| {
                    tx.query_row("SELECT value FROM flue_meta WHERE key = 'lowest_stream'", [], |row| {
                        row.get::<_, String>(0)
                    })
                    .optional()
                    .map_err(sql)
                })
                .unwrap()
        };
        let create = |id: &str| {
            let link: Arc<[Record]> = vec![super::super::birth_record("link", None)].into();
            let birth: Arc<[Record]> = vec![super::super::birth_record(id, None)].into();
            futures_util::FutureExt::now_or_never(store.create_child(&key("parent"), link, &key(id), birth, None))
                .unwrap()
        };
        assert_eq!(kept(), None);
        create("child-1").unwrap();
        assert_eq!(stream_of("child-1"), Some(-4), "below the migrated instance's");
        assert_eq!(kept().as_deref(), Some("-4"));
        // From now on the counter answers.
        create("child-2").unwrap();
        assert_eq!(stream_of("child-2"), Some(-5));
        // A counter that does not parse is rebuilt from the instances.
        store
            .transaction(|tx| {
                tx.execute("UPDATE flue_meta SET value = 'x' WHERE key = 'lowest_stream'", [])
                    .map(drop)
                    .map_err(sql)
            })
            .unwrap();
        create("child-3").unwrap();
        assert_eq!(stream_of("child-3"), Some(-6));
        assert!(create("child-3").is_err(), "a child is created once");
        assert_eq!(kept().as_deref(), Some("-6"));
        // A build before the counter (rolled back to) created a child at the next number and
        // left the counter as it was: the number is seen taken, and the next below the
        // lowest is given (not the taken one, whose birth batch would fail for ever).
        store
            .transaction(|tx| {
                tx.execute(
                    "INSERT INTO flue_instances (agent, id, uid, next_offset, stream) VALUES ('a', 'old-child', 'u', 0, -7)",
                    [],
                )
                .map_err(sql)?;
                tx.execute(
                    "INSERT INTO flue_batches (position, records) VALUES (?1, '[]')",
                    [-7_i64 << 32],
                )
                .map(drop)
                .map_err(sql)
            })
            .unwrap();
        store.reload_index();
        create("child-4").unwrap();
        assert_eq!(stream_of("child-4"), Some(-8));
        assert_eq!(kept().as_deref(), Some("-8"));
    }

    #[test]
    fn a_panic_inside_a_transaction_rolls_it_back() {
        let store = SqliteStore::in_memory().unwrap();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            store.transaction(|connection| -> Result<(), StoreError> {
                insert_instance(connection, "written-then-panicked")?;
                panic!("a bug between two statements");
            })
        }));
        assert!(panicked.is_err());
        assert_eq!(instance_count(&store), 0);
        store
            .transaction(|connection| insert_instance(connection, "kept"))
            .unwrap();
        assert_eq!(instance_count(&store), 1);
    }

    /// A value nested 500 deep (past the 127 serde_json parses, a tool's argument or a state
    /// value can be, and within what a store reads back), two levels under its record and
    /// batch.
    fn deeply_nested() -> serde_json::Value {
        let mut value = serde_json::json!("core");
        for _ in 0..500 {
            value = serde_json::json!([value]);
        }
        value
    }

    /// What a store wrote reads back, however deep a value in it is nested: past serde_json's
    /// limit once in its record, the instance would be unreadable for good.
    #[tokio::test]
    async fn a_value_nested_past_jsons_parse_limit_reads_back_in_its_batch_and_its_submission() {
        use crate::store::Store as _;
        let store = SqliteStore::in_memory().unwrap();
        let mut created = admission("deep", "sub-deep", None);
        created.initial_data = Some(deeply_nested());
        store.admit(created).await.unwrap();
        let key = InstanceKey::new("a", "deep");
        let record = crate::record::Record {
            id: "rec-deep".into(),
            submission_id: None,
            attempt_id: None,
            timestamp: "2026-12-06T00:00:00.000Z".into(),
            body: crate::record::RecordBody::StateWrite {
                name: "notes".into(),
                value: deeply_nested(),
            },
        };
        store.append(&key, vec![record.clone()].into(), None).await.unwrap();
        let batches = store.read(&key, None).await.unwrap();
        assert_eq!(batches.last().unwrap().records[0], record);
        let row = store.submission("sub-deep").await.unwrap().unwrap();
        assert_eq!(row.initial_data, Some(deeply_nested()));
    }

    fn admission(instance: &str, submission: &str, claim: Option<Claim>) -> crate::store::Admission {
        crate::store::Admission {
            key: InstanceKey::new("a", instance.to_owned()),
            submission_id: submission.to_owned(),
            keyed: false,
            kind: crate::store::SubmissionKind::Dispatch,
            message: flue_core::message::DeliveredMessage::user("hi"),
            initial_data: None,
            uid: crate::store::UidCondition::Any,
            max_attempts: 10,
            timeout_ms: 60_000,
            claim,
            trace: None,
        }
    }

    fn claim(attempt: &str) -> Claim {
        Claim {
            attempt_id: attempt.to_owned(),
            owner_id: "owner".into(),
            lease_until_ms: u64::MAX,
        }
    }

    fn attempt(submission: &str, attempt: &str) -> AttemptRef {
        AttemptRef {
            submission_id: submission.to_owned(),
            attempt_id: attempt.to_owned(),
        }
    }

    fn now<T>(future: BoxFuture<'_, T>) -> T {
        futures_util::FutureExt::now_or_never(future).expect("the SQLite store answers at once")
    }

    fn record() -> Arc<[Record]> {
        vec![super::super::birth_record("u", None)].into()
    }

    /// The index answers the fence, the queue and the stream's end; when another store on the
    /// same file commits (another connection), the next transaction reads the index again
    /// instead of trusting what it knew.
    #[test]
    fn another_stores_commits_on_the_same_file_are_seen_by_the_index() {
        let dir = std::env::temp_dir().join(format!("flue-sqlite-index-{}", new_id("t")));
        let first = SqliteStore::open(dir.join("flue.db")).unwrap();
        let second = SqliteStore::open(dir.join("flue.db")).unwrap();
        let key = InstanceKey::new("a", "k");
        now(first.admit(admission("k", "s-1", Some(claim("at-1"))))).unwrap();
        assert_eq!(now(first.append(&key, record(), Some(&attempt("s-1", "at-1")))), Ok(1));
        assert_eq!(now(first.read(&key, Some(1))), Ok(Vec::new()), "up to date");
        // The other store writes the stream's next batch, then settles the submission.
        assert_eq!(now(second.append(&key, record(), Some(&attempt("s-1", "at-1")))), Ok(2));
        let offsets = |batches: Vec<Batch>| batches.iter().map(|batch| batch.offset).collect::<Vec<_>>();
        assert_eq!(
            now(first.read(&key, Some(1))).map(offsets),
            Ok(vec![2]),
            "a reader the index called up to date reads the other's batch"
        );
        assert_eq!(now(first.last_offset(&key)), Ok(Some(2)));
        assert_eq!(
            now(first.append(&key, record(), None)),
            Ok(3),
            "after the other's batch"
        );
        now(second.settle(&attempt("s-1", "at-1"), Outcome::Completed, None, Vec::new())).unwrap();
        assert!(matches!(
            now(first.append(&key, record(), Some(&attempt("s-1", "at-1")))),
            Err(StoreError::Fenced(_))
        ));
        // A delivery the other store queued is seen at the next turn boundary.
        now(first.admit(admission("k", "s-2", Some(claim("at-2"))))).unwrap();
        now(second.admit(admission("k", "s-3", None))).unwrap();
        assert_eq!(now(first.has_queued(&key)), Ok(true));
        let joined = now(first.claim_joinable(&attempt("s-2", "at-2"))).unwrap();
        assert_eq!(joined.iter().map(|row| row.id.as_str()).collect::<Vec<_>>(), ["s-3"]);
        drop((first, second));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A running row the index does not hold whole (one an earlier opening of the file
    /// claimed, one too large to keep) is read from the file: its settlement and requeue work
    /// as for a row the index holds.
    #[test]
    fn a_running_row_the_index_does_not_hold_is_read_from_the_file() {
        let dir = std::env::temp_dir().join(format!("flue-sqlite-rows-{}", new_id("t")));
        let path = dir.join("flue.db");
        let held =
            |store: &SqliteStore, id: &str| store.lock().index.unsettled(id).map(|entry| entry.running.is_some());
        let store = SqliteStore::open(&path).unwrap();
        now(store.admit(admission("k", "s-1", Some(claim("at-1"))))).unwrap();
        assert_eq!(held(&store, "s-1"), Some(true));
        let mut large = admission("big", "s-2", Some(claim("at-2")));
        large.message = flue_core::message::DeliveredMessage::user("x".repeat(300_000));
        now(store.admit(large)).unwrap();
        assert_eq!(held(&store, "s-2"), Some(false), "too large to keep");
        assert!(
            store.lock().json.capacity() <= JSON_KEPT_BYTES,
            "nor is the buffer its JSON was written in"
        );
        assert_eq!(now(store.requeue(&attempt("s-2", "at-2"))), Ok(true));
        drop(store);
        let store = SqliteStore::open(&path).unwrap();
        assert_eq!(
            held(&store, "s-1"),
            Some(false),
            "a reopened store reads running rows lazily"
        );
        now(store.settle(&attempt("s-1", "at-1"), Outcome::Completed, None, Vec::new())).unwrap();
        let settled = now(store.submission("s-1")).unwrap().unwrap();
        assert_eq!(settled.status, SubmissionStatus::Settled);
        assert_eq!(settled.attempt_id.as_deref(), Some("at-1"));
        let requeued = now(store.submission("s-2")).unwrap().unwrap();
        assert_eq!(requeued.status, SubmissionStatus::Queued);
        drop(store);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A user value this build cannot read fails its read and its listing with an error
    /// naming the user and the key, not a bare parse error.
    #[test]
    fn an_unreadable_user_value_is_named_in_its_error() {
        let store = SqliteStore::in_memory().unwrap();
        now(store.set_user_value("u-1", "prefs", Some(serde_json::json!({"dark": true})), 1)).unwrap();
        store
            .lock()
            .connection
            .execute(
                "UPDATE flue_user_values SET value = '{\"dark\":' WHERE key = 'prefs'",
                [],
            )
            .unwrap();
        let read = now(store.user_value("u-1", "prefs")).unwrap_err().to_string();
        assert!(read.contains(r#"user "u-1"'s value "prefs" does not parse"#), "{read}");
        let query = UserValuesQuery {
            prefix: String::new(),
            limit: None,
            offset: 0,
        };
        let listed = now(store.list_user_values("u-1", &query)).unwrap_err().to_string();
        assert!(
            listed.contains(r#"user "u-1"'s value "prefs" does not parse"#),
            "{listed}"
        );
    }

    /// A running row whose JSON this build cannot read is left out of the node-wide scans (the
    /// leases to take over, the aborts to deliver, the leases to renew): the other instances'
    /// work goes on.
    #[test]
    fn an_unreadable_row_is_left_out_of_the_node_wide_scans() {
        let dir = std::env::temp_dir().join(format!("flue-sqlite-unreadable-{}", new_id("t")));
        let path = dir.join("flue.db");
        let store = SqliteStore::open(&path).unwrap();
        let lapsing = |attempt: &str| Claim {
            lease_until_ms: 5,
            ..claim(attempt)
        };
        now(store.admit(admission("a", "s-1", Some(lapsing("at-1"))))).unwrap();
        now(store.admit(admission("b", "s-2", Some(lapsing("at-2"))))).unwrap();
        now(store.request_abort(&InstanceKey::new("a", "b"))).unwrap();
        // Another connection damages the first row (a newer build's, say; in this process,
        // through the store's VFS).
        let other =
            rusqlite::Connection::open_with_flags_and_vfs(&path, rusqlite::OpenFlags::default(), vfs::NAME).unwrap();
        other
            .execute("UPDATE flue_submissions SET data = '{\"id\": 7}' WHERE id = 's-1'", [])
            .unwrap();
        drop(other);
        let expired: Vec<String> = now(store.expired(10)).unwrap().into_iter().map(|row| row.id).collect();
        assert_eq!(expired, ["s-2"]);
        let attempts = ["at-1".to_owned(), "at-2".to_owned()];
        assert_eq!(now(store.aborts_requested(&attempts)), Ok(vec!["at-2".to_owned()]));
        // The node's heartbeat renews the other leases.
        assert_eq!(now(store.renew_leases("owner", &attempts, 50)), Ok(1));
        assert!(now(store.expired(10)).unwrap().is_empty());
        // Its own reads say why, naming it.
        let error = now(store.submission("s-1")).unwrap_err().to_string();
        assert!(error.contains("the row of submission s-1 does not parse"), "{error}");
        let error = now(store.claim_next(&InstanceKey::new("a", "a"), &claim("at-3")))
            .unwrap_err()
            .to_string();
        assert!(error.contains("the submission row 1 does not parse"), "{error}");
        drop(store);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// An unsettled row whose state is not JSON at all (damaged by hand, cut short) does not
    /// keep the store from opening: the layout's refill of the fence column skips it, and the
    /// store reads it as unreadable.
    #[test]
    fn a_row_whose_state_is_not_json_does_not_keep_the_store_from_opening() {
        let dir = std::env::temp_dir().join(format!("flue-sqlite-damaged-{}", new_id("t")));
        let path = dir.join("flue.db");
        let store = SqliteStore::open(&path).unwrap();
        now(store.admit(admission("a", "s-1", None))).unwrap();
        now(store.admit(admission("b", "s-2", None))).unwrap();
        drop(store);
        let other = open_exclusive(&path).unwrap();
        other.busy_timeout(std::time::Duration::from_secs(5)).unwrap();
        other
            .execute(
                "UPDATE flue_submissions SET data = '{\"id\": \"s-1\", \"sta' WHERE id = 's-1'",
                [],
            )
            .unwrap();
        drop(other);
        let store = SqliteStore::open(&path).unwrap();
        assert!(now(store.submission("s-1")).is_err());
        assert!(now(store.submission("s-2")).unwrap().is_some());
        drop(store);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// JSON asked for while the transaction's buffer holds other JSON is written apart: both
    /// texts stay whole, and nothing panics.
    #[test]
    fn json_asked_for_inside_json_gets_a_buffer_of_its_own() {
        let store = SqliteStore::in_memory().unwrap();
        let texts = store
            .transaction(|tx| {
                tx.with_json(&["outer"], "outer", |outer| {
                    tx.with_json(&["inner"], "inner", |inner| Ok((outer.0.to_vec(), inner.0.to_vec())))
                })
            })
            .unwrap();
        assert_eq!(texts, (br#"["outer"]"#.to_vec(), br#"["inner"]"#.to_vec()));
    }

    /// A transaction that fails after changing the index leaves it as it was: the next append
    /// takes the offset the failed one would have, and a claim that rolled back does not pass
    /// the fence.
    #[test]
    fn a_failed_transaction_leaves_the_index_as_it_was() {
        let store = SqliteStore::in_memory().unwrap();
        let key = InstanceKey::new("a", "k");
        now(store.admit(admission("k", "s-1", None))).unwrap();
        let failed = store.transaction(|tx| -> Result<(), StoreError> {
            append_batch(tx, &key, &record(), None)?;
            let _ = claim_head(tx, &key, &claim("at-1"))?;
            assert!(
                owner_of(tx, &attempt("s-1", "at-1")).is_some(),
                "seen inside its transaction"
            );
            Err(StoreError::Other("a later statement failed".into()))
        });
        assert!(failed.is_err());
        assert_eq!(now(store.last_offset(&key)), Ok(Some(0)), "only the birth batch");
        assert!(matches!(
            now(store.append(&key, record(), Some(&attempt("s-1", "at-1")))),
            Err(StoreError::Fenced(_))
        ));
        assert_eq!(now(store.append(&key, record(), None)), Ok(1));
        assert_eq!(now(store.has_queued(&key)), Ok(true), "still queued");
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            store.transaction(|tx| -> Result<(), StoreError> {
                append_batch(tx, &key, &record(), None)?;
                panic!("a bug between two statements");
            })
        }));
        assert!(panicked.is_err());
        assert_eq!(now(store.append(&key, record(), None)), Ok(2));
    }

    /// A write SQLite refuses (here a batch the index did not know of, written behind it)
    /// makes the next transaction read the index from the file again, instead of failing the
    /// same way for good.
    #[test]
    fn a_write_that_fails_on_sqlites_side_makes_the_next_transaction_read_the_index_again() {
        let store = SqliteStore::in_memory().unwrap();
        let key = InstanceKey::new("a", "k");
        now(store.admit(admission("k", "s-1", None))).unwrap();
        // Through the store's own transaction, so no data version tells of it.
        store
            .transaction(|tx| {
                tx.execute(
                    "INSERT INTO flue_batches (position, records)
                         SELECT (stream << 32) + 1, '[]' FROM flue_instances WHERE id = 'k'",
                    [],
                )
                .map_err(sql)
            })
            .unwrap();
        let refused = now(store.append(&key, record(), None)).unwrap_err();
        assert!(refused.to_string().contains("UNIQUE"), "{refused}");
        assert_eq!(
            now(store.read(&key, Some(0))).map(|batches| batches.len()),
            Ok(1),
            "an index in doubt does not tell a reader it is up to date"
        );
        assert_eq!(now(store.append(&key, record(), None)), Ok(2));
    }
}
