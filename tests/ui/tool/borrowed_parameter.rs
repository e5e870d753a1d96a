use flue_runtime::prelude::*;

/// Look something up.
#[tool]
async fn lookup(query: &str) -> String {
    query.to_owned()
}

fn main() {}
