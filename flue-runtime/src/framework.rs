//! The framework's parts of every model request, after the agent's own: the system prompt's
//! sections (the skills catalog, then the agent roster) and the framework tools (`activate_skill`
//! and `read_skill_resource` for skills, `task` for delegates), appended after the render's
//! tools. A render without skills or delegates gets none of them.

use flue_core::render::Rendered;

use crate::subagents::{Delegation, offered, roster, task_tool};

/// Mounts the framework tools onto `rendered` and returns the system prompt sections to add
/// (`None` when there are none). `delegation` builds the `task` tool for the delegates the
/// render offers (it is only called when there are some).
pub(crate) fn mount(
    rendered: &mut Rendered,
    delegation: impl FnOnce(Vec<flue_core::subagent::Subagent>) -> Option<Delegation>,
) -> Option<String> {
    let mut sections = Vec::new();
    if !rendered.skills.is_empty() {
        sections.push(crate::skills::catalog(&rendered.skills));
        let tools = crate::skills::tools(&rendered.skills);
        rendered.tools.extend(tools);
    }
    let delegates = offered(rendered);
    if !delegates.is_empty() {
        let listed = roster(&delegates);
        if let Some(delegation) = delegation(delegates) {
            sections.push(listed);
            rendered.tools.push(task_tool(delegation));
        }
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
