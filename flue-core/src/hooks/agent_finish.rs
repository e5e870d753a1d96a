use std::future::Future;

use super::{hook, root_only};
use crate::event_hooks::{AgentFinishContext, AgentFinishHook, IntoCallbackResult};

/// Runs `run` at every would-stop point of a response (the model made no more tool calls).
///
/// An `append` from the callback sends the model back to work within the same response; the
/// hook runs again at the next would-stop point. Callbacks run sequentially in declaration
/// order; 32 continued cycles per response is the ceiling. A returned error fails the
/// submission. Panics in subagent renders.
///
/// A response whose `max_steps` run out in a tool batch (or whose execution a hook stopped)
/// ends without a would-stop point. When the model stops on the last step it may take, the
/// callbacks run, and an append, which nothing could answer, fails the submission
/// (`agent_finish_unanswerable`) instead of being committed.
#[track_caller]
pub fn use_agent_finish<F, Fut>(run: F)
where
    F: Fn(AgentFinishContext) -> Fut + Send + Sync + 'static,
    Fut: Future + Send + 'static,
    Fut::Output: IntoCallbackResult,
{
    let callback = AgentFinishHook::new(run);
    hook("use_agent_finish", |frame| {
        root_only(
            frame,
            "[flue] use_agent_finish() is not available in a subagent render. Lifecycle hooks run against the root agent's durable record log; a delegate's contract is its task result — validate it in the parent.",
        )?;
        frame.rec.borrow_mut().agent_finishes.push(callback);
        Ok(())
    });
}
