use flue_runtime::prelude::*;

#[hook(tool_call_done, id = "audit", id = "audit_again")]
async fn log_done(_state: &ThreadState, _call: &ToolCall, _result: &ToolResult) {}

fn main() {}
