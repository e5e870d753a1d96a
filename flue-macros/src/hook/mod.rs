//! `#[hook(kind)]`: parse → model → validate → expand.

mod expand;
pub(crate) mod kinds;
mod model;
mod parse;
mod validate;

use proc_macro2::TokenStream;

pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    crate::errors::expand_function(item, |function, errors| {
        let options = parse::options(args, errors);
        // An unknown or missing kind leaves nothing sensible to expand.
        match model::HookModel::build(function, options, errors) {
            Some(model) => {
                validate::check(&model, errors);
                expand::hook(&model)
            }
            None => TokenStream::new(),
        }
    })
}
