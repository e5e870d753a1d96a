use flue_runtime::prelude::*;

/// Search the catalog.
#[tool]
async fn search(#[cfg_attr(feature = "short-names", serde(rename = "q"))] query: String) -> String {
    query
}

fn main() {}
