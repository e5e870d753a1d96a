use flue_runtime::prelude::*;

#[hook(after_thread_created, crate = flue_runtime)]
fn greet(_state: &ThreadState) {}

fn main() {}
