//! Several runtime nodes sharing one Postgres database: leases, takeovers and aborts across
//! nodes. Each test gets a fresh schema of the database at `FLUE_TEST_POSTGRES_URL` (`.ci/test`
//! sets it).
#![cfg(feature = "postgres")]
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

mod harness;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use flue_runtime::BoxFuture;
use flue_runtime::events::Event;
use flue_runtime::prelude::*;
use flue_runtime::provider::ProviderRegistry;
use flue_runtime::record::Batch;
use flue_runtime::store::{
    Claim, InstanceKey, PostgresStore, Store, StoreError, StoreNotice, SubmissionStatus, now_ms,
};
use flue_runtime::testing::{ScriptedModel, ScriptedReply};
use flue_runtime::{Runtime, RuntimeError, RuntimeOptions};
use serde_json::json;

fn url() -> Option<String> {
    harness::postgres_url("the multi-node tests")
}

fn fresh_schema() -> String {
    harness::fresh_schema("flue_multinode")
}

fn claim(attempt: &str, owner: &str, lease_ms: u64) -> Claim {
    Claim {
        attempt_id: attempt.into(),
        owner_id: owner.into(),
        lease_until_ms: now_ms() + lease_ms,
    }
}

// ---- renew_leases vs reclaim ------------------------------------------------------------------

/// A heartbeat that lands just after another node listed the lease as expired: the renewal
/// succeeds (the owner holds the instance for another lease), so the other node's reclaim is
/// refused: it checks the lease it takes over, not only the attempt id. (Regression: `RECLAIM`
/// compared the attempt id alone, and two nodes then ran one instance.)
#[tokio::test]
async fn a_lease_renewed_after_the_expiry_scan_is_not_taken_over() {
    let Some(url) = url() else { return };
    let schema = fresh_schema();
    let a = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
    let b = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
    let key = InstanceKey::new("assistant", "slow-heartbeat");
    a.admit(harness::admission(&key, "d-1", "hello")).await.unwrap();
    a.claim_next(&key, &claim("attempt-a", "node-a", 100))
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(250)).await;
    // Node B's lease scan sees the lease expired...
    let expired = b.expired(now_ms()).await.unwrap();
    assert_eq!(expired.iter().map(|row| row.id.as_str()).collect::<Vec<_>>(), ["d-1"]);
    // ...then node A's (late) heartbeat renews it for another 30 s, successfully...
    assert_eq!(
        a.renew_leases("node-a", &["attempt-a".to_owned()], now_ms() + 30_000)
            .await
            .unwrap(),
        1,
        "the renewal succeeded: node A holds the lease for 30 s more"
    );
    // ...so node B's takeover, acting on its stale read, must not succeed.
    let taken = b
        .reclaim("d-1", "attempt-a", &claim("attempt-b", "node-b", 30_000), now_ms())
        .await
        .unwrap();
    assert!(
        taken.is_none(),
        "a lease renewed 0 ms ago (until {}) was taken over by node B: {:?}",
        now_ms() + 30_000,
        taken.map(|row| (row.owner_id, row.attempt_id, row.attempt_count))
    );
}

// ---- abort intents and running attempts -------------------------------------------------------

#[agent]
fn waiter() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("wait_forever").description("Wait until aborted.").run(
        |ctx, _: serde_json::Map<String, serde_json::Value>| async move {
            ctx.signal().aborted().await;
            "stopped"
        },
    ));
    "Wait."
}

#[agent]
fn pauser() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("pause").description("Take a second.").run(
        |_ctx, _: serde_json::Map<String, serde_json::Value>| async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            "paused"
        },
    ));
    "Pause."
}

/// One model step per response: a message queued behind its response cannot join it (a
/// response joins deliveries only while it can take another step).
#[agent(max_steps = 1)]
fn one_step() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("pause").description("Take a second.").run(
        |_ctx, _: serde_json::Map<String, serde_json::Value>| async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            "paused"
        },
    ));
    "Pause once."
}

/// How many `hold` calls saw their abort signal fire.
static HOLDS_STOPPED: AtomicUsize = AtomicUsize::new(0);

#[agent]
fn holder() -> &'static str {
    use_model("scripted/x");
    use_tool(Tool::new("hold").description("Hold until stopped.").run(
        |ctx, _: serde_json::Map<String, serde_json::Value>| async move {
            ctx.signal().aborted().await;
            HOLDS_STOPPED.fetch_add(1, Ordering::SeqCst);
            "stopped"
        },
    ));
    "Hold."
}

fn node(store: impl Store, model: &ScriptedModel) -> Runtime {
    node_scanning_every(store, model, Duration::from_millis(100))
}

fn node_scanning_every(store: impl Store, model: &ScriptedModel, scan_interval: Duration) -> Runtime {
    node_with(
        store,
        model,
        RuntimeOptions {
            model_retry_delay: Duration::from_millis(1),
            lease: Duration::from_secs(2),
            heartbeat: Duration::from_millis(50),
            scan_interval,
            ..RuntimeOptions::default()
        },
    )
}

fn node_with(store: impl Store, model: &ScriptedModel, options: RuntimeOptions) -> Runtime {
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    Runtime::builder()
        .store(store)
        .providers(providers)
        .agent(waiter)
        .agent(pauser)
        .agent(holder)
        .agent(one_step)
        .options(options)
        .build()
        .unwrap()
}

/// A node that looks at the shared store on its own only once a minute: its heartbeat (which
/// renews its leases and looks for abort requests), its scan and its waits' polls. What it
/// learns sooner, it learns from the other nodes' notices.
fn node_that_looks_once_a_minute(store: impl Store, model: &ScriptedModel) -> Runtime {
    node_with(
        store,
        model,
        RuntimeOptions {
            model_retry_delay: Duration::from_millis(1),
            lease: Duration::from_secs(180),
            heartbeat: Duration::from_secs(60),
            scan_interval: Duration::from_secs(60),
            shared_store_poll: Duration::from_secs(60),
            ..RuntimeOptions::default()
        },
    )
}

fn waiting_model() -> ScriptedModel {
    ScriptedModel::new([
        ScriptedReply::tool_call("wait_forever", json!({})),
        ScriptedReply::text("never"),
    ])
}

fn outcome(result: Result<Result<flue_runtime::AgentReply, RuntimeError>, tokio::time::error::Elapsed>) -> String {
    match result {
        Err(_) => "still running after 10 s".into(),
        Ok(Ok(reply)) => format!("completed: {:?}", reply.text),
        Ok(Err(RuntimeError::Run { error_type, .. })) => error_type,
        Ok(Err(other)) => format!("error: {other}"),
    }
}

async fn dispatch_and_wait_for_the_tool(runtime: &Runtime, instance: &str) -> String {
    let mut events = runtime.observe();
    let handle = runtime.init(&waiter, instance);
    let receipt = handle.dispatch("go").await.unwrap();
    let started = async {
        loop {
            if let Event::ToolStart { .. } = events.recv().await.unwrap().event {
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), started)
        .await
        .expect("the tool started on this node within 10 s");
    receipt.submission_id
}

/// Control: the abort reaches the attempt when it is requested on the node running it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_on_the_owning_node_settles_the_running_submission_aborted() {
    let Some(url) = url() else { return };
    let schema = fresh_schema();
    let model = waiting_model();
    let a = node(PostgresStore::connect_with_schema(&url, &schema).await.unwrap(), &model);
    let id = dispatch_and_wait_for_the_tool(&a, "w").await;
    let handle = a.init(&waiter, "w");
    assert!(handle.abort().await.unwrap());
    let result = tokio::time::timeout(Duration::from_secs(10), handle.read(&id)).await;
    assert_eq!(outcome(result), "submission_aborted");
}

/// §3.9/§3.10: an abort intent stamped on a running row aborts the live attempt (the lease scan
/// enforces abort intents and deadlines on live attempts). Requested through another node, the
/// intent is stamped (`abort()` answers true) and the node running the attempt acts on it: the
/// submission settles aborted. (Regression: only the requesting node's in-process attempts were
/// signalled, and the running one never learnt of it.)
/// Node A hears no notices here (see [`Unannounced`]): its heartbeat's look for abort
/// requests is what finds the intent, as it does when a notice is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_requested_through_another_node_reaches_the_running_attempt() {
    let Some(url) = url() else { return };
    let schema = fresh_schema();
    let model = waiting_model();
    let a = node(
        Unannounced {
            inner: PostgresStore::connect_with_schema(&url, &schema).await.unwrap(),
        },
        &model,
    );
    let b = node(
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap(),
        &waiting_model(),
    );
    // B starts once A runs the submission: started before, its scan could claim it first.
    let id = dispatch_and_wait_for_the_tool(&a, "w").await;
    b.start().await;
    assert!(
        b.init(&waiter, "w").abort().await.unwrap(),
        "node B stamped the abort intent"
    );
    let store = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
    let row = store.submission(&id).await.unwrap().unwrap();
    // The intent is stamped; the running node's lease scan may have acted on it already.
    assert!(
        row.abort_requested && matches!(row.status, SubmissionStatus::Running | SubmissionStatus::Settled),
        "{row:?}"
    );
    let result = tokio::time::timeout(Duration::from_secs(10), a.init(&waiter, "w").read(&id)).await;
    assert_eq!(outcome(result), "submission_aborted");
}

/// The notice path: node B's abort request reaches the attempt running on node A as B's
/// transaction commits, not at A's next heartbeat (a minute away here). (Before notices, A
/// learnt of it only from its heartbeat's look for abort requests, every 10 s by default.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_requested_through_another_node_reaches_the_attempt_before_its_next_heartbeat() {
    let Some(url) = url() else { return };
    let schema = fresh_schema();
    let model = waiting_model();
    let a = node_that_looks_once_a_minute(PostgresStore::connect_with_schema(&url, &schema).await.unwrap(), &model);
    let b = node_that_looks_once_a_minute(
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap(),
        &waiting_model(),
    );
    let id = dispatch_and_wait_for_the_tool(&a, "w").await;
    assert!(
        b.init(&waiter, "w").abort().await.unwrap(),
        "node B stamped the abort intent"
    );
    let result = tokio::time::timeout(Duration::from_secs(10), a.init(&waiter, "w").read(&id)).await;
    assert_eq!(outcome(result), "submission_aborted");
}

/// The Postgres store without its notices: a node on it learns what other nodes did only
/// through its own looks (its heartbeat, its scan, its waits' polls), as when notices are lost.
struct Unannounced {
    inner: PostgresStore,
}

impl Store for Unannounced {
    harness::delegate_store!(
        inner;
        admit, instance, submission, has_queued, claim_next, renew_leases, expired, reclaim,
        aborts_requested, instances_with_queued, claim_joinable, finalize_join, revert_joins, settle, requeue,
        request_abort, append, read, put_attachment, attachment, user_value, set_user_value,
        list_user_values, create_child, shared, settled_among,
    );
}

// ---- request_abort racing claim (one node) -----------------------------------------------------

/// The Postgres store, with its `read` held for a while once `hold` is set: widens the window
/// between an attempt's claim and the moment it becomes the slot's running attempt.
struct SlowRead {
    inner: PostgresStore,
    hold: Arc<AtomicBool>,
}

impl Store for SlowRead {
    harness::delegate_store!(
        inner;
        admit, instance, submission, has_queued, claim_next, renew_leases, expired, reclaim,
        aborts_requested, instances_with_queued, claim_joinable, finalize_join, revert_joins, settle, requeue,
        request_abort, append, put_attachment, attachment, user_value, set_user_value,
        list_user_values, create_child,
    );

    fn read(&self, k: &InstanceKey, after: Option<u64>) -> BoxFuture<'_, Result<Vec<Batch>, StoreError>> {
        let hold = self.hold.swap(false, Ordering::SeqCst);
        let read = self.inner.read(k, after);
        Box::pin(async move {
            if hold {
                tokio::time::sleep(Duration::from_millis(1500)).await;
            }
            read.await
        })
    }
    fn shared(&self) -> bool {
        true
    }
}

/// A node whose first store read after its claim is held (see [`SlowRead`]), and a dispatch
/// to its instance `racing`, returned once the claim committed: the attempt is claimed but
/// not started. Its model answers `done`.
async fn claimed_not_started(url: &str, schema: &str) -> (Runtime, String) {
    let hold = Arc::new(AtomicBool::new(false));
    let store = SlowRead {
        inner: PostgresStore::connect_with_schema(url, schema).await.unwrap(),
        hold: hold.clone(),
    };
    let runtime = node(store, &ScriptedModel::new([ScriptedReply::text("done")]));
    let observer = PostgresStore::connect_with_schema(url, schema).await.unwrap();
    hold.store(true, Ordering::SeqCst);
    let receipt = runtime.init(&waiter, "racing").dispatch("go").await.unwrap();
    // Wait until the worker's claim committed (its store read is now held).
    loop {
        let row = observer.submission(&receipt.submission_id).await.unwrap().unwrap();
        if row.status == SubmissionStatus::Running {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (runtime, receipt.submission_id)
}

/// §3.7 step 1 / §3.10: an abort requested once the row is `running` (claimed) but before the
/// attempt has installed its abort signal is stamped on the row and answered `aborted: true`,
/// and the attempt settles aborted. (Regression: the attempt ran to completion, deciding on the
/// `abort_requested` of its claim snapshot, while `abort_running` found no attempt to signal.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_landing_between_claim_and_attempt_start_is_not_lost() {
    let Some(url) = url() else { return };
    let (runtime, id) = claimed_not_started(&url, &fresh_schema()).await;
    let handle = runtime.init(&waiter, "racing");
    assert!(
        handle.abort().await.unwrap(),
        "the abort intent was stamped on the running row"
    );
    let result = tokio::time::timeout(Duration::from_secs(10), handle.read(&id)).await;
    assert_eq!(outcome(result), "submission_aborted");
}

/// The same race, the abort requested through another node: the running node learns of it
/// from its heartbeat while its attempt is claimed but not started, and the attempt settles
/// aborted without running. (Regression: the heartbeat signalled running attempts only, and
/// the answer for one about to start was dropped; the attempt ran to completion.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_requested_through_another_node_before_the_attempt_starts_is_not_lost() {
    let Some(url) = url() else { return };
    let schema = fresh_schema();
    let (a, id) = claimed_not_started(&url, &schema).await;
    let b = node(
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap(),
        &ScriptedModel::new([ScriptedReply::text("done on b")]),
    );
    assert!(
        b.init(&waiter, "racing").abort().await.unwrap(),
        "node B stamped the abort intent"
    );
    let result = tokio::time::timeout(Duration::from_secs(10), a.init(&waiter, "racing").read(&id)).await;
    assert_eq!(outcome(result), "submission_aborted");
}

// ---- a lease lost to another node -------------------------------------------------------------

/// A node whose renewals failed past its lease finds, once it reaches the database again,
/// that another node took the lease over: its attempt stops (its tool sees the abort signal)
/// instead of running on beside the other node's. (Regression: the renewal's count was
/// ignored, and the attempt ran until its next fenced write.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_whose_lease_another_node_took_over_stops_at_its_next_renewal() {
    let Some(url) = url() else { return };
    let schema = fresh_schema();
    // Node A's renewals fail while `cut` is set (a node cut off from the database, or
    // suspended, past its lease).
    let faulty = harness::faulty::FaultyStore::on(Arc::new(
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap(),
    ));
    let cut = faulty.failing_renewals.clone();
    let a = node(
        faulty,
        &ScriptedModel::new([
            ScriptedReply::tool_call("hold", json!({})),
            ScriptedReply::text("never"),
        ]),
    );
    let mut events = a.observe();
    let receipt = a.init(&holder, "held").dispatch("go").await.unwrap();
    let started = async {
        loop {
            if let Event::ToolStart { .. } = events.recv().await.unwrap().event {
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), started)
        .await
        .expect("the tool started on node A within 10 s");
    let stopped_before = HOLDS_STOPPED.load(Ordering::SeqCst);
    cut.store(true, Ordering::SeqCst);
    // Node B takes the expired lease over (2 s) and answers the submission.
    let b = node(
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap(),
        &ScriptedModel::new([ScriptedReply::text("answered by b")]),
    );
    b.start().await;
    let read = tokio::time::timeout(
        Duration::from_secs(10),
        b.init(&holder, "held").read(&receipt.submission_id),
    )
    .await;
    assert_eq!(outcome(read), "completed: \"answered by b\"");
    assert_eq!(
        HOLDS_STOPPED.load(Ordering::SeqCst),
        stopped_before,
        "node A's tool still runs"
    );
    cut.store(false, Ordering::SeqCst);
    let stopped = async {
        while HOLDS_STOPPED.load(Ordering::SeqCst) == stopped_before {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), stopped)
        .await
        .expect("node A's attempt stopped once its renewal found the lease taken over");
}

/// The Postgres store, whose look for abort requests takes longer than a lease.
struct SlowAbortLook {
    inner: PostgresStore,
}

impl Store for SlowAbortLook {
    harness::delegate_store!(
        inner;
        admit, instance, submission, has_queued, claim_next, renew_leases, expired, reclaim,
        instances_with_queued, claim_joinable, finalize_join, revert_joins, settle, requeue,
        request_abort, append, read, put_attachment, attachment, user_value, set_user_value,
        list_user_values, create_child, settled_among,
    );

    fn aborts_requested(&self, attempts: &[String]) -> BoxFuture<'_, Result<Vec<String>, StoreError>> {
        let look = self.inner.aborts_requested(attempts);
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(2500)).await;
            look.await
        })
    }
    fn shared(&self) -> bool {
        true
    }
}

/// A slow look for abort requests (a saturated pool) does not delay the heartbeat's lease
/// renewals: the lease stays the running node's, and no other node takes it over.
/// (Regression: both went one after the other in one loop, and a look longer than the lease
/// let the lease lapse between two successful renewals.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_look_for_abort_requests_does_not_let_a_live_lease_lapse() {
    let Some(url) = url() else { return };
    let schema = fresh_schema();
    let a = node(
        SlowAbortLook {
            inner: PostgresStore::connect_with_schema(&url, &schema).await.unwrap(),
        },
        &waiting_model(),
    );
    let id = dispatch_and_wait_for_the_tool(&a, "w").await;
    let b = node(
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap(),
        &waiting_model(),
    );
    b.start().await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let store = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
    let row = store.submission(&id).await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.attempt_count),
        (SubmissionStatus::Running, 1),
        "{row:?}"
    );
    assert!(a.init(&waiter, "w").abort().await.unwrap());
}

// ---- waiting for a submission another node runs -------------------------------------------------

/// A send through node B to an instance node A is busy with: B cannot claim it, and A, which
/// carries on with the instance's queue, runs B's message too. B's `send` (and `read`) must
/// still return: only the node that settles a submission wakes its own waiters, so B reads
/// the shared store again while it waits. Node B hears no notices here (see [`Unannounced`]):
/// its poll is what finds the settlement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_answered_by_another_node_returns_its_reply() {
    let Some(url) = url() else { return };
    let schema = fresh_schema();
    // B's own scan would take the message over only after a minute: A runs it.
    let b = node_scanning_every(
        Unannounced {
            inner: PostgresStore::connect_with_schema(&url, &schema).await.unwrap(),
        },
        &ScriptedModel::new([ScriptedReply::text("second done")]),
        Duration::from_secs(60),
    );
    send_answered_by_another_node(&url, &schema, b).await;
}

/// The notice path: node B's send, waiting for a submission node A runs, returns as A's
/// settlement commits, not at B's next look at the store (a minute away here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_waiting_on_another_node_returns_at_its_settlement_not_at_the_next_poll() {
    let Some(url) = url() else { return };
    let schema = fresh_schema();
    let b = node_that_looks_once_a_minute(
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap(),
        &ScriptedModel::new([ScriptedReply::text("second done")]),
    );
    send_answered_by_another_node(&url, &schema, b).await;
}

/// Node B's send (within 10 s) to an instance node A is busy with, and a read through B of
/// A's own submission.
async fn send_answered_by_another_node(url: &str, schema: &str, b: Runtime) {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("pause", json!({})),
        ScriptedReply::text("first done"),
        ScriptedReply::text("second done"),
    ]);
    let a = node(PostgresStore::connect_with_schema(url, schema).await.unwrap(), &model);
    let mut events = a.observe();
    let first = a.init(&pauser, "busy").dispatch("go").await.unwrap();
    loop {
        if let Event::ToolStart { .. } = events.recv().await.unwrap().event {
            break;
        }
    }
    let sent = tokio::time::timeout(Duration::from_secs(10), b.init(&pauser, "busy").send("next"))
        .await
        .expect("B's send returned within 10 s")
        .unwrap();
    // The message joined A's live response at its turn boundary, or ran after it: either
    // way, B's answer is the one A's node reads.
    let on_a = a.init(&pauser, "busy").read(&sent.submission_id).await.unwrap();
    assert_eq!(sent, on_a);
    assert!(["first done", "second done"].contains(&sent.text.as_str()), "{sent:?}");
    let read = tokio::time::timeout(
        Duration::from_secs(10),
        b.init(&pauser, "busy").read(&first.submission_id),
    )
    .await;
    assert_eq!(outcome(read), "completed: \"first done\"");
}

/// Waits (at most 10 s) until `count` nodes of `schema` listen for notices.
async fn listening_connections(url: &str, schema: &str, count: i64) {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let listening = format!("flue notices {schema}");
    let up = async {
        loop {
            let sessions: i64 = client
                .query_one(
                    "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = $1",
                    &[&listening],
                )
                .await
                .unwrap()
                .get(0);
            if sessions >= count {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), up)
        .await
        .expect("the nodes listen for notices");
}

/// A node whose listening connection was lost looks at everything again once it is back: an
/// abort stamped meanwhile, which no notice announced, stops its attempt then (not at its next
/// heartbeat, a minute away here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_listening_connection_was_lost_looks_again_once_it_is_back() {
    let Some(url) = url() else { return };
    let schema = fresh_schema();
    let model = waiting_model();
    let a = node_that_looks_once_a_minute(PostgresStore::connect_with_schema(&url, &schema).await.unwrap(), &model);
    let id = dispatch_and_wait_for_the_tool(&a, "w").await;
    listening_connections(&url, &schema, 1).await;
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let listening = format!("flue notices {schema}");
    // Its first look (as it connected) is over before the intent is stamped.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // An abort intent stamped behind the nodes' backs: no notice announces it.
    let stamped = client
        .execute(
            &format!("UPDATE \"{schema}\".flue_submissions SET abort_requested = TRUE WHERE id = $1"),
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(stamped, 1);
    // Node A's listening connection is lost, and made again.
    client
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
            &[&listening],
        )
        .await
        .unwrap();
    let result = tokio::time::timeout(Duration::from_secs(10), a.init(&waiter, "w").read(&id)).await;
    assert_eq!(outcome(result), "submission_aborted");
    // The listening connection is back.
    listening_connections(&url, &schema, 1).await;
}

/// The notice path: what a node gives back ([`Runtime::release`], as a rolling deploy does)
/// is taken over by another node as the requeue commits, not at that node's next scan (a
/// minute away here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_a_node_gives_back_is_taken_over_by_another_at_once() {
    let Some(url) = url() else { return };
    let schema = fresh_schema();
    let a = node_that_looks_once_a_minute(
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap(),
        &waiting_model(),
    );
    let b = node_that_looks_once_a_minute(
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap(),
        &ScriptedModel::new([ScriptedReply::text("done on B")]),
    );
    b.start().await;
    // B's listening connection is up (and its first look, as it connected, done) before A
    // admits anything: B would otherwise race A for the dispatch.
    listening_connections(&url, &schema, 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let id = dispatch_and_wait_for_the_tool(&a, "w").await;
    assert_eq!(a.release().await, 1, "node A gave its running submission back");
    // And its process exits: the requeue's notice went out before `release` returned.
    drop(a);
    let result = tokio::time::timeout(Duration::from_secs(10), b.init(&waiter, "w").read(&id)).await;
    assert_eq!(outcome(result), "completed: \"done on B\"");
}

// ---- notices between stores ----------------------------------------------------------------------

/// Receives notices (at most 10 s) until `done` says they are all there.
async fn notices_until(
    notices: &mut tokio::sync::broadcast::Receiver<StoreNotice>,
    mut done: impl FnMut(&StoreNotice) -> bool,
) {
    let all = async {
        loop {
            if done(&notices.recv().await.unwrap()) {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), all)
        .await
        .expect("the notices arrived within 10 s");
}

/// Settlements made in a burst are all announced (many to one transaction while the listening
/// connection is busy), to the stores of the same schema only, and not back to the store that
/// made them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_settlements_is_announced_whole_to_the_same_schema_only() {
    let Some(url) = url() else { return };
    let schema = fresh_schema();
    let settling = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
    let hearing = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
    let elsewhere = PostgresStore::connect_with_schema(&url, &fresh_schema()).await.unwrap();
    let mut own = settling.notices().unwrap();
    let mut heard = hearing.notices().unwrap();
    let mut other = elsewhere.notices().unwrap();
    for receiver in [&mut own, &mut heard, &mut other] {
        notices_until(receiver, |notice| *notice == StoreNotice::Resync).await;
    }
    let keys: Vec<InstanceKey> = (0..100)
        .map(|n| InstanceKey::new("assistant", format!("burst-{n}")))
        .collect();
    for (n, key) in keys.iter().enumerate() {
        let id = format!("s-{n}");
        settling.admit(harness::admission(key, &id, "hi")).await.unwrap();
        settling
            .claim_next(key, &claim(&format!("a-{n}"), "node", 30_000))
            .await
            .unwrap()
            .unwrap();
        let attempt = flue_runtime::store::AttemptRef {
            submission_id: id,
            attempt_id: format!("a-{n}"),
        };
        settling
            .settle(&attempt, flue_runtime::record::Outcome::Completed, None, Vec::new())
            .await
            .unwrap();
    }
    let mut missing: std::collections::HashSet<InstanceKey> = keys.into_iter().collect();
    notices_until(&mut heard, |notice| {
        if let StoreNotice::Settled(key) = notice {
            missing.remove(key);
        }
        missing.is_empty()
    })
    .await;
    // A notice from another store of the schema, after all of them: what the settling store
    // heard before it is all it could hear of its own.
    let marker = InstanceKey::new("assistant", "marker");
    hearing.admit(harness::admission(&marker, "m", "hi")).await.unwrap();
    hearing.request_abort(&marker).await.unwrap();
    let mut before_marker = Vec::new();
    notices_until(&mut own, |notice| {
        let end = *notice == StoreNotice::AbortRequested(marker.clone());
        if !end {
            before_marker.push(notice.clone());
        }
        end
    })
    .await;
    assert_eq!(before_marker, [], "the settling store heard its own announcements");
    let mut stray = Vec::new();
    while let Ok(notice) = other.try_recv() {
        stray.push(notice);
    }
    assert!(stray.is_empty(), "another schema's store heard {stray:?}");
}

/// Announcements a node drops (more than its queue holds, made faster than it sends them) are
/// made up for: the other nodes are told to look at everything again, rather than left to
/// their own looks (seconds away) to find the changes.
#[tokio::test(flavor = "current_thread")]
async fn announcements_a_node_drops_are_made_up_for_by_a_resync() {
    let Some(url) = url() else { return };
    let schema = fresh_schema();
    let announcing = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
    let hearing = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
    let mut own = announcing.notices().unwrap();
    let mut heard = hearing.notices().unwrap();
    for receiver in [&mut own, &mut heard] {
        notices_until(receiver, |notice| *notice == StoreNotice::Resync).await;
    }
    // On this one thread the listening task cannot send while the burst is made: its queue
    // fills, and the rest of the burst is dropped.
    let burst = 3_000;
    for n in 0..burst {
        announcing.announce(StoreNotice::Queued(InstanceKey::new("assistant", format!("q-{n}"))));
    }
    let mut queued = 0;
    notices_until(&mut heard, |notice| {
        if matches!(notice, StoreNotice::Queued(_)) {
            queued += 1;
        }
        *notice == StoreNotice::Resync
    })
    .await;
    assert!(queued < burst, "{queued} of {burst} announced: none was dropped");
}

/// The notice path: a node shutting down finishes what it runs and leaves its instance's queue
/// to the others, which take it up at once, not at their next scan (a minute away here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_a_stopping_node_leaves_is_taken_up_by_another_at_once() {
    let Some(url) = url() else { return };
    let schema = fresh_schema();
    let a = node_that_looks_once_a_minute(
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap(),
        &ScriptedModel::new([ScriptedReply::tool_call("pause", json!({}))]),
    );
    let b = node_that_looks_once_a_minute(
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap(),
        &ScriptedModel::new([ScriptedReply::text("second done on B")]),
    );
    b.start().await;
    // B's listening connection is up (and its first look done) before A admits anything.
    listening_connections(&url, &schema, 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut events = a.observe();
    let first = a.init(&one_step, "q").dispatch("go").await.unwrap();
    loop {
        if let Event::ToolStart { .. } = events.recv().await.unwrap().event {
            break;
        }
    }
    // Queued behind the running response (which cannot take it in), then A stops.
    let second = a.init(&one_step, "q").dispatch("next").await.unwrap();
    a.shutdown();
    let read = tokio::time::timeout(
        Duration::from_secs(10),
        b.init(&one_step, "q").read(&first.submission_id),
    )
    .await;
    assert_eq!(outcome(read), "completed: \"\"", "A finishes what it runs");
    let read = tokio::time::timeout(
        Duration::from_secs(10),
        b.init(&one_step, "q").read(&second.submission_id),
    )
    .await;
    assert_eq!(outcome(read), "completed: \"second done on B\"");
}

/// The notice path: an SSE reader on node B, following an instance node A runs, sees the
/// response end as A's settlement commits, not at its next poll of the store (a minute away
/// here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_reader_on_another_node_sees_the_response_end_at_its_settlement() {
    use futures_util::StreamExt;
    let Some(url) = url() else { return };
    let schema = fresh_schema();
    let a = node_that_looks_once_a_minute(
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap(),
        &ScriptedModel::new([ScriptedReply::text("first"), ScriptedReply::text("answer from A")]),
    );
    let b = node_that_looks_once_a_minute(
        PostgresStore::connect_with_schema(&url, &schema).await.unwrap(),
        &ScriptedModel::new([]),
    );
    b.start().await;
    a.init(&pauser, "live").send("hi").await.unwrap();
    let app = flue_runtime::http::router_with(
        &b,
        flue_runtime::http::HttpOptions {
            shared_store_poll: Duration::from_secs(60),
            ..flue_runtime::http::HttpOptions::default()
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    // B's listening connection is up before A's second response.
    listening_connections(&url, &schema, 2).await;
    let response = reqwest::get(format!(
        "http://{addr}/agents/pauser/live?view=updates&offset=-1&live=sse"
    ))
    .await
    .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.bytes_stream();
    let mut seen = String::new();
    // Up to date first (caught up with the first response), then A answers again.
    while !seen.contains("upToDate") {
        let chunk = tokio::time::timeout(Duration::from_secs(10), body.next())
            .await
            .unwrap();
        seen.push_str(std::str::from_utf8(&chunk.unwrap().unwrap()).unwrap());
    }
    a.init(&pauser, "live").send("again").await.unwrap();
    let answered = async {
        while !seen.contains("answer from A") {
            let chunk = body.next().await.unwrap().unwrap();
            seen.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    };
    tokio::time::timeout(Duration::from_secs(10), answered)
        .await
        .expect("B's reader saw A's answer within 10 s");
}
