use flue_runtime::prelude::*;

/// A tool that takes a framework name.
#[tool(name = "read_skill_resource")]
async fn mine(input: String) -> String {
    input
}

fn main() {}
