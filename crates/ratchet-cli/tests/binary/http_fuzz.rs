//! The HTTP API fuzzed by schemathesis against a real `ratchet serve`: requests generated from
//! the server's own `/openapi.json`, valid and invalid, and every answer checked against that
//! document with every check schemathesis has — no 5xx; only documented status codes, content
//! types, headers and bodies; every request the document allows accepted, every one it
//! forbids refused.
//!
//! The server is seeded first (a session whose run completed after an approval, and one whose
//! run waits for approval), and schemathesis is told those ids, so that requests reach real
//! sessions, runs and approvals as well as made-up ones. Event streams are asked for with
//! `follow=false` where schemathesis lets a parameter be fixed; the requests it makes
//! without it follow the stream, and are read for half a second (a following stream never
//! ends by itself).
//!
//! Schemathesis is a Python program: `scripts/test` installs the version
//! `.ci/requirements.txt` pins and names it in `RATCHET_SCHEMATHESIS`. Without that variable the test says it is
//! skipped, and fails in CI (`CI=true`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{DEADLINE, free_port};
use futures::StreamExt;
use ratchet_llm::sse::{SseEvent, SseParser};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_ratchet");
const SCHEMATHESIS: &str = "RATCHET_SCHEMATHESIS";
/// Test cases per operation and phase: a run takes about two minutes on two cores.
const MAX_EXAMPLES: &str = "50";
/// A fixed seed, so that a failure can be reproduced; a new seed explores further.
const SEED: &str = "20261130";
/// The whole schemathesis run, far beyond what it needs.
const FUZZ_DEADLINE: Duration = Duration::from_secs(600);

/// The schemathesis executable, or `None` (and why) when the test is to be skipped.
fn schemathesis() -> Option<PathBuf> {
    let in_ci = std::env::var("CI").is_ok_and(|value| value == "true");
    match std::env::var_os(SCHEMATHESIS) {
        Some(path) => Some(PathBuf::from(path)),
        None => {
            assert!(
                !in_ci,
                "{SCHEMATHESIS} must be set in CI to the schemathesis executable (.ci/run installs it)"
            );
            eprintln!(
                "skipped: set {SCHEMATHESIS} to a schemathesis executable \
                 (pip install -r .ci/requirements.txt) to fuzz the HTTP API"
            );
            None
        }
    }
}

struct Server {
    child: Child,
    base: String,
    log: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// `ratchet serve` on a fresh SQLite file, with the scripted model: each run asks to
    /// `add`, which always needs approval, then answers.
    fn start(dir: &Path) -> Server {
        let script = dir.join("script.json");
        let replies = json!({"replies": [
            {"text": "Let me add.", "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]},
            {"text": "The sum is 5."}
        ]});
        std::fs::write(&script, replies.to_string()).unwrap();
        let config = dir.join("ratchet.toml");
        std::fs::write(&config, "[tools.add]\napproval = \"always\"\n").unwrap();
        let log = dir.join("serve.log");
        let port = free_port();
        let child = Command::new(BIN)
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .arg("--db")
            .arg(format!("sqlite://{}", dir.join("ratchet.db").display()))
            .arg("--model")
            .arg(format!("scripted:{}", script.display()))
            .arg("--workspace")
            .arg(dir)
            .arg("--config")
            .arg(&config)
            .env("RATCHET_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Server {
            child,
            base: format!("http://127.0.0.1:{port}"),
            log,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Waits until `/readyz` answers 200.
    async fn ready(&self, http: &reqwest::Client) {
        let started = Instant::now();
        loop {
            let ready = http.get(self.url("/readyz")).send().await;
            if ready.is_ok_and(|r| r.status().is_success()) {
                return;
            }
            assert!(
                started.elapsed() < DEADLINE,
                "ratchet serve was not ready within {DEADLINE:?}:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn post(&self, http: &reqwest::Client, path: &str, body: Value) -> Value {
        let response = http.post(self.url(path)).json(&body).send().await.unwrap();
        let status = response.status();
        let body: Value = response.json().await.unwrap();
        assert!(status.is_success(), "POST {path}: {status} {body}");
        body
    }

    /// A new session with one message; returns the session and the message's run.
    async fn message(&self, http: &reqwest::Client) -> (String, String) {
        let session = self.post(http, "/v1/sessions", json!({})).await["id"]
            .as_str()
            .unwrap()
            .to_owned();
        let path = format!("/v1/sessions/{session}/messages");
        let accepted = self.post(http, &path, json!({"content": "add"})).await;
        (session, accepted["run_id"].as_str().unwrap().to_owned())
    }
}

/// A run's event stream, read event by event.
struct Events {
    body: futures::stream::BoxStream<'static, reqwest::Result<Vec<u8>>>,
    parser: SseParser,
    pending: std::collections::VecDeque<SseEvent>,
}

impl Events {
    async fn open(server: &Server, http: &reqwest::Client, run: &str) -> Events {
        let response = http
            .get(server.url(&format!("/v1/runs/{run}/events")))
            .send()
            .await
            .unwrap();
        assert!(response.status().is_success(), "{}", response.status());
        Events {
            body: response
                .bytes_stream()
                .map(|chunk| chunk.map(|c| c.to_vec()))
                .boxed(),
            parser: SseParser::default(),
            pending: Default::default(),
        }
    }

    /// The data of the first event of `kind` (earlier ones are passed over).
    async fn until(&mut self, kind: &str) -> Value {
        let found = tokio::time::timeout(DEADLINE, async {
            loop {
                while let Some(event) = self.pending.pop_front() {
                    if event.event == kind {
                        return serde_json::from_str::<Value>(&event.data).unwrap();
                    }
                }
                let chunk = self.body.next().await.expect("the stream ended").unwrap();
                self.pending.extend(self.parser.feed(&chunk));
            }
        });
        found
            .await
            .unwrap_or_else(|_| panic!("no {kind} event within {DEADLINE:?}"))
    }
}

/// Ids that exist, for schemathesis to use beside the ones it makes up.
struct Seeded {
    sessions: Vec<String>,
    runs: Vec<String>,
    approvals: Vec<String>,
}

/// One run that completed after its approval, and one that waits for approval.
async fn seed(server: &Server, http: &reqwest::Client) -> Seeded {
    let mut seeded = Seeded {
        sessions: Vec::new(),
        runs: Vec::new(),
        approvals: Vec::new(),
    };
    for answer in [true, false] {
        let (session, run) = server.message(http).await;
        let mut events = Events::open(server, http, &run).await;
        let required = events.until("approval.required").await;
        let approval = required["payload"]["approval_id"]
            .as_str()
            .unwrap()
            .to_owned();
        if answer {
            let decision = json!({"decisions": [{"call_id": "call_0_0", "decision": "approve"}]});
            let path = format!("/v1/approvals/{approval}");
            server.post(http, &path, decision).await;
            let finished = events.until("run.finished").await;
            assert_eq!(finished["payload"]["status"], "completed", "{finished}");
        }
        seeded.sessions.push(session);
        seeded.runs.push(run);
        seeded.approvals.push(approval);
    }
    seeded
}

/// Schemathesis's configuration: the seeded ids as dictionaries each id parameter draws from
/// (most of the time; otherwise it makes one up), and event streams that end.
fn configuration(seeded: &Seeded) -> String {
    let list = |ids: &[String]| serde_json::to_string(ids).unwrap();
    format!(
        r#"[dictionaries.sessions]
values = {sessions}
[dictionaries.runs]
values = {runs}
[dictionaries.approvals]
values = {approvals}
[dictionaries.calls]
values = ["call_0_0"]

[[operations]]
include-path-regex = "^/v1/sessions/"
parameters = {{ "path.id" = {{ dictionary = "sessions", probability = 0.7 }} }}

[[operations]]
include-path-regex = "^/v1/runs/"
parameters = {{ "path.id" = {{ dictionary = "runs", probability = 0.7 }}, "body.call_id" = {{ dictionary = "calls", probability = 0.5 }} }}

[[operations]]
include-path-regex = "^/v1/approvals/"
parameters = {{ "path.id" = {{ dictionary = "approvals", probability = 0.7 }}, "body.decisions[*].call_id" = {{ dictionary = "calls", probability = 0.7 }} }}

[[operations]]
include-path-regex = "/events$"
request-timeout = 0.5
parameters = {{ "query.follow" = "false" }}

# A cursor is valid only as the server issued it (a sessions cursor only for the order it was
# issued in): no schema can say which strings those are, so a made-up one is refused with 400
# however well it fits the document's `string`.
[[operations]]
include-name = ["GET /v1/sessions", "GET /v1/sessions/{{id}}/messages", "GET /v1/sessions/{{id}}/runs", "GET /v1/sessions/{{id}}/inbox", "GET /v1/runs/{{id}}/steps", "GET /v1/approvals", "GET /v1/webhooks/{{id}}/deliveries", "GET /v1/runs/{{id}}/tree/events", "GET /v1/schedules", "GET /v1/schedules/{{id}}/runs"]
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409", "429"]

# What these accept depends on the server's state and configuration, not on the shape of the
# request: an agent must be in the catalog, a webhook's destination allowed by the server's
# policy, an approval's decisions name the calls of that approval, a schedule's cron and time
# zone must be real ones. And every POST takes an `Idempotency-Key`: one the fuzzer sends again
# with another request is refused, 422. Anything else is 422 too.
[[operations]]
include-method = ["POST", "PATCH"]
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "403", "404", "409", "422", "429"]

# A keyed `POST /v1/sessions` sent again answers with the session its key first created, which
# the fuzzer may have deleted since: a 404 for it afterwards is right.
[checks.ensure_resource_availability]
enabled = false
"#,
        sessions = list(&seeded.sessions),
        runs = list(&seeded.runs),
        approvals = list(&seeded.approvals),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_answer_that_breaks_the_documented_api() {
    let Some(schemathesis) = schemathesis() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    server.ready(&http).await;
    let seeded = seed(&server, &http).await;
    let config = dir.path().join("schemathesis.toml");
    std::fs::write(&config, configuration(&seeded)).unwrap();

    let mut command = tokio::process::Command::new(&schemathesis);
    command
        .arg("--config-file")
        .arg(&config)
        .args(["run", &server.url("/openapi.json")])
        .args(["--checks", "all"])
        .args(["--mode", "all"])
        .args(["--max-examples", MAX_EXAMPLES])
        .args(["--seed", SEED])
        .args(["--request-timeout", "5"])
        .args(["--generation-database", "none"])
        .arg("--no-color")
        .current_dir(dir.path())
        .kill_on_drop(true);
    let output = tokio::time::timeout(FUZZ_DEADLINE, command.output())
        .await
        .unwrap_or_else(|_| panic!("schemathesis did not finish within {FUZZ_DEADLINE:?}"))
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", schemathesis.display()));
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "schemathesis found failures ({}):\n{report}\n--- ratchet serve's log ---\n{}",
        output.status,
        server.log_text()
    );
    assert!(
        report.contains("passed"),
        "schemathesis tested nothing:\n{report}"
    );
    eprintln!("{report}");
}
