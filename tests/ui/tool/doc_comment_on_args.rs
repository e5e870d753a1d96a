use flue_runtime::prelude::*;

#[derive(serde::Deserialize, schemars::JsonSchema)]
struct Search {
    query: String,
}

/// Search issues.
#[tool]
async fn search(
    /// What to search for
    args: Search,
) -> String {
    args.query
}

fn main() {}
