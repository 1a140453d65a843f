//! Where two features meet, through the binary, on SQLite and on PostgreSQL:
//! - a run's deadline cuts off a batch whose `never` call (`append_line`) has run: after
//!   `ratchet runs continue` and `ratchet resume`, the model reads that call's real outcome
//!   and the line is in the file once — the model is never told "not run" of it;
//! - a cancel sent to an API process (`serve --workers 0`) reaches the step a `ratchet worker`
//!   process runs, within the cancel grace and about a second, whatever its tool does;
//! - a process whose clock runs a minute ahead stamps and judges time by the database's clock
//!   where the database has one (PostgreSQL), and by its own on SQLite (one machine).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{
    DEADLINE, SECRETS_KEY, free_port, open_store, output_within_deadline, stderr_of,
};
use ratchet_core::{Role, RunId, RunStatus, StopReason};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_ratchet");
/// The cancel grace the cross-process test gives its worker.
const GRACE_MS: u64 = 1_000;

macro_rules! scenarios {
    ($backend:ident) => {
        mod $backend {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_never_call_that_ran_in_a_batch_cut_off_by_the_deadline_is_not_told_not_run()
            {
                let Some(db) = crate::common::$backend() else {
                    return;
                };
                super::deadline_cut_off(&db.url).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_process_whose_clock_runs_ahead_keeps_the_databases_time() {
                let Some(db) = crate::common::$backend() else {
                    return;
                };
                super::clock_ahead(&db.url).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_cancel_sent_to_the_api_process_reaches_the_step_of_a_worker_process() {
                let Some(db) = crate::common::$backend() else {
                    return;
                };
                super::cancel_across_processes(&db.url).await;
            }
        }
    };
}

scenarios!(sqlite);
scenarios!(postgres);

fn write_script(dir: &Path, replies: Value) -> std::path::PathBuf {
    let path = dir.join("script.json");
    std::fs::write(&path, json!({ "replies": replies }).to_string()).unwrap();
    path
}

async fn deadline_cut_off(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(
        dir.path(),
        json!([
            {"tool_calls": [
                {"name": "append_line", "arguments": {"path": "ledger.txt", "line": "paid 100"}},
                {"name": "sleep_ms", "arguments": {"ms": 20_000}},
            ]},
            {"text": "Paid once."},
        ]),
    );
    let ran = output_within_deadline(
        Command::new(BIN)
            .args(["run", "--json", "--db", url, "--max-duration-ms", "1500"])
            .arg("--model")
            .arg(format!("scripted:{}", script.display()))
            .arg("--workspace")
            .arg(dir.path())
            .arg("pay the invoice"),
        "",
    );
    assert_eq!(ran.status.code(), Some(1), "{}", stderr_of(&ran));
    let store = open_store(url);
    let runs = store.list_runs().await.unwrap();
    let run_id: RunId = runs[0].run_id.clone();
    let ended = store.load_state(&run_id).await.unwrap();
    assert_eq!(ended.stop_reason, Some(StopReason::TimedOut));
    assert!(ended.in_doubt.is_empty(), "{:?}", ended.in_doubt);

    let continued = output_within_deadline(
        Command::new(BIN).args([
            "runs",
            "continue",
            run_id.as_str(),
            "--extra-duration-ms",
            "60000",
            "--db",
            url,
        ]),
        "",
    );
    assert!(continued.status.success(), "{}", stderr_of(&continued));
    let resumed = output_within_deadline(
        Command::new(BIN).args(["resume", "--json", "--db", url]),
        "",
    );
    assert!(resumed.status.success(), "{}", stderr_of(&resumed));

    let done = store.load_state(&run_id).await.unwrap();
    assert_eq!(done.status, RunStatus::Completed);
    assert_eq!(done.counters.model_calls, 2);
    let ledger = std::fs::read_to_string(dir.path().join("ledger.txt")).unwrap();
    assert_eq!(ledger.lines().collect::<Vec<_>>(), ["paid 100"]);
    // What the model was sent before its second answer: the batch's real outcomes.
    let history = store.history(&done.session_id).await.unwrap();
    let results: Vec<&str> = (history.iter())
        .filter(|m| m.role == Role::Tool)
        .map(|m| m.content.as_str())
        .collect();
    assert_eq!(results.len(), 2, "{results:?}");
    assert!(results[0].starts_with("appended"), "{results:?}");
    assert_eq!(results[1], "cancelled", "{results:?}");
    // What the model was shown at its second call (step 4: call, cut off, batch, call).
    let shown = store.step_messages(&run_id, 4).await.unwrap().context;
    let shown: Vec<&str> = (shown.iter())
        .filter(|m| m.message.role == Role::Tool)
        .map(|m| m.message.content.as_str())
        .collect();
    assert_eq!(shown, results);
}

async fn spawn_ratchet(args: &[&str], url: &str, script: &Path, workspace: &Path) -> Child {
    Command::new(BIN)
        .args(args)
        .args(["--db", url])
        .env("RATCHET_MODEL", format!("scripted:{}", script.display()))
        .env("RATCHET_WORKSPACE", workspace)
        .env("RATCHET_CANCEL_GRACE_MS", GRACE_MS.to_string())
        .env("RATCHET_SECRETS_KEY", SECRETS_KEY)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

async fn cancel_across_processes(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(
        dir.path(),
        json!([
            {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 60_000}}]},
            {"text": "Slept."},
        ]),
    );
    let migrated = output_within_deadline(Command::new(BIN).args(["migrate", "--db", url]), "");
    assert!(migrated.status.success(), "{}", stderr_of(&migrated));
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut api = spawn_ratchet(
        &["serve", "--workers", "0", "--listen", &listen],
        url,
        &script,
        dir.path(),
    )
    .await;
    let mut worker = spawn_ratchet(&["worker"], url, &script, dir.path()).await;
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(started.elapsed() < DEADLINE, "ratchet serve did not listen");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let session: Value = (http.post(format!("{base}/v1/sessions")).json(&json!({})))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let sent: Value = http
        .post(format!(
            "{base}/v1/sessions/{}/messages",
            session["id"].as_str().unwrap()
        ))
        .json(&json!({"content": "sleep a minute"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let run_id = RunId::parse(sent["run_id"].as_str().unwrap()).unwrap();
    // The worker process is inside the minute-long call.
    let store = open_store(url);
    let started = Instant::now();
    loop {
        let events = store.run_events_after(&run_id, 0, 1_000).await.unwrap();
        if events
            .iter()
            .any(|e| e.kind == "activity" || e.kind == "tool.call")
            || store.load_state(&run_id).await.unwrap().step_index >= 1
        {
            break;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "the run never reached its call"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let the call start in the worker.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let asked = Instant::now();
    let cancel = (http.post(format!("{base}/v1/runs/{run_id}/cancel")))
        .send()
        .await
        .unwrap();
    assert!(cancel.status().is_success(), "{}", cancel.status());
    let ended = loop {
        let state = store.load_state(&run_id).await.unwrap();
        if state.status.is_terminal() {
            break state;
        }
        assert!(asked.elapsed() < DEADLINE, "still {}", state.status);
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let took = asked.elapsed();
    assert_eq!(ended.status, RunStatus::Cancelled);
    // The promise is the grace and about a second; the bound leaves a busy machine slack.
    assert!(
        took < Duration::from_millis(GRACE_MS) + Duration::from_secs(2),
        "the cancel took {took:?} to end the run (grace {GRACE_MS} ms)"
    );
    // The cancel reached the call itself: the tool saw its token and said so.
    let history = store.history(&ended.session_id).await.unwrap();
    let results: Vec<&str> = (history.iter())
        .filter(|m| m.role == Role::Tool)
        .map(|m| m.content.as_str())
        .collect();
    assert_eq!(results, ["cancelled"]);
    for process in [&mut api, &mut worker] {
        process.kill().unwrap();
        process.wait().unwrap();
    }
}

async fn clock_ahead(url: &str) {
    const AHEAD_MS: i64 = 60_000;
    let store = open_store(url);
    let wall = ratchet_engine::Clock::System.now();
    let ahead = ratchet_engine::Clock::tokio_from(wall + AHEAD_MS);
    let coordinator = ratchet_engine::Coordinator::with_clock(
        Arc::clone(&store),
        ratchet_store::RunQuota::default(),
        ahead,
    );
    let synced = coordinator.sync_clock().await.unwrap();
    let database = store.database_now().await.unwrap();
    let now = coordinator.now();
    if url.starts_with("sqlite:") {
        assert_eq!(
            (synced, database),
            (None, None),
            "one machine: its clock is the clock"
        );
        assert!(
            now - wall >= AHEAD_MS,
            "the process keeps its own time: {now} vs {wall}"
        );
        return;
    }
    let database = database.expect("PostgreSQL has a clock of its own");
    let offset = synced.expect("an offset from the database's clock");
    assert!(
        (offset + AHEAD_MS).abs() < 1_000,
        "the offset makes up the minute ahead: {offset}"
    );
    assert!(
        (now - database).abs() < 1_000,
        "the process's now ({now}) is the database's ({database}), not a minute ahead"
    );
}
