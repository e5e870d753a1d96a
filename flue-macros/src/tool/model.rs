//! The tool as the expansion sees it.

use proc_macro2::{Span, TokenStream, TokenTree};
use quote::ToTokens;
use syn::ext::IdentExt;
use syn::{Attribute, FnArg, Ident, ItemFn, Pat, Type};

use super::parse::Options;
use crate::errors::Errors;

pub(crate) struct Field {
    pub(crate) ident: Ident,
    pub(crate) ty: Type,
    pub(crate) docs: Vec<Attribute>,
}

impl Field {
    /// The name the model sends the argument under: the parameter's, without `r#`.
    pub(crate) fn json_name(&self) -> String {
        self.ident.unraw().to_string()
    }
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
            None => (ident.unraw().to_string(), ident.span()),
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

impl ToolModel {
    /// The generics of the tool's type: the function's without its lifetime parameters, the
    /// lifetimes' own where-predicates, and the outlives bounds that name them (`T: 'a`, which
    /// every type parameter of the tool meets at the call, where the body's lifetimes are
    /// inferred). A bound such as `T: Trait<'a>`, which the tool's type cannot express, names
    /// `'static` instead: [`misplaced_lifetimes`](Self::misplaced_lifetimes) reports it, and the
    /// rest of the expansion still type-checks.
    pub(crate) fn type_generics(&self) -> syn::Generics {
        let generics = &self.function.sig.generics;
        let declared = declared_lifetimes(generics);
        let keep = |bound: syn::TypeParamBound| match bound {
            syn::TypeParamBound::Lifetime(lifetime) if declared.contains(&lifetime.ident) => None,
            bound if lifetimes_in(bound.to_token_stream(), &declared).is_empty() => Some(bound),
            bound => syn::parse2(as_static(bound.to_token_stream(), &declared)).ok(),
        };
        let mut kept = generics.clone();
        kept.params = kept
            .params
            .into_iter()
            .filter_map(|param| match param {
                syn::GenericParam::Lifetime(_) => None,
                syn::GenericParam::Type(mut param) => {
                    param.bounds = std::mem::take(&mut param.bounds).into_iter().filter_map(keep).collect();
                    if param.bounds.is_empty() {
                        param.colon_token = None;
                    }
                    Some(syn::GenericParam::Type(param))
                }
                other => Some(other),
            })
            .collect();
        if let Some(clause) = &mut kept.where_clause {
            clause.predicates = std::mem::take(&mut clause.predicates)
                .into_iter()
                .filter_map(|predicate| match predicate {
                    syn::WherePredicate::Lifetime(_) => None,
                    syn::WherePredicate::Type(mut predicate) => {
                        predicate.bounds = std::mem::take(&mut predicate.bounds)
                            .into_iter()
                            .filter_map(keep)
                            .collect();
                        (!predicate.bounds.is_empty()).then_some(syn::WherePredicate::Type(predicate))
                    }
                    other => Some(other),
                })
                .collect();
        }
        kept
    }

    /// The function's lifetimes named in bounds of its type parameters other than outlives
    /// bounds (as in `T: Trait<'a>`), in order: the tool's type cannot take them.
    pub(crate) fn misplaced_lifetimes(&self) -> Vec<syn::Lifetime> {
        let generics = &self.function.sig.generics;
        let declared = declared_lifetimes(generics);
        if declared.is_empty() {
            return Vec::new();
        }
        let in_params = generics.type_params().flat_map(|param| &param.bounds);
        let in_clause = generics
            .where_clause
            .iter()
            .flat_map(|clause| &clause.predicates)
            .filter_map(|predicate| match predicate {
                syn::WherePredicate::Type(predicate) => Some(&predicate.bounds),
                _ => None,
            })
            .flatten();
        in_params
            .chain(in_clause)
            .filter(|bound| !matches!(bound, syn::TypeParamBound::Lifetime(_)))
            .flat_map(|bound| lifetimes_in(bound.to_token_stream(), &declared))
            .collect()
    }
}

fn declared_lifetimes(generics: &syn::Generics) -> Vec<Ident> {
    generics.lifetimes().map(|def| def.lifetime.ident.clone()).collect()
}

/// `tokens` with the lifetimes among `declared` replaced by `'static`.
fn as_static(tokens: TokenStream, declared: &[Ident]) -> TokenStream {
    let mut out = Vec::new();
    for token in tokens {
        match token {
            TokenTree::Group(group) => {
                let mut replaced = proc_macro2::Group::new(group.delimiter(), as_static(group.stream(), declared));
                replaced.set_span(group.span());
                out.push(TokenTree::Group(replaced));
            }
            TokenTree::Ident(ident)
                if matches!(out.last(), Some(TokenTree::Punct(quote)) if quote.as_char() == '\'')
                    && declared.contains(&ident) =>
            {
                out.push(TokenTree::Ident(Ident::new("static", ident.span())));
            }
            other => out.push(other),
        }
    }
    out.into_iter().collect()
}

/// The lifetimes among `declared` that `tokens` name, in order.
fn lifetimes_in(tokens: TokenStream, declared: &[Ident]) -> Vec<syn::Lifetime> {
    let mut found = Vec::new();
    let mut tokens = tokens.into_iter().peekable();
    while let Some(token) = tokens.next() {
        match token {
            TokenTree::Group(group) => found.extend(lifetimes_in(group.stream(), declared)),
            TokenTree::Punct(quote) if quote.as_char() == '\'' => {
                if let Some(TokenTree::Ident(ident)) = tokens.peek()
                    && declared.contains(ident)
                {
                    let mut lifetime = syn::Lifetime::new(&format!("'{ident}"), ident.span());
                    lifetime.apostrophe = quote.span();
                    found.push(lifetime);
                }
            }
            _ => {}
        }
    }
    found
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
