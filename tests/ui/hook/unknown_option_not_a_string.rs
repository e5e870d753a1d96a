use flue_runtime::prelude::*;

#[hook(filter_messages, ids = my_hook)]
fn limit(_state: &ThreadState, messages: Vec<Message>) -> Vec<Message> {
    messages
}

fn main() {}
