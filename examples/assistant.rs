//! The main example: a support assistant, run end to end by the runtime.
//!
//! ```sh
//! cargo run --example assistant                  # a short conversation, printed
//! cargo run --example assistant -- serve         # serve it over HTTP on 127.0.0.1:3583
//! cargo run --example assistant -- run assistant --id customer-7 "Where is order A-1001?"
//! cargo run --example assistant -- catalog       # its tools, hooks and schemas as JSON
//! ```
//!
//! With `OPENAI_API_KEY`, `ANTHROPIC_API_KEY` or `OPENROUTER_API_KEY` set it talks to that
//! provider; otherwise it uses the scripted model (offline) and says so. The agent has a
//! model, two tools, persistent state, a data writer, and start/finish hooks. Conversations
//! are stored in the embedded SQLite store (`.flue/flue.db`), so a second run continues the
//! first one's conversation.

use std::io::Write;
use std::sync::OnceLock;

use flue_runtime::prelude::*;
use flue_runtime::provider::ProviderRegistry;
use flue_runtime::testing::{ScriptedModel, ScriptedReply};
use flue_runtime::{Runtime, RuntimeError};
use serde::Serialize;
use serde_json::json;

/// A server binary picks its allocator, and the runtime's turn allocates a great deal: mimalloc
/// takes about a fifth off its instructions next to glibc's `malloc` (the README's Benchmarks).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The model specifier, chosen once at startup from the environment.
static MODEL: OnceLock<&'static str> = OnceLock::new();

#[derive(Serialize, schemars::JsonSchema)]
struct Progress {
    step: String,
}

/// Look up the status of an order by its number.
#[tool(progress_argument = "order")]
async fn lookup_order(
    /// The order number, e.g. "A-1001"
    order: String,
) -> Result<String, ToolError> {
    if order.trim().is_empty() {
        return Err(ToolError::new("An order number is required."));
    }
    Ok(format!("Order {order} shipped yesterday and arrives Thursday."))
}

/// Hand the conversation to a human agent.
#[tool(terminate)]
async fn escalate(
    /// Why a person is needed
    reason: String,
) -> String {
    format!("Escalated to a human: {reason}")
}

/// Answers questions about orders.
#[agent(max_steps = 6)]
fn assistant() -> String {
    use_model(*MODEL.get().unwrap_or(&"scripted/assistant"));
    let (lookups, set_lookups) = use_persistent_state("lookups", 0u32);
    let progress = use_data_writer::<Progress>("progress");
    use_tool(lookup_order);
    use_tool(escalate);
    use_agent_start(move |ctx| {
        let progress = progress.clone();
        async move {
            progress.write(&Progress {
                step: format!("reading: {}", ctx.delivery().body()),
            })?;
            Ok::<_, flue_runtime::binding::DataWriteError>(())
        }
    });
    use_agent_finish(move |ctx| {
        let set_lookups = set_lookups.clone();
        async move {
            let looked_up = ctx
                .response()
                .tool_calls
                .iter()
                .filter(|call| call.tool == "lookup_order")
                .count() as u32;
            set_lookups.update(|n| n + looked_up)?;
            Ok::<_, flue_runtime::binding::StateWriteError>(())
        }
    });
    use_response_start(|_| json!({"channel": "example"}));
    format!(
        "You are a friendly support assistant. Use lookup_order before answering questions about an order; \
         escalate when the customer asks for a person. You have looked up {lookups} orders for this customer so far."
    )
}

/// The model to use, and a line saying which and why.
fn choose_model(providers: &mut ProviderRegistry) -> (&'static str, &'static str) {
    // As the providers read a key: one of spaces only is none.
    let has = |name: &str| std::env::var(name).is_ok_and(|value| !value.trim().is_empty());
    if has("OPENAI_API_KEY") {
        (
            "openai/gpt-4o-mini",
            "model: openai/gpt-4o-mini (OPENAI_API_KEY is set)",
        )
    } else if has("ANTHROPIC_API_KEY") {
        (
            "anthropic/claude-sonnet-4-5",
            "model: anthropic/claude-sonnet-4-5 (ANTHROPIC_API_KEY is set)",
        )
    } else if has("OPENROUTER_API_KEY") {
        (
            "openrouter/openai/gpt-4o-mini",
            "model: openrouter/openai/gpt-4o-mini (OPENROUTER_API_KEY is set)",
        )
    } else {
        // The script first; after it, the model echoes, so any further message (a served
        // conversation) still gets an answer.
        let scripted = ScriptedModel::echo().with_id("scripted").without_recording();
        scripted.push(ScriptedReply::tool_call("lookup_order", json!({"order": "A-1001"})));
        scripted.push(ScriptedReply::text(
            "Your order A-1001 shipped yesterday and arrives Thursday.",
        ));
        scripted.push(ScriptedReply::text("Happy to help with anything else."));
        providers.register(scripted);
        (
            "scripted/assistant",
            "model: scripted (offline: no OPENAI_API_KEY, ANTHROPIC_API_KEY or OPENROUTER_API_KEY is set)",
        )
    }
}

#[tokio::main]
async fn main() {
    if let Err(error) = converse().await {
        // A closed stderr is no reason to panic either.
        let _ = writeln!(std::io::stderr(), "error: {error}");
        std::process::exit(1);
    }
}

async fn converse() -> Result<(), RuntimeError> {
    let command = flue_runtime::cli::Cli::from_env().command;
    // The runtime's warnings (a store it could not lock, a provider retried) on stderr, from
    // the start: opening the store may warn. `cli::run` keeps this subscriber.
    flue_runtime::cli::log_to_stderr();
    let mut providers = ProviderRegistry::with_defaults();
    let (model, notice) = choose_model(&mut providers);
    let _ = MODEL.set(model);
    // No store configured: the embedded SQLite store in .flue/flue.db, so the customer's
    // conversation and state carry over from one run to the next.
    let runtime = Runtime::builder().agent(assistant).providers(providers).build()?;
    if let Some(command) = command {
        // A command's output is stdout (JSON for `catalog` and `run --json`): notes go to stderr.
        eprintln!("{notice}\nstore: embedded SQLite at .flue/flue.db");
        std::process::exit(flue_runtime::cli::run(&runtime, command).await);
    }
    show(&format!("{notice}\nstore: embedded SQLite at .flue/flue.db"));
    // Resume anything a previous run left unfinished.
    runtime.start().await;
    let customer = runtime.init(&assistant, "customer-42");

    for message in ["Where is my order A-1001?", "Thanks!"] {
        show(&format!("\nuser:      {message}"));
        let reply = customer.send(message).await?;
        // The model's text as a terminal shows it (no escape sequence acts).
        show(&format!("assistant: {}", flue_runtime::cli::printable(&reply.text)));
        let (data, metadata) = (
            serde_json::Value::Object(reply.data).to_string(),
            serde_json::Value::Object(reply.metadata).to_string(),
        );
        show(&format!("data:      {}", flue_runtime::cli::printable(&data)));
        show(&format!("metadata:  {}", flue_runtime::cli::printable(&metadata)));
    }
    show("\nServe it over HTTP with: cargo run --example assistant -- serve");
    Ok(())
}

/// Writes `line` to stdout, which may be closed (`| head`): the conversation goes on.
fn show(line: &str) {
    let _ = writeln!(std::io::stdout(), "{line}");
}
