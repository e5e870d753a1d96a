//! flue's render hooks (`use_model`, `use_tool`, …) as the macros see them in a body, and the
//! calls of them that can never run inside a render: a hook called there always panics with
//! "[flue] use_…() was called outside an agent function", which the macros report at compile
//! time instead, at the call.
//!
//! - A `#[tool]` or `#[hook]` body never runs in a render: the runtime calls it while the
//!   agent responds, after the render that mounted or selected it.
//! - In an `#[agent]` body, an `async` block or closure runs when something polls it, after
//!   the synchronous render; a callback given to `use_agent_start`, `use_agent_finish`,
//!   `use_response_start` or `use_response_finish` runs at its seam, after the render; a
//!   closure given to `thread::spawn` (or a bare `spawn`), or to a `spawn` or `spawn_scoped`
//!   method (a `thread::scope`'s, a `thread::Builder`'s), runs on another thread, whose hooks
//!   see no render.
//!
//! A plain closure in a tool or hook body is not searched: it may be an agent function itself
//! (`FnAgent`) that some render calls. Nested items, and calls, `let`s and macros under `cfg`
//! (which may not be compiled), are not searched either. Of macros, only the arguments of the
//! standard library's that take expressions (`format!`, `vec!`, `assert!`, …) are searched:
//! another macro's tokens need not be Rust expressions at all.
//!
//! In the render itself, a hook given a literal its rules refuse (a blank instruction, state
//! or data part name) fails every render that reaches the call, and a model specifier that is
//! not `provider-id/model-id` fails the submission whose render picks it: both are reported
//! too.

use syn::visit::Visit;
use syn::{Expr, ExprCall};

use crate::errors::Errors;

/// Every hook of flue's, with the name its own panics give it.
const HOOKS: [(&str, &str); 21] = [
    ("use_agent_finish", "use_agent_finish"),
    ("use_agent_start", "use_agent_start"),
    ("use_data_writer", "use_data_writer"),
    ("use_data_writer_with_schema", "use_data_writer"),
    ("use_delivery", "use_delivery"),
    ("use_dispatch_message", "use_dispatch_message"),
    ("use_hooks", "use_hooks"),
    ("use_initial_data", "use_initial_data"),
    ("use_instruction", "use_instruction"),
    ("use_mcp_connection", "use_mcp_connection"),
    ("use_model", "use_model"),
    ("use_model_with", "use_model"),
    ("use_persistent_state", "use_persistent_state"),
    ("use_persistent_state_opt", "use_persistent_state"),
    ("use_response_finish", "use_response_finish"),
    ("use_response_start", "use_response_start"),
    ("use_sandbox", "use_sandbox"),
    ("use_sandbox_with", "use_sandbox"),
    ("use_skill", "use_skill"),
    ("use_subagent", "use_subagent"),
    ("use_tool", "use_tool"),
];

/// The hooks whose callback runs after the render, at a seam of the response.
const SEAM_CALLBACKS: [&str; 4] = [
    "use_agent_start",
    "use_agent_finish",
    "use_response_start",
    "use_response_finish",
];

/// Why a closure given to a thread's `spawn` runs outside the render.
const SPAWNED: &str = "a closure given to `spawn` runs on a thread of its own, where no render is";

/// The crates a path to one of flue's hooks starts with (`flue_runtime::prelude::use_model`).
const FLUE_CRATES: [&str; 4] = ["flue", "flue_runtime", "flue_core", "__flue"];

/// The flue hook `call` calls (its function's name), if it calls one: a bare name or a path
/// into a flue crate. A function of the user's own named like a hook is only taken for one
/// when it is called bare (`self::use_skill(..)` calls it unmistakably).
pub(crate) fn hook_called(call: &ExprCall) -> Option<&'static str> {
    hook_and_panic_name(call).map(|(hook, _)| hook)
}

/// [`hook_called`], with the name the hook's own panics give it.
fn hook_and_panic_name(call: &ExprCall) -> Option<(&'static str, &'static str)> {
    let Expr::Path(function) = &*call.func else {
        return None;
    };
    if function.qself.is_some() {
        return None;
    }
    let segments = &function.path.segments;
    let last = segments.last()?.ident.to_string();
    let hook = HOOKS.into_iter().find(|(hook, _)| *hook == last)?;
    let bare = segments.len() == 1 && function.path.leading_colon.is_none();
    let in_flue = segments.len() > 1
        && segments
            .first()
            .is_some_and(|first| FLUE_CRATES.iter().any(|name| first.ident == name));
    (bare || in_flue).then_some(hook)
}

/// Where a body runs.
#[derive(Clone, Copy)]
pub(crate) enum Body {
    /// An `#[agent]` function: its render.
    Agent,
    /// A `#[tool]` function.
    Tool,
    /// A `#[hook]` function.
    LifecycleHook,
}

/// Reports the hook calls in `block` that can never run inside a render.
pub(crate) fn check_outside_render(block: &syn::Block, body: Body, errors: &Errors) {
    let mut calls = Calls {
        errors,
        outside: match body {
            Body::Agent => None,
            Body::Tool => Some("a tool runs after the render that mounted it"),
            Body::LifecycleHook => Some("a lifecycle hook runs after the render that selected it"),
        },
        advice: match body {
            Body::Agent => {
                "call it in the agent function's body itself, which the render runs on its own thread (or in a custom hook the body calls)"
            }
            Body::Tool => {
                "call it in the agent function that mounts the tool; a tool gets what it needs from its arguments and its `ToolContext`"
            }
            Body::LifecycleHook => {
                "call it in the agent function that selects the hook; a lifecycle hook gets what it needs from its parameters"
            }
        },
    };
    calls.visit_block(block);
}

struct Calls<'a> {
    errors: &'a Errors,
    /// Why the code being visited runs outside any render; `None` while it is the render.
    outside: Option<&'static str>,
    /// Where the call belongs instead.
    advice: &'static str,
}

impl Calls<'_> {
    fn run_outside(&mut self, why: &'static str, visit: impl FnOnce(&mut Self)) {
        let render = self.outside.replace(why);
        visit(self);
        self.outside = render;
    }

    /// The arguments of a call that runs a closure among them later or elsewhere (a seam's
    /// callback, a spawned thread's body), for `why`: the closure's body runs outside the
    /// render, anything else is evaluated here, in the render (a function that makes the
    /// closure, say).
    fn visit_callbacks<'e>(&mut self, arguments: impl Iterator<Item = &'e Expr>, why: &'static str) {
        for argument in arguments {
            match argument {
                Expr::Closure(closure) => self.run_outside(why, |calls| calls.visit_expr(&closure.body)),
                other => self.visit_expr(other),
            }
        }
    }
}

/// Whether `function` spawns a thread: `std::thread::spawn` (called bare once imported, as
/// `thread::spawn`, or by its full path), a `thread::Builder`'s `spawn` or `spawn_scoped` called
/// by its path, or a bare `spawn` (a thread pool's, imported).
fn spawns_thread(function: &Expr) -> bool {
    let Expr::Path(path) = function else {
        return false;
    };
    let names: Vec<String> = path
        .path
        .segments
        .iter()
        .map(|segment| segment.ident.to_string())
        .collect();
    match names.as_slice() {
        [only] => only == "spawn",
        [.., parent, last] => {
            (parent == "thread" && last == "spawn")
                || (parent == "Builder" && (last == "spawn" || last == "spawn_scoped"))
        }
        [] => false,
    }
}

impl<'ast> Visit<'ast> for Calls<'_> {
    fn visit_local(&mut self, local: &'ast syn::Local) {
        if !configured(&local.attrs) {
            syn::visit::visit_local(self, local);
        }
    }

    fn visit_expr_call(&mut self, call: &'ast ExprCall) {
        // Under `cfg`, the call may not be compiled at all (the attribute sees it before `cfg`
        // applies).
        if configured(&call.attrs) {
            return;
        }
        let called = hook_and_panic_name(call);
        let hook = called.map(|(hook, _)| hook);
        if let (Some((hook, panics_as)), Some(why)) = (called, self.outside) {
            let bare = matches!(&*call.func, Expr::Path(function) if function.path.segments.len() == 1);
            let own = if bare {
                format!("; if `{hook}` is a function of your own, call it by its path (`self::{hook}(..)`)")
            } else {
                String::new()
            };
            self.errors.spanned(
                &call.func,
                format!(
                    "`{hook}` is a hook, and hooks run only while an agent function renders: {why}, so this call would always panic with \"[flue] {panics_as}() was called outside an agent function\"; {}{own}",
                    self.advice
                ),
            );
        }
        if let Some(hook) = hook
            && self.outside.is_none()
            && let Some((literal, message)) = refused_literal(hook, call)
        {
            self.errors.spanned(literal, message);
        }
        if let Some(hook) = hook
            && SEAM_CALLBACKS.contains(&hook)
        {
            self.visit_expr(&call.func);
            self.visit_callbacks(call.args.iter(), "a seam's callback runs after the render");
            return;
        }
        // In the render only: in a tool or hook body, a plain closure is not searched (see the
        // module's docs), one given to `spawn` included.
        if self.outside.is_none() && spawns_thread(&call.func) {
            self.visit_expr(&call.func);
            self.visit_callbacks(call.args.iter(), SPAWNED);
            return;
        }
        syn::visit::visit_expr_call(self, call);
    }

    fn visit_expr_method_call(&mut self, call: &'ast syn::ExprMethodCall) {
        // A thread's `spawn` (`thread::Builder`'s, `spawn_scoped` too, a `thread::scope`'s, a
        // pool's): its closure runs on another thread, where no render is. In the render only,
        // as above.
        if self.outside.is_none()
            && (call.method == "spawn" || call.method == "spawn_scoped")
            && !configured(&call.attrs)
        {
            self.visit_expr(&call.receiver);
            self.visit_callbacks(call.args.iter(), SPAWNED);
            return;
        }
        syn::visit::visit_expr_method_call(self, call);
    }

    fn visit_expr_async(&mut self, block: &'ast syn::ExprAsync) {
        self.run_outside(
            "an async block runs when it is polled, after the synchronous render",
            |calls| {
                syn::visit::visit_expr_async(calls, block);
            },
        );
    }

    fn visit_expr_closure(&mut self, closure: &'ast syn::ExprClosure) {
        if closure.asyncness.is_some() {
            self.run_outside(
                "an async closure's body runs when it is polled, after the synchronous render",
                |calls| {
                    calls.visit_expr(&closure.body);
                },
            );
        } else if self.outside.is_none() {
            // In a render, a plain closure may run in it (an iterator's, a custom hook's).
            syn::visit::visit_expr_closure(self, closure);
        }
        // Outside one, a plain closure may be an agent function that some render calls.
    }

    fn visit_item(&mut self, _item: &'ast syn::Item) {}

    fn visit_stmt_macro(&mut self, mac: &'ast syn::StmtMacro) {
        if !configured(&mac.attrs) {
            syn::visit::visit_stmt_macro(self, mac);
        }
    }

    fn visit_expr_macro(&mut self, mac: &'ast syn::ExprMacro) {
        if !configured(&mac.attrs) {
            syn::visit::visit_expr_macro(self, mac);
        }
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        for argument in macro_arguments(mac).unwrap_or_default() {
            self.visit_expr(&argument);
        }
    }
}

/// The standard library's macros whose arguments are expressions (a format string first, for
/// some), which run where the macro is called.
const EXPRESSION_MACROS: [&str; 20] = [
    "assert",
    "assert_eq",
    "assert_ne",
    "dbg",
    "debug_assert",
    "debug_assert_eq",
    "debug_assert_ne",
    "eprint",
    "eprintln",
    "format",
    "format_args",
    "panic",
    "print",
    "println",
    "todo",
    "unimplemented",
    "unreachable",
    "vec",
    "write",
    "writeln",
];

/// The arguments of `mac`, when it is one of [`EXPRESSION_MACROS`] (called bare, or by a path
/// into `std`, `core` or `alloc`) and they parse as expressions (`vec![value; count]` too).
fn macro_arguments(mac: &syn::Macro) -> Option<Vec<Expr>> {
    use syn::parse::Parser;
    let segments = &mac.path.segments;
    let last = segments.last()?;
    let standard = (segments.len() == 1 && mac.path.leading_colon.is_none())
        || segments
            .first()
            .is_some_and(|first| ["std", "core", "alloc"].iter().any(|name| first.ident == name));
    if !standard || !EXPRESSION_MACROS.iter().any(|name| last.ident == name) {
        return None;
    }
    let listed = syn::punctuated::Punctuated::<Expr, syn::Token![,]>::parse_terminated;
    if let Ok(arguments) = listed.parse2(mac.tokens.clone()) {
        return Some(arguments.into_iter().collect());
    }
    let repeated = |input: syn::parse::ParseStream<'_>| {
        let value: Expr = input.parse()?;
        input.parse::<syn::Token![;]>()?;
        let count: Expr = input.parse()?;
        Ok(vec![value, count])
    };
    (last.ident == "vec")
        .then(|| repeated.parse2(mac.tokens.clone()).ok())
        .flatten()
}

/// The first argument of `call` to `hook`, when it is a string literal the hook refuses, with
/// what it would fail with.
fn refused_literal<'a>(hook: &str, call: &'a ExprCall) -> Option<(&'a syn::LitStr, String)> {
    let Some(Expr::Lit(syn::ExprLit {
        lit: syn::Lit::Str(literal),
        ..
    })) = call.args.first()
    else {
        return None;
    };
    let text = literal.value();
    let fails = |message: &str| format!("every render that reaches this call would fail with \"{message}\"");
    let message = match hook {
        "use_model" | "use_model_with" if text.trim().is_empty() => {
            fails("[flue] use_model() requires a model specifier string, like 'anthropic/claude-sonnet-4-6'.")
        }
        "use_model" | "use_model_with"
            if text
                .split_once('/')
                .is_none_or(|(provider, model)| provider.trim().is_empty() || model.trim().is_empty()) =>
        {
            format!(
                "a submission whose render picks this model would fail with \"[flue] The agent model \"{text}\" could not be resolved: use \"provider-id/model-id\".\""
            )
        }
        "use_persistent_state" | "use_persistent_state_opt" if text.is_empty() => fails(
            "[flue] use_persistent_state(name, default) takes the state name as its first argument — a non-empty string.",
        ),
        "use_data_writer" | "use_data_writer_with_schema" if text.is_empty() => {
            fails("[flue] use_data_writer(name) takes the data part name as its first argument — a non-empty string.")
        }
        "use_instruction" if text.trim().is_empty() => fails("[flue] use_instruction() requires a non-empty string."),
        _ => return None,
    };
    Some((literal, message))
}

/// Whether `attrs` make their item conditional on the build (`cfg`, `cfg_attr`).
pub(crate) fn configured(attrs: &[syn::Attribute]) -> bool {
    attrs
        .iter()
        .any(|attr| attr.path().is_ident("cfg") || attr.path().is_ident("cfg_attr"))
}

#[cfg(test)]
mod tests {
    use super::HOOKS;

    /// The hooks flue-core exports (`pub fn use_…` in its `hooks` module) and the names their
    /// panics give them (`hook("use_…", …)`), read from its source.
    fn flue_core_hooks() -> (Vec<String>, Vec<String>) {
        let directory = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../flue-core/src/hooks");
        let (mut exported, mut panic_names) = (Vec::new(), Vec::new());
        for entry in std::fs::read_dir(directory).expect("flue-core's hooks") {
            let text = std::fs::read_to_string(entry.expect("an entry").path()).expect("a hook's source");
            for line in text.lines() {
                if let Some(rest) = line.strip_prefix("pub fn use_") {
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    exported.push(format!("use_{name}"));
                }
                if let Some((_, rest)) = line.split_once("hook(\"") {
                    panic_names.extend(rest.split_once('"').map(|(name, _)| name.to_owned()));
                }
            }
        }
        exported.sort();
        (exported, panic_names)
    }

    #[test]
    fn the_macros_know_every_hook_flue_core_exports_by_the_name_its_panics_give_it() {
        let (exported, panic_names) = flue_core_hooks();
        let mut known: Vec<String> = HOOKS.iter().map(|(hook, _)| (*hook).to_owned()).collect();
        known.sort();
        assert_eq!(known, exported, "render_hooks::HOOKS must list every hook of flue-core");
        for (hook, panics_as) in HOOKS {
            assert!(
                panic_names.iter().any(|name| name == panics_as),
                "{hook}: flue-core has no hook(\"{panics_as}\", …)"
            );
        }
    }
}
