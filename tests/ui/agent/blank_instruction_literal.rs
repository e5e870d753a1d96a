use flue_runtime::prelude::*;

#[agent]
fn assistant() -> &'static str {
    use_model("openai/gpt-4o");
    use_instruction("  ");
    "Help."
}

fn main() {}
