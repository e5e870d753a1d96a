use flue_runtime::prelude::*;

/// Look a word up.
#[tool]
async fn lookup(word: String) -> String {
    use_model("openai/gpt-4o");
    word
}

fn main() {}
