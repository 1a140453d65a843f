//! Several `ratchet` processes over one database: `serve` and `worker` processes share the
//! work, a worker killed with SIGKILL mid-step has its runs finished by the others once its
//! leases expire, and an event stream served by one process follows steps another executes.
//!
//! Each scenario takes a database url, so that every backend runs the same scenarios: a
//! backend adds a function that makes a fresh database (see `sqlite`), an arm to `open`, and
//! one `scenarios!` line.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::{SECRETS_KEY, free_port, postgres, sqlite};
use futures::StreamExt;
use ratchet_core::{RunId, RunStatus, SessionId};
use ratchet_store::{Store, StoredEvent};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_ratchet");
/// Far longer than a healthy scenario needs on a loaded two-core machine.
const DEADLINE: Duration = Duration::from_secs(120);
/// Short leases and polls, so that takeovers happen within seconds.
const TUNING: [&str; 4] = ["--lease-ms", "1500", "--poll-ms", "100"];

macro_rules! scenarios {
    ($backend:ident) => {
        mod $backend {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn three_processes_share_two_hundred_runs_and_commit_each_step_once() {
                let Some(db) = super::$backend() else { return };
                super::three_processes_share_the_work(&db.url).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn runs_of_a_worker_killed_mid_step_finish_elsewhere_after_its_leases_expire() {
                let Some(db) = super::$backend() else { return };
                super::a_killed_worker_is_taken_over(&db.url).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_api_process_streams_the_steps_another_process_executes() {
                let Some(db) = super::$backend() else { return };
                super::events_cross_processes(&db.url).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_follower_sees_the_live_activity_of_steps_and_a_replay_never_does() {
                let Some(db) = super::$backend() else { return };
                super::live_activity(&db.url).await;
            }
        }
    };
}

scenarios!(sqlite);
scenarios!(postgres);

/// The test's own view of the database, for checking what the processes stored.
pub(crate) fn open(url: &str) -> Arc<dyn Store> {
    if url.starts_with("sqlite:") {
        return Arc::new(ratchet_sqlite::open_url(url).unwrap());
    }
    if url.starts_with("postgres:") {
        return Arc::new(ratchet_postgres::open_url(url).unwrap());
    }
    panic!("no test backend for {url}")
}

/// A `ratchet` process whose stderr is collected as it runs; killed if the test fails.
pub(crate) struct Process {
    pub(crate) name: &'static str,
    child: Child,
    log: Arc<Mutex<String>>,
}

impl Process {
    pub(crate) fn start(name: &'static str, args: &[&str]) -> Process {
        let mut child = Command::new(BIN)
            .args(args)
            .env("RATCHET_LOG", "info")
            .env("RATCHET_SECRETS_KEY", SECRETS_KEY)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let mut stderr = child.stderr.take().unwrap();
        let sink = Arc::clone(&log);
        std::thread::spawn(move || {
            let mut buffer = [0u8; 4096];
            while let Ok(n) = stderr.read(&mut buffer) {
                if n == 0 {
                    break;
                }
                let text = String::from_utf8_lossy(&buffer[..n]).into_owned();
                sink.lock().unwrap().push_str(&text);
            }
        });
        Process { name, child, log }
    }

    pub(crate) fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits until the process has said `marker`; returns its log.
    pub(crate) fn wait_for(&mut self, marker: &str) -> String {
        let started = Instant::now();
        loop {
            let log = self.log();
            if log.contains(marker) {
                return log;
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("{} exited ({status}) before {marker:?}:\n{log}", self.name);
            }
            assert!(
                started.elapsed() < DEADLINE,
                "{} never said {marker:?}:\n{log}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The lease owner its workers claim as, from its startup line.
    fn owner(&mut self) -> String {
        let log = self.wait_for(" workers as ");
        let (_, rest) = log.split_once(" workers as ").unwrap();
        rest.split(',').next().unwrap().to_owned()
    }

    pub(crate) fn kill_9(&mut self) {
        self.child.kill().unwrap();
        let status = self.child.wait().unwrap();
        assert_eq!(status.signal(), Some(9), "{} ended by itself", self.name);
    }

    /// SIGTERM, then the exit status within the deadline.
    pub(crate) fn terminate(&mut self) -> ExitStatus {
        let sent = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                started.elapsed() < DEADLINE,
                "{} did not stop after SIGTERM:\n{}",
                self.name,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Applies the schema once, as a deployment would before starting its processes (which then
/// run with `--no-migrate`).
pub(crate) fn migrate(db: &str) {
    let out = Command::new(BIN)
        .args(["migrate", "--db", db])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.starts_with("schema version "),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A process serving the API on a free port, with `workers` workers, the model `script` and
/// the workspace `dir`.
pub(crate) fn serve(db: &str, dir: &Path, script: &Path, workers: &str) -> (Process, String) {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let model = format!("scripted:{}", script.display());
    let workspace = dir.display().to_string();
    let mut args = vec![
        "serve",
        "--no-migrate",
        "--db",
        db,
        "--listen",
        &listen,
        "--model",
        &model,
        "--workspace",
        &workspace,
        "--workers",
        workers,
    ];
    args.extend(TUNING);
    let mut process = Process::start("serve", &args);
    process.wait_for("ratchet listening on");
    (process, format!("http://{listen}"))
}

pub(crate) fn worker(name: &'static str, db: &str) -> Process {
    let mut args = vec!["worker", "--no-migrate", "--db", db, "--workers", "4"];
    args.extend(TUNING);
    let mut process = Process::start(name, &args);
    process.wait_for("ratchet worker on database");
    process
}

pub(crate) fn write_script(dir: &Path, script: &Value) -> PathBuf {
    let path = dir.join("script.json");
    std::fs::write(&path, script.to_string()).unwrap();
    path
}

async fn post(http: &reqwest::Client, url: String, body: Value) -> Value {
    let response = http.post(&url).json(&body).send().await.unwrap();
    let status = response.status();
    let body: Value = response.json().await.unwrap();
    assert!(status.is_success(), "POST {url}: {status} {body}");
    body
}

async fn create_session(http: &reqwest::Client, base: &str) -> String {
    let session = post(http, format!("{base}/v1/sessions"), json!({})).await;
    session["id"].as_str().unwrap().to_owned()
}

async fn send(http: &reqwest::Client, base: &str, session: &str, content: &str) -> String {
    let url = format!("{base}/v1/sessions/{session}/messages");
    let sent = post(http, url, json!({"content": content})).await;
    sent["run_id"].as_str().unwrap().to_owned()
}

/// Opens `count` sessions with one message each, a few at a time; returns the runs.
async fn submit_runs(base: &str, count: usize) -> Vec<RunId> {
    let http = reqwest::Client::new();
    futures::stream::iter(0..count)
        .map(|i| {
            let http = http.clone();
            async move {
                let session = create_session(&http, base).await;
                let run = send(&http, base, &session, &format!("run {i}")).await;
                RunId::parse(&run).unwrap()
            }
        })
        .buffer_unordered(16)
        .collect()
        .await
}

/// Waits until every run has ended; returns how each ended.
async fn wait_until_ended(store: &dyn Store, runs: &[RunId]) -> BTreeMap<RunId, RunStatus> {
    let wanted: BTreeSet<&RunId> = runs.iter().collect();
    let started = Instant::now();
    loop {
        let ended: BTreeMap<RunId, RunStatus> = store
            .list_runs()
            .await
            .unwrap()
            .into_iter()
            .filter(|r| wanted.contains(&r.run_id) && r.status.is_terminal())
            .map(|r| (r.run_id, r.status))
            .collect();
        if ended.len() == runs.len() {
            return ended;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "{} of {} runs ended within {DEADLINE:?}",
            ended.len(),
            runs.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn session_events(store: &dyn Store, session: &SessionId) -> Vec<StoredEvent> {
    store.events_after(session, 0, 10_000).await.unwrap()
}

/// Checks one ended run: completed with `answer`, its steps `1..=steps` each recorded once and
/// announced by exactly one `step.committed`, its session's events dense. Returns which
/// process (lease owner) committed each step.
async fn check_run(store: &dyn Store, run: &RunId, steps: u64, answer: &str) -> Vec<String> {
    let state = store.load_state(run).await.unwrap();
    assert_eq!(
        (
            state.status,
            state.final_answer.as_deref(),
            state.step_index
        ),
        (RunStatus::Completed, Some(answer), steps),
        "{run}"
    );
    let recorded: Vec<u64> = store
        .steps(run)
        .await
        .unwrap()
        .iter()
        .map(|s| s.index)
        .collect();
    assert_eq!(
        recorded,
        (1..=steps).collect::<Vec<_>>(),
        "{run}: each step recorded once, none missing"
    );
    let events = session_events(store, &state.session_id).await;
    let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(
        seqs,
        (1..=events.len() as i64).collect::<Vec<_>>(),
        "{run}: dense seq"
    );
    let committed: Vec<&StoredEvent> = events
        .iter()
        .filter(|e| e.kind == "step.committed" && e.run_id.as_ref() == Some(run))
        .collect();
    let indexes: Vec<u64> = committed
        .iter()
        .map(|e| e.payload["step_index"].as_u64().unwrap())
        .collect();
    assert_eq!(
        indexes,
        (1..=steps).collect::<Vec<_>>(),
        "{run}: each step committed exactly once, in order"
    );
    committed
        .iter()
        .map(|e| e.payload["worker"].as_str().unwrap().to_owned())
        .collect()
}

/// No job is left in the outbox: nothing ready, nothing held.
async fn assert_outbox_empty(store: &dyn Store) {
    let stats = store.stats(i64::MAX).await.unwrap();
    assert_eq!((stats.ready_jobs, stats.held_jobs), (0, 0), "{stats:?}");
    assert!(store.runs_with_jobs().await.unwrap().is_empty());
}

/// `serve --workers 4` and two `worker --workers 4` on one database; 200 runs of five steps
/// (two tool batches, one of them a short sleep, and an answer) submitted through the API.
/// Every run completes, every step is committed exactly once, the outbox ends empty, more
/// than one process executed steps, and each process stops gracefully on SIGTERM.
async fn three_processes_share_the_work(db: &str) {
    const RUNS: usize = 200;
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(
        dir.path(),
        &json!({"replies": [
            {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 100}}]},
            {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]},
            {"text": "five"}
        ]}),
    );
    migrate(db);
    let (mut api, base) = serve(db, dir.path(), &script, "4");
    let mut first = worker("first worker", db);
    let mut second = worker("second worker", db);
    let owners = BTreeMap::from([
        (api.owner(), api.name),
        (first.owner(), first.name),
        (second.owner(), second.name),
    ]);
    assert_eq!(
        owners.len(),
        3,
        "each process has its own owner: {owners:?}"
    );

    let runs = submit_runs(&base, RUNS).await;
    let store = open(db);
    let ended = wait_until_ended(store.as_ref(), &runs).await;
    assert_eq!(ended.len(), RUNS);

    let mut steps_by_process: BTreeMap<&str, usize> = BTreeMap::new();
    for run in &runs {
        for owner in check_run(store.as_ref(), run, 5, "five").await {
            let process = owners
                .get(&owner)
                .unwrap_or_else(|| panic!("{run}: a step committed by unknown owner {owner}"));
            *steps_by_process.entry(process).or_default() += 1;
        }
    }
    assert_eq!(steps_by_process.values().sum::<usize>(), RUNS * 5);
    assert!(
        steps_by_process.len() > 1,
        "more than one process executed steps: {steps_by_process:?}"
    );
    assert_outbox_empty(store.as_ref()).await;

    for process in [&mut api, &mut first, &mut second] {
        let status = process.terminate();
        assert!(
            status.success(),
            "{} stops gracefully on SIGTERM ({status}):\n{}",
            process.name,
            process.log()
        );
    }
}

/// An API process (no workers) and worker A. Four runs each start a four-second tool call in
/// A; worker B starts (A alive, so B's start-up recovery frees nothing); A is killed with
/// SIGKILL. B takes the four tool steps over once A's leases expire and finishes the runs:
/// each step committed once, the tool steps by B, and the sleep's intent recorded twice —
/// once by A before it died, once by B.
async fn a_killed_worker_is_taken_over(db: &str) {
    const RUNS: usize = 4;
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(
        dir.path(),
        &json!({"replies": [
            {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 4000}}]},
            {"text": "rested"}
        ]}),
    );
    migrate(db);
    let (_api, base) = serve(db, dir.path(), &script, "0");
    let mut doomed = worker("worker A", db);
    let doomed_owner = doomed.owner();
    let runs = submit_runs(&base, RUNS).await;
    let store = open(db);

    // Every run is in A's tool call: A is the only process with workers, and the commit of a
    // run's model step leased its tools step to the same worker. (A replay-safe call's
    // `tool.call` is stored only with its step's commit, so the committed step tells.)
    let started = Instant::now();
    for run in &runs {
        while store.load_state(run).await.unwrap().step_index < 1 {
            assert!(started.elapsed() < DEADLINE, "{run} never called its tool");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let mut survivor = worker("worker B", db);
    let survivor_owner = survivor.owner();
    doomed.kill_9();

    let ended = wait_until_ended(store.as_ref(), &runs).await;
    assert!(
        ended.values().all(|s| *s == RunStatus::Completed),
        "{ended:?}"
    );
    for run in &runs {
        let committers = check_run(store.as_ref(), run, 3, "rested").await;
        assert_eq!(
            committers,
            [doomed_owner.as_str(), &survivor_owner, &survivor_owner],
            "{run}: A committed the model step; B the tool step A held, and the answer"
        );
        assert_eq!(
            store.intents(run, 2).await.unwrap(),
            [],
            "{run}: the replay-safe sleep wrote nothing ahead"
        );
        let session = store.load_state(run).await.unwrap().session_id;
        let calls = (session_events(store.as_ref(), &session).await.into_iter())
            .filter(|e| e.kind == "tool.call")
            .count();
        assert_eq!(
            calls, 1,
            "{run}: only the commit of B's attempt stored the sleep's call"
        );
    }
    assert_outbox_empty(store.as_ref()).await;
    assert!(survivor.terminate().success());
}

/// An event stream of process A (`serve --workers 0`) follows a run that worker B executes
/// over a few seconds: every event of the session, in `seq` order from 1 without a gap,
/// through `run.finished`, the same as the store holds; the steps were B's.
async fn events_cross_processes(db: &str) {
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(
        dir.path(),
        &json!({"replies": [
            {"text": "Let me add these numbers.", "chunk_delay_ms": 30,
             "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}},
                            {"name": "sleep_ms", "arguments": {"ms": 1500}}]},
            {"text": "The sum is five, as computed by another process.", "chunk_delay_ms": 30}
        ]}),
    );
    migrate(db);
    let (_api, base) = serve(db, dir.path(), &script, "0");
    let mut executor = worker("worker B", db);
    let executor_owner = executor.owner();
    let http = reqwest::Client::new();
    let session = create_session(&http, &base).await;
    let stream = http
        .get(format!("{base}/v1/sessions/{session}/events"))
        .send()
        .await
        .unwrap();
    assert!(stream.status().is_success());
    let run = send(&http, &base, &session, "add 2 and 3").await;

    let mut body = stream.bytes_stream();
    let mut text = String::new();
    let mut received: Vec<(i64, String, Value)> = Vec::new();
    // One deadline for the whole run: keep-alive comments must not extend it.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while received
        .last()
        .is_none_or(|(_, kind, _)| kind != "run.finished")
    {
        let chunk = tokio::time::timeout_at(deadline, body.next())
            .await
            .unwrap_or_else(|_| panic!("the stream stalled after {received:?}"))
            .expect("the stream ended")
            .unwrap();
        text.push_str(&String::from_utf8_lossy(&chunk));
        while let Some((frame, rest)) = text.split_once("\n\n") {
            let (mut id, mut kind, mut data) = (None, None, None);
            for line in frame.lines() {
                if let Some(value) = line.strip_prefix("id: ") {
                    id = Some(value.parse::<i64>().unwrap());
                } else if let Some(value) = line.strip_prefix("event: ") {
                    kind = Some(value.to_owned());
                } else if let Some(value) = line.strip_prefix("data: ") {
                    data = Some(serde_json::from_str::<Value>(value).unwrap());
                }
            }
            if let (Some(id), Some(kind), Some(data)) = (id, kind, data) {
                received.push((id, kind, data));
            }
            text = rest.to_owned();
        }
    }

    let seqs: Vec<i64> = received.iter().map(|(seq, _, _)| *seq).collect();
    assert_eq!(
        seqs,
        (1..=received.len() as i64).collect::<Vec<_>>(),
        "in order, no gap, no duplicate"
    );
    let (_, _, finished) = received.last().unwrap();
    assert_eq!(
        (&finished["run_id"], &finished["payload"]["status"]),
        (&json!(run), &json!("completed")),
        "{finished}"
    );
    let store = open(db);
    let stored = session_events(store.as_ref(), &SessionId::parse(&session).unwrap()).await;
    let streamed: Vec<(i64, &str)> = received.iter().map(|(s, k, _)| (*s, k.as_str())).collect();
    let kept: Vec<(i64, &str)> = stored.iter().map(|e| (e.seq, e.kind.as_str())).collect();
    assert_eq!(streamed, kept, "the stream is the session's stored events");
    let committers: BTreeSet<&str> = received
        .iter()
        .filter(|(_, kind, _)| kind == "step.committed")
        .map(|(_, _, data)| data["payload"]["worker"].as_str().unwrap())
        .collect();
    assert_eq!(
        committers,
        BTreeSet::from([executor_owner.as_str()]),
        "worker B executed every step"
    );
    for kind in ["assistant.delta", "tool.call", "tool.result"] {
        assert!(
            received.iter().any(|(_, k, _)| k == kind),
            "{kind} crossed processes"
        );
    }
}

/// One frame of an event stream: `id` is `None` for live activity.
#[derive(Debug)]
struct Frame {
    id: Option<i64>,
    kind: String,
    data: Value,
}

/// Reads frames from `body` until `last` holds for one (or, with `None`, until the stream
/// ends); comments and the `retry` frame are passed over.
async fn read_frames<Chunk: AsRef<[u8]>>(
    body: &mut (impl futures::Stream<Item = reqwest::Result<Chunk>> + Unpin),
    last: Option<&dyn Fn(&Frame) -> bool>,
) -> Vec<Frame> {
    let mut text = String::new();
    let mut frames: Vec<Frame> = Vec::new();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        while let Some((frame, rest)) = text.split_once("\n\n") {
            let (mut id, mut kind, mut data) = (None, None, None);
            for line in frame.lines() {
                if let Some(value) = line.strip_prefix("id: ") {
                    id = Some(value.parse::<i64>().unwrap());
                } else if let Some(value) = line.strip_prefix("event: ") {
                    kind = Some(value.to_owned());
                } else if let Some(value) = line.strip_prefix("data: ") {
                    data = Some(serde_json::from_str::<Value>(value).unwrap());
                }
            }
            text = rest.to_owned();
            if let (Some(kind), Some(data)) = (kind, data) {
                let frame = Frame { id, kind, data };
                let done = last.is_some_and(|last| last(&frame));
                frames.push(frame);
                if done {
                    return frames;
                }
            }
        }
        let chunk = tokio::time::timeout_at(deadline, body.next())
            .await
            .unwrap_or_else(|_| panic!("the stream stalled after {frames:?}"));
        match chunk {
            Some(chunk) => text.push_str(&String::from_utf8_lossy(chunk.unwrap().as_ref())),
            None if last.is_none() => return frames,
            None => panic!("the stream ended after {frames:?}"),
        }
    }
}

/// A stream following a session served by the process running its steps sees, between the
/// stored events, what each step is doing — `loading_context` and `calling_model` (naming the
/// model) before a model step commits, `executing_tools` (naming the batch's tools) before a
/// tools step commits — as events without an `id` and without a `seq`. The stored events it
/// sends are still `seq` 1, 2, 3… without a gap, and neither a replay (`follow=false`) nor a
/// reconnection with `Last-Event-ID` holds any activity: they are the stored events exactly.
async fn live_activity(db: &str) {
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(
        dir.path(),
        &json!({"replies": [
            {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}},
                            {"name": "sleep_ms", "arguments": {"ms": 300}},
                            {"name": "add", "arguments": {"a": 1, "b": 1}}]},
            {"text": "The sum is five.", "chunk_delay_ms": 30}
        ]}),
    );
    let model = format!("scripted:{}", script.display());
    migrate(db);
    let (_server, base) = serve(db, dir.path(), &script, "2");
    let http = reqwest::Client::new();
    let session = create_session(&http, &base).await;
    let path = format!("{base}/v1/sessions/{session}/events");
    let stream = http.get(&path).send().await.unwrap();
    assert!(stream.status().is_success());
    let run = send(&http, &base, &session, "add 2 and 3").await;
    let mut body = stream.bytes_stream();
    let followed = read_frames(&mut body, Some(&|f: &Frame| f.kind == "run.finished")).await;

    let mut seen: Vec<String> = Vec::new();
    for frame in &followed {
        match (&frame.id, frame.data.get("seq")) {
            (None, None) => {
                assert_eq!(
                    (
                        frame.kind.as_str(),
                        &frame.data["live"],
                        &frame.data["run_id"]
                    ),
                    ("activity", &json!(true), &json!(run)),
                    "{frame:?}"
                );
                let payload = &frame.data["payload"];
                let mut said = format!(
                    "{} {}",
                    payload["step_index"],
                    payload["activity"].as_str().unwrap()
                );
                if let Some(model) = payload.get("model") {
                    said = format!("{said} {}", model.as_str().unwrap());
                }
                if let Some(tools) = payload.get("tools") {
                    said = format!("{said} {tools}");
                }
                seen.push(said);
            }
            (Some(id), Some(seq)) if seq == &json!(id) => {
                if frame.kind == "step.committed" {
                    seen.push(format!("{} committed", frame.data["payload"]["step_index"]));
                }
            }
            _ => panic!("a stored event has its seq as its id, a live one neither: {frame:?}"),
        }
    }
    assert_eq!(
        seen,
        [
            "1 loading_context".to_owned(),
            format!("1 calling_model {model}"),
            "1 committed".to_owned(),
            r#"2 executing_tools ["add","sleep_ms"]"#.to_owned(),
            "2 committed".to_owned(),
            "3 loading_context".to_owned(),
            format!("3 calling_model {model}"),
            "3 committed".to_owned(),
        ],
        "each step's activity, in order, before its commit"
    );
    let stored_ids: Vec<i64> = followed.iter().filter_map(|f| f.id).collect();
    assert_eq!(
        stored_ids,
        (1..=stored_ids.len() as i64).collect::<Vec<_>>(),
        "the stored events are in order, without a gap: activity takes no seq"
    );

    let store = open(db);
    let stored = session_events(store.as_ref(), &SessionId::parse(&session).unwrap()).await;
    let kept: Vec<(i64, &str)> = stored.iter().map(|e| (e.seq, e.kind.as_str())).collect();
    let frames_of = |frames: &[Frame]| -> Vec<(i64, String)> {
        frames
            .iter()
            .map(|f| {
                (
                    f.id.expect("a replay holds stored events only"),
                    f.kind.clone(),
                )
            })
            .collect()
    };
    let replay = http
        .get(format!("{path}?follow=false"))
        .send()
        .await
        .unwrap();
    let replayed = frames_of(&read_frames(&mut replay.bytes_stream(), None).await);
    let owned = |events: &[(i64, &str)]| -> Vec<(i64, String)> {
        events.iter().map(|(s, k)| (*s, (*k).to_owned())).collect()
    };
    assert_eq!(replayed, owned(&kept), "a replay is the stored events");
    let middle = stored_ids[stored_ids.len() / 2];
    let resumed = http
        .get(format!("{path}?follow=false"))
        .header("Last-Event-ID", middle.to_string())
        .send()
        .await
        .unwrap();
    let resumed = frames_of(&read_frames(&mut resumed.bytes_stream(), None).await);
    let after: Vec<(i64, &str)> = kept.iter().copied().filter(|(s, _)| *s > middle).collect();
    assert_eq!(
        resumed,
        owned(&after),
        "a reconnection resumes after its stored cursor"
    );
    assert!(
        stored
            .iter()
            .all(|e| e.payload["activity"] != "calling_model"
                && e.payload["activity"] != "loading_context"
                && e.payload["activity"] != "executing_tools"),
        "activity is never stored"
    );
}

/// `bench steps --worker-processes N` leaves every step to `ratchet worker` processes and still
/// sees each run through to its end (it hears their steps through the database); over SQLite,
/// where it could not, it refuses at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_steps_runs_in_worker_processes() {
    let bench = |db: &str| {
        Command::new(BIN)
            .args([
                "bench",
                "steps",
                "--db",
                db,
                "--runs",
                "6",
                "--concurrency",
                "3",
            ])
            .args(["--turns", "1", "--worker-processes", "2", "--json"])
            .env_remove("RATCHET_DB")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let sqlite = sqlite().unwrap();
    let refused = bench(&sqlite.url).wait_with_output().unwrap();
    assert_eq!(refused.status.code(), Some(1));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("--worker-processes needs a database"),
        "{said}"
    );

    let Some(db) = postgres() else { return };
    let child = bench(&db.url);
    let bench_pid = child.id().to_string();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let figures: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(
        (&figures["steps"], &figures["worker_processes"]),
        (&json!(18), &json!(2)),
        "{figures}"
    );
    let store = open(&db.url);
    let mut pids = BTreeSet::new();
    for run in store.list_runs().await.unwrap() {
        for event in session_events(store.as_ref(), &run.session_id).await {
            if event.kind == "step.committed" {
                let owner = event.payload["worker"].as_str().unwrap_or_default();
                pids.insert(owner.split(':').nth(1).unwrap_or_default().to_owned());
            }
        }
    }
    assert!(
        !pids.is_empty() && pids.len() <= 2 && !pids.contains(&bench_pid),
        "every step was committed by one of the two worker processes, none by the benchmark \
         ({bench_pid}): {pids:?}"
    );
}
