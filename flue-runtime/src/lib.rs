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
pub mod events;
pub mod http;
pub mod provider;
pub mod record;
mod runtime;
mod session;
pub mod store;
pub mod testing;
mod tools;

pub use flue_macros::{agent, hook, tool};
pub use runtime::{AgentHandle, AgentReply, Runtime, RuntimeBuilder, RuntimeError, RuntimeOptions, SendRequest};
pub use session::MAX_AGENT_FINISH_CYCLES;

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
