use flue_runtime::prelude::*;

#[hook(user_value_changed)]
async fn announce(_user: &UserState, _key: &str) {}

/// Summarize a thread for the parent.
#[agent(expose_as_tool, parent_hooks = [(announce, "children must announce")])]
fn summarizer() -> &'static str {
    use_model("openai/gpt-4o");
    "Summarize."
}

fn main() {}
