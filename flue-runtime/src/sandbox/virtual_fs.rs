//! The in-memory environment: a filesystem per instance (per agent and id: two agents'
//! instances of one id do not share files), kept for the process's lifetime (so a later
//! submission of the instance finds its files), without command execution. Not
//! durable: a restart starts every instance's workspace empty (use `sandbox::local` for files
//! that last).

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
        Box::pin(async move { Ok(sandbox as Arc<dyn Sandbox>) })
    }
}

/// One instance's in-memory filesystem: files by normalized absolute path (directories are
/// implied by the files under them, plus those made explicit by writes).
#[derive(Default)]
pub struct VirtualSandbox {
    files: Mutex<BTreeMap<String, Vec<u8>>>,
}

impl VirtualSandbox {
    fn files(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<u8>>> {
        self.files.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Sandbox for VirtualSandbox {
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
            files.insert(path, contents);
            Ok(())
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
