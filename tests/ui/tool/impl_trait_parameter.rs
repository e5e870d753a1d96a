use flue_runtime::prelude::*;

/// Look something up.
#[tool]
async fn lookup(query: impl Into<String>) -> String {
    query.into()
}

fn main() {}
