use flue_runtime::prelude::*;

#[hook(filter_messages, id = my_hook)]
fn limit(_state: &ThreadState, messages: Vec<Message>) -> Vec<Message> {
    messages
}

fn main() {}
