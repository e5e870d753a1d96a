//! Delegation through the `task` tool: the roster, child sessions, inheritance, the depth cap,
//! instance limits and `after_subagent_created` (issue 8, item 1).
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use std::sync::Mutex;

use flue_runtime::MAX_DELEGATION_DEPTH;
use flue_runtime::events::Event;
use flue_runtime::prelude::*;
use flue_runtime::provider::{ModelMessage, ModelRequest};
use flue_runtime::testing::{ScriptedModel, ScriptedReply, instructions_of};
use serde_json::json;

mod harness;
use harness::runtime_with;

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
            "No agent named \"anyone\" is available for delegation. Available agents: none.".to_owned(),
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
            "No agent named \"auditor\" is available for delegation. Available agents: summarizer.".to_owned(),
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
    assert_eq!(
        content,
        "delegation_depth_exceeded: delegation is limited to 4 nested levels."
    );
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
