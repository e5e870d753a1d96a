//! Doc comments as descriptions: `///` lines, and `#[doc = …]` attributes whose value a macro
//! writes (`concat!(..)`, `include_str!(..)`), which only the compiler can expand.

use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::Attribute;
use syn::spanned::Spanned;

/// An item's description, from its doc comment.
pub(crate) enum Description {
    /// No doc comment, or only blank lines.
    None,
    /// Literal lines only: the text, lines trimmed and joined.
    Text(String),
    /// At least one line a macro writes: the pieces to `concat!` in the generated code, in
    /// order (literal lines trimmed, the rest as written), and the first such line's span.
    Expanded(Vec<TokenStream>, Span),
}

impl Description {
    pub(crate) fn of(attrs: &[Attribute]) -> Self {
        let mut lines = Vec::new();
        let mut expanded = None;
        for attr in attrs.iter().filter(|attr| attr.path().is_ident("doc")) {
            let syn::Meta::NameValue(syn::MetaNameValue { value, .. }) = &attr.meta else {
                continue;
            };
            match value {
                syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(text),
                    ..
                }) => lines.push(Line::Text(text.value().trim().to_owned())),
                other => {
                    expanded = expanded.or(Some(other.span()));
                    lines.push(Line::Expr(other.clone()));
                }
            }
        }
        if let Some(span) = expanded {
            let mut pieces = Vec::new();
            for (index, line) in lines.iter().enumerate() {
                if index > 0 {
                    pieces.push(quote!("\n"));
                }
                pieces.push(match line {
                    Line::Text(text) => quote!(#text),
                    Line::Expr(expr) => quote!(#expr),
                });
            }
            return Self::Expanded(pieces, span);
        }
        let text = lines
            .iter()
            .filter_map(|line| match line {
                Line::Text(text) => Some(text.as_str()),
                Line::Expr(_) => None,
            })
            .collect::<Vec<_>>()
            .join("\n")
            .trim()
            .to_owned();
        if text.is_empty() { Self::None } else { Self::Text(text) }
    }

    /// A `&'static str` constant expression of the description, trimmed (`None` without one).
    pub(crate) fn expression(&self) -> Option<TokenStream> {
        match self {
            Self::None => None,
            Self::Text(text) => Some(quote!(#text)),
            Self::Expanded(pieces, _) => Some(quote!(::core::primitive::str::trim_ascii(
                ::core::concat!(#(#pieces),*)
            ))),
        }
    }
}

enum Line {
    Text(String),
    Expr(syn::Expr),
}
