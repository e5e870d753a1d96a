use flue_runtime::prelude::*;

#[derive(Clone, serde::Deserialize)]
struct Session {
    started: String,
}

#[agent]
fn assistant() -> &'static str {
    use_model("openai/gpt-4o");
    let (_session, _set) = use_persistent_state("session", Session { started: "now".into() });
    "Help."
}

fn main() {}
