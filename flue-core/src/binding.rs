//! The seam between the render model and the runtime that runs it.
//!
//! Setters, data writers and the dispatcher are `Clone + Send + 'static` handles that hold the
//! render's [`RuntimeBinding`] (or nothing, on a bare render). They call into it when used; the
//! binding resolves the instance's *current* attempt at that moment — so a setter captured in a
//! tool closure writes into the attempt that runs the tool, and one called after the
//! submission ended is refused.

use serde_json::Value;

use crate::BoxFuture;
use crate::message::{DeliveredMessage, DispatchReceipt, MessageError};

/// The read-modify-write step of [`RuntimeBinding::modify_state`]: given the current value,
/// the value to write (or `None` for no change).
pub type StateModify<'a> = dyn FnMut(Option<&Value>) -> Result<Option<Value>, StateWriteError> + 'a;

/// What a render's writers call into. Implemented by the runtime (and by
/// [`crate::testing::TestBinding`] for tests).
pub trait RuntimeBinding: Send + Sync + 'static {
    /// Read-modify-write of the state value `name` in the current attempt's write buffer.
    ///
    /// `modify` receives the current value (the attempt's own writes over the committed
    /// snapshot; `None` before the first write ever) and returns the value to write, or `None`
    /// for no change. The binding runs it under the buffer's lock, so concurrent updaters
    /// compose instead of dropping each other's writes.
    fn modify_state(&self, name: &str, modify: &mut StateModify<'_>) -> Result<(), StateWriteError>;

    /// Appends one write of the data part `name` to the current response and streams it.
    fn write_data(&self, name: &str, data: Value) -> Result<(), DataWriteError>;

    /// Admits `message` to this instance's queue (the same admission as every transport).
    fn dispatch(&self, message: DeliveredMessage) -> BoxFuture<'static, Result<DispatchReceipt, DispatchError>>;
}

/// A state write that could not happen.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum StateWriteError {
    /// The render had no runtime behind it (a bare render).
    #[error("[flue] State \"{name}\" has no durable runtime behind this render, so writes are unavailable.")]
    NoRuntime {
        /// The state name.
        name: String,
    },
    /// The instance is not responding, so there is no attempt to write into.
    #[error(
        "[flue] State \"{name}\" can only be written while the agent is responding — write from tool run functions (and other callbacks that run during a submission)."
    )]
    NotResponding {
        /// The state name.
        name: String,
    },
    /// The value does not serialize to JSON.
    #[error("[flue] State \"{name}\" value is not JSON-serializable: {reason}.")]
    NotJson {
        /// The state name.
        name: String,
        /// What serde reported.
        reason: String,
    },
    /// The stored value does not deserialize as the type the setter was declared with.
    #[error("[flue] State \"{name}\" holds a value that does not match its declared type: {reason}.")]
    TypeMismatch {
        /// The state name.
        name: String,
        /// What serde reported.
        reason: String,
    },
}

/// A data-part write that could not happen.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DataWriteError {
    /// The render had no runtime behind it (a bare render).
    #[error("[flue] Message data \"{name}\" has no durable runtime behind this render, so writes are unavailable.")]
    NoRuntime {
        /// The part name.
        name: String,
    },
    /// No submission is running on the instance.
    #[error(
        "[flue] Message data \"{name}\" can only be written while the agent is responding — write from tool run functions (and other callbacks that run during a submission)."
    )]
    NotResponding {
        /// The part name.
        name: String,
    },
    /// The value does not match the writer's schema.
    #[error("[flue] Message data \"{name}\" write does not match its schema: {issues}.")]
    SchemaMismatch {
        /// The part name.
        name: String,
        /// The validation issues, `; `-joined.
        issues: String,
    },
    /// The value does not serialize to JSON.
    #[error("[flue] Message data \"{name}\" value is not JSON-serializable: {reason}.")]
    NotJson {
        /// The part name.
        name: String,
        /// What serde reported.
        reason: String,
    },
}

/// A self-dispatch that could not be admitted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DispatchError {
    /// The render had no runtime behind it (a bare render).
    #[error(
        "[flue] The use_dispatch_message() dispatcher has no durable runtime behind this render, so self-dispatch is unavailable."
    )]
    NoRuntime,
    /// The runtime behind the render has shut down or is not accepting admissions.
    #[error("[flue] The use_dispatch_message() dispatcher was called while the Flue runtime is not running: {reason}.")]
    RuntimeUnavailable {
        /// Why.
        reason: String,
    },
    /// The message breaks a delivery rule.
    #[error("[flue] The use_dispatch_message() dispatcher received an invalid message: {0}")]
    InvalidMessage(#[from] MessageError),
    /// Admission failed in the store.
    #[error("[flue] The use_dispatch_message() dispatcher could not admit the message: {reason}.")]
    Admission {
        /// Why.
        reason: String,
    },
}
