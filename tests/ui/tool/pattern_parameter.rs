use flue_runtime::prelude::*;

/// Add two numbers.
#[tool]
async fn add((a, b): (i64, i64)) -> String {
    (a + b).to_string()
}

fn main() {}
