//! One response end to end through the runtime, on the memory store, with the scripted model.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use std::sync::Mutex;

use flue_core::message::{Attachment, UserMessage};
use flue_runtime::events::{
    Event, IMAGE_DATA_OMITTED, Observation, OperationKind, TurnPurpose, TurnRequest, TurnResponse,
};
use flue_runtime::prelude::*;
use flue_runtime::provider::{ModelMessage, ProviderRegistry};
use flue_runtime::record::{Outcome, RecordBody};
use flue_runtime::store::{InstanceKey, MemoryStore, UidCondition};
use flue_runtime::testing::{ScriptedModel, ScriptedReply, instructions_of};
use flue_runtime::{Runtime, RuntimeError, RuntimeOptions, SendRequest};
use serde_json::json;

mod harness;
use harness::{Renders, run_error, runtime_with};

/// Add two numbers.
#[tool]
async fn add(
    /// First addend
    a: i64,
    /// Second addend
    b: i64,
) -> String {
    (a + b).to_string()
}

#[agent(max_steps = 4)]
fn calculator() -> &'static str {
    use_model("scripted/calc-1");
    use_tool(add);
    "You add numbers with the add tool."
}

#[tokio::test]
async fn one_exchange_renders_calls_the_model_runs_the_tool_and_answers() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("add", json!({"a": 2, "b": 3})),
        ScriptedReply::text("2 + 3 = 5"),
    ]);
    let runtime = runtime_with(&model, vec![calculator.into()]);
    let reply = runtime.init(&calculator, "c-1").send("What is 2 + 3?").await.unwrap();
    assert_eq!(reply.text, "2 + 3 = 5");
    let requests = model.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[0].model, "calc-1");
    assert_eq!(
        instructions_of(requests[0].system.as_deref()),
        Some("You add numbers with the add tool.")
    );
    assert_eq!(requests[0].tools[0].name, "add");
    assert_eq!(requests[0].messages, [ModelMessage::user("What is 2 + 3?")]);
    let ModelMessage::Tool { content, is_error, .. } = &requests[1].messages[2] else {
        panic!("expected a tool result")
    };
    assert_eq!((content.as_str(), *is_error), ("5", false));
}

#[tokio::test]
async fn an_instance_id_admission_refuses_names_no_instance_anywhere_in_the_api() {
    let model = ScriptedModel::new([]);
    let runtime = runtime_with(&model, vec![calculator.into()]);
    let long = "i".repeat(flue_runtime::MAX_INSTANCE_ID_CHARS + 1);
    for id in ["a\0b", "line\nbreak", long.as_str()] {
        let handle = runtime.init(&calculator, id);
        let refused = handle.send("hi").await.unwrap_err();
        assert!(
            matches!(refused, RuntimeError::InvalidRequest(_)),
            "{id:?}: {refused:?}"
        );
        assert_eq!(
            handle.read("sub_x").await.unwrap_err(),
            RuntimeError::InstanceNotFound(id.to_owned())
        );
        assert!(!handle.abort().await.unwrap());
        assert!(runtime.get_agent_instance(&calculator, id).await.unwrap().is_none());
    }
    assert!(model.requests().is_empty());
}

#[tokio::test]
async fn invalid_tool_arguments_go_back_to_the_model_and_the_tool_does_not_run() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("add", json!({"a": "two"})),
        ScriptedReply::text("Sorry."),
    ]);
    let runtime = runtime_with(&model, vec![calculator.into()]);
    runtime.init(&calculator, "c-2").send("add").await.unwrap();
    let ModelMessage::Tool { content, is_error, .. } = &model.requests()[1].messages[2] else {
        panic!("tool result")
    };
    assert!(*is_error);
    assert!(content.starts_with("Tool argument validation failed:"), "{content}");
    assert!(
        content.ends_with("Call the tool again with corrected arguments."),
        "{content}"
    );
}

/// The arguments of a tool whose schema says more than its type: serde would take `n: 50`.
#[derive(serde::Deserialize, schemars::JsonSchema)]
struct Bounded {
    /// At most ten.
    #[schemars(range(max = 10))]
    n: u32,
}

static BOUNDED_RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[agent]
fn bounded_tool() -> &'static str {
    use_model("scripted/x");
    use_tool(
        Tool::new("bounded")
            .description("Takes a number up to ten.")
            .run(|_ctx, args: Bounded| async move {
                BOUNDED_RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                args.n.to_string()
            }),
    );
    "Count."
}

/// The runtime checks a call's arguments against the tool's schema before it runs: what the
/// schema refuses never reaches the tool, even when its type would take it (a range, a length,
/// a pattern; a tool taking JSON as it comes; an MCP tool), and the model is asked to call
/// again.
#[tokio::test]
async fn arguments_the_schema_refuses_and_the_type_would_take_never_reach_the_tool() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("bounded", json!({"n": 50})),
        ScriptedReply::tool_call("bounded", json!({"n": 5})),
        ScriptedReply::text("Done."),
    ]);
    let runtime = runtime_with(&model, vec![bounded_tool.into()]);
    runtime.init(&bounded_tool, "b").send("count").await.unwrap();
    assert_eq!(
        harness::tool_results(&model.requests()[1])
            .first()
            .map(|(content, error)| (
                content.starts_with("Tool argument validation failed: [/n] 50 is greater than the maximum of 10"),
                *error
            )),
        Some((true, true)),
        "{:?}",
        harness::tool_results(&model.requests()[1])
    );
    // Only the call within range ran.
    assert_eq!(BOUNDED_RUNS.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(
        harness::tool_results(&model.requests()[2]).last().unwrap(),
        &("5".to_owned(), false)
    );
}

/// Divide two numbers.
#[tool]
async fn divide(dividend: i64, divisor: i64) -> Result<String, String> {
    match dividend.checked_div(divisor) {
        Some(quotient) => Ok(quotient.to_string()),
        None => Err(format!("cannot divide {dividend} by {divisor}")),
    }
}

/// Take the square root of a number.
#[tool]
async fn square_root(number: f64) -> Result<String, &'static str> {
    if number < 0.0 {
        Err("a negative number has no real square root")
    } else {
        Ok(number.sqrt().to_string())
    }
}

#[agent(max_steps = 4)]
fn divider() -> &'static str {
    use_model("scripted/calc-1");
    use_tool(divide);
    use_tool(square_root);
    "You divide numbers with the divide tool."
}

#[tokio::test]
async fn a_tool_failing_with_a_string_error_shows_the_model_its_text_as_an_error_result() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("divide", json!({"dividend": 7, "divisor": 0})),
        ScriptedReply::tool_call("square_root", json!({"number": -4.0})),
        ScriptedReply::tool_call("divide", json!({"dividend": 7, "divisor": 2})),
        ScriptedReply::text("7 / 2 = 3"),
    ]);
    let runtime = runtime_with(&model, vec![divider.into()]);
    runtime.init(&divider, "d-1").send("What is 7 / 0?").await.unwrap();
    assert_eq!(
        harness::tool_results(&model.requests()[3]),
        [
            ("cannot divide 7 by 0".to_owned(), true),
            ("a negative number has no real square root".to_owned(), true),
            ("3".to_owned(), false),
        ]
    );
}

#[agent(max_steps = 2)]
fn stubborn() -> &'static str {
    use_model("scripted/x");
    use_tool(add);
    "Loop."
}

#[tokio::test]
async fn max_steps_caps_the_model_calls_of_one_response() {
    let model = ScriptedModel::new((0..5).map(|i| ScriptedReply::tool_call("add", json!({"a": i, "b": 1}))));
    let runtime = runtime_with(&model, vec![stubborn.into()]);
    runtime.init(&stubborn, "s").send("go").await.unwrap();
    assert_eq!(model.requests().len(), 2);
}

/// Sends the model back once more, whatever it answered.
#[agent(max_steps = 1)]
fn never_satisfied() -> &'static str {
    use_model("scripted/x");
    use_agent_finish(|ctx| async move {
        ctx.append(Signal::new("todo", "Check your answer again."))?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    });
    "Answer."
}

/// A finish callback's append at the would-stop point of a response whose `max_steps` are
/// spent cannot be answered: the response fails loudly, and the stream keeps no unanswered
/// signal for the next response's model to read as its own.
#[tokio::test]
async fn a_finish_append_when_no_step_is_left_fails_loudly_and_is_not_committed() {
    let model = ScriptedModel::new([ScriptedReply::text("the answer"), ScriptedReply::text("never asked")]);
    let store = MemoryStore::new();
    let runtime = harness::runtime_on(store.clone(), &model, [never_satisfied.into()]);
    let error = runtime.init(&never_satisfied, "n").send("go").await.unwrap_err();
    let (error_type, message) = run_error(error);
    assert_eq!(
        (error_type.as_str(), message.as_str()),
        (
            "agent_finish_unanswerable",
            "[flue] use_agent_finish appended a continuation signal, but the response has spent its max_steps (1) and can make no further model call; the signal was not stored. The response is failing loudly instead of settling with the check unmet: raise max_steps, or make the hook give up after a bounded number of attempts."
        )
    );
    assert_eq!(model.requests().len(), 1);
    let batches = flue_runtime::store::Store::read(&store, &InstanceKey::new("never_satisfied", "n"), None)
        .await
        .unwrap();
    let signals = batches
        .iter()
        .flat_map(|batch| batch.records.iter())
        .filter(|record| matches!(record.body, RecordBody::Signal { .. } | RecordBody::AgentFinishCycle))
        .count();
    assert_eq!(signals, 0, "no unanswered signal in the stream");
}

/// As `never_satisfied`, with a tool the model calls in its one step.
#[agent(max_steps = 1)]
fn never_satisfied_after_a_tool() -> &'static str {
    use_model("scripted/x");
    use_tool(add);
    use_agent_finish(|ctx| async move {
        ctx.append(Signal::new("todo", "Check your answer again."))?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    });
    "Answer."
}

/// The would-stop point follows however the turns end: a tool batch that spends the last step
/// ends them too, so the finish callbacks run (and their unanswerable append fails the response
/// as after an answer) instead of the response completing with its check skipped.
#[tokio::test]
async fn the_finish_callbacks_run_when_a_tool_batch_spends_the_last_step() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("add", json!({"a": 2, "b": 3})),
        ScriptedReply::text("never asked"),
    ]);
    let runtime = harness::runtime_on(MemoryStore::new(), &model, [never_satisfied_after_a_tool.into()]);
    let error = runtime
        .init(&never_satisfied_after_a_tool, "n")
        .send("go")
        .await
        .unwrap_err();
    assert_eq!(run_error(error).0, "agent_finish_unanswerable");
    assert_eq!(model.requests().len(), 1);
}

static FINISH_LOG: Mutex<Vec<usize>> = Mutex::new(Vec::new());

#[agent]
fn checklist() -> &'static str {
    use_model("scripted/x");
    let (done, _) = use_persistent_state("done", 0u32);
    let (_, set_done) = use_persistent_state("cycles", 0u32);
    let _ = done;
    use_agent_finish(move |ctx| {
        let set_done = set_done.clone();
        async move {
            FINISH_LOG.lock().unwrap().push(ctx.response().tool_calls.len());
            set_done.update(|n| n + 1)?;
            if FINISH_LOG.lock().unwrap().len() < 3 {
                ctx.append(Signal::new("todo", "Keep going: the checklist is not done."))?;
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        }
    });
    "Work through the checklist."
}

#[tokio::test]
async fn use_agent_finish_appends_continue_the_response_until_a_cycle_appends_nothing() {
    let model = ScriptedModel::new([
        ScriptedReply::text("one"),
        ScriptedReply::text("two"),
        ScriptedReply::text("three"),
    ]);
    let runtime = runtime_with(&model, vec![checklist.into()]);
    let reply = runtime.init(&checklist, "k").send("start").await.unwrap();
    assert_eq!(model.requests().len(), 3);
    assert_eq!(reply.text, "one\n\ntwo\n\nthree");
    let last = &model.requests()[2].messages;
    let ModelMessage::User { content, .. } = &last[last.len() - 1] else {
        panic!("a signal")
    };
    assert!(content.starts_with("<signal type=\"todo\">"), "{content}");
    let batches = runtime
        .store()
        .read(&InstanceKey::new("checklist", "k"), None)
        .await
        .unwrap();
    let cycles = batches
        .iter()
        .flat_map(|b| b.records.iter())
        .filter(|r| matches!(r.body, RecordBody::AgentFinishCycle))
        .count();
    assert_eq!(cycles, 2);
}

#[agent]
fn runaway() -> &'static str {
    use_model("scripted/x");
    use_agent_finish(|ctx| async move { ctx.append(Signal::new("again", "more")) });
    "Never stop."
}

#[tokio::test]
async fn a_finish_hook_that_always_appends_fails_at_the_ceiling_of_32_cycles() {
    let model = ScriptedModel::new((0..40).map(|_| ScriptedReply::text("ok")));
    let runtime = runtime_with(&model, vec![runaway.into()]);
    let error = runtime.init(&runaway, "r").send("go").await.unwrap_err();
    let (error_type, message) = run_error(error);
    assert_eq!(error_type, "agent_finish_ceiling");
    assert_eq!(
        message,
        "[flue] use_agent_finish appended a continuation signal after 32 continued cycles in one response — a runaway loop. The response is failing loudly instead of settling as a success; if the model cannot satisfy the check, make the hook give up explicitly (log and return) after a bounded number of attempts."
    );
    assert_eq!(model.requests().len(), 33);
}

#[derive(serde::Serialize, schemars::JsonSchema)]
struct Progress {
    step: String,
}

#[agent]
fn reporter() -> &'static str {
    use_model("scripted/x");
    let progress = use_data_writer::<Progress>("progress");
    let (count, set_count) = use_persistent_state("count", 0u32);
    use_tool(Tool::new("work").description("Do the work.").run(
        move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
            let progress = progress.clone();
            let set_count = set_count.clone();
            async move {
                progress.write(&Progress { step: "working".into() })?;
                set_count.update(|n| n + 1)?;
                Ok::<_, ToolError>("done")
            }
        },
    ));
    use_response_start(|_| json!({"channel": "test"}));
    use_response_finish(|ctx| json!({"tools": ctx.response.tool_calls.len()}));
    if count > 0 { "You worked before." } else { "First time." }
}

#[tokio::test]
async fn state_data_parts_and_metadata_are_durable_and_reach_the_reply() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("work", json!({})),
        ScriptedReply::text("Done."),
        ScriptedReply::text("Again."),
    ]);
    let runtime = runtime_with(&model, vec![reporter.into()]);
    let handle = runtime.init(&reporter, "p");
    let reply = handle.send("work please").await.unwrap();
    assert_eq!(reply.data["progress"], json!({"step": "working"}));
    assert_eq!(
        reply.metadata,
        json!({"channel": "test", "tools": 1}).as_object().unwrap().clone()
    );
    // The sender's reply (built from what its own task committed) is the one read back.
    assert_eq!(handle.read(&reply.submission_id).await.unwrap(), reply);
    // The next submission's render reads the committed state.
    handle.send("again").await.unwrap();
    assert_eq!(
        instructions_of(model.requests()[2].system.as_deref()),
        Some("You worked before.")
    );
}

static LATE_GO: tokio::sync::Notify = tokio::sync::Notify::const_new();
static LATE_DONE: tokio::sync::Notify = tokio::sync::Notify::const_new();
static LATE_WRITES: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// A tool that leaves a task behind holding the render's setter and data writer (it writes
/// when `wait` tells it to, in the next response), and the tool that waits for those writes.
#[agent]
fn leaves_a_writer_behind() -> &'static str {
    use_model("scripted/x");
    let progress = use_data_writer::<Progress>("progress");
    let (_, set_note) = use_persistent_state("note", String::new());
    use_tool(Tool::new("schedule").description("Schedule a late note.").run(
        move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
            let (progress, set_note) = (progress.clone(), set_note.clone());
            async move {
                tokio::spawn(async move {
                    LATE_GO.notified().await;
                    let state = set_note.set("late".to_owned());
                    let data = progress.write(&Progress { step: "late".into() });
                    LATE_WRITES.lock().unwrap().push(format!(
                        "state refused: {}, data refused: {}",
                        state.is_err(),
                        data.is_err()
                    ));
                    LATE_DONE.notify_one();
                });
                Ok::<_, ToolError>("scheduled")
            }
        },
    ));
    use_tool(Tool::new("wait").description("Wait for the late note.").run(
        move |_ctx, _: serde_json::Map<String, serde_json::Value>| async move {
            LATE_GO.notify_one();
            LATE_DONE.notified().await;
            Ok::<_, ToolError>("waited")
        },
    ));
    "Note."
}

/// A setter or data writer a task kept after its response ended writes nothing into the
/// instance's next response: the writes are refused. (Regression: the binding was the
/// instance's, so they landed in whichever response ran, under its submission.)
#[tokio::test]
async fn a_setter_kept_past_its_response_writes_nothing_into_the_next_one() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("schedule", json!({})),
        ScriptedReply::text("Scheduled."),
        ScriptedReply::tool_call("wait", json!({})),
        ScriptedReply::text("Waited."),
    ]);
    let runtime = runtime_with(&model, vec![leaves_a_writer_behind.into()]);
    let handle = runtime.init(&leaves_a_writer_behind, "w");
    handle.send("schedule").await.unwrap();
    let second = handle.send("wait").await.unwrap();
    assert_eq!(
        *LATE_WRITES.lock().unwrap(),
        ["state refused: true, data refused: true"]
    );
    assert!(second.data.get("progress").is_none(), "{:?}", second.data);
    let records = runtime
        .store()
        .read(&InstanceKey::new("leaves_a_writer_behind", "w"), None)
        .await
        .unwrap();
    let shown = format!("{records:?}");
    assert!(!shown.contains("\"late\""), "{shown}");
}

/// A data part with a field left out of its JSON when empty, and one named apart when
/// written.
#[derive(serde::Serialize, schemars::JsonSchema)]
struct Checked {
    step: u32,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    warnings: Vec<String>,
    #[serde(rename(serialize = "doneBy"))]
    done_by: String,
}

#[agent]
fn checker() -> &'static str {
    use_model("scripted/x");
    let checked = use_data_writer::<Checked>("checked");
    use_tool(Tool::new("check").description("Check.").run(
        move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
            let checked = checked.clone();
            async move {
                checked.write(&Checked {
                    step: 1,
                    warnings: Vec::new(),
                    done_by: "me".into(),
                })?;
                Ok::<_, ToolError>("checked")
            }
        },
    ));
    "Check."
}

/// A write is checked against the schema of what serializing the type makes: a field serde
/// leaves out when empty, or names apart when writing, is no mismatch (the schema of what
/// deserializing reads would require `warnings` and `done_by`).
#[tokio::test]
async fn a_data_write_is_checked_against_the_shape_its_type_serializes_to() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("check", json!({})),
        ScriptedReply::text("Done."),
    ]);
    let runtime = runtime_with(&model, vec![checker.into()]);
    let reply = runtime.init(&checker, "c").send("check").await.unwrap();
    assert_eq!(reply.data["checked"], json!({"step": 1, "doneBy": "me"}));
    // The tool's write went through: its result is no error.
    let requests = model.requests();
    let result = requests[1].messages.last().unwrap();
    assert!(format!("{result:?}").contains("checked"), "{result:?}");
}

#[agent]
fn late_reporter() -> &'static str {
    use_model("scripted/x");
    let (started, set_started) = use_persistent_state("started", false);
    // Declared only once a tool has run: the response's first render had no writers.
    if started {
        let _ = use_data_writer::<Progress>("progress");
    }
    use_tool(Tool::new("start").description("Start the work.").run(
        move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
            let set_started = set_started.clone();
            async move {
                set_started.set(true)?;
                Ok::<_, ToolError>("started")
            }
        },
    ));
    "Report as you go."
}

#[tokio::test]
async fn a_data_writer_added_after_a_render_without_writers_fails_the_submission() {
    let model = ScriptedModel::new([ScriptedReply::tool_call("start", json!({})), ScriptedReply::text("ok")]);
    let runtime = runtime_with(&model, vec![late_reporter.into()]);
    let error = runtime.init(&late_reporter, "l").send("go").await.unwrap_err();
    let (error_type, message) = run_error(error);
    assert_eq!(error_type, "render_identity_changed");
    assert!(message.contains("message data added progress"), "{message}");
    // The model was not called again with the changed render.
    assert_eq!(model.requests().len(), 1);
}

#[agent]
fn greeter(props: AgentProps) -> String {
    use_model("scripted/x");
    let start_log = use_dispatch_message();
    let _ = start_log;
    use_agent_start(|ctx| async move {
        if ctx.delivery().body() == "hello" {
            ctx.append(Signal::new("profile", "The user prefers short answers."))?;
        }
        Ok::<_, flue_runtime::event_hooks::AppendError>(())
    });
    format!("Instance {}.", props.id())
}

#[tokio::test]
async fn use_agent_start_appends_reach_the_model_before_its_first_turn() {
    let model = ScriptedModel::new([ScriptedReply::text("Hi.")]);
    let runtime = runtime_with(&model, vec![greeter.into()]);
    runtime.init(&greeter, "g-1").send("hello").await.unwrap();
    let messages = &model.requests()[0].messages;
    assert_eq!(messages.len(), 2);
    let ModelMessage::User { content, .. } = &messages[1] else {
        panic!("signal")
    };
    assert!(content.contains("prefers short answers"));
    assert_eq!(
        instructions_of(model.requests()[0].system.as_deref()),
        Some("Instance g-1.")
    );
}

static ANNOUNCING_CYCLES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[agent]
fn announcing() -> &'static str {
    use_model("scripted/x");
    use_agent_start(|ctx| async move { ctx.append(Signal::new("profile", "Short answers, please.")) });
    use_agent_finish(|ctx| async move {
        if ANNOUNCING_CYCLES.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            ctx.append(Signal::new("todo", "Check the totals."))?;
        }
        Ok::<_, flue_runtime::event_hooks::AppendError>(())
    });
    "Answer."
}

#[tokio::test]
async fn appended_signals_are_announced_to_observers_and_in_agent_end() {
    let model = ScriptedModel::new([ScriptedReply::text("first"), ScriptedReply::text("checked")]);
    let runtime = runtime_with(&model, vec![announcing.into()]);
    let mut events = runtime.observe();
    runtime.init(&announcing, "a").send("go").await.unwrap();
    let user_text = |message: &ModelMessage| match message {
        ModelMessage::User { content, .. } => Some(content.clone()),
        _ => None,
    };
    let (mut started, mut ended, mut at_end) = (Vec::new(), Vec::new(), Vec::new());
    // The agent's runs: each `agent_start` opens one, each `agent_end` closes it with its
    // messages (user texts and assistant texts).
    let mut runs: Vec<Vec<String>> = Vec::new();
    let mut open = false;
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            Event::MessageStart { message } => {
                assert!(open || user_text(&message).is_none(), "a message outside a run");
                started.extend(user_text(&message));
            }
            Event::MessageEnd { message } => ended.extend(user_text(&message)),
            Event::AgentStart => {
                assert!(!open, "runs do not nest");
                open = true;
            }
            Event::AgentEnd { messages } => {
                assert!(open);
                open = false;
                at_end.extend(messages.iter().filter_map(user_text));
                runs.push(
                    messages
                        .iter()
                        .map(|message| match message {
                            ModelMessage::User { content, .. } => content.clone(),
                            ModelMessage::Assistant { text, .. } => text.clone(),
                            other => format!("{other:?}"),
                        })
                        .collect(),
                );
            }
            _ => {}
        }
    }
    assert_eq!(started.len(), 3, "{started:?}");
    assert_eq!(started[0], "go");
    assert!(started[1].starts_with("<signal type=\"profile\">"), "{started:?}");
    assert!(started[2].starts_with("<signal type=\"todo\">"), "{started:?}");
    assert_eq!(ended, started);
    assert_eq!(at_end, started, "agent_end carries them too");
    // Reference §7: `agent_start`/`agent_end` come from the agent loop, once per run: the
    // finish callback's append continues the response in a run of its own, whose `agent_end`
    // carries what it added (the signal and the second answer).
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert_eq!(runs[0].len(), 3, "{runs:?}");
    assert_eq!((runs[0][0].as_str(), runs[0][2].as_str()), ("go", "first"));
    assert_eq!(runs[1].len(), 2, "{runs:?}");
    assert!(runs[1][0].starts_with("<signal type=\"todo\">"), "{runs:?}");
    assert_eq!(runs[1][1], "checked");
}

/// A custom hook that picks a model too: what only the render can catch (two `use_model`
/// calls in the body itself do not compile).
fn use_scripted_defaults() {
    use_model("scripted/y");
}

#[agent]
fn crashing() -> &'static str {
    use_model("scripted/x");
    use_scripted_defaults();
    "never"
}

#[tokio::test]
async fn a_panicking_render_fails_the_submission_with_its_message_and_the_runtime_keeps_working() {
    let model = ScriptedModel::new([ScriptedReply::text("ok")]);
    let runtime = runtime_with(&model, vec![crashing.into(), calculator.into()]);
    let error = runtime.init(&crashing, "x").send("hi").await.unwrap_err();
    let (error_type, message) = run_error(error);
    assert_eq!(error_type, "render_failed");
    assert!(message.starts_with("[flue] use_model() was called twice in one render."));
    let reply = runtime.init(&calculator, "after").send("hi").await.unwrap();
    assert_eq!(reply.text, "ok");
}

/// An agent function that can fail: `?` on a stored value that does not parse.
#[agent]
fn parses_its_limit() -> Result<String, std::num::ParseIntError> {
    use_model("scripted/x");
    let words: u32 = use_persistent_state("limit", "ten".to_owned()).0.parse()?;
    Ok(format!("Answer in {words} words."))
}

#[tokio::test]
async fn an_agent_function_that_returns_an_error_fails_the_submission_with_its_text_and_calls_no_model() {
    let model = ScriptedModel::new([ScriptedReply::text("ok")]);
    let runtime = runtime_with(&model, vec![parses_its_limit.into(), calculator.into()]);
    let error = runtime.init(&parses_its_limit, "x").send("hi").await.unwrap_err();
    assert_eq!(
        run_error(error),
        ("render_failed".to_owned(), "invalid digit found in string".to_owned())
    );
    assert!(model.requests().is_empty(), "no model call");
    let reply = runtime.init(&calculator, "after").send("hi").await.unwrap();
    assert_eq!(reply.text, "ok");
}

#[tokio::test]
async fn submissions_of_one_instance_run_one_at_a_time_in_admission_order() {
    use flue_runtime::store::{Store as _, SubmissionStatus};
    let model = ScriptedModel::echo();
    // The first response's model call is held while the others are admitted.
    let gated = harness::Gated::new(model.clone(), 1);
    let (reached, release) = (gated.reached.clone(), gated.release.clone());
    let mut providers = ProviderRegistry::new();
    providers.register(gated);
    let store = MemoryStore::new();
    let runtime = Runtime::builder()
        .agent(calculator)
        .providers(providers)
        .store(store.clone())
        .build()
        .unwrap();
    let handle = runtime.init(&calculator, "queue");
    let first = handle.dispatch("first").await.unwrap();
    reached.notified().await;
    let second = handle.dispatch("second").await.unwrap();
    let third = handle.dispatch("third").await.unwrap();
    // While the first runs, the others wait their turn: none runs beside it.
    let status = |id: String| {
        let store = store.clone();
        async move { store.submission(&id).await.unwrap().unwrap().status }
    };
    assert_eq!(status(first.submission_id.clone()).await, SubmissionStatus::Running);
    for waiting in [&second, &third] {
        assert_eq!(status(waiting.submission_id.clone()).await, SubmissionStatus::Queued);
    }
    release.add_permits(1);
    let replies = [
        handle.read(&first.submission_id).await.unwrap(),
        handle.read(&second.submission_id).await.unwrap(),
        handle.read(&third.submission_id).await.unwrap(),
    ];
    // Later deliveries may join a live response; every one is answered, in order.
    let seen: Vec<String> = model
        .requests()
        .iter()
        .flat_map(|request| request.messages.iter())
        .filter_map(|message| match message {
            ModelMessage::User { content, .. } => Some(content.clone()),
            _ => None,
        })
        .collect();
    let order: Vec<usize> = ["first", "second", "third"]
        .iter()
        .map(|m| seen.iter().position(|s| s == m).unwrap())
        .collect();
    assert!(order.windows(2).all(|pair| pair[0] < pair[1]), "{seen:?}");
    assert!(replies.iter().all(|reply| !reply.text.is_empty()));
}

#[agent]
fn closer() -> &'static str {
    use_model("scripted/x");
    let dispatch = use_dispatch_message();
    let delivery = use_delivery();
    let opening = delivery.body() == "open";
    // At the response's true end, past its last join point (a dispatch in a finish cycle
    // still joins): the follow-up cannot join it and waits in the queue behind it. The
    // callback is synchronous, so the admission runs on a thread of its own.
    use_response_finish(move |_ctx| {
        if opening {
            let (dispatch, handle) = (dispatch.clone(), tokio::runtime::Handle::current());
            std::thread::spawn(move || {
                handle
                    .block_on(dispatch.dispatch("follow-up"))
                    .expect("the follow-up is admitted");
            })
            .join()
            .unwrap();
        }
    });
    "You close."
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_hands_work_queued_behind_its_submission_on_when_it_settles() {
    let model = ScriptedModel::echo();
    let runtime = runtime_with(&model, vec![closer.into()]);
    let mut events = runtime.observe();
    let reply = runtime.init(&closer, "c").send("open").await.unwrap();
    assert_eq!(reply.text, "You said: open", "the follow-up did not join the response");
    // The send's settlement saw the follow-up queued and woke a worker for it; nothing else
    // would before the periodic scan (15 s).
    let follow_up = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            let observation = events.recv().await.unwrap();
            if matches!(observation.event, Event::SubmissionSettled { .. })
                && observation.submission_id.as_deref() != Some(reply.submission_id.as_str())
            {
                break observation;
            }
        }
    })
    .await
    .expect("the follow-up is processed without waiting for the scan");
    assert!(matches!(
        follow_up.event,
        Event::SubmissionSettled {
            outcome: Outcome::Completed,
            ..
        }
    ));
    assert_eq!(model.requests().len(), 2);
}

#[tokio::test]
async fn conditional_sends_and_idempotency_keys_follow_the_reference() {
    let model = ScriptedModel::echo();
    let runtime = runtime_with(&model, vec![calculator.into()]);
    let created = runtime
        .dispatch_request("calculator", SendRequest::new("c", "hi").uid(UidCondition::CreateOnly))
        .await
        .unwrap();
    let again = runtime
        .dispatch_request("calculator", SendRequest::new("c", "hi").uid(UidCondition::CreateOnly))
        .await
        .unwrap_err();
    assert_eq!(
        again,
        RuntimeError::InstanceExists {
            id: "c".into(),
            uid: created.uid.clone()
        }
    );
    let missing = runtime
        .dispatch_request(
            "calculator",
            SendRequest::new("nobody", "hi").uid(UidCondition::Existing("inst_x".into())),
        )
        .await
        .unwrap_err();
    assert_eq!(missing, RuntimeError::InstanceNotFound("nobody".into()));
    let first = runtime
        .dispatch_request("calculator", SendRequest::new("c", "pay").idempotency_key("k-1"))
        .await
        .unwrap();
    let replay = runtime
        .dispatch_request("calculator", SendRequest::new("c", "pay").idempotency_key("k-1"))
        .await
        .unwrap();
    assert_eq!(first.submission_id, replay.submission_id);
    assert!(first.submission_id.starts_with("sub_ik_") && replay.deduplicated && !first.deduplicated);
    let conflict = runtime
        .dispatch_request("calculator", SendRequest::new("c", "refund").idempotency_key("k-1"))
        .await
        .unwrap_err();
    assert!(matches!(conflict, RuntimeError::SubmissionConflict(_)));
    // At most 256 UTF-16 code units (JavaScript's length): 129 emoji are 258 of them.
    let too_long = runtime
        .dispatch_request(
            "calculator",
            SendRequest::new("c", "pay").idempotency_key("😀".repeat(129)),
        )
        .await
        .unwrap_err();
    assert!(matches!(too_long, RuntimeError::InvalidRequest(_)), "{too_long}");
}

#[tokio::test]
async fn abort_settles_the_running_submission_as_aborted() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("add", json!({"a": 1, "b": 1})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![calculator.into()]);
    let handle = runtime.init(&calculator, "ab");
    let receipt = handle.dispatch("go").await.unwrap();
    assert!(handle.abort().await.unwrap());
    match handle.read(&receipt.submission_id).await {
        Err(RuntimeError::Run {
            error_type, message, ..
        }) => {
            assert_eq!(error_type, "submission_aborted");
            assert_eq!(message, "Submission was aborted.");
        }
        // The memory store answers at once: the abort is stamped before the worker runs.
        Ok(reply) => panic!("the abort was lost: {reply:?}"),
        Err(other) => panic!("unexpected {other}"),
    }
}

/// An abort of an instance of an agent this node does not run (nodes sharing a store may run
/// different agents) stamps its submissions and leaves them to the node that runs it: a
/// worker here would claim the queued head it cannot run, spending an attempt and holding the
/// abort up until the lease lapsed.
#[tokio::test]
async fn an_abort_of_an_agent_this_node_does_not_run_claims_nothing() {
    use flue_runtime::store::SubmissionStatus;
    let model = ScriptedModel::new([]);
    let runtime = runtime_with(&model, vec![calculator.into()]);
    let key = InstanceKey::new("elsewhere", "e");
    runtime
        .store()
        .admit(harness::admission(&key, "sub_elsewhere", "run me elsewhere"))
        .await
        .unwrap();
    let elsewhere = FnAgent::new(AgentDefinition::new("elsewhere"), |_props| "Not run here.");
    assert!(runtime.init(&elsewhere, "e").abort().await.unwrap());
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let row = runtime.store().submission("sub_elsewhere").await.unwrap().unwrap();
    assert_eq!(row.status, SubmissionStatus::Queued, "not claimed here");
    assert!(row.abort_requested);
    assert_eq!(row.attempt_count, 0);
}

/// A heartbeat not shorter than the lease would let leases lapse between renewals, and
/// another node take over a response still running: refused when the runtime is built.
#[test]
fn a_heartbeat_not_shorter_than_the_lease_is_refused() {
    for (lease, heartbeat) in [(5, 10), (10, 10), (10, 0)] {
        let built = Runtime::builder()
            .store(MemoryStore::new())
            .agent(calculator)
            .options(RuntimeOptions {
                lease: std::time::Duration::from_secs(lease),
                heartbeat: std::time::Duration::from_secs(heartbeat),
                ..RuntimeOptions::default()
            })
            .build();
        assert!(
            matches!(&built, Err(RuntimeError::Build(message)) if message.contains("RuntimeOptions::heartbeat")),
            "{lease} s / {heartbeat} s: {:?}",
            built.err()
        );
    }
}

#[tokio::test]
async fn aborting_an_instance_with_nothing_unsettled_loads_no_instance() {
    let model = ScriptedModel::new([]);
    let runtime = runtime_with(&model, vec![calculator.into()]);
    // Neither an instance that does not exist nor an idle one has anything to abort.
    assert!(!runtime.init(&calculator, "never-made").abort().await.unwrap());
    assert_eq!(runtime.cached_instance_count(), 0);
    assert!(!runtime.init(&calculator, "idle").abort().await.unwrap());
    assert_eq!(runtime.cached_instance_count(), 0);
}

/// One exchange of `calculator` (a call of `add`, then the answer) on instance `id`, observed
/// from before it is sent: the runtime and the receiver holding its events.
async fn observed_calculator_exchange(id: &str) -> (Runtime, tokio::sync::broadcast::Receiver<Observation>) {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("add", json!({"a": 1, "b": 2})),
        ScriptedReply::text("3"),
    ]);
    let runtime = runtime_with(&model, vec![calculator.into()]);
    let events = runtime.observe();
    runtime.init(&calculator, id).send("1+2").await.unwrap();
    (runtime, events)
}

#[tokio::test]
async fn observe_delivers_the_lifecycle_of_a_submission_in_order() {
    let (_runtime, mut events) = observed_calculator_exchange("o").await;
    let mut kinds = Vec::new();
    while let Ok(observation) = events.try_recv() {
        kinds.push(match observation.event {
            Event::SubmissionQueued { .. } => "queued",
            Event::SubmissionRunning { .. } => "running",
            Event::AgentStart => "agent_start",
            Event::MessageStart { message } if message.role() == "user" => "user_start",
            Event::MessageEnd { message } if message.role() == "user" => "user_end",
            Event::MessageStart { message } if message.role() == "tool" => "result_start",
            Event::MessageEnd { message } if message.role() == "tool" => "result_end",
            Event::MessageStart { .. } => "assistant_start",
            Event::MessageEnd { .. } => "assistant_end",
            Event::TurnStart { .. } => "turn_start",
            Event::Turn { .. } => "turn",
            Event::ToolStart { .. } => "tool_start",
            Event::Tool { .. } => "tool",
            Event::AgentEnd { .. } => "agent_end",
            Event::Idle => "idle",
            Event::SubmissionSettled {
                outcome: Outcome::Completed,
                ..
            } => "settled",
            _ => continue,
        });
    }
    #[rustfmt::skip]
    let expected = [
        "queued", "running", "agent_start", "user_start", "user_end",
        "turn_start", "assistant_start", "turn", "assistant_end",
        "tool_start", "result_start", "result_end", "tool",
        "turn_start", "assistant_start", "turn", "assistant_end",
        "agent_end", "idle", "settled",
    ];
    assert_eq!(kinds, expected);
}

/// Reference §7.2: `message_start` / `message_end` carry their message and `agent_end` the
/// submission's messages: the input as stored, an assistant step empty at its start and as
/// stored at its end (its tool calls included), a tool's result; images without their bytes.
/// The terminal `tool` event carries the stored result.
#[tokio::test]
async fn message_events_carry_their_messages_and_agent_end_the_submissions() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("add", json!({"a": 1, "b": 2})),
        ScriptedReply::text("3"),
    ]);
    let runtime = runtime_with(&model, vec![calculator.into()]);
    let mut events = runtime.observe();
    let input = DeliveredMessage::User(UserMessage {
        body: "1+2".into(),
        attachments: vec![Attachment::Image {
            data: "iVBORw0KGgo=".into(),
            mime_type: "image/png".into(),
            filename: None,
        }],
    });
    runtime.init(&calculator, "messages").send(input).await.unwrap();
    // The model read the image's bytes; events never carry them.
    let sent = &model.requests()[0].messages[0];
    let ModelMessage::User { images, .. } = sent else {
        panic!("{sent:?}")
    };
    assert_ne!(&*images[0].data, IMAGE_DATA_OMITTED);

    let mut starts = Vec::new();
    let mut ends = Vec::new();
    let mut agent_end = None;
    let mut tool_results = Vec::new();
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            Event::MessageStart { message } => starts.push(message),
            Event::MessageEnd { message } => ends.push(message),
            Event::AgentEnd { messages } => agent_end = Some(messages),
            Event::Tool { result, .. } => tool_results.push(result),
            _ => {}
        }
    }
    assert_eq!(
        tool_results,
        [Some("3".to_owned())],
        "one terminal `tool` event, its stored result"
    );
    let user = ModelMessage::User {
        content: "1+2".into(),
        images: vec![flue_runtime::provider::ModelImage {
            media_type: "image/png".into(),
            data: IMAGE_DATA_OMITTED.into(),
        }],
    };
    let ModelMessage::Assistant { tool_calls, .. } = &ends[1] else {
        panic!("{:?}", ends[1])
    };
    assert_eq!(tool_calls.len(), 1);
    assert_eq!(tool_calls[0].name, "add");
    let arguments: serde_json::Value = serde_json::from_str(&tool_calls[0].arguments).unwrap();
    assert_eq!(arguments, json!({"a": 1, "b": 2}));
    let result = ModelMessage::Tool {
        tool_call_id: tool_calls[0].id.clone(),
        name: "add".into(),
        content: "3".into(),
        is_error: false,
    };
    let answer = ModelMessage::Assistant {
        text: "3".into(),
        tool_calls: Vec::new(),
        reasoning: Vec::new(),
    };
    let empty = ModelMessage::Assistant {
        text: String::new(),
        tool_calls: Vec::new(),
        reasoning: Vec::new(),
    };
    assert_eq!(starts, [user.clone(), empty.clone(), result.clone(), empty]);
    assert_eq!(ends, [user, ends[1].clone(), result, answer]);
    assert_eq!(agent_end.expect("agent_end was published"), ends);
}

/// Reference §7.3: the canonical order of one submission with one tool-calling turn —
/// `operation_start` right before `agent_start`; per turn `turn_start`, `turn_request`, the
/// assistant message with its deltas, `turn`, its `message_end`; per tool its start and result
/// message; the terminal `tool` events, then `turn_messages`; a turn without calls ends with
/// `turn_messages` once its message is durable; `agent_end`, `operation`, `idle`, the settlement.
/// (Our own thread events — `tool_call_started`, `tool_call_done` — are left out here.)
#[tokio::test]
async fn one_tool_calling_submission_emits_the_reference_canonical_order() {
    let (_runtime, mut events) = observed_calculator_exchange("canon").await;
    let mut observed = Vec::new();
    while let Ok(observation) = events.try_recv() {
        observed.push(observation.event);
    }
    let names: Vec<String> = observed
        .iter()
        .filter_map(|event| {
            Some(match event {
                Event::SubmissionQueued { .. } => "submission_queued".to_owned(),
                Event::SubmissionRunning { .. } => "submission_running".to_owned(),
                Event::OperationStart { .. } => "operation_start".to_owned(),
                Event::AgentStart => "agent_start".to_owned(),
                Event::MessageStart { message } => format!("message_start {}", message.role()),
                Event::MessageEnd { message } => format!("message_end {}", message.role()),
                Event::TurnStart { .. } => "turn_start".to_owned(),
                Event::TurnRequest { .. } => "turn_request".to_owned(),
                Event::TextDelta { .. } => "text_delta".to_owned(),
                Event::ToolcallDelta { .. } => "toolcall_delta".to_owned(),
                Event::Turn { .. } => "turn".to_owned(),
                Event::ToolStart { .. } => "tool_start".to_owned(),
                Event::Tool { .. } => "tool".to_owned(),
                Event::TurnMessages { .. } => "turn_messages".to_owned(),
                Event::AgentEnd { .. } => "agent_end".to_owned(),
                Event::Operation { .. } => "operation".to_owned(),
                Event::Idle => "idle".to_owned(),
                Event::SubmissionSettled { .. } => "submission_settled".to_owned(),
                Event::ToolCallStarted { .. } | Event::ToolCallDone { .. } => return None,
                other => format!("unexpected {other:?}"),
            })
        })
        .collect();
    #[rustfmt::skip]
    let expected = [
        "submission_queued", "submission_running",
        "operation_start", "agent_start",
        "message_start user", "message_end user",
        // The tool-calling turn.
        "turn_start", "turn_request", "message_start assistant", "toolcall_delta", "turn",
        "message_end assistant",
        "tool_start", "message_start tool", "message_end tool",
        "tool", "turn_messages",
        // The answering turn.
        "turn_start", "turn_request", "message_start assistant", "text_delta", "turn",
        "message_end assistant", "turn_messages",
        "agent_end", "operation", "idle", "submission_settled",
    ];
    assert_eq!(names, expected);

    // One id per model call, shared by its turn events; every turn here is the agent's own.
    let turn_ids: Vec<(&str, &str)> = observed
        .iter()
        .filter_map(|event| match event {
            Event::TurnStart { turn_id, purpose, .. } => Some(("turn_start", turn_id, purpose)),
            Event::TurnRequest { turn_id, purpose, .. } => Some(("turn_request", turn_id, purpose)),
            Event::Turn { turn_id, purpose, .. } => Some(("turn", turn_id, purpose)),
            Event::TurnMessages { turn_id, purpose, .. } => Some(("turn_messages", turn_id, purpose)),
            _ => None,
        })
        .map(|(kind, turn_id, purpose)| {
            assert_eq!(*purpose, TurnPurpose::Agent, "{kind}");
            (kind, turn_id.as_str())
        })
        .collect();
    assert_eq!(turn_ids.len(), 8);
    let (first, second) = (turn_ids[0].1, turn_ids[4].1);
    assert!(
        first.starts_with("turn_") && second.starts_with("turn_"),
        "{first} {second}"
    );
    assert_ne!(first, second);
    assert!(turn_ids[..4].iter().all(|(_, id)| *id == first), "{turn_ids:?}");
    assert!(turn_ids[4..].iter().all(|(_, id)| *id == second), "{turn_ids:?}");

    // The argument fragments of the call, with its index, id and tool.
    let deltas: Vec<(usize, &str, &str, &str)> = observed
        .iter()
        .filter_map(|event| match event {
            Event::ToolcallDelta {
                index,
                tool_call_id,
                tool_name,
                argument_text_delta,
            } => Some((
                *index,
                tool_call_id.as_str(),
                tool_name.as_str(),
                argument_text_delta.as_str(),
            )),
            _ => None,
        })
        .collect();
    assert_eq!(deltas, [(0, "call_1_0", "add", r#"{"a":1,"b":2}"#)]);

    // Each turn's messages: the assistant step and the results of its calls.
    let messages: Vec<(&ModelMessage, &Vec<ModelMessage>)> = observed
        .iter()
        .filter_map(|event| match event {
            Event::TurnMessages {
                message, tool_results, ..
            } => Some((message, tool_results)),
            _ => None,
        })
        .collect();
    let ModelMessage::Assistant { text, tool_calls, .. } = messages[0].0 else {
        panic!("an assistant message: {:?}", messages[0].0)
    };
    assert_eq!(text, "");
    assert_eq!(tool_calls.len(), 1);
    assert_eq!(
        (tool_calls[0].id.as_str(), tool_calls[0].name.as_str()),
        ("call_1_0", "add")
    );
    assert_eq!(
        messages[0].1,
        &vec![ModelMessage::Tool {
            tool_call_id: "call_1_0".into(),
            name: "add".into(),
            content: "3".into(),
            is_error: false,
        }]
    );
    assert_eq!(
        messages[1].0,
        &ModelMessage::Assistant {
            text: "3".into(),
            tool_calls: Vec::new(),
            reasoning: Vec::new()
        }
    );
    assert!(messages[1].1.is_empty());

    // The operation: one id from start to end, a prompt, successful, with the turns' usage.
    let Some(Event::OperationStart {
        operation_id,
        operation_kind,
    }) = observed
        .iter()
        .find(|event| matches!(event, Event::OperationStart { .. }))
    else {
        panic!("operation_start")
    };
    assert!(operation_id.starts_with("op_"), "{operation_id}");
    assert_eq!(*operation_kind, OperationKind::Prompt);
    let Some(Event::Operation {
        operation_id: ended,
        operation_kind: ended_kind,
        is_error,
        error,
        usage,
        ..
    }) = observed.iter().find(|event| matches!(event, Event::Operation { .. }))
    else {
        panic!("operation")
    };
    assert_eq!((ended, *ended_kind), (operation_id, OperationKind::Prompt));
    assert!(!is_error);
    assert_eq!(*error, None);
    assert_eq!(
        usage.map(|usage| usage.input_tokens),
        Some(20),
        "two calls of 10 input tokens"
    );
}

/// Reference §7.1 (the envelope's correlation): every event of a submission's processing
/// carries its operation's id, and the events of a model turn (deltas and tool events
/// included, which name no turn themselves) carry that turn's id; the submission's own
/// lifecycle events carry neither, the events between turns no turn. `idle` ends the operation
/// and carries its id (the reference emits it before it clears the operation).
#[tokio::test]
async fn observations_carry_the_operation_and_the_turn_they_happened_in() {
    let (runtime, mut events) = observed_calculator_exchange("correlated").await;
    let mut observed = Vec::new();
    while let Ok(observation) = events.try_recv() {
        observed.push(observation);
    }
    let operation = observed
        .iter()
        .find_map(|observation| match &observation.event {
            Event::OperationStart { operation_id, .. } => Some(operation_id.clone()),
            _ => None,
        })
        .expect("operation_start");
    let mut turn = None;
    for observation in &observed {
        let in_operation = !matches!(
            observation.event,
            Event::SubmissionQueued { .. } | Event::SubmissionRunning { .. } | Event::SubmissionSettled { .. }
        );
        assert_eq!(
            observation.operation_id.as_deref(),
            in_operation.then_some(operation.as_str()),
            "{:?}",
            observation.event
        );
        match &observation.event {
            Event::TurnStart { turn_id, .. } => turn = Some(turn_id.clone()),
            Event::AgentStart | Event::AgentEnd { .. } | Event::Operation { .. } | Event::Idle => {
                assert_eq!(observation.turn_id, None, "{:?}", observation.event);
            }
            Event::MessageStart { message } | Event::MessageEnd { message } if message.role() == "user" => {
                assert_eq!(observation.turn_id, None, "{:?}", observation.event);
            }
            _ => {}
        }
        if matches!(
            observation.event,
            Event::TurnStart { .. }
                | Event::TurnRequest { .. }
                | Event::TextDelta { .. }
                | Event::ToolcallDelta { .. }
                | Event::Turn { .. }
                | Event::ToolStart { .. }
                | Event::Tool { .. }
                | Event::TurnMessages { .. }
        ) || matches!(&observation.event, Event::MessageStart { message } | Event::MessageEnd { message } if message.role() != "user")
        {
            assert!(turn.is_some(), "{:?} before any turn", observation.event);
            assert_eq!(observation.turn_id, turn, "{:?}", observation.event);
        }
        if let Event::TurnMessages { turn_id, .. } = &observation.event {
            assert_eq!(Some(turn_id), turn.as_ref());
        }
    }
    // Two turns, two ids; the envelope stamps what the turn events name.
    let stamped: std::collections::BTreeSet<&str> = observed
        .iter()
        .filter_map(|observation| observation.turn_id.as_deref())
        .collect();
    assert_eq!(stamped.len(), 2, "{stamped:?}");
    // Nothing stays correlated once the submission settled: the next one has its own (it
    // fails, the scripted model having no more replies, but runs as an operation all the same).
    let again = runtime.init(&calculator, "correlated").send("again").await;
    assert!(matches!(again, Err(RuntimeError::Run { .. })), "{again:?}");
    let next: Vec<_> = std::iter::from_fn(|| events.try_recv().ok()).collect();
    let next_operation = next
        .iter()
        .find_map(|observation| match &observation.event {
            Event::OperationStart { operation_id, .. } => Some(operation_id.clone()),
            _ => None,
        })
        .expect("the next submission's operation_start");
    assert_ne!(next_operation, operation, "the next submission reused the operation id");
    assert!(
        next.iter()
            .filter_map(|observation| observation.operation_id.as_deref())
            .all(|id| id == next_operation),
        "the next submission's events carry its own operation id"
    );
}

/// Reference §7.2 (Operations row): a failed submission's `operation` is an error and says why.
#[tokio::test]
async fn a_failed_submission_ends_its_operation_with_the_error() {
    let model = ScriptedModel::new([ScriptedReply::Error(flue_runtime::provider::ProviderError::new(
        flue_runtime::provider::ProviderErrorKind::BadRequest,
        "refused",
    ))]);
    let runtime = runtime_with(&model, vec![calculator.into()]);
    let mut events = runtime.observe();
    runtime.init(&calculator, "of").send("1+2").await.unwrap_err();
    let mut operation = None;
    while let Ok(observation) = events.try_recv() {
        if let Event::Operation { is_error, error, .. } = observation.event {
            operation = Some((is_error, error));
        }
    }
    let (is_error, error) = operation.expect("an operation event");
    assert!(is_error);
    let error = error.expect("the failure");
    assert_eq!(error.error_type, "operation_failed");
    assert!(error.message.contains("refused"), "{}", error.message);
}

/// A provider that reasons in two fragments, then answers.
struct Reasoner;

impl flue_runtime::provider::ModelProvider for Reasoner {
    fn id(&self) -> &str {
        "reasoner"
    }

    fn stream(&self, _request: &flue_runtime::provider::ModelRequest) -> flue_runtime::provider::ModelStream {
        use flue_runtime::provider::{ModelResponse, StopReason, StreamEvent};
        let events = vec![
            Ok(StreamEvent::ReasoningDelta("Two ".into())),
            Ok(StreamEvent::ReasoningDelta("and two.".into())),
            Ok(StreamEvent::TextDelta("4".into())),
            Ok(StreamEvent::Completed(ModelResponse {
                text: "4".into(),
                reasoning: "Two and two.".into(),
                tool_calls: Vec::new(),
                stop_reason: StopReason::Stop,
                usage: Default::default(),
                reasoning_blocks: Vec::new(),
            })),
        ];
        Box::pin(futures_util::stream::iter(events))
    }
}

#[agent]
fn thinker() -> &'static str {
    use_model("reasoner/r-1");
    "Think first."
}

/// Reference §7.2 (Messages/deltas row): reasoning streams as `thinking_start`, its
/// `thinking_delta` fragments and `thinking_end`, which closes it before the answer's text.
#[tokio::test]
async fn reasoning_streams_as_thinking_start_deltas_and_end_before_the_answer() {
    let mut providers = ProviderRegistry::new();
    providers.register(Reasoner);
    let runtime = Runtime::builder()
        .store(MemoryStore::new())
        .providers(providers)
        .agent(thinker)
        .build()
        .unwrap();
    let mut events = runtime.observe();
    let reply = runtime.init(&thinker, "t").send("2+2?").await.unwrap();
    assert_eq!(reply.text, "4");
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            Event::MessageStart { message } if message.role() == "assistant" => seen.push("message_start".to_owned()),
            Event::ThinkingStart => seen.push("thinking_start".to_owned()),
            Event::ThinkingDelta { delta } => seen.push(format!("thinking_delta {delta}")),
            Event::ThinkingEnd { content } => seen.push(format!("thinking_end {content}")),
            Event::TextDelta { text } => seen.push(format!("text_delta {text}")),
            Event::Turn { .. } => seen.push("turn".to_owned()),
            _ => {}
        }
    }
    assert_eq!(
        seen,
        [
            "message_start",
            "thinking_start",
            "thinking_delta Two ",
            "thinking_delta and two.",
            "thinking_end Two and two.",
            "text_delta 4",
            "turn",
        ]
    );
}

/// A provider whose first call breaks off mid-reasoning (a retryable network failure), and
/// whose retry reasons and answers.
#[derive(Default)]
struct BrokenReasoner {
    calls: std::sync::atomic::AtomicU32,
}

impl flue_runtime::provider::ModelProvider for BrokenReasoner {
    fn id(&self) -> &str {
        "reasoner"
    }

    fn stream(&self, request: &flue_runtime::provider::ModelRequest) -> flue_runtime::provider::ModelStream {
        use flue_runtime::provider::{ProviderError, ProviderErrorKind, StreamEvent};
        if self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) > 0 {
            return Reasoner.stream(request);
        }
        Box::pin(futures_util::stream::iter(vec![
            Ok(StreamEvent::ReasoningDelta("Hm".into())),
            Err(ProviderError::new(ProviderErrorKind::Network, "connection reset")),
        ]))
    }
}

/// The thinker on a [`BrokenReasoner`], retrying after `retry_delay`.
fn broken_reasoner_runtime(retry_delay: std::time::Duration) -> Runtime {
    let mut providers = ProviderRegistry::new();
    providers.register(BrokenReasoner::default());
    Runtime::builder()
        .store(MemoryStore::new())
        .providers(providers)
        .options(RuntimeOptions {
            model_retry_delay: retry_delay,
            ..RuntimeOptions::default()
        })
        .agent(thinker)
        .build()
        .unwrap()
}

/// A retry after the partial message reached observers ends that message's open reasoning
/// (`thinking_end`) before its `message_end`, and the retry reasons in a new message.
#[tokio::test]
async fn a_call_broken_off_mid_reasoning_ends_its_thinking_before_the_retry() {
    let runtime = broken_reasoner_runtime(std::time::Duration::from_millis(1));
    let mut events = runtime.observe();
    let reply = runtime.init(&thinker, "b").send("2+2?").await.unwrap();
    assert_eq!(reply.text, "4");
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            Event::MessageStart { message } if message.role() == "assistant" => seen.push("message_start"),
            Event::MessageEnd { message } if message.role() == "assistant" => seen.push("message_end"),
            Event::ThinkingStart => seen.push("thinking_start"),
            Event::ThinkingDelta { .. } => seen.push("thinking_delta"),
            Event::ThinkingEnd { .. } => seen.push("thinking_end"),
            Event::TextDelta { .. } => seen.push("text_delta"),
            _ => {}
        }
    }
    #[rustfmt::skip]
    let expected = [
        "message_start", "thinking_start", "thinking_delta", "thinking_end", "message_end",
        "message_start", "thinking_start", "thinking_delta", "thinking_delta", "thinking_end",
        "text_delta", "message_end",
    ];
    assert_eq!(seen, expected);
}

/// An abort while a retry waits out its backoff ends the call's turn and message once: the
/// broken-off call ended its turn and its message before the wait, and no retry starts.
#[tokio::test]
async fn an_abort_during_a_retry_backoff_ends_each_message_once() {
    let runtime = broken_reasoner_runtime(std::time::Duration::from_secs(60));
    let mut events = runtime.observe();
    let handle = runtime.init(&thinker, "b");
    let receipt = handle.dispatch("2+2?").await.unwrap();
    let mut seen = Vec::new();
    let record = |event: &Event, seen: &mut Vec<&'static str>| match event {
        Event::MessageStart { message } if message.role() == "assistant" => seen.push("message_start"),
        Event::MessageEnd { message } if message.role() == "assistant" => seen.push("message_end"),
        Event::Turn { .. } => seen.push("turn"),
        _ => {}
    };
    // The broken-off message ends before the backoff's wait.
    while !seen.contains(&"message_end") {
        let observation = tokio::time::timeout(std::time::Duration::from_secs(10), events.recv())
            .await
            .unwrap()
            .unwrap();
        record(&observation.event, &mut seen);
    }
    assert!(handle.abort().await.unwrap());
    let (error_type, _) = run_error(handle.read(&receipt.submission_id).await.unwrap_err());
    assert_eq!(error_type, "submission_aborted");
    while let Ok(observation) = events.try_recv() {
        record(&observation.event, &mut seen);
    }
    assert_eq!(seen, ["message_start", "turn", "message_end"]);
}

/// Reference §7.2: a call retried after a transient failure is a turn of its own, as in the
/// reference, where the failed call ends its turn (finish reason `error`) and the retry starts
/// the next: two `turn_start`s with different ids, each answered by its `turn`, and the retry's
/// deltas stamped with the second id.
#[tokio::test]
async fn a_retried_call_is_a_turn_of_its_own() {
    let runtime = broken_reasoner_runtime(std::time::Duration::from_millis(1));
    let mut events = runtime.observe();
    let reply = runtime.init(&thinker, "b").send("2+2?").await.unwrap();
    assert_eq!(reply.text, "4");
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        let stamped = observation.turn_id.clone().unwrap_or_default();
        match observation.event {
            Event::TurnStart { turn_id, step, .. } => seen.push(format!("turn_start {turn_id} step {step}")),
            Event::Turn {
                turn_id,
                response,
                is_error,
                step,
                ..
            } => seen.push(format!(
                "turn {turn_id} step {step} {} error={is_error}",
                response.finish_reason
            )),
            Event::TextDelta { .. } => seen.push(format!("text_delta {stamped}")),
            Event::TurnMessages { turn_id, .. } => seen.push(format!("turn_messages {turn_id}")),
            _ => {}
        }
    }
    let turn = |at: usize| seen[at].split(' ').nth(1).unwrap().to_owned();
    let (first, second) = (turn(0), turn(2));
    assert_ne!(first, second, "{seen:?}");
    assert_eq!(
        seen,
        [
            format!("turn_start {first} step 1"),
            format!("turn {first} step 1 error error=true"),
            format!("turn_start {second} step 1"),
            format!("text_delta {second}"),
            format!("turn {second} step 1 stop error=false"),
            format!("turn_messages {second}"),
        ]
    );
}

/// A model that answers its first call and never answers another.
struct AnswersOnce {
    calls: std::sync::atomic::AtomicU32,
}

impl flue_runtime::provider::ModelProvider for AnswersOnce {
    fn id(&self) -> &str {
        "scripted"
    }

    fn stream(&self, _request: &flue_runtime::provider::ModelRequest) -> flue_runtime::provider::ModelStream {
        use flue_runtime::provider::{ModelResponse, StopReason, StreamEvent};
        if self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) > 0 {
            return Box::pin(futures_util::stream::pending());
        }
        Box::pin(futures_util::stream::iter([Ok(StreamEvent::Completed(
            ModelResponse {
                text: "first".into(),
                reasoning: String::new(),
                tool_calls: Vec::new(),
                stop_reason: StopReason::Stop,
                usage: Default::default(),
                reasoning_blocks: Vec::new(),
            },
        ))]))
    }
}

/// A replayed keyed send is answered from its submission: it does not make its caller run
/// the instance's queue (here, work admitted elsewhere that no worker has taken yet, whose
/// model call never ends) before answering.
#[tokio::test]
async fn a_replayed_keyed_send_is_answered_without_running_the_instances_queue_first() {
    let mut providers = ProviderRegistry::new();
    providers.register(AnswersOnce {
        calls: Default::default(),
    });
    let store = MemoryStore::new();
    let runtime = Runtime::builder()
        .store(store.clone())
        .providers(providers)
        .agent(calculator)
        .build()
        .unwrap();
    let handle = runtime.init(&calculator, "r");
    let keyed = || SendRequest::new("r", "hello").idempotency_key("k-1");
    let first = handle.send_request(keyed()).await.unwrap();
    assert_eq!(first.text, "first");
    // Queued on the store directly, as another node admits: no worker of this one runs it.
    let elsewhere = harness::admission(&InstanceKey::new("calculator", "r"), "sub_elsewhere", "from elsewhere");
    flue_runtime::store::Store::admit(&store, elsewhere).await.unwrap();
    let replay = tokio::time::timeout(std::time::Duration::from_secs(5), handle.send_request(keyed()))
        .await
        .expect("the replay is answered at once")
        .unwrap();
    assert_eq!(
        (replay.submission_id.as_str(), replay.text.as_str()),
        (first.submission_id.as_str(), "first")
    );
}

/// The `turn` events `observe()` delivered, in order.
fn observed_turns(
    events: &mut tokio::sync::broadcast::Receiver<flue_runtime::events::Observation>,
) -> Vec<(bool, TurnRequest, TurnResponse)> {
    let mut turns = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let Event::Turn {
            is_error,
            request,
            response,
            ..
        } = observation.event
        {
            turns.push((is_error, request, response));
        }
    }
    turns
}

/// Reference §7.2 (Model turns row): `turn {turnId, purpose, durationMs, request, response,
/// isError}` — the request's summary (provider, model, reasoning level; the messages stay in
/// process) and the normalized response (its output, its usage, its error).
#[tokio::test]
async fn the_turn_event_carries_the_calls_request_and_response() {
    let (_runtime, mut events) = observed_calculator_exchange("tr").await;
    let turns = observed_turns(&mut events);
    assert_eq!(turns.len(), 2);
    let request = TurnRequest {
        provider: "scripted".into(),
        model: "calc-1".into(),
        thinking_level: ThinkingLevel::Medium,
    };
    let (is_error, first_request, first) = &turns[0];
    assert!(!is_error);
    assert_eq!(first_request, &request);
    assert_eq!(first.tool_calls.len(), 1);
    assert_eq!(first.tool_calls[0].name, "add");
    assert_eq!(first.tool_calls[0].arguments, r#"{"a":1,"b":2}"#);
    assert_eq!(first.error, None);
    let (is_error, second_request, second) = &turns[1];
    assert!(!is_error);
    assert_eq!(second_request, &request);
    assert_eq!(second.text, "3");
    assert!(second.tool_calls.is_empty());
    // The scripted model counts 10 input tokens and at least one output token.
    assert_eq!(
        second.usage.map(|usage| (usage.input_tokens, usage.output_tokens)),
        Some((10, 1))
    );
}

#[tokio::test]
async fn a_failed_turn_event_carries_its_error() {
    let model = ScriptedModel::new([ScriptedReply::Error(flue_runtime::provider::ProviderError::new(
        flue_runtime::provider::ProviderErrorKind::BadRequest,
        "refused",
    ))]);
    let runtime = runtime_with(&model, vec![calculator.into()]);
    let mut events = runtime.observe();
    runtime.init(&calculator, "tf").send("1+2").await.unwrap_err();
    let turns = observed_turns(&mut events);
    assert_eq!(turns.len(), 1);
    let (is_error, request, response) = &turns[0];
    assert!(is_error);
    assert_eq!(request.model, "calc-1");
    assert_eq!(response.usage, None);
    let error = response.error.as_ref().expect("the failure");
    assert_eq!(error.error_type, "bad_request");
    assert!(error.message.contains("refused"), "{}", error.message);
}

/// Creation data whose type writes what it cannot read back (a field skipped when
/// serialized) is refused at admission: stored, it would fail every render of the instance for
/// good, creation data never being written again.
#[tokio::test]
async fn initial_data_that_would_not_read_back_as_its_type_once_stored_is_refused() {
    #[derive(serde::Deserialize, serde::Serialize, schemars::JsonSchema)]
    struct Login {
        user: String,
        #[serde(skip_serializing)]
        #[allow(dead_code)] // read only by serde: the field the round trip loses
        token: String,
    }
    let agent = FnAgent::new(AgentDefinition::new("login").initial_data::<Login>(), |_| {
        use_model("scripted/x");
        "Hi."
    });
    let model = ScriptedModel::echo();
    let runtime = runtime_with(&model, vec![AgentRef::new(agent)]);
    let refused = runtime
        .dispatch_request(
            "login",
            SendRequest::new("l", "hi").initial_data(json!({"user": "ada", "token": "t"})),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(refused, RuntimeError::InvalidRequest(ref message) if message.contains("does not read back")),
        "{refused}"
    );
    assert!(
        runtime
            .store()
            .instance(&InstanceKey::new("login", "l"))
            .await
            .unwrap()
            .is_none(),
        "no instance was created"
    );
}

#[tokio::test]
async fn initial_data_is_validated_at_creation_only_and_recorded_as_its_type_reads_it() {
    #[derive(serde::Deserialize, serde::Serialize, schemars::JsonSchema)]
    struct Plan {
        tier: String,
        #[serde(default)]
        seats: u32,
    }
    let agent = FnAgent::new(AgentDefinition::new("onboard").initial_data::<Plan>(), |_| {
        use_model("scripted/x");
        let plan: Option<serde_json::Value> = use_initial_data();
        format!("{plan:?}")
    });
    let model = ScriptedModel::echo();
    let runtime = runtime_with(&model, vec![AgentRef::new(agent)]);
    let bad = runtime
        .dispatch_request("onboard", SendRequest::new("o", "hi").initial_data(json!({"tier": 1})))
        .await
        .unwrap_err();
    assert!(
        matches!(bad, RuntimeError::InvalidRequest(ref message) if message.contains("initial_data")),
        "{bad}"
    );
    // Keys the type does not know are dropped and its defaults filled in (reference feature
    // 25: the birth record holds the schema-parsed data).
    let keyed = || {
        SendRequest::new("o", "hi")
            .initial_data(json!({"tier": "pro", "junk": "x".repeat(64)}))
            .idempotency_key("first")
    };
    let first = runtime.dispatch_request("onboard", keyed()).await.unwrap();
    let info = runtime
        .store()
        .instance(&InstanceKey::new("onboard", "o"))
        .await
        .unwrap()
        .unwrap();
    assert!(info.uid.starts_with("inst_"));
    let batches = runtime
        .store()
        .read(&InstanceKey::new("onboard", "o"), None)
        .await
        .unwrap();
    let RecordBody::ConversationCreated { initial_data, .. } = &batches[0].records[0].body else {
        panic!("a birth record first: {:?}", batches[0].records[0].body);
    };
    assert_eq!(initial_data, &Some(json!({"tier": "pro", "seats": 0})));
    // A replay of the keyed send, as it was sent, is the same admission.
    let replay = runtime.dispatch_request("onboard", keyed()).await.unwrap();
    assert_eq!(replay.submission_id, first.submission_id);
    assert!(replay.deduplicated);
    // Data for an instance that exists is not checked (it creates nothing).
    runtime
        .dispatch_request(
            "onboard",
            SendRequest::new("o", "again").initial_data(json!({"tier": 1})),
        )
        .await
        .unwrap();
    // Nor is its absence.
    runtime
        .dispatch_request("onboard", SendRequest::new("o", "once more"))
        .await
        .unwrap();
}

/// The type's schema constraints, which serde does not know and the catalog publishes, are
/// checked too (the reference answers `invalid_request` for data its schema refuses).
#[tokio::test]
async fn initial_data_outside_its_types_schema_constraints_is_refused() {
    #[derive(serde::Deserialize, serde::Serialize, schemars::JsonSchema)]
    struct Plan {
        #[schemars(range(min = 1, max = 50))]
        seats: u32,
        #[schemars(length(max = 8), regex(pattern = "^[a-z-]+$"))]
        team: String,
    }
    let agent = FnAgent::new(AgentDefinition::new("seated").initial_data::<Plan>(), |_| {
        use_model("scripted/x");
        "Seat them."
    });
    let model = ScriptedModel::echo();
    let runtime = runtime_with(&model, vec![AgentRef::new(agent)]);
    for (data, issue) in [
        (json!({"seats": 0, "team": "core"}), "/seats"),
        (json!({"seats": 5, "team": "much-too-long"}), "/team"),
        (json!({"seats": 5, "team": "Not A Slug"}), "/team"),
    ] {
        let refused = runtime
            .dispatch_request("seated", SendRequest::new("s", "hi").initial_data(data.clone()))
            .await
            .unwrap_err();
        assert!(
            matches!(&refused, RuntimeError::InvalidRequest(message) if message.contains(issue)),
            "{data}: {refused}"
        );
    }
    assert!(
        runtime
            .store()
            .instance(&InstanceKey::new("seated", "s"))
            .await
            .unwrap()
            .is_none()
    );
    runtime
        .dispatch_request(
            "seated",
            SendRequest::new("s", "hi").initial_data(json!({"seats": 5, "team": "core"})),
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn a_send_that_would_create_an_instance_without_the_initial_data_its_type_requires_is_refused() {
    #[derive(serde::Deserialize, serde::Serialize, schemars::JsonSchema)]
    struct Plan {
        tier: String,
    }
    let required = FnAgent::new(AgentDefinition::new("onboard").initial_data::<Plan>(), |_| {
        use_model("scripted/x");
        "Onboard."
    });
    let optional = FnAgent::new(AgentDefinition::new("welcome").initial_data::<Option<Plan>>(), |_| {
        use_model("scripted/x");
        "Welcome."
    });
    let model = ScriptedModel::echo();
    let runtime = runtime_with(&model, vec![AgentRef::new(required), AgentRef::new(optional)]);
    let refused = runtime
        .dispatch_request("onboard", SendRequest::new("o", "hi"))
        .await
        .unwrap_err();
    assert!(
        matches!(refused, RuntimeError::InvalidRequest(ref message) if message.starts_with("This send creates the instance, and the agent requires initialData")),
        "{refused}"
    );
    assert!(
        runtime
            .store()
            .instance(&InstanceKey::new("onboard", "o"))
            .await
            .unwrap()
            .is_none(),
        "no instance was created"
    );
    // A type that accepts no data creates the instance without it.
    runtime
        .dispatch_request("welcome", SendRequest::new("w", "hi"))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_node_that_gave_its_work_back_admits_nothing_new() {
    let model = ScriptedModel::echo();
    let runtime = runtime_with(&model, vec![calculator.into()]);
    runtime.init(&calculator, "before").send("1+2").await.unwrap();
    assert_eq!(runtime.release().await, 0);
    // Admitted, the send would wait for ever: this node claims nothing any more.
    let refused = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        runtime.init(&calculator, "after").send("1+2"),
    )
    .await
    .expect("the send is answered")
    .unwrap_err();
    assert!(matches!(refused, RuntimeError::ShuttingDown), "{refused}");
}

#[agent]
fn waiter() -> &'static str {
    waiting_body()
}

/// A model and one tool that waits until the attempt is aborted.
fn waiting_body() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("wait_forever").description("Wait until aborted.").run(
        |ctx, _: serde_json::Map<String, serde_json::Value>| async move {
            ctx.signal().aborted().await;
            "stopped"
        },
    ));
    "Wait."
}

/// Dispatches "go" to `handle` and aborts it once its tool has started; the submission.
async fn abort_once_its_tool_runs(runtime: &Runtime, handle: &flue_runtime::AgentHandle) -> String {
    let mut events = runtime.observe();
    let receipt = handle.dispatch("go").await.unwrap();
    loop {
        if let Event::ToolStart { .. } = events.recv().await.unwrap().event {
            break;
        }
    }
    assert!(handle.abort().await.unwrap());
    receipt.submission_id
}

#[tokio::test]
async fn abort_cancels_a_running_tool_and_settles_the_submission_as_aborted() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("wait_forever", json!({})),
        ScriptedReply::text("never"),
    ]);
    let runtime = runtime_with(&model, vec![waiter.into()]);
    let handle = runtime.init(&waiter, "w");
    let submission_id = abort_once_its_tool_runs(&runtime, &handle).await;
    let error = handle.read(&submission_id).await.unwrap_err();
    let RuntimeError::Run { details, .. } = &error else {
        panic!("{error}")
    };
    // The reference's details (errors.ts `SubmissionAbortedError`).
    assert_eq!(
        details,
        "The operation was stopped before it produced a completed response."
    );
    let (error_type, message) = run_error(error);
    assert_eq!(
        (error_type.as_str(), message.as_str()),
        ("submission_aborted", "Submission was aborted.")
    );
    assert_eq!(model.requests().len(), 1, "no model call after the abort");
}

#[agent]
fn charger() -> &'static str {
    let (_, set_charges) = use_persistent_state("charges", 0u32);
    use_tool(Tool::new("charge").description("Charge the card.").run(
        move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
            let set_charges = set_charges.clone();
            async move {
                set_charges.update(|n| n + 1)?;
                Ok::<_, ToolError>("charged")
            }
        },
    ));
    waiting_body()
}

/// Reference §3.3 and §3.9: a call's outcome is durable as its tool ends, before its batch
/// commits. An abort while another call of the batch runs keeps it: the stream, the advisory
/// and the next response's model give the call that ended its real result, and only the call
/// the abort stopped the outcome-unknown one. Its state write is not kept: only the attempt's
/// commit of the batch makes state writes real, and the settlement closes the batch without.
#[tokio::test]
async fn an_abort_keeps_the_outcome_of_a_call_that_ended_before_it() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([("charge", json!({})), ("wait_forever", json!({}))]),
        ScriptedReply::text("starting over"),
    ]);
    let store = MemoryStore::new();
    let runtime = harness::runtime_on(store.clone(), &model, vec![charger.into()]);
    let handle = runtime.init(&charger, "charged");
    let key = InstanceKey::new("charger", "charged");
    let outcomes = |store: MemoryStore| {
        let key = key.clone();
        async move {
            flue_runtime::store::Store::read(&store, &key, None)
                .await
                .unwrap()
                .into_iter()
                .flat_map(|batch| batch.records.to_vec())
                .filter_map(|record| match record.body {
                    RecordBody::ToolOutcome {
                        tool_name,
                        content,
                        is_error,
                        ..
                    } => Some((tool_name, content, is_error)),
                    _ => None,
                })
                .collect::<Vec<_>>()
        }
    };
    let mut events = runtime.observe();
    let receipt = handle.dispatch("go").await.unwrap();
    loop {
        if let Event::ToolCallDone { tool_name, .. } = events.recv().await.unwrap().event
            && tool_name == "charge"
        {
            break;
        }
    }
    // Durable while the other call still runs (nothing has committed the batch).
    let mut waited = 0;
    while outcomes(store.clone()).await.is_empty() {
        waited += 1;
        assert!(waited < 500, "the ended call's outcome was never recorded on its own");
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    assert!(handle.abort().await.unwrap());
    handle.read(&receipt.submission_id).await.unwrap_err();
    let unknown = r#"{"type":"interrupted","message":"Tool execution was interrupted before completion. The outcome is unknown."}"#;
    assert_eq!(
        outcomes(store.clone()).await,
        [
            ("charge".to_owned(), "charged".to_owned(), false),
            ("wait_forever".to_owned(), unknown.to_owned(), true)
        ]
    );
    let advised = advisories(&store, &key).await;
    let [(record, _)] = &advised[..] else {
        panic!("one advisory: {advised:?}")
    };
    let RecordBody::Signal { body, .. } = &record.body else {
        unreachable!()
    };
    assert_eq!(
        body,
        "Submission was aborted.\n\nInterrupted tool call(s):\n  - wait_forever (call_1_1)"
    );
    let records: Vec<RecordBody> = flue_runtime::store::Store::read(&store, &key, None)
        .await
        .unwrap()
        .iter()
        .flat_map(|batch| batch.records.iter().map(|record| record.body.clone()))
        .collect();
    assert!(
        records
            .iter()
            .any(|body| matches!(body, RecordBody::ToolResultsCommitted { .. })),
        "the settlement closes the batch: {records:?}"
    );
    assert!(
        !records.iter().any(|body| matches!(body, RecordBody::StateWrite { .. })),
        "the aborted batch's state write is absent: {records:?}"
    );
    handle.send("again").await.unwrap();
    let results: Vec<(String, String)> = model.requests()[1]
        .messages
        .iter()
        .filter_map(|message| match message {
            ModelMessage::Tool { name, content, .. } => Some((name.clone(), content.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        results,
        [
            ("charge".to_owned(), "charged".to_owned()),
            ("wait_forever".to_owned(), unknown.to_owned())
        ]
    );
}

/// The advisory signal records of `key`'s stream (a submission's terminal settlement leaves
/// one), with the record that follows each.
async fn advisories(store: &MemoryStore, key: &InstanceKey) -> Vec<(flue_runtime::record::Record, Option<RecordBody>)> {
    let records: Vec<_> = flue_runtime::store::Store::read(store, key, None)
        .await
        .unwrap()
        .into_iter()
        .flat_map(|batch| batch.records.to_vec())
        .collect();
    records
        .iter()
        .enumerate()
        .filter(|(_, record)| {
            matches!(&record.body, RecordBody::Signal { signal_type, .. }
                if signal_type == "submission_aborted" || signal_type == "submission_interrupted")
        })
        .map(|(index, record)| (record.clone(), records.get(index + 1).map(|next| next.body.clone())))
        .collect()
}

/// Reference §3.9 and §4.6: an aborted submission leaves a `submission_aborted` advisory in
/// the conversation, with its settlement, so the model of the next response reads that the
/// previous one was cut off (after the interrupted call's outcome-unknown result).
#[tokio::test]
async fn an_aborted_submission_leaves_an_advisory_that_the_next_responses_model_reads() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("wait_forever", json!({})),
        ScriptedReply::text("starting over"),
    ]);
    let store = MemoryStore::new();
    let runtime = harness::runtime_on(store.clone(), &model, vec![waiter.into()]);
    let handle = runtime.init(&waiter, "advised");
    let submission_id = abort_once_its_tool_runs(&runtime, &handle).await;
    handle.read(&submission_id).await.unwrap_err();
    let id = submission_id.as_str();
    let advised = advisories(&store, &InstanceKey::new("waiter", "advised")).await;
    let [(record, next)] = &advised[..] else {
        panic!("one advisory: {advised:?}")
    };
    assert_eq!(record.id, format!("record_submission_aborted_{id}"));
    assert_eq!(record.submission_id.as_deref(), Some(id));
    let RecordBody::Signal {
        message_id,
        signal_type,
        body,
        attributes,
        tag_name,
    } = &record.body
    else {
        unreachable!()
    };
    assert_eq!(message_id, &format!("entry_submission_aborted_{id}"));
    // It names the call the abort interrupted (reference `recordSubmissionTerminal`).
    assert_eq!(
        (signal_type.as_str(), body.as_str()),
        (
            "submission_aborted",
            "Submission was aborted.\n\nInterrupted tool call(s):\n  - wait_forever (call_1_0)"
        )
    );
    assert_eq!(
        serde_json::to_value(attributes).unwrap(),
        json!({"submissionId": id, "kind": "dispatch", "reason": "aborted", "interruptedTools": r#"[{"id":"call_1_0","name":"wait_forever"}]"#})
    );
    assert_eq!(tag_name, &None);
    assert!(
        matches!(
            next,
            Some(RecordBody::SubmissionSettled {
                outcome: Outcome::Aborted,
                ..
            })
        ),
        "written with the settlement: {next:?}"
    );

    let reply = handle.send("again").await.unwrap();
    assert_eq!(reply.text, "starting over");
    let requests = model.requests();
    let users: Vec<&str> = requests[1]
        .messages
        .iter()
        .filter_map(|message| match message {
            ModelMessage::User { content, .. } => Some(content.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        users,
        [
            "go".to_owned(),
            format!(
                "<signal type=\"submission_aborted\" interruptedTools=\"[{{&quot;id&quot;:&quot;call_1_0&quot;,&quot;name&quot;:&quot;wait_forever&quot;}}]\" kind=\"dispatch\" reason=\"aborted\" submissionId=\"{id}\">\nSubmission was aborted.\n\nInterrupted tool call(s):\n  - wait_forever (call_1_0)\n</signal>"
            ),
            "again".to_owned(),
        ]
    );
    // The interrupted call is closed before the advisory, as the model needs its result next
    // to its call.
    let tool_at = requests[1]
        .messages
        .iter()
        .position(|message| matches!(message, ModelMessage::Tool { .. }))
        .unwrap();
    let advisory_at = requests[1]
        .messages
        .iter()
        .position(|message| matches!(message, ModelMessage::User { content, .. } if content.starts_with("<signal")))
        .unwrap();
    assert!(tool_at < advisory_at);
    // The advisory is not the next response's input: that settles as completed.
    assert!(advisories(&store, &InstanceKey::new("waiter", "advised")).await.len() == 1);
}

#[agent]
fn chatty() -> &'static str {
    use_model("scripted/x");
    use_agent_start(|_ctx| async {});
    use_agent_start(|ctx| async move {
        ctx.log().info("starting");
    });
    use_agent_finish(|ctx| async move {
        ctx.log().info("finishing");
    });
    use_tool(Tool::new("note").description("Take a note.").run(
        |ctx, _: serde_json::Map<String, serde_json::Value>| async move {
            ctx.log().info("noted");
            "ok"
        },
    ));
    "Chat."
}

/// Reference §7.2: a tool's log lines carry `tool` and `toolCallId`, a callback's `hook` and
/// `hookIndex` (from 0, in declaration order).
#[tokio::test]
async fn log_lines_say_which_tool_call_or_callback_logged_them() {
    let model = ScriptedModel::new([ScriptedReply::tool_call("note", json!({})), ScriptedReply::text("done")]);
    let runtime = runtime_with(&model, vec![chatty.into()]);
    let mut events = runtime.observe();
    runtime.init(&chatty, "c").send("hi").await.unwrap();
    let mut logs = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let Event::Log {
            message, attributes, ..
        } = observation.event
        {
            logs.push((message, serde_json::to_value(attributes).unwrap()));
        }
    }
    assert_eq!(
        logs,
        [
            (
                "starting".to_owned(),
                json!({"hook": "use_agent_start", "hookIndex": 1})
            ),
            ("noted".to_owned(), json!({"tool": "note", "toolCallId": "call_1_0"})),
            (
                "finishing".to_owned(),
                json!({"hook": "use_agent_finish", "hookIndex": 0})
            ),
        ]
    );
}

/// Its budget outlasts the first model call and the tool call's commit on a loaded machine:
/// what the tests check is where the deadline finds the attempt, waiting in the tool.
#[agent(durability(timeout = "2s"))]
fn impatient_waiter() -> &'static str {
    waiting_body()
}

#[tokio::test]
async fn the_timeout_aborts_a_live_attempt_wherever_it_waits_and_settles_it_as_timed_out() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("wait_forever", json!({})),
        ScriptedReply::text("never"),
    ]);
    let runtime = runtime_with(&model, vec![impatient_waiter.into()]);
    let handle = runtime.init(&impatient_waiter, "t");
    let receipt = handle.dispatch("go").await.unwrap();
    // Nothing but the 2 s budget ends the tool: it waits for an abort that nobody requests.
    let error = tokio::time::timeout(std::time::Duration::from_secs(20), handle.read(&receipt.submission_id))
        .await
        .expect("the deadline ended the attempt")
        .unwrap_err();
    let RuntimeError::Run { details, .. } = &error else {
        panic!("{error}")
    };
    // The reference's details (errors.ts `SubmissionTimeoutError`).
    assert_eq!(
        details,
        "The operation ran longer than the configured durability timeout."
    );
    let (error_type, message) = run_error(error);
    assert_eq!(
        (error_type.as_str(), message.as_str()),
        ("submission_timeout", "Submission exceeded the configured timeout.")
    );
    assert_eq!(model.requests().len(), 1, "no model call after the deadline");
}

/// Reference §3.9: a submission whose time ran out leaves a `submission_interrupted`
/// advisory saying so (`reason: exceeded_timeout`), with its settlement.
#[tokio::test]
async fn a_timed_out_submission_leaves_an_interrupted_advisory() {
    let model = ScriptedModel::new([ScriptedReply::tool_call("wait_forever", json!({}))]);
    let store = MemoryStore::new();
    let runtime = harness::runtime_on(store.clone(), &model, vec![impatient_waiter.into()]);
    let handle = runtime.init(&impatient_waiter, "late");
    let receipt = handle.dispatch("go").await.unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(20), handle.read(&receipt.submission_id))
        .await
        .expect("the deadline ended the attempt")
        .unwrap_err();
    let id = receipt.submission_id.as_str();
    let advised = advisories(&store, &InstanceKey::new("impatient_waiter", "late")).await;
    let [(record, next)] = &advised[..] else {
        panic!("one advisory: {advised:?}")
    };
    assert_eq!(record.id, format!("record_submission_interrupted_{id}"));
    let RecordBody::Signal {
        signal_type,
        body,
        attributes,
        ..
    } = &record.body
    else {
        unreachable!()
    };
    assert_eq!(
        (signal_type.as_str(), body.as_str()),
        (
            "submission_interrupted",
            "Submission exceeded the configured timeout.\n\nInterrupted tool call(s):\n  - wait_forever (call_1_0)"
        )
    );
    assert_eq!(
        serde_json::to_value(attributes).unwrap(),
        json!({"submissionId": id, "kind": "dispatch", "reason": "exceeded_timeout", "interruptedTools": r#"[{"id":"call_1_0","name":"wait_forever"}]"#})
    );
    assert!(matches!(
        next,
        Some(RecordBody::SubmissionSettled {
            outcome: Outcome::Failed,
            ..
        })
    ));
}

/// A submission that failed on its own (its model call, here) leaves no advisory: its
/// records already say what happened.
#[tokio::test]
async fn a_submission_that_failed_on_its_own_leaves_no_advisory() {
    // No reply scripted: the model call fails.
    let model = ScriptedModel::new([]);
    let store = MemoryStore::new();
    let runtime = harness::runtime_on(store.clone(), &model, vec![waiter.into()]);
    let error = runtime.init(&waiter, "plain-failure").send("go").await.unwrap_err();
    assert!(matches!(error, RuntimeError::Run { .. }), "{error}");
    assert!(
        advisories(&store, &InstanceKey::new("waiter", "plain-failure"))
            .await
            .is_empty()
    );
}

static LISTENING_STARTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A start callback that waits for its abort signal and then fails, as a callback that
/// listens to it does.
fn listening_start() {
    use_model("scripted/x");
    use_agent_start(|ctx| async move {
        LISTENING_STARTS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        ctx.signal().aborted().await;
        Err::<(), _>("the start work was cut off")
    });
}

#[agent]
fn listening_starter() -> &'static str {
    listening_start();
    "Start."
}

#[agent(durability(timeout = "300ms"))]
fn impatient_listening_starter() -> &'static str {
    listening_start();
    "Start."
}

/// Reference §3.10 and §6.4: a submission whose signal fired settles aborted (or timed out,
/// when its deadline fired it) even when what ends first is a callback failing because of
/// the signal: the failure is the abort's, not the callback's own (`agent_start_failed`).
#[tokio::test]
async fn a_start_callback_failing_on_its_abort_signal_settles_the_submission_aborted_or_timed_out() {
    let model = ScriptedModel::new([]);
    let runtime = runtime_with(
        &model,
        vec![listening_starter.into(), impatient_listening_starter.into()],
    );
    let handle = runtime.init(&listening_starter, "aborted");
    let receipt = handle.dispatch("go").await.unwrap();
    while LISTENING_STARTS.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(handle.abort().await.unwrap());
    let (error_type, message) = run_error(handle.read(&receipt.submission_id).await.unwrap_err());
    assert_eq!(
        (error_type.as_str(), message.as_str()),
        ("submission_aborted", "Submission was aborted.")
    );
    let handle = runtime.init(&impatient_listening_starter, "timed-out");
    let receipt = handle.dispatch("go").await.unwrap();
    let error = tokio::time::timeout(std::time::Duration::from_secs(20), handle.read(&receipt.submission_id))
        .await
        .expect("the deadline ended the attempt")
        .unwrap_err();
    let (error_type, message) = run_error(error);
    assert_eq!(
        (error_type.as_str(), message.as_str()),
        ("submission_timeout", "Submission exceeded the configured timeout.")
    );
    assert!(model.requests().is_empty(), "no model call after either");
}

/// Its budget outlasts the one model call and the answer's commit on a loaded machine.
#[agent(durability(timeout = "2s"))]
fn answered_then_stuck() -> &'static str {
    use_model("scripted/x");
    use_agent_finish(|_ctx| async {
        // Deaf to the deadline's abort, after the final answer was committed.
        std::future::pending::<()>().await;
        Ok::<_, flue_runtime::event_hooks::AppendError>(())
    });
    "Answer."
}

/// Reference §3.9 step 2: settling over an attempt given up after its grace is a
/// reconciliation, and completed work wins: a response whose final answer is durable settles
/// as completed (with its answer), not as timed out, and leaves no advisory.
#[tokio::test]
async fn an_attempt_given_up_after_its_answer_was_durable_settles_as_completed() {
    let model = ScriptedModel::new([ScriptedReply::text("the answer")]);
    let store = MemoryStore::new();
    let options = RuntimeOptions {
        settle_grace: std::time::Duration::from_millis(100),
        ..RuntimeOptions::default()
    };
    let runtime = harness::runtime_on_with(store.clone(), &model, [answered_then_stuck.into()], options);
    let handle = runtime.init(&answered_then_stuck, "a");
    let reply = tokio::time::timeout(std::time::Duration::from_secs(10), handle.send("go"))
        .await
        .expect("settled over the hung callback")
        .unwrap();
    assert_eq!(reply.text, "the answer");
    let advised = advisories(&store, &InstanceKey::new("answered_then_stuck", "a")).await;
    assert!(advised.is_empty(), "{advised:?}");
}

static LISTENING_FINISHES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[agent]
fn answered_then_listening() -> &'static str {
    use_model("scripted/x");
    use_agent_finish(|ctx| async move {
        // Listens to the signal, after the final answer was committed, and fails with it.
        LISTENING_FINISHES.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        ctx.signal().aborted().await;
        Err::<(), _>(format!("stopped: {}", ctx.signal().reason().unwrap_or_default()))
    });
    use_response_finish(|_ctx| json!({"finished": true}));
    "Answer."
}

/// Reference §3.10: an abort that loses the race to completion settles completed. A finish
/// callback that listens to the signal and fails with it, after the final answer was
/// committed, does not fail the response, which ends as it is: completed, with its answer and
/// its finish callbacks' metadata, not aborted.
#[tokio::test]
async fn an_abort_while_a_finish_callback_runs_after_a_durable_answer_settles_completed() {
    let model = ScriptedModel::new([ScriptedReply::text("the answer")]);
    let store = MemoryStore::new();
    let runtime = harness::runtime_on(store.clone(), &model, [answered_then_listening.into()]);
    let handle = runtime.init(&answered_then_listening, "a");
    let receipt = handle.dispatch("go").await.unwrap();
    while LISTENING_FINISHES.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(handle.abort().await.unwrap());
    let reply = tokio::time::timeout(std::time::Duration::from_secs(10), handle.read(&receipt.submission_id))
        .await
        .expect("settled")
        .expect("completed, not aborted");
    assert_eq!(reply.text, "the answer");
    assert_eq!(
        reply.metadata.get("finished"),
        Some(&json!(true)),
        "{:?}",
        reply.metadata
    );
    assert_eq!(model.requests().len(), 1, "one model call");
}

static BROKEN_FINISHES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[agent]
fn answered_then_broken_finish() -> &'static str {
    use_model("scripted/x");
    use_agent_finish(|ctx| async move {
        BROKEN_FINISHES.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        ctx.signal().aborted().await;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    });
    use_response_finish(|_ctx| Err::<serde_json::Value, _>("the ledger is closed"));
    "Answer."
}

/// A `use_response_finish` callback is given no signal: when it fails after an abort that
/// lost the race to the durable answer, the failure is its own, reported with its message,
/// not hidden under `submission_aborted`.
#[tokio::test]
async fn a_response_finish_failure_after_a_lost_abort_race_is_reported_as_its_own() {
    let model = ScriptedModel::new([ScriptedReply::text("the answer")]);
    let runtime = runtime_with(&model, [answered_then_broken_finish.into()]);
    let handle = runtime.init(&answered_then_broken_finish, "a");
    let receipt = handle.dispatch("go").await.unwrap();
    while BROKEN_FINISHES.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(handle.abort().await.unwrap());
    let error = tokio::time::timeout(std::time::Duration::from_secs(10), handle.read(&receipt.submission_id))
        .await
        .expect("settled")
        .expect_err("the finish callback failed");
    let RuntimeError::Run {
        error_type, message, ..
    } = &error
    else {
        panic!("a run error: {error}")
    };
    assert_eq!(error_type, "response_hook_failed", "{error}");
    assert!(message.contains("the ledger is closed"), "{message}");
}

static CAPTURED_THREAD: Mutex<Option<flue_core::lifecycle::ThreadState>> = Mutex::new(None);
static AUDITS_RUN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Keeps the thread, for the test to queue a call through later.
#[tool]
async fn keep_thread(ctx: &ToolContext) -> String {
    *CAPTURED_THREAD.lock().unwrap() = ctx.thread().cloned();
    "kept".into()
}

/// Audits.
#[tool]
async fn late_audit() -> String {
    AUDITS_RUN.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    "audited".into()
}

#[agent]
fn answered_then_closing() -> &'static str {
    use_model("scripted/x");
    use_tool(keep_thread);
    use_tool(late_audit);
    let (_closed, set_closed) = use_persistent_state("closed", false);
    use_agent_finish(move |_ctx| {
        let set_closed = set_closed.clone();
        async move {
            set_closed.set(true)?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        }
    });
    "Answer."
}

type Trigger = std::sync::Arc<Mutex<Option<flue_runtime::BoxFuture<'static, ()>>>>;

/// The memory store, running `trigger` (once) while the finish cycle's state write waits to
/// be appended.
struct FiresDuringFinishCommit {
    inner: MemoryStore,
    trigger: Trigger,
}

impl flue_runtime::store::Store for FiresDuringFinishCommit {
    harness::delegate_store!(
        inner;
        admit, instance, submission, has_queued, claim_next, renew_leases, expired, reclaim,
        aborts_requested, instances_with_queued, claim_joinable, finalize_join, revert_joins, requeue,
        request_abort, read, put_attachment, attachment, user_value, set_user_value,
        list_user_values, create_child, settle,
    );

    fn append(
        &self,
        key: &InstanceKey,
        records: std::sync::Arc<[flue_runtime::record::Record]>,
        attempt: Option<&flue_runtime::store::AttemptRef>,
    ) -> flue_runtime::BoxFuture<'_, Result<u64, flue_runtime::store::StoreError>> {
        let finishing = records
            .iter()
            .any(|record| matches!(&record.body, RecordBody::StateWrite { name, .. } if name == "closed"));
        let fire = if finishing {
            self.trigger.lock().unwrap().take()
        } else {
            None
        };
        let (key, attempt) = (key.clone(), attempt.cloned());
        Box::pin(async move {
            if let Some(fire) = fire {
                fire.await;
            }
            self.inner.append(&key, records, attempt.as_ref()).await
        })
    }
}

/// Reference §3.10: an abort that fires while the finish cycle's writes are being committed,
/// after the final answer was durable, lost the race: the response completes as it is. A call
/// queued meanwhile does not start (nor is it recorded as a step whose outcome would be
/// unknown), and the response is not settled aborted.
#[tokio::test]
async fn an_abort_during_the_finish_commit_of_an_answered_response_runs_no_queued_call_and_completes() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("keep_thread", json!({})),
        ScriptedReply::text("the answer"),
    ]);
    let trigger = Trigger::default();
    let store = MemoryStore::new();
    let runtime = harness::runtime_on(
        FiresDuringFinishCommit {
            inner: store.clone(),
            trigger: trigger.clone(),
        },
        &model,
        [answered_then_closing.into()],
    );
    let handle = runtime.init(&answered_then_closing, "a");
    let firing = handle.clone();
    *trigger.lock().unwrap() = Some(Box::pin(async move {
        let thread = CAPTURED_THREAD
            .lock()
            .unwrap()
            .clone()
            .expect("the tool kept the thread");
        thread.queue_tool(late_audit, json!({})).unwrap();
        assert!(firing.abort().await.unwrap(), "the response was running");
    }));
    let reply = tokio::time::timeout(std::time::Duration::from_secs(10), handle.send("go"))
        .await
        .expect("settled")
        .expect("completed, not aborted");
    assert_eq!(reply.text, "the answer");
    assert!(
        trigger.lock().unwrap().is_none(),
        "the abort fired during the finish commit"
    );
    assert_eq!(
        AUDITS_RUN.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "no call starts after the abort"
    );
    let batches = flue_runtime::store::Store::read(&store, &InstanceKey::new("answered_then_closing", "a"), None)
        .await
        .unwrap();
    let calls = batches
        .iter()
        .flat_map(|batch| batch.records.iter())
        .filter(|record| matches!(&record.body, RecordBody::ToolOutcome { tool_name, .. } if tool_name == "late_audit"))
        .count();
    assert_eq!(calls, 0, "no step was recorded for the queued call");
    assert_eq!(model.requests().len(), 2);
}

static DEAF_FINISHES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[agent]
fn answered_then_appending() -> &'static str {
    use_model("scripted/x");
    use_agent_finish(|ctx| async move {
        // Waits for the abort without failing, then asks for more work as if nothing happened.
        DEAF_FINISHES.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        while !ctx.signal().is_aborted() {
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        ctx.append(Signal::new("todo", "One more thing."))?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    });
    "Answer."
}

/// Reference §3.10, as above for a callback that does not fail: one that appends after the
/// abort fired does not continue the response (its signal is not stored, to sit unanswered):
/// the response, whose answer was durable, settles completed.
#[tokio::test]
async fn a_finish_append_made_after_the_abort_fired_is_not_stored_and_the_response_completes() {
    let model = ScriptedModel::new([ScriptedReply::text("the answer"), ScriptedReply::text("never asked")]);
    let store = MemoryStore::new();
    let runtime = harness::runtime_on(store.clone(), &model, [answered_then_appending.into()]);
    let handle = runtime.init(&answered_then_appending, "a");
    let receipt = handle.dispatch("go").await.unwrap();
    while DEAF_FINISHES.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(handle.abort().await.unwrap());
    let reply = tokio::time::timeout(std::time::Duration::from_secs(10), handle.read(&receipt.submission_id))
        .await
        .expect("settled")
        .expect("completed, not aborted");
    assert_eq!(reply.text, "the answer");
    assert_eq!(model.requests().len(), 1);
    let batches = flue_runtime::store::Store::read(&store, &InstanceKey::new("answered_then_appending", "a"), None)
        .await
        .unwrap();
    assert!(
        !batches
            .iter()
            .flat_map(|batch| batch.records.iter())
            .any(|record| matches!(record.body, RecordBody::Signal { .. } | RecordBody::AgentFinishCycle)),
        "no unanswered signal"
    );
}

static ABORTABLE_STARTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Waits for the abort, then says it stopped.
#[tool]
async fn until_aborted(ctx: &ToolContext) -> String {
    ABORTABLE_STARTS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    ctx.signal().aborted().await;
    "stopped halfway".to_owned()
}

#[agent]
fn abortable_worker() -> &'static str {
    use_model("scripted/x");
    use_tool(until_aborted);
    "Work."
}

/// A call the abort ended has no stored result (the settlement gives it the unknown
/// outcome): observers get no tool-result message for it, which a transcript built from
/// `message_end` would show but the stream never holds.
#[tokio::test]
async fn a_tool_the_abort_ended_has_no_result_message_for_observers() {
    let model = ScriptedModel::new([ScriptedReply::tool_call("until_aborted", json!({}))]);
    let runtime = runtime_with(&model, vec![abortable_worker.into()]);
    let mut events = runtime.observe();
    let handle = runtime.init(&abortable_worker, "w");
    let receipt = handle.dispatch("go").await.unwrap();
    while ABORTABLE_STARTS.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(handle.abort().await.unwrap());
    let aborted = handle.read(&receipt.submission_id).await.unwrap_err();
    assert!(
        matches!(&aborted, RuntimeError::Run { error_type, .. } if error_type == "submission_aborted"),
        "{aborted:?}"
    );
    let mut tool_messages = Vec::new();
    let mut done = Vec::new();
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            Event::MessageEnd {
                message: message @ ModelMessage::Tool { .. },
            } => tool_messages.push(message),
            Event::ToolCallDone { status, .. } => done.push(status),
            _ => {}
        }
    }
    assert_eq!(done, ["error"], "the tool's start has its end, not a success");
    assert!(tool_messages.is_empty(), "{tool_messages:?}");
}

static STUCK_STARTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[agent]
fn stuck_starter() -> &'static str {
    use_model("scripted/x");
    use_agent_start(|_ctx| async {
        // The first delivery's callback awaits what never ends, deaf to the abort signal.
        if STUCK_STARTS.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            std::future::pending::<()>().await;
        }
        Ok::<_, flue_runtime::event_hooks::AppendError>(())
    });
    "Start."
}

#[tokio::test]
async fn a_callback_deaf_to_an_abort_is_given_up_after_the_grace_and_the_instance_goes_on() {
    use flue_runtime::events::{RecoveryOperation, RecoveryOutcome};
    let model = ScriptedModel::new([ScriptedReply::text("the next one is answered")]);
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    let runtime = Runtime::builder()
        .agent(stuck_starter)
        .providers(providers)
        .store(MemoryStore::new())
        .options(RuntimeOptions {
            settle_grace: std::time::Duration::from_millis(100),
            ..RuntimeOptions::default()
        })
        .build()
        .unwrap();
    let mut events = runtime.observe();
    let handle = runtime.init(&stuck_starter, "stuck");
    let sender = handle.clone();
    let stuck = tokio::spawn(async move { sender.send("hello").await });
    while STUCK_STARTS.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(handle.abort().await.unwrap());
    harness::assert_settles_aborted(stuck).await;
    let mut terminated = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let Event::SubmissionRecovery {
            operation: RecoveryOperation::EnforceDeadline,
            outcome: RecoveryOutcome::Terminated,
            error,
            ..
        } = observation.event
        {
            let error = error.unwrap();
            terminated.push((error.error_type, error.message));
        }
    }
    assert_eq!(
        terminated,
        [(
            "attempt_given_up".to_owned(),
            "The response did not end within 0.1 s after its abort signal fired (Submission was aborted.).".to_owned()
        )]
    );
    // The instance is not held by the hung callback: the next message is answered.
    let reply = tokio::time::timeout(std::time::Duration::from_secs(10), handle.send("again"))
        .await
        .expect("the instance is free")
        .unwrap();
    assert_eq!(reply.text, "the next one is answered");
}

#[agent]
fn parallel() -> &'static str {
    use_model("scripted/x");
    use_meeting_tools(["left", "right"]);
    "Run both."
}

/// Declares a tool named after each of `names` answering "met", which completes only once
/// the other runs at the same time.
fn use_meeting_tools(names: [&'static str; 2]) {
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(2));
    for name in names {
        let barrier = barrier.clone();
        use_tool(Tool::new(name).description("Meet the other tool.").run(
            move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
                let barrier = barrier.clone();
                async move {
                    barrier.wait().await;
                    "met"
                }
            },
        ));
    }
}

#[tokio::test]
async fn parallel_tool_calls_of_one_response_run_concurrently() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([("left", json!({})), ("right", json!({}))]),
        ScriptedReply::text("both met"),
    ]);
    let runtime = runtime_with(&model, vec![parallel.into()]);
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runtime.init(&parallel, "p").send("go"),
    )
    .await;
    assert_eq!(reply.unwrap().unwrap().text, "both met");
    assert_eq!(
        harness::tool_results(&model.requests()[1]),
        [("met".to_owned(), false), ("met".to_owned(), false)]
    );
}

#[agent]
fn first_and_last_meet() -> &'static str {
    use_model("scripted/x");
    use_meeting_tools(["first", "last"]);
    use_tool(
        Tool::new("quick")
            .description("Returns at once.")
            .run(|_ctx, _: serde_json::Map<String, serde_json::Value>| async { "quick" }),
    );
    "Run them."
}

/// At a limit of two, a call that finished frees its place at once: `last` starts while
/// `first` (waiting for it) still runs, whatever their order in the batch.
#[tokio::test]
async fn a_finished_tool_call_frees_its_place_under_the_concurrency_limit() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([("first", json!({})), ("quick", json!({})), ("last", json!({}))]),
        ScriptedReply::text("all done"),
    ]);
    let limit = RuntimeOptions {
        tool_concurrency: 2,
        ..RuntimeOptions::default()
    };
    let runtime = harness::runtime_on_with(MemoryStore::new(), &model, [first_and_last_meet.into()], limit);
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runtime.init(&first_and_last_meet, "f").send("go"),
    )
    .await
    .expect("the batch does not wait for its first call to free a place");
    assert_eq!(reply.unwrap().text, "all done");
    // The results go back in call order.
    assert_eq!(
        harness::tool_results(&model.requests()[1]),
        [
            ("met".to_owned(), false),
            ("quick".to_owned(), false),
            ("met".to_owned(), false)
        ]
    );
}

static IN_FLIGHT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static PEAK_IN_FLIGHT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[agent]
fn counted_in_flight() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("slow").description("Takes a while.").run(
        |_ctx, _: serde_json::Map<String, serde_json::Value>| async {
            use std::sync::atomic::Ordering::SeqCst;
            let now = IN_FLIGHT.fetch_add(1, SeqCst) + 1;
            PEAK_IN_FLIGHT.fetch_max(now, SeqCst);
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            IN_FLIGHT.fetch_sub(1, SeqCst);
            "slept"
        },
    ));
    "Sleep."
}

/// Five calls of one step at a limit of two: two run at once (they do run concurrently), never
/// more.
#[tokio::test]
async fn a_steps_calls_run_concurrently_up_to_the_limit_and_never_past_it() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls((0..5).map(|_| ("slow", json!({})))),
        ScriptedReply::text("rested"),
    ]);
    let limit = RuntimeOptions {
        tool_concurrency: 2,
        ..RuntimeOptions::default()
    };
    let runtime = harness::runtime_on_with(MemoryStore::new(), &model, [counted_in_flight.into()], limit);
    let reply = runtime.init(&counted_in_flight, "c").send("go").await.unwrap();
    assert_eq!(reply.text, "rested");
    assert_eq!(harness::tool_results(&model.requests()[1]).len(), 5);
    assert_eq!(PEAK_IN_FLIGHT.load(std::sync::atomic::Ordering::SeqCst), 2);
}

#[agent]
fn fragile_tool() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("explode").description("Panics.").run(
        |_ctx, _: serde_json::Map<String, serde_json::Value>| async {
            if true {
                panic!("the tool blew up");
            }
            "unreachable"
        },
    ));
    use_tool(Tool::new("fail").description("Fails.").run(
        |_ctx, _: serde_json::Map<String, serde_json::Value>| async {
            Err::<String, _>(ToolError::new("the database is down"))
        },
    ));
    // Panics in the closure itself, before it returns its future.
    use_tool(Tool::new("explode_early").description("Panics at once.").run(
        |_ctx, _: serde_json::Map<String, serde_json::Value>| {
            if true {
                panic!("no secret configured");
            }
            async { "unreachable" }
        },
    ));
    "Try the tools."
}

#[tokio::test]
async fn tool_errors_and_panics_become_error_results_the_model_sees() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([
            ("explode", json!({})),
            ("fail", json!({})),
            ("missing", json!({})),
            ("explode_early", json!({})),
        ]),
        ScriptedReply::text("handled"),
    ]);
    let runtime = runtime_with(&model, vec![fragile_tool.into()]);
    runtime.init(&fragile_tool, "f").send("go").await.unwrap();
    let results: Vec<(String, bool)> = model.requests()[1]
        .messages
        .iter()
        .filter_map(|m| match m {
            ModelMessage::Tool { content, is_error, .. } => Some((content.clone(), *is_error)),
            _ => None,
        })
        .collect();
    assert_eq!(
        results,
        [
            ("Tool \"explode\" panicked: the tool blew up".to_owned(), true),
            ("the database is down".to_owned(), true),
            ("Tool \"missing\" is not available.".to_owned(), true),
            ("Tool \"explode_early\" panicked: no secret configured".to_owned(), true),
        ]
    );
}

/// What each render of `planner` read through `use_delivery`, with its instance (the tests
/// that use it run at once).
static FOLLOW_UPS: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());

#[agent]
fn planner(props: AgentProps<'_>) -> &'static str {
    use_model("scripted/x");
    let dispatch = use_dispatch_message();
    let delivery = use_delivery();
    FOLLOW_UPS
        .lock()
        .unwrap()
        .push((props.id().to_owned(), delivery.body().to_owned()));
    use_tool(harness::dispatching(
        Tool::new("schedule_follow_up").description("Queue a follow-up message."),
        dispatch,
        "follow-up: check the invoice",
    ));
    use_agent_start(|ctx| async move {
        if ctx.delivery().body().starts_with("follow-up") {
            ctx.append(Signal::new("note", "This follow-up joined the live response."))?;
        }
        Ok::<_, flue_runtime::event_hooks::AppendError>(())
    });
    "You plan work."
}

#[tokio::test]
async fn a_self_dispatch_joins_the_live_response_at_the_next_turn_boundary() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("schedule_follow_up", json!({})),
        ScriptedReply::text("Planned, and the follow-up is handled."),
    ]);
    let runtime = runtime_with(&model, vec![planner.into()]);
    let mut events = runtime.observe();
    let reply = runtime.init(&planner, "plan").send("plan my week").await.unwrap();
    assert_eq!(
        model.requests().len(),
        2,
        "the joined delivery was read in the same response"
    );
    let second = &model.requests()[1].messages;
    let users: Vec<&str> = second
        .iter()
        .filter_map(|m| match m {
            ModelMessage::User { content, .. } => Some(content.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(users[0], "plan my week");
    assert_eq!(users[1], "follow-up: check the invoice");
    assert!(users[2].contains("This follow-up joined the live response."));
    // The render before the second model call read the newest message in front of the model
    // through use_delivery: the signal the joined delivery's start callback appended.
    let read = FOLLOW_UPS
        .lock()
        .unwrap()
        .iter()
        .filter(|(instance, _)| instance == "plan")
        .map(|(_, body)| body.clone())
        .next_back();
    assert_eq!(read.as_deref(), Some("This follow-up joined the live response."));
    // Both submissions settled completed; the joined one answered by the host's response.
    let mut settled = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let Event::SubmissionSettled { outcome, .. } = observation.event {
            settled.push((observation.submission_id.unwrap(), outcome));
        }
    }
    assert_eq!(settled.len(), 2);
    assert!(settled.iter().all(|(_, outcome)| *outcome == Outcome::Completed));
    assert_eq!(
        settled[1].0, reply.submission_id,
        "a joined delivery settles before its host (reference §7.3)"
    );
    let joined_id = settled
        .iter()
        .find(|(id, _)| *id != reply.submission_id)
        .unwrap()
        .0
        .clone();
    let joined_reply = runtime.init(&planner, "plan").read(&joined_id).await.unwrap();
    assert_eq!(joined_reply.text, reply.text);
    assert_eq!(
        runtime.init(&planner, "plan").read(&reply.submission_id).await.unwrap(),
        reply,
        "the host's reply, read back, is the one its sender got"
    );
}

#[tokio::test]
async fn a_dispatch_admitted_after_an_empty_boundary_still_joins_at_the_next_one() {
    let model = ScriptedModel::new([
        // Step 1: a call that does nothing (an unknown tool): its boundary finds nothing to join.
        ScriptedReply::tool_call("no_such_tool", json!({})),
        // Step 2: the dispatch, admitted after that empty look.
        ScriptedReply::tool_call("schedule_follow_up", json!({})),
        ScriptedReply::text("Done, follow-up included."),
    ]);
    let runtime = runtime_with(&model, vec![planner.into()]);
    runtime.init(&planner, "boundaries").send("plan").await.unwrap();
    let requests = model.requests();
    assert_eq!(requests.len(), 3, "the follow-up joined instead of running on its own");
    let joined = requests[2].messages.iter().any(
        |message| matches!(message, ModelMessage::User { content, .. } if content == "follow-up: check the invoice"),
    );
    assert!(joined, "the third model call reads the joined follow-up");
}

static MODEL_CHOICE: Mutex<&str> = Mutex::new("scripted/first");

#[agent]
fn switcher() -> &'static str {
    let spec = *MODEL_CHOICE.lock().unwrap();
    use_model(spec);
    use_tool(Tool::new("switch").description("Switch models.").run(
        |_ctx, _: serde_json::Map<String, serde_json::Value>| async {
            *MODEL_CHOICE.lock().unwrap() = "scripted/second";
            "switched"
        },
    ));
    "Switch."
}

#[tokio::test]
async fn the_model_is_submission_scoped_so_a_change_takes_effect_on_the_next_submission() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("switch", json!({})),
        ScriptedReply::text("done"),
        ScriptedReply::text("next"),
    ]);
    let runtime = runtime_with(&model, vec![switcher.into()]);
    let handle = runtime.init(&switcher, "m");
    handle.send("one").await.unwrap();
    handle.send("two").await.unwrap();
    let models: Vec<String> = model.requests().iter().map(|request| request.model.clone()).collect();
    assert_eq!(models, ["first", "first", "second"]);
}

#[tokio::test]
async fn unknown_agents_blank_ids_and_reserved_signals_are_refused_at_admission() {
    let model = ScriptedModel::echo();
    let runtime = runtime_with(&model, vec![calculator.into()]);
    let unknown = runtime
        .dispatch_request("nope", SendRequest::new("a", "hi"))
        .await
        .unwrap_err();
    assert_eq!(
        unknown.to_string(),
        "[flue] dispatch() target agent \"nope\" is not registered."
    );
    // Blank as JavaScript's `trim` sees it: a byte order mark and a no-break space too.
    for id in [" ", "\u{feff}", "\u{a0}\u{2003}"] {
        let blank = runtime
            .dispatch_request("calculator", SendRequest::new(id, "hi"))
            .await
            .unwrap_err();
        assert_eq!(
            blank.to_string(),
            "[flue] dispatch() requires a non-empty \"id\" target agent instance id.",
            "{id:?}"
        );
    }
    let reserved = runtime
        .dispatch_request("calculator", SendRequest::new("a", Signal::new("compaction", "x")))
        .await
        .unwrap_err();
    assert!(reserved.to_string().contains("framework-reserved"));
    // A send through a handle of an id admission refuses is refused as a dispatch is, and
    // takes no place in the instance cache.
    for id in [" ", "a/task_b", "x".repeat(513).as_str()] {
        let refused = runtime.init(&calculator, id).send("hi").await.unwrap_err();
        assert!(
            matches!(refused, RuntimeError::InvalidRequest(_)),
            "{id:?}: {refused:?}"
        );
    }
    assert_eq!(runtime.cached_instance_count(), 0);
}

#[tokio::test]
async fn two_agents_with_one_name_or_two_hooks_with_one_id_do_not_build() {
    let model = ScriptedModel::echo();
    let mut providers = ProviderRegistry::new();
    providers.register(model);
    let error = Runtime::builder()
        .store(MemoryStore::new())
        .agent(calculator)
        .agent(calculator)
        .providers(providers)
        .build()
        .err()
        .unwrap();
    assert_eq!(
        error.to_string(),
        "[flue] Two agents are registered under the name \"calculator\"."
    );
}

#[test]
fn a_hand_built_definition_that_breaks_a_compile_time_rule_does_not_build() {
    use flue_core::agent::{Durability, HookStage, ParentHookRequirement};
    use flue_core::lifecycle::{ThreadHook, ThreadHookDefinition, ThreadHookHandler};
    static CAMEL: ThreadHookDefinition = ThreadHookDefinition {
        id: "RedactEmails",
        handler: ThreadHookHandler::AfterThreadCreated(|_| Box::pin(async { Ok(()) })),
    };
    static AUDIT: ThreadHookDefinition = ThreadHookDefinition {
        id: "audit",
        handler: ThreadHookHandler::AfterThreadCreated(|_| Box::pin(async { Ok(()) })),
    };
    let audit = ThreadHook::new(&AUDIT);
    let required = |reason: &'static str| ParentHookRequirement {
        hook: audit,
        stage: HookStage::AfterParent,
        reason,
    };
    let build = |definition: AgentDefinition| {
        Runtime::builder()
            .store(MemoryStore::new())
            .agent(AgentRef::new(FnAgent::new(definition, |_| use_model("scripted/x"))))
            .build()
            .err()
            .map(|error| error.to_string())
    };
    let mut renamed = AgentDefinition::new("helper");
    renamed.name = "Helper".into();
    let cases = [
        (
            renamed,
            "[flue] Agent name \"Helper\" is not a valid identity: use snake_case matching ^[a-z][a-z0-9_]*$.",
        ),
        (
            AgentDefinition::new("helper").description(" \n"),
            "[flue] Agent \"helper\" has a blank description: write what the agent does, or leave it out.",
        ),
        (
            AgentDefinition::new("helper").max_steps(0),
            "[flue] Agent \"helper\": max_steps must be a positive integer.",
        ),
        (
            AgentDefinition::new("helper").durability(Durability {
                max_attempts: 0,
                ..Durability::DEFAULT
            }),
            "[flue] Agent \"helper\": durability max_attempts must be a positive integer.",
        ),
        (
            AgentDefinition::new("helper").durability(Durability {
                timeout: std::time::Duration::ZERO,
                ..Durability::DEFAULT
            }),
            "[flue] Agent \"helper\": durability timeout must be positive.",
        ),
        (
            AgentDefinition::new("helper").hooks(vec![ThreadHook::new(&CAMEL)]),
            "[flue] The lifecycle hook id \"RedactEmails\" must be snake_case: lowercase letters, digits and underscores, starting with a letter.",
        ),
        (
            AgentDefinition::new("helper").hooks(vec![audit, audit]),
            "[flue] Agent \"helper\" selects the lifecycle hook \"audit\" twice; select each hook once (hooks of one kind run in listed order).",
        ),
        (
            AgentDefinition::new("helper").parent_hooks(vec![required("audits")]),
            "[flue] Agent \"helper\" declares parent hooks but is not exposed as a tool; only an agent with expose_as_tool can require hooks of its parents.",
        ),
        (
            AgentDefinition::new("helper")
                .expose_as_tool()
                .parent_hooks(vec![required("audits"), required("again")]),
            "[flue] Agent \"helper\" requires the parent hook \"audit\" twice; require each hook once.",
        ),
        (
            AgentDefinition::new("helper")
                .expose_as_tool()
                .parent_hooks(vec![required(" ")]),
            "[flue] Agent \"helper\" requires the parent hook \"audit\" without a reason; give one, shown to whoever composes this agent.",
        ),
    ];
    for (definition, message) in cases {
        assert_eq!(build(definition).as_deref(), Some(message));
    }
    let sound = AgentDefinition::new("helper")
        .description("Helps.")
        .max_steps(1)
        .hooks(vec![audit])
        .expose_as_tool()
        .parent_hooks(vec![required("audits")]);
    assert_eq!(build(sound), None, "a definition within the rules builds");
}

/// Hand the conversation to a person.
#[tool(terminate)]
async fn escalate(
    /// Why
    reason: String,
) -> String {
    format!("Escalated: {reason}")
}

#[agent]
fn desk() -> &'static str {
    use_model("scripted/x");
    use_tool(escalate);
    use_tool(add);
    "Escalate when asked."
}

#[tokio::test]
async fn a_batch_of_only_terminating_tools_ends_the_turn_without_another_model_call() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("escalate", json!({"reason": "asked for a person"})),
        ScriptedReply::text("unused"),
    ]);
    let runtime = runtime_with(&model, vec![desk.into()]);
    runtime.init(&desk, "d-1").send("a person please").await.unwrap();
    assert_eq!(model.requests().len(), 1);
    // A mixed batch does not end the turn.
    let mixed = ScriptedModel::new([
        ScriptedReply::tool_calls([("escalate", json!({"reason": "x"})), ("add", json!({"a": 1, "b": 1}))]),
        ScriptedReply::text("continued"),
    ]);
    let runtime = runtime_with(&mixed, vec![desk.into()]);
    let reply = runtime.init(&desk, "d-2").send("both").await.unwrap();
    assert_eq!((mixed.requests().len(), reply.text.as_str()), (2, "continued"));
}

static ESCALATION_CHECKS: Mutex<Vec<(String, usize)>> = Mutex::new(Vec::new());

/// Escalates, and a finish check that sends the model back once to log the ticket.
#[agent]
fn checked_desk() -> &'static str {
    use_model("scripted/x");
    use_tool(escalate);
    use_agent_finish(|ctx| async move {
        let calls = ctx.response().tool_calls.len();
        let mut checks = ESCALATION_CHECKS.lock().unwrap();
        let instance = format!("check {}", checks.len() + 1);
        checks.push((instance, calls));
        if checks.len() == 1 {
            ctx.append(Signal::new("todo", "Log the ticket before you hand over."))?;
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    });
    "Escalate when asked."
}

/// Reference §3.7, step 12: the would-stop phase follows the turns however they end. A
/// terminating batch ends the turns as an answer without calls does, so the finish callbacks
/// run after it, and an append continues the response with another model call.
#[tokio::test]
async fn a_terminating_batch_reaches_the_finish_callbacks_whose_append_continues_the_response() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("escalate", json!({"reason": "asked for a person"})),
        ScriptedReply::text("Ticket logged; a person will call you."),
    ]);
    let runtime = runtime_with(&model, vec![checked_desk.into()]);
    let reply = runtime.init(&checked_desk, "cd").send("a person please").await.unwrap();
    assert_eq!(
        model.requests().len(),
        2,
        "the finish callback's append got a model call"
    );
    assert_eq!(reply.text, "Ticket logged; a person will call you.");
    let last = &model.requests()[1].messages;
    let ModelMessage::User { content, .. } = &last[last.len() - 1] else {
        panic!("the appended signal ends the second request")
    };
    assert!(content.starts_with("<signal type=\"todo\">"), "{content}");
    // Each check saw the response's committed call: once after the batch, once after the answer.
    assert_eq!(
        *ESCALATION_CHECKS.lock().unwrap(),
        [("check 1".to_owned(), 1), ("check 2".to_owned(), 1)]
    );
    let batches = runtime
        .store()
        .read(&InstanceKey::new("checked_desk", "cd"), None)
        .await
        .unwrap();
    let cycles = batches
        .iter()
        .flat_map(|b| b.records.iter())
        .filter(|r| matches!(r.body, RecordBody::AgentFinishCycle))
        .count();
    assert_eq!(cycles, 1);
}

#[agent]
fn handoff() -> &'static str {
    use_model("scripted/x");
    let dispatch = use_dispatch_message();
    use_tool(harness::dispatching(
        Tool::new("hand_off")
            .description("Hand the conversation over, leaving a note for later.")
            .terminate(),
        dispatch,
        "note: the customer also asked about refunds",
    ));
    "Hand off when asked."
}

#[tokio::test]
async fn a_delivery_joined_at_a_terminating_batch_is_answered_by_another_turn() {
    // The batch ends the turn, but a delivery that joins at that turn end is steered into the
    // loop, which runs on for it (reference §3.8: every turn end is a join point, and the
    // engine keeps turning while steered messages are pending).
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("hand_off", json!({})),
        ScriptedReply::text("Refunds take five days."),
    ]);
    let runtime = runtime_with(&model, vec![handoff.into()]);
    let mut events = runtime.observe();
    let reply = runtime.init(&handoff, "h").send("a person please").await.unwrap();
    assert_eq!(model.requests().len(), 2, "the joined delivery got a model turn");
    assert_eq!(reply.text, "Refunds take five days.");
    let last_user = model.requests()[1].messages.iter().rev().find_map(|m| match m {
        ModelMessage::User { content, .. } => Some(content.clone()),
        _ => None,
    });
    assert_eq!(
        last_user.as_deref(),
        Some("note: the customer also asked about refunds")
    );
    let mut settled = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let Event::SubmissionSettled { outcome, .. } = observation.event {
            settled.push((observation.submission_id.unwrap(), outcome));
        }
    }
    assert_eq!(settled.len(), 2);
    let joined = settled.iter().find(|(id, _)| *id != reply.submission_id).unwrap();
    assert_eq!(joined.1, Outcome::Completed);
    let joined_reply = runtime.init(&handoff, "h").read(&joined.0).await.unwrap();
    assert_eq!(joined_reply.text, "Refunds take five days.");
}

#[agent(max_steps = 1)]
fn capped_planner() -> &'static str {
    use_model("scripted/x");
    let dispatch = use_dispatch_message();
    use_tool(harness::dispatching(
        Tool::new("schedule_follow_up").description("Queue a follow-up message."),
        dispatch,
        "follow-up: check the invoice",
    ));
    "You plan work."
}

#[tokio::test]
async fn a_delivery_queued_during_a_responses_last_step_is_answered_by_its_own_response_not_joined() {
    // The batch of the last step `max_steps` allows is no join point: a delivery joined there
    // would settle with a response that never reads it.
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("schedule_follow_up", json!({})),
        ScriptedReply::text("The invoice is checked."),
    ]);
    let runtime = runtime_with(&model, vec![capped_planner.into()]);
    let mut events = runtime.observe();
    let handle = runtime.init(&capped_planner, "capped");
    let host = handle.send("plan my week").await.unwrap();
    let mut queued = Vec::new();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut settled = Vec::new();
    while settled.len() < 2 {
        let observation = tokio::time::timeout_at(deadline, events.recv())
            .await
            .expect("both submissions settle")
            .unwrap();
        match observation.event {
            Event::SubmissionQueued { .. } => queued.push(observation.submission_id.unwrap()),
            Event::SubmissionSettled { outcome, .. } => settled.push((observation.submission_id.unwrap(), outcome)),
            _ => {}
        }
    }
    let follow_up = queued.iter().find(|id| **id != host.submission_id).unwrap();
    let row = runtime.store().submission(follow_up).await.unwrap().unwrap();
    assert_eq!(
        row.joined_into, None,
        "the follow-up was not joined into the capped response"
    );
    let answer = handle.read(follow_up).await.unwrap();
    assert_eq!(answer.text, "The invoice is checked.");
    assert_eq!(model.requests().len(), 2, "one model call for each response");
    let last_user = model.requests()[1].messages.iter().rev().find_map(|m| match m {
        ModelMessage::User { content, .. } => Some(content.clone()),
        _ => None,
    });
    assert_eq!(last_user.as_deref(), Some("follow-up: check the invoice"));
}

#[tokio::test]
async fn a_send_whose_message_joined_another_response_returns_when_that_response_settles() {
    // The message is queued behind another: it joins that response before its first model
    // call. The response's tool queues a follow-up its spent step budget does not join; the
    // sender is answered when the response settles, not once the follow-up's response (held
    // here) is done too.
    let scripted = ScriptedModel::new([
        ScriptedReply::tool_call("schedule_follow_up", json!({})),
        ScriptedReply::text("The invoice is checked."),
    ]);
    let gated = harness::Gated::new(scripted.clone(), 2);
    let release = gated.release.clone();
    let mut providers = ProviderRegistry::new();
    providers.register(gated);
    let runtime = Runtime::builder()
        .agent(capped_planner)
        .providers(providers)
        .store(MemoryStore::new())
        .build()
        .unwrap();
    let mut events = runtime.observe();
    let key = InstanceKey::new("capped_planner", "ahead");
    runtime
        .store()
        .admit(harness::admission(&key, "sub_ahead", "plan my week"))
        .await
        .unwrap();
    let handle = runtime.init(&capped_planner, "ahead");
    let reply = tokio::time::timeout(std::time::Duration::from_secs(10), handle.send("and book the flights"))
        .await
        .expect("the send returns once the response that answered it settles")
        .unwrap();
    let row = runtime.store().submission(&reply.submission_id).await.unwrap().unwrap();
    assert_eq!(row.joined_into.as_deref(), Some("sub_ahead"));
    let mut follow_up = None;
    while let Ok(observation) = events.try_recv() {
        if let Event::SubmissionQueued { .. } = observation.event
            && observation.submission_id.as_deref() != Some(reply.submission_id.as_str())
        {
            follow_up = observation.submission_id;
        }
    }
    let follow_up = follow_up.expect("the tool queued a follow-up");
    release.add_permits(1);
    let answer = tokio::time::timeout(std::time::Duration::from_secs(10), handle.read(&follow_up))
        .await
        .expect("the follow-up is answered by a worker")
        .unwrap();
    assert_eq!(answer.text, "The invoice is checked.");
}

static CURSOR: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[agent]
fn cursor() -> &'static str {
    use_model("scripted/x");
    CURSOR.lock().unwrap().push(use_delivery().body().to_owned());
    use_agent_finish(|ctx| async move {
        if ctx.response().usage.output_tokens < 3 {
            ctx.append(Signal::new("nudge", "Say more."))?;
        }
        Ok::<_, flue_runtime::event_hooks::AppendError>(())
    });
    "Talk."
}

#[tokio::test]
async fn the_delivery_cursor_advances_to_a_signal_a_callback_appended() {
    let model = ScriptedModel::new([
        ScriptedReply::text("hi"),
        ScriptedReply::text("a much longer answer than before"),
    ]);
    let runtime = runtime_with(&model, vec![cursor.into()]);
    CURSOR.lock().unwrap().clear();
    runtime.init(&cursor, "c").send("hello").await.unwrap();
    let seen = CURSOR.lock().unwrap().clone();
    // Init render and first turn read the user message; the turn after the append reads the signal.
    assert_eq!(seen.first().map(String::as_str), Some("hello"));
    assert_eq!(seen.last().map(String::as_str), Some("Say more."));
}

static RELEASED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static HELD_RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[agent]
fn holding() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("hold").description("Hold until released.").run(
        |_ctx, _: serde_json::Map<String, serde_json::Value>| async move {
            HELD_RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            while !RELEASED.load(std::sync::atomic::Ordering::SeqCst) {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            "released"
        },
    ));
    "Hold."
}

/// A send is a wait: dropped (a timeout, a `select!`) while its message runs, the wait ends and
/// the message goes on, its tool neither cut nor run again, its attempt not spent; its reply is
/// read later.
#[tokio::test]
async fn a_send_dropped_while_its_message_runs_stops_the_wait_not_the_message() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("hold", json!({})),
        ScriptedReply::text("held to the end"),
    ]);
    let store = MemoryStore::new();
    let runtime = harness::runtime_on(store.clone(), &model, [holding.into()]);
    let handle = runtime.init(&holding, "dropped");
    let mut events = runtime.observe();
    let started = async {
        loop {
            if let Event::ToolStart { .. } = events.recv().await.unwrap().event {
                break;
            }
        }
    };
    let send = handle.send("first");
    let dropped = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        tokio::select! {
            reply = send => Some(reply),
            () = started => None,
        }
    })
    .await
    .expect("the tool started within 10 s");
    assert!(dropped.is_none(), "the tool holds: {dropped:?}");
    RELEASED.store(true, std::sync::atomic::Ordering::SeqCst);
    let submission = runtime
        .store()
        .read(&InstanceKey::new("holding", "dropped"), None)
        .await
        .unwrap()
        .iter()
        .flat_map(|batch| batch.records.iter())
        .find_map(|record| record.submission_id.clone())
        .expect("the message was admitted");
    let reply = tokio::time::timeout(std::time::Duration::from_secs(10), handle.read(&submission))
        .await
        .expect("the message settles")
        .unwrap();
    assert_eq!(reply.text, "held to the end");
    assert_eq!(
        HELD_RUNS.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the tool ran once"
    );
    assert_eq!(model.requests().len(), 2, "no call was made again");
    let row = flue_runtime::store::Store::submission(&store, &submission)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.attempt_count, 1, "its attempt was not given back");
}

/// A process that admitted nothing (a fresh one, after a crash) and reads a submission the
/// crashed one left queued takes it over and answers, as a send would have started the node's
/// background work.
#[tokio::test]
async fn a_read_in_a_fresh_process_takes_over_what_a_crashed_one_left_queued() {
    use flue_runtime::store::Store as _;
    let model = ScriptedModel::new([ScriptedReply::text("5")]);
    let store = MemoryStore::new();
    let key = InstanceKey::new("calculator", "left");
    store.admit(harness::admission(&key, "sub_left", "2+3?")).await.unwrap();
    let options = RuntimeOptions {
        scan_interval: std::time::Duration::from_millis(20),
        ..RuntimeOptions::default()
    };
    let runtime = harness::runtime_on_with(store, &model, [calculator.into()], options);
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runtime.init(&calculator, "left").read("sub_left"),
    )
    .await
    .expect("the read's node took the submission over")
    .unwrap();
    assert_eq!(reply.text, "5");
}

/// A wait on a store of the node's own is woken by the settlement; a settlement that wakes
/// nobody (made without the runtime, here by the test through the store, for an agent this
/// node does not run, which its scan leaves alone) is still found, at the next scan interval.
#[tokio::test]
async fn a_wait_finds_a_settlement_that_woke_nobody_at_the_next_scan_interval() {
    let model = ScriptedModel::new([]);
    let store = MemoryStore::new();
    let options = RuntimeOptions {
        scan_interval: std::time::Duration::from_millis(20),
        ..RuntimeOptions::default()
    };
    let runtime = harness::runtime_on_with(store.clone(), &model, [calculator.into()], options);
    use flue_runtime::store::Store as _;
    let elsewhere = FnAgent::new(AgentDefinition::new("elsewhere"), |_props| "Not run here.");
    let key = InstanceKey::new("elsewhere", "quiet");
    store
        .admit(harness::admission(&key, "sub_quiet", "2+3?"))
        .await
        .unwrap();
    let reading = tokio::spawn({
        let handle = runtime.init(&elsewhere, "quiet");
        async move { handle.read("sub_quiet").await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let claim = flue_runtime::store::Claim {
        attempt_id: "att_quiet".into(),
        owner_id: "elsewhere".into(),
        lease_until_ms: flue_runtime::store::now_ms() + 60_000,
    };
    store.claim_next(&key, &claim).await.unwrap().expect("claimed");
    let attempt = flue_runtime::store::AttemptRef {
        submission_id: "sub_quiet".into(),
        attempt_id: "att_quiet".into(),
    };
    store
        .settle(&attempt, flue_runtime::record::Outcome::Aborted, None, Vec::new())
        .await
        .unwrap();
    let read = tokio::time::timeout(std::time::Duration::from_secs(10), reading)
        .await
        .expect("the wait found the settlement")
        .unwrap();
    assert!(
        matches!(&read, Err(RuntimeError::Run { outcome, .. }) if *outcome == "was aborted"),
        "aborted: {read:?}"
    );
}

fn boom(message: &str) {
    panic!("{message}")
}

#[agent]
fn panicky(props: AgentProps) -> &'static str {
    use_model("scripted/x");
    // Which seam panics is chosen by the instance id.
    match props.id() {
        "start" => use_agent_start(|_ctx| async { boom("the start seam broke") }),
        "finish" => use_agent_finish(|_ctx| async { boom("the finish seam broke") }),
        "response" => use_response_start(|_| -> serde_json::Value { panic!("no metadata today") }),
        "response_string" => use_response_start(|_| json!("not an object")),
        "finish_err" => {
            use_response_finish(|_| json!({"fine": true}));
            use_response_finish(|_| Err::<serde_json::Value, _>("no usage today"));
        }
        "starts" => {
            use_agent_start(|_ctx| async { Err::<(), _>("the cache is cold") });
            use_agent_start(|_ctx| async { Ok::<(), &str>(()) });
            use_agent_start(|_ctx| async { boom("the start seam broke") });
        }
        _ => {}
    }
    "You panic on cue."
}

#[tokio::test]
/// Callbacks are numbered from 0 in declaration order, as the reference numbers them.
async fn a_panicking_callback_fails_the_submission_like_its_error_and_the_instance_keeps_working() {
    let model = ScriptedModel::new((0..3).map(|_| ScriptedReply::text("fine")));
    let runtime = runtime_with(&model, vec![panicky.into()]);
    for (id, error_type, message) in [
        (
            "start",
            "agent_start_failed",
            "[flue] A use_agent_start callback (hook #0 in declaration order) panicked: the start seam broke",
        ),
        (
            "finish",
            "agent_finish_failed",
            "[flue] A use_agent_finish callback (hook #0 in declaration order) panicked: the finish seam broke",
        ),
        (
            "response",
            "response_hook_failed",
            "[flue] A use_response_start callback (hook #0 in declaration order) panicked: no metadata today",
        ),
        (
            "response_string",
            "response_hook_failed",
            "[flue] A use_response_start callback must return a plain object of metadata (or nothing) — got string.",
        ),
        (
            "finish_err",
            "response_hook_failed",
            "[flue] A use_response_finish callback (hook #1 in declaration order) threw: no usage today",
        ),
    ] {
        let error = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            runtime.init(&panicky, id).send("hi"),
        )
        .await
        .expect("the submission settles")
        .unwrap_err();
        assert_eq!(run_error(error), (error_type.to_owned(), message.to_owned()), "{id}");
    }
    let reply = runtime.init(&panicky, "calm").send("hi").await.unwrap();
    assert_eq!(reply.text, "fine");
}

#[tokio::test]
async fn several_failing_start_callbacks_fail_the_submission_with_each_of_their_errors() {
    let model = ScriptedModel::new([ScriptedReply::text("never")]);
    let runtime = runtime_with(&model, vec![panicky.into()]);
    let error = runtime.init(&panicky, "starts").send("hi").await.unwrap_err();
    let RuntimeError::Run {
        error_type,
        message,
        details,
        meta,
        ..
    } = error
    else {
        panic!("expected a run error, got {error}");
    };
    assert_eq!(error_type, "agent_start_failed");
    assert_eq!(message, "[flue] Multiple use_agent_start callbacks threw.");
    let causes = [
        "[flue] A use_agent_start callback (hook #0 in declaration order) threw: the cache is cold",
        "[flue] A use_agent_start callback (hook #2 in declaration order) panicked: the start seam broke",
    ];
    assert_eq!(details, causes.join("\n"));
    assert_eq!(meta.unwrap()["errors"], json!(causes));
    assert!(
        model.requests().is_empty(),
        "the model was called after the start seam failed"
    );
}

/// A runtime of `calculator` on a memory store, whose model answers "answer 0" to "answer 10"
/// in turn, with `options`.
fn answering_eleven_times(options: RuntimeOptions) -> (ScriptedModel, Runtime) {
    answering_eleven_times_as(calculator, options)
}

/// [`answering_eleven_times`] of `agent`.
fn answering_eleven_times_as(agent: impl Into<AgentRef>, options: RuntimeOptions) -> (ScriptedModel, Runtime) {
    let model = ScriptedModel::new((0..11).map(|i| ScriptedReply::text(format!("answer {i}"))));
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    let runtime = Runtime::builder()
        .store(MemoryStore::new())
        .providers(providers)
        .agent(agent)
        .options(options)
        .build()
        .unwrap();
    (model, runtime)
}

#[tokio::test]
async fn idle_instances_past_the_cache_limit_are_dropped_and_an_evicted_one_carries_on_from_the_store() {
    let (model, runtime) = answering_eleven_times(RuntimeOptions {
        cached_instances: 4,
        ..RuntimeOptions::default()
    });
    for i in 0..10 {
        runtime.init(&calculator, format!("c-{i}")).send("hi").await.unwrap();
    }
    assert!(
        runtime.cached_instance_count() <= 4,
        "{} instances cached",
        runtime.cached_instance_count()
    );
    // The first instance was evicted long ago: its next submission folds its stream again.
    let reply = runtime.init(&calculator, "c-0").send("again").await.unwrap();
    assert_eq!(reply.text, "answer 10");
    let history = &model.requests()[10].messages;
    assert_eq!(
        history,
        &[
            ModelMessage::user("hi"),
            ModelMessage::Assistant {
                text: "answer 0".into(),
                tool_calls: Vec::new(),
                reasoning: Vec::new()
            },
            ModelMessage::user("again"),
        ]
    );
}

/// The cache is bounded by what its conversations hold too, not only by their count: many
/// instances created with large initial data or messages (a client's, over HTTP) leave the
/// least recently used idle ones to the store, and an evicted one carries on from it with its
/// history and its initial data.
#[tokio::test]
async fn idle_instances_past_the_caches_bytes_are_dropped_however_few() {
    let notebook = FnAgent::new(AgentDefinition::new("notebook"), |_| {
        use_model("scripted/x");
        let notes = use_initial_data::<serde_json::Value>()
            .and_then(|data| data["notes"].as_str().map(str::len))
            .unwrap_or(0);
        format!("Notes: {notes} bytes.")
    });
    let (model, runtime) = answering_eleven_times_as(
        notebook,
        RuntimeOptions {
            cached_bytes: 1 << 20,
            ..RuntimeOptions::default()
        },
    );
    let large = "x".repeat(300 << 10);
    for i in 0..5 {
        let mut request = SendRequest::new(format!("data-{i}"), "hi");
        request.initial_data = Some(json!({ "notes": large }));
        runtime
            .handle("notebook", format!("data-{i}"))
            .unwrap()
            .send_request(request)
            .await
            .unwrap();
    }
    for i in 0..5 {
        runtime
            .handle("notebook", format!("text-{i}"))
            .unwrap()
            .send(large.as_str())
            .await
            .unwrap();
    }
    // 300 KiB each: a megabyte holds three (the cache goes down to three quarters of it).
    assert!(
        runtime.cached_instance_count() <= 3,
        "{} instances cached",
        runtime.cached_instance_count()
    );
    // An evicted instance carries on from the store: its history and its initial data are
    // read again.
    let reply = runtime
        .handle("notebook", "data-0")
        .unwrap()
        .send("again")
        .await
        .unwrap();
    assert_eq!(reply.text, "answer 10");
    let again = &model.requests()[10];
    assert_eq!(
        again.messages.len(),
        3,
        "the instance's history, read again: {:?}",
        again.messages
    );
    assert!(
        instructions_of(again.system.as_deref()) == Some(&format!("Notes: {} bytes.", large.len())),
        "{:?}",
        again.system
    );
}

/// A user message with one image (`bytes`, base64-encoded as clients send it).
fn with_image(body: &str, bytes: &[u8]) -> DeliveredMessage {
    use base64::Engine as _;
    DeliveredMessage::User(flue_runtime::message::UserMessage {
        body: body.into(),
        attachments: vec![flue_runtime::message::Attachment::Image {
            data: base64::engine::general_purpose::STANDARD.encode(bytes),
            mime_type: "image/png".into(),
            filename: Some("chart.png".into()),
        }],
    })
}

#[tokio::test]
async fn images_reach_the_model_are_kept_in_the_attachment_store_and_survive_eviction() {
    let model = ScriptedModel::new((0..4).map(|i| ScriptedReply::text(format!("answer {i}"))));
    let store = MemoryStore::new();
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    let runtime = Runtime::builder()
        .store(store.clone())
        .providers(providers)
        .agent(calculator)
        .options(RuntimeOptions {
            cached_instances: 0,
            ..RuntimeOptions::default()
        })
        .build()
        .unwrap();
    let png = [137u8, 80, 78, 71, 13, 10, 26, 10, 0, 1, 2, 3];
    let expected = flue_runtime::provider::ModelImage {
        media_type: "image/png".into(),
        data: "iVBORw0KGgoAAQID".into(),
    };
    let handle = runtime.init(&calculator, "eyes");
    handle.send(with_image("What is in this chart?", &png)).await.unwrap();
    // The record names the attachment; the bytes are in the store.
    let key = InstanceKey::new("calculator", "eyes");
    let batches = flue_runtime::store::Store::read(&store, &key, None).await.unwrap();
    let attachment = batches
        .iter()
        .flat_map(|batch| batch.records.iter())
        .find_map(|record| match &record.body {
            RecordBody::UserMessage { attachments, .. } => attachments.first().cloned(),
            _ => None,
        })
        .expect("the input record names its attachment");
    assert_eq!(
        (attachment.size, attachment.filename.as_deref()),
        (12, Some("chart.png"))
    );
    let stored = flue_runtime::store::Store::attachment(&store, &key, &attachment.id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stored.bytes, png);
    // The model saw the image, and its id listed after the text.
    let first = &model.requests()[0].messages[0];
    let listed = format!(
        "What is in this chart?\n\n<attachments>\n<image id=\"{}\" mimeType=\"image/png\" />\n</attachments>",
        attachment.id
    );
    assert!(
        matches!(first, ModelMessage::User { content, images } if *content == listed && images == std::slice::from_ref(&expected)),
        "{first:?}"
    );
    // With no cache the instance is folded again for the next message: the image is loaded
    // from the store and sent again with its message.
    for other in 0..2 {
        runtime
            .init(&calculator, format!("other-{other}"))
            .send("hi")
            .await
            .unwrap();
    }
    assert_eq!(runtime.cached_instance_count(), 1, "only the last instance is cached");
    handle.send("And now?").await.unwrap();
    let history = &model.requests()[3].messages;
    assert!(
        matches!(&history[0], ModelMessage::User { images, .. } if images == std::slice::from_ref(&expected)),
        "{history:?}"
    );
}

#[tokio::test]
async fn a_damaged_attachment_fails_the_submission_at_once_instead_of_retrying_it() {
    let model = ScriptedModel::new([ScriptedReply::text("a chart"), ScriptedReply::text("never")]);
    let rows = MemoryStore::new();
    // The image reaches the model with its message; its bytes are stored (and then damaged).
    let runtime = harness::runtime_on(
        harness::DamagedAttachments { inner: rows.clone() },
        &model,
        [calculator.into()],
    );
    runtime
        .init(&calculator, "damaged")
        .send(with_image("What is in this chart?", b"\x89PNG\r\n\x1a\n\x01\x02\x03"))
        .await
        .unwrap();
    // Another process folds the conversation afresh and must load the image from the store.
    let runtime = harness::runtime_on(
        harness::DamagedAttachments { inner: rows.clone() },
        &model,
        [calculator.into()],
    );
    let error = runtime.init(&calculator, "damaged").send("And now?").await.unwrap_err();
    let RuntimeError::Run {
        error_type,
        message,
        submission_id,
        ..
    } = error
    else {
        panic!("a run error: {error:?}")
    };
    assert_eq!(error_type, "attachment_integrity", "{message}");
    assert!(message.contains("is damaged in the store"), "{message}");
    assert_eq!(model.requests().len(), 1, "no call without the image");
    let row = flue_runtime::store::Store::submission(&rows, &submission_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.attempt_count, 1, "not retried: damaged bytes stay damaged");
    // Reference §6.2: `meta {attachmentId, reason}`.
    let meta = row.error.and_then(|error| error.meta).map(serde_json::Value::Object);
    let attachment_id = meta.as_ref().map(|meta| meta["attachmentId"].clone());
    assert!(
        attachment_id
            .as_ref()
            .and_then(|id| id.as_str())
            .is_some_and(|id| id.starts_with("att_")),
        "{meta:?}"
    );
    assert_eq!(meta.map(|meta| meta["reason"].clone()), Some(json!("digest")));
}

#[tokio::test]
async fn an_image_that_is_not_base64_is_refused_at_admission() {
    let model = ScriptedModel::new([]);
    let runtime = runtime_with(&model, vec![calculator.into()]);
    let message = DeliveredMessage::User(flue_runtime::message::UserMessage {
        body: "look".into(),
        attachments: vec![flue_runtime::message::Attachment::Image {
            data: "not base64!".into(),
            mime_type: "image/png".into(),
            filename: None,
        }],
    });
    let error = runtime.init(&calculator, "bad-image").send(message).await.unwrap_err();
    assert!(
        error.to_string().contains("Image data must be base64-encoded."),
        "{error}"
    );
    assert!(model.requests().is_empty());
}

/// Look up an order.
#[tool(progress_argument = "order")]
async fn lookup_order(
    /// The order number
    order: String,
) -> String {
    format!("{order} shipped")
}

#[agent]
fn orders() -> &'static str {
    use_model("scripted/x");
    use_tool(lookup_order);
    use_tool(add);
    "You look up orders."
}

#[tokio::test]
async fn tool_call_started_fires_once_per_call_before_the_tool_runs_with_its_progress_argument() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([
            ("lookup_order", json!({"order": "A-1001"})),
            ("add", json!({"a": 1, "b": 2})),
        ]),
        ScriptedReply::text("Shipped."),
    ]);
    let runtime = runtime_with(&model, vec![orders.into()]);
    let mut events = runtime.observe();
    runtime.init(&orders, "o").send("where is A-1001?").await.unwrap();
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            Event::ToolCallStarted {
                tool_name, progress, ..
            } => seen.push(format!("started {tool_name} {progress:?}")),
            Event::ToolStart { tool_name, .. } => seen.push(format!("runs {tool_name}")),
            Event::ToolCallDone { tool_name, status, .. } => seen.push(format!("done {tool_name} {status}")),
            _ => {}
        }
    }
    assert_eq!(
        seen,
        [
            "started lookup_order Some(\"A-1001\")",
            "started add None",
            "runs lookup_order",
            "runs add",
            "done lookup_order success",
            "done add success",
        ]
    );
}

// ---- joins, resumes and events (reference §3, §7, §8) ------------------------------------

static FINISH_DISPATCHED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[agent]
fn finish_dispatcher() -> &'static str {
    use_model("scripted/x");
    let dispatch = use_dispatch_message();
    use_agent_finish(move |_ctx| {
        let dispatch = dispatch.clone();
        async move {
            // Appends nothing; dispatches once.
            if !FINISH_DISPATCHED.swap(true, std::sync::atomic::Ordering::SeqCst) {
                dispatch.dispatch("late follow-up").await.map_err(|e| e.to_string())?;
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        }
    });
    "Finish."
}

/// Reference §3.8 "Join points: … the would-stop phase (before finish hooks; again after a
/// no-append cycle in case a hook dispatched)"; §8.23 "A cycle with no appends but a dispatch
/// inside the hook triggers a join + another cycle".
#[tokio::test]
async fn a_dispatch_inside_a_no_append_finish_cycle_joins_the_live_response() {
    let model = ScriptedModel::new([ScriptedReply::text("first"), ScriptedReply::text("second")]);
    let runtime = runtime_with(&model, vec![finish_dispatcher.into()]);
    let mut events = runtime.observe();
    let host = runtime.init(&finish_dispatcher, "rf").send("go").await.unwrap();
    // Collect until both submissions settled (on their own, the delivery settles later).
    let mut running = Vec::new();
    let mut settled = Vec::new();
    while settled.len() < 2 {
        let observation = tokio::time::timeout(std::time::Duration::from_secs(5), events.recv())
            .await
            .expect("both submissions settle")
            .unwrap();
        match observation.event {
            Event::SubmissionRunning { .. } => running.push(observation.submission_id.unwrap()),
            Event::SubmissionSettled { .. } => settled.push(observation.submission_id.unwrap()),
            _ => {}
        }
    }
    let delivery = settled.iter().find(|id| **id != host.submission_id).unwrap().clone();
    let row = runtime.store().submission(&delivery).await.unwrap().unwrap();
    assert_eq!(
        row.joined_into.as_deref(),
        Some(host.submission_id.as_str()),
        "the finish hook's dispatch joins the host's response"
    );
    assert!(
        !running.contains(&delivery),
        "a joined delivery never emits submission_running: {running:?}"
    );
}

static JOIN_SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[agent]
fn counter_joiner() -> &'static str {
    use_model("scripted/x");
    let (count, set_count) = use_persistent_state("count", 0u32);
    let dispatch = use_dispatch_message();
    use_tool(
        Tool::new("bump_and_follow_up")
            .description("Bump the count and queue a follow-up.")
            .run(move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
                let (set_count, dispatch) = (set_count.clone(), dispatch.clone());
                async move {
                    set_count.set(1)?;
                    dispatch
                        .dispatch("follow-up")
                        .await
                        .map_err(|e| ToolError::new(e.to_string()))?;
                    Ok::<_, ToolError>("ok")
                }
            }),
    );
    use_agent_start(move |ctx| async move {
        if ctx.delivery().body() == "follow-up" {
            JOIN_SEEN.lock().unwrap().push(format!("count={count}"));
        }
        Ok::<_, flue_runtime::event_hooks::AppendError>(())
    });
    "Count."
}

/// Reference §3.4 "A joined delivery re-renders first so hooks see earlier writes"; §2.4
/// "Re-render … at a join boundary before a joined delivery's `useAgentStart` hooks".
#[tokio::test]
async fn a_joined_deliverys_start_seam_runs_on_a_fresh_render_that_sees_the_batchs_writes() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("bump_and_follow_up", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![counter_joiner.into()]);
    runtime.init(&counter_joiner, "rj").send("go").await.unwrap();
    assert_eq!(model.requests().len(), 2, "the follow-up joined");
    assert_eq!(*JOIN_SEEN.lock().unwrap(), ["count=1"]);
}

/// Reference §3.7 step 10 "Resolve interrupted joins …, then apply queued joins" before
/// driving model turns; §3.8 "Join points: before turn 1, every turn end, and the would-stop
/// phase".
#[tokio::test]
async fn deliveries_queued_behind_the_head_join_before_turn_one() {
    let model = ScriptedModel::new([ScriptedReply::text("both answered"), ScriptedReply::text("extra")]);
    let runtime = runtime_with(&model, vec![relay_one.into()]);
    let key = InstanceKey::new("relay_one", "q");
    runtime
        .store()
        .admit(harness::admission(&key, "sub_a", "first question"))
        .await
        .unwrap();
    runtime
        .store()
        .admit(harness::admission(&key, "sub_b", "second question"))
        .await
        .unwrap();
    runtime.start().await;
    let handle = runtime.init(&relay_one, "q");
    tokio::time::timeout(std::time::Duration::from_secs(5), handle.read("sub_b"))
        .await
        .unwrap()
        .unwrap();
    let first = harness::user_texts(&model.requests()[0]);
    assert_eq!(first, ["first question", "second question"], "B joined before turn 1");
    assert_eq!(model.requests().len(), 1);
}

#[agent]
fn relay_one() -> &'static str {
    use_model("scripted/x");
    "Relay."
}

/// Reference §7.3 item 8: "per tool: `tool_start` at execution, `message_start`/`message_end`
/// of its tool-result message when done".
#[tokio::test]
async fn each_tool_result_message_has_its_message_start_and_end_between_tool_start_and_tool() {
    let (_runtime, mut events) = observed_calculator_exchange("o-1").await;
    let mut kinds = Vec::new();
    while let Ok(observation) = events.try_recv() {
        kinds.push(match observation.event {
            Event::ToolStart { .. } => "tool_start".to_owned(),
            Event::Tool { .. } => "tool".to_owned(),
            Event::MessageStart { message } => format!("message_start:{}", message.role()),
            Event::MessageEnd { message } => format!("message_end:{}", message.role()),
            _ => continue,
        });
    }
    let from = kinds.iter().position(|k| k == "tool_start").unwrap();
    let to = kinds.iter().position(|k| k == "tool").unwrap();
    assert_eq!(
        kinds[from..=to],
        ["tool_start", "message_start:tool", "message_end:tool", "tool"],
        "{kinds:?}"
    );
}

/// Reference §7.2: `submission_queued` is at least once — a replay of an idempotency key
/// emits it again, for the submission the replay converged on.
#[tokio::test]
async fn a_replayed_idempotency_key_emits_submission_queued_again() {
    let model = ScriptedModel::new([ScriptedReply::text("paid")]);
    let runtime = runtime_with(&model, vec![calculator.into()]);
    let mut events = runtime.observe();
    let first = runtime
        .dispatch_request("calculator", SendRequest::new("c", "pay").idempotency_key("k-1"))
        .await
        .unwrap();
    let replay = runtime
        .dispatch_request("calculator", SendRequest::new("c", "pay").idempotency_key("k-1"))
        .await
        .unwrap();
    assert!(replay.deduplicated);
    let mut queued = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if matches!(observation.event, Event::SubmissionQueued { .. }) {
            queued.push(observation.submission_id.clone());
        }
    }
    assert_eq!(queued, [Some(first.submission_id.clone()), Some(first.submission_id)]);
}

// A sandbox factory that panics (here, not in tests/sandbox.rs: a panic with RUST_BACKTRACE set
// symbolizes a backtrace, and that file measures the process's peak memory).

/// A sandbox factory that panics while it is called (`early`) or inside its future.
struct PanickingFactory {
    early: bool,
}

impl flue_core::sandbox::SandboxFactory for PanickingFactory {
    fn create_sandbox(
        &self,
        _instance_id: &str,
    ) -> flue_core::BoxFuture<
        'static,
        Result<std::sync::Arc<dyn flue_core::sandbox::Sandbox>, flue_core::sandbox::SandboxError>,
    > {
        assert!(!self.early, "no sandbox host configured");
        Box::pin(async { panic!("the sandbox host went away") })
    }
}

/// A remote sandbox host that refuses the connection, quoting its URL with the key in it.
struct RefusedFactory;

impl flue_core::sandbox::SandboxFactory for RefusedFactory {
    fn create_sandbox(
        &self,
        _instance_id: &str,
    ) -> flue_core::BoxFuture<
        'static,
        Result<std::sync::Arc<dyn flue_core::sandbox::Sandbox>, flue_core::sandbox::SandboxError>,
    > {
        Box::pin(async {
            Err(flue_core::sandbox::SandboxError::Io(
                "error sending request for url (https://sandbox.example.com/v1/boxes?api_key=sk-hunter2)".into(),
            ))
        })
    }
}

#[agent]
fn refused_factory() -> &'static str {
    use_model("scripted/x");
    use_sandbox(RefusedFactory);
    "Work with files."
}

/// A sandbox factory's error may quote the host's URL: its query (a key) stays out of the
/// settlement, which the records keep.
#[tokio::test]
async fn a_sandbox_factorys_error_keeps_no_url_query_in_the_settlement() {
    let model = ScriptedModel::new([]);
    let runtime = runtime_with(&model, vec![refused_factory.into()]);
    let error = runtime.init(&refused_factory, "r").send("go").await.unwrap_err();
    let (error_type, message) = run_error(error);
    assert_eq!(error_type, "sandbox_unavailable");
    assert_eq!(
        message,
        "[flue] The sandbox could not be created: error sending request for url (https://sandbox.example.com/v1/boxes)"
    );
}

#[agent]
fn panicking_factory_early() -> &'static str {
    use_model("scripted/x");
    use_sandbox(PanickingFactory { early: true });
    "Work with files."
}

#[agent]
fn panicking_factory_late() -> &'static str {
    use_model("scripted/x");
    use_sandbox(PanickingFactory { early: false });
    "Work with files."
}

#[tokio::test]
async fn a_sandbox_factory_that_panics_fails_the_submission_and_the_runtime_keeps_working() {
    let model = ScriptedModel::new([ScriptedReply::text("still here")]);
    let runtime = runtime_with(
        &model,
        vec![
            panicking_factory_early.into(),
            panicking_factory_late.into(),
            calculator.into(),
        ],
    );
    let early = runtime
        .init(&panicking_factory_early, "p")
        .send("go")
        .await
        .unwrap_err();
    let late = runtime.init(&panicking_factory_late, "p").send("go").await.unwrap_err();
    for (error, panic) in [
        (early, "no sandbox host configured"),
        (late, "the sandbox host went away"),
    ] {
        let (error_type, message) = run_error(error);
        assert_eq!(error_type, "sandbox_unavailable");
        assert_eq!(
            message,
            format!("[flue] The sandbox could not be created: panicked: {panic}")
        );
    }
    let reply = runtime.init(&calculator, "after").send("hi").await.unwrap();
    assert_eq!(reply.text, "still here");
}

/// What each render of [`marked`] mounted.
static MARKED: Renders = Renders::new();

#[agent(max_steps = 4)]
fn marked() -> &'static str {
    use_model("scripted/x");
    let marker = MARKED.mark();
    use_tool(Tool::new("add").description("Add two numbers.").run(
        move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
            let _held = marker.clone();
            async move { Ok::<_, ToolError>("5") }
        },
    ));
    "You add numbers."
}

/// A response's objects refer to one another (the execution's thread view offers the `task`
/// tool, whose delegation keeps that view as its children's parent, and the attempt): once the
/// response ends nothing of it may stay alive, or every exchange leaks its attempt, writer,
/// views and tools, and a server's memory grows with each one.
#[tokio::test]
async fn a_settled_response_keeps_nothing_it_rendered_alive() {
    let model = ScriptedModel::new([]);
    let runtime = runtime_with(&model, vec![marked.into()]);
    // Two instances each time: one conversation going on, one new.
    for id in (0..3).flat_map(|exchange| ["kept".to_owned(), format!("new-{exchange}")]) {
        model.push(ScriptedReply::tool_call("add", json!({"a": 2, "b": 3})));
        model.push(ScriptedReply::text("5"));
        let reply = runtime.init(&marked, id).send("2+3?").await.unwrap();
        assert_eq!(reply.text, "5");
    }
    let (rendered, held) = MARKED.rendered_and_held().await;
    assert!(rendered >= 12, "every exchange rendered twice at least: {rendered}");
    assert_eq!(held, 0, "renders whose tools are still held, of {rendered}");
}

/// Tool calls whose arguments, all the response's calls together, would parse past the JSON
/// limits fail the call as an invalid response, not retried, before the runtime records the
/// calls or parses their arguments. Each call alone is within the limits.
#[tokio::test]
async fn tool_call_arguments_past_the_json_limits_fail_the_call_before_anything_records_them() {
    let half = vec![json!({"n": 0}); flue_runtime::MAX_JSON_CONTAINERS / 2];
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls(vec![
            ("add", json!({"a": 1, "b": 2, "records": half})),
            ("add", json!({"a": 3, "b": 4, "records": half})),
        ]),
        ScriptedReply::text("never asked"),
    ]);
    let runtime = runtime_with(&model, vec![calculator.into()]);
    match runtime.init(&calculator, "big-arguments").send("go").await {
        Err(RuntimeError::Run {
            error_type, message, ..
        }) => {
            assert_eq!(error_type, "operation_failed");
            assert!(message.contains("100000 JSON objects"), "{message}");
        }
        other => panic!("expected a failed submission, got {other:?}"),
    }
    assert_eq!(model.requests().len(), 1, "an invalid response is not retried");
    let batches = runtime
        .store()
        .read(&InstanceKey::new("calculator", "big-arguments"), None)
        .await
        .unwrap();
    assert!(
        batches
            .iter()
            .flat_map(|batch| batch.records.iter())
            .all(|record| !matches!(record.body, RecordBody::AssistantToolCall { .. })),
        "the call was not recorded"
    );
}

static MODEL_DECLARED_ONCE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Settle the model question (marks it settled).
#[tool]
async fn settle_model() -> String {
    MODEL_DECLARED_ONCE.store(true, std::sync::atomic::Ordering::SeqCst);
    "settled".to_owned()
}

/// Declares its model only until its tool ran: a render after that omits `use_model`.
#[agent]
fn forgetful() -> &'static str {
    if !MODEL_DECLARED_ONCE.load(std::sync::atomic::Ordering::SeqCst) {
        use_model("scripted/first-model");
    }
    use_tool(settle_model);
    "Settle the question."
}

/// Reference §8.2: the model is read once, at the response's first render, and is
/// submission-scoped: a later render that omits `use_model` is not refused, and the next
/// call is made to the first model.
#[tokio::test]
async fn a_rerender_that_omits_use_model_keeps_the_responses_model() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("settle_model", json!({})),
        ScriptedReply::text("settled on the first model"),
    ]);
    let runtime = runtime_with(&model, vec![forgetful.into()]);
    let reply = runtime.init(&forgetful, "f").send("go").await.unwrap();
    assert_eq!(reply.text, "settled on the first model");
    let requests = model.requests();
    assert_eq!(requests.len(), 2);
    assert!(
        requests.iter().all(|request| request.model == "first-model"),
        "{requests:?}"
    );
}

static START_BARRIER: std::sync::LazyLock<tokio::sync::Barrier> =
    std::sync::LazyLock::new(|| tokio::sync::Barrier::new(2));
static SECOND_APPENDED: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Two start callbacks that each wait for the other (they finish only when they run at the
/// same time), the first appending only once the second has appended.
#[agent]
fn rendezvous() -> &'static str {
    use_model("scripted/x");
    use_agent_start(|ctx| async move {
        START_BARRIER.wait().await;
        SECOND_APPENDED.notified().await;
        ctx.append(Signal::new("first", "a"))
    });
    use_agent_start(|ctx| async move {
        START_BARRIER.wait().await;
        let appended = ctx.append(Signal::new("second", "b"));
        SECOND_APPENDED.notify_one();
        appended
    });
    "Meet."
}

/// Reference §3.4 and §3.3: a delivery's `use_agent_start` callbacks start together
/// (`Promise.allSettled`), and their appends are committed in the callbacks' declaration
/// order, whatever order they finished in.
#[tokio::test]
async fn start_callbacks_run_concurrently_and_their_appends_keep_declaration_order() {
    let model = ScriptedModel::new([ScriptedReply::text("met")]);
    let runtime = runtime_with(&model, vec![rendezvous.into()]);
    let sent = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runtime.init(&rendezvous, "r").send("hi"),
    )
    .await
    .expect("the callbacks ran at the same time (one alone waits at the barrier for good)");
    sent.unwrap();
    let batches = runtime
        .store()
        .read(&InstanceKey::new("rendezvous", "r"), None)
        .await
        .unwrap();
    let signals: Vec<&str> = batches
        .iter()
        .flat_map(|batch| batch.records.iter())
        .filter_map(|record| match &record.body {
            RecordBody::Signal { signal_type, .. } => Some(signal_type.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(signals, ["first", "second"]);
}

static STARTED_AFTER_A_FAILED_RESPONSE_START: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[agent]
fn refuses_to_start(props: AgentProps) -> &'static str {
    use_model("scripted/x");
    if props.id() == "refusing" {
        use_response_start(|_| Err::<serde_json::Value, _>("no metadata today"));
    }
    use_agent_start(|_ctx| async {
        STARTED_AFTER_A_FAILED_RESPONSE_START.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok::<(), &str>(())
    });
    "You answer."
}

/// Reference §3.7: the input is appended (step 4) before `use_response_start` runs (step 6),
/// and the start seam (step 9) after it. A failing response start leaves the user's message
/// in the conversation, and no start callback has run.
#[tokio::test]
async fn a_failing_response_start_keeps_the_users_message_and_runs_no_start_callback() {
    let store = MemoryStore::new();
    let model = ScriptedModel::new([ScriptedReply::text("fine")]);
    let runtime = harness::runtime_on(store.clone(), &model, vec![refuses_to_start.into()]);
    let error = runtime
        .init(&refuses_to_start, "refusing")
        .send("hi")
        .await
        .unwrap_err();
    assert_eq!(
        run_error(error),
        (
            "response_hook_failed".to_owned(),
            "[flue] A use_response_start callback (hook #0 in declaration order) threw: no metadata today".to_owned()
        )
    );
    assert_eq!(
        STARTED_AFTER_A_FAILED_RESPONSE_START.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the start seam comes after the response start"
    );
    let key = InstanceKey::new("refuses_to_start", "refusing");
    let batches = flue_runtime::store::Store::read(&store, &key, None).await.unwrap();
    let bodies: Vec<&str> = batches
        .iter()
        .flat_map(|batch| batch.records.iter())
        .filter_map(|record| match &record.body {
            RecordBody::UserMessage { body, .. } => Some(body.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(bodies, ["hi"]);
    assert!(model.requests().is_empty(), "no model call");
}

static STARTED_WITHOUT_A_SANDBOX: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[agent]
fn refused_sandbox_with_start() -> &'static str {
    use_model("scripted/x");
    use_sandbox(RefusedFactory);
    use_agent_start(|_ctx| async {
        STARTED_WITHOUT_A_SANDBOX.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok::<(), &str>(())
    });
    "Work with files."
}

/// Reference §3.7: the sandbox is made at initialization (step 2), before the input is
/// stored (step 4) and the start seam runs (step 9): a factory that fails leaves nothing done.
#[tokio::test]
async fn a_sandbox_that_cannot_be_made_fails_the_submission_before_its_input_or_start_callbacks() {
    let store = MemoryStore::new();
    let model = ScriptedModel::new([]);
    let runtime = harness::runtime_on(store.clone(), &model, vec![refused_sandbox_with_start.into()]);
    let error = runtime
        .init(&refused_sandbox_with_start, "r")
        .send("go")
        .await
        .unwrap_err();
    assert_eq!(run_error(error).0, "sandbox_unavailable");
    assert_eq!(STARTED_WITHOUT_A_SANDBOX.load(std::sync::atomic::Ordering::SeqCst), 0);
    let key = InstanceKey::new("refused_sandbox_with_start", "r");
    let batches = flue_runtime::store::Store::read(&store, &key, None).await.unwrap();
    let inputs = batches
        .iter()
        .flat_map(|batch| batch.records.iter())
        .filter(|record| matches!(record.body, RecordBody::UserMessage { .. } | RecordBody::AgentStartRun))
        .count();
    assert_eq!(inputs, 0, "no input record, no start seam marker");
}

static FINISH_SAW: Mutex<Vec<u32>> = Mutex::new(Vec::new());

#[agent]
fn finish_reads_latest_render() -> &'static str {
    use_model("scripted/x");
    let (count, set_count) = use_persistent_state("count", 0u32);
    use_tool(Tool::new("bump").description("Set the count to 1.").run(
        move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
            let set_count = set_count.clone();
            async move {
                set_count.set(1)?;
                Ok::<_, ToolError>("ok")
            }
        },
    ));
    // The callback captures this render's value of `count`.
    use_agent_finish(move |_ctx| async move {
        FINISH_SAW.lock().unwrap().push(count);
        Ok::<_, flue_runtime::event_hooks::AppendError>(())
    });
    "Count."
}

/// Reference §8.7: a seam runs the callbacks of the latest render, so a finish callback
/// sees what a tool wrote earlier in the same response (the render before the last model
/// call read it), not the init render's value.
#[tokio::test]
async fn the_finish_seam_runs_the_callbacks_of_the_latest_render() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("bump", json!({})),
        ScriptedReply::text("Done."),
    ]);
    let runtime = runtime_with(&model, vec![finish_reads_latest_render.into()]);
    runtime.init(&finish_reads_latest_render, "f").send("go").await.unwrap();
    assert_eq!(*FINISH_SAW.lock().unwrap(), [1]);
}

#[agent]
fn phased() -> String {
    use_model("scripted/x");
    let (phase, set_phase) = use_persistent_state("phase", String::from("new"));
    use_agent_start(move |_ctx| {
        let set_phase = set_phase.clone();
        async move { set_phase.set("started".to_owned()).map_err(|error| error.to_string()) }
    });
    format!("Phase: {phase}.")
}

/// Every model call renders afresh, turn 1 included: a start callback's state
/// write already shapes turn 1's instruction. (The reference's turn 1 uses the init render.)
#[tokio::test]
async fn turn_one_renders_afresh_and_sees_what_the_start_seam_wrote() {
    let model = ScriptedModel::new([ScriptedReply::text("ok")]);
    let runtime = runtime_with(&model, vec![phased.into()]);
    runtime.init(&phased, "p").send("go").await.unwrap();
    assert_eq!(
        instructions_of(model.requests()[0].system.as_deref()),
        Some("Phase: started.")
    );
}

/// A handle reads its own instance's submissions: another instance's id (or one never
/// admitted) is refused, not answered with an empty reply.
#[tokio::test]
async fn a_handle_cannot_read_another_instances_submission() {
    let model = ScriptedModel::new([ScriptedReply::text("mine"), ScriptedReply::text("theirs")]);
    let runtime = runtime_with(&model, vec![calculator.into()]);
    let mine = runtime.init(&calculator, "mine");
    let theirs = runtime.init(&calculator, "theirs");
    let reply = mine.send("hi").await.unwrap();
    theirs.send("hi").await.unwrap();
    assert_eq!(mine.read(&reply.submission_id).await.unwrap().text, "mine");
    // Nor is an id no admission makes asked of the store (a NUL fails a Postgres lookup).
    let long = "s".repeat(600);
    for id in [
        reply.submission_id.as_str(),
        "sub_never",
        "",
        "sub_\u{0}x",
        long.as_str(),
    ] {
        let error = theirs.read(id).await.unwrap_err();
        assert!(
            matches!(&error, RuntimeError::InvalidRequest(message) if message.contains("no submission")),
            "{error}"
        );
    }
}
