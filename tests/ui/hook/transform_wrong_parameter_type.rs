use flue_runtime::prelude::*;

#[hook(filter_messages)]
async fn keep_recent(_state: &ThreadState, messages: Vec<String>) -> Vec<Message> {
    let _ = messages;
    Vec::new()
}

fn main() {}
