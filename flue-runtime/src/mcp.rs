//! MCP connections (`use_mcp_connection`; the definitions of [`flue_core::mcp`], re-exported):
//! at the start of a submission the runtime connects to each declared server over streamable
//! HTTP (rmcp), lists its tools, and mounts them as `mcp__<server>__<tool>` (characters a tool
//! name cannot hold become `_`).
//!
//! - **Listing.** A server that repeats a `tools/list` cursor is refused (its listing would
//!   never end), and so is one whose listing does not parse as MCP's schema reads it (the
//!   client reads a page whole: one tool without an object `inputSchema` refuses the page).
//!   The cursors count with the tools against the listing's bound. A connection's `tools`
//!   list mounts those tools, in its order: a name the server does not list, or one named
//!   twice, refuses the server (a typo must not quietly leave the model without the tool).
//! - **Schemas.** A tool's input schema without `type` is an object's, and one without
//!   `properties` has none (as the reference reads them). Its root is declared without the
//!   keywords providers refuse there (`anyOf`, `oneOf`, `allOf`, `not`, `enum`: every request
//!   would fail), the properties of their branches becoming the root's; the server checks the
//!   rest when called. An array that says nothing of its items is declared with `items` of
//!   any value (OpenAI refuses every request declaring one without). A tool whose schema is
//!   not a valid JSON Schema, whose root is not an object, or which is larger than 64 KiB
//!   (declared in every model request), refuses the server when the connection names it, and
//!   is otherwise left out with a warning (the server's other tools are mounted). A
//!   description is cut to 8 KiB,
//!   and says which server's tool it is under its own name (and its title). A schema whose
//!   choices would take too long to read is one the tool cannot be called with. A server that
//!   would mount more than 128 tools (what OpenAI takes in a whole request), or 1 MiB of
//!   declarations, is unavailable (the agent's other tools count against a request's bound
//!   too: a connection's `tools` keeps what a server mounts to what it needs).
//! - **Timeout.** Connecting, listing and each call take at most the connection's timeout
//!   (60 s by default).
//! - **Names.** Two tools of one server whose mounted names are the same (`a.b` and `a_b`, or
//!   names alike in their first 64 characters) make the server unusable, with a reason naming
//!   both; the connection's `tools` then picks one. Neither is dropped nor renamed (`…_2`):
//!   which one a name meant would then hang on the order the server lists them, and could
//!   change between the attempts of a durable response. Tools of two servers that mount alike
//!   (servers `a b` and `a_b`) fail the submission as any taken tool name does
//!   (`tool_name_conflict`): the server names are the agent's to change.
//! - **Calls.** A call goes to the server; its text content is the result, an embedded
//!   resource's text under a line naming its URI, a resource link as its name, URI and
//!   description, and images, audio and binary resources are named in brackets with their type
//!   and size; structured content is added when no block is text (servers send its JSON as text
//!   too). An error result stays an error. The text is cut to its first 50 KB (the sandbox
//!   tools' output cap), on a character boundary, with a line saying so.
//! - **Reuse.** An instance keeps its live connections while it stays in memory, and its later
//!   responses reuse them (so a server keeps its session state between messages, and nobody
//!   pays for its handshake again): one whose definition is the same as the one declared,
//!   whose transport is still open and which lists its tools again, which each response
//!   mounts as listed then (reference §3.7: a submission's init connects, so a server's
//!   changes show from the next message on). A server whose transport failed is connected
//!   afresh, and so found unavailable as at a first connect; one that answers its listing with
//!   an error or with a list that cannot be mounted is unavailable for that response (a new
//!   session would be asked the same, after a handshake's wait), its connection kept for the
//!   next to list again; one that does not answer in time is unavailable for that response
//!   and not kept (the hang may be its session's). A connection
//!   that failed is not kept, so the next response tries again, and one the render no longer
//!   declares is closed. A response connects the servers it does not have together, and an
//!   abort stops the connecting. A connection no response used for
//!   [`RuntimeOptions::mcp_session_idle`](crate::RuntimeOptions::mcp_session_idle) (5 min) is
//!   closed (by the node's scan, or by the next response, which connects afresh): an idle
//!   instance holds no socket, no session on the server and no stream the client re-opens.
//! - **Size.** One message of a server (a result, a listing page, a notification) is read up
//!   to [`MAX_MESSAGE_BYTES`]; a larger one fails its call (its parse would take many times its
//!   size). A stream the client keeps re-opening backs off, up to 30 s between tries.
//! - **Failures.** A server that cannot be used fails the submission (`mcp_connection_failed`),
//!   unless it is `optional`: then its tools are not mounted for this response, observers get a
//!   `warn` log event naming it, and the model is told so with a `resources` signal (attribute
//!   `resource="mcp"`) before its first call.
//! - **Secrets.** The bearer token (`auth`) goes only into the requests' `Authorization`
//!   header, and a URL quoted in an error (the server's own, as a connection error names it) is
//!   quoted without its userinfo, query and fragment, where a token may sit too. The MCP
//!   client library logs its own request failures under the `rmcp` target with the URL and
//!   error bodies whole: an application with a `tracing` subscriber of its own turns that
//!   target off, as [`cli::log_to_stderr`](crate::cli::log_to_stderr) does.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use flue_core::data::{DataSchema, SchemaSource};
use flue_core::tool::{ToolContext, ToolDefinition, ToolHandler, ToolOutput};
use flue_core::url::without_url_secrets;
use flue_core::{BoxFuture, Tool};
use rmcp::model::{CallToolRequestParams, ContentBlock, PaginatedRequestParams, ResourceContents};
use rmcp::service::RunningService;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::{
    StreamableHttpClient, StreamableHttpClientTransportConfig, StreamableHttpError, StreamableHttpPostResponse,
    StreamableHttpResponseLimits,
};
use rmcp::{RoleClient, ServiceExt};
use serde_json::Value;

use crate::provider::{redact_prefix, redact_secret};
use crate::sandbox::tools::MAX_BYTES;

pub use flue_core::mcp::*;

/// How long connecting, listing and each call may take when the connection sets no timeout:
/// the MCP SDK's default, which the reference keeps (a search or a crawl may take most of it).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The largest message read from a server (a JSON body or an SSE event): the runtime keeps
/// 50 KB of a result, and a message of JSON numbers parses to many times its size.
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// One connected server: its client and the tools it offers.
#[derive(Clone)]
pub(crate) struct McpSession {
    _client: Arc<RunningService<RoleClient, ()>>,
    pub(crate) tools: Vec<Tool>,
}

/// A kept session, asked for its tools again ([`McpSession::relisted`]).
enum Relisted {
    /// The session with the tools the server lists now.
    Session(McpSession),
    /// The client can no longer reach the server: it is connected afresh.
    Unreachable,
    /// The server answered with tools that cannot be mounted: it is unavailable for this
    /// response, and its connection is kept (the next response lists again).
    Refused(Unavailable),
    /// The session did not answer in time: unavailable for this response, and not kept (the
    /// hang may be this session's: the next response connects afresh).
    TimedOut(Unavailable),
}

impl McpSession {
    /// This session again for a new response, with the tools the server lists now (reference
    /// §3.7: a submission's init connects, and sees the server's changes since the last).
    async fn relisted(&self, connection: &McpConnection) -> Relisted {
        if self._client.is_closed() || self._client.is_transport_closed() {
            return Relisted::Unreachable;
        }
        let listed = match list_for(connection, &self._client).await {
            Ok(listed) => listed,
            // The transport failed: a new session may reach the server.
            Err(Listing::Unreachable(_)) => return Relisted::Unreachable,
            // The server answered what cannot be mounted (an error, more than is kept): a new
            // session would be asked the same, after its own handshake's wait. Unavailable for
            // this response; the next one lists again.
            Err(Listing::Refused(refused)) => return Relisted::Refused(refused),
            Err(Listing::TimedOut(late)) => return Relisted::TimedOut(late),
        };
        match mount(connection, Arc::clone(&self._client), listed) {
            Ok(session) => Relisted::Session(session),
            Err(refused) => Relisted::Refused(refused),
        }
    }
}

/// An instance's live connections, for its later responses (see the module documentation),
/// each with when a response last used it.
#[derive(Default)]
pub(crate) struct McpConnections(std::sync::Mutex<Vec<(McpConnection, McpSession, Instant)>>);

impl McpConnections {
    /// Notes the kept sessions as used now (a response that used them ended: their idle time
    /// counts from its end, not its start).
    pub(crate) fn touch(&self) {
        let now = Instant::now();
        let mut kept = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        for (.., used) in kept.iter_mut() {
            *used = now;
        }
    }

    /// The kept sessions no response used for `idle`, taken away: dropping what this returns
    /// closes them (outside whatever lock the caller holds).
    pub(crate) fn expired(&self, idle: Duration) -> Vec<McpSession> {
        let mut kept = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut expired = Vec::new();
        kept.retain(|(_, session, used)| {
            let keep = used.elapsed() <= idle;
            if !keep {
                expired.push(session.clone());
            }
            keep
        });
        expired
    }

    /// Every kept session, taken away (an instance's cache lets go of them, as when its slot
    /// drops): dropping what this returns closes them.
    pub(crate) fn take(&self) -> Self {
        Self(std::sync::Mutex::new(std::mem::take(
            &mut *self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner()),
        )))
    }

    /// A session for each of `connections`, in their order: the kept one of an equal
    /// definition that is still live, else a new connection (all checked or connected
    /// together). New sessions are kept, each in place of the one of its name; kept sessions
    /// of servers `connections` does not name are closed.
    pub(crate) async fn resolve(
        &self,
        connections: &[McpConnection],
        idle: Duration,
    ) -> Vec<Result<McpSession, Unavailable>> {
        let (kept, expired): (Vec<Option<McpSession>>, Vec<McpSession>) = {
            let expired = self.expired(idle);
            let mut kept = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            kept.retain(|(definition, ..)| connections.iter().any(|connection| connection.name == definition.name));
            let found = connections
                .iter()
                .map(|connection| {
                    kept.iter()
                        .find(|(definition, ..)| definition == connection)
                        .map(|(_, session, _)| session.clone())
                })
                .collect();
            (found, expired)
        };
        drop(expired);
        // Each server's result for this response, and the session to keep for the next.
        let resolved =
            futures_util::future::join_all(connections.iter().zip(kept).map(|(connection, kept)| async move {
                let relisted = match kept {
                    Some(session) => match session.relisted(connection).await {
                        Relisted::Refused(refused) => return (Err(refused), Some(session)),
                        Relisted::TimedOut(late) => return (Err(late), None),
                        relisted => relisted,
                    },
                    None => Relisted::Unreachable,
                };
                let resolved = match relisted {
                    Relisted::Session(session) => Ok(session),
                    _ => connect(connection).await,
                };
                let keep = resolved.as_ref().ok().cloned();
                (resolved, keep)
            }))
            .await;
        let mut kept = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        for (connection, (_, keep)) in connections.iter().zip(&resolved) {
            // A server that could not be reached is not kept: the next response connects again.
            kept.retain(|(definition, ..)| definition.name != connection.name);
            if let Some(session) = keep {
                kept.push((connection.clone(), session.clone(), Instant::now()));
            }
        }
        resolved.into_iter().map(|(resolved, _)| resolved).collect()
    }

    /// Closes every kept session (a response that declares no server).
    pub(crate) fn clear(&self) {
        let mut kept = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !kept.is_empty() {
            kept.clear();
        }
    }
}

/// Why a server could not be used.
#[derive(Debug)]
pub(crate) struct Unavailable {
    pub(crate) name: String,
    pub(crate) reason: String,
    pub(crate) optional: bool,
}

/// The process-wide rustls provider (ring, as reqwest's): rmcp's client takes the default.
fn install_tls_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// `text` as a tool-name segment: `[A-Za-z0-9_-]`, others replaced by `_`.
fn segment(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The mounted name of `tool` of `server` (at most 64 characters).
pub(crate) fn tool_name(server: &str, tool: &str) -> String {
    let mut name = format!("mcp__{}__{}", segment(server), segment(tool));
    name.truncate(64);
    name
}

/// Connects to `connection` and lists its tools. Unavailable when two of the tools it mounts
/// would have the same name (see the module documentation).
pub(crate) async fn connect(connection: &McpConnection) -> Result<McpSession, Unavailable> {
    let unavailable = unavailable_for(connection);
    if connection.transport == McpTransport::Sse {
        return Err(unavailable(
            "the legacy SSE transport is not supported; serve the MCP endpoint over streamable HTTP".into(),
        ));
    }
    install_tls_provider();
    let mut config = StreamableHttpClientTransportConfig::with_uri(connection.url.clone());
    config.max_json_response_size = MAX_MESSAGE_BYTES;
    config.max_sse_event_size = MAX_MESSAGE_BYTES;
    // A stream the client re-opens on its own (the session's, at idle) backs off, and gives up
    // after a few failures in a row.
    let mut retry = rmcp::transport::common::client_side_sse::ExponentialBackoff::default();
    retry.max_times = Some(8);
    retry.max_delay = Some(Duration::from_secs(30));
    config.retry_config = Arc::new(retry);
    config.auth_header = connection.auth.as_ref().map(|token| token.expose().to_owned());
    for (name, value) in &connection.headers {
        let name = axum::http::HeaderName::try_from(name.as_str())
            .map_err(|error| unavailable(format!("header {name:?}: {error}")))?;
        let value = axum::http::HeaderValue::try_from(value.as_str())
            .map_err(|error| unavailable(format!("header {name}: {error}")))?;
        config.custom_headers.insert(name, value);
    }
    let timeout = connection.timeout.unwrap_or(DEFAULT_TIMEOUT);
    let transport = StreamableHttpClientTransport::with_client(Answered::new(), config);
    let client = tokio::time::timeout(timeout, ().serve(transport))
        .await
        .map_err(|_| unavailable(format!("no answer within {} s", timeout.as_secs())))?
        .map_err(|error| unavailable(readable(&error.to_string())))?;
    // No response cache: each response lists afresh on purpose (a server's changes, or its
    // going away, are seen at once), where rmcp's cache would answer a list that said it
    // keeps (`ttlMs`) from memory, and a failed one with a stale copy; and its entries (one
    // per page, up to the message limit each) would live as long as the kept connection.
    client
        .set_response_cache_config(rmcp::service::ClientCacheConfig::disabled())
        .await;
    let listed = list_for(connection, &client).await.map_err(Listing::into_unavailable)?;
    mount(connection, Arc::new(client), listed)
}

/// rmcp's reqwest client, with an error reply that answers no request (its `id` absent or
/// null) made the POST's failure. rmcp drops such a reply, and the request it answered waited
/// out its timeout (a minute by default), where servers send one at once: the TypeScript SDK's
/// example answers a session it does not know (after a restart) with a 400 and `"id": null`,
/// and catch-all handlers answer a 500 so. The listing then fails at once (and connects afresh),
/// and a call ends with the server's message.
#[derive(Clone)]
struct Answered(reqwest_mcp::Client);

type PostResult = Result<StreamableHttpPostResponse, StreamableHttpError<reqwest_mcp::Error>>;

impl Answered {
    /// As rmcp's own client: no idle connections kept (a response body not read to its end
    /// stalls the next request on a kept one), and redirects followed only within the origin,
    /// and only as 307 or 308 (which keep the method and body; a cross-origin one would send
    /// the session id and headers elsewhere).
    fn new() -> Self {
        let policy = reqwest_mcp::redirect::Policy::custom(|attempt| {
            let same_origin = attempt
                .previous()
                .first()
                .is_some_and(|first| first.origin() == attempt.url().origin());
            if attempt.previous().len() > 10 || !same_origin || !matches!(attempt.status().as_u16(), 307 | 308) {
                attempt.stop()
            } else {
                attempt.follow()
            }
        });
        let client = reqwest_mcp::Client::builder()
            .pool_max_idle_per_host(0)
            .redirect(policy)
            .build()
            .unwrap_or_default();
        Self(client)
    }

    /// `posted`, the answer to `message`: an error for no request fails it when `message` is
    /// a request (a notification's answer is no request's; rmcp sends the first one,
    /// `notifications/initialized`, and fails the connection when its POST fails).
    fn answered(message_is_request: bool, posted: PostResult) -> PostResult {
        match posted {
            posted if !message_is_request => posted,
            Ok(StreamableHttpPostResponse::Json(
                rmcp::model::ServerJsonRpcMessage::Error(rmcp::model::JsonRpcError { id: None, error, .. }),
                _,
            )) => Err(StreamableHttpError::UnexpectedServerResponse(
                format!("an error that answers no request: {}", error.message).into(),
            )),
            posted => posted,
        }
    }
}

impl StreamableHttpClient for Answered {
    type Error = reqwest_mcp::Error;

    fn post_message(
        &self,
        uri: Arc<str>,
        message: rmcp::model::ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<axum::http::HeaderName, axum::http::HeaderValue>,
    ) -> impl Future<Output = PostResult> + Send + '_ {
        let request = matches!(message, rmcp::model::JsonRpcMessage::Request(_));
        let posted = self
            .0
            .post_message(uri, message, session_id, auth_header, custom_headers);
        async move { Self::answered(request, posted.await) }
    }

    fn post_message_with_response_limits(
        &self,
        uri: Arc<str>,
        message: rmcp::model::ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<axum::http::HeaderName, axum::http::HeaderValue>,
        limits: StreamableHttpResponseLimits,
    ) -> impl Future<Output = PostResult> + Send + '_ {
        let request = matches!(message, rmcp::model::JsonRpcMessage::Request(_));
        let posted =
            self.0
                .post_message_with_response_limits(uri, message, session_id, auth_header, custom_headers, limits);
        async move { Self::answered(request, posted.await) }
    }

    fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        custom_headers: HashMap<axum::http::HeaderName, axum::http::HeaderValue>,
    ) -> impl Future<Output = Result<(), StreamableHttpError<reqwest_mcp::Error>>> + Send + '_ {
        self.0.delete_session(uri, session_id, auth_header, custom_headers)
    }

    fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<axum::http::HeaderName, axum::http::HeaderValue>,
    ) -> impl Future<Output = SseStreamResult> + Send + '_ {
        self.0
            .get_stream(uri, session_id, last_event_id, auth_header, custom_headers)
    }

    fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<axum::http::HeaderName, axum::http::HeaderValue>,
        max_sse_event_size: usize,
    ) -> impl Future<Output = SseStreamResult> + Send + '_ {
        self.0.get_stream_with_max_sse_event_size(
            uri,
            session_id,
            last_event_id,
            auth_header,
            custom_headers,
            max_sse_event_size,
        )
    }
}

type SseStreamResult = Result<
    futures_util::stream::BoxStream<
        'static,
        Result<sse_stream::Sse, rmcp::transport::streamable_http_client::SseError>,
    >,
    StreamableHttpError<reqwest_mcp::Error>,
>;

/// What `connection`'s server is unavailable for, said without its credentials, its URL's
/// secrets or its path.
fn unavailable_for(connection: &McpConnection) -> impl Fn(String) -> Unavailable + '_ {
    let credentials = credentials(connection);
    move |reason: String| Unavailable {
        name: connection.name.clone(),
        // Bounded before it is cleaned: a server's error may be megabytes.
        reason: without_server_path(
            &without_url_secrets(&without_credentials(&bounded(reason), &credentials)),
            &connection.url,
        ),
        optional: connection.optional,
    }
}

/// Why a server's tools could not be listed.
enum Listing {
    /// Its transport failed (closed, a request that could not be sent).
    Unreachable(Unavailable),
    /// It answered with an error or with what is not kept (too many tools, a repeated
    /// cursor).
    Refused(Unavailable),
    /// It did not answer within the timeout.
    TimedOut(Unavailable),
}

impl Listing {
    fn into_unavailable(self) -> Unavailable {
        match self {
            Self::Unreachable(unavailable) | Self::Refused(unavailable) | Self::TimedOut(unavailable) => unavailable,
        }
    }
}

/// Every tool `client`'s server lists now, within the connection's timeout.
async fn list_for(
    connection: &McpConnection,
    client: &RunningService<RoleClient, ()>,
) -> Result<Vec<rmcp::model::Tool>, Listing> {
    let unavailable = unavailable_for(connection);
    let timeout = connection.timeout.unwrap_or(DEFAULT_TIMEOUT);
    match tokio::time::timeout(timeout, list_tools(client)).await {
        Err(_) => Err(Listing::TimedOut(unavailable(format!(
            "listing its tools took longer than {} s",
            timeout.as_secs()
        )))),
        Ok(Ok(tools)) => Ok(tools),
        Ok(Err((reason, true))) => Err(Listing::Unreachable(unavailable(reason))),
        Ok(Err((reason, false))) => Err(Listing::Refused(unavailable(reason))),
    }
}

/// The session of `client` with the `listed` tools mounted as the connection says (see the
/// module documentation).
fn mount(
    connection: &McpConnection,
    client: Arc<RunningService<RoleClient, ()>>,
    listed: Vec<rmcp::model::Tool>,
) -> Result<McpSession, Unavailable> {
    let credentials = credentials(connection);
    let unavailable = unavailable_for(connection);
    let listed = match &connection.tools {
        Some(wanted) => select_tools(wanted, listed).map_err(&unavailable)?,
        None => listed,
    };
    let mut tools = Vec::new();
    // The bytes the mounted tools take in each model request.
    let mut declared_bytes = 0;
    // Mounted name → the server's name of the tool mounted under it.
    let mut mounted = std::collections::HashMap::new();
    for listed in listed {
        // A tool the connection names is needed: a schema it cannot be called with refuses the
        // server. One it does not name (no list: every tool) is left out with a warning, and
        // the server's others mounted.
        let leave_out = |error: String| -> Result<(), Unavailable> {
            let error = format!(
                "tool {:?}: {}",
                short(&listed.name),
                error.trim_start_matches("[flue] ")
            );
            if connection.tools.is_some() {
                return Err(unavailable(error));
            }
            // Bounded: a schema's validation error quotes the schema, and a listing is read
            // again at every response.
            tracing::warn!(
                server = %connection.name,
                "[flue] MCP server \"{}\": leaving out {}",
                connection.name,
                shown_reason(&error)
            );
            Ok(())
        };
        // Its name is sent with each call, and described when it says nothing of itself: MCP
        // names are at most 128 characters.
        let name_length = listed.name.chars().count();
        if name_length > MAX_TOOL_NAME_CHARS {
            leave_out(format!(
                "its name is {name_length} characters, more than the {MAX_TOOL_NAME_CHARS} an MCP tool's may be"
            ))?;
            continue;
        }
        // Declared in every model request of the response, and compiled before that: a bound
        // first, on the schema as listed (before its choices are read) and as it will be
        // declared.
        let listed_bytes = crate::json_shape::json_bytes(&*listed.input_schema);
        if listed_bytes > MAX_SCHEMA_BYTES {
            leave_out(format!(
                "its input schema is {listed_bytes} bytes, more than the {MAX_SCHEMA_BYTES} a tool's may be"
            ))?;
            continue;
        }
        let declared = match input_schema(&listed.input_schema) {
            Ok(declared) => declared,
            Err(error) => {
                leave_out(format!("its input schema cannot be declared: {error}"))?;
                continue;
            }
        };
        let schema_bytes = crate::json_shape::json_bytes(&declared);
        if schema_bytes > MAX_SCHEMA_BYTES {
            leave_out(format!(
                "its input schema is {schema_bytes} bytes, more than the {MAX_SCHEMA_BYTES} a tool's may be"
            ))?;
            continue;
        }
        let schema = match DataSchema::new(declared) {
            Ok(schema) => schema,
            Err(error) => {
                leave_out(format!("its input schema is not valid: {error}"))?;
                continue;
            }
        };
        let name = tool_name(&connection.name, &listed.name);
        if let Some(first) = mounted.insert(name.clone(), listed.name.to_string()) {
            let (a, b) = if *first <= *listed.name {
                (first.as_str(), &*listed.name)
            } else {
                (&*listed.name, first.as_str())
            };
            return Err(unavailable(format!(
                "its tools {a:?} and {b:?} would both be mounted as {name:?}; list only one of them in the \
                 connection's tools"
            )));
        }
        // Sent in every model request: what the server wrote there (a gateway templating the
        // caller's key into it) is kept from the model as its results are.
        let description = without_credentials(&describe(&connection.name, &listed), &credentials);
        let declared = name.len() + description.len() + schema_bytes;
        let definition = ToolDefinition::from_parts(name, description, SchemaSource::Given(schema));
        // The rules a local tool's definition is held to: a schema whose root is not an object
        // would fail every model request of the response, not only calls to this server.
        if let Err(error) = definition.validate_input_schema("MCP tool") {
            leave_out(error)?;
            mounted.remove(definition.name.as_ref());
            continue;
        }
        declared_bytes += declared;
        tools.push(Tool::from_handler(McpTool {
            definition,
            remote_name: listed.name.to_string(),
            client: client.clone(),
            timeout: connection.timeout,
            url: connection.url.clone(),
            credentials: credentials.clone(),
        }));
    }
    // Every tool mounted is declared in every model request of the response: past what a
    // request may declare (OpenAI takes 128 tools), every call of the agent would fail, not
    // only this server's. The server is unavailable instead (an optional one degrades).
    if tools.len() > MAX_MOUNTED_TOOLS {
        return Err(unavailable(format!(
            "it would mount {} tools, more than the {MAX_MOUNTED_TOOLS} a model request may declare; name the ones to use in the connection's tools",
            tools.len()
        )));
    }
    if declared_bytes > MAX_MOUNTED_BYTES {
        return Err(unavailable(format!(
            "its tools would take {declared_bytes} bytes of every model request, more than the {MAX_MOUNTED_BYTES} one server's may; name the ones to use in the connection's tools"
        )));
    }
    Ok(McpSession { _client: client, tools })
}

/// The most tools one server mounts: what a model request may declare (OpenAI's bound).
const MAX_MOUNTED_TOOLS: usize = 128;

/// The most bytes one server's mounted tools take in each model request (their names,
/// descriptions and input schemas).
const MAX_MOUNTED_BYTES: usize = 1024 * 1024;

/// The largest input schema (serialized) a listed tool may have: far beyond a real tool's
/// arguments. A larger one is treated as a schema the tool cannot be called with.
const MAX_SCHEMA_BYTES: usize = 64 * 1024;

/// The longest tool name a server may list (the MCP specification's bound).
const MAX_TOOL_NAME_CHARS: usize = 128;

/// What the model is told of a listed tool: its description (cut to
/// [`MAX_DESCRIPTION_BYTES`]), then which server's tool it is under its own name, and its
/// title: a description that refers to the server's other tools by their names (`call
/// search.issues first`) stays followable under the names they are mounted as. A tool that
/// says nothing of itself is described by its title, or its name and server.
fn describe(server: &str, listed: &rmcp::model::Tool) -> String {
    let said = |text: Option<&str>| text.map(str::trim).filter(|text| !text.is_empty()).map(str::to_owned);
    let title = said(listed.title.as_deref()).map(|title| cut_text(&title, MAX_TITLE_BYTES));
    match said(listed.description.as_deref()) {
        Some(description) => {
            let mut described = cut_description(server, &listed.name, &description);
            described.push_str(&format!("\n\n(MCP tool {:?} of server {server:?}", &*listed.name));
            if let Some(title) = title {
                described.push_str(&format!("; title: {title}"));
            }
            described.push_str(".)");
            described
        }
        None => match title {
            Some(title) => format!("{title} (MCP tool {:?} of server {server:?})", &*listed.name),
            None => format!("{} (MCP server {server})", listed.name),
        },
    }
}

/// The longest title a listed tool's description quotes.
const MAX_TITLE_BYTES: usize = 256;

/// `text` cut to `bytes` (on a character boundary), with an ellipsis when cut.
fn cut_text(text: &str, bytes: usize) -> String {
    if text.len() <= bytes {
        return text.to_owned();
    }
    format!("{}…", &text[..text.floor_char_boundary(bytes)])
}

/// The longest description a listed tool keeps; a longer one is cut (with a warning).
const MAX_DESCRIPTION_BYTES: usize = 8 * 1024;

/// A listed tool's description, cut to [`MAX_DESCRIPTION_BYTES`] (on a character boundary).
fn cut_description(server: &str, tool: &str, description: &str) -> String {
    if description.len() <= MAX_DESCRIPTION_BYTES {
        return description.to_owned();
    }
    tracing::warn!(
        server,
        "[flue] MCP server \"{server}\": tool {tool:?}'s description is {} bytes; it is cut to {MAX_DESCRIPTION_BYTES}",
        description.len()
    );
    format!(
        "{}…",
        &description[..description.floor_char_boundary(MAX_DESCRIPTION_BYTES)]
    )
}

/// The most tools one MCP server may list, and the most pages it may list them in: far
/// beyond a real server's, a bound on what one that lists without end makes the runtime keep
/// (every tool is parsed, kept and declared in each model request).
const MAX_LISTED_TOOLS: usize = 1000;
const MAX_LISTED_PAGES: usize = 100;

/// The most bytes a server's tools may take, their names, descriptions and input schemas
/// together, as listed (before the bounds each mounted tool is held to).
const MAX_LISTED_BYTES: usize = 16 * 1024 * 1024;

/// Why a server whose `tools/list` answer did not parse is unavailable. rmcp reads a page
/// whole, so one tool it cannot read refuses the page, and does not say which.
const NOT_A_TOOLS_PAGE: &str = "its tools/list answer is not a page of tools as MCP's schema reads one (one tool \
                                it cannot read, one without an object inputSchema say, fails the whole page)";

/// Every page of the server's tools. A server that repeats a cursor would be listed for ever
/// (each page kept): it is refused, as one listing more than [`MAX_LISTED_TOOLS`] tools or
/// [`MAX_LISTED_PAGES`] pages.
/// Every tool the server lists, page after page; on failure, why, and whether the transport
/// failed (rather than the server answering what is not kept).
async fn list_tools(client: &RunningService<RoleClient, ()>) -> Result<Vec<rmcp::model::Tool>, (String, bool)> {
    let too_many_bytes = || {
        (
            format!(
                "its tools' names, descriptions and input schemas, and its listing's cursors, take more than {} MiB",
                MAX_LISTED_BYTES >> 20
            ),
            false,
        )
    };
    let mut tools = Vec::new();
    let mut listed_bytes = 0;
    let mut cursors = std::collections::HashSet::new();
    let mut cursor = None;
    for _ in 0..MAX_LISTED_PAGES {
        let params = cursor.map(|cursor| PaginatedRequestParams::default().with_cursor(Some(cursor)));
        let page = client.list_tools(params).await.map_err(|error| match error {
            // The server answered, with what is no page of tools as MCP's schema reads one: a
            // session made afresh would be answered the same.
            rmcp::ServiceError::UnexpectedResponse => (NOT_A_TOOLS_PAGE.to_owned(), false),
            rmcp::ServiceError::McpError(_) => (error.to_string(), false),
            _ => (error.to_string(), true),
        })?;
        for mut tool in page.tools {
            // What is mounted is a tool's name, title, description and input schema: the rest goes as
            // each page comes, and what is kept has a bound (pages of up to rmcp's message
            // limit each, a hundred of them, would otherwise all be held at once).
            tool.output_schema = None;
            tool.annotations = None;
            tool.icons = None;
            tool.meta = None;
            listed_bytes += tool.name.len()
                + tool.title.as_deref().map_or(0, str::len)
                + tool.description.as_deref().map_or(0, str::len)
                + crate::json_shape::json_bytes(&*tool.input_schema);
            if listed_bytes > MAX_LISTED_BYTES {
                return Err(too_many_bytes());
            }
            tools.push(tool);
        }
        if tools.len() > MAX_LISTED_TOOLS {
            return Err((format!("it lists more than {MAX_LISTED_TOOLS} tools"), false));
        }
        // The cursors are kept (to refuse a repeated one) and sent back: they count too.
        listed_bytes += page.next_cursor.as_deref().map_or(0, str::len);
        if listed_bytes > MAX_LISTED_BYTES {
            return Err(too_many_bytes());
        }
        match page.next_cursor {
            None => return Ok(tools),
            Some(next) if !cursors.insert(next.clone()) => {
                return Err((
                    format!(
                        "it repeated the tools/list cursor {:?} while its tools were listed",
                        short(&next)
                    ),
                    false,
                ));
            }
            Some(next) => cursor = Some(next),
        }
    }
    Err((
        format!("it lists its tools in more than {MAX_LISTED_PAGES} pages"),
        false,
    ))
}

/// The tools a connection's `tools` list names, in its order. A name the server does not
/// list, or one the list repeats, is an error naming them (and the tools the server lists).
fn select_tools(wanted: &[String], listed: Vec<rmcp::model::Tool>) -> Result<Vec<rmcp::model::Tool>, String> {
    let quoted = |names: &[&str]| -> String {
        names
            .iter()
            .map(|name| format!("{:?}", short(name)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    // Each repeated name once, in the order of its second mention.
    let mut repeated: Vec<&str> = Vec::new();
    for (index, name) in wanted.iter().enumerate() {
        if wanted[..index].contains(name) && !repeated.contains(&name.as_str()) {
            repeated.push(name);
        }
    }
    if !repeated.is_empty() {
        return Err(format!(
            "the connection's tools list names {} more than once",
            quoted(&repeated)
        ));
    }
    let unknown: Vec<&str> = wanted
        .iter()
        .map(String::as_str)
        .filter(|name| !listed.iter().any(|tool| *tool.name == **name))
        .collect();
    if !unknown.is_empty() {
        const SHOWN: usize = 20;
        let mut names: Vec<String> = listed.iter().take(SHOWN).map(|tool| short(&tool.name)).collect();
        if listed.len() > SHOWN {
            names.push(format!("and {} more", listed.len() - SHOWN));
        }
        return Err(format!(
            "it has no tool named {} (named in the connection's tools list); it lists: {}",
            quoted(&unknown),
            if names.is_empty() {
                "no tools".to_owned()
            } else {
                names.join(", ")
            }
        ));
    }
    let mut listed: Vec<Option<rmcp::model::Tool>> = listed.into_iter().map(Some).collect();
    Ok(wanted
        .iter()
        .filter_map(|name| {
            listed
                .iter_mut()
                .find(|tool| tool.as_ref().is_some_and(|tool| *tool.name == **name))
                .and_then(Option::take)
        })
        .collect())
}

/// A name or cursor the server chose, as an error quotes it: its first 100 characters.
fn short(text: &str) -> String {
    const MAX: usize = 100;
    match text.char_indices().nth(MAX) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_owned(),
    }
}

/// A tool's input schema as the reference reads it (without `type`, an object's; an object's
/// without `properties`, with none), and as providers take it
/// ([`flue_core::data::declarable_tool_schema`]: no combinator at its root; what the
/// combinators said the server checks when called; [`items_for_arrays`]).
fn input_schema(listed: &serde_json::Map<String, Value>) -> Result<Value, flue_core::data::TooIntricate> {
    let mut schema = listed.clone();
    flue_core::data::declarable_tool_schema(&mut schema)?;
    let mut schema = Value::Object(schema);
    items_for_arrays(&mut schema);
    Ok(schema)
}

/// Gives every array in `schema` that says nothing of its items `"items": {}` (any value),
/// which means what it meant. OpenAI refuses a tool that declares an array without `items`
/// (`array schema missing items`) in every model request of the response, not only the
/// tool's calls, and servers list such schemas (JSON Schema allows them). The keywords whose
/// values are data, not schemas, are left as they are. Bounded: a schema is at most
/// [`MAX_SCHEMA_BYTES`] as listed, and nested no deeper than its parse allowed.
fn items_for_arrays(schema: &mut Value) {
    match schema {
        Value::Object(map) => {
            let array = match map.get("type") {
                Some(Value::String(kind)) => kind == "array",
                Some(Value::Array(kinds)) => kinds.iter().any(|kind| kind == "array"),
                _ => false,
            };
            if array && !map.contains_key("items") && !map.contains_key("prefixItems") {
                map.insert("items".to_owned(), Value::Object(serde_json::Map::new()));
            }
            for (keyword, value) in map.iter_mut() {
                match keyword.as_str() {
                    // Data, not schemas.
                    "enum" | "const" | "default" | "examples" => {}
                    // Schemas by name: a name is no keyword (a property may be `examples`).
                    "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                        if let Value::Object(schemas) = value {
                            schemas.values_mut().for_each(items_for_arrays);
                        }
                    }
                    _ => items_for_arrays(value),
                }
            }
        }
        Value::Array(values) => values.iter_mut().for_each(items_for_arrays),
        _ => {}
    }
}

struct McpTool {
    definition: ToolDefinition,
    remote_name: String,
    client: Arc<RunningService<RoleClient, ()>>,
    timeout: Option<Duration>,
    /// The server's URL, whose path its errors' texts leave out (see [`without_server_path`]).
    url: String,
    /// What its errors' texts leave out besides (see [`credentials`]).
    credentials: Arc<[String]>,
}

impl ToolHandler for McpTool {
    fn definition(&self) -> &ToolDefinition {
        &self.definition
    }

    fn call(&self, _ctx: ToolContext, args: Value) -> BoxFuture<'_, ToolOutput> {
        Box::pin(async move {
            let mut params = CallToolRequestParams::new(self.remote_name.clone());
            params.arguments = match args {
                Value::Object(arguments) => Some(arguments),
                Value::Null => None,
                other => return ToolOutput::error(format!("MCP tool arguments must be an object, not {other}")),
            };
            // A server that never answers must not hold the response until its deadline.
            let limit = self.timeout.unwrap_or(DEFAULT_TIMEOUT);
            let result = match tokio::time::timeout(limit, self.client.call_tool(params)).await {
                Ok(result) => result,
                Err(_) => {
                    return ToolOutput::error(format!("The MCP server did not answer within {} s.", limit.as_secs()));
                }
            };
            let result = match result {
                Ok(result) => result,
                Err(rmcp::ServiceError::UnexpectedResponse) => {
                    return ToolOutput::error(
                        "The MCP server's answer is not a tool result as MCP's schema reads one (one part it \
                         cannot read, a content block of a type it does not know say, fails the whole result).",
                    );
                }
                Err(error) => {
                    // Cut as a result is: the server chooses the error's text and its length.
                    return ToolOutput::error(capped(format!(
                        "The MCP server failed the call: {}",
                        without_server_path(
                            &without_url_secrets(&without_credentials(&bounded(error.to_string()), &self.credentials)),
                            &self.url
                        )
                    )));
                }
            };
            let mut parts: Vec<String> = result.content.iter().map(content_text).collect();
            // Servers send structured content's JSON as a text block too (the MCP spec asks
            // them to): added only when no block is text.
            if !result
                .content
                .iter()
                .any(|block| matches!(block, ContentBlock::Text(_)))
                && let Some(structured) = &result.structured_content
            {
                parts.push(structured.to_string());
            }
            let text = parts.join("\n");
            if result.is_error == Some(true) {
                ToolOutput::error(if text.is_empty() {
                    "The MCP tool reported an error.".to_owned()
                } else {
                    redacted_capped(text, &self.credentials)
                })
            } else {
                // A server (or a gateway before it) may echo the request's headers in a
                // result as well as in an error.
                ToolOutput::text(redacted_capped(text, &self.credentials))
            }
        })
    }
}

/// A header value's words at least this long are credentials of their own (the token of
/// `Bearer <token>`; not the scheme's name).
const MIN_CREDENTIAL_WORD_BYTES: usize = 8;

/// The credentials of `connection` that a server may echo in an error (a 401 that quotes the
/// token it refused) or a result: its token, the values of its headers that carry one (see
/// [`carries_credential`]), and the long words of those values; and those its URL carries (a
/// password, a query value that carries one, an opaque token in its path, as hosted servers
/// take `…/mcp?api_key=…` or `…/<key>/mcp`). The texts reach the model, the records, the
/// settlement and the log, so none of them may show these.
fn credentials(connection: &McpConnection) -> Arc<[String]> {
    let mut credentials: Vec<String> = connection.auth.iter().map(|token| token.expose().to_owned()).collect();
    if let Ok(url) = reqwest::Url::parse(&connection.url) {
        // A URL part as written and percent-decoded (a server may quote either).
        let both = |text: &str| {
            let decoded = form_urlencoded::parse(format!("v={text}").as_bytes())
                .next()
                .map(|(_, value)| value.into_owned())
                .unwrap_or_default();
            [text.to_owned(), decoded]
        };
        let opaque = |word: &str| carries_credential("", word);
        if let Some(password) = url.password() {
            credentials.extend(both(password));
        }
        // A user name is data (`admin` shows in results), unless it is a token itself
        // (`https://<token>@host`).
        if opaque(url.username()) {
            credentials.extend(both(url.username()));
        }
        // A query value named like a credential counts when it is long enough to be one
        // (`?access=read` is data: `read` is not redacted from every result).
        credentials.extend(
            url.query_pairs()
                .filter(|(name, value)| {
                    carries_credential(name, value) && (value.len() >= MIN_CREDENTIAL_WORD_BYTES || opaque(value))
                })
                .map(|(_, value)| value.into_owned()),
        );
        credentials.extend(
            url.path_segments()
                .into_iter()
                .flatten()
                .filter(|segment| opaque(segment))
                .flat_map(both),
        );
        credentials.retain(|credential| !credential.is_empty());
    }
    // A header named like a credential counts when its value is long enough to be one, as a
    // query value does (`X-Bypass-Cache: true`, `X-Access-Mode: read` are data: `true` is not
    // cut out of every result), except the headers that only ever carry credentials.
    let always = |name: &str| {
        ["authorization", "proxy-authorization", "cookie"]
            .iter()
            .any(|credential| name.eq_ignore_ascii_case(credential))
    };
    for (name, value) in connection.headers.iter().filter(|(name, value)| {
        carries_credential(name, value)
            && (always(name) || value.len() >= MIN_CREDENTIAL_WORD_BYTES || carries_credential("", value))
    }) {
        credentials.push(value.clone());
        if name.eq_ignore_ascii_case("cookie") {
            // `a=<value>; theme=dark`: each cookie's value, as a server may quote it bare (a
            // short one, `theme`'s `dark`, is data).
            credentials.extend(
                value
                    .split(';')
                    .filter_map(|pair| pair.split_once('=').map(|(_, value)| value.trim()))
                    .filter(|value| value.len() >= MIN_CREDENTIAL_WORD_BYTES || carries_credential("", value))
                    .map(str::to_owned),
            );
            continue;
        }
        credentials.extend(
            value
                .split_whitespace()
                .filter(|word| word.len() >= MIN_CREDENTIAL_WORD_BYTES && *word != value)
                .map(str::to_owned),
        );
    }
    // Longest first: a header's whole value before its words.
    credentials.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
    credentials.dedup();
    credentials.into()
}

/// Whether a static header carries a credential: its name says so (`Authorization`, `Cookie`,
/// `X-Api-Key`, `X-Auth-Token`, `X-Access-…`, a secret, a session, a password or pass phrase, a
/// signature, a private value), or its value
/// holds an opaque token (a word of 16 bytes or more mixing letters and digits), whatever the
/// header is called. Other values (`Notion-Version: 2022-06-28`, `X-Env: prod`) are not taken
/// out of what a server sends back: redacting them would change the data the model reads (a
/// date in every result, "products" read as "[redacted]ucts").
pub(crate) fn carries_credential(name: &str, value: &str) -> bool {
    const NAMED: [&str; 13] = [
        "auth",
        "cookie",
        "key",
        "token",
        "secret",
        "session",
        "pass",
        "pwd",
        "signature",
        "credential",
        "bearer",
        "access",
        "private",
    ];
    let name = name.to_ascii_lowercase();
    let opaque = |word: &str| {
        word.len() >= 16 && word.bytes().any(|b| b.is_ascii_digit()) && word.bytes().any(|b| b.is_ascii_alphabetic())
    };
    NAMED.iter().any(|named| name.contains(named)) || value.split_whitespace().any(opaque)
}

/// An error's text bounded before it is cleaned (its credentials, its URLs' secrets, the
/// server's path taken out: each a pass over all of it) and cut to what shows: a server's error
/// may be megabytes. Four times what shows is kept, so what a cut leaves half (a URL, a
/// credential) lies beyond what shows after the cleaning, which only shortens a text by a few
/// bytes per credential at most.
fn bounded(mut text: String) -> String {
    let end = text.floor_char_boundary(4 * MAX_BYTES);
    text.truncate(end);
    text
}

/// `text` without any of `credentials`, as they are or escaped (see [`redact_secret`]).
fn without_credentials(text: &str, credentials: &[String]) -> String {
    credentials
        .iter()
        .fold(text.to_owned(), |text, credential| redact_secret(&text, credential))
}

/// `text` without `credentials` ([`without_credentials`]), then cut as [`capped`] cuts it.
/// Redacted before it is cut (a credential straddling the cut would survive in part), but
/// only as much of it as shows ([`redact_prefix`]): redaction decodes escapes into buffers
/// many times the text's size, and a server's 16 MB result is not decoded whole to show 50 KB.
fn redacted_capped(text: String, credentials: &[String]) -> String {
    let total = text.len();
    let longest = credentials.iter().map(String::len).max().unwrap_or(0);
    let (redacted, whole) = redact_prefix(&text, MAX_BYTES, longest, |text| without_credentials(text, credentials));
    if whole && redacted.len() <= MAX_BYTES {
        return redacted;
    }
    let end = redacted.floor_char_boundary(MAX_BYTES.min(redacted.len()));
    format!(
        "{}\n[Output truncated: the first {end} of {total} bytes.]",
        &redacted[..end]
    )
}

/// `text` cut to its first [`MAX_BYTES`] bytes, the sandbox tools' output cap, so that one
/// result cannot fill the model's context window (and every record after it). The cut falls
/// on a character boundary and a last line says what was left out.
fn capped(mut text: String) -> String {
    let total = text.len();
    if total <= MAX_BYTES {
        return text;
    }
    let mut end = MAX_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text.push_str(&format!("\n[Output truncated: the first {end} of {total} bytes.]"));
    text
}

/// `text` without the path of the server's URL `url`: some hosted MCP servers take their key
/// as a path segment (`https://host/s/<key>/mcp`), and a connection error quotes the URL whole
/// (what it says reaches the model, the records and the settlement). The origin stays named.
fn without_server_path(text: &str, url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(parsed) if parsed.path().len() > 1 => {
            // The URL as quoted (its origin, then its path): the path alone may be part of the
            // host's name (`https://mcp.host/mcp`) or of other text.
            let origin = parsed.origin().ascii_serialization();
            let text = text.replace(&format!("{origin}{}", parsed.path()), &format!("{origin}/…"));
            // A server may quote the path alone (`Cannot POST /s/<key>/mcp`): a path of several
            // segments is too particular to be other text.
            if parsed.path().trim_matches('/').contains('/') {
                text.replace(parsed.path(), "/…")
            } else {
                text
            }
        }
        _ => text.to_owned(),
    }
}

/// An rmcp error as a person reads it: without the transport's Rust type names (a bracketed
/// run that holds a path, `[rmcp::…<…>]`). Other brackets are the server's own words (a JSON
/// body quoted, `{"detail":[…]}`), kept.
fn readable(error: &str) -> String {
    let mut out = String::with_capacity(error.len());
    let mut rest = error;
    while let Some(open) = rest.find('[') {
        out.push_str(&rest[..open]);
        let from = &rest[open..];
        // The run's end, nesting counted (a type name is short: looked for so far only).
        let mut depth = 0usize;
        let close = from.char_indices().take(512).find_map(|(at, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                _ => {}
            }
            (depth == 0).then_some(at)
        });
        match close {
            Some(close) if from[..close].contains("::") => rest = &from[close + 1..],
            _ => {
                out.push('[');
                rest = &from[1..];
            }
        }
    }
    out.push_str(rest);
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A result's content block as the model reads it: text as it is, an embedded resource's text
/// under a line naming its URI, a resource link as its name, URI and description, and what the
/// model cannot read here (images, audio, binary resources) named with its type and size.
fn content_text(block: &ContentBlock) -> String {
    match block {
        ContentBlock::Text(text) => text.text.clone(),
        ContentBlock::Image(image) => format!(
            "[image content: {}, {} bytes of base64]",
            short(&image.mime_type),
            image.data.len()
        ),
        ContentBlock::Audio(audio) => format!(
            "[audio content: {}, {} bytes of base64]",
            short(&audio.mime_type),
            audio.data.len()
        ),
        ContentBlock::Resource(embedded) => match &embedded.resource {
            ResourceContents::TextResourceContents { uri, text, .. } => format!("[resource {}]\n{text}", short(uri)),
            ResourceContents::BlobResourceContents {
                uri, mime_type, blob, ..
            } => format!(
                "[resource {}: {}, {} bytes of base64]",
                short(uri),
                mime_type.as_deref().map_or_else(|| "binary".to_owned(), short),
                blob.len()
            ),
            _ => "[resource content]".to_owned(),
        },
        ContentBlock::ResourceLink(link) => {
            let description = link
                .description
                .as_deref()
                .filter(|description| !description.trim().is_empty())
                .map(|description| format!(": {description}"))
                .unwrap_or_default();
            format!("[resource link {} ({}){description}]", link.name, short(&link.uri))
        }
        _ => "[other content]".to_owned(),
    }
}

/// Why a server could not be used, as the model and observers are told: on one line, its
/// first 300 characters (the text may quote what the server sent, an HTML error page).
pub(crate) fn shown_reason(text: &str) -> String {
    let mut text = text.replace('\n', " ");
    if text.chars().count() > 300 {
        text = text.chars().take(300).collect::<String>() + "…";
    }
    text
}

/// The `resources` signal body for servers unavailable to this response.
pub(crate) fn unavailable_body(unavailable: &[Unavailable]) -> String {
    let reason = shown_reason;
    match unavailable {
        [one] => format!(
            "The MCP server \"{}\" is unavailable for this response ({}); its tools are not mounted.",
            one.name,
            reason(&one.reason)
        ),
        many => {
            let mut lines =
                vec!["These MCP servers are unavailable for this response; their tools are not mounted:".to_owned()];
            lines.extend(
                many.iter()
                    .map(|entry| format!("- \"{}\": {}", entry.name, reason(&entry.reason))),
            );
            lines.join("\n")
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use super::*;

    /// An error reply for no request fails the POST of a request (its request would wait out
    /// its timeout), and is left as it is for a notification's (rmcp fails the connection
    /// when the POST of `notifications/initialized` fails).
    #[test]
    fn an_error_for_no_request_fails_only_a_requests_post() {
        let reply = || {
            let error = rmcp::model::ErrorData::new(rmcp::model::ErrorCode(-32601), "Method not found", None);
            Ok(StreamableHttpPostResponse::Json(
                rmcp::model::ServerJsonRpcMessage::Error(rmcp::model::JsonRpcError::new(None, error)),
                None,
            ))
        };
        assert!(matches!(
            Answered::answered(true, reply()),
            Err(StreamableHttpError::UnexpectedServerResponse(message)) if message.contains("Method not found")
        ));
        assert!(matches!(
            Answered::answered(false, reply()),
            Ok(StreamableHttpPostResponse::Json(..))
        ));
    }

    /// OpenAI refuses a tool declaring an array without `items` in every request: an array a
    /// server's schema leaves open, anywhere in it, is declared as an array of any value, and
    /// what is data (an `enum`'s, a `default`) or already says its items is left as it is.
    #[test]
    fn an_array_whose_items_a_schema_leaves_open_is_declared_with_items_of_any_value() {
        let listed = serde_json::json!({
            "type": "object",
            "properties": {
                "tags": {"type": "array", "description": "Tags."},
                "either": {"type": ["array", "null"]},
                "ids": {"type": "array", "items": {"type": "integer"}},
                "pair": {"type": "array", "prefixItems": [{"type": "string"}]},
                "nested": {"type": "object", "properties": {"deep": {"anyOf": [{"type": "array"}, {"type": "string"}]}}},
                "shape": {"enum": [{"type": "array"}], "default": {"type": "array"}},
                "examples": {"type": "array"}
            },
            "$defs": {"list": {"type": "array"}}
        });
        let declared = input_schema(listed.as_object().unwrap()).unwrap();
        let properties = &declared["properties"];
        assert_eq!(properties["tags"]["items"], serde_json::json!({}));
        assert_eq!(properties["either"]["items"], serde_json::json!({}));
        assert_eq!(properties["ids"]["items"], serde_json::json!({"type": "integer"}));
        assert!(properties["pair"].get("items").is_none());
        assert_eq!(
            properties["nested"]["properties"]["deep"]["anyOf"][0]["items"],
            serde_json::json!({})
        );
        assert_eq!(declared["$defs"]["list"]["items"], serde_json::json!({}));
        assert_eq!(
            properties["shape"]["enum"],
            serde_json::json!([{"type": "array"}]),
            "data stays"
        );
        assert_eq!(
            properties["shape"]["default"],
            serde_json::json!({"type": "array"}),
            "data stays"
        );
        assert_eq!(
            properties["examples"]["items"],
            serde_json::json!({}),
            "a property's name is no keyword"
        );
    }

    /// A listed tool's description names it and its server as the server does (its
    /// description may refer to the server's other tools by those names) and quotes its
    /// title; a tool that says nothing of itself is described by its title.
    #[test]
    fn a_tools_description_names_it_as_its_server_does_and_quotes_its_title() {
        let schema = Arc::new(serde_json::Map::new());
        let mut tool = rmcp::model::Tool::new("search.issues", "Find issues; call auth.login first.", schema);
        tool.title = Some("Issue search".into());
        assert_eq!(
            describe("gh", &tool),
            "Find issues; call auth.login first.\n\n(MCP tool \"search.issues\" of server \"gh\"; title: Issue search.)"
        );
        tool.description = Some("  ".into());
        assert_eq!(
            describe("gh", &tool),
            "Issue search (MCP tool \"search.issues\" of server \"gh\")"
        );
        tool.title = Some("t".repeat(1_000));
        assert!(describe("gh", &tool).starts_with(&format!("{}…", "t".repeat(MAX_TITLE_BYTES))));
        tool.title = None;
        assert_eq!(describe("gh", &tool), "search.issues (MCP server gh)");
    }

    /// A small schema whose choices each refer to definitions that are choices among the same
    /// definitions again (a few kilobytes, well under the size bound) would take longer to
    /// read branch by branch than the universe has left: it is refused at once, and the tool
    /// left out, instead of holding a worker thread for ever.
    #[test]
    fn a_schema_whose_choices_multiply_is_refused_quickly() {
        let branches = |level: usize| -> Vec<Value> {
            (0..40)
                .map(|n| serde_json::json!({"$ref": format!("#/$defs/l{level}"), "properties": {format!("p{n}"): {"type": "string"}}}))
                .collect()
        };
        let mut defs = serde_json::Map::new();
        for level in 0..8 {
            defs.insert(format!("l{level}"), serde_json::json!({"anyOf": branches(level + 1)}));
        }
        let schema = serde_json::json!({"type": "object", "anyOf": branches(0), "$defs": defs});
        assert!(crate::json_shape::json_bytes(&schema) < MAX_SCHEMA_BYTES);
        // The walk without a budget would not return (40^9 branches to follow).
        let refused = input_schema(schema.as_object().expect("an object"));
        assert_eq!(refused, Err(flue_core::data::TooIntricate));

        // Branches that say nothing (`true`) count as well: a choice of thousands of them,
        // referred to again and again, is work too.
        let nothing: Vec<Value> = (0..5_000).map(|_| Value::Bool(true)).collect();
        let again: Vec<Value> = (0..100).map(|_| serde_json::json!({"$ref": "#/$defs/a"})).collect();
        let schema = serde_json::json!({
            "type": "object",
            "anyOf": (0..100).map(|_| serde_json::json!({"$ref": "#/$defs/b"})).collect::<Vec<_>>(),
            "$defs": {"a": {"anyOf": nothing}, "b": {"anyOf": again}},
        });
        assert!(crate::json_shape::json_bytes(&schema) < MAX_SCHEMA_BYTES);
        let refused = input_schema(schema.as_object().expect("an object"));
        assert_eq!(refused, Err(flue_core::data::TooIntricate));

        // Many branches describing one argument differently: any value, not a choice of them all.
        let many: Vec<Value> = (0..40)
            .map(|n| serde_json::json!({"properties": {"mode": {"const": format!("m{n}")}}}))
            .collect();
        let declared = input_schema(
            serde_json::json!({"type": "object", "oneOf": many})
                .as_object()
                .expect("an object"),
        )
        .expect("declarable");
        assert_eq!(declared["properties"]["mode"], serde_json::json!({}));
    }

    /// Servers put `anyOf`/`oneOf`/`allOf` at a tool schema's root (one of two arguments
    /// required, say), which Anthropic and OpenAI refuse in every request that declares it: it
    /// is declared without them, their branches' properties at the root, `allOf`'s required.
    #[test]
    fn a_schemas_root_combinators_are_declared_as_the_properties_of_their_branches() {
        let listed = |schema: Value| input_schema(schema.as_object().expect("an object")).expect("declarable");
        let either = listed(serde_json::json!({
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "anyOf": [{"required": ["query"]}, {"properties": {"id": {"type": "string"}}, "required": ["id"]}],
        }));
        assert_eq!(
            either,
            serde_json::json!({
                "type": "object",
                "properties": {"query": {"type": "string"}, "id": {"type": "string"}},
            })
        );
        let bare = listed(serde_json::json!({
            "allOf": [
                {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "integer"}}},
            ],
            "not": {"required": ["c"]},
        }));
        assert_eq!(
            bare,
            serde_json::json!({
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a"],
            })
        );
        // What providers take is left as it is.
        let plain = serde_json::json!({"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]});
        assert_eq!(listed(plain.clone()), plain);
        assert!(DataSchema::new(either).expect("compiles").has_object_root());
    }

    #[test]
    fn a_reason_shown_to_the_model_and_observers_is_one_line_of_300_characters_at_most() {
        assert_eq!(shown_reason("refused\n<html>\n</html>"), "refused <html> </html>");
        let long = shown_reason(&"é".repeat(400));
        assert_eq!(long.chars().count(), 301);
        assert!(long.ends_with('…'));
    }

    #[test]
    fn a_key_in_the_servers_url_path_is_not_quoted() {
        let url = "https://mcp.example.com/api/s/sk-live-1234/mcp?token=t";
        let error = "error sending request for url (https://mcp.example.com/api/s/sk-live-1234/mcp?token=t)";
        let quoted = without_server_path(&without_url_secrets(error), url);
        assert_eq!(quoted, "error sending request for url (https://mcp.example.com/…)");
        // A server quoting the path alone.
        assert_eq!(
            without_server_path(
                "Cannot POST /api/s/sk-live-1234/mcp",
                "https://mcp.example.com/api/s/sk-live-1234/mcp"
            ),
            "Cannot POST /…"
        );
        // Only the URL's path goes, not text that merely contains it.
        let url = "https://mcp.notion.com/mcp";
        assert_eq!(
            without_server_path(
                "error sending request for url (https://mcp.notion.com/mcp): /mcp refused",
                url
            ),
            "error sending request for url (https://mcp.notion.com/…): /mcp refused"
        );
        // A URL with no path to hide is quoted as it was.
        assert_eq!(
            without_server_path("no answer from https://mcp.example.com/", "https://mcp.example.com"),
            "no answer from https://mcp.example.com/"
        );
    }

    #[test]
    fn errors_read_without_type_names() {
        assert_eq!(
            readable("Send message error Transport [a::B<c::D>] error: Client error: refused"),
            "Send message error Transport error: Client error: refused"
        );
        // The server's own words keep their brackets, a lone one included.
        let quoted =
            r#"Transport [rmcp::T<reqwest::Client>] error: HTTP 422: {"detail":[{"loc":["header","x-api-key"]}]} [see"#;
        assert_eq!(
            readable(quoted),
            r#"Transport error: HTTP 422: {"detail":[{"loc":["header","x-api-key"]}]} [see"#
        );
    }

    /// The headers that carry a credential are kept from what servers send back; the others
    /// (a version, an environment's name) are data, left as they are.
    #[test]
    fn only_the_headers_that_carry_a_credential_are_redacted() {
        let mut connection = McpConnection::new("docs", "https://mcp.example.com/mcp");
        connection.headers = [
            ("Notion-Version", "2022-06-28"),
            ("X-Env", "prod"),
            ("X-Api-Key", "abc12345"),
            ("Cookie", "sid=s3cr3t-cookie-value; theme=dark"),
            ("X-Tenant", "tnt_4f9c2a7b1e8d6c3f"),
            // Named like credentials, valued like data: kept (`true` is not cut out of results).
            ("X-Bypass-Cache", "true"),
            ("X-Access-Mode", "read"),
        ]
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .into();
        let credentials = credentials(&connection);
        let text = "On 2022-06-28 the prod products of tnt_4f9c2a7b1e8d6c3f used abc12345 and sid=s3cr3t-cookie-value; already read: true.";
        assert_eq!(
            without_credentials(text, &credentials),
            "On 2022-06-28 the prod products of [redacted] used [redacted] and sid=[redacted]; already read: true."
        );
        // A cookie's value quoted bare (a session the server says expired); its short data kept.
        let text = "session s3cr3t-cookie-value expired; theme=dark stays";
        assert_eq!(
            without_credentials(text, &credentials),
            "session [redacted] expired; theme=dark stays"
        );
    }

    /// The credentials a server's URL carries (a password, a query value that carries one, an
    /// opaque token in its path) are kept out of what the server says too, as written or
    /// percent-decoded; the URL's other parts (its user name among them) are data.
    #[test]
    fn the_credentials_a_url_carries_are_redacted() {
        let connection = McpConnection::new(
            "hosted",
            "https://bot:pa%24%24word-42@mcp.example.com/u/k7Rq2mXv9LpT4sWz/mcp?api_key=sk-abc123&access=read&profile=default",
        );
        let credentials = credentials(&connection);
        let text = "401: api_key sk-abc123 (user bot, pa$$word-42) refused at /u/k7Rq2mXv9LpT4sWz/mcp for profile default, read access";
        assert_eq!(
            without_credentials(text, &credentials),
            "401: api_key [redacted] (user bot, [redacted]) refused at /u/[redacted]/mcp for profile default, read access"
        );
    }

    /// A result is redacted as an error is, and only the prefix that can show is: what shows
    /// is what redacting all of it shows, wherever a credential (plain or escaped) sits, also
    /// after runs of credentials that redaction shortens to one `[redacted]`.
    #[test]
    fn a_result_is_shown_without_credentials_redacting_only_what_can_show() {
        let credential = "tok-0123456789abcdef".to_owned();
        let credentials = [credential.clone()];
        let escaped: String = credential.bytes().map(|byte| format!("\\u{byte:04x}")).collect();
        let whole = |text: &str| {
            let redacted = without_credentials(text, &credentials);
            if redacted.len() <= MAX_BYTES {
                return redacted;
            }
            let end = redacted.floor_char_boundary(MAX_BYTES);
            redacted[..end].to_owned()
        };
        assert_eq!(
            redacted_capped(format!("Authorization: Bearer {credential}"), &credentials),
            "Authorization: Bearer [redacted]"
        );
        // Where a first prefix would end, and past it.
        let enough = 2 * (MAX_BYTES + 18 * credential.len());
        for form in [credential.as_str(), escaped.as_str()] {
            for at in [
                0,
                MAX_BYTES - 5,
                MAX_BYTES + 3,
                enough - 40,
                enough - 3,
                enough + 10,
                3 * enough,
            ] {
                // Credentials all along, so that redaction shortens what shows the most.
                let dense = format!("{}{}", form.repeat(at / form.len()), "é".repeat(at % form.len()));
                let text = format!("{dense}{form}{}", "x".repeat(enough));
                let shown = redacted_capped(text.clone(), &credentials);
                let (body, note) = shown.rsplit_once("\n[Output truncated").expect("cut");
                let expected = whole(&text);
                // Compared by length first: the texts are hundreds of kilobytes.
                assert_eq!((body.len(), body == expected), (expected.len(), true), "{at}");
                assert!(note.ends_with(&format!("of {} bytes.]", text.len())), "{note}");
                assert!(!body.contains("tok-0") && !body.contains("\\u0074\\u006f"), "{at}");
            }
        }
    }

    #[test]
    fn a_long_result_is_cut_on_a_character_boundary() {
        assert_eq!(capped("short".to_owned()), "short");
        let exact = "x".repeat(MAX_BYTES);
        assert_eq!(capped(exact.clone()), exact);
        let cut = capped(format!("{}é{}", "x".repeat(MAX_BYTES - 1), "y".repeat(10)));
        assert_eq!(
            cut,
            format!(
                "{}\n[Output truncated: the first {} of {} bytes.]",
                "x".repeat(MAX_BYTES - 1),
                MAX_BYTES - 1,
                MAX_BYTES + 11
            )
        );
    }

    #[test]
    fn mounted_names_keep_to_the_tool_name_alphabet_and_length() {
        assert_eq!(tool_name("git hub", "search.issues"), "mcp__git_hub__search_issues");
        assert_eq!(tool_name("s", &"x".repeat(100)).len(), 64);
    }
}
