use flue_runtime::prelude::*;

#[agent]
fn assistant<T>() -> &'static str {
    "Help."
}

fn main() {}
