use serde::de::DeserializeOwned;

use super::hook;
use crate::render::RenderKind;

/// The instance's creation data, recorded once when the instance was created.
///
/// `None` when creation carried no data, on bare renders and in subagent renders. With an
/// `initial_data` type on the agent the value was validated at creation. Panics when the
/// recorded data does not deserialize as `T`.
#[track_caller]
pub fn use_initial_data<T: DeserializeOwned>() -> Option<T> {
    hook("use_initial_data", |frame| {
        if frame.state.kind() == RenderKind::Subagent {
            return Ok(None);
        }
        match frame.state.initial_data() {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(value) => T::deserialize(value).map(Some).map_err(|error| {
                format!("[flue] use_initial_data() could not read the creation data as the requested type: {error}.")
            }),
        }
    })
}
