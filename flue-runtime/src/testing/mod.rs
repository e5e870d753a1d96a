//! The testing kit: agents are testable offline.
//!
//! - [`ScriptedModel`]: an in-process provider that answers from a script.
//! - [`fixture_server`]: an OpenAI- and Anthropic-compatible HTTP server on loopback, so the
//!   real reqwest path runs in tests.
//! - [`instructions_of`] and [`is_framework_tool`]: a request's agent-authored parts, for
//!   assertions that should not depend on what the framework adds.
//! - Re-exports flue-core's in-memory binding and `poll_ready`.

pub mod fixture_server;
mod scripted;

pub use flue_core::testing::*;
pub use scripted::{ScriptedModel, ScriptedReply};

/// The agent's own part of a system prompt: the text before the framework's sections (the
/// "Available Skills" catalog and the "Available Agents" roster); `None` when there is none.
pub fn instructions_of(system: Option<&str>) -> Option<&str> {
    let system = system?;
    let own = ["## Available Skills", "## Available Agents"]
        .iter()
        .filter_map(|heading| {
            if system.starts_with(heading) {
                Some(0)
            } else {
                system.find(&format!("\n\n{heading}"))
            }
        })
        .min()
        .map_or(system, |at| &system[..at]);
    (!own.is_empty()).then_some(own)
}

/// Whether `name` is a tool the framework adds (`task`, `activate_skill`,
/// `read_skill_resource`) rather than one the agent mounts.
pub fn is_framework_tool(name: &str) -> bool {
    matches!(name, "task" | "activate_skill" | "read_skill_resource")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agents_part_of_a_prompt_is_what_precedes_the_framework_sections() {
        assert_eq!(
            instructions_of(Some("Be kind.\n\n## Available Agents\n\nNone.")),
            Some("Be kind.")
        );
        assert_eq!(
            instructions_of(Some("A\n\n## Available Skills\n\n- x\n\n## Available Agents\n\nNone.")),
            Some("A")
        );
        assert_eq!(instructions_of(Some("## Available Agents\n\nNone.")), None);
        assert_eq!(instructions_of(Some("Plain.")), Some("Plain."));
        assert_eq!(instructions_of(None), None);
    }
}
