use flue_runtime::prelude::*;

#[derive(serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
struct Customer {
    name: String,
}

#[agent(durability(timeout = 90))]
fn support() -> &'static str {
    use_model("openai/gpt-4o");
    "Help the customer."
}

fn main() {}
