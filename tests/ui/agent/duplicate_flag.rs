use flue_runtime::prelude::*;

#[agent(expose_as_tool = false, expose_as_tool)]
fn assistant() -> &'static str {
    "Help."
}

fn main() {}
