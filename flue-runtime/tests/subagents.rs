//! Delegation through the `task` tool: the roster, child sessions, inheritance, the depth cap,
//! instance limits and `after_subagent_created` (issue 8, item 1).
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use std::sync::Mutex;

use flue_runtime::MAX_DELEGATION_DEPTH;
use flue_runtime::events::{Event, Observation};
use flue_runtime::prelude::*;
use flue_runtime::provider::{ModelMessage, ModelRequest};
use flue_runtime::testing::{ScriptedModel, ScriptedReply, instructions_of};
use serde_json::json;

mod harness;
use harness::{Renders, runtime_with};

fn tool_result(request: &ModelRequest) -> (String, bool) {
    request
        .messages
        .iter()
        .rev()
        .find_map(|message| match message {
            ModelMessage::Tool { content, is_error, .. } => Some((content.clone(), *is_error)),
            _ => None,
        })
        .expect("a tool result")
}

/// Count the words of a text.
#[tool]
async fn count_words(
    /// The text
    text: String,
) -> String {
    text.split_whitespace().count().to_string()
}

fn summarizer(_: AgentProps<'_>) -> &'static str {
    use_tool(count_words);
    "You summarize support cases in three sentences."
}

fn auditor(_: AgentProps<'_>) -> &'static str {
    "You audit."
}

#[agent]
fn case_agent() -> &'static str {
    use_model("scripted/parent-model");
    use_subagent(Subagent::new(
        "summarizer",
        "Summarizes one support case.",
        FnAgent::new(AgentDefinition::new("summarizer"), summarizer),
    ));
    use_subagent(
        Subagent::new(
            "auditor",
            "Audits quietly.",
            FnAgent::new(AgentDefinition::new("auditor"), auditor),
        )
        .hidden(),
    );
    "Investigate the case. Delegate the summary."
}

#[agent]
fn plain_agent() -> &'static str {
    use_model("scripted/parent-model");
    "No delegates."
}

#[tokio::test]
async fn a_task_runs_the_delegate_in_a_fresh_context_and_returns_only_its_final_answer() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call(
            "task",
            json!({"agent": "summarizer", "prompt": "Summarize case 42: the printer is on fire.", "description": "summary"}),
        ),
        // The child: one tool call of its own, then its answer.
        ScriptedReply::tool_call("count_words", json!({"text": "the printer is on fire"})),
        ScriptedReply::text("Case 42: a printer fire (5 words)."),
        ScriptedReply::text("Done: a printer fire."),
    ]);
    let runtime = runtime_with(&model, vec![case_agent.into()]);
    let mut events = runtime.observe();
    let reply = runtime
        .init(&case_agent, "case-1")
        .send("Look at case 42.")
        .await
        .unwrap();
    assert_eq!(reply.text, "Done: a printer fire.");
    let requests = model.requests();
    assert_eq!(requests.len(), 4);

    // The parent sees the task tool (after its own tools) and the roster, without the hidden
    // delegate.
    let parent = &requests[0];
    assert_eq!(parent.tools.last().unwrap().name, "task");
    let system = parent.system.as_deref().unwrap();
    assert!(
        system.starts_with("Investigate the case. Delegate the summary.\n\n## Available Agents"),
        "{system}"
    );
    assert!(
        system.contains("- **summarizer** — Summarizes one support case."),
        "{system}"
    );
    assert!(
        !system.contains("auditor"),
        "a hidden relationship is not offered: {system}"
    );
    let schema = &parent.tools.last().unwrap().parameters;
    assert_eq!(schema["required"], json!(["agent", "prompt"]), "{schema}");

    // The child: its own instructions and tools, only the prompt, the parent's model.
    let child = &requests[1];
    assert_eq!(child.model, "parent-model");
    assert_eq!(
        instructions_of(child.system.as_deref()),
        Some("You summarize support cases in three sentences.")
    );
    assert_eq!(
        child.messages,
        [ModelMessage::user("Summarize case 42: the printer is on fire.")]
    );
    assert_eq!(
        child.tools.iter().map(|tool| &*tool.name).collect::<Vec<_>>(),
        ["count_words", "task"],
        "the child has its own tools and an inert task tool"
    );
    assert_eq!(tool_result(&requests[2]), ("5".to_owned(), false));

    // Only the final answer returns to the parent.
    assert_eq!(
        tool_result(&requests[3]),
        ("Case 42: a printer fire (5 words).".to_owned(), false)
    );
    let mut tasks = Vec::new();
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            Event::TaskStart {
                agent,
                description,
                prompt,
                ..
            } => tasks.push(format!("start {agent} {description:?} {prompt:?}")),
            Event::Task {
                agent,
                is_error,
                result,
                ..
            } => tasks.push(format!("end {agent} {is_error} {result:?}")),
            _ => {}
        }
    }
    // Reference §7.2: `task_start {taskId, prompt, agent?}`, `task {taskId, agent?, isError,
    // result?, durationMs}`.
    assert_eq!(
        tasks,
        [
            "start summarizer Some(\"summary\") \"Summarize case 42: the printer is on fire.\"",
            "end summarizer false Some(\"Case 42: a printer fire (5 words).\")"
        ]
    );
}

#[agent]
fn short_parent() -> &'static str {
    use_model("scripted/x");
    use_subagent(Subagent::new(
        "counter",
        "Counts words, in one step.",
        FnAgent::new(AgentDefinition::new("counter").max_steps(1), |_: AgentProps<'_>| {
            use_tool(count_words);
            "You count words."
        }),
    ));
    "Delegate the counting."
}

/// A child whose step budget runs out after a tool step has said nothing: the parent's model
/// reads a line saying so, not an empty tool result.
#[tokio::test]
async fn a_task_whose_child_ended_without_text_answers_with_a_line_saying_so() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("task", json!({"agent": "counter", "prompt": "Count: a b c."})),
        ScriptedReply::tool_call("count_words", json!({"text": "a b c"})),
        ScriptedReply::text("Done."),
    ]);
    let runtime = runtime_with(&model, vec![short_parent.into()]);
    let reply = runtime.init(&short_parent, "s-1").send("Count.").await.unwrap();
    assert_eq!(reply.text, "Done.");
    let requests = model.requests();
    assert_eq!(
        tool_result(&requests[2]),
        ("(task completed with no text)".to_owned(), false)
    );
}

/// Reference §7.1: a task's child session publishes its own operation (`operation_start`,
/// `agent_start`, input, turns, deltas, tool events, `agent_end`, `operation` with what the
/// prompt returned, `idle`), each observation correlated with the task (`taskId`), the child's
/// operation (`operationId`, not the parent's) and the child's turn (`turnId`). The parent's
/// own events carry no task id.
#[tokio::test]
async fn a_tasks_child_session_is_observed_turn_by_turn_under_the_tasks_id() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("task", json!({"agent": "summarizer", "prompt": "Summarize case 7."})),
        ScriptedReply::tool_call("count_words", json!({"text": "a broken hinge"})),
        ScriptedReply::text("Case 7: a broken hinge."),
        ScriptedReply::text("Done."),
    ]);
    let runtime = runtime_with(&model, vec![case_agent.into()]);
    let mut events = runtime.observe();
    runtime
        .init(&case_agent, "case-7")
        .send("Look at case 7.")
        .await
        .unwrap();
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        seen.push(observation);
    }
    let task_id = seen
        .iter()
        .find_map(|observation| match &observation.event {
            Event::TaskStart { task_id, .. } => Some(task_id.clone()),
            _ => None,
        })
        .unwrap();
    let start = seen
        .iter()
        .position(|observation| matches!(observation.event, Event::TaskStart { .. }))
        .unwrap();
    let end = seen
        .iter()
        .position(|observation| matches!(observation.event, Event::Task { .. }))
        .unwrap();
    // Everything the child published lies between the task's start and end, and only that.
    let child: Vec<_> = seen
        .iter()
        .enumerate()
        .filter(|(_, observation)| observation.task_id.is_some())
        .collect();
    assert!(child.iter().all(|(index, observation)| {
        start < *index && *index < end && observation.task_id.as_deref() == Some(task_id.as_str())
    }));
    let mut names: Vec<String> = Vec::new();
    for (_, observation) in &child {
        let name = serde_json::to_value(&observation.event).unwrap()["type"]
            .as_str()
            .unwrap()
            .to_owned();
        // Deltas collapse: how many a reply streams is the provider's business.
        if name.ends_with("_delta") && names.last() == Some(&name) {
            continue;
        }
        names.push(name);
    }
    assert_eq!(
        names,
        [
            "operation_start",
            "agent_start",
            "message_start",
            "message_end",
            "turn_start",
            "turn_request",
            "message_start",
            "toolcall_delta",
            "turn",
            "message_end",
            "tool_start",
            "message_start",
            "message_end",
            "tool",
            "turn_messages",
            "turn_start",
            "turn_request",
            "message_start",
            "text_delta",
            "turn",
            "message_end",
            "turn_messages",
            "agent_end",
            "operation",
            "idle",
        ]
    );
    // The child's operation is its own, and returns its answer, usage and model.
    let Event::OperationStart { operation_id, .. } = &child[0].1.event else {
        unreachable!()
    };
    assert!(operation_id.starts_with("op_"), "{operation_id}");
    assert_ne!(
        Some(operation_id),
        seen[start].operation_id.as_ref(),
        "not the parent's"
    );
    assert!(
        child
            .iter()
            .all(|(_, observation)| observation.operation_id.as_ref() == Some(operation_id)),
        "every child event is of the child's operation"
    );
    let Event::Operation {
        operation_id: ended,
        is_error: false,
        result: Some(result),
        usage: Some(_),
        ..
    } = &child[child.len() - 2].1.event
    else {
        panic!("the child's operation: {:?}", child[child.len() - 2].1.event)
    };
    assert_eq!(ended, operation_id);
    assert_eq!(result["text"], "Case 7: a broken hinge.");
    assert_eq!(result["model"], "scripted/parent-model", "{result}");
    assert!(result["usage"].is_object(), "{result}");
    // The child's agent_end carries its messages: the prompt, its two steps, its tool result.
    let child_end = child
        .iter()
        .find_map(|(_, observation)| match &observation.event {
            Event::AgentEnd { messages } => Some(messages.clone()),
            _ => None,
        })
        .unwrap();
    let roles: Vec<&str> = child_end.iter().map(ModelMessage::role).collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant"]);
    assert_eq!(child_end[0], ModelMessage::user("Summarize case 7."));
    // Each child event carries its own turn's id (from its turn_start), never the parent's.
    let parent_turns: Vec<String> = seen[..start]
        .iter()
        .filter_map(|observation| match &observation.event {
            Event::TurnStart { turn_id, .. } => Some(turn_id.clone()),
            _ => None,
        })
        .collect();
    let mut current = None;
    let mut child_turns = Vec::new();
    // The session's own events (its operation's start and end, input) belong to no turn.
    let (outside, turns) = (&child[..4], &child[4..child.len() - 3]);
    for (_, observation) in outside.iter().chain(&child[child.len() - 3..]) {
        assert_eq!(observation.turn_id, None, "{:?}", observation.event);
    }
    for (_, observation) in turns {
        if let Event::TurnStart { turn_id, step, .. } = &observation.event {
            current = Some(turn_id.clone());
            child_turns.push((turn_id.clone(), *step));
        }
        assert_eq!(observation.turn_id, current, "{:?}", observation.event);
        assert!(!parent_turns.contains(observation.turn_id.as_ref().unwrap()));
    }
    assert_eq!(child_turns.iter().map(|(_, step)| *step).collect::<Vec<_>>(), [1, 2]);
    assert_ne!(child_turns[0].0, child_turns[1].0);
    // The child's tool results are reported once committed, with its turn's messages.
    let Some((_, first_turn)) = child
        .iter()
        .find(|(_, observation)| matches!(observation.event, Event::TurnMessages { .. }))
    else {
        unreachable!()
    };
    let Event::TurnMessages { tool_results, .. } = &first_turn.event else {
        unreachable!()
    };
    assert!(
        matches!(&tool_results[..], [ModelMessage::Tool { name, content, is_error: false, .. }] if name == "count_words" && content == "3"),
        "{tool_results:?}"
    );
    assert!(
        seen[start].task_id.is_none() && seen[end].task_id.is_none(),
        "the task's own events are the parent's"
    );
}

#[tokio::test]
async fn without_delegates_the_task_tool_stays_in_the_tool_block_and_the_roster_says_none() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("task", json!({"agent": "anyone", "prompt": "help"})),
        ScriptedReply::text("hi"),
    ]);
    let runtime = runtime_with(&model, vec![plain_agent.into()]);
    runtime.init(&plain_agent, "p").send("hello").await.unwrap();
    let requests = model.requests();
    let tools: Vec<&str> = requests[0].tools.iter().map(|tool| &*tool.name).collect();
    assert_eq!(tools, ["task"], "the same tool block as an agent with delegates");
    let system = requests[0].system.as_deref().unwrap();
    assert!(
        system.starts_with("No delegates.\n\n## Available Agents\n\nNone:"),
        "{system}"
    );
    assert_eq!(
        tool_result(&requests[1]),
        (
            "Subagent \"anyone\" is not declared. Available subagents: (none).".to_owned(),
            false
        )
    );
}

#[tokio::test]
async fn an_agent_outside_the_roster_gets_a_factual_miss_not_an_error() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("task", json!({"agent": "auditor", "prompt": "audit"})),
        ScriptedReply::text("ok"),
    ]);
    let runtime = runtime_with(&model, vec![case_agent.into()]);
    runtime.init(&case_agent, "c").send("go").await.unwrap();
    assert_eq!(
        tool_result(&model.requests()[1]),
        (
            "Subagent \"auditor\" is not declared. Available subagents: summarizer.".to_owned(),
            false
        )
    );
}

// ---- overrides, the general delegate, render failures -----------------------------------------

fn needs_a_model(_: AgentProps<'_>) -> &'static str {
    use_model("scripted/not-allowed");
    "never"
}

#[agent]
fn overriding() -> &'static str {
    use_model("scripted/parent-model");
    use_subagent(Subagent::general().model("scripted/small-model"));
    use_subagent(Subagent::new(
        "broken",
        "Declares a model in a subagent render.",
        FnAgent::new(AgentDefinition::new("broken"), needs_a_model),
    ));
    "Fan out."
}

#[tokio::test]
async fn a_model_override_applies_to_the_child_and_a_failing_render_is_an_error_result() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([
            (
                "task",
                json!({"agent": "flue-general", "prompt": "Find the config file."}),
            ),
            ("task", json!({"agent": "broken", "prompt": "x"})),
        ]),
        ScriptedReply::text("It is config.toml."),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![overriding.into()]);
    runtime.init(&overriding, "o").send("go").await.unwrap();
    let requests = model.requests();
    let general = requests.iter().find(|request| request.model == "small-model").unwrap();
    assert_eq!(
        instructions_of(general.system.as_deref()),
        None,
        "the general delegate has no instructions"
    );
    assert_eq!(general.tools.len(), 1, "only its inert task tool");
    let results: Vec<(String, bool)> = requests
        .last()
        .unwrap()
        .messages
        .iter()
        .filter_map(|message| match message {
            ModelMessage::Tool { content, is_error, .. } => Some((content.clone(), *is_error)),
            _ => None,
        })
        .collect();
    assert_eq!(results[0], ("It is config.toml.".to_owned(), false));
    assert!(results[1].1, "{results:?}");
    assert!(
        results[1].0.starts_with(
            "The \"broken\" agent could not render: [flue] use_model() is not available in a subagent render."
        ),
        "{results:?}"
    );
}

// ---- the depth cap ----------------------------------------------------------------------------

fn recursive(_: AgentProps<'_>) -> &'static str {
    use_subagent(Subagent::new(
        "deeper",
        "Goes one level deeper.",
        FnAgent::new(AgentDefinition::new("deeper"), recursive),
    ));
    "Delegate deeper."
}

#[agent]
fn diver() -> &'static str {
    use_model("scripted/x");
    use_subagent(Subagent::new(
        "deeper",
        "Goes one level deeper.",
        FnAgent::new(AgentDefinition::new("deeper"), recursive),
    ));
    "Dive."
}

#[tokio::test]
async fn delegation_stops_at_four_levels_with_delegation_depth_exceeded() {
    let delegate = || ScriptedReply::tool_call("task", json!({"agent": "deeper", "prompt": "deeper"}));
    let mut replies: Vec<ScriptedReply> = (0..=MAX_DELEGATION_DEPTH).map(|_| delegate()).collect();
    replies.extend((0..=MAX_DELEGATION_DEPTH).map(|level| ScriptedReply::text(format!("level {level}"))));
    let model = ScriptedModel::new(replies);
    let runtime = runtime_with(&model, vec![diver.into()]);
    runtime.init(&diver, "d").send("dive").await.unwrap();
    let requests = model.requests();
    assert_eq!(requests.len(), 2 * (MAX_DELEGATION_DEPTH as usize + 1));
    // The fifth `task` (made at depth 4) was refused.
    let deepest = &requests[MAX_DELEGATION_DEPTH as usize + 1];
    let (content, is_error) = tool_result(deepest);
    assert!(is_error);
    assert_eq!(content, "Maximum delegation depth (4) exceeded.");
    // The session at the limit is told no agent is there to delegate to; the one above it
    // still lists its delegate.
    let system = |index: usize| requests[index].system.clone().unwrap_or_default();
    assert!(system(MAX_DELEGATION_DEPTH as usize).contains("as deep as delegation goes"));
    assert!(system(MAX_DELEGATION_DEPTH as usize - 1).contains("- **deeper**"));
}

// ---- max_instances and after_subagent_created -------------------------------------------------

static CREATED: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[hook(after_subagent_created)]
async fn note_child(parent: &ThreadState, child: &ThreadState) {
    CREATED.lock().unwrap().push(format!(
        "{} created {} ({}) prompt={}",
        parent.thread_id(),
        child.agent_id(),
        child.thread_id().starts_with("task_"),
        child.arguments()["prompt"]
    ));
}

/// Takes a moment.
#[tool]
async fn nap() -> String {
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    "rested".into()
}

fn slow_summarizer(_: AgentProps<'_>) -> &'static str {
    use_tool(nap);
    "You summarize, slowly."
}

#[agent(hooks = [note_child])]
fn limited() -> &'static str {
    use_model("scripted/x");
    use_subagent(
        Subagent::new(
            "summarizer",
            "Summarizes.",
            FnAgent::new(AgentDefinition::new("summarizer"), slow_summarizer),
        )
        .max_instances(1),
    );
    "L"
}

#[tokio::test]
async fn max_instances_caps_running_tasks_and_after_subagent_created_runs_on_the_parent() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([
            ("task", json!({"agent": "summarizer", "prompt": "one"})),
            ("task", json!({"agent": "summarizer", "prompt": "two"})),
        ]),
        // The first task's child naps (still running when the second task starts), then answers.
        ScriptedReply::tool_call("nap", json!({})),
        ScriptedReply::text("summary"),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, vec![limited.into()]);
    runtime.init(&limited, "parent-9").send("go").await.unwrap();
    let requests = model.requests();
    assert_eq!(requests.len(), 4, "one child session ran");
    let results: Vec<(String, bool)> = requests[3]
        .messages
        .iter()
        .filter_map(|message| match message {
            ModelMessage::Tool { content, is_error, .. } => Some((content.clone(), *is_error)),
            _ => None,
        })
        .collect();
    assert_eq!(
        results.iter().filter(|(_, is_error)| !is_error).count(),
        1,
        "{results:?}"
    );
    assert!(
        results
            .iter()
            .any(|(content, is_error)| *is_error && content.starts_with("Subagent instance limit reached")),
        "{results:?}"
    );
    let created = CREATED.lock().unwrap().clone();
    assert_eq!(created.len(), 1, "{created:?}");
    assert!(
        created[0].starts_with("parent-9 created summarizer (true) prompt="),
        "{created:?}"
    );
}

static NESTED_FROM_HOOKS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Starts another task of the parent's from the creation of each child: through the root's
/// delegation, from deeper and deeper child sessions (stopping on its own after ten, so the
/// test ends however deep it goes).
#[hook(after_subagent_created, id = "task_from_creation")]
async fn task_from_creation(parent: &ThreadState, _child: &ThreadState) {
    if NESTED_FROM_HOOKS.lock().unwrap().len() >= 10 {
        return;
    }
    let result = parent
        .invoke_tool("task", json!({"agent": "helper", "prompt": "Go deeper."}))
        .await
        .unwrap();
    let text = result.error.or(result.result).unwrap_or_default();
    NESTED_FROM_HOOKS.lock().unwrap().push(text);
}

#[agent(hooks = [task_from_creation])]
fn hooked_delegator() -> &'static str {
    use_model("scripted/x");
    use_subagent(helper_delegate());
    "Delegate."
}

fn helper_delegate() -> Subagent {
    Subagent::new(
        "helper",
        "Helps.",
        FnAgent::new(AgentDefinition::new("helper"), |_: AgentProps<'_>| "You help."),
    )
}

static NESTED_FROM_SPAWNED: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// [`task_from_creation`] from a task the hook spawns (which does not inherit what the hook's
/// own task carries).
#[hook(after_subagent_created, id = "task_from_a_spawned_task")]
async fn task_from_a_spawned_task(parent: &ThreadState, _child: &ThreadState) {
    if NESTED_FROM_SPAWNED.lock().unwrap().len() >= 10 {
        return;
    }
    let parent = parent.clone();
    let result = tokio::spawn(async move {
        parent
            .invoke_tool("task", json!({"agent": "helper", "prompt": "Go deeper."}))
            .await
            .unwrap()
    })
    .await
    .unwrap();
    let text = result.error.or(result.result).unwrap_or_default();
    NESTED_FROM_SPAWNED.lock().unwrap().push(text);
}

#[agent(hooks = [task_from_a_spawned_task])]
fn spawning_delegator() -> &'static str {
    use_model("scripted/x");
    use_subagent(helper_delegate());
    "Delegate."
}

/// A task started from within a child session through the parent's delegation (a hook of the
/// child's creation invoking the parent's `task` tool) counts its depth from the session it
/// starts in: the nesting stops at the delegation depth limit instead of going on without
/// bound, each level one session deeper.
#[tokio::test]
async fn tasks_started_from_a_childs_creation_hook_are_held_to_the_delegation_depth() {
    nested_from_hooks_stop_at_the_depth_limit(hooked_delegator.into(), &NESTED_FROM_HOOKS).await;
}

/// The same from a task the hook spawned: the depth travels with the thread state the hook
/// was given, not with the task that runs it.
#[tokio::test]
async fn tasks_a_creation_hook_starts_from_a_task_it_spawned_are_held_to_the_delegation_depth() {
    nested_from_hooks_stop_at_the_depth_limit(spawning_delegator.into(), &NESTED_FROM_SPAWNED).await;
}

async fn nested_from_hooks_stop_at_the_depth_limit(agent: AgentRef, log: &Mutex<Vec<String>>) {
    let depth = MAX_DELEGATION_DEPTH as usize;
    let mut replies = vec![ScriptedReply::tool_call(
        "task",
        json!({"agent": "helper", "prompt": "Help."}),
    )];
    // Each child session answers once (the deepest first), then the root.
    replies.extend((0..depth).map(|level| ScriptedReply::text(format!("answer {level}"))));
    replies.push(ScriptedReply::text("done"));
    let model = ScriptedModel::new(replies);
    let name = agent.get().definition().name.to_string();
    let runtime = runtime_with(&model, vec![agent]);
    // Nesting past the limit would outrun the script: the send would not end.
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        runtime.handle(&name, "h-1").unwrap().send("go"),
    )
    .await
    .expect("the nesting ends")
    .unwrap();
    assert_eq!(reply.text, "done");
    let nested = log.lock().unwrap().clone();
    assert_eq!(nested.len(), depth, "one task from each child's creation: {nested:?}");
    assert_eq!(
        nested[0],
        format!("Maximum delegation depth ({MAX_DELEGATION_DEPTH}) exceeded."),
        "the deepest child's hook was refused: {nested:?}"
    );
    assert_eq!(
        model.requests().len(),
        depth + 2,
        "{depth} child sessions and the root's two calls"
    );
}

// ---------------------------------------------------------------------------------------------
// Durable child sessions: a task's child conversation is a record stream of its own, linked
// from the parent's stream; a task re-run after a crash reattaches to it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use flue_runtime::record::Record;
use flue_runtime::store::{InstanceKey, MemoryStore, SqliteStore, Store};
use harness::faulty::FaultyStore;
use serde_json::Value;

/// A store whose first append matching a predicate fails (the process "crashed" between the
/// work the batch records and its commit); the attempt is re-run from what is durable.
fn crashing(
    inner: Box<dyn Store>,
    predicate: impl Fn(&InstanceKey, &[Record]) -> bool + Send + 'static,
) -> FaultyStore {
    let store = FaultyStore::on(Arc::from(inner));
    store.fail_once_in(predicate);
    store
}

/// The stores every durable-task test runs on.
fn backends() -> Vec<(&'static str, Box<dyn Store>)> {
    vec![
        ("memory", Box::new(MemoryStore::new())),
        ("sqlite", Box::new(SqliteStore::in_memory().unwrap())),
    ]
}

/// The records of `key`'s stream, as their JSON.
async fn stream_json(store: &Arc<dyn Store>, key: &InstanceKey) -> Vec<Value> {
    store
        .read(key, None)
        .await
        .unwrap()
        .into_iter()
        .flat_map(|batch| batch.records.to_vec())
        .map(|record| serde_json::to_value(record).unwrap())
        .collect()
}

fn of_type<'a>(records: &'a [Value], kind: &str) -> Vec<&'a Value> {
    records.iter().filter(|record| record["type"] == kind).collect()
}

/// A batch that commits a tool batch answering calls of `tool`.
fn commits_calls_of(tool: &'static str) -> impl Fn(&InstanceKey, &[Record]) -> bool + Send + Sync {
    move |_, records| {
        let json: Vec<Value> = records
            .iter()
            .map(|record| serde_json::to_value(record).unwrap())
            .collect();
        json.iter().any(|record| record["type"] == "tool_results_committed")
            && json
                .iter()
                .any(|record| record["type"] == "tool_outcome" && record["tool_name"] == tool)
    }
}

/// The link the parent's stream keeps to its one task child, and the child's key.
async fn the_child(store: &Arc<dyn Store>, parent: &InstanceKey) -> (Value, InstanceKey) {
    let records = stream_json(store, parent).await;
    let links = of_type(&records, "child_session_retained");
    assert_eq!(links.len(), 1, "one child conversation: {records:#?}");
    let link = links[0].clone();
    let child = InstanceKey::new(
        link["child"]["agent"].as_str().unwrap(),
        link["child"]["id"].as_str().unwrap(),
    );
    (link, child)
}

static TALLIES: [AtomicUsize; 5] = [
    AtomicUsize::new(0),
    AtomicUsize::new(0),
    AtomicUsize::new(0),
    AtomicUsize::new(0),
    AtomicUsize::new(0),
];

/// The slot whose parent also declares an optional MCP server that is down.
const DOWN_MCP_SLOT: usize = 4;

/// A delegate with a counted tool (`tally`), counting into `TALLIES[slot]`.
fn tallying_delegate(slot: usize) -> Subagent {
    Subagent::new(
        "tallier",
        "Tallies words.",
        FnAgent::new(AgentDefinition::new("tallier"), move |_: AgentProps<'_>| {
            use_tool(Tool::new("tally").description("Tally the words.").run(
                move |_ctx, _: serde_json::Map<String, Value>| async move {
                    TALLIES[slot].fetch_add(1, Ordering::SeqCst);
                    Ok::<_, ToolError>("7 words")
                },
            ));
            "You tally words."
        }),
    )
}

fn tallying_parent(slot: usize, down_mcp: bool) -> impl Fn(AgentProps<'_>) -> &'static str + Send + Sync + 'static {
    move |_| {
        use_model("scripted/parent-model");
        use_subagent(tallying_delegate(slot));
        if down_mcp {
            // An optional server nothing listens on: each attempt narrates it unavailable.
            use_mcp_connection(McpConnection::new("docs", "http://127.0.0.1:9/mcp").optional());
        }
        "Delegate the tally."
    }
}

fn tallying_agent(name: &'static str, slot: usize) -> AgentRef {
    FnAgent::new(AgentDefinition::new(name), tallying_parent(slot, false)).into()
}

/// The delegation every durable-task test scripts: the parent's task call, the child's tool
/// call and answer, the parent's answer.
fn tallying_script() -> ScriptedModel {
    ScriptedModel::new([
        ScriptedReply::tool_call("task", json!({"agent": "tallier", "prompt": "Tally: one two three."})),
        ScriptedReply::tool_call("tally", json!({})),
        ScriptedReply::text("Seven words."),
        ScriptedReply::text("The tally is seven."),
    ])
}

#[tokio::test]
async fn a_task_records_its_child_conversation_in_its_own_stream_linked_from_the_parent() {
    for (name, backend) in backends() {
        let model = tallying_script();
        let runtime = harness::runtime_on(
            FaultyStore::on(Arc::from(backend)),
            &model,
            vec![tallying_agent("ledger", 0)],
        );
        let reply = runtime
            .handle("ledger", "l-1")
            .unwrap()
            .send("Tally it.")
            .await
            .unwrap();
        assert_eq!(reply.text, "The tally is seven.", "{name}");
        let store = runtime.store().clone();
        let parent = InstanceKey::new("ledger", "l-1");
        let parent_records = stream_json(&store, &parent).await;

        // The parent links the child from the task call's id; the link comes before the
        // batch that answers the call.
        let (link, child) = the_child(&store, &parent).await;
        let task_call = of_type(&parent_records, "assistant_tool_call")
            .into_iter()
            .find(|record| record["name"] == "task")
            .unwrap();
        assert_eq!(link["parent_tool_call_id"], task_call["tool_call_id"], "{name}: {link}");
        assert_eq!(link["kind"], "task", "{name}");
        let task_id = link["task_id"].as_str().unwrap();
        assert!(task_id.starts_with("task_"), "{name}: {link}");
        let at = |record: &Value| parent_records.iter().position(|other| other == record).unwrap();
        let commit = parent_records
            .iter()
            .rposition(|record| record["type"] == "tool_results_committed")
            .unwrap();
        assert!(at(&link) < commit, "{name}");
        // None of the child's turns are in the parent's stream.
        assert!(
            !parent_records
                .iter()
                .any(|record| record["name"] == "tally" || record["tool_name"] == "tally"),
            "{name}: {parent_records:#?}"
        );

        // The child's own stream: its birth (a task conversation of the parent), its prompt,
        // its steps, its tool batch and its answer.
        assert_ne!(
            child.agent, parent.agent,
            "{name}: a child is not an instance of the agent"
        );
        let records = stream_json(&store, &child).await;
        let birth = &records[0];
        assert_eq!(birth["type"], "conversation_created", "{name}");
        assert_eq!(birth["kind"], "task", "{name}");
        assert_eq!(birth["task_id"], task_id, "{name}");
        assert_eq!(birth["agent"], "tallier", "{name}");
        assert_eq!(birth["parent"], json!({"agent": "ledger", "id": "l-1"}), "{name}");
        let kinds: Vec<&str> = records.iter().map(|record| record["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "conversation_created",
                "user_message",
                "assistant_message_started",
                "assistant_tool_call",
                "assistant_message_completed",
                "tool_outcome",
                "tool_results_committed",
                "assistant_message_started",
                "assistant_message_completed",
            ],
            "{name}: {records:#?}"
        );
        assert_eq!(records[1]["body"], "Tally: one two three.", "{name}");
        assert_eq!(records[5]["content"], "7 words", "{name}");
        assert_eq!(records[8]["text"], "Seven words.", "{name}");
    }
}

/// One "Tally it." exchange of `ledger` (counting into `TALLIES[slot]`) on instance `id`,
/// through `backend` failing once the append that commits the calls of `tool`; asserts that
/// the crash happened and the exchange still answered. The runtime, the model, and how many
/// times the tally tool ran.
async fn tally_through_one_crash(
    name: &str,
    backend: Box<dyn Store>,
    slot: usize,
    tool: &'static str,
    id: &str,
) -> (flue_runtime::Runtime, ScriptedModel, usize) {
    let before = TALLIES[slot].load(Ordering::SeqCst);
    let model = tallying_script();
    let store = crashing(backend, commits_calls_of(tool));
    let failures = store.failures.clone();
    let agent = FnAgent::new(
        AgentDefinition::new("ledger"),
        tallying_parent(slot, slot == DOWN_MCP_SLOT),
    )
    .into();
    let runtime = harness::runtime_on(store, &model, vec![agent]);
    let reply = runtime.handle("ledger", id).unwrap().send("Tally it.").await.unwrap();
    assert_eq!(failures.load(Ordering::SeqCst), 1, "{name}: the crash happened");
    assert_eq!(reply.text, "The tally is seven.", "{name}");
    (runtime, model, TALLIES[slot].load(Ordering::SeqCst) - before)
}

#[tokio::test]
async fn a_task_rerun_after_a_crash_reattaches_to_its_child_and_does_not_redo_completed_steps() {
    // The crash comes as the child commits its tool batch: its first step (and the tool) are
    // done, the batch is not. The parent's attempt fails; its re-run of the task call
    // reattaches to the child, which goes on from its durable step.
    for (name, backend) in backends() {
        let (runtime, model, tallied) = tally_through_one_crash(name, backend, 1, "tally", "l-2").await;
        let requests = model.requests();
        assert_eq!(
            requests.len(),
            4,
            "{name}: no model step was taken twice (parent, child, child, parent)"
        );
        // The tool of the interrupted child batch is not durable: it ran once, and the
        // reattached child was told its outcome is unknown.
        assert_eq!(tallied, 1, "{name}");
        assert_eq!(
            harness::last_batch_results(&requests[2]),
            [(
                r#"{"type":"interrupted","message":"Tool execution was interrupted before completion. The outcome is unknown."}"#.to_owned(),
                true
            )],
            "{name}"
        );
        assert_eq!(
            requests[2].messages[0],
            ModelMessage::user("Tally: one two three."),
            "{name}: the child's own history"
        );
        assert_eq!(
            harness::last_batch_results(&requests[3]),
            [("Seven words.".to_owned(), false)],
            "{name}: the parent got the child's answer"
        );
        // One child conversation, its prompt once.
        let store = runtime.store().clone();
        let (_, child) = the_child(&store, &InstanceKey::new("ledger", "l-2")).await;
        let records = stream_json(&store, &child).await;
        assert_eq!(of_type(&records, "conversation_created").len(), 1, "{name}");
        assert_eq!(of_type(&records, "user_message").len(), 1, "{name}");
        assert_eq!(of_type(&records, "assistant_message_completed").len(), 2, "{name}");
    }
}

#[tokio::test]
async fn a_finished_task_rerun_after_a_crash_returns_its_recorded_answer_without_calling_the_model() {
    // The crash comes as the parent commits the batch answering the task call: the child had
    // answered. The re-run reattaches and returns the recorded answer.
    for (name, backend) in backends() {
        let (runtime, model, tallied) = tally_through_one_crash(name, backend, 2, "task", "l-3").await;
        let requests = model.requests();
        assert_eq!(requests.len(), 4, "{name}: the child's model was not called again");
        assert_eq!(tallied, 1, "{name}");
        assert_eq!(
            harness::last_batch_results(&requests[3]),
            [("Seven words.".to_owned(), false)],
            "{name}: the re-run task returned the child's recorded answer"
        );
        let store = runtime.store().clone();
        let (_, child) = the_child(&store, &InstanceKey::new("ledger", "l-3")).await;
        let records = stream_json(&store, &child).await;
        assert_eq!(of_type(&records, "assistant_message_completed").len(), 2, "{name}");
    }
}

#[tokio::test]
async fn a_finished_task_rerun_beside_an_unavailable_optional_mcp_server_returns_its_recorded_answer() {
    // As above, with an optional MCP server down: the re-run attempt narrates it unavailable,
    // which must not close the interrupted batch (and forget its child) before the re-run.
    for (name, backend) in backends() {
        let (runtime, model, tallied) = tally_through_one_crash(name, backend, DOWN_MCP_SLOT, "task", "l-5").await;
        let requests = model.requests();
        assert_eq!(requests.len(), 4, "{name}: the child's model was not called again");
        assert_eq!(tallied, 1, "{name}: the child's tool ran once");
        assert_eq!(
            harness::last_batch_results(&requests[3]),
            [("Seven words.".to_owned(), false)],
            "{name}: the re-run task returned the child's recorded answer"
        );
        let store = runtime.store().clone();
        let parent = stream_json(&store, &InstanceKey::new("ledger", "l-5")).await;
        assert_eq!(of_type(&parent, "child_session_retained").len(), 1, "{name}: one child");
    }
}

#[tokio::test]
async fn child_streams_never_appear_in_the_parents_history_or_as_instances() {
    let model = tallying_script();
    let runtime = harness::runtime_with(&model, vec![tallying_agent("ledger", 0)]);
    runtime
        .handle("ledger", "l-4")
        .unwrap()
        .send("Tally it.")
        .await
        .unwrap();
    let store = runtime.store().clone();
    let (_, child) = the_child(&store, &InstanceKey::new("ledger", "l-4")).await;

    let app = flue_runtime::http::router(&runtime);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let client = reqwest::Client::new();
    let get = |path: String| {
        let client = client.clone();
        async move {
            let response = client.get(format!("http://{addr}{path}")).send().await.unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        }
    };
    let encode = |text: &str| text.replace('%', "%25").replace('/', "%2F").replace(':', "%3A");

    // The parent's history: its input and one assistant message with the task call and the
    // answer; nothing of the child's conversation.
    let (status, body) = get("/agents/ledger/l-4".to_owned()).await;
    assert_eq!(status, 200, "{body}");
    let snapshot: Value = serde_json::from_str(&body).unwrap();
    let messages = snapshot["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 2, "{snapshot:#}");
    // (The task call's input carries the prompt; the child's tool call and result are its own.)
    assert!(!body.contains("\"tally\"") && !body.contains("7 words"), "{body}");
    let (status, updates) = get("/agents/ledger/l-4?view=updates&offset=-1".to_owned()).await;
    assert_eq!(status, 200, "{updates}");
    assert!(
        !updates.contains("\"tally\"") && !updates.contains("7 words"),
        "{updates}"
    );

    // The child's stream is not an instance a client can read, under its key (no such agent)
    // or the parent's agent (no instance id holds "/task_", which names a task's conversation:
    // no stream of the agent's has that id).
    for path in [
        format!("/agents/{}/{}", encode(&child.agent), encode(&child.id)),
        format!("/agents/ledger/{}", encode(&child.id)),
    ] {
        let (status, body) = get(path.clone()).await;
        assert_eq!(status, 404, "{path}: {body}");
        assert!(!body.contains("tally"), "{path}: {body}");
    }
    let catalog = get("/agents".to_owned()).await.1;
    assert!(!catalog.contains(&*child.agent), "{catalog}");
}

static STEP_RUNS: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];

/// A delegate whose durable `refund` tool takes one recorded step (counted in `STEP_RUNS[0]`,
/// every run of the tool in `STEP_RUNS[1]`).
fn refunding_delegate() -> Subagent {
    Subagent::new(
        "refunder",
        "Refunds orders.",
        FnAgent::new(AgentDefinition::new("refunder"), |_: AgentProps<'_>| {
            use_tool(Tool::new("refund").description("Refund the order.").durable().run(
                |ctx, _: serde_json::Map<String, Value>| async move {
                    STEP_RUNS[1].fetch_add(1, Ordering::SeqCst);
                    let refund: String = ctx
                        .step("issue-refund", async {
                            format!("re_{}", STEP_RUNS[0].fetch_add(1, Ordering::SeqCst) + 1)
                        })
                        .await?;
                    Ok::<_, ToolError>(format!("refunded as {refund}"))
                },
            ));
            "You refund orders."
        }),
    )
}

#[tokio::test]
async fn a_durable_tool_in_a_task_child_re_runs_on_reattach_replaying_its_recorded_steps() {
    for (name, backend) in backends() {
        let before = (STEP_RUNS[0].load(Ordering::SeqCst), STEP_RUNS[1].load(Ordering::SeqCst));
        let model = ScriptedModel::new([
            ScriptedReply::tool_call("task", json!({"agent": "refunder", "prompt": "Refund order 9."})),
            ScriptedReply::tool_call("refund", json!({})),
            ScriptedReply::text("Refunded order 9."),
            ScriptedReply::text("Done."),
        ]);
        let agent: AgentRef = FnAgent::new(AgentDefinition::new("shop"), |_: AgentProps<'_>| {
            use_model("scripted/parent-model");
            use_subagent(refunding_delegate());
            "Delegate refunds."
        })
        .into();
        let store = crashing(backend, commits_calls_of("refund"));
        let runtime = harness::runtime_on(store, &model, vec![agent]);
        let reply = runtime.handle("shop", "s-1").unwrap().send("Refund 9.").await.unwrap();
        assert_eq!(reply.text, "Done.", "{name}");
        let requests = model.requests();
        assert_eq!(requests.len(), 4, "{name}");
        // The tool ran again on reattach, its step did not: the re-run's result is real.
        let runs = (
            STEP_RUNS[0].load(Ordering::SeqCst) - before.0,
            STEP_RUNS[1].load(Ordering::SeqCst) - before.1,
        );
        assert_eq!(runs, (1, 2), "{name}: (step runs, tool runs)");
        assert_eq!(
            harness::last_batch_results(&requests[2]),
            [(format!("refunded as re_{}", before.0 + 1), false)],
            "{name}"
        );
        let store = runtime.store().clone();
        let (_, child) = the_child(&store, &InstanceKey::new("shop", "s-1")).await;
        let records = stream_json(&store, &child).await;
        assert_eq!(
            of_type(&records, "tool_step_settled").len(),
            1,
            "{name}: the step, recorded once"
        );
    }
}

static KEPT_RUNS: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];

/// Reference §3.3: a child's call outcome is durable as its tool ends, as the root's. The
/// child's batch of two durable calls loses its commit (with the second call's outcome): on
/// reattach only the second runs again, and the child's stream holds one outcome per call.
#[tokio::test]
async fn a_task_childs_call_whose_outcome_was_recorded_does_not_run_again_on_reattach() {
    for (name, backend) in backends() {
        let before = (KEPT_RUNS[0].load(Ordering::SeqCst), KEPT_RUNS[1].load(Ordering::SeqCst));
        let model = ScriptedModel::new([
            ScriptedReply::tool_call(
                "task",
                json!({"agent": "refunder", "prompt": "Refund orders 9 and 10."}),
            ),
            ScriptedReply::tool_calls([("refund", json!({})), ("refund", json!({}))]),
            ScriptedReply::text("Refunded both."),
            ScriptedReply::text("Done."),
        ]);
        let delegate = Subagent::new(
            "refunder",
            "Refunds orders.",
            FnAgent::new(AgentDefinition::new("refunder"), |_: AgentProps<'_>| {
                use_tool(Tool::new("refund").description("Refund the order.").durable().run(
                    |ctx, _: serde_json::Map<String, Value>| async move {
                        KEPT_RUNS[1].fetch_add(1, Ordering::SeqCst);
                        let refund: String = ctx
                            .step("issue-refund", async {
                                format!("re_{}", KEPT_RUNS[0].fetch_add(1, Ordering::SeqCst) + 1)
                            })
                            .await?;
                        Ok::<_, ToolError>(format!("refunded as {refund}"))
                    },
                ));
                "You refund orders."
            }),
        );
        let agent: AgentRef = FnAgent::new(AgentDefinition::new("shop"), move |_: AgentProps<'_>| {
            use_model("scripted/parent-model");
            use_subagent(delegate.clone());
            "Delegate refunds."
        })
        .into();
        let store = crashing(backend, commits_calls_of("refund"));
        let runtime = harness::runtime_on(store, &model, vec![agent]);
        let reply = runtime
            .handle("shop", "s-2")
            .unwrap()
            .send("Refund 9 and 10.")
            .await
            .unwrap();
        assert_eq!(reply.text, "Done.", "{name}");
        let runs = (
            KEPT_RUNS[0].load(Ordering::SeqCst) - before.0,
            KEPT_RUNS[1].load(Ordering::SeqCst) - before.1,
        );
        assert_eq!(runs, (2, 3), "{name}: (step runs, tool runs)");
        let store = runtime.store().clone();
        let (_, child) = the_child(&store, &InstanceKey::new("shop", "s-2")).await;
        let records = stream_json(&store, &child).await;
        let outcomes: Vec<&str> = of_type(&records, "tool_outcome")
            .iter()
            .map(|record| record["content"].as_str().unwrap())
            .collect();
        assert_eq!(
            outcomes,
            [
                format!("refunded as re_{}", before.0 + 1),
                format!("refunded as re_{}", before.0 + 2)
            ],
            "{name}: one outcome per call, each its first run's"
        );
    }
}

static NESTED_TALLIES: AtomicUsize = AtomicUsize::new(0);

#[tokio::test]
async fn a_nested_task_rerun_reattaches_its_whole_chain_of_children() {
    // parent → task(coordinator) → task(tallier) → tally; the crash comes as the grandchild
    // commits its tool batch.
    for (name, backend) in backends() {
        let before = NESTED_TALLIES.load(Ordering::SeqCst);
        let model = ScriptedModel::new([
            ScriptedReply::tool_call("task", json!({"agent": "coordinator", "prompt": "Get a tally."})),
            ScriptedReply::tool_call("task", json!({"agent": "tallier", "prompt": "Tally: a b."})),
            ScriptedReply::tool_call("tally", json!({})),
            ScriptedReply::text("Two words."),
            ScriptedReply::text("The tallier says two."),
            ScriptedReply::text("Two."),
        ]);
        let agent: AgentRef = FnAgent::new(AgentDefinition::new("chain"), |_: AgentProps<'_>| {
            use_model("scripted/parent-model");
            use_subagent(Subagent::new(
                "coordinator",
                "Coordinates.",
                FnAgent::new(AgentDefinition::new("coordinator"), |_: AgentProps<'_>| {
                    use_subagent(Subagent::new(
                        "tallier",
                        "Tallies words.",
                        FnAgent::new(AgentDefinition::new("tallier"), |_: AgentProps<'_>| {
                            use_tool(Tool::new("tally").description("Tally the words.").run(
                                |_ctx, _: serde_json::Map<String, Value>| async move {
                                    NESTED_TALLIES.fetch_add(1, Ordering::SeqCst);
                                    Ok::<_, ToolError>("2 words")
                                },
                            ));
                            "You tally words."
                        }),
                    ));
                    "You coordinate."
                }),
            ));
            "Delegate."
        })
        .into();
        let store = crashing(backend, commits_calls_of("tally"));
        let failures = store.failures.clone();
        let runtime = harness::runtime_on(store, &model, vec![agent]);
        let reply = runtime.handle("chain", "c-1").unwrap().send("Go.").await.unwrap();
        assert_eq!(failures.load(Ordering::SeqCst), 1, "{name}");
        assert_eq!(reply.text, "Two.", "{name}");
        assert_eq!(model.requests().len(), 6, "{name}: no model step twice");
        assert_eq!(NESTED_TALLIES.load(Ordering::SeqCst) - before, 1, "{name}");
        let store = runtime.store().clone();
        let (_, child) = the_child(&store, &InstanceKey::new("chain", "c-1")).await;
        let (_, grandchild) = the_child(&store, &child).await;
        assert_eq!(grandchild.agent, child.agent, "{name}");
        assert!(
            grandchild.id.starts_with(&format!("{}/task_", child.id)),
            "{name}: {grandchild}"
        );
        let records = stream_json(&store, &grandchild).await;
        assert_eq!(
            of_type(&records, "conversation_created")[0]["parent"]["id"],
            *child.id,
            "{name}"
        );
        assert_eq!(of_type(&records, "assistant_message_completed").len(), 2, "{name}");
    }
}

// ---------------------------------------------------------------------------------------------
// Terminating tools, correlation, hooks, logs, interrupted calls and cwd of delegated tasks.

/// A parent delegating to `delegate`, under the agent name `name`.
fn delegating_agent(name: &'static str, delegate: fn() -> Subagent) -> AgentRef {
    FnAgent::new(AgentDefinition::new(name), move |_: AgentProps<'_>| {
        use_model("scripted/parent-model");
        use_subagent(delegate());
        "Delegate the work."
    })
    .into()
}

/// A delegate whose only tool terminates its run.
fn closing_delegate() -> Subagent {
    Subagent::new(
        "closer",
        "Closes cases.",
        FnAgent::new(AgentDefinition::new("closer"), |_: AgentProps<'_>| {
            use_tool(
                Tool::new("close_case")
                    .description("Close the case.")
                    .terminate()
                    .run(|_ctx, _: serde_json::Map<String, Value>| async move { Ok::<_, ToolError>("case closed") }),
            );
            "You close cases."
        }),
    )
}

/// Reference §1 item 12: "Turn ends after the batch iff every result in the batch terminates"
/// (as at the root: `a_batch_of_only_terminating_tools_ends_the_turn_without_another_model_call`).
/// A delegate's terminating tool ends the child's run: its answer is what the tool returned
/// (the step had no text).
#[tokio::test]
async fn a_terminating_tool_batch_ends_the_delegates_run_without_another_model_call() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("task", json!({"agent": "closer", "prompt": "Close case 5."})),
        ScriptedReply::tool_call("close_case", json!({})),
        // Only reached when the child is (wrongly) called again after its terminating batch.
        ScriptedReply::text("child spoke again"),
        ScriptedReply::text("Done."),
        ScriptedReply::text("Done."),
    ]);
    let runtime = runtime_with(&model, vec![delegating_agent("desk_closer", closing_delegate)]);
    runtime
        .handle("desk_closer", "d-1")
        .unwrap()
        .send("Close 5.")
        .await
        .unwrap();
    let requests = model.requests();
    let child_calls = requests
        .iter()
        .filter(|request| instructions_of(request.system.as_deref()) == Some("You close cases."))
        .count();
    assert_eq!(
        child_calls, 1,
        "the child's terminating batch ended its run; it was called {child_calls} times"
    );
    let task_result = harness::tool_results(&requests[2]);
    assert_eq!(task_result[0].0, "case closed");
}

/// The tallier of the chain below (its tool counts nothing).
fn quiet_tallier() -> Subagent {
    Subagent::new(
        "tallier",
        "Tallies words.",
        FnAgent::new(AgentDefinition::new("tallier"), |_: AgentProps<'_>| {
            use_tool(
                Tool::new("tally")
                    .description("Tally the words.")
                    .run(|_ctx, _: serde_json::Map<String, Value>| async move { Ok::<_, ToolError>("2 words") }),
            );
            "You tally words."
        }),
    )
}

fn coordinator() -> Subagent {
    Subagent::new(
        "coordinator",
        "Coordinates.",
        FnAgent::new(AgentDefinition::new("coordinator"), |_: AgentProps<'_>| {
            use_subagent(quiet_tallier());
            "You coordinate."
        }),
    )
}

fn chain_script() -> ScriptedModel {
    ScriptedModel::new([
        ScriptedReply::tool_call("task", json!({"agent": "coordinator", "prompt": "Get a tally."})),
        ScriptedReply::tool_call("task", json!({"agent": "tallier", "prompt": "Tally: a b."})),
        ScriptedReply::tool_call("tally", json!({})),
        ScriptedReply::text("Two words."),
        ScriptedReply::text("The tallier says two."),
        ScriptedReply::text("Two."),
    ])
}

/// Reference §7.1: an observation's correlation (`taskId`, `turnId`) is its emitting
/// context's. A nested `task_start`/`task` comes from the coordinator's child session (whose
/// `tool_start` for that very `task` call carries the coordinator's task id), so it carries
/// the coordinator's task id and turn.
#[tokio::test]
async fn a_nested_tasks_start_and_end_are_correlated_with_the_task_that_delegated() {
    let model = chain_script();
    let runtime = runtime_with(&model, vec![delegating_agent("chain_obs", coordinator)]);
    let mut events = runtime.observe();
    runtime.handle("chain_obs", "c-2").unwrap().send("Go.").await.unwrap();
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        seen.push(observation);
    }
    let starts: Vec<_> = seen
        .iter()
        .filter(|observation| matches!(observation.event, Event::TaskStart { .. }))
        .collect();
    assert_eq!(starts.len(), 2);
    let Event::TaskStart { task_id: outer, .. } = &starts[0].event else {
        unreachable!()
    };
    // The coordinator's own tool_start for its `task` call: in the coordinator's context.
    let nested_call = seen
        .iter()
        .find(|observation| {
            matches!(&observation.event, Event::ToolStart { tool_name, .. } if tool_name == "task")
                && observation.task_id.is_some()
        })
        .unwrap();
    assert_eq!(nested_call.task_id.as_ref(), Some(outer));
    let ends: Vec<_> = seen
        .iter()
        .filter(|observation| matches!(observation.event, Event::Task { .. }))
        .collect();
    assert_eq!(
        (starts[1].task_id.as_ref(), starts[1].turn_id.as_ref()),
        (Some(outer), nested_call.turn_id.as_ref()),
        "the nested task_start belongs to the coordinator's session and turn"
    );
    assert_eq!(ends[0].task_id.as_ref(), Some(outer), "the nested task end likewise");
}

/// Reference §7.2: `task_start` carries the `toolCallId` of the `task` call that started it,
/// which ties a task to its call (several tasks run in parallel in one turn).
#[tokio::test]
async fn task_start_names_the_tool_call_that_started_it() {
    let model = chain_script();
    let runtime = runtime_with(&model, vec![delegating_agent("chain_ids", coordinator)]);
    let mut events = runtime.observe();
    runtime.handle("chain_ids", "c-3").unwrap().send("Go.").await.unwrap();
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        seen.push(observation);
    }
    let call_id = seen
        .iter()
        .find_map(|observation| match &observation.event {
            Event::ToolStart {
                tool_name,
                tool_call_id,
            } if tool_name == "task" => Some(tool_call_id.clone()),
            _ => None,
        })
        .unwrap();
    let start = seen
        .iter()
        .find(|observation| matches!(observation.event, Event::TaskStart { .. }))
        .unwrap();
    let json = serde_json::to_value(start).unwrap();
    assert_eq!(json["event"]["toolCallId"], json!(call_id), "{json:#}");
}

#[hook(before_store_tool_result)]
async fn redact_email(_state: &ThreadState, _call: &ToolCall, result: ToolResult) -> ToolResult {
    ToolResult {
        result: result
            .result
            .map(|text| text.replace("jane@example.com", "[email redacted]")),
        ..result
    }
}

/// A delegate whose lookup returns an email address and who selects a redaction hook.
fn redacting_delegate() -> Subagent {
    Subagent::new(
        "looker",
        "Looks customers up.",
        FnAgent::new(AgentDefinition::new("looker"), |_: AgentProps<'_>| {
            use_hooks([redact_email]);
            use_tool(Tool::new("lookup_customer").description("Look the customer up.").run(
                |_ctx, _: serde_json::Map<String, Value>| async move { Ok::<_, ToolError>("Jane, jane@example.com") },
            ));
            "You look customers up."
        }),
    )
}

/// A delegate's session runs no lifecycle hooks, so a subagent render refuses `use_hooks` (as
/// it refuses every hook the child cannot honour): a redaction hook is never silently
/// skipped, and the raw address reaches neither the child's model nor the parent.
#[tokio::test]
async fn a_delegates_selected_lifecycle_hooks_are_not_silently_ignored() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("task", json!({"agent": "looker", "prompt": "Who is customer 3?"})),
        ScriptedReply::tool_call("lookup_customer", json!({})),
        ScriptedReply::text("Customer 3 is Jane."),
        ScriptedReply::text("Jane."),
    ]);
    let runtime = runtime_with(&model, vec![delegating_agent("desk_lookup", redacting_delegate)]);
    runtime
        .handle("desk_lookup", "d-2")
        .unwrap()
        .send("Who is 3?")
        .await
        .unwrap();
    // The render refused the selection, and the parent's model was told why.
    let task_result = harness::tool_results(&model.requests()[1]);
    assert!(
        task_result[0]
            .0
            .contains("use_hooks() is not available in a subagent render"),
        "{task_result:?}"
    );
    for request in model.requests() {
        for (content, _) in harness::tool_results(&request) {
            assert!(
                !content.contains("jane@example.com"),
                "the delegate's redaction hook did not run: {content}"
            );
        }
    }
}

/// A delegate whose tool logs a progress line.
fn logging_delegate() -> Subagent {
    Subagent::new(
        "logger",
        "Logs progress.",
        FnAgent::new(AgentDefinition::new("logger"), |_: AgentProps<'_>| {
            use_tool(Tool::new("work").description("Do the work.").run(
                |ctx, _: serde_json::Map<String, Value>| async move {
                    ctx.log().info("halfway through the work");
                    Ok::<_, ToolError>("worked")
                },
            ));
            "You work."
        }),
    )
}

/// Reference §7.2 (`log {level, message}`): a tool's log lines are published, a tool running
/// inside a task's too, stamped with the task.
#[tokio::test]
async fn a_tool_running_in_a_task_has_its_log_lines_published() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("task", json!({"agent": "logger", "prompt": "Work."})),
        ScriptedReply::tool_call("work", json!({})),
        ScriptedReply::text("Worked."),
        ScriptedReply::text("Done."),
    ]);
    let runtime = runtime_with(&model, vec![delegating_agent("desk_log", logging_delegate)]);
    let mut events = runtime.observe();
    runtime.handle("desk_log", "d-3").unwrap().send("Work.").await.unwrap();
    let mut logs = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let Event::Log {
            message, attributes, ..
        } = &observation.event
        {
            logs.push((message.clone(), observation.task_id.is_some(), attributes.clone()));
        }
    }
    let [(message, in_task, attributes)] = &logs[..] else {
        panic!("one line: {logs:?}")
    };
    assert_eq!((message.as_str(), *in_task), ("halfway through the work", true));
    // Stamped with the call that logged it.
    let attributes = serde_json::to_value(attributes).unwrap();
    assert_eq!(attributes["tool"], "work");
    assert!(
        attributes["toolCallId"].as_str().is_some_and(|id| !id.is_empty()),
        "{attributes}"
    );
}

/// A delegate whose tool waits until the attempt is aborted.
fn waiting_delegate() -> Subagent {
    Subagent::new(
        "waiter",
        "Waits.",
        FnAgent::new(AgentDefinition::new("waiter"), |_: AgentProps<'_>| {
            use_tool(Tool::new("wait_forever").description("Wait until aborted.").run(
                |ctx, _: serde_json::Map<String, Value>| async move {
                    ctx.signal().aborted().await;
                    "stopped"
                },
            ));
            "You wait."
        }),
    )
}

/// An `after_subagent_created` hook that never returns (nor watches the abort signal).
#[hook(after_subagent_created, id = "hang_on_creation")]
async fn hang_on_creation(_parent: &ThreadState, _child: &ThreadState) {
    std::future::pending::<()>().await;
}

#[agent(hooks = [hang_on_creation])]
fn desk_hanging() -> &'static str {
    use_model("scripted/x");
    use_subagent(Subagent::new(
        "summarizer",
        "Summarizes.",
        FnAgent::new(AgentDefinition::new("summarizer"), slow_summarizer),
    ));
    "D"
}

/// An abort drops a running task while it waits on something that does not watch the signal
/// (here the `after_subagent_created` hook, before the child session starts): observers still
/// see the task end, failed, as the reference's `catch` closes it.
#[tokio::test]
async fn an_abort_that_drops_a_running_task_still_ends_the_task() {
    let model = ScriptedModel::new([ScriptedReply::tool_call(
        "task",
        json!({"agent": "summarizer", "prompt": "Sum up."}),
    )]);
    let runtime = runtime_with(&model, vec![desk_hanging.into()]);
    let mut events = runtime.observe();
    let handle = runtime.init(&desk_hanging, "d-5");
    let receipt = handle.dispatch("go").await.unwrap();
    let task_id = loop {
        let observation = events.recv().await.unwrap();
        if let Event::TaskStart { task_id, .. } = &observation.event {
            break task_id.clone();
        }
    };
    // The child is being created: its hook hangs.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert!(handle.abort().await.unwrap());
    let aborted = tokio::time::timeout(std::time::Duration::from_secs(20), handle.read(&receipt.submission_id))
        .await
        .expect("the abort ended the submission");
    assert!(aborted.is_err());
    let (mut task_ended, mut child_started, mut child_ended) = (None, false, false);
    while let Ok(observation) = events.try_recv() {
        let in_task = observation.task_id.as_deref() == Some(task_id.as_str());
        match &observation.event {
            Event::Task {
                task_id: ended,
                is_error,
                ..
            } if *ended == task_id => task_ended = Some(*is_error),
            Event::AgentStart if in_task => child_started = true,
            Event::AgentEnd { .. } if in_task => child_ended = true,
            _ => {}
        }
    }
    assert_eq!(task_ended, Some(true), "the task ended, failed");
    // The hook runs before the child session starts: it has no `agent_end` to owe.
    assert_eq!((child_started, child_ended), (false, false));
}

/// Reference §3.10 + §8 item 20: an abort reaches the running task, and the task call left
/// without an outcome gets the outcome-unknown result naming the child conversation
/// (`childConversationId`): the parent's model learns the child exists (its work may be
/// finished) instead of a bare "outcome unknown".
#[tokio::test]
async fn an_aborted_task_calls_unknown_outcome_names_its_child_conversation() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("task", json!({"agent": "waiter", "prompt": "Wait."})),
        ScriptedReply::tool_call("wait_forever", json!({})),
        ScriptedReply::text("Fine."),
    ]);
    let runtime = runtime_with(&model, vec![delegating_agent("desk_wait", waiting_delegate)]);
    let mut events = runtime.observe();
    let handle = runtime.handle("desk_wait", "d-4").unwrap();
    let receipt = handle.dispatch("go").await.unwrap();
    let mut task_id = None;
    loop {
        let observation = events.recv().await.unwrap();
        if let Event::TaskStart { task_id: started, .. } = &observation.event {
            task_id = Some(started.clone());
        }
        if matches!(&observation.event, Event::ToolStart { tool_name, .. } if tool_name == "wait_forever") {
            break;
        }
    }
    assert!(handle.abort().await.unwrap());
    let aborted = tokio::time::timeout(std::time::Duration::from_secs(20), handle.read(&receipt.submission_id))
        .await
        .expect("the abort reached the running task");
    assert!(aborted.is_err(), "the submission settled aborted");
    // The child session the abort dropped mid-tool still ends: one `agent_end` in the task.
    assert!(task_id.is_some(), "the task started");
    let child_ends = std::iter::from_fn(|| events.try_recv().ok())
        .filter(|observation| observation.task_id == task_id && matches!(observation.event, Event::AgentEnd { .. }))
        .count();
    assert_eq!(child_ends, 1);
    handle.send("And now?").await.unwrap();
    let store = runtime.store().clone();
    let (_, child) = the_child(&store, &InstanceKey::new("desk_wait", "d-4")).await;
    let requests = model.requests();
    let last = requests.last().unwrap();
    let results = harness::tool_results(last);
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(
        results[0].0,
        format!(
            r#"{{"type":"interrupted","message":"Tool execution was interrupted before completion. The outcome is unknown.","childConversationId":"{child}"}}"#
        )
    );
}

/// The reference's task call takes a `cwd` (`task_start {taskId, prompt, agent?, cwd?}`,
/// §7.2; the subagent-render rule for `useSandbox`: "delegates share the parent environment
/// (scope work with the task call's cwd instead)").
#[tokio::test]
async fn the_task_tool_takes_a_cwd_to_scope_the_delegate() {
    let model = ScriptedModel::new([ScriptedReply::text("hi")]);
    let runtime = runtime_with(&model, vec![plain_agent.into()]);
    runtime.init(&plain_agent, "p-cwd").send("hello").await.unwrap();
    let requests = model.requests();
    let task = requests[0].tools.iter().find(|tool| tool.name == "task").unwrap();
    assert!(
        task.parameters["properties"].get("cwd").is_some(),
        "{}",
        task.parameters
    );
}

/// Reference §7.3 item 8: "per tool: `tool_start` at execution, `message_start`/`message_end`
/// of its tool-result message when done", in a task's child session as at the root.
#[tokio::test]
async fn a_childs_tool_results_are_published_as_messages_like_the_roots() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("task", json!({"agent": "summarizer", "prompt": "Summarize case 8."})),
        ScriptedReply::tool_call("count_words", json!({"text": "a loose screw"})),
        ScriptedReply::text("Case 8: a loose screw."),
        ScriptedReply::text("Done."),
    ]);
    let runtime = runtime_with(&model, vec![case_agent.into()]);
    let mut events = runtime.observe();
    runtime
        .init(&case_agent, "case-8")
        .send("Look at case 8.")
        .await
        .unwrap();
    let mut root_results = 0;
    let mut child_results = 0;
    while let Ok(observation) = events.try_recv() {
        if let Event::MessageEnd {
            message: ModelMessage::Tool { .. },
        } = &observation.event
        {
            if observation.task_id.is_some() {
                child_results += 1;
            } else {
                root_results += 1;
            }
        }
    }
    assert_eq!(root_results, 1, "the root's task result");
    assert_eq!(child_results, 1, "the child's count_words result");
}

/// A delegate agent whose definition selects lifecycle hooks would run without them (a
/// delegate's session runs none): `use_subagent` refuses it, so the parent's render fails
/// with the reason before any model call.
#[tokio::test]
async fn a_delegate_whose_definition_selects_lifecycle_hooks_is_refused_not_run_without_them() {
    fn hooked() -> Subagent {
        Subagent::new(
            "hooked",
            "Looks customers up.",
            FnAgent::new(
                AgentDefinition::new("hooked").hooks(vec![redact_email]),
                |_: AgentProps<'_>| "You look customers up.",
            ),
        )
    }
    let model = ScriptedModel::new([ScriptedReply::text("unused")]);
    let runtime = runtime_with(&model, vec![delegating_agent("desk_hooked", hooked)]);
    let error = runtime
        .handle("desk_hooked", "d-5")
        .unwrap()
        .send("Who?")
        .await
        .unwrap_err();
    assert!(
        error.to_string().contains(
            "[flue] use_subagent() \"hooked\": its agent selects lifecycle hooks (redact_email), which a delegate's session does not run."
        ),
        "{error}"
    );
    assert!(model.requests().is_empty(), "no model was called");
}

#[agent]
fn sandboxed_desk() -> &'static str {
    use_model("scripted/parent-model");
    use_sandbox(flue_runtime::sandbox::virtual_sandbox());
    use_subagent(Subagent::new(
        "scribe",
        "Writes notes.",
        FnAgent::new(AgentDefinition::new("scribe"), |_: AgentProps<'_>| "You write notes."),
    ));
    "Delegate the writing."
}

/// A `task` call's `cwd` moves the delegate's working directory (relative to the parent's):
/// its relative paths land there, `task_start` says so, and a `cwd` that leaves the sandbox is
/// refused before the task starts.
#[tokio::test]
async fn a_task_cwd_scopes_the_delegates_sandbox_tools_and_cannot_leave_the_sandbox() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call(
            "task",
            json!({"agent": "scribe", "prompt": "Write the note.", "cwd": "work/notes"}),
        ),
        ScriptedReply::tool_call("write", json!({"path": "today.md", "content": "ship it"})),
        ScriptedReply::text("Written."),
        ScriptedReply::tool_call("read", json!({"path": "/work/notes/today.md"})),
        ScriptedReply::tool_call("task", json!({"agent": "scribe", "prompt": "Escape.", "cwd": "../.."})),
        ScriptedReply::text("Done."),
    ]);
    let runtime = runtime_with(&model, vec![sandboxed_desk.into()]);
    let mut events = runtime.observe();
    runtime.init(&sandboxed_desk, "s-1").send("Note it.").await.unwrap();
    let requests = model.requests();
    // The parent reads what the delegate wrote where its cwd put it.
    let read = harness::last_batch_results(&requests[4]);
    assert!(read[0].0.contains("ship it"), "{read:?}");
    let escape = harness::last_batch_results(&requests[5]);
    assert!(escape[0].1, "{escape:?}");
    assert!(escape[0].0.starts_with("The task's cwd \"../..\""), "{escape:?}");
    let mut starts = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let Event::TaskStart { cwd, .. } = observation.event {
            starts.push(cwd);
        }
    }
    assert_eq!(
        starts,
        [Some("work/notes".to_owned())],
        "the refused task never started"
    );
}

/// A `cwd` needs a sandbox: without one the call is refused, and the task does not start.
#[tokio::test]
async fn a_task_cwd_without_a_sandbox_is_refused() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call(
            "task",
            json!({"agent": "summarizer", "prompt": "Summarize case 9.", "cwd": "cases"}),
        ),
        ScriptedReply::text("Could not."),
    ]);
    let runtime = runtime_with(&model, vec![case_agent.into()]);
    runtime.init(&case_agent, "case-9").send("Case 9.").await.unwrap();
    let requests = model.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(
        harness::tool_results(&requests[1])[0],
        (
            "A task's cwd needs a sandbox, and this agent has none attached.".to_owned(),
            true
        )
    );
}

static FRAGILE_BROKEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The tallier, whose render panics once `FRAGILE_BROKEN` is set.
fn fragile_parent(_: AgentProps<'_>) -> &'static str {
    use_model("scripted/parent-model");
    use_subagent(Subagent::new(
        "tallier",
        "Tallies words.",
        FnAgent::new(AgentDefinition::new("tallier"), |_: AgentProps<'_>| {
            assert!(!FRAGILE_BROKEN.load(Ordering::SeqCst), "the delegate's render broke");
            use_tool(
                Tool::new("tally")
                    .description("Tally the words.")
                    .run(|_ctx, _: serde_json::Map<String, Value>| async move { Ok::<_, ToolError>("7 words") }),
            );
            "You tally words."
        }),
    ));
    "Delegate the tally."
}

/// One "Tally it." exchange of the parent `agent` (instance `id`) on `backend`, whose batch
/// answering the task call fails once, after the child answered; the failure sets `changed`,
/// which changes what the parent or its delegate render from then on. Asserts that the batch
/// failed, and that the re-run returned the child's recorded answer; the events are returned.
async fn rerun_after_the_child_answered(
    name: &str,
    backend: Box<dyn Store>,
    agent: AgentRef,
    id: &str,
    changed: &'static std::sync::atomic::AtomicBool,
) -> Vec<Observation> {
    changed.store(false, Ordering::SeqCst);
    let model = tallying_script();
    let commits = commits_calls_of("task");
    let store = crashing(backend, move |key, records| {
        let hit = commits(key, records);
        if hit {
            changed.store(true, Ordering::SeqCst);
        }
        hit
    });
    let probe = store.clone();
    let agent_name = agent.get().definition().name.to_string();
    let runtime = harness::runtime_on(store, &model, vec![agent]);
    let mut events = runtime.observe();
    let reply = runtime
        .handle(&agent_name, id)
        .unwrap()
        .send("Tally it.")
        .await
        .unwrap();
    changed.store(false, Ordering::SeqCst);
    assert_eq!(
        probe.failures.load(Ordering::SeqCst),
        1,
        "{name}: the task batch's commit failed"
    );
    assert_eq!(reply.text, "The tally is seven.", "{name}");
    let requests = model.requests();
    assert_eq!(requests.len(), 4, "{name}: the child's model was not called again");
    assert_eq!(
        harness::last_batch_results(&requests[3]),
        [("Seven words.".to_owned(), false)],
        "{name}: the re-run returned the recorded answer"
    );
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        seen.push(observation);
    }
    seen
}

/// Completed work is never lost: a re-run of a task call whose child had answered returns the
/// recorded answer before rendering the delegate again, so a delegate that no longer renders
/// (or whose model no longer resolves) does not throw the finished work away.
#[tokio::test]
async fn a_finished_task_rerun_returns_its_answer_even_when_the_delegate_no_longer_renders() {
    for (name, backend) in backends() {
        let agent = FnAgent::new(AgentDefinition::new("fragile"), fragile_parent).into();
        rerun_after_the_child_answered(name, backend, agent, "f-1", &FRAGILE_BROKEN).await;
    }
}

#[agent]
fn clashing_desk() -> &'static str {
    use_model("scripted/parent-model");
    use_sandbox(flue_runtime::sandbox::virtual_sandbox());
    use_subagent(Subagent::new(
        "reader",
        "Reads.",
        FnAgent::new(AgentDefinition::new("reader"), |_: AgentProps<'_>| {
            use_tool(
                Tool::new("read")
                    .description("Read my way.")
                    .run(|_ctx, _: serde_json::Map<String, Value>| async move { Ok::<_, ToolError>("mine") }),
            );
            "You read."
        }),
    ));
    "Delegate the reading."
}

/// A delegate whose tool clashes with a sandbox tool is refused before its child conversation
/// is created: no orphan child is left in the parent's stream.
#[tokio::test]
async fn a_delegate_tool_clashing_with_the_sandbox_is_refused_before_any_child_exists() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("task", json!({"agent": "reader", "prompt": "Read the notes."})),
        ScriptedReply::text("Could not."),
    ]);
    let runtime = runtime_with(&model, vec![clashing_desk.into()]);
    runtime.init(&clashing_desk, "k-1").send("Read.").await.unwrap();
    let requests = model.requests();
    assert_eq!(
        harness::last_batch_results(&requests[1]),
        [(
            "The \"reader\" agent's tool \"read\" clashes with a sandbox tool.".to_owned(),
            true
        )]
    );
    let store = runtime.store().clone();
    let records = stream_json(&store, &InstanceKey::new("clashing_desk", "k-1")).await;
    assert!(of_type(&records, "child_session_retained").is_empty(), "{records:#?}");
}

/// A blank prompt is refused (the schema already refuses an empty one): the delegate would
/// start from nothing.
#[tokio::test]
async fn a_task_with_a_blank_prompt_is_refused() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("task", json!({"agent": "summarizer", "prompt": "   "})),
        ScriptedReply::text("Could not."),
    ]);
    let runtime = runtime_with(&model, vec![case_agent.into()]);
    runtime.init(&case_agent, "case-10").send("Case 10.").await.unwrap();
    let requests = model.requests();
    assert_eq!(requests.len(), 2, "the delegate never ran");
    let result = harness::last_batch_results(&requests[1]);
    assert!(
        result[0].1 && result[0].0.starts_with("The task's prompt is empty"),
        "{result:?}"
    );
}

static OFFER_GONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The tallier's parent, which stops offering it once `OFFER_GONE` is set.
fn fickle_parent(_: AgentProps<'_>) -> &'static str {
    use_model("scripted/parent-model");
    if !OFFER_GONE.load(Ordering::SeqCst) {
        // Its own slot: the tests counting tallies run in parallel.
        use_subagent(tallying_delegate(3));
    }
    "Delegate the tally."
}

/// A render may drop a delegate (conditional resources): a re-run of a task call whose child
/// had answered still returns the recorded answer, not a "no agent named" miss, and reports
/// the task with it.
#[tokio::test]
async fn a_finished_task_rerun_returns_its_answer_even_when_the_render_no_longer_offers_the_delegate() {
    for (name, backend) in backends() {
        let agent = FnAgent::new(AgentDefinition::new("fickle"), fickle_parent).into();
        let seen = rerun_after_the_child_answered(name, backend, agent, "f-2", &OFFER_GONE).await;
        let ends: Vec<_> = seen
            .into_iter()
            .filter_map(|observation| match observation.event {
                Event::Task { result, .. } => Some(result),
                _ => None,
            })
            .collect();
        assert_eq!(ends.last(), Some(&Some("Seven words.".to_owned())), "{name}");
    }
}

static OFFER_GONE_MIDWAY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The tallier's parent, which stops offering it once `OFFER_GONE_MIDWAY` is set.
fn fickle_midway_parent(_: AgentProps<'_>) -> &'static str {
    use_model("scripted/parent-model");
    if !OFFER_GONE_MIDWAY.load(Ordering::SeqCst) {
        use_subagent(tallying_delegate(3));
    }
    "Delegate the tally."
}

/// Runs `parent` (the agent `agent`) until its task's child has a step and no answer: the
/// child's tool batch fails to commit, the parent's attempt fails, and `midway` is set, which
/// changes the parent's render for its re-run. The re-run must not run the child again: its
/// call ends outcome-unknown, its result naming the child conversation (reference §3.9).
async fn an_unfinished_childs_rerun_names_it(
    agent: &'static str,
    parent: fn(AgentProps<'_>) -> &'static str,
    midway: &'static std::sync::atomic::AtomicBool,
) {
    for (name, backend) in backends() {
        midway.store(false, Ordering::SeqCst);
        let model = tallying_script();
        let commits = commits_calls_of("tally");
        let store = crashing(backend, move |key, records| {
            let hit = commits(key, records);
            if hit {
                midway.store(true, Ordering::SeqCst);
            }
            hit
        });
        let runtime = harness::runtime_on(
            store,
            &model,
            vec![FnAgent::new(AgentDefinition::new(agent), parent).into()],
        );
        let reply = runtime.handle(agent, "m-1").unwrap().send("Tally it.").await.unwrap();
        midway.store(false, Ordering::SeqCst);
        // The script's next answer, whatever it says: the parent's model was called next.
        assert_eq!(reply.text, "Seven words.", "{name}");
        let requests = model.requests();
        assert_eq!(
            requests.len(),
            3,
            "{name}: parent, child, parent (the child was not run again)"
        );
        let store = runtime.store().clone();
        let (_, child) = the_child(&store, &InstanceKey::new(agent, "m-1")).await;
        assert_eq!(
            harness::last_batch_results(&requests[2]),
            [(
                format!(
                    r#"{{"type":"interrupted","message":"Tool execution was interrupted before completion. The outcome is unknown.","childConversationId":{}}}"#,
                    json!(child.to_string())
                ),
                true
            )],
            "{name}"
        );
    }
}

/// A render may drop a delegate whose child was interrupted before it answered: the re-run
/// cannot go on with the child, so the call's outcome is unknown, and its result names the
/// child conversation (reference §3.9), as an interrupted call's does; not "not declared".
#[tokio::test]
async fn an_unfinished_task_rerun_whose_delegate_is_no_longer_offered_names_its_child_as_outcome_unknown() {
    an_unfinished_childs_rerun_names_it("midway", fickle_midway_parent, &OFFER_GONE_MIDWAY).await;
}

static MODEL_GONE_MIDWAY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The tallier's parent, whose tallier names a model no provider serves once
/// `MODEL_GONE_MIDWAY` is set (a deploy that dropped a provider).
fn model_gone_parent(_: AgentProps<'_>) -> &'static str {
    use_model("scripted/parent-model");
    if MODEL_GONE_MIDWAY.load(Ordering::SeqCst) {
        use_subagent(tallying_delegate(4).model("retired/model"));
    } else {
        use_subagent(tallying_delegate(4));
    }
    "Delegate the tally."
}

/// A delegate still offered whose child was interrupted before it answered, but which does
/// not start now (its model no longer resolves): the re-run does not tell the model the agent
/// could not start (it would delegate again, repeating the child's work), but that the call's
/// outcome is unknown, naming the child, as when the delegate is no longer offered.
#[tokio::test]
async fn an_unfinished_task_rerun_whose_delegate_no_longer_starts_names_its_child_as_outcome_unknown() {
    an_unfinished_childs_rerun_names_it("model_gone", model_gone_parent, &MODEL_GONE_MIDWAY).await;
}

// ---------------------------------------------------------------------------------------------
// Compaction in a task's child session: the child's conversation compacts as the root's does
// (threshold compaction before a call, overflow recovery), with the submission's settings,
// and its compaction is a record of the child's own stream.

use flue_runtime::provider::{ProviderError, ProviderErrorKind};

/// About 255 estimated tokens (1,000 bytes).
fn a_page() -> String {
    "page ".repeat(200)
}

/// The beginning of the summary the model reads in place of the summarized history.
const SUMMARY_TAG: &str = "<conversation-summary type=\"compaction\">";

/// A reader's tools: `page` (the next long page) and `note` (take a note).
fn use_reading_tools() {
    use_tool(
        Tool::new("page")
            .description("Read the next page.")
            .run(|_ctx, _: serde_json::Map<String, Value>| async move { Ok::<_, ToolError>(a_page()) }),
    );
    use_tool(
        Tool::new("note")
            .description("Take a note.")
            .run(|_ctx, _: serde_json::Map<String, Value>| async move { Ok::<_, ToolError>("noted") }),
    );
}

/// A delegate reading long pages (`page`) and taking notes (`note`).
fn reading_delegate() -> Subagent {
    Subagent::new(
        "reader",
        "Reads long pages.",
        FnAgent::new(AgentDefinition::new("reader"), |_: AgentProps<'_>| {
            use_reading_tools();
            "You read pages."
        }),
    )
}

/// A parent delegating to the reader, under the agent name `name`, with `compaction` as its
/// model's compaction settings (what its tasks' children compact with).
fn reading_parent(name: &'static str, compaction: Compaction) -> AgentRef {
    FnAgent::new(AgentDefinition::new(name), move |_: AgentProps<'_>| {
        use_model_with(
            "scripted/parent-model",
            ModelOptions {
                compaction: compaction.clone(),
                ..ModelOptions::default()
            },
        );
        use_subagent(reading_delegate());
        "Delegate the reading."
    })
    .into()
}

/// A 600-token window less a 100-token reserve: the reader's third call (two pages read)
/// would not fit; about 150 tokens of the newest history stay verbatim.
fn tight_compaction() -> Compaction {
    Compaction::Threshold(CompactionConfig {
        reserve_tokens: Some(100),
        keep_recent_tokens: Some(150),
        model: None,
    })
}

const READ_PROMPT: &str = "Read the pages and report.";

fn read_call() -> ScriptedReply {
    ScriptedReply::tool_call("task", json!({"agent": "reader", "prompt": READ_PROMPT}))
}

fn overflow() -> ScriptedReply {
    ScriptedReply::Error(ProviderError::new(
        ProviderErrorKind::ContextOverflow,
        "prompt is too long",
    ))
}

fn user_text(message: &ModelMessage) -> Option<&str> {
    match message {
        ModelMessage::User { content, .. } => Some(content),
        _ => None,
    }
}

/// Reference (agent-behavior, compaction.ts; task sessions inherit the parent's compaction
/// settings): a task's child compacts like the root before a call whose estimated input would
/// not fit. Its next request reads the summary in place of the older history; the compaction
/// is recorded in the child's stream and reported under the task's id.
#[tokio::test]
async fn a_task_child_whose_conversation_passes_the_threshold_compacts_before_its_next_call() {
    let model = ScriptedModel::new([
        read_call(),
        ScriptedReply::tool_call("page", json!({})),
        ScriptedReply::tool_call("page", json!({})),
        // The child's summarization call, then its call with the summary.
        ScriptedReply::text("The reader read a first page of 'page' words."),
        ScriptedReply::text("Two pages of 'page'."),
        ScriptedReply::text("Read."),
    ])
    .with_context_window(600);
    let runtime = runtime_with(&model, vec![reading_parent("library", tight_compaction())]);
    let mut events = runtime.observe();
    let reply = runtime
        .handle("library", "lib-1")
        .unwrap()
        .send("Read them.")
        .await
        .unwrap();
    assert_eq!(reply.text, "Read.");
    let requests = model.requests();
    assert_eq!(requests.len(), 6, "{requests:#?}");
    // The summarization call: no tools, the older history as a transcript.
    let summarization = &requests[3];
    assert!(summarization.tools.is_empty());
    let transcript = user_text(&summarization.messages[0]).unwrap();
    assert!(transcript.starts_with(&format!("User: {READ_PROMPT}")), "{transcript}");
    // The child's next call reads the summary first and no longer the prompt, then the
    // newest page verbatim.
    let compacted = &requests[4];
    assert_eq!(
        instructions_of(compacted.system.as_deref()),
        Some("You read pages."),
        "the child's own call"
    );
    let summary = user_text(&compacted.messages[0]).unwrap();
    assert!(summary.starts_with(SUMMARY_TAG), "{summary}");
    assert!(summary.contains("The reader read a first page"), "{summary}");
    assert!(
        !compacted.messages.contains(&ModelMessage::user(READ_PROMPT)),
        "{:#?}",
        compacted.messages
    );
    assert_eq!(harness::tool_results(compacted), [(a_page(), false)]);
    assert_eq!(
        compacted.messages.len(),
        3,
        "the summary, the newest page's call and its result: {:#?}",
        compacted.messages
    );
    // The parent got the child's answer.
    assert_eq!(
        harness::last_batch_results(&requests[5]),
        [("Two pages of 'page'.".to_owned(), false)]
    );
    // The child's stream keeps the compaction; the parent's has none.
    let store = runtime.store().clone();
    let parent = InstanceKey::new("library", "lib-1");
    let (_, child) = the_child(&store, &parent).await;
    let records = stream_json(&store, &child).await;
    let compactions = of_type(&records, "compaction");
    assert_eq!(compactions.len(), 1, "{records:#?}");
    assert_eq!(compactions[0]["reason"], "threshold");
    assert!(of_type(&stream_json(&store, &parent).await, "compaction").is_empty());
    // Its events are the root's, under the task's id.
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            Event::CompactionStart { reason, .. } => {
                seen.push((format!("start {reason}"), observation.task_id.is_some()));
            }
            Event::Turn {
                purpose: flue_runtime::events::TurnPurpose::Compaction,
                ..
            } => seen.push(("summary turn".to_owned(), observation.task_id.is_some())),
            Event::Compaction { is_error, .. } => {
                seen.push((format!("end {is_error}"), observation.task_id.is_some()));
            }
            _ => {}
        }
    }
    assert_eq!(
        seen,
        [
            ("start threshold".to_owned(), true),
            ("summary turn".to_owned(), true),
            ("end false".to_owned(), true)
        ]
    );
}

/// A task's child retries a call that failed transiently as the root does: the failed call
/// ends its turn (finish reason `error`) and the retry is a turn of its own, with its own id.
#[tokio::test]
async fn a_task_childs_retried_call_is_a_turn_of_its_own() {
    let model = ScriptedModel::new([
        read_call(),
        ScriptedReply::Error(ProviderError::new(ProviderErrorKind::Server, "overloaded")),
        ScriptedReply::text("One page of 'page'."),
        ScriptedReply::text("Read."),
    ]);
    let runtime = runtime_with(&model, vec![reading_parent("retrying", Compaction::Disabled)]);
    let mut events = runtime.observe();
    let reply = runtime
        .handle("retrying", "r-1")
        .unwrap()
        .send("Read them.")
        .await
        .unwrap();
    assert_eq!(reply.text, "Read.");
    assert_eq!(model.requests().len(), 4);
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if observation.task_id.is_none() {
            continue;
        }
        match observation.event {
            Event::TurnStart { turn_id, .. } => seen.push(format!("turn_start {turn_id}")),
            Event::Turn { turn_id, response, .. } => seen.push(format!("turn {turn_id} {}", response.finish_reason)),
            _ => {}
        }
    }
    let id = |at: usize| seen[at].split(' ').nth(1).unwrap().to_owned();
    let (first, second) = (id(0), id(2));
    assert_ne!(first, second, "{seen:?}");
    assert_eq!(
        seen,
        [
            format!("turn_start {first}"),
            format!("turn {first} error"),
            format!("turn_start {second}"),
            format!("turn {second} stop"),
        ]
    );
}

/// Reference table item 54 ("context-overflow response → compact and retry turn, even with
/// threshold compaction off"), in a task's child: the task succeeds.
#[tokio::test]
async fn a_task_child_whose_call_overflows_compacts_and_retries_and_the_task_succeeds() {
    let model = ScriptedModel::new([
        read_call(),
        ScriptedReply::tool_call("page", json!({})),
        overflow(),
        ScriptedReply::text("The reader was asked to read pages."),
        ScriptedReply::text("One page of 'page'."),
        ScriptedReply::text("Read."),
    ]);
    let runtime = runtime_with(&model, vec![reading_parent("archive", Compaction::Disabled)]);
    let mut events = runtime.observe();
    let reply = runtime
        .handle("archive", "arc-1")
        .unwrap()
        .send("Read them.")
        .await
        .unwrap();
    assert_eq!(reply.text, "Read.");
    let requests = model.requests();
    assert_eq!(requests.len(), 6, "{requests:#?}");
    assert!(requests[3].tools.is_empty(), "the summarization call");
    // The retried call reads the summary in place of the prompt.
    let retried = &requests[4];
    let summary = user_text(&retried.messages[0]).unwrap();
    assert!(summary.starts_with(SUMMARY_TAG), "{summary}");
    assert!(summary.contains("The reader was asked to read pages."), "{summary}");
    assert!(!retried.messages.contains(&ModelMessage::user(READ_PROMPT)));
    assert_eq!(
        harness::last_batch_results(&requests[5]),
        [("One page of 'page'.".to_owned(), false)],
        "the task succeeded"
    );
    let store = runtime.store().clone();
    let (_, child) = the_child(&store, &InstanceKey::new("archive", "arc-1")).await;
    let records = stream_json(&store, &child).await;
    let compactions = of_type(&records, "compaction");
    assert_eq!(compactions.len(), 1, "{records:#?}");
    assert_eq!(compactions[0]["reason"], "overflow");
    // The overflowing turn ends before the compaction starts; the retry is a turn of its own.
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if observation.task_id.is_none() {
            continue;
        }
        match observation.event {
            Event::TurnStart { step, .. } => seen.push(format!("turn_start {step}")),
            Event::Turn {
                step,
                purpose,
                response,
                ..
            } => seen.push(match response.error {
                // A failed call's turn names the provider's error kind, as the root's does.
                Some(error) => format!(
                    "turn {step} {} {purpose:?} {}",
                    response.finish_reason, error.error_type
                ),
                None => format!("turn {step} {} {purpose:?}", response.finish_reason),
            }),
            Event::CompactionStart { reason, .. } => seen.push(format!("compaction_start {reason}")),
            Event::Compaction { is_error, .. } => seen.push(format!("compaction {is_error}")),
            _ => {}
        }
    }
    assert_eq!(
        seen,
        [
            "turn_start 1",
            "turn 1 toolUse Agent",
            "turn_start 2",
            "turn 2 error Agent context_overflow",
            "compaction_start overflow",
            "turn 2 stop Compaction",
            "compaction false",
            "turn_start 2",
            "turn 2 stop Agent",
        ]
    );
}

/// As at the root (`an_overflow_with_nothing_older_to_summarize_fails_as_context_overflow`):
/// overflow recovery compacts once; an overflow that persists fails the task with the
/// overflow error, and no second compaction is tried.
#[tokio::test]
async fn a_task_child_whose_overflow_persists_after_compacting_fails_the_task_with_the_overflow() {
    let model = ScriptedModel::new([
        read_call(),
        ScriptedReply::tool_call("page", json!({})),
        overflow(),
        ScriptedReply::text("The reader was asked to read pages."),
        overflow(),
        ScriptedReply::text("The reader could not."),
    ]);
    let runtime = runtime_with(&model, vec![reading_parent("stacks", Compaction::Default)]);
    let reply = runtime
        .handle("stacks", "st-1")
        .unwrap()
        .send("Read them.")
        .await
        .unwrap();
    assert_eq!(reply.text, "The reader could not.");
    let requests = model.requests();
    assert_eq!(requests.len(), 6, "one compaction, one retry: {requests:#?}");
    assert!(requests[3].tools.is_empty(), "the summarization call");
    let summary = user_text(&requests[4].messages[0]).unwrap();
    assert!(summary.starts_with(SUMMARY_TAG), "the retry was compacted: {summary}");
    let results = harness::last_batch_results(&requests[5]);
    assert_eq!(results.len(), 1, "{results:?}");
    let (message, is_error) = &results[0];
    assert!(is_error, "the task failed: {message}");
    assert!(message.contains("prompt is too long"), "{message}");
    let store = runtime.store().clone();
    let (_, child) = the_child(&store, &InstanceKey::new("stacks", "st-1")).await;
    let records = stream_json(&store, &child).await;
    assert_eq!(of_type(&records, "compaction").len(), 1, "{records:#?}");
}

/// A child's compaction is durable in its stream: a task re-run after a crash reattaches to
/// a child that compacted, and the child goes on from the compacted history (no second
/// summary, its next request reads the recorded summary).
#[tokio::test]
async fn a_reattached_task_child_goes_on_from_its_compacted_history() {
    for (name, backend) in backends() {
        let model = ScriptedModel::new([
            read_call(),
            ScriptedReply::tool_call("page", json!({})),
            ScriptedReply::tool_call("page", json!({})),
            ScriptedReply::text("The reader read a first page of 'page' words."),
            // The child's batch of this call is interrupted (the crash).
            ScriptedReply::tool_call("note", json!({})),
            ScriptedReply::text("Two pages of 'page'."),
            ScriptedReply::text("Read."),
        ])
        .with_context_window(600);
        let store = crashing(backend, commits_calls_of("note"));
        let failures = store.failures.clone();
        let runtime = harness::runtime_on(store, &model, vec![reading_parent("vault", tight_compaction())]);
        let reply = runtime
            .handle("vault", "v-1")
            .unwrap()
            .send("Read them.")
            .await
            .unwrap();
        assert_eq!(failures.load(Ordering::SeqCst), 1, "{name}: the crash happened");
        assert_eq!(reply.text, "Read.", "{name}");
        let requests = model.requests();
        assert_eq!(
            requests.len(),
            7,
            "{name}: one summary, no step taken twice: {requests:#?}"
        );
        // The reattached child's request: the recorded summary, the newest page, the note
        // whose outcome is unknown.
        let resumed = &requests[5];
        let summary = user_text(&resumed.messages[0]).unwrap();
        assert!(summary.starts_with(SUMMARY_TAG), "{name}: {summary}");
        assert!(
            !resumed.messages.contains(&ModelMessage::user(READ_PROMPT)),
            "{name}: {:#?}",
            resumed.messages
        );
        assert_eq!(
            harness::tool_results(resumed),
            [
                (a_page(), false),
                (
                    r#"{"type":"interrupted","message":"Tool execution was interrupted before completion. The outcome is unknown."}"#.to_owned(),
                    true
                )
            ],
            "{name}"
        );
        let store = runtime.store().clone();
        let (_, child) = the_child(&store, &InstanceKey::new("vault", "v-1")).await;
        let records = stream_json(&store, &child).await;
        assert_eq!(of_type(&records, "compaction").len(), 1, "{name}: {records:#?}");
        // Every child record was written by an attempt of the parent's submission.
        assert!(
            records.iter().all(|record| record["attempt_id"].is_string()),
            "{name}: {records:#?}"
        );
    }
}

/// A summarizer that never answers.
struct Stuck;

impl flue_runtime::provider::ModelProvider for Stuck {
    fn id(&self) -> &str {
        "stuck"
    }

    fn stream(&self, _request: &ModelRequest) -> flue_runtime::provider::ModelStream {
        Box::pin(futures_util::stream::pending())
    }
}

/// As at the root (`an_abort_during_the_summary_call_settles_the_submission_aborted`): the
/// child summarizes with the submission's compaction model, and an abort during that call
/// settles the submission aborted, not failed.
#[tokio::test]
async fn an_abort_during_a_task_childs_summary_call_settles_the_submission_aborted() {
    let model = ScriptedModel::new([
        read_call(),
        ScriptedReply::tool_call("page", json!({})),
        ScriptedReply::tool_call("page", json!({})),
    ])
    .with_context_window(600);
    let mut providers = flue_runtime::provider::ProviderRegistry::new();
    providers.register(model.clone());
    providers.register(Stuck);
    let compaction = Compaction::Threshold(CompactionConfig {
        reserve_tokens: Some(100),
        keep_recent_tokens: Some(150),
        model: Some("stuck/summarizer".into()),
    });
    let runtime = flue_runtime::Runtime::builder()
        .store(MemoryStore::new())
        .providers(providers)
        .agent(reading_parent("reading_room", compaction))
        .build()
        .unwrap();
    let handle = runtime.handle("reading_room", "rr-1").unwrap();
    let mut events = runtime.observe();
    let sent = tokio::spawn({
        let handle = handle.clone();
        async move { handle.send("Read them.").await }
    });
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            let observation = events.recv().await.unwrap();
            if let Event::CompactionStart { .. } = observation.event {
                assert!(observation.task_id.is_some(), "the child's compaction");
                break;
            }
        }
    })
    .await
    .expect("the child compacts");
    assert!(handle.abort().await.unwrap());
    harness::assert_settles_aborted(sent).await;
    let mut ends = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let Event::Compaction { is_error, error, .. } = observation.event {
            ends.push((is_error, error.map(|error| error.error_type)));
        }
    }
    assert_eq!(ends, [(true, Some("submission_aborted".to_owned()))]);
}

/// What each render of [`probing_child`] mounted.
static PROBED: Renders = Renders::new();

fn probing_child(_: AgentProps<'_>) -> &'static str {
    let marker = PROBED.mark();
    use_tool(Tool::new("probe").description("Probes the case.").run(
        move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
            let _held = marker.clone();
            async move { Ok::<_, ToolError>("probed") }
        },
    ));
    "You probe cases."
}

#[agent]
fn probing_parent() -> &'static str {
    use_model("scripted/parent-model");
    use_subagent(Subagent::new(
        "prober",
        "Probes one case.",
        FnAgent::new(AgentDefinition::new("prober"), probing_child),
    ));
    "Delegate the probing."
}

/// Delegation adds references between the parent's response and its children's sessions
/// (the delegation keeps the parent's thread view and attempt, a child's session its own
/// nested delegation and tools): once the parent's response ends, nothing its children
/// rendered stays alive.
#[tokio::test]
async fn a_settled_delegating_response_keeps_nothing_its_children_rendered_alive() {
    let model = ScriptedModel::new([]);
    let runtime = runtime_with(&model, vec![probing_parent.into()]);
    for exchange in 0..2 {
        model.push(ScriptedReply::tool_call(
            "task",
            json!({"agent": "prober", "prompt": "Probe case 7."}),
        ));
        model.push(ScriptedReply::tool_call("probe", json!({})));
        model.push(ScriptedReply::text("Case 7 probed."));
        model.push(ScriptedReply::text("Done."));
        let reply = runtime
            .init(&probing_parent, format!("p-{exchange}"))
            .send("Case 7?")
            .await
            .unwrap();
        assert_eq!(reply.text, "Done.");
    }
    let (rendered, held) = PROBED.rendered_and_held().await;
    assert!(rendered >= 2, "each child rendered: {rendered}");
    assert_eq!(held, 0, "child renders whose tools are still held, of {rendered}");
}

/// The ids the `<attachments>` list after a user message's text names, in order.
fn listed_attachment_ids(content: &str) -> Vec<String> {
    let Some((_, list)) = content.rsplit_once("\n\n<attachments>\n") else {
        return Vec::new();
    };
    list.lines()
        .filter_map(|line| line.strip_prefix("<image id=\""))
        .map(|rest| rest.split('"').next().unwrap().to_owned())
        .collect()
}

fn photo_message(body: &str, data: &str) -> DeliveredMessage {
    DeliveredMessage::User(flue_runtime::message::UserMessage {
        body: body.into(),
        attachments: vec![flue_runtime::message::Attachment::Image {
            data: data.into(),
            mime_type: "image/png".into(),
            filename: Some("photo.png".into()),
        }],
    })
}

/// Reference: the model reads the ids of a message's images (listed after its text) and
/// hands an image to a delegate by passing its id to `task`; the delegate's prompt carries
/// the image, stored again under the child's own conversation.
#[tokio::test]
async fn a_task_hands_an_image_of_the_conversation_to_its_delegate_by_its_listed_id() {
    let model = ScriptedModel::new([ScriptedReply::text("A photo, noted.")]);
    let runtime = runtime_with(&model, vec![case_agent.into()]);
    let handle = runtime.init(&case_agent, "case-photo");
    handle
        .send(photo_message("Here is the printer.", "iVBORw0KGgo="))
        .await
        .unwrap();
    let first = model.requests();
    let ModelMessage::User { content, images } = &first[0].messages[0] else {
        panic!("{:?}", first[0].messages)
    };
    assert!(
        content.starts_with("Here is the printer.\n\n<attachments>\n<image id=\""),
        "{content}"
    );
    assert!(
        content.ends_with(" mimeType=\"image/png\" />\n</attachments>"),
        "{content}"
    );
    let ids = listed_attachment_ids(content);
    assert_eq!(ids.len(), 1, "{content}");
    let parent_image = images[0].clone();

    model.push(ScriptedReply::tool_call(
        "task",
        json!({"agent": "summarizer", "prompt": "Describe the printer in the photo.",
               "attachments": [{"id": ids[0]}, {"id": ids[0]}]}),
    ));
    model.push(ScriptedReply::text("A printer, on fire."));
    model.push(ScriptedReply::text("Done."));
    let reply = handle.send("Have it described.").await.unwrap();
    assert_eq!(reply.text, "Done.");
    let requests = model.requests();
    // The parent's history still lists the image once, on its own message.
    let ModelMessage::User { content, .. } = &requests[1].messages[0] else {
        panic!("{:?}", requests[1].messages)
    };
    assert_eq!(listed_attachment_ids(content), ids);
    // The child: the prompt with the image (a repeated id handed once), under an id of its own.
    let child = &requests[2];
    let [ModelMessage::User { content, images }] = &child.messages[..] else {
        panic!("{:?}", child.messages)
    };
    assert!(
        content.starts_with("Describe the printer in the photo.\n\n<attachments>\n"),
        "{content}"
    );
    let child_ids = listed_attachment_ids(content);
    assert_eq!(child_ids.len(), 1, "{content}");
    assert_ne!(child_ids, ids, "an attachment belongs to one conversation");
    assert_eq!(images.as_slice(), [parent_image]);
    assert_eq!(tool_result(&requests[3]), ("A printer, on fire.".to_owned(), false));
}

/// An id not in front of the delegating model refuses the task before any child exists.
#[tokio::test]
async fn a_task_naming_an_attachment_the_conversation_does_not_show_is_refused() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call(
            "task",
            json!({"agent": "summarizer", "prompt": "Describe it.", "attachments": [{"id": "att_elsewhere_0"}]}),
        ),
        ScriptedReply::text("I could not hand it on."),
    ]);
    let runtime = runtime_with(&model, vec![case_agent.into()]);
    let mut events = runtime.observe();
    let reply = runtime
        .init(&case_agent, "case-no-photo")
        .send("Describe the photo.")
        .await
        .unwrap();
    assert_eq!(reply.text, "I could not hand it on.");
    let requests = model.requests();
    assert_eq!(requests.len(), 2, "no child ran");
    assert_eq!(
        tool_result(&requests[1]),
        (
            "Attachment \"att_elsewhere_0\" is not available in this session.".to_owned(),
            true
        )
    );
    while let Ok(observation) = events.try_recv() {
        assert!(
            !matches!(observation.event, Event::TaskStart { .. }),
            "no task started: {:?}",
            observation.event
        );
    }
}

/// A child reattached after a crash reads its images back from its own conversation's
/// attachments: the model sees the prompt's image on every step.
#[tokio::test]
async fn a_reattached_task_child_still_shows_its_delegate_the_image_it_was_handed() {
    for (name, backend) in backends() {
        let model = ScriptedModel::new([ScriptedReply::text("Noted.")]);
        let store = crashing(backend, commits_calls_of("tally"));
        let failures = store.failures.clone();
        let agent = FnAgent::new(AgentDefinition::new("ledger"), tallying_parent(3, false)).into();
        let runtime = harness::runtime_on(store, &model, vec![agent]);
        let handle = runtime.handle("ledger", "l-photo").unwrap();
        handle.send(photo_message("A receipt.", "iVBORw0KGgo=")).await.unwrap();
        let ModelMessage::User { content, images } = &model.requests()[0].messages[0] else {
            panic!("{name}")
        };
        let (ids, photo) = (listed_attachment_ids(content), images[0].clone());
        model.push(ScriptedReply::tool_call(
            "task",
            json!({"agent": "tallier", "prompt": "Tally the receipt.", "attachments": [{"id": ids[0]}]}),
        ));
        model.push(ScriptedReply::tool_call("tally", json!({})));
        model.push(ScriptedReply::text("Seven words."));
        model.push(ScriptedReply::text("The tally is seven."));
        let reply = handle.send("Tally it.").await.unwrap();
        assert_eq!(failures.load(Ordering::SeqCst), 1, "{name}: the crash happened");
        assert_eq!(reply.text, "The tally is seven.", "{name}");
        let requests = model.requests();
        assert_eq!(requests.len(), 5, "{name}");
        // The child's first step, and its step after the reattach.
        for child in [&requests[2], &requests[3]] {
            let ModelMessage::User { content, images } = &child.messages[0] else {
                panic!("{name}: {:?}", child.messages)
            };
            assert!(
                content.starts_with("Tally the receipt.\n\n<attachments>\n"),
                "{name}: {content}"
            );
            assert_eq!(images.as_slice(), std::slice::from_ref(&photo), "{name}");
        }
    }
}

/// The children `count_child` saw created, by parent thread.
static CHILDREN_SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[hook(after_subagent_created)]
async fn count_child(parent: &ThreadState, _child: &ThreadState) {
    CHILDREN_SEEN.lock().unwrap().push(parent.thread_id().to_owned());
}

#[agent(hooks = [count_child])]
fn noting_ledger() -> &'static str {
    use_model("scripted/parent-model");
    use_subagent(tallying_delegate(3));
    "Delegate the tally."
}

/// `after_subagent_created` runs once per child, as `after_thread_created` runs once per
/// thread: a re-attempt that reattaches to a child whose first step never committed does not
/// run it again (a marker in the child's stream records that it ran).
#[tokio::test]
async fn after_subagent_created_runs_once_for_a_child_a_re_attempt_reattaches_to() {
    for (name, backend) in backends() {
        let id = format!("noted-{name}");
        let model = ScriptedModel::new([
            ScriptedReply::tool_call("task", json!({"agent": "tallier", "prompt": "Tally: one two."})),
            // The child's first step: its commit fails, and the parent's attempt with it.
            ScriptedReply::tool_call("tally", json!({})),
            ScriptedReply::tool_call("tally", json!({})),
            ScriptedReply::text("Two words."),
            ScriptedReply::text("The tally is two."),
        ]);
        let store = crashing(backend, |key, records| {
            key.agent.ends_with(":task")
                && records
                    .iter()
                    .any(|record| serde_json::to_value(record).unwrap()["type"] == "assistant_message_completed")
        });
        let failures = store.failures.clone();
        let runtime = harness::runtime_on(store, &model, vec![noting_ledger.into()]);
        let reply = runtime
            .init(&noting_ledger, id.clone())
            .send("Tally it.")
            .await
            .unwrap();
        assert_eq!(failures.load(Ordering::SeqCst), 1, "{name}: the crash happened");
        assert_eq!(reply.text, "The tally is two.", "{name}");
        let runs = CHILDREN_SEEN
            .lock()
            .unwrap()
            .iter()
            .filter(|parent| **parent == id)
            .count();
        assert_eq!(runs, 1, "{name}");
    }
}

/// What each render of the `viewer` delegate was delivered (how many images), per test.
static VIEWER_DELIVERIES: Mutex<Vec<usize>> = Mutex::new(Vec::new());
static LOOKER_DELIVERIES: Mutex<Vec<usize>> = Mutex::new(Vec::new());
static PEERER_DELIVERIES: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// A parent delegating to `viewer`, whose renders note into `deliveries` how many images
/// they were delivered.
fn viewing_parent(
    deliveries: &'static Mutex<Vec<usize>>,
) -> impl Fn(AgentProps<'_>) -> &'static str + Send + Sync + 'static {
    move |_| {
        use_model("scripted/parent-model");
        use_subagent(Subagent::new(
            "viewer",
            "Looks at images and tallies.",
            FnAgent::new(AgentDefinition::new("viewer"), move |_: AgentProps<'_>| {
                let images = match &*use_delivery() {
                    DeliveredMessage::User(message) => message.attachments.len(),
                    DeliveredMessage::Signal(_) => 0,
                };
                deliveries.lock().unwrap().push(images);
                use_tool(
                    Tool::new("tally")
                        .description("Tally the words.")
                        .run(|_ctx, _: serde_json::Map<String, Value>| async { Ok::<_, ToolError>("7 words") }),
                );
                "You look and tally."
            }),
        ));
        "Delegate the looking."
    }
}

/// A photo message, then the script that hands its image to `viewer` (its id read from the
/// first request), with the viewer's tool call, its answer and the parent's.
async fn photo_then_viewing_task(
    handle: &flue_runtime::AgentHandle,
    model: &ScriptedModel,
) -> flue_runtime::provider::ModelImage {
    handle.send(photo_message("A receipt.", "iVBORw0KGgo=")).await.unwrap();
    let ModelMessage::User { content, images } = &model.requests()[0].messages[0] else {
        panic!("{:?}", model.requests()[0].messages)
    };
    let id = listed_attachment_ids(content).remove(0);
    model.push(ScriptedReply::tool_call(
        "task",
        json!({"agent": "viewer", "prompt": "Tally the receipt.", "attachments": [{"id": id}]}),
    ));
    model.push(ScriptedReply::tool_call("tally", json!({})));
    model.push(ScriptedReply::text("Seven words."));
    model.push(ScriptedReply::text("The tally is seven."));
    images[0].clone()
}

/// A reattached child renders with the images its prompt was handed, as its first run did.
#[tokio::test]
async fn a_reattached_task_childs_render_is_delivered_its_images_again() {
    let model = ScriptedModel::new([ScriptedReply::text("Noted.")]);
    let store = crashing(Box::new(MemoryStore::new()), commits_calls_of("tally"));
    let agent = FnAgent::new(AgentDefinition::new("viewing"), viewing_parent(&VIEWER_DELIVERIES)).into();
    let runtime = harness::runtime_on(store.clone(), &model, vec![agent]);
    let handle = runtime.handle("viewing", "v-1").unwrap();
    photo_then_viewing_task(&handle, &model).await;
    let reply = handle.send("Tally it.").await.unwrap();
    assert_eq!(reply.text, "The tally is seven.");
    assert_eq!(store.failures.load(Ordering::SeqCst), 1, "the crash happened");
    assert_eq!(
        *VIEWER_DELIVERIES.lock().unwrap(),
        [1, 1],
        "first run, then the reattach"
    );
}

/// A reattached child whose image is no longer in the store (lost, or damaged past reading)
/// is not run again without it: the call's outcome is unknown, and its result names the
/// child, as when its delegate does not start (the model would otherwise delegate again,
/// repeating the child's work).
#[tokio::test]
async fn a_reattached_task_child_whose_image_is_missing_names_itself_as_outcome_unknown() {
    let model = ScriptedModel::new([ScriptedReply::text("Noted.")]);
    let store = crashing(Box::new(MemoryStore::new()), commits_calls_of("tally"));
    let failures = store.failures.clone();
    // The child's attachments are missing once its step's commit failed (the reattach reads
    // them).
    *store.missing_attachments.lock().unwrap() = Some(Box::new(move |key: &InstanceKey| {
        key.agent.ends_with(":task") && failures.load(Ordering::SeqCst) > 0
    }));
    let agent = FnAgent::new(AgentDefinition::new("peering"), viewing_parent(&PEERER_DELIVERIES)).into();
    let runtime = harness::runtime_on(store.clone(), &model, vec![agent]);
    let handle = runtime.handle("peering", "p-1").unwrap();
    photo_then_viewing_task(&handle, &model).await;
    let reply = handle.send("Tally it.").await.unwrap();
    assert_eq!(store.failures.load(Ordering::SeqCst), 1, "the crash happened");
    // The script's next answer, whatever it says: the parent's model was called next.
    assert_eq!(reply.text, "Seven words.");
    assert_eq!(*PEERER_DELIVERIES.lock().unwrap(), [1], "the child ran once");
    let requests = model.requests();
    assert_eq!(
        requests.len(),
        4,
        "photo, parent, child, parent (the child was not run again)"
    );
    let store: Arc<dyn Store> = Arc::new(store);
    let (_, child) = the_child(&store, &InstanceKey::new("peering", "p-1")).await;
    assert_eq!(
        harness::last_batch_results(&requests[3]),
        [(
            format!(
                r#"{{"type":"interrupted","message":"Tool execution was interrupted before completion. The outcome is unknown.","childConversationId":{}}}"#,
                json!(child.to_string())
            ),
            true
        )]
    );
}

/// A store failure reading the image to hand on fails the attempt (tried again from what is
/// durable), not the task: the re-run hands the image on.
#[tokio::test]
async fn a_failed_read_of_an_image_to_hand_on_is_tried_again_not_answered_as_an_error() {
    let model = ScriptedModel::new([ScriptedReply::text("Noted.")]);
    let store = FaultyStore::on(Arc::new(MemoryStore::new()));
    let agent = FnAgent::new(AgentDefinition::new("looking"), viewing_parent(&LOOKER_DELIVERIES)).into();
    let runtime = harness::runtime_on(store.clone(), &model, vec![agent]);
    let handle = runtime.handle("looking", "l-1").unwrap();
    let photo = photo_then_viewing_task(&handle, &model).await;
    store.failing_attachment_reads.store(1, Ordering::SeqCst);
    let reply = handle.send("Tally it.").await.unwrap();
    assert_eq!(reply.text, "The tally is seven.");
    assert_eq!(store.failures.load(Ordering::SeqCst), 1, "the read failed once");
    let requests = model.requests();
    let child = requests
        .iter()
        .find(|request| request.model == "parent-model" && request.messages.len() == 1
            && matches!(&request.messages[0], ModelMessage::User { content, .. } if content.starts_with("Tally the receipt.")))
        .expect("the child ran");
    let ModelMessage::User { images, .. } = &child.messages[0] else {
        unreachable!()
    };
    assert_eq!(images.as_slice(), [photo]);
    assert_eq!(
        tool_result(requests.last().unwrap()),
        ("Seven words.".to_owned(), false)
    );
}

/// A scripted model whose streams number their tool calls from `usize::MAX` down (a provider
/// of the registry passing a server's numbers through as they come).
#[derive(Clone)]
struct HugeIndices(ScriptedModel);

impl flue_runtime::provider::ModelProvider for HugeIndices {
    fn id(&self) -> &str {
        self.0.id()
    }

    fn stream(&self, request: &ModelRequest) -> flue_runtime::provider::ModelStream {
        use flue_runtime::provider::StreamEvent;
        use futures_util::StreamExt;
        Box::pin(self.0.stream(request).map(|event| {
            event.map(|event| match event {
                StreamEvent::ToolCallStarted { index, id, name } => StreamEvent::ToolCallStarted {
                    index: usize::MAX - index,
                    id,
                    name,
                },
                StreamEvent::ToolCallArguments { index, delta } => StreamEvent::ToolCallArguments {
                    index: usize::MAX - index,
                    delta,
                },
                other => other,
            })
        }))
    }
}

/// A delegate's stream that numbers a call `usize::MAX` is one call found by its number: the
/// child's observer neither allocates a slot per number nor overflows (it panicked, failing
/// the task), and its `toolcall_delta` names the call.
#[tokio::test]
async fn a_delegate_streaming_a_call_numbered_usize_max_runs_it() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("task", json!({"agent": "summarizer", "prompt": "Count: a b c."})),
        ScriptedReply::tool_call("count_words", json!({"text": "a b c"})),
        ScriptedReply::text("Three words."),
        ScriptedReply::text("Done."),
    ]);
    let mut providers = flue_runtime::provider::ProviderRegistry::new();
    providers.register(HugeIndices(model.clone()));
    let runtime = flue_runtime::Runtime::builder()
        .store(flue_runtime::store::MemoryStore::new())
        .providers(providers)
        .agent(case_agent)
        .build()
        .unwrap();
    let mut events = runtime.observe();
    let reply = runtime.init(&case_agent, "huge").send("Count.").await.unwrap();
    assert_eq!(reply.text, "Done.");
    let requests = model.requests();
    assert_eq!(tool_result(&requests[2]), ("3".to_owned(), false));
    assert_eq!(tool_result(&requests[3]), ("Three words.".to_owned(), false));
    let mut child_deltas = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let Event::ToolcallDelta {
            index,
            tool_name,
            tool_call_id,
            ..
        } = observation.event
            && tool_name == "count_words"
        {
            child_deltas.push((index, tool_call_id.is_empty()));
        }
    }
    assert_eq!(child_deltas, [(usize::MAX, false)]);
}

/// What each render of the `imaging_reader` delegate was delivered (how many images).
static IMAGING_READER_DELIVERIES: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// A parent delegating to a reader of long pages that notes into
/// [`IMAGING_READER_DELIVERIES`] how many images each of its renders was delivered; the
/// compaction settings are the parent's, which its task's child inherits.
fn imaging_reading_parent(compaction: Compaction) -> AgentRef {
    FnAgent::new(AgentDefinition::new("scrapbook"), move |_: AgentProps<'_>| {
        use_model_with(
            "scripted/parent-model",
            ModelOptions {
                compaction: compaction.clone(),
                ..ModelOptions::default()
            },
        );
        use_subagent(Subagent::new(
            "reader",
            "Reads long pages about an image.",
            FnAgent::new(AgentDefinition::new("reader"), |_: AgentProps<'_>| {
                let images = match &*use_delivery() {
                    DeliveredMessage::User(message) => message.attachments.len(),
                    DeliveredMessage::Signal(_) => 0,
                };
                IMAGING_READER_DELIVERIES.lock().unwrap().push(images);
                use_reading_tools();
                "You read pages."
            }),
        ));
        "Delegate the reading."
    })
    .into()
}

/// A child reattached after a crash is delivered the images its prompt was handed, also once
/// a compaction summarized the prompt away. (Before, the reattach loaded only the images the
/// compacted history still named, and the delegate's render was delivered the prompt
/// without them.)
#[tokio::test]
async fn a_reattached_child_whose_prompt_was_compacted_away_is_still_delivered_its_images() {
    let model = ScriptedModel::new([ScriptedReply::text("Noted.")]).with_context_window(1500);
    let store = crashing(Box::new(MemoryStore::new()), commits_calls_of("note"));
    let failures = store.failures.clone();
    let runtime = harness::runtime_on(store, &model, vec![imaging_reading_parent(tight_compaction())]);
    let handle = runtime.handle("scrapbook", "s-1").unwrap();
    handle.send(photo_message("A receipt.", "iVBORw0KGgo=")).await.unwrap();
    let ModelMessage::User { content, .. } = &model.requests()[0].messages[0] else {
        panic!("{:?}", model.requests()[0].messages)
    };
    let id = listed_attachment_ids(content).remove(0);
    for reply in [
        ScriptedReply::tool_call(
            "task",
            json!({"agent": "reader", "prompt": READ_PROMPT, "attachments": [{"id": id}]}),
        ),
        ScriptedReply::tool_call("page", json!({})),
        ScriptedReply::tool_call("page", json!({})),
        ScriptedReply::text("The reader read a page about the receipt."),
        // The child's batch of this call is interrupted (the crash).
        ScriptedReply::tool_call("note", json!({})),
        ScriptedReply::text("Two pages."),
        ScriptedReply::text("Read."),
    ] {
        model.push(reply);
    }
    let reply = handle.send("Read about it.").await.unwrap();
    assert_eq!(failures.load(Ordering::SeqCst), 1, "the crash happened");
    assert_eq!(reply.text, "Read.");
    let requests = model.requests();
    assert!(
        requests[4].tools.is_empty(),
        "the child's fourth request summarizes: {requests:#?}"
    );
    assert_eq!(
        *IMAGING_READER_DELIVERIES.lock().unwrap(),
        [1, 1],
        "the first run's render, then the reattached one's"
    );
}
