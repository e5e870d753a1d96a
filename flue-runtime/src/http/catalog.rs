//! `GET /agents`: what the server runs — each agent, its tools with their schemas (from a bare
//! render: the tools its body mounts when nothing is stored yet), its lifecycle hooks and the
//! hooks it requires on a parent.

use flue_core::agent::{Agent, HookStage};
use flue_core::render::RenderState;
use serde_json::{Value, json};

use crate::runtime::RuntimeInner;

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
    // The tools depend on the render; a bare one shows those mounted when nothing is stored.
    match flue_core::render::try_render(agent, &RenderState::bare()) {
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
            entry["renderError"] = json!(error.to_string());
        }
    }
    entry
}
