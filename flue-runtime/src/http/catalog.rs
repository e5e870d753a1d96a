//! `GET /agents`: what the server runs — each agent, its tools with their schemas (from a
//! first render: the tools its body mounts when nothing is stored yet, for an instance named
//! [`CATALOG_INSTANCE`] sent an empty message), its lifecycle hooks and the hooks it requires
//! on a parent. An agent whose render fails has `"tools": null` and a `renderError` saying why
//! (a panic of the application's own, or an error its agent function returned, is only named:
//! the server's log carries its text).

use flue_core::agent::{Agent, HookStage};
use flue_core::render::RenderState;
use serde_json::{Value, json};

use crate::runtime::RuntimeInner;

/// The instance id behind `props.id()` in the catalog's render.
pub(crate) const CATALOG_INSTANCE: &str = "catalog";

/// The catalog of every agent of `runtime`, by name.
pub(crate) fn catalog(runtime: &RuntimeInner) -> Value {
    let agents: Vec<Value> = runtime
        .agent_names()
        .into_iter()
        .filter_map(|name| runtime.agents.get(name))
        .map(|agent| entry(agent.get()))
        .collect();
    json!({ "agents": agents })
}

fn entry(agent: &dyn Agent) -> Value {
    let definition = agent.definition();
    let mut entry = json!({
        "name": definition.name,
        "description": definition.description,
        "maxSteps": definition.max_steps,
        "durability": {
            "maxAttempts": definition.durability.max_attempts,
            "timeoutMs": u64::try_from(definition.durability.timeout.as_millis()).unwrap_or(u64::MAX),
        },
        "exposeAsTool": definition.expose_as_tool,
        "initialData": definition.initial_data.as_ref().map(|spec| spec.schema.get().json().clone()),
        "hooks": definition
            .hooks
            .iter()
            .map(|hook| json!({"id": hook.id(), "kind": hook.kind()}))
            .collect::<Vec<_>>(),
        "parentHooks": definition
            .parent_hooks
            .iter()
            .map(|requirement| json!({
                "hook": requirement.hook.id(),
                "kind": requirement.hook.kind(),
                "stage": match requirement.stage {
                    HookStage::BeforeParent => "before_parent",
                    HookStage::AfterParent => "after_parent",
                },
                "reason": requirement.reason,
            }))
            .collect::<Vec<_>>(),
    });
    // The tools depend on the render; a first render's shows those mounted when nothing is
    // stored: an instance behind `props.id()` (named for the catalog) and an empty message
    // behind `use_delivery()`, as a first render has. Its panic is not printed raw (the
    // application's text), as a tool's is not.
    let delivery = std::sync::Arc::new(flue_core::message::DeliveredMessage::user(""));
    let state = RenderState::root(CATALOG_INSTANCE)
        .with_agent_name(&definition.name)
        .with_delivery(&delivery);
    crate::tools::quiet::install();
    let rendered = crate::tools::quiet::running_tool(|| flue_core::render::try_render(agent, &state));
    match rendered {
        Ok(rendered) => {
            entry["tools"] = rendered
                .tools
                .iter()
                .map(|tool| {
                    json!({
                        "name": tool.name(),
                        "description": tool.definition().description,
                        "inputSchema": tool.input_schema().json(),
                    })
                })
                .collect();
            entry["model"] = json!(rendered.model.as_ref().map(|model| &model.spec));
        }
        Err(error) => {
            entry["tools"] = Value::Null;
            // A panic's text, or the error the agent function returned, is the application's
            // own (a rules-of-hooks refusal is the framework's `[flue] …`): served as
            // settlements serve it, the log keeps it.
            let text = error.to_string();
            let own = match &error {
                flue_core::RenderError::Failed { .. } => true,
                flue_core::RenderError::Panicked { message, .. } => !message.starts_with("[flue]"),
                _ => false,
            };
            let served = if own {
                tracing::error!(agent = %definition.name, error = %text, "the agent's catalog render failed");
                "The agent's render failed because of an internal error; the server's log carries it.".to_owned()
            } else {
                text
            };
            entry["renderError"] = json!(served);
        }
    }
    entry
}

#[cfg(test)]
mod tests {
    use flue_core::agent::{AgentDefinition, AgentProps, FnAgent};

    use super::entry;

    #[test]
    fn a_bare_render_that_panics_is_served_without_the_applications_text() {
        let leaky = FnAgent::new(AgentDefinition::new("leaky"), |_: AgentProps<'_>| -> &'static str {
            panic!("cannot reach postgres://app:hunter2@db")
        });
        let served = entry(&leaky)["renderError"].clone();
        assert_eq!(
            served,
            "The agent's render failed because of an internal error; the server's log carries it."
        );
        // So is an error the agent function returned.
        let failing = FnAgent::new(
            AgentDefinition::new("failing"),
            |_: AgentProps<'_>| -> Result<&'static str, String> {
                Err("cannot reach postgres://app:hunter2@db".into())
            },
        );
        let served = entry(&failing)["renderError"].clone();
        assert_eq!(
            served,
            "The agent's render failed because of an internal error; the server's log carries it."
        );
        // The framework's own refusal is served as it is.
        let twice = FnAgent::new(AgentDefinition::new("twice"), |_: AgentProps<'_>| {
            flue_core::hooks::use_model("a/b");
            flue_core::hooks::use_model("a/c");
            "Two models."
        });
        let served = entry(&twice)["renderError"].clone();
        assert!(
            served.as_str().is_some_and(|text| text.starts_with("[flue]")),
            "{served}"
        );
    }

    /// A body that reads its instance (`props.id()`) or what it was sent (`use_delivery()`),
    /// as the docs show, renders for the catalog as a first render does: its tools listed.
    #[test]
    fn an_agent_reading_its_instance_and_delivery_lists_its_tools() {
        let mail = FnAgent::new(AgentDefinition::new("mail"), |props: AgentProps<'_>| {
            flue_core::hooks::use_model("a/b");
            let sent = flue_core::hooks::use_delivery();
            flue_core::hooks::use_tool(
                flue_core::Tool::new("search")
                    .description("Search the mailbox.")
                    .run(|_ctx, _: serde_json::Map<String, serde_json::Value>| async { "none" }),
            );
            format!("You read {}'s mailbox; they said: {}", props.id(), sent.body())
        });
        let served = entry(&mail);
        assert_eq!(served.get("renderError"), None, "{served}");
        assert_eq!(served["tools"][0]["name"], "search", "{served}");
    }
}
