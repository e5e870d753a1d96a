use flue_runtime::prelude::*;

/// Look an issue up.
#[tool(name = lookup_issue)]
async fn lookup(number: u64) -> String {
    number.to_string()
}

fn main() {}
