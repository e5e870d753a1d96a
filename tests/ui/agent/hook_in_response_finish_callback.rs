use flue_runtime::prelude::*;

#[agent]
fn assistant() -> &'static str {
    use_model("openai/gpt-4o");
    use_response_finish(|_ctx| {
        use_instruction("Too late.");
    });
    "Help."
}

fn main() {}
