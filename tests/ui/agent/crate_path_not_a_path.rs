use flue_runtime::prelude::*;

#[agent(crate = "1bad")]
fn assistant() -> &'static str {
    "Help."
}

fn main() {}
