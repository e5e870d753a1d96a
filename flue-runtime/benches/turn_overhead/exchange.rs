//! Turn-loop overhead, measured the way issue 4 asks. Prints figures; asserts nothing. Two
//! benches run it: `turn_overhead` on mimalloc (a deployed server's allocator, as the
//! README advises) and `turn_overhead_system` on the system allocator (`cargo bench -p
//! flue-runtime --bench turn_overhead` or `--bench turn_overhead_system`).
//!
//! 1. `turn_overhead`: one exchange — user message → tool call → final answer: two streamed
//!    model calls and one tool — through the runtime against a loopback OpenAI-compatible
//!    server, next to the same two HTTP calls made with plain reqwest (the very request bodies
//!    the runtime sent, recorded by the server, with the same headers). Measured on the
//!    multi-thread scheduler a server runs (two workers), driven from the bench's thread and
//!    from a task on the workers (as a server's handler drives it), and again on a
//!    current-thread scheduler, where no wake-up crosses threads. Also with the in-process
//!    scripted model (no HTTP at all), which isolates the runtime's own cost. On each
//!    scheduler a control follows: plain reqwest with 20 µs and 60 µs of busy work (no
//!    runtime) around its two calls, which shows what that scheduler and machine charge for
//!    any work between the calls beyond its own length.
//! 2. Exchanges per second at concurrency 16 over 16 instances.
//! 3. Exchanges 191-200 of one long conversation next to its first ten, next to plain reqwest
//!    replaying exchange 1's and exchange 200's requests.
//! 4. The resident memory 10,000 idle instances add on the memory store (which holds their
//!    records too), all of their conversations cached and with the default cache (each in a
//!    fresh process).
//!
//! Under a profiler, `FLUE_BENCH_PROFILE=http|http-sqlite|sqlite|scripted` runs just 20,000
//! exchanges of one kind (HTTP on the memory store, HTTP on SQLite, scripted on SQLite, scripted
//! on the memory store; `http-spawned` and `http-sqlite-spawned` drive the HTTP exchanges from a
//! task on the workers, as a server's handler does);
//! `long` one conversation of that many HTTP exchanges; `plain` the baseline alone, `provider`
//! the provider path alone, `store` the stores alone,
//! `interleaved` the runtime's own work and the provider path alone and then in turn,
//! `idle-gap` the runtime's own work after busy work and after the CPU went idle.
//! `FLUE_BENCH_SQLITE=memory` runs the SQLite profiles on an in-memory database (SQLite's own
//! work without the WAL's writes and checkpoints).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::{Response, header};
use axum::routing::post;
use flue_runtime::prelude::*;
use flue_runtime::provider::ProviderRegistry;
use flue_runtime::provider::openai::OpenAiProvider;
use flue_runtime::testing::{ScriptedModel, ScriptedReply};
use flue_runtime::{Runtime, RuntimeOptions};
use serde_json::{Value, json};

/// Add two numbers.
#[tool]
async fn add(a: i64, b: i64) -> String {
    (a + b).to_string()
}

#[agent]
fn http_agent() -> &'static str {
    use_model("bench/gpt-bench");
    use_tool(add);
    "You add numbers."
}

#[agent]
fn scripted_agent() -> &'static str {
    use_model("scripted/x");
    use_tool(add);
    "You add numbers."
}

const TOOL_CALL_SSE: &str = concat!(
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"add\",\"arguments\":\"\"}}]}}]}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"a\\\":2,\"}}]}}]}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"\\\"b\\\":3}\"}}]}}]}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n",
    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":20,\"completion_tokens\":5}}\n\n",
    "data: [DONE]\n\n",
);

const TEXT_SSE: &str = concat!(
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"2 + 3 \"}}]}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"= 5\"}}]}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":30,\"completion_tokens\":4}}\n\n",
    "data: [DONE]\n\n",
);

/// An allocator (the bench's root picks which), counting allocations (reallocations included)
/// so the bench can report how many an exchange makes: in a path this short, each is a
/// measurable share.
pub struct CountingAllocator<A>(pub A);

static ALLOCATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

// SAFETY: every call is forwarded to the inner allocator unchanged.
unsafe impl<A: std::alloc::GlobalAlloc> std::alloc::GlobalAlloc for CountingAllocator<A> {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: forwarded with the caller's layout.
        unsafe { self.0.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { self.0.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: forwarded with the caller's pointer, layout and size.
        unsafe { self.0.realloc(ptr, layout, new_size) }
    }
}

fn allocations() -> u64 {
    ALLOCATIONS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The last request body the responder saw for each of the exchange's two calls: what the
/// plain-reqwest baseline replays.
static RECORDED: std::sync::Mutex<[Option<axum::body::Bytes>; 2]> = std::sync::Mutex::new([None, None]);

/// A loopback OpenAI-compatible server that calls the tool first and answers once it has the
/// result, whatever the order requests arrive in.
async fn start_responder() -> SocketAddr {
    async fn chat(body: axum::body::Bytes) -> Response<Body> {
        let call = usize::from(last_role_is_tool(&body));
        RECORDED.lock().unwrap_or_else(|e| e.into_inner())[call] = Some(body);
        let body = if call == 1 { TEXT_SSE } else { TOOL_CALL_SSE };
        Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .body(Body::from(body))
            .unwrap_or_default()
    }
    let app = Router::new().route("/v1/chat/completions", post(chat));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    addr
}

/// Whether the last message of a Chat Completions body is a tool result, found without
/// parsing the body: the server stands in for a remote provider, so its work on this thread
/// should be as small as it can be (the baseline and the runtime share it all the same).
/// Bodies are compact JSON whose messages come before the tool declarations, which have no
/// `role`; [`recorded_bodies`] checks the scan against a parse.
fn last_role_is_tool(body: &[u8]) -> bool {
    const ROLE: &[u8] = b"\"role\":\"";
    body.windows(ROLE.len())
        .rposition(|window| window == ROLE)
        .is_some_and(|at| body[at + ROLE.len()..].starts_with(b"tool\""))
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples.get(samples.len() / 2).copied().unwrap_or_default()
}

/// The `percent`th percentile (nearest rank) of `samples`.
fn percentile(samples: &[Duration], percent: usize) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    let rank = (sorted.len() * percent).div_ceil(100).max(1);
    sorted.get(rank - 1).copied().unwrap_or_default()
}

fn mean(samples: &[Duration]) -> Duration {
    samples.iter().sum::<Duration>() / u32::try_from(samples.len().max(1)).unwrap_or(u32::MAX)
}

fn micros(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e6
}

/// The exchange's two calls as the runtime last made them (run one exchange first).
fn recorded_bodies() -> [axum::body::Bytes; 2] {
    let bodies = RECORDED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .map(|body| body.expect("a runtime exchange ran first"));
    // The responder's scan agrees with a parse of what the runtime sent.
    for (call, body) in bodies.iter().enumerate() {
        let request: Value = serde_json::from_slice(body).expect("a JSON body");
        let last_role = request["messages"]
            .as_array()
            .and_then(|m| m.last())
            .map(|m| &m["role"]);
        assert_eq!(last_role == Some(&json!("tool")), call == 1);
        assert_eq!(last_role_is_tool(body), call == 1);
    }
    bodies
}

async fn plain_reqwest_exchange(client: &reqwest::Client, url: &str, bodies: &[axum::body::Bytes; 2]) {
    for body in bodies {
        plain_reqwest_call(client, url, body).await;
    }
}

/// One of the exchange's calls with plain reqwest: the runtime's headers, the body read whole.
async fn plain_reqwest_call(client: &reqwest::Client, url: &str, body: &axum::body::Bytes) {
    let response = client
        .post(url)
        .bearer_auth("bench")
        .header(header::ACCEPT, "text/event-stream")
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.clone())
        .send()
        .await
        .expect("send");
    std::hint::black_box(response.bytes().await.expect("body"));
}

/// Keeps this thread busy for `length` without touching memory: a stand-in for work an
/// exchange does between its HTTP calls.
fn busy(length: Duration) {
    let until = Instant::now() + length;
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

/// Plain reqwest making the exchange's two calls with `gap` of busy work spread around them,
/// a third before, between and after, as the runtime's work falls (admission and render; the
/// step, the tool and its batch; the last step and the settlement).
async fn plain_reqwest_exchange_with_gap(
    client: &reqwest::Client,
    url: &str,
    bodies: &[axum::body::Bytes; 2],
    gap: Duration,
) {
    busy(gap / 3);
    for body in bodies {
        plain_reqwest_call(client, url, body).await;
        busy(gap / 3);
    }
}

/// The control for the overhead figures: what `gap` of busy work, with no runtime at all,
/// adds to plain reqwest's exchange on this scheduler, interleaved with plain reqwest alone.
/// Where the work between the calls costs the same as its length, the overhead figures
/// measure the runtime's work; where it costs more, the scheduler and the machine charge for
/// the gap itself (wake-ups of a worker that went idle meanwhile), whatever code fills it.
async fn busy_gap_control(scheduler: &str, client: &reqwest::Client, url: &str, rounds: usize) {
    let bodies = recorded_bodies();
    let gaps = [Duration::from_micros(20), Duration::from_micros(60)];
    let mut plain = Vec::new();
    let mut gapped = [Vec::new(), Vec::new()];
    for _ in 0..rounds {
        let started = Instant::now();
        plain_reqwest_exchange(client, url, &bodies).await;
        plain.push(started.elapsed());
        for (samples, gap) in gapped.iter_mut().zip(gaps) {
            let started = Instant::now();
            plain_reqwest_exchange_with_gap(client, url, &bodies, gap).await;
            samples.push(started.elapsed());
        }
    }
    let plain = micros(median(plain));
    let [twenty, sixty] = gapped.map(|samples| micros(median(samples)) - plain);
    println!(
        "control ({scheduler}): plain reqwest with 20 µs and 60 µs of busy work around its calls (no runtime): \
         {twenty:+.0} µs and {sixty:+.0} µs over plain reqwest's {plain:.0} µs (medians of {rounds})"
    );
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|line| line.starts_with("VmRSS:"))
                .and_then(|line| line.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn http_runtime(base_url: &str) -> Runtime {
    http_runtime_on(base_url, flue_runtime::store::MemoryStore::new())
}

fn http_runtime_on(base_url: &str, store: impl flue_runtime::store::Store) -> Runtime {
    let mut providers = ProviderRegistry::new();
    providers.register(OpenAiProvider::compatible("bench", base_url, "FLUE_BENCH_KEY").with_api_key("bench"));
    Runtime::builder()
        .store(store)
        .agent(http_agent)
        .providers(providers)
        .build()
        .expect("runtime")
}

fn scripted_runtime(model: &ScriptedModel) -> Runtime {
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    Runtime::builder()
        .store(flue_runtime::store::MemoryStore::new())
        .agent(scripted_agent)
        .providers(providers)
        .options(RuntimeOptions::default())
        .build()
        .expect("runtime")
}

fn exchange_script(model: &ScriptedModel) {
    model.push(ScriptedReply::tool_call("add", json!({"a": 2, "b": 3})));
    model.push(ScriptedReply::text("2 + 3 = 5"));
}

/// The exchange through the runtime (memory store, then SQLite) next to plain reqwest making
/// the same two calls, interleaved so both see the same machine conditions. Returns the SQLite
/// file and the loopback server's addresses and client, for the later sections.
async fn http_overhead(
    scheduler: &'static str,
    rounds: usize,
) -> (std::path::PathBuf, String, reqwest::Client, String) {
    let addr = start_responder().await;
    let base_url = format!("http://{addr}/v1");
    let url = format!("{base_url}/chat/completions");
    let client = reqwest::Client::new();
    let db = scratch_dir().join(scheduler_tag(scheduler)).join("flue.db");
    let stores: [(&str, Runtime); 2] = [
        ("memory store", http_runtime(&base_url)),
        (
            "SQLite store, WAL + synchronous=NORMAL",
            http_runtime_on(&base_url, flue_runtime::store::SqliteStore::open(&db).expect("sqlite")),
        ),
    ];
    for (store, runtime) in stores {
        for warm in 0..50 {
            runtime
                .init(&http_agent, format!("warm-{warm}"))
                .send("2+3?")
                .await
                .expect("exchange");
        }
        let bodies = recorded_bodies();
        for _ in 0..50 {
            plain_reqwest_exchange(&client, &url, &bodies).await;
        }
        let mut plain = Vec::new();
        let mut through = Vec::new();
        for round in 0..rounds {
            let started = Instant::now();
            plain_reqwest_exchange(&client, &url, &bodies).await;
            plain.push(started.elapsed());
            let handle = runtime.init(&http_agent, format!("exchange-{round}"));
            let started = Instant::now();
            let reply = handle.send("2+3?").await.expect("exchange");
            through.push(started.elapsed());
            assert_eq!(reply.text, "2 + 3 = 5");
        }
        // The mean too: it includes the rare slow exchange (on SQLite, the commit that
        // restarts the WAL) that a median leaves out.
        let mean_overhead = mean(&through).saturating_sub(mean(&plain));
        // And the tail: a stall (a lock held across a disk flush, a checkpoint) shows here
        // first.
        let (plain_p99, through_p99) = (percentile(&plain, 99), percentile(&through, 99));
        let (plain, through) = (median(plain), median(through));
        println!(
            "turn_overhead (HTTP, {store}, {scheduler}): plain reqwest {:.0} µs, runtime {:.0} µs, overhead {:.0} µs per exchange (medians of {rounds}; mean overhead {:.0} µs; p99 plain {:.0} µs, runtime {:.0} µs)",
            micros(plain),
            micros(through),
            micros(through.saturating_sub(plain)),
            micros(mean_overhead),
            micros(plain_p99),
            micros(through_p99)
        );
    }
    busy_gap_control(scheduler, &client, &url, rounds).await;
    (db, base_url, client, url)
}

fn scheduler_tag(scheduler: &str) -> &'static str {
    if scheduler.starts_with("current") {
        "current"
    } else {
        "multi"
    }
}

/// How this (virtual) machine's CPUs idle, when Linux's `cpuidle` says: the multi-thread
/// figures depend on it. An idle vCPU that halts at once (the `haltpoll` driver with
/// `guest_halt_poll_ns` 0, as Firecracker guests are often booted) leaves the processor to the
/// host, so every wake-up that crosses threads waits for the hypervisor and then runs on cold
/// caches; with Linux's default (polling up to 200 µs before halting) the same exchange's
/// multi-thread figures come close to the current-thread ones. The current-thread figures do
/// not depend on it (no wake-up crosses threads).
fn idle_policy() -> Option<String> {
    let read = |path: &str| std::fs::read_to_string(path).ok().map(|text| text.trim().to_owned());
    let driver = read("/sys/devices/system/cpu/cpuidle/current_driver")?;
    Some(match read("/sys/module/haltpoll/parameters/guest_halt_poll_ns") {
        Some(poll) if driver == "haltpoll" => format!(
            "cpuidle: {driver}, guest_halt_poll_ns {poll}{}",
            if poll == "0" {
                " (an idle vCPU halts at once: the multi-thread figures include a hypervisor wake-up for each hand-over between threads)"
            } else {
                ""
            }
        ),
        _ => format!("cpuidle: {driver}"),
    })
}

/// Where this run's SQLite files go (removed when it ends).
fn scratch_dir() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("flue-bench-{}", std::process::id()))
}

/// Runs the bench; `allocator` names the global allocator its root installed.
pub fn main(allocator: &str) {
    let current_thread_profile = std::env::var("FLUE_BENCH_PROFILE").is_ok_and(|target| target.ends_with("-current"));
    let multi = if current_thread_profile {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
    }
    .expect("tokio runtime");
    let profiling = std::env::var("FLUE_BENCH_PROFILE").is_ok() || std::env::var("FLUE_BENCH_MEMORY").is_ok();
    if !profiling {
        println!("allocator: {allocator}");
        if let Some(idle) = idle_policy() {
            println!("{idle}");
        }
    }
    multi.block_on(bench());
    drop(multi);
    if !profiling {
        // 1c. The same exchange where no wake-up crosses threads: what the work costs.
        let current = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        current.block_on(async {
            http_overhead("current-thread scheduler", 400).await;
        });
    }
    let _ = std::fs::remove_dir_all(scratch_dir());
}

async fn bench() {
    if let Some(cached) = std::env::var("FLUE_BENCH_MEMORY").ok().and_then(|v| v.parse().ok()) {
        idle_memory(cached).await;
        return;
    }
    if let Ok(target) = std::env::var("FLUE_BENCH_PROFILE") {
        if target.starts_with("plain") {
            // Profiling aid: the baseline (plain reqwest replaying the exchange's two calls).
            let addr = start_responder().await;
            let base_url = format!("http://{addr}/v1");
            http_runtime(&base_url)
                .init(&http_agent, "p")
                .send("2+3?")
                .await
                .expect("exchange");
            let (client, url, bodies) = (
                reqwest::Client::new(),
                format!("{base_url}/chat/completions"),
                recorded_bodies(),
            );
            for _ in 0..profile_rounds() {
                plain_reqwest_exchange(&client, &url, &bodies).await;
            }
            return;
        }
        if target.starts_with("store") {
            // Profiling aid: the stores' own throughput alone.
            let db = scratch_dir().join("store").join("flue.db");
            std::fs::create_dir_all(db.parent().expect("a parent")).expect("scratch directory");
            store_throughput(&db).await;
            return;
        }
        if target.starts_with("provider") {
            provider_path().await;
            return;
        }
        if target.starts_with("interleaved") {
            interleaved().await;
            return;
        }
        if target.starts_with("idle-gap") {
            idle_gap().await;
            return;
        }
        if target.starts_with("long") {
            // Profiling aid: one conversation of as many exchanges over HTTP (memory store).
            let addr = start_responder().await;
            let runtime = http_runtime(&format!("http://{addr}/v1"));
            let long = runtime.init(&http_agent, "long");
            for _ in 0..profile_rounds() {
                long.send("2+3?").await.expect("exchange");
            }
            return;
        }
        if target.starts_with("http") {
            // Profiling aid: the HTTP exchange on the memory store (`http-sqlite`: on SQLite),
            // many times.
            let addr = start_responder().await;
            let base_url = format!("http://{addr}/v1");
            let runtime = if target.starts_with("http-sqlite") {
                let db = scratch_dir().join("profile").join("flue.db");
                http_runtime_on(&base_url, profile_sqlite(&db))
            } else {
                http_runtime(&base_url)
            };
            let exchanges = async move {
                for round in 0..profile_rounds() {
                    runtime
                        .init(&http_agent, format!("p-{round}"))
                        .send("2+3?")
                        .await
                        .expect("exchange");
                }
            };
            // `…-spawned`: driven from a task on the workers, as a server's handler drives it.
            if target.contains("-spawned") {
                tokio::spawn(exchanges).await.expect("the spawned exchanges");
            } else {
                exchanges.await;
            }
            return;
        }
        // Profiling aid: only the scripted exchange, many times (on SQLite when asked).
        let model = ScriptedModel::new([]).without_recording();
        let scripted = if target.starts_with("sqlite") {
            let db = scratch_dir().join("profile").join("flue.db");
            let mut providers = ProviderRegistry::new();
            providers.register(model.clone());
            Runtime::builder()
                .store(profile_sqlite(&db))
                .agent(scripted_agent)
                .providers(providers)
                .build()
                .expect("runtime")
        } else {
            scripted_runtime(&model)
        };
        for round in 0..profile_rounds() {
            exchange_script(&model);
            scripted
                .init(&scripted_agent, format!("p-{round}"))
                .send("2+3?")
                .await
                .expect("exchange");
        }
        return;
    }
    let rounds = 400;
    // 1. turn_overhead over HTTP, on this (multi-thread) scheduler.
    let (db, base_url, client, url) = http_overhead("multi-thread scheduler, 2 workers", rounds).await;
    // 1a. The same, driven from a task on the workers, as a server's request handler drives it
    // (above, the bench's own thread drives it, and every wake-up of the connection's task
    // crosses threads).
    tokio::spawn(http_overhead(
        "multi-thread scheduler, 2 workers, driven from a spawned task",
        rounds,
    ))
    .await
    .expect("the spawned measurement");
    store_throughput(&db).await;
    let runtime = http_runtime(&base_url);

    // 1b. The runtime's own cost, without HTTP: on the memory store, then on SQLite (and on
    // Postgres, with the `postgres` feature and FLUE_TEST_POSTGRES_URL set).
    scripted_exchange("memory store", flue_runtime::store::MemoryStore::new(), rounds).await;
    let db = scratch_dir().join("scripted").join("flue.db");
    scripted_exchange(
        "SQLite store",
        flue_runtime::store::SqliteStore::open(db).expect("sqlite"),
        rounds,
    )
    .await;
    #[cfg(feature = "postgres")]
    if let Some(store) = postgres_store("exchange").await {
        scripted_exchange("Postgres store", store, rounds).await;
    }

    // 2. Throughput at concurrency 16 over 16 instances.
    let total = 1600;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for worker in 0..16 {
        let runtime = runtime.clone();
        tasks.push(tokio::spawn(async move {
            let handle = runtime.init(&http_agent, format!("concurrent-{worker}"));
            for _ in 0..total / 16 {
                handle.send("2+3?").await.expect("exchange");
            }
        }));
    }
    for task in tasks {
        task.await.expect("worker");
    }
    let elapsed = started.elapsed();
    println!(
        "throughput (HTTP, concurrency 16, 16 instances): {:.0} exchanges/s ({total} exchanges in {:.2} s)",
        total as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64()
    );

    // 3. Exchange 200 of one conversation next to exchange 1, each next to plain reqwest
    // replaying that exchange's own two request bodies (recorded by the server): what the
    // runtime adds at either length, beyond the longer request body itself.
    let long = runtime.init(&http_agent, "long-conversation");
    let mut long_samples = Vec::new();
    let mut first_bodies = None;
    for _ in 0..200 {
        let started = Instant::now();
        long.send("2+3?").await.expect("exchange");
        long_samples.push(started.elapsed());
        first_bodies.get_or_insert_with(recorded_bodies);
    }
    let (first_bodies, last_bodies) = (first_bodies.expect("a first exchange"), recorded_bodies());
    // Medians of ten: exchanges 1-10 and 191-200 (their bodies differ from exchange 1's and
    // 200's by a few messages).
    let first = micros(median(long_samples[..10].to_vec()));
    let last = micros(median(long_samples[190..].to_vec()));
    let mut replays = [Vec::new(), Vec::new()];
    for _ in 0..10 {
        for (samples, bodies) in replays.iter_mut().zip([&first_bodies, &last_bodies]) {
            let started = Instant::now();
            plain_reqwest_exchange(&client, &url, bodies).await;
            samples.push(started.elapsed());
        }
    }
    let [plain_first, plain_last] = replays.map(|samples| micros(median(samples)));
    println!(
        "long conversation (HTTP): exchanges 1-10 {first:.0} µs, exchanges 191-200 {last:.0} µs ({:.2}x, medians); \
         plain reqwest replaying the requests of exchange 1 and 200 {plain_first:.0} µs and {plain_last:.0} µs, so \
         the runtime adds {:.0} µs at the start and {:.0} µs at exchange 200",
        last / first,
        first - plain_first,
        last - plain_last
    );

    // 4. Resident memory with 10,000 idle instances, each measured in a fresh process (a heap
    // that earlier sections grew and freed would hide the growth).
    let bench = std::env::current_exe().expect("this bench's path");
    for cached in [10_000, RuntimeOptions::default().cached_instances] {
        let output = std::process::Command::new(&bench)
            .env("FLUE_BENCH_MEMORY", cached.to_string())
            .output()
            .expect("run the memory measurement");
        print!("{}", String::from_utf8_lossy(&output.stdout));
    }
}

/// The scripted exchange (no HTTP) on `store`: the runtime's own cost, median of `rounds`.
async fn scripted_exchange(name: &str, store: impl flue_runtime::store::Store, rounds: usize) {
    let model = ScriptedModel::new([]).without_recording();
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    let runtime = Runtime::builder()
        .store(store)
        .agent(scripted_agent)
        .providers(providers)
        .build()
        .expect("runtime");
    let mut samples = Vec::new();
    for round in 0..rounds + 50 {
        exchange_script(&model);
        let handle = runtime.init(&scripted_agent, format!("s-{round}"));
        let started = Instant::now();
        handle.send("2+3?").await.expect("exchange");
        if round >= 50 {
            samples.push(started.elapsed());
        }
    }
    println!(
        "turn_overhead (scripted model, {name}): {:.0} µs per exchange (median)",
        micros(median(samples))
    );
}

/// Records the requests the runtime makes and passes them on.
struct Recorder {
    inner: std::sync::Arc<dyn flue_runtime::provider::ModelProvider>,
    requests: std::sync::Mutex<Vec<flue_runtime::provider::ModelRequest>>,
}

impl flue_runtime::provider::ModelProvider for Recorder {
    fn id(&self) -> &str {
        "bench"
    }

    fn stream(&self, request: &flue_runtime::provider::ModelRequest) -> flue_runtime::provider::ModelStream {
        self.requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(request.clone());
        self.inner.stream(request)
    }
}

/// The OpenAI provider on a loopback server, with the exchange's two model requests as the
/// runtime made them (recorded from one exchange on `runtime`).
struct ProviderPath {
    provider: std::sync::Arc<dyn flue_runtime::provider::ModelProvider>,
    requests: Vec<flue_runtime::provider::ModelRequest>,
    runtime: Runtime,
    base_url: String,
}

impl ProviderPath {
    async fn start() -> Self {
        let addr = start_responder().await;
        let base_url = format!("http://{addr}/v1");
        let provider: std::sync::Arc<dyn flue_runtime::provider::ModelProvider> =
            std::sync::Arc::new(OpenAiProvider::compatible("bench", &base_url, "FLUE_BENCH_KEY").with_api_key("bench"));
        let recorder = std::sync::Arc::new(Recorder {
            inner: provider.clone(),
            requests: Default::default(),
        });
        let mut providers = ProviderRegistry::new();
        providers.register_arc(recorder.clone());
        let runtime = Runtime::builder()
            .agent(http_agent)
            .store(flue_runtime::store::MemoryStore::new())
            .providers(providers)
            .build()
            .expect("runtime");
        runtime.init(&http_agent, "p").send("2+3?").await.expect("exchange");
        let requests = recorder.requests.lock().unwrap_or_else(|e| e.into_inner()).clone();
        Self {
            provider,
            requests,
            runtime,
            base_url,
        }
    }

    /// The two model calls, streamed through the provider to their ends.
    async fn calls(&self) {
        use futures_util::StreamExt;
        for request in &self.requests {
            let mut stream = self.provider.stream(request);
            while let Some(event) = stream.next().await {
                std::hint::black_box(event.expect("event"));
            }
        }
    }
}

/// Profiling aid: the provider path alone (the exchange's two model requests streamed through
/// the OpenAI provider) next to plain reqwest making the same calls.
async fn provider_path() {
    let path = ProviderPath::start().await;
    let (client, url, bodies) = (
        reqwest::Client::new(),
        format!("{}/chat/completions", path.base_url),
        recorded_bodies(),
    );
    let (mut plain, mut through) = (Vec::new(), Vec::new());
    for _ in 0..profile_rounds() {
        let started = Instant::now();
        plain_reqwest_exchange(&client, &url, &bodies).await;
        plain.push(started.elapsed());
        let started = Instant::now();
        path.calls().await;
        through.push(started.elapsed());
    }
    let before = allocations();
    plain_reqwest_exchange(&client, &url, &bodies).await;
    let plain_allocs = allocations() - before;
    let before = allocations();
    path.calls().await;
    let provider_allocs = allocations() - before;
    let runtime = &path.runtime;
    let before = allocations();
    runtime.init(&http_agent, "q").send("2+3?").await.expect("exchange");
    let runtime_allocs = allocations() - before;
    println!(
        "allocations (incl. the loopback server's): plain {plain_allocs}, provider {provider_allocs}, runtime {runtime_allocs}"
    );
    let (plain, through) = (median(plain), median(through));
    println!(
        "provider path: plain reqwest {:.1} µs, provider {:.1} µs, overhead {:.1} µs per exchange",
        micros(plain),
        micros(through),
        micros(through.saturating_sub(plain))
    );
}

/// Profiling aid (`FLUE_BENCH_PROFILE=interleaved`): the scripted exchange (the runtime's own
/// work, no HTTP) and the provider path's two calls, each run alone, then alternating as they
/// do inside an HTTP exchange, each part timed. What the parts cost alternating beyond what
/// they cost alone is the price of running the two bodies of code in turn (caches), which no
/// profile of either part shows.
async fn interleaved() {
    let path = ProviderPath::start().await;
    let model = ScriptedModel::new([]).without_recording();
    let scripted = scripted_runtime(&model);
    let rounds = profile_rounds();
    let mut next = 0;
    let mut exchange = async || {
        exchange_script(&model);
        next += 1;
        scripted
            .init(&scripted_agent, format!("i-{next}"))
            .send("2+3?")
            .await
            .expect("exchange");
    };
    // `FLUE_BENCH_PHASE=alone|alternating` runs one phase only (to compare the two under
    // valgrind, whose counts do not separate phases).
    let phase = std::env::var("FLUE_BENCH_PHASE").unwrap_or_default();
    let (alone_rounds, alternating_rounds) = match phase.as_str() {
        "alone" => (rounds, 0),
        "alternating" => (0, rounds),
        _ => (rounds, rounds),
    };
    let (mut alone_runtime, mut alone_provider) = (Vec::new(), Vec::new());
    for _ in 0..alone_rounds {
        let started = Instant::now();
        exchange().await;
        alone_runtime.push(started.elapsed());
    }
    for _ in 0..alone_rounds {
        let started = Instant::now();
        path.calls().await;
        alone_provider.push(started.elapsed());
    }
    let (mut runtime_part, mut provider_part) = (Vec::new(), Vec::new());
    for _ in 0..alternating_rounds {
        let started = Instant::now();
        exchange().await;
        runtime_part.push(started.elapsed());
        let started = Instant::now();
        path.calls().await;
        provider_part.push(started.elapsed());
    }
    let (alone_runtime, alone_provider) = (micros(median(alone_runtime)), micros(median(alone_provider)));
    let (runtime_part, provider_part) = (micros(median(runtime_part)), micros(median(provider_part)));
    println!(
        "interleaved: alone, scripted exchange {alone_runtime:.1} µs + provider calls {alone_provider:.1} µs; \
         alternating, {runtime_part:.1} µs + {provider_part:.1} µs: {:.1} µs more per exchange (medians of {rounds})",
        runtime_part + provider_part - alone_runtime - alone_provider
    );
}

/// Profiling aid (`FLUE_BENCH_PROFILE=idle-gap`): the scripted exchange (no HTTP) run back to
/// back, after 60 µs of busy work, and after 60 µs in which the thread sleeps (its CPU goes
/// idle, as it does while an HTTP exchange waits for the server). What the exchange costs after
/// an idle wait beyond what it costs after a busy one is what this machine charges for going
/// idle (caches and predictors lost meanwhile), which no change to the runtime's code removes
/// and every wait on the network pays.
async fn idle_gap() {
    let model = ScriptedModel::new([]).without_recording();
    let scripted = scripted_runtime(&model);
    let rounds = profile_rounds();
    let mut next = 0;
    let mut exchange = async || {
        exchange_script(&model);
        next += 1;
        let started = Instant::now();
        scripted
            .init(&scripted_agent, format!("g-{next}"))
            .send("2+3?")
            .await
            .expect("exchange");
        started.elapsed()
    };
    let gap = Duration::from_micros(60);
    let (mut back_to_back, mut after_busy, mut after_idle) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        back_to_back.push(exchange().await);
        busy(gap);
        after_busy.push(exchange().await);
        std::thread::sleep(gap);
        after_idle.push(exchange().await);
    }
    let [back_to_back, after_busy, after_idle] = [back_to_back, after_busy, after_idle].map(|s| micros(median(s)));
    println!(
        "idle gap: the scripted exchange takes {back_to_back:.1} µs back to back, {after_busy:.1} µs after 60 µs of \
         busy work, {after_idle:.1} µs after 60 µs asleep (medians of {rounds})"
    );
}

/// A model that makes the exchange (a call of `add`, then the answer once it has the result)
/// and keeps nothing: the memory measurement must not count a recording of every request, as
/// the testing kit's scripted model keeps. The tool batch matters: what a response keeps of its
/// thread view, tools and attempt shows only after one.
struct AddsThenAnswers;

impl flue_runtime::provider::ModelProvider for AddsThenAnswers {
    fn id(&self) -> &str {
        "scripted"
    }

    fn stream(&self, request: &flue_runtime::provider::ModelRequest) -> flue_runtime::provider::ModelStream {
        use flue_runtime::provider::{ModelMessage, ModelResponse, ModelToolCall, StopReason, StreamEvent};
        let answered = matches!(request.messages.last(), Some(ModelMessage::Tool { .. }));
        let response = ModelResponse {
            text: if answered { "2 + 3 = 5".into() } else { String::new() },
            reasoning: String::new(),
            tool_calls: if answered {
                Vec::new()
            } else {
                vec![ModelToolCall {
                    id: "call_1".into(),
                    name: "add".into(),
                    arguments: r#"{"a":2,"b":3}"#.into(),
                }]
            },
            stop_reason: if answered {
                StopReason::Stop
            } else {
                StopReason::ToolUse
            },
            usage: Default::default(),
            reasoning_blocks: Vec::new(),
        };
        Box::pin(futures_util::stream::iter([Ok(StreamEvent::Completed(response))]))
    }
}

/// Resident memory added by 10,000 idle instances (one exchange each: a tool call, then the
/// answer) on the memory store
/// (which holds their records too), with at most `cached` conversations cached.
async fn idle_memory(cached: usize) {
    let before = rss_kib();
    let mut providers = ProviderRegistry::new();
    providers.register(AddsThenAnswers);
    let idle = Runtime::builder()
        .store(flue_runtime::store::MemoryStore::new())
        .agent(scripted_agent)
        .providers(providers)
        .options(RuntimeOptions {
            cached_instances: cached,
            ..RuntimeOptions::default()
        })
        .build()
        .expect("runtime");
    for instance in 0..10_000 {
        let reply = idle
            .init(&scripted_agent, format!("idle-{instance}"))
            .send("2+3?")
            .await
            .expect("exchange");
        assert_eq!(reply.text, "2 + 3 = 5");
    }
    let after = rss_kib();
    println!(
        "memory: 10,000 idle instances (one exchange each, {} conversations cached) add {:.1} MiB resident ({:.1} KiB each)",
        idle.cached_instance_count(),
        (after.saturating_sub(before)) as f64 / 1024.0,
        (after.saturating_sub(before)) as f64 / 10_000.0
    );
}

/// A Postgres store in a fresh schema of the database at `FLUE_TEST_POSTGRES_URL`, when set.
#[cfg(feature = "postgres")]
async fn postgres_store(section: &str) -> Option<flue_runtime::store::PostgresStore> {
    let url = std::env::var("FLUE_TEST_POSTGRES_URL").ok()?;
    let schema = format!("flue_bench_{section}_{}", std::process::id());
    Some(
        flue_runtime::store::PostgresStore::connect_with_schema(&url, &schema)
            .await
            .expect("postgres"),
    )
}

/// Record batches appended per second and admissions per second, memory and SQLite (and
/// Postgres, when configured).
async fn store_throughput(sqlite_path: &std::path::Path) {
    use flue_runtime::record::{Record, RecordBody};
    use flue_runtime::store::{Admission, InstanceKey, MemoryStore, SqliteStore, Store, SubmissionKind, UidCondition};
    #[allow(unused_mut)]
    let mut stores: Vec<(&str, Box<dyn Store>)> = vec![
        ("memory", Box::new(MemoryStore::new())),
        (
            "sqlite",
            Box::new(SqliteStore::open(sqlite_path.with_file_name("throughput.db")).expect("sqlite")),
        ),
    ];
    #[cfg(feature = "postgres")]
    if let Some(store) = postgres_store("throughput").await {
        stores.push(("postgres", Box::new(store)));
    }
    for (name, store) in stores {
        let count = if name == "postgres" { 2_000 } else { 5_000 };
        let started = Instant::now();
        for i in 0..count {
            store
                .admit(Admission {
                    key: InstanceKey::new("bench", format!("i-{}", i % 100)),
                    submission_id: format!("sub-{i}"),
                    keyed: false,
                    kind: SubmissionKind::Dispatch,
                    message: DeliveredMessage::user("hello"),
                    initial_data: None,
                    uid: UidCondition::Any,
                    max_attempts: 10,
                    timeout_ms: 3_600_000,
                    claim: None,
                    trace: None,
                })
                .await
                .expect("admit");
        }
        let admissions = count as f64 / started.elapsed().as_secs_f64();
        let key = InstanceKey::new("bench", "i-0");
        let mut each = Vec::with_capacity(count);
        let started = Instant::now();
        for i in 0..count {
            let records = (0..3)
                .map(|j| Record {
                    id: format!("r-{i}-{j}"),
                    submission_id: None,
                    attempt_id: None,
                    timestamp: "2026-11-30T00:00:00.000Z".into(),
                    body: RecordBody::StateWrite {
                        name: "n".into(),
                        value: json!(i),
                    },
                })
                .collect();
            let appended = Instant::now();
            store.append(&key, records, None).await.expect("append");
            each.push(appended.elapsed());
        }
        let appends = count as f64 / started.elapsed().as_secs_f64();
        let append = micros(median(each));
        // A read that finds nothing new: what every response's catch-up read costs.
        let head = store
            .read(&key, None)
            .await
            .expect("read")
            .last()
            .map(|batch| batch.offset);
        let started = Instant::now();
        for _ in 0..count {
            std::hint::black_box(store.read(&key, head).await.expect("read"));
        }
        let tail_read = micros(started.elapsed()) / count as f64;
        println!(
            "store {name}: {admissions:.0} admissions/s, {appends:.0} batches of 3 records appended/s ({append:.1} µs median), {tail_read:.2} µs per read of an up-to-date stream"
        );
    }
    sqlite_commit_floor(&sqlite_path.with_file_name("floor.db"));
}

/// What one durable SQLite commit costs on this machine, before any store logic: a one-row
/// insert in its own `BEGIN IMMEDIATE` transaction, statements cached, with the store's
/// pragmas (WAL, `synchronous=NORMAL`) and underlying VFS (`unix-excl`: no file-lock calls;
/// the store's own VFS also writes a commit's WAL frames in one call, this floor's in two). An exchange commits six times (admission, input row,
/// the tool-call step, the tool batch, the final step, settlement), so six of these bound
/// what the SQLite store can add to an exchange from below.
fn sqlite_commit_floor(path: &std::path::Path) {
    let connection = rusqlite::Connection::open_with_flags_and_vfs(path, rusqlite::OpenFlags::default(), c"unix-excl")
        .expect("sqlite");
    connection
        .execute_batch(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL;
             CREATE TABLE floor (key INTEGER PRIMARY KEY, value TEXT NOT NULL);",
        )
        .expect("schema");
    let value = "x".repeat(200);
    let commit = |key: i64| {
        connection
            .prepare_cached("BEGIN IMMEDIATE")
            .expect("begin")
            .execute([])
            .expect("begin");
        connection
            .prepare_cached("INSERT INTO floor (key, value) VALUES (?1, ?2)")
            .expect("insert")
            .execute(rusqlite::params![key, value])
            .expect("insert");
        connection
            .prepare_cached("COMMIT")
            .expect("commit")
            .execute([])
            .expect("commit");
    };
    for key in 0..500 {
        commit(key);
    }
    let mut samples = Vec::new();
    for key in 500..5_500 {
        let started = Instant::now();
        commit(key);
        samples.push(started.elapsed());
    }
    let floor = micros(median(samples));
    println!(
        "sqlite commit floor: {floor:.1} µs per one-row commit (median), so six commits per exchange cost {:.0} µs at least",
        6.0 * floor
    );
}

/// The SQLite store of a profile: at `db`, or in memory with `FLUE_BENCH_SQLITE=memory` (no
/// WAL, no file, no checkpointer: what SQLite's own work costs without the I/O).
fn profile_sqlite(db: &std::path::Path) -> flue_runtime::store::SqliteStore {
    if std::env::var("FLUE_BENCH_SQLITE").is_ok_and(|kind| kind == "memory") {
        return flue_runtime::store::SqliteStore::in_memory().expect("sqlite in memory");
    }
    flue_runtime::store::SqliteStore::open(db).expect("sqlite")
}

/// How many exchanges a profiling run makes (`FLUE_BENCH_ROUNDS`, default 20,000).
fn profile_rounds() -> usize {
    std::env::var("FLUE_BENCH_ROUNDS")
        .ok()
        .and_then(|rounds| rounds.parse().ok())
        .unwrap_or(20_000)
}
