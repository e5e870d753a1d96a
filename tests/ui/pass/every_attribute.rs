use flue_runtime::prelude::*;

/// Look up an order.
#[tool(terminate, durable)]
async fn lookup(ctx: &ToolContext, order: String) -> Result<String, ToolError> {
    Ok(format!("{} {order}", ctx.tool_call_id()))
}

#[hook(after_thread_created, id = "greet_thread")]
fn greet(_state: &ThreadState) -> Result<(), HookError> {
    Ok(())
}

#[hook(user_value_changed)]
async fn announce(_user: &UserState, _key: &str) {}

#[agent(hooks = [greet], max_steps = 3)]
fn assistant(props: AgentProps) -> String {
    use_model("openai/gpt-4o");
    use_tool(lookup);
    format!("Help {}.", props.try_id().unwrap_or("someone"))
}

fn main() {
    let _ = (assistant, announce);
}
