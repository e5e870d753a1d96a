use flue_runtime::prelude::*;

fn main() {
    let _agent = FnAgent::new(AgentDefinition::new("support"), |_props| {
        use_model("openai/gpt-4o");
        42u32
    });
}
