use flue_runtime::prelude::*;

#[agent(max_turns = 6)]
fn assistant() -> &'static str {
    "Help."
}

fn main() {}
