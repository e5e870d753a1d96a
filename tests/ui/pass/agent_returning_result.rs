//! An agent function may return a `Result` of its instruction whose error displays, and use
//! `?`: an `Err` fails the render with the error's text.
use flue_runtime::prelude::*;

#[agent]
fn limited() -> Result<String, std::num::ParseIntError> {
    use_model("openai/gpt-4o");
    let words: u32 = use_persistent_state("limit", "12".to_owned()).0.parse()?;
    Ok(format!("Answer in {words} words."))
}

#[agent]
fn boxed(props: AgentProps<'_>) -> Result<&'static str, Box<dyn std::error::Error + Send + Sync>> {
    use_model("openai/gpt-4o");
    if props.id().is_empty() {
        return Err("no instance".into());
    }
    Ok("Be brief.")
}

#[agent]
fn textual() -> Result<Option<String>, String> {
    use_model("openai/gpt-4o");
    Ok(None)
}

fn main() {
    let failing = FnAgent::new(AgentDefinition::new("failing"), |_props: AgentProps<'_>| -> Result<(), String> {
        use_model("openai/gpt-4o");
        Err("unavailable".to_owned())
    });
    let _ = (limited, boxed, textual, failing);
}
