use flue_runtime::prelude::*;

#[derive(serde::Deserialize, schemars::JsonSchema)]
struct Filters {
    tag: String,
}

/// Search the notes.
#[tool]
async fn search(query: String, #[schemars(flatten)] filters: Filters) -> String {
    format!("{query} {}", filters.tag)
}

fn main() {}
