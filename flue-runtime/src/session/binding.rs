//! The runtime side of the render model's writers: setters, data writers and the dispatcher
//! resolve the instance's current attempt when they are called.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use flue_core::BoxFuture;
use flue_core::abort::AbortSignal;
use flue_core::binding::{DataWriteError, DispatchError, RuntimeBinding, StateModify, StateWriteError};
use flue_core::message::{DeliveredMessage, DispatchReceipt};
use flue_core::state::StateBuffer;
use serde_json::Value;

use crate::events::Event;
use crate::record::RecordBody;
use crate::runtime::{RuntimeError, RuntimeInner, SendRequest};
use crate::store::{AttemptRef, InstanceKey, SubmissionKind};

/// One attempt at one submission: its write buffer, its queued data writes, its abort signal.
pub(crate) struct Attempt {
    pub(crate) attempt: AttemptRef,
    pub(crate) buffer: Mutex<StateBuffer>,
    pub(crate) data: Mutex<DataQueue>,
    /// Held while the queue's writes are appended: one batch per write, in write order.
    pub(crate) data_order: tokio::sync::Mutex<()>,
    /// The attempt's writer, through which data writes are appended.
    pub(crate) writer: std::sync::OnceLock<Arc<crate::lifecycle::thread::ThreadWriter>>,
    pub(crate) signal: AbortSignal,
    pub(crate) responding: AtomicBool,
    /// The calls whose `tool_call_done` this attempt published as they ended: a settlement
    /// that gives one of them the outcome-unknown result (an abort ended it, or its batch
    /// never committed) does not announce its end again.
    pub(crate) ended_calls: Mutex<Vec<String>>,
    /// The runtime the attempt runs on, where a data write made on any thread (a tool's own
    /// `std::thread`, a rayon pool) is flushed at once.
    pub(crate) tasks: Option<tokio::runtime::Handle>,
}

impl InstanceBinding {
    /// Counts a batch appended to the stream and wakes its live readers.
    pub(crate) fn note_append(&self) {
        self.appends.fetch_add(1, Ordering::AcqRel);
        self.appended.notify_waiters();
    }
}

impl Attempt {
    pub(crate) fn buffer(&self) -> MutexGuard<'_, StateBuffer> {
        self.buffer.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn data(&self) -> MutexGuard<'_, DataQueue> {
        self.data.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Queues a data write; once the response has a durable step it is appended at once
    /// (its own batch, in write order), from whatever thread it was made on. One flusher at a
    /// time drains the queue: a burst of writes against a slow store waits as writes, not as
    /// a parked task each.
    fn queue_data(self: &Arc<Self>, name: String, data: Value) {
        let spawn = {
            let mut queue = self.data();
            if queue.closed {
                return;
            }
            queue.pending.push_back((name, data));
            let spawn = queue.live && !queue.flushing;
            queue.flushing |= spawn;
            spawn
        };
        if !spawn {
            return;
        }
        let handle = self
            .tasks
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok());
        let Some(handle) = handle else {
            // No runtime to flush on: the response's next commit flushes it.
            self.data().flushing = false;
            return;
        };
        let attempt = self.clone();
        handle.spawn(async move {
            loop {
                let _ = attempt.flush_data().await;
                let mut queue = attempt.data();
                // A write queued while the flush ended found a flusher and spawned none.
                if queue.pending.is_empty() || queue.closed || !queue.live || queue.failed.is_some() {
                    queue.flushing = false;
                    return;
                }
            }
        });
    }

    /// From now on data writes stream as they are made (the response's first step is
    /// durable: the writes made before it are flushed by the next [`Attempt::flush_data`]).
    pub(crate) fn stream_data(&self) {
        self.data().live = true;
    }

    /// Appends the queued data writes, one batch each, in order (a no-op before the
    /// response's first durable step: the writes wait for it). Fails when one of the
    /// attempt's data writes could not be appended.
    pub(crate) async fn flush_data(&self) -> Result<(), String> {
        let _order = self.data_order.lock().await;
        loop {
            let next = {
                let mut queue = self.data();
                if let Some(error) = &queue.failed {
                    return Err(error.clone());
                }
                if queue.closed || !queue.live {
                    return Ok(());
                }
                queue.pending.pop_front()
            };
            let Some((name, data)) = next else {
                return Ok(());
            };
            let Some(writer) = self.writer.get() else {
                return Ok(());
            };
            let batch: Arc<[crate::record::Record]> =
                vec![writer.record(RecordBody::MessageDataWrite { name, data })].into();
            if let Err(error) = writer.append(batch.clone()).await {
                let mut queue = self.data();
                queue.failed = Some(error.to_string());
                queue.closed = true;
                queue.pending.clear();
                return Err(error.to_string());
            }
            // Durable now: clients see the part (live and on the stream) only from here, so a
            // write a failed attempt dropped is never observed.
            if let Some(RecordBody::MessageDataWrite { name, data }) = batch.first().map(|record| &record.body) {
                writer.emit_with(|| Event::DataPart {
                    name: name.clone(),
                    data: data.clone(),
                });
            }
        }
    }

    /// An append the attempt made outside its response's batches (a durable tool's step)
    /// failed: the response's next batch fails too, so the attempt is re-attempted from what
    /// is durable. Later data writes are dropped.
    pub(crate) fn fail_appends(&self, error: String) {
        let mut queue = self.data();
        queue.failed.get_or_insert(error);
        queue.closed = true;
        queue.pending.clear();
    }

    /// Why one of the attempt's appends outside its response's batches failed, if one did:
    /// the attempt is then over, and nothing more is recorded for it (a task's child
    /// conversation included).
    pub(crate) fn failed_append(&self) -> Option<String> {
        self.data().failed.clone()
    }

    /// A failed attempt's queued data writes are dropped; waits for an append in flight.
    pub(crate) async fn close_data(&self) {
        {
            let mut queue = self.data();
            queue.closed = true;
            queue.pending.clear();
        }
        drop(self.data_order.lock().await);
    }
}

/// The journal of one durable tool call's steps ([`flue_core::tool::ToolSteps`]): the values
/// earlier runs of the call settled (from the conversation's fold), and the attempt, through
/// whose writer a newly settled step is appended as a batch of its own before the step returns.
pub(crate) struct CallSteps {
    pub(crate) attempt: Arc<Attempt>,
    pub(crate) tool_call_id: String,
    pub(crate) tool_name: String,
    pub(crate) recorded: std::collections::HashMap<String, Value>,
}

impl flue_core::tool::ToolSteps for CallSteps {
    fn recorded(&self, step_name: &str) -> Option<Value> {
        self.recorded.get(step_name).cloned()
    }

    fn record(&self, step_name: &str, value: Value) -> BoxFuture<'_, Result<(), String>> {
        let step_name = step_name.to_owned();
        Box::pin(async move {
            let Some(writer) = self.attempt.writer.get() else {
                return Err("the attempt has no writer".to_owned());
            };
            let record = writer.record(crate::record::RecordBody::ToolStepSettled {
                tool_call_id: self.tool_call_id.clone(),
                tool_name: self.tool_name.clone(),
                step_name,
                value,
            });
            match writer.append(vec![record].into()).await {
                Ok(_) => Ok(()),
                Err(error) => {
                    self.attempt.fail_appends(error.to_string());
                    Err(error.to_string())
                }
            }
        })
    }
}

/// An attempt's data writes waiting to be appended.
#[derive(Default)]
pub(crate) struct DataQueue {
    pending: std::collections::VecDeque<(String, Value)>,
    /// Whether the response has a durable step (writes before it wait for it).
    live: bool,
    /// The attempt is over (failed): later writes are dropped.
    closed: bool,
    /// Why a data write's append failed.
    failed: Option<String>,
    /// Whether a spawned flusher drains the queue (see `Attempt::queue_data`).
    flushing: bool,
}

/// The reason an aborted attempt's signal carries.
pub(crate) const ABORTED: &str = "Submission was aborted.";

/// Why an attempt given back to the queue ([`crate::Runtime::release`]) stops here: its
/// submission runs again elsewhere, so this attempt settles nothing.
pub(crate) const RELEASED: &str = "The attempt was given back to the queue.";

/// Why an attempt whose lease another node took over (this node's renewals failed past the
/// lease: a partition, a suspended process) stops here: the other node runs its submission
/// from what is durable, and this attempt settles nothing.
pub(crate) const LEASE_LOST: &str = "The attempt's lease was taken over by another node.";

/// Whether an attempt stopped for `reason` hands its submission over (given back to the
/// queue, or taken over by another node) rather than ending it: it settles nothing.
pub(crate) fn hands_over(reason: Option<&str>) -> bool {
    matches!(reason, Some(RELEASED | LEASE_LOST))
}

/// An attempt this node claimed or took over that has not started, with why it was stopped
/// before it could be signalled (an abort another node requested, a lease lost), if it was.
#[derive(Clone, Debug)]
pub(crate) struct Starting {
    attempt_id: String,
    stopped: Option<&'static str>,
}

/// An instance's binding: its current attempt, leases and appends. The renders of an attempt
/// write through an `AttemptBinding` over it.
pub(crate) struct InstanceBinding {
    pub(crate) key: InstanceKey,
    pub(crate) runtime: Weak<RuntimeInner>,
    /// Woken after every batch this node appends to the instance's stream (live readers).
    pub(crate) appended: tokio::sync::Notify,
    /// Batches this node appended to the stream: a reader that saw this count has seen them.
    pub(crate) appends: std::sync::atomic::AtomicU64,
    pub(crate) current: Mutex<Option<Arc<Attempt>>>,
    /// Submissions an abort was requested for while none of their attempts ran here: a
    /// worker may be between their claim and their start (newest last, a few kept).
    pub(crate) pending_aborts: Mutex<std::collections::VecDeque<String>>,
    /// Attempts of the instance this node claimed or took over that have not started (a
    /// takeover waits for the worker role): their leases are this node's to renew, or they
    /// lapse before the attempts run and the scan takes them over though this node is alive.
    pub(crate) starting: Mutex<Vec<Starting>>,
    /// Queued deliveries a `before_create_message` hook prevented while a response joined
    /// them, with why (newest last, a few kept): processed on their own afterwards, they fail
    /// with that error without their row's hooks running again (reference item 30: a
    /// prevented queued message leaves the queue). Held by this node's slot only: processed
    /// on another node, after a restart, once the idle slot was dropped or past [`PREVENTED`]
    /// of them, the delivery's hooks run again (at least once, as `tests/CONFORMANCE.md` item
    /// 30 says).
    pub(crate) prevented: Mutex<std::collections::VecDeque<(String, crate::record::SettlementError)>>,
    /// Admissions to the instance this node made whose `submission_queued` is not yet
    /// announced (see [`InstanceBinding::admitting`]).
    pub(crate) unannounced: Mutex<Vec<Unannounced>>,
}

/// An admission whose `submission_queued` is still owed (see [`InstanceBinding::admitting`]).
pub(crate) struct Unannounced {
    submission_id: String,
    /// The admission this entry belongs to (`None` once its caller is gone).
    token: Option<u64>,
    /// Whether a worker that claimed the submission announced it.
    announced: bool,
    /// When its caller gave it up (an orphan): past [`InstanceBinding::owes_announcements`]'
    /// horizon it is forgotten.
    orphaned_at: Option<std::time::Instant>,
}

/// How many admissions given up mid-way an instance keeps owing an announcement for (oldest
/// forgotten first): one whose caller was dropped may still have committed.
const ORPHANED_ADMISSIONS: usize = 64;

/// Frees the list's memory once nothing is owed: every cached instance keeps one, mostly empty.
fn release_if_empty(owed: &mut Vec<Unannounced>) {
    if owed.is_empty() && owed.capacity() > 0 {
        *owed = Vec::new();
    }
}

/// An admission in progress (see [`InstanceBinding::admitting`]).
pub(crate) struct Admitting {
    binding: Arc<InstanceBinding>,
    token: u64,
    finished: bool,
}

impl Admitting {
    /// Announces the admission through `announce` (`submission_queued`), unless a worker
    /// that claimed it did already; a replay (`deduplicated`) is announced again either way.
    /// Under the instance's lock, so a worker that claims the submission now waits for it
    /// (`announce` only publishes to the runtime's broadcast channels: nothing under the lock
    /// calls back into an admission).
    pub(crate) fn announce(mut self, deduplicated: bool, announce: impl FnOnce()) {
        self.finished = true;
        let mut owed = self.binding.unannounced();
        let at = owed.iter().position(|entry| entry.token == Some(self.token));
        let announced = at.is_some_and(|at| owed.remove(at).announced);
        if deduplicated || !announced {
            announce();
        }
        release_if_empty(&mut owed);
    }
}

impl Admitting {
    /// The store refused the admission (nothing was queued): nothing is owed.
    pub(crate) fn refused(mut self) {
        self.finished = true;
        let mut owed = self.binding.unannounced();
        owed.retain(|entry| entry.token != Some(self.token));
        release_if_empty(&mut owed);
    }
}

impl Drop for Admitting {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        // Given up (a failed admission, or its caller dropped mid-way): if it committed, the
        // worker that claims it owes its announcement. A few are kept.
        let mut owed = self.binding.unannounced();
        let Some(at) = owed.iter().position(|entry| entry.token == Some(self.token)) else {
            return;
        };
        if owed[at].announced {
            owed.remove(at);
            release_if_empty(&mut owed);
            return;
        }
        owed[at].token = None;
        owed[at].orphaned_at = Some(std::time::Instant::now());
        let orphans = owed.iter().filter(|entry| entry.token.is_none()).count();
        if orphans > ORPHANED_ADMISSIONS
            && let Some(oldest) = owed.iter().position(|entry| entry.token.is_none())
        {
            owed.remove(oldest);
        }
    }
}

/// How many aborted submission ids an instance remembers for an attempt about to start.
const PENDING_ABORTS: usize = 64;

/// How many prevented deliveries an instance remembers (see [`InstanceBinding::prevented`]).
const PREVENTED: usize = 64;

impl InstanceBinding {
    fn unannounced(&self) -> std::sync::MutexGuard<'_, Vec<Unannounced>> {
        self.unannounced.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Notes an admission of `submission_id` this node is about to make. Its caller announces
    /// it once the store answers ([`Admitting::announce`]); a worker that claims the
    /// submission first (another thread, the moment the admission commits) announces it
    /// itself before any other event of it ([`Self::announce_claimed`]), so observers never
    /// see a submission run before it was queued, nor miss its queueing when the admission's
    /// caller was dropped after the commit.
    pub(crate) fn admitting(self: &Arc<Self>, submission_id: &str) -> Admitting {
        static TOKENS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let token = TOKENS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.unannounced().push(Unannounced {
            submission_id: submission_id.to_owned(),
            token: Some(token),
            announced: false,
            orphaned_at: None,
        });
        Admitting {
            binding: self.clone(),
            token,
            finished: false,
        }
    }

    /// Whether admissions here still owe their announcement (in progress, or given up
    /// mid-way less than `horizon` ago): the slot then stays cached (evicted, its worker would
    /// find nothing owed). Orphans older than that are forgotten: most never committed (an
    /// admission that failed, or whose caller left before the store answered), and one that
    /// did was claimed by then, here (which announced it) or by another node. Without the
    /// horizon every failed admission would pin its instance in the cache for good.
    pub(crate) fn owes_announcements(&self, horizon: std::time::Duration) -> bool {
        let mut owed = self.unannounced();
        owed.retain(|entry| entry.orphaned_at.is_none_or(|orphaned| orphaned.elapsed() < horizon));
        release_if_empty(&mut owed);
        !owed.is_empty()
    }

    /// Called by a worker that claimed `submission_id` (to run it or to join it), before it
    /// emits any event of it: announces it through `announce` if an admission of it here has
    /// not been announced yet (its caller still waits for the store, or was dropped).
    pub(crate) fn announce_claimed(&self, submission_id: &str, announce: impl FnOnce()) {
        let mut owed = self.unannounced();
        let mut owes = false;
        owed.retain_mut(|entry| {
            if entry.submission_id != submission_id || entry.announced {
                return true;
            }
            owes = true;
            // The admission's caller removes its own entry; an orphan's is done with.
            entry.announced = true;
            entry.token.is_some()
        });
        if owes {
            announce();
        }
        release_if_empty(&mut owed);
    }

    /// Remembers that a hook prevented the row of the queued delivery `submission_id`.
    pub(crate) fn note_prevented(&self, submission_id: &str, error: crate::record::SettlementError) {
        let mut prevented = self.prevented.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if prevented.len() == PREVENTED {
            prevented.pop_front();
        }
        prevented.push_back((submission_id.to_owned(), error));
    }

    /// Why a hook prevented the row of `submission_id` while it was joined, if one did here;
    /// forgotten when `forget` (the delivery settles with it).
    pub(crate) fn prevented(&self, submission_id: &str, forget: bool) -> Option<crate::record::SettlementError> {
        let mut prevented = self.prevented.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let at = prevented.iter().position(|(id, _)| id == submission_id)?;
        if forget {
            prevented.remove(at).map(|(_, error)| error)
        } else {
            prevented.get(at).map(|(_, error)| error.clone())
        }
    }

    pub(crate) fn current(&self) -> Option<Arc<Attempt>> {
        self.current
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    pub(crate) fn set_current(&self, attempt: Option<Arc<Attempt>>) {
        *self.current.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = attempt;
    }

    /// The attempts whose leases this node holds for the instance: the running one and those
    /// about to start.
    pub(crate) fn held_attempts(&self) -> Vec<String> {
        // Read under the lock `start` moves an attempt from starting to running under: an
        // attempt is seen in one of the two, never in neither.
        let current = self.current.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut held: Vec<String> = self
            .starting
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
            .map(|starting| starting.attempt_id.clone())
            .collect();
        held.extend(current.as_ref().map(|attempt| attempt.attempt.attempt_id.clone()));
        held
    }

    /// Holds the lease of `attempt_id`, claimed or taken over, until it starts (or
    /// [`release`](Self::release)).
    pub(crate) fn hold(&self, attempt_id: String) {
        let mut starting = self.starting.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !starting.iter().any(|held| held.attempt_id == attempt_id) {
            starting.push(Starting {
                attempt_id,
                stopped: None,
            });
        }
    }

    /// Stops holding `attempt_id` as about to start (a no-op once it started).
    pub(crate) fn release(&self, attempt_id: &str) {
        self.starting
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .retain(|held| held.attempt_id != attempt_id);
    }

    /// Makes `attempt` the running one; returns why it was stopped since its claim, before
    /// it ran (so no signal reached it): [`ABORTED`] when an abort of its submission was
    /// requested, through this node or another; [`LEASE_LOST`] when another node took its
    /// lease over.
    pub(crate) fn start(&self, attempt: Arc<Attempt>) -> Option<&'static str> {
        let mut current = self.current.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let submission = attempt.attempt.submission_id.clone();
        let mut stopped = None;
        self.starting
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .retain(|held| {
                let started = held.attempt_id == attempt.attempt.attempt_id;
                if started {
                    stopped = held.stopped;
                }
                !started
            });
        *current = Some(attempt);
        let mut pending = self
            .pending_aborts
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let requested = pending.iter().position(|id| *id == submission);
        let requested = requested.and_then(|at| pending.remove(at)).is_some();
        stopped.or(requested.then_some(ABORTED))
    }

    /// An abort was requested for `submissions`: the running attempt is signalled when its
    /// submission is one of them; the others are remembered for an attempt about to start.
    pub(crate) fn abort_submissions(&self, submissions: &[String]) {
        let current = self.current.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let running = current.as_ref().map(|attempt| attempt.attempt.submission_id.as_str());
        if let Some(attempt) = current.as_ref()
            && submissions.contains(&attempt.attempt.submission_id)
        {
            attempt.signal.abort(ABORTED);
        }
        let mut pending = self
            .pending_aborts
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // The oldest of them first (the store lists them in admission order): the queue's
        // head, which an attempt may be about to start, is kept when there are more than the
        // memory holds (the others are claimed later, their rows already stamped).
        for id in submissions
            .iter()
            .filter(|id| Some(id.as_str()) != running)
            .take(PENDING_ABORTS)
        {
            if !pending.contains(id) {
                pending.push_back(id.clone());
            }
        }
        while pending.len() > PENDING_ABORTS {
            pending.pop_front();
        }
    }

    /// Stops the attempt `attempt_id` for `reason` ([`ABORTED`], [`LEASE_LOST`]): fires its
    /// signal when it runs; remembers why when it is about to start (see [`Self::start`]).
    pub(crate) fn stop_attempt(&self, attempt_id: &str, reason: &'static str) {
        // Under the lock `start` moves an attempt from starting to running under: the stop
        // reaches it in one of the two.
        let current = self.current.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(attempt) = current.as_ref()
            && attempt.attempt.attempt_id == attempt_id
        {
            attempt.signal.abort(reason);
            return;
        }
        let mut starting = self.starting.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(held) = starting.iter_mut().find(|held| held.attempt_id == attempt_id) {
            held.stopped.get_or_insert(reason);
        }
    }

    /// Stops the running attempt `attempt_id`, whose submission was given back to the queue.
    pub(crate) fn release_attempt(&self, attempt_id: &str) {
        if let Some(attempt) = self.current()
            && attempt.attempt.attempt_id == attempt_id
        {
            attempt.signal.abort(RELEASED);
        }
    }

    /// Admits `message` to the instance as a dispatch, and wakes its worker.
    pub(crate) fn dispatch(
        &self,
        message: DeliveredMessage,
    ) -> BoxFuture<'static, Result<DispatchReceipt, DispatchError>> {
        let runtime = self.runtime.clone();
        let key = self.key.clone();
        Box::pin(async move {
            let runtime = runtime.upgrade().ok_or_else(|| DispatchError::RuntimeUnavailable {
                reason: "the runtime was dropped".into(),
            })?;
            let request = SendRequest::new(key.id.to_string(), message);
            match runtime.admit(&key.agent, request, SubmissionKind::Dispatch).await {
                Ok((receipt, _)) => {
                    runtime.slot(&key).wake();
                    Ok(receipt)
                }
                Err(RuntimeError::InvalidMessage(error)) => Err(DispatchError::InvalidMessage(error)),
                Err(error) => Err(DispatchError::Admission {
                    reason: error.to_string(),
                }),
            }
        })
    }

    /// The attempt `attempt_id` while it responds.
    fn responding(&self, attempt_id: &str) -> Option<Arc<Attempt>> {
        self.current()
            .filter(|attempt| attempt.attempt.attempt_id == attempt_id && attempt.responding.load(Ordering::Acquire))
    }
}

/// The binding the renders of one attempt get: their state and data writes reach that
/// attempt while it responds, and are refused after it (a setter or writer a spawned task kept
/// writes nothing into the instance's next response, nor into a re-attempt).
pub(crate) struct AttemptBinding {
    pub(crate) instance: Arc<InstanceBinding>,
    pub(crate) attempt_id: String,
}

impl RuntimeBinding for AttemptBinding {
    fn modify_state(&self, name: &str, modify: &mut StateModify<'_>) -> Result<(), StateWriteError> {
        let attempt = self
            .instance
            .responding(&self.attempt_id)
            .ok_or_else(|| StateWriteError::NotResponding { name: name.to_owned() })?;
        let mut buffer = attempt.buffer();
        if let Some(next) = modify(buffer.current(name))? {
            buffer.write(name, next);
        }
        Ok(())
    }

    fn write_data(&self, name: &str, data: Value) -> Result<(), DataWriteError> {
        let attempt = self
            .instance
            .responding(&self.attempt_id)
            .ok_or_else(|| DataWriteError::NotResponding { name: name.to_owned() })?;
        // Its `data_part` event follows once it is durable (see `Attempt::flush_data`).
        attempt.queue_data(name.to_owned(), data);
        Ok(())
    }

    fn dispatch(&self, message: DeliveredMessage) -> BoxFuture<'static, Result<DispatchReceipt, DispatchError>> {
        self.instance.dispatch(message)
    }
}
