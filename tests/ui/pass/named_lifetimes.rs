//! Named lifetimes are only spelling: agents, tools and lifecycle hooks may declare them.
use flue_runtime::prelude::*;

#[hook(after_thread_created)]
fn greet<'s>(state: &'s ThreadState) -> Result<(), HookError> {
    let _: &'s ThreadState = state;
    Ok(())
}

#[hook(user_value_changed)]
async fn announce<'u, 'k>(_user: &'u UserState, _key: &'k str) {}

/// The instance id the props borrow, or a fallback.
fn who<'a>(props: &AgentProps<'a>) -> &'a str {
    props.try_id().unwrap_or("someone")
}

/// Echoes its text back.
#[tool]
async fn echo<'c>(ctx: &'c ToolContext, text: String) -> String
where
    'c: 'c,
{
    let _: &'c ToolContext = ctx;
    text
}

/// Echoes its arguments' text back.
#[tool]
async fn echo_args<'c>(_ctx: &'c ToolContext, args: Echo) -> String {
    args.text
}

#[derive(serde::Deserialize, schemars::JsonSchema)]
struct Echo {
    text: String,
}

#[agent(hooks = [greet])]
fn assistant<'a>(props: AgentProps<'a>) -> String
where
    'a: 'a,
{
    use_model("openai/gpt-4o");
    use_tool(echo);
    use_tool(echo_args);
    format!("Help {}.", who(&props))
}

fn main() {
    let _ = (assistant, announce);
}
