use flue_runtime::prelude::*;

/// Look something up.
#[tool]
async fn lookup(#[serde(default)] ctx: &ToolContext, query: String) -> String {
    let _ = ctx;
    query
}

fn main() {}
