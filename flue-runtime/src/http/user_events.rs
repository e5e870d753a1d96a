//! `GET /users/:userId/events`: a user's live event stream over SSE. The first frame is
//! `{"event":"stream_ready","data":{"client_id"}}`; then every `UserState::emit` of that user
//! as `{"event","data"}`, with heartbeat comments. Connecting runs the `user_client_attached`
//! hooks and disconnecting the `user_client_detached` hooks, with `{id, kind}` from the
//! `client_id` (a fresh id when absent) and `client_kind` query parameters. Live only, at most
//! once: a reader that falls behind its user's events by more than [`BACKLOG`] events, or by
//! more than [`BACKLOG_BYTES`](super::thread_events::BACKLOG_BYTES) of their frames, skips what
//! it missed (other users' events never make it skip: see [`super::thread_events::forwarded`]).
//! Asked for without `Accept: text/event-stream`, and with neither `Sec-Fetch-Site`, `Origin`
//! nor `Authorization`, it is refused (see the module `http`): a page's element sends that.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderValue, Method, header};
use axum::response::Response;
use flue_core::lifecycle::ClientInfo;
use futures_util::StreamExt;
use serde_json::json;
use tokio::time::Instant;

use super::HttpOptions;
use super::error::ApiError;
use crate::lifecycle::UserEvent;
use crate::lifecycle::user::{UserHookEvent, dispatch};
use crate::record::new_id;
use crate::runtime::RuntimeInner;

/// The longest client id or kind accepted.
const MAX_CLIENT_FIELD: usize = 256;

/// How many of its user's events a reader may fall behind by before it skips some.
const BACKLOG: usize = 256;

#[derive(Clone)]
pub(super) struct UserRoutes {
    pub(super) runtime: Arc<RuntimeInner>,
    pub(super) options: Arc<HttpOptions>,
}

/// Runs `user_client_detached` when the response body (the connection) is dropped.
struct Attached {
    runtime: Arc<RuntimeInner>,
    user_id: String,
    client: ClientInfo,
}

impl Drop for Attached {
    fn drop(&mut self) {
        let event = UserHookEvent::ClientDetached(self.client.clone());
        dispatch(&self.runtime, &self.user_id, event);
    }
}

fn client_field(query: &mut HashMap<String, String>, name: &str) -> Result<Option<String>, ApiError> {
    match query.remove(name) {
        Some(value) if flue_core::message::is_blank(&value) => Ok(None),
        Some(value) if value.chars().count() > MAX_CLIENT_FIELD || value.chars().any(char::is_control) => {
            Err(ApiError::invalid_request(format!(
                "The {name} parameter must be at most {MAX_CLIENT_FIELD} printable characters."
            )))
        }
        other => Ok(other),
    }
}

/// The user route's `{user_id}`, taken by name (see [`super::InstancePath`]).
#[derive(serde::Deserialize)]
pub(super) struct UserPath {
    user_id: String,
}

/// `GET /users/:userId/events`.
pub(super) async fn get_user_events(
    State(routes): State<UserRoutes>,
    method: Method,
    user_id: Result<Path<UserPath>, PathRejection>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let mut query: HashMap<String, String> = super::reads::pairs(query.as_deref()).collect();
    let Path(UserPath { user_id }) = user_id.map_err(|rejection| ApiError::invalid_request(rejection.body_text()))?;
    if flue_core::message::is_blank(&user_id) || flue_core::lifecycle::check_user_id(&user_id).is_err() {
        return Err(ApiError::invalid_request(
            "User URLs need a user id of 1 to 512 characters, none of them a control character.",
        ));
    }
    let client = ClientInfo {
        id: client_field(&mut query, "client_id")?.unwrap_or_else(|| new_id("client")),
        kind: client_field(&mut query, "client_kind")?,
    };
    if method == Method::HEAD {
        // Only the headers: a HEAD (a health check, a link checker) is no client, so no
        // attach and detach hooks run for it.
        return Ok(event_stream(Body::empty()));
    }
    // Subscribed before the hooks hear of the client: nothing it emits in reply is missed.
    let events = {
        let user_id = user_id.clone();
        super::thread_events::forwarded(
            routes.runtime.user_events.subscribe(),
            BACKLOG,
            move |event: UserEvent| {
                (*event.user_id == *user_id)
                    .then(|| format!("data:{}\n\n", json!({"event": event.event, "data": event.data})))
            },
        )
    };
    dispatch(&routes.runtime, &user_id, UserHookEvent::ClientAttached(client.clone()));
    let ready = json!({"event": "stream_ready", "data": {"client_id": client.id}});
    let attached = Attached {
        runtime: routes.runtime.clone(),
        user_id: user_id.clone(),
        client,
    };
    let heartbeat = routes.options.heartbeat;
    let closed = routes.runtime.closed();
    let first = Bytes::from(format!("data:{ready}\n\n"));
    let state = (events, attached, Instant::now() + heartbeat, Some(first));
    let body = futures_util::stream::unfold(state, move |(mut events, attached, mut beat, first)| async move {
        if let Some(first) = first {
            return Some((Ok::<_, Infallible>(first), (events, attached, beat, None)));
        }
        let frame = match tokio::time::timeout_at(beat, events.recv()).await {
            Err(_) => {
                beat = Instant::now() + heartbeat;
                ": heartbeat\n\n".to_owned()
            }
            Ok(Some(frame)) => frame,
            Ok(None) => return None,
        };
        Some((Ok(Bytes::from(frame)), (events, attached, beat, None)))
    })
    // A runtime shutting down ends the stream.
    .take_until(closed);
    Ok(event_stream(Body::from_stream(body)))
}

/// An SSE response of `body`.
fn event_stream(body: Body) -> Response {
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}
