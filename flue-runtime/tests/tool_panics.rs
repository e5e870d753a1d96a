//! A tool's panic is its error result, cleaned of secrets, and neither it nor a hook's panic
//! is printed raw by the process's panic hook. Its own test binary: it sets the process's hook
//! before any tool runs.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

mod harness;

use std::sync::Mutex;

use flue_runtime::prelude::*;
use flue_runtime::testing::{ScriptedModel, ScriptedReply};
use serde_json::json;

/// What the process's panic hook was handed.
static PRINTED: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// A request that fails as an HTTP client's does.
fn request() -> Result<(), String> {
    Err("error sending request for url (https://maps.example/find?key=AIza-s3cret&q=x)".into())
}

#[agent]
fn mapper() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("maps").description("Looks a place up.").run(
        |_ctx, _: serde_json::Map<String, serde_json::Value>| async move {
            // An unwrapped HTTP error quotes the URL it called, key and all.
            request().unwrap();
            "found"
        },
    ));
    "You find places."
}

/// Checks the history with a service, unwrapping its error.
#[hook(prefilter_llm_history)]
async fn checked(_state: &ThreadState, messages: Vec<LlmMessage>) -> Vec<LlmMessage> {
    request().unwrap();
    messages
}

#[agent(hooks = [checked])]
fn hooked() -> &'static str {
    use_model("scripted/x");
    "You answer."
}

#[tokio::test]
async fn a_tools_panic_reaches_the_model_cleaned_and_the_panic_hook_not_at_all() {
    std::panic::set_hook(Box::new(|info| PRINTED.lock().unwrap().push(info.to_string())));
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("maps", json!({})),
        ScriptedReply::text("It failed."),
    ]);
    let runtime = harness::runtime_with(&model, [mapper.into()]);
    runtime.init(&mapper, "m").send("Find it.").await.unwrap();
    let (result, is_error) = harness::tool_results(&model.requests()[1]).remove(0);
    assert!(is_error);
    assert!(
        result.starts_with("Tool \"maps\" panicked: called `Result::unwrap()`"),
        "{result}"
    );
    assert!(!result.contains("AIza-s3cret"), "{result}");
    let printed = PRINTED.lock().unwrap().clone();
    assert!(printed.is_empty(), "{printed:?}");
    // Nor a hook's panic: the chain logs it (cleaned) and goes past it.
    let model = ScriptedModel::new([ScriptedReply::text("Answered.")]);
    let runtime = harness::runtime_with(&model, [hooked.into()]);
    let reply = runtime.init(&hooked, "h").send("Hello.").await.unwrap();
    assert_eq!(reply.text, "Answered.");
    let printed = PRINTED.lock().unwrap().clone();
    assert!(printed.is_empty(), "{printed:?}");
    // A panic raised anywhere else still reaches the process's hook.
    std::panic::catch_unwind(|| panic!("outside any tool")).unwrap_err();
    let printed = PRINTED.lock().unwrap().clone();
    assert_eq!(printed.len(), 1, "{printed:?}");
    assert!(printed[0].contains("outside any tool"), "{printed:?}");
}
