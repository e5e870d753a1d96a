//! Rendering: running an agent function in a fresh frame and collecting what its hooks declared.
//!
//! The runtime renders an agent before every model call. Each render starts from a fresh
//! [`Rendered`] value; hooks record onto it in call order; [`render`] then composes the
//! instruction, checks the render-level rules (duplicate tool names, data-writer identity
//! across consecutive renders) and hands the declaration back. What to do with it — which
//! values are submission-scoped, which per turn — is the runtime's business, not the frame's.
//!
//! Reads are supplied by the caller through [`RenderState`]; a *bare* render (no runtime
//! behind it, [`RenderState::bare`]) is how users unit-test their agents: reads give defaults
//! and writers fail with the reference's messages.

mod frame;
mod rendered;
mod state;

use std::borrow::Cow;
use std::cell::RefCell;
use std::panic::{AssertUnwindSafe, catch_unwind};

#[doc(hidden)]
pub use frame::BodyGuard;
pub use frame::is_rendering;
pub(crate) use frame::{Frame, with_frame};
pub use rendered::{DataWriterDeclaration, ModelDeclaration, Rendered, SandboxDeclaration};
pub use state::{RenderKind, RenderState, StateView};

use crate::agent::{Agent, AgentProps};
use crate::error::{RenderError, ToolNameConflictError};

/// Renders `agent` once against `state`.
///
/// Rules-of-hooks violations inside the agent body panic with the reference's `[flue] …`
/// message (use [`try_render`] to receive them as [`RenderError::Panicked`]). An error the body
/// returned (`Result<String, E>`, `?`) fails the render as [`RenderError::Failed`]. After the
/// body returns an instruction, the render-level rules are checked in the reference's order:
/// reserved and duplicate tool names ([`RenderError::ToolNameConflict`]), then data-writer
/// identity against [`RenderState::previous_data_writers`] ([`RenderError::IdentityChanged`]).
#[track_caller]
pub fn render<A: Agent + ?Sized>(agent: &A, state: &RenderState<'_>) -> Result<Rendered, RenderError> {
    let mut rendered = Rendered::with_capacity_hint(state.capacity_hint());
    render_into(agent, state, &mut rendered)?;
    Ok(rendered)
}

/// [`render`] into an existing [`Rendered`] (cleared first), reusing its buffers in place: a
/// runtime that renders the same agent turn after turn allocates and copies nothing for the
/// recording itself. On error, `into` holds whatever the render recorded.
#[track_caller]
pub fn render_into<A: Agent + ?Sized>(
    agent: &A,
    state: &RenderState<'_>,
    into: &mut Rendered,
) -> Result<(), RenderError> {
    into.reset();
    let frame = Frame {
        state,
        rec: RefCell::new(into),
    };
    let props = AgentProps::new(state.instance_id(), state.kind());
    let returned = {
        let _guard = frame::FrameGuard::enter(&frame);
        agent.render_body(props)
    };
    let rendered = frame.rec.into_inner();
    // An agent function that returned an error fails its render as a panic would, before the
    // render-level rules, which are about a declaration it did not complete.
    let returned = returned
        .into_result()
        .map_err(|message| RenderError::Failed { message })?;
    rendered.compose_instruction(returned);
    check_unique_tool_names(rendered)?;
    if let Some(previous) = state.previous_data_writers() {
        check_data_writer_identity(previous, &rendered.data_writers)?;
    }
    Ok(())
}

/// Renders `agent` with no runtime behind it: the form for unit tests and tooling.
///
/// Reads give their defaults (`use_persistent_state` returns the default value,
/// `use_initial_data` returns `None`), `use_delivery` and `props.id()` panic because nothing
/// backs them, and every writer fails with its "no durable runtime behind this render" error.
#[track_caller]
pub fn render_bare<A: Agent + ?Sized>(agent: &A) -> Result<Rendered, RenderError> {
    render(agent, &RenderState::bare())
}

/// Like [`render`], but a panic in the agent body (a rules-of-hooks violation or any other
/// panic) is caught and returned as [`RenderError::Panicked`] carrying its message and, for
/// rules-of-hooks violations, the user's `file:line:column` that broke the rule.
///
/// A panicking render fails its submission, never a worker: the runtime renders this way
/// ([`try_render_into`]), and logs the location with the failure. The frame is cleared before
/// this returns, so the next render on this thread works.
pub fn try_render<A: Agent + ?Sized>(agent: &A, state: &RenderState<'_>) -> Result<Rendered, RenderError> {
    let mut rendered = Rendered::with_capacity_hint(state.capacity_hint());
    try_render_into(agent, state, &mut rendered).map(|()| rendered)
}

/// [`try_render`] into an existing [`Rendered`], as [`render_into`] does.
pub fn try_render_into<A: Agent + ?Sized>(
    agent: &A,
    state: &RenderState<'_>,
    into: &mut Rendered,
) -> Result<(), RenderError> {
    crate::hooks::take_violation_location();
    match catch_unwind(AssertUnwindSafe(|| render_into(agent, state, into))) {
        Ok(result) => result,
        Err(payload) => Err(RenderError::Panicked {
            message: panic_message(payload.as_ref()),
            location: crate::hooks::take_violation_location().map(|location| location.to_string()),
        }),
    }
}

/// Extracts the text of a panic payload (`&str` or `String`; anything else gets a placeholder).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "the agent function panicked with a non-string payload".to_owned()
    }
}

fn check_unique_tool_names(rendered: &Rendered) -> Result<(), ToolNameConflictError> {
    // A handful of names: a quadratic scan over names collected once (each `name()` is a
    // virtual call) beats hashing them. Spills to the heap past 32 tools.
    const INLINE: usize = 32;
    let mut inline = [""; INLINE];
    let mut spilled: Vec<&str> = Vec::new();
    for (index, tool) in rendered.tools.iter().enumerate() {
        let name = tool.name();
        // The framework's own tools are assembled with these (reference: a custom tool using a
        // reserved name is a `tool_name_conflict`).
        if crate::tool::RESERVED_TOOL_NAMES.contains(&name) {
            return Err(ToolNameConflictError::reserved(name));
        }
        let earlier = if index <= INLINE {
            &inline[..index]
        } else {
            &spilled[..]
        };
        if earlier.iter().any(|other| {
            other.len() == name.len() && other.as_bytes().first() == name.as_bytes().first() && *other == name
        }) {
            return Err(ToolNameConflictError::duplicate(name));
        }
        if index < INLINE {
            inline[index] = name;
        } else {
            if spilled.is_empty() {
                spilled.extend_from_slice(&inline);
            }
            spilled.push(name);
        }
    }
    Ok(())
}

fn check_data_writer_identity(
    previous: &[Cow<'static, str>],
    next: &[DataWriterDeclaration],
) -> Result<(), RenderError> {
    let added: Vec<String> = next
        .iter()
        .filter(|declared| !previous.contains(&declared.name))
        .map(|declared| declared.name.to_string())
        .collect();
    let removed: Vec<String> = previous
        .iter()
        .filter(|name| !next.iter().any(|declared| declared.name == **name))
        .map(|name| name.to_string())
        .collect();
    if added.is_empty() && removed.is_empty() {
        Ok(())
    } else {
        Err(RenderError::IdentityChanged { added, removed })
    }
}
