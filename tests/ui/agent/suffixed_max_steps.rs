use flue_runtime::prelude::*;

#[agent(max_steps = 6u8)]
fn assistant() -> &'static str {
    "Help."
}

fn main() {}
