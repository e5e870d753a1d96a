//! The in-memory environment: a filesystem per instance (per agent and id: two agents'
//! instances of one id do not share files), kept for the process's lifetime (so a later
//! submission of the instance finds its files), without command execution, holding at most
//! [`MAX_VIRTUAL_BYTES`] of files and [`MAX_VIRTUAL_FILES`] files per instance, and
//! [`MAX_ALL_VIRTUAL_BYTES`] across the process's instances: past that, the workspaces no
//! response uses go, least recently used first, before a write is refused. Not durable: a
//! restart starts every instance's workspace empty (use `sandbox::local` for files that
//! last), and so may a long idle spell of an instance on a busy process.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use flue_core::BoxFuture;
use flue_core::sandbox::{DirEntry, ExecOutput, ExecRequest, Sandbox, SandboxError, SandboxFactory};

use super::normalize;

/// Every instance's in-memory filesystem, for the process's lifetime: a factory built afresh
/// by each render (`use_sandbox(virtual_sandbox())`) finds the instance's files again.
/// Keyed by agent and instance id (`create_sandbox` alone, without an agent, keys on `""`).
static WORKSPACES: std::sync::LazyLock<Mutex<HashMap<InstanceOf, Arc<VirtualSandbox>>>> =
    std::sync::LazyLock::new(Mutex::default);

/// An instance: its agent and its id.
type InstanceOf = (String, String);

/// The in-memory sandbox factory (`flue_runtime::sandbox::virtual_sandbox()`).
#[derive(Clone, Copy, Debug, Default)]
pub struct VirtualSandboxFactory;

impl SandboxFactory for VirtualSandboxFactory {
    fn create_sandbox(&self, instance_id: &str) -> BoxFuture<'static, Result<Arc<dyn Sandbox>, SandboxError>> {
        self.create_sandbox_for("", instance_id)
    }

    fn create_sandbox_for(
        &self,
        agent: &str,
        instance_id: &str,
    ) -> BoxFuture<'static, Result<Arc<dyn Sandbox>, SandboxError>> {
        let sandbox = WORKSPACES
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .entry((agent.to_owned(), instance_id.to_owned()))
            .or_default()
            .clone();
        sandbox.used.store(
            USES.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            std::sync::atomic::Ordering::Relaxed,
        );
        Box::pin(async move { Ok(sandbox as Arc<dyn Sandbox>) })
    }
}

/// The most bytes of files one instance's in-memory filesystem holds, and the most files: a
/// model writing ever more (or larger) files fails its writes past them, rather than growing
/// the process's memory for its lifetime.
pub(crate) const MAX_VIRTUAL_BYTES: usize = 256 * 1024 * 1024;
/// See [`MAX_VIRTUAL_BYTES`].
pub(crate) const MAX_VIRTUAL_FILES: usize = 100_000;

/// The most bytes of files the in-memory filesystems of all instances hold together: the
/// workspaces last as long as the process, and every instance id a client ever used would
/// otherwise hold its own [`MAX_VIRTUAL_BYTES`].
pub(crate) const MAX_ALL_VIRTUAL_BYTES: usize = 1024 * 1024 * 1024;

/// The bytes of files all instances' in-memory filesystems hold.
static ALL_BYTES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The count of workspaces handed out, which orders their last uses.
static USES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Takes out of `workspaces` the least recently used ones no response holds (only the map
/// does), until those taken hold `needed` bytes or none is left: what to drop once the map's
/// lock is released (dropping one gives its bytes back).
fn idle_workspaces_to_drop(
    workspaces: &mut HashMap<InstanceOf, Arc<VirtualSandbox>>,
    needed: usize,
) -> Vec<Arc<VirtualSandbox>> {
    let mut idle: Vec<(u64, InstanceOf)> = workspaces
        .iter()
        .filter(|(_, sandbox)| Arc::strong_count(sandbox) == 1)
        .map(|(key, sandbox)| (sandbox.used.load(std::sync::atomic::Ordering::Relaxed), key.clone()))
        .collect();
    idle.sort_unstable();
    let (mut freed, mut dropped) = (0, Vec::new());
    for (_, key) in idle {
        if freed >= needed {
            break;
        }
        if let Some(sandbox) = workspaces.remove(&key) {
            // Idle: nobody holds its lock.
            freed += sandbox.files.try_lock().map_or(0, |files| files.bytes);
            dropped.push(sandbox);
        }
    }
    dropped
}

/// Makes room for `more` bytes among all instances' files, dropping idle workspaces (see
/// [`idle_workspaces_to_drop`]).
fn make_room(more: usize) {
    let needed = (ALL_BYTES.load(std::sync::atomic::Ordering::Acquire) + more).saturating_sub(MAX_ALL_VIRTUAL_BYTES);
    let dropped = idle_workspaces_to_drop(
        &mut WORKSPACES.lock().unwrap_or_else(|poisoned| poisoned.into_inner()),
        needed,
    );
    drop(dropped);
}

/// Counts `more` bytes into `all` when that keeps it within `limit`; `false` (nothing counted)
/// when it would not.
fn reserve(all: &std::sync::atomic::AtomicUsize, more: usize, limit: usize) -> bool {
    use std::sync::atomic::Ordering;
    all.fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
        held.checked_add(more).filter(|total| *total <= limit)
    })
    .is_ok()
}

/// One instance's in-memory filesystem: files by normalized absolute path (directories are
/// implied by the files under them, plus those made explicit by writes).
#[derive(Default)]
pub struct VirtualSandbox {
    files: Mutex<Files>,
    /// When it was last handed out ([`USES`]): idle workspaces go least recently used first.
    used: std::sync::atomic::AtomicU64,
}

/// The files, and their bytes in all.
#[derive(Default)]
struct Files {
    by_path: BTreeMap<String, Vec<u8>>,
    bytes: usize,
}

impl Drop for Files {
    fn drop(&mut self) {
        ALL_BYTES.fetch_sub(self.bytes, std::sync::atomic::Ordering::AcqRel);
    }
}

impl std::ops::Deref for Files {
    type Target = BTreeMap<String, Vec<u8>>;

    fn deref(&self) -> &Self::Target {
        &self.by_path
    }
}

impl Files {
    /// Writes `contents` at `path`, within [`MAX_VIRTUAL_BYTES`] and [`MAX_VIRTUAL_FILES`].
    /// (The bytes counted are those allocated for the files: see [`file_weight`].)
    fn insert(&mut self, path: String, contents: Vec<u8>) -> Result<(), SandboxError> {
        let replaced = self.by_path.get(&path).map(|old| file_weight(&path, old));
        let bytes = self.bytes - replaced.unwrap_or(0) + file_weight(&path, &contents);
        if bytes > MAX_VIRTUAL_BYTES {
            return Err(SandboxError::Io(format!(
                "the in-memory sandbox holds at most {MAX_VIRTUAL_BYTES} bytes of files; this write would make {bytes}"
            )));
        }
        if replaced.is_none() && self.by_path.len() >= MAX_VIRTUAL_FILES {
            return Err(SandboxError::Io(format!(
                "the in-memory sandbox holds at most {MAX_VIRTUAL_FILES} files"
            )));
        }
        let more = bytes.saturating_sub(self.bytes);
        // Past the bound, the workspaces no response uses go first (least recently used),
        // and the write is tried again.
        if more > 0
            && !reserve(&ALL_BYTES, more, MAX_ALL_VIRTUAL_BYTES)
            && !{
                make_room(more);
                reserve(&ALL_BYTES, more, MAX_ALL_VIRTUAL_BYTES)
            }
        {
            return Err(SandboxError::Io(format!(
                "the in-memory sandboxes of this process hold at most {MAX_ALL_VIRTUAL_BYTES} bytes of files together"
            )));
        }
        if bytes < self.bytes {
            ALL_BYTES.fetch_sub(self.bytes - bytes, std::sync::atomic::Ordering::AcqRel);
        }
        self.bytes = bytes;
        self.by_path.insert(path, contents);
        Ok(())
    }

    fn remove(&mut self, path: &str) -> Option<Vec<u8>> {
        let removed = self.by_path.remove(path)?;
        let weight = file_weight(path, &removed);
        self.bytes -= weight;
        ALL_BYTES.fetch_sub(weight, std::sync::atomic::Ordering::AcqRel);
        Some(removed)
    }
}

/// What a file entry beyond its path and contents holds: its share of the map's node and the
/// headers of its path and contents.
const FILE_ENTRY_BYTES: usize = 64;

/// The bytes a file holds: its contents' allocation, its path and its entry. (Counting the
/// contents alone, a hundred thousand empty files under 4 KB paths held some 400 MB that no
/// bound saw.)
fn file_weight(path: &str, contents: &Vec<u8>) -> usize {
    FILE_ENTRY_BYTES + path.len() + contents.capacity()
}

impl VirtualSandbox {
    fn files(&self) -> std::sync::MutexGuard<'_, Files> {
        self.files.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Sandbox for VirtualSandbox {
    fn files_identity(&self) -> Option<String> {
        // One workspace per instance, shared by its submissions.
        Some(format!("virtual:{:p}", std::ptr::from_ref(self)))
    }

    fn read_file(&self, path: &str) -> BoxFuture<'_, Result<Vec<u8>, SandboxError>> {
        let result =
            normalize(path).and_then(|path| self.files().get(&path).cloned().ok_or(SandboxError::NotFound(path)));
        Box::pin(std::future::ready(result))
    }

    fn read_file_with<'a>(
        &'a self,
        path: &str,
        visit: &'a mut (dyn FnMut(&[u8]) -> bool + Send),
    ) -> BoxFuture<'a, Result<(), SandboxError>> {
        // The file is in memory already: given in pieces from there, not copied whole.
        let result = normalize(path).and_then(|path| {
            let files = self.files();
            let bytes = files.get(&path).ok_or(SandboxError::NotFound(path.clone()))?;
            for piece in bytes.chunks(64 * 1024) {
                if !visit(piece) {
                    break;
                }
            }
            Ok(())
        });
        Box::pin(std::future::ready(result))
    }

    fn write_file(&self, path: &str, contents: Vec<u8>) -> BoxFuture<'_, Result<(), SandboxError>> {
        let result = normalize(path).and_then(|path| {
            if path == "/" {
                return Err(SandboxError::Io("cannot write to the root directory".into()));
            }
            let mut files = self.files();
            let prefix = format!("{path}/");
            if files
                .range(prefix.clone()..)
                .next()
                .is_some_and(|(existing, _)| existing.starts_with(&prefix))
            {
                return Err(SandboxError::Io(format!("{path} is a directory")));
            }
            // A path is a file or a directory, not both: no parent of it may be a file.
            if let Some(parent) = path
                .match_indices('/')
                .skip(1)
                .map(|(at, _)| &path[..at])
                .find(|parent| files.contains_key(*parent))
            {
                return Err(SandboxError::Io(format!("{parent} is a file, not a directory")));
            }
            files.insert(path, contents)
        });
        Box::pin(std::future::ready(result))
    }

    fn remove(&self, path: &str) -> BoxFuture<'_, Result<(), SandboxError>> {
        let result =
            normalize(path).and_then(|path| self.files().remove(&path).map(drop).ok_or(SandboxError::NotFound(path)));
        Box::pin(std::future::ready(result))
    }

    fn list_dir(&self, path: &str) -> BoxFuture<'_, Result<Vec<DirEntry>, SandboxError>> {
        let result = normalize(path).and_then(|path| {
            let prefix = if path == "/" {
                "/".to_owned()
            } else {
                format!("{path}/")
            };
            let files = self.files();
            let mut entries: BTreeMap<String, DirEntry> = BTreeMap::new();
            for (file, bytes) in files.range(prefix.clone()..) {
                let Some(rest) = file.strip_prefix(&prefix) else { break };
                match rest.split_once('/') {
                    Some((dir, _)) => {
                        entries.entry(dir.to_owned()).or_insert_with(|| DirEntry {
                            name: dir.to_owned(),
                            is_dir: true,
                            size: 0,
                        });
                    }
                    None => {
                        entries.insert(
                            rest.to_owned(),
                            DirEntry {
                                name: rest.to_owned(),
                                is_dir: false,
                                size: bytes.len() as u64,
                            },
                        );
                    }
                }
            }
            if entries.is_empty() && path != "/" {
                return Err(if files.contains_key(&path) {
                    SandboxError::Io(format!("{path} is not a directory"))
                } else {
                    SandboxError::NotFound(path)
                });
            }
            Ok(entries.into_values().collect())
        });
        Box::pin(std::future::ready(result))
    }

    fn exec(&self, _request: ExecRequest) -> BoxFuture<'_, Result<ExecOutput, SandboxError>> {
        Box::pin(std::future::ready(Err(SandboxError::Unsupported(
            "commands (the in-memory sandbox has no shell; use sandbox::local for one)",
        ))))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    /// Past the bound of all instances' files, the workspaces no response holds go, least
    /// recently used first, until what they held makes room; one a response holds stays.
    #[test]
    fn idle_workspaces_go_least_recently_used_first_to_make_room() {
        use std::collections::HashMap;
        use std::sync::Arc;
        let workspace = |used: u64, bytes: usize| {
            let sandbox = super::VirtualSandbox::default();
            sandbox.used.store(used, std::sync::atomic::Ordering::Relaxed);
            sandbox
                .files
                .lock()
                .unwrap()
                .insert("/f".into(), vec![0; bytes])
                .unwrap();
            Arc::new(sandbox)
        };
        let key = |id: &str| (String::new(), id.to_owned());
        let held = workspace(0, 100);
        let mut workspaces: HashMap<_, _> = [
            (key("held"), held.clone()),
            (key("old"), workspace(1, 100)),
            (key("newer"), workspace(2, 100)),
            (key("newest"), workspace(3, 100)),
        ]
        .into_iter()
        .collect();
        let dropped = super::idle_workspaces_to_drop(&mut workspaces, 200);
        assert_eq!(dropped.len(), 2);
        let mut left: Vec<String> = workspaces.keys().map(|(_, id)| id.clone()).collect();
        left.sort();
        assert_eq!(left, ["held", "newest"]);
        drop(held);
    }

    /// What all instances' files hold together is bounded: a reservation past the bound
    /// counts nothing and is refused.
    #[test]
    fn the_bytes_of_all_instances_files_are_bounded_together() {
        let all = std::sync::atomic::AtomicUsize::new(0);
        assert!(super::reserve(&all, 600, 1_000));
        assert!(!super::reserve(&all, 500, 1_000));
        assert_eq!(all.load(std::sync::atomic::Ordering::Relaxed), 600);
        assert!(super::reserve(&all, 400, 1_000));
        assert!(!super::reserve(&all, usize::MAX, 1_000));
    }

    use super::*;

    fn write(sandbox: &VirtualSandbox, path: &str, bytes: usize) -> Result<(), SandboxError> {
        futures_util::FutureExt::now_or_never(sandbox.write_file(path, vec![0; bytes])).unwrap()
    }

    /// Writes past the bytes or the files an instance's in-memory filesystem holds fail, the
    /// files kept as they were; a replaced file counts as its new size, and a removed one
    /// frees its room.
    #[test]
    fn writes_past_the_room_of_the_in_memory_sandbox_fail_and_removals_free_it() {
        let sandbox = VirtualSandbox::default();
        // Four files that fill the room, their paths and entries counted.
        let quarter = MAX_VIRTUAL_BYTES / 4 - FILE_ENTRY_BYTES - "/big/0".len();
        for n in 0..4 {
            write(&sandbox, &format!("/big/{n}"), quarter).unwrap();
        }
        assert_eq!(sandbox.files().bytes, MAX_VIRTUAL_BYTES);
        let error = write(&sandbox, "/one-more", 0).unwrap_err();
        assert!(error.to_string().contains("at most"), "{error}");
        assert!(!sandbox.files().contains_key("/one-more"));
        // A file replaced by a smaller one makes room.
        let one_more = FILE_ENTRY_BYTES + "/one-more".len() + 10;
        write(&sandbox, "/big/0", quarter - one_more).unwrap();
        write(&sandbox, "/one-more", 10).unwrap();
        assert!(
            write(&sandbox, "/big/1", quarter + 1).is_err(),
            "replaced larger: past the room"
        );
        futures_util::FutureExt::now_or_never(sandbox.remove("/big/1"))
            .unwrap()
            .unwrap();
        write(&sandbox, "/big/1", quarter).unwrap();
        assert_eq!(sandbox.files().bytes, MAX_VIRTUAL_BYTES);

        let sandbox = VirtualSandbox::default();
        for n in 0..MAX_VIRTUAL_FILES {
            write(&sandbox, &format!("/f{n}"), 0).unwrap();
        }
        assert!(write(&sandbox, "/one-too-many", 0).is_err());
        write(&sandbox, "/f0", 1).unwrap();
    }

    /// Empty files count their paths against the room, and a removal gives them back.
    #[test]
    fn empty_files_count_their_paths_against_the_room() {
        let sandbox = VirtualSandbox::default();
        let long = "d".repeat(4000);
        for n in 0..10 {
            write(&sandbox, &format!("/{long}/f{n}"), 0).unwrap();
        }
        let held = sandbox.files().bytes;
        assert!(held >= 10 * 4000, "{held} bytes counted for 10 paths of 4 KB");
        futures_util::FutureExt::now_or_never(sandbox.remove(&format!("/{long}/f0")))
            .unwrap()
            .unwrap();
        assert_eq!(sandbox.files().bytes, held / 10 * 9);
    }
}
