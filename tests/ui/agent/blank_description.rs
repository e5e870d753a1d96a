use flue_runtime::prelude::*;

#[agent(description = "  ")]
fn assistant() -> &'static str {
    "Help."
}

fn main() {}
