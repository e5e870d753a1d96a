use flue_runtime::prelude::*;

const TOKEN: &str = "GITHUB_TOKEN";

/// Close an issue.
#[tool(secrets = [TOKEN])]
async fn close(number: u64) -> String {
    number.to_string()
}

fn main() {}
