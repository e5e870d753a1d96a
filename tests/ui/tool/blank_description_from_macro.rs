use flue_runtime::prelude::*;

#[doc = concat!(" ", "")]
#[tool]
async fn lookup(query: String) -> String {
    query
}

fn main() {}
