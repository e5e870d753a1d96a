use flue_runtime::prelude::*;

/// A tool that takes a framework name.
#[tool(name = "give_up")]
async fn mine(input: String) -> String {
    input
}

fn main() {}
