//! `#[agent]` pass cases: the generated value implements `Agent` with the declared statics.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use flue_runtime::agent::HookStage;
use flue_runtime::prelude::*;

/// Checks whether a GitHub issue duplicates an older open issue.
#[agent(max_steps = 6)]
fn duplicate_finder() -> &'static str {
    use_model("openrouter/anthropic/claude-sonnet-4.5");
    "You check whether a GitHub issue duplicates an older open issue."
}

#[agent(
    name = "mail_agent",
    description = "Reads and summarizes the mailbox.",
    expose_as_tool,
    durability(max_attempts = 3, timeout = "90s")
)]
fn mail(props: AgentProps) -> String {
    format!("You read the mailbox of {}.", props.id())
}

#[agent]
fn silent() {
    use_model("openai/gpt-4o-mini");
}

#[derive(serde::Deserialize, serde::Serialize, schemars::JsonSchema)]
struct Customer {
    #[allow(dead_code)]
    plan: String,
}

#[agent(initial_data = Customer)]
fn onboarding() -> &'static str {
    use_model("openai/gpt-4o-mini");
    "Welcome the customer."
}

#[test]
fn agent_generates_a_value_with_the_functions_name_and_its_statics() {
    let definition = duplicate_finder.definition();
    assert_eq!(definition.name, "duplicate_finder");
    assert_eq!(definition.max_steps, Some(6));
    assert_eq!(
        definition.description.as_deref(),
        Some("Checks whether a GitHub issue duplicates an older open issue.")
    );
    assert!(!definition.expose_as_tool);
    let rendered = flue_runtime::render_bare(&duplicate_finder).unwrap();
    assert_eq!(rendered.model.unwrap().spec, "openrouter/anthropic/claude-sonnet-4.5");
}

#[test]
fn agent_options_set_identity_description_exposure_and_durability() {
    let definition = mail.definition();
    assert_eq!(definition.name, "mail_agent");
    assert_eq!(
        definition.description.as_deref(),
        Some("Reads and summarizes the mailbox.")
    );
    assert!(definition.expose_as_tool);
    assert_eq!(definition.durability.max_attempts, 3);
    assert_eq!(definition.durability.timeout, std::time::Duration::from_secs(90));
    let rendered = flue_runtime::render(&mail, &RenderState::root("inbox-1")).unwrap();
    assert_eq!(
        rendered.instruction.as_deref(),
        Some("You read the mailbox of inbox-1.")
    );
    assert_eq!(HookStage::default(), HookStage::AfterParent);
}

#[test]
fn an_agent_returning_unit_has_no_instruction() {
    let rendered = flue_runtime::render_bare(&silent).unwrap();
    assert_eq!(rendered.instruction, None);
    assert!(rendered.model.is_some());
}

#[test]
fn initial_data_declares_a_validating_parser() {
    let spec = onboarding.definition().initial_data.clone().unwrap();
    assert!((spec.parse)(&serde_json::json!({"plan": "pro"})).is_ok());
    assert!(
        (spec.parse)(&serde_json::json!({"tier": "pro"}))
            .unwrap_err()
            .contains("missing field `plan`")
    );
}

#[test]
fn an_agent_value_is_a_delegate() {
    let delegate = Subagent::new("mail", "Reads mail.", mail);
    assert_eq!(delegate.agent().name(), "mail_agent");
}

#[agent]
fn r#match() -> &'static str {
    "You match."
}

/// Matches things.
#[tool]
async fn r#type(r#ref: String) -> String {
    r#ref
}

#[hook(after_system_message)]
fn r#override(_state: &ThreadState, system: String) -> String {
    system
}

/// A transform that returns its value directly may wrap it in a `Result`, as any hook may.
#[hook(after_system_message)]
async fn checked_system(_state: &ThreadState, system: String) -> Result<String, HookError> {
    if system.is_empty() {
        return Err(HookError::new("no system message"));
    }
    Ok(system)
}

#[test]
fn a_transform_returning_its_value_directly_may_wrap_it_in_a_result() {
    use flue_runtime::__private::flue_core::lifecycle::hook_return;
    assert_eq!(checked_system.id(), "checked_system");
    let kept = hook_return::<Option<String>, _>(Ok::<_, HookError>("S".to_owned()));
    assert_eq!(kept.ok(), Some(Some("S".to_owned())));
    let failed = hook_return::<Option<String>, _>(Err::<String, _>(HookError::new("no")));
    assert_eq!(failed.err().map(|error| error.to_string()), Some("no".to_owned()));
}

#[test]
fn a_raw_identifier_names_an_agent_a_tool_and_a_hook_without_its_prefix() {
    assert_eq!(r#match.definition().name, "match");
    let tool = flue_runtime::tool::IntoTool::into_tool(r#type);
    assert_eq!(tool.name(), "type");
    let schema = tool.input_schema().json().clone();
    assert!(schema["properties"].get("ref").is_some(), "{schema}");
    assert_eq!(r#override.id(), "override");
}

/// Triages new issues:
///
/// 1. labels them
///    - `bug` or `feature`
/// 2. asks for a reproduction
#[agent]
fn triage() -> &'static str {
    "You triage issues."
}

#[test]
fn an_agent_description_keeps_the_relative_indentation_of_its_doc_comment() {
    assert_eq!(
        triage.definition().description.as_deref(),
        Some("Triages new issues:\n\n1. labels them\n   - `bug` or `feature`\n2. asks for a reproduction")
    );
}

#[agent(expose_as_tool = true)]
fn exposed_by_boolean() -> &'static str {
    "E"
}

#[agent(expose_as_tool = false)]
fn hidden_by_boolean() -> &'static str {
    "H"
}

#[test]
fn expose_as_tool_also_takes_a_boolean() {
    assert!(exposed_by_boolean.definition().expose_as_tool);
    assert!(!hidden_by_boolean.definition().expose_as_tool);
}

/// An item configured away with `#[cfg]` below the attribute: nothing of it is compiled (rustc
/// evaluates the `cfg` before it expands the attribute, so the expansion never sees it).
mod configured {
    use flue_runtime::prelude::*;

    /// Never compiled.
    #[agent]
    #[cfg(any())]
    fn absent_agent() -> &'static str {
        "Never."
    }

    /// Never compiled.
    #[tool]
    #[cfg(any())]
    async fn absent_tool() -> String {
        String::new()
    }

    #[hook(filter_messages)]
    #[cfg(any())]
    fn absent_hook(_state: &ThreadState, messages: Vec<Message>) -> Vec<Message> {
        messages
    }

    /// Compiled: its configuration holds.
    #[tool]
    #[cfg(test)]
    pub(super) async fn present_tool() -> String {
        "here".into()
    }

    /// Compiled too.
    #[agent]
    #[cfg(test)]
    pub(super) fn present_agent() -> &'static str {
        use_tool(present_tool);
        "Here."
    }
}

#[test]
fn an_item_configured_away_is_left_out_whole_and_a_configured_one_is_kept() {
    assert_eq!(configured::present_agent.definition().name, "present_agent");
    assert_eq!(configured::present_tool.definition().name, "present_tool");
}

/// An agent with an outer attribute of its own and inner attributes in its body.
#[inline]
#[agent]
fn inlined() -> &'static str {
    #![allow(unused_variables)]
    let unused = 1;
    use_model("scripted/x");
    "Inlined."
}

#[test]
fn an_agent_may_carry_outer_attributes_and_inner_ones_in_its_body() {
    assert_eq!(inlined.definition().name, "inlined");
}

#[agent]
fn shared_rules() -> &'static str {
    use_instruction("Be brief.");
    "Shared."
}

#[agent]
fn borrows_a_body(props: AgentProps) -> &'static str {
    use_model("openai/gpt-4o");
    let _ = shared_rules.render_body(props); // the re-entrant call
    "Borrowed."
}

/// An agent body calling another agent's body is a re-entrant render, reported at the call.
#[test]
fn an_agent_body_calling_another_agents_body_is_reported_at_the_call() {
    match flue_runtime::try_render(&borrows_a_body, &flue_runtime::RenderState::bare()) {
        Err(flue_runtime::RenderError::Panicked { message, location }) => {
            assert!(message.starts_with("[flue] Re-entrant agent render."), "{message}");
            let line = include_str!("agent_attribute.rs")
                .lines()
                .position(|line| line.ends_with("// the re-entrant call"))
                .unwrap()
                + 1;
            let location = location.expect("a location");
            assert!(location.contains(&format!("agent_attribute.rs:{line}:")), "{location}");
        }
        other => panic!("unexpected {other:?}"),
    }
}
