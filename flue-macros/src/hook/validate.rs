//! The compile-time rules of `#[hook]`.

use syn::{FnArg, ReturnType};

use super::model::HookModel;
use crate::errors::Errors;

pub(crate) fn check(model: &HookModel, errors: &Errors) {
    crate::render_hooks::check_outside_render(&model.function.block, crate::render_hooks::Body::LifecycleHook, errors);
    let (id, span) = &model.id;
    if !is_identity(id) {
        errors.push(syn::Error::new(
            *span,
            format!(
                "hook id \"{id}\" must be snake_case: lowercase letters, digits and underscores, starting with a letter"
            ),
        ));
    }
    let sig = &model.function.sig;
    let kind = model.kind;
    if let Some(unsafety) = &sig.unsafety {
        errors.spanned(
            unsafety,
            "a lifecycle hook cannot be `unsafe`: the runtime calls it from safe code, so nothing would uphold its safety contract; make it safe and use `unsafe` blocks inside",
        );
    }
    if let Some(constness) = &sig.constness {
        errors.spanned(
            constness,
            "a lifecycle hook cannot be `const`: the runtime calls it at run time, through its handler, never in a constant; remove `const`",
        );
    }
    if let Some(abi) = &sig.abi {
        errors.spanned(
            abi,
            "a lifecycle hook cannot be `extern`: the runtime calls it as a Rust function and turns a panic into a hook error, where another ABI would abort the process; remove the `extern` qualifier",
        );
    }
    if let Some((param, _)) = crate::parameter_named_like_item(sig) {
        errors.spanned(
            param,
            format!(
                "rename the parameter: `{}` names the hook itself, which is in scope in the body, so the parameter would be a pattern matching the hook, not a binding",
                syn::ext::IdentExt::unraw(param)
            ),
        );
    }
    if !crate::lifetimes_only(&sig.generics) {
        errors.spanned(
            &sig.generics,
            "a lifecycle hook cannot be generic over types or constants",
        );
    }
    if let Some(FnArg::Receiver(receiver)) = sig.inputs.first() {
        errors.spanned(
            receiver,
            "a lifecycle hook is a free function, not a method: remove the `self` parameter",
        );
        return;
    }
    if sig.inputs.len() != kind.params.len() {
        let blame = sig.inputs.iter().nth(kind.params.len()).map_or_else(
            || syn::Error::new_spanned(&sig.ident, ""),
            |extra| syn::Error::new_spanned(extra, ""),
        );
        errors.push(syn::Error::new(
            blame.span(),
            format!("{} `{}` hook {}", article(kind.name), kind.name, kind.signature()),
        ));
    }
    if kind.is_transform() && matches!(sig.output, ReturnType::Default) {
        errors.spanned(
            &sig.ident,
            format!("{} `{}` hook {}", article(kind.name), kind.name, kind.signature()),
        );
    }
}

/// "an `after_…` hook", "a `tool_call_done` hook", "a `user_…` hook" (said "you-ser").
fn article(kind: &str) -> &'static str {
    if kind.starts_with(['a', 'e', 'i', 'o']) {
        "an"
    } else {
        "a"
    }
}

fn is_identity(name: &str) -> bool {
    let mut bytes = name.bytes();
    matches!(bytes.next(), Some(b'a'..=b'z')) && bytes.all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_'))
}
