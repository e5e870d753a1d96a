use flue_runtime::prelude::*;

#[agent]
fn assistant(&self) -> &'static str {
    "You help."
}

fn main() {}
