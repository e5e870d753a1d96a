//! The value one render produces.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use crate::data::SchemaSource;
use crate::error::RenderError;
use crate::event_hooks::{AgentFinishHook, AgentStartHook, ResponseFinishHook, ResponseStartHook};
use crate::lifecycle::ThreadHook;
use crate::mcp::McpConnection;
use crate::model::ModelOptions;
use crate::sandbox::SandboxFactory;
use crate::skill::Skill;
use crate::subagent::Subagent;
use crate::tool::Tool;

/// The model a render declared with `use_model`.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelDeclaration {
    /// The `provider-id/model-id` specifier.
    pub spec: Cow<'static, str>,
    /// Thinking level and compaction settings.
    pub options: ModelOptions,
}

/// The sandbox a render attached with `use_sandbox`.
#[derive(Clone)]
pub struct SandboxDeclaration {
    /// The factory that builds the environment once per submission.
    pub factory: Arc<dyn SandboxFactory>,
    /// The working directory inside the environment.
    pub cwd: Option<String>,
}

impl fmt::Debug for SandboxDeclaration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SandboxDeclaration")
            .field("cwd", &self.cwd)
            .finish_non_exhaustive()
    }
}

/// A data part a render declared with `use_data_writer`.
#[derive(Clone)]
pub struct DataWriterDeclaration {
    /// The part's name (`data-<name>` on the wire).
    pub name: Cow<'static, str>,
    /// The JSON Schema every write is checked against, when the writer has one.
    pub schema: Option<SchemaSource>,
}

impl fmt::Debug for DataWriterDeclaration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DataWriterDeclaration")
            .field("name", &self.name)
            .field("has_schema", &self.schema.is_some())
            .finish()
    }
}

/// Everything one render declared, in call order.
///
/// The runtime reads the submission-scoped parts (model, sandbox factory and cwd, MCP
/// connections) once per submission and the per-render parts (tools, skills, subagents,
/// instruction, lifecycle-hook selection, event-hook callbacks) at every turn.
#[derive(Default)]
#[non_exhaustive]
pub struct Rendered {
    /// `use_model`: required for a root render to start (see [`Rendered::require_model`]).
    pub model: Option<ModelDeclaration>,
    /// `use_sandbox`.
    pub sandbox: Option<SandboxDeclaration>,
    /// `use_tool`, in mount order; names are unique (checked after the render).
    pub tools: Vec<Tool>,
    /// `use_skill`, in mount order.
    pub skills: Vec<Skill>,
    /// `use_subagent`, in declaration order.
    pub subagents: Vec<Subagent>,
    /// The composed instruction: the agent's returned text (when non-empty), then every
    /// `use_instruction` part in call order, joined with blank lines. `None` when empty.
    pub instruction: Option<Cow<'static, str>>,
    /// `use_hooks`: the render's lifecycle-hook selection, in listed order.
    pub hooks: Vec<ThreadHook>,
    /// `use_persistent_state` names, in call order.
    pub state_names: Vec<Cow<'static, str>>,
    /// `use_data_writer` declarations, in call order.
    pub data_writers: Vec<DataWriterDeclaration>,
    /// `use_agent_start` callbacks, in declaration order.
    pub agent_starts: Vec<AgentStartHook>,
    /// `use_agent_finish` callbacks, in declaration order.
    pub agent_finishes: Vec<AgentFinishHook>,
    /// `use_response_start` callbacks, in declaration order.
    pub response_starts: Vec<ResponseStartHook>,
    /// `use_response_finish` callbacks, in declaration order.
    pub response_finishes: Vec<ResponseFinishHook>,
    /// `use_mcp_connection` declarations, in call order.
    pub mcp_connections: Vec<McpConnection>,
    pub(crate) instruction_parts: Vec<Cow<'static, str>>,
}

impl Rendered {
    pub(crate) fn with_capacity_hint(hint: usize) -> Self {
        if hint == 0 {
            return Self::default();
        }
        Self {
            tools: Vec::with_capacity(hint),
            ..Self::default()
        }
    }

    /// Empties every declaration, keeping the buffers' capacity.
    pub(crate) fn reset(&mut self) {
        self.model = None;
        self.sandbox = None;
        self.tools.clear();
        self.skills.clear();
        self.subagents.clear();
        self.instruction = None;
        self.hooks.clear();
        self.state_names.clear();
        self.data_writers.clear();
        self.agent_starts.clear();
        self.agent_finishes.clear();
        self.response_starts.clear();
        self.response_finishes.clear();
        self.mcp_connections.clear();
        self.instruction_parts.clear();
    }

    /// How many declarations this render recorded; pass it to
    /// [`crate::RenderState::with_capacity_hint`] for the next render of the same agent.
    pub fn declaration_count(&self) -> usize {
        self.tools.len()
    }

    /// The declared model, or the reference's "requires a model" error.
    pub fn require_model(&self) -> Result<&ModelDeclaration, RenderError> {
        self.model.as_ref().ok_or(RenderError::MissingModel)
    }

    /// The declared data-writer names, in call order: the value to pass as
    /// [`crate::RenderState::with_previous_data_writers`] to the next render.
    pub fn data_writer_names(&self) -> Vec<Cow<'static, str>> {
        self.data_writers.iter().map(|declared| declared.name.clone()).collect()
    }

    /// Looks up a mounted tool by name.
    pub fn tool(&self, name: &str) -> Option<&Tool> {
        self.tools.iter().find(|tool| tool.name() == name)
    }

    pub(crate) fn compose_instruction(&mut self, returned: Option<Cow<'static, str>>) {
        let returned = returned.filter(|text| !text.is_empty());
        // Taken for the composition, then given back empty: the next render into this value
        // reuses its capacity.
        let mut parts = std::mem::take(&mut self.instruction_parts);
        self.instruction = match (returned, parts.is_empty()) {
            (None, true) => None,
            (Some(text), true) => Some(text),
            (returned, false) => {
                let mut composed = String::new();
                for part in returned.iter().chain(parts.iter()) {
                    if !composed.is_empty() {
                        composed.push_str("\n\n");
                    }
                    composed.push_str(part);
                }
                Some(Cow::Owned(composed))
            }
        };
        parts.clear();
        self.instruction_parts = parts;
    }
}

impl fmt::Debug for Rendered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rendered")
            .field("model", &self.model)
            .field("sandbox", &self.sandbox)
            .field("tools", &self.tools.iter().map(Tool::name).collect::<Vec<_>>())
            .field("skills", &self.skills.iter().map(Skill::name).collect::<Vec<_>>())
            .field(
                "subagents",
                &self.subagents.iter().map(Subagent::name).collect::<Vec<_>>(),
            )
            .field("instruction", &self.instruction)
            .field("hooks", &self.hooks.iter().map(ThreadHook::id).collect::<Vec<_>>())
            .field("state_names", &self.state_names)
            .field("data_writers", &self.data_writers)
            .field("agent_starts", &self.agent_starts.len())
            .field("agent_finishes", &self.agent_finishes.len())
            .field("response_starts", &self.response_starts.len())
            .field("response_finishes", &self.response_finishes.len())
            .field("mcp_connections", &self.mcp_connections)
            .finish()
    }
}
