//! # flue-runtime
//!
//! The crate a flue-rs application depends on: it runs agents written in the hooks style.
//! An agent is a synchronous function whose body calls hooks and returns its instruction; the
//! runtime renders it again before every model call, calls the model, runs the tools it asks
//! for, and keeps every conversation durable in a store (the embedded SQLite store unless you
//! configure another). It re-exports the render model ([`flue_core`]) and the attributes, so a
//! user crate needs no other flue dependency.
//!
//! ```
//! use flue_runtime::prelude::*;
//! use flue_runtime::provider::ProviderRegistry;
//! use flue_runtime::store::MemoryStore;
//! use flue_runtime::testing::{ScriptedModel, ScriptedReply};
//! use flue_runtime::Runtime;
//! use serde_json::json;
//!
//! /// Add two numbers.
//! #[tool]
//! async fn add(a: i64, b: i64) -> String {
//!     (a + b).to_string()
//! }
//!
//! /// Adds numbers, and remembers how many questions it answered.
//! #[agent]
//! fn calculator() -> String {
//!     use_model("scripted/calc");
//!     use_tool(add);
//!     let (answered, set_answered) = use_persistent_state("answered", 0u32);
//!     use_agent_finish(move |_| {
//!         let set_answered = set_answered.clone();
//!         async move { set_answered.update(|n| n + 1) }
//!     });
//!     format!("You add numbers. You have answered {answered} questions so far.")
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Offline, a scripted model stands in for a provider (`ProviderRegistry::with_defaults()`
//! // has `openai`, `anthropic` and `openrouter`, keyed from the environment).
//! let model = ScriptedModel::new([
//!     ScriptedReply::tool_call("add", json!({"a": 2, "b": 3})),
//!     ScriptedReply::text("2 + 3 = 5"),
//! ]);
//! let mut providers = ProviderRegistry::new();
//! providers.register(model.clone());
//! let runtime = Runtime::builder()
//!     .store(MemoryStore::new()) // without this line: SQLite in .flue/flue.db
//!     .agent(calculator)
//!     .providers(providers)
//!     .build()?;
//!
//! let reply = runtime.init(&calculator, "customer-7").send("What is 2 + 3?").await?;
//! assert_eq!(reply.text, "2 + 3 = 5");
//! // Two model calls, the second after the tool's result; each rendered the agent afresh.
//! assert_eq!(model.requests().len(), 2);
//! # Ok(())
//! # }
//! ```
//!
//! Where to go next: [`Runtime`] (dispatch, `init`/`send`, `observe`), [`http`] (serving the
//! streaming protocol), [`store`] (SQLite, Postgres, the memory store), [`provider`] (model
//! providers and the registry), [`testing`] (the scripted model and the loopback fixture
//! server), [`events`] (live events) and [`lifecycle`] (lifecycle hooks and `ThreadState`).

pub use flue_core::*;

pub mod cli;
pub mod client;
mod compaction;
pub mod events;
mod fast_map;
mod framework;
pub mod http;
mod json_shape;
pub mod lifecycle;
pub mod mcp;
pub mod provider;
pub mod record;
pub mod resources;
mod runtime;
pub mod sandbox;
mod session;
mod skills;
pub mod store;
mod subagents;
pub mod testing;
mod tools;

pub use compaction::SUMMARY_INSTRUCTIONS;
pub use flue_macros::{agent, hook, tool};
pub use json_shape::{MAX_JSON_CONTAINERS, MAX_JSON_VALUES};
pub use runtime::{
    AgentHandle, AgentReply, MAX_INSTANCE_ID_CHARS, MAX_MODEL_RETRY_WAIT, MAX_RETRY_AFTER_WAIT, OBSERVED_BACKLOG,
    Runtime, RuntimeBuilder, RuntimeError, RuntimeOptions, SendRequest,
};
pub use session::{MAX_AGENT_FINISH_CYCLES, MAX_QUEUED_TOOL_STEPS};
pub use skills::{MAX_WORKSPACE_SKILL_ENTRIES, MAX_WORKSPACE_SKILLS};
pub use subagents::MAX_DELEGATION_DEPTH;

/// An error and its sources, joined with `: ` (a source already quoted by its parent is not
/// repeated).
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Everything an application author needs.
pub mod prelude {
    pub use flue_core::lifecycle::{
        ClientInfo, HookError, LlmMessage, Message, MessageUpdates, ToolCall, ToolResult, ToolStatus,
    };
    pub use flue_core::prelude::*;
    pub use flue_macros::{agent, hook, tool};
}

/// What generated code reaches dependencies through, so a user crate that depends on
/// `flue-runtime` alone compiles. Not a public API.
#[doc(hidden)]
pub mod __private {
    pub use flue_core;
    pub use schemars;
    pub use serde;
    pub use serde_json;
}
