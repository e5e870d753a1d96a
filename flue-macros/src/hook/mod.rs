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
        let model = model::HookModel::build(function, options, errors);
        // An unknown or missing kind has no signature to check the function against.
        if !model.stub {
            validate::check(&model, errors);
        }
        expand::hook(&model)
    })
}
