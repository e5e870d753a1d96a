use std::future::Future;

use super::{hook, root_only};
use crate::event_hooks::{AgentStartContext, AgentStartHook, IntoCallbackResult};

/// Runs `run` when the agent starts work on a delivered message: after the input is durable,
/// before the model reads it (once per delivery, including deliveries that join a live
/// response).
///
/// Callbacks of one delivery run concurrently; their appends and state writes commit
/// atomically with the seam, so a crash re-runs them all and duplicates nothing durable. A
/// returned error fails the submission. Panics in subagent renders.
#[track_caller]
pub fn use_agent_start<F, Fut>(run: F)
where
    F: Fn(AgentStartContext) -> Fut + Send + Sync + 'static,
    Fut: Future + Send + 'static,
    Fut::Output: IntoCallbackResult,
{
    let callback = AgentStartHook::new(run);
    hook("use_agent_start", |frame| {
        root_only(
            frame,
            "[flue] use_agent_start() is not available in a subagent render. Lifecycle hooks run against the root agent's durable record log; a delegate runs a detached task — do its up-front work in the task itself.",
        )?;
        frame.rec.borrow_mut().agent_starts.push(callback);
        Ok(())
    });
}
