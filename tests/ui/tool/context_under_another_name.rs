use flue_runtime::prelude::ToolContext as Ctx;
use flue_runtime::prelude::*;

/// Look something up.
#[tool]
async fn lookup(ctx: &Ctx, query: String) -> String {
    let _ = ctx;
    query
}

fn main() {}
