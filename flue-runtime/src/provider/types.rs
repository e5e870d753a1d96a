//! The provider-neutral model call: what the turn loop sends and what a provider streams back.

use std::borrow::Cow;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use flue_core::model::ThinkingLevel;
use flue_core::usage::Usage;
use futures_util::Stream;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::body::{self, BodyWriter};
use bytes::Bytes;

/// One model call.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelRequest {
    /// The provider's own model id (the part of the specifier after the first `/`).
    pub model: String,
    /// The composed system prompt.
    pub system: Option<String>,
    /// The conversation, oldest first (shared with the runtime's copy of it).
    pub messages: Messages,
    /// The tools the model may call.
    pub tools: Vec<ToolSpec>,
    /// Reasoning effort (already defaulted; providers map it to their own knobs).
    pub thinking_level: ThinkingLevel,
    /// Cap on output tokens, when the caller sets one.
    pub max_output_tokens: Option<u32>,
    /// How many times the provider may retry this call itself before its answer starts
    /// streaming (429s, 5xx answers, connection failures); `None`: as many as its own retry
    /// policy allows. The runtime sets what is left of its budget
    /// ([`RuntimeOptions::model_retries`](crate::RuntimeOptions::model_retries)) on every call
    /// it makes (a turn's, a task child's, a compaction summary's), so a call is never retried
    /// more than that in all, whichever layer retries it.
    pub max_retries: Option<u32>,
}

impl ModelRequest {
    /// About the sizes of what a call writes of this request's JSON body itself, at least
    /// its text, when its tools' declarations take `encoded_tools` bytes and its messages are
    /// encoded in `format`: its head (up to the messages) and the rest (the messages whose
    /// encodings are not kept yet, the tools, the other fields), both without the system
    /// prompt (which a format writes in either). The buffers a provider
    /// serializes the body into start that large instead of doubling their way up (each
    /// doubling a reallocation and a copy of everything written so far). The kept messages
    /// are not counted: the body shares their encodings.
    pub(crate) fn body_size_hint(&self, format: &str, encoded_tools: usize) -> (usize, usize) {
        let messages: usize = self.messages[self.messages.kept(format)..]
            .iter()
            .map(message_size_hint)
            .sum();
        // The declarations, their commas and the field around them.
        let tools = encoded_tools + self.tools.len() + PER_ITEM;
        (2 * PER_ITEM, messages + tools + 2 * PER_ITEM)
    }
}

/// About the JSON around one message or call, and around the request's own fields.
const PER_ITEM: usize = 48;

/// About the size of `blocks`' JSON, at least their text.
pub(crate) fn reasoning_size_hint(blocks: &[ReasoningBlock]) -> usize {
    blocks
        .iter()
        .map(|block| {
            (match block {
                ReasoningBlock::Thinking {
                    thinking, signature, ..
                } => thinking.len() + signature.len(),
                ReasoningBlock::Redacted { data, .. } => data.len(),
                ReasoningBlock::Text { text } => text.len(),
                ReasoningBlock::Detail { detail } => detail
                    .values()
                    .map(|value| value.as_str().map_or(PER_ITEM, str::len))
                    .sum(),
            }) + PER_ITEM
        })
        .sum()
}

/// About the size of `message`'s JSON, at least its text.
pub(crate) fn message_size_hint(message: &ModelMessage) -> usize {
    (match message {
        ModelMessage::User { content, .. } => content.len(),
        ModelMessage::Assistant {
            text,
            tool_calls,
            reasoning,
        } => {
            text.len()
                + reasoning_size_hint(reasoning)
                + tool_calls
                    .iter()
                    .map(|call| call.id.len() + call.name.len() + call.arguments.len() + PER_ITEM)
                    .sum::<usize>()
        }
        ModelMessage::Tool {
            tool_call_id, content, ..
        } => tool_call_id.len() + content.len(),
    }) + PER_ITEM
}

/// A tool as the model sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    /// Name (borrowed from a static tool definition: a model call does not copy it).
    pub name: Cow<'static, str>,
    /// Description (likewise).
    pub description: Cow<'static, str>,
    /// JSON Schema of the arguments (object root).
    /// Shared with the tool's definition: a model call does not copy it.
    pub parameters: Arc<Value>,
}

impl From<&flue_core::Tool> for ToolSpec {
    /// What the model is told about a rendered tool: its name, description and argument
    /// schema, all shared with the tool's definition.
    fn from(tool: &flue_core::Tool) -> Self {
        Self {
            name: tool.definition().name.clone(),
            description: tool.definition().description.clone(),
            parameters: tool.input_schema().shared_json(),
        }
    }
}

/// A conversation's messages, oldest first: what a [`ModelRequest`] sends.
///
/// Cloning one is a reference count, so a request shares the history the runtime keeps rather
/// than copying every message into every model call (which would make a call cost as much as
/// the conversation is long, beyond its request body). Read it as a slice; add to it with
/// [`Messages::push`] and change it otherwise with [`Messages::make_mut`], both of which copy
/// the messages first only while a request still shares them.
///
/// The built-in providers also keep, with the history, its messages encoded in their wire
/// format: a call encodes only the messages added since the last one and copies the rest.
/// `push` keeps that encoding; `make_mut` drops it.
#[derive(Clone, Default, PartialEq)]
pub struct Messages(Arc<History>);

#[derive(Default)]
struct History {
    messages: Vec<ModelMessage>,
    /// The first `count` messages as one provider format encodes them (see
    /// [`Messages::encode_into`]).
    encoded: std::sync::Mutex<Option<Encoded>>,
}

#[derive(Clone)]
struct Encoded {
    format: &'static str,
    count: usize,
    /// The messages' encodings, comma-separated, in parts shared with the bodies that send
    /// them (see [`body::keep`]).
    parts: Vec<Bytes>,
}

impl Encoded {
    fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }
}

impl History {
    fn encoded(&self) -> std::sync::MutexGuard<'_, Option<Encoded>> {
        self.encoded.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Clone for History {
    fn clone(&self) -> Self {
        Self {
            messages: self.messages.clone(),
            encoded: std::sync::Mutex::new(self.encoded().clone()),
        }
    }
}

impl PartialEq for History {
    fn eq(&self, other: &Self) -> bool {
        self.messages == other.messages
    }
}

impl Messages {
    /// No messages.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `message` at the end (copying the messages first when another clone shares them).
    pub fn push(&mut self, message: ModelMessage) {
        Arc::make_mut(&mut self.0).messages.push(message);
    }

    /// The messages, to change (copied first when another clone shares them).
    pub fn make_mut(&mut self) -> &mut Vec<ModelMessage> {
        let history = Arc::make_mut(&mut self.0);
        *history
            .encoded
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        &mut history.messages
    }

    /// The message at `index`, to change (copied first when another clone shares them). The
    /// kept encodings stay when they end before it (a message just added, say), and are
    /// dropped otherwise.
    pub(crate) fn get_mut(&mut self, index: usize) -> &mut ModelMessage {
        let history = Arc::make_mut(&mut self.0);
        let encoded = history
            .encoded
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if encoded.as_ref().is_some_and(|encoded| encoded.count > index) {
            *encoded = None;
        }
        &mut history.messages[index]
    }

    /// The messages as a vector of their own (copied when another clone shares them).
    pub fn into_vec(self) -> Vec<ModelMessage> {
        Arc::try_unwrap(self.0).map_or_else(|shared| shared.messages.clone(), |history| history.messages)
    }

    /// Appends every message, as `encode` writes one in the wire format named `format`,
    /// separated by commas, to `out`. The encodings are kept, and shared with `out` rather than
    /// copied into it: the next call for the same format (on this history or a clone, once
    /// messages were pushed) encodes only the messages added since.
    pub(crate) fn encode_into<E>(
        &self,
        format: &'static str,
        out: &mut BodyWriter,
        mut encode: impl FnMut(&ModelMessage, &mut Vec<u8>) -> Result<(), E>,
    ) -> Result<(), E> {
        self.encode_runs_into(format, out, |_| (1, true), |run, out| encode(&run[0], out))
    }

    /// [`Messages::encode_into`] for a format that sends a run of messages as one (Anthropic
    /// merges a role's consecutive messages): `next_run` tells how many of the messages it is
    /// given make the first run, and whether that run is complete (a later message can no
    /// longer join it); `encode` writes a run, or nothing for a run that sends nothing. Only
    /// complete runs' encodings are kept.
    pub(crate) fn encode_runs_into<E>(
        &self,
        format: &'static str,
        out: &mut BodyWriter,
        mut next_run: impl FnMut(&[ModelMessage]) -> (usize, bool),
        mut encode: impl FnMut(&[ModelMessage], &mut Vec<u8>) -> Result<(), E>,
    ) -> Result<(), E> {
        let messages = &self.0.messages;
        // Writes the run, after a comma when something came before it; nothing on failure.
        let mut write = |run: &[ModelMessage], bytes: &mut Vec<u8>, after: bool| {
            let before = bytes.len();
            if after {
                bytes.push(b',');
            }
            let start = bytes.len();
            match encode(run, bytes) {
                Ok(()) if bytes.len() == start => {
                    bytes.truncate(before);
                    Ok(false)
                }
                Ok(()) => Ok(true),
                Err(error) => {
                    bytes.truncate(before);
                    Err(error)
                }
            }
        };
        let mut cache = self.0.encoded();
        let encoded = match &mut *cache {
            Some(encoded) if encoded.format == format && encoded.count <= messages.len() => encoded,
            stale => stale.insert(Encoded {
                format,
                count: 0,
                parts: Vec::new(),
            }),
        };
        // The runs completed since the last call, encoded into a part of their own.
        let mut at = encoded.count;
        let mut open = None;
        let mut fresh = match &messages[at..] {
            [] => Vec::new(),
            new => Vec::with_capacity(new.iter().map(message_size_hint).sum()),
        };
        let mut failed = None;
        while at < messages.len() {
            let (len, complete) = next_run(&messages[at..]);
            let run = &messages[at..(at + len.max(1)).min(messages.len())];
            if !complete {
                open = Some(at);
                break;
            }
            let after = !encoded.is_empty() || !fresh.is_empty();
            if let Err(error) = write(run, &mut fresh, after) {
                failed = Some(error);
                break;
            }
            at += run.len();
        }
        encoded.count = at;
        if !fresh.is_empty() {
            body::keep(&mut encoded.parts, Bytes::from(fresh));
        }
        if let Some(error) = failed {
            return Err(error);
        }
        let mut wrote = !encoded.is_empty();
        out.share(&encoded.parts);
        drop(cache);
        // The runs a later message may still join: encoded afresh at every call.
        let mut at = open.unwrap_or(messages.len());
        while at < messages.len() {
            let (len, _) = next_run(&messages[at..]);
            let run = &messages[at..(at + len.max(1)).min(messages.len())];
            wrote |= write(run, out.buf(), wrote)?;
            at += run.len();
        }
        Ok(())
    }

    /// How many of the messages have their encoding in `format` kept.
    pub(crate) fn kept(&self, format: &str) -> usize {
        match &*self.0.encoded() {
            Some(encoded) if encoded.format == format && encoded.count <= self.0.messages.len() => encoded.count,
            _ => 0,
        }
    }
}

impl std::ops::Deref for Messages {
    type Target = [ModelMessage];

    fn deref(&self) -> &[ModelMessage] {
        &self.0.messages
    }
}

impl fmt::Debug for Messages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl From<Vec<ModelMessage>> for Messages {
    fn from(messages: Vec<ModelMessage>) -> Self {
        Self(Arc::new(History {
            messages,
            encoded: std::sync::Mutex::default(),
        }))
    }
}

impl<const N: usize> From<[ModelMessage; N]> for Messages {
    fn from(messages: [ModelMessage; N]) -> Self {
        Vec::from(messages).into()
    }
}

impl FromIterator<ModelMessage> for Messages {
    fn from_iter<I: IntoIterator<Item = ModelMessage>>(messages: I) -> Self {
        messages.into_iter().collect::<Vec<_>>().into()
    }
}

impl<'a> IntoIterator for &'a Messages {
    type Item = &'a ModelMessage;
    type IntoIter = std::slice::Iter<'a, ModelMessage>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.messages.iter()
    }
}

impl PartialEq<[ModelMessage]> for Messages {
    fn eq(&self, other: &[ModelMessage]) -> bool {
        self.0.messages.as_slice() == other
    }
}

impl<const N: usize> PartialEq<[ModelMessage; N]> for Messages {
    fn eq(&self, other: &[ModelMessage; N]) -> bool {
        self.0.messages.as_slice() == other
    }
}

impl PartialEq<Vec<ModelMessage>> for Messages {
    fn eq(&self, other: &Vec<ModelMessage>) -> bool {
        self.0.messages == *other
    }
}

/// One message of the conversation sent to the model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "lowercase")]
pub enum ModelMessage {
    /// User-role text (user messages and rendered signals), with a user message's images.
    User {
        /// The text.
        content: String,
        /// Images, in the order they were attached.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        images: Vec<ModelImage>,
    },
    /// A model step: its text and the tool calls it made.
    Assistant {
        /// The text.
        text: String,
        /// Tool calls, in order.
        tool_calls: Vec<ModelToolCall>,
        /// The step's reasoning as its provider wants it back, in order, to send back
        /// unchanged (Anthropic's signed thinking, DeepSeek's reasoning text; empty when the
        /// provider wants none: see [`ReasoningBlock`]).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        reasoning: Vec<ReasoningBlock>,
    },
    /// A tool result answering one call.
    Tool {
        /// The call it answers.
        tool_call_id: String,
        /// The tool's name.
        name: String,
        /// The result text.
        content: String,
        /// Whether the result is an error.
        is_error: bool,
    },
}

/// A block of a model step's reasoning as its provider returned it, kept so the provider
/// can be sent it back unchanged: Anthropic requires a step's signed thinking blocks in the
/// next call of a tool-use loop (and checks their signatures) before it thinks again there,
/// DeepSeek's thinking mode the step's reasoning text, and OpenRouter the step's reasoning
/// details (Gemini and Claude through it refuse a tool loop's next call without them).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ReasoningBlock {
    /// Reasoning text with the signature that authenticates it.
    Thinking {
        /// The reasoning text.
        thinking: String,
        /// The provider's signature of `thinking`.
        signature: String,
        /// Where the block sat among the step's text and tool calls (`None`: before them).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        at: Option<ContentAt>,
    },
    /// Reasoning the provider encrypted: only its opaque data travels.
    Redacted {
        /// The encrypted reasoning.
        data: String,
        /// Where the block sat among the step's text and tool calls (`None`: before them).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        at: Option<ContentAt>,
    },
    /// Unsigned reasoning text a provider wants back with its step (DeepSeek's
    /// `reasoning_content`, which its thinking mode requires in every call of a tool loop).
    Text {
        /// The reasoning text.
        text: String,
    },
    /// One of OpenRouter's `reasoning_details` (reasoning text, a summary or encrypted
    /// reasoning, with its `type`, `format`, `index` and any signature), as the stream built
    /// it up: sent back as it came.
    Detail {
        /// The detail object.
        detail: serde_json::Map<String, serde_json::Value>,
    },
}

/// Where a reasoning block came among its step's other content: after the first `text` bytes
/// of the step's text and its first `calls` tool calls. A model that thinks between its tool
/// calls writes `[thinking, tool_use, thinking, tool_use]`, and Anthropic refuses the tool
/// loop's next call unless the step's thinking blocks come back exactly where they were.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContentAt {
    /// How many bytes of the step's text came before the block.
    pub text: usize,
    /// How many of the step's tool calls came before the block.
    pub calls: usize,
}

impl ReasoningBlock {
    /// Whether the block is Anthropic's signed or encrypted thinking.
    pub fn is_signed(&self) -> bool {
        matches!(self, Self::Thinking { .. } | Self::Redacted { .. })
    }
}

/// An image sent to the model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelImage {
    /// Its media type (`image/png`, …).
    pub media_type: String,
    /// The bytes, base64-encoded (shared: a conversation resends its images on every call).
    pub data: Arc<str>,
}

impl ModelImage {
    /// An image of `bytes` (encoded here in standard, padded base64).
    pub fn from_bytes(media_type: &str, bytes: &[u8]) -> Self {
        use base64::Engine as _;
        Self {
            media_type: media_type.to_owned(),
            data: Arc::from(base64::engine::general_purpose::STANDARD.encode(bytes)),
        }
    }
}

impl ModelMessage {
    /// A user message of `content` alone.
    pub fn user(content: impl Into<String>) -> Self {
        Self::User {
            content: content.into(),
            images: Vec::new(),
        }
    }

    /// An assistant message with no text and no tool calls (a step's before it streams).
    pub(crate) fn empty_assistant() -> Self {
        Self::Assistant {
            text: String::new(),
            tool_calls: Vec::new(),
            reasoning: Vec::new(),
        }
    }

    /// `user`, `assistant` or `tool`.
    pub fn role(&self) -> &'static str {
        match self {
            Self::User { .. } => "user",
            Self::Assistant { .. } => "assistant",
            Self::Tool { .. } => "tool",
        }
    }
}

/// A tool call made by the model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelToolCall {
    /// The call id.
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

/// Why a model call ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model finished its answer.
    Stop,
    /// The model wants tool results.
    ToolUse,
    /// The output-token limit cut the answer.
    Length,
    /// The provider stopped the output under its content policy (a refusal, a content
    /// filter). The runtime fails such a call ([`ProviderErrorKind::Refused`]): what the model
    /// wrote before the stop is not an answer.
    ContentFilter,
    /// No model call was made: a `prefilter_llm_history` hook blocked the request, and its
    /// error text stands as the step's answer.
    HookBlocked,
}

/// What a finish (stop) reason a provider names means; `None` for one that is no answer: a
/// failure the provider names (`error`, z.ai's `network_error`, DeepSeek's
/// `insufficient_system_resource`) or a reason this build does not know, which is taken for
/// one rather than for a final answer (what was streamed would settle as the submission's
/// reply). Names are compared without case; the names different servers use for one outcome
/// are all read.
pub(crate) fn stop_reason_named(reason: &str) -> Option<StopReason> {
    Some(match reason.to_ascii_lowercase().as_str() {
        "stop" | "end" | "end_turn" | "stop_sequence" | "eos" | "eos_token" | "pause_turn" => StopReason::Stop,
        "tool_calls" | "function_call" | "tool_use" => StopReason::ToolUse,
        "length" | "max_tokens" | "model_length" | "model_context_window_exceeded" => StopReason::Length,
        "content_filter" | "refusal" | "sensitive" | "safety" => StopReason::ContentFilter,
        _ => return None,
    })
}

/// The failure of a call whose answer ended with `reason`, which is no answer (see
/// [`stop_reason_named`]): a server error, so the call is made again.
pub(crate) fn failed_finish(provider: &str, field: &str, reason: &str) -> ProviderError {
    let shown: String = reason.chars().filter(|c| !c.is_control()).take(64).collect();
    ProviderError::new(
        ProviderErrorKind::Server,
        format!("[flue] Provider \"{provider}\" ended the response with {field} \"{shown}\", which is no answer."),
    )
}

/// The complete result of one model call.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelResponse {
    /// Answer text.
    pub text: String,
    /// Reasoning text, when the provider streams it.
    pub reasoning: String,
    /// The reasoning as the provider wants it back with the step (see [`ReasoningBlock`];
    /// empty when the provider wants none).
    pub reasoning_blocks: Vec<ReasoningBlock>,
    /// Tool calls, in order.
    pub tool_calls: Vec<ModelToolCall>,
    /// Why the call ended.
    pub stop_reason: StopReason,
    /// Token usage.
    pub usage: Usage,
}

impl ModelResponse {
    /// What the runtime checks of a completed response before it records anything of it:
    /// - an answer the provider stopped under a content policy (Anthropic's `refusal`,
    ///   OpenAI's `content_filter`) is no answer: a [`ProviderErrorKind::Refused`] failure, as
    ///   the reference fails such a call. Kept as a final answer, the cut-off text settled the
    ///   submission `completed` and stayed in the history, where the provider's next calls met
    ///   the refused turn again; as a compaction's summary, it replaced the history for good;
    /// - tool-call arguments that, all the calls together, hold more JSON than
    ///   [`MAX_JSON_CONTAINERS`](crate::MAX_JSON_CONTAINERS) and
    ///   [`MAX_JSON_VALUES`](crate::MAX_JSON_VALUES) allow are an invalid response (not
    ///   retried), refused before the runtime parses them.
    pub(crate) fn check_completed(&self, provider: &str) -> Result<(), ProviderError> {
        if self.stop_reason == StopReason::ContentFilter {
            return Err(ProviderError::new(
                ProviderErrorKind::Refused,
                format!(
                    "[flue] Provider \"{provider}\" stopped the answer under its content policy (a refusal or a content filter): what the model wrote is not kept."
                ),
            ));
        }
        if crate::json_shape::JsonShape::fits(self.tool_calls.iter().map(|call| call.arguments.as_bytes())) {
            return Ok(());
        }
        Err(ProviderError::new(
            ProviderErrorKind::InvalidResponse,
            format!(
                "the arguments of the response's {} tool call(s) hold more than {} JSON objects and arrays, or {} JSON values",
                self.tool_calls.len(),
                crate::MAX_JSON_CONTAINERS,
                crate::MAX_JSON_VALUES
            ),
        ))
    }
}

/// One event of a streamed model call. A stream ends with exactly one `Completed` (or an
/// error).
#[derive(Clone, Debug, PartialEq)]
pub enum StreamEvent {
    /// Answer text.
    TextDelta(String),
    /// Reasoning text.
    ReasoningDelta(String),
    /// A tool call began (its name is known).
    ToolCallStarted {
        /// Position among this response's tool calls.
        index: usize,
        /// The call id.
        id: String,
        /// The tool's name.
        name: String,
    },
    /// More of a tool call's argument text.
    ToolCallArguments {
        /// Position among this response's tool calls.
        index: usize,
        /// The next fragment.
        delta: String,
    },
    /// The call finished.
    Completed(ModelResponse),
}

/// A streamed model call.
pub type ModelStream = Pin<Box<dyn Stream<Item = Result<StreamEvent, ProviderError>> + Send>>;

/// A model provider: turns a [`ModelRequest`] into a stream of [`StreamEvent`]s.
///
/// Implementations retry transient failures that happen before the first event themselves
/// (at most 3 retries, honouring `Retry-After`); a failure after events were streamed is
/// returned as an error for the caller to handle.
pub trait ModelProvider: Send + Sync + 'static {
    /// The provider id: the part of a model specifier before the first `/`.
    fn id(&self) -> &str;

    /// Starts one call. The request is borrowed: the runtime keeps it for a retry, and a
    /// provider takes what its call needs (the HTTP providers encode the body here).
    fn stream(&self, request: &ModelRequest) -> ModelStream;

    /// The context window of `model` in tokens, when known: threshold compaction needs it
    /// (without it only overflow recovery compacts). Default: the well-known model families.
    fn context_window(&self, model: &str) -> Option<u64> {
        known_context_window(model)
    }

    /// The most output tokens `model` may be asked for, when known: a compaction's summary
    /// asks for no more. Default: the well-known model families.
    fn max_output_tokens(&self, model: &str) -> Option<u64> {
        known_max_output_tokens(model)
    }
}

/// The output caps of well-known model families (by the model id's last `/` segment): Claude's
/// by its version (see the Anthropic provider), the others' from a table.
pub fn known_max_output_tokens(model: &str) -> Option<u64> {
    if let Some(cap) = crate::provider::anthropic::output_cap(model) {
        return Some(cap);
    }
    let name = model.rsplit('/').next().unwrap_or(model).to_ascii_lowercase();
    // First match: the longer prefixes of a family first.
    let table: [(&str, u64); 12] = [
        ("gpt-4.1", 32_768),
        // The first gpt-4o snapshot (the later ones take 16,384).
        ("gpt-4o-2024-05-13", 4_096),
        ("gpt-4o", 16_384),
        ("gpt-4-turbo", 4_096),
        ("gpt-4", 8_192),
        ("gpt-3.5", 4_096),
        ("gpt-5", 128_000),
        ("o1-mini", 65_536),
        ("o1-preview", 32_768),
        ("o1", 100_000),
        ("o3", 100_000),
        ("o4", 100_000),
    ];
    table
        .iter()
        .find(|(prefix, _)| name.starts_with(prefix))
        .map(|(_, cap)| *cap)
}

/// The context windows of well-known model families (by the model id's last `/` segment).
pub fn known_context_window(model: &str) -> Option<u64> {
    let name = model.rsplit('/').next().unwrap_or(model).to_ascii_lowercase();
    // ChatGPT's gpt-5 models (`gpt-5-chat-latest`, `gpt-5.1-chat-latest`) have the window of
    // gpt-4o, not the 400,000 of the gpt-5 family.
    if name.starts_with("gpt-5") && name.contains("-chat") {
        return Some(128_000);
    }
    // What the prompt may take (gpt-5's 400,000 include its 128,000 of output), first match.
    let table: [(&str, u64); 11] = [
        ("gpt-4.1", 1_047_576),
        ("gpt-5", 272_000),
        ("gpt-4o", 128_000),
        ("gpt-4-turbo", 128_000),
        ("o1-mini", 128_000),
        ("o1-preview", 128_000),
        ("o1", 200_000),
        ("o3", 200_000),
        ("o4", 200_000),
        ("claude", 200_000),
        ("gemini", 1_048_576),
    ];
    table
        .iter()
        .find(|(prefix, _)| name.starts_with(prefix))
        .map(|(_, window)| *window)
}

/// What went wrong calling a model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderErrorKind {
    /// No API key in the environment.
    MissingKey,
    /// 401/403: the key was refused.
    Unauthorized,
    /// The model id is unknown to the provider.
    UnknownModel,
    /// 429.
    RateLimited,
    /// 5xx.
    Server,
    /// The request does not fit the model's context window.
    ContextOverflow,
    /// No response (or no first byte) in time.
    Timeout,
    /// Connection-level failure.
    Network,
    /// The provider sent something we cannot parse.
    InvalidResponse,
    /// Any other 4xx.
    BadRequest,
    /// The provider stopped the answer under its content policy (a refusal, a content
    /// filter). Not retried: the same request meets the same policy.
    Refused,
}

/// A failed model call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ProviderError {
    /// The category.
    pub kind: ProviderErrorKind,
    /// What happened, for people (never contains the API key).
    pub message: String,
    /// HTTP status, when there was one.
    pub status: Option<u16>,
    /// What the provider asked us to wait before retrying, as asked (a wait longer than a
    /// retry waits makes the error not retryable).
    #[serde(skip)]
    pub retry_after: Option<Duration>,
    /// How many times the provider already retried the call before giving up with this
    /// error (failures before the response streams: 429s, 5xx answers, connection failures).
    /// The turn loop counts them against its own retry budget, so a call is never retried
    /// more than that budget in all.
    #[serde(skip)]
    pub retried: u32,
}

impl ProviderError {
    /// Its kind as an event's or settlement's error type (`context_overflow`, `rate_limited`,
    /// …).
    pub fn error_type(&self) -> String {
        serde_json::to_value(&self.kind)
            .ok()
            .and_then(|kind| kind.as_str().map(str::to_owned))
            .unwrap_or_else(|| "provider_error".into())
    }

    /// An error of `kind`.
    pub fn new(kind: ProviderErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            status: None,
            retry_after: None,
            retried: 0,
        }
    }

    /// Whether a caller with `budget` retries in all, `retries` of them spent, may retry this
    /// failure: it must be retryable, and the provider's own retries count too.
    pub(crate) fn may_retry(&self, retries: u32, budget: u32) -> bool {
        self.is_retryable() && retries.saturating_add(self.retried) < budget
    }

    /// Whether a retry may succeed: rate limits, server errors, timeouts and network failures,
    /// unless the provider asked to wait longer than a retry waits
    /// ([`MAX_RETRY_AFTER_WAIT`](crate::MAX_RETRY_AFTER_WAIT)): a retry after the
    /// longest wait would meet the same limit.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.kind,
            ProviderErrorKind::RateLimited
                | ProviderErrorKind::Server
                | ProviderErrorKind::Timeout
                | ProviderErrorKind::Network
        ) && !self.waits_too_long()
    }

    /// Whether the provider asked to wait longer than a retry waits.
    pub(crate) fn waits_too_long(&self) -> bool {
        self.retry_after
            .is_some_and(|asked| asked > crate::runtime::MAX_RETRY_AFTER_WAIT)
    }
}

/// The reference's finish reason (`stop`, `toolUse`, `length`; this runtime's own two in the
/// same camelCase): what a `turn` event reports. Records keep their snake_case names.
impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Stop => "stop",
            Self::ToolUse => "toolUse",
            Self::Length => "length",
            Self::ContentFilter => "contentFilter",
            Self::HookBlocked => "hookBlocked",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_output_caps_of_well_known_models_are_known_and_others_are_not() {
        let cases = [
            ("claude-3-5-haiku-latest", Some(8192)),
            ("us.anthropic.claude-sonnet-4-5-20250929-v1:0", Some(64_000)),
            ("claude-sonnet-4-6", None),
            ("openai/gpt-4-turbo", Some(4096)),
            ("gpt-4-0613", Some(8192)),
            ("gpt-4o-mini", Some(16_384)),
            ("gpt-4o-2024-05-13", Some(4_096)),
            ("openai/gpt-4o-2024-08-06", Some(16_384)),
            ("gpt-4.1-nano", Some(32_768)),
            ("o1-mini", Some(65_536)),
            ("o3", Some(100_000)),
            ("meta-llama/llama-3.1-8b-instruct", None),
        ];
        for (model, cap) in cases {
            assert_eq!(known_max_output_tokens(model), cap, "{model}");
        }
    }

    #[test]
    fn stop_reasons_read_as_the_reference_finish_reasons_in_events_and_snake_case_in_records() {
        let events: Vec<String> = [StopReason::Stop, StopReason::ToolUse, StopReason::Length]
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(events, ["stop", "toolUse", "length"]);
        assert_eq!(StopReason::HookBlocked.to_string(), "hookBlocked");
        // The persisted name is unchanged: records written before keep reading.
        assert_eq!(
            serde_json::to_value(StopReason::ToolUse).expect("serializes"),
            "tool_use"
        );
        assert_eq!(
            serde_json::from_value::<StopReason>(serde_json::json!("hook_blocked")).expect("reads"),
            StopReason::HookBlocked
        );
    }

    #[test]
    fn known_context_windows_are_what_the_prompt_may_take() {
        assert_eq!(known_context_window("gpt-5"), Some(272_000));
        assert_eq!(known_context_window("openai/gpt-5-mini"), Some(272_000));
        assert_eq!(known_context_window("o1-mini"), Some(128_000));
        assert_eq!(known_context_window("o1"), Some(200_000));
        assert_eq!(known_context_window("o1-preview"), Some(128_000));
        assert_eq!(known_context_window("gpt-5-chat-latest"), Some(128_000));
        assert_eq!(known_context_window("openai/gpt-5.1-chat"), Some(128_000));
        assert_eq!(known_context_window("gpt-5.1"), Some(272_000));
        assert_eq!(known_context_window("llama3.2"), None);
    }

    /// Encodes every message as JSON, counting the messages it encoded.
    fn encoded(messages: &Messages, format: &'static str, count: &mut usize) -> String {
        let mut out = BodyWriter::default();
        messages
            .encode_into(format, &mut out, |message, out| {
                *count += 1;
                serde_json::to_writer(out, message)
            })
            .expect("encodes");
        String::from_utf8(out.to_vec()).expect("JSON is UTF-8")
    }

    /// What encoding every message afresh gives.
    fn fresh(messages: &[ModelMessage]) -> String {
        messages
            .iter()
            .map(|message| serde_json::to_string(message).expect("encodes"))
            .collect::<Vec<_>>()
            .join(",")
    }

    #[test]
    fn a_history_encodes_only_the_messages_added_since_its_last_encoding() {
        let mut messages = Messages::from([ModelMessage::user("one"), ModelMessage::user("two")]);
        let mut count = 0;
        assert_eq!(encoded(&messages, "f", &mut count), fresh(&messages));
        assert_eq!(count, 2);
        // A request shares the history, and its encoding.
        let request = messages.clone();
        assert_eq!(encoded(&request, "f", &mut count), fresh(&messages));
        assert_eq!(count, 2, "nothing encoded again");
        drop(request);
        messages.push(ModelMessage::user("three"));
        assert_eq!(encoded(&messages, "f", &mut count), fresh(&messages));
        assert_eq!(count, 3, "only the new message");
    }

    #[test]
    fn changing_a_message_or_the_format_encodes_the_history_again() {
        let mut messages = Messages::from([ModelMessage::user("one"), ModelMessage::user("two")]);
        let mut count = 0;
        encoded(&messages, "f", &mut count);
        messages.make_mut()[0] = ModelMessage::user("changed");
        assert_eq!(encoded(&messages, "f", &mut count), fresh(&messages));
        assert_eq!(count, 4);
        messages.make_mut().remove(0);
        assert_eq!(encoded(&messages, "f", &mut count), fresh(&messages));
        assert_eq!(count, 5);
        assert_eq!(encoded(&messages, "g", &mut count), fresh(&messages));
        assert_eq!(count, 6, "another format starts over");
    }

    #[test]
    fn a_history_changed_while_a_request_shares_it_leaves_the_request_and_its_encoding_alone() {
        let mut messages = Messages::from([ModelMessage::user("one")]);
        let mut count = 0;
        let request = messages.clone();
        encoded(&request, "f", &mut count);
        messages.make_mut()[0] = ModelMessage::user("changed");
        messages.push(ModelMessage::user("two"));
        assert_eq!(encoded(&request, "f", &mut count), fresh(&request));
        assert_eq!(encoded(&messages, "f", &mut count), fresh(&messages));
        assert_eq!(request, [ModelMessage::user("one")]);
    }

    #[test]
    fn a_failed_encoding_keeps_what_was_encoded_before_it_and_nothing_of_itself() {
        let messages = Messages::from([ModelMessage::user("one"), ModelMessage::user("two")]);
        let mut out = BodyWriter::default();
        let failed = messages.encode_into("f", &mut out, |message, out| {
            if *message == ModelMessage::user("two") {
                out.extend_from_slice(b"half");
                return Err("no");
            }
            serde_json::to_writer(out, message).map_err(|_| "json")
        });
        assert_eq!(failed, Err("no"));
        assert!(out.to_vec().is_empty(), "nothing written on failure");
        let mut count = 0;
        assert_eq!(encoded(&messages, "f", &mut count), fresh(&messages));
        assert_eq!(count, 1, "the first message's encoding was kept");
    }
}
