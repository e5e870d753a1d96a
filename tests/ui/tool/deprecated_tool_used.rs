#![deny(deprecated)]
use flue_runtime::prelude::*;

/// Echo the text.
#[deprecated(note = "use `shout`")]
#[tool]
async fn echo(text: String) -> String {
    text
}

fn main() {
    let _ = echo;
}
