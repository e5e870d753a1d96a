use flue_runtime::prelude::*;

/// Add two numbers.
#[tool]
async fn add(a: i64, b: i64) -> String {
    (a + b).to_string()
}

#[agent]
fn calculator() -> &'static str {
    use_model("openai/gpt-4o");
    use_tool(add);
    use_tool(add);
    "Add."
}

fn main() {}
