//! A local sandbox: the model works on real files in a directory, with the six sandbox tools
//! (`read`, `write`, `edit`, `bash`, `grep`, `glob`).
//!
//! ```sh
//! cargo run --example sandbox            # works in a fresh temporary directory
//! cargo run --example sandbox -- ./work  # or in a directory of yours
//! ```
//!
//! Paths are sandbox paths: `/` is the directory, and the file tools reach nothing outside it.
//! `bash` runs its command as this process's user, in that directory but not confined to it
//! (see `flue_runtime::sandbox::local`): give a model a local sandbox only where it may run
//! what you could.
//! Offline, the scripted model writes a file, runs a command and reads the result.

mod common;

use std::sync::OnceLock;

use flue_runtime::prelude::*;
use flue_runtime::provider::ProviderRegistry;
use flue_runtime::sandbox;
use flue_runtime::store::MemoryStore;
use flue_runtime::testing::ScriptedReply;
use flue_runtime::{Runtime, RuntimeError};
use serde_json::json;

static MODEL: OnceLock<&'static str> = OnceLock::new();
static ROOT: OnceLock<std::path::PathBuf> = OnceLock::new();

#[agent]
fn workbench() -> &'static str {
    use_model(*MODEL.get().unwrap_or(&"scripted/example"));
    use_sandbox(sandbox::local(ROOT.get().cloned().unwrap_or_else(|| "work".into())));
    "You work in a small project directory with the file and shell tools."
}

/// A directory made for this run, that no one else can have made or entered first: a name
/// no one can guess, created (not adopted), readable by this user only. (A shared `/tmp`
/// lets another user make a guessable directory in advance, with a link in it the command's
/// redirect would follow.)
fn fresh_directory() -> std::io::Result<std::path::PathBuf> {
    use std::hash::{BuildHasher, Hasher};
    let mut builder = std::fs::DirBuilder::new();
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    loop {
        let mut random = std::collections::hash_map::RandomState::new().build_hasher();
        random.write_u32(std::process::id());
        let path = std::env::temp_dir().join(format!("flue-sandbox-example-{:016x}", random.finish()));
        match builder.create(&path) {
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => continue,
            created => return created.map(|()| path),
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), RuntimeError> {
    let root = match std::env::args_os().nth(1) {
        Some(argument) if argument.to_string_lossy().starts_with('-') => {
            eprintln!("usage: cargo run --example sandbox [-- DIRECTORY]");
            std::process::exit(2);
        }
        Some(argument) => std::path::PathBuf::from(argument),
        None => fresh_directory().map_err(|error| RuntimeError::Build(format!("a temporary directory: {error}")))?,
    };
    let _ = ROOT.set(root.clone());
    let mut providers = ProviderRegistry::with_defaults();
    let (model, notice) = common::choose_model(
        &mut providers,
        vec![
            ScriptedReply::tool_call(
                "write",
                json!({"path": "hello.sh", "content": "echo \"hello from $(basename \"$PWD\")\"\n"}),
            ),
            ScriptedReply::tool_call("bash", json!({"command": "sh hello.sh > out.txt && wc -c < out.txt"})),
            ScriptedReply::tool_call("read", json!({"path": "out.txt"})),
            ScriptedReply::text("I wrote hello.sh, ran it, and out.txt now holds its greeting."),
        ],
    );
    let _ = MODEL.set(model);
    println!("{notice}\nsandbox: {}", root.display());
    let runtime = Runtime::builder()
        .agent(workbench)
        .providers(providers)
        .store(MemoryStore::new())
        .build()?;
    let reply = runtime
        .init(&workbench, "bench-1")
        .send("Write a script that greets, run it into out.txt, and show me the result.")
        .await?;
    println!("reply: {}", reply.text);
    for entry in std::fs::read_dir(&root)
        .map_err(|error| RuntimeError::Build(error.to_string()))?
        .flatten()
    {
        println!("file:  {}", entry.file_name().to_string_lossy());
    }
    Ok(())
}
