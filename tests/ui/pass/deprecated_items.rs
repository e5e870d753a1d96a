//! `#[deprecated]` on a tool, a hook or an agent marks the item its users name; the
//! expansion itself uses none of it (the module denies `deprecated` and compiles).
mod items {
    #![deny(deprecated)]
    use flue_runtime::prelude::*;

    /// Echo the text.
    #[deprecated(note = "use `shout`")]
    #[tool]
    pub async fn echo(text: String) -> String {
        text
    }

    #[deprecated(note = "filter nothing")]
    #[hook(filter_messages)]
    pub async fn keep_all(_state: &ThreadState, messages: Vec<Message>) -> Vec<Message> {
        messages
    }

    /// An old assistant.
    #[deprecated(note = "use another agent")]
    #[agent]
    pub fn old_assistant() -> &'static str {
        "Be brief."
    }
}

#[allow(deprecated)]
fn main() {
    let _ = (items::echo, items::keep_all, items::old_assistant);
}
