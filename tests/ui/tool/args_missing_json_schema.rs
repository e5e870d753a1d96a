use flue_runtime::prelude::*;

#[derive(serde::Deserialize)]
struct Query {
    text: String,
}

/// Look something up.
#[tool]
async fn lookup(args: Query) -> String {
    args.text
}

fn main() {}
