//! `progress_argument` names an argument as the model sends it: a raw identifier without its
//! `r#`, a serde-renamed field or parameter by its JSON name, a field of a flattened parameter.
//! What compiles passes `use_tool`'s check.
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

/// Search the issues by their title.
#[tool(progress_argument = "q")]
async fn search_titles(#[serde(rename = "q")] query: String) -> String {
    query
}

/// Search the issues by their body.
#[tool(progress_argument = "text")]
async fn search_bodies(#[serde(rename(serialize = "body", deserialize = "text"))] query: String) -> String {
    query
}

/// Search the issues by their label (a schemars rename that serde's matches is fine).
#[tool(progress_argument = "l")]
async fn search_labels(#[serde(rename = "l")] #[schemars(rename = "l")] label: String) -> String {
    label
}

#[derive(serde::Deserialize, schemars::JsonSchema)]
struct Repository {
    /// Repository owner
    owner: String,
}

/// Search the issues of a repository.
#[tool(progress_argument = "owner")]
async fn search_repository(#[serde(flatten)] repository: Repository, query: String) -> String {
    format!("{}: {query}", repository.owner)
}

fn main() {
    for tool in [
        lookup_type.into_tool(),
        search.into_tool(),
        search_titles.into_tool(),
        search_bodies.into_tool(),
        search_labels.into_tool(),
        search_repository.into_tool(),
    ] {
        tool.definition().validate_input_schema("use_tool()").unwrap();
    }
}
