use flue_runtime::prelude::*;

async fn plan() -> &'static str {
    "Help."
}

#[agent]
async fn assistant() -> &'static str {
    plan().await
}

fn main() {}
