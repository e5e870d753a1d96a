use flue_runtime::prelude::*;

/// Say hello.
#[tool(progress_argument = "query")]
async fn hello() -> String {
    "hello".to_owned()
}

fn main() {}
