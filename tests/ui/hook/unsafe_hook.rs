use flue_runtime::prelude::*;

#[hook(after_thread_created)]
unsafe fn greet(_state: &ThreadState) {}

fn main() {}
