//! Webhooks: each wanted event is queued once per webhook from the webhook's creation on, a
//! session's deliveries are attempted strictly in `seq` order, failed attempts wait their
//! turn again, and the last failure dead-letters a delivery without holding back the rest.
//! Signing secrets are handed to attempts as they were last set, and stay readable across a
//! change of key.

use std::collections::HashSet;
use std::sync::Arc;

use ratchet_core::{DeliveryStatus, EventDraft, EventKind, Millis, SessionId, WebhookId};
use serde_json::json;

use super::{T0, config, submit, unique};
use ratchet_store::{
    AttemptOutcome, ClaimedDelivery, Error, Key, Keyring, NewWebhook, SessionSpec, Store, Webhook,
    WebhookDelivery,
};

const DISPATCHER_A: &str = "dispatcher-a";
const DISPATCHER_B: &str = "dispatcher-b";
const ATTEMPT_MS: Millis = 10_000;
const SECRET: &str = "a-secret-of-this-webhook";

async fn tenant_session(store: &dyn Store, tenant: &str) -> SessionId {
    let id = SessionId::from_suffix(&unique()).unwrap();
    let spec = SessionSpec {
        tenant: tenant.to_owned(),
        ..SessionSpec::default()
    };
    store
        .create_session(&id, spec, T0)
        .await
        .unwrap_or_else(|e| panic!("create_session {id}: {e}"));
    id
}

async fn webhook(
    hooks: &dyn Store,
    tenant: &str,
    events: Option<&[&str]>,
    max_attempts: u32,
) -> Webhook {
    let new = NewWebhook {
        id: WebhookId::from_suffix(&unique()).unwrap(),
        tenant: tenant.to_owned(),
        url: "http://127.0.0.1:9/hook".to_owned(),
        events: events.map(|kinds| kinds.iter().map(|k| (*k).to_owned()).collect()),
        secret: SECRET.to_owned(),
        max_attempts,
        request: None,
    };
    hooks
        .create_webhook(new, T0)
        .await
        .unwrap_or_else(|e| panic!("create_webhook: {e}"))
}

/// Writes `n` progress events into the session's run and returns their seqs.
async fn write_events(store: &dyn Store, session: &SessionId, n: usize, now: Millis) -> Vec<i64> {
    let (run, _) = submit(store, session, "go", config(), now).await;
    let drafts = (0..n)
        .map(|i| {
            EventDraft::new(
                EventKind::AssistantDelta,
                json!({ "text": format!("part {i}") }),
            )
        })
        .collect();
    store
        .append_events(session, &run, drafts, now)
        .await
        .unwrap_or_else(|e| panic!("append_events: {e}"))
        .iter()
        .map(|e| e.seq)
        .collect()
}

/// A webhook of `assistant.delta` events allowing `max_attempts`, and a session of its tenant
/// with `n` of them written and queued: the webhook, the session and the events' seqs.
async fn deltas_queued(
    store: &dyn Store,
    hooks: &dyn Store,
    max_attempts: u32,
    n: usize,
) -> (Webhook, SessionId, Vec<i64>) {
    let tenant = unique();
    let hook = webhook(hooks, &tenant, Some(&["assistant.delta"]), max_attempts).await;
    let session = tenant_session(store, &tenant).await;
    let seqs = write_events(store, &session, n, T0).await;
    queue_all(hooks, T0).await;
    (hook, session, seqs)
}

async fn finish(
    hooks: &dyn Store,
    claim: &ratchet_store::DeliveryClaim,
    outcome: AttemptOutcome,
    now: Millis,
) -> ratchet_store::Result<bool> {
    let recorded = hooks
        .finish_deliveries(vec![(claim.clone(), outcome)], now)
        .await?;
    Ok(recorded[0])
}

async fn queue_all(hooks: &dyn Store, now: Millis) {
    for _ in 0..100 {
        if hooks.queue_deliveries(3, now).await.unwrap() == 0 {
            return;
        }
    }
    panic!("queue_deliveries never caught up");
}

async fn log(hooks: &dyn Store, webhook: &WebhookId) -> Vec<WebhookDelivery> {
    hooks
        .deliveries(webhook, None, 0, 1_000)
        .await
        .unwrap_or_else(|e| panic!("deliveries of {webhook}: {e}"))
}

async fn all_events(store: &dyn Store, session: &SessionId) -> Vec<(i64, String)> {
    store
        .events_after(session, 0, 1_000)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.seq, e.kind))
        .collect()
}

async fn claim_deliveries(hooks: &dyn Store, owner: &str, now: Millis) -> Vec<ClaimedDelivery> {
    hooks
        .claim_deliveries(owner, now + ATTEMPT_MS, 100, now)
        .await
        .unwrap_or_else(|e| panic!("claim_deliveries: {e}"))
}

fn failed(retry_at: Option<Millis>) -> AttemptOutcome {
    AttemptOutcome::Failed {
        status: Some(503),
        error: "HTTP 503".to_owned(),
        retry_at,
    }
}

fn claimed_seqs(claimed: &[ClaimedDelivery]) -> Vec<(SessionId, i64)> {
    let mut seqs: Vec<_> = claimed
        .iter()
        .map(|d| (d.event.session_id.clone(), d.event.seq))
        .collect();
    seqs.sort();
    seqs
}

/// A webhook is sent the events written after it was created — every kind, or only the kinds
/// it names — of its own tenant's sessions only, each once, however often the queue is run
/// and however small its batches.
pub async fn a_webhook_is_queued_each_wanted_event_once_from_its_creation_on(
    store: &dyn Store,
    hooks: &dyn Store,
) {
    let tenant = unique();
    let before = tenant_session(store, &tenant).await;
    let written_before = write_events(store, &before, 2, T0).await;
    let every = webhook(hooks, &tenant, None, 5).await;
    let created = webhook(hooks, &tenant, Some(&["run.created"]), 5).await;
    let other_tenant = tenant_session(store, &unique()).await;
    write_events(store, &other_tenant, 2, T0 + 1).await;
    let later = write_events(store, &before, 3, T0 + 2).await;
    let fresh = tenant_session(store, &tenant).await;
    write_events(store, &fresh, 1, T0 + 3).await;

    queue_all(hooks, T0 + 4).await;
    queue_all(hooks, T0 + 5).await;

    let mut expected = Vec::new();
    for (session, after) in [(&before, *written_before.last().unwrap()), (&fresh, 0)] {
        for (seq, kind) in all_events(store, session).await {
            if seq > after {
                expected.push((session.clone(), seq, kind));
            }
        }
    }
    assert!(
        later.iter().all(|seq| expected.contains(&(
            before.clone(),
            *seq,
            "assistant.delta".to_owned()
        ))),
        "the events written after the webhook's creation are expected"
    );
    expected.sort();
    let mut queued: Vec<_> = log(hooks, &every.id)
        .await
        .into_iter()
        .map(|d| {
            assert_eq!(d.status, DeliveryStatus::Pending, "{d:?}");
            assert_eq!((d.attempts, d.max_attempts), (0, 5), "{d:?}");
            (d.session_id, d.seq, d.event_kind)
        })
        .collect();
    queued.sort();
    assert_eq!(
        queued, expected,
        "every event of the tenant's sessions written since the webhook's creation, once"
    );

    let wanted: Vec<_> = expected
        .iter()
        .filter(|(_, _, kind)| kind == "run.created")
        .cloned()
        .collect();
    assert_eq!(wanted.len(), 2, "one run was created in each session since");
    let mut got: Vec<_> = log(hooks, &created.id)
        .await
        .into_iter()
        .map(|d| (d.session_id, d.seq, d.event_kind))
        .collect();
    got.sort();
    assert_eq!(got, wanted, "a webhook naming kinds gets only those");
}

/// Only the earliest open delivery of each webhook and session is ever attempted: a later
/// event waits while an earlier one is in flight or waiting out its backoff.
pub async fn a_sessions_deliveries_are_attempted_strictly_in_seq_order(
    store: &dyn Store,
    hooks: &dyn Store,
) {
    let tenant = unique();
    let hook = webhook(hooks, &tenant, Some(&["assistant.delta"]), 5).await;
    let first = tenant_session(store, &tenant).await;
    let second = tenant_session(store, &tenant).await;
    let firsts = write_events(store, &first, 3, T0).await;
    let seconds = write_events(store, &second, 1, T0).await;
    queue_all(hooks, T0).await;

    let heads = claim_deliveries(hooks, DISPATCHER_A, T0 + 1).await;
    assert_eq!(
        claimed_seqs(&heads),
        [(first.clone(), firsts[0]), (second.clone(), seconds[0])],
        "one attempt per session, its earliest event"
    );
    for head in &heads {
        assert_eq!(head.claim.attempt, 1);
        assert_eq!(head.webhook_id, hook.id);
        assert_eq!(head.secret, SECRET);
        assert_eq!(head.event.kind, "assistant.delta");
        assert!(head.event.payload["text"].is_string(), "{:?}", head.event);
    }
    assert!(
        claim_deliveries(hooks, DISPATCHER_B, T0 + 2)
            .await
            .is_empty(),
        "nothing behind an attempt in flight"
    );

    let head = heads.iter().find(|d| d.event.session_id == first).unwrap();
    assert!(
        finish(hooks, &head.claim, failed(Some(T0 + 100)), T0 + 3)
            .await
            .unwrap()
    );
    assert!(
        claim_deliveries(hooks, DISPATCHER_B, T0 + 50)
            .await
            .is_empty(),
        "a failed attempt waits out its backoff, and the events behind it wait too"
    );
    let again = claim_deliveries(hooks, DISPATCHER_B, T0 + 100).await;
    assert_eq!(claimed_seqs(&again), [(first.clone(), firsts[0])]);
    assert_eq!(again[0].claim.attempt, 2);
    let delivered = AttemptOutcome::Delivered { status: 204 };
    let recorded = hooks
        .finish_deliveries(
            vec![
                (again[0].claim.clone(), delivered.clone()),
                (head.claim.clone(), delivered),
            ],
            T0 + 101,
        )
        .await
        .unwrap();
    assert_eq!(
        recorded,
        [true, false],
        "in one batch, each outcome is recorded only while its claim holds"
    );
    let next = claim_deliveries(hooks, DISPATCHER_B, T0 + 102).await;
    assert_eq!(
        claimed_seqs(&next),
        [(first.clone(), firsts[1])],
        "once delivered, the next event of the session is due"
    );

    let first_log: Vec<_> = log(hooks, &hook.id)
        .await
        .into_iter()
        .filter(|d| d.session_id == first)
        .collect();
    let done = &first_log[0];
    assert_eq!(done.status, DeliveryStatus::Delivered);
    assert_eq!(done.attempts, 2);
    assert_eq!(done.last_status, Some(204));
    assert_eq!(done.last_error, None, "a success clears the last error");
    assert_eq!(done.delivered_at, Some(T0 + 101));
    assert_eq!(first_log[1].status, DeliveryStatus::Delivering);
    assert_eq!(first_log[2].status, DeliveryStatus::Pending);
}

/// The last failed attempt dead-letters a delivery, with why, and the session's next event
/// goes on; the delivery log can be read by status.
pub async fn a_delivery_is_dead_lettered_after_its_last_attempt_and_the_rest_go_on(
    store: &dyn Store,
    hooks: &dyn Store,
) {
    let (hook, session, seqs) = deltas_queued(store, hooks, 2, 2).await;

    let first = claim_deliveries(hooks, DISPATCHER_A, T0 + 1).await;
    assert!(
        finish(hooks, &first[0].claim, failed(Some(T0 + 10)), T0 + 2)
            .await
            .unwrap()
    );
    let last = claim_deliveries(hooks, DISPATCHER_A, T0 + 10).await;
    assert_eq!(last[0].claim.attempt, 2);
    assert!(
        finish(hooks, &last[0].claim, failed(None), T0 + 11)
            .await
            .unwrap()
    );
    let next = claim_deliveries(hooks, DISPATCHER_A, T0 + 12).await;
    assert_eq!(claimed_seqs(&next), [(session.clone(), seqs[1])]);

    let dead = hooks
        .deliveries(&hook.id, Some(DeliveryStatus::DeadLetter), 0, 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].seq, seqs[0]);
    assert_eq!(dead[0].attempts, 2);
    assert_eq!(dead[0].last_status, Some(503));
    assert_eq!(dead[0].last_error.as_deref(), Some("HTTP 503"));
    assert_eq!(dead[0].available_at, None);
    let pending = hooks
        .deliveries(&hook.id, Some(DeliveryStatus::Pending), 0, 10)
        .await
        .unwrap();
    assert!(pending.is_empty(), "{pending:?}");
    let paged = hooks
        .deliveries(&hook.id, None, dead[0].id, 10)
        .await
        .unwrap();
    assert_eq!(
        paged.iter().map(|d| d.seq).collect::<Vec<_>>(),
        [seqs[1]],
        "a page starts after the given delivery"
    );
}

/// An operator requeues a dead delivery: pending again, due now, its attempts counted afresh,
/// and the next claim sends it. A repeat changes nothing; a delivery that is not a dead letter
/// is refused; the bulk requeue takes every dead letter of the webhook, and none twice.
pub async fn an_operator_requeues_dead_deliveries_once(store: &dyn Store, hooks: &dyn Store) {
    let (hook, session, seqs) = deltas_queued(store, hooks, 2, 2).await;
    let refused = hooks.requeue_delivery(&hook.id, 1_000_000, T0).await;
    assert!(
        matches!(refused, Err(Error::NotFound { .. })),
        "{refused:?}"
    );
    let open = hooks.deliveries(&hook.id, None, 0, 10).await.unwrap();
    let refused = hooks.requeue_delivery(&hook.id, open[0].id, T0).await;
    assert!(
        matches!(&refused, Err(Error::Conflict(m)) if m.contains("only a dead letter")),
        "a pending delivery: {refused:?}"
    );
    for seq in [seqs[0], seqs[1]] {
        let claimed = claim_deliveries(hooks, DISPATCHER_A, T0 + 1).await;
        assert_eq!(claimed_seqs(&claimed), [(session.clone(), seq)]);
        let dead = failed(None);
        assert!(
            finish(hooks, &claimed[0].claim, dead, T0 + 2)
                .await
                .unwrap()
        );
    }
    let dead = hooks
        .deliveries(&hook.id, Some(DeliveryStatus::DeadLetter), 0, 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 2);

    let requeued = hooks
        .requeue_delivery(&hook.id, dead[0].id, T0 + 5)
        .await
        .unwrap();
    assert_eq!(
        (
            requeued.status,
            requeued.attempts,
            requeued.available_at,
            requeued.requeued_at
        ),
        (DeliveryStatus::Pending, 0, Some(T0 + 5), Some(T0 + 5))
    );
    let again = hooks
        .requeue_delivery(&hook.id, dead[0].id, T0 + 6)
        .await
        .unwrap();
    assert_eq!(again, requeued, "a repeat changes nothing");
    assert_eq!(
        hooks
            .requeue_dead_deliveries(&hook.id, T0 + 7)
            .await
            .unwrap(),
        1,
        "the other dead letter"
    );
    assert_eq!(
        hooks
            .requeue_dead_deliveries(&hook.id, T0 + 8)
            .await
            .unwrap(),
        0
    );
    let claimed = claim_deliveries(hooks, DISPATCHER_A, T0 + 9).await;
    assert_eq!(
        (claimed_seqs(&claimed), claimed[0].claim.attempt),
        (vec![(session.clone(), seqs[0])], 1),
        "sent again in seq order, its first attempt since the requeue"
    );
    let delivered = AttemptOutcome::Delivered { status: 200 };
    assert!(
        finish(hooks, &claimed[0].claim, delivered, T0 + 10)
            .await
            .unwrap()
    );
    let after = hooks
        .requeue_delivery(&hook.id, dead[0].id, T0 + 11)
        .await
        .unwrap();
    assert_eq!(
        after.status,
        DeliveryStatus::Delivered,
        "a repeat after it was delivered still changes nothing"
    );
}

/// A receiver down for long does not grow the log without end: pending deliveries older than
/// the max age are dead-lettered as expired, and past the open bound of a webhook and session
/// the oldest pending ones go; a delivery in flight is left to its attempt.
pub async fn open_deliveries_are_kept_within_their_age_and_count(
    store: &dyn Store,
    hooks: &dyn Store,
) {
    let (hook, session, seqs) = deltas_queued(store, hooks, 5, 4).await;
    let in_flight = claim_deliveries(hooks, DISPATCHER_A, T0 + 1).await;
    assert_eq!(claimed_seqs(&in_flight), [(session.clone(), seqs[0])]);
    let bounds = |max_age_ms, max_open_per_session| ratchet_store::DeliveryBounds {
        max_age_ms,
        max_open_per_session,
    };
    assert_eq!(
        hooks
            .bound_deliveries(bounds(1_000, 4), T0 + 2)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        hooks
            .bound_deliveries(bounds(1_000, 2), T0 + 2)
            .await
            .unwrap(),
        2,
        "four open, two allowed: the two oldest pending ones go"
    );
    let log = hooks.deliveries(&hook.id, None, 0, 10).await.unwrap();
    let statuses: Vec<_> = log.iter().map(|d| (d.seq, d.status)).collect();
    assert_eq!(
        statuses,
        [
            (seqs[0], DeliveryStatus::Delivering),
            (seqs[1], DeliveryStatus::DeadLetter),
            (seqs[2], DeliveryStatus::DeadLetter),
            (seqs[3], DeliveryStatus::Pending),
        ]
    );
    assert!(
        log[1].last_error.as_deref().unwrap().starts_with("dropped"),
        "{log:?}"
    );
    assert_eq!(
        hooks
            .bound_deliveries(bounds(1_000, 10), T0 + 1_000)
            .await
            .unwrap(),
        1,
        "the pending one queued 1000 ms ago expires; the one in flight is left to its attempt"
    );
    let log = hooks.deliveries(&hook.id, None, 0, 10).await.unwrap();
    assert_eq!(
        (log[0].status, log[3].status),
        (DeliveryStatus::Delivering, DeliveryStatus::DeadLetter)
    );
    assert!(
        log[3].last_error.as_deref().unwrap().starts_with("expired"),
        "{log:?}"
    );
}

/// A dispatcher that stops mid-attempt loses its claim when the lease expires: the attempt
/// is made again (counted), and the old claim can no longer record an outcome. An expired
/// last attempt is dead-lettered instead of being made once more.
pub async fn an_expired_attempt_is_taken_over_and_the_old_claim_is_refused(
    store: &dyn Store,
    hooks: &dyn Store,
) {
    let (hook, session, seqs) = deltas_queued(store, hooks, 2, 2).await;

    let lost = claim_deliveries(hooks, DISPATCHER_A, T0).await;
    assert!(
        claim_deliveries(hooks, DISPATCHER_B, T0 + ATTEMPT_MS - 1)
            .await
            .is_empty(),
        "a live lease is not taken over"
    );
    let taken = claim_deliveries(hooks, DISPATCHER_B, T0 + ATTEMPT_MS).await;
    assert_eq!(claimed_seqs(&taken), [(session.clone(), seqs[0])]);
    assert_eq!(taken[0].claim.attempt, 2);
    assert!(
        !finish(
            hooks,
            &lost[0].claim,
            AttemptOutcome::Delivered { status: 200 },
            T0 + ATTEMPT_MS + 1
        )
        .await
        .unwrap(),
        "the old claim records nothing"
    );
    assert_eq!(
        log(hooks, &hook.id).await[0].status,
        DeliveryStatus::Delivering
    );

    let expired = T0 + 3 * ATTEMPT_MS;
    let next = claim_deliveries(hooks, DISPATCHER_A, expired).await;
    assert_eq!(
        claimed_seqs(&next),
        [(session.clone(), seqs[1])],
        "the expired last attempt is dead-lettered and the next event is due"
    );
    let first = &log(hooks, &hook.id).await[0];
    assert_eq!(first.status, DeliveryStatus::DeadLetter);
    assert_eq!(first.attempts, 2);
    assert!(
        first
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains("unknown"),
        "{first:?}"
    );
    assert!(
        !finish(
            hooks,
            &taken[0].claim,
            AttemptOutcome::Delivered { status: 200 },
            expired + 1
        )
        .await
        .unwrap(),
        "a dead-lettered delivery takes no outcome"
    );
}

/// Webhooks are listed per tenant; deleting one removes it with its deliveries, so nothing
/// more is attempted for it; unknown ids are `NotFound`.
pub async fn webhooks_are_listed_per_tenant_and_deleted_with_their_deliveries(
    store: &dyn Store,
    hooks: &dyn Store,
) {
    let tenant = unique();
    let first = webhook(hooks, &tenant, None, 3).await;
    let second = webhook(hooks, &tenant, Some(&["run.created", "run.finished"]), 4).await;
    webhook(hooks, &unique(), None, 3).await;
    let listed = hooks.webhooks(&tenant).await.unwrap();
    assert_eq!(listed, [first.clone(), second.clone()]);
    assert_eq!(hooks.get_webhook(&second.id).await.unwrap(), second);
    assert_eq!(
        second.events.as_deref(),
        Some(&["run.created".to_owned(), "run.finished".to_owned()][..])
    );
    assert!(second.wants("run.finished") && !second.wants("assistant.delta"));
    assert!(first.wants("assistant.delta"));

    let session = tenant_session(store, &tenant).await;
    write_events(store, &session, 1, T0).await;
    queue_all(hooks, T0).await;
    assert!(!log(hooks, &first.id).await.is_empty());
    hooks.delete_webhook(&first.id).await.unwrap();
    assert!(matches!(
        hooks.get_webhook(&first.id).await,
        Err(Error::NotFound {
            kind: "webhook",
            ..
        })
    ));
    assert!(matches!(
        hooks.deliveries(&first.id, None, 0, 10).await,
        Err(Error::NotFound {
            kind: "webhook",
            ..
        })
    ));
    assert!(matches!(
        hooks.delete_webhook(&first.id).await,
        Err(Error::NotFound {
            kind: "webhook",
            ..
        })
    ));
    let claimed = claim_deliveries(hooks, DISPATCHER_A, T0 + 1).await;
    assert_eq!(
        claimed
            .iter()
            .map(|d| d.event.kind.as_str())
            .collect::<Vec<_>>(),
        ["run.created"],
        "the remaining webhook's delivery is attempted"
    );
    assert!(
        claimed.iter().all(|d| d.webhook_id == second.id),
        "nothing is attempted for a deleted webhook"
    );
    assert_eq!(hooks.webhooks(&tenant).await.unwrap(), [second]);
}

/// Dispatchers racing over the same deliveries (processes sharing a database) make each
/// attempt once: no delivery is handed to two of them.
pub async fn concurrent_dispatchers_claim_each_attempt_once(
    store: Arc<dyn Store>,
    hooks: Arc<dyn Store>,
) {
    let tenant = unique();
    webhook(&*hooks, &tenant, Some(&["assistant.delta"]), 3).await;
    for _ in 0..8 {
        let session = tenant_session(&*store, &tenant).await;
        write_events(&*store, &session, 2, T0).await;
    }
    let queuers: Vec<_> = (0..2)
        .map(|_| {
            let hooks = Arc::clone(&hooks);
            tokio::spawn(async move { queue_all(&*hooks, T0).await })
        })
        .collect();
    for queuer in queuers {
        queuer.await.unwrap();
    }
    let claimers: Vec<_> = [DISPATCHER_A, DISPATCHER_B, "dispatcher-c"]
        .into_iter()
        .map(|owner| {
            let hooks = Arc::clone(&hooks);
            tokio::spawn(async move {
                let mut got = Vec::new();
                for i in 0..4 {
                    got.extend(
                        hooks
                            .claim_deliveries(owner, T0 + ATTEMPT_MS, 3, T0 + i)
                            .await
                            .unwrap_or_else(|e| panic!("{owner} claims: {e}")),
                    );
                }
                got
            })
        })
        .collect();
    let mut seen = HashSet::new();
    for claimer in claimers {
        for delivery in claimer.await.unwrap() {
            assert!(
                seen.insert(delivery.claim.delivery_id),
                "delivery {} was handed out twice",
                delivery.claim.delivery_id
            );
        }
    }
    assert_eq!(seen.len(), 8, "every session's first event, once");
}

/// A new secret signs the attempts claimed after it, a delivery already failing included;
/// another webhook's secret stays as it was.
pub async fn a_rotated_secret_signs_the_attempts_claimed_after_it(
    store: &dyn Store,
    hooks: &dyn Store,
) {
    let (hook, _, _) = deltas_queued(store, hooks, 5, 1).await;
    let (other, _, _) = deltas_queued(store, hooks, 5, 1).await;
    let first = claim_deliveries(hooks, DISPATCHER_A, T0 + 1).await;
    assert!(first.iter().all(|d| d.secret == SECRET), "{first:?}");
    let mine = first.iter().find(|d| d.webhook_id == hook.id).unwrap();
    assert!(
        finish(hooks, &mine.claim, failed(Some(T0 + 10)), T0 + 2)
            .await
            .unwrap()
    );

    hooks
        .rotate_webhook_secret(&hook.id, "the-new-secret-of-it".to_owned(), None)
        .await
        .unwrap();
    let again = claim_deliveries(hooks, DISPATCHER_A, T0 + 10).await;
    assert_eq!(again.len(), 1, "{again:?}");
    assert_eq!(
        (&again[0].webhook_id, again[0].secret.as_str()),
        (&hook.id, "the-new-secret-of-it"),
        "the failed delivery's next attempt is signed with the new secret"
    );
    let theirs = first.iter().find(|d| d.webhook_id == other.id).unwrap();
    assert!(
        finish(hooks, &theirs.claim, failed(Some(T0 + 10)), T0 + 3)
            .await
            .unwrap()
    );
    let untouched = claim_deliveries(hooks, DISPATCHER_A, T0 + 11).await;
    assert_eq!(
        untouched
            .iter()
            .map(|d| (&d.webhook_id, d.secret.as_str()))
            .collect::<Vec<_>>(),
        [(&other.id, SECRET)]
    );

    let unknown = WebhookId::from_suffix(&unique()).unwrap();
    assert!(matches!(
        hooks
            .rotate_webhook_secret(&unknown, "whatever-whatever".to_owned(), None)
            .await,
        Err(Error::NotFound {
            kind: "webhook",
            ..
        })
    ));
}

/// Secrets are sealed with the store's key and open only with it: a store whose keys do not
/// include the one that sealed a secret refuses to claim its attempts or to seal it again,
/// rather than sign with something else. With the old key given as a previous one, every
/// secret is sealed again under the new key, after which the old key is not needed.
///
/// Not in `store_conformance_tests!`, which hands each test one store: each backend runs it
/// with `open`, which opens its database (the same one every call) with the given keys.
pub async fn secrets_are_sealed_with_the_stores_key_and_sealed_again_under_a_new_one(
    open: impl Fn(Keyring) -> Arc<dyn Store>,
) {
    let old = Key::generate().unwrap();
    let new = Key::generate().unwrap();
    let keys = |current: &Key, previous: &[&Key]| {
        Keyring::new(
            current.clone(),
            previous.iter().map(|k| (*k).clone()).collect(),
        )
        .unwrap()
    };
    let before = open(keys(&old, &[]));
    let (hook, _, _) = deltas_queued(&*before, &*before, 5, 1).await;

    let without_old = open(keys(&new, &[]));
    for refused in [
        without_old
            .claim_deliveries(DISPATCHER_A, T0 + ATTEMPT_MS, 10, T0 + 1)
            .await
            .map(|_| 0),
        without_old.seal_webhook_secrets().await,
    ] {
        match refused {
            Err(Error::Secrets(message)) => assert!(
                message.contains(&hook.id.to_string())
                    && message.contains(&format!("sealed with key {}", old.id())),
                "{message}"
            ),
            other => panic!("expected a refusal naming the missing key, found {other:?}"),
        }
    }

    let rotating = open(keys(&new, &[&old]));
    assert_eq!(rotating.seal_webhook_secrets().await.unwrap(), 1);
    assert_eq!(
        rotating.seal_webhook_secrets().await.unwrap(),
        0,
        "nothing is left under the old key"
    );
    let after = open(keys(&new, &[]));
    let claimed = claim_deliveries(&*after, DISPATCHER_A, T0 + 1).await;
    assert_eq!(
        claimed
            .iter()
            .map(|d| (&d.webhook_id, d.secret.as_str()))
            .collect::<Vec<_>>(),
        [(&hook.id, SECRET)],
        "the new key alone opens the secret"
    );
    assert!(
        matches!(
            open(keys(&old, &[]))
                .claim_deliveries(DISPATCHER_B, T0 + 3 * ATTEMPT_MS, 10, T0 + 2 * ATTEMPT_MS)
                .await,
            Err(Error::Secrets(_))
        ),
        "the old key alone no longer opens it"
    );
}
