//! Sub-agents through the binary, on SQLite and on PostgreSQL: an agent of a catalog delegates
//! with `ratchet run --agents DIR --agent ID`, the process is killed with SIGKILL while the
//! children run, and `ratchet resume` finishes every child, joins the parent exactly once and
//! completes it; and `ratchet serve` is killed with SIGKILL while a continuation turn reports
//! background work, and `ratchet resume` finishes that turn, consuming its event exactly once;
//! and a client follows a delegating run's tree stream across a SIGKILL of the server.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{
    SECRETS_KEY, free_port, open_store, output_within_deadline, postgres, sqlite, stderr_of,
};
use ratchet_core::{InboxStatus, Origin, Role, RunId, RunStatus, SessionId, Visibility};
use ratchet_store::Store;
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_ratchet");
const DEADLINE: Duration = Duration::from_secs(120);
const TASKS: usize = 3;

macro_rules! scenarios {
    ($backend:ident) => {
        mod $backend {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_delegating_run_killed_while_its_children_run_resumes_and_joins_once() {
                let Some(db) = super::$backend() else { return };
                super::killed_while_children_run(&db.url).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn ratchet_run_tells_of_background_work_and_resume_finishes_it() {
                let Some(db) = super::$backend() else { return };
                super::run_leaves_background_work_to_resume(&db.url).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_server_killed_during_a_continuation_turn_resumes_and_consumes_once() {
                let Some(db) = super::$backend() else { return };
                super::killed_during_a_continuation(&db.url).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_tree_stream_followed_across_a_server_kill_sends_every_event_once() {
                let Some(db) = super::$backend() else { return };
                super::tree_stream_across_a_kill(&db.url).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn dead_letters_are_discarded_from_the_terminal_and_a_closed_sessions_stay() {
                let Some(db) = super::$backend() else { return };
                super::dead_letters_from_the_terminal(&db.url).await;
            }
        }
    };
}

scenarios!(sqlite);
scenarios!(postgres);

/// A catalog of two agents: `boss` hands three tasks to `worker`s and answers once they are
/// done; a `worker` sleeps (long enough to be killed in the middle of) and answers.
fn write_catalog(dir: &Path, sleep_ms: u64) {
    let tasks: Vec<_> = (0..TASKS)
        .map(|i| json!({"agent": "worker", "task": format!("part {i}")}))
        .collect();
    let boss = json!({"replies": [
        {"tool_calls": [{"name": "delegate", "arguments": {"mode": "foreground", "tasks": tasks}}]},
        {"text": "boss done"}
    ]});
    let worker = json!({"replies": [
        {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": sleep_ms}}]},
        {"text": "worker done"}
    ]});
    std::fs::write(dir.join("boss.json"), boss.to_string()).unwrap();
    std::fs::write(dir.join("worker.json"), worker.to_string()).unwrap();
    std::fs::write(
        dir.join("boss.md"),
        "---\nid: boss\ndescription: splits the job\nmodel: scripted:boss.json\ndelegates: [worker]\n---\nYou split jobs.\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("worker.md"),
        "---\nid: worker\ndescription: does one part\nmodel: scripted:worker.json\ntools: [sleep_ms]\n---\nYou do one part.\n",
    )
    .unwrap();
}

async fn killed_while_children_run(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let catalog = dir.path().join("agents");
    std::fs::create_dir(&catalog).unwrap();
    write_catalog(&catalog, 1_500);
    let mut run = Command::new(BIN)
        .args(["run", "--json", "--db", url, "--agents"])
        .arg(&catalog)
        .args(["--agent", "boss", "--workspace"])
        .arg(dir.path())
        .arg("do the job")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let store = open_store(url);
    let started = Instant::now();
    // Kill it while every child sleeps in its tool call: each child has committed its model
    // step, and the job of its tool step is held under a worker's lease.
    let root = loop {
        let runs = store.list_runs().await.unwrap();
        let sleeping = runs
            .iter()
            .filter(|r| r.status == RunStatus::Running && r.step_index == 1)
            .count();
        let now = ratchet_engine::Clock::System.now();
        let held = store.stats(now).await.unwrap().held_jobs as usize;
        let root = runs.iter().find(|r| r.status == RunStatus::WaitingChildren);
        if let (Some(root), TASKS, TASKS) = (root, sleeping, held) {
            break root.run_id.clone();
        }
        if let Some(status) = run.try_wait().unwrap() {
            panic!("ratchet run ended ({status}) before its children ran: {runs:?}");
        }
        assert!(
            started.elapsed() < DEADLINE,
            "the children never ran: {runs:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    run.kill().unwrap();
    assert_eq!(run.wait().unwrap().signal(), Some(9));
    let tree = store.run_tree(&root).await.unwrap();
    assert_eq!(tree.len(), TASKS + 1);
    assert!(
        tree[1..].iter().all(|n| !n.status.is_terminal()),
        "killed before any child ended: {tree:?}"
    );

    let resumed = output_within_deadline(
        Command::new(BIN).args(["resume", "--json", "--db", url]),
        "",
    );
    assert!(
        resumed.status.success(),
        "resume failed: {}",
        stderr_of(&resumed)
    );
    let reports: Vec<serde_json::Value> = String::from_utf8_lossy(&resumed.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let root_report = reports
        .iter()
        .find(|r| r["run_id"] == root.as_str())
        .unwrap_or_else(|| panic!("resume reports the waiting root too: {reports:?}"));
    assert_eq!(root_report["status"], "completed");
    assert_eq!(root_report["final_answer"], "boss done");

    let tree = store.run_tree(&root).await.unwrap();
    assert_eq!(
        tree.len(),
        TASKS + 1,
        "no child was started twice: {tree:?}"
    );
    for child in &tree[1..] {
        let state = store.load_state(&child.run_id).await.unwrap();
        assert_eq!(
            (state.status, state.final_answer.as_deref()),
            (RunStatus::Completed, Some("worker done")),
            "{}",
            child.run_id
        );
    }
    assert_joined_once(store.as_ref(), &root).await;
}

/// The parent went from `waiting_children` back to `running` exactly once, its batch handed
/// every child's answer over in task order, and it took exactly four steps: the model's
/// delegation, the tools step that started the children, the tools step after the join, and
/// the answer.
async fn assert_joined_once(store: &dyn Store, root: &RunId) {
    let events = store.run_events_after(root, 0, 10_000).await.unwrap();
    let statuses: Vec<&str> = events
        .iter()
        .filter(|e| e.kind == "run.status")
        .filter_map(|e| e.payload["status"].as_str())
        .collect();
    assert_eq!(
        statuses,
        ["running", "waiting_children", "running", "completed"],
        "the join happened once"
    );
    let finished = events
        .iter()
        .filter(|e| e.kind == "subagent.finished")
        .count();
    assert_eq!(finished, TASKS);
    let steps = store.steps(root).await.unwrap();
    assert_eq!(
        steps
            .iter()
            .map(|s| s.instruction.as_str())
            .collect::<Vec<_>>(),
        [
            "call_llm",
            "call_tools_batch",
            "call_tools_batch",
            "call_llm"
        ]
    );
    let state = store.load_state(root).await.unwrap();
    let history = store.history(&state.session_id).await.unwrap();
    let result = history
        .iter()
        .find(|m| m.role == ratchet_core::Role::Tool)
        .expect("the delegation's result");
    let result: serde_json::Value = serde_json::from_str(&result.content).unwrap();
    let answers: Vec<&str> = result["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["answer"].as_str().unwrap_or("(no answer)"))
        .collect();
    assert_eq!(answers, ["worker done"; TASKS]);
}

/// `lead` starts one `worker` in the background, sleeps, and answers; every turn of its runs
/// follows the same script, so the continuation turn that reports the worker's result sleeps
/// too (its `delegate` call is refused: a continuation may only read).
fn write_background_catalog(dir: &Path) {
    let lead = json!({"replies": [
        {"tool_calls": [{"name": "delegate", "arguments": {"mode": "background", "tasks": [
            {"agent": "worker", "task": "the part"}
        ]}}]},
        {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 1_500}}]},
        {"text": "lead done"}
    ]});
    std::fs::write(dir.join("lead.json"), lead.to_string()).unwrap();
    std::fs::write(
        dir.join("worker.json"),
        json!({"replies": [{"text": "worker done"}]}).to_string(),
    )
    .unwrap();
    std::fs::write(
        dir.join("lead.md"),
        "---\nid: lead\ndescription: starts background work\nmodel: scripted:lead.json\ndelegates: [worker]\ntools: [sleep_ms]\n---\nYou lead.\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("worker.md"),
        "---\nid: worker\ndescription: does one part\nmodel: scripted:worker.json\n---\nYou do one part.\n",
    )
    .unwrap();
}

async fn killed_during_a_continuation(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let catalog = dir.path().join("agents");
    std::fs::create_dir(&catalog).unwrap();
    write_background_catalog(&catalog);
    let port = free_port();
    let mut serve = serve(url, &catalog, dir.path(), port).await;
    let started = Instant::now();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let session = post(
        &http,
        &format!("{base}/v1/sessions"),
        json!({"agent": "lead"}),
    )
    .await;
    let session = SessionId::parse(session["id"].as_str().unwrap()).unwrap();
    let path = format!("{base}/v1/sessions/{session}/messages");
    post(&http, &path, json!({"content": "start the work"})).await;

    // Kill it while the continuation turn sleeps in its tool call.
    let store = open_store(url);
    let continuation = loop {
        let runs = store.session_runs(&session, None, 10).await.unwrap();
        let sleeping = runs
            .iter()
            .skip(1)
            .find(|r| r.status == RunStatus::Running && r.step_index >= 3);
        if let Some(run) = sleeping {
            break run.run_id.clone();
        }
        if let Some(status) = serve.try_wait().unwrap() {
            panic!("ratchet serve ended ({status}): {runs:?}");
        }
        assert!(
            started.elapsed() < DEADLINE,
            "no continuation ran: {runs:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    serve.kill().unwrap();
    assert_eq!(serve.wait().unwrap().signal(), Some(9));
    let leased = store.inbox(&session, None, 0, 10).await.unwrap();
    assert_eq!(
        leased
            .iter()
            .map(|e| (e.status, e.lease_run_id.clone()))
            .collect::<Vec<_>>(),
        [(InboxStatus::Leased, Some(continuation.clone()))],
        "killed while the continuation held the event"
    );

    let resumed = output_within_deadline(
        Command::new(BIN).args(["resume", "--json", "--db", url]),
        "",
    );
    assert!(
        resumed.status.success(),
        "resume failed: {}",
        stderr_of(&resumed)
    );
    let turn = store.load_state(&continuation).await.unwrap();
    assert_eq!(
        (turn.status, turn.final_answer.as_deref()),
        (RunStatus::Completed, Some("lead done"))
    );
    let consumed = store.inbox(&session, None, 0, 10).await.unwrap();
    assert_eq!(
        consumed
            .iter()
            .map(|e| (e.status, e.attempts, e.lease_run_id.clone()))
            .collect::<Vec<_>>(),
        [(InboxStatus::Consumed, 1, Some(continuation.clone()))],
        "consumed exactly once, by the turn that was killed"
    );
    let runs = store.session_runs(&session, None, 10).await.unwrap();
    assert_eq!(
        runs.len(),
        2,
        "the first turn and one continuation: {runs:?}"
    );
    let events = store.events_after(&session, 0, 10_000).await.unwrap();
    let count = |kind: &str| events.iter().filter(|e| e.kind == kind).count();
    assert_eq!((count("inbox.leased"), count("inbox.consumed")), (1, 1));

    let visible = store.visible_messages(&session, 0, 1_000).await.unwrap();
    assert!(
        !visible
            .iter()
            .any(|m| m.message.content.contains("[runtime]")),
        "the hidden trigger never reaches client history"
    );
    assert_eq!(
        visible
            .last()
            .map(|m| (m.message.origin, m.message.content.as_str())),
        Some((Origin::Continuation, "lead done"))
    );
    let history = store.history(&session).await.unwrap();
    let triggers: Vec<_> = history
        .iter()
        .filter(|m| m.role == Role::User && m.origin == Origin::Continuation)
        .collect();
    assert_eq!(triggers.len(), 1, "one trigger, written once");
    assert_eq!(triggers[0].visibility, Visibility::Hidden);
    assert!(triggers[0].content.contains("worker done"));

    let root = &runs[0].run_id;
    let shown = output_within_deadline(
        Command::new(BIN).args(["runs", "show", root.as_str(), "--db", url]),
        "",
    );
    let text = String::from_utf8_lossy(&shown.stdout);
    assert!(
        text.lines()
            .any(|l| l.contains("worker  background  completed")),
        "the tree marks the background run: {text}"
    );
}

/// `ratchet serve` of `catalog` on `port`, listening when this returns.
async fn serve(url: &str, catalog: &Path, workspace: &Path, port: u16) -> std::process::Child {
    let serve = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--db",
            url,
            "--lease-ms",
            "1500",
            "--agents",
        ])
        .arg(catalog)
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

/// A successful `POST` of `body` to `url`, answering the JSON it answered.
async fn post(http: &reqwest::Client, url: &str, body: serde_json::Value) -> serde_json::Value {
    let response = http.post(url).json(&body).send().await.unwrap();
    assert!(
        response.status().is_success(),
        "POST {url}: {}",
        response.status()
    );
    response.json().await.unwrap()
}

/// One event of a tree stream as a client received it: its id (the whole cursor), its
/// session and seq, its run and depth.
#[derive(Debug, Clone, PartialEq)]
struct TreeEvent {
    id: String,
    at: (String, i64),
    run: String,
    depth: u64,
    kind: String,
}

/// Reads a tree stream from `after` (a cursor) until `last` holds for an event or the
/// connection ends; returns what it received.
async fn read_tree(
    http: &reqwest::Client,
    url: &str,
    after: Option<&str>,
    mut last: impl FnMut(&TreeEvent) -> bool,
) -> Vec<TreeEvent> {
    let mut request = http.get(url);
    if let Some(after) = after {
        request = request.header("Last-Event-ID", after);
    }
    let mut received = Vec::new();
    let Ok(mut response) = request.send().await else {
        return received;
    };
    let mut parser = ratchet_llm::sse::SseParser::default();
    let read = async {
        while let Ok(Some(bytes)) = response.chunk().await {
            for event in parser.feed(&bytes) {
                let data: serde_json::Value = serde_json::from_str(&event.data).unwrap();
                if data["live"] == true {
                    continue;
                }
                let event = TreeEvent {
                    id: event.id.clone(),
                    at: (
                        data["session_id"].as_str().unwrap().to_owned(),
                        data["seq"].as_i64().unwrap(),
                    ),
                    run: data["run_id"].as_str().unwrap().to_owned(),
                    depth: data["depth"].as_u64().unwrap(),
                    kind: data["kind"].as_str().unwrap().to_owned(),
                };
                let done = last(&event);
                received.push(event);
                if done {
                    return;
                }
            }
        }
    };
    let _ = tokio::time::timeout(DEADLINE, read).await;
    received
}

/// A client follows a delegating run's tree stream; the server is killed with SIGKILL while
/// the children run (after their tool steps) and started again; the client resumes with the last id it received. It
/// gets every event of every run of the tree exactly once, each run's in order — what a
/// replay of the whole tree holds.
async fn tree_stream_across_a_kill(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let catalog = dir.path().join("agents");
    std::fs::create_dir(&catalog).unwrap();
    write_catalog(&catalog, 1500);
    let port = free_port();
    let mut server = serve(url, &catalog, dir.path(), port).await;
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let session = post(
        &http,
        &format!("{base}/v1/sessions"),
        json!({"agent": "boss"}),
    )
    .await;
    let session = session["id"].as_str().unwrap();
    let path = format!("{base}/v1/sessions/{session}/messages");
    let accepted = post(&http, &path, json!({"content": "split the job"})).await;
    let root = accepted["run_id"].as_str().unwrap().to_owned();
    let stream = format!("{base}/v1/runs/{root}/tree/events");
    let root_finished = |e: &TreeEvent| e.kind == "run.finished" && e.run == root;

    // Until every child's tool call is committed: their answers, their ends, the parent's
    // join and its answer are still to come when the server dies.
    let mut calls = 0;
    let mut received = read_tree(&http, &stream, None, |e| {
        calls += usize::from(e.depth == 1 && e.kind == "tool.call");
        calls == TASKS
    })
    .await;
    assert_eq!(calls, TASKS, "every child called its tool: {received:#?}");
    server.kill().unwrap();
    assert_eq!(server.wait().unwrap().signal(), Some(9));
    let mut server = serve(url, &catalog, dir.path(), port).await;
    while !received.last().is_some_and(root_finished) {
        let after = received.last().map(|e| e.id.clone());
        let more = read_tree(&http, &stream, after.as_deref(), root_finished).await;
        assert!(
            !more.is_empty(),
            "the stream resumed with nothing: {received:#?}"
        );
        received.extend(more);
    }

    let replay = read_tree(&http, &format!("{stream}?follow=false"), None, |_| false).await;
    server.kill().unwrap();
    let _ = server.wait();
    let runs: std::collections::BTreeSet<&str> = replay.iter().map(|e| e.run.as_str()).collect();
    assert_eq!(runs.len(), 1 + TASKS, "the root and its children: {runs:?}");
    let mut got: Vec<&(String, i64)> = received.iter().map(|e| &e.at).collect();
    let mut all: Vec<&(String, i64)> = replay.iter().map(|e| &e.at).collect();
    for run in &runs {
        let of = |events: &[TreeEvent]| -> Vec<(String, i64)> {
            (events.iter().filter(|e| e.run == *run))
                .map(|e| e.at.clone())
                .collect()
        };
        assert_eq!(of(&received), of(&replay), "run {run}'s events, in order");
    }
    got.sort();
    all.sort();
    assert_eq!(got.len(), all.len(), "nothing twice");
    assert_eq!(got, all, "every event of the tree, across the kill");
}

/// `ratchet run` of the `lead` agent in `dir`, which leaves its background work behind.
fn run_lead(url: &str, dir: &Path) -> std::process::Output {
    let catalog = dir.join("agents");
    std::fs::create_dir(&catalog).unwrap();
    write_background_catalog(&catalog);
    let ran = output_within_deadline(
        Command::new(BIN)
            .args(["run", "--json", "--db", url, "--agents"])
            .arg(&catalog)
            .args(["--agent", "lead", "--workspace"])
            .arg(dir)
            .arg("start the work"),
        "",
    );
    assert!(ran.status.success(), "run failed: {}", stderr_of(&ran));
    ran
}

async fn run_leaves_background_work_to_resume(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let ran = run_lead(url, dir.path());
    let stderr = stderr_of(&ran);
    assert!(
        stderr.contains("background work goes on in session")
            && stderr.contains(&format!("ratchet resume --db {url}")),
        "{stderr}"
    );
    let report: serde_json::Value = serde_json::from_slice(&ran.stdout).unwrap();
    assert_eq!(report["final_answer"], "lead done");
    let session = SessionId::parse(report["session_id"].as_str().unwrap()).unwrap();

    let resumed = output_within_deadline(
        Command::new(BIN).args(["resume", "--json", "--db", url]),
        "",
    );
    assert!(
        resumed.status.success(),
        "resume failed: {}",
        stderr_of(&resumed)
    );
    let store = open_store(url);
    let inbox = store.inbox(&session, None, 0, 10).await.unwrap();
    assert_eq!(
        inbox.iter().map(|e| e.status).collect::<Vec<_>>(),
        [InboxStatus::Consumed],
        "the report was delivered"
    );
    let runs = store.session_runs(&session, None, 10).await.unwrap();
    assert_eq!(
        runs.iter().map(|r| r.status).collect::<Vec<_>>(),
        [RunStatus::Completed, RunStatus::Completed],
        "the run and its continuation"
    );
}

/// `ratchet inbox` and `ratchet webhooks` act on dead letters in the database: a closed
/// session's report cannot be requeued (nothing would tell it) but can be discarded, once;
/// bad requests say what is wrong and exit non-zero.
async fn dead_letters_from_the_terminal(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let ran = run_lead(url, dir.path());
    let report: serde_json::Value = serde_json::from_slice(&ran.stdout).unwrap();
    let session = SessionId::parse(report["session_id"].as_str().unwrap()).unwrap();
    let store = open_store(url);
    store
        .close_session(&session, ratchet_store::Closing::Archive, 1)
        .await
        .unwrap();
    let event = store.inbox(&session, None, 0, 10).await.unwrap()[0].id;
    let cli = |args: &[&str]| {
        let mut command = Command::new(BIN);
        command.args(args).args(["--db", url]);
        output_within_deadline(&mut command, "")
    };
    let (session_arg, event_arg) = (session.to_string(), event.to_string());

    let refused = cli(&["inbox", "requeue", &session_arg, &event_arg]);
    assert!(
        !refused.status.success(),
        "a closed session's dead letter was requeued"
    );
    assert!(
        stderr_of(&refused).contains("is closed"),
        "{}",
        stderr_of(&refused)
    );
    for _ in 0..2 {
        let discarded = cli(&[
            "inbox",
            "discard",
            &session_arg,
            &event_arg,
            "--by",
            "alice",
        ]);
        assert!(discarded.status.success(), "{}", stderr_of(&discarded));
        let said = String::from_utf8_lossy(&discarded.stdout).into_owned();
        assert!(said.contains("is discarded: discarded by alice"), "{said}");
    }
    let inbox = store.inbox(&session, None, 0, 10).await.unwrap();
    assert_eq!(inbox[0].status, InboxStatus::Discarded);

    for (args, says) in [
        (
            vec!["webhooks", "requeue", "whk_nothing"],
            "give the DELIVERY_ID of a dead delivery, or --all-dead",
        ),
        (
            vec!["webhooks", "requeue", "whk_nothing", "--all-dead"],
            "webhook whk_nothing not found",
        ),
        (
            vec!["inbox", "discard", &session_arg, "999999"],
            "inbox event 999999 of session",
        ),
    ] {
        let failed = cli(&args);
        assert!(!failed.status.success(), "{args:?} succeeded");
        assert!(
            stderr_of(&failed).contains(says),
            "{args:?}: {}",
            stderr_of(&failed)
        );
    }
}
