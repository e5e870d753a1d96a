//! The runtime over the real reqwest path: an agent served by an OpenAI-compatible provider
//! pointed at the loopback fixture server.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use flue_runtime::events::{Event, REASONING_DATA_OMITTED};
use flue_runtime::model::{ModelOptions, ThinkingLevel};
use flue_runtime::prelude::*;
use flue_runtime::provider::anthropic::AnthropicProvider;
use flue_runtime::provider::openai::OpenAiProvider;
use flue_runtime::provider::{ModelMessage, ProviderRegistry, ReasoningBlock, RetryPolicy};
use flue_runtime::record::RecordBody;
use flue_runtime::store::{InstanceKey, SqliteStore};
use flue_runtime::testing::fixture_server::{AnthropicEvent, FixtureReply, FixtureServer};
use flue_runtime::usage::Usage;
use flue_runtime::{Runtime, RuntimeError, RuntimeOptions};
use serde_json::json;

mod scratch;

/// Look up the weather in a city.
#[tool(progress_argument = "city")]
async fn get_weather(
    /// The city
    city: String,
) -> String {
    format!("Sunny in {city}.")
}

#[agent]
fn forecaster() -> &'static str {
    use_model("fixture/gpt-test");
    use_tool(get_weather);
    "You report the weather."
}

fn runtime(server: &FixtureServer) -> Runtime {
    let mut providers = ProviderRegistry::new();
    providers.register(
        OpenAiProvider::compatible("fixture", server.base_url(), "FLUE_FIXTURE_KEY")
            .with_api_key("test-key")
            .with_retry_policy(RetryPolicy::new(3, std::time::Duration::from_millis(1))),
    );
    Runtime::builder()
        .store(flue_runtime::store::MemoryStore::new())
        .agent(forecaster)
        .providers(providers)
        .options(RuntimeOptions {
            model_retry_delay: std::time::Duration::from_millis(1),
            ..RuntimeOptions::default()
        })
        .build()
        .unwrap()
}

/// The ids of the tool calls in a request's `messages`, in order.
fn call_ids(messages: &[serde_json::Value]) -> Vec<&str> {
    messages
        .iter()
        .filter_map(|message| message["tool_calls"].as_array())
        .flatten()
        .map(|call| call["id"].as_str().unwrap())
        .collect()
}

/// The call ids the observed events name as calls start (`tool_call_started`) and as their
/// tools end (`tool`), in order.
fn call_ids_observed(
    events: &mut tokio::sync::broadcast::Receiver<flue_runtime::events::Observation>,
) -> (Vec<String>, Vec<String>) {
    let mut started = Vec::new();
    let mut ended = Vec::new();
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            Event::ToolCallStarted { tool_call_id, .. } => started.push(tool_call_id),
            Event::Tool { tool_call_id, .. } => ended.push(tool_call_id),
            _ => {}
        }
    }
    (started, ended)
}

/// The tool results in a request's `messages` (call id, content), in order.
fn tool_results(messages: &[serde_json::Value]) -> Vec<(&str, &str)> {
    messages
        .iter()
        .filter(|message| message["role"] == "tool")
        .map(|message| {
            (
                message["tool_call_id"].as_str().unwrap(),
                message["content"].as_str().unwrap(),
            )
        })
        .collect()
}

/// A server that ends an answer without calls with `finish_reason: "tool_calls"` (some
/// compatible servers do when their tool-call parser fails): the step is a final answer, and
/// is stored as one (`stop`), so a re-attempt reads it as the live run did (answered).
#[tokio::test]
async fn an_answer_without_calls_that_finishes_for_tool_calls_is_a_final_answer() {
    use flue_runtime::testing::fixture_server::OpenAiChunk;
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_chunks([
        OpenAiChunk::Text("Sunny.".into()),
        OpenAiChunk::Finish("tool_calls".into()),
        OpenAiChunk::Done,
    ]));
    let runtime = runtime(&server);
    let mut events = runtime.observe();
    let reply = runtime.init(&forecaster, "f-stop").send("Weather?").await.unwrap();
    assert_eq!(reply.text, "Sunny.");
    let stored = runtime
        .store()
        .read(&InstanceKey::new("forecaster", "f-stop"), None)
        .await
        .unwrap();
    let stops: Vec<String> = stored
        .iter()
        .flat_map(|batch| batch.records.iter())
        .filter_map(|record| match &record.body {
            RecordBody::AssistantMessageCompleted { stop_reason, .. } => Some(stop_reason.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(stops, ["stop"]);
    let mut finishes = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let Event::Turn { response, .. } = observation.event {
            finishes.push(response.finish_reason);
        }
    }
    assert_eq!(finishes, ["stop"]);
}

/// The assistant messages of the history the call numbered `call` sent, as JSON text.
fn assistant_texts(server: &FixtureServer, call: usize) -> Vec<String> {
    server.requests()[call].body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|message| message["role"] == "assistant")
        .map(|message| message["content"].to_string())
        .collect()
}

/// An answer the provider stopped under its content policy is no answer: the submission fails
/// (not retried: the same request meets the same policy), saying so, and the cut-off text is
/// neither the reply nor in the history the next call sends.
#[tokio::test]
async fn an_answer_stopped_by_a_content_filter_fails_the_submission_and_leaves_no_text_behind() {
    use flue_runtime::testing::fixture_server::OpenAiChunk;
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_chunks([
        OpenAiChunk::Text("Here is how to".into()),
        OpenAiChunk::Finish("content_filter".into()),
        OpenAiChunk::Usage(Usage::default()),
        OpenAiChunk::Done,
    ]));
    let runtime = runtime(&server);
    let handle = runtime.init(&forecaster, "f-filtered");
    let RuntimeError::Run {
        error_type, message, ..
    } = handle.send("Weather?").await.unwrap_err()
    else {
        panic!("run error")
    };
    assert_eq!(error_type, "operation_failed");
    assert!(message.contains("content policy"), "{message}");
    assert_eq!(server.requests().len(), 1, "not retried");
    server.push(FixtureReply::openai_text("Sunny."));
    assert_eq!(handle.send("And now?").await.unwrap().text, "Sunny.");
    assert!(
        !assistant_texts(&server, 1)
            .iter()
            .any(|text| text.contains("Here is how to")),
        "{:?}",
        assistant_texts(&server, 1)
    );
}

/// Anthropic's `refusal` stop is the same: the submission fails, and nothing of the refused
/// answer stays for the next call (Anthropic: a refused turn left in the history draws more
/// refusals).
#[tokio::test]
async fn an_anthropic_refusal_fails_the_submission_and_leaves_no_text_behind() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::anthropic_events([
        AnthropicEvent::MessageStart(Usage::default()),
        AnthropicEvent::TextStart { index: 0 },
        AnthropicEvent::TextDelta {
            index: 0,
            text: "Sure, first you".into(),
        },
        AnthropicEvent::MessageDelta {
            stop_reason: "refusal".into(),
            output_tokens: 4,
        },
        AnthropicEvent::MessageStop,
    ]));
    let runtime = thinking_runtime_of(&server, flue_runtime::store::MemoryStore::new(), forecaster_on_claude);
    let handle = runtime.init(&forecaster_on_claude, "c-refused");
    let RuntimeError::Run { message, .. } = handle.send("Weather?").await.unwrap_err() else {
        panic!("run error")
    };
    assert!(message.contains("content policy"), "{message}");
    assert_eq!(server.requests().len(), 1, "not retried");
    server.push(FixtureReply::anthropic_text("Sunny."));
    assert_eq!(handle.send("And now?").await.unwrap().text, "Sunny.");
    assert!(
        !assistant_texts(&server, 1)
            .iter()
            .any(|text| text.contains("Sure, first you")),
        "{:?}",
        assistant_texts(&server, 1)
    );
}

#[agent]
fn forecaster_on_claude() -> &'static str {
    use_model("claude/claude-sonnet-4-5");
    use_tool(get_weather);
    "You report the weather."
}

/// A server that numbers its call ids per step (`call_0` in every step): the later step's call
/// gets an id of its own, everywhere (stream, events, the next request), else its result would
/// answer the earlier call in every view that finds a call by its id.
#[tokio::test]
async fn a_call_id_an_earlier_step_used_gets_one_of_its_own() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_tool_calls([(
        "call_0",
        "get_weather",
        r#"{"city":"Paris"}"#,
    )]));
    server.push(FixtureReply::openai_tool_calls([(
        "call_0",
        "get_weather",
        r#"{"city":"Tokyo"}"#,
    )]));
    server.push(FixtureReply::openai_text("Sunny in both."));
    let runtime = runtime(&server);
    let mut events = runtime.observe();
    runtime
        .init(&forecaster, "f-ids")
        .send("Paris, then Tokyo?")
        .await
        .unwrap();
    let (started, ended) = call_ids_observed(&mut events);
    assert_eq!(started.len(), 2, "{started:?}");
    assert_eq!(started[0], "call_0");
    assert_ne!(started[1], "call_0");
    assert_eq!(ended, started, "each call's tool events name it as it started");
    let requests = server.requests();
    let messages = requests[2].body["messages"].as_array().unwrap();
    let answered = tool_results(messages);
    assert_eq!(
        answered,
        [("call_0", "Sunny in Paris."), (started[1].as_str(), "Sunny in Tokyo.")]
    );
    let called = call_ids(messages);
    assert_eq!(called, ["call_0", started[1].as_str()]);
}

/// Two calls of one step under one id (an Anthropic-compatible server, or a provider of the
/// application's, that repeats it): the second gets an id of its own, everywhere. Else both
/// outcomes would be stored under one id, the history would give both calls the first result,
/// and the next request would carry two `tool_use` blocks of one id (which Anthropic refuses).
#[tokio::test]
async fn two_calls_of_one_step_under_one_id_each_get_an_id_of_their_own() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::anthropic_tool_use([
        ("toolu_1", "get_weather", r#"{"city":"Paris"}"#),
        ("toolu_1", "get_weather", r#"{"city":"Tokyo"}"#),
    ]));
    server.push(FixtureReply::anthropic_text("Sunny in both."));
    let dir = scratch::dir("duplicate-call-ids");
    let runtime = thinking_runtime(&server, SqliteStore::open(dir.join("flue.db")).unwrap());
    let mut events = runtime.observe();
    let reply = runtime.init(&thinker, "t-dup").send("Paris and Tokyo?").await.unwrap();
    assert_eq!(reply.text, "Sunny in both.");
    let (started, ended) = call_ids_observed(&mut events);
    assert_eq!(started.len(), 2, "{started:?}");
    assert_eq!(started[0], "toolu_1");
    assert_ne!(started[1], "toolu_1");
    assert_eq!(ended, started, "each call's tool events name it as it started");
    // The next request: two tool_use blocks, two results, each under its own id.
    let requests = server.requests();
    let messages = requests[1].body["messages"].as_array().unwrap();
    let blocks: Vec<&serde_json::Value> = messages
        .iter()
        .filter_map(|message| message["content"].as_array())
        .flatten()
        .collect();
    let used: Vec<&str> = blocks
        .iter()
        .filter(|block| block["type"] == "tool_use")
        .map(|block| block["id"].as_str().unwrap())
        .collect();
    assert_eq!(used, [started[0].as_str(), started[1].as_str()]);
    let results: Vec<(&str, String)> = blocks
        .iter()
        .filter(|block| block["type"] == "tool_result")
        .map(|block| {
            let content = &block["content"];
            let text = content
                .as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| content[0]["text"].as_str().unwrap().to_owned());
            (block["tool_use_id"].as_str().unwrap(), text)
        })
        .collect();
    assert_eq!(
        results,
        [
            (started[0].as_str(), "Sunny in Paris.".to_owned()),
            (started[1].as_str(), "Sunny in Tokyo.".to_owned())
        ]
    );
    // And the stored history says the same once read back from the store.
    drop(runtime);
    let runtime = thinking_runtime(&server, SqliteStore::open(dir.join("flue.db")).unwrap());
    server.push(FixtureReply::anthropic_text("Still sunny."));
    runtime.init(&thinker, "t-dup").send("And now?").await.unwrap();
    let requests = server.requests();
    // (Prompt-cache breakpoints move to the newest message: compared without them.)
    let uncached = |message: &serde_json::Value| {
        let mut message = message.clone();
        for block in message["content"].as_array_mut().into_iter().flatten() {
            block.as_object_mut().unwrap().remove("cache_control");
        }
        message
    };
    let (before, replayed) = (&requests[1].body["messages"], &requests[2].body["messages"]);
    assert_eq!(
        uncached(&replayed[1]),
        uncached(&before[1]),
        "the calls, as sent before"
    );
    assert_eq!(
        uncached(&replayed[2]),
        uncached(&before[2]),
        "their results, as sent before"
    );
}

#[agent]
fn weather_desk() -> &'static str {
    use_model("fixture/gpt-test");
    use_subagent(Subagent::new(
        "forecaster",
        "Reports the weather of cities.",
        FnAgent::new(AgentDefinition::new("forecaster"), |_: AgentProps<'_>| {
            use_tool(get_weather);
            "You report the weather."
        }),
    ));
    "Delegate the weather."
}

/// The same in a task's child conversation.
#[tokio::test]
async fn a_childs_call_id_an_earlier_step_of_the_child_used_gets_one_of_its_own() {
    let server = FixtureServer::start().await;
    let task = r#"{"agent":"forecaster","prompt":"Paris, then Tokyo."}"#;
    server.push(FixtureReply::openai_tool_calls([("call_0", "task", task)]));
    server.push(FixtureReply::openai_tool_calls([(
        "call_0",
        "get_weather",
        r#"{"city":"Paris"}"#,
    )]));
    server.push(FixtureReply::openai_tool_calls([(
        "call_0",
        "get_weather",
        r#"{"city":"Tokyo"}"#,
    )]));
    server.push(FixtureReply::openai_text("Sunny in both."));
    server.push(FixtureReply::openai_text("Sunny in Paris and Tokyo."));
    let mut providers = ProviderRegistry::new();
    providers.register(
        OpenAiProvider::compatible("fixture", server.base_url(), "FLUE_FIXTURE_KEY").with_api_key("test-key"),
    );
    let runtime = Runtime::builder()
        .store(flue_runtime::store::MemoryStore::new())
        .agent(weather_desk)
        .providers(providers)
        .build()
        .unwrap();
    let reply = runtime
        .init(&weather_desk, "w-1")
        .send("Paris, then Tokyo?")
        .await
        .unwrap();
    assert_eq!(reply.text, "Sunny in Paris and Tokyo.");
    let requests = server.requests();
    assert_eq!(requests.len(), 5);
    // The child's last request: its two calls under two ids, each answered by its own result.
    let messages = requests[3].body["messages"].as_array().unwrap();
    let called = call_ids(messages);
    assert_eq!(called.len(), 2, "{called:?}");
    assert_eq!(called[0], "call_0");
    assert_ne!(called[1], "call_0");
    let answered = tool_results(messages);
    assert_eq!(
        answered,
        [("call_0", "Sunny in Paris."), (called[1], "Sunny in Tokyo.")]
    );
}

#[tokio::test]
async fn an_exchange_with_a_tool_call_split_across_many_chunks_runs_over_http() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_tool_calls_split(
        [("call_1", "get_weather", r#"{"city":"Paris"}"#)],
        3,
    ));
    server.push(FixtureReply::openai_text("It is sunny in Paris."));
    let runtime = runtime(&server);
    let reply = runtime
        .init(&forecaster, "f-1")
        .send("Weather in Paris?")
        .await
        .unwrap();
    assert_eq!(reply.text, "It is sunny in Paris.");
    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[0].header("authorization"), Some("Bearer test-key"));
    let system = requests[0].body["messages"][0]["content"].as_str().unwrap();
    assert!(
        system.starts_with("You report the weather.\n\n## Available Agents"),
        "{system}"
    );
    assert_eq!(requests[0].body["tools"][0]["function"]["name"], "get_weather");
    let messages = requests[1].body["messages"].as_array().unwrap();
    let tool = messages.last().unwrap();
    assert_eq!(tool["role"], "tool");
    assert_eq!(tool["content"], "Sunny in Paris.");
}

#[tokio::test]
async fn a_rate_limited_call_is_retried_and_the_response_completes() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::status(429, r#"{"error":{"message":"slow down"}}"#).retry_after(0));
    server.push(FixtureReply::openai_text("Done."));
    let runtime = runtime(&server);
    let reply = runtime.init(&forecaster, "f-2").send("hi").await.unwrap();
    assert_eq!(reply.text, "Done.");
    assert_eq!(server.requests().len(), 2);
}

/// A rate limit that asks for a longer wait than the runtime's retries wait fails the
/// submission at once: neither the provider nor the turn loop calls again into the same limit.
#[tokio::test]
async fn a_rate_limit_asking_for_a_longer_wait_than_retries_wait_fails_without_retrying() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::status(429, r#"{"error":{"message":"daily limit reached"}}"#).retry_after(86_400));
    server.push(FixtureReply::openai_text("never reached"));
    let runtime = runtime(&server);
    let error = runtime.init(&forecaster, "f-long-wait").send("hi").await.unwrap_err();
    let RuntimeError::Run { message, .. } = error else {
        panic!("run error")
    };
    assert!(message.contains("daily limit reached"), "{message}");
    assert!(message.contains("asks to wait 1day"), "{message}");
    assert_eq!(server.requests().len(), 1);
}

#[tokio::test]
async fn an_unauthorized_key_fails_the_submission_with_a_clear_error() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::status(401, r#"{"error":{"message":"bad key"}}"#));
    let runtime = runtime(&server);
    let error = runtime.init(&forecaster, "f-3").send("hi").await.unwrap_err();
    let RuntimeError::Run {
        error_type, message, ..
    } = error
    else {
        panic!("run error")
    };
    assert_eq!(error_type, "operation_failed");
    assert!(message.contains("FLUE_FIXTURE_KEY"), "{message}");
    assert!(
        !message.contains("test-key"),
        "the key never reaches an error: {message}"
    );
}

#[tokio::test]
async fn a_call_failing_with_server_errors_is_retried_three_times_in_all() {
    let server = FixtureServer::start().await;
    for _ in 0..20 {
        server.push(FixtureReply::status(
            500,
            r#"{"error":{"message":"boom","type":"server_error"}}"#,
        ));
    }
    let runtime = runtime(&server);
    let error = runtime.init(&forecaster, "f-4").send("hi").await.unwrap_err();
    assert!(matches!(error, RuntimeError::Run { .. }), "{error:?}");
    // The provider's retries before the response streamed and the turn loop's share one
    // budget: three retries, four requests.
    assert_eq!(server.requests().len(), 4);
}

#[tokio::test]
async fn retries_the_provider_made_before_a_stream_was_cut_count_against_the_budget() {
    let server = FixtureServer::start().await;
    // Two failures the provider retries, then streams cut mid-way, which the turn loop retries.
    for _ in 0..2 {
        server.push(FixtureReply::status(
            500,
            r#"{"error":{"message":"boom","type":"server_error"}}"#,
        ));
    }
    for _ in 0..10 {
        server.push(FixtureReply::openai_truncated("Hel"));
    }
    let runtime = runtime(&server);
    let error = runtime.init(&forecaster, "f-budget").send("hi").await.unwrap_err();
    assert!(matches!(error, RuntimeError::Run { .. }), "{error:?}");
    // Three retries in all, four requests: two retried 500s, then the cut stream retried once.
    assert_eq!(server.requests().len(), 4);
}

#[tokio::test]
async fn retries_the_provider_makes_after_a_stream_was_cut_count_against_the_budget_too() {
    let server = FixtureServer::start().await;
    // A cut stream the turn loop retries, then failures the provider retries itself.
    server.push(FixtureReply::openai_truncated("Hel"));
    for _ in 0..10 {
        server.push(FixtureReply::status(
            500,
            r#"{"error":{"message":"boom","type":"server_error"}}"#,
        ));
    }
    let runtime = runtime(&server);
    let error = runtime
        .init(&forecaster, "f-budget-after")
        .send("hi")
        .await
        .unwrap_err();
    assert!(matches!(error, RuntimeError::Run { .. }), "{error:?}");
    // Three retries in all, four requests: the cut stream, then the retry's request and the
    // two retries the budget had left for the provider (it would make three on its own).
    assert_eq!(server.requests().len(), 4);
}

#[tokio::test]
async fn a_budget_of_no_retries_leaves_the_provider_none_either() {
    let server = FixtureServer::start().await;
    for _ in 0..10 {
        server.push(FixtureReply::status(
            500,
            r#"{"error":{"message":"boom","type":"server_error"}}"#,
        ));
    }
    let mut providers = ProviderRegistry::new();
    providers.register(
        OpenAiProvider::compatible("fixture", server.base_url(), "FLUE_FIXTURE_KEY")
            .with_api_key("test-key")
            .with_retry_policy(RetryPolicy::new(3, std::time::Duration::from_millis(1))),
    );
    let runtime = Runtime::builder()
        .store(flue_runtime::store::MemoryStore::new())
        .agent(forecaster)
        .providers(providers)
        .options(RuntimeOptions {
            model_retries: 0,
            ..RuntimeOptions::default()
        })
        .build()
        .unwrap();
    let error = runtime.init(&forecaster, "f-no-retries").send("hi").await.unwrap_err();
    assert!(matches!(error, RuntimeError::Run { .. }), "{error:?}");
    assert_eq!(server.requests().len(), 1);
}

#[tokio::test]
async fn a_stream_cut_mid_way_is_streamed_again_as_a_new_message() {
    let server = FixtureServer::start().await;
    server.push(FixtureReply::openai_truncated("Hello"));
    server.push(FixtureReply::openai_text("Hello world."));
    let runtime = runtime(&server);
    let mut events = runtime.observe();
    let reply = runtime.init(&forecaster, "f-5").send("hi").await.unwrap();
    assert_eq!(reply.text, "Hello world.");
    assert_eq!(server.requests().len(), 2, "the cut stream was retried once");
    // What an observer assembles, message by message.
    let mut assistant = Vec::new();
    let mut open = false;
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            flue_runtime::events::Event::MessageStart { message } if message.role() == "assistant" => {
                assert!(!open, "a message starts only once the previous one ended");
                open = true;
                assistant.push(String::new());
            }
            flue_runtime::events::Event::MessageEnd { message } if message.role() == "assistant" => {
                assert!(open);
                open = false;
            }
            flue_runtime::events::Event::TextDelta { text } => {
                assert!(open, "a delta belongs to an open message");
                assistant.last_mut().unwrap().push_str(&text);
            }
            _ => {}
        }
    }
    assert!(!open);
    assert_eq!(assistant, ["Hello", "Hello world."]);
}

#[tokio::test]
async fn a_tool_call_announced_by_a_stream_that_is_retried_is_told_it_ended() {
    use flue_runtime::testing::fixture_server::OpenAiChunk;
    let server = FixtureServer::start().await;
    // The call starts streaming, then the connection closes before the response ends.
    server.push(FixtureReply::openai_chunks([
        OpenAiChunk::ToolCallStart {
            index: 0,
            id: "call_lost".into(),
            name: "get_weather".into(),
        },
        OpenAiChunk::ToolCallArguments {
            index: 0,
            fragment: r#"{"city":"Paris","#.into(),
        },
    ]));
    server.push(FixtureReply::openai_text("No weather today."));
    let runtime = runtime(&server);
    let mut events = runtime.observe();
    let reply = runtime.init(&forecaster, "f-lost").send("hi").await.unwrap();
    assert_eq!(reply.text, "No weather today.");
    let mut thread_events = Vec::new();
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            Event::ToolCallStarted { tool_call_id, .. } => thread_events.push(("started", tool_call_id)),
            Event::ToolCallDone {
                tool_call_id, status, ..
            } => thread_events.push(("done", format!("{tool_call_id} {status}"))),
            _ => {}
        }
    }
    // Announced once its progress argument (`city`) streamed whole; the retried response
    // called nothing, so the call is told it ended, as failed.
    assert_eq!(
        thread_events,
        [
            ("started", "call_lost".to_owned()),
            ("done", "call_lost error".to_owned())
        ]
    );
}

#[agent]
fn thinker() -> &'static str {
    use_model_with("claude/claude-sonnet-4-5", ModelOptions::thinking(ThinkingLevel::High));
    use_tool(get_weather);
    "You think, then report the weather."
}

fn thinking_runtime(server: &FixtureServer, store: SqliteStore) -> Runtime {
    thinking_runtime_of(server, store, thinker)
}

/// A runtime on `store` running `agent`, its `claude` provider pointed at `server`.
fn thinking_runtime_of(
    server: &FixtureServer,
    store: impl flue_runtime::store::Store,
    agent: impl Into<flue_runtime::AgentRef>,
) -> Runtime {
    let mut providers = ProviderRegistry::new();
    providers.register(
        AnthropicProvider::anthropic()
            .with_id("claude")
            .with_base_url(server.base_url())
            .with_api_key("test-key")
            .with_retry_policy(RetryPolicy::new(3, std::time::Duration::from_millis(1))),
    );
    Runtime::builder()
        .store(store)
        .agent(agent)
        .providers(providers)
        .build()
        .unwrap()
}

/// Scripts `server`: a step that thinks ("Paris, so look it up.", signed `sig-paris`) and
/// calls `get_weather` for Paris, then the answer "Sunny in Paris.".
fn push_signed_thinking_then_answer(server: &FixtureServer) {
    server.push(FixtureReply::anthropic_events([
        AnthropicEvent::MessageStart(Usage::default()),
        AnthropicEvent::ThinkingStart { index: 0 },
        AnthropicEvent::ThinkingDelta {
            index: 0,
            thinking: "Paris, so look it up.".into(),
        },
        AnthropicEvent::SignatureDelta {
            index: 0,
            signature: "sig-paris".into(),
        },
        AnthropicEvent::BlockStop { index: 0 },
        AnthropicEvent::ToolUseStart {
            index: 1,
            id: "toolu_1".into(),
            name: "get_weather".into(),
        },
        AnthropicEvent::InputJsonDelta {
            index: 1,
            partial_json: r#"{"city":"Paris"}"#.into(),
        },
        AnthropicEvent::BlockStop { index: 1 },
        AnthropicEvent::MessageDelta {
            stop_reason: "tool_use".into(),
            output_tokens: 12,
        },
        AnthropicEvent::MessageStop,
    ]));
    server.push(FixtureReply::anthropic_text("Sunny in Paris."));
}

/// Anthropic requires a step's signed thinking back in the next call of its tool loop: the
/// runtime stores it with the step, sends it back (so thinking stays on in the loop), keeps it
/// across a restart, and shows observers the reasoning but not the signature.
#[tokio::test]
async fn signed_thinking_goes_back_to_anthropic_within_its_tool_loop_and_survives_a_restart() {
    let db = scratch::dir("signed-thinking").join("flue.db");
    let server = FixtureServer::start().await;
    push_signed_thinking_then_answer(&server);
    let signed = json!({"type": "thinking", "thinking": "Paris, so look it up.", "signature": "sig-paris"});
    {
        let runtime = thinking_runtime(&server, SqliteStore::open(&db).unwrap());
        let mut events = runtime.observe();
        let reply = runtime.init(&thinker, "t").send("Weather in Paris?").await.unwrap();
        assert_eq!(reply.text, "Sunny in Paris.");
        let loop_call = &server.requests()[1].body;
        assert_eq!(
            loop_call["thinking"]["type"], "enabled",
            "thinking stays on in the loop"
        );
        assert_eq!(loop_call["messages"][1]["content"][0], signed);
        assert_eq!(loop_call["messages"][1]["content"][1]["type"], "tool_use");
        // Stored with the step.
        let records = runtime
            .store()
            .read(&InstanceKey::new("thinker", "t"), None)
            .await
            .unwrap();
        let stored: Vec<&Vec<ReasoningBlock>> = records
            .iter()
            .flat_map(|batch| batch.records.iter())
            .filter_map(|record| match &record.body {
                RecordBody::AssistantMessageCompleted { reasoning_blocks, .. } => Some(reasoning_blocks),
                _ => None,
            })
            .collect();
        assert_eq!(
            stored,
            [
                &vec![ReasoningBlock::Thinking {
                    thinking: "Paris, so look it up.".into(),
                    signature: "sig-paris".into(),
                    at: Some(flue_runtime::provider::ContentAt::default()),
                }],
                &vec![]
            ]
        );
        // Observers see the reasoning, never the signature.
        let mut ended = None;
        while let Ok(observation) = events.try_recv() {
            if let Event::MessageEnd {
                message: ModelMessage::Assistant {
                    tool_calls, reasoning, ..
                },
            } = observation.event
                && !tool_calls.is_empty()
            {
                ended = Some(reasoning);
            }
        }
        assert_eq!(
            ended,
            Some(vec![ReasoningBlock::Thinking {
                thinking: "Paris, so look it up.".into(),
                signature: REASONING_DATA_OMITTED.into(),
                at: Some(flue_runtime::provider::ContentAt::default()),
            }])
        );
        runtime.shutdown();
    }
    // A restart on the same database: the step keeps its signed thinking.
    server.push(FixtureReply::anthropic_text("Still sunny."));
    let runtime = thinking_runtime(&server, SqliteStore::open(&db).unwrap());
    runtime.init(&thinker, "t").send("And now?").await.unwrap();
    let next_turn = &server.requests()[2].body;
    assert_eq!(next_turn["messages"][1]["content"][0], signed);
    assert_eq!(next_turn["thinking"]["type"], "enabled");
}

/// Whether `switching_thinker` renders with Opus (Sonnet otherwise).
static THINKS_WITH_OPUS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[agent]
fn switching_thinker() -> &'static str {
    let model = if THINKS_WITH_OPUS.load(std::sync::atomic::Ordering::SeqCst) {
        "claude/claude-opus-4-1"
    } else {
        "claude/claude-sonnet-4-5"
    };
    use_model_with(model, ModelOptions::thinking(ThinkingLevel::High));
    use_tool(get_weather);
    "You think, then report the weather."
}

/// A thinking block's signature is bound to the model that made it: Anthropic checks the
/// signatures of every block it is sent (earlier turns' too) and refuses another model's. A
/// conversation whose model changes sends the other model's steps without their reasoning, and
/// its own steps with theirs again once it is back, in a cached conversation and after a
/// restart alike.
#[tokio::test]
async fn signed_thinking_goes_back_only_to_the_model_that_made_it() {
    let db = scratch::dir("thinking-model-switch").join("flue.db");
    let server = FixtureServer::start().await;
    push_signed_thinking_then_answer(&server);
    let signed = json!({"type": "thinking", "thinking": "Paris, so look it up.", "signature": "sig-paris"});
    // The content of the step that called the tool, in the request `at`.
    let step = |at: usize| server.requests()[at].body["messages"][1]["content"].clone();
    let sent_blocks = |at: usize| -> Vec<String> {
        step(at)
            .as_array()
            .unwrap()
            .iter()
            .map(|block| block["type"].as_str().unwrap().to_owned())
            .collect()
    };
    {
        let runtime = thinking_runtime_of(&server, SqliteStore::open(&db).unwrap(), switching_thinker);
        let thread = runtime.init(&switching_thinker, "t");
        assert_eq!(thread.send("Weather in Paris?").await.unwrap().text, "Sunny in Paris.");
        assert_eq!(step(1)[0], signed, "Sonnet's own tool loop carries its thinking");

        THINKS_WITH_OPUS.store(true, std::sync::atomic::Ordering::SeqCst);
        server.push(FixtureReply::anthropic_text("Still sunny."));
        thread.send("And now?").await.unwrap();
        assert_eq!(server.requests()[2].body["model"], "claude-opus-4-1");
        assert_eq!(
            sent_blocks(2),
            ["tool_use"],
            "Opus is not sent Sonnet's signed thinking"
        );
        assert_eq!(server.requests()[2].body["thinking"]["type"], "enabled");

        THINKS_WITH_OPUS.store(false, std::sync::atomic::Ordering::SeqCst);
        server.push(FixtureReply::anthropic_text("Sunny still."));
        thread.send("And later?").await.unwrap();
        assert_eq!(step(3)[0], signed, "back on Sonnet, its step has its thinking again");
        runtime.shutdown();
    }
    // After a restart (the conversation folded afresh from the stream), on Opus again.
    THINKS_WITH_OPUS.store(true, std::sync::atomic::Ordering::SeqCst);
    server.push(FixtureReply::anthropic_text("Sunny at night."));
    let runtime = thinking_runtime_of(&server, SqliteStore::open(&db).unwrap(), switching_thinker);
    runtime.init(&switching_thinker, "t").send("Tonight?").await.unwrap();
    assert_eq!(sent_blocks(4), ["tool_use"]);
}

/// Redacts a name from the answers' rows.
#[hook(before_update_message)]
async fn redact_paris(
    _state: &flue_runtime::lifecycle::ThreadState,
    _id: &str,
    mut updates: flue_runtime::lifecycle::MessageUpdates,
) -> flue_runtime::lifecycle::MessageUpdates {
    if let Some(serde_json::Value::String(content)) = updates.get("content").cloned() {
        updates.insert("content".into(), json!(content.replace("Paris", "[city]")));
    }
    updates
}

#[agent(hooks = [redact_paris])]
fn redacted_thinker() -> &'static str {
    use_model_with("claude/claude-sonnet-4-5", ModelOptions::thinking(ThinkingLevel::High));
    use_tool(get_weather);
    "You think, then report the weather."
}

/// An agent whose hooks reshape assistant rows never shows observers the raw reasoning (the
/// hooks never see it, so could not redact it): the step's `message_end` carries none, though
/// the signed blocks stay in the record for the next request.
#[tokio::test]
async fn observers_get_no_reasoning_of_an_agent_whose_hooks_reshape_its_answers() {
    let server = FixtureServer::start().await;
    push_signed_thinking_then_answer(&server);
    let runtime = thinking_runtime_of(&server, flue_runtime::store::MemoryStore::new(), redacted_thinker);
    let mut events = runtime.observe();
    let reply = runtime
        .init(&redacted_thinker, "r")
        .send("Weather in Paris?")
        .await
        .unwrap();
    assert_eq!(reply.text, "Sunny in [city].");
    let mut seen = String::new();
    while let Ok(observation) = events.try_recv() {
        seen.push_str(&serde_json::to_string(&observation.event).unwrap());
    }
    assert!(seen.contains("message_end"), "{seen}");
    assert!(!seen.contains("look it up"), "{seen}");
    let next = &server.requests()[1].body;
    assert_eq!(next["messages"][1]["content"][0]["thinking"], "Paris, so look it up.");
}

#[agent]
fn routed_thinker() -> &'static str {
    use_model_with(
        "openrouter/google/gemini-3-pro",
        ModelOptions::thinking(ThinkingLevel::High),
    );
    use_tool(get_weather);
    "You think, then report the weather."
}

fn routed_runtime(server: &FixtureServer, store: SqliteStore) -> Runtime {
    let mut providers = ProviderRegistry::new();
    providers.register(
        OpenAiProvider::openrouter()
            .with_base_url(server.base_url())
            .with_api_key("test-key")
            .with_retry_policy(RetryPolicy::new(3, std::time::Duration::from_millis(1))),
    );
    Runtime::builder()
        .store(store)
        .agent(routed_thinker)
        .providers(providers)
        .build()
        .unwrap()
}

/// OpenRouter wants a step's reasoning details back in the next call of its tool loop (Gemini
/// and Claude through it refuse the call without them): the runtime stores them with the step,
/// sends them back, keeps them across a restart, and shows observers no encrypted data.
#[tokio::test]
async fn openrouter_reasoning_details_go_back_within_the_tool_loop_and_survive_a_restart() {
    let db = scratch::dir("openrouter-details").join("flue.db");
    let server = FixtureServer::start().await;
    server.push(FixtureReply::raw_sse([
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"reasoning\":\"Paris.\",\"reasoning_details\":[{\"type\":\"reasoning.text\",\"text\":\"Paris.\",\"format\":\"google-gemini-v1\",\"index\":0}]}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"reasoning_details\":[{\"type\":\"reasoning.encrypted\",\"data\":\"sealed\",\"format\":\"google-gemini-v1\",\"index\":1}]}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Paris\\\"}\"}}]}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n",
        "data: [DONE]\n\n",
    ]));
    server.push(FixtureReply::openai_text("Sunny in Paris."));
    let details = json!([
        {"type": "reasoning.text", "text": "Paris.", "format": "google-gemini-v1", "index": 0},
        {"type": "reasoning.encrypted", "data": "sealed", "format": "google-gemini-v1", "index": 1},
    ]);
    {
        let runtime = routed_runtime(&server, SqliteStore::open(&db).unwrap());
        let mut events = runtime.observe();
        let reply = runtime
            .init(&routed_thinker, "r")
            .send("Weather in Paris?")
            .await
            .unwrap();
        assert_eq!(reply.text, "Sunny in Paris.");
        let loop_call = &server.requests()[1].body;
        assert_eq!(loop_call["messages"][2]["reasoning_details"], details, "{loop_call}");
        let mut ended = None;
        while let Ok(observation) = events.try_recv() {
            if let Event::MessageEnd {
                message: ModelMessage::Assistant {
                    tool_calls, reasoning, ..
                },
            } = observation.event
                && !tool_calls.is_empty()
            {
                ended = Some(serde_json::to_value(reasoning).unwrap());
            }
        }
        let ended = ended.expect("the tool-calling step ended");
        assert!(!ended.to_string().contains("sealed"), "{ended}");
        assert_eq!(ended[1]["detail"]["data"], REASONING_DATA_OMITTED);
        runtime.shutdown();
    }
    server.push(FixtureReply::openai_text("Still sunny."));
    let runtime = routed_runtime(&server, SqliteStore::open(&db).unwrap());
    runtime.init(&routed_thinker, "r").send("And now?").await.unwrap();
    assert_eq!(server.requests()[2].body["messages"][2]["reasoning_details"], details);
}
