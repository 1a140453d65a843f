//! `Idempotency-Key` across real processes on SQLite and PostgreSQL: two `ratchet serve`s
//! sent the same keyed messages at once start one run per key, a restart after `kill -9`
//! answers every key again without a run more, and a process that dies in a keyed message's
//! transaction or right after its commit leaves a key the next process answers exactly once.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{DEADLINE, Database, SECRETS_KEY, free_port, postgres, sqlite};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_ratchet");
/// A keyed request holds its key this long: what a repeat waits for after its holder died.
const HOLD_MS: u64 = 1500;

struct Server {
    child: Child,
    base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// `ratchet serve` on `db` with the built-in demo model; `failpoints` set in its
    /// environment when given.
    fn start(dir: &std::path::Path, db: &str, failpoints: Option<&str>) -> Server {
        let config = dir.join("ratchet.toml");
        let settings = format!("[api]\nidempotency_hold_ms = {HOLD_MS}\n");
        std::fs::write(&config, settings).unwrap();
        let port = free_port();
        let mut command = Command::new(BIN);
        command
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--db",
                db,
            ])
            .arg("--config")
            .arg(&config)
            .arg("--workspace")
            .arg(dir)
            .env_remove("FAILPOINTS")
            .env("RATCHET_SECRETS_KEY", SECRETS_KEY)
            .stderr(Stdio::null());
        if let Some(failpoints) = failpoints {
            command.env("FAILPOINTS", failpoints);
        }
        let child = command.spawn().unwrap();
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(started.elapsed() < DEADLINE, "ratchet serve did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        Server {
            child,
            base: format!("http://127.0.0.1:{port}"),
        }
    }

    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

/// A keyed POST's answer: status, whether it was replayed, body.
async fn post(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    body: &Value,
) -> reqwest::Result<(u16, bool, Value)> {
    let response = http
        .post(url)
        .header("idempotency-key", key)
        .json(body)
        .send()
        .await?;
    let status = response.status().as_u16();
    let replayed = response.headers().contains_key("idempotent-replayed");
    Ok((status, replayed, response.json().await?))
}

/// Sends a keyed request until it is no longer in progress (its dead holder's hold passes).
async fn settled(http: &reqwest::Client, url: &str, key: &str, body: &Value) -> (u16, bool, Value) {
    let started = Instant::now();
    loop {
        let answer = post(http, url, key, body).await.unwrap();
        if answer.0 != 409 {
            return answer;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "still in progress: {answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn session_runs(http: &reqwest::Client, base: &str, session: &str) -> Vec<String> {
    let url = format!("{base}/v1/sessions/{session}/runs?limit=100");
    let page: Value = http.get(url).send().await.unwrap().json().await.unwrap();
    let items = page["items"].as_array().unwrap();
    items
        .iter()
        .map(|run| run["id"].as_str().unwrap().to_owned())
        .collect()
}

async fn new_session(http: &reqwest::Client, base: &str) -> String {
    let url = format!("{base}/v1/sessions");
    let created: Value = (http.post(url).json(&json!({})).send().await.unwrap())
        .json()
        .await
        .unwrap();
    created["id"].as_str().unwrap().to_owned()
}

async fn two_processes_and_a_restart(database: Database) {
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let (one, two) = (
        Server::start(dir.path(), &database.url, None),
        Server::start(dir.path(), &database.url, None),
    );
    let session = new_session(&http, &one.base).await;
    let path = format!("/v1/sessions/{session}/messages");
    let keys: Vec<String> = (0..12).map(|i| format!("message-{i}")).collect();
    let urls = (format!("{}{path}", one.base), format!("{}{path}", two.base));
    let mut first_answers = Vec::new();
    for key in &keys {
        let body = json!({"content": format!("hello {key}")});
        let (a, b) = tokio::join!(
            post(&http, &urls.0, key, &body),
            post(&http, &urls.1, key, &body),
        );
        let answers = [a.unwrap(), b.unwrap()];
        let accepted: Vec<_> = answers.iter().filter(|answer| answer.0 == 202).collect();
        assert!(
            !accepted.is_empty() && answers.iter().all(|a| a.0 == 202 || a.0 == 409),
            "{key}: one process carries it out, the other replays it or finds it in progress: \
             {answers:?}"
        );
        if let [x, y] = accepted[..] {
            assert_eq!(x.2, y.2, "{key}: both answers are the one response");
            assert!(x.1 != y.1, "{key}: exactly one of them was replayed");
        }
        first_answers.push(accepted[0].2.clone());
    }
    let runs = session_runs(&http, &one.base, &session).await;
    let mut answered: Vec<String> = (first_answers.iter())
        .map(|answer| answer["run_id"].as_str().unwrap().to_owned())
        .collect();
    answered.sort();
    let mut listed = runs.clone();
    listed.sort();
    assert_eq!(
        listed, answered,
        "one run per key, and it is the one answered"
    );

    one.kill();
    two.kill();
    let three = Server::start(dir.path(), &database.url, None);
    for (key, first) in keys.iter().zip(&first_answers) {
        let body = json!({"content": format!("hello {key}")});
        let again = settled(&http, &format!("{}{path}", three.base), key, &body).await;
        assert_eq!(
            (again.0, again.1, &again.2),
            (202, true, first),
            "{key} after the restart"
        );
    }
    assert_eq!(
        session_runs(&http, &three.base, &session).await.len(),
        keys.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_messages_start_one_run_each_across_two_processes_and_a_restart_on_sqlite() {
    two_processes_and_a_restart(sqlite().unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_messages_start_one_run_each_across_two_processes_and_a_restart_on_postgres() {
    let Some(database) = postgres() else {
        eprintln!("skipped: RATCHET_TEST_POSTGRES_URL is not set");
        return;
    };
    two_processes_and_a_restart(database).await;
}

/// The process carrying a keyed message out aborts at `failpoint`; the next process answers
/// the repeat — from the committed effect (`replayed`) or by carrying the message out — and
/// the session has exactly one run.
#[cfg(feature = "failpoints")]
async fn a_death_at(database: &Database, failpoint: &str, replayed: bool) {
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let dying = Server::start(
        dir.path(),
        &database.url,
        Some(&format!("{failpoint}=return")),
    );
    let session = new_session(&http, &dying.base).await;
    let path = format!("/v1/sessions/{session}/messages");
    let body = json!({"content": "exactly once"});
    let key = format!("key-of-{failpoint}");
    let lost = post(&http, &format!("{}{path}", dying.base), &key, &body).await;
    assert!(
        lost.is_err(),
        "{failpoint}: the process died answering: {lost:?}"
    );
    let mut dying = dying;
    let exit = dying.child.wait().unwrap();
    assert!(!exit.success(), "{failpoint}: the process aborted");

    let next = Server::start(dir.path(), &database.url, None);
    let (status, was_replayed, answer) =
        settled(&http, &format!("{}{path}", next.base), &key, &body).await;
    assert_eq!(
        (status, was_replayed),
        (202, replayed),
        "{failpoint}: {answer}"
    );
    let runs = session_runs(&http, &next.base, &session).await;
    assert_eq!(runs, [answer["run_id"].as_str().unwrap()], "{failpoint}");
    let again = post(&http, &format!("{}{path}", next.base), &key, &body)
        .await
        .unwrap();
    assert_eq!((again.0, again.1, &again.2), (202, true, &answer));
}

#[cfg(feature = "failpoints")]
async fn deaths_around_a_keyed_message(database: Database) {
    a_death_at(&database, "request.before_commit", false).await;
    a_death_at(&database, "request.before_response", true).await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_message_whose_process_died_is_carried_out_once_on_sqlite() {
    deaths_around_a_keyed_message(sqlite().unwrap()).await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_message_whose_process_died_is_carried_out_once_on_postgres() {
    let Some(database) = postgres() else {
        eprintln!("skipped: RATCHET_TEST_POSTGRES_URL is not set");
        return;
    };
    deaths_around_a_keyed_message(database).await;
}

/// Sends `body` to `path` keyed, through a server that aborts right after the request's
/// commit (before its answer is kept); then again through the next server, which answers
/// from the committed effect. Returns the answer.
#[cfg(feature = "failpoints")]
async fn keyed_across_a_death(
    dir: &std::path::Path,
    database: &Database,
    path: &str,
    key: &str,
    body: &Value,
) -> (u16, Value, Server) {
    let http = reqwest::Client::new();
    let dying = Server::start(dir, &database.url, Some("request.before_response=return"));
    let lost = post(&http, &format!("{}{path}", dying.base), key, body).await;
    assert!(
        lost.is_err(),
        "{path}: the process died answering: {lost:?}"
    );
    let mut dying = dying;
    assert!(!dying.child.wait().unwrap().success(), "{path}: it aborted");
    let next = Server::start(dir, &database.url, None);
    let (status, replayed, answer) =
        settled(&http, &format!("{}{path}", next.base), key, body).await;
    assert!(
        replayed,
        "{path}: answered from the recorded effect: {answer}"
    );
    (status, answer, next)
}

/// The ids of a list's `items`.
#[cfg(feature = "failpoints")]
async fn listed_ids(http: &reqwest::Client, url: &str) -> Vec<String> {
    let listed: Value = http.get(url).send().await.unwrap().json().await.unwrap();
    (listed["items"].as_array().unwrap().iter())
        .map(|item| item["id"].as_str().unwrap().to_owned())
        .collect()
}

/// A keyed schedule creation and a keyed trigger whose process died between their commit and
/// their answer are carried out once: one schedule, one manual slot.
#[cfg(feature = "failpoints")]
async fn keyed_schedules_across_deaths(database: Database) {
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let body = json!({"message": "tick", "every_ms": 3_600_000, "session": "new",
        "overlap": "enqueue", "catch_up": "skip", "paused": true});
    let (status, created, server) =
        keyed_across_a_death(dir.path(), &database, "/v1/schedules", "create-1", &body).await;
    assert_eq!(status, 201, "{created}");
    let ids = listed_ids(&http, &format!("{}/v1/schedules", server.base)).await;
    assert_eq!(ids, [created["id"].as_str().unwrap()], "one schedule");
    server.kill();

    let schedule = created["id"].as_str().unwrap();
    let trigger = format!("/v1/schedules/{schedule}/trigger");
    let (status, fired, server) =
        keyed_across_a_death(dir.path(), &database, &trigger, "trigger-1", &json!({})).await;
    assert_eq!(status, 202, "{fired}");
    let slots: Value = (http.get(format!("{}/v1/schedules/{schedule}/runs", server.base)))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let slots = slots["items"].as_array().unwrap();
    assert_eq!(slots.len(), 1, "one manual slot: {slots:?}");
    assert_eq!(slots[0]["run_id"], fired["run_id"], "{slots:?}");
    assert_eq!(slots[0]["manual"], true);
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_schedule_and_trigger_whose_process_died_are_carried_out_once_on_sqlite() {
    keyed_schedules_across_deaths(sqlite().unwrap()).await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_schedule_and_trigger_whose_process_died_are_carried_out_once_on_postgres() {
    let Some(database) = postgres() else {
        eprintln!("skipped: RATCHET_TEST_POSTGRES_URL is not set");
        return;
    };
    keyed_schedules_across_deaths(database).await;
}

/// A keyed continue, a keyed webhook and a keyed rotation of its secret whose process died
/// between their commit and their answer are carried out once: the run's budget is extended
/// once (a repeat does not continue it again when it has failed again), one webhook exists,
/// and the repeats say that the secret is not shown again.
#[cfg(feature = "failpoints")]
async fn keyed_continue_and_webhooks_across_deaths(database: Database) {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("script.json");
    let replies = json!({"replies": [
        {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 1}}]},
        {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 1}}]},
        {"text": "done"},
    ]});
    std::fs::write(&script, replies.to_string()).unwrap();
    let ran = crate::common::output_within_deadline(
        Command::new(BIN)
            .args(["run", "--json", "--db", &database.url, "--max-steps", "1"])
            .arg("--model")
            .arg(format!("scripted:{}", script.display()))
            .arg("--workspace")
            .arg(dir.path())
            .arg("spend the budget"),
        "",
    );
    let ran: Value = serde_json::from_slice(&ran.stdout).unwrap();
    assert_eq!(ran["stop_reason"], "budget_exhausted", "{ran}");
    let run = ratchet_core::RunId::parse(ran["run_id"].as_str().unwrap()).unwrap();
    let path = format!("/v1/runs/{run}/continue");
    let (status, continued, server) = keyed_across_a_death(
        dir.path(),
        &database,
        &path,
        "continue-1",
        &json!({"extra_steps": 1}),
    )
    .await;
    assert_eq!(status, 200, "{continued}");
    assert_eq!(continued["status"], "running");
    let state = crate::common::open_store(&database.url)
        .load_state(&run)
        .await
        .unwrap();
    assert_eq!(state.extension.steps, 1, "continued once");
    server.kill();

    let http = reqwest::Client::new();
    let body = json!({"url": "http://127.0.0.1:9/hook"});
    let (status, created, server) =
        keyed_across_a_death(dir.path(), &database, "/v1/webhooks", "webhook-1", &body).await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["secret_withheld"], true, "{created}");
    assert!(created.get("secret").is_none(), "{created}");
    let ids = listed_ids(&http, &format!("{}/v1/webhooks", server.base)).await;
    assert_eq!(ids, [created["id"].as_str().unwrap()], "one webhook");
    server.kill();

    let rotate = format!(
        "/v1/webhooks/{}/rotate-secret",
        created["id"].as_str().unwrap()
    );
    let (status, rotated, _server) =
        keyed_across_a_death(dir.path(), &database, &rotate, "rotate-1", &json!({})).await;
    assert_eq!(status, 200, "{rotated}");
    assert_eq!(rotated["secret_withheld"], true, "{rotated}");
    assert!(rotated.get("secret").is_none(), "{rotated}");
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_continue_webhook_and_rotation_whose_process_died_are_carried_out_once_on_sqlite() {
    keyed_continue_and_webhooks_across_deaths(sqlite().unwrap()).await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_continue_webhook_and_rotation_whose_process_died_are_carried_out_once_on_postgres()
{
    let Some(database) = postgres() else {
        eprintln!("skipped: RATCHET_TEST_POSTGRES_URL is not set");
        return;
    };
    keyed_continue_and_webhooks_across_deaths(database).await;
}
