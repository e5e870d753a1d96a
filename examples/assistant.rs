//! The main example: a support assistant written with the Agent Hooks API.
//!
//! Until the runtime lands, this example renders the agent the way the runtime will before
//! every model call, prints what the render declared, and runs one of its tools against an
//! in-memory binding — so you can see the render model work end to end, offline.
//!
//! Run it with `cargo run --example assistant`.

use std::sync::Arc;

use flue_runtime::prelude::*;
use flue_runtime::state::StateSnapshot;
use flue_runtime::testing::{TestBinding, poll_ready};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, schemars::JsonSchema)]
struct OrderLookup {
    /// The order number, e.g. "A-1001".
    order: String,
}

#[derive(Serialize, schemars::JsonSchema)]
struct Progress {
    step: String,
}

/// A custom hook: the order tools and their instruction, reusable across agents.
fn use_order_tools(progress: DataWriter<Progress>, set_lookups: StateSetter<u32>) {
    use_tool(
        Tool::new("lookup_order")
            .description("Look up the status of an order by its number.")
            .run(move |_ctx, args: OrderLookup| {
                let progress = progress.clone();
                let set_lookups = set_lookups.clone();
                async move {
                    progress.write(&Progress {
                        step: format!("looking up {}", args.order),
                    })?;
                    set_lookups.update(|n| n + 1)?;
                    Ok::<_, ToolError>(format!("Order {} shipped yesterday.", args.order))
                }
            }),
    );
    use_tool(
        Tool::new("escalate")
            .description("Hand the conversation to a human agent.")
            .terminate()
            .run(|_ctx, _: serde_json::Map<String, serde_json::Value>| async { "Escalated to a human." }),
    );
    use_instruction("Use lookup_order before answering questions about an order.");
}

fn assistant() -> impl Agent {
    FnAgent::new(
        AgentDefinition::new("assistant")
            .description("Answers order questions.")
            .max_steps(6),
        |_props| {
            use_model_with("openai/gpt-4o-mini", ModelOptions::thinking(ThinkingLevel::Low));
            let (lookups, set_lookups) = use_persistent_state("lookups", 0u32);
            let progress = use_data_writer::<Progress>("progress");
            use_order_tools(progress, set_lookups);
            use_agent_start(|ctx| async move {
                ctx.log().info(format!("starting on: {}", ctx.delivery().body()));
            });
            use_agent_finish(|_ctx| async {});
            use_response_start(|_ctx| serde_json::json!({"channel": "example"}));
            format!("You are a friendly support assistant. You have looked up {lookups} orders so far.")
        },
    )
}

fn main() {
    println!(
        "flue-rs example `assistant` (offline: renders the agent; the runtime that calls models is not built yet)\n"
    );
    let agent = assistant();
    let binding = TestBinding::with_snapshot(StateSnapshot::from_iter([("lookups".to_owned(), serde_json::json!(2))]));
    let runtime = binding.as_binding();
    let delivery = Arc::new(DeliveredMessage::user("Where is order A-1001?"));
    let state = RenderState::root("customer-42")
        .with_state(&*binding)
        .with_binding(&runtime)
        .with_delivery(&delivery);

    let rendered = match flue_runtime::try_render(&agent, &state) {
        Ok(rendered) => rendered,
        Err(error) => {
            eprintln!("render failed: {error}");
            std::process::exit(1);
        }
    };
    let model = rendered.require_model().expect("the assistant declares a model");
    println!(
        "model:        {} (thinking: {:?})",
        model.spec, model.options.thinking_level
    );
    println!(
        "tools:        {:?}",
        rendered.tools.iter().map(Tool::name).collect::<Vec<_>>()
    );
    println!("state:        {:?}", rendered.state_names);
    println!("data parts:   {:?}", rendered.data_writer_names());
    println!(
        "event hooks:  {} start, {} finish, {} response start, {} response finish",
        rendered.agent_starts.len(),
        rendered.agent_finishes.len(),
        rendered.response_starts.len(),
        rendered.response_finishes.len()
    );
    println!(
        "instruction:\n  {}\n",
        rendered.instruction.as_deref().unwrap_or("").replace('\n', "\n  ")
    );

    let tool = rendered.tool("lookup_order").expect("mounted").clone();
    let output = poll_ready(tool.call(
        ToolContext::new(&tool, "call_1"),
        serde_json::json!({"order": "A-1001"}),
    ));
    println!("lookup_order -> {}", output.to_text());
    println!("data writes  -> {:?}", binding.data_writes());
    println!("state writes -> {:?}", binding.state().pending());

    let rerendered = flue_runtime::render(&agent, &state.with_previous_data_writers(&rendered.data_writer_names()))
        .expect("re-render");
    println!(
        "\nre-render sees the uncommitted write:\n  {}",
        rerendered.instruction.as_deref().unwrap_or("")
    );
}
