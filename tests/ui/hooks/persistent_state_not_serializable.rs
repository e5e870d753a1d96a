use flue_runtime::prelude::*;

#[derive(Clone)]
struct Session {
    started: std::time::Instant,
}

#[agent]
fn assistant() -> &'static str {
    use_model("openai/gpt-4o");
    let (_session, _set) = use_persistent_state("session", Session { started: std::time::Instant::now() });
    "Help."
}

fn main() {}
