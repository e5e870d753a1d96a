use flue_runtime::prelude::*;

// Creation data is recorded as its type reads it, so the type serializes too.
#[derive(serde::Deserialize, schemars::JsonSchema)]
struct Plan {
    #[allow(dead_code)]
    tier: String,
}

#[agent(initial_data = Plan)]
fn onboarding() -> &'static str {
    "Welcome."
}

fn main() {}
