//! The tool as the expansion sees it.

use proc_macro2::{Span, TokenStream, TokenTree};
use quote::ToTokens;
use syn::ext::IdentExt;
use syn::{Attribute, FnArg, Ident, ItemFn, Pat, Type};

use super::parse::Options;
use crate::docs::Description;
use crate::errors::Errors;

pub(crate) struct Field {
    pub(crate) ident: Ident,
    pub(crate) ty: Type,
    /// The parameter's doc comments, `#[serde(..)]` and `#[schemars(..)]` attributes, in order:
    /// the argument struct's field carries them.
    pub(crate) attrs: Vec<Attribute>,
}

/// Whether an attribute on a plain parameter belongs to the argument struct's field: a doc
/// comment (the field's description), or one the derives read (`#[serde(default)]`,
/// `#[serde(rename = "q")]`, `#[schemars(range(max = 100))]`).
pub(crate) fn is_field_attribute(attr: &Attribute) -> bool {
    is_derive_attribute(attr) || attr.path().is_ident("doc")
}

/// `#[serde(..)]` or `#[schemars(..)]`.
fn is_derive_attribute(attr: &Attribute) -> bool {
    attr.path().is_ident("serde") || attr.path().is_ident("schemars")
}

/// What the serde and schemars attributes of a field say about its JSON name.
#[derive(Default)]
struct Naming {
    serde_rename: Option<String>,
    schemars_rename: Option<String>,
    /// `flatten`: the field's own fields are arguments, which only the schema knows.
    flatten: bool,
    /// `skip` or `skip_deserializing`: the model does not send it.
    skip: bool,
    /// What `#[serde(..)]` says of `flatten` and `skip`.
    serde_flatten: bool,
    serde_skip: bool,
    /// The `#[schemars(..)]` `rename`, `skip` and `flatten` options, where written.
    schemars_options: Vec<(&'static str, Span)>,
}

impl Naming {
    fn of(attrs: &[Attribute]) -> Self {
        let mut naming = Self::default();
        for attr in attrs.iter().filter(|attr| is_derive_attribute(attr)) {
            let schemars = attr.path().is_ident("schemars");
            // A malformed attribute is the derive's to report; what parsed so far stands.
            let _ = attr.parse_nested_meta(|meta| {
                let span = syn::spanned::Spanned::span(&meta.path);
                if meta.path.is_ident("rename") && meta.input.peek(syn::Token![=]) {
                    let name: syn::LitStr = meta.value()?.parse()?;
                    *naming.rename(schemars) = Some(name.value());
                    naming.note(schemars, "rename", span);
                } else if meta.path.is_ident("rename") {
                    // `rename(serialize = "…", deserialize = "…")`: the model's side is the
                    // deserializing one.
                    meta.parse_nested_meta(|inner| {
                        let name: syn::LitStr = inner.value()?.parse()?;
                        if inner.path.is_ident("deserialize") {
                            *naming.rename(schemars) = Some(name.value());
                        }
                        Ok(())
                    })?;
                    naming.note(schemars, "rename", span);
                } else {
                    if meta.path.is_ident("flatten") {
                        naming.flatten = true;
                        naming.serde_flatten |= !schemars;
                        naming.note(schemars, "flatten", span);
                    } else if meta.path.is_ident("skip") || meta.path.is_ident("skip_deserializing") {
                        naming.skip = true;
                        naming.serde_skip |= !schemars;
                        naming.note(schemars, "skip", span);
                    }
                    skip_meta_value(&meta)?;
                }
                Ok(())
            });
        }
        naming
    }

    fn note(&mut self, schemars: bool, option: &'static str, span: Span) {
        if schemars {
            self.schemars_options.push((option, span));
        }
    }

    /// The first `#[schemars(..)]` option that changes the schema's name of the argument
    /// without `#[serde(..)]` saying the same: the schema and the parser would then disagree.
    fn schema_only(&self) -> Option<(&'static str, Span)> {
        self.schemars_options.iter().copied().find(|(option, _)| match *option {
            "rename" => self.schemars_rename != self.serde_rename,
            "flatten" => !self.serde_flatten,
            _ => !self.serde_skip,
        })
    }

    fn rename(&mut self, schemars: bool) -> &mut Option<String> {
        if schemars {
            &mut self.schemars_rename
        } else {
            &mut self.serde_rename
        }
    }
}

/// Consumes what follows a nested meta's path that is not read: `= value` or `(..)`.
fn skip_meta_value(meta: &syn::meta::ParseNestedMeta<'_>) -> syn::Result<()> {
    if meta.input.peek(syn::Token![=]) {
        let _: syn::Expr = meta.value()?.parse()?;
    } else if meta.input.peek(syn::token::Paren) {
        let _: proc_macro2::Group = meta.input.parse()?;
    }
    Ok(())
}

impl Field {
    /// The name the model sends the argument under, as the schema shows it: a
    /// `#[schemars(rename = "…")]`, else a `#[serde(rename = "…")]`, else the parameter's name
    /// without `r#`. `None` when the argument has no name of its own: flattened, or skipped.
    pub(crate) fn json_name(&self) -> Option<String> {
        let naming = Naming::of(&self.attrs);
        if naming.flatten || naming.skip {
            return None;
        }
        Some(
            naming
                .schemars_rename
                .or(naming.serde_rename)
                .unwrap_or_else(|| self.ident.unraw().to_string()),
        )
    }

    /// Whether the field is `#[serde(flatten)]`: its own fields are arguments.
    pub(crate) fn flattened(&self) -> bool {
        Naming::of(&self.attrs).flatten
    }

    /// A `#[schemars(rename | skip | flatten)]` that `#[serde(..)]` does not match: the
    /// option and where it is written.
    pub(crate) fn schema_only(&self) -> Option<(&'static str, Span)> {
        Naming::of(&self.attrs).schema_only()
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
    pub(crate) description: Description,
    pub(crate) has_context: bool,
    pub(crate) arguments: Arguments,
    /// Whether a parameter was rejected (reported): the body is then never called, so the
    /// expansion adds no errors of its own to the report.
    pub(crate) rejected_parameter: bool,
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
        let description = Description::of(&function.attrs);
        let krate = crate::krate::runtime_path(options.krate.take());
        let mut rejected_parameter = false;
        if let Some((param, ty)) = crate::parameter_named_like_item(&function.sig) {
            let named = param.unraw();
            // A plain parameter is an argument field: its JSON name can stay.
            let keep_name = if context_kind(ty).is_none() && named != "args" && named != "_args" {
                format!(" (`#[serde(rename = \"{named}\")]` keeps the argument's name)")
            } else {
                String::new()
            };
            errors.spanned(
                param,
                format!(
                    "rename the parameter: `{named}` names the tool itself, which is in scope in the body, so the parameter would be a pattern matching the tool, not a binding{keep_name}"
                ),
            );
            rejected_parameter = true;
        }
        let mut has_context = false;
        let mut params: Vec<&mut syn::PatType> = Vec::new();
        for (index, input) in function.sig.inputs.iter_mut().enumerate() {
            match input {
                FnArg::Receiver(receiver) => {
                    errors.spanned(
                        &*receiver,
                        "a tool is a free function, not a method: remove the `self` parameter",
                    );
                    rejected_parameter = true;
                }
                FnArg::Typed(param) => {
                    refuse_conditional(param, errors);
                    match context_kind(&param.ty) {
                        None => params.push(param),
                        Some(Context::Shared) if index == 0 => {
                            refuse_field_attributes(param, Refused::Context, errors);
                            has_context = true;
                        }
                        Some(kind) => {
                            errors.spanned(&param.ty, kind.misplaced(index == 0));
                            rejected_parameter = true;
                        }
                    }
                }
            }
        }
        let arguments = match &mut params[..] {
            [single] if is_args_pattern(&single.pat) => {
                refuse_field_attributes(single, Refused::Args, errors);
                if let Some(opaque) = crate::impl_trait_in(&single.ty) {
                    errors.spanned(
                        opaque,
                        "a tool's arguments cannot be `impl Trait`: they are deserialized from the model's JSON, which needs one concrete type; take a struct that derives `Deserialize` and `JsonSchema`",
                    );
                    rejected_parameter = true;
                    Arguments::Struct(syn::parse_quote!(()))
                } else if let Some(borrowed) = borrowed_in(&single.ty) {
                    errors.spanned(
                        &borrowed,
                        "a tool's arguments cannot borrow: they are deserialized from the model's JSON into owned values; take the owned type (`String`, not `&str`)",
                    );
                    name_elided_lifetimes(&mut single.ty);
                    rejected_parameter = true;
                    Arguments::Struct(syn::parse_quote!(()))
                } else {
                    if let Some((what, fix)) = not_an_object(&single.ty) {
                        errors.spanned(
                            &single.ty,
                            format!(
                                "a parameter named `args` is the tool's whole argument object, which the model sends as a JSON object, but {what}: {fix}"
                            ),
                        );
                    }
                    Arguments::Struct((*single.ty).clone())
                }
            }
            rest => Arguments::Plain(
                rest.iter_mut()
                    .enumerate()
                    .filter_map(|(position, param)| {
                        // Doc comments on parameters become field descriptions, and serde and
                        // schemars attributes the field's; rustc does not accept them on
                        // parameters, so they are taken off here. Other attributes
                        // (`#[allow(..)]`) stay on the body's parameter.
                        let (attrs, others): (Vec<_>, Vec<_>) = param.attrs.drain(..).partition(is_field_attribute);
                        param.attrs = others;
                        let field = match param.pat.as_ref() {
                            Pat::Ident(pat) => Field {
                                ident: pat.ident.clone(),
                                ty: (*param.ty).clone(),
                                attrs,
                            },
                            other => {
                                errors.spanned(
                                    other,
                                    "tool parameters are plain names (`query: String`), so they can be argument fields: bind the value to a name and take it apart in the body",
                                );
                                rejected_parameter = true;
                                return None;
                            }
                        };
                        if let Some(opaque) = crate::impl_trait_in(&field.ty) {
                            errors.spanned(
                                opaque,
                                "a tool parameter cannot be `impl Trait`: arguments are deserialized from the model's JSON, which needs one concrete type; take a concrete owned type (`String`, not `impl Into<String>`)",
                            );
                            rejected_parameter = true;
                            return None;
                        }
                        if let Some(borrowed) = borrowed_in(&field.ty) {
                            // The first parameter by reference to a type of another name may be
                            // the context under an alias (`use … ToolContext as Ctx`): the
                            // macro knows the context by its name only.
                            let first = position == 0 && !has_context;
                            let context_hint = if first && references_a_named_type(&borrowed) {
                                "; if this is the tool's context under another name, write `&ToolContext`: the macro knows the context by that name"
                            } else {
                                ""
                            };
                            errors.spanned(
                                &borrowed,
                                format!(
                                    "a tool parameter cannot borrow: arguments are deserialized from the model's JSON into owned values ({}){context_hint}",
                                    owned_hint(&borrowed)
                                ),
                            );
                            name_elided_lifetimes(&mut param.ty);
                            rejected_parameter = true;
                            return None;
                        }
                        Some(field)
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
            rejected_parameter,
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

/// How a parameter's type names the tool's context (any path ending in `ToolContext`; the
/// type system checks the rest).
#[derive(Clone, Copy)]
enum Context {
    /// `&ToolContext`: what a tool takes, as its first parameter.
    Shared,
    /// `&mut ToolContext`.
    Exclusive,
    /// `ToolContext`.
    Owned,
}

impl Context {
    /// The message for a context parameter that is not `&ToolContext` in first position.
    fn misplaced(self, first: bool) -> &'static str {
        match (self, first) {
            (Self::Shared, _) => {
                "the context must be a tool's first parameter: move `&ToolContext` before the arguments"
            }
            (Self::Exclusive, true) => {
                "a tool takes its context by shared reference: write `&ToolContext`, not `&mut ToolContext`"
            }
            (Self::Owned, true) => "a tool takes its context by reference: write `&ToolContext`, not `ToolContext`",
            (_, false) => "a tool takes its context as its first parameter, by shared reference: `ctx: &ToolContext`",
        }
    }
}

fn context_kind(ty: &Type) -> Option<Context> {
    let names_context = |ty: &Type| {
        matches!(ty, Type::Path(path)
            if path.qself.is_none() && path.path.segments.last().is_some_and(|segment| segment.ident == "ToolContext"))
    };
    match ty {
        Type::Reference(reference) if names_context(&reference.elem) => Some(if reference.mutability.is_some() {
            Context::Exclusive
        } else {
            Context::Shared
        }),
        Type::Paren(inner) => context_kind(&inner.elem),
        Type::Group(inner) => context_kind(&inner.elem),
        ty if names_context(ty) => Some(Context::Owned),
        _ => None,
    }
}

/// The first reference, or lifetime other than `'static`, that `ty` names: a parameter that
/// borrows cannot be deserialized from the model's JSON (`&str`, `Vec<&str>`, `Cow<'a, str>`).
/// A `Cow` that leaves its lifetime out (`Cow<str>`) borrows too: the lifetime is only hidden.
fn borrowed_in(ty: &Type) -> Option<TokenStream> {
    match ty {
        Type::Reference(_) => Some(ty.to_token_stream()),
        Type::Paren(inner) => borrowed_in(&inner.elem),
        Type::Group(inner) => borrowed_in(&inner.elem),
        Type::Slice(inner) => borrowed_in(&inner.elem),
        Type::Array(inner) => borrowed_in(&inner.elem),
        Type::Tuple(tuple) => tuple.elems.iter().find_map(borrowed_in),
        Type::Path(path) => {
            let qself = path.qself.as_ref().and_then(|qself| borrowed_in(&qself.ty));
            let elided_cow = || {
                path.path
                    .segments
                    .iter()
                    .any(|segment| segment.ident == "Cow" && !names_lifetime(&segment.arguments))
                    .then(|| ty.to_token_stream())
            };
            qself.or_else(elided_cow).or_else(|| {
                path.path
                    .segments
                    .iter()
                    .filter_map(|segment| match &segment.arguments {
                        syn::PathArguments::AngleBracketed(arguments) => Some(&arguments.args),
                        _ => None,
                    })
                    .flatten()
                    .find_map(|argument| match argument {
                        syn::GenericArgument::Lifetime(lifetime) if lifetime.ident != "static" => {
                            Some(lifetime.to_token_stream())
                        }
                        syn::GenericArgument::Type(ty) => borrowed_in(ty),
                        _ => None,
                    })
            })
        }
        _ => None,
    }
}

/// Writes out the lifetime a `Cow` leaves out (`Cow<str>` → `Cow<'_, str>`), so the body, which
/// keeps the rejected parameter, still compiles as an `async fn` and adds no error of its own.
fn name_elided_lifetimes(ty: &mut Type) {
    match ty {
        Type::Reference(inner) => name_elided_lifetimes(&mut inner.elem),
        Type::Paren(inner) => name_elided_lifetimes(&mut inner.elem),
        Type::Group(inner) => name_elided_lifetimes(&mut inner.elem),
        Type::Slice(inner) => name_elided_lifetimes(&mut inner.elem),
        Type::Array(inner) => name_elided_lifetimes(&mut inner.elem),
        Type::Tuple(tuple) => tuple.elems.iter_mut().for_each(name_elided_lifetimes),
        Type::Path(path) => {
            if let Some(qself) = &mut path.qself {
                name_elided_lifetimes(&mut qself.ty);
            }
            for segment in &mut path.path.segments {
                if segment.ident == "Cow" && !names_lifetime(&segment.arguments) {
                    let elided = syn::Lifetime::new("'_", segment.ident.span());
                    if let syn::PathArguments::AngleBracketed(arguments) = &mut segment.arguments {
                        arguments.args.insert(0, syn::GenericArgument::Lifetime(elided));
                    }
                }
                if let syn::PathArguments::AngleBracketed(arguments) = &mut segment.arguments {
                    for argument in &mut arguments.args {
                        if let syn::GenericArgument::Type(ty) = argument {
                            name_elided_lifetimes(ty);
                        }
                    }
                }
            }
        }
        _ => {}
    }
}

/// Whether a path segment's generic arguments name a lifetime (`Cow<'static, str>`).
fn names_lifetime(arguments: &syn::PathArguments) -> bool {
    matches!(arguments, syn::PathArguments::AngleBracketed(arguments)
        if arguments.args.iter().any(|argument| matches!(argument, syn::GenericArgument::Lifetime(_))))
}

/// Whether `borrowed` is a shared reference to a named type other than `str` (`&Ctx`, not
/// `&str`, `&[T]` or `&mut T`).
fn references_a_named_type(borrowed: &TokenStream) -> bool {
    matches!(syn::parse2::<Type>(borrowed.clone()), Ok(Type::Reference(reference))
        if reference.mutability.is_none()
            && matches!(reference.elem.as_ref(), Type::Path(path) if !path.path.is_ident("str")))
}

/// What to take instead of a borrowed type.
fn owned_hint(borrowed: &TokenStream) -> &'static str {
    match syn::parse2::<Type>(borrowed.clone()) {
        Ok(Type::Reference(reference)) => match reference.elem.as_ref() {
            Type::Path(path) if path.path.is_ident("str") => "take `String`, not `&str`",
            Type::Slice(_) => "take a `Vec`, not a slice",
            _ => "take the value itself, without `&`",
        },
        _ => "take a type that owns its data, such as `String`",
    }
}

/// When `ty` is spelled as a type whose JSON Schema is surely not an object (text, a number,
/// a list, an optional value, any JSON value), what it is instead and what to take, for the
/// message. Other types (a struct, a map, a type parameter) are checked by `use_tool` when the
/// schema exists, at run time.
fn not_an_object(ty: &Type) -> Option<(String, &'static str)> {
    const FIX: &str = "give the parameter another name to make it one argument field, or take a struct that derives `Deserialize` and `JsonSchema`";
    const TEXT: [&str; 5] = ["String", "str", "char", "PathBuf", "OsString"];
    const NUMBERS: [&str; 14] = [
        "i8", "i16", "i32", "i64", "i128", "isize", "u8", "u16", "u32", "u64", "u128", "usize", "f32", "f64",
    ];
    const LISTS: [&str; 6] = ["Vec", "VecDeque", "LinkedList", "HashSet", "BTreeSet", "BinaryHeap"];
    match ty {
        Type::Paren(inner) => not_an_object(&inner.elem),
        Type::Group(inner) => not_an_object(&inner.elem),
        Type::Tuple(tuple) if tuple.elems.is_empty() => Some(("`()` is JSON `null`".to_owned(), FIX)),
        Type::Tuple(_) | Type::Array(_) | Type::Slice(_) => Some(("a tuple or array is a JSON array".to_owned(), FIX)),
        Type::Path(path) if path.qself.is_none() => {
            let last = path.path.segments.last()?;
            let name = last.ident.to_string();
            let inner = || match &last.arguments {
                syn::PathArguments::AngleBracketed(arguments) => {
                    arguments.args.iter().find_map(|argument| match argument {
                        syn::GenericArgument::Type(ty) => Some(ty),
                        _ => None,
                    })
                }
                _ => None,
            };
            if TEXT.contains(&name.as_str()) {
                Some((format!("`{name}` is a JSON string"), FIX))
            } else if NUMBERS.contains(&name.as_str()) {
                Some((format!("`{name}` is a JSON number"), FIX))
            } else if name == "bool" {
                Some(("`bool` is a JSON boolean".to_owned(), FIX))
            } else if LISTS.contains(&name.as_str()) {
                Some((format!("`{name}` is a JSON array"), FIX))
            } else if name == "Option" {
                Some(("`Option` is an object or `null`".to_owned(), FIX))
            } else if name == "Value"
                && path.path.segments.len() >= 2
                && path.path.segments[path.path.segments.len() - 2].ident == "serde_json"
            {
                // Spelled `serde_json::Value`: a bare `Value` may be the application's own type
                // (`use_tool` checks its schema at run time).
                Some((
                    "`Value` is any JSON value, and its schema (`true`) is no object".to_owned(),
                    "take `serde_json::Map<String, Value>` for an object with any fields, or a struct that derives `Deserialize` and `JsonSchema`",
                ))
            } else if matches!(name.as_str(), "Box" | "Arc" | "Rc" | "Cow") {
                inner().and_then(not_an_object)
            } else {
                None
            }
        }
        _ => None,
    }
}

/// A parameter that is no argument field.
#[derive(Clone, Copy)]
enum Refused {
    Context,
    Args,
}

/// Reports and takes off the `#[cfg(..)]` and `#[cfg_attr(..)]` attributes of a parameter: the
/// argument struct, its schema and the call are generated from every parameter, and rustc
/// evaluates a parameter's `cfg` only after the macro ran, on the body's parameter alone.
fn refuse_conditional(param: &mut syn::PatType, errors: &Errors) {
    param.attrs.retain(|attr| {
        let conditional = attr.path().is_ident("cfg") || attr.path().is_ident("cfg_attr");
        if conditional {
            errors.spanned(
                attr,
                "a tool's parameters cannot be conditional: the arguments the model sends, their schema and the call are made from every parameter; put the `cfg` on the whole tool (two tools under opposite `cfg`s), or take an `Option` the model may leave out",
            );
        }
        !conditional
    });
}

/// Reports and takes off the doc comments, `#[serde(..)]` and `#[schemars(..)]` attributes of a
/// parameter that is no argument field, which rustc would not accept on a parameter.
fn refuse_field_attributes(param: &mut syn::PatType, refused: Refused, errors: &Errors) {
    let (field_attrs, kept): (Vec<_>, Vec<_>) = param.attrs.drain(..).partition(is_field_attribute);
    param.attrs = kept;
    let (docs, derive_attrs): (Vec<_>, Vec<_>) = field_attrs.into_iter().partition(|attr| attr.path().is_ident("doc"));
    // One error for the whole comment, whatever its number of lines.
    if !docs.is_empty() {
        let message = match refused {
            Refused::Context => {
                "a doc comment describes an argument field, and the context is no argument, so it takes no description: take the comment off"
            }
            Refused::Args => {
                "a doc comment describes one argument field, and `args` is the whole argument object: document the fields of the arguments struct instead"
            }
        };
        errors.spanned(quote::quote!(#(#docs)*), message);
    }
    for attr in derive_attrs {
        let which = if attr.path().is_ident("serde") {
            "serde"
        } else {
            "schemars"
        };
        let message = match refused {
            Refused::Context => format!(
                "`#[{which}(..)]` shapes an argument field, and the context is no argument: take the attribute off"
            ),
            Refused::Args => format!(
                "`#[{which}(..)]` shapes one argument field, and `args` is the whole argument object: put the attribute on its type or on its fields"
            ),
        };
        errors.spanned(&attr, message);
    }
}

fn is_args_pattern(pat: &Pat) -> bool {
    matches!(pat, Pat::Ident(ident) if ident.ident == "args" || ident.ident == "_args")
}
