//! `ratchet serve` as a real process: a SIGTERM stops it gracefully — event streams end, the
//! step in flight still commits, the process exits 0 — and `ratchet resume` finishes the run;
//! a SIGHUP reloads its catalog and configuration, or keeps them when the new ones have
//! problems; a webhook attempt cut short by a SIGKILL is made again by the next process; and
//! webhook secrets are kept sealed under a key that can be rotated.

use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::{DEADLINE, free_port};
use futures::StreamExt;
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_ratchet");

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

fn start(dir: &std::path::Path, db: &str, script: &std::path::Path) -> Server {
    let port = free_port();
    let child = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--db",
            db,
        ])
        .arg("--model")
        .arg(format!("scripted:{}", script.display()))
        .arg("--workspace")
        .arg(dir)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            started.elapsed() < DEADLINE,
            "ratchet serve did not listen on {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Server {
        child,
        base: format!("http://127.0.0.1:{port}"),
    }
}

impl Server {
    /// Opens a session and sends `content`; returns the session and the message's run.
    async fn send_in_new_session(&self, http: &reqwest::Client, content: &str) -> (String, String) {
        let session = json(
            http.post(format!("{}/v1/sessions", self.base))
                .json(&json!({}))
                .send()
                .await
                .unwrap(),
        )
        .await;
        let session = session["id"].as_str().unwrap().to_owned();
        let run = self.send(http, &session, content).await;
        (session, run)
    }

    async fn send(&self, http: &reqwest::Client, session: &str, content: &str) -> String {
        let sent = http
            .post(format!("{}/v1/sessions/{session}/messages", self.base))
            .json(&json!({"content": content}))
            .send()
            .await
            .unwrap();
        json(sent).await["run_id"].as_str().unwrap().to_owned()
    }
}

/// What an event stream carries while a batch runs: its live activity (a replay-safe call's
/// `tool.call` is stored only with its step's commit).
const RUNNING_TOOLS: &str = r#""activity":"executing_tools""#;

/// Reads an event stream until `marker` has gone by.
async fn read_until<S, B, E>(body: &mut S, marker: &str)
where
    S: futures::Stream<Item = Result<B, E>> + Unpin,
    B: AsRef<[u8]>,
    E: std::fmt::Debug,
{
    let mut seen = String::new();
    while !seen.contains(marker) {
        let chunk = tokio::time::timeout(DEADLINE, body.next())
            .await
            .expect("stream stalled")
            .expect("stream ended")
            .unwrap();
        seen.push_str(&String::from_utf8_lossy(chunk.as_ref()));
    }
}

async fn json(response: reqwest::Response) -> Value {
    let status = response.status();
    let body: Value = response.json().await.unwrap();
    assert!(status.is_success(), "{status}: {body}");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_the_step_in_flight_commit_and_ends_event_streams() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("script.json");
    let replies = json!({"replies": [
        {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 1500}}]},
        {"text": "rested"}
    ]});
    std::fs::write(&script, replies.to_string()).unwrap();
    let db = format!("sqlite://{}", dir.path().join("r.db").display());
    let mut server = start(dir.path(), &db, &script);
    let http = reqwest::Client::new();
    let (session, run) = server.send_in_new_session(&http, "take a rest").await;
    let stream = http
        .get(format!("{}/v1/sessions/{session}/events", server.base))
        .send()
        .await
        .unwrap();
    assert!(stream.status().is_success());
    let mut body = stream.bytes_stream();
    // Wait until the tool call is running: the live activity of its batch is on the stream.
    read_until(&mut body, RUNNING_TOOLS).await;
    let terminated = Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()
        .unwrap();
    assert!(terminated.success());

    // The event stream ends instead of holding the shutdown up.
    let ended = tokio::time::timeout(DEADLINE, async {
        while let Some(chunk) = body.next().await {
            if chunk.is_err() {
                break;
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the event stream did not end on shutdown");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "ratchet serve did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "graceful shutdown exits 0: {status}");

    let show = Command::new(BIN)
        .args(["runs", "show", &run, "--json", "--db", &db])
        .output()
        .unwrap();
    let shown: Value = serde_json::from_slice(&show.stdout).unwrap();
    assert_eq!(
        shown["step_index"], 2,
        "the tool batch in flight committed during the grace period: {shown}"
    );
    assert_eq!(
        shown["status"], "running",
        "no new step was started: {shown}"
    );

    let resumed = Command::new(BIN)
        .args(["resume", "--json", "--db", &db])
        .output()
        .unwrap();
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    let report: Value =
        serde_json::from_slice(resumed.stdout.split(|b| *b == b'\n').next().unwrap()).unwrap();
    assert_eq!(report["status"], "completed");
    assert_eq!(report["final_answer"], "rested");
}

#[test]
fn without_tokens_the_server_refuses_to_listen_beyond_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("r.db").display());
    let out = Command::new(BIN)
        .args(["serve", "--listen", "0.0.0.0:0", "--db", &db])
        .arg("--workspace")
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("refusing to listen on 0.0.0.0:0 without authentication"),
        "{stderr}"
    );
    assert!(!dir.path().join("r.db").exists(), "nothing was opened");

    let config = dir.path().join("ratchet.toml");
    std::fs::write(
        &config,
        "[[tokens]]\ntenant = \"acme\"\nenv = \"RATCHET_TEST_UNSET_TOKEN\"\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--listen", "0.0.0.0:0", "--db", &db, "--config"])
        .arg(&config)
        .env_remove("RATCHET_TEST_UNSET_TOKEN")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("RATCHET_TEST_UNSET_TOKEN is not set"),
        "{stderr}"
    );
}

/// A run keeps the configuration it started with: restarting the server with another model
/// changes new runs only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_with_another_model_does_not_change_a_running_run() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, script: Value| {
        let path = dir.path().join(name);
        std::fs::write(&path, script.to_string()).unwrap();
        path
    };
    let before = write(
        "before.json",
        json!({"replies": [
            {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 600}}]},
            {"text": "answer of the first model"}
        ]}),
    );
    let after = write(
        "after.json",
        json!({"replies": [{"text": "answer of the second model"}]}),
    );
    let db = format!("sqlite://{}", dir.path().join("r.db").display());
    let http = reqwest::Client::new();

    let mut first = start(dir.path(), &db, &before);
    let (session, old_run) = first.send_in_new_session(&http, "old run").await;
    // Stop the first server while the run sleeps in its tool batch.
    let stream = http
        .get(format!("{}/v1/runs/{old_run}/events", first.base))
        .send()
        .await
        .unwrap();
    let mut body = stream.bytes_stream();
    read_until(&mut body, RUNNING_TOOLS).await;
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    drop(body);

    let second = start(dir.path(), &db, &after);
    let new_run = second.send(&http, &session, "new run").await;
    let completed = |r: &Value| r["status"] == "completed";
    let old = run_until(&http, &second.base, &old_run, completed).await;
    assert_eq!(old["final_answer"], "answer of the first model", "{old}");
    let new = run_until(&http, &second.base, &new_run, completed).await;
    assert_eq!(new["final_answer"], "answer of the second model", "{new}");
}

async fn post(http: &reqwest::Client, url: String) -> Value {
    json(http.post(url).json(&json!({})).send().await.unwrap()).await
}

/// Polls a run until `done` says so; returns the run.
async fn run_until(
    http: &reqwest::Client,
    base: &str,
    run: &str,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let started = Instant::now();
    loop {
        let state = json(
            http.get(format!("{base}/v1/runs/{run}"))
                .send()
                .await
                .unwrap(),
        )
        .await;
        if done(&state) {
            return state;
        }
        assert!(started.elapsed() < DEADLINE, "run {run}: {state}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A pause is a fact in the database: one asked for while a tool runs survives the server
/// being SIGKILLed (the step is taken again and its commit pauses the run), a paused run
/// stays paused, holding its session, across another SIGKILL, and resumes to its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_survives_sigkill_and_the_paused_run_resumes_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("script.json");
    let replies = json!({"replies": [
        {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 600}}]},
        {"text": "resumed to the end"}
    ]});
    std::fs::write(&script, replies.to_string()).unwrap();
    let db = format!("sqlite://{}", dir.path().join("r.db").display());
    let http = reqwest::Client::new();

    let mut first = start(dir.path(), &db, &script);
    let (session, run) = first.send_in_new_session(&http, "sleep, then answer").await;
    let stream = http
        .get(format!("{}/v1/runs/{run}/events", first.base))
        .send()
        .await
        .unwrap();
    let mut body = stream.bytes_stream();
    read_until(&mut body, RUNNING_TOOLS).await;
    let pausing = post(&http, format!("{}/v1/runs/{run}/pause", first.base)).await;
    assert_eq!(pausing["status"], "pausing", "{pausing}");
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    drop(body);

    let mut second = start(dir.path(), &db, &script);
    let paused = run_until(&http, &second.base, &run, |r| r["status"] != "running").await;
    assert_eq!(
        (&paused["status"], &paused["step_index"]),
        (&json!("paused"), &json!(2)),
        "the step taken again committed, and its commit paused the run: {paused}"
    );
    let queued = second.send(&http, &session, "after the pause").await;
    second.child.kill().unwrap();
    second.child.wait().unwrap();

    let third = start(dir.path(), &db, &script);
    let still = run_until(&http, &third.base, &run, |_| true).await;
    assert_eq!(still["status"], "paused", "{still}");
    let waiting = run_until(&http, &third.base, &queued, |_| true).await;
    assert_eq!(
        waiting["status"], "queued",
        "the paused run still holds its session"
    );
    let resumed = post(&http, format!("{}/v1/runs/{run}/resume", third.base)).await;
    assert_eq!(resumed["status"], "running");
    let done = run_until(&http, &third.base, &run, |r| r["status"] == "completed").await;
    assert_eq!(
        (&done["final_answer"], &done["step_index"]),
        (&json!("resumed to the end"), &json!(3))
    );
    run_until(&http, &third.base, &queued, |r| r["status"] == "completed").await;
}

/// `ratchet serve` with `args` after its listen address, its stderr collected line by line.
fn start_watched(args: &[&str]) -> (Server, Stderr) {
    let port = free_port();
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(args)
        .env_remove("RATCHET_LOG")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = Stderr::default();
    let pipe = std::io::BufReader::new(child.stderr.take().unwrap());
    let collected = Arc::clone(&stderr.0);
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(pipe).map_while(Result::ok) {
            collected.lock().unwrap().lines.push(line);
        }
        collected.lock().unwrap().closed = true;
    });
    let server = Server {
        child,
        base: format!("http://127.0.0.1:{port}"),
    };
    stderr.wait_for(0, |line| line.starts_with("ratchet listening on"));
    (server, stderr)
}

#[derive(Default)]
struct Stderr(Arc<Mutex<Lines>>);

#[derive(Default, Clone)]
struct Lines {
    lines: Vec<String>,
    /// The process closed its stderr: it has ended.
    closed: bool,
}

impl Stderr {
    fn len(&self) -> usize {
        self.0.lock().unwrap().lines.len()
    }

    /// The first line from the `from`th on that `wanted` accepts.
    fn wait_for(&self, from: usize, wanted: impl Fn(&str) -> bool) -> String {
        let started = Instant::now();
        loop {
            let Lines { lines, closed } = self.0.lock().unwrap().clone();
            if let Some(line) = lines.iter().skip(from).find(|l| wanted(l)) {
                return line.clone();
            }
            assert!(!closed, "ratchet serve ended; its stderr: {lines:#?}");
            assert!(
                started.elapsed() < DEADLINE,
                "no such line on stderr: {lines:#?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn hang_up(server: &Server) {
    let sent = Command::new("kill")
        .args(["-HUP", &server.child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
}

async fn agents_of(http: &reqwest::Client, base: &str) -> Value {
    json(http.get(format!("{base}/v1/agents")).send().await.unwrap()).await["items"].clone()
}

fn definition(id: &str, model: &str, tools: &str) -> String {
    format!(
        "---\nid: {id}\ndescription: The {id}.\nmodel: {model}\ntools: [{tools}]\n---\nYou are the {id}.\n"
    )
}

/// SIGHUP reads the catalog and the configuration again: a valid catalog replaces the old
/// one whole, settings that need a restart are named, and a catalog with problems is
/// rejected — every problem on stderr and in the 422 of `POST /v1/admin/reload` — while the
/// process stays up with the catalog it had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_a_valid_catalog_and_keeps_the_old_one_when_the_new_one_has_problems() {
    let dir = tempfile::tempdir().unwrap();
    let catalog = dir.path().join("agents");
    std::fs::create_dir(&catalog).unwrap();
    let write = |name: &str, text: &str| std::fs::write(catalog.join(name), text).unwrap();
    write("writer.md", &definition("writer", "scripted:demo", "add"));
    let config = dir.path().join("ratchet.toml");
    std::fs::write(&config, "poll_ms = 50\n").unwrap();
    let db = format!("sqlite://{}", dir.path().join("r.db").display());
    let (mut server, stderr) = start_watched(&[
        "--db",
        &db,
        "--config",
        config.to_str().unwrap(),
        "--agents",
        catalog.to_str().unwrap(),
        "--workspace",
        dir.path().to_str().unwrap(),
    ]);
    let http = reqwest::Client::new();
    let before = agents_of(&http, &server.base).await;
    assert_eq!(before.as_array().unwrap().len(), 1, "{before}");

    write(
        "writer.md",
        &definition("writer", "scripted:demo", "add, now"),
    );
    write("editor.md", &definition("editor", "scripted:demo", "now"));
    std::fs::write(&config, "poll_ms = 60\n").unwrap();
    let seen = stderr.len();
    hang_up(&server);
    let line = stderr.wait_for(seen, |l| l.starts_with("reload"));
    assert_eq!(
        line,
        "reloaded with 2 agents (editor, writer), model scripted:demo; changed but in force \
         only after a restart: poll_ms"
    );
    let reloaded = agents_of(&http, &server.base).await;
    let ids: Vec<&str> = (reloaded.as_array().unwrap().iter())
        .map(|a| a["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["editor", "writer"], "{reloaded}");
    assert_ne!(
        reloaded[1]["hash"], before[0]["hash"],
        "the writer's new definition is active"
    );
    assert_eq!(reloaded[1]["tools"], json!(["add", "now"]), "{reloaded}");

    write(
        "writer.md",
        &definition("writer", "scripted:demo", "add, rm_rf"),
    );
    write("editor.md", &definition("editor", "no-such-profile", "now"));
    let seen = stderr.len();
    hang_up(&server);
    let line = stderr.wait_for(seen, |l| l.starts_with("reload"));
    assert!(
        line.starts_with("reload rejected, the previous configuration stays active (2 problems): "),
        "{line}"
    );
    let editor = format!(
        "{}:4: model \"no-such-profile\"",
        catalog.join("editor.md").display()
    );
    let writer = format!(
        "{}:5: unknown tool \"rm_rf\"",
        catalog.join("writer.md").display()
    );
    assert!(line.contains(&editor) && line.contains(&writer), "{line}");
    assert!(
        server.child.try_wait().unwrap().is_none(),
        "a SIGHUP does not end the process"
    );
    assert_eq!(agents_of(&http, &server.base).await, reloaded);

    let answer = http
        .post(format!("{}/v1/admin/reload", server.base))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::UNPROCESSABLE_ENTITY);
    let body: Value = answer.json().await.unwrap();
    let problems = body["error"]["problems"].as_array().unwrap();
    assert_eq!(problems.len(), 2, "{body}");
    assert!(problems[0].as_str().unwrap().starts_with(&editor), "{body}");
    assert!(problems[1].as_str().unwrap().starts_with(&writer), "{body}");
    assert_eq!(agents_of(&http, &server.base).await, reloaded);
}

/// What a webhook receiver in the test heard: the attempts that arrived (delivery ids), and
/// the events it accepted, in order.
#[derive(Default)]
struct Heard {
    arrived: Vec<i64>,
    accepted: Vec<(i64, i64, String)>,
    bad_signatures: usize,
}

const WEBHOOK_SECRET: &str = "a-secret-the-test-knows";

/// A receiver that never answers its first request and accepts every later one.
async fn start_receiver(heard: Arc<Mutex<Heard>>) -> String {
    async fn receive(
        axum::extract::State(heard): axum::extract::State<Arc<Mutex<Heard>>>,
        headers: axum::http::HeaderMap,
        body: String,
    ) -> axum::http::StatusCode {
        let delivery: Value = serde_json::from_str(&body).unwrap();
        let id = delivery["delivery_id"].as_i64().unwrap();
        let first = {
            let mut heard = heard.lock().unwrap();
            heard.arrived.push(id);
            heard.arrived.len() == 1
        };
        if first {
            std::future::pending::<()>().await;
        }
        let signature = headers
            .get(ratchet_webhooks::SIGNATURE_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        let mut heard = heard.lock().unwrap();
        if !ratchet_webhooks::verify_signature(WEBHOOK_SECRET, signature, &body) {
            heard.bad_signatures += 1;
        }
        let event = &delivery["event"];
        heard.accepted.push((
            id,
            event["seq"].as_i64().unwrap(),
            event["kind"].as_str().unwrap().to_owned(),
        ));
        axum::http::StatusCode::OK
    }
    let app = axum::Router::new()
        .route("/hook", axum::routing::post(receive))
        .with_state(heard);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{address}/hook")
}

/// A webhook attempt in flight when its server is SIGKILLed is made again by the next
/// process once its lease has expired, under the same delivery id; the receiver then gets
/// every event of the session once, in `seq` order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_attempt_cut_short_by_sigkill_is_made_again_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("script.json");
    let replies = json!({"replies": [
        {"text": "Let me add.", "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]},
        {"text": "The sum is 5."}
    ]});
    std::fs::write(&script, replies.to_string()).unwrap();
    let config = dir.path().join("ratchet.toml");
    std::fs::write(
        &config,
        "[webhooks]\ntimeout_ms = 1000\nretry_backoff_ms = 50\n",
    )
    .unwrap();
    let db = format!("sqlite://{}", dir.path().join("r.db").display());
    let model = format!("scripted:{}", script.display());
    let args = [
        "--db",
        &db,
        "--model",
        &model,
        "--config",
        config.to_str().unwrap(),
    ];
    let heard = Arc::new(Mutex::new(Heard::default()));
    let url = start_receiver(Arc::clone(&heard)).await;
    let http = reqwest::Client::new();

    let (mut first, _) = start_watched(&args);
    let webhook = post_json(
        &http,
        format!("{}/v1/webhooks", first.base),
        json!({"url": url, "secret": WEBHOOK_SECRET}),
    )
    .await;
    let webhook = webhook["id"].as_str().unwrap().to_owned();
    let (session, run) = first.send_in_new_session(&http, "add two and three").await;
    let started = Instant::now();
    while heard.lock().unwrap().arrived.is_empty() {
        assert!(started.elapsed() < DEADLINE, "no attempt arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first.child.kill().unwrap();
    first.child.wait().unwrap();

    let (second, _) = start_watched(&args);
    run_until(&http, &second.base, &run, |r| r["status"] == "completed").await;
    let log = loop {
        let page = json(
            http.get(format!(
                "{}/v1/webhooks/{webhook}/deliveries?limit=200",
                second.base
            ))
            .send()
            .await
            .unwrap(),
        )
        .await;
        let items = page["items"].as_array().unwrap().clone();
        if !items.is_empty()
            && items.iter().all(|d| d["status"] == "delivered")
            && items.last().unwrap()["event_kind"] == "run.finished"
        {
            break items;
        }
        assert!(started.elapsed() < DEADLINE, "deliveries: {items:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    let heard = heard.lock().unwrap();
    let seqs: Vec<i64> = heard.accepted.iter().map(|(_, seq, _)| *seq).collect();
    assert_eq!(
        seqs,
        (1..=log.len() as i64).collect::<Vec<_>>(),
        "session {session}: every event once, in seq order"
    );
    assert_eq!(heard.bad_signatures, 0);
    let cut_short = heard.arrived[0];
    assert_eq!(
        heard.accepted[0].0, cut_short,
        "the attempt cut short was made again under its delivery id"
    );
    assert_eq!(log[0]["id"], cut_short);
    assert_eq!(log[0]["attempts"], 2, "{:#?}", log[0]);
    assert!(
        log[1..].iter().all(|d| d["attempts"] == 1),
        "nothing else was attempted twice: {log:#?}"
    );
    // Both processes sealed and opened the secret with the key the first one made.
    assert!(
        !database_files_contain(dir.path(), WEBHOOK_SECRET),
        "the secret is in the database in clear"
    );
    assert!(dir.path().join("r.db.key").is_file());
}

/// Whether any file of the directory but the key file holds `text`.
fn database_files_contain(dir: &std::path::Path, text: &str) -> bool {
    std::fs::read_dir(dir).unwrap().any(|entry| {
        let path = entry.unwrap().path();
        path.extension().is_none_or(|e| e != "key")
            && std::fs::read(&path)
                .unwrap()
                .windows(text.len())
                .any(|w| w == text.as_bytes())
    })
}

/// `serve` without a key on SQLite makes one beside the database (owner-only) and says so;
/// a process given another key refuses to start rather than lose the secrets sealed with the
/// first, until the first is given as a previous key: then it seals them again under the new
/// one, after which the old key is not needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_secrets_stay_sealed_across_a_rotation_of_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("r.db").display());
    let key_file = dir.path().join("r.db.key");
    let http = reqwest::Client::new();

    let (first, stderr) = start_watched(&["--db", &db]);
    let made = stderr.wait_for(0, |line| line.starts_with("made the key that seals"));
    assert!(made.contains(&key_file.display().to_string()), "{made}");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key_file).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
    post_json(
        &http,
        format!("{}/v1/webhooks", first.base),
        json!({"url": "https://hooks.example.com/x", "secret": WEBHOOK_SECRET}),
    )
    .await;
    drop(first);
    assert!(!database_files_contain(dir.path(), WEBHOOK_SECRET));

    let old_key = std::fs::read_to_string(&key_file)
        .unwrap()
        .trim()
        .to_owned();
    let new_key = "ff".repeat(32);
    let serve = |env: &[(&str, &str)]| {
        let mut command = Command::new(BIN);
        command
            .args(["serve", "--listen", &format!("127.0.0.1:{}", free_port())])
            .args(["--db", &db])
            .env_remove("RATCHET_SECRETS_KEY")
            .env_remove("RATCHET_SECRETS_PREVIOUS_KEYS");
        for (name, value) in env {
            command.env(name, value);
        }
        command
    };
    let refused =
        crate::common::output_within_deadline(&mut serve(&[("RATCHET_SECRETS_KEY", &new_key)]), "");
    assert!(!refused.status.success());
    let said = crate::common::stderr_of(&refused);
    assert!(
        said.contains("cannot seal the webhook secrets under the current key")
            && said.contains("which is not one of this process's keys")
            && said.contains("previous_key_files"),
        "{said}"
    );

    let mut rotating = serve(&[
        ("RATCHET_SECRETS_KEY", &new_key),
        ("RATCHET_SECRETS_PREVIOUS_KEYS", &old_key),
    ]);
    let mut child = rotating.stderr(Stdio::piped()).spawn().unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stderr.take().unwrap()));
    let sealed = lines.next().unwrap().unwrap();
    assert!(
        sealed.starts_with("sealed 1 webhook secrets under key "),
        "{sealed}"
    );
    child.kill().unwrap();
    child.wait().unwrap();

    std::fs::remove_file(&key_file).unwrap();
    let mut with_new_only = serve(&[("RATCHET_SECRETS_KEY", &new_key)]);
    let mut child = with_new_only.stderr(Stdio::piped()).spawn().unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stderr.take().unwrap()));
    let listening = lines.next().unwrap().unwrap();
    assert!(listening.starts_with("ratchet listening on"), "{listening}");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A database on a server is shared by processes that may not share a disk: `serve` needs
/// a configured key for it, and says how to give one, before it connects.
#[test]
fn serve_on_postgresql_without_a_key_refuses_to_start() {
    let output = crate::common::output_within_deadline(
        Command::new(BIN)
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(["--db", "postgres://nobody@127.0.0.1:1/none"])
            .env_remove("RATCHET_SECRETS_KEY"),
        "",
    );
    assert!(!output.status.success());
    let said = crate::common::stderr_of(&output);
    assert!(
        said.contains("needs a key") && said.contains("RATCHET_SECRETS_KEY"),
        "{said}"
    );
}

async fn post_json(http: &reqwest::Client, url: String, body: Value) -> Value {
    json(http.post(url).json(&body).send().await.unwrap()).await
}

/// The security settings of `ratchet.toml` reach the server `ratchet serve` starts: a host
/// named in `[server] allowed_hosts` is answered and another is refused with 421, and a tenant
/// past `[limits] max_streams_per_tenant` gets 429 until its stream closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_configured_host_names_and_stream_caps_hold_in_a_started_server() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ratchet.toml");
    std::fs::write(
        &config,
        "[server]\nallowed_hosts = [\"agents.example\"]\n\n[limits]\nmax_streams_per_tenant = 1\n",
    )
    .unwrap();
    let db = format!("sqlite://{}", dir.path().join("r.db").display());
    let (server, _stderr) = start_watched(&[
        "--db",
        &db,
        "--config",
        config.to_str().unwrap(),
        "--model",
        "scripted:demo",
    ]);
    let http = reqwest::Client::new();
    let sessions = format!("{}/v1/sessions", server.base);
    let named = |host: &str| http.get(&sessions).header("host", host).send();
    assert_eq!(named("agents.example").await.unwrap().status(), 200);
    let refused = named("elsewhere.example").await.unwrap();
    assert_eq!(refused.status(), 421);
    let body: Value = refused.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("allowed_hosts")),
        "{body}"
    );

    let session = json(http.post(&sessions).json(&json!({})).send().await.unwrap()).await;
    let events = format!("{sessions}/{}/events", session["id"].as_str().unwrap());
    let first = http.get(&events).send().await.unwrap();
    assert_eq!(first.status(), 200);
    let second = http.get(&events).send().await.unwrap();
    assert_eq!(second.status(), 429, "one stream per tenant is configured");
    let body: Value = second.json().await.unwrap();
    assert_eq!(body["error"]["code"], "too_many_streams", "{body}");
    drop(first);
    let started = Instant::now();
    loop {
        let again = http.get(&events).send().await.unwrap();
        if again.status() == 200 {
            break;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "the closed stream's place never came back: {}",
            again.status()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
