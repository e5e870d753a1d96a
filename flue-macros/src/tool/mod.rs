//! `#[tool]`: parse → model → validate → expand.

mod expand;
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
    let model = model::ToolModel::build(function, options, &errors);
    validate::check(&model, &errors);
    let expanded = expand::tool(&model);
    let mut output = errors.finish();
    output.extend(expanded);
    output
}
