//! # flue-runtime
//!
//! The crate a flue-rs application depends on. It re-exports the render model
//! ([`flue_core`]) so a user crate needs no other flue dependency:
//!
//! ```
//! use flue_runtime::prelude::*;
//!
//! let agent = FnAgent::new(AgentDefinition::new("hello"), |_| {
//!     use_model("openai/gpt-4o-mini");
//!     "Say hello."
//! });
//! let rendered = flue_runtime::render_bare(&agent).unwrap();
//! assert_eq!(rendered.instruction.as_deref(), Some("Say hello."));
//! ```

pub use flue_core::*;

pub mod cli;
pub mod client;
mod compaction;
pub mod events;
mod framework;
pub mod http;
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

pub use flue_macros::{agent, hook, tool};
pub use runtime::{AgentHandle, AgentReply, Runtime, RuntimeBuilder, RuntimeError, RuntimeOptions, SendRequest};
pub use session::MAX_AGENT_FINISH_CYCLES;
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
