use flue_runtime::prelude::*;

/// Look something up.
#[tool]
async fn lookup(query: String, ctx: &mut ToolContext) -> String {
    let _ = ctx;
    query
}

fn main() {}
