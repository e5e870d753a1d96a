use flue_runtime::prelude::*;

#[hook(after_thread_created, crate = "1bad")]
async fn greet(_state: &ThreadState) {}

fn main() {}
