//! Code generation for `#[hook]`.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::{FnArg, ReturnType};

use super::model::HookModel;

pub(crate) fn hook(model: &HookModel) -> TokenStream {
    let function = &model.function;
    let krate = &model.krate;
    let kind = model.kind;
    let vis = &function.vis;
    let ident = &function.sig.ident;
    let id = &model.id.0;
    let (docs, other_attrs) = crate::docs::split_docs(&function.attrs);
    // `#[deprecated]` marks the hook its users name, not the hidden body the hook calls.
    let (deprecated, other_attrs): (Vec<_>, Vec<_>) = other_attrs
        .into_iter()
        .partition(|attr| attr.path().is_ident("deprecated"));
    let variant = format_ident!("{}", kind.variant);
    let (reference, handler, definition) = if kind.user_scope {
        (quote!(UserHook), quote!(UserHookHandler), quote!(UserHookDefinition))
    } else {
        (
            quote!(ThreadHook),
            quote!(ThreadHookHandler),
            quote!(ThreadHookDefinition),
        )
    };

    let mut body = function.clone();
    body.sig.ident = format_ident!("__flue_hook_body");
    body.attrs = other_attrs.into_iter().cloned().collect();
    body.vis = syn::Visibility::Inherited;
    // `unsafe`, `const` and `extern` are reported; the body is a plain Rust function.
    body.sig.unsafety = None;
    body.sig.constness = None;
    body.sig.abi = None;
    // A `self` receiver is reported, and rustc would reject it on the free body function too; a
    // parameter named like the hook is reported, and rustc would read it as a pattern matching
    // the hook; `unsafe` is reported, and the safe body function would add an error per unsafe
    // call in it: the body is left out, and not called.
    let receiver = function.sig.receiver().is_some();
    let named_like_hook = crate::parameter_named_like_item(&function.sig).is_some();
    let unsafe_fn = function.sig.unsafety.is_some();
    let body = (!receiver && !named_like_hook && !unsafe_fn).then(|| {
        quote! {
            #[allow(dead_code)]
            #body
        }
    });

    let args: Vec<_> = (0..kind.params.len())
        .map(|index| format_ident!("__flue_arg{index}"))
        .collect();
    // Each argument goes through `hook_parameter` spanned at its parameter's type, so a type
    // the kind does not pass is reported there, with the type it passes. (A parameter of an
    // `impl Trait` type is generic, and one of a `&dyn Trait` type where the kind passes a
    // reference coerces it: each takes the argument as it is.)
    let passes_reference = |index: usize| {
        kind.params
            .get(index)
            .and_then(|param| param.split_once(": "))
            .is_some_and(|(_, ty)| ty.starts_with('&'))
    };
    let call_args: Vec<TokenStream> = function
        .sig
        .inputs
        .iter()
        .zip(&args)
        .enumerate()
        .map(|(index, (input, arg))| match input {
            FnArg::Typed(param)
                if crate::impl_trait_in(&param.ty).is_none()
                    && !(trait_object_reference(&param.ty) && passes_reference(index)) =>
            {
                quote_spanned!(crate::located_at(&param.ty)=> __flue::lifecycle::hook_parameter(#arg))
            }
            FnArg::Typed(param) => {
                let arg = syn::Ident::new(&arg.to_string(), crate::located_at(&param.ty));
                quote!(#arg)
            }
            FnArg::Receiver(_) => quote!(#arg),
        })
        .collect();
    let await_ = function.sig.asyncness.map(|_| quote!(.await));
    // An async body's future must be `Send`: asserted at the function's `async` (see `#[tool]`).
    let call = quote!(__flue_hook_body(#(#call_args),*));
    let call = match &function.sig.asyncness {
        Some(asyncness) => {
            quote_spanned!(crate::located_at(asyncness)=> __flue::send_body(__flue_hook_body(#(#call_args),*)))
        }
        None => call,
    };
    let expected: syn::Type = syn::parse_str(kind.returns).unwrap_or_else(|_| syn::parse_quote!(()));
    let expected = qualify(&expected);
    // A wrong arity, type parameters or a receiver were reported: the body is not called.
    let well_formed = !model.stub
        && function.sig.inputs.len() == args.len()
        && crate::lifetimes_only(&function.sig.generics)
        && !receiver
        && !named_like_hook
        && !unsafe_fn;
    let result = match &function.sig.output {
        // The return type may be `impl Trait`, which cannot be named in a path: the helper
        // infers it from the body's value, and its call is spanned at the return type, so a
        // type the kind does not return is reported there. Before it, a `Result` whose error is
        // text, or displays without converting into a `HookError`, gets a `HookError` of that
        // text instead, which no trait impl can do (see `flue_core::lifecycle::hook_return`).
        ReturnType::Type(_, ty) if well_formed => {
            let convert =
                quote_spanned!(crate::located_at(ty)=> __flue::lifecycle::hook_return::<#expected, _>(__flue_returned));
            quote!({
                use __flue::lifecycle::{
                    ConvertibleHookReturn as _, DisplayErrorHookReturn as _, OtherHookReturn as _,
                    TextErrorHookReturn as _,
                };
                let __flue_returned = #call #await_;
                let __flue_returned = (&&&__flue::tool::Returned(&__flue_returned))
                    .__flue_hook_return()
                    .adapt(__flue_returned);
                #convert
            })
        }
        ReturnType::Default if well_formed && !kind.is_transform() => {
            quote!(__flue::lifecycle::hook_return::<(), ()>(#call #await_))
        }
        // The signature error is already reported; keep the item compiling without piling on.
        _ => quote!(::core::result::Result::Err(__flue::lifecycle::HookError::new(
            "ill-formed hook"
        ))),
    };

    quote! {
        #(#docs)*
        #(#deprecated)*
        #[allow(non_upper_case_globals)]
        #vis const #ident: #krate::__private::flue_core::lifecycle::#reference = {
            use #krate::__private::flue_core as __flue;
            #body
            // In a block of its own: the body (an item of the outer block) sees the user's
            // items named `DEFINITION`, not this one.
            {
                static DEFINITION: __flue::lifecycle::#definition = __flue::lifecycle::#definition {
                    id: #id,
                    handler: __flue::lifecycle::#handler::#variant(|#(#args),*| {
                        ::std::boxed::Box::pin(async move { #result })
                    }),
                };
                __flue::lifecycle::#reference::new(&DEFINITION)
            }
        };
    }
}

/// Spells out every type of a kind's return type by its full path, so a user type of the same
/// name in scope is not picked up.
fn qualify(ty: &syn::Type) -> TokenStream {
    const PATHS: [(&str, &str); 7] = [
        ("Option", "::core::option::Option"),
        ("Vec", "::std::vec::Vec"),
        ("String", "::std::string::String"),
        ("Message", "__flue::lifecycle::Message"),
        ("LlmMessage", "__flue::lifecycle::LlmMessage"),
        ("MessageUpdates", "__flue::lifecycle::MessageUpdates"),
        ("ToolResult", "__flue::lifecycle::ToolResult"),
    ];
    let text = quote!(#ty).to_string();
    let qualified = text
        .split(' ')
        .map(|token| match PATHS.iter().find(|(name, _)| token == *name) {
            Some((_, path)) => (*path).to_owned(),
            None => token.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(" ");
    qualified
        .parse()
        .unwrap_or_else(|_| quote::quote_spanned!(Span::call_site()=> ()))
}

/// Whether `ty` is a reference to a trait object (`&dyn Debug`, `&'a (dyn Any + Send)`): the
/// kind's reference coerces to it at the call, which `HookParameter`'s exact match would
/// refuse.
fn trait_object_reference(ty: &syn::Type) -> bool {
    fn trait_object(ty: &syn::Type) -> bool {
        match ty {
            syn::Type::TraitObject(_) => true,
            syn::Type::Paren(inner) => trait_object(&inner.elem),
            syn::Type::Group(inner) => trait_object(&inner.elem),
            _ => false,
        }
    }
    match ty {
        syn::Type::Reference(reference) => trait_object(&reference.elem),
        syn::Type::Paren(inner) => trait_object_reference(&inner.elem),
        syn::Type::Group(inner) => trait_object_reference(&inner.elem),
        _ => false,
    }
}
