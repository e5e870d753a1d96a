use flue_runtime::prelude::*;

/// Look something up.
#[tool(terminate, terminate)]
async fn lookup(query: String) -> String {
    query
}

fn main() {}
