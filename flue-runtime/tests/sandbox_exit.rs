//! `kill_running_commands`: what a process about to exit calls so its sandbox commands do not
//! outlive it. In a test binary of its own: it kills every command of the process, and the
//! other sandbox tests run theirs in parallel.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use std::time::{Duration, Instant};

use flue_core::sandbox::{ExecRequest, SandboxFactory};
use flue_runtime::sandbox::{LocalSandboxFactory, kill_running_commands};

mod scratch;

#[tokio::test]
async fn a_running_command_and_what_it_started_are_killed_before_the_process_exits() {
    let root = scratch::dir("sandbox-exit");
    let sandbox = LocalSandboxFactory::new(&root).create_sandbox("exit").await.unwrap();
    // A command that starts a child of its own, in a group of its own, that would outlive it.
    let call = tokio::spawn({
        let sandbox = sandbox.clone();
        async move {
            sandbox
                .exec(ExecRequest {
                    command: "setsid sh -c 'echo $$ > inner.pid; sleep 2; touch outlived.txt' & echo started > started.txt; sleep 30".into(),
                    cwd: Some("/".into()),
                    timeout: Some(Duration::from_secs(60)),
                })
                .await
        }
    });
    let started = Instant::now();
    // Both started, and the child's pid is known (written before it sleeps).
    let inner = loop {
        let pid = std::fs::read_to_string(root.join("inner.pid")).ok();
        if root.join("started.txt").exists()
            && let Some(pid) = pid.as_deref().and_then(|pid| pid.trim().parse::<u32>().ok())
        {
            break pid;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "the command never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        alive(inner),
        "the child runs before the kill (so its end below is the kill's doing)"
    );
    kill_running_commands();
    let ended = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("the command ended at once, not after its 30 s")
        .unwrap()
        .unwrap();
    assert_eq!(ended.exit_code, None);
    assert!(ended.stderr.contains("SIGKILL"), "{ended:?}");
    // The child is gone (or a zombie no one has reaped yet), so it never writes its file: a
    // bound on the wait, not a timing the assertion depends on.
    let killed = Instant::now();
    while alive(inner) {
        assert!(
            killed.elapsed() < Duration::from_secs(10),
            "the command's own child (pid {inner}) outlived it"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !root.join("outlived.txt").exists(),
        "the command's own child outlived it"
    );
}

/// Whether process `pid` still runs (a zombie has ended).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name in parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}
