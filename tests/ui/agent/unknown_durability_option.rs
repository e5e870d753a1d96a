use flue_runtime::prelude::*;

#[agent(durability(retries = 3))]
fn assistant() -> &'static str {
    "Help."
}

fn main() {}
