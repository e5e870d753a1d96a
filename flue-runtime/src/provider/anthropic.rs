//! The Anthropic Messages provider.
//!
//! Calls `POST {base_url}/messages` with `stream: true` (headers `x-api-key` and
//! `anthropic-version: 2023-06-01`) and maps the streamed events to [`StreamEvent`]s.
//!
//! How [`ModelRequest`] maps to the request body:
//!
//! - `system` → the top-level `system` field;
//! - messages → content blocks: user images → `image` blocks (`source: {"type": "base64"}`)
//!   before the user's `text`, assistant tool calls → `tool_use` blocks (the arguments as
//!   the `input` object, as written), [`ModelMessage::Tool`] → a user message of `tool_result`
//!   blocks (`tool_use_id`, `content`, `is_error`; a failed result without text says
//!   [`EMPTY_ERROR_RESULT`], as the API refuses it empty). Consecutive messages of the same role are
//!   merged (so consecutive tool results form one user message, results first); empty text is
//!   dropped, as the API refuses empty text blocks;
//! - `tools` → `{"name", "description", "input_schema"}` (each encoded once per tool);
//! - prompt caching (on unless [`with_prompt_caching`](AnthropicProvider::with_prompt_caching)
//!   turns it off): `system` is sent as one text block with `cache_control: {"type":
//!   "ephemeral"}` (a breakpoint after the tools and the system prompt), and so is the last
//!   block of the call's last message, so each call reads the conversation the call before
//!   cached;
//! - `max_output_tokens` → `max_tokens` (required by the API: 8192 when unset, 4096 for
//!   Claude 3 before 3.5, whose output cap it is);
//! - `thinking_level` (`off` sends nothing), by the model's id:
//!   - Claude 5 and later (and a Claude id without a version) always think: `off` is sent as
//!     the least, `low`, below;
//!   - Claude 4.6 and later (and a Claude id without a version) → `thinking: {"type":
//!     "adaptive", "display": "summarized"}` (Opus 4.7 and later would otherwise omit the
//!     reasoning; Fable 5.1 and later also get `"block_binding": {"prefix_mismatch_behavior":
//!     "drop_block"}` with its `anthropic-beta` header, see `binds_thinking`) with
//!     `output_config: {"effort"}`: minimal and low → `low`, medium →
//!     `medium`, high → `high`, xhigh → `xhigh` (4.7 and later; `high` before), max → `max`;
//!     `max_tokens` is 32,000 when unset, as
//!     thinking spends from it. Claude Opus 4.7 and later refuse a budget;
//!   - Claude 3.7 to 4.5, and models that are not Claude → `thinking: {"type": "enabled",
//!     "budget_tokens"}` with budgets minimal 1024, low 2048, medium 8192, high 16384, xhigh
//!     24576, max 32768. `max_tokens` must exceed the budget: when unset it becomes budget +
//!     8192 within the model's output cap (32,000 for Opus 4 and 4.1, 64,000 for the others;
//!     the budget shrinks to leave room for the answer); when set too low, the budget shrinks
//!     to half of it (at least 1024) or thinking is dropped;
//!   - Claude before 3.7, which cannot think → nothing.
//!
//! A step's signed thinking blocks (`thinking` with its `signature`, `redacted_thinking` with
//! its `data`) are kept with the step ([`ReasoningBlock`]) and sent back unchanged before its
//! text and tool calls while thinking is on, to the model that made them only (a signature is
//! checked against the model it is sent to: a conversation whose model changed sends the other
//! model's steps without them). Inside a tool-use loop (an assistant tool call
//! after the last user message) a budgeted call requires the last step's signed thinking, so
//! budgeted thinking stays on there only when that step has some: a step made with thinking
//! off, or one a `prefilter_llm_history` hook rewrote, turns it off until the next user
//! message. Adaptive thinking stays on (the model may skip thinking in any step).
//!
//! Usage: `input_tokens` is the whole prompt (Anthropic's `input_tokens` plus cache reads and
//! cache writes), so it means the same as OpenAI's `prompt_tokens`.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use flue_core::model::ThinkingLevel;
use flue_core::url::url_without_secrets;
use flue_core::usage::Usage;
use reqwest::header::HeaderName;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;

use super::body::{BodyWriter, Payload};
pub use super::http::RetryPolicy;
use super::http::{
    CallContext, CallHeaders, Endpoint, ErrorDetails, Flow, KeySource, SharedClient, SseDecoder, Transport,
    ended_early, error_event, error_stream, map_error, parse_event_json, secret_header, send_with_retries, sse_stream,
};
use super::sse::Event;
use super::text::{Text, borrowed};
use super::tool_json::{Declarations, ToolJson};
use super::types::{
    ContentAt, ModelMessage, ModelProvider, ModelRequest, ModelResponse, ModelStream, ModelToolCall, ProviderError,
    ProviderErrorKind, ReasoningBlock, StopReason, StreamEvent,
};
use super::wire_names;

/// The API version sent as `anthropic-version`.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";
/// `max_tokens` when the request sets no cap (and the room left for the answer beside a
/// thinking budget).
pub const DEFAULT_MAX_TOKENS: u32 = 8192;
/// What a failed tool result without text says to the model (the API refuses it empty).
pub const EMPTY_ERROR_RESULT: &str = "The tool failed without a message.";
/// `max_tokens` when the request sets no cap and the model thinks adaptively (its thinking
/// spends from it).
pub const ADAPTIVE_MAX_TOKENS: u32 = 32_000;
/// The smallest thinking budget the API accepts.
const MIN_THINKING_BUDGET: u32 = 1024;

/// A provider speaking the Anthropic Messages API.
///
/// The API key is read from `ANTHROPIC_API_KEY` at call time; [`with_api_key`](Self::with_api_key)
/// gives one in code instead. When there is none the call's stream yields one
/// [`ProviderErrorKind::MissingKey`] error and no request is made.
///
/// ```
/// use std::time::Duration;
/// use flue_runtime::provider::ModelProvider;
/// use flue_runtime::provider::anthropic::AnthropicProvider;
///
/// let provider = AnthropicProvider::anthropic().with_timeout(Duration::from_secs(90));
/// assert_eq!(provider.id(), "anthropic");
/// ```
#[derive(Clone)]
pub struct AnthropicProvider {
    id: String,
    base_url: String,
    endpoint: Endpoint,
    key: KeySource,
    transport: Transport,
    client: SharedClient,
    tools: ToolJson,
    /// Whether calls mark prompt-cache breakpoints (see [`AnthropicProvider::with_prompt_caching`]).
    prompt_caching: bool,
}

/// The base URL without its userinfo, query and fragment (the key is redacted by its own
/// Debug): a provider's Debug ends up in logs.
impl std::fmt::Debug for AnthropicProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnthropicProvider")
            .field("id", &self.id)
            .field("base_url", &url_without_secrets(&self.base_url))
            .field("endpoint", &self.endpoint)
            .field("key", &self.key)
            .field("transport", &self.transport)
            .field("client", &self.client)
            .field("tools", &self.tools)
            .field("prompt_caching", &self.prompt_caching)
            .finish()
    }
}

impl AnthropicProvider {
    /// Anthropic: id `anthropic`, base URL `https://api.anthropic.com/v1`, key in
    /// `ANTHROPIC_API_KEY`.
    pub fn anthropic() -> Self {
        Self {
            id: "anthropic".to_owned(),
            base_url: "https://api.anthropic.com/v1".to_owned(),
            endpoint: Endpoint::default(),
            key: KeySource::env("ANTHROPIC_API_KEY"),
            transport: Transport::default(),
            client: SharedClient::default(),
            tools: ToolJson::default(),
            prompt_caching: true,
        }
    }

    /// Whether calls mark prompt-cache breakpoints (on by default): the system prompt (with
    /// the tools before it) and the call's last message get `cache_control: {"type":
    /// "ephemeral"}`, so each call of a conversation reads what the one before wrote, at a
    /// tenth of the input price, instead of paying for the whole history again (writing costs a
    /// quarter more, once; prompts under the model's minimum, 1,024 tokens or so, are not
    /// cached and cost nothing extra). Turn it off for a server that refuses the field.
    pub fn with_prompt_caching(mut self, cache: bool) -> Self {
        self.prompt_caching = cache;
        self
    }

    /// Registers the provider under another id (a second Anthropic account, a proxy).
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = id.into();
        self
    }

    /// Replaces the base URL (the part before `/messages`).
    pub fn with_base_url(mut self, base_url: impl Into<String>) -> Self {
        self.base_url = base_url.into();
        self.endpoint = Endpoint::default();
        self
    }

    /// Reads the API key from another environment variable.
    pub fn with_key_env(mut self, key_env: impl Into<String>) -> Self {
        self.key.env = key_env.into();
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
    /// When it does, the stream fails with [`ProviderErrorKind::Timeout`].
    pub fn with_idle_timeout(mut self, idle: Duration) -> Self {
        self.transport.idle_timeout = idle;
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

    /// The base URL.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// The environment variable the API key is read from.
    pub fn key_env(&self) -> &str {
        &self.key.env
    }

    /// The JSON body of a call, encoded from borrowed parts: the conversation is not copied
    /// into a JSON tree first, and each tool's declaration is encoded once (see [`ToolJson`]).
    fn body_bytes(&self, request: &ModelRequest) -> Result<Payload, serde_json::Error> {
        let (max_tokens, thinking, effort) = thinking_fields(request);
        let tools = self.tools.declarations(&request.tools, |tool| {
            serde_json::value::to_raw_value(&ToolDeclaration {
                name: &tool.name,
                description: &tool.description,
                input_schema: &tool.parameters,
            })
        })?;
        // `{"messages":[…],` then the other fields: the history's encodings are kept with it
        // (each complete run of a role's messages is encoded once, not at every call).
        // Signed reasoning goes back only while thinking is on (the format keys the kept
        // encodings, so turning it off or on encodes the history again).
        let (format, reasoning) = match thinking {
            Some(_) => (ANTHROPIC_MESSAGES, Reasoning::Sent),
            None => (ANTHROPIC_MESSAGES_WITHOUT_REASONING, Reasoning::Left),
        };
        // The system prompt goes with the fields, after the messages.
        let (head, tail) = request.body_size_hint(format, tools.encoded_len());
        let system_len = request.system.as_deref().map_or(0, str::len);
        let mut writer = BodyWriter::with_capacity(head, tail + system_len);
        writer.buf().extend_from_slice(b"{\"messages\":[");
        let last = request.messages.as_ptr_range().end;
        request
            .messages
            .encode_runs_into(format, &mut writer, next_run, |run, out| {
                let mut merged = messages(run, reasoning);
                // The call's last message is a cache breakpoint: the run holding it is the
                // open one, encoded afresh at every call, so no kept encoding carries it.
                if self.prompt_caching
                    && std::ptr::eq(run.as_ptr_range().end, last)
                    && let Some(message) = merged.last_mut()
                {
                    message.cached = message.content.last().is_some_and(Block::may_cache);
                }
                merged
                    .iter()
                    .try_for_each(|message| serde_json::to_writer(&mut *out, message))
            })?;
        let body = writer.buf();
        body.extend_from_slice(b"],");
        let system = request.system.as_deref().filter(|s| !s.is_empty());
        let fields = MessagesFields {
            model: &request.model,
            max_tokens,
            stream: true,
            system: system.map(|text| match self.prompt_caching {
                true => System::Cached([CachedText {
                    kind: "text",
                    text,
                    cache_control: EPHEMERAL,
                }]),
                false => System::Text(text),
            }),
            tools: &tools,
            thinking,
            output_config: effort.map(|effort| OutputConfig { effort }),
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

/// The wire format [`Messages::encode_runs_into`](crate::provider::Messages) keeps the
/// history's encodings in: with the steps' signed reasoning, and without it.
const ANTHROPIC_MESSAGES: &str = "anthropic-messages";
const ANTHROPIC_MESSAGES_WITHOUT_REASONING: &str = "anthropic-messages-without-reasoning";

/// Whether the steps' signed reasoning is sent.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reasoning {
    Sent,
    Left,
}

/// A call's body but its messages (written before these, see `body_bytes`).
#[derive(Serialize)]
struct MessagesFields<'a> {
    model: &'a str,
    max_tokens: u32,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    system: Option<System<'a>>,
    #[serde(skip_serializing_if = "Declarations::is_empty")]
    tools: &'a Declarations,
    #[serde(skip_serializing_if = "Option::is_none")]
    thinking: Option<Thinking>,
    #[serde(skip_serializing_if = "Option::is_none")]
    output_config: Option<OutputConfig>,
}

#[derive(Serialize)]
struct OutputConfig {
    effort: &'static str,
}

#[derive(Serialize)]
struct ToolDeclaration<'a> {
    name: &'a str,
    description: &'a str,
    input_schema: &'a Value,
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Thinking {
    /// A fixed budget (Claude before 4.6).
    Enabled { budget_tokens: u32 },
    /// The model decides how much, steered by `output_config.effort` (Claude 4.6 and later),
    /// and its reasoning is shown summarized: Claude Opus 4.7 and later omit it by default,
    /// and then stream signatures only, so no reasoning reaches events or records.
    Adaptive {
        display: &'static str,
        #[serde(skip_serializing_if = "Option::is_none")]
        block_binding: Option<BlockBinding>,
    },
}

/// What a model that binds its thinking blocks to their prefix does with a block whose
/// prefix changed (see [`binds_thinking`]).
#[derive(Serialize)]
struct BlockBinding {
    prefix_mismatch_behavior: &'static str,
}

/// The beta that `thinking.block_binding` needs.
const THINKING_BINDING_BETA: &str = "thinking-binding-controls-2026-08-01";

/// Whether `model` binds each thinking block to its prefix (the system prompt, the tools and
/// the messages before it): Claude Fable 5.1 and later (and a Claude id without a version, a
/// newer model's). By default such a model answers 400 when a block comes back after its
/// prefix changed, and accounts made since 2026-08-31 enforce it. Here the instruction is
/// rendered again before every model call, so the system prompt and tools can change inside
/// a tool loop, and compaction rewrites history: such calls ask the API to drop the blocks
/// that no longer match (`drop_block`) instead. Older models run no such check.
fn binds_thinking(model: &str) -> bool {
    match claude_version(model) {
        Some(Some(version)) => version >= (5, 1),
        Some(None) => true,
        None => false,
    }
}

/// How a model takes thinking, from its id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ThinkingMode {
    /// No thinking (Claude before 3.7): nothing is sent. With the model's output cap, which
    /// an unset `max_tokens` stays within (4096 before Claude 3.5).
    Unsupported(u32),
    /// `{"type": "enabled", "budget_tokens"}`, with the model's output cap when known: Claude
    /// 3.7 to 4.5, and models that are not Claude behind an Anthropic-compatible API.
    Budget(Option<u32>),
    /// `{"type": "adaptive"}` and `output_config.effort`: Claude 4.6 and later (4.7 and later
    /// refuse a budget), and a Claude id without a version (a newer model's).
    Adaptive,
}

/// The thinking mode of `model`: a Claude id (`claude-opus-4-1-20250805`,
/// `claude-3-7-sonnet-latest`, `claude-sonnet-4-6`, also behind a prefix such as Bedrock's
/// `us.anthropic.`) by its version, anything else by budget.
fn thinking_mode(model: &str) -> ThinkingMode {
    let Some((family, version)) = claude_family_version(model) else {
        return ThinkingMode::Budget(None);
    };
    let Some((major, minor)) = version else {
        return ThinkingMode::Adaptive;
    };
    match (major, minor) {
        (0..=2, _) | (3, 0..=4) => ThinkingMode::Unsupported(4096),
        (3, 5..=6) => ThinkingMode::Unsupported(DEFAULT_MAX_TOKENS),
        (3, _) => ThinkingMode::Budget(Some(64_000)),
        (4, 0 | 1) if family == "opus" => ThinkingMode::Budget(Some(32_000)),
        (4, 0..=5) => ThinkingMode::Budget(Some(64_000)),
        _ => ThinkingMode::Adaptive,
    }
}

/// The output cap of a Claude `model` whose cap this provider knows (by its version).
pub(crate) fn output_cap(model: &str) -> Option<u64> {
    match thinking_mode(model) {
        ThinkingMode::Unsupported(cap) | ThinkingMode::Budget(Some(cap)) => Some(u64::from(cap)),
        ThinkingMode::Budget(None) | ThinkingMode::Adaptive => None,
    }
}

/// A Claude id's version (`None` when it has none), `None` for another model.
fn claude_version(model: &str) -> Option<Option<(u32, u32)>> {
    claude_family_version(model).map(|(_, version)| version)
}

/// A Claude id's family (`opus`, …; empty when the version comes first) and version
/// (`claude-3-7-sonnet…`, `claude-opus-4-1…`, also behind a prefix such as Bedrock's
/// `us.anthropic.`); `None` for a model that is not Claude.
fn claude_family_version(model: &str) -> Option<(String, Option<(u32, u32)>)> {
    let model = model.to_ascii_lowercase();
    let at = model.find("claude-")?;
    let parts: Vec<&str> = model[at + "claude-".len()..].split(['-', '.', '@']).collect();
    let number = |part: &str| {
        (!part.is_empty() && part.len() <= 2)
            .then(|| part.parse::<u32>().ok())
            .flatten()
    };
    // `claude-3-7-sonnet…` (version first) or `claude-opus-4-1…` (family first).
    let (family, version) = match parts.first().copied().and_then(number) {
        Some(_) => ("", &parts[..]),
        None => (parts.first().copied().unwrap_or(""), parts.get(1..).unwrap_or(&[])),
    };
    let version = version.first().copied().and_then(number).map(|major| {
        let minor = version.get(1).copied().and_then(number).unwrap_or(0);
        (major, minor)
    });
    Some((family.to_owned(), version))
}

/// `max_tokens`, `thinking` and the effort of a call.
///
/// Budget mode: `max_tokens` must exceed the budget. Unset, it is the budget plus
/// [`DEFAULT_MAX_TOKENS`], within the model's output cap (the budget shrinks to leave room for
/// the answer); set too low, the budget shrinks to half of it (at least 1024) or thinking is
/// dropped. Inside a tool loop whose last step has no signed thinking, thinking is dropped
/// (see [`may_think`]).
///
/// Adaptive mode: no budget; unset, `max_tokens` is [`ADAPTIVE_MAX_TOKENS`] while thinking is
/// on, as thinking spends from it.
fn thinking_fields(request: &ModelRequest) -> (u32, Option<Thinking>, Option<&'static str>) {
    let level = request.thinking_level;
    let max = request.max_output_tokens;
    match thinking_mode(&request.model) {
        ThinkingMode::Adaptive => {
            match adaptive_effort(level, &request.model).or_else(|| always_thinks(&request.model).then_some("low")) {
                Some(effort) => (
                    max.unwrap_or(ADAPTIVE_MAX_TOKENS),
                    Some(Thinking::Adaptive {
                        display: "summarized",
                        block_binding: binds_thinking(&request.model).then_some(BlockBinding {
                            prefix_mismatch_behavior: "drop_block",
                        }),
                    }),
                    Some(effort),
                ),
                None => (max.unwrap_or(DEFAULT_MAX_TOKENS), None, None),
            }
        }
        // An explicit limit stays within the model's cap too (the API refuses one past it).
        ThinkingMode::Unsupported(cap) => (max.map_or(DEFAULT_MAX_TOKENS.min(cap), |max| max.min(cap)), None, None),
        ThinkingMode::Budget(cap) => {
            let max = max.map(|max| max.min(cap.unwrap_or(u32::MAX)));
            let budget = thinking_budget(level).filter(|_| may_think(&request.messages));
            let (max_tokens, budget) = match (max, budget) {
                (None, None) => (DEFAULT_MAX_TOKENS.min(cap.unwrap_or(u32::MAX)), None),
                (None, Some(budget)) => {
                    let max_tokens = (budget + DEFAULT_MAX_TOKENS).min(cap.unwrap_or(u32::MAX));
                    let room = DEFAULT_MAX_TOKENS.min(max_tokens / 4);
                    (max_tokens, Some(budget.min(max_tokens - room).max(MIN_THINKING_BUDGET)))
                }
                (Some(max), None) => (max, None),
                (Some(max), Some(budget)) if max > budget => (max, Some(budget)),
                (Some(max), Some(_)) if max > MIN_THINKING_BUDGET => (max, Some((max / 2).max(MIN_THINKING_BUDGET))),
                (Some(max), Some(_)) => (max, None),
            };
            let thinking = budget
                .filter(|&budget| budget < max_tokens)
                .map(|budget_tokens| Thinking::Enabled { budget_tokens });
            (max_tokens, thinking, None)
        }
    }
}

/// Whether `model` thinks whatever the request says: Claude 5 and later (and a Claude id
/// without a version, a newer model's) think adaptively when the request has no `thinking`,
/// and Fable refuses `{"type": "disabled"}`. Their `Off` asks for the least thinking (`low`
/// effort), so their thinking blocks are kept and sent back in a tool loop, which the API
/// requires of a model that thought.
fn always_thinks(model: &str) -> bool {
    match claude_version(model) {
        Some(Some((major, _))) => major >= 5,
        Some(None) => true,
        None => false,
    }
}

/// The adaptive `effort` of a thinking level on `model` (`None` for `Off`): `xhigh` where the
/// model has it (Claude 4.7 and later, and a Claude id without a version), else `high`.
fn adaptive_effort(level: ThinkingLevel, model: &str) -> Option<&'static str> {
    match level {
        ThinkingLevel::Off => None,
        ThinkingLevel::Minimal | ThinkingLevel::Low => Some("low"),
        ThinkingLevel::Medium => Some("medium"),
        ThinkingLevel::High => Some("high"),
        ThinkingLevel::Xhigh => Some(match claude_version(model) {
            Some(Some(version)) if version < (4, 7) => "high",
            _ => "xhigh",
        }),
        ThinkingLevel::Max => Some("max"),
    }
}

/// The system prompt: its text, or one text block marked as a cache breakpoint.
#[derive(Serialize)]
#[serde(untagged)]
enum System<'a> {
    Text(&'a str),
    Cached([CachedText<'a>; 1]),
}

#[derive(Serialize)]
struct CachedText<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
    cache_control: CacheControl,
}

#[derive(Clone, Copy, Serialize)]
struct CacheControl {
    #[serde(rename = "type")]
    kind: &'static str,
}

/// A cache breakpoint of the default lifetime (five minutes, renewed by each hit).
const EPHEMERAL: CacheControl = CacheControl { kind: "ephemeral" };

struct Message<'a> {
    role: &'static str,
    content: Vec<Block<'a>>,
    /// Whether the last block is a cache breakpoint.
    cached: bool,
}

/// `{"role", "content"}`, the last block with `cache_control` when the message is `cached`.
impl Serialize for Message<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{SerializeSeq, SerializeStruct};
        struct Content<'m, 'a>(&'m Message<'a>);
        impl Serialize for Content<'_, '_> {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                #[derive(Serialize)]
                struct Cached<'b, 'a> {
                    #[serde(flatten)]
                    block: &'b Block<'a>,
                    cache_control: CacheControl,
                }
                let blocks = &self.0.content;
                let mut seq = serializer.serialize_seq(Some(blocks.len()))?;
                for (at, block) in blocks.iter().enumerate() {
                    if self.0.cached && at + 1 == blocks.len() {
                        seq.serialize_element(&Cached {
                            block,
                            cache_control: EPHEMERAL,
                        })?;
                    } else {
                        seq.serialize_element(block)?;
                    }
                }
                seq.end()
            }
        }
        let mut message = serializer.serialize_struct("Message", 2)?;
        message.serialize_field("role", self.role)?;
        message.serialize_field("content", &Content(self))?;
        message.end()
    }
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block<'a> {
    Thinking {
        thinking: &'a str,
        signature: &'a str,
    },
    RedactedThinking {
        data: &'a str,
    },
    Image {
        source: ImageSource<'a>,
    },
    Text {
        text: &'a str,
    },
    ToolUse {
        id: Cow<'a, str>,
        name: Cow<'a, str>,
        input: &'a RawValue,
    },
    ToolResult {
        tool_use_id: Cow<'a, str>,
        content: &'a str,
        is_error: bool,
    },
}

#[derive(Serialize)]
struct ImageSource<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    media_type: &'a str,
    data: &'a str,
}

/// A tool call's id as Anthropic accepts it (`^[a-zA-Z0-9_-]+$`): another provider's ids
/// can have other characters (Kimi writes `functions.add:0`); see [`wire_names`].
fn tool_use_id(id: &str) -> Cow<'_, str> {
    wire_names::conforming(id, true, usize::MAX)
}

/// The thinking budget of a level (`None` for `Off`).
fn thinking_budget(level: ThinkingLevel) -> Option<u32> {
    match level {
        ThinkingLevel::Off => None,
        ThinkingLevel::Minimal => Some(1024),
        ThinkingLevel::Low => Some(2048),
        ThinkingLevel::Medium => Some(8192),
        ThinkingLevel::High => Some(16384),
        ThinkingLevel::Xhigh => Some(24576),
        ThinkingLevel::Max => Some(32768),
    }
}

/// Whether the model may think in this call: outside a tool-use loop, or inside one whose
/// last step has signed reasoning to send back (the API refuses a thinking call in a loop
/// without it). The call continues a loop when a tool result follows the last step: all that
/// follows it goes in one Anthropic user message, so a signal or a user message after the
/// results does not end the loop for the API.
fn may_think(messages: &[ModelMessage]) -> bool {
    // A step that sends no block (an empty answer) is not in the request: the API's last
    // step is the one before it.
    let Some(last_step) = messages
        .iter()
        .rposition(|message| matches!(message, ModelMessage::Assistant { .. }) && role_of(message).is_some())
    else {
        return true;
    };
    let in_loop = messages[last_step + 1..]
        .iter()
        .any(|message| matches!(message, ModelMessage::Tool { .. }));
    !in_loop
        || matches!(&messages[last_step], ModelMessage::Assistant { reasoning, .. }
            if reasoning.iter().any(ReasoningBlock::is_signed))
}

/// The role of the Anthropic message `message` goes into, or `None` when it sends no block
/// (it then joins whichever run it sits in).
fn role_of(message: &ModelMessage) -> Option<&'static str> {
    match message {
        ModelMessage::User { content, images } => {
            (!images.is_empty() || text_block(content).is_some()).then_some("user")
        }
        ModelMessage::Assistant { text, tool_calls, .. } => {
            (!tool_calls.is_empty() || text_block(text).is_some()).then_some("assistant")
        }
        ModelMessage::Tool { .. } => Some("user"),
    }
}

/// How many of `conversation`'s first messages [`messages`] merges into one Anthropic message,
/// and whether that run is complete: a message of the other role follows it, so no later
/// message can join it.
fn next_run(conversation: &[ModelMessage]) -> (usize, bool) {
    let mut role = None;
    for (at, message) in conversation.iter().enumerate() {
        match (role, role_of(message)) {
            (Some(current), Some(next)) if next != current => return (at, true),
            (None, next) => role = next,
            _ => {}
        }
    }
    (conversation.len(), false)
}

/// The conversation as Anthropic messages: content blocks, same-role runs merged.
fn messages(conversation: &[ModelMessage], reasoning: Reasoning) -> Vec<Message<'_>> {
    let mut merged: Vec<Message<'_>> = Vec::new();
    for message in conversation {
        let (role, blocks) = match message {
            ModelMessage::User { content, images } => {
                // Images first, as Anthropic recommends, then the text.
                let mut blocks: Vec<Block<'_>> = images
                    .iter()
                    .map(|image| Block::Image {
                        source: ImageSource {
                            kind: "base64",
                            media_type: &image.media_type,
                            data: &image.data,
                        },
                    })
                    .collect();
                blocks.extend(text_block(content));
                ("user", blocks)
            }
            ModelMessage::Assistant {
                text,
                tool_calls,
                reasoning: signed,
            } => {
                // The step's signed reasoning, when the step sends anything else (see
                // `role_of`), where the model wrote it among the text and calls.
                let signed: &[ReasoningBlock] = if reasoning == Reasoning::Sent && role_of(message).is_some() {
                    signed
                } else {
                    &[]
                };
                ("assistant", assistant_blocks(text, tool_calls, signed))
            }
            ModelMessage::Tool {
                tool_call_id,
                content,
                is_error,
                ..
            } => (
                "user",
                vec![Block::ToolResult {
                    tool_use_id: tool_use_id(tool_call_id),
                    // The API refuses an error result without content, and the history is
                    // sent again at every call: one such result would fail them all.
                    content: if *is_error && content.trim().is_empty() {
                        EMPTY_ERROR_RESULT
                    } else {
                        content
                    },
                    is_error: *is_error,
                }],
            ),
        };
        if blocks.is_empty() {
            continue;
        }
        match merged.last_mut() {
            Some(last) if last.role == role => last.content.extend(blocks),
            _ => merged.push(Message {
                role,
                content: blocks,
                cached: false,
            }),
        }
    }
    for message in &mut merged {
        if message.role == "user" {
            // The API wants tool results before any text of the same message.
            message
                .content
                .sort_by_key(|block| !matches!(block, Block::ToolResult { .. }));
        }
    }
    merged
}

/// A step's content blocks: its signed reasoning blocks where they came among its text and
/// tool calls (the text split where a block came), as Anthropic requires them back. Blocks
/// without a position (steps recorded before positions were kept), or positions the step
/// cannot have (past its text or calls, inside a character, going back), put the reasoning
/// first, then the text, then the calls. (A step a `prefilter_llm_history` hook changed
/// comes without its reasoning: see `lifecycle::llm::from_llm`.)
fn assistant_blocks<'a>(text: &'a str, calls: &'a [ModelToolCall], reasoning: &'a [ReasoningBlock]) -> Vec<Block<'a>> {
    let signed: Vec<(Block<'a>, Option<ContentAt>)> = reasoning
        .iter()
        .filter_map(|block| match block {
            ReasoningBlock::Thinking {
                thinking,
                signature,
                at,
            } => Some((Block::Thinking { thinking, signature }, *at)),
            ReasoningBlock::Redacted { data, at } => Some((Block::RedactedThinking { data }, *at)),
            // Another provider's unsigned reasoning: not Anthropic's to read.
            ReasoningBlock::Text { .. } | ReasoningBlock::Detail { .. } => None,
        })
        .collect();
    let mut last = ContentAt::default();
    let placed = signed.iter().all(|(_, at)| {
        let Some(at) = at else { return false };
        let fits =
            at.text >= last.text && at.calls >= last.calls && text.is_char_boundary(at.text) && at.calls <= calls.len();
        last = *at;
        fits
    });
    let tool_use = |call: &'a ModelToolCall| Block::ToolUse {
        id: tool_use_id(&call.id),
        name: wire_names::tool_name(&call.name),
        input: tool_input(call),
    };
    let mut blocks = Vec::with_capacity(signed.len() + calls.len() + 1);
    let mut written = ContentAt::default();
    for (block, at) in signed {
        if placed && let Some(at) = at {
            blocks.extend(text_block(&text[written.text..at.text]));
            blocks.extend(calls[written.calls..at.calls].iter().map(tool_use));
            written = at;
        }
        blocks.push(block);
    }
    blocks.extend(text_block(&text[written.text..]));
    blocks.extend(calls[written.calls..].iter().map(tool_use));
    blocks
}

impl Block<'_> {
    /// Whether the block may carry `cache_control` (thinking blocks may not).
    fn may_cache(&self) -> bool {
        !matches!(self, Self::Thinking { .. } | Self::RedactedThinking { .. })
    }
}

fn text_block(text: &str) -> Option<Block<'_>> {
    (!text.trim().is_empty()).then_some(Block::Text { text })
}

/// An empty `input` object.
fn empty_input() -> &'static RawValue {
    static EMPTY: std::sync::OnceLock<Box<RawValue>> = std::sync::OnceLock::new();
    EMPTY.get_or_init(|| RawValue::from_string("{}".to_owned()).unwrap_or_default())
}

/// A tool call's arguments as the `input` object, sent as written (`{}` when they are empty
/// or not a JSON object).
fn tool_input(call: &ModelToolCall) -> &RawValue {
    match serde_json::from_str::<&RawValue>(&call.arguments) {
        Ok(raw) if raw.get().starts_with('{') => raw,
        _ => {
            if !call.arguments.trim().is_empty() {
                tracing::warn!(tool = %call.name, id = %call.id, "tool arguments are not a JSON object: sent as {{}}");
            }
            empty_input()
        }
    }
}

/// The headers of every Messages call (the key's follows them).
const FIXED_HEADERS: &[(&str, &str)] = &[
    ("accept", "text/event-stream"),
    ("anthropic-version", ANTHROPIC_VERSION),
];

/// The headers of a call whose thinking sets `block_binding`.
const BINDING_HEADERS: &[(&str, &str)] = &[
    ("accept", "text/event-stream"),
    ("anthropic-version", ANTHROPIC_VERSION),
    ("anthropic-beta", THINKING_BINDING_BETA),
];

/// The headers of `request`'s call.
fn fixed_headers(request: &ModelRequest) -> &'static [(&'static str, &'static str)] {
    match thinking_fields(request).1 {
        Some(Thinking::Adaptive {
            block_binding: Some(_), ..
        }) => BINDING_HEADERS,
        _ => FIXED_HEADERS,
    }
}

impl ModelProvider for AnthropicProvider {
    fn id(&self) -> &str {
        &self.id
    }

    fn stream(&self, request: &ModelRequest) -> ModelStream {
        let key = match self.key.resolve(&self.id) {
            Ok(key) => key,
            Err(error) => return error_stream(error),
        };
        let headers = CallHeaders {
            fixed: fixed_headers(request),
            key: match key
                .as_ref()
                .map(|key| secret_header(key.expose(), &self.id, &self.key.env))
            {
                Some(Ok(value)) => Some((HeaderName::from_static("x-api-key"), value)),
                Some(Err(error)) => return error_stream(error),
                None => None,
            },
        };
        let ctx = CallContext::new(&self.id, &self.key.env, &request.model, key);
        let body = super::http::encode_body(self.body_bytes(request));
        let url = self.endpoint.url(&self.base_url, "messages");
        let transport = self.transport.for_request(request);
        let client = self.client.clone();
        let connect_ctx = ctx.clone();
        let connect = async move {
            let client = client.get()?;
            send_with_retries(&client, &url, &headers, body?, &transport, &connect_ctx).await
        };
        sse_stream(connect, MessagesDecoder::new(ctx.clone()), transport.idle_timeout, ctx)
    }
}

/// A tool call being assembled.
#[derive(Debug)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
}

/// Decodes Messages API stream events.
struct MessagesDecoder {
    ctx: CallContext,
    text: String,
    reasoning: String,
    /// The thinking blocks as they stream (a block keeps only once signed, see `complete`).
    reasoning_blocks: Vec<ReasoningBlock>,
    /// Content block index → position in `reasoning_blocks`.
    reasoning_at: HashMap<u64, usize>,
    calls: Vec<PartialCall>,
    /// Content block index → position in `calls`.
    blocks: HashMap<u64, usize>,
    stop: Option<StopReason>,
    /// Anthropic's own counts (input excludes cache reads/writes).
    input_tokens: u64,
    cache_read_tokens: u64,
    cache_write_tokens: u64,
    output_tokens: u64,
}

impl MessagesDecoder {
    fn new(ctx: CallContext) -> Self {
        Self {
            ctx,
            text: String::new(),
            reasoning: String::new(),
            reasoning_blocks: Vec::new(),
            reasoning_at: HashMap::new(),
            calls: Vec::new(),
            blocks: HashMap::new(),
            stop: None,
            input_tokens: 0,
            cache_read_tokens: 0,
            cache_write_tokens: 0,
            output_tokens: 0,
        }
    }

    /// The counts of `message_start` and then `message_delta`, which are cumulative: a count
    /// only grows. (Servers that write 0 into one of the two, some SGLang releases into the
    /// delta's `input_tokens`, others into the start's, lose nothing.)
    fn usage(&mut self, usage: &Value) {
        let number = |key: &str| usage.get(key).and_then(Value::as_u64).unwrap_or(0);
        self.input_tokens = self.input_tokens.max(number("input_tokens"));
        self.cache_read_tokens = self.cache_read_tokens.max(number("cache_read_input_tokens"));
        self.cache_write_tokens = self.cache_write_tokens.max(number("cache_creation_input_tokens"));
        self.output_tokens = self.output_tokens.max(number("output_tokens"));
    }

    fn invalid(&self, what: &str) -> ProviderError {
        ProviderError::new(
            ProviderErrorKind::InvalidResponse,
            format!(
                "[flue] Provider \"{}\" sent an invalid stream event: {what}.",
                self.ctx.provider
            ),
        )
    }

    fn block_start(&mut self, data: &Value, out: &mut VecDeque<StreamEvent>) -> Result<(), ProviderError> {
        let index = data
            .get("index")
            .and_then(Value::as_u64)
            .ok_or_else(|| self.invalid("a block without index"))?;
        let block = data
            .get("content_block")
            .ok_or_else(|| self.invalid("a block start without content_block"))?;
        let kept = matches!(
            block.get("type").and_then(Value::as_str),
            Some("tool_use" | "thinking" | "redacted_thinking")
        );
        if kept && self.calls.len() + self.reasoning_blocks.len() >= super::MAX_STREAMED_PARTS {
            return Err(self.invalid(&format!(
                "more than {} tool calls and thinking blocks in one answer",
                super::MAX_STREAMED_PARTS
            )));
        }
        let text = |key: &str| {
            block
                .get(key)
                .and_then(Value::as_str)
                .filter(|t| !t.is_empty())
                .map(str::to_owned)
        };
        match block.get("type").and_then(Value::as_str) {
            Some("text") => {
                if let Some(text) = text("text") {
                    self.text.push_str(&text);
                    out.push_back(StreamEvent::TextDelta(text));
                }
            }
            Some("thinking") => {
                let thinking = text("thinking").unwrap_or_default();
                self.reasoning_at.insert(index, self.reasoning_blocks.len());
                self.reasoning_blocks.push(ReasoningBlock::Thinking {
                    thinking: thinking.clone(),
                    signature: text("signature").unwrap_or_default(),
                    at: Some(self.content_at()),
                });
                if !thinking.is_empty() {
                    self.reasoning.push_str(&thinking);
                    out.push_back(StreamEvent::ReasoningDelta(thinking));
                }
            }
            Some("redacted_thinking") => {
                // Encrypted: nothing to show, only to send back.
                if let Some(data) = text("data") {
                    self.reasoning_blocks.push(ReasoningBlock::Redacted {
                        data,
                        at: Some(self.content_at()),
                    });
                }
            }
            Some("tool_use") => {
                let id = text("id").ok_or_else(|| self.invalid("a tool_use block without id"))?;
                let name = text("name").ok_or_else(|| self.invalid("a tool_use block without name"))?;
                let slot = self.calls.len();
                out.push_back(StreamEvent::ToolCallStarted {
                    index: slot,
                    id: id.clone(),
                    name: name.clone(),
                });
                // Inputs normally stream as `input_json_delta`; a complete input may come here.
                let arguments = match block.get("input") {
                    Some(Value::Object(input)) if !input.is_empty() => {
                        let arguments = Value::Object(input.clone()).to_string();
                        out.push_back(StreamEvent::ToolCallArguments {
                            index: slot,
                            delta: arguments.clone(),
                        });
                        arguments
                    }
                    _ => String::new(),
                };
                self.calls.push(PartialCall { id, name, arguments });
                self.blocks.insert(index, slot);
            }
            _ => {}
        }
        Ok(())
    }

    fn block_delta(
        &mut self,
        index: Option<u64>,
        delta: &BlockDelta<'_>,
        out: &mut VecDeque<StreamEvent>,
    ) -> Result<(), ProviderError> {
        match delta.kind.as_ref().map(Text::as_str) {
            Some("text_delta") => {
                if let Some(text) = non_empty(&delta.text) {
                    self.text.push_str(text);
                    out.push_back(StreamEvent::TextDelta(text.to_owned()));
                }
            }
            Some("thinking_delta") => {
                if let Some(thinking) = non_empty(&delta.thinking) {
                    if let Some(ReasoningBlock::Thinking { thinking: block, .. }) = self.reasoning_block(index) {
                        block.push_str(thinking);
                    }
                    self.reasoning.push_str(thinking);
                    out.push_back(StreamEvent::ReasoningDelta(thinking.to_owned()));
                }
            }
            Some("signature_delta") => {
                if let Some(fragment) = non_empty(&delta.signature)
                    && let Some(ReasoningBlock::Thinking { signature, .. }) = self.reasoning_block(index)
                {
                    signature.push_str(fragment);
                }
            }
            Some("input_json_delta") => {
                let slot = index
                    .and_then(|index| self.blocks.get(&index).copied())
                    .ok_or_else(|| self.invalid("input_json_delta for a block that is not a tool_use"))?;
                if let Some(fragment) = non_empty(&delta.partial_json) {
                    self.calls[slot].arguments.push_str(fragment);
                    out.push_back(StreamEvent::ToolCallArguments {
                        index: slot,
                        delta: fragment.to_owned(),
                    });
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Where a block starting now sits among the step's text and tool calls.
    fn content_at(&self) -> ContentAt {
        ContentAt {
            text: self.text.len(),
            calls: self.calls.len(),
        }
    }

    /// The thinking block streaming at content block `index`.
    fn reasoning_block(&mut self, index: Option<u64>) -> Option<&mut ReasoningBlock> {
        let at = *self.reasoning_at.get(&index?)?;
        self.reasoning_blocks.get_mut(at)
    }

    fn complete(&mut self, out: &mut VecDeque<StreamEvent>) {
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
        let stop_reason = self.stop.unwrap_or(if tool_calls.is_empty() {
            StopReason::Stop
        } else {
            StopReason::ToolUse
        });
        let usage = Usage {
            input_tokens: self
                .input_tokens
                .saturating_add(self.cache_read_tokens)
                .saturating_add(self.cache_write_tokens),
            output_tokens: self.output_tokens,
            cache_read_tokens: self.cache_read_tokens,
            cache_write_tokens: self.cache_write_tokens,
            reasoning_tokens: 0,
        };
        out.push_back(StreamEvent::Completed(ModelResponse {
            text: std::mem::take(&mut self.text),
            reasoning: std::mem::take(&mut self.reasoning),
            // A thinking block the stream never signed cannot be sent back.
            reasoning_blocks: std::mem::take(&mut self.reasoning_blocks)
                .into_iter()
                .filter(|block| !matches!(block, ReasoningBlock::Thinking { signature, .. } if signature.is_empty()))
                .collect(),
            tool_calls,
            stop_reason,
            usage,
        }));
    }
}

/// A field's text, unless absent or empty.
fn non_empty<'t>(field: &'t Option<Text<'_>>) -> Option<&'t str> {
    field.as_ref().map(Text::as_str).filter(|text| !text.is_empty())
}

/// A `content_block_delta` event, typed.
#[derive(Deserialize)]
struct DeltaEvent<'a> {
    #[serde(rename = "type", borrow)]
    kind: Text<'a>,
    #[serde(default)]
    index: Option<u64>,
    #[serde(borrow)]
    delta: BlockDelta<'a>,
}

/// The `delta` of a `content_block_delta` event (other fields are not used).
#[derive(Default, Deserialize)]
struct BlockDelta<'a> {
    #[serde(rename = "type", default, borrow)]
    kind: Option<Text<'a>>,
    #[serde(default, borrow)]
    text: Option<Text<'a>>,
    #[serde(default, borrow)]
    thinking: Option<Text<'a>>,
    #[serde(default, borrow)]
    signature: Option<Text<'a>>,
    #[serde(default, borrow)]
    partial_json: Option<Text<'a>>,
}

impl SseDecoder for MessagesDecoder {
    fn event(&mut self, event: &Event<'_>, out: &mut VecDeque<StreamEvent>) -> Result<Flow, ProviderError> {
        let data = event.data.trim();
        if data.is_empty() {
            return Ok(Flow::KeepAlive);
        }
        // The hot event (one per streamed fragment) is decoded without a `Value` tree.
        if event.event == "content_block_delta"
            && let Ok(delta) = serde_json::from_str::<DeltaEvent<'_>>(data)
            && delta.kind.as_str() == "content_block_delta"
        {
            self.block_delta(delta.index, &delta.delta, out)?;
            return Ok(Flow::Continue);
        }
        // An `error` event, whatever its data's `type` (a proxy may send the bare error object,
        // `{"type": "overloaded_error", …}`, or text).
        if event.event == "error" {
            return Err(error_event(&self.ctx, data));
        }
        // A stream ended the OpenAI way (a compatible server): the end of the stream.
        if data == "[DONE]" {
            self.end(out)?;
            return Ok(Flow::Done);
        }
        let data = parse_event_json(&self.ctx, data)?;
        let kind = data.get("type").and_then(Value::as_str).unwrap_or(event.event);
        match kind {
            // Anthropic's keep-alive: a stream of nothing else is one that stalled.
            "ping" => return Ok(Flow::KeepAlive),
            "message_start" => {
                if let Some(usage) = data.get("message").and_then(|m| m.get("usage")) {
                    self.usage(usage);
                }
            }
            "content_block_start" => self.block_start(&data, out)?,
            "content_block_delta" => {
                if let Some(delta) = data.get("delta") {
                    let text = |key: &str| delta.get(key).and_then(Value::as_str).map(borrowed);
                    let view = BlockDelta {
                        kind: text("type"),
                        text: text("text"),
                        thinking: text("thinking"),
                        signature: text("signature"),
                        partial_json: text("partial_json"),
                    };
                    self.block_delta(data.get("index").and_then(Value::as_u64), &view, out)?;
                }
            }
            "message_delta" => {
                if let Some(reason) = data
                    .get("delta")
                    .and_then(|d| d.get("stop_reason"))
                    .and_then(Value::as_str)
                    .filter(|reason| !reason.trim().is_empty())
                {
                    // A reason that is no answer (one this build does not know) fails the
                    // call, rather than settle what was streamed as the reply.
                    let Some(stop) = super::types::stop_reason_named(reason) else {
                        return Err(super::types::failed_finish(&self.ctx.provider, "stop_reason", reason));
                    };
                    self.stop = Some(stop);
                }
                if let Some(usage) = data.get("usage") {
                    self.usage(usage);
                }
            }
            "message_stop" => {
                self.complete(out);
                return Ok(Flow::Done);
            }
            "error" => {
                let error = data.get("error").unwrap_or(&data);
                return Err(map_error(
                    &self.ctx,
                    None,
                    None,
                    &ErrorDetails::from_value(error),
                    &error.to_string(),
                ));
            }
            _ => {}
        }
        Ok(Flow::Continue)
    }

    fn end(&mut self, out: &mut VecDeque<StreamEvent>) -> Result<(), ProviderError> {
        // Without `message_stop`, a stop reason still means the answer is whole.
        if self.stop.is_some() {
            self.complete(out);
            Ok(())
        } else {
            Err(ended_early(&self.ctx))
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests assert by unwrapping

    use serde_json::json;

    use super::*;

    #[test]
    fn debug_of_the_provider_shows_neither_its_key_nor_its_base_url_secrets() {
        let provider = AnthropicProvider::anthropic()
            .with_base_url("https://user:hunter2@127.0.0.1:1/v1?key=hunter2#hunter2")
            .with_api_key("sk-hunter2-0123456789");
        // The endpoint, parsed at the first call, is part of the provider's Debug too.
        assert!(provider.endpoint.url(&provider.base_url, "messages").is_ok());
        let debug = format!("{provider:?}");
        assert!(!debug.contains("hunter2"), "{debug}");
        assert!(debug.contains("https://127.0.0.1:1/v1"), "{debug}");
    }

    fn request(messages: Vec<ModelMessage>, level: ThinkingLevel, max: Option<u32>) -> ModelRequest {
        ModelRequest {
            model: "claude".to_owned(),
            system: None,
            messages: messages.into(),
            tools: Vec::new(),
            thinking_level: level,
            max_output_tokens: max,
            max_retries: None,
        }
    }

    fn user(text: &str) -> ModelMessage {
        ModelMessage::user(text)
    }

    /// A step calling `calls` tools, then their results.
    fn tool_step(history: &mut crate::provider::Messages, step: usize, calls: usize) {
        history.push(ModelMessage::Assistant {
            text: if step.is_multiple_of(2) {
                String::new()
            } else {
                format!("Looking {step}.")
            },
            tool_calls: (0..calls)
                .map(|call| ModelToolCall {
                    id: format!("call_{step}_{call}"),
                    name: "t".into(),
                    arguments: "{\"a\":1}".into(),
                })
                .collect(),
            reasoning: Vec::new(),
        });
        for call in 0..calls {
            history.push(ModelMessage::Tool {
                tool_call_id: format!("call_{step}_{call}"),
                name: "t".into(),
                content: format!("\"result\" {call} ✓"),
                is_error: call == 1,
            });
        }
    }

    /// An empty answer after a tool loop made without thinking sends nothing: the API still
    /// sees that loop, whose last step has no thinking, and refuses a thinking call in it.
    #[test]
    fn an_empty_answer_after_an_unsigned_tool_loop_does_not_turn_thinking_on() {
        let mut history = crate::provider::Messages::from(vec![user("look it up")]);
        tool_step(&mut history, 0, 1);
        history.push(ModelMessage::Assistant {
            text: String::new(),
            tool_calls: Vec::new(),
            reasoning: Vec::new(),
        });
        history.push(user("and?"));
        assert!(!may_think(&history));
        // A step that answered in words ends the loop.
        let mut answered = history.to_vec();
        answered[3] = ModelMessage::Assistant {
            text: "Found it.".into(),
            tool_calls: Vec::new(),
            reasoning: Vec::new(),
        };
        assert!(may_think(&answered));
    }

    #[test]
    fn a_body_is_the_same_whether_its_history_was_encoded_before_or_not() {
        let provider = AnthropicProvider::anthropic();
        let mut warm = request(vec![user("hi")], ThinkingLevel::Off, None);
        warm.system = Some("Be brief.".into());
        let mut sizes = Vec::new();
        for step in 0..6 {
            let body = provider.body_bytes(&warm).expect("a body");
            let cold = ModelRequest {
                messages: warm.messages.to_vec().into(),
                ..warm.clone()
            };
            assert_eq!(
                body.to_vec(),
                provider.body_bytes(&cold).expect("a body").to_vec(),
                "step {step}: byte for byte"
            );
            sizes.push(provider.body(&warm)["messages"].as_array().map(Vec::len));
            tool_step(&mut warm.messages, step, 1 + step % 3);
            if step % 2 == 1 {
                // A user message joins the tool results' user turn; an empty step joins nothing.
                warm.messages.push(user("and then?"));
                warm.messages.push(ModelMessage::Assistant {
                    text: " ".into(),
                    tool_calls: Vec::new(),
                    reasoning: Vec::new(),
                });
            }
        }
        assert_eq!(sizes, [Some(1), Some(3), Some(5), Some(7), Some(9), Some(11)]);
        let body = provider.body(&warm);
        let turns = body["messages"].as_array().expect("messages");
        // The last user turn: tool results first, then the user's text.
        let last = &turns[turns.len() - 1]["content"];
        assert_eq!(last[0]["type"], "tool_result");
        assert_eq!(body["model"], "claude");
        assert_eq!(body["system"][0]["text"], "Be brief.");
    }

    #[test]
    fn tool_inputs_go_as_written_and_arguments_that_are_no_object_as_an_empty_one() {
        let call = |id: &str, arguments: &str| ModelToolCall {
            id: id.to_owned(),
            name: "lookup".to_owned(),
            arguments: arguments.to_owned(),
        };
        let mut request = request(
            vec![
                user("go"),
                ModelMessage::Assistant {
                    text: String::new(),
                    tool_calls: vec![
                        call("a", r#"{"city": "Paris", "days": [1, 2]}"#),
                        call("b", "[1]"),
                        call("c", ""),
                        call("d", "{oops"),
                    ],
                    reasoning: Vec::new(),
                },
            ],
            ThinkingLevel::Off,
            None,
        );
        request.tools = vec![super::super::ToolSpec {
            name: "lookup".into(),
            description: "Looks \"it\" up.".into(),
            parameters: std::sync::Arc::new(json!({"type": "object"})),
        }];
        let provider = AnthropicProvider::anthropic();
        for _ in 0..2 {
            // The second body reuses the tool's encoded declaration.
            let body = provider.body(&request);
            let inputs: Vec<&Value> = body["messages"][1]["content"]
                .as_array()
                .unwrap()
                .iter()
                .map(|block| &block["input"])
                .collect();
            assert_eq!(
                inputs,
                [
                    &json!({"city": "Paris", "days": [1, 2]}),
                    &json!({}),
                    &json!({}),
                    &json!({})
                ]
            );
            assert_eq!(
                body["tools"],
                json!([{"name": "lookup", "description": "Looks \"it\" up.", "input_schema": {"type": "object"}}])
            );
        }
    }

    #[test]
    fn max_tokens_always_exceeds_the_thinking_budget() {
        let provider = AnthropicProvider::anthropic();
        let cases = [
            (ThinkingLevel::Off, None, 8192, None),
            (ThinkingLevel::Medium, None, 16384, Some(8192)),
            (ThinkingLevel::Max, None, 40960, Some(32768)),
            (ThinkingLevel::High, Some(4000), 4000, Some(2000)),
            (ThinkingLevel::Low, Some(1500), 1500, Some(1024)),
            (ThinkingLevel::Low, Some(1000), 1000, None),
            (ThinkingLevel::Minimal, Some(50_000), 50_000, Some(1024)),
        ];
        for (level, max, want_max, want_budget) in cases {
            let body = provider.body(&request(vec![user("hi")], level, max));
            assert_eq!(body["max_tokens"], want_max, "{level:?} {max:?}");
            assert_eq!(
                body.get("thinking").map(|t| t["budget_tokens"].clone()),
                want_budget.map(Value::from)
            );
        }
    }

    /// A user message, a step with `text` calling `f` (no reasoning), and its result: the
    /// conversation inside a tool loop.
    fn tool_loop(text: &str) -> Vec<ModelMessage> {
        vec![
            user("go"),
            ModelMessage::Assistant {
                text: text.into(),
                tool_calls: vec![ModelToolCall {
                    id: "t1".into(),
                    name: "f".into(),
                    arguments: "{}".into(),
                }],
                reasoning: Vec::new(),
            },
            ModelMessage::Tool {
                tool_call_id: "t1".into(),
                name: "f".into(),
                content: "ok".into(),
                is_error: false,
            },
        ]
    }

    #[test]
    fn the_thinking_mode_follows_the_claude_version_in_the_model_id() {
        let cases = [
            ("claude-3-5-haiku-latest", ThinkingMode::Unsupported(8192)),
            ("claude-3-opus-20240229", ThinkingMode::Unsupported(4096)),
            ("claude-3-haiku-20240307", ThinkingMode::Unsupported(4096)),
            ("claude-3-7-sonnet-20250219", ThinkingMode::Budget(Some(64_000))),
            ("claude-sonnet-4-20250514", ThinkingMode::Budget(Some(64_000))),
            ("claude-opus-4-20250514", ThinkingMode::Budget(Some(32_000))),
            ("claude-opus-4-1-20250805", ThinkingMode::Budget(Some(32_000))),
            ("claude-opus-4-5", ThinkingMode::Budget(Some(64_000))),
            ("claude-haiku-4-5-20251001", ThinkingMode::Budget(Some(64_000))),
            (
                "us.anthropic.claude-sonnet-4-5-20250929-v1:0",
                ThinkingMode::Budget(Some(64_000)),
            ),
            ("claude-sonnet-4-6", ThinkingMode::Adaptive),
            ("claude-opus-4-7", ThinkingMode::Adaptive),
            ("anthropic.claude-opus-4-6-v1", ThinkingMode::Adaptive),
            ("claude-opus-5", ThinkingMode::Adaptive),
            ("claude-mythos-preview", ThinkingMode::Adaptive),
            ("glm-4.6", ThinkingMode::Budget(None)),
        ];
        for (model, mode) in cases {
            assert_eq!(thinking_mode(model), mode, "{model}");
        }
    }

    /// Blocks back where they came: a whitespace-only stretch of text between two blocks is
    /// left out (the API refuses it), a redacted block keeps its place, and calls made before
    /// any text come before it.
    #[test]
    fn a_steps_blocks_are_rebuilt_in_the_order_the_model_wrote_them() {
        let calls: Vec<ModelToolCall> = ["a", "b"]
            .iter()
            .map(|id| ModelToolCall {
                id: (*id).into(),
                name: "lookup".into(),
                arguments: "{}".into(),
            })
            .collect();
        let text = "  \nLater text.";
        let reasoning = [
            ReasoningBlock::Thinking {
                thinking: "first".into(),
                signature: "s1".into(),
                at: Some(ContentAt { text: 0, calls: 1 }),
            },
            ReasoningBlock::Redacted {
                data: "opaque".into(),
                at: Some(ContentAt { text: 3, calls: 2 }),
            },
        ];
        let kinds: Vec<String> = assistant_blocks(text, &calls, &reasoning)
            .iter()
            .map(|block| match block {
                Block::Thinking { thinking, .. } => format!("thinking {thinking}"),
                Block::RedactedThinking { data } => format!("redacted {data}"),
                Block::Text { text } => format!("text {text}"),
                Block::ToolUse { id, .. } => format!("call {id}"),
                other => panic!("{}", serde_json::to_string(other).unwrap_or_default()),
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "call a",
                "thinking first",
                "call b",
                "redacted opaque",
                "text Later text."
            ]
        );
    }

    /// Claude 5 and later think whatever the request says (Fable refuses `disabled`): `Off`
    /// asks for the least, so the steps' thinking goes back in a tool loop as it must.
    #[test]
    fn a_model_that_always_thinks_is_asked_for_the_least_thinking_when_it_is_off() {
        let provider = AnthropicProvider::anthropic();
        for model in ["claude-fable-5", "claude-opus-5-5", "claude-fable"] {
            let mut call = request(tool_loop(""), ThinkingLevel::Off, None);
            call.model = model.into();
            let body = provider.body(&call);
            assert_eq!(body["thinking"]["type"], "adaptive", "{model}");
            assert_eq!(body["output_config"], json!({"effort": "low"}), "{model}");
        }
    }

    #[test]
    fn claude_4_6_and_later_think_adaptively_with_an_effort_even_inside_a_tool_loop() {
        let provider = AnthropicProvider::anthropic();
        let looping = tool_loop("");
        for (level, effort) in [
            (ThinkingLevel::Minimal, "low"),
            (ThinkingLevel::Medium, "medium"),
            (ThinkingLevel::Xhigh, "xhigh"),
            (ThinkingLevel::Max, "max"),
        ] {
            let mut call = request(looping.clone(), level, None);
            call.model = "claude-opus-4-7".into();
            let body = provider.body(&call);
            assert_eq!(
                body["thinking"],
                json!({"type": "adaptive", "display": "summarized"}),
                "{level:?}"
            );
            assert_eq!(body["output_config"], json!({"effort": effort}), "{level:?}");
            assert_eq!(body["max_tokens"], ADAPTIVE_MAX_TOKENS);
        }
        // Claude 4.6 predates `xhigh`.
        let mut older = request(looping.clone(), ThinkingLevel::Xhigh, None);
        older.model = "claude-sonnet-4-6".into();
        assert_eq!(provider.body(&older)["output_config"], json!({"effort": "high"}));
        let mut off = request(looping, ThinkingLevel::Off, Some(1000));
        off.model = "claude-opus-4-7".into();
        let body = provider.body(&off);
        assert_eq!((body.get("thinking"), body.get("output_config")), (None, None));
        assert_eq!(body["max_tokens"], 1000);
    }

    #[test]
    fn a_budget_fits_the_models_output_cap_and_an_older_claude_gets_no_thinking() {
        let provider = AnthropicProvider::anthropic();
        let cases = [
            ("claude-opus-4-1-20250805", ThinkingLevel::Max, 32_000, Some(24_000)),
            ("claude-opus-4-1-20250805", ThinkingLevel::Medium, 16_384, Some(8192)),
            ("claude-sonnet-4-5", ThinkingLevel::Max, 40_960, Some(32_768)),
            ("claude-3-5-haiku-latest", ThinkingLevel::High, 8192, None),
            // Claude 3 writes at most 4096 tokens: a larger default is refused.
            ("claude-3-haiku-20240307", ThinkingLevel::High, 4096, None),
        ];
        for (model, level, want_max, want_budget) in cases {
            let mut call = request(vec![user("hi")], level, None);
            call.model = model.into();
            let body = provider.body(&call);
            assert_eq!(body["max_tokens"], want_max, "{model} {level:?}");
            assert_eq!(
                body.get("thinking").map(|t| t["budget_tokens"].clone()),
                want_budget.map(Value::from),
                "{model} {level:?}"
            );
        }
    }

    #[test]
    fn an_explicit_output_limit_past_the_models_cap_is_held_to_it() {
        let provider = AnthropicProvider::anthropic();
        let cases = [
            ("claude-3-5-haiku-latest", ThinkingLevel::Off, 8192),
            ("claude-3-haiku-20240307", ThinkingLevel::Low, 4096),
            ("claude-opus-4-1-20250805", ThinkingLevel::Off, 16_000),
            ("claude-opus-4-1-20250805", ThinkingLevel::Low, 16_000),
        ];
        for (model, level, want_max) in cases {
            let mut call = request(vec![user("hi")], level, Some(16_000));
            call.model = model.into();
            assert_eq!(provider.body(&call)["max_tokens"], want_max, "{model} {level:?}");
        }
        let mut call = request(vec![user("hi")], ThinkingLevel::Off, Some(40_000));
        call.model = "claude-opus-4-1-20250805".into();
        assert_eq!(provider.body(&call)["max_tokens"], 32_000);
    }

    #[test]
    fn a_failed_tool_result_without_text_is_sent_with_a_message() {
        let result = |content: &str, is_error| ModelMessage::Tool {
            tool_call_id: "t1".into(),
            name: "f".into(),
            content: content.into(),
            is_error,
        };
        for (message, want) in [
            (result("", true), EMPTY_ERROR_RESULT),
            (result(" \n", true), EMPTY_ERROR_RESULT),
            (result("", false), ""),
            (result("boom", true), "boom"),
        ] {
            let encoded = serde_json::to_value(messages(&[message], Reasoning::Sent)).unwrap();
            assert_eq!(encoded[0]["content"][0]["content"], want);
        }
    }

    #[test]
    fn prompt_caching_marks_the_system_prompt_and_the_calls_last_message_only() {
        let looping = tool_loop("Looking.");
        let mut call = request(looping, ThinkingLevel::Off, None);
        call.system = Some("Be brief.".into());
        let provider = AnthropicProvider::anthropic();
        // Twice: the second body reuses the kept encodings of the complete runs.
        for _ in 0..2 {
            let body = provider.body(&call);
            assert_eq!(
                body["system"],
                json!([{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}])
            );
            let marked: Vec<(usize, usize)> = body["messages"]
                .as_array()
                .unwrap()
                .iter()
                .enumerate()
                .flat_map(|(at, message)| {
                    let blocks = message["content"].as_array().unwrap().clone();
                    blocks
                        .into_iter()
                        .enumerate()
                        .filter(|(_, block)| block.get("cache_control").is_some())
                        .map(move |(block, _)| (at, block))
                })
                .collect();
            assert_eq!(marked, [(2, 0)]);
            assert_eq!(body["messages"][2]["content"][0]["type"], "tool_result");
        }
        // The next call moves the breakpoint to its own last message.
        let mut next = call.clone();
        let mut messages: Vec<ModelMessage> = call.messages.iter().cloned().collect();
        messages.push(ModelMessage::Assistant {
            text: "Done.".into(),
            tool_calls: Vec::new(),
            reasoning: Vec::new(),
        });
        messages.push(user("thanks"));
        next.messages = messages.into();
        let body = provider.body(&next);
        assert_eq!(body["messages"][2]["content"][0].get("cache_control"), None);
        assert_eq!(
            body["messages"][4]["content"][0]["cache_control"],
            json!({"type": "ephemeral"})
        );
        let plain = AnthropicProvider::anthropic().with_prompt_caching(false).body(&call);
        assert_eq!(plain["system"], "Be brief.");
        assert!(!plain.to_string().contains("cache_control"));
    }

    #[test]
    fn thinking_is_dropped_inside_a_tool_loop_only() {
        let provider = AnthropicProvider::anthropic();
        let looping = tool_loop("");
        assert!(
            provider
                .body(&request(looping.clone(), ThinkingLevel::High, None))
                .get("thinking")
                .is_none()
        );
        let mut next_turn = looping;
        next_turn.push(ModelMessage::Assistant {
            text: "done".into(),
            tool_calls: Vec::new(),
            reasoning: Vec::new(),
        });
        next_turn.push(user("again"));
        assert!(
            provider
                .body(&request(next_turn, ThinkingLevel::High, None))
                .get("thinking")
                .is_some()
        );
        // A signal or a user message after the results joins them in one user message: for
        // the API the loop goes on, and its step has no signed reasoning to send back.
        let mut joined = tool_loop("");
        joined.push(user("<signal type=\"note\">\nA note.\n</signal>"));
        let body = provider.body(&request(joined, ThinkingLevel::High, None));
        assert!(body.get("thinking").is_none(), "{body}");
        assert_eq!(body["messages"].as_array().map(Vec::len), Some(3), "{body}");
    }

    #[test]
    fn a_user_message_with_images_sends_image_blocks_before_its_text() {
        let message = ModelMessage::User {
            content: "What is this?".into(),
            images: vec![crate::provider::ModelImage {
                media_type: "image/jpeg".into(),
                data: "/9j/4AAQ".into(),
            }],
        };
        assert_eq!(
            serde_json::to_value(messages(&[message], Reasoning::Sent)).unwrap(),
            json!([{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "/9j/4AAQ"}},
                {"type": "text", "text": "What is this?"},
            ]}])
        );
    }

    fn feed(
        decoder: &mut MessagesDecoder,
        out: &mut VecDeque<StreamEvent>,
        name: &str,
        data: serde_json::Value,
    ) -> Result<Flow, ProviderError> {
        let data = data.to_string();
        decoder.event(
            &Event {
                event: name,
                data: &data,
            },
            out,
        )
    }

    #[test]
    fn deltas_decode_the_same_on_the_typed_route_and_the_value_route() {
        let mut decoder = MessagesDecoder::new(CallContext::new("anthropic", "KEY", "m", None));
        let mut out = VecDeque::new();
        let start = json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}});
        feed(&mut decoder, &mut out, "content_block_start", start).unwrap();
        let escaped =
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "a \"b\"\n"}});
        // Named as Anthropic names it (typed), then unnamed (through a Value): same result.
        feed(&mut decoder, &mut out, "content_block_delta", escaped.clone()).unwrap();
        feed(&mut decoder, &mut out, "", escaped).unwrap();
        // An odd shape is skipped as before, not an error.
        let odd = json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": 5}});
        feed(&mut decoder, &mut out, "content_block_delta", odd).unwrap();
        let deltas: Vec<_> = out
            .iter()
            .map(|event| match event {
                StreamEvent::TextDelta(text) => text.as_str(),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(deltas, ["a \"b\"\n", "a \"b\"\n"]);
    }

    /// `message_delta`'s usage is cumulative: a server writing 0 there for the input (one
    /// SGLang release did) leaves the start's count; an empty `stop_reason` is none (the
    /// answer ends at the real one).
    #[test]
    fn a_zero_count_in_the_delta_keeps_the_starts_and_an_empty_stop_reason_is_none() {
        let mut decoder = MessagesDecoder::new(CallContext::new("anthropic", "KEY", "m", None));
        let mut out = VecDeque::new();
        let start = json!({"type": "message_start", "message": {"id": "msg_1", "usage": {"input_tokens": 1200, "output_tokens": 1}}});
        feed(&mut decoder, &mut out, "message_start", start).unwrap();
        let block = json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}});
        feed(&mut decoder, &mut out, "content_block_start", block).unwrap();
        let text = json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}});
        feed(&mut decoder, &mut out, "content_block_delta", text).unwrap();
        feed(
            &mut decoder,
            &mut out,
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        )
        .unwrap();
        let empty = json!({"type": "message_delta", "delta": {"stop_reason": ""}, "usage": {"input_tokens": 0, "output_tokens": 5}});
        feed(&mut decoder, &mut out, "message_delta", empty).expect("an empty reason is none");
        let delta = json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"input_tokens": 0, "output_tokens": 7}});
        feed(&mut decoder, &mut out, "message_delta", delta).unwrap();
        feed(&mut decoder, &mut out, "message_stop", json!({"type": "message_stop"})).unwrap();
        let response = out
            .iter()
            .find_map(|event| match event {
                StreamEvent::Completed(response) => Some(response),
                _ => None,
            })
            .expect("completes");
        assert_eq!(response.text, "Hi");
        assert_eq!(response.stop_reason, StopReason::Stop);
        assert_eq!((response.usage.input_tokens, response.usage.output_tokens), (1200, 7));
    }

    /// An answer opening tool calls and thinking blocks without end fails as an invalid
    /// response once past `MAX_STREAMED_PARTS` of them; text blocks keep nothing of their own.
    #[test]
    fn an_answer_past_the_most_tool_calls_and_thinking_blocks_fails() {
        let mut decoder = MessagesDecoder::new(CallContext::new("anthropic", "KEY", "m", None));
        let mut out = VecDeque::new();
        let limit = super::super::MAX_STREAMED_PARTS;
        for index in 0..limit + 10 {
            let text =
                json!({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}});
            feed(&mut decoder, &mut out, "content_block_start", text).expect("text blocks are not counted");
        }
        for index in 0..limit {
            let block = if index % 2 == 0 {
                json!({"type": "tool_use", "id": format!("toolu_{index}"), "name": "f", "input": {}})
            } else {
                json!({"type": "thinking", "thinking": "", "signature": ""})
            };
            let start = json!({"type": "content_block_start", "index": index, "content_block": block});
            feed(&mut decoder, &mut out, "content_block_start", start).expect("at the bound");
        }
        let one_more = json!({"type": "content_block_start", "index": limit, "content_block": {"type": "tool_use", "id": "toolu_x", "name": "f", "input": {}}});
        let text =
            json!({"type": "content_block_start", "index": limit, "content_block": {"type": "text", "text": ""}});
        feed(&mut decoder, &mut out, "content_block_start", text).expect("a text block at the bound");
        let error = feed(&mut decoder, &mut out, "content_block_start", one_more).expect_err("past the bound");
        assert_eq!(error.kind, ProviderErrorKind::InvalidResponse);
        assert!(error.message.contains("more than 4096"), "{}", error.message);
    }
}
