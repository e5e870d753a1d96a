use flue_runtime::prelude::*;

#[hook(kind = "filter_messages")]
fn keep(_state: &ThreadState, messages: Vec<Message>) -> Vec<Message> {
    messages
}

fn main() {}
