//! The runtime: agents, providers and a store, and the handles that send to agent instances.

use std::collections::HashMap;

use crate::fast_map::FastMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flue_core::agent::AgentRef;
use flue_core::message::{DeliveredMessage, DispatchReceipt, MessageError};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::sync::{broadcast, oneshot};

use crate::events::RecoveryOperation::{
    EnforceDeadline, ProcessSubmission, ReconcilePass, ReconcileSubmission, StartSubmission,
};
use crate::events::RecoveryOutcome::{AgentUnavailable, Deferred};
use crate::events::{Correlation, Event, Observation};
use crate::provider::ProviderRegistry;
use crate::record::{Outcome, SettlementError, new_id, now};
use crate::session::{self, InstanceSlot, ReplyParts, Settled};
use crate::store::{
    Admission, InstanceInfo, InstanceKey, Store, StoreError, StoreNotice, SubmissionKind, SubmissionStatus,
    TraceContext, UidCondition,
};

/// Everything that can go wrong talking to the runtime.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// The agent is not registered with this runtime.
    #[error("[flue] dispatch() target agent \"{0}\" is not registered.")]
    UnknownAgent(String),
    /// A request breaks an input rule.
    #[error("{0}")]
    InvalidRequest(String),
    /// The message breaks a delivery rule.
    #[error("{0}")]
    InvalidMessage(#[from] MessageError),
    /// `uid` named an incarnation that does not exist.
    #[error("Agent instance \"{0}\" was not found.")]
    InstanceNotFound(String),
    /// Create-only send to an existing instance.
    #[error("Agent instance \"{id}\" already exists.")]
    InstanceExists {
        /// The instance id.
        id: String,
        /// Its incarnation.
        uid: String,
    },
    /// An idempotency key reused with another message, initial data or kind of send.
    #[error("Submission \"{0}\" was already admitted with a different message, initial data or kind.")]
    SubmissionConflict(String),
    /// The submission failed or was aborted.
    #[error("The submission {submission_id} {outcome}: {message}")]
    Run {
        /// The submission.
        submission_id: String,
        /// How it ended, as the error's sentence says it: `failed` or `was aborted`.
        outcome: &'static str,
        /// Stable error type.
        error_type: String,
        /// What happened.
        message: String,
        /// Detail beyond the message (may be empty).
        details: String,
        /// Structured facts about the failure, when it has any (`attemptCount` and
        /// `maxAttempts` of `submission_retry_exhausted`, say).
        meta: Option<Box<serde_json::Map<String, serde_json::Value>>>,
    },
    /// The store failed.
    #[error("{0}")]
    Store(String),
    /// The runtime could not be built.
    #[error("{0}")]
    Build(String),
    /// The runtime is shutting down and admits nothing new.
    #[error("[flue] The runtime is shutting down: it admits no new messages.")]
    ShuttingDown,
    /// The submission was admitted, but this node is stopping and will not process it: it
    /// runs when another node, or this one's next process, takes it over (read it there; do
    /// not send it again, unless under the same idempotency key).
    #[error(
        "[flue] Submission \"{submission_id}\" was admitted but not processed here: the runtime is stopping. Another node, or the next process, runs it."
    )]
    NotProcessedHere {
        /// The admitted submission.
        submission_id: String,
    },
    /// The submission was admitted (or was there to read), but its reply could not be read:
    /// the store failed every time the wait looked, for about a minute. It may have run, or
    /// run still: [`AgentHandle::read`] it again by its id (do not send it again, unless under
    /// the same idempotency key).
    #[error(
        "[flue] Submission \"{submission_id}\" was admitted, but its reply could not be read: {reason}. Read it again by its id."
    )]
    ReplyUnread {
        /// The admitted submission.
        submission_id: String,
        /// The store's last failure.
        reason: String,
    },
}

impl From<StoreError> for RuntimeError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::InstanceNotFound(id) => Self::InstanceNotFound(id),
            StoreError::InstanceExists { id, uid } => Self::InstanceExists { id, uid },
            StoreError::SubmissionConflict(id) => Self::SubmissionConflict(id),
            other => Self::Store(other.to_string()),
        }
    }
}

/// Tuning of the turn loop.
#[derive(Clone, Debug)]
pub struct RuntimeOptions {
    /// How many tool calls of one model step (its tool batch) run at once. A task's child
    /// runs its own batches under the same bound, so calls delegated from one step add to
    /// the parent's (eight `task` calls each running eight tools are 64 calls at once).
    pub tool_concurrency: usize,
    /// Retries of one model call after transient failures, in all: a built-in provider's own
    /// retries before the response streams (429s, 5xx answers, connection failures) count
    /// against it, and the turn loop retries the rest (a stream cut mid-way, an error event).
    pub model_retries: u32,
    /// Base delay of the turn loop's retries: it doubles with each retry, up to
    /// [`MAX_MODEL_RETRY_WAIT`] ([`RuntimeOptions::model_retry_wait`]); the turn loop waits
    /// a random 75–100 % of that, as the reference does, so instances that failed together do
    /// not retry together. (A built-in provider's own retries wait by its
    /// [`RetryPolicy`](crate::provider::RetryPolicy), whose default starts at the same 2 s.)
    pub model_retry_delay: Duration,
    /// How long a claim holds an instance without renewal. When a node dies, another takes
    /// its running submissions over once their leases expire.
    pub lease: Duration,
    /// How often this node renews its leases (well under `lease`; one not shorter than it is
    /// refused when the runtime is built).
    pub heartbeat: Duration,
    /// How often this node looks for expired leases and for queued work admitted elsewhere
    /// (and each send or read waiting for a submission reads the store again on its own: on
    /// a shared store, behind the node's look for all of them at
    /// [`shared_store_poll`](Self::shared_store_poll)).
    pub scan_interval: Duration,
    /// How long an instance keeps an MCP session no response used (5 min): then it is closed
    /// (by the scan, or by the next response, which connects afresh), so idle instances hold
    /// no connection, no session on the server and no stream the client keeps re-opening.
    pub mcp_session_idle: Duration,
    /// How many instances keep their folded conversation in memory between submissions. Past
    /// it, the least recently used idle instances are dropped (a quarter of the limit at a
    /// time); an evicted instance re-reads its stream from the store at its next submission.
    pub cached_instances: usize,
    /// Roughly how many bytes the cached conversations may hold together (their texts,
    /// values and images, as folded). Past it, the least recently used idle instances are
    /// dropped too, when an instance is added to the cache or a conversation grows, until
    /// they hold three quarters of it (an instance of a thousandth of that or less stays,
    /// unless the count is past too): a client creating instances with large initial data or
    /// messages does not make the node hold them all.
    pub cached_bytes: usize,
    /// How long a model step's streamed text and reasoning may wait before they are appended
    /// to the record stream while the step still streams ([`RecordBody::AssistantTextDelta`],
    /// [`RecordBody::AssistantReasoningDelta`]), which is what lets HTTP clients follow a long
    /// answer live. A step that streams for less is appended once, when it completes. `None`
    /// appends nothing until the step completes. Agents that select a `before_create_message`
    /// or `before_update_message` hook never stream this way, and keep no reasoning: those
    /// hooks decide what an answer stores and shows, so nothing they did not see is appended.
    /// `Some(Duration::ZERO)` appends what streamed at every chance, often one append per
    /// delta: a store write for each, which a durable store pays for.
    ///
    /// [`RecordBody::AssistantTextDelta`]: crate::record::RecordBody::AssistantTextDelta
    /// [`RecordBody::AssistantReasoningDelta`]: crate::record::RecordBody::AssistantReasoningDelta
    pub text_flush: Option<Duration>,
    /// How long an attempt may take to end after its abort signal fired (its timeout, an
    /// abort, the node stopping). Code that ignores the signal — a callback awaiting what never
    /// ends — is then given up where it waits and the submission settles over it, so one hung
    /// callback cannot hold its instance forever.
    pub settle_grace: Duration,
    /// On a store several nodes share (and on any store while this node stops), how often the
    /// node looks in the store for the submissions its sends (and reads) wait on that another
    /// node may settle: one read for all of them, however many wait. A store that announces
    /// other nodes' settlements ([`Store::notices`](crate::store::Store::notices):
    /// `PostgresStore` does) wakes the wait as the settlement lands; this look is then what
    /// finds one whose notice was lost.
    pub shared_store_poll: Duration,
    /// How long a submission whose attempt a store failure ended (a write or read that failed
    /// after its retries) waits before this node attempts it again: doubled for each attempt
    /// before it, at most [`MAX_MODEL_RETRY_WAIT`], a random 75–100 % of that. Without it, a
    /// store down for a second would spend the submission's whole attempt budget
    /// ([`Durability::max_attempts`](flue_core::agent::Durability::max_attempts)) in milliseconds. The
    /// attempt waits before it gives the submission back, its lease held: no other node takes
    /// it meanwhile. A node that stops does not wait (the submission is queued for the next).
    pub store_retry_delay: Duration,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        Self {
            tool_concurrency: 8,
            model_retries: 3,
            model_retry_delay: Duration::from_millis(2000),
            lease: Duration::from_secs(30),
            heartbeat: Duration::from_secs(10),
            scan_interval: Duration::from_secs(15),
            mcp_session_idle: Duration::from_secs(300),
            cached_instances: 1024,
            cached_bytes: 512 << 20,
            text_flush: Some(Duration::from_secs(1)),
            settle_grace: Duration::from_secs(60),
            shared_store_poll: Duration::from_millis(250),
            store_retry_delay: Duration::from_secs(1),
        }
    }
}

/// How many waited-on submissions one look for settlements reads at most
/// ([`RuntimeInner::watch_settlements`]); more take several.
const SETTLEMENT_LOOK: usize = 500;

/// The longest wait before a retry of a model call, however many retries came before it (the
/// built-in providers cap their own backoff at this same bound).
pub const MAX_MODEL_RETRY_WAIT: Duration = Duration::from_secs(30);

/// The longest `Retry-After` a retry of a model call waits out, in full (a per-minute rate
/// limit's, up to a minute); a failure whose `Retry-After` asks for longer is not retried (a
/// retry sooner would meet the same limit) and says how long the provider asked to wait.
pub const MAX_RETRY_AFTER_WAIT: Duration = Duration::from_secs(60);

/// How many events [`Runtime::observe`] keeps for its slowest subscriber.
pub const OBSERVED_BACKLOG: usize = 4096;

/// How many thread events the broadcast of their HTTP readers keeps (each reader takes its
/// instance's off it as they come, see `http::thread_events`).
const THREAD_EVENTS_BACKLOG: usize = 1024;

impl RuntimeOptions {
    /// The wait before the `retry`-th retry (from 1) of a model call: `model_retry_delay`
    /// doubled for each retry before it, at most [`MAX_MODEL_RETRY_WAIT`] (never an overflow,
    /// however many retries are allowed).
    pub fn model_retry_wait(&self, retry: u32) -> Duration {
        doubled(self.model_retry_delay, retry)
    }

    /// The retries a retry of a model call that failed with `error` (after `retries` of the
    /// turn loop's) has spent in all, the provider's own included, and the wait before it:
    /// [`model_retry_wait`](Self::model_retry_wait) scaled by `jitter` (in `[0, 1)`) to between
    /// 75 and 100 % of it, or what the provider asked for (`Retry-After`) when that is
    /// longer, at most [`MAX_RETRY_AFTER_WAIT`].
    pub(crate) fn model_retry(&self, retries: u32, error: &crate::provider::ProviderError) -> (u32, Duration) {
        self.model_retry_jittered(retries, error, crate::provider::jitter_fraction())
    }

    /// The wait before the attempt after `attempt` (from 1) of a submission, when a store
    /// failure ended that one: [`store_retry_delay`](Self::store_retry_delay) doubled for
    /// each attempt before it, at most [`MAX_MODEL_RETRY_WAIT`], scaled by `jitter` (in
    /// `[0, 1)`) to between 75 and 100 % of it.
    pub(crate) fn store_retry_wait(&self, attempt: u32, jitter: f64) -> Duration {
        doubled(self.store_retry_delay, attempt).mul_f64(1.0 - 0.25 * jitter.clamp(0.0, 1.0))
    }

    fn model_retry_jittered(
        &self,
        retries: u32,
        error: &crate::provider::ProviderError,
        jitter: f64,
    ) -> (u32, Duration) {
        let spent = retries.saturating_add(1).saturating_add(error.retried);
        let wait = self
            .model_retry_wait(spent)
            .mul_f64(1.0 - 0.25 * jitter.clamp(0.0, 1.0))
            .max(error.retry_after.unwrap_or_default().min(MAX_RETRY_AFTER_WAIT));
        (spent, wait)
    }
}

/// `delay` doubled for each of the `n - 1` before the `n`-th (from 1), at most
/// [`MAX_MODEL_RETRY_WAIT`] (never an overflow, however large `n`).
fn doubled(delay: Duration, n: u32) -> Duration {
    delay
        .saturating_mul(2u32.saturating_pow(n.saturating_sub(1)))
        .min(MAX_MODEL_RETRY_WAIT)
}

/// Builds a [`Runtime`].
pub struct RuntimeBuilder {
    agents: Vec<AgentRef>,
    user_hooks: Vec<flue_core::lifecycle::UserHook>,
    providers: ProviderRegistry,
    store: Option<Arc<dyn Store>>,
    options: RuntimeOptions,
}

impl RuntimeBuilder {
    /// Registers an agent.
    pub fn agent(mut self, agent: impl Into<AgentRef>) -> Self {
        self.agents.push(agent.into());
        self
    }

    /// Registers a user-scope lifecycle hook (`user_value_changed`, `user_client_attached`,
    /// `user_client_detached`): every registered hook of a kind runs for every user, in
    /// registration order; no agent selects them.
    pub fn user_hook(mut self, hook: flue_core::lifecycle::UserHook) -> Self {
        self.user_hooks.push(hook);
        self
    }

    /// Uses `providers` to resolve model specifiers (default: openai, anthropic, openrouter).
    pub fn providers(mut self, providers: ProviderRegistry) -> Self {
        self.providers = providers;
        self
    }

    /// Uses `store` (default: the embedded SQLite store in `.flue/flue.db` under the working
    /// directory; use [`crate::store::MemoryStore`] for tests).
    pub fn store(mut self, store: impl Store) -> Self {
        self.store = Some(Arc::new(store));
        self
    }

    /// Sets the turn-loop options.
    pub fn options(mut self, options: RuntimeOptions) -> Self {
        self.options = options;
        self
    }

    /// Builds the runtime. Fails when an agent's definition breaks a rule `#[agent]` checks
    /// at compile time ([`flue_core::agent::AgentDefinition::check`]), when a hook id is not
    /// snake_case, when two agents share a name, when two different lifecycle hooks share an
    /// id (naming both), or, without [`store`](Self::store), when the default SQLite store
    /// cannot be opened (another process holds `.flue/flue.db`, or its format is another
    /// build's).
    pub fn build(self) -> Result<Runtime, RuntimeError> {
        let (lease, heartbeat) = (self.options.lease, self.options.heartbeat);
        if heartbeat.is_zero() || heartbeat >= lease {
            return Err(RuntimeError::Build(format!(
                "[flue] RuntimeOptions::heartbeat ({heartbeat:?}) must be longer than zero and shorter than lease ({lease:?}): a lease would lapse between renewals, and another node take over a response still running here."
            )));
        }
        let store = match self.store {
            Some(store) => store,
            None => Arc::new(crate::store::SqliteStore::open_default().map_err(|error| {
                RuntimeError::Build(format!(
                    "[flue] The default store .flue/flue.db could not be opened: {error}"
                ))
            })?),
        };
        let mut agents = FastMap::default();
        let mut hook_ids: HashMap<&'static str, flue_core::lifecycle::ThreadHook> = HashMap::new();
        for agent in &self.agents {
            let definition = agent.get().definition();
            definition.check().map_err(RuntimeError::Build)?;
            let name = definition.name.to_string();
            if agents.insert(name.clone(), agent.clone()).is_some() {
                return Err(RuntimeError::Build(format!(
                    "[flue] Two agents are registered under the name \"{name}\"."
                )));
            }
            let hooks = definition
                .hooks
                .iter()
                .chain(definition.parent_hooks.iter().map(|requirement| &requirement.hook));
            for hook in hooks {
                if let Some(existing) = hook_ids.insert(hook.id(), *hook)
                    && existing != *hook
                {
                    return Err(RuntimeError::Build(flue_core::lifecycle::shared_id_message(
                        hook.id(),
                        existing.kind(),
                        hook.kind(),
                    )));
                }
            }
        }
        let user_hooks = crate::lifecycle::user::unique_user_hooks(self.user_hooks).map_err(RuntimeError::Build)?;
        if let Some(clash) = user_hooks.iter().find(|hook| hook_ids.contains_key(hook.id())) {
            return Err(RuntimeError::Build(flue_core::lifecycle::shared_id_message(
                clash.id(),
                hook_ids[clash.id()].kind(),
                clash.kind(),
            )));
        }
        // Every hook id the application declares, for the renders' selections to be checked
        // against (a user hook stands for its id alone: no thread hook may share it).
        let mut known_hooks: HashMap<&'static str, crate::lifecycle::KnownHook> = hook_ids
            .into_iter()
            .map(|(id, hook)| (id, crate::lifecycle::KnownHook::Thread(hook)))
            .collect();
        for hook in &user_hooks {
            known_hooks.insert(hook.id(), crate::lifecycle::KnownHook::User(hook.kind()));
        }
        let (events, _) = broadcast::channel(OBSERVED_BACKLOG);
        let (thread_events, _) = broadcast::channel(THREAD_EVENTS_BACKLOG);
        let (user_events, _) = broadcast::channel(1024);
        let inner = Arc::new(RuntimeInner {
            agents,
            providers: self.providers,
            store,
            options: self.options,
            instances: Mutex::default(),
            slot_uses: AtomicU64::new(0),
            cached_weight: AtomicUsize::new(0),
            events,
            thread_events,
            event_index: Mutex::new(0),
            correlations: Mutex::default(),
            waiters: Mutex::default(),
            shutting_down: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            closed: tokio::sync::watch::Sender::new(false),
            owner_id: live_owners_add(new_id("owner")),
            background: AtomicBool::new(false),
            watching_settlements: AtomicBool::new(false),
            user_hooks,
            user_chains: crate::lifecycle::user::UserChains::default(),
            user_events,
            known_hooks: Mutex::new(known_hooks),
        });
        Ok(Runtime { inner })
    }
}

pub(crate) struct RuntimeInner {
    pub(crate) agents: FastMap<String, AgentRef>,
    pub(crate) providers: ProviderRegistry,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) options: RuntimeOptions,
    pub(crate) instances: Mutex<FastMap<InstanceKey, Arc<InstanceSlot>>>,
    /// A clock of slot uses: which cached instance was used least recently.
    slot_uses: AtomicU64,
    /// The cached conversations' weights together (see `RuntimeOptions::cached_bytes`).
    pub(crate) cached_weight: AtomicUsize,
    events: broadcast::Sender<Observation>,
    /// The thread events alone (`tool_call_started`, `tool_call_done`, `ThreadState::emit`)
    /// for their HTTP readers: a reader of them does not make every other event observed
    /// (built, and copied for it only to be dropped).
    /// (Shared: each reader's task gets a pointer, not a copy of what an application emitted.)
    thread_events: broadcast::Sender<Arc<Observation>>,
    /// The next observation's index, held while the observation is sent so that observers
    /// receive indices in the order they were given, whichever thread emits.
    event_index: Mutex<u64>,
    /// The correlation of each submission an attempt of this node processes, by submission
    /// id: what its observations are stamped with.
    correlations: Mutex<FastMap<Arc<str>, Arc<Correlation>>>,
    /// Senders waiting for a submission to settle, by submission id.
    waiters: Mutex<FastMap<String, Waiting>>,
    shutting_down: AtomicBool,
    /// Turns `true` at [`Runtime::release`]: workers claim nothing more, the scan takes over
    /// nothing.
    draining: AtomicBool,
    /// Turns `true` at [`Runtime::shutdown`]: live HTTP reads end on it.
    closed: tokio::sync::watch::Sender<bool>,
    /// This node's identity on claims and leases.
    pub(crate) owner_id: String,
    /// Whether the heartbeat and lease scan run.
    background: AtomicBool,
    /// Whether the look for settlements of the submissions waited on here runs (a shared
    /// store's: see [`RuntimeInner::watch_settlements`]).
    watching_settlements: AtomicBool,
    /// The user-scope hooks, in registration order.
    pub(crate) user_hooks: Vec<flue_core::lifecycle::UserHook>,
    /// Their per-user queues.
    pub(crate) user_chains: crate::lifecycle::user::UserChains,
    /// `UserState::emit` events, for the user event streams.
    pub(crate) user_events: broadcast::Sender<crate::lifecycle::UserEvent>,
    /// The hook of each id met so far: those the agents and the user scope declare, then
    /// those renders select (see [`crate::lifecycle::HookSet::register`]).
    pub(crate) known_hooks: Mutex<HashMap<&'static str, crate::lifecycle::KnownHook>>,
}

impl RuntimeInner {
    /// Completes once [`Runtime::shutdown`] was called (at once if it was).
    pub(crate) fn closed(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut closed = self.closed.subscribe();
        async move {
            // An error means the runtime is gone: closed too.
            let _ = closed.wait_for(|closed| *closed).await;
        }
    }

    /// Whether [`Runtime::shutdown`] was called.
    pub(crate) fn is_closed(&self) -> bool {
        *self.closed.borrow()
    }

    /// A claim by this node for a new attempt, leased for `options.lease`.
    pub(crate) fn claim(&self) -> crate::store::Claim {
        crate::store::Claim {
            attempt_id: new_id("attempt"),
            owner_id: self.owner_id.clone(),
            lease_until_ms: lease_until(self.options.lease),
        }
    }

    /// Starts the heartbeat (lease renewal) and the scan (expired leases, queued work admitted
    /// elsewhere), once, on the current tokio runtime.
    pub(crate) fn ensure_background(self: &Arc<Self>) {
        if self.background.swap(true, Ordering::SeqCst) {
            return;
        }
        self.watch_settlements();
        // Two loops: a scan that takes long (many leases to take over, a saturated pool) must
        // not hold up the renewal of this node's own leases past their lease.
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(scan_interval) = weak.upgrade().map(|runtime| runtime.options.scan_interval) else {
                    return;
                };
                // At least a millisecond apart: a zero interval must not spin.
                tokio::time::sleep(scan_interval.max(Duration::from_millis(1))).await;
                let Some(runtime) = weak.upgrade() else { return };
                runtime.scan().await;
            }
        });
        // The heartbeat: renewals in a loop of their own, so that a slow look for abort
        // requests never delays one; each beat counts from the start of the last, so a slow
        // renewal does not push the next one a whole period later.
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(runtime) = weak.upgrade() else { return };
                let beat = tokio::time::Instant::now() + runtime.options.heartbeat.max(Duration::from_millis(1));
                // Leases that lapsed while renewals failed (a database failover, a stalled or
                // suspended node) are this node's again at the next renewal, unless another
                // node took them over meanwhile: those attempts stop here. The scan never takes
                // over an attempt running here (it leaves held ones alone).
                let lease_until = lease_until(runtime.options.lease);
                let running = runtime.running_attempts();
                if !running.is_empty() {
                    match runtime
                        .store
                        .renew_leases(&runtime.owner_id, &running, lease_until)
                        .await
                    {
                        Ok(renewed) if renewed < running.len() as u64 => {
                            // An attempt that settled (or was given back) since the list was
                            // taken is not renewed, and routinely so: only the attempts still
                            // held count. (One renewed and settled since may hide a lost one
                            // for a beat: the next renewal, without it, finds that.)
                            let held = runtime.running_attempts();
                            let still_held: Vec<String> =
                                running.into_iter().filter(|attempt| held.contains(attempt)).collect();
                            if renewed < still_held.len() as u64 {
                                runtime.stop_lost_leases(&still_held, lease_until).await;
                            }
                        }
                        Ok(_) => {}
                        Err(error) => {
                            tracing::warn!(%error, "renewing leases failed");
                            runtime.emit_recovery(Concerning::Pass, ProcessSubmission, Deferred, Some(&error));
                        }
                    }
                }
                drop(runtime);
                tokio::time::sleep_until(beat).await;
            }
        });
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(runtime) = weak.upgrade() else { return };
                let beat = tokio::time::Instant::now() + runtime.options.heartbeat.max(Duration::from_millis(1));
                // An abort requested through another node (whose notice did not come, or
                // that missed this one's attempt as it started) reaches the attempt here.
                runtime.enforce_abort_requests(&runtime.running_attempts()).await;
                drop(runtime);
                tokio::time::sleep_until(beat).await;
            }
        });
        // What other nodes sharing the store did, as it announces it: their settlements wake
        // the waits here at once, their abort requests reach the attempts running here, and
        // the work they give back is claimed.
        if let Some(mut notices) = self.store.notices() {
            let weak = Arc::downgrade(self);
            // A resync's looks (which may take long: a scan) run on a task of their own, so
            // the notices behind it are not held up; resyncs asked for while one runs make
            // one more run (a `Notify` keeps one permit).
            let resync = Arc::new(tokio::sync::Notify::new());
            let resyncs = resync.clone();
            let looking = weak.clone();
            tokio::spawn(async move {
                loop {
                    resyncs.notified().await;
                    let Some(runtime) = looking.upgrade() else { return };
                    runtime.enforce_abort_requests(&runtime.running_attempts()).await;
                    // Work given back meanwhile, too.
                    runtime.scan().await;
                }
            });
            tokio::spawn(async move {
                loop {
                    let notice = match notices.recv().await {
                        Ok(notice) => notice,
                        Err(broadcast::error::RecvError::Lagged(_)) => StoreNotice::Resync,
                        Err(broadcast::error::RecvError::Closed) => break,
                    };
                    let Some(runtime) = weak.upgrade() else { break };
                    runtime.on_notice(notice, &resync);
                }
                // The resync task ends too, finding the runtime gone.
                resync.notify_one();
            });
        }
    }

    /// On a shared store, starts (once) the look that finds the submissions waited on here
    /// that settled without waking their waits (another node settled them, and no notice of it
    /// came): one read of the store for all of them each
    /// [`RuntimeOptions::shared_store_poll`], not one read of each row per wait.
    pub(crate) fn watch_settlements(self: &Arc<Self>) {
        if !self.store.shared() || self.watching_settlements.swap(true, Ordering::SeqCst) {
            return;
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            // Whether the last look failed: a store that stays down is reported once, not at
            // every poll.
            let mut failing = false;
            loop {
                let Some(poll) = weak.upgrade().map(|runtime| runtime.options.shared_store_poll) else {
                    return;
                };
                // At least a millisecond apart: a zero poll must not spin.
                tokio::time::sleep(poll.max(Duration::from_millis(1))).await;
                let Some(runtime) = weak.upgrade() else { return };
                match runtime.look_for_settlements().await {
                    Ok(()) if failing => {
                        failing = false;
                        tracing::info!("looking for settlements of the submissions waited on here works again");
                    }
                    Ok(()) => {}
                    // Each wait also looks on its own, less often (see `wait`).
                    Err(error) if !failing => {
                        failing = true;
                        tracing::warn!(%error, "looking for settlements of the submissions waited on here failed; it goes on trying at every poll");
                    }
                    Err(error) => tracing::debug!(%error, "looking for settlements still fails"),
                }
            }
        });
    }

    /// Wakes the waits whose submissions settled, looking at all of them in reads of
    /// [`SETTLEMENT_LOOK`] ids.
    async fn look_for_settlements(&self) -> Result<(), StoreError> {
        let waited: Vec<String> = self
            .waiters
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .keys()
            .cloned()
            .collect();
        for ids in waited.chunks(SETTLEMENT_LOOK) {
            let settled = self.store.settled_among(ids).await?;
            self.notify_settled(&settled);
        }
        Ok(())
    }

    /// Acts on a notice of the store (see [`Store::notices`]), without waiting on the store:
    /// what reads it runs on a task of its own.
    fn on_notice(self: &Arc<Self>, notice: StoreNotice, resync: &tokio::sync::Notify) {
        match notice {
            StoreNotice::Settled(key) => {
                self.wake_waiters_of(&key);
                // Its live readers here read the stream again (the settlement appended to it):
                // they see the response's end as it lands, not at their next poll.
                let slot = self
                    .instances
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .get(&key)
                    .cloned();
                if let Some(slot) = slot {
                    slot.note_append();
                }
            }
            StoreNotice::AbortRequested(key) => {
                let running = self
                    .instances
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .get(&key)
                    .map(|slot| slot.held_attempts())
                    .unwrap_or_default();
                if !running.is_empty() {
                    let runtime = self.clone();
                    tokio::spawn(async move { runtime.enforce_abort_requests(&running).await });
                }
            }
            StoreNotice::Queued(key) => {
                // As the scan wakes a queue it finds (whose worker claims, or finds the head
                // taken).
                if !self.claims_stopped() && self.agents.contains_key(&*key.agent) {
                    self.slot(&key).wake();
                }
            }
            StoreNotice::Resync => {
                self.wake_waiters();
                resync.notify_one();
            }
        }
    }

    /// Stops the attempts among `running` (ones this node holds) whose abort was requested.
    async fn enforce_abort_requests(&self, running: &[String]) {
        if running.is_empty() {
            return;
        }
        match self.store.aborts_requested(running).await {
            Ok(aborting) if !aborting.is_empty() => self.stop_attempts(&aborting, session::ABORTED),
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(%error, "reading abort requests failed");
                self.emit_recovery(Concerning::Pass, EnforceDeadline, Deferred, Some(&error));
            }
        }
    }

    /// Whether this node gives its work back ([`Runtime::release`]) rather than take more.
    pub(crate) fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Whether this node takes no more work: it is shutting down ([`Runtime::shutdown`]: what
    /// runs may finish, nothing more starts; reference §3.9) or gives its work back.
    pub(crate) fn claims_stopped(&self) -> bool {
        self.shutting_down.load(Ordering::Acquire) || self.draining()
    }

    /// Makes every send and read waiting on this node look at its submission again.
    pub(crate) fn wake_waiters(&self) {
        drop(std::mem::take(
            &mut *self.waiters.lock().unwrap_or_else(|poisoned| poisoned.into_inner()),
        ));
    }

    /// Whether a worker of this node runs the instance `key`.
    fn busy_here(&self, key: &InstanceKey) -> bool {
        self.instances
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(key)
            .is_some_and(|slot| !slot.is_idle())
    }

    /// Takes over submissions whose lease expired (their node died) and wakes every instance
    /// with queued work; nothing once the node stops taking work ([`Self::claims_stopped`]).
    pub(crate) async fn scan(self: &Arc<Self>) {
        self.scan_leases(false).await;
        self.close_idle_mcp_sessions();
    }

    /// Closes the MCP sessions cached instances kept and no response used for
    /// [`RuntimeOptions::mcp_session_idle`] (dropped once the cache's lock is released).
    fn close_idle_mcp_sessions(&self) {
        let idle = self.options.mcp_session_idle;
        let expired: Vec<_> = {
            let instances = self.instances.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            // Not a running instance's: its response uses them (and notes them used as it ends).
            instances
                .values()
                .filter(|slot| slot.is_idle())
                .flat_map(|slot| slot.expired_mcp_sessions(idle))
                .collect()
        };
        drop(expired);
    }

    /// [`Self::scan`]; `starting`: the node's first, which on a store one process at a time
    /// can use ([`Store::exclusive`](crate::store::Store::exclusive)) takes over every
    /// submission left running by an owner that is not a runtime of this process (a process
    /// that ended: a crash, a Ctrl-C) at once, not once its lease ran out.
    async fn scan_leases(self: &Arc<Self>, starting: bool) {
        if self.claims_stopped() {
            return;
        }
        let ended_owners = starting && self.store.exclusive();
        // Past every lease (as a store's integer column holds it).
        let now = if ended_owners {
            i64::MAX as u64
        } else {
            crate::store::now_ms()
        };
        match self.store.expired(now).await {
            Ok(expired) => {
                // Held after the listing: an attempt running here when its row was listed is
                // still held (or has ended) now.
                let held = self.running_attempts();
                for row in expired {
                    let Some(stale) = row.attempt_id.clone() else { continue };
                    if ended_owners
                        && !crate::store::lease_expired(row.lease_until_ms, crate::store::now_ms())
                        && row.owner_id.as_deref().is_none_or(live_owner)
                    {
                        // Another runtime of this process runs it.
                        continue;
                    }
                    if held.contains(&stale) {
                        // This node runs the attempt: its renewals failed for longer than the
                        // lease. Taking it over here would fence the live attempt and run it
                        // again; the heartbeat renews it instead. Another node may still take
                        // it over, as it would from a node it cannot tell from a dead one.
                        continue;
                    }
                    if !self.agents.contains_key(&*row.key.agent) {
                        // Nodes sharing a store may run different agents: taking this one over
                        // here would spend one of its attempts on a node that cannot run it.
                        self.emit_recovery(Concerning::Row(&row), ReconcileSubmission, AgentUnavailable, None);
                        continue;
                    }
                    let claim = self.claim();
                    match self.store.reclaim(&row.id, &stale, &claim, now).await {
                        Ok(Some(reclaimed)) => {
                            tracing::info!(submission = %reclaimed.id, instance = %reclaimed.key, "took over an expired lease");
                            self.slot(&reclaimed.key).resume(reclaimed, claim.attempt_id);
                        }
                        Ok(None) => {}
                        Err(error) => {
                            tracing::warn!(%error, "reclaiming an expired submission failed");
                            self.emit_recovery(Concerning::Row(&row), ReconcileSubmission, Deferred, Some(&error));
                        }
                    }
                }
            }
            Err(error) => {
                tracing::warn!(%error, "listing expired leases failed");
                self.emit_recovery(Concerning::Pass, ReconcilePass, Deferred, Some(&error));
            }
        }
        match self.store.instances_with_queued().await {
            Ok(keys) => {
                for key in keys.into_iter().filter(|key| self.agents.contains_key(&*key.agent)) {
                    self.slot(&key).wake();
                }
            }
            Err(error) => {
                tracing::warn!(%error, "listing queued work failed");
                self.emit_recovery(Concerning::Pass, ReconcilePass, Deferred, Some(&error));
            }
        }
    }

    /// The names of the registered agents, sorted.
    pub(crate) fn agent_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.agents.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// Whether anyone observes now: work done only for an event (copies it alone needs) can
    /// be skipped when nobody does.
    pub(crate) fn observed(&self) -> bool {
        self.events.receiver_count() > 0
    }

    /// Live thread events of every instance (what [`Self::emit_thread_event`] publishes).
    pub(crate) fn observe_thread_events(&self) -> broadcast::Receiver<Arc<Observation>> {
        self.thread_events.subscribe()
    }

    /// [`emit_with`](Self::emit_with) for a thread event: observers get it, and so do the
    /// readers of [`Self::observe_thread_events`].
    pub(crate) fn emit_thread_event(
        &self,
        key: &InstanceKey,
        submission_id: Option<&str>,
        event: impl FnOnce() -> Event,
    ) {
        self.publish_to(Some(key), submission_id, None, true, event);
    }

    pub(crate) fn emit(&self, key: &InstanceKey, submission_id: Option<&str>, event: Event) {
        self.emit_with(key, submission_id, || event);
    }

    /// [`emit`](Self::emit), building the event only when someone observes: the turn loop's
    /// per-step events would otherwise copy names and ids for nobody.
    pub(crate) fn emit_with(&self, key: &InstanceKey, submission_id: Option<&str>, event: impl FnOnce() -> Event) {
        self.publish(Some(key), submission_id, None, event);
    }

    /// [`emit_with`](Self::emit_with) for an event of a task's child session (`task`), which
    /// runs for `submission_id` of the root instance `key`.
    pub(crate) fn emit_in_task(
        &self,
        key: &InstanceKey,
        submission_id: &str,
        task: &crate::events::TaskScope,
        event: impl FnOnce() -> Event,
    ) {
        self.publish(Some(key), Some(submission_id), Some(task), event);
    }

    /// Reports a coordination step that failed (or skipped work) and was deferred, as a
    /// `submission_recovery` about what it `concerns`.
    pub(crate) fn emit_recovery(
        &self,
        concerns: Concerning<'_>,
        operation: crate::events::RecoveryOperation,
        outcome: crate::events::RecoveryOutcome,
        error: Option<&dyn std::fmt::Display>,
    ) {
        let error = error.map(|error| crate::record::SettlementError::new("store_failure", error.to_string()));
        self.emit_recovery_error(concerns, operation, outcome, error);
    }

    /// [`RuntimeInner::emit_recovery`] with an error of any type.
    pub(crate) fn emit_recovery_error(
        &self,
        concerns: Concerning<'_>,
        operation: crate::events::RecoveryOperation,
        outcome: crate::events::RecoveryOutcome,
        error: Option<crate::record::SettlementError>,
    ) {
        let (key, submission_id, submission) = match concerns {
            Concerning::Pass => (None, None, None),
            Concerning::Instance(key) => (Some(key), None, None),
            Concerning::Submission(key, id) => (Some(key), Some(id), None),
            Concerning::Row(row) => (Some(&row.key), Some(row.id.as_str()), Some(row)),
        };
        self.publish(key, submission_id, None, || Event::SubmissionRecovery {
            kind: submission.map(|submission| submission.kind),
            operation,
            outcome,
            attempt_count: submission.map(|submission| submission.attempt_count),
            max_attempts: submission.map(|submission| submission.max_attempts),
            error,
        });
    }

    fn publish(
        &self,
        key: Option<&InstanceKey>,
        submission_id: Option<&str>,
        task: Option<&crate::events::TaskScope>,
        event: impl FnOnce() -> Event,
    ) {
        self.publish_to(key, submission_id, task, false, event);
    }

    /// Publishes to the observers, and a thread event (`thread`) to the readers of thread
    /// events too.
    fn publish_to(
        &self,
        key: Option<&InstanceKey>,
        submission_id: Option<&str>,
        task: Option<&crate::events::TaskScope>,
        thread: bool,
        event: impl FnOnce() -> Event,
    ) {
        let observed = self.observed();
        let threaded = thread && self.thread_events.receiver_count() > 0;
        if !observed && !threaded {
            return;
        }
        let event = event();
        let (operation_id, mut turn_id) = submission_id
            .and_then(|id| {
                self.correlations
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .get(id)
                    .cloned()
            })
            .map_or((None, None), |correlation| {
                let (operation, turn) = correlation.ids();
                (Some(operation), turn)
            });
        // A child's events belong to its operation and turn, not to the parent's that called
        // the task.
        let task_id = task.map(|task| {
            let (task_id, turn) = task.ids();
            turn_id = turn;
            task_id
        });
        let operation_id = task.map_or(operation_id, |task| Some(task.operation_id().to_owned()));
        let mut observation = Observation {
            agent: key.map(|key| key.agent.to_string()),
            instance_id: key.map(|key| key.id.to_string()),
            submission_id: submission_id.map(str::to_owned),
            operation_id,
            turn_id,
            task_id,
            event_index: 0,
            timestamp: String::new(),
            event,
        };
        let mut next_index = self.event_index.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        observation.event_index = *next_index;
        observation.timestamp = now().to_string();
        *next_index += 1;
        match (observed, threaded) {
            (true, true) => {
                let _ = self.thread_events.send(Arc::new(observation.clone()));
                let _ = self.events.send(observation);
            }
            (false, _) => {
                let _ = self.thread_events.send(Arc::new(observation));
            }
            (true, false) => {
                let _ = self.events.send(observation);
            }
        }
    }

    /// Stamps the observations of `submission_id` with `correlation` until the returned
    /// guard drops (the end of the attempt's processing, however it ends).
    pub(crate) fn correlate(self: &Arc<Self>, submission_id: &Arc<str>, correlation: Arc<Correlation>) -> Correlated {
        self.correlations
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(submission_id.clone(), correlation);
        Correlated {
            runtime: Arc::downgrade(self),
            submission_id: submission_id.clone(),
        }
    }

    /// Stops each of `attempt_ids` this node holds, for `reason`: a running attempt's signal
    /// fires; one about to start learns why as it starts.
    fn stop_attempts(&self, attempt_ids: &[String], reason: &'static str) {
        let held: Vec<(Arc<InstanceSlot>, String)> = self
            .instances
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .values()
            .flat_map(|slot| {
                slot.held_attempts()
                    .into_iter()
                    .filter(|attempt| attempt_ids.contains(attempt))
                    .map(|attempt| (slot.clone(), attempt))
            })
            .collect();
        for (slot, attempt) in held {
            slot.stop_attempt(&attempt, reason);
        }
    }

    /// After a renewal that renewed fewer leases than it asked for: which of `attempts` this
    /// node no longer holds (asked one by one; an attempt that settled meanwhile counts, and
    /// stopping it then does nothing), stopped as another node's now.
    async fn stop_lost_leases(&self, attempts: &[String], lease_until_ms: u64) {
        let mut lost = Vec::new();
        for attempt in attempts {
            match self
                .store
                .renew_leases(&self.owner_id, std::slice::from_ref(attempt), lease_until_ms)
                .await
            {
                Ok(0) => lost.push(attempt.clone()),
                Ok(_) => {}
                // Asked again at the next heartbeat.
                Err(error) => tracing::warn!(%error, attempt = %attempt, "renewing a lease failed"),
            }
        }
        if !lost.is_empty() {
            tracing::warn!(attempts = ?lost, "the store no longer renews leases this node held (another node took them over, or the store cannot read their rows); their attempts stop here");
            self.stop_attempts(&lost, session::LEASE_LOST);
        }
    }

    /// The attempts this node runs or took over to run: the leases its heartbeat renews and
    /// its scan leaves alone.
    fn running_attempts(&self) -> Vec<String> {
        self.instances
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .values()
            .flat_map(|slot| slot.held_attempts())
            .collect()
    }

    /// Requests an abort of every unsettled submission of the instance and tells its worker;
    /// the ids of those affected. With nothing to abort (an idle instance, or one that does
    /// not exist) no worker is woken, and no slot is made for an id a client made up.
    pub(crate) async fn abort_instance(self: &Arc<Self>, key: &InstanceKey) -> Result<Vec<String>, StoreError> {
        let affected = self.store.request_abort(key).await?;
        // An agent this node does not run is the abort's to stamp only: a worker woken here
        // would claim its queued head and could not run it (the attempt spent, the abort
        // held up until its lease lapsed). The node that runs it sees the stamp.
        if !affected.is_empty() && self.agents.contains_key(&*key.agent) {
            let slot = self.slot(key);
            slot.abort_submissions(&affected);
            slot.wake();
        }
        Ok(affected)
    }

    /// Whether this node knows the instance `key` exists, without asking the store (its slot
    /// holds its conversation): a later message to an instance needs no store read to tell
    /// it does not create one.
    fn known_instance(&self, key: &InstanceKey) -> bool {
        let instances = self.instances.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        instances.get(key).is_some_and(|slot| slot.known_to_exist())
    }

    pub(crate) fn slot(self: &Arc<Self>, key: &InstanceKey) -> Arc<InstanceSlot> {
        let used = self.slot_uses.fetch_add(1, Ordering::Relaxed);
        let mut instances = self.instances.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (slot, evicted) = match instances.get(key) {
            Some(slot) => (slot.clone(), Evicted::default()),
            None => {
                let slot = Arc::new(InstanceSlot::new(key.clone(), Arc::downgrade(self)));
                instances.insert(key.clone(), slot.clone());
                let evicted = self.evict_past_limits(&mut instances);
                (slot, evicted)
            }
        };
        drop(instances);
        drop(evicted);
        slot.touch(used);
        slot
    }

    /// The idle instances to drop (outside the map's lock) when the cache is past
    /// [`RuntimeOptions::cached_instances`] or [`RuntimeOptions::cached_bytes`]: the least
    /// recently used, until it holds three quarters of both.
    fn evict_past_limits(&self, instances: &mut FastMap<InstanceKey, Arc<InstanceSlot>>) -> Evicted {
        let (limit, bytes) = (self.options.cached_instances, self.options.cached_bytes);
        if instances.len() <= limit && self.cached_weight.load(Ordering::Relaxed) <= bytes {
            return Evicted::default();
        }
        evict_idle(
            instances,
            limit - limit / 4,
            (&self.cached_weight, bytes - bytes / 4),
            self.orphan_horizon(),
        )
    }

    /// How long an admission given up mid-way keeps owing its `submission_queued` here (see
    /// [`InstanceBinding::owes_announcements`](crate::session::binding::InstanceBinding::owes_announcements)):
    /// had it committed, a worker has usually claimed it by then (a claim of its own lapses
    /// after the lease, and the scan takes it over at its next pass; a queued one is claimed at
    /// the next scan once its instance is free), so its announcement was made, or was another
    /// node's to make. One queued behind a response running on another node for longer than
    /// that, and claimed here afterwards, runs without its `submission_queued` on this node:
    /// the price of not pinning every failed admission's instance in the cache.
    fn orphan_horizon(&self) -> Duration {
        self.options
            .lease
            .saturating_add(self.options.scan_interval.saturating_mul(2))
    }

    /// After an instance's conversation grew: drops idle instances when the cache is past its
    /// bytes.
    pub(crate) fn trim_cache(&self) {
        if self.cached_weight.load(Ordering::Relaxed) <= self.options.cached_bytes {
            return;
        }
        let evicted = {
            let mut instances = self.instances.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            self.evict_past_limits(&mut instances)
        };
        drop(evicted);
    }

    /// Admits a message (the one admission path of every transport).
    pub(crate) async fn admit(
        self: &Arc<Self>,
        agent: &str,
        request: SendRequest,
        kind: SubmissionKind,
    ) -> Result<(DispatchReceipt, Option<u64>), RuntimeError> {
        let (receipt, offset, _) = self.admit_claiming(agent, request, kind, None).await?;
        Ok((receipt, offset))
    }

    /// [`RuntimeInner::admit`], also claiming the admitted submission in the same store
    /// transaction when `claim` is given and it is the instance's head (the caller holds the
    /// instance's worker role and runs it next).
    pub(crate) async fn admit_claiming(
        self: &Arc<Self>,
        agent: &str,
        mut request: SendRequest,
        kind: SubmissionKind,
        claim: Option<crate::store::Claim>,
    ) -> Result<(DispatchReceipt, Option<u64>, Option<crate::store::Submission>), RuntimeError> {
        // A node that gave its work back (`release`) would never run what it admitted: it
        // claims nothing any more.
        if self.shutting_down.load(Ordering::Acquire) || self.draining() {
            return Err(RuntimeError::ShuttingDown);
        }
        let agent_ref = self
            .agents
            .get(agent)
            .ok_or_else(|| RuntimeError::UnknownAgent(agent.to_owned()))?;
        check_instance_id(&request.id).map_err(RuntimeError::InvalidRequest)?;
        request.message.validate()?;
        if matches!(request.uid, UidCondition::Existing(_)) && request.initial_data.is_some() {
            return Err(RuntimeError::InvalidRequest(
                "`initialData` creates an instance, so it cannot be combined with a `uid` that continues one.".into(),
            ));
        }
        let key = InstanceKey::new(agent, request.id.clone());
        let definition = agent_ref.get().definition();
        // Recorded as the agent's type reads it (reference: schema-parsed), whether or not the
        // instance exists, so a replay of a keyed send carries the same data as its first
        // admission; checked only when it creates the instance. A send that would create the
        // instance without data is checked too (the type may accept none, an `Option`): the
        // data is recorded at creation only, so an instance created without the data its
        // type requires could never be given it. A send that continues an instance (`uid`)
        // creates none: the store answers it.
        if let Some(spec) = &definition.initial_data {
            match &mut request.initial_data {
                Some(data) => match (spec.parse)(data) {
                    Ok(parsed) => *data = parsed,
                    Err(reason) if self.store.instance(&key).await?.is_none() => {
                        return Err(RuntimeError::InvalidRequest(format!(
                            "initialData does not match the agent's initial_data type: {reason}"
                        )));
                    }
                    Err(_) => {}
                },
                None if !matches!(request.uid, UidCondition::Existing(_)) => {
                    if let Err(reason) = (spec.parse)(&Value::Null)
                        && !self.known_instance(&key)
                        && self.store.instance(&key).await?.is_none()
                    {
                        return Err(RuntimeError::InvalidRequest(format!(
                            "This send creates the instance, and the agent requires initialData matching its initial_data type: {reason}"
                        )));
                    }
                }
                None => {}
            }
        }
        let (submission_id, keyed) = match &request.idempotency_key {
            Some(idempotency_key) => {
                // At most 256 UTF-16 code units: the length JavaScript gives the key.
                if idempotency_key.is_empty() || idempotency_key.encode_utf16().count() > 256 {
                    return Err(RuntimeError::InvalidRequest(
                        "idempotencyKey must be a non-empty string of at most 256 characters (UTF-16 code units)."
                            .into(),
                    ));
                }
                (keyed_submission_id(agent, &request.id, idempotency_key), true)
            }
            None => (new_id("sub"), false),
        };
        // Dropped during the admission (a cancelled send), a claim that committed would hold its
        // submission under a lease this node keeps renewing: hand it back to the queue.
        let pending = claim.as_ref().map(|claim| PendingClaim {
            runtime: self.clone(),
            key: key.clone(),
            attempt: Some(crate::store::AttemptRef {
                submission_id: submission_id.clone(),
                attempt_id: claim.attempt_id.clone(),
            }),
        });
        // Held through the admission (so the slot stays cached): a worker that claims the
        // submission the moment it commits announces it if this call has not yet.
        let slot = self.slot(&key);
        let admitting = slot.binding().admitting(&submission_id);
        let admitted = self
            .store
            .admit(Admission {
                key: key.clone(),
                submission_id,
                keyed,
                kind,
                message: request.message,
                initial_data: request.initial_data,
                uid: request.uid,
                // The agent's budget from admission on. The reference stamps 10 at every claim
                // and the agent's budget only once the input is applied (its §8 item 19), so a
                // submission that keeps dying before that is judged against 10 and its
                // `submission_running` says 10: here the agent's `durability` bounds every
                // attempt, as the agent declared, and the event reports that budget.
                max_attempts: definition.durability.max_attempts,
                timeout_ms: u64::try_from(definition.durability.timeout.as_millis()).unwrap_or(u64::MAX),
                claim,
                trace: request.trace,
            })
            .await;
        let admitted = match admitted {
            Ok(admitted) => {
                if let Some(mut pending) = pending {
                    pending.attempt = None;
                }
                admitted
            }
            // A failure whose outcome is unknown (`Other`: the store may have committed before
            // its answer was lost): its announcement stays owed, a claim it made goes back to
            // the queue (`pending`, dropped here: a compare-and-set on its attempt, which finds
            // nothing when nothing committed) and the instance is woken, so what committed runs
            // now rather than after its lease and the next scan.
            Err(error @ StoreError::Other(_)) => {
                drop(pending);
                self.ensure_background();
                slot.wake();
                return Err(error.into());
            }
            // Refused: nothing was queued, nothing is owed.
            Err(error) => {
                if let Some(mut pending) = pending {
                    pending.attempt = None;
                }
                admitting.refused();
                return Err(error.into());
            }
        };
        if !admitted.deduplicated {
            // A new instance's birth record is on its stream (a store need not say whether
            // this admission created it: an over-count only costs live readers one look).
            slot.note_append();
            if let Some(birth) = &admitted.birth {
                slot.note_birth(birth);
            }
        }
        // At least once: a replay of an idempotency key emits it again (reference §7.2).
        admitting.announce(admitted.deduplicated, || {
            self.emit(&key, Some(&admitted.submission.id), Event::SubmissionQueued { kind });
        });
        self.ensure_background();
        let receipt = DispatchReceipt {
            submission_id: admitted.submission.id.clone(),
            accepted_at: admitted.submission.accepted_at.clone(),
            uid: admitted.uid,
            deduplicated: admitted.deduplicated,
        };
        Ok((receipt, admitted.offset, admitted.claimed))
    }

    /// Waits for a submission to settle and reads its reply.
    /// `after` is a stream offset known to precede the submission's records (its admission
    /// offset), so the reply is read without rescanning the conversation.
    pub(crate) async fn wait(
        &self,
        key: &InstanceKey,
        submission_id: &str,
        after: Option<u64>,
    ) -> Result<AgentReply, RuntimeError> {
        // Declared before the loop's receivers, so dropped after them: however the wait ends
        // (answered, failed, given up), its registration goes with it.
        let _registered = Registered {
            waiters: &self.waiters,
            submission_id,
        };
        // Looks that failed in a row: a store failing for a while (a failover) is waited out;
        // one failing for good ends the wait with the id to read again by.
        let mut failed_looks = 0;
        loop {
            // Register before looking, so a settlement between the look and the wait is seen.
            let (sender, settled) = oneshot::channel();
            {
                let mut waiters = self.waiters.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                let waiting = waiters.entry(submission_id.to_owned()).or_default();
                // The senders of earlier rounds of this wait (and of waits given up) go.
                waiting.retain(|(_, sender)| !sender.is_closed());
                waiting.push((key.clone(), sender));
            }
            // Another instance's submission is not this one's to read: as if there were none.
            let row = match self.store.submission(submission_id).await {
                Ok(row) => row,
                Err(error) => {
                    look_failed(submission_id, &mut failed_looks, error).await?;
                    continue;
                }
            };
            let row = row
                .filter(|row| row.key == *key)
                .ok_or_else(|| RuntimeError::InvalidRequest(format!("no submission \"{submission_id}\"")))?;
            if let Some(outcome) = row.outcome {
                self.waiters
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .remove(submission_id);
                let parts = match outcome {
                    Outcome::Completed => {
                        // A joined delivery is answered by its host's whole response (every
                        // attempt of it, also those before the one that joined the delivery),
                        // which began before the delivery was admitted: read from the start.
                        let after = if row.joined_into.is_some() { None } else { after };
                        let batches = match self.store.read(key, after).await {
                            Ok(batches) => batches,
                            Err(error) => {
                                look_failed(submission_id, &mut failed_looks, error).await?;
                                continue;
                            }
                        };
                        session::reply_of(&batches, row.joined_into.as_deref().unwrap_or(submission_id))
                    }
                    Outcome::Failed | Outcome::Aborted => ReplyParts::default(),
                };
                return reply_from(
                    submission_id,
                    Settled {
                        outcome,
                        error: row.error,
                        reply: parts,
                    },
                );
            }
            // A node that gave its work back settles nothing more here, and one shutting down
            // starts nothing queued (a response running here may still join it): on a store of
            // its own no other node will either while this process runs (the next one takes it
            // over).
            // (`claims_stopped` includes a node draining: while `release` gives the attempts back
            // one by one, one still running here may yet settle here.)
            let stranded = self.claims_stopped()
                && match row.status {
                    // Joined into a response (or being joined): it settles with its host, which
                    // runs nowhere here once the instance is not busy here.
                    SubmissionStatus::Queued | SubmissionStatus::Joining | SubmissionStatus::Joined => {
                        !self.busy_here(key)
                    }
                    // Running, but not here (an attempt whose settlement failed): nothing
                    // here takes it over. (A send that claimed it with its admission runs
                    // it while holding the instance, before its attempt is held.)
                    SubmissionStatus::Running => {
                        !self.busy_here(key)
                            && row
                                .attempt_id
                                .as_ref()
                                .is_none_or(|attempt| !self.running_attempts().contains(attempt))
                    }
                    SubmissionStatus::Settled => false,
                };
            if stranded && !self.store.shared() {
                // The row was read before the node was looked at: a submission that settled
                // here in between (its worker then idle) is answered, not called stranded.
                let settled_since = match self.store.submission(submission_id).await {
                    Ok(row) => row.is_some_and(|row| row.outcome.is_some()),
                    Err(error) => {
                        look_failed(submission_id, &mut failed_looks, error).await?;
                        continue;
                    }
                };
                if settled_since {
                    continue;
                }
                return Err(RuntimeError::NotProcessedHere {
                    submission_id: submission_id.to_owned(),
                });
            }
            // The look went through: only failures in a row end the wait.
            failed_looks = 0;
            // A dropped sender (the runtime going away) also ends the wait; the loop re-reads.
            // While the node stops, the wait also looks again now and then: what it waits on
            // may end without a settlement to wake it (an admission that failed while holding
            // the instance).
            // (On a shared store the node's look for settlements goes on while it stops, and
            // a wait there is never stranded: it looks no more often.)
            if self.claims_stopped() && !self.store.shared() {
                let poll = self.options.shared_store_poll.max(Duration::from_millis(1));
                let _ = tokio::time::timeout(poll, settled).await;
            } else {
                // The settlement wakes the wait. On a shared store, where another node may
                // settle it (its instance was busy there), so does that node's notice, or else
                // the node's look for settlements ([`RuntimeInner::watch_settlements`]), one
                // read for every wait. The wait also looks again on its own at every scan
                // interval: for a settlement that woke nobody (a delivery settled with a host
                // whose attempt could not read which deliveries it had joined; a look that
                // failed).
                let look = self.options.scan_interval.max(Duration::from_millis(1));
                let _ = tokio::time::timeout(look, settled).await;
            }
        }
    }

    /// Wakes everyone waiting for these submissions.
    pub(crate) fn notify_settled<'a>(&self, ids: impl IntoIterator<Item = &'a String>) {
        let mut waiters = self.waiters.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        for id in ids {
            for (_, sender) in waiters.remove(id).unwrap_or_default() {
                let _ = sender.send(());
            }
        }
    }

    /// Makes every send and read waiting on a submission of the instance `key` look at it
    /// again (another node settled submissions of it).
    fn wake_waiters_of(&self, key: &InstanceKey) {
        self.waiters
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .retain(|_, waiting| {
                // Dropped, a sender wakes its wait.
                waiting.retain(|(waits_in, _)| waits_in != key);
                !waiting.is_empty()
            });
    }
}

/// The sends and reads waiting for one submission to settle: each looks again when its
/// sender is used or dropped. Each names the instance it waits in (a wait that names another
/// instance than the submission's is refused after its look, but meanwhile it is here too).
type Waiting = Vec<(InstanceKey, oneshot::Sender<()>)>;

/// A wait's place in [`RuntimeInner::waiters`], taken out when the wait ends: with its
/// receivers dropped, its senders are closed, and the submission's entry goes once no wait is
/// left in it. (Without it, a wait for a submission that does not exist, or one given up on
/// a shared store where another node settles the submission, would stay for the runtime's
/// life.)
struct Registered<'a> {
    waiters: &'a Mutex<FastMap<String, Waiting>>,
    submission_id: &'a str,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        let mut waiters = self.waiters.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(waiting) = waiters.get_mut(self.submission_id) {
            waiting.retain(|(_, sender)| !sender.is_closed());
            if waiting.is_empty() {
                waiters.remove(self.submission_id);
            }
        }
    }
}

/// The sender's answer to a settlement: the reply of a completed submission, the error of
/// another.
fn reply_from(submission_id: &str, settled: Settled) -> Result<AgentReply, RuntimeError> {
    match settled.outcome {
        Outcome::Completed => Ok(AgentReply {
            text: settled.reply.texts.join("\n\n"),
            data: settled.reply.data,
            metadata: settled.reply.metadata,
            submission_id: submission_id.to_owned(),
        }),
        Outcome::Failed | Outcome::Aborted => {
            let error = settled.error.unwrap_or(SettlementError::new(
                "internal_error",
                "The submission did not complete.",
            ));
            Err(RuntimeError::Run {
                submission_id: submission_id.to_owned(),
                outcome: if settled.outcome == Outcome::Aborted {
                    "was aborted"
                } else {
                    "failed"
                },
                error_type: error.error_type,
                message: error.message,
                details: error.details,
                meta: error.meta.map(Box::new),
            })
        }
    }
}

/// The longest agent instance id, in characters.
pub const MAX_INSTANCE_ID_CHARS: usize = 512;

/// Why `id` cannot name an agent instance: blank (the reference's rule); longer than
/// [`MAX_INSTANCE_ID_CHARS`] or holding a control character (stricter than the reference: an
/// id keys every store's instance index, where Postgres takes neither a NUL nor a key past
/// its index's row size, and it is a URL path segment and a log field, where line breaks and
/// escapes are never what a client meant); or holding `/task_`, which separates a task's
/// conversation from its parent's in the child's stream id (see `InstanceKey::writable_by`:
/// the write fence reads a child's root from it). Ids stored before this rule that hold it are
/// no longer reachable through the runtime's API.
pub(crate) fn check_instance_id(id: &str) -> Result<(), String> {
    if flue_core::message::is_blank(id) {
        return Err("[flue] dispatch() requires a non-empty \"id\" target agent instance id.".into());
    }
    let length = id.chars().count();
    if length > MAX_INSTANCE_ID_CHARS {
        return Err(format!(
            "[flue] An agent instance id is at most {MAX_INSTANCE_ID_CHARS} characters; this one has {length}."
        ));
    }
    if let Some(control) = id.chars().find(|character| character.is_control()) {
        return Err(format!(
            "[flue] An agent instance id cannot contain control characters; this one has U+{:04X}.",
            u32::from(control)
        ));
    }
    if id.contains(crate::store::TASK_SEPARATOR) {
        return Err(format!(
            "[flue] An agent instance id cannot contain \"{}\": it separates a task's conversation from its parent's.",
            crate::store::TASK_SEPARATOR
        ));
    }
    Ok(())
}

/// `sub_ik_` + the first 32 hex digits of SHA-256 over the key's identity: replays of one
/// idempotency key converge on one submission, and different identities never meet.
///
/// The identity is the agent, the instance id and the key joined by newlines, as the
/// reference derives it. A key holding a newline is hashed with each part's length before it,
/// under another prefix (the ids this runtime has stored for such keys since its first
/// release): the reference's input would tell the parts apart too (admission refuses a
/// newline in an agent name or an instance id), so these ids alone differ from the
/// reference's, and are kept so that a replay of a stored key still finds its submission.
fn keyed_submission_id(agent: &str, id: &str, key: &str) -> String {
    let identity = if [agent, id, key].iter().any(|part| part.contains('\n')) {
        format!(
            "flue-submission-key-v2\n{}:{agent}{}:{id}{}:{key}",
            agent.len(),
            id.len(),
            key.len()
        )
    } else {
        format!("flue-submission-key\n{agent}\n{id}\n{key}")
    };
    let digest = Sha256::digest(identity.as_bytes());
    let hex: String = digest.iter().map(|byte| format!("{byte:02x}")).collect();
    format!("sub_ik_{}", &hex[..32])
}

/// A message to send, with the optional admission controls.
#[derive(Clone, Debug, PartialEq)]
pub struct SendRequest {
    /// The instance id.
    pub id: String,
    /// The message.
    pub message: DeliveredMessage,
    /// Creation data (only used when this send creates the instance).
    pub initial_data: Option<Value>,
    /// Conditional send.
    pub uid: UidCondition,
    /// Idempotency key: replays converge on one submission (a replay with another message,
    /// initial data or kind of send is a [`RuntimeError::SubmissionConflict`]). A replay is
    /// answered from the ledger before the `uid` condition is looked at, so retrying a
    /// create-only send (`uid: null`) whose answer was lost returns its receipt
    /// (`deduplicated`), not `agent_instance_exists` for the instance it created. The
    /// reference checks the condition first and refuses that retry.
    pub idempotency_key: Option<String>,
    /// The caller's trace context, carried on the submission.
    pub trace: Option<TraceContext>,
}

impl SendRequest {
    /// An unconditional send of `message` to `id`.
    pub fn new(id: impl Into<String>, message: impl Into<DeliveredMessage>) -> Self {
        Self {
            id: id.into(),
            message: message.into(),
            initial_data: None,
            uid: UidCondition::Any,
            idempotency_key: None,
            trace: None,
        }
    }

    /// Sets creation data.
    pub fn initial_data(mut self, data: Value) -> Self {
        self.initial_data = Some(data);
        self
    }

    /// Sets the conditional-send rule.
    pub fn uid(mut self, uid: UidCondition) -> Self {
        self.uid = uid;
        self
    }

    /// Sets an idempotency key.
    pub fn idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.idempotency_key = Some(key.into());
        self
    }

    /// Sets the caller's trace context.
    pub fn trace(mut self, trace: TraceContext) -> Self {
        self.trace = Some(trace);
        self
    }
}

/// What a completed submission produced.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AgentReply {
    /// The response's text parts, joined with blank lines.
    pub text: String,
    /// The last value of each data part.
    pub data: serde_json::Map<String, Value>,
    /// Response metadata.
    pub metadata: flue_core::metadata::Metadata,
    /// The submission.
    pub submission_id: String,
}

/// A runtime: runs registered agents.
#[derive(Clone)]
pub struct Runtime {
    inner: Arc<RuntimeInner>,
}

impl Runtime {
    /// Starts building a runtime (providers default to openai, anthropic and openrouter; the
    /// store defaults to the embedded SQLite store in `.flue/flue.db`).
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder {
            agents: Vec::new(),
            user_hooks: Vec::new(),
            providers: ProviderRegistry::with_defaults(),
            store: None,
            options: RuntimeOptions::default(),
        }
    }

    /// Admits `message` for the instance `id` of `agent`, fire-and-forget.
    pub async fn dispatch(
        &self,
        agent: &impl flue_core::Agent,
        id: impl Into<String>,
        message: impl Into<DeliveredMessage>,
    ) -> Result<DispatchReceipt, RuntimeError> {
        self.dispatch_request(&agent.definition().name, SendRequest::new(id, message))
            .await
    }

    /// Admits a [`SendRequest`] for the agent named `agent`.
    pub async fn dispatch_request(&self, agent: &str, request: SendRequest) -> Result<DispatchReceipt, RuntimeError> {
        let key = InstanceKey::new(agent, request.id.clone());
        let receipt = self.inner.admit(agent, request, SubmissionKind::Dispatch).await?.0;
        self.inner.slot(&key).wake();
        Ok(receipt)
    }

    /// How many instances hold a folded conversation in memory (at most about
    /// [`RuntimeOptions::cached_instances`], plus those running).
    pub fn cached_instance_count(&self) -> usize {
        self.inner
            .instances
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .len()
    }

    /// A handle on the instance `id` of `agent` (no I/O).
    pub fn init(&self, agent: &impl flue_core::Agent, id: impl Into<String>) -> AgentHandle {
        self.handle_of(InstanceKey::new(agent.definition().name.to_string(), id.into()))
    }

    fn handle_of(&self, key: InstanceKey) -> AgentHandle {
        AgentHandle {
            runtime: self.inner.clone(),
            key,
            uid: Arc::new(Mutex::new(None)),
        }
    }

    /// A handle on the instance `id` of the agent registered as `agent` (no I/O): for callers
    /// that know agents by name (a command line, a router).
    pub fn handle(&self, agent: &str, id: impl Into<String>) -> Result<AgentHandle, RuntimeError> {
        if !self.inner.agents.contains_key(agent) {
            return Err(RuntimeError::UnknownAgent(agent.to_owned()));
        }
        Ok(self.handle_of(InstanceKey::new(agent, id.into())))
    }

    /// The names of the registered agents, sorted.
    pub fn agent_names(&self) -> Vec<&str> {
        self.inner.agent_names()
    }

    /// The instance, if it was ever contacted.
    pub async fn get_agent_instance(
        &self,
        agent: &impl flue_core::Agent,
        id: &str,
    ) -> Result<Option<InstanceInfo>, RuntimeError> {
        // No instance can have an id admission refuses (nor could every store look it up).
        if check_instance_id(id).is_err() {
            return Ok(None);
        }
        let key = InstanceKey::new(agent.definition().name.to_string(), id);
        Ok(self.inner.store.instance(&key).await?)
    }

    /// Live events of every instance, in the order they happen. Live only: no replay.
    ///
    /// The runtime never waits for a subscriber: events are kept for the slowest one up to
    /// [`OBSERVED_BACKLOG`] behind the newest, and a subscriber that falls further behind
    /// misses the oldest ones, learning how many from `recv`'s
    /// [`RecvError::Lagged`](broadcast::error::RecvError::Lagged). A subscriber that must see
    /// every event (an audit log) hands them on at once, to a queue of its own.
    pub fn observe(&self) -> broadcast::Receiver<Observation> {
        self.inner.events.subscribe()
    }

    /// The user `user_id`: values shared by every thread of the user (durable, in the store),
    /// and `emit` to the user's connected clients. Setting a value runs the registered
    /// `user_value_changed` hooks in the background.
    pub fn user(&self, user_id: &str) -> flue_core::lifecycle::UserState {
        crate::lifecycle::user::user_state(&self.inner, user_id, true)
    }

    /// Live `UserState::emit` events of every user. Live only: no replay.
    pub fn observe_users(&self) -> broadcast::Receiver<crate::lifecycle::UserEvent> {
        self.inner.user_events.subscribe()
    }

    /// Tells the runtime a client connected to (`attached`) or disconnected from the user's
    /// event stream: the `user_client_attached` / `user_client_detached` hooks run in the
    /// background. The HTTP user stream calls it; call it from your own transport.
    pub fn user_client(&self, user_id: &str, client: flue_core::lifecycle::ClientInfo, attached: bool) {
        let event = if attached {
            crate::lifecycle::user::UserHookEvent::ClientAttached(client)
        } else {
            crate::lifecycle::user::UserHookEvent::ClientDetached(client)
        };
        crate::lifecycle::user::dispatch(&self.inner, user_id, event);
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// Starts this node's background work — lease renewal, and the scan that takes over
    /// expired submissions and picks up queued work — and runs one scan now. Call it when a
    /// process starts on a durable store: work left by a crashed process resumes, at once on
    /// a store one process holds ([`Store::exclusive`]: SQLite on Unix), elsewhere once its
    /// lease expired. Admission starts the background work too, but its first scan comes a
    /// scan interval later and takes over expired leases only.
    pub async fn start(&self) {
        self.inner.ensure_background();
        self.inner.scan_leases(true).await;
    }

    /// The shared state (for the crate's HTTP routes).
    pub(crate) fn inner(&self) -> &Arc<RuntimeInner> {
        &self.inner
    }

    /// Gives every submission this node is running back to the queue, and stops running
    /// them here; from then on (for good) this node claims no work, takes over none and
    /// admits none (a send is refused with [`RuntimeError::ShuttingDown`], over HTTP 503
    /// `runtime_unavailable`, so its client tries another node). Another node takes them over
    /// at once on a store that announces it ([`crate::store::Store::notices`]: `PostgresStore`
    /// does), else at its next scan ([`RuntimeOptions::scan_interval`]), and this one's next
    /// process as it starts, without waiting for their leases to expire.
    /// For a process about to exit with work still running: a server at the end of its
    /// shutdown's grace (`cli::serve` calls it), a command-line `run` whose background scan
    /// took over other instances' work. Returns how many were given back.
    ///
    /// What the attempts committed stays: the next attempt resumes from it, as after a crash
    /// (a tool batch they were running is repaired with outcome-unknown results). On a store
    /// that is not shared, the sends and reads waiting on this node for a submission that is
    /// not settled end with [`RuntimeError::NotProcessedHere`].
    pub async fn release(&self) -> usize {
        self.inner.draining.store(true, Ordering::Release);
        let running: Vec<_> = self
            .inner
            .instances
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
            .filter_map(|(key, slot)| slot.running().map(|attempt| (key.clone(), slot.clone(), attempt)))
            .collect();
        // Stopped first, then given back: given back first, another node could claim one and
        // run its tools while this node's still ran them. Each attempt gets a moment to see
        // its signal (its tools listen to it); one that runs on past it is given back anyway,
        // the process exiting next.
        for (_, slot, attempt) in &running {
            slot.release_attempt(&attempt.attempt_id);
        }
        let stopped = async {
            for (_, slot, attempt) in &running {
                while slot
                    .running()
                    .is_some_and(|current| current.attempt_id == attempt.attempt_id)
                {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        };
        let _ = tokio::time::timeout(RELEASE_WAIT, stopped).await;
        let mut released = 0;
        for (key, _, attempt) in running {
            match self.inner.store.requeue(&attempt).await {
                Ok(true) => {
                    released += 1;
                }
                // It settled (or another node took it over) meanwhile.
                Ok(false) => {}
                Err(error) => {
                    tracing::warn!(instance = %key, %error, "giving a running submission back to the queue failed; its lease lapses");
                }
            }
        }
        // The sends and reads waiting here look again (and, on a store of this node's own, are
        // told the node is stopping: nothing here will settle what they wait for).
        self.inner.wake_waiters();
        // The requeues' notices go out before the process exits (on a store that announces).
        self.inner.store.flush_announcements().await;
        released
    }

    /// Stops admitting new messages and claiming queued work (the attempts running go on, and
    /// may finish; what is queued waits for another node or the next process), and ends the
    /// live reads of the HTTP router ([`crate::http::router`]): SSE streams and event streams
    /// end (a client reconnects, to another node or to the next process) and a waiting long
    /// poll answers at once, so a server's graceful shutdown, which waits for every open
    /// response, can finish.
    pub fn shutdown(&self) {
        self.inner.shutting_down.store(true, Ordering::Release);
        self.inner.closed.send_replace(true);
        // The sends and reads waiting here look again: one whose submission is queued here, on
        // an instance nothing runs here, is told the node is stopping.
        self.inner.wake_waiters();
    }
}

/// Removes the least recently used idle slots until `target` remain and the cached
/// conversations weigh the target of `weight` at most (`weight`'s total, which an evicted
/// slot's weight leaves), or no idle one is left; returns them, for the caller to drop once it
/// released the map (freeing a quarter of the cache's conversations takes a while, and every
/// admission waits on that lock). Idle: no worker runs it and nothing else holds it (every
/// user takes it from this map, under the same lock, so none can appear meanwhile).
#[must_use = "the evicted slots are dropped by the caller, outside the lock"]
/// What eviction let go of: the slots it dropped from the cache, and what the slots it kept
/// (held elsewhere) cached. Dropped once the cache's lock is released.
#[derive(Default)]
struct Evicted {
    slots: Vec<Arc<InstanceSlot>>,
    shed: Vec<crate::session::Shed>,
}

fn evict_idle(
    instances: &mut FastMap<InstanceKey, Arc<InstanceSlot>>,
    target: usize,
    (total, target_weight): (&AtomicUsize, usize),
    orphan_horizon: Duration,
) -> Evicted {
    let mut idle: Vec<(u64, InstanceKey)> = instances
        .iter()
        .filter(|(_, slot)| slot.is_idle() && (Arc::strong_count(slot) == 1 || slot.weight() > 0))
        // An admission given up mid-way still owes its `submission_queued` to the worker that
        // claims it, through this slot (a few at most), until it is claimed by then if it
        // committed at all.
        .filter(|(_, slot)| !slot.binding().owes_announcements(orphan_horizon))
        .map(|(key, slot)| (slot.last_used(), key.clone()))
        .collect();
    idle.sort_unstable_by_key(|(used, _)| *used);
    // Past the count only for its bytes, a light instance (one a thousandth of the target
    // or less) stays: dropping it frees next to nothing, and its next message reads its stream
    // again (while busy instances hold the bytes, every light idle one would go).
    let light = target_weight / 1024;
    let mut evicted = Evicted::default();
    for (_, key) in idle {
        let over_count = instances.len() > target;
        if !over_count && total.load(Ordering::Relaxed) <= target_weight {
            break;
        }
        if !over_count && instances.get(&key).is_some_and(|slot| slot.weight() <= light) {
            continue;
        }
        // A slot held elsewhere (a live reader waits on its appends, which a slot made
        // again would not announce to it) stays, and lets go of what it caches instead.
        if let Some(slot) = instances.get(&key).filter(|slot| Arc::strong_count(slot) > 1) {
            if let Some((weight, shed)) = slot.shed() {
                total.fetch_sub(weight, Ordering::Relaxed);
                evicted.shed.push(shed);
            }
            continue;
        }
        if let Some(slot) = instances.remove(&key) {
            total.fetch_sub(slot.forget_weight(), Ordering::Relaxed);
            evicted.slots.push(slot);
        }
    }
    evicted
}

/// What a `submission_recovery` is about.
#[derive(Clone, Copy)]
pub(crate) enum Concerning<'a> {
    /// No one instance: a pass over the store (a scan, the lease heartbeat).
    Pass,
    /// An instance's queue.
    Instance(&'a InstanceKey),
    /// A submission known by its id.
    Submission(&'a InstanceKey, &'a str),
    /// A submission whose row is at hand (its kind and attempts are reported too).
    Row(&'a crate::store::Submission),
}

/// A claim requested with an admission that was dropped before it answered (see
/// [`RuntimeInner::admit_claiming`]): requeues the attempt, if the claim committed, and wakes a
/// worker for the instance.
struct PendingClaim {
    runtime: Arc<RuntimeInner>,
    key: InstanceKey,
    attempt: Option<crate::store::AttemptRef>,
}

impl Drop for PendingClaim {
    fn drop(&mut self) {
        let Some(attempt) = self.attempt.take() else { return };
        let (runtime, key) = (self.runtime.clone(), self.key.clone());
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                if let Err(error) = runtime.store.requeue(&attempt).await {
                    tracing::warn!(instance = %key, %error, "requeueing the claim of a dropped admission failed");
                    runtime.emit_recovery(
                        Concerning::Submission(&key, &attempt.submission_id),
                        StartSubmission,
                        Deferred,
                        Some(&error),
                    );
                }
                runtime.slot(&key).wake();
            });
        }
    }
}

/// A handle on one agent instance.
#[derive(Clone)]
pub struct AgentHandle {
    runtime: Arc<RuntimeInner>,
    key: InstanceKey,
    uid: Arc<Mutex<Option<String>>>,
}

/// Runs `run` (an instance's worker loop that a sender drives) on a task of its own and waits
/// for it: dropped, the wait ends and the loop goes on. `None` when the loop panicked (it
/// gave its attempt back to the queue: the caller waits for the settlement).
async fn detached(
    run: impl std::future::Future<Output = Option<crate::session::Settled>> + Send + 'static,
) -> Option<crate::session::Settled> {
    // In the caller's span: the submission's own span and logs stay under the application's
    // (an HTTP request's, say).
    // Boxed first: the run's future is large (about 12 KB), and a future passed to the
    // spawn by value is copied at each of its layers; a box moves as a pointer.
    tokio::spawn(tracing::Instrument::in_current_span(Box::pin(run)))
        .await
        .ok()
        .flatten()
}

/// The owner ids of this process's runtimes that still exist: on an
/// [exclusive](crate::store::Store::exclusive) store, a submission running under any other
/// owner was left by a process that ended.
static LIVE_OWNERS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Notes `owner` live in this process; returns it.
fn live_owners_add(owner: String) -> String {
    LIVE_OWNERS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .push(owner.clone());
    owner
}

/// Whether `owner` is a runtime of this process that still exists.
fn live_owner(owner: &str) -> bool {
    LIVE_OWNERS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .iter()
        .any(|live| live == owner)
}

impl Drop for RuntimeInner {
    fn drop(&mut self) {
        LIVE_OWNERS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .retain(|live| *live != self.owner_id);
    }
}

/// How long [`Runtime::release`] gives the attempts it stops to end before it gives them back.
const RELEASE_WAIT: Duration = Duration::from_secs(2);

impl AgentHandle {
    /// Sends `message` and waits for the reply. A runtime shutting down refuses it
    /// ([`RuntimeError::ShuttingDown`]); one that stops before processing it, once admitted,
    /// says so ([`RuntimeError::NotProcessedHere`]: it runs later, elsewhere); a store that
    /// fails while the reply is awaited, for about a minute, is
    /// [`RuntimeError::ReplyUnread`], with the id to [`read`](AgentHandle::read) it by.
    ///
    /// Dropping the returned future (a timeout, a `select!`) stops the wait, not the message:
    /// once admitted, it is processed as if dispatched; [`AgentHandle::abort`] stops it. The
    /// submission's id is in the reply the dropped future did not return: to wait for a reply
    /// again, send with an idempotency key ([`SendRequest::idempotency_key`], through
    /// [`AgentHandle::send_request`]) and send again with the same key, or
    /// [`dispatch`](AgentHandle::dispatch) and [`read`](AgentHandle::read) the receipt's
    /// submission.
    pub async fn send(&self, message: impl Into<DeliveredMessage>) -> Result<AgentReply, RuntimeError> {
        self.send_request(SendRequest::new(self.key.id.to_string(), message))
            .await
    }

    /// Sends a [`SendRequest`] (its `id` is replaced by this handle's) and waits for the reply.
    pub async fn send_request(&self, mut request: SendRequest) -> Result<AgentReply, RuntimeError> {
        // An id admission refuses takes no place in the instance cache (below, before the
        // admission), where it would push a warm conversation out.
        check_instance_id(&self.key.id).map_err(RuntimeError::InvalidRequest)?;
        if *request.id != *self.key.id {
            request.id = self.key.id.to_string();
        }
        // The sender waits for this submission anyway: when the instance is idle, this send
        // runs it (on a task of its own, see below) rather than waking a worker for it,
        // claiming it in the admission's own transaction.
        let slot = self.runtime.slot(&self.key);
        let role = slot.acquire();
        let claim = role.as_ref().map(|_| self.runtime.claim());
        let (receipt, offset, claimed) = self
            .runtime
            .admit_claiming(&self.key.agent, request, SubmissionKind::Direct, claim)
            .await?;
        let settled = match role {
            // A replay of a keyed send: its submission is processed (or settled) already, or
            // waits in the queue. Its reply is read when it settles; the queue is a worker's,
            // not this caller's to run first.
            Some(role) if receipt.deduplicated && claimed.is_none() => {
                drop(role);
                slot.wake();
                None
            }
            // Run on a task of its own, which the caller awaits: a caller that stops waiting
            // (a timeout, a `select!`, a dropped HTTP handler) stops observing, not the
            // response, whose tools would be cut mid-way and whose attempt would be spent.
            Some(role) => {
                let submission_id = receipt.submission_id.clone();
                detached(async move { role.drive(claimed, &submission_id).await }).await
            }
            None if receipt.deduplicated => None,
            None => {
                let (slot, submission_id) = (slot.clone(), receipt.submission_id.clone());
                detached(async move { slot.drive(&submission_id).await }).await
            }
        };
        *self.uid.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(receipt.uid.clone());
        match settled {
            // Settled on this task: its reply is at hand.
            Some(settled) => reply_from(&receipt.submission_id, settled),
            None => self.runtime.wait(&self.key, &receipt.submission_id, offset).await,
        }
    }

    /// Admits `message` without waiting; read the reply later with [`AgentHandle::read`].
    pub async fn dispatch(&self, message: impl Into<DeliveredMessage>) -> Result<DispatchReceipt, RuntimeError> {
        let request = SendRequest::new(self.key.id.to_string(), message);
        let receipt = self
            .runtime
            .admit(&self.key.agent, request, SubmissionKind::Dispatch)
            .await?
            .0;
        self.runtime.slot(&self.key).wake();
        Ok(receipt)
    }

    /// Waits for the submission to settle and returns its reply. An id this instance never
    /// admitted (another instance's included) is [`RuntimeError::InvalidRequest`]; an
    /// instance never contacted is [`RuntimeError::InstanceNotFound`]; a submission this node,
    /// stopping, will not process (on a store of its own) is
    /// [`RuntimeError::NotProcessedHere`]; a store that keeps failing for about a minute is
    /// [`RuntimeError::ReplyUnread`]. Reading starts the node's background work, as a send
    /// does: a submission a crashed process left queued or running is taken over here.
    pub async fn read(&self, submission_id: &str) -> Result<AgentReply, RuntimeError> {
        // An id admission refuses names no instance (nor could every store look it up).
        if check_instance_id(&self.key.id).is_err() {
            return Err(RuntimeError::InstanceNotFound(self.key.id.to_string()));
        }
        // A store failing for a while (the failover a `ReplyUnread` may have come from) is
        // waited out here as in the wait below.
        let mut failed_looks = 0;
        let known = loop {
            match self.runtime.store.instance(&self.key).await {
                Ok(info) => break info.is_some(),
                Err(error) => look_failed(submission_id, &mut failed_looks, error).await?,
            }
        };
        if !known {
            return Err(RuntimeError::InstanceNotFound(self.key.id.to_string()));
        }
        // Nor does one no admission makes (Postgres refuses a NUL in it as a failure, which
        // would be looked up again for a minute).
        if submission_id.is_empty() || submission_id.len() > 512 || submission_id.chars().any(char::is_control) {
            return Err(RuntimeError::InvalidRequest(format!(
                "no submission {:?}: a submission id is at most 512 bytes, without control characters",
                submission_id.chars().take(64).collect::<String>()
            )));
        }
        // What finds its settlement by another node, and what takes over the work a crashed
        // process left (without an admission here, nothing may have started them).
        self.runtime.ensure_background();
        self.runtime.wait(&self.key, submission_id, None).await
    }

    /// Requests an abort of every unsettled submission of the instance. Returns whether any
    /// was affected; settlement as aborted happens asynchronously. A response whose end was
    /// already durable (its final answer committed, its finish callbacks still running) wins
    /// the race and settles completed (reference §3.10).
    pub async fn abort(&self) -> Result<bool, RuntimeError> {
        if check_instance_id(&self.key.id).is_err() {
            return Ok(false);
        }
        Ok(!self.runtime.abort_instance(&self.key).await?.is_empty())
    }

    /// The instance this handle addresses.
    pub fn key(&self) -> &InstanceKey {
        &self.key
    }

    /// The incarnation seen by the last send through this handle.
    pub fn uid(&self) -> Option<String> {
        self.uid.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone()
    }
}

/// Ends a submission's correlation (see [`RuntimeInner::correlate`]) when dropped.
pub(crate) struct Correlated {
    runtime: std::sync::Weak<RuntimeInner>,
    submission_id: Arc<str>,
}

impl Drop for Correlated {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.upgrade() {
            runtime
                .correlations
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .remove(&self.submission_id);
        }
    }
}

/// How many looks in a row a wait for a settlement lets fail before it gives up: with
/// [`look_failed`]'s pauses, about a minute of a failing store.
const WAIT_FAILED_LOOKS: u32 = 8;

/// Notes a wait's look that failed on the store: pauses before the next (200 ms, doubling: 51 s
/// over the eight), or gives the wait up, past [`WAIT_FAILED_LOOKS`] in a row, with
/// [`RuntimeError::ReplyUnread`].
async fn look_failed(submission_id: &str, failed_looks: &mut u32, error: StoreError) -> Result<(), RuntimeError> {
    *failed_looks += 1;
    if *failed_looks > WAIT_FAILED_LOOKS {
        return Err(RuntimeError::ReplyUnread {
            submission_id: submission_id.to_owned(),
            reason: error.to_string(),
        });
    }
    tracing::warn!(submission = submission_id, %error, "reading a submission's settlement failed; looking again");
    tokio::time::sleep(Duration::from_millis(100 << (*failed_looks).min(8))).await;
    Ok(())
}

/// When a lease taken now for `lease` ends, in ms since the epoch (a lease too long to add
/// never ends, rather than wrapping).
fn lease_until(lease: Duration) -> u64 {
    crate::store::now_ms().saturating_add(u64::try_from(lease.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past the cache's bytes only, the least recently used heavy idle instances go; light
    /// ones stay (dropping them frees next to nothing), even when busy ones hold the bytes and
    /// the target cannot be reached. Past the count, any idle one goes, least recently used
    /// first.
    #[test]
    fn eviction_for_bytes_drops_heavy_idle_instances_and_leaves_light_ones() {
        let slot = |id: &str, used: u64, weight: usize| {
            let slot = InstanceSlot::new(InstanceKey::new("a", id), std::sync::Weak::new()).weighing(weight);
            slot.touch(used);
            (InstanceKey::new("a", id), Arc::new(slot))
        };
        let mut instances: FastMap<InstanceKey, Arc<InstanceSlot>> = [
            slot("light-old", 1, 10),
            slot("heavy-old", 2, 600),
            slot("light-new", 3, 10),
            slot("heavy-new", 4, 600),
        ]
        .into_iter()
        .collect();
        // A busy instance holding more than the target (its worker keeps a second reference).
        let (busy_key, busy) = slot("busy", 5, 50_000);
        let busy = Arc::new(Arc::into_inner(busy).expect("unshared").worked());
        instances.insert(busy_key, busy.clone());
        let total = AtomicUsize::new(10 + 600 + 10 + 600 + 50_000);
        // Light: a thousandth of the 20 KiB target or less.
        let evicted = evict_idle(&mut instances, 100, (&total, 20 << 10), Duration::MAX).slots;
        let mut gone: Vec<String> = evicted.iter().map(|slot| slot.key().id.to_string()).collect();
        gone.sort();
        assert_eq!(gone, ["heavy-new", "heavy-old"]);
        assert_eq!(total.load(Ordering::Relaxed), 10 + 10 + 50_000);
        // Past the count, the least recently used go first, whatever they weigh.
        let evicted = evict_idle(&mut instances, 2, (&total, usize::MAX), Duration::MAX).slots;
        let gone: Vec<String> = evicted.iter().map(|slot| slot.key().id.to_string()).collect();
        assert_eq!(gone, ["light-old"]);
        assert_eq!(total.load(Ordering::Relaxed), 10 + 50_000);
        drop(busy);
    }

    /// An idle instance owing the announcement of an admission given up mid-way stays cached
    /// within the horizon and goes past it; one whose admission is still in progress stays.
    #[test]
    fn eviction_passes_over_owed_announcements_only_within_the_horizon() {
        let slot = |id: &str, used: u64| {
            let slot = InstanceSlot::new(InstanceKey::new("a", id), std::sync::Weak::new());
            slot.touch(used);
            (InstanceKey::new("a", id), Arc::new(slot))
        };
        let (orphaned_key, orphaned) = slot("orphaned", 1);
        drop(orphaned.binding().admitting("sub_failed"));
        let (waiting_key, waiting) = slot("waiting", 2);
        let admission = waiting.binding().admitting("sub_waiting");
        let mut instances: FastMap<InstanceKey, Arc<InstanceSlot>> =
            [(orphaned_key.clone(), orphaned), (waiting_key.clone(), waiting)]
                .into_iter()
                .collect();
        let total = AtomicUsize::new(0);
        let within = evict_idle(&mut instances, 0, (&total, usize::MAX), Duration::from_secs(3600)).slots;
        assert!(within.is_empty(), "both still owe an announcement");
        let past = evict_idle(&mut instances, 0, (&total, usize::MAX), Duration::ZERO).slots;
        let gone: Vec<String> = past.iter().map(|slot| slot.key().id.to_string()).collect();
        assert_eq!(
            gone,
            ["orphaned"],
            "the orphan is forgotten; the admission in progress is not"
        );
        assert!(instances.contains_key(&waiting_key));
        drop(admission);
    }

    /// An idle instance a live reader holds (waiting on its appends) stays in the cache, so a
    /// later append still wakes that reader, but lets go of its conversation and its weight as
    /// an evicted one would: readers cannot pin conversations past the cache's bounds.
    #[test]
    fn eviction_keeps_a_held_idle_instance_and_lets_go_of_what_it_caches() {
        let birth = crate::record::Batch {
            offset: 0,
            records: Arc::new([crate::store::birth_record("inst_1", None)]),
        };
        let key = InstanceKey::new("a", "followed");
        let followed = InstanceSlot::new(key.clone(), std::sync::Weak::new())
            .caching(&birth)
            .weighing(600);
        let followed = Arc::new(followed);
        assert!(followed.caches_conversation());
        let reader = followed.clone();
        let mut instances: FastMap<InstanceKey, Arc<InstanceSlot>> = [(key.clone(), followed)].into_iter().collect();
        let total = AtomicUsize::new(600);
        let evicted = evict_idle(&mut instances, 100, (&total, 100), Duration::MAX);
        assert!(evicted.slots.is_empty());
        assert_eq!(evicted.shed.len(), 1);
        assert!(
            Arc::ptr_eq(&instances[&key], &reader),
            "the reader's slot is still the instance's"
        );
        assert_eq!(total.load(Ordering::Relaxed), 0);
        assert_eq!(reader.weight(), 0);
        assert!(
            !reader.caches_conversation(),
            "the conversation is read again when next needed"
        );
        // Let go of once: with nothing left to let go of, it is passed over.
        let passed_over = evict_idle(&mut instances, 0, (&total, 100), Duration::MAX);
        assert!(passed_over.slots.is_empty() && passed_over.shed.is_empty());
        assert_eq!(instances.len(), 1);
        drop(reader);
        // No longer held: it goes as any idle instance does.
        let evicted = evict_idle(&mut instances, 0, (&total, 100), Duration::MAX);
        assert_eq!(evicted.slots.len(), 1);
    }

    /// Reference Appendix A: the lease, the node's heartbeat, scan and settle grace, the model
    /// retries and their base delay, and the delta flush delay.
    #[test]
    fn the_default_timings_are_the_references() {
        let options = RuntimeOptions::default();
        assert_eq!(options.lease, Duration::from_millis(30_000));
        assert_eq!(options.heartbeat, Duration::from_secs(10));
        assert_eq!(options.scan_interval, Duration::from_secs(15));
        assert_eq!(options.settle_grace, Duration::from_secs(60));
        assert_eq!(
            (options.model_retries, options.model_retry_delay),
            (3, Duration::from_millis(2000))
        );
        assert_eq!(options.text_flush, Some(Duration::from_millis(1000)));
    }

    #[test]
    fn a_model_retry_waits_twice_as_long_as_the_last_up_to_30_s_whatever_the_count() {
        let options = RuntimeOptions {
            model_retry_delay: Duration::from_secs(2),
            ..RuntimeOptions::default()
        };
        let waits: Vec<u64> = [1, 2, 3, 4, 5]
            .map(|retry| options.model_retry_wait(retry).as_secs())
            .to_vec();
        assert_eq!(waits, [2, 4, 8, 16, 30]);
        for retry in [33, 64, u32::MAX] {
            assert_eq!(options.model_retry_wait(retry), MAX_MODEL_RETRY_WAIT);
        }
        let huge = RuntimeOptions {
            model_retry_delay: Duration::MAX,
            ..RuntimeOptions::default()
        };
        assert_eq!(huge.model_retry_wait(1), MAX_MODEL_RETRY_WAIT);
    }

    #[test]
    fn a_turn_loop_retry_waits_75_to_100_percent_of_its_nominal_wait_or_longer_when_asked() {
        let options = RuntimeOptions {
            model_retry_delay: Duration::from_secs(2),
            ..RuntimeOptions::default()
        };
        let error = crate::provider::ProviderError::new(crate::provider::ProviderErrorKind::Server, "busy");
        assert_eq!(
            options.model_retry_jittered(0, &error, 0.0),
            (1, Duration::from_secs(2))
        );
        assert_eq!(
            options.model_retry_jittered(0, &error, 1.0),
            (1, Duration::from_millis(1500))
        );
        assert_eq!(
            options.model_retry_jittered(1, &error, 0.5),
            (2, Duration::from_millis(3500))
        );
        // The provider's own retries count, and a longer Retry-After wins over the jitter.
        let mut asked = error.clone();
        asked.retried = 2;
        asked.retry_after = Some(Duration::from_secs(20));
        assert_eq!(
            options.model_retry_jittered(0, &asked, 1.0),
            (3, Duration::from_secs(20))
        );
        // Waited in full up to a minute (a per-minute limit's); a longer one is not retried.
        asked.retry_after = Some(Duration::from_secs(45));
        assert_eq!(options.model_retry_jittered(0, &asked, 0.0).1, Duration::from_secs(45));
        asked.retry_after = Some(Duration::from_secs(600));
        assert!(!asked.is_retryable());
        assert_eq!(options.model_retry_jittered(0, &asked, 0.0).1, MAX_RETRY_AFTER_WAIT);
    }

    #[test]
    fn keyed_ids_without_newlines_keep_the_first_releases_derivation() {
        // Stored submissions were keyed so: a replay after an upgrade must find its submission.
        let digest = Sha256::digest(b"flue-submission-key\nsupport\ncustomer-7\nretry-1");
        let hex: String = digest.iter().map(|byte| format!("{byte:02x}")).collect();
        assert_eq!(
            keyed_submission_id("support", "customer-7", "retry-1"),
            format!("sub_ik_{}", &hex[..32])
        );
    }

    #[test]
    fn identities_told_apart_only_by_where_a_newline_falls_get_different_ids() {
        let ids = [
            keyed_submission_id("a", "x", "y\nz"),
            keyed_submission_id("a", "x\ny", "z"),
            keyed_submission_id("a\nx", "y", "z"),
            keyed_submission_id("a", "x\ny\nz", ""),
        ];
        for (at, id) in ids.iter().enumerate() {
            assert!(id.starts_with("sub_ik_") && id.len() == "sub_ik_".len() + 32);
            assert!(!ids[at + 1..].contains(id), "{id} repeats");
        }
        assert_eq!(
            ids[0],
            keyed_submission_id("a", "x", "y\nz"),
            "a replay meets its submission"
        );
    }

    /// A runtime on the memory store with no agent: nothing ever runs what is admitted to it.
    fn idle_runtime() -> Runtime {
        Runtime::builder()
            .store(crate::store::MemoryStore::new())
            .build()
            .expect("a runtime")
    }

    /// A reader of thread events (`GET /:id/events`) gets them without making every other
    /// event observed: those are not even built; an observer gets both kinds.
    #[test]
    fn a_thread_event_reader_gets_thread_events_and_leaves_the_rest_unbuilt() {
        let runtime = idle_runtime();
        let key = InstanceKey::new("desk", "a");
        let mut thread_events = runtime.inner.observe_thread_events();
        assert!(!runtime.inner.observed());
        let built = AtomicBool::new(false);
        runtime.inner.emit_with(&key, None, || {
            built.store(true, Ordering::SeqCst);
            Event::Idle
        });
        assert!(!built.load(Ordering::SeqCst), "an event nobody observes is not built");
        let done = || Event::ToolCallDone {
            tool_call_id: "call_1".into(),
            tool_name: "add".into(),
            status: "success".into(),
        };
        runtime.inner.emit_thread_event(&key, None, done);
        let received = thread_events.try_recv().expect("the thread event");
        assert!(matches!(received.event, Event::ToolCallDone { .. }));
        let mut observer = runtime.observe();
        runtime.inner.emit_thread_event(&key, None, done);
        runtime.inner.emit(&key, None, Event::Idle);
        assert!(matches!(
            thread_events.try_recv().expect("the thread event").event,
            Event::ToolCallDone { .. }
        ));
        assert!(
            thread_events.try_recv().is_err(),
            "only thread events reach their readers"
        );
        assert!(matches!(
            observer.try_recv().expect("the thread event").event,
            Event::ToolCallDone { .. }
        ));
        assert!(matches!(
            observer.try_recv().expect("the other event").event,
            Event::Idle
        ));
    }

    #[test]
    fn observers_receive_event_indices_in_order_whatever_thread_emits_them() {
        let runtime = idle_runtime();
        let mut observer = runtime.observe();
        const PER_THREAD: usize = 1_000;
        let collected = std::thread::scope(|scope| {
            let reader = scope.spawn(|| {
                let mut indices = Vec::with_capacity(2 * PER_THREAD);
                while indices.len() < 2 * PER_THREAD {
                    match observer.blocking_recv() {
                        Ok(observation) => indices.push(observation.event_index),
                        Err(error) => panic!("the observer lagged or closed: {error}"),
                    }
                }
                indices
            });
            for _ in 0..2 {
                scope.spawn(|| {
                    for _ in 0..PER_THREAD {
                        runtime.inner.emit_recovery(
                            Concerning::Pass,
                            crate::events::RecoveryOperation::StartSubmission,
                            crate::events::RecoveryOutcome::Deferred,
                            None,
                        );
                        // Keeps the reader within the backlog.
                        std::thread::yield_now();
                    }
                });
            }
            reader.join().expect("the reader")
        });
        let out_of_order = collected.windows(2).filter(|pair| pair[1] != pair[0] + 1).count();
        assert_eq!(out_of_order, 0, "indices arrive as they were given, one after another");
    }

    fn registered_waits(runtime: &Runtime) -> usize {
        let waiters = runtime
            .inner
            .waiters
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        waiters.values().map(Vec::len).sum::<usize>() + waiters.len()
    }

    #[tokio::test]
    async fn a_wait_for_a_submission_that_does_not_exist_leaves_no_registration_behind() {
        let runtime = idle_runtime();
        let key = InstanceKey::new("assistant", "a");
        for _ in 0..3 {
            let error = runtime
                .inner
                .wait(&key, "sub_missing", None)
                .await
                .expect_err("no such submission");
            assert!(matches!(error, RuntimeError::InvalidRequest(_)), "{error:?}");
        }
        assert_eq!(registered_waits(&runtime), 0);
    }

    #[tokio::test]
    async fn a_wait_given_up_before_its_submission_settles_leaves_no_registration_behind() {
        let runtime = idle_runtime();
        let key = InstanceKey::new("assistant", "a");
        let admission = Admission {
            key: key.clone(),
            submission_id: "sub_queued".into(),
            keyed: false,
            kind: SubmissionKind::Dispatch,
            message: DeliveredMessage::user("hello"),
            initial_data: None,
            uid: UidCondition::Any,
            max_attempts: 1,
            timeout_ms: 60_000,
            claim: None,
            trace: None,
        };
        runtime.inner.store.admit(admission).await.expect("admitted");
        for _ in 0..3 {
            let wait = runtime.inner.wait(&key, "sub_queued", None);
            // The submission stays queued (no agent runs it): every wait is given up.
            assert!(tokio::time::timeout(Duration::from_millis(5), wait).await.is_err());
        }
        assert_eq!(registered_waits(&runtime), 0);
        // A wait still going on keeps its registration (its settlement must reach it).
        let waiting = {
            let inner = runtime.inner.clone();
            let key = key.clone();
            tokio::spawn(async move { inner.wait(&key, "sub_queued", None).await.map(|reply| reply.text) })
        };
        while registered_waits(&runtime) == 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(registered_waits(&runtime), 2);
        waiting.abort();
        assert!(waiting.await.expect_err("aborted").is_cancelled());
        assert_eq!(registered_waits(&runtime), 0);
    }
}
