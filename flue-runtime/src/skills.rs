//! Skills at run time: the "Available Skills" catalog in the system prompt (one line per
//! mounted skill), the `activate_skill` tool that returns a skill's full instructions as its
//! result (so the system prompt never changes when a skill activates), and
//! `read_skill_resource`, mounted when a skill carries supporting files, which reads them
//! read-only. Unknown names are answered with a factual miss listing what is available.

use std::sync::Arc;

use flue_core::data::SchemaSource;
use flue_core::skill::Skill;
use flue_core::tool::{ToolContext, ToolDefinition, ToolHandler, ToolOutput};
use flue_core::{BoxFuture, Tool};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::Value;

const ACTIVATE_DESCRIPTION: &str = "Load the full instructions of one skill from \"Available Skills\" in the system prompt, before doing work that matches its description. Its supporting files stay unread until you read them with read_skill_resource.";

const READ_DESCRIPTION: &str = "Read a supporting file of a skill (the paths are listed when the skill is activated).";

/// The "Available Skills" section of the system prompt.
pub(crate) fn catalog(skills: &[Skill]) -> String {
    let mut section = String::from(
        "## Available Skills\n\nWhen a task matches a skill's description, load its instructions with the `activate_skill` tool first:\n",
    );
    for skill in skills {
        section.push_str(&format!("\n- **{}** — {}", skill.name(), skill.description()));
    }
    section
}

/// The framework tools for `skills`: `activate_skill`, and `read_skill_resource` when a skill
/// has supporting files.
pub(crate) fn tools(skills: &[Skill]) -> Vec<Tool> {
    let skills: Arc<[Skill]> = skills.into();
    let mut tools = vec![Tool::from_handler(ActivateSkill {
        definition: ToolDefinition::from_checked(
            "activate_skill",
            ACTIVATE_DESCRIPTION,
            SchemaSource::Typed(flue_core::data::tool_input_schema_of::<ActivateArgs>),
            None,
            &[],
            false,
        ),
        skills: skills.clone(),
    })];
    if skills.iter().any(|skill| !skill.definition().files.is_empty()) {
        tools.push(Tool::from_handler(ReadSkillResource {
            definition: ToolDefinition::from_checked(
                "read_skill_resource",
                READ_DESCRIPTION,
                SchemaSource::Typed(flue_core::data::tool_input_schema_of::<ReadArgs>),
                None,
                &[],
                false,
            ),
            skills,
        }));
    }
    tools
}

fn names(skills: &[Skill]) -> String {
    let names: Vec<&str> = skills.iter().map(Skill::name).collect();
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

/// `activate_skill`'s arguments.
#[derive(Deserialize, JsonSchema)]
struct ActivateArgs {
    /// The skill's name, from "Available Skills".
    name: String,
}

struct ActivateSkill {
    definition: ToolDefinition,
    skills: Arc<[Skill]>,
}

impl ToolHandler for ActivateSkill {
    fn definition(&self) -> &ToolDefinition {
        &self.definition
    }

    fn call(&self, _ctx: ToolContext, args: Value) -> BoxFuture<'_, ToolOutput> {
        let output = match serde_json::from_value::<ActivateArgs>(args) {
            Err(error) => ToolOutput::error(format!("Tool argument validation failed: [root] {error}")),
            Ok(args) => match self.skills.iter().find(|skill| skill.name() == args.name) {
                None => ToolOutput::text(format!(
                    "No skill named \"{}\" is available. Available skills: {}.",
                    args.name,
                    names(&self.skills)
                )),
                Some(skill) => ToolOutput::text(briefing(skill)),
            },
        };
        Box::pin(std::future::ready(output))
    }
}

/// A skill's instructions, with its supporting files and how to read them.
fn briefing(skill: &Skill) -> String {
    let definition = skill.definition();
    let mut text = definition.instructions.clone();
    if !definition.files.is_empty() {
        text.push_str(&format!(
            "\n\nSupporting files of this skill (read one with read_skill_resource, skill \"{}\"):",
            skill.name()
        ));
        for path in definition.files.keys() {
            text.push_str(&format!("\n- {path}"));
        }
    }
    text
}

/// `read_skill_resource`'s arguments.
#[derive(Deserialize, JsonSchema)]
struct ReadArgs {
    /// The skill's name.
    skill: String,
    /// The file's path within the skill, as the activation listed it.
    path: String,
    /// The line to start from (1-based).
    #[serde(default)]
    #[schemars(range(min = 1))]
    offset: Option<usize>,
    /// How many lines to read at most.
    #[serde(default)]
    #[schemars(range(min = 1))]
    limit: Option<usize>,
}

struct ReadSkillResource {
    definition: ToolDefinition,
    skills: Arc<[Skill]>,
}

impl ToolHandler for ReadSkillResource {
    fn definition(&self) -> &ToolDefinition {
        &self.definition
    }

    fn call(&self, _ctx: ToolContext, args: Value) -> BoxFuture<'_, ToolOutput> {
        let output = match serde_json::from_value::<ReadArgs>(args) {
            Err(error) => ToolOutput::error(format!("Tool argument validation failed: [root] {error}")),
            Ok(args) => read(&self.skills, &args),
        };
        Box::pin(std::future::ready(output))
    }
}

fn read(skills: &[Skill], args: &ReadArgs) -> ToolOutput {
    let Some(skill) = skills.iter().find(|skill| skill.name() == args.skill) else {
        return ToolOutput::error(format!(
            "No skill named \"{}\" is available. Available skills: {}.",
            args.skill,
            names(skills)
        ));
    };
    let Some(bytes) = skill.definition().files.get(&args.path) else {
        let paths: Vec<&str> = skill.definition().files.keys().map(String::as_str).collect();
        return ToolOutput::error(format!(
            "The skill \"{}\" has no file \"{}\". Its files: {}.",
            skill.name(),
            args.path,
            if paths.is_empty() {
                "none".to_owned()
            } else {
                paths.join(", ")
            }
        ));
    };
    let Ok(text) = std::str::from_utf8(bytes) else {
        return ToolOutput::error(format!(
            "\"{}\" is a binary file ({} bytes); only text files can be read.",
            args.path,
            bytes.len()
        ));
    };
    match crate::sandbox::tools::line_window(text, args.offset, args.limit) {
        Ok(window) => ToolOutput::text(window),
        Err(message) => ToolOutput::error(format!("\"{}\": {message}", args.path)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use super::*;

    fn skill() -> Skill {
        Skill::from_skill_md(
            None,
            "---\nname: refunds\ndescription: Refunds.\n---\nRead POLICY.md.",
            [
                ("POLICY.md", "line 1\nline 2\nline 3".as_bytes()),
                ("logo.png", &[0xff, 0xfe, 0x00][..]),
            ],
        )
        .unwrap()
    }

    fn args(path: &str, offset: Option<usize>, limit: Option<usize>) -> ReadArgs {
        ReadArgs {
            skill: "refunds".into(),
            path: path.into(),
            offset,
            limit,
        }
    }

    #[test]
    fn activation_lists_the_supporting_files() {
        assert_eq!(
            briefing(&skill()),
            "Read POLICY.md.\n\nSupporting files of this skill (read one with read_skill_resource, skill \"refunds\"):\n- POLICY.md\n- logo.png"
        );
    }

    #[test]
    fn a_resource_reads_by_line_range_with_a_continuation_marker() {
        let skills = [skill()];
        assert_eq!(
            read(&skills, &args("POLICY.md", None, None)).to_text(),
            "line 1\nline 2\nline 3"
        );
        assert_eq!(
            read(&skills, &args("POLICY.md", Some(2), Some(1))).to_text(),
            "line 2\n\n[Showing lines 2-2 of 3. Continue with offset 3.]"
        );
        let past = read(&skills, &args("POLICY.md", Some(9), None));
        assert!(past.is_error);
        let binary = read(&skills, &args("logo.png", None, None));
        assert!(binary.is_error && binary.to_text().contains("binary file (3 bytes)"));
        let missing = read(&skills, &args("NOPE.md", None, None));
        assert_eq!(
            missing.to_text(),
            "The skill \"refunds\" has no file \"NOPE.md\". Its files: POLICY.md, logo.png."
        );
    }
}
