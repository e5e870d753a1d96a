use flue_runtime::prelude::*;

/// Count the labels.
#[tool]
async fn count_labels(labels: &[String]) -> String {
    labels.len().to_string()
}

fn main() {}
