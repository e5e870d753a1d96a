use flue_runtime::prelude::*;

/// Count something.
#[tool]
async fn count(query: String) -> usize {
    query.len()
}

fn main() {}
