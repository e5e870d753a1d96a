use flue_runtime::prelude::*;

/// Search the catalog.
#[tool]
async fn search(query: String, #[cfg(feature = "labels")] label: Option<String>) -> String {
    format!("{query} {label:?}")
}

fn main() {}
