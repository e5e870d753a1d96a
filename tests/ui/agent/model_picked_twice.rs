use flue_runtime::prelude::*;

#[agent]
fn assistant() -> &'static str {
    use_model("openai/gpt-4o");
    use_model_with("anthropic/claude-sonnet-4-5", ModelOptions::default());
    "Help."
}

fn main() {}
