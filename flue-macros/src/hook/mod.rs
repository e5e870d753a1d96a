//! `#[hook(kind)]`: parse → model → validate → expand.

mod expand;
pub(crate) mod kinds;
mod model;
mod parse;
mod validate;

use proc_macro2::TokenStream;

use crate::errors::Errors;

pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
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
    let options = parse::options(args, &errors);
    let model = model::HookModel::build(function, options, &errors);
    if let Some(model) = &model {
        validate::check(model, &errors);
    }
    let mut output = errors.finish();
    if let Some(model) = model {
        output.extend(expand::hook(&model));
    }
    output
}
