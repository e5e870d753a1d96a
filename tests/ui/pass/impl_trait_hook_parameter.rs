//! A hook parameter of an `impl Trait` type takes the argument its kind passes as it is.
use flue_runtime::prelude::*;

#[hook(before_update_message)]
fn keep(_state: &ThreadState, message_id: impl AsRef<str>, updates: MessageUpdates) -> MessageUpdates {
    let _ = message_id.as_ref().len();
    updates
}

#[agent(hooks = [keep])]
fn uses_it() -> &'static str {
    use_model("openai/gpt-4o");
    "Keep updates."
}

fn main() {}
