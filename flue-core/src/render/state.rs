//! What the runtime supplies to one render.

use std::borrow::Cow;
use std::sync::Arc;

use serde_json::Value;

use crate::binding::RuntimeBinding;
use crate::message::DeliveredMessage;

/// Whether a render is the instance's own (root) render or a delegate's render at task time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RenderKind {
    /// The agent instance's own render, before every model call.
    #[default]
    Root,
    /// A delegate rendered for one `task` call. Instance-scoped and client-facing hooks panic
    /// here; `use_initial_data` returns `None` and `use_delivery` returns the task prompt.
    Subagent,
}

/// Read access to persisted state as of this render: the attempt's uncommitted writes over the
/// committed snapshot.
///
/// The runtime implements it over its write buffer; [`crate::state::StateBuffer`] and
/// [`crate::state::StateSnapshot`] implement it for tests and tooling.
pub trait StateView: Send + Sync {
    /// Calls `visit` with the current value of `name`, or `None` when it was never written.
    fn visit(&self, name: &str, visit: &mut dyn FnMut(Option<&Value>));
}

/// Everything a render reads, supplied by the caller. Cheap to copy; borrows from the caller.
///
/// `RenderState::bare()` (also `Default`) is a render with nothing behind it.
#[derive(Clone, Copy, Default)]
pub struct RenderState<'a> {
    kind: RenderKind,
    instance_id: Option<&'a str>,
    agent_name: Option<&'a str>,
    state: Option<&'a dyn StateView>,
    initial_data: Option<&'a Value>,
    delivery: Option<&'a Arc<DeliveredMessage>>,
    previous_data_writers: Option<&'a [Cow<'static, str>]>,
    binding: Option<&'a Arc<dyn RuntimeBinding>>,
    capacity_hint: usize,
}

impl<'a> RenderState<'a> {
    /// A root render with no runtime behind it.
    pub fn bare() -> Self {
        Self::default()
    }

    /// A root render of the instance `instance_id`.
    pub fn root(instance_id: &'a str) -> Self {
        Self {
            instance_id: Some(instance_id),
            ..Self::default()
        }
    }

    /// A delegate's render for one task, reading `delivery` (the task prompt) from `use_delivery`.
    pub fn subagent(delivery: &'a Arc<DeliveredMessage>) -> Self {
        Self {
            kind: RenderKind::Subagent,
            delivery: Some(delivery),
            ..Self::default()
        }
    }

    /// Sets the instance id behind `props.id()`.
    pub fn with_instance_id(mut self, instance_id: &'a str) -> Self {
        self.instance_id = Some(instance_id);
        self
    }

    /// Sets the agent's durable identity (for messages and the dispatcher).
    pub fn with_agent_name(mut self, agent_name: &'a str) -> Self {
        self.agent_name = Some(agent_name);
        self
    }

    /// Sets the persisted-state view `use_persistent_state` reads.
    pub fn with_state(mut self, state: &'a dyn StateView) -> Self {
        self.state = Some(state);
        self
    }

    /// Sets the instance's creation data that `use_initial_data` reads.
    pub fn with_initial_data(mut self, initial_data: &'a Value) -> Self {
        self.initial_data = Some(initial_data);
        self
    }

    /// Sets the delivery cursor that `use_delivery` reads.
    pub fn with_delivery(mut self, delivery: &'a Arc<DeliveredMessage>) -> Self {
        self.delivery = Some(delivery);
        self
    }

    /// Sets the data-writer names of the previous render of the same response; the render
    /// fails with [`crate::RenderError::IdentityChanged`] when this render declares another set.
    pub fn with_previous_data_writers(mut self, names: &'a [Cow<'static, str>]) -> Self {
        self.previous_data_writers = Some(names);
        self
    }

    /// Sets the runtime binding behind setters, data writers and the dispatcher.
    pub fn with_binding(mut self, binding: &'a Arc<dyn RuntimeBinding>) -> Self {
        self.binding = Some(binding);
        self
    }

    /// Pre-sizes the recording for about `entries` declarations (tools, state, callbacks):
    /// pass the previous render's [`crate::Rendered::declaration_count`] to render without
    /// reallocating.
    pub fn with_capacity_hint(mut self, entries: usize) -> Self {
        self.capacity_hint = entries;
        self
    }

    /// Root or subagent.
    pub fn kind(&self) -> RenderKind {
        self.kind
    }

    /// The instance id, when a runtime (or a test) supplied one.
    pub fn instance_id(&self) -> Option<&'a str> {
        self.instance_id
    }

    /// The agent's durable identity, when supplied.
    pub fn agent_name(&self) -> Option<&'a str> {
        self.agent_name
    }

    /// The persisted-state view, when supplied.
    pub fn state(&self) -> Option<&'a dyn StateView> {
        self.state
    }

    /// The creation data, when supplied.
    pub fn initial_data(&self) -> Option<&'a Value> {
        self.initial_data
    }

    /// The delivery cursor, when supplied.
    pub fn delivery(&self) -> Option<&'a Arc<DeliveredMessage>> {
        self.delivery
    }

    /// The previous render's data-writer names, when supplied.
    pub fn previous_data_writers(&self) -> Option<&'a [Cow<'static, str>]> {
        self.previous_data_writers
    }

    /// The runtime binding, when supplied. `None` means writers have no durable runtime.
    pub fn binding(&self) -> Option<&'a Arc<dyn RuntimeBinding>> {
        self.binding
    }

    pub(crate) fn capacity_hint(&self) -> usize {
        self.capacity_hint
    }
}

impl std::fmt::Debug for RenderState<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RenderState")
            .field("kind", &self.kind)
            .field("instance_id", &self.instance_id)
            .field("agent_name", &self.agent_name)
            .field("has_state", &self.state.is_some())
            .field("initial_data", &self.initial_data)
            .field("delivery", &self.delivery)
            .field("previous_data_writers", &self.previous_data_writers)
            .field("has_binding", &self.binding.is_some())
            .finish()
    }
}
