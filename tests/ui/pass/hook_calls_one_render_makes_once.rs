//! Calls that look repeated but that one render makes once: under opposite `cfg`s, through a
//! name bound again to another value, after the function returned; and hooks evaluated in the
//! render to build a seam's callback.
#![allow(unreachable_code)]
use flue_runtime::prelude::*;

#[derive(serde::Deserialize, schemars::JsonSchema)]
struct Numbers {
    a: i64,
    b: i64,
}

#[agent]
fn calculator() -> &'static str {
    #[cfg(debug_assertions)]
    use_model("openai/gpt-4o-mini");
    #[cfg(not(debug_assertions))]
    use_model("openai/gpt-4o");
    let tool = Tool::new("add")
        .description("Add two numbers.")
        .run(|_ctx, numbers: Numbers| async move { (numbers.a + numbers.b).to_string() });
    use_tool(tool);
    let tool = Tool::new("subtract")
        .description("Subtract two numbers.")
        .run(|_ctx, numbers: Numbers| async move { (numbers.a - numbers.b).to_string() });
    use_tool(tool);
    use_agent_start({
        let (count, _set_count) = use_persistent_state("count", 0u32);
        move |_ctx| async move {
            let _ = count;
        }
    });
    // Never compiled: not checked.
    #[cfg(any())]
    use_instruction(" ");
    return "Calculate.";
    use_model("anthropic/claude-sonnet-4-5");
    "Never."
}

fn main() {}
