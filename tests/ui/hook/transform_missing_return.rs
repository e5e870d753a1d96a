use flue_runtime::prelude::*;

#[hook(before_store_tool_result)]
async fn redact(_state: &ThreadState, _call: &ToolCall, _result: ToolResult) {}

fn main() {}
