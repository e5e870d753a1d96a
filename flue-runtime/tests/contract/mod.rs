//! The store contract: every behaviour the runtime relies on, as one suite run against every
//! `Store` (memory, SQLite, Postgres). Case names follow the reference's contract checklists
//! (§5.2 submission store, §5.3 conversation stream, §5.4 attachments) for the behaviours our
//! trait covers.
//!
//! A backend instantiates it with `contract::store_contract!(name, || async { store })`.
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;

use flue_runtime::lifecycle::UserValuesQuery;
use flue_runtime::message::{Attachment, DeliveredMessage, UserMessage};
use flue_runtime::record::{Outcome, Record, RecordBody, SettlementError};
use flue_runtime::store::{
    ATTACHMENT_CHUNK_BYTES, Admission, AttachmentPut, AttemptRef, Claim, InstanceKey, Store, StoreError, Submission,
    SubmissionKind, SubmissionStatus, TraceContext, UidCondition, now_ms,
};

pub type Factory = Arc<dyn Store>;

/// Generates one `#[tokio::test]` per contract case for a backend.
macro_rules! store_contract {
    ($backend:ident, $factory:expr) => {
        mod $backend {
            #[allow(unused_imports)]
            use super::*;
            contract::generate!(
                $factory,
                [
                    admits_one_queued_dispatch_row_when_the_same_submission_is_replayed,
                    returns_conflict_when_one_submission_id_is_reused_with_another_payload,
                    returns_conflict_when_one_submission_id_is_reused_with_other_initial_data_or_kind,
                    round_trips_a_dispatched_user_message_with_attachments,
                    returns_conflict_when_one_submission_id_is_replayed_with_different_attachment_bytes,
                    round_trips_direct_submission_images,
                    rejects_replay_when_a_direct_submission_image_has_different_bytes,
                    creates_the_instance_with_a_birth_record_once,
                    hands_the_birth_batch_to_the_admission_that_created_the_instance_and_to_no_other,
                    concurrent_first_admissions_create_one_instance_with_one_birth_record,
                    keeps_the_admitting_requests_trace_context_on_the_submission,
                    honours_conditional_sends,
                    retains_one_identity_when_conflicting_creates_race,
                    converges_concurrent_keyed_replays_on_one_submission,
                    answers_a_keyed_replay_of_a_create_only_send_with_its_receipt,
                    orders_direct_and_dispatched_submissions_together_within_one_session,
                    lists_queued_dispatches_in_admission_order_and_selects_one_runnable_head_per_session,
                    keeps_agents_with_the_same_instance_id_in_independent_sessions,
                    claims_only_runnable_session_heads_while_allowing_separate_sessions_to_claim_independently,
                    requeues_a_running_attempt_on_ownership_alone,
                    reports_unsettled_visibility_until_a_claimed_dispatch_completes,
                    ignores_stale_attempt_settlement_and_keeps_the_first_owning_terminal_state,
                    stamps_an_abort_intent_on_a_queued_submission_without_changing_its_status,
                    stamps_the_running_head_and_every_queued_submission_in_the_session_at_once,
                    scopes_the_abort_to_one_agent_when_another_agent_shares_the_instance_id,
                    leaves_settled_submissions_untouched_and_does_not_resurrect_them,
                    returns_an_empty_array_for_a_session_with_no_unsettled_submissions,
                    sets_attempt_count_to_1_at_claim_and_increments_it_on_reclaim,
                    extends_lease_timestamp_for_owned_running_submissions,
                    ignores_submissions_owned_by_a_different_coordinator,
                    leaves_the_lease_of_an_attempt_the_owner_no_longer_runs_to_expire,
                    ignores_settled_submissions_when_renewing_leases,
                    returns_running_submissions_with_expired_leases,
                    excludes_submissions_with_future_lease_expiry,
                    excludes_settled_submissions,
                    returns_empty_when_no_submissions_exist,
                    replaces_a_running_attempt_and_returns_the_updated_submission,
                    returns_null_without_writing_when_the_attempt_no_longer_owns_the_submission,
                    does_not_take_over_a_lease_that_has_not_expired_by_the_takeover,
                    reports_the_running_attempts_whose_submission_has_an_abort_requested,
                    claims_the_queued_dispatch_prefix_in_admission_order_onto_a_running_host,
                    claims_nothing_for_a_stale_attempt_or_a_host_that_is_not_running,
                    claims_direct_deliveries_alongside_dispatches,
                    stops_the_prefix_at_an_abort_requested_delivery,
                    claims_nothing_into_a_host_whose_abort_was_requested,
                    finalizes_a_claimed_join_once_and_fences_on_the_host_attempt,
                    a_taken_over_host_reverts_the_joins_its_dead_attempt_never_applied,
                    joined_deliveries_settle_with_a_completing_host_and_joining_stragglers_revert,
                    joined_deliveries_settle_when_a_direct_host_finalizes_its_settlement,
                    joined_deliveries_share_a_failing_host_outcome,
                    unsettled_joins_block_later_queued_work_and_clear_with_the_host,
                    settling_reports_whether_a_submission_of_the_instance_is_still_queued,
                    request_session_abort_stamps_joining_and_joined_deliveries,
                    reports_no_unsettled_submissions_initially,
                    get_submission_returns_null_for_unknown_ids,
                    names_the_settled_submissions_among_those_asked_about,
                    appends_one_ordered_canonical_batch,
                    round_trips_a_tool_outcomes_structured_output_null_included,
                    assigns_one_indivisible_offset_to_a_multi_record_batch,
                    round_trips_a_batch_larger_than_a_backend_cell_size_cap,
                    refuses_a_write_nested_deeper_than_it_reads_back_and_keeps_one_that_is_not,
                    authorizes_a_submission_owned_append_for_the_running_claimed_attempt,
                    authorizes_a_host_append_for_a_delivery_it_claimed_for_a_turn_boundary_join,
                    rejects_a_host_append_for_a_foreign_submission_it_has_not_claimed,
                    rejects_a_submission_owned_append_from_a_stale_attempt,
                    rejects_a_submission_owned_append_from_another_agent_sharing_the_instance_id,
                    fences_the_attempt_a_takeover_replaced_and_accepts_its_successor,
                    rejects_a_submission_owned_append_for_an_unknown_submission,
                    rejects_an_empty_batch,
                    creates_a_child_stream_and_its_parent_link_in_one_step,
                    keeps_the_streams_of_several_children_and_grandchildren_apart,
                    creates_neither_the_child_nor_the_link_when_the_attempt_is_fenced_or_the_child_exists,
                    replays_strictly_after_a_batch_offset,
                    reads_a_page_of_the_batches_after_an_offset,
                    reports_a_streams_last_offset_without_reading_it,
                    gives_concurrent_appends_distinct_consecutive_offsets,
                    settles_with_its_records_in_the_same_step,
                    lists_instances_with_queued_work,
                    stamps_the_timeout_deadline_at_the_first_claim_and_keeps_it_across_attempts,
                    keeps_a_custom_attempt_budget_and_timeout_through_admission_and_claims,
                    an_admission_with_a_claim_claims_the_idle_instances_head_in_the_same_step,
                    an_admission_with_a_claim_claims_nothing_behind_earlier_unsettled_work,
                    returns_the_original_bytes_when_an_exact_conversation_attachment_is_put,
                    returns_the_original_bytes_when_the_payload_exceeds_one_persisted_chunk,
                    accepts_an_exact_retry_when_the_first_put_acknowledgement_is_uncertain,
                    accepts_concurrent_exact_puts_when_one_attachment_identity_has_one_winner,
                    throws_attachment_conflict_when_one_id_is_reused_with_different_bytes,
                    throws_attachment_conflict_when_one_id_is_reused_for_a_different_conversation,
                    throws_attachment_integrity_when_declared_size_differs_from_decoded_bytes,
                    throws_attachment_integrity_when_declared_digest_differs_from_decoded_bytes,
                    returns_null_when_a_different_conversation_requests_an_existing_attachment,
                    returns_an_independent_byte_copy_when_stored_or_returned_arrays_are_mutated,
                    round_trips_a_user_value_and_deletes_it,
                    lists_user_values_by_literal_prefix_in_key_order_with_the_total,
                    keeps_each_users_values_apart,
                ]
            );
        }
    };
}

macro_rules! generate {
    ($factory:expr, [$($case:ident),* $(,)?]) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let Some(store) = ($factory)().await else { return };
                contract::$case(store).await;
            }
        )*
    };
}

pub(crate) use {generate, store_contract};

// ---- fixtures -------------------------------------------------------------------------------

fn key(agent: &str, id: &str) -> InstanceKey {
    InstanceKey::new(agent, id)
}

fn admission(id: &str, agent: &str, instance: &str, kind: SubmissionKind, body: &str) -> Admission {
    Admission {
        kind,
        ..crate::harness::admission(&key(agent, instance), id, body)
    }
}

fn dispatch(id: &str) -> Admission {
    dispatch_on(id, "agent-1")
}

/// A dispatch to `instance` of the `assistant` agent.
fn dispatch_on(id: &str, instance: &str) -> Admission {
    admission(id, "assistant", instance, SubmissionKind::Dispatch, "test.event")
}

/// A claim of attempt `attempt` by `owner-a`, leased for 30 s.
pub fn claim(attempt: &str) -> Claim {
    Claim {
        attempt_id: attempt.to_owned(),
        owner_id: "owner-a".into(),
        lease_until_ms: now_ms() + 30_000,
    }
}

/// A time after the leases [`claim`] grants: a node's scan then finds them expired.
fn after_the_lease() -> u64 {
    now_ms() + 60_000
}

fn attempt(submission: &str, attempt: &str) -> AttemptRef {
    AttemptRef {
        submission_id: submission.to_owned(),
        attempt_id: attempt.to_owned(),
    }
}

fn record(submission: Option<&str>, attempt: Option<&str>, body: RecordBody) -> Record {
    Record {
        id: format!("record_{}", ulid()),
        submission_id: submission.map(Into::into),
        attempt_id: attempt.map(Into::into),
        timestamp: "2026-06-03T00:00:00.000Z".into(),
        body,
    }
}

fn ulid() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("{:016}", NEXT.fetch_add(1, Ordering::SeqCst))
}

fn user(body: &str) -> RecordBody {
    RecordBody::UserMessage {
        message_id: format!("m_{}", ulid()),
        body: body.into(),
        attachments: Vec::new(),
    }
}

async fn admit(store: &Factory, admission: Admission) -> Submission {
    store.admit(admission).await.unwrap().submission
}

async fn row(store: &Factory, id: &str) -> Submission {
    store.submission(id).await.unwrap().unwrap()
}

/// `d-1` on `assistant/agent-1` running as `a1`, and `d-2` on `assistant/agent-2` as `a2`.
async fn two_running(store: &Factory) {
    admit(store, dispatch("d-1")).await;
    admit(store, dispatch_on("d-2", "agent-2")).await;
    for (instance, attempt) in [("agent-1", "a1"), ("agent-2", "a2")] {
        store
            .claim_next(&key("assistant", instance), &claim(attempt))
            .await
            .unwrap()
            .unwrap();
    }
}

async fn running_host(store: &Factory) -> AttemptRef {
    admit(store, dispatch("host-1")).await;
    let claimed = store
        .claim_next(&key("assistant", "agent-1"), &claim("attempt-1"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claimed.id, "host-1");
    attempt("host-1", "attempt-1")
}

/// Settles `host`; returns whether the store saw a submission still queued.
async fn settle(store: &Factory, host: &AttemptRef, outcome: Outcome, error: Option<SettlementError>) -> bool {
    let record = record(
        Some(&host.submission_id),
        Some(&host.attempt_id),
        RecordBody::SubmissionSettled {
            outcome,
            error: error.clone(),
        },
    );
    store.settle(host, outcome, error, vec![record]).await.unwrap()
}

// ---- dispatch admission ---------------------------------------------------------------------

pub async fn admits_one_queued_dispatch_row_when_the_same_submission_is_replayed(store: Factory) {
    let first = store.admit(dispatch("dispatch-1")).await.unwrap();
    let replay = store.admit(dispatch("dispatch-1")).await.unwrap();
    assert!(!first.deduplicated && replay.deduplicated);
    assert_eq!(replay.submission, first.submission);
    assert_eq!(first.submission.status, SubmissionStatus::Queued);
    assert_eq!(first.submission.key, key("assistant", "agent-1"));
    assert_eq!(replay.uid, first.uid);
}

pub async fn returns_conflict_when_one_submission_id_is_reused_with_another_payload(store: Factory) {
    store.admit(dispatch("dispatch-1")).await.unwrap();
    let mut other = dispatch("dispatch-1");
    other.message = DeliveredMessage::user("different");
    assert_eq!(
        store.admit(other).await.unwrap_err(),
        StoreError::SubmissionConflict("dispatch-1".into())
    );
}

/// The identity a replay must match is (kind, agent, id, message, initialData); a JSON `null`
/// as initial data is data, not its absence.
pub async fn returns_conflict_when_one_submission_id_is_reused_with_other_initial_data_or_kind(store: Factory) {
    use serde_json::{Value, json};
    let with_data = |id: &str, data: Option<Value>| Admission {
        initial_data: data,
        ..dispatch(id)
    };
    let first = store
        .admit(with_data("dispatch-1", Some(json!({"plan": "free"}))))
        .await
        .unwrap();
    assert_eq!(first.submission.initial_data, Some(json!({"plan": "free"})));
    assert_eq!(
        row(&store, "dispatch-1").await.initial_data,
        Some(json!({"plan": "free"}))
    );
    let replay = store
        .admit(with_data("dispatch-1", Some(json!({"plan": "free"}))))
        .await
        .unwrap();
    assert!(replay.deduplicated);
    assert_eq!(replay.submission, first.submission);
    let conflict = Err(StoreError::SubmissionConflict("dispatch-1".into()));
    for other in [Some(json!({"plan": "pro"})), Some(Value::Null), None] {
        assert_eq!(
            store.admit(with_data("dispatch-1", other.clone())).await.map(|_| ()),
            conflict,
            "{other:?}"
        );
    }
    let direct = Admission {
        kind: SubmissionKind::Direct,
        ..with_data("dispatch-1", Some(json!({"plan": "free"})))
    };
    assert_eq!(store.admit(direct).await.map(|_| ()), conflict, "another kind");

    store.admit(with_data("dispatch-2", Some(Value::Null))).await.unwrap();
    assert_eq!(row(&store, "dispatch-2").await.initial_data, Some(Value::Null));
    assert!(
        store
            .admit(with_data("dispatch-2", Some(Value::Null)))
            .await
            .unwrap()
            .deduplicated
    );
    assert_eq!(
        store.admit(with_data("dispatch-2", None)).await.map(|_| ()),
        Err(StoreError::SubmissionConflict("dispatch-2".into()))
    );
    store.admit(with_data("dispatch-3", None)).await.unwrap();
    assert_eq!(row(&store, "dispatch-3").await.initial_data, None);
    assert_eq!(
        store
            .admit(with_data("dispatch-3", Some(Value::Null)))
            .await
            .map(|_| ()),
        Err(StoreError::SubmissionConflict("dispatch-3".into()))
    );
}

/// An image attachment of `bytes` as a delivery carries it (base64, with its media type).
fn image_attachment(bytes: &[u8], media_type: &str, filename: Option<&str>) -> Attachment {
    use base64::Engine as _;
    Attachment::Image {
        data: base64::engine::general_purpose::STANDARD.encode(bytes),
        mime_type: media_type.into(),
        filename: filename.map(Into::into),
    }
}

/// `admission` delivering a user message of `body` with `attachments`.
fn with_images(admission: Admission, body: &str, attachments: Vec<Attachment>) -> Admission {
    Admission {
        message: DeliveredMessage::User(UserMessage {
            body: body.into(),
            attachments,
        }),
        ..admission
    }
}

/// The decoded bytes and media type of every attachment of a stored user message, in order.
fn stored_images(row: &Submission) -> Vec<(Vec<u8>, String)> {
    let DeliveredMessage::User(user) = &row.message else {
        panic!("a user message: {:?}", row.message)
    };
    user.attachments
        .iter()
        .map(|attachment| (attachment.bytes().unwrap(), attachment.mime_type().to_owned()))
        .collect()
}

/// Three images: two small ones of different types, and one past 256 KiB (the chunk size the
/// reference's stores split attachment data into).
fn three_images() -> (Vec<Attachment>, Vec<(Vec<u8>, String)>) {
    let png = vec![137, 80, 78, 71, 13, 10, 26, 10, 0, 255];
    let jpeg = vec![0xff, 0xd8, 0xff, 0xe0];
    let large: Vec<u8> = (0..256 * 1024 + 1).map(|i| (i % 251) as u8).collect();
    let attachments = vec![
        image_attachment(&png, "image/png", Some("a.png")),
        image_attachment(&jpeg, "image/jpeg", None),
        image_attachment(&large, "image/png", Some("large.png")),
    ];
    let expected = vec![
        (png, "image/png".to_owned()),
        (jpeg, "image/jpeg".to_owned()),
        (large, "image/png".to_owned()),
    ];
    (attachments, expected)
}

pub async fn round_trips_a_dispatched_user_message_with_attachments(store: Factory) {
    let (attachments, expected) = three_images();
    let input = with_images(dispatch("dispatch-1"), "look at these", attachments);
    let admitted = admit(&store, input.clone()).await;
    assert_eq!(admitted.message, input.message);
    let stored = row(&store, "dispatch-1").await;
    assert_eq!(stored, admitted, "the stored row is the admitted one");
    assert_eq!(stored_images(&stored), expected, "bytes and media types read back");
    let replay = store.admit(input.clone()).await.unwrap();
    assert!(replay.deduplicated, "an exact replay, images included, converges");
    assert_eq!(replay.submission, stored);
    let claimed = store
        .claim_next(&key("assistant", "agent-1"), &claim("a1"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claimed.message, input.message, "the attempt gets the images");
}

pub async fn returns_conflict_when_one_submission_id_is_replayed_with_different_attachment_bytes(store: Factory) {
    let first = image_attachment(&[1, 2, 3, 4], "image/png", Some("a.png"));
    let input = with_images(dispatch("dispatch-1"), "look", vec![first.clone()]);
    store.admit(input.clone()).await.unwrap();
    let conflict = Err(StoreError::SubmissionConflict("dispatch-1".into()));
    let others = [
        vec![image_attachment(&[1, 2, 3, 5], "image/png", Some("a.png"))],
        vec![first.clone(), image_attachment(&[9], "image/png", None)],
        Vec::new(),
    ];
    for attachments in others {
        let replay = with_images(dispatch("dispatch-1"), "look", attachments.clone());
        assert_eq!(store.admit(replay).await.map(|_| ()), conflict, "{attachments:?}");
    }
    assert_eq!(
        stored_images(&row(&store, "dispatch-1").await),
        [(vec![1, 2, 3, 4], "image/png".to_owned())],
        "the first bytes stay"
    );
    assert!(store.admit(input).await.unwrap().deduplicated);
}

pub async fn round_trips_direct_submission_images(store: Factory) {
    let (attachments, expected) = three_images();
    let direct = admission("direct-1", "assistant", "agent-1", SubmissionKind::Direct, "Hello");
    let input = with_images(direct, "Hello", attachments);
    let admitted = admit(&store, input.clone()).await;
    assert_eq!(admitted.kind, SubmissionKind::Direct);
    assert_eq!(admitted.message, input.message);
    let stored = row(&store, "direct-1").await;
    assert_eq!(
        stored, admitted,
        "the stored row, accepted_at included, is the admitted one"
    );
    assert_eq!(stored_images(&stored), expected, "bytes and media types read back");
    let replay = store.admit(input).await.unwrap();
    assert!(replay.deduplicated);
    assert_eq!(replay.submission, stored);
}

pub async fn rejects_replay_when_a_direct_submission_image_has_different_bytes(store: Factory) {
    let direct = || admission("direct-1", "assistant", "agent-1", SubmissionKind::Direct, "Hello");
    let input = with_images(direct(), "Hello", vec![image_attachment(&[7; 64], "image/webp", None)]);
    store.admit(input.clone()).await.unwrap();
    let mut other = vec![7; 64];
    other[63] = 8;
    let replay = with_images(direct(), "Hello", vec![image_attachment(&other, "image/webp", None)]);
    assert_eq!(
        store.admit(replay).await.map(|_| ()),
        Err(StoreError::SubmissionConflict("direct-1".into()))
    );
    assert_eq!(
        stored_images(&row(&store, "direct-1").await),
        [(vec![7; 64], "image/webp".to_owned())],
        "the first bytes stay"
    );
    assert!(store.admit(input).await.unwrap().deduplicated);
}

pub async fn keeps_the_admitting_requests_trace_context_on_the_submission(store: Factory) {
    let trace = TraceContext::parse(
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        Some("vendor=opaque"),
    );
    assert!(trace.is_some());
    let mut traced = dispatch("dispatch-1");
    traced.trace = trace.clone();
    assert_eq!(store.admit(traced).await.unwrap().submission.trace, trace);
    assert_eq!(row(&store, "dispatch-1").await.trace, trace);
    store.admit(dispatch("dispatch-2")).await.unwrap();
    assert_eq!(row(&store, "dispatch-2").await.trace, None);
}

pub async fn creates_the_instance_with_a_birth_record_once(store: Factory) {
    assert!(store.instance(&key("assistant", "agent-1")).await.unwrap().is_none());
    let mut first = dispatch("dispatch-1");
    first.initial_data = Some(serde_json::json!({"plan": "pro"}));
    let admitted = store.admit(first).await.unwrap();
    assert!(admitted.uid.starts_with("inst_"));
    assert_eq!(admitted.offset, Some(0));
    store.admit(dispatch("dispatch-2")).await.unwrap();
    let info = store.instance(&key("assistant", "agent-1")).await.unwrap().unwrap();
    assert_eq!(info.uid, admitted.uid);
    let batches = store.read(&key("assistant", "agent-1"), None).await.unwrap();
    assert_eq!(batches.len(), 1);
    assert_eq!(
        batches[0].records[0].body,
        RecordBody::ConversationCreated {
            uid: admitted.uid,
            initial_data: Some(serde_json::json!({"plan": "pro"})),
            kind: None,
            parent: None,
            task_id: None,
            agent: None,
        }
    );
    // A `null` initial data is data given, and reads back as given (not as none).
    let mut null = dispatch("dispatch-3");
    null.key = key("assistant", "agent-2");
    null.initial_data = Some(serde_json::Value::Null);
    store.admit(null).await.unwrap();
    let batches = store.read(&key("assistant", "agent-2"), None).await.unwrap();
    assert!(
        matches!(
            &batches[0].records[0].body,
            RecordBody::ConversationCreated {
                initial_data: Some(serde_json::Value::Null),
                ..
            }
        ),
        "{:?}",
        batches[0].records[0].body
    );
}

/// Not in the reference's checklists: the admission that creates an instance gets its birth
/// batch as stored (the runtime takes it instead of reading the stream back); a later
/// admission, a replay and a dispatch to an existing instance get none.
pub async fn hands_the_birth_batch_to_the_admission_that_created_the_instance_and_to_no_other(store: Factory) {
    let mut first = dispatch("dispatch-1");
    first.initial_data = Some(serde_json::json!({"plan": "pro"}));
    let admitted = store.admit(first.clone()).await.unwrap();
    let stored = store.read(&key("assistant", "agent-1"), None).await.unwrap();
    assert_eq!(
        admitted.birth.as_ref(),
        stored.first(),
        "the birth batch as the stream holds it"
    );
    assert_eq!(stored.len(), 1);
    let replay = store.admit(first).await.unwrap();
    assert!(replay.deduplicated);
    assert_eq!(replay.birth, None, "a replay created nothing");
    assert_eq!(store.admit(dispatch("dispatch-2")).await.unwrap().birth, None);
}

/// Not in the reference's checklists: admissions racing to create one instance (on Postgres,
/// from transactions that each find it missing) leave one instance and one birth record.
pub async fn concurrent_first_admissions_create_one_instance_with_one_birth_record(store: Factory) {
    let admissions: Vec<_> = (0..8)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move { store.admit(dispatch(&format!("racer-{i}"))).await.unwrap() })
        })
        .collect();
    let mut uids = Vec::new();
    let mut births = Vec::new();
    for admission in admissions {
        let admitted = admission.await.unwrap();
        assert!(!admitted.deduplicated);
        uids.push(admitted.uid);
        births.extend(admitted.birth);
    }
    let info = store.instance(&key("assistant", "agent-1")).await.unwrap().unwrap();
    assert!(uids.iter().all(|uid| *uid == info.uid), "{uids:?} vs {}", info.uid);
    let batches = store.read(&key("assistant", "agent-1"), None).await.unwrap();
    assert_eq!(batches.len(), 1, "one birth batch");
    assert_eq!(
        births, batches,
        "the one admission that created the instance got its birth batch"
    );
    assert!(matches!(
        batches[0].records[..],
        [Record {
            body: RecordBody::ConversationCreated { .. },
            ..
        }]
    ));
    for i in 0..8 {
        assert_eq!(
            row(&store, &format!("racer-{i}")).await.key,
            key("assistant", "agent-1")
        );
    }
}

pub async fn honours_conditional_sends(store: Factory) {
    let mut create = dispatch("dispatch-1");
    create.uid = UidCondition::CreateOnly;
    let uid = store.admit(create).await.unwrap().uid;
    let mut again = dispatch("dispatch-2");
    again.uid = UidCondition::CreateOnly;
    assert_eq!(
        store.admit(again).await.unwrap_err(),
        StoreError::InstanceExists {
            id: "agent-1".into(),
            uid: uid.clone()
        }
    );
    let mut wrong = dispatch("dispatch-3");
    wrong.uid = UidCondition::Existing("inst_other".into());
    assert_eq!(
        store.admit(wrong).await.unwrap_err(),
        StoreError::InstanceNotFound("agent-1".into())
    );
    let mut right = dispatch("dispatch-4");
    right.uid = UidCondition::Existing(uid);
    store.admit(right).await.unwrap();
    let mut missing = admission("dispatch-5", "assistant", "nobody", SubmissionKind::Dispatch, "x");
    missing.uid = UidCondition::Existing("inst_x".into());
    assert_eq!(
        store.admit(missing).await.unwrap_err(),
        StoreError::InstanceNotFound("nobody".into())
    );
}

/// Create-only admissions of one new instance racing (on Postgres, transactions that each find
/// it missing): exactly one creates it; every other is told it exists, under the winner's
/// incarnation, and leaves nothing behind.
pub async fn retains_one_identity_when_conflicting_creates_race(store: Factory) {
    let racers: Vec<_> = (0..8)
        .map(|i| {
            let store = store.clone();
            let create = Admission {
                uid: UidCondition::CreateOnly,
                initial_data: Some(serde_json::json!({ "racer": i })),
                ..dispatch(&format!("create-{i}"))
            };
            tokio::spawn(async move { store.admit(create).await })
        })
        .collect();
    let mut results = Vec::new();
    for racer in futures_util::future::join_all(racers).await {
        results.push(racer.unwrap());
    }
    let winners: Vec<usize> = (0..results.len()).filter(|i| results[*i].is_ok()).collect();
    assert_eq!(winners.len(), 1, "exactly one create wins: {results:?}");
    let winner = winners[0];
    let admitted = results[winner].as_ref().unwrap();
    assert!(!admitted.deduplicated);
    let info = store.instance(&key("assistant", "agent-1")).await.unwrap().unwrap();
    assert_eq!(info.uid, admitted.uid);
    for (i, result) in results.iter().enumerate().filter(|(i, _)| *i != winner) {
        assert_eq!(
            result.as_ref().map(|_| ()),
            Err(&StoreError::InstanceExists {
                id: "agent-1".into(),
                uid: info.uid.clone()
            }),
            "racer {i}"
        );
        assert!(
            store.submission(&format!("create-{i}")).await.unwrap().is_none(),
            "a refused create leaves no submission"
        );
    }
    let batches = store.read(&key("assistant", "agent-1"), None).await.unwrap();
    assert_eq!(batches.len(), 1, "one birth batch");
    assert_eq!(
        batches[0].records[0].body,
        RecordBody::ConversationCreated {
            uid: info.uid,
            initial_data: Some(serde_json::json!({ "racer": winner })),
            kind: None,
            parent: None,
            task_id: None,
            agent: None,
        },
        "the winner's creation data"
    );
    assert_eq!(
        row(&store, &format!("create-{winner}")).await.status,
        SubmissionStatus::Queued
    );
}

/// A create-only send whose answer was lost is retried with its idempotency key: the replay
/// gets the receipt (the instance it created does not refuse it), while another create-only
/// send is refused.
pub async fn answers_a_keyed_replay_of_a_create_only_send_with_its_receipt(store: Factory) {
    let create_only = |id: &str| Admission {
        keyed: true,
        uid: UidCondition::CreateOnly,
        ..dispatch(id)
    };
    let first = store.admit(create_only("keyed-1")).await.unwrap();
    let replay = store.admit(create_only("keyed-1")).await.unwrap();
    assert!(!first.deduplicated && replay.deduplicated);
    assert_eq!((replay.submission.id.as_str(), &replay.uid), ("keyed-1", &first.uid));
    match store.admit(create_only("keyed-2")).await {
        Err(StoreError::InstanceExists { uid, .. }) => assert_eq!(uid, first.uid),
        other => panic!("another create-only send: {other:?}"),
    }
}

/// Replays of one idempotency-keyed submission racing converge on one admission: once while
/// they also race to create the instance, once on an instance that exists.
pub async fn converges_concurrent_keyed_replays_on_one_submission(store: Factory) {
    let mut uids = Vec::new();
    for id in ["keyed-1", "keyed-2"] {
        let replays: Vec<_> = (0..8)
            .map(|_| {
                let store = store.clone();
                let replay = Admission {
                    keyed: true,
                    ..dispatch(id)
                };
                tokio::spawn(async move { store.admit(replay).await.unwrap() })
            })
            .collect();
        let mut admitted = Vec::new();
        for replay in futures_util::future::join_all(replays).await {
            admitted.push(replay.unwrap());
        }
        assert_eq!(
            admitted.iter().filter(|admitted| !admitted.deduplicated).count(),
            1,
            "{id}: admitted once"
        );
        let stored = row(&store, id).await;
        for replay in &admitted {
            assert_eq!(replay.submission, stored, "{id}: every replay answers with the one row");
            assert_eq!(replay.uid, admitted[0].uid);
        }
        uids.push(admitted[0].uid.clone());
    }
    assert_eq!(uids[0], uids[1], "one instance");
    assert_eq!(
        store.read(&key("assistant", "agent-1"), None).await.unwrap().len(),
        1,
        "one birth batch"
    );
    let mut order = Vec::new();
    for attempt_id in ["a1", "a2"] {
        let head = store
            .claim_next(&key("assistant", "agent-1"), &claim(attempt_id))
            .await
            .unwrap()
            .unwrap();
        order.push(head.id.clone());
        settle(&store, &attempt(&head.id, attempt_id), Outcome::Completed, None).await;
    }
    assert_eq!(order, ["keyed-1", "keyed-2"], "one queue entry each");
    assert!(!store.has_queued(&key("assistant", "agent-1")).await.unwrap());
}

// ---- ordering and claims --------------------------------------------------------------------

pub async fn orders_direct_and_dispatched_submissions_together_within_one_session(store: Factory) {
    admit(
        &store,
        admission("direct-1", "assistant", "agent-1", SubmissionKind::Direct, "Hello"),
    )
    .await;
    admit(&store, dispatch("dispatch-1")).await;
    admit(
        &store,
        admission("direct-2", "assistant", "agent-2", SubmissionKind::Direct, "Hello"),
    )
    .await;
    let head = store
        .claim_next(&key("assistant", "agent-1"), &claim("a1"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(head.id, "direct-1");
    assert!(
        store
            .claim_next(&key("assistant", "agent-1"), &claim("a2"))
            .await
            .unwrap()
            .is_none(),
        "dispatch-1 waits behind direct-1"
    );
    assert_eq!(
        store
            .claim_next(&key("assistant", "agent-2"), &claim("a3"))
            .await
            .unwrap()
            .unwrap()
            .id,
        "direct-2"
    );
}

pub async fn lists_queued_dispatches_in_admission_order_and_selects_one_runnable_head_per_session(store: Factory) {
    for id in ["d-1", "d-2", "d-3"] {
        admit(&store, dispatch(id)).await;
    }
    let rows: Vec<Submission> = [
        row(&store, "d-1").await,
        row(&store, "d-2").await,
        row(&store, "d-3").await,
    ]
    .into();
    assert!(rows.windows(2).all(|pair| pair[0].sequence < pair[1].sequence));
    let mut order = Vec::new();
    for round in 0..3 {
        let attempt_id = format!("a{round}");
        let head = store
            .claim_next(&key("assistant", "agent-1"), &claim(&attempt_id))
            .await
            .unwrap()
            .unwrap();
        assert!(
            store
                .claim_next(&key("assistant", "agent-1"), &claim("extra"))
                .await
                .unwrap()
                .is_none()
        );
        order.push(head.id.clone());
        settle(&store, &attempt(&head.id, &attempt_id), Outcome::Completed, None).await;
    }
    assert_eq!(order, ["d-1", "d-2", "d-3"]);
}

pub async fn keeps_agents_with_the_same_instance_id_in_independent_sessions(store: Factory) {
    admit(
        &store,
        admission("alpha-1", "alpha", "shared", SubmissionKind::Dispatch, "x"),
    )
    .await;
    admit(
        &store,
        admission("beta-1", "beta", "shared", SubmissionKind::Dispatch, "x"),
    )
    .await;
    assert_eq!(
        store
            .claim_next(&key("alpha", "shared"), &claim("a1"))
            .await
            .unwrap()
            .unwrap()
            .id,
        "alpha-1"
    );
    assert_eq!(
        store
            .claim_next(&key("beta", "shared"), &claim("b1"))
            .await
            .unwrap()
            .unwrap()
            .id,
        "beta-1"
    );
}

pub async fn claims_only_runnable_session_heads_while_allowing_separate_sessions_to_claim_independently(
    store: Factory,
) {
    admit(&store, dispatch("first")).await;
    admit(&store, dispatch("second")).await;
    admit(
        &store,
        admission("other", "assistant", "agent-2", SubmissionKind::Dispatch, "x"),
    )
    .await;
    let first = store
        .claim_next(&key("assistant", "agent-1"), &claim("a1"))
        .await
        .unwrap()
        .unwrap();
    let other = store
        .claim_next(&key("assistant", "agent-2"), &claim("a2"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((first.id.as_str(), other.id.as_str()), ("first", "other"));
    assert_eq!(first.status, SubmissionStatus::Running);
    assert_eq!(first.owner_id.as_deref(), Some("owner-a"));
    assert!(first.lease_until_ms > now_ms());
    assert_eq!(row(&store, "second").await.status, SubmissionStatus::Queued);
}

// ---- lifecycle --------------------------------------------------------------------------------

pub async fn requeues_a_running_attempt_on_ownership_alone(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    store
        .claim_next(&key("assistant", "agent-1"), &claim("owner"))
        .await
        .unwrap()
        .unwrap();
    assert!(!store.requeue(&attempt("d-1", "imposter")).await.unwrap());
    assert_eq!(row(&store, "d-1").await.status, SubmissionStatus::Running);
    assert!(store.requeue(&attempt("d-1", "owner")).await.unwrap());
    let requeued = row(&store, "d-1").await;
    assert_eq!(
        (requeued.status, requeued.attempt_id, requeued.lease_until_ms),
        (SubmissionStatus::Queued, None, 0)
    );
    let again = store
        .claim_next(&key("assistant", "agent-1"), &claim("next"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(again.attempt_count, 2, "attempts keep counting across requeues");
}

pub async fn reports_unsettled_visibility_until_a_claimed_dispatch_completes(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    assert!(store.has_queued(&key("assistant", "agent-1")).await.unwrap());
    store
        .claim_next(&key("assistant", "agent-1"), &claim("a1"))
        .await
        .unwrap()
        .unwrap();
    assert!(!store.has_queued(&key("assistant", "agent-1")).await.unwrap());
    assert_eq!(row(&store, "d-1").await.outcome, None);
    settle(&store, &attempt("d-1", "a1"), Outcome::Completed, None).await;
    let settled = row(&store, "d-1").await;
    assert_eq!(
        (settled.status, settled.outcome, settled.error),
        (SubmissionStatus::Settled, Some(Outcome::Completed), None)
    );
}

pub async fn ignores_stale_attempt_settlement_and_keeps_the_first_owning_terminal_state(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    store
        .claim_next(&key("assistant", "agent-1"), &claim("a1"))
        .await
        .unwrap()
        .unwrap();
    let stale = store
        .settle(&attempt("d-1", "stale"), Outcome::Completed, None, Vec::new())
        .await;
    assert!(matches!(stale, Err(StoreError::Fenced(_))));
    let error = SettlementError::new("operation_failed", "first");
    settle(&store, &attempt("d-1", "a1"), Outcome::Failed, Some(error.clone())).await;
    let late = store
        .settle(&attempt("d-1", "a1"), Outcome::Completed, None, Vec::new())
        .await;
    assert!(late.is_err());
    let settled = row(&store, "d-1").await;
    assert_eq!((settled.outcome, settled.error), (Some(Outcome::Failed), Some(error)));
}

// ---- abort requests ---------------------------------------------------------------------------

pub async fn stamps_an_abort_intent_on_a_queued_submission_without_changing_its_status(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    assert_eq!(
        store.request_abort(&key("assistant", "agent-1")).await.unwrap(),
        ["d-1"]
    );
    let stamped = row(&store, "d-1").await;
    assert!(stamped.abort_requested);
    assert_eq!(stamped.status, SubmissionStatus::Queued);
    // Asked again: the same answer, and the row as the first request left it.
    assert_eq!(
        store.request_abort(&key("assistant", "agent-1")).await.unwrap(),
        ["d-1"]
    );
    assert_eq!(row(&store, "d-1").await, stamped);
}

pub async fn stamps_the_running_head_and_every_queued_submission_in_the_session_at_once(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    admit(&store, dispatch("d-2")).await;
    store
        .claim_next(&key("assistant", "agent-1"), &claim("a1"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        store.request_abort(&key("assistant", "agent-1")).await.unwrap(),
        ["d-1", "d-2"]
    );
    let (head, queued) = (row(&store, "d-1").await, row(&store, "d-2").await);
    assert!(head.abort_requested && queued.abort_requested);
    assert_eq!(
        (head.status, head.attempt_id.as_deref()),
        (SubmissionStatus::Running, Some("a1"))
    );
}

pub async fn scopes_the_abort_to_one_agent_when_another_agent_shares_the_instance_id(store: Factory) {
    admit(
        &store,
        admission("alpha-1", "alpha", "shared", SubmissionKind::Dispatch, "x"),
    )
    .await;
    admit(
        &store,
        admission("beta-1", "beta", "shared", SubmissionKind::Dispatch, "x"),
    )
    .await;
    assert_eq!(store.request_abort(&key("alpha", "shared")).await.unwrap(), ["alpha-1"]);
    assert!(!row(&store, "beta-1").await.abort_requested);
}

pub async fn leaves_settled_submissions_untouched_and_does_not_resurrect_them(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    store
        .claim_next(&key("assistant", "agent-1"), &claim("a1"))
        .await
        .unwrap()
        .unwrap();
    settle(&store, &attempt("d-1", "a1"), Outcome::Completed, None).await;
    let settled = row(&store, "d-1").await;
    assert!(
        store
            .request_abort(&key("assistant", "agent-1"))
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(row(&store, "d-1").await, settled, "untouched");
    assert!(
        store
            .claim_next(&key("assistant", "agent-1"), &claim("a2"))
            .await
            .unwrap()
            .is_none()
    );
    assert!(store.expired(now_ms() + 60_000).await.unwrap().is_empty());
    assert_eq!(row(&store, "d-1").await.status, SubmissionStatus::Settled);
}

pub async fn returns_an_empty_array_for_a_session_with_no_unsettled_submissions(store: Factory) {
    assert!(
        store
            .request_abort(&key("assistant", "nobody"))
            .await
            .unwrap()
            .is_empty()
    );
}

// ---- durability and leases --------------------------------------------------------------------

pub async fn sets_attempt_count_to_1_at_claim_and_increments_it_on_reclaim(store: Factory) {
    let admitted = admit(&store, dispatch("d-1")).await;
    assert_eq!((admitted.attempt_count, admitted.max_attempts), (0, 10));
    let claimed = store
        .claim_next(&key("assistant", "agent-1"), &claim("a1"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claimed.attempt_count, 1);
    let reclaimed = store
        .reclaim("d-1", "a1", &claim("a2"), after_the_lease())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (reclaimed.attempt_count, reclaimed.attempt_id.as_deref()),
        (2, Some("a2"))
    );
}

pub async fn extends_lease_timestamp_for_owned_running_submissions(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    store
        .claim_next(&key("assistant", "agent-1"), &claim("a1"))
        .await
        .unwrap()
        .unwrap();
    let later = now_ms() + 90_000;
    assert_eq!(
        store.renew_leases("owner-a", &["a1".to_owned()], later).await.unwrap(),
        1
    );
    assert_eq!(row(&store, "d-1").await.lease_until_ms, later);
}

pub async fn ignores_submissions_owned_by_a_different_coordinator(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    store
        .claim_next(&key("assistant", "agent-1"), &claim("a1"))
        .await
        .unwrap()
        .unwrap();
    let before = row(&store, "d-1").await.lease_until_ms;
    assert_eq!(
        store
            .renew_leases("owner-b", &["a1".to_owned()], now_ms() + 90_000)
            .await
            .unwrap(),
        0
    );
    assert_eq!(row(&store, "d-1").await.lease_until_ms, before);
}

pub async fn leaves_the_lease_of_an_attempt_the_owner_no_longer_runs_to_expire(store: Factory) {
    two_running(&store).await;
    let before = row(&store, "d-2").await.lease_until_ms;
    let later = now_ms() + 90_000;
    assert_eq!(
        store.renew_leases("owner-a", &["a1".to_owned()], later).await.unwrap(),
        1
    );
    assert_eq!(row(&store, "d-1").await.lease_until_ms, later);
    assert_eq!(
        row(&store, "d-2").await.lease_until_ms,
        before,
        "a2 is not running any more"
    );
}

/// A settled row's lease is not renewed, even when its owner names its attempt (a late
/// heartbeat), and the renewal does not bring it back as running or expired.
pub async fn ignores_settled_submissions_when_renewing_leases(store: Factory) {
    two_running(&store).await;
    settle(&store, &attempt("d-1", "a1"), Outcome::Completed, None).await;
    let settled = row(&store, "d-1").await;
    let later = now_ms() + 90_000;
    let renewed = store
        .renew_leases("owner-a", &["a1".to_owned(), "a2".to_owned()], later)
        .await
        .unwrap();
    assert_eq!(renewed, 1, "only the running submission");
    assert_eq!(row(&store, "d-2").await.lease_until_ms, later);
    assert_eq!(row(&store, "d-1").await, settled, "the settled row is untouched");
    assert_eq!(
        store.renew_leases("owner-a", &["a1".to_owned()], later).await.unwrap(),
        0
    );
    assert_eq!(row(&store, "d-1").await, settled);
    let expired = store.expired(later + 60_000).await.unwrap();
    assert_eq!(
        expired.iter().map(|row| row.id.as_str()).collect::<Vec<_>>(),
        ["d-2"],
        "the settled row is never listed as expired"
    );
    assert!(
        store
            .reclaim("d-1", "a1", &claim("a3"), later + 60_000)
            .await
            .unwrap()
            .is_none(),
        "nor taken over"
    );
    assert!(
        store
            .claim_next(&key("assistant", "agent-1"), &claim("a4"))
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(row(&store, "d-1").await, settled);
}

pub async fn returns_running_submissions_with_expired_leases(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    let short = Claim {
        attempt_id: "a1".into(),
        owner_id: "owner-a".into(),
        lease_until_ms: 1,
    };
    store
        .claim_next(&key("assistant", "agent-1"), &short)
        .await
        .unwrap()
        .unwrap();
    let expired = store.expired(now_ms()).await.unwrap();
    assert_eq!(expired.iter().map(|row| row.id.as_str()).collect::<Vec<_>>(), ["d-1"]);
}

pub async fn excludes_submissions_with_future_lease_expiry(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    store
        .claim_next(&key("assistant", "agent-1"), &claim("a1"))
        .await
        .unwrap()
        .unwrap();
    assert!(store.expired(now_ms()).await.unwrap().is_empty());
}

pub async fn excludes_settled_submissions(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    let short = Claim {
        attempt_id: "a1".into(),
        owner_id: "owner-a".into(),
        lease_until_ms: 1,
    };
    store
        .claim_next(&key("assistant", "agent-1"), &short)
        .await
        .unwrap()
        .unwrap();
    settle(&store, &attempt("d-1", "a1"), Outcome::Completed, None).await;
    assert!(store.expired(now_ms()).await.unwrap().is_empty());
}

pub async fn returns_empty_when_no_submissions_exist(store: Factory) {
    assert!(store.expired(now_ms()).await.unwrap().is_empty());
}

pub async fn replaces_a_running_attempt_and_returns_the_updated_submission(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    store
        .claim_next(&key("assistant", "agent-1"), &claim("a1"))
        .await
        .unwrap()
        .unwrap();
    let next = Claim {
        attempt_id: "a2".into(),
        owner_id: "owner-b".into(),
        lease_until_ms: now_ms() + 30_000,
    };
    let replaced = store
        .reclaim("d-1", "a1", &next, after_the_lease())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (replaced.attempt_id.as_deref(), replaced.owner_id.as_deref()),
        (Some("a2"), Some("owner-b"))
    );
    assert_eq!(replaced.lease_until_ms, next.lease_until_ms);
    assert_eq!(row(&store, "d-1").await, replaced);
}

pub async fn does_not_take_over_a_lease_that_has_not_expired_by_the_takeover(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    store
        .claim_next(&key("assistant", "agent-1"), &claim("a1"))
        .await
        .unwrap()
        .unwrap();
    // The owner renewed after another node's scan listed the lease: the takeover, at `now`,
    // finds it running until later.
    assert!(
        store
            .reclaim("d-1", "a1", &claim("a2"), now_ms())
            .await
            .unwrap()
            .is_none()
    );
    let unchanged = row(&store, "d-1").await;
    assert_eq!(
        (unchanged.attempt_count, unchanged.attempt_id.as_deref()),
        (1, Some("a1"))
    );
}

pub async fn reports_the_running_attempts_whose_submission_has_an_abort_requested(store: Factory) {
    two_running(&store).await;
    let running = ["a1".to_owned(), "a2".to_owned(), "a3".to_owned()];
    assert!(store.aborts_requested(&running).await.unwrap().is_empty());
    store.request_abort(&key("assistant", "agent-2")).await.unwrap();
    assert_eq!(store.aborts_requested(&running).await.unwrap(), ["a2"]);
    assert!(
        store.aborts_requested(&["a1".to_owned()]).await.unwrap().is_empty(),
        "only the attempts asked about"
    );
}

pub async fn returns_null_without_writing_when_the_attempt_no_longer_owns_the_submission(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    store
        .claim_next(&key("assistant", "agent-1"), &claim("a1"))
        .await
        .unwrap()
        .unwrap();
    assert!(
        store
            .reclaim("d-1", "stale", &claim("a2"), after_the_lease())
            .await
            .unwrap()
            .is_none()
    );
    let unchanged = row(&store, "d-1").await;
    assert_eq!(
        (unchanged.attempt_count, unchanged.attempt_id.as_deref()),
        (1, Some("a1"))
    );
}

// ---- turn-boundary joins ----------------------------------------------------------------------

pub async fn claims_the_queued_dispatch_prefix_in_admission_order_onto_a_running_host(store: Factory) {
    let host = running_host(&store).await;
    admit(&store, dispatch("queued-1")).await;
    admit(&store, dispatch("queued-2")).await;
    let claimed = store.claim_joinable(&host).await.unwrap();
    assert_eq!(
        claimed.iter().map(|row| row.id.as_str()).collect::<Vec<_>>(),
        ["queued-1", "queued-2"]
    );
    for id in ["queued-1", "queued-2"] {
        let joining = row(&store, id).await;
        assert_eq!(
            (joining.status, joining.joined_into.as_deref()),
            (SubmissionStatus::Joining, Some("host-1"))
        );
    }
    assert!(store.claim_joinable(&host).await.unwrap().is_empty());
}

pub async fn claims_nothing_for_a_stale_attempt_or_a_host_that_is_not_running(store: Factory) {
    let host = running_host(&store).await;
    admit(&store, dispatch("queued-1")).await;
    assert!(
        store
            .claim_joinable(&attempt("host-1", "stale"))
            .await
            .unwrap()
            .is_empty()
    );
    settle(&store, &host, Outcome::Completed, None).await;
    assert!(store.claim_joinable(&host).await.unwrap().is_empty());
    assert_eq!(row(&store, "queued-1").await.status, SubmissionStatus::Queued);
}

pub async fn claims_direct_deliveries_alongside_dispatches(store: Factory) {
    let host = running_host(&store).await;
    admit(
        &store,
        admission("direct-1", "assistant", "agent-1", SubmissionKind::Direct, "Hello"),
    )
    .await;
    admit(&store, dispatch("queued-2")).await;
    let claimed = store.claim_joinable(&host).await.unwrap();
    assert_eq!(
        claimed.iter().map(|row| row.id.as_str()).collect::<Vec<_>>(),
        ["direct-1", "queued-2"]
    );
}

/// The reference's case, as this trait can reach it: an abort request flags every unsettled
/// submission of the instance, the running host with its deliveries, so the host claims
/// nothing, not even the delivery admitted after the abort. (A delivery flagged behind an
/// unflagged host cannot happen through the trait: the stores' per-row stop is a guard; this
/// case is the same outcome as the one below, reached from a flagged delivery.)
pub async fn stops_the_prefix_at_an_abort_requested_delivery(store: Factory) {
    let host = running_host(&store).await;
    admit(&store, dispatch("queued-1")).await;
    store.request_abort(&key("assistant", "agent-1")).await.unwrap();
    admit(&store, dispatch("queued-2")).await;
    assert!(
        store.claim_joinable(&host).await.unwrap().is_empty(),
        "queued-1 is abort-flagged: the prefix stops there"
    );
    assert_eq!(row(&store, "queued-2").await.status, SubmissionStatus::Queued);
}

/// A delivery admitted after an abort of its instance was requested is not part of what the
/// abort ends: the aborted host claims nothing more, and the delivery runs on its own after.
pub async fn claims_nothing_into_a_host_whose_abort_was_requested(store: Factory) {
    let host = running_host(&store).await;
    assert_eq!(
        store.request_abort(&key("assistant", "agent-1")).await.unwrap(),
        ["host-1"]
    );
    admit(&store, dispatch("queued-1")).await;
    assert!(
        store.claim_joinable(&host).await.unwrap().is_empty(),
        "the host is being aborted: it joins nothing"
    );
    let queued = row(&store, "queued-1").await;
    assert_eq!(
        (queued.status, queued.abort_requested),
        (SubmissionStatus::Queued, false)
    );
}

pub async fn finalizes_a_claimed_join_once_and_fences_on_the_host_attempt(store: Factory) {
    let host = running_host(&store).await;
    admit(&store, dispatch("queued-1")).await;
    store.claim_joinable(&host).await.unwrap();
    assert!(
        !store
            .finalize_join(&attempt("host-1", "stale"), "queued-1")
            .await
            .unwrap()
    );
    assert!(store.finalize_join(&host, "queued-1").await.unwrap());
    assert_eq!(row(&store, "queued-1").await.status, SubmissionStatus::Joined);
    assert!(!store.finalize_join(&host, "queued-1").await.unwrap());
}

pub async fn a_taken_over_host_reverts_the_joins_its_dead_attempt_never_applied(store: Factory) {
    let host = running_host(&store).await;
    admit(&store, dispatch("applied-1")).await;
    admit(&store, dispatch("cut-off-1")).await;
    store.claim_joinable(&host).await.unwrap();
    store.finalize_join(&host, "applied-1").await.unwrap();
    admit(&store, dispatch("later-1")).await;
    // The host's attempt died; another takes the host over.
    let taken = store
        .reclaim("host-1", "attempt-1", &claim("attempt-2"), after_the_lease())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(taken.attempt_id.as_deref(), Some("attempt-2"));
    let new_host = attempt("host-1", "attempt-2");
    assert_eq!(
        store.revert_joins(&host).await.unwrap(),
        0,
        "only the owning attempt reverts"
    );
    assert_eq!(row(&store, "cut-off-1").await.status, SubmissionStatus::Joining);
    assert_eq!(store.revert_joins(&new_host).await.unwrap(), 1);
    let reverted = row(&store, "cut-off-1").await;
    assert_eq!(
        (reverted.status, reverted.joined_into),
        (SubmissionStatus::Queued, None)
    );
    let applied = row(&store, "applied-1").await;
    assert_eq!(
        (applied.status, applied.joined_into.as_deref()),
        (SubmissionStatus::Joined, Some("host-1")),
        "an applied join stays"
    );
    // The reverted delivery joins again ahead of the one admitted after it.
    let claimed = store.claim_joinable(&new_host).await.unwrap();
    assert_eq!(
        claimed.iter().map(|row| row.id.as_str()).collect::<Vec<_>>(),
        ["cut-off-1", "later-1"]
    );
}

pub async fn joined_deliveries_settle_with_a_completing_host_and_joining_stragglers_revert(store: Factory) {
    let host = running_host(&store).await;
    admit(&store, dispatch("joined-1")).await;
    admit(&store, dispatch("straggler-1")).await;
    store.claim_joinable(&host).await.unwrap();
    store.finalize_join(&host, "joined-1").await.unwrap();
    settle(&store, &host, Outcome::Completed, None).await;
    let joined = row(&store, "joined-1").await;
    assert_eq!(
        (joined.status, joined.outcome),
        (SubmissionStatus::Settled, Some(Outcome::Completed))
    );
    let straggler = row(&store, "straggler-1").await;
    assert_eq!(
        (straggler.status, straggler.joined_into),
        (SubmissionStatus::Queued, None)
    );
    assert_eq!(
        store
            .claim_next(&key("assistant", "agent-1"), &claim("a9"))
            .await
            .unwrap()
            .unwrap()
            .id,
        "straggler-1"
    );
}

/// §5.2 "joined deliveries settle when a direct host finalizes its settlement": a direct
/// host (a `send`'s) with a direct and a dispatched delivery joined into it settles them with
/// it, completed, with no error of their own.
pub async fn joined_deliveries_settle_when_a_direct_host_finalizes_its_settlement(store: Factory) {
    admit(
        &store,
        admission("direct-host", "assistant", "agent-1", SubmissionKind::Direct, "Hello"),
    )
    .await;
    let claimed = store
        .claim_next(&key("assistant", "agent-1"), &claim("attempt-1"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claimed.id, "direct-host");
    let host = attempt("direct-host", "attempt-1");
    admit(
        &store,
        admission("direct-1", "assistant", "agent-1", SubmissionKind::Direct, "And this?"),
    )
    .await;
    admit(&store, dispatch("queued-1")).await;
    let joined: Vec<String> = store
        .claim_joinable(&host)
        .await
        .unwrap()
        .into_iter()
        .map(|row| row.id)
        .collect();
    assert_eq!(joined, ["direct-1", "queued-1"]);
    for delivery in &joined {
        assert!(store.finalize_join(&host, delivery).await.unwrap());
    }
    settle(&store, &host, Outcome::Completed, None).await;
    for id in ["direct-host", "direct-1", "queued-1"] {
        let settled = row(&store, id).await;
        assert_eq!(
            (settled.status, settled.outcome, settled.error),
            (SubmissionStatus::Settled, Some(Outcome::Completed), None),
            "{id}"
        );
    }
    assert_eq!(
        row(&store, "direct-1").await.joined_into.as_deref(),
        Some("direct-host")
    );
}

pub async fn joined_deliveries_share_a_failing_host_outcome(store: Factory) {
    let host = running_host(&store).await;
    admit(&store, dispatch("joined-1")).await;
    store.claim_joinable(&host).await.unwrap();
    store.finalize_join(&host, "joined-1").await.unwrap();
    let error = SettlementError::new("operation_failed", "model down");
    settle(&store, &host, Outcome::Failed, Some(error.clone())).await;
    let joined = row(&store, "joined-1").await;
    assert_eq!((joined.outcome, joined.error), (Some(Outcome::Failed), Some(error)));
}

pub async fn unsettled_joins_block_later_queued_work_and_clear_with_the_host(store: Factory) {
    let host = running_host(&store).await;
    admit(&store, dispatch("joined-1")).await;
    store.claim_joinable(&host).await.unwrap();
    store.finalize_join(&host, "joined-1").await.unwrap();
    admit(&store, dispatch("later-1")).await;
    assert!(
        store
            .claim_next(&key("assistant", "agent-1"), &claim("x"))
            .await
            .unwrap()
            .is_none()
    );
    settle(&store, &host, Outcome::Completed, None).await;
    assert_eq!(
        store
            .claim_next(&key("assistant", "agent-1"), &claim("y"))
            .await
            .unwrap()
            .unwrap()
            .id,
        "later-1"
    );
}

/// Not in the reference's checklists: the settling task learns from its settlement whether to
/// carry on with the queue, without a read of its own.
pub async fn settling_reports_whether_a_submission_of_the_instance_is_still_queued(store: Factory) {
    let completed = |store: &Factory, host: AttemptRef| {
        let store = store.clone();
        async move { settle(&store, &host, Outcome::Completed, None).await }
    };
    let next = |store: &Factory, attempt_id: &'static str| {
        let store = store.clone();
        async move {
            let claimed = store
                .claim_next(&key("assistant", "agent-1"), &claim(attempt_id))
                .await
                .unwrap()
                .unwrap();
            attempt(&claimed.id, attempt_id)
        }
    };
    // Nothing else on the instance; queued work on another instance does not count.
    let host = running_host(&store).await;
    admit(&store, dispatch_on("elsewhere-1", "agent-2")).await;
    assert!(!completed(&store, host).await);
    // A submission queued behind the running host.
    admit(&store, dispatch("d-1")).await;
    let host = next(&store, "a1").await;
    admit(&store, dispatch("d-2")).await;
    assert!(completed(&store, host).await);
    // A join claimed but never applied goes back to the queue: it counts.
    let host = next(&store, "a2").await;
    admit(&store, dispatch("d-3")).await;
    assert_eq!(store.claim_joinable(&host).await.unwrap().len(), 1);
    assert!(completed(&store, host).await);
    // A join applied settles with its host: nothing is left.
    let host = next(&store, "a3").await;
    admit(&store, dispatch("d-4")).await;
    store.claim_joinable(&host).await.unwrap();
    assert!(store.finalize_join(&host, "d-4").await.unwrap());
    assert!(!completed(&store, host).await);
    assert!(!store.has_queued(&key("assistant", "agent-1")).await.unwrap());
}

pub async fn request_session_abort_stamps_joining_and_joined_deliveries(store: Factory) {
    let host = running_host(&store).await;
    admit(&store, dispatch("joined-1")).await;
    admit(&store, dispatch("joining-1")).await;
    store.claim_joinable(&host).await.unwrap();
    store.finalize_join(&host, "joined-1").await.unwrap();
    let stamped = store.request_abort(&key("assistant", "agent-1")).await.unwrap();
    assert_eq!(stamped, ["host-1", "joined-1", "joining-1"]);
    // The rows carry the stamp (what a takeover reads), their status unchanged.
    for (id, status) in [
        ("host-1", SubmissionStatus::Running),
        ("joined-1", SubmissionStatus::Joined),
        ("joining-1", SubmissionStatus::Joining),
    ] {
        let row = row(&store, id).await;
        assert!(row.abort_requested, "{id} is stamped");
        assert_eq!(row.status, status, "{id}");
    }
}

// ---- edge cases -------------------------------------------------------------------------------

pub async fn reports_no_unsettled_submissions_initially(store: Factory) {
    assert!(!store.has_queued(&key("assistant", "agent-1")).await.unwrap());
    assert!(store.instances_with_queued().await.unwrap().is_empty());
}

pub async fn get_submission_returns_null_for_unknown_ids(store: Factory) {
    assert!(store.submission("missing").await.unwrap().is_none());
}

/// What a node's look for the settlements of the sends waiting on it reads (one read for
/// many waits): settled rows only, whatever their outcome; queued, running and unknown ids
/// are left out.
pub async fn names_the_settled_submissions_among_those_asked_about(store: Factory) {
    for (id, instance) in [
        ("d-1", "agent-1"),
        ("d-2", "agent-2"),
        ("d-3", "agent-3"),
        ("d-4", "agent-4"),
    ] {
        admit(&store, dispatch_on(id, instance)).await;
    }
    let none: Vec<String> = Vec::new();
    let asked = |ids: &[&str]| ids.iter().map(|id| (*id).to_owned()).collect::<Vec<String>>();
    let all = asked(&["d-1", "d-2", "d-3", "d-4", "missing"]);
    assert_eq!(store.settled_among(&all).await.unwrap(), none, "nothing settled yet");
    for (id, instance, attempt_id) in [
        ("d-1", "agent-1", "a1"),
        ("d-2", "agent-2", "a2"),
        ("d-4", "agent-4", "a4"),
    ] {
        store
            .claim_next(&key("assistant", instance), &claim(attempt_id))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row(&store, id).await.status, SubmissionStatus::Running);
    }
    settle(&store, &attempt("d-1", "a1"), Outcome::Completed, None).await;
    let error = SettlementError::new("operation_failed", "failed");
    settle(&store, &attempt("d-4", "a4"), Outcome::Failed, Some(error)).await;
    let mut settled = store.settled_among(&all).await.unwrap();
    settled.sort();
    assert_eq!(
        settled,
        asked(&["d-1", "d-4"]),
        "d-2 runs, d-3 is queued, \"missing\" is no submission"
    );
    assert_eq!(store.settled_among(&asked(&["d-4"])).await.unwrap(), asked(&["d-4"]));
    assert_eq!(store.settled_among(&asked(&["d-2", "d-3"])).await.unwrap(), none);
    assert_eq!(store.settled_among(&[]).await.unwrap(), none, "no ids, none settled");
}

// ---- conversation stream ------------------------------------------------------------------------

pub async fn appends_one_ordered_canonical_batch(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    let stream = key("assistant", "agent-1");
    let records = vec![record(None, None, user("a")), record(None, None, user("b"))];
    let offset = store.append(&stream, records.clone().into(), None).await.unwrap();
    assert_eq!(offset, 1, "the birth record is batch 0");
    let batches = store.read(&stream, Some(0)).await.unwrap();
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0].offset, 1);
    // The records as appended, in their order.
    assert_eq!(*batches[0].records, *records);
}

/// Not in the reference's checklists: a tool outcome's structured `output` reads back as
/// appended on every store: none, a JSON `null` (a tool that answered `null`, served as
/// `null`, not as the text the model read) or a value.
pub async fn round_trips_a_tool_outcomes_structured_output_null_included(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    let stream = key("assistant", "agent-1");
    let outcome = |call: &str, output: Option<serde_json::Value>| {
        record(
            None,
            None,
            RecordBody::ToolOutcome {
                assistant_message_id: "msg-1".into(),
                tool_call_id: call.into(),
                tool_name: "lookup".into(),
                is_error: false,
                content: "null".into(),
                output,
                terminate: false,
                duration_ms: 3,
            },
        )
    };
    let records = vec![
        outcome("call-none", None),
        outcome("call-null", Some(serde_json::Value::Null)),
        outcome("call-value", Some(serde_json::json!({"found": [1, 2.5, null]}))),
    ];
    let offset = store.append(&stream, records.clone().into(), None).await.unwrap();
    let batch = store.read(&stream, Some(offset - 1)).await.unwrap().remove(0);
    assert_eq!(*batch.records, *records);
    let outputs: Vec<_> = batch
        .records
        .iter()
        .map(|record| match &record.body {
            RecordBody::ToolOutcome { output, .. } => output.clone(),
            other => panic!("a tool outcome, not {other:?}"),
        })
        .collect();
    assert_eq!(
        outputs[1],
        Some(serde_json::Value::Null),
        "a null answer stays an answer"
    );
}

pub async fn assigns_one_indivisible_offset_to_a_multi_record_batch(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    let stream = key("assistant", "agent-1");
    let records: Vec<Record> = (0..5).map(|i| record(None, None, user(&format!("m{i}")))).collect();
    let offset = store.append(&stream, records.clone().into(), None).await.unwrap();
    assert!(store.read(&stream, Some(offset)).await.unwrap().is_empty());
    let batch = store.read(&stream, Some(offset - 1)).await.unwrap().remove(0);
    assert_eq!(*batch.records, *records);
}

pub async fn round_trips_a_batch_larger_than_a_backend_cell_size_cap(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    let stream = key("assistant", "agent-1");
    let big = "x".repeat(2_500_000);
    let offset = store
        .append(&stream, vec![record(None, None, user(&big))].into(), None)
        .await
        .unwrap();
    let next = store
        .append(&stream, vec![record(None, None, user("after"))].into(), None)
        .await
        .unwrap();
    assert_eq!(next, offset + 1);
    let batches = store.read(&stream, Some(offset - 1)).await.unwrap();
    let RecordBody::UserMessage { body, .. } = &batches[0].records[0].body else {
        panic!("user message")
    };
    assert_eq!(body.len(), 2_500_000);
}

/// A value `depth` arrays deep (built in code: no parse of outside input goes past 128).
fn nested(depth: usize) -> serde_json::Value {
    (0..depth).fold(serde_json::json!("core"), |inner, _| serde_json::json!([inner]))
}

/// Not in the reference's checklists: a value nested deeper than a store reads back (512
/// levels in all) is refused when it is written, changing nothing, instead of making its
/// stream, its queue or its user's values unreadable; one well past serde_json's own limit of
/// 128 levels is stored and read back.
pub async fn refuses_a_write_nested_deeper_than_it_reads_back_and_keeps_one_that_is_not(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    let stream = key("assistant", "agent-1");
    let state = |value| {
        record(
            None,
            None,
            RecordBody::StateWrite {
                name: "history".into(),
                value,
            },
        )
    };
    let refused = store
        .append(&stream, vec![state(nested(600))].into(), None)
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("deeper than 512 levels"), "{refused}");
    let kept = vec![state(nested(400))];
    let offset = store.append(&stream, kept.clone().into(), None).await.unwrap();
    assert_eq!(offset, 1, "the refused batch took no offset");
    let batches = store.read(&stream, Some(0)).await.unwrap();
    assert_eq!(batches.len(), 1);
    assert_eq!(*batches[0].records, *kept);

    let deep_birth = Admission {
        initial_data: Some(nested(600)),
        ..dispatch_on("d-deep", "agent-deep")
    };
    assert!(store.admit(deep_birth).await.is_err());
    assert_eq!(store.instance(&key("assistant", "agent-deep")).await.unwrap(), None);
    assert_eq!(store.submission("d-deep").await.unwrap(), None);
    let born = Admission {
        initial_data: Some(nested(400)),
        ..dispatch_on("d-born", "agent-born")
    };
    admit(&store, born).await;
    assert_eq!(row(&store, "d-born").await.initial_data, Some(nested(400)));

    let user = user_id("deep");
    assert!(
        store
            .set_user_value(&user, "history", Some(nested(600)), 1_000)
            .await
            .is_err()
    );
    assert_eq!(store.user_value(&user, "history").await.unwrap(), None);
    store
        .set_user_value(&user, "history", Some(nested(400)), 2_000)
        .await
        .unwrap();
    let stored = store.user_value(&user, "history").await.unwrap().unwrap();
    assert_eq!(stored.value, nested(400));
}

pub async fn authorizes_a_submission_owned_append_for_the_running_claimed_attempt(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    store
        .claim_next(&key("assistant", "agent-1"), &claim("a1"))
        .await
        .unwrap()
        .unwrap();
    let owned = record(Some("d-1"), Some("a1"), user("hi"));
    let offset = store
        .append(
            &key("assistant", "agent-1"),
            vec![owned.clone()].into(),
            Some(&attempt("d-1", "a1")),
        )
        .await
        .expect("the running claimed attempt may append its submission's records");
    // The batch is in the stream, as written, at the offset the append returned.
    let batches = store.read(&key("assistant", "agent-1"), None).await.unwrap();
    let appended = batches
        .iter()
        .find(|batch| batch.offset == offset)
        .expect("the appended batch");
    assert_eq!(appended.records.to_vec(), [owned]);
}

/// §5.3: a host writes the records of a delivery it claimed into its response (its input, its
/// start seam) while the delivery is `joining` and once it is `joined`, under its own attempt.
pub async fn authorizes_a_host_append_for_a_delivery_it_claimed_for_a_turn_boundary_join(store: Factory) {
    let host = running_host(&store).await;
    admit(&store, dispatch("queued-1")).await;
    assert_eq!(store.claim_joinable(&host).await.unwrap().len(), 1);
    let stream = key("assistant", "agent-1");
    let delivery = |body: &str| {
        vec![
            record(Some("queued-1"), Some("attempt-1"), user(body)),
            record(Some("host-1"), Some("attempt-1"), user("the host's own")),
        ]
    };
    let joining = store
        .append(&stream, delivery("joining").into(), Some(&host))
        .await
        .unwrap();
    assert!(store.finalize_join(&host, "queued-1").await.unwrap());
    let joined = store
        .append(&stream, delivery("joined").into(), Some(&host))
        .await
        .unwrap();
    assert_eq!(joined, joining + 1);
}

/// §5.3: a host's append may not carry the records of a submission it has not claimed (still
/// queued, another instance's, or joined into another host), nor records another attempt
/// wrote; the stream is unchanged.
pub async fn rejects_a_host_append_for_a_foreign_submission_it_has_not_claimed(store: Factory) {
    let host = running_host(&store).await;
    admit(&store, dispatch("queued-1")).await;
    admit(&store, dispatch_on("elsewhere-1", "agent-2")).await;
    let stream = key("assistant", "agent-1");
    let head = store.last_offset(&stream).await.unwrap();
    for foreign in [
        record(Some("queued-1"), Some("attempt-1"), user("not claimed")),
        record(Some("elsewhere-1"), Some("attempt-1"), user("another instance's")),
        record(Some("never-admitted"), Some("attempt-1"), user("unknown")),
        record(Some("host-1"), Some("attempt-0"), user("another attempt's")),
        record(None, Some("attempt-0"), user("another attempt's, of no submission")),
    ] {
        let batch = vec![record(Some("host-1"), Some("attempt-1"), user("own")), foreign];
        let refused = store.append(&stream, batch.into(), Some(&host)).await;
        assert!(matches!(refused, Err(StoreError::Fenced(_))), "{refused:?}");
    }
    // A delivery joined into another host (of another instance), joining or joined: its
    // records are that host's to write, not this one's.
    admit(&store, dispatch_on("host-3", "agent-3")).await;
    let other = store
        .claim_next(&key("assistant", "agent-3"), &claim("attempt-3"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(other.id, "host-3");
    admit(&store, dispatch_on("joined-elsewhere", "agent-3")).await;
    let other = attempt("host-3", "attempt-3");
    let joined: Vec<String> = store
        .claim_joinable(&other)
        .await
        .unwrap()
        .into_iter()
        .map(|row| row.id)
        .collect();
    assert_eq!(joined, ["joined-elsewhere"]);
    for finalized in [false, true] {
        if finalized {
            assert!(store.finalize_join(&other, "joined-elsewhere").await.unwrap());
        }
        let batch = vec![
            record(Some("host-1"), Some("attempt-1"), user("own")),
            record(
                Some("joined-elsewhere"),
                Some("attempt-1"),
                user("another host's delivery"),
            ),
        ];
        let refused = store.append(&stream, batch.into(), Some(&host)).await;
        assert!(
            matches!(refused, Err(StoreError::Fenced(_))),
            "finalized {finalized}: {refused:?}"
        );
    }
    // Without an authorization, no record may belong to a submission or an attempt.
    let unauthorized = store
        .append(
            &stream,
            vec![record(Some("host-1"), Some("attempt-1"), user("own"))].into(),
            None,
        )
        .await;
    assert!(matches!(unauthorized, Err(StoreError::Fenced(_))), "{unauthorized:?}");
    assert_eq!(store.last_offset(&stream).await.unwrap(), head, "nothing was appended");
    assert_eq!(row(&store, "queued-1").await.status, SubmissionStatus::Queued);
}

/// §5.3: an attempt writes its own instance's stream and its task children's streams, never
/// another agent's instance that shares the id, another instance of its own agent (one whose
/// id begins with its own included), or a child of either.
pub async fn rejects_a_submission_owned_append_from_another_agent_sharing_the_instance_id(store: Factory) {
    let host = running_host(&store).await;
    admit(
        &store,
        admission("o-1", "concierge", "agent-1", SubmissionKind::Dispatch, "hi"),
    )
    .await;
    admit(
        &store,
        admission("s-1", "assistant", "agent-2", SubmissionKind::Dispatch, "hi"),
    )
    .await;
    let owned = |text: &str| vec![record(Some(&host.submission_id), Some(&host.attempt_id), user(text))];
    for stream in [key("concierge", "agent-1"), key("assistant", "agent-2")] {
        let before = store.read(&stream, None).await.unwrap().len();
        let result = store.append(&stream, owned("intruding").into(), Some(&host)).await;
        assert!(matches!(result, Err(StoreError::Fenced(_))), "{stream}: {result:?}");
        assert_eq!(
            store.read(&stream, None).await.unwrap().len(),
            before,
            "{stream}: unchanged"
        );
        // Nor can it give that instance a task child.
        let birth = record(
            None,
            Some(&host.attempt_id),
            RecordBody::ConversationCreated {
                uid: "inst_intruder".into(),
                initial_data: None,
                kind: Some(flue_runtime::record::ConversationKind::Task),
                parent: None,
                task_id: Some("task_x".into()),
                agent: None,
            },
        );
        let child = key(&format!("{}:task", stream.agent), &format!("{}/task_x", stream.id));
        let result = store
            .create_child(&stream, owned("link").into(), &child, vec![birth].into(), Some(&host))
            .await;
        assert!(matches!(result, Err(StoreError::Fenced(_))), "{child}: {result:?}");
        assert!(
            store.read(&child, None).await.unwrap().is_empty(),
            "{child}: not created"
        );
    }
    // A stream that does not exist, of an instance not its own: fenced too (the fence is
    // reported before the missing stream, on every store).
    let nowhere = key("assistant", "nowhere");
    let result = store.append(&nowhere, owned("intruding").into(), Some(&host)).await;
    assert!(matches!(result, Err(StoreError::Fenced(_))), "{nowhere}: {result:?}");
    // Nor a task child of another instance whose id begins with its own and a `/` (one that
    // exists: its own attempt created it).
    admit(
        &store,
        admission("eu-1", "assistant", "agent-1/eu", SubmissionKind::Dispatch, "hi"),
    )
    .await;
    let eu = key("assistant", "agent-1/eu");
    store.claim_next(&eu, &claim("attempt-eu")).await.unwrap().unwrap();
    let eu_attempt = attempt("eu-1", "attempt-eu");
    let cousin = key("assistant:task", "agent-1/eu/task_x");
    let link = vec![record(Some("eu-1"), Some("attempt-eu"), user("link"))];
    let birth = vec![record(None, Some("attempt-eu"), user("child"))];
    store
        .create_child(&eu, link.into(), &cousin, birth.into(), Some(&eu_attempt))
        .await
        .unwrap();
    let before = store.read(&cousin, None).await.unwrap().len();
    let result = store.append(&cousin, owned("intruding").into(), Some(&host)).await;
    assert!(matches!(result, Err(StoreError::Fenced(_))), "{cousin}: {result:?}");
    assert_eq!(
        store.read(&cousin, None).await.unwrap().len(),
        before,
        "{cousin}: unchanged"
    );
    // Its own instance's stream takes the append.
    assert!(
        store
            .append(&key("assistant", "agent-1"), owned("mine").into(), Some(&host))
            .await
            .is_ok()
    );
}

pub async fn rejects_a_submission_owned_append_from_a_stale_attempt(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    store
        .claim_next(&key("assistant", "agent-1"), &claim("a1"))
        .await
        .unwrap()
        .unwrap();
    let stale = record(Some("d-1"), Some("old"), user("hi"));
    let result = store
        .append(
            &key("assistant", "agent-1"),
            vec![stale].into(),
            Some(&attempt("d-1", "old")),
        )
        .await;
    assert!(matches!(result, Err(StoreError::Fenced(_))));
    assert_eq!(
        store.read(&key("assistant", "agent-1"), None).await.unwrap().len(),
        1,
        "stream unchanged"
    );
}

/// A real takeover, as the runtime's scan does it: the host's lease runs out, another node
/// lists it expired and reclaims it under a new attempt. Every write of the dead attempt is
/// then refused (its appends and settlement fenced, its join claims and finalizations
/// answered with nothing), and the new attempt's are accepted. Unlike
/// [`rejects_a_submission_owned_append_from_a_stale_attempt`], the stale attempt did own the
/// submission.
pub async fn fences_the_attempt_a_takeover_replaced_and_accepts_its_successor(store: Factory) {
    let stream = key("assistant", "agent-1");
    admit(&store, dispatch("host-1")).await;
    let short = Claim {
        attempt_id: "attempt-1".into(),
        owner_id: "owner-a".into(),
        lease_until_ms: now_ms() + 200,
    };
    store.claim_next(&stream, &short).await.unwrap().unwrap();
    let dead = attempt("host-1", "attempt-1");
    admit(&store, dispatch("joining-1")).await;
    assert_eq!(
        store.claim_joinable(&dead).await.unwrap().len(),
        1,
        "claimed before it died"
    );
    store
        .append(
            &stream,
            vec![record(Some("host-1"), Some("attempt-1"), user("before"))].into(),
            Some(&dead),
        )
        .await
        .unwrap();
    admit(&store, dispatch("queued-1")).await;

    // The lease runs out; another node's scan finds it and takes the host over.
    while now_ms() <= short.lease_until_ms + 100 {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let expired = store.expired(now_ms()).await.unwrap();
    assert_eq!(
        expired
            .iter()
            .map(|row| (row.id.as_str(), row.attempt_id.as_deref()))
            .collect::<Vec<_>>(),
        [("host-1", Some("attempt-1"))]
    );
    let successor = Claim {
        attempt_id: "attempt-2".into(),
        owner_id: "owner-b".into(),
        lease_until_ms: now_ms() + 30_000,
    };
    let taken = store
        .reclaim("host-1", "attempt-1", &successor, now_ms())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (
            taken.attempt_id.as_deref(),
            taken.owner_id.as_deref(),
            taken.attempt_count
        ),
        (Some("attempt-2"), Some("owner-b"), 2)
    );
    let live = attempt("host-1", "attempt-2");
    let batches = store.read(&stream, None).await.unwrap().len();

    // The dead attempt, still holding its AttemptRef, is refused everywhere.
    let late = store
        .append(
            &stream,
            vec![record(Some("host-1"), Some("attempt-1"), user("late"))].into(),
            Some(&dead),
        )
        .await;
    assert!(matches!(late, Err(StoreError::Fenced(_))), "append: {late:?}");
    let link = vec![record(Some("host-1"), Some("attempt-1"), user("link"))].into();
    let birth = vec![record(None, Some("attempt-1"), user("child"))].into();
    let child = key("assistant:task", "agent-1/task_1");
    let spawned = store.create_child(&stream, link, &child, birth, Some(&dead)).await;
    assert!(
        matches!(spawned, Err(StoreError::Fenced(_))),
        "create_child: {spawned:?}"
    );
    assert!(store.read(&child, None).await.unwrap().is_empty(), "no child");
    let settled = store
        .settle(
            &dead,
            Outcome::Completed,
            None,
            vec![record(
                Some("host-1"),
                Some("attempt-1"),
                RecordBody::SubmissionSettled {
                    outcome: Outcome::Completed,
                    error: None,
                },
            )],
        )
        .await;
    assert!(matches!(settled, Err(StoreError::Fenced(_))), "settle: {settled:?}");
    assert!(store.claim_joinable(&dead).await.unwrap().is_empty(), "claim_joinable");
    assert_eq!(row(&store, "queued-1").await.status, SubmissionStatus::Queued);
    assert!(!store.finalize_join(&dead, "joining-1").await.unwrap(), "finalize_join");
    assert_eq!(row(&store, "joining-1").await.status, SubmissionStatus::Joining);
    assert!(!store.requeue(&dead).await.unwrap(), "requeue");
    assert_eq!(
        store
            .renew_leases("owner-a", &["attempt-1".to_owned()], now_ms() + 90_000)
            .await
            .unwrap(),
        0,
        "renew_leases"
    );
    assert_eq!(
        store.read(&stream, None).await.unwrap().len(),
        batches,
        "stream unchanged"
    );
    assert_eq!(row(&store, "host-1").await, taken, "host unchanged");

    // The successor's work is accepted.
    store
        .append(
            &stream,
            vec![record(Some("host-1"), Some("attempt-2"), user("resumed"))].into(),
            Some(&live),
        )
        .await
        .unwrap();
    assert!(store.finalize_join(&live, "joining-1").await.unwrap());
    let claimed = store.claim_joinable(&live).await.unwrap();
    assert_eq!(
        claimed.iter().map(|row| row.id.as_str()).collect::<Vec<_>>(),
        ["queued-1"]
    );
    assert!(
        settle(&store, &live, Outcome::Completed, None).await,
        "the unapplied join is queued again"
    );
    let host = row(&store, "host-1").await;
    assert_eq!(
        (host.status, host.outcome, host.attempt_id.as_deref()),
        (SubmissionStatus::Settled, Some(Outcome::Completed), Some("attempt-2"))
    );
    let joined = row(&store, "joining-1").await;
    assert_eq!(
        (joined.status, joined.outcome),
        (SubmissionStatus::Settled, Some(Outcome::Completed))
    );
    assert_eq!(row(&store, "queued-1").await.status, SubmissionStatus::Queued);
    let records: Vec<Record> = store
        .read(&stream, None)
        .await
        .unwrap()
        .iter()
        .flat_map(|batch| batch.records.iter().cloned())
        .collect();
    assert!(
        records.iter().all(
            |record| !matches!(&record.body, RecordBody::UserMessage { body, .. } if body == "late" || body == "link")
        ),
        "nothing of the dead attempt's after the takeover"
    );
    assert_eq!(
        records
            .iter()
            .filter(|record| matches!(record.body, RecordBody::SubmissionSettled { .. }))
            .map(|record| record.attempt_id.as_deref())
            .collect::<Vec<_>>(),
        [Some("attempt-2")],
        "one settlement, the successor's"
    );
}

pub async fn rejects_a_submission_owned_append_for_an_unknown_submission(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    let unknown = record(Some("nope"), Some("a1"), user("hi"));
    let result = store
        .append(
            &key("assistant", "agent-1"),
            vec![unknown].into(),
            Some(&attempt("nope", "a1")),
        )
        .await;
    assert!(matches!(result, Err(StoreError::Fenced(_))));
    // Nothing was written: the birth batch alone.
    let batches = store.read(&key("assistant", "agent-1"), None).await.unwrap();
    assert_eq!(batches.iter().map(|batch| batch.offset).collect::<Vec<_>>(), [0]);
}

/// A task's child conversation: its birth batch and the parent's link land together
/// (reference §3.3 "child creation"), and the child is a stream of its own.
pub async fn creates_a_child_stream_and_its_parent_link_in_one_step(store: Factory) {
    let host = running_host(&store).await;
    let parent = key("assistant", "agent-1");
    let child = key("assistant:task", "agent-1/task_1");
    let link = record(
        Some(&host.submission_id),
        Some(&host.attempt_id),
        RecordBody::ChildSessionRetained {
            task_id: "task_1".into(),
            kind: flue_runtime::record::ConversationKind::Task,
            child: child.clone(),
            parent_tool_call_id: "call_1".into(),
        },
    );
    let birth = record(
        None,
        Some(&host.attempt_id),
        RecordBody::ConversationCreated {
            uid: "inst_child".into(),
            initial_data: None,
            kind: Some(flue_runtime::record::ConversationKind::Task),
            parent: Some(parent.clone()),
            task_id: Some("task_1".into()),
            agent: Some("helper".into()),
        },
    );
    let offset = store
        .create_child(
            &parent,
            vec![link.clone()].into(),
            &child,
            vec![birth.clone(), record(None, None, user("do it"))].into(),
            Some(&host),
        )
        .await
        .unwrap();
    let parent_batches = store.read(&parent, None).await.unwrap();
    assert_eq!(offset, parent_batches.last().unwrap().offset);
    assert_eq!(&*parent_batches.last().unwrap().records, [link]);
    let child_batches = store.read(&child, None).await.unwrap();
    assert_eq!(child_batches.len(), 1);
    assert_eq!(child_batches[0].offset, 0);
    assert_eq!(child_batches[0].records[0], birth);
    // The child is appended to like any stream, apart from its parent's.
    let step = record(None, Some(&host.attempt_id), user("more"));
    assert_eq!(store.append(&child, vec![step].into(), Some(&host)).await.unwrap(), 1);
    assert_eq!(store.read(&parent, None).await.unwrap().len(), parent_batches.len());
    assert!(!store.has_queued(&child).await.unwrap());
    assert!(!store.instances_with_queued().await.unwrap().contains(&child));
}

pub async fn creates_neither_the_child_nor_the_link_when_the_attempt_is_fenced_or_the_child_exists(store: Factory) {
    let host = running_host(&store).await;
    let parent = key("assistant", "agent-1");
    let child = key("assistant:task", "agent-1/task_1");
    // The link as the authorizing attempt wrote it, so the store's own fence is what refuses
    // a stale attempt (a link of another attempt's is refused before the store is asked).
    let link_of = |attempt: &AttemptRef| {
        vec![record(
            Some(&attempt.submission_id),
            Some(&attempt.attempt_id),
            user("link"),
        )]
        .into()
    };
    let link = || link_of(&host);
    let birth = || {
        vec![record(
            None,
            None,
            RecordBody::ConversationCreated {
                uid: "inst_child".into(),
                initial_data: None,
                kind: Some(flue_runtime::record::ConversationKind::Task),
                parent: None,
                task_id: None,
                agent: None,
            },
        )]
        .into()
    };
    let before = store.read(&parent, None).await.unwrap().len();
    let stale_attempt = attempt("host-1", "old");
    let stale = store
        .create_child(&parent, link_of(&stale_attempt), &child, birth(), Some(&stale_attempt))
        .await;
    assert!(matches!(stale, Err(StoreError::Fenced(_))), "{stale:?}");
    assert!(store.read(&child, None).await.unwrap().is_empty(), "no child");
    assert_eq!(store.read(&parent, None).await.unwrap().len(), before, "no link");
    // No parent stream: refused by the store (the link names nothing the check refuses).
    let unowned = || vec![record(None, None, user("link"))].into();
    let missing = store
        .create_child(&key("assistant", "nobody"), unowned(), &child, birth(), None)
        .await;
    assert!(matches!(missing, Err(StoreError::Other(_))), "{missing:?}");
    assert!(store.read(&child, None).await.unwrap().is_empty(), "no child");

    store
        .create_child(&parent, link(), &child, birth(), Some(&host))
        .await
        .unwrap();
    let again = store.create_child(&parent, link(), &child, birth(), Some(&host)).await;
    assert!(again.is_err(), "a child is created once");
    assert_eq!(store.read(&parent, None).await.unwrap().len(), before + 1, "one link");
    assert_eq!(store.read(&child, None).await.unwrap().len(), 1, "one birth");
}

pub async fn keeps_the_streams_of_several_children_and_grandchildren_apart(store: Factory) {
    let host = running_host(&store).await;
    let parent = key("assistant", "agent-1");
    let children: Vec<InstanceKey> = (0..3)
        .map(|n| key("assistant:task", &format!("agent-1/task_{n}")))
        .chain([key("assistant:task", "agent-1/task_0/task_9")])
        .collect();
    for (n, child) in children.iter().enumerate() {
        let link = record(
            Some(&host.submission_id),
            Some(&host.attempt_id),
            user(&format!("link {n}")),
        );
        let birth = record(
            None,
            Some(&host.attempt_id),
            RecordBody::ConversationCreated {
                uid: format!("inst_child_{n}"),
                initial_data: None,
                kind: Some(flue_runtime::record::ConversationKind::Task),
                parent: None,
                task_id: Some(format!("task_{n}")),
                agent: None,
            },
        );
        store
            .create_child(&parent, vec![link].into(), child, vec![birth].into(), Some(&host))
            .await
            .unwrap();
    }
    // Interleaved appends: each lands in its own stream, at its own next offset.
    for round in 1..=2u64 {
        for (n, child) in children.iter().enumerate() {
            let step = record(None, Some(&host.attempt_id), user(&format!("child {n} round {round}")));
            assert_eq!(
                store.append(child, vec![step].into(), Some(&host)).await.unwrap(),
                round
            );
        }
    }
    for (n, child) in children.iter().enumerate() {
        let batches = store.read(child, None).await.unwrap();
        assert_eq!(batches.len(), 3, "{child}");
        for (round, batch) in batches.iter().enumerate().skip(1) {
            let texts: Vec<&str> = batch
                .records
                .iter()
                .filter_map(|record| match &record.body {
                    RecordBody::UserMessage { body, .. } => Some(body.as_str()),
                    _ => None,
                })
                .collect();
            assert_eq!(texts, [format!("child {n} round {round}")], "{child}");
        }
    }
    assert!(
        store
            .read(&parent, None)
            .await
            .unwrap()
            .iter()
            .flat_map(|batch| batch.records.iter())
            .all(|record| !matches!(&record.body, RecordBody::UserMessage { body, .. } if body.starts_with("child"))),
        "no child's record in the parent's stream"
    );
}

/// An empty batch is a malformed call: refused as such, before the fence (a stale attempt's
/// empty batch is not reported fenced) and whether or not the stream exists.
pub async fn rejects_an_empty_batch(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    let stale = attempt("d-1", "no-such-attempt");
    for (stream, authorization) in [
        (key("assistant", "agent-1"), None),
        (key("assistant", "agent-1"), Some(&stale)),
        (key("assistant", "never-admitted"), Some(&stale)),
    ] {
        let refused = store.append(&stream, Vec::new().into(), authorization).await;
        assert!(
            matches!(&refused, Err(StoreError::Other(message)) if message.contains("must not be empty")),
            "{stream}: {refused:?}"
        );
    }
    // A child's creation alike: an empty link (from a stale attempt too) or an empty birth.
    let child = key("assistant:task", "agent-1/task_1");
    let some = || -> Arc<[Record]> { vec![record(None, None, user("x"))].into() };
    for (link, birth, authorization) in [
        (Vec::new().into(), some(), Some(&stale)),
        (Vec::new().into(), some(), None),
        (some(), Vec::new().into(), None),
    ] {
        let refused = store
            .create_child(&key("assistant", "agent-1"), link, &child, birth, authorization)
            .await;
        assert!(
            matches!(&refused, Err(StoreError::Other(message)) if message.contains("must not be empty")),
            "{refused:?}"
        );
    }
    assert!(store.last_offset(&child).await.unwrap().is_none(), "no child stream");
}

pub async fn reports_a_streams_last_offset_without_reading_it(store: Factory) {
    let stream = key("assistant", "agent-1");
    assert_eq!(store.last_offset(&stream).await.unwrap(), None, "no stream yet");
    admit(&store, dispatch("d-1")).await;
    assert_eq!(store.last_offset(&stream).await.unwrap(), Some(0), "the birth batch");
    for i in 1..=3u64 {
        store
            .append(&stream, vec![record(None, None, user(&format!("m{i}")))].into(), None)
            .await
            .unwrap();
        assert_eq!(store.last_offset(&stream).await.unwrap(), Some(i));
    }
    // Another instance's stream, and a stream that does not exist, are their own.
    admit(&store, dispatch_on("d-2", "agent-2")).await;
    assert_eq!(store.last_offset(&key("assistant", "agent-2")).await.unwrap(), Some(0));
    assert_eq!(store.last_offset(&stream).await.unwrap(), Some(3));
    assert_eq!(store.last_offset(&key("assistant", "unknown")).await.unwrap(), None);
}

pub async fn replays_strictly_after_a_batch_offset(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    let stream = key("assistant", "agent-1");
    for i in 0..4 {
        store
            .append(&stream, vec![record(None, None, user(&format!("m{i}")))].into(), None)
            .await
            .unwrap();
    }
    let after = store.read(&stream, Some(2)).await.unwrap();
    assert_eq!(after.iter().map(|batch| batch.offset).collect::<Vec<_>>(), [3, 4]);
    assert_eq!(store.read(&stream, None).await.unwrap().len(), 5);
    assert!(store.read(&key("assistant", "unknown"), None).await.unwrap().is_empty());
    // After the last offset there can be, nothing (no overflow on the way).
    assert!(store.read(&stream, Some(u64::MAX)).await.unwrap().is_empty());
    assert!(store.read(&stream, Some(u64::MAX - 1)).await.unwrap().is_empty());
}

/// A page: the first `limit` batches after the offset, in order; fewer at the end of the
/// stream, none past it or for an unknown stream.
pub async fn reads_a_page_of_the_batches_after_an_offset(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    let stream = key("assistant", "agent-1");
    for i in 0..6 {
        store
            .append(&stream, vec![record(None, None, user(&format!("m{i}")))].into(), None)
            .await
            .unwrap();
    }
    let offsets =
        |batches: Vec<flue_runtime::record::Batch>| batches.iter().map(|batch| batch.offset).collect::<Vec<_>>();
    assert_eq!(offsets(store.read_page(&stream, None, 3).await.unwrap()), [0, 1, 2]);
    assert_eq!(offsets(store.read_page(&stream, Some(2), 3).await.unwrap()), [3, 4, 5]);
    assert_eq!(offsets(store.read_page(&stream, Some(4), 3).await.unwrap()), [5, 6]);
    assert_eq!(
        offsets(store.read_page(&stream, Some(1), usize::MAX).await.unwrap()),
        [2, 3, 4, 5, 6]
    );
    assert!(store.read_page(&stream, Some(1), 0).await.unwrap().is_empty());
    assert!(store.read_page(&stream, Some(6), 3).await.unwrap().is_empty());
    assert!(store.read_page(&stream, Some(u64::MAX), 3).await.unwrap().is_empty());
    assert!(
        store
            .read_page(&key("assistant", "unknown"), None, 3)
            .await
            .unwrap()
            .is_empty()
    );
    // A page holds the records its batches were appended with.
    let page = store.read_page(&stream, Some(3), 1).await.unwrap();
    assert_eq!(page[0].records, store.read(&stream, Some(3)).await.unwrap()[0].records);
}

pub async fn gives_concurrent_appends_distinct_consecutive_offsets(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    let stream = key("assistant", "agent-1");
    let mut tasks = Vec::new();
    for i in 0..16 {
        let store = store.clone();
        let stream = stream.clone();
        tasks.push(tokio::spawn(async move {
            store
                .append(&stream, vec![record(None, None, user(&format!("c{i}")))].into(), None)
                .await
                .unwrap()
        }));
    }
    let mut offsets = Vec::new();
    for (i, task) in tasks.into_iter().enumerate() {
        offsets.push((task.await.unwrap(), i));
    }
    offsets.sort_unstable();
    assert_eq!(
        offsets.iter().map(|(offset, _)| *offset).collect::<Vec<u64>>(),
        (1..=16).collect::<Vec<u64>>()
    );
    // Each append's batch is in the stream at the offset it was given, whole: none lost, none
    // written over.
    let batches = store.read(&stream, Some(0)).await.unwrap();
    assert_eq!(batches.len(), 16);
    for (batch, (offset, i)) in batches.iter().zip(&offsets) {
        assert_eq!(batch.offset, *offset);
        assert_eq!(batch.records.len(), 1);
        let RecordBody::UserMessage { body, .. } = &batch.records[0].body else {
            panic!("batch {offset}: {:?}", batch.records[0].body)
        };
        assert_eq!(*body, format!("c{i}"), "batch {offset}");
    }
}

pub async fn settles_with_its_records_in_the_same_step(store: Factory) {
    let host = running_host(&store).await;
    settle(&store, &host, Outcome::Completed, None).await;
    let batches = store.read(&key("assistant", "agent-1"), None).await.unwrap();
    let last = batches.last().unwrap();
    assert!(matches!(
        last.records[0].body,
        RecordBody::SubmissionSettled {
            outcome: Outcome::Completed,
            ..
        }
    ));
}

pub async fn lists_instances_with_queued_work(store: Factory) {
    admit(&store, dispatch("d-1")).await;
    admit(&store, admission("o-1", "other", "x", SubmissionKind::Dispatch, "x")).await;
    let mut keys = store.instances_with_queued().await.unwrap();
    keys.sort();
    assert_eq!(keys, [key("assistant", "agent-1"), key("other", "x")]);
    store
        .claim_next(&key("other", "x"), &claim("a"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        store.instances_with_queued().await.unwrap(),
        [key("assistant", "agent-1")]
    );
    // Queued behind a running submission: the node running it carries on with the queue.
    admit(&store, admission("o-2", "other", "x", SubmissionKind::Dispatch, "y")).await;
    assert_eq!(
        store.instances_with_queued().await.unwrap(),
        [key("assistant", "agent-1")]
    );
    settle(&store, &attempt("o-1", "a"), Outcome::Completed, None).await;
    let mut keys = store.instances_with_queued().await.unwrap();
    keys.sort();
    assert_eq!(keys, [key("assistant", "agent-1"), key("other", "x")]);
    // A host given back to the queue with a delivery it joined (which stays joined until the
    // host settles) waits for a node again.
    let host = store
        .claim_next(&key("other", "x"), &claim("b"))
        .await
        .unwrap()
        .unwrap();
    let host = attempt(&host.id, "b");
    admit(&store, admission("o-3", "other", "x", SubmissionKind::Dispatch, "z")).await;
    let joined = store.claim_joinable(&host).await.unwrap();
    assert!(!joined.is_empty());
    for delivery in &joined {
        assert!(store.finalize_join(&host, &delivery.id).await.unwrap());
    }
    assert!(store.requeue(&host).await.unwrap());
    let mut keys = store.instances_with_queued().await.unwrap();
    keys.sort();
    assert_eq!(keys, [key("assistant", "agent-1"), key("other", "x")]);
}

pub async fn stamps_the_timeout_deadline_at_the_first_claim_and_keeps_it_across_attempts(store: Factory) {
    let admitted = admit(&store, dispatch("d-1")).await;
    assert_eq!((admitted.timeout_ms, admitted.timeout_at_ms), (3_600_000, 0));
    let before = now_ms();
    let claimed = store
        .claim_next(&key("assistant", "agent-1"), &claim("a1"))
        .await
        .unwrap()
        .unwrap();
    let deadline = claimed.timeout_at_ms;
    assert!(
        (before + 3_600_000..=now_ms() + 3_600_000).contains(&deadline),
        "the deadline is the first claim plus the budget: {deadline}"
    );
    let reclaimed = store
        .reclaim("d-1", "a1", &claim("a2"), after_the_lease())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reclaimed.timeout_at_ms, deadline, "a reclaim keeps the deadline");
    assert!(store.requeue(&attempt("d-1", "a2")).await.unwrap());
    assert_eq!(row(&store, "d-1").await.timeout_at_ms, deadline, "a requeue keeps it");
    let again = store
        .claim_next(&key("assistant", "agent-1"), &claim("a3"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(again.timeout_at_ms, deadline, "a later claim keeps it");
}

/// An agent's own durability rather than the defaults (10 attempts, one hour): the attempt
/// budget and the wall-clock budget are stamped at admission and kept through every claim.
/// The values reach past 32 bits (an attempt budget past `i32`, a timeout past `u32`
/// milliseconds), which a narrow column would not keep; a timeout of `u64::MAX` (no budget)
/// keeps a deadline of never, without overflowing.
pub async fn keeps_a_custom_attempt_budget_and_timeout_through_admission_and_claims(store: Factory) {
    let budgets = [
        ("tight", 1_u32, 1_500_u64, false),
        ("wide", u32::MAX, 5_000_000_000_u64, true),
        ("endless", 3, u64::MAX, false),
    ];
    for (instance, max_attempts, timeout_ms, claim_at_admission) in budgets {
        let id = format!("{instance}-1");
        let stream = key("assistant", instance);
        let input = Admission {
            max_attempts,
            timeout_ms,
            claim: claim_at_admission.then(|| claim("a1")),
            ..admission(&id, "assistant", instance, SubmissionKind::Dispatch, "test.event")
        };
        let before = now_ms();
        let admitted = store.admit(input).await.unwrap();
        let durability = |row: &Submission| (row.max_attempts, row.timeout_ms);
        assert_eq!(
            durability(&admitted.submission),
            (max_attempts, timeout_ms),
            "{instance}"
        );
        assert_eq!(
            admitted.submission.timeout_at_ms, 0,
            "{instance}: no deadline before a claim"
        );
        let claimed = match admitted.claimed {
            Some(claimed) => claimed,
            None => {
                let queued = row(&store, &id).await;
                assert_eq!(
                    (durability(&queued), queued.timeout_at_ms),
                    ((max_attempts, timeout_ms), 0),
                    "{instance}: read back after admission"
                );
                store.claim_next(&stream, &claim("a1")).await.unwrap().unwrap()
            }
        };
        let deadline = claimed.timeout_at_ms;
        assert_eq!(durability(&claimed), (max_attempts, timeout_ms), "{instance}");
        assert!(
            (before.saturating_add(timeout_ms)..=now_ms().saturating_add(timeout_ms)).contains(&deadline),
            "{instance}: the deadline is the first claim plus the custom budget: {deadline}"
        );
        assert_eq!(row(&store, &id).await, claimed, "{instance}: read back after the claim");
        let reclaimed = store
            .reclaim(&id, "a1", &claim("a2"), after_the_lease())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (durability(&reclaimed), reclaimed.timeout_at_ms, reclaimed.attempt_count),
            ((max_attempts, timeout_ms), deadline, 2),
            "{instance}: a takeover keeps the budget"
        );
        assert!(store.requeue(&attempt(&id, "a2")).await.unwrap());
        let again = store.claim_next(&stream, &claim("a3")).await.unwrap().unwrap();
        assert_eq!(
            (durability(&again), again.timeout_at_ms, again.attempt_count),
            ((max_attempts, timeout_ms), deadline, 3),
            "{instance}: a claim after a requeue keeps the budget"
        );
        assert_eq!(
            row(&store, &id).await,
            again,
            "{instance}: read back after the last claim"
        );
    }
}

// ---- claiming at admission --------------------------------------------------------------------

/// `dispatch(id)` asking to claim the instance's head in the same step.
fn claiming(id: &str, attempt_id: &str) -> Admission {
    Admission {
        claim: Some(claim(attempt_id)),
        ..dispatch(id)
    }
}

pub async fn an_admission_with_a_claim_claims_the_idle_instances_head_in_the_same_step(store: Factory) {
    let before = now_ms();
    let admitted = store.admit(claiming("d-1", "a1")).await.unwrap();
    let claimed = admitted.claimed.expect("the idle instance's head is claimed");
    assert_eq!(claimed.id, "d-1");
    assert_eq!(claimed.status, SubmissionStatus::Running);
    assert_eq!(claimed.attempt_id.as_deref(), Some("a1"));
    assert_eq!(claimed.owner_id.as_deref(), Some("owner-a"));
    assert_eq!(claimed.attempt_count, 1);
    assert!(claimed.lease_until_ms > now_ms());
    assert!(
        claimed.timeout_at_ms >= before + 3_600_000,
        "the budget starts at this claim"
    );
    assert_eq!(
        row(&store, "d-1").await,
        claimed,
        "the claim is durable with the admission"
    );
    assert_eq!(
        store
            .claim_next(&key("assistant", "agent-1"), &claim("a2"))
            .await
            .unwrap(),
        None,
        "nothing is left to claim"
    );
    // The claimed attempt owns the submission like any other.
    store
        .append(
            &key("assistant", "agent-1"),
            vec![record(Some("d-1"), Some("a1"), user("hi"))].into(),
            Some(&attempt("d-1", "a1")),
        )
        .await
        .unwrap();
}

pub async fn an_admission_with_a_claim_claims_nothing_behind_earlier_unsettled_work(store: Factory) {
    admit(&store, dispatch("first")).await;
    let second = store.admit(claiming("second", "a1")).await.unwrap();
    assert_eq!(second.claimed, None, "an earlier submission is queued");
    assert_eq!(row(&store, "first").await.status, SubmissionStatus::Queued);
    assert_eq!(row(&store, "second").await.status, SubmissionStatus::Queued);
    store
        .claim_next(&key("assistant", "agent-1"), &claim("a2"))
        .await
        .unwrap()
        .unwrap();
    let third = store.admit(claiming("third", "a3")).await.unwrap();
    assert_eq!(third.claimed, None, "the head is running");
    assert_eq!(row(&store, "third").await.status, SubmissionStatus::Queued);
    let replay = store.admit(claiming("second", "a4")).await.unwrap();
    assert!(replay.deduplicated);
    assert_eq!(replay.claimed, None, "a replay claims nothing");
    assert_eq!(row(&store, "second").await.status, SubmissionStatus::Queued);
}

// ---- attachments (reference §5.4) -------------------------------------------------------------

fn image(id: &str, bytes: Vec<u8>) -> AttachmentPut {
    AttachmentPut::new(id, "image/png", bytes)
}

fn conversation() -> InstanceKey {
    key("assistant", "agent-1")
}

pub async fn returns_the_original_bytes_when_an_exact_conversation_attachment_is_put(store: Factory) {
    let put = image("att-1", vec![137, 80, 78, 71, 0, 255]);
    store.put_attachment(&conversation(), put.clone()).await.unwrap();
    let stored = store.attachment(&conversation(), "att-1").await.unwrap().unwrap();
    assert_eq!(stored.bytes, put.bytes);
    assert_eq!((stored.media_type.as_str(), stored.size), ("image/png", 6));
    assert_eq!(stored.digest, put.digest);
}

pub async fn returns_the_original_bytes_when_the_payload_exceeds_one_persisted_chunk(store: Factory) {
    let bytes: Vec<u8> = (0..ATTACHMENT_CHUNK_BYTES + 1).map(|i| (i % 251) as u8).collect();
    store
        .put_attachment(&conversation(), image("att-big", bytes.clone()))
        .await
        .unwrap();
    let stored = store.attachment(&conversation(), "att-big").await.unwrap().unwrap();
    assert_eq!(stored.bytes.len(), bytes.len());
    assert!(stored.bytes == bytes, "the chunks come back whole and in order");
}

pub async fn accepts_an_exact_retry_when_the_first_put_acknowledgement_is_uncertain(store: Factory) {
    let put = image("att-1", vec![1, 2, 3]);
    store.put_attachment(&conversation(), put.clone()).await.unwrap();
    store.put_attachment(&conversation(), put.clone()).await.unwrap();
    assert_eq!(
        store.attachment(&conversation(), "att-1").await.unwrap().unwrap().bytes,
        put.bytes
    );
}

pub async fn accepts_concurrent_exact_puts_when_one_attachment_identity_has_one_winner(store: Factory) {
    let put = image("att-1", vec![9; 1024]);
    let puts = (0..4).map(|_| {
        let (store, put) = (store.clone(), put.clone());
        tokio::spawn(async move { store.put_attachment(&conversation(), put).await })
    });
    for put in futures_util::future::join_all(puts).await {
        put.unwrap().unwrap();
    }
    assert_eq!(
        store.attachment(&conversation(), "att-1").await.unwrap().unwrap().bytes,
        put.bytes
    );
}

pub async fn throws_attachment_conflict_when_one_id_is_reused_with_different_bytes(store: Factory) {
    store
        .put_attachment(&conversation(), image("att-1", vec![1, 2, 3]))
        .await
        .unwrap();
    let error = store
        .put_attachment(&conversation(), image("att-1", vec![3, 2, 1]))
        .await
        .unwrap_err();
    assert!(
        matches!(error, StoreError::AttachmentConflict(ref id) if id == "att-1"),
        "{error}"
    );
    assert_eq!(
        store.attachment(&conversation(), "att-1").await.unwrap().unwrap().bytes,
        [1, 2, 3],
        "the first bytes stay"
    );
}

pub async fn throws_attachment_conflict_when_one_id_is_reused_for_a_different_conversation(store: Factory) {
    let put = image("att-1", vec![1, 2, 3]);
    store.put_attachment(&conversation(), put.clone()).await.unwrap();
    let error = store
        .put_attachment(&key("assistant", "agent-2"), put)
        .await
        .unwrap_err();
    assert!(matches!(error, StoreError::AttachmentConflict(_)), "{error}");
}

pub async fn throws_attachment_integrity_when_declared_size_differs_from_decoded_bytes(store: Factory) {
    let put = AttachmentPut {
        size: 4,
        ..image("att-1", vec![1, 2, 3])
    };
    let error = store.put_attachment(&conversation(), put).await.unwrap_err();
    assert!(matches!(error, StoreError::AttachmentIntegrity { .. }), "{error}");
    assert_eq!(store.attachment(&conversation(), "att-1").await.unwrap(), None);
}

pub async fn throws_attachment_integrity_when_declared_digest_differs_from_decoded_bytes(store: Factory) {
    let put = AttachmentPut {
        digest: flue_runtime::store::sha256_hex(b"other"),
        ..image("att-1", vec![1, 2, 3])
    };
    let error = store.put_attachment(&conversation(), put).await.unwrap_err();
    assert!(matches!(error, StoreError::AttachmentIntegrity { .. }), "{error}");
    assert_eq!(store.attachment(&conversation(), "att-1").await.unwrap(), None);
}

pub async fn returns_null_when_a_different_conversation_requests_an_existing_attachment(store: Factory) {
    store
        .put_attachment(&conversation(), image("att-1", vec![1, 2, 3]))
        .await
        .unwrap();
    assert_eq!(
        store.attachment(&key("assistant", "agent-2"), "att-1").await.unwrap(),
        None
    );
    assert_eq!(store.attachment(&key("other", "agent-1"), "att-1").await.unwrap(), None);
}

pub async fn returns_an_independent_byte_copy_when_stored_or_returned_arrays_are_mutated(store: Factory) {
    let mut bytes = vec![1, 2, 3];
    store
        .put_attachment(&conversation(), image("att-1", bytes.clone()))
        .await
        .unwrap();
    bytes[0] = 42;
    let mut first = store.attachment(&conversation(), "att-1").await.unwrap().unwrap();
    first.bytes[1] = 42;
    let second = store.attachment(&conversation(), "att-1").await.unwrap().unwrap();
    assert_eq!(second.bytes, [1, 2, 3]);
}

// ---- user values (UserState; not in the reference's store checklists) --------------------------

/// A user id no other case (or run sharing the database) uses.
fn user_id(name: &str) -> String {
    format!("{name}-{}", new_user_suffix())
}

fn new_user_suffix() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}-{}",
        std::process::id(),
        now_ms(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

pub async fn round_trips_a_user_value_and_deletes_it(store: Factory) {
    let user = user_id("ada");
    assert_eq!(store.user_value(&user, "theme").await.unwrap(), None);
    let value = serde_json::json!({"mode": "dark", "size": [1, 2]});
    store
        .set_user_value(&user, "theme", Some(value.clone()), 1_000)
        .await
        .unwrap();
    let stored = store.user_value(&user, "theme").await.unwrap().unwrap();
    assert_eq!(
        (stored.key.as_str(), &stored.value, stored.updated_at),
        ("theme", &value, 1_000)
    );
    store
        .set_user_value(&user, "theme", Some(serde_json::json!("light")), 2_000)
        .await
        .unwrap();
    let stored = store.user_value(&user, "theme").await.unwrap().unwrap();
    assert_eq!((stored.value, stored.updated_at), (serde_json::json!("light"), 2_000));
    store.set_user_value(&user, "theme", None, 3_000).await.unwrap();
    assert_eq!(store.user_value(&user, "theme").await.unwrap(), None);
    // Deleting what is absent is not an error.
    store.set_user_value(&user, "theme", None, 4_000).await.unwrap();
}

pub async fn lists_user_values_by_literal_prefix_in_key_order_with_the_total(store: Factory) {
    let user = user_id("grace");
    for (at, key) in ["pref:b", "pref:a", "pref%x", "pref_y", "other", "pref:c"]
        .into_iter()
        .enumerate()
    {
        store
            .set_user_value(&user, key, Some(serde_json::json!(at)), at as i64)
            .await
            .unwrap();
    }
    let page = |prefix: &str, limit: Option<usize>, offset: usize| UserValuesQuery {
        prefix: prefix.to_owned(),
        limit,
        offset,
    };
    let all = store.list_user_values(&user, &page("pref:", None, 0)).await.unwrap();
    let keys: Vec<&str> = all.entries.iter().map(|entry| entry.key.as_str()).collect();
    assert_eq!((keys, all.total), (vec!["pref:a", "pref:b", "pref:c"], 3));
    let second = store.list_user_values(&user, &page("pref:", Some(1), 1)).await.unwrap();
    assert_eq!(second.entries.len(), 1);
    assert_eq!((second.entries[0].key.as_str(), second.total), ("pref:b", 3));
    // A page past the end is empty, and still says the total.
    let past = store.list_user_values(&user, &page("pref:", Some(2), 5)).await.unwrap();
    assert_eq!((past.entries.len(), past.total), (0, 3));
    // `%` and `_` are characters, not wildcards.
    let literal = store.list_user_values(&user, &page("pref%", None, 0)).await.unwrap();
    assert_eq!(
        literal
            .entries
            .iter()
            .map(|entry| entry.key.as_str())
            .collect::<Vec<_>>(),
        ["pref%x"]
    );
    let everything = store.list_user_values(&user, &page("", None, 0)).await.unwrap();
    assert_eq!(everything.total, 6);
    assert_eq!(
        everything.entries.first().map(|entry| entry.key.as_str()),
        Some("other")
    );
}

pub async fn keeps_each_users_values_apart(store: Factory) {
    let (first, second) = (user_id("first"), user_id("second"));
    store
        .set_user_value(&first, "k", Some(serde_json::json!(1)), 1)
        .await
        .unwrap();
    assert_eq!(store.user_value(&second, "k").await.unwrap(), None);
    let listed = store
        .list_user_values(&second, &UserValuesQuery::default())
        .await
        .unwrap();
    assert_eq!(listed.total, 0);
}
