//! Standard Agents lifecycle hooks through the runtime (reference `standard-agents.md` §6):
//! each test names the checklist items it proves. Items left out are listed, with the reason,
//! in `tests/CONFORMANCE.md`.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use std::sync::Mutex;

use flue_runtime::Runtime;
use flue_runtime::lifecycle::{
    InjectMessage, MessageOrder, MessageRole, MessageStatus, MessagesQuery, ThreadError, ToolStatus, UserValuesQuery,
};
use flue_runtime::prelude::*;
use flue_runtime::provider::{ModelMessage, ProviderError, ProviderErrorKind, ProviderRegistry, StopReason};
use flue_runtime::record::RecordBody;
use flue_runtime::store::{InstanceKey, MemoryStore, SqliteStore};
use flue_runtime::testing::{ScriptedModel, ScriptedReply};
use serde_json::{Value, json};

mod harness;
mod scratch;
use harness::{run_error, runtime_on, runtime_with};

/// A fresh database file for a test that restarts its runtime.
fn scratch_db(name: &str) -> std::path::PathBuf {
    scratch::dir(name).join("flue.db")
}

/// Every record body of an instance's stream, in order.
async fn bodies(runtime: &Runtime, agent: &str, id: &str) -> Vec<RecordBody> {
    runtime
        .store()
        .read(&InstanceKey::new(agent, id), None)
        .await
        .unwrap()
        .iter()
        .flat_map(|batch| batch.records.iter().map(|record| record.body.clone()))
        .collect()
}

// ---- scoping (items 4–10, 60, 63) -------------------------------------------------------------

static SCOPE_LOG: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

#[hook(after_system_message)]
async fn agent_level(_state: &ThreadState, system: String) -> Option<String> {
    SCOPE_LOG.lock().unwrap().push("agent_level");
    Some(format!("{system} +agent"))
}

#[hook(after_system_message)]
async fn render_level(_state: &ThreadState, system: String) -> Option<String> {
    SCOPE_LOG.lock().unwrap().push("render_level");
    Some(format!("{system} +render"))
}

#[hook(after_system_message)]
async fn never_selected(_state: &ThreadState, _system: String) -> Option<String> {
    SCOPE_LOG.lock().unwrap().push("never_selected");
    None
}

#[agent(hooks = [agent_level])]
fn scoped_by_render() -> &'static str {
    use_model("scripted/x");
    use_hooks([render_level]);
    "Base."
}

#[agent(hooks = [agent_level])]
fn scoped_by_agent() -> &'static str {
    use_model("scripted/x");
    "Base."
}

#[tokio::test]
async fn items_04_05_06_07_the_render_selection_replaces_agent_hooks_and_an_empty_one_falls_back() {
    let model = ScriptedModel::new([ScriptedReply::text("a"), ScriptedReply::text("b")]);
    let runtime = runtime_with(&model, vec![scoped_by_render.into(), scoped_by_agent.into()]);
    runtime.init(&scoped_by_render, "r").send("hi").await.unwrap();
    runtime.init(&scoped_by_agent, "a").send("hi").await.unwrap();
    // The hooks see the whole system message (the framework's roster included) and append.
    let requests = model.requests();
    let systems: Vec<&str> = requests
        .iter()
        .map(|request| request.system.as_deref().unwrap())
        .collect();
    assert!(
        systems[0].starts_with("Base.\n\n## Available Agents")
            && systems[0].ends_with(" +render")
            && !systems[0].contains("+agent"),
        "{}",
        systems[0]
    );
    assert!(
        systems[1].ends_with(" +agent") && !systems[1].contains("+render"),
        "{}",
        systems[1]
    );
    let log = SCOPE_LOG.lock().unwrap().clone();
    assert!(
        !log.contains(&"never_selected"),
        "item 4: an unreferenced hook never runs"
    );
    let _ = never_selected; // defined, referenced by nothing the runtime runs
}

static CHAIN_LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[hook(after_system_message)]
async fn first_of_two(_state: &ThreadState, system: String) -> Option<String> {
    CHAIN_LOG.lock().unwrap().push(format!("first saw {system:?}"));
    Some(format!("{system} [1]"))
}

#[hook(after_system_message)]
async fn second_of_two(_state: &ThreadState, system: String) -> Option<String> {
    CHAIN_LOG.lock().unwrap().push(format!("second saw {system:?}"));
    Some(format!("{system} [2]"))
}

#[hook(after_system_message)]
async fn keeps_the_text(_state: &ThreadState, _system: String) -> Option<String> {
    None
}

#[hook(after_system_message)]
async fn fails_midway(_state: &ThreadState, _system: String) -> Result<Option<String>, HookError> {
    Err(HookError::new("mail server unreachable"))
}

#[agent(hooks = [second_of_two, first_of_two])]
fn listed_order() -> &'static str {
    use_model("scripted/x");
    use_hooks([first_of_two, keeps_the_text, fails_midway, second_of_two]);
    "S"
}

#[tokio::test]
async fn items_08_09_11_12_37_hooks_chain_in_listed_order_none_keeps_and_an_error_keeps_the_last_good_value() {
    let logs = harness::logs::capture();
    let model = ScriptedModel::new([ScriptedReply::text("ok")]);
    let runtime = runtime_with(&model, vec![listed_order.into()]);
    runtime.init(&listed_order, "o").send("hi").await.unwrap();
    let system = model.requests()[0].system.clone().unwrap();
    assert!(
        system.starts_with("S\n\n## Available Agents") && system.ends_with(" [1] [2]"),
        "{system}"
    );
    let log = CHAIN_LOG.lock().unwrap().clone();
    assert_eq!(log.len(), 2);
    assert!(
        log[0].starts_with("first saw \"S\\n\\n## Available Agents") && log[0].ends_with("\""),
        "{log:?}"
    );
    assert!(
        log[1].starts_with("second saw \"S\\n\\n") && log[1].ends_with(" [1]\""),
        "{log:?}"
    );
    assert_eq!(
        logs.lines("mail server unreachable"),
        ["[Hooks] ✗ Error running after_system_message hook: mail server unreachable"]
    );
}

// ---- filter_messages (items 13–18) ------------------------------------------------------------

static FILTER_INPUTS: Mutex<Vec<Vec<String>>> = Mutex::new(Vec::new());

#[hook(after_system_message)]
async fn inject_note(state: &ThreadState, _system: String) -> Result<Option<String>, HookError> {
    let step = state.execution().map(|execution| execution.step_count()).unwrap_or(0);
    if step == 1 {
        state
            .inject_message(InjectMessage::new(MessageRole::User, "note from after_system_message"))
            .await
            .map_err(|error| HookError::new(error.to_string()))?;
    }
    Ok(None)
}

#[hook(filter_messages)]
async fn shout_and_add(_state: &ThreadState, messages: Vec<Message>) -> Vec<Message> {
    FILTER_INPUTS.lock().unwrap().push(
        messages
            .iter()
            .map(|row| match row.status {
                Some(MessageStatus::Completed) => row.content.clone().unwrap_or_default(),
                other => format!("{other:?} row"),
            })
            .collect(),
    );
    let mut out: Vec<Message> = messages
        .into_iter()
        .map(|mut row| {
            if row.role == MessageRole::User {
                row.content = row.content.map(|text| text.to_uppercase());
            }
            row
        })
        .collect();
    let mut synthesized = out[0].clone();
    synthesized.id = "context_only".into();
    synthesized.content = Some("synthesized context".into());
    out.push(synthesized);
    out
}

#[agent(hooks = [inject_note, shout_and_add])]
fn filtering() -> &'static str {
    use_model("scripted/x");
    use_tool(echo_tool);
    "F"
}

/// Echo the text.
#[tool]
async fn echo_tool(
    /// Text
    text: String,
) -> String {
    text
}

#[tokio::test]
async fn items_13_14_15_16_17_filter_messages_sees_injected_rows_once_per_request_and_never_changes_storage() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("echo_tool", json!({"text": "x"})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![filtering.into()]);
    runtime.init(&filtering, "f").send("hello").await.unwrap();
    let inputs = FILTER_INPUTS.lock().unwrap().clone();
    assert_eq!(inputs.len(), 2, "item 14: once per model request");
    assert_eq!(inputs[0], ["hello", "note from after_system_message"], "item 13");
    // Item 16: the second snapshot has the stored (not upper-cased) rows; item 15: no pending row.
    assert_eq!(
        inputs[1][..2],
        ["hello".to_owned(), "note from after_system_message".to_owned()]
    );
    assert_eq!(
        inputs[1].len(),
        4,
        "the call step and its result, no pending row: {inputs:?}"
    );
    assert!(
        inputs.iter().flatten().all(|content| !content.ends_with(" row")),
        "{inputs:?}"
    );
    let requests = model.requests();
    assert_eq!(
        requests[0].messages,
        [
            ModelMessage::user("HELLO"),
            ModelMessage::user("NOTE FROM AFTER_SYSTEM_MESSAGE"),
            ModelMessage::user("synthesized context"),
        ],
        "item 17: a synthesized row reaches the request"
    );
    let stored = bodies(&runtime, "filtering", "f").await;
    assert!(
        stored
            .iter()
            .any(|body| matches!(body, RecordBody::UserMessage { body, .. } if body == "hello"))
    );
    assert!(
        !stored.iter().any(
            |body| matches!(body, RecordBody::MessageInjected { content, .. } if content == "synthesized context")
        )
    );
}

#[hook(filter_messages)]
async fn drop_tool_results(_state: &ThreadState, messages: Vec<Message>) -> Vec<Message> {
    messages
        .into_iter()
        .filter(|row| row.role != MessageRole::Tool)
        .collect()
}

#[agent(hooks = [drop_tool_results])]
fn forgetful() -> &'static str {
    use_model("scripted/x");
    use_tool(echo_tool);
    "F"
}

#[tokio::test]
async fn item_18_dropping_a_tool_result_drops_its_call_from_the_request() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("echo_tool", json!({"text": "x"})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![forgetful.into()]);
    runtime.init(&forgetful, "f").send("hello").await.unwrap();
    // The call-only step had no text: with its call dropped it goes too.
    assert_eq!(model.requests()[1].messages, [ModelMessage::user("hello")]);
}

/// Puts a reminder right after every tool-calling step (between its calls and their
/// results) and repeats every tool result at the end.
#[hook(filter_messages)]
async fn misplace_tool_results(_state: &ThreadState, messages: Vec<Message>) -> Vec<Message> {
    let mut out = Vec::new();
    let mut results = Vec::new();
    for row in messages {
        let calls = row.tool_calls.is_some();
        if row.role == MessageRole::Tool {
            results.push(row.clone());
        }
        out.push(row.clone());
        if calls {
            let mut reminder = row;
            reminder.id = format!("reminder-{}", reminder.id);
            reminder.role = MessageRole::User;
            reminder.content = Some("remember the budget".into());
            reminder.tool_calls = None;
            out.push(reminder);
        }
    }
    out.extend(results);
    out
}

#[agent(hooks = [misplace_tool_results])]
fn misplacing() -> &'static str {
    use_model("scripted/x");
    use_tool(echo_tool);
    "M"
}

/// Pairing stays valid however the hook orders its rows (reference: the runtime keeps the
/// pairing valid after the chain): a call's result goes right after its step, once, and a row
/// the hook put between them comes after. OpenAI-format providers refuse anything else.
#[tokio::test]
async fn item_18_a_row_between_a_call_and_its_result_or_a_repeated_result_is_sent_paired() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("echo_tool", json!({"text": "x"})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![misplacing.into()]);
    runtime.init(&misplacing, "m").send("hello").await.unwrap();
    let sent = &model.requests()[1].messages;
    let shape: Vec<String> = sent
        .iter()
        .map(|message| match message {
            ModelMessage::User { content, .. } => format!("user {content}"),
            ModelMessage::Assistant { tool_calls, .. } => format!("calls {}", tool_calls.len()),
            ModelMessage::Tool { tool_call_id, .. } => format!("result of {}", tool_call_id.is_empty()),
        })
        .collect();
    assert_eq!(
        shape,
        ["user hello", "calls 1", "result of false", "user remember the budget"]
    );
    let (ModelMessage::Assistant { tool_calls, .. }, ModelMessage::Tool { tool_call_id, .. }) = (&sent[1], &sent[2])
    else {
        panic!("a step, then its result: {sent:?}")
    };
    assert_eq!(&tool_calls[0].id, tool_call_id);
}

static RETRIED_REQUEST_HOOKS: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

#[hook(after_system_message)]
async fn inject_every_time(state: &ThreadState, _system: String) -> Result<Option<String>, HookError> {
    RETRIED_REQUEST_HOOKS.lock().unwrap().push("after_system_message");
    state
        .inject_message(InjectMessage::new(MessageRole::User, "injected for this step"))
        .await
        .map_err(|error| HookError::new(error.to_string()))?;
    Ok(None)
}

#[hook(filter_messages)]
async fn count_filters(_state: &ThreadState, messages: Vec<Message>) -> Vec<Message> {
    RETRIED_REQUEST_HOOKS.lock().unwrap().push("filter_messages");
    messages
}

#[hook(prefilter_llm_history)]
async fn count_prefilters(_state: &ThreadState, messages: Vec<LlmMessage>) -> Vec<LlmMessage> {
    RETRIED_REQUEST_HOOKS.lock().unwrap().push("prefilter_llm_history");
    messages
}

#[agent(hooks = [inject_every_time, count_filters, count_prefilters])]
fn retried() -> &'static str {
    use_model("scripted/x");
    "R"
}

/// A call the turn loop makes again after a transient failure is the same model request: the
/// request's hooks ran for it once, and what they injected is stored once.
#[tokio::test]
async fn a_call_retried_after_a_transient_failure_runs_the_request_hooks_once() {
    let model = ScriptedModel::new([
        ScriptedReply::Error(ProviderError::new(ProviderErrorKind::Server, "503 overloaded")),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![retried.into()]);
    let reply = runtime.init(&retried, "r").send("hello").await.unwrap();
    assert_eq!(reply.text, "done");
    assert_eq!(
        *RETRIED_REQUEST_HOOKS.lock().unwrap(),
        ["after_system_message", "filter_messages", "prefilter_llm_history"]
    );
    let requests = model.requests();
    assert_eq!(requests.len(), 2, "the failed call and its retry");
    assert_eq!(
        requests[0].messages, requests[1].messages,
        "the retry sends the same request"
    );
    assert_eq!(requests[0].system, requests[1].system);
    let injected = bodies(&runtime, "retried", "r")
        .await
        .into_iter()
        .filter(
            |body| matches!(body, RecordBody::MessageInjected { content, .. } if content == "injected for this step"),
        )
        .count();
    assert_eq!(injected, 1, "the injected row is stored once");
}

// ---- prefilter_llm_history (items 19–21) ------------------------------------------------------

#[hook(prefilter_llm_history)]
async fn rewrite_for_provider(_state: &ThreadState, mut messages: Vec<LlmMessage>) -> Vec<LlmMessage> {
    assert_eq!(messages[0].role, "system", "provider format: the system prompt first");
    messages[0].content = json!("rewritten system");
    messages.push(LlmMessage {
        role: "user".into(),
        content: json!("appended by prefilter"),
        tool_calls: None,
        tool_call_id: None,
        name: None,
    });
    messages
}

#[hook(prefilter_llm_history)]
async fn fails_softly(_state: &ThreadState, _messages: Vec<LlmMessage>) -> Result<Vec<LlmMessage>, HookError> {
    Err(HookError::new("quota service down"))
}

#[agent(hooks = [rewrite_for_provider, fails_softly])]
fn prefiltered() -> &'static str {
    use_model("scripted/x");
    "P"
}

#[tokio::test]
async fn items_19_21_prefilter_output_is_exactly_what_is_dispatched_and_a_plain_error_is_logged() {
    let logs = harness::logs::capture();
    let model = ScriptedModel::new([ScriptedReply::text("ok")]);
    let runtime = runtime_with(&model, vec![prefiltered.into()]);
    let reply = runtime.init(&prefiltered, "p").send("hi").await.unwrap();
    assert_eq!(reply.text, "ok");
    let request = &model.requests()[0];
    assert_eq!(request.system.as_deref(), Some("rewritten system"));
    assert_eq!(
        request.messages,
        [ModelMessage::user("hi"), ModelMessage::user("appended by prefilter")]
    );
    assert_eq!(
        logs.lines("quota service down"),
        ["[Hooks] ✗ Error running prefilter_llm_history hook: quota service down"]
    );
}

#[hook(prefilter_llm_history)]
async fn blocks(_state: &ThreadState, _messages: Vec<LlmMessage>) -> Result<Vec<LlmMessage>, HookError> {
    Err(HookError::block("This request is over the monthly budget."))
}

#[agent(hooks = [blocks])]
fn blocked() -> &'static str {
    use_model("scripted/x");
    "B"
}

#[tokio::test]
async fn item_20_a_blocking_prefilter_stops_with_hook_blocked_and_stores_its_message() {
    let model = ScriptedModel::new([ScriptedReply::text("never")]);
    let runtime = runtime_with(&model, vec![blocked.into()]);
    let mut events = runtime.observe();
    let reply = runtime.init(&blocked, "b").send("hi").await.unwrap();
    assert!(model.requests().is_empty(), "no provider request");
    assert_eq!(reply.text, "This request is over the monthly budget.");
    // Observers see the stored message as any step's: its end, and in agent_end.
    let said = ModelMessage::Assistant {
        text: "This request is over the monthly budget.".into(),
        tool_calls: Vec::new(),
        reasoning: Vec::new(),
    };
    let (mut ended, mut in_agent_end) = (false, false);
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            flue_runtime::events::Event::MessageEnd { message } => ended |= message == said,
            flue_runtime::events::Event::AgentEnd { messages } => in_agent_end = messages.contains(&said),
            _ => {}
        }
    }
    assert!(ended && in_agent_end, "message_end {ended}, agent_end {in_agent_end}");
    let stored = bodies(&runtime, "blocked", "b").await;
    assert!(stored.iter().any(|body| matches!(
        body,
        RecordBody::AssistantMessageCompleted { text, stop_reason: StopReason::HookBlocked, .. }
            if text == "This request is over the monthly budget."
    )));
}

#[derive(serde::Serialize, schemars::JsonSchema)]
struct Status {
    state: String,
}

#[agent(hooks = [blocks])]
fn blocked_reporting() -> &'static str {
    use_model("scripted/x");
    let status = use_data_writer::<Status>("status");
    use_agent_start(move |_ctx| {
        let status = status.clone();
        async move {
            status.write(&Status {
                state: "checking the budget".into(),
            })?;
            Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
        }
    });
    "B"
}

#[tokio::test]
async fn data_written_before_a_blocked_first_step_reaches_the_reply() {
    let model = ScriptedModel::new([ScriptedReply::text("never")]);
    let runtime = runtime_with(&model, vec![blocked_reporting.into()]);
    let handle = runtime.init(&blocked_reporting, "b");
    let reply = handle.send("hi").await.unwrap();
    assert_eq!(reply.text, "This request is over the monthly budget.");
    assert_eq!(reply.data["status"], json!({"state": "checking the budget"}));
    // Durably: the reply read back has it too.
    assert_eq!(handle.read(&reply.submission_id).await.unwrap().data, reply.data);
}

// ---- create and update hooks (items 22–29, 35, 36) --------------------------------------------

static ROW_LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[hook(before_create_message)]
async fn tag_rows(_state: &ThreadState, mut message: Message) -> Message {
    ROW_LOG
        .lock()
        .unwrap()
        .push(format!("before_create {:?} {:?}", message.role, message.status));
    if message.role == MessageRole::User {
        message.content = message.content.map(|text| format!("[user] {text}"));
        message.metadata.insert("tagged".into(), json!(true));
    }
    message
}

#[hook(after_create_message)]
async fn saw_created(_state: &ThreadState, message: &Message) -> Result<(), HookError> {
    ROW_LOG.lock().unwrap().push(format!(
        "after_create {:?} {}",
        message.role,
        message.content.clone().unwrap_or_default()
    ));
    assert!(!message.id.is_empty());
    Err(HookError::new("post-write hooks cannot undo a write"))
}

#[hook(before_update_message)]
async fn sign_answers(_state: &ThreadState, id: &str, mut updates: MessageUpdates) -> MessageUpdates {
    ROW_LOG
        .lock()
        .unwrap()
        .push(format!("before_update {}", id.starts_with("msg_")));
    if let Some(Value::String(content)) = updates.get("content").cloned() {
        updates.insert("content".into(), json!(format!("{content} — signed")));
    }
    updates
}

#[hook(after_update_message)]
async fn saw_updated(_state: &ThreadState, message: &Message) {
    ROW_LOG.lock().unwrap().push(format!(
        "after_update {:?} {:?} {}",
        message.role,
        message.status,
        message.content.clone().unwrap_or_default()
    ));
}

#[agent(hooks = [tag_rows, saw_created, sign_answers, saw_updated])]
fn row_hooks() -> &'static str {
    use_model("scripted/x");
    "R"
}

#[hook(before_update_message)]
async fn redact_tokens(_state: &ThreadState, _id: &str, mut updates: MessageUpdates) -> MessageUpdates {
    if let Some(Value::String(content)) = updates.get("content").cloned() {
        updates.insert("content".into(), json!(content.replace("SECRET", "[redacted]")));
    }
    updates
}

#[agent(hooks = [redact_tokens])]
fn token_redacting() -> &'static str {
    use_model("scripted/x");
    "R"
}

/// A `before_update_message` hook that redacts the answer redacts it for observers too:
/// no live event carries the raw text (its deltas are held back, and the hooked text follows
/// the hooks in one delta, before the turn's event, which carries it too).
#[tokio::test]
async fn a_redacting_update_hook_keeps_the_raw_text_out_of_the_live_events() {
    let model = ScriptedModel::new([ScriptedReply::text("the token is SECRET, keep it")]);
    let runtime = runtime_with(&model, vec![token_redacting.into()]);
    let mut events = runtime.observe();
    let reply = runtime.init(&token_redacting, "r").send("the token?").await.unwrap();
    assert_eq!(reply.text, "the token is [redacted], keep it");
    let mut deltas = String::new();
    let mut turns = Vec::new();
    let mut seen = 0;
    while let Ok(observation) = events.try_recv() {
        seen += 1;
        let shown = format!("{:?}", observation.event);
        assert!(!shown.contains("SECRET"), "{shown}");
        match observation.event {
            flue_runtime::events::Event::TextDelta { text } => deltas.push_str(&text),
            flue_runtime::events::Event::Turn { response, .. } => turns.push(response.text),
            _ => {}
        }
    }
    assert!(seen > 5, "the events were observed ({seen})");
    assert_eq!(deltas, "the token is [redacted], keep it");
    assert_eq!(turns, ["the token is [redacted], keep it"]);
}

/// Marks the answer reviewed, a field the port does not know.
#[hook(before_update_message)]
async fn mark_reviewed(_state: &ThreadState, _id: &str, mut updates: MessageUpdates) -> MessageUpdates {
    updates.insert("reviewed".into(), json!(true));
    updates
}

#[agent(hooks = [redact_tokens, mark_reviewed])]
fn redacting_then_refused() -> &'static str {
    use_model("scripted/x");
    "R"
}

/// A `before_update_message` hook whose set the port refuses fails alone: the step keeps
/// what the hooks before it changed. (Regression: the whole chain's result was dropped for
/// the model's raw text, and the redacted secret was stored and answered.)
#[tokio::test]
async fn a_refused_update_set_fails_its_hook_and_keeps_the_earlier_hooks_changes() {
    let model = ScriptedModel::new([ScriptedReply::text("the token is SECRET")]);
    let runtime = runtime_with(&model, vec![redacting_then_refused.into()]);
    let reply = runtime
        .init(&redacting_then_refused, "r")
        .send("the token?")
        .await
        .unwrap();
    assert_eq!(reply.text, "the token is [redacted]");
    let stored = bodies(&runtime, "redacting_then_refused", "r").await;
    let shown = format!("{stored:?}");
    assert!(!shown.contains("SECRET"), "{shown}");
    assert!(!shown.contains("reviewed"), "the refused set is not stored: {shown}");
}

#[tokio::test]
async fn items_22_23_24_25_36_create_and_update_hooks_shape_the_stored_rows() {
    let model = ScriptedModel::new([ScriptedReply::text("answer")]);
    let runtime = runtime_with(&model, vec![row_hooks.into()]);
    let mut events = runtime.observe();
    let reply = runtime.init(&row_hooks, "r").send("question").await.unwrap();
    assert_eq!(
        reply.text, "answer — signed",
        "item 24: the returned updates are applied"
    );
    // `message_end` shows the messages as stored.
    let mut ended = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let flue_runtime::events::Event::MessageEnd { message } = observation.event {
            ended.push(message);
        }
    }
    assert_eq!(
        ended,
        [
            ModelMessage::user("[user] question"),
            ModelMessage::Assistant {
                text: "answer — signed".into(),
                tool_calls: Vec::new(),
                reasoning: Vec::new()
            }
        ]
    );
    assert_eq!(model.requests()[0].messages, [ModelMessage::user("[user] question")]);
    assert_eq!(
        ROW_LOG.lock().unwrap().clone(),
        [
            "before_create User Some(Completed)",
            "after_create User [user] question",
            "before_create Assistant Some(Pending)",
            "after_create Assistant ",
            "before_update true",
            "after_update Assistant Some(Completed) answer — signed",
        ]
    );
    let stored = bodies(&runtime, "row_hooks", "r").await;
    // Item 22: the stored row shows the change; item 36: the post-write error kept it.
    assert!(
        stored
            .iter()
            .any(|body| matches!(body, RecordBody::UserMessage { body, .. } if body == "[user] question"))
    );
    assert!(stored.iter().any(|body| matches!(
        body,
        RecordBody::MessageUpdated { updates, .. } if updates.get("metadata") == Some(&json!({"tagged": true}))
    )));
}

static TRACED: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Tags the running step's row as soon as it exists, through `update_message`.
#[hook(after_create_message)]
async fn trace_assistant_rows(state: &ThreadState, message: &Message) -> Result<(), HookError> {
    if message.role != MessageRole::Assistant {
        return Ok(());
    }
    let mut updates = MessageUpdates::new();
    updates.insert("metadata".into(), json!({"trace": "t-1"}));
    // The content is the step's to set when it completes: this one is superseded.
    updates.insert("content".into(), json!("placeholder"));
    let updated = state
        .update_message(&message.id, updates)
        .await
        .map_err(|error| HookError::new(error.to_string()))?;
    let read = state.get_message(&message.id).await.unwrap().unwrap();
    TRACED.lock().unwrap().push(format!(
        "{:?} {:?} {:?}",
        updated.status,
        updated.metadata.get("trace"),
        read.metadata.get("trace")
    ));
    Ok(())
}

#[agent(hooks = [trace_assistant_rows])]
fn tracer() -> &'static str {
    use_model("scripted/x");
    "T"
}

/// `after_create_message` hands hooks the running step's row, which `get_message` reads: an
/// `update_message` of it applies to it at once and is stored with its step (under the step's
/// own fields), rather than failing as an unknown message.
#[tokio::test]
async fn the_running_steps_row_takes_updates_stored_with_its_step() {
    let model = ScriptedModel::new([ScriptedReply::text("traced")]);
    let runtime = runtime_with(&model, vec![tracer.into()]);
    let reply = runtime.init(&tracer, "tr-1").send("hi").await.unwrap();
    assert_eq!(reply.text, "traced");
    assert_eq!(
        *TRACED.lock().unwrap(),
        [r#"Some(Pending) Some(String("t-1")) Some(String("t-1"))"#]
    );
    let stored = bodies(&runtime, "tracer", "tr-1").await;
    let updates: Vec<_> = stored
        .iter()
        .filter_map(|body| match body {
            RecordBody::MessageUpdated { updates, .. } => Some(updates.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(updates.len(), 1, "{stored:?}");
    assert_eq!(
        serde_json::Value::Object(updates[0].clone()),
        json!({"metadata": {"trace": "t-1"}})
    );
    // The next request shows the step's own answer.
    model.push(ScriptedReply::text("again"));
    runtime.init(&tracer, "tr-1").send("more").await.unwrap();
    let history = &model.requests()[1].messages;
    assert!(
        history
            .iter()
            .any(|message| matches!(message, ModelMessage::Assistant { text, .. } if text == "traced")),
        "{history:?}"
    );
}

static DELETIONS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Tries to delete the running step's row as soon as it exists.
#[hook(after_create_message)]
async fn delete_assistant_rows(state: &ThreadState, message: &Message) -> Result<(), HookError> {
    if message.role != MessageRole::Assistant {
        return Ok(());
    }
    let exists = state.get_message(&message.id).await.unwrap().is_some();
    let deleted = state.delete_message(&message.id).await;
    DELETIONS
        .lock()
        .unwrap()
        .push(format!("read: {exists}, deleted: {deleted:?}"));
    Ok(())
}

#[agent(hooks = [delete_assistant_rows])]
fn eraser() -> &'static str {
    use_model("scripted/x");
    "E"
}

/// The running step's row, which the reads show, is refused by `delete_message` with a reason
/// rather than answered as a row that does not exist; the step is stored as it answers.
/// (Regression: the call said `false`, "no such row", for a row the hook had just read.)
#[tokio::test]
async fn deleting_the_running_steps_row_is_refused_with_a_reason() {
    let model = ScriptedModel::new([ScriptedReply::text("kept")]);
    let runtime = runtime_with(&model, vec![eraser.into()]);
    let reply = runtime.init(&eraser, "e-1").send("hi").await.unwrap();
    assert_eq!(reply.text, "kept");
    let deletions = DELETIONS.lock().unwrap().clone();
    assert_eq!(deletions.len(), 1, "{deletions:?}");
    assert!(
        deletions[0].starts_with("read: true, deleted: Err(Unavailable(")
            && deletions[0].contains("can be deleted once its step is stored"),
        "{deletions:?}"
    );
}

static PENDING_LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Reads the thread from inside the assistant row's hooks: the row is there, as stored.
async fn log_as_read(state: &ThreadState, hook: &str, message: &Message) {
    let found = state.get_message(&message.id).await.unwrap();
    let listed = state.get_messages(MessagesQuery::default()).await.unwrap();
    let last = listed.messages.last().unwrap();
    PENDING_LOG.lock().unwrap().push(format!(
        "{} {hook} {:?}: get_message {:?}, last listed {} {:?}",
        state.thread_id(),
        message.status,
        found.map(|row| row.status),
        last.id == message.id,
        last.status
    ));
}

#[hook(after_create_message)]
async fn read_created_row(state: &ThreadState, message: &Message) {
    if message.role == MessageRole::Assistant {
        log_as_read(state, "after_create", message).await;
    }
}

#[hook(before_update_message)]
async fn see_failed_status(
    state: &ThreadState,
    _id: &str,
    updates: MessageUpdates,
) -> Result<MessageUpdates, HookError> {
    PENDING_LOG.lock().unwrap().push(format!(
        "{} before_update {}",
        state.thread_id(),
        Value::Object(updates.clone())
    ));
    // Named after its thread: tests running beside this one log the same failure.
    Err(HookError::new(format!(
        "the status board is down for {}",
        state.thread_id()
    )))
}

#[hook(after_update_message)]
async fn read_updated_row(state: &ThreadState, message: &Message) {
    log_as_read(state, "after_update", message).await;
}

#[agent(hooks = [read_created_row, see_failed_status, read_updated_row])]
fn pending_rows() -> &'static str {
    use_model("scripted/x");
    "P"
}

#[agent(hooks = [see_failed_status, read_updated_row])]
fn update_hooks_only() -> &'static str {
    use_model("scripted/x");
    "U"
}

/// Sends to the instance `id` of `agent` with no model reply scripted (the call fails), and
/// returns what its update hooks logged for that instance.
async fn failed_step_updates<A: Agent + Copy + Into<AgentRef>>(agent: A, id: &str) -> Vec<String> {
    let model = ScriptedModel::new([]);
    let runtime = runtime_with(&model, vec![agent.into()]);
    let error = runtime.init(&agent, id).send("question").await.unwrap_err();
    assert_eq!(run_error(error).0, "operation_failed");
    PENDING_LOG
        .lock()
        .unwrap()
        .iter()
        .filter(|line| line.starts_with(&format!("{id} ")) && !line.contains("after_create"))
        .cloned()
        .collect()
}

#[tokio::test]
async fn item_35_the_failed_status_goes_through_the_update_hooks_without_any_create_hook() {
    assert_eq!(
        failed_step_updates(update_hooks_only, "updates-only").await,
        [
            r#"updates-only before_update {"status":"failed"}"#,
            "updates-only after_update Some(Failed): get_message Some(Some(Failed)), last listed true Some(Failed)",
        ]
    );
}

#[tokio::test]
async fn item_23_after_create_message_finds_the_pending_assistant_row_in_the_thread() {
    let model = ScriptedModel::new([ScriptedReply::text("answer")]);
    let runtime = runtime_with(&model, vec![pending_rows.into()]);
    let reply = runtime.init(&pending_rows, "created").send("question").await.unwrap();
    // Item 35: the step's row is written with its last good value though this agent's
    // update hook throws on every update.
    assert_eq!(reply.text, "answer");
    let log = PENDING_LOG.lock().unwrap().clone();
    assert_eq!(
        log.iter().find(|line| line.starts_with("created ")).map(String::as_str),
        Some("created after_create Some(Pending): get_message Some(Some(Pending)), last listed true Some(Pending)"),
        "{log:?}"
    );
}

#[tokio::test]
async fn item_35_a_failed_model_step_gets_its_failed_status_through_the_update_hooks() {
    let logs = harness::logs::capture();
    // The update chain failed: the failed status still goes on with its last good value (what
    // `after_update_message` reads; only completed steps are stored, so the row is not kept).
    assert_eq!(
        failed_step_updates(pending_rows, "failed").await,
        [
            r#"failed before_update {"status":"failed"}"#,
            "failed after_update Some(Failed): get_message Some(Some(Failed)), last listed true Some(Failed)",
        ]
    );
    assert_eq!(
        logs.lines("the status board is down for failed"),
        ["[Hooks] ✗ Error running before_update_message hook: the status board is down for failed"]
    );
}

static PREVENT_LOG: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

#[hook(before_create_message)]
async fn refuse_user_rows(_state: &ThreadState, message: Message) -> Result<Message, HookError> {
    if message.role == MessageRole::User
        && message
            .content
            .as_deref()
            .is_some_and(|text| text.contains("forbidden"))
    {
        return Err(HookError::new("forbidden words are not stored"));
    }
    Ok(message)
}

#[hook(before_create_message)]
async fn after_the_refusal(_state: &ThreadState, message: Message) -> Message {
    PREVENT_LOG.lock().unwrap().push("later before_create ran");
    message
}

#[agent(hooks = [refuse_user_rows, after_the_refusal])]
fn guarded_rows() -> &'static str {
    use_model("scripted/x");
    "G"
}

#[tokio::test]
async fn items_28_29_a_prevented_sent_message_is_not_stored_starts_no_turn_and_fails_with_message_hook_error() {
    let model = ScriptedModel::new([ScriptedReply::text("never")]);
    let runtime = runtime_with(&model, vec![guarded_rows.into()]);
    let error = runtime
        .init(&guarded_rows, "g")
        .send("a forbidden word")
        .await
        .unwrap_err();
    assert_eq!(
        run_error(error),
        (
            "message_hook_error".to_owned(),
            "forbidden words are not stored".to_owned()
        )
    );
    assert!(model.requests().is_empty(), "no turn");
    assert!(
        PREVENT_LOG.lock().unwrap().is_empty(),
        "item 28: later hooks of the kind did not run"
    );
    let stored = bodies(&runtime, "guarded_rows", "g").await;
    assert!(!stored.iter().any(|body| matches!(body, RecordBody::UserMessage { .. })));
}

#[hook(before_create_message)]
async fn refuse_with_text(_state: &ThreadState, message: Message) -> Result<Message, String> {
    if message
        .content
        .as_deref()
        .is_some_and(|text| text.contains("forbidden"))
    {
        return Err(format!("{:?} rows with forbidden words are not stored", message.role));
    }
    Ok(message)
}

/// An error that displays but is no `std::error::Error`, as `anyhow::Error` is.
struct Quota(u32);

impl std::fmt::Display for Quota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "over the quota of {} rows", self.0)?;
        // Its cause in the alternate form only, as `anyhow::Error` shows its causes.
        if f.alternate() {
            f.write_str(": the plan allows no more")?;
        }
        Ok(())
    }
}

#[hook(before_create_message)]
fn refuse_with_display(_state: &ThreadState, message: Message) -> Result<Message, Quota> {
    if message.content.as_deref().is_some_and(|text| text.contains("quota")) {
        return Err(Quota(3));
    }
    Ok(message)
}

#[agent(hooks = [refuse_with_text, refuse_with_display])]
fn text_guarded_rows() -> &'static str {
    use_model("scripted/x");
    "G"
}

#[tokio::test]
async fn a_hook_failing_with_text_or_an_error_that_displays_fails_as_with_a_hook_error_of_that_text() {
    let model = ScriptedModel::new([ScriptedReply::text("never")]);
    let runtime = runtime_with(&model, vec![text_guarded_rows.into()]);
    for (input, message) in [
        ("a forbidden word", "User rows with forbidden words are not stored"),
        ("past the quota", "over the quota of 3 rows: the plan allows no more"),
    ] {
        let error = runtime.init(&text_guarded_rows, "g").send(input).await.unwrap_err();
        assert_eq!(run_error(error), ("message_hook_error".to_owned(), message.to_owned()));
    }
    assert!(model.requests().is_empty(), "no turn");
    let stored = bodies(&runtime, "text_guarded_rows", "g").await;
    assert!(!stored.iter().any(|body| matches!(body, RecordBody::UserMessage { .. })));
}

#[hook(before_create_message)]
async fn rejects_tool_rows(_state: &ThreadState, mut message: Message) -> Result<Message, HookError> {
    if message.role == MessageRole::Tool {
        message.content = Some("never stored".into());
        return Err(HookError::new("tool rows are read-only"));
    }
    Ok(message)
}

#[agent(hooks = [rejects_tool_rows])]
fn tool_rows_continue() -> &'static str {
    use_model("scripted/x");
    use_tool(echo_tool);
    "T"
}

#[tokio::test]
async fn item_35_a_tool_result_is_stored_with_its_last_good_value_when_a_pre_write_hook_throws() {
    let logs = harness::logs::capture();
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("echo_tool", json!({"text": "kept"})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![tool_rows_continue.into()]);
    runtime.init(&tool_rows_continue, "t").send("go").await.unwrap();
    let ModelMessage::Tool { content, .. } = &model.requests()[1].messages[2] else {
        panic!("a tool result")
    };
    assert_eq!(content, "kept");
    assert_eq!(
        logs.lines("tool rows are read-only"),
        ["[Hooks] ✗ Error running before_create_message hook: tool rows are read-only"]
    );
}

// ---- ThreadState rows (items 26, 27, 83) ------------------------------------------------------

static THREAD_RESULTS: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[hook(before_create_message)]
async fn no_shouting(_state: &ThreadState, message: Message) -> Result<Message, HookError> {
    if message.content.as_deref().is_some_and(|text| text.contains('!')) {
        return Err(HookError::new("no shouting"));
    }
    Ok(message)
}

#[hook(before_update_message)]
async fn no_shouting_updates(
    _state: &ThreadState,
    _id: &str,
    updates: MessageUpdates,
) -> Result<MessageUpdates, HookError> {
    if updates
        .get("content")
        .and_then(Value::as_str)
        .is_some_and(|text| text.contains('!'))
    {
        return Err(HookError::new("no shouting in updates"));
    }
    Ok(updates)
}

/// Work with the thread's rows.
#[tool]
async fn edit_rows(ctx: &ToolContext) -> Result<String, ToolError> {
    let thread = ctx.thread().expect("a thread behind the tool");
    let mut results = THREAD_RESULTS.lock().unwrap().clone();
    // Item 26: a prevented inject rejects with the hook's error; nothing is stored.
    match thread
        .inject_message(InjectMessage::new(MessageRole::User, "hey!"))
        .await
    {
        Err(ThreadError::Hook(error)) => results.push(format!("inject rejected: {error}")),
        other => results.push(format!("inject unexpected: {other:?}")),
    }
    let note = thread
        .inject_message(InjectMessage::new(MessageRole::System, "calm note").silent())
        .await
        .map_err(|error| ToolError::new(error.to_string()))?;
    // Item 27: a prevented update rejects; the row is unchanged.
    let mut loud = MessageUpdates::new();
    loud.insert("content".into(), json!("calm note!"));
    match thread.update_message(&note.id, loud).await {
        Err(ThreadError::Hook(error)) => results.push(format!("update rejected: {error}")),
        other => results.push(format!("update unexpected: {other:?}")),
    }
    let unchanged = thread.get_message(&note.id).await.unwrap().unwrap();
    results.push(format!("row still: {}", unchanged.content.unwrap()));
    let mut quiet = MessageUpdates::new();
    quiet.insert("content".into(), json!("calmer note"));
    let updated = thread.update_message(&note.id, quiet).await.unwrap();
    results.push(format!("updated: {}", updated.content.unwrap()));
    let mut unknown = MessageUpdates::new();
    unknown.insert("role".into(), json!("assistant"));
    results.push(format!(
        "unknown field: {}",
        matches!(
            thread.update_message(&note.id, unknown).await,
            Err(ThreadError::Invalid(_))
        )
    ));
    // Item 83: newest first, with total and has_more; silent rows only when asked for.
    let page = thread
        .get_messages(MessagesQuery {
            limit: Some(1),
            order: MessageOrder::Desc,
            include_silent: true,
            ..MessagesQuery::default()
        })
        .await
        .unwrap();
    results.push(format!(
        "newest: {} total {} more {}",
        page.messages[0].content.clone().unwrap(),
        page.total,
        page.has_more
    ));
    let visible = thread.get_messages(MessagesQuery::default()).await.unwrap();
    results.push(format!("visible: {}", visible.total));
    *THREAD_RESULTS.lock().unwrap() = results;
    Ok("edited".into())
}

#[agent(hooks = [no_shouting, no_shouting_updates])]
fn row_editor() -> &'static str {
    use_model("scripted/x");
    use_tool(edit_rows);
    "E"
}

#[hook(before_create_message)]
async fn makes_it_a_tool_row(_state: &ThreadState, mut message: Message) -> Message {
    if message.content.as_deref() == Some("as a tool row") {
        message.role = MessageRole::Tool;
        message.status = Some(MessageStatus::Pending);
    }
    message
}

static INJECTED: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Injects a row a hook tries to make a tool row.
#[tool]
async fn inject_as_tool(ctx: &ToolContext) -> Result<String, ToolError> {
    let thread = ctx.thread().expect("a thread behind the tool");
    let returned = thread
        .inject_message(InjectMessage::new(MessageRole::User, "as a tool row"))
        .await
        .map_err(|error| ToolError::new(error.to_string()))?;
    let stored = thread.get_message(&returned.id).await.unwrap().unwrap();
    INJECTED.lock().unwrap().extend([
        format!("returned {:?} {:?}", returned.role, returned.status),
        format!("stored {:?} {:?}", stored.role, stored.status),
    ]);
    Ok("injected".into())
}

#[agent(hooks = [makes_it_a_tool_row])]
fn tool_row_injector() -> &'static str {
    use_model("scripted/x");
    use_tool(inject_as_tool);
    "I"
}

#[tokio::test]
async fn an_injected_row_is_returned_as_stored_whatever_a_hook_changed() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("inject_as_tool", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![tool_row_injector.into()]);
    runtime.init(&tool_row_injector, "inj").send("go").await.unwrap();
    assert_eq!(
        *INJECTED.lock().unwrap(),
        ["returned User Some(Completed)", "stored User Some(Completed)"]
    );
}

#[tokio::test]
async fn items_26_27_83_thread_rows_are_injected_updated_and_paged_through_their_hooks() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("edit_rows", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![row_editor.into()]);
    runtime.init(&row_editor, "e").send("start").await.unwrap();
    assert_eq!(
        THREAD_RESULTS.lock().unwrap().clone(),
        [
            "inject rejected: no shouting",
            "update rejected: no shouting in updates",
            "row still: calm note",
            "updated: calmer note",
            "unknown field: true",
            // start, the step with the call, the note (its tool result is not stored yet).
            "newest: calmer note total 3 more true",
            "visible: 2",
        ]
    );
    // The note was injected while the call was open: it follows the call's result, so the
    // next request keeps each call next to its result.
    let messages = &model.requests()[1].messages;
    assert!(matches!(messages[1], ModelMessage::Assistant { .. }));
    assert!(matches!(messages[2], ModelMessage::Tool { .. }));
    assert_eq!(
        messages[3],
        ModelMessage::user("<system-message type=\"system\">\ncalmer note\n</system-message>")
    );
}

// ---- the tool-call chain (items 38–46) --------------------------------------------------------

static TOOL_CHAIN: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Succeeds or fails on demand.
#[tool]
async fn flaky(
    /// Whether to fail
    fail: bool,
) -> Result<String, ToolError> {
    if fail {
        Err(ToolError::new("it broke"))
    } else {
        Ok("contact: jane@example.com".into())
    }
}

/// Panics.
#[tool]
async fn panicky() -> String {
    panic!("tool exploded")
}

#[hook(tool_call_done)]
async fn chain_done(_state: &ThreadState, call: &ToolCall, result: &ToolResult) {
    TOOL_CHAIN
        .lock()
        .unwrap()
        .push(format!("done {} {:?}", call.function.name, result.status));
}

#[hook(after_tool_call_success)]
async fn chain_success(_state: &ThreadState, call: &ToolCall, _result: ToolResult) -> Option<ToolResult> {
    TOOL_CHAIN
        .lock()
        .unwrap()
        .push(format!("success {}", call.function.name));
    None
}

#[hook(after_tool_call_failure)]
async fn chain_failure(_state: &ThreadState, call: &ToolCall, result: ToolResult) -> Option<ToolResult> {
    TOOL_CHAIN.lock().unwrap().push(format!(
        "failure {} {}",
        call.function.name,
        result.error.clone().unwrap_or_default()
    ));
    Some(ToolResult::error(format!(
        "handled: {}",
        result.error.unwrap_or_default()
    )))
}

/// Says its word back after a moment.
#[tool]
async fn slow_echo(word: String) -> String {
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    word
}

/// Counts the successful calls in a thread value: reads it, takes a moment, writes it back.
#[hook(after_tool_call_success)]
async fn count_successes(state: &ThreadState, _call: &ToolCall, _result: ToolResult) -> Option<ToolResult> {
    let count = state
        .get_value("successes")
        .await
        .unwrap()
        .and_then(|value| value.as_u64())
        .unwrap_or(0);
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    state.set_value("successes", Some(json!(count + 1))).await.unwrap();
    COUNTED.lock().unwrap().push(count + 1);
    None
}

/// What `count_successes` wrote, in order.
static COUNTED: Mutex<Vec<u64>> = Mutex::new(Vec::new());

#[agent(hooks = [count_successes])]
fn success_counter() -> &'static str {
    use_model("scripted/x");
    use_tool(slow_echo);
    "C"
}

/// The calls of one step run concurrently, their tool-result hooks one call at a time (as the
/// reference runs a step's calls in order): a hook that reads a thread value and writes it
/// back loses no other call's update.
#[tokio::test]
async fn the_tool_result_hooks_of_parallel_calls_run_one_call_at_a_time() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([
            ("slow_echo", json!({"word": "one"})),
            ("slow_echo", json!({"word": "two"})),
            ("slow_echo", json!({"word": "three"})),
        ]),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![success_counter.into()]);
    let handle = runtime.init(&success_counter, "c");
    assert_eq!(handle.send("go").await.unwrap().text, "done");
    assert_eq!(*COUNTED.lock().unwrap(), [1, 2, 3]);
}

/// Hands the conversation over (ends the turn when it succeeds).
#[tool(terminate)]
async fn hand_over() -> String {
    "handed over".into()
}

/// Refuses every hand-over, by policy.
#[hook(after_tool_call_success)]
async fn refuse_hand_over(_state: &ThreadState, call: &ToolCall, _result: ToolResult) -> Option<ToolResult> {
    (call.function.name == "hand_over").then(|| ToolResult::error("hand-over refused by policy"))
}

#[agent(hooks = [refuse_hand_over])]
fn handing_over() -> &'static str {
    use_model("scripted/x");
    use_tool(hand_over);
    "H"
}

/// A `terminate` tool's result that a tool hook turned into an error does not end the turn:
/// the model reads the error and answers (the error was stored as the call's result, and the
/// response counted as answered without the model seeing it).
#[tokio::test]
async fn a_terminate_tools_result_a_hook_made_an_error_does_not_end_the_turn() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("hand_over", json!({})),
        ScriptedReply::text("I could not hand you over."),
    ]);
    let runtime = runtime_with(&model, vec![handing_over.into()]);
    let reply = runtime.init(&handing_over, "h").send("a person, please").await.unwrap();
    assert_eq!(reply.text, "I could not hand you over.");
    let requests = model.requests();
    assert_eq!(requests.len(), 2);
    let ModelMessage::Tool { content, is_error, .. } = &requests[1].messages[2] else {
        panic!("a tool result")
    };
    assert_eq!((content.as_str(), *is_error), ("hand-over refused by policy", true));
}

#[hook(before_store_tool_result)]
async fn chain_redact(_state: &ThreadState, _call: &ToolCall, result: ToolResult) -> ToolResult {
    TOOL_CHAIN.lock().unwrap().push(format!("store {:?}", result.status));
    ToolResult {
        result: result
            .result
            .map(|text| text.replace("jane@example.com", "[email redacted]")),
        ..result
    }
}

#[hook(before_create_message)]
async fn chain_create(_state: &ThreadState, message: Message) -> Message {
    if message.role == MessageRole::Tool {
        TOOL_CHAIN
            .lock()
            .unwrap()
            .push(format!("create {:?}", message.tool_status));
    }
    message
}

#[agent(hooks = [chain_done, chain_success, chain_failure, chain_redact, chain_create])]
fn tool_chain() -> &'static str {
    use_model("scripted/x");
    use_tool(flaky);
    use_tool(panicky);
    "T"
}

#[hook(before_store_tool_result)]
async fn redact_emails(_state: &ThreadState, _call: &ToolCall, result: ToolResult) -> ToolResult {
    ToolResult {
        result: result
            .result
            .map(|text| text.replace("jane@example.com", "[email redacted]")),
        ..result
    }
}

#[agent(hooks = [redact_emails])]
fn redacting() -> &'static str {
    use_model("scripted/x");
    use_tool(flaky);
    "R"
}

#[tokio::test]
async fn observers_see_the_tool_result_as_stored_after_before_store_tool_result() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("flaky", json!({"fail": false})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![redacting.into()]);
    let mut events = runtime.observe();
    runtime.init(&redacting, "r").send("go").await.unwrap();
    let mut tool_messages = Vec::new();
    while let Ok(observation) = events.try_recv() {
        let json = serde_json::to_string(&observation).unwrap();
        assert!(
            !json.contains("jane@example.com"),
            "an event showed the unredacted result: {json}"
        );
        if let flue_runtime::events::Event::MessageEnd {
            message: ModelMessage::Tool { content, .. },
        } = observation.event
        {
            tool_messages.push(content);
        }
    }
    assert_eq!(tool_messages, ["contact: [email redacted]"]);
}

/// Answers a contact as a value.
#[tool]
async fn contact_card() -> serde_json::Value {
    json!({"contact": "jane@example.com"})
}

#[agent(hooks = [redact_emails])]
fn redacting_values() -> &'static str {
    use_model("scripted/x");
    use_tool(contact_card);
    "R"
}

/// A tool that answered a value keeps it for clients only while the stored text is what it
/// answered: a result hook's redaction leaves the redacted text alone, and no value beside it.
#[tokio::test]
async fn a_value_a_result_hook_redacted_is_not_kept_beside_the_redacted_text() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("contact_card", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![redacting_values.into()]);
    runtime.init(&redacting_values, "v").send("go").await.unwrap();
    let outcome = bodies(&runtime, "redacting_values", "v")
        .await
        .into_iter()
        .find_map(|body| match body {
            RecordBody::ToolOutcome { content, output, .. } => Some((content, output)),
            _ => None,
        })
        .unwrap();
    assert_eq!(outcome, ("{\n  \"contact\": \"[email redacted]\"\n}".to_owned(), None));
}

static DEEP_RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Answers a value nested 520 levels deep (built in code: no parse allows it).
#[tool]
async fn deep_value() -> serde_json::Value {
    DEEP_RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    (0..520).fold(json!(1), |inner, _| json!([inner]))
}

#[agent]
fn deep_answers() -> &'static str {
    use_model("scripted/x");
    use_tool(deep_value);
    "D"
}

/// A value too deep for a store to keep in its record is kept as the text the model reads
/// only: the outcome stores (a record too deep would fail its append, and the call would end
/// outcome-unknown).
#[tokio::test]
async fn a_value_too_deep_to_store_beside_its_text_is_kept_as_text() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("deep_value", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![deep_answers.into()]);
    let reply = runtime.init(&deep_answers, "d").send("go").await.unwrap();
    assert_eq!(reply.text, "done");
    assert_eq!(DEEP_RUNS.load(std::sync::atomic::Ordering::SeqCst), 1);
    // Its outcome stored as it ran (not a failed append's outcome-unknown result).
    let outcomes: Vec<(bool, bool, bool)> = bodies(&runtime, "deep_answers", "d")
        .await
        .into_iter()
        .filter_map(|body| match body {
            RecordBody::ToolOutcome {
                is_error,
                content,
                output,
                ..
            } => Some((is_error, content.starts_with("[\n  [\n    ["), output.is_some())),
            _ => None,
        })
        .collect();
    assert_eq!(outcomes, [(false, true, false)]);
}

#[hook(before_create_message)]
async fn review_tool_rows(_state: &ThreadState, mut message: Message) -> Message {
    if message.role == MessageRole::Tool {
        message.metadata.insert("reviewed".into(), json!(true));
    }
    message
}

static REVIEWED_ROWS: Mutex<Vec<(&'static str, Option<serde_json::Value>)>> = Mutex::new(Vec::new());

/// Notes what a created tool row says it is.
#[hook(after_create_message)]
async fn note_created_tool_rows(_state: &ThreadState, message: &Message) {
    if message.role == MessageRole::Tool {
        REVIEWED_ROWS
            .lock()
            .unwrap()
            .push(("created", message.metadata.get("reviewed").cloned()));
    }
}

/// Notes what the tool rows the model is shown say they are.
#[hook(filter_messages)]
async fn note_shown_tool_rows(_state: &ThreadState, messages: Vec<Message>) -> Vec<Message> {
    REVIEWED_ROWS.lock().unwrap().extend(
        messages
            .iter()
            .filter(|row| row.role == MessageRole::Tool)
            .map(|row| ("shown", row.metadata.get("reviewed").cloned())),
    );
    messages
}

#[agent(hooks = [review_tool_rows, note_created_tool_rows, note_shown_tool_rows])]
fn reviewing() -> &'static str {
    use_model("scripted/x");
    use_tool(flaky);
    "R"
}

#[tokio::test]
async fn what_a_tool_rows_create_hook_changes_commits_with_the_tool_batch() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("flaky", json!({"fail": false})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![reviewing.into()]);
    runtime.init(&reviewing, "r").send("go").await.unwrap();
    let batches = runtime
        .store()
        .read(&InstanceKey::new("reviewing", "r"), None)
        .await
        .unwrap();
    let batch = batches
        .iter()
        .find(|batch| {
            batch
                .records
                .iter()
                .any(|record| matches!(record.body, RecordBody::ToolResultsCommitted { .. }))
        })
        .expect("the tool batch");
    let kinds: Vec<&str> = batch
        .records
        .iter()
        .map(|record| match &record.body {
            RecordBody::ToolOutcome { .. } => "outcome",
            RecordBody::MessageUpdated { updates, .. } => {
                assert_eq!(updates["metadata"]["reviewed"], json!(true), "{updates:?}");
                "updated"
            }
            RecordBody::ToolResultsCommitted { .. } => "committed",
            _ => "other",
        })
        .collect();
    assert_eq!(kinds, ["outcome", "updated", "committed"]);
    // The row is what its create hook made it, to its `after_create_message` and every reader.
    assert_eq!(
        REVIEWED_ROWS.lock().unwrap().clone(),
        [("created", Some(json!(true))), ("shown", Some(json!(true)))]
    );
}

#[tokio::test]
async fn items_38_39_40_42_43_44_45_each_call_runs_done_then_after_then_store_then_create() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([
            ("flaky", json!({"fail": false})),
            ("flaky", json!({"fail": true})),
            ("panicky", json!({})),
        ]),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![tool_chain.into()]);
    runtime.init(&tool_chain, "t").send("go").await.unwrap();
    assert_eq!(
        TOOL_CHAIN.lock().unwrap().clone(),
        [
            "done flaky Success",
            "success flaky",
            "store Success",
            "create Some(Success)",
            "done flaky Error",
            "failure flaky it broke",
            "store Error",
            "create Some(Error)",
            "done panicky Error",
            "failure panicky Tool \"panicky\" panicked: tool exploded",
            "store Error",
            "create Some(Error)",
        ]
    );
    let results: Vec<(String, bool)> = model.requests()[1]
        .messages
        .iter()
        .filter_map(|message| match message {
            ModelMessage::Tool { content, is_error, .. } => Some((content.clone(), *is_error)),
            _ => None,
        })
        .collect();
    assert_eq!(
        results,
        [
            ("contact: [email redacted]".to_owned(), false),
            ("handled: it broke".to_owned(), true),
            ("handled: Tool \"panicky\" panicked: tool exploded".to_owned(), true),
        ]
    );
}

// ---- tool_call_started (items 47, 48, 51) -----------------------------------------------------

static STARTED: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[hook(tool_call_started)]
async fn record_started(state: &ThreadState, call: &ToolCall, progress: Option<&str>) {
    let ran = state.context().get("ran").is_some();
    STARTED
        .lock()
        .unwrap()
        .push(format!("{} {} {progress:?} ran={ran}", call.id, call.function.name));
}

/// Note that it ran.
#[tool]
async fn marks_context(ctx: &ToolContext) -> String {
    ctx.thread().unwrap().context().set("ran", json!(true));
    "ran".into()
}

#[agent(hooks = [record_started])]
fn observed() -> &'static str {
    use_model("scripted/x");
    use_tool(marks_context);
    "O"
}

#[tokio::test]
async fn items_47_48_51_tool_call_started_fires_once_per_parallel_call_before_any_tool_runs() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([("marks_context", json!({})), ("marks_context", json!({}))]),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![observed.into()]);
    runtime.init(&observed, "o").send("go").await.unwrap();
    let started = STARTED.lock().unwrap().clone();
    assert_eq!(started.len(), 2, "{started:?}");
    assert!(
        started
            .iter()
            .all(|line| line.ends_with("marks_context None ran=false")),
        "{started:?}"
    );
    assert_ne!(started[0], started[1], "one per call id");
}

static SLOW_STARTED: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[hook(tool_call_started)]
async fn slow_started(state: &ThreadState, call: &ToolCall, _progress: Option<&str>) {
    tokio::time::sleep(std::time::Duration::from_secs(40)).await;
    // The response is over: the thread state refuses writes now.
    let write = state.set_value("late", Some(json!(true))).await;
    SLOW_STARTED.lock().unwrap().push(format!(
        "finished for {}, write refused: {}",
        call.function.name,
        matches!(write, Err(ThreadError::Unavailable(_)))
    ));
}

#[agent(hooks = [slow_started])]
fn slow_observer() -> &'static str {
    use_model("scripted/x");
    use_tool(marks_context);
    "O"
}

/// Standard Agents §1.3: each `tool_call_started` await is bounded to 30 s; on timeout the
/// hook is left running and the stream goes on (it is not cancelled).
#[tokio::test(start_paused = true)]
async fn a_tool_call_started_hook_past_30_s_is_left_running_while_the_response_goes_on() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("marks_context", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![slow_observer.into()]);
    let started = tokio::time::Instant::now();
    let reply = runtime.init(&slow_observer, "slow").send("go").await.unwrap();
    assert_eq!(reply.text, "done");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(40),
        "the response did not wait for the hook"
    );
    assert!(SLOW_STARTED.lock().unwrap().is_empty());
    tokio::time::sleep(std::time::Duration::from_secs(20)).await;
    assert_eq!(
        *SLOW_STARTED.lock().unwrap(),
        ["finished for marks_context, write refused: true"]
    );
}

/// Waits longer than its budget on every call.
#[hook(tool_call_started)]
async fn stalled_started(_state: &ThreadState, _call: &ToolCall, _progress: Option<&str>) {
    tokio::time::sleep(std::time::Duration::from_secs(40)).await;
}

#[agent(hooks = [stalled_started])]
fn stalled_observer() -> &'static str {
    use_model("scripted/x");
    use_tool(marks_context);
    "O"
}

/// An abort is not held up by `tool_call_started` hooks: the wait for them ends with it, and
/// the response settles aborted (the hooks go on running). (Regression: each call's hooks
/// were waited for their whole 30 s budget, one call after another, past the abort.)
#[tokio::test(start_paused = true)]
async fn an_abort_ends_the_wait_for_tool_call_started_hooks() {
    let model = ScriptedModel::new([ScriptedReply::tool_calls([
        ("marks_context", json!({})),
        ("marks_context", json!({})),
    ])]);
    let runtime = runtime_with(&model, vec![stalled_observer.into()]);
    let handle = runtime.init(&stalled_observer, "stalled");
    let receipt = handle.dispatch("go").await.unwrap();
    let started = tokio::time::Instant::now();
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    assert!(handle.abort().await.unwrap());
    let error = handle.read(&receipt.submission_id).await.unwrap_err();
    assert!(format!("{error:?}").contains("submission_aborted"), "{error:?}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(30),
        "the abort waited for the hooks: {:?}",
        started.elapsed()
    );
}

static LATE_CREATES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static LATE_INJECTED: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Counts the create hooks run for the late row.
#[hook(before_create_message)]
async fn count_late_creates(_state: &ThreadState, message: Message) -> Message {
    if message.content.as_deref() == Some("late") {
        LATE_CREATES.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
    message
}

/// Injects a row once its response is long over.
#[hook(tool_call_started)]
async fn inject_late(state: &ThreadState, _call: &ToolCall, _progress: Option<&str>) {
    tokio::time::sleep(std::time::Duration::from_secs(40)).await;
    let injected = state
        .inject_message(InjectMessage::new(MessageRole::User, "late"))
        .await;
    LATE_INJECTED.lock().unwrap().push(format!(
        "refused: {}",
        matches!(injected, Err(ThreadError::Unavailable(_)))
    ));
}

#[agent(hooks = [count_late_creates, inject_late])]
fn late_writer() -> &'static str {
    use_model("scripted/x");
    use_tool(marks_context);
    "L"
}

/// A thread state used after its response ended refuses a row before the row's hooks run
/// (they would run for a write that is refused).
#[tokio::test(start_paused = true)]
async fn a_row_written_after_the_response_ended_is_refused_before_its_hooks_run() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("marks_context", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![late_writer.into()]);
    runtime.init(&late_writer, "late").send("go").await.unwrap();
    tokio::time::sleep(std::time::Duration::from_secs(20)).await;
    assert_eq!(*LATE_INJECTED.lock().unwrap(), ["refused: true"]);
    assert_eq!(LATE_CREATES.load(std::sync::atomic::Ordering::SeqCst), 0);
}

// ---- after_thread_created, execution, context, values (items 55, 77, 78, 79, 82) ---------------

static CREATED: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[hook(after_thread_created)]
async fn welcome(state: &ThreadState) -> Result<(), HookError> {
    CREATED.lock().unwrap().push(format!(
        "{} {} execution={}",
        state.thread_id(),
        state.agent_id(),
        state.execution().is_some()
    ));
    state
        .set_value("welcomed", Some(json!(true)))
        .await
        .map_err(|error| HookError::new(error.to_string()))
}

static EXECUTIONS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Reads and writes the thread's values and context.
#[tool]
async fn bookkeeping(ctx: &ToolContext) -> Result<String, ToolError> {
    let thread = ctx.thread().unwrap();
    let execution = thread.execution().expect("item 77: an execution inside a tool");
    let seen = thread.context().get("seen");
    thread.context().set("seen", json!("by the tool"));
    let visits = thread
        .get_value("visits")
        .await
        .unwrap()
        .and_then(|value| value.as_u64())
        .unwrap_or(0);
    thread.set_value("visits", Some(json!(visits + 1))).await.unwrap();
    thread.set_value("scratch", None).await.unwrap();
    let echoed = thread
        .invoke_tool("echo_tool", json!({"text": "invoked"}))
        .await
        .unwrap();
    let welcomed = thread.get_value("welcomed").await.unwrap();
    let line = format!(
        "steps={} aborted={} seen={seen:?} visits={visits} welcomed={welcomed:?} invoked={:?}/{:?}",
        execution.step_count(),
        execution.abort_signal().is_aborted(),
        echoed.status,
        echoed.result,
    );
    EXECUTIONS.lock().unwrap().push(line);
    Ok("booked".into())
}

#[hook(tool_call_done)]
async fn context_reader(state: &ThreadState, _call: &ToolCall, _result: &ToolResult) {
    let seen = state.context().get("seen");
    EXECUTIONS.lock().unwrap().push(format!("hook saw {seen:?}"));
}

#[agent(hooks = [welcome, context_reader])]
fn bookkeeper() -> &'static str {
    use_model("scripted/x");
    use_tool(bookkeeping);
    use_tool(echo_tool);
    "B"
}

#[tokio::test]
async fn items_55_77_78_79_82_thread_state_across_executions_and_a_restart() {
    let db = scratch_db("values");
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("bookkeeping", json!({})),
        ScriptedReply::text("one"),
        ScriptedReply::tool_call("bookkeeping", json!({})),
        ScriptedReply::text("two"),
    ]);
    {
        let runtime = runtime_on(SqliteStore::open(&db).unwrap(), &model, vec![bookkeeper.into()]);
        runtime.init(&bookkeeper, "k").send("first").await.unwrap();
        runtime.shutdown();
    }
    // A restart on the same store: values survive, the context does not.
    let runtime = runtime_on(SqliteStore::open(&db).unwrap(), &model, vec![bookkeeper.into()]);
    runtime.init(&bookkeeper, "k").send("second").await.unwrap();
    assert_eq!(
        CREATED.lock().unwrap().clone(),
        ["k bookkeeper execution=false"],
        "item 55: once"
    );
    assert_eq!(
        EXECUTIONS.lock().unwrap().clone(),
        [
            "steps=1 aborted=false seen=None visits=0 welcomed=Some(Bool(true)) invoked=Success/Some(\"invoked\")",
            "hook saw Some(String(\"by the tool\"))",
            "steps=1 aborted=false seen=None visits=1 welcomed=Some(Bool(true)) invoked=Success/Some(\"invoked\")",
            "hook saw Some(String(\"by the tool\"))",
        ]
    );
    // Item 82: invoke_tool stored no tool row (only the two model calls' results are stored).
    let stored = bodies(&runtime, "bookkeeper", "k").await;
    let outcomes = stored
        .iter()
        .filter(|body| matches!(body, RecordBody::ToolOutcome { .. }))
        .count();
    assert_eq!(outcomes, 2);
}

/// Logs, then echoes.
#[tool]
async fn chatty_echo(
    ctx: &ToolContext,
    /// Text
    text: String,
) -> String {
    ctx.log().info("echoing");
    text
}

/// Runs `chatty_echo` through the thread state.
#[tool]
async fn relay_echo(ctx: &ToolContext) -> Result<String, ToolError> {
    let thread = ctx.thread().unwrap();
    let echoed = thread.invoke_tool("chatty_echo", json!({"text": "hi"})).await.unwrap();
    Ok(format!("{:?}", echoed.result))
}

#[agent]
fn relayer() -> &'static str {
    use_model("scripted/x");
    use_tool(relay_echo);
    use_tool(chatty_echo);
    "R"
}

/// A tool run by `invoke_tool` has its log lines published as a model's call's are, stamped
/// with the tool and the invocation's id.
#[tokio::test]
async fn a_tool_run_by_invoke_tool_has_its_log_lines_published() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("relay_echo", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![relayer.into()]);
    let mut events = runtime.observe();
    runtime.init(&relayer, "r").send("go").await.unwrap();
    let mut lines = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let flue_runtime::events::Event::Log {
            message, attributes, ..
        } = observation.event
        {
            lines.push((message, serde_json::to_value(attributes).unwrap()));
        }
    }
    let [(message, attributes)] = &lines[..] else {
        panic!("one line: {lines:?}")
    };
    assert_eq!(message, "echoing");
    assert_eq!(attributes["tool"], "chatty_echo");
    assert!(
        attributes["toolCallId"]
            .as_str()
            .is_some_and(|id| id.starts_with("invoke_")),
        "{attributes}"
    );
}

// ---- emit (item 54) ---------------------------------------------------------------------------

/// Reports progress to connected clients.
#[tool]
async fn report(ctx: &ToolContext) -> String {
    ctx.thread().unwrap().emit("progress", json!({"percent": 50}));
    "reported".into()
}

#[agent]
fn reporter() -> &'static str {
    use_model("scripted/x");
    use_tool(report);
    "R"
}

#[tokio::test]
async fn item_54_emit_reaches_the_thread_event_channel_without_any_hook() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("report", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![reporter.into()]);
    let mut events = runtime.observe();
    runtime.init(&reporter, "r").send("go").await.unwrap();
    let mut emitted = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let flue_runtime::events::Event::ThreadEvent { event_type, data } = observation.event {
            emitted.push((event_type, data));
        }
    }
    assert_eq!(emitted, [("progress".to_owned(), json!({"percent": 50}))]);
}

// ---- required parent hooks (items 60, 63, 65, 70) ---------------------------------------------

static PARENT_HOOKS: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[hook(after_system_message)]
async fn child_before(state: &ThreadState, system: String) -> Option<String> {
    PARENT_HOOKS
        .lock()
        .unwrap()
        .push(format!("child_before on {}", state.thread_id()));
    Some(format!("{system} <before>"))
}

#[hook(after_system_message)]
async fn child_after(state: &ThreadState, system: String) -> Option<String> {
    PARENT_HOOKS
        .lock()
        .unwrap()
        .push(format!("child_after on {}", state.thread_id()));
    Some(format!("{system} <after>"))
}

#[hook(after_system_message)]
async fn parent_own(_state: &ThreadState, system: String) -> Option<String> {
    Some(format!("{system} <parent>"))
}

#[agent(expose_as_tool, description = "Syncs mail.",
        // Item 59: without a stage, a required hook runs after the parent's own.
        parent_hooks = [(child_after, "Shows what the child did last."),
                        (child_before, before_parent, "Shows synchronized mail first.")])]
fn mail_child() -> &'static str {
    "You sync mail."
}

#[agent(hooks = [parent_own])]
fn parent_agent() -> &'static str {
    use_model("scripted/x");
    use_subagent(Subagent::new("mail", "Syncs mail.", mail_child).hidden());
    "P"
}

/// A delegate whose own delegate requires parent hooks: the delegate is that parent, and a
/// task's session runs no hooks.
fn mail_desk(_: AgentProps<'_>) -> &'static str {
    use_subagent(Subagent::new("mail", "Syncs mail.", mail_child));
    "You handle the mail desk."
}

#[agent]
fn front_office() -> &'static str {
    use_model("scripted/x");
    use_subagent(Subagent::new(
        "desk",
        "Handles the mail desk.",
        FnAgent::new(AgentDefinition::new("mail_desk"), mail_desk),
    ));
    "Delegate the mail."
}

/// Items 69 + §4.1.4: a requirement binds the direct parent, and the parent never runs with
/// part of its required set. A task's child is that parent for its own delegates but runs no
/// hooks, so the task is refused (before its child exists) instead of running without them.
#[tokio::test]
async fn a_task_whose_delegate_offers_a_child_requiring_parent_hooks_is_refused() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("task", json!({"agent": "desk", "prompt": "Sync the mail."})),
        ScriptedReply::text("The desk cannot run."),
    ]);
    let runtime = runtime_with(&model, vec![front_office.into()]);
    let reply = runtime.init(&front_office, "office-1").send("Mail?").await.unwrap();
    assert_eq!(reply.text, "The desk cannot run.");
    let requests = model.requests();
    assert_eq!(requests.len(), 2, "the desk's model was never called");
    let (content, is_error) = requests[1]
        .messages
        .iter()
        .find_map(|message| match message {
            ModelMessage::Tool { content, is_error, .. } => Some((content.clone(), *is_error)),
            _ => None,
        })
        .unwrap();
    assert!(is_error);
    assert_eq!(
        content,
        "The \"desk\" agent cannot run as a task: it delegates to \"mail\", whose agent requires hooks of \
         its parent (child_after, child_before), and a task's session runs no lifecycle hooks."
    );
}

#[tokio::test]
async fn items_60_63_65_70_required_child_hooks_surround_the_parent_hooks_on_the_parent_thread() {
    let model = ScriptedModel::new([ScriptedReply::text("ok")]);
    let runtime = runtime_with(&model, vec![parent_agent.into()]);
    runtime.init(&parent_agent, "parent-1").send("hi").await.unwrap();
    let system = model.requests()[0].system.clone().unwrap();
    assert!(system.ends_with(" <before> <parent> <after>"), "{system}");
    assert_eq!(
        PARENT_HOOKS.lock().unwrap().clone(),
        ["child_before on parent-1", "child_after on parent-1"]
    );
}

// ---- stop (ExecutionState::stop) ---------------------------------------------------------------

/// Ends the execution after this step.
#[tool]
async fn halt(ctx: &ToolContext) -> String {
    ctx.thread().unwrap().execution().unwrap().stop();
    "halting".into()
}

#[agent]
fn haltable() -> &'static str {
    use_model("scripted/x");
    use_tool(halt);
    "H"
}

#[tokio::test]
async fn execution_stop_ends_the_response_without_another_model_call() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("halt", json!({})),
        ScriptedReply::text("never"),
    ]);
    let runtime = runtime_with(&model, vec![haltable.into()]);
    runtime.init(&haltable, "h").send("go").await.unwrap();
    assert_eq!(model.requests().len(), 1);
}

/// Ends the execution, and the turn (a batch of only terminating tools ends it).
#[tool(terminate)]
async fn halt_here(ctx: &ToolContext) -> String {
    ctx.thread().unwrap().execution().unwrap().stop();
    "handed over".into()
}

#[agent]
fn halting_checked() -> &'static str {
    use_model("scripted/x");
    use_tool(halt_here);
    use_agent_finish(|ctx| async move {
        ctx.append(Signal::new("todo", "Check once more."))?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    });
    "H"
}

/// `stop()` ends the response with what it has: a finish callback's append at its would-stop
/// point, which no model call could answer, is not stored, and the response completes (it
/// does not fail as an append at a spent `max_steps` does).
#[tokio::test]
async fn a_finish_append_after_a_stop_is_not_stored_and_the_response_completes() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("halt_here", json!({})),
        ScriptedReply::text("never"),
    ]);
    let runtime = runtime_with(&model, vec![halting_checked.into()]);
    runtime.init(&halting_checked, "h").send("go").await.unwrap();
    assert_eq!(model.requests().len(), 1);
    let stored = bodies(&runtime, "halting_checked", "h").await;
    assert!(
        !stored
            .iter()
            .any(|body| matches!(body, RecordBody::Signal { .. } | RecordBody::AgentFinishCycle)),
        "{stored:?}"
    );
}

static HALT_FINISHES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[agent]
fn haltable_checked() -> &'static str {
    use_model("scripted/x");
    use_tool(halt);
    use_agent_finish(|_ctx| async move {
        HALT_FINISHES.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    });
    "H"
}

/// A `stop()` from a tool that does not terminate ends the turns as a terminating one does:
/// the would-stop point follows, finish callbacks included.
#[tokio::test]
async fn the_finish_callbacks_run_after_a_stop_from_a_tool_that_does_not_terminate() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("halt", json!({})),
        ScriptedReply::text("never"),
    ]);
    let runtime = runtime_with(&model, vec![haltable_checked.into()]);
    runtime.init(&haltable_checked, "h").send("go").await.unwrap();
    assert_eq!(model.requests().len(), 1);
    assert_eq!(HALT_FINISHES.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[hook(before_create_message)]
async fn refuse_forbidden(_state: &ThreadState, message: Message) -> Result<Message, HookError> {
    if message.content.as_deref() == Some("forbidden") {
        return Err(HookError::new("not allowed here"));
    }
    Ok(message)
}

#[agent(hooks = [refuse_forbidden])]
fn guarded() -> &'static str {
    use_model("scripted/x");
    "G"
}

/// Item 29: a user message a pre-write hook refused is not stored, its images included (they
/// would be served to anyone reading the instance); an accepted message's are.
#[tokio::test]
async fn item_29_a_refused_message_leaves_none_of_its_images_stored() {
    use flue_runtime::message::{Attachment, DeliveredMessage, UserMessage};
    let model = ScriptedModel::new([ScriptedReply::text("ok")]);
    let store = MemoryStore::new();
    let runtime = runtime_on(store.clone(), &model, vec![guarded.into()]);
    let handle = runtime.init(&guarded, "g");
    let with_image = |body: &str| {
        DeliveredMessage::User(UserMessage {
            body: body.into(),
            attachments: vec![Attachment::Image {
                data: "iVBORw0KGgo=".into(),
                mime_type: "image/png".into(),
                filename: None,
            }],
        })
    };
    let key = InstanceKey::new("guarded", "g");
    let refused = handle.dispatch(with_image("forbidden")).await.unwrap();
    let error = handle.read(&refused.submission_id).await.unwrap_err();
    assert_eq!(run_error(error).0, "message_hook_error");
    let image = format!("att_{}_0", refused.submission_id);
    assert!(
        flue_runtime::store::Store::attachment(&store, &key, &image)
            .await
            .unwrap()
            .is_none(),
        "the refused message's image is not stored"
    );
    let accepted = handle.dispatch(with_image("fine")).await.unwrap();
    handle.read(&accepted.submission_id).await.unwrap();
    let image = format!("att_{}_0", accepted.submission_id);
    assert!(
        flue_runtime::store::Store::attachment(&store, &key, &image)
            .await
            .unwrap()
            .is_some()
    );
}

/// Refuses a user message of more than one image.
#[hook(before_create_message)]
async fn one_image_at_most(_state: &ThreadState, message: Message) -> Result<Message, HookError> {
    if message.attachments.len() > 1 {
        return Err(HookError::new("one picture at a time"));
    }
    Ok(message)
}

static IMAGES_SEEN: Mutex<Vec<Vec<flue_runtime::lifecycle::MessageAttachment>>> = Mutex::new(Vec::new());

/// Notes the images of the user rows the model is shown.
#[hook(filter_messages)]
async fn note_images(_state: &ThreadState, messages: Vec<Message>) -> Vec<Message> {
    IMAGES_SEEN.lock().unwrap().extend(
        messages
            .iter()
            .filter(|row| row.role == MessageRole::User)
            .map(|row| row.attachments.clone()),
    );
    messages
}

#[agent(hooks = [one_image_at_most, note_images])]
fn picture_taker() -> &'static str {
    use_model("scripted/x");
    "P"
}

/// A user row names its images (id, type, size, file name) to the hooks that create it and
/// to every later reader of the rows, as the reference's `attachments` field.
#[tokio::test]
async fn a_user_row_names_its_images_to_its_create_hooks_and_its_readers() {
    use flue_runtime::lifecycle::MessageAttachment;
    use flue_runtime::message::{Attachment, DeliveredMessage, UserMessage};
    let model = ScriptedModel::new([ScriptedReply::text("a dot")]);
    let runtime = runtime_with(&model, vec![picture_taker.into()]);
    let handle = runtime.init(&picture_taker, "p");
    let png = |filename: Option<&str>| Attachment::Image {
        data: "iVBORw0KGgoA".into(),
        mime_type: "image/png".into(),
        filename: filename.map(Into::into),
    };
    let two = DeliveredMessage::User(UserMessage {
        body: "two".into(),
        attachments: vec![png(None), png(None)],
    });
    assert_eq!(run_error(handle.send(two).await.unwrap_err()).0, "message_hook_error");
    let one = DeliveredMessage::User(UserMessage {
        body: "one".into(),
        attachments: vec![png(Some("dot.png"))],
    });
    let reply = handle.send(one).await.unwrap();
    assert_eq!(
        IMAGES_SEEN.lock().unwrap().clone(),
        [vec![MessageAttachment {
            id: format!("att_{}_0", reply.submission_id),
            mime_type: "image/png".into(),
            size: 9,
            name: Some("dot.png".into()),
        }]]
    );
}

/// Keeps the images of the newest user row only (older images cost tokens every call).
#[hook(filter_messages)]
async fn newest_images_only(_state: &ThreadState, mut messages: Vec<Message>) -> Vec<Message> {
    let newest = messages.iter().rposition(|row| row.role == MessageRole::User);
    for (at, row) in messages.iter_mut().enumerate() {
        if Some(at) != newest {
            row.attachments.clear();
        }
    }
    messages
}

#[agent(hooks = [newest_images_only])]
fn thrifty_viewer() -> &'static str {
    use_model("scripted/x");
    "V"
}

/// A `filter_messages` hook that leaves a row's attachments out sends the row without those
/// images (nor their ids in its text): the rows it returns are what the model reads.
#[tokio::test]
async fn attachments_a_message_filter_leaves_out_are_not_sent() {
    use flue_runtime::message::{Attachment, DeliveredMessage, UserMessage};
    let model = ScriptedModel::new([ScriptedReply::text("a dot"), ScriptedReply::text("another")]);
    let runtime = runtime_with(&model, vec![thrifty_viewer.into()]);
    let handle = runtime.init(&thrifty_viewer, "v");
    let picture = |body: &str| {
        DeliveredMessage::User(UserMessage {
            body: body.into(),
            attachments: vec![Attachment::Image {
                data: "iVBORw0KGgoA".into(),
                mime_type: "image/png".into(),
                filename: None,
            }],
        })
    };
    handle.send(picture("first")).await.unwrap();
    handle.send(picture("second")).await.unwrap();
    let sent = &model.requests()[1].messages;
    let users: Vec<(usize, bool)> = sent
        .iter()
        .filter_map(|message| match message {
            ModelMessage::User { content, images } => Some((images.len(), content.contains("<attachments>"))),
            _ => None,
        })
        .collect();
    assert_eq!(users, [(0, false), (1, true)]);
}

/// Strips every image from user rows (a policy against uploads).
#[hook(before_create_message)]
async fn strip_uploads(_state: &ThreadState, mut message: Message) -> Message {
    message.attachments.clear();
    message
}

#[agent(hooks = [strip_uploads])]
fn upload_refuser() -> &'static str {
    use_model("scripted/x");
    "U"
}

/// An image a `before_create_message` hook left out of the input row is not stored, served or
/// sent: the row the hook returns is what is stored.
#[tokio::test]
async fn an_image_a_create_hook_leaves_out_is_not_stored() {
    use flue_runtime::message::{Attachment, DeliveredMessage, UserMessage};
    let model = ScriptedModel::new([ScriptedReply::text("no picture")]);
    let runtime = runtime_with(&model, vec![upload_refuser.into()]);
    let handle = runtime.init(&upload_refuser, "u");
    let reply = handle
        .send(DeliveredMessage::User(UserMessage {
            body: "look".into(),
            attachments: vec![Attachment::Image {
                data: "iVBORw0KGgoA".into(),
                mime_type: "image/png".into(),
                filename: None,
            }],
        }))
        .await
        .unwrap();
    let ModelMessage::User { images, content } = &model.requests()[0].messages[0] else {
        panic!("the user message")
    };
    assert_eq!((images.len(), content.as_str()), (0, "look"));
    let stored = bodies(&runtime, "upload_refuser", "u").await;
    assert!(
        stored
            .iter()
            .any(|body| matches!(body, RecordBody::UserMessage { attachments, .. } if attachments.is_empty()))
    );
    let key = InstanceKey::new("upload_refuser", "u");
    let id = format!("att_{}_0", reply.submission_id);
    assert_eq!(runtime.store().attachment(&key, &id).await.unwrap(), None);
}

/// Tags assistant rows as they are created.
#[hook(before_create_message)]
async fn tag_assistant_rows(_state: &ThreadState, mut message: Message) -> Message {
    if message.role == MessageRole::Assistant {
        message.metadata.insert("tag".into(), json!("x"));
    }
    message
}

/// While the step streams its call, notes progress on the step's (pending) row.
#[hook(tool_call_started)]
async fn note_progress(state: &ThreadState, _call: &ToolCall, _progress: Option<&str>) {
    let rows = state.get_messages(MessagesQuery::default()).await.unwrap();
    let pending = rows
        .messages
        .iter()
        .find(|row| row.role == MessageRole::Assistant && row.status == Some(MessageStatus::Pending))
        .expect("the step's pending row");
    let mut updates = serde_json::Map::new();
    updates.insert("metadata".into(), json!({"tag": "x", "progress": "y"}));
    state.update_message(&pending.id, updates).await.unwrap();
}

/// Does nothing.
#[tool]
async fn noop() -> String {
    "ok".into()
}

#[agent(hooks = [tag_assistant_rows, note_progress])]
fn progressing() -> &'static str {
    use_model("scripted/x");
    use_tool(noop);
    "P"
}

/// Standard Agents §2.1 `updateMessage`: a change made to the running step's row while it
/// streams is stored over what its create hooks set earlier, not under it.
#[tokio::test]
async fn an_update_of_the_running_steps_row_outlasts_its_create_hooks_fields() {
    let model = ScriptedModel::new([ScriptedReply::tool_call("noop", json!({})), ScriptedReply::text("done")]);
    let runtime = runtime_with(&model, vec![progressing.into()]);
    runtime.init(&progressing, "p").send("go").await.unwrap();
    let stored = bodies(&runtime, "progressing", "p").await;
    let step = stored
        .iter()
        .find_map(|body| match body {
            RecordBody::AssistantToolCall { message_id, .. } => Some(message_id.clone()),
            _ => None,
        })
        .unwrap();
    let metadata: Vec<&Value> = stored
        .iter()
        .filter_map(|body| match body {
            RecordBody::MessageUpdated { message_id, updates } if *message_id == step => updates.get("metadata"),
            _ => None,
        })
        .collect();
    assert_eq!(
        metadata.last(),
        Some(&&json!({"tag": "x", "progress": "y"})),
        "{metadata:?}"
    );
}

#[test]
fn tool_status_and_message_status_serialize_as_the_reference_spells_them() {
    assert_eq!(serde_json::to_value(ToolStatus::Error).unwrap(), json!("error"));
    assert_eq!(serde_json::to_value(MessageStatus::Pending).unwrap(), json!("pending"));
}

// ---- queued messages (items 30, 81-adjacent: queue_message) ------------------------------------

static SPAM_REFUSALS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[hook(before_create_message)]
async fn refuse_spam(_state: &ThreadState, message: Message) -> Result<Message, HookError> {
    if message.content.as_deref() == Some("spam") {
        SPAM_REFUSALS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        return Err(HookError::new("spam is not stored"));
    }
    Ok(message)
}

/// Queues two follow-up messages.
#[tool]
async fn queue_two(ctx: &ToolContext) -> Result<String, ToolError> {
    let thread = ctx.thread().unwrap();
    for content in ["spam", "a real follow-up"] {
        thread
            .queue_message(content)
            .await
            .map_err(|error| ToolError::new(error.to_string()))?;
    }
    Ok("queued".into())
}

#[agent(hooks = [refuse_spam])]
fn queueing() -> &'static str {
    use_model("scripted/x");
    use_tool(queue_two);
    "Q"
}

#[tokio::test]
async fn item_30_a_prevented_queued_message_leaves_the_response_which_goes_on_with_the_others() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("queue_two", json!({})),
        ScriptedReply::text("answered both"),
    ]);
    let runtime = runtime_with(&model, vec![queueing.into()]);
    let mut events = runtime.observe();
    let reply = runtime.init(&queueing, "q").send("start").await.unwrap();
    assert_eq!(reply.text, "answered both");
    // The follow-up joined the response at the tool batch's boundary; the spam did not.
    let second = &model.requests()[1].messages;
    assert_eq!(second.last(), Some(&ModelMessage::user("a real follow-up")));
    assert!(!second.contains(&ModelMessage::user("spam")));
    // The spam left the response and, processed on its own after it, failed with the hook's
    // error, its hook not run again.
    let settled = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            let observation = events.recv().await.unwrap();
            if let flue_runtime::events::Event::SubmissionSettled { error: Some(error), .. } = observation.event {
                break error;
            }
        }
    })
    .await
    .expect("the prevented message settles");
    assert_eq!(settled.error_type, "message_hook_error");
    assert_eq!(settled.message, "spam is not stored");
    assert_eq!(model.requests().len(), 2, "no turn for the prevented message");
    assert_eq!(
        SPAM_REFUSALS.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the hook prevented it once"
    );
}

// ---- ids (item 3) -----------------------------------------------------------------------------

#[hook(after_create_message, id = "audit")]
async fn audit_rows(_state: &ThreadState, _message: &Message) {}

#[hook(after_update_message, id = "audit")]
async fn audit_updates(_state: &ThreadState, _message: &Message) {}

#[agent(hooks = [audit_rows])]
fn audited_rows() -> &'static str {
    use_model("scripted/x");
    "A"
}

#[agent(hooks = [audit_updates])]
fn audited_updates() -> &'static str {
    use_model("scripted/x");
    "A"
}

#[test]
fn item_03_two_hooks_sharing_an_id_are_refused_when_the_runtime_is_built() {
    let error = Runtime::builder()
        .store(MemoryStore::new())
        .agent(audited_rows)
        .agent(audited_updates)
        .build()
        .err()
        .expect("a clash");
    let text = error.to_string();
    assert!(text.contains("Two lifecycle hooks share the id \"audit\""), "{text}");
    assert!(
        text.contains("after_create_message") && text.contains("after_update_message"),
        "{text}"
    );
}

#[agent]
fn selects_audit_updates() -> &'static str {
    use_model("scripted/x");
    use_hooks([audit_updates]);
    "A"
}

#[hook(user_value_changed, id = "audit")]
async fn audit_user_values(_user: &UserState, _key: &str) -> Result<(), HookError> {
    Ok(())
}

#[agent]
fn selects_audit_rows() -> &'static str {
    use_model("scripted/x");
    use_hooks([audit_rows]);
    "A"
}

/// Item 3 beyond what the builder sees: a hook a render selects may not share its id with
/// another agent's hook, nor with a user hook. The clash fails the render that meets it,
/// before any model call; the same hook selected again is no clash.
#[tokio::test]
async fn item_03_a_hook_a_render_selects_may_not_share_an_id_with_another_hook_of_the_application() {
    let model = ScriptedModel::new([ScriptedReply::text("ok"), ScriptedReply::text("again")]);
    let runtime = runtime_with(
        &model,
        vec![
            audited_rows.into(),
            selects_audit_updates.into(),
            selects_audit_rows.into(),
        ],
    );
    let (error_type, message) = run_error(runtime.init(&selects_audit_updates, "s").send("hi").await.unwrap_err());
    assert_eq!(error_type, "render_failed");
    assert!(
        message.contains("Two lifecycle hooks share the id \"audit\""),
        "{message}"
    );
    assert!(model.requests().is_empty());
    // The declared hook itself, selected by another render: the same hook, no clash.
    assert_eq!(
        runtime.init(&selects_audit_rows, "r").send("hi").await.unwrap().text,
        "ok"
    );

    let model = ScriptedModel::new([]);
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    let with_user_hook = Runtime::builder()
        .store(MemoryStore::new())
        .providers(providers)
        .agent(selects_audit_rows)
        .user_hook(audit_user_values)
        .build()
        .unwrap();
    let (error_type, message) = run_error(
        with_user_hook
            .init(&selects_audit_rows, "u")
            .send("hi")
            .await
            .unwrap_err(),
    );
    assert_eq!(error_type, "render_failed");
    assert!(
        message.contains("share the id \"audit\"") && message.contains("user_value_changed"),
        "{message}"
    );
}

// ---- user scope (items 73–76) -----------------------------------------------------------------

static USER_LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[hook(user_value_changed)]
async fn mirror_theme(user: &UserState, key: &str) -> Result<(), HookError> {
    let value = user
        .get_value(key)
        .await
        .map_err(|error| HookError::new(error.to_string()))?;
    USER_LOG
        .lock()
        .unwrap()
        .push(format!("{} changed {key} to {value:?}", user.user_id()));
    if key == "theme" {
        // A write from the hook does not fire the hooks again.
        user.set_value("theme_mirror", value)
            .await
            .map_err(|error| HookError::new(error.to_string()))?;
    }
    Err(HookError::new("the audit log is unreachable"))
}

#[hook(user_client_attached)]
async fn greet_client(user: &UserState, client: &ClientInfo) {
    USER_LOG
        .lock()
        .unwrap()
        .push(format!("{} attached {} {:?}", user.user_id(), client.id, client.kind));
}

#[hook(user_client_detached)]
async fn forget_client(user: &UserState, client: &ClientInfo) {
    USER_LOG
        .lock()
        .unwrap()
        .push(format!("{} detached {}", user.user_id(), client.id));
}

async fn user_log_reaches(count: usize) -> Vec<String> {
    for _ in 0..500 {
        let log = USER_LOG.lock().unwrap().clone();
        if log.len() >= count {
            return log;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    panic!("the user hooks did not run: {:?}", USER_LOG.lock().unwrap());
}

#[hook(filter_messages)]
async fn reads_the_mood(state: &ThreadState, messages: Vec<Message>) -> Vec<Message> {
    assert_eq!(state.get_value("mood").await.unwrap(), None);
    messages
}

#[agent(hooks = [reads_the_mood])]
fn moody() -> &'static str {
    use_model("scripted/x");
    use_tool(flaky);
    "M"
}

/// The memory store, counting reads of a whole stream.
struct CountingReads {
    inner: MemoryStore,
    whole: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl CountingReads {
    /// A store and its count of whole-stream reads.
    fn new() -> (Self, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        let whole = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let store = Self {
            inner: MemoryStore::new(),
            whole: whole.clone(),
        };
        (store, whole)
    }
}

impl flue_runtime::store::Store for CountingReads {
    harness::delegate_store!(
        inner;
        admit, instance, submission, has_queued, claim_next, renew_leases, expired, reclaim,
        aborts_requested, instances_with_queued, claim_joinable, finalize_join, revert_joins, settle, requeue,
        request_abort, append, put_attachment, attachment, user_value, set_user_value,
        list_user_values, create_child,
    );

    fn read(
        &self,
        key: &InstanceKey,
        after: Option<u64>,
    ) -> flue_runtime::BoxFuture<'_, Result<Vec<flue_runtime::record::Batch>, flue_runtime::store::StoreError>> {
        if after.is_none() {
            self.whole.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        self.inner.read(key, after)
    }
}

#[tokio::test]
async fn a_hook_reading_the_thread_at_every_turn_reads_the_whole_stream_once_per_instance() {
    let (store, whole) = CountingReads::new();
    let model = ScriptedModel::new([
        ScriptedReply::text("hello"),
        ScriptedReply::tool_call("flaky", json!({"fail": false})),
        ScriptedReply::tool_call("flaky", json!({"fail": false})),
        ScriptedReply::tool_call("flaky", json!({"fail": false})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_on(store, &model, vec![moody.into()]);
    let handle = runtime.init(&moody, "m");
    handle.send("hi").await.unwrap();
    let before = whole.load(std::sync::atomic::Ordering::SeqCst);
    assert!(before >= 1, "the first response's reads folded the stream");
    // Four model calls, each after a filter_messages that reads the thread: the instance's
    // fold is brought up to date with what is new, not read again from the start (neither for
    // each read, nor for the new response).
    handle.send("work").await.unwrap();
    assert_eq!(model.requests().len(), 5);
    assert_eq!(
        whole.load(std::sync::atomic::Ordering::SeqCst) - before,
        0,
        "the thread state re-read the whole stream"
    );
}

#[agent]
fn plain_talker() -> &'static str {
    use_model("scripted/x");
    "P"
}

#[tokio::test]
async fn a_new_instances_submissions_never_read_its_stream_from_the_start() {
    let (store, whole) = CountingReads::new();
    let model = ScriptedModel::new([ScriptedReply::text("hello"), ScriptedReply::text("again")]);
    let runtime = runtime_on(store, &model, vec![plain_talker.into()]);
    let handle = runtime.init(&plain_talker, "fresh");
    assert_eq!(handle.send("hi").await.unwrap().text, "hello");
    assert_eq!(handle.send("more").await.unwrap().text, "again");
    // The admission that created the instance handed its birth batch over: the conversation
    // starts from it and reads only what follows.
    assert_eq!(whole.load(std::sync::atomic::Ordering::SeqCst), 0);
    // And the conversation it started from is the whole one.
    let second = &model.requests()[1].messages;
    assert_eq!(second.len(), 3, "{second:?}");
    assert_eq!(second[0], ModelMessage::user("hi"));
    assert_eq!(second[2], ModelMessage::user("more"));
}

#[tokio::test]
async fn user_ids_keys_and_prefixes_with_control_characters_are_refused_before_the_store() {
    let runtime = Runtime::builder().store(MemoryStore::new()).build().unwrap();
    let refused = |result: Result<_, ThreadError>| match result {
        Err(ThreadError::Invalid(message)) => message,
        other => panic!("expected an invalid-input error, got {other:?}"),
    };
    // Postgres text cannot hold NUL: every store refuses it alike.
    let user = runtime.user("ada\0");
    assert!(
        refused(user.set_value("theme", Some(json!("dark"))).await.map(|_| ())).starts_with("A user id cannot contain")
    );
    assert!(refused(user.get_value("theme").await.map(|_| ())).starts_with("A user id cannot contain"));
    let user = runtime.user("ada");
    assert!(
        refused(user.set_value("the\0me", Some(json!("dark"))).await.map(|_| ()))
            .starts_with("A user value key cannot contain")
    );
    let query = UserValuesQuery {
        prefix: "th\0".into(),
        ..UserValuesQuery::default()
    };
    assert!(refused(user.list_values(query).await.map(|_| ())).contains("control characters"));
    // Nothing was stored.
    assert_eq!(user.list_values(UserValuesQuery::default()).await.unwrap().total, 0);
}

/// Held until the test releases it: the user hook below waits for a permit.
static HOLD_GREETINGS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(0);
static HELD_GREETINGS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[hook(user_client_attached)]
async fn held_greeting(_user: &UserState, _client: &ClientInfo) {
    HOLD_GREETINGS.acquire().await.unwrap().forget();
    HELD_GREETINGS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

#[tokio::test]
async fn a_users_hook_events_past_the_queue_bound_are_dropped_with_a_warning_not_held() {
    use flue_runtime::lifecycle::USER_HOOK_QUEUE;
    let logs = harness::logs::capture();
    let runtime = Runtime::builder()
        .store(MemoryStore::new())
        .user_hook(held_greeting)
        .build()
        .unwrap();
    // A client connecting in a loop while the hook is stuck: this (current-thread) test does
    // not yield, so the hook's worker takes none of them yet.
    let extra = 25;
    for n in 0..USER_HOOK_QUEUE + extra {
        runtime.user_client(
            "looping",
            ClientInfo {
                id: format!("c-{n}"),
                kind: None,
            },
            true,
        );
    }
    // One warning for the first drop, however many follow (this user's: another test drops
    // events of its own user in this binary).
    let this_user = |message: &str| {
        logs.fields_of(message)
            .iter()
            .filter(|fields| fields.contains(&r#"user="looping""#.to_owned()))
            .count()
    };
    assert_eq!(
        this_user(&format!(
            "[Hooks] ✗ A user_client_attached event was dropped: {USER_HOOK_QUEUE} events already wait for this user's hooks (further drops are counted when the queue drains)"
        )),
        1,
        "{:?}",
        logs.lines("events already wait for this user's hooks")
    );
    HOLD_GREETINGS.add_permits(USER_HOOK_QUEUE + extra);
    for _ in 0..1000 {
        if HELD_GREETINGS.load(std::sync::atomic::Ordering::SeqCst) == USER_HOOK_QUEUE {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert_eq!(
        HELD_GREETINGS.load(std::sync::atomic::Ordering::SeqCst),
        USER_HOOK_QUEUE,
        "every queued event ran, the dropped ones did not"
    );
    // And the count, once the queue drained.
    assert_eq!(
        this_user(&format!(
            "[Hooks] ✗ {extra} user hook event(s) were dropped while this user's queue was full"
        )),
        1,
        "{:?}",
        logs.lines("user hook event(s) were dropped while this user's queue was full")
    );
    // The queue drained: the next event runs.
    runtime.user_client(
        "looping",
        ClientInfo {
            id: "c-last".into(),
            kind: None,
        },
        true,
    );
    for _ in 0..1000 {
        if HELD_GREETINGS.load(std::sync::atomic::Ordering::SeqCst) == USER_HOOK_QUEUE + 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(
        HELD_GREETINGS.load(std::sync::atomic::Ordering::SeqCst),
        USER_HOOK_QUEUE + 1
    );
}

/// Held until the test releases it, like the greetings above (a hook of its own, so the two
/// tests do not share permits).
static HOLD_ARRIVALS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(0);
static ARRIVED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
static LEFT: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

#[hook(user_client_attached)]
async fn held_arrival(_user: &UserState, client: &ClientInfo) {
    HOLD_ARRIVALS.acquire().await.unwrap().forget();
    ARRIVED.lock().unwrap().push(client.id.clone());
}

#[hook(user_client_detached)]
async fn departure(_user: &UserState, client: &ClientInfo) {
    LEFT.lock().unwrap().push(client.id.clone());
}

#[tokio::test]
async fn past_the_queue_bound_a_clients_detach_is_dropped_exactly_when_its_attach_was() {
    use flue_runtime::lifecycle::USER_HOOK_QUEUE;
    let runtime = Runtime::builder()
        .store(MemoryStore::new())
        .user_hook(held_arrival)
        .user_hook(departure)
        .build()
        .unwrap();
    let client = |n: usize| ClientInfo {
        id: format!("c-{n}"),
        kind: None,
    };
    // Clients connecting and leaving in a loop while the attach hook is stuck (this
    // current-thread test does not yield: the worker takes none of them yet). The queue fills
    // with attaches; the rest are dropped.
    let (clients, extra) = (USER_HOOK_QUEUE + 25, 25);
    for n in 0..clients {
        runtime.user_client("leaving", client(n), true);
    }
    for n in 0..clients {
        runtime.user_client("leaving", client(n), false);
    }
    HOLD_ARRIVALS.add_permits(clients);
    // The queue drains (room for more again)...
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while LEFT.lock().unwrap().len() < USER_HOOK_QUEUE {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the heard clients left");
    // ...and the unheard clients are forgotten once they left: a client of that id connecting
    // again is heard, arriving and leaving. Its events queue after all of the above, and the
    // hooks run in order: once its detach ran, every event queued before it had run.
    runtime.user_client("leaving", client(clients - 1), true);
    runtime.user_client("leaving", client(clients - 1), false);
    let again = client(clients - 1).id;
    let heard_leaving_again = || {
        let left = LEFT.lock().unwrap();
        left.len() > USER_HOOK_QUEUE && left.last() == Some(&again)
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while !heard_leaving_again() {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the client connecting again was heard leaving");
    let heard: Vec<String> = (0..USER_HOOK_QUEUE).map(|n| client(n).id).collect();
    let heard_then_again: Vec<String> = heard.iter().cloned().chain([again.clone()]).collect();
    assert_eq!(
        *ARRIVED.lock().unwrap(),
        heard_then_again,
        "the first {USER_HOOK_QUEUE} attaches ran, then the one again"
    );
    assert_eq!(
        *LEFT.lock().unwrap(),
        heard_then_again,
        "each client the hooks saw arrive leaves, though the queue was full; the {extra} unheard ones do not"
    );
}

#[tokio::test]
async fn items_73_74_75_76_user_hooks_run_for_every_user_without_recursion_and_their_errors_stay_in_the_log() {
    let logs = harness::logs::capture();
    let model = ScriptedModel::new([]);
    let mut providers = ProviderRegistry::new();
    providers.register(model);
    let runtime = Runtime::builder()
        .store(MemoryStore::new())
        .providers(providers)
        .user_hook(mirror_theme)
        .user_hook(greet_client)
        .user_hook(forget_client)
        .build()
        .unwrap();
    let user = runtime.user("u-1");
    // Item 76: the hook's error does not reach the write.
    user.set_value("theme", Some(json!("dark"))).await.unwrap();
    // The hooks run in the background and see the key (they read the value when they run).
    user_log_reaches(1).await;
    assert_eq!(user.get_value("theme_mirror").await.unwrap(), Some(json!("dark")));
    user.set_value("theme", None).await.unwrap();
    runtime.user_client(
        "u-1",
        ClientInfo {
            id: "c-9".into(),
            kind: Some("web".into()),
        },
        true,
    );
    runtime.user_client(
        "u-1",
        ClientInfo {
            id: "c-9".into(),
            kind: None,
        },
        false,
    );
    let log = user_log_reaches(4).await;
    assert_eq!(
        log,
        [
            "u-1 changed theme to Some(String(\"dark\"))",
            "u-1 changed theme to None",
            "u-1 attached c-9 Some(\"web\")",
            "u-1 detached c-9",
        ],
        "in order, once each: the mirror writes fired nothing"
    );
    assert_eq!(
        user.get_value("theme_mirror").await.unwrap(),
        None,
        "mirrored, then deleted"
    );
    assert_eq!(
        logs.lines("the audit log is unreachable"),
        [
            "[Hooks] ✗ Error running user_value_changed hook: the audit log is unreachable",
            "[Hooks] ✗ Error running user_value_changed hook: the audit log is unreachable",
        ]
    );
    let page = user
        .list_values(flue_runtime::lifecycle::UserValuesQuery::default())
        .await
        .unwrap();
    assert_eq!(page.total, 0);
    assert!(matches!(
        user.set_value("", Some(json!(1))).await,
        Err(ThreadError::Invalid(_))
    ));
}

/// A user hook written by hand, which panics before it returns its future (quoting a URL
/// with its token, as a webhook client's error does).
fn panics_at_once<'a>(_: &'a UserState, _: &'a str) -> flue_runtime::lifecycle::HookFuture<'a, ()> {
    panic!("before its future: https://hooks.example/x?token=s3cret-hook")
}

static PANICS_AT_ONCE: flue_runtime::lifecycle::UserHookDefinition = flue_runtime::lifecycle::UserHookDefinition {
    id: "panics_at_once",
    handler: flue_runtime::lifecycle::UserHookHandler::UserValueChanged(panics_at_once),
};

static AFTER_THE_PANIC: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[hook(user_value_changed)]
async fn runs_after_the_panic(_user: &UserState, key: &str) {
    AFTER_THE_PANIC.lock().unwrap().push(key.to_owned());
}

#[tokio::test]
async fn a_user_hook_panicking_before_its_future_is_an_error_and_the_users_events_go_on() {
    let logs = harness::logs::capture();
    let mut providers = ProviderRegistry::new();
    providers.register(ScriptedModel::new([]));
    let runtime = Runtime::builder()
        .store(MemoryStore::new())
        .providers(providers)
        .user_hook(flue_runtime::lifecycle::UserHook::new(&PANICS_AT_ONCE))
        .user_hook(runs_after_the_panic)
        .build()
        .unwrap();
    let user = runtime.user("u-panic");
    user.set_value("first", Some(json!(1))).await.unwrap();
    user.set_value("second", Some(json!(2))).await.unwrap();
    let mut seen = Vec::new();
    for _ in 0..500 {
        seen = AFTER_THE_PANIC.lock().unwrap().clone();
        if seen.len() >= 2 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // The next hook of the event, and the user's next event, still ran.
    assert_eq!(seen, ["first", "second"]);
    // Logged without the URL's secrets.
    let logged = logs.lines("before its future");
    assert_eq!(logged.len(), 2, "{logged:?}");
    for line in &logged {
        assert!(
            line.starts_with(
                "[Hooks] ✗ Error running user_value_changed hook: panicked: before its future: https://hooks.example/x"
            ),
            "{line}"
        );
        assert!(!line.contains("s3cret-hook"), "{line}");
    }
}

// ---- queue_tool (item 81) ---------------------------------------------------------------------

/// Not mounted by any render: only queued.
#[tool]
async fn audit_trail(
    /// What happened
    event: String,
) -> String {
    format!("audited {event}")
}

/// Queues an audit.
#[tool]
async fn queue_audit(ctx: &ToolContext) -> Result<String, ToolError> {
    ctx.thread()
        .unwrap()
        .queue_tool(audit_trail, json!({"event": "refund"}))
        .map_err(|error| ToolError::new(error.to_string()))?;
    Ok("queued".into())
}

/// What a generic tool's arguments are.
#[derive(serde::Deserialize, schemars::JsonSchema)]
struct Audited {
    /// What happened
    event: String,
}

/// A generic tool: audits with its type parameter's label.
#[tool]
async fn labelled_audit<L: Label>(args: Audited) -> String {
    format!("{} {}", L::LABEL, args.event)
}

trait Label: Send + Sync + 'static {
    const LABEL: &'static str;
}

struct Refunds;

impl Label for Refunds {
    const LABEL: &'static str = "refund:";
}

/// Queues the generic tool its render mounted, built again.
#[tool]
async fn queue_labelled(ctx: &ToolContext) -> Result<String, ToolError> {
    ctx.thread()
        .unwrap()
        .queue_tool(labelled_audit::<Refunds>::new(), json!({"event": "granted"}))
        .map_err(|error| ToolError::new(error.to_string()))?;
    Ok("queued".into())
}

#[agent]
fn generic_auditing() -> &'static str {
    use_model("scripted/x");
    use_tool(labelled_audit::<Refunds>::new());
    use_tool(queue_labelled);
    "A"
}

/// A generic `#[tool]` built again is the tool its render mounted (one per instantiation,
/// as a tool that is not generic): queuing it runs it. (Regression: each `::new()` was a tool
/// of its own, and `queue_tool` refused it as another tool under the mounted one's name.)
#[tokio::test]
async fn a_generic_tool_built_again_is_the_mounted_one_and_can_be_queued() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("queue_labelled", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![generic_auditing.into()]);
    runtime.init(&generic_auditing, "g").send("refund me").await.unwrap();
    let requests = model.requests();
    assert_eq!(requests.len(), 2);
    let results = harness::tool_results(&requests[1]);
    assert_eq!(
        results,
        [("queued".to_owned(), false), ("refund: granted".to_owned(), false)]
    );
    let (one, again) = (
        Tool::from_handler(labelled_audit::<Refunds>::new()),
        Tool::from_handler(labelled_audit::<Refunds>::new()),
    );
    assert_eq!(one.identity(), again.identity());
    assert!(one.is_static());
}

/// Observers are shown the queued calls' step (its assistant message, with the calls) before
/// the results that answer them, as a model's step: one rebuilding the conversation from
/// events has no orphan results.
#[agent]
fn announced_auditing() -> &'static str {
    use_model("scripted/x");
    use_tool(queue_audit);
    "A"
}

#[tokio::test]
async fn a_queued_calls_step_is_announced_before_its_results() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("queue_audit", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![announced_auditing.into()]);
    let mut events = runtime.observe();
    runtime
        .init(&announced_auditing, "announced")
        .send("refund me")
        .await
        .unwrap();
    let mut announced_calls: Vec<String> = Vec::new();
    let mut answered_before_announced: Vec<String> = Vec::new();
    let mut audited = 0;
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            flue_runtime::events::Event::MessageEnd {
                message: ModelMessage::Assistant { tool_calls, .. },
            } => announced_calls.extend(tool_calls.into_iter().map(|call| call.id)),
            flue_runtime::events::Event::MessageEnd {
                message: ModelMessage::Tool { tool_call_id, name, .. },
            } => {
                if name == "audit_trail" {
                    audited += 1;
                }
                if !announced_calls.contains(&tool_call_id) {
                    answered_before_announced.push(tool_call_id);
                }
            }
            _ => {}
        }
    }
    assert_eq!(audited, 1, "the queued call's result was shown");
    assert!(
        answered_before_announced.is_empty(),
        "results shown before their call's step: {answered_before_announced:?} (announced: {announced_calls:?})"
    );
}

static AT_REST_QUEUE: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[hook(after_thread_created)]
async fn queue_at_rest(state: &ThreadState) {
    let outcome = state.queue_tool(audit_trail, json!({"event": "x"}));
    AT_REST_QUEUE.lock().unwrap().push(format!("{:?}", outcome.is_err()));
}

#[agent(hooks = [queue_at_rest])]
fn auditing() -> &'static str {
    use_model("scripted/x");
    use_tool(queue_audit);
    "A"
}

#[tokio::test]
async fn item_81_a_queued_tool_runs_later_in_the_same_flow_even_when_not_mounted() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("queue_audit", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![auditing.into()]);
    let reply = runtime.init(&auditing, "a").send("refund me").await.unwrap();
    assert_eq!(reply.text, "done");
    let requests = model.requests();
    assert_eq!(requests.len(), 2);
    // The queued call and its result follow the batch that queued it.
    let messages = &requests[1].messages;
    let ModelMessage::Assistant { tool_calls, text, .. } = &messages[3] else {
        panic!("the queued call's step: {messages:?}")
    };
    assert_eq!((text.as_str(), tool_calls[0].name.as_str()), ("", "audit_trail"));
    assert_eq!(
        messages[4],
        ModelMessage::Tool {
            tool_call_id: tool_calls[0].id.clone(),
            name: "audit_trail".into(),
            content: "audited refund".into(),
            is_error: false,
        }
    );
    assert_eq!(
        AT_REST_QUEUE.lock().unwrap().clone(),
        ["true"],
        "at rest there is nothing to queue onto"
    );
}

static FINISHES_AFTER_QUEUED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Queues an audit when the answer's row is completed.
#[hook(after_update_message)]
async fn audit_the_answer(state: &ThreadState, message: &Message) {
    if message.role == MessageRole::Assistant && message.content.as_deref() == Some("the answer") {
        state.queue_tool(audit_trail, json!({"event": "answer"})).unwrap();
    }
}

/// Ends the response: a terminating tool.
#[tool(terminate)]
async fn close_case() -> String {
    "closed".into()
}

/// Queues the terminating `close_case` when the answer's row is completed.
#[hook(after_update_message)]
async fn close_after_the_answer(state: &ThreadState, message: &Message) {
    if message.role == MessageRole::Assistant && message.content.as_deref() == Some("the answer") {
        state.queue_tool(close_case, json!({})).unwrap();
    }
}

#[agent(max_steps = 1, hooks = [audit_the_answer])]
fn audited_once() -> &'static str {
    use_model("scripted/x");
    use_agent_finish(|_ctx| async move {
        FINISHES_AFTER_QUEUED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    });
    "A"
}

#[agent(hooks = [close_after_the_answer])]
fn closing() -> &'static str {
    use_model("scripted/x");
    "A"
}

/// Calls queued at the would-stop point run, and a response that can make no more model calls
/// (its max_steps spent) still reaches its finish callbacks: the queued call does not skip
/// them.
#[tokio::test]
async fn a_call_queued_at_the_would_stop_point_with_no_step_left_still_runs_the_finish_callbacks() {
    let model = ScriptedModel::new([ScriptedReply::text("the answer")]);
    let runtime = runtime_with(&model, vec![audited_once.into()]);
    let reply = runtime.init(&audited_once, "a").send("go").await.unwrap();
    assert_eq!(reply.text, "the answer");
    assert_eq!(model.requests().len(), 1, "max_steps = 1");
    let audited = bodies(&runtime, "audited_once", "a")
        .await
        .into_iter()
        .any(|body| matches!(body, RecordBody::ToolOutcome { tool_name, .. } if tool_name == "audit_trail"));
    assert!(audited, "the queued call ran");
    assert_eq!(FINISHES_AFTER_QUEUED.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// A queued call that terminates ends the turns as a terminating batch of the model's does:
/// no model call follows it.
#[tokio::test]
async fn a_terminating_call_queued_at_the_would_stop_point_calls_the_model_no_more() {
    let model = ScriptedModel::new([ScriptedReply::text("the answer"), ScriptedReply::text("not asked for")]);
    let runtime = runtime_with(&model, vec![closing.into()]);
    let reply = runtime.init(&closing, "c").send("go").await.unwrap();
    assert_eq!(model.requests().len(), 1, "the queued call terminated the turns");
    assert_eq!(reply.text, "the answer");
}

/// Queues a tool named like the framework's `task`.
#[tool]
async fn queue_reserved(ctx: &ToolContext) -> String {
    let named_task = Tool::new("task")
        .description("Not the framework's.")
        .run(|_ctx, _: serde_json::Map<String, serde_json::Value>| async { "ran" });
    match ctx.thread().unwrap().queue_tool(named_task, json!({})) {
        Ok(()) => "queued".into(),
        Err(error) => format!("refused: {error}"),
    }
}

#[agent]
fn reserving() -> &'static str {
    use_model("scripted/x");
    use_tool(queue_reserved);
    "A"
}

/// A queued tool is not rendered, so the render's check of reserved names does not see it:
/// `queue_tool` refuses a tool named like a framework tool (its call would be stored as the
/// framework tool's, and a re-attempt would run that tool on it).
#[tokio::test]
async fn queue_tool_refuses_a_tool_named_like_a_framework_tool() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("queue_reserved", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![reserving.into()]);
    let reply = runtime.init(&reserving, "r").send("go").await.unwrap();
    assert_eq!(reply.text, "done");
    let requests = model.requests();
    let ModelMessage::Tool { content, .. } = requests[1].messages.last().unwrap() else {
        panic!("the tool's result: {:?}", requests[1].messages)
    };
    assert!(
        content.starts_with("refused: ") && content.contains("Tool name \"task\" is reserved by the framework."),
        "{content}"
    );
    assert!(
        requests[1].messages.iter().all(|message| !matches!(message, ModelMessage::Assistant { tool_calls, .. } if tool_calls.iter().any(|call| call.name == "task"))),
        "no call of the reserved name was stored"
    );
}

/// Queues a tool named like the mounted `queue_clash`, but another.
#[tool]
async fn queue_clash(ctx: &ToolContext) -> String {
    let impostor = Tool::new("queue_clash")
        .description("Not the mounted one.")
        .run(|_ctx, _: serde_json::Map<String, serde_json::Value>| async { "impostor ran" });
    let thread = ctx.thread().unwrap();
    let other = match thread.queue_tool(impostor, json!({})) {
        Ok(()) => "queued".to_owned(),
        Err(error) => format!("refused: {error}"),
    };
    // The mounted tool itself may be queued.
    let itself = thread.queue_tool(queue_clash_again, json!({}));
    format!("{other}; itself {}", if itself.is_ok() { "queued" } else { "refused" })
}

/// Answers when queued.
#[tool]
async fn queue_clash_again() -> String {
    "again".into()
}

#[agent]
fn clashing() -> &'static str {
    use_model("scripted/x");
    use_tool(queue_clash);
    use_tool(queue_clash_again);
    "A"
}

/// Calls are stored and found again by name: `queue_tool` refuses a tool that shares its name
/// with another mounted in the render (a re-attempt would run the mounted one in its place).
#[tokio::test]
async fn queue_tool_refuses_a_tool_named_like_another_mounted_tool() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("queue_clash", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![clashing.into()]);
    let reply = runtime.init(&clashing, "c").send("go").await.unwrap();
    assert_eq!(reply.text, "done");
    let requests = model.requests();
    let results: Vec<&str> = requests[1]
        .messages
        .iter()
        .filter_map(|message| match message {
            ModelMessage::Tool { content, .. } => Some(content.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(results.len(), 2, "{results:?}");
    assert!(
        results[0].starts_with("refused: [flue] Duplicate tool name \"queue_clash\".")
            && results[0].ends_with("itself queued"),
        "{results:?}"
    );
    assert_eq!(results[1], "again");
}

/// Queues an audit when it runs (itself queued).
#[tool]
async fn chain_audit(ctx: &ToolContext) -> Result<String, ToolError> {
    ctx.thread()
        .unwrap()
        .queue_tool(audit_trail, json!({"event": "chained"}))
        .map_err(|error| ToolError::new(error.to_string()))?;
    Ok("chained".into())
}

/// Queues a chained audit.
#[tool]
async fn queue_chain(ctx: &ToolContext) -> Result<String, ToolError> {
    ctx.thread()
        .unwrap()
        .queue_tool(chain_audit, json!({}))
        .map_err(|error| ToolError::new(error.to_string()))?;
    Ok("queued".into())
}

#[agent(max_steps = 1)]
fn one_step_auditing() -> &'static str {
    use_model("scripted/x");
    use_tool(queue_chain);
    "A"
}

/// Reference item 81: a queued call runs later in the same flow, and so do the calls it
/// queues, before the next model call and past the step budget (queued steps are no model
/// steps): none is left recorded and unrun, which the next model call would be told was
/// interrupted.
#[tokio::test]
async fn calls_queued_by_a_queued_call_run_in_the_same_flow_past_the_step_budget() {
    let model = ScriptedModel::new([ScriptedReply::tool_call("queue_chain", json!({}))]);
    let runtime = runtime_with(&model, vec![one_step_auditing.into()]);
    let mut events = runtime.observe();
    runtime.init(&one_step_auditing, "a").send("audit").await.unwrap();
    let mut warnings = Vec::new();
    let mut ran = Vec::new();
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            flue_runtime::events::Event::Log { level, message, .. } if level == "warn" => warnings.push(message),
            flue_runtime::events::Event::ToolCallDone { tool_name, .. } => ran.push(tool_name),
            _ => {}
        }
    }
    assert_eq!(ran, ["queue_chain", "chain_audit", "audit_trail"]);
    assert!(warnings.is_empty(), "{warnings:?}");
    // With steps to spare, the next model call sees each chained call's own result.
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("queue_chain", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![chain_auditing.into()]);
    runtime.init(&chain_auditing, "a").send("audit").await.unwrap();
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
            ("queue_chain".to_owned(), "queued".to_owned()),
            ("chain_audit".to_owned(), "chained".to_owned()),
            ("audit_trail".to_owned(), "audited chained".to_owned()),
        ]
    );
}

static REQUEUES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Queues itself again, every time.
#[tool]
async fn requeue_self(ctx: &ToolContext) -> Result<String, ToolError> {
    REQUEUES.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    ctx.thread()
        .unwrap()
        .queue_tool(requeue_self, json!({}))
        .map_err(|error| ToolError::new(error.to_string()))?;
    Ok("again".into())
}

#[agent]
fn requeuing() -> &'static str {
    use_model("scripted/x");
    use_tool(requeue_self);
    "R"
}

/// A call that queues itself would run until the submission's deadline: after
/// `MAX_QUEUED_TOOL_STEPS` queued steps in a row the response fails, saying why.
#[tokio::test]
async fn calls_that_queue_themselves_for_ever_fail_the_response_at_the_ceiling() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("requeue_self", json!({})),
        ScriptedReply::text("never"),
    ]);
    let runtime = runtime_with(&model, vec![requeuing.into()]);
    let error = runtime.init(&requeuing, "r").send("go").await.unwrap_err();
    let (error_type, message) = run_error(error);
    assert_eq!(error_type, "queued_tool_ceiling", "{message}");
    assert!(message.contains("64 steps in a row"), "{message}");
    assert_eq!(
        REQUEUES.load(std::sync::atomic::Ordering::SeqCst),
        1 + flue_runtime::MAX_QUEUED_TOOL_STEPS,
        "the model's call, then the queued steps up to the ceiling"
    );
    assert_eq!(model.requests().len(), 1);
    // The stream holds the steps that ran, each with its outcome, and no step that never ran
    // (its calls would read as interrupted in every later request).
    let stored = bodies(&runtime, "requeuing", "r").await;
    let calls = stored
        .iter()
        .filter(|body| matches!(body, RecordBody::AssistantToolCall { .. }))
        .count();
    let outcomes: Vec<&str> = stored
        .iter()
        .filter_map(|body| match body {
            RecordBody::ToolOutcome { content, .. } => Some(content.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(calls, 1 + flue_runtime::MAX_QUEUED_TOOL_STEPS as usize);
    assert_eq!(outcomes.len(), calls);
    assert!(outcomes.iter().all(|content| *content == "again"), "{outcomes:?}");
}

#[agent]
fn chain_auditing() -> &'static str {
    use_model("scripted/x");
    use_tool(queue_chain);
    "A"
}

// ---- env (item 80) ----------------------------------------------------------------------------

/// Calls the billing API.
#[tool(secrets = ["FLUE_TEST_BILLING_TOKEN"])]
async fn billing(ctx: &ToolContext) -> Result<String, ToolError> {
    let thread = ctx.thread().unwrap();
    let token = thread
        .env("FLUE_TEST_BILLING_TOKEN")
        .map_err(|error| ToolError::new(error.to_string()))?;
    let undeclared = thread.env("HOME").is_err();
    let unset = thread.env("FLUE_TEST_UNSET_SECRET").is_err();
    Ok(format!(
        "token {} chars, printed {token}, undeclared refused {undeclared}, unset refused {unset}",
        token.expose().len()
    ))
}

/// Declares a secret that is not set.
#[tool(secrets = ["FLUE_TEST_UNSET_SECRET"])]
async fn unset_secret() -> String {
    String::new()
}

#[agent]
fn billed() -> &'static str {
    use_model("scripted/x");
    use_tool(billing);
    use_tool(unset_secret);
    "B"
}

#[tokio::test]
async fn item_80_env_reads_declared_set_variables_only_and_never_prints_them() {
    assert_eq!(
        std::env::var("FLUE_TEST_BILLING_TOKEN").as_deref(),
        Ok("s3cr3t-value"),
        "set for the tests by .cargo/config.toml"
    );
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("billing", json!({})),
        ScriptedReply::text("ok"),
    ]);
    let runtime = runtime_with(&model, vec![billed.into()]);
    runtime.init(&billed, "b").send("bill").await.unwrap();
    let ModelMessage::Tool { content, .. } = &model.requests()[1].messages[2] else {
        panic!("a tool result")
    };
    assert_eq!(
        content,
        "token 12 chars, printed [redacted], undeclared refused true, unset refused true"
    );
}

/// Reads the billing token, which another tool of the render declares, and answers it whole.
#[tool]
async fn leaky_route(ctx: &ToolContext) -> Result<String, ToolError> {
    let token = ctx
        .thread()
        .unwrap()
        .env("FLUE_TEST_BILLING_TOKEN")
        .map_err(|error| ToolError::new(error.to_string()))?;
    Ok(format!("routed with {}", token.expose()))
}

#[agent]
fn routed() -> &'static str {
    use_model("scripted/x");
    use_tool(billing);
    use_tool(leaky_route);
    "R"
}

/// A tool may read through `env` a secret another tool of its render declares: what it
/// answers is cleared of that value too, not only of its own declared secrets'.
#[tokio::test]
async fn item_80_a_secret_read_through_env_is_kept_out_of_any_tools_answer() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("leaky_route", json!({})),
        ScriptedReply::text("ok"),
    ]);
    let runtime = runtime_with(&model, vec![routed.into()]);
    runtime.init(&routed, "r").send("route").await.unwrap();
    let ModelMessage::Tool { content, .. } = &model.requests()[1].messages[2] else {
        panic!("a tool result")
    };
    assert_eq!(content, "routed with [redacted]");
}

/// Screens the history through an API keyed by the billing token (another tool's declared
/// secret), in its URL, and fails as an HTTP library's error would: quoting the URL. It
/// blocks the request with that text, or (for a message saying `panic`) unwraps it.
#[hook(prefilter_llm_history)]
async fn keyed_screen(state: &ThreadState, messages: Vec<LlmMessage>) -> Result<Vec<LlmMessage>, HookError> {
    let token = state
        .env("FLUE_TEST_BILLING_TOKEN")
        .map_err(|error| HookError::new(error.to_string()))?;
    let failure = format!(
        "error sending request for url (https://user:{0}@screen.example/v1/check?key={0}): timed out; bearer {0}",
        token.expose()
    );
    if messages.iter().any(|message| message.content == json!("panic")) {
        panic!("{failure}");
    }
    Err(HookError::block(failure))
}

#[agent(hooks = [keyed_screen])]
fn screened() -> &'static str {
    use_model("scripted/x");
    use_tool(billing);
    "S"
}

/// Item 80 and the secrets rule: a hook reads the render's declared secrets through `env`
/// too; its error (the blocking message stored as the reply, which clients and later turns
/// read) and its panic (logged) are cleaned of them and of the URL's secrets, as a tool's are.
#[tokio::test]
async fn item_80_a_hooks_error_or_panic_is_kept_clear_of_the_secrets_env_hands_it() {
    let logs = harness::logs::capture();
    let model = ScriptedModel::new([ScriptedReply::text("screened")]);
    let runtime = runtime_with(&model, vec![screened.into()]);
    let refusal = runtime.init(&screened, "s-1").send("screen me").await.unwrap();
    assert!(!refusal.text.contains("s3cr3t-value"), "{}", refusal.text);
    assert!(refusal.text.contains("bearer [redacted]"), "{}", refusal.text);
    assert!(refusal.text.contains("screen.example/v1/check"), "{}", refusal.text);
    let stored = format!("{:?}", bodies(&runtime, "screened", "s-1").await);
    assert!(!stored.contains("s3cr3t-value"), "{stored}");
    // A panic is an error the chain logs and goes past.
    let passed = runtime.init(&screened, "s-2").send("panic").await.unwrap();
    assert_eq!(passed.text, "screened");
    let logged = logs.lines("Error running prefilter_llm_history hook: panicked");
    assert_eq!(logged.len(), 1, "{logged:?}");
    assert!(!logged[0].contains("s3cr3t-value"), "{logged:?}");
    assert!(logged[0].contains("bearer [redacted]"), "{logged:?}");
}

/// Retries a failed lookup itself through an API keyed by the billing token, and answers its
/// failure as an HTTP library's error reads: quoting the URL, key and all.
#[hook(after_tool_call_success)]
async fn keyed_retry(state: &ThreadState, _call: &ToolCall, _result: ToolResult) -> Option<ToolResult> {
    let token = state.env("FLUE_TEST_BILLING_TOKEN").ok()?;
    Some(ToolResult::error(format!(
        "retry failed: error sending request for url (https://api.example/v1?key={0}); bearer {0}",
        token.expose()
    )))
}

/// Notes on every tool row which key its lookup used.
#[hook(before_create_message)]
async fn keyed_note(state: &ThreadState, mut message: Message) -> Result<Message, HookError> {
    if message.role == MessageRole::Tool {
        let token = state
            .env("FLUE_TEST_BILLING_TOKEN")
            .map_err(|error| HookError::new(error.to_string()))?;
        message.content = Some(format!(
            "{} (looked up with {}; see https://docs.example/lookups?page=2)",
            message.content.unwrap_or_default(),
            token.expose()
        ));
    }
    Ok(message)
}

#[agent(hooks = [keyed_retry, keyed_note])]
fn keyed_lookups() -> &'static str {
    use_model("scripted/x");
    use_tool(billing);
    "R"
}

/// What a hook returns is cleaned of the secrets `env` hands it, as its error and a tool's own
/// answer are: a replaced tool result, and a row a create hook changed, are stored, served and
/// read by the model.
#[tokio::test]
async fn item_80_what_a_hook_returns_is_kept_clear_of_the_secrets_env_hands_it() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("billing", json!({})),
        ScriptedReply::text("ok"),
    ]);
    let runtime = runtime_with(&model, vec![keyed_lookups.into()]);
    runtime.init(&keyed_lookups, "r").send("bill").await.unwrap();
    let ModelMessage::Tool { content, .. } = &model.requests()[1].messages[2] else {
        panic!("a tool result")
    };
    assert!(!content.contains("s3cr3t-value"), "{content}");
    assert!(content.contains("bearer [redacted]"), "{content}");
    // What is no error keeps its URLs whole (only an error's lose their query, as a tool's).
    assert!(
        content.contains("(looked up with [redacted]; see https://docs.example/lookups?page=2)"),
        "{content}"
    );
    assert!(
        content.contains("error sending request for url (https://api.example/v1); bearer [redacted]"),
        "the error's URL loses its query: {content}"
    );
    let stored = format!("{:?}", bodies(&runtime, "keyed_lookups", "r").await);
    assert!(!stored.contains("s3cr3t-value"), "{stored}");
}

/// A memory store whose appends of a thread value take 300 ms (a slow database), and whose
/// append of a final answer tells [`FINAL_STEP_STORED`] and takes 50 ms more to return.
#[derive(Clone, Default)]
struct SlowValueWrites {
    inner: MemoryStore,
}

impl flue_runtime::store::Store for SlowValueWrites {
    harness::delegate_store!(
        inner;
        admit, instance, submission, has_queued, claim_next, renew_leases, expired, reclaim,
        aborts_requested, instances_with_queued, claim_joinable, finalize_join, revert_joins, settle,
        requeue, request_abort, read, read_page, last_offset, put_attachment, attachment, user_value,
        set_user_value, list_user_values, create_child,
    );

    fn append(
        &self,
        key: &InstanceKey,
        records: std::sync::Arc<[flue_runtime::record::Record]>,
        authorization: Option<&flue_runtime::store::AttemptRef>,
    ) -> flue_runtime::BoxFuture<'_, Result<u64, flue_runtime::store::StoreError>> {
        let value = records
            .iter()
            .any(|record| matches!(record.body, RecordBody::ThreadValueSet { .. }));
        let answer = records
            .iter()
            .any(|record| matches!(&record.body, RecordBody::AssistantMessageCompleted { text, .. } if text == "done"));
        let append = self.inner.append(key, records, authorization);
        Box::pin(async move {
            if value {
                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            }
            if answer {
                FINAL_STEP_STORED.notify_one();
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            append.await
        })
    }
}

static RACING_WRITE: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Told when [`SlowValueWrites`] stores the final answer.
static FINAL_STEP_STORED: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Writes a thread value from a task of its own once the final answer is being stored: the
/// write is made as the response ends.
#[tool]
async fn write_in_the_background(ctx: &ToolContext) -> String {
    let state = ctx.thread().unwrap().clone();
    let stored = FINAL_STEP_STORED.notified();
    tokio::spawn(async move {
        stored.await;
        let written = state.set_value("racing", Some(json!(1))).await;
        RACING_WRITE.lock().unwrap().push(format!("{:?}", written.is_ok()));
    });
    "writing".into()
}

#[agent]
fn racing_writer() -> &'static str {
    use_model("scripted/x");
    use_tool(write_in_the_background);
    "W"
}

/// A write through the thread state that is being stored as its response ends is waited
/// for: its `kv_changed` is published and the write is in the stream before the response's
/// end. (Before, it landed after the response, and its event was dropped while `set_value`
/// answered `Ok`.)
#[tokio::test]
async fn a_thread_write_racing_the_end_of_its_response_is_stored_and_announced_before_it_ends() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("write_in_the_background", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_on(SlowValueWrites::default(), &model, vec![racing_writer.into()]);
    let mut events = runtime.observe();
    let reply = runtime.init(&racing_writer, "r").send("go").await.unwrap();
    assert_eq!(reply.text, "done");
    // The response waited for the write (or refused it: then no event is owed).
    let written = RACING_WRITE.lock().unwrap().clone();
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            flue_runtime::events::Event::ThreadEvent { event_type, .. } if event_type == "kv_changed" => {
                seen.push(format!("kv_changed {}", observation.operation_id.is_some()));
            }
            flue_runtime::events::Event::Idle => seen.push("idle".to_owned()),
            _ => {}
        }
    }
    assert_eq!(written, ["true"], "the write went on as the response ended");
    // Announced once, within its operation: before `idle`, carrying the operation's id.
    assert_eq!(seen, ["kv_changed true", "idle"]);
}

// ---- the create hooks of the signals a response appends ------------------------------------

/// Refuses rows that say "forbidden"; redacts an e-mail address from the others.
#[hook(before_create_message)]
async fn guard_rows(_state: &ThreadState, mut message: Message) -> Result<Message, HookError> {
    if message
        .content
        .as_deref()
        .is_some_and(|text| text.contains("forbidden"))
    {
        return Err(HookError::new("forbidden words are not stored"));
    }
    message.content = message
        .content
        .map(|text| text.replace("jane@example.com", "[redacted]"));
    Ok(message)
}

/// The signal rows `note_signal_rows` saw created, by their content.
static SIGNAL_ROWS: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[hook(after_create_message)]
async fn note_signal_rows(_state: &ThreadState, message: &Message) {
    if message.metadata.contains_key("signal_type") {
        SIGNAL_ROWS
            .lock()
            .unwrap()
            .push(message.content.clone().unwrap_or_default());
    }
}

#[agent(hooks = [guard_rows, note_signal_rows])]
fn briefed() -> &'static str {
    use_model("scripted/x");
    use_agent_start(|ctx| async move {
        ctx.append(Signal::new("context", "The customer is jane@example.com."))?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    });
    "B"
}

/// A signal a `use_agent_start` callback appends is a row like a delivered one: it goes
/// through `before_create_message` (what the hook returns is stored, and what the model reads)
/// and then `after_create_message`.
#[tokio::test]
async fn a_signal_a_start_callback_appends_goes_through_the_create_hooks() {
    let model = ScriptedModel::new([ScriptedReply::text("Hello.")]);
    let runtime = runtime_with(&model, vec![briefed.into()]);
    runtime.init(&briefed, "b").send("hi").await.unwrap();
    let request = format!("{:?}", model.requests()[0].messages);
    assert!(!request.contains("jane@example.com"), "{request}");
    assert!(request.contains("The customer is [redacted]."), "{request}");
    assert_eq!(*SIGNAL_ROWS.lock().unwrap(), ["The customer is [redacted]."]);
}

/// How many times `self_checking`'s finish callback appended its check.
static CHECKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[agent(hooks = [guard_rows, note_signal_rows])]
fn self_checking() -> &'static str {
    use_model("scripted/x");
    use_agent_finish(|ctx| async move {
        if CHECKS.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            ctx.append(Signal::new("check", "A forbidden check."))?;
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    });
    "S"
}

/// A signal a `use_agent_finish` callback appends that `before_create_message` refuses is not
/// stored, and nothing answers it: the response ends with the answer it has.
#[tokio::test]
async fn a_finish_append_a_create_hook_refuses_is_not_stored_and_continues_nothing() {
    let model = ScriptedModel::new([ScriptedReply::text("Done."), ScriptedReply::text("Checked.")]);
    let runtime = runtime_with(&model, vec![self_checking.into()]);
    let reply = runtime.init(&self_checking, "s").send("go").await.unwrap();
    assert_eq!(reply.text, "Done.");
    assert_eq!(model.requests().len(), 1, "no continuation");
    let batches = runtime
        .store()
        .read(&InstanceKey::new("self_checking", "s"), None)
        .await
        .unwrap();
    let stored_signals = batches
        .iter()
        .flat_map(|batch| batch.records.iter())
        .filter(|record| matches!(record.body, RecordBody::Signal { .. } | RecordBody::AgentFinishCycle))
        .count();
    assert_eq!(stored_signals, 0, "neither the signal nor a finish cycle is stored");
}
