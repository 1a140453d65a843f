//! Durable timers through the binary, on SQLite and on PostgreSQL: a run parks on a `wait` of
//! a few seconds, its process is killed with SIGKILL while it waits and right around its due
//! time, and `ratchet resume` — another process — wakes it exactly once (one `timer.woke`, one
//! wait result, one model call after it), never before the due time frozen when it parked, and
//! completes it; and a message sent to a server started after the one the run parked in was
//! killed wakes the run early, saying so.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::common::{
    DEADLINE, SECRETS_KEY, free_port, open_store, output_within_deadline, postgres, sqlite,
    stderr_of,
};
use ratchet_core::{Millis, RunId, RunStatus, SessionId};
use ratchet_store::{Store, StoredEvent};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_ratchet");
/// How long the runs of the kill tests wait.
const WAIT_MS: i64 = 2_500;
/// Streamed slowly (about a second), so that a kill just after the wake can land in it.
const FINAL: &str = "Woke up on time and finished the job after the wait, one durable step at a time, as promised before waiting.";

macro_rules! scenarios {
    ($backend:ident) => {
        mod $backend {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_run_killed_while_it_waits_is_woken_once_by_the_next_process() {
                let Some(db) = super::$backend() else { return };
                super::killed_at(&db.url, super::Kill::AfterParking(300)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_run_killed_just_before_its_due_time_is_woken_once() {
                let Some(db) = super::$backend() else { return };
                super::killed_at(&db.url, super::Kill::FromDue(-80)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_run_killed_at_its_due_time_is_woken_once() {
                let Some(db) = super::$backend() else { return };
                super::killed_at(&db.url, super::Kill::FromDue(0)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_run_killed_as_it_wakes_is_woken_once() {
                let Some(db) = super::$backend() else { return };
                super::killed_at(&db.url, super::Kill::FromDue(150)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_message_to_the_next_server_wakes_a_waiting_run_early() {
                let Some(db) = super::$backend() else { return };
                super::woken_by_a_message(&db.url).await;
            }
        }
    };
}

scenarios!(sqlite);
scenarios!(postgres);

fn now_ms() -> Millis {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    Millis::try_from(since.as_millis()).unwrap()
}

/// A script that waits `ms` and then answers `FINAL`.
fn write_script(dir: &Path, ms: i64) -> std::path::PathBuf {
    let script = json!({"replies": [
        {"text": "I will wait.", "tool_calls": [{"name": "wait", "arguments": {"ms": ms}}]},
        {"text": FINAL, "chunk_delay_ms": 40}
    ]});
    let path = dir.join("script.json");
    std::fs::write(&path, script.to_string()).unwrap();
    path
}

/// When the process that parked the run is killed.
#[derive(Debug, Clone, Copy)]
enum Kill {
    /// This many ms after the run was seen waiting.
    AfterParking(u64),
    /// This many ms from the run's due time (before it when negative).
    FromDue(i64),
}

/// Polls until the only run of the store waits on its timer; returns it and its due time.
async fn parked(store: &dyn Store, process: &mut Child) -> (RunId, Millis) {
    let started = Instant::now();
    loop {
        let runs = store.list_runs().await.unwrap();
        if let Some(run) = runs.iter().find(|r| r.status == RunStatus::WaitingTimer) {
            let state = store.load_state(&run.run_id).await.unwrap();
            let due = state.timer.expect("a waiting run has its timer").due_at;
            return (run.run_id.clone(), due);
        }
        if let Some(status) = process.try_wait().unwrap() {
            panic!("the process ended ({status}) before its run waited: {runs:?}");
        }
        assert!(started.elapsed() < DEADLINE, "no run waited: {runs:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn kill(mut process: Child, what: &str) {
    if let Some(status) = process.try_wait().unwrap() {
        panic!("{what}: the process ended ({status}) before the kill");
    }
    process.kill().unwrap();
    assert_eq!(process.wait().unwrap().signal(), Some(9), "{what}");
}

async fn killed_at(url: &str, when: Kill) {
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(dir.path(), WAIT_MS);
    let mut run = Command::new(BIN)
        .args(["run", "--json", "--db", url, "--model"])
        .arg(format!("scripted:{}", script.display()))
        .arg("--workspace")
        .arg(dir.path())
        .arg("wait a little, then answer")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let store = open_store(url);
    let (run_id, due) = parked(&*store, &mut run).await;
    let at = match when {
        Kill::AfterParking(ms) => now_ms() + ms as i64,
        Kill::FromDue(offset) => due + offset,
    };
    tokio::time::sleep(Duration::from_millis(
        u64::try_from(at - now_ms()).unwrap_or(0),
    ))
    .await;
    kill(run, &format!("{when:?}"));
    let before = store.load_state(&run_id).await.unwrap();
    assert!(
        !before.status.is_terminal(),
        "{when:?}: killed before the run ended: {:?}",
        before.status
    );

    let resumed = output_within_deadline(
        Command::new(BIN).args(["resume", "--json", "--db", url]),
        "",
    );
    assert!(
        resumed.status.success(),
        "{when:?}: resume failed: {}",
        stderr_of(&resumed)
    );
    let events = woke_once(&*store, &run_id, "timer", &format!("{when:?}")).await;
    let woke = only(&events, "timer.woke");
    assert!(
        woke.payload["waited_ms"].as_i64().unwrap() >= WAIT_MS,
        "{when:?}: woken early: {}",
        woke.payload
    );
    assert!(
        woke.created_at >= due,
        "{when:?}: woken at {} before its due time {due}",
        woke.created_at
    );
}

/// The run completed, woken once by `woke`: one wait set and one woken, its due time the
/// one frozen when it parked, one result of the wait call, and one model call after it (two
/// in all). Returns the run's events.
async fn woke_once(store: &dyn Store, run_id: &RunId, woke: &str, what: &str) -> Vec<StoredEvent> {
    let state = store.load_state(run_id).await.unwrap();
    assert_eq!(
        (state.status, state.final_answer.as_deref()),
        (RunStatus::Completed, Some(FINAL)),
        "{what}"
    );
    assert_eq!(
        state.counters.model_calls, 2,
        "{what}: one model call after the wait"
    );
    assert_eq!(state.step_index, 4, "{what}: ask, park, wake, answer");
    let events = store.run_events_after(run_id, 0, 10_000).await.unwrap();
    let set = only(&events, "timer.set");
    let woken = only(&events, "timer.woke");
    assert_eq!(woken.payload["woke"], woke, "{what}: {}", woken.payload);
    assert_eq!(
        woken.payload["due_at"], set.payload["due_at"],
        "{what}: the due time is the one frozen when the run parked"
    );
    let call = set.payload["call_id"].as_str().unwrap();
    let results: Vec<&StoredEvent> = (events.iter())
        .filter(|e| e.kind == "tool.result" && e.payload["call_id"] == call)
        .collect();
    assert_eq!(results.len(), 1, "{what}: one result of the wait");
    let result: Value =
        serde_json::from_str(results[0].payload["content"].as_str().unwrap()).unwrap();
    assert_eq!(result["woke"], woke, "{what}: {result}");
    let answers = (events.iter())
        .filter(|e| e.kind == "assistant.message")
        .count();
    assert_eq!(
        answers, 2,
        "{what}: the model was called once after the wait"
    );
    events
}

fn only<'a>(events: &'a [StoredEvent], kind: &str) -> &'a StoredEvent {
    let found: Vec<&StoredEvent> = events.iter().filter(|e| e.kind == kind).collect();
    assert_eq!(found.len(), 1, "exactly one {kind}: {found:?}");
    found[0]
}

async fn serve(url: &str, script: &Path, workspace: &Path, port: u16) -> Child {
    let serve = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--db",
            url,
            "--lease-ms",
            "1500",
            "--model",
        ])
        .arg(format!("scripted:{}", script.display()))
        .arg("--workspace")
        .arg(workspace)
        .env("RATCHET_SECRETS_KEY", SECRETS_KEY)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(started.elapsed() < DEADLINE, "ratchet serve did not listen");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    serve
}

async fn post(http: &reqwest::Client, url: &str, body: Value) -> Value {
    let response = http.post(url).json(&body).send().await.unwrap();
    assert!(
        response.status().is_success(),
        "POST {url}: {}",
        response.status()
    );
    response.json().await.unwrap()
}

/// A run waits ten minutes in one server, which is killed; a steering message sent to the
/// next server ends the wait at once: the run is woken by input, takes the message in before
/// its next model call, and completes.
async fn woken_by_a_message(url: &str) {
    const LONG_WAIT_MS: i64 = 600_000;
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(dir.path(), LONG_WAIT_MS);
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let port = free_port();
    let mut first = serve(url, &script, dir.path(), port).await;
    let base = format!("http://127.0.0.1:{port}");
    let session = post(&http, &format!("{base}/v1/sessions"), json!({})).await;
    let session = SessionId::parse(session["id"].as_str().unwrap()).unwrap();
    post(
        &http,
        &format!("{base}/v1/sessions/{session}/messages"),
        json!({"content": "wait for me"}),
    )
    .await;
    let store = open_store(url);
    let (run_id, due) = parked(&*store, &mut first).await;
    let run: Value = http
        .get(format!("{base}/v1/runs/{run_id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(run["status"], "waiting_timer", "{run}");
    assert_eq!(run["wait"]["due_at"], due, "{run}");
    kill(first, "the first server");

    let port = free_port();
    let mut second = serve(url, &script, dir.path(), port).await;
    let base = format!("http://127.0.0.1:{port}");
    let sent = now_ms();
    let steered = post(
        &http,
        &format!("{base}/v1/sessions/{session}/messages"),
        json!({"content": "I am here now", "multitask": "steer"}),
    )
    .await;
    assert_eq!(steered["run_id"], run_id.as_str(), "{steered}");
    let started = Instant::now();
    while !store
        .load_state(&run_id)
        .await
        .unwrap()
        .status
        .is_terminal()
    {
        if let Some(status) = second.try_wait().unwrap() {
            panic!("the second server ended ({status})");
        }
        assert!(
            started.elapsed() < DEADLINE,
            "the message did not wake the run"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = second.kill();
    let _ = second.wait();
    let events = woke_once(&*store, &run_id, "input", "woken by a message").await;
    let woke = only(&events, "timer.woke");
    assert!(
        woke.created_at >= sent && woke.created_at < due,
        "woken by the message, long before its due time: {}",
        woke.payload
    );
    assert_eq!(
        only(&events, "message.steered").payload["content"],
        "I am here now",
        "the message joined the run before its next model call"
    );
}
