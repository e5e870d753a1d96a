use flue_runtime::prelude::*;

#[agent(durability(max_attempts = 3, timeout = "soon"))]
fn assistant() -> &'static str {
    "Help."
}

fn main() {}
