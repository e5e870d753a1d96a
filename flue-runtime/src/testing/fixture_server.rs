//! A scripted OpenAI- and Anthropic-compatible HTTP server on loopback, so tests run the real
//! provider path (reqwest, retries, server-sent events) offline.
//!
//! [`FixtureServer::start`] binds `127.0.0.1` on a free port and serves, on the current tokio
//! runtime:
//!
//! - `POST /v1/chat/completions` (OpenAI Chat Completions) and
//! - `POST /v1/messages` (Anthropic Messages).
//!
//! Both answer from one FIFO queue of scripted [`FixtureReply`] values pushed by the test. The
//! server does not check which API a reply imitates, nor any API key: it only records every
//! request ([`RecordedRequest`]: method, path, headers, JSON body) for assertions. When the queue
//! is empty it answers `400` with a body saying the fixture script ran out, so a test that
//! makes more calls than it scripted fails loudly and at once (a `400` is not retried, where
//! a `5xx` would be, for seconds, recording the retries). Other paths answer `404`.
//!
//! ```
//! use flue_runtime::provider::openai::OpenAiProvider;
//! use flue_runtime::provider::{ModelMessage, ModelProvider, ModelRequest, StreamEvent};
//! use flue_runtime::model::ThinkingLevel;
//! use flue_runtime::testing::fixture_server::{FixtureReply, FixtureServer};
//! use futures_util::StreamExt;
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let server = FixtureServer::start().await;
//! server.push(FixtureReply::openai_text("Hello there"));
//!
//! // Any OpenAI-compatible provider pointed at the server; the key is only recorded.
//! let provider = OpenAiProvider::compatible("fixture", server.base_url(), "FIXTURE_API_KEY")
//!     .with_api_key("test-key");
//! let request = ModelRequest {
//!     model: "fixture-model".into(),
//!     system: Some("Be brief.".into()),
//!     messages: vec![ModelMessage::user("Hi")].into(),
//!     tools: vec![],
//!     thinking_level: ThinkingLevel::Off,
//!     max_output_tokens: None,
//!     max_retries: None,
//! };
//! let mut stream = provider.stream(&request);
//! let mut completed = None;
//! while let Some(event) = stream.next().await {
//!     if let StreamEvent::Completed(response) = event.unwrap() {
//!         completed = Some(response);
//!     }
//! }
//! assert_eq!(completed.unwrap().text, "Hello there");
//!
//! let requests = server.requests();
//! assert_eq!(requests[0].path, "/v1/chat/completions");
//! assert_eq!(requests[0].header("authorization"), Some("Bearer test-key"));
//! assert_eq!(requests[0].body["messages"][0]["role"], "system");
//! # });
//! ```

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::Response;
use flue_core::usage::Usage;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The OpenAI route, relative to the server root.
pub const OPENAI_PATH: &str = "/v1/chat/completions";
/// The Anthropic route, relative to the server root.
pub const ANTHROPIC_PATH: &str = "/v1/messages";

/// The usage the convenience replies ([`FixtureReply::openai_text`], …) report.
pub const FIXTURE_USAGE: Usage = Usage {
    input_tokens: 12,
    output_tokens: 7,
    cache_read_tokens: 4,
    cache_write_tokens: 0,
    reasoning_tokens: 0,
};

/// How many characters a convenience reply puts in one tool-argument chunk.
const DEFAULT_ARGUMENT_CHUNK: usize = 5;

/// A running fixture server. Dropped, it stops accepting connections; a reply already being
/// sent runs to its end (a connection a test wants cut mid-stream is scripted with
/// [`FixtureReply::abort`]).
pub struct FixtureServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

#[derive(Default)]
struct Shared {
    replies: Mutex<VecDeque<FixtureReply>>,
    requests: Mutex<Vec<RecordedRequest>>,
}

impl FixtureServer {
    /// Starts a server on `127.0.0.1` (a free port) on the current tokio runtime.
    ///
    /// # Panics
    ///
    /// When no loopback port can be bound (use [`try_start`](Self::try_start) to handle that).
    pub async fn start() -> FixtureServer {
        match Self::try_start().await {
            Ok(server) => server,
            Err(error) => panic!("[flue] The fixture server could not bind 127.0.0.1: {error}"),
        }
    }

    /// Starts a server on `127.0.0.1` (a free port) on the current tokio runtime.
    pub async fn try_start() -> std::io::Result<FixtureServer> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::default());
        let router = Router::new().fallback(handle).with_state(Arc::clone(&shared));
        let task = tokio::spawn(async move {
            if let Err(error) = axum::serve(listener, router).await {
                tracing::error!(%error, "the fixture server stopped");
            }
        });
        Ok(FixtureServer { addr, shared, task })
    }

    /// The base URL to give a provider: `http://127.0.0.1:PORT/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Queues `reply` as the answer to the next request (after those already queued).
    pub fn push(&self, reply: FixtureReply) -> &Self {
        lock(&self.shared.replies).push_back(reply);
        self
    }

    /// Every request received so far, oldest first.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        lock(&self.shared.requests).clone()
    }

    /// How many scripted replies are still queued.
    pub fn pending(&self) -> usize {
        lock(&self.shared.replies).len()
    }
}

impl Drop for FixtureServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl std::fmt::Debug for FixtureServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FixtureServer")
            .field("addr", &self.addr)
            .field("pending", &self.pending())
            .finish()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One request the server received.
#[derive(Clone, Debug, PartialEq)]
pub struct RecordedRequest {
    /// The method (`POST`).
    pub method: String,
    /// The path (`/v1/chat/completions`).
    pub path: String,
    /// The headers, names lowercased (repeated headers joined with `, `).
    pub headers: BTreeMap<String, String>,
    /// The body parsed as JSON; a body that is not JSON is kept as a JSON string, an empty one
    /// (or one not read whole: over 64 MiB or cut off, answered `413`) is `null`.
    pub body: Value,
}

impl RecordedRequest {
    /// The value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(&name.to_ascii_lowercase()).map(String::as_str)
    }
}

/// One chunk of a scripted OpenAI Chat Completions stream. Each becomes one `data:` event
/// (wrapped in a `chat.completion.chunk` object where it carries content).
#[derive(Clone, Debug, PartialEq)]
pub enum OpenAiChunk {
    /// `delta.content`.
    Text(String),
    /// `delta.reasoning_content` (the field of DeepSeek/vLLM; OpenRouter's is `reasoning`).
    Reasoning(String),
    /// The first chunk of a tool call: `delta.tool_calls[{index, id, type, function: {name, arguments: ""}}]`.
    ToolCallStart {
        /// The call's `index`.
        index: usize,
        /// Its id.
        id: String,
        /// The tool name.
        name: String,
    },
    /// More argument text of a tool call: `delta.tool_calls[{index, function: {arguments}}]`.
    ToolCallArguments {
        /// The call's `index`.
        index: usize,
        /// The fragment.
        fragment: String,
    },
    /// A chunk with an empty delta and this `finish_reason` (`stop`, `tool_calls`, `length`, …).
    Finish(String),
    /// The usage chunk (`choices: []`, `usage` with the token details).
    Usage(Usage),
    /// An error object inside the stream: `{"error": {"message", "type", "code"}}`.
    Error {
        /// `error.code` (`rate_limit_exceeded`, `server_error`, …).
        code: String,
        /// `error.message`.
        message: String,
    },
    /// A `data:` payload sent verbatim (`{not json` for a malformed chunk).
    Raw(String),
    /// `data: [DONE]`.
    Done,
    /// A pause before the next chunk (to trip idle timeouts).
    Pause(Duration),
    /// An SSE comment line (`: text`), as a gateway sends to keep a connection alive.
    Comment(String),
}

/// One event of a scripted Anthropic Messages stream (`event: <type>` plus its `data:`).
#[derive(Clone, Debug, PartialEq)]
pub enum AnthropicEvent {
    /// `message_start` with the prompt usage. `input_tokens` is sent minus the cache reads and
    /// writes (Anthropic counts them apart), so the provider reports exactly this usage.
    MessageStart(Usage),
    /// `content_block_start` of a text block.
    TextStart {
        /// Block index.
        index: usize,
    },
    /// `content_block_delta` with a `text_delta`.
    TextDelta {
        /// Block index.
        index: usize,
        /// The text.
        text: String,
    },
    /// `content_block_start` of a thinking block.
    ThinkingStart {
        /// Block index.
        index: usize,
    },
    /// `content_block_delta` with a `thinking_delta`.
    ThinkingDelta {
        /// Block index.
        index: usize,
        /// The reasoning text.
        thinking: String,
    },
    /// `content_block_delta` with a `signature_delta`: the signature of the thinking block at
    /// `index`, which the provider sends back with the step.
    SignatureDelta {
        /// Block index.
        index: usize,
        /// The signature.
        signature: String,
    },
    /// `content_block_start` of a `redacted_thinking` block (encrypted reasoning).
    RedactedThinking {
        /// Block index.
        index: usize,
        /// The encrypted data.
        data: String,
    },
    /// `content_block_start` of a `tool_use` block (`input: {}`).
    ToolUseStart {
        /// Block index.
        index: usize,
        /// The call id.
        id: String,
        /// The tool name.
        name: String,
    },
    /// `content_block_delta` with an `input_json_delta`.
    InputJsonDelta {
        /// Block index.
        index: usize,
        /// The fragment.
        partial_json: String,
    },
    /// `content_block_stop`.
    BlockStop {
        /// Block index.
        index: usize,
    },
    /// `message_delta` with a `stop_reason` (`end_turn`, `tool_use`, `max_tokens`, …) and the
    /// output token count.
    MessageDelta {
        /// The stop reason.
        stop_reason: String,
        /// `usage.output_tokens`.
        output_tokens: u64,
    },
    /// `message_stop`.
    MessageStop,
    /// `ping`.
    Ping,
    /// An `error` event: `{"type": "error", "error": {"type", "message"}}`.
    Error {
        /// `error.type` (`overloaded_error`, …).
        kind: String,
        /// `error.message`.
        message: String,
    },
    /// An event sent verbatim.
    Raw {
        /// The `event:` name.
        event: String,
        /// The `data:` payload.
        data: String,
    },
    /// A pause before the next event.
    Pause(Duration),
}

/// A piece of a streamed body.
#[derive(Clone, Debug, PartialEq)]
enum Frame {
    Bytes(String),
    Pause(Duration),
}

#[derive(Clone, Debug, PartialEq)]
enum ReplyBody {
    Full { content_type: &'static str, text: String },
    Stream { frames: Vec<Frame>, abort: bool },
}

/// A scripted answer of the [`FixtureServer`]: an HTTP status with a body, or a streamed
/// (server-sent events) completion, plus optional headers and a delay before the first byte.
///
/// ```
/// use std::time::Duration;
/// use flue_runtime::testing::fixture_server::FixtureReply;
///
/// let rate_limited = FixtureReply::status(429, r#"{"error":{"message":"slow down"}}"#).retry_after(1);
/// let slow = FixtureReply::openai_text("late").delay(Duration::from_secs(5));
/// let parallel = FixtureReply::openai_tool_calls_interleaved(
///     vec![("call_1", "get_weather", r#"{"city":"Paris"}"#), ("call_2", "get_time", r#"{"tz":"CET"}"#)],
///     2,
/// );
/// # drop((rate_limited, slow, parallel));
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct FixtureReply {
    status: u16,
    headers: Vec<(String, String)>,
    delay: Duration,
    body: ReplyBody,
}

impl FixtureReply {
    fn stream(frames: Vec<Frame>) -> Self {
        Self {
            status: 200,
            headers: Vec::new(),
            delay: Duration::ZERO,
            body: ReplyBody::Stream { frames, abort: false },
        }
    }

    /// An HTTP `status` with `body` (sent as `application/json` when it parses as JSON, else as
    /// `text/plain`).
    ///
    /// # Panics
    ///
    /// On a status HTTP has no room for (outside 100–999), at the test's line: answered, it
    /// would be a server error the provider retries with the next scripted reply.
    #[track_caller]
    pub fn status(status: u16, body: impl Into<String>) -> Self {
        assert!(
            StatusCode::from_u16(status).is_ok(),
            "[flue fixture] Invalid scripted status {status}."
        );
        let text = body.into();
        let content_type = if serde_json::from_str::<Value>(&text).is_ok() {
            "application/json"
        } else {
            "text/plain; charset=utf-8"
        };
        Self {
            status,
            headers: Vec::new(),
            delay: Duration::ZERO,
            body: ReplyBody::Full { content_type, text },
        }
    }

    /// An OpenAI-shaped error: `status` with `{"error": {"message", "type", "param": null, "code"}}`.
    #[track_caller]
    pub fn openai_error(status: u16, code: &str, message: &str) -> Self {
        let kind = match status {
            401 | 403 => "invalid_request_error",
            429 => "requests",
            500..=599 => "server_error",
            _ => "invalid_request_error",
        };
        let body = json!({"error": {"message": message, "type": kind, "param": null, "code": code}});
        Self::status(status, body.to_string())
    }

    /// OpenAI's answer to a prompt too long for the model: `400` with code
    /// `context_length_exceeded`.
    pub fn openai_context_length_exceeded() -> Self {
        Self::openai_error(
            400,
            "context_length_exceeded",
            "This model's maximum context length is 128000 tokens. However, your messages resulted in 131072 \
             tokens. Please reduce the length of the messages.",
        )
    }

    /// An Anthropic-shaped error: `status` with `{"type": "error", "error": {"type", "message"}}`.
    #[track_caller]
    pub fn anthropic_error(status: u16, kind: &str, message: &str) -> Self {
        let body = json!({"type": "error", "error": {"type": kind, "message": message}});
        Self::status(status, body.to_string())
    }

    /// A streamed OpenAI completion made of `chunks`, sent in order. Nothing is added: end
    /// with [`OpenAiChunk::Finish`] and [`OpenAiChunk::Done`] for a complete answer.
    pub fn openai_chunks(chunks: impl IntoIterator<Item = OpenAiChunk>) -> Self {
        Self::stream(chunks.into_iter().map(openai_frame).collect())
    }

    /// A complete OpenAI text answer: `text` in word-sized chunks, finish reason `stop`, the
    /// [`FIXTURE_USAGE`] chunk, `[DONE]`.
    pub fn openai_text(text: &str) -> Self {
        let mut chunks: Vec<OpenAiChunk> = split_words(text).into_iter().map(OpenAiChunk::Text).collect();
        chunks.extend(openai_ending("stop"));
        Self::openai_chunks(chunks)
    }

    /// A complete OpenAI answer calling tools `(id, name, arguments)`, one call after the
    /// other (as OpenAI streams parallel calls), arguments in 5-character chunks; finish reason
    /// `tool_calls`, the [`FIXTURE_USAGE`] chunk, `[DONE]`.
    pub fn openai_tool_calls<'a>(calls: impl IntoIterator<Item = (&'a str, &'a str, &'a str)>) -> Self {
        Self::openai_tool_calls_split(calls, DEFAULT_ARGUMENT_CHUNK)
    }

    /// Like [`openai_tool_calls`](Self::openai_tool_calls), with arguments split into chunks
    /// of `chunk_chars` characters (1 = one chunk per character).
    pub fn openai_tool_calls_split<'a>(
        calls: impl IntoIterator<Item = (&'a str, &'a str, &'a str)>,
        chunk_chars: usize,
    ) -> Self {
        let mut chunks = Vec::new();
        for (index, (id, name, arguments)) in calls.into_iter().enumerate() {
            chunks.push(OpenAiChunk::ToolCallStart {
                index,
                id: id.to_owned(),
                name: name.to_owned(),
            });
            chunks.extend(
                split_chars(arguments, chunk_chars)
                    .into_iter()
                    .map(|fragment| OpenAiChunk::ToolCallArguments { index, fragment }),
            );
        }
        chunks.extend(openai_ending("tool_calls"));
        Self::openai_chunks(chunks)
    }

    /// Like [`openai_tool_calls_split`](Self::openai_tool_calls_split), but every call starts
    /// first and the argument chunks of the calls then alternate (call 0, call 1, call 0, …).
    pub fn openai_tool_calls_interleaved<'a>(
        calls: impl IntoIterator<Item = (&'a str, &'a str, &'a str)>,
        chunk_chars: usize,
    ) -> Self {
        let calls: Vec<_> = calls.into_iter().collect();
        let mut chunks: Vec<OpenAiChunk> = calls
            .iter()
            .enumerate()
            .map(|(index, (id, name, _))| OpenAiChunk::ToolCallStart {
                index,
                id: (*id).to_owned(),
                name: (*name).to_owned(),
            })
            .collect();
        let mut pieces: Vec<VecDeque<String>> = calls
            .iter()
            .map(|(_, _, arguments)| split_chars(arguments, chunk_chars).into())
            .collect();
        while pieces.iter().any(|p| !p.is_empty()) {
            for (index, queue) in pieces.iter_mut().enumerate() {
                if let Some(fragment) = queue.pop_front() {
                    chunks.push(OpenAiChunk::ToolCallArguments { index, fragment });
                }
            }
        }
        chunks.extend(openai_ending("tool_calls"));
        Self::openai_chunks(chunks)
    }

    /// An OpenAI stream that sends the first word-chunk of `text`, then a malformed chunk
    /// (`data: {not json`), then ends properly.
    pub fn openai_malformed(text: &str) -> Self {
        let mut chunks: Vec<OpenAiChunk> = split_words(text).into_iter().take(1).map(OpenAiChunk::Text).collect();
        chunks.push(OpenAiChunk::Raw("{not json".to_owned()));
        chunks.extend(openai_ending("stop"));
        Self::openai_chunks(chunks)
    }

    /// An OpenAI stream that sends `text` and then closes the connection cleanly without a
    /// finish reason or `[DONE]` (a response cut short).
    pub fn openai_truncated(text: &str) -> Self {
        Self::openai_chunks(split_words(text).into_iter().map(OpenAiChunk::Text))
    }

    /// A streamed Anthropic message made of `events`, sent in order. Nothing is added: end
    /// with [`AnthropicEvent::MessageDelta`] and [`AnthropicEvent::MessageStop`] for a
    /// complete answer.
    pub fn anthropic_events(events: impl IntoIterator<Item = AnthropicEvent>) -> Self {
        Self::stream(events.into_iter().map(anthropic_frame).collect())
    }

    /// A complete Anthropic text answer: `message_start` ([`FIXTURE_USAGE`]), one text block
    /// with `text` in word-sized deltas, stop reason `end_turn`, `message_stop`.
    pub fn anthropic_text(text: &str) -> Self {
        let mut events = vec![
            AnthropicEvent::MessageStart(FIXTURE_USAGE),
            AnthropicEvent::TextStart { index: 0 },
        ];
        events.extend(
            split_words(text)
                .into_iter()
                .map(|text| AnthropicEvent::TextDelta { index: 0, text }),
        );
        events.push(AnthropicEvent::BlockStop { index: 0 });
        events.extend(anthropic_ending("end_turn"));
        Self::anthropic_events(events)
    }

    /// A complete Anthropic answer calling tools `(id, name, arguments)`: one `tool_use` block
    /// per call, arguments in 5-character `input_json_delta`s, stop reason `tool_use`.
    pub fn anthropic_tool_use<'a>(calls: impl IntoIterator<Item = (&'a str, &'a str, &'a str)>) -> Self {
        Self::anthropic_tool_use_split(calls, DEFAULT_ARGUMENT_CHUNK)
    }

    /// Like [`anthropic_tool_use`](Self::anthropic_tool_use), with arguments split into
    /// chunks of `chunk_chars` characters.
    pub fn anthropic_tool_use_split<'a>(
        calls: impl IntoIterator<Item = (&'a str, &'a str, &'a str)>,
        chunk_chars: usize,
    ) -> Self {
        let mut events = vec![AnthropicEvent::MessageStart(FIXTURE_USAGE)];
        for (index, (id, name, arguments)) in calls.into_iter().enumerate() {
            events.push(AnthropicEvent::ToolUseStart {
                index,
                id: id.to_owned(),
                name: name.to_owned(),
            });
            events.extend(
                split_chars(arguments, chunk_chars)
                    .into_iter()
                    .map(|partial_json| AnthropicEvent::InputJsonDelta { index, partial_json }),
            );
            events.push(AnthropicEvent::BlockStop { index });
        }
        events.extend(anthropic_ending("tool_use"));
        Self::anthropic_events(events)
    }

    /// A stream of raw server-sent-event text, each item written as is (include the `data: `
    /// prefixes and the blank lines).
    pub fn raw_sse(pieces: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self::stream(pieces.into_iter().map(|piece| Frame::Bytes(piece.into())).collect())
    }

    /// Waits `delay` before answering (before the status line: the first byte).
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// Adds a `Retry-After: <seconds>` header.
    pub fn retry_after(self, seconds: u64) -> Self {
        self.header("retry-after", seconds.to_string())
    }

    /// Adds a response header. The first scripted value of a name replaces the fixture's own
    /// (`content-type`, `cache-control`); more values of that name are added.
    ///
    /// # Panics
    ///
    /// On a name or value HTTP does not allow (a space in the name, a line break in the
    /// value), at the test's line.
    #[track_caller]
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        let (name, value) = (name.into(), value.into());
        assert!(
            HeaderName::try_from(name.as_str()).is_ok() && HeaderValue::try_from(value.as_str()).is_ok(),
            "[flue fixture] Invalid scripted header {name:?}: {value:?}."
        );
        self.headers.push((name, value));
        self
    }

    /// For a streamed reply: after the scripted chunks, break the connection (the chunked body
    /// is never terminated) instead of ending the body cleanly. No effect on a status reply.
    pub fn abort(mut self) -> Self {
        if let ReplyBody::Stream { abort, .. } = &mut self.body {
            *abort = true;
        }
        self
    }
}

fn openai_ending(finish_reason: &str) -> [OpenAiChunk; 3] {
    [
        OpenAiChunk::Finish(finish_reason.to_owned()),
        OpenAiChunk::Usage(FIXTURE_USAGE),
        OpenAiChunk::Done,
    ]
}

fn anthropic_ending(stop_reason: &str) -> [AnthropicEvent; 2] {
    [
        AnthropicEvent::MessageDelta {
            stop_reason: stop_reason.to_owned(),
            output_tokens: FIXTURE_USAGE.output_tokens,
        },
        AnthropicEvent::MessageStop,
    ]
}

/// `text` in pieces that each start at a word (leading whitespace kept with the word).
fn split_words(text: &str) -> Vec<String> {
    let mut pieces: Vec<String> = Vec::new();
    let mut current = String::new();
    let mut in_word = false;
    for c in text.chars() {
        if c.is_whitespace() && in_word {
            pieces.push(std::mem::take(&mut current));
        }
        in_word = !c.is_whitespace();
        current.push(c);
    }
    if !current.is_empty() {
        pieces.push(current);
    }
    pieces
}

/// `text` in pieces of `size` characters (at least 1).
fn split_chars(text: &str, size: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars.chunks(size.max(1)).map(|chunk| chunk.iter().collect()).collect()
}

fn data_frame(payload: &str) -> Frame {
    Frame::Bytes(format!("data: {payload}\n\n"))
}

fn chat_chunk(delta: Value, finish_reason: Option<&str>) -> Value {
    json!({
        "id": "chatcmpl-fixture",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "fixture",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    })
}

fn openai_frame(chunk: OpenAiChunk) -> Frame {
    let value = match chunk {
        OpenAiChunk::Text(text) => chat_chunk(json!({"content": text}), None),
        OpenAiChunk::Reasoning(text) => chat_chunk(json!({"reasoning_content": text}), None),
        OpenAiChunk::ToolCallStart { index, id, name } => chat_chunk(
            json!({"tool_calls": [
                {"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}
            ]}),
            None,
        ),
        OpenAiChunk::ToolCallArguments { index, fragment } => chat_chunk(
            json!({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}),
            None,
        ),
        OpenAiChunk::Finish(reason) => chat_chunk(json!({}), Some(&reason)),
        OpenAiChunk::Usage(usage) => json!({
            "id": "chatcmpl-fixture",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "fixture",
            "choices": [],
            "usage": {
                "prompt_tokens": usage.input_tokens,
                "completion_tokens": usage.output_tokens,
                "total_tokens": usage.input_tokens + usage.output_tokens,
                "prompt_tokens_details": {
                    "cached_tokens": usage.cache_read_tokens,
                    "cache_write_tokens": usage.cache_write_tokens,
                },
                "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            },
        }),
        OpenAiChunk::Error { code, message } => {
            json!({"error": {"message": message, "type": code, "param": null, "code": code}})
        }
        OpenAiChunk::Raw(payload) => return data_frame(&payload),
        OpenAiChunk::Done => return data_frame("[DONE]"),
        OpenAiChunk::Pause(pause) => return Frame::Pause(pause),
        OpenAiChunk::Comment(text) => return Frame::Bytes(format!(": {text}\n\n")),
    };
    data_frame(&value.to_string())
}

fn anthropic_frame(event: AnthropicEvent) -> Frame {
    let (name, data) = match event {
        AnthropicEvent::MessageStart(usage) => {
            let uncached_input = usage
                .input_tokens
                .saturating_sub(usage.cache_read_tokens + usage.cache_write_tokens);
            (
                "message_start",
                json!({"type": "message_start", "message": {
                    "id": "msg_fixture",
                    "type": "message",
                    "role": "assistant",
                    "model": "fixture",
                    "content": [],
                    "stop_reason": null,
                    "stop_sequence": null,
                    "usage": {
                        "input_tokens": uncached_input,
                        "cache_read_input_tokens": usage.cache_read_tokens,
                        "cache_creation_input_tokens": usage.cache_write_tokens,
                        "output_tokens": 1,
                    },
                }}),
            )
        }
        AnthropicEvent::TextStart { index } => (
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}),
        ),
        AnthropicEvent::TextDelta { index, text } => (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}}),
        ),
        AnthropicEvent::ThinkingStart { index } => (
            "content_block_start",
            json!({"type": "content_block_start", "index": index,
                   "content_block": {"type": "thinking", "thinking": ""}}),
        ),
        AnthropicEvent::ThinkingDelta { index, thinking } => (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index,
                   "delta": {"type": "thinking_delta", "thinking": thinking}}),
        ),
        AnthropicEvent::SignatureDelta { index, signature } => (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index,
                   "delta": {"type": "signature_delta", "signature": signature}}),
        ),
        AnthropicEvent::RedactedThinking { index, data } => (
            "content_block_start",
            json!({"type": "content_block_start", "index": index,
                   "content_block": {"type": "redacted_thinking", "data": data}}),
        ),
        AnthropicEvent::ToolUseStart { index, id, name } => (
            "content_block_start",
            json!({"type": "content_block_start", "index": index,
                   "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}}),
        ),
        AnthropicEvent::InputJsonDelta { index, partial_json } => (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index,
                   "delta": {"type": "input_json_delta", "partial_json": partial_json}}),
        ),
        AnthropicEvent::BlockStop { index } => (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ),
        AnthropicEvent::MessageDelta {
            stop_reason,
            output_tokens,
        } => (
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": null},
                   "usage": {"output_tokens": output_tokens}}),
        ),
        AnthropicEvent::MessageStop => ("message_stop", json!({"type": "message_stop"})),
        AnthropicEvent::Ping => ("ping", json!({"type": "ping"})),
        AnthropicEvent::Error { kind, message } => (
            "error",
            json!({"type": "error", "error": {"type": kind, "message": message}}),
        ),
        AnthropicEvent::Raw { event, data } => return Frame::Bytes(format!("event: {event}\ndata: {data}\n\n")),
        AnthropicEvent::Pause(pause) => return Frame::Pause(pause),
    };
    Frame::Bytes(format!("event: {name}\ndata: {data}\n\n"))
}

fn error_json(kind: &str, message: String) -> String {
    json!({"error": {"message": message, "type": kind, "code": kind}}).to_string()
}

/// Records the request, then answers with the next scripted reply.
async fn handle(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let read = axum::body::to_bytes(body, 64 * 1024 * 1024).await;
    let unread = read.as_ref().err().map(ToString::to_string);
    let bytes = read.unwrap_or_default();
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
    };
    let mut headers = BTreeMap::<String, String>::new();
    for (name, value) in &parts.headers {
        let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
        headers
            .entry(name.as_str().to_owned())
            .and_modify(|existing| {
                existing.push_str(", ");
                existing.push_str(&value);
            })
            .or_insert(value);
    }
    let method = parts.method.as_str().to_owned();
    let path = parts.uri.path().to_owned();
    let routed = method == "POST" && (path == OPENAI_PATH || path == ANTHROPIC_PATH);
    // Recorded and answered under the replies' lock: the n-th request `requests()` lists is
    // the one the n-th scripted reply answered, however many arrive at once. A body that
    // could not be read whole takes no reply.
    let next = {
        let mut replies = lock(&shared.replies);
        lock(&shared.requests).push(RecordedRequest {
            method: method.clone(),
            path: path.clone(),
            headers,
            body,
        });
        if routed && unread.is_none() {
            replies.pop_front()
        } else {
            None
        }
    };
    if let Some(error) = unread {
        let message =
            format!("[flue fixture] The request body could not be read whole (over 64 MiB, or cut off): {error}.");
        return plain(
            StatusCode::PAYLOAD_TOO_LARGE,
            error_json("fixture_unread_body", message),
        );
    }
    if !routed {
        let message = format!(
            "[flue fixture] No route for {method} {path}: the fixture server answers POST {OPENAI_PATH} and POST \
             {ANTHROPIC_PATH} (give providers the base URL http://127.0.0.1:PORT/v1)."
        );
        return plain(StatusCode::NOT_FOUND, error_json("not_found_error", message));
    }
    let Some(reply) = next else {
        let message = format!(
            "[flue fixture] The fixture script ran out: no scripted reply is left for {method} {path}. Push one \
             FixtureReply per expected request (retries included)."
        );
        return plain(StatusCode::BAD_REQUEST, error_json("fixture_script_exhausted", message));
    };
    if !reply.delay.is_zero() {
        tokio::time::sleep(reply.delay).await;
    }
    respond(reply)
}

fn plain(status: StatusCode, body: String) -> Response {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn respond(reply: FixtureReply) -> Response {
    let Ok(status) = StatusCode::from_u16(reply.status) else {
        let message = format!("[flue fixture] Invalid scripted status {}.", reply.status);
        return plain(
            StatusCode::INTERNAL_SERVER_ERROR,
            error_json("fixture_invalid_reply", message),
        );
    };
    let (content_type, body) = match reply.body {
        ReplyBody::Full { content_type, text } => (content_type, Body::from(text)),
        ReplyBody::Stream { frames, abort } => ("text/event-stream", Body::from_stream(frame_stream(frames, abort))),
    };
    let mut response = Response::new(body);
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // A scripted header replaces the fixture's own of that name (its content type, say);
    // several scripted values of one name are all sent.
    let mut scripted = Vec::new();
    for (name, value) in reply.headers {
        let (Ok(name), Ok(value)) = (
            HeaderName::try_from(name.as_str()),
            HeaderValue::try_from(value.as_str()),
        ) else {
            let message = format!("[flue fixture] Invalid scripted header {name:?}.");
            return plain(
                StatusCode::INTERNAL_SERVER_ERROR,
                error_json("fixture_invalid_reply", message),
            );
        };
        if !scripted.contains(&name) {
            headers.remove(&name);
            scripted.push(name.clone());
        }
        headers.append(name, value);
    }
    response
}

/// The body of a streamed reply: each frame is written (and flushed) on its own; pauses sleep;
/// `abort` ends with an error, which makes the server cut the connection.
fn frame_stream(
    frames: Vec<Frame>,
    abort: bool,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    futures_util::stream::unfold((frames.into_iter(), abort), |(mut frames, abort)| async move {
        loop {
            match frames.next() {
                Some(Frame::Bytes(text)) => return Some((Ok(Bytes::from(text)), (frames, abort))),
                Some(Frame::Pause(pause)) => tokio::time::sleep(pause).await,
                None if abort => {
                    // Let the server flush what was written, so the cut comes mid-body.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let error = std::io::Error::other("[flue fixture] the scripted reply aborts the connection");
                    return Some((Err(error), (frames, false)));
                }
                None => return None,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_and_chars_split_without_losing_text() {
        assert_eq!(split_words("Hello there  world"), ["Hello", " there", "  world"]);
        assert_eq!(split_words("  lead"), ["  lead"]);
        assert_eq!(split_words(""), Vec::<String>::new());
        assert_eq!(split_chars("abcdé", 2), ["ab", "cd", "é"]);
        assert_eq!(split_chars("abc", 0), ["a", "b", "c"]);
    }

    /// A reply HTTP cannot carry fails where the test scripts it, not as a retried server
    /// error that hands the next scripted reply to the wrong call.
    #[test]
    #[should_panic(expected = "[flue fixture] Invalid scripted status 0.")]
    fn a_status_http_has_no_room_for_fails_where_it_is_scripted() {
        let _ = FixtureReply::status(0, "{}");
    }

    #[test]
    #[should_panic(expected = "[flue fixture] Invalid scripted header \"x-trace\"")]
    fn a_header_value_with_a_line_break_fails_where_it_is_scripted() {
        let _ = FixtureReply::openai_text("hi").header("x-trace", "a\nb");
    }
}
