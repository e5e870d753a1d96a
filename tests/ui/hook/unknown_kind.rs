use flue_runtime::prelude::*;

#[hook(before_tool_call)]
async fn audit(_state: &ThreadState) {}

fn main() {}
