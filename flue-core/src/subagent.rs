//! Delegates declared with `use_subagent`.

use std::fmt;

use crate::agent::{AgentDefinition, AgentProps, AgentRef, FnAgent, Instruction};
use crate::model::ThinkingLevel;

/// The name of the framework's general-purpose delegate.
pub const GENERAL_SUBAGENT_NAME: &str = "flue-general";

/// A delegate the model can hand work to through the framework's `task` tool, with the
/// relationship options of Standard Agents.
///
/// A task runs the delegate in a child session of its own (a fresh context: the task's prompt
/// is its only message, with the images of the parent's conversation the call names by
/// attachment id) and returns its final answer. The delegate shares the parent's
/// sandbox; the `task` call's `cwd` moves its working directory. Its session runs no lifecycle
/// hooks: its render cannot select any (`use_hooks`), and `use_subagent` refuses an agent
/// whose definition selects some rather than have it run without them. For the same reason a
/// task is refused when its delegate offers a delegate of its own that requires parent hooks.
#[derive(Clone)]
pub struct Subagent {
    pub(crate) name: String,
    pub(crate) description: String,
    pub(crate) agent: AgentRef,
    pub(crate) model: Option<String>,
    pub(crate) thinking_level: Option<ThinkingLevel>,
    pub(crate) max_instances: Option<u32>,
    pub(crate) optional: Option<String>,
    pub(crate) hidden: bool,
}

impl Subagent {
    /// A delegate `name`, described by `description` (the catalog line the model uses to
    /// decide when to delegate), rendered from `agent` at delegation time.
    pub fn new(name: impl Into<String>, description: impl Into<String>, agent: impl Into<AgentRef>) -> Self {
        Self {
            name: name.into(),
            description: description.into(),
            agent: agent.into(),
            model: None,
            thinking_level: None,
            max_instances: None,
            optional: None,
            hidden: false,
        }
    }

    /// A blank general-purpose delegate (`flue-general`): no instructions, the parent's
    /// environment and model, a fresh context.
    pub fn general() -> Self {
        fn blank(_: AgentProps<'_>) -> Instruction {
            Instruction::NONE
        }
        Self::new(
            GENERAL_SUBAGENT_NAME,
            "General-purpose agent for independent research, file exploration, and parallel work. Runs with a fresh context and the workspace tools; give it complete instructions in the prompt.",
            FnAgent::new(AgentDefinition::from_checked("flue_general".into()), blank),
        )
    }

    /// Overrides the inherited model.
    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.model = Some(model.into());
        self
    }

    /// Overrides the inherited thinking level.
    pub fn thinking_level(mut self, thinking_level: ThinkingLevel) -> Self {
        self.thinking_level = Some(thinking_level);
        self
    }

    /// Caps live instances of this relationship.
    pub fn max_instances(mut self, max_instances: u32) -> Self {
        self.max_instances = Some(max_instances);
        self
    }

    /// Enables the relationship only while the environment variable `flag` is `true`, `1` or
    /// `yes` (trimmed, case-insensitive).
    pub fn optional(mut self, flag: impl Into<String>) -> Self {
        self.optional = Some(flag.into());
        self
    }

    /// Leaves the delegate out of the roster; it still contributes its parent hooks.
    pub fn hidden(mut self) -> Self {
        self.hidden = true;
        self
    }

    /// The delegate's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its catalog description.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// The agent rendered per task.
    pub fn agent(&self) -> &AgentRef {
        &self.agent
    }

    /// The model override.
    pub fn model_override(&self) -> Option<&str> {
        self.model.as_deref()
    }

    /// The thinking-level override.
    pub fn thinking_level_override(&self) -> Option<ThinkingLevel> {
        self.thinking_level
    }

    /// The live-instance cap.
    pub fn max_instances_limit(&self) -> Option<u32> {
        self.max_instances
    }

    /// The enabling flag, for optional relationships.
    pub fn optional_flag(&self) -> Option<&str> {
        self.optional.as_deref()
    }

    /// Whether the relationship is hidden.
    pub fn is_hidden(&self) -> bool {
        self.hidden
    }

    /// Whether the relationship is enabled under `env` (a lookup of environment variables).
    pub fn is_enabled(&self, env: impl Fn(&str) -> Option<String>) -> bool {
        match &self.optional {
            None => true,
            Some(flag) => env(flag)
                .map(|value| matches!(value.trim().to_ascii_lowercase().as_str(), "true" | "1" | "yes"))
                .unwrap_or(false),
        }
    }

    /// Checks the definition rules; `source` labels the message (`use_subagent()`).
    pub(crate) fn check(&self, source: &str) -> Result<(), String> {
        if self.name.trim().is_empty() {
            return Err(format!("[flue] {source} name must be a non-empty string."));
        }
        if self.description.trim().is_empty() {
            return Err(format!(
                "[flue] {source} \"{}\" needs a non-empty description — it is the catalog line the model uses to decide when to delegate.",
                self.name
            ));
        }
        if self.model.as_ref().is_some_and(|model| model.trim().is_empty()) {
            return Err(format!(
                "[flue] {source} \"{}\" model must be a non-empty string.",
                self.name
            ));
        }
        let definition = self.agent.get().definition();
        // The parent-hook rules `#[agent]` checks at compile time, for an agent built another
        // way (`AgentDefinition::parent_hooks`): fail closed before the parent runs with part
        // of its set.
        let requirements = &definition.parent_hooks;
        if !requirements.is_empty() && !definition.expose_as_tool {
            return Err(format!(
                "[flue] {source} \"{}\": its agent declares parent hooks but is not exposed as a tool; only an agent with expose_as_tool can require hooks of its parents.",
                self.name
            ));
        }
        for (index, requirement) in requirements.iter().enumerate() {
            if requirement.reason.trim().is_empty() {
                return Err(format!(
                    "[flue] {source} \"{}\": its agent's parent hook {} needs a non-blank reason.",
                    self.name,
                    requirement.hook.id()
                ));
            }
            if requirements[..index]
                .iter()
                .any(|earlier| earlier.hook.id() == requirement.hook.id())
            {
                return Err(format!(
                    "[flue] {source} \"{}\": its agent requires the parent hook {} twice; require each hook once.",
                    self.name,
                    requirement.hook.id()
                ));
            }
        }
        let hooks = &definition.hooks;
        if !hooks.is_empty() {
            let ids: Vec<&str> = hooks.iter().map(|hook| hook.id()).collect();
            return Err(format!(
                "[flue] {source} \"{}\": its agent selects lifecycle hooks ({}), which a delegate's session does not run. Delegate to an agent without them, or do that work in the parent's hooks.",
                self.name,
                ids.join(", ")
            ));
        }
        // The rest of the rules `#[agent]` checks at compile time, for a delegate built by
        // hand: it need not be registered with the runtime, whose builder checks those.
        definition.check().map_err(|message| {
            format!(
                "[flue] {source} \"{}\": {}",
                self.name,
                message.trim_start_matches("[flue] ")
            )
        })
    }
}

impl fmt::Debug for Subagent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subagent")
            .field("name", &self.name)
            .field("agent", &self.agent)
            .field("model", &self.model)
            .field("hidden", &self.hidden)
            .finish_non_exhaustive()
    }
}
