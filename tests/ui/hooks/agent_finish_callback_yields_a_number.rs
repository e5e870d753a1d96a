use flue_runtime::prelude::*;

#[agent]
fn assistant() -> &'static str {
    use_model("openai/gpt-4o");
    use_agent_finish(|_ctx| async { 3u32 });
    "Help."
}

fn main() {}
