//! `ratchet serve` as a real process: a SIGTERM stops it gracefully — event streams end, the
//! step in flight still commits, the process exits 0 — and `ratchet resume` finishes the run.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{DEADLINE, free_port};
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
    // Wait until the tool call is running: its announcement is on the stream.
    read_until(&mut body, "event: tool.call").await;
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
    read_until(&mut body, "event: tool.call").await;
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
    read_until(&mut body, "event: tool.call").await;
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
