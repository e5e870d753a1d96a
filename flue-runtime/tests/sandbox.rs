//! Sandboxes through the runtime: the in-memory and local environments, the six tools with
//! their limits, cwd scoping, refused escapes, per-file serialization, presence flips narrated
//! as `environment` signals, and delegates sharing the environment (issue 8, item 3).
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use flue_runtime::prelude::*;
use flue_runtime::provider::ModelMessage;
use flue_runtime::sandbox;
use flue_runtime::testing::{ScriptedModel, ScriptedReply};
use serde_json::json;

mod harness;
mod scratch;
use harness::{last_batch_results, runtime_with};

// ---- the in-memory environment ------------------------------------------------------------------

#[agent]
fn in_memory() -> &'static str {
    use_model("scripted/x");
    // A fresh factory each render: the instance's files are found again.
    use_sandbox(sandbox::virtual_sandbox());
    "Work with files."
}

#[agent]
fn in_memory_neighbour() -> &'static str {
    use_model("scripted/x");
    use_sandbox(sandbox::virtual_sandbox());
    "Work with files too."
}

/// Reads, its own way.
#[tool(name = "read")]
async fn own_read(
    /// What to read
    path: String,
) -> String {
    path
}

#[agent]
fn shadowing() -> &'static str {
    use_model("scripted/x");
    use_tool(own_read);
    use_sandbox(sandbox::virtual_sandbox());
    "Read files."
}

/// Reference `ToolNameConflictError`: the agent's tools and its sandbox's are one set of names,
/// and a name in both fails the submission as a duplicate, before any model call.
#[tokio::test]
async fn an_agent_tool_named_like_a_sandbox_tool_fails_as_a_duplicate_tool_name() {
    let model = ScriptedModel::new([ScriptedReply::text("unused")]);
    let runtime = runtime_with(&model, [shadowing.into()]);
    let error = runtime.init(&shadowing, "s").send("read it").await.unwrap_err();
    let flue_runtime::RuntimeError::Run {
        error_type, message, ..
    } = error
    else {
        panic!("a run error: {error}")
    };
    assert_eq!(
        (error_type.as_str(), message.as_str()),
        ("tool_name_conflict", "Duplicate tool name \"read\".")
    );
    assert!(model.requests().is_empty());
}

#[tokio::test]
async fn two_agents_instances_of_one_id_do_not_share_an_in_memory_sandbox() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("write", json!({"path": "secret.txt", "content": "for ops only"})),
        ScriptedReply::text("written"),
        ScriptedReply::tool_call("read", json!({"path": "secret.txt"})),
        ScriptedReply::text("looked"),
        ScriptedReply::tool_call("read", json!({"path": "secret.txt"})),
        ScriptedReply::text("read back"),
    ]);
    let runtime = runtime_with(&model, [in_memory.into(), in_memory_neighbour.into()]);
    runtime.init(&in_memory, "user-42").send("write it").await.unwrap();
    runtime
        .init(&in_memory_neighbour, "user-42")
        .send("read it")
        .await
        .unwrap();
    let (content, is_error) = last_batch_results(&model.requests()[3]).remove(0);
    assert!(is_error && !content.contains("for ops only"), "{content}");
    // The writer's own instance still has it.
    runtime.init(&in_memory, "user-42").send("read it").await.unwrap();
    let (content, is_error) = last_batch_results(&model.requests()[5]).remove(0);
    assert!(!is_error && content.contains("for ops only"), "{content}");
}

#[tokio::test]
async fn the_six_tools_work_in_the_in_memory_sandbox_and_keep_within_it() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([
            (
                "write",
                json!({"path": "notes/todo.md", "content": "- buy milk\n- call Ada\n"}),
            ),
            ("write", json!({"path": "notes/done.md", "content": "- nothing\n"})),
        ]),
        ScriptedReply::tool_calls([
            (
                "edit",
                json!({"path": "notes/todo.md", "old_string": "milk", "new_string": "bread"}),
            ),
            ("read", json!({"path": "/notes/todo.md"})),
        ]),
        ScriptedReply::tool_calls([
            ("read", json!({"path": "notes/todo.md"})),
            ("grep", json!({"pattern": "ada", "ignore_case": true})),
            ("glob", json!({"pattern": "**/*.md"})),
            ("bash", json!({"command": "ls"})),
            ("read", json!({"path": "../../etc/passwd"})),
            (
                "edit",
                json!({"path": "notes/todo.md", "old_string": "-", "new_string": "*"}),
            ),
        ]),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [in_memory.into()]);
    runtime.init(&in_memory, "m").send("go").await.unwrap();
    let requests = model.requests();
    let tools: Vec<&str> = requests[0].tools.iter().map(|tool| &*tool.name).collect();
    assert_eq!(tools, ["read", "write", "edit", "bash", "grep", "glob", "task"]);
    assert_eq!(
        last_batch_results(&requests[1]),
        [
            ("Wrote 22 bytes to /notes/todo.md.".to_owned(), false),
            ("Wrote 10 bytes to /notes/done.md.".to_owned(), false),
        ]
    );
    let third = last_batch_results(&requests[3]);
    assert_eq!(third[0], ("- buy bread\n- call Ada".to_owned(), false));
    assert_eq!(third[1], ("/notes/todo.md:2: - call Ada".to_owned(), false));
    assert_eq!(third[2], ("notes/done.md\nnotes/todo.md".to_owned(), false));
    assert!(
        third[3].1 && third[3].0.contains("does not support commands"),
        "{:?}",
        third[3]
    );
    assert_eq!(
        third[4],
        ("path \"../../etc/passwd\" is outside the sandbox root".to_owned(), true)
    );
    assert_eq!(
        third[5],
        (
            "old_string occurs 2 times in /notes/todo.md; include more context to make it unique, or set replace_all."
                .to_owned(),
            true
        )
    );
}

#[tokio::test]
async fn an_edit_is_refused_for_a_file_past_16_mb_or_one_it_would_grow_past_it() {
    let two_mb = "a".repeat(2 * 1024 * 1024);
    let seventeen_mb = "z".repeat(17 * 1024 * 1024);
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([
            ("write", json!({"path": "small.txt", "content": two_mb})),
            ("write", json!({"path": "huge.txt", "content": seventeen_mb})),
        ]),
        ScriptedReply::tool_calls([
            // Ten times two MB is past the bound.
            (
                "edit",
                json!({"path": "small.txt", "old_string": "a", "new_string": "aaaaaaaaaa", "replace_all": true}),
            ),
            (
                "edit",
                json!({"path": "huge.txt", "old_string": "z", "new_string": "y", "replace_all": true}),
            ),
        ]),
        // The same size is fine.
        ScriptedReply::tool_call(
            "edit",
            json!({"path": "small.txt", "old_string": "a", "new_string": "b", "replace_all": true}),
        ),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [in_memory.into()]);
    runtime.init(&in_memory, "big-edits").send("go").await.unwrap();
    let requests = model.requests();
    assert_eq!(
        last_batch_results(&requests[2]),
        [
            (
                "The edit would make /small.txt larger than 16 MB; it was not made.".to_owned(),
                true
            ),
            (
                "/huge.txt is larger than 16 MB; edit can only change smaller files (use bash for this one)."
                    .to_owned(),
                true
            ),
        ]
    );
    assert_eq!(
        last_batch_results(&requests[3]),
        [("Edited /small.txt (2097152 replacements).".to_owned(), false)]
    );
}

#[tokio::test]
async fn edits_of_one_file_in_one_batch_run_one_at_a_time_and_lose_nothing() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("write", json!({"path": "f.txt", "content": "alpha beta gamma"})),
        ScriptedReply::tool_calls([
            (
                "edit",
                json!({"path": "f.txt", "old_string": "alpha", "new_string": "ALPHA"}),
            ),
            (
                "edit",
                json!({"path": "f.txt", "old_string": "beta", "new_string": "BETA"}),
            ),
            (
                "edit",
                json!({"path": "f.txt", "old_string": "gamma", "new_string": "GAMMA"}),
            ),
        ]),
        ScriptedReply::tool_call("read", json!({"path": "f.txt"})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [in_memory.into()]);
    runtime.init(&in_memory, "locks").send("go").await.unwrap();
    assert_eq!(
        last_batch_results(&model.requests()[3]),
        [("ALPHA BETA GAMMA".to_owned(), false)]
    );
}

// ---- the local environment ----------------------------------------------------------------------

static LOCAL_ROOT: std::sync::LazyLock<std::path::PathBuf> = std::sync::LazyLock::new(|| {
    let root = scratch::dir("local");
    std::fs::create_dir_all(root.join("work")).unwrap();
    std::os::unix::fs::symlink("/etc", root.join("work/escape")).unwrap();
    root
});

#[agent]
fn on_disk() -> &'static str {
    use_model("scripted/x");
    use_sandbox_with(sandbox::local(LOCAL_ROOT.clone()), SandboxOptions::cwd("/work"));
    "Work on disk."
}

#[tokio::test]
async fn the_local_sandbox_runs_commands_in_its_cwd_and_refuses_links_out_of_the_root() {
    assert_eq!(
        std::env::var("FLUE_TEST_SANDBOX_SECRET").as_deref(),
        Ok("sk-do-not-leak"),
        "set for the tests by .cargo/config.toml"
    );
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([
            (
                "bash",
                json!({"command": "pwd && echo hello > greeting.txt && echo warn >&2"}),
            ),
            ("bash", json!({"command": "exit 3"})),
            ("bash", json!({"command": "echo \"key=[$FLUE_TEST_SANDBOX_SECRET]\""})),
            (
                "bash",
                json!({"command": "cat /proc/$PPID/environ >/dev/null 2>&1 && echo readable || echo refused"}),
            ),
        ]),
        ScriptedReply::tool_calls([
            ("read", json!({"path": "greeting.txt"})),
            ("read", json!({"path": "escape/hostname"})),
            ("write", json!({"path": "/../outside.txt", "content": "x"})),
            ("glob", json!({"pattern": "*.txt"})),
        ]),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [on_disk.into()]);
    runtime.init(&on_disk, "d").send("go").await.unwrap();
    let requests = model.requests();
    let first = last_batch_results(&requests[1]);
    let real_work = std::fs::canonicalize(LOCAL_ROOT.join("work")).unwrap();
    assert_eq!(first[0], (format!("{}\nwarn", real_work.display()), false));
    assert_eq!(
        first[1],
        ("(no output)\n\nThe command exited with code 3.".to_owned(), false)
    );
    assert_eq!(
        first[2],
        ("key=[]".to_owned(), false),
        "the process's secrets stay out of commands"
    );
    // Nor can a command read the process's launch environment from /proc (as root it could
    // read anything: this holds for an unprivileged user only).
    // SAFETY: geteuid has no preconditions.
    if cfg!(target_os = "linux") && unsafe { libc::geteuid() } != 0 {
        assert_eq!(
            first[3],
            ("refused".to_owned(), false),
            "/proc/$PPID/environ was readable"
        );
    }
    let second = last_batch_results(&requests[2]);
    assert_eq!(second[0], ("hello".to_owned(), false));
    assert_eq!(
        second[1],
        (
            "path \"/work/escape/hostname\" is outside the sandbox root".to_owned(),
            true
        )
    );
    assert_eq!(
        second[2],
        ("path \"/../outside.txt\" is outside the sandbox root".to_owned(), true)
    );
    assert_eq!(second[3], ("greeting.txt".to_owned(), false));
    assert!(!LOCAL_ROOT.parent().unwrap().join("outside.txt").exists());
}

// ---- presence flips and delegates ---------------------------------------------------------------

fn helper(_: AgentProps<'_>) -> &'static str {
    "You check files."
}

#[agent]
fn attaches_later() -> &'static str {
    use_model("scripted/x");
    let (attached, set_attached) = use_persistent_state("attached", false);
    use_tool(Tool::new("attach").description("Attaches the workspace.").run(
        move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
            let set_attached = set_attached.clone();
            async move {
                set_attached
                    .set(true)
                    .map_err(|error| ToolError::new(error.to_string()))?;
                Ok::<_, ToolError>("attached")
            }
        },
    ));
    if attached {
        use_sandbox(sandbox::virtual_sandbox());
        use_subagent(Subagent::new(
            "checker",
            "Checks files.",
            FnAgent::new(AgentDefinition::new("checker"), helper),
        ));
    }
    "Work."
}

#[tokio::test]
async fn attaching_mid_response_narrates_the_environment_and_delegates_share_it() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("attach", json!({})),
        ScriptedReply::tool_call("write", json!({"path": "a.txt", "content": "from the parent"})),
        ScriptedReply::tool_call("task", json!({"agent": "checker", "prompt": "Read a.txt."})),
        // The child reads the parent's file through the shared sandbox.
        ScriptedReply::tool_call("read", json!({"path": "a.txt"})),
        ScriptedReply::text("It says: from the parent"),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [attaches_later.into()]);
    runtime.init(&attaches_later, "f").send("go").await.unwrap();
    let requests = model.requests();
    let tools: Vec<&str> = requests[0].tools.iter().map(|tool| &*tool.name).collect();
    assert_eq!(tools, ["attach", "task"]);
    let environment: Vec<&str> = requests[1]
        .messages
        .iter()
        .filter_map(|message| match message {
            ModelMessage::User { content, .. } if content.starts_with("<signal type=\"environment\"") => {
                Some(content.as_str())
            }
            _ => None,
        })
        .collect();
    assert_eq!(environment.len(), 1, "{:?}", requests[1].messages);
    assert!(
        environment[0].contains("The working directory is now `/`.")
            && environment[0].contains("All available tools: attach, read, write, edit, bash, grep, glob, task")
            && environment[0].contains("- **checker** — Checks files."),
        "{}",
        environment[0]
    );
    // No separate `resources` signal for what flipped with the environment.
    assert!(
        !requests[1].messages.iter().any(
            |message| matches!(message, ModelMessage::User { content, .. } if content.contains("type=\"resources\""))
        ),
        "{:?}",
        requests[1].messages
    );
    let child = &requests[3];
    assert!(child.tools.iter().any(|tool| tool.name == "read"));
    assert_eq!(
        last_batch_results(&requests[4]),
        [("from the parent".to_owned(), false)]
    );
}

#[tokio::test]
async fn an_instances_in_memory_files_outlive_its_submission() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("write", json!({"path": "memo.txt", "content": "remember me"})),
        ScriptedReply::text("saved"),
        ScriptedReply::tool_call("read", json!({"path": "memo.txt"})),
        ScriptedReply::text("read it"),
    ]);
    let runtime = runtime_with(&model, [in_memory.into()]);
    let handle = runtime.init(&in_memory, "lasting");
    handle.send("save a memo").await.unwrap();
    handle.send("read the memo").await.unwrap();
    assert_eq!(
        last_batch_results(&model.requests()[3]),
        [("remember me".to_owned(), false)]
    );
}

// ---- escapes and limits --------------------------------------------------------------------

static DANGLING_ROOT: std::sync::LazyLock<(std::path::PathBuf, std::path::PathBuf)> = std::sync::LazyLock::new(|| {
    let base = scratch::dir("dangling");
    let root = base.join("root");
    std::fs::create_dir_all(&root).unwrap();
    let outside = base.join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    // A link to a file that does not exist yet, outside the root.
    std::os::unix::fs::symlink(outside.join("planted.txt"), root.join("link.txt")).unwrap();
    (root, outside)
});

#[agent]
fn dangling() -> &'static str {
    use_model("scripted/x");
    use_sandbox(sandbox::local(DANGLING_ROOT.0.clone()));
    "Work on disk."
}

#[tokio::test]
async fn a_dangling_link_out_of_the_root_cannot_be_written_through() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([
            ("write", json!({"path": "link.txt", "content": "planted"})),
            (
                "edit",
                json!({"path": "link.txt", "old_string": "a", "new_string": "b"}),
            ),
        ]),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [dangling.into()]);
    runtime.init(&dangling, "dl").send("go").await.unwrap();
    let results = last_batch_results(&model.requests()[1]);
    assert!(!DANGLING_ROOT.1.join("planted.txt").exists(), "the write left the root");
    assert_eq!(
        results[0],
        ("path \"/link.txt\" is outside the sandbox root".to_owned(), true)
    );
}

static TIMEOUT_ROOT: std::sync::LazyLock<std::path::PathBuf> = std::sync::LazyLock::new(|| scratch::dir("timeout"));

#[agent]
fn timed() -> &'static str {
    use_model("scripted/x");
    use_sandbox(sandbox::local(TIMEOUT_ROOT.clone()));
    "Work on disk."
}

#[tokio::test]
async fn a_timed_out_command_leaves_no_process_behind() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call(
            "bash",
            json!({"command": "(sleep 2; touch leaked.txt); echo never", "timeout_seconds": 1}),
        ),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [timed.into()]);
    runtime.init(&timed, "t").send("go").await.unwrap();
    let results = last_batch_results(&model.requests()[1]);
    assert!(results[0].1 && results[0].0.contains("killed after 1 s"), "{results:?}");
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    assert!(
        !TIMEOUT_ROOT.join("leaked.txt").exists(),
        "the command's children outlived its timeout"
    );
}

/// A process that moved to a process group of its own (GNU `timeout` does) is killed with
/// the command at its timeout, and so are its children, also when the command would start
/// another such process as soon as one is killed.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_timed_out_command_leaves_no_process_behind_in_another_group() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call(
            "bash",
            json!({
                "command": "for i in 1 2 3 4; do timeout 30 sh -c 'sleep 2; touch regrouped.txt'; done; echo never",
                "timeout_seconds": 1
            }),
        ),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [timed.into()]);
    runtime.init(&timed, "regrouped").send("go").await.unwrap();
    let results = last_batch_results(&model.requests()[1]);
    assert!(results[0].1 && results[0].0.contains("killed after 1 s"), "{results:?}");
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    assert!(
        !TIMEOUT_ROOT.join("regrouped.txt").exists(),
        "a process in a group of its own outlived the command's timeout"
    );
}

/// A group whose leader exited unreaped (a zombie) may still have members: it is killed too.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_timed_out_commands_group_behind_a_zombie_is_killed_too() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call(
            "bash",
            json!({
                "command": "(setsid sh -c 'touch zombie_member_started.txt; (sleep 2; touch behind_zombie.txt) & exit 0' & exec sleep 60)",
                "timeout_seconds": 1
            }),
        ),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [timed.into()]);
    runtime.init(&timed, "zombie").send("go").await.unwrap();
    // The command ran, its group's member started, and the timeout killed it.
    let results = last_batch_results(&model.requests()[1]);
    assert!(results[0].1 && results[0].0.contains("killed after 1 s"), "{results:?}");
    assert!(
        TIMEOUT_ROOT.join("zombie_member_started.txt").exists(),
        "the group's member never started (no setsid?): the test proves nothing"
    );
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    assert!(
        !TIMEOUT_ROOT.join("behind_zombie.txt").exists(),
        "a member of a zombie's group outlived the command's timeout"
    );
}

#[tokio::test]
async fn a_timed_out_command_still_shows_the_output_it_printed() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call(
            "bash",
            json!({"command": "echo started; echo warned >&2; sleep 5", "timeout_seconds": 1}),
        ),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [timed.into()]);
    // The result says the command was killed at its timeout (not that it ran its `sleep`).
    runtime.init(&timed, "partial").send("go").await.unwrap();
    let results = last_batch_results(&model.requests()[1]);
    let (text, is_error) = &results[0];
    assert!(*is_error, "{text}");
    assert!(text.starts_with("started\nwarned\n"), "{text}");
    assert!(text.contains("killed after 1 s"), "{text}");
}

#[tokio::test]
async fn a_command_leaving_a_background_process_finishes_when_its_shell_exits() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call(
            "bash",
            // The background `sleep` inherits the output pipes and holds them open; its pid is
            // printed so the test can end it.
            json!({"command": "sleep 30 & echo $!", "timeout_seconds": 5}),
        ),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [timed.into()]);
    runtime.init(&timed, "background").send("go").await.unwrap();
    // Waiting for the pipes to close would have hit the 5 s timeout (an error result).
    let results = last_batch_results(&model.requests()[1]);
    let (pid, is_error) = &results[0];
    assert!(!is_error, "{pid}");
    let pid: u32 = pid.trim().parse().expect("the background pid");
    let _ = std::process::Command::new("kill").arg(pid.to_string()).status();
}

#[tokio::test]
async fn a_first_line_longer_than_the_byte_cap_is_still_readable() {
    let long = "y".repeat(60 * 1024);
    let model = ScriptedModel::new([
        ScriptedReply::tool_call(
            "write",
            json!({"path": "wide.txt", "content": format!("{long}\nsecond\n")}),
        ),
        ScriptedReply::tool_call("read", json!({"path": "wide.txt"})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [in_memory.into()]);
    runtime.init(&in_memory, "wide").send("go").await.unwrap();
    let (text, is_error) = last_batch_results(&model.requests()[2]).remove(0);
    assert!(!is_error);
    assert!(text.starts_with("yyyy"), "{}", &text[..text.len().min(200)]);
    assert!(
        !text.contains("Continue with offset 1."),
        "a marker that points back at itself"
    );
    assert!(
        text.contains("Continue with offset 2."),
        "{}",
        &text[text.len().saturating_sub(200)..]
    );
}

/// The process's peak resident memory, in KiB.
fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|line| line.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[tokio::test]
async fn a_command_flooding_its_output_does_not_grow_the_runtime_without_bound() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call(
            "bash",
            json!({"command": "head -c 300000000 /dev/zero | tr '\\0' y; echo; echo tail-line"}),
        ),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [timed.into()]);
    let before = peak_rss_kib();
    runtime.init(&timed, "flood").send("go").await.unwrap();
    let grown = peak_rss_kib().saturating_sub(before);
    let results = last_batch_results(&model.requests()[1]);
    assert!(
        results[0].0.ends_with("tail-line"),
        "{}",
        &results[0].0[..200.min(results[0].0.len())]
    );
    assert!(grown < 100 * 1024, "300 MB of output grew the peak by {grown} KiB");
}

static HUGE_ROOT: std::sync::LazyLock<std::path::PathBuf> = std::sync::LazyLock::new(|| {
    let root = scratch::dir("huge");
    // A gigabyte of NUL bytes (valid text, one line), taking no disk space.
    let file = std::fs::File::create(root.join("huge.txt")).unwrap();
    file.set_len(1 << 30).unwrap();
    root
});

#[agent]
fn huge() -> &'static str {
    use_model("scripted/x");
    use_sandbox(sandbox::local(HUGE_ROOT.clone()));
    "Work on disk."
}

#[tokio::test]
async fn a_huge_file_is_read_and_searched_only_as_far_as_the_tools_show() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("read", json!({"path": "huge.txt"})),
        ScriptedReply::tool_call("grep", json!({"pattern": "needle", "path": "huge.txt"})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [huge.into()]);
    let before = peak_rss_kib();
    runtime.init(&huge, "huge").send("go").await.unwrap();
    let grown = peak_rss_kib().saturating_sub(before);
    let requests = model.requests();
    let (read, is_error) = last_batch_results(&requests[1]).remove(0);
    assert!(!is_error, "{}", &read[..read.len().min(200)]);
    assert!(read.starts_with('\0'));
    assert!(
        read.contains("\n\n[Line 1 is more than ") && read.ends_with(" bytes; only its first 51200 are shown.]"),
        "{}",
        &read[read.len().saturating_sub(200)..]
    );
    assert_eq!(last_batch_results(&requests[2]), [("No matches.".to_owned(), false)]);
    assert!(grown < 100 * 1024, "a 1 GB file grew the peak by {grown} KiB");
}

/// The virtual sandbox, with a tool set of its own that names one tool twice.
struct TwiceNamedTools;

impl flue_core::sandbox::SandboxFactory for TwiceNamedTools {
    fn create_sandbox(
        &self,
        instance_id: &str,
    ) -> flue_runtime::BoxFuture<
        'static,
        Result<std::sync::Arc<dyn flue_core::sandbox::Sandbox>, flue_core::sandbox::SandboxError>,
    > {
        flue_core::sandbox::SandboxFactory::create_sandbox(&sandbox::virtual_sandbox(), instance_id)
    }

    fn tools(&self) -> Option<Vec<Tool>> {
        let lookup = || {
            Tool::new("lookup")
                .description("Look it up.")
                .run(|_ctx, _: serde_json::Map<String, serde_json::Value>| async { Ok::<_, ToolError>("found") })
        };
        Some(vec![lookup(), lookup()])
    }
}

#[agent]
fn twice_named() -> &'static str {
    use_model("scripted/x");
    use_sandbox(TwiceNamedTools);
    "Work."
}

/// A sandbox factory's own tools go to the provider with the render's: two sharing a name
/// would have every call refused. The submission fails with `tool_name_conflict` first.
#[tokio::test]
async fn a_sandbox_factorys_tools_sharing_a_name_fail_the_submission_before_any_call() {
    let model = ScriptedModel::new([ScriptedReply::text("never")]);
    let runtime = runtime_with(&model, [twice_named.into()]);
    let error = runtime.init(&twice_named, "t").send("go").await.unwrap_err();
    let flue_runtime::RuntimeError::Run {
        error_type, message, ..
    } = error
    else {
        panic!("a run error: {error}")
    };
    assert_eq!(error_type, "tool_name_conflict");
    assert!(message.contains("lookup"), "{message}");
    assert!(model.requests().is_empty());
}

/// In the virtual sandbox a path is a file or a directory, never both: a write under a file
/// is refused (it would be invisible to `glob`, `grep` and listings), as is a file over a
/// directory.
#[tokio::test]
async fn the_virtual_sandbox_refuses_a_file_under_a_file_and_a_file_over_a_directory() {
    let sandbox = flue_core::sandbox::SandboxFactory::create_sandbox(&sandbox::virtual_sandbox(), "v")
        .await
        .unwrap();
    sandbox.write_file("/a", b"file a".to_vec()).await.unwrap();
    let error = sandbox.write_file("/a/b", b"file b".to_vec()).await.unwrap_err();
    assert!(error.to_string().contains("/a is a file"), "{error}");
    sandbox.write_file("/d/e/f", b"deep".to_vec()).await.unwrap();
    let error = sandbox.write_file("/d/e/f/g", b"deeper".to_vec()).await.unwrap_err();
    assert!(error.to_string().contains("/d/e/f is a file"), "{error}");
    let error = sandbox.write_file("/d", b"over".to_vec()).await.unwrap_err();
    assert!(error.to_string().contains("/d is a directory"), "{error}");
    // Siblings that share a prefix are neither.
    sandbox.write_file("/ab", b"beside".to_vec()).await.unwrap();
    sandbox.write_file("/d/e2", b"beside".to_vec()).await.unwrap();
    assert_eq!(sandbox.read_file("/a").await.unwrap(), b"file a");
}

/// A descriptor the runtime's process holds without close-on-exec (inherited from what
/// launched it) does not reach the commands the model runs.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_command_inherits_no_descriptor_of_the_runtimes_process_past_stdio() {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open("/proc/self/status").unwrap();
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is open (held by `file` until the end); clearing its flags is all it does.
    assert_eq!(unsafe { libc::fcntl(fd, libc::F_SETFD, 0) }, 0);
    let model = ScriptedModel::new([
        ScriptedReply::tool_call(
            "bash",
            json!({"command": format!("[ -e /proc/$$/fd/{fd} ] && echo inherited || echo closed")}),
        ),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [on_disk.into()]);
    runtime.init(&on_disk, "fds").send("go").await.unwrap();
    assert_eq!(last_batch_results(&model.requests()[1]), [("closed".to_owned(), false)]);
    drop(file);
}
