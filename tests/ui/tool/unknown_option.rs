use flue_runtime::prelude::*;

/// Look something up.
#[tool(timeout = 5)]
async fn lookup(query: String) -> String {
    query
}

fn main() {}
