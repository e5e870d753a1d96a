use flue_runtime::prelude::*;

#[agent]
async fn assistant() -> &'static str {
    "Help."
}

fn main() {}
