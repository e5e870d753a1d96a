//! The examples, run as the README runs them: offline (no provider key in their environment),
//! each plays its scripted conversation through the real runtime, and what it prints and stores
//! shows that its tools, hooks and store did their part. `cargo test` builds the examples beside
//! the tests (a `cargo test --test examples` alone does not: build them first).
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use std::path::{Path, PathBuf};
use std::process::Command;

use flue_runtime::record::RecordBody;
use flue_runtime::store::{InstanceKey, SqliteStore, Store};

/// The built example `name`: in the `examples` directory beside this test's own `deps`.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile = exe.parent().and_then(Path::parent).unwrap();
    let path = profile
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    let rebuild = "`cargo test` builds the examples (`cargo test --test examples` alone does not: run `cargo build --examples` first)";
    let built = std::fs::metadata(&path)
        .and_then(|built| built.modified())
        .unwrap_or_else(|_| panic!("{} is not built: {rebuild}", path.display()));
    // A source changed since it was built (its own, or the crates'): it would be tested as it
    // was. Cargo lists the sources it was built from beside it.
    let listed = std::fs::read_to_string(path.with_extension("d")).unwrap_or_default();
    for source in dependencies(&listed) {
        let changed = std::fs::metadata(&source).and_then(|source| source.modified());
        assert!(
            changed.is_ok_and(|changed| changed <= built),
            "{} is older than {source}: {rebuild}",
            path.display()
        );
    }
    path
}

/// The files a cargo dep-info file (`target: source source…`, spaces in names escaped) lists.
fn dependencies(listed: &str) -> Vec<String> {
    let Some((_, sources)) = listed.lines().next().and_then(|line| line.split_once(": ")) else {
        return Vec::new();
    };
    let mut files = vec![String::new()];
    let mut chars = sources.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => files.last_mut().unwrap().extend(chars.next()),
            ' ' => files.push(String::new()),
            c => files.last_mut().unwrap().push(c),
        }
    }
    files.retain(|file| !file.is_empty());
    files
}

/// Runs the example `name` offline in `directory`; its standard output (it must succeed).
fn run_offline(name: &str, directory: &Path) -> String {
    let output = Command::new(example(name))
        .current_dir(directory)
        .env_remove("OPENAI_API_KEY")
        .env_remove("ANTHROPIC_API_KEY")
        .env_remove("OPENROUTER_API_KEY")
        .env_remove("FLUE_LOG")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    );
    assert!(output.status.success(), "{name} failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.starts_with(
            "model: scripted (offline: no OPENAI_API_KEY, ANTHROPIC_API_KEY or OPENROUTER_API_KEY is set)"
        ),
        "{name} says which model runs: {stdout}"
    );
    stdout
}

/// A directory of its own for one test, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(format!("flue-examples-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The last value of the state `name` on the stream of `key`, and how many user messages the
/// stream holds.
async fn stored(database: &Path, key: &InstanceKey, name: &str) -> (Option<serde_json::Value>, usize) {
    let store = SqliteStore::open(database).unwrap();
    let batches = store.read(key, None).await.unwrap();
    let records = batches.iter().flat_map(|batch| batch.records.iter());
    let mut value = None;
    let mut messages = 0;
    for record in records {
        match &record.body {
            RecordBody::StateWrite {
                name: written,
                value: new,
            } if written == name => value = Some(new.clone()),
            RecordBody::UserMessage { .. } => messages += 1,
            _ => {}
        }
    }
    (value, messages)
}

/// The README's first command: the assistant's conversation, its tool's answer, its data
/// writer's and start hook's parts, and its state in `.flue/flue.db`, which a second run
/// continues.
#[tokio::test]
async fn the_assistant_converses_offline_and_a_second_run_continues_its_stored_conversation() {
    let scratch = Scratch::new("assistant");
    let printed = run_offline("assistant", &scratch.0);
    for line in [
        "store: embedded SQLite at .flue/flue.db",
        "assistant: Your order A-1001 shipped yesterday and arrives Thursday.",
        r#"data:      {"progress":{"step":"reading: Where is my order A-1001?"}}"#,
        r#"metadata:  {"channel":"example"}"#,
        "assistant: Happy to help with anything else.",
    ] {
        assert!(
            printed.lines().any(|printed| printed == line),
            "{line:?} in:\n{printed}"
        );
    }
    let database = scratch.0.join(".flue").join("flue.db");
    let customer = InstanceKey::new("assistant", "customer-42");
    // The finish hook counted the one lookup, in the persistent state.
    assert_eq!(
        stored(&database, &customer, "lookups").await,
        (Some(serde_json::json!(1)), 2)
    );
    run_offline("assistant", &scratch.0);
    assert_eq!(
        stored(&database, &customer, "lookups").await,
        (Some(serde_json::json!(2)), 4),
        "the second run continued the first one's conversation and state"
    );
}

#[test]
fn the_delegation_example_runs_its_subagent_through_the_task_tool() {
    let scratch = Scratch::new("delegation");
    let printed = run_offline("delegation", &scratch.0);
    assert!(printed.contains("task started: summarizer\n"), "{printed}");
    assert!(
        printed.contains("task ended:   summarizer (error: false, "),
        "{printed}"
    );
    assert!(
        printed.contains("reply: Summary from the specialist: floor 3's printer jams on duplex jobs since the update."),
        "{printed}"
    );
}

#[test]
fn the_skills_example_activates_its_skill_and_reads_its_supporting_file() {
    let scratch = Scratch::new("skills");
    let printed = run_offline("skills", &scratch.0);
    assert!(
        printed.contains("tool: activate_skill (error: false)\ntool: read_skill_resource (error: false)\n"),
        "{printed}"
    );
}

/// Without an argument the sandbox example works in a directory it made for the run (not one
/// that was there), where its scripted commands really ran.
#[test]
fn the_sandbox_example_runs_its_commands_in_a_fresh_directory() {
    let scratch = Scratch::new("sandbox");
    let printed = run_offline("sandbox", &scratch.0);
    let root = printed
        .lines()
        .find_map(|line| line.strip_prefix("sandbox: "))
        .map(PathBuf::from)
        .unwrap();
    let _made = Scratch(root.clone());
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&root).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "{}", root.display());
    }
    let greeting = std::fs::read_to_string(root.join("out.txt")).unwrap();
    let name = root.file_name().unwrap().to_string_lossy();
    assert_eq!(greeting, format!("hello from {name}\n"));
    assert!(printed.contains("file:  hello.sh"), "{printed}");
}
