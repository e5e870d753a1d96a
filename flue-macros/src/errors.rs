//! Error accumulation: every problem of an item, reported in one build.

use proc_macro2::TokenStream;
use quote::ToTokens;
use std::cell::RefCell;
use std::fmt::Display;

/// Collects spanned errors. Dropping it with unchecked errors is a bug in the macro, so it
/// panics (the serde `Ctxt` guard).
pub(crate) struct Errors {
    errors: RefCell<Option<Vec<syn::Error>>>,
}

impl Errors {
    pub(crate) fn new() -> Self {
        Self {
            errors: RefCell::new(Some(Vec::new())),
        }
    }

    pub(crate) fn push(&self, error: syn::Error) {
        if let Some(errors) = self.errors.borrow_mut().as_mut() {
            errors.push(error);
        }
    }

    pub(crate) fn spanned<T: ToTokens, M: Display>(&self, tokens: T, message: M) {
        self.push(syn::Error::new_spanned(tokens, message));
    }

    /// Consumes the collected errors as `compile_error!` tokens (empty when there are none).
    pub(crate) fn finish(self) -> TokenStream {
        let errors = self.errors.borrow_mut().take().unwrap_or_default();
        errors.into_iter().map(|error| error.to_compile_error()).collect()
    }
}

impl Drop for Errors {
    fn drop(&mut self) {
        if !std::thread::panicking() && self.errors.borrow().is_some() {
            panic!("flue-macros: errors were collected but never reported");
        }
    }
}

/// The shape every attribute shares: parse the function (on failure, report and re-emit the
/// item untouched), let `build` parse, model, validate and expand it, and emit the errors
/// beside the expansion so the rest of the crate keeps type-checking.
pub(crate) fn expand_function(
    item: TokenStream,
    build: impl FnOnce(syn::ItemFn, &Errors) -> TokenStream,
) -> TokenStream {
    let errors = Errors::new();
    let function: syn::ItemFn = match syn::parse2(item.clone()) {
        Ok(function) => function,
        Err(error) => {
            errors.push(error);
            let mut output = errors.finish();
            output.extend(item);
            return output;
        }
    };
    let expanded = build(function, &errors);
    let mut output = errors.finish();
    output.extend(expanded);
    output
}
