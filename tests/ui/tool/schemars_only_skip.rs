use flue_runtime::prelude::*;

/// Search the notes.
#[tool]
async fn search(query: String, #[schemars(skip)] page: u32) -> String {
    format!("{query} {page}")
}

fn main() {}
