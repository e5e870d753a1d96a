use flue_runtime::prelude::*;

/// Look something up.
#[tool(name = "look up")]
async fn lookup(query: String) -> String {
    query
}

fn main() {}
