//! Every Agent Hooks API hook, one file each.
//!
//! All hooks follow the rules of hooks: call them synchronously while an agent function
//! renders (in its body or in a custom hook it calls). Every hook is `#[track_caller]`, so a
//! misuse panics at the user's line with the reference's `[flue] …` message.

mod agent_finish;
mod agent_start;
mod data_writer;
mod delivery;
mod dispatch;
mod initial_data;
mod instruction;
mod lifecycle;
mod mcp;
mod model;
mod persistent_state;
mod response;
mod sandbox;
mod skill;
mod subagent;
mod tool;

use std::cell::Cell;
use std::panic::Location;

pub use agent_finish::use_agent_finish;
pub use agent_start::use_agent_start;
pub use data_writer::{DataWriter, use_data_writer, use_data_writer_with_schema};
pub use delivery::use_delivery;
pub use dispatch::{Dispatcher, use_dispatch_message};
pub use initial_data::use_initial_data;
pub use instruction::use_instruction;
pub use lifecycle::use_hooks;
pub use mcp::use_mcp_connection;
pub use model::{use_model, use_model_with};
pub use persistent_state::{StateSetter, StateValue, use_persistent_state, use_persistent_state_opt};
pub use response::{use_response_finish, use_response_start};
pub use sandbox::{use_sandbox, use_sandbox_with};
pub use skill::use_skill;
pub use subagent::use_subagent;
pub use tool::use_tool;

use crate::render::{Frame, RenderKind, with_frame};

thread_local! {
    static LAST_VIOLATION: Cell<Option<&'static Location<'static>>> = const { Cell::new(None) };
}

/// Panics with a rules-of-hooks `message` at the caller's location (through every
/// `#[track_caller]` frame above), remembering the location for [`crate::try_render`].
#[track_caller]
pub(crate) fn violation(message: String) -> ! {
    let location = Location::caller();
    LAST_VIOLATION.with(|slot| slot.set(Some(location)));
    panic!("{message}");
}

/// The location of the last rules-of-hooks violation on this thread, taken (cleared).
pub(crate) fn take_violation_location() -> Option<&'static Location<'static>> {
    LAST_VIOLATION.with(Cell::take)
}

/// Runs a hook's body against the current frame; an `Err` becomes a violation at the
/// caller's line.
#[track_caller]
pub(crate) fn hook<R>(name: &str, body: impl FnOnce(&Frame<'_>) -> Result<R, String>) -> R {
    match with_frame(name, body) {
        Ok(value) => value,
        Err(message) => violation(message),
    }
}

/// The rejection of a root-only hook in a subagent render.
#[inline]
pub(crate) fn root_only(frame: &Frame<'_>, message: &str) -> Result<(), String> {
    if frame.state.kind() == RenderKind::Subagent {
        Err(message.to_owned())
    } else {
        Ok(())
    }
}
