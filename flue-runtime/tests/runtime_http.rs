//! The runtime over the real reqwest path: an agent served by an OpenAI-compatible provider
//! pointed at the loopback fixture server.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use flue_runtime::prelude::*;
use flue_runtime::provider::openai::OpenAiProvider;
use flue_runtime::provider::{ProviderRegistry, RetryPolicy};
use flue_runtime::testing::fixture_server::{FixtureReply, FixtureServer};
use flue_runtime::{Runtime, RuntimeError, RuntimeOptions};

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
