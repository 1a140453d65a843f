//! The `ratchet` binary as a client of a real `ratchet serve` process: `run --server` keeps
//! the embedded run's output contract, `chat` answers piped lines and leaves at end of input,
//! `bench sse` reports its figures, and every failure (bad token, unreachable server,
//! options that do not apply) exits 1 with a clear message instead of a panic.
//!
//! Each test starts its own server on a free port with a scripted model and kills it (by its
//! PID) when the test ends, even when it fails.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::{free_port, output_within_deadline, report, stderr_of, stdout_of};
use serde_json::{Value, json};

/// How long a server gets to accept connections.
const STARTUP: Duration = Duration::from_secs(20);

/// Environment variables that would change what the binary does.
const RATCHET_VARS: [&str; 8] = [
    "RATCHET_DB",
    "RATCHET_LOG",
    "RATCHET_TOKEN",
    "RATCHET_LISTEN",
    "RATCHET_MODEL",
    "RATCHET_WORKSPACE",
    "RATCHET_MAX_STEPS",
    "RATCHET_TEST_SECRET",
];

fn command(dir: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ratchet"));
    command.current_dir(dir);
    for var in RATCHET_VARS {
        command.env_remove(var);
    }
    // Never send loopback traffic through a proxy the caller may have configured.
    command
        .env("NO_PROXY", "127.0.0.1")
        .env("no_proxy", "127.0.0.1");
    command
}

/// A `ratchet serve` process; killed by its PID when dropped.
struct Server {
    child: Child,
    url: String,
    log: PathBuf,
}

impl Server {
    /// Serves `dir/server.db` with `script` as the model and `dir` as the workspace.
    fn start(dir: &Path, script: &Value, extra: &[&str], env: &[(&str, &str)]) -> Server {
        std::fs::write(dir.join("server-script.json"), script.to_string()).unwrap();
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let log = dir.join("server.log");
        let db = format!("sqlite://{}", dir.join("server.db").display());
        let mut command = command(dir);
        command
            .args(["serve", "--listen", &listen, "--db", &db])
            .args(["--model", "scripted:server-script.json"])
            .args(["--workspace", &dir.display().to_string()])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(dir.join("server.err")).unwrap());
        for (key, value) in env {
            command.env(key, value);
        }
        let mut server = Server {
            child: command.spawn().expect("cannot start `ratchet serve`"),
            url: format!("http://{listen}"),
            log: dir.join("server.err"),
        };
        let started = Instant::now();
        while TcpStream::connect(&listen).is_err() {
            if let Some(status) = server.child.try_wait().unwrap() {
                panic!("ratchet serve exited {status}:\n{}", server.log());
            }
            assert!(
                started.elapsed() < STARTUP,
                "ratchet serve did not accept connections on {listen} within {STARTUP:?}:\n{}",
                server.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // `Child::kill` signals this child's PID (SIGKILL), nothing else.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `ratchet ARGS` in `dir` with `stdin` piped in, within the common deadline.
fn ratchet_with(dir: &Path, args: &[&str], stdin: &str, env: &[(&str, &str)]) -> Output {
    let mut command = command(dir);
    command.args(args);
    for (key, value) in env {
        command.env(key, value);
    }
    output_within_deadline(&mut command, stdin)
}

fn ratchet(dir: &Path, args: &[&str]) -> Output {
    ratchet_with(dir, args, "", &[])
}

/// Two tool round-trips, then an answer: 5 steps. One call per batch: the calls of a batch
/// run in parallel, so the order of their announcements is not fixed, and these tests
/// compare output byte for byte.
fn script() -> Value {
    json!({"replies": [
        {"text": "Adding.", "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]},
        {"text": "Now the total.", "tool_calls": [{"name": "add", "arguments": {"a": 5, "b": 9}}]},
        {"text": "The total is 14."}
    ]})
}

/// The embedded `ratchet run` with `script`, in its own directory.
fn embedded_run(dir: &Path, script: &Value, extra: &[&str]) -> Output {
    std::fs::write(dir.join("script.json"), script.to_string()).unwrap();
    let db = format!("sqlite://{}", dir.join("embedded.db").display());
    let workspace = dir.display().to_string();
    let mut args = vec![
        "run",
        "--db",
        &db,
        "--workspace",
        &workspace,
        "--model",
        "scripted:script.json",
    ];
    args.extend_from_slice(extra);
    ratchet(dir, &args)
}

#[test]
fn run_over_the_server_keeps_the_embedded_output_contract() {
    let served = tempfile::tempdir().unwrap();
    let embedded = tempfile::tempdir().unwrap();
    let server = Server::start(served.path(), &script(), &[], &[]);

    // JSON: one object, the same report but for the ids.
    let remote = ratchet(
        served.path(),
        &["run", "--server", &server.url, "--json", "add it all up"],
    );
    let local = embedded_run(embedded.path(), &script(), &["--json", "add it all up"]);
    assert_eq!(remote.status.code(), Some(0), "{}", stderr_of(&remote));
    assert_eq!(local.status.code(), Some(0), "{}", stderr_of(&local));
    let (remote_report, local_report) = (report(&remote), report(&local));
    for key in ["status", "stop_reason", "steps", "final_answer"] {
        assert_eq!(remote_report[key], local_report[key], "{key}");
    }
    assert_eq!(remote_report["final_answer"], "The total is 14.");
    assert_eq!(remote_report["steps"], 5);
    assert!(
        remote_report["run_id"]
            .as_str()
            .unwrap()
            .starts_with("run_")
    );
    assert!(
        remote_report["session_id"]
            .as_str()
            .unwrap()
            .starts_with("ses_")
    );
    // Progress streams on stderr in both modes, identically.
    assert_eq!(stderr_of(&remote), stderr_of(&local));

    // Text: the answer alone on stdout, the same progress on stderr.
    let remote = ratchet(
        served.path(),
        &["run", "--server", &server.url, "add it all up"],
    );
    let local = embedded_run(embedded.path(), &script(), &["add it all up"]);
    assert_eq!(remote.status.code(), Some(0), "{}", stderr_of(&remote));
    assert_eq!(remote.status.code(), local.status.code());
    assert_eq!(stdout_of(&remote), "The total is 14.\n");
    assert_eq!(stdout_of(&remote), stdout_of(&local));
    assert_eq!(stderr_of(&remote), stderr_of(&local));
    let progress = stderr_of(&remote);
    for line in [
        "Adding.",
        "  [call_0_0] add {\"a\":2,\"b\":3}",
        "  [call_0_0] -> 5",
        "Now the total.",
        "  [call_1_0] add {\"a\":5,\"b\":9}",
        "  [call_1_0] -> 14",
        "The total is 14.",
    ] {
        assert!(
            progress.lines().any(|l| l == line),
            "no line {line:?} in:\n{progress}"
        );
    }
}

#[test]
fn a_failed_run_over_the_server_exits_1_and_reports_like_the_embedded_run() {
    let served = tempfile::tempdir().unwrap();
    let embedded = tempfile::tempdir().unwrap();
    // Arguments the schema rejects, again and again: the run fails with `parse_failures`.
    let script = json!({"replies": [{"tool_calls": [{"name": "add", "arguments": {"a": "x"}}]}]});
    let server = Server::start(served.path(), &script, &[], &[]);
    let remote = ratchet(
        served.path(),
        &["run", "--server", &server.url, "add badly"],
    );
    let local = embedded_run(embedded.path(), &script, &["add badly"]);
    assert_eq!(remote.status.code(), Some(1), "{}", stderr_of(&remote));
    assert_eq!(local.status.code(), Some(1), "{}", stderr_of(&local));
    assert_eq!(stderr_of(&remote), stderr_of(&local));
    assert!(stderr_of(&remote).contains("invalid arguments for add"));
    // `RUN failed (parse_failures) after N steps`: the same but for the run's id.
    let without_id = |output: &Output| {
        let stdout = stdout_of(output);
        let (id, rest) = stdout.split_once(' ').unwrap();
        assert!(id.starts_with("run_"), "{stdout}");
        rest.to_owned()
    };
    assert_eq!(without_id(&remote), without_id(&local));
    assert!(
        without_id(&remote).starts_with("failed (parse_failures) after "),
        "{}",
        stdout_of(&remote)
    );
}

#[test]
fn chat_answers_piped_lines_and_leaves_at_end_of_input_or_quit() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &script(), &[], &[]);
    let output = ratchet_with(
        dir.path(),
        &["chat", "--server", &server.url],
        "add it all up\n\nand once more\n",
        &[],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr_of(&output));
    let stdout = stdout_of(&output);
    let turn = "Adding.\n  [call_0_0] add {\"a\":2,\"b\":3}\n  [call_0_0] -> 5\nNow the total.\n  \
                [call_1_0] add {\"a\":5,\"b\":9}\n  [call_1_0] -> 14\nThe total is 14.\n";
    // Both lines answered, in order, in one session; no prompt when stdin is not a terminal.
    assert_eq!(stdout, format!("{turn}{turn}"));

    let output = ratchet_with(
        dir.path(),
        &["chat", "--server", &server.url],
        "add it all up\n/quit\nnever sent\n",
        &[],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr_of(&output));
    assert_eq!(stdout_of(&output), turn);
}

#[test]
fn chat_remembers_an_earlier_message_of_its_session() {
    let dir = tempfile::tempdir().unwrap();
    let search = json!({"replies": [
        {"tool_calls": [{"name": "memory_search", "arguments": {"query": "zebra"}}]},
        {"text": "Searched."}
    ]});
    let server = Server::start(dir.path(), &search, &[], &[]);
    let output = ratchet_with(
        dir.path(),
        &["chat", "--server", &server.url],
        "the launch code is zebra seven\nwhat did I tell you before?\n",
        &[],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr_of(&output));
    let stdout = stdout_of(&output);
    let results: Vec<Value> = stdout
        .lines()
        .filter_map(|line| line.strip_prefix("  [call_0_0] -> "))
        .map(|result| serde_json::from_str(result).unwrap())
        .collect();
    assert_eq!(results.len(), 2, "one search per turn:\n{stdout}");
    // The second message does not say "zebra": only the first one can be found.
    let second = &results[1]["matches"];
    assert_eq!(second.as_array().map(Vec::len), Some(1), "{stdout}");
    assert_eq!(second[0]["role"], "user");
    assert_eq!(second[0]["text"], "the launch code is **zebra** seven");
    assert!(
        second[0].get("session_id").is_none(),
        "the hit is from the chat's own session: {second}"
    );
    assert_eq!(
        second[0]["run_id"], results[0]["matches"][0]["run_id"],
        "the first turn's run said it"
    );
}

#[test]
fn bench_sse_reports_delivery_as_one_json_line() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &script(), &[], &[]);
    let check = |output: &Output| {
        assert_eq!(output.status.code(), Some(0), "{}", stderr_of(output));
        let stdout = stdout_of(output);
        let last = stdout.lines().last().expect("bench printed nothing");
        let report: Value = serde_json::from_str(last)
            .unwrap_or_else(|e| panic!("last line is not JSON ({e}): {last:?}"));
        for key in ["events_per_s", "p50_ms", "p99_ms"] {
            assert!(report[key].as_f64().is_some(), "{key} in {report}");
        }
        assert_eq!(report["subscribers"], 10);
        assert_eq!(report["runs"], 2);
        // Every subscriber got every event of the session.
        let per_subscriber = report["events_per_subscriber"].as_u64().unwrap();
        assert!(per_subscriber > 2, "{report}");
        assert_eq!(report["events"].as_u64().unwrap(), 10 * per_subscriber);
        assert!(report["events_per_s"].as_f64().unwrap() > 0.0, "{report}");
    };
    check(&ratchet(
        dir.path(),
        &[
            "bench",
            "sse",
            "--server",
            &server.url,
            "--subscribers",
            "10",
            "--runs",
            "2",
            "--json",
        ],
    ));
    // Standalone: an in-process server.
    check(&ratchet(
        dir.path(),
        &[
            "bench",
            "sse",
            "--subscribers",
            "10",
            "--runs",
            "2",
            "--json",
        ],
    ));
}

/// The stalled mode builds the backlog it is asked for, holds clients that read nothing on it,
/// and reports the server's resident memory before, at the peak and after they leave.
#[test]
fn bench_sse_with_stalled_subscribers_reports_the_servers_memory() {
    let dir = tempfile::tempdir().unwrap();
    let output = ratchet(
        dir.path(),
        &[
            "bench",
            "sse",
            "--stalled-subscribers",
            "3",
            "--backlog-bytes",
            "2000000",
            "--json",
        ],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr_of(&output));
    let stdout = stdout_of(&output);
    let report: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(report["stalled_subscribers"], 3);
    assert!(
        report["backlog_bytes"].as_u64().unwrap() >= 2_000_000,
        "{report}"
    );
    let before = report["rss_before_mb"].as_f64().unwrap();
    let peak = report["rss_peak_mb"].as_f64().unwrap();
    assert!(before > 0.0 && peak >= before, "{report}");
    assert!(report["rss_after_mb"].as_f64().unwrap() > 0.0, "{report}");

    let refused = ratchet(
        dir.path(),
        &[
            "bench",
            "sse",
            "--server",
            "http://127.0.0.1:9",
            "--stalled-subscribers",
            "3",
            "--backlog-bytes",
            "1",
        ],
    );
    assert!(!refused.status.success());
    assert!(
        stderr_of(&refused).contains("needs --server-pid"),
        "{}",
        stderr_of(&refused)
    );
}

#[test]
fn a_bad_token_is_refused_with_the_servers_message() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("ratchet.toml"),
        "[[tokens]]\ntenant = \"acme\"\nenv = \"RATCHET_TEST_SECRET\"\n",
    )
    .unwrap();
    let server = Server::start(
        dir.path(),
        &script(),
        &["--config", "ratchet.toml"],
        &[("RATCHET_TEST_SECRET", "s3cret-token-of-acme")],
    );
    let url = server.url.as_str();
    let refused = |output: &Output, message: &str| {
        assert_eq!(output.status.code(), Some(1), "{}", stderr_of(output));
        let stderr = stderr_of(output);
        assert!(
            stderr.contains("401") && stderr.contains(message) && stderr.contains("--token"),
            "{stderr}"
        );
        assert_eq!(stdout_of(output), "");
    };
    refused(
        &ratchet(
            dir.path(),
            &["run", "--server", url, "--token", "wrong", "hi"],
        ),
        "unknown bearer token",
    );
    refused(
        &ratchet(dir.path(), &["run", "--server", url, "--json", "hi"]),
        "missing bearer token",
    );
    refused(
        &ratchet_with(
            dir.path(),
            &["chat", "--server", url],
            "hi\n",
            &[("RATCHET_TOKEN", "wrong")],
        ),
        "unknown bearer token",
    );
    refused(
        &ratchet(
            dir.path(),
            &[
                "bench",
                "sse",
                "--server",
                url,
                "--token",
                "wrong",
                "--subscribers",
                "2",
            ],
        ),
        "unknown bearer token",
    );
    // The right token, from the environment.
    let output = ratchet_with(
        dir.path(),
        &["run", "--server", url, "hi"],
        "",
        &[("RATCHET_TOKEN", "s3cret-token-of-acme")],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr_of(&output));
    assert_eq!(stdout_of(&output), "The total is 14.\n");
}

#[test]
fn an_unreachable_server_and_options_that_do_not_apply_fail_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let nobody = format!("http://127.0.0.1:{}", free_port());
    for args in [
        vec!["run", "--server", &nobody, "hi"],
        vec!["chat", "--server", &nobody],
        vec!["bench", "sse", "--server", &nobody, "--subscribers", "1"],
    ] {
        let output = ratchet_with(dir.path(), &args, "hi\n", &[]);
        assert_eq!(output.status.code(), Some(1), "{args:?}");
        let stderr = stderr_of(&output);
        assert!(
            stderr.contains(&format!("cannot reach the Ratchet server at {nobody}")),
            "{args:?}: {stderr}"
        );
    }
    for flag in [
        ["--model", "scripted:demo"],
        ["--workspace", "."],
        ["--max-steps", "3"],
        ["--memory-scope", "tenant"],
    ] {
        let output = ratchet(
            dir.path(),
            &["run", "--server", &nobody, flag[0], flag[1], "hi"],
        );
        assert_eq!(output.status.code(), Some(1));
        let stderr = stderr_of(&output);
        assert!(
            stderr.contains(&format!("{} cannot be used with --server", flag[0])),
            "{stderr}"
        );
    }
    let output = ratchet(dir.path(), &["run", "--server", "ftp://x", "hi"]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr_of(&output).contains("http://"),
        "{}",
        stderr_of(&output)
    );
    // Nothing was created on the way.
    assert!(!dir.path().join("ratchet.db").exists());
}

/// A server whose `ratchet.toml` guards `append_line` calls on `secret*` paths.
fn guarded_server(dir: &Path) -> Server {
    let config = "[tools.append_line]\napproval = { path = \"secret*\" }\n";
    std::fs::write(dir.join("ratchet.toml"), config).unwrap();
    let script = json!({"replies": [
        {"text": "Writing.", "tool_calls": [
            {"name": "append_line", "arguments": {"path": "secret.txt", "line": "s"}},
            {"name": "append_line", "arguments": {"path": "open.txt", "line": "o"}}
        ]},
        {"text": "Written."}
    ]});
    Server::start(dir, &script, &["--config", "ratchet.toml"], &[])
}

#[test]
fn run_and_chat_over_the_server_ask_at_the_prompt_when_a_batch_is_gated() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let server = guarded_server(dir);
    let args = ["run", "--server", &server.url, "--json", "write"];
    let output = ratchet_with(dir, &args, "y\n", &[]);
    let stderr = stderr_of(&output);
    assert!(output.status.success(), "{stderr}\n{}", server.log());
    assert_eq!(report(&output)["status"], "completed");
    assert!(
        stderr.contains("secret.txt") && stderr.contains("(needs approval)"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("secret.txt")).unwrap(),
        "s\n"
    );
    // Each call's events are shown once, even though the stream was followed twice.
    assert_eq!(
        stderr.matches("] append_line").count(),
        4,
        "two calls, two results: {stderr}"
    );

    let chat = ratchet_with(dir, &["chat", "--server", &server.url], "write\nn\n", &[]);
    let stdout = stdout_of(&chat);
    assert!(chat.status.success(), "{}", stderr_of(&chat));
    assert!(stdout.contains("denied by a human"), "{stdout}");
    assert!(stdout.contains("Written."), "{stdout}");
    for file in ["secret.txt", "open.txt"] {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        assert_eq!(
            text.lines().count(),
            1,
            "no call of the denied batch ran: {file}"
        );
    }

    let listed = ratchet(
        dir,
        &["approvals", "list", "--server", &server.url, "--json"],
    );
    assert!(listed.status.success(), "{}", stderr_of(&listed));
    let listed: Value = serde_json::from_slice(&listed.stdout).unwrap();
    let statuses: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, ["decided", "decided"]);
}

/// A server whose catalog's `boss` hands a task to `scribe`, whose `add` calls a person must
/// approve (a child is offered only tools that may be delegated, which `append_line` is not).
fn delegating_server(dir: &Path) -> Server {
    let agents = dir.join("agents");
    std::fs::create_dir_all(&agents).unwrap();
    let boss = json!({"replies": [
        {"tool_calls": [{"name": "delegate", "arguments": {"mode": "foreground", "tasks": [
            {"agent": "scribe", "task": "write it"}
        ]}}]},
        {"text": "The scribe is done."}
    ]});
    let scribe = json!({"replies": [
        {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]},
        {"text": "Written."}
    ]});
    for (id, script, front) in [
        ("boss", boss, "delegates: [scribe]"),
        ("scribe", scribe, "tools: [add]\napproval:\n  add: always"),
    ] {
        std::fs::write(agents.join(format!("{id}.json")), script.to_string()).unwrap();
        let definition = format!(
            "---\nid: {id}\ndescription: the {id}\nmodel: scripted:{id}.json\n{front}\n---\nYou are the {id}.\n"
        );
        std::fs::write(agents.join(format!("{id}.md")), definition).unwrap();
    }
    let unused = json!({"replies": [{"text": "no agent"}]});
    Server::start(dir, &unused, &["--agents", "agents"], &[])
}

/// The root run waits for its child, which waits for a person: `chat` and `run --server`
/// follow the whole tree, show the child's calls indented below its start and ask about the
/// child's approval at the prompt.
#[test]
fn chat_and_run_over_the_server_follow_a_delegation_and_ask_for_a_childs_approval() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let server = delegating_server(dir);
    let args = ["chat", "--server", &server.url, "--agent", "boss"];
    let chat = ratchet_with(dir, &args, "write it down\ny\n", &[]);
    let (stdout, stderr) = (stdout_of(&chat), stderr_of(&chat));
    assert!(chat.status.success(), "{stderr}\n{}", server.log());
    assert!(
        stderr.contains("approval apr_") && stderr.contains("[call_0_0] add {"),
        "the child's approval was asked at the prompt: {stderr}"
    );
    let lines: Vec<&str> = stdout.lines().collect();
    let started = (lines.iter())
        .position(|l| l.starts_with("  -> scribe run_") && l.ends_with(": write it"))
        .unwrap_or_else(|| panic!("no line tells of the child's start: {stdout}"));
    assert!(
        lines[started + 1].starts_with("    [call_0_0] add {"),
        "the child's call is indented below its start: {stdout}"
    );
    assert_eq!(lines[started + 2], "    [call_0_0] -> 5", "{stdout}");
    assert!(
        lines[started + 3].starts_with("  <- scribe run_")
            && lines[started + 3].ends_with(" completed"),
        "{stdout}"
    );
    assert!(
        !lines.contains(&"Written."),
        "the child's answer is its parent's tool result, not the chat's: {stdout}"
    );
    assert!(stdout.contains("The scribe is done."), "{stdout}");

    let args = [
        "run",
        "--server",
        &server.url,
        "--agent",
        "boss",
        "--json",
        "go",
    ];
    let run = ratchet_with(dir, &args, "y\n", &[]);
    let stderr = stderr_of(&run);
    assert!(run.status.success(), "{stderr}\n{}", server.log());
    assert_eq!(report(&run)["status"], "completed", "{stderr}");
    // (The prompt has no newline of its own when stdin is not a terminal.)
    assert!(stderr.contains("    [call_0_0] add {"), "{stderr}");
    assert!(stderr.contains("\n    [call_0_0] -> 5\n"), "{stderr}");

    let args = ["chat", "--server", &server.url, "--agent", "nobody"];
    let refused = ratchet_with(dir, &args, "hi\n", &[]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        stderr_of(&refused).contains("nobody"),
        "{}",
        stderr_of(&refused)
    );
}

/// `ratchet runs list|show --db` on the server's database, which must succeed.
fn server_runs(dir: &Path, args: &[&str]) -> Value {
    let db = format!("sqlite://{}", dir.join("server.db").display());
    let output = ratchet(dir, &[&["runs"], args, &["--db", &db, "--json"]].concat());
    assert!(output.status.success(), "{}", stderr_of(&output));
    serde_json::from_slice(&output.stdout).unwrap()
}

/// `runs cancel --server` acts through the API: a run whose tool keeps it busy is cancelled
/// (the tool is told to stop) and `ratchet run --server` following it ends with it; a
/// cancelled run's cancel is met already; a completed run's, or an unknown run's, is refused
/// with the reason.
#[test]
fn runs_cancel_works_through_a_server() {
    let dir = tempfile::tempdir().unwrap();
    // Every run sleeps first: long enough to be cancelled in, short enough to complete once.
    let script = json!({"replies": [
        {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 5000}}]},
        {"text": "Done."}
    ]});
    let server = Server::start(dir.path(), &script, &[], &[]);
    let answered = command(dir.path())
        .args([
            "run",
            "--server",
            &server.url,
            "--json",
            "sleep, then answer",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let completed = report(&answered);
    assert_eq!(completed["status"], "completed", "{completed}");
    let completed_id = completed["run_id"].as_str().unwrap().to_owned();

    let follower = command(dir.path())
        .args([
            "run",
            "--server",
            &server.url,
            "--json",
            "sleep, to be cancelled",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let run_id = loop {
        let runs = server_runs(dir.path(), &["list"]);
        let running = runs
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["status"] == "running");
        if let Some(run) = running {
            break run["run_id"].as_str().unwrap().to_owned();
        }
        assert!(started.elapsed() < STARTUP, "no run started");
        std::thread::sleep(Duration::from_millis(20));
    };
    let cancelled = ratchet(
        dir.path(),
        &["runs", "cancel", &run_id, "--server", &server.url],
    );
    assert!(cancelled.status.success(), "{}", stderr_of(&cancelled));
    assert_eq!(
        stdout_of(&cancelled),
        format!("{run_id} is cancelling: the step it is taking ends it\n")
    );
    let followed = follower.wait_with_output().unwrap();
    assert_eq!(followed.status.code(), Some(1), "{}", stderr_of(&followed));
    assert_eq!(report(&followed)["status"], "cancelled");
    assert_eq!(
        server_runs(dir.path(), &["show", &run_id])["status"],
        "cancelled"
    );
    let again = ratchet(
        dir.path(),
        &["runs", "cancel", &run_id, "--server", &server.url],
    );
    assert!(again.status.success(), "{}", stderr_of(&again));
    assert_eq!(stdout_of(&again), format!("{run_id} is cancelled\n"));

    let refused = ratchet(
        dir.path(),
        &["runs", "cancel", &completed_id, "--server", &server.url],
    );
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        stderr_of(&refused).contains(&format!(
            "cannot cancel run {completed_id}: it has already ended (completed)"
        )),
        "{}",
        stderr_of(&refused)
    );
    let unknown = ratchet(
        dir.path(),
        &["runs", "cancel", "run_unknown", "--server", &server.url],
    );
    assert_eq!(unknown.status.code(), Some(1));
    assert!(
        stderr_of(&unknown).contains("no run run_unknown"),
        "{}",
        stderr_of(&unknown)
    );
}

/// `runs pause|resume --server` act through the API: `ratchet run --server` following the
/// run stops when it pauses (exit 2), and the resumed run ends on the server.
#[test]
fn runs_pause_and_resume_work_through_a_server() {
    let dir = tempfile::tempdir().unwrap();
    let script = json!({"replies": [
        {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 800}}]},
        {"text": "Resumed."}
    ]});
    let server = Server::start(dir.path(), &script, &[], &[]);
    let follower = command(dir.path())
        .args(["run", "--server", &server.url, "--json", "sleep first"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let run_id = loop {
        let runs = server_runs(dir.path(), &["list"]);
        if let Some(run) = runs.as_array().unwrap().first() {
            break run["run_id"].as_str().unwrap().to_owned();
        }
        assert!(started.elapsed() < STARTUP, "no run started");
        std::thread::sleep(Duration::from_millis(20));
    };
    let paused = ratchet(
        dir.path(),
        &["runs", "pause", &run_id, "--server", &server.url],
    );
    assert!(paused.status.success(), "{}", stderr_of(&paused));
    assert!(stdout_of(&paused).contains(&run_id));
    let followed = follower.wait_with_output().unwrap();
    assert_eq!(followed.status.code(), Some(2), "{}", stderr_of(&followed));
    assert_eq!(report(&followed)["status"], "paused");

    let resumed = ratchet(
        dir.path(),
        &["runs", "resume", &run_id, "--server", &server.url],
    );
    assert!(resumed.status.success(), "{}", stderr_of(&resumed));
    assert_eq!(stdout_of(&resumed), format!("{run_id} is running again\n"));
    let started = Instant::now();
    while server_runs(dir.path(), &["show", &run_id])["status"] != "completed" {
        assert!(started.elapsed() < STARTUP, "the resumed run did not end");
        std::thread::sleep(Duration::from_millis(20));
    }
    let again = ratchet(
        dir.path(),
        &["runs", "resume", &run_id, "--server", &server.url],
    );
    assert_eq!(again.status.code(), Some(1));
    assert!(
        stderr_of(&again).contains("only a paused run can"),
        "the server's reason is shown: {}",
        stderr_of(&again)
    );
}
