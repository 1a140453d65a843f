//! Schedules over HTTP: a definition checked with a clear 422 for every bad field, kept per
//! tenant, and fired by the server's own scheduler — each slot once, its run naming the
//! schedule and slot — with pause, resume, trigger and the list of decided slots.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::common::*;

fn every_second(session: &str) -> Value {
    json!({
        "message": "what time is it?",
        "every_ms": 1000,
        "session": session,
        "overlap": "enqueue",
        "catch_up": "all",
    })
}

async fn create(server: &Server, token: &str, body: Value) -> Value {
    let reply = call(server.post(token, "/v1/schedules", body)).await;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
    reply.body
}

/// The decided slots of a schedule, newest first, every page.
async fn slots(server: &Server, id: &str) -> Vec<Value> {
    all_pages(server, &format!("/v1/schedules/{id}/runs"), 200)
        .await
        .concat()
}

/// Waits until `enough` holds of the schedule's decided slots, and returns them.
async fn slots_until(server: &Server, id: &str, enough: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let slots = slots(server, id).await;
        if enough(&slots) {
            return slots;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the schedule's slots never got there: {slots:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_is_kept_per_tenant_changed_and_deleted() {
    let server = Server::start(quick_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let body = json!({
        "message": "the weekly digest",
        "cron": "0 9 * * MON",
        "timezone": "Europe/Paris",
        "session": session,
        "overlap": "skip",
        "catch_up": "one",
        "paused": true,
    });
    let created = create(&server, TOKEN_A, body).await;
    let id = created["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("sch_"), "{created}");
    assert_eq!(
        keys(&created),
        [
            "agent",
            "catch_up",
            "created_at",
            "cron",
            "every_ms",
            "id",
            "last_run_id",
            "last_slot",
            "message",
            "next_fire_at",
            "overlap",
            "paused",
            "session",
            "timezone",
            "updated_at"
        ]
    );
    assert_eq!(
        (
            &created["session"],
            &created["paused"],
            &created["next_fire_at"]
        ),
        (&json!(session), &json!(true), &Value::Null),
        "a paused schedule has no next fire"
    );
    assert_eq!(
        server.get_ok(TOKEN_A, &format!("/v1/schedules/{id}")).await,
        created
    );
    let listed = server.get_ok(TOKEN_A, "/v1/schedules").await;
    assert_eq!(ids(&listed["items"]), std::slice::from_ref(&id));
    let others = server.get_ok(TOKEN_B, "/v1/schedules").await;
    assert_eq!(
        others["items"],
        json!([]),
        "another tenant's are not listed"
    );
    for (method, path) in [
        ("get", format!("/v1/schedules/{id}")),
        ("get", format!("/v1/schedules/{id}/runs")),
        ("post", format!("/v1/schedules/{id}/trigger")),
        ("post", format!("/v1/schedules/{id}/pause")),
        ("delete", format!("/v1/schedules/{id}")),
    ] {
        let request = match method {
            "get" => server.get(TOKEN_B, &path),
            "delete" => server.http.delete(server.url(&path)).bearer_auth(TOKEN_B),
            _ => server.post(TOKEN_B, &path, json!({})),
        };
        assert_error(
            &format!("{method} {path} of another tenant"),
            &call(request).await,
            StatusCode::NOT_FOUND,
            "not_found",
        );
    }

    let resumed =
        call(server.post(TOKEN_A, &format!("/v1/schedules/{id}/resume"), json!({}))).await;
    assert_eq!(resumed.status, StatusCode::OK, "{}", resumed.body);
    let next = resumed.body["next_fire_at"]
        .as_i64()
        .expect("due once resumed");
    assert!(next > resumed.body["updated_at"].as_i64().unwrap());

    let changed = call(server.patch(
        TOKEN_A,
        &format!("/v1/schedules/{id}"),
        json!({"every_ms": 3_600_000, "message": "hourly now", "overlap": "cancel_previous"}),
    ))
    .await;
    assert_eq!(changed.status, StatusCode::OK, "{}", changed.body);
    assert_eq!(
        (
            &changed.body["cron"],
            &changed.body["timezone"],
            &changed.body["every_ms"],
            &changed.body["message"],
            &changed.body["overlap"],
        ),
        (
            &Value::Null,
            &Value::Null,
            &json!(3_600_000),
            &json!("hourly now"),
            &json!("cancel_previous")
        )
    );
    assert_eq!(
        changed.body["next_fire_at"].as_i64().unwrap() % 3_600_000,
        0
    );

    let deleted = server
        .http
        .delete(server.url(&format!("/v1/schedules/{id}")))
        .bearer_auth(TOKEN_A)
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), StatusCode::NO_CONTENT);
    assert_error(
        "a deleted schedule",
        &call(server.get(TOKEN_A, &format!("/v1/schedules/{id}"))).await,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    assert_error(
        "a malformed id",
        &call(server.get(TOKEN_A, "/v1/schedules/nope")).await,
        StatusCode::BAD_REQUEST,
        "bad_request",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_schedule_is_refused_saying_what_is_expected() {
    let server = Server::start(quick_script()).await;
    let others = server.create_session(TOKEN_B).await;
    let with = |change: Value| {
        let mut body = every_second("new");
        for (key, value) in change.as_object().unwrap() {
            if value.is_null() {
                body.as_object_mut().unwrap().remove(key);
            } else {
                body[key] = value.clone();
            }
        }
        body
    };
    let cases = [
        (
            json!({"cron": "* * * * *"}),
            "exactly one of cron and every_ms; found both",
        ),
        (json!({"every_ms": null}), "found neither"),
        (json!({"every_ms": 999}), "every_ms must be at least 1000"),
        (json!({"every_ms": null, "cron": "* * * *"}), "5 fields"),
        (
            json!({"every_ms": null, "cron": "* * * * * * *"}),
            "found 7",
        ),
        (
            json!({"every_ms": null, "cron": "99 * * * *"}),
            "not a valid expression",
        ),
        (
            json!({"every_ms": null, "cron": "0 0 30 2 *"}),
            "never fire",
        ),
        (
            json!({"every_ms": null, "cron": "* * * * *", "timezone": "Mars/Base"}),
            "IANA time zone",
        ),
        (
            json!({"timezone": "UTC"}),
            "timezone applies to a cron expression only",
        ),
        (json!({"message": "   "}), "message must be 1 to"),
        (
            json!({"session": "yesterday"}),
            "session must be \"new\" or a session id",
        ),
        (json!({"session": others}), "names no session of yours"),
        (json!({"agent": "nobody"}), "unknown agent \"nobody\""),
    ];
    for (change, expected) in cases {
        let reply = call(server.post(TOKEN_A, "/v1/schedules", with(change.clone()))).await;
        assert_error(
            &format!("{change}"),
            &reply,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        );
        let message = reply.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(expected), "{change}: {message}");
    }
    for change in [
        json!({"overlap": "sometimes"}),
        json!({"catch_up": 3}),
        json!({"sessions": "new"}),
        json!({"overlap": null}),
    ] {
        let reply = call(server.post(TOKEN_A, "/v1/schedules", with(change.clone()))).await;
        assert!(
            reply.status.is_client_error() && reply.body["error"]["message"].is_string(),
            "{change}: {} {}",
            reply.status,
            reply.body
        );
    }
    assert_eq!(
        server.get_ok(TOKEN_A, "/v1/schedules").await["items"],
        json!([]),
        "nothing was created"
    );
}

/// The server's scheduler fires an every-second schedule slot after slot, each run in a new
/// session of the tenant naming its schedule and slot; a trigger adds a manual slot; a pause
/// stops it at once and nothing is decided after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_fires_each_slot_once_until_paused() {
    let server = Server::start(quick_script()).await;
    let created = create(&server, TOKEN_A, every_second("new")).await;
    let id = created["id"].as_str().unwrap().to_owned();
    let fired = |slots: &[Value]| {
        slots
            .iter()
            .filter(|s| s["outcome"] == "fired" && s["manual"] == false)
            .count()
    };
    let seen = slots_until(&server, &id, |slots| fired(slots) >= 3).await;
    let mut times: Vec<i64> = seen.iter().map(|s| s["slot"].as_i64().unwrap()).collect();
    assert!(
        times.windows(2).all(|w| w[0] > w[1]),
        "newest first: {times:?}"
    );
    times.sort();
    assert!(
        times.windows(2).all(|w| w[1] - w[0] == 1000),
        "consecutive whole seconds, none twice, none lost: {times:?}"
    );
    for slot in seen.iter().filter(|s| s["outcome"] == "fired") {
        let run_id = slot["run_id"].as_str().unwrap();
        let run = server.get_ok(TOKEN_A, &format!("/v1/runs/{run_id}")).await;
        assert_eq!(
            run["schedule"],
            json!({"schedule_id": id, "slot": slot["slot"], "manual": false})
        );
        assert_eq!(run["session_id"], slot["session_id"]);
        let session = slot["session_id"].as_str().unwrap();
        let runs = server
            .get_ok(TOKEN_A, &format!("/v1/sessions/{session}/runs"))
            .await;
        assert_eq!(
            (&runs["items"][0]["schedule_id"], &runs["items"][0]["slot"]),
            (&json!(id), &slot["slot"])
        );
    }

    let trigger =
        call(server.post(TOKEN_A, &format!("/v1/schedules/{id}/trigger"), json!({}))).await;
    assert_eq!(trigger.status, StatusCode::ACCEPTED, "{}", trigger.body);
    assert_eq!(
        (&trigger.body["manual"], &trigger.body["outcome"]),
        (&json!(true), &json!("fired"))
    );
    let manual_run = trigger.body["run_id"].as_str().unwrap();
    let run = server
        .get_ok(TOKEN_A, &format!("/v1/runs/{manual_run}"))
        .await;
    assert_eq!(run["schedule"]["manual"], true);

    let paused = call(server.post(TOKEN_A, &format!("/v1/schedules/{id}/pause"), json!({}))).await;
    assert_eq!(paused.status, StatusCode::OK, "{}", paused.body);
    assert_eq!(paused.body["next_fire_at"], Value::Null);
    let paused_at = paused.body["updated_at"].as_i64().unwrap();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let after = slots(&server, &id).await;
    let later: Vec<&Value> = after
        .iter()
        .filter(|s| s["decided_at"].as_i64().unwrap() > paused_at)
        .collect();
    assert!(later.is_empty(), "decided after the pause: {later:#?}");
    let page = server
        .get_ok(TOKEN_A, &format!("/v1/schedules/{id}/runs?limit=2"))
        .await;
    let cursor = page["next_cursor"].as_str().unwrap().to_owned();
    let next = server
        .get_ok(
            TOKEN_A,
            &format!("/v1/schedules/{id}/runs?limit=200&cursor={cursor}"),
        )
        .await;
    assert_eq!(next["items"].as_array().unwrap().len(), after.len() - 2);
}
