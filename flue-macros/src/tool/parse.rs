//! Parsing `#[tool(name = "…", progress_argument = "…", secrets = [..], terminate, durable, crate = "…")]`.

use proc_macro2::TokenStream;
use syn::parse::Parser;
use syn::{Expr, LitStr, Token};

use crate::errors::Errors;

const OPTIONS: &[&str] = &["name", "progress_argument", "secrets", "terminate", "durable", "crate"];

#[derive(Default)]
pub(crate) struct Options {
    pub(crate) name: Option<LitStr>,
    pub(crate) progress_argument: Option<LitStr>,
    pub(crate) secrets: Option<Vec<LitStr>>,
    /// The `secrets` option was written wrong (reported): the body's reads are not checked
    /// against a list that is not what the author meant.
    pub(crate) secrets_malformed: bool,
    /// A flag as written (`terminate = false` included, so a repeated flag is reported).
    pub(crate) terminate: Option<bool>,
    pub(crate) durable: Option<bool>,
    pub(crate) krate: Option<syn::Path>,
}

fn set<T>(slot: &mut Option<T>, value: T, key: &syn::Path, errors: &Errors) {
    if slot.is_some() {
        let name = key.get_ident().map(ToString::to_string).unwrap_or_default();
        errors.spanned(key, format!("duplicate #[tool] option `{name}`"));
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
                if let Some(value) = crate::option_value(&meta, "tool", errors, "a string", "name = \"lookup\"")? {
                    set(&mut options.name, value, &key, errors);
                }
            }
            "progress_argument" => {
                if let Some(value) = crate::option_value(
                    &meta,
                    "tool",
                    errors,
                    "an argument's name as a string",
                    "progress_argument = \"query\"",
                )? {
                    set(&mut options.progress_argument, value, &key, errors);
                }
            }
            "terminate" => set(&mut options.terminate, crate::flag(&meta)?, &key, errors),
            "durable" => set(&mut options.durable, crate::flag(&meta)?, &key, errors),
            "secrets" => {
                let Some(list) = crate::option_value::<syn::ExprArray>(
                    &meta,
                    "tool",
                    errors,
                    "a list of environment variable names",
                    "secrets = [\"GITHUB_TOKEN\"]",
                )?
                else {
                    options.secrets_malformed = true;
                    return Ok(());
                };
                let mut secrets = Vec::new();
                for element in list.elems {
                    match element {
                        Expr::Lit(syn::ExprLit {
                            lit: syn::Lit::Str(secret),
                            ..
                        }) => secrets.push(secret),
                        other => {
                            options.secrets_malformed = true;
                            errors.spanned(other, "secrets are environment variable names as string literals");
                        }
                    }
                }
                set(&mut options.secrets, secrets, &key, errors);
            }
            "crate" => {
                let path: LitStr = meta.value()?.parse()?;
                match path.parse::<syn::Path>() {
                    Ok(parsed) => set(&mut options.krate, parsed, &key, errors),
                    Err(_) => errors.spanned(&path, "`crate` must name a path, like \"flue_runtime\""),
                }
            }
            _ => {
                if meta.input.peek(Token![=]) {
                    let _: Expr = meta.value()?.parse()?;
                }
                errors.spanned(
                    &key,
                    format!(
                        "unknown #[tool] option `{name}`; expected one of: {}",
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
