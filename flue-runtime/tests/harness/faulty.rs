//! A store that fails on purpose: the fault injection the durability and delegation tests
//! share. A failed write stands for a crash between the work a batch records and its commit;
//! the attempt is abandoned and re-run from what is durable.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use flue_runtime::BoxFuture;
use flue_runtime::record::{Batch, Outcome, Record, SettlementError};
use flue_runtime::store::{Admission, Admitted, AttemptRef, InstanceKey, MemoryStore, Store, StoreError, Submission};

type Predicate = Box<dyn Fn(&InstanceKey, &[Record]) -> bool + Send>;

/// Wraps a store (the memory store by default). Appends and settlements whose records match
/// the armed predicate fail, once or always; listing expired leases fails while
/// `failing_scans` is set; renewing leases fails while `failing_renewals` is set; the next
/// `failing_requeues` requeues fail; the next read of the stream `stall_next_read` names takes
/// its time; and, once `hang_after_admit` holds `"armed"`, the next admission commits and then
/// never answers (a caller dropped between a remote store's commit and its reply), leaving its
/// submission's id there. Every call failed on purpose counts in `failures`, and every stalled
/// read in `stalled_reads`, so a test can show its fault fired.
#[derive(Clone)]
pub struct FaultyStore {
    pub inner: Arc<dyn Store>,
    fault: Arc<Mutex<Option<Predicate>>>,
    always: Arc<AtomicBool>,
    /// How many calls failed on purpose (writes, reads, requeues, scans, renewals).
    pub failures: Arc<AtomicUsize>,
    pub hang_after_admit: Arc<Mutex<Option<String>>>,
    /// Once it holds `"armed"`, the next admission commits and then answers with an error of
    /// unknown outcome (`StoreError::Other`: a remote store's answer lost), leaving its
    /// submission's id there (counted in `failures`).
    pub lose_admit_answer: Arc<Mutex<Option<String>>>,
    /// While set, listings of expired leases fail (each one counted in `failures`).
    pub failing_scans: Arc<AtomicBool>,
    /// While set, lease renewals fail, each one counted in `failures` (a database failover, a
    /// stalled node): leases lapse.
    pub failing_renewals: Arc<AtomicBool>,
    /// How many of the next requeues fail.
    pub failing_requeues: Arc<AtomicUsize>,
    /// How long the next read of the named stream takes (a stalled database), once.
    pub stall_next_read: Arc<Mutex<Option<(InstanceKey, std::time::Duration)>>>,
    /// How many reads `stall_next_read` stalled.
    pub stalled_reads: Arc<AtomicUsize>,
    /// How many of the next reads of a stream fail.
    pub failing_reads: Arc<AtomicUsize>,
    /// How many of the next looks at an instance's row fail.
    pub failing_instance_looks: Arc<AtomicUsize>,
    /// How long each listing of expired leases takes while set (a slow scan).
    pub stall_scans: Arc<Mutex<Option<std::time::Duration>>>,
    /// How many listings of expired leases were asked for (failed ones too).
    pub scans: Arc<AtomicUsize>,
    /// How many of the next reads of an attachment fail.
    pub failing_attachment_reads: Arc<AtomicUsize>,
    /// While set, an append that fails on purpose is committed first: its acknowledgement is
    /// what is lost (a remote store's connection dropping after its `COMMIT`).
    pub acks_lost: Arc<AtomicBool>,
    /// While set, an append that fails on purpose is committed and then never answers (a
    /// remote store whose reply its caller stopped waiting for): a caller that gives it up
    /// leaves it in the stream.
    pub hangs_after_commit: Arc<AtomicBool>,
    /// While set, an admission answers only once it commits and a permit is added to
    /// `admits_released` (a remote store's reply still on its way).
    pub holding_admits: Arc<AtomicBool>,
    pub admits_released: Arc<tokio::sync::Semaphore>,
    /// How many admissions committed.
    pub admitted: Arc<AtomicUsize>,
    /// Attachment reads from the streams this matches find nothing (an attachment lost, or
    /// never stored).
    pub missing_attachments: Arc<Mutex<Option<KeyPredicate>>>,
}

/// Which streams a fault concerns.
pub type KeyPredicate = Box<dyn Fn(&InstanceKey) -> bool + Send + Sync>;

impl Default for FaultyStore {
    fn default() -> Self {
        Self::on(Arc::new(MemoryStore::new()))
    }
}

impl FaultyStore {
    pub fn on(inner: Arc<dyn Store>) -> Self {
        Self {
            inner,
            fault: Arc::default(),
            always: Arc::default(),
            failures: Arc::default(),
            hang_after_admit: Arc::default(),
            lose_admit_answer: Arc::default(),
            failing_scans: Arc::default(),
            failing_renewals: Arc::default(),
            failing_requeues: Arc::default(),
            stall_next_read: Arc::default(),
            stalled_reads: Arc::default(),
            failing_reads: Arc::default(),
            failing_instance_looks: Arc::default(),
            stall_scans: Arc::default(),
            scans: Arc::default(),
            failing_attachment_reads: Arc::default(),
            acks_lost: Arc::default(),
            hangs_after_commit: Arc::default(),
            holding_admits: Arc::default(),
            admits_released: Arc::new(tokio::sync::Semaphore::new(0)),
            admitted: Arc::default(),
            missing_attachments: Arc::default(),
        }
    }

    /// The next write whose records match fails.
    pub fn fail_once(&self, predicate: impl Fn(&[Record]) -> bool + Send + 'static) {
        self.fail_once_in(move |_, records| predicate(records));
    }

    /// Every write whose records match fails.
    pub fn fail_always(&self, predicate: impl Fn(&[Record]) -> bool + Send + 'static) {
        self.arm(Box::new(move |_, records| predicate(records)), true);
    }

    /// The next write to a stream whose key and records match fails.
    pub fn fail_once_in(&self, predicate: impl Fn(&InstanceKey, &[Record]) -> bool + Send + 'static) {
        self.arm(Box::new(predicate), false);
    }

    /// Arms `predicate`, failing every matching write (`always`) or the next one only (a fault
    /// armed once after one armed always, or disarmed, still fails once).
    fn arm(&self, predicate: Predicate, always: bool) {
        let mut fault = self.fault.lock().unwrap();
        self.always.store(always, Ordering::SeqCst);
        *fault = Some(predicate);
    }

    /// No write fails from now on.
    pub fn disarm(&self) {
        let mut fault = self.fault.lock().unwrap();
        self.always.store(false, Ordering::SeqCst);
        *fault = None;
    }

    /// The injected failure of `what`, counted in `failures`, while `left` says more of its
    /// calls fail (one fewer each time); `None` once none are left.
    fn fails<T: Send + 'static>(
        &self,
        left: &AtomicUsize,
        what: &str,
    ) -> Option<BoxFuture<'static, Result<T, StoreError>>> {
        left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| left.checked_sub(1))
            .ok()?;
        self.failures.fetch_add(1, Ordering::SeqCst);
        Some(Box::pin(std::future::ready(Err(injected(what)))))
    }

    /// Whether a write of `records` to `key` fails now (counted; a one-time fault is spent).
    fn injects_failure(&self, key: &InstanceKey, records: &[Record]) -> bool {
        let mut fault = self.fault.lock().unwrap();
        if !fault.as_ref().is_some_and(|matches| matches(key, records)) {
            return false;
        }
        if !self.always.load(Ordering::SeqCst) {
            *fault = None;
        }
        self.failures.fetch_add(1, Ordering::SeqCst);
        true
    }
}

/// Whether `records` commit a tool batch: the write a crash "between a tool outcome and its
/// batch commit" fails.
pub fn commits_a_tool_batch(records: &[Record]) -> bool {
    records.iter().any(|record| {
        matches!(
            record.body,
            flue_runtime::record::RecordBody::ToolResultsCommitted { .. }
        )
    })
}

/// Whether `records` settle a submission.
pub fn settles(records: &[Record]) -> bool {
    records
        .iter()
        .any(|record| matches!(record.body, flue_runtime::record::RecordBody::SubmissionSettled { .. }))
}

fn injected(what: &str) -> StoreError {
    StoreError::Other(format!("injected {what} failure"))
}

impl Store for FaultyStore {
    crate::harness::delegate_store!(
        inner;
        submission, has_queued, claim_next, reclaim,
        aborts_requested, instances_with_queued, claim_joinable, finalize_join, revert_joins,
        request_abort, put_attachment, user_value, set_user_value,
        list_user_values, create_child,
    );

    fn instance(
        &self,
        key: &InstanceKey,
    ) -> BoxFuture<'_, Result<Option<flue_runtime::store::InstanceInfo>, StoreError>> {
        if let Some(failed) = self.fails(&self.failing_instance_looks, "instance look") {
            return failed;
        }
        self.inner.instance(key)
    }

    fn admit(&self, admission: Admission) -> BoxFuture<'_, Result<Admitted, StoreError>> {
        Box::pin(async move {
            let admitted = self.inner.admit(admission).await?;
            self.admitted.fetch_add(1, Ordering::SeqCst);
            let hang = {
                let mut hang = self.hang_after_admit.lock().unwrap();
                let armed = hang.as_deref() == Some("armed");
                if armed {
                    *hang = Some(admitted.submission.id.clone());
                }
                armed
            };
            if hang {
                std::future::pending::<()>().await;
            }
            {
                let mut lose = self.lose_admit_answer.lock().unwrap();
                if lose.as_deref() == Some("armed") {
                    *lose = Some(admitted.submission.id.clone());
                    self.failures.fetch_add(1, Ordering::SeqCst);
                    return Err(injected("admission answer"));
                }
            }
            if self.holding_admits.load(Ordering::SeqCst) {
                self.admits_released.acquire().await.unwrap().forget();
            }
            Ok(admitted)
        })
    }

    fn requeue(&self, attempt: &AttemptRef) -> BoxFuture<'_, Result<bool, StoreError>> {
        if let Some(failed) = self.fails(&self.failing_requeues, "requeue") {
            return failed;
        }
        self.inner.requeue(attempt)
    }

    fn attachment(
        &self,
        key: &InstanceKey,
        id: &str,
    ) -> BoxFuture<'_, Result<Option<flue_runtime::store::StoredAttachment>, StoreError>> {
        if let Some(failed) = self.fails(&self.failing_attachment_reads, "attachment read") {
            return failed;
        }
        if self
            .missing_attachments
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(|missing| missing(key))
        {
            return Box::pin(std::future::ready(Ok(None)));
        }
        self.inner.attachment(key, id)
    }

    fn expired(&self, now_ms: u64) -> BoxFuture<'_, Result<Vec<Submission>, StoreError>> {
        self.scans.fetch_add(1, Ordering::SeqCst);
        if self.failing_scans.load(Ordering::SeqCst) {
            self.failures.fetch_add(1, Ordering::SeqCst);
            return Box::pin(std::future::ready(Err(injected("scan"))));
        }
        let stall = *self.stall_scans.lock().unwrap();
        Box::pin(async move {
            if let Some(stall) = stall {
                tokio::time::sleep(stall).await;
            }
            self.inner.expired(now_ms).await
        })
    }

    /// As the wrapped store: one shared by several nodes stays one.
    fn shared(&self) -> bool {
        self.inner.shared()
    }

    fn renew_leases(
        &self,
        owner_id: &str,
        attempt_ids: &[String],
        lease_until_ms: u64,
    ) -> BoxFuture<'_, Result<u64, StoreError>> {
        if self.failing_renewals.load(Ordering::SeqCst) {
            self.failures.fetch_add(1, Ordering::SeqCst);
            return Box::pin(std::future::ready(Err(injected("renewal"))));
        }
        self.inner.renew_leases(owner_id, attempt_ids, lease_until_ms)
    }

    fn read(&self, key: &InstanceKey, after: Option<u64>) -> BoxFuture<'_, Result<Vec<Batch>, StoreError>> {
        let stall = {
            let mut stall = self.stall_next_read.lock().unwrap();
            stall
                .take_if(|(stalled, _)| stalled == key)
                .map(|(_, duration)| duration)
        };
        if stall.is_some() {
            self.stalled_reads.fetch_add(1, Ordering::SeqCst);
        }
        if let Some(failed) = self.fails(&self.failing_reads, "read") {
            return failed;
        }
        let key = key.clone();
        Box::pin(async move {
            if let Some(stall) = stall {
                tokio::time::sleep(stall).await;
            }
            self.inner.read(&key, after).await
        })
    }

    fn append(
        &self,
        key: &InstanceKey,
        records: Arc<[Record]>,
        authorization: Option<&AttemptRef>,
    ) -> BoxFuture<'_, Result<u64, StoreError>> {
        if self.injects_failure(key, &records) {
            if self.hangs_after_commit.load(Ordering::SeqCst) {
                let (key, authorization) = (key.clone(), authorization.cloned());
                return Box::pin(async move {
                    self.inner.append(&key, records, authorization.as_ref()).await?;
                    std::future::pending().await
                });
            }
            if self.acks_lost.load(Ordering::SeqCst) {
                let (key, authorization) = (key.clone(), authorization.cloned());
                return Box::pin(async move {
                    self.inner.append(&key, records, authorization.as_ref()).await?;
                    Err(injected("append acknowledgement"))
                });
            }
            return Box::pin(std::future::ready(Err(injected("append"))));
        }
        self.inner.append(key, records, authorization)
    }

    /// A settlement fails as an append does: when its records match (in its instance's stream).
    fn settle(
        &self,
        host: &AttemptRef,
        outcome: Outcome,
        error: Option<SettlementError>,
        records: Vec<Record>,
    ) -> BoxFuture<'_, Result<bool, StoreError>> {
        let host = host.clone();
        Box::pin(async move {
            if let Some(row) = self.inner.submission(&host.submission_id).await?
                && self.injects_failure(&row.key, &records)
            {
                return Err(injected("settlement"));
            }
            self.inner.settle(&host, outcome, error, records).await
        })
    }
}
