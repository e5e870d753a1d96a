use flue_runtime::prelude::*;

#[hook(after_thread_created)]
const fn greet(_state: &ThreadState) {}

fn main() {}
