//! Named lifetimes are only spelling: agents and lifecycle hooks may declare them.
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

#[agent(hooks = [greet])]
fn assistant<'a>(props: AgentProps<'a>) -> String
where
    'a: 'a,
{
    use_model("openai/gpt-4o");
    format!("Help {}.", who(&props))
}

fn main() {
    let _ = (assistant, announce);
}
