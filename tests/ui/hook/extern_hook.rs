use flue_runtime::prelude::*;

#[hook(after_thread_created)]
extern "C" fn greet(_state: &ThreadState) {}

fn main() {}
