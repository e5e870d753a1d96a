//! A Rust client of the streaming protocol ([`crate::http`]): send a message, read its reply,
//! follow an instance's updates live over SSE.
//!
//! Following survives dropped connections: the client reconnects from the last offset the
//! server confirmed and skips chunks it already delivered (each chunk has a position: its
//! batch and its index in that batch), so every chunk arrives once, in order. An event the
//! client cannot read (larger than [`Client::with_max_event_bytes`], or not JSON) would be
//! read again on every reconnection: it ends the stream with [`ClientError::Protocol`]
//! instead. (Bytes that are not UTF-8 read as U+FFFD, as an event stream is decoded.) A stream followed in one session can be followed on in a
//! later one, from where its last delivered chunk left it ([`Chunks::resume_point`],
//! [`Instance::follow_from`]), each chunk still once.
//!
//! ```no_run
//! # async fn demo() -> Result<(), flue_runtime::client::ClientError> {
//! use flue_runtime::client::Client;
//!
//! let client = Client::new("http://127.0.0.1:3583")?;
//! let customer = client.instance("assistant", "customer-42");
//! let reply = customer.prompt("Where is my order?").await?;
//! println!("{}", reply.text);
//! # Ok(())
//! # }
//! ```

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use flue_core::message::DeliveredMessage;
use flue_core::url::url_without_secrets;
use futures_util::{Stream, StreamExt};
use serde_json::{Map, Value, json};

use crate::provider::sse::SseParser;

/// Why a client call failed.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The server refused with the error envelope (or answered a 5xx without one: then the type
    /// is empty and the message says the status).
    #[error("{status} {error_type}: {message} {details}{}", reference_note(.reference.as_deref()))]
    Api {
        /// HTTP status.
        status: u16,
        /// The envelope's stable type (`invalid_request`, `stream_not_found`, …).
        error_type: String,
        /// Its message.
        message: String,
        /// Its details.
        details: String,
        /// Its structured meta, when it has one (boxed: an error should be small to return).
        meta: Option<Box<Value>>,
        /// The reference the server logged the error's cause under (the envelope's `ref`, or
        /// its `flue-error-ref` header), to quote when reporting it.
        reference: Option<String>,
    },
    /// The instance's stream was replaced while it was followed (its incarnation changed: the
    /// instance was deleted and made again, or the server's store is another), told by a
    /// checkpoint, or by a 416 of the new incarnation when the new stream is shorter than what
    /// was read: what was read of the old stream does not continue into the new one. Follow
    /// it again from the start.
    #[error(
        "the instance's stream was replaced (incarnation {previous}, now {current}): follow it again from the start"
    )]
    StreamReplaced {
        /// The incarnation followed until then.
        previous: String,
        /// The stream's incarnation now.
        current: String,
    },
    /// The submission failed or was aborted.
    #[error("submission {submission_id} {outcome}: {}", .error.message)]
    Settled {
        /// The submission.
        submission_id: String,
        /// `failed` or `aborted`.
        outcome: String,
        /// The settlement's error: type, message, details and meta.
        error: Box<crate::record::SettlementError>,
    },
    /// [`Instance::prompt`] sent the message and the server admitted it, but its reply could
    /// not be read (`error`: the stream failed, or was replaced, after the admission). The
    /// message is the server's: [`Instance::reply`] with `receipt` reads its reply again, where
    /// sending it again would send it twice.
    #[error(
        "the message was admitted (submission {}), but its reply could not be read: {error}",
        .receipt.submission_id
    )]
    Unanswered {
        /// The admission's receipt.
        receipt: Receipt,
        /// Why the reply could not be read.
        error: Box<ClientError>,
    },
    /// The server could not be reached, or answered something that is not the protocol. (A
    /// request whose answer was lost may have reached the server: see [`Instance::send`].)
    #[error("{0}")]
    Transport(String),
    /// The request cannot be made as asked: a base URL that is not an `http(s)` URL a path can
    /// be added to, or an agent name or instance id that no URL can carry (`.` and `..`,
    /// which every URL parser resolves as a path step instead of sending them, and text with
    /// a tab or a line break, which URL parsers drop).
    #[error("{0}")]
    InvalidRequest(String),
    /// The server answered something that is not the protocol: a redirect (the client does
    /// not follow them), an admission without a receipt, a refusal below 500 without the
    /// error envelope, a success that is not JSON, an answer larger than
    /// [`Client::with_max_body_bytes`], a followed stream's success that is not an event
    /// stream, or an event the client cannot read (larger than [`Client::with_max_event_bytes`],
    /// or whose data is not JSON). Asking again would meet the same, so this error also ends a
    /// followed stream rather than a reconnection.
    #[error("{0}")]
    Protocol(String),
}

/// How deep the protocol's JSON may nest for the client: what a store holds (values nested up
/// to its depth, a tool's arguments, state, data) wrapped in the few levels of a frame or a
/// history snapshot. (serde_json's own limit, 128 levels, would make a conversation holding
/// a value nested 123 levels or more unreadable for good by this client, which browsers and
/// the reference's client read.)
const READ_DEPTH: usize = crate::store::depth::MAX_STORED_DEPTH + 32;

/// Parses the protocol's JSON nested up to [`READ_DEPTH`].
fn read_json(bytes: &[u8]) -> serde_json::Result<Value> {
    crate::store::depth::from_nested(bytes, READ_DEPTH)
}

/// How an [`ClientError::Api`] error names its reference, if it has one.
fn reference_note(reference: Option<&str>) -> String {
    reference
        .map(|reference| format!(" (ref {reference})"))
        .unwrap_or_default()
}

impl From<reqwest::Error> for ClientError {
    fn from(error: reqwest::Error) -> Self {
        Self::Transport(transport_text(error))
    }
}

/// The text of a reqwest error, its URL quoted without the userinfo, query and fragment where a
/// credential may sit: reqwest quotes the whole URL it requested, and a
/// client error reaches logs and whoever the application shows it to.
fn transport_text(error: reqwest::Error) -> String {
    let url = error.url().map(|url| url_without_secrets(url.as_str()));
    let error = error.without_url();
    // With its causes: reqwest's own text names only the kind of failure ("error sending
    // request"), not why (refused, a name that does not resolve, a certificate, a timeout).
    let text = flue_core::url::without_url_secrets(&crate::error_chain(&error));
    match url {
        Some(url) => format!("{text} for url ({url})"),
        None => text,
    }
}

/// How long a followed stream may be silent: three of the server's 15 s heartbeats.
const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(45);

/// How long a request other than following a stream may take, answer included.
const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// The most bytes the answer of a request other than following a stream may take, by
/// default: 256 MiB (a conversation's whole history is one answer).
const DEFAULT_MAX_BODY_BYTES: usize = 256 * 1024 * 1024;

/// The most bytes one event of a followed stream may take, by default: as many as a history's
/// answer. The largest event is a `conversation-reset` (after a compaction or an edit), which
/// carries the history snapshot whole, as `GET /:id` answers it; a message the server admitted
/// is one event about as long as its request ([`crate::http::MAX_BODY_BYTES`] at most).
const DEFAULT_MAX_EVENT_BYTES: usize = DEFAULT_MAX_BODY_BYTES;

/// Connections a followed stream may fail in a row before it ends (see
/// [`Client::with_reconnect_limit`]).
const DEFAULT_RECONNECT_LIMIT: u32 = 10;

/// How long after it was made a connection must still bring bytes to count as made: two of
/// the server's heartbeat intervals (see [`Follow::stable`]).
const STABLE_CONNECTION: Duration = Duration::from_secs(30);

/// A connection to a server of the protocol.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    /// The server's root, without a fragment; its query (a gateway's, say) goes with every
    /// request.
    base: reqwest::Url,
    token: Option<String>,
    /// How long a followed stream may stay silent before its connection is taken for dead.
    idle_timeout: Duration,
    /// How long any other request may take, its answer included.
    request_timeout: Duration,
    /// The most bytes one event of a followed stream may take.
    max_event_bytes: usize,
    /// The most bytes the answer of any other request may take.
    max_body_bytes: usize,
    /// How many connections in a row a followed stream may fail before it ends.
    reconnect_limit: u32,
}

/// Without the bearer token, and the base URL without its userinfo, query and fragment: a
/// client's Debug ends up in logs.
impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base", &url_without_secrets(self.base.as_str()))
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("idle_timeout", &self.idle_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("reconnect_limit", &self.reconnect_limit)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// A client of the server at `base_url` (its root: agents are under `/agents/<name>`
    /// below its path). A query of the base URL goes with every request; a fragment is
    /// dropped. Credentials in it (`user:password@`) go as Basic authorization (to a proxy
    /// in front of the server, say), unless a bearer token is set
    /// ([`Client::with_bearer_token`], which replaces them: two `Authorization` headers
    /// would reach the server, which reads the first). [`ClientError::InvalidRequest`] when
    /// it is not an `http` or `https` URL.
    pub fn new(base_url: impl Into<String>) -> Result<Self, ClientError> {
        let base_url = base_url.into();
        let invalid = |why: &dyn std::fmt::Display| {
            ClientError::InvalidRequest(format!("the base URL {} {why}", url_without_secrets(&base_url)))
        };
        let mut base =
            reqwest::Url::parse(&base_url).map_err(|error| invalid(&format_args!("is not a URL ({error})")))?;
        if !matches!(base.scheme(), "http" | "https") {
            return Err(invalid(&"is not an http or https URL"));
        }
        base.set_fragment(None);
        // Redirects are not followed: a POST redirected becomes a GET without its body (so a
        // message would be lost while the answer looked fine), and a server of the protocol
        // answers where it is asked. A redirect is an error naming where it points.
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        Ok(Self {
            http,
            base,
            token: None,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            reconnect_limit: DEFAULT_RECONNECT_LIMIT,
        })
    }

    /// Ends a followed stream (and so [`Instance::reply`] and [`Instance::prompt`]) with the
    /// last connection's error once `attempts` connections in a row failed (default: 10,
    /// about 20 s of growing pauses while the server is unreachable, more when each attempt
    /// waits for a connection timeout). A connection that brings something new (a chunk, a
    /// later offset), or stays up for 30 s (two thirds of the idle timeout, when that is
    /// shorter), heartbeats flowing, starts the count again, however it ends; one that is
    /// accepted and dropped, or never heard from, counts as failed.
    pub fn with_reconnect_limit(mut self, attempts: u32) -> Self {
        self.reconnect_limit = attempts;
        self
    }

    /// Fails a request other than following a stream (sending, the history, an abort, the
    /// catalog) that has not been answered whole within `timeout` (default: 60 s), so a
    /// server that accepts the connection and never answers cannot hold a caller forever.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Sends `token` as a bearer token with every request, in place of the base URL's
    /// credentials (reqwest would send those as Basic authorization, ahead of the token, which
    /// the server would then not read).
    pub fn with_bearer_token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        // Neither can fail on an http(s) URL, the only kind `new` takes.
        let _ = self.base.set_username("");
        let _ = self.base.set_password(None);
        self
    }

    /// Takes a followed stream's connection for dead (and reconnects) when nothing, not even
    /// a heartbeat, arrived on it for `timeout` (default: 45 s, three server heartbeats).
    pub fn with_idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// Refuses an event of a followed stream larger than `bytes` (its SSE lines, line ends
    /// included; default: 256 MiB, as [`Client::with_max_body_bytes`]: a history snapshot's
    /// bound, since a reset carries one). The server
    /// splits catch-up batches at about 1 MiB, but one chunk (a message, a tool result, a big
    /// data part, and a `conversation-reset` after a compaction or an edit, which carries the
    /// whole transcript) is sent whole in one event, however large: raise the bound when
    /// the followed conversations produce more. An event
    /// past the bound ends the stream with [`ClientError::Protocol`], after the chunks
    /// before it; the client stops buffering it as soon as it passes the bound.
    pub fn with_max_event_bytes(mut self, bytes: usize) -> Self {
        self.max_event_bytes = bytes;
        self
    }

    /// Refuses the answer of a request other than following a stream (a history, a
    /// catalog, a receipt, an error) larger than `bytes` (default: 256 MiB) with
    /// [`ClientError::Transport`]: the client stops reading it as soon as it passes the bound,
    /// so a server (or what stands between) cannot make it buffer without end.
    pub fn with_max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body_bytes = bytes;
        self
    }

    /// The instance `id` of the agent `agent`. Any text is carried (percent-encoded as one
    /// path segment) but `.`, `..` and text with a tab or a line break: the instance's requests fail with
    /// [`ClientError::InvalidRequest`] rather than reach another URL.
    pub fn instance(&self, agent: &str, id: &str) -> Instance {
        Instance {
            client: self.clone(),
            url: self.endpoint(&["agents", agent, id]),
        }
    }

    /// The agents the server serves (`GET /agents`).
    pub async fn catalog(&self) -> Result<Value, ClientError> {
        let url = self.endpoint(&["agents"])?;
        let response = self.call(reqwest::Method::GET, url).send().await?;
        json_of(response, self.max_body_bytes).await
    }

    /// The URL of `segments` below the base URL's path, each percent-encoded as one segment,
    /// with the base URL's query.
    fn endpoint(&self, segments: &[&str]) -> Result<reqwest::Url, ClientError> {
        if let Some(dots) = segments.iter().find(|segment| matches!(**segment, "." | "..")) {
            return Err(ClientError::InvalidRequest(format!(
                "\"{dots}\" cannot be an agent name or instance id in a URL: URL parsers take it for a path step"
            )));
        }
        // The URL parser drops these from a segment instead of encoding them: `a\tb` would
        // reach the instance `ab`, and `.\t.` the path step `..`.
        if let Some(broken) = segments.iter().find(|segment| segment.contains(['\t', '\n', '\r'])) {
            return Err(ClientError::InvalidRequest(format!(
                "{broken:?} cannot be an agent name or instance id in a URL: it has a tab or a line break"
            )));
        }
        let mut url = self.base.clone();
        url.path_segments_mut()
            .map_err(|()| ClientError::InvalidRequest("the base URL cannot have a path".into()))?
            .pop_if_empty()
            .extend(segments);
        Ok(url)
    }

    /// A request answered whole (not a followed stream), bounded by the request timeout.
    fn call(&self, method: reqwest::Method, url: reqwest::Url) -> reqwest::RequestBuilder {
        self.request(method, url).timeout(self.request_timeout)
    }

    fn request(&self, method: reqwest::Method, url: reqwest::Url) -> reqwest::RequestBuilder {
        let request = self.http.request(method, url);
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }
}

/// The body of a success, or the error of the envelope.
async fn json_of(response: reqwest::Response, limit: usize) -> Result<Value, ClientError> {
    let status = response.status().as_u16();
    if response.status().is_redirection() {
        return Err(redirected(&response));
    }
    let header_reference = response
        .headers()
        .get("flue-error-ref")
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    let bytes = body_within(response, limit).await?;
    let body: Value = match read_json(&bytes) {
        Ok(body) => body,
        // A refusal below 500 that is not JSON (a proxy's HTML page) is not the protocol.
        Err(_) if (400..500).contains(&status) => {
            return Err(ClientError::Protocol(format!(
                "the server answered {status} without the protocol's error envelope: is the client's base URL a flue server's?"
            )));
        }
        // A gateway's 5xx page (HTML): the server's failure all the same, as the error says.
        Err(_) if status >= 500 => {
            return Err(ClientError::Api {
                status,
                error_type: String::new(),
                message: format!("the server answered {status}"),
                details: String::new(),
                meta: None,
                reference: header_reference,
            });
        }
        // A whole body (a cut one fails as the transport's) that is no JSON: the same when
        // asked again.
        Err(error) => {
            return Err(ClientError::Protocol(format!(
                "the server answered {status} with no JSON: {error}"
            )));
        }
    };
    if status >= 400 {
        let error = &body["error"];
        let Some(error_type) = error["type"].as_str().filter(|error_type| !error_type.is_empty()) else {
            // A gateway's 5xx may pass (a reader asks again); a refusal below 500 from
            // something that is not a flue server stays one.
            if status >= 500 {
                return Err(ClientError::Api {
                    status,
                    error_type: String::new(),
                    message: format!("the server answered {status}"),
                    details: String::new(),
                    meta: None,
                    reference: header_reference,
                });
            }
            return Err(ClientError::Protocol(format!(
                "the server answered {status} without the protocol's error envelope: is the client's base URL a flue server's?"
            )));
        };
        let text = |field: &str| error[field].as_str().unwrap_or_default().to_owned();
        return Err(ClientError::Api {
            status,
            error_type: error_type.to_owned(),
            message: text("message"),
            details: text("details"),
            meta: error.get("meta").cloned().map(Box::new),
            reference: error["ref"].as_str().map(str::to_owned).or(header_reference),
        });
    }
    Ok(body)
}

/// The error of a redirect, which the client does not follow (see [`Client::new`]).
fn redirected(response: &reqwest::Response) -> ClientError {
    let location = response
        .headers()
        .get(reqwest::header::LOCATION)
        .and_then(|value| value.to_str().ok())
        .map_or_else(|| "nowhere".to_owned(), url_without_secrets);
    ClientError::Protocol(format!(
        "the server answered {} redirecting to {location}: give the client the base URL the server answers at",
        response.status().as_u16()
    ))
}

/// The whole body of `response`, refused once it passes `limit` bytes (declared or read).
async fn body_within(mut response: reqwest::Response, limit: usize) -> Result<Vec<u8>, ClientError> {
    let status = response.status().as_u16();
    // The same answer, asked again: not retried (see `answer_lost`).
    let too_large = || {
        ClientError::Protocol(format!(
            "the server answered {status} with a body larger than the client's bound of {limit} bytes"
        ))
    };
    if response
        .content_length()
        .is_some_and(|declared| declared > limit as u64)
    {
        return Err(too_large());
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|error| {
        ClientError::Transport(format!(
            "the server answered {status}, then its body failed: {}",
            transport_text(error)
        ))
    })? {
        if body.len() + chunk.len() > limit {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// What admission answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Receipt {
    /// The admitted submission.
    pub submission_id: String,
    /// The stream offset before the submission's records: read its reply from here.
    pub offset: String,
    /// The instance's incarnation.
    pub uid: String,
    /// Whether an idempotency key replayed an earlier admission.
    pub deduplicated: bool,
}

/// What a completed submission's response produced, read from the stream.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reply {
    /// The submission.
    pub submission_id: String,
    /// Its steps' texts, joined with blank lines.
    pub text: String,
    /// The last value of each data part.
    pub data: Map<String, Value>,
    /// Response metadata.
    pub metadata: Map<String, Value>,
}

/// One instance on the server.
#[derive(Clone)]
pub struct Instance {
    client: Client,
    /// Its URL, or why it has none (its id or agent name cannot be carried by one).
    url: Result<reqwest::Url, ClientError>,
}

/// Its URL without the userinfo, query and fragment; its client as [`Client`]'s Debug shows it.
impl std::fmt::Debug for Instance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Instance")
            .field("client", &self.client)
            .field("url", &self.url.as_ref().map(|url| url_without_secrets(url.as_str())))
            .finish()
    }
}

/// Chunks of an instance's stream, in order, each once: a [`Stream`] that knows where it
/// stands ([`Chunks::resume_point`]).
pub struct Chunks {
    stream: Pin<Box<dyn Stream<Item = Result<Value, ClientError>> + Send>>,
    resume: Arc<Mutex<ResumePoint>>,
}

impl Chunks {
    /// Where the stream stands after the chunks delivered so far: what
    /// [`Instance::follow_from`] goes on from, in this process or a later one (keep it with
    /// what the last chunk did, and every chunk is still handled once).
    pub fn resume_point(&self) -> ResumePoint {
        self.resume
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }
}

impl Stream for Chunks {
    type Item = Result<Value, ClientError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.stream.as_mut().poll_next(cx)
    }
}

impl std::fmt::Debug for Chunks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chunks")
            .field("resume_point", &self.resume_point())
            .finish()
    }
}

/// Where a followed stream stands: the offset to read it again from, the last chunk
/// delivered (those up to it are skipped), and the stream's incarnation once known (a stream
/// replaced since ends with [`ClientError::StreamReplaced`] rather than be taken for the one
/// followed). Serializable, to be kept between sessions.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ResumePoint {
    /// An offset the server confirmed, at or before the last chunk delivered.
    pub offset: String,
    /// The position (batch, index) of the last chunk delivered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last: Option<(u64, u64)>,
    /// The stream's incarnation, once a checkpoint named it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incarnation: Option<String>,
}

impl ResumePoint {
    /// The start of a stream after `offset` (`-1`: from its beginning), nothing delivered yet.
    pub fn at(offset: impl Into<String>) -> Self {
        Self {
            offset: offset.into(),
            last: None,
            incarnation: None,
        }
    }
}

impl Instance {
    /// The instance's URL, with `path` (segments) added below it.
    fn url(&self, path: &[&str]) -> Result<reqwest::Url, ClientError> {
        let mut url = self.url.clone()?;
        if !path.is_empty() {
            url.path_segments_mut()
                .map_err(|()| ClientError::InvalidRequest("the base URL cannot have a path".into()))?
                .extend(path);
        }
        Ok(url)
    }

    /// Admits `message` (`POST /:id`) under a fresh idempotency key: when the answer is lost
    /// (the connection failed, the request timed out, a gateway answered 5xx, the server
    /// answered 408 or 429) the admission is posted again with the same key, at most
    /// [`ADMISSION_POSTS`] times in all, so the message is admitted once whether or not the
    /// lost answer's request reached the server (a replay answers with the first admission's
    /// receipt, [`Receipt::deduplicated`]). An error after the last post may still hide an
    /// admission: [`Self::send_with_key`] with a key of the caller's own can ask again.
    pub async fn send(&self, message: impl Into<DeliveredMessage>) -> Result<Receipt, ClientError> {
        self.send_with_key(message, &crate::record::new_id("send")).await
    }

    /// [`Self::send`] under `idempotency_key` (at most 256 characters): sending the same
    /// message with the same key again, in this process or after a restart, admits it once.
    pub async fn send_with_key(
        &self,
        message: impl Into<DeliveredMessage>,
        idempotency_key: &str,
    ) -> Result<Receipt, ClientError> {
        let mut body =
            serde_json::to_value(message.into()).map_err(|error| ClientError::Transport(error.to_string()))?;
        if let Value::Object(fields) = &mut body {
            fields.insert("idempotencyKey".into(), json!(idempotency_key));
        }
        self.send_json(body).await
    }

    /// Admits a raw admission body (a message with `uid`, `initialData` or `idempotencyKey`
    /// beside it). A body with an `idempotencyKey` is posted again when its answer is lost,
    /// as [`Self::send`] does; one without is posted once (posted again, it could be admitted
    /// twice).
    pub async fn send_json(&self, body: Value) -> Result<Receipt, ClientError> {
        let keyed = body.get("idempotencyKey").is_some();
        let mut posts = 1;
        loop {
            let mut retry_after = None;
            match self.post_admission(&body, &mut retry_after).await {
                // After the pause a refusal's `Retry-After` asks for, when longer.
                Err(error) if keyed && posts < ADMISSION_POSTS && answer_lost(&error) => {
                    tokio::time::sleep(reconnect_delay(posts, retry_after)).await;
                    posts += 1;
                }
                answered => return answered,
            }
        }
    }

    /// Posts an admission; a refusal's `Retry-After` goes to `retry_after`.
    async fn post_admission(&self, body: &Value, retry_after: &mut Option<Duration>) -> Result<Receipt, ClientError> {
        let response = self
            .client
            .call(reqwest::Method::POST, self.url(&[])?)
            .json(body)
            .send()
            .await?;
        let status = response.status().as_u16();
        *retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|value| value.to_str().ok())
            .and_then(crate::provider::parse_retry_after);
        let receipt = json_of(response, self.client.max_body_bytes).await?;
        let text = |field: &str| receipt[field].as_str().unwrap_or_default().to_owned();
        // An admission answers 202 with the submission and its offset: anything else admitted
        // nothing this client can follow.
        if status != 202 || text("submissionId").is_empty() || text("offset").is_empty() {
            return Err(ClientError::Protocol(format!(
                "the server answered {status} without a receipt (submissionId and offset): the message may not have been admitted; is the client's base URL a flue server's?"
            )));
        }
        // Followed from, and copied into every chunk's resume point: an offset, nothing longer.
        if !is_stream_offset(&text("offset")) {
            return Err(ClientError::Protocol(
                "the server's receipt carries no stream offset: the message may have been admitted; read its reply with the submission id".into(),
            ));
        }
        Ok(Receipt {
            submission_id: text("submissionId"),
            offset: text("offset"),
            uid: text("uid"),
            deduplicated: receipt["deduplicated"] == json!(true),
        })
    }

    /// Sends `message` and waits for its reply. Once the message is admitted, a failure to
    /// read its reply is [`ClientError::Unanswered`], with the receipt to read it again by; a
    /// submission that failed or was aborted is [`ClientError::Settled`]. As for
    /// [`Self::send`], an error after an answer was lost may still hide an admission:
    /// [`Self::prompt_with_key`] with a key of the caller's own can ask again without sending
    /// the message twice.
    pub async fn prompt(&self, message: impl Into<DeliveredMessage>) -> Result<Reply, ClientError> {
        self.prompt_with_key(message, &crate::record::new_id("send")).await
    }

    /// [`Self::prompt`] under `idempotency_key` (see [`Self::send_with_key`]): prompting again
    /// with the same message and key after an error waits for the reply of the one admission.
    pub async fn prompt_with_key(
        &self,
        message: impl Into<DeliveredMessage>,
        idempotency_key: &str,
    ) -> Result<Reply, ClientError> {
        let receipt = self.send_with_key(message, idempotency_key).await?;
        self.reply(&receipt).await.map_err(|error| match error {
            settled @ ClientError::Settled { .. } => settled,
            error => ClientError::Unanswered {
                receipt,
                error: Box::new(error),
            },
        })
    }

    /// Waits for the submission of `receipt` to settle and returns its reply.
    pub async fn reply(&self, receipt: &Receipt) -> Result<Reply, ClientError> {
        if !receipt.deduplicated
            && let Some(reply) = self
                .reply_from(receipt, &receipt.offset, ReplyFold::default(), false)
                .await?
        {
            return Ok(reply);
        }
        // A replayed admission has no offset of its own, and a message joined into a response
        // that was running when it was admitted is answered by that response, which began
        // before its offset: both are read from the history snapshot (one answer, which holds
        // the conversation as it is), then from the stream after it if they are not settled
        // yet. Following the stream from its start instead would read every reset of the
        // conversation's history again (each a whole transcript, in one event).
        self.reply_from_history(receipt).await
    }

    /// The reply of `receipt`'s submission from the history snapshot, and the stream after
    /// it.
    async fn reply_from_history(&self, receipt: &Receipt) -> Result<Reply, ClientError> {
        let submission_id = receipt.submission_id.as_str();
        let snapshot = self.history_again_when_lost().await?;
        if let Some(current) = snapshot["incarnation"].as_str().filter(|current| !current.is_empty())
            && !receipt.uid.is_empty()
            && current != receipt.uid
        {
            return Err(ClientError::StreamReplaced {
                previous: receipt.uid.clone(),
                current: current.to_owned(),
            });
        }
        let mut replies = ReplyFold::of_snapshot(&snapshot);
        for settlement in snapshot["settlements"].as_array().into_iter().flatten() {
            let mut chunk = settlement.clone();
            let Value::Object(fields) = &mut chunk else {
                return Err(ClientError::Protocol(
                    "the history snapshot's settlements are not objects: is the client's base URL a flue server's?"
                        .into(),
                ));
            };
            fields.insert("type".into(), json!("submission-settled"));
            if let Some(result) = replies.apply(&chunk, submission_id, self.client.max_body_bytes) {
                return result;
            }
        }
        let Some(offset) = snapshot["offset"].as_str().filter(|offset| is_stream_offset(offset)) else {
            return Err(ClientError::Protocol(
                "the history snapshot has no stream offset: is the client's base URL a flue server's?".into(),
            ));
        };
        self.reply_from(receipt, offset, replies, true)
            .await?
            .ok_or_else(|| ClientError::Transport("the stream ended before the submission settled".into()))
    }

    /// The reply of `receipt`'s submission following the stream from `from` with `replies`
    /// (what came before `from`); `None` when it was answered by another submission's
    /// response, which may have begun before `from` (unless `whole`: `replies` holds
    /// everything before `from`). The stream must be the incarnation the receipt names: in
    /// another (the instance made again, the server's store replaced) the submission never
    /// settles, and the follow ends with [`ClientError::StreamReplaced`].
    async fn reply_from(
        &self,
        receipt: &Receipt,
        from: &str,
        mut replies: ReplyFold,
        whole: bool,
    ) -> Result<Option<Reply>, ClientError> {
        let submission_id = receipt.submission_id.as_str();
        let mut chunks = self.follow_from(&ResumePoint {
            incarnation: Some(receipt.uid.clone()).filter(|uid| !uid.is_empty()),
            ..ResumePoint::at(from)
        });
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk?;
            if !whole && ReplyFold::answered_by_another(&chunk, submission_id) {
                return Ok(None);
            }
            if let Some(result) = replies.apply(&chunk, submission_id, self.client.max_body_bytes) {
                return result.map(Some);
            }
        }
        Err(ClientError::Transport(
            "the stream ended before the submission settled".into(),
        ))
    }

    /// The history snapshot (`GET /:id`).
    pub async fn history(&self) -> Result<Value, ClientError> {
        self.history_read().await.map_err(|(error, _)| error)
    }

    /// The history snapshot; on failure, with the wait a refusal's `Retry-After` asked for.
    async fn history_read(&self) -> Result<Value, (ClientError, Option<Duration>)> {
        let response = self
            .client
            .call(reqwest::Method::GET, self.url(&[]).map_err(|error| (error, None))?)
            .send()
            .await
            .map_err(|error| (error.into(), None))?;
        let retry_after = retry_after_of(&response);
        json_of(response, self.client.max_body_bytes)
            .await
            .map_err(|error| (error, retry_after))
    }

    /// The history snapshot, read again (as a followed stream reconnects: backing off, as long
    /// as the server asks, [`Client::with_reconnect_limit`] times at most) while its answer is
    /// lost or the server is busy: a reply read from it is the submission's, which the server
    /// has, and a server whose readers hold all the room it gives answers 503 for a while.
    async fn history_again_when_lost(&self) -> Result<Value, ClientError> {
        let mut failures = 0;
        loop {
            match self.history_read().await {
                Ok(snapshot) => return Ok(snapshot),
                Err((error, retry_after)) if answer_lost(&error) && failures + 1 < self.client.reconnect_limit => {
                    failures += 1;
                    tokio::time::sleep(reconnect_delay(failures, retry_after)).await;
                }
                Err((error, _)) => return Err(error),
            }
        }
    }

    /// Requests an abort of the instance's unsettled submissions; whether any was.
    pub async fn abort(&self) -> Result<bool, ClientError> {
        let response = self
            .client
            .call(reqwest::Method::POST, self.url(&["abort"])?)
            .send()
            .await?;
        Ok(json_of(response, self.client.max_body_bytes).await?["aborted"] == json!(true))
    }

    /// Every chunk after `offset` (`-1`: from the start), live, for as long as the stream is
    /// read. A dropped connection is resumed from the last offset the server confirmed;
    /// chunks seen before are skipped by position, and a server answering 408, 429 or 5xx
    /// (or not reachable) is asked again after a growing pause, until
    /// [`Client::with_reconnect_limit`] connections in a row failed. Other errors the server answers (404, 416, …)
    /// end the stream, and so does an answer that is not the protocol (not an event stream,
    /// or a refusal without the error envelope) or an event the client cannot read (larger
    /// than [`Client::with_max_event_bytes`], or not JSON): [`ClientError::Protocol`]
    /// comes once, after every chunk received before that event, as the stream's last item.
    /// A stream the server replaced meanwhile (another incarnation of the instance) ends with
    /// [`ClientError::StreamReplaced`].
    pub fn follow(&self, offset: &str) -> Chunks {
        self.follow_from(&ResumePoint::at(offset))
    }

    /// [`Instance::follow`] from where a stream followed before stood ([`Chunks::resume_point`]):
    /// the chunks delivered then are skipped, and a stream replaced since (another incarnation
    /// of the instance) ends with [`ClientError::StreamReplaced`].
    pub fn follow_from(&self, point: &ResumePoint) -> Chunks {
        let resume = Arc::new(Mutex::new(point.clone()));
        let state = Follow {
            instance: self.clone(),
            offset: point.offset.clone(),
            last: point.last,
            resume: resume.clone(),
            body: None,
            parser: SseParser::new(self.client.max_event_bytes),
            ready: VecDeque::new(),
            failures: 0,
            connected_at: None,
            heard_at: None,
            incarnation: point.incarnation.clone(),
            retry_after: None,
            ended: false,
            error: None,
        };
        Chunks {
            stream: Box::pin(futures_util::stream::unfold(state, |mut state| async move {
                let item = state.next().await?;
                Some((item, state))
            })),
            resume,
        }
    }
}

type Body = Pin<Box<dyn Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>;

/// The state of a followed stream.
struct Follow {
    instance: Instance,
    /// Where a reconnection reads from: the last offset a control frame confirmed.
    offset: String,
    /// The position of the last chunk taken in (delivered, or ready to be).
    last: Option<(u64, u64)>,
    /// Where the stream stands after the chunks delivered (shared with [`Chunks`]).
    resume: Arc<Mutex<ResumePoint>>,
    body: Option<Body>,
    parser: SseParser,
    /// Chunks ready to be delivered, each with its position and the confirmed offset when it
    /// came (at or before its batch: where a later session reads it from again).
    ready: VecDeque<(Value, (u64, u64), String)>,
    /// Consecutive failed connections (the backoff grows with them). A connection that
    /// brings something new (a chunk, a later offset) or carries bytes (heartbeats) for
    /// [`Follow::stable`] starts the count again; one that only says hello and drops, or
    /// stays open silent until it is cut, does not.
    failures: u32,
    /// When the current connection was made.
    connected_at: Option<tokio::time::Instant>,
    /// When bytes (a heartbeat, at least) last came on the current connection.
    heard_at: Option<tokio::time::Instant>,
    /// The stream's incarnation, from the first connection's checkpoint.
    incarnation: Option<String>,
    /// The wait the last refusal asked for (`Retry-After`), when longer than the backoff.
    retry_after: Option<Duration>,
    /// The server refused the stream, or sent an event the client cannot read: the stream
    /// is over once `ready` and `error` are delivered.
    ended: bool,
    /// Why the stream ended, delivered after the chunks received before it.
    error: Option<ClientError>,
}

impl Follow {
    async fn next(&mut self) -> Option<Result<Value, ClientError>> {
        loop {
            if let Some((chunk, position, offset)) = self.ready.pop_front() {
                let mut resume = self.resume.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                resume.offset = offset;
                resume.last = Some(position);
                resume.incarnation.clone_from(&self.incarnation);
                return Some(Ok(chunk));
            }
            if self.ended {
                return self.error.take().map(Err);
            }
            let Some(body) = &mut self.body else {
                if self.failures > 0 {
                    tokio::time::sleep(reconnect_delay(self.failures, self.retry_after.take())).await;
                }
                // A server (or proxy) that takes the request and never answers is as dead
                // as a connection that went silent.
                let idle_timeout = self.instance.client.idle_timeout;
                let connecting = connect(&self.instance, &self.offset, &mut self.retry_after);
                let connected = tokio::time::timeout(idle_timeout, connecting)
                    .await
                    .unwrap_or_else(|_| Err(ClientError::Transport("the server did not answer".into())));
                match connected {
                    Ok(body) => {
                        self.body = Some(body);
                        self.connected_at = Some(tokio::time::Instant::now());
                        self.heard_at = None;
                    }
                    // A request timeout or a rate limit passes: asked again after the backoff.
                    Err(error @ ClientError::Api { status: 408 | 429, .. }) => self.failed(error),
                    // Beyond the head of another incarnation: the stream was replaced by a
                    // shorter one (an append-only stream never shrinks).
                    Err(ClientError::Api {
                        status: 416,
                        meta: Some(meta),
                        ..
                    }) if self.replaced_by(&meta).is_some() => {
                        self.ended = true;
                        return self.replaced_by(&meta).map(Err);
                    }
                    // What the server refuses (404, 416, …) stays refused, and an answer that
                    // is not the protocol stays so: the stream ends with the error (asking
                    // again would only hammer the server). It retries the rest.
                    Err(
                        error @ (ClientError::Api { status: ..500, .. }
                        | ClientError::Protocol(_)
                        | ClientError::InvalidRequest(_)),
                    ) => {
                        self.ended = true;
                        return Some(Err(error));
                    }
                    Err(error) => self.failed(error),
                }
                continue;
            };
            // The server sends at least a heartbeat every 15 s: a longer silence is a
            // connection that died without a reset (a dropped network, a NAT that forgot it).
            let Ok(next) = tokio::time::timeout(self.instance.client.idle_timeout, body.next()).await else {
                // Silent now: a working connection that died (a laptop asleep, a network
                // changed) when it carried the server's heartbeats for a while, else no sign
                // it ever worked.
                let worked = self
                    .connected_at
                    .zip(self.heard_at)
                    .is_some_and(|(connected, heard)| heard.duration_since(connected) >= self.stable());
                if !worked {
                    self.connected_at = None;
                }
                self.reconnect(ClientError::Transport("the stream went silent".into()));
                continue;
            };
            match next {
                Some(Ok(bytes)) => {
                    self.heard_at = Some(tokio::time::Instant::now());
                    self.parser.push(&bytes);
                    // The same offset would bring the same event again: end the stream
                    // rather than reconnect to it forever.
                    let taken = self.take_events();
                    if matches!(taken, Ok(true)) {
                        self.failures = 0;
                    }
                    if let Err(error) = taken {
                        self.body = None;
                        // Frees the event's buffer.
                        self.parser = SseParser::default();
                        self.ended = true;
                        self.error = Some(error);
                    }
                }
                // The connection dropped (or the server closed it): resume.
                Some(Err(error)) => self.reconnect(error.into()),
                None => self.reconnect(ClientError::Transport("the server closed the stream".into())),
            }
        }
    }

    fn reconnect(&mut self, error: ClientError) {
        self.body = None;
        // A connection that carried the server's heartbeats a while was not a failure to
        // connect: the count starts again (a proxy that cuts long connections now and then
        // ends nothing). One that only stayed open, silent, was (a proxy that holds the body
        // back and cuts it would otherwise be reconnected to forever).
        let stable = self.stable();
        let worked = self
            .connected_at
            .take()
            .zip(self.heard_at)
            .is_some_and(|(connected, heard)| heard.duration_since(connected) >= stable);
        if worked {
            self.failures = 0;
        }
        self.parser = SseParser::new(self.instance.client.max_event_bytes);
        self.failed(error);
    }

    /// How long after it was made a connection must still bring bytes (heartbeats, at least)
    /// to count as made: [`STABLE_CONNECTION`], or two thirds of the idle timeout when that is
    /// shorter.
    fn stable(&self) -> Duration {
        STABLE_CONNECTION.min(self.instance.client.idle_timeout.saturating_mul(2) / 3)
    }

    /// The replacement a 416's `meta` tells of: the stream's incarnation there, when it is not
    /// the one followed until then.
    fn replaced_by(&self, meta: &Value) -> Option<ClientError> {
        let previous = self.incarnation.as_deref()?;
        let current = meta["incarnation"].as_str().filter(|current| !current.is_empty())?;
        (current != previous).then(|| ClientError::StreamReplaced {
            previous: previous.to_owned(),
            current: current.to_owned(),
        })
    }

    /// A connection failed with `error`: the next is made after a pause, unless too many in a
    /// row failed (the stream then ends with the error).
    fn failed(&mut self, error: ClientError) {
        self.failures += 1;
        if self.failures >= self.instance.client.reconnect_limit {
            self.ended = true;
            self.error = Some(error);
        }
    }

    /// Moves the complete events out of the parser: chunks not seen before into `ready`, the
    /// confirmed offset from control frames. Returns whether anything new came (a chunk, a
    /// later offset); the error of an event that cannot be read (the events before it are
    /// taken), or of a checkpoint naming another incarnation than the stream's.
    fn take_events(&mut self) -> Result<bool, ClientError> {
        let mut progressed = false;
        let unreadable = |offset: &str, why: &dyn std::fmt::Display| {
            ClientError::Protocol(format!("cannot read the stream after offset {offset}: {why}"))
        };
        loop {
            let event = match self.parser.next_event() {
                Ok(Some(event)) => event,
                Ok(None) => return Ok(progressed),
                Err(error) => return Err(unreadable(&self.offset, &error)),
            };
            let payload: Value = match read_json(event.data.as_bytes()) {
                Ok(payload) => payload,
                Err(error) => {
                    let why = format!("an event's data is not JSON ({error})");
                    return Err(unreadable(&self.offset, &why));
                }
            };
            match event.event {
                "data" => {
                    for chunk in payload.as_array().into_iter().flatten() {
                        if chunk["type"] == "stream-checkpoint"
                            && let Some(current) = chunk["incarnation"].as_str().filter(|current| !current.is_empty())
                        {
                            match &self.incarnation {
                                Some(previous) if previous != current => {
                                    return Err(ClientError::StreamReplaced {
                                        previous: previous.clone(),
                                        current: current.to_owned(),
                                    });
                                }
                                Some(_) => {}
                                None => {
                                    self.incarnation = Some(current.to_owned());
                                    // Known from now on, before any chunk is delivered: a point
                                    // kept now finds a replaced stream replaced.
                                    self.resume
                                        .lock()
                                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                                        .incarnation
                                        .get_or_insert_with(|| current.to_owned());
                                }
                            }
                        }
                        let position = (chunk["position"]["batch"].as_u64(), chunk["position"]["index"].as_u64());
                        // The checkpoint has no position; the rest are delivered once.
                        let (Some(batch), Some(index)) = position else { continue };
                        if self.last.is_some_and(|last| (batch, index) <= last) {
                            continue;
                        }
                        self.last = Some((batch, index));
                        self.ready
                            .push_back((chunk.clone(), (batch, index), self.offset.clone()));
                        progressed = true;
                    }
                }
                "control" => {
                    if let Some(offset) = payload["streamNextOffset"].as_str()
                        && offset != self.offset
                    {
                        // Sent back in the next connection's query, and kept with every chunk
                        // taken after it: an offset is `-1` or two numbers, nothing longer.
                        if !is_stream_offset(offset) {
                            return Err(unreadable(
                                &self.offset,
                                &format!(
                                    "its streamNextOffset {:?} is no stream offset",
                                    offset.chars().take(40).collect::<String>()
                                ),
                            ));
                        }
                        offset.clone_into(&mut self.offset);
                        progressed = true;
                    }
                }
                _ => {}
            }
        }
    }
}

/// Whether `offset` is a stream offset as the protocol writes one: `-1`, or two numbers of at
/// most 20 digits joined by `_`.
fn is_stream_offset(offset: &str) -> bool {
    let number = |digits: &str| (1..=20).contains(&digits.len()) && digits.bytes().all(|byte| byte.is_ascii_digit());
    offset == "-1"
        || offset
            .split_once('_')
            .is_some_and(|(high, low)| number(high) && number(low))
}

/// How many times [`Instance::send`] posts one admission in all: the first post, and the
/// posts again after answers that were lost.
pub const ADMISSION_POSTS: u32 = 3;

/// Whether `error` leaves an admission's outcome unknown, or refused it for now: the
/// connection failed or timed out, a gateway or the server failed (5xx), or the server asked
/// to come back (408, 429). A refusal of the request itself (another 4xx) or an answer that
/// is not the protocol is the same when asked again.
fn answer_lost(error: &ClientError) -> bool {
    match error {
        ClientError::Transport(_) => true,
        ClientError::Api { status, .. } => *status >= 500 || matches!(status, 408 | 429),
        _ => false,
    }
}

/// The longest pause before a reconnection, whatever the server's `Retry-After` asks (a
/// gateway's `Retry-After: 86400` would otherwise hold a follower a day without a word).
const MAX_RECONNECT_WAIT: Duration = Duration::from_secs(30);

/// The pause before reconnecting after `failures` failed connections in a row: a backoff
/// doubling from 200 ms to 3.2 s, or the wait the server asked for when longer (at most
/// [`MAX_RECONNECT_WAIT`]).
fn reconnect_delay(failures: u32, retry_after: Option<Duration>) -> Duration {
    let backoff = Duration::from_millis(100 * 2u64.pow(failures.min(5)));
    retry_after.map_or(backoff, |asked| asked.min(MAX_RECONNECT_WAIT).max(backoff))
}

/// Connects a followed stream from `offset`; a refusal's `Retry-After` goes to `retry_after`.
async fn connect(instance: &Instance, offset: &str, retry_after: &mut Option<Duration>) -> Result<Body, ClientError> {
    let mut url = instance.url(&[])?;
    url.query_pairs_mut()
        .append_pair("view", "updates")
        .append_pair("offset", offset)
        .append_pair("live", "sse");
    let response = instance.client.request(reqwest::Method::GET, url).send().await?;
    let status = response.status().as_u16();
    *retry_after = retry_after_of(&response);
    connected(response, status, instance.client.max_body_bytes).await
}

/// The wait a response's `Retry-After` asks for.
fn retry_after_of(response: &reqwest::Response) -> Option<Duration> {
    response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|value| value.to_str().ok())
        .and_then(crate::provider::parse_retry_after)
}

/// The instance's SSE stream from a response. An answer that is not the protocol (a success
/// that is not an event stream, a refusal below 500 without the error envelope: a page from a
/// wrong base URL, say) is a [`ClientError::Protocol`].
async fn connected(response: reqwest::Response, status: u16, limit: usize) -> Result<Body, ClientError> {
    if response.status().is_success() {
        let content_type = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default();
        if !content_type.starts_with("text/event-stream") {
            return Err(ClientError::Protocol(format!(
                "the server answered {status} with {} instead of an event stream: is the client's base URL a flue server's?",
                if content_type.is_empty() {
                    "no content type"
                } else {
                    content_type
                }
            )));
        }
        return Ok(Box::pin(response.bytes_stream()));
    }
    match json_of(response, limit).await {
        Err(error @ ClientError::Api { .. }) => Err(error),
        // A rate limit or a request timeout passes, whatever its body says.
        Err(_) if matches!(status, 408 | 429) => Err(ClientError::Api {
            status,
            error_type: String::new(),
            message: format!("the server answered {status}"),
            details: String::new(),
            meta: None,
            reference: None,
        }),
        Err(error @ ClientError::Protocol(_)) => Err(error),
        Err(_) if status < 500 => Err(ClientError::Protocol(format!(
            "the server answered {status} without the protocol's error envelope: is the client's base URL a flue server's?"
        ))),
        Err(error) => Err(error),
        Ok(_) => Err(ClientError::Transport(
            "the server refused the stream without an error".into(),
        )),
    }
}

/// Builds replies from chunks.
#[derive(Default)]
struct ReplyFold {
    /// Submission → its response's message id.
    responses: std::collections::HashMap<String, String>,
    /// Response message id → the reply so far, and the step text being streamed.
    replies: std::collections::HashMap<String, (Vec<String>, String, Reply)>,
    /// Roughly the bytes the chunks taken in since the last snapshot added (texts, data,
    /// metadata, ids): what a reply may hold is bounded as a history's answer is.
    held: usize,
}

impl ReplyFold {
    /// Whether `chunk` settles `submission_id` as answered by another submission's response:
    /// a response that began before the delivery joined it, so before any offset its receipt
    /// gave (steps of it may lie there).
    fn answered_by_another(chunk: &Value, submission_id: &str) -> bool {
        chunk["type"] == "submission-settled"
            && chunk["submissionId"] == submission_id
            && chunk["outcome"] == "completed"
            && chunk["answeredBySubmissionId"]
                .as_str()
                .is_some_and(|host| host != submission_id)
    }

    /// The replies of a snapshot's assistant messages: their text parts (one per step), data
    /// parts and metadata.
    fn of_snapshot(snapshot: &Value) -> Self {
        let mut fold = Self::default();
        for message in snapshot["messages"].as_array().into_iter().flatten() {
            let (Some(message_id), Some(submission)) = (message["id"].as_str(), message["submissionId"].as_str())
            else {
                continue;
            };
            if message["role"] != "assistant" {
                continue;
            }
            fold.responses
                .entry(submission.to_owned())
                .or_insert_with(|| message_id.to_owned());
            let (texts, step, reply) = fold.replies.entry(message_id.to_owned()).or_default();
            for part in message["parts"].as_array().into_iter().flatten() {
                let kind = part["type"].as_str().unwrap_or_default();
                if kind == "text" && part["state"] == "streaming" {
                    // A step still streaming: its next deltas continue this text.
                    part["text"].as_str().unwrap_or_default().clone_into(step);
                } else if kind == "text" {
                    texts.push(part["text"].as_str().unwrap_or_default().to_owned());
                } else if let Some(name) = kind.strip_prefix("data-") {
                    reply.data.insert(name.to_owned(), part["data"].clone());
                }
            }
            if let Some(metadata) = message["metadata"].as_object() {
                flue_core::metadata::merge_metadata(&mut reply.metadata, metadata.clone());
            }
        }
        fold
    }

    /// Takes in `chunk`; the result once `submission_id` settled, or an error once what the
    /// replies hold passes `limit` bytes (a server streaming for ever without settling).
    fn apply(&mut self, chunk: &Value, submission_id: &str, limit: usize) -> Option<Result<Reply, ClientError>> {
        let message_id = chunk["messageId"].as_str().unwrap_or_default().to_owned();
        self.held = self.held.saturating_add(match chunk["type"].as_str()? {
            "message-started" => message_id.len() + chunk["metadata"].to_string().len(),
            "message-delta" => chunk["delta"].as_str().map_or(0, str::len),
            "data-part" | "message-metadata" => chunk.to_string().len(),
            _ => 0,
        });
        if self.held > limit {
            return Some(Err(ClientError::Protocol(format!(
                "the replies on the stream passed {limit} bytes before the submission settled"
            ))));
        }
        match chunk["type"].as_str()? {
            // The snapshot holds every response so far: what a reply already said is kept.
            "conversation-reset" => *self = Self::of_snapshot(&chunk["snapshot"]),
            "message-started" => {
                if let Some(submission) = chunk["submissionId"].as_str() {
                    self.responses
                        .entry(submission.to_owned())
                        .or_insert(message_id.clone());
                }
                let (_, step, reply) = self.replies.entry(message_id).or_default();
                step.clear();
                if let Some(metadata) = chunk["metadata"].as_object() {
                    flue_core::metadata::merge_metadata(&mut reply.metadata, metadata.clone());
                }
            }
            "message-delta" if chunk["kind"] == "text" => {
                let (_, step, _) = self.replies.entry(message_id).or_default();
                step.push_str(chunk["delta"].as_str().unwrap_or_default());
            }
            "message-completed" => {
                let (texts, step, _) = self.replies.entry(message_id).or_default();
                if !step.is_empty() {
                    texts.push(std::mem::take(step));
                }
            }
            "data-part" => {
                let (_, _, reply) = self.replies.entry(message_id).or_default();
                if let Some(name) = chunk["name"].as_str() {
                    reply.data.insert(name.to_owned(), chunk["data"].clone());
                }
            }
            "message-metadata" => {
                let (_, _, reply) = self.replies.entry(message_id).or_default();
                if let Some(metadata) = chunk["metadata"].as_object() {
                    flue_core::metadata::merge_metadata(&mut reply.metadata, metadata.clone());
                }
            }
            "submission-settled" if chunk["submissionId"] == submission_id => {
                if chunk["outcome"] != "completed" {
                    // A settlement without a readable error still ends the wait, as a failure.
                    let error = serde_json::from_value(chunk["error"].clone()).unwrap_or_else(|_| {
                        crate::record::SettlementError::new("internal_error", "The submission did not complete.")
                    });
                    return Some(Err(ClientError::Settled {
                        submission_id: submission_id.to_owned(),
                        outcome: chunk["outcome"].as_str().unwrap_or_default().to_owned(),
                        error: Box::new(error),
                    }));
                }
                // A joined delivery is answered by its host's response.
                let answered_by = chunk["answeredBySubmissionId"].as_str().unwrap_or(submission_id);
                let reply = self
                    .responses
                    .get(answered_by)
                    .and_then(|message_id| self.replies.get(message_id))
                    .map(|(texts, _, reply)| Reply {
                        text: texts.join("\n\n"),
                        ..reply.clone()
                    })
                    .unwrap_or_default();
                return Some(Ok(Reply {
                    submission_id: submission_id.to_owned(),
                    ..reply
                }));
            }
            _ => {}
        }
        None
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests assert by unwrapping

    use super::*;
    use std::sync::{Arc, Mutex};

    /// A server URL carrying a key in its query; nothing listens on port 1 of loopback.
    const SECRET_URL: &str = "http://127.0.0.1:1/?key=hunter2";

    #[tokio::test]
    async fn a_stream_from_an_unreachable_server_ends_after_its_reconnect_limit() {
        // Nothing listens on port 1 of loopback: every connection is refused at once.
        let client = Client::new("http://127.0.0.1:1").unwrap().with_reconnect_limit(3);
        let items: Vec<_> = client.instance("assistant", "i").follow("-1").collect().await;
        assert!(
            matches!(items.as_slice(), [Err(ClientError::Transport(_))]),
            "one transport error ends the stream (it retried forever before): {items:?}"
        );
    }

    #[tokio::test]
    async fn transport_errors_quote_the_server_without_its_query() {
        let client = Client::new(SECRET_URL).unwrap().with_bearer_token("token-hunter2");
        let errors = [
            client.catalog().await.unwrap_err(),
            client.instance("assistant", "i").history().await.unwrap_err(),
            client.instance("assistant", "i").abort().await.unwrap_err(),
        ];
        for error in errors {
            let (display, debug) = (error.to_string(), format!("{error:?}"));
            assert!(!display.contains("hunter2"), "{display}");
            assert!(!debug.contains("hunter2"), "{debug}");
            assert!(
                display.contains("http://127.0.0.1:1/"),
                "the server stays named: {display}"
            );
        }
    }

    /// A loopback server answering every request with `response`; its base URL.
    async fn answering(response: &'static str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let mut request = [0u8; 4096];
                let _ = socket.read(&mut request).await;
                let _ = socket.write_all(response.as_bytes()).await;
            }
        });
        base
    }

    /// A loopback server answering its connections with `responses` in turn (the last one
    /// from then on); its base URL.
    async fn answering_in_turn(responses: Vec<&'static str>) -> String {
        serving_in_turn(responses).await.0
    }

    /// [`answering_in_turn`], with the request lines (`GET /… HTTP/1.1`) it was sent.
    async fn serving_in_turn(responses: Vec<&'static str>) -> (String, Arc<Mutex<Vec<String>>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let lines = Arc::new(Mutex::new(Vec::new()));
        let recorded = lines.clone();
        tokio::spawn(async move {
            let mut turn = 0;
            while let Ok((mut socket, _)) = listener.accept().await {
                let mut request = [0u8; 4096];
                let read = socket.read(&mut request).await.unwrap_or(0);
                let text = String::from_utf8_lossy(&request[..read]);
                recorded
                    .lock()
                    .unwrap()
                    .push(text.lines().next().unwrap_or_default().to_owned());
                let response = responses[turn.min(responses.len() - 1)];
                turn += 1;
                let _ = socket.write_all(response.as_bytes()).await;
            }
        });
        (base, lines)
    }

    /// A test server answering each connection in turn with `responses`, after reading its
    /// request whole (headers, then the `content-length` body): the requests' bodies.
    async fn recording_in_turn(responses: Vec<String>) -> (String, Arc<Mutex<Vec<String>>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let recorded = bodies.clone();
        tokio::spawn(async move {
            let mut turn = 0;
            while let Ok((mut socket, _)) = listener.accept().await {
                let mut request = Vec::new();
                let mut buffer = [0u8; 4096];
                let body = loop {
                    let Ok(read @ 1..) = socket.read(&mut buffer).await else {
                        break None;
                    };
                    request.extend_from_slice(&buffer[..read]);
                    let text = String::from_utf8_lossy(&request).into_owned();
                    let Some(end) = text.find("\r\n\r\n") else { continue };
                    let length: usize = text[..end]
                        .lines()
                        .find_map(|line| {
                            line.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse().unwrap())
                        })
                        .unwrap_or(0);
                    if request.len() >= end + 4 + length {
                        break Some(text[end + 4..end + 4 + length].to_owned());
                    }
                };
                recorded.lock().unwrap().push(body.unwrap_or_default());
                let response = responses[turn.min(responses.len() - 1)].clone();
                turn += 1;
                let _ = socket.write_all(response.as_bytes()).await;
            }
        });
        (base, bodies)
    }

    fn answer(status: &str, body: &str) -> String {
        format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
    }

    const RECEIPT: &str = r#"{"submissionId":"sub_1","offset":"0000000000000000_0000000000000002","uid":"inst_1"}"#;

    /// A send whose answer was lost (a gateway's 502, a 503 the server gave while it
    /// started) is posted again under the same idempotency key, so the server admits the
    /// message once however many of the posts reached it.
    #[tokio::test]
    async fn a_send_whose_answer_was_lost_is_posted_again_under_the_same_key() {
        let (base, bodies) = recording_in_turn(vec![
            answer("502 Bad Gateway", "<h1>502</h1>"),
            answer(
                "503 Service Unavailable",
                r#"{"error":{"type":"unavailable","message":"Starting.","details":""}}"#,
            ),
            answer("202 Accepted", RECEIPT),
        ])
        .await;
        let instance = Client::new(base).unwrap().instance("assistant", "i");
        let receipt = instance.send("hello").await.unwrap();
        assert_eq!(receipt.submission_id, "sub_1");
        let bodies: Vec<Value> = bodies
            .lock()
            .unwrap()
            .iter()
            .map(|body| serde_json::from_str(body).unwrap())
            .collect();
        assert_eq!(bodies.len(), ADMISSION_POSTS as usize, "{bodies:?}");
        let key = bodies[0]["idempotencyKey"].as_str().unwrap().to_owned();
        assert!(key.starts_with("send_"), "{key}");
        for body in &bodies {
            assert_eq!(body["idempotencyKey"], json!(key));
            assert_eq!(body["body"], json!("hello"));
        }
        // Each send has its own key; a caller's own key is sent as given.
        let (base, bodies) = recording_in_turn(vec![answer("202 Accepted", RECEIPT)]).await;
        let instance = Client::new(base).unwrap().instance("assistant", "i");
        instance.send("again").await.unwrap();
        instance.send_with_key("mine", "order-42").await.unwrap();
        let bodies = bodies.lock().unwrap().clone();
        let keys: Vec<Value> = bodies
            .iter()
            .map(|body| serde_json::from_str::<Value>(body).unwrap()["idempotencyKey"].clone())
            .collect();
        assert_ne!(keys[0], json!(key));
        assert_eq!(keys[1], json!("order-42"));
    }

    /// Posting again stops at [`ADMISSION_POSTS`]; a refusal of the request itself is not
    /// posted again, nor is a raw body without a key (it could be admitted twice).
    #[tokio::test]
    async fn only_a_keyed_admission_whose_answer_was_lost_is_posted_again_and_only_so_often() {
        let unavailable = answer(
            "503 Service Unavailable",
            r#"{"error":{"type":"unavailable","message":"Down.","details":""}}"#,
        );
        let (base, bodies) = recording_in_turn(vec![unavailable.clone()]).await;
        let instance = Client::new(base).unwrap().instance("assistant", "i");
        let error = instance.send("hello").await.unwrap_err();
        assert!(matches!(error, ClientError::Api { status: 503, .. }), "{error:?}");
        assert_eq!(bodies.lock().unwrap().len(), ADMISSION_POSTS as usize);

        let (base, bodies) = recording_in_turn(vec![unavailable, answer("202 Accepted", RECEIPT)]).await;
        let instance = Client::new(base).unwrap().instance("assistant", "i");
        let error = instance.send_json(json!({"body": "unkeyed"})).await.unwrap_err();
        assert!(matches!(error, ClientError::Api { status: 503, .. }), "{error:?}");
        assert_eq!(bodies.lock().unwrap().len(), 1, "an unkeyed admission is posted once");

        let invalid = answer(
            "400 Bad Request",
            r#"{"error":{"type":"invalid_request","message":"No.","details":""}}"#,
        );
        let (base, bodies) = recording_in_turn(vec![invalid, answer("202 Accepted", RECEIPT)]).await;
        let instance = Client::new(base).unwrap().instance("assistant", "i");
        let error = instance.send("hello").await.unwrap_err();
        assert!(matches!(error, ClientError::Api { status: 400, .. }), "{error:?}");
        assert_eq!(bodies.lock().unwrap().len(), 1, "a refusal is not posted again");
    }

    /// A whole HTTP answer of `status` (`200 OK`) with the JSON `body`, after the `headers`
    /// given (each line ending with CRLF), closing its connection: for the test servers.
    fn json_answer(status: &str, headers: &str, body: &str) -> &'static str {
        Box::leak(
            format!(
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{headers}content-length: {}\r\n\
                 connection: close\r\n\r\n{body}",
                body.len()
            )
            .into_boxed_str(),
        )
    }

    /// A history whose settlements are not objects (another API behind the base URL, a
    /// proxy's stub) is no protocol: a replayed receipt's reply, read from it, is an error,
    /// not a panic.
    #[tokio::test]
    async fn a_reply_read_from_a_history_that_is_not_the_protocol_is_an_error() {
        let body = r#"{"offset":"-1","messages":[],"settlements":["x"]}"#;
        let base = answering(json_answer("200 OK", "", body)).await;
        let receipt = Receipt {
            submission_id: "sub_1".into(),
            offset: "-1".into(),
            uid: String::new(),
            deduplicated: true,
        };
        let read = Client::new(base)
            .unwrap()
            .instance("assistant", "i")
            .reply(&receipt)
            .await;
        assert!(matches!(read, Err(ClientError::Protocol(_))), "{read:?}");
    }

    /// A reply read from the history (a replayed admission's) is read again when the server
    /// answers it 503, after the wait it asks for: a server whose readers hold all the room it
    /// gives refuses for a while, and the submission's reply is still there. (Before, one 503
    /// failed the prompt at once.)
    #[tokio::test]
    async fn a_reply_read_from_a_busy_servers_history_is_read_again() {
        let refusal = r#"{"error":{"type":"server_busy","message":"Busy reading.","details":"Retry."}}"#;
        let busy = json_answer("503 Service Unavailable", "retry-after: 0\r\n", refusal);
        let body = r#"{"offset":"-1","incarnation":"","messages":[],"settlements":[{"submissionId":"sub_1","outcome":"completed"}]}"#;
        let history = json_answer("200 OK", "", body);
        let (base, lines) = serving_in_turn(vec![busy, busy, history]).await;
        let receipt = Receipt {
            submission_id: "sub_1".into(),
            offset: "-1".into(),
            uid: String::new(),
            deduplicated: true,
        };
        let instance = Client::new(&base).unwrap().instance("assistant", "i");
        let reply = instance.reply(&receipt).await.unwrap();
        assert_eq!(reply.submission_id, "sub_1");
        assert_eq!(lines.lock().unwrap().len(), 3, "read twice more");
        // Within the reconnect limit only.
        let (base, lines) = serving_in_turn(vec![busy]).await;
        let instance = Client::new(&base)
            .unwrap()
            .with_reconnect_limit(2)
            .instance("assistant", "i");
        let read = instance.reply(&receipt).await;
        assert!(matches!(read, Err(ClientError::Api { status: 503, .. })), "{read:?}");
        assert_eq!(lines.lock().unwrap().len(), 2);
    }

    /// A control frame's offset is sent back in the next connection's query and kept with
    /// every chunk taken after it: one that is no stream offset (a broken server's, or a
    /// hostile one's of megabytes) ends the follow as a protocol error.
    #[tokio::test]
    async fn a_stream_offset_that_is_no_offset_ends_the_follow() {
        let base = answering_in_turn(vec![
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n\
             event: data\ndata:[{\"type\":\"stream-checkpoint\",\"incarnation\":\"inst_a\"}]\n\n\
             event: control\ndata:{\"streamNextOffset\":\"0000000000000000_0000000000000001xxxxxxxxxxxx\"}\n\n",
        ])
        .await;
        let items = tokio::time::timeout(
            Duration::from_secs(10),
            Client::new(base)
                .unwrap()
                .instance("assistant", "i")
                .follow("-1")
                .collect::<Vec<_>>(),
        )
        .await
        .expect("the follow ends");
        assert!(
            matches!(items.as_slice(), [Err(ClientError::Protocol(message))] if message.contains("is no stream offset")),
            "{items:?}"
        );
        for (offset, valid) in [
            ("-1", true),
            ("0000000000000000_0000000000000001", true),
            ("12_3", true),
            ("", false),
            ("-2", false),
            ("1_", false),
            ("_1", false),
            ("1_2_3", false),
            ("１_2", false),
            (&"1".repeat(21), false),
        ] {
            assert_eq!(is_stream_offset(offset), valid, "{offset:?}");
        }
    }

    /// The error of sending `hi` to an instance of the server at `base`.
    async fn refused_send(base: &str) -> ClientError {
        Client::new(base)
            .unwrap()
            .instance("assistant", "i")
            .send("hi")
            .await
            .unwrap_err()
    }

    /// An admission the client did not see admitted is an error, never a receipt: a POST a
    /// proxy redirects (which a client following it would resend as a GET, without its
    /// body), and a success that is not a receipt (a base URL of another JSON API).
    #[tokio::test]
    async fn an_admission_answered_without_a_receipt_is_an_error() {
        let redirected = answering(
            "HTTP/1.1 301 Moved Permanently\r\nlocation: https://agents.example.com/elsewhere?key=hunter2\r\n\
             content-length: 0\r\nconnection: close\r\n\r\n",
        )
        .await;
        let error = refused_send(&redirected).await;
        let text = error.to_string();
        assert!(matches!(error, ClientError::Protocol(_)), "{error:?}");
        assert!(
            text.contains("redirecting to https://agents.example.com/elsewhere"),
            "{text}"
        );
        assert!(!text.contains("hunter2"), "{text}");
        let other_api = answering(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 8\r\n\
             connection: close\r\n\r\n{\"v\": 1}",
        )
        .await;
        let error = refused_send(&other_api).await;
        assert!(
            matches!(&error, ClientError::Protocol(text) if text.contains("without a receipt")),
            "{error:?}"
        );
        // A receipt whose offset is no stream offset (a follow would copy it into every chunk).
        let body = format!(
            r#"{{"submissionId":"s","offset":"{}","uid":"u"}}"#,
            "1".repeat(64 * 1024)
        );
        let huge = answering(String::leak(format!(
            "HTTP/1.1 202 Accepted\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
             connection: close\r\n\r\n{body}",
            body.len()
        )))
        .await;
        let error = refused_send(&huge).await;
        assert!(
            matches!(&error, ClientError::Protocol(text) if text.contains("no stream offset")),
            "{error:?}"
        );
    }

    /// A server that accepts the stream and drops it at once brings nothing new: the
    /// connections count as failed, and the stream ends at its limit instead of reconnecting
    /// five times a second forever.
    #[tokio::test]
    async fn a_stream_accepted_and_dropped_at_once_ends_after_its_reconnect_limit() {
        let base = answering(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n\
             event: data\ndata:[{\"type\":\"stream-checkpoint\",\"incarnation\":\"a\"}]\n\n",
        )
        .await;
        let client = Client::new(base).unwrap().with_reconnect_limit(3);
        let items = tokio::time::timeout(
            Duration::from_secs(20),
            client.instance("assistant", "i").follow("-1").collect::<Vec<_>>(),
        )
        .await
        .expect("the stream ends");
        assert!(
            matches!(items.as_slice(), [Err(ClientError::Transport(_))]),
            "{items:?}"
        );
    }

    /// A connection that stays up but silent (a hung server, a proxy that holds the stream
    /// back) is no working connection, however long it stays: it counts as failed, and the
    /// stream ends at its limit.
    #[tokio::test(start_paused = true)]
    async fn a_stream_that_stays_silent_ends_after_its_reconnect_limit() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((mut socket, _)) = listener.accept().await {
                let mut request = [0u8; 4096];
                let _ = socket.read(&mut request).await;
                let _ = socket
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
                    .await;
                // Kept open, and silent.
                held.push(socket);
            }
        });
        let client = Client::new(base).unwrap().with_reconnect_limit(3);
        let items: Vec<_> = client.instance("assistant", "i").follow("-1").collect().await;
        assert!(
            matches!(items.as_slice(), [Err(ClientError::Transport(message))] if message.contains("silent")),
            "{items:?}"
        );
    }

    /// A connection that stays open silent after its checkpoint until the peer cuts it (a
    /// buffering proxy that holds the body back), however long it stayed, counts as failed:
    /// the stream ends at its limit rather than reconnecting forever.
    #[tokio::test(start_paused = true)]
    async fn a_stream_cut_after_a_long_silence_ends_after_its_reconnect_limit() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut request = [0u8; 4096];
                    let _ = socket.read(&mut request).await;
                    let _ = socket
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n\
                              event: data\ndata:[{\"type\":\"stream-checkpoint\",\"incarnation\":\"a\"}]\n\n",
                        )
                        .await;
                    // Silent past the stable time, within the idle timeout; then cut.
                    tokio::time::sleep(Duration::from_secs(40)).await;
                });
            }
        });
        let client = Client::new(base).unwrap().with_reconnect_limit(3);
        let items = tokio::time::timeout(
            Duration::from_secs(3600),
            client.instance("assistant", "i").follow("-1").collect::<Vec<_>>(),
        )
        .await
        .expect("the stream ends");
        assert!(
            matches!(items.as_slice(), [Err(ClientError::Transport(_))]),
            "{items:?}"
        );
    }

    /// A stream replaced while it was followed (another incarnation) does not go on as if it
    /// were the same: what was read of the old one does not continue into the new one.
    #[tokio::test]
    async fn a_stream_replaced_while_followed_ends_with_its_new_incarnation() {
        let base = answering_in_turn(vec![
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n\
             event: data\ndata:[{\"type\":\"stream-checkpoint\",\"incarnation\":\"inst_a\"}]\n\n\
             event: data\ndata:[{\"type\":\"text\",\"position\":{\"batch\":0,\"index\":0}}]\n\n\
             event: control\ndata:{\"streamNextOffset\":\"0000000000000000_0000000000000001\"}\n\n",
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n\
             event: data\ndata:[{\"type\":\"stream-checkpoint\",\"incarnation\":\"inst_b\"}]\n\n",
        ])
        .await;
        let client = Client::new(base).unwrap();
        let items = tokio::time::timeout(
            Duration::from_secs(10),
            client.instance("assistant", "i").follow("-1").collect::<Vec<_>>(),
        )
        .await
        .expect("the stream ends");
        assert_eq!(items.len(), 2, "{items:?}");
        assert!(items[0].is_ok());
        assert!(
            matches!(&items[1], Err(ClientError::StreamReplaced { previous, current }) if previous == "inst_a" && current == "inst_b"),
            "{items:?}"
        );
    }

    /// A connection that carried the server's heartbeats for a while and then went silent
    /// (a laptop asleep, a network that changed) was a working one: such drops, however many,
    /// do not end a follow of a quiet instance as connections that never worked do.
    #[tokio::test]
    async fn a_working_connection_that_goes_silent_is_not_counted_a_failed_one() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = connections.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((mut socket, _)) = listener.accept().await {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut request = [0u8; 4096];
                let _ = socket.read(&mut request).await;
                let _ = socket
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n\
                          event: data\ndata:[{\"type\":\"stream-checkpoint\",\"incarnation\":\"inst_a\"}]\n\n",
                    )
                    .await;
                // Heartbeats for 250 ms, then silence, the connection kept open.
                for _ in 0..5 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let _ = socket.write_all(b": heartbeat\n\n").await;
                }
                held.push(socket);
            }
        });
        let client = Client::new(base)
            .unwrap()
            .with_idle_timeout(Duration::from_millis(300))
            .with_reconnect_limit(2);
        let mut chunks = client.instance("assistant", "i").follow("-1");
        let ended = tokio::time::timeout(Duration::from_secs(3), chunks.next()).await;
        assert!(ended.is_err(), "the follow ended: {ended:?}");
        assert!(
            connections.load(std::sync::atomic::Ordering::SeqCst) >= 3,
            "it reconnected past its limit of failed connections"
        );
    }

    /// A connection that drops after delivering chunks the server had not confirmed yet (no
    /// control frame followed them) is resumed from the last confirmed offset, which sends
    /// them again: the client skips the ones it delivered, and every chunk arrives once.
    #[tokio::test]
    async fn chunks_delivered_before_a_drop_are_not_delivered_again_on_resuming() {
        let base = answering_in_turn(vec![
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n\
             event: data\ndata:[{\"type\":\"stream-checkpoint\",\"incarnation\":\"inst_a\"}]\n\n\
             event: data\ndata:[{\"type\":\"text\",\"n\":0,\"position\":{\"batch\":1,\"index\":0}},{\"type\":\"text\",\"n\":1,\"position\":{\"batch\":1,\"index\":1}}]\n\n",
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n\
             event: data\ndata:[{\"type\":\"stream-checkpoint\",\"incarnation\":\"inst_a\"}]\n\n\
             event: data\ndata:[{\"type\":\"text\",\"n\":0,\"position\":{\"batch\":1,\"index\":0}},{\"type\":\"text\",\"n\":1,\"position\":{\"batch\":1,\"index\":1}},{\"type\":\"text\",\"n\":2,\"position\":{\"batch\":1,\"index\":2}}]\n\n\
             event: data\ndata:[{\"type\":\"text\",\"n\":3,\"position\":{\"batch\":2,\"index\":0}}]\n\n\
             event: control\ndata:{\"streamNextOffset\":\"0000000000000000_0000000000000003\"}\n\n",
            // Then the stream ends for good: a refusal that is not retried.
            "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
        ])
        .await;
        let client = Client::new(base).unwrap();
        let items = tokio::time::timeout(
            Duration::from_secs(10),
            client.instance("assistant", "i").follow("-1").collect::<Vec<_>>(),
        )
        .await
        .expect("the stream ends");
        let delivered: Vec<u64> = items
            .iter()
            .filter_map(|item| item.as_ref().ok())
            .map(|chunk| chunk["n"].as_u64().unwrap())
            .collect();
        assert_eq!(delivered, [0, 1, 2, 3], "{items:?}");
        assert!(matches!(items.last(), Some(Err(ClientError::Protocol(_)))), "{items:?}");
    }

    /// A follow resumed in a later session from the point the last one delivered its chunks
    /// to reads from an offset the server confirmed, delivers none of those chunks again, and
    /// ends as replaced when the instance was made again meanwhile.
    #[tokio::test]
    async fn a_follow_resumed_from_its_resume_point_delivers_each_chunk_once_and_knows_its_stream() {
        const OFFSET: &str = "0000000000000000_0000000000000002";
        let (base, requests) = serving_in_turn(vec![
            // The first session: batch 1, its confirmation, then batch 2's first chunk.
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n\
             event: data\ndata:[{\"type\":\"stream-checkpoint\",\"incarnation\":\"inst_a\"}]\n\n\
             event: data\ndata:[{\"type\":\"text\",\"n\":0,\"position\":{\"batch\":1,\"index\":0}},{\"type\":\"text\",\"n\":1,\"position\":{\"batch\":1,\"index\":1}}]\n\n\
             event: control\ndata:{\"streamNextOffset\":\"0000000000000000_0000000000000002\"}\n\n\
             event: data\ndata:[{\"type\":\"text\",\"n\":2,\"position\":{\"batch\":2,\"index\":0}}]\n\n",
            // The second: from the confirmed offset, batch 2 whole.
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n\
             event: data\ndata:[{\"type\":\"stream-checkpoint\",\"incarnation\":\"inst_a\"}]\n\n\
             event: data\ndata:[{\"type\":\"text\",\"n\":2,\"position\":{\"batch\":2,\"index\":0}},{\"type\":\"text\",\"n\":3,\"position\":{\"batch\":2,\"index\":1}}]\n\n",
            "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
            // The third: the instance was made again.
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n\
             event: data\ndata:[{\"type\":\"stream-checkpoint\",\"incarnation\":\"inst_b\"}]\n\n",
        ])
        .await;
        let client = Client::new(base).unwrap();
        let instance = client.instance("assistant", "i");
        let mut first = instance.follow("-1");
        assert_eq!(first.resume_point(), ResumePoint::at("-1"), "nothing read yet");
        // Where each chunk stands is the offset confirmed before it (all of a batch's chunks
        // were taken in at once, with the confirmation that follows them): a point kept after
        // the first chunk of batch 1 goes on from before batch 1, not after it.
        let stands = [("-1", (1, 0)), ("-1", (1, 1)), (OFFSET, (2, 0))];
        for (n, (offset, last)) in stands.into_iter().enumerate() {
            let chunk = tokio::time::timeout(Duration::from_secs(5), first.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            assert_eq!(chunk["n"], n);
            assert_eq!(
                first.resume_point(),
                ResumePoint {
                    offset: offset.into(),
                    last: Some(last),
                    incarnation: Some("inst_a".into()),
                },
                "after chunk {n}"
            );
        }
        let point = first.resume_point();
        drop(first);
        assert_eq!(
            point,
            ResumePoint {
                offset: OFFSET.into(),
                last: Some((2, 0)),
                incarnation: Some("inst_a".into()),
            }
        );
        // Kept between sessions as JSON.
        let point: ResumePoint = serde_json::from_str(&serde_json::to_string(&point).unwrap()).unwrap();
        let items = tokio::time::timeout(
            Duration::from_secs(10),
            instance.follow_from(&point).collect::<Vec<_>>(),
        )
        .await
        .expect("the stream ends");
        let delivered: Vec<u64> = items
            .iter()
            .filter_map(|item| item.as_ref().ok())
            .map(|chunk| chunk["n"].as_u64().unwrap())
            .collect();
        assert_eq!(delivered, [3], "{items:?}");
        assert!(
            requests.lock().unwrap()[1].contains(&format!("offset={OFFSET}")),
            "{:?}",
            requests.lock().unwrap()
        );
        let replaced = tokio::time::timeout(
            Duration::from_secs(10),
            instance.follow_from(&point).collect::<Vec<_>>(),
        )
        .await
        .expect("the stream ends");
        assert!(
            matches!(&replaced[..], [Err(ClientError::StreamReplaced { previous, current })] if previous == "inst_a" && current == "inst_b"),
            "{replaced:?}"
        );
    }

    /// A stream replaced by a shorter one (the server's store started over, the instance was
    /// made again with fewer batches) answers the reconnection 416: with another incarnation
    /// in its meta, that is the replacement, not an offset the client got wrong; with the one
    /// followed, it stays the server's refusal.
    #[tokio::test]
    async fn a_replacement_shorter_than_the_offset_read_is_reported_replaced() {
        let gone = |incarnation: &str| {
            let body = format!(
                "{{\"error\":{{\"type\":\"stream_offset_gone\",\"message\":\"The requested offset is beyond the end of the stream.\",\"details\":\"\",\"meta\":{{\"offset\":\"0000000000000000_0000000000000040\",\"nextOffset\":\"0000000000000000_0000000000000002\",\"incarnation\":\"{incarnation}\"}}}}}}"
            );
            format!(
                "HTTP/1.1 416 Range Not Satisfiable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
        };
        let followed = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n\
             event: data\ndata:[{\"type\":\"stream-checkpoint\",\"incarnation\":\"inst_a\"}]\n\n\
             event: data\ndata:[{\"type\":\"text\",\"position\":{\"batch\":40,\"index\":0}}]\n\n\
             event: control\ndata:{\"streamNextOffset\":\"0000000000000000_0000000000000040\"}\n\n";
        for (incarnation, replaced) in [("inst_b", true), ("inst_a", false)] {
            // Leaked: the test server serves `'static` answers (a few hundred bytes, twice).
            let gone: &'static str = Box::leak(gone(incarnation).into_boxed_str());
            let base = answering_in_turn(vec![followed, gone]).await;
            let client = Client::new(base).unwrap();
            let items = tokio::time::timeout(
                Duration::from_secs(10),
                client.instance("assistant", "i").follow("-1").collect::<Vec<_>>(),
            )
            .await
            .expect("the stream ends");
            assert_eq!(items.len(), 2, "{items:?}");
            if replaced {
                assert!(
                    matches!(&items[1], Err(ClientError::StreamReplaced { previous, current }) if previous == "inst_a" && current == "inst_b"),
                    "{items:?}"
                );
            } else {
                assert!(
                    matches!(&items[1], Err(ClientError::Api { status: 416, .. })),
                    "{items:?}"
                );
            }
        }
    }

    /// The error envelope reaches the caller whole, with the reference the server logged the
    /// cause under; a refusal that is not the envelope is not taken for one.
    #[tokio::test]
    async fn an_error_envelope_keeps_its_reference_and_a_foreign_refusal_is_a_protocol_error() {
        let failing = answering(
            "HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n\
             flue-error-ref: err_01\r\ncontent-length: 94\r\nconnection: close\r\n\r\n\
             {\"error\":{\"type\":\"internal_error\",\"message\":\"An internal error.\",\"details\":\"\",\"ref\":\"err_01\"}}",
        )
        .await;
        let error = Client::new(failing).unwrap().catalog().await.unwrap_err();
        assert!(
            matches!(&error, ClientError::Api { status: 500, reference: Some(reference), .. } if reference == "err_01"),
            "{error:?}"
        );
        assert!(error.to_string().ends_with("(ref err_01)"), "{error}");
        let gateway = answering(
            "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\
             connection: close\r\n\r\n{}",
        )
        .await;
        let error = Client::new(gateway).unwrap().catalog().await.unwrap_err();
        assert!(matches!(error, ClientError::Protocol(_)), "{error:?}");
        // A gateway's HTML 502 is the server's failure, with its status (a caller retries it).
        let html = answering(
            "HTTP/1.1 502 Bad Gateway\r\ncontent-type: text/html\r\nflue-error-ref: err_02\r\n\
             content-length: 13\r\nconnection: close\r\n\r\n<h1>502</h1>\n",
        )
        .await;
        let error = Client::new(html).unwrap().catalog().await.unwrap_err();
        assert!(
            matches!(&error, ClientError::Api { status: 502, error_type, reference: Some(reference), .. } if error_type.is_empty() && reference == "err_02"),
            "{error:?}"
        );
    }

    #[tokio::test]
    async fn a_refused_connection_says_why() {
        let error = Client::new("http://127.0.0.1:1").unwrap().catalog().await.unwrap_err();
        assert!(error.to_string().to_lowercase().contains("refused"), "{error}");
    }

    #[tokio::test]
    async fn a_redirect_to_a_url_with_a_key_leaves_the_key_out_of_the_error() {
        // The redirect is not followed; the error names where it points, without its key.
        let base = answering(
            "HTTP/1.1 302 Found\r\nlocation: http://user:hunter2@127.0.0.1:1/next?key=hunter2\r\n\
             content-length: 0\r\nconnection: close\r\n\r\n",
        )
        .await;
        let error = Client::new(base).unwrap().catalog().await.unwrap_err();
        let (display, debug) = (error.to_string(), format!("{error:?}"));
        assert!(!display.contains("hunter2"), "{display}");
        assert!(!debug.contains("hunter2"), "{debug}");
    }

    #[tokio::test]
    async fn an_answer_that_is_not_json_is_reported_without_the_url_secrets() {
        let base = answering("HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n\r\nabc").await;
        let error = Client::new(format!("{base}/?key=hunter2"))
            .unwrap()
            .catalog()
            .await
            .unwrap_err();
        let (display, debug) = (error.to_string(), format!("{error:?}"));
        assert!(display.starts_with("the server answered 200 with no JSON"), "{display}");
        assert!(!display.contains("hunter2"), "{display}");
        assert!(!debug.contains("hunter2"), "{debug}");
    }

    #[tokio::test]
    async fn a_refused_stream_keeps_the_wait_the_server_asked_for() {
        let base = answering(
            "HTTP/1.1 503 Service Unavailable\r\nretry-after: 7\r\ncontent-type: application/json\r\n\
             content-length: 2\r\nconnection: close\r\n\r\n{}",
        )
        .await;
        let instance = Client::new(base).unwrap().instance("assistant", "i");
        let mut retry_after = None;
        let refused = connect(&instance, "-1", &mut retry_after).await.err();
        assert!(
            matches!(refused, Some(ClientError::Api { status: 503, .. })),
            "{refused:?}"
        );
        assert_eq!(retry_after, Some(Duration::from_secs(7)));
        // The asked wait, when longer than the backoff; the backoff otherwise.
        assert_eq!(reconnect_delay(1, retry_after), Duration::from_secs(7));
        assert_eq!(
            reconnect_delay(5, Some(Duration::from_millis(1))),
            Duration::from_millis(3200)
        );
        assert_eq!(reconnect_delay(1, None), Duration::from_millis(200));
        // A wait asked past 30 s (a day, or more than a duration holds) is 30 s.
        assert_eq!(
            reconnect_delay(1, Some(Duration::from_secs(86_400))),
            MAX_RECONNECT_WAIT
        );
        assert_eq!(reconnect_delay(5, Some(Duration::MAX)), MAX_RECONNECT_WAIT);
    }

    /// A loopback server answering every request with `response` and sending each request's
    /// first line to the receiver; its base URL.
    async fn recording(response: &'static str) -> (String, tokio::sync::mpsc::UnboundedReceiver<String>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (lines, received) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let mut request = [0u8; 4096];
                let read = socket.read(&mut request).await.unwrap_or(0);
                let text = String::from_utf8_lossy(&request[..read]);
                let _ = lines.send(text.lines().next().unwrap_or_default().to_owned());
                let _ = socket.write_all(response.as_bytes()).await;
            }
        });
        (base, received)
    }

    /// An answer that will be the same when asked again (past the body bound, or a success
    /// that is not JSON) is not asked for again: an admission is posted once, not three times.
    #[tokio::test]
    async fn an_answer_that_would_be_the_same_again_is_not_asked_for_again() {
        const NOT_JSON: &str = "HTTP/1.1 202 Accepted\r\ncontent-type: text/html\r\ncontent-length: 9\r\n\
             connection: close\r\n\r\n<html/>..";
        let (base, mut lines) = recording(NOT_JSON).await;
        let error = refused_send(&base).await;
        assert!(
            matches!(&error, ClientError::Protocol(text) if text.contains("no JSON")),
            "{error:?}"
        );
        let mut posts = 0;
        while let Ok(line) = lines.try_recv() {
            posts += usize::from(line.starts_with("POST"));
        }
        assert_eq!(posts, 1);
    }

    #[tokio::test]
    async fn an_answer_past_the_body_bound_is_refused_whether_declared_or_streamed() {
        // 64 bytes of JSON: declared by its length, then streamed in chunks without one.
        const DECLARED: &str = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 64\r\n\
             connection: close\r\n\r\n{\"agents\":[\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"]}";
        const STREAMED: &str = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\
             connection: close\r\n\r\n20\r\n{\"agents\":[\"aaaaaaaaaaaaaaaaaaaa\r\n20\r\naaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"]}\r\n0\r\n\r\n";
        for response in [DECLARED, STREAMED] {
            let (base, _lines) = recording(response).await;
            let bounded = Client::new(&base).unwrap().with_max_body_bytes(63);
            let error = bounded.catalog().await.unwrap_err();
            assert!(
                matches!(&error, ClientError::Protocol(text) if text.contains("larger than the client's bound of 63 bytes")),
                "{error:?}"
            );
            let fits = Client::new(&base)
                .unwrap()
                .with_max_body_bytes(64)
                .catalog()
                .await
                .unwrap();
            assert_eq!(fits["agents"][0].as_str().map(str::len), Some(49));
        }
    }

    #[tokio::test]
    async fn a_base_urls_path_and_query_frame_every_request_path() {
        let (base, mut lines) = recording(
            "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\
             connection: close\r\n\r\n{}",
        )
        .await;
        let client = Client::new(format!("{base}/gateway/?key=k#fragment")).unwrap();
        let instance = client.instance("assistant", "a b/c?d");
        let _ = client.catalog().await;
        let _ = instance.history().await;
        let _ = instance.abort().await;
        let _ = instance.send("hi").await;
        let _ = instance.follow("-1").collect::<Vec<_>>().await;
        let mut seen = Vec::new();
        while let Ok(line) = lines.try_recv() {
            seen.push(line);
        }
        assert_eq!(
            seen,
            [
                "GET /gateway/agents?key=k HTTP/1.1",
                "GET /gateway/agents/assistant/a%20b%2Fc%3Fd?key=k HTTP/1.1",
                "POST /gateway/agents/assistant/a%20b%2Fc%3Fd/abort?key=k HTTP/1.1",
                "POST /gateway/agents/assistant/a%20b%2Fc%3Fd?key=k HTTP/1.1",
                "GET /gateway/agents/assistant/a%20b%2Fc%3Fd?key=k&view=updates&offset=-1&live=sse HTTP/1.1",
            ]
        );
    }

    #[tokio::test]
    async fn an_instance_id_or_agent_of_dots_is_refused_instead_of_reaching_another_url() {
        let (base, mut lines) = recording("HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}").await;
        let client = Client::new(base).unwrap();
        for (agent, id) in [
            ("assistant", "."),
            ("assistant", ".."),
            ("..", "i"),
            (".", "i"),
            // A URL drops tabs and line breaks: these would reach `useralice`, `..`, `ab`.
            ("assistant", "user\talice"),
            ("assistant", ".\t."),
            ("assistant", "a\r\nb"),
            ("assist\nant", "i"),
        ] {
            let instance = client.instance(agent, id);
            let errors = [
                instance.history().await.unwrap_err(),
                instance.abort().await.unwrap_err(),
                instance.send("hi").await.unwrap_err(),
                instance.prompt("hi").await.unwrap_err(),
            ];
            for error in errors {
                assert!(
                    matches!(error, ClientError::InvalidRequest(_)),
                    "{agent}/{id}: {error:?}"
                );
            }
            let followed: Vec<_> = instance.follow("-1").collect().await;
            assert!(
                matches!(followed.as_slice(), [Err(ClientError::InvalidRequest(_))]),
                "{agent}/{id}: {followed:?}"
            );
        }
        assert!(lines.try_recv().is_err(), "no request left the client");
        // `..` inside an id is only text.
        let dotted = client.instance("assistant", "a..b").history().await;
        assert!(dotted.is_ok(), "{dotted:?}");
        assert_eq!(lines.recv().await.unwrap(), "GET /agents/assistant/a..b HTTP/1.1");
    }

    /// A server streaming text for ever without settling the submission (broken, hostile, or
    /// a proxy looping) ends a reply once what it holds passes the client's bound, instead of
    /// growing it until memory runs out.
    #[test]
    fn a_reply_that_never_settles_ends_once_it_holds_more_than_the_bound() {
        let mut fold = ReplyFold::default();
        let started = json!({"type": "message-started", "messageId": "m1", "submissionId": "s1"});
        assert!(fold.apply(&started, "s1", 1_000).is_none());
        let delta = json!({"type": "message-delta", "kind": "text", "messageId": "m1", "delta": "x".repeat(100)});
        let mut ended = None;
        for _ in 0..20 {
            if let Some(result) = fold.apply(&delta, "s1", 1_000) {
                ended = Some(result);
                break;
            }
        }
        assert!(
            matches!(ended, Some(Err(ClientError::Protocol(ref message))) if message.contains("1000 bytes")),
            "{ended:?}"
        );
        // Within the bound, the reply is what the chunks said.
        let mut fold = ReplyFold::default();
        for chunk in [
            started,
            json!({"type": "message-delta", "kind": "text", "messageId": "m1", "delta": "hello"}),
            json!({"type": "message-completed", "messageId": "m1"}),
        ] {
            assert!(fold.apply(&chunk, "s1", 1_000).is_none());
        }
        let settled = json!({"type": "submission-settled", "submissionId": "s1", "outcome": "completed"});
        let reply = fold.apply(&settled, "s1", 1_000).unwrap().unwrap();
        assert_eq!(reply.text, "hello");
    }

    /// Credentials in the base URL go as Basic authorization (a proxy in front of the
    /// server), unless a bearer token is set: it replaces them, as two `Authorization` headers
    /// would leave the server reading the first.
    #[test]
    fn a_bearer_token_replaces_the_base_urls_credentials() {
        let basic = Client::new("http://gw:hunter2@127.0.0.1:1/").unwrap();
        assert_eq!((basic.base.username(), basic.base.password()), ("gw", Some("hunter2")));
        let bearer = basic.with_bearer_token("tok");
        assert_eq!((bearer.base.username(), bearer.base.password()), ("", None));
        assert_eq!(bearer.base.as_str(), "http://127.0.0.1:1/");
    }

    #[test]
    fn a_base_url_that_is_not_an_http_url_is_refused_without_its_secrets() {
        for base in [
            "127.0.0.1:3583",
            "not a url",
            "ftp://user:hunter2@host/",
            "mailto:me@example.com",
        ] {
            let error = Client::new(base).unwrap_err();
            assert!(matches!(error, ClientError::InvalidRequest(_)), "{base}: {error:?}");
            assert!(!error.to_string().contains("hunter2"), "{error}");
        }
    }

    #[test]
    fn debug_of_a_client_and_its_instances_shows_neither_the_bearer_token_nor_url_secrets() {
        let client = Client::new(SECRET_URL).unwrap().with_bearer_token("token-hunter2");
        let instance = client.instance("assistant", "i");
        for debug in [format!("{client:?}"), format!("{instance:?}")] {
            assert!(!debug.contains("hunter2"), "{debug}");
            assert!(debug.contains("127.0.0.1:1"), "{debug}");
        }
    }
}
