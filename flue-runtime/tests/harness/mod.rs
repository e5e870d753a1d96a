//! What the runtime's integration tests share: a runtime on the memory store (or a given
//! store) with the scripted model, and readers of the requests the model received.
#![allow(dead_code, clippy::unwrap_used)] // each test file uses a part; tests assert by unwrapping

pub mod faulty;
pub mod logs;

use flue_runtime::prelude::*;
use flue_runtime::provider::{ModelMessage, ModelRequest, ProviderRegistry};
use flue_runtime::store::{MemoryStore, Store};
use flue_runtime::testing::ScriptedModel;
use flue_runtime::{Runtime, RuntimeOptions};

/// About 100 estimated tokens of `word`.
pub fn long(word: &str) -> String {
    format!("{word} ").repeat(80)
}

/// `spec` with threshold compaction at a 100-token reserve, keeping `keep_recent` tokens.
pub fn use_tight_model(spec: &'static str, keep_recent: u32) {
    use_tight_model_summarized_by(spec, keep_recent, None);
}

/// [`use_tight_model`] whose summaries the model `summarizer` makes (`None`: `spec`'s).
pub fn use_tight_model_summarized_by(spec: &'static str, keep_recent: u32, summarizer: Option<&str>) {
    use_model_with(
        spec,
        ModelOptions {
            compaction: Compaction::Threshold(CompactionConfig {
                reserve_tokens: Some(100),
                keep_recent_tokens: Some(keep_recent),
                model: summarizer.map(str::to_owned),
            }),
            ..ModelOptions::default()
        },
    );
}

/// `tool` (a [`Tool::new`] builder) made to dispatch `message` to its own instance through
/// `dispatch` when it is called, answering with the receipt's submission id: a tool that
/// queues a delivery in the middle of a response, as the join tests need.
pub fn dispatching(
    tool: flue_core::tool::ToolBuilder,
    dispatch: Dispatcher,
    message: impl Into<flue_runtime::message::DeliveredMessage>,
) -> Tool {
    let message = message.into();
    tool.run(move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
        let (dispatch, message) = (dispatch.clone(), message.clone());
        async move {
            let receipt = dispatch
                .dispatch(message)
                .await
                .map_err(|error| ToolError::new(error.to_string()))?;
            Ok::<_, ToolError>(receipt.submission_id)
        }
    })
}

/// A runtime on `store` running `agents` with `model` (retries without waiting).
pub fn runtime_on(store: impl Store, model: &ScriptedModel, agents: impl IntoIterator<Item = AgentRef>) -> Runtime {
    let options = RuntimeOptions {
        model_retry_delay: std::time::Duration::from_millis(1),
        store_retry_delay: std::time::Duration::from_millis(1),
        ..RuntimeOptions::default()
    };
    runtime_on_with(store, model, agents, options)
}

/// [`runtime_on`] with `options`.
pub fn runtime_on_with(
    store: impl Store,
    model: &ScriptedModel,
    agents: impl IntoIterator<Item = AgentRef>,
    options: RuntimeOptions,
) -> Runtime {
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    let mut builder = Runtime::builder().store(store).providers(providers).options(options);
    for agent in agents {
        builder = builder.agent(agent);
    }
    builder.build().unwrap()
}

/// The type and message of a failed run; panics on any other error.
pub fn run_error(error: flue_runtime::RuntimeError) -> (String, String) {
    match error {
        flue_runtime::RuntimeError::Run {
            error_type, message, ..
        } => (error_type, message),
        other => panic!("expected a run error, got {other}"),
    }
}

/// [`runtime_on`] the memory store.
pub fn runtime_with(model: &ScriptedModel, agents: impl IntoIterator<Item = AgentRef>) -> Runtime {
    runtime_on(MemoryStore::new(), model, agents)
}

/// The text of every user message a request carries, oldest first.
pub fn user_texts(request: &ModelRequest) -> Vec<String> {
    request
        .messages
        .iter()
        .filter_map(|message| match message {
            ModelMessage::User { content, .. } => Some(content.clone()),
            _ => None,
        })
        .collect()
}

/// Every tool result a request carries, as (content, is_error), oldest first.
pub fn tool_results(request: &ModelRequest) -> Vec<(String, bool)> {
    request
        .messages
        .iter()
        .filter_map(|message| match message {
            ModelMessage::Tool { content, is_error, .. } => Some((content.clone(), *is_error)),
            _ => None,
        })
        .collect()
}

/// The results of the request's last tool batch (those answering its last step with calls).
pub fn last_batch_results(request: &ModelRequest) -> Vec<(String, bool)> {
    let all = tool_results(request);
    let calls = request
        .messages
        .iter()
        .rev()
        .find_map(|message| match message {
            ModelMessage::Assistant { tool_calls, .. } if !tool_calls.is_empty() => Some(tool_calls.len()),
            _ => None,
        })
        .unwrap_or(0);
    all[all.len().saturating_sub(calls)..].to_vec()
}

/// A direct admission of `text` to `key` as submission `id`, with the defaults a dispatch has
/// (any incarnation, 10 attempts, an hour), claiming nothing.
pub fn admission(key: &flue_runtime::store::InstanceKey, id: &str, text: &str) -> flue_runtime::store::Admission {
    use flue_runtime::store::{Admission, SubmissionKind, UidCondition};
    Admission {
        key: key.clone(),
        submission_id: id.into(),
        keyed: false,
        kind: SubmissionKind::Dispatch,
        message: flue_runtime::message::DeliveredMessage::user(text),
        initial_data: None,
        uid: UidCondition::Any,
        max_attempts: 10,
        timeout_ms: 3_600_000,
        claim: None,
        trace: None,
    }
}

/// Inside `impl Store for Wrapper`, hands each listed method to the store in `self.$inner`
/// unchanged: a wrapper writes only the methods it intercepts (a fault, a pause, a delay).
#[allow(unused_macros)] // each test file uses a part of the harness
macro_rules! delegate_store {
    ($inner:ident; $($method:ident),+ $(,)?) => {
        $( $crate::harness::delegate_store!(@one $inner $method); )+
    };
    (@one $inner:ident admit) => {
        fn admit(&self, a: flue_runtime::store::Admission) -> flue_runtime::BoxFuture<'_, Result<flue_runtime::store::Admitted, flue_runtime::store::StoreError>> {
            self.$inner.admit(a)
        }
    };
    (@one $inner:ident instance) => {
        fn instance(&self, k: &flue_runtime::store::InstanceKey) -> flue_runtime::BoxFuture<'_, Result<Option<flue_runtime::store::InstanceInfo>, flue_runtime::store::StoreError>> {
            self.$inner.instance(k)
        }
    };
    (@one $inner:ident submission) => {
        fn submission(&self, id: &str) -> flue_runtime::BoxFuture<'_, Result<Option<flue_runtime::store::Submission>, flue_runtime::store::StoreError>> {
            self.$inner.submission(id)
        }
    };
    (@one $inner:ident settled_among) => {
        fn settled_among<'a>(&'a self, ids: &'a [String]) -> flue_runtime::BoxFuture<'a, Result<Vec<String>, flue_runtime::store::StoreError>> {
            self.$inner.settled_among(ids)
        }
    };
    (@one $inner:ident has_queued) => {
        fn has_queued(&self, k: &flue_runtime::store::InstanceKey) -> flue_runtime::BoxFuture<'_, Result<bool, flue_runtime::store::StoreError>> {
            self.$inner.has_queued(k)
        }
    };
    (@one $inner:ident claim_next) => {
        fn claim_next(&self, k: &flue_runtime::store::InstanceKey, c: &flue_runtime::store::Claim) -> flue_runtime::BoxFuture<'_, Result<Option<flue_runtime::store::Submission>, flue_runtime::store::StoreError>> {
            self.$inner.claim_next(k, c)
        }
    };
    (@one $inner:ident renew_leases) => {
        fn renew_leases(&self, o: &str, a: &[String], l: u64) -> flue_runtime::BoxFuture<'_, Result<u64, flue_runtime::store::StoreError>> {
            self.$inner.renew_leases(o, a, l)
        }
    };
    (@one $inner:ident expired) => {
        fn expired(&self, n: u64) -> flue_runtime::BoxFuture<'_, Result<Vec<flue_runtime::store::Submission>, flue_runtime::store::StoreError>> {
            self.$inner.expired(n)
        }
    };
    (@one $inner:ident reclaim) => {
        fn reclaim(&self, id: &str, s: &str, c: &flue_runtime::store::Claim, n: u64) -> flue_runtime::BoxFuture<'_, Result<Option<flue_runtime::store::Submission>, flue_runtime::store::StoreError>> {
            self.$inner.reclaim(id, s, c, n)
        }
    };
    (@one $inner:ident aborts_requested) => {
        fn aborts_requested(&self, a: &[String]) -> flue_runtime::BoxFuture<'_, Result<Vec<String>, flue_runtime::store::StoreError>> {
            self.$inner.aborts_requested(a)
        }
    };
    (@one $inner:ident instances_with_queued) => {
        fn instances_with_queued(&self) -> flue_runtime::BoxFuture<'_, Result<Vec<flue_runtime::store::InstanceKey>, flue_runtime::store::StoreError>> {
            self.$inner.instances_with_queued()
        }
    };
    (@one $inner:ident claim_joinable) => {
        fn claim_joinable(&self, h: &flue_runtime::store::AttemptRef) -> flue_runtime::BoxFuture<'_, Result<Vec<flue_runtime::store::Submission>, flue_runtime::store::StoreError>> {
            self.$inner.claim_joinable(h)
        }
    };
    (@one $inner:ident finalize_join) => {
        fn finalize_join(&self, h: &flue_runtime::store::AttemptRef, id: &str) -> flue_runtime::BoxFuture<'_, Result<bool, flue_runtime::store::StoreError>> {
            self.$inner.finalize_join(h, id)
        }
    };
    (@one $inner:ident revert_joins) => {
        fn revert_joins(&self, h: &flue_runtime::store::AttemptRef) -> flue_runtime::BoxFuture<'_, Result<usize, flue_runtime::store::StoreError>> {
            self.$inner.revert_joins(h)
        }
    };
    (@one $inner:ident settle) => {
        fn settle(
            &self,
            h: &flue_runtime::store::AttemptRef,
            o: flue_runtime::record::Outcome,
            e: Option<flue_runtime::record::SettlementError>,
            r: Vec<flue_runtime::record::Record>,
        ) -> flue_runtime::BoxFuture<'_, Result<bool, flue_runtime::store::StoreError>> {
            self.$inner.settle(h, o, e, r)
        }
    };
    (@one $inner:ident requeue) => {
        fn requeue(&self, a: &flue_runtime::store::AttemptRef) -> flue_runtime::BoxFuture<'_, Result<bool, flue_runtime::store::StoreError>> {
            self.$inner.requeue(a)
        }
    };
    (@one $inner:ident request_abort) => {
        fn request_abort(&self, k: &flue_runtime::store::InstanceKey) -> flue_runtime::BoxFuture<'_, Result<Vec<String>, flue_runtime::store::StoreError>> {
            self.$inner.request_abort(k)
        }
    };
    (@one $inner:ident append) => {
        fn append(
            &self,
            k: &flue_runtime::store::InstanceKey,
            r: std::sync::Arc<[flue_runtime::record::Record]>,
            a: Option<&flue_runtime::store::AttemptRef>,
        ) -> flue_runtime::BoxFuture<'_, Result<u64, flue_runtime::store::StoreError>> {
            self.$inner.append(k, r, a)
        }
    };
    (@one $inner:ident create_child) => {
        fn create_child(
            &self,
            p: &flue_runtime::store::InstanceKey,
            l: std::sync::Arc<[flue_runtime::record::Record]>,
            c: &flue_runtime::store::InstanceKey,
            b: std::sync::Arc<[flue_runtime::record::Record]>,
            a: Option<&flue_runtime::store::AttemptRef>,
        ) -> flue_runtime::BoxFuture<'_, Result<u64, flue_runtime::store::StoreError>> {
            self.$inner.create_child(p, l, c, b, a)
        }
    };
    (@one $inner:ident read) => {
        fn read(&self, k: &flue_runtime::store::InstanceKey, after: Option<u64>) -> flue_runtime::BoxFuture<'_, Result<Vec<flue_runtime::record::Batch>, flue_runtime::store::StoreError>> {
            self.$inner.read(k, after)
        }
    };
    (@one $inner:ident read_page) => {
        fn read_page(&self, k: &flue_runtime::store::InstanceKey, after: Option<u64>, limit: usize) -> flue_runtime::BoxFuture<'_, Result<Vec<flue_runtime::record::Batch>, flue_runtime::store::StoreError>> {
            self.$inner.read_page(k, after, limit)
        }
    };
    (@one $inner:ident last_offset) => {
        fn last_offset(&self, k: &flue_runtime::store::InstanceKey) -> flue_runtime::BoxFuture<'_, Result<Option<u64>, flue_runtime::store::StoreError>> {
            self.$inner.last_offset(k)
        }
    };
    (@one $inner:ident put_attachment) => {
        fn put_attachment(&self, k: &flue_runtime::store::InstanceKey, a: flue_runtime::store::AttachmentPut) -> flue_runtime::BoxFuture<'_, Result<(), flue_runtime::store::StoreError>> {
            self.$inner.put_attachment(k, a)
        }
    };
    (@one $inner:ident attachment) => {
        fn attachment(&self, k: &flue_runtime::store::InstanceKey, id: &str) -> flue_runtime::BoxFuture<'_, Result<Option<flue_runtime::store::StoredAttachment>, flue_runtime::store::StoreError>> {
            self.$inner.attachment(k, id)
        }
    };
    (@one $inner:ident user_value) => {
        fn user_value(&self, user_id: &str, key: &str) -> flue_runtime::BoxFuture<'_, Result<Option<flue_runtime::lifecycle::UserValue>, flue_runtime::store::StoreError>> {
            self.$inner.user_value(user_id, key)
        }
    };
    (@one $inner:ident set_user_value) => {
        fn set_user_value(&self, user_id: &str, key: &str, value: Option<serde_json::Value>, updated_at: i64) -> flue_runtime::BoxFuture<'_, Result<(), flue_runtime::store::StoreError>> {
            self.$inner.set_user_value(user_id, key, value, updated_at)
        }
    };
    (@one $inner:ident list_user_values) => {
        fn list_user_values(&self, user_id: &str, query: &flue_runtime::lifecycle::UserValuesQuery) -> flue_runtime::BoxFuture<'_, Result<flue_runtime::lifecycle::UserValuePage, flue_runtime::store::StoreError>> {
            self.$inner.list_user_values(user_id, query)
        }
    };
    (@one $inner:ident shared) => {
        fn shared(&self) -> bool {
            self.$inner.shared()
        }
    };
    (@one $inner:ident notices) => {
        fn notices(&self) -> Option<tokio::sync::broadcast::Receiver<flue_runtime::store::StoreNotice>> {
            self.$inner.notices()
        }
    };
    (@one $inner:ident flush_announcements) => {
        fn flush_announcements(&self) -> flue_runtime::BoxFuture<'_, ()> {
            self.$inner.flush_announcements()
        }
    };
    (@one $inner:ident announce) => {
        fn announce(&self, notice: flue_runtime::store::StoreNotice) {
            self.$inner.announce(notice)
        }
    };
}
#[allow(unused_imports)]
pub(crate) use delegate_store;

/// The test database's URL (`FLUE_TEST_POSTGRES_URL`, which `.ci/test` sets after starting a
/// throwaway server), or `None` with a note when it is not set. Under CI it must be: a
/// Postgres test that skipped there would check nothing, so `what` fails instead.
pub fn postgres_url(what: &str) -> Option<String> {
    let url = std::env::var("FLUE_TEST_POSTGRES_URL")
        .ok()
        .filter(|url| !url.is_empty());
    if url.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "FLUE_TEST_POSTGRES_URL is not set: under CI {what} must run (use .ci/test)"
        );
        eprintln!("note: FLUE_TEST_POSTGRES_URL is not set; skipping {what} (run .ci/test)");
    }
    url
}

/// Runs `test` on `cases` inputs drawn from `strategy` (or on `FLUE_PROPERTY_CASES` inputs,
/// when that is set: a longer hunt without editing the test), each through `block_on` of one
/// current-thread tokio runtime made for the run; a failure panics with its reason and the
/// shortest failing input the shrinking found (`input` names it: "sequence",
/// "conversation"), printed whole.
pub fn check_property<S, F>(cases: u32, strategy: &S, input: &str, test: impl Fn(S::Value) -> F)
where
    S: proptest::strategy::Strategy,
    S::Value: std::fmt::Debug,
    F: std::future::Future<Output = Result<(), proptest::test_runner::TestCaseError>>,
{
    use proptest::test_runner::{Config, TestError, TestRunner};
    let tokio = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let cases = match std::env::var("FLUE_PROPERTY_CASES") {
        Ok(count) => count
            .parse()
            .unwrap_or_else(|_| panic!("FLUE_PROPERTY_CASES is not a count of cases: {count:?}")),
        Err(_) => cases,
    };
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    match runner.run(strategy, |value| tokio.block_on(test(value))) {
        Ok(()) => {}
        Err(TestError::Fail(reason, shortest)) => {
            panic!("{reason}\nthe shortest {input} found that shows it:\n{shortest:#?}")
        }
        Err(abort) => panic!("{abort}"),
    }
}

/// A schema name no other test uses: `<prefix>_<a fresh ULID>`, lower case (tests run in
/// parallel, each in schemas of its own).
pub fn fresh_schema(prefix: &str) -> String {
    format!("{prefix}_{}", ulid::Ulid::new().to_string().to_lowercase())
}

/// Waits (at most 10 s) for a spawned `send` that an abort ended, and checks it settled as
/// aborted.
pub async fn assert_settles_aborted(
    sent: tokio::task::JoinHandle<Result<flue_runtime::AgentReply, flue_runtime::RuntimeError>>,
) {
    let error = tokio::time::timeout(std::time::Duration::from_secs(10), sent)
        .await
        .expect("the submission settles")
        .unwrap()
        .unwrap_err();
    let flue_runtime::RuntimeError::Run {
        outcome, error_type, ..
    } = error
    else {
        panic!("expected a run error, got {error}");
    };
    assert_eq!((outcome, error_type.as_str()), ("was aborted", "submission_aborted"));
}

/// A model that holds its `hold`-th call until released: `reached` is notified when the call
/// starts, and one permit added to `release` lets it go on.
pub struct Gated {
    inner: ScriptedModel,
    hold: usize,
    calls: std::sync::atomic::AtomicUsize,
    pub reached: std::sync::Arc<tokio::sync::Notify>,
    pub release: std::sync::Arc<tokio::sync::Semaphore>,
}

impl Gated {
    pub fn new(inner: ScriptedModel, hold: usize) -> Self {
        Self {
            inner,
            hold,
            calls: std::sync::atomic::AtomicUsize::new(0),
            reached: std::sync::Arc::new(tokio::sync::Notify::new()),
            release: std::sync::Arc::new(tokio::sync::Semaphore::new(0)),
        }
    }
}

impl flue_runtime::provider::ModelProvider for Gated {
    fn id(&self) -> &str {
        "scripted"
    }
    fn context_window(&self, _model: &str) -> Option<u64> {
        None
    }
    fn stream(&self, request: &ModelRequest) -> flue_runtime::provider::ModelStream {
        use futures_util::StreamExt;
        let n = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        let stream = self.inner.stream(request);
        if n != self.hold {
            return stream;
        }
        let (reached, release) = (self.reached.clone(), self.release.clone());
        Box::pin(
            futures_util::stream::once(async move {
                reached.notify_one();
                release.acquire().await.unwrap().forget();
                stream
            })
            .flatten(),
        )
    }
}

/// Weak handles on a value each render of a test agent gave to what it mounted (a tool that
/// holds it), so a test sees whether anything still holds what was rendered.
pub struct Renders(std::sync::Mutex<Vec<std::sync::Weak<()>>>);

impl Renders {
    /// No renders yet (a `static` for the agent's render function to mark).
    pub const fn new() -> Self {
        Self(std::sync::Mutex::new(Vec::new()))
    }

    /// A value for one render's tool to hold.
    pub fn mark(&self) -> std::sync::Arc<()> {
        let marker = std::sync::Arc::new(());
        self.0.lock().unwrap().push(std::sync::Arc::downgrade(&marker));
        marker
    }

    /// How many renders there were, and how many of their values are still held once nothing
    /// should hold them: the reply is sent when the submission settles and the worker drops
    /// the response just after, so this waits (a bounded while) for the count to reach zero.
    pub async fn rendered_and_held(&self) -> (usize, usize) {
        let held = || {
            self.0
                .lock()
                .unwrap()
                .iter()
                .filter(|marker| marker.strong_count() > 0)
                .count()
        };
        for _ in 0..1000 {
            if held() == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let held = held();
        (self.0.lock().unwrap().len(), held)
    }
}

/// A memory store whose attachments all read back damaged (their digest does not match).
pub struct DamagedAttachments {
    pub inner: MemoryStore,
}

impl Store for DamagedAttachments {
    delegate_store!(
        inner;
        admit, instance, submission, has_queued, claim_next, renew_leases, expired, reclaim,
        aborts_requested, instances_with_queued, claim_joinable, finalize_join, revert_joins, settle,
        requeue, request_abort, append, create_child, last_offset, read, read_page, put_attachment,
        user_value, set_user_value, list_user_values,
    );

    fn attachment(
        &self,
        _key: &flue_runtime::store::InstanceKey,
        id: &str,
    ) -> flue_runtime::BoxFuture<
        '_,
        Result<Option<flue_runtime::store::StoredAttachment>, flue_runtime::store::StoreError>,
    > {
        let id = id.to_owned();
        Box::pin(async move {
            Err(flue_runtime::store::StoreError::AttachmentIntegrity {
                detail: format!("attachment \"{id}\" does not match its declared SHA-256 digest"),
                id,
                reason: flue_runtime::store::IntegrityFailure::Digest,
            })
        })
    }
}
