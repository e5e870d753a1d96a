use flue_runtime::prelude::*;

/// Search issues.
#[tool(progress_argument = "titel")]
async fn search(owner: String, query: String) -> String {
    format!("{owner} {query}")
}

fn main() {}
