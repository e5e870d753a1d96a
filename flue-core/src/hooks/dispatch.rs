use std::fmt;
use std::sync::Arc;

use super::{hook, root_only, violation};
use crate::BoxFuture;
use crate::binding::{DispatchError, RuntimeBinding};
use crate::message::{DeliveredMessage, DispatchReceipt};
use crate::render::is_rendering;

/// A dispatcher bound to this instance: the same admission as every transport.
///
/// A dispatch to the busy instance joins the live response at its next turn boundary; to an
/// idle instance it wakes a new response. A response that can make no more model steps (its
/// `max_steps` spent, its execution stopped) joins nothing: the delivery waits in the queue
/// and gets a response of its own. Panics in subagent renders.
#[track_caller]
pub fn use_dispatch_message() -> Dispatcher {
    hook("use_dispatch_message", |frame| {
        root_only(
            frame,
            "[flue] use_dispatch_message() is not available in a subagent render. A delegate has no instance of its own to dispatch to — return what it produced as its task result instead.",
        )?;
        Ok(Dispatcher {
            binding: frame.state.binding().cloned(),
        })
    })
}

/// Dispatches messages to the instance that rendered it. `Clone + Send + 'static`.
#[derive(Clone)]
pub struct Dispatcher {
    binding: Option<Arc<dyn RuntimeBinding>>,
}

impl Dispatcher {
    /// Admits `message` (a `&str`/`String` is a user message) and resolves to its receipt.
    ///
    /// Panics when called during a render. Fails on a bare render and for an invalid message.
    #[track_caller]
    pub fn dispatch(
        &self,
        message: impl Into<DeliveredMessage>,
    ) -> BoxFuture<'static, Result<DispatchReceipt, DispatchError>> {
        if is_rendering() {
            violation(
                "[flue] The use_dispatch_message() dispatcher was called during render. Renders are pure reads — dispatch from tool run functions, effects, and other callbacks.".to_owned(),
            );
        }
        let message = message.into();
        let result = match (&self.binding, message.validate()) {
            (None, _) => Err(DispatchError::NoRuntime),
            (Some(_), Err(error)) => Err(DispatchError::InvalidMessage(error)),
            (Some(binding), Ok(())) => return binding.dispatch(message),
        };
        Box::pin(std::future::ready(result))
    }
}

impl fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dispatcher")
            .field("has_runtime", &self.binding.is_some())
            .finish()
    }
}
