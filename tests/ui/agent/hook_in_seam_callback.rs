use flue_runtime::prelude::*;

#[agent]
fn assistant() -> &'static str {
    use_model("openai/gpt-4o");
    use_agent_start(|_ctx| {
        let (_visits, _set_visits) = use_persistent_state("visits", 0u32);
        async {}
    });
    "Help."
}

fn main() {}
