//! Subagents: an agent that delegates a focused task to a specialist through the `task` tool.
//!
//! ```sh
//! cargo run --example delegation
//! ```
//!
//! The `summarizer` delegate renders fresh for each task, sees only the task prompt, works with
//! its own tool, and only its final answer returns to the parent. Offline, the scripted model
//! plays both sides.

mod common;

use std::sync::OnceLock;

use flue_runtime::prelude::*;
use flue_runtime::provider::ProviderRegistry;
use flue_runtime::store::MemoryStore;
use flue_runtime::testing::ScriptedReply;
use flue_runtime::{Runtime, RuntimeError};
use serde_json::json;

static MODEL: OnceLock<&'static str> = OnceLock::new();

/// Count the words of a text.
#[tool]
async fn count_words(
    /// The text
    text: String,
) -> String {
    text.split_whitespace().count().to_string()
}

/// The delegate: no model of its own (it inherits the parent's), its own tool.
fn summarizer(_: AgentProps<'_>) -> &'static str {
    use_tool(count_words);
    "You summarize one support case in two sentences, and say how many words the case has."
}

#[agent]
fn case_agent() -> &'static str {
    use_model(*MODEL.get().unwrap_or(&"scripted/example"));
    use_subagent(Subagent::new(
        "summarizer",
        "Summarizes one support case; give it the whole case text.",
        FnAgent::new(AgentDefinition::new("summarizer"), summarizer),
    ));
    "You triage support cases. Delegate the summary of a case to the `summarizer` agent, with the full case text in the prompt."
}

#[tokio::main]
async fn main() -> Result<(), RuntimeError> {
    let mut providers = ProviderRegistry::with_defaults();
    let (model, notice) = common::choose_model(
        &mut providers,
        vec![
            ScriptedReply::tool_call(
                "task",
                json!({"agent": "summarizer", "prompt": "Summarize: the printer on floor 3 jams on every duplex job since the update."}),
            ),
            ScriptedReply::tool_call(
                "count_words",
                json!({"text": "the printer on floor 3 jams on every duplex job since the update"}),
            ),
            ScriptedReply::text("Floor 3's printer jams on duplex jobs since an update (13 words)."),
            ScriptedReply::text("Summary from the specialist: floor 3's printer jams on duplex jobs since the update."),
        ],
    );
    let _ = MODEL.set(model);
    println!("{notice}");
    let runtime = Runtime::builder()
        .agent(case_agent)
        .providers(providers)
        .store(MemoryStore::new())
        .build()?;
    let mut events = runtime.observe();
    let reply = runtime
        .init(&case_agent, "case-7")
        .send("Case 7: the printer on floor 3 jams on every duplex job since the update.")
        .await?;
    common::observed(&mut events, |observation| match observation.event {
        flue_runtime::events::Event::TaskStart { agent, .. } => println!("task started: {agent}"),
        flue_runtime::events::Event::Task {
            agent,
            is_error,
            duration_ms,
            ..
        } => {
            println!("task ended:   {agent} (error: {is_error}, {duration_ms} ms)");
        }
        _ => {}
    });
    println!("reply: {}", reply.text);
    Ok(())
}
