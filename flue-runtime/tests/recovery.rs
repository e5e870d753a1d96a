//! Crash recovery: the runtime runs in a child process (this test binary, re-invoked), is
//! SIGKILLed at a chosen point, and a fresh process on the same database recovers.
//!
//! Kill points are reached deterministically: the child's store pauses before the chosen
//! durability point, prints `READY`, and the parent kills it there.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

mod harness;
mod scratch;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use flue_core::BoxFuture;
use flue_runtime::prelude::*;
use flue_runtime::provider::{ModelProvider, ModelRequest, ModelStream, ProviderRegistry, StreamEvent};
use flue_runtime::record::{Outcome, Record, RecordBody, SettlementError};
use flue_runtime::store::{AttemptRef, InstanceKey, SqliteStore, Store, StoreError};
use flue_runtime::testing::{ScriptedModel, ScriptedReply};
use flue_runtime::{Runtime, RuntimeError, RuntimeOptions};
use serde_json::json;

const CHILD: &str = "FLUE_RECOVERY_CHILD";

// ---- the child process ------------------------------------------------------------------------

/// Where the child pauses (and is killed).
#[derive(Clone, Copy, PartialEq, Debug)]
enum Point {
    ModelStream,
    /// During a model stream, once the text streamed so far is in the stream.
    ModelStreamStreamed,
    ToolBatchCommit,
    /// The commit of the batch answering a `task` call (its child has answered).
    TaskCommit,
    StartSeam,
    Settlement,
    Never,
}

impl Point {
    fn parse(text: &str) -> Self {
        match text {
            "model_stream" => Self::ModelStream,
            "model_stream_streamed" => Self::ModelStreamStreamed,
            "tool_batch_commit" => Self::ToolBatchCommit,
            "task_commit" => Self::TaskCommit,
            "start_seam" => Self::StartSeam,
            "settlement" => Self::Settlement,
            _ => Self::Never,
        }
    }
}

fn pause_forever() -> ! {
    // On its own line: libtest may have printed "test … " without a newline.
    println!("\nREADY");
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// The backend under test (SQLite file, or a Postgres schema), pausing before the chosen
/// durability point.
struct PausingStore {
    inner: Box<dyn Store>,
    point: Point,
    dir: PathBuf,
}

impl PausingStore {
    /// Pauses for good (printing `READY`) while serving the parent's abort requests: a SQLite
    /// file belongs to one process, so the paused process itself requests the abort on its store
    /// (durably, and unseen by the stuck attempt), as its runtime would for an abort call the
    /// crash overtakes. See [`request_abort`].
    fn pause(&self) -> ! {
        println!("\nREADY");
        loop {
            if let Ok(agent) = std::fs::read_to_string(self.dir.join("abort_request")) {
                std::fs::remove_file(self.dir.join("abort_request")).unwrap();
                let key = InstanceKey::new(agent.trim(), "customer");
                // Off this thread, which a runtime is blocked on.
                let aborted = std::thread::scope(|scope| {
                    scope
                        .spawn(|| {
                            tokio::runtime::Builder::new_current_thread()
                                .enable_all()
                                .build()
                                .unwrap()
                                .block_on(self.inner.request_abort(&key))
                                .unwrap()
                                .len()
                        })
                        .join()
                        .unwrap()
                });
                let done = self.dir.join("abort_done");
                std::fs::write(done.with_extension("tmp"), aborted.to_string()).unwrap();
                std::fs::rename(done.with_extension("tmp"), done).unwrap();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// The backend: a Postgres schema when `FLUE_RECOVERY_PG` is `url|schema`, else SQLite in `dir`.
async fn open_backend(dir: &Path) -> Box<dyn Store> {
    #[cfg(feature = "postgres")]
    if let Ok(target) = std::env::var("FLUE_RECOVERY_PG")
        && let Some((url, schema)) = target.split_once('|')
    {
        return Box::new(
            flue_runtime::store::PostgresStore::connect_with_schema(url, schema)
                .await
                .unwrap(),
        );
    }
    let store = SqliteStore::open(dir.join("flue.db")).unwrap();
    if std::env::var_os("FLUE_RECOVERY_STRAY_CLOSE").is_some() {
        // Code of the process that reads the database file by other means (a sandbox's file
        // tool, a backup) and closes it: the POSIX locks of the process on it are gone.
        drop(std::fs::read(dir.join("flue.db")).unwrap());
    }
    Box::new(store)
}

impl Store for PausingStore {
    harness::delegate_store!(
        inner;
        admit, instance, submission, has_queued, claim_next, renew_leases, expired, reclaim,
        aborts_requested, instances_with_queued, claim_joinable, finalize_join, revert_joins, requeue,
        request_abort, read, put_attachment, attachment, user_value, set_user_value,
        list_user_values, create_child,
    );

    fn exclusive(&self) -> bool {
        self.inner.exclusive()
    }

    fn settle(
        &self,
        h: &AttemptRef,
        o: Outcome,
        e: Option<SettlementError>,
        r: Vec<Record>,
    ) -> BoxFuture<'_, Result<bool, StoreError>> {
        if self.point == Point::Settlement {
            self.pause();
        }
        self.inner.settle(h, o, e, r)
    }
    fn append(
        &self,
        k: &InstanceKey,
        r: std::sync::Arc<[Record]>,
        a: Option<&AttemptRef>,
    ) -> BoxFuture<'_, Result<u64, StoreError>> {
        let pause = match self.point {
            Point::ToolBatchCommit => r
                .iter()
                .any(|record| matches!(record.body, RecordBody::ToolResultsCommitted { .. })),
            Point::TaskCommit => r
                .iter()
                .any(|record| matches!(record.body, RecordBody::ToolResultsCommitted { .. }))
                && r.iter().any(
                    |record| matches!(&record.body, RecordBody::ToolOutcome { tool_name, .. } if tool_name == "task"),
                ),
            Point::StartSeam => r.iter().any(|record| matches!(record.body, RecordBody::AgentStartRun)),
            _ => false,
        };
        if pause {
            self.pause();
        }
        self.inner.append(k, r, a)
    }
}

/// A model that streams a little and then hangs (to be killed mid-stream), after a while
/// long enough for the runtime to append what streamed when `appended`.
struct HangingModel {
    appended: bool,
}

impl ModelProvider for HangingModel {
    fn id(&self) -> &str {
        "scripted"
    }
    fn stream(&self, _request: &ModelRequest) -> ModelStream {
        let appended = self.appended;
        Box::pin(futures_util::stream::unfold(0, move |step| async move {
            if step == 0 {
                return Some((Ok(StreamEvent::TextDelta("partial ".into())), 1));
            }
            if appended {
                // Several `text_flush` intervals (the child's is 10 ms).
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            pause_forever()
        }))
    }
}

fn side_effects(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("charges"))
        .map(|text| text.lines().count())
        .unwrap_or(0)
}

#[agent(durability(max_attempts = 3))]
fn billing() -> &'static str {
    billing_body()
}

/// `billing` with a two-second budget across all attempts.
#[agent(durability(max_attempts = 3, timeout = "2s"))]
fn billing_on_a_budget() -> &'static str {
    billing_body()
}

/// Charges the card: a line appended to `charges` in `dir`, an external side effect the
/// parent process counts.
fn record_charge(dir: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(Path::new(dir).join("charges"))?;
    writeln!(file, "charged")
}

/// The billing agents' hooks: a helper an agent calls records onto its render like the agent.
fn billing_body() -> &'static str {
    use_model("scripted/x");
    let (_, set_charged) = use_persistent_state("charged", false);
    let dir = std::env::var("FLUE_RECOVERY_DIR").unwrap_or_default();
    use_tool(Tool::new("charge").description("Charge the card once.").run(
        move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
            let set_charged = set_charged.clone();
            let dir = dir.clone();
            async move {
                record_charge(&dir)?;
                set_charged.set(true)?;
                Ok::<_, ToolError>("charged")
            }
        },
    ));
    use_agent_start(|ctx| async move {
        ctx.append(Signal::new("account", "The account is in good standing."))?;
        Ok::<_, flue_runtime::event_hooks::AppendError>(())
    });
    "You bill customers."
}

/// A tool that charges the card: an external side effect, visible to the parent process.
fn charge_tool() -> Tool {
    let dir = std::env::var("FLUE_RECOVERY_DIR").unwrap_or_default();
    Tool::new("charge").description("Charge the card once.").run(
        move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
            let dir = dir.clone();
            async move {
                record_charge(&dir)?;
                Ok::<_, ToolError>("charged")
            }
        },
    )
}

/// Delegates the charge to a `biller` task, whose child conversation charges the card.
#[agent(durability(max_attempts = 3))]
fn delegating() -> &'static str {
    use_model("scripted/x");
    use_subagent(Subagent::new(
        "biller",
        "Charges cards.",
        FnAgent::new(AgentDefinition::new("biller"), |_: AgentProps<'_>| {
            use_tool(charge_tool());
            "You charge cards."
        }),
    ));
    "You bill customers through the biller."
}

/// The child: `mode` is `crash:<point>` (send and get killed) or `recover` (resume and
/// report). Prints one JSON line with the outcome when it finishes.
async fn child(mode: &str, dir: &Path) {
    let db = dir.join("flue.db");
    // `crash:<point>`: send, pause there. `crash-resume`: resume the interrupted submission and
    // pause at the tool-batch commit again. `recover`: resume and report.
    let (point, resume) = match mode.strip_prefix("crash:") {
        Some(point) => (Point::parse(point), false),
        None if mode == "crash-resume" => (Point::ToolBatchCommit, true),
        None if mode == "standby" => (Point::Never, true),
        None => (Point::Never, true),
    };
    let mut providers = ProviderRegistry::new();
    if point == Point::TaskCommit {
        // The parent delegates; the task's child charges and answers.
        providers.register(ScriptedModel::new([
            ScriptedReply::tool_call("task", json!({"agent": "biller", "prompt": "Charge the card."})),
            ScriptedReply::tool_call("charge", json!({})),
            ScriptedReply::text("Charged."),
            ScriptedReply::text("All set."),
        ]));
    } else if matches!(point, Point::ModelStream | Point::ModelStreamStreamed) {
        providers.register(HangingModel {
            appended: point == Point::ModelStreamStreamed,
        });
    } else if mode == "standby" {
        // The surviving node answers every message it gets.
        providers.register(ScriptedModel::echo());
    } else if resume && point == Point::Never {
        // The recovering process's model answers from what it reads (an outcome-unknown tool
        // result, say); it never asks for the tool again, so a second charge would be recovery's.
        providers.register(ScriptedModel::new([ScriptedReply::text(
            "Recovered: please confirm the charge.",
        )]));
    } else {
        providers.register(ScriptedModel::new([
            ScriptedReply::tool_call("charge", json!({})),
            ScriptedReply::text("All set."),
        ]));
    }
    let _ = db;
    let store = PausingStore {
        inner: open_backend(dir).await,
        point,
        dir: dir.to_owned(),
    };
    // `FLUE_RECOVERY_LEASE_MS`: a lease longer than any test waits (the recovery must not wait
    // for it).
    let lease = std::env::var("FLUE_RECOVERY_LEASE_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map_or(Duration::from_millis(400), Duration::from_millis);
    let options = RuntimeOptions {
        lease,
        heartbeat: Duration::from_millis(50),
        scan_interval: Duration::from_millis(100),
        text_flush: Some(Duration::from_millis(10)),
        ..RuntimeOptions::default()
    };
    let runtime = Runtime::builder()
        .agent(billing)
        .agent(billing_on_a_budget)
        .agent(delegating)
        .providers(providers)
        .store(store)
        .options(options)
        .build()
        .unwrap();
    let handle = if std::env::var_os("FLUE_RECOVERY_DELEGATING").is_some() {
        runtime.init(&delegating, "customer")
    } else if std::env::var_os("FLUE_RECOVERY_ON_A_BUDGET").is_some() {
        runtime.init(&billing_on_a_budget, "customer")
    } else {
        runtime.init(&billing, "customer")
    };
    if resume && point != Point::Never {
        runtime.start().await;
        tokio::time::sleep(Duration::from_secs(3600)).await;
    }
    if mode == "standby" {
        // A second node: takes over whatever the first leaves behind, then reports every
        // submission listed in `submissions` once all settled.
        runtime.start().await;
        println!("\nSTANDBY");
        let ids = loop {
            if let Ok(text) = std::fs::read_to_string(dir.join("submissions"))
                && text.ends_with('\n')
            {
                break text;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let mut outcomes = Vec::new();
        for id in ids.lines() {
            let result = tokio::time::timeout(Duration::from_secs(30), handle.read(id))
                .await
                .unwrap();
            outcomes.push(json!({"id": id, "ok": result.is_ok()}));
        }
        println!("\nREPORT {}", json!(outcomes));
        return;
    }
    if resume {
        runtime.start().await;
        let id = std::fs::read_to_string(dir.join("submission")).unwrap();
        let result = tokio::time::timeout(Duration::from_secs(20), handle.read(id.trim()))
            .await
            .unwrap();
        let report = match result {
            Ok(reply) => json!({"outcome": "completed", "text": reply.text}),
            Err(RuntimeError::Run {
                error_type,
                message,
                meta,
                ..
            }) => json!({"outcome": "failed", "type": error_type, "message": message, "meta": meta}),
            Err(other) => json!({"outcome": "error", "message": other.to_string()}),
        };
        println!("\nREPORT {report}");
        return;
    }
    let receipt = handle.dispatch("Charge my card.").await.unwrap();
    std::fs::write(dir.join("submission"), &receipt.submission_id).unwrap();
    tokio::time::sleep(Duration::from_secs(3600)).await;
}

/// The child process of the recovery tests (run by [`spawn`], with `--ignored`).
#[tokio::test]
#[ignore = "the child process of the recovery tests"]
async fn recovery_child_entry() {
    // Runs only when re-invoked by a recovery test (`--include-ignored` runs it alone: nothing
    // to do then).
    let (Ok(mode), Ok(dir)) = (std::env::var(CHILD), std::env::var("FLUE_RECOVERY_DIR")) else {
        return;
    };
    child(&mode, Path::new(&dir)).await;
}

// ---- the parent ------------------------------------------------------------------------------

/// A child process that is killed when dropped: a test that fails while its child is paused
/// (a panic before the kill) leaves no process behind, holding its database.
struct Spawned(Child);

impl std::ops::Deref for Spawned {
    type Target = Child;

    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Spawned {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        // A child that already ended (and was waited for) cannot be killed: nothing to do.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(mode: &str, dir: &Path, extra: &[(&str, &str)]) -> Spawned {
    let mut command = Command::new(std::env::current_exe().unwrap());
    if let Ok(backend) = std::fs::read_to_string(dir.join("backend")) {
        command.env("FLUE_RECOVERY_PG", backend);
    }
    command
        .args([
            "--exact",
            "recovery_child_entry",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD, mode)
        .env("FLUE_RECOVERY_DIR", dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    for (key, value) in extra {
        command.env(key, value);
    }
    Spawned(command.spawn().unwrap())
}

/// Runs a child until it prints `READY` (or a JSON report), returning that line.
fn wait_for_line(child: &mut Child, wanted: impl Fn(&str) -> bool) -> String {
    let stdout = child.stdout.take().unwrap();
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if sender.send(line).is_err() {
                return;
            }
        }
    });
    loop {
        let line = receiver
            .recv_timeout(Duration::from_secs(60))
            .expect("the child answered in time");
        if wanted(&line) {
            return line;
        }
    }
}

/// A fresh scratch directory; with `postgres`, also a fresh schema of the test database
/// (named in the directory's `backend` file, which the children read). `None` when Postgres is
/// asked for but not configured outside CI.
fn scratch(postgres: bool) -> Option<PathBuf> {
    let dir = scratch::dir("recovery");
    if postgres {
        let url = harness::postgres_url("Postgres recovery")?;
        let schema = harness::fresh_schema("flue_recovery");
        std::fs::write(dir.join("backend"), format!("{url}|{schema}")).unwrap();
    }
    Some(dir)
}

/// Crashes a child at `point`, then recovers in a fresh process; returns the recovery report
/// and the records left in the database.
fn crash_and_recover(
    dir: PathBuf,
    point: &str,
    before_kill: impl Fn(&Path),
) -> (serde_json::Value, Vec<Record>, PathBuf) {
    crash(&format!("crash:{point}"), &dir, &[], before_kill);
    let report = recover(&dir, &[]);
    let records = records(&dir);
    (report, records, dir)
}

/// Runs a child in `mode` until it pauses (`READY`), calls `before_kill`, then SIGKILLs it.
fn crash(mode: &str, dir: &Path, env: &[(&str, &str)], before_kill: impl Fn(&Path)) {
    let mut crashing = spawn(mode, dir, env);
    wait_for_line(&mut crashing, |line| line == "READY");
    before_kill(dir);
    crashing.kill().unwrap(); // SIGKILL
    crashing.wait().unwrap();
}

/// Runs a recovering child to its report.
fn recover(dir: &Path, env: &[(&str, &str)]) -> serde_json::Value {
    let mut recovering = spawn("recover", dir, env);
    let line = wait_for_line(&mut recovering, |line| line.starts_with("REPORT "));
    recovering.wait().unwrap();
    serde_json::from_str(&line["REPORT ".len()..]).unwrap()
}

/// Requests an abort of the instance's submissions, durably, while a child is paused; returns
/// how many submissions it marked. On Postgres another process requests it, as another node
/// would; a SQLite file is the paused child's alone, so the child requests it on its own store
/// ([`PausingStore::pause`]).
fn request_abort(dir: &Path, agent: &str) -> usize {
    if !dir.join("backend").exists() {
        let request = dir.join("abort_request");
        std::fs::write(request.with_extension("tmp"), agent).unwrap();
        std::fs::rename(request.with_extension("tmp"), request).unwrap();
        let done = dir.join("abort_done");
        for _ in 0..6_000 {
            if let Ok(aborted) = std::fs::read_to_string(&done) {
                std::fs::remove_file(&done).unwrap();
                return aborted.parse().unwrap();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("the paused child did not request the abort within 60 s");
    }
    let store = backend(dir);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime
        .block_on(store.request_abort(&InstanceKey::new(agent, "customer")))
        .unwrap()
        .len()
}

fn backend(dir: &Path) -> Box<dyn Store> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        #[cfg(feature = "postgres")]
        if let Ok(target) = std::fs::read_to_string(dir.join("backend"))
            && let Some((url, schema)) = target.split_once('|')
        {
            return Box::new(
                flue_runtime::store::PostgresStore::connect_with_schema(url, schema)
                    .await
                    .unwrap(),
            ) as Box<dyn Store>;
        }
        Box::new(SqliteStore::open(dir.join("flue.db")).unwrap()) as Box<dyn Store>
    })
}

fn records(dir: &Path) -> Vec<Record> {
    let store = backend(dir);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime
        .block_on(store.read(&InstanceKey::new("billing", "customer"), None))
        .unwrap()
        .into_iter()
        .flat_map(|batch| batch.records.to_vec())
        .collect()
}

/// The records of the `delegating` instance and of its one task child.
fn delegated_records(dir: &Path) -> (Vec<Record>, Vec<Record>) {
    let store = backend(dir);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let read = |key: &InstanceKey| -> Vec<Record> {
        runtime
            .block_on(store.read(key, None))
            .unwrap()
            .into_iter()
            .flat_map(|batch| batch.records.to_vec())
            .collect()
    };
    let parent = read(&InstanceKey::new("delegating", "customer"));
    let children: Vec<&InstanceKey> = parent
        .iter()
        .filter_map(|record| match &record.body {
            RecordBody::ChildSessionRetained { child, .. } => Some(child),
            _ => None,
        })
        .collect();
    assert_eq!(children.len(), 1, "one child conversation");
    let child = read(children[0]);
    (parent, child)
}

/// The terminal advisory of the one settled submission in `records`: its record id, signal
/// type and body; and whether the record right after it is that submission's settlement.
fn advisory(records: &[Record]) -> (String, String, String, bool) {
    let advisories: Vec<(usize, &Record)> = records
        .iter()
        .enumerate()
        .filter(|(_, record)| {
            matches!(&record.body, RecordBody::Signal { signal_type, .. }
                if signal_type.starts_with("submission_"))
        })
        .collect();
    let [(index, record)] = advisories[..] else {
        panic!("one terminal advisory: {advisories:?}")
    };
    let RecordBody::Signal { signal_type, body, .. } = &record.body else {
        unreachable!()
    };
    let settles = records.get(index + 1).is_some_and(|next| {
        next.submission_id == record.submission_id && matches!(next.body, RecordBody::SubmissionSettled { .. })
    });
    (record.id.clone(), signal_type.clone(), body.clone(), settles)
}

fn count(records: &[Record], predicate: impl Fn(&RecordBody) -> bool) -> usize {
    records.iter().filter(|record| predicate(&record.body)).count()
}

macro_rules! recovery_suite {
    ($backend:ident, $postgres:expr) => {
        mod $backend {
            use super::*;

            #[test]
            fn a_crash_during_a_model_stream_loses_no_input_and_the_response_completes() {
                let Some(dir) = scratch($postgres) else { return };
                let (report, records, _) = crash_and_recover(dir, "model_stream", |_| {});
                assert_eq!(report["outcome"], "completed", "{report}");
                assert_eq!(count(&records, |body| matches!(body, RecordBody::UserMessage { .. })), 1, "input applied once");
                assert_eq!(count(&records, |body| matches!(body, RecordBody::AgentStartRun)), 1, "seam not repeated");
                assert_eq!(
                    count(&records, |body| matches!(body, RecordBody::SubmissionSettled { outcome: Outcome::Completed, .. })),
                    1
                );
            }

            #[test]
            fn a_crash_after_a_step_streamed_text_makes_the_step_again_and_keeps_only_its_completed_text() {
                let Some(dir) = scratch($postgres) else { return };
                let (report, records, _) = crash_and_recover(dir, "model_stream_streamed", |_| {});
                assert_eq!(report["outcome"], "completed", "{report}");
                assert_eq!(report["text"], "Recovered: please confirm the charge.", "{report}");
                let streamed: Vec<&str> = records
                    .iter()
                    .filter_map(|record| match &record.body {
                        RecordBody::AssistantTextDelta { delta, .. } => Some(delta.as_str()),
                        _ => None,
                    })
                    .collect();
                assert_eq!(streamed, ["partial "], "the dead attempt's text was in the stream");
                assert_eq!(
                    count(&records, |body| matches!(body, RecordBody::AssistantMessageStarted { .. })),
                    2,
                    "the interrupted step and the one made again"
                );
                let completed: Vec<&str> = records
                    .iter()
                    .filter_map(|record| match &record.body {
                        RecordBody::AssistantMessageCompleted { text, .. } => Some(text.as_str()),
                        _ => None,
                    })
                    .collect();
                assert_eq!(completed, ["Recovered: please confirm the charge."]);
                assert_eq!(count(&records, |body| matches!(body, RecordBody::UserMessage { .. })), 1);
            }

            #[test]
            fn a_crash_between_a_tool_outcome_and_its_batch_commit_is_repaired_without_its_state_writes() {
                let Some(dir) = scratch($postgres) else { return };
                let (report, records, dir) = crash_and_recover(dir, "tool_batch_commit", |_| {});
                assert_eq!(report["outcome"], "completed", "{report}");
                assert_eq!(side_effects(&dir), 1, "the tool ran once; recovery did not re-run it");
                assert_eq!(count(&records, |body| matches!(body, RecordBody::StateWrite { .. })), 0, "the write is absent");
                // Repaired in the stream with the outcome-unknown result the model was told.
                let outcomes: Vec<(bool, &str)> = records
                    .iter()
                    .filter_map(|record| match &record.body {
                        RecordBody::ToolOutcome { is_error, content, .. } => Some((*is_error, content.as_str())),
                        _ => None,
                    })
                    .collect();
                assert_eq!(
                    outcomes,
                    [(
                        true,
                        r#"{"type":"interrupted","message":"Tool execution was interrupted before completion. The outcome is unknown."}"#
                    )]
                );
                assert_eq!(count(&records, |body| matches!(body, RecordBody::UserMessage { .. })), 1);
            }

            #[test]
            fn a_task_rerun_after_a_crash_reattaches_to_its_answered_child_without_running_it_again() {
                let Some(dir) = scratch($postgres) else { return };
                let delegates = [("FLUE_RECOVERY_DELEGATING", "1")];
                // Killed as the parent commits the batch answering the task call: the child
                // had charged and answered.
                crash("crash:task_commit", &dir, &delegates, |_| {});
                let report = recover(&dir, &delegates);
                assert_eq!(report["outcome"], "completed", "{report}");
                assert_eq!(side_effects(&dir), 1, "the child's tool ran once: recovery reattached");
                let (parent, child) = delegated_records(&dir);
                let results: Vec<(&str, bool)> = parent
                    .iter()
                    .filter_map(|record| match &record.body {
                        RecordBody::ToolOutcome { tool_name, content, is_error, .. } if tool_name == "task" => {
                            Some((content.as_str(), *is_error))
                        }
                        _ => None,
                    })
                    .collect();
                assert_eq!(results, [("Charged.", false)], "the child's recorded answer, once");
                assert_eq!(
                    count(&child, |body| matches!(body, RecordBody::AssistantMessageCompleted { .. })),
                    2,
                    "the child's steps, none taken again"
                );
                assert_eq!(count(&child, |body| matches!(body, RecordBody::UserMessage { .. })), 1);
            }

            #[test]
            fn a_crash_inside_a_start_seam_reruns_it_without_duplicating_its_durable_effects() {
                let Some(dir) = scratch($postgres) else { return };
                let (report, records, _) = crash_and_recover(dir, "start_seam", |_| {});
                assert_eq!(report["outcome"], "completed", "{report}");
                assert_eq!(count(&records, |body| matches!(body, RecordBody::AgentStartRun)), 1);
                assert_eq!(
                    count(&records, |body| matches!(body, RecordBody::Signal { signal_type, .. } if signal_type == "account")),
                    1
                );
            }

            #[test]
            fn a_crash_during_settlement_settles_once_without_redoing_completed_work() {
                let Some(dir) = scratch($postgres) else { return };
                let (report, records, dir) = crash_and_recover(dir, "settlement", |_| {});
                assert_eq!(report["outcome"], "completed", "{report}");
                assert_eq!(report["text"], "All set.", "the recovered reply is the completed response's");
                assert_eq!(side_effects(&dir), 1, "completed work is never redone");
                assert_eq!(count(&records, |body| matches!(body, RecordBody::SubmissionSettled { .. })), 1);
            }

            #[test]
            fn a_durable_final_answer_settles_completed_even_past_the_budget_and_after_an_abort_request() {
                let Some(dir) = scratch($postgres) else { return };
                let budget = [("FLUE_RECOVERY_ON_A_BUDGET", "1")];
                crash("crash:settlement", &dir, &budget, |dir| {
                    assert_eq!(request_abort(dir, "billing_on_a_budget"), 1);
                });
                std::thread::sleep(Duration::from_millis(2_500));
                let report = recover(&dir, &budget);
                assert_eq!(report["outcome"], "completed", "{report}");
                assert_eq!(report["text"], "All set.");
                assert_eq!(side_effects(&dir), 1);
            }

            #[test]
            fn an_abort_requested_before_the_crash_settles_as_aborted() {
                let Some(dir) = scratch($postgres) else { return };
                // The abort is requested (durably) while the attempt is stuck; then the process dies.
                let (report, records, dir) = crash_and_recover(dir, "tool_batch_commit", |dir| {
                    assert_eq!(request_abort(dir, "billing"), 1);
                });
                assert_eq!(report["outcome"], "failed", "{report}");
                assert_eq!(report["type"], "submission_aborted");
                assert_eq!(
                    count(&records, |body| matches!(body, RecordBody::SubmissionSettled { outcome: Outcome::Aborted, .. })),
                    1
                );
                // The advisory the model of a later response reads, with the settlement.
                let (id, signal_type, body, settles) = advisory(&records);
                let submission = std::fs::read_to_string(dir.join("submission")).unwrap();
                assert_eq!(id, format!("record_submission_aborted_{}", submission.trim()));
                // It names the call the crash interrupted, whose outcome is unknown.
                assert_eq!(
                    (signal_type.as_str(), body.as_str()),
                    (
                        "submission_aborted",
                        "Submission was aborted.\n\nInterrupted tool call(s):\n  - charge (call_1_0)"
                    )
                );
                assert!(settles);
            }

            #[test]
            fn max_attempts_bounds_the_retries_of_a_submission_that_keeps_crashing() {
                let Some(dir) = scratch($postgres) else { return };
                // Three crashes at the tool-batch commit use max_attempts = 3; the fourth process
                // settles the submission as failed instead of running it again.
                for round in 0..3 {
                    let mode = if round == 0 { "crash:tool_batch_commit" } else { "crash-resume" };
                    crash(mode, &dir, &[], |_| {});
                }
                let report = recover(&dir, &[]);
                assert_eq!(report["type"], "submission_retry_exhausted", "{report}");
                assert_eq!(report["message"], "Submission exceeded maximum recovery attempts (3/3).");
                // The charge whose outcome no attempt confirmed, in the error and the advisory.
                let tools = &report["meta"]["interruptedTools"];
                assert_eq!(tools.as_array().map(Vec::len), Some(1), "{report}");
                assert_eq!(tools[0]["name"], "charge");
                let call = tools[0]["id"].as_str().unwrap();
                let (id, signal_type, body, settles) = advisory(&records(&dir));
                let submission = std::fs::read_to_string(dir.join("submission")).unwrap();
                assert_eq!(id, format!("record_submission_interrupted_{}", submission.trim()));
                assert_eq!(signal_type, "submission_interrupted");
                assert_eq!(
                    body,
                    format!(
                        "Submission exceeded maximum recovery attempts (3/3).\n\nInterrupted tool call(s):\n  - charge ({call})"
                    )
                );
                assert!(settles);
            }

            #[test]
            fn the_timeout_spans_attempts_so_a_recovery_after_the_budget_fails_the_submission() {
                let Some(dir) = scratch($postgres) else { return };
                let budget = [("FLUE_RECOVERY_ON_A_BUDGET", "1")];
                crash("crash:tool_batch_commit", &dir, &budget, |_| {});
                // The two-second budget started at the first claim; a fresh attempt does not
                // restart it.
                std::thread::sleep(Duration::from_millis(2_500));
                let report = recover(&dir, &budget);
                assert_eq!(report["type"], "submission_timeout", "{report}");
                assert_eq!(report["message"], "Submission exceeded the configured timeout.");
                // The interrupted tool ran once and was not run again.
                assert_eq!(side_effects(&dir), 1);
            }
        }
    };
}

recovery_suite!(sqlite, false);
#[cfg(feature = "postgres")]
recovery_suite!(postgres, true);

/// A SQLite file is one process's: a submission found running in it when a runtime starts was
/// left by a process that ended (here SIGKILLed), and is taken over at once, not once its lease
/// (ten minutes here) runs out.
#[test]
fn a_sqlite_store_reopened_after_a_crash_takes_over_at_once_not_after_the_lease() {
    let Some(dir) = scratch(false) else { return };
    let long_lease = [("FLUE_RECOVERY_LEASE_MS", "600000")];
    crash("crash:tool_batch_commit", &dir, &long_lease, |_| {});
    let report = recover(&dir, &long_lease);
    assert_eq!(report["outcome"], "completed", "{report}");
    assert_eq!(side_effects(&dir), 1, "the tool ran once");
}

/// A SQLite file belongs to the runtime process that opened it: a second process cannot open
/// the store meanwhile (it would run the same instances beside the first), and says why; once
/// the first process is gone, the file opens again.
#[test]
fn a_second_process_cannot_open_a_sqlite_store_in_use_and_says_why() {
    let Some(dir) = scratch(false) else { return };
    crash("crash:settlement", &dir, &[], |dir| {
        let error = SqliteStore::open(dir.join("flue.db")).err().unwrap();
        let message = error.to_string();
        assert!(message.contains("is in use by another process"), "{message}");
        assert!(message.contains("Postgres"), "{message}");
    });
    SqliteStore::open(dir.join("flue.db")).unwrap();
}

/// The same after code of the first process read the database file and closed it (which
/// releases the process's POSIX locks on it, SQLite's own included).
#[test]
fn a_second_process_cannot_open_a_sqlite_store_in_use_after_the_first_closed_a_descriptor_of_it() {
    let Some(dir) = scratch(false) else { return };
    crash("crash:settlement", &dir, &[("FLUE_RECOVERY_STRAY_CLOSE", "1")], |dir| {
        let error = SqliteStore::open(dir.join("flue.db")).err().unwrap();
        assert!(error.to_string().contains("is in use by another process"), "{error}");
    });
    SqliteStore::open(dir.join("flue.db")).unwrap();
}

/// Two nodes on one Postgres: the owner of a busy instance is killed; the other takes the
/// instance over once the lease expires, completes the submission exactly once, and processes
/// the messages admitted during the failover in order.
#[cfg(feature = "postgres")]
#[test]
fn failover_to_a_second_node_completes_the_submission_once_and_keeps_admission_order() {
    let Some(dir) = scratch(true) else { return };
    // Node A takes the first message and dies holding it.
    let mut owner = spawn("crash:tool_batch_commit", &dir, &[]);
    wait_for_line(&mut owner, |line| line == "READY");
    // Node B starts only now: started earlier, its scan could claim the first message before A
    // does, and A would never reach its crash point.
    let mut standby = spawn("standby", &dir, &[]);
    // Messages admitted while A holds the instance: they queue behind its submission.
    let store = backend(&dir);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let first = std::fs::read_to_string(dir.join("submission")).unwrap();
    let mut ids = vec![first.trim().to_owned()];
    for (index, body) in ["second", "third"].iter().enumerate() {
        let id = format!("sub_failover_{index}");
        runtime
            .block_on(store.admit(harness::admission(&InstanceKey::new("billing", "customer"), &id, body)))
            .unwrap();
        ids.push(id);
    }
    std::fs::write(
        dir.join("submissions"),
        ids.iter().map(|id| format!("{id}\n")).collect::<String>(),
    )
    .unwrap();
    owner.kill().unwrap(); // SIGKILL: its lease now runs out
    owner.wait().unwrap();
    let report = wait_for_line(&mut standby, |line| line.starts_with("REPORT "));
    standby.wait().unwrap();
    let outcomes: serde_json::Value = serde_json::from_str(&report["REPORT ".len()..]).unwrap();
    assert!(
        outcomes.as_array().unwrap().iter().all(|outcome| outcome["ok"] == true),
        "{outcomes}"
    );
    let records = records(&dir);
    for id in &ids {
        let settled = records
            .iter()
            .filter(|record| record.submission_id.as_deref() == Some(id.as_str()))
            .filter(|record| matches!(record.body, RecordBody::SubmissionSettled { .. }))
            .count();
        assert_eq!(settled, 1, "{id} settled exactly once");
    }
    let users: Vec<String> = records
        .iter()
        .filter_map(|record| match &record.body {
            RecordBody::UserMessage { body, .. } => Some(body.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(users, ["Charge my card.", "second", "third"], "admission order");
}
