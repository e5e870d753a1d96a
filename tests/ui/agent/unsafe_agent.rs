use flue_runtime::prelude::*;

unsafe fn instruction() -> &'static str {
    "Help."
}

#[agent]
unsafe fn assistant() -> &'static str {
    instruction()
}

fn main() {}
