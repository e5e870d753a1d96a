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

/// Where a generic tool finds its greeting.
trait Greeting: Send + Sync + 'static {
    const TEXT: &'static str;
}

struct Hello;

impl Greeting for Hello {
    const TEXT: &'static str = "hello";
}

/// Greets with its type's greeting; its lifetime bounds the type parameters in both places
/// a bound can go.
#[tool]
async fn greet_with<'c, G: Greeting + 'c, A>(ctx: &'c ToolContext, args: A) -> String
where
    A: serde::de::DeserializeOwned + schemars::JsonSchema + Send + 'static + 'c,
    G: 'c,
{
    let _: &'c ToolContext = ctx;
    let _ = args;
    G::TEXT.to_owned()
}

#[agent(hooks = [greet])]
fn assistant<'a>(props: AgentProps<'a>) -> String
where
    'a: 'a,
{
    use_model("openai/gpt-4o");
    use_tool(echo);
    use_tool(echo_args);
    use_tool(greet_with::<Hello, Echo>::new());
    format!("Help {}.", who(&props))
}

fn main() {
    let _ = (assistant, announce);
}
