//! Procedural macros of flue-rs. Use them through `flue_runtime` (`use flue_runtime::prelude::*`),
//! which re-exports them and everything their expansion needs.
//!
//! Each attribute is built as parse → model → validate → expand. Every problem of one item is
//! reported in one build, spanned on the smallest offending token, and the item is still
//! emitted beside the `compile_error!` so the rest of the crate keeps type-checking.

mod agent;
mod errors;
mod hook;
mod krate;
mod tool;

use proc_macro::TokenStream;

/// Turns a synchronous function into an agent: a value of the same name implementing
/// `flue_runtime::Agent`.
///
/// ```ignore
/// #[agent(max_steps = 6)]
/// fn duplicate_finder() -> &'static str {
///     use_model("openrouter/anthropic/claude-sonnet-4.5");
///     "You check whether a GitHub issue duplicates an older open issue."
/// }
/// ```
///
/// | option | meaning |
/// | --- | --- |
/// | `name = "…"` | durable identity (`^[a-z][a-z0-9_]*$`); default: the function's name |
/// | `description = "…"` | what the agent does (catalog, delegate description) |
/// | `initial_data = Type` | creation-data type, validated when an instance is created |
/// | `durability(max_attempts = N, timeout = "90s")` | attempt budget and wall-clock limit |
/// | `max_steps = N` | cap on model steps per response |
/// | `hooks = [a, b]` | agent-level lifecycle hooks |
/// | `expose_as_tool` | may be used as a delegate and declare `parent_hooks` |
/// | `parent_hooks = [(hook, before_parent, "reason")]` | hooks required on a parent |
/// | `crate = "path"` | where `flue_runtime` is, when the dependency is renamed |
///
/// The function takes no parameters or one `AgentProps`, is not `async`, and returns anything
/// `Into<Instruction>` (`&'static str`, `String`, `()`).
///
/// **What it expands to**: the function body moves into a hidden inner function; the name
/// becomes a zero-sized `struct` (so it is a value, passable to `Subagent::new` or a runtime)
/// with an `impl Agent` whose `definition()` holds the statics and whose `render_body` calls
/// the inner function.
#[proc_macro_attribute]
pub fn agent(args: TokenStream, item: TokenStream) -> TokenStream {
    agent::expand(args.into(), item.into()).into()
}

/// Defines a Standard Agents lifecycle hook: a `const` of the same name, of type `ThreadHook`
/// (or `UserHook` for the three user-scope kinds), that agents select with `use_hooks([..])`
/// or `#[agent(hooks = [..])]`.
///
/// ```ignore
/// #[hook(before_store_tool_result)]
/// async fn redact_emails(_state: &ThreadState, _call: &ToolCall, result: ToolResult) -> ToolResult {
///     ToolResult { result: result.result.map(|text| redact(&text)), ..result }
/// }
/// ```
///
/// | option | meaning |
/// | --- | --- |
/// | `kind` (first, required) | one of the 17 kinds below |
/// | `id = "…"` | snake-case id, unique across the application; default: the function's name |
/// | `crate = "path"` | where `flue_runtime` is, when the dependency is renamed |
///
/// | kind | parameters | returns |
/// | --- | --- | --- |
/// | `after_thread_created` | `&ThreadState` | `()` |
/// | `after_subagent_created` | `&ThreadState, &ThreadState` (parent, child) | `()` |
/// | `after_system_message` | `&ThreadState, String` | `Option<String>` or `String` |
/// | `filter_messages` | `&ThreadState, Vec<Message>` | `Vec<Message>` |
/// | `prefilter_llm_history` | `&ThreadState, Vec<LlmMessage>` | `Vec<LlmMessage>` |
/// | `before_create_message` | `&ThreadState, Message` | `Message` |
/// | `after_create_message` | `&ThreadState, &Message` | `()` |
/// | `before_update_message` | `&ThreadState, &str, MessageUpdates` | `MessageUpdates` |
/// | `after_update_message` | `&ThreadState, &Message` | `()` |
/// | `before_store_tool_result` | `&ThreadState, &ToolCall, ToolResult` | `ToolResult` |
/// | `after_tool_call_success` | `&ThreadState, &ToolCall, ToolResult` | `Option<ToolResult>` or `ToolResult` |
/// | `after_tool_call_failure` | `&ThreadState, &ToolCall, ToolResult` | `Option<ToolResult>` or `ToolResult` |
/// | `tool_call_started` | `&ThreadState, &ToolCall, Option<&str>` | `()` |
/// | `tool_call_done` | `&ThreadState, &ToolCall, &ToolResult` | `()` |
/// | `user_client_attached` | `&UserState, &ClientInfo` | `()` |
/// | `user_client_detached` | `&UserState, &ClientInfo` | `()` |
/// | `user_value_changed` | `&UserState, &str` | `()` |
///
/// Any hook may be `async` and may return `Result<T, E>` with `E: Into<HookError>`.
///
/// **What it expands to**: the function moves into a hidden body; the name becomes a `const`
/// holding a reference to a `static` definition (id plus a typed handler that calls the body).
/// Thread hooks and user-scope hooks are different types, so a user-scope hook passed to
/// `use_hooks` does not compile.
#[proc_macro_attribute]
pub fn hook(args: TokenStream, item: TokenStream) -> TokenStream {
    hook::expand(args.into(), item.into()).into()
}

/// Turns an async function into a model-callable tool: a value of the same name implementing
/// `ToolHandler`, mounted with `use_tool(name)`.
///
/// ```ignore
/// /// Read a public GitHub issue.
/// #[tool]
/// async fn get_github_issue(ctx: &ToolContext, args: IssueRef) -> Result<String, ToolError> { … }
///
/// /// Search the open issues of a repository.
/// #[tool(progress_argument = "query")]
/// async fn search_github_issues(
///     /// Repository owner
///     owner: String,
///     /// Repository name
///     repo: String,
///     /// Words from the issue title or text
///     query: String,
/// ) -> Result<String, ToolError> { … }
/// ```
///
/// The doc comment is the tool's description (required). Arguments come either as one
/// parameter named `args` whose type is `Deserialize + JsonSchema`, or as plain parameters from
/// which the macro builds the argument struct (doc comments on parameters become field
/// descriptions). A first parameter `&ToolContext` is optional.
///
/// | option | meaning |
/// | --- | --- |
/// | `name = "…"` | the model-facing name (`^[A-Za-z0-9_-]{1,64}$`, not reserved); default: the function's name |
/// | `progress_argument = "field"` | string argument reported by `tool_call_started` as it streams |
/// | `secrets = ["NAME", …]` | environment variables the tool may read through `ctx.secret(..)` |
/// | `terminate` | a batch made only of terminating tools ends the turn |
/// | `crate = "path"` | where `flue_runtime` is, when the dependency is renamed |
///
/// The function returns text, JSON, `()`, a `ToolOutput`, or a `Result` of these with an error
/// convertible into `ToolError` (an `Err` is an error result the model sees).
///
/// **What it expands to**: the function moves into a hidden body; the name becomes a
/// zero-sized `struct` (generic tools: a struct built with `name::<T>::new()`) with an
/// `impl ToolHandler` whose definition is a `static` (name, description, the argument schema
/// generated by schemars on first use) and whose `call` deserializes the arguments and awaits
/// the body.
#[proc_macro_attribute]
pub fn tool(args: TokenStream, item: TokenStream) -> TokenStream {
    tool::expand(args.into(), item.into()).into()
}
