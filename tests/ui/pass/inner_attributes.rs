//! Inner attributes at the top of a tool's, a hook's or an agent's body apply to that body, as
//! in any function: a lint allowed there, an inner doc comment (which documents the function,
//! as `///` would).
#![deny(unused_variables, unused_mut)]
use flue_runtime::prelude::*;

/// Echo the text.
#[tool]
async fn echo(text: String) -> String {
    #![allow(unused_variables)]
    let unused = 1;
    text
}

#[tool]
async fn shout(text: String) -> String {
    //! Shout the text.
    #![allow(unused_mut)]
    let mut loud = text.to_uppercase();
    loud
}

#[hook(filter_messages)]
async fn keep_all(_state: &ThreadState, messages: Vec<Message>) -> Vec<Message> {
    #![allow(unused_variables)]
    let unused = 1;
    messages
}

#[agent]
fn assistant() -> &'static str {
    //! An assistant that echoes.
    #![allow(unused_variables)]
    let unused = 1;
    use_model("scripted/x");
    use_tool(echo);
    use_tool(shout);
    "Be brief."
}

fn main() {
    assert_eq!(echo.into_tool().definition().description, "Echo the text.");
    assert_eq!(shout.into_tool().definition().description, "Shout the text.");
    assert_eq!(assistant.definition().description.as_deref(), Some("An assistant that echoes."));
    let _ = keep_all;
}
