//! The framework's parts of every model request, after the agent's own: the system prompt's
//! sections (the skills catalog, then the agent roster) and the framework tools (`activate_skill`
//! and `read_skill_resource` for skills; `task`, always), appended after the render's tools.
//! The skills are the render's declared ones, then those the sandbox's workspace provides
//! (mounted by the caller, which owns the failure of a name both declare).

use std::sync::Arc;

use flue_core::Tool;
use flue_core::lifecycle::ThreadState;
use flue_core::render::Rendered;

use crate::lifecycle::HookSet;
use crate::subagents::{Delegation, offered, roster};

/// Mounts the framework tools onto `rendered` and returns the system prompt sections to add:
/// the skills catalog and `activate_skill` (and `read_skill_resource`) when the render mounts
/// skills (`workspace`: the sandbox's workspace, whose skills the caller mounted after the
/// declared ones); the agent roster and the session's `task` tool always (when `delegation` is
/// given: every model-calling session), told what the render offers, with the parent's state
/// for `after_subagent_created` and the `environment` children share.
pub(crate) fn mount(
    rendered: &mut Rendered,
    delegation: Option<(&Arc<Delegation>, &Tool)>,
    parent: Option<(ThreadState, HookSet)>,
    environment: crate::sandbox::Environment,
    workspace: Option<&Arc<crate::skills::Workspace>>,
    sections: &mut Sections,
) {
    let delegates = offered(rendered);
    // A session at the delegation depth limit lists none: each `task` call would be refused
    // (and is, saying why).
    let at_limit = delegation.is_some_and(|(delegation, _)| delegation.at_depth_limit());
    let listed = if at_limit { Vec::new() } else { delegates.clone() };
    let key = sections_key(rendered, &listed, delegation.is_some());
    let fresh = sections.key != Some(key);
    let mut text = Vec::new();
    if !rendered.skills.is_empty() {
        if fresh {
            text.push(crate::skills::catalog(&rendered.skills));
        }
        let tools = crate::skills::tools(&rendered.skills, workspace);
        rendered.tools.extend(tools);
    }
    if let Some((delegation, tool)) = delegation {
        if fresh {
            text.push(if at_limit {
                crate::subagents::roster_at_depth_limit()
            } else {
                roster(&listed)
            });
        }
        delegation.update(delegates, parent, environment);
        rendered.tools.push(tool.clone());
    }
    if fresh {
        sections.key = Some(key);
        // The key names the skills by address: held, theirs cannot go to a later render's.
        sections.held.clone_from(&rendered.skills);
        sections.text = (!text.is_empty()).then(|| text.join("\n\n"));
    }
}

/// The system prompt sections of the latest render, kept while what they list repeats.
#[derive(Default)]
pub(crate) struct Sections {
    key: Option<u64>,
    /// The skills `key` names by address.
    held: Vec<flue_core::skill::Skill>,
    text: Option<String>,
}

impl Sections {
    /// The sections' text (`None` when there are none).
    pub(crate) fn text(&self) -> Option<&str> {
        self.text.as_deref()
    }
}

/// What the sections depend on: the skills (by identity), the offered delegates' names and
/// descriptions, and whether the roster is shown.
fn sections_key(rendered: &Rendered, delegates: &[flue_core::subagent::Subagent], roster: bool) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for skill in &rendered.skills {
        skill.identity().hash(&mut hasher);
    }
    0xff_u8.hash(&mut hasher);
    for delegate in delegates {
        delegate.name().hash(&mut hasher);
        delegate.description().hash(&mut hasher);
    }
    roster.hash(&mut hasher);
    hasher.finish()
}

/// The system prompt: the instruction, then the framework's sections (one allocation of the
/// exact size).
pub(crate) fn system(instruction: Option<&str>, sections: Option<&str>) -> Option<String> {
    let instruction = instruction.filter(|text| !text.is_empty());
    match (instruction, sections) {
        (Some(instruction), Some(sections)) => {
            let mut text = String::with_capacity(instruction.len() + 2 + sections.len());
            text.push_str(instruction);
            text.push_str("\n\n");
            text.push_str(sections);
            Some(text)
        }
        (None, Some(sections)) => Some(sections.to_owned()),
        (instruction, None) => instruction.map(str::to_owned),
    }
}

/// The length of [`system`]'s result, without building it.
pub(crate) fn system_len(instruction: Option<&str>, sections: Option<&str>) -> usize {
    let instruction = instruction.map_or(0, str::len);
    match sections {
        Some(sections) if instruction > 0 => instruction + 2 + sections.len(),
        Some(sections) => sections.len(),
        None => instruction,
    }
}
