use flue_runtime::prelude::*;

/// Search the notes.
#[tool]
async fn search(#[schemars(rename = "q")] query: String) -> String {
    query
}

fn main() {}
