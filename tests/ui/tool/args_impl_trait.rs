use flue_runtime::prelude::*;

/// Look something up.
#[tool]
async fn lookup(args: Vec<impl Into<String>>) -> String {
    args.into_iter().map(Into::into).collect()
}

fn main() {}
