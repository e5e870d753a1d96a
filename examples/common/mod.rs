//! What the smaller examples share: the model they use (a provider when its key is set, the
//! scripted model otherwise — offline — with the example's script).

use flue_runtime::provider::ProviderRegistry;
use flue_runtime::testing::{ScriptedModel, ScriptedReply};

/// The model specifier and a line saying which model runs and why. Offline, `script` is what
/// the scripted model answers, in order (then it echoes).
pub fn choose_model(providers: &mut ProviderRegistry, script: Vec<ScriptedReply>) -> (&'static str, String) {
    // As the providers read a key: one of spaces only is none.
    let has = |name: &str| std::env::var(name).is_ok_and(|value| !value.trim().is_empty());
    for (key, spec) in [
        ("OPENAI_API_KEY", "openai/gpt-4o-mini"),
        ("ANTHROPIC_API_KEY", "anthropic/claude-sonnet-4-5"),
        ("OPENROUTER_API_KEY", "openrouter/openai/gpt-4o-mini"),
    ] {
        if has(key) {
            return (spec, format!("model: {spec} ({key} is set)"));
        }
    }
    let scripted = ScriptedModel::echo().with_id("scripted").without_recording();
    for reply in script {
        scripted.push(reply);
    }
    providers.register(scripted);
    (
        "scripted/example",
        "model: scripted (offline: no OPENAI_API_KEY, ANTHROPIC_API_KEY or OPENROUTER_API_KEY is set)".to_owned(),
    )
}

/// Hands `visit` every event observed so far, past a gap where the observer fell behind.
#[allow(dead_code)] // not every example reads events
pub fn observed(
    events: &mut tokio::sync::broadcast::Receiver<flue_runtime::events::Observation>,
    mut visit: impl FnMut(flue_runtime::events::Observation),
) {
    use tokio::sync::broadcast::error::TryRecvError;
    loop {
        match events.try_recv() {
            Ok(observation) => visit(observation),
            Err(TryRecvError::Lagged(missed)) => println!("({missed} events missed)"),
            Err(TryRecvError::Empty | TryRecvError::Closed) => return,
        }
    }
}
