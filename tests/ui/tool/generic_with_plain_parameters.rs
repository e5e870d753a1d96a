use flue_runtime::prelude::*;

/// Echo a value.
#[tool]
async fn echo<T: serde::de::DeserializeOwned + schemars::JsonSchema + Send + 'static>(query: String) -> String {
    query
}

fn main() {}
