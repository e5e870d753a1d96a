use flue_runtime::prelude::*;

#[hook("filter_messages")]
fn keep(_state: &ThreadState, messages: Vec<Message>) -> Vec<Message> {
    messages
}

fn main() {}
