use flue_runtime::prelude::*;

/// Look something up.
#[tool(name = "look", name = "find")]
async fn lookup(query: String) -> String {
    query
}

fn main() {}
