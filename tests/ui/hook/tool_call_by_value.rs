use flue_runtime::prelude::*;

#[hook(before_store_tool_result)]
fn keep(_state: &ThreadState, call: ToolCall, result: ToolResult) -> ToolResult {
    let _ = call;
    result
}

fn main() {}
