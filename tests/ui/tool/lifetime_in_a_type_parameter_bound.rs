use flue_runtime::prelude::*;

/// Where a tool looks things up, for as long as `'a`.
trait Lookup<'a>: Send + Sync + 'static {}

/// Looks something up.
#[tool]
async fn look_up<'a, L: Lookup<'a>>(_ctx: &'a ToolContext, args: String) -> String {
    args
}

fn main() {}
