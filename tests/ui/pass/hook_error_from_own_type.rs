//! A lifecycle hook's `Result` may fail with a type of the application's own that a
//! `HookError` converts from, as well as with any `std::error::Error`.
use flue_runtime::prelude::*;

struct Refusal(&'static str);

impl From<Refusal> for HookError {
    fn from(refusal: Refusal) -> Self {
        HookError::new(refusal.0)
    }
}

#[hook(before_create_message)]
fn refuse_empty(_state: &ThreadState, message: Message) -> Result<Message, Refusal> {
    if message.content.as_deref().is_some_and(str::is_empty) {
        return Err(Refusal("empty"));
    }
    Ok(message)
}

#[hook(before_store_tool_result)]
fn parse_check(_state: &ThreadState, _call: &ToolCall, result: ToolResult) -> Result<ToolResult, std::num::ParseIntError> {
    "7".parse::<u32>()?;
    Ok(result)
}

fn main() {
    let _ = (refuse_empty, parse_check);
}
