//! `GET /:id/events`: the instance's live thread events over SSE — frames
//! `{"type":"event","eventType","data","timestamp"}` for `tool_call_started {id, name,
//! progress}` (while the response streams, at the moment the reference gives: see
//! `session/observation.rs`) and `tool_call_done {id, name, status}` (when the tool has run;
//! `error` for a call the abort ended),
//! sent whether or not any lifecycle hook is selected, and the events hooks and tools send
//! with `ThreadState::emit` (and `kv_changed` after `set_value`). Live only, at most once: a
//! reader that falls behind its own instance's events by more than [`BACKLOG`] skips what it
//! missed. A task per reader takes the instance's events off the runtime-wide broadcast as
//! they come, so a reader slowed by its socket is not made to skip them by other instances'
//! traffic (which overran the broadcast's backlog while the reader stalled).

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::Response;
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::sync::broadcast::{self, error::RecvError};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::Routes;
use super::error::ApiError;
use crate::events::{Event, Observation};
use crate::store::InstanceKey;

/// How many of its instance's events a reader may fall behind by before it skips some.
const BACKLOG: usize = 256;

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

/// The thread events of the instance `key` among `events`, taken off the broadcast as they
/// come (see [`forwarded`]): a reader falls behind its instance's events only.
fn instance_events(events: broadcast::Receiver<Observation>, key: InstanceKey) -> mpsc::Receiver<Value> {
    forwarded(events, BACKLOG, move |observation| {
        if observation.agent.as_deref() != Some(&*key.agent) || observation.instance_id.as_deref() != Some(&*key.id) {
            return None;
        }
        thread_event(&observation)
    })
}

/// What `pick` keeps of `events`, taken off the broadcast as they come by a task of their own
/// (which ends with the receiver, or with the broadcast), for a reader that may stall (an
/// SSE connection whose socket is full): read from the broadcast only when the reader goes
/// on, what it keeps would be skipped with everything else the broadcast's backlog lost
/// meanwhile. Beyond `backlog` unread, the newest are dropped (live only, at most once).
pub(super) fn forwarded<T, U>(
    mut events: broadcast::Receiver<T>,
    backlog: usize,
    mut pick: impl FnMut(T) -> Option<U> + Send + 'static,
) -> mpsc::Receiver<U>
where
    T: Clone + Send + 'static,
    U: Send + 'static,
{
    let (sender, receiver) = mpsc::channel(backlog);
    tokio::spawn(async move {
        loop {
            let event = tokio::select! {
                () = sender.closed() => return,
                received = events.recv() => match received {
                    Ok(event) => event,
                    // Only the broadcast's own backlog overran: this task was not scheduled
                    // for that long.
                    Err(RecvError::Lagged(_)) => continue,
                    Err(RecvError::Closed) => return,
                },
            };
            if let Some(kept) = pick(event) {
                let _ = sender.try_send(kept);
            }
        }
    });
    receiver
}

/// `GET /:id/events`.
pub(super) async fn get_events(State(routes): State<Routes>, id: super::InstanceId) -> Result<Response, ApiError> {
    let key = routes.read_key(id)?;
    let events = instance_events(routes.runtime.observe_thread_events(), key);
    let closed = routes.runtime.closed();
    let heartbeat = routes.options.heartbeat;
    let state = (events, Instant::now() + heartbeat);
    let body = futures_util::stream::unfold(state, move |(mut events, mut beat)| async move {
        let frame = match tokio::time::timeout_at(beat, events.recv()).await {
            Err(_) => {
                beat = Instant::now() + heartbeat;
                ": heartbeat\n\n".to_owned()
            }
            Ok(Some(event)) => format!("event: event\ndata:{event}\n\n"),
            Ok(None) => return None,
        };
        Some((Ok::<_, Infallible>(Bytes::from(frame)), (events, beat)))
    })
    // A runtime shutting down ends the stream.
    .take_until(closed);
    let mut response = Response::new(Body::from_stream(body));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Ok(response)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use super::*;

    fn observed(index: u64, agent: &str, id: &str, tool_call_id: &str) -> Observation {
        Observation {
            agent: Some(agent.to_owned()),
            instance_id: Some(id.to_owned()),
            submission_id: None,
            operation_id: None,
            turn_id: None,
            task_id: None,
            event_index: index,
            timestamp: "2026-12-06T00:00:00.000Z".to_owned(),
            event: Event::ToolCallDone {
                tool_call_id: tool_call_id.to_owned(),
                tool_name: "add".to_owned(),
                status: "success".to_owned(),
            },
        }
    }

    /// A reader that stalls (its socket full) while other instances' events overrun the
    /// broadcast's backlog still gets its own instance's events: they were taken off the
    /// broadcast as they came. (Read from the broadcast only when the reader went on, they
    /// were among what it skipped.)
    #[tokio::test]
    async fn a_stalled_reader_keeps_its_instances_events_through_other_instances_traffic() {
        let (sender, receiver) = broadcast::channel(8);
        let mut events = instance_events(receiver, InstanceKey::new("desk", "a"));
        sender.send(observed(0, "desk", "a", "call_mine")).unwrap();
        tokio::task::yield_now().await;
        for index in 1..=100 {
            sender.send(observed(index, "desk", "b", "call_theirs")).unwrap();
            if index % 4 == 0 {
                tokio::task::yield_now().await;
            }
        }
        sender.send(observed(101, "desk", "a", "call_mine_too")).unwrap();
        drop(sender);
        let mut mine = Vec::new();
        while let Some(event) = events.recv().await {
            mine.push(event["data"]["id"].as_str().unwrap().to_owned());
        }
        assert_eq!(mine, ["call_mine", "call_mine_too"]);
    }

    /// Dropping the reader ends its task (no task per closed connection stays behind).
    #[tokio::test]
    async fn a_reader_gone_ends_its_task() {
        let (sender, receiver) = broadcast::channel(8);
        let events = instance_events(receiver, InstanceKey::new("desk", "a"));
        drop(events);
        tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while sender.receiver_count() > 0 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the task let go of the broadcast");
    }
}
