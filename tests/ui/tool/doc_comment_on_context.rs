use flue_runtime::prelude::*;

/// Look something up.
#[tool]
async fn lookup(
    /// The call's context
    /// (its secrets and steps)
    ctx: &ToolContext,
    query: String,
) -> String {
    let _ = ctx;
    query
}

fn main() {}
