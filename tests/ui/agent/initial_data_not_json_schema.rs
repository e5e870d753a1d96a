use flue_runtime::prelude::*;

#[derive(serde::Serialize, serde::Deserialize)]
struct Plan {
    seats: u32,
}

#[agent(initial_data = Plan)]
fn billing() -> &'static str {
    use_model("openai/gpt-4o");
    "Answer billing questions."
}

fn main() {}
