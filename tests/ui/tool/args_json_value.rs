use flue_runtime::prelude::*;

/// Store the record.
#[tool]
async fn store(args: serde_json::Value) -> String {
    args.to_string()
}

fn main() {}
