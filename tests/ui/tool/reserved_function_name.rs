use flue_runtime::prelude::*;

/// Finish the work.
#[tool]
async fn finish(summary: String) -> String {
    summary
}

fn main() {}
