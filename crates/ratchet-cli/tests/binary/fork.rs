//! Forks with real processes: a finished run is forked at a step with `ratchet runs fork`, the
//! process running the fork is killed with SIGKILL mid-way, and `ratchet resume` finishes the
//! fork with a history of its own while the source's rows stay exactly as they were — on
//! SQLite and on PostgreSQL.

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ratchet_core::{RunId, SessionId};
use serde_json::{Value, json};

use crate::common::{self, DEADLINE, Database};

const BIN: &str = env!("CARGO_BIN_EXE_ratchet");

/// One model call asking for a sum and a pause long enough to be killed in, then an answer.
fn script() -> Value {
    json!({"replies": [
        {"text": "Adding, then resting a moment.", "tool_calls": [
            {"name": "add", "arguments": {"a": 2, "b": 3}},
            {"name": "sleep_ms", "arguments": {"ms": 1500}}]},
        {"text": "The sum is 5."}
    ]})
}

fn ratchet(db: &str, args: &[&str]) -> Output {
    let output =
        common::output_within_deadline(Command::new(BIN).args(args).args(["--db", db]), "");
    assert!(
        output.status.success(),
        "ratchet {args:?} failed: {}",
        common::stderr_of(&output)
    );
    output
}

fn show(db: &str, run: &str) -> Value {
    serde_json::from_slice(&ratchet(db, &["runs", "show", run, "--json"]).stdout).unwrap()
}

/// What a store holds of a session and its run, read through the `Reads` role.
async fn rows(db: &str, session: &str, run: &str) -> (Vec<ratchet_core::Message>, Value, Value) {
    let store = ratchet::open_existing_store(db).unwrap();
    let session = SessionId::parse(session).unwrap();
    let run = RunId::parse(run).unwrap();
    let history = store.history(&session).await.unwrap();
    let steps = serde_json::to_value(store.steps(&run).await.unwrap()).unwrap();
    let events =
        serde_json::to_value(store.events_after(&session, 0, 10_000).await.unwrap()).unwrap();
    (history, steps, events)
}

fn fork_survives_a_kill_and_leaves_its_source_alone(database: Option<Database>) {
    let Some(database) = database else {
        eprintln!("skipped: no PostgreSQL (set RATCHET_TEST_POSTGRES_URL)");
        return;
    };
    let db = database.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("script.json");
    std::fs::write(&path, script().to_string()).unwrap();
    let model = format!("scripted:{}", path.display());
    let ran = ratchet(db, &["run", "--json", "--model", &model, "What is 2 + 3?"]);
    let report = common::report(&ran);
    assert_eq!(report["status"], "completed", "{report}");
    assert_eq!(report["steps"], 3);
    let source = report["run_id"].as_str().unwrap().to_owned();
    let source_session = report["session_id"].as_str().unwrap().to_owned();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let before = runtime.block_on(rows(db, &source_session, &source));
    let shown_before = show(db, &source);

    // Forked after its tools step: the fork's first step calls the model.
    let forked = ratchet(db, &["runs", "fork", &source, "--at-step", "2"]);
    let printed = common::stdout_of(&forked);
    let field = |name: &str| {
        (printed.lines())
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no {name} in {printed:?}"))
            .to_owned()
    };
    let (session, fork) = (field("session"), field("run"));
    assert!(
        printed.contains(&format!("forked {source} at step 2")),
        "{printed}"
    );
    let copied = runtime.block_on(rows(db, &session, &fork)).0;
    assert_eq!(
        copied,
        before.0[..4],
        "the fork holds the history through step 2"
    );
    assert_eq!(
        show(db, &fork)["forked_from"],
        json!({"run_id": source, "step": 2})
    );

    // The process running the fork dies while its tools sleep, after its model step committed.
    let mut child = Command::new(BIN)
        .args(["resume", "--json", "--db", db])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    loop {
        let state = show(db, &fork);
        if state["step_index"].as_u64().unwrap() >= 1 {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "resume ended before the kill: {state}"
        );
        assert!(
            started.elapsed() < DEADLINE,
            "the fork made no step: {state}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    assert_eq!(child.wait().unwrap().signal(), Some(9), "killed mid-way");
    let killed = show(db, &fork);
    assert_eq!(killed["status"], "running", "{killed}");

    let resumed = ratchet(db, &["resume", "--json"]);
    let reports: Vec<Value> = common::stdout_of(&resumed)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        reports.len(),
        1,
        "only the fork was unfinished: {reports:?}"
    );
    assert_eq!(reports[0]["run_id"], fork.as_str());
    assert_eq!(reports[0]["status"], "completed", "{reports:?}");
    assert_eq!(reports[0]["final_answer"], "The sum is 5.");
    let done = show(db, &fork);
    let indexes: Vec<u64> = (done["steps"].as_array().unwrap().iter())
        .map(|s| s["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indexes, [1, 2, 3], "no step lost or repeated: {done}");

    let (history, _, _) = runtime.block_on(rows(db, &session, &fork));
    assert_eq!(history[..4], before.0[..4], "the copy stays as it was");
    assert_eq!(history.len(), 4 + 4, "and the fork's own steps follow it");
    assert_eq!(history.last().unwrap().content, "The sum is 5.");
    let after = runtime.block_on(rows(db, &source_session, &source));
    assert_eq!(
        after, before,
        "the source's messages, steps and events are unchanged"
    );
    assert_eq!(show(db, &source), shown_before);
}

#[test]
fn a_fork_killed_mid_way_completes_on_sqlite_and_its_source_is_unchanged() {
    fork_survives_a_kill_and_leaves_its_source_alone(common::sqlite());
}

#[test]
fn a_fork_killed_mid_way_completes_on_postgresql_and_its_source_is_unchanged() {
    fork_survives_a_kill_and_leaves_its_source_alone(common::postgres());
}
