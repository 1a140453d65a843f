//! Property tests of request bodies, through `app()` without a socket: arbitrary JSON values
//! and arbitrary bytes posted to every POST endpoint never get a 5xx; a refusal is a 4xx with
//! the JSON error body `{"error": {"code", "message"}}` and changes nothing a client can read.
//!
//! The server is seeded with a session whose run completed, one whose run waits for
//! approval and one whose run failed, so that ids exist; then its workers are stopped, so
//! nothing moves between a request and the look at the state after it.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::header::CONTENT_TYPE;
use axum::http::{Method, Request, StatusCode};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use ratchet_core::{ApprovalPolicy, Limits, MemoryScope, ModelReply, RunConfigSnapshot, ToolCall};
use ratchet_engine::{Coordinator, Engine, Models, PoolConfig, WorkerPool};
use ratchet_server::{Active, AppState};
use ratchet_store::Store;
use ratchet_tools::Registry;
use serde_json::{Value, json};
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::common::{DEADLINE, FnModel};

/// Cases per property, each posted to every endpoint: many shapes, quick to run.
const CASES: u32 = 64;

/// The runner: a failure is reported with its shrunk input (runners outside the `proptest!`
/// macro have no source file to save it beside).
fn runner() -> TestRunner {
    TestRunner::new(Config {
        cases: CASES,
        failure_persistence: None,
        ..Config::default()
    })
}

/// The ids the seeded server holds.
struct Seeded {
    app: Router,
    /// Idle; its run completed.
    session: String,
    completed_run: String,
    /// Waits for a human to approve its `add` call.
    waiting_run: String,
    approval: String,
    /// Failed calling the model (`llm_error`).
    failed_run: String,
    /// Keeps the database file.
    _dir: tempfile::TempDir,
}

/// The model: refuses a message that says "fail", asks to `add` (gated) for one that says
/// "gate", answers anything else.
fn model() -> FnModel<impl Fn(ratchet_llm::ModelRequest) -> ratchet_llm::Result<ModelReply>> {
    FnModel(|request: ratchet_llm::ModelRequest| {
        let first = request.messages.first().map(|m| m.content.as_str());
        match first {
            Some("fail") => Err(ratchet_llm::Error::Fatal("HTTP 401: no key".into())),
            Some("gate") => Ok(ModelReply {
                tool_calls: vec![ToolCall {
                    id: "call_0_0".into(),
                    name: "add".into(),
                    arguments: json!({"a": 1, "b": 2}),
                }],
                ..Default::default()
            }),
            _ => Ok(ModelReply {
                text: "done".into(),
                ..Default::default()
            }),
        }
    })
}

async fn seed() -> Seeded {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("ratchet.db").display());
    let store: Arc<dyn Store> = Arc::new(ratchet_sqlite::open_url(&db).unwrap());
    let tools = Arc::new(Registry::builtin());
    let models = Arc::new(Models::new(tools.names()));
    models.register("fuzz", Arc::new(model()));
    let coordinator = Coordinator::new(Arc::clone(&store));
    let engine = Arc::new(Engine::new(Arc::clone(&coordinator), models, tools));
    let mut template = RunConfigSnapshot {
        model: "fuzz".into(),
        model_settings: None,
        workspace: Some(dir.path().display().to_string()),
        system_prompt: String::new(),
        tools: Registry::builtin().specs(),
        limits: Limits::default(),
        memory_scope: MemoryScope::Session,
        ..RunConfigSnapshot::default()
    };
    let add = template.tools.iter_mut().find(|t| t.name == "add").unwrap();
    add.approval = ApprovalPolicy::Always;
    let state = AppState::new(
        Arc::clone(&coordinator),
        store,
        Active::new(template, Vec::new(), Default::default()),
        CancellationToken::new(),
    );
    let app = ratchet_server::app(state);
    let pool = WorkerPool::start(
        Arc::clone(&coordinator),
        engine,
        PoolConfig {
            workers: 2,
            poll: Duration::from_millis(10),
            ..PoolConfig::default()
        },
    );

    let mut bus = coordinator.subscribe();
    let mut runs = Vec::new();
    let mut sessions = Vec::new();
    for content in ["hello", "gate", "fail"] {
        let session = post_ok(&app, "/v1/sessions", json!({})).await["id"].clone();
        let session = session.as_str().unwrap().to_owned();
        let path = format!("/v1/sessions/{session}/messages");
        let accepted = post_ok(&app, &path, json!({"content": content})).await;
        runs.push(accepted["run_id"].as_str().unwrap().to_owned());
        sessions.push(session);
    }
    // Every run has ended or waits: two `run.finished` and one `approval.required`.
    let (mut finished, mut approval) = (0, None);
    tokio::time::timeout(DEADLINE, async {
        while finished < 2 || approval.is_none() {
            let event = bus.recv().await.unwrap();
            match event.kind.as_str() {
                "run.finished" => finished += 1,
                "approval.required" => {
                    approval = Some(event.payload["approval_id"].as_str().unwrap().to_owned());
                }
                _ => {}
            }
        }
    })
    .await
    .expect("the seeded runs did not settle");
    pool.shutdown().await;

    let seeded = Seeded {
        app,
        session: sessions[0].clone(),
        completed_run: runs[0].clone(),
        waiting_run: runs[1].clone(),
        approval: approval.unwrap(),
        failed_run: runs[2].clone(),
        _dir: dir,
    };
    let status = |run: &str| {
        let path = format!("/v1/runs/{run}");
        let app = seeded.app.clone();
        async move { get_ok(&app, &path).await["status"].clone() }
    };
    assert_eq!(status(&seeded.completed_run).await, "completed");
    assert_eq!(status(&seeded.waiting_run).await, "waiting_human");
    assert_eq!(status(&seeded.failed_run).await, "failed");
    seeded
}

/// One answer of the router: status, content type and body.
struct Answer {
    status: StatusCode,
    content_type: String,
    body: Vec<u8>,
}

async fn send(
    app: &Router,
    method: Method,
    path: &str,
    content_type: Option<&str>,
    body: Vec<u8>,
) -> Answer {
    let mut request = Request::builder().method(method).uri(path);
    if let Some(content_type) = content_type {
        request = request.header(CONTENT_TYPE, content_type);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::from(body)).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let content_type = response
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap()
        .to_vec();
    Answer {
        status,
        content_type,
        body,
    }
}

async fn post_ok(app: &Router, path: &str, body: Value) -> Value {
    let answer = send(
        app,
        Method::POST,
        path,
        Some("application/json"),
        body.to_string().into_bytes(),
    )
    .await;
    assert!(
        answer.status.is_success(),
        "POST {path}: {}",
        String::from_utf8_lossy(&answer.body)
    );
    serde_json::from_slice(&answer.body).unwrap()
}

async fn get_ok(app: &Router, path: &str) -> Value {
    let answer = send(app, Method::GET, path, None, Vec::new()).await;
    assert_eq!(
        answer.status,
        StatusCode::OK,
        "GET {path}: {}",
        String::from_utf8_lossy(&answer.body)
    );
    serde_json::from_slice(&answer.body).unwrap()
}

/// Every item of a listing, following its cursors.
async fn all_items(app: &Router, path: &str) -> Vec<Value> {
    let mut items = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let separator = if path.contains('?') { '&' } else { '?' };
        let mut url = format!("{path}{separator}limit=200");
        if let Some(cursor) = &cursor {
            url.push_str(&format!("&cursor={cursor}"));
        }
        let page = get_ok(app, &url).await;
        items.extend(page["items"].as_array().unwrap().iter().cloned());
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => return items,
        }
    }
}

/// What a client can read: every session with its runs (each in full) and messages, and
/// every approval.
async fn snapshot(app: &Router) -> Value {
    let mut sessions = Vec::new();
    for session in all_items(app, "/v1/sessions").await {
        let id = session["id"].as_str().unwrap().to_owned();
        let mut runs = Vec::new();
        for run in all_items(app, &format!("/v1/sessions/{id}/runs")).await {
            let run_id = run["id"].as_str().unwrap();
            runs.push(get_ok(app, &format!("/v1/runs/{run_id}")).await);
        }
        let messages = all_items(app, &format!("/v1/sessions/{id}/messages")).await;
        sessions.push(json!({"session": session, "runs": runs, "messages": messages}));
    }
    json!({"sessions": sessions, "approvals": all_items(app, "/v1/approvals").await})
}

/// A POST endpoint aimed at an id, what it answers when it accepts, and whether it reads a
/// body (`cancel` and `retry` take none, and ignore whatever is sent).
#[derive(Debug, Clone)]
struct Target {
    path: String,
    success: StatusCode,
    reads_body: bool,
}

/// The POST endpoints, each aimed at the seeded ids (and at ids that do not exist).
fn targets(seeded: &Seeded) -> Vec<Target> {
    let missing_session = "ses_0000000000000000000000000000000";
    let missing_run = "run_0000000000000000000000000000000";
    let (completed, waiting, failed) = (
        &seeded.completed_run,
        &seeded.waiting_run,
        &seeded.failed_run,
    );
    let target = |path: String, success, reads_body| Target {
        path,
        success,
        reads_body,
    };
    let (created, accepted, ok) = (StatusCode::CREATED, StatusCode::ACCEPTED, StatusCode::OK);
    vec![
        target("/v1/sessions".to_owned(), created, true),
        target(
            format!("/v1/sessions/{}/messages", seeded.session),
            accepted,
            true,
        ),
        target(
            format!("/v1/sessions/{missing_session}/messages"),
            accepted,
            true,
        ),
        target(format!("/v1/runs/{completed}/cancel"), ok, false),
        target(format!("/v1/runs/{missing_run}/cancel"), ok, false),
        target(format!("/v1/runs/{completed}/reconcile"), ok, true),
        target(format!("/v1/runs/{waiting}/reconcile"), ok, true),
        target(format!("/v1/runs/{completed}/retry"), ok, false),
        target(format!("/v1/runs/{failed}/retry"), ok, false),
        target(format!("/v1/runs/{completed}/continue"), ok, true),
        target(format!("/v1/runs/{failed}/continue"), ok, true),
        target(format!("/v1/approvals/{}", seeded.approval), ok, true),
        target("/v1/approvals/apr_nope-1".to_owned(), ok, true),
        target("/v1/approvals/not-an-id".to_owned(), ok, true),
    ]
}

/// The code each refusal status is documented with (docs/API.md, "Errors").
fn code_of(status: StatusCode) -> Option<&'static str> {
    Some(match status.as_u16() {
        400 => "bad_request",
        401 => "unauthorized",
        404 => "not_found",
        405 => "method_not_allowed",
        409 => "conflict",
        413 => "payload_too_large",
        415 => "unsupported_media_type",
        422 => "invalid_request",
        _ => return None,
    })
}

/// Posts `body` to every target and checks each answer: the documented success status with
/// a JSON object (for a body that was a JSON object, if the endpoint reads one), or a
/// documented refusal that left everything as it was.
fn check_posts(
    runtime: &Runtime,
    app: &Router,
    targets: &[Target],
    content_type: Option<&str>,
    body: &[u8],
) -> Result<(), TestCaseError> {
    runtime.block_on(async {
        let mut state = snapshot(app).await;
        for target in targets {
            state = check_post(app, target, content_type, body.to_vec(), state).await?;
        }
        Ok(())
    })
}

/// One post, made in state `before`; returns the state after it.
async fn check_post(
    app: &Router,
    target: &Target,
    content_type: Option<&str>,
    body: Vec<u8>,
    before: Value,
) -> Result<Value, TestCaseError> {
    let path = &target.path;
    let sent_object = serde_json::from_slice::<Value>(&body).is_ok_and(|b| b.is_object());
    let answer = send(app, Method::POST, path, content_type, body).await;
    let text = String::from_utf8_lossy(&answer.body);
    let what = format!(
        "POST {path} ({content_type:?}) answered {}: {text}",
        answer.status
    );
    prop_assert!(!answer.status.is_server_error(), "{}", what);
    prop_assert!(
        answer.content_type.starts_with("application/json"),
        "{}",
        what
    );
    let body: Value = serde_json::from_slice(&answer.body)
        .map_err(|e| TestCaseError::fail(format!("{what}: not JSON: {e}")))?;
    if answer.status.is_success() {
        prop_assert_eq!(answer.status, target.success, "{}", what);
        prop_assert!(body.is_object(), "{}", what);
        prop_assert!(
            sent_object || !target.reads_body,
            "accepted a body that is not a JSON object: {}",
            what
        );
        return Ok(snapshot(app).await);
    }
    let code = code_of(answer.status);
    prop_assert!(code.is_some(), "an undocumented status: {}", what);
    let error = body
        .as_object()
        .filter(|b| b.len() == 1)
        .and_then(|b| b.get("error"));
    let error = error.and_then(Value::as_object).filter(|e| e.len() == 2);
    let error = error.ok_or_else(|| TestCaseError::fail(format!("not an error body: {what}")))?;
    prop_assert_eq!(error.get("code").and_then(Value::as_str), code, "{}", what);
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or_default();
    prop_assert!(!message.trim().is_empty(), "{}", what);
    let after = snapshot(app).await;
    prop_assert!(
        before == after,
        "a refused request changed the state: {}",
        what
    );
    Ok(after)
}

/// Arbitrary JSON, without the float edge cases the JSON text itself cannot carry.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        any::<String>().prop_map(Value::from),
        "(ses|run|apr|call)_[a-z0-9_-]{0,8}".prop_map(Value::from),
        Just(Value::from("approve")),
        Just(Value::from("steer")),
        Just(Value::from("succeeded")),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            proptest::collection::btree_map(any::<String>(), inner, 0..6)
                .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

/// Arrays of the values a body's fields take, in order: serde reads a struct from an array
/// of its fields too, which a JSON API must not. The first ones have the shapes of the
/// endpoints' bodies, with fitting values.
fn positional_body() -> impl Strategy<Value = Value> {
    let shaped = proptest::sample::select(vec![
        json!([null, null]),
        json!(["hello", null]),
        json!(["call_0_0", "succeeded", null]),
        json!([null, true]),
        json!([null, null, null, null, null]),
        json!([[], null]),
    ]);
    let field = prop_oneof![
        3 => Just(Value::Null),
        1 => (0u64..5).prop_map(Value::from),
        1 => Just(Value::from("hello")),
        1 => Just(Value::from("default")),
        1 => Just(json!({})),
    ];
    prop_oneof![
        shaped,
        proptest::collection::vec(field, 0..6).prop_map(Value::from),
    ]
}

/// Objects whose keys are the API's own field names, with values of any type: bodies that
/// get past the JSON syntax and test every field's type and meaning.
fn near_valid_body() -> impl Strategy<Value = Value> {
    let field = proptest::sample::select(vec![
        "agent",
        "metadata",
        "content",
        "multitask",
        "call_id",
        "outcome",
        "result",
        "decisions",
        "abort",
        "decision",
        "note",
        "extra_steps",
        "extra_model_calls",
        "extra_tool_calls",
        "extra_tokens",
        "extra_duration_ms",
    ]);
    let decision = proptest::collection::btree_map(
        proptest::sample::select(vec!["call_id", "decision", "note", "other"]),
        json_value(),
        0..4,
    )
    .prop_map(|map| json!(map));
    let value = prop_oneof![
        3 => json_value(),
        1 => proptest::collection::vec(decision, 0..3).prop_map(Value::from),
        1 => (0u64..5).prop_map(Value::from),
        1 => Just(Value::from("default")),
    ];
    proptest::collection::btree_map(field, value, 0..4).prop_map(|map| json!(map))
}

#[test]
fn arbitrary_json_bodies_are_refused_cleanly_or_accepted() {
    let runtime = Runtime::new().unwrap();
    let seeded = runtime.block_on(seed());
    let targets = targets(&seeded);
    let strategy = prop_oneof![json_value(), near_valid_body(), positional_body()];
    runner()
        .run(&strategy, |body| {
            let body = body.to_string().into_bytes();
            check_posts(
                &runtime,
                &seeded.app,
                &targets,
                Some("application/json"),
                &body,
            )
        })
        .unwrap();
}

#[test]
fn arbitrary_bytes_are_refused_cleanly_or_accepted() {
    let runtime = Runtime::new().unwrap();
    let seeded = runtime.block_on(seed());
    let targets = targets(&seeded);
    let bytes = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..64),
        any::<String>().prop_map(String::into_bytes),
        // JSON cut short (or not at all) or with a byte changed.
        (
            prop_oneof![near_valid_body(), positional_body()],
            any::<proptest::sample::Index>(),
            any::<u8>()
        )
            .prop_map(|(body, at, byte)| {
                let mut bytes = body.to_string().into_bytes();
                let at = at.index(bytes.len() + 1);
                if byte % 2 == 0 || at == bytes.len() {
                    bytes.truncate(at);
                } else {
                    bytes[at] = byte;
                }
                bytes
            }),
    ];
    let content_type = proptest::option::of(proptest::sample::select(vec![
        "application/json",
        "application/json; charset=utf-8",
        "application/problem+json",
        "text/plain",
        "application/x-www-form-urlencoded",
        "",
    ]));
    runner()
        .run(&(content_type, bytes), |(content_type, body)| {
            check_posts(&runtime, &seeded.app, &targets, content_type, &body)
        })
        .unwrap();
}
