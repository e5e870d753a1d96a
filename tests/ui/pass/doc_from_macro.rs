//! A doc comment written with a macro (`#[doc = include_str!(..)]`, `concat!`) is a description.
use flue_runtime::prelude::*;

#[doc = concat!("Look ", "something up.")]
#[tool]
async fn lookup(query: String) -> String {
    query
}

#[doc = concat!("Answers ", "questions.")]
#[agent]
fn assistant() -> &'static str {
    "You help."
}

fn main() {
    assert_eq!(lookup.into_tool().definition().description, "Look something up.");
    assert_eq!(assistant.definition().description.as_deref(), Some("Answers questions."));
}
