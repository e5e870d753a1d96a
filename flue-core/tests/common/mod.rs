//! Helpers shared by the flue-core tests.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping
#![allow(dead_code)]

use std::panic::{AssertUnwindSafe, catch_unwind};

use flue_core::prelude::*;

/// An agent named `test_agent` whose body is `body`.
pub fn agent<F, I>(body: F) -> FnAgent<F>
where
    F: Fn(AgentProps<'_>) -> I + Send + Sync + 'static,
    I: Into<Instruction>,
{
    FnAgent::new(AgentDefinition::new("test_agent"), body)
}

/// Runs `f`, expecting a panic, and returns its message.
pub fn panic_message_of<R>(f: impl FnOnce() -> R) -> String {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(_) => panic!("expected a panic, but the call returned"),
        Err(payload) => flue_core::render::panic_message(payload.as_ref()),
    }
}

/// Renders `agent` bare, expecting the body to panic; returns the panic message.
pub fn render_panic<A: Agent>(agent: &A) -> String {
    match flue_core::try_render(agent, &RenderState::bare()) {
        Err(flue_core::RenderError::Panicked { message, .. }) => message,
        other => panic!("expected the render to panic, got {other:?}"),
    }
}

/// Renders `agent` as a subagent, expecting a panic; returns the message.
pub fn subagent_render_panic<A: Agent>(agent: &A) -> String {
    let delivery = std::sync::Arc::new(DeliveredMessage::user("task prompt"));
    match flue_core::try_render(agent, &RenderState::subagent(&delivery)) {
        Err(flue_core::RenderError::Panicked { message, .. }) => message,
        other => panic!("expected the render to panic, got {other:?}"),
    }
}

/// A do-nothing sandbox factory.
pub struct NoSandbox;

impl SandboxFactory for NoSandbox {
    fn create_sandbox(
        &self,
        _instance_id: &str,
    ) -> flue_core::BoxFuture<
        'static,
        Result<std::sync::Arc<dyn flue_core::sandbox::Sandbox>, flue_core::sandbox::SandboxError>,
    > {
        Box::pin(async { Err(flue_core::sandbox::SandboxError::Unsupported("anything")) })
    }
}

/// A tool named `name` that echoes its input.
pub fn echo_tool(name: &'static str) -> Tool {
    Tool::new(name)
        .description("Echo the input.")
        .run(|_ctx, args: serde_json::Map<String, serde_json::Value>| async move { serde_json::Value::Object(args) })
}
