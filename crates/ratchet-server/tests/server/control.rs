//! Human in the loop and run control over HTTP: approvals, continue and retry, steering,
//! context compaction, and many clients racing approvals, denials, cancels and messages.

use std::sync::Arc;

use ratchet_core::ApprovalPolicy;
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::common::*;

// ---------------------------------------------------------------------------------------
// Approvals

/// `add` needs approval when `a` has three digits; `now` never does.
async fn gated_server() -> Server {
    let script = json!({"replies": [
        {"text": "Three calls.", "tool_calls": [
            {"name": "add", "arguments": {"a": 100, "b": 1}},
            {"name": "add", "arguments": {"a": 2, "b": 3}},
            {"name": "now"}
        ]},
        {"text": "Done."}
    ]});
    Server::start_with(script, |template, _| {
        let add = template.tools.iter_mut().find(|t| t.name == "add").unwrap();
        add.approval = ApprovalPolicy::WhenArguments([("a".into(), "???".into())].into());
    })
    .await
}

/// Sends a message and waits for the approval its run asks for; returns (run, approval id,
/// the run's events so far).
async fn gated_message(server: &Server, session: &str) -> (String, String, Vec<Ev>) {
    let accepted = server.send(TOKEN_A, session, "add things").await;
    let run = accepted["run_id"].as_str().unwrap().to_owned();
    let mut stream = server.stream(&format!("/v1/runs/{run}/events"), None).await;
    let events = stream
        .until(|e| e.kind == "run.status" && e.data["payload"]["status"] == "waiting_human")
        .await;
    let required = events
        .iter()
        .find(|e| e.kind == "approval.required")
        .expect("the gate is announced");
    let approval = required.data["payload"]["approval_id"]
        .as_str()
        .unwrap()
        .to_owned();
    (run, approval, events)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gated_batch_runs_only_what_a_human_approved_and_the_model_sees_every_result() {
    let server = gated_server().await;
    let session = server.create_session(TOKEN_A).await;
    let (run, approval, events) = gated_message(&server, &session).await;
    assert!(
        !kinds(&events).contains(&"tool.call"),
        "no call of a gated batch starts: {:?}",
        kinds(&events)
    );
    let state = server.get_ok(TOKEN_A, &format!("/v1/runs/{run}")).await;
    assert_eq!(state["status"], "waiting_human");
    assert_eq!(state["pending_human"]["kind"], "approval", "{state}");

    let pending = server.get_ok(TOKEN_A, "/v1/approvals?status=pending").await;
    let item = &pending["items"][0];
    assert_eq!(pending["items"].as_array().unwrap().len(), 1, "{pending}");
    assert_eq!(item["id"], approval.as_str());
    assert_eq!(item["run_id"], run.as_str());
    assert_eq!(item["status"], "pending");
    let calls = item["calls"].as_array().unwrap();
    let shape: Vec<(&str, bool)> = calls
        .iter()
        .map(|c| (c["name"].as_str().unwrap(), c["needs_approval"] == true))
        .collect();
    assert_eq!(shape, [("add", true), ("add", false), ("now", false)]);
    assert_eq!(calls[0]["arguments"], json!({"a": 100, "b": 1}));
    let call_ids: Vec<&str> = calls
        .iter()
        .map(|c| c["call_id"].as_str().unwrap())
        .collect();

    // Another tenant sees nothing of it.
    let theirs = server.get_ok(TOKEN_B, "/v1/approvals").await;
    assert_eq!(theirs["items"], json!([]));
    let path = format!("/v1/approvals/{approval}");
    let body = json!({"decisions": [{"call_id": call_ids[0], "decision": "approve"}]});
    assert_error(
        "other tenant's approval",
        &call(server.get(TOKEN_B, &path)).await,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    assert_error(
        "other tenant's answer",
        &call(server.post(TOKEN_B, &path, body)).await,
        StatusCode::NOT_FOUND,
        "not_found",
    );

    // Answers that cannot be right change nothing.
    for (bad, status, code) in [
        (
            json!({"decisions": [{"call_id": call_ids[1], "decision": "approve"}]}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            json!({"decisions": [{"call_id": "nope", "decision": "deny"}]}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            json!({"decisions": [{"call_id": call_ids[0], "decision": "maybe"}]}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            json!({"decisions": [], "abort": true}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            json!({}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            json!({"abort": false}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
    ] {
        let reply = call(server.post(TOKEN_A, &path, bad.clone())).await;
        assert_error(&bad.to_string(), &reply, status, code);
    }
    let unknown = call(server.get(TOKEN_A, "/v1/approvals/apr_nope-1")).await;
    assert_error(
        "unknown approval",
        &unknown,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    let malformed = call(server.get(TOKEN_A, "/v1/approvals/run_x")).await;
    assert_error(
        "malformed id",
        &malformed,
        StatusCode::BAD_REQUEST,
        "bad_request",
    );
    let status = call(server.get(TOKEN_A, "/v1/approvals?status=open")).await;
    assert_error(
        "unknown status",
        &status,
        StatusCode::BAD_REQUEST,
        "bad_request",
    );
    assert_eq!(
        server.get_ok(TOKEN_A, &path).await["status"],
        "pending",
        "refused answers leave it pending"
    );

    // Deny the gated call; the others, not named, run.
    let answer =
        json!({"decisions": [{"call_id": call_ids[0], "decision": "deny", "note": "too big"}]});
    let reply = call(server.post(TOKEN_A, &path, answer.clone())).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body["status"], "decided");
    let decided: Vec<&str> = reply.body["calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["decision"].as_str().unwrap())
        .collect();
    assert_eq!(decided, ["deny", "approve", "approve"]);
    assert_eq!(reply.body["calls"][0]["note"], "too big");
    let state = server.finish(&run).await;
    assert_eq!(state["status"], "completed", "{state}");
    assert_eq!(state["final_answer"], "Done.");

    // The model saw one result per call, in its order; the denied call never ran.
    let messages = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}/messages"))
        .await;
    let tool_results: Vec<(String, String)> = messages["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            (
                m["tool_call_id"].as_str().unwrap().to_owned(),
                m["content"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let order: Vec<&str> = tool_results.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(order, call_ids);
    assert!(
        tool_results[0].1.contains("denied by a human: too big"),
        "{tool_results:?}"
    );
    assert!(tool_results[1].1.contains('5'), "{tool_results:?}");
    let all = server
        .replay(&format!("/v1/runs/{run}/events?follow=false"), None)
        .await;
    let decided_at = all
        .iter()
        .position(|e| e.kind == "approval.decided")
        .expect("approval.decided");
    let started: Vec<(usize, &str)> = all
        .iter()
        .enumerate()
        .filter(|(_, e)| e.kind == "tool.call")
        .map(|(i, e)| (i, e.data["payload"]["call_id"].as_str().unwrap()))
        .collect();
    assert_eq!(
        started.iter().map(|(_, id)| *id).collect::<Vec<_>>(),
        call_ids[1..],
        "only the approved calls started"
    );
    assert!(
        started.iter().all(|(i, _)| *i > decided_at),
        "and only after the answer"
    );

    // The same answer again is fine; a different one is a conflict.
    let again = call(server.post(TOKEN_A, &path, answer)).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.body);
    let different = json!({"decisions": [{"call_id": call_ids[0], "decision": "approve"}]});
    assert_error(
        "a different answer",
        &call(server.post(TOKEN_A, &path, different)).await,
        StatusCode::CONFLICT,
        "conflict",
    );
    let decided = server.get_ok(TOKEN_A, "/v1/approvals?status=decided").await;
    assert_eq!(ids(&decided["items"]), [approval.as_str()]);
    let pending = server.get_ok(TOKEN_A, "/v1/approvals?status=pending").await;
    assert_eq!(pending["items"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborting_an_approval_cancels_the_run_and_the_next_message_runs() {
    let server = gated_server().await;
    let session = server.create_session(TOKEN_A).await;
    let (run, approval, _) = gated_message(&server, &session).await;
    let path = format!("/v1/approvals/{approval}");
    let reply = call(server.post(TOKEN_A, &path, json!({"abort": true}))).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body["status"], "aborted");
    let state = server.get_ok(TOKEN_A, &format!("/v1/runs/{run}")).await;
    assert_eq!(
        (&state["status"], &state["stop_reason"]),
        (&json!("cancelled"), &json!("cancelled")),
        "{state}"
    );
    assert_eq!(state["usage"]["tool_calls"], 0, "{state}");
    // The session is free: the next message runs (and is gated in its turn).
    let (next, next_approval, _) = gated_message(&server, &session).await;
    assert_ne!(next, run);
    let cancelled = call(server.post(TOKEN_A, &format!("/v1/runs/{next}/cancel"), json!({}))).await;
    assert_eq!(cancelled.status, StatusCode::OK, "{}", cancelled.body);
    let listed = server
        .get_ok(TOKEN_A, "/v1/approvals?status=cancelled")
        .await;
    assert_eq!(ids(&listed["items"]), [next_approval.as_str()]);
    let late = json!({"abort": true});
    let reply = call(server.post(TOKEN_A, &format!("/v1/approvals/{next_approval}"), late)).await;
    assert_error(
        "answer after cancel",
        &reply,
        StatusCode::CONFLICT,
        "conflict",
    );
}

// ---------------------------------------------------------------------------------------
// Continue and retry

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_failed_calling_the_model_is_retried_with_fresh_attempts() {
    let server = Server::start_with(quick_script(), |template, models| {
        template.model = "flaky".into();
        template.limits.max_model_attempts = 2;
        // Fails its first two calls with a transient error, then answers.
        let failures = std::sync::atomic::AtomicU32::new(2);
        let flaky = FnModel(move |_| {
            use std::sync::atomic::Ordering;
            if failures
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                    left.checked_sub(1)
                })
                .is_ok()
            {
                return Err(ratchet_llm::Error::transient(
                    "HTTP 503 from the flaky model",
                ));
            }
            Ok(ratchet_core::ModelReply {
                text: "recovered".into(),
                ..Default::default()
            })
        });
        models.register("flaky", Arc::new(flaky));
    })
    .await;
    let (_, run, failed) = server.run_to_end("hello").await;
    assert_eq!(
        (&failed["status"], &failed["stop_reason"]),
        (&json!("failed"), &json!("llm_error")),
        "{failed}"
    );
    let steps = failed["step_index"].as_u64().unwrap();

    let continue_path = format!("/v1/runs/{run}/continue");
    let retry_path = format!("/v1/runs/{run}/retry");
    let theirs = call(server.post(TOKEN_B, &retry_path, json!({}))).await;
    assert_error(
        "another tenant's run",
        &theirs,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    let extra = call(server.post(TOKEN_A, &continue_path, json!({"extra_stepz": 1}))).await;
    assert_error(
        "unknown field",
        &extra,
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_request",
    );

    let reply = call(server.post(TOKEN_A, &retry_path, json!({}))).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body["status"], "running");
    let done = server.finish_again(&run, 2).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["final_answer"], "recovered");
    assert_eq!(
        done["step_index"],
        steps + 1,
        "the failed step stays; one new step answers"
    );
    let events = server
        .replay(&format!("/v1/runs/{run}/events?follow=false"), None)
        .await;
    assert_eq!(
        kinds(&events)
            .iter()
            .filter(|k| **k == "run.resumed")
            .count(),
        1
    );
    let finished = kinds(&events)
        .iter()
        .filter(|k| **k == "run.finished")
        .count();
    assert_eq!(finished, 2, "one per end: failed, then completed");

    let again = call(server.post(TOKEN_A, &retry_path, json!({}))).await;
    assert_error(
        "retry of a completed run",
        &again,
        StatusCode::CONFLICT,
        "conflict",
    );
}

/// A pause asked for while a tool runs lets the tool finish, then stops the run at that
/// step's end; the paused run holds its session until resumed, then ends as it would have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_run_stops_at_its_step_boundary_holds_its_session_and_resumes() {
    let script = json!({"replies": [
        {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 700}}]},
        {"text": "Slept well."}
    ]});
    let server = Server::start(script).await;
    let session = server.create_session(TOKEN_A).await;
    let run = server.send(TOKEN_A, &session, "sleep a little").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut stream = server.stream(&format!("/v1/runs/{run}/events"), None).await;
    stream.until_running("sleep_ms").await;

    let pause_path = format!("/v1/runs/{run}/pause");
    let resume_path = format!("/v1/runs/{run}/resume");
    let reply = call(server.post(TOKEN_A, &pause_path, json!({}))).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(
        reply.body,
        json!({"run_id": run, "status": "pausing"}),
        "the tool is running: the run pauses when its step ends"
    );
    let pausing = server.get_ok(TOKEN_A, &format!("/v1/runs/{run}")).await;
    assert_eq!(
        (&pausing["status"], &pausing["pause_requested"]),
        (&json!("running"), &json!(true))
    );
    let events = stream
        .until(|e| e.kind == "run.status" && e.data["payload"]["status"] == "paused")
        .await;
    assert!(
        events.iter().any(|e| e.kind == "tool.result"),
        "the tool's work was kept"
    );
    let paused = server.get_ok(TOKEN_A, &format!("/v1/runs/{run}")).await;
    assert_eq!(
        (
            &paused["status"],
            &paused["pause_requested"],
            &paused["step_index"]
        ),
        (&json!("paused"), &json!(false), &json!(2))
    );

    let next = server.send(TOKEN_A, &session, "and then?").await;
    assert_eq!(
        next["run_status"], "queued",
        "a paused run holds its session"
    );
    let next = next["run_id"].as_str().unwrap().to_owned();
    let again = call(server.post(TOKEN_A, &pause_path, json!({}))).await;
    assert_eq!(again.body["status"], "paused", "{}", again.body);
    let queued = call(server.post(TOKEN_A, &format!("/v1/runs/{next}/pause"), json!({}))).await;
    assert_error(
        "pause of a queued run",
        &queued,
        StatusCode::CONFLICT,
        "conflict",
    );
    let theirs = call(server.post(TOKEN_B, &resume_path, json!({}))).await;
    assert_error(
        "another tenant's run",
        &theirs,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    let bad = call(server.post(TOKEN_A, "/v1/runs/nope/resume", json!({}))).await;
    assert_error(
        "a malformed id",
        &bad,
        StatusCode::BAD_REQUEST,
        "bad_request",
    );
    let session_view = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}"))
        .await;
    assert_eq!(session_view["status"], "paused", "{session_view}");

    let reply = call(server.post(TOKEN_A, &resume_path, json!({}))).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body, json!({"run_id": run, "status": "running"}));
    let done = server.finish(&run).await;
    assert_eq!(
        (&done["status"], &done["final_answer"], &done["step_index"]),
        (&json!("completed"), &json!("Slept well."), &json!(3))
    );
    let second = server.finish(&next).await;
    assert_eq!(second["status"], "completed", "the session moved on");

    for path in [&pause_path, &resume_path] {
        let ended = call(server.post(TOKEN_A, path, json!({}))).await;
        assert_error(path, &ended, StatusCode::CONFLICT, "conflict");
    }
    let events = server
        .replay(&format!("/v1/runs/{run}/events?follow=false"), None)
        .await;
    let statuses: Vec<&str> = events
        .iter()
        .filter(|e| e.kind == "run.status")
        .filter_map(|e| e.data["payload"]["status"].as_str())
        .collect();
    assert_eq!(statuses, ["running", "paused", "running", "completed"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_spent_its_budget_is_continued_with_more() {
    let forever = json!({"replies": [
        {"text": "More.", "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 1}}]}
    ]});
    let server = Server::start_with(forever, |template, _| template.limits.max_steps = 3).await;
    let (_, run, failed) = server.run_to_end("loop").await;
    assert_eq!(
        (&failed["stop_reason"], &failed["step_index"]),
        (&json!("budget_exhausted"), &json!(3)),
        "{failed}"
    );

    let continue_path = format!("/v1/runs/{run}/continue");
    let retry = call(server.post(TOKEN_A, &format!("/v1/runs/{run}/retry"), json!({}))).await;
    assert_error(
        "retry of a spent budget",
        &retry,
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_request",
    );
    let nothing = call(server.post(TOKEN_A, &continue_path, json!({}))).await;
    assert_error(
        "continue without budget",
        &nothing,
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_request",
    );
    assert!(
        nothing.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("budget is spent"),
        "{}",
        nothing.body
    );

    // Amounts are whole numbers up to the `int64` the document promises: `3.0` is 3.
    for refused in [json!(9_223_372_036_854_775_808u64), json!(2.5), json!(-1)] {
        let body = json!({"extra_steps": refused});
        let reply = call(server.post(TOKEN_A, &continue_path, body.clone())).await;
        assert_error(
            &body.to_string(),
            &reply,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        );
    }
    let reply = call(server.post(TOKEN_A, &continue_path, json!({"extra_steps": 3.0}))).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    let again = server.finish_again(&run, 2).await;
    assert_eq!(
        (
            &again["status"],
            &again["stop_reason"],
            &again["step_index"]
        ),
        (&json!("failed"), &json!("budget_exhausted"), &json!(6)),
        "three more steps: a model call, its tools, a concluding call: {again}"
    );
    assert_eq!(again["usage"]["tool_calls"], 2, "{again}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steer_past_the_users_lane_is_refused_with_429_and_queues_nothing() {
    let script = json!({"replies": [
        {"text": "Sleeping.", "tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 600_000}}]},
        {"text": "Awake."}
    ]});
    let server = Server::start_with(script, |template, _| {
        template.steer.user.max_messages = 1;
    })
    .await;
    let session = server.create_session(TOKEN_A).await;
    let accepted = server.send(TOKEN_A, &session, "sleep").await;
    let run = accepted["run_id"].as_str().unwrap().to_owned();
    let mut events = server.stream(&format!("/v1/runs/{run}/events"), None).await;
    events.until_running("sleep_ms").await;
    let path = format!("/v1/sessions/{session}/messages");
    let steer = |content: &str| json!({"content": content, "multitask": "steer"});
    let first = call(server.post(TOKEN_A, &path, steer("first"))).await;
    assert_eq!(first.status, StatusCode::ACCEPTED, "{}", first.body);
    let second = call(server.post(TOKEN_A, &path, steer("second"))).await;
    assert_eq!(
        second.status,
        StatusCode::TOO_MANY_REQUESTS,
        "{}",
        second.body
    );
    assert_eq!(second.body["error"]["code"], "steer_queue_full");
    let message = second.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("1 steering messages from users already wait"),
        "{message}"
    );
    let cancelled = call(server.post(TOKEN_A, &format!("/v1/runs/{run}/cancel"), json!({}))).await;
    assert_eq!(cancelled.status, StatusCode::OK, "{}", cancelled.body);
    events.until(|e| e.kind == "run.finished").await;
    let messages = server.get_ok(TOKEN_A, &path).await;
    let contents: Vec<&str> = messages["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert!(contents.contains(&"first"), "{contents:?}");
    assert!(
        !contents.contains(&"second"),
        "the refused steer was never stored: {contents:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steering_message_joins_the_active_run_after_its_tool_results() {
    let script = json!({"replies": [
        {"text": "Sleeping.", "tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 300}}]},
        {"text": "Awake."}
    ]});
    let server = Server::start(script).await;
    let session = server.create_session(TOKEN_A).await;
    let accepted = server.send(TOKEN_A, &session, "sleep").await;
    let run = accepted["run_id"].as_str().unwrap().to_owned();
    let mut events = server.stream(&format!("/v1/runs/{run}/events"), None).await;
    events.until_running("sleep_ms").await;
    let path = format!("/v1/sessions/{session}/messages");
    let body = json!({"content": "and then say hi", "multitask": "steer"});
    let reply = call(server.post(TOKEN_A, &path, body)).await;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.body);
    assert_eq!(reply.body["steered"], true);
    assert_eq!(
        reply.body["run_id"],
        run.as_str(),
        "it joins the active run"
    );
    let seen = events.until(|e| e.kind == "run.finished").await;
    let steered = seen
        .iter()
        .position(|e| e.kind == "message.steered")
        .expect("message.steered");
    let result = seen.iter().position(|e| e.kind == "tool.result").unwrap();
    assert!(
        result < steered,
        "after the tool's result: {:?}",
        kinds(&seen)
    );
    assert_eq!(
        seen[steered].data["payload"]["message_id"],
        reply.body["message_id"]
    );
    let messages = server.get_ok(TOKEN_A, &path).await;
    let shape: Vec<(&str, &str)> = messages["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["role"].as_str().unwrap(), m["run_id"].as_str().unwrap()))
        .collect();
    let r = run.as_str();
    assert_eq!(
        shape,
        [
            ("user", r),
            ("assistant", r),
            ("tool", r),
            ("user", r),
            ("assistant", r)
        ]
    );
    let runs = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}/runs"))
        .await;
    assert_eq!(ids(&runs["items"]), [r], "no run of its own");
}

// ---------------------------------------------------------------------------------------
// Context compaction

/// Calls `add` on each of its first `rounds` calls, then answers; summarises when asked to
/// compress. Keeps every request it was sent.
struct Recorder {
    rounds: usize,
    requests: std::sync::Mutex<Vec<ratchet_llm::ModelRequest>>,
}

impl Recorder {
    fn new(rounds: usize) -> Arc<Recorder> {
        Arc::new(Recorder {
            rounds,
            requests: std::sync::Mutex::new(Vec::new()),
        })
    }
}

#[async_trait::async_trait]
impl ratchet_llm::Model for Recorder {
    async fn complete(
        &self,
        request: ratchet_llm::ModelRequest,
        _deltas: tokio::sync::mpsc::UnboundedSender<String>,
        _cancel: CancellationToken,
    ) -> ratchet_llm::Result<ratchet_core::ModelReply> {
        let summarizing =
            request.tools.is_empty() && request.system_prompt.starts_with("You compress");
        let mut requests = self.requests.lock().unwrap();
        let turns = requests
            .iter()
            .filter(|r| !r.system_prompt.starts_with("You compress"))
            .count();
        requests.push(request);
        let reply = if summarizing {
            ratchet_core::ModelReply {
                text: "SUMMARY-TEXT".into(),
                ..Default::default()
            }
        } else if turns < self.rounds {
            ratchet_core::ModelReply {
                text: format!("round {turns}"),
                tool_calls: vec![ratchet_core::ToolCall {
                    id: format!("call-{turns}"),
                    name: "add".into(),
                    arguments: json!({"a": turns, "b": 1}),
                }],
                ..Default::default()
            }
        } else {
            ratchet_core::ModelReply {
                text: "done".into(),
                ..Default::default()
            }
        };
        Ok(reply)
    }
}

/// A run has measured no prompt before its first model call: the history it would send is
/// measured then, and compacted first when it is over the budget (a later run of a session
/// here, whose history of earlier turns is over it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runs_first_model_call_is_compacted_when_its_history_is_over_the_budget() {
    let recorder = Recorder::new(0);
    let model = Arc::clone(&recorder);
    let server = Server::start_with(quick_script(), move |template, models| {
        template.model = "recorder".into();
        template.limits.max_prompt_tokens = Some(120);
        models.register("recorder", model);
    })
    .await;
    let session = server.create_session(TOKEN_A).await;
    let mut runs = Vec::new();
    for turn in 0..4 {
        let content = format!("turn {turn}: {}", "a long enough question ".repeat(6));
        let accepted = server.send(TOKEN_A, &session, &content).await;
        let run = accepted["run_id"].as_str().unwrap().to_owned();
        let ended = server.finish(&run).await;
        assert_eq!(ended["status"], "completed", "{ended}");
        runs.push(run);
    }
    let first_steps = |run: &str| {
        let path = format!("/v1/runs/{run}/steps?limit=10");
        let server = &server;
        async move {
            let steps = server.get_ok(TOKEN_A, &path).await;
            (steps["items"].as_array().unwrap().iter())
                .map(|s| s["instruction"].as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        }
    };
    let mut steps = Vec::new();
    for run in &runs {
        steps.push(first_steps(run).await);
    }
    assert_eq!(steps[0], ["call_llm"], "a short history fits");
    assert!(
        steps.contains(&vec!["compress_context".to_owned(), "call_llm".to_owned()]),
        "a long history is compacted before the run's first model call: {steps:?}"
    );
    let requests = recorder.requests.lock().unwrap().clone();
    for request in requests
        .iter()
        .filter(|r| !r.system_prompt.starts_with("You compress"))
    {
        let estimate: u64 = request.messages.iter().map(|m| m.estimated_tokens()).sum();
        assert!(
            estimate < 120,
            "every prompt is within its budget: {estimate}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_over_its_budget_is_compacted_into_a_hidden_summary() {
    let recorder = Recorder::new(6);
    let model = Arc::clone(&recorder);
    let server = Server::start_with(quick_script(), move |template, models| {
        template.model = "recorder".into();
        template.limits.max_prompt_tokens = Some(80);
        models.register("recorder", model);
    })
    .await;
    let (session, run, done) = server.run_to_end("add things up").await;
    assert_eq!(
        (&done["status"], &done["final_answer"]),
        (&json!("completed"), &json!("done")),
        "{done}"
    );

    let steps = server
        .get_ok(TOKEN_A, &format!("/v1/runs/{run}/steps?limit=200"))
        .await;
    let instructions: Vec<&str> = steps["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["instruction"].as_str().unwrap())
        .collect();
    assert!(
        instructions.contains(&"compress_context"),
        "{instructions:?}"
    );
    let events = server
        .replay(&format!("/v1/runs/{run}/events?follow=false"), None)
        .await;
    let compacted: Vec<&Ev> = events
        .iter()
        .filter(|e| e.kind == "context.compacted")
        .collect();
    assert!(!compacted.is_empty());
    let payload = &compacted[0].data["payload"];
    assert!(
        payload["tokens_after"].as_u64().unwrap() < payload["tokens_before"].as_u64().unwrap(),
        "{payload}"
    );

    let requests = recorder.requests.lock().unwrap().clone();
    let summarize = requests
        .iter()
        .position(|r| r.system_prompt.starts_with("You compress"))
        .unwrap();
    assert!(
        requests[summarize].tools.is_empty(),
        "a summary call offers no tools"
    );
    let before = &requests[summarize - 1];
    let after = &requests[summarize + 1];
    assert!(
        after.messages[0].content.contains("SUMMARY-TEXT"),
        "the summary leads the next prompt"
    );
    assert!(
        after.messages.len() < before.messages.len() + 2,
        "older messages are gone from the prompt"
    );
    assert_ne!(
        after.messages[1].role,
        ratchet_core::Role::Tool,
        "no tool result without its call"
    );
    let estimate: u64 = after.messages.iter().map(|m| m.estimated_tokens()).sum();
    assert!(
        estimate < 80,
        "the compacted prompt fits its budget: {estimate}"
    );
    for request in requests
        .iter()
        .filter(|r| !r.system_prompt.starts_with("You compress"))
    {
        let estimate: u64 = request.messages.iter().map(|m| m.estimated_tokens()).sum();
        assert!(
            estimate < 80 + 20,
            "every prompt stays near its budget: {estimate}"
        );
    }

    // The summary is hidden: clients see the conversation as it happened.
    let messages = server.messages(&session).await;
    let contents: Vec<&str> = messages
        .iter()
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert!(
        !contents.iter().any(|c| c.contains("SUMMARY-TEXT")),
        "{contents:?}"
    );
    assert_eq!(contents[0], "add things up");
}

// ---------------------------------------------------------------------------------------
// Many clients at once

/// Three turns of two calls each — a guarded `append_line` whose line names its run and turn,
/// and a short sleep — then an answer. The same calls for the same run and turn, as a model
/// call redone after a retry must ask for the same thing.
struct Busy;

#[async_trait::async_trait]
impl ratchet_llm::Model for Busy {
    async fn complete(
        &self,
        request: ratchet_llm::ModelRequest,
        _deltas: tokio::sync::mpsc::UnboundedSender<String>,
        _cancel: CancellationToken,
    ) -> ratchet_llm::Result<ratchet_core::ModelReply> {
        let turn = request.call_index;
        if turn >= 3 || request.tools.is_empty() {
            return Ok(ratchet_core::ModelReply {
                text: "done".into(),
                ..Default::default()
            });
        }
        let run = request.run_id.to_string();
        let pause = run.bytes().map(u64::from).sum::<u64>() % 30 + turn * 7;
        let call = |i: u64, name: &str, arguments: serde_json::Value| ratchet_core::ToolCall {
            id: format!("c{turn}-{i}"),
            name: name.into(),
            arguments,
        };
        Ok(ratchet_core::ModelReply {
            text: format!("turn {turn}"),
            tool_calls: vec![
                call(
                    0,
                    "append_line",
                    json!({"path": "log.txt", "line": format!("{run}/c{turn}-0")}),
                ),
                call(1, "sleep_ms", json!({"ms": pause})),
            ],
            ..Default::default()
        })
    }
}

/// A small deterministic generator, seeded from the clock and printed, so that a failing
/// interleaving's choices can be replayed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

struct Sent {
    session: String,
    content: String,
    message_id: String,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_approvals_denials_cancels_and_messages_keep_every_invariant() {
    const SESSIONS: usize = 6;
    const MESSAGES: usize = 4;
    let workspace = tempfile::tempdir().unwrap();
    let log = workspace.path().join("log.txt");
    let root = workspace.path().display().to_string();
    let server = Arc::new(
        Server::start_with(quick_script(), move |template, models| {
            template.model = "busy".into();
            template.workspace = Some(root);
            let append = template
                .tools
                .iter_mut()
                .find(|t| t.name == "append_line")
                .unwrap();
            append.approval = ApprovalPolicy::Always;
            models.register("busy", Arc::new(Busy));
        })
        .await,
    );
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    eprintln!("seed {seed}");
    let mut sessions = Vec::new();
    for _ in 0..SESSIONS {
        sessions.push(server.create_session(TOKEN_A).await);
    }

    // Clients send messages with every multitask mode at random instants.
    let mut senders = Vec::new();
    for (i, session) in sessions.iter().enumerate() {
        let (server, session) = (Arc::clone(&server), session.clone());
        senders.push(tokio::spawn(async move {
            let mut rng = Rng(seed.wrapping_add(i as u64 * 7919) | 1);
            let mut sent = Vec::new();
            for m in 0..MESSAGES {
                tokio::time::sleep(std::time::Duration::from_millis(rng.below(60))).await;
                let multitask = ["enqueue", "interrupt", "steer"][rng.below(3) as usize];
                let content = format!("{session} message {m} ({multitask})");
                let path = format!("/v1/sessions/{session}/messages");
                let body = json!({"content": content, "multitask": multitask});
                let reply = call(server.post(TOKEN_A, &path, body)).await;
                assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.body);
                let message_id = reply.body["message_id"].as_str().unwrap().to_owned();
                sent.push(Sent {
                    session: session.clone(),
                    content,
                    message_id,
                });
            }
            sent
        }));
    }

    // Humans answer approvals (approve, deny, abort) and cancel runs, racing each other.
    let stop = CancellationToken::new();
    let mut humans = Vec::new();
    for h in 0..2u64 {
        let (server, stop, sessions) = (Arc::clone(&server), stop.clone(), sessions.clone());
        humans.push(tokio::spawn(async move {
            let mut rng = Rng(seed.wrapping_mul(31 + h) | 1);
            while !stop.is_cancelled() {
                let pending = server
                    .get_ok(TOKEN_A, "/v1/approvals?status=pending&limit=200")
                    .await;
                for approval in pending["items"].as_array().unwrap() {
                    let calls = approval["calls"].as_array().unwrap();
                    let decide = |decision: &str| {
                        let decisions: Vec<_> = calls
                            .iter()
                            .map(|c| json!({"call_id": c["call_id"], "decision": decision}))
                            .collect();
                        json!({"decisions": decisions})
                    };
                    let body = match rng.below(10) {
                        0..=5 => decide("approve"),
                        6..=8 => decide("deny"),
                        _ => json!({"abort": true}),
                    };
                    let path = format!("/v1/approvals/{}", approval["id"].as_str().unwrap());
                    let reply = call(server.post(TOKEN_A, &path, body)).await;
                    assert!(
                        [StatusCode::OK, StatusCode::CONFLICT].contains(&reply.status),
                        "an answer is taken or loses a race, nothing else: {} {}",
                        reply.status,
                        reply.body
                    );
                }
                if rng.below(4) == 0 {
                    let session = &sessions[rng.below(sessions.len() as u64) as usize];
                    let runs = server
                        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}/runs"))
                        .await;
                    if let Some(runs) = runs["items"].as_array().filter(|r| !r.is_empty()) {
                        let run = runs[rng.below(runs.len() as u64) as usize]["id"]
                            .as_str()
                            .unwrap();
                        let reply = call(server.post(
                            TOKEN_A,
                            &format!("/v1/runs/{run}/cancel"),
                            json!({}),
                        ))
                        .await;
                        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
                    }
                }
                tokio::time::sleep(std::time::Duration::from_millis(rng.below(15))).await;
            }
        }));
    }
    let mut sent: Vec<Sent> = Vec::new();
    for sender in senders {
        sent.extend(sender.await.unwrap());
    }
    // Everything settles: every run of every session ends, nothing is queued or steering.
    let settle = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let mut busy = false;
        for session in &sessions {
            let now = server
                .get_ok(TOKEN_A, &format!("/v1/sessions/{session}"))
                .await;
            let runs = server
                .get_ok(TOKEN_A, &format!("/v1/sessions/{session}/runs?limit=200"))
                .await;
            busy |= !now["active_run_id"].is_null()
                || runs["items"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|r| r["status"] == "queued");
        }
        if !busy {
            break;
        }
        assert!(
            tokio::time::Instant::now() < settle,
            "the runs did not settle"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    stop.cancel();
    for human in humans {
        human.await.unwrap();
    }

    let lines = std::fs::read_to_string(&log).unwrap_or_default();
    let lines: Vec<&str> = lines.lines().collect();
    let unique: std::collections::BTreeSet<&str> = lines.iter().copied().collect();
    assert_eq!(unique.len(), lines.len(), "no tool ran twice: {lines:?}");
    let mut finished_runs = 0;
    for session in &sessions {
        let events = server
            .replay(&format!("/v1/sessions/{session}/events?follow=false"), None)
            .await;
        let mut status: std::collections::BTreeMap<String, String> = Default::default();
        // When a human's cancel or abort of each run was accepted.
        let mut ended_by_human: std::collections::BTreeMap<String, i64> = Default::default();
        let mut denied: std::collections::BTreeSet<(String, String)> = Default::default();
        let mut finished: std::collections::BTreeMap<String, usize> = Default::default();
        let mut never_started: std::collections::BTreeSet<String> = Default::default();
        let mut message_runs: std::collections::BTreeMap<String, String> = Default::default();
        for event in &events {
            let payload = &event.data["payload"];
            let run = event.run_id.clone().unwrap_or_default();
            match event.kind.as_str() {
                "run.created" => {
                    status.insert(run.clone(), "queued".into());
                    never_started.insert(run.clone());
                    message_runs.insert(payload["message_id"].as_str().unwrap().to_owned(), run);
                }
                "run.status" => {
                    let to = payload["status"].as_str().unwrap().to_owned();
                    if to == "running" {
                        never_started.remove(&run);
                    }
                    if to == "cancelling" || to == "cancelled" {
                        let at = event.data["created_at"].as_i64().unwrap();
                        ended_by_human.entry(run.clone()).or_insert(at);
                    }
                    status.insert(run, to);
                }
                "approval.decided" => {
                    if payload["answer"] == "abort" {
                        let at = event.data["created_at"].as_i64().unwrap();
                        ended_by_human.entry(run.clone()).or_insert(at);
                    }
                    for decision in payload["answer"]["decisions"]
                        .as_array()
                        .into_iter()
                        .flatten()
                    {
                        if decision["decision"] == "deny" {
                            denied.insert((
                                run.clone(),
                                decision["call_id"].as_str().unwrap().to_owned(),
                            ));
                        }
                    }
                }
                "tool.call" => {
                    // A replay-safe call's event is stored with its step's commit, which may
                    // come after the cancel: when the call started is in the payload.
                    let call_id = payload["call_id"].as_str().unwrap().to_owned();
                    let started_at = payload["started_at"].as_i64().unwrap();
                    assert!(
                        ended_by_human.get(&run).is_none_or(|at| started_at <= *at),
                        "{run}: tool {call_id} started after its cancel was accepted"
                    );
                    assert!(
                        !denied.contains(&(run.clone(), call_id.clone())),
                        "{run}: denied call {call_id} started"
                    );
                }
                "run.finished" => *finished.entry(run).or_default() += 1,
                _ => {}
            }
            let active = status
                .values()
                .filter(|s| !["queued", "completed", "failed", "cancelled"].contains(&s.as_str()))
                .count();
            assert!(
                active <= 1,
                "{session} has {active} active runs after event #{}",
                event.seq
            );
        }
        for (run, status) in &status {
            assert!(
                ["completed", "failed", "cancelled"].contains(&status.as_str()),
                "{run} ended {status}"
            );
            assert_eq!(finished.get(run), Some(&1), "{run} has exactly one end");
            let state = server.get_ok(TOKEN_A, &format!("/v1/runs/{run}")).await;
            assert!(state["stop_reason"].is_string(), "{state}");
            finished_runs += 1;
        }
        for (run, call_id) in &denied {
            let line = format!("{run}/{call_id}");
            assert!(!unique.contains(line.as_str()), "denied {line} ran");
        }
        // Every message is in the conversation once, or its run was cancelled before it began.
        let messages = server.messages(session).await;
        let shown: Vec<&str> = messages
            .iter()
            .filter(|m| m["role"] == "user")
            .map(|m| m["id"].as_str().unwrap())
            .collect();
        for message in sent.iter().filter(|m| &m.session == session) {
            let times = shown.iter().filter(|id| **id == message.message_id).count();
            let cancelled_unstarted = message_runs
                .get(&message.message_id)
                .is_some_and(|run| never_started.contains(run));
            assert!(
                times == 1 || (times == 0 && cancelled_unstarted),
                "{:?} shown {times} times (run cancelled before it began: {cancelled_unstarted})",
                message.content
            );
        }
    }
    assert!(finished_runs >= SESSIONS, "every session ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_deadline_a_run_ends_timed_out_and_starts_nothing_more() {
    let forever = json!({"replies": [
        {"text": "Waiting.", "tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 150}}]}
    ]});
    let server = Server::start_with(forever, |template, _| {
        template.limits.max_duration_ms = Some(400);
    })
    .await;
    let (_, run, ended) = server.run_to_end("wait").await;
    assert_eq!(
        (&ended["status"], &ended["stop_reason"]),
        (&json!("failed"), &json!("timed_out")),
        "{ended}"
    );
    let took = ended["finished_at"].as_i64().unwrap() - ended["started_at"].as_i64().unwrap();
    assert!(
        (400..5_000).contains(&took),
        "ended {took} ms after it started"
    );
    let steps = server
        .get_ok(TOKEN_A, &format!("/v1/runs/{run}/steps?limit=200"))
        .await;
    let steps = steps["items"].as_array().unwrap();
    assert!(
        steps.iter().all(|s| s["summary"]["conclude"] != true),
        "no concluding call is made past the deadline: {steps:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_an_aborted_run_never_ran_reach_the_next_model_call_answered() {
    let recorder = Recorder::new(1);
    let model = Arc::clone(&recorder);
    let server = Server::start_with(quick_script(), move |template, models| {
        template.model = "recorder".into();
        let add = template.tools.iter_mut().find(|t| t.name == "add").unwrap();
        add.approval = ApprovalPolicy::Always;
        models.register("recorder", model);
    })
    .await;
    let session = server.create_session(TOKEN_A).await;
    let first = server.send(TOKEN_A, &session, "add").await;
    let run = first["run_id"].as_str().unwrap().to_owned();
    let mut events = server.stream(&format!("/v1/runs/{run}/events"), None).await;
    let seen = events.until(|e| e.kind == "approval.required").await;
    let approval = seen.last().unwrap().data["payload"]["approval_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let path = format!("/v1/approvals/{approval}");
    let reply = call(server.post(TOKEN_A, &path, json!({"abort": true}))).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);

    let second = server.send(TOKEN_A, &session, "again").await;
    let done = server.finish(second["run_id"].as_str().unwrap()).await;
    assert_eq!(done["status"], "completed", "{done}");
    let requests = recorder.requests.lock().unwrap().clone();
    let sent = &requests.last().unwrap().messages;
    let roles: Vec<ratchet_core::Role> = sent.iter().map(|m| m.role).collect();
    use ratchet_core::Role::{Assistant, Tool, User};
    assert_eq!(roles, [User, Assistant, Tool, User], "{sent:?}");
    assert_eq!(sent[2].tool_call_id.as_deref(), Some("call-0"));
    assert!(sent[2].content.starts_with("not run"), "{:?}", sent[2]);
    let visible = server.messages(&session).await;
    assert_eq!(
        visible.len(),
        4,
        "clients see what happened, without invented results"
    );
}

// ---------------------------------------------------------------------------------------
// Usage and cost

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_and_cost_show_in_the_run_its_steps_events_and_metrics() {
    let server = Server::start_with(quick_script(), |template, models| {
        template.model = "metered".into();
        template.model_settings = Some(ratchet_core::ModelSettings {
            provider: "openai".into(),
            base_url: "http://127.0.0.1:9/v1".into(),
            model: "metered-1".into(),
            api_key_env: None,
            connect_timeout_ms: 1_000,
            read_timeout_ms: 1_000,
            stream: true,
            max_output_tokens: None,
            // Cache writes at the default price, 1.25 × input; cache reads at their own.
            prices: Some(ratchet_core::Prices {
                input_per_mtok: 2.5,
                output_per_mtok: 10.0,
                cache_write_per_mtok: None,
                cache_read_per_mtok: Some(0.5),
            }),
        });
        // Answers at once, reporting 1,000 prompt tokens (200 written to the cache, 500 read
        // from it) and 400 generated, 100 reasoning.
        let metered = FnModel(|_| {
            Ok(ratchet_core::ModelReply {
                text: "metered".into(),
                tool_calls: Vec::new(),
                usage: ratchet_core::Usage {
                    input_tokens: 1_000,
                    output_tokens: 400,
                    reasoning_tokens: 100,
                    cache_write_tokens: 200,
                    cache_read_tokens: 500,
                },
                reasoning: String::new(),
            })
        });
        models.register("metered", Arc::new(metered));
    })
    .await;
    let (_, run, done) = server.run_to_end("how much?").await;
    let usage = &done["usage"];
    assert_eq!(
        (
            &usage["input_tokens"],
            &usage["output_tokens"],
            &usage["reasoning_tokens"],
            &usage["cache_write_tokens"],
            &usage["cache_read_tokens"]
        ),
        (
            &json!(1000),
            &json!(400),
            &json!(100),
            &json!(200),
            &json!(500)
        ),
        "{done}"
    );
    // 300 uncached × $2.5/M + 200 written × $3.125/M + 500 read × $0.5/M + 400 × $10/M
    // = $0.005625
    assert!(
        (usage["cost_usd"].as_f64().unwrap() - 0.005625).abs() < 1e-12,
        "{usage}"
    );
    let steps = server
        .get_ok(TOKEN_A, &format!("/v1/runs/{run}/steps"))
        .await;
    let summary = &steps["items"][0]["summary"];
    assert_eq!(summary["cost_microusd"], 5625);
    assert_eq!(
        (
            &summary["cache_write_tokens"],
            &summary["cache_read_tokens"]
        ),
        (&json!(200), &json!(500))
    );
    let events = server
        .replay(&format!("/v1/runs/{run}/events?follow=false"), None)
        .await;
    let message = events
        .iter()
        .find(|e| e.kind == "assistant.message")
        .unwrap();
    assert_eq!(message.data["payload"]["usage"]["reasoning_tokens"], 100);
    assert_eq!(message.data["payload"]["usage"]["cache_read_tokens"], 500);
    assert_eq!(message.data["payload"]["cost_microusd"], 5625);
    let finished = events.iter().find(|e| e.kind == "run.finished").unwrap();
    assert_eq!(finished.data["payload"]["counters"]["cost_microusd"], 5625);
    assert_eq!(
        finished.data["payload"]["counters"]["cache_write_tokens"],
        200
    );
    let metrics = server
        .http
        .get(server.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "ratchet_model_tokens_total{kind=\"input\"} 1000",
        "ratchet_model_tokens_total{kind=\"reasoning\"} 100",
        "ratchet_model_tokens_total{kind=\"cache_write\"} 200",
        "ratchet_model_tokens_total{kind=\"cache_read\"} 500",
        "ratchet_model_cost_microdollars_total 5625",
    ] {
        assert!(metrics.contains(line), "{line} missing from:\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_is_an_event_of_its_step_and_never_the_answer_nor_sent_back() {
    let requests = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = requests.clone();
    let server = Server::start_with(quick_script(), move |template, models| {
        template.model = "thinking".into();
        // Reasons before each answer: first it adds, then it answers.
        let thinking = FnModel(move |request: ratchet_llm::ModelRequest| {
            let first = request.call_index == 0;
            seen.lock().unwrap().push(request.messages);
            Ok(if first {
                ratchet_core::ModelReply {
                    text: "Let me add.".into(),
                    tool_calls: vec![ratchet_core::ToolCall {
                        id: "call-0".into(),
                        name: "add".into(),
                        arguments: json!({"a": 2, "b": 3}),
                    }],
                    reasoning: "SECRET-PLAN: add 2 and 3.".into(),
                    ..Default::default()
                }
            } else {
                ratchet_core::ModelReply {
                    text: "The sum is 5.".into(),
                    reasoning: "SECRET-CHECK: the tool said 5.".into(),
                    ..Default::default()
                }
            })
        });
        models.register("thinking", Arc::new(thinking));
    })
    .await;
    let (session, run, done) = server.run_to_end("add 2 and 3").await;
    assert_eq!(done["final_answer"], "The sum is 5.", "{done}");

    let events = server
        .replay(&format!("/v1/runs/{run}/events?follow=false"), None)
        .await;
    let reasoning: Vec<&Value> = events
        .iter()
        .filter(|e| e.kind == "assistant.reasoning")
        .map(|e| &e.data["payload"])
        .collect();
    assert_eq!(
        reasoning,
        [
            &json!({"run_id": run, "step_index": 1, "text": "SECRET-PLAN: add 2 and 3."}),
            &json!({"run_id": run, "step_index": 3, "text": "SECRET-CHECK: the tool said 5."}),
        ]
    );
    // Each is stored with its step's commit, just ahead of the step's answer.
    let kinds = kinds(&events);
    for (at, kind) in kinds.iter().enumerate() {
        if *kind == "assistant.reasoning" {
            assert_eq!(kinds[at + 1], "assistant.message", "{kinds:?}");
        }
    }
    for event in events.iter().filter(|e| e.kind != "assistant.reasoning") {
        assert!(
            !event.data.to_string().contains("SECRET"),
            "{:?}",
            event.data
        );
    }
    for message in server.messages(&session).await {
        assert!(!message.to_string().contains("SECRET"), "{message}");
    }
    let requests = requests.lock().unwrap();
    assert_eq!(requests.len(), 2);
    assert!(
        requests[1].iter().all(|m| !m.content.contains("SECRET")),
        "reasoning went back to the model: {:?}",
        requests[1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_model_call_ends_the_run_with_llm_error_and_the_providers_message() {
    let server = Server::start_with(quick_script(), |template, models| {
        template.model = "refusing".into();
        // Refuses every call, as a provider does with a bad key.
        let refusing = FnModel(|_| {
            Err(ratchet_llm::Error::Fatal(
                "HTTP 401: Incorrect API key provided".into(),
            ))
        });
        models.register("refusing", Arc::new(refusing));
    })
    .await;
    let (_, run, done) = server.run_to_end("hello").await;
    assert_eq!(
        (&done["status"], &done["stop_reason"]),
        (&json!("failed"), &json!("llm_error")),
        "{done}"
    );
    let events = server
        .replay(&format!("/v1/runs/{run}/events?follow=false"), None)
        .await;
    let errors: Vec<&Ev> = events.iter().filter(|e| e.kind == "model.error").collect();
    assert_eq!(errors.len(), 1, "refused once, not retried");
    let payload = &errors[0].data["payload"];
    assert_eq!(payload["message"], "HTTP 401: Incorrect API key provided");
    assert_eq!(payload["final"], true);
}

fn criteria(max_attempts: u32) -> ratchet_core::CompletionCriteria {
    ratchet_core::CompletionCriteria {
        required_tools: vec!["add".into()],
        required_fields: vec!["summary".into()],
        min_steps: 0,
        max_attempts,
    }
}

/// A model that tries to finish before its criteria are met is told what is missing and goes
/// on; the API shows the refusals and, while unmet, the blockers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_is_refused_until_its_criteria_are_met() {
    let script = json!({"replies": [
        {"text": "All done."},
        {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]},
        {"text": "```json\n{\"summary\": \"2 + 3 = 5\"}\n```"}
    ]});
    let server = Server::start_with(script, |template, _| {
        template.completion = Some(criteria(3));
    })
    .await;
    let (session, run, done) = server.run_to_end("add, then report").await;
    assert_eq!(
        (
            &done["status"],
            &done["completion_refusals"],
            &done["completion_blockers"]
        ),
        (&json!("completed"), &json!(1), &json!([])),
        "{done}"
    );
    let events = server
        .replay(&format!("/v1/runs/{run}/events?follow=false"), None)
        .await;
    let blocked: Vec<&Ev> = events
        .iter()
        .filter(|e| e.kind == "completion.blocked")
        .collect();
    assert_eq!(blocked.len(), 1);
    assert_eq!(
        blocked[0].data["payload"]["blockers"],
        json!([{"kind": "tool_not_called", "tool": "add"}, {"kind": "answer_not_json"}])
    );
    let messages = server.messages(&session).await;
    assert!(
        messages.iter().all(|m| !m["content"]
            .as_str()
            .unwrap_or_default()
            .contains("cannot finish yet")),
        "the runtime's note to the model is hidden: {messages:?}"
    );

    let stubborn = json!({"replies": [{"text": "All done."}]});
    let server = Server::start_with(stubborn, |template, _| {
        template.completion = Some(criteria(1));
    })
    .await;
    let (_, _, failed) = server.run_to_end("just say done").await;
    assert_eq!(
        (
            &failed["status"],
            &failed["stop_reason"],
            &failed["completion_refusals"]
        ),
        (&json!("failed"), &json!("completion_blocked"), &json!(2)),
        "{failed}"
    );
    assert_eq!(
        failed["completion_blockers"],
        json!([{"kind": "tool_not_called", "tool": "add"}, {"kind": "answer_not_json"}])
    );
}
