//! The store's VFS: SQLite's `unix-excl` (see [`super::open_exclusive`]) with each commit's
//! WAL frames written in one system call.
//!
//! SQLite writes a WAL frame with two `pwrite` calls, its 24-byte header and then its page, so
//! a commit of three pages makes six trips through the kernel's page-cache write path (each
//! header a write of part of a page). This VFS opens every file through `unix-excl` and wraps
//! the WAL files only. A write that appends at the WAL's end is gathered; the gathered bytes
//! are written in one call when the commit frame's page arrives (the frame whose header
//! carries the database size), inside that write, before SQLite publishes the commit. So a
//! commit that returns has its frames in the file as before, and a failed write fails the
//! commit as before. Every other access to the WAL through the file (a read, a sync, its size,
//! a truncation, closing it, a file control, a write that is not an append: a rewritten
//! checksum, a frame overwritten in place) writes what is gathered first. A write at offset 0
//! (the header of a WAL that starts over) begins the appends anew. Frames gathered by a
//! transaction that rolls back are written, or not, as harmlessly as SQLite's own writes of
//! them would be: they are beyond the last commit and the next transaction overwrites them.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use rusqlite::ffi;

/// The name connections open the store's files with.
pub(super) const NAME: &CStr = c"flue-excl";

/// Gathered appends are written before they would pass this size, commit frame or not (a large
/// transaction). `unix-excl` writes at most 128 KiB less one byte per call.
const MAX_GATHERED: usize = 96 * 1024;

/// Registers the VFS with SQLite (once per process).
pub(super) fn register() -> Result<(), String> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            // SAFETY: `sqlite3_vfs_find` takes a NUL-terminated name; the VFS it returns is
            // SQLite's own and lives as long as the process. The copy registered here is leaked,
            // as SQLite keeps the pointer for good.
            unsafe {
                let inner = ffi::sqlite3_vfs_find(c"unix-excl".as_ptr());
                if inner.is_null() {
                    return Err("sqlite: this SQLite has no unix-excl VFS".to_owned());
                }
                let mut vfs = *inner;
                // The unix VFS's other methods do not look at the VFS they are called through.
                let offset = usize::try_from((*inner).szOsFile)
                    .map_err(|_| "sqlite: unix-excl's file handle has no size".to_owned())?
                    .next_multiple_of(std::mem::align_of::<Trailer>());
                TRAILER_OFFSET.store(offset, Ordering::Relaxed);
                vfs.szOsFile = c_int::try_from(offset + std::mem::size_of::<Trailer>())
                    .map_err(|_| "sqlite: file handle too large".to_owned())?;
                vfs.zName = NAME.as_ptr();
                vfs.pAppData = inner.cast();
                vfs.pNext = std::ptr::null_mut();
                vfs.xOpen = Some(open);
                let rc = ffi::sqlite3_vfs_register(Box::into_raw(Box::new(vfs)), 0);
                if rc == ffi::SQLITE_OK {
                    Ok(())
                } else {
                    Err(format!("sqlite: registering the {NAME:?} VFS failed ({rc})"))
                }
            }
        })
        .clone()
}

/// Where this VFS's own part of a WAL file handle starts: after `unix-excl`'s, aligned (set by
/// [`register`], before any file is opened).
static TRAILER_OFFSET: AtomicUsize = AtomicUsize::new(0);

/// What a WAL file handle carries after `unix-excl`'s part.
struct Trailer {
    /// `unix-excl`'s methods for the file.
    inner: *const ffi::sqlite3_io_methods,
    /// The gathered appends.
    gather: *mut Gather,
}

/// Appends gathered for one write.
#[derive(Default)]
struct Gather {
    /// Where the gathered bytes go.
    start: i64,
    bytes: Vec<u8>,
    /// Where the next append goes: one past the furthest byte written since the WAL last
    /// started over.
    end: i64,
    /// Where the page of a commit frame whose header was just gathered goes.
    commit_page_at: Option<i64>,
}

/// # Safety
/// SQLite calls it as a VFS's `xOpen`, through the VFS [`register`] made.
unsafe extern "C" fn open(
    vfs: *mut ffi::sqlite3_vfs,
    name: *const c_char,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    // SAFETY: `pAppData` is `unix-excl`, set by `register`; SQLite allocated `file` with this
    // VFS's `szOsFile`, which holds `unix-excl`'s part and then the trailer.
    unsafe {
        let inner: *mut ffi::sqlite3_vfs = (*vfs).pAppData.cast();
        let Some(inner_open) = (*inner).xOpen else {
            return ffi::SQLITE_CANTOPEN;
        };
        let rc = inner_open(inner, name, file, flags, out_flags);
        let methods = (*file).pMethods;
        if flags & ffi::SQLITE_OPEN_WAL == 0 || methods.is_null() {
            // Not a WAL, or not opened: `unix-excl`'s handle as it is.
            return rc;
        }
        let trailer = file
            .cast::<u8>()
            .add(TRAILER_OFFSET.load(Ordering::Relaxed))
            .cast::<Trailer>();
        trailer.write(Trailer {
            inner: methods,
            gather: Box::into_raw(Box::default()),
        });
        (*file).pMethods = &WAL_METHODS;
        rc
    }
}

/// The trailer of a WAL handle this VFS opened.
///
/// # Safety
/// `file` is such a handle, open.
unsafe fn trailer<'a>(file: *mut ffi::sqlite3_file) -> &'a Trailer {
    // SAFETY: the caller's promise: `open` wrote the trailer there.
    unsafe {
        &*file
            .cast::<u8>()
            .add(TRAILER_OFFSET.load(Ordering::Relaxed))
            .cast::<Trailer>()
    }
}

/// Writes the gathered bytes (in one call); SQLite's result code.
///
/// # Safety
/// `file` is a WAL handle of this VFS, open.
unsafe fn flush(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: the caller's promise; SQLite uses a handle from one thread at a time.
    unsafe {
        let trailer = trailer(file);
        let gather = &mut *trailer.gather;
        if gather.bytes.is_empty() {
            return ffi::SQLITE_OK;
        }
        let Ok(amount) = c_int::try_from(gather.bytes.len()) else {
            return ffi::SQLITE_IOERR_WRITE;
        };
        let write = (*trailer.inner).xWrite.expect("unix-excl writes");
        let rc = write(file, gather.bytes.as_ptr().cast(), amount, gather.start);
        gather.bytes.clear();
        gather.commit_page_at = None;
        rc
    }
}

/// # Safety
/// SQLite calls it as a WAL handle's `xWrite`.
unsafe extern "C" fn write(file: *mut ffi::sqlite3_file, data: *const c_void, amount: c_int, offset: i64) -> c_int {
    // SAFETY: SQLite's promises for `xWrite`: `data` holds `amount` bytes; the handle is ours.
    unsafe {
        let trailer = trailer(file);
        let gather = &mut *trailer.gather;
        let bytes = std::slice::from_raw_parts(data.cast::<u8>(), usize::try_from(amount).unwrap_or(0));
        if offset == 0 {
            // The WAL starts over: what follows its header are appends again.
            let rc = flush(file);
            if rc != ffi::SQLITE_OK {
                return rc;
            }
            gather.end = 0;
        }
        if offset != gather.end {
            // Not an append (a checksum rewritten, a frame overwritten in place, a transaction
            // after a rolled-back one): written now, after what is gathered.
            let rc = flush(file);
            if rc != ffi::SQLITE_OK {
                return rc;
            }
            let write = (*trailer.inner).xWrite.expect("unix-excl writes");
            let rc = write(file, data, amount, offset);
            gather.end = gather.end.max(offset + i64::from(amount));
            return rc;
        }
        if !gather.bytes.is_empty() && gather.bytes.len() + bytes.len() > MAX_GATHERED {
            let rc = flush(file);
            if rc != ffi::SQLITE_OK {
                return rc;
            }
        }
        if gather.bytes.is_empty() {
            gather.start = offset;
        }
        gather.bytes.extend_from_slice(bytes);
        gather.end = offset + i64::from(amount);
        let commit = gather.commit_page_at == Some(offset);
        // A frame header (24 bytes) with a database size is a commit frame's.
        gather.commit_page_at = (bytes.len() == 24 && bytes[4..8] != [0; 4]).then_some(offset + 24);
        if commit {
            return flush(file);
        }
        ffi::SQLITE_OK
    }
}

/// A method that writes what is gathered first, then forwards.
macro_rules! flushing {
    ($name:ident, $method:ident, ($($arg:ident: $ty:ty),*)) => {
        /// # Safety
        /// SQLite calls it as a WAL handle's method of the same name.
        unsafe extern "C" fn $name(file: *mut ffi::sqlite3_file $(, $arg: $ty)*) -> c_int {
            // SAFETY: the handle is ours, and SQLite's promises for the method hold for the
            // forwarded call.
            unsafe {
                let rc = flush(file);
                if rc != ffi::SQLITE_OK {
                    return rc;
                }
                match (*trailer(file).inner).$method {
                    Some(method) => method(file $(, $arg)*),
                    None => ffi::SQLITE_IOERR,
                }
            }
        }
    };
}

/// A method that forwards as it is.
macro_rules! forwarding {
    ($name:ident, $method:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty, $missing:expr) => {
        /// # Safety
        /// SQLite calls it as a WAL handle's method of the same name.
        unsafe extern "C" fn $name(file: *mut ffi::sqlite3_file $(, $arg: $ty)*) -> $ret {
            // SAFETY: the handle is ours, and SQLite's promises for the method hold for the
            // forwarded call.
            unsafe {
                match (*trailer(file).inner).$method {
                    Some(method) => method(file $(, $arg)*),
                    None => $missing,
                }
            }
        }
    };
}

flushing!(read, xRead, (data: *mut c_void, amount: c_int, offset: i64));
flushing!(truncate, xTruncate, (size: i64));
flushing!(sync, xSync, (flags: c_int));
flushing!(file_size, xFileSize, (size: *mut i64));
flushing!(lock, xLock, (level: c_int));
flushing!(unlock, xUnlock, (level: c_int));
flushing!(file_control, xFileControl, (op: c_int, argument: *mut c_void));
forwarding!(check_reserved_lock, xCheckReservedLock, (out: *mut c_int) -> c_int, ffi::SQLITE_IOERR);
forwarding!(sector_size, xSectorSize, () -> c_int, 4096);
forwarding!(device_characteristics, xDeviceCharacteristics, () -> c_int, 0);
forwarding!(shm_map, xShmMap, (page: c_int, size: c_int, extend: c_int, out: *mut *mut c_void) -> c_int, ffi::SQLITE_IOERR);
forwarding!(shm_lock, xShmLock, (offset: c_int, count: c_int, flags: c_int) -> c_int, ffi::SQLITE_IOERR);
forwarding!(shm_unmap, xShmUnmap, (delete: c_int) -> c_int, ffi::SQLITE_OK);
forwarding!(fetch, xFetch, (offset: i64, amount: c_int, out: *mut *mut c_void) -> c_int, ffi::SQLITE_OK);
forwarding!(unfetch, xUnfetch, (offset: i64, page: *mut c_void) -> c_int, ffi::SQLITE_OK);

/// # Safety
/// SQLite calls it as a WAL handle's `xShmBarrier`.
unsafe extern "C" fn shm_barrier(file: *mut ffi::sqlite3_file) {
    // SAFETY: the handle is ours.
    unsafe {
        if let Some(barrier) = (*trailer(file).inner).xShmBarrier {
            barrier(file);
        }
    }
}

/// # Safety
/// SQLite calls it as a WAL handle's `xClose`, once.
unsafe extern "C" fn close(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: the handle is ours; after `unix-excl` closed it, nothing uses the trailer again.
    unsafe {
        let flushed = flush(file);
        let trailer = trailer(file);
        let (inner, gather) = (trailer.inner, trailer.gather);
        let rc = match (*inner).xClose {
            Some(close) => close(file),
            None => ffi::SQLITE_OK,
        };
        drop(Box::from_raw(gather));
        if flushed == ffi::SQLITE_OK { rc } else { flushed }
    }
}

static WAL_METHODS: ffi::sqlite3_io_methods = ffi::sqlite3_io_methods {
    iVersion: 3,
    xClose: Some(close),
    xRead: Some(read),
    xWrite: Some(write),
    xTruncate: Some(truncate),
    xSync: Some(sync),
    xFileSize: Some(file_size),
    xLock: Some(lock),
    xUnlock: Some(unlock),
    xCheckReservedLock: Some(check_reserved_lock),
    xFileControl: Some(file_control),
    xSectorSize: Some(sector_size),
    xDeviceCharacteristics: Some(device_characteristics),
    xShmMap: Some(shm_map),
    xShmLock: Some(shm_lock),
    xShmBarrier: Some(shm_barrier),
    xShmUnmap: Some(shm_unmap),
    xFetch: Some(fetch),
    xUnfetch: Some(unfetch),
};

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use std::path::{Path, PathBuf};

    use rusqlite::{Connection, OpenFlags};

    use super::*;

    /// A fresh directory of this test's own.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("flue-vfs-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn open(path: &Path) -> Connection {
        register().unwrap();
        let connection = Connection::open_with_flags_and_vfs(path, OpenFlags::default(), NAME).unwrap();
        connection
            .execute_batch("PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA wal_autocheckpoint = 0;")
            .unwrap();
        connection
    }

    /// The database and its WAL as a process killed right now would leave them, opened afresh
    /// (SQLite recovers the WAL: it keeps the frames up to the last commit whose checksums
    /// hold).
    fn crash_copy(path: &Path, dir: &Path) -> Connection {
        let copy = dir.join("copy.db");
        std::fs::copy(path, &copy).unwrap();
        std::fs::copy(path.with_extension("db-wal"), copy.with_extension("db-wal")).unwrap();
        open(&copy)
    }

    fn count(connection: &Connection) -> i64 {
        connection
            .query_row("SELECT COUNT(*) FROM t", [], |row| row.get(0))
            .unwrap()
    }

    #[test]
    fn a_commit_is_in_the_wal_file_when_it_returns() {
        let dir = scratch("commit");
        let path = dir.join("flue.db");
        let writer = open(&path);
        writer
            .execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
            .unwrap();
        let reader = open(&path);
        for id in 1..=50_i64 {
            writer
                .execute(
                    "INSERT INTO t (id, body) VALUES (?1, ?2)",
                    rusqlite::params![id, "x".repeat(300)],
                )
                .unwrap();
            // Another connection reads the WAL through its own handle, and a copy of the files
            // is what a crash now would leave: both see every commit.
            assert_eq!(count(&reader), id);
            if id % 10 == 0 {
                assert_eq!(count(&crash_copy(&path, &dir)), id);
            }
        }
        drop((writer, reader));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn closing_the_last_connection_checkpoints_and_removes_the_wal() {
        let dir = scratch("close");
        let path = dir.join("flue.db");
        let writer = open(&path);
        writer
            .execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
            .unwrap();
        for id in 1..=20_i64 {
            writer
                .execute("INSERT INTO t (id, body) VALUES (?1, 'kept')", [id])
                .unwrap();
        }
        assert!(path.with_extension("db-wal").exists());
        drop(writer);
        assert!(!path.with_extension("db-wal").exists(), "the WAL is gone");
        assert!(
            !path.with_extension("db-shm").exists(),
            "no shared-memory file was made"
        );
        assert_eq!(count(&open(&path)), 20, "its frames are in the database file");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_large_transaction_with_spilled_and_rewritten_frames_survives_a_crash() {
        let dir = scratch("spill");
        let path = dir.join("flue.db");
        let writer = open(&path);
        // A page cache of a few pages: the transaction writes frames before it commits, then
        // writes some pages again (SQLite overwrites their frames in place and rewrites the
        // checksums of the frames after them when it commits).
        writer
            .execute_batch("PRAGMA cache_size = 4; CREATE TABLE t (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
            .unwrap();
        writer.execute_batch("BEGIN").unwrap();
        for id in 1..=400_i64 {
            writer
                .execute(
                    "INSERT INTO t (id, body) VALUES (?1, ?2)",
                    rusqlite::params![id, "a".repeat(900)],
                )
                .unwrap();
        }
        writer.execute("UPDATE t SET body = ?1", [&"b".repeat(900)]).unwrap();
        writer.execute_batch("COMMIT").unwrap();
        assert_eq!(
            count(&crash_copy(&path, &dir)),
            400,
            "the large commit is whole in the file"
        );
        // A later small commit on top, and one that rolls back after spilling.
        writer
            .execute("INSERT INTO t (id, body) VALUES (401, 'last')", [])
            .unwrap();
        writer.execute_batch("BEGIN").unwrap();
        for id in 402..=600_i64 {
            writer
                .execute(
                    "INSERT INTO t (id, body) VALUES (?1, ?2)",
                    rusqlite::params![id, "c".repeat(900)],
                )
                .unwrap();
        }
        writer.execute_batch("ROLLBACK").unwrap();
        writer
            .execute("INSERT INTO t (id, body) VALUES (402, 'after the rollback')", [])
            .unwrap();
        let recovered = crash_copy(&path, &dir);
        assert_eq!(count(&recovered), 402);
        let updated: i64 = recovered
            .query_row("SELECT COUNT(*) FROM t WHERE body = ?1", [&"b".repeat(900)], |row| {
                row.get(0)
            })
            .unwrap();
        assert_eq!(updated, 400);
        let integrity: String = recovered
            .query_row("PRAGMA integrity_check", [], |row| row.get(0))
            .unwrap();
        assert_eq!(integrity, "ok");
        drop((writer, recovered));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
