use std::future::Future;

use super::{hook, root_only};
use crate::event_hooks::{AgentFinishContext, AgentFinishHook, IntoCallbackResult};

/// Runs `run` at every would-stop point of a response: where its turns end (the model made no
/// more tool calls, a terminating batch ended them, or no model step is left).
///
/// An `append` from the callback sends the model back to work within the same response; the
/// hook runs again at the next would-stop point. Callbacks run sequentially in declaration
/// order; 32 continued cycles per response is the ceiling. A returned error fails the
/// submission. Panics in subagent renders.
///
/// A response whose `max_steps` run out (in an answer or in a tool batch), or whose execution
/// was stopped (`ExecutionState::stop`), reaches its would-stop point there, where no model
/// call may follow: the callbacks run, and an append is not stored, since nothing could
/// answer it: at a spent `max_steps` it fails the submission (`agent_finish_unanswerable`),
/// so a check the model was cut off before meeting is not skipped silently; after a stop the
/// response completes with what it has.
/// When the abort signal fires after the response's end was durable, nothing a callback does
/// then continues or fails it (an append is not stored, an error only logged): the response
/// ends as it is, completed.
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
