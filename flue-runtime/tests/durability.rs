//! Fault injection: a store that fails chosen appends once. A failed durability point abandons
//! the attempt; the next attempt resumes from what is durable, as after a crash.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

mod harness;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use flue_runtime::prelude::*;
use flue_runtime::provider::{ModelMessage, ProviderRegistry};
use flue_runtime::record::{Outcome, Record, RecordBody};
use flue_runtime::store::{Admission, AttemptRef, Claim, InstanceKey, Store};
use flue_runtime::testing::{ScriptedModel, ScriptedReply};
use flue_runtime::{AgentReply, Runtime, RuntimeError, RuntimeOptions};
use serde_json::json;

use harness::Gated;
use harness::faulty::{self, FaultyStore};

fn runtime(store: &FaultyStore, model: &ScriptedModel, agent: impl Into<AgentRef>) -> Runtime {
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    Runtime::builder()
        .agent(agent)
        .providers(providers)
        .store(store.clone())
        .options(RuntimeOptions {
            model_retry_delay: std::time::Duration::from_millis(1),
            ..RuntimeOptions::default()
        })
        .build()
        .unwrap()
}

/// A started runtime that takes over what a dead node left: short leases, a fast scan.
async fn taking_over(store: &FaultyStore, model: &ScriptedModel, agent: impl Into<AgentRef>) -> Runtime {
    let runtime = fast_scanning(store, model, agent);
    runtime.start().await;
    runtime
}

/// The runtime [`taking_over`] starts, not started yet (to observe it from its start).
fn fast_scanning(store: &FaultyStore, model: &ScriptedModel, agent: impl Into<AgentRef>) -> Runtime {
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    Runtime::builder()
        .agent(agent)
        .providers(providers)
        .store(store.clone())
        .options(fast_scanning_options())
        .build()
        .unwrap()
}

/// The options of [`fast_scanning`]: a 200 ms lease, a beat and a scan every 20 ms.
fn fast_scanning_options() -> RuntimeOptions {
    RuntimeOptions {
        lease: std::time::Duration::from_millis(200),
        heartbeat: std::time::Duration::from_millis(20),
        scan_interval: std::time::Duration::from_millis(20),
        ..RuntimeOptions::default()
    }
}

async fn records(store: &FaultyStore, key: &InstanceKey) -> Vec<Record> {
    store
        .inner
        .read(key, None)
        .await
        .unwrap()
        .into_iter()
        .flat_map(|batch| batch.records.to_vec())
        .collect()
}

/// The instances `charge` ran for, one entry per run (per instance: the tests that charge run
/// at once, in any order).
static CHARGES: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// How many times `charge` ran for `instance`.
fn charges(instance: &str) -> usize {
    CHARGES.lock().unwrap().iter().filter(|id| *id == instance).count()
}

#[agent]
fn billing() -> &'static str {
    use_model("scripted/x");
    let (_, set_charged) = use_persistent_state("charged", false);
    use_tool(Tool::new("charge").description("Charge the card.").run(
        move |ctx: ToolContext, _: serde_json::Map<String, serde_json::Value>| {
            let set_charged = set_charged.clone();
            async move {
                CHARGES
                    .lock()
                    .unwrap()
                    .push(ctx.instance_id().unwrap_or_default().to_owned());
                set_charged.set(true)?;
                Ok::<_, ToolError>("charged")
            }
        },
    ));
    "You bill customers."
}

#[tokio::test]
async fn a_failure_between_a_tool_outcome_and_its_batch_commit_leaves_the_tools_state_writes_absent() {
    let store = FaultyStore::default();
    store.fail_once(faulty::commits_a_tool_batch);
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("charge", json!({})),
        ScriptedReply::text("I could not confirm the charge."),
    ]);
    let runtime = runtime(&store, &model, billing);
    let reply = runtime.init(&billing, "b-1").send("charge me").await.unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    assert_eq!(reply.text, "I could not confirm the charge.");
    let key = InstanceKey::new("billing", "b-1");
    let all = records(&store, &key).await;
    assert!(
        !all.iter()
            .any(|record| matches!(record.body, RecordBody::StateWrite { .. })),
        "the interrupted batch's state write is absent"
    );
    // The re-attempt settled the batch in the stream with the result the model is told, so
    // readers of the stream see the call end (reference §3.9 step 7).
    let outcomes: Vec<_> = all
        .iter()
        .filter_map(|record| match &record.body {
            RecordBody::ToolOutcome {
                tool_name,
                is_error,
                content,
                ..
            } => Some((
                tool_name.as_str(),
                *is_error,
                content.as_str(),
                record.submission_id.is_some(),
            )),
            _ => None,
        })
        .collect();
    assert_eq!(
        outcomes,
        [(
            "charge",
            true,
            r#"{"type":"interrupted","message":"Tool execution was interrupted before completion. The outcome is unknown."}"#,
            true
        )]
    );
    assert_eq!(
        all.iter()
            .filter(|record| matches!(record.body, RecordBody::ToolResultsCommitted { .. }))
            .count(),
        1
    );
    // The tool ran once; the re-attempt did not re-run it but told the model its outcome is unknown.
    assert_eq!(charges("b-1"), 1);
    let requests = model.requests();
    let ModelMessage::Tool { content, is_error, .. } = requests[1].messages.last().unwrap() else {
        panic!("tool result")
    };
    assert!(*is_error);
    assert_eq!(
        content,
        r#"{"type":"interrupted","message":"Tool execution was interrupted before completion. The outcome is unknown."}"#
    );
    // The input was applied exactly once.
    let inputs = all
        .iter()
        .filter(|record| matches!(record.body, RecordBody::UserMessage { .. }))
        .count();
    assert_eq!(inputs, 1);
}

/// Adds a row to the thread (an append of its own, in the middle of the tool).
#[tool]
async fn jot(ctx: &ToolContext) -> Result<String, ToolError> {
    let thread = ctx.thread().expect("a thread");
    thread
        .inject_message(flue_runtime::lifecycle::InjectMessage::new(
            flue_runtime::lifecycle::MessageRole::User,
            "remember the milk",
        ))
        .await
        .map_err(|error| ToolError::new(error.to_string()))?;
    Ok("jotted".into())
}

/// Lets `held_one` end.
static HELD_ONE_GO: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// The next store read fails once this is armed (the test's store's `failing_reads`).
static FAIL_NEXT_READ: std::sync::OnceLock<Arc<AtomicUsize>> = std::sync::OnceLock::new();
static JOTTED: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Injects a row with the store's next read failing: the one that reads the stored row back.
#[tool]
async fn jot_past_a_failed_read(ctx: &ToolContext) -> String {
    let thread = ctx.thread().expect("a thread");
    FAIL_NEXT_READ.get().expect("armed").store(1, Ordering::SeqCst);
    let injected = thread
        .inject_message(flue_runtime::lifecycle::InjectMessage::new(
            flue_runtime::lifecycle::MessageRole::User,
            "remember the eggs",
        ))
        .await;
    JOTTED.lock().unwrap().push(match &injected {
        Ok(row) => format!("injected {}", row.content.as_deref().unwrap_or_default()),
        Err(error) => format!("failed: {error}"),
    });
    "jotted".into()
}

#[agent]
fn careful_scribe() -> &'static str {
    use_model("scripted/x");
    use_tool(jot_past_a_failed_read);
    "You take notes."
}

/// An injected row is stored once its append commits: a failed read of it back afterwards
/// does not fail the call (a caller trying again would store it twice); the row as written
/// stands in. (Regression: the call failed with the store's error.)
#[tokio::test]
async fn an_inject_whose_read_back_fails_after_its_append_still_answers_the_row() {
    let store = FaultyStore::default();
    let _ = FAIL_NEXT_READ.set(store.failing_reads.clone());
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("jot_past_a_failed_read", json!({})),
        ScriptedReply::text("noted"),
    ]);
    let runtime = runtime(&store, &model, careful_scribe);
    runtime.init(&careful_scribe, "c").send("note the eggs").await.unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1, "the read back failed");
    assert_eq!(JOTTED.lock().unwrap().clone(), ["injected remember the eggs"]);
    let injected = records(&store, &InstanceKey::new("careful_scribe", "c"))
        .await
        .into_iter()
        .filter(|record| matches!(record.body, RecordBody::MessageInjected { .. }))
        .count();
    assert_eq!(injected, 1);
}

/// Ends once the test lets it (`HELD_ONE_GO`).
#[tool]
async fn held_one() -> String {
    HELD_ONE_GO.notified().await;
    "let go".into()
}

#[agent]
fn scribe() -> &'static str {
    use_model("scripted/x");
    use_tool(jot);
    use_tool(held_one);
    "You take notes."
}

/// A tool stopped by an abort while the store had its write (committed, its answer not yet
/// back: a remote store's) leaves that write in the stream, and batches after it (the
/// outcome of a call that ended before the abort) in the node's fold. The node reads the
/// conversation again, so the row is not missing from what its next model call reads.
#[tokio::test]
async fn a_write_a_tool_gave_up_on_mid_commit_is_seen_by_the_next_submission() {
    use flue_runtime::events::Event;
    let store = FaultyStore::default();
    store.hangs_after_commit.store(true, Ordering::SeqCst);
    store.fail_once(|records| {
        records
            .iter()
            .any(|record| matches!(record.body, RecordBody::MessageInjected { .. }))
    });
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([("jot", json!({})), ("held_one", json!({}))]),
        ScriptedReply::text("noted"),
    ]);
    let runtime = runtime(&store, &model, scribe);
    let mut events = runtime.observe();
    let handle = runtime.init(&scribe, "s");
    let sending = tokio::spawn({
        let handle = handle.clone();
        async move { handle.send("jot it down").await }
    });
    let key = InstanceKey::new("scribe", "s");
    // The row is committed (its append hangs after)...
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while !records(&store, &key)
            .await
            .iter()
            .any(|record| matches!(record.body, RecordBody::MessageInjected { .. }))
        {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the row is committed");
    assert_eq!(store.failures.load(Ordering::SeqCst), 1, "the row's append hangs");
    // ...then the other call ends (its outcome's append waits behind the hung one), before
    // the abort.
    HELD_ONE_GO.notify_one();
    let status = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            if let Event::ToolCallDone { tool_name, status, .. } = events.recv().await.unwrap().event
                && tool_name == "held_one"
            {
                break status;
            }
        }
    })
    .await
    .expect("the other call ends");
    assert_eq!(status, "success", "the other call ended before the abort");
    assert!(handle.abort().await.unwrap());
    let aborted = sending.await.unwrap().unwrap_err();
    assert!(
        matches!(&aborted, RuntimeError::Run { outcome, .. } if *outcome == "was aborted"),
        "{aborted:?}"
    );
    // The stream holds a batch after the write the tool gave up on: the other call's outcome.
    let stream = records(&store, &key).await;
    let position = |wanted: fn(&RecordBody) -> bool| stream.iter().position(|record| wanted(&record.body));
    let injected = position(|body| matches!(body, RecordBody::MessageInjected { .. })).unwrap();
    let outcome = position(
        |body| matches!(body, RecordBody::ToolOutcome { tool_name, is_error: false, .. } if tool_name == "held_one"),
    );
    assert!(
        outcome.is_some_and(|outcome| outcome > injected),
        "the other call's outcome follows the row: {stream:#?}"
    );
    store.disarm();
    handle.send("what did you note?").await.unwrap();
    let read = format!("{:?}", model.requests()[1].messages);
    assert!(read.contains("remember the milk"), "{read}");
}

/// A tool's thread write whose commit went through while its answer was lost (a remote
/// store's connection dropping after its `COMMIT`) fails the write and not the response; the
/// node's fold lacks the row, so the next submission reads the conversation again, and its
/// model call sees the row, as a restarted node's would.
#[tokio::test]
async fn a_thread_write_whose_answer_was_lost_is_seen_by_the_next_submission() {
    let store = FaultyStore::default();
    store.acks_lost.store(true, Ordering::SeqCst);
    store.fail_once(|records| {
        records
            .iter()
            .any(|record| matches!(record.body, RecordBody::MessageInjected { .. }))
    });
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("jot", json!({})),
        ScriptedReply::text("could not note it"),
        ScriptedReply::text("you noted the milk"),
    ]);
    let runtime = runtime(&store, &model, scribe);
    let handle = runtime.init(&scribe, "lost");
    handle.send("jot it down").await.unwrap();
    let (result, is_error) = harness::tool_results(&model.requests()[1]).remove(0);
    assert!(is_error, "the write failed as far as the tool knows: {result}");
    handle.send("what did you note?").await.unwrap();
    let read = format!("{:?}", model.requests()[2].messages);
    assert!(read.contains("remember the milk"), "{read}");
}

/// A wait whose looks at the store keep failing (a store down for good) gives up after a
/// while with the submission's id, so that its caller reads it again rather than sending the
/// message twice: the message was admitted, and may have run.
#[tokio::test(start_paused = true)]
async fn a_reply_the_store_cannot_give_back_names_the_admitted_submission() {
    let store = FaultyStore::default();
    let model = ScriptedModel::new([ScriptedReply::text("done")]);
    let runtime = runtime(&store, &model, one_shot_answer);
    let handle = runtime.init(&one_shot_answer, "unread");
    let receipt = handle.dispatch("hi").await.unwrap();
    assert_eq!(handle.read(&receipt.submission_id).await.unwrap().text, "done");
    store.failing_reads.store(usize::MAX, Ordering::SeqCst);
    let error = handle.read(&receipt.submission_id).await.unwrap_err();
    assert!(
        matches!(&error, RuntimeError::ReplyUnread { submission_id, .. } if *submission_id == receipt.submission_id),
        "{error:?}"
    );
    // The store back, the same read answers.
    store.failing_reads.store(0, Ordering::SeqCst);
    assert_eq!(handle.read(&receipt.submission_id).await.unwrap().text, "done");
    // A store failing for a while (a failover) when the read first looks at the instance is
    // waited out as the look at the submission is: the read `ReplyUnread` advises succeeds.
    store.failing_instance_looks.store(3, Ordering::SeqCst);
    assert_eq!(handle.read(&receipt.submission_id).await.unwrap().text, "done");
    assert_eq!(store.failing_instance_looks.load(Ordering::SeqCst), 0);
}

#[agent(durability(max_attempts = 1))]
fn one_shot_answer() -> &'static str {
    use_model("scripted/x");
    use_response_finish(|_ctx| json!({"finished": true}));
    "Answer."
}

/// A store failure after the response's end is durable (its finish batch's write) spends no
/// attempt: another attempt settles the response as it is, completed with its answer and its
/// finish metadata, even when the budget was one attempt (it used to settle as a spent
/// budget, an answered response reported failed).
#[tokio::test]
async fn a_store_failure_after_a_durable_answer_is_settled_completed_by_another_attempt() {
    let store = FaultyStore::default();
    store.fail_once(|records| {
        records
            .iter()
            .any(|record| matches!(record.body, RecordBody::MessageMetadata { .. }))
    });
    let model = ScriptedModel::new([ScriptedReply::text("the answer")]);
    let runtime = runtime(&store, &model, one_shot_answer);
    let reply = runtime.init(&one_shot_answer, "osa").send("go").await.unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    assert_eq!(reply.text, "the answer");
    assert_eq!(reply.metadata.get("finished"), Some(&json!(true)));
    assert_eq!(model.requests().len(), 1, "completed work is never redone");
}

/// Past its few deferrals, a response whose end is durable still settles completed with its
/// answer when the store keeps refusing what follows the end (its finish batch): only the
/// finish's metadata is missing. (It used to settle as a spent budget, an answered response
/// reported failed.)
#[tokio::test]
async fn a_finish_batch_the_store_keeps_refusing_leaves_the_answered_response_completed() {
    let store = FaultyStore::default();
    store.fail_always(|records| {
        records
            .iter()
            .any(|record| matches!(record.body, RecordBody::MessageMetadata { .. }))
    });
    let model = ScriptedModel::new([ScriptedReply::text("the answer")]);
    let runtime = runtime(&store, &model, one_shot_answer);
    let reply = runtime.init(&one_shot_answer, "refused").send("go").await.unwrap();
    assert!(
        store.failures.load(Ordering::SeqCst) > 1,
        "re-attempted before giving up"
    );
    assert_eq!(reply.text, "the answer");
    assert_eq!(
        reply.metadata.get("finished"),
        None,
        "the finish batch was never stored"
    );
    assert_eq!(model.requests().len(), 1, "completed work is never redone");
}

/// Whether `records` hold a final answer's completion (a step without tool calls).
fn completes_an_answer(records: &[Record]) -> bool {
    records
        .iter()
        .any(|record| matches!(&record.body, RecordBody::AssistantMessageCompleted { .. }))
        && !records
            .iter()
            .any(|record| matches!(record.body, RecordBody::AssistantToolCall { .. }))
}

/// A final answer whose commit went through but whose acknowledgement was lost (a remote
/// store's connection dropping after its `COMMIT`) settles completed, on the last attempt
/// too: the settlement reads what its fold missed before it tells how the response ended. (It
/// settled as a spent budget, an answered response reported failed.)
#[tokio::test]
async fn a_final_answer_whose_commit_acknowledgement_was_lost_settles_completed_on_the_last_attempt() {
    let store = FaultyStore::default();
    store.acks_lost.store(true, Ordering::SeqCst);
    store.fail_once(completes_an_answer);
    let model = ScriptedModel::new([ScriptedReply::text("the answer")]);
    let runtime = runtime(&store, &model, one_shot_answer);
    let reply = runtime.init(&one_shot_answer, "lost-ack").send("go").await.unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    assert_eq!(reply.text, "the answer");
    assert_eq!(reply.metadata.get("finished"), Some(&json!(true)));
    assert_eq!(model.requests().len(), 1, "completed work is never redone");
    let answers = records(&store, &InstanceKey::new("one_shot_answer", "lost-ack"))
        .await
        .iter()
        .filter(|record| matches!(record.body, RecordBody::AssistantMessageCompleted { .. }))
        .count();
    assert_eq!(answers, 1, "the answer is stored once");
}

#[agent(durability(max_attempts = 1))]
fn one_shot_billing() -> &'static str {
    use_model("scripted/x");
    use_tool(
        Tool::new("charge")
            .description("Charge the card.")
            .run(|_ctx, _: serde_json::Map<String, serde_json::Value>| async { Ok::<_, ToolError>("charged") }),
    );
    "You bill customers."
}

/// Reference §3.9 (`recordSubmissionTerminal`): a submission that ends without committing
/// its tool batch settles that batch in its settlement's batch, before the advisory, with the
/// outcome-unknown results: no call rests without an outcome for readers of the stream, and
/// the next response's model is told the same result.
#[tokio::test]
async fn a_batch_a_failed_submission_left_uncommitted_is_settled_with_its_settlement() {
    let store = FaultyStore::default();
    store.fail_once(faulty::commits_a_tool_batch);
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("charge", json!({})),
        ScriptedReply::text("The last charge may not have gone through."),
    ]);
    let runtime = runtime(&store, &model, one_shot_billing);
    let handle = runtime.init(&one_shot_billing, "osb");
    let (error_type, submission_id) = match handle.send("charge me").await.unwrap_err() {
        RuntimeError::Run {
            error_type,
            submission_id,
            ..
        } => (error_type, submission_id),
        other => panic!("run error: {other}"),
    };
    assert_eq!(error_type, "submission_retry_exhausted");
    let key = InstanceKey::new("one_shot_billing", "osb");
    let batches = store.inner.read(&key, None).await.unwrap();
    let settlement = batches.last().expect("the settlement's batch");
    let kinds: Vec<_> = settlement
        .records
        .iter()
        .map(|record| {
            assert_eq!(record.submission_id.as_deref(), Some(submission_id.as_str()));
            match &record.body {
                RecordBody::ToolOutcome { is_error, content, .. } => {
                    assert!(*is_error);
                    assert_eq!(content, UNKNOWN);
                    "outcome"
                }
                RecordBody::ToolResultsCommitted { .. } => "committed",
                RecordBody::Signal { signal_type, .. } => signal_type.as_str(),
                RecordBody::SubmissionSettled { .. } => "settled",
                _ => "other",
            }
        })
        .collect();
    assert_eq!(kinds, ["outcome", "committed", "submission_interrupted", "settled"]);
    let reply = handle.send("did it work?").await.unwrap();
    assert_eq!(reply.text, "The last charge may not have gone through.");
    assert_eq!(
        harness::tool_results(&model.requests()[1]),
        [(UNKNOWN.to_owned(), true)]
    );
}

#[agent(durability(max_attempts = 1))]
fn one_shot_waiter() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("wait_forever").description("Waits for good.").run(
        |_ctx, _: serde_json::Map<String, serde_json::Value>| async {
            std::future::pending::<Result<&'static str, ToolError>>().await
        },
    ));
    "You wait."
}

/// The settlement repairs a batch from an up-to-date fold. An aborted submission settles its
/// open call; the next one's attempt fails to read the stream at its start (so its cached
/// fold still shows the call open) and settles failed: it reads the stream again before it
/// names any call uncommitted, and writes no second repair for the earlier submission's call.
#[tokio::test]
async fn a_settlement_after_a_failed_read_does_not_settle_an_earlier_submissions_batch_again() {
    use flue_runtime::events::Event;
    let store = FaultyStore::default();
    let model = ScriptedModel::new([ScriptedReply::tool_call("wait_forever", json!({}))]);
    let runtime = runtime(&store, &model, one_shot_waiter);
    let mut events = runtime.observe();
    let handle = runtime.init(&one_shot_waiter, "w");
    let first = handle.dispatch("wait").await.unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while !matches!(events.recv().await.unwrap().event, Event::ToolStart { .. }) {}
    })
    .await
    .expect("the tool runs");
    assert!(handle.abort().await.unwrap());
    handle.read(&first.submission_id).await.unwrap_err();
    store.failing_reads.store(1, Ordering::SeqCst);
    handle.send("and now?").await.unwrap_err();
    assert_eq!(
        store.failures.load(Ordering::SeqCst),
        1,
        "the second attempt's read failed"
    );
    let all = records(&store, &InstanceKey::new("one_shot_waiter", "w")).await;
    let repaired: Vec<_> = all
        .iter()
        .filter(|record| matches!(record.body, RecordBody::ToolOutcome { .. }))
        .map(|record| record.submission_id.as_deref().map(str::to_owned))
        .collect();
    assert_eq!(
        repaired,
        [Some(first.submission_id.clone())],
        "one repair, the aborted submission's"
    );
}

static STARTS: AtomicUsize = AtomicUsize::new(0);

#[agent]
fn onboarding() -> &'static str {
    use_model("scripted/x");
    let (_, set_seeded) = use_persistent_state("seeded", 0u32);
    use_agent_start(move |ctx| {
        let set_seeded = set_seeded.clone();
        async move {
            STARTS.fetch_add(1, Ordering::SeqCst);
            set_seeded.update(|n| n + 1)?;
            ctx.append(Signal::new("workspace", "Seeded the workspace."))?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        }
    });
    use_agent_start(|_ctx| async {
        STARTS.fetch_add(1, Ordering::SeqCst);
    });
    "You onboard customers."
}

#[tokio::test]
async fn a_failure_inside_a_start_seam_re_runs_every_start_callback_and_duplicates_no_durable_effect() {
    let store = FaultyStore::default();
    store.fail_once(|records| {
        records
            .iter()
            .any(|record| matches!(record.body, RecordBody::AgentStartRun))
    });
    let model = ScriptedModel::new([ScriptedReply::text("Welcome!")]);
    let runtime = runtime(&store, &model, onboarding);
    runtime.init(&onboarding, "o-1").send("hello").await.unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    assert_eq!(
        STARTS.load(Ordering::SeqCst),
        4,
        "both callbacks ran in each of the two attempts"
    );
    let all = records(&store, &InstanceKey::new("onboarding", "o-1")).await;
    let count = |predicate: fn(&RecordBody) -> bool| all.iter().filter(|record| predicate(&record.body)).count();
    assert_eq!(count(|body| matches!(body, RecordBody::AgentStartRun)), 1);
    assert_eq!(
        count(|body| matches!(body, RecordBody::Signal { signal_type, .. } if signal_type == "workspace")),
        1
    );
    let writes: Vec<_> = all
        .iter()
        .filter_map(|record| match &record.body {
            RecordBody::StateWrite { name, value } if name == "seeded" => Some(value.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(writes, [json!(1)], "the failed seam's write never happened");
    let messages = &model.requests()[0].messages;
    assert_eq!(
        messages.len(),
        2,
        "one user message and one appended signal: {messages:?}"
    );
}

/// The batches of an instance's stream, each as the kinds of its records.
async fn batch_kinds(store: &FaultyStore, key: &InstanceKey) -> Vec<Vec<&'static str>> {
    let kind = |body: &RecordBody| match body {
        RecordBody::UserMessage { .. } => "user",
        RecordBody::AgentStartRun => "seam",
        RecordBody::Signal { .. } => "signal",
        RecordBody::StateWrite { .. } => "state",
        _ => "other",
    };
    store
        .inner
        .read(key, None)
        .await
        .unwrap()
        .iter()
        .map(|batch| batch.records.iter().map(|record| kind(&record.body)).collect())
        .collect()
}

#[tokio::test]
async fn without_start_callbacks_the_seam_marker_commits_in_the_inputs_batch() {
    let store = FaultyStore::default();
    let model = ScriptedModel::new([ScriptedReply::text("Relayed.")]);
    let runtime = runtime(&store, &model, relay);
    runtime.init(&relay, "r-batch").send("hello").await.unwrap();
    let batches = batch_kinds(&store, &InstanceKey::new("relay", "r-batch")).await;
    assert!(
        batches.contains(&vec!["user", "seam"]),
        "input and seam marker share one batch: {batches:?}"
    );
}

#[agent]
fn greeter() -> &'static str {
    use_model("scripted/x");
    let (_, set_greeted) = use_persistent_state("greeted", false);
    use_agent_start(move |ctx| {
        let set_greeted = set_greeted.clone();
        async move {
            set_greeted.set(true)?;
            ctx.append(Signal::new("welcome", "A new visitor."))?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        }
    });
    "You greet visitors."
}

#[tokio::test]
async fn with_start_callbacks_the_input_is_durable_before_the_seam_runs() {
    let store = FaultyStore::default();
    let model = ScriptedModel::new([ScriptedReply::text("Welcome!")]);
    let runtime = runtime(&store, &model, greeter);
    runtime.init(&greeter, "g-batch").send("hello").await.unwrap();
    let batches = batch_kinds(&store, &InstanceKey::new("greeter", "g-batch")).await;
    let input = batches.iter().position(|batch| batch == &["user"]);
    let seam = batches.iter().position(|batch| batch == &["signal", "state", "seam"]);
    assert!(
        matches!((input, seam), (Some(input), Some(seam)) if input < seam),
        "the input commits alone, then the seam's appends, writes and marker: {batches:?}"
    );
}

#[agent(durability(max_attempts = 3))]
fn patient() -> &'static str {
    use_model("scripted/x");
    "x"
}

/// A store failure that lasts a moment (a database restarting) does not spend the attempt
/// budget at once: each re-attempt waits longer than the one before (`store_retry_delay`),
/// so the third attempt comes after the store is back, and the submission completes.
#[tokio::test]
async fn re_attempts_after_a_store_failure_wait_for_the_store_to_come_back() {
    let store = FaultyStore::default();
    let model = ScriptedModel::new([ScriptedReply::text("made it")]);
    let options = RuntimeOptions {
        store_retry_delay: std::time::Duration::from_millis(200),
        ..RuntimeOptions::default()
    };
    let runtime = harness::runtime_on_with(store.clone(), &model, [patient.into()], options);
    store.fail_always(|records| records.iter().any(|r| matches!(r.body, RecordBody::UserMessage { .. })));
    // The store is back 100 ms after its first refusal: before the second re-attempt, which
    // waits at least 150 + 300 ms.
    let healer = {
        let store = store.clone();
        tokio::spawn(async move {
            while store.failures.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            store.disarm();
        })
    };
    let reply = runtime.init(&patient, "p").send("hi").await.unwrap();
    healer.await.unwrap();
    assert_eq!(reply.text, "made it");
    let failures = store.failures.load(Ordering::SeqCst);
    assert!((1..=2).contains(&failures), "{failures} refused inputs");
}

/// The wait before a re-attempt after a store failure keeps the submission's lease: the
/// heartbeat renews it, so another node's scan does not take the submission over while it
/// waits (it would run it at once, spending the wait's point). The wait outlasts four leases
/// here; the waiting attempt still owns the submission when it ends, and gives it back to the
/// queue itself (a `deferred` recovery of it), which an attempt whose lease was taken over
/// cannot (it finds the submission another attempt's, and leaves it).
#[tokio::test]
async fn a_re_attempt_waiting_after_a_store_failure_keeps_its_lease_from_other_nodes() {
    use flue_runtime::events::{Event, RecoveryOperation, RecoveryOutcome};
    let store = FaultyStore::default();
    // Four leases of 200 ms.
    let wait = std::time::Duration::from_millis(800);
    let waiting_model = ScriptedModel::new([ScriptedReply::text("after the wait")]);
    let options = RuntimeOptions {
        store_retry_delay: wait,
        ..fast_scanning_options()
    };
    let waiting = harness::runtime_on_with(store.clone(), &waiting_model, [patient.into()], options);
    let mut events = waiting.observe();
    waiting.start().await;
    let other_model = ScriptedModel::new([ScriptedReply::text("taken over")]);
    let other = taking_over(&store, &other_model, patient).await;
    store.fail_once(|records| records.iter().any(|r| matches!(r.body, RecordBody::UserMessage { .. })));
    let receipt = waiting.init(&patient, "w").dispatch("hi").await.unwrap();
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        waiting.init(&patient, "w").read(&receipt.submission_id),
    )
    .await
    .expect("the submission settles")
    .unwrap();
    assert_eq!(
        store.failures.load(Ordering::SeqCst),
        1,
        "the first input's append failed"
    );
    // Either node may run the attempt after the wait: the waiting one requeued the submission.
    assert!(
        ["after the wait", "taken over"].contains(&reply.text.as_str()),
        "{}",
        reply.text
    );
    // The waiting attempt still owned the submission at the end of its wait.
    let is_deferral = |observation: &flue_runtime::events::Observation| {
        observation.submission_id.as_deref() == Some(receipt.submission_id.as_str())
            && matches!(
                &observation.event,
                Event::SubmissionRecovery {
                    operation: RecoveryOperation::ProcessSubmission,
                    outcome: RecoveryOutcome::Deferred,
                    ..
                }
            )
    };
    let deferral = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            let observation = events.recv().await.unwrap();
            if is_deferral(&observation) {
                break observation.event;
            }
        }
    })
    .await
    .expect("the waiting attempt gave the submission back to the queue itself");
    let Event::SubmissionRecovery {
        attempt_count, error, ..
    } = deferral
    else {
        unreachable!()
    };
    assert_eq!(attempt_count, Some(1), "the failed attempt's");
    let error = error.expect("the store failure it waited after");
    assert!(error.message.contains("injected append failure"), "{error:?}");
    let mut more = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if is_deferral(&observation) {
            more.push(observation);
        }
    }
    assert!(more.is_empty(), "one wait, one deferral: {more:?}");
    let row = store.submission(&receipt.submission_id).await.unwrap().unwrap();
    assert_eq!(row.attempt_count, 2, "the failed attempt and the one after its wait");
    assert_eq!(
        waiting_model.requests().len() + other_model.requests().len(),
        1,
        "one model call"
    );
    drop(other);
}

/// A wait after a store failure that no test outlasts: an hour, which the runtime caps at
/// 30 s (22.5 s at the least, with its jitter). A test that sees the submission settle, or
/// handed back, within its 10 s liveness bound saw the wait end early.
const WAIT_NO_TEST_OUTLASTS: std::time::Duration = std::time::Duration::from_secs(3600);

/// How long a test waits for what must happen (a liveness bound: it fails if it never does).
const LIVENESS: std::time::Duration = std::time::Duration::from_secs(10);

/// A runtime of `agent` whose re-attempts after a store failure wait longer than any test
/// (`WAIT_NO_TEST_OUTLASTS`), and whose store refuses the first input.
fn failing_the_first_input(model: &ScriptedModel, agent: impl Into<AgentRef>) -> (FaultyStore, Runtime) {
    let store = FaultyStore::default();
    let options = RuntimeOptions {
        store_retry_delay: WAIT_NO_TEST_OUTLASTS,
        ..RuntimeOptions::default()
    };
    let runtime = harness::runtime_on_with(store.clone(), model, [agent.into()], options);
    store.fail_once(|records| records.iter().any(|r| matches!(r.body, RecordBody::UserMessage { .. })));
    (store, runtime)
}

/// [`failing_the_first_input`], its submission (of `patient`) waiting after the failure.
async fn waiting_after_a_store_failure(model: &ScriptedModel) -> (FaultyStore, Runtime, String) {
    let (store, runtime) = failing_the_first_input(model, patient);
    let receipt = runtime.init(&patient, "w").dispatch("hi").await.unwrap();
    tokio::time::timeout(LIVENESS, async {
        while store.failures.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the first input's append failed");
    // Into the wait.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    (store, runtime, receipt.submission_id)
}

/// An abort requested while the submission waits to be re-attempted after a store failure
/// ends the wait: the submission settles aborted at once, not at the wait's end.
#[tokio::test]
async fn an_abort_during_the_wait_after_a_store_failure_settles_at_once() {
    let model = ScriptedModel::new([ScriptedReply::text("never")]);
    let (store, runtime, submission_id) = waiting_after_a_store_failure(&model).await;
    let handle = runtime.init(&patient, "w");
    assert!(handle.abort().await.unwrap());
    let settled = tokio::time::timeout(LIVENESS, handle.read(&submission_id))
        .await
        .expect("settled before the wait's end");
    assert!(
        matches!(&settled, Err(RuntimeError::Run { error_type, .. }) if error_type == "submission_aborted"),
        "{settled:?}"
    );
    assert!(model.requests().is_empty(), "no model call");
    let row = store.submission(&submission_id).await.unwrap().unwrap();
    assert_eq!(row.outcome, Some(Outcome::Aborted));
}

/// A node giving its work back (`release`) gives back a submission waiting to be re-attempted
/// after a store failure too, at once: another node takes it without waiting for its lease.
#[tokio::test]
async fn a_node_giving_its_work_back_gives_back_a_submission_waiting_after_a_store_failure() {
    let model = ScriptedModel::new([ScriptedReply::text("never")]);
    let (store, runtime, submission_id) = waiting_after_a_store_failure(&model).await;
    let released = tokio::time::timeout(LIVENESS, runtime.release())
        .await
        .expect("given back before the wait's end");
    assert_eq!(released, 1);
    let row = store.submission(&submission_id).await.unwrap().unwrap();
    assert_eq!(row.status, flue_runtime::store::SubmissionStatus::Queued);
    let next_model = ScriptedModel::new([ScriptedReply::text("taken over")]);
    let next = taking_over(&store, &next_model, patient).await;
    // Within the liveness bound: well before the given-back attempt's 30 s lease would lapse.
    let reply = tokio::time::timeout(LIVENESS, next.init(&patient, "w").read(&submission_id))
        .await
        .expect("taken over at once")
        .unwrap();
    assert_eq!(reply.text, "taken over");
}

#[agent(durability(max_attempts = 3, timeout = "500ms"))]
fn hurried() -> &'static str {
    use_model("scripted/x");
    "x"
}

/// A deadline that passes while the submission waits to be re-attempted after a store
/// failure settles it as timed out then, not at the wait's end.
#[tokio::test]
async fn a_deadline_passing_during_the_wait_after_a_store_failure_settles_it_then() {
    let model = ScriptedModel::new([ScriptedReply::text("never")]);
    let (store, runtime) = failing_the_first_input(&model, hurried);
    let handle = runtime.init(&hurried, "h");
    let settled = tokio::time::timeout(LIVENESS, handle.send("hi"))
        .await
        .expect("settled before the wait's end");
    assert!(
        matches!(&settled, Err(RuntimeError::Run { error_type, .. }) if error_type == "submission_timeout"),
        "{settled:?}"
    );
    assert_eq!(
        store.failures.load(Ordering::SeqCst),
        1,
        "the first input's append failed"
    );
    assert!(model.requests().is_empty());
}

/// A node shutting down does not wait out the wait either: the submission goes back to the
/// queue as it stops.
#[tokio::test]
async fn a_node_shutting_down_ends_the_wait_after_a_store_failure() {
    let model = ScriptedModel::new([ScriptedReply::text("never")]);
    let (store, runtime, submission_id) = waiting_after_a_store_failure(&model).await;
    runtime.shutdown();
    tokio::time::timeout(LIVENESS, async {
        while store.submission(&submission_id).await.unwrap().unwrap().status
            != flue_runtime::store::SubmissionStatus::Queued
        {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("back in the queue before the wait's end");
}

/// A lease lost during the wait after a store failure (its renewals failed past the lease,
/// and another node took the submission over) ends the wait: the instance is this node's to
/// run again at once, not at the wait's end, so what comes next for it runs here.
#[tokio::test]
async fn a_lease_lost_during_the_wait_after_a_store_failure_ends_the_wait() {
    let store = FaultyStore::default();
    let waiting_model = ScriptedModel::new([ScriptedReply::text("next, here")]);
    let options = RuntimeOptions {
        store_retry_delay: WAIT_NO_TEST_OUTLASTS,
        ..fast_scanning_options()
    };
    let waiting = harness::runtime_on_with(store.clone(), &waiting_model, [patient.into()], options);
    waiting.start().await;
    store.fail_once(|records| records.iter().any(|r| matches!(r.body, RecordBody::UserMessage { .. })));
    let receipt = waiting.init(&patient, "w").dispatch("hi").await.unwrap();
    tokio::time::timeout(LIVENESS, async {
        while store.failures.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the first input's append failed");
    let failed_attempt = store
        .submission(&receipt.submission_id)
        .await
        .unwrap()
        .unwrap()
        .attempt_id;
    // The lease lapses, and another node takes the submission over.
    store.failing_renewals.store(true, Ordering::SeqCst);
    let other_model = ScriptedModel::new([ScriptedReply::text("taken over")]);
    let other = taking_over(&store, &other_model, patient).await;
    tokio::time::timeout(LIVENESS, async {
        while store
            .submission(&receipt.submission_id)
            .await
            .unwrap()
            .unwrap()
            .attempt_id
            == failed_attempt
        {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("taken over");
    store.failing_renewals.store(false, Ordering::SeqCst);
    assert!(store.failures.load(Ordering::SeqCst) > 1, "renewals failed");
    let reply = tokio::time::timeout(LIVENESS, other.init(&patient, "w").read(&receipt.submission_id))
        .await
        .expect("the other node settles it")
        .unwrap();
    assert_eq!(reply.text, "taken over");
    other.shutdown();
    drop(other);
    // The waiting node learns at its next renewal that the lease is gone, and its wait ends.
    let next = tokio::time::timeout(LIVENESS, waiting.init(&patient, "w").send("again"))
        .await
        .expect("run here before the wait's end")
        .unwrap();
    assert_eq!(next.text, "next, here");
}

/// A budget no test spends while its waits keep their length: one that re-attempted at once
/// would spend hundreds of attempts in a moment.
#[agent(durability(max_attempts = 1000, timeout = "600ms"))]
fn hurried_unreadable() -> &'static str {
    use_model("scripted/x");
    "x"
}

/// A deadline already spent when the wait after a store failure begins does not shorten the
/// wait: an attempt that cannot read the stream past its deadline (so cannot settle it as
/// timed out) is made again a wait later, not at once, which would spend every attempt in a
/// moment while the store is down. Once the stream reads, the submission settles timed out.
#[tokio::test]
async fn the_wait_after_a_store_failure_keeps_its_length_past_a_spent_deadline() {
    let store = FaultyStore::default();
    let model = ScriptedModel::new([ScriptedReply::text("never")]);
    let options = RuntimeOptions {
        store_retry_delay: std::time::Duration::from_millis(400),
        ..RuntimeOptions::default()
    };
    let runtime = harness::runtime_on_with(store.clone(), &model, [hurried_unreadable.into()], options);
    store.fail_once(|records| records.iter().any(|r| matches!(r.body, RecordBody::UserMessage { .. })));
    let receipt = runtime.init(&hurried_unreadable, "h").dispatch("hi").await.unwrap();
    tokio::time::timeout(LIVENESS, async {
        while store.failures.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the first input's append failed");
    // From now on the stream cannot be read: the second attempt (300-400 ms on) waits until
    // the deadline (600 ms from the admission), the third, past it, 1.2-1.6 s, and the fourth
    // 2.4-3.2 s: a fifth attempt comes 4.2 s after the admission at the earliest, so the look
    // below finds at most four even 3 s late (a loaded machine), where attempts made at once
    // past the deadline would be hundreds.
    store.failing_reads.store(usize::MAX, Ordering::SeqCst);
    tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
    let row = store.submission(&receipt.submission_id).await.unwrap().unwrap();
    assert!(
        row.attempt_count <= 4,
        "{} attempts soon after the first failure",
        row.attempt_count
    );
    store.failing_reads.store(0, Ordering::SeqCst);
    let settled = tokio::time::timeout(
        LIVENESS,
        runtime.init(&hurried_unreadable, "h").read(&receipt.submission_id),
    )
    .await
    .expect("settled once the stream reads");
    assert!(
        matches!(&settled, Err(RuntimeError::Run { error_type, .. }) if error_type == "submission_timeout"),
        "{settled:?}"
    );
    assert!(model.requests().is_empty());
}

#[agent(durability(max_attempts = 2))]
fn fragile() -> &'static str {
    use_model("scripted/x");
    "x"
}

/// Reference §3.9 step 4 and the `submission_interrupted` error: a budget spent before any
/// attempt applied the input settles as an interruption before input, not as retry
/// exhaustion.
#[tokio::test]
async fn a_budget_spent_before_the_input_was_applied_settles_as_interrupted_before_input() {
    let store = FaultyStore::default();
    let model = ScriptedModel::echo();
    let runtime = runtime(&store, &model, fragile);
    store.fail_always(|records| records.iter().any(|r| matches!(r.body, RecordBody::UserMessage { .. })));
    let error = runtime.init(&fragile, "f-input").send("hi").await.unwrap_err();
    assert_eq!(store.failures.load(Ordering::SeqCst), 2, "one failed input per attempt");
    let RuntimeError::Run {
        error_type,
        message,
        meta,
        ..
    } = error
    else {
        panic!("run error")
    };
    assert_eq!(error_type, "submission_interrupted");
    assert_eq!(
        message,
        "Submission was repeatedly interrupted before input application and exhausted its retry budget."
    );
    assert_eq!(
        meta.map(|meta| serde_json::Value::Object(*meta)),
        Some(json!({"phase": "retry_exhausted_before_input", "attemptCount": 2, "maxAttempts": 2}))
    );
    assert!(model.requests().is_empty(), "no model call started");
}

#[tokio::test]
async fn repeated_store_failures_exhaust_the_attempt_budget() {
    let store = FaultyStore::default();
    let model = ScriptedModel::echo();
    let runtime = runtime(&store, &model, fragile);
    store.fail_always(|records| {
        records
            .iter()
            .any(|r| matches!(r.body, RecordBody::AssistantMessageStarted { .. }))
    });
    let error = runtime.init(&fragile, "f").send("hi").await.unwrap_err();
    assert_eq!(store.failures.load(Ordering::SeqCst), 2, "one failed step per attempt");
    let RuntimeError::Run {
        error_type,
        message,
        meta,
        ..
    } = error
    else {
        panic!("run error")
    };
    assert_eq!(error_type, "submission_retry_exhausted");
    assert_eq!(message, "Submission exceeded maximum recovery attempts (2/2).");
    assert_eq!(
        meta.map(|meta| serde_json::Value::Object(*meta)),
        Some(json!({"attemptCount": 2, "maxAttempts": 2}))
    );
}

#[agent(durability(max_attempts = 2))]
fn fragile_billing() -> &'static str {
    use_model("scripted/x");
    use_tool(
        Tool::new("charge")
            .description("Charge the card.")
            .run(|_ctx, _: serde_json::Map<String, serde_json::Value>| async { "charged" }),
    );
    "You bill customers."
}

/// Reference §3.9 step 4 and §6.2: a budget that runs out on a tool batch that never
/// committed names its calls, whose outcomes nobody knows, in the error (`interruptedTools`)
/// and in the `submission_interrupted` advisory the settlement leaves for the model.
#[tokio::test]
async fn a_budget_spent_on_an_uncommitted_tool_batch_names_its_calls_in_the_error_and_the_advisory() {
    let store = FaultyStore::default();
    // Every batch of a call that ran fails (the re-attempt's repair of the first, which ran
    // nothing, commits).
    store.fail_always(|records| {
        records
            .iter()
            .any(|record| matches!(record.body, RecordBody::ToolOutcome { is_error: false, .. }))
    });
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("charge", json!({})),
        ScriptedReply::tool_call("charge", json!({})),
    ]);
    let runtime = runtime(&store, &model, fragile_billing);
    let error = runtime
        .init(&fragile_billing, "fb")
        .send("charge me")
        .await
        .unwrap_err();
    assert_eq!(store.failures.load(Ordering::SeqCst), 2, "one failed batch per attempt");
    let RuntimeError::Run {
        error_type,
        message,
        meta,
        submission_id,
        ..
    } = error
    else {
        panic!("run error")
    };
    assert_eq!(error_type, "submission_retry_exhausted");
    assert_eq!(message, "Submission exceeded maximum recovery attempts (2/2).");
    // The second attempt's call (the model's second call made it).
    assert_eq!(
        meta.map(|meta| serde_json::Value::Object(*meta)),
        Some(json!({"attemptCount": 2, "maxAttempts": 2, "interruptedTools": [{"name": "charge", "id": "call_2_0"}]}))
    );
    let all = records(&store, &InstanceKey::new("fragile_billing", "fb")).await;
    let at = all
        .iter()
        .position(|record| record.id == format!("record_submission_interrupted_{submission_id}"))
        .expect("the advisory");
    let RecordBody::Signal {
        signal_type,
        body,
        attributes,
        ..
    } = &all[at].body
    else {
        panic!("a signal: {:?}", all[at])
    };
    assert_eq!(signal_type, "submission_interrupted");
    assert_eq!(
        body,
        "Submission exceeded maximum recovery attempts (2/2).\n\nInterrupted tool call(s):\n  - charge (call_2_0)"
    );
    assert_eq!(attributes["reason"], "exhausted_retry_budget");
    assert_eq!(attributes["kind"], "direct");
    assert_eq!(attributes["interruptedTools"], r#"[{"id":"call_2_0","name":"charge"}]"#);
    assert!(matches!(
        all[at + 1].body,
        RecordBody::SubmissionSettled {
            outcome: Outcome::Failed,
            ..
        }
    ));
}

/// Reference §3.9 step 4: a budget spent before any attempt applied the input leaves the
/// advisory too (`reason: interrupted_before_input_marker`), though the model never saw the
/// submission.
#[tokio::test]
async fn a_budget_spent_before_the_input_was_applied_leaves_an_interrupted_advisory() {
    let store = FaultyStore::default();
    let model = ScriptedModel::echo();
    let runtime = runtime(&store, &model, fragile);
    let inputs = AtomicUsize::new(0);
    // Each attempt's input fails; then the store heals for the advisory and the settlement.
    store.fail_always(move |records| {
        records.iter().any(|r| matches!(r.body, RecordBody::UserMessage { .. }))
            && inputs.fetch_add(1, Ordering::SeqCst) < 2
    });
    let error = runtime.init(&fragile, "f-advised").send("hi").await.unwrap_err();
    let RuntimeError::Run {
        error_type,
        submission_id,
        ..
    } = error
    else {
        panic!("run error")
    };
    assert_eq!(error_type, "submission_interrupted");
    let all = records(&store, &InstanceKey::new("fragile", "f-advised")).await;
    let advisory = all
        .iter()
        .find(|record| record.id == format!("record_submission_interrupted_{submission_id}"))
        .expect("the advisory");
    let RecordBody::Signal { attributes, .. } = &advisory.body else {
        panic!("a signal")
    };
    assert_eq!(attributes["reason"], "interrupted_before_input_marker");
    // No input was applied: the advisory alone does not make one.
    assert!(
        !all.iter()
            .any(|record| matches!(record.body, RecordBody::UserMessage { .. }))
    );
    // The next submission runs as usual, reading the advisory before its input.
    let reply = runtime.init(&fragile, "f-advised").send("again").await.unwrap();
    assert_eq!(reply.text, "You said: again");
    let requests = model.requests();
    let ModelMessage::User { content, .. } = &requests[0].messages[requests[0].messages.len() - 2] else {
        panic!("the advisory before the input")
    };
    assert!(
        content.starts_with("<signal type=\"submission_interrupted\""),
        "{content}"
    );
}

#[agent]
fn relay() -> &'static str {
    use_model("scripted/x");
    "Relay."
}

/// Reference §7.3: an assistant `message_start` is followed by its `message_end`, also when
/// the step's completion could not be stored (the attempt fails, and the next one answers).
/// (Regression: the failed commit returned before the step's `message_end`.)
#[tokio::test]
async fn an_assistant_message_whose_completion_was_not_stored_still_ends() {
    use flue_runtime::events::Event;
    let store = FaultyStore::default();
    store.fail_once(|records| {
        records
            .iter()
            .any(|record| matches!(record.body, RecordBody::AssistantMessageCompleted { .. }))
    });
    let model = ScriptedModel::new([ScriptedReply::text("lost"), ScriptedReply::text("answered")]);
    let runtime = runtime(&store, &model, relay);
    let mut events = runtime.observe();
    let reply = runtime.init(&relay, "r-commit").send("hello").await.unwrap();
    assert_eq!(reply.text, "answered");
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            Event::MessageStart {
                message: ModelMessage::Assistant { .. },
            } => seen.push("start"),
            Event::MessageEnd {
                message: ModelMessage::Assistant { .. },
            } => seen.push("end"),
            _ => {}
        }
    }
    assert_eq!(seen, ["start", "end", "start", "end"]);
}

/// How many times `lookup` ran.
static LOOKUPS: AtomicUsize = AtomicUsize::new(0);

/// Looks it up (counted in `LOOKUPS`).
#[tool]
async fn lookup() -> String {
    LOOKUPS.fetch_add(1, Ordering::SeqCst);
    "found".into()
}

#[agent]
fn looking_up_relay() -> &'static str {
    use_model("scripted/x");
    use_tool(lookup);
    "Relay, looking things up."
}

/// The calls a step announced (`tool_call_started`) end (`tool_call_done`, an error) when the
/// step could not be stored: they will not run, and thread-event readers are not left showing
/// them running. (Had the step been stored, its call would have run and ended a success.)
#[tokio::test]
async fn the_calls_of_a_step_that_was_not_stored_are_done() {
    use flue_runtime::events::Event;
    let store = FaultyStore::default();
    store.fail_once(|records| {
        records
            .iter()
            .any(|record| matches!(record.body, RecordBody::AssistantMessageCompleted { .. }))
    });
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("lookup", json!({})),
        ScriptedReply::text("answered"),
    ]);
    let runtime = runtime(&store, &model, looking_up_relay);
    let mut events = runtime.observe();
    let reply = runtime.init(&looking_up_relay, "r-calls").send("hello").await.unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1, "the step's commit failed");
    assert_eq!(reply.text, "answered");
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            Event::ToolCallStarted { tool_name, .. } => seen.push(format!("started {tool_name}")),
            Event::ToolCallDone { tool_name, status, .. } => seen.push(format!("done {tool_name} {status}")),
            _ => {}
        }
    }
    assert_eq!(seen, ["started lookup", "done lookup error"]);
    assert_eq!(LOOKUPS.load(Ordering::SeqCst), 0, "the call never ran");
    let outcomes: Vec<_> = records(&store, &InstanceKey::new("looking_up_relay", "r-calls"))
        .await
        .into_iter()
        .filter(|record| matches!(record.body, RecordBody::ToolOutcome { .. }))
        .collect();
    assert!(
        outcomes.is_empty(),
        "no outcome for a call of no stored step: {outcomes:?}"
    );
}

#[tokio::test]
async fn a_submission_held_by_a_dead_node_is_taken_over_after_its_lease_expires() {
    use flue_runtime::store::{Claim, now_ms};
    let store = FaultyStore::default();
    let model = ScriptedModel::new([ScriptedReply::text("taken over")]);
    // Another node admitted and claimed the submission, then died: its lease runs out.
    let key = InstanceKey::new("relay", "r-1");
    let admitted = store
        .admit(harness::admission(&key, "sub_dead_node", "hello"))
        .await
        .unwrap();
    let dead = Claim {
        attempt_id: "attempt_dead".into(),
        owner_id: "owner_dead".into(),
        lease_until_ms: now_ms() + 100,
    };
    let claimed = store.claim_next(&key, &dead).await.unwrap().unwrap();
    assert_eq!(claimed.id, admitted.submission.id);
    let runtime = taking_over(&store, &model, relay).await;
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runtime.init(&relay, "r-1").read("sub_dead_node"),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(reply.text, "taken over");
    let row = store.submission("sub_dead_node").await.unwrap().unwrap();
    assert_eq!(row.attempt_count, 2, "the dead attempt and the takeover");
    assert_ne!(row.owner_id.as_deref(), Some("owner_dead"));
    assert_eq!(model.requests().len(), 1, "exactly once");
}

/// Reference §3.9 step 4: a takeover that finds the attempt budget spent settles the
/// submission as it is, without an attempt: observers see its settlement, and no
/// `submission_running` (with an attempt count past the budget) nor an operation or agent
/// start and end for an attempt that never ran.
#[tokio::test]
async fn a_takeover_that_finds_the_budget_spent_settles_without_an_attempts_events() {
    use flue_runtime::events::Event;
    use flue_runtime::store::{Claim, now_ms};
    let store = FaultyStore::default();
    let model = ScriptedModel::new([]);
    let key = InstanceKey::new("relay", "r-spent");
    let mut admission = harness::admission(&key, "sub_spent", "hello");
    admission.max_attempts = 1;
    store.admit(admission).await.unwrap();
    let dead = Claim {
        attempt_id: "attempt_dead".into(),
        owner_id: "owner_dead".into(),
        lease_until_ms: now_ms() + 100,
    };
    store.claim_next(&key, &dead).await.unwrap().unwrap();
    let runtime = fast_scanning(&store, &model, relay);
    let mut events = runtime.observe();
    runtime.start().await;
    let error = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runtime.init(&relay, "r-spent").read("sub_spent"),
    )
    .await
    .unwrap()
    .unwrap_err();
    let RuntimeError::Run { error_type, .. } = error else {
        panic!("a run error")
    };
    assert_eq!(error_type, "submission_interrupted");
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if observation.submission_id.as_deref() != Some("sub_spent") {
            continue;
        }
        match observation.event {
            Event::SubmissionRunning { .. } => seen.push("submission_running"),
            Event::OperationStart { .. } => seen.push("operation_start"),
            Event::AgentStart => seen.push("agent_start"),
            Event::AgentEnd { .. } => seen.push("agent_end"),
            Event::Operation { .. } => seen.push("operation"),
            Event::Idle => seen.push("idle"),
            Event::SubmissionSettled { .. } => seen.push("submission_settled"),
            _ => {}
        }
    }
    assert_eq!(seen, ["submission_settled"]);
    assert!(model.requests().is_empty());
}

/// Reference §3.9 step 10: "Resolve interrupted joins (record exists ⇒ finalize; else
/// revert), then apply queued joins". A node claimed a delivery into its response and died
/// before the delivery's input was saved; the node that takes the response over puts the
/// join back in the queue first, so it joins ahead of a delivery admitted after it.
#[tokio::test]
async fn a_join_cut_off_before_its_input_was_saved_rejoins_in_order_after_a_takeover() {
    use flue_runtime::store::{AttemptRef, Claim, now_ms};
    let store = FaultyStore::default();
    let model = ScriptedModel::new([ScriptedReply::text("all three answered")]);
    let key = InstanceKey::new("relay", "r-join");
    store
        .admit(harness::admission(&key, "sub_host", "first"))
        .await
        .unwrap();
    let dead = Claim {
        attempt_id: "attempt_dead".into(),
        owner_id: "owner_dead".into(),
        lease_until_ms: now_ms() + 100,
    };
    store.claim_next(&key, &dead).await.unwrap().unwrap();
    store
        .admit(harness::admission(&key, "sub_cut_off", "second"))
        .await
        .unwrap();
    let host = AttemptRef {
        submission_id: "sub_host".into(),
        attempt_id: "attempt_dead".into(),
    };
    let joined = store.claim_joinable(&host).await.unwrap();
    assert_eq!(joined.len(), 1, "the dead node claimed the delivery into its response");
    // Admitted after the claim: it must not overtake the cut-off join.
    store
        .admit(harness::admission(&key, "sub_later", "third"))
        .await
        .unwrap();
    let runtime = taking_over(&store, &model, relay).await;
    let handle = runtime.init(&relay, "r-join");
    let reply = tokio::time::timeout(std::time::Duration::from_secs(10), handle.read("sub_host"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reply.text, "all three answered");
    let users = harness::user_texts(&model.requests()[0]);
    assert_eq!(users, ["first", "second", "third"], "deliveries in admission order");
    for id in ["sub_cut_off", "sub_later"] {
        let row = store.submission(id).await.unwrap().unwrap();
        assert_eq!(
            (row.joined_into.as_deref(), row.outcome),
            (Some("sub_host"), Some(Outcome::Completed)),
            "{id}"
        );
    }
    assert_eq!(model.requests().len(), 1);
}

static SEAMS_RUN: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// The tests reading [`SEAMS_RUN`] run one at a time.
static SEAMS_SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[agent]
fn seam_keeper() -> &'static str {
    use_model("scripted/x");
    use_agent_start(|ctx| {
        let body = ctx.delivery().body().to_owned();
        async move {
            SEAMS_RUN.lock().unwrap().push(body);
        }
    });
    "Greet."
}

/// What a dead node left: the host `sub_host` ("first") claimed by `attempt_dead` with its
/// input and start seam saved, and `sub_joined` ("second") claimed into it with only its
/// input saved (its `use_agent_start` seam never ran). The host may run `max_attempts`.
async fn a_join_cut_off_before_its_seam(store: &FaultyStore, key: &InstanceKey, max_attempts: u32) {
    use flue_runtime::store::now_ms;
    let mut host_admission = harness::admission(key, "sub_host", "first");
    host_admission.max_attempts = max_attempts;
    store.admit(host_admission).await.unwrap();
    let dead = Claim {
        attempt_id: "attempt_dead".into(),
        owner_id: "owner_dead".into(),
        lease_until_ms: now_ms() + 100,
    };
    store.claim_next(key, &dead).await.unwrap().unwrap();
    store
        .admit(harness::admission(key, "sub_joined", "second"))
        .await
        .unwrap();
    let host = AttemptRef {
        submission_id: "sub_host".into(),
        attempt_id: "attempt_dead".into(),
    };
    assert_eq!(store.claim_joinable(&host).await.unwrap().len(), 1);
    let record = |submission: &str, body: RecordBody| Record {
        id: format!("record_{}", ulid_like()),
        submission_id: Some(submission.into()),
        attempt_id: Some("attempt_dead".into()),
        timestamp: "2026-11-30T00:00:00.000Z".into(),
        body,
    };
    let user = |id: &str, body: &str| RecordBody::UserMessage {
        message_id: id.into(),
        body: body.into(),
        attachments: Vec::new(),
    };
    for batch in [
        vec![record("sub_host", user("m1", "first"))],
        vec![record("sub_host", RecordBody::AgentStartRun)],
        vec![record("sub_joined", user("m2", "second"))],
    ] {
        store.append(key, batch.into(), Some(&host)).await.unwrap();
    }
}

/// [`a_join_cut_off_before_its_seam`] on instance `id` of a fresh store, with `max_attempts`,
/// then a runtime taking it over (its model scripted to answer `answer`) and reading the host
/// submission's reply. Callers hold `SEAMS_SERIAL`.
async fn a_cut_off_join_taken_over(
    id: &str,
    max_attempts: u32,
    answer: &str,
) -> (FaultyStore, ScriptedModel, Result<AgentReply, RuntimeError>) {
    let store = FaultyStore::default();
    let model = ScriptedModel::new([ScriptedReply::text(answer)]);
    a_join_cut_off_before_its_seam(&store, &InstanceKey::new("seam_keeper", id), max_attempts).await;
    SEAMS_RUN.lock().unwrap().clear();
    let runtime = taking_over(&store, &model, seam_keeper).await;
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runtime.init(&seam_keeper, id).read("sub_host"),
    )
    .await
    .unwrap();
    (store, model, read)
}

/// A node joined a delivery into its response, saved the delivery's input and died before
/// the delivery's `use_agent_start` seam ran. The node that takes the response over runs
/// the seam: the join is put back and rejoins, its input already in place.
#[tokio::test]
async fn a_join_cut_off_between_its_input_and_its_start_seam_runs_the_seam_after_a_takeover() {
    let _serial = SEAMS_SERIAL.lock().await;
    let (store, model, read) = a_cut_off_join_taken_over("g-join", 10, "both answered").await;
    let reply = read.unwrap();
    assert_eq!(reply.text, "both answered");
    assert_eq!(
        *SEAMS_RUN.lock().unwrap(),
        ["second"],
        "the joined delivery's seam ran, once"
    );
    let users = harness::user_texts(&model.requests()[0]);
    assert_eq!(users, ["first", "second"], "the input is not saved twice");
    let row = store.submission("sub_joined").await.unwrap().unwrap();
    assert_eq!(
        (row.joined_into.as_deref(), row.outcome),
        (Some("sub_host"), Some(Outcome::Completed))
    );
    assert_eq!(model.requests().len(), 1);
}

/// The same cut-off join, taken over by an attempt the budget does not allow: the response
/// ends there, and the join settles with it (as the reference's "record exists ⇒ finalize")
/// instead of going back to the queue for a run of its own.
#[tokio::test]
async fn a_join_cut_off_before_its_seam_settles_with_a_response_out_of_attempts() {
    let _serial = SEAMS_SERIAL.lock().await;
    let (store, model, read) = a_cut_off_join_taken_over("g-spent", 1, "never asked").await;
    let error = read.unwrap_err();
    assert!(error.to_string().contains("attempt"), "{error}");
    let row = store.submission("sub_joined").await.unwrap().unwrap();
    assert_eq!(
        (row.joined_into.as_deref(), row.outcome),
        (Some("sub_host"), Some(Outcome::Failed)),
        "settled with its host"
    );
    assert!(SEAMS_RUN.lock().unwrap().is_empty());
    assert!(model.requests().is_empty());
}

/// A store where a first node answered `agent`'s instance `instance` (submission
/// `sub_answered`, its final answer "the answer" durable) and died before settling it.
async fn answered_but_unsettled(agent: &str, instance: &str) -> FaultyStore {
    use flue_runtime::store::{Claim, now_ms};
    let store = FaultyStore::default();
    // First node: answers, then its settlement append fails and the node dies before retrying.
    store.fail_always(|records| {
        records
            .iter()
            .any(|r| matches!(r.body, RecordBody::SubmissionSettled { .. }))
    });
    let key = InstanceKey::new(agent, instance);
    let admitted = store
        .admit(Admission {
            key: key.clone(),
            submission_id: "sub_answered".into(),
            keyed: false,
            kind: flue_runtime::store::SubmissionKind::Dispatch,
            message: DeliveredMessage::user("question"),
            initial_data: None,
            uid: flue_runtime::store::UidCondition::Any,
            max_attempts: 10,
            timeout_ms: 3_600_000,
            claim: None,
            trace: None,
        })
        .await
        .unwrap();
    let _ = admitted;
    // Simulate the first node's durable progress: input and final answer committed, unsettled.
    let first = Claim {
        attempt_id: "attempt_one".into(),
        owner_id: "owner_one".into(),
        lease_until_ms: now_ms() + 50,
    };
    store.claim_next(&key, &first).await.unwrap().unwrap();
    let auth = AttemptRef {
        submission_id: "sub_answered".into(),
        attempt_id: "attempt_one".into(),
    };
    let record = |body: RecordBody| Record {
        id: format!("record_{}", ulid_like()),
        submission_id: Some("sub_answered".into()),
        attempt_id: Some("attempt_one".into()),
        timestamp: "2026-11-30T00:00:00.000Z".into(),
        body,
    };
    store
        .append(
            &key,
            vec![record(RecordBody::UserMessage {
                message_id: "m1".into(),
                body: "question".into(),
                attachments: Vec::new(),
            })]
            .into(),
            Some(&auth),
        )
        .await
        .unwrap();
    store
        .append(&key, vec![record(RecordBody::AgentStartRun)].into(), Some(&auth))
        .await
        .unwrap();
    store
        .append(
            &key,
            vec![
                record(RecordBody::AssistantMessageStarted {
                    message_id: "m2".into(),
                    model: "scripted/x".into(),
                    turn_id: None,
                    response_metadata: None,
                }),
                record(RecordBody::AssistantMessageCompleted {
                    message_id: "m2".into(),
                    text: "the answer".into(),
                    reasoning: String::new(),
                    stop_reason: flue_runtime::provider::StopReason::Stop,
                    usage: Default::default(),
                    reasoning_blocks: Vec::new(),
                }),
            ]
            .into(),
            Some(&auth),
        )
        .await
        .unwrap();
    store.disarm();
    store
}

#[tokio::test]
async fn a_resumed_response_that_already_answered_settles_without_calling_the_model_again() {
    let store = answered_but_unsettled("relay", "r-2").await;
    let model = ScriptedModel::new([ScriptedReply::text("the answer")]);
    let runtime = fast_scanning(&store, &model, relay);
    let mut events = runtime.observe();
    runtime.start().await;
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runtime.init(&relay, "r-2").read("sub_answered"),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(reply.text, "the answer");
    assert!(model.requests().is_empty(), "completed work is never redone");
    // It settles without an attempt (§3.9 step 2): none of an attempt's events.
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if observation.submission_id.as_deref() == Some("sub_answered") {
            seen.push(
                serde_json::to_value(&observation.event).unwrap()["type"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
            );
        }
    }
    assert_eq!(seen, ["submission_settled"]);
}

/// A sandbox host that is down.
struct DownSandbox;

impl flue_core::sandbox::SandboxFactory for DownSandbox {
    fn create_sandbox(
        &self,
        _instance_id: &str,
    ) -> flue_core::BoxFuture<
        'static,
        Result<std::sync::Arc<dyn flue_core::sandbox::Sandbox>, flue_core::sandbox::SandboxError>,
    > {
        Box::pin(async { Err(flue_core::sandbox::SandboxError::Io("the sandbox host is down".into())) })
    }
}

#[agent]
fn relay_with_resources() -> &'static str {
    use_model("scripted/x");
    use_sandbox(DownSandbox);
    use_mcp_connection(flue_runtime::mcp::McpConnection::new("docs", "http://127.0.0.1:9/mcp"));
    "Relay."
}

/// Reference §3.9 step 2: a resumed response whose answer is durable settles `completed`
/// as it is. It needs no sandbox or MCP server, so one that cannot be had does not fail it.
#[tokio::test]
async fn a_resumed_response_that_already_answered_sets_up_no_sandbox_or_mcp_server() {
    let store = answered_but_unsettled("relay_with_resources", "r-3").await;
    let model = ScriptedModel::new([]);
    let runtime = taking_over(&store, &model, relay_with_resources).await;
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runtime.init(&relay_with_resources, "r-3").read("sub_answered"),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(reply.text, "the answer");
    assert!(model.requests().is_empty());
}

fn ulid_like() -> u64 {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    NEXT.fetch_add(1, Ordering::SeqCst) as u64
}

#[tokio::test]
async fn a_send_dropped_after_its_admission_committed_a_claim_leaves_the_submission_to_a_worker() {
    let store = FaultyStore::default();
    *store.hang_after_admit.lock().unwrap() = Some("armed".into());
    let model = ScriptedModel::new([ScriptedReply::text("Relayed.")]);
    let runtime = runtime(&store, &model, relay);
    let handle = runtime.init(&relay, "r-dropped");
    // The admission (with the sender's claim) commits; the sender is dropped before its reply.
    let dropped = tokio::time::timeout(std::time::Duration::from_millis(200), handle.send("hello")).await;
    assert!(dropped.is_err());
    let submission_id = store.hang_after_admit.lock().unwrap().clone().unwrap();
    let reply = tokio::time::timeout(std::time::Duration::from_secs(10), handle.read(&submission_id))
        .await
        .expect("a worker ran the submission the dropped sender had claimed")
        .unwrap();
    assert_eq!(reply.text, "Relayed.");
}

/// A send whose claiming admission committed but whose answer was lost (the store says
/// `Other`: outcome unknown) fails to its caller, and gives the claim back and wakes the
/// instance: the submission runs now, not once its lease (30 s) lapsed and a scan took it.
#[tokio::test]
async fn a_send_whose_admission_answer_was_lost_runs_its_committed_submission_at_once() {
    let store = FaultyStore::default();
    *store.lose_admit_answer.lock().unwrap() = Some("armed".into());
    let model = ScriptedModel::new([ScriptedReply::text("Relayed.")]);
    let runtime = runtime(&store, &model, relay);
    let handle = runtime.init(&relay, "r-lost");
    let error = handle.send("hello").await.expect_err("the store's answer was lost");
    assert!(
        error.to_string().contains("injected admission answer failure"),
        "{error}"
    );
    assert_eq!(store.failures.load(Ordering::SeqCst), 1, "the fault fired");
    let submission_id = store.lose_admit_answer.lock().unwrap().clone().unwrap();
    assert_ne!(submission_id, "armed");
    // Well inside the lease: only the given-back claim and the wake-up can run it this soon.
    let reply = tokio::time::timeout(std::time::Duration::from_secs(10), handle.read(&submission_id))
        .await
        .expect("the committed submission ran at once, not after its lease lapsed")
        .unwrap();
    assert_eq!(reply.text, "Relayed.");
    assert_eq!(model.requests().len(), 1, "it ran once");
}

/// Reference §7: a submission is `submission_queued` before it is `submission_running`. The
/// worker that claims a delivery can run it the moment its admission commits, on another
/// thread than the dispatch still waiting for the store's answer: the worker then announces
/// it first, and the dispatch, answered, does not announce it again.
#[tokio::test]
async fn a_delivery_run_before_its_dispatch_heard_back_is_announced_queued_first_and_once() {
    assert_eq!(
        delivery_events_with_its_admission_answer_held(false).await,
        ["queued", "running", "settled"]
    );
}

/// A dispatch dropped after its admission committed (its caller gone) announced nothing: the
/// worker that runs the delivery announces it.
#[tokio::test]
async fn a_delivery_whose_dispatch_was_dropped_after_the_commit_is_still_announced_queued() {
    assert_eq!(
        delivery_events_with_its_admission_answer_held(true).await,
        ["queued", "running", "settled"]
    );
}

/// The delivery's `submission_*` events, in order, when its dispatch's admission commits
/// while a response runs and the store's answer is held until the delivery has run (or the
/// dispatch is dropped first).
async fn delivery_events_with_its_admission_answer_held(drop_dispatch: bool) -> Vec<&'static str> {
    let store = FaultyStore::default();
    let scripted = ScriptedModel::new([
        ScriptedReply::text("first answer"),
        ScriptedReply::text("the follow-up is answered"),
    ]);
    let gated = Gated::new(scripted.clone(), 1);
    let (reached, release) = (gated.reached.clone(), gated.release.clone());
    let mut providers = ProviderRegistry::new();
    providers.register(gated);
    let runtime = Runtime::builder()
        .agent(relay)
        .providers(providers)
        .store(store.clone())
        .build()
        .unwrap();
    let mut events = runtime.observe();
    let handle = runtime.init(&relay, "announced");
    let sender = handle.clone();
    let host = tokio::spawn(async move { sender.send("question").await });
    reached.notified().await;
    // The delivery's admission commits, and its answer is held back.
    store.holding_admits.store(true, Ordering::SeqCst);
    let dispatcher = handle.clone();
    let dispatch = tokio::spawn(async move { dispatcher.dispatch("follow-up").await });
    while store.admitted.load(Ordering::SeqCst) < 2 {
        tokio::task::yield_now().await;
    }
    if drop_dispatch {
        dispatch.abort();
    }
    release.add_permits(1);
    let host = tokio::time::timeout(std::time::Duration::from_secs(10), host)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(host.text, "first answer");
    let name = |event: &flue_runtime::events::Event| match event {
        flue_runtime::events::Event::SubmissionQueued { .. } => Some("queued"),
        flue_runtime::events::Event::SubmissionRunning { .. } => Some("running"),
        flue_runtime::events::Event::SubmissionSettled { .. } => Some("settled"),
        _ => None,
    };
    let mut seen: Vec<(String, &'static str)> = Vec::new();
    // The settlement left the delivery's row queued: a worker runs it while its dispatch
    // waits (or after it was dropped).
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    let delivery = loop {
        let observation = tokio::time::timeout_at(deadline, events.recv())
            .await
            .expect("the delivery runs while its dispatch waits for the store")
            .unwrap();
        if let (Some(event), Some(id)) = (name(&observation.event), observation.submission_id) {
            seen.push((id.to_string(), event));
            if event == "settled" && *id != *host.submission_id {
                break id.to_string();
            }
        }
    };
    if !drop_dispatch {
        assert!(
            !dispatch.is_finished(),
            "the dispatch still waits for its admission's answer"
        );
        store.admits_released.add_permits(1);
        let receipt = dispatch.await.unwrap().unwrap();
        assert_eq!(receipt.submission_id, delivery);
        while let Ok(observation) = events.try_recv() {
            if let (Some(event), Some(id)) = (name(&observation.event), observation.submission_id) {
                seen.push((id.to_string(), event));
            }
        }
    }
    let reply = handle.read(&delivery).await.unwrap();
    assert_eq!(reply.text, "the follow-up is answered");
    seen.into_iter()
        .filter(|(id, _)| *id == delivery)
        .map(|(_, event)| event)
        .collect()
}

// ---- joins, resumes and the finish phase (reference §3, §8) ------------------------------

/// Fails the `n`-th batch (1-based) that carries an `assistant_message_started`.
fn nth_step_batch(n: usize) -> impl Fn(&[Record]) -> bool + Send + 'static {
    let seen = AtomicUsize::new(0);
    move |records: &[Record]| {
        records
            .iter()
            .any(|r| matches!(r.body, RecordBody::AssistantMessageStarted { .. }))
            && seen.fetch_add(1, Ordering::SeqCst) + 1 == n
    }
}

#[agent]
fn follow_upper() -> &'static str {
    use_model("scripted/x");
    let dispatch = use_dispatch_message();
    use_tool(harness::dispatching(
        Tool::new("follow_up").description("Queue a follow-up."),
        dispatch,
        "follow-up",
    ));
    "Plan."
}

/// Reference §3.7 step 10 "Resolve interrupted joins (record exists ⇒ finalize; else
/// revert)", step 14 "Settle joined deliveries (each its own `submission_settled` under host
/// attempt), then host"; §3.8 "they are settled through the outbox before the host (so HTTP
/// waiters see a record), with the store fan-out as a backstop"; §7.3 "plus their own
/// … `submission_settled`".
#[tokio::test]
async fn a_delivery_joined_by_an_earlier_attempt_settles_with_its_own_record_and_event() {
    let store = FaultyStore::default();
    // The step after the join fails once: the host is re-attempted from what is durable.
    store.fail_once(nth_step_batch(2));
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("follow_up", json!({})),
        ScriptedReply::text("lost with the failed attempt"),
        ScriptedReply::text("answered"),
    ]);
    let runtime = runtime(&store, &model, follow_upper);
    let mut events = runtime.observe();
    let host = runtime.init(&follow_upper, "j-1").send("plan").await.unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    let mut queued = Vec::new();
    let mut settled = Vec::new();
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            flue_runtime::events::Event::SubmissionQueued { .. } => queued.push(observation.submission_id.unwrap()),
            flue_runtime::events::Event::SubmissionSettled { .. } => settled.push(observation.submission_id.unwrap()),
            _ => {}
        }
    }
    let delivery = queued.iter().find(|id| **id != host.submission_id).unwrap().clone();
    let row = store.submission(&delivery).await.unwrap().unwrap();
    assert_eq!(row.joined_into.as_deref(), Some(host.submission_id.as_str()));
    assert_eq!(row.outcome, Some(Outcome::Completed));
    let all = records(&store, &InstanceKey::new("follow_upper", "j-1")).await;
    let has_record = all.iter().any(|record| {
        matches!(record.body, RecordBody::SubmissionSettled { .. })
            && record.submission_id.as_deref() == Some(delivery.as_str())
    });
    assert!(
        has_record,
        "the joined delivery's submission_settled record is in the stream"
    );
    assert!(
        settled.contains(&delivery),
        "the joined delivery's submission_settled event was published: {settled:?}"
    );
}

/// A host whose re-attempt ends before its response runs (an abort requested while no attempt
/// ran it) still settles the deliveries an earlier attempt joined, each with its own record,
/// event and answer to whoever waits for it (reference §3.7 step 14).
#[tokio::test]
async fn a_delivery_joined_by_an_earlier_attempt_settles_when_the_re_attempt_is_aborted_before_it_runs() {
    use flue_runtime::events::Event;
    let store = FaultyStore::default();
    // The step after the join fails and so does the requeue: the attempt is abandoned, its
    // lease lapses, and nothing takes it over until this test starts the scan.
    store.fail_once(nth_step_batch(2));
    store.failing_requeues.store(1, Ordering::SeqCst);
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("follow_up", json!({})),
        ScriptedReply::text("lost with the failed attempt"),
    ]);
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    let runtime = Runtime::builder()
        .agent(follow_upper)
        .providers(providers)
        .store(store.clone())
        .options(RuntimeOptions {
            lease: std::time::Duration::from_millis(100),
            heartbeat: std::time::Duration::from_millis(20),
            scan_interval: std::time::Duration::from_secs(3600),
            ..RuntimeOptions::default()
        })
        .build()
        .unwrap();
    let mut events = runtime.observe();
    let handle = runtime.init(&follow_upper, "j-abort");
    let sender = handle.clone();
    let host = tokio::spawn(async move { sender.send("plan").await });
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while store.failures.load(Ordering::SeqCst) < 2 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the step's append and the requeue fail");
    let key = InstanceKey::new("follow_upper", "j-abort");
    let mut delivery = None;
    for record in records(&store, &key).await {
        let Some(id) = record.submission_id else { continue };
        let row = store.submission(&id).await.unwrap().unwrap();
        if row.joined_into.is_some() {
            delivery = Some(id.to_string());
            break;
        }
    }
    let delivery = delivery.expect("the follow-up joined the host");
    // Someone waits for the joined delivery from before its host settles.
    let reader = handle.clone();
    let waited = delivery.clone();
    let joined = tokio::spawn(async move { reader.read(&waited).await });
    assert!(handle.abort().await.unwrap());
    // The abandoned attempt's lease lapses; the scan takes the host over.
    tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    runtime.start().await;
    harness::assert_settles_aborted(host).await;
    let joined = tokio::time::timeout(std::time::Duration::from_secs(10), joined)
        .await
        .expect("whoever waits for the joined delivery is answered")
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(
            &joined,
            RuntimeError::Run {
                outcome: "was aborted",
                ..
            }
        ),
        "{joined}"
    );
    let all = records(&store, &key).await;
    assert!(
        all.iter()
            .any(|record| matches!(record.body, RecordBody::SubmissionSettled { .. })
                && record.submission_id.as_deref() == Some(delivery.as_str())),
        "the joined delivery's submission_settled record is in the stream"
    );
    let mut settled = Vec::new();
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        let kind = match &observation.event {
            Event::SubmissionRunning { .. } => "submission_running",
            Event::OperationStart { .. } => "operation_start",
            Event::AgentStart => "agent_start",
            Event::AgentEnd { .. } => "agent_end",
            Event::Operation { .. } => "operation",
            Event::Idle => "idle",
            _ => "other",
        };
        seen.push((observation.submission_id.clone(), kind));
        if let Event::SubmissionSettled { outcome, .. } = observation.event {
            settled.push((observation.submission_id.unwrap(), outcome));
        }
    }
    let host_id = settled
        .iter()
        .find(|(id, _)| *id != delivery)
        .map(|(id, _)| id.clone())
        .expect("the host settled");
    assert!(
        settled.contains(&(delivery.clone(), Outcome::Aborted)),
        "the joined delivery's submission_settled event was published: {settled:?}"
    );
    // Reference §3.7 step 1: the re-attempt found the abort before it ran. It is reported
    // running, then settles: it starts no operation, so no agent_start/agent_end, operation or
    // idle (the first attempt's operation is the host's only one).
    let per_host = |kind: &str| {
        seen.iter()
            .filter(|(submission, event)| submission.as_deref() == Some(host_id.as_str()) && *event == kind)
            .count()
    };
    assert_eq!(per_host("submission_running"), 2, "{seen:?}");
    assert_eq!(
        (
            per_host("operation_start"),
            per_host("agent_start"),
            per_host("agent_end"),
            per_host("operation"),
            per_host("idle")
        ),
        (1, 1, 1, 1, 1),
        "{seen:?}"
    );
}

/// Reference §3.4 "on resume `hasPendingSteeredContinuation` detects a durably steered but
/// unanswered tail (walk back from leaf: a joined entry … before any assistant) and drives the
/// continuation turn"; §3.3 the joined input is durable. A delivery that joined at the
/// would-stop phase after the host's final answer must still be answered after a re-attempt.
#[tokio::test]
async fn a_delivery_joined_after_the_final_answer_is_answered_after_a_re_attempt() {
    let store = FaultyStore::default();
    // The continuation step (the one answering the joined delivery) fails once.
    store.fail_once(nth_step_batch(2));
    let scripted = ScriptedModel::new([
        ScriptedReply::text("first answer"),
        ScriptedReply::text("lost with the failed attempt"),
        ScriptedReply::text("the follow-up is answered"),
    ]);
    let gated = Gated::new(scripted.clone(), 1);
    let (reached, release) = (gated.reached.clone(), gated.release.clone());
    let mut providers = ProviderRegistry::new();
    providers.register(gated);
    let runtime = Runtime::builder()
        .agent(relay)
        .providers(providers)
        .store(store.clone())
        .options(RuntimeOptions {
            model_retry_delay: std::time::Duration::from_millis(1),
            ..RuntimeOptions::default()
        })
        .build()
        .unwrap();
    let handle = runtime.init(&relay, "late-join");
    let sender = handle.clone();
    let host = tokio::spawn(async move { sender.send("question").await });
    reached.notified().await;
    // Admitted while the host's final step streams: it joins at the would-stop phase.
    let delivery = handle.dispatch("follow-up").await.unwrap();
    release.add_permits(1);
    let host = tokio::time::timeout(std::time::Duration::from_secs(10), host)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    let row = store.submission(&delivery.submission_id).await.unwrap().unwrap();
    assert_eq!(
        row.joined_into.as_deref(),
        Some(host.submission_id.as_str()),
        "the follow-up joined"
    );
    let requests = scripted.requests();
    assert_eq!(
        requests.len(),
        3,
        "the re-attempt drives the continuation turn for the joined follow-up"
    );
    assert_eq!(host.text, "first answer\n\nthe follow-up is answered");
}

#[agent]
fn looker() -> &'static str {
    use_model("scripted/x");
    use_tool(
        Tool::new("look")
            .description("Look it up.")
            .run(|_ctx, _: serde_json::Map<String, serde_json::Value>| async { "found" }),
    );
    "Look things up."
}

/// A joined delivery is answered by its host's whole response: also by the steps an earlier
/// attempt of the host committed before the attempt that joined the delivery.
#[tokio::test]
async fn a_delivery_joined_by_a_re_attempt_reads_the_hosts_whole_reply() {
    let store = FaultyStore::default();
    // The host's second step fails once: its first step stays, a re-attempt answers.
    store.fail_once(nth_step_batch(2));
    let scripted = ScriptedModel::new([
        ScriptedReply::ToolCalls {
            text: "Looking it up.".to_owned(),
            calls: vec![("look".to_owned(), "{}".to_owned())],
        },
        ScriptedReply::text("lost with the failed attempt"),
        ScriptedReply::text("Found it."),
    ]);
    let gated = Gated::new(scripted.clone(), 2);
    let (reached, release) = (gated.reached.clone(), gated.release.clone());
    let mut providers = ProviderRegistry::new();
    providers.register(gated);
    let runtime = Runtime::builder()
        .agent(looker)
        .providers(providers)
        .store(store.clone())
        .options(RuntimeOptions {
            model_retry_delay: std::time::Duration::from_millis(1),
            ..RuntimeOptions::default()
        })
        .build()
        .unwrap();
    let handle = runtime.init(&looker, "rejoin");
    let sender = handle.clone();
    let host = tokio::spawn(async move { sender.send("Where is order 7?").await });
    reached.notified().await;
    // Admitted while the host's second step streams; that step's batch then fails.
    let delivery = handle.dispatch("And order 8?").await.unwrap();
    release.add_permits(1);
    let host = tokio::time::timeout(std::time::Duration::from_secs(10), host)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    assert_eq!(host.text, "Looking it up.\n\nFound it.");
    let row = store.submission(&delivery.submission_id).await.unwrap().unwrap();
    assert_eq!(row.joined_into.as_deref(), Some(host.submission_id.as_str()));
    let joined = handle.read(&delivery.submission_id).await.unwrap();
    assert_eq!(joined.text, host.text);
}

/// Hand over to a person.
#[tool(terminate)]
async fn hand_off(
    /// Why
    reason: String,
) -> String {
    format!("Handed off: {reason}")
}

#[agent]
fn handoff_desk() -> &'static str {
    use_model("scripted/x");
    use_tool(hand_off);
    use_response_finish(|_ctx| json!({"handed_off": true}));
    "Hand off."
}

/// Reference §8.20 "a complete trailing tool batch that unanimously `terminate`s is
/// `completed` (no further turn)"; §3.9 step 2 "`completed` ⇒ settle"; §8.10 completed work
/// is never redone.
#[tokio::test]
async fn a_re_attempt_after_a_committed_terminating_batch_calls_no_model() {
    let store = FaultyStore::default();
    // The response-finish batch (after the terminating batch committed) fails once.
    store.fail_once(|records| {
        records
            .iter()
            .any(|r| matches!(r.body, RecordBody::MessageMetadata { .. }))
    });
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("hand_off", json!({"reason": "asked"})),
        ScriptedReply::text("a turn after a terminating batch"),
    ]);
    let runtime = runtime(&store, &model, handoff_desk);
    runtime
        .init(&handoff_desk, "h-1")
        .send("a person please")
        .await
        .unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    assert_eq!(model.requests().len(), 1, "completed work is never redone");
}

#[agent(max_steps = 2)]
fn looper() -> &'static str {
    use_model("scripted/x");
    use_tool(
        Tool::new("again")
            .description("Go again.")
            .run(|_ctx, _: serde_json::Map<String, serde_json::Value>| async { "again" }),
    );
    "Loop."
}

/// Reference (standard-agents §… `maxSteps` "at most N steps per turn"; DESIGN §4 "`max_steps`
/// caps it"): the step budget belongs to the response, so a re-attempt that resumes the same
/// response must not get a fresh budget.
#[tokio::test]
async fn max_steps_caps_a_response_across_its_attempts() {
    let store = FaultyStore::default();
    // The second step's tool batch fails once: the re-attempt resumes after step 2.
    let seen = AtomicUsize::new(0);
    store.fail_once(move |records| {
        records
            .iter()
            .any(|r| matches!(r.body, RecordBody::ToolResultsCommitted { .. }))
            && seen.fetch_add(1, Ordering::SeqCst) + 1 == 2
    });
    let model = ScriptedModel::new((0..6).map(|_| ScriptedReply::tool_call("again", json!({}))));
    let runtime = runtime(&store, &model, looper);
    runtime.init(&looper, "l-1").send("go").await.unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    let steps = records(&store, &InstanceKey::new("looper", "l-1"))
        .await
        .iter()
        .filter(|r| matches!(r.body, RecordBody::AssistantMessageStarted { .. }))
        .count();
    assert_eq!(steps, 2, "max_steps = 2 durable model steps in the response");
}

/// Writes the audit trail.
#[tool]
async fn audit() -> String {
    "audited".into()
}

/// Looks it up, and queues an audit of the lookup.
#[tool]
async fn audited_look(ctx: &ToolContext) -> Result<String, ToolError> {
    ctx.thread()
        .unwrap()
        .queue_tool(audit, json!({}))
        .map_err(|error| ToolError::new(error.to_string()))?;
    Ok("found".into())
}

#[agent(max_steps = 2)]
fn audited_looker() -> &'static str {
    use_model("scripted/x");
    use_tool(audited_look);
    "Look things up."
}

/// The step budget counts model steps: the step that runs calls queued with `queue_tool` is
/// none, live or read back by a re-attempt.
#[tokio::test]
async fn a_re_attempt_counts_only_model_steps_against_max_steps() {
    let store = FaultyStore::default();
    // Batches that start a step: model step 1, the queued calls' step, model step 2 (failed).
    store.fail_once(nth_step_batch(3));
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("audited_look", json!({})),
        ScriptedReply::text("lost with the failed attempt"),
        ScriptedReply::text("Found it."),
    ]);
    let runtime = runtime(&store, &model, audited_looker);
    let reply = runtime
        .init(&audited_looker, "a-1")
        .send("Where is order 7?")
        .await
        .unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    assert_eq!(
        model.requests().len(),
        3,
        "the re-attempt still has its second model step"
    );
    assert_eq!(reply.text, "Found it.");
}

/// Standard Agents §2.1 `queueTool` (durable: accepted work is never lost): calls a tool
/// queued are recorded with the batch that queued them. An attempt that dies before running
/// them leaves them an open batch that the re-attempt settles (outcome unknown, the call not
/// durable), where they were lost with the attempt.
#[tokio::test]
async fn a_call_queued_by_a_tool_is_recorded_with_its_batch_and_not_lost_with_the_attempt() {
    let store = FaultyStore::default();
    // The append after the batch that committed the queuing call's outcome fails.
    let armed = std::sync::atomic::AtomicBool::new(false);
    store.fail_once(move |records: &[Record]| {
        if armed.load(Ordering::SeqCst) {
            return true;
        }
        if records.iter().any(
            |record| matches!(&record.body, RecordBody::ToolOutcome { tool_name, .. } if tool_name == "audited_look"),
        ) {
            armed.store(true, Ordering::SeqCst);
        }
        false
    });
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("audited_look", json!({})),
        ScriptedReply::text("Found it."),
    ]);
    let runtime = runtime(&store, &model, audited_looker);
    let reply = runtime
        .init(&audited_looker, "a-2")
        .send("Where is order 8?")
        .await
        .unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    assert_eq!(reply.text, "Found it.");
    let all = records(&store, &InstanceKey::new("audited_looker", "a-2")).await;
    let audit_calls: Vec<&str> = all
        .iter()
        .filter_map(|record| match &record.body {
            RecordBody::AssistantToolCall { tool_call_id, name, .. } if name == "audit" => Some(tool_call_id.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(audit_calls.len(), 1, "the queued call is in the stream");
    let outcomes = all
        .iter()
        .filter(|record| matches!(&record.body, RecordBody::ToolOutcome { tool_call_id, .. } if tool_call_id == audit_calls[0]))
        .count();
    assert_eq!(outcomes, 1, "and settled once");
    assert!(
        model.requests()[1]
            .messages
            .iter()
            .any(|message| matches!(message, ModelMessage::Tool { name, .. } if name == "audit")),
        "the model reads its result"
    );
}

/// Repeat the text.
#[tool]
async fn echo(
    /// The text
    text: String,
) -> String {
    text
}

#[agent]
fn origin_stamper() -> &'static str {
    use_model("scripted/x");
    use_tool(echo);
    use_response_start(|_| json!({"origin": "web"}));
    use_response_finish(|ctx| {
        json!({
            "saw_origin": ctx.metadata.get("origin") == Some(&json!("web")),
            "tool_calls": ctx.response.tool_calls.iter().map(|call| call.tool.clone()).collect::<Vec<_>>(),
        })
    });
    "Echo."
}

/// Reference §3.4: "`useResponseStart` runs only when no durable assistant step exists for the
/// submission; its metadata becomes durable only via the first `assistant_message_started`" —
/// and the finish callbacks of a resumed response read it back from there.
#[tokio::test]
async fn a_resumed_response_finishes_with_the_start_metadata_its_first_step_recorded() {
    let store = FaultyStore::default();
    // Step 2's batch fails once: the response resumes with a durable first step.
    store.fail_once(nth_step_batch(2));
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("echo", json!({"text": "hi"})),
        ScriptedReply::text("lost with the failed attempt"),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime(&store, &model, origin_stamper);
    let reply = runtime.init(&origin_stamper, "o-1").send("go").await.unwrap();
    assert_eq!(
        (reply.text.as_str(), store.failures.load(Ordering::SeqCst)),
        ("done", 1)
    );
    let all = records(&store, &InstanceKey::new("origin_stamper", "o-1")).await;
    let finish: Vec<_> = all
        .iter()
        .filter_map(|record| match &record.body {
            RecordBody::MessageMetadata { metadata } => Some(metadata.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(finish.len(), 1);
    assert_eq!(finish[0].get("saw_origin"), Some(&json!(true)), "{finish:?}");
    // The response's tool calls, the earlier attempt's included (derived from the durable
    // records, as the reference's aggregates are).
    assert_eq!(finish[0].get("tool_calls"), Some(&json!(["echo"])), "{finish:?}");
    let started_with_metadata = all
        .iter()
        .filter(|record| {
            matches!(
                &record.body,
                RecordBody::AssistantMessageStarted {
                    response_metadata: Some(_),
                    ..
                }
            )
        })
        .count();
    assert_eq!(started_with_metadata, 1, "only the response's first step carries it");
}

/// The stream an attempt that died mid-response left of the submission `submission` of `key`
/// (admitted with the message "question"): the attempt's claim, its lease lapsing in 50 ms,
/// and its `batches` appended as its records, the first of them holding the input ("m1").
async fn dead_attempt_left(store: &FaultyStore, key: &InstanceKey, submission: &str, batches: Vec<Vec<RecordBody>>) {
    use flue_runtime::store::now_ms;
    store
        .admit(harness::admission(key, submission, "question"))
        .await
        .unwrap();
    let dead = Claim {
        attempt_id: "attempt_dead".into(),
        owner_id: "owner_dead".into(),
        lease_until_ms: now_ms() + 50,
    };
    store.claim_next(key, &dead).await.unwrap().unwrap();
    let auth = AttemptRef {
        submission_id: submission.into(),
        attempt_id: "attempt_dead".into(),
    };
    for batch in batches {
        let records: Vec<Record> = batch
            .into_iter()
            .map(|body| Record {
                id: format!("record_{}", ulid_like()),
                submission_id: Some(submission.into()),
                attempt_id: Some("attempt_dead".into()),
                timestamp: "2026-11-30T00:00:00.000Z".into(),
                body,
            })
            .collect();
        store.append(key, records.into(), Some(&auth)).await.unwrap();
    }
}

/// The dead attempt's input batch of [`dead_attempt_left`]: the message, and its run's start.
fn dead_attempt_input() -> Vec<RecordBody> {
    vec![
        RecordBody::UserMessage {
            message_id: "m1".into(),
            body: "question".into(),
            attachments: Vec::new(),
        },
        RecordBody::AgentStartRun,
    ]
}

#[agent]
fn stamped_relay() -> &'static str {
    use_model("scripted/x");
    use_response_finish(|_ctx| json!({"stamped": true}));
    "Relay."
}

/// Reference §3.4 "External side effects in callbacks may repeat; durable effects never
/// duplicate"; §3.9 step 2 "`completed` ⇒ settle joined + host `completed`": an attempt that
/// died after its response-finish batch committed (before settling) is settled, not finished
/// a second time.
#[tokio::test]
async fn a_resumed_answered_response_does_not_append_its_finish_metadata_twice() {
    let store = FaultyStore::default();
    let model = ScriptedModel::new([]);
    let key = InstanceKey::new("stamped_relay", "s-1");
    // The dead attempt's durable progress: input + seam, the final answer, the finish batch.
    let batches = vec![
        dead_attempt_input(),
        vec![
            RecordBody::AssistantMessageStarted {
                message_id: "m2".into(),
                model: "scripted/x".into(),
                turn_id: None,
                response_metadata: None,
            },
            RecordBody::AssistantMessageCompleted {
                message_id: "m2".into(),
                text: "the answer".into(),
                reasoning: String::new(),
                stop_reason: flue_runtime::provider::StopReason::Stop,
                usage: Default::default(),
                reasoning_blocks: Vec::new(),
            },
        ],
        vec![RecordBody::MessageMetadata {
            metadata: serde_json::from_value(json!({"stamped": true})).unwrap(),
        }],
    ];
    dead_attempt_left(&store, &key, "sub_stamped", batches).await;
    let runtime = taking_over(&store, &model, stamped_relay).await;
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runtime.init(&stamped_relay, "s-1").read("sub_stamped"),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(reply.text, "the answer");
    let metadata = records(&store, &key)
        .await
        .iter()
        .filter(|r| matches!(r.body, RecordBody::MessageMetadata { .. }))
        .count();
    assert_eq!(metadata, 1, "the response-finish batch is durable once");
}

/// A call whose step is durable but which never ran (its attempt died after storing the step:
/// a crash, a store failure) ends for thread-event readers when the next attempt settles its
/// batch with the outcome-unknown result: `tool_call_done`, in error (they were left showing it
/// running).
#[tokio::test]
async fn a_call_settled_outcome_unknown_by_a_takeover_is_done() {
    use flue_runtime::events::Event;
    let store = FaultyStore::default();
    let model = ScriptedModel::new([ScriptedReply::text("could not look it up")]);
    let key = InstanceKey::new("relay", "r-unknown");
    // The dead attempt's durable progress: its input, then a step calling `lookup`.
    let batches = vec![
        dead_attempt_input(),
        vec![
            RecordBody::AssistantMessageStarted {
                message_id: "m2".into(),
                model: "scripted/x".into(),
                turn_id: Some("turn_1".into()),
                response_metadata: None,
            },
            RecordBody::AssistantToolCall {
                message_id: "m2".into(),
                tool_call_id: "call_lookup".into(),
                name: "lookup".into(),
                arguments: "{}".into(),
            },
            RecordBody::AssistantMessageCompleted {
                message_id: "m2".into(),
                text: String::new(),
                reasoning: String::new(),
                stop_reason: flue_runtime::provider::StopReason::ToolUse,
                usage: Default::default(),
                reasoning_blocks: Vec::new(),
            },
        ],
    ];
    dead_attempt_left(&store, &key, "sub_unknown", batches).await;
    let runtime = fast_scanning(&store, &model, relay);
    let mut events = runtime.observe();
    runtime.start().await;
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runtime.init(&relay, "r-unknown").read("sub_unknown"),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(reply.text, "could not look it up");
    let mut done = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let Event::ToolCallDone {
            tool_call_id, status, ..
        } = observation.event
        {
            done.push((tool_call_id, status));
        }
    }
    assert_eq!(done, [("call_lookup".to_owned(), "error".to_owned())]);
}

#[agent]
fn tallied() -> &'static str {
    use_model("scripted/x");
    let (_, responses) = use_persistent_state("responses", 0u32);
    use_response_finish(move |_ctx| responses.update(|count| count + 1));
    "Relay."
}

/// Reference §3.4 "durable effects never duplicate": a finish callback that writes state and
/// contributes no metadata commits its batch all the same; the re-attempt after a failed
/// settlement finds that batch and does not run the callback (and its write) again.
#[tokio::test]
async fn a_finish_batch_of_state_writes_alone_is_not_made_again_by_a_re_attempt() {
    let reply = finish_once_after_a_failed_settlement(tallied, ScriptedReply::text("the answer")).await;
    assert_eq!(reply.text, "the answer");
}

/// Sends to `agent` (whose finish callback counts responses in state) with `reply` scripted and
/// the first settlement failing, and checks the re-attempt did not run the callback again.
async fn finish_once_after_a_failed_settlement(
    agent: impl flue_core::Agent + Copy + Into<AgentRef>,
    reply: ScriptedReply,
) -> flue_runtime::AgentReply {
    let store = FaultyStore::default();
    store.fail_once(faulty::settles);
    let model = ScriptedModel::new([reply]);
    let runtime = taking_over(&store, &model, agent).await;
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runtime.init(&agent, "t-1").send("question"),
    )
    .await
    .expect("the submission settles")
    .unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1, "the first settlement failed");
    let name = agent.definition().name.to_string();
    let writes: Vec<serde_json::Value> = records(&store, &InstanceKey::new(name, "t-1"))
        .await
        .into_iter()
        .filter_map(|record| match record.body {
            RecordBody::StateWrite { name, value } if name == "responses" => Some(value),
            _ => None,
        })
        .collect();
    assert_eq!(writes, [json!(1)], "the finish callback's write is durable once");
    assert_eq!(model.requests().len(), 1);
    reply
}

/// Takes a note.
#[tool]
async fn note() -> String {
    "noted".into()
}

#[agent(max_steps = 1)]
fn tallied_short() -> &'static str {
    use_model("scripted/x");
    use_tool(note);
    let (_, responses) = use_persistent_state("responses", 0u32);
    use_response_finish(move |_ctx| responses.update(|count| count + 1));
    "Note."
}

/// The same for a response its step budget ended after a tool batch, with no final answer:
/// the re-attempt settles it as it is (completed, without text), without running the finish
/// callback again or calling the model.
#[tokio::test]
async fn a_finish_batch_of_a_response_without_a_final_answer_is_not_made_again_by_a_re_attempt() {
    let reply = finish_once_after_a_failed_settlement(tallied_short, ScriptedReply::tool_call("note", json!({}))).await;
    assert_eq!(reply.text, "", "no final answer");
}

// ---- the delivery cursor and data writes ---------------------------------------------------

#[agent]
fn cursor() -> String {
    use_model("scripted/x");
    use_agent_start(|ctx| async move {
        ctx.append(Signal::new("profile", "The user prefers short answers."))?;
        Ok::<_, flue_runtime::event_hooks::AppendError>(())
    });
    format!("In front: {}", use_delivery().body())
}

/// Reference §1 row 26 / hooks docs `useDelivery()`: "Crash-safe: a resumed attempt derives
/// the same cursor from the durable record stream the live attempt saw" (`restoreDeliveryCursor`).
#[tokio::test]
async fn a_resumed_attempt_restores_the_delivery_cursor_from_the_stream() {
    let store = FaultyStore::default();
    store.fail_once(nth_step_batch(1));
    let model = ScriptedModel::new([ScriptedReply::text("lost"), ScriptedReply::text("answered")]);
    let runtime = runtime(&store, &model, cursor);
    runtime.init(&cursor, "c-1").send("go").await.unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    let requests = model.requests();
    assert_eq!(requests.len(), 2);
    for request in &requests {
        let system = request.system.as_deref().unwrap_or_default();
        assert!(
            system.contains("In front: The user prefers short answers."),
            "the cursor stays on the appended signal: {system}"
        );
    }
}

static STREAMED_STORE: std::sync::OnceLock<FaultyStore> = std::sync::OnceLock::new();

#[agent]
fn streamer() -> &'static str {
    use_model("scripted/x");
    let progress = use_data_writer::<u32>("progress");
    use_tool(
        Tool::new("work")
            .description("Work.")
            .run(move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
                let progress = progress.clone();
                async move {
                    progress.write(&1)?;
                    let store = STREAMED_STORE.get().unwrap();
                    let key = InstanceKey::new("streamer", "s-1");
                    for _ in 0..100 {
                        let all = records(store, &key).await;
                        if all
                            .iter()
                            .any(|r| matches!(r.body, RecordBody::MessageDataWrite { .. }))
                        {
                            return Ok::<_, ToolError>("streamed");
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    }
                    Ok::<_, ToolError>("not streamed")
                }
            }),
    );
    "Work."
}

/// Reference §1 row 28 / `useDataWriter()`: "Each write is appended durably and streamed to
/// clients immediately, so a part can show live progress mid-tool-run"; §3.3 item 8 "one
/// batch per write"; §8 item 25 (buffered only until the first completed step).
#[tokio::test]
async fn a_data_write_mid_tool_run_is_durable_before_the_tool_returns() {
    let store = STREAMED_STORE.get_or_init(FaultyStore::default).clone();
    let model = ScriptedModel::new([ScriptedReply::tool_call("work", json!({})), ScriptedReply::text("done")]);
    let runtime = runtime(&store, &model, streamer);
    let mut events = runtime.observe();
    let reply = runtime.init(&streamer, "s-1").send("go").await.unwrap();
    assert_eq!(reply.data["progress"], json!(1));
    // The durable write is observed, once.
    assert_eq!(observed_data_parts(&mut events), [json!(1)]);
    let tool_result = model.requests()[1]
        .messages
        .iter()
        .find_map(|m| match m {
            ModelMessage::Tool { content, .. } => Some(content.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(tool_result, "streamed");
    // One batch per write: the data write is not folded into the tool batch.
    let batches = store
        .inner
        .read(&InstanceKey::new("streamer", "s-1"), None)
        .await
        .unwrap();
    let data_batch = batches
        .iter()
        .find(|b| {
            b.records
                .iter()
                .any(|r| matches!(r.body, RecordBody::MessageDataWrite { .. }))
        })
        .unwrap();
    assert_eq!(data_batch.records.len(), 1);
}

static FINISHED_USAGE: Mutex<Option<flue_runtime::usage::Usage>> = Mutex::new(None);

#[agent]
fn metered() -> &'static str {
    use_model("scripted/x");
    use_tool(
        Tool::new("look")
            .description("Look.")
            .run(|_ctx, _: serde_json::Map<String, serde_json::Value>| async { "seen" }),
    );
    use_response_finish(|ctx| {
        *FINISHED_USAGE.lock().unwrap() = Some(ctx.response.usage);
    });
    "Look, then answer."
}

/// Reference agent-hooks `useResponseFinish` ("its `response.usage` and `response.toolCalls`
/// aggregates are final") with `useAgentFinish` ("aggregates every tool call the response has
/// made — across all turns and re-attempts, derived from durable records"), §3.2
/// (`assistant_message_completed` carries each step's `usage`): the usage a response-finish
/// callback reads counts every durable step of the response, the ones an earlier attempt made
/// included.
#[tokio::test]
async fn response_finish_usage_counts_the_steps_of_earlier_attempts() {
    let store = FaultyStore::default();
    // The first step's tool batch fails once: the re-attempt resumes after step 1.
    store.fail_once(faulty::commits_a_tool_batch);
    let model = ScriptedModel::new([ScriptedReply::tool_call("look", json!({})), ScriptedReply::text("done")]);
    let runtime = runtime(&store, &model, metered);
    runtime.init(&metered, "m-1").send("go").await.unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    assert_eq!(model.requests().len(), 2, "the re-attempt did not repeat step 1");
    let durable = records(&store, &InstanceKey::new("metered", "m-1"))
        .await
        .into_iter()
        .fold(flue_runtime::usage::Usage::default(), |mut sum, r| {
            if let RecordBody::AssistantMessageCompleted { usage, .. } = r.body {
                sum += usage;
            }
            sum
        });
    assert_eq!(durable.input_tokens, 20, "two durable steps");
    assert_eq!(*FINISHED_USAGE.lock().unwrap(), Some(durable));
}

/// The data parts `observe()` delivered, in order.
fn observed_data_parts(
    events: &mut tokio::sync::broadcast::Receiver<flue_runtime::events::Observation>,
) -> Vec<serde_json::Value> {
    let mut parts = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let flue_runtime::events::Event::DataPart { data, .. } = observation.event {
            parts.push(data);
        }
    }
    parts
}

static CRUNCHED: tokio::sync::Notify = tokio::sync::Notify::const_new();

#[agent]
fn thread_writer() -> &'static str {
    use_model("scripted/x");
    let progress = use_data_writer::<u32>("progress");
    use_tool(Tool::new("crunch").description("Crunch on a thread of its own.").run(
        move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
            let progress = progress.clone();
            async move {
                // Written from a plain thread, which has no tokio runtime.
                std::thread::spawn(move || progress.write(&7)).join().unwrap().unwrap();
                // Ends only once the write was observed live.
                CRUNCHED.notified().await;
                "crunched"
            }
        },
    ));
    "Crunch."
}

/// Reference item 28 (each write "durably appended and streamed immediately"): a data write
/// made on a thread without a tokio runtime (a tool's own `std::thread`) streams while the
/// tool still runs, not once its result commits.
#[tokio::test]
async fn a_data_write_from_a_plain_thread_streams_while_the_tool_runs() {
    let store = FaultyStore::default();
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("crunch", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime(&store, &model, thread_writer);
    let mut events = runtime.observe();
    let handle = runtime.init(&thread_writer, "t-1");
    let sent = tokio::spawn(async move { handle.send("go").await });
    let streamed = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            if let flue_runtime::events::Event::DataPart { data, .. } = events.recv().await.unwrap().event {
                break data;
            }
        }
    })
    .await
    .expect("the write streamed while the tool ran");
    assert_eq!(streamed, json!(7));
    CRUNCHED.notify_one();
    let reply = tokio::time::timeout(std::time::Duration::from_secs(10), sent)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(reply.data.get("progress"), Some(&json!(7)));
}

/// The messages `early_writer`'s start callback wrote its progress for, one entry per write
/// (the tests that send them run at once).
static EARLY_WRITES: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[agent]
fn early_writer() -> &'static str {
    use_model("scripted/x");
    let progress = use_data_writer::<u32>("progress");
    use_agent_start(move |ctx| {
        let progress = progress.clone();
        let message = match ctx.delivery() {
            DeliveredMessage::User(message) => message.body.clone(),
            DeliveredMessage::Signal(_) => String::new(),
        };
        async move {
            let written = progress.write(&1);
            if written.is_ok() {
                EARLY_WRITES.lock().unwrap().push(message);
            }
            written
        }
    });
    "Write early."
}

/// Reference §3.3 item 8 ("a failed attempt's queued writes are dropped"), §8 item 25 (writes
/// before the first completed step are buffered, and a failed attempt's vanish): a data part
/// reaches clients through the durable stream only. The live `data_part` event follows the
/// same rule — published once the write is durable — so a write the failed attempt dropped is
/// never observed.
#[tokio::test]
async fn a_data_write_a_failed_attempt_dropped_is_never_observed() {
    let store = FaultyStore::default();
    let model = ScriptedModel::new([ScriptedReply::Error(flue_runtime::provider::ProviderError::new(
        flue_runtime::provider::ProviderErrorKind::BadRequest,
        "refused",
    ))]);
    let runtime = runtime(&store, &model, early_writer);
    let mut events = runtime.observe();
    runtime
        .init(&early_writer, "e-1")
        .send("go, to be refused")
        .await
        .unwrap_err();
    let written = EARLY_WRITES
        .lock()
        .unwrap()
        .iter()
        .filter(|message| *message == "go, to be refused")
        .count();
    assert_eq!(written, 1, "the attempt wrote before it failed");
    let durable = records(&store, &InstanceKey::new("early_writer", "e-1"))
        .await
        .iter()
        .filter(|r| matches!(r.body, RecordBody::MessageDataWrite { .. }))
        .count();
    assert_eq!(durable, 0, "the failed attempt dropped its write");
    assert_eq!(observed_data_parts(&mut events), Vec::<serde_json::Value>::new());
}

/// A step stored before what follows it failed (here the first flush of the data writes made
/// before it): its message ends as stored, not as a step that was lost, and the response
/// settles with it.
#[tokio::test]
async fn a_step_stored_before_its_data_flush_failed_ends_as_stored() {
    use flue_runtime::events::Event;
    let store = FaultyStore::default();
    store.fail_once(|records| {
        records
            .iter()
            .any(|r| matches!(r.body, RecordBody::MessageDataWrite { .. }))
    });
    let model = ScriptedModel::new([ScriptedReply::text("first"), ScriptedReply::text("second")]);
    let runtime = runtime(&store, &model, early_writer);
    let mut events = runtime.observe();
    let reply = runtime.init(&early_writer, "e-2").send("go").await.unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    assert_eq!(reply.text, "first");
    let mut ended = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let Event::MessageEnd {
            message: ModelMessage::Assistant { text, .. },
        } = observation.event
        {
            ended.push(text);
        }
    }
    assert_eq!(ended, ["first"]);
}

#[agent]
fn counted_writer() -> &'static str {
    use_model("scripted/x");
    let progress = use_data_writer::<u32>("progress");
    use_tool(
        Tool::new("work")
            .description("Work.")
            .run(move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
                let progress = progress.clone();
                async move {
                    progress.write(&7)?;
                    Ok::<_, ToolError>("worked")
                }
            }),
    );
    "Work."
}

/// Same rule after the first step: a write whose append failed (the attempt is abandoned; its
/// re-attempt finds the tool's outcome unknown and does not run it again) is never observed.
#[tokio::test]
async fn a_data_write_whose_append_failed_is_never_observed() {
    let store = FaultyStore::default();
    store.fail_once(|records| {
        records
            .iter()
            .any(|r| matches!(r.body, RecordBody::MessageDataWrite { .. }))
    });
    let model = ScriptedModel::new([ScriptedReply::tool_call("work", json!({})), ScriptedReply::text("done")]);
    let runtime = runtime(&store, &model, counted_writer);
    let mut events = runtime.observe();
    let reply = runtime.init(&counted_writer, "c-1").send("go").await.unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    assert!(!reply.data.contains_key("progress"));
    let durable = records(&store, &InstanceKey::new("counted_writer", "c-1"))
        .await
        .iter()
        .filter(|r| matches!(r.body, RecordBody::MessageDataWrite { .. }))
        .count();
    assert_eq!(durable, 0);
    assert_eq!(observed_data_parts(&mut events), Vec::<serde_json::Value>::new());
}

#[agent]
fn compacting() -> &'static str {
    harness::use_tight_model("scripted/x", 150);
    "Be brief."
}

/// Reference §7.2 (Compaction row; the events reference: "Every `compaction_start` is
/// followed by exactly one terminal `compaction` event"): a compaction whose record could not
/// be appended ends with a failed `compaction` event before its attempt is abandoned.
#[tokio::test]
async fn a_compaction_whose_record_could_not_be_appended_ends_with_a_failed_event() {
    let long = |word: &str| format!("{word} ").repeat(80);
    let store = FaultyStore::default();
    store.fail_once(|records| records.iter().any(|r| matches!(r.body, RecordBody::Compaction { .. })));
    let model = ScriptedModel::new([
        ScriptedReply::text(long("one")),
        ScriptedReply::text(long("two")),
        ScriptedReply::text("A first summary."),
        // The re-attempt compacts again, then answers.
        ScriptedReply::text("A second summary."),
        ScriptedReply::text("three it is"),
    ])
    .with_context_window(600);
    let runtime = runtime(&store, &model, compacting);
    let handle = runtime.init(&compacting, "c-1");
    handle.send(long("first")).await.unwrap();
    handle.send(long("second")).await.unwrap();
    let mut events = runtime.observe();
    assert_eq!(handle.send(long("third")).await.unwrap().text, "three it is");
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            flue_runtime::events::Event::CompactionStart { .. } => seen.push("start".to_owned()),
            flue_runtime::events::Event::Compaction { is_error, error, .. } => seen.push(format!(
                "end {is_error} {}",
                error.map(|error| error.error_type).unwrap_or_default()
            )),
            _ => {}
        }
    }
    assert_eq!(seen, ["start", "end true store_failure", "start", "end false "]);
}

/// Counts of one durable-tool scenario: runs of the tool and of each of its steps.
#[derive(Default)]
struct Runs {
    tool: AtomicUsize,
    first: AtomicUsize,
    second: AtomicUsize,
}

impl Runs {
    const fn new() -> Self {
        Self {
            tool: AtomicUsize::new(0),
            first: AtomicUsize::new(0),
            second: AtomicUsize::new(0),
        }
    }

    fn get(&self) -> (usize, usize, usize) {
        (
            self.tool.load(Ordering::SeqCst),
            self.first.load(Ordering::SeqCst),
            self.second.load(Ordering::SeqCst),
        )
    }
}

/// A tool (durable or not) whose run takes two named steps, counting every run.
fn two_step_tool(name: &'static str, durable: bool, runs: &'static Runs) -> Tool {
    let tool = Tool::new(name).description("Refund an order in two steps.");
    let tool = if durable { tool.durable() } else { tool };
    tool.run(move |ctx, _: serde_json::Map<String, serde_json::Value>| async move {
        runs.tool.fetch_add(1, Ordering::SeqCst);
        let refund: String = ctx
            .step("issue-refund", async {
                let n = runs.first.fetch_add(1, Ordering::SeqCst) + 1;
                format!("re_{n}")
            })
            .await?;
        let mail: u32 = ctx
            .step("email-customer", async {
                runs.second.fetch_add(1, Ordering::SeqCst) as u32 + 1
            })
            .await?;
        Ok::<_, ToolError>(format!("refund {refund}, email {mail}"))
    })
}

fn is_batch_commit(records: &[Record]) -> bool {
    records
        .iter()
        .any(|record| matches!(record.body, RecordBody::ToolResultsCommitted { .. }))
}

/// The result the model saw for the call of `tool` in its request `at`.
fn tool_result(model: &ScriptedModel, at: usize, tool: &str) -> (String, bool) {
    model.requests()[at]
        .messages
        .iter()
        .find_map(|message| match message {
            ModelMessage::Tool {
                name,
                content,
                is_error,
                ..
            } if name == tool => Some((content.clone(), *is_error)),
            _ => None,
        })
        .unwrap()
}

const UNKNOWN: &str =
    r#"{"type":"interrupted","message":"Tool execution was interrupted before completion. The outcome is unknown."}"#;

static REFUNDS: Runs = Runs::new();
static NOTES: Runs = Runs::new();

#[agent]
fn refunder() -> &'static str {
    use_model("scripted/x");
    use_tool(two_step_tool("refund", true, &REFUNDS));
    use_tool(two_step_tool("note", false, &NOTES));
    "You refund orders."
}

/// The first append of a tool outcome (a call's own, as it ended, or the batch's commit).
fn has_outcome(records: &[Record]) -> bool {
    records
        .iter()
        .any(|record| matches!(record.body, RecordBody::ToolOutcome { .. }))
}

/// Reference checklist item 14 and §3.9 step 7: a durable tool's call whose outcome was never
/// recorded runs again on recovery; its settled steps replay instead of running again, and
/// the model sees the re-run's real result. A non-durable call of the same batch gets the
/// outcome-unknown result and does not run again.
#[tokio::test]
async fn an_interrupted_durable_call_runs_again_replaying_its_settled_steps() {
    let store = FaultyStore::default();
    // The refund ends first: its outcome's own append is lost (the note's goes with the
    // commit that never comes).
    store.fail_once(has_outcome);
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([("refund", json!({})), ("note", json!({}))]),
        ScriptedReply::text("Refunded."),
    ]);
    let runtime = runtime(&store, &model, refunder);
    let reply = runtime.init(&refunder, "r-1").send("refund me").await.unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    assert_eq!(reply.text, "Refunded.");
    // The durable tool ran twice, each of its steps once; the model was called twice in all.
    assert_eq!(REFUNDS.get(), (2, 1, 1));
    assert_eq!(model.requests().len(), 2);
    assert_eq!(
        tool_result(&model, 1, "refund"),
        ("refund re_1, email 1".to_owned(), false),
        "the re-run's real result, from the replayed step values"
    );
    // The non-durable tool ran once (its steps just ran) and its outcome is unknown.
    assert_eq!(NOTES.get(), (1, 1, 1));
    assert_eq!(tool_result(&model, 1, "note"), (UNKNOWN.to_owned(), true));
    let all = records(&store, &InstanceKey::new("refunder", "r-1")).await;
    let steps: Vec<(&str, &str, &serde_json::Value)> = all
        .iter()
        .filter_map(|record| match &record.body {
            RecordBody::ToolStepSettled {
                tool_name,
                step_name,
                value,
                ..
            } => Some((tool_name.as_str(), step_name.as_str(), value)),
            _ => None,
        })
        .collect();
    assert_eq!(
        steps,
        [
            ("refund", "issue-refund", &json!("re_1")),
            ("refund", "email-customer", &json!(1))
        ],
        "only the durable tool's steps are recorded, once each"
    );
    let outcomes = all
        .iter()
        .filter(|record| matches!(record.body, RecordBody::ToolOutcome { .. }))
        .count();
    assert_eq!(
        outcomes, 2,
        "one committed batch: the re-run's outcome and the unknown one"
    );
}

/// The tool rows `note_tool_rows` saw created, by their content.
static TOOL_ROWS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

#[hook(after_create_message)]
async fn note_tool_rows(_state: &ThreadState, message: &Message) {
    if message.role == flue_runtime::lifecycle::MessageRole::Tool {
        TOOL_ROWS
            .lock()
            .unwrap()
            .push(message.content.clone().unwrap_or_default());
    }
}

#[agent(hooks = [note_tool_rows])]
fn audited() -> &'static str {
    use_model("scripted/x");
    use_tool(
        Tool::new("quick")
            .description("Answer at once.")
            .durable()
            .run(|_ctx, _: serde_json::Map<String, serde_json::Value>| async { Ok::<_, ToolError>("quick done") }),
    );
    use_tool(Tool::new("slow").description("Answer in a moment.").durable().run(
        |_ctx, _: serde_json::Map<String, serde_json::Value>| async {
            tokio::time::sleep(std::time::Duration::from_millis(30)).await;
            Ok::<_, ToolError>("slow done")
        },
    ));
    "You answer."
}

/// A batch committed by a later attempt creates the rows of the outcomes an earlier attempt
/// recorded as well as its own: `after_create_message` runs for every one of them (it ran for
/// the re-run's only).
#[tokio::test]
async fn after_create_message_runs_for_every_row_a_re_attempts_batch_commit_creates() {
    let store = FaultyStore::default();
    // The quick call's outcome is recorded as it ends; the batch's commit (with the slow
    // call's) fails, and the re-attempt runs the slow call again.
    store.fail_once(is_batch_commit);
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([("quick", json!({})), ("slow", json!({}))]),
        ScriptedReply::text("Both done."),
    ]);
    let runtime = runtime(&store, &model, audited);
    let reply = runtime.init(&audited, "a-1").send("go").await.unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    assert_eq!(reply.text, "Both done.");
    let mut rows = TOOL_ROWS.lock().unwrap().clone();
    rows.sort();
    assert_eq!(rows, ["quick done", "slow done"]);
}

static HALF_DONE: Runs = Runs::new();

#[agent]
fn half_refunder() -> &'static str {
    use_model("scripted/x");
    use_tool(two_step_tool("refund", true, &HALF_DONE));
    "You refund orders."
}

/// A crash after the first step settled but before the second did: the re-run replays the
/// first and runs the second.
#[tokio::test]
async fn a_durable_call_interrupted_between_its_steps_runs_only_the_unsettled_step_again() {
    let store = FaultyStore::default();
    store.fail_once(|records| {
        records.iter().any(|record| {
            matches!(&record.body, RecordBody::ToolStepSettled { step_name, .. } if step_name == "email-customer")
        })
    });
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("refund", json!({})),
        ScriptedReply::text("Done."),
    ]);
    let runtime = runtime(&store, &model, half_refunder);
    let reply = runtime.init(&half_refunder, "h-1").send("refund me").await.unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    assert_eq!(reply.text, "Done.");
    assert_eq!(HALF_DONE.get(), (2, 1, 2));
    assert_eq!(model.requests().len(), 2);
    assert_eq!(
        tool_result(&model, 1, "refund"),
        ("refund re_1, email 2".to_owned(), false)
    );
}

static FLIPPED: Runs = Runs::new();

#[agent]
fn flipper() -> &'static str {
    use_model("scripted/x");
    // Durable until the tool has run once: the re-attempt's render no longer declares it.
    use_tool(two_step_tool(
        "refund",
        FLIPPED.tool.load(Ordering::SeqCst) == 0,
        &FLIPPED,
    ));
    "You refund orders."
}

/// Reference §8 item 20: a durable call re-runs only if the current render still declares
/// its tool durable.
#[tokio::test]
async fn a_call_whose_tool_the_current_render_no_longer_declares_durable_is_not_run_again() {
    let store = FaultyStore::default();
    store.fail_once(is_batch_commit);
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("refund", json!({})),
        ScriptedReply::text("Unsure."),
    ]);
    let runtime = runtime(&store, &model, flipper);
    let reply = runtime.init(&flipper, "f-1").send("refund me").await.unwrap();
    assert_eq!(reply.text, "Unsure.");
    assert_eq!(FLIPPED.get(), (1, 1, 1));
    assert_eq!(tool_result(&model, 1, "refund"), (UNKNOWN.to_owned(), true));
}

#[agent]
fn repeater() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("send").description("Send twice.").durable().run(
        |ctx, _: serde_json::Map<String, serde_json::Value>| async move {
            ctx.step("send", async { 1 }).await?;
            ctx.step("send", async { 2 }).await?;
            Ok::<_, ToolError>("sent")
        },
    ));
    "You send."
}

/// Step names are unique per call: a reused name is an error result the model sees.
#[tokio::test]
async fn a_step_name_used_twice_in_one_call_is_an_error_result() {
    let store = FaultyStore::default();
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("send", json!({})),
        ScriptedReply::text("Failed."),
    ]);
    let runtime = runtime(&store, &model, repeater);
    runtime.init(&repeater, "p-1").send("send").await.unwrap();
    let (content, is_error) = tool_result(&model, 1, "send");
    assert!(is_error);
    assert!(content.contains("ran the step \"send\" twice in one call"), "{content}");
    let steps = records(&store, &InstanceKey::new("repeater", "p-1"))
        .await
        .into_iter()
        .filter(|record| matches!(record.body, RecordBody::ToolStepSettled { .. }))
        .count();
    assert_eq!(steps, 1, "the first step settled");
}

#[agent]
fn averager() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("average").description("Average nothing.").durable().run(
        |ctx, _: serde_json::Map<String, serde_json::Value>| async move {
            let refused = ctx.step("average", async { f64::NAN }).await.unwrap_err();
            // Nothing was recorded: the name is free for another try.
            let average: f64 = ctx.step("average", async { 2.5 }).await?;
            Ok::<_, ToolError>(format!("{average} ({refused})"))
        },
    ));
    "You average."
}

/// A step's value is recorded as JSON, which has no NaN (serde_json writes `null`, which an
/// `f64` cannot read): a value a re-run could not read back is an error and is not recorded,
/// rather than recorded and then failing to parse, and the step's name stays free.
#[tokio::test]
async fn a_step_value_that_would_not_read_back_is_an_error_and_not_recorded() {
    let store = FaultyStore::default();
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("average", json!({})),
        ScriptedReply::text("Failed."),
    ]);
    let runtime = runtime(&store, &model, averager);
    runtime.init(&averager, "a-1").send("average").await.unwrap();
    let (content, is_error) = tool_result(&model, 1, "average");
    assert!(!is_error, "{content}");
    assert!(content.starts_with("2.5 ("), "{content}");
    assert!(
        content.contains(
            "step \"average\" returned a value that does not read back as its type after the JSON round trip"
        ),
        "{content}"
    );
    let steps = records(&store, &InstanceKey::new("averager", "a-1"))
        .await
        .into_iter()
        .filter(|record| matches!(record.body, RecordBody::ToolStepSettled { .. }))
        .count();
    assert_eq!(steps, 1, "only the value a re-run can read is recorded");
}

static PAIR: Runs = Runs::new();

#[agent]
fn pair_refunder() -> &'static str {
    use_model("scripted/x");
    use_tool(two_step_tool("refund", true, &PAIR));
    "You refund orders."
}

/// Two durable calls of one batch run concurrently and record their steps under their own call
/// ids: when neither outcome was recorded, each re-run replays its own settled steps and
/// nothing runs twice.
#[tokio::test]
async fn two_durable_calls_of_one_batch_each_replay_their_own_steps() {
    let store = FaultyStore::default();
    // The first call's outcome is lost, and the attempt with it (the second's never lands).
    store.fail_once(has_outcome);
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([("refund", json!({})), ("refund", json!({}))]),
        ScriptedReply::text("Refunded."),
    ]);
    let runtime = runtime(&store, &model, pair_refunder);
    let reply = runtime.init(&pair_refunder, "pp-1").send("refund me").await.unwrap();
    assert_eq!(reply.text, "Refunded.");
    assert_eq!(PAIR.get(), (4, 2, 2));
}

static KEPT: Runs = Runs::new();

#[agent]
fn kept_refunder() -> &'static str {
    use_model("scripted/x");
    use_tool(two_step_tool("refund", true, &KEPT));
    "You refund orders."
}

/// Reference §3.3 and §3.9 step 7: each call's outcome is durable as its tool ends, before
/// the batch commits. When the commit is lost, the call that ended first keeps its outcome and
/// does not run again (first write wins); only the call whose outcome went with the commit
/// runs again. The model sees both real results, and the stream one outcome per call.
#[tokio::test]
async fn a_call_whose_outcome_was_recorded_does_not_run_again_when_the_batch_commit_is_lost() {
    let store = FaultyStore::default();
    store.fail_once(is_batch_commit);
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([("refund", json!({})), ("refund", json!({}))]),
        ScriptedReply::text("Refunded."),
    ]);
    let runtime = runtime(&store, &model, kept_refunder);
    let reply = runtime.init(&kept_refunder, "kr-1").send("refund me").await.unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    assert_eq!(reply.text, "Refunded.");
    // Three runs of the tool: both calls, then the second again (replaying its steps).
    assert_eq!(KEPT.get(), (3, 2, 2));
    assert_eq!(
        harness::tool_results(&model.requests()[1]),
        [
            ("refund re_1, email 1".to_owned(), false),
            ("refund re_2, email 2".to_owned(), false)
        ]
    );
    let all = records(&store, &InstanceKey::new("kept_refunder", "kr-1")).await;
    let outcomes = all
        .iter()
        .filter(|record| matches!(record.body, RecordBody::ToolOutcome { .. }))
        .count();
    assert_eq!(outcomes, 2, "one outcome per call");
}

static TWICE: Runs = Runs::new();

#[agent]
fn twice_refunder() -> &'static str {
    use_model("scripted/x");
    use_tool(two_step_tool("refund", true, &TWICE));
    "You refund orders."
}

/// A re-run that is interrupted too: the steps the first run settled are still on record for
/// the third attempt, which replays them (the model sees one refund, one email).
#[tokio::test]
async fn a_durable_call_interrupted_twice_still_replays_its_first_runs_steps() {
    let store = FaultyStore::default();
    let left = Arc::new(AtomicUsize::new(2));
    let left2 = left.clone();
    store.fail_always(move |records| {
        is_batch_commit(records)
            && left2
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
    });
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("refund", json!({})),
        ScriptedReply::text("Done."),
    ]);
    let runtime = runtime(&store, &model, twice_refunder);
    let reply = runtime.init(&twice_refunder, "tw-1").send("refund me").await.unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 2);
    assert_eq!(reply.text, "Done.");
    assert_eq!(TWICE.get(), (3, 1, 1));
    assert_eq!(
        tool_result(&model, 1, "refund"),
        ("refund re_1, email 1".to_owned(), false)
    );
}

static SWALLOWED: AtomicUsize = AtomicUsize::new(0);

#[agent]
fn swallower() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("charge").description("Charge.").durable().run(
        |ctx, _: serde_json::Map<String, serde_json::Value>| async move {
            let n: usize = ctx
                .step("charge", async { SWALLOWED.fetch_add(1, Ordering::SeqCst) + 1 })
                .await
                .unwrap_or(0);
            Ok::<_, ToolError>(format!("charged {n}"))
        },
    ));
    "You charge."
}

/// A step whose record could not be appended: even when the tool ignores the step's error and
/// reports success, that result is not committed; the attempt is re-attempted from what is
/// durable and the re-run's step runs (and records) again.
#[tokio::test]
async fn a_tool_ignoring_its_steps_failed_append_does_not_commit_its_result() {
    let store = FaultyStore::default();
    store.fail_once(|records| {
        records
            .iter()
            .any(|record| matches!(record.body, RecordBody::ToolStepSettled { .. }))
    });
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("charge", json!({})),
        ScriptedReply::text("Done."),
    ]);
    let runtime = runtime(&store, &model, swallower);
    let reply = runtime.init(&swallower, "sw-1").send("charge").await.unwrap();
    assert_eq!(reply.text, "Done.");
    assert_eq!(model.requests().len(), 2);
    assert_eq!(tool_result(&model, 1, "charge"), ("charged 2".to_owned(), false));
}

static SWALLOWED_BESIDE: AtomicUsize = AtomicUsize::new(0);

#[agent]
fn swallower_beside() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("charge").description("Charge.").durable().run(
        |ctx, _: serde_json::Map<String, serde_json::Value>| async move {
            let n: usize = ctx
                .step("charge", async { SWALLOWED_BESIDE.fetch_add(1, Ordering::SeqCst) + 1 })
                .await
                .unwrap_or(0);
            Ok::<_, ToolError>(format!("charged {n}"))
        },
    ));
    use_tool(
        Tool::new("note")
            .description("Note.")
            .run(|_ctx, _: serde_json::Map<String, serde_json::Value>| async move { "noted" }),
    );
    "You charge."
}

/// The same within a batch, where the call ends before another (its outcome would be recorded
/// as it ends): an attempt one of whose appends failed records no outcome, so the call is not
/// taken as done; the re-attempt runs it again and the model reads the re-run's result.
#[tokio::test]
async fn a_call_whose_step_append_failed_records_no_outcome_and_runs_again() {
    let store = FaultyStore::default();
    store.fail_once(|records| {
        records
            .iter()
            .any(|record| matches!(record.body, RecordBody::ToolStepSettled { .. }))
    });
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([("charge", json!({})), ("note", json!({}))]),
        ScriptedReply::text("Done."),
    ]);
    let runtime = runtime(&store, &model, swallower_beside);
    let reply = runtime.init(&swallower_beside, "swb-1").send("charge").await.unwrap();
    assert_eq!(reply.text, "Done.");
    assert_eq!(model.requests().len(), 2);
    assert_eq!(tool_result(&model, 1, "charge"), ("charged 2".to_owned(), false));
}

static CLOSING: AtomicUsize = AtomicUsize::new(0);
static CLOSING_STEPS: AtomicUsize = AtomicUsize::new(0);

#[agent]
fn closer() -> &'static str {
    use_model("scripted/x");
    use_tool(
        Tool::new("close")
            .description("Close the ticket.")
            .durable()
            .terminate()
            .run(|ctx, _: serde_json::Map<String, serde_json::Value>| async move {
                CLOSING.fetch_add(1, Ordering::SeqCst);
                let n: usize = ctx
                    .step("close", async { CLOSING_STEPS.fetch_add(1, Ordering::SeqCst) + 1 })
                    .await?;
                Ok::<_, ToolError>(format!("closed {n}"))
            }),
    );
    "You close tickets."
}

/// A re-run whose every result asks to terminate ends the response as the first run would
/// have: no further model call.
#[tokio::test]
async fn a_re_run_terminating_batch_ends_the_response_without_another_model_call() {
    let store = FaultyStore::default();
    store.fail_once(is_batch_commit);
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("close", json!({})),
        ScriptedReply::text("unexpected"),
    ]);
    let runtime = runtime(&store, &model, closer);
    runtime.init(&closer, "cl-1").send("close").await.unwrap();
    assert_eq!(model.requests().len(), 1);
    assert_eq!(CLOSING.load(Ordering::SeqCst), 2);
    assert_eq!(CLOSING_STEPS.load(Ordering::SeqCst), 1);
}

static HANGING: Runs = Runs::new();

#[agent]
fn hanger() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("refund").description("Refund.").durable().run(
        |ctx, _: serde_json::Map<String, serde_json::Value>| async move {
            HANGING.tool.fetch_add(1, Ordering::SeqCst);
            let a: usize = ctx
                .step("one", async { HANGING.first.fetch_add(1, Ordering::SeqCst) + 1 })
                .await?;
            let b: usize = ctx
                .step("two", async {
                    HANGING.second.fetch_add(1, Ordering::SeqCst);
                    std::future::pending::<usize>().await
                })
                .await?;
            Ok::<_, ToolError>(format!("{a} {b}"))
        },
    ));
    "You refund."
}

/// An abort while a durable call waits in a step settles the submission as aborted: the call is
/// not re-run by the next submission, whose model sees the call's outcome as unknown.
#[tokio::test]
async fn an_abort_during_a_step_leaves_the_call_unknown_and_it_does_not_run_again() {
    let store = FaultyStore::default();
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("refund", json!({})),
        ScriptedReply::text("Ok."),
    ]);
    let runtime = runtime(&store, &model, hanger);
    let handle = runtime.init(&hanger, "hg-1");
    handle.dispatch("refund").await.unwrap();
    for _ in 0..500 {
        if HANGING.second.load(Ordering::SeqCst) == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(handle.abort().await.unwrap());
    let reply = handle.send("again").await.unwrap();
    assert_eq!(reply.text, "Ok.");
    assert_eq!(HANGING.get(), (1, 1, 1));
    assert_eq!(tool_result(&model, 1, "refund"), (UNKNOWN.to_owned(), true));
}

static KILLED: Runs = Runs::new();

#[agent]
fn killed_refunder() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("refund").description("Refund.").durable().run(
        |ctx, _: serde_json::Map<String, serde_json::Value>| async move {
            KILLED.tool.fetch_add(1, Ordering::SeqCst);
            let a: usize = ctx
                .step("one", async { KILLED.first.fetch_add(1, Ordering::SeqCst) + 1 })
                .await?;
            let b: usize = ctx
                .step("two", async {
                    // The first node dies here.
                    if KILLED.second.fetch_add(1, Ordering::SeqCst) == 0 {
                        std::future::pending::<()>().await;
                    }
                    2
                })
                .await?;
            Ok::<_, ToolError>(format!("{a} {b}"))
        },
    ));
    "You refund."
}

/// A node dies while a durable call waits in its second step; a second node, with nothing but
/// the store, takes the submission over, replays the first step and runs the second.
#[tokio::test]
async fn a_node_dying_mid_call_is_taken_over_and_the_call_replays_its_settled_steps() {
    let store = FaultyStore::default();
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("refund", json!({})),
        ScriptedReply::text("Refunded."),
    ]);
    let (first_store, first_model) = (store.clone(), model.clone());
    // The first node runs on a tokio runtime of its own, shut down mid-call: its tasks (the
    // attempt, its lease's heartbeat) stop as a killed process's would.
    std::thread::spawn(move || {
        let dead = tokio::runtime::Runtime::new().unwrap();
        dead.block_on(async move {
            let node = taking_over(&first_store, &first_model, killed_refunder).await;
            node.init(&killed_refunder, "k-1").dispatch("refund").await.unwrap();
            while KILLED.second.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            std::mem::forget(node);
        });
        dead.shutdown_background();
    })
    .join()
    .unwrap();
    let node = taking_over(&store, &model, killed_refunder).await;
    let handle = node.init(&killed_refunder, "k-1");
    let submission = records(&store, &InstanceKey::new("killed_refunder", "k-1"))
        .await
        .iter()
        .find_map(|record| record.submission_id.as_deref().map(str::to_owned))
        .unwrap();
    let reply = tokio::time::timeout(std::time::Duration::from_secs(10), handle.read(&submission))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reply.text, "Refunded.");
    assert_eq!(KILLED.get(), (2, 1, 2));
    assert_eq!(tool_result(&model, 1, "refund"), ("1 2".to_owned(), false));
}

/// The next `submission_recovery` observed (other events skipped), within ten seconds.
async fn next_recovery(
    events: &mut tokio::sync::broadcast::Receiver<flue_runtime::events::Observation>,
) -> flue_runtime::events::Observation {
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            let observation = events.recv().await.unwrap();
            if matches!(
                observation.event,
                flue_runtime::events::Event::SubmissionRecovery { .. }
            ) {
                return observation;
            }
        }
    })
    .await
    .expect("a submission_recovery within ten seconds")
}

/// Reference §7.2 `submission_recovery` (`reconcile_submission` / `agent_unavailable`): nodes
/// sharing one store may run different agents. An expired lease of an agent this node does
/// not run is reported and left alone: taking it over would spend one of its attempts on a
/// node that cannot run it.
#[tokio::test]
async fn an_expired_submission_of_an_agent_this_node_does_not_run_is_reported_and_left_for_a_node_that_runs_it() {
    use flue_runtime::events::{Event, RecoveryOperation, RecoveryOutcome};
    use flue_runtime::store::{SubmissionKind, SubmissionStatus, now_ms};
    let store = FaultyStore::default();
    let key = InstanceKey::new("elsewhere", "e-1");
    store
        .admit(harness::admission(&key, "sub_elsewhere", "hello"))
        .await
        .unwrap();
    let dead = Claim {
        attempt_id: "attempt_dead".into(),
        owner_id: "owner_dead".into(),
        lease_until_ms: now_ms() + 50,
    };
    store.claim_next(&key, &dead).await.unwrap().unwrap();
    let model = ScriptedModel::new([]);
    let runtime = taking_over(&store, &model, relay).await;
    let mut events = runtime.observe();
    let observation = next_recovery(&mut events).await;
    assert_eq!(observation.agent.as_deref(), Some("elsewhere"));
    assert_eq!(observation.instance_id.as_deref(), Some("e-1"));
    assert_eq!(observation.submission_id.as_deref(), Some("sub_elsewhere"));
    assert_eq!(
        observation.event,
        Event::SubmissionRecovery {
            kind: Some(SubmissionKind::Dispatch),
            operation: RecoveryOperation::ReconcileSubmission,
            outcome: RecoveryOutcome::AgentUnavailable,
            attempt_count: Some(1),
            max_attempts: Some(10),
            error: None,
        }
    );
    // Reported again by the next scan, and still not taken over.
    let again = next_recovery(&mut events).await;
    assert_eq!(again.submission_id.as_deref(), Some("sub_elsewhere"));
    let row = store.submission("sub_elsewhere").await.unwrap().unwrap();
    assert_eq!(row.status, SubmissionStatus::Running);
    assert_eq!(row.attempt_count, 1, "no attempt spent here");
    assert_eq!(row.owner_id.as_deref(), Some("owner_dead"));
    assert!(model.requests().is_empty());
}

/// Reference §7.2 `submission_recovery` (`reconcile_pass` / `deferred`): a scan that cannot
/// list expired leases concerns no one instance; it is reported without an agent, an
/// instance or a submission, and the next scan tries again.
#[tokio::test]
async fn a_scan_that_cannot_list_expired_leases_is_reported_as_a_deferred_pass_naming_no_instance() {
    use flue_runtime::events::{Event, RecoveryOperation, RecoveryOutcome};
    use flue_runtime::record::SettlementError;
    use flue_runtime::store::now_ms;
    let store = FaultyStore::default();
    store.failing_scans.store(true, Ordering::SeqCst);
    let model = ScriptedModel::new([ScriptedReply::text("taken over after the store came back")]);
    let runtime = taking_over(&store, &model, relay).await;
    let mut events = runtime.observe();
    let observation = next_recovery(&mut events).await;
    assert_eq!(
        (&observation.agent, &observation.instance_id, &observation.submission_id),
        (&None, &None, &None)
    );
    assert_eq!(
        observation.event,
        Event::SubmissionRecovery {
            kind: None,
            operation: RecoveryOperation::ReconcilePass,
            outcome: RecoveryOutcome::Deferred,
            attempt_count: None,
            max_attempts: None,
            error: Some(SettlementError::new(
                "store_failure",
                "store failure: injected scan failure"
            )),
        }
    );
    let json = serde_json::to_value(&observation).unwrap();
    assert!(
        json.get("agent").is_none() && json.get("instanceId").is_none(),
        "{json}"
    );
    assert_eq!(json["event"]["type"], "submission_recovery");
    assert_eq!(json["event"]["operation"], "reconcile_pass");
    assert_eq!(json["event"]["outcome"], "deferred");

    // The store answers again: the next scan takes over what a dead node left.
    let key = InstanceKey::new("relay", "r-after-scan");
    store
        .admit(harness::admission(&key, "sub_after_scan", "hello"))
        .await
        .unwrap();
    let dead = Claim {
        attempt_id: "attempt_dead".into(),
        owner_id: "owner_dead".into(),
        lease_until_ms: now_ms() + 50,
    };
    store.claim_next(&key, &dead).await.unwrap().unwrap();
    store.failing_scans.store(false, Ordering::SeqCst);
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runtime.init(&relay, "r-after-scan").read("sub_after_scan"),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(reply.text, "taken over after the store came back");
}

/// Reference §7.2 `submission_recovery` (`finalize_settlement` / `deferred`): a settlement
/// the store rejects is reported with the submission; the attempt's lease then lapses
/// unrenewed, and the takeover finds the final answer durable and settles it without calling
/// the model again.
#[tokio::test]
async fn a_settlement_that_fails_is_reported_and_settles_once_its_lease_is_taken_over() {
    use flue_runtime::events::{Event, RecoveryOperation, RecoveryOutcome};
    let store = FaultyStore::default();
    store.fail_once(faulty::settles);
    let model = ScriptedModel::new([ScriptedReply::text("answered once")]);
    let runtime = taking_over(&store, &model, relay).await;
    let mut events = runtime.observe();
    let handle = runtime.init(&relay, "r-settle");
    let receipt = handle.dispatch("hello").await.unwrap();
    let observation = next_recovery(&mut events).await;
    assert_eq!(
        observation.submission_id.as_deref(),
        Some(receipt.submission_id.as_str())
    );
    let Event::SubmissionRecovery {
        operation,
        outcome,
        attempt_count,
        error,
        ..
    } = &observation.event
    else {
        unreachable!()
    };
    assert_eq!(
        (*operation, *outcome, *attempt_count),
        (
            RecoveryOperation::FinalizeSettlement,
            RecoveryOutcome::Deferred,
            Some(1)
        )
    );
    assert!(error.as_ref().unwrap().message.contains("injected settlement failure"));
    let reply = tokio::time::timeout(std::time::Duration::from_secs(10), handle.read(&receipt.submission_id))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reply.text, "answered once");
    assert_eq!(
        model.requests().len(),
        1,
        "the answer was durable: no second model call"
    );
    let row = store.submission(&receipt.submission_id).await.unwrap().unwrap();
    assert_eq!(row.outcome, Some(Outcome::Completed));
    assert_eq!(row.attempt_count, 2, "settled by the takeover");
}

/// Reference §7.2 `submission_recovery` (`process_submission` / `deferred`): an attempt
/// abandoned for a store failure is reported with the submission and its attempts, then
/// re-attempted.
#[tokio::test]
async fn an_attempt_abandoned_for_a_store_failure_is_reported_before_it_is_re_attempted() {
    use flue_runtime::events::{Event, RecoveryOperation, RecoveryOutcome};
    let store = FaultyStore::default();
    store.fail_once(faulty::commits_a_tool_batch);
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("charge", json!({})),
        ScriptedReply::text("I could not confirm the charge."),
    ]);
    let runtime = runtime(&store, &model, billing);
    let mut events = runtime.observe();
    let reply = runtime.init(&billing, "b-recovery").send("charge me").await.unwrap();
    assert_eq!(reply.text, "I could not confirm the charge.");
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        seen.push(observation);
    }
    let recoveries: Vec<_> = seen
        .iter()
        .filter(|observation| matches!(observation.event, Event::SubmissionRecovery { .. }))
        .collect();
    assert_eq!(recoveries.len(), 1, "{recoveries:?}");
    assert_eq!(
        recoveries[0].submission_id.as_deref(),
        Some(reply.submission_id.as_str())
    );
    let Event::SubmissionRecovery {
        operation,
        outcome,
        attempt_count,
        max_attempts,
        error,
        ..
    } = &recoveries[0].event
    else {
        unreachable!()
    };
    assert_eq!(
        (*operation, *outcome, *attempt_count),
        (RecoveryOperation::ProcessSubmission, RecoveryOutcome::Deferred, Some(1))
    );
    assert!(max_attempts.is_some());
    assert!(error.as_ref().unwrap().message.contains("injected append failure"));
    // Reported before the next attempt started running.
    let position = |wanted: &dyn Fn(&Event) -> bool| seen.iter().position(|observation| wanted(&observation.event));
    let reported = position(&|event| matches!(event, Event::SubmissionRecovery { .. })).unwrap();
    let second = position(&|event| matches!(event, Event::SubmissionRunning { attempt_count: 2, .. })).unwrap();
    assert!(reported < second);
}

#[agent]
fn noter() -> &'static str {
    use_model("scripted/x");
    use_tool(
        Tool::new("note")
            .description("Take a note.")
            .run(|_ctx, _: serde_json::Map<String, serde_json::Value>| async { "noted" }),
    );
    "You take notes."
}

/// The settlements `observe()` reported for `submission_id`, in order.
fn settlements_of(
    events: &mut tokio::sync::broadcast::Receiver<flue_runtime::events::Observation>,
    submission_id: &str,
) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    while let Ok(observed) = events.try_recv() {
        if let flue_runtime::events::Event::SubmissionSettled { outcome, .. } = observed.event
            && observed.submission_id.as_deref() == Some(submission_id)
        {
            outcomes.push(outcome);
        }
    }
    outcomes
}

#[tokio::test]
async fn a_requeue_that_fails_after_a_store_failure_leaves_the_submission_to_a_takeover() {
    let store = FaultyStore::default();
    store.fail_once(faulty::commits_a_tool_batch);
    store.failing_requeues.store(1, Ordering::SeqCst);
    let model = ScriptedModel::new([ScriptedReply::tool_call("note", json!({})), ScriptedReply::text("done")]);
    let runtime = taking_over(&store, &model, noter).await;
    let mut events = runtime.observe();
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runtime.init(&noter, "n-1").send("note this"),
    )
    .await
    .expect("the submission settles")
    .unwrap();
    assert_eq!(
        store.failures.load(Ordering::SeqCst),
        2,
        "the append and the requeue failed"
    );
    // Not failed after its first attempt: the lease lapsed and the takeover completed it.
    assert_eq!(reply.text, "done");
    assert_eq!(settlements_of(&mut events, &reply.submission_id), [Outcome::Completed]);
}

#[tokio::test]
async fn a_settlement_that_fails_is_not_reported_settled() {
    let store = FaultyStore::default();
    store.fail_once(faulty::settles);
    let model = ScriptedModel::new([ScriptedReply::text("done"), ScriptedReply::text("done again")]);
    let runtime = taking_over(&store, &model, noter).await;
    let mut events = runtime.observe();
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runtime.init(&noter, "n-2").send("hello"),
    )
    .await
    .expect("the submission settles")
    .unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1);
    // One settlement reported: the durable one, made by the takeover.
    assert_eq!(settlements_of(&mut events, &reply.submission_id), [Outcome::Completed]);
}

static SLOW_RUNS: AtomicUsize = AtomicUsize::new(0);

/// A permit per run of `slow_worker`'s tool that may end.
static SLOW_GO: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(0);

#[agent]
fn slow_worker() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("crunch").description("Crunch numbers.").run(
        |_ctx, _: serde_json::Map<String, serde_json::Value>| async {
            SLOW_RUNS.fetch_add(1, Ordering::SeqCst);
            SLOW_GO.acquire().await.unwrap().forget();
            "crunched"
        },
    ));
    "You crunch numbers."
}

/// Renewals that fail for longer than the lease (a database failover, a stalled or suspended
/// node) while this node still runs the attempt must not make the node take its own attempt
/// over: that would fence the running tool, run it again and spend the attempt budget.
#[tokio::test]
async fn a_node_whose_renewals_failed_for_longer_than_the_lease_does_not_take_over_its_own_live_attempt() {
    let store = FaultyStore::default();
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("crunch", json!({})),
        ScriptedReply::text("crunched it"),
    ]);
    let runtime = taking_over(&store, &model, slow_worker).await;
    let handle = runtime.init(&slow_worker, "sw-1");
    let receipt = handle.dispatch("crunch").await.unwrap();
    tokio::time::timeout(LIVENESS, async {
        while SLOW_RUNS.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the tool started");
    // No renewal, the tool still running, until the lease has lapsed in the store and two of
    // the node's scans have looked since (the second began after the first ended): a lapse
    // the node saw, and must not act on.
    store.failing_renewals.store(true, Ordering::SeqCst);
    tokio::time::timeout(LIVENESS, async {
        while store
            .inner
            .submission(&receipt.submission_id)
            .await
            .unwrap()
            .unwrap()
            .lease_until_ms
            >= flue_runtime::store::now_ms()
        {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the lease lapsed");
    let scans = store.scans.load(Ordering::SeqCst);
    tokio::time::timeout(LIVENESS, async {
        while store.scans.load(Ordering::SeqCst) < scans + 2 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the node scanned");
    store.failing_renewals.store(false, Ordering::SeqCst);
    assert!(store.failures.load(Ordering::SeqCst) > 0, "renewals failed");
    assert_eq!(SLOW_RUNS.load(Ordering::SeqCst), 1, "the tool ran once, and runs on");
    // Enough permits for a second run, had there been one: it shows in the counts below.
    SLOW_GO.add_permits(2);
    let reply = tokio::time::timeout(std::time::Duration::from_secs(10), handle.read(&receipt.submission_id))
        .await
        .expect("the submission settles")
        .unwrap();
    assert_eq!(reply.text, "crunched it");
    assert_eq!(SLOW_RUNS.load(Ordering::SeqCst), 1, "the tool ran once");
    assert_eq!(model.requests().len(), 2, "no model call was made again");
    let row = store.inner.submission(&receipt.submission_id).await.unwrap().unwrap();
    assert_eq!(row.outcome, Some(Outcome::Completed));
    assert_eq!(row.attempt_count, 1, "the node kept its own attempt");
}

/// A store that stalls for longer than the lease between an attempt's claim and its start (the
/// read of the instance's stream the attempt starts from) must not make the node take over the
/// attempt it is about to run: the attempt's lease is the node's to renew from its claim on.
#[tokio::test]
async fn an_attempt_whose_start_stalled_past_its_lease_is_not_taken_over_by_its_own_node() {
    let store = FaultyStore::default();
    let model = ScriptedModel::new([ScriptedReply::text("relayed"), ScriptedReply::text("relayed again")]);
    let runtime = taking_over(&store, &model, relay).await;
    let handle = runtime.init(&relay, "r-stall");
    // Three lease periods, for the first read of the stream: the attempt's start (no other
    // reads it before the submission settles).
    *store.stall_next_read.lock().unwrap() = Some((
        InstanceKey::new("relay", "r-stall"),
        std::time::Duration::from_millis(600),
    ));
    let receipt = handle.dispatch("hello").await.unwrap();
    let reply = tokio::time::timeout(std::time::Duration::from_secs(10), handle.read(&receipt.submission_id))
        .await
        .expect("the submission settles")
        .unwrap();
    assert_eq!(
        store.stalled_reads.load(Ordering::SeqCst),
        1,
        "the start's read stalled"
    );
    assert_eq!(reply.text, "relayed");
    assert_eq!(model.requests().len(), 1, "the model was called once");
    let row = store.inner.submission(&receipt.submission_id).await.unwrap().unwrap();
    assert_eq!(row.outcome, Some(Outcome::Completed));
    assert_eq!(row.attempt_count, 1, "the node kept its own attempt");
}

/// Runs until its node gives its work back (never returns).
#[tool]
async fn hold_forever() -> String {
    std::future::pending::<String>().await
}

#[agent]
fn holder() -> &'static str {
    use_model("scripted/x");
    use_tool(hold_forever);
    "Hold."
}

#[tokio::test]
async fn a_submission_given_back_is_taken_over_at_once_by_another_node() {
    use flue_runtime::events::Event;
    let store = FaultyStore::default();
    let first_model = ScriptedModel::new([ScriptedReply::tool_call("hold_forever", json!({}))]);
    // A node with the default 30 s lease runs the submission into its tool.
    let first = runtime(&store, &first_model, holder);
    let mut events = first.observe();
    let receipt = first.init(&holder, "h-1").dispatch("go").await.unwrap();
    loop {
        if let Event::ToolStart { .. } = events.recv().await.unwrap().event {
            break;
        }
    }
    // It stops: what it runs goes back to the queue, and it takes nothing more.
    assert_eq!(first.release().await, 1);
    let next_model = ScriptedModel::new([ScriptedReply::text("resumed")]);
    let next = taking_over(&store, &next_model, holder).await;
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        next.init(&holder, "h-1").read(&receipt.submission_id),
    )
    .await
    .expect("taken over without waiting for the first node's 30 s lease")
    .unwrap();
    assert_eq!(reply.text, "resumed");
    assert_eq!(first_model.requests().len(), 1);
    // The interrupted call is repaired (outcome unknown), not run again on the next node.
    let requests = next_model.requests();
    assert_eq!(requests.len(), 1);
    let row = store.submission(&receipt.submission_id).await.unwrap().unwrap();
    assert_eq!(row.attempt_count, 2, "the given-back attempt and the takeover");
    // The first node settled nothing of it.
    let settlements = records(&store, &InstanceKey::new("holder", "h-1"))
        .await
        .into_iter()
        .filter(|record| matches!(record.body, RecordBody::SubmissionSettled { .. }))
        .count();
    assert_eq!(settlements, 1);
}

/// A send waiting for a submission its node gave back is told the node is stopping: on a
/// store of its own nothing in this process settles it any more (it waited for ever).
#[tokio::test]
async fn a_send_waiting_when_its_node_gives_its_work_back_ends_not_processed_here() {
    use flue_runtime::events::Event;
    let store = flue_runtime::store::MemoryStore::new();
    let model = ScriptedModel::new([ScriptedReply::tool_call("hold_forever", json!({}))]);
    let runtime = harness::runtime_on(store, &model, vec![holder.into()]);
    let mut events = runtime.observe();
    let handle = runtime.init(&holder, "h-2");
    let sent = tokio::spawn(async move { handle.send("go").await });
    loop {
        if let Event::ToolStart { .. } = events.recv().await.unwrap().event {
            break;
        }
    }
    assert_eq!(runtime.release().await, 1);
    let outcome = tokio::time::timeout(std::time::Duration::from_secs(5), sent)
        .await
        .expect("the send ends")
        .unwrap();
    assert!(
        matches!(outcome, Err(flue_runtime::RuntimeError::NotProcessedHere { .. })),
        "{outcome:?}"
    );
}

static DEAF_FINISH_STARTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[agent]
fn deaf_finisher() -> &'static str {
    use_model("scripted/x");
    use_agent_finish(|_ctx| async {
        DEAF_FINISH_STARTED.store(true, Ordering::SeqCst);
        // Deaf to its signal: the attempt outlives its grace.
        std::future::pending::<()>().await;
        Ok::<_, flue_runtime::event_hooks::AppendError>(())
    });
    "Answer."
}

/// An attempt given back (its node stopping) that hangs past its grace is left to the attempt
/// that takes it over: it reports no terminal advisory (`enforce_deadline`, `terminated`),
/// and the submission is queued again, not settled. (Regression: it was reported as a
/// terminated attempt, for a submission that went on elsewhere.)
#[tokio::test]
async fn an_attempt_given_back_that_outlives_its_grace_is_not_reported_terminated() {
    use flue_runtime::events::{Event, RecoveryOutcome};
    let store = flue_runtime::store::MemoryStore::new();
    let model = ScriptedModel::new([ScriptedReply::text("the answer")]);
    let options = RuntimeOptions {
        settle_grace: std::time::Duration::from_millis(100),
        ..RuntimeOptions::default()
    };
    let runtime = harness::runtime_on_with(store.clone(), &model, [deaf_finisher.into()], options);
    let mut events = runtime.observe();
    let receipt = runtime.init(&deaf_finisher, "d-1").dispatch("go").await.unwrap();
    while !DEAF_FINISH_STARTED.load(Ordering::SeqCst) {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(runtime.release().await, 1);
    let mut recoveries = Vec::new();
    let mut seen = 0;
    while let Ok(observation) = events.try_recv() {
        seen += 1;
        if let Event::SubmissionRecovery { outcome, .. } = observation.event {
            recoveries.push(outcome);
        }
    }
    assert!(seen > 3, "the response's events were observed ({seen})");
    assert!(!recoveries.contains(&RecoveryOutcome::Terminated), "{recoveries:?}");
    let row = store.submission(&receipt.submission_id).await.unwrap().unwrap();
    assert_eq!(row.status, flue_runtime::store::SubmissionStatus::Queued, "given back");
}

static GIVEN_BACK_STORE: std::sync::OnceLock<flue_runtime::store::MemoryStore> = std::sync::OnceLock::new();
static STATUS_WHEN_STOPPED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Waits for its attempt's stop, then notes its submission's status in the store.
#[tool]
async fn note_when_stopped(ctx: &ToolContext) -> String {
    ctx.signal().aborted().await;
    let store = GIVEN_BACK_STORE.get().expect("the test's store");
    let rows = store
        .read(&InstanceKey::new("stop_noter", "s-1"), None)
        .await
        .unwrap()
        .iter()
        .flat_map(|batch| batch.records.iter())
        .find_map(|record| record.submission_id.clone());
    let row = store.submission(&rows.unwrap()).await.unwrap().unwrap();
    STATUS_WHEN_STOPPED.lock().unwrap().push(format!("{:?}", row.status));
    "stopped".into()
}

#[agent]
fn stop_noter() -> &'static str {
    use_model("scripted/x");
    use_tool(note_when_stopped);
    "Note."
}

/// `release` stops what runs before it gives it back: a tool that listens to its signal stops
/// while its submission is still this node's (running), not once another node may claim it.
#[tokio::test]
async fn release_stops_a_running_attempt_before_giving_it_back() {
    use flue_runtime::events::Event;
    let store = GIVEN_BACK_STORE
        .get_or_init(flue_runtime::store::MemoryStore::new)
        .clone();
    let model = ScriptedModel::new([ScriptedReply::tool_call("note_when_stopped", json!({}))]);
    let runtime = harness::runtime_on(store.clone(), &model, vec![stop_noter.into()]);
    let mut events = runtime.observe();
    let receipt = runtime.init(&stop_noter, "s-1").dispatch("go").await.unwrap();
    loop {
        if let Event::ToolStart { .. } = events.recv().await.unwrap().event {
            break;
        }
    }
    assert_eq!(runtime.release().await, 1);
    assert_eq!(*STATUS_WHEN_STOPPED.lock().unwrap(), ["Running"]);
    let row = store.submission(&receipt.submission_id).await.unwrap().unwrap();
    assert_eq!(row.status, flue_runtime::store::SubmissionStatus::Queued, "given back");
}

static JOIN_GATE_OPEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Runs until [`JOIN_GATE_OPEN`] is set.
#[tool]
async fn join_gate() -> String {
    while !JOIN_GATE_OPEN.load(Ordering::SeqCst) {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    "open".to_owned()
}

#[agent]
fn join_keeper() -> &'static str {
    use_model("scripted/x");
    use_tool(join_gate);
    "Wait for the gate."
}

/// A delivery joined into a response settles with it: when the response's settlement failed
/// (its row left running, nothing here running it), a read of the delivery waiting on a node
/// that stops is told so, as one of the host is, instead of waiting for ever.
#[tokio::test]
async fn a_read_of_a_delivery_joined_into_an_unsettled_response_ends_when_its_node_stops() {
    use flue_runtime::events::Event;
    use flue_runtime::store::SubmissionStatus;
    let store = FaultyStore::default();
    // The response's settlement fails once: its row stays running, the joined delivery joined.
    store.fail_once(faulty::settles);
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("join_gate", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime(&store, &model, join_keeper);
    let mut events = runtime.observe();
    let handle = runtime.init(&join_keeper, "j-1");
    let host = handle.dispatch("go").await.unwrap();
    loop {
        if let Event::ToolStart { .. } = events.recv().await.unwrap().event {
            break;
        }
    }
    let joined = handle.dispatch("and this too").await.unwrap();
    JOIN_GATE_OPEN.store(true, Ordering::SeqCst);
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while store.failures.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the settlement was tried");
    let row = store.submission(&joined.submission_id).await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.joined_into.as_deref()),
        (SubmissionStatus::Joined, Some(host.submission_id.as_str()))
    );
    runtime.shutdown();
    let waited = tokio::time::timeout(std::time::Duration::from_secs(5), handle.read(&joined.submission_id))
        .await
        .expect("the read ends");
    assert!(
        matches!(waited, Err(flue_runtime::RuntimeError::NotProcessedHere { .. })),
        "{waited:?}"
    );
}

static GATE_OPEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Runs until [`GATE_OPEN`] is set.
#[tool]
async fn gate() -> String {
    while !GATE_OPEN.load(Ordering::SeqCst) {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    "open".to_owned()
}

#[agent]
fn gate_keeper() -> &'static str {
    use_model("scripted/x");
    use_tool(gate);
    "Wait for the gate."
}

/// Reference §3.9 (graceful shutdown stops claiming first): a node shutting down lets what
/// runs finish but starts nothing queued (each claim spends an attempt, and the work would
/// be given back at the end of the grace), and a read waiting for a queued submission is
/// told the node is stopping.
#[tokio::test]
async fn a_node_shutting_down_finishes_what_runs_and_claims_nothing_queued() {
    use flue_runtime::events::Event;
    use flue_runtime::store::{Store as _, SubmissionStatus};
    let store = flue_runtime::store::MemoryStore::new();
    let model = ScriptedModel::new([ScriptedReply::tool_call("gate", json!({})), ScriptedReply::text("done")]);
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    let runtime = Runtime::builder()
        .agent(gate_keeper)
        .providers(providers)
        .store(store.clone())
        .options(RuntimeOptions {
            scan_interval: std::time::Duration::from_millis(20),
            ..RuntimeOptions::default()
        })
        .build()
        .unwrap();
    runtime.start().await;
    let mut events = runtime.observe();
    let handle = runtime.init(&gate_keeper, "g-1");
    let first = handle.dispatch("go").await.unwrap();
    loop {
        if let Event::ToolStart { .. } = events.recv().await.unwrap().event {
            break;
        }
    }
    runtime.shutdown();
    // Work queued once the node is stopping (another node's admission, say), on an instance
    // nothing runs here: the scans that follow do not start it.
    let key = InstanceKey::new("gate_keeper", "g-2");
    store
        .admit(harness::admission(&key, "sub_queued_late", "later"))
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let row = store.submission("sub_queued_late").await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.attempt_count),
        (SubmissionStatus::Queued, 0),
        "nothing queued was claimed"
    );
    let waited = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        runtime.init(&gate_keeper, "g-2").read("sub_queued_late"),
    )
    .await
    .expect("the read ends");
    assert!(
        matches!(waited, Err(flue_runtime::RuntimeError::NotProcessedHere { .. })),
        "{waited:?}"
    );
    // What was running finishes.
    GATE_OPEN.store(true, Ordering::SeqCst);
    let reply = tokio::time::timeout(std::time::Duration::from_secs(5), handle.read(&first.submission_id))
        .await
        .expect("what ran finishes")
        .unwrap();
    assert_eq!(reply.text, "done");
}

#[agent(durability(timeout = "100ms"))]
fn hasty() -> &'static str {
    use_model("scripted/x");
    "Be quick."
}

/// Reference §3.9 step 5: a takeover that finds the submission's deadline passed settles it as
/// timed out without an attempt: none of an attempt's events (`submission_running`, the
/// operation, the agent's start and end) is emitted, and no model call is made.
#[tokio::test]
async fn a_takeover_past_the_deadline_settles_timed_out_without_an_attempt() {
    use flue_runtime::events::Event;
    use flue_runtime::store::{Admission, Claim, Store as _};
    let store = FaultyStore::default();
    // A node that died holding the submission: its lease and the 100 ms budget both run out.
    store
        .admit(Admission {
            timeout_ms: 100,
            claim: Some(Claim {
                attempt_id: "attempt_of_a_dead_node".into(),
                owner_id: "a-dead-node".into(),
                lease_until_ms: flue_runtime::store::now_ms() + 50,
            }),
            ..harness::admission(&InstanceKey::new("hasty", "h-1"), "sub_of_a_dead_node", "hello")
        })
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let model = ScriptedModel::new([ScriptedReply::text("too late")]);
    let runtime = fast_scanning(&store, &model, hasty);
    let mut events = runtime.observe();
    runtime.start().await;
    let error = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runtime.init(&hasty, "h-1").read("sub_of_a_dead_node"),
    )
    .await
    .expect("taken over and settled")
    .unwrap_err();
    let RuntimeError::Run { error_type, .. } = &error else {
        panic!("{error}")
    };
    assert_eq!(error_type, "submission_timeout");
    assert!(model.requests().is_empty(), "no model call");
    let mut attempted = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if matches!(
            observation.event,
            Event::SubmissionRunning { .. } | Event::OperationStart { .. } | Event::AgentStart
        ) {
            attempted.push(observation.event);
        }
    }
    assert!(attempted.is_empty(), "{attempted:?}");
}

#[agent]
fn runaway_across_attempts() -> &'static str {
    use_model("scripted/x");
    use_agent_finish(|ctx| async move { ctx.append(Signal::new("again", "more")) });
    "Never stop."
}

/// Reference §8.23: the finish ceiling counts the response's durable `agent_finish_cycle`
/// records, so a restart does not give a runaway loop another 32 cycles. The commit of the
/// 21st model step fails (a crash there, after 20 durable cycles); the re-attempt makes that
/// call again, counts the 20 cycles and fails at the ceiling after 12 more: one model call
/// more than an uninterrupted response makes, where a count started afresh would allow 32.
#[tokio::test]
async fn the_finish_ceiling_counts_the_cycles_made_before_a_restart() {
    let store = FaultyStore::default();
    let steps = Arc::new(AtomicUsize::new(0));
    let counted = steps.clone();
    store.fail_once(move |records| {
        records
            .iter()
            .any(|record| matches!(record.body, RecordBody::AssistantMessageCompleted { .. }))
            && counted.fetch_add(1, Ordering::SeqCst) + 1 == 21
    });
    let model = ScriptedModel::new((0..80).map(|_| ScriptedReply::text("ok")));
    let runtime = runtime(&store, &model, runaway_across_attempts);
    let error = runtime
        .init(&runaway_across_attempts, "r")
        .send("go")
        .await
        .unwrap_err();
    let RuntimeError::Run {
        error_type, message, ..
    } = error
    else {
        panic!("a run error: {error}")
    };
    assert_eq!(error_type, "agent_finish_ceiling", "{message}");
    assert_eq!(
        store.failures.load(Ordering::SeqCst),
        1,
        "the 21st step's commit failed once"
    );
    assert_eq!(model.requests().len(), 34);
    let durable = records(&store, &InstanceKey::new("runaway_across_attempts", "r"))
        .await
        .iter()
        .filter(|record| matches!(record.body, RecordBody::AgentFinishCycle))
        .count();
    assert_eq!(durable, 32);
}

#[agent(durability(max_attempts = 1))]
fn one_shot_noter() -> &'static str {
    use_model("scripted/x");
    "You answer once."
}

/// Waits until `store`'s one armed failure (a settlement's) happened.
async fn settlement_failed(store: &FaultyStore) {
    for _ in 0..1000 {
        if store.failures.load(Ordering::SeqCst) == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    assert_eq!(store.failures.load(Ordering::SeqCst), 1, "the settlement failed");
}

/// Reference §3.9: a response that ended durably settles completed even past its budget. A
/// takeover whose budget is spent and whose read of the stream fails cannot see that the
/// response ended: it does not settle it failed, but gives it back for an attempt that reads
/// the stream, which settles it completed.
#[tokio::test]
async fn a_spent_budgets_failed_read_does_not_settle_an_ended_response_as_failed() {
    let store = FaultyStore::default();
    store.fail_once(faulty::settles);
    let model = ScriptedModel::new([ScriptedReply::text("done")]);
    let runtime = taking_over(&store, &model, one_shot_noter).await;
    let mut events = runtime.observe();
    let handle = runtime.init(&one_shot_noter, "once-1");
    let receipt = handle.dispatch("hello").await.unwrap();
    settlement_failed(&store).await;
    // The answer is durable, its settlement failed: the next read (the takeover's) fails too.
    store.failing_reads.store(1, Ordering::SeqCst);
    let reply = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while store.failing_reads.load(Ordering::SeqCst) > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        handle.read(&receipt.submission_id).await
    })
    .await
    .expect("the submission settles")
    .unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 2, "a takeover's read failed");
    assert_eq!(reply.text, "done");
    assert_eq!(model.requests().len(), 1, "the answer was not made again");
    assert_eq!(
        settlements_of(&mut events, &receipt.submission_id),
        [Outcome::Completed]
    );
}

static STEPS_SEEN: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

#[agent]
fn step_counter() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("note_step").description("Notes the step.").run(
        |ctx, _: serde_json::Map<String, serde_json::Value>| async move {
            let step = ctx
                .thread()
                .and_then(|thread| thread.execution())
                .map(|execution| execution.step_count());
            STEPS_SEEN.lock().unwrap().push(step.unwrap_or(0));
            Ok::<_, ToolError>("noted")
        },
    ));
    "You count steps."
}

/// `ExecutionState::step_count` is the response's, as its step budget is: a re-attempt after a
/// crash counts on from the durable steps instead of starting again from 0.
#[tokio::test]
async fn a_re_attempts_step_count_goes_on_from_the_durable_steps() {
    let store = FaultyStore::default();
    store.fail_once(faulty::commits_a_tool_batch);
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("note_step", json!({})),
        ScriptedReply::tool_call("note_step", json!({})),
        ScriptedReply::text("counted"),
    ]);
    let runtime = runtime(&store, &model, step_counter);
    let reply = runtime.init(&step_counter, "steps-1").send("count").await.unwrap();
    assert_eq!(reply.text, "counted");
    assert_eq!(
        store.failures.load(Ordering::SeqCst),
        1,
        "the first batch's commit failed"
    );
    // Step 1's tool ran in the first attempt; the re-attempt's first model call is step 2.
    assert_eq!(*STEPS_SEEN.lock().unwrap(), [1, 2]);
}

static HOLD_RUNS: AtomicUsize = AtomicUsize::new(0);
static HOLD_OPEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[agent]
fn queue_holder() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("hold").description("Holds until let go.").run(
        |_ctx, _: serde_json::Map<String, serde_json::Value>| async {
            HOLD_RUNS.fetch_add(1, Ordering::SeqCst);
            while !HOLD_OPEN.load(Ordering::SeqCst) {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            Ok::<_, ToolError>("let go")
        },
    ));
    "You hold."
}

/// A send whose instance has another's submission at the head of its queue (another node's
/// admission, say) does not run that one on its own task: cancelling the send would give that
/// attempt back, run its tools again and spend its budget. A spawned worker runs the queue;
/// the send waits for its own settlement.
#[tokio::test]
async fn a_cancelled_send_does_not_give_back_the_attempt_of_a_submission_ahead_of_it() {
    let store = FaultyStore::default();
    let key = InstanceKey::new("queue_holder", "h-1");
    store
        .admit(Admission {
            key: key.clone(),
            submission_id: "sub_ahead".into(),
            keyed: false,
            kind: flue_runtime::store::SubmissionKind::Dispatch,
            message: DeliveredMessage::user("hold on"),
            initial_data: None,
            uid: flue_runtime::store::UidCondition::Any,
            max_attempts: 3,
            timeout_ms: 3_600_000,
            claim: None,
            trace: None,
        })
        .await
        .unwrap();
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("hold", json!({})),
        ScriptedReply::text("held"),
        ScriptedReply::text("mine"),
    ]);
    let runtime = runtime(&store, &model, queue_holder);
    let handle = runtime.init(&queue_holder, "h-1");
    // The send is cancelled while the submission ahead of it holds.
    let sending = tokio::spawn({
        let handle = handle.clone();
        async move { handle.send("me next").await }
    });
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while HOLD_RUNS.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the submission ahead runs");
    sending.abort();
    assert!(sending.await.unwrap_err().is_cancelled(), "the send was still waiting");
    HOLD_OPEN.store(true, Ordering::SeqCst);
    let ahead = tokio::time::timeout(std::time::Duration::from_secs(10), handle.read("sub_ahead"))
        .await
        .expect("the submission ahead settles")
        .unwrap();
    assert_eq!(ahead.text, "held");
    assert_eq!(HOLD_RUNS.load(Ordering::SeqCst), 1, "its tool ran once");
    let row = store.submission("sub_ahead").await.unwrap().unwrap();
    assert_eq!(row.attempt_count, 1, "no attempt was given back");
}

static CRUNCHES: AtomicUsize = AtomicUsize::new(0);

#[agent]
fn long_cruncher() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("crunch").description("Crunch numbers.").run(
        |_ctx, _: serde_json::Map<String, serde_json::Value>| async {
            CRUNCHES.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
            "crunched"
        },
    ));
    "You crunch numbers."
}

/// A started runtime with a 1 s lease renewed every 50 ms and a scan every 50 ms: leases
/// long enough that a loaded machine's stalls do not lapse them, short beside the 3 s scan.
async fn scanning_slowly_with(store: &FaultyStore, model: &ScriptedModel, agent: impl Into<AgentRef>) -> Runtime {
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    let runtime = Runtime::builder()
        .agent(agent)
        .providers(providers)
        .store(store.clone())
        .options(RuntimeOptions {
            lease: std::time::Duration::from_secs(1),
            heartbeat: std::time::Duration::from_millis(50),
            scan_interval: std::time::Duration::from_millis(50),
            ..RuntimeOptions::default()
        })
        .build()
        .unwrap();
    runtime.start().await;
    runtime
}

/// A node whose scan is slow (many leases to take over, a saturated pool) still renews its
/// own leases on time: another node sharing the store never takes over its live attempt, so
/// the running tool is not run a second time.
#[tokio::test]
async fn a_slow_scan_does_not_hold_up_the_renewal_of_a_nodes_own_leases() {
    let shared: Arc<dyn Store> = Arc::new(flue_runtime::store::MemoryStore::new());
    let slow = FaultyStore::on(shared.clone());
    *slow.stall_scans.lock().unwrap() = Some(std::time::Duration::from_secs(3));
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("crunch", json!({})),
        ScriptedReply::text("crunched it"),
        ScriptedReply::text("crunched it again"),
    ]);
    let first = scanning_slowly_with(&slow, &model, long_cruncher).await;
    let other = scanning_slowly_with(&FaultyStore::on(shared), &model, long_cruncher).await;
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        first.init(&long_cruncher, "lc-1").send("crunch"),
    )
    .await
    .expect("the submission settles")
    .unwrap();
    assert_eq!(reply.text, "crunched it");
    assert_eq!(CRUNCHES.load(Ordering::SeqCst), 1, "the tool ran once");
    let row = slow.submission(&reply.submission_id).await.unwrap().unwrap();
    assert_eq!(row.attempt_count, 1, "no other node took the live attempt over");
    assert_eq!(model.requests().len(), 2, "no step was made again");
    drop(other);
}

/// `release` gives back the running attempts; one claimed but still getting ready (its first
/// read stalled) gives itself back when it finds the node releasing, instead of running on a
/// node about to exit (whose lease would then have to lapse, and whose attempt would count).
#[tokio::test]
async fn an_attempt_getting_ready_when_its_node_releases_its_work_is_given_back_too() {
    let store = FaultyStore::default();
    let model = ScriptedModel::new([ScriptedReply::text("answered")]);
    let runtime = runtime(&store, &model, noter);
    *store.stall_next_read.lock().unwrap() =
        Some((InstanceKey::new("noter", "r-1"), std::time::Duration::from_secs(1)));
    let receipt = runtime.init(&noter, "r-1").dispatch("hello").await.unwrap();
    let status = || async { store.submission(&receipt.submission_id).await.unwrap().unwrap().status };
    // The attempt is claimed and reading the stream (its read stalls for a second).
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while store.stalled_reads.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the start's read stalls");
    assert_eq!(
        status().await,
        flue_runtime::store::SubmissionStatus::Running,
        "claimed"
    );
    assert_eq!(runtime.release().await, 0, "nothing was running yet");
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while status().await != flue_runtime::store::SubmissionStatus::Queued {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("back in the queue for the next node");
    assert!(model.requests().is_empty(), "the released node made no model call");
    let row = store.submission(&receipt.submission_id).await.unwrap().unwrap();
    assert_eq!(row.outcome, None, "not settled");
}

/// A stream that stays unreadable past the budget leaves the submission to a few takeovers
/// (one of them may read it), then settles it as failed: it does not hold the instance's
/// queue for ever.
#[tokio::test]
async fn a_stream_that_stays_unreadable_past_the_budget_settles_after_a_few_takeovers() {
    let store = FaultyStore::default();
    store.failing_reads.store(usize::MAX, Ordering::SeqCst);
    let model = ScriptedModel::new([ScriptedReply::text("never")]);
    let runtime = taking_over(&store, &model, one_shot_noter).await;
    let receipt = runtime
        .init(&one_shot_noter, "unread-1")
        .dispatch("hello")
        .await
        .unwrap();
    let row = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            let row = store.submission(&receipt.submission_id).await.unwrap().unwrap();
            if row.outcome.is_some() {
                return row;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the submission settles");
    store.failing_reads.store(0, Ordering::SeqCst);
    assert_eq!(row.outcome, Some(Outcome::Failed));
    assert_eq!(row.attempt_count, 4, "the last attempt and three takeovers");
    assert!(model.requests().is_empty());
}

static RENDER_BROKEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[agent]
fn redeployed() -> &'static str {
    assert!(
        !RENDER_BROKEN.load(Ordering::SeqCst),
        "the new build's render is broken"
    );
    use_model("scripted/x");
    "You answer."
}

/// Reference §3.9 step 2: a resumed response whose answer is durable settles completed as it
/// is. The node that takes it over (a new build, say) may not render the agent any more: the
/// answer, stored and maybe streamed, still settles completed, not failed.
#[tokio::test]
async fn a_durable_answer_settles_completed_when_the_resumed_render_fails() {
    let store = FaultyStore::default();
    store.fail_once(faulty::settles);
    let model = ScriptedModel::new([ScriptedReply::text("done")]);
    let runtime = taking_over(&store, &model, redeployed).await;
    let mut events = runtime.observe();
    let handle = runtime.init(&redeployed, "r-1");
    let receipt = handle.dispatch("hello").await.unwrap();
    settlement_failed(&store).await;
    RENDER_BROKEN.store(true, Ordering::SeqCst);
    let reply = tokio::time::timeout(std::time::Duration::from_secs(10), handle.read(&receipt.submission_id))
        .await
        .expect("the submission settles");
    RENDER_BROKEN.store(false, Ordering::SeqCst);
    assert_eq!(reply.unwrap().text, "done");
    assert_eq!(model.requests().len(), 1, "the answer was not made again");
    assert_eq!(
        settlements_of(&mut events, &receipt.submission_id),
        [Outcome::Completed]
    );
}

/// A memory store that says it is shared with other nodes, counting how the sends waiting on
/// it look: the rows they read one by one, and the ids each look for settlements names.
#[derive(Clone, Default)]
struct WaitLooksCounted {
    inner: flue_runtime::store::MemoryStore,
    row_reads: Arc<AtomicUsize>,
    looks: Arc<Mutex<Vec<usize>>>,
}

impl Store for WaitLooksCounted {
    harness::delegate_store!(
        inner;
        admit, instance, has_queued, claim_next, renew_leases, expired, reclaim, aborts_requested,
        instances_with_queued, claim_joinable, finalize_join, revert_joins, settle, requeue,
        request_abort, append, read, read_page, last_offset, put_attachment, attachment, user_value,
        set_user_value, list_user_values, create_child,
    );

    fn submission(
        &self,
        id: &str,
    ) -> flue_runtime::BoxFuture<'_, Result<Option<flue_runtime::store::Submission>, flue_runtime::store::StoreError>>
    {
        self.row_reads.fetch_add(1, Ordering::SeqCst);
        self.inner.submission(id)
    }

    fn settled_among<'a>(
        &'a self,
        ids: &'a [String],
    ) -> flue_runtime::BoxFuture<'a, Result<Vec<String>, flue_runtime::store::StoreError>> {
        self.looks.lock().unwrap().push(ids.len());
        self.inner.settled_among(ids)
    }

    fn shared(&self) -> bool {
        true
    }
}

/// On a shared store, where another node may settle what a send here waits on (and its notice
/// may never come), the node looks for the settlements of every wait in one read per poll,
/// not with a read of each wait's row per poll (a thousand waiting sends would make four
/// thousand reads a second): the waits are still answered within a poll or so of the
/// settlement.
#[tokio::test]
async fn waits_on_a_shared_store_look_for_their_settlements_together_each_poll() {
    let store = WaitLooksCounted::default();
    let mut providers = ProviderRegistry::new();
    providers.register(ScriptedModel::new([]));
    let node = Runtime::builder()
        .agent(noter)
        .providers(providers)
        .store(store.clone())
        .options(RuntimeOptions {
            shared_store_poll: std::time::Duration::from_millis(20),
            ..RuntimeOptions::default()
        })
        .build()
        .unwrap();
    // Twenty submissions another node admitted and runs (its lease is live: nothing here
    // takes them over), each waited on here.
    let claim = |n: usize| Claim {
        attempt_id: format!("attempt_elsewhere_{n}"),
        owner_id: "node_elsewhere".into(),
        lease_until_ms: u64::MAX,
    };
    let mut waits = Vec::new();
    for n in 0..20 {
        let key = InstanceKey::new("noter", format!("w-{n}"));
        let mut admission = harness::admission(&key, &format!("sub_elsewhere_{n}"), "hello");
        admission.claim = Some(claim(n));
        store.admit(admission).await.unwrap();
        let handle = node.init(&noter, format!("w-{n}"));
        waits.push(tokio::spawn(
            async move { handle.read(&format!("sub_elsewhere_{n}")).await },
        ));
    }
    // Each wait reads its row once as it starts.
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while store.row_reads.load(Ordering::SeqCst) < 20 {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("every wait started");
    let (reads, looks) = (
        store.row_reads.load(Ordering::SeqCst),
        store.looks.lock().unwrap().len(),
    );
    // Three polls.
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while store.looks.lock().unwrap().len() < looks + 3 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the node looks at each poll");
    assert_eq!(
        store.row_reads.load(Ordering::SeqCst),
        reads,
        "no wait read its row again while nothing settled"
    );
    let during: Vec<usize> = store.looks.lock().unwrap()[looks..].to_vec();
    assert!(
        during.iter().all(|&ids| ids == 20),
        "each look named every wait: {during:?}"
    );
    // The other node settles them, and tells no one.
    for n in 0..20 {
        let settled = store
            .settle(
                &AttemptRef {
                    submission_id: format!("sub_elsewhere_{n}"),
                    attempt_id: format!("attempt_elsewhere_{n}"),
                },
                Outcome::Completed,
                None,
                Vec::new(),
            )
            .await;
        settled.unwrap();
    }
    for wait in waits {
        let reply = tokio::time::timeout(std::time::Duration::from_secs(5), wait)
            .await
            .expect("the wait is answered soon after the settlement, not at its own next look")
            .unwrap()
            .unwrap();
        assert!(reply.submission_id.starts_with("sub_elsewhere_"), "{reply:?}");
    }
}

/// A value `depth` arrays deep (only code builds one past serde_json's 128 levels).
fn nested(depth: usize) -> serde_json::Value {
    (0..depth).fold(json!("core"), |inner, _| json!([inner]))
}

#[agent]
fn deep_writer() -> &'static str {
    use_model("scripted/x");
    let (_, set_history) = use_persistent_state("history", serde_json::Value::Null);
    use_tool(Tool::new("remember").description("Remember.").run(
        move |_ctx, input: serde_json::Map<String, serde_json::Value>| {
            let set_history = set_history.clone();
            async move {
                let depth = input.get("depth").and_then(serde_json::Value::as_u64).unwrap_or(1);
                set_history.set(nested(usize::try_from(depth).unwrap()))?;
                Ok::<_, ToolError>("remembered")
            }
        },
    ));
    "You remember."
}

/// A state value nested deeper than a store reads back is refused when its batch is written,
/// not stored to make the stream unreadable: the attempt is abandoned for that store failure
/// (reported with its reason), the next attempt reports the call's outcome as unknown, and the
/// instance goes on (a value under the bound is kept).
#[tokio::test]
async fn a_state_value_nested_deeper_than_a_store_reads_back_is_refused_and_its_instance_goes_on() {
    let dir = std::env::temp_dir().join(format!("flue-deep-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("remember", json!({ "depth": 600 })),
        ScriptedReply::tool_call("remember", json!({ "depth": 400 })),
        ScriptedReply::text("Remembered."),
    ]);
    let runtime = harness::runtime_on(
        flue_runtime::store::SqliteStore::open(dir.join("flue.db")).unwrap(),
        &model,
        [deep_writer.into()],
    );
    let mut events = runtime.observe();
    let reply = runtime.init(&deep_writer, "d").send("Remember.").await.unwrap();
    assert_eq!(reply.text, "Remembered.");
    let requests = model.requests();
    let (unknown, is_error) = &harness::tool_results(&requests[1])[0];
    assert!(*is_error && unknown.contains("outcome is unknown"), "{unknown}");
    let mut reasons = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let flue_runtime::events::Event::SubmissionRecovery { error, .. } = observation.event {
            reasons.extend(error.map(|error| error.message));
        }
    }
    assert!(
        reasons.iter().any(|reason| reason.contains("deeper than 512 levels")),
        "{reasons:?}"
    );
    let written: Vec<serde_json::Value> = runtime
        .store()
        .read(&InstanceKey::new("deep_writer", "d"), None)
        .await
        .unwrap()
        .iter()
        .flat_map(|batch| batch.records.iter())
        .filter_map(|record| match &record.body {
            RecordBody::StateWrite { value, .. } => Some(value.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(written, [nested(400)]);
    drop(runtime);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The fault store's own rule, which the tests above rely on: a fault armed once fails one
/// write, also after a fault armed always was disarmed (it does not inherit "always").
#[tokio::test]
async fn a_fault_armed_once_after_a_disarmed_permanent_one_fails_one_write() {
    let store = FaultyStore::default();
    let key = InstanceKey::new("relay", "faults");
    store
        .admit(harness::admission(&key, "sub_faults", "hello"))
        .await
        .unwrap();
    let write = || {
        let record = Record {
            id: format!("record_{}", ulid_like()),
            submission_id: None,
            attempt_id: None,
            timestamp: "2026-11-30T00:00:00.000Z".into(),
            body: RecordBody::StateWrite {
                name: "n".into(),
                value: json!(1),
            },
        };
        store.append(&key, vec![record].into(), None)
    };
    store.fail_always(|_| true);
    assert!(write().await.is_err());
    assert!(write().await.is_err(), "armed always");
    store.disarm();
    assert!(write().await.is_ok(), "disarmed");
    store.fail_once(|_| true);
    assert!(write().await.is_err());
    assert!(write().await.is_ok(), "armed once");
    assert_eq!(store.failures.load(Ordering::SeqCst), 3);
}
