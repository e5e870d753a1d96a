//! Model-callable tools: definitions, the handler trait `#[tool]` implements, the inline
//! builder, the context a tool runs with, and what it returns.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};

use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::BoxFuture;
use crate::abort::AbortSignal;
use crate::data::{DataSchema, SchemaSource, tool_input_schema_of};
use crate::error::ToolNameConflictError;
use crate::log::Logger;

/// Tool names the framework reserves for its own tools.
pub const RESERVED_TOOL_NAMES: [&str; 5] = ["task", "activate_skill", "read_skill_resource", "finish", "give_up"];

/// A tool's identity and model-facing description.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ToolDefinition {
    /// `^[A-Za-z0-9_-]{1,64}$`; a reserved name fails the render that mounts it.
    pub name: Cow<'static, str>,
    /// What the tool does, shown to the model.
    pub description: Cow<'static, str>,
    /// JSON Schema of the arguments (an object at the root).
    pub input_schema: SchemaSource,
    /// The string argument whose completed value is reported as `tool_call_started` progress.
    pub progress_argument: Option<Cow<'static, str>>,
    /// Declared secrets: the only environment variables the tool can read, through its context.
    pub secrets: Cow<'static, [&'static str]>,
    /// Whether a batch made only of terminating tools ends the turn.
    pub terminate: bool,
    /// Whether a call interrupted before its batch committed runs again on recovery (its
    /// settled [`ToolContext::step`]s replay their recorded values) instead of getting an
    /// outcome-unknown result.
    pub durable: bool,
}

impl ToolDefinition {
    /// A definition whose rules were checked at compile time by `#[tool]`.
    #[doc(hidden)]
    pub const fn from_checked(
        name: &'static str,
        description: &'static str,
        input_schema: SchemaSource,
        progress_argument: Option<&'static str>,
        secrets: &'static [&'static str],
        terminate: bool,
    ) -> Self {
        Self {
            name: Cow::Borrowed(name),
            description: Cow::Borrowed(description),
            input_schema,
            progress_argument: match progress_argument {
                Some(argument) => Some(Cow::Borrowed(argument)),
                None => None,
            },
            secrets: Cow::Borrowed(secrets),
            terminate,
            durable: false,
        }
    }

    /// The same definition, marked durable (see [`ToolDefinition::durable`]).
    #[must_use]
    pub const fn into_durable(mut self) -> Self {
        self.durable = true;
        self
    }

    /// A definition built at run time (an MCP server's tool): the caller vouches for the name.
    #[doc(hidden)]
    pub fn from_parts(
        name: impl Into<Cow<'static, str>>,
        description: impl Into<Cow<'static, str>>,
        input_schema: SchemaSource,
    ) -> Self {
        Self {
            name: name.into(),
            description: description.into(),
            input_schema,
            progress_argument: None,
            secrets: Cow::Borrowed(&[]),
            terminate: false,
            durable: false,
        }
    }

    /// Checks every definition rule; `source` labels the message (e.g. `Tool::new()`). A
    /// reserved name is not one of them: as in the reference, it conflicts with the
    /// framework's tools where the render's tools are assembled (the render fails with a
    /// `ToolNameConflictError`, as for a duplicate name).
    pub fn validate(&self, source: &str) -> Result<(), String> {
        check_tool_name_format(&self.name, source)?;
        if self.description.trim().is_empty() {
            // The reference's exact text, like the schema's below.
            return Err(format!("[flue] {source} description must be a non-empty string."));
        }
        self.validate_input_schema(source)
    }

    /// Checks that the argument schema has an object root and that the progress argument
    /// names one of its string properties.
    pub fn validate_input_schema(&self, source: &str) -> Result<(), String> {
        let schema = self.input_schema.get();
        if !schema.has_object_root() {
            // The reference's exact text: the panic's location (or the wrapping error) names
            // the tool.
            return Err(format!("[flue] {source} input must be a top-level object schema."));
        }
        if let Some(argument) = &self.progress_argument {
            let root = schema.json();
            let property = root
                .get("properties")
                .and_then(|properties| properties.get(argument.as_ref()))
                .map(|property| referenced(root, property));
            match property {
                None => {
                    return Err(format!(
                        "[flue] {source} \"{}\" progress_argument \"{argument}\" is not one of its arguments.",
                        self.name
                    ));
                }
                Some(property) if property.get("type").and_then(Value::as_str) != Some("string") => {
                    return Err(format!(
                        "[flue] {source} \"{}\" progress_argument \"{argument}\" must be a string argument.",
                        self.name
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }
}

/// The schema `node` stands for: the definition its local `$ref` (`#/$defs/…`) names, followed
/// a few hops (schemars describes a derived type, a unit-only enum say, by reference), or
/// `node` itself.
fn referenced<'a>(root: &'a Value, mut node: &'a Value) -> &'a Value {
    for _ in 0..8 {
        let Some(target) = node
            .get("$ref")
            .and_then(Value::as_str)
            .and_then(|reference| reference.strip_prefix('#'))
            .and_then(crate::data::fragment_decoded)
            .and_then(|pointer| root.pointer(&pointer))
        else {
            break;
        };
        node = target;
    }
    node
}

/// Checks a tool name: non-empty, `^[A-Za-z0-9_-]{1,64}$`, not reserved.
pub fn check_tool_name(name: &str, source: &str) -> Result<(), String> {
    check_tool_name_format(name, source)?;
    if RESERVED_TOOL_NAMES.contains(&name) {
        return Err(format!("[flue] {source} {}", ToolNameConflictError::reserved(name)));
    }
    Ok(())
}

/// Checks a tool name's form: non-empty, `^[A-Za-z0-9_-]{1,64}$` (what every provider
/// accepts).
pub fn check_tool_name_format(name: &str, source: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err(format!("[flue] {source} name must be a non-empty string."));
    }
    if name.len() > 64
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(format!(
            "[flue] {source} name \"{name}\" must match ^[A-Za-z0-9_-]{{1,64}}$ (what every provider accepts)."
        ));
    }
    Ok(())
}

/// The behaviour of a tool: what `#[tool]` and [`Tool::new`] implement.
pub trait ToolHandler: Send + Sync + 'static {
    /// Identity, description, schema.
    fn definition(&self) -> &ToolDefinition;

    /// Runs the tool with schema-validated JSON arguments.
    fn call(&self, ctx: ToolContext, args: Value) -> BoxFuture<'_, ToolOutput>;
}

/// A mountable tool. Cheap to clone: `&'static` for zero-sized handlers (what `#[tool]`
/// generates), reference-counted otherwise.
#[derive(Clone)]
pub struct Tool(Repr);

#[derive(Clone)]
enum Repr {
    Static(&'static dyn ToolHandler),
    Shared(Arc<dyn ToolHandler>),
}

impl Tool {
    /// Starts an inline tool definition (for closures over render values).
    ///
    /// ```
    /// use flue_core::prelude::*;
    /// use schemars::JsonSchema;
    /// use serde::Deserialize;
    ///
    /// #[derive(Deserialize, JsonSchema)]
    /// struct Credit { amount: u32 }
    ///
    /// let tool = Tool::new("offer_credit")
    ///     .description("Offer the customer a credit.")
    ///     .run(|_ctx, args: Credit| async move { format!("Offered {}.", args.amount) });
    /// assert_eq!(tool.name(), "offer_credit");
    /// ```
    #[allow(clippy::new_ret_no_self)] // `Tool::new(..)….run(..)` reads as defining a tool.
    pub fn new(name: impl Into<Cow<'static, str>>) -> ToolBuilder {
        ToolBuilder {
            name: name.into(),
            description: Cow::Borrowed(""),
            progress_argument: None,
            secrets: Vec::new(),
            terminate: false,
            durable: false,
        }
    }

    /// Wraps a handler. Zero-sized handlers are promoted to `&'static` without allocating.
    pub fn from_handler<H: ToolHandler>(handler: H) -> Self {
        if std::mem::size_of::<H>() == 0 {
            // Boxing a zero-sized value does not allocate; leaking it yields a `'static` ref.
            Self(Repr::Static(Box::leak(Box::new(handler))))
        } else {
            Self(Repr::Shared(Arc::new(handler)))
        }
    }

    fn handler(&self) -> &dyn ToolHandler {
        match &self.0 {
            Repr::Static(handler) => *handler,
            Repr::Shared(handler) => handler.as_ref(),
        }
    }

    /// The tool's name.
    pub fn name(&self) -> &str {
        &self.handler().definition().name
    }

    /// Whether the tool's handler lives for the whole process (a `#[tool]` item, or any
    /// zero-sized handler): its [`Tool::identity`] then never names another tool.
    pub fn is_static(&self) -> bool {
        matches!(self.0, Repr::Static(_))
    }

    /// A cheap identity for caches: equal for clones of one tool (and for every mount of a
    /// `#[tool]` item), different for separately built tools. A shared handler is named by its
    /// address; a zero-sized one has no address of its own (every such handler sits at the same
    /// dangling one), so it is named by its definition's, which is a `static` of its own for
    /// each `#[tool]` item.
    pub fn identity(&self) -> usize {
        match &self.0 {
            Repr::Static(handler) => std::ptr::from_ref::<ToolDefinition>(handler.definition()) as usize,
            Repr::Shared(handler) => Arc::as_ptr(handler).cast::<()>() as usize,
        }
    }

    /// The tool's definition.
    pub fn definition(&self) -> &ToolDefinition {
        self.handler().definition()
    }

    /// The argument schema.
    pub fn input_schema(&self) -> DataSchema {
        self.definition().input_schema.get()
    }

    /// Runs the tool. The runtime validates `args` against the schema first; this does not.
    pub fn call(&self, ctx: ToolContext, args: Value) -> BoxFuture<'_, ToolOutput> {
        self.handler().call(ctx, args)
    }
}

impl fmt::Debug for Tool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Tool").field(&self.name()).finish()
    }
}

/// Converts a value into a mountable [`Tool`]: implemented for `Tool`, `&Tool` and every
/// [`ToolHandler`] (so `use_tool(get_github_issue)` works for a `#[tool]` item).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a tool",
    label = "not a tool",
    note = "define tools with `#[tool]` on an async fn, or inline with `Tool::new(\"name\").description(..).run(..)`"
)]
pub trait IntoTool {
    /// The tool.
    fn into_tool(self) -> Tool;
}

impl IntoTool for Tool {
    fn into_tool(self) -> Tool {
        self
    }
}

impl IntoTool for &Tool {
    fn into_tool(self) -> Tool {
        self.clone()
    }
}

impl<H: ToolHandler> IntoTool for H {
    fn into_tool(self) -> Tool {
        Tool::from_handler(self)
    }
}

/// Builder returned by [`Tool::new`].
#[derive(Debug)]
#[must_use = "a tool is defined only when `.run(..)` is called"]
pub struct ToolBuilder {
    name: Cow<'static, str>,
    description: Cow<'static, str>,
    progress_argument: Option<Cow<'static, str>>,
    secrets: Vec<&'static str>,
    terminate: bool,
    durable: bool,
}

impl ToolBuilder {
    /// What the tool does (required).
    pub fn description(mut self, description: impl Into<Cow<'static, str>>) -> Self {
        self.description = description.into();
        self
    }

    /// The string argument reported as progress by `tool_call_started`.
    pub fn progress_argument(mut self, argument: impl Into<Cow<'static, str>>) -> Self {
        self.progress_argument = Some(argument.into());
        self
    }

    /// Declares a secret the tool may read through [`ToolContext::secret`].
    pub fn secret(mut self, name: &'static str) -> Self {
        self.secrets.push(name);
        self
    }

    /// Marks the tool terminating.
    pub fn terminate(mut self) -> Self {
        self.terminate = true;
        self
    }

    /// Marks the tool durable: a call interrupted before it ended runs again when the response
    /// resumes, and the [`ToolContext::step`]s that settled before the interruption return
    /// their recorded values instead of running again. A call that ended while others of its
    /// batch ran on has its outcome recorded at once and never runs again; the outcome of the
    /// batch's last call to end is recorded with the batch's commit, so an attempt that ends
    /// before that commit runs it again (work it did outside its steps is done twice). Its
    /// persistent-state writes count only if its batch commits (an attempt that ends in
    /// between loses them, as the reference's rollback does): what must survive belongs in a
    /// step's value.
    pub fn durable(mut self) -> Self {
        self.durable = true;
        self
    }

    /// Finishes the tool with its run function.
    ///
    /// Panics with a `[flue] Tool::new() …` message when the definition breaks a rule
    /// (name, description, object argument schema, progress argument). A name the framework
    /// reserves is refused where the tool is used: the render that mounts it fails with a
    /// `ToolNameConflictError`, and `queue_tool` refuses it.
    #[track_caller]
    pub fn run<A, F, Fut>(self, run: F) -> Tool
    where
        A: DeserializeOwned + JsonSchema + Send + 'static,
        F: Fn(ToolContext, A) -> Fut + Send + Sync + 'static,
        Fut: Future + Send + 'static,
        Fut::Output: IntoToolOutput,
    {
        let definition = ToolDefinition {
            name: self.name,
            description: self.description,
            input_schema: SchemaSource::Typed(tool_input_schema_of::<A>),
            progress_argument: self.progress_argument,
            secrets: Cow::Owned(self.secrets),
            terminate: self.terminate,
            durable: self.durable,
        };
        if let Err(message) = definition.validate("Tool::new()") {
            panic!("{message}");
        }
        Tool(Repr::Shared(Arc::new(FnTool {
            definition,
            run,
            _args: std::marker::PhantomData,
        })))
    }
}

struct FnTool<A, F> {
    definition: ToolDefinition,
    run: F,
    _args: std::marker::PhantomData<fn() -> A>,
}

impl<A, F, Fut> ToolHandler for FnTool<A, F>
where
    A: DeserializeOwned + Send + 'static,
    F: Fn(ToolContext, A) -> Fut + Send + Sync + 'static,
    Fut: Future + Send + 'static,
    Fut::Output: IntoToolOutput,
{
    fn definition(&self) -> &ToolDefinition {
        &self.definition
    }

    fn call(&self, ctx: ToolContext, args: Value) -> BoxFuture<'_, ToolOutput> {
        match parse_arguments::<A>(args) {
            Ok(args) => {
                let future = (self.run)(ctx, args);
                Box::pin(async move { future.await.into_tool_output() })
            }
            Err(output) => Box::pin(std::future::ready(output)),
        }
    }
}

/// The bound on a tool's argument type. Implemented for every `DeserializeOwned + JsonSchema`
/// type; `#[tool]` asserts it at the argument type so a missing derive reads as a fix-it.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be a tool's arguments",
    label = "needs `#[derive(Deserialize, JsonSchema)]`",
    note = "a tool's arguments are parsed with serde and described to the model with schemars: derive both"
)]
pub trait ToolArguments: DeserializeOwned + JsonSchema + Send + 'static {}

impl<T: DeserializeOwned + JsonSchema + Send + 'static> ToolArguments for T {}

/// The bound on each plain parameter of a `#[tool]` function (one that is not an `args`
/// struct), asserted at the parameter's type: a type without the derives reads as a fix-it
/// there, beside what the derives of the argument struct `#[tool]` makes report (serde's and
/// schemars' own words, which do not say how to describe a type of another crate).
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be a tool argument",
    label = "needs `#[derive(Deserialize, JsonSchema)]`",
    note = "a tool's arguments are parsed with serde and described to the model with schemars: derive both",
    note = "for a type of another crate, turn on its `serde` feature and schemars' feature for it (`chrono04`, `uuid1`, …), or describe it with `#[schemars(with = \"String\")]` on the parameter"
)]
pub trait ToolArgument: DeserializeOwned + JsonSchema + Send + 'static {}

impl<T: DeserializeOwned + JsonSchema + Send + 'static> ToolArgument for T {}

/// Asserts [`ToolArgument`] where `#[tool]` spans it: at a plain parameter's type.
#[doc(hidden)]
pub const fn tool_argument<T: ToolArgument>() {}

/// The bound on a tool function's return value, asserted by `#[tool]` at the return type.
#[diagnostic::on_unimplemented(
    message = "a tool returns text, JSON, `()` or a `ToolOutput` (optionally in a `Result`), not `{Self}`",
    label = "not a tool result",
    note = "return `String`, `serde_json::Value`, `ToolOutput`, or a `Result` of one whose error is a `ToolError`, text, or any error that displays",
    note = "to answer with a struct of your own, serialize it: `Ok(serde_json::to_value(value)?)` (its error converts into a `ToolError`)"
)]
pub trait ToolReturn: IntoToolOutput {}

impl<T: IntoToolOutput> ToolReturn for T {}

/// The bound on a tool's progress argument (`#[tool(progress_argument = "…")]`): text, whose
/// JSON Schema is `"type": "string"`, what `use_tool` requires of it. An optional argument is
/// not one (its schema also admits `null`).
///
/// Implement it for a type of your own only if its schema is a plain string (a unit-only
/// enum, say): `use_tool` checks the schema when the tool is mounted.
#[diagnostic::on_unimplemented(
    message = "the progress argument must be text, not `{Self}`",
    label = "`progress_argument` names this argument, so it must be a `String`",
    note = "`tool_call_started` reports the progress argument's text once the model has streamed it whole: make it a required `String` argument"
)]
pub trait ProgressArgument {}

impl ProgressArgument for String {}
impl ProgressArgument for Box<str> {}
impl ProgressArgument for Arc<str> {}
impl ProgressArgument for Cow<'static, str> {}

/// Asserts [`ProgressArgument`] where `#[tool]` spans it: at the progress argument's type.
#[doc(hidden)]
pub const fn progress_argument<T: ProgressArgument>() {}

/// The two things a `#[tool]` expansion does with its argument type, behind one bounded
/// function: a missing derive is then one diagnostic (rustc merges identical ones), with the
/// [`ToolArguments`] message, at the argument type.
#[doc(hidden)]
pub struct ArgumentFns<T> {
    /// The argument schema.
    pub schema: fn() -> DataSchema,
    /// Parses the arguments, or the error result the model sees.
    pub parse: fn(Value) -> Result<T, ToolOutput>,
}

/// See [`ArgumentFns`].
#[doc(hidden)]
pub const fn arguments<T: ToolArguments>() -> ArgumentFns<T> {
    ArgumentFns {
        schema: tool_input_schema_of::<T>,
        parse: parse_arguments::<T>,
    }
}

/// The definition of the generic `#[tool]` type `T`, made by `make` the first time it is
/// asked for and kept for the process: a generic tool is zero-sized as any other `#[tool]`,
/// so every mount of one instantiation is one tool (its [`Tool::identity`] is this
/// definition's address), and another instantiation another.
#[doc(hidden)]
pub fn generic_definition<T: 'static>(make: impl FnOnce() -> ToolDefinition) -> &'static ToolDefinition {
    use std::any::TypeId;
    use std::collections::HashMap;
    use std::sync::{OnceLock, RwLock};
    static DEFINITIONS: OnceLock<RwLock<HashMap<TypeId, &'static ToolDefinition>>> = OnceLock::new();
    let definitions = DEFINITIONS.get_or_init(RwLock::default);
    let id = TypeId::of::<T>();
    if let Some(definition) = definitions
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&id)
    {
        return definition;
    }
    // Made outside the lock (a schema may take a while); the first one kept wins.
    let made = make();
    let mut definitions = definitions.write().unwrap_or_else(std::sync::PoisonError::into_inner);
    let kept: &'static ToolDefinition = definitions.entry(id).or_insert_with(|| Box::leak(Box::new(made)));
    kept
}

/// Converts a tool function's return value, asserting [`ToolReturn`] where `#[tool]` spans it.
#[doc(hidden)]
pub fn tool_return<T: ToolReturn>(value: T) -> ToolOutput {
    value.into_tool_output()
}

// A tool may fail with text (`Result<T, String>`, `Result<T, &'static str>`) or with any error
// that displays (`Result<T, anyhow::Error>`, `Result<T, Box<dyn Error + Send + Sync>>`, neither
// of which implements `std::error::Error`). No impl of `IntoToolOutput` can take those beside the
// one for `Result<T, E: Into<ToolError>>`, nor can `ToolError` be `From` them beside its
// `From<E: Error>`: coherence rules both out. So `#[tool]` picks by method resolution, before
// `tool_return`: `(&&&Returned(&value)).__flue_tool_return().adapt(value)` finds, in order,
// 1. `TextErrorReturn` (a text error, made a `ToolError`) or `ConvertibleReturn` (a value
//    `tool_return` converts as it is), both on `&&Returned<_>`;
// 2. `DisplayErrorReturn` (any other `Result` whose error displays: its text becomes the
//    `ToolError`), on `&Returned<_>`;
// 3. `OtherReturn`, on `Returned<_>` (anything else, left for `tool_return` to reject at the
//    return type).
// Each level's receiver is one reference shallower, so a level is tried only when none above
// applies; `Returned` is no reference, so no impl matches at two levels. `#[hook]` reads a
// lifecycle hook's value the same way, through the traits of `crate::lifecycle` and into a
// `HookError` (see `Failure`).

/// A function's return value, borrowed while `#[tool]` or `#[hook]` picks how to read it.
#[doc(hidden)]
pub struct Returned<'a, T: ?Sized>(pub &'a T);

/// A `Result` whose error is text; see [`TextError`].
#[doc(hidden)]
pub trait TextErrorReturn {
    /// How `#[tool]` reads the value before [`tool_return`].
    fn __flue_tool_return(&self) -> TextError<ToolError> {
        TextError::new()
    }
}

impl<T> TextErrorReturn for &&Returned<'_, Result<T, String>> {}
impl<T> TextErrorReturn for &&Returned<'_, Result<T, &'static str>> {}

/// A value [`tool_return`] converts as it is; see [`AsReturned`].
#[doc(hidden)]
pub trait ConvertibleReturn {
    /// How `#[tool]` reads the value before [`tool_return`].
    fn __flue_tool_return(&self) -> AsReturned {
        AsReturned
    }
}

impl<T: IntoToolOutput> ConvertibleReturn for &&Returned<'_, T> {}

/// A `Result` whose error displays but is no `std::error::Error` (`anyhow::Error`, a boxed
/// `dyn Error`); see [`DisplayError`].
#[doc(hidden)]
pub trait DisplayErrorReturn {
    /// How `#[tool]` reads the value before [`tool_return`].
    fn __flue_tool_return(&self) -> DisplayError<ToolError> {
        DisplayError::new()
    }
}

impl<T, E: fmt::Display> DisplayErrorReturn for &Returned<'_, Result<T, E>> {}

/// Any other return value; see [`AsReturned`].
#[doc(hidden)]
pub trait OtherReturn {
    /// How `#[tool]` reads the value before [`tool_return`].
    fn __flue_tool_return(&self) -> AsReturned {
        AsReturned
    }
}

impl<T: ?Sized> OtherReturn for Returned<'_, T> {}

/// The error a `Result` is read into when its own error is text or only displays: a tool's
/// [`ToolError`] or a lifecycle hook's [`HookError`](crate::lifecycle::HookError).
#[doc(hidden)]
pub trait Failure {
    /// The failure whose message is `text`.
    fn from_text(text: String) -> Self;
}

impl Failure for ToolError {
    fn from_text(text: String) -> Self {
        Self::new(text)
    }
}

/// Reads a `Result` with a text error as one with the failure `F`, whose message is the text
/// (for a tool, the error result the model sees).
#[doc(hidden)]
pub struct TextError<F>(std::marker::PhantomData<fn() -> F>);

impl<F: Failure> TextError<F> {
    /// The reading.
    pub fn new() -> Self {
        Self(std::marker::PhantomData)
    }

    /// The text error as an `F`.
    pub fn adapt<T, E: Into<String>>(self, value: Result<T, E>) -> Result<T, F> {
        value.map_err(|text| F::from_text(text.into()))
    }
}

impl<F: Failure> Default for TextError<F> {
    fn default() -> Self {
        Self::new()
    }
}

/// Reads a `Result` whose error displays as one with the failure `F`, whose message is the
/// error's text (its alternate `Display`, `{:#}`: an `anyhow::Error`'s causes included).
#[doc(hidden)]
pub struct DisplayError<F>(std::marker::PhantomData<fn() -> F>);

impl<F: Failure> DisplayError<F> {
    /// The reading.
    pub fn new() -> Self {
        Self(std::marker::PhantomData)
    }

    /// The error as an `F`.
    pub fn adapt<T, E: fmt::Display>(self, value: Result<T, E>) -> Result<T, F> {
        // The alternate form: `anyhow::Error`'s shows its causes after its context
        // (`reading the config: No such file or directory`), where the plain one shows only
        // the outermost context.
        value.map_err(|error| F::from_text(format!("{error:#}")))
    }
}

impl<F: Failure> Default for DisplayError<F> {
    fn default() -> Self {
        Self::new()
    }
}

/// Leaves a return value as it is.
#[doc(hidden)]
pub struct AsReturned;

impl AsReturned {
    /// The value itself.
    pub fn adapt<T>(self, value: T) -> T {
        value
    }
}

/// Deserializes tool arguments, or the error result the model sees when they do not fit,
/// naming where as the schema check does (a JSON pointer, `root` for the arguments
/// themselves): arguments the schema let through may still not fit the Rust type (a number out
/// of a `u8`'s range, a date that does not parse), and the model must know which to fix.
pub fn parse_arguments<A: DeserializeOwned>(args: Value) -> Result<A, ToolOutput> {
    serde_path_to_error::deserialize(args).map_err(|error| {
        use std::fmt::Write as _;
        let mut path = String::new();
        for segment in error.path().iter() {
            let _ = match segment {
                serde_path_to_error::Segment::Seq { index } => write!(path, "/{index}"),
                serde_path_to_error::Segment::Map { key } => {
                    write!(path, "/{}", key.replace('~', "~0").replace('/', "~1"))
                }
                serde_path_to_error::Segment::Enum { variant } => write!(path, "/{variant}"),
                serde_path_to_error::Segment::Unknown => write!(path, "/?"),
            };
        }
        if path.is_empty() {
            path.push_str("root");
        }
        ToolOutput::invalid_arguments(format_args!("[{path}] {}", error.inner()))
    })
}

/// What a tool produced.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolOutput {
    /// The result.
    pub content: ToolContent,
    /// Whether it is an error result (the model sees it; the submission continues).
    pub is_error: bool,
    /// Whether this result asks to end the turn (a batch ends only when every result does).
    pub terminate: bool,
}

/// The body of a tool result.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolContent {
    /// Text.
    Text(String),
    /// A JSON value (rendered to the model as pretty-printed JSON).
    Json(Value),
}

impl ToolOutput {
    /// A text result.
    pub fn text(text: impl Into<String>) -> Self {
        Self {
            content: ToolContent::Text(text.into()),
            is_error: false,
            terminate: false,
        }
    }

    /// A JSON result.
    pub fn json(value: Value) -> Self {
        Self {
            content: ToolContent::Json(value),
            is_error: false,
            terminate: false,
        }
    }

    /// An error result.
    pub fn error(message: impl Into<String>) -> Self {
        Self {
            content: ToolContent::Text(message.into()),
            is_error: true,
            terminate: false,
        }
    }

    /// The error result of a call whose arguments are not what the tool takes (`issues`: what
    /// is wrong, and where): the reference's `tool_input_validation`, whose message asks the
    /// model to call the tool again. The tool does not run.
    pub fn invalid_arguments(issues: impl std::fmt::Display) -> Self {
        let issues = issues.to_string();
        Self::error(format!(
            "Tool argument validation failed: {}. Call the tool again with corrected arguments.",
            issues.trim_end().trim_end_matches('.')
        ))
    }

    /// Marks the result terminating.
    pub fn terminating(mut self) -> Self {
        self.terminate = true;
        self
    }

    /// The text the model reads.
    pub fn to_text(&self) -> String {
        match &self.content {
            ToolContent::Text(text) => text.clone(),
            ToolContent::Json(value) => serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string()),
        }
    }
}

/// What a tool function may return: text, JSON, `()`, a [`ToolOutput`], or a `Result` of any
/// of these with a [`ToolError`] (an `Err` becomes an error result). A `#[tool]` function may
/// also fail with text (`Result<T, String>`, `Result<T, &'static str>`) or with any error that
/// displays (`anyhow::Error`, `Box<dyn Error + Send + Sync>`), which the attribute converts
/// itself: coherence rules out an impl of this trait for those.
#[diagnostic::on_unimplemented(
    message = "a tool returns text, JSON, `()` or a `ToolOutput` (optionally in a `Result`), not `{Self}`",
    label = "not a tool result",
    note = "return `String`, `serde_json::Value`, `ToolOutput`, or a `Result` of one; its error may be a `ToolError` or any `std::error::Error` (a `#[tool]` function's also text, or any error that displays)",
    note = "to answer with a struct of your own, serialize it: `Ok(serde_json::to_value(value)?)` (its error converts into a `ToolError`)"
)]
pub trait IntoToolOutput {
    /// Converts into a result.
    fn into_tool_output(self) -> ToolOutput;
}

impl IntoToolOutput for ToolOutput {
    fn into_tool_output(self) -> ToolOutput {
        self
    }
}

impl IntoToolOutput for String {
    fn into_tool_output(self) -> ToolOutput {
        ToolOutput::text(self)
    }
}

impl IntoToolOutput for &'static str {
    fn into_tool_output(self) -> ToolOutput {
        ToolOutput::text(self)
    }
}

impl IntoToolOutput for Value {
    fn into_tool_output(self) -> ToolOutput {
        ToolOutput::json(self)
    }
}

impl IntoToolOutput for () {
    fn into_tool_output(self) -> ToolOutput {
        ToolOutput::text("")
    }
}

impl<T: IntoToolOutput, E: Into<ToolError>> IntoToolOutput for Result<T, E> {
    fn into_tool_output(self) -> ToolOutput {
        match self {
            Ok(output) => output.into_tool_output(),
            Err(error) => ToolOutput::error(error.into().message),
        }
    }
}

/// A tool failure the model should see. `?` converts any `std::error::Error` into it; make one
/// from text with [`ToolError::new`] (a `#[tool]` function may also just fail with a `String`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolError {
    message: String,
}

impl ToolError {
    /// A failure with `message`.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for ToolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for ToolError {
    fn from(error: E) -> Self {
        // The alternate form, as for an error that only displays: a `thiserror` variant that
        // is a transparent `anyhow::Error` shows its causes.
        Self::new(format!("{error:#}"))
    }
}

/// Where a tool's declared secrets come from; the runtime's is the process environment.
pub trait SecretSource: Send + Sync {
    /// The value of `name`, if set.
    fn get(&self, name: &str) -> Option<String>;
}

/// Reads secrets from the process environment.
#[derive(Clone, Copy, Debug, Default)]
pub struct EnvSecrets;

impl SecretSource for EnvSecrets {
    fn get(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

/// A secret value. Its `Debug` and `Display` print `[redacted]`, so formatting it into a log
/// line or a result never leaks it; read it with [`Secret::expose`] where it is sent.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a value.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value, for the one place that sends it (an `Authorization` header, say).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret([redacted])")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

/// A secret that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SecretError {
    /// The tool did not declare it.
    #[error(
        "[flue] Tool \"{tool}\" read the secret \"{name}\" without declaring it. Declare it with `secrets = [\"{name}\"]`."
    )]
    NotDeclared {
        /// The tool.
        tool: String,
        /// The secret.
        name: String,
    },
    /// Declared but not set.
    #[error("[flue] Tool \"{tool}\" needs the secret \"{name}\", which is not set.")]
    Missing {
        /// The tool.
        tool: String,
        /// The secret.
        name: String,
    },
}

/// A step name taken for one call of [`ToolContext::step`] or [`ToolContext::try_step`]: given
/// back when dropped unless the step settled (its value was replayed, returned or recorded).
struct StepName<'a> {
    names: &'a Mutex<HashSet<String>>,
    name: &'a str,
    settled: bool,
}

impl<'a> StepName<'a> {
    /// Takes `name`, or `None` when this call already took it.
    fn reserve(names: &'a Mutex<HashSet<String>>, name: &'a str) -> Option<Self> {
        let taken = Self::lock(names).insert(name.to_owned());
        taken.then_some(Self {
            names,
            name,
            settled: false,
        })
    }

    fn lock(names: &Mutex<HashSet<String>>) -> std::sync::MutexGuard<'_, HashSet<String>> {
        names.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The step settled: its name stays taken for the rest of the call.
    fn settled(&mut self) {
        self.settled = true;
    }
}

impl Drop for StepName<'_> {
    fn drop(&mut self) {
        if !self.settled {
            Self::lock(self.names).remove(self.name);
        }
    }
}

/// Where one call's durable steps are kept. The runtime gives a durable tool's context one
/// ([`ToolContext::with_steps`]); without one (standalone runs, non-durable tools) a
/// [`ToolContext::step`] just runs.
pub trait ToolSteps: Send + Sync {
    /// The value an earlier run of this call recorded for `step_name`, if it settled.
    fn recorded(&self, step_name: &str) -> Option<Value>;

    /// Records `value` as the settled value of `step_name`; resolves once it is durable.
    fn record(&self, step_name: &str, value: Value) -> BoxFuture<'_, Result<(), String>>;
}

/// What a tool runs with: its call's identity, the abort signal, a logger, its secrets and
/// (for durable tools in a runtime) the record of its settled steps.
#[derive(Clone)]
pub struct ToolContext {
    inner: Arc<ContextInner>,
}

struct ContextInner {
    tool_name: String,
    tool_call_id: String,
    instance_id: Option<String>,
    secrets_declared: Cow<'static, [&'static str]>,
    secrets: Arc<dyn SecretSource>,
    signal: AbortSignal,
    log: Logger,
    thread: Option<crate::lifecycle::ThreadState>,
    steps: Option<Arc<dyn ToolSteps>>,
    /// The step names this call used (shared by the context's clones: one call, one set).
    step_names: Arc<Mutex<HashSet<String>>>,
}

impl ToolContext {
    /// A context for one call of `tool` (environment secrets, a fresh abort signal, a
    /// discarding logger); adjust it with the `with_*` methods.
    pub fn new(tool: &Tool, tool_call_id: impl Into<String>) -> Self {
        Self {
            inner: Arc::new(ContextInner {
                tool_name: tool.name().to_owned(),
                tool_call_id: tool_call_id.into(),
                instance_id: None,
                secrets_declared: tool.definition().secrets.clone(),
                secrets: Arc::new(EnvSecrets),
                signal: AbortSignal::new(),
                log: Logger::discard(),
                thread: None,
                steps: None,
                step_names: Arc::default(),
            }),
        }
    }

    fn edit(mut self, edit: impl FnOnce(&mut ContextInner)) -> Self {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) => edit(inner),
            None => {
                let inner = &*self.inner;
                let mut copy = ContextInner {
                    tool_name: inner.tool_name.clone(),
                    tool_call_id: inner.tool_call_id.clone(),
                    instance_id: inner.instance_id.clone(),
                    secrets_declared: inner.secrets_declared.clone(),
                    secrets: inner.secrets.clone(),
                    signal: inner.signal.clone(),
                    log: inner.log.clone(),
                    thread: inner.thread.clone(),
                    steps: inner.steps.clone(),
                    step_names: inner.step_names.clone(),
                };
                edit(&mut copy);
                self.inner = Arc::new(copy);
            }
        }
        self
    }

    /// Sets the instance the call runs in.
    pub fn with_instance_id(self, instance_id: impl Into<String>) -> Self {
        let instance_id = instance_id.into();
        self.edit(|inner| inner.instance_id = Some(instance_id))
    }

    /// Sets the secret source.
    pub fn with_secrets(self, secrets: Arc<dyn SecretSource>) -> Self {
        self.edit(|inner| inner.secrets = secrets)
    }

    /// Sets the abort signal.
    pub fn with_signal(self, signal: AbortSignal) -> Self {
        self.edit(|inner| inner.signal = signal)
    }

    /// Sets the logger.
    pub fn with_logger(self, log: Logger) -> Self {
        self.edit(|inner| inner.log = log)
    }

    /// Sets the thread the call runs in.
    pub fn with_thread(self, thread: crate::lifecycle::ThreadState) -> Self {
        self.edit(|inner| inner.thread = Some(thread))
    }

    /// Sets where the call's steps are recorded (the runtime does, for durable tools).
    pub fn with_steps(self, steps: Arc<dyn ToolSteps>) -> Self {
        self.edit(|inner| inner.steps = Some(steps))
    }

    /// Runs one named step of the call and returns its value. In a runtime, a durable tool's
    /// step value is recorded before it is returned, and when the call runs again after an
    /// interruption (its batch never committed) the step returns the recorded value without
    /// running `work` again: put each side effect that must happen once (a charge, an email)
    /// in a step of its own. This holds in a subagent's child session too (a `task`'s child
    /// records its steps in its own conversation). Elsewhere the step just runs: standalone
    /// runs, calls through `ThreadState::invoke_tool`, and tools not marked durable. What a
    /// durable tool does outside its steps (a data write, an injected message) happens again
    /// when the call runs again.
    ///
    /// Names identify steps across runs of one call, so they must be non-empty and unique
    /// within the call: a reused name is an error. A recorded value that no longer
    /// deserializes into `T` is an error too. Whatever `work` returns is recorded, a `Result`
    /// included: for a step that can fail, [`ToolContext::try_step`] records only success.
    ///
    /// ```
    /// use flue_core::prelude::*;
    /// use serde_json::json;
    ///
    /// let tool = Tool::new("refund")
    ///     .description("Refund an order.")
    ///     .durable()
    ///     .run(|ctx, _: serde_json::Map<String, serde_json::Value>| async move {
    ///         let refund: String = ctx.step("issue", async { "re_1".to_owned() }).await?;
    ///         Ok::<_, ToolError>(format!("Refunded as {refund}."))
    ///     });
    /// let ctx = ToolContext::new(&tool, "call_1");
    /// let output = flue_core::testing::poll_ready(tool.call(ctx, json!({})));
    /// assert_eq!(output.to_text(), "Refunded as re_1.");
    /// ```
    pub async fn step<T, F>(&self, name: &str, work: F) -> Result<T, ToolError>
    where
        T: Serialize + DeserializeOwned,
        F: Future<Output = T>,
    {
        self.settle(name, async { Ok::<T, std::convert::Infallible>(work.await) })
            .await
    }

    /// A step that may fail: like [`ToolContext::step`], but only an `Ok` value is recorded.
    /// An `Err` is returned as the tool's error (its `Display` text) and leaves nothing on
    /// record, so a re-run of the call tries the step again, and so may this run (the name
    /// stays free, as it does when the step's future is dropped before it settles: a timeout
    /// around it). Put a side effect that can fail (a declined charge) in one of these.
    pub async fn try_step<T, E, F>(&self, name: &str, work: F) -> Result<T, ToolError>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: Future<Output = Result<T, E>>,
    {
        self.settle(name, work).await
    }

    /// The step `name`: its recorded value, or `work`'s, recorded when it is `Ok`.
    async fn settle<T, E, F>(&self, name: &str, work: F) -> Result<T, ToolError>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: Future<Output = Result<T, E>>,
    {
        let inner = &self.inner;
        let tool = &inner.tool_name;
        if name.is_empty() {
            return Err(ToolError::new(format!(
                "[flue] Tool \"{tool}\" ran a step without a name. Name each step of a call."
            )));
        }
        let Some(mut reserved) = StepName::reserve(&inner.step_names, name) else {
            return Err(ToolError::new(format!(
                "[flue] Tool \"{tool}\" ran the step \"{name}\" twice in one call. A re-run finds a step's recorded value by its name: give each step of a call a name of its own."
            )));
        };
        // Until `settled` below, an error, a refusal or the call dropping this future (a
        // timeout around the step) leaves the name free for another try: nothing settled.
        let Some(steps) = &inner.steps else {
            let value = work.await.map_err(|error| ToolError::new(error.to_string()))?;
            reserved.settled();
            return Ok(value);
        };
        let parse = |value: Value| {
            serde_json::from_value(value).map_err(|error| {
                ToolError::new(format!(
                    "[flue] Tool \"{tool}\" step \"{name}\" has a value of another shape: {error}"
                ))
            })
        };
        if let Some(value) = steps.recorded(name) {
            reserved.settled();
            return parse(value);
        }
        let value = work.await.map_err(|error| ToolError::new(error.to_string()))?;
        let value = serde_json::to_value(value).map_err(|error| {
            ToolError::new(format!(
                "[flue] Tool \"{tool}\" step \"{name}\" returned a value that is not JSON: {error}"
            ))
        })?;
        // The first run returns what a re-run would read back, and a value that would not read
        // back (JSON has no NaN: serde_json writes `null`) is not recorded.
        let settled = T::deserialize(&value).map_err(|error| {
            ToolError::new(format!(
                "[flue] Tool \"{tool}\" step \"{name}\" returned a value that does not read back as its type after the JSON round trip ({error}), so it was not recorded"
            ))
        })?;
        // From here the value may be on record even if recording reports a failure (or this
        // future is dropped while it records): the name stays taken.
        reserved.settled();
        steps.record(name, value).await.map_err(|error| {
            ToolError::new(format!(
                "[flue] Tool \"{tool}\" step \"{name}\" could not be recorded: {error}"
            ))
        })?;
        Ok(settled)
    }

    /// The thread the call runs in: its rows, durable values, execution context and live
    /// events. `None` for standalone runs, and for a call a delegate makes inside a task: a
    /// task's child conversation is not a thread of lifecycle hooks (a delegate runs none),
    /// so a tool meant for delegates too takes `None` as "no thread here".
    pub fn thread(&self) -> Option<&crate::lifecycle::ThreadState> {
        self.inner.thread.as_ref()
    }

    /// The tool's name.
    pub fn tool_name(&self) -> &str {
        &self.inner.tool_name
    }

    /// This call's id.
    pub fn tool_call_id(&self) -> &str {
        &self.inner.tool_call_id
    }

    /// The instance the call runs in (`None` for standalone runs).
    pub fn instance_id(&self) -> Option<&str> {
        self.inner.instance_id.as_deref()
    }

    /// The abort signal: fires when the submission is aborted.
    pub fn signal(&self) -> &AbortSignal {
        &self.inner.signal
    }

    /// Progress lines into the conversation stream.
    pub fn log(&self) -> &Logger {
        &self.inner.log
    }

    /// Reads a declared secret.
    pub fn secret(&self, name: &str) -> Result<Secret, SecretError> {
        let inner = &self.inner;
        if !inner.secrets_declared.contains(&name) {
            return Err(SecretError::NotDeclared {
                tool: inner.tool_name.clone(),
                name: name.to_owned(),
            });
        }
        inner.secrets.get(name).map(Secret).ok_or_else(|| SecretError::Missing {
            tool: inner.tool_name.clone(),
            name: name.to_owned(),
        })
    }
}

impl fmt::Debug for ToolContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolContext")
            .field("tool_name", &self.inner.tool_name)
            .field("tool_call_id", &self.inner.tool_call_id)
            .field("instance_id", &self.inner.instance_id)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::poll_ready;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// An error whose cause shows in its alternate form only, as a `thiserror` variant that is
    /// a transparent `anyhow::Error` does.
    #[derive(Debug)]
    struct Chained;

    impl std::fmt::Display for Chained {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("saving the order")?;
            if f.alternate() {
                f.write_str(": disk full")?;
            }
            Ok(())
        }
    }

    impl std::error::Error for Chained {}

    #[test]
    fn a_tool_or_hook_error_from_a_std_error_keeps_the_causes_its_alternate_form_shows() {
        assert_eq!(ToolError::from(Chained).message(), "saving the order: disk full");
        assert_eq!(
            crate::lifecycle::HookError::from(Chained).message,
            "saving the order: disk full"
        );
    }

    /// A journal in memory: what is recorded, and what a "previous run" left.
    #[derive(Default)]
    struct Journal {
        settled: Mutex<Vec<(String, Value)>>,
    }

    impl ToolSteps for Journal {
        fn recorded(&self, step_name: &str) -> Option<Value> {
            let settled = self.settled.lock().expect("journal");
            settled
                .iter()
                .find(|(name, _)| name == step_name)
                .map(|(_, value)| value.clone())
        }

        fn record(&self, step_name: &str, value: Value) -> BoxFuture<'_, Result<(), String>> {
            self.settled
                .lock()
                .expect("journal")
                .push((step_name.to_owned(), value));
            Box::pin(std::future::ready(Ok(())))
        }
    }

    fn charging(runs: &'static AtomicUsize) -> Tool {
        Tool::new("charge").description("Charge the card.").durable().run(
            move |ctx, _: serde_json::Map<String, Value>| async move {
                let charge: u32 = ctx
                    .step("charge", async {
                        runs.fetch_add(1, Ordering::SeqCst);
                        7
                    })
                    .await?;
                Ok::<_, ToolError>(format!("charge {charge}"))
            },
        )
    }

    #[test]
    fn durable_is_a_definition_flag_set_by_the_builder_and_the_const_marker() {
        static RUNS: AtomicUsize = AtomicUsize::new(0);
        assert!(charging(&RUNS).definition().durable);
        let plain = Tool::new("plain")
            .description("Plain.")
            .run(|_ctx, _: serde_json::Map<String, Value>| async { "" });
        assert!(!plain.definition().durable);
        static DEFINITION: ToolDefinition = ToolDefinition::from_checked(
            "t",
            "T.",
            SchemaSource::Typed(crate::data::tool_input_schema_of::<serde_json::Map<String, Value>>),
            None,
            &[],
            false,
        )
        .into_durable();
        assert!(DEFINITION.durable);
    }

    #[test]
    fn a_standalone_run_just_runs_its_steps() {
        static RUNS: AtomicUsize = AtomicUsize::new(0);
        let tool = charging(&RUNS);
        let output = poll_ready(tool.call(ToolContext::new(&tool, "call_1"), serde_json::json!({})));
        assert_eq!(output, ToolOutput::text("charge 7"));
        let output = poll_ready(tool.call(ToolContext::new(&tool, "call_2"), serde_json::json!({})));
        assert_eq!(output, ToolOutput::text("charge 7"));
        assert_eq!(RUNS.load(Ordering::SeqCst), 2, "nothing is recorded without a journal");
    }

    #[test]
    fn a_step_records_its_value_and_a_re_run_of_the_call_replays_it() {
        static RUNS: AtomicUsize = AtomicUsize::new(0);
        let tool = charging(&RUNS);
        let journal = Arc::new(Journal::default());
        let ctx = || ToolContext::new(&tool, "call_1").with_steps(journal.clone());
        let output = poll_ready(tool.call(ctx(), serde_json::json!({})));
        assert_eq!(output, ToolOutput::text("charge 7"));
        assert_eq!(
            *journal.settled.lock().expect("journal"),
            vec![("charge".to_owned(), serde_json::json!(7))]
        );
        let output = poll_ready(tool.call(ctx(), serde_json::json!({})));
        assert_eq!(output, ToolOutput::text("charge 7"));
        assert_eq!(RUNS.load(Ordering::SeqCst), 1, "the re-run read the recorded value");
    }

    #[test]
    fn a_failed_try_step_is_not_recorded_and_the_call_may_try_it_again() {
        static RUNS: AtomicUsize = AtomicUsize::new(0);
        let tool = Tool::new("charge").description("Charge the card.").durable().run(
            |ctx, _: serde_json::Map<String, Value>| async move {
                let first = ctx
                    .try_step("charge", async {
                        RUNS.fetch_add(1, Ordering::SeqCst);
                        Err::<u32, _>("the card was declined")
                    })
                    .await;
                assert_eq!(first.expect_err("declined").to_string(), "the card was declined");
                let charge: u32 = ctx
                    .try_step("charge", async {
                        RUNS.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, std::convert::Infallible>(7)
                    })
                    .await?;
                Ok::<_, ToolError>(format!("charge {charge}"))
            },
        );
        let journal = Arc::new(Journal::default());
        let output = poll_ready(tool.call(
            ToolContext::new(&tool, "call_1").with_steps(journal.clone()),
            serde_json::json!({}),
        ));
        assert_eq!(output, ToolOutput::text("charge 7"));
        assert_eq!(RUNS.load(Ordering::SeqCst), 2);
        assert_eq!(
            *journal.settled.lock().expect("journal"),
            vec![("charge".to_owned(), serde_json::json!(7))],
            "only the step that succeeded is on record"
        );
    }

    #[test]
    fn a_step_dropped_before_it_settled_leaves_its_name_free() {
        let tool = Tool::new("fetch").description("Fetch.").durable().run(
            |ctx, _: serde_json::Map<String, Value>| async move {
                // A step given up on (the tool's own timeout around it drops it) while its
                // work is still pending.
                let mut abandoned = Box::pin(ctx.step("fetch", std::future::pending::<u32>()));
                let pending =
                    std::future::poll_fn(|cx| std::task::Poll::Ready(abandoned.as_mut().poll(cx).is_pending())).await;
                assert!(pending);
                drop(abandoned);
                let fetched: u32 = ctx.step("fetch", async { 7 }).await?;
                Ok::<_, ToolError>(format!("fetched {fetched}"))
            },
        );
        let journal = Arc::new(Journal::default());
        for ctx in [
            ToolContext::new(&tool, "call_1"),
            ToolContext::new(&tool, "call_1").with_steps(journal.clone()),
        ] {
            let output = poll_ready(tool.call(ctx, serde_json::json!({})));
            assert_eq!(output, ToolOutput::text("fetched 7"));
        }
        assert_eq!(
            *journal.settled.lock().expect("journal"),
            vec![("fetch".to_owned(), serde_json::json!(7))]
        );
    }

    #[test]
    fn a_step_name_used_twice_in_one_call_is_an_error_result() {
        let tool = Tool::new("twice").description("Twice.").durable().run(
            |ctx, _: serde_json::Map<String, Value>| async move {
                ctx.step("send", async { 1 }).await?;
                ctx.clone().step("send", async { 2 }).await?;
                Ok::<_, ToolError>("sent twice")
            },
        );
        for ctx in [
            ToolContext::new(&tool, "call_1"),
            ToolContext::new(&tool, "call_1").with_steps(Arc::new(Journal::default())),
        ] {
            let output = poll_ready(tool.call(ctx, serde_json::json!({})));
            assert!(output.is_error, "{output:?}");
            assert!(
                output.to_text().contains("ran the step \"send\" twice"),
                "{}",
                output.to_text()
            );
        }
        let empty = Tool::new("empty")
            .description("Empty.")
            .run(|ctx, _: serde_json::Map<String, Value>| async move { ctx.step("", async { String::new() }).await });
        let output = poll_ready(empty.call(ToolContext::new(&empty, "call_1"), serde_json::json!({})));
        assert!(output.is_error);
    }

    #[test]
    fn a_recorded_value_of_another_shape_is_an_error_result() {
        let tool = Tool::new("shape").description("Shape.").durable().run(
            |ctx, _: serde_json::Map<String, Value>| async move {
                let n: u32 = ctx.step("count", async { 1 }).await?;
                Ok::<_, ToolError>(n.to_string())
            },
        );
        let journal = Arc::new(Journal::default());
        journal
            .settled
            .lock()
            .expect("journal")
            .push(("count".to_owned(), serde_json::json!("one")));
        let output = poll_ready(tool.call(ToolContext::new(&tool, "c").with_steps(journal), serde_json::json!({})));
        assert!(output.is_error);
    }

    /// What `#[tool]` accepts as a progress argument at compile time ([`ProgressArgument`]),
    /// `use_tool` accepts when it mounts the tool; an optional argument passes neither.
    #[test]
    fn every_progress_argument_type_passes_the_mount_check_and_an_optional_one_does_not() {
        #[derive(serde::Deserialize, JsonSchema)]
        #[allow(dead_code)]
        struct Args<T> {
            progress: T,
        }
        fn mounted<T: JsonSchema + 'static>() -> Result<(), String> {
            ToolDefinition::from_checked(
                "t",
                "T.",
                SchemaSource::Typed(tool_input_schema_of::<Args<T>>),
                Some("progress"),
                &[],
                false,
            )
            .validate_input_schema("use_tool()")
        }
        fn progress_argument<T: ProgressArgument + JsonSchema + 'static>() -> Result<(), String> {
            super::progress_argument::<T>();
            mounted::<T>()
        }
        assert_eq!(progress_argument::<String>(), Ok(()));
        assert_eq!(progress_argument::<Box<str>>(), Ok(()));
        assert_eq!(progress_argument::<Arc<str>>(), Ok(()));
        assert_eq!(progress_argument::<Cow<'static, str>>(), Ok(()));
        assert_eq!(
            mounted::<Option<String>>(),
            Err("[flue] use_tool() \"t\" progress_argument \"progress\" must be a string argument.".to_owned())
        );
        // What the trait's doc invites: a unit-only enum, which schemars describes by `$ref`.
        #[derive(serde::Deserialize, JsonSchema)]
        #[allow(dead_code)]
        enum Mode {
            Fast,
            Slow,
        }
        impl ProgressArgument for Mode {}
        assert_eq!(progress_argument::<Mode>(), Ok(()));
        // A referenced definition that is not a string is still refused.
        #[derive(serde::Deserialize, JsonSchema)]
        #[allow(dead_code)]
        struct Pair {
            a: u32,
        }
        assert_eq!(
            mounted::<Pair>(),
            Err("[flue] use_tool() \"t\" progress_argument \"progress\" must be a string argument.".to_owned())
        );
    }
}
