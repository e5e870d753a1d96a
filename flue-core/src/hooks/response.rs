use super::{hook, root_only};
use crate::event_hooks::{
    IntoMetadata, ResponseFinishContext, ResponseFinishHook, ResponseStartContext, ResponseStartHook,
};

/// Observes the response's true start (once per response, before the first model call and
/// before any `use_agent_start` callback). Return a JSON object to deep-merge onto the
/// response message's metadata, or `()` to only observe.
///
/// The callback is synchronous by its type: async work belongs in `use_agent_start`.
/// Panics in subagent renders.
#[track_caller]
pub fn use_response_start<F, M>(run: F)
where
    F: Fn(&ResponseStartContext) -> M + Send + Sync + 'static,
    M: IntoMetadata,
{
    let callback = ResponseStartHook::new(run);
    hook("use_response_start", |frame| {
        root_only(
            frame,
            "[flue] use_response_start() is not available in a subagent render. Response metadata decorates the agent's public conversation; delegates run detached tasks with no client-facing output.",
        )?;
        frame.rec.borrow_mut().response_starts.push(callback);
        Ok(())
    });
}

/// Observes the response's true end (once per response, after the last `use_agent_finish`
/// cycle), with final usage and tool calls. Same return contract as [`use_response_start`].
#[track_caller]
pub fn use_response_finish<F, M>(run: F)
where
    F: Fn(&ResponseFinishContext) -> M + Send + Sync + 'static,
    M: IntoMetadata,
{
    let callback = ResponseFinishHook::new(run);
    hook("use_response_finish", |frame| {
        root_only(
            frame,
            "[flue] use_response_finish() is not available in a subagent render. Response metadata decorates the agent's public conversation; delegates run detached tasks with no client-facing output.",
        )?;
        frame.rec.borrow_mut().response_finishes.push(callback);
        Ok(())
    });
}
