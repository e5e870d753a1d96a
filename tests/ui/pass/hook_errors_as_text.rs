//! A `#[hook]` function may fail with text or with any error that displays, as a tool may: its
//! text becomes the `HookError`'s message. A `HookError` itself is read as it is.
use std::fmt;

use flue_runtime::prelude::*;

#[hook(before_create_message)]
async fn text_error(_state: &ThreadState, message: Message) -> Result<Message, String> {
    Err(format!("no room for {:?}", message.id))
}

#[hook(after_create_message)]
fn static_text_error(_state: &ThreadState, _message: &Message) -> Result<(), &'static str> {
    Err("the audit log is down")
}

#[hook(after_system_message)]
fn boxed_error(_state: &ThreadState, prompt: String) -> Result<String, Box<dyn std::error::Error + Send + Sync>> {
    if prompt.is_empty() {
        return Err("an empty prompt".into());
    }
    Ok(prompt)
}

/// An error that displays but is no `std::error::Error`, as `anyhow::Error` is.
struct Displayed;

impl fmt::Display for Displayed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("displayed")
    }
}

#[hook(after_tool_call_failure)]
async fn displayed_error(
    _state: &ThreadState,
    _call: &ToolCall,
    _result: ToolResult,
) -> Result<Option<ToolResult>, Displayed> {
    Err(Displayed)
}

#[hook(prefilter_llm_history)]
fn blocking_error(_state: &ThreadState, history: Vec<LlmMessage>) -> Result<Vec<LlmMessage>, HookError> {
    if history.is_empty() {
        return Err(HookError::block("nothing to send"));
    }
    Ok(history)
}

#[hook(filter_messages)]
fn io_error(_state: &ThreadState, messages: Vec<Message>) -> Result<Vec<Message>, std::io::Error> {
    Ok(messages)
}

#[agent(hooks = [text_error, static_text_error, boxed_error, displayed_error, blocking_error, io_error])]
fn guarded() -> &'static str {
    use_model("openai/gpt-4.1");
    "Guarded."
}

fn main() {}
