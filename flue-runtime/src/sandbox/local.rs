//! The local environment: a directory on the real filesystem, with commands run by `sh -c`.
//! Sandbox paths map onto the root (`/` is the root); a path that leaves it — through `..` or
//! through a symbolic link — is refused.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use flue_core::BoxFuture;
use flue_core::sandbox::{DirEntry, ExecOutput, ExecRequest, Sandbox, SandboxError, SandboxFactory};

use super::normalize;

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
            let root = tokio::fs::canonicalize(&root).await.map_err(io)?;
            Ok(Arc::new(LocalSandbox { root }) as Arc<dyn Sandbox>)
        })
    }
}

/// A directory on the real filesystem.
#[derive(Debug)]
pub struct LocalSandbox {
    root: PathBuf,
}

fn io(error: std::io::Error) -> SandboxError {
    match error.kind() {
        std::io::ErrorKind::NotFound => SandboxError::NotFound(error.to_string()),
        _ => SandboxError::Io(error.to_string()),
    }
}

impl LocalSandbox {
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
                // through it would create its target wherever it points: refused.
                Err(_) if std::fs::symlink_metadata(existing).is_ok() => {
                    return Err(SandboxError::OutsideRoot(path.to_owned()));
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

/// Bytes of each output stream a command keeps (its end): the `bash` tool shows at most
/// 50 KB, and a command flooding its output must not grow the runtime's memory with it.
const MAX_OUTPUT_BYTES: usize = 1024 * 1024;

/// Everything `reader` yields until its end, but only the last [`MAX_OUTPUT_BYTES`] of it.
async fn capped(reader: Option<impl tokio::io::AsyncRead + Unpin>) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    let mut kept = Vec::new();
    let Some(mut reader) = reader else { return kept };
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        match reader.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(read) => {
                kept.extend_from_slice(&buffer[..read]);
                if kept.len() > 2 * MAX_OUTPUT_BYTES {
                    kept.drain(..kept.len() - MAX_OUTPUT_BYTES);
                }
            }
        }
    }
    if kept.len() > MAX_OUTPUT_BYTES {
        kept.drain(..kept.len() - MAX_OUTPUT_BYTES);
    }
    kept
}

/// A command's process group, killed when dropped (whatever of it still runs).
struct ProcessGroup(u32);

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        #[cfg(unix)]
        if let Ok(group) = libc::pid_t::try_from(self.0) {
            // SAFETY: killpg only sends a signal; a group already gone returns ESRCH, which
            // is no error here.
            unsafe {
                libc::killpg(group, libc::SIGKILL);
            }
        }
    }
}

impl Sandbox for LocalSandbox {
    fn read_file(&self, path: &str) -> BoxFuture<'_, Result<Vec<u8>, SandboxError>> {
        let resolved = self.resolve(path);
        let shown = path.to_owned();
        Box::pin(async move {
            let real = resolved?;
            tokio::fs::read(&real).await.map_err(|error| match error.kind() {
                std::io::ErrorKind::NotFound => SandboxError::NotFound(shown),
                _ => io(error),
            })
        })
    }

    fn write_file(&self, path: &str, contents: Vec<u8>) -> BoxFuture<'_, Result<(), SandboxError>> {
        let resolved = self.resolve(path);
        Box::pin(async move {
            let real = resolved?;
            if let Some(parent) = real.parent() {
                tokio::fs::create_dir_all(parent).await.map_err(io)?;
            }
            tokio::fs::write(&real, contents).await.map_err(io)
        })
    }

    fn remove(&self, path: &str) -> BoxFuture<'_, Result<(), SandboxError>> {
        let resolved = self.resolve(path);
        let shown = path.to_owned();
        Box::pin(async move {
            let real = resolved?;
            let metadata = tokio::fs::symlink_metadata(&real)
                .await
                .map_err(|_| SandboxError::NotFound(shown))?;
            if metadata.is_dir() {
                tokio::fs::remove_dir(&real).await.map_err(io)
            } else {
                tokio::fs::remove_file(&real).await.map_err(io)
            }
        })
    }

    fn list_dir(&self, path: &str) -> BoxFuture<'_, Result<Vec<DirEntry>, SandboxError>> {
        let resolved = self.resolve(path);
        let shown = path.to_owned();
        Box::pin(async move {
            let real = resolved?;
            let mut reader = tokio::fs::read_dir(&real).await.map_err(|error| match error.kind() {
                std::io::ErrorKind::NotFound => SandboxError::NotFound(shown),
                _ => io(error),
            })?;
            let mut entries = Vec::new();
            while let Some(entry) = reader.next_entry().await.map_err(io)? {
                let Ok(name) = entry.file_name().into_string() else {
                    continue;
                };
                let metadata = entry.metadata().await.map_err(io)?;
                entries.push(DirEntry {
                    name,
                    is_dir: metadata.is_dir(),
                    size: if metadata.is_dir() { 0 } else { metadata.len() },
                });
            }
            entries.sort_by(|a, b| a.name.cmp(&b.name));
            Ok(entries)
        })
    }

    fn exec(&self, request: ExecRequest) -> BoxFuture<'_, Result<ExecOutput, SandboxError>> {
        let cwd = self.resolve(request.cwd.as_deref().unwrap_or("/"));
        Box::pin(async move {
            let cwd = cwd?;
            let mut command = tokio::process::Command::new("sh");
            // The process's environment holds provider keys and other secrets: a command the
            // model writes gets none of it, only what a shell needs.
            command
                .arg("-c")
                .arg(&request.command)
                .current_dir(&cwd)
                .env_clear()
                .env(
                    "PATH",
                    std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into()),
                )
                .env("HOME", &cwd)
                .env("LANG", "C.UTF-8")
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .kill_on_drop(true);
            // Its own process group: a timeout (or an abort dropping this future) kills every
            // process the command started, not only the shell.
            #[cfg(unix)]
            command.process_group(0);
            let limit = request.timeout.unwrap_or(DEFAULT_COMMAND_TIMEOUT);
            let mut child = command.spawn().map_err(io)?;
            let pid = child.id();
            let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
            let output = async {
                let (stdout, stderr, status) = tokio::join!(capped(stdout), capped(stderr), child.wait());
                status.map(|status| std::process::Output { status, stdout, stderr })
            };
            tokio::pin!(output);
            // Declared after the shell's future, so dropped (killing the group) before it: the
            // unreaped shell keeps the group id from being reused by another process meanwhile.
            let mut group = pid.map(ProcessGroup);
            let finished = tokio::time::timeout(limit, &mut output).await;
            if finished.is_ok() {
                // Done: the group id may already belong to someone else.
                std::mem::forget(group.take());
            }
            drop(group);
            match finished {
                Err(_) => Ok(ExecOutput {
                    exit_code: None,
                    stdout: String::new(),
                    stderr: format!("The command was killed after {} s.", limit.as_secs()),
                }),
                Ok(Err(error)) => Err(io(error)),
                Ok(Ok(output)) => Ok(ExecOutput {
                    exit_code: output.status.code(),
                    stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
                    stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
                }),
            }
        })
    }
}
