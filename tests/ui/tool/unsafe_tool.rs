use flue_runtime::prelude::*;

/// Look something up.
#[tool]
async unsafe fn lookup(query: String) -> String {
    query
}

fn main() {}
