use flue_runtime::prelude::*;

/// Look something up.
#[tool(terminate, terminate = false)]
async fn lookup(query: String) -> String {
    query
}

fn main() {}
