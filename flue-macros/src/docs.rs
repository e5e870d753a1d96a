//! Doc comments as descriptions: `///` lines, and `#[doc = …]` attributes whose value a macro
//! writes (`concat!(..)`, `include_str!(..)`), which only the compiler can expand.
//!
//! The text is unindented as rustdoc does it, so markdown survives: the leading whitespace the
//! literal lines share (at least the space after `///`) is removed and the rest kept, so nested
//! lists and indented code blocks stay what they are. Each line loses its trailing whitespace,
//! and the text its leading and trailing blank lines.

use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::Attribute;
use syn::spanned::Spanned;

/// An item's description, from its doc comment.
pub(crate) enum Description {
    /// No doc comment, or only blank lines.
    None,
    /// Literal lines only: the unindented text.
    Text(String),
    /// At least one line a macro writes: the pieces to `concat!` in the generated code, in
    /// order (literal lines unindented, the rest as written), and the first such line's span.
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
                }) => {
                    // A block comment (`/** … */`) is one attribute of several lines.
                    let text = text.value();
                    lines.extend(text.split('\n').map(|line| Line::Text(line.to_owned())));
                }
                other => {
                    expanded = expanded.or(Some(other.span()));
                    lines.push(Line::Expr(other.clone()));
                }
            }
        }
        unindent(&mut lines);
        if let Some(span) = expanded {
            // The compiler expands the macro lines; the generated code trims the blank lines
            // around the whole text (`flue_core::doc_description`).
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
        let text: Vec<&str> = lines
            .iter()
            .filter_map(|line| match line {
                Line::Text(text) => Some(text.as_str()),
                Line::Expr(_) => None,
            })
            .collect();
        let first = text.iter().position(|line| !line.is_empty());
        let last = text.iter().rposition(|line| !line.is_empty());
        match (first, last) {
            (Some(first), Some(last)) => Self::Text(text[first..=last].join("\n")),
            _ => Self::None,
        }
    }

    /// A `&'static str` constant expression of the description (`None` without one), for
    /// generated code that has `flue_core` in scope as `__flue`.
    pub(crate) fn expression(&self) -> Option<TokenStream> {
        match self {
            Self::None => None,
            Self::Text(text) => Some(quote!(#text)),
            Self::Expanded(pieces, _) => Some(quote!(__flue::doc_description(::core::concat!(#(#pieces),*)))),
        }
    }
}

enum Line {
    Text(String),
    Expr(syn::Expr),
}

/// Removes the leading whitespace (spaces and tabs) the non-blank literal lines share, and
/// every literal line's trailing whitespace; a blank line becomes empty.
fn unindent(lines: &mut [Line]) {
    let indent_of = |text: &str| text.chars().take_while(|c| *c == ' ' || *c == '\t').count();
    let indent = lines
        .iter()
        .filter_map(|line| match line {
            Line::Text(text) if !text.trim().is_empty() => Some(indent_of(text)),
            _ => None,
        })
        .min()
        .unwrap_or(0);
    for line in lines {
        if let Line::Text(text) = line {
            *text = text.chars().skip(indent).collect::<String>().trim_end().to_owned();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Description;
    use proc_macro2::TokenStream;
    use quote::quote;
    use syn::Attribute;
    use syn::parse::Parser;

    fn text(attrs: TokenStream) -> Option<String> {
        let attrs = Attribute::parse_outer.parse2(attrs).expect("attributes parse");
        match Description::of(&attrs) {
            Description::None => None,
            Description::Text(text) => Some(text),
            Description::Expanded(..) => panic!("no line is written by a macro"),
        }
    }

    #[test]
    fn the_shared_indentation_goes_and_the_relative_indentation_stays() {
        let described = text(quote! {
            #[doc = "   Lists:"]
            #[doc = "   - one"]
            #[doc = "     - nested"]
            #[doc = ""]
            #[doc = "       code"]
        });
        assert_eq!(described.as_deref(), Some("Lists:\n- one\n  - nested\n\n    code"));
    }

    #[test]
    fn trailing_whitespace_and_surrounding_blank_lines_go() {
        let described = text(quote! {
            #[doc = "  "]
            #[doc = ""]
            #[doc = " First.  "]
            #[doc = "\t"]
            #[doc = "  Second.\t"]
            #[doc = ""]
            #[doc = " "]
        });
        assert_eq!(described.as_deref(), Some("First.\n\n Second."));
    }

    #[test]
    fn a_block_comment_is_split_into_its_lines() {
        let described = text(quote! {
            #[doc = "\n    Does one thing:\n      - well\n"]
        });
        assert_eq!(described.as_deref(), Some("Does one thing:\n  - well"));
    }

    #[test]
    fn only_blank_lines_is_no_description() {
        assert_eq!(text(quote!(#[doc = " "] #[doc = ""])), None);
        assert_eq!(text(quote!()), None);
    }
}
