//! The testing kit: agents are testable offline.
//!
//! - [`ScriptedModel`]: an in-process provider that answers from a script.
//! - [`fixture_server`]: an OpenAI- and Anthropic-compatible HTTP server on loopback, so the
//!   real reqwest path runs in tests.
//! - Re-exports flue-core's in-memory binding and `poll_ready`.

pub mod fixture_server;
mod scripted;

pub use flue_core::testing::*;
pub use scripted::{ScriptedModel, ScriptedReply};
