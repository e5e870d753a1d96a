//! A model step's text reaches the record stream, and so HTTP clients, while the step still
//! streams: coalesced `assistant_text_delta` records, at most one per `text_flush` interval,
//! and the step's completion alone says what its text is.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

mod harness;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flue_runtime::prelude::*;
use flue_runtime::provider::{
    ModelProvider, ModelRequest, ModelResponse, ModelStream, ModelToolCall, ProviderError, ProviderErrorKind,
    ProviderRegistry, StopReason, StreamEvent,
};
use flue_runtime::record::{Batch, RecordBody};
use flue_runtime::store::{InstanceKey, Store};
use flue_runtime::{Runtime, RuntimeOptions};
use harness::faulty::FaultyStore;
use serde_json::{Value, json};
use tokio::sync::Semaphore;

/// What one scripted call does, in order.
#[derive(Clone)]
enum Step {
    /// Streams a text delta.
    Text(&'static str),
    /// Streams a reasoning delta.
    Reasoning(&'static str),
    /// Waits until the test opens the gate once.
    Gate,
    /// Fails the call with a retryable network error.
    Fail,
    /// Completes the call with this text (and the reasoning it streamed).
    Complete(&'static str),
    /// Completes the call with the text it streamed and a call of tool `.0` with arguments `.1`.
    CallTool(&'static str, &'static str),
}

/// A model whose calls stream as scripted, waiting at gates the test opens.
#[derive(Clone)]
struct GatedModel {
    calls: Arc<Mutex<VecDeque<Vec<Step>>>>,
    gate: Arc<Semaphore>,
    requests: Arc<Mutex<Vec<ModelRequest>>>,
}

impl GatedModel {
    fn new(calls: Vec<Vec<Step>>) -> Self {
        Self {
            calls: Arc::new(Mutex::new(calls.into())),
            gate: Arc::new(Semaphore::new(0)),
            requests: Arc::default(),
        }
    }

    fn open_gate(&self) {
        self.gate.add_permits(1);
    }
}

impl ModelProvider for GatedModel {
    fn id(&self) -> &str {
        "gated"
    }

    fn stream(&self, request: &ModelRequest) -> ModelStream {
        self.requests.lock().unwrap().push(request.clone());
        let steps: VecDeque<Step> = self.calls.lock().unwrap().pop_front().unwrap_or_default().into();
        let gate = self.gate.clone();
        // The steps left, and the reasoning and text streamed so far.
        let state = (steps, String::new(), String::new());
        Box::pin(futures_util::stream::unfold(
            state,
            move |(mut steps, mut reasoning, mut said)| {
                let gate = gate.clone();
                async move {
                    let event = loop {
                        match steps.pop_front()? {
                            Step::Text(text) => {
                                said.push_str(text);
                                break Ok(StreamEvent::TextDelta(text.into()));
                            }
                            Step::Reasoning(text) => {
                                reasoning.push_str(text);
                                break Ok(StreamEvent::ReasoningDelta(text.into()));
                            }
                            Step::Gate => gate.acquire().await.unwrap().forget(),
                            Step::Fail => {
                                steps.clear();
                                break Err(ProviderError::new(ProviderErrorKind::Network, "the connection dropped"));
                            }
                            Step::Complete(text) => {
                                steps.clear();
                                break Ok(StreamEvent::Completed(ModelResponse {
                                    text: text.into(),
                                    reasoning: reasoning.clone(),
                                    tool_calls: Vec::new(),
                                    stop_reason: StopReason::Stop,
                                    usage: Default::default(),
                                    reasoning_blocks: Vec::new(),
                                }));
                            }
                            Step::CallTool(name, arguments) => {
                                steps.clear();
                                break Ok(StreamEvent::Completed(ModelResponse {
                                    text: said.clone(),
                                    reasoning: reasoning.clone(),
                                    tool_calls: vec![ModelToolCall {
                                        id: "call_1".into(),
                                        name: name.into(),
                                        arguments: arguments.into(),
                                    }],
                                    stop_reason: StopReason::ToolUse,
                                    usage: Default::default(),
                                    reasoning_blocks: Vec::new(),
                                }));
                            }
                        }
                    };
                    Some((event, (steps, reasoning, said)))
                }
            },
        ))
    }
}

#[agent]
fn narrator() -> &'static str {
    use_model("gated/x");
    "Tell it."
}

#[hook(before_update_message)]
async fn redact(_state: &ThreadState, _id: &str, mut updates: MessageUpdates) -> MessageUpdates {
    if let Some(Value::String(content)) = updates.get("content").cloned() {
        updates.insert("content".into(), json!(content.replace("secret", "[redacted]")));
    }
    updates
}

#[agent(hooks = [redact])]
fn redacting_narrator() -> &'static str {
    use_model("gated/x");
    "Tell it."
}

/// The weather of a city.
#[tool]
async fn weather(
    /// The city.
    city: String,
) -> String {
    format!("Sunny in {city}")
}

#[agent]
fn forecaster() -> &'static str {
    use_model("gated/x");
    use_tool(weather);
    "Forecast."
}

/// One model step per response, and response-start metadata.
#[agent(max_steps = 1)]
fn one_step() -> &'static str {
    use_model("gated/x");
    use_response_start(|_| json!({"channel": "web"}));
    "Be brief."
}

/// How often `counted_start`'s response-start callback ran (one test uses it).
static STARTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// `one_step` whose start metadata says which run of its callback made it.
#[agent(max_steps = 1)]
fn counted_start() -> &'static str {
    use_model("gated/x");
    use_response_start(|_| json!({"start": STARTS.fetch_add(1, std::sync::atomic::Ordering::SeqCst)}));
    "Be brief."
}

struct Served {
    runtime: Runtime,
    store: FaultyStore,
    base: String,
    client: reqwest::Client,
}

async fn serve(model: &GatedModel, text_flush: Option<Duration>) -> Served {
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    let store = FaultyStore::default();
    let runtime = Runtime::builder()
        .store(store.clone())
        .providers(providers)
        .agent(narrator)
        .agent(redacting_narrator)
        .agent(forecaster)
        .agent(one_step)
        .agent(counted_start)
        .options(RuntimeOptions {
            model_retry_delay: Duration::from_millis(1),
            text_flush,
            ..RuntimeOptions::default()
        })
        .build()
        .unwrap();
    let app = flue_runtime::http::router(&runtime);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Served {
        runtime,
        store,
        base: format!("http://{addr}/agents"),
        client: reqwest::Client::new(),
    }
}

impl Served {
    async fn admit(&self, agent: &str, id: &str, body: &str) {
        let response = self
            .client
            .post(format!("{}/{agent}/{id}", self.base))
            .json(&json!({"kind": "user", "body": body}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 202);
    }

    async fn get(&self, agent: &str, tail: &str) -> Value {
        let response = self
            .client
            .get(format!("{}/{agent}/{tail}", self.base))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 200);
        response.json().await.unwrap()
    }

    /// Every chunk of the updates view from the start (the checkpoint left out).
    async fn updates(&self, agent: &str, id: &str) -> Vec<Value> {
        let chunks = self.get(agent, &format!("{id}?view=updates&offset=-1")).await;
        chunks.as_array().unwrap()[1..].to_vec()
    }

    /// The updates once `done` holds for them.
    async fn updates_until(&self, agent: &str, id: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        for _ in 0..500 {
            let chunks = self.updates(agent, id).await;
            if done(&chunks) {
                return chunks;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the updates of {agent}/{id} never reached the awaited state");
    }

    /// The updates once the first text or reasoning of `agent/id` streamed.
    async fn first_delta(&self, agent: &str, id: &str) -> Vec<Value> {
        self.updates_until(agent, id, |chunks| types(chunks).contains(&"message-delta"))
            .await
    }

    async fn batches(&self, agent: &str, id: &str) -> Vec<Batch> {
        self.store.read(&InstanceKey::new(agent, id), None).await.unwrap()
    }
}

fn types(chunks: &[Value]) -> Vec<&str> {
    chunks.iter().map(|chunk| chunk["type"].as_str().unwrap()).collect()
}

fn settled(chunks: &[Value]) -> bool {
    types(chunks).contains(&"submission-settled")
}

/// The text deltas a stream's records carry, in order.
fn text_deltas(batches: &[Batch]) -> Vec<String> {
    batches
        .iter()
        .flat_map(|batch| batch.records.iter())
        .filter_map(|record| match &record.body {
            RecordBody::AssistantTextDelta { delta, .. } => Some(delta.clone()),
            _ => None,
        })
        .collect()
}

fn assistant_parts(snapshot: &Value) -> Value {
    let messages = snapshot["messages"].as_array().unwrap();
    let assistant = messages.iter().find(|message| message["role"] == "assistant").unwrap();
    assistant["parts"].clone()
}

#[tokio::test]
async fn a_long_answer_reaches_http_readers_while_the_model_still_streams() {
    let model = GatedModel::new(vec![vec![
        Step::Text("Once upon"),
        Step::Gate,
        Step::Text(" a time"),
        Step::Complete("Once upon a time"),
    ]]);
    let served = serve(&model, Some(Duration::from_millis(20))).await;
    served.admit("narrator", "n1", "tell me a story").await;

    // The model is held after its first delta: the text is in the stream all the same.
    let chunks = served.first_delta("narrator", "n1").await;
    assert_eq!(
        types(&chunks),
        [
            "conversation-reset",
            "message-appended",
            "message-started",
            "message-delta"
        ]
    );
    assert_eq!(chunks[3]["delta"], "Once upon");
    assert_eq!(chunks[3]["messageId"], chunks[2]["messageId"]);
    let snapshot = served.get("narrator", "n1").await;
    assert_eq!(
        assistant_parts(&snapshot),
        json!([{"type": "text", "text": "Once upon", "state": "streaming"}]),
        "the history shows the step streaming"
    );

    model.open_gate();
    let chunks = served.updates_until("narrator", "n1", settled).await;
    assert_eq!(
        types(&chunks),
        [
            "conversation-reset",
            "message-appended",
            "message-started",
            "message-delta",
            "message-delta",
            "message-completed",
            "submission-settled",
        ]
    );
    assert_eq!(chunks[4]["delta"], " a time", "the rest of the text, once");
    let batches: Vec<u64> = chunks[2..6]
        .iter()
        .map(|chunk| chunk["position"]["batch"].as_u64().unwrap())
        .collect();
    assert!(
        batches[1] < batches[3],
        "the first delta was its own append: {batches:?}"
    );
    let snapshot = served.get("narrator", "n1").await;
    assert_eq!(
        assistant_parts(&snapshot),
        json!([{"type": "text", "text": "Once upon a time", "state": "done"}])
    );
    let streamed = text_deltas(&served.batches("narrator", "n1").await);
    assert!(
        !streamed.is_empty() && "Once upon a time".starts_with(&streamed.concat()),
        "{streamed:?}"
    );

    // The model reads the step's text from its completion, once.
    model.calls.lock().unwrap().push_back(vec![Step::Complete("The end.")]);
    served.admit("narrator", "n1", "and then?").await;
    served
        .updates_until("narrator", "n1", |chunks| {
            types(chunks)
                .iter()
                .filter(|kind| **kind == "submission-settled")
                .count()
                == 2
        })
        .await;
    let requests = model.requests.lock().unwrap().clone();
    let history = format!("{:?}", requests[1].messages.clone().into_vec());
    assert_eq!(history.matches("Once upon").count(), 1, "{history}");
    served.runtime.shutdown();
}

#[tokio::test]
async fn a_fast_answer_is_one_append_and_no_interval_streams_nothing_early() {
    for text_flush in [Some(Duration::from_secs(60)), None] {
        let model = GatedModel::new(vec![vec![
            Step::Text("Quick"),
            Step::Text(" answer"),
            Step::Complete("Quick answer"),
        ]]);
        let served = serve(&model, text_flush).await;
        served.admit("narrator", "n2", "hi").await;
        let chunks = served.updates_until("narrator", "n2", settled).await;
        assert_eq!(
            types(&chunks),
            [
                "conversation-reset",
                "message-appended",
                "message-started",
                "message-delta",
                "message-completed",
                "submission-settled",
            ],
            "{text_flush:?}"
        );
        assert_eq!(chunks[3]["delta"], "Quick answer");
        assert!(text_deltas(&served.batches("narrator", "n2").await).is_empty());
        served.runtime.shutdown();
    }
}

#[tokio::test]
async fn a_call_retried_after_its_text_streamed_resets_readers_to_the_text_it_completed_with() {
    let model = GatedModel::new(vec![
        vec![Step::Text("I think the ans"), Step::Gate, Step::Fail],
        vec![
            Step::Text("The answer"),
            Step::Gate,
            Step::Text(" is 4."),
            Step::Complete("The answer is 4."),
        ],
    ]);
    let served = serve(&model, Some(Duration::from_millis(20))).await;
    served.admit("narrator", "n3", "2+2?").await;
    served.first_delta("narrator", "n3").await;
    model.open_gate();
    // While the retry streams, readers see its text alone: its first append started the step
    // again, which dropped the failed call's text (a reset).
    let text = |snapshot: &Value| assistant_parts(snapshot)[0]["text"].clone();
    for _ in 0..500 {
        if text(&served.get("narrator", "n3").await) == "The answer" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(text(&served.get("narrator", "n3").await), "The answer");
    model.open_gate();
    let chunks = served.updates_until("narrator", "n3", settled).await;
    let last_reset = chunks
        .iter()
        .rposition(|chunk| chunk["type"] == "conversation-reset")
        .unwrap();
    assert!(last_reset > 0, "the retry reset the readers: {:?}", types(&chunks));
    assert_eq!(
        assistant_parts(&chunks[last_reset]["snapshot"]),
        json!([{"type": "text", "text": "The answer", "state": "streaming"}])
    );
    assert_eq!(
        types(&chunks[last_reset + 1..]),
        ["message-delta", "message-completed", "submission-settled"]
    );
    assert_eq!(chunks[last_reset + 1]["delta"], " is 4.");
    let snapshot = served.get("narrator", "n3").await;
    assert_eq!(
        assistant_parts(&snapshot),
        json!([{"type": "text", "text": "The answer is 4.", "state": "done"}])
    );

    // The protocol's client folds the same answer.
    let client = flue_runtime::client::Client::new(served.base.trim_end_matches("/agents")).unwrap();
    let instance = client.instance("narrator", "n3");
    model.calls.lock().unwrap().push_back(vec![Step::Complete("Yes.")]);
    let reply = instance.prompt("sure?").await.unwrap();
    assert_eq!(reply.text, "Yes.");
    served.runtime.shutdown();
}

#[tokio::test]
async fn an_agent_whose_hook_rewrites_answers_never_streams_raw_text_into_the_stream() {
    let model = GatedModel::new(vec![vec![
        Step::Reasoning("the secret is 42"),
        Step::Text("the secret is"),
        Step::Gate,
        Step::Text(" out"),
        Step::Complete("the secret is out"),
    ]]);
    let served = serve(&model, Some(Duration::from_millis(1))).await;
    served.admit("redacting_narrator", "r1", "tell").await;
    // The model is called (the message is in the stream by then)…
    for _ in 0..1000 {
        if !model.requests.lock().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!model.requests.lock().unwrap().is_empty(), "the model was never called");
    // …and well past the interval while it is held, nothing of the step is in the stream.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let chunks = served.updates("redacting_narrator", "r1").await;
    assert_eq!(types(&chunks), ["conversation-reset", "message-appended"]);
    model.open_gate();
    let chunks = served.updates_until("redacting_narrator", "r1", settled).await;
    let deltas: Vec<&Value> = chunks.iter().filter(|chunk| chunk["type"] == "message-delta").collect();
    assert_eq!(
        deltas.len(),
        1,
        "no reasoning either: the hook never sees it, so none is kept"
    );
    assert_eq!(deltas[0]["delta"], "the [redacted] is out");
    let batches = served.batches("redacting_narrator", "r1").await;
    assert!(text_deltas(&batches).is_empty());
    let stored = serde_json::to_string(
        &batches
            .iter()
            .flat_map(|batch| batch.records.iter())
            .collect::<Vec<_>>(),
    )
    .unwrap();
    assert!(!stored.contains("secret"), "{stored}");
    served.runtime.shutdown();
}

#[tokio::test]
async fn reasoning_streams_into_its_own_part_before_the_text_and_a_fast_step_shows_both() {
    let model = GatedModel::new(vec![
        vec![
            Step::Reasoning("Count the "),
            Step::Gate,
            Step::Reasoning("letters."),
            Step::Text("Five"),
            Step::Gate,
            Step::Text(" letters."),
            Step::Complete("Five letters."),
        ],
        vec![Step::Reasoning("Easy."), Step::Complete("Yes.")],
    ]);
    let served = serve(&model, Some(Duration::from_millis(20))).await;
    served.admit("narrator", "t1", "how long is 'hello'?").await;
    served.first_delta("narrator", "t1").await;
    model.open_gate();
    let chunks = served
        .updates_until("narrator", "t1", |chunks| {
            chunks
                .iter()
                .any(|chunk| chunk["type"] == "message-delta" && chunk["kind"] == "text")
        })
        .await;
    let snapshot = served.get("narrator", "t1").await;
    let parts = assistant_parts(&snapshot);
    assert_eq!(parts[0]["type"], "reasoning", "{parts}");
    assert_eq!(parts[1]["type"], "text", "{parts}");
    assert_eq!(parts[1]["state"], "streaming", "{parts}");
    assert!(
        chunks
            .iter()
            .all(|chunk| chunk["type"] != "conversation-reset" || chunk["position"]["batch"] == 0)
    );

    model.open_gate();
    let chunks = served.updates_until("narrator", "t1", settled).await;
    let deltas: Vec<(&str, &str)> = chunks
        .iter()
        .filter(|chunk| chunk["type"] == "message-delta")
        .map(|chunk| (chunk["kind"].as_str().unwrap(), chunk["delta"].as_str().unwrap()))
        .collect();
    let reasoning: String = deltas
        .iter()
        .filter(|(kind, _)| *kind == "reasoning")
        .map(|(_, delta)| *delta)
        .collect();
    let text: String = deltas
        .iter()
        .filter(|(kind, _)| *kind == "text")
        .map(|(_, delta)| *delta)
        .collect();
    assert_eq!(
        (reasoning.as_str(), text.as_str()),
        ("Count the letters.", "Five letters."),
        "{deltas:?}"
    );
    assert_eq!(
        assistant_parts(&served.get("narrator", "t1").await),
        json!([
            {"type": "reasoning", "text": "Count the letters.", "state": "done"},
            {"type": "text", "text": "Five letters.", "state": "done"},
        ])
    );

    // A step too fast to stream anything shows its reasoning too, from its completion.
    served.admit("narrator", "t1", "sure?").await;
    let chunks = served
        .updates_until("narrator", "t1", |chunks| {
            types(chunks)
                .iter()
                .filter(|kind| **kind == "submission-settled")
                .count()
                == 2
        })
        .await;
    let second = chunks
        .iter()
        .rposition(|chunk| chunk["type"] == "message-started")
        .unwrap();
    assert_eq!(
        types(&chunks[second..]),
        [
            "message-started",
            "message-delta",
            "message-delta",
            "message-completed",
            "submission-settled"
        ]
    );
    assert_eq!(chunks[second + 1]["kind"], "reasoning");
    assert_eq!(chunks[second + 1]["delta"], "Easy.");
    assert_eq!(chunks[second + 2]["kind"], "text");
    served.runtime.shutdown();
}

#[tokio::test]
async fn a_streamed_step_that_calls_a_tool_finishes_its_text_before_the_tool_input() {
    let model = GatedModel::new(vec![
        vec![
            Step::Text("Let me check"),
            Step::Gate,
            Step::Text(" the weather."),
            Step::CallTool("weather", r#"{"city":"Paris"}"#),
        ],
        vec![Step::Complete("Sunny.")],
    ]);
    let served = serve(&model, Some(Duration::from_millis(20))).await;
    served.admit("forecaster", "w1", "weather in Paris?").await;
    served.first_delta("forecaster", "w1").await;
    model.open_gate();
    let chunks = served.updates_until("forecaster", "w1", settled).await;
    let kinds: Vec<String> = chunks
        .iter()
        .filter(|chunk| chunk["type"] != "message-started")
        .map(|chunk| match chunk["type"].as_str().unwrap() {
            "message-delta" => format!("delta {}", chunk["delta"].as_str().unwrap()),
            kind => kind.to_owned(),
        })
        .collect();
    assert_eq!(
        kinds[2..],
        [
            "delta Let me check",
            "delta  the weather.",
            "tool-input",
            "message-completed",
            "tool-output",
            "delta Sunny.",
            "message-completed",
            "submission-settled",
        ],
        "a client that extends the last streaming part folds the step's text whole"
    );
    let parts = assistant_parts(&served.get("forecaster", "w1").await);
    let shapes: Vec<(&str, &str)> = parts
        .as_array()
        .unwrap()
        .iter()
        .map(|part| (part["type"].as_str().unwrap(), part["text"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(
        shapes,
        [
            ("text", "Let me check the weather."),
            ("dynamic-tool", ""),
            ("text", "Sunny.")
        ]
    );
    served.runtime.shutdown();
}

#[tokio::test]
async fn a_step_whose_attempt_died_mid_stream_is_made_again_within_max_steps_and_keeps_its_start_metadata() {
    let model = GatedModel::new(vec![
        vec![Step::Text("Half"), Step::Gate, Step::Complete("Half an answer")],
        vec![Step::Complete("A whole answer.")],
    ]);
    let served = serve(&model, Some(Duration::from_millis(20))).await;
    // The first attempt's step streams (its start is appended), then its completion fails.
    served.store.fail_once(|records| {
        records
            .iter()
            .any(|record| matches!(record.body, RecordBody::AssistantMessageCompleted { .. }))
    });
    let handle = served.runtime.init(&counted_start, "s1");
    let send = tokio::spawn(async move { handle.send("answer me").await });
    served.first_delta("counted_start", "s1").await;
    model.open_gate();
    let reply = send.await.unwrap().unwrap();
    assert_eq!(
        reply.text, "A whole answer.",
        "max_steps = 1 counts completed steps only"
    );
    assert_eq!(model.requests.lock().unwrap().len(), 2);
    assert_eq!(
        serde_json::Value::Object(reply.metadata),
        json!({"start": 0}),
        "the response-start metadata the dead attempt's step start recorded, once"
    );
    assert_eq!(
        STARTS.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "use_response_start runs once per response"
    );
    assert_eq!(
        assistant_parts(&served.get("counted_start", "s1").await),
        json!([{"type": "text", "text": "A whole answer.", "state": "done"}]),
        "the dead attempt's text is gone"
    );
    served.runtime.shutdown();
}

#[tokio::test]
async fn the_reply_keeps_the_response_start_metadata_of_a_first_step_that_streamed() {
    let model = GatedModel::new(vec![vec![
        Step::Text("Streaming"),
        Step::Gate,
        Step::Complete("Streaming, done."),
    ]]);
    let served = serve(&model, Some(Duration::from_millis(20))).await;
    let handle = served.runtime.init(&one_step, "m1");
    let send = tokio::spawn(async move { handle.send("hi").await });
    served.first_delta("one_step", "m1").await;
    model.open_gate();
    let reply = send.await.unwrap().unwrap();
    assert_eq!(reply.text, "Streaming, done.");
    assert_eq!(serde_json::Value::Object(reply.metadata), json!({"channel": "web"}));
    served.runtime.shutdown();
}

#[tokio::test]
async fn the_protocols_turn_ids_are_the_observed_model_turns() {
    let model = GatedModel::new(vec![
        vec![Step::CallTool("weather", r#"{"city":"Oslo"}"#)],
        vec![Step::Complete("Cold.")],
    ]);
    let served = serve(&model, Some(Duration::from_millis(20))).await;
    let mut events = served.runtime.observe();
    served.admit("forecaster", "t2", "weather in Oslo?").await;
    let chunks = served.updates_until("forecaster", "t2", settled).await;
    let mut observed = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let flue_runtime::events::Event::TurnStart { turn_id, .. } = observation.event {
            observed.push(turn_id);
        }
    }
    let started: Vec<&str> = chunks
        .iter()
        .filter(|chunk| chunk["type"] == "message-started")
        .map(|chunk| chunk["turnId"].as_str().unwrap())
        .collect();
    assert_eq!(started.len(), 2);
    assert!(started.iter().all(|turn| turn.starts_with("turn_")), "{started:?}");
    assert_eq!(started, observed, "one turn per model call, named alike on both sides");
    let snapshot = served.get("forecaster", "t2").await;
    let assistant = snapshot["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|message| message["role"] == "assistant")
        .unwrap();
    assert_eq!(
        assistant["turnId"], started[0],
        "the response message names its first turn"
    );
    served.runtime.shutdown();
}
