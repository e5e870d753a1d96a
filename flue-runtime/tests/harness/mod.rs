//! What the runtime's integration tests share: a runtime on the memory store (or a given
//! store) with the scripted model, and readers of the requests the model received.
#![allow(dead_code, clippy::unwrap_used)] // each test file uses a part; tests assert by unwrapping

use flue_runtime::prelude::*;
use flue_runtime::provider::{ModelMessage, ModelRequest, ProviderRegistry};
use flue_runtime::store::{MemoryStore, Store};
use flue_runtime::testing::ScriptedModel;
use flue_runtime::{Runtime, RuntimeOptions};

/// A runtime on `store` running `agents` with `model` (retries without waiting).
pub fn runtime_on(store: impl Store, model: &ScriptedModel, agents: impl IntoIterator<Item = AgentRef>) -> Runtime {
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    let mut builder = Runtime::builder()
        .store(store)
        .providers(providers)
        .options(RuntimeOptions {
            model_retry_delay: std::time::Duration::from_millis(1),
            ..RuntimeOptions::default()
        });
    for agent in agents {
        builder = builder.agent(agent);
    }
    builder.build().unwrap()
}

/// [`runtime_on`] the memory store.
pub fn runtime_with(model: &ScriptedModel, agents: impl IntoIterator<Item = AgentRef>) -> Runtime {
    runtime_on(MemoryStore::new(), model, agents)
}

/// Every tool result a request carries, as (content, is_error), oldest first.
pub fn tool_results(request: &ModelRequest) -> Vec<(String, bool)> {
    request
        .messages
        .iter()
        .filter_map(|message| match message {
            ModelMessage::Tool { content, is_error, .. } => Some((content.clone(), *is_error)),
            _ => None,
        })
        .collect()
}

/// The results of the request's last tool batch (those answering its last step with calls).
pub fn last_batch_results(request: &ModelRequest) -> Vec<(String, bool)> {
    let all = tool_results(request);
    let calls = request
        .messages
        .iter()
        .rev()
        .find_map(|message| match message {
            ModelMessage::Assistant { tool_calls, .. } if !tool_calls.is_empty() => Some(tool_calls.len()),
            _ => None,
        })
        .unwrap_or(0);
    all[all.len().saturating_sub(calls)..].to_vec()
}

/// A direct admission of `text` to `key` as submission `id`, with the defaults a dispatch has
/// (any incarnation, 10 attempts, an hour), claiming nothing.
pub fn admission(key: &flue_runtime::store::InstanceKey, id: &str, text: &str) -> flue_runtime::store::Admission {
    use flue_runtime::store::{Admission, SubmissionKind, UidCondition};
    Admission {
        key: key.clone(),
        submission_id: id.into(),
        keyed: false,
        kind: SubmissionKind::Dispatch,
        message: flue_runtime::message::DeliveredMessage::user(text),
        initial_data: None,
        uid: UidCondition::Any,
        max_attempts: 10,
        timeout_ms: 3_600_000,
        claim: None,
        trace: None,
    }
}
