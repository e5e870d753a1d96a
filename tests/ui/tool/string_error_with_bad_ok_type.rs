use flue_runtime::prelude::*;

/// Count something.
#[tool]
async fn count(query: String) -> Result<usize, String> {
    Ok(query.len())
}

fn main() {}
