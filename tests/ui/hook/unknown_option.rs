use flue_runtime::prelude::*;

#[hook(after_thread_created, order = "first")]
async fn audit(_state: &ThreadState) {}

fn main() {}
