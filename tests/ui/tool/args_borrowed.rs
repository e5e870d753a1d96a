use flue_runtime::prelude::*;

#[derive(serde::Deserialize, schemars::JsonSchema)]
struct Search {
    query: String,
}

/// Search the issues.
#[tool]
async fn search(args: &Search) -> String {
    args.query.clone()
}

fn main() {}
