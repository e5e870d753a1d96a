use flue_runtime::prelude::*;

fn main() {
    // An agent body renders synchronously: a closure returning a future is no agent.
    let _agent = FnAgent::new(AgentDefinition::new("support"), |_props| async {
        use_model("openai/gpt-4o");
        "Help."
    });
}
