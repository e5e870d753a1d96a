use flue_runtime::prelude::*;

async fn lookup(query: String) -> String {
    query
}

#[agent]
fn assistant() -> &'static str {
    use_model("openai/gpt-4o");
    use_tool(lookup);
    "Help."
}

fn main() {}
