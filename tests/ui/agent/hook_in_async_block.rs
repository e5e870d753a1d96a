use flue_runtime::prelude::*;

#[agent]
fn assistant() -> &'static str {
    use_model("openai/gpt-4o");
    let _later = async {
        use_instruction("Too late to compose the agent.");
    };
    "Help."
}

fn main() {}
