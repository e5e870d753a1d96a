use flue_runtime::prelude::*;

/// Search issues.
#[tool(progress_argument = "query")]
async fn search(#[serde(rename = "q")] query: String) -> String {
    query
}

fn main() {}
