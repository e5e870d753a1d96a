use std::borrow::Cow;

use super::{hook, root_only};
use crate::model::ModelOptions;
use crate::render::ModelDeclaration;

/// Declares the agent's model: `use_model("anthropic/claude-sonnet-4-5")`.
///
/// Required, exactly once per root render. The specifier may vary render to render, but the
/// runtime reads it once per submission (submission-scoped). Panics when called twice, with a
/// blank specifier, or in a subagent render (a delegate's model comes from its `Subagent`).
#[track_caller]
pub fn use_model(spec: impl Into<Cow<'static, str>>) {
    use_model_with(spec, ModelOptions::default());
}

/// [`use_model`] with a thinking level and compaction settings.
///
/// ```
/// use flue_core::prelude::*;
///
/// let agent = FnAgent::new(AgentDefinition::new("thinker"), |_| {
///     use_model_with("anthropic/claude-sonnet-4-5", ModelOptions::thinking(ThinkingLevel::High));
/// });
/// let rendered = flue_core::render_bare(&agent).unwrap();
/// assert_eq!(rendered.model.unwrap().options.thinking_level, Some(ThinkingLevel::High));
/// ```
#[track_caller]
pub fn use_model_with(spec: impl Into<Cow<'static, str>>, options: ModelOptions) {
    let spec = spec.into();
    hook("use_model", |frame| {
        root_only(
            frame,
            "[flue] use_model() is not available in a subagent render. A delegate declares its model on its use_subagent() definition.",
        )?;
        let mut rec = frame.rec.borrow_mut();
        if rec.model.is_some() {
            return Err("[flue] use_model() was called twice in one render. An agent has one model; call use_model() exactly once (compute the specifier before the call if it depends on state).".to_owned());
        }
        if spec.trim().is_empty() {
            return Err(
                "[flue] use_model() requires a model specifier string, like 'anthropic/claude-sonnet-4-6'.".to_owned(),
            );
        }
        options.validate().map_err(|error| error.to_string())?;
        rec.model = Some(ModelDeclaration { spec, options });
        Ok(())
    });
}
