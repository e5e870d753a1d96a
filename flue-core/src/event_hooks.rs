//! The four event hooks' callbacks and the contexts they receive.
//!
//! `use_agent_start` and `use_agent_finish` callbacks are async, may fail, and can append
//! signals into the running response while they run. `use_response_start` and
//! `use_response_finish` callbacks are synchronous observers returning metadata; that they are
//! synchronous is enforced by their type (a callback returning a future does not compile).

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use serde_json::Value;

use crate::BoxFuture;
use crate::abort::AbortSignal;
use crate::log::Logger;
use crate::message::{DeliveredMessage, MessageError, Signal};
use crate::metadata::Metadata;
use crate::usage::Usage;

/// The error a callback fails with: anything that converts into a boxed error.
pub type CallbackError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What an event-hook callback may return: `()` or `Result<(), E>`.
#[diagnostic::on_unimplemented(
    message = "a `use_agent_start` or `use_agent_finish` callback's future yields `()` or `Result<(), E>`, not `{Self}`",
    label = "the callback's future yields this",
    note = "report a failure as an error (`Err(..)`, which fails the seam); return nothing otherwise"
)]
pub trait IntoCallbackResult {
    /// Converts into the callback's outcome.
    fn into_callback_result(self) -> Result<(), CallbackError>;
}

impl IntoCallbackResult for () {
    fn into_callback_result(self) -> Result<(), CallbackError> {
        Ok(())
    }
}

impl<E: Into<CallbackError>> IntoCallbackResult for Result<(), E> {
    fn into_callback_result(self) -> Result<(), CallbackError> {
        self.map_err(Into::into)
    }
}

/// Receives what a seam's callbacks append and log; implemented by the runtime.
pub trait SeamChannel: Send + Sync {
    /// Buffers a signal for the seam's atomic commit.
    fn append(&self, signal: Signal);
}

/// The window in which a callback's `append` is legal: open while the callback runs.
#[derive(Clone, Debug)]
pub struct AppendWindow {
    /// Held by an append from its check to its push, and by [`close`](Self::close): once
    /// `close` returns, every append that passed the check has pushed (the runtime takes the
    /// signals next), and every later one fails.
    open: Arc<std::sync::Mutex<bool>>,
}

impl AppendWindow {
    /// A window that is open.
    pub fn open() -> Self {
        Self {
            open: Arc::new(std::sync::Mutex::new(true)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, bool> {
        self.open.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Closes the window: every later `append` through a captured context fails, and one
    /// running on another thread (a task the callback spawned) has pushed its signal when
    /// this returns.
    pub fn close(&self) {
        *self.lock() = false;
    }

    /// Whether appends are still legal.
    pub fn is_open(&self) -> bool {
        *self.lock()
    }

    /// Runs `push` while the window is open (the window cannot close meanwhile); `None` when
    /// it is closed.
    fn while_open<R>(&self, push: impl FnOnce() -> R) -> Option<R> {
        let open = self.lock();
        (*open).then(push)
    }
}

/// Which seam an append came from (for its messages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seam {
    /// A `use_agent_start` callback.
    AgentStart,
    /// A `use_agent_finish` callback.
    AgentFinish,
}

/// An `append` that could not happen.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum AppendError {
    /// The callback already settled.
    #[error("{}", after_settled_message(*.0))]
    AfterSettled(Seam),
    /// The signal breaks a delivery rule.
    #[error("{}", invalid_message(.0))]
    Invalid(MessageError),
}

fn after_settled_message(seam: Seam) -> &'static str {
    match seam {
        Seam::AgentStart => {
            "[flue] append() was called after its use_agent_start callback settled. The append window is the callback itself — to send input at any other time, use the dispatcher from use_dispatch_message()."
        }
        Seam::AgentFinish => {
            "[flue] append() was called after its use_agent_finish callback settled. The continuation window is the callback itself — to send input at any other time, use the dispatcher from use_dispatch_message()."
        }
    }
}

fn invalid_message(error: &MessageError) -> String {
    match error {
        MessageError::ReservedSignalType(signal_type) => format!(
            "[flue] append() signal type \"{signal_type}\" is framework-reserved vocabulary (the runtime's own narration and recovery signals) — use an application-specific type."
        ),
        other => format!("[flue] append() message is invalid: {other}"),
    }
}

/// The append/log/abort surface shared by the two async seams.
#[derive(Clone)]
struct SeamHandle {
    seam: Seam,
    channel: Arc<dyn SeamChannel>,
    window: AppendWindow,
    signal: AbortSignal,
    log: Logger,
}

impl SeamHandle {
    fn append(&self, signal: Signal) -> Result<(), AppendError> {
        if !self.window.is_open() {
            return Err(AppendError::AfterSettled(self.seam));
        }
        signal.validate().map_err(AppendError::Invalid)?;
        // Checked again with the push, under the window's lock: an append racing the
        // callback's end either lands before the runtime takes the signals or fails, never
        // lands after and is lost.
        self.window
            .while_open(|| self.channel.append(signal))
            .ok_or(AppendError::AfterSettled(self.seam))
    }
}

/// What a `use_agent_start` callback receives.
///
/// `append` writes a signal into this response without registering a delivery; it is legal
/// only while the callback runs. Prefer the dispatcher from `use_dispatch_message` for real
/// input. (That `append` takes a [`Signal`] makes appending a user message a type error.)
#[derive(Clone)]
pub struct AgentStartContext {
    handle: SeamHandle,
    delivery: Arc<DeliveredMessage>,
}

impl AgentStartContext {
    /// Built by the runtime for one callback run.
    pub fn new(
        channel: Arc<dyn SeamChannel>,
        window: AppendWindow,
        signal: AbortSignal,
        log: Logger,
        delivery: Arc<DeliveredMessage>,
    ) -> Self {
        Self {
            handle: SeamHandle {
                seam: Seam::AgentStart,
                channel,
                window,
                signal,
                log,
            },
            delivery,
        }
    }

    /// Appends a signal into the running response (validated like a delivered signal).
    pub fn append(&self, signal: Signal) -> Result<(), AppendError> {
        self.handle.append(signal)
    }

    /// The delivered message this callback runs for.
    pub fn delivery(&self) -> &DeliveredMessage {
        &self.delivery
    }

    /// The submission's abort signal.
    pub fn signal(&self) -> &AbortSignal {
        &self.handle.signal
    }

    /// Progress lines into the conversation stream (never seen by the model).
    pub fn log(&self) -> &Logger {
        &self.handle.log
    }
}

impl fmt::Debug for AgentStartContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentStartContext")
            .field("delivery", &self.delivery)
            .finish_non_exhaustive()
    }
}

/// One tool call a response made.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolCallSummary {
    /// The tool's name.
    pub tool: String,
    /// Whether its result was an error.
    pub is_error: bool,
}

/// What a response did so far (or, in `use_response_finish`, in total).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResponseSummary {
    /// Every tool call of the response, across turns and re-attempts.
    pub tool_calls: Vec<ToolCallSummary>,
    /// Aggregate usage.
    pub usage: Usage,
}

/// What a `use_agent_finish` callback receives.
#[derive(Clone)]
pub struct AgentFinishContext {
    handle: SeamHandle,
    response: Arc<ResponseSummary>,
}

impl AgentFinishContext {
    /// Built by the runtime for one callback run.
    pub fn new(
        channel: Arc<dyn SeamChannel>,
        window: AppendWindow,
        signal: AbortSignal,
        log: Logger,
        response: Arc<ResponseSummary>,
    ) -> Self {
        Self {
            handle: SeamHandle {
                seam: Seam::AgentFinish,
                channel,
                window,
                signal,
                log,
            },
            response,
        }
    }

    /// Appends a continuation signal: the response runs another turn.
    pub fn append(&self, signal: Signal) -> Result<(), AppendError> {
        self.handle.append(signal)
    }

    /// What the response did so far.
    pub fn response(&self) -> &ResponseSummary {
        &self.response
    }

    /// The submission's abort signal.
    pub fn signal(&self) -> &AbortSignal {
        &self.handle.signal
    }

    /// Progress lines into the conversation stream.
    pub fn log(&self) -> &Logger {
        &self.handle.log
    }
}

impl fmt::Debug for AgentFinishContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentFinishContext")
            .field("response", &self.response)
            .finish_non_exhaustive()
    }
}

/// What a `use_response_start` callback receives.
#[derive(Clone, Debug)]
pub struct ResponseStartContext {
    /// Metadata accumulated so far this response (earlier callbacks' contributions).
    pub metadata: Metadata,
    /// Progress lines into the conversation stream.
    pub log: Logger,
}

/// What a `use_response_finish` callback receives.
#[derive(Clone, Debug)]
pub struct ResponseFinishContext {
    /// Metadata accumulated so far (start contributions, then earlier finish callbacks').
    pub metadata: Metadata,
    /// Final usage and tool calls of the response.
    pub response: ResponseSummary,
    /// Progress lines into the conversation stream.
    pub log: Logger,
}

/// What a response-metadata callback may return: nothing (`()`, `None`) or a JSON object
/// (`Map`, `Some(map)`, or a `Value` that is an object or `null`), optionally in a `Result`.
#[diagnostic::on_unimplemented(
    message = "a response metadata callback returns a JSON object of metadata or nothing, not `{Self}`",
    label = "not metadata",
    note = "use_response_start and use_response_finish callbacks are synchronous; async work belongs in use_agent_start or use_agent_finish"
)]
pub trait IntoMetadata {
    /// Converts into a metadata contribution.
    fn into_metadata(self) -> Result<Option<Metadata>, MetadataError>;
}

impl IntoMetadata for () {
    fn into_metadata(self) -> Result<Option<Metadata>, MetadataError> {
        Ok(None)
    }
}

impl IntoMetadata for Metadata {
    fn into_metadata(self) -> Result<Option<Metadata>, MetadataError> {
        Ok(Some(self))
    }
}

impl IntoMetadata for Option<Metadata> {
    fn into_metadata(self) -> Result<Option<Metadata>, MetadataError> {
        Ok(self)
    }
}

impl IntoMetadata for Value {
    fn into_metadata(self) -> Result<Option<Metadata>, MetadataError> {
        match self {
            Value::Object(map) => Ok(Some(map)),
            Value::Null => Ok(None),
            Value::Array(_) => Err(MetadataError::NotAnObject("an array")),
            Value::String(_) => Err(MetadataError::NotAnObject("string")),
            Value::Number(_) => Err(MetadataError::NotAnObject("number")),
            Value::Bool(_) => Err(MetadataError::NotAnObject("boolean")),
        }
    }
}

impl<M: IntoMetadata, E: Into<CallbackError>> IntoMetadata for Result<M, E> {
    fn into_metadata(self) -> Result<Option<Metadata>, MetadataError> {
        match self {
            Ok(metadata) => metadata.into_metadata(),
            Err(error) => Err(MetadataError::Failed(error.into().to_string())),
        }
    }
}

/// A response-metadata callback that did not produce metadata.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MetadataError {
    /// It returned a JSON value that is not an object.
    #[error("[flue] A response metadata callback must return a plain object of metadata (or nothing) — got {0}.")]
    NotAnObject(&'static str),
    /// It returned an error.
    #[error("{0}")]
    Failed(String),
}

type AgentStartFn = dyn Fn(AgentStartContext) -> BoxFuture<'static, Result<(), CallbackError>> + Send + Sync;
type AgentFinishFn = dyn Fn(AgentFinishContext) -> BoxFuture<'static, Result<(), CallbackError>> + Send + Sync;
type ResponseStartFn = dyn Fn(&ResponseStartContext) -> Result<Option<Metadata>, MetadataError> + Send + Sync;
type ResponseFinishFn = dyn Fn(&ResponseFinishContext) -> Result<Option<Metadata>, MetadataError> + Send + Sync;

/// Shares a callback: `&'static` when the closure is zero-sized (boxing a zero-sized value
/// does not allocate, so leaking it is free), reference-counted otherwise. Renders re-declare
/// every callback before every model call, so this keeps the common case allocation-free.
enum Shared<F: ?Sized + 'static> {
    Static(&'static F),
    Counted(Arc<F>),
}

impl<F: ?Sized> Clone for Shared<F> {
    fn clone(&self) -> Self {
        match self {
            Self::Static(f) => Self::Static(f),
            Self::Counted(f) => Self::Counted(Arc::clone(f)),
        }
    }
}

impl<F: ?Sized> std::ops::Deref for Shared<F> {
    type Target = F;

    fn deref(&self) -> &F {
        match self {
            Self::Static(f) => f,
            Self::Counted(f) => f,
        }
    }
}

macro_rules! share {
    ($closure:expr) => {{
        let closure = $closure;
        if std::mem::size_of_val(&closure) == 0 {
            Shared::Static(Box::leak(Box::new(closure)))
        } else {
            Shared::Counted(Arc::new(closure))
        }
    }};
}

/// A `use_agent_start` callback.
#[derive(Clone)]
pub struct AgentStartHook(Shared<AgentStartFn>);

impl AgentStartHook {
    /// Wraps an async callback.
    pub fn new<F, Fut>(run: F) -> Self
    where
        F: Fn(AgentStartContext) -> Fut + Send + Sync + 'static,
        Fut: Future + Send + 'static,
        Fut::Output: IntoCallbackResult,
    {
        Self(share!(move |ctx| -> BoxFuture<'static, Result<(), CallbackError>> {
            let future = run(ctx);
            Box::pin(async move { future.await.into_callback_result() })
        }))
    }

    /// Runs the callback.
    pub fn call(&self, ctx: AgentStartContext) -> BoxFuture<'static, Result<(), CallbackError>> {
        (self.0)(ctx)
    }
}

/// A `use_agent_finish` callback.
#[derive(Clone)]
pub struct AgentFinishHook(Shared<AgentFinishFn>);

impl AgentFinishHook {
    /// Wraps an async callback.
    pub fn new<F, Fut>(run: F) -> Self
    where
        F: Fn(AgentFinishContext) -> Fut + Send + Sync + 'static,
        Fut: Future + Send + 'static,
        Fut::Output: IntoCallbackResult,
    {
        Self(share!(move |ctx| -> BoxFuture<'static, Result<(), CallbackError>> {
            let future = run(ctx);
            Box::pin(async move { future.await.into_callback_result() })
        }))
    }

    /// Runs the callback.
    pub fn call(&self, ctx: AgentFinishContext) -> BoxFuture<'static, Result<(), CallbackError>> {
        (self.0)(ctx)
    }
}

/// A `use_response_start` callback.
#[derive(Clone)]
pub struct ResponseStartHook(Shared<ResponseStartFn>);

impl ResponseStartHook {
    /// Wraps a synchronous callback.
    pub fn new<F, M>(run: F) -> Self
    where
        F: Fn(&ResponseStartContext) -> M + Send + Sync + 'static,
        M: IntoMetadata,
    {
        Self(share!(move |ctx: &_| run(ctx).into_metadata()))
    }

    /// Runs the callback.
    pub fn call(&self, ctx: &ResponseStartContext) -> Result<Option<Metadata>, MetadataError> {
        (self.0)(ctx)
    }
}

/// A `use_response_finish` callback.
#[derive(Clone)]
pub struct ResponseFinishHook(Shared<ResponseFinishFn>);

impl ResponseFinishHook {
    /// Wraps a synchronous callback.
    pub fn new<F, M>(run: F) -> Self
    where
        F: Fn(&ResponseFinishContext) -> M + Send + Sync + 'static,
        M: IntoMetadata,
    {
        Self(share!(move |ctx: &_| run(ctx).into_metadata()))
    }

    /// Runs the callback.
    pub fn call(&self, ctx: &ResponseFinishContext) -> Result<Option<Metadata>, MetadataError> {
        (self.0)(ctx)
    }
}

macro_rules! opaque_debug {
    ($($name:ident),*) => {$(
        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(stringify!($name))
            }
        }
    )*};
}
opaque_debug!(AgentStartHook, AgentFinishHook, ResponseStartHook, ResponseFinishHook);
