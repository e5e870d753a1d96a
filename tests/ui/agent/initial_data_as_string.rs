use flue_runtime::prelude::*;

#[derive(serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
struct Customer {
    name: String,
}

#[agent(initial_data = "Customer")]
fn support() -> &'static str {
    use_model("openai/gpt-4o");
    "Help the customer."
}

fn main() {}
