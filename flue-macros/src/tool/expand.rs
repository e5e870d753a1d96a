//! Code generation for `#[tool]`.

use proc_macro2::TokenStream;
use quote::{ToTokens, format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{ReturnType, Type};

use super::model::{Arguments, ToolModel};
use crate::docs::Description;

pub(crate) fn tool(model: &ToolModel) -> TokenStream {
    let function = &model.function;
    let krate = &model.krate;
    let ident = &function.sig.ident;
    let vis = &function.vis;
    let name = &model.name.0;
    let (docs, other_attrs) = crate::docs::split_docs(&function.attrs);
    // `#[deprecated]` marks the tool its users name, not the hidden body the tool calls.
    let (deprecated, other_attrs): (Vec<_>, Vec<_>) = other_attrs
        .into_iter()
        .partition(|attr| attr.path().is_ident("deprecated"));
    // The tool's type takes the function's type parameters only: its lifetimes are the body's
    // own (inferred at the call), never part of the tool.
    let type_generics = model.type_generics();
    let (impl_generics, ty_generics, where_clause) = type_generics.split_for_impl();
    let generic = !type_generics.params.is_empty();

    let mut body = function.clone();
    body.sig.ident = format_ident!("__flue_tool_body");
    body.attrs = other_attrs.into_iter().cloned().collect();
    body.vis = syn::Visibility::Inherited;
    // `unsafe` is reported; the body is called from safe code.
    body.sig.unsafety = None;
    // An ABI changes nothing (an `async` body runs in its future's `poll`, a Rust function, so a
    // panic still unwinds), but would warn that the arguments are not FFI-safe: it is dropped,
    // as `#[agent]` drops it.
    body.sig.abi = None;
    // A `self` receiver is reported, and rustc would reject it on the free body function too;
    // a parameter named like the tool is reported, and rustc would read it as a pattern matching
    // the tool; `unsafe` is reported, and the safe body function would add an error per unsafe
    // call in it: the body is left out (it is never called then).
    let callable = function.sig.receiver().is_none()
        && crate::parameter_named_like_item(&function.sig).is_none()
        && function.sig.unsafety.is_none();
    let body = callable.then(|| {
        quote! {
            #[allow(dead_code)]
            #body
        }
    });

    let krate_text = quote!(#krate).to_string().replace(' ', "");
    let serde_path = format!("{krate_text}::__private::serde");
    let schemars_path = format!("{krate_text}::__private::schemars");
    let args_ident = format_ident!("__FlueToolArgs_{}", ident);
    let (args_struct, args_ty, call_args): (TokenStream, Type, Vec<TokenStream>) = match &model.arguments {
        Arguments::Struct(ty) => (quote!(), ty.clone(), vec![quote!(__flue_args)]),
        Arguments::Plain(fields) => {
            let declared = fields.iter().map(|field| {
                let (field_ident, ty, attrs) = (&field.ident, &field.ty, &field.attrs);
                quote!(#(#attrs)* #field_ident: #ty)
            });
            let moved = fields.iter().map(|field| {
                let field_ident = &field.ident;
                quote!(__flue_args.#field_ident)
            });
            (
                quote! {
                    #[derive(#krate::__private::serde::Deserialize, #krate::__private::schemars::JsonSchema)]
                    #[serde(crate = #serde_path)]
                    #[schemars(crate = #schemars_path)]
                    #[allow(non_camel_case_types)]
                    struct #args_ident { #(#declared),* }
                },
                syn::parse_quote!(#args_ident),
                moved.collect(),
            )
        }
    };
    let context = model.has_context.then(|| quote!(&__flue_ctx,));
    let turbofish = ty_generics.as_turbofish();
    // A sync tool is reported as an error; do not pile an await error on top of it.
    let await_ = function.sig.asyncness.map(|_| quote!(.await));
    // The body's future must be `Send` (the runtime runs tools on its worker threads): asserted
    // at the function's `async`, so a value held across an `.await` that is not `Send` is
    // reported there, with rustc's notes in the body, rather than at the attribute.
    let call = quote!(__flue_tool_body #turbofish (#context #(#call_args),*));
    let call = match &function.sig.asyncness {
        Some(asyncness) => {
            quote_spanned!(crate::located_at(asyncness)=> __flue::send_body(__flue_tool_body #turbofish (#context #(#call_args),*)))
        }
        None => call,
    };
    // A rejected parameter, or a bound the tool's type cannot take (both reported), leaves the
    // body uncallable from it: the tool still expands, so the rest of the crate type-checks,
    // but never runs.
    let output = match &function.sig.output {
        _ if model.rejected_parameter || !model.misplaced_lifetimes().is_empty() || !callable => {
            quote!(::core::unreachable!("this tool failed to compile"))
        }
        // The return type may be `impl Trait`, which cannot be named in a path: the helper
        // infers it from the body's value, and its call is spanned at the return type, so a
        // type that is no tool result is reported there. Before it, a `Result` whose error is
        // text, or displays without being a `std::error::Error`, gets a `ToolError` instead,
        // which no trait impl can do (see `flue_core::tool::Returned`).
        ReturnType::Type(_, ty) => {
            let convert = quote_spanned!(crate::located_at(ty)=> __flue::tool::tool_return(__flue_returned));
            quote!({
                use __flue::tool::{
                    ConvertibleReturn as _, DisplayErrorReturn as _, OtherReturn as _, TextErrorReturn as _,
                };
                let __flue_returned = #call #await_;
                let __flue_returned = (&&&__flue::tool::Returned(&__flue_returned))
                    .__flue_tool_return()
                    .adapt(__flue_returned);
                #convert
            })
        }
        ReturnType::Default => {
            quote!({ #call #await_; __flue::ToolOutput::text("") })
        }
    };
    // Every use of the argument type is bounded by ToolArguments and spanned at the type, so a
    // missing derive produces one diagnostic (rustc merges identical ones), at the type.
    let schema_fn = quote_spanned!(args_ty.span()=> __flue::tool::arguments::<#args_ty>().schema);
    let parse_fn = quote_spanned!(args_ty.span()=> (__flue::tool::arguments::<#args_ty>().parse));
    // A plain progress argument must be text, asserted at its type. A field of an argument
    // struct is checked by `use_tool` only: serde may rename it, so only the schema knows its
    // JSON name and type.
    let progress_check = match (&model.options.progress_argument, &model.arguments) {
        (Some(progress), Arguments::Plain(fields)) => fields
            .iter()
            .find(|field| field.json_name().is_some_and(|name| name == progress.value()))
            .map(|field| {
                let ty = &field.ty;
                quote_spanned!(ty.span()=> const _: () = __flue::tool::progress_argument::<#ty>();)
            })
            .unwrap_or_default(),
        _ => quote!(),
    };
    // Each plain parameter must parse and describe itself, asserted at its type (unless its
    // attributes parse or describe it otherwise, or it names the tool's type parameters or a
    // lifetime, which an item here cannot). Once per type: parameters of one type share it.
    let argument_checks: TokenStream = match &model.arguments {
        // A rejected parameter (a borrowed or `impl Trait` type) was reported as such.
        _ if model.rejected_parameter => quote!(),
        Arguments::Plain(fields) => {
            let mut asserted = Vec::new();
            fields
                .iter()
                .filter(|field| checked(field, &type_generics))
                .filter(|field| {
                    let ty = field.ty.to_token_stream().to_string();
                    let first = !asserted.contains(&ty);
                    if first {
                        asserted.push(ty);
                    }
                    first
                })
                .map(|field| {
                    let ty = &field.ty;
                    quote_spanned!(crate::located_at(ty)=> const _: () = __flue::tool::tool_argument::<#ty>();)
                })
                .collect()
        }
        Arguments::Struct(_) => quote!(),
    };
    // A description a macro writes (`#[doc = include_str!(..)]`) is known only once the
    // compiler expands it: it must not be blank either.
    let (description, description_check) = match (&model.description, model.description.expression()) {
        // A constant of its own, which the definition does not use, so a blank one is the only
        // error reported.
        (Description::Expanded(_, span), Some(text)) => (
            text.clone(),
            Some(quote_spanned! {*span=>
                const __FLUE_DESCRIPTION_IS_NOT_BLANK: () = ::core::assert!(
                    !#text.is_empty(),
                    "a tool needs a description, and this doc comment is blank: say what the tool does — the model reads it to decide when to call the tool",
                );
            }),
        ),
        (_, text) => (text.unwrap_or_else(|| quote!("")), None),
    };
    let progress = match &model.options.progress_argument {
        Some(progress) => quote!(::core::option::Option::Some(#progress)),
        None => quote!(::core::option::Option::None),
    };
    let secrets = model.options.secrets.iter().flatten();
    let terminate = model.options.terminate == Some(true);
    let mut definition_expr = quote!(__flue::tool::ToolDefinition::from_checked(
        #name,
        #description,
        __flue::data::SchemaSource::Typed(#schema_fn),
        #progress,
        &[#(#secrets),*],
        #terminate,
    ));
    if model.options.durable == Some(true) {
        definition_expr = quote!(#definition_expr.into_durable());
    }

    let (item, definition_fn, constructor) = if generic {
        let params = function.sig.generics.type_params().map(|param| &param.ident);
        (
            // Zero-sized, as a tool that is not generic: its definition is kept per
            // instantiation, so every mount of one is one tool.
            quote! {
                #(#docs)*
                #(#deprecated)*
                #[allow(non_camel_case_types)]
                #vis struct #ident #impl_generics #where_clause {
                    // Each in a `PhantomData` of its own: a tuple's elements but the last must be
                    // sized, and a parameter may be `?Sized`.
                    _types: ::core::marker::PhantomData<fn() -> (#(::core::marker::PhantomData<#params>,)*)>,
                }
            },
            quote!(__flue::tool::generic_definition::<Self>(|| #definition_expr)),
            quote! {
                // (A `#[deprecated]` tool's own impls do not warn; the user's uses of it do.)
                #[allow(deprecated)]
                impl #impl_generics #ident #ty_generics #where_clause {
                    /// The tool, ready for `use_tool`.
                    #vis fn new() -> Self {
                        Self { _types: ::core::marker::PhantomData }
                    }
                }
            },
        )
    } else {
        (
            quote! {
                #(#docs)*
                #(#deprecated)*
                #[allow(non_camel_case_types)]
                #[derive(
                    ::core::clone::Clone,
                    ::core::marker::Copy,
                    ::core::fmt::Debug,
                    ::core::default::Default,
                )]
                #vis struct #ident;
            },
            quote! {
                static DEFINITION: __flue::tool::ToolDefinition = #definition_expr;
                &DEFINITION
            },
            quote!(),
        )
    };

    quote! {
        #item

        const _: () = {
            use #krate::__private::flue_core as __flue;

            #args_struct

            #body

            #progress_check

            #argument_checks

            #description_check

            #constructor

            #[automatically_derived]
            #[allow(deprecated)]
            impl #impl_generics __flue::tool::ToolHandler for #ident #ty_generics #where_clause {
                fn definition(&self) -> &__flue::tool::ToolDefinition {
                    #definition_fn
                }

                fn call(
                    &self,
                    __flue_ctx: __flue::ToolContext,
                    __flue_json: #krate::__private::serde_json::Value,
                ) -> __flue::BoxFuture<'_, __flue::ToolOutput> {
                    ::std::boxed::Box::pin(async move {
                        let __flue_args: #args_ty = match #parse_fn(__flue_json) {
                            ::core::result::Result::Ok(__flue_args) => __flue_args,
                            ::core::result::Result::Err(__flue_output) => return __flue_output,
                        };
                        let _ = &__flue_ctx;
                        #output
                    })
                }
            }
        };
    }
}

/// Whether a plain parameter's type is asserted to be an argument type: unless its attributes
/// parse or describe it otherwise, or it names the tool's type parameters or a lifetime.
fn checked(field: &super::model::Field, generics: &syn::Generics) -> bool {
    !field.attrs.iter().any(described_otherwise) && !mentions_generics(&field.ty, generics)
}

/// Whether a parameter's `#[serde(..)]` or `#[schemars(..)]` attribute parses, describes or
/// skips it by other means (`with`, `deserialize_with`, `schema_with`, `skip`,
/// `skip_deserializing`): its type then need not be an argument type itself.
fn described_otherwise(attr: &syn::Attribute) -> bool {
    const OTHERWISE: [&str; 5] = ["with", "deserialize_with", "schema_with", "skip", "skip_deserializing"];
    if !(attr.path().is_ident("serde") || attr.path().is_ident("schemars")) {
        return false;
    }
    let syn::Meta::List(list) = &attr.meta else {
        return false;
    };
    fn names_one(tokens: proc_macro2::TokenStream) -> bool {
        tokens.into_iter().any(|token| match token {
            proc_macro2::TokenTree::Ident(ident) => OTHERWISE.iter().any(|name| ident == name),
            proc_macro2::TokenTree::Group(group) => names_one(group.stream()),
            _ => false,
        })
    }
    names_one(list.tokens.clone())
}

/// Whether `ty` names a lifetime other than `'static` or one of `generics`' type parameters.
fn mentions_generics(ty: &Type, generics: &syn::Generics) -> bool {
    let params: Vec<String> = generics.type_params().map(|param| param.ident.to_string()).collect();
    fn walk(tokens: proc_macro2::TokenStream, params: &[String]) -> bool {
        let mut tokens = tokens.into_iter().peekable();
        while let Some(token) = tokens.next() {
            match token {
                proc_macro2::TokenTree::Punct(punct) if punct.as_char() == '\'' => {
                    if let Some(proc_macro2::TokenTree::Ident(name)) = tokens.next()
                        && name != "static"
                    {
                        return true;
                    }
                }
                proc_macro2::TokenTree::Ident(ident) if params.iter().any(|param| ident == param) => return true,
                proc_macro2::TokenTree::Group(group) if walk(group.stream(), params) => return true,
                _ => {}
            }
        }
        false
    }
    walk(quote!(#ty), &params)
}
