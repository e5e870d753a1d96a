use flue_runtime::prelude::*;

/// Look something up.
#[tool(crate = "1bad")]
async fn lookup(query: String) -> String {
    query
}

fn main() {}
