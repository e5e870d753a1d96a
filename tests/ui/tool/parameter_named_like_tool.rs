use flue_runtime::prelude::*;

/// Repeat the text.
#[tool]
async fn echo(echo: String) -> String {
    echo
}

fn main() {}
