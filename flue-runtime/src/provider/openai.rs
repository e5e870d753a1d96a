//! The OpenAI Chat Completions provider, also used for OpenRouter and any OpenAI-compatible
//! server (vLLM, Ollama, LM Studio, the testing kit's [fixture server](crate::testing::fixture_server)).
//!
//! Calls `POST {base_url}/chat/completions` with `stream: true` and
//! `stream_options.include_usage` (unless [`with_stream_usage`](OpenAiProvider::with_stream_usage)
//! turns it off), and maps the streamed chunks to [`StreamEvent`]s.
//!
//! How [`ModelRequest`] maps to the request body:
//!
//! - `system` → a leading `{"role": "system"}` message;
//! - [`ModelMessage::User`] → `{"role": "user", "content"}`; with images, `content` is parts:
//!   the text, then `{"type": "image_url", "image_url": {"url": "data:<type>;base64,…"}}` each;
//! - [`ModelMessage::Assistant`] → `{"role": "assistant", "content", "tool_calls": [{"id",
//!   "type": "function", "function": {"name", "arguments"}}]}` (`content` is `null` when there
//!   are tool calls and no text; `tool_calls` is omitted when empty);
//! - [`ModelMessage::Tool`] → `{"role": "tool", "tool_call_id", "content"}`;
//! - `tools` → `[{"type": "function", "function": {"name", "description", "parameters"}}]`;
//! - `max_output_tokens` → `max_completion_tokens` for `openai` (its reasoning models refuse
//!   `max_tokens`), `max_tokens` for OpenRouter and compatible servers (Ollama reads only it);
//! - `thinking_level` → `minimal`/`low`/`medium`/`high` (`xhigh` and `max` send `high`; `off`
//!   sends nothing, except to OpenAI's models that reason by default, which get the least
//!   effort they take: `minimal` on `gpt-5`, `low` on the o-series), as said below.
//!
//! The thinking level is sent per flavour:
//! - `openai`: `reasoning_effort`, except for the model families that reject it (`gpt-4*`,
//!   `gpt-3.5*`, `chatgpt-*`, `gpt-5-chat*`, `o1-mini`, `o1-preview`, fine-tuned ones too),
//!   which get no reasoning parameter; the o-series gets `low` for `minimal`;
//! - `openrouter`: OpenRouter's unified `reasoning: {"effort"}` object only (OpenRouter translates
//!   it for every upstream, including non-OpenAI ones), which also takes `none` (for `off`, so
//!   a model that reasons by default does not) and `xhigh` (for `xhigh` and `max`);
//! - compatible servers: nothing, unless
//!   [`with_reasoning_effort`](OpenAiProvider::with_reasoning_effort) turns `reasoning_effort`
//!   on (many compatible servers refuse it, or refuse it for a model that cannot reason).
//!
//! A step's reasoning goes back with it as `reasoning_content` when the provider echoes
//! reasoning ([`with_reasoning_echo`](OpenAiProvider::with_reasoning_echo): on by default for
//! DeepSeek's API, whose thinking mode requires it within a tool loop). OpenRouter's streamed
//! `delta.reasoning_details` are built up by their `index` (text, summary and data appended)
//! and go back with their step as `reasoning_details`, unchanged: Gemini and Claude through
//! OpenRouter refuse a tool loop's next call without them.
//!
//! How the streamed chunks map to [`StreamEvent`]s: `delta.content` → `TextDelta`;
//! `delta.reasoning` or `delta.reasoning_content` → `ReasoningDelta`; `delta.tool_calls[]` →
//! `ToolCallStarted` once a call's name is known (with a generated id if the server sends none),
//! then `ToolCallArguments` per fragment (calls may interleave by `index`; events carry the
//! call's position in this response); `finish_reason` → [`StopReason`] (`stop` after tool calls
//! counts as `ToolUse`); the usage chunk → `Usage`; `data: [DONE]` (or the body's end after a
//! finish reason and the usage chunk) → one `Completed`. Tool calls with empty arguments complete
//! with `{}`. An `{"error": …}` chunk, llama.cpp's `error: {…}` line, a choice that finishes
//! with `finish_reason: "error"` (OpenRouter, when the upstream failed), `[DONE]` before any
//! choice, a malformed chunk or a body that ends early fails the stream. A body that ends after
//! the finish reason with neither the usage chunk nor `[DONE]` ended early too when the usage
//! was asked for: with `include_usage` the server still had the usage to send, and completing
//! would report zero tokens. (Servers that send no usage still end with `[DONE]`.)

mod chunk;

use std::borrow::Cow;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use flue_core::model::ThinkingLevel;
use flue_core::url::url_without_secrets;
use flue_core::usage::Usage;
use reqwest::header::AUTHORIZATION;
use serde::Serialize;
use serde_json::Value;

use super::MAX_STREAMED_PARTS;
use super::body::{BodyWriter, Payload};
pub use super::http::RetryPolicy;
use super::http::{
    CallContext, CallHeaders, Endpoint, ErrorDetails, Flow, KeySource, SharedClient, SseDecoder, Transport,
    check_event_shape, ended_early, error_event, error_stream, map_error, parse_event_json, secret_header,
    send_with_retries, sse_stream,
};
use super::sse::Event;
use super::tool_json::{Declarations, ToolJson};
use super::wire_names;
use chunk::{CallView, ChunkView, Text, UsageView};

use super::types::{
    ModelMessage, ModelProvider, ModelRequest, ModelResponse, ModelStream, ModelToolCall, ProviderError,
    ProviderErrorKind, ReasoningBlock, StopReason, StreamEvent,
};

/// Which server an [`OpenAiProvider`] talks to (decides the reasoning parameter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flavor {
    OpenAi,
    OpenRouter,
    Compatible,
}

/// A provider speaking the OpenAI Chat Completions API.
///
/// The API key is read from the provider's environment variable at call time (so it can be set
/// after the provider is built); [`with_api_key`](Self::with_api_key) gives one in code instead.
/// When there is no key the call's stream yields one [`ProviderErrorKind::MissingKey`] error and
/// no request is made.
///
/// ```no_run
/// use std::time::Duration;
/// use flue_runtime::provider::openai::{OpenAiProvider, RetryPolicy};
///
/// let openai = OpenAiProvider::openai();
/// let local = OpenAiProvider::compatible("local", "http://127.0.0.1:11434/v1", "OLLAMA_API_KEY")
///     .with_optional_key()
///     .with_timeout(Duration::from_secs(120))
///     .with_retry_policy(RetryPolicy::none());
/// ```
#[derive(Clone)]
pub struct OpenAiProvider {
    id: String,
    base_url: String,
    endpoint: Endpoint,
    flavor: Flavor,
    /// Whether the thinking level is sent (see [`OpenAiProvider::with_reasoning_effort`]).
    reasoning_effort: bool,
    /// Whether `stream_options.include_usage` is sent (see
    /// [`OpenAiProvider::with_stream_usage`]).
    stream_usage: bool,
    /// Whether a step's reasoning goes back with it (see
    /// [`OpenAiProvider::with_reasoning_echo`]; `None`: by the base URL).
    reasoning_echo: Option<bool>,
    /// The least idle timeout of a call that asks for reasoning (see
    /// [`OpenAiProvider::with_reasoning_idle_timeout`]).
    reasoning_idle_timeout: Duration,
    key: KeySource,
    transport: Transport,
    client: SharedClient,
    tools: ToolJson,
}

/// The base URL without its userinfo, query and fragment (the key is redacted by its own
/// Debug): a provider's Debug ends up in logs.
impl std::fmt::Debug for OpenAiProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiProvider")
            .field("id", &self.id)
            .field("base_url", &url_without_secrets(&self.base_url))
            .field("endpoint", &self.endpoint)
            .field("flavor", &self.flavor)
            .field("reasoning_effort", &self.reasoning_effort)
            .field("stream_usage", &self.stream_usage)
            .field("reasoning_echo", &self.reasoning_echo)
            .field("reasoning_idle_timeout", &self.reasoning_idle_timeout)
            .field("key", &self.key)
            .field("transport", &self.transport)
            .field("client", &self.client)
            .field("tools", &self.tools)
            .finish()
    }
}

impl OpenAiProvider {
    fn new(id: impl Into<String>, base_url: impl Into<String>, key_env: impl Into<String>, flavor: Flavor) -> Self {
        let base_url = base_url.into();
        Self {
            id: id.into(),
            reasoning_echo: None,
            base_url,
            endpoint: Endpoint::default(),
            flavor,
            // Compatible servers differ: many refuse the parameter, or refuse it for a model
            // that cannot reason, so they get it only when asked.
            reasoning_effort: flavor != Flavor::Compatible,
            stream_usage: true,
            reasoning_idle_timeout: REASONING_IDLE_TIMEOUT,
            key: KeySource::env(key_env),
            transport: Transport::default(),
            client: SharedClient::default(),
            tools: ToolJson::default(),
        }
    }

    /// OpenAI: id `openai`, base URL `https://api.openai.com/v1`, key in `OPENAI_API_KEY`.
    pub fn openai() -> Self {
        Self::new("openai", "https://api.openai.com/v1", "OPENAI_API_KEY", Flavor::OpenAi)
    }

    /// OpenRouter: id `openrouter`, base URL `https://openrouter.ai/api/v1`, key in
    /// `OPENROUTER_API_KEY`. Model ids are OpenRouter's (`anthropic/claude-sonnet-4.5`).
    pub fn openrouter() -> Self {
        Self::new(
            "openrouter",
            "https://openrouter.ai/api/v1",
            "OPENROUTER_API_KEY",
            Flavor::OpenRouter,
        )
    }

    /// Any OpenAI-compatible server: registered as `id`, calling `{base_url}/chat/completions`,
    /// with the key read from the environment variable `key_env`.
    pub fn compatible(id: impl Into<String>, base_url: impl Into<String>, key_env: impl Into<String>) -> Self {
        Self::new(id, base_url, key_env, Flavor::Compatible)
    }

    /// Replaces the base URL (the part before `/chat/completions`).
    pub fn with_base_url(mut self, base_url: impl Into<String>) -> Self {
        self.base_url = base_url.into();
        self.endpoint = Endpoint::default();
        self
    }

    /// Sets how long an attempt may wait for the response to start (default 60 s), counted
    /// from when the request was sent: a long body's upload (a conversation with images, on a
    /// slow link) does not count against it while it moves on. A timeout is retried like a
    /// server error.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.transport.timeout = timeout;
        self
    }

    /// Sets how long the streamed body may stay silent between two chunks (default 120 s).
    /// When it does, the stream fails with [`ProviderErrorKind::Timeout`]. A call that asks
    /// for reasoning waits at least [`with_reasoning_idle_timeout`](Self::with_reasoning_idle_timeout).
    pub fn with_idle_timeout(mut self, idle: Duration) -> Self {
        self.transport.idle_timeout = idle;
        self
    }

    /// Sets the least idle timeout of a call that sends a reasoning effort (default 10
    /// minutes). Chat Completions streams nothing while a reasoning model thinks, and at a
    /// high effort it thinks for minutes before its first token.
    pub fn with_reasoning_idle_timeout(mut self, idle: Duration) -> Self {
        self.reasoning_idle_timeout = idle;
        self
    }

    /// Sets the retry policy for failures before the response starts (default: 3 retries from
    /// 2 s, see [`RetryPolicy`]).
    pub fn with_retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.transport.retry = policy;
        self
    }

    /// Uses `key` instead of reading the environment variable (tests, keys from a secret
    /// store). Error messages still name the environment variable and never show the key; an
    /// empty `key` restores reading the environment.
    pub fn with_api_key(mut self, key: impl Into<String>) -> Self {
        self.key.set_explicit(key);
        self
    }

    /// Lets calls go out without a key when the environment variable is unset (local servers
    /// that need none); no `Authorization` header is sent then.
    pub fn with_optional_key(mut self) -> Self {
        self.key.optional = true;
        self
    }

    /// Whether to send the thinking level (`reasoning_effort`, or OpenRouter's `reasoning`
    /// object). On for `openai` (for the model families that take it) and `openrouter`; off
    /// for compatible servers, where many refuse it (Ollama and Groq for a model that cannot
    /// reason, some for the value `minimal`): turn it on for a server and model that take it.
    pub fn with_reasoning_effort(mut self, send: bool) -> Self {
        self.reasoning_effort = send;
        self
    }

    /// Whether to ask for the usage at the end of the stream (`stream_options:
    /// {"include_usage": true}`, on by default). Some compatible servers refuse the field
    /// (Mistral, older Azure API versions): turn it off for them, and their calls report the
    /// usage they send anyway, if any.
    pub fn with_stream_usage(mut self, ask: bool) -> Self {
        self.stream_usage = ask;
        self
    }

    /// Whether to keep a step's reasoning (`reasoning_content`) and send it back with the step
    /// as `reasoning_content`. DeepSeek's thinking mode requires it in every call of a tool
    /// loop (it refuses the call without it), so it is on for a compatible provider whose base
    /// URL is DeepSeek's (`api.deepseek.com`) and off otherwise: other servers refuse the field
    /// (Groq) or ignore it. Turn it on for a server that wants it back.
    pub fn with_reasoning_echo(mut self, echo: bool) -> Self {
        self.reasoning_echo = Some(echo);
        self
    }

    /// What of a step's reasoning goes back with it (see [`Echo`]).
    fn echo(&self) -> Echo {
        let text = self.echoes_reasoning();
        Echo {
            text,
            details: text || self.flavor == Flavor::OpenRouter,
        }
    }

    /// Whether a step's reasoning goes back with it: as chosen, else for DeepSeek's API only.
    fn echoes_reasoning(&self) -> bool {
        self.reasoning_echo
            .unwrap_or_else(|| self.flavor == Flavor::Compatible && self.is_deepseek())
    }

    /// Whether calls go to DeepSeek's API: decided from the endpoint's host, parsed once
    /// (this runs at every call).
    fn is_deepseek(&self) -> bool {
        self.endpoint
            .parsed(&self.base_url, CHAT_PATH)
            .as_ref()
            .is_ok_and(|url| url.host_str() == Some("api.deepseek.com"))
    }

    /// The base URL.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// The environment variable the API key is read from.
    pub fn key_env(&self) -> &str {
        &self.key.env
    }

    /// The JSON body of a call, serialized straight from the request: the conversation's
    /// strings are borrowed, never copied into an intermediate `Value` tree, and its messages'
    /// encodings are kept with the history, so a call of a long conversation encodes only its
    /// new messages (the body grows with the conversation; its cost should be copying the
    /// bytes, nothing more).
    fn body_bytes(&self, request: &ModelRequest) -> Result<Payload, serde_json::Error> {
        let tools = self.tools.declarations(&request.tools, |tool| {
            serde_json::value::to_raw_value(&ChatTool {
                kind: "function",
                function: ChatToolFunction {
                    name: &tool.name,
                    description: &tool.description,
                    parameters: &tool.parameters,
                },
            })
        })?;
        // `{"messages":[…],` then the other fields: the history's encodings are kept with it
        // (each message is encoded once, not at every call of a long conversation).
        // The system prompt is the first message, before the kept ones.
        let echo = self.echo();
        let format = echo.format();
        let (head, tail) = request.body_size_hint(format, tools.encoded_len());
        let system_len = request.system.as_deref().map_or(0, str::len);
        let mut writer = BodyWriter::with_capacity(head + system_len, tail);
        let body = writer.buf();
        body.extend_from_slice(b"{\"messages\":[");
        if let Some(system) = request.system.as_deref().filter(|s| !s.is_empty()) {
            serde_json::to_writer(&mut *body, &ChatMessage::System { content: system })?;
            if !request.messages.is_empty() {
                body.push(b',');
            }
        }
        request.messages.encode_into(format, &mut writer, |message, out| {
            // A step that said nothing and called nothing (an empty answer, reasoning cut by
            // the output limit) is left out: it tells the model nothing, and servers refuse an
            // assistant message with neither content nor calls (Mistral answers 400).
            if let ModelMessage::Assistant { text, tool_calls, .. } = message
                && text.trim().is_empty()
                && tool_calls.is_empty()
            {
                return Ok(());
            }
            serde_json::to_writer(out, &chat_message(message, echo))
        })?;
        let body = writer.buf();
        body.extend_from_slice(b"],");
        let (reasoning, reasoning_effort) = self.reasoning_fields(request);
        // OpenAI's reasoning models refuse `max_tokens`; other servers (Ollama among them)
        // read only `max_tokens`.
        let (max_completion_tokens, max_tokens) = match self.flavor {
            Flavor::OpenAi => (request.max_output_tokens, None),
            Flavor::OpenRouter | Flavor::Compatible => (None, request.max_output_tokens),
        };
        let fields = ChatFields {
            model: &request.model,
            stream: true,
            stream_options: self.stream_usage.then_some(StreamOptions { include_usage: true }),
            tools: &tools,
            reasoning,
            reasoning_effort,
            max_completion_tokens,
            max_tokens,
        };
        // The fields' own object, without its opening brace: they follow the messages.
        let fields_at = body.len();
        serde_json::to_writer(&mut *body, &fields)?;
        body.remove(fields_at);
        Ok(writer.finish())
    }

    /// The JSON body of a call, as a value (tests).
    #[cfg(test)]
    fn body(&self, request: &ModelRequest) -> Value {
        super::http::decoded_body(self.body_bytes(request))
    }
}

/// Which of a step's reasoning goes back with it. A conversation's steps keep the reasoning
/// blocks of the provider that made them, and a later submission may call another provider
/// (the model is submission-scoped): each provider sends back only what it asks for, or a
/// server that refuses the field (Groq, OpenAI) would refuse every later call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Echo {
    /// `reasoning_content` (DeepSeek, or as [`OpenAiProvider::with_reasoning_echo`] says).
    text: bool,
    /// `reasoning_details` (OpenRouter, or a server echoing reasoning).
    details: bool,
}

impl Echo {
    /// The wire format [`Messages::encode_into`] keeps the history's encodings in: one per
    /// choice, so a history encoded for one provider is not sent to another.
    fn format(self) -> &'static str {
        match (self.text, self.details) {
            (false, false) => "openai-chat-completions",
            (true, false) => "openai-chat-completions+reasoning-content",
            (false, true) => "openai-chat-completions+reasoning-details",
            (true, true) => "openai-chat-completions+reasoning-content+reasoning-details",
        }
    }
}

/// The default least idle timeout of a call that asks for reasoning.
const REASONING_IDLE_TIMEOUT: Duration = Duration::from_secs(600);

/// Where Chat Completions calls go, under the base URL.
const CHAT_PATH: &str = "chat/completions";

/// A call's message in the Chat Completions format (borrowing the conversation's strings),
/// with the reasoning `echo` asks for.
fn chat_message(message: &ModelMessage, echo: Echo) -> ChatMessage<'_> {
    match message {
        ModelMessage::User { content, images } if images.is_empty() => ChatMessage::User {
            content: UserContent::Text(content),
        },
        ModelMessage::User { content, images } => ChatMessage::User {
            content: UserContent::Parts(
                std::iter::once(UserPart::Text { text: content })
                    .chain(images.iter().map(|image| UserPart::ImageUrl {
                        image_url: ImageUrl {
                            url: format!("data:{};base64,{}", image.media_type, image.data),
                        },
                    }))
                    .collect(),
            ),
        },
        ModelMessage::Assistant {
            text,
            tool_calls,
            reasoning,
        } => ChatMessage::Assistant {
            content: if text.is_empty() && !tool_calls.is_empty() {
                None
            } else {
                Some(text)
            },
            // Kept only by a provider that echoes reasoning (see `with_reasoning_echo`), and
            // sent only to one. DeepSeek's thinking mode refuses (400) a step with calls but
            // no `reasoning_content`, so such a step that had none (or was made elsewhere)
            // sends it empty.
            reasoning_content: reasoning
                .iter()
                .filter(|_| echo.text)
                .find_map(|block| match block {
                    ReasoningBlock::Text { text } => Some(text.as_str()),
                    _ => None,
                })
                .or_else(|| (echo.text && !tool_calls.is_empty()).then_some("")),
            // Only OpenRouter streams them, and it wants them back.
            reasoning_details: reasoning
                .iter()
                .filter(|_| echo.details)
                .filter_map(|block| match block {
                    ReasoningBlock::Detail { detail } => Some(detail),
                    _ => None,
                })
                .collect(),
            tool_calls: tool_calls
                .iter()
                .map(|call| ChatToolCall {
                    id: call_id(&call.id),
                    kind: "function",
                    function: ChatFunction {
                        name: wire_names::tool_name(&call.name),
                        arguments: sent_arguments(call),
                    },
                })
                .collect(),
        },
        ModelMessage::Tool {
            tool_call_id, content, ..
        } => ChatMessage::Tool {
            tool_call_id: call_id(tool_call_id),
            content,
        },
    }
}

/// A tool call's id as OpenAI accepts it in the history: at most 40 characters. Ids other
/// servers made can be longer (vLLM's are 46); see [`wire_names`].
fn call_id(id: &str) -> Cow<'_, str> {
    wire_names::conforming(id, false, 40)
}

/// A tool call's arguments as sent back to the model: as it wrote them when they are a JSON
/// object, else `{}`. Arguments a model's answer cut short (its output ran out mid-call) are
/// not JSON: servers that check them (Ollama, vLLM, gateways to other providers) refuse every
/// later request of the conversation that carries them.
fn sent_arguments(call: &ModelToolCall) -> &str {
    let object = call.arguments.trim_start().starts_with('{')
        && serde_json::from_str::<serde::de::IgnoredAny>(&call.arguments).is_ok();
    if object {
        return &call.arguments;
    }
    if !call.arguments.trim().is_empty() {
        tracing::warn!(tool = %call.name, id = %call.id, "tool arguments are not a JSON object: sent as {{}}");
    }
    "{}"
}

/// A call's body but its messages (written before these, see `body_bytes`).
#[derive(Serialize)]
struct ChatFields<'a> {
    model: &'a str,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
    /// The declarations, encoded once per tool (see [`ToolJson`]).
    #[serde(skip_serializing_if = "Declarations::is_empty")]
    tools: &'a Declarations,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning: Option<ReasoningOption>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_effort: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_completion_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

#[derive(Serialize)]
struct ReasoningOption {
    effort: &'static str,
}

#[derive(Serialize)]
#[serde(tag = "role", rename_all = "lowercase")]
enum ChatMessage<'a> {
    System {
        content: &'a str,
    },
    User {
        content: UserContent<'a>,
    },
    Assistant {
        content: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        reasoning_content: Option<&'a str>,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        reasoning_details: Vec<&'a serde_json::Map<String, Value>>,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<ChatToolCall<'a>>,
    },
    Tool {
        tool_call_id: Cow<'a, str>,
        content: &'a str,
    },
}

/// A user message's content: its text, or, with images, content parts.
#[derive(Serialize)]
#[serde(untagged)]
enum UserContent<'a> {
    Text(&'a str),
    Parts(Vec<UserPart<'a>>),
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum UserPart<'a> {
    Text { text: &'a str },
    ImageUrl { image_url: ImageUrl },
}

#[derive(Serialize)]
struct ImageUrl {
    /// A `data:` URL.
    url: String,
}

#[derive(Serialize)]
struct ChatToolCall<'a> {
    id: Cow<'a, str>,
    #[serde(rename = "type")]
    kind: &'static str,
    function: ChatFunction<'a>,
}

#[derive(Serialize)]
struct ChatFunction<'a> {
    name: Cow<'a, str>,
    arguments: &'a str,
}

#[derive(Serialize)]
struct ChatTool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    function: ChatToolFunction<'a>,
}

#[derive(Serialize)]
struct ChatToolFunction<'a> {
    name: &'a str,
    description: &'a str,
    parameters: &'a Arc<Value>,
}

impl OpenAiProvider {
    /// What a call sends of its thinking level: OpenRouter's `reasoning` object, or
    /// `reasoning_effort` (not for `Off` but to OpenAI's models that reason by default, nor to a
    /// model that refuses it or a compatible server not asked to).
    fn reasoning_fields(&self, request: &ModelRequest) -> (Option<ReasoningOption>, Option<&'static str>) {
        if !self.reasoning_effort {
            return (None, None);
        }
        match (reasoning_effort(request.thinking_level), self.flavor) {
            (_, Flavor::OpenRouter) => (
                openrouter_effort(&request.model, request.thinking_level).map(|effort| ReasoningOption { effort }),
                None,
            ),
            (Some(effort), Flavor::OpenAi) => (None, openai_effort(&request.model, effort)),
            (Some(effort), Flavor::Compatible) => (None, Some(effort)),
            // Nothing would leave an OpenAI reasoning model at its default (medium) effort.
            (None, Flavor::OpenAi) => (None, openai_least_effort(&request.model)),
            (None, _) => (None, None),
        }
    }
}

/// OpenRouter's `reasoning.effort` of a thinking level for `model`: it takes `none` (no
/// reasoning, where nothing would leave a reasoning model at its default effort) and `xhigh`
/// beside OpenAI's levels, and translates them for every upstream. But an OpenAI model that
/// cannot stop reasoning refuses `none` (400, "reasoning is mandatory"): `Off` sends it the
/// least effort it takes, as the OpenAI provider does, and nothing to a model that takes no
/// reasoning parameter.
fn openrouter_effort(model: &str, level: ThinkingLevel) -> Option<&'static str> {
    match level {
        // (Without a variant's suffix: `openai/gpt-5:online` is gpt-5.)
        ThinkingLevel::Off => match model
            .strip_prefix("openai/")
            .map(|openai| openai.split(':').next().unwrap_or(openai))
        {
            Some(openai) => match OpenAiFamily::of(openai) {
                OpenAiFamily::Gpt5 | OpenAiFamily::OSeries => openai_least_effort(openai),
                OpenAiFamily::Refuses => None,
                OpenAiFamily::AfterGpt5 | OpenAiFamily::Other => Some("none"),
            },
            None => Some("none"),
        },
        ThinkingLevel::Xhigh | ThinkingLevel::Max => Some("xhigh"),
        level => Some(reasoning_effort(level).unwrap_or("medium")),
    }
}

/// The `reasoning_effort` of a thinking level (`None` for `Off`).
fn reasoning_effort(level: ThinkingLevel) -> Option<&'static str> {
    match level {
        ThinkingLevel::Off => None,
        ThinkingLevel::Minimal => Some("minimal"),
        ThinkingLevel::Low => Some("low"),
        ThinkingLevel::Medium => Some("medium"),
        ThinkingLevel::High | ThinkingLevel::Xhigh | ThinkingLevel::Max => Some("high"),
    }
}

/// The `reasoning_effort` an OpenAI model takes for `effort`: none for the families that
/// refuse the parameter (`gpt-4*`, `gpt-3.5*`, `chatgpt-*`, `gpt-5-chat*`, `o1-mini`,
/// `o1-preview`, also fine-tuned: `ft:gpt-4o…`), and `low` for `minimal` on the o-series
/// (`o1`, `o3`, `o4-mini`, …), which takes only low, medium and high, and on `gpt-5.1` and
/// later, which took `none` in its place (and refuse `minimal`).
fn openai_effort(model: &str, effort: &'static str) -> Option<&'static str> {
    match OpenAiFamily::of(model) {
        OpenAiFamily::Refuses => None,
        OpenAiFamily::OSeries | OpenAiFamily::AfterGpt5 if effort == "minimal" => Some("low"),
        _ => Some(effort),
    }
}

/// The `reasoning_effort` of [`ThinkingLevel::Off`] for an OpenAI model whose default is to
/// reason: the least it takes (`minimal` on `gpt-5`, `low` on the o-series, which cannot turn
/// reasoning off). Nothing for `gpt-5.1` and later (their default is already `none`), for the
/// families that refuse the parameter and for models not known to reason.
fn openai_least_effort(model: &str) -> Option<&'static str> {
    match OpenAiFamily::of(model) {
        OpenAiFamily::Gpt5 => Some("minimal"),
        OpenAiFamily::OSeries => Some("low"),
        OpenAiFamily::AfterGpt5 | OpenAiFamily::Refuses | OpenAiFamily::Other => None,
    }
}

/// What an OpenAI model takes as `reasoning_effort`, by its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OpenAiFamily {
    /// `gpt-4*`, `gpt-3.5*`, `chatgpt-*`, the `gpt-5` chat models (`gpt-5-chat*`,
    /// `gpt-5.1-chat*`, …), `o1-mini`, `o1-preview` (fine-tuned ones too): no reasoning
    /// parameter.
    Refuses,
    /// `o1`, `o3`, `o4-mini`, …: low, medium and high.
    OSeries,
    /// `gpt-5`, `gpt-5-mini`, `gpt-5-nano`: minimal to high.
    Gpt5,
    /// `gpt-5.1` and later: none to high (no minimal).
    AfterGpt5,
    /// Any other name: sent as asked.
    Other,
}

impl OpenAiFamily {
    fn of(model: &str) -> Self {
        let model = model.to_ascii_lowercase();
        let model = model.strip_prefix("ft:").unwrap_or(&model);
        let chat_5 = model.starts_with("gpt-5") && model.contains("-chat");
        let refuses = chat_5
            || ["gpt-4", "gpt-3.5", "chatgpt-", "o1-mini", "o1-preview"]
                .iter()
                .any(|prefix| model.starts_with(prefix));
        let digit_after = |prefix: &str| {
            model
                .strip_prefix(prefix)
                .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        };
        if refuses {
            Self::Refuses
        } else if digit_after("o") {
            Self::OSeries
        } else if digit_after("gpt-5.") {
            Self::AfterGpt5
        } else if model == "gpt-5" || model.starts_with("gpt-5-") {
            Self::Gpt5
        } else {
            Self::Other
        }
    }
}

impl ModelProvider for OpenAiProvider {
    fn id(&self) -> &str {
        &self.id
    }

    fn stream(&self, request: &ModelRequest) -> ModelStream {
        let key = match self.key.resolve(&self.id) {
            Ok(key) => key,
            Err(error) => return error_stream(error),
        };
        let headers = CallHeaders {
            fixed: &[("accept", "text/event-stream")],
            key: match key
                .as_ref()
                .map(|key| secret_header(&format!("Bearer {}", key.expose()), &self.id, &self.key.env))
            {
                Some(Ok(value)) => Some((AUTHORIZATION, value)),
                Some(Err(error)) => return error_stream(error),
                None => None,
            },
        };
        let ctx = CallContext::new(&self.id, &self.key.env, &request.model, key);
        let body = super::http::encode_body(self.body_bytes(request));
        let url = self.endpoint.url(&self.base_url, CHAT_PATH);
        let transport = self.transport.for_request(request);
        let client = self.client.clone();
        let connect_ctx = ctx.clone();
        let connect = async move {
            let client = client.get()?;
            send_with_retries(&client, &url, &headers, body?, &transport, &connect_ctx).await
        };
        let decoder = ChatDecoder::new(ctx.clone(), self.stream_usage, self.echoes_reasoning());
        let idle = match self.reasoning_fields(request) {
            // No reasoning asked for (nothing sent, or an effort of `none`): the model has no
            // silence to think in.
            (None | Some(ReasoningOption { effort: "none" }), None) | (None, Some("none")) => transport.idle_timeout,
            _ => transport.idle_timeout.max(self.reasoning_idle_timeout),
        };
        sse_stream(connect, decoder, idle, ctx)
    }
}

/// A tool call being assembled from its chunks.
#[derive(Debug, Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
    /// Where `arguments` stands, read fragment by fragment.
    scan: ArgumentScan,
    started: bool,
    /// The id was made up here (the call started before the server gave one): an id the
    /// server sends later continues this call (which keeps the id its start reported).
    generated: bool,
    /// The server's id for a call that started under another (an earlier call of the step
    /// had it): its later fragments still name this one.
    server_id: String,
    /// The call's name came again with no arguments once its own were whole: a server that
    /// opens each call with a fragment naming it (`"arguments": ""`) and sends the arguments
    /// without a name, under the same index and id. Text after that opens the next call.
    named_again: bool,
}

impl PartialCall {
    /// Appends a fragment of the arguments.
    fn push_arguments(&mut self, fragment: &str) {
        self.arguments.push_str(fragment);
        self.scan.feed(fragment);
    }

    /// Whether the arguments so far are one whole JSON object or array (what tells a call's
    /// end from its continuation, for servers that do not say). Parsed once, when their
    /// brackets close: a server that repeats a call's name or id in every fragment does not
    /// make each fragment a read of the whole text.
    fn is_whole(&self) -> bool {
        if !self.scan.may_be_whole() {
            return false;
        }
        // Past the close only whitespace keeps the text whole, and it does not change
        // whether the text parses: the first answer stands.
        *self
            .scan
            .parsed
            .get_or_init(|| serde_json::from_str::<serde::de::IgnoredAny>(&self.arguments).is_ok())
    }

    /// Whether a fragment under an id not seen before (naming `name`, if any, and bringing
    /// `fragment`) is the server's late id for this call: its id was made up here, the fragment
    /// names no other tool, and it brings arguments only while this call's are not whole. A
    /// fragment that names the call's tool and brings nothing is taken for the next call of
    /// that tool (two calls of a tool without arguments) unless this call is halfway through
    /// its arguments.
    fn takes_late_id(&self, name: Option<&str>, fragment: &str) -> bool {
        let fits = match name {
            None => fragment.trim().is_empty() || !self.is_whole(),
            Some(name) if name != self.name => false,
            Some(_) if fragment.trim().is_empty() => !self.arguments.trim().is_empty() && !self.is_whole(),
            Some(_) => !self.is_whole(),
        };
        self.generated && self.server_id.is_empty() && fits
    }
}

/// A call's arguments as their fragments arrive: how deep their brackets are (outside
/// strings), whether the outermost one closed, and whether anything but whitespace came
/// after it (or the text does not start with a bracket at all).
#[derive(Debug, Default)]
struct ArgumentScan {
    depth: u32,
    in_string: bool,
    escaped: bool,
    opened: bool,
    closed: bool,
    /// Text that can make no whole object or array: before the first bracket, or after the
    /// last.
    stray: bool,
    /// Whether the text parsed when its brackets closed.
    parsed: std::sync::OnceLock<bool>,
}

impl ArgumentScan {
    fn feed(&mut self, fragment: &str) {
        for byte in fragment.bytes() {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if byte == b'\\' {
                    self.escaped = true;
                } else if byte == b'"' {
                    self.in_string = false;
                }
                continue;
            }
            if byte.is_ascii_whitespace() {
                continue;
            }
            if self.closed || (!self.opened && byte != b'{' && byte != b'[') {
                self.stray = true;
                continue;
            }
            match byte {
                b'"' => self.in_string = true,
                b'{' | b'[' => {
                    self.opened = true;
                    self.depth += 1;
                }
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    self.closed = self.depth == 0;
                }
                _ => {}
            }
        }
    }

    /// Whether the text may be one whole object or array: its outermost bracket closed and
    /// nothing stray. Only then is it worth parsing.
    fn may_be_whole(&self) -> bool {
        self.closed && !self.stray
    }
}

/// Whether a fragment without index and id that names the tool `name` begins a call after
/// `last` rather than continuing it: a server numbering nothing names each call once, in its
/// first fragment; one that repeats the name repeats the last call's own.
fn starts_another(last: &PartialCall, name: Option<&str>) -> bool {
    match name {
        Some(name) if !last.name.is_empty() => name != last.name || last.is_whole(),
        _ => false,
    }
}

/// Whether a fragment naming `name` and bringing `fragment` opens a call after `last`: it names
/// another tool, or the same one with arguments (more than white space) once `last`'s are
/// whole (a server may repeat a call's name in each of its fragments), or it brings arguments
/// without a name after `last`'s name came again once its arguments were whole
/// (`PartialCall::named_again`; the new call is of that tool).
fn opens_another(last: &PartialCall, name: Option<&str>, fragment: &str) -> bool {
    match name {
        Some(name) if !last.name.is_empty() && name != last.name => true,
        Some(_) => !fragment.trim().is_empty() && starts_another(last, name),
        None => !fragment.trim().is_empty() && last.named_again && last.is_whole(),
    }
}

/// Decodes `chat.completion.chunk` events.
struct ChatDecoder {
    ctx: CallContext,
    text: String,
    reasoning: String,
    calls: Vec<PartialCall>,
    /// Provider `tool_calls[].index` → position in `calls`.
    slots: HashMap<u64, usize>,
    stop: Option<StopReason>,
    usage: Usage,
    /// Whether a chunk carried `usage` (with `include_usage`, the last chunk before `[DONE]`).
    usage_seen: bool,
    /// Whether `include_usage` was asked for (then the usage chunk ends the answer).
    usage_asked: bool,
    /// Whether a chunk had a choice: a stream that ends without one answered nothing.
    choice_seen: bool,
    /// A choice finished with a `finish_reason` that is no answer: `"error"` (OpenRouter, when
    /// the upstream failed), another failure a server names, or one this build does not know
    /// (see [`stop_reason_named`](super::types::stop_reason_named)).
    failed: Option<String>,
    /// Whether the reasoning is kept to go back with the step.
    reasoning_echo: bool,
    /// OpenRouter's reasoning details so far, built up by their `index`.
    details: Vec<serde_json::Map<String, Value>>,
    /// The detail of each `index` and `type` (as JSON) in `details`.
    details_at: HashMap<(u64, Option<String>), usize>,
    /// The latest call in `calls` under each id (its own or the server's).
    by_id: HashMap<String, usize>,
    /// The ids of the calls started so far.
    started_ids: HashSet<String>,
    /// What the answer brought more of than [`MAX_STREAMED_PARTS`]: it fails.
    too_many: Option<&'static str>,
}

impl ChatDecoder {
    fn new(ctx: CallContext, usage_asked: bool, reasoning_echo: bool) -> Self {
        Self {
            ctx,
            text: String::new(),
            reasoning: String::new(),
            calls: Vec::new(),
            slots: HashMap::new(),
            stop: None,
            usage: Usage::default(),
            usage_seen: false,
            usage_asked,
            choice_seen: false,
            failed: None,
            reasoning_echo,
            details: Vec::new(),
            details_at: HashMap::new(),
            by_id: HashMap::new(),
            started_ids: HashSet::new(),
            too_many: None,
        }
    }

    /// Takes one streamed reasoning detail: a continuation of the detail of its `index` and
    /// `type` (its text, summary or data appended, other fields set), or a new one.
    fn reasoning_detail(&mut self, item: serde_json::Map<String, Value>) {
        let key = item
            .get("index")
            .and_then(Value::as_u64)
            .map(|index| (index, item.get("type").map(Value::to_string)));
        let same = key.as_ref().and_then(|key| self.details_at.get(key)).copied();
        let Some(detail) = same.map(|at| &mut self.details[at]) else {
            if self.details.len() >= MAX_STREAMED_PARTS {
                self.too_many = Some("reasoning details");
                return;
            }
            if let Some(key) = key {
                self.details_at.insert(key, self.details.len());
            }
            self.details.push(item);
            return;
        };
        for (field, value) in item {
            match (field.as_str(), detail.get_mut(&field), value) {
                ("text" | "summary" | "data", Some(Value::String(built)), Value::String(more)) => built.push_str(&more),
                (_, _, Value::Null) => {}
                (_, _, value) => {
                    detail.insert(field, value);
                }
            }
        }
    }

    /// Reads one chunk; returns whether it moved the answer on (an output, a tool call's or a
    /// reasoning detail's fragment, usage or a finish reason). A chunk that moved nothing is a
    /// keep-alive: gateways relay an upstream's pings as `{"type":"ping"}` or as a choice with
    /// an empty delta, and these must not hold a stalled stream open past the keep-alive limit.
    fn chunk(&mut self, chunk: ChunkView<'_>, out: &mut VecDeque<StreamEvent>) -> bool {
        let before = out.len();
        let mut moved = chunk.usage.is_some();
        if let Some(usage) = chunk.usage {
            self.usage = usage_of(&usage);
            self.usage_seen = true;
        }
        let Some(choice) = chunk.choice.0 else { return moved };
        self.choice_seen = true;
        if let Some(delta) = choice.delta {
            moved |= delta.tool_calls.as_ref().is_some_and(|calls| !calls.is_empty())
                || delta
                    .reasoning_details
                    .as_ref()
                    .is_some_and(|details| !details.is_empty());
            if let Some(text) = delta.content.as_ref().map(Text::as_str).filter(|t| !t.is_empty()) {
                self.text.push_str(text);
                out.push_back(StreamEvent::TextDelta(text.to_owned()));
            }
            let reasoning = [&delta.reasoning, &delta.reasoning_content]
                .into_iter()
                .find_map(|text| text.as_ref().map(Text::as_str).filter(|t| !t.is_empty()));
            if let Some(reasoning) = reasoning {
                self.reasoning.push_str(reasoning);
                out.push_back(StreamEvent::ReasoningDelta(reasoning.to_owned()));
            }
            for call in delta.tool_calls.into_iter().flatten() {
                if self.too_many.is_some() {
                    return true;
                }
                self.tool_call(call, out);
            }
            for detail in delta.reasoning_details.into_iter().flatten() {
                if self.too_many.is_some() {
                    return true;
                }
                self.reasoning_detail(detail);
            }
        }
        // An empty reason is none: servers that write `""` on every chunk (Ollama, some
        // SGLang releases) have not finished yet.
        if let Some(reason) = choice.finish_reason.filter(|reason| !reason.as_str().trim().is_empty()) {
            moved = true;
            match super::types::stop_reason_named(reason.as_str()) {
                Some(stop) => self.stop = Some(stop),
                None => {
                    self.failed.get_or_insert_with(|| reason.as_str().to_owned());
                    self.stop = Some(StopReason::Stop);
                }
            }
        }
        moved || out.len() > before
    }

    /// Fails the stream once a choice finished with a `finish_reason` that is no answer
    /// (`"error"`: OpenRouter ends so when the upstream failed mid-way): what it said is not the
    /// answer, and the call may be made again. Otherwise the chunk continues the answer, or
    /// keeps the stream alive when it did not `move` it.
    fn failed_finish(&self, moved: bool) -> Result<Flow, ProviderError> {
        if let Some(what) = self.too_many {
            return Err(ProviderError::new(
                ProviderErrorKind::InvalidResponse,
                format!(
                    "[flue] Provider \"{}\" streamed more than {MAX_STREAMED_PARTS} {what} in one answer.",
                    self.ctx.provider
                ),
            ));
        }
        match &self.failed {
            None if moved => Ok(Flow::Continue),
            None => Ok(Flow::KeepAlive),
            Some(reason) => Err(super::types::failed_finish(&self.ctx.provider, "finish_reason", reason)),
        }
    }

    fn tool_call(&mut self, call: CallView<'_>, out: &mut VecDeque<StreamEvent>) {
        let id = call.id.as_ref().map(Text::as_str).filter(|id| !id.is_empty());
        let (name, fragment) = match &call.function {
            Some(function) => (
                function.name.as_ref().map(Text::as_str).filter(|n| !n.is_empty()),
                function.arguments.as_ref().map_or("", Text::as_str),
            ),
            None => (None, ""),
        };
        let slot = match call.index {
            Some(index) => match self.slots.get(&index) {
                // A known index, unless a new call reuses it (servers that number every call
                // 0): a fragment that opens another call (it names a tool and brings arguments
                // once that call's are whole) starts one, whatever its id. A fragment with
                // another id also starts one when it names a tool (unless the
                // call's id was made up here and the name is the call's own: the server's id
                // for it, arriving late), or when the call's arguments are already whole JSON;
                // without a name it continues the call otherwise.
                // (A fragment without a name opens a call of the one it follows only under that
                // call's id, or none: under another id it is the next rule's.)
                Some(&slot)
                    if opens_another(&self.calls[slot], name, fragment)
                        && (name.is_some()
                            || id.is_none_or(|id| self.calls[slot].id == id || self.calls[slot].server_id == id)) =>
                {
                    let slot = self.new_call_after(slot, name);
                    self.slots.insert(index, slot);
                    slot
                }
                Some(&slot)
                    if id.is_none_or(|id| {
                        let call = &self.calls[slot];
                        let same_name = name.is_none_or(|name| call.name.is_empty() || call.name == name);
                        call.id.is_empty()
                            || call.id == id
                            || call.server_id == id
                            || (call.generated && same_name)
                            || (name.is_none() && !call.is_whole())
                    }) =>
                {
                    slot
                }
                _ => {
                    let slot = self.new_call();
                    self.slots.insert(index, slot);
                    slot
                }
            },
            // By id: the latest call under it (two calls of a step may share one), unless this
            // fragment opens another (it names a tool and brings arguments once that call's
            // are whole).
            None => match id.and_then(|id| self.by_id.get(id).copied()) {
                Some(slot) if opens_another(&self.calls[slot], name, fragment) => self.new_call_after(slot, name),
                Some(slot) => slot,
                // Neither index nor id: a fragment continues the last call, unless it opens
                // another (the same rule).
                None if id.is_none() && !self.calls.is_empty() => {
                    let last = self.calls.len() - 1;
                    if opens_another(&self.calls[last], name, fragment) {
                        self.new_call_after(last, name)
                    } else {
                        last
                    }
                }
                // An id not seen before, after a call named before any id came (its id made up
                // here): the server's id for that call, arriving late, unless the fragment
                // names another tool or brings arguments once the call's are whole. Later
                // fragments under it find the call by it.
                None => match (id, self.calls.len().checked_sub(1)) {
                    (Some(id), Some(last)) if self.calls[last].takes_late_id(name, fragment) => {
                        self.calls[last].server_id = id.to_owned();
                        note_id(&mut self.by_id, id, last);
                        last
                    }
                    _ => self.new_call(),
                },
            },
        };
        let entry = &mut self.calls[slot];
        if entry.started
            && name.is_some_and(|name| name == entry.name)
            && fragment.trim().is_empty()
            && entry.is_whole()
        {
            entry.named_again = true;
        }
        if let Some(id) = id.filter(|_| entry.id.is_empty()) {
            entry.id = id.to_owned();
            note_id(&mut self.by_id, id, slot);
        }
        if let Some(name) = name.filter(|_| entry.name.is_empty()) {
            entry.name = name.to_owned();
        }
        // A server that gives two calls of one step the same id (every call `call_0`, say):
        // the later one gets an id of its own, else both results would answer the first call.
        let taken =
            !entry.started && !entry.name.is_empty() && !entry.id.is_empty() && self.started_ids.contains(&entry.id);
        if taken {
            entry.server_id = std::mem::replace(&mut entry.id, format!("call_{}", ulid::Ulid::new()));
            note_id(&mut self.by_id, &entry.id, slot);
        }
        entry.push_arguments(fragment);
        if entry.started {
            if !fragment.is_empty() {
                out.push_back(StreamEvent::ToolCallArguments {
                    index: slot,
                    delta: fragment.to_owned(),
                });
            }
        } else if !entry.name.is_empty() {
            if entry.id.is_empty() {
                entry.id = format!("call_{}", ulid::Ulid::new());
                entry.generated = true;
                note_id(&mut self.by_id, &entry.id, slot);
            }
            entry.started = true;
            self.started_ids.insert(entry.id.clone());
            out.push_back(StreamEvent::ToolCallStarted {
                index: slot,
                id: entry.id.clone(),
                name: entry.name.clone(),
            });
            if !entry.arguments.is_empty() {
                out.push_back(StreamEvent::ToolCallArguments {
                    index: slot,
                    delta: entry.arguments.clone(),
                });
            }
        }
    }

    fn new_call(&mut self) -> usize {
        if self.calls.len() >= MAX_STREAMED_PARTS {
            // The chunk's other calls are not read, and the answer fails after it.
            self.too_many = Some("tool calls");
        }
        self.calls.push(PartialCall::default());
        self.calls.len() - 1
    }

    /// Starts the call a fragment opens after the one at `prev` (`opens_another`): without a
    /// name of its own it is a call of `prev`'s tool, whose name came again to open it.
    fn new_call_after(&mut self, prev: usize, name: Option<&str>) -> usize {
        let slot = self.new_call();
        if name.is_none() {
            self.calls[slot].name = self.calls[prev].name.clone();
        }
        slot
    }

    fn complete(&mut self, out: &mut VecDeque<StreamEvent>) -> Result<(), ProviderError> {
        // Without a finish reason, a call whose arguments are not whole JSON was cut short (a
        // proxy that ends the stream with `[DONE]` when its upstream failed): the answer is
        // not complete, and the call may be made again.
        let cut = |call: &PartialCall| {
            !call.arguments.trim().is_empty() && serde_json::from_str::<serde::de::IgnoredAny>(&call.arguments).is_err()
        };
        if self.stop.is_none() && self.calls.iter().any(cut) {
            return Err(ended_early(&self.ctx));
        }
        if let Some(index) = self.calls.iter().position(|c| !c.started) {
            return Err(ProviderError::new(
                ProviderErrorKind::InvalidResponse,
                format!(
                    "[flue] Provider \"{}\" streamed tool call {index} without a name.",
                    self.ctx.provider
                ),
            ));
        }
        let tool_calls: Vec<ModelToolCall> = std::mem::take(&mut self.calls)
            .into_iter()
            .map(|call| ModelToolCall {
                id: call.id,
                name: call.name,
                arguments: if call.arguments.trim().is_empty() {
                    "{}".to_owned()
                } else {
                    call.arguments
                },
            })
            .collect();
        let stop_reason = match self.stop {
            // Some compatible servers say `stop` after tool calls.
            Some(StopReason::Stop) | None if !tool_calls.is_empty() => StopReason::ToolUse,
            Some(reason) => reason,
            None => StopReason::Stop,
        };
        let mut reasoning_blocks = if self.reasoning_echo && !self.reasoning.is_empty() {
            vec![ReasoningBlock::Text {
                text: self.reasoning.clone(),
            }]
        } else {
            Vec::new()
        };
        reasoning_blocks.extend(
            std::mem::take(&mut self.details)
                .into_iter()
                .map(|detail| ReasoningBlock::Detail { detail }),
        );
        out.push_back(StreamEvent::Completed(ModelResponse {
            text: std::mem::take(&mut self.text),
            reasoning: std::mem::take(&mut self.reasoning),
            reasoning_blocks,
            tool_calls,
            stop_reason,
            usage: self.usage,
        }));
        Ok(())
    }
}

/// Notes that the call at `slot` goes by `id`: the latest call under an id is the one its
/// fragments without an index continue.
fn note_id(by_id: &mut HashMap<String, usize>, id: &str, slot: usize) {
    match by_id.get_mut(id) {
        Some(latest) => *latest = (*latest).max(slot),
        None => {
            by_id.insert(id.to_owned(), slot);
        }
    }
}

fn usage_of(usage: &UsageView) -> Usage {
    let prompt = usage.prompt_tokens_details.as_ref();
    Usage {
        input_tokens: usage.prompt_tokens.unwrap_or(0),
        output_tokens: usage.completion_tokens.unwrap_or(0),
        cache_read_tokens: prompt.and_then(|d| d.cached_tokens).unwrap_or(0),
        cache_write_tokens: prompt.and_then(|d| d.cache_write_tokens).unwrap_or(0),
        reasoning_tokens: usage
            .completion_tokens_details
            .as_ref()
            .and_then(|d| d.reasoning_tokens)
            .unwrap_or(0),
    }
}

impl SseDecoder for ChatDecoder {
    fn event(&mut self, event: &Event<'_>, out: &mut VecDeque<StreamEvent>) -> Result<Flow, ProviderError> {
        let data = event.data.trim();
        if data == "[DONE]" {
            if !self.choice_seen {
                // Nothing was answered: an error the server reported some other way (or none).
                return Err(ended_early(&self.ctx));
            }
            self.complete(out)?;
            return Ok(Flow::Done);
        }
        if data.is_empty() {
            return Ok(Flow::KeepAlive);
        }
        // Before any parse of it: the error event's, the typed chunk's and the `Value` one's.
        check_event_shape(&self.ctx, data)?;
        if event.event == "error" {
            return Err(error_event(&self.ctx, data));
        }
        if let Some(chunk) = ChunkView::parse(data) {
            let moved = self.chunk(chunk, out);
            return self.failed_finish(moved);
        }
        let chunk = parse_event_json(&self.ctx, data)?;
        if let Some(error) = chunk.get("error").filter(|e| !e.is_null()) {
            return Err(map_error(
                &self.ctx,
                None,
                None,
                &ErrorDetails::from_value(error),
                &error.to_string(),
            ));
        }
        let moved = self.chunk(ChunkView::from_value(&chunk), out);
        self.failed_finish(moved)
    }

    fn end(&mut self, out: &mut VecDeque<StreamEvent>) -> Result<(), ProviderError> {
        // Without `[DONE]`, the answer is whole once both the finish reason and the usage chunk
        // (requested with `include_usage`, sent after the finish reason) arrived.
        if self.stop.is_some() && (self.usage_seen || !self.usage_asked) {
            self.complete(out)
        } else {
            Err(ended_early(&self.ctx))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::types::ToolSpec;
    use serde_json::json;

    #[test]
    fn debug_of_the_provider_shows_neither_its_key_nor_its_base_url_secrets() {
        let provider =
            OpenAiProvider::compatible("p", "https://user:hunter2@127.0.0.1:1/v1?key=hunter2#hunter2", "P_KEY")
                .with_api_key("sk-hunter2-0123456789");
        // The endpoint, parsed at the first call, is part of the provider's Debug too.
        assert!(provider.endpoint.url(&provider.base_url, "chat/completions").is_ok());
        let debug = format!("{provider:?}");
        assert!(!debug.contains("hunter2"), "{debug}");
        assert!(debug.contains("https://127.0.0.1:1/v1"), "{debug}");
    }

    fn request(model: &str, level: ThinkingLevel) -> ModelRequest {
        ModelRequest {
            model: model.to_owned(),
            system: None,
            messages: vec![ModelMessage::user("hi")].into(),
            tools: vec![ToolSpec {
                name: "t".into(),
                description: "d".into(),
                parameters: Arc::new(json!({"type": "object"})),
            }],
            thinking_level: level,
            max_output_tokens: None,
            max_retries: None,
        }
    }

    #[test]
    fn tool_arguments_that_are_not_a_json_object_go_back_as_an_empty_object() {
        let mut call = request("gpt-5", ThinkingLevel::Off);
        for (id, arguments) in [
            ("whole", "{\"a\":1}"),
            ("cut", "{\"a\":"),
            ("empty", ""),
            ("array", "[1]"),
        ] {
            call.messages.push(ModelMessage::Assistant {
                text: String::new(),
                tool_calls: vec![crate::provider::ModelToolCall {
                    id: id.into(),
                    name: "t".into(),
                    arguments: arguments.into(),
                }],
                reasoning: Vec::new(),
            });
            call.messages.push(ModelMessage::Tool {
                tool_call_id: id.into(),
                name: "t".into(),
                content: "ok".into(),
                is_error: false,
            });
        }
        let body = OpenAiProvider::openai().body(&call);
        let sent: Vec<&str> = body["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .filter_map(|message| message["tool_calls"][0]["function"]["arguments"].as_str())
            .collect();
        assert_eq!(sent, ["{\"a\":1}", "{}", "{}", "{}"]);
    }

    /// A step that said nothing and called nothing is not sent: servers refuse an assistant
    /// message with neither content nor calls.
    #[test]
    fn an_empty_step_is_left_out_of_the_body() {
        let mut call = request("gpt-5", ThinkingLevel::Off);
        call.system = Some("Be brief.".into());
        call.messages.push(ModelMessage::Assistant {
            text: " ".into(),
            tool_calls: Vec::new(),
            reasoning: Vec::new(),
        });
        call.messages.push(ModelMessage::user("again?"));
        let body = OpenAiProvider::openai().body(&call);
        let roles: Vec<&str> = body["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(|message| message["role"].as_str().expect("a role"))
            .collect();
        assert_eq!(roles, ["system", "user", "user"]);
    }

    #[test]
    fn a_body_is_the_same_whether_its_history_was_encoded_before_or_not() {
        let provider = OpenAiProvider::openai();
        let mut warm = request("gpt-5", ThinkingLevel::Off);
        warm.system = Some("Be brief.".into());
        let mut bodies = Vec::new();
        for turn in 0..3 {
            bodies.push(provider.body_bytes(&warm).expect("a body"));
            warm.messages.push(ModelMessage::Assistant {
                text: String::new(),
                tool_calls: vec![crate::provider::ModelToolCall {
                    id: format!("call_{turn}"),
                    name: "t".into(),
                    arguments: "{\"a\":1}".into(),
                }],
                reasoning: Vec::new(),
            });
            warm.messages.push(ModelMessage::Tool {
                tool_call_id: format!("call_{turn}"),
                name: "t".into(),
                content: "\"quoted\" ✓".into(),
                is_error: false,
            });
        }
        let mut cold = warm.clone();
        cold.messages = warm.messages.to_vec().into();
        let (warm, cold) = (
            provider.body_bytes(&warm).expect("a body"),
            provider.body_bytes(&cold).expect("a body"),
        );
        let (warm, cold) = (warm.to_vec(), cold.to_vec());
        assert_eq!(warm, cold, "byte for byte");
        let body: Value = serde_json::from_slice(&warm).expect("JSON");
        assert_eq!(body["messages"].as_array().map(Vec::len), Some(8));
        assert_eq!(body["messages"][0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(body["model"], "gpt-5");
        let first: Value = serde_json::from_slice(&bodies[0].to_vec()).expect("JSON");
        assert_eq!(first["messages"].as_array().map(Vec::len), Some(2));
    }

    #[test]
    fn reasoning_parameters_follow_the_flavour_and_level() {
        let openai = OpenAiProvider::openai();
        let body = openai.body(&request("o4-mini", ThinkingLevel::Max));
        assert_eq!(body["reasoning_effort"], "high");
        let body = openai.body(&request("gpt-4o-mini", ThinkingLevel::High));
        assert!(body.get("reasoning_effort").is_none());
        // Off is the least effort a reasoning model takes (nothing would leave it at medium).
        let body = openai.body(&request("gpt-5", ThinkingLevel::Off));
        assert_eq!(body["reasoning_effort"], "minimal");
        let router = OpenAiProvider::openrouter();
        let body = router.body(&request("anthropic/claude-sonnet-4.5", ThinkingLevel::Minimal));
        assert_eq!(body["reasoning"], json!({"effort": "minimal"}));
        assert!(body.get("reasoning_effort").is_none());
        // Off is `none`, but not to an OpenAI model that cannot stop reasoning (it refuses
        // `none`), nor to one that takes no reasoning parameter.
        let off = |model: &str| {
            router
                .body(&request(model, ThinkingLevel::Off))
                .get("reasoning")
                .cloned()
        };
        assert_eq!(off("anthropic/claude-sonnet-4.5"), Some(json!({"effort": "none"})));
        assert_eq!(off("openai/gpt-5.1"), Some(json!({"effort": "none"})));
        assert_eq!(off("openai/gpt-5"), Some(json!({"effort": "minimal"})));
        assert_eq!(off("openai/o3"), Some(json!({"effort": "low"})));
        assert_eq!(off("openai/gpt-5:online"), Some(json!({"effort": "minimal"})));
        assert_eq!(off("openai/gpt-4o"), None);
        let body = router.body(&request("openai/gpt-5", ThinkingLevel::Max));
        assert_eq!(body["reasoning"], json!({"effort": "xhigh"}));
    }

    #[test]
    fn openai_sends_an_effort_only_to_models_that_take_it_and_minimal_as_low_where_refused() {
        let openai = OpenAiProvider::openai();
        let cases = [
            ("gpt-5", ThinkingLevel::Minimal, Some("minimal")),
            ("gpt-5-mini", ThinkingLevel::Medium, Some("medium")),
            ("gpt-5.1", ThinkingLevel::Minimal, Some("low")),
            ("gpt-5.2-codex", ThinkingLevel::Minimal, Some("low")),
            ("gpt-5.1", ThinkingLevel::High, Some("high")),
            ("o3", ThinkingLevel::Minimal, Some("low")),
            ("o4-mini-2025-04-16", ThinkingLevel::Minimal, Some("low")),
            ("o1", ThinkingLevel::High, Some("high")),
            ("o1-mini", ThinkingLevel::High, None),
            ("o1-preview", ThinkingLevel::High, None),
            ("gpt-5-chat-latest", ThinkingLevel::High, None),
            ("ft:gpt-4o-mini-2024-07-18:org::abc", ThinkingLevel::High, None),
            ("ft:o4-mini-2025-04-16:org::abc", ThinkingLevel::Low, Some("low")),
            ("chatgpt-4o-latest", ThinkingLevel::High, None),
            // Off: the least each takes, nothing where none is taken or known.
            ("gpt-5", ThinkingLevel::Off, Some("minimal")),
            ("gpt-5-nano", ThinkingLevel::Off, Some("minimal")),
            ("gpt-5.1", ThinkingLevel::Off, None),
            ("gpt-5.2-codex", ThinkingLevel::Off, None),
            ("gpt-5.1-chat-latest", ThinkingLevel::High, None),
            ("gpt-5.2-chat-latest", ThinkingLevel::Off, None),
            ("o3", ThinkingLevel::Off, Some("low")),
            ("gpt-5-chat-latest", ThinkingLevel::Off, None),
            ("gpt-4.1", ThinkingLevel::Off, None),
            ("my-finetune", ThinkingLevel::Off, None),
        ];
        for (model, level, want) in cases {
            let body = openai.body(&request(model, level));
            assert_eq!(
                body.get("reasoning_effort").and_then(Value::as_str),
                want,
                "{model} {level:?}"
            );
        }
    }

    #[test]
    fn reasoning_is_echoed_by_default_only_to_deepseek() {
        let deepseek = OpenAiProvider::compatible("deepseek", "https://api.deepseek.com/v1", "DEEPSEEK_API_KEY");
        assert!(deepseek.echoes_reasoning());
        assert!(!deepseek.clone().with_reasoning_echo(false).echoes_reasoning());
        let moved =
            OpenAiProvider::compatible("d", "http://127.0.0.1:1/v1", "D_KEY").with_base_url("https://api.deepseek.com");
        assert!(moved.echoes_reasoning());
        assert!(
            !moved
                .with_reasoning_echo(false)
                .with_base_url("https://api.deepseek.com/v1")
                .echoes_reasoning()
        );
        let away = OpenAiProvider::compatible("d", "https://api.deepseek.com/v1", "D_KEY")
            .with_base_url("http://127.0.0.1:1/v1");
        assert!(!away.echoes_reasoning());
        // The host as URLs compare it: case-blind, without the port.
        assert!(OpenAiProvider::compatible("d", "https://API.DeepSeek.com:443/v1", "D_KEY").echoes_reasoning());
        for other in [
            "https://api.groq.com/openai/v1",
            "https://api.deepseek.com.evil.test/v1",
            "http://localhost:11434/v1",
        ] {
            assert!(
                !OpenAiProvider::compatible("x", other, "X_KEY").echoes_reasoning(),
                "{other}"
            );
        }
        assert!(!OpenAiProvider::openrouter().echoes_reasoning());
    }

    #[test]
    fn a_compatible_server_gets_an_effort_only_when_asked_and_the_cap_as_max_tokens() {
        let mut call = request("llama3.2", ThinkingLevel::Medium);
        call.max_output_tokens = Some(500);
        let compatible = OpenAiProvider::compatible("local", "http://127.0.0.1:1/v1", "LOCAL_KEY");
        let body = compatible.body(&call);
        assert_eq!(body.get("reasoning_effort"), None);
        assert_eq!(
            (body["max_tokens"].clone(), body.get("max_completion_tokens")),
            (json!(500), None)
        );
        assert_eq!(body["stream_options"], json!({"include_usage": true}));
        let asked = compatible.with_reasoning_effort(true).with_stream_usage(false);
        let body = asked.body(&call);
        assert_eq!(body["reasoning_effort"], "medium");
        assert_eq!(body.get("stream_options"), None);
        // OpenAI itself takes `max_completion_tokens`; OpenRouter `max_tokens`.
        let body = OpenAiProvider::openai().body(&call);
        assert_eq!(
            (body["max_completion_tokens"].clone(), body.get("max_tokens")),
            (json!(500), None)
        );
        assert_eq!(OpenAiProvider::openrouter().body(&call)["max_tokens"], 500);
    }

    #[test]
    fn the_body_buffer_starts_near_the_size_of_the_body() {
        let mut long = request("gpt-5", ThinkingLevel::Off);
        long.system = Some("You add numbers with the add tool.".repeat(10));
        for turn in 0..200 {
            long.messages
                .make_mut()
                .push(ModelMessage::user(format!("what is {turn} + 2?")));
            long.messages.push(ModelMessage::Assistant {
                text: String::new(),
                tool_calls: vec![crate::provider::ModelToolCall {
                    id: format!("call_{turn}"),
                    name: "add".into(),
                    arguments: format!("{{\"a\":{turn},\"b\":2}}"),
                }],
                reasoning: Vec::new(),
            });
            long.messages.push(ModelMessage::Tool {
                tool_call_id: format!("call_{turn}"),
                name: "add".into(),
                content: (turn + 2).to_string(),
                is_error: false,
            });
            long.messages.push(ModelMessage::Assistant {
                text: format!("{turn} + 2 = {}", turn + 2),
                tool_calls: Vec::new(),
                reasoning: Vec::new(),
            });
        }
        let provider = OpenAiProvider::openai();
        // The tools' declarations are encoded once per provider: the hint counts them exactly.
        let unshared = ModelRequest {
            messages: long.messages.to_vec().into(),
            ..long.clone()
        };
        provider.body_bytes(&unshared).expect("a body");
        let tools = provider
            .tools
            .declarations(&long.tools, |_| unreachable!("encoded by body_bytes"))
            .expect("cached declarations");
        let system = long.system.as_deref().map_or(0, str::len);
        for call in ["first", "next"] {
            let (head, tail) = long.body_size_hint(provider.echo().format(), tools.encoded_len());
            let body = provider.body_bytes(&long).expect("a body");
            let parts = body.parts();
            assert!(
                parts.len() >= 3,
                "{call}: the history is shared, between the head and the rest"
            );
            let (first, last) = (parts[0].len(), parts[parts.len() - 1].len());
            // Neither buffer grows while it is written (the system prompt and the tools'
            // schemas, most of their bytes, are counted exactly)...
            assert!(first <= head + system, "{call}: head {head} + {system} for {first}");
            assert!(last <= tail, "{call}: rest {tail} for {last}");
            // ...and the next call's is not twice the size it needs: it counts no kept message.
            if call == "next" {
                assert!(head + system <= 2 * first, "{call}: head {head} + {system} for {first}");
                assert!(tail <= 2 * last, "{call}: rest {tail} for {last}");
            }
        }
    }

    #[test]
    fn a_user_message_with_images_is_sent_as_content_parts() {
        let mut with_image = request("gpt-5", ThinkingLevel::Off);
        with_image.messages = vec![ModelMessage::User {
            content: "What is this?".into(),
            images: vec![crate::provider::ModelImage {
                media_type: "image/png".into(),
                data: "iVBORw0K".into(),
            }],
        }]
        .into();
        let body = OpenAiProvider::openai().body(&with_image);
        assert_eq!(
            body["messages"][0],
            json!({"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}},
            ]})
        );
        let plain = OpenAiProvider::openai().body(&request("gpt-5", ThinkingLevel::Off));
        assert_eq!(plain["messages"][0], json!({"role": "user", "content": "hi"}));
    }

    /// Feeds `chunks` (event data) to a decoder, then ends the body; the completion or the error.
    fn decode(chunks: &[&str], end: bool) -> Result<Option<ModelResponse>, ProviderErrorKind> {
        let mut decoder = ChatDecoder::new(CallContext::new("fixture", "KEY", "m", None), true, false);
        let mut out = VecDeque::new();
        for data in chunks {
            let event = Event {
                data,
                ..Event::default()
            };
            if decoder.event(&event, &mut out).map_err(|e| e.kind)? == Flow::Done {
                break;
            }
        }
        if end {
            decoder.end(&mut out).map_err(|e| e.kind)?;
        }
        Ok(out.into_iter().find_map(|event| match event {
            StreamEvent::Completed(response) => Some(response),
            _ => None,
        }))
    }

    #[test]
    fn a_stream_done_without_a_finish_reason_and_with_cut_arguments_ended_early() {
        let start = r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","function":{"name":"lookup","arguments":"{\"q\":"}}]}}]}"#;
        assert_eq!(decode(&[start, "[DONE]"], false), Err(ProviderErrorKind::Network));
        // Whole arguments complete the answer, with or without a finish reason.
        let whole = r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","function":{"name":"lookup","arguments":"{\"q\":1}"}}]}}]}"#;
        let response = decode(&[whole, "[DONE]"], false).expect("decodes").expect("completes");
        assert_eq!(response.tool_calls[0].arguments, r#"{"q":1}"#);
    }

    /// A server that writes `"finish_reason": ""` on its chunks (Ollama, some SGLang
    /// releases) has not finished with them: its answer completes at its real reason, or at
    /// `[DONE]` when the last is empty too.
    #[test]
    fn an_empty_finish_reason_is_no_reason() {
        let part = |text: &str, reason: &str| {
            format!(r#"{{"choices":[{{"index":0,"delta":{{"content":"{text}"}},"finish_reason":"{reason}"}}]}}"#)
        };
        let (first, second) = (part("Hel", ""), part("lo", " "));
        let stopped = part("", "stop");
        let response = decode(&[&first, &second, &stopped, "[DONE]"], false)
            .expect("decodes")
            .expect("completes");
        assert_eq!(
            (response.text.as_str(), response.stop_reason),
            ("Hello", StopReason::Stop)
        );
        let response = decode(&[&first, &second, "[DONE]"], false)
            .expect("decodes")
            .expect("completes");
        assert_eq!(
            (response.text.as_str(), response.stop_reason),
            ("Hello", StopReason::Stop)
        );
    }

    /// A relay that cut a delta inside an emoji (JavaScript writes each half as a lone `\u`
    /// escape) costs the answer that character, not the call.
    #[test]
    fn a_lone_surrogate_escape_reads_as_a_replacement_character() {
        let part = |text: &str| format!(r#"{{"choices":[{{"index":0,"delta":{{"content":"{text}"}}}}]}}"#);
        let (first, second) = (part(r"ok \ud83d"), part(r"\ude00 done"));
        let stopped = r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#;
        let response = decode(&[&first, &second, stopped, "[DONE]"], false)
            .expect("decodes")
            .expect("completes");
        assert_eq!(response.text, "ok \u{fffd}\u{fffd} done");
    }

    /// An answer streaming tool calls or reasoning details without end fails as an invalid
    /// response once past [`MAX_STREAMED_PARTS`] of them, spread over many events or in one;
    /// continuations of the ones it has do not count.
    #[test]
    fn an_answer_past_the_most_tool_calls_or_reasoning_details_fails() {
        let calls = |from: usize, count: usize| {
            let calls: Vec<String> = (from..from + count)
                .map(|i| format!(r#"{{"index":{i},"id":"c{i}","function":{{"name":"f","arguments":"{{}}"}}}}"#))
                .collect();
            format!(
                r#"{{"choices":[{{"index":0,"delta":{{"tool_calls":[{}]}}}}]}}"#,
                calls.join(",")
            )
        };
        let details = |from: usize, count: usize| {
            let details: Vec<String> = (from..from + count)
                .map(|i| format!(r#"{{"type":"reasoning.text","index":{i},"text":"t"}}"#))
                .collect();
            format!(
                r#"{{"choices":[{{"index":0,"delta":{{"reasoning_details":[{}]}}}}]}}"#,
                details.join(",")
            )
        };
        let finish = r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#;
        let usage = r#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}"#;
        // Continuations of the first: no more parts.
        let call_again =
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":""}}]}}]}"#;
        let detail_again = details(0, 1);
        for (parts, again) in [
            (&calls as &dyn Fn(usize, usize) -> String, call_again),
            (&details, detail_again.as_str()),
        ] {
            let at_most: Vec<String> = (0..MAX_STREAMED_PARTS / 512).map(|n| parts(n * 512, 512)).collect();
            let mut events: Vec<&str> = at_most.iter().map(String::as_str).collect();
            events.extend([again, finish, usage, "[DONE]"]);
            assert!(decode(&events, false).expect("at the bound").is_some());
            let one_more = parts(MAX_STREAMED_PARTS, 1);
            events.insert(events.len() - 3, &one_more);
            assert_eq!(decode(&events, false), Err(ProviderErrorKind::InvalidResponse));
            let all_in_one = parts(0, MAX_STREAMED_PARTS + 1000);
            assert_eq!(decode(&[&all_in_one], false), Err(ProviderErrorKind::InvalidResponse));
        }
    }

    /// Every parse of an event comes after its shape is counted: an `error` event, a chunk
    /// the typed view reads (its `reasoning_details` and `tool_calls` are lists of any length)
    /// and one it does not.
    #[test]
    fn events_past_the_json_limits_fail_the_call_before_any_parse_of_them() {
        let objects = |count: usize| vec!["{}"; count].join(",");
        let past = crate::MAX_JSON_CONTAINERS;
        let feed = |event: &str, data: &str| {
            let mut decoder = ChatDecoder::new(CallContext::new("fixture", "KEY", "m", None), true, false);
            decoder
                .event(&Event { event, data }, &mut VecDeque::new())
                .map_err(|error| (error.kind, error.message))
        };
        for (event, data) in [
            ("error", format!("[{}]", objects(past))),
            (
                "",
                format!(
                    r#"{{"choices":[{{"index":0,"delta":{{"reasoning_details":[{}]}}}}]}}"#,
                    objects(past)
                ),
            ),
            (
                "",
                format!(
                    r#"{{"choices":[{{"index":0,"delta":{{"tool_calls":[{}]}}}}]}}"#,
                    objects(past)
                ),
            ),
        ] {
            let (kind, message) = feed(event, &data).expect_err("past the limits");
            assert_eq!(kind, ProviderErrorKind::InvalidResponse, "{message}");
            assert!(
                message.contains("more than 100000 JSON objects and arrays"),
                "{message}"
            );
        }
        // At the limit the same chunk is read (seven containers besides the list's elements:
        // one detail holding them, as more details than `MAX_STREAMED_PARTS` fail the call).
        let at = format!(
            r#"{{"choices":[{{"index":0,"delta":{{"reasoning_details":[{{"data":[{}]}}]}}}}]}}"#,
            objects(past - 7)
        );
        assert_eq!(feed("", &at).ok(), Some(Flow::Continue));
    }

    /// The scan says a call's arguments may be whole only once their outermost bracket closed
    /// with nothing stray around it: brackets and quotes inside strings do not count.
    #[test]
    fn argument_scan_finds_the_close_of_the_outermost_bracket_outside_strings() {
        let scan = |fragments: &[&str]| {
            let mut call = PartialCall::default();
            for fragment in fragments {
                call.push_arguments(fragment);
            }
            (call.scan.may_be_whole(), call.is_whole())
        };
        assert_eq!(scan(&[r#"{"q":"#, r#""a}\"]" }"#]), (true, true));
        assert_eq!(
            scan(&[r#"{"q":{"#, r#""r":[1,2]}"#]),
            (false, false),
            "one bracket still open"
        );
        assert_eq!(scan(&[r#" [1, {"a": "}"}] "#]), (true, true));
        assert_eq!(
            scan(&[r#"{"q":1}"#, r#"{"q":2}"#]),
            (false, false),
            "a second value after the first"
        );
        assert_eq!(scan(&["5"]), (false, false), "not an object or array");
        assert_eq!(scan(&[r#"{"q":}"#]), (true, false), "closed, yet not JSON");
        assert_eq!(
            scan(&[r#"{"q":"\\"}"#]),
            (true, true),
            "an escaped backslash ends before the quote"
        );
    }

    /// A server that names no index and no id but repeats the call's name in every fragment
    /// continues that call until its arguments are whole; the same name after that starts the
    /// next call.
    #[test]
    fn repeated_names_without_index_or_id_continue_a_call_until_its_arguments_close() {
        let fragment = |arguments: &str| {
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"function": {"name": "lookup", "arguments": arguments}}
            ]}}]})
            .to_string()
        };
        let mut chunks: Vec<String> = vec![fragment("{\"q\":\"")];
        chunks.extend((0..2_000).map(|_| fragment("ab")));
        chunks.push(fragment("\"}"));
        chunks.push(fragment("{\"q\":\"next\"}"));
        chunks.push(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#.to_owned());
        chunks.push("[DONE]".to_owned());
        let chunks: Vec<&str> = chunks.iter().map(String::as_str).collect();
        let response = decode(&chunks, false).expect("decodes").expect("completes");
        let arguments: Vec<&str> = response.tool_calls.iter().map(|call| call.arguments.as_str()).collect();
        assert_eq!(
            arguments,
            [
                format!("{{\"q\":\"{}\"}}", "ab".repeat(2_000)).as_str(),
                r#"{"q":"next"}"#
            ]
        );
    }

    /// The same without indices: the fragment that brings the server's id (and the first
    /// arguments) continues the call named before it, and so do later ones under that id.
    /// (Regression: it opened a second, nameless call, and the answer failed as invalid.)
    #[test]
    fn a_call_named_before_its_id_stays_one_call_without_indices() {
        let chunks = [
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"function":{"name":"lookup"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"id":"call_late","function":{"arguments":"{\"q\":"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"id":"call_late","function":{"arguments":"1}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"id":"call_next","function":{"name":"fetch","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            "[DONE]",
        ];
        let response = decode(&chunks, false).expect("decodes").expect("completes");
        let calls: Vec<_> = response
            .tool_calls
            .iter()
            .map(|call| (call.name.as_str(), call.arguments.as_str()))
            .collect();
        assert_eq!(calls, [("lookup", "{\"q\":1}"), ("fetch", "{}")]);
        assert_eq!(response.tool_calls[1].id, "call_next");
    }

    /// The shape that stays ambiguous without indices: a call named without an id and
    /// without arguments, then a fragment under a new id naming the same tool, again without
    /// arguments. Taken for two calls of a tool that takes none (not the first call's late id).
    #[test]
    fn two_calls_of_a_tool_without_arguments_stay_two_without_indices() {
        let chunks = [
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"function":{"name":"ping","arguments":""}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"id":"call_2","function":{"name":"ping","arguments":""}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            "[DONE]",
        ];
        let response = decode(&chunks, false).expect("decodes").expect("completes");
        let names: Vec<_> = response.tool_calls.iter().map(|call| call.name.as_str()).collect();
        assert_eq!(names, ["ping", "ping"]);
        assert_eq!(response.tool_calls[1].id, "call_2");
    }

    #[test]
    fn a_call_named_before_the_server_gives_its_id_stays_one_call() {
        let chunks = [
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"lookup"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_late","function":{"arguments":"{\"q\":"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"1}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            "[DONE]",
        ];
        let response = decode(&chunks, false).expect("decodes").expect("completes");
        assert_eq!(response.tool_calls.len(), 1, "{:?}", response.tool_calls);
        let call = &response.tool_calls[0];
        assert_eq!((call.name.as_str(), call.arguments.as_str()), ("lookup", "{\"q\":1}"));
        // The id its start reported (made up before the server's arrived) stays its id.
        assert!(call.id.starts_with("call_"), "{}", call.id);
    }

    #[test]
    fn openrouter_reasoning_details_are_built_up_by_index_and_sent_back_with_their_step() {
        let chunks = [
            r#"{"choices":[{"index":0,"delta":{"reasoning":"Let me ","reasoning_details":[{"type":"reasoning.text","text":"Let me ","format":"google-gemini-v1","index":0}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"reasoning":"check.","reasoning_details":[{"type":"reasoning.text","text":"check.","index":0}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"reasoning_details":[{"type":"reasoning.encrypted","data":"c2ln","format":"google-gemini-v1","index":1,"id":"tool_1"}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"tool_1","type":"function","function":{"name":"lookup","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            "[DONE]",
        ];
        let response = decode(&chunks, false).expect("decodes").expect("completes");
        assert_eq!(response.reasoning, "Let me check.");
        let details: Vec<Value> = response
            .reasoning_blocks
            .iter()
            .map(|block| match block {
                ReasoningBlock::Detail { detail } => Value::Object(detail.clone()),
                other => panic!("unexpected block {other:?}"),
            })
            .collect();
        assert_eq!(
            details,
            [
                json!({"type": "reasoning.text", "text": "Let me check.", "format": "google-gemini-v1", "index": 0}),
                json!({"type": "reasoning.encrypted", "data": "c2ln", "format": "google-gemini-v1", "index": 1, "id": "tool_1"}),
            ]
        );
        // The next call of the tool loop carries them with the step, unchanged.
        let mut call = request("google/gemini-3-pro", ThinkingLevel::Medium);
        call.messages = vec![
            ModelMessage::user("look it up"),
            ModelMessage::Assistant {
                text: String::new(),
                tool_calls: response.tool_calls.clone(),
                reasoning: response.reasoning_blocks.clone(),
            },
            ModelMessage::Tool {
                tool_call_id: "tool_1".into(),
                name: "lookup".into(),
                content: "found".into(),
                is_error: false,
            },
        ]
        .into();
        let body = OpenAiProvider::openrouter().body(&call);
        assert_eq!(body["messages"][1]["reasoning_details"], json!(details));
        // A step without details sends none.
        assert_eq!(body["messages"][0].get("reasoning_details"), None);
    }

    /// The `(id, name, arguments)` of the calls a stream of `chunks` completes with.
    fn decoded_calls(chunks: &[&str]) -> Vec<(String, String, String)> {
        let response = decode(chunks, false).expect("decodes").expect("completes");
        response
            .tool_calls
            .into_iter()
            .map(|call| (call.id, call.name, call.arguments))
            .collect()
    }

    #[test]
    fn a_fragment_with_a_new_id_continues_its_call_unless_it_names_another_tool() {
        // A continuation repeating another id, without a name: still the first call.
        let chunks = [
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"lookup","arguments":"{\"q\":"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_a_2","function":{"arguments":"\"x\"}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            "[DONE]",
        ];
        let call = |id: &str, name: &str, arguments: &str| (id.to_owned(), name.to_owned(), arguments.to_owned());
        assert_eq!(decoded_calls(&chunks), [call("call_a", "lookup", r#"{"q":"x"}"#)]);
        // A call whose id was made up here, then another tool on the same index with its
        // own id: two calls, not one with both argument strings.
        let chunks = [
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"type":"function","function":{"name":"lookup","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_b","type":"function","function":{"name":"fetch","arguments":"{\"url\":\"u\"}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            "[DONE]",
        ];
        let calls = decoded_calls(&chunks);
        assert_eq!(calls[1], call("call_b", "fetch", r#"{"url":"u"}"#));
        assert_eq!(
            (calls.len(), calls[0].1.as_str(), calls[0].2.as_str()),
            (2, "lookup", "{}")
        );
        // A server numbering every call 0: a call whose arguments are whole, then another id
        // whose first fragment has no name yet: a second call.
        let chunks = [
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"lookup","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_c","type":"function","function":{"arguments":""}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_c","function":{"name":"fetch","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            "[DONE]",
        ];
        assert_eq!(
            decoded_calls(&chunks),
            [call("call_a", "lookup", "{}"), call("call_c", "fetch", "{}")]
        );
    }

    /// Two calls of one step under one id (a server that numbers ids per step, or repeats
    /// one) keep their own results: the later call gets an id of its own when it starts, and
    /// its later fragments still reach it.
    #[test]
    fn a_call_whose_id_an_earlier_call_of_the_step_has_gets_its_own() {
        let chunks = [
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_0","type":"function","function":{"name":"weather","arguments":"{\"city\":"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_0","function":{"arguments":"\"Paris\"}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"call_0","type":"function","function":{"name":"weather","arguments":"{\"city\":"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"call_0","function":{"arguments":"\"Tokyo\"}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            "[DONE]",
        ];
        let calls = decoded_calls(&chunks);
        assert_eq!(calls.len(), 2, "{calls:?}");
        assert_eq!(
            (calls[0].0.as_str(), calls[0].2.as_str()),
            ("call_0", r#"{"city":"Paris"}"#)
        );
        assert_ne!(calls[1].0, "call_0", "{calls:?}");
        assert!(calls[1].0.starts_with("call_"), "{calls:?}");
        assert_eq!(calls[1].2, r#"{"city":"Tokyo"}"#);
        // Without indices, or every call at index 0 under one id: the second call's opening
        // fragment (a name and arguments, once the first call's are whole) starts a call of
        // its own, whose later fragments reach it.
        for key in [r#""id":"call_0","#, r#""index":0,"id":"call_0","#] {
            let fragment = |function: &str| {
                format!(r#"{{"choices":[{{"index":0,"delta":{{"tool_calls":[{{{key}"function":{function}}}]}}}}]}}"#)
            };
            let chunks = [
                fragment(r#"{"name":"weather","arguments":"{\"city\":\"Paris\"}"}"#),
                fragment(r#"{"name":"weather","arguments":"{\"city\":"}"#),
                fragment(r#"{"arguments":"\"Tokyo\"}"}"#),
                r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#.to_owned(),
                "[DONE]".to_owned(),
            ];
            let chunks: Vec<&str> = chunks.iter().map(String::as_str).collect();
            let calls = decoded_calls(&chunks);
            assert_eq!(calls.len(), 2, "{key}: {calls:?}");
            assert_eq!(calls[0].2, r#"{"city":"Paris"}"#, "{key}");
            assert_ne!(calls[1].0, "call_0", "{key}: {calls:?}");
            assert_eq!(calls[1].2, r#"{"city":"Tokyo"}"#, "{key}");
        }
        // A server that repeats the call's name in every fragment continues the call.
        let chunks = [
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_0","type":"function","function":{"name":"weather","arguments":"{\"city\":"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_0","function":{"name":"weather","arguments":"\"Tokyo\"}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            "[DONE]",
        ];
        let calls = decoded_calls(&chunks);
        assert_eq!(calls.len(), 1, "{calls:?}");
        assert_eq!(
            (calls[0].0.as_str(), calls[0].2.as_str()),
            ("call_0", r#"{"city":"Tokyo"}"#)
        );
        // Another tool's name opens a call, whatever its first fragment brings.
        let chunks = [
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_0","type":"function","function":{"name":"weather","arguments":"{\"city\":\"Tokyo\"}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_0","function":{"name":"time","arguments":" "}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"zone\":\"UTC\"}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            "[DONE]",
        ];
        let calls = decoded_calls(&chunks);
        assert_eq!(calls.len(), 2, "{calls:?}");
        assert_eq!(
            (calls[0].1.as_str(), calls[0].2.as_str()),
            ("weather", r#"{"city":"Tokyo"}"#)
        );
        assert_eq!(calls[1].1, "time");
        assert_eq!(calls[1].2.trim(), r#"{"zone":"UTC"}"#);
    }

    /// A server that opens each call with a fragment naming it and no arguments, and sends the
    /// arguments without a name under the same index and id (or with neither), gives each
    /// call its own arguments.
    #[test]
    fn a_fragment_naming_only_the_tool_opens_a_call_once_the_last_one_is_whole() {
        let opening = |key: &str| {
            format!(
                r#"{{"choices":[{{"index":0,"delta":{{"tool_calls":[{{{key}"type":"function","function":{{"name":"weather","arguments":""}}}}]}}}}]}}"#
            )
        };
        let arguments = |key: &str, city: &str| {
            format!(
                r#"{{"choices":[{{"index":0,"delta":{{"tool_calls":[{{{key}"function":{{"arguments":"{{\"city\":\"{city}\"}}"}}}}]}}}}]}}"#
            )
        };
        for key in [r#""index":0,"id":"call_0","#, r#""id":"call_0","#, ""] {
            let chunks = [
                opening(key),
                arguments(key, "Paris"),
                opening(key),
                arguments(key, "Tokyo"),
                r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#.to_owned(),
                "[DONE]".to_owned(),
            ];
            let chunks: Vec<&str> = chunks.iter().map(String::as_str).collect();
            let calls = decoded_calls(&chunks);
            assert_eq!(calls.len(), 2, "{key}: {calls:?}");
            assert_eq!(
                (calls[0].1.as_str(), calls[0].2.as_str()),
                ("weather", r#"{"city":"Paris"}"#),
                "{key}"
            );
            assert_eq!(
                (calls[1].1.as_str(), calls[1].2.as_str()),
                ("weather", r#"{"city":"Tokyo"}"#),
                "{key}"
            );
            assert_ne!(calls[0].0, calls[1].0, "{key}");
        }
        // At index 0, a nameless fragment under another id after the repeated name is another
        // call whose name comes later: it takes that name, not the earlier call's.
        let chunks = [
            opening(r#""index":0,"id":"call_0","#),
            arguments(r#""index":0,"id":"call_0","#, "Paris"),
            opening(r#""index":0,"id":"call_0","#),
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","function":{"arguments":"{\"zone\":\"UTC\"}"}}]}}]}"#.to_owned(),
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","function":{"name":"time","arguments":""}}]}}]}"#.to_owned(),
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#.to_owned(),
            "[DONE]".to_owned(),
        ];
        let chunks: Vec<&str> = chunks.iter().map(String::as_str).collect();
        assert_eq!(
            decoded_calls(&chunks),
            [
                (
                    "call_0".to_owned(),
                    "weather".to_owned(),
                    r#"{"city":"Paris"}"#.to_owned()
                ),
                ("call_1".to_owned(), "time".to_owned(), r#"{"zone":"UTC"}"#.to_owned())
            ]
        );
    }

    /// A server that repeats the call's name in every fragment and ends with a fragment of
    /// white space once the arguments are whole makes one call, whether it numbers its
    /// calls, names their ids, or neither.
    #[test]
    fn a_repeated_name_with_only_white_space_opens_no_call() {
        for key in [r#""index":0,"id":"call_0","#, r#""id":"call_0","#, ""] {
            let chunks = [
                format!(
                    r#"{{"choices":[{{"index":0,"delta":{{"tool_calls":[{{{key}"type":"function","function":{{"name":"weather","arguments":"{{\"city\":\"Tokyo\"}}"}}}}]}}}}]}}"#
                ),
                format!(
                    r#"{{"choices":[{{"index":0,"delta":{{"tool_calls":[{{{key}"function":{{"name":"weather","arguments":"\n"}}}}]}}}}]}}"#
                ),
                r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#.to_owned(),
                "[DONE]".to_owned(),
            ];
            let chunks: Vec<&str> = chunks.iter().map(String::as_str).collect();
            let calls = decoded_calls(&chunks);
            assert_eq!(calls.len(), 1, "{key}: {calls:?}");
            assert_eq!(calls[0].2.trim(), r#"{"city":"Tokyo"}"#, "{key}");
        }
    }

    /// DeepSeek's thinking mode answers 400 ("Missing `reasoning_content` field in the
    /// assistant message") to a step with calls that does not send its reasoning back, even
    /// one that had none.
    #[test]
    fn a_step_with_calls_sends_reasoning_content_to_deepseek_even_when_it_had_none() {
        let mut call = request("deepseek-chat", ThinkingLevel::Medium);
        let step = |reasoning: Vec<ReasoningBlock>, calls: usize| ModelMessage::Assistant {
            text: if calls == 0 { "Done.".into() } else { String::new() },
            tool_calls: (0..calls)
                .map(|index| ModelToolCall {
                    id: format!("call_{index}"),
                    name: "lookup".into(),
                    arguments: "{}".into(),
                })
                .collect(),
            reasoning,
        };
        call.messages = vec![
            ModelMessage::user("look it up"),
            step(Vec::new(), 1),
            step(vec![ReasoningBlock::Text { text: "Twice.".into() }], 1),
            step(Vec::new(), 0),
        ]
        .into();
        let deepseek = OpenAiProvider::compatible("deepseek", "https://api.deepseek.com", "DEEPSEEK_API_KEY");
        let body = deepseek.body(&call);
        let sent: Vec<Option<&str>> = (1..=3)
            .map(|at| body["messages"][at].get("reasoning_content").and_then(Value::as_str))
            .collect();
        assert_eq!(sent, [Some(""), Some("Twice."), None]);
        assert_eq!(body["messages"][3]["content"], "Done.");
        // A provider that does not echo reasoning gets none, calls or not.
        let body = OpenAiProvider::openai().body(&call);
        assert!((1..=3).all(|at| body["messages"][at].get("reasoning_content").is_none()));
    }

    #[test]
    fn a_step_reasoned_through_one_provider_goes_to_another_without_the_fields_it_refuses() {
        // A conversation's step made through DeepSeek (reasoning_content) and OpenRouter
        // (reasoning_details), then a submission on another provider.
        let mut call = request("gpt-5", ThinkingLevel::Medium);
        call.messages = vec![
            ModelMessage::user("look it up"),
            ModelMessage::Assistant {
                text: "Found it.".into(),
                tool_calls: Vec::new(),
                reasoning: vec![
                    ReasoningBlock::Text {
                        text: "DeepSeek's thoughts".into(),
                    },
                    ReasoningBlock::Detail {
                        detail: serde_json::Map::from_iter([
                            ("type".to_owned(), json!("reasoning.text")),
                            ("text".to_owned(), json!("Gemini's")),
                            ("index".to_owned(), json!(0)),
                        ]),
                    },
                ],
            },
        ]
        .into();
        let sent = |provider: &OpenAiProvider| {
            let step = provider.body(&call)["messages"][1].clone();
            (
                step.get("reasoning_content").is_some(),
                step.get("reasoning_details").is_some(),
            )
        };
        let deepseek = OpenAiProvider::compatible("deepseek", "https://api.deepseek.com", "DEEPSEEK_API_KEY");
        // One history, encoded for each provider in turn: no encoding leaks into another's.
        for _ in 0..2 {
            assert_eq!(sent(&OpenAiProvider::openai()), (false, false), "OpenAI refuses both");
            assert_eq!(
                sent(&OpenAiProvider::compatible(
                    "groq",
                    "https://api.groq.com/openai/v1",
                    "GROQ_API_KEY"
                )),
                (false, false),
                "Groq refuses both"
            );
            assert_eq!(sent(&OpenAiProvider::openrouter()), (false, true));
            assert_eq!(sent(&deepseek), (true, true));
        }
    }

    #[test]
    fn the_body_ending_completes_only_after_the_finish_reason_and_the_usage() {
        let text = r#"{"choices":[{"index":0,"delta":{"content":"Hi"}}]}"#;
        let finish = r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#;
        let usage = r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#;
        let finish_with_usage = r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#;
        let tokens =
            |response: Option<ModelResponse>| response.map(|r| (r.text, r.usage.input_tokens, r.usage.output_tokens));
        let whole = Ok(Some(("Hi".to_owned(), 3, 1)));
        // `[DONE]` completes, with or without usage (compatible servers may send none).
        assert_eq!(decode(&[text, finish, usage, "[DONE]"], false).map(tokens), whole);
        assert_eq!(
            decode(&[text, finish, "[DONE]"], false).map(tokens),
            Ok(Some(("Hi".to_owned(), 0, 0)))
        );
        // Without `[DONE]`: complete once the usage arrived after (or with) the finish reason…
        assert_eq!(decode(&[text, finish, usage], true).map(tokens), whole);
        assert_eq!(decode(&[text, finish_with_usage], true).map(tokens), whole);
        // …else the body ended early: before the usage, or before the finish reason.
        assert_eq!(
            decode(&[text, finish], true).map(tokens),
            Err(ProviderErrorKind::Network)
        );
        assert_eq!(decode(&[text], true).map(tokens), Err(ProviderErrorKind::Network));
        assert_eq!(
            decode(&[text, usage], true).map(tokens),
            Err(ProviderErrorKind::Network)
        );
    }

    #[test]
    fn a_tool_call_index_reused_with_a_new_id_is_a_new_call() {
        let mut decoder = ChatDecoder::new(CallContext::new("fixture", "KEY", "m", None), true, false);
        let mut out = VecDeque::new();
        for (id, name, args) in [("a", "one", "{}"), ("b", "two", "{\"x\":1}")] {
            let chunk = json!({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "id": id, "function": {"name": name, "arguments": args}}
            ]}}]});
            let data = chunk.to_string();
            let event = Event {
                data: &data,
                ..Event::default()
            };
            assert_eq!(decoder.event(&event, &mut out).ok(), Some(Flow::Continue));
        }
        assert!(decoder.complete(&mut out).is_ok());
        let Some(StreamEvent::Completed(response)) = out.pop_back() else {
            panic!("no completion: {out:?}")
        };
        let calls: Vec<_> = response
            .tool_calls
            .iter()
            .map(|c| (c.id.as_str(), c.arguments.as_str()))
            .collect();
        assert_eq!(calls, [("a", "{}"), ("b", "{\"x\":1}")]);
        assert_eq!(response.stop_reason, StopReason::ToolUse);
    }
}
