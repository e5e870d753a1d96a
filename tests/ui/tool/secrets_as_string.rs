use flue_runtime::prelude::*;

/// Look an issue up.
#[tool(secrets = "GITHUB_TOKEN")]
async fn lookup(number: u64) -> String {
    number.to_string()
}

fn main() {}
