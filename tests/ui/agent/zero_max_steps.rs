use flue_runtime::prelude::*;

#[agent(max_steps = 0)]
fn assistant() -> &'static str {
    "Help."
}

fn main() {}
