//! Errors of the render model.

use std::fmt;

/// A render that could not produce a usable declaration.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RenderError {
    /// Two mounted tools share a name (checked after the render, as in the reference).
    #[error(transparent)]
    ToolNameConflict(#[from] ToolNameConflictError),
    /// A root render declared no model. Raised where the runtime needs one (submission start).
    #[error("[flue] The agent requires a model. Call use_model(\"provider-id/model-id\") in the agent function.")]
    MissingModel,
    /// The set of `use_data_writer` names differs from the previous render of the same response.
    #[error("{}", identity_changed_message(.added, .removed))]
    IdentityChanged {
        /// Names declared now but not by the previous render, in this render's order.
        added: Vec<String>,
        /// Names the previous render declared that this one does not, in that render's order.
        removed: Vec<String>,
    },
    /// The agent function returned an error (an `Err` it returned, or `?` in its body); the
    /// message is the error's text.
    #[error("{message}")]
    Failed {
        /// The error's text (its alternate `Display`, `{:#}`: an `anyhow::Error`'s causes
        /// included).
        message: String,
    },
    /// The agent body panicked (a rules-of-hooks violation or any other panic).
    #[error("{message}")]
    Panicked {
        /// The panic message; for rules-of-hooks violations, the reference's `[flue] …` text.
        message: String,
        /// For rules-of-hooks violations: the `file:line:column` of the offending call in the
        /// user's code.
        location: Option<String>,
    },
}

fn identity_changed_message(added: &[String], removed: &[String]) -> String {
    let mut delta = Vec::with_capacity(2);
    if !added.is_empty() {
        delta.push(format!("added {}", added.join(", ")));
    }
    if !removed.is_empty() {
        delta.push(format!("removed {}", removed.join(", ")));
    }
    format!(
        "[flue] The agent's render changed identity between turns: message data {}. Message data must be declared unconditionally on every render — the named parts are the response's client-facing identity. Resources (tools, skills, subagents), persisted state, event hooks, and the sandbox may all be conditional.",
        delta.join("; ")
    )
}

/// Why a tool name conflicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolNameConflict {
    /// Two tools in one render share the name.
    Duplicate,
    /// A user tool took a name the framework reserves (`task`, `activate_skill`, …).
    Reserved,
}

/// `ToolNameConflictError` (type `tool_name_conflict`): duplicate or reserved tool name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolNameConflictError {
    name: String,
    conflict: ToolNameConflict,
}

impl ToolNameConflictError {
    /// Two tools in one render named `name`.
    pub fn duplicate(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            conflict: ToolNameConflict::Duplicate,
        }
    }

    /// A user tool named with the reserved `name`.
    pub fn reserved(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            conflict: ToolNameConflict::Reserved,
        }
    }

    /// The conflicting name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Why it conflicts.
    pub fn conflict(&self) -> ToolNameConflict {
        self.conflict
    }

    /// The stable error type on the wire.
    pub const TYPE: &'static str = "tool_name_conflict";
}

impl fmt::Display for ToolNameConflictError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.conflict {
            ToolNameConflict::Duplicate => write!(f, "Duplicate tool name \"{}\".", self.name),
            // The reference's exact text: the reserved names are
            // [`RESERVED_TOOL_NAMES`](crate::tool::RESERVED_TOOL_NAMES), documented there.
            ToolNameConflict::Reserved => write!(f, "Tool name \"{}\" is reserved by the framework.", self.name),
        }
    }
}

impl std::error::Error for ToolNameConflictError {}
