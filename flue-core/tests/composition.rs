//! Custom hooks and conditional resources across renders.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::{agent, echo_tool};
use flue_core::prelude::*;

fn use_retention(active: bool) {
    use_tool(echo_tool("offer_credit"));
    if active {
        use_instruction("Only while the customer is weighing cancellation: you may offer retention incentives.");
    }
}

fn use_support_kit() {
    use_retention(true);
    use_skill(Skill::new("refunds", "How to issue refunds.", "Check the order first.").unwrap());
    use_library();
}

fn use_library() {
    use_tool(echo_tool("search_docs"));
    let (_, _) = use_persistent_state("docs_version", 1u32);
}

#[test]
fn custom_hooks_compose_through_several_levels_in_call_order() {
    let agent = agent(|_| {
        use_model("openai/gpt-4o");
        use_tool(echo_tool("lookup_order"));
        use_support_kit();
        use_instruction("Sign off politely.");
        "You are the support agent."
    });
    let rendered = flue_core::render_bare(&agent).unwrap();
    let tools: Vec<&str> = rendered.tools.iter().map(Tool::name).collect();
    assert_eq!(tools, ["lookup_order", "offer_credit", "search_docs"]);
    assert_eq!(rendered.skills[0].name(), "refunds");
    assert_eq!(rendered.state_names, ["docs_version"]);
    assert_eq!(
        rendered.instruction.as_deref(),
        Some(
            "You are the support agent.\n\nOnly while the customer is weighing cancellation: you may offer retention incentives.\n\nSign off politely."
        )
    );
}

#[test]
fn a_duplicate_across_custom_hooks_is_still_a_duplicate() {
    let agent = agent(|_| {
        use_model("openai/gpt-4o");
        use_library();
        use_library();
    });
    let message = common::render_panic(&agent);
    assert!(
        message.starts_with("[flue] Duplicate use_persistent_state name \"docs_version\""),
        "{message}"
    );
}

#[test]
fn tools_skills_subagents_and_state_may_be_conditional_across_renders() {
    let phase = Arc::new(AtomicBool::new(false));
    let agent = agent({
        let phase = Arc::clone(&phase);
        move |_| {
            use_model("openai/gpt-4o");
            if phase.load(Ordering::SeqCst) {
                use_tool(echo_tool("draft_reply"));
                use_skill(Skill::new("tone", "Tone guide.", "Be warm.").unwrap());
                use_subagent(Subagent::general());
                let _ = use_persistent_state("draft", String::new());
            } else {
                use_tool(echo_tool("gather_facts"));
            }
            let _keep = use_data_writer::<u8>("progress");
        }
    });
    let first = flue_core::render_bare(&agent).unwrap();
    assert_eq!(first.tools.iter().map(Tool::name).collect::<Vec<_>>(), ["gather_facts"]);
    assert!(first.skills.is_empty() && first.subagents.is_empty() && first.state_names.is_empty());
    phase.store(true, Ordering::SeqCst);
    let previous = first.data_writer_names();
    let second = flue_core::render(&agent, &RenderState::bare().with_previous_data_writers(&previous)).unwrap();
    assert_eq!(second.tools.iter().map(Tool::name).collect::<Vec<_>>(), ["draft_reply"]);
    assert_eq!((second.skills.len(), second.subagents.len()), (1, 1));
    assert_eq!(second.state_names, ["draft"]);
}

#[test]
fn every_render_starts_from_a_fresh_frame() {
    let agent = agent(|_| {
        use_model("openai/gpt-4o");
        use_tool(echo_tool("only_once"));
        use_instruction("part");
    });
    for _ in 0..3 {
        let rendered = flue_core::render_bare(&agent).unwrap();
        assert_eq!(rendered.tools.len(), 1);
        assert_eq!(rendered.instruction.as_deref(), Some("part"));
    }
}

#[test]
fn inline_tools_close_over_render_values_and_run_with_their_context() {
    let agent = agent(|_| {
        use_model("openai/gpt-4o");
        let (tier, _) = use_persistent_state("tier", "gold".to_owned());
        use_tool(
            Tool::new("describe_tier")
                .description("Describe the customer's tier.")
                .secret("CRM_TOKEN")
                .run(move |ctx, _: serde_json::Map<String, serde_json::Value>| {
                    let tier = tier.clone();
                    async move {
                        let undeclared = ctx.secret("OTHER").unwrap_err().to_string();
                        Ok::<_, ToolError>(format!("{tier} / {undeclared}"))
                    }
                }),
        );
    });
    let rendered = flue_core::render_bare(&agent).unwrap();
    let tool = rendered.tool("describe_tier").unwrap().clone();
    let ctx = ToolContext::new(&tool, "call_1");
    let output = flue_core::testing::poll_ready(tool.call(ctx, serde_json::json!({})));
    assert_eq!(
        output.to_text(),
        "gold / [flue] Tool \"describe_tier\" read the secret \"OTHER\" without declaring it. Declare it with `secrets = [\"OTHER\"]`."
    );
    assert!(!output.is_error);
}

#[test]
fn a_secret_never_prints_its_value() {
    let secret = Secret::new("ghp_supersecret");
    assert_eq!(format!("{secret} {secret:?}"), "[redacted] Secret([redacted])");
    assert_eq!(secret.expose(), "ghp_supersecret");
}
