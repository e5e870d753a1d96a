//! The compile-time rules of `#[agent]`.

use quote::ToTokens;
use syn::FnArg;

use super::model::AgentModel;
use crate::errors::Errors;

pub(crate) fn check(model: &AgentModel, errors: &Errors) {
    super::hook_calls::check(&model.function.block, errors);
    crate::render_hooks::check_outside_render(&model.function.block, crate::render_hooks::Body::Agent, errors);
    let sig = &model.function.sig;
    if let Some(unsafety) = &sig.unsafety {
        errors.spanned(
            unsafety,
            "an agent function cannot be `unsafe`: the runtime calls it from safe code, so nothing would uphold its safety contract; make it safe and use `unsafe` blocks inside",
        );
    }
    if let Some(asyncness) = &sig.asyncness {
        errors.spanned(
            asyncness,
            "an agent function must be synchronous: it is rendered before every model call. Move async work into tools or use_agent_start callbacks",
        );
    }
    // Named lifetimes (`fn assistant<'a>(props: AgentProps<'a>)`) are only spelling: the body
    // keeps them. Types and constants cannot be chosen by the runtime that renders the agent.
    if !crate::lifetimes_only(&sig.generics) {
        errors.spanned(
            &sig.generics,
            "an agent function cannot be generic over types or constants",
        );
    }
    let mut inputs = sig.inputs.iter();
    if let Some(first) = inputs.next()
        && let FnArg::Receiver(receiver) = first
    {
        errors.spanned(
            receiver,
            "an agent is a free function, not a method: remove the `self` parameter",
        );
    }
    for extra in inputs {
        errors.spanned(extra, "an agent function takes no parameters or one `AgentProps`");
    }
    if let Some((param, _)) = crate::parameter_named_like_item(sig) {
        errors.spanned(
            param,
            format!(
                "rename the parameter: `{}` names the agent itself, which is in scope in the body, so the parameter would be a pattern matching the agent, not a binding (`props: AgentProps`)",
                syn::ext::IdentExt::unraw(param)
            ),
        );
    }
    let (name, span) = &model.name;
    if !is_identity(name) {
        errors.push(syn::Error::new(
            *span,
            format!("agent name \"{name}\" is not a valid identity: use snake_case matching ^[a-z][a-z0-9_]*$"),
        ));
    }
    if let Some(description) = model.description()
        && description.value().trim().is_empty()
    {
        errors.spanned(
            description,
            "an agent's description cannot be blank: write what the agent does, or leave `description` out",
        );
    }
    if let Some(steps) = &model.options.max_steps {
        check_count(steps, "max_steps", errors);
    }
    if let Some(attempts) = &model.options.max_attempts {
        check_count(attempts, "max_attempts", errors);
    }
    let hooks = model.options.hooks.as_deref().unwrap_or_default();
    for (index, hook) in hooks.iter().enumerate() {
        let name = hook.to_token_stream().to_string();
        if hooks[..index]
            .iter()
            .any(|earlier| earlier.to_token_stream().to_string() == name)
        {
            errors.spanned(
                hook,
                format!(
                    "hooks names the hook `{name}` twice; select each hook once (hooks of one kind run in listed order)"
                ),
            );
        }
    }
    let requirements = model.parent_hooks();
    if !requirements.is_empty() && !model.options.exposed_as_tool() {
        errors.spanned(
            &requirements[0].hook,
            "only an agent with `expose_as_tool` can declare parent_hooks: add `expose_as_tool` to #[agent(..)]",
        );
    }
    for (index, requirement) in requirements.iter().enumerate() {
        let hook = requirement.hook.to_token_stream().to_string();
        if requirements[..index]
            .iter()
            .any(|earlier| earlier.hook.to_token_stream().to_string() == hook)
        {
            errors.spanned(
                &requirement.hook,
                format!("parent_hooks names the hook `{hook}` twice; require each hook once"),
            );
        }
        if requirement.reason.value().trim().is_empty() {
            errors.spanned(
                &requirement.reason,
                "a parent hook needs a non-blank reason, shown to whoever composes this agent",
            );
        }
        let stage = requirement.stage.to_string();
        if stage != "before_parent" && stage != "after_parent" {
            errors.spanned(
                &requirement.stage,
                format!("unknown stage `{stage}`; expected `before_parent` or `after_parent`"),
            );
        }
    }
}

fn is_identity(name: &str) -> bool {
    let mut bytes = name.bytes();
    matches!(bytes.next(), Some(b'a'..=b'z')) && bytes.all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_'))
}

/// A count option (`max_steps`, `max_attempts`): a positive `u32`, written without a suffix
/// or with `u32`.
fn check_count(count: &syn::LitInt, option: &str, errors: &Errors) {
    if !matches!(count.suffix(), "" | "u32") {
        errors.spanned(
            count,
            format!(
                "{option} is a u32: write it without a suffix, like `{option} = {}`",
                count.base10_digits()
            ),
        );
        return;
    }
    match count.base10_parse::<u32>() {
        Ok(0) => errors.spanned(count, format!("{option} must be a positive integer")),
        Ok(_) => {}
        Err(_) => errors.spanned(count, format!("{option} must fit in a u32 (at most {})", u32::MAX)),
    }
}
