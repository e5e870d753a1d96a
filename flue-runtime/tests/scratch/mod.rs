//! Scratch directories for tests that need real files (SQLite databases, crash-test state).
//!
//! Every directory of one test process lives under `<tmp>/flue-tests-<uid>/<pid>/`. Rust tests have
//! no teardown hook, so a process, when it first asks for a directory, removes the roots of
//! test processes that have exited (on Linux, where `/proc` says which have; elsewhere the
//! roots stay for the system's temporary-file cleaning).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// A fresh, empty directory whose name starts with `label`.
pub fn dir(label: &str) -> PathBuf {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let root = ROOT.get_or_init(|| {
        // One base per user: another user's (made by a run as root, say) is not writable.
        let base = std::env::temp_dir().join(format!("flue-tests-{}", user_id()));
        remove_exited(&base);
        base.join(std::process::id().to_string())
    });
    let dir = root.join(format!("{label}-{}", NEXT.fetch_add(1, Ordering::Relaxed)));
    std::fs::create_dir_all(&dir).unwrap_or_else(|error| panic!("cannot create {}: {error}", dir.display()));
    dir
}

/// Removes the roots under `base` whose process has exited.
fn remove_exited(base: &Path) {
    if !cfg!(target_os = "linux") {
        return;
    }
    let Ok(entries) = std::fs::read_dir(base) else { return };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// The user running the tests (its uid on Unix).
fn user_id() -> String {
    #[cfg(unix)]
    {
        // SAFETY: geteuid takes nothing and cannot fail.
        unsafe { libc::geteuid() }.to_string()
    }
    #[cfg(not(unix))]
    {
        std::env::var("USERNAME").unwrap_or_else(|_| "user".to_owned())
    }
}
