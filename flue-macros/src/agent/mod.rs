//! `#[agent]`: parse → model → validate → expand.

mod expand;
mod hook_calls;
mod model;
mod parse;
mod validate;

use proc_macro2::TokenStream;

pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    crate::errors::expand_function(item, |function, errors| {
        let options = parse::options(args, errors);
        let model = model::AgentModel::build(function, options, errors);
        validate::check(&model, errors);
        expand::agent(&model)
    })
}
