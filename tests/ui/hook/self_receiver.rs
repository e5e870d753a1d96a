use flue_runtime::prelude::*;

#[hook(after_thread_created)]
async fn greet(&self) {}

fn main() {}
