//! flue's render hooks (`use_model`, `use_tool`, …) as the macros see them in a body, and the
//! calls of them that can never run inside a render: a hook called there always panics with
//! "[flue] use_…() was called outside an agent function", which the macros report at compile
//! time instead, at the call.
//!
//! - A `#[tool]` or `#[hook]` body never runs in a render: the runtime calls it while the
//!   agent responds, after the render that mounted or selected it.
//! - In an `#[agent]` body, an `async` block or closure runs when something polls it, after
//!   the synchronous render; a callback given to `use_agent_start`, `use_agent_finish`,
//!   `use_response_start` or `use_response_finish` runs at its seam, after the render.
//!
//! A plain closure in a tool or hook body is not searched: it may be an agent function itself
//! (`FnAgent`) that some render calls. Nested items are not searched either.

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

/// The flue hook `call` calls (its function's name), if it calls one: a bare name or a path
/// into a flue crate (`flue_runtime::prelude::use_model`). A function of the user's own named
/// like a hook is only taken for one when it is called bare.
pub(crate) fn hook_called(call: &ExprCall) -> Option<&'static str> {
    let Expr::Path(function) = &*call.func else {
        return None;
    };
    if function.qself.is_some() {
        return None;
    }
    let segments = &function.path.segments;
    let last = segments.last()?.ident.to_string();
    let (hook, _) = HOOKS.into_iter().find(|(hook, _)| *hook == last)?;
    let bare = segments.len() == 1 && function.path.leading_colon.is_none();
    let in_flue = segments
        .first()
        .is_some_and(|first| first.ident.to_string().starts_with("flue"));
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
            Body::Agent => "call it in the agent function's body (or in a custom hook the body calls)",
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
    fn outside(&mut self, why: &'static str, visit: impl FnOnce(&mut Self)) {
        let render = self.outside.replace(why);
        visit(self);
        self.outside = render;
    }
}

impl<'ast> Visit<'ast> for Calls<'_> {
    fn visit_expr_call(&mut self, call: &'ast ExprCall) {
        let hook = hook_called(call);
        if let (Some(hook), Some(why)) = (hook, self.outside) {
            let panics_as = HOOKS
                .iter()
                .find(|(name, _)| *name == hook)
                .map_or(hook, |(_, panics_as)| panics_as);
            self.errors.spanned(
                &call.func,
                format!(
                    "`{hook}` is a hook, and hooks run only while an agent function renders: {why}, so this call would always panic with \"[flue] {panics_as}() was called outside an agent function\"; {}",
                    self.advice
                ),
            );
        }
        if let Some(hook) = hook
            && SEAM_CALLBACKS.contains(&hook)
        {
            self.visit_expr(&call.func);
            for argument in &call.args {
                self.outside("a seam's callback runs after the render", |calls| {
                    match argument {
                        // The callback itself is the part that runs later.
                        Expr::Closure(callback) => calls.visit_expr(&callback.body),
                        other => calls.visit_expr(other),
                    }
                });
            }
            return;
        }
        syn::visit::visit_expr_call(self, call);
    }

    fn visit_expr_async(&mut self, block: &'ast syn::ExprAsync) {
        self.outside(
            "an async block runs when it is polled, after the synchronous render",
            |calls| {
                syn::visit::visit_expr_async(calls, block);
            },
        );
    }

    fn visit_expr_closure(&mut self, closure: &'ast syn::ExprClosure) {
        if closure.asyncness.is_some() {
            self.outside(
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
}
