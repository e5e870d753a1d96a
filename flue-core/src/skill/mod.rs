//! Skills: progressive-disclosure instructions mounted with `use_skill`.
//!
//! A mounted skill costs one catalog line (name and description) in the system prompt; the
//! model pulls the full instructions with the framework's `activate_skill` tool. The runtime
//! also discovers workspace skills, `.agents/skills/<name>/SKILL.md` in an agent's sandbox,
//! validated by the same rules ([`Skill::from_skill_md`], the name being the directory's).

mod front_matter;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// A validated skill. Cheap to clone.
#[derive(Clone, PartialEq)]
pub struct Skill {
    inner: Arc<SkillDefinition>,
}

/// The fields of a skill definition (the Agent Skills `SKILL.md` front matter and body).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SkillDefinition {
    /// Lowercase letters, digits and single hyphens; at most 64 characters.
    pub name: String,
    /// When to use the skill; at most 1024 characters.
    pub description: String,
    /// The full instructions returned by `activate_skill`.
    pub instructions: String,
    /// Licence text or identifier.
    pub license: Option<String>,
    /// Environment requirements; at most 500 characters.
    pub compatibility: Option<String>,
    /// Extra string metadata.
    pub metadata: BTreeMap<String, String>,
    /// Tools the skill expects (informational).
    pub allowed_tools: Option<String>,
    /// Supporting files by safe relative path (never `SKILL.md`).
    pub files: BTreeMap<String, Vec<u8>>,
}

impl Skill {
    /// Validates `definition` (trimming its text fields) into a skill.
    pub fn define(definition: SkillDefinition) -> Result<Self, SkillDefinitionError> {
        Self::validated(definition, Instructions::Required)
    }

    fn validated(definition: SkillDefinition, instructions: Instructions) -> Result<Self, SkillDefinitionError> {
        let definition = normalize(definition, instructions)?;
        Ok(Self {
            inner: Arc::new(definition),
        })
    }

    /// A skill from the text of a `SKILL.md` (front matter: `name`, `description`, and the
    /// optional `license`, `compatibility`, `metadata`, `allowed-tools`; the body is the
    /// instructions), with its supporting files by relative path. With `directory`, the
    /// skill's name must be the directory's name (the Agent Skills rule). [`skill!`](crate::skill!)
    /// embeds a skill directory at compile time.
    pub fn from_skill_md<'a>(
        directory: Option<&str>,
        skill_md: &str,
        files: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    ) -> Result<Self, SkillDefinitionError> {
        let parsed = front_matter::parse(skill_md).map_err(|message| SkillDefinitionError {
            issues: vec![issue(&["SKILL.md"], &message)],
        })?;
        let mut fields = parsed.fields;
        // A `SKILL.md` may be front matter alone (the reference reads it so): its name and
        // description are the skill, and its files may say the rest.
        let skill = Self::validated(
            SkillDefinition {
                name: fields.remove("name").unwrap_or_default(),
                description: fields.remove("description").unwrap_or_default(),
                instructions: parsed.body,
                license: fields.remove("license"),
                compatibility: fields.remove("compatibility"),
                metadata: parsed.metadata,
                allowed_tools: fields.remove("allowed-tools"),
                files: files
                    .into_iter()
                    .map(|(path, bytes)| (path.to_owned(), bytes.to_vec()))
                    .collect(),
            },
            Instructions::Optional,
        )?;
        if let Some(directory) = directory {
            let directory = directory.trim_end_matches('/').rsplit('/').next().unwrap_or(directory);
            if skill.name() != directory {
                return Err(SkillDefinitionError {
                    issues: vec![issue(
                        &["name"],
                        &format!("Must match the skill's directory name \"{directory}\"."),
                    )],
                });
            }
        }
        Ok(skill)
    }

    /// A skill with just a name, description and instructions.
    pub fn new(
        name: impl Into<String>,
        description: impl Into<String>,
        instructions: impl Into<String>,
    ) -> Result<Self, SkillDefinitionError> {
        Self::define(SkillDefinition {
            name: name.into(),
            description: description.into(),
            instructions: instructions.into(),
            ..SkillDefinition::default()
        })
    }

    /// The address of the skill's definition: equal for clones of one skill. A cheap identity
    /// for caches.
    pub fn identity(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    /// The skill's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The catalog description.
    pub fn description(&self) -> &str {
        &self.inner.description
    }

    /// The whole definition.
    pub fn definition(&self) -> &SkillDefinition {
        &self.inner
    }
}

impl fmt::Debug for Skill {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Skill")
            .field("name", &self.inner.name)
            .finish_non_exhaustive()
    }
}

impl From<&Skill> for Skill {
    fn from(skill: &Skill) -> Self {
        skill.clone()
    }
}

/// One problem with a skill definition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidationIssue {
    /// The field path, e.g. `["files", "../x"]`.
    pub path: Vec<String>,
    /// What is wrong.
    pub message: String,
}

/// `SkillDefinitionValidationError` (type `skill_definition_validation`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Skill definition is invalid: {}", describe(.issues))]
pub struct SkillDefinitionError {
    /// Every problem found.
    pub issues: Vec<ValidationIssue>,
}

fn describe(issues: &[ValidationIssue]) -> String {
    issues
        .iter()
        .map(|issue| format!("{}: {}", issue.path.join("."), issue.message))
        .collect::<Vec<_>>()
        .join("; ")
}

fn issue(path: &[&str], message: &str) -> ValidationIssue {
    ValidationIssue {
        path: path.iter().map(|segment| (*segment).to_owned()).collect(),
        message: message.to_owned(),
    }
}

/// Whether a skill must have instructions: one defined in code must; a `SKILL.md` may be
/// front matter alone.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Instructions {
    Required,
    Optional,
}

fn normalize(
    mut definition: SkillDefinition,
    instructions: Instructions,
) -> Result<SkillDefinition, SkillDefinitionError> {
    let mut issues = Vec::new();
    for (field, value) in [
        ("name", &mut definition.name),
        ("description", &mut definition.description),
        ("instructions", &mut definition.instructions),
    ] {
        *value = value.trim().to_owned();
        if value.is_empty() && !(field == "instructions" && instructions == Instructions::Optional) {
            issues.push(issue(&[field], "Must be a non-empty string."));
        }
    }
    let name = &definition.name;
    if name.chars().count() > 64 {
        issues.push(issue(&["name"], "Must be at most 64 characters."));
    }
    if !name.is_empty() && !is_skill_name(name) {
        issues.push(issue(
            &["name"],
            "Must contain only lowercase ASCII letters, numbers, and single hyphens.",
        ));
    }
    if definition.description.chars().count() > 1024 {
        issues.push(issue(&["description"], "Must be at most 1024 characters."));
    }
    for optional in [
        &mut definition.license,
        &mut definition.compatibility,
        &mut definition.allowed_tools,
    ] {
        if let Some(text) = optional.take() {
            let trimmed = text.trim();
            *optional = (!trimmed.is_empty()).then(|| trimmed.to_owned());
        }
    }
    if definition
        .compatibility
        .as_ref()
        .is_some_and(|text| text.chars().count() > 500)
    {
        issues.push(issue(&["compatibility"], "Must be at most 500 characters."));
    }
    for path in definition.files.keys() {
        if !is_safe_relative_path(path) {
            issues.push(issue(
                &["files", path],
                "Must be a safe relative path and must not be SKILL.md.",
            ));
        }
    }
    if issues.is_empty() {
        Ok(definition)
    } else {
        Err(SkillDefinitionError { issues })
    }
}

/// `^[a-z0-9]+(?:-[a-z0-9]+)*$`
fn is_skill_name(name: &str) -> bool {
    name.split('-')
        .all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()))
}

fn is_safe_relative_path(path: &str) -> bool {
    !(path.is_empty()
        || path == "SKILL.md"
        || path.starts_with('/')
        || path.ends_with('/')
        || path.contains('\\')
        || path.contains('\0')
        || path
            .split('/')
            .any(|segment| segment.is_empty() || segment == "." || segment == ".."))
}

/// Embeds a skill directory at compile time: `skill!("skills/refunds")` reads
/// `skills/refunds/SKILL.md` (relative to the calling file, as `include_str!`), and
/// `skill!("skills/refunds", files = ["POLICY.md"])` also embeds the listed supporting files.
/// The skill is validated when the expression runs; an invalid one panics with the
/// `skill_definition_validation` message (inside an agent body, that fails the submission).
#[macro_export]
macro_rules! skill {
    ($directory:literal $(, files = [$($file:literal),* $(,)?])? $(,)?) => {
        match $crate::skill::Skill::from_skill_md(
            ::core::option::Option::Some($directory),
            ::core::include_str!(::core::concat!($directory, "/SKILL.md")),
            [$($(($file, &::core::include_bytes!(::core::concat!($directory, "/", $file))[..])),*)?],
        ) {
            ::core::result::Result::Ok(skill) => skill,
            ::core::result::Result::Err(error) => ::core::panic!("[flue] skill!({}): {}", $directory, error),
        }
    };
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use super::*;

    #[test]
    fn a_skill_md_becomes_a_validated_skill_with_its_files() {
        let skill = Skill::from_skill_md(
            Some("skills/refunds"),
            "---\nname: refunds\ndescription: Process refunds. Use when asked for one.\n---\nRead POLICY.md first.",
            [("POLICY.md", &b"30 days"[..])],
        )
        .unwrap();
        assert_eq!(skill.name(), "refunds");
        assert_eq!(skill.definition().instructions, "Read POLICY.md first.");
        assert_eq!(skill.definition().files["POLICY.md"], b"30 days");
    }

    #[test]
    fn the_name_must_match_the_directory_and_the_rules_apply() {
        let text = "---\nname: refunds\ndescription: d\n---\nbody";
        let error = Skill::from_skill_md(Some("skills/returns"), text, []).unwrap_err();
        assert_eq!(error.issues[0].path, ["name"]);
        let error = Skill::from_skill_md(None, "---\nname: Bad--Name\n---\n", []).unwrap_err();
        let paths: Vec<String> = error.issues.iter().map(|issue| issue.path.join(".")).collect();
        assert_eq!(paths, ["description", "name"], "a SKILL.md may have no body");
        let bodiless = Skill::from_skill_md(None, "---\nname: refunds\ndescription: d\n---\n", []).unwrap();
        assert_eq!(bodiless.definition().instructions, "");
        let error = Skill::new("refunds", "d", " ").unwrap_err();
        assert_eq!(
            error.issues[0].path,
            ["instructions"],
            "a skill defined in code needs them"
        );
        let error = Skill::from_skill_md(None, text, [("../escape", &b""[..])]).unwrap_err();
        assert_eq!(error.issues[0].path, ["files", "../escape"]);
        let error = Skill::from_skill_md(None, "no front matter", []).unwrap_err();
        assert_eq!(error.issues[0].path, ["SKILL.md"]);
    }
}
