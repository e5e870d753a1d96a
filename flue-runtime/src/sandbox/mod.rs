//! Sandboxes: the environment an agent attaches with `use_sandbox`, and the six tools the
//! model works in it with (`read`, `write`, `edit`, `bash`, `grep`, `glob`).
//!
//! - [`virtual_sandbox`]: an in-memory filesystem per instance (kept for the process's
//!   lifetime, not across restarts), no commands. [`local`]: a directory on the real
//!   filesystem, commands through `bash -c` (`sh -c` without bash) with a cleared
//!   environment (only `PATH`, `LANG`, `HOME` — this process's, where per-user toolchains
//!   and caches live, or the working directory when it has none — and the toolchain
//!   locations [`TOOLCHAIN_VARIABLES`] lists: paths, no secrets), and on Linux this
//!   process made non-dumpable before the first one, so a command cannot read this process's
//!   own launch environment from `/proc` either.
//!   That is all it hides: a command runs as this process's user, in its home, so the
//!   credentials the user's tools keep there (`gh`, `aws`, git's, npm's) are a command's too;
//!   and it can read the
//!   environment of the user's other processes (the shell or supervisor that started this
//!   one, siblings given the same keys), anything the user can read (as root, anything at
//!   all), and it has no resource limits. What a command leaves running in the background
//!   once it has ended (`npm run dev &`) is not tracked: it outlives the response and the
//!   process (a command still running at its timeout, an abort or the CLI's exit is killed
//!   with everything it started; on other systems than Linux, with what stayed in its
//!   process group). Run untrusted models as a user of their own, or in a
//!   container. The file tools' paths are sandbox paths — `/` is the root — and a path that
//!   leaves the root is refused; the root's own host path (which commands see: they start in
//!   it) names the root too, as does the path it was configured with when a link leads to it
//!   (macOS's `/tmp`), so a path a command printed names the same file.
//! - The factory runs once per submission (when the render first attaches the sandbox); the
//!   working directory (`SandboxOptions::cwd`, default `/`) is submission-scoped, and the
//!   tools' relative paths start there. Presence is re-read at every turn boundary: a render
//!   that drops `use_sandbox` unmounts the tools, one that adds it mounts them, and the change
//!   reaches the model as an `environment` signal.
//! - Limits: `read` 2000 lines / 50 KB (from the start, with a continuation marker), `bash`
//!   2000 lines / 50 KB (the end), `grep` 100 matches of at most 500 characters per line,
//!   `glob` 1000 paths, `edit` files (before and after the edit) of at most 16 MB; `grep` and
//!   `glob` walk at most 20,000 files and directories (and say so when they stop there).
//!   Writes and edits of one file run one at a time, each to its end once started, even when
//!   the response is aborted meanwhile: within a submission and its delegates, and across
//!   the submissions (of any instance) acting on the same local directory or in-memory
//!   workspace.
//! - `read` and `grep` read a file a piece at a time ([`Sandbox::read_file_with`]), only as
//!   far as they can show: `read` stops 1 MB past its window (a marker then counts "more
//!   than" the lines seen, and only what was read is checked to be UTF-8) and skips at most
//!   256 MB to reach it, `grep` stops at one match more than it shows, at a line longer than
//!   1 MB (its head searched, not the rest of the file), and after reading 256 MB in all
//!   (saying so).
//! - Delegates share the parent's sandbox and its tools (`Environment`); a `task` call's
//!   `cwd` moves the delegate's working directory (relative to the parent's unless absolute,
//!   inside the sandbox). Like the tools' own paths, it is no boundary: the sandbox is.
//! - Workspace skills: a workspace brings skills of its own as directories
//!   `<cwd>/.agents/skills/<name>/` holding a `SKILL.md` (the Agent Skills format, its `name`
//!   the directory's). They are discovered through the sandbox's file API (any sandbox: the
//!   local one, the in-memory one, a factory's own) once per session — when the submission's
//!   sandbox is made, and for a delegate when its task starts, in its own `cwd` — not in
//!   directories above the cwd. While a render attaches the sandbox they are listed after the
//!   skills mounted with `use_skill` and activate like them. A link to a skill's directory
//!   counts (where the sandbox follows it); a directory without `SKILL.md` is not a skill; an
//!   unreadable or invalid `SKILL.md` is skipped with a warning (`tracing`,
//!   `[flue] Skipping invalid workspace skill "<name>": …`); a name a `use_skill` skill also
//!   has fails the submission (`skill_name_conflict`, `[flue] Skill name "<name>" appears in
//!   both agent definition and workspace discovery. …`; for a delegate, the task fails).
//!   Supporting files stay in the sandbox (activation names the skill's directory; the model
//!   reads them with the sandbox's tools, not `read_skill_resource`), and activation reads
//!   `SKILL.md` again, so an edit made during the session shows. A skill added during a
//!   submission is found by the next one, and narrated to the model as a new skill.
//!
//! A factory of the application's own implements [`SandboxFactory`] and [`Sandbox`], both
//! here:
//!
//! ```
//! use std::sync::Arc;
//! use flue_runtime::BoxFuture;
//! use flue_runtime::sandbox::{DirEntry, ExecOutput, ExecRequest, Sandbox, SandboxError, SandboxFactory};
//!
//! /// An environment that refuses everything (a container's client would go here).
//! struct Sealed;
//!
//! impl Sandbox for Sealed {
//!     fn read_file(&self, path: &str) -> BoxFuture<'_, Result<Vec<u8>, SandboxError>> {
//!         let missing = SandboxError::NotFound(path.to_owned());
//!         Box::pin(async move { Err(missing) })
//!     }
//!     fn write_file(&self, _path: &str, _contents: Vec<u8>) -> BoxFuture<'_, Result<(), SandboxError>> {
//!         Box::pin(async { Err(SandboxError::Unsupported("writes")) })
//!     }
//!     fn remove(&self, _path: &str) -> BoxFuture<'_, Result<(), SandboxError>> {
//!         Box::pin(async { Err(SandboxError::Unsupported("removals")) })
//!     }
//!     fn list_dir(&self, _path: &str) -> BoxFuture<'_, Result<Vec<DirEntry>, SandboxError>> {
//!         Box::pin(async { Ok(Vec::new()) })
//!     }
//!     fn exec(&self, _request: ExecRequest) -> BoxFuture<'_, Result<ExecOutput, SandboxError>> {
//!         Box::pin(async { Err(SandboxError::Unsupported("commands")) })
//!     }
//! }
//!
//! struct SealedFactory;
//!
//! impl SandboxFactory for SealedFactory {
//!     fn create_sandbox(&self, _instance_id: &str) -> BoxFuture<'static, Result<Arc<dyn Sandbox>, SandboxError>> {
//!         Box::pin(async { Ok(Arc::new(Sealed) as Arc<dyn Sandbox>) })
//!     }
//! }
//! ```

mod glob_match;
mod local;
pub(crate) mod tools;
mod virtual_fs;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

// The environment's interface, for a factory of the application's own (a container, a
// remote machine): `flue_runtime::sandbox::{Sandbox, SandboxFactory, …}`.
pub use flue_core::sandbox::*;
pub use local::{
    DEFAULT_COMMAND_TIMEOUT, LocalSandbox, LocalSandboxFactory, TOOLCHAIN_VARIABLES, kill_running_commands,
};
pub use virtual_fs::{VirtualSandbox, VirtualSandboxFactory};

/// The in-memory sandbox: a filesystem per instance (kept while the process runs), no
/// commands.
pub fn virtual_sandbox() -> VirtualSandboxFactory {
    VirtualSandboxFactory
}

/// A directory on the real filesystem (created when missing), with commands.
pub fn local(root: impl Into<std::path::PathBuf>) -> LocalSandboxFactory {
    LocalSandboxFactory::new(root)
}

/// The longest sandbox path, in bytes (the kernel's `PATH_MAX`).
pub(crate) const MAX_PATH_BYTES: usize = 4096;

/// The most components a sandbox path has: checking a path costs more the deeper it is (a
/// resolution looks each prefix up), and a write makes the directories it names.
pub(crate) const MAX_PATH_COMPONENTS: usize = 256;

/// A sandbox path made absolute and normal (`.` and `..` resolved); `..` past the root is
/// refused, and so is a path past [`MAX_PATH_BYTES`] or [`MAX_PATH_COMPONENTS`].
pub(crate) fn normalize(path: &str) -> Result<String, SandboxError> {
    if path.contains('\0') {
        return Err(SandboxError::Io("a path cannot contain a NUL byte".into()));
    }
    let too_long = || {
        SandboxError::Io(format!(
            "a path may be at most {MAX_PATH_BYTES} bytes and {MAX_PATH_COMPONENTS} components long"
        ))
    };
    if path.len() > MAX_PATH_BYTES {
        return Err(too_long());
    }
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                if parts.pop().is_none() {
                    return Err(SandboxError::OutsideRoot(path.to_owned()));
                }
            }
            part => parts.push(part),
        }
    }
    if parts.len() > MAX_PATH_COMPONENTS {
        return Err(too_long());
    }
    Ok(format!("/{}", parts.join("/")))
}

/// `path` (relative to `cwd` unless absolute) as a sandbox path.
pub(crate) fn join(cwd: &str, path: &str) -> Result<String, SandboxError> {
    let joined = if path.starts_with('/') {
        normalize(path)
    } else {
        normalize(&format!("{}/{path}", cwd.trim_end_matches('/')))
    };
    // Errors name the path as the caller gave it.
    joined.map_err(|error| match error {
        SandboxError::OutsideRoot(_) => SandboxError::OutsideRoot(path.to_owned()),
        other => other,
    })
}

/// The per-file locks that serialize writes and edits, by the file's real path.
type LockMap = Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>;

/// A session's [`LockMap`], shared.
pub(crate) type FileLocks = Arc<LockMap>;

/// The file locks of every environment whose files have an identity
/// ([`Sandbox::files_identity`]), while a session or a write holds them.
static FILE_LOCKS: Mutex<Vec<(String, std::sync::Weak<LockMap>)>> = Mutex::new(Vec::new());

/// The file locks of the files `identity` names (shared by every session acting on them), or
/// new ones for a session of its own.
fn file_locks(identity: Option<String>) -> FileLocks {
    let Some(identity) = identity else {
        return FileLocks::default();
    };
    let mut all = FILE_LOCKS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    all.retain(|(_, locks)| locks.strong_count() > 0);
    if let Some(locks) = all
        .iter()
        .find(|(held, _)| *held == identity)
        .and_then(|(_, locks)| locks.upgrade())
    {
        return locks;
    }
    let locks = FileLocks::default();
    all.push((identity, Arc::downgrade(&locks)));
    locks
}

/// One submission's environment: the sandbox, the working directory, and the per-file locks
/// that serialize writes and edits.
pub(crate) struct SandboxSession {
    pub(crate) sandbox: Arc<dyn Sandbox>,
    pub(crate) cwd: String,
    /// Shared with the sessions scoped from this one (a delegate's writes to a file wait for
    /// the parent's), and with the sessions of other submissions acting on the same files
    /// (see [`Sandbox::files_identity`]).
    pub(crate) locks: FileLocks,
}

impl SandboxSession {
    pub(crate) fn new(sandbox: Arc<dyn Sandbox>, cwd: Option<&str>) -> Result<Self, SandboxError> {
        let locks = file_locks(sandbox.files_identity());
        Ok(Self {
            sandbox,
            cwd: normalize(cwd.unwrap_or("/"))?,
            locks,
        })
    }

    /// This session with its working directory moved to `cwd` (relative to this one's unless
    /// absolute): the same sandbox and file locks.
    fn scoped(&self, cwd: &str) -> Result<Self, SandboxError> {
        Ok(Self {
            sandbox: self.sandbox.clone(),
            cwd: join(&self.cwd, cwd)?,
            locks: self.locks.clone(),
        })
    }

    /// The lock of one file (`path` normalized), keyed by the file's real path in the sandbox:
    /// two paths naming one file through a link (`link.txt` and its target, a file under a
    /// linked directory) share it. A path that cannot be resolved keeps its own (the
    /// operation then fails anyway).
    pub(crate) async fn lock_of(&self, path: &str) -> Arc<tokio::sync::Mutex<()>> {
        let key = self.sandbox.real_path(path).await.unwrap_or_else(|_| path.to_owned());
        self.locks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .entry(key)
            .or_default()
            .clone()
    }
}

/// The tools of a submission's sandbox while a render attaches it: what the model works
/// with, and what delegates share.
#[derive(Clone, Default)]
pub(crate) struct Environment {
    pub(crate) tools: Vec<flue_core::Tool>,
    /// The session (`None`: no sandbox is attached).
    pub(crate) session: Option<Arc<SandboxSession>>,
    /// Whether `tools` are the built-in ones over `session` (a factory's own tools cannot be
    /// moved to another directory).
    built_in: bool,
}

impl Environment {
    /// The built-in tools over `session`.
    pub(crate) fn built_in(session: Arc<SandboxSession>) -> Self {
        Self {
            tools: tools::tools(&session),
            session: Some(session),
            built_in: true,
        }
    }

    /// A sandbox factory's own tools, for `session`.
    pub(crate) fn custom(session: Arc<SandboxSession>, tools: Vec<flue_core::Tool>) -> Self {
        Self {
            tools,
            session: Some(session),
            built_in: false,
        }
    }

    /// The environment of a delegate working in `cwd` (relative to this environment's working
    /// directory unless absolute, and inside the sandbox).
    pub(crate) fn scoped(&self, cwd: &str) -> Result<Self, String> {
        let Some(session) = &self.session else {
            return Err("A task's cwd needs a sandbox, and this agent has none attached.".to_owned());
        };
        if !self.built_in {
            return Err("A task's cwd cannot scope this sandbox's own tools; leave cwd out.".to_owned());
        }
        let scoped = session
            .scoped(cwd)
            .map_err(|error| format!("The task's cwd \"{cwd}\": {error}"))?;
        Ok(Self::built_in(Arc::new(scoped)))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use super::*;

    #[test]
    fn paths_normalize_and_cannot_climb_out() {
        assert_eq!(normalize("a/./b/../c").unwrap(), "/a/c");
        assert_eq!(normalize("/").unwrap(), "/");
        assert_eq!(join("/work", "notes.md").unwrap(), "/work/notes.md");
        assert_eq!(join("/work", "/etc/x").unwrap(), "/etc/x");
        assert!(matches!(normalize("../etc/passwd"), Err(SandboxError::OutsideRoot(_))));
        assert!(matches!(join("/a", "../../x"), Err(SandboxError::OutsideRoot(_))));
    }

    #[cfg(unix)]
    #[tokio::test]
    async fn one_file_has_one_lock_whatever_path_names_it() {
        use flue_core::sandbox::SandboxFactory;
        let root = std::env::temp_dir().join(format!("flue-sandbox-locks-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("dir")).unwrap();
        std::fs::write(root.join("dir/f.txt"), "x").unwrap();
        std::os::unix::fs::symlink("dir/f.txt", root.join("link.txt")).unwrap();
        std::os::unix::fs::symlink("dir", root.join("alias")).unwrap();
        let sandbox = local(&root).create_sandbox("locks").await.unwrap();
        let session = SandboxSession::new(sandbox, Some("/dir")).unwrap();
        let file = session.lock_of("/dir/f.txt").await;
        for other in ["/link.txt", "/alias/f.txt", "/alias/../dir/f.txt"] {
            let named = session.lock_of(&join(&session.cwd, other).unwrap()).await;
            assert!(Arc::ptr_eq(&file, &named), "{other} has a lock of its own");
        }
        // A file not made yet, under a linked directory: the lock of its real path too.
        let new = session.lock_of("/alias/new.txt").await;
        assert!(Arc::ptr_eq(&new, &session.lock_of("/dir/new.txt").await));
        assert!(!Arc::ptr_eq(&file, &new));
        let _ = std::fs::remove_dir_all(&root);
    }
}
