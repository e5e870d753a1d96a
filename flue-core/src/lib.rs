//! # flue-core
//!
//! The render model of flue-rs: agents are synchronous functions whose body calls *hooks*
//! (`use_model`, `use_tool`, `use_persistent_state`, …). The runtime renders the agent before
//! every model call; each hook records onto a thread-local render frame, and the render returns
//! a [`Rendered`] declaration. This crate holds the frame, every hook, the rules of hooks with
//! the reference's messages, and the definitions the runtime consumes. It does no I/O.
//!
//! ```
//! use flue_core::prelude::*;
//!
//! let support = FnAgent::new(AgentDefinition::new("support"), |_props| {
//!     use_model("anthropic/claude-sonnet-4-5");
//!     let (tier, _set_tier) = use_persistent_state("tier", "free".to_owned());
//!     use_instruction(format!("The customer is on the {tier} plan."));
//!     "You answer support questions."
//! });
//!
//! let rendered = flue_core::render_bare(&support).unwrap();
//! assert_eq!(rendered.model.unwrap().spec, "anthropic/claude-sonnet-4-5");
//! assert_eq!(
//!     rendered.instruction.as_deref(),
//!     Some("You answer support questions.\n\nThe customer is on the free plan."),
//! );
//! ```
//!
//! ## The rules of hooks
//!
//! - Hooks run only while an agent function renders, on the thread that renders it; anywhere
//!   else they panic with `[flue] <hook>() was called outside an agent function. …` (on a
//!   helper thread the body spawned, that thread panics, and the render fails with what the
//!   body makes of it: `std::thread::scope`'s own "a scoped thread panicked"). The attributes
//!   refuse at compile time the calls that can never run in a render: in a `#[tool]` or
//!   `#[hook]` body, and in an agent's `async` blocks, seam callbacks and closures given to
//!   `thread::spawn` or a `spawn` method (also in the arguments of the standard library's
//!   expression macros there, `format!`, `vec!`, …).
//! - Renders never nest; an agent function that calls another agent's render panics.
//! - `use_model` and `use_sandbox` at most once per render; names are unique per render
//!   (tools, skills, subagents, state, data parts, MCP servers). Where `#[agent]` can tell,
//!   it refuses these at compile time: a repeated call among the body's top-level statements
//!   (`use_model`, `use_sandbox`, `use_tool` of one tool, `use_hooks` of one hook, state or
//!   data parts of one literal name), which every render would run (statements under `cfg`
//!   or after a `return` aside).
//! - Writers (state setters, data writers, the dispatcher) panic during a render.
//! - Data-writer names are identical on every render of a response.
//! - Instance-scoped and client-facing hooks panic in a subagent render.
//!
//! Every hook is `#[track_caller]`: a misuse panics at the user's line.

// The rules of hooks, a panicking render, a stored state value that no longer fits its type
// and a panicking tool or hook are each caught (`catch_unwind`) and reported as the failure
// of their render, call or submission: under `panic = "abort"` the first of them would end the
// whole process, every instance with it.
#[cfg(panic = "abort")]
compile_error!(
    "flue-rs needs `panic = \"unwind\"` (the default): it catches the panics of renders, tools and hooks and reports them as failures; under `panic = \"abort\"` one would end the process"
);

pub mod abort;
pub mod agent;
pub mod binding;
pub mod data;
mod error;
pub mod event_hooks;
pub mod hooks;
pub mod lifecycle;
pub mod log;
pub mod mcp;
pub mod message;
pub mod metadata;
pub mod model;
pub mod render;
pub mod sandbox;
pub mod skill;
pub mod state;
pub mod subagent;
pub mod testing;
pub mod tool;
pub mod url;
pub mod usage;

use std::future::Future;
use std::pin::Pin;

pub use agent::{Agent, AgentDefinition, AgentProps, AgentRef, FnAgent, Instruction};
pub use error::{RenderError, ToolNameConflict, ToolNameConflictError};
pub use render::{
    RenderKind, RenderState, Rendered, is_rendering, render, render_bare, render_into, try_render, try_render_into,
};
pub use tool::{Tool, ToolContext, ToolError, ToolOutput};

/// A boxed, `Send` future: what the runtime-facing traits return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// An async tool or hook body's future, asserted `Send` where `#[tool]` and `#[hook]` span the
/// call: at the function's `async`, so a value held across an `.await` that is not `Send` is
/// reported at the user's function rather than inside the expansion.
#[doc(hidden)]
pub fn send_body<F: Future + Send>(body: F) -> F {
    body
}

/// A description that a macro writes at least partly (`#[doc = include_str!(..)]` on a
/// `#[tool]` or an `#[agent]`), as the attributes expand it: without the blank lines around it
/// and the whitespace at its end. Its first line keeps its indentation, as a `///` description's
/// does once unindented; a blank one becomes `""`.
#[doc(hidden)]
pub const fn doc_description(text: &str) -> &str {
    let bytes = text.as_bytes();
    let mut start = 0;
    let mut index = 0;
    while index < bytes.len() && bytes[index].is_ascii_whitespace() {
        if bytes[index] == b'\n' {
            start = index + 1;
        }
        index += 1;
    }
    let (_, rest) = bytes.split_at(start);
    // `start` follows a `\n`, on a character boundary, so this always succeeds.
    match std::str::from_utf8(rest) {
        Ok(rest) => rest.trim_ascii_end(),
        Err(_) => text.trim_ascii(),
    }
}

/// Everything an agent author needs: the hooks and the types they take and return.
pub mod prelude {
    pub use crate::abort::AbortSignal;
    pub use crate::agent::{Agent, AgentDefinition, AgentProps, AgentRef, Durability, FnAgent, HookStage, Instruction};
    pub use crate::data::DataSchema;
    pub use crate::event_hooks::{AgentFinishContext, AgentStartContext, ResponseFinishContext, ResponseStartContext};
    pub use crate::hooks::*;
    pub use crate::lifecycle::{ThreadHook, ThreadState, UserHook, UserState};
    pub use crate::mcp::McpConnection;
    pub use crate::message::{DeliveredMessage, Signal};
    pub use crate::metadata::Metadata;
    pub use crate::model::{Compaction, CompactionConfig, ModelOptions, ThinkingLevel};
    pub use crate::render::{RenderState, Rendered};
    pub use crate::sandbox::{SandboxFactory, SandboxOptions};
    pub use crate::skill::Skill;
    pub use crate::subagent::Subagent;
    pub use crate::tool::{IntoTool, Secret, Tool, ToolContext, ToolError, ToolHandler, ToolOutput};
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_macro_written_description_loses_its_surrounding_blank_lines_only() {
        assert_eq!(
            super::doc_description(" \n\t\n    code\n  more  \n \n"),
            "    code\n  more"
        );
        assert_eq!(super::doc_description("Text."), "Text.");
        assert_eq!(super::doc_description(" \n \n"), "");
        assert_eq!(super::doc_description(""), "");
    }
}
