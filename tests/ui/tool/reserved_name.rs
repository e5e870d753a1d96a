use flue_runtime::prelude::*;

/// Delegate a task.
#[tool(name = "task")]
async fn delegate(prompt: String) -> String {
    prompt
}

fn main() {}
