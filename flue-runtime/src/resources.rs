//! Dynamic resources: tools, skills and delegates may be declared conditionally, so what the
//! model can use changes between renders. The system prompt's skill catalog and agent roster
//! stay frozen on a durable baseline (the first render's; no prompt rewrite, so the provider's
//! prompt cache survives); each render's declared sets are compared with the last narrated
//! snapshot, and changes reach the model as signals before its next call:
//!
//! - `resources` (attribute `resource` = `tool`, `skill` or `subagent`), one per changed kind:
//!   added entries as catalog lines (`- **name** — description`), removals and updates as one
//!   line each, and last the full current roster (`All available skills: a, b`);
//! - `instructions`, body `System instructions updated.`, when the composed instruction text
//!   changed (the live system prompt already carries it; the signal marks when).
//!
//! The snapshot is a record (`resource_snapshot`) committed with the narration — or, the first
//! time, with the first model step (no extra durability point). Framework tools (`task`,
//! `activate_skill`, `read_skill_resource`) follow their kinds and are not narrated themselves.
//! Narration never moves the `use_delivery` cursor.

use std::collections::BTreeMap;

use flue_core::Tool;
use flue_core::render::Rendered;
use flue_core::skill::Skill;
use flue_core::subagent::Subagent;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// A narrated snapshot: each kind's entries (name → digest of what the model reads of it) and
/// the instruction text's digest.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceSet {
    /// Tools the agent mounts (framework tools excluded).
    #[serde(default)]
    pub tools: BTreeMap<String, String>,
    /// Mounted skills.
    #[serde(default)]
    pub skills: BTreeMap<String, String>,
    /// Offered delegates.
    #[serde(default)]
    pub subagents: BTreeMap<String, String>,
    /// The composed instruction's digest.
    #[serde(default)]
    pub instructions: String,
    /// The sandbox's working directory while one is attached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<String>,
}

fn digest(parts: &[&str]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update((part.len() as u64).to_le_bytes());
        hasher.update(part.as_bytes());
    }
    let bytes = hasher.finalize();
    let mut hex = String::with_capacity(24);
    for byte in &bytes[..12] {
        hex.push(char::from(HEX[usize::from(byte >> 4)]));
        hex.push(char::from(HEX[usize::from(byte & 0xf)]));
    }
    hex
}

/// The digest of an agent's instruction. Instances of one agent mostly render the same text,
/// so each thread keeps its last digest (a comparison instead of a SHA-256 per new instance).
fn instruction_digest(instruction: &str) -> String {
    thread_local! {
        static LAST: std::cell::RefCell<(String, String)> = const { std::cell::RefCell::new((String::new(), String::new())) };
    }
    LAST.with_borrow_mut(|(text, hex)| {
        if hex.is_empty() || text != instruction {
            *hex = digest(&[instruction]);
            text.clear();
            text.push_str(instruction);
        }
        hex.clone()
    })
}

/// A tool's digest (its description and input schema). A static tool's never changes, so it
/// is computed once per process.
fn tool_digest(tool: &Tool) -> String {
    static STATIC_TOOLS: std::sync::LazyLock<std::sync::Mutex<std::collections::HashMap<usize, String>>> =
        std::sync::LazyLock::new(Default::default);
    let compute = || {
        let schema = tool.input_schema().shared_json().to_string();
        digest(&[&tool.definition().description, &schema])
    };
    if !tool.is_static() {
        return compute();
    }
    let mut cache = STATIC_TOOLS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    cache.entry(tool.identity()).or_insert_with(compute).clone()
}

/// A cheap fingerprint of what a render declares — the identities of its tools and skills, its
/// delegates' names and descriptions, its instruction — equal for two renders whose snapshots
/// are equal (tools and skills are compared by identity, so rebuilt ones only cost a fresh
/// snapshot).
pub(crate) struct Fingerprint {
    hash: u64,
    /// The tools and skills the hash names by address, held while it is: freed, an address
    /// could go to a tool or skill the next render builds, which would then look unchanged.
    _held: (Vec<Tool>, Vec<Skill>),
}

impl PartialEq for Fingerprint {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash
    }
}

/// The [`Fingerprint`] of `rendered` (allocates only to hold rebuilt tools and skills).
pub(crate) fn fingerprint(rendered: &Rendered, own_tools: usize, environment: Option<&str>) -> Fingerprint {
    fingerprint_under(rendered, own_tools, environment, |name| std::env::var(name).ok())
}

/// [`fingerprint`], with the process's environment read through `env` (whether an optional
/// delegate's flag is on).
fn fingerprint_under(
    rendered: &Rendered,
    own_tools: usize,
    environment: Option<&str>,
    env: impl Fn(&str) -> Option<String>,
) -> Fingerprint {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    // The sandbox's and the framework's tools follow the agent's; the environment and the
    // skills and delegates hashed below decide them.
    let own = &rendered.tools[..own_tools.min(rendered.tools.len())];
    for tool in own {
        tool.identity().hash(&mut hasher);
    }
    environment.hash(&mut hasher);
    0xff_u8.hash(&mut hasher);
    for skill in &rendered.skills {
        skill.identity().hash(&mut hasher);
    }
    0xfe_u8.hash(&mut hasher);
    for subagent in &rendered.subagents {
        subagent.name().hash(&mut hasher);
        subagent.description().hash(&mut hasher);
        subagent.is_hidden().hash(&mut hasher);
        subagent.optional_flag().hash(&mut hasher);
        // Whether its flag is on now: a delegate the environment turned on mid-response is
        // narrated before the next call, as the `task` tool accepts it from then on.
        subagent.is_enabled(&env).hash(&mut hasher);
    }
    rendered.instruction.as_deref().hash(&mut hasher);
    // A static tool's identity is its definition's, which lives as long as the process.
    let rebuilt = own.iter().filter(|tool| !tool.is_static()).cloned().collect();
    Fingerprint {
        hash: hasher.finish(),
        _held: (rebuilt, rendered.skills.clone()),
    }
}

/// What one render declares, with the descriptions narration quotes.
pub(crate) struct Declared<'a> {
    tools: &'a [Tool],
    /// Every tool the model gets (the sandbox's and the framework's too).
    all_tools: &'a [Tool],
    skills: &'a [Skill],
    subagents: Vec<Subagent>,
    instruction: &'a str,
    environment: Option<&'a str>,
}

impl<'a> Declared<'a> {
    /// The render's declarations: its first `own_tools` tools are the agent's (the sandbox's
    /// and the framework's follow), `environment` the sandbox's working directory if attached.
    pub(crate) fn of(rendered: &'a Rendered, own_tools: usize, environment: Option<&'a str>) -> Self {
        Self {
            tools: &rendered.tools[..own_tools.min(rendered.tools.len())],
            all_tools: &rendered.tools,
            skills: &rendered.skills,
            subagents: crate::subagents::offered(rendered),
            instruction: rendered.instruction.as_deref().unwrap_or(""),
            environment,
        }
    }

    /// The snapshot of these declarations.
    pub(crate) fn snapshot(&self) -> ResourceSet {
        ResourceSet {
            tools: self
                .tools
                .iter()
                .map(|tool| (tool.name().to_owned(), tool_digest(tool)))
                .collect(),
            skills: self
                .skills
                .iter()
                .map(|skill| (skill.name().to_owned(), digest(&[skill.description()])))
                .collect(),
            subagents: self
                .subagents
                .iter()
                .map(|subagent| (subagent.name().to_owned(), digest(&[subagent.description()])))
                .collect(),
            instructions: instruction_digest(self.instruction),
            environment: self.environment.map(str::to_owned),
        }
    }

    /// The `environment` signal: the whole current surface, not a delta.
    fn environment_body(&self) -> String {
        let mut lines = vec![match self.environment {
            Some(cwd) => format!(
                "The execution environment (sandbox) changed. The working directory is now `{cwd}`. Do not rely on files or command results from before without checking them again."
            ),
            None => "The execution environment (sandbox) was detached: there are no file or shell tools any more."
                .to_owned(),
        }];
        let tools: Vec<&str> = self.all_tools.iter().map(Tool::name).collect();
        lines.push(format!(
            "All available tools: {}",
            if tools.is_empty() {
                "(none)".to_owned()
            } else {
                tools.join(", ")
            }
        ));
        for (label, entries) in [
            (
                "skills",
                self.skills
                    .iter()
                    .map(|skill| catalog_line(skill.name(), skill.description()))
                    .collect::<Vec<_>>(),
            ),
            (
                "agents",
                self.subagents
                    .iter()
                    .map(|subagent| catalog_line(subagent.name(), subagent.description()))
                    .collect(),
            ),
        ] {
            if entries.is_empty() {
                lines.push(format!("All available {label}: (none)"));
            } else {
                lines.push(format!("All available {label}:"));
                lines.extend(entries);
            }
        }
        lines.join("\n")
    }

    fn description(&self, kind: Kind, name: &str) -> String {
        match kind {
            Kind::Tool => self
                .tools
                .iter()
                .find(|tool| tool.name() == name)
                .map(|tool| tool.definition().description.to_string()),
            Kind::Skill => self
                .skills
                .iter()
                .find(|skill| skill.name() == name)
                .map(|skill| skill.description().to_owned()),
            Kind::Subagent => self
                .subagents
                .iter()
                .find(|subagent| subagent.name() == name)
                .map(|subagent| subagent.description().to_owned()),
        }
        .unwrap_or_default()
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Tool,
    Skill,
    Subagent,
}

impl Kind {
    fn attribute(self) -> &'static str {
        match self {
            Self::Tool => "tool",
            Self::Skill => "skill",
            Self::Subagent => "subagent",
        }
    }

    /// The word the model reads (delegates are "agents", as in the roster).
    fn words(self) -> (&'static str, &'static str) {
        match self {
            Self::Tool => ("tool", "tools"),
            Self::Skill => ("skill", "skills"),
            Self::Subagent => ("agent", "agents"),
        }
    }
}

/// A narration signal: its type, `resource` attribute (for `resources`) and body.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Narration {
    pub(crate) signal_type: &'static str,
    pub(crate) resource: Option<&'static str>,
    pub(crate) body: String,
}

/// The signals that take the model from `previous` to what `declared` declares.
pub(crate) fn narrate(previous: &ResourceSet, current: &ResourceSet, declared: &Declared<'_>) -> Vec<Narration> {
    let mut signals = Vec::new();
    let deltas = if previous.environment == current.environment {
        &[
            (Kind::Tool, &previous.tools, &current.tools),
            (Kind::Skill, &previous.skills, &current.skills),
            (Kind::Subagent, &previous.subagents, &current.subagents),
        ][..]
    } else {
        // A full snapshot supersedes this boundary's deltas.
        signals.push(Narration {
            signal_type: "environment",
            resource: None,
            body: declared.environment_body(),
        });
        &[][..]
    };
    for &(kind, before, after) in deltas {
        let added: Vec<&String> = after.keys().filter(|name| !before.contains_key(*name)).collect();
        let removed: Vec<&String> = before.keys().filter(|name| !after.contains_key(*name)).collect();
        let updated: Vec<&String> = after
            .iter()
            .filter(|(name, digest)| before.get(*name).is_some_and(|old| old != *digest))
            .map(|(name, _)| name)
            .collect();
        if added.is_empty() && removed.is_empty() && updated.is_empty() {
            continue;
        }
        let (singular, plural) = kind.words();
        let mut lines = Vec::new();
        if !added.is_empty() {
            lines.push(if added.len() == 1 {
                format!("New {singular} available:")
            } else {
                format!("New {plural} available:")
            });
            for name in &added {
                lines.push(catalog_line(name, &declared.description(kind, name)));
            }
        }
        for name in &removed {
            lines.push(format!("The {singular} \"{name}\" was removed."));
        }
        for name in &updated {
            match kind {
                // The tools array carries a tool's new description and schema.
                Kind::Tool => lines.push(format!("The tool \"{name}\" changed.")),
                _ => {
                    lines.push(format!("The {singular} \"{name}\" changed:"));
                    lines.push(catalog_line(name, &declared.description(kind, name)));
                }
            }
        }
        let roster: Vec<&str> = after.keys().map(String::as_str).collect();
        lines.push(format!(
            "All available {plural}: {}",
            if roster.is_empty() {
                "(none)".to_owned()
            } else {
                roster.join(", ")
            }
        ));
        signals.push(Narration {
            signal_type: "resources",
            resource: Some(kind.attribute()),
            body: lines.join("\n"),
        });
    }
    if previous.instructions != current.instructions {
        signals.push(Narration {
            signal_type: "instructions",
            resource: None,
            body: "System instructions updated.".to_owned(),
        });
    }
    signals
}

fn catalog_line(name: &str, description: &str) -> String {
    let description = crate::skills::one_line(description);
    if description.is_empty() {
        format!("- **{name}**")
    } else {
        format!("- **{name}** — {description}")
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use super::*;

    fn set(tools: &[(&str, &str)], skills: &[(&str, &str)]) -> ResourceSet {
        ResourceSet {
            tools: tools.iter().map(|(n, d)| ((*n).to_owned(), (*d).to_owned())).collect(),
            skills: skills.iter().map(|(n, d)| ((*n).to_owned(), (*d).to_owned())).collect(),
            subagents: BTreeMap::new(),
            instructions: "i".into(),
            environment: None,
        }
    }

    /// An optional delegate whose flag the environment turned on (or off) changes what the
    /// render offers, so its fingerprint: the roster is narrated again before the next call.
    #[test]
    fn an_optional_delegate_turned_on_or_off_changes_the_fingerprint() {
        let flag = "FLUE_TEST_FINGERPRINT_DELEGATE_FLAG";
        let mut rendered = Rendered::default();
        rendered.subagents.push(
            Subagent::new(
                "helper",
                "Helps.",
                flue_core::agent::FnAgent::new(flue_core::AgentDefinition::new("helper"), |_| "Help."),
            )
            .optional(flag),
        );
        let unset = |_: &str| None;
        let set = |name: &str| (name == flag).then(|| "1".to_owned());
        let off = fingerprint_under(&rendered, 0, None, unset);
        let on = fingerprint_under(&rendered, 0, None, set);
        let off_again = fingerprint_under(&rendered, 0, None, unset);
        assert!(off != on, "turned on");
        assert!(off == off_again, "turned off");
    }

    #[test]
    fn the_remembered_instruction_digest_is_the_digest_of_the_text_asked_about() {
        for text in [
            "",
            "You add numbers.",
            "You add numbers.",
            "",
            "Other.",
            "You add numbers.",
        ] {
            assert_eq!(instruction_digest(text), digest(&[text]), "{text:?}");
        }
        assert_ne!(instruction_digest("a"), instruction_digest("b"));
    }

    #[test]
    fn one_signal_per_changed_kind_ending_in_the_full_roster() {
        let skills = [
            Skill::new("faq", "Answers FAQs.", "x").unwrap(),
            Skill::new("refunds", "Processes refunds.", "x").unwrap(),
        ];
        let declared = Declared {
            tools: &[],
            all_tools: &[],
            skills: &skills,
            subagents: Vec::new(),
            instruction: "",
            environment: None,
        };
        let before = set(&[("lookup", "1"), ("search", "1")], &[("faq", "1")]);
        let after = set(&[("search", "2")], &[("faq", "1"), ("refunds", "1")]);
        let signals = narrate(&before, &after, &declared);
        assert_eq!(
            signals,
            [
                Narration {
                    signal_type: "resources",
                    resource: Some("tool"),
                    body: "The tool \"lookup\" was removed.\nThe tool \"search\" changed.\nAll available tools: search"
                        .into(),
                },
                Narration {
                    signal_type: "resources",
                    resource: Some("skill"),
                    body:
                        "New skill available:\n- **refunds** — Processes refunds.\nAll available skills: faq, refunds"
                            .into(),
                },
            ]
        );
    }

    #[test]
    fn an_instruction_change_is_marked_and_nothing_else_says_nothing() {
        let declared = Declared {
            tools: &[],
            all_tools: &[],
            skills: &[],
            subagents: Vec::new(),
            instruction: "",
            environment: None,
        };
        let before = set(&[], &[]);
        assert!(narrate(&before, &before.clone(), &declared).is_empty());
        let mut after = before.clone();
        after.instructions = "j".into();
        let signals = narrate(&before, &after, &declared);
        assert_eq!(signals.len(), 1);
        assert_eq!(
            (signals[0].signal_type, signals[0].body.as_str()),
            ("instructions", "System instructions updated.")
        );
    }
}
