//! Dynamic resources: conditional tools, skills and delegates are narrated to the model as
//! `resources` signals, instruction changes as an `instructions` signal, and the system
//! prompt's catalogs stay on the frozen baseline (issue 8, item 4).
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use flue_runtime::prelude::*;
use flue_runtime::provider::ModelMessage;
use flue_runtime::record::RecordBody;
use flue_runtime::store::InstanceKey;
use flue_runtime::testing::{ScriptedModel, ScriptedReply, instructions_of, is_framework_tool};
use serde_json::json;

mod harness;
use harness::runtime_with;

/// Issue a refund.
#[tool]
async fn issue_refund(
    /// The order
    order: String,
) -> String {
    format!("refunded {order}")
}

/// The `unlock` tool: sets the agent's `unlocked` state.
fn unlock(description: &'static str, set_unlocked: StateSetter<bool>) -> Tool {
    Tool::new("unlock")
        .description(description)
        .run(move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
            let set_unlocked = set_unlocked.clone();
            async move {
                set_unlocked
                    .set(true)
                    .map_err(|error| ToolError::new(error.to_string()))?;
                Ok::<_, ToolError>("unlocked")
            }
        })
}

#[agent]
fn phased() -> String {
    use_model("scripted/x");
    let (unlocked, set_unlocked) = use_persistent_state("unlocked", false);
    use_tool(unlock("Unlocks the refund tools.", set_unlocked));
    if unlocked {
        use_tool(issue_refund);
        use_skill(Skill::new("refunds", "Processes refunds.", "Check the order, then refund.").unwrap());
        "You handle refunds now.".to_owned()
    } else {
        "You answer questions.".to_owned()
    }
}

#[tokio::test]
async fn a_flip_mid_response_is_narrated_before_the_next_call_and_the_catalog_stays_frozen() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("unlock", json!({})),
        ScriptedReply::text("Refunds are open."),
    ]);
    let runtime = runtime_with(&model, [phased.into()]);
    runtime.init(&phased, "p").send("Unlock refunds.").await.unwrap();
    let requests = model.requests();
    // The first call: one tool, no skills, the first instruction.
    assert_eq!(
        instructions_of(requests[0].system.as_deref()),
        Some("You answer questions.")
    );
    // The second call: the new instruction is live; the skill catalog is not in the prompt
    // (the baseline had none) — the signals tell the model instead.
    assert_eq!(
        instructions_of(requests[1].system.as_deref()),
        Some("You handle refunds now.")
    );
    assert!(!requests[1].system.as_deref().unwrap().contains("Available Skills"));
    let tools: Vec<&str> = requests[1].tools.iter().map(|tool| &*tool.name).collect();
    assert_eq!(tools, ["unlock", "issue_refund", "activate_skill", "task"]);
    let signals: Vec<&str> = requests[1]
        .messages
        .iter()
        .filter_map(|message| match message {
            ModelMessage::User { content, .. } if content.starts_with('<') => Some(content.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        signals,
        [
            "<signal type=\"resources\" resource=\"tool\">\nNew tool available:\n- **issue_refund** — Issue a refund.\nAll available tools: issue_refund, unlock\n</signal>",
            "<signal type=\"resources\" resource=\"skill\">\nNew skill available:\n- **refunds** — Processes refunds.\nAll available skills: refunds\n</signal>",
            "<signal type=\"instructions\">\nSystem instructions updated.\n</signal>",
        ]
    );
    // Narrated once: a third call would see no new signal (the snapshot is durable).
    let bodies: Vec<RecordBody> = runtime
        .store()
        .read(&InstanceKey::new("phased", "p"), None)
        .await
        .unwrap()
        .iter()
        .flat_map(|batch| batch.records.iter().map(|record| record.body.clone()))
        .collect();
    let snapshots = bodies
        .iter()
        .filter(|body| matches!(body, RecordBody::ResourceSnapshot { .. }))
        .count();
    assert_eq!(snapshots, 2, "the baseline, then the narrated change");
}

static DEPLOYED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[agent]
fn redeployed() -> &'static str {
    use_model("scripted/x");
    // A redeploy between responses adds a tool.
    if DEPLOYED.load(std::sync::atomic::Ordering::SeqCst) {
        use_tool(issue_refund);
    }
    "You help."
}

#[tokio::test]
async fn a_change_between_responses_is_narrated_before_the_next_responses_first_call() {
    let model = ScriptedModel::new([ScriptedReply::text("Hello."), ScriptedReply::text("I can refund now.")]);
    let runtime = runtime_with(&model, [redeployed.into()]);
    let handle = runtime.init(&redeployed, "r");
    handle.send("Hi.").await.unwrap();
    DEPLOYED.store(true, std::sync::atomic::Ordering::SeqCst);
    handle.send("Can you refund?").await.unwrap();
    let requests = model.requests();
    assert!(requests[0].tools.iter().all(|tool| is_framework_tool(&tool.name)));
    // The second response's first call: the user message, then the narration before the call.
    let last = requests[1].messages.last().unwrap();
    assert_eq!(
        last,
        &ModelMessage::user(
            "<signal type=\"resources\" resource=\"tool\">\nNew tool available:\n- **issue_refund** — Issue a refund.\nAll available tools: issue_refund\n</signal>"
        )
    );
}

/// Look an order up.
#[tool]
async fn lookup_order(
    /// The order
    order: String,
) -> String {
    format!("order {order} is on its way")
}

static SWAPPED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Move on to refunds.
#[tool]
async fn advance() -> String {
    SWAPPED.store(true, std::sync::atomic::Ordering::SeqCst);
    "advanced".to_owned()
}

#[agent]
fn swapping() -> &'static str {
    use_model("scripted/x");
    use_tool(advance);
    // One `#[tool]` item for another, the list as long as before and the instruction unchanged.
    if SWAPPED.load(std::sync::atomic::Ordering::SeqCst) {
        use_tool(issue_refund);
    } else {
        use_tool(lookup_order);
    }
    "You help with orders."
}

#[tokio::test]
async fn one_tool_item_swapped_for_another_is_narrated_before_the_next_call() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("advance", json!({})),
        ScriptedReply::text("I can refund now."),
    ]);
    let runtime = runtime_with(&model, [swapping.into()]);
    runtime.init(&swapping, "s").send("Refund order 7.").await.unwrap();
    let requests = model.requests();
    let tools: Vec<&str> = requests[1].tools.iter().map(|tool| &*tool.name).collect();
    assert_eq!(tools, ["advance", "issue_refund", "task"]);
    assert_eq!(
        requests[1].messages.last().unwrap(),
        &ModelMessage::user(
            "<signal type=\"resources\" resource=\"tool\">\nNew tool available:\n- **issue_refund** — Issue a refund.\nThe tool \"lookup_order\" was removed.\nAll available tools: advance, issue_refund\n</signal>"
        )
    );
}

#[agent]
fn metered() -> String {
    use_model("scripted/x");
    let (left, set_left) = use_persistent_state("left", 3_i64);
    // Built anew by every render, its description following the state.
    use_tool(
        Tool::new("spend")
            .description(format!("Spends one credit; {left} left."))
            .run(move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
                let set_left = set_left.clone();
                async move {
                    set_left
                        .set(left - 1)
                        .map_err(|error| ToolError::new(error.to_string()))?;
                    Ok::<_, ToolError>("spent")
                }
            }),
    );
    "You spend credits.".to_owned()
}

#[tokio::test]
async fn a_rebuilt_tools_changed_description_is_narrated_before_the_next_call() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("spend", json!({})),
        ScriptedReply::tool_call("spend", json!({})),
        ScriptedReply::text("Spent two."),
    ]);
    let runtime = runtime_with(&model, [metered.into()]);
    runtime.init(&metered, "m").send("Spend two credits.").await.unwrap();
    let requests = model.requests();
    let descriptions: Vec<&str> = requests.iter().map(|request| &*request.tools[0].description).collect();
    assert_eq!(
        descriptions,
        [
            "Spends one credit; 3 left.",
            "Spends one credit; 2 left.",
            "Spends one credit; 1 left."
        ]
    );
    // Each later call hears that the tool changed, right before it.
    for request in &requests[1..] {
        assert_eq!(
            request.messages.last().unwrap(),
            &ModelMessage::user(
                "<signal type=\"resources\" resource=\"tool\">\nThe tool \"spend\" changed.\nAll available tools: spend\n</signal>"
            ),
        );
    }
}

#[agent]
fn phased_compacting() -> String {
    harness::use_tight_model("scripted/x", 150);
    let (unlocked, set_unlocked) = use_persistent_state("unlocked", false);
    use_tool(unlock("Unlocks the refunds skill.", set_unlocked));
    if unlocked {
        use_skill(Skill::new("refunds", "Processes refunds.", "Check the order, then refund.").unwrap());
    }
    "You help customers.".to_owned()
}

#[tokio::test]
async fn after_a_compaction_the_catalog_takes_the_resources_then_declared_as_its_new_baseline() {
    // A 600-token window with a 100-token reserve: a few long messages force a compaction.
    let model = ScriptedModel::new(
        std::iter::once(ScriptedReply::tool_call("unlock", json!({})))
            .chain((0..8).map(|_| ScriptedReply::text(harness::long("answer")))),
    )
    .with_context_window(600);
    let runtime = runtime_with(&model, [phased_compacting.into()]);
    let handle = runtime.init(&phased_compacting, "c");
    let compacted = || async {
        runtime
            .store()
            .read(&InstanceKey::new("phased_compacting", "c"), None)
            .await
            .unwrap()
            .iter()
            .flat_map(|batch| batch.records.iter())
            .any(|record| matches!(record.body, RecordBody::Compaction { .. }))
    };
    handle.send(harness::long("unlock")).await.unwrap();
    let mut sent = 1;
    while !compacted().await {
        assert!(sent < 4, "no compaction after {sent} long messages");
        handle.send(harness::long("more")).await.unwrap();
        sent += 1;
    }
    let requests = model.requests();
    // Before the compaction the skill came as a signal; the frozen catalog (empty) stayed out
    // of the prompt.
    assert!(!requests[1].system.as_deref().unwrap().contains("Available Skills"));
    assert!(requests[1].messages.iter().any(|message| matches!(
        message,
        ModelMessage::User { content, .. } if content.contains("New skill available")
    )));
    // The answering call after the compaction: the catalog lists the skill declared by then.
    let answered = requests.last().unwrap();
    assert!(answered.messages[0] != requests[1].messages[0], "the summary leads");
    let system = answered.system.as_deref().unwrap();
    assert!(system.contains("Available Skills"), "{system}");
    assert!(system.contains("refunds"), "{system}");
}
