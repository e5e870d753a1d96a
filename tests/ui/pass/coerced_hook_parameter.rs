//! A hook parameter of a `&dyn Trait` type takes the reference its kind passes, coerced.
use std::fmt::Debug;

use flue_runtime::prelude::*;

#[hook(after_create_message)]
fn log_message(_state: &ThreadState, message: &dyn Debug) {
    let _ = format!("{message:?}");
}

#[hook(after_tool_call_success)]
fn log_call(_state: &ThreadState, call: &(dyn Debug + Sync), result: ToolResult) -> ToolResult {
    let _ = format!("{call:?}");
    result
}

#[agent(hooks = [log_message, log_call])]
fn uses_them() -> &'static str {
    use_model("openai/gpt-4o");
    "Log."
}

fn main() {}
