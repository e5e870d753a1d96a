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

/// Splits a function's attributes into its doc attributes, as the public item generated in its
/// place carries them, and the others. A `//!` comment at the top of the body documents the
/// function as `///` does (rustdoc reads both, outer first, and so does [`Description::of`]);
/// on the generated item it is an outer attribute, as an inner one is not permitted there.
pub(crate) fn split_docs(attrs: &[Attribute]) -> (Vec<Attribute>, Vec<&Attribute>) {
    let (docs, others): (Vec<&Attribute>, Vec<&Attribute>) = attrs.iter().partition(|attr| attr.path().is_ident("doc"));
    let docs = docs
        .into_iter()
        .map(|attr| Attribute {
            style: syn::AttrStyle::Outer,
            ..attr.clone()
        })
        .collect();
    (docs, others)
}

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
                    lines.extend(block_lines(&text).into_iter().map(Line::Text));
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

/// The lines of one literal doc attribute. A block comment's (several lines) are trimmed as
/// rustdoc trims them: its first and last lines go when blank or only stars (`/**` and `*/` on
/// lines of their own), and when every other non-blank line (the first one aside, when it has
/// text: `/** Summary.`) starts with a star in the same column (` * text`), the stars go with
/// what precedes them. (A macro cannot tell a block comment from a `#[doc = "…"]` of several
/// lines: one whose every line starts `* ` is read as starred too.)
fn block_lines(text: &str) -> Vec<String> {
    let mut lines: Vec<&str> = text.split('\n').collect();
    if lines.len() < 2 {
        return lines.into_iter().map(str::to_owned).collect();
    }
    let decoration = |line: &str| line.trim().chars().all(|c| c == '*');
    // The first line's text, when it has some, is the comment's own (`/** Summary.`): no star.
    let mut skip = usize::from(!decoration(lines[0]) && !lines[0].trim_start().starts_with('*'));
    if lines.first().is_some_and(|line| decoration(line)) {
        lines.remove(0);
        skip = 0;
    }
    if lines.last().is_some_and(|line| decoration(line)) {
        lines.pop();
    }
    let star_column = |line: &str| {
        let column = line.find(|c: char| c != ' ' && c != '\t')?;
        line[column..].starts_with('*').then_some(column)
    };
    let mut columns = lines
        .iter()
        .skip(skip)
        .filter(|line| !line.trim().is_empty())
        .map(|line| star_column(line));
    let shared = match columns.next() {
        Some(Some(column)) if columns.all(|other| other == Some(column)) => Some(column),
        _ => None,
    };
    lines
        .into_iter()
        .enumerate()
        .map(|(index, line)| match shared {
            Some(column) if index >= skip && !line.trim().is_empty() => line[column + 1..].to_owned(),
            _ => line.to_owned(),
        })
        .collect()
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
    fn a_starred_block_comment_loses_its_stars_as_rustdoc_trims_them() {
        // `/**\n * Search the issues.\n *   - nested\n *\n * Done.\n */`
        let described = text(quote! {
            #[doc = "\n * Search the issues.\n *   - nested\n *\n * Done.\n "]
        });
        assert_eq!(described.as_deref(), Some("Search the issues.\n  - nested\n\nDone."));
        // Stars in other columns, or on some lines only, are text.
        let described = text(quote! {
            #[doc = "\n * One.\n  * Two.\n"]
        });
        assert_eq!(described.as_deref(), Some("* One.\n * Two."));
        let described = text(quote! {
            #[doc = "\n * A list:\n   not starred\n"]
        });
        assert_eq!(described.as_deref(), Some("* A list:\n  not starred"));
        // A comment on one line keeps a leading star: it is the text's own.
        assert_eq!(text(quote!(#[doc = "* starred"])).as_deref(), Some("* starred"));
        // Text on the comment's first line (`/** Summary.`) is not starred; the rest is.
        let described = text(quote! {
            #[doc = " Summary.\n * more\n "]
        });
        assert_eq!(described.as_deref(), Some("Summary.\nmore"));
    }

    #[test]
    fn only_blank_lines_is_no_description() {
        assert_eq!(text(quote!(#[doc = " "] #[doc = ""])), None);
        assert_eq!(text(quote!()), None);
    }
}
