//! The framework's parts of every model request, after the agent's own: the system prompt's
//! sections (the skills catalog, then the agent roster) and the framework tools (`activate_skill`
//! and `read_skill_resource` for skills; `task`, always), appended after the render's tools.

use std::sync::Arc;

use flue_core::Tool;
use flue_core::lifecycle::ThreadState;
use flue_core::render::Rendered;

use crate::lifecycle::HookSet;
use crate::subagents::{Delegation, offered, roster};

/// Mounts the framework tools onto `rendered` and returns the system prompt sections to add:
/// the skills catalog and `activate_skill` (and `read_skill_resource`) when the render mounts
/// skills; the agent roster and the session's `task` tool always (when `delegation` is given:
/// every model-calling session), told what the render offers, with the parent's state for
/// `after_subagent_created` and the `environment` children share.
pub(crate) fn mount(
    rendered: &mut Rendered,
    delegation: Option<(&Arc<Delegation>, &Tool)>,
    parent: Option<(ThreadState, HookSet)>,
    environment: Vec<Tool>,
) -> Option<String> {
    let mut sections = Vec::new();
    if !rendered.skills.is_empty() {
        sections.push(crate::skills::catalog(&rendered.skills));
        let tools = crate::skills::tools(&rendered.skills);
        rendered.tools.extend(tools);
    }
    if let Some((delegation, tool)) = delegation {
        let delegates = offered(rendered);
        sections.push(roster(&delegates));
        delegation.update(delegates, parent, environment);
        rendered.tools.push(tool.clone());
    }
    (!sections.is_empty()).then(|| sections.join("\n\n"))
}

/// The system prompt: the instruction, then the framework's sections.
pub(crate) fn system(instruction: Option<String>, sections: Option<&str>) -> Option<String> {
    match (instruction, sections) {
        (Some(instruction), Some(sections)) if !instruction.is_empty() => Some(format!("{instruction}\n\n{sections}")),
        (_, Some(sections)) => Some(sections.to_owned()),
        (instruction, None) => instruction,
    }
}
