//! The hook as the expansion sees it.

use proc_macro2::Span;
use syn::{Ident, ItemFn};

use super::kinds::{self, Kind};
use super::parse::Options;
use crate::errors::Errors;

pub(crate) struct HookModel {
    pub(crate) function: ItemFn,
    pub(crate) kind: &'static Kind,
    pub(crate) id: (String, Span),
    pub(crate) krate: syn::Path,
    /// The kind is missing or unknown (reported): the item is still emitted, as a hook whose
    /// body is not called, so its uses do not add errors of their own.
    pub(crate) stub: bool,
}

impl HookModel {
    /// The model; a stub when the kind is missing or unknown.
    pub(crate) fn build(function: ItemFn, options: Options, errors: &Errors) -> Self {
        let kind = match &options.kind {
            // The arguments did not parse before a kind: that error is the one to fix.
            None if options.malformed => None,
            None => {
                errors.push(syn::Error::new(
                    Span::call_site(),
                    format!(
                        "#[hook] needs a kind, like #[hook(filter_messages)]; one of: {}",
                        kinds::all_names()
                    ),
                ));
                None
            }
            Some(kind) => match kinds::find(&kind.to_string()) {
                Some(found) => Some(found),
                None => {
                    errors.spanned(
                        kind,
                        format!("unknown hook kind `{kind}`; expected one of: {}", kinds::all_names()),
                    );
                    None
                }
            },
        };
        let ident: &Ident = &function.sig.ident;
        let id = match &options.id {
            Some(id) => (id.value(), id.span()),
            None => (syn::ext::IdentExt::unraw(ident).to_string(), ident.span()),
        };
        let krate = crate::krate::runtime_path(options.krate);
        Self {
            stub: kind.is_none(),
            kind: kind.unwrap_or(kinds::STUB),
            function,
            id,
            krate,
        }
    }
}
