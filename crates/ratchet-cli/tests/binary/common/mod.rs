//! What the `ratchet` binary's integration tests share: running the binary with a deadline,
//! and picking a free local port.

use std::io::{Read, Write};

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Far longer than any test run needs; only a hung binary reaches it.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// The key `serve` seals webhook secrets with in tests whose database may be PostgreSQL
/// (which needs a configured key; SQLite makes its own).
#[allow(dead_code, reason = "only the tests that may serve PostgreSQL set it")]
pub const SECRETS_KEY: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

/// Runs `command` with `stdin` piped in and its output captured; kills it and fails the test
/// if it outlives `DEADLINE`, so a driver that never notices its run ended cannot hang the
/// suite. No invocation may panic.
#[allow(dead_code, reason = "not every test binary runs the CLI to completion")]
pub fn output_within_deadline(command: &mut Command, stdin: &str) -> Output {
    let described = format!("{command:?}");
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cannot start the ratchet binary");
    let mut input = child.stdin.take().unwrap();
    let stdin = stdin.to_owned();
    let feeder = std::thread::spawn(move || {
        let _ = input.write_all(stdin.as_bytes());
        // Dropping `input` closes the pipe: the child sees end of input.
    });
    // Drain both pipes on their own threads so a chatty child never blocks on a full pipe.
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            pipe.read_to_end(&mut bytes).map(|_| bytes)
        })
    };
    let stdout = drain(Box::new(child.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{described} did not exit within {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    feeder.join().unwrap();
    let output = Output {
        status,
        stdout: stdout.join().unwrap().unwrap(),
        stderr: stderr.join().unwrap().unwrap(),
    };
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !stderr.contains("panicked"),
        "{described} panicked:\n{stderr}"
    );
    output
}

/// A port nobody listens on right now (another process could still take it before use).
#[allow(dead_code, reason = "not every test binary starts a server")]
/// Sends `request` and reads its answer's body as JSON; panics if either fails.
pub async fn json_of(request: reqwest::RequestBuilder) -> serde_json::Value {
    let response = request.send().await.unwrap();
    response.json().await.unwrap()
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[allow(dead_code, reason = "not every test binary reads output")]
pub fn stdout_of(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).unwrap()
}

#[allow(dead_code, reason = "not every test binary reads output")]
pub fn stderr_of(output: &Output) -> String {
    String::from_utf8(output.stderr.clone()).unwrap()
}

/// The report of `run --json`: stdout must hold exactly one JSON object with exactly the
/// documented keys, and nothing else.
#[allow(dead_code, reason = "not every test binary runs `run --json`")]
pub fn report(output: &Output) -> serde_json::Value {
    let stdout = stdout_of(output);
    let values: Vec<serde_json::Value> = serde_json::Deserializer::from_str(&stdout)
        .into_iter()
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {stdout:?}"));
    assert_eq!(
        values.len(),
        1,
        "expected one JSON value on stdout: {stdout:?}"
    );
    let mut keys: Vec<&str> = values[0]
        .as_object()
        .unwrap_or_else(|| panic!("expected a JSON object: {stdout:?}"))
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "final_answer",
            "run_id",
            "session_id",
            "status",
            "steps",
            "stop_reason"
        ]
    );
    values[0].clone()
}

/// A fresh database, kept alive (the file's directory, the server's database) for the test's
/// duration.
#[allow(
    dead_code,
    reason = "only the multi-process test binaries use databases this way"
)]
pub struct Database {
    pub url: String,
    _dir: Option<tempfile::TempDir>,
    _server: Option<ratchet_postgres::testkit::TestDatabase>,
}

/// A new SQLite file. The tests that use it kill processes, not the machine: it spares the
/// disk the fsyncs.
#[allow(
    dead_code,
    reason = "only the multi-process test binaries use databases this way"
)]
pub fn sqlite() -> Option<Database> {
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "sqlite://{}?synchronous=normal",
        dir.path().join("ratchet.db").display()
    );
    Some(Database {
        url,
        _dir: Some(dir),
        _server: None,
    })
}

/// A database of its own on the server `RATCHET_TEST_POSTGRES_URL` names; `None` (the test
/// says it is skipped) without one, outside CI.
#[allow(
    dead_code,
    reason = "only the multi-process test binaries use databases this way"
)]
pub fn postgres() -> Option<Database> {
    let server = ratchet_postgres::testkit::TestDatabase::create()?;
    Some(Database {
        url: server.url().to_owned(),
        _dir: None,
        _server: Some(server),
    })
}

/// The store of a test database, as the processes under test share it.
pub fn open_store(url: &str) -> std::sync::Arc<dyn ratchet_store::Store> {
    if url.starts_with("sqlite:") {
        return std::sync::Arc::new(ratchet_sqlite::open_url(url).unwrap());
    }
    std::sync::Arc::new(ratchet_postgres::open_url(url).unwrap())
}
