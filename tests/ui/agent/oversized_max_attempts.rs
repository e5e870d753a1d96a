use flue_runtime::prelude::*;

#[agent(durability(max_attempts = 5_000_000_000))]
fn assistant() -> &'static str {
    "Help."
}

fn main() {}
