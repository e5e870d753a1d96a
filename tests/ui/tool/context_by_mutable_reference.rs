use flue_runtime::prelude::*;

/// Look something up.
#[tool]
async fn lookup(ctx: &mut ToolContext, query: String) -> String {
    let _ = ctx;
    query
}

fn main() {}
