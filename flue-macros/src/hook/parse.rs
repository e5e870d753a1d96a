//! Parsing `#[hook(kind, id = "…", crate = "…")]`.

use proc_macro2::TokenStream;
use syn::parse::{Parse, ParseStream, Parser};
use syn::{Ident, LitStr, Token};

use crate::errors::Errors;

pub(crate) struct Options {
    pub(crate) kind: Option<Ident>,
    pub(crate) id: Option<LitStr>,
    pub(crate) krate: Option<syn::Path>,
    /// The arguments did not parse (reported): what came before the error is kept, and no
    /// missing kind is reported on top of it.
    pub(crate) malformed: bool,
}

enum Arg {
    Kind(Ident),
    KeyValue(Ident, LitStr),
}

impl Parse for Arg {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        if input.peek(LitStr) {
            let kind: LitStr = input.parse()?;
            return Err(syn::Error::new(
                kind.span(),
                format!(
                    "the hook kind comes first, bare, not as a string: write `#[hook({})]`",
                    kind.value()
                ),
            ));
        }
        let key: Ident = input.call(syn::ext::IdentExt::parse_any)?;
        if input.peek(Token![=]) {
            input.parse::<Token![=]>()?;
            let value = input.parse::<LitStr>().map_err(|error| {
                let message = match key.to_string().as_str() {
                    "id" => "#[hook] option `id` takes a string: write `id = \"my_hook\"`".to_owned(),
                    "crate" => "#[hook] option `crate` takes a string: write `crate = \"flue_runtime\"`".to_owned(),
                    "kind" => "the hook kind comes first, bare: write `#[hook(filter_messages)]` (the kind's name, not `kind = …`)"
                        .to_owned(),
                    _ => format!("unknown #[hook] option `{key}`; expected one of: `id`, `crate`"),
                };
                syn::Error::new(
                    if key == "id" || key == "crate" {
                        error.span()
                    } else {
                        key.span()
                    },
                    message,
                )
            })?;
            Ok(Arg::KeyValue(key, value))
        } else {
            Ok(Arg::Kind(key))
        }
    }
}

pub(crate) fn options(args: TokenStream, errors: &Errors) -> Options {
    let mut options = Options {
        kind: None,
        id: None,
        krate: None,
        malformed: false,
    };
    // One argument at a time, so a malformed one keeps those before it (the kind).
    let mut parsed = Vec::new();
    let parser = |input: ParseStream<'_>| -> syn::Result<()> {
        while !input.is_empty() {
            parsed.push(input.parse::<Arg>()?);
            if !input.is_empty() {
                input.parse::<Token![,]>()?;
            }
        }
        Ok(())
    };
    if let Err(error) = parser.parse2(args) {
        errors.push(error);
        options.malformed = true;
    }
    for arg in parsed {
        match arg {
            // An option written without its value, not a kind.
            Arg::Kind(key) if key == "id" || key == "crate" => {
                let example = if key == "id" { "\"my_hook\"" } else { "\"flue_runtime\"" };
                errors.spanned(
                    &key,
                    format!("#[hook] option `{key}` takes a value: write `{key} = {example}`"),
                );
            }
            Arg::Kind(kind) if options.kind.is_none() => options.kind = Some(kind),
            Arg::Kind(kind) => errors.spanned(&kind, "a hook has one kind; remove the second"),
            Arg::KeyValue(key, value) => match key.to_string().as_str() {
                "id" if options.id.is_none() => options.id = Some(value),
                "crate" if options.krate.is_none() => match value.parse::<syn::Path>() {
                    Ok(path) => options.krate = Some(path),
                    Err(_) => errors.spanned(&value, "`crate` must name a path, like \"flue_runtime\""),
                },
                "id" | "crate" => errors.spanned(&key, format!("duplicate #[hook] option `{key}`")),
                "kind" => errors.spanned(
                    &key,
                    format!("the hook kind comes first, bare: write `#[hook({})]`", value.value()),
                ),
                _ => errors.spanned(
                    &key,
                    format!("unknown #[hook] option `{key}`; expected one of: `id`, `crate`"),
                ),
            },
        }
    }
    options
}
