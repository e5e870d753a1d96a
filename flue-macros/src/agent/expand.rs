//! Code generation for `#[agent]`.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Attribute, FnArg, ReturnType};

use super::model::AgentModel;
use crate::docs::Description;

pub(crate) fn agent(model: &AgentModel) -> TokenStream {
    let function = &model.function;
    let krate = &model.krate;
    let ident = &model.ident;
    let vis = &function.vis;
    let (docs, other_attrs) = crate::docs::split_docs(&function.attrs);
    // `#[deprecated]` marks the agent its users name, not the hidden body its render calls.
    let (deprecated, other_attrs): (Vec<&Attribute>, Vec<&Attribute>) = other_attrs
        .into_iter()
        .partition(|attr| attr.path().is_ident("deprecated"));
    // syn keeps the body's inner attributes (`#![allow(..)]`) with the function's: they go
    // back inside the body (before an outer one, rustc refuses them).
    let (inner_attrs, other_attrs): (Vec<&Attribute>, Vec<&Attribute>) = other_attrs
        .into_iter()
        .partition(|attr| matches!(attr.style, syn::AttrStyle::Inner(_)));
    let name = &model.name.0;
    let inputs = &function.sig.inputs;
    let output = &function.sig.output;
    let statements = &function.block.stmts;
    // Lifetime parameters only (validated): the body keeps the names its signature uses.
    let generics = &function.sig.generics;
    let where_clause = &generics.where_clause;

    // A `self` receiver is reported, and rustc would reject it on the nested body function
    // too; a parameter named like the agent is reported, and rustc would read it as a pattern
    // matching the agent; `async` and `unsafe` are reported, and the synchronous, safe body
    // function would add errors of its own (`.await` outside async, unsafe calls): the body is
    // left out (it is not called then).
    let callable = function.sig.receiver().is_none()
        && crate::parameter_named_like_item(&function.sig).is_none()
        && function.sig.asyncness.is_none()
        && function.sig.unsafety.is_none();

    // The argument the body gets, through `agent_parameter` spanned at its parameter's type, so
    // a type other than `AgentProps` is reported there.
    let argument = match (inputs.len(), inputs.first()) {
        // Type or const parameters were reported: the body cannot be called.
        _ if !crate::lifetimes_only(generics) => None,
        // A parameter named like the agent, `async` or `unsafe` was reported: the body is left
        // out (below).
        _ if !callable => None,
        (0, _) => Some(None),
        (1, Some(FnArg::Typed(param))) => Some(Some(
            quote_spanned!(crate::located_at(&param.ty)=> __flue::agent::agent_parameter(__flue_props)),
        )),
        // A shape error was reported; keep the item compiling without piling on errors.
        _ => None,
    };
    let convert = match (argument, output) {
        // The return type may be `impl Into<Instruction>`, which cannot be named in a path: the
        // helper infers it from the body's value, and its call is spanned at the return type,
        // so a type that is no instruction is reported there.
        (Some(argument), ReturnType::Type(_, ty)) => {
            // Picked by method resolution (see `flue_core::agent::ReturnedValue`): a value
            // that is no instruction is reported with what an agent returns.
            let convert = quote_spanned!(crate::located_at(ty)=> (&__flue::agent::ReturnedValue(&__flue_returned))
                .__flue_instruction()
                .convert(__flue_returned));
            quote!({
                use __flue::agent::{Instructs as _, NotInstructs as _};
                let __flue_returned = __flue_agent_body(#argument);
                #convert
            })
        }
        (Some(argument), ReturnType::Default) => quote!({
            __flue_agent_body(#argument);
            __flue::Instruction::NONE
        }),
        (None, _) => quote!(__flue::Instruction::NONE),
    };

    let body = callable.then(|| {
        quote! {
            #(#other_attrs)*
            #[allow(dead_code)]
            fn __flue_agent_body #generics (#inputs) #output #where_clause {
                #(#inner_attrs)*
                #(#statements)*
            }
        }
    });

    let mut statics = Vec::new();
    let description = match model.description() {
        Some(description) => Description::Text(description.value()),
        None => Description::of(&function.attrs),
    };
    match (&description, description.expression()) {
        (Description::Expanded(..), Some(text)) => {
            // A description a macro writes may turn out blank: an agent needs none, so it is
            // left out then.
            statics.push(quote! {
                let __flue_description: &'static str = #text;
                if !__flue_description.is_empty() {
                    __flue_definition = __flue_definition.description(__flue_description);
                }
            });
        }
        (_, Some(text)) => statics.push(quote!(__flue_definition = __flue_definition.description(#text);)),
        (_, None) => {}
    }
    if let Some(ty) = &model.options.initial_data {
        statics
            .push(quote_spanned!(crate::located_at(ty)=> __flue_definition = __flue_definition.initial_data::<#ty>();));
    }
    if model.options.max_attempts.is_some() || model.timeout_ms.is_some() {
        let attempts = match &model.options.max_attempts {
            Some(attempts) => count(attempts),
            None => quote!(__flue::agent::Durability::DEFAULT.max_attempts),
        };
        let timeout = match model.timeout_ms {
            Some(ms) => quote!(::core::time::Duration::from_millis(#ms)),
            None => quote!(__flue::agent::Durability::DEFAULT.timeout),
        };
        statics.push(quote!(__flue_definition = __flue_definition.durability(__flue::agent::Durability { max_attempts: #attempts, timeout: #timeout });));
    }
    if let Some(steps) = &model.options.max_steps {
        let steps = count(steps);
        statics.push(quote!(__flue_definition = __flue_definition.max_steps(#steps);));
    }
    if let Some(hooks) = &model.options.hooks {
        let hooks = hooks
            .iter()
            .map(|hook| quote_spanned!(crate::located_at(hook)=> __flue::lifecycle::thread_hook(#hook)));
        statics.push(quote!(__flue_definition = __flue_definition.hooks(::std::vec![#(#hooks),*]);));
    }
    if model.options.exposed_as_tool() {
        statics.push(quote!(__flue_definition = __flue_definition.expose_as_tool();));
    }
    if !model.parent_hooks().is_empty() {
        let requirements = model.parent_hooks().iter().map(|requirement| {
            let hook = &requirement.hook;
            let reason = &requirement.reason;
            let stage = if requirement.stage == "before_parent" {
                quote!(__flue::agent::HookStage::BeforeParent)
            } else {
                quote!(__flue::agent::HookStage::AfterParent)
            };
            let hook = quote_spanned!(crate::located_at(hook)=> __flue::lifecycle::thread_hook(#hook));
            quote_spanned!(hook.span()=> __flue::agent::ParentHookRequirement { hook: #hook, stage: #stage, reason: #reason })
        });
        statics.push(quote!(__flue_definition = __flue_definition.parent_hooks(::std::vec![#(#requirements),*]);));
    }

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

        const _: () = {
            use #krate::__private::flue_core as __flue;

            // Out of the scope of `definition`'s static: the options' expressions (a hook list
            // naming a user's `DEFINITION`) see the user's items.
            fn __flue_definition_of() -> __flue::AgentDefinition {
                #[allow(unused_mut)]
                let mut __flue_definition = __flue::AgentDefinition::from_checked(::std::borrow::Cow::Borrowed(#name));
                #(#statics)*
                __flue_definition
            }

            // Through an alias: a `#[deprecated]` agent's impl does not warn, and the user's
            // body, inside it, still warns of what it uses.
            #[allow(deprecated)]
            type __FlueAgent = #ident;

            #[automatically_derived]
            impl __flue::Agent for __FlueAgent {
                fn definition(&self) -> &__flue::AgentDefinition {
                    static DEFINITION: ::std::sync::OnceLock<__flue::AgentDefinition> = ::std::sync::OnceLock::new();
                    DEFINITION.get_or_init(__flue_definition_of)
                }

                // A body called from another's is reported where it was called.
                #[track_caller]
                fn render_body(&self, __flue_props: __flue::AgentProps<'_>) -> __flue::Instruction {
                    let __flue_body = __flue::render::BodyGuard::enter();
                    #body
                    #convert
                }
            }
        };
    }
}

/// A count option's value as an unsuffixed `u32` literal at its span: a suffix or a value out
/// of range is reported by validation, and this keeps it from adding a type error of its own.
fn count(literal: &syn::LitInt) -> TokenStream {
    let mut value = proc_macro2::Literal::u32_unsuffixed(literal.base10_parse().unwrap_or(1));
    value.set_span(literal.span());
    quote!(#value)
}
