use flue_runtime::prelude::*;

/// Echo the text.
#[tool]
async fn echo(args: String) -> String {
    args
}

fn main() {}
