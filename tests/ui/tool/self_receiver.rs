use flue_runtime::prelude::*;

/// Search issues.
#[tool]
async fn search(&self, query: String) -> String {
    query
}

fn main() {}
