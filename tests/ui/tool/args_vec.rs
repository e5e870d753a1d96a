use flue_runtime::prelude::*;

/// Count the labels.
#[tool]
async fn count_labels(args: Vec<String>) -> String {
    args.len().to_string()
}

fn main() {}
