//! Procedural macros of flue-rs. Use them through `flue_runtime` (`use flue_runtime::prelude::*`),
//! which re-exports them and everything their expansion needs.
//!
//! Each attribute is built as parse → model → validate → expand. Every problem of one item is
//! reported in one build, spanned on the smallest offending token, and the item is still
//! emitted beside the `compile_error!` so the rest of the crate keeps type-checking.

mod agent;
mod errors;

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
