use flue_runtime::prelude::*;

#[derive(serde::Deserialize, schemars::JsonSchema)]
struct Search {
    query: String,
}

/// Search issues.
#[tool(progress_argument = "titel")]
async fn search(args: Search) -> String {
    args.query
}

fn main() {}
