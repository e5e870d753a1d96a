//! The streaming protocol over real HTTP on loopback (reference §4): admission, the history
//! snapshot, updates as JSON, long-poll and SSE, HEAD, abort, attachments, and a clear 4xx
//! for every kind of bad input.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use flue_runtime::http::HttpOptions;
use flue_runtime::prelude::*;
use flue_runtime::provider::ProviderRegistry;
use flue_runtime::store::MemoryStore;
use flue_runtime::testing::{ScriptedModel, ScriptedReply};
use flue_runtime::{Runtime, RuntimeOptions};
use futures_util::StreamExt;
use reqwest::header::HeaderMap;
use serde_json::{Value, json};

mod harness;

/// Add two numbers.
#[tool]
async fn add(
    ctx: &ToolContext,
    /// First addend
    a: i64,
    /// Second addend
    b: i64,
) -> String {
    // Connected clients of the thread-event stream see the sum as it is computed.
    if let Some(thread) = ctx.thread() {
        thread.emit("computed", json!({"sum": a + b}));
    }
    (a + b).to_string()
}

#[agent(max_steps = 4)]
fn calculator() -> &'static str {
    use_model("scripted/calc-1");
    use_tool(add);
    "You add numbers with the add tool."
}

#[hook(after_system_message, id = "mail_context")]
fn mail_context(_state: &ThreadState, message: String) -> String {
    message
}

#[hook(filter_messages)]
fn keep_recent(_state: &ThreadState, messages: Vec<Message>) -> Vec<Message> {
    messages
}

/// Released by [`RELEASE_LOOKUP`].
static RELEASE_LOOKUP: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Takes until the test releases it.
#[tool]
async fn slow_lookup() -> String {
    RELEASE_LOOKUP.notified().await;
    "found".to_owned()
}

#[agent]
fn slow_worker() -> &'static str {
    use_model("scripted/slow-1");
    use_tool(slow_lookup);
    "You look things up."
}

/// Never ends: only an abort stops it.
#[tool]
async fn stuck_lookup() -> String {
    std::future::pending().await
}

#[agent]
fn stuck_worker() -> &'static str {
    use_model("scripted/stuck-1");
    use_tool(stuck_lookup);
    "You look things up."
}

#[agent]
fn planner() -> &'static str {
    use_model("scripted/plan-1");
    let dispatch = use_dispatch_message();
    use_tool(harness::dispatching(
        Tool::new("schedule_follow_up").description("Queue a follow-up message."),
        dispatch,
        Signal::new("follow_up", "check the invoice").tag_name("follow-up"),
    ));
    use_agent_start(|ctx| async move {
        if ctx.delivery().body() == "check the invoice" {
            ctx.append(Signal::new("note", "The follow-up joined."))?;
        }
        Ok::<_, flue_runtime::event_hooks::AppendError>(())
    });
    "You plan work."
}

/// Reads the mailbox.
#[agent(expose_as_tool, hooks = [keep_recent], parent_hooks = [(mail_context, before_parent, "Shows new mail to the coordinator.")])]
fn mail_agent() -> &'static str {
    use_model("scripted/mail-1");
    "Read mail."
}

/// Edits the thread's rows: a note injected, the first user row's text corrected.
#[tool]
async fn curate(ctx: &ToolContext) -> Result<String, ToolError> {
    let thread = ctx.thread().unwrap();
    let rows = thread
        .get_messages(flue_runtime::lifecycle::MessagesQuery::default())
        .await
        .map_err(|error| ToolError::new(error.to_string()))?;
    let mut updates = MessageUpdates::new();
    updates.insert("content".into(), json!("corrected question"));
    thread
        .update_message(&rows.messages[0].id, updates)
        .await
        .map_err(|error| ToolError::new(error.to_string()))?;
    let note = flue_runtime::lifecycle::InjectMessage::new(flue_runtime::lifecycle::MessageRole::Assistant, "a note");
    let note = thread
        .inject_message(note)
        .await
        .map_err(|error| ToolError::new(error.to_string()))?;
    Ok(note.id)
}

/// Deletes a row.
#[tool]
async fn forget(
    ctx: &ToolContext,
    /// The row id
    id: String,
) -> Result<String, ToolError> {
    let deleted = ctx
        .thread()
        .unwrap()
        .delete_message(&id)
        .await
        .map_err(|error| ToolError::new(error.to_string()))?;
    Ok(deleted.to_string())
}

#[agent]
fn curator() -> &'static str {
    use_model("scripted/curate-1");
    use_tool(curate);
    use_tool(forget);
    "You keep the history tidy."
}

static CLIENTS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Waits until `client_attached` logged a line starting with `line` (`"<user> + <client> "`).
async fn attach_hook_ran(line: &str) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while !CLIENTS.lock().unwrap().iter().any(|logged| logged.starts_with(line)) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the attach hook ran: {line}"));
}

#[hook(user_client_attached)]
async fn client_attached(user: &UserState, client: &ClientInfo) {
    CLIENTS
        .lock()
        .unwrap()
        .push(format!("{} + {} {:?}", user.user_id(), client.id, client.kind));
    user.emit("welcome", json!({"client": client.id}));
}

#[hook(user_client_detached)]
async fn client_detached(user: &UserState, client: &ClientInfo) {
    CLIENTS
        .lock()
        .unwrap()
        .push(format!("{} - {}", user.user_id(), client.id));
}

struct Server {
    runtime: Runtime,
    store: MemoryStore,
    root: String,
    base: String,
    client: reqwest::Client,
    model: ScriptedModel,
}

impl Server {
    async fn start() -> Self {
        Self::start_with(HttpOptions::default()).await
    }

    async fn start_with(options: HttpOptions) -> Self {
        let model = ScriptedModel::new([]);
        let mut providers = ProviderRegistry::new();
        providers.register(model.clone());
        let store = MemoryStore::new();
        let runtime = Runtime::builder()
            .store(store.clone())
            .providers(providers)
            .agent(calculator)
            .agent(mail_agent)
            .agent(planner)
            .agent(curator)
            .agent(slow_worker)
            .agent(stuck_worker)
            .user_hook(client_attached)
            .user_hook(client_detached)
            .options(RuntimeOptions {
                model_retry_delay: Duration::from_millis(1),
                ..RuntimeOptions::default()
            })
            .build()
            .unwrap();
        let app = flue_runtime::http::router_with(&runtime, options.clone());
        let runtime = runtime.clone();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            flue_runtime::http::serve(listener, app, &options, std::future::pending())
                .await
                .unwrap()
        });
        Self {
            runtime,
            store,
            root: format!("http://{addr}"),
            base: format!("http://{addr}/agents/calculator"),
            client: reqwest::Client::new(),
            model,
        }
    }

    fn url(&self, tail: &str) -> String {
        format!("{}{tail}", self.base)
    }

    /// Scripts one exchange: a tool call, then the answer.
    fn script_exchange(&self, answer: &str) {
        self.model
            .push(ScriptedReply::tool_call("add", json!({"a": 2, "b": 3})));
        self.model.push(ScriptedReply::text(answer));
    }

    /// Admits a user message `body` to `id`; the receipt.
    async fn admit(&self, id: &str, body: &str) -> Value {
        let response = self.post(id, json!({"kind": "user", "body": body})).await;
        assert_eq!(response.status().as_u16(), 202);
        response.json().await.unwrap()
    }

    async fn post(&self, id: &str, body: Value) -> reqwest::Response {
        self.client
            .post(self.url(&format!("/{id}")))
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    async fn get(&self, tail: &str) -> reqwest::Response {
        self.client.get(self.url(tail)).send().await.unwrap()
    }

    async fn get_json(&self, tail: &str) -> (u16, HeaderMap, Value) {
        let response = self.get(tail).await;
        let (status, headers) = (response.status().as_u16(), response.headers().clone());
        (status, headers, response.json().await.unwrap_or(Value::Null))
    }

    /// The history snapshot once `count` submissions have settled.
    async fn settled(&self, id: &str, count: usize) -> Value {
        for _ in 0..500 {
            let (status, _, snapshot) = self.get_json(&format!("/{id}")).await;
            if status == 200 && snapshot["settlements"].as_array().map_or(0, Vec::len) >= count {
                return snapshot;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{count} submissions of {id} did not settle");
    }
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    headers.get(name).map_or("", |value| value.to_str().unwrap())
}

fn assert_security_headers(headers: &HeaderMap) {
    assert_eq!(header(headers, "x-content-type-options"), "nosniff");
    assert_eq!(header(headers, "cross-origin-resource-policy"), "cross-origin");
}

/// Asserts `response` is the error envelope of `error_type` with `status`; returns its error.
/// What a reader of a live stream accepts.
const SSE: &str = "text/event-stream";

async fn assert_error(response: reqwest::Response, status: u16, error_type: &str) -> Value {
    let (actual, headers) = (response.status().as_u16(), response.headers().clone());
    // Checked before the body is read: a request that should have been refused and was
    // served a live stream would otherwise wait on a body that never ends.
    assert!(
        actual == status || actual >= 400,
        "expected {status} {error_type}, got {actual} (not read further: it may stream for ever)"
    );
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        (actual, body["error"]["type"].as_str()),
        (status, Some(error_type)),
        "{body}"
    );
    assert_eq!(header(&headers, "content-type"), "application/json");
    assert_security_headers(&headers);
    let error = body["error"].clone();
    assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    assert!(error["details"].is_string(), "{body}");
    error
}

fn types(chunks: &[Value]) -> Vec<&str> {
    chunks.iter().map(|chunk| chunk["type"].as_str().unwrap()).collect()
}

#[tokio::test]
async fn admission_answers_202_with_the_receipt_location_and_next_offset() {
    let server = Server::start().await;
    server.script_exchange("2 + 3 = 5");
    let response = server.post("c1", json!({"kind": "user", "body": "2+3?"})).await;
    assert_eq!(response.status().as_u16(), 202);
    let headers = response.headers().clone();
    let receipt: Value = response.json().await.unwrap();
    assert_eq!(receipt["streamUrl"], json!(server.url("/c1")));
    assert_eq!(header(&headers, "location"), server.url("/c1"));
    assert_eq!(
        receipt["offset"], "0000000000000000_0000000000000000",
        "the head after the birth record"
    );
    assert_eq!(
        header(&headers, "stream-next-offset"),
        receipt["offset"].as_str().unwrap()
    );
    assert!(receipt["submissionId"].as_str().unwrap().starts_with("sub_"));
    assert!(receipt["uid"].as_str().is_some_and(|uid| !uid.is_empty()));
    assert!(receipt.get("deduplicated").is_none());
    assert_security_headers(&headers);

    // The same idempotency key again: the same submission, deduplicated, offset -1.
    server.script_exchange("again");
    let keyed = json!({"kind": "user", "body": "once", "idempotencyKey": "k-1"});
    let first: Value = server.post("c1", keyed.clone()).await.json().await.unwrap();
    let replay: Value = server.post("c1", keyed).await.json().await.unwrap();
    assert_eq!(replay["submissionId"], first["submissionId"]);
    assert_eq!(
        (replay["deduplicated"].clone(), replay["offset"].clone()),
        (json!(true), json!("-1"))
    );
}

/// Reference §3.6: "Direct HTTP admission is the same path with `kind:'direct'`" — and
/// `submission_queued {submissionId, kind}` (§7.2) says so.
#[tokio::test]
async fn an_http_admission_is_a_direct_submission() {
    use flue_runtime::events::Event;
    use flue_runtime::store::{Store, SubmissionKind};
    let server = Server::start().await;
    let mut events = server.runtime.observe();
    server.model.push(ScriptedReply::text("hi"));
    let receipt: Value = server
        .post("c1", json!({"kind": "user", "body": "hi"}))
        .await
        .json()
        .await
        .unwrap();
    let row = server
        .store
        .submission(receipt["submissionId"].as_str().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.kind, SubmissionKind::Direct);
    let kind = loop {
        let observation = tokio::time::timeout(Duration::from_secs(5), events.recv())
            .await
            .unwrap()
            .unwrap();
        if let Event::SubmissionQueued { kind } = observation.event {
            break kind;
        }
    };
    assert_eq!(kind, SubmissionKind::Direct);
}

#[tokio::test]
async fn the_history_snapshot_folds_each_response_into_one_assistant_message() {
    let server = Server::start().await;
    server.script_exchange("2 + 3 = 5");
    let receipt = server.admit("c1", "2+3?").await;
    let snapshot = server.settled("c1", 1).await;
    let (status, headers, _) = server.get_json("/c1").await;
    assert_eq!(status, 200);
    assert_eq!(header(&headers, "cache-control"), "no-store");
    assert_eq!(header(&headers, "stream-up-to-date"), "true");
    assert_eq!(
        header(&headers, "stream-next-offset"),
        snapshot["offset"].as_str().unwrap()
    );
    assert_security_headers(&headers);

    assert_eq!(snapshot["v"], 1);
    assert_eq!(snapshot["conversationId"], "agents/calculator/c1");
    assert_eq!(snapshot["incarnation"], receipt["uid"]);
    let messages = snapshot["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 2, "{snapshot}");
    let (user, assistant) = (&messages[0], &messages[1]);
    assert_eq!(
        (user["role"].as_str(), user["purpose"].as_str()),
        (Some("user"), Some("user"))
    );
    assert_eq!(
        user["parts"],
        json!([{"type": "text", "text": "2+3?", "state": "done"}])
    );
    assert_eq!(user["submissionId"], receipt["submissionId"]);
    assert_eq!(assistant["role"], "assistant");
    let parts = assistant["parts"].as_array().unwrap();
    assert_eq!(parts.len(), 2, "both steps in one message: {assistant}");
    assert_eq!(parts[0]["type"], "dynamic-tool");
    assert_eq!(parts[0]["toolName"], "add");
    assert_eq!(parts[0]["input"], json!({"a": 2, "b": 3}));
    assert_eq!(
        (parts[0]["state"].as_str(), parts[0]["output"].as_str()),
        (Some("output-available"), Some("5"))
    );
    assert_eq!(parts[1], json!({"type": "text", "text": "2 + 3 = 5", "state": "done"}));
    assert_eq!(
        snapshot["settlements"],
        json!([{"submissionId": receipt["submissionId"], "outcome": "completed"}])
    );
}

#[tokio::test]
async fn updates_start_with_a_checkpoint_and_project_chunks_in_stream_order() {
    let server = Server::start().await;
    server.script_exchange("2 + 3 = 5");
    let receipt = server.admit("c1", "2+3?").await;
    let snapshot = server.settled("c1", 1).await;

    let (status, headers, body) = server.get_json("/c1?view=updates&offset=-1").await;
    assert_eq!(status, 200);
    assert_eq!(header(&headers, "cache-control"), "no-store");
    assert_eq!(header(&headers, "stream-up-to-date"), "true");
    assert_eq!(
        header(&headers, "stream-next-offset"),
        snapshot["offset"].as_str().unwrap()
    );
    let chunks = body.as_array().unwrap();
    assert_eq!(
        chunks[0],
        json!({"type": "stream-checkpoint", "incarnation": receipt["uid"]})
    );
    let chunks = &chunks[1..];
    assert_eq!(
        types(chunks),
        [
            "conversation-reset",
            "message-appended",
            "message-started",
            "tool-input",
            "message-completed",
            "tool-output",
            "message-started",
            "message-delta",
            "message-completed",
            "submission-settled",
        ]
    );
    assert_eq!(
        chunks[0]["snapshot"]["messages"],
        json!([]),
        "the birth batch resets to an empty conversation"
    );
    // One assistant message per response: both steps carry the first step's id.
    let ids: Vec<&Value> = chunks
        .iter()
        .filter(|chunk| chunk["type"].as_str().unwrap().starts_with("message-") && chunk["type"] != "message-appended")
        .map(|chunk| &chunk["messageId"])
        .collect();
    assert!(ids.windows(2).all(|pair| pair[0] == pair[1]), "{ids:?}");
    assert_eq!(chunks[5]["output"], "5");
    assert_eq!(chunks[7]["delta"], "2 + 3 = 5");
    assert_eq!(chunks[9]["outcome"], "completed");
    // Positions: batch offsets ascend; indexes count within a batch.
    let positions: Vec<(u64, u64)> = chunks
        .iter()
        .map(|chunk| {
            assert_eq!(chunk["conversationId"], "agents/calculator/c1");
            (
                chunk["position"]["batch"].as_u64().unwrap(),
                chunk["position"]["index"].as_u64().unwrap(),
            )
        })
        .collect();
    assert!(positions.windows(2).all(|pair| pair[0] < pair[1]), "{positions:?}");
    // Each chunk's fields, as reference §4.6 lists them (`?`: optional); every chunk also has
    // its type, conversation and position. A delta has no timestamp.
    for chunk in chunks {
        let fields: &[&str] = match chunk["type"].as_str().unwrap() {
            "conversation-reset" => &["snapshot"],
            "message-appended" => &["message"],
            "message-started" => &["messageId", "submissionId?", "turnId?", "metadata?", "timestamp"],
            "tool-input" => &["messageId", "toolCallId", "toolName", "input", "timestamp"],
            "tool-output" => &["toolCallId", "output", "durationMs?", "timestamp"],
            "message-delta" => &["messageId", "kind", "delta"],
            "message-completed" => &["messageId", "timestamp"],
            "submission-settled" => &[
                "submissionId",
                "outcome",
                "error?",
                "answeredBySubmissionId?",
                "timestamp",
            ],
            other => panic!("an unexpected chunk {other}"),
        };
        let keys: Vec<&str> = chunk.as_object().unwrap().keys().map(String::as_str).collect();
        for key in &keys {
            let known = ["type", "conversationId", "position"].contains(key)
                || fields.iter().any(|field| field.trim_end_matches('?') == *key);
            assert!(known, "{key} is no field of {chunk}");
        }
        for field in fields.iter().filter(|field| !field.ends_with('?')) {
            assert!(keys.contains(field), "{field} missing from {chunk}");
        }
    }

    // From the head: the checkpoint alone, the same offset.
    let head = snapshot["offset"].as_str().unwrap();
    let (_, headers, body) = server.get_json(&format!("/c1?view=updates&offset={head}")).await;
    assert_eq!(body.as_array().unwrap().len(), 1);
    assert_eq!(header(&headers, "stream-next-offset"), head);
}

#[tokio::test]
async fn a_long_poll_waits_for_the_next_batch_and_times_out_with_the_checkpoint_alone() {
    let server = Server::start_with(HttpOptions {
        long_poll_timeout: Duration::from_millis(300),
        ..HttpOptions::default()
    })
    .await;
    server.script_exchange("first");
    server.post("c1", json!({"kind": "user", "body": "one"})).await;
    let head = server.settled("c1", 1).await["offset"].as_str().unwrap().to_owned();

    // Nothing new: after the timeout, the checkpoint alone, the same offset, up to date.
    let (status, headers, body) = server
        .get_json(&format!("/c1?view=updates&offset={head}&live=long-poll"))
        .await;
    assert_eq!((status, body.as_array().unwrap().len()), (200, 1));
    assert_eq!(header(&headers, "stream-next-offset"), head);
    assert_eq!(header(&headers, "stream-up-to-date"), "true");

    // A message admitted while the poll waits ends the wait with its chunks (on a server whose
    // polls outlast the admission however slow the machine).
    let server = Server::start_with(HttpOptions {
        long_poll_timeout: Duration::from_secs(20),
        ..HttpOptions::default()
    })
    .await;
    server.script_exchange("first");
    server.post("c1", json!({"kind": "user", "body": "one"})).await;
    let head = server.settled("c1", 1).await["offset"].as_str().unwrap().to_owned();
    let server = std::sync::Arc::new(server);
    let poll = {
        let server = server.clone();
        let head = head.clone();
        tokio::spawn(async move {
            server
                .get_json(&format!("/c1?view=updates&offset={head}&live=long-poll"))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    server.script_exchange("second");
    server.post("c1", json!({"kind": "user", "body": "two"})).await;
    let (_, headers, body) = poll.await.unwrap();
    let chunks = &body.as_array().unwrap()[1..];
    assert!(!chunks.is_empty());
    assert_eq!(chunks[0]["type"], "message-appended");
    assert_eq!(chunks[0]["message"]["parts"][0]["text"], "two");
    assert_ne!(header(&headers, "stream-next-offset"), head);
}

/// Serves `server`'s runtime through a second router that caches no reads; its agent's base
/// URL.
async fn uncached_router(server: &Server) -> String {
    let uncached = flue_runtime::http::router_with(
        &server.runtime,
        HttpOptions {
            updates_cache_instances: 0,
            ..HttpOptions::default()
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}/agents/calculator", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, uncached).await.unwrap() });
    base
}

/// The updates a router caches per instance answer, at every offset and as the conversation
/// grows, byte for byte what a router caching nothing (folding the whole stream) answers.
#[tokio::test]
async fn updates_reads_answer_byte_for_byte_as_an_uncached_router_at_every_offset() {
    let server = Server::start().await;
    let uncached_base = uncached_router(&server).await;
    let read = |base: String| {
        let client = server.client.clone();
        async move {
            let response = client.get(base).send().await.unwrap();
            let status = response.status().as_u16();
            let headers: Vec<(String, String)> = [
                "content-type",
                "cache-control",
                "stream-next-offset",
                "stream-up-to-date",
            ]
            .iter()
            .map(|name| (name.to_string(), header(response.headers(), name).to_owned()))
            .collect();
            (status, headers, response.bytes().await.unwrap())
        }
    };
    for (exchange, answer) in ["first", "second", "third"].into_iter().enumerate() {
        server.script_exchange(answer);
        server.admit("c1", answer).await;
        let snapshot = server.settled("c1", exchange + 1).await;
        let head: u64 = snapshot["offset"]
            .as_str()
            .unwrap()
            .split('_')
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        // Every offset to the head, `0_2` (no fixed width) and two past the head (416).
        let mut offsets: Vec<(String, u16)> = std::iter::once(("-1".to_owned(), 200))
            .chain((0..=head).map(|offset| (format!("0000000000000000_{offset:016}"), 200)))
            .chain([
                ("0_2".to_owned(), 200),
                (format!("0000000000000000_{:016}", head + 1), 416),
                ("0_99999999999999999999".to_owned(), 416),
            ])
            .collect();
        // Both directions: the cache moves forward with the stream and serves reads behind it.
        if exchange == 1 {
            offsets.reverse();
        }
        for (offset, status) in offsets {
            let tail = format!("/c1?view=updates&offset={offset}");
            let cached = read(server.url(&tail)).await;
            assert_eq!(cached, read(format!("{uncached_base}{tail}")).await, "{tail}");
            assert_eq!(cached.0, status, "{tail}");
        }
    }
}

/// `view=history` and an SSE reader's catch-up, which a caching router answers from its
/// per-instance fold and window, answer at every offset and as the conversation grows what a
/// router caching nothing (folding the whole stream) answers.
#[tokio::test]
async fn history_and_sse_catch_up_answer_as_an_uncached_router_at_every_offset() {
    let server = Server::start().await;
    let uncached_base = uncached_router(&server).await;
    let client = server.client.clone();
    let history = |url: String| {
        let client = client.clone();
        async move {
            let response = client.get(url).send().await.unwrap();
            let next = header(response.headers(), "stream-next-offset").to_owned();
            (response.status().as_u16(), next, response.bytes().await.unwrap())
        }
    };
    // An SSE reader's chunks up to its first up-to-date control, and that control's offset
    // (frames may group chunks differently; what they carry, in order, is the same).
    let caught_up = |url: String| {
        let client = client.clone();
        async move {
            let response = client.get(url).send().await.unwrap();
            assert_eq!(response.status(), 200);
            let frames = sse_frames(response, |frames| {
                frames
                    .iter()
                    .any(|(event, data)| event == "control" && data.contains("upToDate"))
            })
            .await;
            let mut chunks = Vec::new();
            let mut offset = String::new();
            for (event, data) in frames {
                let value: Value = serde_json::from_str(&data).unwrap();
                match event.as_str() {
                    "data" => chunks.extend(value.as_array().unwrap().iter().cloned()),
                    "control" if value.get("upToDate").is_some() => {
                        offset = value["streamNextOffset"].as_str().unwrap().to_owned();
                    }
                    _ => {}
                }
            }
            (chunks, offset)
        }
    };
    for (exchange, answer) in ["first", "second", "third"].into_iter().enumerate() {
        server.script_exchange(answer);
        server.admit("c1", answer).await;
        server.settled("c1", exchange + 1).await;
        let cached = history(server.url("/c1")).await;
        assert_eq!(cached, history(format!("{uncached_base}/c1")).await);
        assert_eq!(cached.0, 200);
        let head: u64 = cached.1.split('_').nth(1).unwrap().parse().unwrap();
        // A poll from the start fills the window the SSE readers then catch up from.
        if exchange == 1 {
            server
                .client
                .get(server.url("/c1?view=updates&offset=-1"))
                .send()
                .await
                .unwrap();
        }
        let mut offsets: Vec<String> = std::iter::once("-1".to_owned())
            .chain((0..=head).map(|offset| format!("0000000000000000_{offset:016}")))
            .collect();
        if exchange == 2 {
            offsets.reverse();
        }
        for offset in offsets {
            let tail = format!("/c1?view=updates&offset={offset}&live=sse");
            let reader = caught_up(server.url(&tail)).await;
            assert_eq!(reader, caught_up(format!("{uncached_base}{tail}")).await, "{tail}");
            assert_eq!(reader.1, cached.1, "{tail}: caught up to the head");
        }
        // Past the head: 416 from both.
        let past = format!("/c1?view=updates&offset=0000000000000000_{:016}&live=sse", head + 1);
        let status = client.get(server.url(&past)).send().await.unwrap().status();
        assert_eq!(status, 416);
        assert_eq!(
            client
                .get(format!("{uncached_base}{past}"))
                .send()
                .await
                .unwrap()
                .status(),
            416
        );
    }
    // An instance without a stream: 404 from both.
    assert_eq!(history(server.url("/nobody")).await.0, 404);
    assert_eq!(history(format!("{uncached_base}/nobody")).await.0, 404);
}

/// Reference §4.4: long-poll waits only "if the first read is empty" (of batches); a read
/// that finds batches answers at once, even when they project to no chunk
/// (`[checkpoint]`, `Stream-Next-Offset` advanced). The runtime writes such batches itself
/// (e.g. the `AgentStartRun` seam marker of an agent with `use_agent_start`, state writes).
#[tokio::test]
async fn a_long_poll_answers_at_once_when_the_new_batches_project_to_no_chunk() {
    use flue_runtime::record::{Record, RecordBody};
    use flue_runtime::store::{InstanceKey, Store};
    let server = Server::start_with(HttpOptions {
        // A wait for the timeout would outlast the test's guard below by far.
        long_poll_timeout: Duration::from_secs(3600),
        ..HttpOptions::default()
    })
    .await;
    server.model.push(ScriptedReply::text("hi"));
    server.post("c1", json!({"kind": "user", "body": "hi"})).await;
    let head = server.settled("c1", 1).await["offset"].as_str().unwrap().to_owned();
    let record = Record {
        id: "record_state".into(),
        submission_id: None,
        attempt_id: None,
        timestamp: "2026-01-01T00:00:00.000Z".into(),
        body: RecordBody::StateWrite {
            name: "n".into(),
            value: json!(1),
        },
    };
    let key = InstanceKey::new("calculator", "c1");
    let offset = server.store.append(&key, vec![record].into(), None).await.unwrap();
    let (status, headers, body) = tokio::time::timeout(
        Duration::from_secs(60),
        server.get_json(&format!("/c1?view=updates&offset={head}&live=long-poll")),
    )
    .await
    .expect("answered without waiting for the long-poll timeout");
    assert_eq!((status, body.as_array().unwrap().len()), (200, 1));
    assert_eq!(
        header(&headers, "stream-next-offset"),
        format!("0000000000000000_{offset:016}")
    );
}

/// An SSE reader catching up over batches that each reset the conversation (so each carries
/// the whole, big, snapshot) gets them a few at a time, each round closed by a control frame,
/// instead of one round of every batch.
#[tokio::test]
async fn an_sse_catch_up_over_big_resets_sends_a_bounded_round_between_control_frames() {
    use flue_runtime::record::{Record, RecordBody};
    use flue_runtime::store::{InstanceKey, Store};
    let server = Server::start().await;
    server.model.push(ScriptedReply::text("hi"));
    server.post("c1", json!({"kind": "user", "body": "hi"})).await;
    server.settled("c1", 1).await;
    let key = InstanceKey::new("calculator", "c1");
    let at = |body| Record {
        id: "record_edit".into(),
        submission_id: None,
        attempt_id: None,
        timestamp: "2026-01-01T00:00:00.000Z".into(),
        body,
    };
    let big = "x".repeat(1024 * 1024);
    server
        .store
        .append(
            &key,
            vec![at(RecordBody::UserMessage {
                message_id: "user_big".into(),
                body: big.clone(),
                attachments: Vec::new(),
            })]
            .into(),
            None,
        )
        .await
        .unwrap();
    let mut head = 0;
    for edit in 0..12 {
        let mut updates = serde_json::Map::new();
        updates.insert("content".into(), json!(format!("{big}{edit}")));
        head = server
            .store
            .append(
                &key,
                vec![at(RecordBody::MessageUpdated {
                    message_id: "user_big".into(),
                    updates,
                })]
                .into(),
                None,
            )
            .await
            .unwrap();
    }
    let response = server.get("/c1?view=updates&offset=-1&live=sse").await;
    assert_eq!(response.status(), 200);
    let frames = tokio::time::timeout(
        Duration::from_secs(120),
        sse_frames(response, |frames| {
            frames
                .iter()
                .any(|(event, data)| event == "control" && data.contains("upToDate"))
        }),
    )
    .await
    .expect("caught up");
    // Every round: its data frames, then a control frame.
    let mut rounds = vec![Vec::new()];
    for (event, data) in &frames {
        match event.as_str() {
            "data" => rounds.last_mut().unwrap().push(data.len()),
            "control" => rounds.push(Vec::new()),
            _ => {}
        }
    }
    let rounds: Vec<Vec<usize>> = rounds.into_iter().filter(|round| !round.is_empty()).collect();
    assert!(rounds.len() >= 3, "13 MiB of resets in {} round(s)", rounds.len());
    for round in &rounds {
        let (bytes, last) = (round.iter().sum::<usize>(), round.last().copied().unwrap_or(0));
        assert!(
            bytes - last < 4 * 1024 * 1024 + 4096,
            "a round takes no batch after 4 MiB: {round:?}"
        );
    }
    let last_control = frames.iter().rev().find(|(event, _)| event == "control").unwrap();
    assert!(
        last_control.1.contains(&format!("0000000000000000_{head:016}")),
        "{}",
        last_control.1
    );
}

/// One conversation of `calculator` of one exchange and then `messages` user messages,
/// each a batch of its own, served over HTTP on a store that tallies its reads.
struct LongConversation {
    addr: std::net::SocketAddr,
    /// The last batch's offset.
    head: u64,
    /// The most batches one read returned (reset once the conversation is written).
    largest: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// The batches all reads returned (likewise).
    total: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    _runtime: Runtime,
}

impl LongConversation {
    async fn serve(options: HttpOptions, messages: usize) -> Self {
        Self::serve_padded(options, messages, 0).await
    }

    /// 400 messages of 64 KiB (25 MiB in all) served without an updates cache and with
    /// 64 KiB of room for readers' folds: every read folds on its own, and one fold takes the
    /// whole room.
    async fn beyond_a_tight_room() -> Self {
        let options = HttpOptions {
            updates_cache_instances: 0,
            max_reader_fold_bytes: 64 * 1024,
            ..HttpOptions::default()
        };
        Self::serve_padded(options, 400, 64 * 1024).await
    }

    /// [`Self::serve`] with `padding` more bytes in each message.
    async fn serve_padded(options: HttpOptions, messages: usize, padding: usize) -> Self {
        use flue_runtime::record::{Record, RecordBody};
        use flue_runtime::store::{InstanceKey, Store};
        let model = ScriptedModel::new([ScriptedReply::text("hi")]);
        let mut providers = ProviderRegistry::new();
        providers.register(model.clone());
        let store = MemoryStore::new();
        let (largest, total) = (
            std::sync::Arc::<std::sync::atomic::AtomicUsize>::default(),
            std::sync::Arc::<std::sync::atomic::AtomicUsize>::default(),
        );
        let runtime = Runtime::builder()
            .store(LargestRead {
                inner: store.clone(),
                largest: std::sync::Arc::clone(&largest),
                total: std::sync::Arc::clone(&total),
            })
            .providers(providers)
            .agent(calculator)
            .build()
            .unwrap();
        let app = flue_runtime::http::router_with(&runtime, options);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        runtime.init(&calculator, "long").send("hi").await.unwrap();
        let key = InstanceKey::new("calculator", "long");
        for n in 0..messages {
            let record = Record {
                id: format!("record_{n}"),
                submission_id: None,
                attempt_id: None,
                timestamp: "2026-01-01T00:00:00.000Z".into(),
                body: RecordBody::UserMessage {
                    message_id: format!("user_{n}"),
                    body: format!("m{n}{}", " ".repeat(padding)),
                    attachments: Vec::new(),
                },
            };
            store.append(&key, vec![record].into(), None).await.unwrap();
        }
        let head = store.last_offset(&key).await.unwrap().unwrap();
        largest.store(0, std::sync::atomic::Ordering::SeqCst);
        total.store(0, std::sync::atomic::Ordering::SeqCst);
        Self {
            addr,
            head,
            largest,
            total,
            _runtime: runtime,
        }
    }
}

/// A memory store that remembers the most batches one read returned, and how many its reads
/// returned in all.
struct LargestRead {
    inner: MemoryStore,
    largest: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    total: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl LargestRead {
    fn note(
        &self,
        read: Result<Vec<flue_runtime::record::Batch>, flue_runtime::store::StoreError>,
    ) -> Result<Vec<flue_runtime::record::Batch>, flue_runtime::store::StoreError> {
        if let Ok(batches) = &read {
            self.largest
                .fetch_max(batches.len(), std::sync::atomic::Ordering::SeqCst);
            self.total.fetch_add(batches.len(), std::sync::atomic::Ordering::SeqCst);
        }
        read
    }
}

impl flue_runtime::store::Store for LargestRead {
    harness::delegate_store!(
        inner;
        admit, instance, submission, has_queued, claim_next, renew_leases, expired, reclaim,
        aborts_requested, instances_with_queued, claim_joinable, finalize_join, revert_joins, settle,
        requeue, request_abort, append, create_child, last_offset, put_attachment, attachment, user_value,
        set_user_value, list_user_values,
    );

    fn read(
        &self,
        key: &flue_runtime::store::InstanceKey,
        after: Option<u64>,
    ) -> flue_runtime::BoxFuture<'_, Result<Vec<flue_runtime::record::Batch>, flue_runtime::store::StoreError>> {
        let read = self.inner.read(key, after);
        Box::pin(async move { self.note(read.await) })
    }

    fn read_page(
        &self,
        key: &flue_runtime::store::InstanceKey,
        after: Option<u64>,
        limit: usize,
    ) -> flue_runtime::BoxFuture<'_, Result<Vec<flue_runtime::record::Batch>, flue_runtime::store::StoreError>> {
        let read = self.inner.read_page(key, after, limit);
        Box::pin(async move {
            // As a store on a database would, so readers' reads interleave.
            tokio::task::yield_now().await;
            self.note(read.await)
        })
    }
}

/// Every read of a long stream reads it a page at a time and holds one page, never the whole
/// stream, with the updates cache and without: an SSE reader catching up (from the start and
/// from an offset far back) and the instance's live feed when it first folds the stream, a
/// JSON read of updates, the history. Idle connections on a long conversation would otherwise
/// hold a copy of it each.
#[tokio::test]
async fn reads_of_a_long_stream_read_it_a_page_at_a_time() {
    for cached in [0, HttpOptions::default().updates_cache_instances] {
        reads_of_a_long_stream(cached).await;
    }
}

async fn reads_of_a_long_stream(cached: usize) {
    let long = LongConversation::serve(
        HttpOptions {
            updates_cache_instances: cached,
            ..HttpOptions::default()
        },
        3000,
    )
    .await;
    let (addr, largest, head) = (long.addr, &long.largest, long.head);
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/agents/calculator/long");
    for offset in ["-1".to_owned(), format!("0000000000000000_{:016}", head - 2500)] {
        let response = client
            .get(format!("{url}?view=updates&offset={offset}&live=sse"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let head = format!("0000000000000000_{head:016}");
        let frames = sse_frames(response, |frames| {
            frames
                .iter()
                .any(|(event, data)| event == "control" && data.contains(&head))
        })
        .await;
        let messages = frames
            .iter()
            .filter(|(event, _)| event == "data")
            .map(|(_, data)| data.matches("\"m").count())
            .sum::<usize>();
        assert!(messages >= 2500, "the reader got the stream ({messages} messages)");
    }
    for query in ["view=updates&offset=-1", "view=history"] {
        let response = client.get(format!("{url}?{query}")).send().await.unwrap();
        assert_eq!(response.status(), 200, "{query}");
        let body = response.text().await.unwrap();
        assert!(body.contains("\"m0\""), "{query}: {body:.200}");
    }
    let largest = largest.load(std::sync::atomic::Ordering::SeqCst);
    assert!(largest <= 1000, "a read of {largest} batches (cache of {cached})");
}

/// A JSON read the cache does not serve reads one page of its answer (100 batches) and one
/// batch more, to tell whether it reaches the head: not a store page of 256, most of which it
/// would hold unanswered. (Regression: with large batches, that was hundreds of MiB per read,
/// counted in no room.)
#[tokio::test]
async fn a_read_the_cache_does_not_serve_reads_one_page_of_its_answer_and_one_batch_more() {
    let options = HttpOptions {
        updates_cache_instances: 0,
        ..HttpOptions::default()
    };
    let long = LongConversation::serve(options, 400).await;
    let url = format!("http://{}/agents/calculator/long?view=updates&offset=-1", long.addr);
    let response = reqwest::get(url).await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.headers().get("stream-up-to-date").is_none());
    let chunks: Vec<Value> = response.json().await.unwrap();
    assert!(chunks.len() > 1, "{chunks:?}");
    assert_eq!(long.largest.load(std::sync::atomic::Ordering::SeqCst), 101);
}

/// Readers who connect at once to a conversation no cache entry holds (after a restart, or
/// once its entry was evicted) fold it once, not once each: one read fills the entry while the
/// others wait for it and read what it made. (Before, each folded a copy of its own, which no
/// budget counted.)
#[tokio::test]
async fn readers_who_come_at_once_to_an_uncached_conversation_fold_it_once() {
    let long = LongConversation::serve(HttpOptions::default(), 2000).await;
    let head = format!("0000000000000000_{:016}", long.head);
    let client = reqwest::Client::new();
    let reads = (0..8).map(|n| {
        let query = if n % 2 == 0 {
            format!("view=updates&offset={head}")
        } else {
            "view=history".to_owned()
        };
        let url = format!("http://{}/agents/calculator/long?{query}", long.addr);
        let client = client.clone();
        async move {
            let response = client.get(url).send().await.unwrap();
            assert_eq!(response.status(), 200);
            response.bytes().await.unwrap();
        }
    });
    futures_util::future::join_all(reads).await;
    let read = long.total.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        (2000..4000).contains(&read),
        "8 readers read {read} batches of a stream of 2000"
    );
}

/// A JSON or history read that has to fold the stream takes room for its fold from the room
/// catching-up SSE readers share: with none left it is answered 503 `server_busy` (and reads
/// no batch), and it is served once the room is let go. (Before, such reads held folds that no
/// budget counted, however many came at once.)
#[tokio::test]
async fn a_read_that_folds_the_stream_shares_the_readers_room() {
    let long = LongConversation::beyond_a_tight_room().await;
    let url = |query: &str| format!("http://{}/agents/calculator/long?{query}", long.addr);
    let client = reqwest::Client::new();
    // A catching-up SSE reader that stops taking bytes holds the room.
    let mut holding = client.get(url("view=updates&offset=-1&live=sse")).send().await.unwrap();
    assert_eq!(holding.status(), 200);
    holding.chunk().await.unwrap().unwrap();
    let read_before = long.total.load(std::sync::atomic::Ordering::SeqCst);
    for query in ["view=updates&offset=0_300", "view=updates&offset=-1", "view=history"] {
        let refused = client.get(url(query)).send().await.unwrap();
        assert_eq!(refused.status(), 503, "{query}");
        assert_eq!(refused.headers()["retry-after"], "1");
        let body: Value = refused.json().await.unwrap();
        assert_eq!(body["error"]["type"], "server_busy", "{query}: {body}");
    }
    assert_eq!(
        long.total.load(std::sync::atomic::Ordering::SeqCst),
        read_before,
        "no batch read for a read refused"
    );
    drop(holding);
    for query in ["view=updates&offset=0_300", "view=history"] {
        let mut tries = 0;
        loop {
            let response = client.get(url(query)).send().await.unwrap();
            if response.status() == 200 {
                break;
            }
            assert_eq!(response.status(), 503, "{query}");
            tries += 1;
            assert!(tries < 500, "{query}: the room was never let go");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A live feed's fold takes room among the readers' folds for as long as the instance is
/// followed: the room of the reader it took over, which lets its own fold go. (Regression: the
/// feed's fold was counted nowhere, so a server following many instances held a copy of each
/// conversation beyond `max_reader_fold_bytes`.)
#[tokio::test]
async fn a_live_feed_holds_room_for_its_fold_while_the_instance_is_followed() {
    // 10 messages of 4 KiB: a fold of over 40 KiB, in a room of 64 KiB (no updates cache).
    let options = HttpOptions {
        updates_cache_instances: 0,
        max_reader_fold_bytes: 64 * 1024,
        ..HttpOptions::default()
    };
    let long = LongConversation::serve_padded(options, 10, 4 * 1024).await;
    let url = |query: &str| format!("http://{}/agents/calculator/long?{query}", long.addr);
    let client = reqwest::Client::new();
    let mut live = client
        .get(url(&format!("view=updates&offset=0_{}&live=sse", long.head)))
        .send()
        .await
        .unwrap();
    assert_eq!(live.status(), 200);
    // The checkpoint, then the control frame the feed sends once it serves the reader.
    let mut received = String::new();
    while !received.contains("event: control") {
        let chunk = live.chunk().await.unwrap().expect("the stream went on");
        received.push_str(&String::from_utf8_lossy(&chunk));
    }
    // A read that folds the conversation again finds no room beside the feed's fold.
    let refused = client.get(url("view=updates&offset=-1")).send().await.unwrap();
    assert_eq!(refused.status(), 503);
    // Once nobody follows the instance, the room is let go.
    drop(live);
    let mut tries = 0;
    loop {
        let response = client.get(url("view=updates&offset=-1")).send().await.unwrap();
        if response.status() == 200 {
            break;
        }
        assert_eq!(response.status(), 503);
        tries += 1;
        assert!(tries < 500, "the feed's room was never let go");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A lone SSE reader of a conversation larger than the readers' whole room is served to the
/// head: the instance's live feed, which it is handed over to there, folds the stream without
/// asking for room the reader still holds. (Regression: the feed's fold asked for room too,
/// found none on an idle server, and ended the reader's stream at the head.)
#[tokio::test]
async fn a_lone_sse_reader_of_a_conversation_larger_than_the_room_is_served_to_the_head() {
    let long = LongConversation::beyond_a_tight_room().await;
    let url = format!(
        "http://{}/agents/calculator/long?view=updates&offset=-1&live=sse",
        long.addr
    );
    let response = reqwest::Client::new().get(&url).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.bytes_stream();
    let mut text = String::new();
    while !text.contains("\"upToDate\":true") {
        let chunk = tokio::time::timeout(Duration::from_secs(10), body.next())
            .await
            .expect("a frame within 10 s")
            .expect("the stream stays open while it catches up")
            .unwrap();
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    assert!(text.matches("\"m").count() >= 400, "the reader got the stream");
    // Caught up on its own, it is handed over to the live feed, and stays open.
    if let Ok(next) = tokio::time::timeout(Duration::from_millis(500), body.next()).await {
        assert!(next.is_some(), "the stream ended at the head");
    }
}

/// SSE readers catching up on their own hold their folds and pages in a room the router
/// bounds: a reader that finds none is answered 503 `server_busy` with `Retry-After`, and is
/// served once the reader holding the room is gone. (Before, each idle connection behind the
/// updates cache's window held its own copy of the conversation, counted by no budget.)
#[tokio::test]
async fn sse_readers_catching_up_on_their_own_share_a_bounded_room() {
    let long = LongConversation::beyond_a_tight_room().await;
    let url = format!(
        "http://{}/agents/calculator/long?view=updates&offset=-1&live=sse",
        long.addr
    );
    let client = reqwest::Client::new();
    // Far more than the sockets buffer: a reader that stops taking bytes stays catching up.
    let mut holding = client.get(&url).send().await.unwrap();
    assert_eq!(holding.status(), 200);
    holding.chunk().await.unwrap().unwrap();
    let refused = client.get(&url).send().await.unwrap();
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["retry-after"], "1");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["type"], "server_busy", "{body}");
    drop(holding);
    // The room is the closed connection's no longer.
    for _ in 0..500 {
        let response = client.get(&url).send().await.unwrap();
        if response.status() == 200 {
            return;
        }
        assert_eq!(response.status(), 503);
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("the room was never let go");
}

/// A reader that finds the room full is refused before it folds the stream (a client retrying
/// its 503 would otherwise fold a long conversation at each retry, and many at once would
/// each hold a fold no room counts).
#[tokio::test]
async fn an_sse_reader_refused_for_want_of_room_reads_no_stream_to_fold() {
    let long = LongConversation::beyond_a_tight_room().await;
    let url = |offset: &str| {
        format!(
            "http://{}/agents/calculator/long?view=updates&offset={offset}&live=sse",
            long.addr
        )
    };
    let client = reqwest::Client::new();
    // Stalled on its first page, which it holds: it reads no more.
    let mut holding = client.get(url("-1")).send().await.unwrap();
    assert_eq!(holding.status(), 200);
    holding.chunk().await.unwrap().unwrap();
    let read_before = long.total.load(std::sync::atomic::Ordering::SeqCst);
    let refused = client.get(url("0_300")).send().await.unwrap();
    assert_eq!(refused.status(), 503);
    assert_eq!(
        long.total.load(std::sync::atomic::Ordering::SeqCst),
        read_before,
        "no batch read for a reader refused"
    );
}

/// A reader that follows a long conversation alone and reconnects at the head costs what is
/// new, not a fold of the whole stream: its new live feed starts from the updates cache's fold.
/// (Regression: each reconnection made a feed that read and folded every batch again.)
#[tokio::test]
async fn an_sse_reader_reconnecting_at_the_head_does_not_fold_the_stream_again() {
    let long = LongConversation::serve(HttpOptions::default(), 2000).await;
    let (addr, batches, head) = (long.addr, &long.total, long.head);
    let offset = format!("0000000000000000_{head:016}");
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/agents/calculator/long?view=updates&offset={offset}&live=sse");
    let mut read = Vec::new();
    for _ in 0..4 {
        let before = batches.load(std::sync::atomic::Ordering::SeqCst);
        let response = client.get(&url).send().await.unwrap();
        assert_eq!(response.status(), 200);
        sse_frames(response, |frames| {
            frames
                .iter()
                .any(|(event, data)| event == "control" && data.contains("upToDate"))
        })
        .await;
        read.push(batches.load(std::sync::atomic::Ordering::SeqCst) - before);
    }
    // The first connection folds the stream (for its own catch-up and the cache); none after.
    assert!(read[0] >= 2000, "the first connection folded the stream: {read:?}");
    assert!(
        read[1..].iter().all(|&batches| batches < 100),
        "batches read per connection: {read:?}"
    );
}

/// Live-read durations meant as "for ever" (`Duration::MAX`) are read as very long ones: an
/// SSE reader and a long poll wait for what comes, and get it. (Regression: the deadline
/// `now + Duration::MAX` overflowed, and the reader's task panicked, ending its stream.)
#[tokio::test]
async fn live_reads_with_durations_meant_as_for_ever_wait_and_deliver() {
    let server = Server::start_with(HttpOptions {
        long_poll_timeout: Duration::MAX,
        sse_wait: Duration::MAX,
        heartbeat: Duration::MAX,
        // The server's own timeouts too (hyper adds the head timeout to the current instant).
        request_head_timeout: Duration::MAX,
        response_write_timeout: Duration::MAX,
        request_body_timeout: Duration::MAX,
        request_body_deadline: Duration::MAX,
        ..HttpOptions::default()
    })
    .await;
    server.model.push(ScriptedReply::text("first"));
    server.post("c1", json!({"kind": "user", "body": "hi"})).await;
    server.settled("c1", 1).await;
    let (_, headers, _) = server.get_json("/c1?view=updates&offset=-1").await;
    let head = headers["stream-next-offset"].to_str().unwrap().to_owned();
    let sse = server.get(&format!("/c1?view=updates&offset={head}&live=sse")).await;
    assert_eq!(sse.status(), 200);
    let long_poll_url = format!("/c1?view=updates&offset={head}&live=long-poll");
    let long_poll = server.get(&long_poll_url);
    server.model.push(ScriptedReply::text("second"));
    let (long_poll, _) = tokio::join!(long_poll, async {
        // The SSE reader is up to date before the next message is posted.
        tokio::time::sleep(Duration::from_millis(50)).await;
        server.post("c1", json!({"kind": "user", "body": "again"})).await
    });
    assert_eq!(long_poll.status(), 200);
    let frames = sse_frames(sse, |frames| {
        frames
            .iter()
            .any(|(event, data)| event == "data" && data.contains("second"))
    })
    .await;
    assert!(frames.iter().any(|(event, _)| event == "control"), "{frames:?}");
}

/// One agent's router bounds the same durations as the whole router: a long poll meant to
/// wait "for ever" waits, and answers. (Regression: only `router_with` bounded them, and
/// `agent_router`'s long poll panicked adding `Duration::MAX` to the current instant.)
#[tokio::test]
async fn an_agent_router_reads_durations_meant_as_for_ever_as_very_long_ones() {
    let model = ScriptedModel::new([]);
    let runtime = harness::runtime_with(&model, vec![calculator.into()]);
    let options = HttpOptions {
        long_poll_timeout: Duration::MAX,
        heartbeat: Duration::MAX,
        ..HttpOptions::default()
    };
    let app = flue_runtime::http::agent_router(&runtime, "calculator", options).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let client = reqwest::Client::new();
    let post = |body: &'static str| {
        client
            .post(format!("{base}/c1"))
            .json(&json!({"kind": "user", "body": body}))
            .send()
    };
    model.push(ScriptedReply::text("first"));
    assert_eq!(post("hi").await.unwrap().status().as_u16(), 202);
    let head = loop {
        let response = client
            .get(format!("{base}/c1?view=updates&offset=-1"))
            .send()
            .await
            .unwrap();
        let head = response.headers()["stream-next-offset"].to_str().unwrap().to_owned();
        if response.text().await.unwrap().contains("first") {
            break head;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let long_poll = client
        .get(format!("{base}/c1?view=updates&offset={head}&live=long-poll"))
        .send();
    model.push(ScriptedReply::text("second"));
    let (long_poll, _) = tokio::join!(long_poll, async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        post("again").await.unwrap()
    });
    let long_poll = long_poll.expect("the long poll answers (its task did not panic)");
    assert_eq!(long_poll.status(), 200);
}

/// A reader whose catch-up ends exactly at a store page's end learns it is up to date with
/// that page's control frame, not a keep-alive later.
#[tokio::test]
async fn an_sse_catch_up_ending_on_a_page_boundary_is_up_to_date_at_once() {
    use flue_runtime::record::{Record, RecordBody};
    use flue_runtime::store::{InstanceKey, Store};
    let server = Server::start_with(HttpOptions {
        updates_cache_instances: 0,
        ..HttpOptions::default()
    })
    .await;
    server.model.push(ScriptedReply::text("hi"));
    server.post("c1", json!({"kind": "user", "body": "hi"})).await;
    server.settled("c1", 1).await;
    let key = InstanceKey::new("calculator", "c1");
    // 256 batches in all (the readers' store page), then 512.
    for total in [256, 512] {
        let mut head = server.store.last_offset(&key).await.unwrap().unwrap();
        while head + 1 < total {
            let record = Record {
                id: format!("record_{head}"),
                submission_id: None,
                attempt_id: None,
                timestamp: "2026-01-01T00:00:00.000Z".into(),
                body: RecordBody::UserMessage {
                    message_id: format!("user_{head}"),
                    body: "m".into(),
                    attachments: Vec::new(),
                },
            };
            head = server.store.append(&key, vec![record].into(), None).await.unwrap();
        }
        let response = server.get("/c1?view=updates&offset=-1&live=sse").await;
        assert_eq!(response.status(), 200);
        tokio::time::timeout(
            Duration::from_secs(5),
            sse_frames(response, |frames| {
                frames
                    .iter()
                    .any(|(event, data)| event == "control" && data.contains("upToDate"))
            }),
        )
        .await
        .unwrap_or_else(|_| panic!("up to date at once over {total} batches"));
    }
}

/// Reads SSE frames (event name or comment, data) until `until` holds for the frames read.
async fn sse_frames(response: reqwest::Response, until: impl Fn(&[(String, String)]) -> bool) -> Vec<(String, String)> {
    let mut body = response.bytes_stream();
    let (mut buffer, mut frames) = (String::new(), Vec::new());
    while !until(&frames) {
        let chunk = tokio::time::timeout(Duration::from_secs(10), body.next())
            .await
            .expect("a frame within 10 s")
            .expect("the stream stays open")
            .unwrap();
        buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(end) = buffer.find("\n\n") {
            let frame: String = buffer.drain(..end + 2).collect();
            let (mut event, mut data) = (String::new(), String::new());
            for line in frame.lines() {
                if let Some(name) = line.strip_prefix("event: ") {
                    event = name.to_owned();
                } else if let Some(payload) = line.strip_prefix("data:") {
                    data = payload.to_owned();
                } else if line.starts_with(':') {
                    event = line.to_owned();
                }
            }
            frames.push((event, data));
        }
    }
    frames
}

/// Reads SSE frames for `window`, whatever they are.
async fn sse_frames_for(response: reqwest::Response, window: Duration) -> Vec<(String, String)> {
    let mut body = response.bytes_stream();
    let (mut buffer, mut frames) = (String::new(), Vec::new());
    let deadline = tokio::time::Instant::now() + window;
    while let Ok(Some(chunk)) = tokio::time::timeout_at(deadline, body.next()).await {
        buffer.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        while let Some(end) = buffer.find("\n\n") {
            let frame: String = buffer.drain(..end + 2).collect();
            let (mut event, mut data) = (String::new(), String::new());
            for line in frame.lines() {
                if let Some(name) = line.strip_prefix("event: ") {
                    event = name.to_owned();
                } else if let Some(payload) = line.strip_prefix("data:") {
                    data = payload.to_owned();
                } else if line.starts_with(':') {
                    event = line.to_owned();
                }
            }
            frames.push((event, data));
        }
    }
    frames
}

#[tokio::test]
async fn sse_sends_the_checkpoint_then_data_and_control_frames_then_heartbeats_and_new_batches() {
    let server = Server::start_with(HttpOptions {
        heartbeat: Duration::from_millis(100),
        ..HttpOptions::default()
    })
    .await;
    server.script_exchange("first");
    let receipt = server.admit("c1", "one").await;
    server.settled("c1", 1).await;

    let response = server
        .client
        .get(server.url("/c1?view=updates&offset=-1&live=sse"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(header(response.headers(), "content-type"), "text/event-stream");
    assert_eq!(header(response.headers(), "cache-control"), "no-cache");
    assert_security_headers(response.headers());
    let frames = sse_frames(response, |frames| {
        frames.iter().any(|(event, _)| event == ": heartbeat")
    })
    .await;
    assert_eq!(frames[0].0, "data");
    let checkpoint: Value = serde_json::from_str(&frames[0].1).unwrap();
    assert_eq!(
        checkpoint,
        json!([{"type": "stream-checkpoint", "incarnation": receipt["uid"]}])
    );
    assert_eq!(frames[1].0, "data");
    let chunks: Vec<Value> = serde_json::from_str(&frames[1].1).unwrap();
    assert_eq!(chunks[0]["type"], "conversation-reset");
    assert_eq!(chunks.last().unwrap()["type"], "submission-settled");
    assert_eq!(frames[2].0, "control");
    let control: Value = serde_json::from_str(&frames[2].1).unwrap();
    assert_eq!(control["upToDate"], true);
    assert!(control["streamNextOffset"].as_str().unwrap().ends_with(&format!(
        "{:016}",
        chunks.last().unwrap()["position"]["batch"].as_u64().unwrap()
    )));
    assert!(
        frames[3..].iter().all(|(event, _)| event == ": heartbeat"),
        "{frames:?}"
    );
}

#[tokio::test]
async fn an_sse_reader_receives_batches_appended_while_it_waits() {
    let server = Server::start().await;
    server.script_exchange("first");
    server.post("c1", json!({"kind": "user", "body": "one"})).await;
    let head = server.settled("c1", 1).await["offset"].as_str().unwrap().to_owned();
    let response = server
        .client
        .get(server.url(&format!("/c1?view=updates&offset={head}&live=sse")))
        .send()
        .await
        .unwrap();
    let reader = tokio::spawn(sse_frames(response, |frames| {
        frames
            .iter()
            .any(|(event, data)| event == "data" && data.contains("submission-settled"))
    }));
    tokio::time::sleep(Duration::from_millis(50)).await;
    server.script_exchange("second");
    server.post("c1", json!({"kind": "user", "body": "two"})).await;
    let frames = reader.await.unwrap();
    let chunks: Vec<Value> = frames
        .iter()
        .filter(|(event, data)| event == "data" && !data.contains("stream-checkpoint"))
        .flat_map(|(_, data)| serde_json::from_str::<Vec<Value>>(data).unwrap())
        .collect();
    assert_eq!(chunks[0]["type"], "message-appended");
    assert_eq!(chunks[0]["message"]["parts"][0]["text"], "two");
    assert_eq!(chunks.last().unwrap()["type"], "submission-settled");
}

/// Reference §4.5: every SSE read cycle "always emit[s] `control`" (with `upToDate` at the
/// head), then sleeps "until a store notification or 30 s" and loops — so a reader that
/// connects (or reconnects) at the head gets `{streamNextOffset, upToDate:true}` at once, and a
/// keep-alive control every `sse_wait` while idle.
#[tokio::test]
async fn an_sse_reader_at_the_head_gets_a_control_frame_at_once_and_keep_alives() {
    let server = Server::start_with(HttpOptions {
        heartbeat: Duration::from_millis(100),
        sse_wait: Duration::from_millis(300),
        ..HttpOptions::default()
    })
    .await;
    server.model.push(ScriptedReply::text("hi"));
    server.post("c1", json!({"kind": "user", "body": "hi"})).await;
    let head = server.settled("c1", 1).await["offset"].as_str().unwrap().to_owned();
    let response = server
        .client
        .get(server.url(&format!("/c1?view=updates&offset={head}&live=sse")))
        .send()
        .await
        .unwrap();
    let frames = sse_frames_for(response, Duration::from_millis(1500)).await;
    let events: Vec<&str> = frames.iter().map(|(event, _)| event.as_str()).collect();
    assert_eq!(events[0], "data", "the checkpoint first: {events:?}");
    assert_eq!(
        events.get(1).copied(),
        Some("control"),
        "the first read cycle's control frame follows the checkpoint: {events:?}"
    );
    let control: Value = serde_json::from_str(&frames[1].1).unwrap();
    assert_eq!(control, json!({"streamNextOffset": head, "upToDate": true}));
    let controls = events.iter().filter(|event| **event == "control").count();
    assert!(
        controls >= 3,
        "an idle stream sends a control frame every sse_wait (300 ms) over 1.5 s: {events:?}"
    );
}

#[tokio::test]
async fn head_answers_the_head_offset_and_a_missing_stream_with_headers_only() {
    let server = Server::start().await;
    server.script_exchange("first");
    server.post("c1", json!({"kind": "user", "body": "one"})).await;
    let snapshot = server.settled("c1", 1).await;
    let response = server.client.head(server.url("/c1")).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let headers = response.headers();
    assert_eq!(
        header(headers, "stream-next-offset"),
        snapshot["offset"].as_str().unwrap()
    );
    assert_eq!(header(headers, "stream-up-to-date"), "true");
    assert_eq!(header(headers, "cache-control"), "no-store");
    assert_eq!(header(headers, "content-type"), "application/json");
    assert_security_headers(headers);

    let response = server.client.head(server.url("/never")).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 404);
    assert_security_headers(response.headers());
    assert!(response.bytes().await.unwrap().is_empty());
}

/// A page on another site can send a browser's "simple" requests here without a preflight:
/// those that change state are refused unless the server allows other sites; reads and
/// requests from this server's own pages (or from no browser) pass. A page another server on
/// `localhost` serves is `same-site` to the browser (ports aside) and refused all the same.
#[tokio::test]
async fn a_browser_on_another_site_cannot_change_state_unless_allowed() {
    let server = Server::start().await;
    let abort = |site: &'static str| {
        server
            .client
            .post(server.url("/idle/abort"))
            .header("sec-fetch-site", site)
            .send()
    };
    let refused = abort("cross-site").await.unwrap();
    let error = assert_error(refused, 403, "forbidden").await;
    assert!(
        error["details"].as_str().unwrap().contains("allow_cross_site"),
        "{error}"
    );
    for site in ["same-origin", "none"] {
        assert_eq!(abort(site).await.unwrap().status().as_u16(), 200, "{site}");
    }
    let same_site = |origin: String| {
        server
            .client
            .post(server.url("/idle/abort"))
            .header("sec-fetch-site", "same-site")
            .header("origin", origin)
            .send()
    };
    let another_port = same_site("http://localhost:1".to_owned()).await.unwrap();
    assert_error(another_port, 403, "forbidden").await;
    let this_host = server.root.trim_start_matches("http://").to_owned();
    let own = same_site(format!("https://{this_host}")).await.unwrap();
    assert_eq!(own.status().as_u16(), 200);
    let message = server
        .client
        .post(server.url("/c1"))
        .header("sec-fetch-site", "cross-site")
        .header("content-type", "text/plain")
        .body("{\"kind\":\"user\",\"body\":\"hi\"}")
        .send()
        .await
        .unwrap();
    let error = assert_error(message, 403, "forbidden").await;
    // No credentials are in play: the refusal says where the request came from is refused.
    assert_eq!(
        error["message"], "The request is not allowed from where it came.",
        "{error}"
    );
    let read = server
        .client
        .get(server.url("/c1"))
        .header("sec-fetch-site", "cross-site")
        .send()
        .await
        .unwrap();
    assert_ne!(read.status().as_u16(), 403);

    // A browser that sends no Sec-Fetch-Site: its Origin says where the request comes from.
    let from_origin = |origin: String| {
        server
            .client
            .post(server.url("/idle/abort"))
            .header("origin", origin)
            .send()
    };
    let refused = from_origin("http://evil.example".to_owned()).await.unwrap();
    assert_error(refused, 403, "forbidden").await;
    let host = server.root.trim_start_matches("http://").to_owned();
    assert_eq!(
        from_origin(format!("http://{host}")).await.unwrap().status().as_u16(),
        200
    );
    // The user routes run the application's hooks even for a read, also one a page on another
    // port sends without an Origin (an `<img>`'s), and one a browser that trusts no plain-HTTP
    // address sends with neither header: only a stream's reader (`Accept: text/event-stream`)
    // is served then.
    for accept in ["image/avif,image/webp,*/*", "*/*"] {
        let attach = server
            .client
            .get(format!("{}/users/u1/events?client_id=img&client_kind=web", server.root))
            .header("accept", accept)
            .send()
            .await
            .unwrap();
        assert_error(attach, 403, "forbidden").await;
    }
    let reader = server
        .client
        .get(format!("{}/users/u1/events?client_id=reader", server.root))
        .header("accept", "text/event-stream; q=1")
        .send()
        .await
        .unwrap();
    assert_eq!(reader.status().as_u16(), 200);
    // The user's hooks run in order: once the reader's attach hook ran, one the refused
    // requests had started would have run too.
    attach_hook_ran("u1 + reader ").await;
    assert!(
        !CLIENTS.lock().unwrap().iter().any(|line| line.contains(" img ")),
        "no hook ran"
    );
    drop(reader);
    for site in ["cross-site", "same-site"] {
        let attach = server
            .client
            .get(format!("{}/users/u1/events?client_id=c&client_kind=web", server.root))
            .header("sec-fetch-site", site)
            .send()
            .await
            .unwrap();
        // The status first: an attach let through is a stream that never ends.
        assert_eq!(attach.status().as_u16(), 403, "{site}");
        assert_error(attach, 403, "forbidden").await;
    }

    let open = Server::start_with(HttpOptions {
        allow_cross_site: true,
        ..HttpOptions::default()
    })
    .await;
    let allowed = open
        .client
        .post(open.url("/idle/abort"))
        .header("sec-fetch-site", "cross-site")
        .send()
        .await
        .unwrap();
    assert_eq!(allowed.status().as_u16(), 200);
}

/// DNS rebinding: a page on another site points its own name at this server's address and is
/// then, to the browser, the same site; over plain HTTP its reads carry no header that says a
/// page sent them. Without an authorization policy the server answers only by an IP address,
/// `localhost` or an allowed name, whoever asks.
#[tokio::test]
async fn a_request_that_reaches_the_server_by_another_name_is_refused_unless_allowed() {
    let port = |server: &Server| server.root.rsplit(':').next().unwrap().to_owned();
    // A rebound page's same-origin read over plain HTTP: no Origin, no Sec-Fetch-*.
    let rebound =
        |server: &Server, host: String, path: &str| server.client.get(server.url(path)).header("host", host).send();
    let server = Server::start().await;
    server.script_exchange("hi");
    server.post("c1", json!({"kind": "user", "body": "one"})).await;
    server.settled("c1", 1).await;
    let evil = format!("evil.example:{}", port(&server));
    let error = assert_error(rebound(&server, evil.clone(), "/c1").await.unwrap(), 403, "forbidden").await;
    assert!(error["details"].as_str().unwrap().contains("allowed_hosts"), "{error}");
    assert_eq!(
        error["message"], "The request is not allowed from where it came.",
        "{error}"
    );
    for path in [
        "/c1?view=updates&offset=-1&live=sse",
        "/c1?view=updates&offset=-1&live=long-poll",
    ] {
        assert_error(rebound(&server, evil.clone(), path).await.unwrap(), 403, "forbidden").await;
    }
    let posted = server
        .client
        .post(server.url("/c1"))
        .header("host", evil.clone())
        .header("origin", format!("http://{evil}"))
        .json(&json!({"kind": "user", "body": "from a rebound page"}))
        .send()
        .await
        .unwrap();
    assert_error(posted, 403, "forbidden").await;
    // The same read by the loopback names.
    for host in [
        format!("localhost:{}", port(&server)),
        format!("[::1]:{}", port(&server)),
    ] {
        assert_eq!(rebound(&server, host, "/c1").await.unwrap().status().as_u16(), 200);
    }

    let named = Server::start_with(HttpOptions {
        allowed_hosts: vec!["agents.example.com".to_owned()],
        ..HttpOptions::default()
    })
    .await;
    let host = format!("agents.example.com:{}", port(&named));
    assert_eq!(rebound(&named, host, "/c1").await.unwrap().status().as_u16(), 404);
    let evil = format!("evil.example:{}", port(&named));
    assert_error(rebound(&named, evil, "/c1").await.unwrap(), 403, "forbidden").await;

    // With an authorization policy the name is not checked: the policy decides.
    let tokens = flue_runtime::http::BearerTokens::new().allow("token", flue_runtime::http::Access::All);
    let guarded = Server::start_with(HttpOptions::default().authorized_by(tokens)).await;
    let evil = format!("evil.example:{}", port(&guarded));
    let unauthenticated = rebound(&guarded, evil.clone(), "/c1").await.unwrap();
    assert_eq!(unauthenticated.status().as_u16(), 401);
    let authorized = guarded
        .client
        .get(guarded.url("/c1"))
        .header("host", evil)
        .bearer_auth("token")
        .send();
    assert_eq!(authorized.await.unwrap().status().as_u16(), 404);
}

/// Reference §3.9 (`recordSubmissionTerminal`): a response aborted while its tool runs
/// settles the call with the outcome-unknown result, so the history shows the call ended, as
/// an error, instead of running for good.
#[tokio::test]
async fn a_call_an_abort_interrupted_ends_as_an_error_in_the_history() {
    let server = Server::start().await;
    server.model.push(ScriptedReply::tool_call("stuck_lookup", json!({})));
    let instance = format!("{}/agents/stuck_worker/s1", server.root);
    let response = server
        .client
        .post(&instance)
        .json(&json!({"kind": "user", "body": "find it"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 202);
    let history = || async {
        let response = server.client.get(&instance).send().await.unwrap();
        response.json::<Value>().await.unwrap()
    };
    let tool_part = |snapshot: &Value| snapshot["messages"][1]["parts"][0].clone();
    let mut running = Value::Null;
    for _ in 0..500 {
        running = tool_part(&history().await);
        if running["type"] == "dynamic-tool" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(running["state"], "input-available", "{running}");
    let aborted = server.client.post(format!("{instance}/abort")).send().await.unwrap();
    assert_eq!(aborted.json::<Value>().await.unwrap(), json!({"aborted": true}));
    let mut snapshot = Value::Null;
    for _ in 0..500 {
        snapshot = history().await;
        if snapshot["settlements"]
            .as_array()
            .is_some_and(|settled| !settled.is_empty())
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(snapshot["settlements"][0]["outcome"], "aborted", "{snapshot}");
    let ended = tool_part(&snapshot);
    assert_eq!(ended["state"], "output-error", "{snapshot}");
    assert_eq!(
        ended["errorText"],
        r#"{"type":"interrupted","message":"Tool execution was interrupted before completion. The outcome is unknown."}"#
    );
    // The abort's advisory names the call, as an exhausted budget's does.
    let advisory = &snapshot["messages"][2];
    assert_eq!(advisory["purpose"], "advisory", "{snapshot}");
    assert_eq!(
        advisory["parts"][0]["text"],
        "Submission was aborted.\n\nInterrupted tool call(s):\n  - stuck_lookup (call_1_0)"
    );
}

/// Nested under a path with parameters of its own (a tenant's), the routers still find their
/// instance, attachment and user ids: the handlers take their parameters by name.
#[tokio::test]
async fn the_routers_work_nested_under_a_path_with_parameters_of_its_own() {
    let model = ScriptedModel::new([]);
    let runtime = harness::runtime_with(&model, vec![calculator.into()]);
    let app = axum::Router::new()
        .nest(
            "/t/{tenant}/calc",
            flue_runtime::http::agent_router(&runtime, "calculator", HttpOptions::default()).unwrap(),
        )
        .nest("/all/{tenant}", flue_runtime::http::router(&runtime));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let root = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let client = reqwest::Client::new();
    for (base, id) in [
        (format!("{root}/t/acme/calc"), "one"),
        (format!("{root}/all/acme/agents/calculator"), "two"),
    ] {
        model.push(ScriptedReply::text("hi"));
        let admitted = client
            .post(format!("{base}/{id}"))
            .json(&json!({"kind": "user", "body": "hi"}))
            .send()
            .await
            .unwrap();
        assert_eq!(admitted.status().as_u16(), 202, "{base}");
        let read = client.get(format!("{base}/{id}")).send().await.unwrap();
        assert_eq!(read.status().as_u16(), 200, "{base}");
        let missing = client
            .get(format!("{base}/{id}/attachments/att_nope"))
            .send()
            .await
            .unwrap();
        assert_error(missing, 404, "attachment_not_found").await;
        let aborted = client.post(format!("{base}/{id}/abort")).send().await.unwrap();
        assert_eq!(aborted.status().as_u16(), 200, "{base}");
        let blank = client.get(format!("{base}/%20")).send().await.unwrap();
        assert_error(blank, 400, "invalid_request").await;
    }
    let events = client
        .head(format!("{root}/all/acme/users/u1/events"))
        .send()
        .await
        .unwrap();
    assert_eq!(events.status().as_u16(), 200);
}

#[tokio::test]
async fn abort_answers_whether_anything_was_unsettled() {
    let server = Server::start().await;
    let response = server.client.post(server.url("/idle/abort")).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert_security_headers(response.headers());
    assert_eq!(response.json::<Value>().await.unwrap(), json!({"aborted": false}));
    // Nothing was unsettled (the instance does not even exist): no instance was loaded for it.
    assert_eq!(server.runtime.cached_instance_count(), 0);
    let response = server.client.get(server.url("/idle/abort")).send().await.unwrap();
    assert_eq!(header(response.headers(), "allow"), "POST");
    assert_error(response, 405, "method_not_allowed").await;
}

/// The memory store, whose first look at an instance misses it (a read racing the
/// admission that creates it, whose stream the next look finds).
struct LateInstance {
    inner: MemoryStore,
    /// Cleared to make the next look miss.
    missed: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl flue_runtime::store::Store for LateInstance {
    harness::delegate_store!(
        inner;
        admit, submission, has_queued, claim_next, renew_leases, expired, reclaim,
        aborts_requested, instances_with_queued, claim_joinable, finalize_join, revert_joins, settle,
        requeue, request_abort, append, create_child, last_offset, put_attachment, attachment, read,
        read_page, user_value, set_user_value, list_user_values,
    );

    fn instance(
        &self,
        key: &flue_runtime::store::InstanceKey,
    ) -> flue_runtime::BoxFuture<'_, Result<Option<flue_runtime::store::InstanceInfo>, flue_runtime::store::StoreError>>
    {
        if !self.missed.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return Box::pin(async { Ok(None) });
        }
        self.inner.instance(key)
    }
}

/// A read that looked for the instance just before the admission creating it committed, and
/// then found its stream, still names the instance's incarnation in its checkpoint (it used to
/// be empty, and a live reader kept it so for the life of its stream).
#[tokio::test]
async fn a_read_racing_the_instances_creation_names_its_incarnation() {
    let model = ScriptedModel::new([ScriptedReply::text("hi")]);
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    let store = MemoryStore::new();
    let missed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let runtime = Runtime::builder()
        .store(LateInstance {
            inner: store.clone(),
            missed: missed.clone(),
        })
        .providers(providers)
        .agent(calculator)
        .build()
        .unwrap();
    let handle = runtime.init(&calculator, "raced");
    handle.send("hi").await.unwrap();
    let uid = flue_runtime::store::Store::instance(&store, handle.key())
        .await
        .unwrap()
        .unwrap()
        .uid;
    let app = flue_runtime::http::router(&runtime);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    missed.store(false, std::sync::atomic::Ordering::SeqCst);
    let body: Value = reqwest::get(format!("http://{addr}/agents/calculator/raced?view=updates&offset=-1"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        body[0],
        json!({"type": "stream-checkpoint", "incarnation": uid}),
        "{body}"
    );
}

/// Reference §6.2: an attachment whose stored bytes fail their integrity check is answered
/// 500 `attachment_integrity` with `meta {attachmentId, reason}`, not a bare internal error.
#[tokio::test]
async fn an_attachment_failing_its_integrity_check_is_500_attachment_integrity() {
    let model = ScriptedModel::new([ScriptedReply::text("hi")]);
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    let runtime = Runtime::builder()
        .store(harness::DamagedAttachments {
            inner: MemoryStore::new(),
        })
        .providers(providers)
        .agent(calculator)
        .build()
        .unwrap();
    runtime.init(&calculator, "pics").send("hi").await.unwrap();
    let app = flue_runtime::http::router(&runtime);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let response = reqwest::get(format!("http://{addr}/agents/calculator/pics/attachments/att_1"))
        .await
        .unwrap();
    let error = assert_error(response, 500, "attachment_integrity").await;
    assert_eq!(error["meta"], json!({"attachmentId": "att_1", "reason": "digest"}));
    assert!(
        !error.to_string().contains("SHA-256"),
        "what was found stays in the log: {error}"
    );
}

#[tokio::test]
async fn attachments_are_served_with_their_type_and_immutable_caching() {
    use base64::Engine as _;
    let server = Server::start().await;
    server.model.push(ScriptedReply::text("A red dot."));
    let png = b"\x89PNG\r\n\x1a\nnot really a png".to_vec();
    let data = base64::engine::general_purpose::STANDARD.encode(&png);
    server
        .post(
            "pics",
            json!({"kind": "user", "body": "What is this?",
                   "attachments": [{"type": "image", "data": data, "mimeType": "image/png", "filename": "dot.png"}]}),
        )
        .await;
    let snapshot = server.settled("pics", 1).await;
    let file = &snapshot["messages"][0]["parts"][1];
    assert_eq!(file["type"], "file");
    assert_eq!(file["mediaType"], "image/png");
    assert_eq!(
        (file["size"].as_u64(), file["filename"].as_str()),
        (Some(png.len() as u64), Some("dot.png"))
    );
    assert!(file.get("url").is_none());

    let id = file["id"].as_str().unwrap();
    let response = server
        .client
        .get(server.url(&format!("/pics/attachments/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let headers = response.headers().clone();
    assert_eq!(header(&headers, "content-type"), "image/png");
    assert_eq!(header(&headers, "content-length"), png.len().to_string());
    assert_eq!(header(&headers, "content-disposition"), "inline");
    assert_eq!(
        header(&headers, "cache-control"),
        "private, max-age=31536000, immutable"
    );
    assert_eq!(header(&headers, "content-security-policy"), "sandbox");
    assert_security_headers(&headers);
    assert_eq!(response.bytes().await.unwrap().as_ref(), png.as_slice());

    let missing = server.get("/pics/attachments/att_nope").await;
    assert_error(missing, 404, "attachment_not_found").await;
    let no_stream = server.get(&format!("/never/attachments/{id}")).await;
    assert_error(no_stream, 404, "stream_not_found").await;
    let wrong_method = server
        .client
        .delete(server.url(&format!("/pics/attachments/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(header(wrong_method.headers(), "allow"), "GET");
    assert_error(wrong_method, 405, "method_not_allowed").await;
    // HEAD too (reference §4.1: other methods than GET → 405), with headers only.
    let head = server
        .client
        .head(server.url(&format!("/pics/attachments/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(head.status().as_u16(), 405);
    assert_eq!(header(head.headers(), "allow"), "GET");
    assert!(head.bytes().await.unwrap().is_empty());
}

#[tokio::test]
async fn bad_admissions_get_the_protocols_4xx_with_the_error_envelope() {
    let server = Server::start().await;
    let url = server.url("/c1");
    let client = &server.client;
    let raw = |content_type: Option<&'static str>, body: &'static str| {
        let mut request = client.post(&url).body(body);
        if let Some(content_type) = content_type {
            request = request.header("content-type", content_type);
        }
        request
    };

    assert_error(
        raw(Some("text/plain"), "hello").send().await.unwrap(),
        415,
        "unsupported_media_type",
    )
    .await;
    // A browser posts this media type cross-site without a preflight; JSON named only in a
    // parameter is not a JSON body.
    assert_error(
        raw(
            Some("text/plain; charset=application/json"),
            "{\"kind\":\"user\",\"body\":\"hi\"}",
        )
        .send()
        .await
        .unwrap(),
        415,
        "unsupported_media_type",
    )
    .await;
    let error = assert_error(
        raw(Some("application/json"), "{\"kind\":").send().await.unwrap(),
        400,
        "invalid_json",
    )
    .await;
    assert!(error["details"].as_str().unwrap().contains("EOF"), "{error}");
    assert_error(
        raw(Some("application/json"), "\"hi\"").send().await.unwrap(),
        400,
        "invalid_request",
    )
    .await;
    assert_error(raw(None, "").send().await.unwrap(), 400, "invalid_request").await;
    assert_error(
        raw(Some("application/json"), "   ").send().await.unwrap(),
        400,
        "invalid_request",
    )
    .await;
    // The type is checked before the text: a blank body sent as text is not JSON.
    assert_error(
        raw(Some("text/plain"), "   ").send().await.unwrap(),
        415,
        "unsupported_media_type",
    )
    .await;
    // A type that is not ASCII text is one given, not a missing one.
    let odd = client
        .post(&url)
        .header(
            "content-type",
            reqwest::header::HeaderValue::from_bytes(b"application/j\xC3\xA9son").unwrap(),
        )
        .body("{\"kind\":\"user\",\"body\":\"hi\"}")
        .send()
        .await
        .unwrap();
    let error = assert_error(odd, 415, "unsupported_media_type").await;
    assert_eq!(
        error["details"], "Send the body as application/json, not a content type that is not ASCII text.",
        "{error}"
    );
    let wait = client
        .post(format!("{url}?wait=true"))
        .json(&json!({"kind": "user", "body": "hi"}))
        .send()
        .await
        .unwrap();
    assert!(
        assert_error(wait, 400, "invalid_request").await["details"]
            .as_str()
            .unwrap()
            .contains("wait")
    );

    let cases = [
        (
            json!({"kind": "signal", "type": "resources", "body": "x"}),
            "framework-reserved",
        ),
        (
            json!({"kind": "user", "body": "hi", "uid": "u", "initialData": {}}),
            "initialData",
        ),
        (
            json!({"kind": "user", "body": "hi", "attachments": [{"type": "image", "data": "!!", "mimeType": "image/png"}]}),
            "base64",
        ),
        // An image is one of the types every provider takes (a page served back inline from an
        // attachment would be a document, not a picture).
        (
            json!({"kind": "user", "body": "hi", "attachments": [{"type": "image", "data": "PHNjcmlwdD4=", "mimeType": "text/html"}]}),
            "image/png, image/jpeg",
        ),
        (
            json!({"kind": "user", "body": "hi", "attachments": [{"type": "image", "data": "PHN2Zz4=", "mimeType": "image/svg+xml"}]}),
            "not supported",
        ),
        // No picture at all, and more pictures than any provider takes in one request: each
        // would be stored, and sent with every later call of the conversation.
        (
            json!({"kind": "user", "body": "hi", "attachments": [{"type": "image", "data": " ", "mimeType": "image/png"}]}),
            "must not be empty",
        ),
        (
            json!({"kind": "user", "body": "hi", "attachments": vec![json!({"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png"}); 101]}),
            "at most 100 attachments; this one has 101",
        ),
        // A PNG sent as a JPEG: a provider refuses it, in every later call too.
        (
            json!({"kind": "user", "body": "hi", "attachments": [{"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/jpeg"}]}),
            "Image data is not of its mimeType \"image/jpeg\": its bytes are image/png.",
        ),
    ];
    for (body, says) in cases {
        let error = assert_error(server.post("c1", body.clone()).await, 400, "invalid_request").await;
        assert!(error["details"].as_str().unwrap().contains(says), "{body} → {error}");
    }
    // The reference's own words (reference §4.2): a rule's, else the message shape's.
    const SHAPE: &str = "Delivered messages must be { kind: \"user\", body: string, attachments?: attachment[] } or { kind: \"signal\", type: string, body: string, attributes?: Record<string, string>, tagName?: string }.";
    let exact = [
        (
            json!({"kind": "signal", "type": "note", "body": "x", "tagName": "1bad"}),
            "Signal message \"tagName\" must be a valid XML tag name (letters, digits, \"_\", \"-\", \".\"; must not start with a digit, \"-\", or \".\").",
        ),
        (json!({"kind": "signal", "type": "", "body": "x"}), SHAPE),
        (json!({"kind": "robot", "body": "hi"}), SHAPE),
        (json!({"body": "hi"}), SHAPE),
        (json!({"kind": "user", "body": 5}), SHAPE),
        (json!({"kind": "user", "body": "hi", "attachments": null}), SHAPE),
        (
            json!({"kind": "user", "body": "hi", "attachments": [{"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png", "filename": null}]}),
            SHAPE,
        ),
        (
            json!({"kind": "signal", "type": "note", "body": "x", "tagName": null}),
            SHAPE,
        ),
        (
            json!({"kind": "signal", "type": "note", "body": "x", "attributes": null}),
            SHAPE,
        ),
        // A rule's own words come before the shape's.
        (
            json!({"kind": "signal", "type": "note", "body": "x", "tagName": "1bad", "attributes": null}),
            "Signal message \"tagName\" must be a valid XML tag name (letters, digits, \"_\", \"-\", \".\"; must not start with a digit, \"-\", or \".\").",
        ),
        (
            json!({"kind": "user", "body": "hi", "uid": 7}),
            "`uid` must be a string (continue only that incarnation) or null (create only when fresh).",
        ),
        (
            json!({"kind": "user", "body": "hi", "idempotencyKey": ""}),
            "`idempotencyKey` must be a non-empty string naming this delivery.",
        ),
        (
            json!({"kind": "user", "body": "hi", "idempotencyKey": 7}),
            "`idempotencyKey` must be a non-empty string naming this delivery.",
        ),
        (
            json!({"kind": "user", "body": "hi", "idempotencyKey": "k".repeat(257)}),
            "`idempotencyKey` must be at most 256 characters.",
        ),
    ];
    for (body, says) in exact {
        let error = assert_error(server.post("c1", body.clone()).await, 400, "invalid_request").await;
        assert_eq!(error["details"], says, "{body}");
    }
    // An image over the limit (14,680,064 characters of base64).
    let oversized = json!({"kind": "user", "body": "hi",
        "attachments": [{"type": "image", "data": "A".repeat(14_680_068), "mimeType": "image/png"}]});
    let error = assert_error(server.post("c1", oversized).await, 400, "invalid_request").await;
    assert_eq!(error["details"], "Image data exceeds the 14680064 character limit.");
    assert!(server.model.requests().is_empty(), "no bad input reached the model");
    // What the reference takes: a type of spaces (it is not empty), and a field of the other
    // kind, `null` or not (its schema drops unknown keys).
    for body in [
        json!({"kind": "signal", "type": " ", "body": "x"}),
        json!({"kind": "user", "body": "hi", "tagName": null, "attributes": null}),
        json!({"kind": "signal", "type": "note", "body": "x", "attachments": null}),
    ] {
        server.model.push(ScriptedReply::text("ok"));
        assert_eq!(server.post("c2", body.clone()).await.status().as_u16(), 202, "{body}");
    }
}

/// Reference §4.2: `idempotencyKey` is a "non-empty string ≤256 chars" — JavaScript string
/// length, in UTF-16 code units: an emoji is two of them, an `é` one.
#[tokio::test]
async fn an_idempotency_key_is_at_most_256_utf16_code_units_long() {
    let server = Server::start().await;
    let post = |key: String| server.post("c1", json!({"kind": "user", "body": "hi", "idempotencyKey": key}));
    let error = assert_error(post("😀".repeat(129)).await, 400, "invalid_request").await;
    assert!(error["details"].as_str().unwrap().contains("idempotencyKey"), "{error}");
    for key in ["😀".repeat(128), "é".repeat(256)] {
        server.model.push(ScriptedReply::text("hi"));
        assert_eq!(post(key).await.status().as_u16(), 202);
    }
}

#[tokio::test]
async fn conditional_sends_answer_404_and_409_with_their_meta() {
    let server = Server::start().await;
    server.model.push(ScriptedReply::text("hi"));
    let receipt = server.admit("c1", "hi").await;
    let wrong_uid = server
        .post("c1", json!({"kind": "user", "body": "hi", "uid": "inc_other"}))
        .await;
    assert_error(wrong_uid, 404, "agent_instance_not_found").await;
    let missing = server
        .post("c2", json!({"kind": "user", "body": "hi", "uid": "inc_other"}))
        .await;
    assert_error(missing, 404, "agent_instance_not_found").await;
    let exists = server
        .post("c1", json!({"kind": "user", "body": "hi", "uid": null}))
        .await;
    let error = assert_error(exists, 409, "agent_instance_exists").await;
    assert_eq!(error["meta"]["uid"], receipt["uid"]);
    server.model.push(ScriptedReply::text("one"));
    server
        .post("c1", json!({"kind": "user", "body": "one", "idempotencyKey": "k"}))
        .await;
    let conflict = server
        .post("c1", json!({"kind": "user", "body": "another", "idempotencyKey": "k"}))
        .await;
    let error = assert_error(conflict, 409, "submission_conflict").await;
    assert!(error["meta"]["submissionId"].as_str().unwrap().starts_with("sub_"));
}

/// Reference §6.1 / §3.6: `submission_conflict` when "an idempotency key [is] reused with a
/// different identity (kind, agent, id, message, initialData)". The transport kind is not in
/// the keyed id, so one key used by `dispatch()` and by HTTP is a loud kind conflict.
#[tokio::test]
async fn an_idempotency_key_replayed_with_other_initial_data_or_by_another_kind_of_send_conflicts() {
    let server = Server::start().await;
    server.model.push(ScriptedReply::text("hi"));
    let keyed = |data: Value| json!({"kind": "user", "body": "hi", "idempotencyKey": "k", "initialData": data});
    let first = server.post("c9", keyed(json!({"plan": "free"}))).await;
    assert_eq!(first.status().as_u16(), 202);
    let same = server.post("c9", keyed(json!({"plan": "free"}))).await;
    assert_eq!(same.status().as_u16(), 202);
    assert_eq!(same.json::<Value>().await.unwrap()["deduplicated"], true);
    let replay = server.post("c9", keyed(json!({"plan": "pro"}))).await;
    let error = assert_error(replay, 409, "submission_conflict").await;
    assert!(error["meta"]["submissionId"].as_str().unwrap().starts_with("sub_ik_"));

    server.model.push(ScriptedReply::text("hi"));
    let dispatched = flue_runtime::SendRequest::new("c9", "again").idempotency_key("k2");
    server.runtime.dispatch_request("calculator", dispatched).await.unwrap();
    let posted = server
        .post("c9", json!({"kind": "user", "body": "again", "idempotencyKey": "k2"}))
        .await;
    assert_error(posted, 409, "submission_conflict").await;
}

#[tokio::test]
async fn bad_reads_get_the_protocols_4xx_with_the_error_envelope() {
    let server = Server::start().await;
    server.model.push(ScriptedReply::text("hi"));
    server.post("c1", json!({"kind": "user", "body": "hi"})).await;
    let head = server.settled("c1", 1).await["offset"].as_str().unwrap().to_owned();
    let get = |tail: String| {
        let request = server.client.get(server.url(&tail));
        async move { request.send().await.unwrap() }
    };
    for (tail, says) in [
        ("/c1?view=updates", "offset"),
        ("/c1?view=updates&offset=abc", "malformed"),
        ("/c1?view=updates&offset=-1&offset=-1", "exactly one"),
        ("/c1?view=updates&view=history&offset=-1", "`view` parameter is given"),
        ("/c1?view=updates&offset=-1&live=sse&live=sse", "`live` parameter"),
        ("/c1?view=updates&offset=-1&live=stream", "live"),
        ("/c1?view=updates&offset=-1&tail=5", "tail"),
        ("/c1?view=everything", "view"),
        ("/c1?view=history&offset=-1", "history"),
        ("/c1?live=sse", "history"),
    ] {
        let error = assert_error(get(tail.to_owned()).await, 400, "invalid_request").await;
        assert!(error["details"].as_str().unwrap().contains(says), "{tail} → {error}");
    }
    let past = format!("0000000000000000_{:016}", 99);
    let error = assert_error(
        get(format!("/c1?view=updates&offset={past}")).await,
        416,
        "stream_offset_gone",
    )
    .await;
    // The reference's `offset` and `nextOffset`, and the stream's incarnation (a reader that
    // followed another one tells its stream was replaced by a shorter one).
    let incarnation = error["meta"]["incarnation"].as_str().unwrap().to_owned();
    assert!(incarnation.starts_with("inst_"), "{error}");
    assert_eq!(
        error["meta"],
        json!({"offset": past, "nextOffset": head, "incarnation": incarnation})
    );
    // Quoted back as the client wrote it, not in the canonical form.
    let short = assert_error(
        get("/c1?view=updates&offset=0_99".to_owned()).await,
        416,
        "stream_offset_gone",
    )
    .await;
    assert_eq!(
        short["meta"],
        json!({"offset": "0_99", "nextOffset": head, "incarnation": incarnation})
    );
    assert_error(get("/never".to_owned()).await, 404, "stream_not_found").await;
    assert_error(
        get("/never?view=updates&offset=-1".to_owned()).await,
        404,
        "stream_not_found",
    )
    .await;
    // Blank as JavaScript's `trim` sees it: a byte order mark and a no-break space too.
    for blank in ["%20", "%EF%BB%BF", "%C2%A0%20"] {
        let error = assert_error(get(format!("/{blank}")).await, 400, "invalid_request").await;
        assert_eq!(
            error["details"], "Agent conversation URLs must end with a non-empty conversation id segment.",
            "{blank}"
        );
        let error = assert_error(
            server.post(blank, json!({"kind": "user", "body": "hi"})).await,
            400,
            "invalid_request",
        )
        .await;
        assert_eq!(
            error["details"], "Agent conversation URLs must end with a non-empty conversation id segment.",
            "{blank}"
        );
    }
    // Only a 405 names the allowed methods (an empty `allow` here would say none are).
    for blank in [
        get("/".to_owned()).await,
        server.client.get(server.url("")).send().await.unwrap(),
        server.client.post(server.url("/")).send().await.unwrap(),
    ] {
        assert!(blank.headers().get("allow").is_none(), "{:?}", blank.headers());
        assert_error(blank, 400, "invalid_request").await;
    }
    let unknown = server
        .client
        .get(format!("{}/nowhere/at/all", server.url("")))
        .send()
        .await
        .unwrap();
    assert_error(unknown, 404, "route_not_found").await;
    let other_agent = server
        .client
        .get(server.url("/c1").replace("calculator", "nobody"))
        .send()
        .await
        .unwrap();
    assert_error(other_agent, 404, "route_not_found").await;
    let put = server.client.put(server.url("/c1")).send().await.unwrap();
    assert_eq!(header(put.headers(), "allow"), "GET, HEAD, POST");
    assert_error(put, 405, "method_not_allowed").await;
}

/// Reference §4.3/§4.4: offsets parse as `^\d+_(\d+)$` with no fixed width and compare
/// numerically; an offset beyond the head is 416 `stream_offset_gone`, not a malformed 400.
#[tokio::test]
async fn a_well_formed_offset_too_large_for_u64_is_beyond_the_head() {
    let server = Server::start().await;
    server.model.push(ScriptedReply::text("hi"));
    server.post("c1", json!({"kind": "user", "body": "hi"})).await;
    let head = server.settled("c1", 1).await["offset"].as_str().unwrap().to_owned();
    let response = server
        .client
        .get(server.url("/c1?view=updates&offset=0_99999999999999999999"))
        .send()
        .await
        .unwrap();
    let error = assert_error(response, 416, "stream_offset_gone").await;
    assert_eq!(error["meta"]["offset"], "0_99999999999999999999");
    assert_eq!(error["meta"]["nextOffset"], json!(head));
}

/// What a client can hold of a server: a stalled body, a stalled head, connections.
mod limits {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Reads what the server sends on `socket` until it closes the connection (or 10 s pass).
    async fn until_closed(socket: &mut tokio::net::TcpStream) -> String {
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), socket.read_to_end(&mut answer))
            .await
            .expect("the server closes the connection")
            .unwrap();
        String::from_utf8_lossy(&answer).into_owned()
    }

    /// The status of `GET /agents` on a connection of its own.
    async fn catalog_status(server: &Server) -> reqwest::StatusCode {
        let response = server.client.get(format!("{}/agents", server.root)).send().await;
        response.unwrap().status()
    }

    fn root(server: &Server) -> String {
        server.root.trim_start_matches("http://").to_owned()
    }

    /// A client that sends part of a message's body and stalls is answered 408, and the
    /// message is not admitted.
    #[tokio::test]
    async fn a_body_that_stalls_is_answered_408_request_timeout() {
        let server = Server::start_with(HttpOptions {
            request_body_timeout: Duration::from_millis(300),
            ..HttpOptions::default()
        })
        .await;
        let mut socket = tokio::net::TcpStream::connect(root(&server)).await.unwrap();
        let head = format!(
            "POST /agents/calculator/slow HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"kind\":\"user\",",
            root(&server)
        );
        socket.write_all(head.as_bytes()).await.unwrap();
        let answer = until_closed(&mut socket).await;
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains("\"type\":\"request_timeout\""), "{answer}");
        let response = server.get("/slow").await;
        assert_eq!(response.status(), 404, "nothing was admitted");
    }

    /// The body timeout is between reads, not for the whole body: a large body on a slow
    /// link that keeps arriving is admitted however long it takes.
    #[tokio::test]
    async fn a_body_that_keeps_arriving_slowly_is_admitted() {
        let server = Server::start_with(HttpOptions {
            request_body_timeout: Duration::from_millis(300),
            ..HttpOptions::default()
        })
        .await;
        let mut socket = tokio::net::TcpStream::connect(root(&server)).await.unwrap();
        let body = format!("{{\"kind\":\"user\",\"body\":\"{}\"}}", "x".repeat(2000));
        let head = format!(
            "POST /agents/calculator/trickle HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            root(&server),
            body.len()
        );
        socket.write_all(head.as_bytes()).await.unwrap();
        // About a second in all, a part every 100 ms.
        for part in body.as_bytes().chunks(body.len() / 10 + 1) {
            socket.write_all(part).await.unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let answer = until_closed(&mut socket).await;
        assert!(answer.starts_with("HTTP/1.1 202"), "{answer}");
    }

    /// The bodies being read together have a bound, taken as their bytes arrive: a client
    /// that declares a large body and sends it slowly holds only what it sent, and does not
    /// keep other messages out; a body whose bytes find no room left is answered 503
    /// `server_busy` at once. A body that keeps arriving but not all of it within the body
    /// deadline is answered 408, and its room freed: the next body is admitted.
    #[tokio::test]
    async fn bodies_past_the_room_for_buffered_bodies_are_refused_and_a_trickling_one_is_cut_off() {
        let server = Server::start_with(HttpOptions {
            request_body_timeout: Duration::from_secs(1),
            request_body_deadline: Duration::from_secs(4),
            // Clamped up to room for one body of the largest size.
            max_buffered_request_bytes: 0,
            ..HttpOptions::default()
        })
        .await;
        // Declares the largest body, and sends a byte every 200 ms: it never stalls, and
        // never ends. Meanwhile other messages are admitted.
        let trickle = |instance: &'static str, first: usize| {
            let root = root(&server);
            async move {
                let socket = tokio::net::TcpStream::connect(&root).await.unwrap();
                let (answer, mut sending) = socket.into_split();
                let head = format!(
                    "POST /agents/calculator/{instance} HTTP/1.1\r\nHost: {root}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                    flue_runtime::http::MAX_BODY_BYTES
                );
                sending.write_all(head.as_bytes()).await.unwrap();
                sending.write_all(&vec![b' '; first]).await.unwrap();
                tokio::spawn(async move {
                    while sending.write_all(b" ").await.is_ok() {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                });
                answer
            }
        };
        let _slow = trickle("slow", 0).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let admitted = server
            .post("beside", json!({"kind": "user", "body": "x".repeat(200)}))
            .await;
        assert_eq!(admitted.status(), 202, "a slow body holds only what it sent");
        // A body that has sent all but a few hundred bytes of the room, then trickles.
        let mut hog = trickle("hog", flue_runtime::http::MAX_BODY_BYTES - 300).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let refused = server
            .post("refused", json!({"kind": "user", "body": "x".repeat(2000)}))
            .await;
        assert_eq!(refused.status(), 503);
        assert_eq!(refused.headers()["retry-after"], "1");
        let body: serde_json::Value = refused.json().await.unwrap();
        assert_eq!(body["error"]["type"], "server_busy", "{body}");
        let mut said = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), hog.read_to_end(&mut said))
            .await
            .expect("the server closes the connection")
            .unwrap();
        let said = String::from_utf8_lossy(&said);
        assert!(said.starts_with("HTTP/1.1 408"), "{said}");
        assert!(said.contains("took too long"), "{said}");
        let admitted = server
            .post("after", json!({"kind": "user", "body": "x".repeat(2000)}))
            .await;
        assert_eq!(admitted.status(), 202);
    }

    /// Initial data takes room for what it holds parsed, not only for its text: dense JSON
    /// (many small arrays) parses to many times its bytes, and a message carrying it finds no
    /// room where its text alone would have found some; once the room is free, it is admitted.
    #[tokio::test]
    async fn initial_data_and_signal_attributes_take_room_for_what_they_hold_parsed() {
        let server = Server::start_with(HttpOptions {
            request_body_timeout: Duration::from_secs(1),
            request_body_deadline: Duration::from_secs(3),
            // Clamped up to room for one body of the largest size.
            max_buffered_request_bytes: 0,
            ..HttpOptions::default()
        })
        .await;
        // A body holding all but 3 MiB of the room, trickling on until its deadline.
        let root = root(&server);
        let socket = tokio::net::TcpStream::connect(&root).await.unwrap();
        let (mut hog, mut sending) = socket.into_split();
        let head = format!(
            "POST /agents/calculator/hog HTTP/1.1\r\nHost: {root}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            flue_runtime::http::MAX_BODY_BYTES
        );
        sending.write_all(head.as_bytes()).await.unwrap();
        sending
            .write_all(&vec![b' '; flue_runtime::http::MAX_BODY_BYTES - (3 << 20)])
            .await
            .unwrap();
        tokio::spawn(async move {
            while sending.write_all(b" ").await.is_ok() {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        // 80,000 empty arrays: 240 KB of text, about 4 MB parsed. A signal of 80,000 empty
        // attributes: 960 KB of text, about 5 MB parsed.
        let dense = json!({"kind": "user", "body": "hi", "initialData": {"rows": vec![json!([]); 80_000]}});
        let attributes: serde_json::Map<String, serde_json::Value> =
            (0..80_000).map(|n| (format!("a{n:05}"), json!(""))).collect();
        let signal = json!({"kind": "signal", "type": "note", "body": "", "attributes": attributes});
        for dense in [&dense, &signal] {
            let refused = server.post("dense", dense.clone()).await;
            assert_eq!(refused.status(), 503);
            let body: serde_json::Value = refused.json().await.unwrap();
            assert_eq!(body["error"]["type"], "server_busy", "{body}");
        }
        // As long a text without initial data finds room.
        let admitted = server
            .post("plain", json!({"kind": "user", "body": "x".repeat(240_000)}))
            .await;
        assert_eq!(admitted.status(), 202);
        // The hog is cut off at its deadline, and its room freed.
        let mut said = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), hog.read_to_end(&mut said))
            .await
            .expect("the server closes the connection")
            .unwrap();
        assert!(String::from_utf8_lossy(&said).starts_with("HTTP/1.1 408"));
        for dense in [dense, signal] {
            let later = server.post("dense", dense).await;
            assert_ne!(later.status(), 503, "{:?}", later.text().await);
        }
    }

    /// A body declaring a length past the body limit is refused at once, before any of it is
    /// read (or room taken for it).
    #[tokio::test]
    async fn a_body_declaring_more_than_the_limit_is_refused_before_it_is_read() {
        let server = Server::start().await;
        let mut socket = tokio::net::TcpStream::connect(root(&server)).await.unwrap();
        let head = format!(
            "POST /agents/calculator/huge HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            root(&server),
            flue_runtime::http::MAX_BODY_BYTES + 1
        );
        socket.write_all(head.as_bytes()).await.unwrap();
        let answer = until_closed(&mut socket).await;
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    }

    /// `max_connections: usize::MAX` caps nothing (a semaphore counts less: it is clamped).
    #[tokio::test]
    async fn the_largest_connection_cap_serves() {
        let server = Server::start_with(HttpOptions {
            max_connections: usize::MAX,
            ..HttpOptions::default()
        })
        .await;
        assert_eq!(catalog_status(&server).await, 200);
    }

    /// A connection that sends part of a request head and stalls is closed.
    #[tokio::test]
    async fn a_head_that_stalls_closes_the_connection() {
        let server = Server::start_with(HttpOptions {
            request_head_timeout: Duration::from_millis(300),
            ..HttpOptions::default()
        })
        .await;
        let mut socket = tokio::net::TcpStream::connect(root(&server)).await.unwrap();
        socket.write_all(b"GET /agents HTTP/1.1\r\nHost: loc").await.unwrap();
        let answer = until_closed(&mut socket).await;
        assert!(!answer.contains("200 OK"), "{answer}");
        // The server serves on.
        assert_eq!(catalog_status(&server).await, 200);
    }

    /// Past `max_connections`, a client waits until a connection closes, then is served.
    #[tokio::test]
    async fn a_connection_past_the_cap_waits_for_one_to_close() {
        let server = Server::start_with(HttpOptions {
            max_connections: 1,
            ..HttpOptions::default()
        })
        .await;
        let mut holder = tokio::net::TcpStream::connect(root(&server)).await.unwrap();
        holder.write_all(b"GET /agents HTTP/1.1\r\nHost: loc").await.unwrap();
        let client = reqwest::Client::new();
        let waiting = tokio::spawn({
            let url = format!("{}/agents", server.root);
            async move { client.get(url).send().await.unwrap().status() }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished(), "served while the only connection was taken");
        drop(holder);
        let status = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("served once the connection closed")
            .unwrap();
        assert_eq!(status, 200);
    }
}

mod random_input {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    use super::*;

    /// Bodies of every shape: JSON values near the message shape, arbitrary bytes, text.
    fn bodies() -> impl Strategy<Value = (Option<&'static str>, Vec<u8>)> {
        let key = prop::sample::select(vec![
            "kind",
            "body",
            "type",
            "uid",
            "initialData",
            "idempotencyKey",
            "attachments",
            "tagName",
            "attributes",
        ]);
        let scalar = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[a-z_ ]{0,12}".prop_map(Value::from),
            prop::sample::select(vec!["user", "signal", "resources", "image"]).prop_map(Value::from),
        ];
        let value = scalar.prop_recursive(3, 24, 4, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                prop::collection::btree_map(key.clone().prop_map(str::to_owned), inner, 0..5)
                    .prop_map(|map| Value::Object(map.into_iter().collect())),
            ]
        });
        let content_type = prop::sample::select(vec![
            Some("application/json"),
            Some("text/plain"),
            Some("application/json; charset=utf-8"),
            None,
        ]);
        prop_oneof![
            (
                content_type.clone(),
                value.prop_map(|value| value.to_string().into_bytes())
            ),
            (content_type, prop::collection::vec(any::<u8>(), 0..64)),
        ]
    }

    /// Query strings from the protocol's words and noise.
    fn queries() -> impl Strategy<Value = String> {
        let name = prop::sample::select(vec!["view", "offset", "live", "tail", "wait", "x"]);
        let value = prop_oneof![
            prop::sample::select(vec![
                "history",
                "updates",
                "-1",
                "0_0",
                "0000000000000000_0000000000000002",
                "9_99999999999999999999",
                "long-poll",
                "sse",
                "",
                "%ZZ",
                "now",
            ])
            .prop_map(str::to_owned),
            "[ -~]{0,10}",
        ];
        prop::collection::vec((name, value), 0..4).prop_map(|pairs| {
            pairs
                .into_iter()
                .map(|(name, value)| format!("{name}={value}"))
                .collect::<Vec<_>>()
                .join("&")
        })
    }

    #[test]
    fn random_bodies_and_queries_on_every_route_never_get_a_5xx_and_errors_are_enveloped() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let server = runtime.block_on(async {
            let server = Server::start_with(HttpOptions {
                long_poll_timeout: Duration::from_millis(20),
                ..HttpOptions::default()
            })
            .await;
            server.model.push(ScriptedReply::text("hi"));
            server.post("c1", json!({"kind": "user", "body": "hi"})).await;
            server.settled("c1", 1).await;
            server
        });
        let methods = prop::sample::select(vec!["GET", "POST", "HEAD", "PUT", "DELETE", "PATCH"]);
        let paths = prop::sample::select(vec!["/c1", "/c2", "/c1/abort", "/c1/attachments/att_x", "/%20", "/"]);
        let mut runner = TestRunner::new(Config {
            cases: 256,
            ..Config::default()
        });
        runner
            .run(
                &(methods, paths, queries(), bodies()),
                |(method, path, query, (content_type, body))| {
                    let (status, content_type_back, envelope) = runtime.block_on(async {
                        // Long-poll and SSE reads on the head would wait: keep those out.
                        let query = query.replace("live=", "live_=");
                        let mut request = server
                            .client
                            .request(method.parse().unwrap(), format!("{}{path}?{query}", server.url("")))
                            .body(body);
                        if let Some(content_type) = content_type {
                            request = request.header("content-type", content_type);
                        }
                        let response = request.send().await.unwrap();
                        let status = response.status().as_u16();
                        let content_type = header(response.headers(), "content-type").to_owned();
                        assert_security_headers(response.headers());
                        let bytes = response.bytes().await.unwrap();
                        (status, content_type, serde_json::from_slice::<Value>(&bytes).ok())
                    });
                    prop_assert!(status < 500, "{method} {path}?{query} answered {status}");
                    if status >= 400 && method != "HEAD" {
                        prop_assert_eq!(content_type_back.as_str(), "application/json");
                        let envelope = envelope.unwrap_or_default();
                        prop_assert!(
                            envelope["error"]["type"].is_string(),
                            "{} {}: {}",
                            method,
                            path,
                            envelope
                        );
                    }
                    Ok(())
                },
            )
            .unwrap();
    }
}

#[tokio::test]
async fn the_catalog_lists_agents_with_tool_schemas_hooks_and_parent_hook_requirements() {
    let server = Server::start().await;
    let (status, headers, catalog) = {
        let response = server
            .client
            .get(format!("{}/agents", server.root))
            .send()
            .await
            .unwrap();
        let (status, headers) = (response.status().as_u16(), response.headers().clone());
        (status, headers, response.json::<Value>().await.unwrap())
    };
    assert_eq!(status, 200);
    assert_security_headers(&headers);
    let agents = catalog["agents"].as_array().unwrap();
    let names: Vec<&str> = agents.iter().map(|agent| agent["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "calculator",
            "curator",
            "mail_agent",
            "planner",
            "slow_worker",
            "stuck_worker"
        ]
    );
    let calc = &agents[0];
    assert_eq!(calc["maxSteps"], 4);
    assert_eq!(calc["model"], "scripted/calc-1");
    let tool = &calc["tools"][0];
    assert_eq!(
        (tool["name"].as_str(), tool["description"].as_str()),
        (Some("add"), Some("Add two numbers."))
    );
    assert_eq!(tool["inputSchema"]["type"], "object");
    assert_eq!(tool["inputSchema"]["properties"]["a"]["description"], "First addend");
    let mail = &agents[2];
    assert_eq!(mail["description"], "Reads the mailbox.");
    assert_eq!(mail["exposeAsTool"], true);
    assert_eq!(mail["hooks"], json!([{"id": "keep_recent", "kind": "filter_messages"}]));
    assert_eq!(
        mail["parentHooks"],
        json!([{"hook": "mail_context", "kind": "after_system_message", "stage": "before_parent",
                "reason": "Shows new mail to the coordinator."}])
    );
}

mod access_control {
    use flue_runtime::http::{Access, BearerTokens};

    use super::*;

    async fn authorized_server() -> Server {
        let tokens = BearerTokens::new()
            .allow("token-alice", Access::IdPrefix("alice:".into()))
            .allow("token-bob", Access::instances("calculator", ["bob:1"]))
            .allow("token-admin", Access::All);
        Server::start_with(HttpOptions::default().authorized_by(tokens)).await
    }

    async fn as_user(
        server: &Server,
        token: Option<&str>,
        method: reqwest::Method,
        tail: &str,
        body: Option<Value>,
    ) -> reqwest::Response {
        let mut request = server.client.request(method, server.url(tail));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        request.send().await.unwrap()
    }

    #[tokio::test]
    async fn one_user_cannot_read_or_write_another_users_instance() {
        use reqwest::Method;
        let server = authorized_server().await;
        server.model.push(ScriptedReply::text("hello alice"));
        let message = json!({"kind": "user", "body": "hi"});
        let admitted = as_user(
            &server,
            Some("token-alice"),
            Method::POST,
            "/alice:1",
            Some(message.clone()),
        )
        .await;
        assert_eq!(admitted.status().as_u16(), 202);
        for _ in 0..500 {
            let response = as_user(&server, Some("token-alice"), Method::GET, "/alice:1", None).await;
            let snapshot: Value = response.json().await.unwrap();
            if !snapshot["settlements"].as_array().unwrap().is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        // Bob reaches neither Alice's history, updates, head, abort nor attachments, and cannot write.
        for (method, tail, body) in [
            (Method::GET, "/alice:1", None),
            (Method::GET, "/alice:1?view=updates&offset=-1", None),
            (Method::HEAD, "/alice:1", None),
            (Method::POST, "/alice:1", Some(message.clone())),
            (Method::POST, "/alice:1/abort", None),
            (Method::GET, "/alice:1/attachments/att_x", None),
            // The thread's live events (an allowed request would stream without end: the
            // refusal comes first).
            (Method::GET, "/alice:1/events", None),
        ] {
            let response = as_user(&server, Some("token-bob"), method.clone(), tail, body).await;
            if method == Method::HEAD {
                assert_eq!(response.status().as_u16(), 403, "{tail}");
            } else {
                assert_error(response, 403, "forbidden").await;
            }
        }
        // Without a token, or with an unknown one: 401 with the challenge.
        for token in [None, Some("token-mallory")] {
            let response = as_user(&server, token, Method::GET, "/alice:1", None).await;
            assert_eq!(header(response.headers(), "www-authenticate"), "Bearer");
            assert_error(response, 401, "unauthorized").await;
        }
        let basic = server
            .client
            .get(server.url("/alice:1"))
            .basic_auth("alice", Some("secret"))
            .send()
            .await
            .unwrap();
        assert_error(basic, 401, "unauthorized").await;

        // Bob's own instance works; Alice's token does not reach it; the admin's reaches both.
        server.model.push(ScriptedReply::text("hello bob"));
        let own = as_user(
            &server,
            Some("token-bob"),
            Method::POST,
            "/bob:1",
            Some(message.clone()),
        )
        .await;
        assert_eq!(own.status().as_u16(), 202);
        let other = as_user(&server, Some("token-alice"), Method::GET, "/bob:1", None).await;
        assert_error(other, 403, "forbidden").await;
        let admin = as_user(&server, Some("token-admin"), Method::GET, "/alice:1", None).await;
        assert_eq!(admin.status().as_u16(), 200);
        // Any valid token reads the catalog.
        let catalog = server
            .client
            .get(format!("{}/agents", server.root))
            .bearer_auth("token-bob")
            .send()
            .await
            .unwrap();
        assert_eq!(catalog.status().as_u16(), 200);
        let anonymous = server
            .client
            .get(format!("{}/agents", server.root))
            .send()
            .await
            .unwrap();
        assert_error(anonymous, 401, "unauthorized").await;
        // A stranger cannot tell a registered agent's paths from others': all are 401.
        for (method, path) in [
            (Method::GET, "/agents/calculator/x"),
            (Method::GET, "/agents/nosuch/x"),
            (Method::POST, "/agents/calculator/"),
            (Method::POST, "/agents/nosuch/"),
            (Method::GET, "/elsewhere"),
        ] {
            let response = server
                .client
                .request(method, format!("{}{path}", server.root))
                .send()
                .await
                .unwrap();
            assert_error(response, 401, "unauthorized").await;
        }
        // With a token, an unknown route is one.
        let unknown = server
            .client
            .get(format!("{}/agents/nosuch/x", server.root))
            .bearer_auth("token-bob")
            .send()
            .await
            .unwrap();
        assert_error(unknown, 404, "route_not_found").await;
        // Nothing Bob or a stranger sent reached the model.
        assert_eq!(server.model.requests().len(), 2);
    }
}

mod client {
    use flue_runtime::client::{Client, ClientError, Receipt};

    use super::*;

    #[tokio::test]
    async fn prompt_returns_the_reply_the_runtime_produced() {
        let server = Server::start().await;
        server.script_exchange("2 + 3 = 5");
        let client = Client::new(&server.root).unwrap();
        let calc = client.instance("calculator", "c1");
        let reply = calc.prompt("2+3?").await.unwrap();
        assert_eq!(reply.text, "2 + 3 = 5");
        let history = calc.history().await.unwrap();
        assert_eq!(history["settlements"][0]["submissionId"], json!(reply.submission_id));
        // A second prompt reads only its own reply.
        server.model.push(ScriptedReply::text("Again: 5."));
        assert_eq!(calc.prompt("once more").await.unwrap().text, "Again: 5.");
        assert!(!calc.abort().await.unwrap());
    }

    /// A message sent while a response runs joins it and is answered by it: its reply is the
    /// whole response, what it said before the join included. It is read from the history
    /// snapshot and the stream after it, as a replayed message's is: not by following the
    /// stream from its start, whose old events (here a long message; a reset of a long
    /// conversation's history) may be larger than the client reads as one event.
    #[tokio::test]
    async fn the_reply_of_a_joined_message_is_its_hosts_whole_response() {
        let server = Server::start().await;
        server.model.push(ScriptedReply::text("Read it."));
        let roomy = Client::new(&server.root).unwrap();
        let long = "a long message ".repeat(4096);
        assert_eq!(
            roomy
                .instance("slow_worker", "w1")
                .prompt(long.as_str())
                .await
                .unwrap()
                .text,
            "Read it."
        );
        server.model.push(ScriptedReply::ToolCalls {
            text: "Looking it up.".into(),
            calls: vec![("slow_lookup".into(), "{}".into())],
        });
        server.model.push(ScriptedReply::text("Found it."));
        let client = Client::new(&server.root).unwrap().with_max_event_bytes(16 * 1024);
        assert!(
            matches!(
                client
                    .instance("slow_worker", "w1")
                    .follow("-1")
                    .collect::<Vec<_>>()
                    .await
                    .last(),
                Some(Err(ClientError::Protocol(_)))
            ),
            "the long message's event is more than this client reads as one"
        );
        let worker = client.instance("slow_worker", "w1");
        let host = worker.send("find it").await.unwrap();
        while server.model.requests().is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let joined = worker.send("and quickly").await.unwrap();
        RELEASE_LOOKUP.notify_one();
        let reply = worker.reply(&joined).await.unwrap();
        assert_eq!(reply.submission_id, joined.submission_id);
        assert_eq!(reply.text, "Looking it up.\n\nFound it.");
        assert_eq!(worker.reply(&host).await.unwrap().text, reply.text);
        let history = worker.history().await.unwrap();
        assert_eq!(
            history["settlements"][1]["answeredBySubmissionId"],
            json!(host.submission_id),
            "{history}"
        );
        // A replayed admission (an idempotency key sent again) has no offset of its own.
        server.model.push(ScriptedReply::text("Once."));
        let keyed = json!({"kind": "user", "body": "once", "idempotencyKey": "k-once"});
        let first = worker.send_json(keyed.clone()).await.unwrap();
        assert_eq!(worker.reply(&first).await.unwrap().text, "Once.");
        let replay = worker.send_json(keyed).await.unwrap();
        assert!(replay.deduplicated);
        let replayed = worker.reply(&replay).await.unwrap();
        assert_eq!(
            (replayed.submission_id.as_str(), replayed.text.as_str()),
            (first.submission_id.as_str(), "Once.")
        );
    }

    /// A server that accepts the connection and never answers does not hold a caller forever.
    #[tokio::test]
    async fn a_request_the_server_never_answers_fails_after_the_request_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let held = tokio::spawn(async move {
            let mut sockets = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                sockets.push(socket);
            }
        });
        let client = Client::new(format!("http://{addr}"))
            .unwrap()
            .with_request_timeout(Duration::from_millis(200));
        let instance = client.instance("calculator", "c1");
        // Without the bound each call would wait for good: a guard, not a measurement.
        tokio::time::timeout(Duration::from_secs(60), async {
            assert!(matches!(instance.history().await, Err(ClientError::Transport(_))));
            assert!(matches!(instance.send("hi").await, Err(ClientError::Transport(_))));
            assert!(matches!(client.catalog().await, Err(ClientError::Transport(_))));
        })
        .await
        .expect("a call the server never answered waited for good");
        held.abort();
    }

    #[tokio::test]
    async fn the_client_reads_the_catalog_and_sends_its_bearer_token() {
        use flue_runtime::http::{Access, BearerTokens};
        let tokens = BearerTokens::new().allow("secret", Access::IdPrefix("mine-".into()));
        let server = Server::start_with(HttpOptions::default().authorized_by(tokens)).await;
        server.model.push(ScriptedReply::text("authorized"));
        let anonymous = Client::new(&server.root).unwrap();
        assert!(matches!(
            anonymous.catalog().await,
            Err(ClientError::Api { status: 401, .. })
        ));
        let client = Client::new(&server.root).unwrap().with_bearer_token("secret");
        let catalog = client.catalog().await.unwrap();
        assert_eq!(catalog["agents"][0]["name"], "calculator");
        assert_eq!(
            client.instance("calculator", "mine-1").prompt("hi").await.unwrap().text,
            "authorized"
        );
        let refused = client.instance("calculator", "theirs").send("hi").await;
        assert!(
            matches!(refused, Err(ClientError::Api { status: 403, .. })),
            "{refused:?}"
        );
        // Instance ids are path segments: any text round-trips.
        server.model.push(ScriptedReply::text("odd id"));
        let odd = client.instance("calculator", "mine-a b/c?d");
        assert_eq!(odd.prompt("hi").await.unwrap().text, "odd id");
        assert_eq!(
            odd.history().await.unwrap()["conversationId"],
            "agents/calculator/mine-a b/c?d"
        );
    }

    /// A prompt whose message was admitted but whose reply could not be read fails with the
    /// receipt: the reply is read again by it, not by sending the message twice.
    #[tokio::test]
    async fn a_prompt_admitted_but_not_answered_fails_with_its_receipt() {
        let server = Server::start().await;
        server.script_exchange("2 + 3 = 5");
        // Every event of the stream is larger than this client reads as one.
        let cramped = Client::new(&server.root).unwrap().with_max_event_bytes(64);
        let (receipt, error) = match cramped.instance("calculator", "u1").prompt("2+3?").await {
            Err(ClientError::Unanswered { receipt, error }) => (receipt, error),
            other => panic!("expected the receipt with the error, got {other:?}"),
        };
        assert!(matches!(*error, ClientError::Protocol(_)), "{error:?}");
        let roomy = Client::new(&server.root).unwrap();
        let reply = roomy.instance("calculator", "u1").reply(&receipt).await.unwrap();
        assert_eq!(
            (reply.submission_id.as_str(), reply.text.as_str()),
            (receipt.submission_id.as_str(), "2 + 3 = 5")
        );
        let history = roomy.instance("calculator", "u1").history().await.unwrap();
        assert_eq!(history["settlements"].as_array().unwrap().len(), 1, "sent once");
    }

    /// A receipt names its instance's incarnation: read against another (the instance made
    /// again, or the server's store replaced), a reply ends with `StreamReplaced`, where it
    /// waited for ever for a submission that stream never settles (a longer stream) or was
    /// told its offset was past the end (a shorter one).
    #[tokio::test]
    async fn a_reply_read_in_another_incarnation_of_its_instance_says_the_stream_was_replaced() {
        let (first, second) = (Server::start().await, Server::start().await);
        first.script_exchange("one");
        let on_first = Client::new(&first.root).unwrap().instance("calculator", "r1");
        let short = on_first.send("hi").await.unwrap();
        assert_eq!(on_first.reply(&short).await.unwrap().text, "one");
        let on_second = Client::new(&second.root).unwrap().instance("calculator", "r1");
        let mut long = None;
        for answer in ["two", "three"] {
            second.script_exchange(answer);
            let receipt = on_second.send("hi").await.unwrap();
            assert_eq!(on_second.reply(&receipt).await.unwrap().text, answer);
            long = Some(receipt);
        }
        let long = long.unwrap();
        assert_ne!(short.uid, long.uid);
        for (name, instance, receipt) in [
            ("the longer stream", &on_second, &short),
            ("the shorter stream", &on_first, &long),
        ] {
            let replayed = Receipt {
                deduplicated: true,
                ..receipt.clone()
            };
            for receipt in [receipt, &replayed] {
                let read = tokio::time::timeout(Duration::from_secs(10), instance.reply(receipt))
                    .await
                    .unwrap_or_else(|_| panic!("{name}: the reply waited for a settlement that never comes"));
                assert!(
                    matches!(&read, Err(ClientError::StreamReplaced { previous, .. }) if *previous == receipt.uid),
                    "{name} (deduplicated: {}): {read:?}",
                    receipt.deduplicated
                );
            }
        }
    }

    #[tokio::test]
    async fn a_failed_submission_and_a_refused_request_are_errors_with_their_types() {
        let server = Server::start().await;
        // No scripted reply: the model call fails and the submission settles failed.
        let client = Client::new(&server.root).unwrap();
        let calc = client.instance("calculator", "c1");
        match calc.prompt("2+3?").await {
            Err(ClientError::Settled { outcome, error, .. }) => {
                assert_eq!(
                    (outcome.as_str(), error.error_type.as_str()),
                    ("failed", "operation_failed")
                );
                assert_eq!(
                    error.meta.unwrap()["operation"],
                    "prompt",
                    "the settlement's meta reaches the caller"
                );
            }
            other => panic!("expected a failed settlement, got {other:?}"),
        }
        match calc.send(flue_runtime::prelude::Signal::new("resources", "x")).await {
            Err(ClientError::Api { status, error_type, .. }) => {
                assert_eq!((status, error_type.as_str()), (400, "invalid_request"))
            }
            other => panic!("expected the envelope, got {other:?}"),
        }
        let missing = client.instance("calculator", "never").history().await;
        assert!(
            matches!(missing, Err(ClientError::Api { status: 404, .. })),
            "{missing:?}"
        );
    }

    /// A loopback proxy to `upstream` that cuts its first `cut` connections after `after` bytes
    /// from the server.
    async fn flaky_proxy(
        upstream: String,
        cut: usize,
        after: usize,
    ) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (mut inbound, _) = listener.accept().await.unwrap();
                let connections = counter.fetch_add(1, Ordering::SeqCst) + 1;
                let limit = (connections <= cut).then_some(after);
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    let mut outbound = tokio::net::TcpStream::connect(upstream).await.unwrap();
                    let (mut in_read, mut in_write) = inbound.split();
                    let (mut out_read, mut out_write) = outbound.split();
                    let to_server = tokio::io::copy(&mut in_read, &mut out_write);
                    let to_client = async {
                        let mut sent = 0usize;
                        let mut buffer = vec![0u8; 512];
                        loop {
                            let n = out_read.read(&mut buffer).await.unwrap_or(0);
                            if n == 0 {
                                return;
                            }
                            let n = limit.map_or(n, |limit| n.min(limit.saturating_sub(sent)));
                            if in_write.write_all(&buffer[..n]).await.is_err() {
                                return;
                            }
                            sent += n;
                            if limit.is_some_and(|limit| sent >= limit) {
                                return;
                            }
                        }
                    };
                    tokio::select! {
                        _ = to_server => {}
                        () = to_client => {}
                    }
                });
            }
        });
        (format!("http://{addr}"), accepted)
    }

    #[tokio::test]
    async fn following_resumes_after_a_dropped_connection_and_delivers_each_chunk_once_in_order() {
        let server = Server::start().await;
        for answer in ["one", "two", "three"] {
            server.script_exchange(answer);
            server.post("c1", json!({"kind": "user", "body": answer})).await;
            server
                .settled(
                    "c1",
                    ["one", "two", "three"].iter().position(|a| *a == answer).unwrap() + 1,
                )
                .await;
        }
        let (_, _, all) = server.get_json("/c1?view=updates&offset=-1").await;
        let expected: Vec<Value> = all.as_array().unwrap()[1..].to_vec();

        // Every connection of the first three is cut mid-frame (after 700 bytes of the response).
        let upstream = server.root.trim_start_matches("http://").to_owned();
        let (proxy, connections) = flaky_proxy(upstream, 3, 700).await;
        let client = Client::new(&proxy).unwrap();
        let mut chunks = client.instance("calculator", "c1").follow("-1");
        let mut received = Vec::new();
        while received.len() < expected.len() {
            let chunk = tokio::time::timeout(Duration::from_secs(20), chunks.next())
                .await
                .expect("chunks keep coming")
                .unwrap()
                .unwrap();
            received.push(chunk);
        }
        assert_eq!(received, expected, "each chunk once, in order");
        assert!(
            connections.load(std::sync::atomic::Ordering::SeqCst) >= 4,
            "three connections were cut and resumed"
        );
    }
}

#[tokio::test]
async fn the_thread_event_stream_carries_tool_call_started_emitted_events_and_done_for_its_instance_only() {
    let server = Server::start().await;
    let response = server.client.get(server.url("/c1/events")).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(header(response.headers(), "content-type"), "text/event-stream");
    assert_security_headers(response.headers());
    let reader = tokio::spawn(sse_frames(response, |frames| {
        frames.iter().any(|(_, data)| data.contains("tool_call_done"))
    }));
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Another instance's tools do not reach this stream.
    server.script_exchange("elsewhere");
    server.post("other", json!({"kind": "user", "body": "2+3?"})).await;
    server.settled("other", 1).await;
    server.script_exchange("2 + 3 = 5");
    server.post("c1", json!({"kind": "user", "body": "2+3?"})).await;
    let frames = reader.await.unwrap();
    let events: Vec<Value> = frames
        .iter()
        .filter(|(event, _)| event == "event")
        .map(|(_, data)| serde_json::from_str(data).unwrap())
        .collect();
    assert_eq!(events.len(), 3, "{events:?}");
    assert_eq!(events[0]["type"], "event");
    assert_eq!(events[0]["eventType"], "tool_call_started");
    assert_eq!(events[0]["data"]["name"], "add");
    assert_eq!(events[0]["data"]["progress"], Value::Null);
    // What the tool sent with ThreadState::emit, as it ran.
    assert_eq!(events[1]["type"], "event");
    assert_eq!(events[1]["eventType"], "computed");
    assert_eq!(events[1]["data"], json!({"sum": 5}));
    assert_eq!(events[2]["eventType"], "tool_call_done");
    assert_eq!(events[2]["data"]["status"], "success");
    assert_eq!(events[0]["data"]["id"], events[2]["data"]["id"]);
    assert!(events[2]["timestamp"].is_string());
}

#[tokio::test]
async fn the_trace_headers_of_an_admission_are_carried_on_its_submission() {
    let server = Server::start().await;
    server.model.push(ScriptedReply::text("traced"));
    server.model.push(ScriptedReply::text("untraced"));
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let traced: Value = server
        .client
        .post(server.url("/c1"))
        .header("traceparent", parent)
        .header("tracestate", "vendor=1")
        .json(&json!({"kind": "user", "body": "hi"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let row = server
        .runtime
        .store()
        .submission(traced["submissionId"].as_str().unwrap())
        .await
        .unwrap()
        .unwrap();
    let trace = row.trace.unwrap();
    assert_eq!(
        (trace.traceparent.as_str(), trace.tracestate.as_deref()),
        (parent, Some("vendor=1"))
    );
    // A malformed traceparent is ignored, not refused.
    let untraced = server
        .client
        .post(server.url("/c1"))
        .header("traceparent", "not-a-trace")
        .json(&json!({"kind": "user", "body": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(untraced.status().as_u16(), 202);
    let untraced: Value = untraced.json().await.unwrap();
    let row = server
        .runtime
        .store()
        .submission(untraced["submissionId"].as_str().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.trace, None);
}

#[tokio::test]
async fn an_updates_read_covers_at_most_100_batches_and_is_up_to_date_only_at_the_head() {
    let server = Server::start().await;
    // Each text exchange appends its input, its step and its settlement: 34 exchanges and the
    // birth record make 103 batches.
    for n in 0..34 {
        server.model.push(ScriptedReply::text(format!("answer {n}")));
        server
            .post("long", json!({"kind": "user", "body": format!("question {n}")}))
            .await;
        server.settled("long", n + 1).await;
    }
    let (_, headers, body) = server.get_json("/long?view=updates&offset=-1").await;
    let chunks = &body.as_array().unwrap()[1..];
    let batches: std::collections::BTreeSet<u64> = chunks
        .iter()
        .map(|chunk| chunk["position"]["batch"].as_u64().unwrap())
        .collect();
    assert_eq!(batches.len(), 100, "one read covers 100 batches");
    assert!(
        headers.get("stream-up-to-date").is_none(),
        "not at the head: the header is absent, never false"
    );
    let next = header(&headers, "stream-next-offset").to_owned();
    assert_eq!(next, format!("0000000000000000_{:016}", batches.last().unwrap()));
    let (_, headers, body) = server.get_json(&format!("/long?view=updates&offset={next}")).await;
    assert_eq!(header(&headers, "stream-up-to-date"), "true");
    let rest: std::collections::BTreeSet<u64> = body.as_array().unwrap()[1..]
        .iter()
        .map(|chunk| chunk["position"]["batch"].as_u64().unwrap())
        .collect();
    assert_eq!(rest.len(), 3, "the rest, up to the head");
}

#[tokio::test]
async fn a_runtime_that_is_shutting_down_answers_503_with_retry_after() {
    let server = Server::start().await;
    server.runtime.shutdown();
    let response = server.post("c1", json!({"kind": "user", "body": "hi"})).await;
    assert_eq!(header(response.headers(), "retry-after"), "1");
    let error = assert_error(response, 503, "runtime_unavailable").await;
    assert_eq!(error["meta"], json!({"state": "draining"}));
}

#[tokio::test]
async fn sse_readers_joining_at_any_offset_while_the_instance_works_see_exactly_the_canonical_chunks() {
    let server = std::sync::Arc::new(
        Server::start_with(HttpOptions {
            heartbeat: Duration::from_millis(50),
            ..HttpOptions::default()
        })
        .await,
    );
    server.script_exchange("warm");
    server.post("busy", json!({"kind": "user", "body": "warm"})).await;
    server.settled("busy", 1).await;
    let exchanges = 6;
    // Set once every exchange settled: each reader reads until its stream reaches it.
    let final_head: std::sync::Arc<Mutex<Option<String>>> = std::sync::Arc::default();
    // Readers from the start, from the head, and from offsets in between, joining while the
    // instance answers more messages: the shared feed serves those that caught up.
    let mut readers = Vec::new();
    for n in 0..12 {
        let (_, _, head) = server.get_json("/busy?view=updates&offset=-1").await;
        let chunks = head.as_array().unwrap();
        let batch = |chunk: &Value| chunk["position"]["batch"].as_u64().unwrap();
        let offset = match n % 3 {
            0 => "-1".to_owned(),
            1 => format!("0000000000000000_{:016}", batch(chunks.last().unwrap())),
            _ => format!("0000000000000000_{:016}", batch(&chunks[chunks.len() / 2])),
        };
        let response = server
            .client
            .get(server.url(&format!("/busy?view=updates&offset={offset}&live=sse")))
            .send()
            .await
            .unwrap();
        let final_head = final_head.clone();
        readers.push((
            offset,
            tokio::spawn(sse_frames(response, move |frames| {
                let Some(head) = final_head.lock().unwrap().clone() else {
                    return false;
                };
                frames
                    .iter()
                    .any(|(event, data)| event == "control" && data.contains(&format!("\"{head}\"")))
            })),
        ));
        if n % 2 == 1 {
            let k = n / 2;
            server.script_exchange(&format!("a{k}"));
            server
                .post("busy", json!({"kind": "user", "body": format!("q{k}")}))
                .await;
        }
    }
    let head = server.settled("busy", exchanges + 1).await["offset"]
        .as_str()
        .unwrap()
        .to_owned();
    *final_head.lock().unwrap() = Some(head);
    for (offset, reader) in readers {
        let frames = tokio::time::timeout(Duration::from_secs(20), reader)
            .await
            .unwrap()
            .unwrap();
        let received: Vec<Value> = frames
            .iter()
            .filter(|(event, data)| event == "data" && !data.contains("stream-checkpoint"))
            .flat_map(|(_, data)| serde_json::from_str::<Vec<Value>>(data).unwrap())
            .collect();
        let (_, _, canonical) = server.get_json(&format!("/busy?view=updates&offset={offset}")).await;
        assert_eq!(
            received,
            canonical.as_array().unwrap()[1..].to_vec(),
            "reader from {offset}"
        );
    }
}

/// Two nodes on one Postgres database: an SSE reader of node A sees what node B appends (no
/// local wake-up reaches A: its shared feed polls the store).
#[cfg(feature = "postgres")]
#[tokio::test]
async fn an_sse_reader_on_one_node_sees_batches_another_node_appends() {
    use flue_runtime::store::PostgresStore;
    let Some(url) = harness::postgres_url("the two-node SSE test") else {
        return;
    };
    let schema = harness::fresh_schema("flue_test");
    let node = |model: &ScriptedModel| {
        let (url, schema, model) = (url.clone(), schema.clone(), model.clone());
        async move {
            let mut providers = ProviderRegistry::new();
            providers.register(model);
            Runtime::builder()
                .store(PostgresStore::connect_with_schema(&url, &schema).await.unwrap())
                .providers(providers)
                .agent(calculator)
                .build()
                .unwrap()
        }
    };
    let (model_a, model_b) = (ScriptedModel::new([]), ScriptedModel::new([]));
    let (a, b) = (node(&model_a).await, node(&model_b).await);
    let app = flue_runtime::http::router_with(
        &a,
        HttpOptions {
            shared_store_poll: Duration::from_millis(50),
            ..HttpOptions::default()
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    model_b.push(ScriptedReply::text("one"));
    let on_b = b.init(&calculator, "shared");
    on_b.send("first").await.unwrap();
    let client = reqwest::Client::new();
    let head = client
        .head(format!("http://{addr}/agents/calculator/shared"))
        .send()
        .await
        .unwrap()
        .headers()["stream-next-offset"]
        .to_str()
        .unwrap()
        .to_owned();
    let response = client
        .get(format!(
            "http://{addr}/agents/calculator/shared?view=updates&offset={head}&live=sse"
        ))
        .send()
        .await
        .unwrap();
    let reader = tokio::spawn(sse_frames(response, |frames| {
        frames
            .iter()
            .any(|(event, data)| event == "data" && data.contains("submission-settled"))
    }));
    tokio::time::sleep(Duration::from_millis(100)).await;
    model_b.push(ScriptedReply::text("two"));
    on_b.send("second").await.unwrap();
    let frames = tokio::time::timeout(Duration::from_secs(20), reader)
        .await
        .unwrap()
        .unwrap();
    let chunks: Vec<Value> = frames
        .iter()
        .filter(|(event, data)| event == "data" && !data.contains("stream-checkpoint"))
        .flat_map(|(_, data)| serde_json::from_str::<Vec<Value>>(data).unwrap())
        .collect();
    assert_eq!(chunks[0]["message"]["parts"][0]["text"], "second");
    assert!(model_a.requests().is_empty(), "node A only served the stream");
}

#[tokio::test]
async fn a_body_without_a_declared_length_or_type_is_no_message_and_binary_text_is_unsupported() {
    let server = Server::start().await;
    // Streamed (chunked) without a content type: nothing declares a body, so there is no message.
    let stream = futures_util::stream::iter([Ok::<_, std::io::Error>(bytes::Bytes::from_static(
        b"{\"kind\":\"user\"}",
    ))]);
    let chunked = server
        .client
        .post(server.url("/c1"))
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .unwrap();
    assert_error(chunked, 400, "invalid_request").await;
    // Bytes that are not UTF-8, sent as text: the type is refused before the bytes are read.
    let binary = server
        .client
        .post(server.url("/c1"))
        .header("content-type", "application/octet-stream")
        .body(vec![0xff, 0xfe, 0x00, 0x01])
        .send()
        .await
        .unwrap();
    assert_error(binary, 415, "unsupported_media_type").await;
    let invalid = server
        .client
        .post(server.url("/c1"))
        .header("content-type", "application/json")
        .body(vec![0xff, 0xfe])
        .send()
        .await
        .unwrap();
    assert_error(invalid, 400, "invalid_json").await;
}

#[tokio::test]
async fn joined_deliveries_signals_and_failures_project_as_the_protocol_says() {
    let server = Server::start().await;
    let planner_url = server.url("/p1").replace("calculator", "planner");
    server
        .model
        .push(ScriptedReply::tool_call("schedule_follow_up", json!({})));
    server.model.push(ScriptedReply::text("Planned, follow-up handled."));
    let receipt: Value = server
        .client
        .post(&planner_url)
        .json(&json!({"kind": "user", "body": "plan my week"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut snapshot = Value::Null;
    for _ in 0..500 {
        snapshot = server
            .client
            .get(&planner_url)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if snapshot["settlements"].as_array().map_or(0, Vec::len) >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let settlements = snapshot["settlements"].as_array().unwrap();
    assert_eq!(settlements.len(), 2, "{snapshot}");
    // The joined delivery settles first, answered by its host's response.
    let host = receipt["submissionId"].as_str().unwrap();
    assert_ne!(settlements[0]["submissionId"], host);
    assert_eq!(settlements[0]["answeredBySubmissionId"], host);
    assert_eq!(settlements[1]["submissionId"], host);
    assert!(settlements[1].get("answeredBySubmissionId").is_none());
    // The delivered signal and the one its start callback appended: system messages of the
    // dispatch purpose, shown as diagnostics, with their tag name and attributes (none: no
    // `signal`), never their type (reference §4.6).
    let signals: Vec<&Value> = snapshot["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|message| message["purpose"] == "dispatch")
        .collect();
    assert_eq!(signals.len(), 2, "{snapshot}");
    assert_eq!(signals[0]["signal"], json!({"tagName": "follow-up"}));
    for signal in &signals {
        assert_eq!(
            (signal["role"].as_str(), signal["display"].as_str()),
            (Some("system"), Some("diagnostic"))
        );
    }
    assert_eq!(signals[0]["parts"][0]["text"], "check the invoice");
    assert_eq!(signals[1]["parts"][0]["text"], "The follow-up joined.");
    assert!(signals[1].get("signal").is_none(), "{}", signals[1]);
    // Still one assistant message for the whole response.
    let assistants = snapshot["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|message| message["role"] == "assistant")
        .count();
    assert_eq!(assistants, 1);

    // A failed submission's settlement carries its error, on the wire and in the snapshot.
    let failing = server
        .post("f1", json!({"kind": "user", "body": "no reply scripted"}))
        .await;
    assert_eq!(failing.status().as_u16(), 202);
    let snapshot = server.settled("f1", 1).await;
    let settlement = &snapshot["settlements"][0];
    assert_eq!(settlement["outcome"], "failed");
    // The reference's shape: `{type, name, message, details, meta?}`.
    let error = &settlement["error"];
    assert_eq!(
        (
            error["type"].as_str(),
            error["name"].as_str(),
            error["details"].as_str()
        ),
        (Some("operation_failed"), Some("OperationFailedError"), Some("")),
        "{settlement}"
    );
    let reason = error["meta"]["reason"].as_str().unwrap();
    assert_eq!(error["meta"]["operation"], "prompt");
    assert_eq!(error["message"], format!("prompt failed: {reason}"));
    let (_, _, updates) = server.get_json("/f1?view=updates&offset=-1").await;
    let settled = updates
        .as_array()
        .unwrap()
        .iter()
        .find(|chunk| chunk["type"] == "submission-settled")
        .unwrap();
    assert_eq!(settled["error"], settlement["error"]);
}

#[tokio::test]
async fn rows_a_thread_state_injects_updates_and_deletes_project_into_the_snapshot_and_reset_the_updates() {
    let server = Server::start().await;
    let base = format!("{}/agents/curator", server.root);
    server.model.push(ScriptedReply::tool_call("curate", json!({})));
    server.model.push(ScriptedReply::text("tidied"));
    let admitted = server
        .client
        .post(format!("{base}/t1"))
        .json(&json!({"kind": "user", "body": "orignal qestion"}))
        .send()
        .await
        .unwrap();
    assert_eq!(admitted.status().as_u16(), 202);
    let snapshot = wait_settled(&server, &base, "t1", 1).await;
    let messages = snapshot["messages"].as_array().unwrap();
    assert_eq!(messages[0]["role"], "user");
    assert_eq!(messages[0]["parts"][0]["text"], "corrected question", "{snapshot}");
    let note = messages
        .iter()
        .find(|message| message["parts"][0]["text"] == "a note")
        .unwrap_or_else(|| panic!("the injected note: {snapshot}"));
    assert_eq!(note["role"], "assistant");
    assert_eq!(note["display"], "visible");
    // The batch that edited a past row projects to a reset carrying the new snapshot.
    let updates: Value = server
        .client
        .get(format!("{base}/t1?view=updates&offset=-1"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let resets: Vec<&Value> = updates
        .as_array()
        .unwrap()
        .iter()
        .filter(|chunk| chunk["type"] == "conversation-reset")
        .collect();
    assert_eq!(resets.len(), 2, "the birth and the edit: {updates}");
    assert_eq!(
        resets[1]["snapshot"]["messages"][0]["parts"][0]["text"],
        "corrected question"
    );

    // Deleting the note removes it from the snapshot.
    let note_id = note["id"].as_str().unwrap().to_owned();
    server
        .model
        .push(ScriptedReply::tool_call("forget", json!({"id": note_id})));
    server.model.push(ScriptedReply::text("forgotten"));
    server
        .client
        .post(format!("{base}/t1"))
        .json(&json!({"kind": "user", "body": "forget the note"}))
        .send()
        .await
        .unwrap();
    let snapshot = wait_settled(&server, &base, "t1", 2).await;
    assert!(
        !snapshot["messages"]
            .as_array()
            .unwrap()
            .iter()
            .any(|message| message["id"] == note_id.as_str()),
        "{snapshot}"
    );
}

async fn wait_settled(server: &Server, base: &str, id: &str, count: usize) -> Value {
    for _ in 0..500 {
        let response = server.client.get(format!("{base}/{id}")).send().await.unwrap();
        if response.status().as_u16() == 200 {
            let snapshot: Value = response.json().await.unwrap();
            if snapshot["settlements"].as_array().map_or(0, Vec::len) >= count {
                return snapshot;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{count} submissions of {id} did not settle");
}

#[tokio::test]
async fn a_user_stream_says_ready_carries_that_users_events_and_runs_the_attach_and_detach_hooks() {
    let server = Server::start().await;
    let url = format!("{}/users/u-7/events?client_id=tab-1&client_kind=web", server.root);
    let response = server.client.get(&url).header("accept", SSE).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(header(response.headers(), "content-type"), "text/event-stream");
    assert_security_headers(response.headers());
    let runtime = server.runtime.clone();
    let reader = tokio::spawn(sse_frames(response, |frames| {
        frames.iter().any(|(_, data)| data.contains("\"notice\""))
    }));
    // The attach hook's own emit arrives, then what the application emits for this user only.
    for _ in 0..500 {
        if CLIENTS
            .lock()
            .unwrap()
            .iter()
            .any(|line| line.starts_with("u-7 + tab-1"))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    runtime.user("someone-else").emit("notice", json!({"n": 0}));
    runtime.user("u-7").emit("notice", json!({"n": 1}));
    let frames: Vec<Value> = reader
        .await
        .unwrap()
        .into_iter()
        .filter(|(event, _)| !event.starts_with(':'))
        .map(|(_, data)| serde_json::from_str(&data).unwrap())
        .collect();
    assert_eq!(
        frames,
        [
            json!({"event": "stream_ready", "data": {"client_id": "tab-1"}}),
            json!({"event": "welcome", "data": {"client": "tab-1"}}),
            json!({"event": "notice", "data": {"n": 1}}),
        ]
    );
    // The reader dropped the connection: the detach hook runs.
    for _ in 0..500 {
        if CLIENTS.lock().unwrap().iter().any(|line| line == "u-7 - tab-1") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let clients = CLIENTS.lock().unwrap().clone();
    assert!(clients.contains(&"u-7 + tab-1 Some(\"web\")".to_owned()), "{clients:?}");
    assert!(clients.contains(&"u-7 - tab-1".to_owned()), "{clients:?}");
}

#[tokio::test]
async fn a_user_token_reaches_its_own_user_stream_and_instances_and_nothing_else() {
    use flue_runtime::http::{Access, BearerTokens};
    let tokens = BearerTokens::new()
        .allow("u7-token", Access::User("u-7".into()))
        .allow("instance-token", Access::instances("calculator", ["c1"]));
    let server = Server::start_with(HttpOptions::default().authorized_by(tokens)).await;
    let get = |path: String, token: &'static str| {
        let request = server
            .client
            .get(format!("{}{path}", server.root))
            .bearer_auth(token)
            .header("accept", SSE);
        async move { request.send().await.unwrap() }
    };
    let own = get("/users/u-7/events".into(), "u7-token").await;
    assert_eq!(own.status().as_u16(), 200);
    drop(own);
    // A client with a bearer token is no page's element: it need not ask for a stream.
    let bare = server
        .client
        .get(format!("{}/users/u-7/events", server.root))
        .bearer_auth("u7-token")
        .send()
        .await
        .unwrap();
    assert_eq!(bare.status().as_u16(), 200);
    drop(bare);
    assert_error(get("/users/u-8/events".into(), "u7-token").await, 403, "forbidden").await;
    assert_error(
        get("/users/u-7/events".into(), "instance-token").await,
        403,
        "forbidden",
    )
    .await;
    let unauthenticated = server
        .client
        .get(format!("{}/users/u-7/events", server.root))
        .header("accept", SSE)
        .send()
        .await
        .unwrap();
    assert_error(unauthenticated, 401, "unauthorized").await;
    // The user's namespace of instances: `u-7:…`.
    let instance = get("/agents/calculator/u-7:notes".into(), "u7-token").await;
    assert_eq!(instance.status().as_u16(), 404, "reached (not found yet), not refused");
    assert_error(
        get("/agents/calculator/u-8:notes".into(), "u7-token").await,
        403,
        "forbidden",
    )
    .await;
}

#[tokio::test]
async fn a_user_id_with_a_colon_reaches_its_events_but_no_instance_namespace() {
    use flue_runtime::http::{Access, BearerTokens};
    // `u:admin`'s namespace `u:admin:…` would lie inside user `u`'s, so it has none: an id
    // `u:admin:notes` is user `u`'s instance `admin:notes`.
    let tokens = BearerTokens::new()
        .allow("u-token", Access::User("u".into()))
        .allow("admin-token", Access::User("u:admin".into()));
    let server = Server::start_with(HttpOptions::default().authorized_by(tokens)).await;
    let get = |path: &str, token: &'static str| {
        let request = server
            .client
            .get(format!("{}{path}", server.root))
            .bearer_auth(token)
            .header("accept", SSE);
        async move { request.send().await.unwrap() }
    };
    for path in ["/agents/calculator/u:notes", "/agents/calculator/u:admin:notes"] {
        let reached = get(path, "u-token").await;
        assert_eq!(
            reached.status().as_u16(),
            404,
            "{path}: reached (not found yet), not refused"
        );
    }
    assert_error(
        get("/agents/calculator/u:admin:notes", "admin-token").await,
        403,
        "forbidden",
    )
    .await;
    let events = get("/users/u:admin/events", "admin-token").await;
    assert_eq!(events.status().as_u16(), 200);
}

#[tokio::test]
async fn a_compaction_projects_to_a_conversation_reset_with_the_summary_in_the_snapshot() {
    use flue_runtime::provider::{ProviderError, ProviderErrorKind};
    let server = Server::start().await;
    server.model.push(ScriptedReply::text("first answer"));
    server.admit("k1", "a long first question").await;
    server.settled("k1", 1).await;
    // The next call overflows: the history is summarized and the call retried.
    server.model.push(ScriptedReply::Error(ProviderError::new(
        ProviderErrorKind::ContextOverflow,
        "prompt is too long",
    )));
    server
        .model
        .push(ScriptedReply::text("Summary: one question, answered."));
    server.model.push(ScriptedReply::text("second answer"));
    server.admit("k1", "and another").await;
    let snapshot = server.settled("k1", 2).await;
    let summary = snapshot["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|message| message["signal"]["tagName"] == "conversation-summary")
        .unwrap_or_else(|| panic!("the summary message: {snapshot}"));
    assert_eq!(summary["parts"][0]["text"], "Summary: one question, answered.");
    assert_eq!(summary["signal"]["attributes"]["reason"], "overflow");
    let (_, _, updates) = server.get_json("/k1?view=updates&offset=-1").await;
    let resets = updates
        .as_array()
        .unwrap()
        .iter()
        .filter(|chunk| chunk["type"] == "conversation-reset")
        .count();
    assert_eq!(resets, 2, "the birth and the compaction: {updates}");
}

#[tokio::test]
async fn a_followed_stream_the_server_refuses_ends_with_the_error() {
    let server = Server::start().await;
    let client = flue_runtime::client::Client::new(&server.root).unwrap();
    let mut chunks = client.instance("calculator", "never-contacted").follow("-1");
    let first = chunks.next().await.unwrap();
    assert!(
        matches!(first, Err(flue_runtime::client::ClientError::Api { status: 404, .. })),
        "{first:?}"
    );
    // The refusal stays a refusal: the stream ends rather than asking again and again.
    let next = tokio::time::timeout(Duration::from_secs(2), chunks.next())
        .await
        .expect("the stream ends after the refusal");
    assert!(next.is_none(), "{next:?}");
}

/// A loopback server answering every connection with `answers[n]` (the last one again once
/// they run out); its base URL and how many connections it took.
async fn answering(answers: Vec<&'static str>) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let connections = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = connections.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let n = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let answer = answers[n.min(answers.len() - 1)];
            let mut request = [0u8; 4096];
            let _ = socket.read(&mut request).await;
            let _ = socket.write_all(answer.as_bytes()).await;
        }
    });
    (base, connections)
}

/// Follows an instance on a server answering `answers` (see [`answering`]): the stream's first
/// item (guarded against a hang, not timed), the stream, and the server's connection count.
async fn follow_answering(
    answers: Vec<&'static str>,
) -> (
    Option<Result<Value, flue_runtime::client::ClientError>>,
    flue_runtime::client::Chunks,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    let (base, connections) = answering(answers).await;
    let client = flue_runtime::client::Client::new(base).unwrap();
    let mut chunks = client.instance("assistant", "i").follow("-1");
    let first = tokio::time::timeout(Duration::from_secs(30), chunks.next())
        .await
        .expect("the stream ends");
    (first, chunks, connections)
}

/// What a wrong base URL answers (a page, not the protocol) ends a followed stream with a
/// protocol error at once, rather than reconnecting forever.
#[tokio::test]
async fn a_followed_stream_answered_with_something_not_the_protocol_ends_at_once() {
    for answer in [
        "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: 13\r\nconnection: close\r\n\r\n<html></html>",
        "HTTP/1.1 404 Not Found\r\ncontent-type: text/html\r\ncontent-length: 13\r\nconnection: close\r\n\r\n<html></html>",
    ] {
        let (first, mut chunks, connections) = follow_answering(vec![answer]).await;
        assert!(
            matches!(&first, Some(Err(flue_runtime::client::ClientError::Protocol(message))) if message.contains("base URL")),
            "{first:?}"
        );
        assert!(chunks.next().await.is_none());
        assert_eq!(connections.load(std::sync::atomic::Ordering::SeqCst), 1, "asked once");
    }
}

/// A rate limit or a request timeout passes: the follower asks again after a pause.
#[tokio::test]
async fn a_followed_stream_answered_429_asks_again() {
    const LIMITED: &str = "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: 47\r\nconnection: close\r\n\r\n{\"error\":{\"type\":\"rate_limited\",\"message\":\"x\"}}";
    const REFUSED: &str = "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 51\r\nconnection: close\r\n\r\n{\"error\":{\"type\":\"stream_not_found\",\"message\":\"x\"}}";
    // A rate limit without the protocol's envelope (a proxy's page) passes too.
    const LIMITED_PAGE: &str = "HTTP/1.1 429 Too Many Requests\r\ncontent-type: text/html\r\ncontent-length: 13\r\nconnection: close\r\n\r\n<html></html>";
    let (first, _, connections) = follow_answering(vec![LIMITED, LIMITED_PAGE, REFUSED]).await;
    assert!(
        matches!(
            first,
            Some(Err(flue_runtime::client::ClientError::Api { status: 404, .. }))
        ),
        "{first:?}"
    );
    assert_eq!(
        connections.load(std::sync::atomic::Ordering::SeqCst),
        3,
        "two 429s, then the refusal"
    );
}

#[tokio::test]
async fn a_follower_reconnects_when_a_connection_goes_silent() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let accepted = connections.clone();
    tokio::spawn(async move {
        // Held open and silent, as a connection a network dropped without a reset is.
        let mut silent = Vec::new();
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 4096];
            let _ = socket.read(&mut request).await.unwrap();
            let nth = accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut body = String::from(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n\
                 event: data\ndata:[{\"type\":\"stream-checkpoint\",\"incarnation\":\"inc_1\"}]\n\n",
            );
            if nth > 0 {
                body.push_str(
                    "event: data\ndata:[{\"type\":\"message-completed\",\"messageId\":\"m\",\
                     \"position\":{\"batch\":1,\"index\":0}}]\n\n\
                     event: control\ndata:{\"streamNextOffset\":\"0000000000000000_0000000000000001\",\"upToDate\":true}\n\n",
                );
            }
            socket.write_all(body.as_bytes()).await.unwrap();
            silent.push(socket);
        }
    });
    let client = flue_runtime::client::Client::new(format!("http://{addr}"))
        .unwrap()
        .with_idle_timeout(Duration::from_millis(300));
    let mut chunks = client.instance("calculator", "k1").follow("-1");
    let chunk = tokio::time::timeout(Duration::from_secs(5), chunks.next())
        .await
        .expect("a silent connection is given up and the stream read again")
        .unwrap()
        .unwrap();
    assert_eq!(chunk["type"], "message-completed");
    assert_eq!(connections.load(std::sync::atomic::Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_reply_keeps_what_its_response_said_before_a_compaction_reset() {
    use flue_runtime::provider::{ProviderError, ProviderErrorKind};
    let server = Server::start().await;
    // The first step says something and calls a tool; the next call overflows: the history is
    // summarized (a conversation-reset on the stream) and the call retried.
    server.model.push(ScriptedReply::ToolCalls {
        text: "Let me add.".into(),
        calls: vec![("add".into(), json!({"a": 2, "b": 3}).to_string())],
    });
    server.model.push(ScriptedReply::Error(ProviderError::new(
        ProviderErrorKind::ContextOverflow,
        "prompt is too long",
    )));
    server.model.push(ScriptedReply::text("Summary: adding."));
    server.model.push(ScriptedReply::text("The sum is 5."));
    let client = flue_runtime::client::Client::new(&server.root).unwrap();
    let reply = tokio::time::timeout(
        Duration::from_secs(10),
        client.instance("calculator", "k1").prompt("What is 2 + 3?"),
    )
    .await
    .unwrap()
    .unwrap();
    let (_, _, updates) = server.get_json("/k1?view=updates&offset=-1").await;
    let resets = types(updates.as_array().unwrap())
        .iter()
        .filter(|kind| **kind == "conversation-reset")
        .count();
    assert_eq!(resets, 2, "the birth and the compaction: {updates}");
    assert_eq!(reply.text, "Let me add.\n\nThe sum is 5.");
}

#[tokio::test]
async fn a_follower_catching_up_on_big_batches_gets_past_them() {
    let server = Server::start().await;
    // Two messages whose chunks together pass what one SSE event may hold on this client
    // (16 MiB), each well under it: one frame of both would end the follow.
    let big = "x".repeat(9 * 1024 * 1024);
    for _ in 0..2 {
        server.model.push(ScriptedReply::text("ok"));
        server.admit("k1", &big).await;
    }
    server.settled("k1", 2).await;
    let client = flue_runtime::client::Client::new(&server.root)
        .unwrap()
        .with_max_event_bytes(16 * 1024 * 1024);
    let mut chunks = client.instance("calculator", "k1").follow("-1");
    let mut settled = 0;
    while settled < 2 {
        let chunk = tokio::time::timeout(Duration::from_secs(20), chunks.next())
            .await
            .expect("the follower gets past the big batches")
            .unwrap()
            .unwrap();
        if chunk["type"] == "submission-settled" {
            settled += 1;
        }
    }
}

#[tokio::test]
async fn a_follower_reconnects_when_a_server_never_answers() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut silent = Vec::new();
        for nth in 0.. {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 4096];
            let _ = socket.read(&mut request).await.unwrap();
            // The first connection is taken and never answered (a hung proxy or server).
            if nth > 0 {
                let body = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n\
                     event: data\ndata:[{\"type\":\"message-completed\",\"messageId\":\"m\",\
                     \"position\":{\"batch\":1,\"index\":0}}]\n\n";
                socket.write_all(body.as_bytes()).await.unwrap();
            }
            silent.push(socket);
        }
    });
    let client = flue_runtime::client::Client::new(format!("http://{addr}"))
        .unwrap()
        .with_idle_timeout(Duration::from_millis(300));
    let mut chunks = client.instance("calculator", "k1").follow("-1");
    let chunk = tokio::time::timeout(Duration::from_secs(5), chunks.next())
        .await
        .expect("an unanswered connection is given up and the stream asked for again")
        .unwrap()
        .unwrap();
    assert_eq!(chunk["type"], "message-completed");
}

/// A stub server answering every connection with the SSE `frames` and holding it open, so
/// that a second connection can only be the client's own reconnection; its URL and the count
/// of connections it took.
async fn sse_stub(frames: String) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let accepted = connections.clone();
    tokio::spawn(async move {
        let mut open = Vec::new();
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 4096];
            let _ = socket.read(&mut request).await.unwrap();
            accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let response =
                format!("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n{frames}");
            socket.write_all(response.as_bytes()).await.unwrap();
            open.push(socket);
        }
    });
    (format!("http://{addr}"), connections)
}

/// The next item of `chunks`, which must come within 5 s.
async fn next_within(
    chunks: &mut flue_runtime::client::Chunks,
    what: &str,
) -> Option<Result<Value, flue_runtime::client::ClientError>> {
    tokio::time::timeout(Duration::from_secs(5), chunks.next())
        .await
        .unwrap_or_else(|_| panic!("{what} within 5 s"))
}

/// Two chunks and the control frame confirming them, then `event`.
fn frames_then(event: &str) -> String {
    format!(
        "event: data\ndata:[{{\"type\":\"stream-checkpoint\",\"incarnation\":\"inc_1\"}},\
         {{\"type\":\"message-started\",\"messageId\":\"m\",\"position\":{{\"batch\":1,\"index\":0}}}},\
         {{\"type\":\"message-completed\",\"messageId\":\"m\",\"position\":{{\"batch\":1,\"index\":1}}}}]\n\n\
         event: control\ndata:{{\"streamNextOffset\":\"0000000000000000_0000000000000001\",\"upToDate\":false}}\n\n\
         {event}"
    )
}

/// Follows the stub serving `frames_then(event)`: the two chunks come, then the error (the
/// stream's last item, once), and the stream ends without reconnecting.
async fn assert_followed_event_ends_the_stream(
    client: flue_runtime::client::Client,
    connections: &std::sync::atomic::AtomicUsize,
    expected: &str,
) {
    let mut chunks = client.instance("calculator", "k1").follow("-1");
    for kind in ["message-started", "message-completed"] {
        let chunk = next_within(&mut chunks, "the chunks before the event")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(chunk["type"], kind);
    }
    match next_within(&mut chunks, "the error").await {
        Some(Err(flue_runtime::client::ClientError::Protocol(message))) => assert_eq!(message, expected),
        other => panic!("the protocol error, not {other:?}"),
    }
    let end = next_within(&mut chunks, "the end of the stream").await;
    assert!(end.is_none(), "{end:?}");
    assert_eq!(
        connections.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "no reconnection"
    );
}

#[tokio::test]
async fn a_followed_event_over_the_limit_ends_the_stream_with_an_error() {
    // A data part of 2,000 bytes: well under the default bound, over the client's 1,024.
    let big = format!(
        "event: data\ndata:[{{\"type\":\"data-part\",\"messageId\":\"m\",\"name\":\"blob\",\
         \"data\":\"{}\",\"position\":{{\"batch\":2,\"index\":0}}}}]\n\n",
        "x".repeat(2000)
    );
    let (root, connections) = sse_stub(frames_then(&big)).await;
    let client = flue_runtime::client::Client::new(root)
        .unwrap()
        .with_max_event_bytes(1024);
    assert_followed_event_ends_the_stream(
        client,
        &connections,
        "cannot read the stream after offset 0000000000000000_0000000000000001: \
         an event is larger than 1024 bytes",
    )
    .await;
}

#[tokio::test]
async fn a_followed_event_whose_data_is_not_json_ends_the_stream_with_an_error() {
    let (root, connections) = sse_stub(frames_then("event: data\ndata: [{not json\n\n")).await;
    let client = flue_runtime::client::Client::new(root).unwrap();
    assert_followed_event_ends_the_stream(
        client,
        &connections,
        "cannot read the stream after offset 0000000000000000_0000000000000001: \
         an event's data is not JSON (key must be a string at line 1 column 3)",
    )
    .await;
}

#[tokio::test]
async fn an_authorization_callback_sees_the_path_the_client_requested() {
    use flue_runtime::http::{AccessRequest, Denied};
    let paths = std::sync::Arc::new(Mutex::new(Vec::new()));
    let seen = paths.clone();
    // A policy written against the URLs clients use: the abort route is refused.
    let policy = move |request: &AccessRequest<'_>| {
        seen.lock().unwrap().push(request.path.to_owned());
        if request.path.ends_with("/abort") && request.path.starts_with("/agents/calculator/") {
            return Err(Denied::Forbidden("no aborts".into()));
        }
        Ok(())
    };
    let server = Server::start_with(HttpOptions::default().authorized_by(policy)).await;
    let response = server.client.post(server.url("/k1/abort")).send().await.unwrap();
    assert_error(response, 403, "forbidden").await;
    server.client.get(server.url("/k1")).send().await.unwrap();
    server
        .client
        .get(format!("{}/users/u1/events", server.root))
        .header("accept", SSE)
        .send()
        .await
        .unwrap();
    assert_eq!(
        *paths.lock().unwrap(),
        [
            "/agents/calculator/k1/abort",
            "/agents/calculator/k1",
            "/users/u1/events"
        ]
    );
}

#[tokio::test]
async fn a_head_request_on_a_user_stream_attaches_no_client() {
    let server = Server::start().await;
    let url = format!("{}/users/u-head/events?client_id=probe-1", server.root);
    let response = server.client.head(&url).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(header(response.headers(), "content-type"), "text/event-stream");
    assert_security_headers(response.headers());
    // The user's hooks run in order: once a reader's attach hook ran after the HEAD, one the
    // HEAD had started would have run too.
    let reader = server
        .client
        .get(format!("{}/users/u-head/events?client_id=probe-2", server.root))
        .header("accept", SSE)
        .send()
        .await
        .unwrap();
    assert_eq!(reader.status().as_u16(), 200);
    attach_hook_ran("u-head + probe-2 ").await;
    let clients = CLIENTS.lock().unwrap().clone();
    assert!(
        !clients.iter().any(|line| line.starts_with("u-head + probe-1 ")),
        "a HEAD is not a client: {clients:?}"
    );
    drop(reader);
    let response = server
        .client
        .head(format!("{}/users/%20/events", server.root))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    // Nor is a user id with a control character (no store takes a NUL).
    let response = server
        .client
        .get(format!("{}/users/u%00x/events", server.root))
        .header("accept", SSE)
        .send()
        .await
        .unwrap();
    assert_error(response, 400, "invalid_request").await;
    assert!(
        !CLIENTS.lock().unwrap().iter().any(|line| line.starts_with("u\0x ")),
        "no hook ran for it"
    );
}

#[tokio::test]
async fn a_body_past_the_limit_is_413_request_too_large() {
    let server = Server::start().await;
    let body = json!({"kind": "user", "body": "a".repeat(flue_runtime::http::MAX_BODY_BYTES)});
    let error = assert_error(server.post("big", body).await, 413, "request_too_large").await;
    assert!(error["details"].as_str().unwrap().contains("16777216"), "{error}");
    assert!(server.model.requests().is_empty());
}

/// A body streamed without a declared length is refused once what was read passes the
/// limit, not read to its end.
#[tokio::test]
async fn a_streamed_body_past_the_limit_is_413_request_too_large() {
    let server = Server::start().await;
    let chunk = bytes::Bytes::from(vec![b'a'; 1 << 20]);
    let head = bytes::Bytes::from_static(b"{\"kind\":\"user\",\"body\":\"");
    // 17 MiB of body text after the head, in 1 MiB chunks.
    let stream = futures_util::stream::iter(
        std::iter::once(head)
            .chain(std::iter::repeat_n(chunk, 17))
            .map(Ok::<_, std::io::Error>),
    );
    let response = server
        .client
        .post(server.url("/streamed"))
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .unwrap();
    let error = assert_error(response, 413, "request_too_large").await;
    assert!(error["details"].as_str().unwrap().contains("16777216"), "{error}");
    assert!(server.model.requests().is_empty());
    assert_eq!(server.get_json("/streamed").await.0, 404, "no instance was created");
}

#[tokio::test]
async fn a_body_whose_json_would_parse_past_the_value_limits_is_413_and_creates_nothing() {
    let server = Server::start().await;
    // Well under the byte limit, and about 70 MiB parsed: small objects cost far more memory
    // than their text.
    let records = vec![json!({"n": 0}); flue_runtime::MAX_JSON_CONTAINERS];
    let body = json!({"kind": "user", "body": "hi", "initialData": records});
    let error = assert_error(server.post("many", body).await, 413, "request_too_large").await;
    assert!(
        error["details"].as_str().unwrap().contains("100000 JSON objects"),
        "{error}"
    );
    assert!(server.model.requests().is_empty());
    assert_eq!(server.get_json("/many").await.0, 404, "no instance was created");
}

#[tokio::test]
async fn instance_ids_admission_refuses_are_400_to_admit_404_to_read_and_never_reach_the_store() {
    let server = Server::start().await;
    let long = "i".repeat(flue_runtime::MAX_INSTANCE_ID_CHARS + 1);
    for (id, says) in [
        ("a%00b", "control characters"),
        ("a%0Ab", "U+000A"),
        (long.as_str(), "at most 512"),
        ("acme%2Ftask_1", "separates a task's conversation"),
    ] {
        let error = assert_error(
            server.post(id, json!({"kind": "user", "body": "hi"})).await,
            400,
            "invalid_request",
        )
        .await;
        assert!(error["details"].as_str().unwrap().contains(says), "{id}: {error}");
        // A read of such an id is one of a stream never created (as the reference's, which
        // refuses only a blank id on reads).
        assert_error(server.get(&format!("/{id}")).await, 404, "stream_not_found").await;
        assert_error(server.get(&format!("/{id}/events")).await, 404, "stream_not_found").await;
        let head = server.client.head(server.url(&format!("/{id}"))).send().await.unwrap();
        assert_eq!(head.status().as_u16(), 404, "{id}");
        let attachment = server.get(&format!("/{id}/attachments/att_1")).await;
        assert_error(attachment, 404, "stream_not_found").await;
    }
    // The longest id and any other character are fine.
    let longest = "é".repeat(flue_runtime::MAX_INSTANCE_ID_CHARS);
    server.model.push(ScriptedReply::text("hi"));
    server.admit(&longest, "hi").await;
    server.model.push(ScriptedReply::text("hi"));
    server.admit("a%20b%E2%9C%93", "hi").await;
    // The store was asked about none of the refused ids (the runtime's own look answers
    // without it): it holds no instance of them.
    let store = server.runtime.store().clone();
    for id in ["a\0b", "a\nb", long.as_str(), "acme/task_1"] {
        let key = flue_runtime::store::InstanceKey::new("calculator", id);
        assert!(store.instance(&key).await.unwrap().is_none(), "{id:?}");
        assert!(store.read(&key, None).await.unwrap_or_default().is_empty(), "{id:?}");
    }
    let created = flue_runtime::store::InstanceKey::new("calculator", "a b\u{2713}");
    assert!(
        store.instance(&created).await.unwrap().is_some(),
        "the store answers for an id it holds"
    );
}

/// Idempotency keys are per instance: `x` with key `y\nz` and `x\ny` with key `z` once
/// met on one submission id (the second instance's first message answered 409 with the
/// first's submission). An id with a line break is refused now, and the keys' hash tells
/// such parts apart anyway (unit tests of `keyed_submission_id`).
#[tokio::test]
async fn idempotency_keys_of_instances_told_apart_by_a_line_break_never_meet() {
    let server = Server::start().await;
    let post = |id: &'static str, key: &'static str| {
        server.post(id, json!({"kind": "user", "body": "hello", "idempotencyKey": key}))
    };
    server.model.push(ScriptedReply::text("one"));
    let first = post("x", "y\nz").await;
    assert_eq!(first.status().as_u16(), 202);
    let first: Value = first.json().await.unwrap();
    let error = assert_error(post("x%0Ay", "z").await, 400, "invalid_request").await;
    assert!(
        error["details"].as_str().unwrap().contains("control characters"),
        "{error}"
    );
    let replay: Value = post("x", "y\nz").await.json().await.unwrap();
    assert_eq!(
        (replay["submissionId"].clone(), replay["deduplicated"].clone()),
        (first["submissionId"].clone(), json!(true))
    );
}

#[tokio::test]
async fn the_crates_client_follows_a_conversation_holding_a_message_at_the_body_limit() {
    let server = Server::start().await;
    server.model.push(ScriptedReply::text("ok"));
    // About the longest message a POST takes: the body limit less the JSON around the text
    // (the client's idempotency key included).
    let text = "a".repeat(flue_runtime::http::MAX_BODY_BYTES - 128);
    let client = flue_runtime::client::Client::new(&server.root).unwrap();
    let instance = client.instance("calculator", "big");
    instance.send(text.as_str()).await.expect("admitted");
    let mut chunks = instance.follow("-1");
    let mut seen = Vec::new();
    let settled = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.unwrap_or_else(|error| panic!("after {seen:?}: {error}"));
            seen.push(chunk["type"].as_str().unwrap_or_default().to_owned());
            if chunk["type"] == "submission-settled" {
                return true;
            }
        }
        false
    })
    .await
    .expect("the stream settles");
    assert!(settled, "the stream ended before the settlement");
}

/// A memory store whose admissions return a while after they commit: a client can go away
/// in between.
struct SlowAdmit {
    inner: MemoryStore,
}

impl flue_runtime::store::Store for SlowAdmit {
    harness::delegate_store!(
        inner;
        instance, submission, has_queued, claim_next, renew_leases, expired, reclaim,
        aborts_requested, instances_with_queued, claim_joinable, finalize_join, revert_joins, settle,
        requeue, request_abort, append, create_child, read, put_attachment, attachment, user_value,
        set_user_value, list_user_values,
    );

    fn admit(
        &self,
        admission: flue_runtime::store::Admission,
    ) -> flue_runtime::BoxFuture<'_, Result<flue_runtime::store::Admitted, flue_runtime::store::StoreError>> {
        Box::pin(async move {
            let admitted = self.inner.admit(admission).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            admitted
        })
    }
}

/// An admission the store committed is processed at once and reported queued, even when the
/// client closed its connection before the answer (the handler is then dropped mid-way).
#[tokio::test]
async fn an_admission_whose_client_went_away_after_the_commit_still_runs_at_once() {
    let model = ScriptedModel::new([ScriptedReply::text("5")]);
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    let store = MemoryStore::new();
    let runtime = Runtime::builder()
        .store(SlowAdmit { inner: store.clone() })
        .providers(providers)
        .agent(calculator)
        .build()
        .unwrap();
    let mut events = runtime.observe();
    let app = flue_runtime::http::router(&runtime);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let body = r#"{"kind":"user","body":"2+3?"}"#;
    let request = format!(
        "POST /agents/calculator/gone HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    {
        use tokio::io::AsyncWriteExt;
        let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
        socket.write_all(request.as_bytes()).await.unwrap();
        // Gone while the admission is still on its way back from the store.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let key = flue_runtime::store::InstanceKey::new("calculator", "gone");
    let mut settled = false;
    for _ in 0..200 {
        let submissions = flue_runtime::store::Store::read(&store, &key, None).await.unwrap();
        if submissions
            .iter()
            .flat_map(|batch| batch.records.iter())
            .any(|record| matches!(record.body, flue_runtime::record::RecordBody::SubmissionSettled { .. }))
        {
            settled = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(settled, "the admitted message waited for the next scan");
    let mut queued = false;
    while let Ok(observation) = events.try_recv() {
        queued |= matches!(observation.event, flue_runtime::events::Event::SubmissionQueued { .. });
    }
    assert!(queued, "submission_queued was not emitted");
}

/// Reference §4.7: a failure that is not the client's answers 500 `internal_error` with the
/// generic message (its cause stays in the log), under a reference `err_<ULID>` that the
/// body and the `flue-error-ref` header both carry.
#[tokio::test]
async fn a_store_failure_answers_the_generic_500_envelope_with_its_reference() {
    let store = harness::faulty::FaultyStore::default();
    let model = ScriptedModel::new([ScriptedReply::text("hello")]);
    let runtime = harness::runtime_on(store.clone(), &model, [calculator.into()]);
    runtime.init(&calculator, "c1").send("hi").await.unwrap();
    let app = flue_runtime::http::router(&runtime);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    store
        .failing_reads
        .store(usize::MAX, std::sync::atomic::Ordering::SeqCst);
    let response = reqwest::get(format!("http://{addr}/agents/calculator/c1"))
        .await
        .unwrap();
    let reference = header(response.headers(), "flue-error-ref").to_owned();
    let error = assert_error(response, 500, "internal_error").await;
    assert_eq!(error["message"], "An internal error occurred.");
    assert_eq!(error["details"], "");
    assert_eq!(error["ref"], reference.as_str());
    let ulid = reference.strip_prefix("err_").expect("an err_ reference");
    assert_eq!(ulid.len(), 26, "{reference}");
    assert!(
        ulid.chars().all(|c| c.is_ascii_digit() || c.is_ascii_uppercase()),
        "{reference}"
    );
    assert!(
        !error.to_string().contains("injected"),
        "the cause is not told: {error}"
    );
}

/// A memory store that, once told to, answers the next look-up of an instance and of its
/// stream's head as if neither existed yet: a read that starts just before the instance's
/// admission commits.
struct BornDuringTheRead {
    inner: MemoryStore,
    hide_instance: std::sync::Arc<std::sync::atomic::AtomicBool>,
    hide_head: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl flue_runtime::store::Store for BornDuringTheRead {
    harness::delegate_store!(
        inner;
        admit, submission, has_queued, claim_next, renew_leases, expired, reclaim,
        aborts_requested, instances_with_queued, claim_joinable, finalize_join, revert_joins, settle,
        requeue, request_abort, append, create_child, read, put_attachment, attachment, user_value,
        set_user_value, list_user_values,
    );

    fn instance(
        &self,
        key: &flue_runtime::store::InstanceKey,
    ) -> flue_runtime::BoxFuture<'_, Result<Option<flue_runtime::store::InstanceInfo>, flue_runtime::store::StoreError>>
    {
        if self.hide_instance.swap(false, std::sync::atomic::Ordering::SeqCst) {
            return Box::pin(std::future::ready(Ok(None)));
        }
        self.inner.instance(key)
    }

    fn last_offset(
        &self,
        key: &flue_runtime::store::InstanceKey,
    ) -> flue_runtime::BoxFuture<'_, Result<Option<u64>, flue_runtime::store::StoreError>> {
        if self.hide_head.swap(false, std::sync::atomic::Ordering::SeqCst) {
            return Box::pin(std::future::ready(Ok(None)));
        }
        self.inner.last_offset(key)
    }
}

/// A read that found no instance answers 404, even when the instance's admission commits
/// while it goes on. (Regression: it went on and served the new stream with an empty
/// incarnation, which a live reader keeps for the life of its stream.)
#[tokio::test]
async fn a_read_that_found_no_instance_answers_not_found_though_one_is_born_meanwhile() {
    let model = ScriptedModel::new([ScriptedReply::text("5")]);
    let (hide_instance, hide_head) = (
        std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false)),
        std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false)),
    );
    let store = BornDuringTheRead {
        inner: MemoryStore::new(),
        hide_instance: hide_instance.clone(),
        hide_head: hide_head.clone(),
    };
    let runtime = harness::runtime_on(store, &model, [calculator.into()]);
    runtime.init(&calculator, "born").send("2+3?").await.unwrap();
    let app = flue_runtime::http::router(&runtime);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let url = format!("http://{addr}/agents/calculator/born?view=updates&offset=-1");
    let client = reqwest::Client::new();
    let found = client.get(&url).send().await.unwrap();
    assert_eq!(found.status().as_u16(), 200);
    hide_instance.store(true, std::sync::atomic::Ordering::SeqCst);
    hide_head.store(true, std::sync::atomic::Ordering::SeqCst);
    let racing = client.get(&url).send().await.unwrap();
    let status = racing.status().as_u16();
    let body = racing.text().await.unwrap();
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("stream_not_found"), "{body}");
}
