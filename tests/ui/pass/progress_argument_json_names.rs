//! `progress_argument` names an argument as the model sends it: a raw identifier without its
//! `r#`, a serde-renamed field by its JSON name. What compiles passes `use_tool`'s check.
use flue_runtime::prelude::*;

/// Look a type up.
#[tool(progress_argument = "type")]
async fn lookup_type(r#type: String) -> String {
    r#type
}

#[derive(serde::Deserialize, schemars::JsonSchema)]
struct Search {
    /// Words to search for
    #[serde(rename = "q")]
    query: String,
}

/// Search the issues.
#[tool(progress_argument = "q")]
async fn search(args: Search) -> String {
    args.query
}

fn main() {
    for tool in [lookup_type.into_tool(), search.into_tool()] {
        tool.definition().validate_input_schema("use_tool()").unwrap();
    }
}
