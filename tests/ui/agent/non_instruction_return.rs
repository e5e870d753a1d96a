use flue_runtime::prelude::*;

#[agent]
fn assistant() -> u32 {
    7
}

fn main() {}
