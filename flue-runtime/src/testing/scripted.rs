//! An in-process model that answers from a script: agents are testable offline, and the
//! turn loop runs exactly as it does against a real provider.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use flue_core::usage::Usage;
use futures_util::stream;

use crate::provider::{
    ModelMessage, ModelProvider, ModelRequest, ModelResponse, ModelStream, ModelToolCall, ProviderError,
    ProviderErrorKind, StopReason, StreamEvent,
};

/// One scripted answer.
#[derive(Clone, Debug, PartialEq)]
pub enum ScriptedReply {
    /// Answer with text and stop.
    Text(String),
    /// Call tools (`(name, arguments JSON)`), optionally with some text.
    ToolCalls {
        /// Text before the calls.
        text: String,
        /// The calls.
        calls: Vec<(String, String)>,
    },
    /// Fail the call.
    Error(ProviderError),
}

impl ScriptedReply {
    /// A text answer.
    pub fn text(text: impl Into<String>) -> Self {
        Self::Text(text.into())
    }

    /// One tool call.
    pub fn tool_call(name: impl Into<String>, arguments: serde_json::Value) -> Self {
        Self::ToolCalls {
            text: String::new(),
            calls: vec![(name.into(), arguments.to_string())],
        }
    }

    /// Several tool calls in one step.
    pub fn tool_calls<N: Into<String>>(calls: impl IntoIterator<Item = (N, serde_json::Value)>) -> Self {
        Self::ToolCalls {
            text: String::new(),
            calls: calls
                .into_iter()
                .map(|(name, arguments)| (name.into(), arguments.to_string()))
                .collect(),
        }
    }
}

/// A [`ModelProvider`] (id `scripted` unless renamed) that answers each call with the next
/// scripted reply and records every request it received.
///
/// When the script runs out it answers with a provider error naming the problem, so a test
/// that makes more calls than it scripted fails loudly. [`ScriptedModel::echo`] answers
/// `You said: <last user message>` once its script is spent instead.
///
/// Its clones share one script and one record: every call takes the next reply, whichever
/// session makes it. Calls made at the same time (parallel `task` children, several instances
/// served at once) take the replies in the order they reach the model, which a test does not
/// choose; script such a test with one model per session (each with its own id), or make its
/// calls one after another. [`without_recording`](Self::without_recording) stops the
/// recording for every clone; [`with_id`](Self::with_id) and
/// [`with_context_window`](Self::with_context_window) set the clone they return.
#[derive(Clone)]
pub struct ScriptedModel {
    id: String,
    inner: Arc<Mutex<Inner>>,
    context_window: Option<u64>,
}

struct Inner {
    script: VecDeque<ScriptedReply>,
    echo: bool,
    /// Whether requests are kept for [`ScriptedModel::requests`].
    recording: bool,
    requests: Vec<ModelRequest>,
    calls: u64,
}

impl ScriptedModel {
    /// A model answering with `replies`, in order.
    pub fn new(replies: impl IntoIterator<Item = ScriptedReply>) -> Self {
        Self {
            id: "scripted".into(),
            context_window: None,
            inner: Arc::new(Mutex::new(Inner {
                script: replies.into_iter().collect(),
                echo: false,
                recording: true,
                requests: Vec::new(),
                calls: 0,
            })),
        }
    }

    /// A model that echoes the last user message (after any scripted replies).
    pub fn echo() -> Self {
        let model = Self::new([]);
        model.lock().echo = true;
        model
    }

    /// Keeps no request (for [`ScriptedModel::requests`]): a model serving for long (an
    /// example's offline mode, a benchmark) would otherwise hold every request it received,
    /// each with its conversation's history.
    pub fn without_recording(self) -> Self {
        self.lock().recording = false;
        self
    }

    /// Renames the provider id.
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = id.into();
        self
    }

    /// Reports a context window of `tokens` (for threshold compaction; none by default).
    pub fn with_context_window(mut self, tokens: u64) -> Self {
        self.context_window = Some(tokens);
        self
    }

    /// Appends replies to the script.
    pub fn push(&self, reply: ScriptedReply) {
        self.lock().script.push_back(reply);
    }

    /// Every request received, in order (none [`without_recording`](Self::without_recording)).
    pub fn requests(&self) -> Vec<ModelRequest> {
        self.lock().requests.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl ModelProvider for ScriptedModel {
    fn id(&self) -> &str {
        &self.id
    }

    fn context_window(&self, _model: &str) -> Option<u64> {
        self.context_window
    }

    fn stream(&self, request: &ModelRequest) -> ModelStream {
        let mut inner = self.lock();
        inner.calls += 1;
        let call = inner.calls;
        let last_user = request.messages.iter().rev().find_map(|message| match message {
            ModelMessage::User { content, .. } => Some(content.clone()),
            _ => None,
        });
        if inner.recording {
            inner.requests.push(request.clone());
        }
        let reply = match inner.script.pop_front() {
            Some(reply) => reply,
            None if inner.echo => ScriptedReply::Text(format!("You said: {}", last_user.unwrap_or_default())),
            None => ScriptedReply::Error(ProviderError::new(
                ProviderErrorKind::InvalidResponse,
                format!("the scripted model has no reply left for call {call}"),
            )),
        };
        drop(inner);
        let events: Vec<Result<StreamEvent, ProviderError>> = match reply {
            ScriptedReply::Error(error) => vec![Err(error)],
            ScriptedReply::Text(text) => {
                let mut events: Vec<_> = text
                    .split_inclusive(' ')
                    .map(|word| Ok(StreamEvent::TextDelta(word.to_owned())))
                    .collect();
                events.push(Ok(StreamEvent::Completed(response(text, Vec::new()))));
                events
            }
            ScriptedReply::ToolCalls { text, calls } => {
                let calls: Vec<ModelToolCall> = calls
                    .into_iter()
                    .enumerate()
                    .map(|(index, (name, arguments))| ModelToolCall {
                        id: format!("call_{call}_{index}"),
                        name,
                        arguments,
                    })
                    .collect();
                let mut events = Vec::new();
                if !text.is_empty() {
                    events.push(Ok(StreamEvent::TextDelta(text.clone())));
                }
                for (index, tool_call) in calls.iter().enumerate() {
                    events.push(Ok(StreamEvent::ToolCallStarted {
                        index,
                        id: tool_call.id.clone(),
                        name: tool_call.name.clone(),
                    }));
                    events.push(Ok(StreamEvent::ToolCallArguments {
                        index,
                        delta: tool_call.arguments.clone(),
                    }));
                }
                events.push(Ok(StreamEvent::Completed(response(text, calls))));
                events
            }
        };
        Box::pin(stream::iter(events))
    }
}

fn response(text: String, tool_calls: Vec<ModelToolCall>) -> ModelResponse {
    let stop_reason = if tool_calls.is_empty() {
        StopReason::Stop
    } else {
        StopReason::ToolUse
    };
    let usage = Usage {
        input_tokens: 10,
        output_tokens: (text.len() as u64 / 4).max(1),
        ..Usage::default()
    };
    ModelResponse {
        text,
        reasoning: String::new(),
        reasoning_blocks: Vec::new(),
        tool_calls,
        stop_reason,
        usage,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use super::*;

    fn request(text: &str) -> ModelRequest {
        ModelRequest {
            model: "m".into(),
            system: None,
            messages: vec![ModelMessage::user(text)].into(),
            tools: Vec::new(),
            thinking_level: flue_core::model::ThinkingLevel::Off,
            max_output_tokens: None,
            max_retries: None,
        }
    }

    #[test]
    fn a_model_without_recording_keeps_no_request() {
        let recording = ScriptedModel::echo();
        let quiet = ScriptedModel::echo().without_recording();
        for model in [&recording, &quiet] {
            drop(model.stream(&request("one")));
            drop(model.stream(&request("two")));
        }
        assert_eq!(recording.requests().len(), 2);
        assert!(quiet.requests().is_empty());
    }
}
