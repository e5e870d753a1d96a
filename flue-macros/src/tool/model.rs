//! The tool as the expansion sees it.

use proc_macro2::Span;
use syn::{Attribute, FnArg, Ident, ItemFn, Pat, Type};

use super::parse::Options;
use crate::errors::Errors;

pub(crate) struct Field {
    pub(crate) ident: Ident,
    pub(crate) ty: Type,
    pub(crate) docs: Vec<Attribute>,
}

pub(crate) enum Arguments {
    /// One `args: T` parameter with `T: Deserialize + JsonSchema`.
    Struct(Type),
    /// Plain parameters: the macro builds the argument struct.
    Plain(Vec<Field>),
}

pub(crate) struct ToolModel {
    pub(crate) function: ItemFn,
    pub(crate) name: (String, Span),
    pub(crate) description: Option<String>,
    pub(crate) has_context: bool,
    pub(crate) arguments: Arguments,
    pub(crate) options: Options,
    pub(crate) krate: syn::Path,
}

impl ToolModel {
    pub(crate) fn build(mut function: ItemFn, mut options: Options, errors: &Errors) -> Self {
        let ident = function.sig.ident.clone();
        let name = match &options.name {
            Some(name) => (name.value(), name.span()),
            None => (syn::ext::IdentExt::unraw(&ident).to_string(), ident.span()),
        };
        let description = doc_text(&function.attrs);
        let krate = crate::krate::runtime_path(options.krate.take());
        let mut params: Vec<&mut syn::PatType> = Vec::new();
        for input in &mut function.sig.inputs {
            match input {
                FnArg::Typed(param) => params.push(param),
                FnArg::Receiver(receiver) => errors.spanned(receiver, "a tool is a free function, not a method"),
            }
        }
        let has_context = params.first().is_some_and(|param| is_context(&param.ty));
        let rest = if has_context { &mut params[1..] } else { &mut params[..] };
        let arguments = match rest {
            [single] if is_args_pattern(&single.pat) => Arguments::Struct((*single.ty).clone()),
            rest => Arguments::Plain(
                rest.iter_mut()
                    .filter_map(|param| {
                        // Doc comments on parameters become field descriptions; rustc does not
                        // accept them on parameters, so they are taken off here.
                        let (docs, others): (Vec<_>, Vec<_>) =
                            param.attrs.drain(..).partition(|attr| attr.path().is_ident("doc"));
                        param.attrs = others;
                        match param.pat.as_ref() {
                            Pat::Ident(pat) => Some(Field {
                                ident: pat.ident.clone(),
                                ty: (*param.ty).clone(),
                                docs,
                            }),
                            other => {
                                errors.spanned(
                                    other,
                                    "tool parameters are plain names (`query: String`), so they can be argument fields",
                                );
                                None
                            }
                        }
                    })
                    .collect(),
            ),
        };
        Self {
            function,
            name,
            description,
            has_context,
            arguments,
            options,
            krate,
        }
    }
}

/// `&ToolContext` (any path ending in `ToolContext`; the type system checks the rest).
fn is_context(ty: &Type) -> bool {
    match ty {
        Type::Reference(reference) => matches!(reference.elem.as_ref(), Type::Path(path)
            if path.path.segments.last().is_some_and(|segment| segment.ident == "ToolContext")),
        _ => false,
    }
}

fn is_args_pattern(pat: &Pat) -> bool {
    matches!(pat, Pat::Ident(ident) if ident.ident == "args" || ident.ident == "_args")
}

/// The doc comment's text, lines trimmed and joined, when there is one.
pub(crate) fn doc_text(attrs: &[Attribute]) -> Option<String> {
    let lines: Vec<String> = attrs
        .iter()
        .filter(|attr| attr.path().is_ident("doc"))
        .filter_map(|attr| match &attr.meta {
            syn::Meta::NameValue(syn::MetaNameValue {
                value:
                    syn::Expr::Lit(syn::ExprLit {
                        lit: syn::Lit::Str(text),
                        ..
                    }),
                ..
            }) => Some(text.value().trim().to_owned()),
            _ => None,
        })
        .collect();
    let text = lines.join("\n").trim().to_owned();
    (!text.is_empty()).then_some(text)
}
