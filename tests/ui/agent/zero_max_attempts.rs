use flue_runtime::prelude::*;

#[agent(durability(max_attempts = 0))]
fn assistant() -> &'static str {
    "Help."
}

fn main() {}
