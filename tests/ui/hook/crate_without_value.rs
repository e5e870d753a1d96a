use flue_runtime::prelude::*;

#[hook(filter_messages, crate)]
fn limit(_state: &ThreadState, messages: Vec<Message>) -> Vec<Message> {
    messages
}

fn main() {}
