use flue_runtime::prelude::*;

#[hook(tool_call_done)]
async fn log_done(_state: &ThreadState, _call: &ToolCall, _result: &ToolResult) -> bool {
    true
}

fn main() {}
