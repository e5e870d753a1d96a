use flue_runtime::prelude::*;

#[agent]
fn briefed() -> &'static str {
    use_model("openai/gpt-4o");
    let _parts = vec![use_instruction(" ")];
    "Brief."
}

fn main() {}
