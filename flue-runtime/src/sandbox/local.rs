//! The local environment: a directory on the real filesystem, with commands run by `bash -c`
//! (by `sh -c` where no `bash` is installed: the model's tool is named `bash` and writes bash,
//! `[[ ]]`, arrays, `set -o pipefail`, which a POSIX `sh` such as dash refuses).
//! Sandbox paths map onto the root (`/` is the root); a path that leaves it — through `..` or
//! through a symbolic link — is refused.

use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use flue_core::BoxFuture;
use flue_core::sandbox::{DirEntry, ExecOutput, ExecRequest, Sandbox, SandboxError, SandboxFactory};

use super::normalize;

/// The shell commands run in: the first executable `bash` on the process's `PATH` (an
/// absolute path, found once; the command's own environment is cleared), else `sh`.
fn shell() -> &'static std::ffi::OsStr {
    static SHELL: std::sync::OnceLock<std::ffi::OsString> = std::sync::OnceLock::new();
    SHELL.get_or_init(|| {
        let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
        std::env::split_paths(&path)
            .filter(|directory| directory.is_absolute())
            .map(|directory| directory.join("bash"))
            .find(|candidate| is_executable(candidate))
            .map_or_else(|| "sh".into(), std::path::PathBuf::into_os_string)
    })
}

/// Whether `path` is a file this process may execute.
fn is_executable(path: &std::path::Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path).is_ok_and(|metadata| metadata.is_file() && metadata.permissions().mode() & 0o111 != 0)
    }
    #[cfg(not(unix))]
    {
        path.is_file()
    }
}

/// Makes this process's own environment, memory and file descriptors unreadable by other
/// processes of its user (Linux: not dumpable, as `ssh-agent` and `gpg-agent` make
/// themselves), once, before the first command. A command gets a cleared environment, but it
/// runs as this process's user and could otherwise read this process's whole launch
/// environment, provider keys included, from `/proc/$PPID/environ`. The process then leaves
/// no core dump and a debugger needs root to attach. It hides this process only: the user's
/// other processes (the shell that started this one) stay readable, and a command running as
/// root reads anything. Run untrusted models as a user of their own (or in a container).
fn hide_process_environment() {
    #[cfg(target_os = "linux")]
    {
        static HIDDEN: std::sync::Once = std::sync::Once::new();
        HIDDEN.call_once(|| {
            // SAFETY: PR_SET_DUMPABLE takes one integer argument and touches no memory of ours.
            let result = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
            if result != 0 {
                tracing::warn!(
                    error = %std::io::Error::last_os_error(),
                    "sandbox: could not make the process non-dumpable; commands may read its environment"
                );
            }
        });
    }
}

/// The variables of this process a command gets besides `PATH`, `HOME` and `LANG`: where
/// toolchains are installed, set when they are not in their per-user default places. Paths,
/// no secrets.
pub const TOOLCHAIN_VARIABLES: [&str; 8] = [
    "RUSTUP_HOME",
    "CARGO_HOME",
    "GOPATH",
    "GOROOT",
    "JAVA_HOME",
    "PYENV_ROOT",
    "NVM_DIR",
    "VOLTA_HOME",
];

/// The [`TOOLCHAIN_VARIABLES`] this process has.
fn toolchains() -> impl Iterator<Item = (&'static str, std::ffi::OsString)> {
    TOOLCHAIN_VARIABLES
        .into_iter()
        .filter_map(|name| std::env::var_os(name).map(|value| (name, value)))
}

/// How long a command may run when the call sets no limit.
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(120);

/// The local sandbox factory (`flue_runtime::sandbox::local(root)`).
#[derive(Clone, Debug)]
pub struct LocalSandboxFactory {
    root: PathBuf,
}

impl LocalSandboxFactory {
    /// A factory for the directory `root` (created when missing).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }
}

impl SandboxFactory for LocalSandboxFactory {
    fn create_sandbox(&self, _instance_id: &str) -> BoxFuture<'static, Result<Arc<dyn Sandbox>, SandboxError>> {
        let root = self.root.clone();
        Box::pin(async move {
            tokio::fs::create_dir_all(&root).await.map_err(io)?;
            let real = tokio::fs::canonicalize(&root).await.map_err(io)?;
            // The root as configured too, when a link leads to it (see `Root::logical`).
            // By its components: without a trailing slash, which `absolute` keeps.
            let logical = std::path::absolute(&root)
                .ok()
                .map(|logical| logical.components().collect::<PathBuf>())
                .filter(|logical| *logical != real && logical.components().all(|part| part != Component::ParentDir));
            Ok(Arc::new(LocalSandbox {
                root: Root { real, logical },
            }) as Arc<dyn Sandbox>)
        })
    }
}

/// A directory on the real filesystem. Every operation checks its path (following links,
/// which may mean a slow or stalled filesystem) on tokio's blocking pool, not on the runtime's
/// workers.
#[derive(Clone, Debug)]
pub struct LocalSandbox {
    root: Root,
}

/// A local sandbox's root directory: its real path (links resolved), which it is used by,
/// and the path it was configured with when a link leads there (macOS's `/tmp` is
/// `/private/tmp`; Fedora Silverblue's `/home` is `/var/home`). Commands see both: they start
/// in the real one, but a shell's `cd ~/project; pwd` prints the configured one, as do links a
/// user made with it. A path under either names the same file.
#[derive(Clone, Debug)]
struct Root {
    real: PathBuf,
    logical: Option<PathBuf>,
}

impl Root {
    /// A root without another path to it.
    #[cfg(test)]
    fn real(real: PathBuf) -> Self {
        Self { real, logical: None }
    }

    /// `path` past the root (its real path, or the configured one), when it is under it.
    #[cfg(unix)]
    fn strip<'p>(&self, path: &'p Path) -> Option<&'p Path> {
        path.strip_prefix(&self.real).ok().or_else(|| {
            self.logical
                .as_ref()
                .and_then(|logical| path.strip_prefix(logical).ok())
        })
    }
}

impl std::ops::Deref for Root {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.real
    }
}

impl AsRef<Path> for Root {
    fn as_ref(&self) -> &Path {
        &self.real
    }
}

/// Writes `contents` over `file` (opened at its start, not appending) and cuts what is left of
/// its old contents past them. The room for the new contents is `reserve`d first, so a full
/// disk or a quota fails the write before any old byte changed, on a filesystem that writes in
/// place. (Emptying the file first, a failed write left it empty or cut short, and the model
/// only an I/O error.) A file with contents is replaced whole instead where it can be: see
/// [`write_whole`].
fn overwrite(
    file: &mut std::fs::File,
    contents: &[u8],
    reserve: impl FnOnce(&std::fs::File, u64) -> std::io::Result<()>,
) -> std::io::Result<()> {
    use std::io::Write;
    let length = u64::try_from(contents.len()).unwrap_or(u64::MAX);
    reserve(file, length)?;
    file.write_all(contents)?;
    file.set_len(length)
}

/// Writes `contents` as the file at the normalized sandbox path `path` under `root`, which
/// [`open_beneath`] opened (`file`, made when missing): whole or not at all. A file with old
/// contents, which is its directory's entry `path` names and its only link, is replaced: the
/// contents go to a new file beside it, given its mode and owner, renamed over it once written
/// ([`replace_at`]). A failed or cut-off write then leaves the old file as it was, where written
/// over in place, a disk that fills partway (reserving room does not help on a copy-on-write
/// filesystem, whose every written block is new) left new text followed by old. A file reached
/// through a link, a file of several links, and a new or empty one are written in place
/// ([`overwrite`]): a link stays a link, the links stay one file, and an empty file has nothing
/// to lose.
#[cfg(unix)]
fn write_whole(root: &Root, path: &str, file: &mut std::fs::File, contents: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let opened = file.metadata()?;
    if opened.len() > 0
        && opened.nlink() == 1
        && let Ok((dir, Some(name))) = walk_beneath(root, path, End::Parent)
        && let Ok(status) = beneath::status_at(&dir, &name)
        && same_file(&status, &opened)
        && replace_at(&dir, &name, &status, |file| overwrite(file, contents, reserve))?
    {
        return Ok(());
    }
    overwrite(file, contents, reserve)
}

#[cfg(not(unix))]
fn write_whole(_root: &Root, _path: &str, file: &mut std::fs::File, contents: &[u8]) -> std::io::Result<()> {
    overwrite(file, contents, reserve)
}

/// Whether the entry of `status` is the file of `opened` (not a link to it, nor another file
/// swapped in since it was opened).
#[cfg(unix)]
fn same_file(status: &libc::stat, opened: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    #[allow(clippy::unnecessary_cast, clippy::useless_conversion)] // their types differ across targets
    let (device, inode) = (status.st_dev as u64, status.st_ino as u64);
    status.st_mode & libc::S_IFMT == libc::S_IFREG && device == opened.dev() && inode == opened.ino()
}

/// Replaces the regular file `name` of `dir` (`status`) with a new one that `write` fills: made
/// in `dir` readable by this process's user alone until written, given the old one's owner
/// (where this process may give it) and mode, then renamed over it. `Ok(false)`, nothing
/// changed, when the new file cannot be made beside the old one or renamed over it (a
/// directory this process may not write in, a sticky one, a file that is a mount point): the
/// caller writes in place then, as it could before. A failed `write` removes the new file and
/// leaves the old one as it was.
#[cfg(unix)]
fn replace_at(
    dir: &std::os::fd::OwnedFd,
    name: &std::ffi::OsStr,
    status: &libc::stat,
    write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> std::io::Result<bool> {
    use std::os::unix::fs::PermissionsExt;
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let number = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // The process id and a count name it apart from this process's others; the time, from one
    // a process of the same id (a container's first, restarted) left behind.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos());
    let temporary = std::ffi::OsString::from(format!(".flue-write-{}-{number}-{nanos:x}.tmp", std::process::id()));
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    let Ok(created) = beneath::create_at(dir, &temporary, flags, 0o600) else {
        return Ok(false);
    };
    let mut file = std::fs::File::from(created);
    let written = (|| {
        // The owner first: changing it may clear the mode's set-id bits.
        let _ = std::os::unix::fs::fchown(&file, Some(status.st_uid), Some(status.st_gid));
        write(&mut file)?;
        #[allow(clippy::useless_conversion)] // its type differs across targets
        let mode = u32::from(status.st_mode) & 0o7777;
        file.set_permissions(std::fs::Permissions::from_mode(mode))
    })();
    if let Err(error) = written {
        let _ = beneath::remove_at(dir, &temporary, false);
        return Err(error);
    }
    if beneath::rename_at(dir, &temporary, name).is_err() {
        let _ = beneath::remove_at(dir, &temporary, false);
        return Ok(false);
    }
    Ok(true)
}

/// Reserves the blocks of a file `length` bytes long (Linux's `fallocate`): a full disk or a
/// quota fails here. A filesystem that cannot reserve (or another system) reserves nothing,
/// and the write goes on as it would.
fn reserve(file: &std::fs::File, length: u64) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    if let Ok(length @ 1..) = libc::off_t::try_from(length) {
        use std::os::fd::AsRawFd;
        // SAFETY: `fallocate` takes an open descriptor and integers, and touches no memory of
        // ours.
        if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, length) } != 0 {
            let error = std::io::Error::last_os_error();
            if matches!(
                error.raw_os_error(),
                Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG | libc::EIO)
            ) {
                return Err(error);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, length);
    Ok(())
}

fn io(error: std::io::Error) -> SandboxError {
    match error.kind() {
        std::io::ErrorKind::NotFound => SandboxError::NotFound(error.to_string()),
        _ => SandboxError::Io(error.to_string()),
    }
}

impl LocalSandbox {
    /// `path` (normalized) as a sandbox path: the root's own host path names the root. A
    /// command runs in the root and sees host paths (`pwd`, a traceback, `realpath`), so a
    /// path it printed names the same file in the file tools, not one of a copy of the host's
    /// tree made under the root. A path that names something under the root as a sandbox
    /// path stays that one (a root `/app` holding an `app/` directory: `/app/models` is
    /// `<root>/app/models`).
    fn inside<'p>(&self, path: &'p str) -> &'p str {
        let rest = [Some(&self.root.real), self.root.logical.as_ref()]
            .into_iter()
            .flatten()
            .filter_map(|root| root.to_str().filter(|root| *root != "/"))
            .find_map(|root| match path.strip_prefix(root) {
                Some("") => Some("/"),
                Some(rest) if rest.starts_with('/') => Some(rest),
                _ => None,
            });
        let Some(rest) = rest else { return path };
        let first = path.trim_start_matches('/').split('/').next().unwrap_or_default();
        if std::fs::symlink_metadata(self.root.join(first)).is_ok() {
            return path;
        }
        rest
    }

    /// The sandbox path a file operation acts on: `path` normalized, as [`Self::inside`] reads
    /// it, and checked by [`Self::resolve`].
    fn checked(&self, path: &str) -> Result<String, SandboxError> {
        let normalized = normalize(path)?;
        let inside = self.inside(&normalized);
        self.resolve(inside)?;
        Ok(inside.to_owned())
    }

    /// The real path of a sandbox path, refusing one that leaves the root (also through a
    /// symbolic link in an existing ancestor, and through a dangling link anywhere on the way).
    fn resolve(&self, path: &str) -> Result<PathBuf, SandboxError> {
        let normalized = normalize(path)?;
        let real = self.root.join(normalized.trim_start_matches('/'));
        // The deepest existing ancestor, with its links resolved, must stay under the root.
        let mut existing: &Path = &real;
        loop {
            match std::fs::canonicalize(existing) {
                Ok(canonical) => {
                    if !canonical.starts_with(&self.root) {
                        return Err(SandboxError::OutsideRoot(path.to_owned()));
                    }
                    break;
                }
                // A link whose target does not exist (yet) cannot be checked, and writing
                // through it would create its target wherever it points: refused. Said as a
                // missing target when the link points inside the root (not a rule broken).
                Err(_) if std::fs::symlink_metadata(existing).is_ok() => {
                    let target = std::fs::read_link(existing)
                        .ok()
                        .map(|target| lexically_normal(&existing.parent().unwrap_or(&self.root).join(target)));
                    return Err(match target {
                        Some(target) if target.starts_with(&self.root) => SandboxError::NotFound(format!(
                            "{path} goes through a symbolic link whose target does not exist"
                        )),
                        _ => SandboxError::OutsideRoot(path.to_owned()),
                    });
                }
                Err(_) => match existing.parent() {
                    Some(parent) => existing = parent,
                    None => break,
                },
            }
        }
        Ok(real)
    }
}

/// `path` with its `.` and `..` parts resolved by name only (no link followed).
fn lexically_normal(path: &Path) -> PathBuf {
    let mut normal = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                normal.pop();
            }
            other => normal.push(other),
        }
    }
    normal
}

/// What a file is opened for: reading it, or replacing its contents (creating it and its
/// missing parent directories).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Access {
    Read,
    Write,
}

/// Why [`open_beneath`] opened nothing.
#[derive(Debug)]
enum OpenError {
    /// The path leads out of the root (through a link met on the way).
    Outside,
    /// What the path names is no regular file (nor a directory): a FIFO, a socket, a device.
    NotRegular(Access),
    /// What the path names is one of the kernel's files (`/proc`, `/sys`).
    OfTheKernel,
    /// What the path names is a database file of a store of this process.
    OfTheStore,
    /// Anything else.
    Io(std::io::Error),
}

impl OpenError {
    /// The sandbox error, naming the path as the caller gave it.
    fn shown(self, shown: &str) -> SandboxError {
        match self {
            Self::Outside => SandboxError::OutsideRoot(shown.to_owned()),
            Self::NotRegular(access) => SandboxError::Io(format!(
                "{shown} is not a regular file (but a FIFO, socket or device); only regular files can be {}",
                match access {
                    Access::Read => "read",
                    Access::Write => "written",
                }
            )),
            Self::OfTheKernel => SandboxError::Io(format!(
                "{shown} is a file of the kernel's (/proc or /sys); the file tools do not open them"
            )),
            Self::OfTheStore => SandboxError::Io(format!(
                "{shown} is a file of the runtime's own database; the file tools do not open it"
            )),
            Self::Io(error) if error.kind() == std::io::ErrorKind::NotFound => SandboxError::NotFound(shown.to_owned()),
            Self::Io(error) => io(error),
        }
    }
}

impl From<std::io::Error> for OpenError {
    fn from(error: std::io::Error) -> Self {
        Self::Io(error)
    }
}

/// Links followed at most while opening one path (as the kernel's own limit).
#[cfg(unix)]
const MAX_LINKS: usize = 40;

/// Opens the file at the normalized sandbox path `path` under `root`, never leaving the root
/// whatever changes on disk meanwhile (see [`walk_beneath`]).
#[cfg(unix)]
fn open_beneath(root: &Root, path: &str, access: Access) -> Result<std::fs::File, OpenError> {
    let end = End::Open {
        flags: access.flags(),
        make_dirs: access == Access::Write,
    };
    match walk_beneath(root, path, end) {
        Ok((fd, _)) => regular(fd, access),
        // A FIFO opened for writing with no reader, or a socket.
        Err(OpenError::Io(error)) if error.raw_os_error() == Some(libc::ENXIO) => Err(OpenError::NotRegular(access)),
        Err(error) => Err(error),
    }
}

/// Removes the file, link or empty directory at the normalized sandbox path `path` under
/// `root`: its directory is reached by [`walk_beneath`], and the entry removed from that
/// descriptor (`unlinkat`), so no directory swapped for a link on the way leads the removal
/// out of the root. A link is removed itself, not followed.
#[cfg(unix)]
fn remove_beneath(root: &Root, path: &str) -> Result<(), OpenError> {
    let (dir, name) = walk_beneath(root, path, End::Parent)?;
    let Some(name) = name else {
        return Err(OpenError::Io(std::io::Error::from_raw_os_error(libc::EINVAL)));
    };
    let status = beneath::status_at(&dir, &name)?;
    beneath::remove_at(&dir, &name, status.st_mode & libc::S_IFMT == libc::S_IFDIR)?;
    Ok(())
}

/// The most entries a directory listing reads: past it the listing fails (with
/// [`TOO_MANY_ENTRIES`] in its error) rather than read on, each entry kept with its status, in
/// a directory a command filled with millions of files.
pub(crate) const MAX_LISTED_ENTRIES: usize = 100_000;

/// What the error of a listing stopped at [`MAX_LISTED_ENTRIES`] says.
pub(crate) const TOO_MANY_ENTRIES: &str = "entries: list a narrower path";

fn too_many_entries(limit: usize) -> std::io::Error {
    std::io::Error::other(format!("the directory holds more than {limit} {TOO_MANY_ENTRIES}"))
}

/// The entries of the directory at the normalized sandbox path `path` under `root`: opened by
/// [`walk_beneath`] and listed from that descriptor, so no directory swapped for a link on the
/// way (or the listed one itself) leads the listing out of the root. Entries are described as
/// they are (a link as a link, not followed); names that are not UTF-8 are left out.
#[cfg(unix)]
fn list_beneath(root: &Root, path: &str) -> Result<Vec<DirEntry>, OpenError> {
    let end = End::Open {
        flags: libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        make_dirs: false,
    };
    let (dir, _) = walk_beneath(root, path, end)?;
    let entries = beneath::entries(dir, MAX_LISTED_ENTRIES)?
        .into_iter()
        .filter_map(|(name, status)| {
            let name = name.into_string().ok()?;
            let is_dir = status.st_mode & libc::S_IFMT == libc::S_IFDIR;
            Some(DirEntry {
                name,
                is_dir,
                size: if is_dir {
                    0
                } else {
                    u64::try_from(status.st_size).unwrap_or(0)
                },
            })
        })
        .collect();
    Ok(entries)
}

/// Opens the directory at the normalized sandbox path `path` under `root`, for a command to
/// start in: reached by [`walk_beneath`] (each component `O_DIRECTORY | O_NOFOLLOW`, a link on
/// the way followed by hand and refused when it leads out of the root), so the descriptor is
/// of a directory beneath the root whatever was swapped on disk after the check. (`O_CLOEXEC`:
/// a command started meanwhile does not keep it open.)
#[cfg(unix)]
fn open_dir_beneath(root: &Root, path: &str) -> Result<std::os::fd::OwnedFd, OpenError> {
    let end = End::Open {
        flags: beneath::DIRECTORY,
        make_dirs: false,
    };
    let (dir, _) = walk_beneath(root, path, end)?;
    Ok(dir)
}

/// Where a [`walk_beneath`] ends.
#[cfg(unix)]
#[derive(Clone, Copy, Debug)]
enum End {
    /// At the path's last component, opened with `flags` (a link there followed like any
    /// other); missing directories on the way made when `make_dirs`. A path with no component
    /// left opens the directory reached (`.`).
    Open { flags: libc::c_int, make_dirs: bool },
    /// At the directory holding the path's last component, which is neither opened nor
    /// followed.
    Parent,
}

/// Walks the normalized sandbox path `path` under `root`, never leaving the root whatever
/// changes on disk meanwhile: [`LocalSandbox::resolve`] checks a path before the operation,
/// but a directory on the way, or the file itself, may be swapped for a link out of the root
/// after that check. So the walk goes a component at a time from a descriptor of the root,
/// each step an `openat` that does not follow a link (`O_NOFOLLOW`). A link met on the way is
/// read and followed by hand: its target is walked the same way, and one leading out of the
/// root (an absolute target elsewhere, or `..` past the root) is refused. Links that stay
/// inside the root keep working, as the check allows them.
///
/// The descriptor returned is what `end` asks for, with, for [`End::Parent`], the name of the
/// last component in it (`None` when the path has none).
///
/// (`openat2` with `RESOLVE_BENEATH` would do the walk in the kernel, but refuses every
/// absolute link, also one into the root; and the walk is needed anyway where it is missing.)
#[cfg(unix)]
fn walk_beneath(
    root: &Root,
    path: &str,
    end: End,
) -> Result<(std::os::fd::OwnedFd, Option<std::ffi::OsString>), OpenError> {
    use std::collections::VecDeque;
    use std::os::fd::OwnedFd;

    let root_fd = beneath::open_at(None, root.as_os_str(), beneath::DIRECTORY)?;
    // The directories walked into, innermost last (`..` leaves the innermost).
    let mut walked: Vec<OwnedFd> = Vec::new();
    let mut pending: VecDeque<std::ffi::OsString> = components(std::ffi::OsStr::new(path)).collect();
    let mut links = 0;
    while let Some(name) = pending.pop_front() {
        if name == ".." {
            if walked.pop().is_none() {
                return Err(OpenError::Outside);
            }
            continue;
        }
        let last = pending.is_empty();
        let (flags, make_dirs) = match end {
            End::Parent if last => {
                let dir = walked.pop().unwrap_or(root_fd);
                return Ok((dir, Some(name)));
            }
            End::Open { flags, make_dirs } if last => (flags, make_dirs),
            End::Open { make_dirs, .. } => (beneath::DIRECTORY, make_dirs),
            End::Parent => (beneath::DIRECTORY, false),
        };
        let parent = walked.last().unwrap_or(&root_fd);
        if last && is_a_store_file(parent, &name) {
            return Err(OpenError::OfTheStore);
        }
        // A device, FIFO or socket is refused before it is opened: opening some devices acts
        // (a watchdog starts, a serial line resets its board). (An open of a directory only
        // fails on one without reaching its driver.)
        if last
            && flags & libc::O_DIRECTORY == 0
            && beneath::status_at(parent, &name).is_ok_and(|status| {
                matches!(
                    status.st_mode & libc::S_IFMT,
                    libc::S_IFCHR | libc::S_IFBLK | libc::S_IFIFO | libc::S_IFSOCK
                )
            })
        {
            return Err(OpenError::Io(std::io::Error::from_raw_os_error(libc::ENXIO)));
        }
        let opened = match beneath::open_at(Some(parent), &name, flags) {
            Err(error) if !last && make_dirs && error.kind() == std::io::ErrorKind::NotFound => {
                // A missing directory of a write: made here, then walked into.
                beneath::make_dir_at(parent, &name)?;
                beneath::open_at(Some(parent), &name, flags)
            }
            opened => opened,
        };
        match opened {
            Ok(fd) if last => return Ok((fd, None)),
            Ok(fd) => walked.push(fd),
            // Refused as a link (`O_NOFOLLOW`): followed by hand.
            Err(error) if beneath::is_link_at(parent, &name) => {
                links += 1;
                if links > MAX_LINKS {
                    return Err(OpenError::Io(error));
                }
                let target = beneath::read_link_at(parent, &name)?;
                let target = Path::new(&target);
                let rest = if target.is_absolute() {
                    // An absolute target counts only inside the root (by either of its paths):
                    // walked from the root.
                    let inside = root.strip(target).ok_or(OpenError::Outside)?;
                    walked.clear();
                    inside
                } else {
                    target
                };
                for part in components(rest.as_os_str()).collect::<Vec<_>>().into_iter().rev() {
                    pending.push_front(part);
                }
            }
            Err(error) => return Err(OpenError::Io(error)),
        }
    }
    // No component left (the root itself, or a link's `..`): the directory reached.
    match end {
        End::Open { flags, .. } => {
            let dir = walked.last().unwrap_or(&root_fd);
            Ok((beneath::open_at(Some(dir), std::ffi::OsStr::new("."), flags)?, None))
        }
        End::Parent => Ok((walked.pop().unwrap_or(root_fd), None)),
    }
}

/// The opened file, if it is a regular one: the check is on what was opened (`fstat`), not on
/// the path again. A directory is let through, for the read or write to fail with its own
/// error.
#[cfg(unix)]
fn regular(fd: std::os::fd::OwnedFd, access: Access) -> Result<std::fs::File, OpenError> {
    let file = std::fs::File::from(fd);
    if of_the_kernel(&file)? {
        return Err(OpenError::OfTheKernel);
    }
    let kind = file.metadata()?.file_type();
    if kind.is_file() || kind.is_dir() {
        Ok(file)
    } else {
        Err(OpenError::NotRegular(access))
    }
}

/// Whether the entry `name` of `dir` (not followed, if a link) is a database file a store of
/// this process has open: opened here and closed, it would release the store's lock on it (see
/// [`crate::store::is_store_file`]). Looked at before the open, which is what the close
/// would undo.
#[cfg(unix)]
fn is_a_store_file(dir: &std::os::fd::OwnedFd, name: &std::ffi::OsStr) -> bool {
    beneath::status_at(dir, name).is_ok_and(|status| {
        #[allow(clippy::unnecessary_cast, clippy::useless_conversion)] // their types differ across targets
        crate::store::is_store_file(status.st_dev as u64, status.st_ino as u64)
    })
}

/// Whether `file` is one of the kernel's (Linux: on a procfs or sysfs filesystem). The file
/// tools run in this process: with the root at `/`, `/proc/self/environ` would be this
/// process's launch environment, provider keys included (a command's environment is cleared,
/// and other processes cannot read this one's: see `hide_process_environment`, but nothing
/// stops a process reading its own).
#[cfg(unix)]
fn of_the_kernel(file: &std::fs::File) -> std::io::Result<bool> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        const PROC_SUPER_MAGIC: i64 = 0x9fa0;
        const SYSFS_MAGIC: i64 = 0x6265_6572;
        // SAFETY: `statfs` is plain data, written whole by `fstatfs` on success; the
        // descriptor is open for the call's length.
        let mut status: libc::statfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstatfs(file.as_raw_fd(), &raw mut status) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        #[allow(clippy::unnecessary_cast)] // its type differs across targets
        let kind = status.f_type as i64;
        Ok(kind == PROC_SUPER_MAGIC || kind == SYSFS_MAGIC)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = file;
        Ok(false)
    }
}

/// The components of a path to walk: its names, `..` kept, empty ones and `.` dropped.
#[cfg(unix)]
fn components(path: &std::ffi::OsStr) -> impl Iterator<Item = std::ffi::OsString> + '_ {
    use std::os::unix::ffi::OsStrExt;
    path.as_bytes()
        .split(|byte| *byte == b'/')
        .filter(|part| !part.is_empty() && *part != b".")
        .map(|part| std::ffi::OsStr::from_bytes(part).to_owned())
}

#[cfg(unix)]
impl Access {
    /// The flags of the final component's `openat`. `O_NONBLOCK`: opening a FIFO does not
    /// wait for its other end (a read of one would otherwise hang until the call is aborted);
    /// what was opened is checked, and refused when not a regular file, before any read or
    /// write (on a regular file the flag changes nothing). A write does not truncate at the
    /// open either, for the same reason.
    fn flags(self) -> libc::c_int {
        // `O_NOCTTY`: a terminal opened (refused after, raced in after the look) does not
        // become the runtime's controlling terminal.
        let common = libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY;
        match self {
            Self::Read => libc::O_RDONLY | common,
            Self::Write => libc::O_WRONLY | libc::O_CREAT | common,
        }
    }
}

/// The system calls of [`walk_beneath`] and of what acts on where it ends, each on a directory
/// descriptor and one name.
#[cfg(unix)]
mod beneath {
    use std::ffi::{CString, OsStr, OsString};
    use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
    use std::os::unix::ffi::{OsStrExt, OsStringExt};

    /// A directory to walk into, never through a link. (`O_PATH` on Linux: a directory that
    /// may be searched but not listed can still be walked.)
    #[cfg(target_os = "linux")]
    pub(super) const DIRECTORY: libc::c_int = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    #[cfg(not(target_os = "linux"))]
    pub(super) const DIRECTORY: libc::c_int = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;

    fn c_name(name: &OsStr) -> std::io::Result<CString> {
        CString::new(name.as_bytes()).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
    }

    /// `openat(dir, name, flags)`; `dir` `None` is the working directory (for an absolute
    /// `name`, the root's own path).
    pub(super) fn open_at(dir: Option<&OwnedFd>, name: &OsStr, flags: libc::c_int) -> std::io::Result<OwnedFd> {
        opened_at(dir, name, flags, 0o666)
    }

    /// `openat(dir, name, flags, mode)`: a file made with `mode` (`O_CREAT`).
    pub(super) fn create_at(dir: &OwnedFd, name: &OsStr, flags: libc::c_int, mode: u32) -> std::io::Result<OwnedFd> {
        opened_at(Some(dir), name, flags, mode)
    }

    fn opened_at(dir: Option<&OwnedFd>, name: &OsStr, flags: libc::c_int, mode: u32) -> std::io::Result<OwnedFd> {
        let name = c_name(name)?;
        let dir = dir.map_or(libc::AT_FDCWD, AsRawFd::as_raw_fd);
        // SAFETY: `name` is a NUL-terminated string alive for the call; `dir` is an open
        // descriptor (borrowed for the call) or AT_FDCWD; the mode is read only with O_CREAT.
        let fd = unsafe { libc::openat(dir, name.as_ptr(), flags, mode as libc::c_uint) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// `mkdirat(dir, name)`, a directory already there (made concurrently) being no error.
    pub(super) fn make_dir_at(dir: &OwnedFd, name: &OsStr) -> std::io::Result<()> {
        let name = c_name(name)?;
        // SAFETY: `name` is a NUL-terminated string alive for the call; `dir` is open.
        if unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), 0o777) } < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() != std::io::ErrorKind::AlreadyExists {
                return Err(error);
            }
        }
        Ok(())
    }

    /// The status of `name` in `dir`, a link described itself (not followed).
    pub(super) fn status_at(dir: &impl AsRawFd, name: &OsStr) -> std::io::Result<libc::stat> {
        let name = c_name(name)?;
        let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: `name` is NUL-terminated, `dir` open, `stat` writable for one `stat`.
        let result = unsafe {
            libc::fstatat(
                dir.as_raw_fd(),
                name.as_ptr(),
                stat.as_mut_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        if result < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fstatat succeeded, so it filled `stat`.
        Ok(unsafe { stat.assume_init() })
    }

    /// Whether `name` in `dir` is a symbolic link (not followed).
    pub(super) fn is_link_at(dir: &OwnedFd, name: &OsStr) -> bool {
        status_at(dir, name).is_ok_and(|stat| stat.st_mode & libc::S_IFMT == libc::S_IFLNK)
    }

    /// `unlinkat(dir, name)`: the entry `name` of `dir` removed (a directory, empty, when
    /// `directory`).
    pub(super) fn remove_at(dir: &OwnedFd, name: &OsStr, directory: bool) -> std::io::Result<()> {
        let name = c_name(name)?;
        let flags = if directory { libc::AT_REMOVEDIR } else { 0 };
        // SAFETY: `name` is a NUL-terminated string alive for the call; `dir` is open.
        if unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), flags) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// `renameat(dir, from, dir, to)`: the entry `from` of `dir` replaces its entry `to`.
    pub(super) fn rename_at(dir: &OwnedFd, from: &OsStr, to: &OsStr) -> std::io::Result<()> {
        let (from, to) = (c_name(from)?, c_name(to)?);
        // SAFETY: both names are NUL-terminated strings alive for the call; `dir` is open.
        if unsafe { libc::renameat(dir.as_raw_fd(), from.as_ptr(), dir.as_raw_fd(), to.as_ptr()) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// The directory stream of `fdopendir`, closed when dropped.
    struct Stream(std::ptr::NonNull<libc::DIR>);

    impl Drop for Stream {
        fn drop(&mut self) {
            // SAFETY: the stream came from fdopendir and is closed only here.
            unsafe {
                libc::closedir(self.0.as_ptr());
            }
        }
    }

    /// `errno` cleared, and whether it was: `readdir` tells its end from an error only by it.
    /// Where its location is not known here, a failing `readdir` reads as the end.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    fn clear_errno() -> bool {
        // SAFETY: the location of the calling thread's errno, valid for the thread's life.
        unsafe {
            *libc::__errno_location() = 0;
        }
        true
    }
    #[cfg(any(target_vendor = "apple", target_os = "freebsd"))]
    fn clear_errno() -> bool {
        // SAFETY: the location of the calling thread's errno, valid for the thread's life.
        unsafe {
            *libc::__error() = 0;
        }
        true
    }
    #[cfg(not(any(
        target_os = "linux",
        target_os = "android",
        target_vendor = "apple",
        target_os = "freebsd"
    )))]
    fn clear_errno() -> bool {
        false
    }

    /// The entries of the directory `dir` (opened for reading), `.` and `..` left out, each
    /// with its status (a link described itself). An entry removed while listed is left out.
    /// More than `limit` entries fail the listing (with [`super::TOO_MANY_ENTRIES`]).
    pub(super) fn entries(dir: OwnedFd, limit: usize) -> std::io::Result<Vec<(OsString, libc::stat)>> {
        let raw = dir.into_raw_fd();
        // SAFETY: `raw` is an open directory descriptor owned here; on success the stream owns
        // it (closedir closes it).
        let Some(stream) = std::ptr::NonNull::new(unsafe { libc::fdopendir(raw) }) else {
            let error = std::io::Error::last_os_error();
            // SAFETY: fdopendir failed, so `raw` is still owned here, and closed once.
            drop(unsafe { OwnedFd::from_raw_fd(raw) });
            return Err(error);
        };
        let stream = Stream(stream);
        // SAFETY: the stream is open; its descriptor lives as long as it does.
        let dir = unsafe { std::os::fd::BorrowedFd::borrow_raw(libc::dirfd(stream.0.as_ptr())) };
        let mut entries = Vec::new();
        loop {
            let cleared = clear_errno();
            // SAFETY: the stream is open and used by this thread only.
            let entry = unsafe { libc::readdir(stream.0.as_ptr()) };
            if entry.is_null() {
                let error = std::io::Error::last_os_error();
                return match error.raw_os_error() {
                    Some(code) if cleared && code != 0 => Err(error),
                    _ => Ok(entries),
                };
            }
            // SAFETY: readdir returned an entry, valid until the next readdir on the stream;
            // its name is NUL-terminated. The name is copied before that.
            let name = unsafe { std::ffi::CStr::from_ptr((*entry).d_name.as_ptr()) };
            let name = OsStr::from_bytes(name.to_bytes()).to_owned();
            if name == "." || name == ".." {
                continue;
            }
            if entries.len() >= limit {
                return Err(super::too_many_entries(limit));
            }
            match status_at(&dir, &name) {
                Ok(status) => entries.push((name, status)),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => return Err(error),
            }
        }
    }

    /// The target of the link `name` in `dir`.
    pub(super) fn read_link_at(dir: &OwnedFd, name: &OsStr) -> std::io::Result<OsString> {
        let name = c_name(name)?;
        let mut buffer = vec![0u8; 256];
        loop {
            // SAFETY: `name` is NUL-terminated, `dir` open, and `buffer` writable for its
            // length.
            let read =
                unsafe { libc::readlinkat(dir.as_raw_fd(), name.as_ptr(), buffer.as_mut_ptr().cast(), buffer.len()) };
            let Ok(read) = usize::try_from(read) else {
                return Err(std::io::Error::last_os_error());
            };
            if read < buffer.len() {
                buffer.truncate(read);
                return Ok(OsString::from_vec(buffer));
            }
            // Possibly cut: again with room to spare.
            buffer.resize(buffer.len() * 2, 0);
        }
    }
}

/// Opens the file at the normalized sandbox path `path` under `root` (by path: elsewhere than
/// on Unix, the check of [`LocalSandbox::resolve`] is all there is).
#[cfg(not(unix))]
fn open_beneath(root: &Root, path: &str, access: Access) -> Result<std::fs::File, OpenError> {
    let real = root.join(path.trim_start_matches('/'));
    match access {
        Access::Read => Ok(std::fs::File::open(&real)?),
        Access::Write => {
            if let Some(parent) = real.parent() {
                std::fs::create_dir_all(parent)?;
            }
            Ok(std::fs::File::options().write(true).create(true).open(&real)?)
        }
    }
}

/// Removes the file, link or empty directory at the normalized sandbox path `path` (by path:
/// elsewhere than on Unix, the check of [`LocalSandbox::resolve`] is all there is).
#[cfg(not(unix))]
fn remove_beneath(root: &Root, path: &str) -> Result<(), OpenError> {
    let real = root.join(path.trim_start_matches('/'));
    if std::fs::symlink_metadata(&real)?.is_dir() {
        std::fs::remove_dir(&real)?;
    } else {
        std::fs::remove_file(&real)?;
    }
    Ok(())
}

/// The entries of the directory at the normalized sandbox path `path` (by path, as
/// [`remove_beneath`] elsewhere than on Unix).
#[cfg(not(unix))]
fn list_beneath(root: &Root, path: &str) -> Result<Vec<DirEntry>, OpenError> {
    let mut entries = Vec::new();
    for entry in std::fs::read_dir(root.join(path.trim_start_matches('/')))? {
        let entry = entry?;
        if entries.len() >= MAX_LISTED_ENTRIES {
            return Err(too_many_entries(MAX_LISTED_ENTRIES).into());
        }
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        let metadata = entry.metadata()?;
        entries.push(DirEntry {
            name,
            is_dir: metadata.is_dir(),
            size: if metadata.is_dir() { 0 } else { metadata.len() },
        });
    }
    Ok(entries)
}

/// Makes `command` start in the directory at the normalized sandbox path `path` under `root`
/// (`shown`: the path as the caller gave it, for errors).
///
/// A path handed to the child (`current_dir`) would be resolved again when it starts, after
/// the check of [`LocalSandbox::resolve`]: a directory on the way swapped for a link out of the
/// root in between would start the command outside it. So the directory is opened here by
/// [`open_dir_beneath`], and the child changes into that descriptor (`fchdir`) just before it
/// runs the command; nothing resolves the path again. The descriptor belongs to the
/// `pre_exec` closure, so it stays open until the command (the closure with it) is dropped,
/// after the spawn; `O_CLOEXEC` closes it in the child as the shell starts.
///
/// A missing directory, or one that is none, fails as `current_dir` did: with the system's
/// error (`NotFound` for a missing one).
#[cfg(unix)]
async fn start_in(
    command: &mut tokio::process::Command,
    root: Root,
    path: String,
    shown: String,
) -> Result<(), SandboxError> {
    use std::os::fd::AsRawFd;
    /// `close_range`'s flag that marks the descriptors close-on-exec rather than closing them
    /// (the pipe through which the child reports a failed exec stays open until the exec).
    #[cfg(target_os = "linux")]
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    let dir = blocking(move || {
        open_dir_beneath(&root, &path).map_err(|error| match error {
            // Said as the command's directory: the model would read a bare "no such file" as
            // a path its command named.
            OpenError::Io(error) if error.kind() == std::io::ErrorKind::NotFound => {
                SandboxError::NotFound(format!("{shown} (the working directory the command was to start in)"))
            }
            OpenError::Io(error) => io(error),
            other => other.shown(&shown),
        })
    })
    .await?;
    let change_into = move || {
        // SAFETY: `dir` is an open directory descriptor, owned by this closure (the child's
        // copy of it, in the child).
        if unsafe { libc::fchdir(dir.as_raw_fd()) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // A session of its own (and so a process group of its own, whose id is the shell's
        // pid: a timeout or an abort kills every process the command started). Without a
        // controlling terminal, a command that asks the user something (`git push` over
        // HTTPS, `ssh`, `sudo`) fails at once instead of stopping for its timeout as a
        // background group reading the runtime's terminal, and cannot write or type into it.
        // SAFETY: `setsid` takes no arguments; the child is no group leader yet (its group is
        // the runtime's).
        if unsafe { libc::setsid() } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // Descriptors the runtime's own process inherited without close-on-exec (from what
        // launched it) are no business of the command's: every one past stdio closes at exec.
        // Best effort: a kernel before 5.11 refuses the flag, and they stay open.
        #[cfg(target_os = "linux")]
        // SAFETY: `close_range` with `CLOSE_RANGE_CLOEXEC` only marks descriptors; its
        // arguments are plain integers.
        unsafe {
            libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, CLOSE_RANGE_CLOEXEC);
        }
        Ok(())
    };
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe calls are sound: it makes three system calls (`fchdir`, `setsid`,
    // `close_range`),
    // reads `errno` on failure, and neither allocates nor takes a lock.
    unsafe {
        command.pre_exec(change_into);
    }
    Ok(())
}

/// Makes `command` start in the directory at the normalized sandbox path `path` under `root`,
/// by path (`current_dir`): elsewhere than on Unix the check of [`LocalSandbox::resolve`] is
/// all there is, and a directory on the way swapped for a link after it is followed when the
/// command starts.
#[cfg(not(unix))]
async fn start_in(
    command: &mut tokio::process::Command,
    root: Root,
    path: String,
    _shown: String,
) -> Result<(), SandboxError> {
    command.current_dir(root.join(path.trim_start_matches('/')));
    Ok(())
}

/// `work` on tokio's blocking pool (the file system calls of one operation, in one go).
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, SandboxError> + Send + 'static,
) -> Result<T, SandboxError> {
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|error| Err(SandboxError::Io(format!("the file operation failed: {error}"))))
}

impl LocalSandbox {
    /// The sandbox path of the file at `path` with the links of its deepest existing ancestor
    /// resolved (the part that does not exist yet appended as given).
    fn real_sandbox_path(&self, path: &str) -> Result<String, SandboxError> {
        let normalized = normalize(path)?;
        let normalized = self.inside(&normalized);
        let real = self.root.join(normalized.trim_start_matches('/'));
        let mut existing: &Path = &real;
        let mut missing = Vec::new();
        let canonical = loop {
            match std::fs::canonicalize(existing) {
                Ok(canonical) => break canonical,
                Err(error) => match (existing.parent(), existing.file_name()) {
                    (Some(parent), Some(name)) => {
                        missing.push(name);
                        existing = parent;
                    }
                    _ => return Err(io(error)),
                },
            }
        };
        let inside = canonical
            .strip_prefix(&self.root)
            .map_err(|_| SandboxError::OutsideRoot(path.to_owned()))?;
        let parts: Vec<String> = inside
            .iter()
            .chain(missing.into_iter().rev())
            .map(|part| part.to_string_lossy().into_owned())
            .collect();
        Ok(format!("/{}", parts.join("/")))
    }
}

/// Bytes of each output stream a command keeps (its end): the `bash` tool shows at most
/// 50 KB, and a command flooding its output must not grow the runtime's memory with it.
const MAX_OUTPUT_BYTES: usize = 1024 * 1024;

/// How long a command's output is still read once its shell has exited or been killed. What
/// it printed last may still be in the pipes, but a process that outlives the shell (one it
/// started in the background) can hold them open indefinitely, so they are not read to their
/// end.
const OUTPUT_GRACE: Duration = Duration::from_millis(150);

/// One output stream of a command, read as it comes, keeping only its last
/// [`MAX_OUTPUT_BYTES`].
struct Captured<R> {
    /// `None` once the stream has ended (or when there was none).
    reader: Option<R>,
    kept: Vec<u8>,
}

impl<R: tokio::io::AsyncRead + Unpin> Captured<R> {
    fn new(reader: Option<R>) -> Self {
        Self {
            reader,
            kept: Vec::new(),
        }
    }

    /// Reads until the stream ends. Stopping it midway (a timeout) loses nothing: each read is
    /// kept as it arrives, and calling it again goes on where it stopped.
    async fn read_to_end(&mut self) {
        use tokio::io::AsyncReadExt;
        let Some(reader) = self.reader.as_mut() else { return };
        let mut buffer = vec![0u8; 64 * 1024];
        loop {
            match reader.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(read) => {
                    self.kept.extend_from_slice(&buffer[..read]);
                    // Trimmed only now and then, so a flood is not shifted on every read.
                    if self.kept.len() > 2 * MAX_OUTPUT_BYTES {
                        self.kept.drain(..self.kept.len() - MAX_OUTPUT_BYTES);
                    }
                }
            }
        }
        self.reader = None;
    }

    /// What was read, at most its last [`MAX_OUTPUT_BYTES`].
    fn into_text(mut self) -> String {
        if self.kept.len() > MAX_OUTPUT_BYTES {
            self.kept.drain(..self.kept.len() - MAX_OUTPUT_BYTES);
        }
        String::from_utf8_lossy(&self.kept).into_owned()
    }
}

/// What ended a command that a signal killed (a crash, the kernel out of memory), said so the
/// model does not take it for a hang.
fn killed_by_signal(status: &std::process::ExitStatus) -> Option<String> {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        let signal = status.signal()?;
        let name = match signal {
            libc::SIGHUP => "SIGHUP",
            libc::SIGINT => "SIGINT",
            libc::SIGQUIT => "SIGQUIT",
            libc::SIGILL => "SIGILL",
            libc::SIGABRT => "SIGABRT",
            libc::SIGBUS => "SIGBUS",
            libc::SIGFPE => "SIGFPE",
            libc::SIGKILL => "SIGKILL",
            libc::SIGSEGV => "SIGSEGV",
            libc::SIGPIPE => "SIGPIPE",
            libc::SIGTERM => "SIGTERM",
            _ => return Some(format!("The command was killed by signal {signal}.")),
        };
        Some(format!("The command was killed by signal {signal} ({name})."))
    }
    #[cfg(not(unix))]
    {
        let _ = status;
        None
    }
}

/// The process groups of the commands running in this process, for
/// [`kill_running_commands`].
static RUNNING: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

fn running() -> std::sync::MutexGuard<'static, Vec<u32>> {
    RUNNING.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Kills every command the local sandboxes of this process are running, with what each
/// started. A command runs in a session of its own, so the terminal's Ctrl-C does not reach
/// it, and it dies with its call's future; `std::process::exit` drops no future. Call this
/// before exiting while responses may still run a command (the [`cli`](crate::cli) does):
/// else the commands outlive the process, and a resumed attempt may run one again beside
/// its first run. What a command that has ended left running in the background
/// (`npm run dev &`) is the command's to leave: it is not tracked, and outlives this call and
/// the process.
pub fn kill_running_commands() {
    let groups = std::mem::take(&mut *running());
    for group in groups {
        kill_group(group);
    }
}

/// A command's process group, killed when dropped (whatever of it still runs), with, on
/// Linux, the groups of the shell's descendants that left it (GNU `timeout`, `setsid`, job
/// control move a process to a group of its own, which killing the command's group would miss)
/// while they are still its descendants. (Elsewhere the command's group alone is killed.) A daemon that forks and leaves its parent
/// (`setsid -f`, `pg_ctl start`, `redis-server --daemonize yes`, `ssh -fN`) is no longer
/// one, and outlives the command: run untrusted models in a container of their own.
struct ProcessGroup(u32);

impl ProcessGroup {
    /// The group of the command whose shell is `pid`, known to [`kill_running_commands`]
    /// until dropped.
    fn running(pid: u32) -> Self {
        running().push(pid);
        Self(pid)
    }

    /// Forgets the group unkilled: its command ended (its id may be another's by now).
    fn release(self) {
        let group = self.0;
        running().retain(|&running| running != group);
        std::mem::forget(self);
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        let group = self.0;
        running().retain(|&running| running != group);
        kill_group(group);
    }
}

/// Kills the process group `group` and the groups of its descendants that left it.
fn kill_group(group: u32) {
    #[cfg(not(unix))]
    let _ = group;
    #[cfg(unix)]
    if let Ok(group) = libc::pid_t::try_from(group) {
        // Found while the shell (the group's leader) still runs and they are its
        // descendants. The command's group is stopped first, so it starts no more of them
        // meanwhile; a process of another group that forks meanwhile is in a group killed
        // here, or is found by the next look.
        #[cfg(target_os = "linux")]
        // SAFETY: killpg only sends a signal; a group already gone returns ESRCH.
        unsafe {
            libc::killpg(group, libc::SIGSTOP);
        }
        #[cfg(target_os = "linux")]
        for _ in 0..3 {
            // SAFETY: getpgrp has no preconditions and cannot fail.
            let own = unsafe { libc::getpgrp() };
            // Never this process's own group (a descendant may join it), nor init's.
            let others: Vec<(libc::pid_t, bool)> = descendant_groups(group)
                .into_iter()
                .filter(|(other, _)| *other != group && *other != own && *other > 1)
                .collect();
            for &(other, _) in &others {
                // SAFETY: killpg only sends a signal; a group already gone returns ESRCH.
                unsafe {
                    libc::killpg(other, libc::SIGKILL);
                }
            }
            // A zombie's group is killed (its members may live on: the zombie keeps the
            // group id from reuse), but only a live process found is worth another look.
            if !others.iter().any(|&(_, live)| live) {
                break;
            }
        }
        // SAFETY: killpg only sends a signal; a group already gone returns ESRCH, which
        // is no error here.
        unsafe {
            libc::killpg(group, libc::SIGKILL);
        }
    }
}

/// The process groups of `root`'s descendants (from `/proc`: each process's parent and group),
/// each with whether a live process (not a zombie) of it was found.
#[cfg(target_os = "linux")]
fn descendant_groups(root: libc::pid_t) -> std::collections::BTreeMap<libc::pid_t, bool> {
    let mut children: std::collections::HashMap<libc::pid_t, Vec<(libc::pid_t, libc::pid_t, bool)>> =
        std::collections::HashMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Default::default();
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid pgrp …`; the command name may hold spaces and parentheses.
        let Some((_, after)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut fields = after.split_whitespace();
        let live = fields.next() != Some("Z");
        if let (Some(Ok(parent)), Some(Ok(group))) = (
            fields.next().map(str::parse::<libc::pid_t>),
            fields.next().map(str::parse::<libc::pid_t>),
        ) {
            children.entry(parent).or_default().push((pid, group, live));
        }
    }
    let mut groups = std::collections::BTreeMap::new();
    let mut pending = vec![root];
    while let Some(parent) = pending.pop() {
        for &(pid, group, live) in children.get(&parent).into_iter().flatten() {
            *groups.entry(group).or_insert(false) |= live;
            pending.push(pid);
        }
    }
    groups
}

impl Sandbox for LocalSandbox {
    fn files_identity(&self) -> Option<String> {
        Some(format!("local:{}", self.root.real.display()))
    }

    fn read_file(&self, path: &str) -> BoxFuture<'_, Result<Vec<u8>, SandboxError>> {
        let this = self.clone();
        let shown = path.to_owned();
        Box::pin(async move {
            blocking(move || {
                use std::io::Read;
                let normalized = this.checked(&shown)?;
                let mut file =
                    open_beneath(&this.root, &normalized, Access::Read).map_err(|error| error.shown(&shown))?;
                let mut bytes = Vec::new();
                file.read_to_end(&mut bytes).map_err(io)?;
                Ok(bytes)
            })
            .await
        })
    }

    fn real_path(&self, path: &str) -> BoxFuture<'_, Result<String, SandboxError>> {
        let this = self.clone();
        let path = path.to_owned();
        Box::pin(async move { blocking(move || this.real_sandbox_path(&path)).await })
    }

    fn read_file_with<'a>(
        &'a self,
        path: &str,
        visit: &'a mut (dyn FnMut(&[u8]) -> bool + Send),
    ) -> BoxFuture<'a, Result<(), SandboxError>> {
        let this = self.clone();
        let shown = path.to_owned();
        Box::pin(async move {
            use tokio::io::AsyncReadExt;
            let file = blocking(move || {
                let normalized = this.checked(&shown)?;
                open_beneath(&this.root, &normalized, Access::Read).map_err(|error| error.shown(&shown))
            })
            .await?;
            let mut file = tokio::fs::File::from_std(file);
            let mut buffer = vec![0u8; 64 * 1024];
            loop {
                let read = file.read(&mut buffer).await.map_err(io)?;
                if read == 0 || !visit(&buffer[..read]) {
                    return Ok(());
                }
            }
        })
    }

    fn write_file(&self, path: &str, contents: Vec<u8>) -> BoxFuture<'_, Result<(), SandboxError>> {
        let this = self.clone();
        let shown = path.to_owned();
        Box::pin(async move {
            blocking(move || {
                let normalized = this.checked(&shown)?;
                let mut file =
                    open_beneath(&this.root, &normalized, Access::Write).map_err(|error| error.shown(&shown))?;
                write_whole(&this.root, &normalized, &mut file, &contents).map_err(io)
            })
            .await
        })
    }

    fn remove(&self, path: &str) -> BoxFuture<'_, Result<(), SandboxError>> {
        let this = self.clone();
        let shown = path.to_owned();
        Box::pin(async move {
            blocking(move || {
                let normalized = this.checked(&shown)?;
                if normalized == "/" {
                    return Err(SandboxError::Io("the sandbox root cannot be removed".into()));
                }
                remove_beneath(&this.root, &normalized).map_err(|error| error.shown(&shown))
            })
            .await
        })
    }

    fn list_dir(&self, path: &str) -> BoxFuture<'_, Result<Vec<DirEntry>, SandboxError>> {
        let this = self.clone();
        let shown = path.to_owned();
        Box::pin(async move {
            let mut entries = blocking(move || {
                let normalized = this.checked(&shown)?;
                list_beneath(&this.root, &normalized).map_err(|error| error.shown(&shown))
            })
            .await?;
            entries.sort_by(|a, b| a.name.cmp(&b.name));
            Ok(entries)
        })
    }

    fn exec(&self, request: ExecRequest) -> BoxFuture<'_, Result<ExecOutput, SandboxError>> {
        let shown = request.cwd.clone().unwrap_or_else(|| "/".to_owned());
        let this = self.clone();
        let checking = shown.clone();
        let checked = blocking(move || {
            let inside = this.checked(&checking)?;
            Ok((this.resolve(&inside)?, inside))
        });
        let root = self.root.clone();
        // The user's home: per-user toolchains (rustup's, pyenv's, nvm's) and caches live
        // there. (The working directory as home broke them, and filled the workspace with
        // caches the file tools' walks then spent their budget in.)
        let home = std::env::var_os("HOME").filter(|home| Path::new(home).is_absolute());
        Box::pin(async move {
            let (cwd, normalized) = checked.await?;
            hide_process_environment();
            let mut command = tokio::process::Command::new(shell());
            // Where it starts: the directory opened beneath the root, not the path `cwd`
            // resolved again (see `start_in`). The command itself is not confined: it may
            // name any path the process can reach.
            start_in(&mut command, root, normalized, shown).await?;
            // The process's environment holds provider keys and other secrets: a command the
            // model writes gets none of it, only what a shell needs.
            command
                .arg("-c")
                .arg(&request.command)
                .env_clear()
                .env(
                    "PATH",
                    std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into()),
                )
                .env("HOME", home.as_deref().unwrap_or(cwd.as_os_str()))
                .envs(toolchains())
                .env("LANG", "C.UTF-8")
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .kill_on_drop(true);
            // Its own process group (on Unix, a session of its own: see `start_in`): a timeout
            // (or an abort dropping this future) kills every process the command started, not
            // only the shell.
            let limit = request.timeout.unwrap_or(DEFAULT_COMMAND_TIMEOUT);
            let mut child = command.spawn().map_err(io)?;
            // Declared after the shell, so dropped (killing the group) before it: the unreaped
            // shell keeps the group id from being reused by another process meanwhile.
            let mut group = child.id().map(ProcessGroup::running);
            // Outside the timed wait, so a command killed by its timeout still shows what it
            // printed until then.
            let mut stdout = Captured::new(child.stdout.take());
            let mut stderr = Captured::new(child.stderr.take());
            // The call ends with the shell, not with its output pipes: a process it left in
            // the background may hold them open long after (and would make a quick command
            // look timed out).
            let exited = tokio::time::timeout(limit, async {
                tokio::select! {
                    status = child.wait() => status,
                    _ = async { tokio::join!(stdout.read_to_end(), stderr.read_to_end()) } => child.wait().await,
                }
            })
            .await;
            if exited.is_ok() {
                // Done: the group id may already belong to someone else, and what the shell
                // left running in the background is the command's to leave.
                if let Some(group) = group.take() {
                    group.release();
                }
            }
            drop(group);
            // What is still in the pipes, read for a moment only (see `OUTPUT_GRACE`).
            let _ = tokio::time::timeout(OUTPUT_GRACE, async {
                tokio::join!(stdout.read_to_end(), stderr.read_to_end())
            })
            .await;
            match exited {
                Err(_) => {
                    let mut stderr = stderr.into_text();
                    if !stderr.is_empty() && !stderr.ends_with('\n') {
                        stderr.push('\n');
                    }
                    stderr.push_str(&format!("The command was killed after {} s.", limit.as_secs()));
                    Ok(ExecOutput {
                        exit_code: None,
                        stdout: stdout.into_text(),
                        stderr,
                    })
                }
                Ok(Err(error)) => Err(io(error)),
                Ok(Ok(status)) => {
                    let mut stderr = stderr.into_text();
                    if let Some(killed) = killed_by_signal(&status) {
                        if !stderr.is_empty() && !stderr.ends_with('\n') {
                            stderr.push('\n');
                        }
                        stderr.push_str(&killed);
                    }
                    Ok(ExecOutput {
                        exit_code: status.code(),
                        stdout: stdout.into_text(),
                        stderr,
                    })
                }
            }
        })
    }
}

#[cfg(all(test, unix))]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use super::*;

    /// A root and a directory beside it (outside it), removed when dropped.
    struct Scratch {
        base: PathBuf,
        root: PathBuf,
        outside: PathBuf,
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.base);
        }
    }

    fn scratch(name: &str) -> Scratch {
        let base = std::env::temp_dir().join(format!("flue-local-sandbox-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let (root, outside) = (base.join("root"), base.join("outside"));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        let root = std::fs::canonicalize(root).unwrap();
        Scratch { base, root, outside }
    }

    /// A write over a file reserves its room before it changes a byte: a disk that is full
    /// leaves the old contents whole. Once written, a shorter file is cut to the new contents.
    #[test]
    fn a_write_that_finds_no_room_leaves_the_old_contents_whole() {
        let dirs = scratch("overwrite");
        let path = dirs.root.join("notes.txt");
        std::fs::write(&path, "the old notes, long").unwrap();
        let mut file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let full = |_: &std::fs::File, _: u64| Err(std::io::Error::from_raw_os_error(libc::ENOSPC));
        let error = overwrite(&mut file, b"new", full).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "the old notes, long");
        let mut file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        overwrite(&mut file, b"new", reserve).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        let mut file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        overwrite(&mut file, b"newer and longer", reserve).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "newer and longer");
    }

    /// A root reached through a link is known by the path it was configured with too: a path
    /// a command printed under it (`cd ~/project; pwd`) names the file under the root, not one
    /// of a copy made beneath it, and a link a user made with it stays inside.
    #[tokio::test]
    async fn a_root_reached_through_a_link_is_known_by_its_configured_path_too() {
        let dirs = scratch("logical-root");
        let configured = dirs.base.join("configured");
        std::os::unix::fs::symlink(&dirs.root, &configured).unwrap();
        // Configured with a trailing slash, as shell completion writes it.
        let sandbox = LocalSandboxFactory::new(format!("{}/", configured.display()))
            .create_sandbox("i")
            .await
            .unwrap();
        let printed = format!("{}/src/app.py", configured.display());
        sandbox.write_file(&printed, b"print(1)".to_vec()).await.unwrap();
        assert_eq!(
            std::fs::read_to_string(dirs.root.join("src/app.py")).unwrap(),
            "print(1)"
        );
        assert_eq!(sandbox.read_file("/src/app.py").await.unwrap(), b"print(1)");
        std::os::unix::fs::symlink(configured.join("src"), dirs.root.join("lib")).unwrap();
        assert_eq!(sandbox.read_file("lib/app.py").await.unwrap(), b"print(1)");
        // The real path still names the root, and a path outside both is refused.
        let real = format!("{}/src/app.py", dirs.root.display());
        assert_eq!(sandbox.read_file(&real).await.unwrap(), b"print(1)");
        std::os::unix::fs::symlink(&dirs.outside, dirs.root.join("away")).unwrap();
        assert!(matches!(
            sandbox.read_file("away/x").await,
            Err(SandboxError::OutsideRoot(_))
        ));
    }

    /// A write over a file with contents replaces it whole: the new contents in a new file of
    /// the old one's mode, renamed over it, nothing left beside it. A write that fails partway
    /// (a disk filling on a copy-on-write filesystem, where reserving room reserves nothing)
    /// leaves the old file as it was.
    #[cfg(unix)]
    #[tokio::test]
    async fn a_write_replaces_a_file_whole_or_leaves_it_as_it_was() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dirs = scratch("replace");
        let path = dirs.root.join("notes.txt");
        std::fs::write(&path, "the old notes, long").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        let before = std::fs::metadata(&path).unwrap();
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        sandbox.write_file("notes.txt", b"new".to_vec()).await.unwrap();
        let after = std::fs::metadata(&path).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        assert_ne!(after.ino(), before.ino(), "replaced, not written over");
        assert_eq!(after.permissions().mode() & 0o7777, 0o640);
        let names = |dir: &Path| {
            let mut names: Vec<String> = std::fs::read_dir(dir)
                .unwrap()
                .map(|entry| entry.unwrap().file_name().into_string().unwrap())
                .collect();
            names.sort();
            names
        };
        assert_eq!(names(&dirs.root), ["notes.txt"]);
        // A write cut off partway: half written, then the disk is full.
        let dir = beneath::open_at(None, dirs.root.as_os_str(), beneath::DIRECTORY).unwrap();
        let name = std::ffi::OsStr::new("notes.txt");
        let status = beneath::status_at(&dir, name).unwrap();
        let cut = |file: &mut std::fs::File| {
            use std::io::Write;
            // Readable by this user alone while it is written (the old file's mode after).
            assert_eq!(file.metadata()?.permissions().mode() & 0o777, 0o600);
            file.write_all(b"half of the new")?;
            Err(std::io::Error::from_raw_os_error(libc::ENOSPC))
        };
        let error = replace_at(&dir, name, &status, cut).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        assert_eq!(names(&dirs.root), ["notes.txt"], "the new file is removed");
        // A replacement that cannot be renamed into place (here over a directory; a sticky
        // directory or a mount point alike) changes nothing and says so: written in place then.
        std::fs::create_dir(dirs.root.join("held")).unwrap();
        std::fs::write(dirs.root.join("held/inside"), "").unwrap();
        let held = beneath::status_at(&dir, std::ffi::OsStr::new("held")).unwrap();
        let placed = replace_at(&dir, std::ffi::OsStr::new("held"), &held, |file| {
            std::io::Write::write_all(file, b"x")
        });
        assert!(!placed.unwrap());
        assert_eq!(names(&dirs.root), ["held", "notes.txt"], "nothing left beside it");
        std::fs::remove_dir_all(dirs.root.join("held")).unwrap();
        // A link stays a link, and a file's links stay one file: both written in place.
        std::os::unix::fs::symlink("notes.txt", dirs.root.join("link.txt")).unwrap();
        std::fs::hard_link(&path, dirs.root.join("hard.txt")).unwrap();
        sandbox
            .write_file("link.txt", b"through the link".to_vec())
            .await
            .unwrap();
        assert!(
            std::fs::symlink_metadata(dirs.root.join("link.txt"))
                .unwrap()
                .is_symlink()
        );
        assert_eq!(
            std::fs::read_to_string(dirs.root.join("hard.txt")).unwrap(),
            "through the link"
        );
        sandbox
            .write_file("hard.txt", b"through the other".to_vec())
            .await
            .unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "through the other");
    }

    /// A listing reads at most its limit of entries: one more fails it, saying so (a walk
    /// then says it was cut), rather than reading on and keeping every entry.
    #[cfg(unix)]
    #[test]
    fn a_listing_past_its_limit_of_entries_fails_saying_so() {
        let scratch = scratch("many-entries");
        for n in 0..5 {
            std::fs::write(scratch.root.join(format!("f{n}")), "").unwrap();
        }
        let open = || std::fs::File::open(&scratch.root).unwrap().into();
        assert_eq!(beneath::entries(open(), 5).unwrap().len(), 5);
        let error = beneath::entries(open(), 4).unwrap_err();
        assert_eq!(
            error.to_string(),
            format!("the directory holds more than 4 {TOO_MANY_ENTRIES}")
        );
    }

    // The race's end state: `resolve` checked the path while it was inside the root, then a
    // directory on the way (or the file itself) was swapped for a link out of the root before
    // the open. The open must not follow it.

    #[test]
    fn a_directory_swapped_for_a_link_after_the_check_is_not_written_through() {
        let dirs = scratch("swapped-dir");
        std::fs::create_dir_all(dirs.root.join("sub")).unwrap();
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        sandbox.resolve("/sub/planted.txt").unwrap();
        std::fs::remove_dir(dirs.root.join("sub")).unwrap();
        std::os::unix::fs::symlink(&dirs.outside, dirs.root.join("sub")).unwrap();
        let opened = open_beneath(&Root::real(dirs.root.clone()), "/sub/planted.txt", Access::Write);
        assert!(matches!(opened, Err(OpenError::Outside)), "{opened:?}");
        assert!(!dirs.outside.join("planted.txt").exists(), "the write left the root");
    }

    #[test]
    fn a_file_swapped_for_a_link_after_the_check_is_not_read_or_written_through() {
        let dirs = scratch("swapped-file");
        std::fs::write(dirs.root.join("notes.txt"), "mine").unwrap();
        std::fs::write(dirs.outside.join("secret.txt"), "secret").unwrap();
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        sandbox.resolve("/notes.txt").unwrap();
        std::fs::remove_file(dirs.root.join("notes.txt")).unwrap();
        std::os::unix::fs::symlink(dirs.outside.join("secret.txt"), dirs.root.join("notes.txt")).unwrap();
        let read = open_beneath(&Root::real(dirs.root.clone()), "/notes.txt", Access::Read);
        assert!(matches!(read, Err(OpenError::Outside)), "{read:?}");
        let written = open_beneath(&Root::real(dirs.root.clone()), "/notes.txt", Access::Write);
        assert!(matches!(written, Err(OpenError::Outside)), "{written:?}");
        assert_eq!(
            std::fs::read_to_string(dirs.outside.join("secret.txt")).unwrap(),
            "secret"
        );
    }

    #[test]
    fn links_that_stay_inside_the_root_are_still_followed() {
        let dirs = scratch("inside-links");
        std::fs::create_dir_all(dirs.root.join("data/deep")).unwrap();
        std::fs::write(dirs.root.join("data/deep/f.txt"), "found").unwrap();
        std::os::unix::fs::symlink("data/deep", dirs.root.join("relative")).unwrap();
        std::os::unix::fs::symlink(dirs.root.join("data"), dirs.root.join("absolute")).unwrap();
        std::os::unix::fs::symlink("../deep/f.txt", dirs.root.join("data/deep/up.txt")).unwrap();
        for path in ["/relative/f.txt", "/absolute/deep/f.txt", "/relative/up.txt"] {
            let mut text = String::new();
            std::io::Read::read_to_string(
                &mut open_beneath(&Root::real(dirs.root.clone()), path, Access::Read).unwrap(),
                &mut text,
            )
            .unwrap();
            assert_eq!(text, "found", "{path}");
        }
        std::io::Write::write_all(
            &mut open_beneath(&Root::real(dirs.root.clone()), "/relative/new/made.txt", Access::Write).unwrap(),
            b"made",
        )
        .unwrap();
        assert_eq!(
            std::fs::read_to_string(dirs.root.join("data/deep/new/made.txt")).unwrap(),
            "made"
        );
        // A link climbing out of the root through `..` is refused like any other.
        std::os::unix::fs::symlink("../../outside", dirs.root.join("data/climb")).unwrap();
        let climbed = open_beneath(&Root::real(dirs.root.clone()), "/data/climb/x.txt", Access::Write);
        assert!(matches!(climbed, Err(OpenError::Outside)), "{climbed:?}");
    }
    #[test]
    fn a_directory_swapped_for_a_link_after_the_check_is_not_removed_through() {
        let dirs = scratch("swapped-remove");
        std::fs::create_dir_all(dirs.root.join("sub")).unwrap();
        std::fs::write(dirs.root.join("sub/victim.txt"), "mine").unwrap();
        std::fs::write(dirs.outside.join("victim.txt"), "theirs").unwrap();
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        sandbox.resolve("/sub/victim.txt").unwrap();
        std::fs::remove_dir_all(dirs.root.join("sub")).unwrap();
        std::os::unix::fs::symlink(&dirs.outside, dirs.root.join("sub")).unwrap();
        let removed = remove_beneath(&Root::real(dirs.root.clone()), "/sub/victim.txt");
        assert!(matches!(removed, Err(OpenError::Outside)), "{removed:?}");
        assert!(dirs.outside.join("victim.txt").exists(), "the removal left the root");
    }

    /// `/sub/inner` in the root, checked, then `/sub` swapped for a link to a directory
    /// outside that has an `inner` too.
    fn swapped_after_the_check(name: &str) -> Scratch {
        let dirs = scratch(name);
        std::fs::create_dir_all(dirs.root.join("sub/inner")).unwrap();
        std::fs::create_dir_all(dirs.outside.join("inner")).unwrap();
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        sandbox.resolve("/sub/inner").unwrap();
        sandbox.resolve("/sub").unwrap();
        std::fs::remove_dir_all(dirs.root.join("sub")).unwrap();
        std::os::unix::fs::symlink(&dirs.outside, dirs.root.join("sub")).unwrap();
        dirs
    }

    #[test]
    fn a_directory_swapped_for_a_link_after_the_check_is_not_listed_through() {
        let dirs = swapped_after_the_check("swapped-list");
        std::fs::write(dirs.outside.join("inner/secret.txt"), "secret").unwrap();
        // A directory on the way, and the listed directory itself.
        for path in ["/sub/inner", "/sub"] {
            let listed = list_beneath(&Root::real(dirs.root.clone()), path);
            assert!(matches!(listed, Err(OpenError::Outside)), "{path}: {listed:?}");
        }
    }

    #[test]
    fn a_directory_swapped_for_a_link_after_the_check_is_not_opened_as_a_cwd() {
        let dirs = swapped_after_the_check("swapped-cwd-open");
        // A directory on the way, and the cwd itself.
        for path in ["/sub/inner", "/sub"] {
            let opened = open_dir_beneath(&Root::real(dirs.root.clone()), path);
            assert!(matches!(opened, Err(OpenError::Outside)), "{path}: {opened:?}");
        }
        // A link that stays inside the root is followed to the directory it names.
        std::fs::create_dir_all(dirs.root.join("data/deep")).unwrap();
        std::os::unix::fs::symlink("data/deep", dirs.root.join("relative")).unwrap();
        let opened = std::fs::File::from(open_dir_beneath(&Root::real(dirs.root.clone()), "/relative").unwrap());
        let (opened, deep) = (
            opened.metadata().unwrap(),
            std::fs::metadata(dirs.root.join("data/deep")).unwrap(),
        );
        use std::os::unix::fs::MetadataExt;
        assert_eq!((opened.dev(), opened.ino()), (deep.dev(), deep.ino()));
    }

    /// A link to a missing file inside the root is refused as such, not as a path outside
    /// the root; one to a missing file outside it is refused as outside.
    #[tokio::test]
    async fn a_dangling_link_says_where_it_points() {
        let dirs = scratch("dangling-inside");
        std::os::unix::fs::symlink("build/out.txt", dirs.root.join("latest")).unwrap();
        std::os::unix::fs::symlink(dirs.outside.join("gone.txt"), dirs.root.join("away")).unwrap();
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        let inside = sandbox.write_file("/latest", b"x".to_vec()).await.unwrap_err();
        assert!(
            matches!(&inside, SandboxError::NotFound(said) if said.contains("symbolic link whose target does not exist")),
            "{inside:?}"
        );
        let away = sandbox.write_file("/away", b"x".to_vec()).await.unwrap_err();
        assert!(matches!(away, SandboxError::OutsideRoot(_)), "{away:?}");
        assert!(!dirs.outside.join("gone.txt").exists());
    }

    /// A command's home is this process's (where per-user toolchains live), not the working
    /// directory.
    #[tokio::test]
    async fn a_commands_home_is_the_users_not_the_working_directory() {
        let dirs = scratch("home");
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        let ran = sandbox
            .exec(ExecRequest {
                command: "echo \"$HOME\"".into(),
                cwd: None,
                timeout: None,
            })
            .await
            .unwrap();
        let expected = std::env::var("HOME")
            .ok()
            .filter(|home| home.starts_with('/'))
            .unwrap_or_else(|| dirs.root.display().to_string());
        assert_eq!(ran.stdout.trim(), expected);
    }

    /// A path a command printed (the root's host path and beneath) names the file beneath
    /// the root in every file operation, not one of a copy of the host's tree.
    #[tokio::test]
    async fn the_roots_host_path_names_the_root_in_the_file_operations() {
        let dirs = scratch("host-path");
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        let host = dirs.root.display().to_string();
        sandbox
            .write_file(&format!("{host}/src/main.py"), b"print(1)".to_vec())
            .await
            .unwrap();
        assert_eq!(std::fs::read(dirs.root.join("src/main.py")).unwrap(), b"print(1)");
        assert!(
            !dirs.root.join(host.trim_start_matches('/')).exists(),
            "no copy of the host's tree"
        );
        assert_eq!(sandbox.read_file("/src/main.py").await.unwrap(), b"print(1)");
        assert_eq!(
            sandbox.read_file(&format!("{host}/src/../src/main.py")).await.unwrap(),
            b"print(1)"
        );
        assert_eq!(
            sandbox.real_path(&format!("{host}/src/main.py")).await.unwrap(),
            "/src/main.py"
        );
        let listed = sandbox.list_dir(&host).await.unwrap();
        assert_eq!(
            listed.iter().map(|entry| entry.name.as_str()).collect::<Vec<_>>(),
            ["src"]
        );
        // A path that only starts like the root's is the sandbox path it is, and so is one
        // whose first part is under the root.
        let first = host.trim_start_matches('/').split('/').next().unwrap().to_owned();
        std::fs::create_dir_all(dirs.root.join(&first).join("inner")).unwrap();
        std::fs::write(dirs.root.join(&first).join("inner/kept.txt"), b"kept").unwrap();
        assert_eq!(
            sandbox.read_file(&format!("/{first}/inner/kept.txt")).await.unwrap(),
            b"kept"
        );
        std::fs::remove_dir_all(dirs.root.join(&first)).unwrap();
        let sibling = format!("{host}-sibling/x");
        assert!(matches!(
            sandbox.read_file(&sibling).await,
            Err(SandboxError::NotFound(_))
        ));
        let ran = sandbox
            .exec(ExecRequest {
                command: "pwd".into(),
                cwd: Some(format!("{host}/src")),
                timeout: None,
            })
            .await
            .unwrap();
        assert_eq!(ran.stdout.trim(), format!("{host}/src"));
    }

    #[tokio::test]
    async fn remove_and_list_act_beneath_the_root_and_follow_links_inside_it() {
        let dirs = scratch("remove-list");
        std::fs::create_dir_all(dirs.root.join("data/deep/empty")).unwrap();
        std::fs::write(dirs.root.join("data/deep/f.txt"), "12345").unwrap();
        std::os::unix::fs::symlink("data/deep", dirs.root.join("relative")).unwrap();
        std::os::unix::fs::symlink(dirs.root.join("data"), dirs.root.join("absolute")).unwrap();
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        let listed = sandbox.list_dir("/relative").await.unwrap();
        assert_eq!(
            listed,
            vec![
                DirEntry {
                    name: "empty".into(),
                    is_dir: true,
                    size: 0
                },
                DirEntry {
                    name: "f.txt".into(),
                    is_dir: false,
                    size: 5
                },
            ]
        );
        let top: Vec<_> = sandbox
            .list_dir("/")
            .await
            .unwrap()
            .into_iter()
            .map(|entry| (entry.name, entry.is_dir))
            .collect();
        // A link is listed as a link (not a directory), as it is not followed.
        assert_eq!(
            top,
            [
                ("absolute".into(), false),
                ("data".into(), true),
                ("relative".into(), false)
            ]
        );
        assert_eq!(
            sandbox.list_dir("/data/deep/f.txt").await.map_err(|e| e.to_string()),
            Err("Not a directory (os error 20)".into())
        );
        assert_eq!(
            sandbox.list_dir("/nothing").await,
            Err(SandboxError::NotFound("/nothing".into()))
        );
        sandbox.remove("/absolute/deep/f.txt").await.unwrap();
        sandbox.remove("/relative/empty").await.unwrap();
        assert!(sandbox.list_dir("/data/deep").await.unwrap().is_empty());
        // A link is removed itself, not what it points to.
        sandbox.remove("/relative").await.unwrap();
        assert!(!dirs.root.join("relative").exists() && dirs.root.join("data/deep").is_dir());
        assert_eq!(
            sandbox.remove("/relative").await,
            Err(SandboxError::NotFound("/relative".into()))
        );
        assert!(matches!(sandbox.remove("/").await, Err(SandboxError::Io(_))));
        assert!(dirs.root.is_dir());
    }

    /// `command` run by `sandbox` in the sandbox directory `cwd`.
    async fn run(sandbox: &LocalSandbox, cwd: &str, command: &str) -> Result<ExecOutput, SandboxError> {
        let request = ExecRequest {
            command: command.to_owned(),
            cwd: Some(cwd.to_owned()),
            timeout: Some(Duration::from_secs(20)),
        };
        sandbox.exec(request).await
    }

    /// A command runs in a session of its own, without the runtime's terminal: what asks the
    /// user a question fails at once instead of stopping, and cannot reach the terminal.
    #[tokio::test]
    async fn a_command_leads_a_session_of_its_own_without_the_runtimes_terminal() {
        let dirs = scratch("session");
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        let ran = run(
            &sandbox,
            "/",
            "echo $$; cut -d' ' -f6 /proc/$$/stat; cut -d' ' -f5 /proc/$$/stat",
        )
        .await
        .unwrap();
        let ids: Vec<i64> = ran.stdout.split_whitespace().map(|id| id.parse().unwrap()).collect();
        let [pid, session, group] = ids[..] else {
            panic!("{ran:?}")
        };
        assert_eq!(session, pid, "the shell leads its session");
        assert_eq!(group, pid, "and its process group");
        // SAFETY: `getsid(0)` reads this process's session id.
        assert_ne!(i64::from(unsafe { libc::getsid(0) }), session);
        let tty = run(&sandbox, "/", "cat /dev/tty; echo \"exit $?\"").await.unwrap();
        assert!(tty.stdout.contains("exit 1"), "no terminal to read: {tty:?}");
    }

    #[tokio::test]
    async fn a_command_a_signal_killed_says_which_signal() {
        let dirs = scratch("signalled");
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        let ran = run(&sandbox, "/", "echo before; kill -SEGV $$").await.unwrap();
        assert_eq!(ran.exit_code, None);
        assert_eq!(ran.stdout, "before\n");
        assert_eq!(ran.stderr, "The command was killed by signal 11 (SIGSEGV).");
    }

    /// A command that ended is no longer among the running ones: an exit's
    /// `kill_running_commands` kills nothing of it (its group id may be another's by then,
    /// and what it left in the background is its own to leave).
    #[tokio::test]
    async fn a_command_that_ended_is_not_among_the_running_ones() {
        let dirs = scratch("ended");
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        let ran = run(&sandbox, "/", "echo $$").await.unwrap();
        let pid: u32 = ran.stdout.trim().parse().unwrap();
        assert!(!running().contains(&pid), "{pid} is still listed");
    }

    #[tokio::test]
    async fn an_abandoned_command_leaves_no_process_behind() {
        let dirs = scratch("abandoned");
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        // Dropping the call (an aborted turn) while the shell still runs, once its background
        // child has started (the marker is written after it).
        let mut call = Box::pin(run(
            &sandbox,
            "/",
            "(sleep 1; touch leaked.txt) & touch started.txt; sleep 30",
        ));
        let started = dirs.root.join("started.txt");
        tokio::select! {
            ran = &mut call => panic!("the command ended: {ran:?}"),
            () = async {
                while !started.exists() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            } => {}
        }
        drop(call);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(
            !dirs.root.join("leaked.txt").exists(),
            "the command's children outlived it"
        );
    }

    /// The command's directory is checked, then swapped for a link out of the root before the
    /// command starts in it: `start_in` opens it beneath the root (the walk refuses the link),
    /// so the command does not run outside. (Through `exec` the swap would come before its
    /// check, which refuses it by the path alone: this tests the start itself.)
    #[tokio::test]
    async fn a_cwd_swapped_for_a_link_after_the_check_does_not_run_the_command_outside_the_root() {
        let dirs = scratch("swapped-cwd");
        std::fs::create_dir_all(dirs.root.join("sub")).unwrap();
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        sandbox.resolve("/sub").unwrap();
        std::fs::remove_dir(dirs.root.join("sub")).unwrap();
        std::os::unix::fs::symlink(&dirs.outside, dirs.root.join("sub")).unwrap();
        let mut command = tokio::process::Command::new("sh");
        command.args(["-c", "touch planted.txt"]);
        let started = start_in(
            &mut command,
            Root::real(dirs.root.clone()),
            "/sub".into(),
            "/sub".into(),
        )
        .await;
        assert_eq!(started, Err(SandboxError::OutsideRoot("/sub".into())));
        assert!(!dirs.outside.join("planted.txt").exists());
    }

    #[tokio::test]
    async fn commands_run_in_bash_where_it_is_installed() {
        let dirs = scratch("bashisms");
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        let has_bash = std::process::Command::new("bash")
            .arg("-c")
            .arg("true")
            .status()
            .is_ok_and(|status| status.success());
        let ran = run(
            &sandbox,
            "/",
            "set -o pipefail; words=(one two); [[ ${words[1]} == two ]] && echo bash",
        )
        .await;
        if has_bash {
            let output = ran.expect("the command ran");
            assert_eq!(
                (output.exit_code, output.stdout.as_str()),
                (Some(0), "bash\n"),
                "{output:?}"
            );
            assert!(std::path::Path::new(shell()).is_absolute(), "{:?}", shell());
        } else {
            assert_eq!(shell(), "sh");
        }
    }

    #[tokio::test]
    async fn a_cwd_through_a_link_out_of_the_root_is_refused() {
        let dirs = scratch("linked-cwd");
        std::fs::create_dir_all(dirs.outside.join("inner")).unwrap();
        std::os::unix::fs::symlink(&dirs.outside, dirs.root.join("escape")).unwrap();
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        for cwd in ["/escape", "/escape/inner"] {
            let ran = run(&sandbox, cwd, "touch planted.txt").await;
            assert_eq!(ran, Err(SandboxError::OutsideRoot(cwd.into())), "{cwd}");
        }
        assert!(!dirs.outside.join("planted.txt").exists() && !dirs.outside.join("inner/planted.txt").exists());
    }

    #[tokio::test]
    async fn commands_start_in_their_cwd_links_inside_the_root_followed() {
        let dirs = scratch("exec-cwd");
        std::fs::create_dir_all(dirs.root.join("data/deep")).unwrap();
        std::fs::write(dirs.root.join("data/file.txt"), "x").unwrap();
        std::os::unix::fs::symlink("data/deep", dirs.root.join("relative")).unwrap();
        std::os::unix::fs::symlink(dirs.root.join("data"), dirs.root.join("absolute")).unwrap();
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        let deep = dirs.root.join("data/deep").display().to_string();
        for (cwd, expected) in [
            ("/", dirs.root.display().to_string()),
            ("/data/deep", deep.clone()),
            ("/relative", deep.clone()),
            ("/absolute/deep", deep.clone()),
            ("/data/deep/../deep", deep),
        ] {
            let output = run(&sandbox, cwd, "pwd").await.unwrap();
            assert_eq!(
                (output.exit_code, output.stdout.trim_end()),
                (Some(0), expected.as_str()),
                "{cwd}"
            );
        }
        // A missing cwd is named as the command's working directory (the model would read
        // a bare "no such file" as a path its command named); one that is no directory keeps
        // its error.
        assert_eq!(
            run(&sandbox, "/nothing", "pwd").await,
            Err(SandboxError::NotFound(
                "/nothing (the working directory the command was to start in)".into()
            ))
        );
        assert_eq!(
            run(&sandbox, "/data/file.txt", "pwd").await,
            Err(SandboxError::Io("Not a directory (os error 20)".into()))
        );
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn the_cwd_descriptor_is_not_left_open_in_the_command() {
        let dirs = scratch("exec-fds");
        std::fs::create_dir_all(dirs.root.join("sub")).unwrap();
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        // `exit 0`: a descriptor gone when read (the glob's own) fails `readlink`, no matter.
        let output = run(
            &sandbox,
            "/sub",
            "for fd in /proc/$$/fd/*; do readlink \"$fd\"; done; exit 0",
        )
        .await
        .unwrap();
        assert_eq!(output.exit_code, Some(0), "{output:?}");
        let sub = dirs.root.join("sub").display().to_string();
        // The listing worked: the command's own output pipe is among the descriptors read.
        assert!(
            output.stdout.lines().any(|target| target.starts_with("pipe:")),
            "no descriptor listed: {output:?}"
        );
        assert!(
            !output.stdout.lines().any(|target| target == sub),
            "the cwd's descriptor is open in the command: {output:?}"
        );
    }

    /// Makes a FIFO at `path`.
    fn fifo(path: &Path) {
        use std::os::unix::ffi::OsStrExt;
        let name = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: `name` is a NUL-terminated path alive for the call.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o644) }, 0);
    }

    /// The file tools run in this process: with the root at `/`, its own launch environment
    /// (provider keys) is one read away, and other processes' files of the kernel too.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn the_kernels_files_are_not_opened_by_the_file_tools() {
        let sandbox = LocalSandbox {
            root: Root::real("/".into()),
        };
        for path in ["/proc/self/environ", "/proc/self/cmdline", "/sys/kernel/hostname"] {
            if !Path::new(path).exists() {
                continue;
            }
            assert_eq!(
                sandbox.read_file(path).await,
                Err(SandboxError::Io(format!(
                    "{path} is a file of the kernel's (/proc or /sys); the file tools do not open them"
                ))),
                "{path}"
            );
        }
        // Nothing written either.
        assert!(matches!(
            sandbox.write_file("/proc/self/comm", b"x".to_vec()).await,
            Err(SandboxError::Io(message)) if message.contains("a file of the kernel's")
        ));
    }

    /// The file tools run in this process: a store's database opened by them and closed would
    /// release the store's lock on it (any close of the file does), letting another process
    /// open it beside the store. Its files are refused, by name or through a link; once the
    /// store is closed they are files like any other.
    #[cfg(unix)]
    #[tokio::test]
    async fn the_files_of_an_open_store_are_not_opened_by_the_file_tools() {
        let dirs = scratch("store-files");
        let store = crate::store::SqliteStore::open(dirs.root.join(".flue/flue.db")).unwrap();
        std::os::unix::fs::symlink(".flue/flue.db", dirs.root.join("db-link")).unwrap();
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        for path in ["/.flue/flue.db", ".flue/flue.db-wal", "db-link"] {
            assert_eq!(
                sandbox.read_file(path).await,
                Err(SandboxError::Io(format!(
                    "{path} is a file of the runtime's own database; the file tools do not open it"
                ))),
                "{path}"
            );
        }
        assert!(matches!(
            sandbox.write_file(".flue/flue.db", b"x".to_vec()).await,
            Err(SandboxError::Io(message)) if message.contains("the runtime's own database")
        ));
        // The lock file and the directory's other files are the tools' to read.
        sandbox.write_file(".flue/notes.txt", b"ok".to_vec()).await.unwrap();
        assert_eq!(sandbox.read_file(".flue/notes.txt").await.unwrap(), b"ok");
        drop(store);
        assert!(sandbox.read_file(".flue/flue.db").await.is_ok());
    }

    #[tokio::test]
    async fn a_fifo_is_refused_rather_than_waited_on() {
        let dirs = scratch("fifo");
        fifo(&dirs.root.join("pipe"));
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        let read = tokio::time::timeout(Duration::from_secs(5), sandbox.read_file("pipe")).await;
        if read.is_err() {
            // Blocked in the open: a writer lets it go, so the test ends.
            drop(std::fs::OpenOptions::new().write(true).open(dirs.root.join("pipe")));
        }
        assert_eq!(
            read,
            Ok(Err(SandboxError::Io(
                "pipe is not a regular file (but a FIFO, socket or device); only regular files can be read".into()
            )))
        );
        let written = tokio::time::timeout(Duration::from_secs(5), sandbox.write_file("pipe", b"x".to_vec())).await;
        if written.is_err() {
            drop(std::fs::File::open(dirs.root.join("pipe")));
        }
        assert_eq!(
            written,
            Ok(Err(SandboxError::Io(
                "pipe is not a regular file (but a FIFO, socket or device); only regular files can be written".into()
            )))
        );
        // A directory keeps its own error.
        std::fs::create_dir(dirs.root.join("dir")).unwrap();
        let Err(SandboxError::Io(message)) = sandbox.read_file("dir").await else {
            panic!("a directory was read")
        };
        assert!(message.starts_with("Is a directory"), "{message}");
    }

    /// A FIFO is refused without being opened: a writer a command left waiting on it is not
    /// let through (an open would complete its open, and the close after give it EPIPE).
    #[tokio::test]
    async fn a_fifo_is_refused_without_being_opened() {
        let dirs = scratch("fifo-unopened");
        let pipe = dirs.root.join("pipe");
        fifo(&pipe);
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        let (opened, writer_opened) = std::sync::mpsc::channel();
        let writer = std::thread::spawn({
            let pipe = pipe.clone();
            move || {
                let file = std::fs::OpenOptions::new().write(true).open(&pipe);
                opened.send(file.is_ok()).unwrap();
            }
        });
        assert!(sandbox.read_file("pipe").await.is_err());
        assert!(
            writer_opened.recv_timeout(Duration::from_millis(300)).is_err(),
            "the read opened the FIFO: its waiting writer went through"
        );
        // Our own reader lets the writer go.
        let reader = std::fs::File::open(&pipe).unwrap();
        assert!(writer_opened.recv().unwrap());
        drop(reader);
        writer.join().unwrap();
    }

    /// A path past the kernel's length, or deeper than 256 components, is refused before it
    /// is looked up (checking a deep path costs with its depth, and a write makes the
    /// directories it names).
    #[tokio::test]
    async fn a_path_too_long_or_too_deep_is_refused() {
        let dirs = scratch("deep");
        let sandbox = LocalSandbox {
            root: Root::real(dirs.root.clone()),
        };
        let expected = SandboxError::Io("a path may be at most 4096 bytes and 256 components long".into());
        let deep = format!("{}f", "a/".repeat(300));
        assert_eq!(sandbox.write_file(&deep, b"x".to_vec()).await, Err(expected.clone()));
        assert!(!dirs.root.join("a").exists(), "no directory was made");
        let long = "n".repeat(5000);
        assert_eq!(sandbox.read_file(&long).await, Err(expected));
        let fits = format!("{}f", "a/".repeat(200));
        sandbox.write_file(&fits, b"x".to_vec()).await.unwrap();
        assert_eq!(sandbox.read_file(&fits).await.unwrap(), b"x");
    }
}
