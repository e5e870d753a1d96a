#![deny(deprecated)]
use flue_runtime::prelude::*;

/// Echo the text.
#[deprecated(note = "use `shout`")]
#[tool]
async fn echo(text: String) -> String {
    text
}

#[agent]
fn assistant() -> &'static str {
    use_model("openai/gpt-4o");
    use_tool(echo);
    "Help."
}

fn main() {}
