use flue_runtime::prelude::*;

#[agent]
unsafe fn assistant() -> &'static str {
    "Help."
}

fn main() {}
