//! Parsing the attribute's options. Unknown keys list the valid ones; duplicates are errors.

use proc_macro2::TokenStream;
use syn::parse::Parser;
use syn::spanned::Spanned;
use syn::{Expr, Ident, LitInt, LitStr, Token, Type};

use crate::errors::Errors;

pub(crate) const OPTIONS: &[&str] = &[
    "name",
    "description",
    "initial_data",
    "durability",
    "max_steps",
    "hooks",
    "expose_as_tool",
    "parent_hooks",
    "crate",
];

/// The options as written, before validation.
#[derive(Default)]
pub(crate) struct Options {
    pub(crate) name: Option<LitStr>,
    pub(crate) description: Option<LitStr>,
    pub(crate) initial_data: Option<Type>,
    pub(crate) max_attempts: Option<LitInt>,
    pub(crate) timeout: Option<LitStr>,
    pub(crate) max_steps: Option<LitInt>,
    pub(crate) hooks: Option<Vec<Expr>>,
    /// As written (`expose_as_tool = false` included, so a repeated flag is reported): see
    /// [`Options::exposed_as_tool`].
    pub(crate) expose_as_tool: Option<bool>,
    pub(crate) parent_hooks: Option<Vec<ParentHook>>,
    pub(crate) krate: Option<syn::Path>,
}

impl Options {
    /// Whether the agent may be used as a delegate: `expose_as_tool`, or `= true`.
    pub(crate) fn exposed_as_tool(&self) -> bool {
        self.expose_as_tool == Some(true)
    }
}

pub(crate) struct ParentHook {
    pub(crate) hook: Expr,
    pub(crate) stage: syn::Ident,
    pub(crate) reason: LitStr,
}

fn set<T>(slot: &mut Option<T>, value: T, key: &syn::Path, errors: &Errors) {
    if slot.is_some() {
        errors.spanned(
            key,
            format!(
                "duplicate #[agent] option `{}`",
                key.get_ident().map(ToString::to_string).unwrap_or_default()
            ),
        );
    } else {
        *slot = Some(value);
    }
}

pub(crate) fn options(args: TokenStream, errors: &Errors) -> Options {
    let mut options = Options::default();
    let parser = syn::meta::parser(|meta| {
        let key = meta.path.clone();
        let name = key.get_ident().map(ToString::to_string).unwrap_or_default();
        match name.as_str() {
            "name" => {
                if let Some(value) = crate::option_value(&meta, "agent", errors, "a string", "name = \"support\"")? {
                    set(&mut options.name, value, &key, errors);
                }
            }
            "description" => {
                if let Some(value) = crate::option_value(
                    &meta,
                    "agent",
                    errors,
                    "a string",
                    "description = \"Answers support questions.\"",
                )? {
                    set(&mut options.description, value, &key, errors);
                }
            }
            "initial_data" => {
                if let Some(value) = crate::option_value(
                    &meta,
                    "agent",
                    errors,
                    "a type, not a string",
                    "initial_data = Customer",
                )? {
                    set(&mut options.initial_data, value, &key, errors);
                }
            }
            "max_steps" => {
                if let Some(value) = crate::option_value(&meta, "agent", errors, "a positive integer", "max_steps = 6")?
                {
                    set(&mut options.max_steps, value, &key, errors);
                }
            }
            "expose_as_tool" => set(&mut options.expose_as_tool, crate::flag(&meta)?, &key, errors),
            "crate" => {
                let path: LitStr = meta.value()?.parse()?;
                match path.parse::<syn::Path>() {
                    Ok(parsed) => set(&mut options.krate, parsed, &key, errors),
                    Err(_) => errors.spanned(&path, "`crate` must name a path, like \"flue_runtime\""),
                }
            }
            "hooks" => {
                if let Some(list) = crate::option_value::<syn::ExprArray>(
                    &meta,
                    "agent",
                    errors,
                    "a list of hooks",
                    "hooks = [redact_secrets]",
                )? {
                    set(&mut options.hooks, list.elems.into_iter().collect(), &key, errors);
                }
            }
            "durability" => meta.parse_nested_meta(|inner| {
                let inner_key = inner.path.clone();
                match inner_key.get_ident().map(ToString::to_string).as_deref() {
                    Some("max_attempts") => {
                        if let Some(value) = crate::option_value(
                            &inner,
                            "agent",
                            errors,
                            "a positive integer",
                            "durability(max_attempts = 3)",
                        )? {
                            set(&mut options.max_attempts, value, &inner_key, errors);
                        }
                    }
                    Some("timeout") => {
                        if let Some(value) = crate::option_value(
                            &inner,
                            "agent",
                            errors,
                            "a duration string",
                            "durability(timeout = \"90s\")",
                        )? {
                            set(&mut options.timeout, value, &inner_key, errors);
                        }
                    }
                    _ => {
                        if inner.input.peek(Token![=]) {
                            let _: Expr = inner.value()?.parse()?;
                        }
                        errors.spanned(
                            &inner_key,
                            "unknown durability option; expected one of: `max_attempts`, `timeout`",
                        );
                    }
                }
                Ok(())
            })?,
            "parent_hooks" => {
                let Some(list) = crate::option_value::<syn::ExprArray>(
                    &meta,
                    "agent",
                    errors,
                    "a list of `(hook, \"reason\")` or `(hook, stage, \"reason\")`",
                    "parent_hooks = [(redact_secrets, \"children must not leak tokens\")]",
                )?
                else {
                    return Ok(());
                };
                let mut requirements = Vec::new();
                for element in list.elems {
                    match parent_hook(element) {
                        Ok(requirement) => requirements.push(requirement),
                        Err(error) => errors.push(error),
                    }
                }
                set(&mut options.parent_hooks, requirements, &key, errors);
            }
            _ => {
                if meta.input.peek(Token![=]) {
                    let _: Expr = meta.value()?.parse()?;
                }
                errors.spanned(
                    &key,
                    format!(
                        "unknown #[agent] option `{name}`; expected one of: {}",
                        OPTIONS
                            .iter()
                            .map(|option| format!("`{option}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                );
            }
        }
        Ok(())
    });
    if let Err(error) = parser.parse2(args) {
        errors.push(error);
    }
    options
}

fn parent_hook(element: Expr) -> syn::Result<ParentHook> {
    let shape = "each parent hook is `(hook, \"reason\")` or `(hook, stage, \"reason\")`, with stage `before_parent` or `after_parent` (the default)";
    let Expr::Tuple(tuple) = element else {
        return Err(syn::Error::new_spanned(element, shape));
    };
    let parts: Vec<Expr> = tuple.elems.iter().cloned().collect();
    let (hook, stage, reason) = match <[Expr; 2]>::try_from(parts) {
        // The stage defaults to `after_parent`, as the reference's does.
        Ok([hook, reason]) => (hook, Ident::new("after_parent", tuple.span()), reason),
        Err(parts) => {
            let Ok([hook, stage, reason]) = <[Expr; 3]>::try_from(parts) else {
                return Err(syn::Error::new_spanned(tuple, shape));
            };
            let stage = match stage {
                Expr::Path(path) if path.path.get_ident().is_some() => path
                    .path
                    .get_ident()
                    .cloned()
                    .ok_or_else(|| syn::Error::new_spanned(&path, shape))?,
                other => return Err(syn::Error::new_spanned(other, shape)),
            };
            (hook, stage, reason)
        }
    };
    let reason = match reason {
        Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Str(reason),
            ..
        }) => reason,
        other => {
            return Err(syn::Error::new_spanned(
                other,
                "the reason of a parent hook is a string literal",
            ));
        }
    };
    Ok(ParentHook { hook, stage, reason })
}
