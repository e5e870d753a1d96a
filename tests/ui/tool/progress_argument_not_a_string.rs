use flue_runtime::prelude::*;

/// Count the things.
#[tool(progress_argument = "count")]
async fn count_things(count: u64) -> String {
    count.to_string()
}

fn main() {}
