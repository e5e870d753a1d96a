use flue_runtime::prelude::*;

#[agent]
fn assistant(props: AgentProps) -> &'static str {
    if props.id().starts_with("careful") {
        use_model("anthropic/claude-sonnet-4-5");
    } else {
        use_model("gpt-4o-mini");
    }
    "Help."
}

fn main() {}
