//! Webhooks over the API: configured per tenant, sent every wanted event signed and in `seq`
//! order per session through a receiver's failures, with a delivery log; and a receiver that
//! never answers holds back nothing but its own deliveries. Destinations inside are refused at
//! creation and again as an attempt connects, the log does not map ports, and a rotated secret
//! signs what follows it.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode as AxumStatus};
use ratchet_core::{Backoff, WebhookId};
use ratchet_store::NewWebhook;
use ratchet_webhooks::{
    DELIVERY_HEADER, DispatcherConfig, EVENT_HEADER, NO_ANSWER, Rule, SIGNATURE_HEADER,
    WebhookPolicy,
};
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::common::*;

/// What a receiver accepted (answered 2xx), in the order it accepted it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Accepted {
    session_id: String,
    seq: i64,
    kind: String,
}

#[derive(Default)]
struct Receiver {
    /// Requests still to be refused with a 500.
    failures_left: AtomicU32,
    refused: AtomicU32,
    /// Requests that arrived, answered or not.
    arrived: AtomicU32,
    /// Whether requests are never answered.
    hangs: bool,
    secret: Mutex<String>,
    accepted: Mutex<Vec<Accepted>>,
    problems: Mutex<Vec<String>>,
}

async fn receive(
    State(receiver): State<Arc<Receiver>>,
    headers: HeaderMap,
    body: Bytes,
) -> AxumStatus {
    receiver.arrived.fetch_add(1, Ordering::SeqCst);
    if receiver.hangs {
        std::future::pending::<()>().await;
    }
    if receiver
        .failures_left
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
    {
        receiver.refused.fetch_add(1, Ordering::SeqCst);
        return AxumStatus::INTERNAL_SERVER_ERROR;
    }
    let body = String::from_utf8(body.to_vec()).unwrap();
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let payload: Value = serde_json::from_str(&body).unwrap();
    let mut problems = Vec::new();
    let secret = receiver.secret.lock().unwrap().clone();
    if !ratchet_webhooks::verify_signature(&secret, &header(SIGNATURE_HEADER), &body) {
        problems.push(format!("a bad signature on {body}"));
    }
    if header(DELIVERY_HEADER) != payload["delivery_id"].as_i64().unwrap_or(-1).to_string() {
        problems.push(format!("the delivery header does not name {body}"));
    }
    let event = &payload["event"];
    if header(EVENT_HEADER) != event["kind"].as_str().unwrap_or_default() {
        problems.push(format!("the event header does not name {body}"));
    }
    // A run's event names the run's span (these runs were started without a caller's trace).
    let traceparent = match event["run_id"].as_str() {
        Some(run) => {
            ratchet_core::trace::run_traceparent(&ratchet_core::RunId::parse(run).unwrap(), None)
        }
        None => String::new(),
    };
    if header("traceparent") != traceparent {
        problems.push(format!(
            "the traceparent header is not {traceparent:?}: {body}"
        ));
    }
    receiver.problems.lock().unwrap().extend(problems);
    receiver.accepted.lock().unwrap().push(Accepted {
        session_id: event["session_id"].as_str().unwrap().to_owned(),
        seq: event["seq"].as_i64().unwrap(),
        kind: event["kind"].as_str().unwrap().to_owned(),
    });
    AxumStatus::NO_CONTENT
}

/// A local receiver; its URL.
async fn start_receiver(receiver: Arc<Receiver>) -> String {
    let app = axum::Router::new()
        .route("/hook", axum::routing::post(receive))
        .with_state(receiver);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{address}/hook")
}

/// A quick dispatcher that sends to loopback, as `ratchet serve` does when it listens on
/// loopback only (the receivers here are on 127.0.0.1).
fn quick_dispatch(timeout: Duration, concurrency: u32) -> DispatcherConfig {
    DispatcherConfig {
        poll: Duration::from_millis(20),
        timeout,
        concurrency,
        backoff: Backoff {
            first_ms: 30,
            max_ms: 200,
        },
        policy: WebhookPolicy::default().loopback_allowed(true),
        ..DispatcherConfig::default()
    }
}

async fn create_webhook(server: &Server, body: Value) -> Value {
    let reply = call(server.post(TOKEN_A, "/v1/webhooks", body)).await;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
    reply.body
}

async fn deliveries(server: &Server, webhook: &str) -> Vec<Value> {
    let mut all = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            None => format!("/v1/webhooks/{webhook}/deliveries?limit=200"),
            Some(c) => format!("/v1/webhooks/{webhook}/deliveries?limit=200&cursor={c}"),
        };
        let page = server.get_ok(TOKEN_A, &path).await;
        all.extend(page["items"].as_array().unwrap().iter().cloned());
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => return all,
        }
    }
}

async fn session_events(server: &Server, session: &str) -> Vec<Accepted> {
    server
        .replay(&format!("/v1/sessions/{session}/events?follow=false"), None)
        .await
        .into_iter()
        .map(|e| Accepted {
            session_id: session.to_owned(),
            seq: e.seq,
            kind: e.kind,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_failing_three_times_then_succeeding_gets_every_event_once_in_order() {
    let server =
        Server::start_with_dispatcher(quick_script(), quick_dispatch(Duration::from_secs(5), 4))
            .await;
    let receiver = Arc::new(Receiver {
        failures_left: AtomicU32::new(3),
        ..Receiver::default()
    });
    let url = start_receiver(Arc::clone(&receiver)).await;
    let webhook = create_webhook(&server, json!({"url": url, "max_attempts": 5})).await;
    let secret = webhook["secret"].as_str().unwrap();
    assert!(secret.starts_with("whsec_"), "{webhook}");
    *receiver.secret.lock().unwrap() = secret.to_owned();
    let id = webhook["id"].as_str().unwrap();

    let (first, _, ended) = server.run_to_end("add two and three").await;
    assert_eq!(ended["status"], "completed");
    let (second, _, _) = server.run_to_end("and again").await;
    let mut expected = session_events(&server, &first).await;
    expected.extend(session_events(&server, &second).await);
    assert!(expected.len() > 10, "{expected:?}");

    let log = wait_for(&server, id, |log| {
        log.len() == expected.len() && log.iter().all(|d| d["status"] == "delivered")
    })
    .await;

    let accepted = receiver.accepted.lock().unwrap().clone();
    for session in [&first, &second] {
        let got: Vec<_> = accepted
            .iter()
            .filter(|a| &a.session_id == session)
            .cloned()
            .collect();
        let want: Vec<_> = expected
            .iter()
            .filter(|a| &a.session_id == session)
            .cloned()
            .collect();
        assert_eq!(
            got, want,
            "session {session}: every event once, in seq order"
        );
        assert_eq!(
            want.iter().map(|a| a.seq).collect::<Vec<_>>(),
            (1..=want.len() as i64).collect::<Vec<_>>(),
            "a webhook created before the session gets it from its first event"
        );
    }
    assert_eq!(
        accepted.len(),
        expected.len(),
        "nothing else, nothing twice"
    );
    assert!(
        receiver.problems.lock().unwrap().is_empty(),
        "{:?}",
        receiver.problems.lock().unwrap()
    );
    assert_eq!(receiver.refused.load(Ordering::SeqCst), 3);
    let retried: u64 = log
        .iter()
        .map(|d| d["attempts"].as_u64().unwrap() - 1)
        .sum();
    assert_eq!(retried, 3, "the log counts the three refused attempts");
    let refused_once: Vec<_> = log.iter().filter(|d| d["attempts"] != 1).collect();
    assert!(
        refused_once
            .iter()
            .all(|d| d["last_status"] == 204 && d["last_error"].is_null()),
        "{refused_once:?}"
    );
}

/// A receiver that was down: its dead letters are requeued, one by id and the rest at once,
/// and each arrives once, signed; a repeat changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_requeues_dead_deliveries_and_they_arrive_once() {
    let server =
        Server::start_with_dispatcher(quick_script(), quick_dispatch(Duration::from_secs(5), 4))
            .await;
    let receiver = Arc::new(Receiver {
        failures_left: AtomicU32::new(2),
        ..Receiver::default()
    });
    let url = start_receiver(Arc::clone(&receiver)).await;
    let webhook = create_webhook(
        &server,
        json!({"url": url, "max_attempts": 1, "events": ["run.finished"]}),
    )
    .await;
    *receiver.secret.lock().unwrap() = webhook["secret"].as_str().unwrap().to_owned();
    let id = webhook["id"].as_str().unwrap();
    server.run_to_end("add two and three").await;
    server.run_to_end("and again").await;
    let dead = wait_for(&server, id, |log| {
        log.len() == 2 && log.iter().all(|d| d["status"] == "dead_letter")
    })
    .await;

    let one = format!("/v1/webhooks/{id}/deliveries/{}/requeue", dead[0]["id"]);
    let requeued = call(server.post(TOKEN_A, &one, json!({}))).await;
    assert_eq!(requeued.status, StatusCode::OK, "{}", requeued.body);
    assert_eq!(requeued.body["attempts"], 0, "{}", requeued.body);
    assert!(requeued.body["requeued_at"].is_i64(), "{}", requeued.body);
    let bulk = format!("/v1/webhooks/{id}/deliveries/requeue");
    let all = call(server.post(TOKEN_A, &bulk, json!({}))).await;
    assert_eq!(
        (all.status, &all.body),
        (StatusCode::OK, &json!({"requeued": 1}))
    );
    let log = wait_for(&server, id, |log| {
        log.iter().all(|d| d["status"] == "delivered")
    })
    .await;
    assert!(log.iter().all(|d| d["attempts"] == 1), "{log:?}");
    assert_eq!(receiver.accepted.lock().unwrap().len(), 2, "each once");
    assert!(
        receiver.problems.lock().unwrap().is_empty(),
        "{:?}",
        receiver.problems.lock().unwrap()
    );

    let again = call(server.post(TOKEN_A, &one, json!({}))).await;
    assert_eq!(
        (again.status, &again.body["status"]),
        (StatusCode::OK, &json!("delivered")),
        "a repeat of the requeue changes nothing"
    );
    let all = call(server.post(TOKEN_A, &bulk, json!({}))).await;
    assert_eq!(all.body, json!({"requeued": 0}));
    for (what, path, token, status, code) in [
        (
            "a delivery id that is not a number",
            format!("/v1/webhooks/{id}/deliveries/x/requeue"),
            TOKEN_A,
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "a delivery the webhook does not have",
            format!("/v1/webhooks/{id}/deliveries/999999/requeue"),
            TOKEN_A,
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            "another tenant's webhook",
            one.clone(),
            TOKEN_B,
            StatusCode::NOT_FOUND,
            "not_found",
        ),
    ] {
        assert_error(
            what,
            &call(server.post(token, &path, json!({}))).await,
            status,
            code,
        );
    }
}

/// Reads the delivery log until `done` holds of it.
async fn wait_for(server: &Server, webhook: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let log = deliveries(server, webhook).await;
        if done(&log) {
            return log;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the delivery log never got there: {log:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_that_hangs_holds_back_no_step() {
    let concurrency = 2;
    let server = Server::start_with_dispatcher(
        quick_script(),
        quick_dispatch(Duration::from_secs(600), concurrency),
    )
    .await;
    let receiver = Arc::new(Receiver {
        hangs: true,
        ..Receiver::default()
    });
    let url = start_receiver(Arc::clone(&receiver)).await;
    let webhook = create_webhook(&server, json!({"url": url})).await;
    let id = webhook["id"].as_str().unwrap();

    // The dispatcher is stuck on the receiver from the first run's first event on.
    let runs = 8;
    let mut sessions = Vec::new();
    for _ in 0..runs {
        sessions.push(server.create_session(TOKEN_A).await);
    }
    let first = server
        .send(TOKEN_A, &sessions[0], "add two and three")
        .await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while receiver.arrived.load(Ordering::SeqCst) < 1 {
        assert!(tokio::time::Instant::now() < deadline, "no attempt arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut started = vec![first["run_id"].as_str().unwrap().to_owned()];
    for session in &sessions[1..] {
        let accepted = server.send(TOKEN_A, session, "add two and three").await;
        started.push(accepted["run_id"].as_str().unwrap().to_owned());
    }
    let mut steps = 0;
    for run in &started {
        let ended = server.finish(run).await;
        assert_eq!(ended["status"], "completed", "{ended}");
        steps += ended["step_index"].as_u64().unwrap();
    }
    assert_eq!(
        steps,
        3 * runs,
        "every run took its three steps while the webhook hung"
    );

    let log = deliveries(&server, id).await;
    let delivering = log.iter().filter(|d| d["status"] == "delivering").count();
    assert_eq!(
        delivering, concurrency as usize,
        "the hung attempts, and no more, are in flight"
    );
    assert!(
        log.iter().all(|d| d["status"] != "delivered"),
        "the receiver answered nothing"
    );
    assert_eq!(receiver.arrived.load(Ordering::SeqCst), concurrency);
    assert!(
        log.iter().filter(|d| d["status"] == "pending").count() > 0,
        "the rest wait their turn"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_are_checked_and_kept_per_tenant() {
    let server = Server::start(quick_script()).await;
    for (body, says) in [
        (json!({"url": "ftp://example.com/hook"}), "scheme \"ftp\""),
        (json!({"url": "/relative"}), "has no scheme"),
        (json!({"url": "not a url"}), "does not parse"),
        (
            json!({"url": "http://example.com/hook", "events": ["run.finished", "run.exploded"]}),
            "unknown event kinds [\"run.exploded\"]",
        ),
        (
            json!({"url": "http://example.com/hook", "events": []}),
            "at least one event kind",
        ),
        (
            json!({"url": "http://example.com/hook", "secret": "short"}),
            "found 5 characters",
        ),
        (
            json!({"url": "http://example.com/hook", "max_attempts": 0}),
            "found 0",
        ),
        (
            json!({"url": "http://example.com/hook", "max_attempts": 51}),
            "found 51",
        ),
        (
            json!({"url": "http://example.com/hook", "retries": 3}),
            "retries",
        ),
    ] {
        let reply = call(server.post(TOKEN_A, "/v1/webhooks", body.clone())).await;
        assert_eq!(
            reply.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{body}: {}",
            reply.body
        );
        assert_eq!(reply.body["error"]["code"], "invalid_request");
        let message = reply.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{body}: {message}");
    }
    assert!(
        server.get_ok(TOKEN_A, "/v1/webhooks").await["items"]
            .as_array()
            .unwrap()
            .is_empty(),
        "nothing was created by a refused request"
    );

    let created = create_webhook(
        &server,
        json!({
            "url": "https://example.com/hook",
            "events": ["run.finished", "run.finished", "run.created"],
            "secret": "sixteen-chars-ok",
        }),
    )
    .await;
    assert_eq!(created["secret"], "sixteen-chars-ok");
    assert_eq!(created["events"], json!(["run.finished", "run.created"]));
    assert_eq!(created["max_attempts"], 10);
    let id = created["id"].as_str().unwrap();
    let shown = server.get_ok(TOKEN_A, &format!("/v1/webhooks/{id}")).await;
    assert!(
        shown.get("secret").is_none(),
        "the secret is shown once: {shown}"
    );
    assert_eq!(shown["url"], "https://example.com/hook");
    let listed = server.get_ok(TOKEN_A, "/v1/webhooks").await;
    assert_eq!(listed["items"].as_array().unwrap().len(), 1);

    assert!(
        server.get_ok(TOKEN_B, "/v1/webhooks").await["items"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    for path in [
        format!("/v1/webhooks/{id}"),
        format!("/v1/webhooks/{id}/deliveries"),
    ] {
        let reply = call(server.get(TOKEN_B, &path)).await;
        assert_eq!(
            reply.status,
            StatusCode::NOT_FOUND,
            "{path}: {}",
            reply.body
        );
    }
    let reply = call(
        server
            .http
            .delete(server.url(&format!("/v1/webhooks/{id}")))
            .bearer_auth(TOKEN_B),
    )
    .await;
    assert_eq!(
        reply.status,
        StatusCode::NOT_FOUND,
        "another tenant cannot delete it"
    );

    let reply = call(server.get(TOKEN_A, "/v1/webhooks/hook-1")).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.body);
    let reply = call(server.get(
        TOKEN_A,
        &format!("/v1/webhooks/{id}/deliveries?status=lost"),
    ))
    .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.body);
    assert!(
        reply.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("dead_letter")
    );
    let reply = call(server.get(TOKEN_A, &format!("/v1/webhooks/{id}/deliveries?cursor=x"))).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.body);

    let response = server
        .http
        .delete(server.url(&format!("/v1/webhooks/{id}")))
        .bearer_auth(TOKEN_A)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    let reply = call(server.get(TOKEN_A, &format!("/v1/webhooks/{id}"))).await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND);
}

/// The destinations the security probe could create (F3, F10) are refused with 422, and the
/// message names the rule and the key that would permit it; nothing is created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_to_the_inside_are_refused_at_creation_naming_the_rule() {
    let server = Server::start_with_webhook_policy(quick_script(), WebhookPolicy::default()).await;
    let allow = "add it to [webhooks] allow to permit it";
    for (url, says) in [
        (
            "http://127.0.0.1:7700/v1/sessions",
            "127.0.0.1 is a loopback address; ",
        ),
        ("http://localhost:7700/", "localhost is a loopback name; "),
        ("http://[::1]/", "::1 is a loopback address; "),
        (
            "http://169.254.169.254/latest/meta-data/",
            "169.254.169.254 is the cloud metadata address; ",
        ),
        ("http://0.0.0.0:22/", "0.0.0.0 is an unspecified address; "),
        ("http://10.0.0.1/", "10.0.0.1 is a private address; "),
        ("http://192.168.1.1/", "192.168.1.1 is a private address; "),
        ("http://127.1/", "127.0.0.1 is a loopback address; "),
        ("http://2130706433/", "127.0.0.1 is a loopback address; "),
        ("http://0x7f000001/", "127.0.0.1 is a loopback address; "),
        (
            "http://[::ffff:127.0.0.1]/",
            "::ffff:127.0.0.1 (IPv4 127.0.0.1) is a loopback address; ",
        ),
        (
            "http://metadata.google.internal/computeMetadata/v1/",
            "metadata.google.internal is a private name (.internal); ",
        ),
    ] {
        let reply = call(server.post(TOKEN_A, "/v1/webhooks", json!({"url": url}))).await;
        assert_eq!(
            reply.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{url}: {}",
            reply.body
        );
        let message = reply.body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(says) && message.ends_with(allow),
            "{url}: {message}"
        );
    }
    for (url, says) in [
        ("http://user:pass@example.com/hook", "carries credentials"),
        (
            "http://example.com:99999/hook",
            "its port is not valid; expected 1–65535",
        ),
        ("http://example.com:0/hook", "its port is not valid"),
    ] {
        let reply = call(server.post(TOKEN_A, "/v1/webhooks", json!({"url": url}))).await;
        assert_eq!(
            reply.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{url}: {}",
            reply.body
        );
        let message = reply.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{url}: {message}");
        assert!(!message.contains("pass@"), "{url}: {message}");
    }
    assert!(
        server.get_ok(TOKEN_A, "/v1/webhooks").await["items"]
            .as_array()
            .unwrap()
            .is_empty(),
        "nothing was created"
    );
    let created = create_webhook(&server, json!({"url": "HTTP://Example.COM:8080"})).await;
    assert_eq!(
        created["url"], "http://example.com:8080/",
        "stored as it will be requested"
    );
}

/// Adds a webhook of tenant A to the store directly, past the API's check: a webhook created
/// before the policy existed, under a wider one, or whose name resolves elsewhere since.
async fn stored_webhook(server: &Server, url: &str, max_attempts: u32) -> String {
    let id = WebhookId::from_suffix(&uuid_like()).unwrap();
    let webhook = server
        .webhooks
        .create_webhook(
            NewWebhook {
                id,
                tenant: "tenant-a".to_owned(),
                url: url.to_owned(),
                events: Some(vec!["run.finished".to_owned()]),
                secret: "a-secret-of-sixteen".to_owned(),
                max_attempts,
                request: None,
            },
            0,
        )
        .await
        .unwrap();
    webhook.id.to_string()
}

fn uuid_like() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    format!("stored-{}", NEXT.fetch_add(1, Ordering::SeqCst))
}

/// Runs once and waits until each webhook's single delivery has ended (delivered or dead).
async fn deliver_one_run(server: &Server, webhooks: &[&str]) -> Vec<Value> {
    server.run_to_end("add two and three").await;
    let mut ended = Vec::new();
    for webhook in webhooks {
        let log = wait_for(server, webhook, |log| {
            log.len() == 1
                && ["delivered", "dead_letter"].contains(&log[0]["status"].as_str().unwrap())
        })
        .await;
        ended.push(log[0].clone());
    }
    ended
}

/// DNS rebinding: a name is judged by the addresses it resolves to as the attempt connects,
/// not by how it looked when the webhook was created. `localhost` stands for any name that
/// resolves inside; only a block or the name in `[webhooks] allow` lets the attempt through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_that_resolves_inside_is_refused_as_the_attempt_connects() {
    let receiver = Arc::new(Receiver::default());
    let url = start_receiver(Arc::clone(&receiver)).await;
    let by_name = url.replace("127.0.0.1", "localhost");
    for (allow, delivered) in [
        (None, false),
        (Some("127.0.0.0/8"), true),
        (Some("localhost"), true),
        (Some("10.0.0.0/8"), false),
    ] {
        let policy = WebhookPolicy::new(
            allow
                .iter()
                .map(|rule| Rule::parse(rule).unwrap())
                .collect(),
        );
        let dispatch = DispatcherConfig {
            policy,
            ..quick_dispatch(Duration::from_secs(5), 4)
        };
        let server = Server::start_with_dispatcher(quick_script(), dispatch).await;
        let webhook = stored_webhook(&server, &by_name, 1).await;
        let arrived = receiver.arrived.load(Ordering::SeqCst);
        let ended = deliver_one_run(&server, &[&webhook]).await.remove(0);
        if delivered {
            assert_eq!(ended["status"], "delivered", "{allow:?}: {ended}");
            assert_eq!(receiver.arrived.load(Ordering::SeqCst), arrived + 1);
        } else {
            assert_eq!(ended["status"], "dead_letter", "{allow:?}: {ended}");
            assert_eq!(
                ended["last_error"],
                "refused by policy: localhost resolves to a loopback address; add the name or \
                 its addresses to [webhooks] allow to permit it",
                "{allow:?}"
            );
            assert!(ended["last_status"].is_null());
            assert_eq!(
                receiver.arrived.load(Ordering::SeqCst),
                arrived,
                "{allow:?}: nothing was sent"
            );
        }
    }
}

/// A webhook to an address inside that is already stored (created before the policy) is
/// refused before anything connects: the client never resolves an address, so the check is
/// the dispatcher's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_address_inside_is_refused_before_connecting() {
    let receiver = Arc::new(Receiver::default());
    let url = start_receiver(Arc::clone(&receiver)).await;
    let dispatch = DispatcherConfig {
        policy: WebhookPolicy::default(),
        ..quick_dispatch(Duration::from_secs(5), 4)
    };
    let server = Server::start_with_dispatcher(quick_script(), dispatch).await;
    let webhook = stored_webhook(&server, &url, 1).await;
    let ended = deliver_one_run(&server, &[&webhook]).await.remove(0);
    assert_eq!(ended["status"], "dead_letter", "{ended}");
    assert_eq!(
        ended["last_error"],
        "refused by policy: 127.0.0.1 is a loopback address; add it to [webhooks] allow to \
         permit it"
    );
    assert_eq!(
        receiver.arrived.load(Ordering::SeqCst),
        0,
        "nothing was sent"
    );
}

/// The delivery log is not a port scanner: a closed port, an open port that speaks something
/// else than HTTP, and one that never answers read the same; an HTTP receiver's status is
/// still shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_delivery_log_does_not_tell_closed_ports_from_open_ones() {
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let banner = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let banner_address = banner.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        loop {
            let (mut socket, _) = banner.accept().await.unwrap();
            let _ = socket.write_all(b"SSH-2.0-OpenSSH_9.6\r\n").await;
        }
    });
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_address = silent.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let (socket, _) = silent.accept().await.unwrap();
            held.push(socket);
        }
    });
    let failing = Arc::new(Receiver {
        failures_left: AtomicU32::new(u32::MAX),
        ..Receiver::default()
    });
    let failing_url = start_receiver(failing).await;

    let server = Server::start_with_dispatcher(
        quick_script(),
        quick_dispatch(Duration::from_millis(500), 4),
    )
    .await;
    let mut webhooks = Vec::new();
    for address in [closed, banner_address, silent_address] {
        webhooks.push(stored_webhook(&server, &format!("http://{address}/hook"), 1).await);
    }
    webhooks.push(stored_webhook(&server, &failing_url, 1).await);
    let ids: Vec<&str> = webhooks.iter().map(String::as_str).collect();
    let ended = deliver_one_run(&server, &ids).await;

    for (what, delivery) in ["closed", "not HTTP", "silent"].iter().zip(&ended) {
        assert_eq!(delivery["status"], "dead_letter", "{what}: {delivery}");
        assert_eq!(delivery["last_error"], NO_ANSWER, "{what}: {delivery}");
        assert!(delivery["last_status"].is_null(), "{what}: {delivery}");
    }
    assert_eq!(ended[3]["last_status"], 500, "{}", ended[3]);
    assert_eq!(ended[3]["last_error"], "the receiver answered HTTP 500");
}

/// `POST /v1/webhooks/{id}/rotate-secret` shows the new secret once, and every delivery after
/// it is signed with it; another tenant's webhook is as absent as a missing one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_secret_signs_the_deliveries_after_it() {
    let server =
        Server::start_with_dispatcher(quick_script(), quick_dispatch(Duration::from_secs(5), 4))
            .await;
    let receiver = Arc::new(Receiver::default());
    let url = start_receiver(Arc::clone(&receiver)).await;
    let webhook = create_webhook(&server, json!({"url": url})).await;
    let id = webhook["id"].as_str().unwrap();
    let first_secret = webhook["secret"].as_str().unwrap().to_owned();
    *receiver.secret.lock().unwrap() = first_secret.clone();
    let rotate = |token: &'static str, body: Option<Value>| {
        let request = server
            .http
            .post(server.url(&format!("/v1/webhooks/{id}/rotate-secret")))
            .bearer_auth(token);
        call(match body {
            Some(body) => request.json(&body),
            None => request,
        })
    };

    let (first, _, _) = server.run_to_end("add two and three").await;
    let before = session_events(&server, &first).await.len();
    wait_for(&server, id, |log| {
        log.len() == before && log.iter().all(|d| d["status"] == "delivered")
    })
    .await;

    let reply = rotate(TOKEN_B, None).await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND, "{}", reply.body);
    let reply = rotate(TOKEN_A, Some(json!({"secret": "short"}))).await;
    assert_eq!(
        reply.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        reply.body
    );
    let reply = rotate(TOKEN_A, Some(json!({"secrets": "sixteen-chars-ok"}))).await;
    assert_eq!(
        reply.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        reply.body
    );
    let reply = rotate(TOKEN_A, None).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body["id"], id);
    let second_secret = reply.body["secret"].as_str().unwrap().to_owned();
    assert!(second_secret.starts_with("whsec_") && second_secret != first_secret);
    *receiver.secret.lock().unwrap() = second_secret;
    assert!(
        server
            .get_ok(TOKEN_A, &format!("/v1/webhooks/{id}"))
            .await
            .get("secret")
            .is_none(),
        "the secret is shown only by the rotation"
    );

    let (second, _, _) = server.run_to_end("and again").await;
    let after = before + session_events(&server, &second).await.len();
    wait_for(&server, id, |log| {
        log.len() == after && log.iter().all(|d| d["status"] == "delivered")
    })
    .await;
    assert!(
        receiver.problems.lock().unwrap().is_empty(),
        "every delivery verified with the secret of its time: {:?}",
        receiver.problems.lock().unwrap()
    );
    assert_eq!(receiver.accepted.lock().unwrap().len(), after);

    let reply = rotate(TOKEN_A, Some(json!({"secret": "a-chosen-secret-1"}))).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body["secret"], "a-chosen-secret-1");
}
