//! Procedural macros of flue-rs. Use them through `flue_runtime` (`use flue_runtime::prelude::*`),
//! which re-exports them and everything their expansion needs.
//!
//! Each attribute is built as parse → model → validate → expand. Every problem of one item is
//! reported in one build, spanned on the smallest offending token, and the item is still
//! emitted beside the `compile_error!` so the rest of the crate keeps type-checking.

mod agent;
mod docs;
mod errors;
mod hook;
mod krate;
mod render_hooks;
mod tool;

/// A span that points at `tokens` (errors are reported there) and resolves names as the
/// expansion's own: the user's tokens may come from a `macro_rules!` fragment whose hygiene
/// would hide the expansion's locals (`__flue_returned`) from code spanned with them.
fn located_at(tokens: &impl syn::spanned::Spanned) -> proc_macro2::Span {
    proc_macro2::Span::call_site().located_at(tokens.span())
}

/// Whether `generics` declares lifetimes and nothing else (none at all included).
fn lifetimes_only(generics: &syn::Generics) -> bool {
    generics
        .params
        .iter()
        .all(|param| matches!(param, syn::GenericParam::Lifetime(_)))
}

/// The parameter of `sig` named like the function itself (`fn echo(echo: String)`), with its
/// type, if any: the expansion puts a value of that name in scope of the body, so the parameter
/// would be a pattern matching that value instead of a binding.
fn parameter_named_like_item(sig: &syn::Signature) -> Option<(&syn::Ident, &syn::Type)> {
    use syn::ext::IdentExt;
    let name = sig.ident.unraw();
    sig.inputs.iter().find_map(|input| match input {
        syn::FnArg::Typed(param) => match param.pat.as_ref() {
            syn::Pat::Ident(pat) if pat.ident.unraw() == name => Some((&pat.ident, param.ty.as_ref())),
            _ => None,
        },
        syn::FnArg::Receiver(_) => None,
    })
}

/// The value of `meta`'s option as a `T`. Without `= value`, or with a value of another kind,
/// the error says what the option takes and how to write it (`#[attribute] option `key` takes
/// {what}: write `{example}``), spanned at the key or at the value; a value of the wrong kind
/// is consumed, so the options after it are still read.
fn option_value<T: syn::parse::Parse>(
    meta: &syn::meta::ParseNestedMeta<'_>,
    attribute: &str,
    errors: &errors::Errors,
    what: &str,
    example: &str,
) -> syn::Result<Option<T>> {
    let key = meta.path.get_ident().map(ToString::to_string).unwrap_or_default();
    let message = format!("#[{attribute}] option `{key}` takes {what}: write `{example}`");
    if !meta.input.peek(syn::Token![=]) {
        errors.spanned(&meta.path, message);
        return Ok(None);
    }
    let input = meta.value()?;
    let fork = input.fork();
    if let Ok(value) = fork.parse::<T>() {
        use syn::parse::discouraged::Speculative;
        input.advance_to(&fork);
        return Ok(Some(value));
    }
    // Not a `T`: as an expression (what an option value is), reported whole.
    let written: syn::Expr = input.parse()?;
    errors.spanned(&written, message);
    Ok(None)
}

/// The first `impl Trait` that `ty` names (`impl Into<String>`, `Vec<impl Display>`): the
/// argument struct of a `#[tool]` cannot hold one, and the model's JSON needs one concrete type
/// to become; a `#[hook]` parameter of one is generic, and takes its argument as it is.
pub(crate) fn impl_trait_in(ty: &syn::Type) -> Option<&syn::TypeImplTrait> {
    match ty {
        syn::Type::ImplTrait(opaque) => Some(opaque),
        syn::Type::Reference(inner) => impl_trait_in(&inner.elem),
        syn::Type::Ptr(inner) => impl_trait_in(&inner.elem),
        syn::Type::Paren(inner) => impl_trait_in(&inner.elem),
        syn::Type::Group(inner) => impl_trait_in(&inner.elem),
        syn::Type::Slice(inner) => impl_trait_in(&inner.elem),
        syn::Type::Array(inner) => impl_trait_in(&inner.elem),
        syn::Type::Tuple(tuple) => tuple.elems.iter().find_map(impl_trait_in),
        syn::Type::Path(path) => {
            let qself = path.qself.as_ref().and_then(|qself| impl_trait_in(&qself.ty));
            qself.or_else(|| {
                path.path.segments.iter().find_map(|segment| match &segment.arguments {
                    syn::PathArguments::AngleBracketed(arguments) => {
                        arguments.args.iter().find_map(|argument| match argument {
                            syn::GenericArgument::Type(ty) => impl_trait_in(ty),
                            syn::GenericArgument::AssocType(assoc) => impl_trait_in(&assoc.ty),
                            _ => None,
                        })
                    }
                    syn::PathArguments::Parenthesized(arguments) => arguments
                        .inputs
                        .iter()
                        .find_map(impl_trait_in)
                        .or_else(|| match &arguments.output {
                            syn::ReturnType::Type(_, ty) => impl_trait_in(ty),
                            syn::ReturnType::Default => None,
                        }),
                    syn::PathArguments::None => None,
                })
            })
        }
        _ => None,
    }
}

/// A flag option: `flag`, or `flag = true` / `flag = false` (what it says).
fn flag(meta: &syn::meta::ParseNestedMeta<'_>) -> syn::Result<bool> {
    if meta.input.peek(syn::Token![=]) {
        let value: syn::LitBool = meta.value()?.parse()?;
        Ok(value.value)
    } else {
        Ok(true)
    }
}

use proc_macro::TokenStream;

/// Turns a synchronous function into an agent: a value of the same name implementing
/// `flue_runtime::Agent`.
///
/// ```
/// use flue_runtime::prelude::*;
///
/// /// Checks whether a GitHub issue duplicates an older open issue.
/// #[agent(max_steps = 6)]
/// fn duplicate_finder() -> &'static str {
///     use_model("openrouter/anthropic/claude-sonnet-4.5");
///     "You check whether a GitHub issue duplicates an older open issue."
/// }
///
/// let definition = duplicate_finder.definition();
/// assert_eq!(definition.name, "duplicate_finder");
/// assert_eq!(definition.max_steps, Some(6));
/// let rendered = flue_runtime::render_bare(&duplicate_finder).unwrap();
/// assert_eq!(rendered.model.unwrap().spec, "openrouter/anthropic/claude-sonnet-4.5");
/// ```
///
/// With props, identity and durability:
///
/// ```
/// use flue_runtime::prelude::*;
///
/// #[agent(name = "mail_agent", expose_as_tool, durability(max_attempts = 3, timeout = "90s"))]
/// fn mail(props: AgentProps) -> String {
///     format!("You read the mailbox of {}.", props.id())
/// }
///
/// assert!(mail.definition().expose_as_tool);
/// let rendered = flue_runtime::render(&mail, &RenderState::root("inbox-1")).unwrap();
/// assert_eq!(rendered.instruction.as_deref(), Some("You read the mailbox of inbox-1."));
/// ```
///
/// | option | meaning |
/// | --- | --- |
/// | `name = "…"` | durable identity (`^[a-z][a-z0-9_]*$`); default: the function's name |
/// | `description = "…"` | what the agent does (catalog, delegate description); default: the doc comment, unindented as rustdoc does it |
/// | `initial_data = Type` | creation-data type (`Deserialize + Serialize + JsonSchema`): validated when an instance is created, recorded as `Type` reads it |
/// | `durability(max_attempts = N, timeout = "90s")` | attempt budget and wall-clock limit |
/// | `max_steps = N` | cap on model steps per response |
/// | `hooks = [a, b]` | agent-level lifecycle hooks |
/// | `expose_as_tool` | marks the agent as meant for delegation (the catalog's `exposeAsTool`); required to declare `parent_hooks`. Any agent can be a delegate (also `= true` / `false`) |
/// | `parent_hooks = [(hook, before_parent, "reason")]` | hooks required on a parent (the stage may be left out: `(hook, "reason")` is `after_parent`) |
/// | `crate = "path"` | where `flue_runtime` is, when the dependency is renamed |
///
/// The function takes no parameters or one `AgentProps`, is not `async`, returns anything
/// `Into<Instruction>` (`&'static str`, `String`, `()`, or a `Result` of one whose error
/// displays: an `Err`, `?` included, fails the render with the error's text, and the
/// submission with it, as a panic does), and is generic over nothing but lifetimes (`fn assistant<'a>(props:
/// AgentProps<'a>)`).
///
/// **The rules of hooks at compile time**: a hook call among the body's top-level statements
/// runs on every render, so one that repeats an earlier one where the rules allow one per
/// render (`use_model`, `use_sandbox`, `use_tool` of the same tool, `use_hooks` of the same
/// hook, `use_persistent_state` or `use_data_writer` of the same literal name) does not
/// compile. Calls under a condition, a loop or a closure, and calls in custom hooks, are
/// checked when the agent renders, and so are statements after a `return`; calls and `let`s
/// under `cfg` are not checked here at all (they may not be compiled). A hook called where no
/// render runs does not compile either: in an `async` block or closure (even one the body
/// blocks on), in the body of a closure given to `use_agent_start`, `use_agent_finish`,
/// `use_response_start` or `use_response_finish`, or in one given to `thread::spawn` (or a
/// bare `spawn`) or to a `spawn` or `spawn_scoped` method (a `thread::scope`'s, a
/// `thread::Builder`'s), which runs on another thread (nor in a `#[tool]` or `#[hook]` body,
/// where a plain closure, spawned or not, is not searched: it may be an agent function some
/// render calls). These checks see into the arguments of the standard library's expression
/// macros (`format!`, `vec!`, …), not into other macros. A hook given a literal its rules
/// refuse (a blank instruction, state or data part name, a model specifier that is not
/// `provider-id/model-id`) does not compile wherever the call is.
///
/// **What it expands to**: the function body moves into a hidden inner function; the name
/// becomes a zero-sized `struct` (so it is a value, passable to `Subagent::new` or a runtime)
/// with an `impl Agent` whose `definition()` holds the statics and whose `render_body` calls
/// the inner function. The full expansion of an example is committed in
/// `flue-macros/tests/expand/agent.expanded.rs`.
///
/// **Its name is a value**: like any unit struct, it is a pattern wherever it is in scope, so a
/// `let` or a parameter of the same name there does not compile (`mismatched types`). Name
/// bindings apart from agents, tools and hooks (see `#[tool]` for an example). Being a struct,
/// it is a type name too: a module or type of the same name in the same scope clashes with it
/// (`mod triage; pub use triage::triage;` is E0255); re-export the agent from a module named
/// apart (`mod agents; pub use agents::triage;`).
#[proc_macro_attribute]
pub fn agent(args: TokenStream, item: TokenStream) -> TokenStream {
    agent::expand(args.into(), item.into()).into()
}

/// Defines a Standard Agents lifecycle hook: a `const` of the same name, of type `ThreadHook`
/// (or `UserHook` for the three user-scope kinds), that agents select with `use_hooks([..])`
/// or `#[agent(hooks = [..])]`.
///
/// ```
/// use flue_runtime::prelude::*;
///
/// #[hook(before_store_tool_result)]
/// async fn redact_emails(_state: &ThreadState, _call: &ToolCall, result: ToolResult) -> ToolResult {
///     ToolResult { result: result.result.map(|text| text.replace("dev@example.com", "[email redacted]")), ..result }
/// }
///
/// #[hook(filter_messages, id = "limit_to_20_messages")]
/// fn limit(_state: &ThreadState, messages: Vec<Message>) -> Vec<Message> {
///     let skip = messages.len().saturating_sub(20);
///     messages.into_iter().skip(skip).collect()
/// }
///
/// #[agent(hooks = [limit])]
/// fn support() -> &'static str {
///     use_model("openai/gpt-4o-mini");
///     use_hooks([redact_emails]);
///     "You answer support questions."
/// }
///
/// assert_eq!(redact_emails.id(), "redact_emails");
/// assert_eq!(limit.id(), "limit_to_20_messages");
/// let rendered = flue_runtime::render_bare(&support).unwrap();
/// assert_eq!(rendered.hooks[0].id(), "redact_emails");
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
/// Any hook may be `async` and may return `Result<T, E>`. `E` is a `HookError` (read as it
/// is: `HookError::block` keeps its flag), any `std::error::Error` or other type a `HookError`
/// converts from, text (`String`, `&'static str`), or any error that displays (`anyhow::Error`,
/// `Box<dyn Error + Send + Sync>`): the error's text (for one that only displays, its
/// alternate form, with an `anyhow::Error`'s causes) becomes the `HookError`'s message, as a
/// tool's does. A hook may name its lifetimes (`fn greet<'s>(state: &'s ThreadState)`), but
/// not be generic over types or constants. A parameter has the kind's type, or is `impl
/// Trait` of it, or `&dyn Trait` where the kind passes a reference. A render hook (`use_model`, …) called in the body does
/// not compile: a lifecycle hook runs after the render that selected it, where every hook
/// call panics.
///
/// The calls of one model step run concurrently, but the tool-result hooks of a call
/// (`tool_call_done`, `after_tool_call_*`, `before_store_tool_result` and the tool row's
/// `before_create_message`) run one call at a time, as the calls end: a hook may read a thread
/// value and write it back without racing itself on another call of the step.
///
/// **What it expands to**: the function moves into a hidden body; the name becomes a `const`
/// holding a reference to a `static` definition (id plus a typed handler that calls the body).
/// Thread hooks and user-scope hooks are different types, so a user-scope hook passed to
/// `use_hooks` does not compile. An example's full expansion is committed in
/// `flue-macros/tests/expand/hook.expanded.rs`.
///
/// **Its name is a value**: a `const`, which is a pattern wherever it is in scope, so a `let`
/// or a parameter of the same name there does not compile. Name bindings apart from hooks,
/// tools and agents (see `#[tool]` for an example).
#[proc_macro_attribute]
pub fn hook(args: TokenStream, item: TokenStream) -> TokenStream {
    hook::expand(args.into(), item.into()).into()
}

/// Turns an async function into a model-callable tool: a value of the same name implementing
/// `ToolHandler`, mounted with `use_tool(name)`.
///
/// ```
/// use flue_runtime::prelude::*;
///
/// #[derive(serde::Deserialize, schemars::JsonSchema)]
/// struct IssueRef {
///     /// Repository owner
///     owner: String,
///     /// Repository name
///     repo: String,
///     /// Issue number
///     number: u64,
/// }
///
/// /// Read a public GitHub issue.
/// #[tool]
/// async fn get_github_issue(_ctx: &ToolContext, args: IssueRef) -> Result<String, ToolError> {
///     Ok(format!("{}/{}#{}", args.owner, args.repo, args.number))
/// }
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
/// ) -> Result<String, ToolError> {
///     Ok(format!("searched {owner}/{repo} for {query}"))
/// }
///
/// let tool = search_github_issues.into_tool();
/// assert_eq!(tool.definition().description, "Search the open issues of a repository.");
/// assert_eq!(tool.input_schema().json()["properties"]["query"]["description"], "Words from the issue title or text");
/// let output = flue_runtime::testing::poll_ready(
///     tool.call(ToolContext::new(&tool, "call_1"), serde_json::json!({"owner": "o", "repo": "r", "query": "crash"})),
/// );
/// assert_eq!(output.to_text(), "searched o/r for crash");
/// # let _ = get_github_issue;
/// ```
///
/// The doc comment is the tool's description (required; a macro may write it, as in
/// `#[doc = include_str!("search.md")]`). It is markdown, unindented as rustdoc does it: the
/// indentation the `///` lines share goes, the rest stays, so nested lists and indented code
/// blocks reach the model as written; each line loses its trailing whitespace and the text its
/// surrounding blank lines (text a macro writes is kept as written, but for the blank lines
/// around the whole description). An `#[agent]`'s doc comment is read the same way.
///
/// Arguments come either as one parameter named `args` whose type is a struct (or map)
/// deriving `Deserialize` and `JsonSchema`, or as plain parameters of owned types from which
/// the macro builds the argument struct. A first parameter `&ToolContext` is optional.
///
/// A plain parameter's doc comment, `#[serde(..)]` and `#[schemars(..)]` attributes go to its
/// field of the argument struct, so the schema and the parsing both honour them; other
/// attributes stay on the parameter. A `#[schemars(..)]` `rename`, `skip` or `flatten` that
/// `#[serde(..)]` does not say too is refused (the schema would show what the parser refuses):
/// write the `#[serde(..)]` one, which schemars reads as well.
///
/// ```
/// use flue_runtime::prelude::*;
///
/// /// Search issues by their title.
/// #[tool(progress_argument = "q")]
/// async fn search_titles(
///     /// Words from the title
///     #[serde(rename = "q")]
///     query: String,
///     /// How many issues to return; all of them when 0
///     #[serde(default)]
///     #[schemars(range(max = 100))]
///     limit: u32,
/// ) -> String {
///     format!("{query}: {limit}")
/// }
///
/// let tool = search_titles.into_tool();
/// assert_eq!(tool.input_schema().json()["required"], serde_json::json!(["q"]));
/// let output = flue_runtime::testing::poll_ready(
///     tool.call(ToolContext::new(&tool, "call_1"), serde_json::json!({"q": "crash"})),
/// );
/// assert_eq!(output.to_text(), "crash: 0");
/// ```
///
/// | option | meaning |
/// | --- | --- |
/// | `name = "…"` | the model-facing name (`^[A-Za-z0-9_-]{1,64}$`, not reserved); default: the function's name |
/// | `progress_argument = "field"` | string argument reported by `tool_call_started` as it streams, by its JSON name (a renamed parameter's `rename`; a plain parameter's type must be `String`; an `args` struct's field is checked by `use_tool`) |
/// | `secrets = ["NAME", …]` | environment variables the tool may read through `ctx.secret(..)` (a `ctx.secret("LITERAL")` in the body that names no declared secret does not compile) |
/// | `terminate` | a batch made only of terminating tools ends the turn (also `terminate = true` / `false`) |
/// | `durable` | an interrupted call runs again on recovery, replaying its settled `ctx.step(..)` values (also `= true` / `false`) |
/// | `crate = "path"` | where `flue_runtime` is, when the dependency is renamed |
///
/// The function returns text, JSON, `()`, a `ToolOutput`, or a `Result` of these whose error
/// is convertible into `ToolError` (any `std::error::Error`) or is text (`String`,
/// `&'static str`): an `Err` is an error result the model sees, its message or its text.
///
/// ```
/// use flue_runtime::prelude::*;
///
/// /// Divide two numbers.
/// #[tool]
/// async fn divide(dividend: i64, divisor: i64) -> Result<String, String> {
///     let quotient = dividend.checked_div(divisor).ok_or(format!("cannot divide {dividend} by {divisor}"))?;
///     Ok(quotient.to_string())
/// }
///
/// let tool = divide.into_tool();
/// let output = flue_runtime::testing::poll_ready(
///     tool.call(ToolContext::new(&tool, "call_1"), serde_json::json!({"dividend": 1, "divisor": 0})),
/// );
/// assert_eq!(output, ToolOutput::error("cannot divide 1 by 0"));
/// ```
///
/// **A tool must not block its thread.** Its future runs on the response's own task, beside
/// the timer that enforces the agent's `timeout` and the abort: a body that blocks (a
/// synchronous `std::process::Command::output`, a blocking database client, a long
/// computation) holds all of them, and a call that never returns holds the instance for good.
/// Run such work with `tokio::task::spawn_blocking` (or an async client) and await it.
///
/// A tool may be generic over types (taking its arguments as `args: T`) and may name lifetimes.
/// The lifetimes belong to the body, not to the tool, which outlives every call: type
/// parameters may be bounded by them only as outlives bounds (`T: 'a`), never as in
/// `T: Trait<'a>` (a compile error).
///
/// **What it expands to**: the function moves into a hidden body; the name becomes a
/// zero-sized `struct` (generic tools: a struct built with `name::<T>::new()`) with an
/// `impl ToolHandler` whose definition is a `static` (name, description, the argument schema
/// generated by schemars on first use) and whose `call` deserializes the arguments and awaits
/// the body. An example's full expansion is committed in
/// `flue-macros/tests/expand/tool.expanded.rs`.
///
/// **Its name is a value**: like any unit struct, it is a pattern wherever it is in scope, so a
/// `let` or a parameter of the same name there does not compile. Here a second tool's
/// parameter is named like the first tool (the parameter is read as the unit struct: E0308):
///
/// ```compile_fail,E0308
/// use flue_runtime::prelude::*;
///
/// /// Search.
/// #[tool]
/// async fn query(text: String) -> String {
///     text
/// }
///
/// /// Look up.
/// #[tool]
/// async fn lookup(query: String) -> String {
///     query
/// }
/// ```
///
/// rustc reads the parameter `query` as the pattern `query` (the tool) and reports
/// `mismatched types`; name one of the two apart (`async fn lookup(search: String)`, or
/// `#[tool(name = "query")] async fn query_tool(…)`). A parameter named like its own tool, agent
/// or hook (`async fn echo(echo: String)`) is reported by the attribute itself. As with
/// `#[agent]`, the struct is a type name too: a module or type of the same name in its scope
/// clashes with it (E0255).
///
/// A render hook (`use_model`, …) called in the body does not compile: a tool runs after the
/// render that mounted it, where every hook call panics (a plain closure is not searched: it
/// may be an agent function some render calls).
#[proc_macro_attribute]
pub fn tool(args: TokenStream, item: TokenStream) -> TokenStream {
    tool::expand(args.into(), item.into()).into()
}

#[cfg(test)]
mod expansion_snapshots {
    //! "What it expands to", committed under `tests/expand/`. Regenerate with
    //! `FLUE_BLESS=1 cargo test -p flue-macros` and review the diff.

    use proc_macro2::TokenStream;
    use quote::quote;

    fn check(name: &str, expanded: TokenStream) {
        let file = syn::parse2::<syn::File>(expanded).expect("the expansion parses as a file");
        let pretty = prettyplease::unparse(&file);
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/expand/{name}.expanded.rs"));
        if std::env::var_os("FLUE_BLESS").is_some() {
            std::fs::write(&path, &pretty).expect("writes the snapshot");
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert_eq!(pretty, committed, "{name}: expansion differs from {}", path.display());
    }

    #[test]
    fn agent_expansion() {
        let expanded = crate::agent::expand(
            quote!(max_steps = 6, hooks = [redact_emails]),
            quote! {
                /// Finds duplicate GitHub issues.
                fn duplicate_finder() -> &'static str {
                    use_model("openrouter/anthropic/claude-sonnet-4.5");
                    use_tool(get_github_issue);
                    "You check whether a GitHub issue duplicates an older open issue."
                }
            },
        );
        check("agent", expanded);
    }

    #[test]
    fn tool_expansion() {
        let expanded = crate::tool::expand(
            quote!(progress_argument = "query", secrets = ["GITHUB_TOKEN"]),
            quote! {
                /// Search the open issues in a public GitHub repository.
                async fn search_github_issues(
                    ctx: &ToolContext,
                    /// Repository owner
                    owner: String,
                    /// Words from the issue title or text
                    query: String,
                ) -> Result<String, ToolError> {
                    Ok(format!("{owner}: {query}"))
                }
            },
        );
        check("tool", expanded);
    }

    #[test]
    fn hook_expansion() {
        let expanded = crate::hook::expand(
            quote!(before_store_tool_result),
            quote! {
                async fn redact_emails(_state: &ThreadState, _call: &ToolCall, result: ToolResult) -> ToolResult {
                    result
                }
            },
        );
        check("hook", expanded);
    }
}
