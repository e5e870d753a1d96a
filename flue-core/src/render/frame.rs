//! The thread-local render slot and the RAII guard that owns it for one render.
//!
//! A render is synchronous and never spans an `.await`, so a thread-local slot is exactly as
//! wide as one render: the guard sets it on entry and clears it on drop, which also runs while
//! a panic unwinds out of the agent body. Hooks find the frame through [`with_frame`]; writers
//! use [`is_rendering`] for the inverse check (any active render on this thread makes them
//! refuse, as in the reference).

use std::cell::{Cell, RefCell};
use std::ptr;

use super::{RenderState, Rendered};

thread_local! {
    static CURRENT: Cell<*const ()> = const { Cell::new(ptr::null()) };
    /// Whether an agent's body runs on this thread.
    static BODY: Cell<bool> = const { Cell::new(false) };
}

/// Marks an agent's body as running on this thread until it drops (on unwind too). What the
/// bodies `#[agent]` and [`crate::FnAgent`] make open with: one body calling another agent's
/// `render_body` directly (its hooks would join this render unnoticed) is a re-entrant render.
#[doc(hidden)]
#[must_use]
pub struct BodyGuard {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl BodyGuard {
    /// Enters an agent's body, or panics with the re-entrant render's message when one runs.
    #[track_caller]
    pub fn enter() -> Self {
        if BODY.with(|body| body.replace(true)) {
            crate::hooks::violation(REENTRANT_MESSAGE.to_owned());
        }
        Self {
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for BodyGuard {
    fn drop(&mut self) {
        BODY.with(|body| body.set(false));
    }
}

/// One render in progress: what the runtime supplied, and what the hooks recorded so far.
pub(crate) struct Frame<'a> {
    pub(crate) state: &'a RenderState<'a>,
    pub(crate) rec: RefCell<&'a mut Rendered>,
}

/// Whether a render is in progress on this thread.
///
/// Writers (state setters, data writers, the dispatcher) refuse to run while this is true:
/// renders are pure reads.
pub fn is_rendering() -> bool {
    CURRENT.with(|slot| !slot.get().is_null())
}

/// The message every hook panics with when it runs outside a render.
pub(crate) fn outside_message(hook: &str) -> String {
    format!(
        "[flue] {hook}() was called outside an agent function. Flue Hooks compose an agent while it renders: call them synchronously in the agent function body (or in a custom hook it calls), not from tools, actions, event handlers, or module scope."
    )
}

pub(crate) const REENTRANT_MESSAGE: &str = "[flue] Re-entrant agent render. An agent function must not invoke another agent function directly; compose shared behavior with custom hooks instead.";

/// Runs `f` against the frame of the render in progress, or panics with the reference's
/// "called outside an agent function" message naming `hook`.
#[track_caller]
pub(crate) fn with_frame<R>(hook: &str, f: impl FnOnce(&Frame<'_>) -> R) -> R {
    let current = CURRENT.with(Cell::get);
    if current.is_null() {
        crate::hooks::violation(outside_message(hook));
    }
    // SAFETY: `current` is only non-null while a `FrameGuard` is alive on this thread, and the
    // guard is dropped (clearing the slot) before the frame it points to goes out of scope.
    // The closure is higher-ranked over the frame's lifetimes, so nothing borrowed from the
    // frame can escape this call.
    let frame = unsafe { &*current.cast::<Frame<'_>>() };
    f(frame)
}

/// Owns the slot for exactly one render. Dropping it clears the slot, on unwind too.
pub(crate) struct FrameGuard {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl FrameGuard {
    /// Installs `frame` as the current render, or panics if a render is already in progress.
    #[track_caller]
    pub(crate) fn enter(frame: &Frame<'_>) -> FrameGuard {
        CURRENT.with(|slot| {
            if !slot.get().is_null() {
                crate::hooks::violation(REENTRANT_MESSAGE.to_owned());
            }
            slot.set(ptr::from_ref(frame).cast());
        });
        FrameGuard {
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for FrameGuard {
    fn drop(&mut self) {
        CURRENT.with(|slot| slot.set(ptr::null()));
    }
}
