//! `GET /:id/events`: the instance's live thread events over SSE — frames
//! `{"type":"event","eventType","data","timestamp"}` for `tool_call_started {id, name,
//! progress}` (while the response streams, at the moment the reference gives: see
//! `session/observation.rs`) and `tool_call_done {id, name, status}` (when the tool has run;
//! `error` for a call the abort ended),
//! sent whether or not any lifecycle hook is selected, and the events hooks and tools send
//! with `ThreadState::emit` (and `kv_changed` after `set_value`). Live only, at most once: a
//! reader that falls behind its own instance's events by more than [`BACKLOG`] events, or by
//! more than [`BACKLOG_BYTES`] of their frames, skips what it missed. A task per reader takes the instance's events off the runtime-wide broadcast as
//! they come, so a reader slowed by its socket is not made to skip them by other instances'
//! traffic (which overran the broadcast's backlog while the reader stalled).

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::Response;
use futures_util::StreamExt;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::sync::broadcast::{self, error::RecvError};

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::Routes;
use super::error::ApiError;
use crate::events::{Event, Observation};
use crate::store::InstanceKey;

/// How many of its instance's events a reader may fall behind by before it skips some.
const BACKLOG: usize = 256;

/// How many bytes of frames a reader may fall behind by before it skips some (beyond one
/// frame, whatever its size): an application's events have no size bound, and a reader that
/// takes a little now and then keeps its connection.
pub(super) const BACKLOG_BYTES: usize = 1024 * 1024;

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
fn instance_events(events: broadcast::Receiver<Arc<Observation>>, key: InstanceKey) -> Forwarded {
    forwarded(events, BACKLOG, move |observation| {
        if observation.agent.as_deref() != Some(&*key.agent) || observation.instance_id.as_deref() != Some(&*key.id) {
            return None;
        }
        thread_event(&observation).map(|event| format!("event: event\ndata:{event}\n\n"))
    })
}

/// The frames `pick` makes of `events`, taken off the broadcast as they come by a task of
/// their own (which ends with the receiver, or with the broadcast), for a reader that may
/// stall (an SSE connection whose socket is full): read from the broadcast only when the
/// reader goes on, what it keeps would be skipped with everything else the broadcast's backlog
/// lost meanwhile. Beyond `backlog` unread frames, or [`BACKLOG_BYTES`] of them, the newest are
/// dropped (live only, at most once).
pub(super) fn forwarded<T>(
    mut events: broadcast::Receiver<T>,
    backlog: usize,
    mut pick: impl FnMut(T) -> Option<String> + Send + 'static,
) -> Forwarded
where
    T: Clone + Send + 'static,
{
    let (sender, receiver) = mpsc::channel(backlog);
    let queued = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&queued);
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
            let Some(frame) = pick(event) else { continue };
            let bytes = frame.len();
            // Counted before it is sent, so the reader never takes off more than was put on.
            let held = counted.fetch_add(bytes, Ordering::AcqRel);
            if (held > 0 && held + bytes > BACKLOG_BYTES) || sender.try_send(frame).is_err() {
                counted.fetch_sub(bytes, Ordering::AcqRel);
            }
        }
    });
    Forwarded { receiver, queued }
}

/// A reader's frames, as [`forwarded`] keeps them.
pub(super) struct Forwarded {
    receiver: mpsc::Receiver<String>,
    /// The bytes of the frames not yet taken.
    queued: Arc<AtomicUsize>,
}

impl Forwarded {
    /// The next frame; `None` once the broadcast ended.
    pub(super) async fn recv(&mut self) -> Option<String> {
        let frame = self.receiver.recv().await?;
        self.queued.fetch_sub(frame.len(), Ordering::AcqRel);
        Some(frame)
    }
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
            Ok(Some(frame)) => frame,
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

    fn observed(index: u64, agent: &str, id: &str, tool_call_id: &str) -> Arc<Observation> {
        Arc::new(Observation {
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
        })
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
        while let Some(frame) = events.recv().await {
            mine.push(event_of(&frame)["data"]["id"].as_str().unwrap().to_owned());
        }
        assert_eq!(mine, ["call_mine", "call_mine_too"]);
    }

    /// The event a frame carries.
    fn event_of(frame: &str) -> Value {
        let data = frame.strip_prefix("event: event\ndata:").unwrap();
        serde_json::from_str(data.trim_end()).unwrap()
    }

    /// A reader that stalls holds at most [`BACKLOG_BYTES`] of frames (beyond the first):
    /// past it the newest are dropped, and it takes what it kept, then what comes once it
    /// has read.
    #[tokio::test]
    async fn a_stalled_reader_holds_a_bounded_number_of_bytes() {
        let (sender, receiver) = broadcast::channel(64);
        let mut events = forwarded(receiver, BACKLOG, |text: String| Some(text));
        let big = "x".repeat(400 * 1024);
        for _ in 0..4 {
            sender.send(big.clone()).unwrap();
        }
        tokio::task::yield_now().await;
        sender.send("small".to_owned()).unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        // Two big frames fit within the bound; the third and fourth passed it (the small one fits).
        let mut kept = Vec::new();
        for _ in 0..3 {
            kept.push(events.recv().await.unwrap().len());
        }
        assert_eq!(kept, [big.len(), big.len(), 5]);
        sender.send("after".to_owned()).unwrap();
        assert_eq!(events.recv().await.unwrap(), "after");
        // A frame larger than the bound still reaches a reader that holds nothing.
        sender.send("y".repeat(2 * BACKLOG_BYTES)).unwrap();
        assert_eq!(events.recv().await.unwrap().len(), 2 * BACKLOG_BYTES);
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
