//! `GET /:id/events`: the instance's live thread events over SSE — frames
//! `{"type":"event","eventType","data","timestamp"}` for `tool_call_started {id, name,
//! progress}` (while the response streams, at the moment the reference gives: see
//! `session/observation.rs`) and `tool_call_done {id, name, status}` (when the tool has run),
//! sent whether or not any lifecycle hook is selected, and the events hooks and tools send
//! with `ThreadState::emit` (and `kv_changed` after `set_value`). Live only, at most once: a reader that
//! falls behind skips what it missed.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::Response;
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::sync::broadcast::error::RecvError;
use tokio::time::Instant;

use super::Routes;
use super::error::ApiError;
use crate::events::{Event, Observation};

/// The thread event an observation is, if it is one.
fn thread_event(observation: &Observation) -> Option<Value> {
    let (event_type, data) = match &observation.event {
        Event::ToolCallStarted {
            tool_call_id,
            tool_name,
            progress,
        } => (
            "tool_call_started",
            json!({"id": tool_call_id, "name": tool_name, "progress": progress}),
        ),
        Event::ThreadEvent { event_type, data } => (event_type.as_str(), data.clone()),
        Event::ToolCallDone {
            tool_call_id,
            tool_name,
            status,
        } => (
            "tool_call_done",
            json!({"id": tool_call_id, "name": tool_name, "status": status}),
        ),
        _ => return None,
    };
    Some(json!({
        "type": "event",
        "eventType": event_type,
        "data": data,
        "timestamp": observation.timestamp,
    }))
}

/// `GET /:id/events`.
pub(super) async fn get_events(State(routes): State<Routes>, id: super::InstanceId) -> Result<Response, ApiError> {
    let key = routes.key(id)?;
    let events = routes.runtime.observe();
    let closed = routes.runtime.closed();
    let heartbeat = routes.options.heartbeat;
    let state = (events, key, Instant::now() + heartbeat);
    let body = futures_util::stream::unfold(state, move |(mut events, key, mut beat)| async move {
        loop {
            let received = tokio::time::timeout_at(beat, events.recv()).await;
            let frame = match received {
                Err(_) => {
                    beat = Instant::now() + heartbeat;
                    ": heartbeat\n\n".to_owned()
                }
                Ok(Ok(observation)) => {
                    if observation.agent.as_deref() != Some(&*key.agent)
                        || observation.instance_id.as_deref() != Some(&*key.id)
                    {
                        continue;
                    }
                    let Some(event) = thread_event(&observation) else {
                        continue;
                    };
                    format!("event: event\ndata:{event}\n\n")
                }
                // Live only: a lagging reader skips what it missed.
                Ok(Err(RecvError::Lagged(_))) => continue,
                Ok(Err(RecvError::Closed)) => return None,
            };
            return Some((Ok::<_, Infallible>(Bytes::from(frame)), (events, key, beat)));
        }
    })
    // A runtime shutting down ends the stream.
    .take_until(closed);
    let mut response = Response::new(Body::from_stream(body));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Ok(response)
}
