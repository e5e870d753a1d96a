use flue_runtime::prelude::*;

/// Look an issue up.
#[tool]
async fn lookup(number: u64) -> String {
    number.to_string()
}

#[agent(hooks = [lookup])]
fn support() -> &'static str {
    use_model("openai/gpt-4o");
    use_tool(lookup);
    "Help."
}

fn main() {}
