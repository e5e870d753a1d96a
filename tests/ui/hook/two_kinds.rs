use flue_runtime::prelude::*;

#[hook(after_create_message, after_update_message)]
async fn audit(_state: &ThreadState, _message: &Message) {}

fn main() {}
