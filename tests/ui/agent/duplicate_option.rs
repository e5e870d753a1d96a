use flue_runtime::prelude::*;

#[agent(max_steps = 6, max_steps = 8)]
fn assistant() -> &'static str {
    "Help."
}

fn main() {}
