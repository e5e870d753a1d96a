//! Serving agents over HTTP: the streaming protocol of the reference system, so that a client
//! written for it works unchanged.
//!
//! [`router`] mounts every agent of a runtime under `/agents/<name>`; [`agent_router`] serves
//! one agent at the router's root. Per instance:
//!
//! | Route | What |
//! |---|---|
//! | `POST /:id` | Admits a message (202 with `{streamUrl, offset, submissionId, uid}`). |
//! | `GET /:id` | The history snapshot (`view=history`, the default). |
//! | `GET /:id?view=updates&offset=…` | Chunks after `offset`, as JSON (a page: at most 100 batches, and no batch after 4 MiB of chunks; `Stream-Up-To-Date` says whether it reaches the head); `live=long-poll` waits for them, `live=sse` streams them (catching up a page per control frame). |
//! | `HEAD /:id` | The stream's head offset. |
//! | `POST /:id/abort` | Requests an abort of the instance's unsettled submissions. |
//! | `GET /:id/attachments/:attachmentId` | An attachment's bytes. |
//! | `GET /:id/events` | Live thread events over SSE (`tool_call_started`, `tool_call_done`). |
//! | `GET /agents` | The catalog ([`router`] only). |
//! | `GET /users/:userId/events` | A user's live events over SSE, read with `Accept: text/event-stream`; runs the `user_client_attached`/`_detached` hooks ([`router`] only). |
//!
//! Every failure answers the error envelope `{"error":{"type","message","details",…}}` with
//! its type's status ([`ApiError`]); every response carries `X-Content-Type-Options: nosniff`
//! and `Cross-Origin-Resource-Policy: cross-origin`.
//!
//! Browsers on other sites: a message's body must be declared JSON by its media type (a body
//! declared `text/plain` is refused, though a browser sends one cross-site without a CORS
//! preflight), and a request that changes state (or runs hooks: the user routes) sent by a
//! browser from another site (`Sec-Fetch-Site: cross-site`; `same-site` with no `Origin` or one
//! that is not the request's `Host`; without `Sec-Fetch-Site`, an `Origin` that is not the
//! `Host`: a page on another port of `localhost` included) is refused (403) unless
//! [`HttpOptions::allow_cross_site`] is set. A user's event stream asked for without
//! `Accept: text/event-stream` and with neither header nor an `Authorization` (an `<img>` on
//! a page that a browser sends to a plain-HTTP address it does not trust sends none of them)
//! is refused too.
//! A web page a developer happens to open cannot drive the agents served on their machine.
//!
//! ```no_run
//! # async fn serve(runtime: flue_runtime::Runtime) -> std::io::Result<()> {
//! use flue_runtime::http::HttpOptions;
//! let options = HttpOptions::default();
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3583").await?;
//! let app = flue_runtime::http::router_with(&runtime, options.clone());
//! flue_runtime::http::serve(listener, app, &options, std::future::pending()).await
//! # }
//! ```
//!
//! [`serve`] bounds what a client can hold: a deadline on each request head, a deadline on
//! each stalled write of a response, a connection cap
//! ([`HttpOptions::request_head_timeout`], [`HttpOptions::response_write_timeout`],
//! [`HttpOptions::max_connections`]); the router itself bounds a message body's size, the time
//! it takes to arrive, and the bytes of all the bodies it holds at once
//! ([`HttpOptions::max_buffered_request_bytes`]). Served another way (`axum::serve`, which runs
//! hyper without a timer), the head and write deadlines and the cap are the server's to set.
//!
//! Live reads (SSE streams, event streams, long polls) never end on their own, and a graceful
//! shutdown waits for every open response: call [`Runtime::shutdown`](crate::Runtime::shutdown)
//! in the shutdown signal, which ends them, or serve with [`crate::cli::serve`], which does.

mod admission;
pub mod auth;
mod catalog;
mod error;
mod feed;
mod projection;
mod reads;
mod server;
mod thread_events;
mod updates_cache;
mod user_events;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{DefaultBodyLimit, OriginalUri, Path, RawQuery, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, any, get, post};
use serde_json::json;

pub use auth::{Access, AccessRequest, Authorize, BearerTokens, Denied};
pub use error::ApiError;
pub use server::serve;

use crate::Runtime;
use crate::record::format_offset;
use crate::runtime::RuntimeInner;
use crate::store::{InstanceKey, SubmissionKind};

/// The largest request body, in bytes: room for a message with an image at the protocol's
/// limit (14,680,064 base64 characters).
pub const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

/// Access control and the timing of live reads.
///
/// The live reads' durations are bounded when a router is built: one past a year (such as
/// `Duration::MAX`, meant as "for ever") counts as a year, and the intervals every live reader
/// repeats at count as at least 100 ms (`sse_wait`, `heartbeat`) and 10 ms
/// (`shared_store_poll`): at zero, each reader would loop without pause.
#[derive(Clone)]
pub struct HttpOptions {
    /// Asked before every request is handled (401/403 when it refuses); `None` serves
    /// everyone, as the reference protocol does.
    pub authorization: Option<Arc<dyn Authorize>>,
    /// How long a long-poll read waits for new batches (the reference: 30 s).
    pub long_poll_timeout: Duration,
    /// How long an up-to-date SSE stream stays silent before it sends a control frame again,
    /// which keeps intermediaries from closing an idle stream (30 s).
    pub sse_wait: Duration,
    /// The interval of SSE heartbeat comments while a stream is idle (15 s).
    pub heartbeat: Duration,
    /// How often live readers read a shared store (one other nodes append to) again, since
    /// only this node's appends wake them, and other nodes' settlements on a store that
    /// announces them (`PostgresStore`): what another node streams mid-response shows at this
    /// pace (250 ms).
    pub shared_store_poll: Duration,
    /// How many instances' reads are cached, per agent (256; 0 caches none): `view=updates`
    /// JSON and long-poll reads, `view=history` and SSE readers' catch-up. An instance's entry
    /// holds the fold of its stream at the newest offset read and the serialized chunks of its
    /// newest batches (at most 1024 batches and 256 KiB), so a client polling a long
    /// conversation, reloading its history or reconnecting its SSE reader costs what is new
    /// since the entry's last read, not a fold of the whole stream. The least recently read
    /// instance is evicted first; a read before an entry's window folds the stream from the
    /// start, as an uncached read does.
    pub updates_cache_instances: usize,
    /// About how many bytes those entries hold together, per agent, their folds and chunks
    /// (128 MiB): past it the least recently read go, all but the one a read just folded. A
    /// fold holds about what its conversation's records hold, so a few long conversations
    /// cannot make the cache hold them all.
    pub updates_cache_bytes: usize,
    /// Whether a browser may send requests that change state (any method but `GET` and
    /// `HEAD`, and any request of the user routes, whose reads run the application's hooks)
    /// from another site (`Sec-Fetch-Site: cross-site`; `same-site` with no `Origin` or one
    /// that is not the request's `Host`, such as a page on another port of `localhost`; from a
    /// browser that sends no `Sec-Fetch-Site`, an `Origin` that is not the `Host`). Off by
    /// default: a web page a
    /// developer happens to open could otherwise abort, or post messages to, the agents
    /// served on their machine (a request with no body, or one whose body is not declared
    /// JSON, needs no CORS preflight). Turn it on to serve a browser app on another site
    /// through a CORS layer.
    pub allow_cross_site: bool,
    /// The host names this server answers to while it serves without an
    /// [`authorization`](Self::authorization) policy, besides `localhost` (and its
    /// subdomains) and IP addresses: compared with the request's `Host` (its port aside, ASCII
    /// case aside). Empty by default. The guard against DNS rebinding: a page on another site
    /// can point its own name at `127.0.0.1` and then, to the browser, be the same site as an
    /// agent server on the developer's machine, free to read and post. A request by any other
    /// name is refused (403), whatever sent it: over plain HTTP a browser's same-site read
    /// carries nothing that tells it apart from another client's. Once an authorization
    /// policy is set, the name is not checked.
    pub allowed_hosts: Vec<String>,
    /// How long a message's body may go without any of it arriving (60 s, between two reads
    /// as nginx's `client_body_timeout`): a client that sends part of a body and stalls is
    /// answered 408 `request_timeout` and no longer holds what it sent, while a large body on
    /// a slow link arrives in its own time.
    pub request_body_timeout: Duration,
    /// How long a message's whole body may take to arrive (5 min; 16 MiB at 56 KB/s): a client
    /// that keeps sending a little at a time, within
    /// [`request_body_timeout`](Self::request_body_timeout), is answered 408 `request_timeout`
    /// once this has passed, and no longer holds the room its body took.
    pub request_body_deadline: Duration,
    /// How many bytes of message bodies the router holds at once, all requests together
    /// (256 MiB; at least one body of [`MAX_BODY_BYTES`] fits). A body takes room for its
    /// bytes as they arrive, and holds it until its admission is made; once parsed, its
    /// initial data and a signal's attributes take room for what their nodes weigh too (dense
    /// JSON parses to many times its text), up to the whole room. One whose next bytes, or
    /// whose parsed nodes, find no room is answered 503 `server_busy` at once (with
    /// `Retry-After`), and frees what it held. Many clients sending large bodies cannot make
    /// the server hold more than this (nor parse more than this at once), and a client sending
    /// slowly holds only what it sent, for as long as
    /// [`request_body_deadline`](Self::request_body_deadline) lets it: clients that send this
    /// much and then trickle keep others' messages out until then.
    /// Shared by the agents of one [`router_with`]; each [`agent_router`] has its own.
    pub max_buffered_request_bytes: usize,
    /// About how many bytes the reads that fold a conversation themselves hold at once, all
    /// readers together (512 MiB, at most 4 GiB). An SSE reader whose offset is before the
    /// updates cache's window folds the conversation up to its offset itself, and holds that
    /// fold and a page of batches until the instance's live feed serves it, at the pace its
    /// client takes bytes. A JSON, long-poll or `view=history` read that the cache does not
    /// serve holds its fold while it is made and answered, and so does the read that fills an
    /// instance's cache entry (readers who come at once wait for that one, and read what it
    /// made). An instance's live feed holds its fold here too, for as long as the instance is
    /// followed (the room of the reader it took over, which lets its own go). One that finds
    /// no room is answered 503 `server_busy` (with `Retry-After`), before
    /// it reads any batch; an SSE reader whose fold outgrows the room left ends its response
    /// (its client resumes from its last offset). A fold larger than the whole room takes all
    /// of it, once the others are done. Shared by the agents of one [`router_with`]; each
    /// [`agent_router`] has its own.
    pub max_reader_fold_bytes: usize,
    /// How long a connection served by [`serve`] may take to send a request's head, and how
    /// long it may stay idle between requests (30 s); then it is closed. Keep it well above a
    /// client's round trip: a zero closes every connection before its head arrives.
    pub request_head_timeout: Duration,
    /// How long a connection served by [`serve`] may go without its client taking any byte of
    /// a response being written (60 s, as nginx's `send_timeout`); then it is closed. A
    /// client that stops reading a live stream would otherwise hold it, and what it buffers,
    /// while the connection stays open. A slow client that keeps reading is served in its own
    /// time. Keep it well above a client's round trip: a zero closes every connection whose
    /// response does not fit the socket's buffer at once.
    pub response_write_timeout: Duration,
    /// How many connections [`serve`] serves at once (4096; live reads are connections too):
    /// further clients wait in the listener's backlog until one closes. At least one;
    /// `usize::MAX` caps nothing. The cap is the server's, not each client's: one client
    /// holding many idle live reads can take all of it. Exposed beyond trusted clients, serve
    /// behind a proxy that limits connections per client.
    pub max_connections: usize,
}

impl std::fmt::Debug for HttpOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpOptions")
            .field("authorization", &self.authorization.is_some())
            .field("long_poll_timeout", &self.long_poll_timeout)
            .field("sse_wait", &self.sse_wait)
            .field("heartbeat", &self.heartbeat)
            .field("shared_store_poll", &self.shared_store_poll)
            .field("updates_cache_instances", &self.updates_cache_instances)
            .field("updates_cache_bytes", &self.updates_cache_bytes)
            .field("allow_cross_site", &self.allow_cross_site)
            .field("allowed_hosts", &self.allowed_hosts)
            .field("request_body_timeout", &self.request_body_timeout)
            .field("request_body_deadline", &self.request_body_deadline)
            .field("max_buffered_request_bytes", &self.max_buffered_request_bytes)
            .field("max_reader_fold_bytes", &self.max_reader_fold_bytes)
            .field("request_head_timeout", &self.request_head_timeout)
            .field("response_write_timeout", &self.response_write_timeout)
            .field("max_connections", &self.max_connections)
            .finish()
    }
}

impl HttpOptions {
    /// The longest a live read's duration counts for.
    pub(crate) const LONGEST_WAIT: Duration = Duration::from_secs(365 * 24 * 60 * 60);

    /// These options with the live reads' durations bounded (see the type's doc): the reads
    /// add them to the current instant, which a duration near `Duration::MAX` overflows.
    fn bounded(mut self) -> Self {
        let within = |duration: Duration, shortest: Duration| duration.clamp(shortest, Self::LONGEST_WAIT);
        self.long_poll_timeout = within(self.long_poll_timeout, Duration::ZERO);
        self.sse_wait = within(self.sse_wait, Duration::from_millis(100));
        self.heartbeat = within(self.heartbeat, Duration::from_millis(100));
        self.shared_store_poll = within(self.shared_store_poll, Duration::from_millis(10));
        self
    }

    /// These options, with every request asked of `authorization` first.
    pub fn authorized_by(mut self, authorization: impl Authorize) -> Self {
        self.authorization = Some(Arc::new(authorization));
        self
    }
}

impl Default for HttpOptions {
    fn default() -> Self {
        Self {
            authorization: None,
            long_poll_timeout: Duration::from_secs(30),
            sse_wait: Duration::from_secs(30),
            heartbeat: Duration::from_secs(15),
            shared_store_poll: Duration::from_millis(250),
            updates_cache_instances: 256,
            updates_cache_bytes: 128 << 20,
            allow_cross_site: false,
            allowed_hosts: Vec::new(),
            request_body_timeout: Duration::from_secs(60),
            request_body_deadline: Duration::from_secs(300),
            max_buffered_request_bytes: 256 * 1024 * 1024,
            max_reader_fold_bytes: 512 * 1024 * 1024,
            request_head_timeout: Duration::from_secs(30),
            response_write_timeout: Duration::from_secs(60),
            max_connections: 4096,
        }
    }
}

/// What every handler of one agent's routes shares.
#[derive(Clone)]
struct Routes {
    runtime: Arc<RuntimeInner>,
    agent: Arc<str>,
    options: Arc<HttpOptions>,
    /// The live feeds of the instances followed over SSE (the router's: one byte budget for
    /// every agent's).
    feeds: Arc<feed::Feeds>,
    /// What this agent's instances' `view=updates` reads projected.
    updates: Arc<updates_cache::UpdatesCache>,
    /// Room for the bytes of message bodies being read and parsed, in bytes
    /// ([`HttpOptions::max_buffered_request_bytes`]).
    bodies: Arc<tokio::sync::Semaphore>,
    /// Room for the folds readers make themselves, in bytes
    /// ([`HttpOptions::max_reader_fold_bytes`]).
    folds: reads::FoldRoom,
}

/// What the agents of one router share: room for message bodies, the live feeds (one byte
/// budget for all), room for readers' folds.
#[derive(Clone)]
struct Shared {
    bodies: Arc<tokio::sync::Semaphore>,
    feeds: Arc<feed::Feeds>,
    folds: reads::FoldRoom,
}

impl Shared {
    fn new(options: &HttpOptions) -> Self {
        Self {
            bodies: body_room(options),
            feeds: Arc::default(),
            folds: reads::FoldRoom::new(options.max_reader_fold_bytes),
        }
    }
}

/// An instance route's `{id}`, taken by name: the router may be nested under a path with
/// parameters of its own.
#[derive(serde::Deserialize)]
pub(super) struct InstancePath {
    id: String,
}

/// What an instance route's handler takes of its path.
pub(super) type InstanceId = Result<Path<InstancePath>, PathRejection>;

impl Routes {
    /// The instance `id` names, refusing a blank id.
    fn key(&self, id: InstanceId) -> Result<InstanceKey, ApiError> {
        let id = path_id(id)?;
        crate::runtime::check_instance_id(&id).map_err(ApiError::invalid_request)?;
        Ok(InstanceKey::new(self.agent.clone(), id))
    }

    /// The instance a read names, refusing a blank id: an id no admission accepts (too long,
    /// a task's) names no stream, so its read is `404 stream_not_found`, as a read of any
    /// instance never created is.
    fn read_key(&self, id: InstanceId) -> Result<InstanceKey, ApiError> {
        let id = path_id(id)?;
        if crate::runtime::check_instance_id(&id).is_err() {
            return Err(ApiError::stream_not_found(
                &InstanceKey::new(self.agent.clone(), id).stream_path(),
            ));
        }
        Ok(InstanceKey::new(self.agent.clone(), id))
    }
}

/// The instance id of a route's path, refusing a blank one.
fn path_id(id: InstanceId) -> Result<String, ApiError> {
    let Path(InstancePath { id }) = id.map_err(|rejection| ApiError::invalid_request(rejection.body_text()))?;
    if flue_core::message::is_blank(&id) {
        return Err(ApiError::invalid_request(
            "Agent conversation URLs must end with a non-empty conversation id segment.",
        ));
    }
    Ok(id)
}

/// The catalog `GET /agents` answers: every agent, its tools with their schemas, its
/// lifecycle hooks and the hooks it requires on a parent.
pub fn catalog_of(runtime: &Runtime) -> serde_json::Value {
    catalog::catalog(runtime.inner())
}

/// Every agent of `runtime` under `/agents/<name>`, with default [`HttpOptions`].
pub fn router(runtime: &Runtime) -> Router {
    router_with(runtime, HttpOptions::default())
}

/// [`router`] with `options`.
pub fn router_with(runtime: &Runtime, options: HttpOptions) -> Router {
    let options = Arc::new(options.bounded());
    let shared = Shared::new(&options);
    let inner = runtime.inner().clone();
    let mut app = Router::new().route(
        "/agents",
        get(move || {
            let inner = inner.clone();
            async move { axum::Json(catalog::catalog(&inner)) }
        })
        .fallback(not_allowed("GET, HEAD"))
        .route_layer(guarded(&options, None)),
    );
    let users = user_events::UserRoutes {
        runtime: runtime.inner().clone(),
        options: options.clone(),
    };
    app = app.route(
        "/users/{user_id}/events",
        get(user_events::get_user_events)
            .fallback(not_allowed("GET, HEAD"))
            .route_layer(axum::middleware::from_fn_with_state(users.clone(), guard_user))
            .with_state(users),
    );
    for name in runtime.agent_names() {
        app = app
            .nest(
                &format!("/agents/{name}"),
                routes(runtime.inner().clone(), name, options.clone(), shared.clone()),
            )
            .route(
                &format!("/agents/{name}/"),
                any(blank_id).layer(guarded(&options, Some(name))),
            );
    }
    finish(app, &options)
}

/// One agent's routes at the router's root (`/:id`, …; not the catalog nor the users'
/// event streams, which [`router`] mounts); `None` when `runtime` has no agent named `agent`.
pub fn agent_router(runtime: &Runtime, agent: &str, options: HttpOptions) -> Option<Router> {
    runtime.inner().agents.contains_key(agent).then(|| {
        let options = Arc::new(options.bounded());
        let shared = Shared::new(&options);
        finish(
            routes(runtime.inner().clone(), agent, options.clone(), shared),
            &options,
        )
    })
}

/// The room [`HttpOptions::max_buffered_request_bytes`] gives message bodies: at least one
/// body of [`MAX_BODY_BYTES`], at most what a semaphore counts.
fn body_room(options: &HttpOptions) -> Arc<tokio::sync::Semaphore> {
    Arc::new(tokio::sync::Semaphore::new(body_room_bytes(options)))
}

/// The bytes of [`body_room`].
fn body_room_bytes(options: &HttpOptions) -> usize {
    options
        .max_buffered_request_bytes
        .clamp(MAX_BODY_BYTES, tokio::sync::Semaphore::MAX_PERMITS)
}

/// Takes room in `bodies` for what `request` holds parsed beyond its texts (see
/// [`parsed_beyond_text`]), beside the body's own `room`, until the admission is made: never
/// more than the whole room, so a body that fits alone is admitted once the others are. 503
/// `server_busy` at once when it finds none.
fn hold_parsed(
    bodies: &Arc<tokio::sync::Semaphore>,
    options: &HttpOptions,
    mut room: Option<tokio::sync::OwnedSemaphorePermit>,
    request: &crate::SendRequest,
) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, ApiError> {
    let held = room.as_ref().map_or(0, tokio::sync::OwnedSemaphorePermit::num_permits);
    let parsed = parsed_beyond_text(request).min(body_room_bytes(options).saturating_sub(held));
    let Ok(parsed @ 1..) = u32::try_from(parsed) else {
        return Ok(room);
    };
    let more = bodies
        .clone()
        .try_acquire_many_owned(parsed)
        .map_err(|_| ApiError::server_busy())?;
    match &mut room {
        Some(room) => room.merge(more),
        None => room = Some(more),
    }
    Ok(room)
}

/// What `request` holds parsed that its body's text does not weigh: its initial data's nodes
/// (they weigh more than their text: dense JSON many times more), a signal's attributes (a map
/// of many short strings: each entry weighs a node beside its text) and a message's
/// attachments.
fn parsed_beyond_text(request: &crate::SendRequest) -> usize {
    use crate::json_shape::{NODE_WEIGHT, parsed_weight};
    let data = request.initial_data.as_ref().map_or(0, parsed_weight);
    let message = match &request.message {
        crate::message::DeliveredMessage::Signal(signal) => signal
            .attributes
            .iter()
            .map(|(key, value)| NODE_WEIGHT + key.len() + value.len())
            .sum(),
        crate::message::DeliveredMessage::User(user) => user.attachments.len() * NODE_WEIGHT,
    };
    data + message
}

fn routes(runtime: Arc<RuntimeInner>, agent: &str, options: Arc<HttpOptions>, shared: Shared) -> Router {
    let Shared { bodies, feeds, folds } = shared;
    let state = Routes {
        bodies,
        updates: Arc::new(updates_cache::UpdatesCache::new(
            options.updates_cache_instances,
            options.updates_cache_bytes,
            folds.clone(),
        )),
        folds,
        runtime,
        agent: agent.into(),
        options,
        feeds,
    };
    Router::new()
        .route(
            "/{id}",
            get(reads::get_stream)
                .head(reads::head_stream)
                .post(post_message)
                .fallback(not_allowed("GET, HEAD, POST")),
        )
        .route("/{id}/abort", post(post_abort).fallback(not_allowed("POST")))
        .route(
            "/{id}/events",
            get(thread_events::get_events).fallback(not_allowed("GET, HEAD")),
        )
        .route(
            "/{id}/attachments/{attachment_id}",
            // GET only: axum's `get` answers HEAD too, which the protocol's route does not.
            get(reads::get_attachment)
                .head(|| async { ApiError::method_not_allowed("HEAD", "GET") })
                .fallback(not_allowed("GET")),
        )
        .route("/", any(blank_id))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), guard_instance))
        .with_state(state)
}

/// What a guard's middleware answers.
type Guarding = std::pin::Pin<Box<dyn Future<Output = Response> + Send>>;

/// The guard of a route that names no instance: of `agent`'s, or of none.
fn guarded(
    options: &Arc<HttpOptions>,
    agent: Option<&str>,
) -> axum::middleware::FromFnLayer<impl Fn(Request, Next) -> Guarding + Clone + Send + Sync + 'static, (), (Request,)> {
    let (options, agent) = (options.clone(), agent.map(str::to_owned));
    axum::middleware::from_fn(move |request: Request, next: Next| {
        let (options, agent) = (options.clone(), agent.clone());
        Box::pin(async move { guard(&options, agent.as_deref(), None, None, request, next).await }) as Guarding
    })
}

/// Asks the authorization callback (when there is one) before the handler runs.
async fn guard_instance(
    State(routes): State<Routes>,
    params: Result<Path<std::collections::HashMap<String, String>>, PathRejection>,
    request: Request,
    next: Next,
) -> Response {
    let id = params.ok().and_then(|Path(mut params)| params.remove("id"));
    let agent = routes.agent.clone();
    guard(&routes.options, Some(&agent), id.as_deref(), None, request, next).await
}

/// Asks the authorization callback (when there is one) before a user route runs.
async fn guard_user(
    State(routes): State<user_events::UserRoutes>,
    params: Result<Path<std::collections::HashMap<String, String>>, PathRejection>,
    request: Request,
    next: Next,
) -> Response {
    let user_id = params
        .ok()
        .and_then(|Path(mut params)| params.remove("user_id"))
        .unwrap_or_default();
    guard(&routes.options, None, None, Some(&user_id), request, next).await
}

async fn guard(
    options: &HttpOptions,
    agent: Option<&str>,
    instance_id: Option<&str>,
    user_id: Option<&str>,
    request: Request,
    next: Next,
) -> Response {
    // A user route runs the application's hooks even for a read (a client's attach and
    // detach): as guarded as a write.
    if options.authorization.is_none()
        && let Some(host) = request_host(request.headers(), request.uri())
        && !host_allowed(host, &options.allowed_hosts)
    {
        return ApiError::forbidden_origin(format!(
            "This server was reached by the name {host:?}, which it does not answer to without an authorization policy (a page on another site can point its own name at this address); list the name in HttpOptions::allowed_hosts, or set HttpOptions::authorization."
        ))
        .into_response();
    }
    let changes_state =
        user_id.is_some() || !matches!(*request.method(), axum::http::Method::GET | axum::http::Method::HEAD);
    if changes_state && !options.allow_cross_site && from_another_site(request.headers(), request.uri()) {
        return ApiError::forbidden_origin(
            "A browser page from another site, or from another port of this host (as its Sec-Fetch-Site or Origin says), may not change state here; set HttpOptions::allow_cross_site to serve a browser app from there.",
        )
        .into_response();
    }
    // A browser that reaches a plain-HTTP address it does not deem trustworthy sends neither
    // `Sec-Fetch-Site` nor, with a no-CORS `GET` (an `<img>`'s), an `Origin`: such a page
    // from anywhere would run a user's attach and detach hooks. A user's stream is asked for
    // as one (`Accept: text/event-stream`, what `EventSource` sends), which no such element
    // sends.
    if user_id.is_some()
        && request.method() == axum::http::Method::GET
        && !options.allow_cross_site
        && request.headers().get("sec-fetch-site").is_none()
        && request.headers().get(axum::http::header::ORIGIN).is_none()
        // A page's element sends no `Authorization` (a client with a bearer token is no page).
        && request.headers().get(axum::http::header::AUTHORIZATION).is_none()
        && !asks_for_event_stream(request.headers())
    {
        return ApiError::forbidden_origin(
            "A user's event stream is read with Accept: text/event-stream (a request that says neither where it comes from nor that it reads a stream may be a page's element from another site).",
        )
        .into_response();
    }
    if let Some(authorization) = &options.authorization {
        // The path the client requested: inside a nested router (every agent's routes are
        // nested under `/agents/<name>`) the request's own URI has lost that prefix, and a
        // policy written against the real URLs would not match it.
        let path = match request.extensions().get::<OriginalUri>() {
            Some(OriginalUri(uri)) => uri.path(),
            None => request.uri().path(),
        };
        let access = AccessRequest {
            method: request.method(),
            path,
            headers: request.headers(),
            agent,
            instance_id,
            user_id,
        };
        match authorization.authorize(access).await {
            Ok(()) => {}
            Err(Denied::Unauthenticated(details)) => return ApiError::unauthorized(details).into_response(),
            Err(Denied::Forbidden(details)) => return ApiError::forbidden(details).into_response(),
        }
    }
    next.run(request).await
}

/// Whether the request's `Accept` lists `text/event-stream` by name (not only through `*/*`).
fn asks_for_event_stream(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get_all(axum::http::header::ACCEPT)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|media| {
            media
                .split(';')
                .next()
                .is_some_and(|media| media.trim().eq_ignore_ascii_case("text/event-stream"))
        })
}

/// Whether a browser sent the request from another site: as its `Sec-Fetch-Site` says, or,
/// from a browser that sends none (an older one, or a plain-HTTP address it does not deem
/// trustworthy), when its `Origin` names another host than the one the request was sent to
/// (an opaque `null` origin included). `same-site` is decided by the `Origin` too: a site is
/// a scheme and a registrable domain, ports aside, so a page another server on `localhost`
/// serves (or a sibling subdomain) is `same-site` while it is as foreign to this server as
/// any other page.
fn from_another_site(headers: &axum::http::HeaderMap, uri: &axum::http::Uri) -> bool {
    // A browser that says where the request comes from: `same-origin`, or `none` (the user's
    // own navigation), passes; `cross-site` does not; `same-site` (or a value this build does
    // not know) is another origin than this server's own, which only a matching `Origin` can
    // tell apart from another port or subdomain (a browser sends none with a no-CORS `GET`,
    // an `<img>`'s, which the user routes' reads must not take either).
    let site = headers.get("sec-fetch-site").map(axum::http::HeaderValue::as_bytes);
    match site {
        Some(site) if site.eq_ignore_ascii_case(b"same-origin") || site.eq_ignore_ascii_case(b"none") => {
            return false;
        }
        Some(site) if site.eq_ignore_ascii_case(b"cross-site") => return true,
        _ => {}
    }
    let Some(origin) = headers.get(axum::http::header::ORIGIN) else {
        // Without `Sec-Fetch-Site` either: not a browser's cross-site request.
        return site.is_some();
    };
    let authority = origin
        .to_str()
        .ok()
        .and_then(|origin| origin.split_once("://"))
        .map(|(_, authority)| authority);
    match (authority, request_host(headers, uri)) {
        (Some(authority), Some(host)) => !authority.eq_ignore_ascii_case(host),
        _ => true,
    }
}

/// Whether `host` (a `Host` header or an authority, with or without its port) is a name this
/// server answers to without an authorization policy: an IP address, `localhost` or one of
/// its subdomains, or one of `allowed` (see [`HttpOptions::allowed_hosts`]).
fn host_allowed(host: &str, allowed: &[String]) -> bool {
    let is_port = |port: &str| !port.is_empty() && port.bytes().all(|byte| byte.is_ascii_digit());
    // `[v6]:port`, `[v6]`, `name:port`, `v4:port`, `name`.
    let name = match host.strip_prefix('[') {
        Some(rest) => {
            return rest.split_once(']').is_some_and(|(ip, after)| {
                ip.parse::<std::net::Ipv6Addr>().is_ok()
                    && (after.is_empty() || after.strip_prefix(':').is_some_and(is_port))
            });
        }
        None => match host.rsplit_once(':') {
            Some((name, port)) if is_port(port) => name,
            Some(_) => return false,
            None => host,
        },
    };
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.parse::<std::net::Ipv4Addr>().is_ok() {
        return true;
    }
    let lowercase = name.to_ascii_lowercase();
    lowercase == "localhost"
        || lowercase.ends_with(".localhost")
        || allowed.iter().any(|allowed| {
            let allowed = allowed.strip_suffix('.').unwrap_or(allowed);
            allowed.eq_ignore_ascii_case(name)
        })
}

async fn blank_id() -> ApiError {
    ApiError::invalid_request("Agent conversation URLs must end with a non-empty conversation id segment.")
}

/// The router-wide parts: unmatched routes, the body limit, the security headers. An
/// unmatched route is guarded too: unauthorized, an unknown agent's path is answered as a
/// known one's is (401), not 404, which would tell the agents' names to anyone.
fn finish(app: Router, options: &Arc<HttpOptions>) -> Router {
    use axum::handler::Handler;
    let unmatched =
        (|uri: OriginalUri| async move { ApiError::route_not_found(uri.path()) }).layer(guarded(options, None));
    app.fallback(unmatched)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::map_response(security_headers))
}

async fn security_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert("cross-origin-resource-policy", HeaderValue::from_static("cross-origin"));
    response
}

fn not_allowed<S: Clone + Send + Sync + 'static>(allow: &'static str) -> MethodRouter<S> {
    MethodRouter::new()
        .fallback(move |method: Method| async move { ApiError::method_not_allowed(method.as_str(), allow) })
}

/// A message's body, read within the body timeout and deadline and at most
/// [`MAX_BODY_BYTES`], with the room in `bodies` it holds: taken as its bytes arrive, never
/// waited for. A body finding no room for its next bytes is answered 503 `server_busy` at
/// once, and frees what it held: a client sending slowly holds only what it sent, and no body
/// holds room while it waits for more (bodies each holding part of the room could otherwise
/// all wait for ever).
async fn read_body(
    request: Request,
    options: &HttpOptions,
    bodies: &Arc<tokio::sync::Semaphore>,
) -> Result<(Bytes, Option<tokio::sync::OwnedSemaphorePermit>), ApiError> {
    use futures_util::StreamExt;
    let mut chunks = request.into_body().into_data_stream();
    let mut body = bytes::BytesMut::new();
    let mut room: Option<tokio::sync::OwnedSemaphorePermit> = None;
    let read = async {
        loop {
            let chunk = match tokio::time::timeout(options.request_body_timeout, chunks.next()).await {
                Err(_) => return Err(ApiError::request_timeout(options.request_body_timeout)),
                Ok(None) => return Ok(()),
                Ok(Some(Err(error))) => return Err(ApiError::invalid_request(error.to_string())),
                Ok(Some(Ok(chunk))) => chunk,
            };
            if chunk.is_empty() {
                continue;
            }
            if body.len() + chunk.len() > MAX_BODY_BYTES {
                return Err(ApiError::request_too_large());
            }
            // At most MAX_BODY_BYTES: it fits a permit count.
            let taken = u32::try_from(chunk.len()).map_err(|_| ApiError::request_too_large())?;
            let more = bodies
                .clone()
                .try_acquire_many_owned(taken)
                .map_err(|_| ApiError::server_busy())?;
            match &mut room {
                Some(room) => room.merge(more),
                None => room = Some(more),
            }
            body.extend_from_slice(&chunk);
        }
    };
    tokio::time::timeout(options.request_body_deadline, read)
        .await
        .map_err(|_| ApiError::body_too_slow(options.request_body_deadline))??;
    Ok((body.freeze(), room))
}

/// `POST /:id`: admission only (the response is not awaited).
async fn post_message(
    State(routes): State<Routes>,
    id: InstanceId,
    OriginalUri(uri): OriginalUri,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    request: Request,
) -> Result<Response, ApiError> {
    let key = routes.key(id)?;
    if reads::pairs(query.as_deref()).any(|(name, _)| name == "wait") {
        return Err(ApiError::invalid_request(
            "The `wait` parameter is not supported: admission is fire-and-forget. Read the reply from the stream.",
        ));
    }
    // Read here, not by an extractor, to bound how long it may take and what it holds.
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse::<u64>().ok());
    if declared.is_some_and(|declared| declared > MAX_BODY_BYTES as u64) {
        return Err(ApiError::request_too_large());
    }
    let (body, room) = read_body(request, &routes.options, &routes.bodies).await?;
    let request = admission::parse(&key.id, &headers, &body)?;
    // What the admission needs is parsed: the body's room now covers its texts, and the
    // nodes of its initial data and attributes take room of their own.
    drop(body);
    let room = hold_parsed(&routes.bodies, &routes.options, room, &request)?;
    // A direct send, as `send()` is (only the caller does not wait here for the reply). On a
    // task of its own: a client that goes away drops this handler, and an admission the store
    // committed must still be reported queued and woken now (not at the next scan).
    let (runtime, agent) = (routes.runtime.clone(), routes.agent.clone());
    let (receipt, offset) = tokio::spawn(async move {
        // The body's room is held until the admission is made, here: a client that goes away
        // meanwhile does not free it while the message is still held.
        let _room = room;
        let admitted = runtime.admit(&agent, request, SubmissionKind::Direct).await;
        if admitted.is_ok() {
            runtime.slot(&key).wake();
        }
        admitted
    })
    .await
    .map_err(|error| ApiError::internal(&error))??;
    let offset = match offset {
        Some(offset) if !receipt.deduplicated => format_offset(offset),
        _ => "-1".to_owned(),
    };
    let stream_url = stream_url(&headers, &uri);
    let mut body = json!({
        "streamUrl": stream_url,
        "offset": offset,
        "submissionId": receipt.submission_id,
        "uid": receipt.uid,
    });
    if receipt.deduplicated {
        body["deduplicated"] = json!(true);
    }
    let mut response = (StatusCode::ACCEPTED, axum::Json(body)).into_response();
    let headers = response.headers_mut();
    if let Ok(location) = HeaderValue::from_str(&stream_url) {
        headers.insert(header::LOCATION, location);
    }
    if let Ok(offset) = HeaderValue::from_str(&offset) {
        headers.insert("stream-next-offset", offset);
    }
    Ok(response)
}

/// The request's URL without its query: absolute when the request named its host (in `Host`,
/// or in HTTP/2's `:authority`, which arrives in the URI).
fn stream_url(headers: &HeaderMap, uri: &axum::http::Uri) -> String {
    let path = uri.path();
    let host = request_host(headers, uri);
    let scheme = headers
        .get("x-forwarded-proto")
        .and_then(|proto| proto.to_str().ok())
        .or_else(|| uri.scheme_str())
        .filter(|proto| matches!(*proto, "http" | "https"))
        .unwrap_or("http");
    match host {
        Some(host) => format!("{scheme}://{host}{path}"),
        None => path.to_owned(),
    }
}

/// The host a request was sent to: its `Host` header, or over HTTP/2 (which has none) its
/// URI's authority.
fn request_host<'a>(headers: &'a HeaderMap, uri: &'a axum::http::Uri) -> Option<&'a str> {
    headers
        .get(header::HOST)
        .and_then(|host| host.to_str().ok())
        .or_else(|| uri.authority().map(axum::http::uri::Authority::as_str))
}

/// `POST /:id/abort`: requests an abort of every unsettled submission of the instance.
async fn post_abort(State(routes): State<Routes>, id: InstanceId) -> Result<Response, ApiError> {
    let key = routes.key(id)?;
    let affected = routes
        .runtime
        .abort_instance(&key)
        .await
        .map_err(|error| ApiError::internal(&error))?;
    Ok(axum::Json(json!({"aborted": !affected.is_empty()})).into_response())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests assert by unwrapping

    use super::*;

    #[test]
    fn the_stream_url_names_the_host_from_the_host_header_or_the_http2_authority() {
        let mut headers = HeaderMap::new();
        let h2: axum::http::Uri = "https://api.example.com/agents/a/c1?x=1".parse().unwrap();
        assert_eq!(stream_url(&headers, &h2), "https://api.example.com/agents/a/c1");
        headers.insert("x-forwarded-proto", HeaderValue::from_static("http"));
        assert_eq!(stream_url(&headers, &h2), "http://api.example.com/agents/a/c1");
        headers.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        headers.insert(header::HOST, HeaderValue::from_static("front.example.com"));
        let h1: axum::http::Uri = "/agents/a/c1?x=1".parse().unwrap();
        assert_eq!(stream_url(&headers, &h1), "https://front.example.com/agents/a/c1");
        assert_eq!(stream_url(&HeaderMap::new(), &h1), "/agents/a/c1");
    }

    /// Reference Appendix A and §4.4–§4.5: the long poll, the durable poll, the SSE heartbeat,
    /// and the SSE stream's wait before it sends a control frame again.
    #[test]
    fn the_default_live_read_timings_are_the_references() {
        let options = HttpOptions::default();
        assert_eq!(options.long_poll_timeout, Duration::from_millis(30_000));
        assert_eq!(options.shared_store_poll, Duration::from_millis(250));
        assert_eq!(options.heartbeat, Duration::from_millis(15_000));
        assert_eq!(options.sse_wait, Duration::from_secs(30));
        assert!(options.authorization.is_none() && !options.allow_cross_site && options.allowed_hosts.is_empty());
    }

    #[test]
    fn the_server_answers_ip_addresses_localhost_and_the_allowed_names_only() {
        let allowed = ["agents.example.com".to_owned()];
        for host in [
            "127.0.0.1:3583",
            "127.0.0.1",
            "10.1.2.3:80",
            "[::1]:3583",
            "[::1]",
            "localhost:3583",
            "LOCALHOST",
            "app.localhost:5173",
            "localhost.",
            "agents.example.com:443",
            "Agents.Example.com.",
        ] {
            assert!(host_allowed(host, &allowed), "{host}");
        }
        for host in [
            "evil.example:3583",
            "127.0.0.1.evil.example",
            "localhost.evil.example",
            "example.com",
            "[not-an-ip]:80",
            "[::1]junk",
            "[::1]:",
            "localhost:x",
            "",
        ] {
            assert!(!host_allowed(host, &allowed), "{host}");
        }
    }

    #[test]
    fn an_origin_is_compared_with_the_host_header_or_the_http2_authority() {
        let origin = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::ORIGIN, HeaderValue::from_static(value));
            headers
        };
        // HTTP/2: no Host header, the authority is in the request's URI.
        let h2: axum::http::Uri = "http://127.0.0.1:8080/agents/a/c1/abort".parse().unwrap();
        assert!(!from_another_site(&origin("http://127.0.0.1:8080"), &h2));
        assert!(from_another_site(&origin("http://evil.example"), &h2));
        assert!(from_another_site(&origin("null"), &h2));
        // HTTP/1.1: the Host header.
        let h1: axum::http::Uri = "/agents/a/c1/abort".parse().unwrap();
        let mut same = origin("http://api.example.com");
        same.insert(header::HOST, HeaderValue::from_static("API.example.com"));
        assert!(!from_another_site(&same, &h1));
        // Neither names a host: nothing to compare with.
        assert!(from_another_site(&origin("http://api.example.com"), &h1));
        // No Origin: not a browser's cross-site request.
        assert!(!from_another_site(&HeaderMap::new(), &h1));
        // `same-site` (ports aside): the Origin decides. Another server on localhost is
        // another site here; the scheme aside, the same host is this one.
        let same_site = |origin_value: &'static str| {
            let mut headers = origin(origin_value);
            headers.insert("sec-fetch-site", HeaderValue::from_static("same-site"));
            headers.insert(header::HOST, HeaderValue::from_static("localhost:3583"));
            headers
        };
        assert!(from_another_site(&same_site("http://localhost:5173"), &h1));
        assert!(from_another_site(&same_site("https://docs.localhost:3583"), &h1));
        assert!(!from_another_site(&same_site("https://localhost:3583"), &h1));
        // `same-site` without an Origin (an `<img>`'s `GET`): another origin's all the same.
        let mut bare = HeaderMap::new();
        bare.insert("sec-fetch-site", HeaderValue::from_static("same-site"));
        bare.insert(header::HOST, HeaderValue::from_static("localhost:3583"));
        assert!(from_another_site(&bare, &h1));
        let mut cross = origin("http://localhost:3583");
        cross.insert("sec-fetch-site", HeaderValue::from_static("cross-site"));
        assert!(from_another_site(&cross, &h1));
    }
}
