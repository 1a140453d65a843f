//! Idempotent requests: a key is taken once, answered once and replayed until it expires; a
//! keyed message or session records its effect in its own transaction, so a repeat after its
//! holder died answers from it; a mark that lost its key writes nothing.

use std::sync::Arc;

use ratchet_core::{MessageId, RunId, RunStatus, SessionId};
use ratchet_store::{
    Effect, Error, KeyedRequest, NewRun, RequestClaim, RequestKey, RequestMark, SessionSpec, Store,
    StoredResponse, WhenBusy,
};

use super::{T0, config, new_session, unique};

const TTL_MS: i64 = 3_600_000;
/// How long the suite's requests hold their key.
const HOLD_MS: i64 = 30_000;

fn keyed(tenant: &str, key: &str, path: &str, body_hash: &str, now: i64) -> KeyedRequest {
    KeyedRequest {
        key: RequestKey::parse(tenant, key).unwrap(),
        method: "POST".into(),
        path: path.into(),
        body_hash: body_hash.into(),
        held_until: now + HOLD_MS,
        expires_at: now + TTL_MS,
    }
}

async fn begin(store: &dyn Store, request: &KeyedRequest, now: i64) -> RequestClaim {
    store
        .begin_request(request.clone(), now)
        .await
        .unwrap_or_else(|e| panic!("begin_request {:?} at {now}: {e}", request.key))
}

fn executes(claim: RequestClaim) -> RequestMark {
    match claim {
        RequestClaim::Execute(mark) => mark,
        other => panic!("expected the key to be taken, found {other:?}"),
    }
}

fn message(session: &SessionId, request: Option<RequestMark>) -> NewRun {
    NewRun {
        session_id: session.clone(),
        run_id: RunId::from_suffix(&unique()).unwrap(),
        message_id: MessageId::from_suffix(&unique()).unwrap(),
        content: "keyed hello".into(),
        config: config(),
        when_busy: WhenBusy::Enqueue,
        quota: Default::default(),
        trace: None,
        request,
    }
}

fn response(body: &str) -> StoredResponse {
    StoredResponse {
        status: 202,
        body: body.into(),
    }
}

/// The first request takes the key; its response is replayed to every repeat, whatever the
/// hold; another path or body with the key is a mismatch; a repeat while it is held is in
/// progress; a key given back is taken again; keys are per tenant; and expired keys are
/// swept, after which the key is new.
pub async fn a_keyed_request_is_carried_out_once_and_its_response_replayed(store: &dyn Store) {
    let (tenant, key) = (unique(), unique());
    let path = "/v1/sessions/x/messages";
    let request = keyed(&tenant, &key, path, "body-1", T0);
    let mark = executes(begin(store, &request, T0).await);
    assert_eq!(mark.attempt, 1);
    assert_eq!(
        begin(store, &request, T0 + 1).await,
        RequestClaim::InProgress {
            held_until: T0 + HOLD_MS
        },
        "a repeat while the first is carried out"
    );
    let other_body = keyed(&tenant, &key, path, "body-2", T0);
    let other_path = keyed(&tenant, &key, "/v1/sessions", "body-1", T0);
    for other in [&other_body, &other_path] {
        assert_eq!(
            begin(store, other, T0 + 2).await,
            RequestClaim::Mismatch {
                method: "POST".into(),
                path: path.into()
            }
        );
    }
    assert!(
        store
            .finish_request(&mark, response("{\"a\":1}"))
            .await
            .unwrap()
    );
    assert!(
        !store
            .finish_request(&mark, response("{\"b\":2}"))
            .await
            .unwrap(),
        "a key is answered once"
    );
    for now in [T0 + 3, T0 + HOLD_MS + 5] {
        assert_eq!(
            begin(store, &request, now).await,
            RequestClaim::Replay(response("{\"a\":1}"))
        );
    }
    // Another tenant's key of the same name is its own.
    let theirs = keyed(&unique(), &key, path, "body-1", T0);
    executes(begin(store, &theirs, T0 + 4).await);

    // A key given back is taken afresh by the next request.
    let given_back = keyed(&tenant, &unique(), path, "body-1", T0);
    let mark = executes(begin(store, &given_back, T0).await);
    store.abandon_request(&mark).await.unwrap();
    executes(begin(store, &given_back, T0 + 1).await);

    // Expired keys are swept, and only they; a swept key is new again.
    let short = KeyedRequest {
        expires_at: T0 + 10,
        ..keyed(&tenant, &unique(), path, "body-1", T0)
    };
    let mark = executes(begin(store, &short, T0).await);
    assert!(
        store
            .finish_request(&mark, response("short"))
            .await
            .unwrap()
    );
    let swept = store.sweep_requests(T0 + 10).await.unwrap();
    assert!(swept >= 1, "the expired key was swept; swept {swept}");
    assert_eq!(executes(begin(store, &short, T0 + 11).await).attempt, 1);
    assert_eq!(
        begin(store, &request, T0 + 12).await,
        RequestClaim::Replay(response("{\"a\":1}")),
        "a key that has not expired is kept"
    );
}

/// A keyed message and a keyed session record their effect with the key in their own
/// transaction. When the holder dies before answering, a repeat past the hold answers from
/// that effect (the run is not submitted again), under a new attempt; the dead holder's
/// mark can neither answer nor record another effect, and what it tried wrote nothing.
pub async fn a_keyed_effect_is_recorded_with_its_key_and_recovered_after_its_holder_died(
    store: &dyn Store,
) {
    let session = new_session(store).await;
    let tenant = ratchet_store::DEFAULT_TENANT;
    let path = format!("/v1/sessions/{session}/messages");
    let request = keyed(tenant, &unique(), &path, "hello", T0);
    let mark = executes(begin(store, &request, T0).await);
    let new = message(&session, Some(mark.clone()));
    let (run_id, message_id) = (new.run_id.clone(), new.message_id.clone());
    let submitted = store.submit_message(new, T0).await.unwrap();
    assert_eq!(submitted.status, RunStatus::Running);

    let after_hold = T0 + HOLD_MS;
    let expected = Effect::Submitted {
        message_id,
        run_id: run_id.clone(),
        status: RunStatus::Running,
        steered: false,
    };
    let recovered = match begin(store, &request, after_hold).await {
        RequestClaim::Recovered { mark, effect } => {
            assert_eq!(effect, expected);
            mark
        }
        other => panic!("expected the committed message to be recovered, found {other:?}"),
    };
    assert_eq!(recovered.attempt, 2);
    assert!(
        !store.finish_request(&mark, response("late")).await.unwrap(),
        "the dead holder's mark no longer answers"
    );
    let late = store
        .submit_message(message(&session, Some(mark.clone())), after_hold)
        .await;
    assert!(
        matches!(late, Err(Error::Conflict(_))),
        "a message under a lost mark is refused: {late:?}"
    );
    let runs = store.session_runs(&session, None, 10).await.unwrap();
    assert_eq!(
        runs.iter().map(|r| r.run_id.clone()).collect::<Vec<_>>(),
        vec![run_id],
        "the session has the keyed run only"
    );
    assert!(
        store
            .finish_request(&recovered, response("ok"))
            .await
            .unwrap()
    );
    assert_eq!(
        begin(store, &request, after_hold + 1).await,
        RequestClaim::Replay(response("ok"))
    );

    // A keyed session: the effect names it, and a lost mark creates none.
    let request = keyed(tenant, &unique(), "/v1/sessions", "{}", T0);
    let mark = executes(begin(store, &request, T0).await);
    let created = SessionId::from_suffix(&unique()).unwrap();
    let spec = SessionSpec {
        request: Some(mark.clone()),
        ..SessionSpec::default()
    };
    store.create_session(&created, spec, T0).await.unwrap();
    let RequestClaim::Recovered { effect, .. } = begin(store, &request, after_hold).await else {
        panic!("expected the created session to be recovered");
    };
    assert_eq!(
        effect,
        Effect::SessionCreated {
            session_id: created
        }
    );
    let orphan = SessionId::from_suffix(&unique()).unwrap();
    let spec = SessionSpec {
        request: Some(mark),
        ..SessionSpec::default()
    };
    let refused = store.create_session(&orphan, spec, after_hold).await;
    assert!(matches!(refused, Err(Error::Conflict(_))), "{refused:?}");
    assert!(
        matches!(
            store.get_session(&orphan).await,
            Err(Error::NotFound { .. })
        ),
        "a session refused under a lost mark is not written"
    );

    // A key whose holder died without an effect is simply taken over.
    let request = keyed(tenant, &unique(), "/v1/runs/x/cancel", "", T0);
    executes(begin(store, &request, T0).await);
    assert_eq!(
        executes(begin(store, &request, after_hold).await).attempt,
        2
    );
}

/// Many requests with one key at once, through handles that may be separate connections:
/// exactly one takes the key, every other finds it in progress.
pub async fn concurrent_requests_with_one_key_have_one_holder(store: Arc<dyn Store>) {
    let request = keyed(&unique(), &unique(), "/v1/sessions", "{}", T0);
    let racers: Vec<_> = (0..8)
        .map(|_| {
            let (store, request) = (Arc::clone(&store), request.clone());
            tokio::spawn(async move { store.begin_request(request, T0).await })
        })
        .collect();
    let mut taken = 0;
    for racer in racers {
        match racer
            .await
            .expect("begin task panicked")
            .expect("begin_request failed")
        {
            RequestClaim::Execute(_) => taken += 1,
            RequestClaim::InProgress { .. } => {}
            other => panic!("a racer found {other:?}"),
        }
    }
    assert_eq!(taken, 1, "exactly one racer may take the key");
}

/// A keyed retry, a keyed webhook and a keyed rotation of its secret record what they did with
/// the key in their own transaction, the secret left out: a repeat after the holder died
/// answers from that record. Under a mark that lost its key each is refused and changes
/// nothing: the run that failed again stays failed, no webhook is created.
pub async fn keyed_resumes_webhooks_and_rotations_record_their_effect(store: &dyn Store) {
    let tenant = ratchet_store::DEFAULT_TENANT;
    let after_hold = T0 + HOLD_MS;
    let recovered = |claim: RequestClaim| match claim {
        RequestClaim::Recovered { effect, .. } => effect,
        other => panic!("expected a recorded effect, found {other:?}"),
    };

    let session = new_session(store).await;
    let (run, _) = super::submit(store, &session, "flaky", config(), T0).await;
    let fail = async |now: i64| {
        let claimed = super::claim(store, super::OWNER_A, now).await;
        let failed = ratchet_core::step::finish_step(
            claimed.state,
            &claimed.job,
            ratchet_core::StopReason::LlmError,
            now,
            now + 1,
        );
        super::commit(store, &claimed.claim, failed, None, now + 1).await;
    };
    fail(T0 + 1).await;
    let request = keyed(tenant, &unique(), &format!("/v1/runs/{run}/retry"), "", T0);
    let mark = executes(begin(store, &request, T0).await);
    let retry = ratchet_core::step::Resumption::Retry;
    (store.resume_failed(&run, retry, Some(mark.clone()), T0 + 3))
        .await
        .unwrap();
    let effect = recovered(begin(store, &request, after_hold).await);
    assert_eq!(
        effect,
        Effect::Resumed {
            run_id: run.clone()
        }
    );
    fail(after_hold + 1).await;
    let late = (store.resume_failed(&run, retry, Some(mark), after_hold + 3)).await;
    assert!(matches!(late, Err(Error::Conflict(_))), "{late:?}");
    assert_eq!(super::load(store, &run).await.status, RunStatus::Failed);

    let request = keyed(tenant, &unique(), "/v1/webhooks", "{}", T0);
    let mark = executes(begin(store, &request, T0).await);
    let webhook = |suffix: &str, mark: &RequestMark| ratchet_store::NewWebhook {
        id: ratchet_core::WebhookId::from_suffix(suffix).unwrap(),
        tenant: tenant.to_owned(),
        url: "http://127.0.0.1:9/hook".to_owned(),
        events: None,
        secret: "the-first-secret-of-it".to_owned(),
        max_attempts: 3,
        request: Some(mark.clone()),
    };
    let created = (store.create_webhook(webhook(&unique(), &mark), T0))
        .await
        .unwrap();
    let effect = recovered(begin(store, &request, after_hold).await);
    assert_eq!(
        effect,
        Effect::WebhookCreated {
            webhook_id: created.id.clone()
        }
    );
    let orphan = unique();
    let refused = (store.create_webhook(webhook(&orphan, &mark), after_hold)).await;
    assert!(matches!(refused, Err(Error::Conflict(_))), "{refused:?}");
    let listed: Vec<_> = (store.webhooks(tenant).await.unwrap().into_iter())
        .map(|w| w.id)
        .collect();
    assert!(listed.contains(&created.id));
    assert!(
        !listed.iter().any(|id| id.as_str().ends_with(&orphan)),
        "a webhook refused under a lost mark is not written"
    );

    let path = format!("/v1/webhooks/{}/rotate-secret", created.id);
    let request = keyed(tenant, &unique(), &path, "{}", T0);
    let mark = executes(begin(store, &request, T0).await);
    let rotated = "the-second-secret-of-it".to_owned();
    (store.rotate_webhook_secret(&created.id, rotated, Some(mark.clone())))
        .await
        .unwrap();
    let effect = recovered(begin(store, &request, after_hold).await);
    assert_eq!(
        effect,
        Effect::SecretRotated {
            webhook_id: created.id.clone()
        }
    );
    let late =
        (store.rotate_webhook_secret(&created.id, "a-third-secret-of-it".into(), Some(mark))).await;
    assert!(matches!(late, Err(Error::Conflict(_))), "{late:?}");
}
