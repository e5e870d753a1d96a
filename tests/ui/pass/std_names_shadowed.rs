//! The expansions name standard types by their full paths: user types named like them
//! (`Option`, `Vec`, `String`) in scope change nothing.
#![allow(dead_code)]
use flue_runtime::prelude::*;

struct Option;
struct Vec;
struct String;

#[hook(filter_messages)]
fn keep_all(_state: &ThreadState, messages: std::vec::Vec<Message>) -> std::vec::Vec<Message> {
    messages
}

#[hook(after_system_message)]
fn keep_system(_state: &ThreadState, message: std::string::String) -> std::option::Option<std::string::String> {
    Some(message)
}

/// Look something up.
#[tool]
async fn lookup(query: std::string::String) -> std::string::String {
    query
}

#[agent(hooks = [keep_all, keep_system])]
fn assistant() -> &'static str {
    use_tool(lookup);
    "You help."
}

fn main() {
    assert_eq!(assistant.definition().hooks.len(), 2);
}
