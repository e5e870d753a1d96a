use flue_runtime::prelude::*;

/// Look something up.
#[tool]
fn lookup(query: String) -> String {
    query
}

fn main() {}
