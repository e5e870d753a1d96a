//! Standard Agents lifecycle hooks: the 17 kinds, the values they see, and the references an
//! agent uses to select them (`use_hooks`, `#[agent(hooks = [..])]`).
//!
//! Thread hooks ([`ThreadHook`]) and user-scope hooks ([`UserHook`]) are different types, so
//! selecting a user-scope hook where thread hooks are expected does not compile.

mod kind;
mod thread;
mod types;
mod user;

use std::fmt;

pub use kind::HookKind;
pub use thread::{
    ExecutionState, InjectMessage, MessageOrder, MessagePage, MessagesQuery, ThreadContext, ThreadError,
    ThreadIdentity, ThreadState, ThreadStateApi,
};
pub use types::{
    ClientInfo, HookError, LlmMessage, Message, MessageAttachment, MessageRole, MessageStatus, MessageUpdates,
    ToolCall, ToolCallFunction, ToolResult, ToolStatus,
};
pub use user::{
    MAX_USER_KEY_LEN, UserState, UserStateApi, UserValue, UserValuePage, UserValuesQuery, check_user_id, check_user_key,
};

use crate::BoxFuture;

/// The outcome of one hook call.
pub type HookFuture<'a, T> = BoxFuture<'a, Result<T, HookError>>;

/// What a lifecycle hook function may return for a kind whose result is `T`: `T` itself or
/// `Result<T, E>` with `E` convertible into a [`HookError`]. `#[hook]` asserts it at the
/// function's return type, after reading a `Result` whose error is text or only displays as
/// one with a [`HookError`] of that text.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not what this lifecycle hook returns",
    label = "this hook kind returns `{T}` (or `Result<{T}, E>`)",
    note = "see the kind's signature in the `#[hook]` documentation; the error `E` of a `Result` is a `HookError`, any `std::error::Error`, text, or any error that displays (such an error is read as a `HookError` before this check, so this message names it so)"
)]
pub trait HookReturn<T> {
    /// Converts into the hook's outcome.
    fn into_hook_result(self) -> Result<T, HookError>;
}

/// A hook function's parameter declared as `Self` where its kind passes `Provided`: only the
/// very type. `#[hook]` asserts it at each parameter's type (through [`hook_parameter`]), so a
/// wrong type is reported there with the type the kind passes, rather than as a mismatch the
/// other way round inside the expansion.
#[diagnostic::on_unimplemented(
    message = "this hook parameter is declared `{Self}`, but its kind passes `{Provided}` here",
    label = "declare it as `{Provided}`",
    note = "see the kind's signature in the `#[hook]` documentation"
)]
#[doc(hidden)]
pub trait HookParameter<Provided> {
    /// The argument itself.
    fn declared(provided: Provided) -> Self;
}

impl<T> HookParameter<T> for T {
    fn declared(provided: T) -> T {
        provided
    }
}

/// The argument a hook function's parameter of type `D` gets from its kind's `P`: `P` itself,
/// asserting [`HookParameter`] where `#[hook]` spans the call. A function, so `D` is inferred
/// from the parameter (its lifetimes included) rather than named.
#[doc(hidden)]
pub fn hook_parameter<D: HookParameter<P>, P>(provided: P) -> D {
    D::declared(provided)
}

// Like a tool (see `crate::tool::Returned`), a `#[hook]` function may fail with text
// (`Result<T, String>`, `Result<T, &'static str>`) or with any error that displays
// (`anyhow::Error`, `Box<dyn Error + Send + Sync>`), which no `IntoHookError` impl can take beside
// the one for every type a `HookError` converts from. So `#[hook]` reads its value by method
// resolution first: `(&&&Returned(&value)).__flue_hook_return().adapt(value)` finds, in order,
// 1. `TextErrorHookReturn` (a text error, made a `HookError`) or `ConvertibleHookReturn` (a
//    `Result` whose error is an `IntoHookError`, read as it is: a `HookError::block` keeps its
//    flag), both on `&&Returned<_>`;
// 2. `DisplayErrorHookReturn` (any other `Result` whose error displays: its text becomes the
//    `HookError`'s message), on `&Returned<_>`;
// 3. `OtherHookReturn`, on `Returned<_>` (anything else, left for `hook_return` to accept or
//    reject at the return type).

impl crate::tool::Failure for HookError {
    fn from_text(text: String) -> Self {
        Self::new(text)
    }
}

/// A `Result` whose error is text; read as one with a [`HookError`] of that text.
#[doc(hidden)]
pub trait TextErrorHookReturn {
    /// How `#[hook]` reads the value before [`hook_return`].
    fn __flue_hook_return(&self) -> crate::tool::TextError<HookError> {
        crate::tool::TextError::new()
    }
}

impl<T> TextErrorHookReturn for &&crate::tool::Returned<'_, Result<T, String>> {}
impl<T> TextErrorHookReturn for &&crate::tool::Returned<'_, Result<T, &'static str>> {}

/// A `Result` whose error [`hook_return`] converts as it is.
#[doc(hidden)]
pub trait ConvertibleHookReturn {
    /// How `#[hook]` reads the value before [`hook_return`].
    fn __flue_hook_return(&self) -> crate::tool::AsReturned {
        crate::tool::AsReturned
    }
}

impl<T, E: IntoHookError> ConvertibleHookReturn for &&crate::tool::Returned<'_, Result<T, E>> {}

/// A `Result` whose error displays but converts into no [`HookError`] (`anyhow::Error`, a boxed
/// `dyn Error`); read as one with a [`HookError`] of the error's text.
#[doc(hidden)]
pub trait DisplayErrorHookReturn {
    /// How `#[hook]` reads the value before [`hook_return`].
    fn __flue_hook_return(&self) -> crate::tool::DisplayError<HookError> {
        crate::tool::DisplayError::new()
    }
}

impl<T, E: fmt::Display> DisplayErrorHookReturn for &crate::tool::Returned<'_, Result<T, E>> {}

/// Any other return value, left as it is.
#[doc(hidden)]
pub trait OtherHookReturn {
    /// How `#[hook]` reads the value before [`hook_return`].
    fn __flue_hook_return(&self) -> crate::tool::AsReturned {
        crate::tool::AsReturned
    }
}

impl<T: ?Sized> OtherHookReturn for crate::tool::Returned<'_, T> {}

/// Converts a hook function's return value for a kind whose result is `T`, asserting
/// [`HookReturn`] where `#[hook]` spans it. A function, not a path naming the return type, so
/// the type may be `impl Trait`.
#[doc(hidden)]
pub fn hook_return<T, R: HookReturn<T>>(value: R) -> Result<T, HookError> {
    value.into_hook_result()
}

/// The error of a lifecycle hook's `Result`: a [`HookError`], any `std::error::Error`, or any
/// other type a [`HookError`] converts from. Text is not one (coherence rules out a conversion
/// from it beside the one from every error type), nor is an error that only displays
/// (`anyhow::Error`, a boxed `dyn Error`): `#[hook]` reads those itself, before this trait, as
/// a [`HookError`] of their text; elsewhere `HookError::new(text)` makes one of them.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a lifecycle hook's error",
    label = "fail with a `HookError`, any `std::error::Error`, text, or an error that displays",
    note = "a `Result` a lifecycle hook returns fails with a `HookError` or a type it converts from (every `std::error::Error` does); a `#[hook]` function may also fail with text or with any error that displays, whose text becomes the `HookError`'s message"
)]
pub trait IntoHookError {
    /// Converts into the hook's error.
    fn into_hook_error(self) -> HookError;
}

// Not recommended: a type that converts into no `HookError` is reported as not being an
// `IntoHookError` (the message above), rather than as rustc's `From` bound.
#[diagnostic::do_not_recommend]
impl<E> IntoHookError for E
where
    HookError: From<E>,
{
    fn into_hook_error(self) -> HookError {
        HookError::from(self)
    }
}

impl<T> HookReturn<T> for T {
    fn into_hook_result(self) -> Result<T, HookError> {
        Ok(self)
    }
}

impl<T, E: IntoHookError> HookReturn<T> for Result<T, E> {
    fn into_hook_result(self) -> Result<T, HookError> {
        self.map_err(IntoHookError::into_hook_error)
    }
}

/// `after_system_message` may return the new message directly.
impl HookReturn<Option<String>> for String {
    fn into_hook_result(self) -> Result<Option<String>, HookError> {
        Ok(Some(self))
    }
}

/// `after_tool_call_*` may return the replacement result directly.
impl HookReturn<Option<ToolResult>> for ToolResult {
    fn into_hook_result(self) -> Result<Option<ToolResult>, HookError> {
        Ok(Some(self))
    }
}

/// `after_system_message` may return the new message directly, in a `Result`.
impl<E: IntoHookError> HookReturn<Option<String>> for Result<String, E> {
    fn into_hook_result(self) -> Result<Option<String>, HookError> {
        self.map(Some).map_err(IntoHookError::into_hook_error)
    }
}

/// `after_tool_call_*` may return the replacement result directly, in a `Result`.
impl<E: IntoHookError> HookReturn<Option<ToolResult>> for Result<ToolResult, E> {
    fn into_hook_result(self) -> Result<Option<ToolResult>, HookError> {
        self.map(Some).map_err(IntoHookError::into_hook_error)
    }
}

/// What `#[agent(hooks = [..])]` and `parent_hooks` select as a lifecycle hook: a
/// [`ThreadHook`]. Anything else is refused at compile time, a user-scope hook with where it
/// belongs instead. ([`use_hooks`](crate::hooks::use_hooks) takes `ThreadHook`s as such, so an
/// empty selection needs no annotation.)
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a thread lifecycle hook",
    label = "not a `#[hook(kind)]` of a thread kind",
    note = "agents select hooks defined with `#[hook(kind)]` for one of the 14 thread kinds",
    note = "a user-scope hook (`user_client_attached`, `user_client_detached`, `user_value_changed`) is registered with the runtime instead: `RuntimeBuilder::user_hook(..)`"
)]
pub trait SelectableHook {
    /// The hook itself.
    fn into_thread_hook(self) -> ThreadHook;
}

impl SelectableHook for ThreadHook {
    fn into_thread_hook(self) -> ThreadHook {
        self
    }
}

/// A value selected as an agent's hook that is not one (see [`SelectableHook`]): rustc reports
/// the bound of this impl that fails, [`UserScope`] for anything but a user-scope hook, and
/// [`RegisteredWithTheRuntime`] for a user-scope hook, each with its message. Neither holds for
/// a type this impl could run for, so its body is never reached.
impl<H: UserScope + RegisteredWithTheRuntime> SelectableHook for H {
    fn into_thread_hook(self) -> ThreadHook {
        unreachable!("no type is both a user-scope hook and registered with an agent")
    }
}

/// A user-scope hook (see [`SelectableHook`]); anything else that an agent selects as a hook is
/// reported as not being a thread hook.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a thread lifecycle hook",
    label = "not a `#[hook(kind)]` of a thread kind",
    note = "agents select hooks defined with `#[hook(kind)]` for one of the 14 thread kinds"
)]
#[doc(hidden)]
pub trait UserScope {}

impl UserScope for UserHook {}

/// Never implemented (sealed): a user-scope hook selected by an agent is reported with where it
/// belongs.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is a user-scope hook: register it with `RuntimeBuilder::user_hook(..)`; agents select thread hooks only",
    label = "a user-scope hook runs for a user's clients and values, not in an agent's conversation"
)]
#[doc(hidden)]
pub trait RegisteredWithTheRuntime: sealed::Never {}

mod sealed {
    /// Implemented by nothing.
    pub trait Never {}
}

/// A selected hook as the [`ThreadHook`] it is, asserting [`SelectableHook`] where `#[agent]`
/// spans it (at each listed hook).
#[doc(hidden)]
pub fn thread_hook<H: SelectableHook>(hook: H) -> ThreadHook {
    hook.into_thread_hook()
}

/// The typed entry point of a thread hook, one variant per kind.
#[derive(Clone, Copy)]
#[allow(missing_docs)] // each variant is its kind; see `HookKind`.
pub enum ThreadHookHandler {
    AfterThreadCreated(for<'a> fn(&'a ThreadState) -> HookFuture<'a, ()>),
    AfterSubagentCreated(for<'a> fn(&'a ThreadState, &'a ThreadState) -> HookFuture<'a, ()>),
    AfterSystemMessage(for<'a> fn(&'a ThreadState, String) -> HookFuture<'a, Option<String>>),
    FilterMessages(for<'a> fn(&'a ThreadState, Vec<Message>) -> HookFuture<'a, Vec<Message>>),
    PrefilterLlmHistory(for<'a> fn(&'a ThreadState, Vec<LlmMessage>) -> HookFuture<'a, Vec<LlmMessage>>),
    BeforeCreateMessage(for<'a> fn(&'a ThreadState, Message) -> HookFuture<'a, Message>),
    AfterCreateMessage(for<'a> fn(&'a ThreadState, &'a Message) -> HookFuture<'a, ()>),
    BeforeUpdateMessage(for<'a> fn(&'a ThreadState, &'a str, MessageUpdates) -> HookFuture<'a, MessageUpdates>),
    AfterUpdateMessage(for<'a> fn(&'a ThreadState, &'a Message) -> HookFuture<'a, ()>),
    BeforeStoreToolResult(for<'a> fn(&'a ThreadState, &'a ToolCall, ToolResult) -> HookFuture<'a, ToolResult>),
    AfterToolCallSuccess(for<'a> fn(&'a ThreadState, &'a ToolCall, ToolResult) -> HookFuture<'a, Option<ToolResult>>),
    AfterToolCallFailure(for<'a> fn(&'a ThreadState, &'a ToolCall, ToolResult) -> HookFuture<'a, Option<ToolResult>>),
    ToolCallStarted(for<'a> fn(&'a ThreadState, &'a ToolCall, Option<&'a str>) -> HookFuture<'a, ()>),
    ToolCallDone(for<'a> fn(&'a ThreadState, &'a ToolCall, &'a ToolResult) -> HookFuture<'a, ()>),
}

impl ThreadHookHandler {
    /// The kind this handler implements.
    pub fn kind(&self) -> HookKind {
        match self {
            Self::AfterThreadCreated(_) => HookKind::AfterThreadCreated,
            Self::AfterSubagentCreated(_) => HookKind::AfterSubagentCreated,
            Self::AfterSystemMessage(_) => HookKind::AfterSystemMessage,
            Self::FilterMessages(_) => HookKind::FilterMessages,
            Self::PrefilterLlmHistory(_) => HookKind::PrefilterLlmHistory,
            Self::BeforeCreateMessage(_) => HookKind::BeforeCreateMessage,
            Self::AfterCreateMessage(_) => HookKind::AfterCreateMessage,
            Self::BeforeUpdateMessage(_) => HookKind::BeforeUpdateMessage,
            Self::AfterUpdateMessage(_) => HookKind::AfterUpdateMessage,
            Self::BeforeStoreToolResult(_) => HookKind::BeforeStoreToolResult,
            Self::AfterToolCallSuccess(_) => HookKind::AfterToolCallSuccess,
            Self::AfterToolCallFailure(_) => HookKind::AfterToolCallFailure,
            Self::ToolCallStarted(_) => HookKind::ToolCallStarted,
            Self::ToolCallDone(_) => HookKind::ToolCallDone,
        }
    }
}

/// The typed entry point of a user-scope hook.
#[derive(Clone, Copy)]
#[allow(missing_docs)] // each variant is its kind; see `HookKind`.
pub enum UserHookHandler {
    UserClientAttached(for<'a> fn(&'a UserState, &'a ClientInfo) -> HookFuture<'a, ()>),
    UserClientDetached(for<'a> fn(&'a UserState, &'a ClientInfo) -> HookFuture<'a, ()>),
    UserValueChanged(for<'a> fn(&'a UserState, &'a str) -> HookFuture<'a, ()>),
}

impl UserHookHandler {
    /// The kind this handler implements.
    pub fn kind(&self) -> HookKind {
        match self {
            Self::UserClientAttached(_) => HookKind::UserClientAttached,
            Self::UserClientDetached(_) => HookKind::UserClientDetached,
            Self::UserValueChanged(_) => HookKind::UserValueChanged,
        }
    }
}

/// The static definition of a thread hook: id plus typed handler.
#[derive(Debug)]
pub struct ThreadHookDefinition {
    /// Snake-case id, unique across the application.
    pub id: &'static str,
    /// The handler (its variant is the kind).
    pub handler: ThreadHookHandler,
}

/// The static definition of a user-scope hook.
#[derive(Debug)]
pub struct UserHookDefinition {
    /// Snake-case id, unique across the application.
    pub id: &'static str,
    /// The handler.
    pub handler: UserHookHandler,
}

/// A reference to a thread hook: what `#[hook]` defines for a thread kind, and what
/// `use_hooks` and `#[agent(hooks = [..])]` accept. `Copy`, one pointer wide.
#[derive(Clone, Copy)]
pub struct ThreadHook(&'static ThreadHookDefinition);

impl ThreadHook {
    /// Wraps a static definition.
    pub const fn new(definition: &'static ThreadHookDefinition) -> Self {
        Self(definition)
    }

    /// The hook's id.
    pub fn id(&self) -> &'static str {
        self.0.id
    }

    /// The hook's kind.
    pub fn kind(&self) -> HookKind {
        self.0.handler.kind()
    }

    /// The typed handler.
    pub fn handler(&self) -> ThreadHookHandler {
        self.0.handler
    }

    /// The definition.
    pub fn definition(&self) -> &'static ThreadHookDefinition {
        self.0
    }
}

impl PartialEq for UserHook {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.0, other.0)
    }
}

impl Eq for UserHook {}

/// Refuses a lifecycle-hook id that is not snake_case (`^[a-z][a-z0-9_]*$`), the rule
/// `#[hook]` checks at compile time, for hooks defined by hand.
pub fn check_hook_id(id: &str) -> Result<(), String> {
    if crate::agent::is_identity(id) {
        Ok(())
    } else {
        Err(format!(
            "[flue] The lifecycle hook id \"{id}\" must be snake_case: lowercase letters, digits and underscores, starting with a letter."
        ))
    }
}

/// What two different hooks under one id are told (the runtime's builder says it too):
/// the id, then the kinds of the hook met first and of the other one.
pub fn shared_id_message(id: &str, first: HookKind, second: HookKind) -> String {
    format!(
        "[flue] Two lifecycle hooks share the id \"{id}\" ({first} and {second}); hook ids must be unique across the application."
    )
}

impl PartialEq for ThreadHook {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.0, other.0)
    }
}

impl Eq for ThreadHook {}

/// A reference to a user-scope hook. Not accepted by `use_hooks` (a different type).
#[derive(Clone, Copy)]
pub struct UserHook(&'static UserHookDefinition);

impl UserHook {
    /// Wraps a static definition.
    pub const fn new(definition: &'static UserHookDefinition) -> Self {
        Self(definition)
    }

    /// The hook's id.
    pub fn id(&self) -> &'static str {
        self.0.id
    }

    /// The hook's kind.
    pub fn kind(&self) -> HookKind {
        self.0.handler.kind()
    }

    /// The typed handler.
    pub fn handler(&self) -> UserHookHandler {
        self.0.handler
    }
}

impl fmt::Debug for ThreadHookHandler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ThreadHookHandler({})", self.kind())
    }
}

impl fmt::Debug for UserHookHandler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UserHookHandler({})", self.kind())
    }
}

impl fmt::Debug for ThreadHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ThreadHook({} {})", self.kind(), self.id())
    }
}

impl fmt::Debug for UserHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UserHook({} {})", self.kind(), self.id())
    }
}
