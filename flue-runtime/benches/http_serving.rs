//! Serving benchmarks (issue: serving), on loopback:
//!
//! 1. Admissions per second over HTTP (`POST /:id`), 16 concurrent clients, each to its own
//!    instance, on the memory store and on SQLite; the agent answers at once (a model that
//!    streams nothing), so the instances' processing runs alongside.
//! 2. 1,000 concurrent SSE readers of one busy instance: each message's delivery latency,
//!    from just before its `POST` to a reader receiving its `message-appended` chunk (p50 and
//!    p99 over every reader and message), and the resident memory the readers add (server
//!    and the light raw-socket clients, one process).
//!
//! `cargo bench -p flue-runtime --bench http_serving`

use std::sync::Arc;
use std::time::{Duration, Instant};

use flue_runtime::prelude::*;
use flue_runtime::provider::{
    ModelProvider, ModelRequest, ModelResponse, ModelStream, ProviderRegistry, StopReason, StreamEvent,
};
use flue_runtime::{Runtime, RuntimeOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Answers "ok" at once.
struct AnswersOk;

impl ModelProvider for AnswersOk {
    fn id(&self) -> &str {
        "instant"
    }

    fn stream(&self, _request: &ModelRequest) -> ModelStream {
        let response = ModelResponse {
            text: "ok".into(),
            reasoning: String::new(),
            tool_calls: Vec::new(),
            stop_reason: StopReason::Stop,
            usage: Default::default(),
            reasoning_blocks: Vec::new(),
        };
        Box::pin(futures_util::stream::iter([Ok(StreamEvent::Completed(response))]))
    }
}

#[agent]
fn echo() -> &'static str {
    use_model("instant/ok");
    "Answer ok."
}

fn runtime(store: impl flue_runtime::store::Store) -> Runtime {
    let mut providers = ProviderRegistry::new();
    providers.register(AnswersOk);
    Runtime::builder()
        .store(store)
        .providers(providers)
        .agent(echo)
        .options(RuntimeOptions::default())
        .build()
        .expect("runtime")
}

async fn serve(runtime: &Runtime) -> String {
    let app = flue_runtime::http::router(runtime);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    format!("http://{addr}")
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|line| line.starts_with("VmRSS:"))
                .and_then(|line| line.split_whitespace().nth(1).and_then(|kib| kib.parse().ok()))
        })
        .unwrap_or(0)
}

fn percentile(sorted: &[Duration], fraction: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * fraction).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

async fn admissions(name: &str, runtime: Runtime) {
    let base = serve(&runtime).await;
    let client = reqwest::Client::new();
    let (clients, per_client) = (16usize, 250usize);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for worker in 0..clients {
        let (client, base) = (client.clone(), base.clone());
        tasks.push(tokio::spawn(async move {
            for n in 0..per_client {
                let response = client
                    .post(format!("{base}/agents/echo/load-{worker}"))
                    .json(&serde_json::json!({"kind": "user", "body": format!("message {n}")}))
                    .send()
                    .await
                    .expect("post");
                assert_eq!(response.status().as_u16(), 202);
            }
        }));
    }
    for task in tasks {
        task.await.expect("client");
    }
    let elapsed = started.elapsed();
    println!(
        "admissions over HTTP ({name}, {clients} clients): {:.0}/s ({} in {:.2} s)",
        (clients * per_client) as f64 / elapsed.as_secs_f64(),
        clients * per_client,
        elapsed.as_secs_f64()
    );
}

/// One raw-socket SSE reader: reports when it sees each message's `message-appended` chunk.
async fn reader(address: String, path: String, messages: usize, seen: Arc<Vec<std::sync::Mutex<Vec<Instant>>>>) {
    let mut stream = tokio::net::TcpStream::connect(&address).await.expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nAccept: text/event-stream\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("request");
    let mut buffer = vec![0u8; 16 * 1024];
    let mut text = String::new();
    let mut next = 0usize;
    while next < messages {
        let n = stream.read(&mut buffer).await.expect("read");
        if n == 0 {
            return;
        }
        text.push_str(&String::from_utf8_lossy(&buffer[..n]));
        while next < messages {
            let marker = format!("\"text\":\"bench-{next}\"");
            let Some(at) = text.find(&marker) else { break };
            seen[next].lock().expect("lock").push(Instant::now());
            text.drain(..at + marker.len());
            next += 1;
        }
        // Keep only a tail that may hold a marker's start.
        if text.len() > 64 * 1024 {
            let keep = text.len() - 256;
            text.drain(..keep);
        }
    }
}

async fn fan_out(readers: usize, messages: usize) {
    let runtime = runtime(flue_runtime::store::MemoryStore::new());
    let base = serve(&runtime).await;
    let address = base.trim_start_matches("http://").to_owned();
    let client = reqwest::Client::new();
    let response = client
        .post(format!("{base}/agents/echo/busy"))
        .json(&serde_json::json!({"kind": "user", "body": "warm up"}))
        .send()
        .await
        .expect("post");
    let offset = response.headers()["stream-next-offset"]
        .to_str()
        .expect("offset")
        .to_owned();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = rss_kib();
    let seen: Arc<Vec<std::sync::Mutex<Vec<Instant>>>> =
        Arc::new((0..messages).map(|_| std::sync::Mutex::new(Vec::new())).collect());
    let path = format!("/agents/echo/busy?view=updates&offset={offset}&live=sse");
    let mut tasks = Vec::new();
    for _ in 0..readers {
        tasks.push(tokio::spawn(reader(
            address.clone(),
            path.clone(),
            messages,
            seen.clone(),
        )));
    }
    // Let every reader connect and catch up.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let connected = rss_kib();
    let mut sent = Vec::new();
    for n in 0..messages {
        sent.push(Instant::now());
        client
            .post(format!("{base}/agents/echo/busy"))
            .json(&serde_json::json!({"kind": "user", "body": format!("bench-{n}")}))
            .send()
            .await
            .expect("post");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for task in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(30), task).await;
    }
    let mut latencies: Vec<Duration> = Vec::new();
    let mut missing = 0;
    for (n, seen) in seen.iter().enumerate() {
        let seen = seen.lock().expect("lock");
        missing += readers - seen.len();
        latencies.extend(seen.iter().map(|at| at.duration_since(sent[n])));
    }
    latencies.sort();
    println!(
        "SSE fan-out ({readers} readers of one busy instance, {messages} messages): delivery p50 {:.2} ms, p99 {:.2} ms, \
         max {:.2} ms ({} deliveries, {missing} missing); readers add {:.1} MiB resident ({:.1} KiB each, server and clients)",
        millis(percentile(&latencies, 0.5)),
        millis(percentile(&latencies, 0.99)),
        millis(*latencies.last().unwrap_or(&Duration::ZERO)),
        latencies.len(),
        connected.saturating_sub(before) as f64 / 1024.0,
        connected.saturating_sub(before) as f64 / readers as f64,
    );
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
        admissions("memory store", self::runtime(flue_runtime::store::MemoryStore::new())).await;
        let dir = std::env::temp_dir().join(format!("flue-http-bench-{}", std::process::id()));
        let sqlite = flue_runtime::store::SqliteStore::open(dir.join("flue.db")).expect("sqlite");
        admissions("SQLite store", self::runtime(sqlite)).await;
        let _ = std::fs::remove_dir_all(&dir);
        fan_out(1_000, 20).await;
    });
}
