//! The built-in providers over the real reqwest path, against the loopback fixture server.
//!
//! Keys are given with `with_api_key` (no environment mutation); each provider names a unique
//! environment variable so the messages that mention it are checkable.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use flue_runtime::model::ThinkingLevel;
use flue_runtime::provider::anthropic::AnthropicProvider;
use flue_runtime::provider::openai::{OpenAiProvider, RetryPolicy};
use flue_runtime::provider::registry::ResolveError;
use flue_runtime::provider::{
    ContentAt, ModelMessage, ModelProvider, ModelRequest, ModelResponse, ModelToolCall, ProviderError,
    ProviderErrorKind, ProviderRegistry, ReasoningBlock, StopReason, StreamEvent, ToolSpec,
};
use flue_runtime::testing::fixture_server::{
    AnthropicEvent, FIXTURE_USAGE, FixtureReply, FixtureServer, OpenAiChunk, RecordedRequest,
};
use flue_runtime::usage::Usage;
use futures_util::StreamExt;
use serde_json::json;

mod harness;

const KEY: &str = "sk-fixture-secret-key-0123456789";

/// Retries that wait only milliseconds.
fn fast_retries() -> RetryPolicy {
    RetryPolicy::new(3, Duration::from_millis(5))
}

fn openai(server: &FixtureServer, key_env: &str) -> OpenAiProvider {
    OpenAiProvider::compatible("fixture", server.base_url(), key_env)
        .with_api_key(KEY)
        .with_retry_policy(fast_retries())
}

fn anthropic(server: &FixtureServer) -> AnthropicProvider {
    AnthropicProvider::anthropic()
        .with_base_url(server.base_url())
        .with_key_env("FLUE_TEST_ANTHROPIC_KEY")
        .with_api_key(KEY)
        .with_retry_policy(fast_retries())
}

fn request(text: &str) -> ModelRequest {
    ModelRequest {
        model: "fixture-model".to_owned(),
        system: None,
        messages: vec![ModelMessage::user(text)].into(),
        tools: Vec::new(),
        thinking_level: ThinkingLevel::Off,
        max_output_tokens: None,
        max_retries: None,
    }
}

/// Every event of a call, and the error that ended it (if any).
async fn run(provider: &dyn ModelProvider, request: ModelRequest) -> (Vec<StreamEvent>, Option<ProviderError>) {
    let mut stream = provider.stream(&request);
    let mut events = Vec::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => events.push(event),
            Err(error) => {
                assert!(stream.next().await.is_none(), "the stream goes on after an error");
                return (events, Some(error));
            }
        }
    }
    (events, None)
}

/// The response of a call that must complete; checks `Completed` comes once, last.
async fn complete(provider: &dyn ModelProvider, request: ModelRequest) -> (Vec<StreamEvent>, ModelResponse) {
    let (mut events, error) = run(provider, request).await;
    assert_eq!(error, None, "events so far: {events:?}");
    let Some(StreamEvent::Completed(response)) = events.pop() else {
        panic!("no Completed last: {events:?}")
    };
    assert!(
        !events.iter().any(|e| matches!(e, StreamEvent::Completed(_))),
        "Completed twice"
    );
    (events, response)
}

/// The error of a call that must fail (with no `Completed` before it).
async fn fail(provider: &dyn ModelProvider, request: ModelRequest) -> (Vec<StreamEvent>, ProviderError) {
    let (events, error) = run(provider, request).await;
    assert!(
        !events.iter().any(|e| matches!(e, StreamEvent::Completed(_))),
        "completed: {events:?}"
    );
    let Some(error) = error else {
        panic!("no error; events: {events:?}")
    };
    (events, error)
}

fn text_deltas(events: &[StreamEvent]) -> Vec<&str> {
    events
        .iter()
        .filter_map(|e| match e {
            StreamEvent::TextDelta(text) => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

/// The arguments streamed for call `index`, concatenated.
fn streamed_arguments(events: &[StreamEvent], index: usize) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            StreamEvent::ToolCallArguments { index: i, delta } if *i == index => Some(delta.as_str()),
            _ => None,
        })
        .collect()
}

fn started(events: &[StreamEvent]) -> Vec<(usize, &str, &str)> {
    events
        .iter()
        .filter_map(|e| match e {
            StreamEvent::ToolCallStarted { index, id, name } => Some((*index, id.as_str(), name.as_str())),
            _ => None,
        })
        .collect()
}

fn call(id: &str, name: &str, arguments: &str) -> ModelToolCall {
    ModelToolCall {
        id: id.to_owned(),
        name: name.to_owned(),
        arguments: arguments.to_owned(),
    }
}

fn paths(requests: &[RecordedRequest]) -> Vec<&str> {
    requests.iter().map(|r| r.path.as_str()).collect()
}

// ---- streaming ----

#[tokio::test]
async fn openai_text_streams_as_deltas_and_completes_once() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_text("Hello there, world"));
    let (events, response) = complete(&openai(&server, "FLUE_TEST_KEY_TEXT"), request("hi")).await;
    assert_eq!(text_deltas(&events), ["Hello", " there,", " world"]);
    assert_eq!(response.text, "Hello there, world");
    assert_eq!(response.stop_reason, StopReason::Stop);
    assert!(response.tool_calls.is_empty());
    assert_eq!(paths(&server.requests()), ["/v1/chat/completions"]);
}

#[tokio::test]
async fn anthropic_text_streams_as_deltas_and_completes_once() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::anthropic_text("Bonjour tout le monde"));
    let (events, response) = complete(&anthropic(&server), request("salut")).await;
    assert_eq!(text_deltas(&events), ["Bonjour", " tout", " le", " monde"]);
    assert_eq!(response.text, "Bonjour tout le monde");
    assert_eq!(response.stop_reason, StopReason::Stop);
    assert_eq!(paths(&server.requests()), ["/v1/messages"]);
}

#[tokio::test]
async fn reasoning_streams_separately_from_text() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_chunks([
        OpenAiChunk::Reasoning("Think".into()),
        OpenAiChunk::Reasoning("ing.".into()),
        OpenAiChunk::Text("Answer".into()),
        OpenAiChunk::Finish("stop".into()),
        OpenAiChunk::Done,
    ]));
    server.push(FixtureReply::anthropic_events([
        AnthropicEvent::MessageStart(Usage::default()),
        AnthropicEvent::ThinkingStart { index: 0 },
        AnthropicEvent::ThinkingDelta {
            index: 0,
            thinking: "Hmm.".into(),
        },
        AnthropicEvent::BlockStop { index: 0 },
        AnthropicEvent::Ping,
        AnthropicEvent::TextStart { index: 1 },
        AnthropicEvent::TextDelta {
            index: 1,
            text: "Yes".into(),
        },
        AnthropicEvent::BlockStop { index: 1 },
        AnthropicEvent::MessageDelta {
            stop_reason: "end_turn".into(),
            output_tokens: 3,
        },
        AnthropicEvent::MessageStop,
    ]));
    let (events, response) = complete(&openai(&server, "FLUE_TEST_KEY_REASONING"), request("q")).await;
    assert_eq!(
        events,
        [
            StreamEvent::ReasoningDelta("Think".into()),
            StreamEvent::ReasoningDelta("ing.".into()),
            StreamEvent::TextDelta("Answer".into())
        ]
    );
    assert_eq!(
        (response.reasoning.as_str(), response.text.as_str()),
        ("Thinking.", "Answer")
    );
    let (events, response) = complete(&anthropic(&server), request("q")).await;
    assert_eq!(
        events,
        [
            StreamEvent::ReasoningDelta("Hmm.".into()),
            StreamEvent::TextDelta("Yes".into())
        ]
    );
    assert_eq!((response.reasoning.as_str(), response.text.as_str()), ("Hmm.", "Yes"));
}

/// A thinking step that calls `lookup`: a signed thinking block, a redacted one, an unsigned
/// one (the stream was cut before its signature), then the call.
fn signed_thinking_tool_step() -> FixtureReply {
    FixtureReply::anthropic_events([
        AnthropicEvent::MessageStart(Usage::default()),
        AnthropicEvent::ThinkingStart { index: 0 },
        AnthropicEvent::ThinkingDelta {
            index: 0,
            thinking: "Look it ".into(),
        },
        AnthropicEvent::ThinkingDelta {
            index: 0,
            thinking: "up.".into(),
        },
        AnthropicEvent::SignatureDelta {
            index: 0,
            signature: "sig-0".into(),
        },
        AnthropicEvent::BlockStop { index: 0 },
        AnthropicEvent::RedactedThinking {
            index: 1,
            data: "encrypted-1".into(),
        },
        AnthropicEvent::BlockStop { index: 1 },
        AnthropicEvent::ThinkingStart { index: 2 },
        AnthropicEvent::ThinkingDelta {
            index: 2,
            thinking: " Unsigned.".into(),
        },
        AnthropicEvent::BlockStop { index: 2 },
        AnthropicEvent::ToolUseStart {
            index: 3,
            id: "call_1".into(),
            name: "lookup".into(),
        },
        AnthropicEvent::InputJsonDelta {
            index: 3,
            partial_json: "{\"q\":1}".into(),
        },
        AnthropicEvent::BlockStop { index: 3 },
        AnthropicEvent::MessageDelta {
            stop_reason: "tool_use".into(),
            output_tokens: 9,
        },
        AnthropicEvent::MessageStop,
    ])
}

#[tokio::test]
async fn anthropic_thinking_keeps_its_signed_and_redacted_blocks_and_drops_unsigned_ones() {
    let server = FixtureServer::start().await;
    server.push(signed_thinking_tool_step());
    let (events, response) = complete(&anthropic(&server), request("q")).await;
    // Every piece of reasoning text streams, signed or not; redacted reasoning shows nothing.
    assert_eq!(
        events[..3],
        [
            StreamEvent::ReasoningDelta("Look it ".into()),
            StreamEvent::ReasoningDelta("up.".into()),
            StreamEvent::ReasoningDelta(" Unsigned.".into()),
        ]
    );
    assert_eq!(response.reasoning, "Look it up. Unsigned.");
    assert_eq!(
        response.reasoning_blocks,
        [
            ReasoningBlock::Thinking {
                thinking: "Look it up.".into(),
                signature: "sig-0".into(),
                at: Some(ContentAt::default()),
            },
            ReasoningBlock::Redacted {
                data: "encrypted-1".into(),
                at: Some(ContentAt::default()),
            },
        ]
    );
    assert_eq!(response.tool_calls.len(), 1);
}

/// A step that thinks between its calls, with text between them too (Claude's interleaved
/// thinking): `[thinking, text, tool_use, thinking, text, tool_use]`.
fn interleaved_thinking_tool_step() -> FixtureReply {
    let thinking = |index: usize, text: &str| {
        [
            AnthropicEvent::ThinkingStart { index },
            AnthropicEvent::ThinkingDelta {
                index,
                thinking: text.into(),
            },
            AnthropicEvent::SignatureDelta {
                index,
                signature: format!("sig-{index}"),
            },
            AnthropicEvent::BlockStop { index },
        ]
    };
    let text = |index: usize, text: &str| {
        [
            AnthropicEvent::TextStart { index },
            AnthropicEvent::TextDelta {
                index,
                text: text.into(),
            },
            AnthropicEvent::BlockStop { index },
        ]
    };
    let call = |index: usize, id: &str| {
        [
            AnthropicEvent::ToolUseStart {
                index,
                id: id.into(),
                name: "lookup".into(),
            },
            AnthropicEvent::InputJsonDelta {
                index,
                partial_json: format!("{{\"q\":{index}}}"),
            },
            AnthropicEvent::BlockStop { index },
        ]
    };
    let mut events = vec![AnthropicEvent::MessageStart(Usage::default())];
    events.extend(thinking(0, "First the city."));
    events.extend(text(1, "Looking up the city. "));
    events.extend(call(2, "call_a"));
    events.extend(thinking(3, "Then its weather."));
    events.extend(text(4, "And its weather."));
    events.extend(call(5, "call_b"));
    events.extend([
        AnthropicEvent::MessageDelta {
            stop_reason: "tool_use".into(),
            output_tokens: 9,
        },
        AnthropicEvent::MessageStop,
    ]);
    FixtureReply::anthropic_events(events)
}

/// Anthropic refuses a tool loop's next call (a 400, "thinking blocks … cannot be modified")
/// unless the step's thinking blocks come back exactly where the model wrote them.
#[tokio::test]
async fn anthropic_sends_a_step_that_thought_between_its_calls_back_in_the_order_it_came() {
    let server = FixtureServer::start().await;
    server.push(interleaved_thinking_tool_step());
    server.push(FixtureReply::anthropic_text("Sunny."));
    let provider = anthropic(&server);
    let mut call = request("q");
    call.thinking_level = ThinkingLevel::High;
    let (_, step) = complete(&provider, call.clone()).await;
    assert_eq!(step.text, "Looking up the city. And its weather.");
    let mut messages = vec![
        ModelMessage::user("q"),
        ModelMessage::Assistant {
            text: step.text.clone(),
            tool_calls: step.tool_calls.clone(),
            reasoning: step.reasoning_blocks.clone(),
        },
    ];
    for id in ["call_a", "call_b"] {
        messages.push(ModelMessage::Tool {
            tool_call_id: id.into(),
            name: "lookup".into(),
            content: "42".into(),
            is_error: false,
        });
    }
    call.messages = messages.into();
    complete(&provider, call).await;
    assert_eq!(
        server.requests()[1].body["messages"][1],
        json!({"role": "assistant", "content": [
            {"type": "thinking", "thinking": "First the city.", "signature": "sig-0"},
            {"type": "text", "text": "Looking up the city. "},
            {"type": "tool_use", "id": "call_a", "name": "lookup", "input": {"q": 2}},
            {"type": "thinking", "thinking": "Then its weather.", "signature": "sig-3"},
            {"type": "text", "text": "And its weather."},
            {"type": "tool_use", "id": "call_b", "name": "lookup", "input": {"q": 5}},
        ]})
    );
}

/// Positions a step cannot have (past its text) and blocks without one (recorded before
/// positions were kept): the blocks go first, then the text.
#[tokio::test]
async fn anthropic_sends_reasoning_first_when_the_step_no_longer_matches_its_positions() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::anthropic_text("Sunny."));
    let provider = anthropic(&server);
    let mut call = request("q");
    call.thinking_level = ThinkingLevel::High;
    let signed = |index: usize, at: Option<ContentAt>| ReasoningBlock::Thinking {
        thinking: format!("thought {index}"),
        signature: format!("sig-{index}"),
        at,
    };
    call.messages = vec![
        ModelMessage::user("q"),
        ModelMessage::Assistant {
            text: "short".into(),
            tool_calls: Vec::new(),
            reasoning: vec![signed(0, None), signed(1, Some(ContentAt { text: 40, calls: 0 }))],
        },
        ModelMessage::user("again"),
    ]
    .into();
    complete(&provider, call).await;
    assert_eq!(
        server.requests()[0].body["messages"][1]["content"],
        json!([
            {"type": "thinking", "thinking": "thought 0", "signature": "sig-0"},
            {"type": "thinking", "thinking": "thought 1", "signature": "sig-1"},
            {"type": "text", "text": "short"},
        ])
    );
}

#[tokio::test]
async fn anthropic_sends_a_steps_signed_reasoning_back_first_and_keeps_thinking_on_in_its_tool_loop() {
    let server = FixtureServer::start().await;
    server.push(signed_thinking_tool_step());
    server.push(FixtureReply::anthropic_text("Found."));
    server.push(FixtureReply::anthropic_text("Found."));
    let provider = anthropic(&server);
    let mut call = request("q");
    call.thinking_level = ThinkingLevel::High;
    let (_, step) = complete(&provider, call.clone()).await;
    let mut messages = vec![
        ModelMessage::user("q"),
        ModelMessage::Assistant {
            text: step.text.clone(),
            tool_calls: step.tool_calls.clone(),
            reasoning: step.reasoning_blocks.clone(),
        },
        ModelMessage::Tool {
            tool_call_id: "call_1".into(),
            name: "lookup".into(),
            content: "42".into(),
            is_error: false,
        },
    ];
    call.messages = messages.clone().into();
    complete(&provider, call.clone()).await;
    let body = &server.requests()[1].body;
    assert_eq!(body["thinking"], json!({"type": "enabled", "budget_tokens": 16384}));
    assert_eq!(
        body["messages"][1],
        json!({"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Look it up.", "signature": "sig-0"},
            {"type": "redacted_thinking", "data": "encrypted-1"},
            {"type": "tool_use", "id": "call_1", "name": "lookup", "input": {"q": 1}},
        ]})
    );
    // With thinking off, the reasoning stays home (the API wants it only for thinking calls).
    call.thinking_level = ThinkingLevel::Off;
    messages.push(ModelMessage::user("again"));
    call.messages = messages.into();
    complete(&provider, call).await;
    let body = &server.requests()[2].body;
    assert_eq!(body.get("thinking"), None);
    assert_eq!(
        body["messages"][1]["content"],
        json!([{"type": "tool_use", "id": "call_1", "name": "lookup", "input": {"q": 1}}])
    );
}

#[tokio::test]
async fn a_llama_cpp_error_line_in_the_stream_fails_the_call_as_what_it_says() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::raw_sse([
        "error: {\"code\":400,\"message\":\"the request exceeds the available context size, try increasing it\",\"type\":\"exceed_context_size_error\",\"n_prompt_tokens\":5000,\"n_ctx\":4096}\n\n",
        "data: [DONE]\n\n",
    ]));
    let (_, error) = fail(&openai(&server, "FLUE_TEST_KEY_LLAMA_ERROR"), request("q")).await;
    assert_eq!(error.kind, ProviderErrorKind::ContextOverflow, "{error}");
    assert!(error.message.contains("exceeds the available context size"), "{error}");
}

#[tokio::test]
async fn an_error_event_that_is_not_json_fails_the_call_as_what_it_says() {
    let server = FixtureServer::start().await;
    // Plain text where the error object would be: the server's words, not a malformed stream.
    server.push(FixtureReply::raw_sse([
        "event: error\ndata: upstream overloaded, try again later\n\n",
    ]));
    // llama.cpp's error line with its `data: [DONE]` in the same event (no blank line between).
    server.push(FixtureReply::raw_sse([
        "error: {\"code\":400,\"message\":\"the request exceeds the available context size, try increasing it\",\"type\":\"exceed_context_size_error\"}\n",
        "data: [DONE]\n\n",
    ]));
    let provider = openai(&server, "FLUE_TEST_KEY_TEXT_ERROR").with_retry_policy(RetryPolicy::none());
    let (_, error) = fail(&provider, request("q")).await;
    assert_eq!(error.kind, ProviderErrorKind::Server, "{error}");
    assert!(
        error.message.contains("upstream overloaded, try again later"),
        "{error}"
    );
    assert!(!error.message.contains("malformed"), "{error}");
    let (_, error) = fail(&provider, request("q")).await;
    assert_eq!(error.kind, ProviderErrorKind::ContextOverflow, "{error}");
    assert!(error.message.contains("exceeds the available context size"), "{error}");
}

/// An Anthropic-compatible proxy's `error` event whose data is the bare error object (its
/// `type` not `"error"`), text, or llama.cpp's error line before `data: [DONE]`: each fails the
/// call as what it says.
#[tokio::test]
async fn an_anthropic_error_event_fails_the_call_as_what_it_says_whatever_its_data() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::raw_sse([
        "event: error\ndata: {\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}\n\n",
    ]));
    server.push(FixtureReply::raw_sse([
        "event: error\ndata: upstream overloaded, try again later\n\n",
    ]));
    server.push(FixtureReply::raw_sse([
        "error: {\"code\":400,\"message\":\"the request exceeds the available context size, try increasing it\",\"type\":\"exceed_context_size_error\"}\n\n",
        "data: [DONE]\n\n",
    ]));
    let provider = anthropic(&server).with_retry_policy(RetryPolicy::none());
    let (_, error) = fail(&provider, request("q")).await;
    assert_eq!(error.kind, ProviderErrorKind::Server, "{error}");
    assert!(error.message.contains("Overloaded"), "{error}");
    let (_, error) = fail(&provider, request("q")).await;
    assert_eq!(error.kind, ProviderErrorKind::Server, "{error}");
    assert!(error.message.contains("upstream overloaded"), "{error}");
    let (_, error) = fail(&provider, request("q")).await;
    assert_eq!(error.kind, ProviderErrorKind::ContextOverflow, "{error}");
    // A `data: [DONE]` alone ends an Anthropic stream as it ends (cut short without a stop).
    server.push(FixtureReply::raw_sse(["data: [DONE]\n\n"]));
    let (_, error) = fail(&provider, request("q")).await;
    assert_eq!(error.kind, ProviderErrorKind::Network, "{error}");
    assert!(!error.message.contains("malformed"), "{error}");
}

#[tokio::test]
async fn a_stream_done_without_any_choice_or_finished_with_error_is_no_answer() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::raw_sse(["data: [DONE]\n\n"]));
    server.push(FixtureReply::openai_chunks([
        OpenAiChunk::Text("Partial".into()),
        OpenAiChunk::Finish("error".into()),
        OpenAiChunk::Done,
    ]));
    let provider = openai(&server, "FLUE_TEST_KEY_NO_CHOICE").with_retry_policy(RetryPolicy::none());
    let (_, error) = fail(&provider, request("q")).await;
    assert_eq!(error.kind, ProviderErrorKind::Network, "{error}");
    let (events, error) = fail(&provider, request("q")).await;
    assert_eq!(events, [StreamEvent::TextDelta("Partial".into())]);
    assert_eq!(error.kind, ProviderErrorKind::Server, "{error}");
    assert!(error.message.contains("finish_reason \"error\""), "{error}");
}

/// A finish reason is read by what it means, whatever server names it: a failure a server
/// names (z.ai's `network_error`, DeepSeek's `insufficient_system_resource`) or one this build
/// does not know is no answer (what was streamed would have settled as the reply), and is
/// retried as a server error; a content filter under another name is one.
#[tokio::test]
async fn a_finish_reason_is_read_by_what_it_means_and_an_unknown_one_is_no_answer() {
    let server = FixtureServer::start().await;
    let provider = openai(&server, "FLUE_TEST_KEY_FINISHES").with_retry_policy(RetryPolicy::none());
    let finishing = |reason: &str| {
        FixtureReply::openai_chunks([
            OpenAiChunk::Text("Partial".into()),
            OpenAiChunk::Finish(reason.into()),
            OpenAiChunk::Done,
        ])
    };
    for (reason, stop) in [
        ("STOP", StopReason::Stop),
        ("end_turn", StopReason::Stop),
        ("model_length", StopReason::Length),
        ("model_context_window_exceeded", StopReason::Length),
        ("sensitive", StopReason::ContentFilter),
    ] {
        server.push(finishing(reason));
        let (_, response) = complete(&provider, request("q")).await;
        assert_eq!(response.stop_reason, stop, "{reason}");
    }
    for reason in ["network_error", "insufficient_system_resource", "something_new"] {
        server.push(finishing(reason));
        let (_, error) = fail(&provider, request("q")).await;
        assert_eq!(error.kind, ProviderErrorKind::Server, "{reason}: {error}");
        assert!(
            error.message.contains(&format!("finish_reason \"{reason}\"")),
            "{error}"
        );
    }
    let anthropic = anthropic(&server).with_retry_policy(RetryPolicy::none());
    server.push(FixtureReply::anthropic_events([
        AnthropicEvent::MessageStart(Usage::default()),
        AnthropicEvent::TextStart { index: 0 },
        AnthropicEvent::TextDelta {
            index: 0,
            text: "Partial".into(),
        },
        AnthropicEvent::BlockStop { index: 0 },
        AnthropicEvent::MessageDelta {
            stop_reason: "something_new".into(),
            output_tokens: 1,
        },
        AnthropicEvent::MessageStop,
    ]));
    let (_, error) = fail(&anthropic, request("q")).await;
    assert_eq!(error.kind, ProviderErrorKind::Server, "{error}");
    assert!(error.message.contains("stop_reason \"something_new\""), "{error}");
}

#[tokio::test]
async fn without_asking_for_usage_a_stream_that_ends_after_its_finish_reason_completes() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_chunks([
        OpenAiChunk::Text("Done".into()),
        OpenAiChunk::Finish("stop".into()),
    ]));
    let provider = openai(&server, "FLUE_TEST_KEY_NO_USAGE").with_stream_usage(false);
    let (_, response) = complete(&provider, request("q")).await;
    assert_eq!(response.text, "Done");
    assert_eq!(server.requests()[0].body.get("stream_options"), None);
}

#[tokio::test]
async fn an_exhausted_quota_is_not_retried_as_a_rate_limit() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_error(
        429,
        "insufficient_quota",
        "You exceeded your current quota, please check your plan and billing details.",
    ));
    let (_, error) = fail(&openai(&server, "FLUE_TEST_KEY_QUOTA"), request("q")).await;
    assert_eq!(error.kind, ProviderErrorKind::BadRequest, "{error}");
    assert!(!error.is_retryable());
    assert!(error.message.contains("exceeded your current quota"), "{error}");
    assert_eq!(server.requests().len(), 1, "retried");
}

/// DeepSeek's thinking mode refuses a call of a tool loop whose steps come back without their
/// `reasoning_content`: a provider that echoes reasoning keeps it with the step and sends it
/// back; others keep nothing and send nothing.
#[tokio::test]
async fn echoed_reasoning_goes_back_with_its_step_as_reasoning_content() {
    let server = FixtureServer::start().await;
    let reasoning_step = || {
        FixtureReply::openai_chunks([
            OpenAiChunk::Reasoning("Need the tool.".into()),
            OpenAiChunk::ToolCallStart {
                index: 0,
                id: "call_1".into(),
                name: "lookup".into(),
            },
            OpenAiChunk::ToolCallArguments {
                index: 0,
                fragment: "{}".into(),
            },
            OpenAiChunk::Finish("tool_calls".into()),
            OpenAiChunk::Usage(Usage::default()),
            OpenAiChunk::Done,
        ])
    };
    server.push(reasoning_step());
    server.push(FixtureReply::openai_text("Found."));
    server.push(reasoning_step());
    let echoing = openai(&server, "FLUE_TEST_KEY_ECHO").with_reasoning_echo(true);
    let (_, step) = complete(&echoing, request("q")).await;
    assert_eq!(
        step.reasoning_blocks,
        [ReasoningBlock::Text {
            text: "Need the tool.".into()
        }]
    );
    let mut call = request("q");
    call.messages = vec![
        ModelMessage::user("q"),
        ModelMessage::Assistant {
            text: String::new(),
            tool_calls: step.tool_calls.clone(),
            reasoning: step.reasoning_blocks.clone(),
        },
        ModelMessage::Tool {
            tool_call_id: "call_1".into(),
            name: "lookup".into(),
            content: "42".into(),
            is_error: false,
        },
    ]
    .into();
    complete(&echoing, call).await;
    assert_eq!(
        server.requests()[1].body["messages"][1]["reasoning_content"],
        "Need the tool."
    );
    // Without the echo (the default of a compatible server), the reasoning is shown only.
    let (_, step) = complete(&openai(&server, "FLUE_TEST_KEY_NO_ECHO"), request("q")).await;
    assert_eq!(
        (step.reasoning.as_str(), step.reasoning_blocks.len()),
        ("Need the tool.", 0)
    );
}

// ---- tool calls ----

#[tokio::test]
async fn openai_tool_call_arguments_split_into_one_character_chunks_reassemble_exactly() {
    let arguments = r#"{"city":"Paris","units":"metric","note":"é \"quoted\" \\ ok"}"#;
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_tool_calls_split(
        vec![("call_1", "get_weather", arguments)],
        1,
    ));
    let (events, response) = complete(&openai(&server, "FLUE_TEST_KEY_SPLIT"), request("weather?")).await;
    let fragments = events
        .iter()
        .filter(|e| matches!(e, StreamEvent::ToolCallArguments { .. }))
        .count();
    assert_eq!(fragments, arguments.chars().count(), "one event per chunk");
    assert_eq!(started(&events), [(0, "call_1", "get_weather")]);
    assert_eq!(streamed_arguments(&events, 0), arguments);
    assert_eq!(response.tool_calls, [call("call_1", "get_weather", arguments)]);
    assert_eq!(response.stop_reason, StopReason::ToolUse);
    let parsed: serde_json::Value = serde_json::from_str(&response.tool_calls[0].arguments).unwrap();
    assert_eq!(parsed["note"], "é \"quoted\" \\ ok");
}

#[tokio::test]
async fn openai_two_parallel_tool_calls_interleaved_by_index_stay_apart_and_ordered() {
    let first = r#"{"city":"Paris"}"#;
    let second = r#"{"timezone":"Europe/Berlin"}"#;
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_tool_calls_interleaved(
        vec![("call_a", "get_weather", first), ("call_b", "get_time", second)],
        3,
    ));
    let (events, response) = complete(&openai(&server, "FLUE_TEST_KEY_PARALLEL"), request("both")).await;
    assert_eq!(
        started(&events),
        [(0, "call_a", "get_weather"), (1, "call_b", "get_time")]
    );
    assert_eq!(streamed_arguments(&events, 0), first);
    assert_eq!(streamed_arguments(&events, 1), second);
    assert_eq!(
        response.tool_calls,
        [call("call_a", "get_weather", first), call("call_b", "get_time", second)]
    );
}

#[tokio::test]
async fn openai_two_whole_tool_calls_streamed_one_after_the_other_complete_as_two_in_order() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_tool_calls(vec![
        ("c1", "a", r#"{"n":1}"#),
        ("c2", "b", r#"{"n":2}"#),
    ]));
    let (_, response) = complete(&openai(&server, "FLUE_TEST_KEY_SEQUENTIAL"), request("go")).await;
    assert_eq!(
        response.tool_calls,
        [call("c1", "a", r#"{"n":1}"#), call("c2", "b", r#"{"n":2}"#)]
    );
}

#[tokio::test]
async fn anthropic_tool_use_blocks_reassemble_their_partial_json() {
    let first = r#"{"path":"src/main.rs","line":42}"#;
    let second = r#"{"query":"fn main"}"#;
    let server = FixtureServer::start().await;
    server.push(FixtureReply::anthropic_tool_use_split(
        vec![("toolu_1", "read", first), ("toolu_2", "grep", second)],
        2,
    ));
    let (events, response) = complete(&anthropic(&server), request("look")).await;
    assert_eq!(started(&events), [(0, "toolu_1", "read"), (1, "toolu_2", "grep")]);
    assert_eq!(streamed_arguments(&events, 0), first);
    assert_eq!(streamed_arguments(&events, 1), second);
    assert_eq!(
        response.tool_calls,
        [call("toolu_1", "read", first), call("toolu_2", "grep", second)]
    );
    assert_eq!(response.stop_reason, StopReason::ToolUse);
}

#[tokio::test]
async fn anthropic_tool_use_after_text_is_indexed_among_tool_calls_only() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::anthropic_events([
        AnthropicEvent::MessageStart(Usage::default()),
        AnthropicEvent::TextStart { index: 0 },
        AnthropicEvent::TextDelta {
            index: 0,
            text: "Let me check.".into(),
        },
        AnthropicEvent::BlockStop { index: 0 },
        AnthropicEvent::ToolUseStart {
            index: 1,
            id: "toolu_9".into(),
            name: "ls".into(),
        },
        AnthropicEvent::BlockStop { index: 1 },
        AnthropicEvent::MessageDelta {
            stop_reason: "tool_use".into(),
            output_tokens: 9,
        },
        AnthropicEvent::MessageStop,
    ]));
    let (events, response) = complete(&anthropic(&server), request("files?")).await;
    assert_eq!(started(&events), [(0, "toolu_9", "ls")]);
    assert_eq!(response.text, "Let me check.");
    assert_eq!(
        response.tool_calls,
        [call("toolu_9", "ls", "{}")],
        "no input deltas means empty arguments"
    );
}

// ---- usage ----

#[tokio::test]
async fn openai_usage_chunk_is_recorded_with_cache_and_reasoning_tokens() {
    let usage = Usage {
        input_tokens: 100,
        output_tokens: 40,
        cache_read_tokens: 64,
        cache_write_tokens: 0,
        reasoning_tokens: 16,
    };
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_text("hi"));
    server.push(FixtureReply::openai_chunks([
        OpenAiChunk::Text("ok".into()),
        OpenAiChunk::Finish("length".into()),
        OpenAiChunk::Usage(usage),
        OpenAiChunk::Done,
    ]));
    let provider = openai(&server, "FLUE_TEST_KEY_USAGE");
    let (_, response) = complete(&provider, request("a")).await;
    assert_eq!(response.usage, FIXTURE_USAGE);
    let (_, response) = complete(&provider, request("b")).await;
    assert_eq!(response.usage, usage);
    assert_eq!(response.stop_reason, StopReason::Length);
}

#[tokio::test]
async fn anthropic_usage_counts_the_whole_prompt_and_the_final_output_tokens() {
    let usage = Usage {
        input_tokens: 1000,
        output_tokens: 0,
        cache_read_tokens: 600,
        cache_write_tokens: 300,
        reasoning_tokens: 0,
    };
    let server = FixtureServer::start().await;
    server.push(FixtureReply::anthropic_events([
        AnthropicEvent::MessageStart(usage),
        AnthropicEvent::TextStart { index: 0 },
        AnthropicEvent::TextDelta {
            index: 0,
            text: "x".into(),
        },
        AnthropicEvent::MessageDelta {
            stop_reason: "max_tokens".into(),
            output_tokens: 77,
        },
        AnthropicEvent::MessageStop,
    ]));
    let (_, response) = complete(&anthropic(&server), request("a")).await;
    assert_eq!(
        response.usage,
        Usage {
            output_tokens: 77,
            ..usage
        }
    );
    assert_eq!(response.stop_reason, StopReason::Length);
}

// ---- retries ----

/// The wait (`wait_ms=…`) each logged retry of `provider`'s calls took, in order.
fn logged_waits(logs: &harness::logs::Capture, provider: &str) -> Vec<String> {
    let provider = format!("provider={provider}");
    logs.fields_of("retrying model call")
        .into_iter()
        .filter(|fields| fields.contains(&provider))
        .filter_map(|fields| fields.into_iter().find(|field| field.starts_with("wait_ms=")))
        .collect()
}

#[tokio::test]
async fn rate_limit_with_retry_after_zero_then_success_succeeds_after_one_retry() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_error(429, "rate_limit_exceeded", "Slow down").retry_after(0));
    server.push(FixtureReply::openai_text("made it"));
    // A long base delay: Retry-After (0 s) is what decides the wait, as the retry's log says.
    let logs = harness::logs::capture();
    let provider = OpenAiProvider::compatible("fixture-429", server.base_url(), "FLUE_TEST_KEY_429")
        .with_api_key(KEY)
        .with_retry_policy(RetryPolicy::new(3, Duration::from_secs(20)));
    let (_, response) = complete(&provider, request("hi")).await;
    assert_eq!(response.text, "made it");
    assert_eq!(server.requests().len(), 2);
    assert_eq!(logged_waits(&logs, "fixture-429"), ["wait_ms=0"]);
}

#[tokio::test]
async fn retry_after_in_seconds_is_honoured_before_retrying() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::anthropic_error(429, "rate_limit_error", "Too many requests").retry_after(1));
    server.push(FixtureReply::anthropic_text("after the wait"));
    let logs = harness::logs::capture();
    let provider = anthropic(&server).with_id("anthropic-429");
    let (_, response) = complete(&provider, request("hi")).await;
    assert_eq!(response.text, "after the wait");
    assert_eq!(server.requests().len(), 2);
    // The retry waited the second asked (the policy's own backoff is 5 ms).
    assert_eq!(logged_waits(&logs, "anthropic-429"), ["wait_ms=1000"]);
}

/// A rate limit whose `Retry-After` asks for longer than any retry waits (a minute) is not
/// retried into another 429: the call fails at once, saying how long the provider asked.
#[tokio::test]
async fn a_retry_after_longer_than_any_retry_waits_fails_at_once_saying_so() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_error(429, "rate_limit_exceeded", "Try again in an hour").retry_after(3600));
    server.push(FixtureReply::openai_text("never reached"));
    let (_, error) = fail(&openai(&server, "FLUE_TEST_KEY_LONG_WAIT"), request("hi")).await;
    assert_eq!(
        (error.kind.clone(), error.status),
        (ProviderErrorKind::RateLimited, Some(429))
    );
    assert_eq!(
        error.retry_after,
        Some(Duration::from_secs(3600)),
        "the wait asked, whole"
    );
    assert!(
        !error.is_retryable(),
        "a caller's retry within 30 s would meet the same limit"
    );
    assert!(error.message.contains("Try again in an hour"), "{}", error.message);
    assert!(error.message.contains("asks to wait 1h"), "{}", error.message);
    assert!(error.message.contains("(1m)"), "{}", error.message);
    assert_eq!(server.requests().len(), 1);
    assert_eq!(server.pending(), 1, "no retry");
}

/// The same wait asked in milliseconds (`retry-after-ms`), and by a server error: not retried.
#[tokio::test]
async fn a_retry_after_ms_longer_than_any_retry_waits_is_not_retried_on_a_server_error_either() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_error(503, "overloaded", "Come back later").header("retry-after-ms", "90000"));
    server.push(FixtureReply::openai_text("never reached"));
    let (_, error) = fail(&openai(&server, "FLUE_TEST_KEY_LONG_WAIT_MS"), request("hi")).await;
    assert_eq!(
        (error.kind.clone(), error.status),
        (ProviderErrorKind::Server, Some(503))
    );
    assert_eq!(error.retry_after, Some(Duration::from_secs(90)));
    assert!(error.message.contains("asks to wait 1m 30s"), "{}", error.message);
    assert_eq!(server.requests().len(), 1);
}

#[tokio::test]
async fn server_errors_until_retries_run_out_fail_after_exactly_four_requests() {
    let server = FixtureServer::start().await;
    for _ in 0..4 {
        server.push(FixtureReply::openai_error(
            500,
            "server_error",
            "The server had an error",
        ));
    }
    server.push(FixtureReply::openai_text("never reached"));
    let (events, error) = fail(&openai(&server, "FLUE_TEST_KEY_500"), request("hi")).await;
    assert!(events.is_empty());
    assert_eq!(
        (error.kind.clone(), error.status),
        (ProviderErrorKind::Server, Some(500))
    );
    assert!(error.message.contains("The server had an error"), "{}", error.message);
    assert_eq!(server.requests().len(), 4);
    assert_eq!(server.pending(), 1, "no fifth attempt");
}

#[tokio::test]
async fn rate_limits_until_retries_run_out_are_rate_limited_with_the_asked_wait() {
    let server = FixtureServer::start().await;
    for _ in 0..4 {
        server
            .push(FixtureReply::anthropic_error(429, "rate_limit_error", "Number of requests exceeded").retry_after(0));
    }
    let (_, error) = fail(&anthropic(&server), request("hi")).await;
    assert_eq!(
        (error.kind.clone(), error.status),
        (ProviderErrorKind::RateLimited, Some(429))
    );
    assert_eq!(error.retry_after, Some(Duration::ZERO));
    assert_eq!(server.requests().len(), 4);
}

#[tokio::test]
async fn a_slow_first_byte_is_retried_and_the_next_attempt_can_succeed() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_text("too late").delay(Duration::from_secs(4)));
    server.push(FixtureReply::openai_text("on time"));
    let provider = openai(&server, "FLUE_TEST_KEY_SLOW_RETRY").with_timeout(Duration::from_secs(1));
    let (_, response) = complete(&provider, request("hi")).await;
    assert_eq!(response.text, "on time");
    assert_eq!(server.requests().len(), 2);
}

// ---- error mapping ----

#[tokio::test]
async fn unauthorized_names_the_key_variable_and_never_shows_the_key() {
    let server = FixtureServer::start().await;
    // The body echoes the key, as some providers do.
    let echo = format!("Incorrect API key provided: {KEY}. You can find your API key at the dashboard.");
    server.push(FixtureReply::openai_error(401, "invalid_api_key", &echo));
    let (_, error) = fail(&openai(&server, "FLUE_TEST_KEY_UNAUTHORIZED"), request("hi")).await;
    assert_eq!(
        (error.kind.clone(), error.status),
        (ProviderErrorKind::Unauthorized, Some(401))
    );
    assert!(
        error.message.contains("FLUE_TEST_KEY_UNAUTHORIZED"),
        "{}",
        error.message
    );
    assert!(!error.message.contains(KEY), "{}", error.message);
    assert!(!format!("{error:?}").contains(KEY));
    assert_eq!(server.requests().len(), 1, "401 is not retried");
    assert_eq!(
        server.requests()[0].header("authorization"),
        Some(format!("Bearer {KEY}").as_str())
    );

    server.push(FixtureReply::anthropic_error(
        403,
        "permission_error",
        "Your key cannot use this model",
    ));
    let (_, error) = fail(&anthropic(&server), request("hi")).await;
    assert_eq!(error.kind, ProviderErrorKind::Unauthorized);
    assert!(error.message.contains("FLUE_TEST_ANTHROPIC_KEY"), "{}", error.message);
}

/// A request body the fixture cannot read whole is answered `413` and takes no scripted
/// reply: the next call still gets the reply scripted for it.
#[tokio::test]
async fn a_body_the_fixture_cannot_read_whole_takes_no_reply() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_text("kept"));
    let response = reqwest::Client::new()
        .post(format!("{}/chat/completions", server.base_url()))
        .body(vec![b' '; 64 * 1024 * 1024 + 1])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 413);
    assert_eq!(server.pending(), 1);
    assert_eq!(server.requests().len(), 1);
}

/// A scripted header replaces the fixture's own of that name: a reply scripted as HTML is
/// served as HTML alone (two content types would leave a test of a provider's content-type
/// check reading the fixture's default); several scripted values of one name all go.
#[tokio::test]
async fn a_scripted_header_replaces_the_fixtures_own_of_that_name() {
    let server = FixtureServer::start().await;
    server.push(
        FixtureReply::status(502, "<h1>502</h1>")
            .header("content-type", "text/html")
            .header("x-seen", "a")
            .header("x-seen", "b"),
    );
    let response = reqwest::Client::new()
        .post(format!("{}/chat/completions", server.base_url()))
        .body("{}")
        .send()
        .await
        .unwrap();
    let values = |name: &str| -> Vec<String> {
        response
            .headers()
            .get_all(name)
            .iter()
            .map(|value| value.to_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(values("content-type"), ["text/html"]);
    assert_eq!(values("x-seen"), ["a", "b"]);
    assert_eq!(values("cache-control"), ["no-cache"]);
}

#[tokio::test]
async fn a_key_straddling_the_end_of_the_quoted_error_page_is_not_partly_shown() {
    let server = FixtureServer::start().await;
    // A non-JSON error page that echoes the request's Authorization header near its start.
    let page = format!("{} Authorization: Bearer {KEY}", "x".repeat(261));
    server.push(FixtureReply::status(400, page));
    let (_, error) = fail(&openai(&server, "FLUE_TEST_KEY_SNIPPET"), request("hi")).await;
    assert!(!error.message.contains(&KEY[..16]), "{}", error.message);
}

#[tokio::test]
async fn a_request_timeout_408_is_retried_and_an_echoed_url_keeps_its_query_key_out() {
    let server = FixtureServer::start().await;
    // A gateway that gave up waiting, then one whose error page echoes the URL it was called
    // with (a key in its query).
    server.push(FixtureReply::status(408, r#"{"error":{"message":"request timed out"}}"#).retry_after(0));
    server.push(FixtureReply::status(
        400,
        "bad request to https://gw.example/v1/chat/completions?api-key=hunter2-secret&x=1 (see logs)",
    ));
    let (_, error) = fail(&openai(&server, "FLUE_TEST_KEY_408"), request("hi")).await;
    assert_eq!(server.requests().len(), 2, "the 408 was retried");
    assert_eq!(error.kind, ProviderErrorKind::BadRequest);
    assert!(!error.message.contains("hunter2"), "{}", error.message);
    assert!(
        error.message.contains("https://gw.example/v1/chat/completions"),
        "{}",
        error.message
    );
}

#[tokio::test]
async fn an_explicit_key_read_with_its_line_end_is_sent_trimmed() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_text("ok"));
    let provider = OpenAiProvider::openai()
        .with_base_url(server.base_url())
        .with_api_key(format!("{KEY}\n"))
        .with_retry_policy(RetryPolicy::none());
    let (_, response) = complete(&provider, request("hi")).await;
    assert_eq!(response.text, "ok");
    assert_eq!(
        server.requests()[0].header("authorization"),
        Some(format!("Bearer {KEY}").as_str())
    );
}

#[tokio::test]
async fn unknown_model_404_maps_to_unknown_model_naming_it() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_error(
        404,
        "model_not_found",
        "The model `gpt-nope` does not exist",
    ));
    server.push(FixtureReply::anthropic_error(
        404,
        "not_found_error",
        "model: claude-nope",
    ));
    let mut openai_request = request("hi");
    openai_request.model = "gpt-nope".to_owned();
    let (_, error) = fail(&openai(&server, "FLUE_TEST_KEY_404"), openai_request).await;
    assert_eq!(
        (error.kind.clone(), error.status),
        (ProviderErrorKind::UnknownModel, Some(404))
    );
    assert!(error.message.contains("\"gpt-nope\""), "{}", error.message);
    let (_, error) = fail(&anthropic(&server), request("hi")).await;
    assert_eq!(error.kind, ProviderErrorKind::UnknownModel);
    assert!(error.message.contains("claude-nope"), "{}", error.message);
    assert_eq!(server.requests().len(), 2, "not retried");
}

#[tokio::test]
async fn an_upstream_context_overflow_wrapped_by_openrouter_is_recognised_and_quoted() {
    let server = FixtureServer::start().await;
    let upstream = json!({
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "prompt is too long: 250000 tokens > 200000 maximum"}
    });
    server.push(FixtureReply::status(
        400,
        json!({"error": {"message": "Provider returned error", "code": 400,
            "metadata": {"raw": upstream.to_string(), "provider_name": "Anthropic"}}})
        .to_string(),
    ));
    // A text `raw` is quoted as it is.
    server.push(FixtureReply::status(
        400,
        json!({"error": {"message": "Provider returned error", "code": 400,
            "metadata": {"raw": "upstream refused: invalid image", "provider_name": "Google"}}})
        .to_string(),
    ));
    let (_, error) = fail(&openai(&server, "FLUE_TEST_KEY_OR_RAW"), request("hi")).await;
    assert_eq!(error.kind, ProviderErrorKind::ContextOverflow, "{error}");
    assert!(
        error.message.contains("Provider returned error: prompt is too long"),
        "{}",
        error.message
    );
    let (_, error) = fail(&openai(&server, "FLUE_TEST_KEY_OR_RAW"), request("hi")).await;
    assert_eq!(error.kind, ProviderErrorKind::BadRequest);
    assert!(
        error
            .message
            .contains("Provider returned error: upstream refused: invalid image"),
        "{}",
        error.message
    );
}

#[tokio::test]
async fn context_overflow_is_recognised_for_both_providers_and_status_413() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_context_length_exceeded());
    server.push(FixtureReply::status(413, "Request Entity Too Large"));
    server.push(FixtureReply::anthropic_error(
        400,
        "invalid_request_error",
        "prompt is too long: 215000 tokens > 200000 maximum",
    ));
    let provider = openai(&server, "FLUE_TEST_KEY_OVERFLOW");
    let (_, error) = fail(&provider, request("long")).await;
    assert_eq!(
        (error.kind.clone(), error.status),
        (ProviderErrorKind::ContextOverflow, Some(400))
    );
    assert!(error.message.contains("maximum context length"), "{}", error.message);
    let (_, error) = fail(&provider, request("long")).await;
    assert_eq!(
        (error.kind.clone(), error.status),
        (ProviderErrorKind::ContextOverflow, Some(413))
    );
    let (_, error) = fail(&anthropic(&server), request("long")).await;
    assert_eq!(error.kind, ProviderErrorKind::ContextOverflow);
    assert_eq!(server.requests().len(), 3);
}

#[tokio::test]
async fn anthropic_input_plus_max_tokens_over_the_context_limit_is_context_overflow() {
    let server = FixtureServer::start().await;
    // Anthropic's 400 when the prompt fits but prompt + max_tokens does not (common with a
    // thinking budget, which raises max_tokens).
    server.push(FixtureReply::anthropic_error(
        400,
        "invalid_request_error",
        "input length and `max_tokens` exceed context limit: 178959 + 64000 > 200000, decrease input length or `max_tokens` and try again",
    ));
    let (_, error) = fail(&anthropic(&server), request("long")).await;
    assert_eq!(error.kind, ProviderErrorKind::ContextOverflow, "{}", error.message);
}

#[tokio::test]
async fn a_llama_cpp_context_size_error_is_context_overflow() {
    let server = FixtureServer::start().await;
    // llama.cpp server (an OpenAI-compatible target of `openai_compatible`).
    server.push(FixtureReply::status(
        400,
        r#"{"error":{"code":400,"message":"request (9412 tokens) exceeds the available context size (8192 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9412,"n_ctx":8192}}"#,
    ));
    let (_, error) = fail(&openai(&server, "FLUE_TEST_KEY_LLAMACPP"), request("long")).await;
    assert_eq!(error.kind, ProviderErrorKind::ContextOverflow, "{}", error.message);
}

#[tokio::test]
async fn other_client_errors_are_bad_requests_with_the_provider_message() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_error(
        400,
        "invalid_value",
        "Invalid 'tools[0].function.name': bad name.",
    ));
    let (_, error) = fail(&openai(&server, "FLUE_TEST_KEY_400"), request("hi")).await;
    assert_eq!(
        (error.kind.clone(), error.status),
        (ProviderErrorKind::BadRequest, Some(400))
    );
    assert!(
        error.message.contains("Invalid 'tools[0].function.name': bad name."),
        "{}",
        error.message
    );
}

#[tokio::test]
async fn a_malformed_chunk_is_an_invalid_response_after_the_good_deltas() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_malformed("Hello world"));
    let (events, error) = fail(&openai(&server, "FLUE_TEST_KEY_MALFORMED"), request("hi")).await;
    assert_eq!(events, [StreamEvent::TextDelta("Hello".into())]);
    assert_eq!(error.kind, ProviderErrorKind::InvalidResponse);
    assert_eq!(
        server.requests().len(),
        1,
        "a failure after streaming began is not retried"
    );
}

#[tokio::test]
async fn a_stream_that_stops_midway_is_an_error_not_a_completion() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_truncated("Half an"));
    server.push(FixtureReply::openai_truncated("Cut off").abort());
    server.push(FixtureReply::anthropic_events([
        AnthropicEvent::MessageStart(Usage::default()),
        AnthropicEvent::TextStart { index: 0 },
        AnthropicEvent::TextDelta {
            index: 0,
            text: "Par".into(),
        },
    ]));
    let provider = openai(&server, "FLUE_TEST_KEY_TRUNCATED");
    let (events, error) = fail(&provider, request("hi")).await;
    assert_eq!(text_deltas(&events), ["Half", " an"]);
    assert_eq!(error.kind, ProviderErrorKind::Network);
    assert!(
        error.message.contains("the stream ended before the response completed"),
        "{}",
        error.message
    );
    let (events, error) = fail(&provider, request("hi")).await;
    assert_eq!(text_deltas(&events), ["Cut", " off"], "the connection broke mid-body");
    assert_eq!(error.kind, ProviderErrorKind::Network, "{}", error.message);
    let (_, error) = fail(&anthropic(&server), request("hi")).await;
    assert_eq!(error.kind, ProviderErrorKind::Network);
    assert_eq!(server.requests().len(), 3);
}

#[tokio::test]
async fn an_openai_stream_cut_between_the_finish_reason_and_the_usage_is_an_error() {
    let server = FixtureServer::start().await;
    // `stream_options.include_usage` was sent: OpenAI streams the usage chunk, then `[DONE]`,
    // after the finish-reason chunk. This body ends (cleanly) right after the finish reason.
    server.push(FixtureReply::openai_chunks([
        OpenAiChunk::Text("Hi".into()),
        OpenAiChunk::Finish("stop".into()),
    ]));
    // Completing would report zero tokens for a call that used some.
    let (events, error) = fail(&openai(&server, "FLUE_TEST_KEY_CUT_AFTER_FINISH"), request("hi")).await;
    assert_eq!(text_deltas(&events), ["Hi"]);
    assert_eq!(error.kind, ProviderErrorKind::Network);
    assert!(
        error.message.contains("the stream ended before the response completed"),
        "{}",
        error.message
    );
}

#[tokio::test]
async fn an_openai_stream_ending_after_the_usage_without_done_completes_with_the_usage() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_chunks([
        OpenAiChunk::Text("Hi".into()),
        OpenAiChunk::Finish("stop".into()),
        OpenAiChunk::Usage(FIXTURE_USAGE),
    ]));
    // A compatible server that sends no usage but does end with `[DONE]`.
    server.push(FixtureReply::openai_chunks([
        OpenAiChunk::Text("Hi".into()),
        OpenAiChunk::Finish("stop".into()),
        OpenAiChunk::Done,
    ]));
    let provider = openai(&server, "FLUE_TEST_KEY_END_AFTER_USAGE");
    let (_, response) = complete(&provider, request("hi")).await;
    assert_eq!((response.text.as_str(), response.usage), ("Hi", FIXTURE_USAGE));
    let (_, response) = complete(&provider, request("hi")).await;
    assert_eq!((response.text.as_str(), response.usage), ("Hi", Usage::default()));
}

#[tokio::test]
async fn errors_inside_the_stream_are_mapped() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_chunks([
        OpenAiChunk::Text("par".into()),
        OpenAiChunk::Error {
            code: "rate_limit_exceeded".into(),
            message: "Rate limit reached".into(),
        },
    ]));
    server.push(FixtureReply::anthropic_events([
        AnthropicEvent::MessageStart(Usage::default()),
        AnthropicEvent::Error {
            kind: "overloaded_error".into(),
            message: "Overloaded".into(),
        },
    ]));
    let (events, error) = fail(&openai(&server, "FLUE_TEST_KEY_STREAM_ERROR"), request("hi")).await;
    assert_eq!(text_deltas(&events), ["par"]);
    assert_eq!(
        (error.kind.clone(), error.status),
        (ProviderErrorKind::RateLimited, None)
    );
    assert!(error.message.contains("Rate limit reached"), "{}", error.message);
    let (_, error) = fail(&anthropic(&server), request("hi")).await;
    assert_eq!(error.kind, ProviderErrorKind::Server);
    assert!(error.message.contains("Overloaded"), "{}", error.message);
}

// ---- timeouts ----

#[tokio::test]
async fn a_first_byte_slower_than_the_timeout_is_a_timeout() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_text("late").delay(Duration::from_secs(5)));
    let provider = openai(&server, "FLUE_TEST_KEY_TIMEOUT")
        .with_timeout(Duration::from_millis(200))
        .with_retry_policy(RetryPolicy::none());
    // The reply would come (and succeed) after 5 s: a timeout is the 200 ms one.
    let (_, error) = fail(&provider, request("hi")).await;
    assert_eq!(error.kind, ProviderErrorKind::Timeout);
    assert!(
        error.message.contains("did not start answering within 200ms"),
        "{}",
        error.message
    );
}

/// The time allowed for an answer to start counts from when the request went up: a long body
/// (a conversation with images) on a slow link is no timeout while its upload moves on.
#[tokio::test]
async fn a_long_body_uploading_slower_than_the_timeout_is_no_timeout_while_it_moves_on() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    // A small receive buffer: the server's reads, not the kernel's, pace the upload.
    socket.set_recv_buffer_size(64 * 1024).expect("receive buffer");
    socket.bind("127.0.0.1:0".parse().expect("address")).expect("bind");
    let listener = socket.listen(8).expect("listen");
    let address = listener.local_addr().expect("address");
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.expect("accept");
        let mut received = Vec::new();
        let mut chunk = vec![0u8; 128 * 1024];
        let head_end = loop {
            let n = stream.read(&mut chunk).await.expect("read");
            assert!(n > 0, "the request ended in its head");
            received.extend_from_slice(&chunk[..n]);
            if let Some(at) = received.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
        };
        let head = String::from_utf8_lossy(&received[..head_end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|line| line.strip_prefix("content-length:"))
            .expect("a content-length")
            .trim()
            .parse()
            .expect("a length");
        // Three quarters of the body slowly (at least 1.9 s: beyond the 1.5 s allowed), the rest
        // at once. (The sender's kernel takes more of it each time about a third of its buffer
        // of up to 4 MiB went out: well within the 1.5 s, even on a loaded machine.)
        let mut read = received.len() - head_end;
        while read < length {
            if read < length / 4 * 3 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let n = stream.read(&mut chunk).await.expect("read");
            assert!(n > 0, "the body ended early");
            read += n;
        }
        let events = [
            r#"{"choices":[{"index":0,"delta":{"content":"ok"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
            "[DONE]",
        ];
        let mut answer = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n".to_owned();
        for event in events {
            answer.push_str(&format!("data: {event}\n\n"));
        }
        stream.write_all(answer.as_bytes()).await.expect("answer");
        stream.shutdown().await.expect("shutdown");
    });
    let provider = OpenAiProvider::compatible("slow-link", format!("http://{address}/v1"), "FLUE_TEST_KEY_SLOW_LINK")
        .with_api_key(KEY)
        .with_timeout(Duration::from_millis(1500))
        .with_retry_policy(RetryPolicy::none());
    let (_, response) = complete(&provider, request(&"x".repeat(32 << 20))).await;
    assert_eq!(response.text, "ok");
    server.await.expect("the server");
}

#[tokio::test]
async fn a_stream_silent_longer_than_the_idle_timeout_is_a_timeout() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_chunks([
        OpenAiChunk::Text("first".into()),
        OpenAiChunk::Pause(Duration::from_secs(5)),
        OpenAiChunk::Finish("stop".into()),
        OpenAiChunk::Done,
    ]));
    let provider = openai(&server, "FLUE_TEST_KEY_IDLE").with_idle_timeout(Duration::from_millis(500));
    // The stream would go on (and end properly) after 5 s: a timeout is the idle one.
    let (events, error) = fail(&provider, request("hi")).await;
    assert_eq!(text_deltas(&events), ["first"]);
    assert_eq!(error.kind, ProviderErrorKind::Timeout);
    assert_eq!(server.requests().len(), 1);
}

/// A gateway that keeps the connection alive with SSE comments while no event comes (its
/// upstream queued or stuck) gets five times the idle timeout, not for ever: the keep-alives
/// reset the wait for bytes, not the wait for events. (It would otherwise hold the turn until
/// the submission's timeout, an hour by default.)
#[tokio::test]
async fn keep_alives_without_output_for_the_idle_timeout_are_a_timeout() {
    let server = FixtureServer::start().await;
    let mut chunks = vec![OpenAiChunk::Text("first".into())];
    for _ in 0..40 {
        chunks.push(OpenAiChunk::Pause(Duration::from_millis(100)));
        chunks.push(OpenAiChunk::Comment("OPENROUTER PROCESSING".into()));
    }
    chunks.extend([
        OpenAiChunk::Text(" late".into()),
        OpenAiChunk::Finish("stop".into()),
        OpenAiChunk::Done,
    ]);
    server.push(FixtureReply::openai_chunks(chunks));
    // 4 s of keep-alives; 1.5 s allowed.
    let provider = openai(&server, "FLUE_TEST_KEY_KEEPALIVE").with_idle_timeout(Duration::from_millis(300));
    let (events, error) = fail(&provider, request("hi")).await;
    // Failed before the keep-alives ran out: the text after them never arrived.
    assert_eq!(text_deltas(&events), ["first"]);
    assert_eq!(error.kind, ProviderErrorKind::Timeout);
    assert!(error.message.contains("only keep-alives"), "{}", error.message);
}

/// Anthropic keeps a stream alive with `ping` events, and a gateway may send events with no
/// data: a stream of nothing else for five times the idle timeout is one that stalled, and
/// fails as the SSE comments' does. (Before, each such event counted as the response moving,
/// and a stalled stream that kept pinging held the turn until the submission's timeout.)
#[tokio::test]
async fn ping_and_empty_events_without_output_are_keep_alives_too() {
    let server = FixtureServer::start().await;
    let mut events = vec![
        AnthropicEvent::MessageStart(Usage::default()),
        AnthropicEvent::TextStart { index: 0 },
        AnthropicEvent::TextDelta {
            index: 0,
            text: "first".into(),
        },
    ];
    for _ in 0..40 {
        events.push(AnthropicEvent::Pause(Duration::from_millis(100)));
        events.push(AnthropicEvent::Ping);
    }
    events.push(AnthropicEvent::TextDelta {
        index: 0,
        text: " late".into(),
    });
    server.push(FixtureReply::anthropic_events(events));
    let mut chunks = vec![OpenAiChunk::Text("first".into())];
    // An empty event, and the chunks gateways relay an upstream's pings as: a ping object
    // (Anthropic's OpenAI-compatible endpoint) and a choice with an empty delta.
    let keep_alives = ["", r#"{"type":"ping"}"#, r#"{"choices":[{"index":0,"delta":{}}]}"#];
    for keep_alive in keep_alives.iter().cycle().take(40) {
        chunks.push(OpenAiChunk::Pause(Duration::from_millis(100)));
        chunks.push(OpenAiChunk::Raw((*keep_alive).to_owned()));
    }
    chunks.extend([OpenAiChunk::Text(" late".into()), OpenAiChunk::Finish("stop".into())]);
    server.push(FixtureReply::openai_chunks(chunks));
    // 4 s of keep-alives; 1.5 s allowed.
    let idle = Duration::from_millis(300);
    for provider in [
        &anthropic(&server).with_idle_timeout(idle) as &dyn ModelProvider,
        &openai(&server, "FLUE_TEST_KEY_EMPTY_EVENTS").with_idle_timeout(idle),
    ] {
        let (events, error) = fail(provider, request("hi")).await;
        assert_eq!(text_deltas(&events), ["first"]);
        assert_eq!(error.kind, ProviderErrorKind::Timeout);
        assert!(error.message.contains("only keep-alives"), "{}", error.message);
    }
}

/// Keep-alives between outputs, each gap shorter than the idle timeout, end nothing: the wait
/// counts from the last output.
#[tokio::test]
async fn keep_alives_between_outputs_within_the_idle_timeout_end_nothing() {
    let server = FixtureServer::start().await;
    let mut chunks = Vec::new();
    for word in ["one", " two", " three"] {
        for _ in 0..4 {
            chunks.push(OpenAiChunk::Pause(Duration::from_millis(100)));
            chunks.push(OpenAiChunk::Comment("keep-alive".into()));
        }
        chunks.push(OpenAiChunk::Text(word.into()));
    }
    chunks.extend([OpenAiChunk::Finish("stop".into()), OpenAiChunk::Done]);
    server.push(FixtureReply::openai_chunks(chunks));
    // 1.2 s of keep-alives in all, 0.4 s between outputs.
    let provider = openai(&server, "FLUE_TEST_KEY_KEEPALIVE_OK").with_idle_timeout(Duration::from_millis(800));
    let (_, response) = complete(&provider, request("hi")).await;
    assert_eq!(response.text, "one two three");
}

#[tokio::test]
async fn an_idle_timeout_of_duration_max_is_no_limit_not_a_panic() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_text("Hello there, world"));
    server.push(FixtureReply::anthropic_text("Bonjour tout le monde"));
    let provider = openai(&server, "FLUE_TEST_KEY_IDLE_MAX").with_idle_timeout(Duration::MAX);
    let (_, response) = complete(&provider, request("hi")).await;
    assert_eq!(response.text, "Hello there, world");
    let provider = anthropic(&server).with_idle_timeout(Duration::MAX);
    let (_, response) = complete(&provider, request("salut")).await;
    assert_eq!(response.text, "Bonjour tout le monde");
}

#[tokio::test]
async fn a_call_asking_for_reasoning_may_stay_silent_longer_than_the_idle_timeout() {
    let server = FixtureServer::start().await;
    let silent_reasoning = || {
        FixtureReply::openai_chunks([
            OpenAiChunk::Pause(Duration::from_millis(800)),
            OpenAiChunk::Text("thought it through".into()),
            OpenAiChunk::Finish("stop".into()),
            OpenAiChunk::Done,
        ])
    };
    server.push(silent_reasoning());
    server.push(silent_reasoning());
    let provider = OpenAiProvider::openai()
        .with_base_url(server.base_url())
        .with_api_key(KEY)
        .with_retry_policy(RetryPolicy::none())
        .with_idle_timeout(Duration::from_millis(300))
        .with_reasoning_idle_timeout(Duration::from_secs(5));
    // Reasoning asked for: the model's silence is its thinking.
    let thinking = ModelRequest {
        model: "o3".into(),
        thinking_level: ThinkingLevel::High,
        ..request("hi")
    };
    let (events, error) = run(&provider, thinking).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(text_deltas(&events), ["thought it through"]);
    // Without reasoning (a model that takes no effort), the idle timeout holds.
    let plain = ModelRequest {
        model: "gpt-4.1".into(),
        thinking_level: ThinkingLevel::High,
        ..request("hi")
    };
    let (_, error) = fail(&provider, plain).await;
    assert_eq!(error.kind, ProviderErrorKind::Timeout);
    // Nor when the effort sent is `none` (OpenRouter's `Off`): no reasoning is asked for.
    server.push(silent_reasoning());
    let openrouter = OpenAiProvider::openrouter()
        .with_base_url(server.base_url())
        .with_api_key(KEY)
        .with_retry_policy(RetryPolicy::none())
        .with_idle_timeout(Duration::from_millis(300))
        .with_reasoning_idle_timeout(Duration::from_secs(5));
    let off = ModelRequest {
        model: "meta-llama/llama-3.3-70b-instruct".into(),
        thinking_level: ThinkingLevel::Off,
        ..request("hi")
    };
    let (_, error) = fail(&openrouter, off).await;
    assert_eq!(error.kind, ProviderErrorKind::Timeout);
    let requests = server.requests();
    assert_eq!(
        requests.last().unwrap().body["reasoning"],
        serde_json::json!({"effort": "none"})
    );
}

// ---- keys ----

#[tokio::test]
async fn a_missing_key_fails_with_missing_key_before_any_request() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_text("unused"));
    let provider = OpenAiProvider::compatible("fixture", server.base_url(), "FLUE_TEST_KEY_NEVER_SET_4C1D");
    let (events, error) = fail(&provider, request("hi")).await;
    assert!(events.is_empty());
    assert_eq!(error.kind, ProviderErrorKind::MissingKey);
    assert_eq!(
        error.message,
        "[flue] Provider \"fixture\" needs an API key: set FLUE_TEST_KEY_NEVER_SET_4C1D."
    );
    let anthropic = AnthropicProvider::anthropic()
        .with_base_url(server.base_url())
        .with_key_env("FLUE_TEST_KEY_NEVER_SET_9E2B");
    let (_, error) = fail(&anthropic, request("hi")).await;
    assert_eq!(error.kind, ProviderErrorKind::MissingKey);
    assert!(error.message.contains("FLUE_TEST_KEY_NEVER_SET_9E2B"));
    assert!(server.requests().is_empty());
}

#[tokio::test]
async fn an_optional_key_sends_no_authorization_header() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_text("local"));
    let provider =
        OpenAiProvider::compatible("local", server.base_url(), "FLUE_TEST_KEY_NEVER_SET_77AA").with_optional_key();
    let (_, response) = complete(&provider, request("hi")).await;
    assert_eq!(response.text, "local");
    assert_eq!(server.requests()[0].header("authorization"), None);
}

// ---- request mapping ----

fn full_request(thinking_level: ThinkingLevel) -> ModelRequest {
    ModelRequest {
        model: "fixture-model".to_owned(),
        system: Some("You are terse.".to_owned()),
        messages: vec![
            ModelMessage::user("Weather in Paris and Rome?"),
            ModelMessage::Assistant {
                text: String::new(),
                tool_calls: vec![
                    call("call_1", "get_weather", r#"{"city":"Paris"}"#),
                    call("call_2", "get_weather", r#"{"city":"Rome"}"#),
                ],
                reasoning: Vec::new(),
            },
            ModelMessage::Tool {
                tool_call_id: "call_1".into(),
                name: "get_weather".into(),
                content: "18C".into(),
                is_error: false,
            },
            ModelMessage::Tool {
                tool_call_id: "call_2".into(),
                name: "get_weather".into(),
                content: "timeout".into(),
                is_error: true,
            },
            ModelMessage::Assistant {
                text: "Paris is 18C.".to_owned(),
                tool_calls: Vec::new(),
                reasoning: Vec::new(),
            },
            ModelMessage::user("Thanks"),
        ]
        .into(),
        tools: vec![ToolSpec {
            name: "get_weather".into(),
            description: "Current weather of a city.".into(),
            parameters: std::sync::Arc::new(
                json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
            ),
        }],
        thinking_level,
        max_output_tokens: Some(20_000),
        max_retries: None,
    }
}

#[tokio::test]
async fn openai_request_carries_system_messages_tools_reasoning_effort_and_the_key() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_text("ok"));
    complete(
        &openai(&server, "FLUE_TEST_KEY_MAPPING").with_reasoning_effort(true),
        full_request(ThinkingLevel::High),
    )
    .await;
    let recorded = &server.requests()[0];
    assert_eq!(
        (recorded.method.as_str(), recorded.path.as_str()),
        ("POST", "/v1/chat/completions")
    );
    assert_eq!(recorded.header("Authorization"), Some(format!("Bearer {KEY}").as_str()));
    assert_eq!(recorded.header("content-type"), Some("application/json"));
    assert_eq!(recorded.header("accept"), Some("text/event-stream"));
    let body = &recorded.body;
    assert_eq!(body["model"], "fixture-model");
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"], json!({"include_usage": true}));
    assert_eq!(body["reasoning_effort"], "high");
    assert_eq!(body["max_tokens"], 20_000);
    assert_eq!(
        body["messages"],
        json!([
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                {"id": "call_2", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}},
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "timeout"},
            {"role": "assistant", "content": "Paris is 18C."},
            {"role": "user", "content": "Thanks"},
        ])
    );
    assert_eq!(
        body["tools"],
        json!([{"type": "function", "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }}])
    );
}

#[tokio::test]
async fn openai_thinking_off_sends_no_reasoning_and_openrouter_uses_its_reasoning_object() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_text("a"));
    server.push(FixtureReply::openai_text("b"));
    complete(
        &openai(&server, "FLUE_TEST_KEY_OFF").with_reasoning_effort(true),
        full_request(ThinkingLevel::Off),
    )
    .await;
    let router = OpenAiProvider::openrouter()
        .with_base_url(server.base_url())
        .with_api_key(KEY)
        .with_retry_policy(fast_retries());
    assert_eq!(router.id(), "openrouter");
    complete(&router, full_request(ThinkingLevel::Xhigh)).await;
    let requests = server.requests();
    assert!(requests[0].body.get("reasoning_effort").is_none());
    assert!(requests[0].body.get("reasoning").is_none());
    assert_eq!(requests[1].body["reasoning"], json!({"effort": "xhigh"}));
    assert!(requests[1].body.get("reasoning_effort").is_none());
}

#[tokio::test]
async fn anthropic_request_uses_content_blocks_merged_tool_results_and_its_headers() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::anthropic_text("ok"));
    complete(&anthropic(&server), full_request(ThinkingLevel::Medium)).await;
    let recorded = &server.requests()[0];
    assert_eq!(recorded.path, "/v1/messages");
    assert_eq!(recorded.header("x-api-key"), Some(KEY));
    assert_eq!(recorded.header("anthropic-version"), Some("2023-06-01"));
    assert_eq!(recorded.header("authorization"), None);
    assert_eq!(recorded.header("content-type"), Some("application/json"));
    assert_eq!(recorded.header("accept"), Some("text/event-stream"));
    let body = &recorded.body;
    // The system prompt and the last message are prompt-cache breakpoints.
    assert_eq!(
        body["system"],
        json!([{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}])
    );
    assert_eq!(body["stream"], true);
    assert_eq!(body["max_tokens"], 20_000);
    assert_eq!(body["thinking"], json!({"type": "enabled", "budget_tokens": 8192}));
    assert_eq!(
        body["messages"],
        json!([
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Rome?"}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "call_2", "name": "get_weather", "input": {"city": "Rome"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": "18C", "is_error": false},
                {"type": "tool_result", "tool_use_id": "call_2", "content": "timeout", "is_error": true},
            ]},
            {"role": "assistant", "content": [{"type": "text", "text": "Paris is 18C."}]},
            {"role": "user", "content": [
                {"type": "text", "text": "Thanks", "cache_control": {"type": "ephemeral"}},
            ]},
        ])
    );
    assert_eq!(
        body["tools"],
        json!([{
            "name": "get_weather",
            "description": "Current weather of a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }])
    );
}

#[tokio::test]
async fn anthropic_defaults_max_tokens_above_the_thinking_budget() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::anthropic_text("a"));
    server.push(FixtureReply::anthropic_text("b"));
    let provider = anthropic(&server);
    complete(&provider, request("no thinking")).await;
    let mut thinking = request("think hard");
    thinking.thinking_level = ThinkingLevel::High;
    complete(&provider, thinking).await;
    let requests = server.requests();
    assert_eq!(requests[0].body["max_tokens"], 8192);
    assert!(requests[0].body.get("thinking").is_none());
    assert_eq!(requests[1].body["thinking"]["budget_tokens"], 16384);
    assert_eq!(requests[1].body["max_tokens"], 16384 + 8192);
}

// ---- fixture server ----

#[tokio::test]
async fn the_fixture_server_answers_400_saying_the_script_ran_out_and_is_not_retried() {
    let server = FixtureServer::start().await;
    // Retries on: an exhausted script is not retried.
    let provider = openai(&server, "FLUE_TEST_KEY_EXHAUSTED");
    let (_, error) = fail(&provider, request("hi")).await;
    assert_eq!(
        (error.kind.clone(), error.status),
        (ProviderErrorKind::BadRequest, Some(400))
    );
    assert!(error.message.contains("fixture script ran out"), "{}", error.message);
    assert_eq!(server.requests().len(), 1, "no retry");
}

// ---- registry ----

#[test]
fn the_registry_resolves_at_the_first_slash() {
    let registry = ProviderRegistry::with_defaults();
    let (provider, model) = registry.resolve("openrouter/anthropic/claude-sonnet-4.5").unwrap();
    assert_eq!(
        (provider.id(), model.as_str()),
        ("openrouter", "anthropic/claude-sonnet-4.5")
    );
    let (provider, model) = registry.resolve("openai/gpt-4o-mini").unwrap();
    assert_eq!((provider.id(), model.as_str()), ("openai", "gpt-4o-mini"));
    let (provider, _) = registry.resolve("anthropic/claude-sonnet-4-5").unwrap();
    assert_eq!(provider.id(), "anthropic");
    assert_eq!(registry.ids(), ["anthropic", "openai", "openrouter"]);
}

#[test]
fn the_registry_rejects_specifiers_without_provider_and_model() {
    let registry = ProviderRegistry::with_defaults();
    for spec in ["gpt-4o", "/gpt-4o", "openai/", ""] {
        let error = registry.resolve(spec).err().unwrap();
        assert_eq!(error, ResolveError::Malformed { spec: spec.to_owned() });
        assert_eq!(
            error.to_string(),
            format!("[flue] The agent model \"{spec}\" could not be resolved: use \"provider-id/model-id\".")
        );
    }
}

#[test]
fn the_registry_lists_the_registered_ids_for_an_unknown_provider() {
    let registry = ProviderRegistry::with_defaults();
    let error = registry.resolve("mistral/large").err().unwrap();
    assert_eq!(
        error.to_string(),
        "[flue] The agent model \"mistral/large\" could not be resolved: no provider \"mistral\" is registered \
         (registered: anthropic, openai, openrouter)."
    );
    let empty = ProviderRegistry::default();
    assert!(empty.ids().is_empty());
    assert!(
        empty
            .resolve("openai/gpt-4o")
            .err()
            .unwrap()
            .to_string()
            .contains("(registered: none)")
    );
}

#[tokio::test]
async fn registering_a_provider_replaces_the_one_with_the_same_id() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_text("from the fixture"));
    let mut registry = ProviderRegistry::with_defaults();
    registry
        .register(OpenAiProvider::compatible("openai", server.base_url(), "FLUE_TEST_KEY_REPLACED").with_api_key(KEY));
    assert_eq!(registry.ids().len(), 3);
    let (provider, model) = registry.resolve("openai/gpt-4o-mini").unwrap();
    let mut call = request("hi");
    call.model = model;
    let (_, response) = complete(provider.as_ref(), call).await;
    assert_eq!(response.text, "from the fixture");
    assert_eq!(server.requests()[0].body["model"], "gpt-4o-mini");
    assert!(registry.get("openai").is_some() && registry.get("mistral").is_none());
}

/// A redirect to another origin is not followed: Anthropic's `x-api-key` (which reqwest keeps
/// on every redirect, unlike `Authorization`) must never reach it. One within the origin is.
#[tokio::test]
async fn a_redirect_to_another_origin_is_refused_and_the_key_stays_home() {
    let (first, other) = (FixtureServer::start().await, FixtureServer::start().await);
    other.push(FixtureReply::anthropic_text("hello"));
    first.push(FixtureReply::status(307, "moved").header("location", format!("{}/messages", other.base_url())));
    let provider = anthropic(&first).with_retry_policy(RetryPolicy::none());
    let (_, error) = run(&provider, request("hi")).await;
    assert!(error.is_some(), "a 3xx from another origin fails the call");
    assert!(other.requests().is_empty(), "nothing reached the other origin");
    let error = error.unwrap();
    assert!(!error.message.contains(KEY), "{}", error.message);

    // The same origin's redirect is followed, the key with it.
    first.push(FixtureReply::status(308, "moved").header("location", format!("{}/messages?moved=1", first.base_url())));
    first.push(FixtureReply::anthropic_text("hello"));
    let (_, response) = complete(&provider, request("hi")).await;
    assert_eq!(response.text, "hello");
    let requests = first.requests();
    assert_eq!(requests.last().unwrap().header("x-api-key"), Some(KEY));
}

/// A 200 answering a page instead of an event stream (a login page, a wrong base URL) is an
/// invalid response quoting what came, not a network failure to retry.
#[tokio::test]
async fn a_page_answered_instead_of_an_event_stream_is_an_invalid_response_not_retried() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::status(200, "<html><body>Please sign in</body></html>"));
    let (events, error) = run(&openai(&server, "FLUE_TEST_PAGE_KEY"), request("hi")).await;
    assert!(events.is_empty());
    let error = error.unwrap();
    assert_eq!(
        (error.kind, error.status),
        (ProviderErrorKind::InvalidResponse, Some(200))
    );
    assert!(
        error.message.contains("text/plain") && error.message.contains("Please sign in"),
        "{}",
        error.message
    );
    assert_eq!(server.requests().len(), 1, "not retried");
}

/// Tool calls streamed with neither `index` nor `id` (as some OpenAI-compatible servers do):
/// a fragment naming another tool, or the same tool once the last call's arguments are whole,
/// starts a call; one repeating the name of an unfinished call continues it.
#[tokio::test]
async fn openai_tool_calls_without_index_or_id_stay_apart() {
    let server = FixtureServer::start().await;
    let call = |name: &str, arguments: &str| {
        let chunk = json!({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": arguments}}]}}]});
        format!("data: {chunk}\n\n")
    };
    server.push(FixtureReply::raw_sse([
        call("get_weather", "{\"city\":\"Paris\"}"),
        call("get_time", "{\"tz\":"),
        call("get_time", "\"CET\"}"),
        call("get_time", "{\"tz\":\"UTC\"}"),
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n".to_owned(),
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\n".to_owned(),
        "data: [DONE]\n\n".to_owned(),
    ]));
    let (_, response) = complete(&openai(&server, "FLUE_TEST_NO_INDEX_KEY"), request("hi")).await;
    let calls: Vec<(&str, &str)> = response
        .tool_calls
        .iter()
        .map(|call| (call.name.as_str(), call.arguments.as_str()))
        .collect();
    assert_eq!(
        calls,
        [
            ("get_weather", "{\"city\":\"Paris\"}"),
            ("get_time", "{\"tz\":\"CET\"}"),
            ("get_time", "{\"tz\":\"UTC\"}")
        ]
    );
    let ids: std::collections::HashSet<&str> = response.tool_calls.iter().map(|call| call.id.as_str()).collect();
    assert_eq!(ids.len(), 3, "each call has its own id");
}

/// `delta.content` as an array of parts (some OpenAI-compatible servers): the text parts are
/// the text.
#[tokio::test]
async fn openai_content_sent_as_parts_is_text() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::raw_sse([
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":[{\"type\":\"text\",\"text\":\"hel\"},{\"type\":\"text\",\"text\":\"lo\"}]}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":[{\"type\":\"image_url\",\"image_url\":{\"url\":\"x\"}}]}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" world\"}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\n",
        "data: [DONE]\n\n",
    ]));
    let (_, response) = complete(&openai(&server, "FLUE_TEST_PARTS_KEY"), request("hi")).await;
    assert_eq!(response.text, "hello world");
}

/// Two calls of one conversation whose first message is long enough for its kept encoding
/// to be shared with the second call's body rather than copied into it (the body goes in
/// parts); the first message. The second call must answer "second".
async fn second_call_of_a_long_conversation(provider: &OpenAiProvider) -> String {
    let long = "one ".repeat(8 * 1024);
    let mut call = request(&long);
    complete(provider, call.clone()).await;
    call.messages.push(ModelMessage::Assistant {
        text: "first".into(),
        tool_calls: Vec::new(),
        reasoning: Vec::new(),
    });
    call.messages.push(ModelMessage::user("two"));
    let (_, response) = complete(provider, call).await;
    assert_eq!(response.text, "second");
    long
}

#[tokio::test]
async fn a_later_call_shares_the_kept_history_and_still_sends_one_body_of_known_length() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_text("first"));
    server.push(FixtureReply::openai_error(429, "rate_limit_exceeded", "Slow down").retry_after(0));
    server.push(FixtureReply::openai_text("second"));
    // The second call is retried once.
    let long = second_call_of_a_long_conversation(&openai(&server, "FLUE_TEST_KEY_PARTS")).await;
    let requests = server.requests();
    assert_eq!(requests.len(), 3);
    let expected = json!([
        {"role": "user", "content": long},
        {"role": "assistant", "content": "first"},
        {"role": "user", "content": "two"},
    ]);
    for recorded in &requests[1..] {
        assert_eq!(recorded.body["messages"], expected);
        assert_eq!(recorded.header("transfer-encoding"), None, "not chunked");
        let sent = serde_json::to_vec(&recorded.body).expect("JSON");
        let length: usize = recorded
            .header("content-length")
            .expect("a Content-Length")
            .parse()
            .expect("a number");
        // The body is compact JSON: its length is that of the value re-encoded.
        assert_eq!(length, sent.len());
    }
}

#[tokio::test]
async fn a_body_in_parts_follows_a_307_redirect_with_the_same_bytes() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_text("first"));
    // The second call (its history shared, so its body in parts) is redirected, and so is the
    // call made again with the body whole, which reqwest then follows.
    for _ in 0..2 {
        server.push(FixtureReply::status(307, "").header("location", "/v1/chat/completions"));
    }
    server.push(FixtureReply::openai_text("second"));
    second_call_of_a_long_conversation(&openai(&server, "FLUE_TEST_KEY_REDIRECT")).await;
    let requests = server.requests();
    assert_eq!(requests.len(), 4);
    for redirected in &requests[2..] {
        assert_eq!(redirected.body, requests[1].body);
        assert_eq!(redirected.body["messages"].as_array().map(Vec::len), Some(3));
    }
}

/// Anthropic refuses tool-call ids outside `^[a-zA-Z0-9_-]+$` with a 400. A conversation
/// that made a call through another provider (Kimi writes `functions.add:0`) and goes on
/// with Claude sends the call and its result under one id Anthropic accepts, distinct from
/// every other call's.
#[tokio::test]
async fn anthropic_sends_another_providers_tool_call_ids_in_a_form_it_accepts() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::anthropic_text("Done."));
    let provider = anthropic(&server);
    let mut call = request("q");
    let ids = ["functions.add:0", "functions.add:1", "toolu_01Ab-c_d"];
    let mut messages = vec![
        ModelMessage::user("q"),
        ModelMessage::Assistant {
            text: String::new(),
            tool_calls: ids
                .iter()
                .map(|id| ModelToolCall {
                    id: (*id).into(),
                    name: "add".into(),
                    arguments: "{}".into(),
                })
                .collect(),
            reasoning: Vec::new(),
        },
    ];
    for id in ids {
        messages.push(ModelMessage::Tool {
            tool_call_id: id.into(),
            name: "add".into(),
            content: "5".into(),
            is_error: false,
        });
    }
    call.messages = messages.into();
    complete(&provider, call).await;
    let body = &server.requests()[0].body;
    let sent: Vec<&str> = body["messages"][1]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|block| block["id"].as_str().unwrap())
        .collect();
    let answered: Vec<&str> = body["messages"][2]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|block| block["tool_use_id"].as_str().unwrap())
        .collect();
    assert_eq!(sent, answered, "each result answers its call");
    assert_eq!(sent[2], "toolu_01Ab-c_d", "an id Anthropic accepts is sent as it is");
    assert_ne!(sent[0], sent[1]);
    for id in sent {
        assert!(
            id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'),
            "{id}"
        );
    }
}

/// A history holding the call `calls` made and their results (`is_error` for each made-up
/// tool's), after the user's question.
fn history_of_calls(calls: &[(&str, &str)]) -> Vec<ModelMessage> {
    let mut messages = vec![
        ModelMessage::user("q"),
        ModelMessage::Assistant {
            text: String::new(),
            tool_calls: calls.iter().map(|(id, name)| call(id, name, "{}")).collect(),
            reasoning: Vec::new(),
        },
    ];
    for (id, name) in calls {
        messages.push(ModelMessage::Tool {
            tool_call_id: (*id).into(),
            name: (*name).into(),
            content: "5".into(),
            is_error: *name != "add",
        });
    }
    messages
}

fn accepted_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// A model may call a tool nobody offered by a name no provider accepts (GPT-4o now and then
/// calls `multi_tool_use.parallel`). The call has its error result; the history sends its name
/// in a form OpenAI and Anthropic accept, where sent as it was each later call of the
/// conversation would be refused with a 400. Offered tools' names are sent as they are.
#[tokio::test]
async fn a_made_up_tool_name_in_the_history_is_sent_in_a_form_each_provider_accepts() {
    let calls = [
        ("call_1", "multi_tool_use.parallel"),
        ("call_2", "add"),
        ("call_3", "multi_tool_use:parallel"),
    ];
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_text("Done."));
    server.push(FixtureReply::anthropic_text("Done."));
    for provider in [
        &openai(&server, "FLUE_TEST_UNUSED_KEY") as &dyn ModelProvider,
        &anthropic(&server),
    ] {
        let mut request = request("q");
        request.messages = history_of_calls(&calls).into();
        complete(provider, request).await;
    }
    let requests = server.requests();
    let openai_names: Vec<&str> = requests[0].body["messages"][1]["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|call| call["function"]["name"].as_str().unwrap())
        .collect();
    let anthropic_names: Vec<&str> = requests[1].body["messages"][1]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|block| block["name"].as_str().unwrap())
        .collect();
    for names in [&openai_names, &anthropic_names] {
        assert!(names.iter().all(|name| accepted_name(name)), "{names:?}");
        assert_eq!(names[1], "add", "an offered tool's name is sent as it is");
        assert!(names[0].starts_with("multi_tool_use_parallel_"), "{names:?}");
        assert_ne!(names[0], names[2], "two made-up names stay two");
    }
    assert_eq!(openai_names, anthropic_names, "the same form for both");
}

/// OpenAI refuses a history whose tool-call ids are longer than 40 characters; other servers
/// make longer ones (vLLM's are 46). A conversation that goes on with OpenAI sends such a call
/// and its result under one id of 40 characters, distinct from every other call's; shorter
/// ids are sent as they are.
#[tokio::test]
async fn openai_sends_another_servers_long_tool_call_ids_cut_to_forty_characters() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_text("Done."));
    let long = "chatcmpl-tool-0123456789abcdef0123456789abcdef";
    let longer = "chatcmpl-tool-0123456789abcdef0123456789abcdeg";
    let calls = [(long, "add"), (longer, "add"), ("functions.add:0", "add")];
    let mut request = request("q");
    request.messages = history_of_calls(&calls).into();
    complete(&openai(&server, "FLUE_TEST_UNUSED_KEY"), request).await;
    let body = &server.requests()[0].body;
    let sent: Vec<&str> = body["messages"][1]["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|call| call["id"].as_str().unwrap())
        .collect();
    let answered: Vec<&str> = (2..5)
        .map(|at| body["messages"][at]["tool_call_id"].as_str().unwrap())
        .collect();
    assert_eq!(sent, answered, "each result answers its call");
    assert_eq!(
        sent[2], "functions.add:0",
        "an id of 40 characters or fewer is sent as it is"
    );
    assert!(sent[..2].iter().all(|id| id.len() == 40), "{sent:?}");
    assert_ne!(sent[0], sent[1]);
}

/// Claude Fable 5.1 and later bind each thinking block to the system prompt, tools and
/// messages before it, and answer 400 by default when one comes back after that prefix
/// changed — which a re-rendered instruction or a compaction does. Their thinking calls ask
/// the API to drop such blocks instead (a beta, with its header); older models' calls do not
/// carry the field or the header.
#[tokio::test]
async fn a_model_that_binds_thinking_to_its_prefix_is_asked_to_drop_mismatched_blocks() {
    let server = FixtureServer::start().await;
    let provider = anthropic(&server);
    let cases = [
        ("claude-fable-5-1", ThinkingLevel::High, true),
        ("claude-opus-5-5", ThinkingLevel::Low, true),
        ("claude-fable", ThinkingLevel::Medium, true),
        ("claude-fable-5", ThinkingLevel::High, false),
        ("claude-opus-4-7", ThinkingLevel::High, false),
        // Fable always thinks: `Off` asks for the least, bound like any other level.
        ("claude-fable-5-1", ThinkingLevel::Off, true),
        ("claude-opus-4-7", ThinkingLevel::Off, false),
    ];
    for (at, (model, level, binds)) in cases.into_iter().enumerate() {
        server.push(FixtureReply::anthropic_text("ok"));
        let mut call = request("q");
        call.model = model.into();
        call.thinking_level = level;
        complete(&provider, call).await;
        let sent = &server.requests()[at];
        let binding = sent.body["thinking"].get("block_binding").cloned();
        if binds {
            assert_eq!(
                binding,
                Some(json!({"prefix_mismatch_behavior": "drop_block"})),
                "{model}"
            );
            assert_eq!(
                sent.header("anthropic-beta"),
                Some("thinking-binding-controls-2026-08-01"),
                "{model}"
            );
        } else {
            assert_eq!(binding, None, "{model} {level:?}");
            assert_eq!(sent.header("anthropic-beta"), None, "{model} {level:?}");
        }
    }
}
