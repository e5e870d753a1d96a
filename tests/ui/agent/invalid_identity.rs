use flue_runtime::prelude::*;

#[agent(name = "Support-Agent")]
fn assistant() -> &'static str {
    "Help."
}

fn main() {}
