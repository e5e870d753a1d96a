use flue_runtime::prelude::*;

#[hook(after_thread_created)]
async fn greet(_state: &ThreadState, _greeting: String) {}

fn main() {}
