use flue_runtime::prelude::*;

#[hook]
async fn audit(_state: &ThreadState) {}

fn main() {}
