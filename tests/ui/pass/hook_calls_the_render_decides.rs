//! Hook calls that may look repeated but are not on every render, or are not flue's: the
//! runtime checks what each render actually calls.
use flue_runtime::prelude::*;

/// Add two numbers.
#[tool]
async fn add(a: i64, b: i64) -> String {
    (a + b).to_string()
}

/// Subtract two numbers.
#[tool]
async fn subtract(a: i64, b: i64) -> String {
    (a - b).to_string()
}

mod mine {
    pub fn use_model(_spec: &str) {}
}

fn use_defaults() {
    use_tool(subtract);
}

#[agent]
fn calculator(props: AgentProps) -> &'static str {
    let careful = props.id().starts_with("careful");
    if careful {
        use_model("anthropic/claude-sonnet-4-5");
    } else {
        use_model("openai/gpt-4o-mini");
    }
    mine::use_model("not flue's");
    mine::use_model("not flue's");
    let (_count, _) = use_persistent_state("count", 0u32);
    let (_total, _) = use_persistent_state("total", 0u64);
    let _progress = use_data_writer::<u32>("progress");
    let _status = use_data_writer::<String>("status");
    use_tool(add);
    use_defaults();
    "Calculate."
}

fn main() {}
