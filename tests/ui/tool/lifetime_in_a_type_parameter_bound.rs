use flue_runtime::prelude::*;

/// Where a tool looks things up, for as long as `'a`.
trait Lookup<'a>: Send + Sync + 'static {}

#[derive(serde::Deserialize, schemars::JsonSchema)]
struct Query {
    text: String,
}

/// Looks something up.
#[tool]
async fn look_up<'a, L: Lookup<'a>>(_ctx: &'a ToolContext, args: Query) -> String {
    args.text
}

fn main() {}
