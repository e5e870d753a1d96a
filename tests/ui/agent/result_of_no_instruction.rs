use flue_runtime::prelude::*;

/// An error type that does not display.
#[derive(Debug)]
struct Unreadable;

#[agent]
fn counted() -> Result<u32, String> {
    use_model("openai/gpt-4o");
    Ok(3)
}

#[agent]
fn unreadable() -> Result<String, Unreadable> {
    use_model("openai/gpt-4o");
    Err(Unreadable)
}

fn main() {}
