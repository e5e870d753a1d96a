//! The in-memory store: the whole [`Store`] contract in one mutex-guarded structure.

use std::collections::BTreeMap;

use crate::fast_map::FastMap;
use std::sync::{Arc, Mutex, MutexGuard};

use flue_core::BoxFuture;
use flue_core::lifecycle::{UserValue, UserValuePage, UserValuesQuery};

use super::attachments::{AttachmentPut, StoredAttachment, conflict};
use super::{
    Admission, Admitted, AttemptRef, Claim, InstanceInfo, InstanceKey, Store, StoreError, Submission, SubmissionStatus,
    empty_batch, lease_expired,
};
use crate::record::{Batch, Outcome, Record, SettlementError, new_id};

/// A [`Store`] that keeps everything in memory. Cheap to clone (clones share the data).
#[derive(Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Default)]
struct Inner {
    /// See [`MemoryStore::pretending_shared`].
    #[cfg(test)]
    shared: bool,
    sequence: u64,
    submissions: FastMap<String, Submission>,
    /// Hashed, not ordered: every exchange looks its instance up several times, and a lookup
    /// in an ordered map compares the key's strings at each level.
    instances: FastMap<InstanceKey, Instance>,
    /// Attachments by id, with the instance that owns each.
    attachments: FastMap<String, (InstanceKey, StoredAttachment)>,
    /// User values by user, in key order.
    user_values: FastMap<String, BTreeMap<String, (serde_json::Value, i64)>>,
}

#[derive(Default)]
struct Instance {
    uid: String,
    /// Unsettled submission ids, in admission order (settled ones leave, so every scan is
    /// bounded by the instance's backlog, not its history).
    unsettled: Vec<String>,
    batches: Vec<Batch>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// The store, saying it is [shared](Store::shared) with other nodes (a unit test's
    /// stand-in for a Postgres store).
    #[cfg(test)]
    pub(crate) fn pretending_shared(self) -> Self {
        self.lock().shared = true;
        self
    }

    /// Appends `records` as the attempts that wrote them would, without their authorization
    /// (a unit test's stream of records of several submissions).
    #[cfg(test)]
    pub(crate) fn append_unfenced(&self, key: &InstanceKey, records: Arc<[Record]>) -> Result<u64, StoreError> {
        self.lock().append(key, records)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn ready<T: Send + 'static>(value: T) -> BoxFuture<'static, T> {
    Box::pin(std::future::ready(value))
}

impl Inner {
    /// Starts an attempt of the instance's head, when it is queued (and is `only`, if given).
    fn claim_head(&mut self, key: &InstanceKey, claim: &Claim, only: Option<&str>) -> Option<Submission> {
        let id = self.instances.get(key)?.unsettled.first()?;
        if only.is_some_and(|only| only != id) {
            return None;
        }
        let row = self.submissions.get_mut(id)?;
        if row.status != SubmissionStatus::Queued {
            return None;
        }
        super::start_attempt(row, claim);
        Some(row.clone())
    }

    /// Puts the deliveries claimed into `host` but never applied back in the queue (they are
    /// unsettled rows of the host's instance).
    fn revert_joining(&mut self, host: &str) -> usize {
        let Some(key) = self.submissions.get(host).map(|row| row.key.clone()) else {
            return 0;
        };
        let Inner {
            instances, submissions, ..
        } = self;
        let mut reverted = 0;
        for id in instances
            .get(&key)
            .map(|instance| instance.unsettled.as_slice())
            .unwrap_or_default()
        {
            let Some(row) = submissions.get_mut(id) else { continue };
            if row.joined_into.as_deref() == Some(host) && row.status == SubmissionStatus::Joining {
                row.status = SubmissionStatus::Queued;
                row.joined_into = None;
                reverted += 1;
            }
        }
        reverted
    }

    fn owns(&self, attempt: &AttemptRef) -> bool {
        self.submissions.get(&attempt.submission_id).is_some_and(|row| {
            row.status == SubmissionStatus::Running && row.attempt_id.as_deref() == Some(attempt.attempt_id.as_str())
        })
    }

    /// A write's fence: with `authorization`, that attempt must run its submission, the
    /// submission's instance must be the one whose `stream` is written (or its task child's),
    /// and `records` must be the attempt's (see [`super::joined_submissions_of`]).
    fn fence(
        &self,
        authorization: Option<&AttemptRef>,
        stream: &InstanceKey,
        records: &[Record],
    ) -> Result<(), StoreError> {
        let joined = super::joined_submissions_of(records, authorization)?;
        let Some(attempt) = authorization else { return Ok(()) };
        if !self.owns(attempt) {
            return Err(StoreError::Fenced(format!(
                "attempt {} does not own submission {}",
                attempt.attempt_id, attempt.submission_id
            )));
        }
        match self.submissions.get(&attempt.submission_id) {
            Some(row) if stream.writable_by(&row.key.agent, &row.key.id) => {}
            _ => {
                return Err(StoreError::Fenced(format!(
                    "submission {} does not write the stream {stream}",
                    attempt.submission_id
                )));
            }
        }
        for submission in joined {
            let claimed = self.submissions.get(submission).is_some_and(|row| {
                row.joined_into.as_deref() == Some(attempt.submission_id.as_str())
                    && matches!(row.status, SubmissionStatus::Joining | SubmissionStatus::Joined)
            });
            if !claimed {
                return Err(super::not_joined(submission, &attempt.submission_id));
            }
        }
        Ok(())
    }

    fn append(&mut self, key: &InstanceKey, records: Arc<[Record]>) -> Result<u64, StoreError> {
        if records.is_empty() {
            return Err(empty_batch());
        }
        // Refused as the stores that write text refuse it (see `depth`).
        if super::nests_too_deep(&*records) {
            return Err(super::too_deep_error("records"));
        }
        let instance = self
            .instances
            .get_mut(key)
            .ok_or_else(|| StoreError::Other(format!("no stream {key}")))?;
        let offset = instance.batches.len() as u64;
        instance.batches.push(Batch { offset, records });
        Ok(offset)
    }
}

impl Store for MemoryStore {
    fn admit(&self, admission: Admission) -> BoxFuture<'_, Result<Admitted, StoreError>> {
        let mut inner = self.lock();
        let result = (|| {
            if let Some(existing) = inner.submissions.get(&admission.submission_id) {
                if existing.admitted_by(&admission) {
                    let uid = inner
                        .instances
                        .get(&admission.key)
                        .map(|instance| instance.uid.clone())
                        .unwrap_or_default();
                    return Ok(Admitted {
                        submission: existing.clone(),
                        uid,
                        deduplicated: true,
                        offset: None,
                        claimed: None,
                        birth: None,
                    });
                }
                return Err(StoreError::SubmissionConflict(admission.submission_id.clone()));
            }
            // As deep as its birth record nests them in a batch.
            if super::nests_too_deep(&[(&admission.message, &admission.initial_data)]) {
                return Err(super::too_deep_error("submission's message and initial data"));
            }
            let existing_uid = inner.instances.get(&admission.key).map(|instance| instance.uid.clone());
            super::check_uid(&admission, existing_uid.as_deref())?;
            let (uid, birth) = match existing_uid {
                Some(uid) => (uid, None),
                None => {
                    let uid = new_id("inst");
                    let birth = Batch {
                        offset: 0,
                        records: Arc::new([super::birth_record(&uid, admission.initial_data.clone())]),
                    };
                    let instance = Instance {
                        uid: uid.clone(),
                        unsettled: Vec::new(),
                        batches: vec![birth.clone()],
                    };
                    inner.instances.insert(admission.key.clone(), instance);
                    (uid, Some(birth))
                }
            };
            inner.sequence += 1;
            let key = admission.key.clone();
            let claim = admission.claim.clone();
            let submission = super::queued_submission(admission, inner.sequence);
            inner.submissions.insert(submission.id.clone(), submission.clone());
            let instance = inner
                .instances
                .get_mut(&key)
                .ok_or_else(|| StoreError::Other("instance vanished".into()))?;
            instance.unsettled.push(submission.id.clone());
            let offset = instance.batches.len().checked_sub(1).map(|last| last as u64);
            let claimed = claim.and_then(|claim| inner.claim_head(&key, &claim, Some(&submission.id)));
            Ok(Admitted {
                submission,
                uid,
                deduplicated: false,
                offset,
                claimed,
                birth,
            })
        })();
        ready(result)
    }

    fn instance(&self, key: &InstanceKey) -> BoxFuture<'_, Result<Option<InstanceInfo>, StoreError>> {
        let inner = self.lock();
        let info = inner.instances.get(key).map(|instance| InstanceInfo {
            id: key.id.to_string(),
            uid: instance.uid.clone(),
        });
        ready(Ok(info))
    }

    fn submission(&self, id: &str) -> BoxFuture<'_, Result<Option<Submission>, StoreError>> {
        ready(Ok(self.lock().submissions.get(id).cloned()))
    }

    fn has_queued(&self, key: &InstanceKey) -> BoxFuture<'_, Result<bool, StoreError>> {
        let inner = self.lock();
        let queued = inner.instances.get(key).is_some_and(|instance| {
            instance.unsettled.iter().any(|id| {
                inner
                    .submissions
                    .get(id)
                    .is_some_and(|row| row.status == SubmissionStatus::Queued)
            })
        });
        ready(Ok(queued))
    }

    fn claim_next(&self, key: &InstanceKey, claim: &Claim) -> BoxFuture<'_, Result<Option<Submission>, StoreError>> {
        ready(Ok(self.lock().claim_head(key, claim, None)))
    }

    fn renew_leases(
        &self,
        owner_id: &str,
        attempt_ids: &[String],
        lease_until_ms: u64,
    ) -> BoxFuture<'_, Result<u64, StoreError>> {
        let mut inner = self.lock();
        let Inner {
            instances, submissions, ..
        } = &mut *inner;
        let mut renewed = 0;
        // Running rows are unsettled: the scan is bounded by the backlogs, not the history.
        for id in instances.values().flat_map(|instance| instance.unsettled.iter()) {
            let Some(row) = submissions.get_mut(id) else { continue };
            if row.status == SubmissionStatus::Running
                && row.owner_id.as_deref() == Some(owner_id)
                && row
                    .attempt_id
                    .as_ref()
                    .is_some_and(|attempt| attempt_ids.contains(attempt))
            {
                row.lease_until_ms = lease_until_ms;
                renewed += 1;
            }
        }
        ready(Ok(renewed))
    }

    fn expired(&self, now_ms: u64) -> BoxFuture<'_, Result<Vec<Submission>, StoreError>> {
        let inner = self.lock();
        let mut rows: Vec<Submission> = inner
            .instances
            .values()
            .flat_map(|instance| instance.unsettled.iter())
            .filter_map(|id| inner.submissions.get(id))
            .filter(|row| row.status == SubmissionStatus::Running && lease_expired(row.lease_until_ms, now_ms))
            .cloned()
            .collect();
        rows.sort_by_key(|row| row.sequence);
        ready(Ok(rows))
    }

    fn reclaim(
        &self,
        submission_id: &str,
        stale_attempt_id: &str,
        claim: &Claim,
        now_ms: u64,
    ) -> BoxFuture<'_, Result<Option<Submission>, StoreError>> {
        let mut inner = self.lock();
        let reclaimed = inner.submissions.get_mut(submission_id).and_then(|row| {
            if row.status != SubmissionStatus::Running
                || row.attempt_id.as_deref() != Some(stale_attempt_id)
                || !lease_expired(row.lease_until_ms, now_ms)
            {
                return None;
            }
            row.attempt_id = Some(claim.attempt_id.clone());
            row.owner_id = Some(claim.owner_id.clone());
            row.lease_until_ms = claim.lease_until_ms;
            row.attempt_count += 1;
            Some(row.clone())
        });
        ready(Ok(reclaimed))
    }

    fn aborts_requested(&self, attempt_ids: &[String]) -> BoxFuture<'_, Result<Vec<String>, StoreError>> {
        let inner = self.lock();
        let aborting = inner
            .instances
            .values()
            .flat_map(|instance| instance.unsettled.iter())
            .filter_map(|id| inner.submissions.get(id))
            .filter(|row| row.status == SubmissionStatus::Running && row.abort_requested)
            .filter_map(|row| row.attempt_id.clone())
            .filter(|attempt| attempt_ids.contains(attempt))
            .collect();
        ready(Ok(aborting))
    }

    fn instances_with_queued(&self) -> BoxFuture<'_, Result<Vec<InstanceKey>, StoreError>> {
        let inner = self.lock();
        let mut keys = inner
            .instances
            .iter()
            .filter(|(_, instance)| {
                let statuses = || {
                    instance
                        .unsettled
                        .iter()
                        .filter_map(|id| inner.submissions.get(id).map(|row| row.status))
                };
                statuses().any(|status| status == SubmissionStatus::Queued)
                    && !statuses().any(|status| status == SubmissionStatus::Running)
            })
            .map(|(key, _)| key.clone())
            .collect::<Vec<_>>();
        // In key order, whatever the map's.
        keys.sort_unstable();
        ready(Ok(keys))
    }

    fn claim_joinable(&self, host: &AttemptRef) -> BoxFuture<'_, Result<Vec<Submission>, StoreError>> {
        let mut inner = self.lock();
        if !inner.owns(host) {
            return ready(Ok(Vec::new()));
        }
        // A host being aborted takes no more deliveries: one admitted after the abort was
        // requested is not part of what the abort ends.
        let Some(key) = inner
            .submissions
            .get(&host.submission_id)
            .filter(|row| !row.abort_requested)
            .map(|row| row.key.clone())
        else {
            return ready(Ok(Vec::new()));
        };
        let queued: Vec<String> = inner
            .instances
            .get(&key)
            .map(|instance| {
                instance
                    .unsettled
                    .iter()
                    .filter(|id| {
                        inner
                            .submissions
                            .get(*id)
                            .is_some_and(|row| row.status == SubmissionStatus::Queued)
                    })
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        let mut claimed = Vec::new();
        for id in queued {
            let Some(row) = inner.submissions.get_mut(&id) else {
                break;
            };
            if row.abort_requested {
                break;
            }
            row.status = SubmissionStatus::Joining;
            row.joined_into = Some(host.submission_id.clone());
            claimed.push(row.clone());
        }
        ready(Ok(claimed))
    }

    fn revert_joins(&self, host: &AttemptRef) -> BoxFuture<'_, Result<usize, StoreError>> {
        let mut inner = self.lock();
        if !inner.owns(host) {
            return ready(Ok(0));
        }
        ready(Ok(inner.revert_joining(&host.submission_id)))
    }

    fn finalize_join(&self, host: &AttemptRef, submission_id: &str) -> BoxFuture<'_, Result<bool, StoreError>> {
        let mut inner = self.lock();
        let owns = inner.owns(host);
        let done = match inner.submissions.get_mut(submission_id) {
            Some(row)
                if owns
                    && row.status == SubmissionStatus::Joining
                    && row.joined_into.as_deref() == Some(host.submission_id.as_str()) =>
            {
                row.status = SubmissionStatus::Joined;
                true
            }
            _ => false,
        };
        ready(Ok(done))
    }

    fn settle(
        &self,
        host: &AttemptRef,
        outcome: Outcome,
        error: Option<SettlementError>,
        records: Vec<Record>,
    ) -> BoxFuture<'_, Result<bool, StoreError>> {
        let mut inner = self.lock();
        let result = (|| {
            if !inner.owns(host) {
                return Err(StoreError::Fenced(format!(
                    "attempt {} does not own {}",
                    host.attempt_id, host.submission_id
                )));
            }
            let key = inner
                .submissions
                .get(&host.submission_id)
                .map(|row| row.key.clone())
                .ok_or_else(|| StoreError::Other(format!("no submission {}", host.submission_id)))?;
            if !records.is_empty() {
                inner.append(&key, records.into())?;
            }
            let unsettled = inner
                .instances
                .get(&key)
                .map(|instance| instance.unsettled.clone())
                .unwrap_or_default();
            let joined: Vec<String> = unsettled
                .into_iter()
                .filter(|id| {
                    inner
                        .submissions
                        .get(id)
                        .is_some_and(|row| row.joined_into.as_deref() == Some(host.submission_id.as_str()))
                })
                .collect();
            for id in joined {
                if let Some(row) = inner.submissions.get_mut(&id) {
                    match row.status {
                        SubmissionStatus::Joined => {
                            row.status = SubmissionStatus::Settled;
                            row.outcome = Some(outcome);
                            row.error = error.clone();
                        }
                        // A join claimed but never applied goes back to the queue: never lost.
                        SubmissionStatus::Joining => {
                            row.status = SubmissionStatus::Queued;
                            row.joined_into = None;
                        }
                        _ => {}
                    }
                }
            }
            if let Some(row) = inner.submissions.get_mut(&host.submission_id) {
                row.status = SubmissionStatus::Settled;
                row.lease_until_ms = 0;
                row.outcome = Some(outcome);
                row.error = error;
            }
            let Inner {
                submissions, instances, ..
            } = &mut *inner;
            let Some(instance) = instances.get_mut(&key) else {
                return Ok(false);
            };
            instance.unsettled.retain(|id| {
                submissions
                    .get(id)
                    .is_some_and(|row| row.status != SubmissionStatus::Settled)
            });
            Ok(instance.unsettled.iter().any(|id| {
                submissions
                    .get(id)
                    .is_some_and(|row| row.status == SubmissionStatus::Queued)
            }))
        })();
        ready(result)
    }

    fn requeue(&self, attempt: &AttemptRef) -> BoxFuture<'_, Result<bool, StoreError>> {
        let mut inner = self.lock();
        if !inner.owns(attempt) {
            return ready(Ok(false));
        }
        inner.revert_joining(&attempt.submission_id);
        if let Some(row) = inner.submissions.get_mut(&attempt.submission_id) {
            row.status = SubmissionStatus::Queued;
            row.attempt_id = None;
            row.owner_id = None;
            row.lease_until_ms = 0;
        }
        ready(Ok(true))
    }

    fn request_abort(&self, key: &InstanceKey) -> BoxFuture<'_, Result<Vec<String>, StoreError>> {
        let mut inner = self.lock();
        let ids: Vec<String> = inner
            .instances
            .get(key)
            .map(|instance| instance.unsettled.clone())
            .unwrap_or_default();
        let mut affected = Vec::new();
        for id in ids {
            if let Some(row) = inner.submissions.get_mut(&id)
                && row.status != SubmissionStatus::Settled
            {
                row.abort_requested = true;
                affected.push(id);
            }
        }
        ready(Ok(affected))
    }

    fn append(
        &self,
        key: &InstanceKey,
        records: Arc<[Record]>,
        authorization: Option<&AttemptRef>,
    ) -> BoxFuture<'_, Result<u64, StoreError>> {
        // A malformed call is refused before the fence is looked at, as the other stores do.
        if records.is_empty() {
            return ready(Err(empty_batch()));
        }
        let mut inner = self.lock();
        if let Err(fenced) = inner.fence(authorization, key, &records) {
            return ready(Err(fenced));
        }
        ready(inner.append(key, records))
    }

    fn create_child(
        &self,
        parent: &InstanceKey,
        link: Arc<[Record]>,
        child: &InstanceKey,
        birth: Arc<[Record]>,
        authorization: Option<&AttemptRef>,
    ) -> BoxFuture<'_, Result<u64, StoreError>> {
        if link.is_empty() || birth.is_empty() {
            return ready(Err(empty_batch()));
        }
        let mut inner = self.lock();
        if let Err(fenced) = inner.fence(authorization, parent, &link) {
            return ready(Err(fenced));
        }
        if inner.instances.contains_key(child) {
            return ready(Err(StoreError::Other(format!("the stream {child} exists"))));
        }
        if super::nests_too_deep(&*birth) {
            return ready(Err(super::too_deep_error("records")));
        }
        // The link first: it fails (changing nothing) when the parent has no stream.
        let offset = match inner.append(parent, link) {
            Ok(offset) => offset,
            Err(error) => return ready(Err(error)),
        };
        let uid = super::birth_uid(&birth);
        inner.instances.insert(
            child.clone(),
            Instance {
                uid,
                unsettled: Vec::new(),
                batches: vec![Batch {
                    offset: 0,
                    records: birth,
                }],
            },
        );
        ready(Ok(offset))
    }

    fn last_offset(&self, key: &InstanceKey) -> BoxFuture<'_, Result<Option<u64>, StoreError>> {
        let inner = self.lock();
        let last = inner
            .instances
            .get(key)
            .and_then(|instance| instance.batches.last())
            .map(|batch| batch.offset);
        ready(Ok(last))
    }

    fn read(&self, key: &InstanceKey, after: Option<u64>) -> BoxFuture<'_, Result<Vec<Batch>, StoreError>> {
        self.read_page(key, after, usize::MAX)
    }

    fn read_page(
        &self,
        key: &InstanceKey,
        after: Option<u64>,
        limit: usize,
    ) -> BoxFuture<'_, Result<Vec<Batch>, StoreError>> {
        let inner = self.lock();
        let batches = inner
            .instances
            .get(key)
            .map(|instance| {
                // Past the last offset there can be (no overflow at `u64::MAX`), nothing.
                let start = after.map_or(Some(0), |after| usize::try_from(after).ok()?.checked_add(1));
                start
                    .and_then(|start| instance.batches.get(start..))
                    .map(|rest| rest[..rest.len().min(limit)].to_vec())
                    .unwrap_or_default()
            })
            .unwrap_or_default();
        ready(Ok(batches))
    }

    fn put_attachment(&self, key: &InstanceKey, attachment: AttachmentPut) -> BoxFuture<'_, Result<(), StoreError>> {
        if let Err(error) = attachment.verify() {
            return ready(Err(error));
        }
        let mut inner = self.lock();
        let result = match inner.attachments.get(&attachment.id) {
            Some((owner, stored)) => {
                if attachment.is_stored_as(key, owner, &stored.media_type, stored.size, &stored.digest) {
                    Ok(())
                } else {
                    Err(conflict(&attachment.id))
                }
            }
            None => {
                let stored = StoredAttachment {
                    id: attachment.id.clone(),
                    media_type: attachment.media_type,
                    size: attachment.size,
                    digest: attachment.digest,
                    bytes: attachment.bytes,
                };
                inner.attachments.insert(attachment.id, (key.clone(), stored));
                Ok(())
            }
        };
        ready(result)
    }

    fn attachment(&self, key: &InstanceKey, id: &str) -> BoxFuture<'_, Result<Option<StoredAttachment>, StoreError>> {
        let inner = self.lock();
        let found = inner
            .attachments
            .get(id)
            .filter(|(owner, _)| owner == key)
            .map(|(_, stored)| stored.clone());
        ready(Ok(found))
    }

    fn user_value(&self, user_id: &str, key: &str) -> BoxFuture<'_, Result<Option<UserValue>, StoreError>> {
        let inner = self.lock();
        let found = inner
            .user_values
            .get(user_id)
            .and_then(|values| values.get(key))
            .map(|(value, updated_at)| UserValue {
                key: key.to_owned(),
                value: value.clone(),
                updated_at: *updated_at,
            });
        ready(Ok(found))
    }

    fn set_user_value(
        &self,
        user_id: &str,
        key: &str,
        value: Option<serde_json::Value>,
        updated_at: i64,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        if value.as_ref().is_some_and(super::nests_too_deep) {
            return ready(Err(super::too_deep_error("user value")));
        }
        let mut inner = self.lock();
        let values = inner.user_values.entry(user_id.to_owned()).or_default();
        match value {
            Some(value) => {
                values.insert(key.to_owned(), (value, updated_at));
            }
            None => {
                values.remove(key);
            }
        }
        ready(Ok(()))
    }

    #[cfg(test)]
    fn shared(&self) -> bool {
        self.lock().shared
    }

    fn list_user_values(
        &self,
        user_id: &str,
        query: &UserValuesQuery,
    ) -> BoxFuture<'_, Result<UserValuePage, StoreError>> {
        let inner = self.lock();
        let matching: Vec<UserValue> = inner
            .user_values
            .get(user_id)
            .into_iter()
            .flat_map(|values| values.range(query.prefix.clone()..))
            .take_while(|(key, _)| key.starts_with(&query.prefix))
            .map(|(key, (value, updated_at))| UserValue {
                key: key.clone(),
                value: value.clone(),
                updated_at: *updated_at,
            })
            .collect();
        let total = matching.len();
        let entries = matching
            .into_iter()
            .skip(query.offset)
            .take(query.limit.unwrap_or(usize::MAX))
            .collect();
        ready(Ok(UserValuePage { entries, total }))
    }
}
