//! The HTTP API over a real socket: a server on 127.0.0.1 with a fresh SQLite file, a real
//! worker pool and a scripted model, driven with reqwest. Covers every endpoint, tenants and
//! tokens, bad input, and the event streams' promise: resumable without a gap or a duplicate.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::CONTENT_TYPE;
use serde_json::{Value, json};
use tokio::time::{Instant, timeout};

use crate::common::*;

// ---------------------------------------------------------------------------------------
// Endpoints

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_created_fetched_and_listed_page_by_page() {
    let server = Server::start(quick_script()).await;
    let created = call(server.post(
        TOKEN_A,
        "/v1/sessions",
        json!({"agent": "default", "metadata": {"team": "blue"}}),
    ))
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let first = created.body["id"].as_str().unwrap().to_owned();
    assert!(first.starts_with("ses_"), "{first}");
    assert_eq!(created.body["agent"], "default");
    assert_eq!(created.body["metadata"], json!({"team": "blue"}));
    assert!(created.body["active_run_id"].is_null());
    assert!(created.body["created_at"].as_i64().unwrap() > 0);
    let fetched = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{first}"))
        .await;
    assert_eq!(fetched, created.body);

    let mut created: Vec<String> = vec![first];
    for _ in 0..4 {
        created.push(server.create_session(TOKEN_A).await);
    }
    let pages = all_pages(&server, "/v1/sessions", 2).await;
    let sizes: Vec<usize> = pages.iter().map(Vec::len).collect();
    assert_eq!(sizes, [2, 2, 1], "5 sessions in pages of 2");
    let listed: Vec<String> = pages
        .iter()
        .flat_map(|p| ids(&Value::Array(p.clone())))
        .collect();
    let mut expected = created.clone();
    expected.sort();
    assert_eq!(listed, expected, "every session once, in id order");

    let whole = server.get_ok(TOKEN_A, "/v1/sessions").await;
    assert_eq!(ids(&whole["items"]), expected);
    assert!(whole["next_cursor"].is_null());
    let tail = server
        .get_ok(TOKEN_A, &format!("/v1/sessions?cursor={}", expected[2]))
        .await;
    assert_eq!(ids(&tail["items"]), expected[3..]);

    // Newest first, a page at a time, for a console's list.
    let newest: Vec<String> = expected.iter().rev().cloned().collect();
    let pages = all_pages(&server, "/v1/sessions?order=newest", 2).await;
    let listed: Vec<String> = pages
        .iter()
        .flat_map(|p| ids(&Value::Array(p.clone())))
        .collect();
    assert_eq!(listed, newest, "every session once, newest first");
    let oldest = server.get_ok(TOKEN_A, "/v1/sessions?order=oldest").await;
    assert_eq!(ids(&oldest["items"]), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_titled_renamed_found_and_paged_by_activity() {
    let server = Server::start(quick_script()).await;
    let quiet = server.create_session(TOKEN_A).await;
    let trip = server.create_session(TOKEN_A).await;
    let budget = server.create_session(TOKEN_A).await;
    let run = server.send(TOKEN_A, &trip, "Plan my trip\nto Rome").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    server.finish(&run).await;
    let titled = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{trip}"))
        .await;
    assert_eq!(
        (
            &titled["title"],
            &titled["last_run_status"],
            &titled["status"]
        ),
        (&json!("Plan my trip"), &json!("completed"), &json!("idle"))
    );
    assert!(
        titled["parent_session_id"].is_null(),
        "a session a person started has no parent: {titled}"
    );

    let path = format!("/v1/sessions/{budget}");
    let renamed = call(server.patch(TOKEN_A, &path, json!({"title": "  Budget review "}))).await;
    assert_eq!(renamed.status, StatusCode::OK, "{}", renamed.body);
    assert_eq!(renamed.body["title"], "Budget review");
    for (body, status) in [
        (json!({"title": "   "}), StatusCode::UNPROCESSABLE_ENTITY),
        (
            json!({"title": "a\u{7}b"}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            json!({"title": "x".repeat(201)}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (json!({"name": "x"}), StatusCode::UNPROCESSABLE_ENTITY),
    ] {
        let refused = call(server.patch(TOKEN_A, &path, body.clone())).await;
        assert_eq!(refused.status, status, "{body}: {}", refused.body);
        assert!(
            refused.body["error"]["message"].is_string(),
            "{}",
            refused.body
        );
    }
    let foreign = call(server.patch(TOKEN_B, &path, json!({"title": "mine"}))).await;
    assert_error(
        "another tenant's session",
        &foreign,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    assert_eq!(
        server.get_ok(TOKEN_A, &path).await["title"],
        "Budget review",
        "nothing refused was written"
    );

    let on = &server;
    let found = |query: &str| {
        let path = format!("/v1/sessions?{query}");
        async move { ids(&on.get_ok(TOKEN_A, &path).await["items"]) }
    };
    assert_eq!(
        found("q=ROME").await,
        std::slice::from_ref(&trip),
        "message text, any case"
    );
    assert_eq!(
        found("q=budget").await,
        std::slice::from_ref(&budget),
        "titles"
    );
    assert_eq!(
        found(&format!("q={}", &quiet[4..20])).await,
        std::slice::from_ref(&quiet),
        "ids"
    );
    let mut all = vec![quiet.clone(), trip.clone(), budget.clone()];
    all.sort();
    assert_eq!(found("status=idle&agent=default").await, all);
    assert!(found("status=failed").await.is_empty());
    assert!(found("status=waiting_human").await.is_empty());
    assert!(found("created_from=99999999999999").await.is_empty());
    assert!(found("agent=planner").await.is_empty());

    // Latest activity first, a page at a time: the run's session leads.
    let pages = all_pages(&server, "/v1/sessions?order=activity", 2).await;
    let listed: Vec<String> = pages
        .iter()
        .flat_map(|p| ids(&Value::Array(p.clone())))
        .collect();
    assert_eq!(listed.len(), 3, "every session once: {listed:?}");
    assert_eq!(listed[0], trip);
    let page = server
        .get_ok(TOKEN_A, "/v1/sessions?order=activity&limit=1")
        .await;
    let cursor = page["next_cursor"].as_str().unwrap();
    assert!(cursor.ends_with(&format!(".{trip}")), "{cursor}");

    let long = format!("q={}", "x".repeat(201));
    for query in [
        "order=activity&cursor=nonsense",
        "status=bogus",
        "cursor=ses_x&order=activity",
        &long,
        "q=%20%20",
        "agent=",
        "created_from=-1",
    ] {
        let refused = call(server.get(TOKEN_A, &format!("/v1/sessions?{query}"))).await;
        assert_eq!(
            refused.status,
            StatusCode::BAD_REQUEST,
            "{query}: {}",
            refused.body
        );
    }
}

/// A run reads back each budget it has with what it used; a cancelled run has no answer,
/// whatever its model said on the way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_tells_its_budgets_and_only_a_completed_run_its_answer() {
    let script = json!({"replies": [
        {"text": "Going to sleep.", "tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 60000}}]},
        {"text": "never"}
    ]});
    let server = Server::start_with(script, |config, _| {
        config.limits.max_steps = 9;
        config.limits.max_tokens = Some(5_000);
    })
    .await;
    let session = server.create_session(TOKEN_A).await;
    let run = server.send(TOKEN_A, &session, "nap").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    server
        .stream(&format!("/v1/runs/{run}/events"), None)
        .await
        .until_running("sleep_ms")
        .await;
    let running = server.get_ok(TOKEN_A, &format!("/v1/runs/{run}")).await;
    let budgets = running["budgets"].as_array().unwrap();
    assert_eq!(
        budgets[0],
        json!({"kind": "steps", "used": 1, "limit": 9, "spent": false}),
        "{running}"
    );
    assert_eq!(budgets[1]["kind"], "tokens");
    assert_eq!(budgets[1]["limit"], 5_000);
    assert!(budgets[1]["used"].as_u64().unwrap() > 0, "{running}");
    assert_eq!(budgets.len(), 2, "only the budgets the run has: {running}");

    let cancelled = call(server.post(TOKEN_A, &format!("/v1/runs/{run}/cancel"), json!({}))).await;
    assert!(cancelled.status.is_success(), "{}", cancelled.body);
    let ended = server.finish(&run).await;
    assert_eq!(ended["status"], "cancelled", "{ended}");
    assert!(
        ended["final_answer"].is_null(),
        "what it said on its way is not its answer: {ended}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_tells_its_status_and_last_activity() {
    let server = Server::start(sleepy_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let fresh = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}"))
        .await;
    assert_eq!(fresh["status"], "idle");
    assert_eq!(fresh["last_activity_at"], fresh["created_at"], "{fresh}");

    let accepted = server.send(TOKEN_A, &session, "take a nap").await;
    // The run then sleeps in its tool call, writing nothing until it is cancelled.
    server
        .stream(&format!("/v1/sessions/{session}/events"), None)
        .await
        .until_running("sleep_ms")
        .await;
    let events = server
        .replay(&format!("/v1/sessions/{session}/events?follow=false"), None)
        .await;
    let created = &events[0];
    assert_eq!(created.kind, "run.created");
    assert_eq!(
        (
            &created.data["payload"]["message_id"],
            &created.data["payload"]["content"]
        ),
        (&accepted["message_id"], &json!("take a nap")),
        "a run's creation carries its message"
    );
    let busy = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}"))
        .await;
    assert_eq!(busy["status"], "running", "{busy}");
    assert_eq!(
        busy["last_activity_at"],
        events.last().unwrap().data["created_at"],
        "the latest event's time"
    );
    let listed = server.get_ok(TOKEN_A, "/v1/sessions").await;
    assert_eq!(listed["items"][0]["status"], "running");

    let archived = call(server.post(
        TOKEN_A,
        &format!("/v1/sessions/{session}/archive"),
        json!({}),
    ))
    .await;
    assert!(archived.status.is_success(), "{}", archived.body);
    let closed = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}"))
        .await;
    assert_eq!(closed["status"], "archived");
    assert!(
        closed["last_activity_at"].as_i64() >= busy["last_activity_at"].as_i64(),
        "{closed}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_runs_to_completion_with_its_messages_runs_and_steps_listed() {
    let server = Server::start(quick_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let accepted = server.send(TOKEN_A, &session, "hello").await;
    assert_eq!(
        keys(&accepted),
        ["message_id", "run_id", "run_status", "steered"],
        "{accepted}"
    );
    assert!(accepted["message_id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(accepted["run_status"], "running");
    let run = accepted["run_id"].as_str().unwrap().to_owned();
    assert!(run.starts_with("run_"));

    let state = server.finish(&run).await;
    assert_eq!(state["id"], run.as_str());
    assert_eq!(state["session_id"], session.as_str());
    assert_eq!(state["status"], "completed", "{state}");
    assert!(state["stop_reason"].is_string(), "{state}");
    assert_eq!(state["step_index"], 3, "llm, tools, llm: {state}");
    assert_eq!(state["usage"]["model_calls"], 2, "{state}");
    assert_eq!(state["usage"]["tool_calls"], 1, "{state}");
    assert!(state["usage"]["output_tokens"].as_u64().unwrap() > 0);
    assert_eq!(state["final_answer"], "The sum is 5.");
    assert!(state["finished_at"].as_i64().unwrap() >= state["created_at"].as_i64().unwrap());
    let session_now = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}"))
        .await;
    assert!(session_now["active_run_id"].is_null(), "{session_now}");

    // Messages: the conversation in order.
    let messages_path = format!("/v1/sessions/{session}/messages");
    let messages = server.get_ok(TOKEN_A, &messages_path).await;
    assert!(messages["next_cursor"].is_null());
    let items = messages["items"].as_array().unwrap();
    let field =
        |name: &str| -> Vec<&str> { items.iter().map(|m| m[name].as_str().unwrap()).collect() };
    assert_eq!(field("role"), ["user", "assistant", "tool", "assistant"]);
    assert_eq!(field("origin"), ["user", "agent", "agent", "agent"]);
    assert_eq!(field("visibility"), ["visible"; 4]);
    assert_eq!(field("run_id"), [run.as_str(); 4]);
    let contents = field("content");
    assert_eq!(contents[0], "hello");
    assert_eq!(contents[1], "Let me add.");
    assert!(
        contents[2].contains('5'),
        "the tool's result: {}",
        contents[2]
    );
    assert_eq!(contents[3], "The sum is 5.");
    assert_eq!(items[0]["id"], accepted["message_id"]);
    let calls = items[1]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["name"], "add");
    assert_eq!(items[2]["tool_call_id"], calls[0]["id"]);
    // One message per page gives the same conversation.
    let pages = all_pages(&server, &messages_path, 1).await;
    let paged: Vec<Value> = pages.concat();
    assert_eq!(&paged, items);

    // Runs of the session.
    let runs = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}/runs"))
        .await;
    assert_eq!(ids(&runs["items"]), [run.as_str()]);
    assert_eq!(runs["items"][0]["status"], "completed");
    assert_eq!(runs["items"][0]["step_index"], 3);

    // Steps, numbered from 1, and paged by index.
    let steps_path = format!("/v1/runs/{run}/steps");
    let steps = server.get_ok(TOKEN_A, &steps_path).await;
    let steps = steps["items"].as_array().unwrap();
    let indexes: Vec<u64> = steps.iter().map(|s| s["index"].as_u64().unwrap()).collect();
    assert_eq!(indexes, [1, 2, 3]);
    for step in steps {
        assert!(step["instruction"].as_str().is_some_and(|i| !i.is_empty()));
        assert!(step["duration_ms"].as_i64().unwrap() >= 0);
    }
    let paged: Vec<Value> = all_pages(&server, &steps_path, 2).await.concat();
    assert_eq!(&paged, steps);

    // Each step opened up: what its model call was sent, and what it wrote.
    let step = async |index: u64| {
        let path = format!("/v1/runs/{run}/steps/{index}");
        server.get_ok(TOKEN_A, &path).await
    };
    let first = step(1).await;
    assert_eq!(first["index"], 1);
    assert_eq!(first["instruction"], "call_llm");
    let sent = &first["model_call"];
    let roles = |call: &Value| -> Vec<String> {
        (call["messages"].as_array().unwrap().iter())
            .map(|m| m["role"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(roles(sent), ["user"], "{first}");
    assert_eq!(sent["messages"][0]["content"], "hello");
    let offered: Vec<&str> = (sent["tools"].as_array().unwrap().iter())
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert!(offered.contains(&"add"), "{offered:?}");
    assert!(sent["tools"][0]["parameters"].is_object(), "{first}");
    assert_eq!(sent["reply"]["content"], "Let me add.");
    assert_eq!(sent["reply"]["tool_calls"], items[1]["tool_calls"]);
    assert_eq!(first["written"].as_array().unwrap().len(), 1, "{first}");

    let batch = step(2).await;
    assert!(
        batch["model_call"].is_null(),
        "a batch calls no model: {batch}"
    );
    assert_eq!(batch["written"][0]["role"], "tool");
    assert_eq!(batch["written"][0]["tool_call_id"], calls[0]["id"]);

    let last = step(3).await;
    let sent = &last["model_call"];
    assert_eq!(roles(sent), ["user", "assistant", "tool"], "{last}");
    assert_eq!(sent["messages"][2]["content"], contents[2]);
    assert_eq!(sent["reply"]["content"], "The sum is 5.");
    assert_eq!(
        sent["system_prompt"], first["model_call"]["system_prompt"],
        "a run's system prompt is frozen"
    );
    let state = server.get_ok(TOKEN_A, &format!("/v1/runs/{run}")).await;
    assert_eq!(state["step_index"], 3);
    for (index, status) in [
        ("4", StatusCode::NOT_FOUND),
        ("0", StatusCode::BAD_REQUEST),
        ("one", StatusCode::BAD_REQUEST),
    ] {
        let response = call(server.get(TOKEN_A, &format!("/v1/runs/{run}/steps/{index}"))).await;
        assert_eq!(response.status, status, "step {index}: {}", response.body);
        assert!(
            response.body["error"]["message"].as_str().is_some(),
            "{}",
            response.body
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multitask_interrupt_cancels_the_active_run_and_starts_the_new_one() {
    let server = Server::start(sleepy_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let first = server.send(TOKEN_A, &session, "sleep").await;
    let run = first["run_id"].as_str().unwrap().to_owned();
    let mut run_events = server.stream(&format!("/v1/runs/{run}/events"), None).await;
    run_events.until_running("sleep_ms").await;

    let messages_path = format!("/v1/sessions/{session}/messages");
    let interrupting = call(server.post(
        TOKEN_A,
        &messages_path,
        json!({"content": "forget that", "multitask": "interrupt"}),
    ))
    .await;
    assert_eq!(
        interrupting.status,
        StatusCode::ACCEPTED,
        "{}",
        interrupting.body
    );
    let newcomer = interrupting.body["run_id"].as_str().unwrap().to_owned();
    let ended = server.finish(&run).await;
    assert_eq!(ended["status"], "cancelled", "{ended}");
    assert_eq!(ended["stop_reason"], "cancelled");
    let mut newcomer_events = server
        .stream(&format!("/v1/runs/{newcomer}/events"), None)
        .await;
    newcomer_events.until_running("sleep_ms").await;
    let session_now = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}"))
        .await;
    assert_eq!(
        session_now["active_run_id"],
        newcomer.as_str(),
        "the newcomer holds the session"
    );
    let cancelled = call(
        server
            .http
            .post(server.url(&format!("/v1/runs/{newcomer}/cancel")))
            .bearer_auth(TOKEN_A),
    )
    .await;
    assert_eq!(cancelled.status, StatusCode::OK, "{}", cancelled.body);
    assert_eq!(server.finish(&newcomer).await["status"], "cancelled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multitask_reject_conflicts_enqueue_queues_and_a_slow_run_is_cancelled() {
    let server = Server::start(sleepy_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let first = server.send(TOKEN_A, &session, "sleep").await;
    assert_eq!(first["run_status"], "running");
    let run = first["run_id"].as_str().unwrap().to_owned();
    let mut run_events = server.stream(&format!("/v1/runs/{run}/events"), None).await;
    run_events.until_running("sleep_ms").await;

    let messages_path = format!("/v1/sessions/{session}/messages");
    let rejected = call(server.post(
        TOKEN_A,
        &messages_path,
        json!({"content": "now", "multitask": "reject"}),
    ))
    .await;
    assert_error(
        "reject while active",
        &rejected,
        StatusCode::CONFLICT,
        "conflict",
    );
    let queued = call(server.post(
        TOKEN_A,
        &messages_path,
        json!({"content": "later", "multitask": "enqueue"}),
    ))
    .await;
    assert_eq!(queued.status, StatusCode::ACCEPTED, "{}", queued.body);
    assert_eq!(queued.body["run_status"], "queued");
    let queued_run = queued.body["run_id"].as_str().unwrap().to_owned();

    let session_now = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}"))
        .await;
    assert_eq!(session_now["active_run_id"], run.as_str());
    let runs = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}/runs"))
        .await;
    let statuses: BTreeMap<String, String> = runs["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["id"].as_str().unwrap().to_owned(),
                r["status"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        statuses,
        BTreeMap::from([
            (run.clone(), "running".to_owned()),
            (queued_run.clone(), "queued".to_owned()),
        ])
    );
    let contents: Vec<String> = server.get_ok(TOKEN_A, &messages_path).await["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"].as_str().unwrap().to_owned())
        .collect();
    assert!(
        !contents.contains(&"now".to_owned()),
        "a rejected message is not recorded: {contents:?}"
    );

    // The queued run has no step in flight: it ends at once.
    let cancel = |id: &str| {
        server
            .http
            .post(server.url(&format!("/v1/runs/{id}/cancel")))
    };
    let cancelled = call(cancel(&queued_run).bearer_auth(TOKEN_A)).await;
    assert_eq!(cancelled.status, StatusCode::OK, "{}", cancelled.body);
    assert_eq!(
        cancelled.body,
        json!({"run_id": queued_run, "status": "cancelled"})
    );

    // The running one is sleeping inside a tool: it winds down.
    let cancelling = call(cancel(&run).bearer_auth(TOKEN_A)).await;
    assert_eq!(cancelling.status, StatusCode::OK, "{}", cancelling.body);
    assert_eq!(
        cancelling.body,
        json!({"run_id": run, "status": "cancelling"})
    );
    let started = Instant::now();
    run_events.until(|e| e.kind == "run.finished").await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the sleep was interrupted"
    );
    let state = server.get_ok(TOKEN_A, &format!("/v1/runs/{run}")).await;
    assert_eq!(state["status"], "cancelled", "{state}");
    assert_eq!(state["stop_reason"], "cancelled", "{state}");
    assert!(state["finished_at"].is_i64());
    let again = call(cancel(&run).bearer_auth(TOKEN_A)).await;
    assert_eq!(again.body, json!({"run_id": run, "status": "cancelled"}));
    let queued_state = server
        .get_ok(TOKEN_A, &format!("/v1/runs/{queued_run}"))
        .await;
    assert_eq!(queued_state["status"], "cancelled", "{queued_state}");
    let session_now = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}"))
        .await;
    assert!(session_now["active_run_id"].is_null(), "{session_now}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_metrics_and_the_openapi_document() {
    let server = Server::start(quick_script()).await;
    let health = call(server.http.get(server.url("/healthz"))).await;
    assert_eq!(health.status, StatusCode::OK);
    assert_eq!(health.body, json!({"status": "ok"}));
    let ready = call(server.http.get(server.url("/readyz"))).await;
    assert_eq!(ready.status, StatusCode::OK);
    assert_eq!(ready.body, json!({"status": "ready"}));

    let session = server.create_session(TOKEN_A).await;
    let run = server.send(TOKEN_A, &session, "hello").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    server.finish(&run).await;
    let response = server
        .http
        .get(server.url("/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        response.headers()[CONTENT_TYPE]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    let text = response.text().await.unwrap();
    let value_of = |series: &str| -> f64 {
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
            .trim()
            .parse()
            .unwrap()
    };
    assert!(value_of("ratchet_steps_committed_total") >= 3.0);
    assert_eq!(value_of(r#"ratchet_runs{status="completed"}"#), 1.0);
    assert_eq!(value_of(r#"ratchet_runs{status="running"}"#), 0.0);

    let openapi = call(server.http.get(server.url("/openapi.json"))).await;
    assert_eq!(openapi.status, StatusCode::OK);
    assert!(openapi.body["openapi"].as_str().unwrap().starts_with('3'));
    let paths: BTreeMap<&str, Vec<&str>> = openapi.body["paths"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(path, _)| path.starts_with("/v1"))
        .map(|(path, item)| (path.as_str(), keys(item)))
        .collect();
    let expected = BTreeMap::from([
        ("/v1/agents", vec!["get"]),
        ("/v1/admin/reload", vec!["post"]),
        ("/v1/sessions", vec!["get", "post"]),
        ("/v1/sessions/{id}", vec!["delete", "get", "patch"]),
        ("/v1/sessions/{id}/archive", vec!["post"]),
        ("/v1/sessions/{id}/inbox", vec!["get"]),
        ("/v1/sessions/{id}/inbox/{event_id}/discard", vec!["post"]),
        ("/v1/sessions/{id}/inbox/{event_id}/requeue", vec!["post"]),
        ("/v1/sessions/{id}/messages", vec!["get", "post"]),
        ("/v1/sessions/{id}/runs", vec!["get"]),
        ("/v1/sessions/{id}/events", vec!["get"]),
        ("/v1/runs/{id}", vec!["get"]),
        ("/v1/runs/{id}/steps", vec!["get"]),
        ("/v1/runs/{id}/steps/{index}", vec!["get"]),
        ("/v1/runs/{id}/tree", vec!["get"]),
        ("/v1/runs/{id}/tree/events", vec!["get"]),
        ("/v1/runs/{id}/cancel", vec!["post"]),
        ("/v1/runs/{id}/pause", vec!["post"]),
        ("/v1/runs/{id}/reconcile", vec!["post"]),
        ("/v1/runs/{id}/resume", vec!["post"]),
        ("/v1/runs/{id}/retry", vec!["post"]),
        ("/v1/runs/{id}/continue", vec!["post"]),
        ("/v1/runs/{id}/fork", vec!["post"]),
        ("/v1/approvals", vec!["get"]),
        ("/v1/approvals/{id}", vec!["get", "post"]),
        ("/v1/runs/{id}/events", vec!["get"]),
        ("/v1/webhooks", vec!["get", "post"]),
        ("/v1/webhooks/{id}", vec!["delete", "get"]),
        ("/v1/webhooks/{id}/deliveries", vec!["get"]),
        ("/v1/webhooks/{id}/deliveries/requeue", vec!["post"]),
        (
            "/v1/webhooks/{id}/deliveries/{delivery_id}/requeue",
            vec!["post"],
        ),
        ("/v1/webhooks/{id}/rotate-secret", vec!["post"]),
        ("/v1/schedules", vec!["get", "post"]),
        ("/v1/schedules/{id}", vec!["delete", "get", "patch"]),
        ("/v1/schedules/{id}/pause", vec!["post"]),
        ("/v1/schedules/{id}/resume", vec!["post"]),
        ("/v1/schedules/{id}/trigger", vec!["post"]),
        ("/v1/schedules/{id}/runs", vec!["get"]),
    ]);
    assert_eq!(paths, expected);
    let error_detail = &openapi.body["components"]["schemas"]["ErrorDetail"];
    assert_eq!(
        error_detail["required"],
        json!(["code", "message"]),
        "only a rejected reload lists problems: {error_detail}"
    );
    let message_answers = &openapi.body["paths"]["/v1/sessions/{id}/messages"]["post"]["responses"];
    assert_eq!(
        keys(message_answers),
        ["202", "409", "429", "4XX"],
        "a message may be refused by a run quota"
    );
}

/// Reconciliation answers only a run that waits for that call; a finished run says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciling_a_run_that_is_not_in_doubt_is_a_conflict() {
    let server = Server::start(quick_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let run = server.send(TOKEN_A, &session, "hello").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    server.finish(&run).await;
    let path = format!("/v1/runs/{run}/reconcile");
    let post = |body: Value| {
        server
            .http
            .post(server.url(&path))
            .bearer_auth(TOKEN_A)
            .json(&body)
    };
    let answer = call(post(json!({"call_id": "call_0_0", "outcome": "succeeded"}))).await;
    assert_eq!(answer.status, StatusCode::CONFLICT, "{}", answer.body);
    assert_eq!(answer.body["error"]["code"], "conflict");
    let message = answer.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("not waiting for reconciliation"),
        "{message}"
    );
    let bad = call(post(json!({"call_id": "call_0_0", "outcome": "maybe"}))).await;
    assert_eq!(bad.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", bad.body);
    let other_tenant = server
        .http
        .post(server.url(&path))
        .bearer_auth(TOKEN_B)
        .json(&json!({"call_id": "call_0_0", "outcome": "skip"}));
    assert_eq!(call(other_tenant).await.status, StatusCode::NOT_FOUND);
}

// ---------------------------------------------------------------------------------------
// Tenants and tokens

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_sees_nothing_of_another_tenants_sessions_runs_and_events() {
    let server = Server::start(quick_script()).await;
    let a_session = server.create_session(TOKEN_A).await;
    let a_run = server.send(TOKEN_A, &a_session, "hello").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    server.finish(&a_run).await;
    let b_session = server.create_session(TOKEN_B).await;

    let reads = [
        format!("/v1/sessions/{a_session}"),
        format!("/v1/sessions/{a_session}/messages"),
        format!("/v1/sessions/{a_session}/runs"),
        format!("/v1/sessions/{a_session}/events"),
        format!("/v1/sessions/{a_session}/events?follow=false"),
        format!("/v1/runs/{a_run}"),
        format!("/v1/runs/{a_run}/steps"),
        format!("/v1/runs/{a_run}/steps/1"),
        format!("/v1/runs/{a_run}/tree"),
        format!("/v1/runs/{a_run}/events"),
    ];
    for path in &reads {
        // A sees it (a followed stream never ends: only its status is read); B gets the same
        // answer as for an id that does not exist.
        let response = timeout(DEADLINE, server.get(TOKEN_A, path).send())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{path}");
        drop(response);
        assert_error(
            path,
            &call(server.get(TOKEN_B, path)).await,
            StatusCode::NOT_FOUND,
            "not_found",
        );
    }
    let post_message = call(server.post(
        TOKEN_B,
        &format!("/v1/sessions/{a_session}/messages"),
        json!({"content": "intrude"}),
    ))
    .await;
    assert_error("B posts", &post_message, StatusCode::NOT_FOUND, "not_found");
    let cancel = call(
        server
            .http
            .post(server.url(&format!("/v1/runs/{a_run}/cancel")))
            .bearer_auth(TOKEN_B),
    )
    .await;
    assert_error("B cancels", &cancel, StatusCode::NOT_FOUND, "not_found");
    let stolen = call(server.http.get(server.url(&format!(
        "/v1/sessions/{a_session}/events?follow=false&access_token={TOKEN_B}"
    ))))
    .await;
    assert_error(
        "B's query token",
        &stolen,
        StatusCode::NOT_FOUND,
        "not_found",
    );

    let b_list = server.get_ok(TOKEN_B, "/v1/sessions").await;
    assert_eq!(ids(&b_list["items"]), [b_session.as_str()]);
    let a_list = server.get_ok(TOKEN_A, "/v1/sessions").await;
    assert_eq!(ids(&a_list["items"]), [a_session.as_str()]);
    // A's messages are untouched by B's attempt.
    let messages = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{a_session}/messages"))
        .await;
    assert_eq!(messages["items"].as_array().unwrap().len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_a_valid_token_are_refused_and_streams_take_a_query_token() {
    let server = Server::start(quick_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let unauthorized = StatusCode::UNAUTHORIZED;
    let missing = call(server.http.get(server.url("/v1/sessions"))).await;
    assert_error("no token", &missing, unauthorized, "unauthorized");
    let wrong = call(server.get("not-a-token", "/v1/sessions")).await;
    assert_error("wrong token", &wrong, unauthorized, "unauthorized");
    let scheme = call(
        server
            .http
            .get(server.url("/v1/sessions"))
            .header("authorization", format!("Basic {TOKEN_A}")),
    )
    .await;
    assert_error("not bearer", &scheme, unauthorized, "unauthorized");
    let post = call(
        server
            .http
            .post(server.url("/v1/sessions"))
            .json(&json!({})),
    )
    .await;
    assert_error("no token, POST", &post, unauthorized, "unauthorized");
    let events = format!("/v1/sessions/{session}/events?follow=false");
    let no_token = call(server.http.get(server.url(&events))).await;
    assert_error("stream, no token", &no_token, unauthorized, "unauthorized");
    let bad_query = call(
        server
            .http
            .get(server.url(&format!("{events}&access_token=nope"))),
    )
    .await;
    assert_error(
        "stream, wrong token",
        &bad_query,
        unauthorized,
        "unauthorized",
    );
    // Nothing was created by the refused requests.
    let listed = server.get_ok(TOKEN_A, "/v1/sessions").await;
    assert_eq!(ids(&listed["items"]), [session.as_str()]);

    let run = server.send(TOKEN_A, &session, "hello").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    server.finish(&run).await;
    let by_header = server.replay(&events, None).await;
    assert!(!by_header.is_empty());
    let response = server
        .http
        .get(server.url(&format!("{events}&access_token={TOKEN_A}")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let by_query = Sse::new(response).read_to_end().await;
    assert_eq!(by_query, by_header);
    // A token with URL-special characters, percent-encoded as a URL requires.
    let response = server
        .http
        .get(server.url(&format!("{events}&access_token=q0%2FLw%2BZk9a%3D%3D")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK, "{}", response.url());
    assert_eq!(Sse::new(response).read_to_end().await, by_header);
    // Only event streams take a token from the URL; elsewhere it would only end up in logs.
    let run_path = format!("/v1/runs/{run}?access_token={TOKEN_A}");
    let response = server.http.get(server.url(&run_path)).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
}

// ---------------------------------------------------------------------------------------
// Bad input

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_the_right_status_and_a_json_error() {
    let server = Server::start(quick_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let messages = format!("/v1/sessions/{session}/messages");
    let raw = |path: &str, body: &'static str| {
        server
            .http
            .post(server.url(path))
            .bearer_auth(TOKEN_A)
            .header(CONTENT_TYPE, "application/json")
            .body(body)
    };
    let (bad, unprocessable) = (StatusCode::BAD_REQUEST, StatusCode::UNPROCESSABLE_ENTITY);

    // Bodies.
    for (what, request, status, code) in [
        ("malformed", raw("/v1/sessions", "{"), bad, "bad_request"),
        (
            "malformed",
            raw(&messages, r#"{"content": "hi""#),
            bad,
            "bad_request",
        ),
        (
            "wrong type",
            raw(&messages, r#"{"content": 5}"#),
            unprocessable,
            "invalid_request",
        ),
        (
            "wrong type",
            raw("/v1/sessions", r#"{"metadata": [1]}"#),
            unprocessable,
            "invalid_request",
        ),
        (
            "bad enum",
            raw(&messages, r#"{"content": "x", "multitask": "maybe"}"#),
            unprocessable,
            "invalid_request",
        ),
        (
            "unknown field",
            raw(&messages, r#"{"content": "x", "colour": "red"}"#),
            unprocessable,
            "invalid_request",
        ),
        (
            "unknown field",
            raw("/v1/sessions", r#"{"name": "x"}"#),
            unprocessable,
            "invalid_request",
        ),
        (
            "missing field",
            raw(&messages, "{}"),
            unprocessable,
            "invalid_request",
        ),
        (
            "empty content",
            raw(&messages, r#"{"content": ""}"#),
            unprocessable,
            "invalid_request",
        ),
        (
            "blank content",
            raw(&messages, r#"{"content": " \n\t "}"#),
            unprocessable,
            "invalid_request",
        ),
        (
            "unknown agent",
            raw("/v1/sessions", r#"{"agent": "nobody"}"#),
            unprocessable,
            "invalid_request",
        ),
    ] {
        assert_error(what, &call(request).await, status, code);
    }
    for path in ["/v1/sessions", messages.as_str()] {
        let request = server
            .http
            .post(server.url(path))
            .bearer_auth(TOKEN_A)
            .body(r#"{"content": "hi"}"#);
        assert_error(
            "no content type",
            &call(request).await,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        );
    }
    let huge = json!({"content": "a".repeat(1 << 20)});
    assert_error(
        "oversized",
        &call(server.post(TOKEN_A, &messages, huge)).await,
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
    );

    // Ids.
    let missing_session = "ses_0000000000000000000000000000000";
    let missing_run = "run_0000000000000000000000000000000";
    let mut gets: Vec<(String, StatusCode)> = Vec::new();
    for bad_session in [
        "nope",
        "ses_",
        "ses_a.b",
        "run_abc",
        format!("ses_{}", "a".repeat(65)).as_str(),
    ] {
        for suffix in ["", "/messages", "/runs", "/events"] {
            gets.push((format!("/v1/sessions/{bad_session}{suffix}"), bad));
        }
    }
    for bad_run in ["nope", "run_", "ses_abc"] {
        for suffix in ["", "/steps", "/tree", "/events"] {
            gets.push((format!("/v1/runs/{bad_run}{suffix}"), bad));
        }
    }
    for suffix in ["", "/messages", "/runs", "/events"] {
        gets.push((
            format!("/v1/sessions/{missing_session}{suffix}"),
            StatusCode::NOT_FOUND,
        ));
    }
    for suffix in ["", "/steps", "/tree", "/events"] {
        gets.push((
            format!("/v1/runs/{missing_run}{suffix}"),
            StatusCode::NOT_FOUND,
        ));
    }
    // Query strings: limits, cursors, stream positions, unknown parameters.
    for list in [
        "/v1/sessions".to_owned(),
        messages.clone(),
        format!("/v1/sessions/{session}/runs"),
    ] {
        for query in [
            "limit=0",
            "limit=201",
            "limit=-1",
            "limit=abc",
            "colour=red",
        ] {
            gets.push((format!("{list}?{query}"), bad));
        }
        gets.push((format!("{list}?limit=200"), StatusCode::OK));
    }
    for query in [
        "cursor=garbage",
        "cursor=ses_a.b",
        "order=sideways",
        "order=",
    ] {
        gets.push((format!("/v1/sessions?{query}"), bad));
    }
    gets.push((format!("{messages}?cursor=abc"), bad));
    gets.push((format!("/v1/sessions/{session}/runs?cursor=nope"), bad));
    let events = format!("/v1/sessions/{session}/events");
    for query in [
        "after=-1",
        "after=abc",
        "after=1.5",
        "follow=maybe",
        "colour=red",
    ] {
        gets.push((format!("{events}?{query}"), bad));
    }
    gets.push(("/v1/nope".to_owned(), StatusCode::NOT_FOUND));
    gets.push(("/nope".to_owned(), StatusCode::NOT_FOUND));
    gets.push(("/v1/sessions/a/b/c".to_owned(), StatusCode::NOT_FOUND));
    for (path, status) in gets {
        let reply = call(server.get(TOKEN_A, &path)).await;
        if status == StatusCode::OK {
            assert_eq!(reply.status, status, "{path}: {}", reply.body);
        } else {
            let code = if status == bad {
                "bad_request"
            } else {
                "not_found"
            };
            assert_error(&path, &reply, status, code);
        }
    }
    for (id, status, code) in [
        ("nope", bad, "bad_request"),
        (missing_run, StatusCode::NOT_FOUND, "not_found"),
    ] {
        let cancel = server
            .http
            .post(server.url(&format!("/v1/runs/{id}/cancel")))
            .bearer_auth(TOKEN_A);
        assert_error("cancel", &call(cancel).await, status, code);
    }
    let post_missing = call(server.post(
        TOKEN_A,
        &format!("/v1/sessions/{missing_session}/messages"),
        json!({"content": "hi"}),
    ))
    .await;
    assert_error("post", &post_missing, StatusCode::NOT_FOUND, "not_found");
    // Run steps' cursor and stream positions need a run.
    let run = server.send(TOKEN_A, &session, "hello").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    server.finish(&run).await;
    for query in ["cursor=-1", "cursor=x", "limit=0", "limit=201"] {
        let path = format!("/v1/runs/{run}/steps?{query}");
        assert_error(
            &path,
            &call(server.get(TOKEN_A, &path)).await,
            bad,
            "bad_request",
        );
    }
    for path in [events.clone(), format!("/v1/runs/{run}/events")] {
        for header in ["-1", "abc", "", "1.5"] {
            let request = server.get(TOKEN_A, &path).header("last-event-id", header);
            assert_error(
                &format!("{path} Last-Event-ID {header:?}"),
                &call(request).await,
                bad,
                "bad_request",
            );
        }
        let path = format!("{path}?after=-3");
        assert_error(
            &path,
            &call(server.get(TOKEN_A, &path)).await,
            bad,
            "bad_request",
        );
    }
    // Only the one good message was recorded.
    let recorded = server.get_ok(TOKEN_A, &messages).await;
    let users: Vec<&str> = recorded["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "user")
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(users, ["hello"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_method_gets_a_json_error() {
    let server = Server::start(quick_script()).await;
    let reply = call(
        server
            .http
            .delete(server.url("/v1/sessions"))
            .bearer_auth(TOKEN_A),
    )
    .await;
    assert_error(
        "DELETE /v1/sessions",
        &reply,
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
    );
}

// ---------------------------------------------------------------------------------------
// Event streams

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnecting_client_gets_exactly_the_events_it_missed() {
    // 25 words 40 ms apart: the run streams for about 1 s, its deltas flushed every ~100 ms.
    let server = Server::start(slow_script(25, 40)).await;
    let session = server.create_session(TOKEN_A).await;
    let path = format!("/v1/sessions/{session}/events");
    let mut first = server.stream(&path, None).await;
    server.send(TOKEN_A, &session, "talk slowly").await;
    let mut deltas = 0;
    let seen = first
        .until(|e| {
            deltas += usize::from(e.kind == "assistant.delta");
            deltas == 3
        })
        .await;
    drop(first);
    let last = seen.last().unwrap().seq;
    assert_eq!(seqs(&seen), (1..=last).collect::<Vec<_>>());
    assert!(
        !kinds(&seen).contains(&"run.finished"),
        "disconnected mid-run"
    );

    // The run goes on without the client; wait until it has produced events it missed.
    let deadline = Instant::now() + DEADLINE;
    loop {
        let missed = server
            .replay(&format!("{path}?after={last}&follow=false"), None)
            .await;
        if !missed.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "the run stalled");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let mut second = server.stream(&path, Some(&last.to_string())).await;
    let mut resumed = second.until(|e| e.kind == "run.finished").await;
    let full = server.replay(&format!("{path}?follow=false"), None).await;
    let total = full.last().unwrap().seq;
    if resumed.last().unwrap().seq < total {
        resumed.extend(second.until(|e| e.seq == total).await);
    }
    assert_eq!(seqs(&full), (1..=total).collect::<Vec<_>>(), "dense seqs");
    assert_eq!(
        resumed[0].seq,
        last + 1,
        "resumed right after the last seen"
    );
    assert!(
        kinds(&resumed).contains(&"assistant.delta"),
        "missed deltas"
    );
    let union: Vec<Ev> = seen.into_iter().chain(resumed).collect();
    assert_eq!(union, full, "no gap, no duplicate, same events");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_from_any_seq_is_the_suffix_of_the_full_stream() {
    let server = Server::start(quick_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let run = server.send(TOKEN_A, &session, "hello").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    server.finish(&run).await;
    let path = format!("/v1/sessions/{session}/events");
    let full = server.replay(&format!("{path}?follow=false"), None).await;
    let n = full.len();
    assert!(n >= 10, "a run of three steps has many events: {n}");
    assert_eq!(seqs(&full), (1..=n as i64).collect::<Vec<_>>());
    assert_eq!(full[0].kind, "run.created");
    assert_eq!(full[n - 1].kind, "run.finished");
    for k in 0..=n + 2 {
        let suffix = &full[k.min(n)..];
        let by_query = server
            .replay(&format!("{path}?after={k}&follow=false"), None)
            .await;
        assert_eq!(by_query, suffix, "after={k}");
        let by_header = server
            .replay(&format!("{path}?follow=false"), Some(&k.to_string()))
            .await;
        assert_eq!(by_header, suffix, "Last-Event-ID: {k}");
    }
    // The header wins over the query parameter.
    let both = server
        .replay(&format!("{path}?after=7&follow=false"), Some("3"))
        .await;
    assert_eq!(both, full[3..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_subscribers_see_the_same_ordered_stream() {
    // About half a second of streaming, while subscribers come and go.
    let server = Server::start(slow_script(20, 25)).await;
    let session = server.create_session(TOKEN_A).await;
    let path = format!("/v1/sessions/{session}/events");
    // Half subscribe before the run starts, half while it runs.
    let mut streams = Vec::new();
    for _ in 0..25 {
        streams.push(server.stream(&path, None).await);
    }
    server.send(TOKEN_A, &session, "hello everyone").await;
    let late = futures::future::join_all((0..25).map(|_| server.stream(&path, None))).await;
    streams.extend(late);
    let readers: Vec<_> = streams
        .into_iter()
        .map(|mut stream| {
            tokio::spawn(async move { stream.until(|e| e.kind == "run.finished").await })
        })
        .collect();
    let mut seen = Vec::new();
    for reader in readers {
        seen.push(reader.await.unwrap());
    }
    let full = server.replay(&format!("{path}?follow=false"), None).await;
    assert_eq!(seqs(&full), (1..=full.len() as i64).collect::<Vec<_>>());
    assert!(
        kinds(&full)
            .iter()
            .filter(|k| **k == "assistant.delta")
            .count()
            >= 2
    );
    for (i, events) in seen.iter().enumerate() {
        assert_eq!(events, &full[..events.len()], "subscriber {i}");
        assert_eq!(events.len(), seen[0].len(), "subscriber {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_stream_carries_only_that_runs_events() {
    let server = Server::start(quick_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let first = server.send(TOKEN_A, &session, "one").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let second = server.send(TOKEN_A, &session, "two").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    // Followed live from the start, until the run's own end.
    let mut live_second = server
        .stream(&format!("/v1/runs/{second}/events"), None)
        .await;
    let live = live_second.until(|e| e.kind == "run.finished").await;
    server.finish(&first).await;
    server.finish(&second).await;

    let full = server
        .replay(&format!("/v1/sessions/{session}/events?follow=false"), None)
        .await;
    assert_eq!(seqs(&full), (1..=full.len() as i64).collect::<Vec<_>>());
    let mut covered = BTreeSet::new();
    for run in [&first, &second] {
        let own: Vec<Ev> = full
            .iter()
            .filter(|e| e.run_id.as_deref() == Some(run.as_str()))
            .cloned()
            .collect();
        assert!(kinds(&own).contains(&"run.finished"), "{run}");
        let replayed = server
            .replay(&format!("/v1/runs/{run}/events?follow=false"), None)
            .await;
        assert_eq!(replayed, own, "{run}");
        // Resuming a run stream counts in session seqs.
        let middle = own[own.len() / 2].seq;
        let resumed = server
            .replay(
                &format!("/v1/runs/{run}/events?follow=false"),
                Some(&middle.to_string()),
            )
            .await;
        let after_middle: Vec<Ev> = own.iter().filter(|e| e.seq > middle).cloned().collect();
        assert_eq!(resumed, after_middle, "{run} after {middle}");
        covered.extend(seqs(&own));
    }
    assert_eq!(covered.len(), full.len(), "every event belongs to one run");
    let second_own: Vec<Ev> = full
        .iter()
        .filter(|e| e.run_id.as_deref() == Some(second.as_str()))
        .cloned()
        .collect();
    assert_eq!(live, second_own[..live.len()]);
    assert_eq!(live.last().unwrap().kind, "run.finished");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follow_false_ends_after_the_backlog_while_a_run_is_still_active() {
    let server = Server::start(sleepy_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let run = server.send(TOKEN_A, &session, "sleep").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut live = server.stream(&format!("/v1/runs/{run}/events"), None).await;
    let so_far = live.until_running("sleep_ms").await;

    let backlog = server
        .replay(&format!("/v1/sessions/{session}/events?follow=false"), None)
        .await;
    assert_eq!(
        seqs(&backlog),
        (1..=backlog.len() as i64).collect::<Vec<_>>()
    );
    assert_eq!(backlog[..so_far.len()], so_far);
    assert!(!kinds(&backlog).contains(&"run.finished"), "still running");
    let run_backlog = server
        .replay(&format!("/v1/runs/{run}/events?follow=false"), None)
        .await;
    assert_eq!(run_backlog, backlog);
    // A followed stream, by contrast, stays open while the run sleeps.
    let mut followed = server
        .stream(&format!("/v1/sessions/{session}/events"), None)
        .await;
    for expected in &backlog {
        let next = timeout(DEADLINE, followed.next()).await.unwrap();
        assert_eq!(next.as_ref(), Some(expected));
    }
    assert!(
        timeout(Duration::from_millis(200), followed.next())
            .await
            .is_err(),
        "a followed stream does not end after the backlog"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_longer_than_one_store_page_is_replayed_whole() {
    // The stream reads the store 500 events at a time; 40 queued runs make more than that.
    let server = Server::start(quick_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let path = format!("/v1/sessions/{session}/events");
    let mut live = server.stream(&path, None).await;
    let mut runs = Vec::new();
    for i in 0..40 {
        let accepted = server.send(TOKEN_A, &session, &format!("turn {i}")).await;
        runs.push(accepted["run_id"].as_str().unwrap().to_owned());
    }
    let last_run = runs.last().unwrap().clone();
    let followed = live
        .until(|e| e.kind == "run.finished" && e.run_id.as_deref() == Some(&last_run))
        .await;
    let full = server.replay(&format!("{path}?follow=false"), None).await;
    let n = full.len();
    assert!(n > 500, "more than one page: {n}");
    assert_eq!(seqs(&full), (1..=n as i64).collect::<Vec<_>>());
    assert_eq!(followed, full, "the live follower saw the same");
    let finished = full.iter().filter(|e| e.kind == "run.finished").count();
    assert_eq!(finished, 40);
    for k in [1, 499, 500, 501, n - 1, n] {
        let suffix = server
            .replay(&format!("{path}?after={k}&follow=false"), None)
            .await;
        assert_eq!(suffix, full[k..], "after={k}");
    }
}
