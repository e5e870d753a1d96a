//! Agents: the [`Agent`] trait `#[agent]` implements, its statics, and the values a render
//! passes to and receives from the agent function.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::data::SchemaSource;
use crate::lifecycle::ThreadHook;
use crate::render::RenderKind;

/// An agent: durable identity and statics, plus the synchronous function rendered before every
/// model call. `#[agent]` implements it for the value it generates; [`FnAgent`] implements it
/// for a closure.
pub trait Agent: Send + Sync + 'static {
    /// Identity and statics, read without rendering.
    fn definition(&self) -> &AgentDefinition;

    /// Runs the agent function body once. Called by [`crate::render()`] inside a render frame;
    /// calling it directly panics: outside a render at its first hook (no frame), inside another
    /// agent's body as a re-entrant render (the bodies `#[agent]` and [`FnAgent`] make check).
    fn render_body(&self, props: AgentProps<'_>) -> Instruction;
}

/// An agent's identity and statics.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct AgentDefinition {
    /// Durable identity: `^[a-z][a-z0-9_]*$`. Part of every stream path; never change it for
    /// an agent with live instances.
    pub name: Cow<'static, str>,
    /// What the agent does (catalog, and its tool description when exposed as a tool).
    pub description: Option<Cow<'static, str>>,
    /// The schema of the creation data, validated when an instance is created.
    pub initial_data: Option<InitialDataSpec>,
    /// Attempt budget and wall-clock limit of one submission.
    pub durability: Durability,
    /// Cap on model steps per response.
    pub max_steps: Option<u32>,
    /// Agent-level lifecycle hooks: used when the render's `use_hooks` selection is empty, and
    /// for at-rest operations.
    pub hooks: Cow<'static, [ThreadHook]>,
    /// Whether the agent is meant as a delegate of other agents (Standard Agents'
    /// `exposeAsTool`): only then may it declare parent hooks. Delegating to an agent
    /// (`use_subagent`) does not require it, as in Flue, whose general delegate is not one.
    pub expose_as_tool: bool,
    /// Lifecycle hooks this agent requires on any parent that delegates to it.
    pub parent_hooks: Cow<'static, [ParentHookRequirement]>,
}

impl AgentDefinition {
    /// A definition named `name` with every static at its default.
    ///
    /// Panics when `name` is not a valid identity (`^[a-z][a-z0-9_]*$`); `#[agent]` checks
    /// this at compile time.
    #[track_caller]
    pub fn new(name: impl Into<Cow<'static, str>>) -> Self {
        let name = name.into();
        if !is_identity(&name) {
            panic!("[flue] Agent name \"{name}\" is not a valid identity: use snake_case matching ^[a-z][a-z0-9_]*$.");
        }
        Self::from_checked(name)
    }

    /// `new` without the identity check, for names checked at compile time.
    #[doc(hidden)]
    pub const fn from_checked(name: Cow<'static, str>) -> Self {
        Self {
            name,
            description: None,
            initial_data: None,
            durability: Durability::DEFAULT,
            max_steps: None,
            hooks: Cow::Borrowed(&[]),
            expose_as_tool: false,
            parent_hooks: Cow::Borrowed(&[]),
        }
    }

    /// Sets the description.
    pub fn description(mut self, description: impl Into<Cow<'static, str>>) -> Self {
        self.description = Some(description.into());
        self
    }

    /// Declares the creation-data type: creation data is checked against it and recorded as it
    /// reads the data (serialized back).
    pub fn initial_data<T: InitialData>(mut self) -> Self {
        self.initial_data = Some(InitialDataSpec::of::<T>());
        self
    }

    /// Sets the durability budget.
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// Caps model steps per response.
    pub fn max_steps(mut self, max_steps: u32) -> Self {
        self.max_steps = Some(max_steps);
        self
    }

    /// Sets the agent-level lifecycle hooks.
    pub fn hooks(mut self, hooks: impl Into<Cow<'static, [ThreadHook]>>) -> Self {
        self.hooks = hooks.into();
        self
    }

    /// Exposes the agent as a delegate.
    pub fn expose_as_tool(mut self) -> Self {
        self.expose_as_tool = true;
        self
    }

    /// Sets the parent-hook requirements: hooks every parent that delegates to this agent runs
    /// around its own. A hook the parent selects itself, or that another of its delegates (or
    /// this one under a second name) requires too, runs once, at its first place.
    pub fn parent_hooks(mut self, requirements: impl Into<Cow<'static, [ParentHookRequirement]>>) -> Self {
        self.parent_hooks = requirements.into();
        self
    }

    /// The rules `#[agent]` checks at compile time, for definitions built by hand: a valid
    /// name, a non-blank description, positive budgets, snake_case hook ids each selected
    /// once, and parent hooks only on an exposed agent, each with a reason. The runtime's
    /// builder refuses a definition that breaks one.
    pub fn check(&self) -> Result<(), String> {
        let name = &self.name;
        if !is_identity(name) {
            return Err(format!(
                "[flue] Agent name \"{name}\" is not a valid identity: use snake_case matching ^[a-z][a-z0-9_]*$."
            ));
        }
        if self.description.as_deref().is_some_and(crate::message::is_blank) {
            return Err(format!(
                "[flue] Agent \"{name}\" has a blank description: write what the agent does, or leave it out."
            ));
        }
        if self.max_steps == Some(0) {
            return Err(format!(
                "[flue] Agent \"{name}\": max_steps must be a positive integer."
            ));
        }
        if self.durability.max_attempts == 0 {
            return Err(format!(
                "[flue] Agent \"{name}\": durability max_attempts must be a positive integer."
            ));
        }
        if self.durability.timeout.is_zero() {
            return Err(format!("[flue] Agent \"{name}\": durability timeout must be positive."));
        }
        for (index, hook) in self.hooks.iter().enumerate() {
            crate::lifecycle::check_hook_id(hook.id())?;
            if self.hooks[..index].contains(hook) {
                return Err(format!(
                    "[flue] Agent \"{name}\" selects the lifecycle hook \"{}\" twice; select each hook once (hooks of one kind run in listed order).",
                    hook.id()
                ));
            }
        }
        if !self.parent_hooks.is_empty() && !self.expose_as_tool {
            return Err(format!(
                "[flue] Agent \"{name}\" declares parent hooks but is not exposed as a tool; only an agent with expose_as_tool can require hooks of its parents."
            ));
        }
        for (index, requirement) in self.parent_hooks.iter().enumerate() {
            let id = requirement.hook.id();
            crate::lifecycle::check_hook_id(id)?;
            if self.parent_hooks[..index]
                .iter()
                .any(|earlier| earlier.hook == requirement.hook)
            {
                return Err(format!(
                    "[flue] Agent \"{name}\" requires the parent hook \"{id}\" twice; require each hook once."
                ));
            }
            if crate::message::is_blank(requirement.reason) {
                return Err(format!(
                    "[flue] Agent \"{name}\" requires the parent hook \"{id}\" without a reason; give one, shown to whoever composes this agent."
                ));
            }
        }
        Ok(())
    }
}

/// `^[a-z][a-z0-9_]*$`: the identity rule of agent names and lifecycle-hook ids.
pub fn is_identity(name: &str) -> bool {
    let mut bytes = name.bytes();
    matches!(bytes.next(), Some(b'a'..=b'z')) && bytes.all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_'))
}

/// The creation-data type of an agent: its schema and a validating parser.
#[derive(Clone)]
pub struct InitialDataSpec {
    /// The JSON Schema (for the catalog and for clients).
    pub schema: SchemaSource,
    /// Parses creation data, returning the normalized value or what is wrong.
    pub parse: fn(&Value) -> Result<Value, String>,
}

impl InitialDataSpec {
    /// The spec of type `T`.
    pub fn of<T>() -> Self
    where
        T: serde::de::DeserializeOwned + serde::Serialize + schemars::JsonSchema + 'static,
    {
        /// The data as `T` reads it: keys it does not know dropped, its defaults filled in. It
        /// must also meet `T`'s schema, whose constraints serde does not know (a range, a
        /// length, a pattern): the catalog publishes that schema, and creation data is never
        /// written again. And it must read back as `T` (a type may write what it cannot read:
        /// a field skipped when serialized, without a default): stored, such data would fail
        /// every render of the instance for good.
        fn parse<T>(value: &Value) -> Result<Value, String>
        where
            T: serde::de::DeserializeOwned + serde::Serialize + schemars::JsonSchema + 'static,
        {
            let parsed = T::deserialize(value).map_err(|error| error.to_string())?;
            crate::data::schema_of::<T>()
                .validate(value)
                .map_err(|issues| issues.join("; "))?;
            let normalized = serde_json::to_value(parsed).map_err(|error| error.to_string())?;
            T::deserialize(&normalized).map_err(|error| {
                format!("it does not read back as the agent's initial_data type once stored ({error})")
            })?;
            Ok(normalized)
        }
        Self {
            schema: SchemaSource::of::<T>(),
            parse: parse::<T>,
        }
    }
}

impl fmt::Debug for InitialDataSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InitialDataSpec").finish_non_exhaustive()
    }
}

/// Attempt budget and wall-clock limit of one submission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Durability {
    /// Attempts before a repeatedly interrupted submission fails (default 10).
    pub max_attempts: u32,
    /// Wall-clock budget from the first claim, across every attempt (default one hour): a live
    /// attempt is aborted at its end, and a re-attempt after it fails with `submission_timeout`.
    pub timeout: Duration,
}

impl Durability {
    /// The reference defaults: 10 attempts, one hour.
    pub const DEFAULT: Durability = Durability {
        max_attempts: 10,
        timeout: Duration::from_secs(3600),
    };
}

impl Default for Durability {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// When a required parent hook runs relative to the parent's own hooks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HookStage {
    /// Before the parent's hooks.
    BeforeParent,
    /// After the parent's hooks (the default).
    #[default]
    AfterParent,
}

/// A lifecycle hook an exposed agent requires on its direct parent.
#[derive(Clone, Copy, Debug)]
pub struct ParentHookRequirement {
    /// The hook.
    pub hook: ThreadHook,
    /// When it runs.
    pub stage: HookStage,
    /// Why, shown to whoever composes this agent (non-blank).
    pub reason: &'static str,
}

/// What the agent function receives.
#[derive(Clone, Copy, Debug)]
pub struct AgentProps<'a> {
    id: Option<&'a str>,
    kind: RenderKind,
}

impl<'a> AgentProps<'a> {
    pub(crate) fn new(id: Option<&'a str>, kind: RenderKind) -> Self {
        Self { id, kind }
    }

    /// The instance id.
    ///
    /// Panics on a render with no instance behind it (bare renders and subagent renders).
    #[track_caller]
    pub fn id(&self) -> &'a str {
        match (self.id, self.kind) {
            (Some(id), _) => id,
            (None, RenderKind::Subagent) => panic!(
                "[flue] A subagent render has no agent instance behind it, so `props.id()` is unavailable. Pass what the delegate needs through the task prompt."
            ),
            (None, RenderKind::Root) => panic!(
                "[flue] This render has no agent instance behind it, so `props.id()` is unavailable. Pass an instance id in the render state to back it in tests and tooling."
            ),
        }
    }

    /// The instance id, or `None` when nothing backs it.
    pub fn try_id(&self) -> Option<&'a str> {
        self.id
    }

    /// Root or subagent render.
    pub fn kind(&self) -> RenderKind {
        self.kind
    }
}

/// What an agent function returns: its instruction text, or nothing, or the error that fails
/// its render.
///
/// Converts from `&'static str`, `String`, `Cow<'static, str>`, `Option<String>` and `()`, and
/// from a `Result` of any of these whose error displays (`Result<String, anyhow::Error>`, a
/// `Result` with a `std::error::Error`): an `Err` fails the render with the error's text (its
/// alternate `Display`, which for `anyhow::Error` includes its causes) as
/// [`RenderError::Failed`](crate::RenderError::Failed), so an agent function can use `?`. The
/// runtime fails the submission with it as it does a panicking render; [`render`](crate::render())
/// returns it where a panic would unwind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Instruction(Option<Cow<'static, str>>, Option<String>);

impl Instruction {
    /// No instruction.
    pub const NONE: Instruction = Instruction(None, None);

    /// The instruction of an agent function that failed with `message`: its render fails with
    /// [`RenderError::Failed`](crate::RenderError::Failed).
    pub fn failed(message: impl Into<String>) -> Self {
        Self(None, Some(message.into()))
    }

    /// The text, if any.
    pub fn as_str(&self) -> Option<&str> {
        self.0.as_deref()
    }

    /// The error the agent function failed with, if it did.
    pub fn failure(&self) -> Option<&str> {
        self.1.as_deref()
    }

    /// The text, or the failure.
    pub(crate) fn into_result(self) -> Result<Option<Cow<'static, str>>, String> {
        match self.1 {
            Some(failure) => Err(failure),
            None => Ok(self.0),
        }
    }
}

/// An agent function that can fail: an `Err` fails its render with the error's text.
impl<T: Into<Instruction>, E: fmt::Display> From<Result<T, E>> for Instruction {
    fn from(returned: Result<T, E>) -> Self {
        match returned {
            Ok(instruction) => instruction.into(),
            // The alternate form, as a tool's error: `anyhow::Error`'s shows its causes.
            Err(error) => Self::failed(format!("{error:#}")),
        }
    }
}

impl From<&'static str> for Instruction {
    fn from(text: &'static str) -> Self {
        Self(Some(Cow::Borrowed(text)), None)
    }
}

impl From<String> for Instruction {
    fn from(text: String) -> Self {
        Self(Some(Cow::Owned(text)), None)
    }
}

impl From<Cow<'static, str>> for Instruction {
    fn from(text: Cow<'static, str>) -> Self {
        Self(Some(text), None)
    }
}

impl From<Option<String>> for Instruction {
    fn from(text: Option<String>) -> Self {
        Self(text.map(Cow::Owned), None)
    }
}

impl From<Option<&'static str>> for Instruction {
    fn from(text: Option<&'static str>) -> Self {
        Self(text.map(Cow::Borrowed), None)
    }
}

impl From<()> for Instruction {
    fn from((): ()) -> Self {
        Self(None, None)
    }
}

/// What an agent's creation data can be (`#[agent(initial_data = T)]`,
/// [`AgentDefinition::initial_data`]): implemented for every type serde reads and writes and
/// schemars describes; its message says which derives a type lacks.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be an agent's initial data",
    label = "needs `#[derive(Serialize, Deserialize, JsonSchema)]`",
    note = "creation data is checked against the type's JSON Schema and recorded as the type reads it (serialized back)"
)]
pub trait InitialData: serde::de::DeserializeOwned + serde::Serialize + schemars::JsonSchema + 'static {}

impl<T: serde::de::DeserializeOwned + serde::Serialize + schemars::JsonSchema + 'static> InitialData for T {}

/// An agent function's parameter declared as `Self`: only [`AgentProps`] itself. `#[agent]`
/// asserts it at the parameter's type (through [`agent_parameter`]), so another type is
/// reported there, saying what an agent takes.
#[diagnostic::on_unimplemented(
    message = "an agent function's parameter is its `AgentProps`, not `{Self}`",
    label = "declare it as `AgentProps` (or leave the parameter out)",
    note = "the instance's values come from hooks: `use_persistent_state`, `use_delivery`, `props.id()`"
)]
#[doc(hidden)]
pub trait AgentParameter<'a> {
    /// The props themselves.
    fn declared(props: AgentProps<'a>) -> Self;
}

impl<'a> AgentParameter<'a> for AgentProps<'a> {
    fn declared(props: AgentProps<'a>) -> Self {
        props
    }
}

/// The argument an agent function's parameter of type `D` gets: the props, asserting
/// [`AgentParameter`] where `#[agent]` spans the call.
#[doc(hidden)]
pub fn agent_parameter<'a, D: AgentParameter<'a>>(props: AgentProps<'a>) -> D {
    D::declared(props)
}

// What `#[agent]` converts an agent function's return value with: anything
// `Into<Instruction>` (a type of the user's own with a `From` impl, `impl Into<Instruction>`
// included). A bound on that alone would report a wrong return type as rustc's own
// "`Instruction: From<u32>` is not satisfied"; so the attribute picks by method resolution,
// `(&ReturnedValue(&value)).__flue_instruction().convert(value)`: `Instructs` (on
// `ReturnedValue<&T>`, found first) when the value converts, else `NotInstructs` (on
// `&ReturnedValue<&T>`), whose `convert` asks for [`Instructive`], which nothing implements:
// its diagnostic says what an agent returns.

/// An agent function's return value, borrowed while `#[agent]` picks how to convert it.
#[doc(hidden)]
pub struct ReturnedValue<'a, T: ?Sized>(pub &'a T);

/// A return value that converts into the instruction; see [`IntoInstructionFn`].
#[doc(hidden)]
pub trait Instructs {
    /// How `#[agent]` converts the value.
    fn __flue_instruction(&self) -> IntoInstructionFn {
        IntoInstructionFn
    }
}

impl<T: Into<Instruction>> Instructs for ReturnedValue<'_, T> {}

/// Any other return value; see [`NoInstruction`].
#[doc(hidden)]
pub trait NotInstructs {
    /// How `#[agent]` converts the value.
    fn __flue_instruction(&self) -> NoInstruction {
        NoInstruction
    }
}

impl<T: ?Sized> NotInstructs for &ReturnedValue<'_, T> {}

/// Converts with `Into<Instruction>`.
#[doc(hidden)]
pub struct IntoInstructionFn;

impl IntoInstructionFn {
    /// The instruction.
    pub fn convert<T: Into<Instruction>>(self, value: T) -> Instruction {
        value.into()
    }
}

/// Reports a return value that is no instruction, at the return type.
#[doc(hidden)]
pub struct NoInstruction;

impl NoInstruction {
    /// Never compiles: nothing is [`Instructive`].
    pub fn convert<T: Instructive>(self, _value: T) -> Instruction {
        Instruction::NONE
    }
}

/// What an agent body may return: anything `Into<Instruction>`. The bound of
/// [`FnAgent`]'s body, which says what is wrong with a closure that returns something else, an
/// `async` one's future included.
#[diagnostic::on_unimplemented(
    message = "an agent body returns its instruction (`&'static str`, `String`, `Option<String>`, `()`, a `Result` of one whose error displays, or anything `Into<Instruction>`), not `{Self}`",
    label = "this closure returns `{Self}`",
    note = "an agent body renders synchronously: an `async` closure is not one (a tool, or a hook's callback, is where to wait)",
    note = "everything else (model, tools, state) is composed with hooks in the body"
)]
pub trait IntoInstruction {
    /// The instruction.
    fn into_instruction(self) -> Instruction;
}

#[diagnostic::do_not_recommend]
impl<T: Into<Instruction>> IntoInstruction for T {
    fn into_instruction(self) -> Instruction {
        self.into()
    }
}

/// Implemented by nothing: the bound that reports an agent function's wrong return type.
#[doc(hidden)]
#[diagnostic::on_unimplemented(
    message = "an agent function returns its instruction (`&'static str`, `String`, `Option<String>`, `()`, a `Result` of one whose error displays, or anything `Into<Instruction>`), not `{Self}`",
    label = "not an instruction",
    note = "everything else (model, tools, state) is composed with hooks in the body"
)]
pub trait Instructive {}

/// A shared reference to an agent: `&'static` for zero-sized agents (what `#[agent]`
/// generates), reference-counted otherwise.
#[derive(Clone)]
pub struct AgentRef(Repr);

#[derive(Clone)]
enum Repr {
    Static(&'static dyn Agent),
    Shared(Arc<dyn Agent>),
}

impl AgentRef {
    /// Shares `agent`. Zero-sized agents are promoted to `&'static` without allocating.
    pub fn new<A: Agent>(agent: A) -> Self {
        if std::mem::size_of::<A>() == 0 {
            // Boxing a zero-sized value does not allocate; leaking it yields a `'static` ref.
            Self(Repr::Static(Box::leak(Box::new(agent))))
        } else {
            Self(Repr::Shared(Arc::new(agent)))
        }
    }

    /// Wraps an already shared agent.
    pub fn from_arc(agent: Arc<dyn Agent>) -> Self {
        Self(Repr::Shared(agent))
    }

    /// The agent.
    pub fn get(&self) -> &dyn Agent {
        match &self.0 {
            Repr::Static(agent) => *agent,
            Repr::Shared(agent) => agent.as_ref(),
        }
    }

    /// The agent's identity.
    pub fn name(&self) -> &str {
        &self.get().definition().name
    }
}

impl<A: Agent> From<A> for AgentRef {
    fn from(agent: A) -> Self {
        Self::new(agent)
    }
}

impl fmt::Debug for AgentRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("AgentRef").field(&self.name()).finish()
    }
}

/// An agent from a closure: the definition plus a `Fn(AgentProps) -> impl Into<Instruction>`.
///
/// ```
/// use flue_core::prelude::*;
///
/// let greeter = FnAgent::new(AgentDefinition::new("greeter"), |_props| {
///     use_model("openai/gpt-4o-mini");
///     "Greet the user."
/// });
/// let rendered = flue_core::render_bare(&greeter).unwrap();
/// assert_eq!(rendered.instruction.as_deref(), Some("Greet the user."));
/// ```
pub struct FnAgent<F> {
    definition: AgentDefinition,
    body: F,
}

impl<F, I> FnAgent<F>
where
    F: Fn(AgentProps<'_>) -> I + Send + Sync + 'static,
    I: IntoInstruction,
{
    /// An agent with `definition` whose function is `body`.
    pub fn new(definition: AgentDefinition, body: F) -> Self {
        Self { definition, body }
    }
}

impl<F, I> Agent for FnAgent<F>
where
    F: Fn(AgentProps<'_>) -> I + Send + Sync + 'static,
    I: IntoInstruction,
{
    fn definition(&self) -> &AgentDefinition {
        &self.definition
    }

    #[track_caller]
    fn render_body(&self, props: AgentProps<'_>) -> Instruction {
        let _body = crate::render::BodyGuard::enter();
        (self.body)(props).into_instruction()
    }
}

impl<F> fmt::Debug for FnAgent<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FnAgent")
            .field("definition", &self.definition)
            .finish_non_exhaustive()
    }
}
