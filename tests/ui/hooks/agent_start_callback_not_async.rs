use flue_runtime::prelude::*;

#[agent]
fn assistant() -> &'static str {
    use_model("openai/gpt-4o");
    // A seam callback is async: it may wait, and appends while it runs.
    use_agent_start(|_ctx| {});
    "Help."
}

fn main() {}
