//! The hook calls an agent body makes on every render: its top-level statements. Whatever the
//! rules of hooks allow once per render, called twice there, fails every render that reaches
//! the second call; the macro reports it at compile time instead, at that call, with the
//! runtime's own words. Calls under a condition, a loop or a closure, and calls inside custom
//! hooks, are the runtime's to check: which of them run is only known when the agent renders.
//! So are statements under `cfg` (which may not be compiled) and those after one that leaves
//! the function (`return`, `panic!`).

use quote::ToTokens;
use syn::{Expr, ExprCall, Stmt};

use crate::errors::Errors;
use crate::render_hooks::configured;

pub(crate) fn check(block: &syn::Block, errors: &Errors) {
    let mut seen = Seen::default();
    for statement in &block.stmts {
        // A statement under `cfg` may not be compiled at all (the attribute sees it before
        // `cfg` applies): two calls under opposite `cfg`s are one call.
        let (expr, bound) = match statement {
            // Its names count as bound again either way: a repeat after it may be another value.
            Stmt::Local(local) => {
                let init = local.init.as_ref().filter(|_| !configured(&local.attrs));
                (init.map(|init| &*init.expr), Some(&local.pat))
            }
            Stmt::Expr(expr, _) => (Some(expr), None),
            // What follows a statement that leaves the function never runs with it.
            Stmt::Macro(mac) if diverges(&mac.mac) => return,
            _ => continue,
        };
        match expr {
            Some(Expr::Return(_)) => return,
            Some(Expr::Call(call)) if !configured(&call.attrs) => {
                if let Some(hook) = crate::render_hooks::hook_called(call) {
                    seen.call(hook, call, errors);
                }
            }
            _ => {}
        }
        // A name bound again is another value: a tool or hook of that name is another one.
        if let Some(pattern) = bound {
            let mut names = Bindings::default();
            syn::visit::Visit::visit_pat(&mut names, pattern);
            seen.tools.retain(|tool| !names.0.contains(tool));
            seen.hooks.retain(|hook| !names.0.contains(hook));
        }
    }
}

/// Whether a statement macro never returns (`panic!`, `unreachable!`, `todo!`,
/// `unimplemented!`).
fn diverges(mac: &syn::Macro) -> bool {
    mac.path.segments.last().is_some_and(|last| {
        ["panic", "unreachable", "todo", "unimplemented"]
            .iter()
            .any(|name| last.ident == name)
    })
}

/// The names a pattern binds.
#[derive(Default)]
struct Bindings(Vec<String>);

impl<'ast> syn::visit::Visit<'ast> for Bindings {
    fn visit_pat_ident(&mut self, pat: &'ast syn::PatIdent) {
        self.0.push(pat.ident.to_string());
        syn::visit::visit_pat_ident(self, pat);
    }
}

/// What the top-level statements so far selected, mounted or named.
#[derive(Default)]
struct Seen {
    model: bool,
    sandbox: bool,
    states: Vec<String>,
    data_parts: Vec<String>,
    tools: Vec<String>,
    hooks: Vec<String>,
}

impl Seen {
    fn call(&mut self, hook: &str, call: &ExprCall, errors: &Errors) {
        let first = call.args.first();
        match hook {
            "use_model" | "use_model_with" => {
                let repeated = std::mem::replace(&mut self.model, true);
                report(repeated, errors, &call.func, || {
                    runtime_says(
                        "use_model() was called twice in one render. An agent has one model; call use_model() exactly once (compute the specifier before the call if it depends on state).",
                    )
                });
            }
            "use_sandbox" | "use_sandbox_with" => {
                let repeated = std::mem::replace(&mut self.sandbox, true);
                report(repeated, errors, &call.func, || {
                    runtime_says(
                        "use_sandbox() was called twice in one render. An agent has one environment — attach it once, in the agent body or a single custom hook.",
                    )
                });
            }
            "use_persistent_state" | "use_persistent_state_opt" => {
                let Some(name) = first.and_then(string_literal) else {
                    return;
                };
                report(once(&mut self.states, &name.value()), errors, name, || {
                    runtime_says(&format!(
                        "Duplicate use_persistent_state name \"{}\" in one render. State names identify a value across renders and must be unique.",
                        name.value()
                    ))
                });
            }
            "use_data_writer" | "use_data_writer_with_schema" => {
                let Some(name) = first.and_then(string_literal) else {
                    return;
                };
                report(once(&mut self.data_parts, &name.value()), errors, name, || {
                    runtime_says(&format!(
                        "Duplicate use_data_writer name \"{}\" in one render. Data part names identify a part within the response and must be unique.",
                        name.value()
                    ))
                });
            }
            "use_tool" => {
                let Some(Expr::Path(tool)) = first else {
                    return;
                };
                report(once(&mut self.tools, &tokens(tool)), errors, tool, || {
                    format!(
                        "`{}` is mounted earlier too, and both run on every render: every render would fail with ToolNameConflictError (`Duplicate tool name`); mount it once",
                        tokens(tool)
                    )
                });
            }
            "use_hooks" => {
                let Some(Expr::Array(listed)) = first else {
                    return;
                };
                for hook in &listed.elems {
                    let Expr::Path(hook) = hook else {
                        continue;
                    };
                    report(once(&mut self.hooks, &tokens(hook)), errors, hook, || {
                        format!(
                            "`{}` is selected earlier too, and both run on every render: every render would fail with \"[flue] use_hooks() selected the lifecycle hook … twice in one render\"; select each hook once (hooks of one kind run in listed order)",
                            tokens(hook)
                        )
                    });
                }
            }
            _ => {}
        }
    }
}

/// Reports `message` at `tokens` when the call `repeated` an earlier one.
fn report<T: ToTokens>(repeated: bool, errors: &Errors, tokens: T, message: impl FnOnce() -> String) {
    if repeated {
        errors.spanned(tokens, message());
    }
}

fn string_literal(expr: &Expr) -> Option<&syn::LitStr> {
    match expr {
        Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Str(literal),
            ..
        }) => Some(literal),
        _ => None,
    }
}

/// Notes `name`; whether it was noted before.
fn once(names: &mut Vec<String>, name: &str) -> bool {
    if names.iter().any(|seen| seen == name) {
        return true;
    }
    names.push(name.to_owned());
    false
}

fn tokens(path: &syn::ExprPath) -> String {
    path.to_token_stream().to_string().replace(' ', "")
}

fn runtime_says(message: &str) -> String {
    format!(
        "this call repeats an earlier one, and both run on every render: every render would fail with \"[flue] {message}\""
    )
}
