//! Processing submissions: one worker per busy instance claims submissions in admission order
//! and drives each response through the turn loop.
//!
//! Every durability point is one append: the input, a start seam (signals, state writes,
//! marker), each model step, each tool batch (outcomes, the state writes its tools made, the
//! commit marker), each continued finish cycle, the response-finish metadata, and settlement.
//! A model step that streams text or reasoning for longer than `RuntimeOptions::text_flush`
//! also appends its start and what streamed so far while it streams (see `live_text`), so
//! clients follow it. Neither is a durability point: a step whose attempt dies before it
//! completes is made again, and only completed steps count against `max_steps`. Its start
//! does count as the response's first: `use_response_start` runs once per response, and a
//! resumed one reads back the metadata that start recorded.

mod binding;
mod compaction;
pub(crate) mod conversation;
mod deadline;
mod lifecycle;
mod live_text;
mod narration;
mod observation;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use flue_core::abort::AbortSignal;
use flue_core::event_hooks::{
    AgentFinishContext, AgentStartContext, AppendWindow, ResponseFinishContext, ResponseStartContext, ResponseSummary,
    SeamChannel,
};
use flue_core::lifecycle::ExecutionState;
use flue_core::log::{LogLevel, LogSink, Logger};
use flue_core::message::{DeliveredMessage, Signal};
use flue_core::metadata::{Metadata, merge_metadata};
use flue_core::model::ThinkingLevel;
use flue_core::render::{RenderState, Rendered};
use flue_core::state::StateBuffer;
use flue_core::tool::ToolContext;
use flue_core::usage::Usage;
use flue_core::{Agent, RenderError};
use futures_util::{FutureExt, StreamExt};
use tracing::Instrument;

use crate::events::{
    Correlation, Event, LazyId, OperationKind, RecoveryOperation, RecoveryOutcome, TurnPurpose, TurnRequest,
    TurnResponse,
};
use crate::lifecycle::HookSet;
use crate::lifecycle::thread::{RuntimeThread, ThreadWriter};
use crate::provider::{
    Messages, ModelImage, ModelMessage, ModelProvider, ModelRequest, ModelResponse, ModelToolCall, StreamEvent,
    ToolSpec,
};
use crate::record::{AttachmentRef, Batch, Outcome, Record, RecordBody, SettlementError, new_id, now};
use crate::runtime::{Concerning, RuntimeInner};
use crate::store::AttachmentPut;
use crate::store::{AttemptRef, InstanceKey, StoreError, Submission, SubmissionKind, SubmissionStatus};
use crate::tools;
use deadline::Deadline;
use live_text::LiveText;

pub(crate) use binding::{ABORTED, Attempt, AttemptBinding, InstanceBinding, LEASE_LOST};
#[cfg(feature = "postgres")]
pub(crate) use conversation::records_weight;
pub(crate) use conversation::{
    CallIds, Conversation, ReplyParts, RetainedChild, interrupted_task, micros_of, reply_of, tool_calls_from,
};

/// How many takeovers past its budget a submission whose stream cannot be read is left to
/// (the lease lapsing each time) before it settles as failed without knowing how it ended.
const UNREAD_DEFERRALS: u32 = 3;

/// The framework ceiling of continued finish cycles per response.
pub const MAX_AGENT_FINISH_CYCLES: u32 = 32;

/// The framework ceiling of steps of `queue_tool` calls run in a row, without a model step
/// between them (calls that queue calls: a tool that queues itself would run until the
/// submission's deadline).
pub const MAX_QUEUED_TOOL_STEPS: u32 = 64;

/// One instance's worker state.
pub(crate) struct InstanceSlot {
    key: InstanceKey,
    runtime: Weak<RuntimeInner>,
    busy: AtomicBool,
    wakes: AtomicU64,
    /// When the runtime last handed this slot out (its use clock): for evicting idle ones.
    last_used: AtomicU64,
    binding: Arc<InstanceBinding>,
    conversation: tokio::sync::Mutex<Conversation>,
    /// The conversation's weight when last noted, counted in the runtime's total.
    weight: std::sync::atomic::AtomicUsize,
    /// The instance's live MCP connections, which its responses reuse.
    mcp: crate::mcp::McpConnections,
    /// The stream as its thread state's reads folded it (see `ThreadWriter`).
    thread_fold: crate::lifecycle::thread::ThreadFold,
}

/// The worker role of an instance, taken before admitting (see [`InstanceSlot::acquire`]).
pub(crate) struct Role {
    slot: Arc<InstanceSlot>,
    /// The wake count when taken: senders that found the role taken meanwhile left their
    /// work to it.
    seen: u64,
    held: bool,
}

impl Role {
    /// Runs the instance's queue until `submission_id` is processed, starting with what the
    /// admission claimed (if anything).
    /// Returns the submission's settlement when this call made it and knows its reply whole.
    pub(crate) async fn drive(mut self, claimed: Option<Submission>, submission_id: &str) -> Option<Settled> {
        self.held = false;
        self.slot.run(claimed, Some(submission_id)).await
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        if self.held {
            self.slot.busy.store(false, Ordering::SeqCst);
            if self.slot.wakes.load(Ordering::SeqCst) != self.seen {
                self.slot.wake();
            }
        }
    }
}

/// Hands an instance's queue on when the task running it is dropped mid-way.
struct Abandoned {
    slot: Arc<InstanceSlot>,
    /// The attempt in progress.
    attempt: Option<AttemptRef>,
    armed: bool,
    /// Whether the task still holds the instance's worker role. Once it gave the role up
    /// (to look at the queue a last time), another worker may run the instance and make its
    /// own attempt current: a drop then only makes up for the look it cut short.
    holds_role: bool,
}

impl Drop for Abandoned {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if !self.holds_role {
            if tokio::runtime::Handle::try_current().is_ok() {
                self.slot.wake();
            }
            return;
        }
        self.slot.binding.set_current(None);
        let (slot, attempt) = (self.slot.clone(), self.attempt.take());
        // No longer this node's to renew: a requeue that fails leaves the lease to lapse.
        if let Some(attempt) = &attempt {
            slot.binding.release(&attempt.attempt_id);
        }
        self.slot.busy.store(false, Ordering::SeqCst);
        // Without a tokio runtime (it is shutting down) the lease lapses with the process.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                if let (Some(attempt), Some(runtime)) = (attempt, slot.runtime.upgrade())
                    && let Err(error) = runtime.store.requeue(&attempt).await
                {
                    tracing::warn!(instance = %slot.key, %error, "requeueing an abandoned attempt failed");
                    runtime.emit_recovery(
                        Concerning::Submission(&slot.key, &attempt.submission_id),
                        RecoveryOperation::ProcessSubmission,
                        RecoveryOutcome::Deferred,
                        Some(&error),
                    );
                }
                slot.wake();
            });
        }
    }
}

/// What a slot the cache keeps let go of ([`InstanceSlot::shed`]): dropped outside the cache's
/// lock, as an evicted slot is.
pub(crate) struct Shed {
    _conversation: Conversation,
    _mcp: crate::mcp::McpConnections,
    _thread_fold: Option<Box<(Conversation, Option<u64>)>>,
}

impl InstanceSlot {
    pub(crate) fn new(key: InstanceKey, runtime: Weak<RuntimeInner>) -> Self {
        let binding = Arc::new(InstanceBinding {
            key: key.clone(),
            runtime: runtime.clone(),
            appended: tokio::sync::Notify::new(),
            appends: AtomicU64::new(0),
            current: Mutex::new(None),
            pending_aborts: Mutex::default(),
            starting: Mutex::default(),
            prevented: Mutex::default(),
            unannounced: Mutex::default(),
        });
        Self {
            key,
            runtime,
            busy: AtomicBool::new(false),
            wakes: AtomicU64::new(0),
            last_used: AtomicU64::new(0),
            binding,
            conversation: tokio::sync::Mutex::new(Conversation::default()),
            weight: std::sync::atomic::AtomicUsize::new(0),
            mcp: crate::mcp::McpConnections::default(),
            thread_fold: crate::lifecycle::thread::ThreadFold::default(),
        }
    }

    /// Whether this node knows the instance exists (its conversation was read from a stream),
    /// without waiting: `false` when it does not know (or the conversation is in use).
    pub(crate) fn known_to_exist(&self) -> bool {
        self.conversation
            .try_lock()
            .is_ok_and(|conversation| conversation.last_offset.is_some())
    }

    /// The MCP sessions this instance kept that no response used for `idle`, taken away (to
    /// drop, closing them, outside the cache's lock).
    pub(crate) fn expired_mcp_sessions(&self, idle: std::time::Duration) -> Vec<crate::mcp::McpSession> {
        self.mcp.expired(idle)
    }

    pub(crate) fn touch(&self, used: u64) {
        self.last_used.fetch_max(used, Ordering::Relaxed);
    }

    pub(crate) fn last_used(&self) -> u64 {
        self.last_used.load(Ordering::Relaxed)
    }

    /// The attempts whose leases this node holds for the instance: the running one and those
    /// about to start.
    pub(crate) fn held_attempts(&self) -> Vec<String> {
        self.binding.held_attempts()
    }

    /// What the instance's responses and its admissions on this node share.
    pub(crate) fn binding(&self) -> &Arc<InstanceBinding> {
        &self.binding
    }

    /// Whether no worker runs this instance.
    pub(crate) fn is_idle(&self) -> bool {
        !self.busy.load(Ordering::SeqCst)
    }

    /// Woken after every batch this node appends to the instance's stream.
    pub(crate) fn appended(&self) -> &tokio::sync::Notify {
        &self.binding.appended
    }

    /// How many batches this node appended to the instance's stream (counted before the
    /// [`appended`](Self::appended) wake-up).
    pub(crate) fn appends(&self) -> u64 {
        self.binding.appends.load(Ordering::Acquire)
    }

    /// Counts an append made outside a response (an admission's birth record) and wakes the
    /// live readers.
    pub(crate) fn note_append(&self) {
        self.binding.note_append();
    }

    /// Takes the first batch of an instance an admission just created (its birth record) as
    /// what the stream holds, so the first submission does not read it back. Only an empty
    /// conversation takes it, and only when no one holds it (else the next read brings it).
    pub(crate) fn note_birth(&self, birth: &Batch) {
        if let Ok(mut conversation) = self.conversation.try_lock()
            && conversation.last_offset.is_none()
            && birth.offset == 0
        {
            conversation.apply(birth);
            self.note_weight(conversation.weight());
        }
    }

    /// Counts the conversation's `weight` in the runtime's total of cached conversations.
    fn note_weight(&self, weight: usize) {
        let Some(runtime) = self.runtime.upgrade() else { return };
        let before = self.weight.swap(weight, Ordering::Relaxed);
        runtime.cached_weight.fetch_add(weight, Ordering::Relaxed);
        runtime.cached_weight.fetch_sub(before, Ordering::Relaxed);
        if weight > before {
            runtime.trim_cache();
        }
    }

    /// The conversation's weight when last noted.
    pub(crate) fn weight(&self) -> usize {
        self.weight.load(Ordering::Relaxed)
    }

    /// The instance.
    #[cfg(test)]
    pub(crate) fn key(&self) -> &InstanceKey {
        &self.key
    }

    /// Notes `weight` as the conversation's, without a runtime (the cache's own tests).
    #[cfg(test)]
    pub(crate) fn weighing(self, weight: usize) -> Self {
        self.weight.store(weight, Ordering::Relaxed);
        self
    }

    /// Its weight, no longer counted here (the runtime drops the slot): what to subtract from
    /// the runtime's total.
    pub(crate) fn forget_weight(&self) -> usize {
        self.weight.swap(0, Ordering::Relaxed)
    }

    /// Lets go of what the slot caches, as dropping it would (its conversation, read from the
    /// stream again by the next submission, and its MCP sessions), when no submission uses
    /// them: for a slot the cache must keep (a live reader waits on its appends). Returns the
    /// weight no longer counted here, to subtract from the runtime's total, and what was let
    /// go of, to drop once the cache's lock is released.
    pub(crate) fn shed(&self) -> Option<(usize, Shed)> {
        let mut conversation = self.conversation.try_lock().ok()?;
        let shed = Shed {
            _conversation: std::mem::take(&mut *conversation),
            _mcp: self.mcp.take(),
            _thread_fold: self.thread_fold.try_lock().ok().and_then(|mut fold| fold.take()),
        };
        drop(conversation);
        Some((self.forget_weight(), shed))
    }

    /// Marks the slot as run by a worker (the cache's own tests).
    #[cfg(test)]
    pub(crate) fn worked(self) -> Self {
        self.busy.store(true, Ordering::SeqCst);
        self
    }

    /// Whether the slot caches a conversation read from the stream (the cache's own tests).
    #[cfg(test)]
    pub(crate) fn caches_conversation(&self) -> bool {
        self.conversation
            .try_lock()
            .map_or(true, |conversation| conversation.last_offset.is_some())
    }

    /// Takes `batch` into the cached conversation (the cache's own tests).
    #[cfg(test)]
    pub(crate) fn caching(self, batch: &Batch) -> Self {
        self.conversation.try_lock().expect("unshared").apply(batch);
        self
    }

    /// Makes sure a worker runs for this instance.
    pub(crate) fn wake(self: &Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        if !self.busy.swap(true, Ordering::SeqCst) {
            tokio::spawn(self.clone().work());
        }
    }

    /// Runs `submission`, just claimed by a caller that holds the worker role, on a spawned
    /// worker that takes the role over and carries on with the instance's queue.
    fn hand_over(self: &Arc<Self>, mut submission: Submission, attempt_id: String) {
        self.binding.hold(attempt_id.clone());
        submission.attempt_id = Some(attempt_id);
        let slot = self.clone();
        tokio::spawn(async move {
            slot.run(Some(submission), None).await;
        });
    }

    /// Runs a submission this node took over from an expired lease (the claim is held), then
    /// carries on with the instance's queue.
    pub(crate) fn resume(self: &Arc<Self>, mut submission: Submission, attempt_id: String) {
        let slot = self.clone();
        // Held from the takeover on: the heartbeat renews the lease while the attempt waits
        // for the worker role, and the scan leaves it alone.
        self.binding.hold(attempt_id.clone());
        submission.attempt_id = Some(attempt_id.clone());
        tokio::spawn(async move {
            // Wait for any local worker of this instance to finish first.
            while slot.busy.swap(true, Ordering::SeqCst) {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            slot.run(Some(submission), None).await;
            // Starting released it; an attempt that never started must not be renewed on.
            slot.binding.release(&attempt_id);
        });
    }

    /// An abort was requested for `submissions` (all of the instance's unsettled ones): the
    /// running attempt is signalled, and an attempt about to start learns of it.
    pub(crate) fn abort_submissions(&self, submissions: &[String]) {
        self.binding.abort_submissions(submissions);
    }

    /// Stops the attempt `attempt_id` for `reason` when this node holds it: running, or
    /// about to start (see [`InstanceBinding::stop_attempt`]).
    pub(crate) fn stop_attempt(&self, attempt_id: &str, reason: &'static str) {
        self.binding.stop_attempt(attempt_id, reason);
    }

    /// Stops the running attempt `attempt_id` here; its submission was given back to the queue.
    pub(crate) fn release_attempt(&self, attempt_id: &str) {
        self.binding.release_attempt(attempt_id);
    }

    /// The attempt running here, if any.
    pub(crate) fn running(&self) -> Option<AttemptRef> {
        self.binding.current().map(|attempt| attempt.attempt.clone())
    }

    async fn work(self: Arc<Self>) {
        self.run(None, None).await;
    }

    /// Processes the instance's queue on the calling task until `submission_id` has been
    /// processed (then hands any remaining work to a spawned worker), or until the node stops
    /// taking work. Returns at once when a worker is already running: the caller then just
    /// waits for the settlement. Call it once the submission is admitted (a running worker
    /// re-checks the queue when woken after that).
    pub(crate) async fn drive(self: &Arc<Self>, submission_id: &str) -> Option<Settled> {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        if self.busy.swap(true, Ordering::SeqCst) {
            return None;
        }
        self.run(None, Some(submission_id)).await
    }

    /// Takes the instance's worker role before an admission, when no worker runs: the caller
    /// then admits with a claim and continues with [`Role::drive`]. Dropping the role unused
    /// (a failed admission, a cancelled send) gives it back.
    pub(crate) fn acquire(self: &Arc<Self>) -> Option<Role> {
        let seen = self.wakes.load(Ordering::SeqCst);
        (!self.busy.swap(true, Ordering::SeqCst)).then(|| Role {
            slot: self.clone(),
            seen,
            held: true,
        })
    }

    /// The worker loop; the caller holds `busy`. `first` is a submission already claimed.
    ///
    /// Cancellation-safe: when the task running it is dropped (a runtime shutting down drops
    /// its tasks; a sender runs it on a task of its own, so a cancelled send does not), the
    /// attempt in progress is requeued, as if its process had died, and a spawned worker takes
    /// the queue over.
    ///
    /// Returns `until`'s settlement when this loop made it and knows its reply whole.
    async fn run(self: &Arc<Self>, first: Option<Submission>, until: Option<&str>) -> Option<Settled> {
        let mut guard = Abandoned {
            slot: self.clone(),
            attempt: None,
            armed: true,
            holds_role: true,
        };
        let settled = self.run_loop(&mut guard, first, until).await;
        guard.armed = false;
        settled
    }

    async fn run_loop(
        self: &Arc<Self>,
        guard: &mut Abandoned,
        mut first: Option<Submission>,
        until: Option<&str>,
    ) -> Option<Settled> {
        let mut seen = self.wakes.load(Ordering::SeqCst);
        loop {
            let runtime = self.runtime.upgrade()?;
            let next = match first.take() {
                Some(claimed) => Ok(claimed.attempt_id.clone().map(|attempt_id| (claimed, attempt_id))),
                // A node shutting down, or giving its work back, claims no more.
                None if runtime.claims_stopped() => Ok(None),
                None => {
                    let claim = runtime.claim();
                    let claimed = runtime.store.claim_next(&self.key, &claim).await;
                    claimed.map(|claimed| claimed.map(|submission| (submission, claim.attempt_id)))
                }
            };
            match next {
                // Another's submission heads the queue (another node's admission, one given
                // back): a spawned worker runs it and the rest of the queue, this caller's
                // submission included, which the caller then waits for (the sender's loop
                // runs its own submission only, as the submission a send admitted).
                Ok(Some((submission, attempt_id))) if until.is_some_and(|until| until != submission.id) => {
                    self.hand_over(submission, attempt_id);
                    return None;
                }
                Ok(Some((submission, attempt_id))) => {
                    let done = until == Some(submission.id.as_str());
                    // Held from its claim: the lease is renewed while the attempt gets ready to
                    // start (a stalled store can take longer than the lease), and the scan does
                    // not take over what this node is about to run.
                    self.binding.hold(attempt_id.clone());
                    guard.attempt = Some(AttemptRef {
                        submission_id: submission.id.clone(),
                        attempt_id: attempt_id.clone(),
                    });
                    let span = tracing::info_span!(
                        "flue.submission",
                        submission = %submission.id,
                        instance = %self.key,
                        attempt = %attempt_id,
                        traceparent = submission.trace.as_ref().map(|trace| trace.traceparent.as_str()),
                        tracestate = submission.trace.as_ref().and_then(|trace| trace.tracestate.as_deref()),
                    );
                    let (settled, left) = self
                        .process(&runtime, submission, attempt_id.clone(), until)
                        .instrument(span)
                        .await;
                    if let Ok(conversation) = self.conversation.try_lock() {
                        // With the thread state's own fold, which the slot keeps too.
                        let thread_fold = self
                            .thread_fold
                            .try_lock()
                            .ok()
                            .and_then(|fold| fold.as_ref().map(|folded| folded.0.weight()))
                            .unwrap_or(0);
                        self.note_weight(conversation.weight() + thread_fold);
                    }
                    // `until` joined the response just settled: its sender reads the host's
                    // reply from the store, and the rest of the queue is a worker's.
                    let (done, settled) = if done {
                        (true, settled)
                    } else {
                        (left.is_some_and(|left| left.settled_until), None)
                    };
                    self.binding.release(&attempt_id);
                    guard.attempt = None;
                    seen = self.wakes.load(Ordering::SeqCst);
                    if done {
                        // The worker's role is given up here: from now on another worker may
                        // run the instance (and make its attempt current), which a drop of
                        // this task while it looks at the queue below must leave alone.
                        guard.holds_role = false;
                        self.busy.store(false, Ordering::SeqCst);
                        // An admitter that found this worker busy counted its admission after
                        // committing it: what the settlement did not see, the count shows.
                        let more = match left {
                            Some(left) => left.queued || self.wakes.load(Ordering::SeqCst) != left.admissions,
                            None => {
                                self.wakes.load(Ordering::SeqCst) != seen
                                    || runtime.store.has_queued(&self.key).await.unwrap_or(true)
                            }
                        };
                        if more {
                            self.wake();
                        }
                        return settled;
                    }
                }
                Ok(None) => {
                    self.busy.store(false, Ordering::SeqCst);
                    let now_seen = self.wakes.load(Ordering::SeqCst);
                    if now_seen != seen && !self.busy.swap(true, Ordering::SeqCst) {
                        seen = now_seen;
                        continue;
                    }
                    if runtime.claims_stopped() {
                        // What is left queued here waits for another node: its waiters learn
                        // that now that nothing here runs the instance, and the other nodes
                        // (on a store that announces) that they may.
                        runtime.wake_waiters();
                        if runtime.store.shared() && runtime.store.has_queued(&self.key).await.unwrap_or(true) {
                            runtime
                                .store
                                .announce(crate::store::StoreNotice::Queued(self.key.clone()));
                        }
                    }
                    return None;
                }
                Err(error) => {
                    tracing::error!(instance = %self.key, %error, "claiming the next submission failed");
                    runtime.emit_recovery(
                        Concerning::Instance(&self.key),
                        RecoveryOperation::StartSubmission,
                        RecoveryOutcome::Deferred,
                        Some(&error),
                    );
                    self.busy.store(false, Ordering::SeqCst);
                    // A wake while the claim failed (an admission committed meanwhile) is not
                    // left to the next scan: one more claim, as after an empty one.
                    let now_seen = self.wakes.load(Ordering::SeqCst);
                    if now_seen != seen && !self.busy.swap(true, Ordering::SeqCst) {
                        seen = now_seen;
                        continue;
                    }
                    return None;
                }
            }
        }
    }

    /// Runs one claimed submission to its settlement. Returns the settlement when this call
    /// made it durable and the reply is complete in what this attempt committed (its first
    /// attempt, not given up on): the sender then needs no read of the store. With it, the queue as the
    /// settlement left it, when the settlement committed (and whether `until` settled with it).
    async fn process(
        &self,
        runtime: &Arc<RuntimeInner>,
        submission: Submission,
        attempt_id: String,
        until: Option<&str>,
    ) -> (Option<Settled>, Option<QueueLeft>) {
        // Before any other event of it: its admission's caller (on another thread, or
        // dropped) may not have announced it yet.
        self.binding.announce_claimed(&submission.id, || {
            runtime.emit(
                &self.key,
                Some(&submission.id),
                Event::SubmissionQueued { kind: submission.kind },
            );
        });
        let Some(agent) = runtime.agents.get(&*self.key.agent).cloned() else {
            return (None, None);
        };
        let mut conversation = self.conversation.lock().await;
        let attempt_ref = AttemptRef {
            submission_id: submission.id.clone(),
            attempt_id: attempt_id.clone(),
        };
        let refreshed = match runtime.store.read(&self.key, conversation.last_offset).await {
            Ok(batches) => {
                for batch in &batches {
                    conversation.apply(batch);
                }
                Ok(())
            }
            Err(error) => Err(Failure::store(error)),
        };
        let attempt = Arc::new(Attempt {
            attempt: attempt_ref.clone(),
            buffer: Mutex::new(StateBuffer::new(Arc::new(conversation.state.clone()))),
            data: Mutex::default(),
            data_order: tokio::sync::Mutex::new(()),
            writer: std::sync::OnceLock::new(),
            signal: AbortSignal::new(),
            responding: AtomicBool::new(true),
            ended_calls: Mutex::default(),
            tasks: tokio::runtime::Handle::try_current().ok(),
        });
        // An abort requested between the claim and now reached no signal: it counts as
        // requested before the attempt ran.
        let stopped = self.binding.start(attempt.clone());
        let abort_requested = stopped == Some(binding::ABORTED) || submission.abort_requested;
        // Another node took the lease over while the attempt got ready: the submission is
        // that node's to run.
        if binding::hands_over(stopped) {
            self.binding.set_current(None);
            *conversation = Conversation::default();
            return (None, None);
        }
        // The node began giving its work back while the attempt got ready (`release` gives back
        // the running attempts only): it gives this one back too, before it does anything.
        if runtime.draining() {
            self.binding.set_current(None);
            *conversation = Conversation::default();
            if let Err(error) = runtime.store.requeue(&attempt_ref).await {
                tracing::warn!(instance = %self.key, submission = %submission.id, %error, "giving an attempt back to the queue failed; its lease lapses");
            }
            return (None, None);
        }
        // A response that ended durably (an attempt died before settling it) settles as
        // completed: even past its budget, after an abort request or with its attempts used.
        let answered = refreshed.is_ok() && conversation.has_ended(&submission.id);
        // The attempt could not read the stream: it did no work, and how the submission ended
        // is not known yet (see the settlement below).
        let unread = refreshed.is_err();
        // Whether the submission's input is in the stream: a budget spent before it was is an
        // interruption before input (unknown when the stream could not be read).
        let input_applied = refreshed.is_err() || conversation.has_input(&submission.id);
        // The live deadline: at the budget's end the attempt is aborted wherever it waits (a
        // model stream, a tool, a retry delay) and settles as timed out.
        let deadline = deadline_of(&submission, agent.get().definition().durability.timeout);
        // A budget a takeover finds spent: the submission settles as it is, without an attempt
        // (§3.9 step 4), so none of an attempt's events (running, the operation, the agent's
        // start and end) is emitted. (An abort requested before the attempt ran is the
        // attempt's pre-execution check, after its `submission_running`, §3.7.)
        let budget_spent_unrun =
            refreshed.is_ok() && !answered && !abort_requested && submission.attempt_count > submission.max_attempts;
        // So does a deadline a re-attempt (a takeover, a retry) finds passed (§3.9 step 5): it
        // settles as timed out. (A first attempt runs, and its deadline fires at once.)
        let past_deadline_unrun = refreshed.is_ok()
            && !answered
            && !abort_requested
            && !budget_spent_unrun
            && submission.attempt_count > 1
            && Instant::now() >= deadline;
        let settles_unrun = budget_spent_unrun || past_deadline_unrun;
        // An abort the attempt finds before it runs (§3.7 step 1): reported running, then
        // settled aborted, without an operation (no prompt runs), so without its events.
        let aborted_before_running = refreshed.is_ok() && !answered && abort_requested;
        // A response that ended durably settles as it is (§3.9 step 2; its missing finish
        // batch, if any, is written first): no attempt runs, so none of an attempt's events is
        // emitted either, and observers counting attempts count none.
        let operates = !settles_unrun && !aborted_before_running && !answered;
        if !settles_unrun && !answered {
            runtime.emit(
                &self.key,
                Some(&submission.id),
                Event::SubmissionRunning {
                    kind: submission.kind,
                    attempt_count: submission.attempt_count,
                    max_attempts: submission.max_attempts,
                },
            );
        }
        let record_ids: (Arc<str>, Arc<str>) = (submission.id.as_str().into(), attempt_id.as_str().into());
        let writer = Arc::new(ThreadWriter::new(
            runtime,
            &self.key,
            &self.binding,
            &attempt_ref,
            record_ids.clone(),
            self.thread_fold.clone(),
        ));
        let _ = attempt.writer.set(writer.clone());
        // A re-attempt's execution counts on from the response's durable steps, as its step
        // budget does.
        let execution = ExecutionState::resumed(
            record_ids.0.clone(),
            attempt.signal.clone(),
            conversation.steps(&submission.id),
        );
        let mut response = Response {
            runtime,
            key: &self.key,
            agent: agent.get(),
            binding: &self.binding,
            attempt: &attempt,
            render_binding: Arc::new(AttemptBinding {
                instance: self.binding.clone(),
                attempt_id: attempt.attempt.attempt_id.clone(),
            }),
            conversation: &mut conversation,
            delivery: Arc::new(submission.message.clone()),
            submission: &submission,
            first_step_metadata: None,
            ended: Vec::new(),
            queued_step: None,
            queued_rounds: 0,
            agent_open: false,
            data_writer_names: None,
            joined: Vec::new(),
            spare: None,
            deferred: Vec::new(),
            repairing: false,
            reply: ReplyParts::default(),
            record_ids,
            admissions: &self.wakes,
            joins_checked: None,
            writer,
            unfolded: Vec::new(),
            identity: None,
            thread: None,
            at_rest: None,
            hooks: HookSet::default(),
            at_rest_hooks: HookSet::default(),
            execution,
            model_spec: None,
            hooked_system: None,
            compaction_summarized: std::collections::HashSet::new(),
            framework_sections: crate::framework::Sections::default(),
            first_snapshot: None,
            declared: None,
            sandbox: None,
            workspace: None,
            sandbox_present: false,
            own_tools: 0,
            delegation: None,
            mcp: None,
            mcp_connections: &self.mcp,
            mcp_unavailable: Vec::new(),
            budget: crate::compaction::Budget::default(),
            correlation: None,
        };
        // The operation: the processing of this submission, from just before `agent_start` to
        // just after `agent_end`. Its id is made only when an event needs it; every event of
        // the processing carries it (and the turn's id while a turn runs).
        let correlation = Arc::new(Correlation::new());
        // Without an operation (a settlement that runs no attempt), events are stamped with
        // none: an id no `operation_start` announced would group them under nothing.
        let correlated = operates.then(|| runtime.correlate(&response.record_ids.0, correlation.clone()));
        if operates {
            response.correlation = Some(correlation.clone());
        }
        let operation_started = Instant::now();
        if operates {
            runtime.emit_with(&self.key, Some(&submission.id), || Event::OperationStart {
                operation_id: correlation.operation_id(),
                operation_kind: OperationKind::Prompt,
            });
            runtime.emit(&self.key, Some(&submission.id), Event::AgentStart);
            response.agent_open = true;
        }
        let mut given_up = false;
        let result = match refreshed {
            Ok(()) if answered => response.run().await,
            // Ended before the response runs: the deliveries an earlier attempt joined settle
            // with it all the same.
            Ok(()) if abort_requested => response.resolve_earlier_joins(false).await.and(Err(Failure::aborted())),
            // The budget counts every attempt, the interrupted ones included.
            Ok(()) if submission.attempt_count > submission.max_attempts => {
                let mut error = budget_spent(input_applied, submission.attempt_count - 1, submission.max_attempts);
                let calls = response.conversation.unresolved_calls();
                if input_applied && !calls.is_empty() {
                    error = with_interrupted_tools(error, &calls);
                }
                response.resolve_earlier_joins(false).await.and(Err(Failure {
                    outcome: Outcome::Failed,
                    error,
                    transient: false,
                }))
            }
            // The deliveries an earlier attempt joined settle with it.
            Ok(()) if past_deadline_unrun => response.resolve_earlier_joins(false).await.and(Err(timed_out())),
            // Boxed: the response's state machine is kilobytes, and the futures that await this
            // one would otherwise carry (and move) it inline.
            Ok(()) => {
                let run = Deadline::new(
                    Box::pin(response.run()),
                    deadline,
                    attempt.signal.clone(),
                    TIMEOUT_MESSAGE,
                    runtime.options.settle_grace,
                );
                match run.await {
                    Some(result) => result,
                    // Given back (this node is stopping) or taken over, and hung past the
                    // grace: another attempt runs the submission from what is durable and
                    // settles it. Nothing ended here: no terminal advisory, no settlement.
                    None if binding::hands_over(attempt.signal.reason()) => {
                        given_up = true;
                        tracing::warn!(instance = %self.key, submission = %submission.id, reason = attempt.signal.reason().unwrap_or_default(), "the response did not end within its grace after its attempt was given back; left to the attempt that takes it over");
                        Err(Failure::aborted())
                    }
                    None => {
                        // Given up where it hung: what it held in memory is not trusted.
                        given_up = true;
                        let reason = attempt.signal.reason().unwrap_or_default().to_owned();
                        tracing::error!(instance = %self.key, submission = %submission.id, %reason, "the response did not end within its grace after its abort signal fired; settling over it");
                        runtime.emit_recovery_error(
                            Concerning::Row(&submission),
                            RecoveryOperation::EnforceDeadline,
                            RecoveryOutcome::Terminated,
                            Some(SettlementError::new(
                                "attempt_given_up",
                                format!(
                                    "The response did not end within {} s after its abort signal fired ({reason}).",
                                    runtime.options.settle_grace.as_secs_f64()
                                ),
                            )),
                        );
                        // Settled over as the reference's reconciliation settles a hung attempt
                        // (§3.9 step 2): a response that ended durably (its final answer was
                        // committed before a finish callback hung, say) settles as completed,
                        // never as aborted or timed out.
                        let ended = match runtime.store.read(&self.key, None).await {
                            Ok(batches) => {
                                let mut durable = Conversation::default();
                                for batch in &batches {
                                    durable.apply(batch);
                                }
                                durable.has_ended(&submission.id)
                            }
                            Err(_) => false,
                        };
                        if ended { Ok(()) } else { Err(Failure::aborted()) }
                    }
                }
            }
            Err(failure) => Err(failure),
        };
        // Once the attempt's signal fired, how the response ended is the abort's: a callback,
        // hook or tool that failed because of the signal (it listened to it) fails with the
        // abort, not with an error of its own. An abort the deadline fired (the first reason
        // wins) is the timeout. (A node giving the attempt back is handled below.)
        // (An abort that lost the race to the response's end, a finish callback failing
        // because of it, ended the response as it is: see `would_stop`.)
        // Whether the response's end was durable before it failed (a response given up on is
        // not trusted: its settlement above read the stream).
        let ended_first = !given_up && response.conversation.has_ended(&submission.id);
        let result = match result {
            // A transient failure after the response's end was durable (a store write of its
            // finish batch, say) stays transient, the signal fired or not: another attempt
            // settles the response as it is (completed), which the abort or the deadline lost.
            Err(failure) if failure.transient && ended_first && !binding::hands_over(attempt.signal.reason()) => {
                Err(failure)
            }
            // Any other failure after the end is the response's own (a `use_response_finish`
            // callback's, which is given no signal to listen to): the abort lost the race.
            Err(failure) if ended_first => Err(failure),
            Err(_) if attempt.signal.reason() == Some(TIMEOUT_MESSAGE) => Err(timed_out()),
            Err(_) if attempt.signal.is_aborted() && !binding::hands_over(attempt.signal.reason()) => {
                Err(Failure::aborted())
            }
            other => other,
        };
        // Nothing appends for the attempt after its response: a state or data write from here
        // on is refused (not buffered for a flush that will not come), a write queued after
        // the final flush (or by a failed attempt) is dropped, and the thread state refuses
        // writes. A write being stored as the response ends is waited for first, so its event
        // is the operation's, before the response's end is.
        attempt.responding.store(false, Ordering::Release);
        if let Some(writer) = attempt.writer.get() {
            writer.close().await;
        }
        attempt.close_data().await;
        // The MCP sessions the response used are idle from its end.
        self.mcp.touch();
        // A turn a failure broke off ends with the response.
        response.set_turn(None);
        if operates {
            // The run the response ended in (unless it ended where the model would stop).
            response.end_agent_run();
            runtime.emit_with(&self.key, Some(&submission.id), || Event::Operation {
                operation_id: correlation.operation_id(),
                operation_kind: OperationKind::Prompt,
                duration_ms: operation_started.elapsed().as_millis() as u64,
                is_error: result.is_err(),
                error: result.as_ref().err().map(|failure| failure.error.clone()),
                usage: Some(response.conversation.usage(&submission.id)),
                result: None,
            });
        }
        // `idle` ends the operation: it carries the operation's id, as its other events do.
        if operates {
            runtime.emit(&self.key, Some(&submission.id), Event::Idle);
        }
        drop(correlated);
        // Everything the attempt appended is in the fold (a batch a tool or hook wrote, a task's
        // child): the settlement reads it.
        response.fold_thread_writes();
        let joined_ids = std::mem::take(&mut response.joined);
        let reply = std::mem::take(&mut response.reply);
        // An append given up while the store had it (a tool an abort stopped mid-write) may be
        // in the stream and in no fold (see `ThreadWriter::lost_track`).
        let lost_track = attempt.writer.get().is_some_and(|writer| writer.lost_track());
        if binding::hands_over(attempt.signal.reason()) {
            // Given back to the queue (the node is stopping), or taken over by another node:
            // another attempt runs the submission from what is durable, and settles it.
            attempt.buffer().discard_pending();
            self.binding.set_current(None);
            *conversation = Conversation::default();
            return (None, None);
        }
        // A tool batch the response left uncommitted (calls open before the input was applied
        // are an earlier submission's): settled in the settlement's batch, first, the calls
        // without a recorded outcome getting the unknown one, so no call rests without an
        // outcome (reference §3.9).
        let mut interrupted = Vec::new();
        let mut interrupted_calls = Vec::new();
        let (outcome, error) = match result {
            Ok(()) => (Outcome::Completed, None),
            Err(mut failure) => {
                attempt.buffer().discard_pending();
                // A write whose commit went through but whose answer was lost (a remote
                // store's connection dropping after its `COMMIT`) is in the stream and not in
                // the fold, which then tells an answered response from a failed one wrongly.
                // After a failed write the settlement asks the stream itself (folded afresh: a
                // later write the fold holds may follow the lost one). A response found ended
                // so is settled as it is (completed) by another attempt, as one whose end the
                // fold saw: the abort or the deadline that raced it lost.
                let mut ended_unseen = false;
                if !given_up
                    && !unread
                    && attempt.writer.get().is_some_and(|writer| writer.had_failed_write())
                    && !conversation.has_ended(&submission.id)
                {
                    match runtime.store.read(&self.key, None).await {
                        Ok(batches) => {
                            let mut durable = Conversation::default();
                            for batch in &batches {
                                durable.apply(batch);
                            }
                            if durable.has_ended(&submission.id) {
                                failure.transient = true;
                                ended_unseen = true;
                            }
                        }
                        Err(error) => {
                            tracing::debug!(instance = %self.key, submission = %submission.id, %error, "the stream could not be read after a failed write; settling from the fold");
                        }
                    }
                }
                // An attempt that could not read the stream cannot tell a spent budget from a
                // response that ended (an attempt died before settling it) or an abort, which
                // §3.9 settles first whatever the budget: it reads again, and gives a submission
                // that ended or is to abort back to the queue, for an attempt that reads the
                // stream to settle it so. When it still cannot read, the submission is left to
                // a takeover (the lease lapses unrenewed) rather than settled as failed.
                // A stream that stays unreadable (past a few takeovers) settles as before, so
                // the instance's queue does not wait on it for ever.
                let mut classify_later = false;
                if unread && failure.transient && submission.attempt_count >= submission.max_attempts {
                    match runtime.store.read(&self.key, conversation.last_offset).await {
                        Ok(batches) => {
                            for batch in &batches {
                                conversation.apply(batch);
                            }
                            classify_later = conversation.has_ended(&submission.id) || abort_requested;
                        }
                        Err(error)
                            if submission.attempt_count < submission.max_attempts.saturating_add(UNREAD_DEFERRALS) =>
                        {
                            tracing::warn!(instance = %self.key, submission = %submission.id, %error, "the stream could not be read to settle a spent budget; the lease lapses");
                            runtime.emit_recovery(
                                Concerning::Row(&submission),
                                RecoveryOperation::ProcessSubmission,
                                RecoveryOutcome::Deferred,
                                Some(&error),
                            );
                            self.binding.set_current(None);
                            *conversation = Conversation::default();
                            return (None, None);
                        }
                        Err(error) => {
                            tracing::warn!(instance = %self.key, submission = %submission.id, %error, "the stream stayed unreadable past its budget; settling the submission as failed");
                        }
                    }
                }
                // A response whose end is durable is settled as it is (completed) by another
                // attempt, whatever the budget: a failure after its end spends none of it (a
                // few deferrals at most, as for an unreadable stream).
                let ended = !given_up
                    && (ended_unseen || conversation.has_ended(&submission.id))
                    && submission.attempt_count < submission.max_attempts.saturating_add(UNREAD_DEFERRALS);
                if failure.transient && (submission.attempt_count < submission.max_attempts || classify_later || ended)
                {
                    tracing::warn!(instance = %self.key, submission = %submission.id, error = %failure.error.message, "re-attempting after a store failure");
                    // Forget the cached fold: the next attempt re-reads what is durable.
                    *conversation = Conversation::default();
                    // The store may be down for a while: the next attempt waits, or the budget
                    // would be spent at once. It waits here, before the requeue, the attempt
                    // still current: the heartbeat renews its lease, so no scan takes it over
                    // (requeued, the submission is any node's to claim at once: a shared store
                    // tells them). The wait ends early when the node stops, and when the
                    // attempt's signal fires (an abort, the node giving its work back, a lost
                    // lease) or its deadline passes: the next claim settles an abort or a spent
                    // deadline before it runs anything.
                    let wait = runtime
                        .options
                        .store_retry_wait(submission.attempt_count, crate::provider::jitter_fraction());
                    // A deadline already past when the wait begins does not shorten it (an
                    // attempt that cannot read the stream would be made again at once, every
                    // attempt spent in a moment): the next claim that reads settles it.
                    let deadline_ahead = Instant::now() < deadline;
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = runtime.closed() => {}
                        () = attempt.signal.aborted() => {}
                        () = tokio::time::sleep_until(deadline.into()), if deadline_ahead => {}
                    }
                    self.binding.set_current(None);
                    if binding::hands_over(attempt.signal.reason()) {
                        // Given back by `release`, which requeues it, or taken over by another
                        // node.
                        return (None, None);
                    }
                    match runtime.store.requeue(&attempt_ref).await {
                        Ok(true) => {
                            runtime.emit_recovery(
                                Concerning::Row(&submission),
                                RecoveryOperation::ProcessSubmission,
                                RecoveryOutcome::Deferred,
                                Some(&failure.error.message),
                            );
                            return (None, None);
                        }
                        // Another attempt owns the submission now: its settlement is refused
                        // below, as it should be.
                        Ok(false) => {}
                        // The store is still failing: settling now would spend the whole
                        // budget on one failure. The lease lapses unrenewed and the takeover
                        // re-attempts (or settles an exhausted budget), as after a crash.
                        Err(error) => {
                            tracing::warn!(instance = %self.key, submission = %submission.id, %error, "requeueing after a store failure failed; the lease lapses");
                            runtime.emit_recovery(
                                Concerning::Row(&submission),
                                RecoveryOperation::ProcessSubmission,
                                RecoveryOutcome::Deferred,
                                Some(&error),
                            );
                            return (None, None);
                        }
                    }
                }
                if failure.transient && !given_up && conversation.has_ended(&submission.id) {
                    // Past its deferrals, a response whose end is durable settles as it is, as
                    // any other attempt would settle it (§3.9): its answer stands, and only
                    // what its finish would have stored after it is missing.
                    tracing::warn!(instance = %self.key, submission = %submission.id, error = %failure.error.message, "the response's end is durable but what followed it could not be stored after repeated attempts; settling it completed as it is");
                    (Outcome::Completed, None)
                } else {
                    // Applied now, if not before: this attempt may have applied it.
                    let applied = input_applied || conversation.has_input(&submission.id);
                    if applied && conversation.open_calls().is_some() {
                        // The fold may lag the stream (a response given up mid-append, a commit
                        // whose answer was lost, a read that failed at the start): it is brought
                        // up to date before it names calls uncommitted, and nothing is written
                        // for them when it cannot be. An append given up while the store had it
                        // may sit before batches the fold took: the fold starts over.
                        if lost_track {
                            *conversation = Conversation::default();
                        }
                        match runtime.store.read(&self.key, conversation.last_offset).await {
                            Ok(batches) => {
                                for batch in &batches {
                                    conversation.apply(batch);
                                }
                                interrupted = conversation.interrupted_batch();
                                interrupted_calls = conversation.unresolved_calls();
                            }
                            Err(error) => {
                                tracing::warn!(instance = %self.key, submission = %submission.id, %error, "the stream could not be read to settle an uncommitted tool batch; the settlement leaves it open");
                            }
                        }
                    }
                    if failure.transient {
                        let mut exhausted = budget_spent(applied, submission.attempt_count, submission.max_attempts);
                        if !interrupted_calls.is_empty() {
                            exhausted = with_interrupted_tools(exhausted, &interrupted_calls);
                        }
                        *conversation = Conversation::default();
                        (Outcome::Failed, Some(exhausted))
                    } else {
                        (failure.outcome, Some(failure.error))
                    }
                }
            }
        };
        // HTTP clients are served a generic error in place of the application's own text or an
        // untyped framework error: the log carries it, under the submission's id (reference
        // §6.4).
        if let Some(error) = error.as_ref().filter(|error| error.is_internal()) {
            tracing::error!(instance = %self.key, submission = %submission.id, joined = ?joined_ids, error_type = %error.error_type, error = %error.message, details = %error.details, "the submission failed with an error clients are served as internal_error");
        }
        let stamp = |body| Record {
            id: new_id("record"),
            submission_id: Some(submission.id.as_str().into()),
            attempt_id: Some(attempt_id.as_str().into()),
            timestamp: now(),
            body,
        };
        let mut unknown_outcomes = calls_settled_unknown(&interrupted);
        {
            let ended = attempt
                .ended_calls
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            unknown_outcomes.retain(|(id, _)| !ended.contains(id));
        }
        let mut records: Vec<Record> = interrupted.into_iter().map(stamp).collect();
        // Why the submission ended, for the model of a later response to read: before its
        // settlement, in the same batch.
        if let Some((id, body)) = error
            .as_ref()
            .and_then(|error| terminal_advisory(&submission, outcome, error, &interrupted_calls))
        {
            records.push(Record {
                id,
                submission_id: Some(submission.id.as_str().into()),
                attempt_id: Some(attempt_id.as_str().into()),
                timestamp: now(),
                body,
            });
        }
        for id in joined_ids.iter().chain(std::iter::once(&submission.id)) {
            records.push(Record {
                id: format!("record_submission_settled_{id}"),
                submission_id: Some(id.as_str().into()),
                attempt_id: Some(attempt_id.as_str().into()),
                timestamp: now(),
                body: RecordBody::SubmissionSettled {
                    outcome,
                    error: error.clone(),
                },
            });
        }
        // Loaded before the settling transaction: an admission that transaction does not see
        // is counted after this.
        let admissions = self.wakes.load(Ordering::SeqCst);
        let left = match runtime
            .store
            .settle(&attempt_ref, outcome, error.clone(), records)
            .await
        {
            Ok(queued) => {
                self.binding.note_append();
                announce_ended(runtime, &self.key, &submission.id, &unknown_outcomes);
                Some(QueueLeft {
                    admissions,
                    queued,
                    settled_until: until.is_some_and(|until| joined_ids.iter().any(|id| id == until)),
                })
            }
            Err(store_error) => {
                if matches!(store_error, StoreError::Fenced(_)) {
                    // Another attempt owns the submission now (a node took the lease over, or
                    // settled it): the normal end of a superseded attempt, not a failure.
                    tracing::warn!(instance = %self.key, submission = %submission.id, %store_error, "settlement refused: the submission is another attempt's now");
                } else {
                    tracing::error!(instance = %self.key, submission = %submission.id, %store_error, "settlement failed");
                }
                // The attempt's lease lapses unrenewed; the scan that takes the submission over
                // finds its outcome in the stream (or runs it again) and settles it.
                runtime.emit_recovery(
                    Concerning::Row(&submission),
                    RecoveryOperation::FinalizeSettlement,
                    RecoveryOutcome::Deferred,
                    Some(&store_error),
                );
                None
            }
        };
        // Reported only once durable: a refused or failed settlement is made again (or
        // otherwise) by whoever takes the submission over.
        if left.is_some() {
            for id in joined_ids.iter().chain(std::iter::once(&submission.id)) {
                runtime.emit(
                    &self.key,
                    Some(id),
                    Event::SubmissionSettled {
                        outcome,
                        error: error.clone(),
                    },
                );
            }
        }
        self.binding.set_current(None);
        // Read again by the instance's next submission: what was given up on, or a fold that
        // may lack a batch of the stream (one given up on while the store had it, or one whose
        // commit went through while its answer was lost: a failed write the response went on
        // after).
        let failed_write = attempt.writer.get().is_some_and(|writer| writer.had_failed_write());
        if given_up || lost_track || failed_write {
            *conversation = Conversation::default();
        }
        drop(conversation);
        runtime.notify_settled(joined_ids.iter().chain(std::iter::once(&submission.id)));
        // A response given up on kept in memory what it had: its sender reads the settlement.
        let settled =
            (left.is_some() && submission.attempt_count == 1 && !given_up).then_some(Settled { outcome, error, reply });
        (settled, left)
    }
}

/// The instance's queue as a committed settlement left it.
#[derive(Clone, Copy)]
struct QueueLeft {
    /// The instance's admission count, loaded just before the settling transaction.
    admissions: u64,
    /// Whether that transaction saw a submission still queued.
    queued: bool,
    /// Whether the submission the worker loop runs until was joined into the one that
    /// settled, and so settled with it.
    settled_until: bool,
}

/// A settlement as the task that made it durable knows it.
pub(crate) struct Settled {
    pub(crate) outcome: Outcome,
    pub(crate) error: Option<SettlementError>,
    /// The reply (meaningful when completed).
    pub(crate) reply: ReplyParts,
}

/// Why a response did not complete.
pub(crate) struct Failure {
    outcome: Outcome,
    error: SettlementError,
    /// A store failure: the attempt is abandoned and the submission re-attempted (within its
    /// budget) from what is durable, exactly as after a crash.
    transient: bool,
}

impl Failure {
    fn failed(error_type: &str, message: impl Into<String>) -> Self {
        Self {
            outcome: Outcome::Failed,
            error: SettlementError::new(error_type, message),
            transient: false,
        }
    }

    /// The one failure of `failures`, or for several an aggregate of them: `heading` as the
    /// message, each failure's message as a line of the details and an item of `meta.errors`.
    fn aggregate(error_type: &str, heading: &str, mut failures: Vec<Failure>) -> Option<Self> {
        if failures.len() < 2 {
            return failures.pop();
        }
        let causes: Vec<String> = failures.into_iter().map(|failure| failure.error.message).collect();
        let mut meta = serde_json::Map::new();
        meta.insert("errors".into(), causes.clone().into());
        let mut failure = Self::failed(error_type, heading);
        failure.error.details = causes.join("\n");
        failure.error = failure.error.with_meta(meta);
        Some(failure)
    }

    /// The model call of the response failed for `reason`: `prompt failed: <reason>`, with
    /// the operation and the reason as meta.
    fn prompt_failed(error_type: &str, reason: &str) -> Self {
        let mut meta = serde_json::Map::new();
        meta.insert("operation".into(), "prompt".into());
        meta.insert("reason".into(), reason.into());
        let mut failure = Self::failed(error_type, format!("prompt failed: {reason}"));
        failure.error = failure.error.with_meta(meta);
        failure
    }

    fn store(error: impl std::fmt::Display) -> Self {
        Self {
            transient: true,
            ..Self::failed("store_failure", error.to_string())
        }
    }

    fn aborted() -> Self {
        Self {
            outcome: Outcome::Aborted,
            error: submission_aborted(),
            transient: false,
        }
    }
}

/// The error of a submission an abort ended (and of what its sessions were doing).
pub(crate) fn submission_aborted() -> SettlementError {
    let mut error = SettlementError::new("submission_aborted", binding::ABORTED);
    error.details = "The operation was stopped before it produced a completed response.".to_owned();
    error
}

impl From<RenderError> for Failure {
    fn from(error: RenderError) -> Self {
        let error_type = match &error {
            RenderError::ToolNameConflict(_) => "tool_name_conflict",
            RenderError::MissingModel => "model_required",
            RenderError::IdentityChanged { .. } => "render_identity_changed",
            RenderError::Failed { .. } | RenderError::Panicked { .. } => "render_failed",
            _ => "render_failed",
        };
        Self::failed(error_type, error.to_string())
    }
}

/// Signals appended by a seam's callbacks, in arrival order.
#[derive(Default)]
struct Appends(Mutex<Vec<Signal>>);

impl SeamChannel for Appends {
    fn append(&self, signal: Signal) {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(signal);
    }
}

impl Appends {
    fn take(&self) -> Vec<Signal> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }
}

/// Log lines from tools and callbacks become events.
struct EventLog {
    submission: EventLogBase,
    /// Who logs: the events' attributes, made only when a line is logged.
    who: Option<Who>,
}

/// Who logs a line (reference §7.2).
enum Who {
    /// A tool call: `tool`, `toolCallId`.
    Tool { name: String, call_id: String },
    /// The `index`-th (from 0) callback of `hook`: `hook`, `hookIndex`.
    Hook { hook: &'static str, index: usize },
}

impl Who {
    fn attributes(&self) -> serde_json::Map<String, serde_json::Value> {
        let pairs: [(&str, serde_json::Value); 2] = match self {
            Self::Tool { name, call_id } => [("tool", name.as_str().into()), ("toolCallId", call_id.as_str().into())],
            Self::Hook { hook, index } => [("hook", (*hook).into()), ("hookIndex", (*index).into())],
        };
        pairs
            .into_iter()
            .map(|(name, value)| (name.to_owned(), value))
            .collect()
    }
}

/// The logger of one tool call: its lines carry the call's `tool` and `toolCallId`.
pub(crate) fn tool_call_logger(base: &EventLogBase, tool: &str, tool_call_id: &str) -> Logger {
    base.logger(Some(Who::Tool {
        name: tool.to_owned(),
        call_id: tool_call_id.to_owned(),
    }))
}

/// What the loggers of one submission share (publishing `log` events for it, stamped with
/// its task for a tool running in a task's child session); each logs as someone
/// ([`tool_call_logger`], a callback's `hook` and `hookIndex`). Cloned by reference.
#[derive(Clone)]
pub(crate) struct EventLogBase(Arc<LogTarget>);

/// Where a submission's log lines go.
struct LogTarget {
    runtime: Weak<RuntimeInner>,
    key: InstanceKey,
    submission_id: String,
    /// The task whose child session the lines come from (`None`: the root's).
    task: Option<Arc<crate::events::TaskScope>>,
}

impl EventLogBase {
    pub(crate) fn new(
        runtime: &Arc<RuntimeInner>,
        key: &InstanceKey,
        submission_id: &str,
        task: Option<Arc<crate::events::TaskScope>>,
    ) -> Self {
        Self(Arc::new(LogTarget {
            runtime: Arc::downgrade(runtime),
            key: key.clone(),
            submission_id: submission_id.to_owned(),
            task,
        }))
    }

    fn logger(&self, who: Option<Who>) -> Logger {
        Logger::new(Arc::new(EventLog {
            submission: self.clone(),
            who,
        }))
    }

    /// The logger of the `index`-th (from 0) `hook` callback.
    pub(crate) fn hook(&self, hook: &'static str, index: usize) -> Logger {
        self.logger(Some(Who::Hook { hook, index }))
    }
}

impl LogSink for EventLog {
    fn log(&self, level: LogLevel, message: &str) {
        let target = &self.submission.0;
        if let Some(runtime) = target.runtime.upgrade() {
            let event = || Event::Log {
                level: serde_json::to_value(level)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default(),
                message: message.to_owned(),
                attributes: self.who.as_ref().map(|who| Arc::new(who.attributes())),
            };
            match &target.task {
                Some(task) => runtime.emit_in_task(&target.key, &target.submission_id, task, event),
                None => runtime.emit_with(&target.key, Some(&target.submission_id), event),
            }
        }
    }
}

/// One response in progress.
struct Response<'a> {
    runtime: &'a Arc<RuntimeInner>,
    key: &'a InstanceKey,
    agent: &'a dyn Agent,
    binding: &'a Arc<InstanceBinding>,
    attempt: &'a Arc<Attempt>,
    /// What this attempt's renders write state and data through.
    render_binding: Arc<dyn flue_core::binding::RuntimeBinding>,
    conversation: &'a mut Conversation,
    delivery: Arc<DeliveredMessage>,
    submission: &'a Submission,
    first_step_metadata: Option<Metadata>,
    data_writer_names: Option<Vec<std::borrow::Cow<'static, str>>>,
    /// Deliveries joined into this response, in order.
    joined: Vec<String>,
    /// The previous render, reused for the next one's buffers.
    spare: Option<Rendered>,
    /// Records that wait for an interrupted tool batch's repair (see [`Response::mount_mcp`]).
    deferred: Vec<Record>,
    /// Whether the render being prepared is the one that repairs an interrupted batch.
    repairing: bool,
    /// What the records this attempt committed add to the reply.
    reply: ReplyParts,
    /// The submission and attempt ids its records carry (shared by all of them).
    record_ids: (Arc<str>, Arc<str>),
    /// The instance's wake count: every admission on this node bumps it after it commits.
    admissions: &'a AtomicU64,
    /// The wake count when the store last had nothing to join: while it has not moved (and no
    /// other node writes to the store), nothing can have been queued since.
    joins_checked: Option<u64>,
    /// The attempt's one writer (the response's batches and the thread operations').
    writer: Arc<ThreadWriter>,
    /// Batches the writer appended, on their way into the conversation (kept for its capacity).
    unfolded: Vec<crate::record::Batch>,
    /// The thread's identity, once a `ThreadState` needed it.
    identity: Option<Arc<flue_core::lifecycle::ThreadIdentity>>,
    /// The `ThreadState` of the execution (hooks and tools of the running response), made
    /// when first needed.
    thread: Option<Arc<RuntimeThread>>,
    /// The at-rest `ThreadState` (the input rows' hooks, `after_thread_created`), made when
    /// first needed.
    at_rest: Option<Arc<RuntimeThread>>,
    /// The lifecycle hooks of the latest render.
    hooks: HookSet,
    /// The at-rest hooks (the agent's, with the required hooks of the first render's
    /// relationships).
    at_rest_hooks: HookSet,
    /// The execution `thread` reports (step counts, `stop()`).
    execution: ExecutionState,
    /// The submission's model and thinking level (what delegates inherit), once resolved.
    model_spec: Option<(String, ThinkingLevel)>,
    /// The current step's system message as `after_system_message` made it, once the hook
    /// ran: the hook runs once per step, and a call the step makes again on a compacted
    /// history (after an overflow) is sent this one (what the hook injected is not injected
    /// twice).
    hooked_system: Option<Option<String>>,
    /// The rows the compaction being made summarizes (those before its cut), by id: the rows
    /// its summary does not read are the ones it keeps, whatever hooks wrote meanwhile.
    compaction_summarized: std::collections::HashSet<String>,
    /// The system prompt sections the latest render's skills and delegates add.
    framework_sections: crate::framework::Sections,
    /// The conversation's first resource snapshot, committed with the step it was taken for.
    first_snapshot: Option<Record>,
    /// The latest render's fingerprint and resource snapshot (reused while renders repeat).
    declared: Option<(crate::resources::Fingerprint, Arc<crate::resources::ResourceSet>)>,
    /// The submission's sandbox and its tools, once a render attached it.
    sandbox: Option<crate::sandbox::Environment>,
    /// The skills the sandbox's workspace provides, found when the sandbox was attached.
    workspace: Option<Arc<crate::skills::Workspace>>,
    /// Whether the latest render attaches the sandbox.
    sandbox_present: bool,
    /// How many of the latest render's tools are the agent's own (the sandbox's and the
    /// framework's follow).
    own_tools: usize,
    /// The session's delegation and its `task` tool, once the model is known (detached when
    /// the response is dropped).
    delegation: Option<crate::subagents::Delegating>,
    /// The submission's MCP servers, once connected.
    mcp: Option<Vec<crate::mcp::McpSession>>,
    /// The instance's live MCP connections (reused from its earlier responses).
    mcp_connections: &'a crate::mcp::McpConnections,
    /// The optional MCP servers that could not be reached, until they are narrated: after the
    /// input and the response start, before the start seam (reference §3.7 step 8), or, when a
    /// tool batch awaits its repair, right after it.
    mcp_unavailable: Vec<crate::mcp::Unavailable>,
    /// The submission's compaction settings and the size of the latest model call.
    budget: crate::compaction::Budget,
    /// What the response's events are stamped with (its operation, the turn in progress).
    correlation: Option<Arc<Correlation>>,
    /// The messages of the `message_end` events someone observed since the agent's run began:
    /// what its `agent_end` carries.
    ended: Vec<ModelMessage>,
    /// Calls `queue_tool` queued while a tool batch ran, recorded as a step of their own with
    /// that batch's commit: the next [`Self::run_queued_tools`] runs them.
    queued_step: Option<QueuedStep>,
    /// How many queued steps [`Self::run_queued_tools`] has run in a row, without a model step
    /// between them. At `MAX_QUEUED_TOOL_STEPS` a batch records no further step: the response
    /// fails at the ceiling instead of leaving a step in the stream that never runs.
    queued_rounds: u32,
    /// Whether the agent's run is open: its `agent_start` was emitted, its `agent_end` not yet.
    /// A run ends where the model would stop; a continuation (a finish callback's appends, a
    /// late join) is a run of its own (the reference's loop `continue()`).
    agent_open: bool,
}

impl Response<'_> {
    /// The delivery cursor (`use_delivery`) advances to the last signal a callback appended:
    /// it is now the message in front of the model.
    fn advance_delivery(&mut self, appended: &[Signal]) {
        if let Some(last) = appended.last() {
            self.delivery = Arc::new(DeliveredMessage::Signal(last.clone()));
        }
    }

    fn emit(&self, event: Event) {
        self.runtime.emit(self.key, Some(&self.submission.id), event);
    }

    /// The model turn the response's events belong to from now on (`None`: between turns).
    fn set_turn(&self, turn: Option<&LazyId>) {
        if let Some(correlation) = &self.correlation {
            correlation.set_turn(turn);
        }
    }

    /// [`emit`](Self::emit), building the event only when someone observes.
    fn emit_with(&self, event: impl FnOnce() -> Event) {
        self.runtime.emit_with(self.key, Some(&self.submission.id), event);
    }

    /// [`Self::emit_with`] for a thread event (its HTTP readers get it too).
    fn emit_thread_event(&self, event: impl FnOnce() -> Event) {
        self.runtime
            .emit_thread_event(self.key, Some(&self.submission.id), event);
    }

    /// The `message_start` and `message_end` of a stored message (an input, once committed),
    /// as the conversation holds it.
    fn stored_message_events(&mut self, message_id: Option<&str>) {
        // A delivery joined, or a signal appended, after the model would have stopped
        // continues the response in a run of its own.
        self.open_agent_run();
        if !self.runtime.observed() {
            return;
        }
        let Some(message) = message_id.and_then(|id| self.conversation.observed_message(id)) else {
            return;
        };
        self.emit(Event::MessageStart {
            message: message.clone(),
        });
        self.end_message(message);
    }

    /// Commits `records` ([`Response::commit`]), the signals among them through their create
    /// hooks first ([`Response::created_signals`]), then announces the signals as a stored
    /// delivery is announced (`message_start`, `message_end`, and `agent_end`'s messages): an
    /// append of `use_agent_start` or `use_agent_finish`, a narration. Observers see what the
    /// model is answering.
    async fn commit_signals(&mut self, records: Vec<Record>, with_state: bool) -> Result<(), Failure> {
        let (records, _, created) = self.created_signals(records).await;
        self.commit_created_signals(records, created, with_state).await
    }

    /// [`Response::commit_signals`] of records whose signals' create hooks ran (`created`:
    /// their rows, for `after_create_message` once stored).
    async fn commit_created_signals(
        &mut self,
        records: Vec<Record>,
        created: Vec<lifecycle::CreatedRow>,
        with_state: bool,
    ) -> Result<(), Failure> {
        let signals: Vec<String> = records
            .iter()
            .filter_map(|record| match &record.body {
                RecordBody::Signal { message_id, .. } => Some(message_id.clone()),
                _ => None,
            })
            .collect();
        self.commit(records, with_state).await?;
        for message_id in &signals {
            self.stored_message_events(Some(message_id));
        }
        self.signals_created(created).await;
        Ok(())
    }

    /// Opens a run of the agent (its `agent_start`) unless one is open: a continuation after
    /// the model would have stopped. Only a response that operates has runs.
    fn open_agent_run(&mut self) {
        if !self.agent_open && self.correlation.is_some() {
            self.agent_open = true;
            self.emit(Event::AgentStart);
        }
    }

    /// Ends the agent's open run (its `agent_end`, with the messages that ended in it).
    fn end_agent_run(&mut self) {
        if std::mem::take(&mut self.agent_open) {
            let messages = std::mem::take(&mut self.ended);
            self.emit_with(|| Event::AgentEnd { messages });
        }
    }

    /// A `message_end`, whose message `agent_end` carries too.
    fn end_message(&mut self, message: ModelMessage) {
        self.ended.push(message.clone());
        self.emit(Event::MessageEnd { message });
    }

    fn record(&self, body: RecordBody) -> Record {
        Record {
            id: new_id("record"),
            submission_id: Some(self.record_ids.0.clone()),
            attempt_id: Some(self.record_ids.1.clone()),
            timestamp: now(),
            body,
        }
    }

    /// The logger of the framework's own lines about this response.
    fn logger(&self) -> Logger {
        self.log_base().logger(None)
    }

    /// What the loggers of this response's tool calls and callbacks share.
    fn log_base(&self) -> EventLogBase {
        EventLogBase::new(self.runtime, self.key, &self.submission.id, None)
    }

    /// Appends one batch (plus the attempt's pending state writes and data writes, which
    /// become durable with it) and folds it into the conversation.
    async fn commit(&mut self, records: Vec<Record>, with_state: bool) -> Result<(), Failure> {
        self.commit_then(records, with_state, Vec::new()).await
    }

    /// [`Self::commit`], with `tail` after the batch's marker in the same append.
    async fn commit_then(
        &mut self,
        mut records: Vec<Record>,
        with_state: bool,
        tail: Vec<Record>,
    ) -> Result<(), Failure> {
        // Data writes made so far land before the batch (each its own batch).
        self.flush_data().await?;
        self.fold_thread_writes();
        let writes = if with_state {
            self.attempt.buffer().drain()
        } else {
            Vec::new()
        };
        if !writes.is_empty() {
            // State writes go before the batch's marker (the last record).
            let marker = records.pop();
            records.reserve(writes.len() + 1);
            records.extend(writes.into_iter().map(|write| {
                self.record(RecordBody::StateWrite {
                    name: write.name,
                    value: write.value,
                })
            }));
            records.extend(marker);
        }
        records.extend(tail);
        if records.is_empty() {
            return Ok(());
        }
        let records: Arc<[Record]> = records.into();
        self.writer.append(records.clone()).await.map_err(Failure::store)?;
        for record in records.iter() {
            self.reply.add(record);
        }
        self.fold_thread_writes();
        Ok(())
    }

    /// Folds what the attempt appended and the conversation has not seen (the response's last
    /// batch, and rows or values hooks and tools wrote through the `ThreadState`).
    fn fold_thread_writes(&mut self) {
        self.writer.take_unfolded(&mut self.unfolded);
        for batch in self.unfolded.drain(..) {
            self.conversation.apply(&batch);
            // Data writes stream through the writer on their own: the reply takes them here.
            for record in batch.records.iter() {
                if matches!(record.body, RecordBody::MessageDataWrite { .. }) {
                    self.reply.add(record);
                }
            }
        }
    }

    /// Appends the attempt's queued data writes (once the response has a durable step).
    async fn flush_data(&mut self) -> Result<(), Failure> {
        self.attempt.flush_data().await.map_err(Failure::store)
    }

    fn identity(&mut self) -> Arc<flue_core::lifecycle::ThreadIdentity> {
        let (conversation, key) = (&*self.conversation, self.key);
        self.identity
            .get_or_insert_with(|| Arc::new(conversation.identity(key)))
            .clone()
    }

    /// The execution's `ThreadState` implementation (made on first use, then kept current with
    /// each render's hooks and tools).
    fn thread_view(&mut self) -> Arc<RuntimeThread> {
        if let Some(view) = &self.thread {
            return view.clone();
        }
        let view = RuntimeThread::new(
            self.identity(),
            self.writer.clone(),
            Some(self.execution.clone()),
            self.hooks.clone(),
        );
        if let Some(rendered) = &self.spare {
            view.set_tools(&rendered.tools);
        }
        self.thread = Some(view.clone());
        view
    }

    /// The at-rest `ThreadState` implementation (no execution, the at-rest hooks).
    fn at_rest_view(&mut self) -> Arc<RuntimeThread> {
        if let Some(view) = &self.at_rest {
            return view.clone();
        }
        let view = RuntimeThread::new(self.identity(), self.writer.clone(), None, self.at_rest_hooks.clone());
        self.at_rest = Some(view.clone());
        view
    }

    fn render(&mut self) -> Result<Rendered, Failure> {
        let buffer = self.attempt.buffer();
        let initial = self
            .conversation
            .initial_data
            .clone()
            .unwrap_or(serde_json::Value::Null);
        let mut state = RenderState::root(&self.key.id)
            .with_agent_name(&self.key.agent)
            .with_state(&*buffer)
            .with_binding(&self.render_binding)
            .with_delivery(&self.delivery)
            .with_initial_data(&initial);
        // After the first render, every render is checked against the last one, even when it
        // declared no writers (a writer added later is a change too).
        if let Some(previous) = &self.data_writer_names {
            state = state.with_previous_data_writers(previous);
        }
        let mut rendered = self.spare.take().unwrap_or_default();
        let result = flue_core::try_render_into(self.agent, &state, &mut rendered);
        drop(buffer);
        match result {
            Ok(()) => {
                self.data_writer_names = Some(rendered.data_writer_names());
                self.hooks = HookSet::resolve(self.agent.definition(), &rendered.hooks, &rendered.subagents)
                    .and_then(|hooks| hooks.register(&self.runtime.known_hooks).map(|()| hooks))
                    .map_err(|message| Failure::failed("render_failed", message))?;
                // With hooks selected the execution's state exists from the first render on
                // (the streaming-time `tool_call_started` hooks need it).
                let view = match &self.thread {
                    Some(view) => Some(view.clone()),
                    None if !self.hooks.is_empty() => Some(self.thread_view()),
                    None => None,
                };
                if let Some(view) = view {
                    view.set_hooks(self.hooks.clone());
                    view.set_tools(&rendered.tools);
                }
                Ok(rendered)
            }
            Err(error) => {
                // A rules-of-hooks violation's place in the agent's code, for its developer:
                // the failure carries the reference's message alone.
                if let RenderError::Panicked {
                    message,
                    location: Some(location),
                } = &error
                {
                    tracing::warn!(instance = %self.key, submission = %self.submission.id, %location, "the agent's render broke a rule of hooks: {message}");
                }
                Err(error.into())
            }
        }
    }

    /// Makes a render ready for a model call: the sandbox (created the first time a render of
    /// the submission attaches one, its workspace's skills discovered then; presence re-read
    /// every time) with its tools and workspace skills, then the framework's tools and prompt
    /// sections. A workspace skill named like a declared one fails the submission
    /// (`skill_name_conflict`).
    async fn prepare(&mut self, rendered: &mut Rendered) -> Result<(), Failure> {
        self.mount_mcp(rendered).await?;
        self.own_tools = rendered.tools.len();
        self.sandbox_present = false;
        if let Some(declaration) = &rendered.sandbox {
            let environment = self.create_sandbox(declaration).await?;
            let tools = &environment.tools;
            if let Some(taken) = rendered
                .tools
                .iter()
                .find(|own| tools.iter().any(|tool| tool.name() == own.name()))
            {
                // The render's tools and the sandbox's are one set (reference
                // `ToolNameConflictError`).
                return Err(Failure::failed(
                    flue_core::ToolNameConflictError::TYPE,
                    flue_core::ToolNameConflictError::duplicate(taken.name()).to_string(),
                ));
            }
            rendered.tools.extend(tools.iter().cloned());
            self.sandbox_present = true;
            // The workspace's skills, after the declared ones, while the sandbox is attached.
            if let Some(workspace) = &self.workspace {
                workspace
                    .mount(rendered)
                    .map_err(|message| Failure::failed("skill_name_conflict", message))?;
            }
        }
        self.mount_framework(rendered);
        if let Some(view) = &self.thread {
            view.set_tools(&rendered.tools);
        }
        Ok(())
    }

    /// The submission's sandbox, made by `declaration`'s factory the first time a render
    /// declares one (at initialization, when the init render does).
    async fn create_sandbox(
        &mut self,
        declaration: &flue_core::render::SandboxDeclaration,
    ) -> Result<&crate::sandbox::Environment, Failure> {
        if self.sandbox.is_none() {
            let environment = self.make_sandbox(declaration).await?;
            self.sandbox = Some(environment);
        }
        Ok(self.sandbox.as_ref().expect("the sandbox was just made"))
    }

    /// A sandbox made by `declaration`'s factory, and the workspace's skills in it.
    async fn make_sandbox(
        &mut self,
        declaration: &flue_core::render::SandboxDeclaration,
    ) -> Result<crate::sandbox::Environment, Failure> {
        // A factory that panics fails the submission like one that returns an error.
        // A remote sandbox's error may quote its URL: without a key in its query.
        let unavailable = |error: &dyn std::fmt::Display| {
            Failure::failed(
                "sandbox_unavailable",
                format!(
                    "[flue] The sandbox could not be created: {}",
                    flue_core::url::without_url_secrets(&error.to_string())
                ),
            )
        };
        let panicked = |payload: Box<dyn std::any::Any + Send>| {
            unavailable(&format_args!(
                "panicked: {}",
                flue_core::render::panic_message(payload.as_ref())
            ))
        };
        let factory = &declaration.factory;
        let sandbox = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            factory.create_sandbox_for(&self.key.agent, &self.key.id)
        })) {
            Ok(created) => match std::panic::AssertUnwindSafe(created).catch_unwind().await {
                Ok(created) => created.map_err(|error| unavailable(&error))?,
                Err(payload) => return Err(panicked(payload)),
            },
            Err(payload) => return Err(panicked(payload)),
        };
        let session = crate::sandbox::SandboxSession::new(sandbox, declaration.cwd.as_deref()).map_err(|error| {
            Failure::failed(
                "sandbox_unavailable",
                format!("[flue] The sandbox's working directory: {error}"),
            )
        })?;
        let session = Arc::new(session);
        let tools = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| factory.tools())).map_err(|payload| {
            Failure::failed(
                "sandbox_unavailable",
                format!(
                    "[flue] The sandbox's tools could not be listed: panicked: {}",
                    flue_core::render::panic_message(payload.as_ref())
                ),
            )
        })?;
        // A factory's own tools are built by hand (`Tool::from_handler` checks no name): one
        // named like a framework tool, or two sharing a name, would reach the provider, which
        // refuses every call then. The submission fails here instead (reference
        // `ToolNameConflictError`), before anything runs; delegates share these tools.
        if let Some(tools) = &tools {
            let mut names = std::collections::HashSet::new();
            for tool in tools {
                // Every rule a declared tool's name meets (a provider refuses the rest).
                if let Err(message) = flue_core::tool::check_tool_name(tool.name(), "The sandbox's tool") {
                    let error_type = if flue_core::tool::RESERVED_TOOL_NAMES.contains(&tool.name()) {
                        flue_core::ToolNameConflictError::TYPE
                    } else {
                        "sandbox_unavailable"
                    };
                    return Err(Failure::failed(error_type, message));
                }
                if !names.insert(tool.name()) {
                    return Err(Failure::failed(
                        flue_core::ToolNameConflictError::TYPE,
                        flue_core::ToolNameConflictError::duplicate(tool.name()).to_string(),
                    ));
                }
            }
        }
        // The workspace's skills: found once, when the submission's sandbox is made.
        self.workspace = Some(Arc::new(crate::skills::Workspace::discover(&session).await));
        let environment = match tools {
            Some(tools) => crate::sandbox::Environment::custom(session, tools),
            None => crate::sandbox::Environment::built_in(session),
        };
        Ok(environment)
    }

    /// Connects the submission's MCP servers, once: at initialization, with the init
    /// render's declarations (reference §3.7 step 2), reusing the instance's live
    /// connections and connecting the others together (an abort stops the connecting). A
    /// required server that cannot be used fails the submission before its input is stored;
    /// an optional one is a `warn` log event now and narrated later.
    async fn connect_mcp(&mut self, rendered: &Rendered) -> Result<(), Failure> {
        if self.mcp.is_none() && rendered.mcp_connections.is_empty() {
            // Nothing to connect (most agents): nothing to wait for. Servers an earlier render
            // declared are closed.
            self.mcp_connections.clear();
            self.mcp = Some(Vec::new());
        }
        if self.mcp.is_none() {
            let connecting = self
                .mcp_connections
                .resolve(&rendered.mcp_connections, self.runtime.options.mcp_session_idle);
            let connected = tokio::select! {
                connected = connecting => connected,
                () = self.attempt.signal.aborted() => return Err(Failure::aborted()),
            };
            let mut sessions = Vec::new();
            let mut unavailable = Vec::new();
            for connected in connected {
                match connected {
                    Ok(session) => sessions.push(session),
                    Err(failure) if failure.optional => {
                        let message = format!(
                            "[flue] The optional MCP server \"{}\" could not be used; its tools are not mounted for this response: {}",
                            failure.name,
                            crate::mcp::shown_reason(&failure.reason)
                        );
                        tracing::warn!(instance = %self.key, submission = %self.submission.id, "{message}");
                        self.logger().warn(message);
                        unavailable.push(failure);
                    }
                    Err(failure) => {
                        return Err(Failure::failed(
                            "mcp_connection_failed",
                            format!(
                                "[flue] The MCP server \"{}\" could not be used: {}",
                                failure.name,
                                crate::mcp::shown_reason(&failure.reason)
                            ),
                        ));
                    }
                }
            }
            self.mcp_unavailable = unavailable;
            self.mcp = Some(sessions);
        }
        Ok(())
    }

    /// Mounts the MCP servers' tools (connected at initialization; connected here only for a
    /// render that comes before it, which none does today), narrating the unreachable optional
    /// ones if that is still to do.
    async fn mount_mcp(&mut self, rendered: &mut Rendered) -> Result<(), Failure> {
        self.connect_mcp(rendered).await?;
        self.narrate_unreachable_mcp().await?;
        let tools = self.mcp.iter().flatten().flat_map(|session| session.tools.iter());
        for tool in tools {
            if rendered.tools.iter().any(|own| own.name() == tool.name()) {
                return Err(Failure::failed(
                    flue_core::ToolNameConflictError::TYPE,
                    flue_core::ToolNameConflictError::duplicate(tool.name()).to_string(),
                ));
            }
            rendered.tools.push(tool.clone());
        }
        Ok(())
    }

    /// Narrates the optional MCP servers that could not be reached (once): a `resources`
    /// signal. While a render re-runs an interrupted tool batch, the signal waits for the
    /// repair: folded before it, it would close the batch's calls as interrupted and forget
    /// their children and recorded steps.
    async fn narrate_unreachable_mcp(&mut self) -> Result<(), Failure> {
        let unavailable = std::mem::take(&mut self.mcp_unavailable);
        // Once per response: a re-attempt that finds the servers still unreachable finds its
        // notice in the stream (under the response's own id) and stores no second one.
        let message_id = format!("msg_mcp_unavailable_{}", self.submission.id);
        if unavailable.is_empty() || self.conversation.has_row(&message_id) {
            return Ok(());
        }
        let mut attributes = std::collections::BTreeMap::new();
        attributes.insert("resource".to_owned(), "mcp".to_owned());
        let signal = self.record(RecordBody::Signal {
            message_id,
            signal_type: "resources".to_owned(),
            body: crate::mcp::unavailable_body(&unavailable),
            attributes,
            tag_name: None,
        });
        if self.repairing {
            self.deferred.push(signal);
            Ok(())
        } else {
            self.commit_signals(vec![signal], false).await
        }
    }

    /// The sandbox's tools while a render attaches it (delegates share them).
    fn environment(&self) -> crate::sandbox::Environment {
        match (&self.sandbox, self.sandbox_present) {
            (Some(environment), true) => environment.clone(),
            _ => crate::sandbox::Environment::default(),
        }
    }

    /// Mounts the framework tools (skills, the `task` tool) and keeps the system prompt
    /// sections they add. The `task` tool waits for the submission's model, which delegates
    /// inherit (the init render, which calls no model, gets none).
    fn mount_framework(&mut self, rendered: &mut Rendered) {
        if self.delegation.is_none()
            && let Some((spec, thinking)) = self.model_spec.clone()
        {
            let delegation = Arc::new(crate::subagents::Delegation::root(
                self.runtime,
                self.key,
                &self.submission.id,
                spec,
                thinking,
                self.budget.settings.clone(),
                self.attempt.signal.clone(),
            ));
            let tool = crate::subagents::task_tool(delegation.clone());
            // Tasks record through the attempt from the start (a `task` a hook invokes outside
            // a batch included); each batch attaches its own view of the retained children.
            delegation.attach(crate::subagents::Journal::root(
                self.attempt.clone(),
                self.writer.clone(),
                self.conversation.retained_children(),
            ));
            self.delegation = Some(crate::subagents::Delegating { delegation, tool });
        }
        let environment = self.environment();
        let parent = self.thread.as_ref().map(|view| (view.state(), self.hooks.clone()));
        let delegation = self
            .delegation
            .as_ref()
            .map(|delegating| (&delegating.delegation, &delegating.tool));
        let workspace = self.workspace.as_ref().filter(|_| self.sandbox_present);
        crate::framework::mount(
            rendered,
            delegation,
            parent,
            environment,
            workspace,
            &mut self.framework_sections,
        );
        if let Some(delegating) = &self.delegation {
            delegating
                .delegation
                .show_attachments(self.conversation.visible_attachments());
        }
    }

    /// Whether the response may make another model step: its step budget is not spent and
    /// its execution was not stopped.
    fn can_step(&self, steps: u32, max_steps: u32) -> bool {
        steps < max_steps && !self.execution.stopped()
    }

    /// Whether the attempt's abort signal fired (not to give the attempt back to the queue)
    /// after the response's end was durable: the abort lost the race to completion.
    fn lost_race_to_abort(&self) -> bool {
        self.attempt.signal.is_aborted()
            && !binding::hands_over(self.attempt.signal.reason())
            && self.conversation.has_ended(&self.submission.id)
    }

    /// A failure of what a response needs to run (its render, its model), met by a resumed
    /// response whose answer is durable: it settles completed as it is (reference §3.9 step 2)
    /// — a new build whose render fails, a provider this node lacks, must not turn stored,
    /// maybe already streamed, work into a failure. Its `use_response_finish` callbacks cannot
    /// run without the render: said in a warning. Any other response fails with it.
    fn as_answered(&self, answered: bool, failure: Failure) -> Result<(), Failure> {
        if !answered || failure.transient {
            return Err(failure);
        }
        if self.conversation.has_finished(&self.submission.id) {
            tracing::info!(instance = %self.key, submission = %self.submission.id, error = %failure.error.message, "a resumed response whose finish batch is durable could not be rendered again; it settles completed");
        } else {
            tracing::warn!(instance = %self.key, submission = %self.submission.id, error = %failure.error.message, "a resumed response whose answer is durable could not be rendered again; it settles completed without its use_response_finish callbacks");
        }
        Ok(())
    }

    fn check_abort(&self) -> Result<(), Failure> {
        if self.attempt.signal.is_aborted() {
            Err(Failure::aborted())
        } else {
            Ok(())
        }
    }

    async fn run(&mut self) -> Result<(), Failure> {
        let definition = self.agent.definition();
        let deadline = deadline_of(self.submission, definition.durability.timeout);
        // A resumed response that already ended (in a final answer, or in its finish batch)
        // settles as it is.
        let already_answered = self.conversation.has_ended(&self.submission.id);
        let out_of_time = !already_answered && Instant::now() >= deadline;
        // Deliveries an earlier attempt joined into this response settle with it, each with
        // its own record and event.
        self.resolve_earlier_joins(!out_of_time).await?;
        if out_of_time {
            return Err(timed_out());
        }
        self.restore_delivery_cursor().await?;
        if self.conversation.has_stepped(&self.submission.id) {
            self.attempt.stream_data();
        }
        // The init render: model, thinking level and compaction are submission-scoped.
        let rendered = match self.render() {
            Ok(rendered) => rendered,
            Err(failure) => return self.as_answered(already_answered, failure),
        };
        let model = match rendered.require_model() {
            Ok(model) => model.clone(),
            Err(error) => return self.as_answered(already_answered, error.into()),
        };
        let (provider, model_id) = match self.runtime.providers.resolve(&model.spec) {
            Ok(resolved) => resolved,
            Err(error) => {
                let failure = Failure::failed("model_resolution", error.to_string());
                return self.as_answered(already_answered, failure);
            }
        };
        let thinking = model.options.thinking_level.unwrap_or(ThinkingLevel::Medium);
        self.model_spec = Some((model.spec.to_string(), thinking));
        self.budget = crate::compaction::Budget::new(model.options.compaction.clone());

        let submission_id = self.submission.id.clone();
        // Initialization (reference §3.7 step 2): the init render's MCP servers and sandbox,
        // before the input is stored or any callback runs, so one that cannot be had fails
        // the submission with nothing done. A resumed response whose answer is durable settles
        // as it is (reference §3.9 step 2) and needs neither.
        if !already_answered {
            self.connect_mcp(&rendered).await?;
            if let Some(declaration) = &rendered.sandbox {
                self.create_sandbox(declaration).await?;
            }
        }

        // At rest (the input row), the agent-level hooks run, with the required hooks of the
        // relationships the first render declares.
        match HookSet::at_rest(definition, &rendered.subagents)
            .and_then(|hooks| hooks.register(&self.runtime.known_hooks).map(|()| hooks))
        {
            Ok(hooks) => self.at_rest_hooks = hooks,
            Err(message) => return self.as_answered(already_answered, Failure::failed("render_failed", message)),
        }
        self.thread_created().await?;

        // Input applied (once: a re-attempt finds it in the stream), then the response start,
        // then the start seam for the waking delivery (skipped when its marker committed).
        let delivery = self.delivery.clone();
        let seam_pending = self.store_input(&rendered, &delivery, &submission_id).await? == Some(true);
        // True start of the response (reference §3.7, step 6: after the input is durable, before
        // the start seam): use_response_start metadata, once per response — skipped when a
        // resumed response has a durable step start (completed or not), whose recorded metadata
        // it reads back.
        let opened = self.conversation.has_opened_step(&submission_id);
        let mut metadata = match self.conversation.response_metadata(&submission_id) {
            Some(recorded) if opened => recorded.clone(),
            _ => Metadata::new(),
        };
        let response_starts = if opened { &[][..] } else { &rendered.response_starts[..] };
        for (index, callback) in response_starts.iter().enumerate() {
            let ctx = ResponseStartContext {
                metadata: metadata.clone(),
                log: self.log_base().hook("use_response_start", index),
            };
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| callback.call(&ctx))) {
                Ok(Ok(Some(contribution))) => merge_metadata(&mut metadata, contribution),
                Ok(Ok(None)) => {}
                Ok(Err(error)) => return Err(metadata_failure("use_response_start", index, error)),
                Err(payload) => {
                    return Err(callback_panicked(
                        "response_hook_failed",
                        "use_response_start",
                        Some(index),
                        payload.as_ref(),
                    ));
                }
            }
        }
        // Recorded with the response's first step start, never again.
        self.first_step_metadata = (!opened).then(|| metadata.clone());
        // The optional MCP servers that could not be reached are narrated before the start
        // seam (reference §3.7 step 8), unless a tool batch awaits its repair (then right
        // after it: see `narrate_unreachable_mcp`).
        if self.conversation.open_calls().is_none() {
            self.narrate_unreachable_mcp().await?;
        }
        if seam_pending {
            self.start_seam(&rendered, delivery, &submission_id).await?;
        }
        // A tool batch an earlier attempt left uncommitted: its durable calls run again before
        // the next model call. Then the join point before turn 1: deliveries queued behind this
        // one join before the first model call (a resumed, answered response settles as it is).
        // Every join point is one only while the response can make another model step: a
        // delivery joined into a response that ends without reading it would settle unanswered.
        let max_steps = definition.max_steps.unwrap_or(u32::MAX);
        // The step budget belongs to the response: a re-attempt counts the durable steps.
        let mut steps = self.conversation.steps(&submission_id);
        // A resumed response whose answer is durable settles as it is (reference §3.9 step 2:
        // `completed`), without its would-stop phase: that attempt's guards (its deadline, its
        // abort, its attempt budget) are not this one's to spend on new model calls.
        let ended = already_answered;
        // At the would-stop point (reference §3.7, step 12) whenever the live turns end,
        // however they end.
        let mut stopping = false;
        if !already_answered {
            let mut terminated = false;
            if let Some(terminate) = self.rerun_durable_calls(&rendered).await? {
                terminated = terminate;
                if let Some(queued_terminate) = self.run_queued_tools(&rendered, &model.spec).await? {
                    terminated = queued_terminate;
                }
            }
            // The repair is done: what waited for it goes now.
            let deferred = std::mem::take(&mut self.deferred);
            if !deferred.is_empty() {
                self.commit_signals(deferred, false).await?;
            }
            let joined = self.can_step(steps, max_steps) && self.join_queued().await?;
            // Resumed with no step left (its last batch committed before the crash), the
            // turns are over too.
            stopping = (terminated || !self.can_step(steps, max_steps)) && !joined;
        }
        self.spare = Some(rendered);

        let mut finish_cycles = self.conversation.finish_cycles(&submission_id);
        loop {
            if ended {
                break;
            }
            if std::mem::take(&mut stopping) {
                // The agent's run ends where the model would stop; what follows (a finish
                // callback's appends, a late join) continues in a run of its own.
                self.end_agent_run();
                let rendered = self.spare.take().unwrap_or_default();
                let steps_again = self
                    .would_stop(&rendered, &model.spec, (steps, max_steps), &mut finish_cycles)
                    .await;
                self.spare = Some(rendered);
                if !steps_again? {
                    break;
                }
            }
            self.check_abort()?;
            if Instant::now() >= deadline {
                return Err(timed_out());
            }
            if !self.can_step(steps, max_steps) {
                break;
            }
            // Every model call renders afresh, turn 1 included: what the start seam
            // wrote already shapes turn 1's instruction and tools. (The reference's turn 1 uses
            // the init render, and the start seam's writes show from turn 2.)
            let mut rendered = self.render()?;
            self.prepare(&mut rendered).await?;
            steps += 1;
            self.execution.count_step();
            let (response, message_id, turn_id) = self
                .model_step(&*provider, &model_id, &model.spec, thinking, &rendered, steps)
                .await?;
            if response.stop_reason == crate::provider::StopReason::HookBlocked {
                // `prefilter_llm_history` blocked the request: the execution stops here.
                self.commit(Vec::new(), true).await?;
                self.spare = Some(rendered);
                break;
            }
            if response.tool_calls.is_empty() {
                self.spare = Some(rendered);
                stopping = true;
                continue;
            }
            let mut terminate = self
                .tool_batch(
                    &rendered,
                    &rendered.tools,
                    &response.tool_calls,
                    message_id,
                    &[],
                    Some((&turn_id, &response.text)),
                )
                .await?;
            if let Some(queued_terminate) = self.run_queued_tools(&rendered, &model.spec).await? {
                terminate = queued_terminate;
            }
            // A terminating batch ends the turn, but deliveries that join at its end are
            // steered into the loop, which runs on to answer them (reference §3.8).
            let joined = self.can_step(steps, max_steps) && self.join_queued().await?;
            self.spare = Some(rendered);
            // The turns end at a terminating batch, and at a batch after which no step is left
            // (`max_steps` spent, or a tool's `stop()`): the would-stop point follows, as after
            // an answer without calls.
            stopping = (terminate || !self.can_step(steps, max_steps)) && !joined;
        }

        // Calls queued when the response could run no more (by a hook of its last commit, or
        // of a step `prefilter_llm_history` blocked) are not run: said, not dropped silently.
        self.warn_unrun_queued_tools();
        // The true end: use_response_finish with final usage and tool calls — once: a resumed,
        // answered response whose finish batch committed settles as it is (durable effects
        // never duplicate).
        let rendered = self.spare.take().unwrap_or_default();
        if already_answered && self.conversation.has_finished(&submission_id) {
            return Ok(());
        }
        let summary = ResponseSummary {
            // The response's committed calls, the ones of earlier attempts included.
            tool_calls: self.conversation.tool_calls(&self.submission.id).to_vec(),
            // The response's durable steps, the ones of earlier attempts included.
            usage: self.conversation.usage(&self.submission.id),
        };
        let mut finish_metadata = Metadata::new();
        for (index, callback) in rendered.response_finishes.iter().enumerate() {
            let mut seen = metadata.clone();
            merge_metadata(&mut seen, finish_metadata.clone());
            let ctx = ResponseFinishContext {
                metadata: seen,
                response: summary.clone(),
                log: self.log_base().hook("use_response_finish", index),
            };
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| callback.call(&ctx))) {
                Ok(Ok(Some(contribution))) => merge_metadata(&mut finish_metadata, contribution),
                Ok(Ok(None)) => {}
                Ok(Err(error)) => return Err(metadata_failure("use_response_finish", index, error)),
                Err(payload) => {
                    return Err(callback_panicked(
                        "response_hook_failed",
                        "use_response_finish",
                        Some(index),
                        payload.as_ref(),
                    ));
                }
            }
        }
        // The metadata record marks the finish batch durable: recorded whenever callbacks ran,
        // also empty, since their state writes commit in this batch and a re-attempt that found
        // no mark would run them (and write) again.
        let records = if finish_metadata.is_empty() && rendered.response_finishes.is_empty() {
            Vec::new()
        } else {
            vec![self.record(RecordBody::MessageMetadata {
                metadata: finish_metadata,
            })]
        };
        self.commit(records, true).await?;
        Ok(())
    }

    /// Applies a joined delivery's input, then runs its start seam (see [`Self::store_input`]).
    /// Returns `false` when a `before_create_message` hook prevented its row.
    async fn apply_input(
        &mut self,
        rendered: &Rendered,
        delivery: Arc<DeliveredMessage>,
        submission_id: &str,
    ) -> Result<bool, Failure> {
        let Some(seam_pending) = self.store_input(rendered, &delivery, submission_id).await? else {
            return Ok(false);
        };
        if seam_pending {
            self.start_seam(rendered, delivery, submission_id).await?;
        }
        Ok(true)
    }

    /// Stores a delivery's input, once: a re-attempt finds it in the stream. Without
    /// `use_agent_start` callbacks the start seam has nothing to run and its marker commits in
    /// the input's batch (one durability point instead of two). Returns whether the seam is
    /// still to run, or `None` when a `before_create_message` hook prevented a joined
    /// delivery's row (the waking delivery's prevention fails the submission instead).
    async fn store_input(
        &mut self,
        rendered: &Rendered,
        delivery: &DeliveredMessage,
        submission_id: &str,
    ) -> Result<Option<bool>, Failure> {
        let needs_input = !self.conversation.has_input(submission_id);
        let needs_seam = !self.conversation.has_started(submission_id);
        if needs_input {
            // Prevented while a response here joined it: its row's hooks are not run again. On
            // its own it fails as it did; joined again, it leaves again.
            let waking = submission_id == self.submission.id;
            if let Some(error) = self.binding.prevented(submission_id, waking) {
                if !waking {
                    return Ok(None);
                }
                return Err(Failure {
                    outcome: Outcome::Failed,
                    error,
                    transient: false,
                });
            }
            let (input, attachments) = self.input_record(submission_id, delivery)?;
            let (mut records, created) = match self.input_row(input).await {
                lifecycle::InputRow::Store(records, created) => {
                    // The images are stored once the row is: a message a hook refused leaves
                    // none behind (they would be served), nor does an image a hook left out of
                    // the row.
                    let kept: Vec<&str> = match records.first().map(|record| &record.body) {
                        Some(RecordBody::UserMessage { attachments, .. }) => {
                            attachments.iter().map(|attachment| attachment.id.as_str()).collect()
                        }
                        _ => Vec::new(),
                    };
                    let attachments = attachments
                        .into_iter()
                        .filter(|(put, _)| kept.contains(&put.id.as_str()))
                        .collect();
                    self.store_attachments(attachments).await?;
                    (records, created)
                }
                lifecycle::InputRow::Prevented(failure) if submission_id == self.submission.id => return Err(failure),
                lifecycle::InputRow::Prevented(failure) => {
                    // A joined delivery's row was prevented: it leaves this response, which
                    // goes on without it. Its claim goes back to the queue at settlement, and
                    // processed on its own it fails with this error.
                    tracing::warn!(instance = %self.key, submission = submission_id, error = %failure.error.message, "a queued message was not stored: a before_create_message hook prevented it");
                    self.binding.note_prevented(submission_id, failure.error);
                    return Ok(None);
                }
            };
            let message_id = records.first().and_then(|record| match &record.body {
                RecordBody::UserMessage { message_id, .. } | RecordBody::Signal { message_id, .. } => {
                    Some(message_id.clone())
                }
                _ => None,
            });
            if needs_seam && rendered.agent_starts.is_empty() {
                records.push(self.seam_marker(submission_id));
                self.commit(records, true).await?;
                self.stored_message_events(message_id.as_deref());
                self.input_row_created(created).await;
                return Ok(Some(false));
            }
            self.commit(records, false).await?;
            self.stored_message_events(message_id.as_deref());
            self.input_row_created(created).await;
        }
        Ok(Some(needs_seam))
    }

    fn seam_marker(&self, submission_id: &str) -> Record {
        let mut marker = self.record(RecordBody::AgentStartRun);
        marker.submission_id = Some(submission_id.into());
        marker
    }

    /// The input's record, and the images it names (stored with [`Self::store_attachments`]
    /// once its row may be).
    fn input_record(
        &mut self,
        submission_id: &str,
        message: &DeliveredMessage,
    ) -> Result<(Record, Vec<(AttachmentPut, ModelImage)>), Failure> {
        let (mut record, images) = match message {
            DeliveredMessage::User(user) => {
                let (refs, images) = attachments_of(submission_id, &user.attachments)?;
                let record = self.record(RecordBody::UserMessage {
                    message_id: new_id("msg"),
                    body: user.body.clone(),
                    attachments: refs,
                });
                (record, images)
            }
            DeliveredMessage::Signal(signal) => (self.signal_record(signal), Vec::new()),
        };
        record.submission_id = Some(submission_id.into());
        Ok((record, images))
    }

    /// Puts a user message's images into the attachment store (before its input record names
    /// them; ids derive from the submission, so a re-attempt's put is an exact retry) and keeps
    /// them for the model calls of this conversation.
    async fn store_attachments(&mut self, images: Vec<(AttachmentPut, ModelImage)>) -> Result<(), Failure> {
        for (put, image) in images {
            let id = put.id.clone();
            self.runtime
                .store
                .put_attachment(self.key, put)
                .await
                .map_err(Failure::store)?;
            self.conversation.keep_image(id, image);
        }
        Ok(())
    }

    /// Loads the images of the history that are not in memory (an instance folded again from
    /// its stream) from the attachment store.
    async fn load_images(&mut self) -> Result<(), Failure> {
        for attachment in self.conversation.missing_images() {
            let stored = match self.runtime.store.attachment(self.key, &attachment.id).await {
                Ok(stored) => stored,
                // Damaged bytes stay damaged: another attempt would fail the same way.
                Err(StoreError::AttachmentIntegrity { id, reason, detail }) => {
                    let mut failure = Failure::failed(
                        "attachment_integrity",
                        format!(
                            "The attachment \"{}\" of this conversation is damaged in the store: {detail}",
                            attachment.id
                        ),
                    );
                    // Reference §6.2: `meta {attachmentId, reason}`.
                    let mut meta = serde_json::Map::new();
                    meta.insert("attachmentId".into(), id.into());
                    meta.insert("reason".into(), reason.as_str().into());
                    failure.error = failure.error.with_meta(meta);
                    return Err(failure);
                }
                Err(error) => return Err(Failure::store(error)),
            };
            let Some(stored) = stored else {
                return Err(Failure::failed(
                    "attachment_not_found",
                    format!(
                        "The attachment \"{}\" of this conversation is not in the store.",
                        attachment.id
                    ),
                ));
            };
            let image = ModelImage::from_bytes(&stored.media_type, &stored.bytes);
            self.conversation.keep_image(attachment.id, image);
        }
        Ok(())
    }

    fn signal_record(&self, signal: &Signal) -> Record {
        self.record(RecordBody::Signal {
            message_id: new_id("msg"),
            signal_type: signal.signal_type.clone(),
            body: signal.body.clone(),
            attributes: signal.attributes.clone(),
            tag_name: signal.tag_name.clone(),
        })
    }

    /// Runs a delivery's `use_agent_start` callbacks concurrently and commits their appends and
    /// state writes with the seam marker in one batch.
    async fn start_seam(
        &mut self,
        rendered: &Rendered,
        delivery: Arc<DeliveredMessage>,
        submission_id: &str,
    ) -> Result<(), Failure> {
        let appends = Arc::new(Appends::default());
        let mut signals = Vec::new();
        if !rendered.agent_starts.is_empty() {
            let windows: Vec<AppendWindow> = rendered.agent_starts.iter().map(|_| AppendWindow::open()).collect();
            let per_callback: Vec<Arc<Appends>> = rendered
                .agent_starts
                .iter()
                .map(|_| Arc::new(Appends::default()))
                .collect();
            let log = self.log_base();
            let runs = rendered
                .agent_starts
                .iter()
                .zip(&windows)
                .zip(&per_callback)
                .enumerate()
                .map(|(index, ((callback, window), channel))| {
                    let ctx = AgentStartContext::new(
                        channel.clone(),
                        window.clone(),
                        self.attempt.signal.clone(),
                        log.hook("use_agent_start", index),
                        delivery.clone(),
                    );
                    // A callback that panics while building its future, or while it runs,
                    // fails the seam like one that returns an error.
                    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| callback.call(ctx)));
                    let window = window.clone();
                    async move {
                        let result = match run {
                            Ok(run) => std::panic::AssertUnwindSafe(run).catch_unwind().await,
                            Err(payload) => Err(payload),
                        };
                        window.close();
                        result
                    }
                });
            let results = futures_util::future::join_all(runs).await;
            // Every callback ran: each failure is reported, in declaration order.
            let mut failures: Vec<Failure> = Vec::new();
            for (index, result) in results.into_iter().enumerate() {
                match result {
                    Ok(Ok(())) => {}
                    Ok(Err(error)) => failures.push(Failure::failed(
                        "agent_start_failed",
                        format!(
                            "[flue] A use_agent_start callback (hook #{index} in declaration order) threw: {error}"
                        ),
                    )),
                    Err(payload) => failures.push(callback_panicked(
                        "agent_start_failed",
                        "use_agent_start",
                        Some(index),
                        payload.as_ref(),
                    )),
                }
            }
            if let Some(failure) = Failure::aggregate(
                "agent_start_failed",
                "[flue] Multiple use_agent_start callbacks threw.",
                failures,
            ) {
                return Err(failure);
            }
            // Appended signals reach the conversation grouped in declaration order.
            for channel in &per_callback {
                signals.extend(channel.take());
            }
        }
        drop(appends);
        let records: Vec<Record> = signals.iter().map(|signal| self.signal_record(signal)).collect();
        let (mut records, kept, created) = self.created_signals(records).await;
        let appended = kept_signals(signals, &kept);
        records.push(self.seam_marker(submission_id));
        self.commit_created_signals(records, created, true).await?;
        self.advance_delivery(&appended);
        Ok(())
    }

    /// The would-stop point (reference §3.7, step 12), where the turns ended: the model
    /// answered without calls, a terminating batch ended them, or no step is left after a
    /// batch (`max_steps` spent, or the execution stopped). Calls queued with
    /// `queue_tool` run first (the model sees their results),
    /// then queued deliveries join (while the response `can_step`), then `use_agent_finish`
    /// runs: an append continues the response, a counted cycle committed with its signals.
    /// Returns whether the response goes on to another model step.
    async fn would_stop(
        &mut self,
        rendered: &Rendered,
        spec: &str,
        (steps, max_steps): (u32, u32),
        finish_cycles: &mut u32,
    ) -> Result<bool, Failure> {
        // The abort (or the deadline) fired after the response's end was durable: it lost the
        // race to completion (reference §3.10). Nothing continues the response (no queued
        // call, no join, no finish cycle): it ends as it is, through its finish callbacks and
        // batch.
        if self.lost_race_to_abort() {
            return Ok(false);
        }
        // Calls queued meanwhile run; the model answers their results, unless they terminate
        // (as a terminating batch of its own calls, the turns end) or no step is left: then the
        // would-stop point goes on, joins and finish callbacks included.
        if let Some(terminate) = self.run_queued_tools(rendered, spec).await?
            && !terminate
            && self.can_step(steps, max_steps)
        {
            return Ok(true);
        }
        // Read afresh at each use: a hook that ran meanwhile may have stopped the execution.
        if self.can_step(steps, max_steps) && self.join_queued().await? {
            return Ok(true);
        }
        let finished = self.finish_cycle(rendered).await;
        // The signal fired while the callbacks ran: whether one failed because of it (it
        // listened) or returned as if nothing happened, with or without appends, the response
        // ends as it is (an append would continue it after the abort).
        if self.lost_race_to_abort() {
            if let Err(failure) = &finished {
                tracing::warn!(instance = %self.key, submission = %self.submission.id, error = %failure.error.message, "a use_agent_finish callback failed after the abort signal fired; the response ends as it is");
            }
            return Ok(false);
        }
        let mut appended = finished?;
        if !appended.is_empty() && self.execution.stopped() {
            // Stopped on purpose: the response completes with what it has, and no model call
            // could answer the append, which committed would sit unanswered in the stream (the
            // next response's model would read it as meant for its own answer).
            tracing::warn!(instance = %self.key, submission = %self.submission.id, signals = appended.len(), "use_agent_finish appended a continuation signal after the execution was stopped; the signal is not stored and the response completes");
            appended.clear();
        }
        // Each append through its create hooks: one a `before_create_message` hook refuses is
        // not stored, and a cycle whose appends were all refused continues nothing.
        let (mut records, created) = if appended.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            let records = appended.iter().map(|signal| self.signal_record(signal)).collect();
            let (records, kept, created) = self.created_signals(records).await;
            appended = kept_signals(appended, &kept);
            (records, created)
        };
        // The signal fired while the hooks ran: the response ends as it is, as above.
        if self.lost_race_to_abort() {
            return Ok(false);
        }
        if appended.is_empty() {
            self.commit(Vec::new(), true).await?;
            // The signal fired while the commit awaited the store: nothing continues the
            // response, as above.
            if self.lost_race_to_abort() {
                return Ok(false);
            }
            // Calls a finish callback or a hook of that commit queued run now (the model sees
            // their results, unless they terminate or no step is left), as at the would-stop
            // point; the finish callbacks ran already.
            if let Some(terminate) = self.run_queued_tools(rendered, spec).await?
                && !terminate
                && self.can_step(steps, max_steps)
            {
                return Ok(true);
            }
            // Joins again after a no-append cycle, in case a hook dispatched: a joined delivery
            // drives another turn (not a counted cycle).
            return Ok(self.can_step(steps, max_steps) && self.join_queued().await?);
        }
        if steps >= max_steps {
            // Nothing could answer the append either; but the check it makes was not met.
            return Err(Failure::failed(
                "agent_finish_unanswerable",
                format!(
                    "[flue] use_agent_finish appended a continuation signal, but the response has spent its max_steps ({max_steps}) and can make no further model call; the signal was not stored. The response is failing loudly instead of settling with the check unmet: raise max_steps, or make the hook give up after a bounded number of attempts."
                ),
            ));
        }
        *finish_cycles += 1;
        if *finish_cycles > MAX_AGENT_FINISH_CYCLES {
            return Err(Failure::failed(
                "agent_finish_ceiling",
                format!(
                    "[flue] use_agent_finish appended a continuation signal after {MAX_AGENT_FINISH_CYCLES} continued cycles in one response — a runaway loop. The response is failing loudly instead of settling as a success; if the model cannot satisfy the check, make the hook give up explicitly (log and return) after a bounded number of attempts."
                ),
            ));
        }
        records.push(self.record(RecordBody::AgentFinishCycle));
        self.commit_created_signals(records, created, true).await?;
        self.advance_delivery(&appended);
        Ok(true)
    }

    /// Runs the `use_agent_finish` callbacks sequentially; returns what they appended.
    async fn finish_cycle(&mut self, rendered: &Rendered) -> Result<Vec<Signal>, Failure> {
        let mut appended = Vec::new();
        let summary = Arc::new(ResponseSummary {
            // The response's committed calls, the ones of earlier attempts included.
            tool_calls: self.conversation.tool_calls(&self.submission.id).to_vec(),
            // The response's durable steps, the ones of earlier attempts included.
            usage: self.conversation.usage(&self.submission.id),
        });
        for (index, callback) in rendered.agent_finishes.iter().enumerate() {
            let channel = Arc::new(Appends::default());
            let window = AppendWindow::open();
            let ctx = AgentFinishContext::new(
                channel.clone(),
                window.clone(),
                self.attempt.signal.clone(),
                self.log_base().hook("use_agent_finish", index),
                summary.clone(),
            );
            let result = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| callback.call(ctx))) {
                Ok(run) => std::panic::AssertUnwindSafe(run).catch_unwind().await,
                Err(payload) => Err(payload),
            };
            window.close();
            let result = match result {
                Ok(result) => result,
                Err(payload) => {
                    return Err(callback_panicked(
                        "agent_finish_failed",
                        "use_agent_finish",
                        Some(index),
                        payload.as_ref(),
                    ));
                }
            };
            if let Err(error) = result {
                return Err(Failure::failed(
                    "agent_finish_failed",
                    format!("[flue] A use_agent_finish callback (hook #{index} in declaration order) threw: {error}"),
                ));
            }
            appended.extend(channel.take());
        }
        Ok(appended)
    }

    /// Takes over the deliveries an earlier attempt of this response joined (their input is
    /// in the stream, unsettled): a join interrupted before it was finalized is finalized, as
    /// its record exists. They settle with this attempt, through its settlement records.
    ///
    /// When the response goes on (`rejoin`), a join whose input is saved but whose start
    /// seam never ran is not finalized: put back in the queue, it rejoins before turn 1 and
    /// its seam runs then. A response that ends here (aborted, out of attempts or of time)
    /// finalizes it too, so that it settles with the response it joined.
    async fn resolve_earlier_joins(&mut self, rejoin: bool) -> Result<(), Failure> {
        let host = self.submission.id.clone();
        let candidates: Vec<String> = self
            .conversation
            .unsettled_inputs()
            .iter()
            .filter(|id| ***id != *host && !self.joined.iter().any(|joined| **joined == ***id))
            .map(|id| id.to_string())
            .collect();
        for id in candidates {
            let Some(row) = self.runtime.store.submission(&id).await.map_err(Failure::store)? else {
                continue;
            };
            if row.outcome.is_some() || row.joined_into.as_deref() != Some(host.as_str()) {
                continue;
            }
            match row.status {
                SubmissionStatus::Joined => {}
                // Its input saved but its start seam not run: left to be reverted below, it
                // rejoins at the join point before turn 1, where the seam runs (the input is
                // found in the stream and not saved again).
                SubmissionStatus::Joining if rejoin && !self.conversation.has_started(&id) => continue,
                SubmissionStatus::Joining => {
                    if !self
                        .runtime
                        .store
                        .finalize_join(&self.attempt.attempt, &id)
                        .await
                        .map_err(Failure::store)?
                    {
                        continue;
                    }
                }
                _ => continue,
            }
            self.joined.push(id);
        }
        // Joins an earlier attempt claimed but never applied go back to the queue, so the
        // join point before turn 1 takes them again ahead of later deliveries (§3.9 step 10).
        // A first attempt has claimed nothing before.
        if self.submission.attempt_count > 1 {
            self.runtime
                .store
                .revert_joins(&self.attempt.attempt)
                .await
                .map_err(Failure::store)?;
        }
        Ok(())
    }

    /// A resumed response derives the `use_delivery` cursor from the stream: the latest input
    /// or appended signal an earlier attempt committed (reference `restoreDeliveryCursor`).
    async fn restore_delivery_cursor(&mut self) -> Result<(), Failure> {
        if !self.conversation.has_input(&self.submission.id) {
            return Ok(());
        }
        let message = match self.conversation.delivery_cursor().cloned() {
            None => return Ok(()),
            Some(conversation::DeliveryCursor::Appended(signal)) => DeliveredMessage::Signal(signal),
            Some(conversation::DeliveryCursor::Input(id)) if id == self.submission.id => {
                self.submission.message.clone()
            }
            Some(conversation::DeliveryCursor::Input(id)) => {
                match self.runtime.store.submission(&id).await.map_err(Failure::store)? {
                    Some(row) => row.message,
                    None => return Ok(()),
                }
            }
        };
        self.delivery = Arc::new(message);
        Ok(())
    }

    /// Claims queued deliveries into this response; returns whether any joined.
    async fn join_queued(&mut self) -> Result<bool, Failure> {
        // After the abort nothing joins: a delivery the abort did not stamp (admitted after it)
        // is processed on its own, not settled aborted with this response.
        if self.attempt.signal.is_aborted() {
            return Ok(false);
        }
        // Loaded before the store is asked: an admission committed after the question bumps
        // the count after it, so the next boundary asks again.
        let admissions = self.admissions.load(Ordering::SeqCst);
        if self.joins_checked == Some(admissions) && !self.runtime.store.shared() {
            return Ok(false);
        }
        let claimed = self
            .runtime
            .store
            .claim_joinable(&self.attempt.attempt)
            .await
            .map_err(Failure::store)?;
        if claimed.is_empty() {
            self.joins_checked = Some(admissions);
            return Ok(false);
        }
        self.joins_checked = None;
        let mut joined_any = false;
        for delivery in claimed {
            self.binding.announce_claimed(&delivery.id, || {
                self.runtime.emit(
                    self.key,
                    Some(&delivery.id),
                    Event::SubmissionQueued { kind: delivery.kind },
                );
            });
            let message = Arc::new(delivery.message.clone());
            let previous = std::mem::replace(&mut self.delivery, message.clone());
            // A joined delivery re-renders first: its start seam's hooks see the writes
            // committed before the join (and the delivery they start for).
            let fresh = self.render()?;
            if !self.apply_input(&fresh, message, &delivery.id).await? {
                // Not finalized: at settlement the claim goes back to the queue, and the
                // delivery is processed on its own — where the prevention fails it with
                // `message_hook_error`.
                self.delivery = previous;
                continue;
            }
            joined_any = true;
            self.runtime
                .store
                .finalize_join(&self.attempt.attempt, &delivery.id)
                .await
                .map_err(Failure::store)?;
            self.joined.push(delivery.id);
        }
        Ok(joined_any)
    }

    async fn model_step(
        &mut self,
        provider: &dyn ModelProvider,
        model_id: &str,
        spec: &str,
        thinking: ThinkingLevel,
        rendered: &Rendered,
        step: u32,
    ) -> Result<(ModelResponse, String, LazyId), Failure> {
        self.open_agent_run();
        self.load_images().await?;
        self.hooked_system = None;
        let message_id = new_id("msg");
        self.narrate_resources(rendered).await?;
        let instruction = rendered.instruction.as_deref();
        let mut tools: Vec<ToolSpec> = rendered.tools.iter().map(ToolSpec::from).collect();
        let system_len = crate::framework::system_len(instruction, self.sections());
        crate::compaction::compact_if_needed(self, provider, model_id, thinking, system_len, step).await?;
        let mut row_updates = None;
        let mut live: Option<LiveText> = None;
        let mut compacted_for_overflow = false;
        // Transient failures retried so far (with the provider's own retries of each call): the
        // retries share one budget.
        let mut retries = 0;
        let mut history_len: usize;
        // The request a transient failure makes again: the same model request, so its hooks
        // are not run again (what they injected would be stored twice). A call after overflow
        // recovery is a new request, on the compacted history: its history hooks run, under
        // the system message `after_system_message` made for the step (once per step).
        let mut retried: Option<(Option<String>, Messages)> = None;
        let (response, started, turn_id) = loop {
            let (system, messages) = match retried.take() {
                Some(request) => request,
                None => {
                    let system = crate::framework::system(instruction, self.sections());
                    match self.request(system).await {
                        Ok(request) => request,
                        Err(blocked) => {
                            let response = self
                                .blocked_step(spec, message_id.clone(), blocked, live.take(), row_updates.take())
                                .await?;
                            return Ok((response, message_id, LazyId::new("turn")));
                        }
                    }
                }
            };
            // The history the call is made on, for the compaction budget's count: with the
            // rows the request's hooks folded in (the provider counts them in this call, so
            // the next step's estimate must not count them again).
            history_len = self.conversation.messages.len();
            if row_updates.is_none() {
                row_updates = Some(self.assistant_row_created(&message_id).await);
            }
            // One id per model call (a retry after a transient failure, or after an overflow
            // recovery, is a call and a turn of its own); the step's start names its first.
            let turn_id = LazyId::new("turn");
            let live = live.get_or_insert_with(|| self.live_text(&message_id, spec, Some(turn_id.get())));
            let request = ModelRequest {
                model: model_id.to_owned(),
                system,
                messages,
                tools: std::mem::take(&mut tools),
                thinking_level: thinking,
                max_output_tokens: None,
                max_retries: Some(self.runtime.options.model_retries.saturating_sub(retries)),
            };
            let started = Instant::now();
            self.set_turn(Some(&turn_id));
            self.emit_with(|| Event::TurnStart {
                turn_id: turn_id.get(),
                purpose: TurnPurpose::Agent,
                step,
            });
            self.emit_with(|| Event::TurnRequest {
                turn_id: turn_id.get(),
                purpose: TurnPurpose::Agent,
                request: turn_request(provider, model_id, thinking),
            });
            self.emit_with(|| Event::MessageStart {
                message: ModelMessage::empty_assistant(),
            });
            let streamed = self.stream_once(provider, &request, &rendered.tools, live).await;
            // Kept for a call after overflow recovery.
            tools = request.tools;
            let sent = (request.system, request.messages);
            if let Err(error) = &streamed {
                // A failed call still ends its turn (§7.2: `turn` with finish reason `error` or
                // `aborted`) and its assistant message, before any recovery.
                let stop_reason = match error {
                    StepError::Aborted => "aborted",
                    StepError::Provider(_) | StepError::Store(_) => "error",
                };
                self.emit_with(|| Event::Turn {
                    turn_id: turn_id.get(),
                    purpose: TurnPurpose::Agent,
                    step,
                    duration_ms: started.elapsed().as_millis() as u64,
                    request: turn_request(provider, model_id, thinking),
                    response: TurnResponse {
                        finish_reason: stop_reason.to_owned(),
                        error: Some(error.describe()),
                        ..TurnResponse::default()
                    },
                    is_error: true,
                });
                self.emit_with(|| Event::MessageEnd {
                    message: ModelMessage::empty_assistant(),
                });
                // The turn ended: what follows (a retry's backoff, a recovery, a step the
                // request's hooks block) is not part of it.
                self.set_turn(None);
            }
            let error = match streamed {
                Ok(response) => break (response, started, turn_id),
                Err(error) => error,
            };
            let failure = match error {
                StepError::Aborted => Failure::aborted(),
                StepError::Store(error) => Failure::store(error),
                StepError::Provider(error) if error.kind == crate::provider::ProviderErrorKind::ContextOverflow => {
                    // Overflow recovery: compact and retry the call once, also with threshold
                    // compaction off.
                    let compacted = if compacted_for_overflow {
                        false
                    } else {
                        match crate::compaction::compact(
                            self,
                            crate::compaction::Reason::Overflow,
                            provider,
                            model_id,
                            thinking,
                            step,
                        )
                        .await
                        {
                            Ok(compacted) => compacted,
                            Err(failure) => {
                                // An abort, or the summary's record not stored: the step
                                // failed, as any other of its failures.
                                self.assistant_row_failed(&message_id).await;
                                return Err(failure);
                            }
                        }
                    };
                    if compacted {
                        compacted_for_overflow = true;
                        // The compaction recorded the conversation's snapshot, and the call
                        // made again streams its own text.
                        live.drop_snapshot();
                        live.restart();
                        continue;
                    }
                    // Reported as an overflow (issue 4: "recognised and reported as such"),
                    // where the reference's settlement says `operation_failed`.
                    Failure::prompt_failed("context_overflow", &error.to_string())
                }
                StepError::Provider(error) if error.may_retry(retries, self.runtime.options.model_retries) => {
                    // A transient failure: the call is made again after its backoff, as the
                    // reference makes it, in a turn of its own. The retry streams its own text;
                    // what this call appended stays behind (the step's completion says what
                    // the text is).
                    let delay;
                    (retries, delay) = self.runtime.options.model_retry(retries, &error);
                    live.restart();
                    let aborted = tokio::select! {
                        () = tokio::time::sleep(delay) => false,
                        () = self.attempt.signal.aborted() => true,
                    };
                    if !aborted {
                        retried = Some(sent);
                        continue;
                    }
                    Failure::aborted()
                }
                StepError::Provider(error) => Failure::prompt_failed("operation_failed", &error.to_string()),
            };
            // The step failed: its row's failed status, through the update hooks.
            self.assistant_row_failed(&message_id).await;
            return Err(failure);
        };
        // What the row's create hooks set before the model was called.
        let created_updates = row_updates.unwrap_or_default();
        self.budget.called(&response.usage, history_len);
        // The call's own duration (the row hooks below are not the model's time).
        let duration_ms = started.elapsed().as_millis() as u64;
        let mut response = response;
        // No call to answer: a final answer, whatever the finish reason said (a server whose
        // tool-call parser failed says `tool_calls`); stored as one, the stream's fold reads it
        // as this loop does.
        if response.tool_calls.is_empty() && response.stop_reason == crate::provider::StopReason::ToolUse {
            response.stop_reason = crate::provider::StopReason::Stop;
        }
        let mut completion_updates = flue_core::lifecycle::MessageUpdates::new();
        if self.shapes_assistant_rows() {
            // The row hooks never see reasoning: it is not kept where they cannot redact it.
            response.reasoning.clear();
            response.text = self
                .assistant_row_updating(&message_id, std::mem::take(&mut response.text), &mut completion_updates)
                .await;
            // The text the hooks let through, in one delta: observers never saw the raw one
            // (`stream_once` held its deltas back).
            if !response.text.is_empty() {
                self.emit_with(|| Event::TextDelta {
                    text: response.text.clone(),
                });
            }
        }
        self.emit_with(|| Event::Turn {
            turn_id: turn_id.get(),
            purpose: TurnPurpose::Agent,
            step,
            duration_ms,
            request: turn_request(provider, model_id, thinking),
            response: TurnResponse {
                finish_reason: response.stop_reason.to_string(),
                text: response.text.clone(),
                tool_calls: response.tool_calls.clone(),
                usage: Some(response.usage),
                error: None,
            },
            is_error: false,
        });
        // The step's start (unless its text streamed into the stream already), its calls and
        // its completion.
        let mut records = match live {
            Some(live) => {
                // The reply reads the response's start metadata from the step's start, which
                // may have been appended while the step streamed.
                if let Some(started) = live.appended_start() {
                    self.reply.add(started);
                }
                live.into_unappended()
            }
            None => Vec::new(),
        };
        records.extend(crate::record::model_step_ending(&message_id, &response).map(|body| self.record(body)));
        // The row's fields oldest first, each later change over the earlier: what its create
        // hooks set, then what `update_message` set while the step ran, then what the update
        // hooks of its completion set (its content and status are the step's: they came last).
        let row_updates = {
            let mut updates = created_updates;
            updates.extend(self.writer.take_pending_updates());
            updates.extend(completion_updates);
            updates
        };
        if !row_updates.is_empty() {
            records.push(self.record(RecordBody::MessageUpdated {
                message_id: message_id.clone(),
                updates: row_updates,
            }));
        }
        if let Err(failure) = self.commit(records, false).await {
            // The step's message ends with the step (observers saw it start), and the calls
            // announced while it streamed will not run: the attempt fails, and the next one
            // makes the step again.
            self.emit_with(|| Event::MessageEnd {
                message: ModelMessage::empty_assistant(),
            });
            for call in &response.tool_calls {
                self.emit_thread_event(|| Event::ToolCallDone {
                    tool_call_id: call.id.clone(),
                    tool_name: call.name.clone(),
                    status: "error".to_owned(),
                });
            }
            return Err(failure);
        }
        // The step is stored: whatever fails after it, its message ends as stored (a re-attempt
        // resumes from it, and runs its calls).
        let after = self.after_step_stored(&message_id).await;
        self.fold_thread_writes();
        if self.runtime.observed() {
            // As stored: after the message hooks.
            let mut message =
                self.conversation
                    .observed_message(&message_id)
                    .unwrap_or_else(|| ModelMessage::Assistant {
                        text: response.text.clone(),
                        tool_calls: response.tool_calls.clone(),
                        reasoning: Vec::new(),
                    });
            // The row hooks never saw the reasoning, so could not redact it: observers get
            // none (the blocks stay in the record, for the provider's next request).
            if self.shapes_assistant_rows()
                && let ModelMessage::Assistant { reasoning, .. } = &mut message
            {
                reasoning.clear();
            }
            self.end_message(message);
        }
        after?;
        if response.tool_calls.is_empty() {
            // A turn without calls added its message alone, durable now (a turn with calls
            // reports its messages once its tool batch committed).
            self.emit_with(|| Event::agent_turn_messages(&turn_id, response.text.clone(), Vec::new(), Vec::new()));
            self.set_turn(None);
        }
        self.assistant_row_updated(&message_id).await;
        Ok((response, message_id, turn_id))
    }

    /// After a model step's records are stored: an update of its row made while they
    /// committed, then the data writes made before the response had a message.
    pub(super) async fn after_step_stored(&mut self, message_id: &str) -> Result<(), Failure> {
        // The stream holds the step's row now; an update made while it committed (by a task
        // a hook spawned) is stored after it.
        let late = self.writer.finish_pending_row();
        if !late.is_empty() {
            let update = self.record(RecordBody::MessageUpdated {
                message_id: message_id.to_owned(),
                updates: late,
            });
            self.commit(vec![update], false).await?;
        }
        // The response has a message now: data writes stream from here on (the ones made
        // before it flush now).
        self.attempt.stream_data();
        self.flush_data().await
    }

    /// The step `message_id`'s start, with what the response's first step carries (the
    /// conversation's first resource snapshot, `use_response_start` metadata), ready to
    /// stream its text (see [`LiveText`]). An agent with a hook that shapes the assistant row
    /// (`before_create_message`, `before_update_message`) does not stream into the stream:
    /// the hooks decide what is stored and shown.
    fn live_text(&mut self, message_id: &str, spec: &str, turn_id: Option<String>) -> LiveText {
        let response_metadata = self.first_step_metadata.take().filter(|metadata| !metadata.is_empty());
        let started = self.record(RecordBody::AssistantMessageStarted {
            message_id: message_id.to_owned(),
            model: spec.to_owned(),
            turn_id,
            response_metadata,
        });
        let every = self
            .runtime
            .options
            .text_flush
            .filter(|_| !self.shapes_assistant_rows());
        LiveText::new(message_id, self.first_snapshot.take(), started, every)
    }

    /// Whether a selected hook decides what an assistant row stores or how it shows: the raw
    /// text is then neither streamed into the stream nor its reasoning recorded (the hooks
    /// never see reasoning, so they could not redact it).
    fn shapes_assistant_rows(&self) -> bool {
        use flue_core::lifecycle::HookKind;
        self.hooks.has(HookKind::BeforeUpdateMessage) || self.hooks.has(HookKind::BeforeCreateMessage)
    }

    /// The framework's sections of the system prompt: the frozen baseline once the
    /// conversation has a resource snapshot (this render's before).
    fn sections(&self) -> Option<&str> {
        if self.conversation.resources.is_some() {
            self.conversation.baseline_sections.as_deref()
        } else {
            self.framework_sections.text()
        }
    }

    /// One streamed model call, not retried here: its step retries a transient failure as a
    /// call and turn of its own. Its text goes to `live` too, which appends it when due.
    async fn stream_once(
        &self,
        provider: &dyn ModelProvider,
        request: &ModelRequest,
        tools: &[flue_core::Tool],
        live: &mut LiveText,
    ) -> Result<ModelResponse, StepError> {
        let mut stream = provider.stream(request);
        let mut observer = observation::ToolCallObserver::new(tools);
        let mut ids = CallIds::default();
        // Row hooks may redact the text, and never see the reasoning: observers get neither
        // raw (the step's text follows its hooks, in one delta).
        let held = self.shapes_assistant_rows();
        // Whether a `thinking_start` is open, and the reasoning since: anything but more
        // reasoning ends it, and so does the call's end, however it ends.
        let mut thinking = false;
        let mut thought = String::new();
        let ended = loop {
            let due = live.due();
            // Text that waited its interval while events kept coming goes now: the timer below
            // is armed only while the stream waits.
            if due.is_some_and(|due| due <= tokio::time::Instant::now()) {
                if let Err(error) = live.flush(&self.writer, |body| self.record(body)).await {
                    break Err(StepError::Store(error));
                }
                continue;
            }
            // In this order: an abort wins, and the flush timer is polled (so registered with
            // the timer driver, which wakes a parked worker to re-arm) only when the stream has
            // nothing ready. Most steps end before their text is due and never arm it.
            let next = tokio::select! {
                biased;
                () = self.attempt.signal.aborted() => break Err(StepError::Aborted),
                next = stream.next() => next,
                // Lazy: no timer is made while no text waits.
                () = async { if let Some(due) = due { tokio::time::sleep_until(due).await } }, if due.is_some() => {
                    if let Err(error) = live.flush(&self.writer, |body| self.record(body)).await {
                        break Err(StepError::Store(error));
                    }
                    continue;
                }
            };
            if thinking && !matches!(next, Some(Ok(StreamEvent::ReasoningDelta(_)))) {
                thinking = false;
                let content = std::mem::take(&mut thought);
                self.emit_with(|| Event::ThinkingEnd { content });
            }
            match next {
                None => {
                    break Err(StepError::Provider(crate::provider::ProviderError::new(
                        crate::provider::ProviderErrorKind::Network,
                        "the model stream ended before the response completed",
                    )));
                }
                Some(Err(error)) => break Err(StepError::Provider(error)),
                Some(Ok(StreamEvent::Completed(mut response))) => {
                    if let Err(error) = response.check_completed(provider.id()) {
                        break Err(StepError::Provider(error));
                    }
                    ids.rename(
                        self.conversation,
                        &mut response.tool_calls,
                        &mut response.reasoning_blocks,
                    );
                    for started in observer.finish(&response) {
                        self.tool_call_started(started).await;
                    }
                    break Ok(response);
                }
                Some(Ok(StreamEvent::TextDelta(delta))) => {
                    live.push_text(&delta);
                    if !held {
                        self.emit_with(|| Event::TextDelta { text: delta });
                    }
                }
                Some(Ok(StreamEvent::ReasoningDelta(delta))) => {
                    if held {
                        live.push_reasoning(&delta);
                        continue;
                    }
                    if !thinking {
                        thinking = true;
                        self.emit_with(|| Event::ThinkingStart);
                    }
                    thought.push_str(&delta);
                    live.push_reasoning(&delta);
                    self.emit_with(|| Event::ThinkingDelta { delta });
                }
                Some(Ok(StreamEvent::ToolCallStarted { index, id, name })) => {
                    let id = ids.own(self.conversation, index, id);
                    if let Some(started) = observer.started(index, &id, &name) {
                        self.tool_call_started(started).await;
                    }
                }
                Some(Ok(StreamEvent::ToolCallArguments { index, delta })) => {
                    let started = observer.arguments(index, &delta);
                    // The fragment moves into the event: nothing is copied for nobody.
                    self.emit_with(|| Event::ToolcallDelta {
                        index,
                        tool_call_id: observer.id_of(index).to_owned(),
                        tool_name: observer.name_of(index).to_owned(),
                        argument_text_delta: delta,
                    });
                    if let Some(started) = started {
                        self.tool_call_started(started).await;
                    }
                }
            }
        };
        if thinking {
            self.emit_with(|| Event::ThinkingEnd { content: thought });
        }
        if ended.is_err() {
            // The calls announced while it streamed will not run (a retry streams its own):
            // whoever shows them running hears they ended.
            for (id, name) in observer.announced() {
                self.emit_thread_event(|| Event::ToolCallDone {
                    tool_call_id: id.to_owned(),
                    tool_name: name.to_owned(),
                    status: "error".to_owned(),
                });
            }
        }
        ended
    }

    /// Publishes a `tool_call_started` (the event, always; then the selected hooks).
    async fn tool_call_started(&self, started: observation::Started) {
        self.emit_thread_event(|| Event::ToolCallStarted {
            tool_call_id: started.id.clone(),
            tool_name: started.name.clone(),
            progress: started.progress.clone(),
        });
        self.tool_call_started_hooks(
            &started.id,
            &started.name,
            &started.arguments,
            started.progress.as_deref(),
        )
        .await;
    }

    /// Logs (a `warn` event and the log) the calls `queue_tool` asked for that the response
    /// ended without running, and forgets them.
    fn warn_unrun_queued_tools(&mut self) {
        let Some(view) = &self.thread else { return };
        let queued = view.take_queued_tools();
        // A step recorded with its batch and never run stays open in the stream: the next
        // response reads its calls' outcomes as unknown.
        let recorded = self.queued_step.take();
        let names: Vec<&str> = recorded
            .iter()
            .flat_map(|step| step.tools.iter().map(flue_core::Tool::name))
            .chain(queued.iter().map(|(tool, _)| tool.name()))
            .collect();
        if names.is_empty() {
            return;
        }
        let message = format!(
            "[flue] The response ended before running the tool calls queued with queue_tool: {}. Queue calls while the response can still run them (not after its last step).",
            names.join(", ")
        );
        tracing::warn!(instance = %self.key, submission = %self.submission.id, "{message}");
        self.logger().warn(message);
    }

    /// Runs the calls queued with `queue_tool` as a step of their own (stored as the calls of
    /// an assistant step without text or turn, then a tool batch; no model step, so not counted
    /// against `max_steps`), and then the calls those queued, until none is left (reference:
    /// the running tool queue, in the same flow); `None` when nothing was queued, else whether
    /// every result of the last batch asked to end the turn.
    async fn run_queued_tools(&mut self, rendered: &Rendered, spec: &str) -> Result<Option<bool>, Failure> {
        let mut terminated = None;
        self.queued_rounds = 0;
        loop {
            let step = match self.queued_step.take() {
                // Recorded with the batch that queued them (never past the ceiling).
                Some(step) => step,
                None => {
                    // After the abort no queued call starts (nor is recorded as a step): they
                    // stay queued, and are reported unrun. A response whose end was durable
                    // ends as it is (the abort lost the race); any other fails aborted.
                    if self.attempt.signal.is_aborted() {
                        if self.lost_race_to_abort() {
                            return Ok(terminated);
                        }
                        return Err(Failure::aborted());
                    }
                    let Some((records, step)) = self.queued_step_of(spec) else {
                        self.queued_rounds = 0;
                        return Ok(terminated);
                    };
                    // Past the ceiling the calls are taken from the queue and not recorded.
                    if self.queued_rounds >= MAX_QUEUED_TOOL_STEPS {
                        return Err(Failure::failed(
                            "queued_tool_ceiling",
                            format!(
                                "[flue] queue_tool calls queued more calls for {MAX_QUEUED_TOOL_STEPS} steps in a row without a model step — a runaway loop (a tool that queues itself?). The response is failing loudly instead of running until its deadline; queue a call only when it has new work to do."
                            ),
                        ));
                    }
                    self.commit(records, false).await?;
                    step
                }
            };
            self.check_abort()?;
            self.queued_rounds += 1;
            // The step is durable (with the batch that queued it, or just now): observers are
            // shown the assistant message whose calls the results below answer.
            self.stored_message_events(Some(&step.message_id));
            terminated = Some(
                self.tool_batch(rendered, &step.tools, &step.calls, step.message_id, &[], None)
                    .await?,
            );
        }
    }

    /// The calls queued with `queue_tool` (taken from the thread) as the records of a step of
    /// their own, and the step; `None` when nothing was queued.
    fn queued_step_of(&mut self, spec: &str) -> Option<(Vec<Record>, QueuedStep)> {
        let view = self.thread.as_ref()?;
        let queued = view.take_queued_tools();
        if queued.is_empty() {
            return None;
        }
        let message_id = new_id("msg");
        let calls: Vec<ModelToolCall> = queued
            .iter()
            .map(|(tool, args)| ModelToolCall {
                id: new_id("call"),
                name: tool.name().to_owned(),
                arguments: args.to_string(),
            })
            .collect();
        let mut records = vec![self.record(RecordBody::AssistantMessageStarted {
            message_id: message_id.clone(),
            model: spec.to_owned(),
            turn_id: None,
            response_metadata: None,
        })];
        for call in &calls {
            records.push(self.record(RecordBody::AssistantToolCall {
                message_id: message_id.clone(),
                tool_call_id: call.id.clone(),
                name: call.name.clone(),
                arguments: call.arguments.clone(),
            }));
        }
        records.push(self.record(RecordBody::AssistantMessageCompleted {
            message_id: message_id.clone(),
            text: String::new(),
            reasoning: String::new(),
            reasoning_blocks: Vec::new(),
            stop_reason: crate::provider::StopReason::ToolUse,
            usage: Usage::default(),
        }));
        let tools: Vec<flue_core::Tool> = queued.into_iter().map(|(tool, _)| tool).collect();
        Some((
            records,
            QueuedStep {
                message_id,
                calls,
                tools,
            },
        ))
    }

    /// Repairs a tool batch an earlier attempt left uncommitted (reference §3.9 step 7): when
    /// the response's last durable step has calls without outcomes and the current render
    /// declares some of their tools durable, those calls run again (the steps they settled
    /// replay their recorded values) and the batch commits with their outcomes, each other
    /// call getting the outcome-unknown result. Without a durable tool among them nothing runs
    /// here: the next model call sees every call's outcome-unknown result. `None` when no
    /// batch was open, else whether the batch ended the turn (every call's recorded outcome
    /// asked to terminate, reference §8.20).
    async fn rerun_durable_calls(&mut self, rendered: &Rendered) -> Result<Option<bool>, Failure> {
        let Some((step, _)) = self.conversation.open_calls() else {
            return Ok(None);
        };
        // The calls whose outcomes were recorded as they finished keep them (first write wins);
        // their rows are created by this attempt's commit, and their `after_create_message`
        // runs after it (their pre-write hooks ran as they were recorded).
        let (step, calls) = (step.to_owned(), self.conversation.unresolved_calls());
        let mut created_rows = self.conversation.recorded_outcome_rows();
        // The init render has no `task` tool (it waits for the model): an interrupted task
        // call re-runs — reattaching to its child — with the tools a turn's render mounts.
        let prepared;
        let rendered = if calls.iter().any(|call| call.name == "task")
            && !rendered.tools.iter().any(|tool| tool.name() == "task")
        {
            let mut fresh = self.render()?;
            self.repairing = true;
            let ready = self.prepare(&mut fresh).await;
            self.repairing = false;
            ready?;
            prepared = fresh;
            &prepared
        } else {
            rendered
        };
        let durable: Vec<flue_core::Tool> = rendered
            .tools
            .iter()
            .filter(|tool| tool.definition().durable)
            .cloned()
            .collect();
        let (rerun, unknown): (Vec<ModelToolCall>, Vec<ModelToolCall>) = calls
            .iter()
            .cloned()
            .partition(|call| durable.iter().any(|tool| tool.name() == call.name));
        if rerun.is_empty() {
            // Nothing runs again: the batch is settled in the stream with the outcome-unknown
            // results the model is told (reference §3.9 step 7), so readers of the stream see
            // the calls end and the response's committed calls include them.
            let bodies = self.conversation.interrupted_batch();
            let ended = calls_settled_unknown(&bodies);
            let records: Vec<Record> = bodies.into_iter().map(|body| self.record(body)).collect();
            created_rows.extend(
                records
                    .iter()
                    .filter(|record| matches!(record.body, RecordBody::ToolOutcome { .. }))
                    .map(|record| record.id.clone()),
            );
            self.commit(records, false).await?;
            self.tool_rows_created(&created_rows).await;
            announce_ended(self.runtime, self.key, &self.submission.id, &ended);
            return Ok(Some(self.conversation.batch_terminated()));
        }
        let terminated = self
            .tool_batch(rendered, &durable, &rerun, step, &unknown, None)
            .await?;
        self.tool_rows_created(&created_rows).await;
        let ended: Vec<(String, String)> = unknown.into_iter().map(|call| (call.id, call.name)).collect();
        announce_ended(self.runtime, self.key, &self.submission.id, &ended);
        Ok(Some(terminated))
    }

    /// Runs a step's tool `calls` against `tools` and commits the batch, with the
    /// outcome-unknown result for each of the step's `unknown` calls (interrupted calls that
    /// are not run again); returns whether every result asked to end the turn.
    async fn tool_batch(
        &mut self,
        rendered: &Rendered,
        tools: &[flue_core::Tool],
        calls: &[ModelToolCall],
        assistant_message_id: String,
        unknown: &[ModelToolCall],
        turn: Option<(&LazyId, &str)>,
    ) -> Result<bool, Failure> {
        let view = self.thread_view();
        view.set_tools(&rendered.tools);
        let thread = view.state();
        if let Some(crate::subagents::Delegating { delegation, .. }) = &self.delegation {
            // The batch's tasks record their children through the attempt; a re-run task
            // call finds the child it created.
            delegation.attach(crate::subagents::Journal::root(
                self.attempt.clone(),
                self.writer.clone(),
                self.conversation.retained_children(),
            ));
        }
        // With tool hooks selected, what is stored (and shown) is what their chain makes of
        // the result, which may redact it: its message events wait for the chain.
        let hooked = self.has_tool_hooks();
        let settled: Vec<SettledCall> = {
            let runtime = self.runtime;
            let key = self.key;
            let submission_id = self.submission.id.as_str();
            let log = self.log_base();
            let signal = &self.attempt.signal;
            let (attempt, conversation) = (self.attempt, &*self.conversation);
            let (hooks, writer, thread) = (&self.hooks, &self.writer, &thread);
            let assistant_message_id = assistant_message_id.as_str();
            // The calls run concurrently; their tool-result hook chains one call at a time, as
            // the calls end (the reference runs a step's calls in order): a hook that reads a
            // thread value and writes it back does not race the same hook of another call.
            let one_chain_at_a_time = &tokio::sync::Mutex::new(());
            tools::run_batch(
                tools,
                calls,
                runtime.options.tool_concurrency,
                signal,
                |tool, call: &ModelToolCall| {
                    let ctx = ToolContext::new(tool, call.id.clone())
                        .with_instance_id(key.id.to_string())
                        .with_signal(signal.clone())
                        .with_logger(tool_call_logger(&log, &call.name, &call.id))
                        .with_thread(thread.clone());
                    if !tool.definition().durable {
                        return ctx;
                    }
                    // A durable call's steps are recorded; a re-run replays the settled ones.
                    ctx.with_steps(Arc::new(binding::CallSteps {
                        attempt: attempt.clone(),
                        tool_call_id: call.id.clone(),
                        tool_name: call.name.clone(),
                        recorded: conversation.tool_steps(&call.id),
                    }))
                },
                |call: &ModelToolCall| {
                    runtime.emit_with(key, Some(submission_id), || Event::ToolStart {
                        tool_name: call.name.clone(),
                        tool_call_id: call.id.clone(),
                    });
                },
                |run: &tools::Executed| {
                    attempt
                        .ended_calls
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(run.call.id.clone());
                    runtime.emit_thread_event(key, Some(submission_id), || Event::ToolCallDone {
                        tool_call_id: run.call.id.clone(),
                        tool_name: run.call.name.clone(),
                        // A call the abort ended has no result: whatever it returned, it is
                        // not a success the conversation keeps.
                        status: if run.output.is_error || run.interrupted {
                            "error"
                        } else {
                            "success"
                        }
                        .to_owned(),
                    });
                    // The tool-result message, when the tool is done (its terminal `tool`
                    // event follows the batch's commit). A call the abort ended has none: its
                    // result is never stored (the settlement gives it the unknown outcome).
                    if !hooked && !run.interrupted && runtime.observed() {
                        let message = tool_message(run.call, run.output.to_text(), run.output.is_error);
                        emit_tool_message(runtime, key, submission_id, message);
                    }
                },
                |run: tools::Executed, last| async move {
                    // A call the abort ended records nothing: no chain runs for a result that is
                    // never stored (its outcome stays unknown).
                    if run.interrupted {
                        return SettledCall {
                            call: run.call,
                            duration_ms: run.duration_ms,
                            content: run.output.to_text(),
                            is_error: run.output.is_error,
                            row_id: None,
                            held: Vec::new(),
                            failed: None,
                        };
                    }
                    // The tool row's id is its outcome record's.
                    let row_id = hooked.then(|| new_id("record"));
                    let (content, is_error, updates) = match &row_id {
                        Some(row_id) => {
                            let chain = one_chain_at_a_time.lock().await;
                            let stored = lifecycle::tool_outcome(hooks, thread, &run, row_id).await;
                            drop(chain);
                            if runtime.observed() {
                                let message = tool_message(run.call, stored.content.clone(), stored.is_error);
                                emit_tool_message(runtime, key, submission_id, message);
                            }
                            (stored.content, stored.is_error, stored.updates)
                        }
                        None => (run.output.to_text(), run.output.is_error, Default::default()),
                    };
                    // The value the tool answered, while the row shows what it answered (a
                    // tool-result hook that rewrote it, or made it an error, leaves the text).
                    let output = run
                        .structured_output()
                        .filter(|_| !is_error && (row_id.is_none() || content == run.output.to_text()));
                    let mut outcome = writer.record(RecordBody::ToolOutcome {
                        assistant_message_id: assistant_message_id.to_owned(),
                        tool_call_id: run.call.id.clone(),
                        tool_name: run.call.name.clone(),
                        is_error,
                        content: content.clone(),
                        output,
                        // A result the tool hooks turned into an error does not end the turn:
                        // the model is to read it.
                        terminate: run.output.terminate && (run.output.is_error || !is_error),
                        duration_ms: run.duration_ms,
                    });
                    let mut batch = Vec::with_capacity(2);
                    if let Some(row_id) = &row_id {
                        outcome.id.clone_from(row_id);
                    }
                    batch.push(outcome);
                    // What the row's create hooks set goes with the row: a crash cannot keep the
                    // outcome and lose the changes (the hooks do not run again).
                    if let Some(row_id) = row_id.as_ref().filter(|_| !updates.is_empty()) {
                        batch.push(writer.record(RecordBody::MessageUpdated {
                            message_id: row_id.clone(),
                            updates,
                        }));
                    }
                    // The outcome is durable as the tool ends, while the others run on (reference
                    // §3.3): an attempt that ends before the batch commits keeps it, and the call
                    // is never run again. The batch's last call goes with the commit (one append
                    // fewer): an attempt that ends before that commit runs it again if durable,
                    // and gives it the unknown outcome otherwise. The data the tool wrote lands first; an attempt one of whose
                    // appends failed (a durable step's) records nothing more: it is re-attempted
                    // from what is durable, and the call runs again.
                    let mut failed = None;
                    let held = if last {
                        batch
                    } else {
                        match attempt.flush_data().await {
                            Err(error) => failed = Some(error),
                            Ok(()) => {
                                if let Err(error) = writer.append(batch.into()).await {
                                    failed = Some(error.to_string());
                                }
                            }
                        }
                        Vec::new()
                    };
                    SettledCall {
                        call: run.call,
                        duration_ms: run.duration_ms,
                        content,
                        is_error,
                        row_id,
                        held,
                        failed,
                    }
                },
            )
            .await
        };
        if let Some(error) = settled.iter().find_map(|call| call.failed.clone()) {
            return Err(Failure::store(error));
        }
        if let Err(failure) = self.check_abort() {
            // The calls that ended before the abort keep their outcomes (the batch is settled
            // with the submission, the others' outcomes unknown; a call the abort ended holds
            // none).
            let ended: Vec<Record> = settled.iter().flat_map(|call| call.held.iter().cloned()).collect();
            if !ended.is_empty() {
                self.commit(ended, false).await?;
            }
            return Err(failure);
        }
        let mut records = Vec::with_capacity(settled.len() + unknown.len() + 1);
        let mut rows = Vec::new();
        // The results as `turn_messages` and `agent_end` report them: copied only when someone
        // observes (an observer subscribing mid-batch gets no `turn_messages` for it).
        let mut results = self.runtime.observed().then(|| Vec::with_capacity(settled.len()));
        for call in &settled {
            rows.extend(call.row_id.iter().cloned());
            if let Some(results) = &mut results {
                results.push(tool_message(call.call, call.content.clone(), call.is_error));
            }
            records.extend(call.held.iter().cloned());
        }
        for call in unknown {
            let outcome = self.record(self.conversation.interrupted_outcome(&assistant_message_id, call));
            rows.push(outcome.id.clone());
            if let (Some(results), RecordBody::ToolOutcome { content, .. }) = (&mut results, &outcome.body) {
                results.push(tool_message(call, content.clone(), true));
            }
            records.push(outcome);
        }
        records.push(self.record(RecordBody::ToolResultsCommitted { assistant_message_id }));
        // Calls the batch's tools queued (`queue_tool`) commit with it, as a step of their own
        // that runs next: a crash before they run leaves them an open batch that recovery
        // settles, where in memory they were lost.
        let spec = self.model_spec.as_ref().map(|(spec, _)| spec.clone());
        let queued = match spec {
            Some(spec) if self.queued_step.is_none() && self.queued_rounds < MAX_QUEUED_TOOL_STEPS => {
                self.queued_step_of(&spec)
            }
            _ => None,
        };
        let tail = match queued {
            Some((records, step)) => {
                self.queued_step = Some(step);
                records
            }
            None => Vec::new(),
        };
        self.commit_then(records, true, tail).await?;
        self.tool_rows_created(&rows).await;
        for call in &settled {
            self.runtime
                .emit_with(self.key, Some(&self.submission.id), || Event::Tool {
                    tool_name: call.call.name.clone(),
                    tool_call_id: call.call.id.clone(),
                    is_error: call.is_error,
                    result: Some(call.content.clone()),
                    duration_ms: call.duration_ms,
                });
        }
        if let Some(tool_results) = &results {
            self.ended.extend(tool_results.iter().cloned());
        }
        if let (Some((turn_id, text)), Some(tool_results)) = (turn, results) {
            self.emit_with(|| Event::agent_turn_messages(turn_id, text.to_owned(), calls.to_vec(), tool_results));
        }
        if turn.is_some() {
            // The model turn ends with its batch.
            self.set_turn(None);
        }
        Ok(self.conversation.batch_terminated())
    }
}

/// Calls queued with `queue_tool`, stored as an assistant step of their own (its id), to run.
struct QueuedStep {
    message_id: String,
    calls: Vec<ModelToolCall>,
    tools: Vec<flue_core::Tool>,
}

/// A call of a tool batch once its tool ended and its outcome went through the hooks.
struct SettledCall<'c> {
    call: &'c ModelToolCall,
    duration_ms: u64,
    /// The result as stored.
    content: String,
    is_error: bool,
    /// Its tool row's id, when the tool hooks ran (the row's hooks follow the commit).
    row_id: Option<String>,
    /// Its outcome's records, when they go with the batch's commit (the last call's).
    held: Vec<Record>,
    /// Why its outcome's own append failed (or was not made).
    failed: Option<String>,
}

/// A user message's images as its record names them (ids from the submission, in order) and
/// as they are stored and shown to the model.
#[allow(clippy::type_complexity)]
fn attachments_of(
    submission_id: &str,
    attachments: &[flue_core::message::Attachment],
) -> Result<(Vec<AttachmentRef>, Vec<(AttachmentPut, ModelImage)>), Failure> {
    let mut refs = Vec::with_capacity(attachments.len());
    let mut images = Vec::with_capacity(attachments.len());
    for (index, attachment) in attachments.iter().enumerate() {
        let bytes = attachment
            .bytes()
            .map_err(|error| Failure::failed("invalid_request", error.to_string()))?;
        let image = ModelImage::from_bytes(attachment.mime_type(), &bytes);
        let put = AttachmentPut::new(format!("att_{submission_id}_{index}"), attachment.mime_type(), bytes);
        refs.push(AttachmentRef {
            id: put.id.clone(),
            media_type: put.media_type.clone(),
            size: put.size,
            filename: attachment.filename().map(str::to_owned),
        });
        images.push((put, image));
    }
    Ok((refs, images))
}

/// The tool-result message answering `call`.
/// The signals of `signals` whose create hooks kept them (`kept`, in order).
fn kept_signals(signals: Vec<Signal>, kept: &[bool]) -> Vec<Signal> {
    signals
        .into_iter()
        .zip(kept)
        .filter_map(|(signal, kept)| kept.then_some(signal))
        .collect()
}

fn tool_message(call: &ModelToolCall, content: String, is_error: bool) -> ModelMessage {
    ModelMessage::Tool {
        tool_call_id: call.id.clone(),
        name: call.name.clone(),
        content,
        is_error,
    }
}

/// A tool result's `message_start` and `message_end`.
fn emit_tool_message(runtime: &RuntimeInner, key: &InstanceKey, submission_id: &str, message: ModelMessage) {
    runtime.emit(
        key,
        Some(submission_id),
        Event::MessageStart {
            message: message.clone(),
        },
    );
    runtime.emit(key, Some(submission_id), Event::MessageEnd { message });
}

enum StepError {
    Aborted,
    Provider(crate::provider::ProviderError),
    /// Appending the step's streamed text failed.
    Store(crate::store::StoreError),
}

impl StepError {
    /// The failure as a `turn` event's `response.error`: the provider error's kind and message.
    fn describe(&self) -> SettlementError {
        match self {
            Self::Aborted => SettlementError::new("aborted", "The call was aborted."),
            Self::Provider(error) => SettlementError::new(error.error_type(), error.message.clone()),
            Self::Store(error) => SettlementError::new("store_failure", error.to_string()),
        }
    }
}

/// A `turn` event's `request`: the model a call asked for.
pub(crate) fn turn_request(provider: &dyn ModelProvider, model_id: &str, thinking: ThinkingLevel) -> TurnRequest {
    TurnRequest {
        provider: provider.id().to_owned(),
        model: model_id.to_owned(),
        thinking_level: thinking,
    }
}

/// The failure of a submission whose `hook` callback (`index` in declaration order, for the
/// seams that number them) panicked: the failure (`error_type`) its error would be.
fn callback_panicked(
    error_type: &str,
    hook: &str,
    index: Option<usize>,
    payload: &(dyn std::any::Any + Send),
) -> Failure {
    // Numbered from 0, as the reference numbers them.
    let which = index.map(|index| format!(" (hook #{index} in declaration order)"));
    Failure::failed(
        error_type,
        format!(
            "[flue] A {hook} callback{} panicked: {}",
            which.unwrap_or_default(),
            flue_core::render::panic_message(payload)
        ),
    )
}

/// The failure of a submission whose `hook` callback (`index` in declaration order) gave no
/// metadata: it returned something other than an object, or an error.
fn metadata_failure(hook: &str, index: usize, error: flue_core::event_hooks::MetadataError) -> Failure {
    use flue_core::event_hooks::MetadataError;
    let message = match error {
        MetadataError::NotAnObject(got) => {
            format!("[flue] A {hook} callback must return a plain object of metadata (or nothing) — got {got}.")
        }
        MetadataError::Failed(error) => {
            format!("[flue] A {hook} callback (hook #{index} in declaration order) threw: {error}")
        }
        other => other.to_string(),
    };
    Failure::failed("response_hook_failed", message)
}

/// The settlement error of a submission whose attempts ran out: `attempts` of `max`.
/// The settlement error of a spent attempt budget: an interruption before input when no
/// attempt applied the submission's input (no model call ever started), else retry
/// exhaustion.
fn budget_spent(input_applied: bool, attempts: u32, max: u32) -> SettlementError {
    if input_applied {
        return retry_exhausted(attempts, max);
    }
    let mut meta = serde_json::Map::new();
    meta.insert("phase".into(), "retry_exhausted_before_input".into());
    meta.insert("attemptCount".into(), attempts.into());
    meta.insert("maxAttempts".into(), max.into());
    let mut error = SettlementError::new(
        "submission_interrupted",
        "Submission was repeatedly interrupted before input application and exhausted its retry budget.",
    )
    .with_meta(meta);
    error.details = format!(
        "All {attempts} attempts ended before the submission's input was applied: it was never processed and no model call started."
    );
    error
}

/// `error` naming the tool `calls` whose outcomes no attempt confirmed (an interrupted batch
/// the budget ran out on): `meta.interruptedTools`, each `{name, id}`.
fn with_interrupted_tools(mut error: SettlementError, calls: &[ModelToolCall]) -> SettlementError {
    let tools: Vec<serde_json::Value> = calls
        .iter()
        .map(|call| serde_json::json!({"name": call.name, "id": call.id}))
        .collect();
    error
        .meta
        .get_or_insert_with(Default::default)
        .insert("interruptedTools".into(), tools.into());
    error
}

/// The advisory a terminal settlement leaves in the conversation (reference §3.9), its record
/// id and body: a signal that tells the model of a later response why this submission ended,
/// when it was aborted (`submission_aborted`) or interrupted for good, its attempts or its
/// time spent (`submission_interrupted`). Either names the `interrupted` tool calls, whose
/// outcomes are unknown, in its body and its `interruptedTools` attribute (JSON text).
/// Any other failure is the submission's own, in its records already: none.
fn terminal_advisory(
    submission: &Submission,
    outcome: Outcome,
    error: &SettlementError,
    interrupted: &[ModelToolCall],
) -> Option<(String, RecordBody)> {
    use std::fmt::Write as _;
    let (signal_type, reason) = match (outcome, error.error_type.as_str()) {
        (Outcome::Aborted, _) => ("submission_aborted", "aborted"),
        (_, "submission_retry_exhausted") => ("submission_interrupted", "exhausted_retry_budget"),
        (_, "submission_timeout") => ("submission_interrupted", "exceeded_timeout"),
        (_, "submission_interrupted") => ("submission_interrupted", "interrupted_before_input_marker"),
        _ => return None,
    };
    let mut body = error.message.clone();
    if !interrupted.is_empty() {
        body.push_str("\n\nInterrupted tool call(s):");
        for call in interrupted {
            let _ = write!(body, "\n  - {} ({})", call.name, call.id);
        }
    }
    let kind = match submission.kind {
        SubmissionKind::Direct => "direct",
        SubmissionKind::Dispatch => "dispatch",
    };
    let mut attributes = std::collections::BTreeMap::from([
        ("submissionId".to_owned(), submission.id.clone()),
        ("kind".to_owned(), kind.to_owned()),
        ("reason".to_owned(), reason.to_owned()),
    ]);
    if !interrupted.is_empty() {
        let tools: Vec<serde_json::Value> = interrupted
            .iter()
            .map(|call| serde_json::json!({"name": call.name, "id": call.id}))
            .collect();
        attributes.insert(
            "interruptedTools".to_owned(),
            serde_json::Value::from(tools).to_string(),
        );
    }
    Some((
        format!("record_{signal_type}_{}", submission.id),
        RecordBody::Signal {
            message_id: format!("entry_{signal_type}_{}", submission.id),
            signal_type: signal_type.to_owned(),
            body,
            attributes,
            tag_name: None,
        },
    ))
}

fn retry_exhausted(attempts: u32, max: u32) -> SettlementError {
    let mut meta = serde_json::Map::new();
    meta.insert("attemptCount".into(), attempts.into());
    meta.insert("maxAttempts".into(), max.into());
    SettlementError::new(
        "submission_retry_exhausted",
        format!("Submission exceeded maximum recovery attempts ({attempts}/{max})."),
    )
    .with_meta(meta)
}

/// The failure of a submission whose budget ran out.
fn timed_out() -> Failure {
    let mut failure = Failure::failed("submission_timeout", TIMEOUT_MESSAGE);
    failure.error.details = "The operation ran longer than the configured durability timeout.".to_owned();
    failure
}

const TIMEOUT_MESSAGE: &str = "Submission exceeded the configured timeout.";

/// When the submission's budget runs out. The budget runs from the first claim across every
/// attempt: a re-attempt after a crash inherits what is left of it.
fn deadline_of(submission: &Submission, timeout: Duration) -> Instant {
    let left = match submission.timeout_at_ms {
        0 => timeout,
        at => Duration::from_millis(at.saturating_sub(crate::store::now_ms())),
    };
    later_by(left)
}

/// `Instant::now()` plus `wait`, or about a century from now for a wait no clock can add
/// (a budget of `Duration::MAX` means none).
pub(crate) fn later_by(wait: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(wait)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// The calls (id and tool name) that `bodies` settle with the outcome-unknown result.
fn calls_settled_unknown(bodies: &[RecordBody]) -> Vec<(String, String)> {
    bodies
        .iter()
        .filter_map(|body| match body {
            RecordBody::ToolOutcome {
                tool_call_id,
                tool_name,
                ..
            } => Some((tool_call_id.clone(), tool_name.clone())),
            _ => None,
        })
        .collect()
}

/// Tells whoever shows `calls` running (announced by `tool_call_started`, by this attempt or
/// one that ended before reporting them: a crash, a store failure after their step was stored)
/// that they ended, in error: their batch was settled with the outcome-unknown result, and
/// they will not run.
fn announce_ended(runtime: &RuntimeInner, key: &InstanceKey, submission_id: &str, calls: &[(String, String)]) {
    for (id, name) in calls {
        runtime.emit_thread_event(key, Some(submission_id), || Event::ToolCallDone {
            tool_call_id: id.clone(),
            tool_name: name.clone(),
            status: "error".to_owned(),
        });
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use super::*;

    /// What an admission owes a worker: nothing once refused or announced; an announcement
    /// once dropped mid-way (it may have committed), until a worker claims it. A slot owing
    /// one is kept cached (see `evict_idle`).
    #[test]
    fn an_admission_owes_its_announcement_only_when_given_up_mid_way() {
        let slot = InstanceSlot::new(InstanceKey::new("a", "i"), Weak::new());
        let binding = slot.binding();
        let owes = || binding.owes_announcements(Duration::MAX);
        binding.admitting("sub_refused").refused();
        assert!(!owes());
        let announced = std::cell::Cell::new(0);
        binding
            .admitting("sub_answered")
            .announce(false, || announced.set(announced.get() + 1));
        assert_eq!(announced.get(), 1);
        assert!(!owes());
        drop(binding.admitting("sub_dropped"));
        assert!(owes());
        binding.announce_claimed("sub_dropped", || announced.set(announced.get() + 1));
        assert_eq!(announced.get(), 2);
        assert!(!owes());
        binding.announce_claimed("sub_dropped", || announced.set(announced.get() + 1));
        assert_eq!(announced.get(), 2, "announced once");
    }

    /// An admission given up mid-way that no worker here claims (it never committed, or
    /// another node ran it) is forgotten past the horizon, so it stops pinning its slot in the
    /// cache; one still in progress is owed whatever its age.
    #[test]
    fn an_orphaned_admission_is_forgotten_past_the_horizon_and_one_in_progress_is_not() {
        let slot = InstanceSlot::new(InstanceKey::new("a", "i"), Weak::new());
        let binding = slot.binding();
        drop(binding.admitting("sub_never_committed"));
        assert!(
            binding.owes_announcements(Duration::from_secs(3600)),
            "within the horizon"
        );
        assert!(!binding.owes_announcements(Duration::ZERO), "past it");
        assert!(
            !binding.owes_announcements(Duration::MAX),
            "forgotten for good, not only passed over"
        );
        let in_progress = binding.admitting("sub_waiting");
        assert!(binding.owes_announcements(Duration::ZERO));
        let announced = std::cell::Cell::new(0);
        // A worker that claims the forgotten one has nothing of it to announce.
        binding.announce_claimed("sub_never_committed", || announced.set(announced.get() + 1));
        assert_eq!(announced.get(), 0);
        in_progress.announce(false, || announced.set(announced.get() + 1));
        assert_eq!(announced.get(), 1);
        assert!(!binding.owes_announcements(Duration::MAX));
    }

    fn attempt(id: &str) -> Arc<Attempt> {
        Arc::new(Attempt {
            attempt: AttemptRef {
                submission_id: format!("sub_{id}"),
                attempt_id: id.to_owned(),
            },
            buffer: Mutex::new(StateBuffer::new(Arc::default())),
            data: Mutex::default(),
            data_order: tokio::sync::Mutex::new(()),
            writer: std::sync::OnceLock::new(),
            signal: AbortSignal::new(),
            responding: AtomicBool::new(true),
            ended_calls: Mutex::default(),
            tasks: tokio::runtime::Handle::try_current().ok(),
        })
    }

    /// An abort of more unsettled submissions than the slot remembers still reaches the
    /// attempt about to start: the queue's head, the oldest of them.
    #[tokio::test]
    async fn an_abort_of_many_submissions_reaches_the_head_about_to_start() {
        let slot = Arc::new(InstanceSlot::new(InstanceKey::new("a", "i"), Weak::new()));
        let ids: Vec<String> = (0..70).map(|n| format!("sub_{n}")).collect();
        slot.binding.abort_submissions(&ids);
        assert_eq!(
            slot.binding.start(attempt("0")),
            Some(binding::ABORTED),
            "the head's abort was remembered"
        );
    }

    /// A stop (an abort another node requested, a lease another node took over) for an
    /// attempt held here but not started reaches it as it starts, the first reason kept; a
    /// running attempt's signal fires; an attempt no longer held is left alone.
    #[tokio::test]
    async fn a_stop_for_an_attempt_about_to_start_is_seen_as_it_starts() {
        let slot = Arc::new(InstanceSlot::new(InstanceKey::new("a", "i"), Weak::new()));
        slot.binding.hold("0".to_owned());
        slot.stop_attempt("0", binding::ABORTED);
        assert_eq!(slot.binding.start(attempt("0")), Some(binding::ABORTED));
        slot.binding.hold("1".to_owned());
        slot.stop_attempt("1", binding::LEASE_LOST);
        slot.stop_attempt("1", binding::ABORTED);
        assert_eq!(slot.binding.start(attempt("1")), Some(binding::LEASE_LOST));
        let running = slot.binding.current().unwrap();
        assert!(!running.signal.is_aborted());
        slot.stop_attempt("1", binding::ABORTED);
        assert_eq!(running.signal.reason(), Some(binding::ABORTED));
        slot.binding.hold("2".to_owned());
        slot.binding.release("2");
        slot.stop_attempt("2", binding::ABORTED);
        assert_eq!(slot.binding.start(attempt("2")), None);
    }

    /// A task dropped after it gave the instance's worker role up (a send cancelled while it
    /// looked at the queue a last time) leaves alone the worker that took the role over: its
    /// attempt stays current (held for the heartbeat, reachable by aborts) and the role stays
    /// its own. A task dropped while it holds the role gives both back.
    #[tokio::test]
    async fn a_task_dropped_after_giving_up_the_worker_role_leaves_the_next_worker_alone() {
        let slot = Arc::new(InstanceSlot::new(InstanceKey::new("a", "i"), Weak::new()));
        // Another worker took the role over and started its attempt.
        slot.busy.store(true, Ordering::SeqCst);
        slot.binding.set_current(Some(attempt("attempt_w")));
        drop(Abandoned {
            slot: slot.clone(),
            attempt: None,
            armed: true,
            holds_role: false,
        });
        assert!(slot.busy.load(Ordering::SeqCst), "the role stays the other worker's");
        assert_eq!(
            slot.binding.current().map(|current| current.attempt.attempt_id.clone()),
            Some("attempt_w".to_owned())
        );
        drop(Abandoned {
            slot: slot.clone(),
            attempt: None,
            armed: true,
            holds_role: true,
        });
        assert!(!slot.busy.load(Ordering::SeqCst), "given back by the task that held it");
        assert!(slot.binding.current().is_none());
    }
}
