use flue_runtime::prelude::*;

unsafe fn normalize(query: String) -> String {
    query
}

/// Look something up.
#[tool]
async unsafe fn lookup(query: String) -> String {
    normalize(query)
}

fn main() {}
