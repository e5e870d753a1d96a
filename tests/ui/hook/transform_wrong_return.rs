use flue_runtime::prelude::*;

#[hook(before_store_tool_result)]
async fn redact(_state: &ThreadState, _call: &ToolCall, result: ToolResult) -> String {
    result.result.unwrap_or_default()
}

fn main() {}
