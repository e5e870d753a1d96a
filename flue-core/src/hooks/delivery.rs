use std::sync::Arc;

use super::hook;
use crate::message::DeliveredMessage;

/// The message currently in front of the model: the delivery that woke the response, advanced
/// by joined deliveries and appended signals. In a subagent render, the parent's task prompt.
///
/// Constant within a render. Panics on a render with no delivery behind it (bare renders).
#[track_caller]
pub fn use_delivery() -> Arc<DeliveredMessage> {
    hook("use_delivery", |frame| {
        frame.state.delivery().cloned().ok_or_else(|| {
            "[flue] use_delivery() found no delivered message behind this render. Every agent run in the runtime is triggered by one; a direct render outside the runtime (tests, tooling) must supply a `delivery` in its render-state context.".to_owned()
        })
    })
}
