//! The execution environment an agent attaches with `use_sandbox`.
//!
//! A [`SandboxFactory`] is cheap to construct (renders build a fresh one every time); the
//! expensive [`SandboxFactory::create_sandbox_for`] runs once per submission. Factories key
//! durable resources on the instance (its agent and id) so a later submission finds the same
//! workspace, and another agent's instance of the same id does not.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::BoxFuture;
use crate::tool::Tool;

/// Builds the environment for one submission.
pub trait SandboxFactory: Send + Sync + 'static {
    /// Creates (or reconnects to) the environment of `instance_id`.
    fn create_sandbox(&self, instance_id: &str) -> BoxFuture<'static, Result<Arc<dyn Sandbox>, SandboxError>>;

    /// Creates (or reconnects to) the environment of the instance `instance_id` of `agent`:
    /// what the runtime calls. By default the id alone chooses it
    /// ([`create_sandbox`](Self::create_sandbox)); a factory whose environments must not be
    /// shared by two agents' instances of one id (a user id, say) keys them on both.
    fn create_sandbox_for(
        &self,
        agent: &str,
        instance_id: &str,
    ) -> BoxFuture<'static, Result<Arc<dyn Sandbox>, SandboxError>> {
        let _ = agent;
        self.create_sandbox(instance_id)
    }

    /// Replaces the framework's default model-facing tool set when it returns `Some`.
    fn tools(&self) -> Option<Vec<Tool>> {
        None
    }
}

/// A filesystem and command-execution surface. Paths are relative to the sandbox root (or
/// absolute inside it); paths outside the root are refused with [`SandboxError::OutsideRoot`].
pub trait Sandbox: Send + Sync + 'static {
    /// Reads a whole file.
    fn read_file(&self, path: &str) -> BoxFuture<'_, Result<Vec<u8>, SandboxError>>;
    /// Reads a file a piece at a time: `visit` gets its bytes in order, and returns `false`
    /// to stop the read there (the tools read no more of a file than they can show). The
    /// default reads the whole file with [`Sandbox::read_file`] and gives it as one piece; an
    /// environment that can read a file incrementally should, so a huge file is not held in
    /// memory.
    fn read_file_with<'a>(
        &'a self,
        path: &str,
        visit: &'a mut (dyn FnMut(&[u8]) -> bool + Send),
    ) -> BoxFuture<'a, Result<(), SandboxError>> {
        let whole = self.read_file(path);
        Box::pin(async move {
            visit(&whole.await?);
            Ok(())
        })
    }
    /// The path under which the environment knows the file at `path` (an absolute, normal
    /// sandbox path): two paths naming one file (through links) give the same one. The
    /// tools serialize writes and edits of one file by it. The default is `path` itself.
    fn real_path(&self, path: &str) -> BoxFuture<'_, Result<String, SandboxError>> {
        Box::pin(std::future::ready(Ok(path.to_owned())))
    }
    /// What names the files this environment acts on, the same for the environments of other
    /// submissions (or instances) acting on the same files: the tools serialize writes and
    /// edits of one file across all of them by it (a local directory: its real path). `None`
    /// (the default): only within one submission.
    fn files_identity(&self) -> Option<String> {
        None
    }
    /// Creates or replaces a file (creating parent directories).
    fn write_file(&self, path: &str, contents: Vec<u8>) -> BoxFuture<'_, Result<(), SandboxError>>;
    /// Removes a file or an empty directory.
    fn remove(&self, path: &str) -> BoxFuture<'_, Result<(), SandboxError>>;
    /// Lists a directory.
    fn list_dir(&self, path: &str) -> BoxFuture<'_, Result<Vec<DirEntry>, SandboxError>>;
    /// Runs a shell command.
    fn exec(&self, request: ExecRequest) -> BoxFuture<'_, Result<ExecOutput, SandboxError>>;
}

/// One directory entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntry {
    /// Entry name.
    pub name: String,
    /// Whether it is a directory.
    pub is_dir: bool,
    /// Size in bytes (0 for directories).
    pub size: u64,
}

/// A command to run in a sandbox.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecRequest {
    /// The shell command line.
    pub command: String,
    /// Working directory inside the sandbox (default: the agent's cwd).
    pub cwd: Option<String>,
    /// Time limit.
    pub timeout: Option<Duration>,
}

/// What a command produced.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ExecOutput {
    /// Exit code (`None` when killed).
    pub exit_code: Option<i32>,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

/// A sandbox operation that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SandboxError {
    /// The path resolves outside the sandbox root.
    #[error("path \"{0}\" is outside the sandbox root")]
    OutsideRoot(String),
    /// Nothing at the path.
    #[error("no such file or directory: {0}")]
    NotFound(String),
    /// The environment does not support the operation.
    #[error("the sandbox does not support {0}")]
    Unsupported(&'static str),
    /// Any other failure.
    #[error("{0}")]
    Io(String),
}

/// Options of `use_sandbox_with`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SandboxOptions {
    /// The agent's working directory inside the environment (non-empty).
    pub cwd: Option<String>,
}

impl SandboxOptions {
    /// Options with a working directory.
    pub fn cwd(cwd: impl Into<String>) -> Self {
        Self { cwd: Some(cwd.into()) }
    }
}

impl fmt::Debug for dyn SandboxFactory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SandboxFactory")
    }
}
