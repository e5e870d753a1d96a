//! One response end to end through the runtime, on the memory store, with the scripted model.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use std::sync::Mutex;

use flue_runtime::events::Event;
use flue_runtime::prelude::*;
use flue_runtime::provider::{ModelMessage, ProviderRegistry};
use flue_runtime::record::{Outcome, RecordBody};
use flue_runtime::store::{InstanceKey, MemoryStore, UidCondition};
use flue_runtime::testing::{ScriptedModel, ScriptedReply};
use flue_runtime::{Runtime, RuntimeError, RuntimeOptions, SendRequest};
use serde_json::json;

fn runtime_with(model: &ScriptedModel, agents: Vec<AgentRef>) -> Runtime {
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    let mut builder = Runtime::builder().providers(providers).options(RuntimeOptions {
        model_retry_delay: std::time::Duration::from_millis(1),
        ..RuntimeOptions::default()
    });
    for agent in agents {
        builder = builder.agent(agent);
    }
    builder.build().unwrap()
}

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
    let model = ScriptedModel::new([ScriptedReply::tool_call("add", json!({"a": 2, "b": 3})), ScriptedReply::text("2 + 3 = 5")]);
    let runtime = runtime_with(&model, vec![calculator.into()]);
    let reply = runtime.init(&calculator, "c-1").send("What is 2 + 3?").await.unwrap();
    assert_eq!(reply.text, "2 + 3 = 5");
    let requests = model.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[0].model, "calc-1");
    assert_eq!(requests[0].system.as_deref(), Some("You add numbers with the add tool."));
    assert_eq!(requests[0].tools[0].name, "add");
    assert_eq!(requests[0].messages, [ModelMessage::User { content: "What is 2 + 3?".into() }]);
    let ModelMessage::Tool { content, is_error, .. } = &requests[1].messages[2] else { panic!("expected a tool result") };
    assert_eq!((content.as_str(), *is_error), ("5", false));
}

#[tokio::test]
async fn invalid_tool_arguments_go_back_to_the_model_and_the_tool_does_not_run() {
    let model = ScriptedModel::new([ScriptedReply::tool_call("add", json!({"a": "two"})), ScriptedReply::text("Sorry.")]);
    let runtime = runtime_with(&model, vec![calculator.into()]);
    runtime.init(&calculator, "c-2").send("add").await.unwrap();
    let ModelMessage::Tool { content, is_error, .. } = &model.requests()[1].messages[2] else { panic!("tool result") };
    assert!(*is_error);
    assert!(content.starts_with("Tool argument validation failed:"), "{content}");
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
    let model = ScriptedModel::new([ScriptedReply::text("one"), ScriptedReply::text("two"), ScriptedReply::text("three")]);
    let runtime = runtime_with(&model, vec![checklist.into()]);
    let reply = runtime.init(&checklist, "k").send("start").await.unwrap();
    assert_eq!(model.requests().len(), 3);
    assert_eq!(reply.text, "one\n\ntwo\n\nthree");
    let last = &model.requests()[2].messages;
    let ModelMessage::User { content } = &last[last.len() - 1] else { panic!("a signal") };
    assert!(content.starts_with("<signal type=\"todo\">"), "{content}");
    let batches = runtime.store().read(&InstanceKey::new("checklist", "k"), None).await.unwrap();
    let cycles = batches.iter().flat_map(|b| &b.records).filter(|r| matches!(r.body, RecordBody::AgentFinishCycle)).count();
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
    let RuntimeError::Run { error_type, message, .. } = error else { panic!("a run error") };
    assert_eq!(error_type, "agent_finish_ceiling");
    assert!(message.contains("after 32 continued cycles"));
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
    use_tool(Tool::new("work").description("Do the work.").run(move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
        let progress = progress.clone();
        let set_count = set_count.clone();
        async move {
            progress.write(&Progress { step: "working".into() })?;
            set_count.update(|n| n + 1)?;
            Ok::<_, ToolError>("done")
        }
    }));
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
    assert_eq!(reply.metadata, json!({"channel": "test", "tools": 1}).as_object().unwrap().clone());
    // The next submission's render reads the committed state.
    handle.send("again").await.unwrap();
    assert_eq!(model.requests()[2].system.as_deref(), Some("You worked before."));
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
    let ModelMessage::User { content } = &messages[1] else { panic!("signal") };
    assert!(content.contains("prefers short answers"));
    assert_eq!(model.requests()[0].system.as_deref(), Some("Instance g-1."));
}

#[agent]
fn crashing() -> &'static str {
    use_model("scripted/x");
    use_model("scripted/y");
    "never"
}

#[tokio::test]
async fn a_panicking_render_fails_the_submission_with_its_message_and_the_runtime_keeps_working() {
    let model = ScriptedModel::new([ScriptedReply::text("ok")]);
    let runtime = runtime_with(&model, vec![crashing.into(), calculator.into()]);
    let error = runtime.init(&crashing, "x").send("hi").await.unwrap_err();
    let RuntimeError::Run { error_type, message, .. } = error else { panic!("run error") };
    assert_eq!(error_type, "render_failed");
    assert!(message.starts_with("[flue] use_model() was called twice in one render."));
    let reply = runtime.init(&calculator, "after").send("hi").await.unwrap();
    assert_eq!(reply.text, "ok");
}

#[tokio::test]
async fn submissions_of_one_instance_run_one_at_a_time_in_admission_order() {
    let model = ScriptedModel::echo();
    let runtime = runtime_with(&model, vec![calculator.into()]);
    let handle = runtime.init(&calculator, "queue");
    let first = handle.dispatch("first").await.unwrap();
    let second = handle.dispatch("second").await.unwrap();
    let third = handle.dispatch("third").await.unwrap();
    let replies = [handle.read(&first.submission_id).await.unwrap(), handle.read(&second.submission_id).await.unwrap(), handle.read(&third.submission_id).await.unwrap()];
    // Later deliveries may join a live response; every one is answered, in order.
    let seen: Vec<String> = model
        .requests()
        .iter()
        .flat_map(|request| request.messages.iter())
        .filter_map(|message| match message {
            ModelMessage::User { content } => Some(content.clone()),
            _ => None,
        })
        .collect();
    let order: Vec<usize> = ["first", "second", "third"].iter().map(|m| seen.iter().position(|s| s == m).unwrap()).collect();
    assert!(order.windows(2).all(|pair| pair[0] < pair[1]), "{seen:?}");
    assert!(replies.iter().all(|reply| !reply.text.is_empty()));
}

#[tokio::test]
async fn conditional_sends_and_idempotency_keys_follow_the_reference() {
    let model = ScriptedModel::echo();
    let runtime = runtime_with(&model, vec![calculator.into()]);
    let created = runtime.dispatch_request("calculator", SendRequest::new("c", "hi").uid(UidCondition::CreateOnly)).await.unwrap();
    let again = runtime.dispatch_request("calculator", SendRequest::new("c", "hi").uid(UidCondition::CreateOnly)).await.unwrap_err();
    assert_eq!(again, RuntimeError::InstanceExists { id: "c".into(), uid: created.uid.clone() });
    let missing = runtime
        .dispatch_request("calculator", SendRequest::new("nobody", "hi").uid(UidCondition::Existing("inst_x".into())))
        .await
        .unwrap_err();
    assert_eq!(missing, RuntimeError::InstanceNotFound("nobody".into()));
    let first = runtime.dispatch_request("calculator", SendRequest::new("c", "pay").idempotency_key("k-1")).await.unwrap();
    let replay = runtime.dispatch_request("calculator", SendRequest::new("c", "pay").idempotency_key("k-1")).await.unwrap();
    assert_eq!(first.submission_id, replay.submission_id);
    assert!(first.submission_id.starts_with("sub_ik_") && replay.deduplicated && !first.deduplicated);
    let conflict = runtime.dispatch_request("calculator", SendRequest::new("c", "refund").idempotency_key("k-1")).await.unwrap_err();
    assert!(matches!(conflict, RuntimeError::SubmissionConflict(_)));
}

#[tokio::test]
async fn abort_settles_the_running_submission_as_aborted() {
    let model = ScriptedModel::new([ScriptedReply::tool_call("add", json!({"a": 1, "b": 1})), ScriptedReply::text("done")]);
    let runtime = runtime_with(&model, vec![calculator.into()]);
    let handle = runtime.init(&calculator, "ab");
    let receipt = handle.dispatch("go").await.unwrap();
    assert!(handle.abort().await.unwrap());
    match handle.read(&receipt.submission_id).await {
        Err(RuntimeError::Run { error_type, message, .. }) => {
            assert_eq!(error_type, "submission_aborted");
            assert_eq!(message, "Submission was aborted.");
        }
        Ok(_) => {} // the response finished before the abort landed: completed wins
        Err(other) => panic!("unexpected {other}"),
    }
}

#[tokio::test]
async fn observe_delivers_the_lifecycle_of_a_submission_in_order() {
    let model = ScriptedModel::new([ScriptedReply::tool_call("add", json!({"a": 1, "b": 2})), ScriptedReply::text("3")]);
    let runtime = runtime_with(&model, vec![calculator.into()]);
    let mut events = runtime.observe();
    runtime.init(&calculator, "o").send("1+2").await.unwrap();
    let mut kinds = Vec::new();
    while let Ok(observation) = events.try_recv() {
        kinds.push(match observation.event {
            Event::SubmissionQueued { .. } => "queued",
            Event::SubmissionRunning { .. } => "running",
            Event::TurnStart { .. } => "turn_start",
            Event::Turn { .. } => "turn",
            Event::ToolStart { .. } => "tool_start",
            Event::Tool { .. } => "tool",
            Event::SubmissionSettled { outcome: Outcome::Completed, .. } => "settled",
            _ => continue,
        });
    }
    assert_eq!(kinds, ["queued", "running", "turn_start", "turn", "tool_start", "tool", "turn_start", "turn", "settled"]);
}

#[tokio::test]
async fn initial_data_is_validated_at_creation_only() {
    #[derive(serde::Deserialize, schemars::JsonSchema)]
    #[allow(dead_code)]
    struct Plan {
        tier: String,
    }
    let agent = FnAgent::new(AgentDefinition::new("onboard").initial_data::<Plan>(), |_| {
        use_model("scripted/x");
        let plan: Option<serde_json::Value> = use_initial_data();
        format!("{plan:?}")
    });
    let model = ScriptedModel::echo();
    let runtime = runtime_with(&model, vec![AgentRef::new(agent)]);
    let bad = runtime.dispatch_request("onboard", SendRequest::new("o", "hi").initial_data(json!({"tier": 1}))).await.unwrap_err();
    assert!(matches!(bad, RuntimeError::InvalidRequest(ref message) if message.contains("initial_data")), "{bad}");
    runtime.dispatch_request("onboard", SendRequest::new("o", "hi").initial_data(json!({"tier": "pro"}))).await.unwrap();
    let info = runtime.store().instance(&InstanceKey::new("onboard", "o")).await.unwrap().unwrap();
    assert!(info.uid.starts_with("inst_"));
    let _ = MemoryStore::new();
}
