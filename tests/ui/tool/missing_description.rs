use flue_runtime::prelude::*;

#[tool]
async fn lookup(query: String) -> String {
    query
}

fn main() {}
