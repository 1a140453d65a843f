//! Crash recovery with real processes: `ratchet run` is killed with SIGKILL at many points of
//! a slow run — mid model stream, mid tool batch, right after a commit — and `ratchet resume`
//! must finish the run with no step lost or repeated and no `never`-replay effect repeated.

use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_ratchet");
const DEADLINE: Duration = Duration::from_secs(60);
const FINAL_ANSWER: &str = "All done: the sum is 5.";

/// Four model calls and three tool batches (7 steps); every stream and batch is slow enough
/// to be killed in the middle of.
fn slow_script() -> Value {
    json!({"replies": [
        {"text": "Starting the job now, one careful step at a time.", "chunk_delay_ms": 40,
         "tool_calls": [
            {"name": "append_line", "arguments": {"path": "log.txt", "line": "first"}},
            {"name": "sleep_ms", "arguments": {"ms": 400}}]},
        {"text": "Now adding the numbers together for you.", "chunk_delay_ms": 40,
         "tool_calls": [
            {"name": "add", "arguments": {"a": 2, "b": 3}},
            {"name": "sleep_ms", "arguments": {"ms": 300}}]},
        {"text": "Recording the second line in the log.", "chunk_delay_ms": 40,
         "tool_calls": [{"name": "append_line", "arguments": {"path": "log.txt", "line": "second"}}]},
        {"text": FINAL_ANSWER, "chunk_delay_ms": 40}
    ]})
}

struct Sandbox {
    _dir: tempfile::TempDir,
    db: String,
    workspace: PathBuf,
    script: PathBuf,
}

impl Sandbox {
    fn new(script: &Value) -> Sandbox {
        let dir = tempfile::tempdir().unwrap();
        let workspace = dir.path().join("ws");
        std::fs::create_dir(&workspace).unwrap();
        let script_path = dir.path().join("script.json");
        std::fs::write(&script_path, script.to_string()).unwrap();
        let db = format!("sqlite://{}", dir.path().join("ratchet.db").display());
        Sandbox {
            _dir: dir,
            db,
            workspace,
            script: script_path,
        }
    }

    fn start_run(&self) -> (Child, Arc<Mutex<String>>) {
        self.start_run_with(&[])
    }

    fn start_run_with(&self, args: &[&str]) -> (Child, Arc<Mutex<String>>) {
        let mut child = Command::new(BIN)
            .args(["run", "--json", "--db", &self.db])
            .args(args)
            .arg("--model")
            .arg(format!("scripted:{}", self.script.display()))
            .arg("--workspace")
            .arg(&self.workspace)
            .arg("Write the log and add 2 and 3.")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let progress = Arc::new(Mutex::new(String::new()));
        let mut stderr = child.stderr.take().unwrap();
        let sink = Arc::clone(&progress);
        std::thread::spawn(move || {
            let mut buffer = [0u8; 1024];
            while let Ok(n) = stderr.read(&mut buffer) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buffer[..n]));
            }
        });
        (child, progress)
    }

    fn ratchet(&self, args: &[&str]) -> Output {
        Command::new(BIN)
            .args(args)
            .args(["--db", &self.db])
            .output()
            .unwrap()
    }

    fn show(&self, run_id: &str) -> Value {
        let out = self.ratchet(&["runs", "show", run_id, "--json"]);
        assert!(
            out.status.success(),
            "runs show failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    fn only_run_id(&self) -> String {
        let out = self.ratchet(&["runs", "list", "--json"]);
        let runs: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(runs.as_array().unwrap().len(), 1, "{runs}");
        runs[0]["run_id"].as_str().unwrap().to_owned()
    }

    /// `ratchet resume --json`, failing the test if it does not finish in time (a resume that
    /// hangs has run something it must not have).
    fn resume(&self) -> (Option<i32>, Vec<Value>) {
        let mut child = Command::new(BIN)
            .args(["resume", "--json", "--db", &self.db])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let started = Instant::now();
        while child.try_wait().unwrap().is_none() {
            if started.elapsed() > DEADLINE {
                child.kill().unwrap();
                panic!("ratchet resume did not finish within {DEADLINE:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "resume panicked: {stderr}");
        let lines = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}")))
            .collect();
        (out.status.code(), lines)
    }

    fn log_lines(&self) -> Vec<String> {
        std::fs::read_to_string(self.workspace.join("log.txt"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

fn wait_for(progress: &Mutex<String>, marker: &str, child: &mut Child) {
    let started = Instant::now();
    loop {
        if progress.lock().unwrap().contains(marker) {
            return;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "run exited ({status}) before {marker:?}; it printed: {}",
                progress.lock().unwrap()
            );
        }
        assert!(
            started.elapsed() < DEADLINE,
            "no {marker:?} within {DEADLINE:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Where to kill: after this text appears on the run's stderr, plus a delay.
struct KillPoint {
    marker: &'static str,
    delay_ms: u64,
    what: &'static str,
}

const KILL_POINTS: &[KillPoint] = &[
    KillPoint {
        marker: "Starting",
        delay_ms: 0,
        what: "first model stream",
    },
    KillPoint {
        marker: "[call_0_1] sleep_ms",
        delay_ms: 100,
        what: "first tool batch, append done, sleep running",
    },
    KillPoint {
        marker: "[call_0_1] ->",
        delay_ms: 0,
        what: "right after the first batch committed",
    },
    KillPoint {
        marker: "Now adding",
        delay_ms: 30,
        what: "second model stream",
    },
    KillPoint {
        marker: "[call_1_1] sleep_ms",
        delay_ms: 50,
        what: "second tool batch",
    },
    KillPoint {
        marker: "[call_1_1] ->",
        delay_ms: 5,
        what: "between the second batch and the third model call",
    },
    KillPoint {
        marker: "Recording",
        delay_ms: 0,
        what: "third model stream",
    },
    KillPoint {
        marker: "[call_2_0] append_line",
        delay_ms: 0,
        what: "at the second append_line",
    },
    KillPoint {
        marker: "[call_2_0] ->",
        delay_ms: 0,
        what: "right after the second append committed",
    },
    KillPoint {
        marker: "All done",
        delay_ms: 0,
        what: "final model stream",
    },
];

fn kill_and_resume(point: &KillPoint) {
    let sandbox = Sandbox::new(&slow_script());
    let (mut child, progress) = sandbox.start_run();
    wait_for(&progress, point.marker, &mut child);
    std::thread::sleep(Duration::from_millis(point.delay_ms));
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert_eq!(
        status.signal(),
        Some(9),
        "{}: the run ended by itself before the kill",
        point.what
    );

    let run_id = sandbox.only_run_id();
    let before = sandbox.show(&run_id);
    assert_eq!(
        before["status"], "running",
        "{}: killed mid-run: {before}",
        point.what
    );

    let (code, reports) = sandbox.resume();
    assert_eq!(
        reports.len(),
        1,
        "{}: one line per active run: {reports:?}",
        point.what
    );
    let report = &reports[0];
    assert_eq!(report["run_id"], run_id.as_str());
    let after = sandbox.show(&run_id);
    let indexes: Vec<u64> = after["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["index"].as_u64().unwrap())
        .collect();
    let expected: Vec<u64> = (1..=indexes.len() as u64).collect();
    assert_eq!(
        indexes, expected,
        "{}: steps are 1..n with no gap or duplicate",
        point.what
    );
    assert_eq!(after["step_index"].as_u64().unwrap(), indexes.len() as u64);
    assert!(
        indexes.len() as u64 >= before["step_index"].as_u64().unwrap(),
        "{}: no committed step was lost",
        point.what
    );
    let log = sandbox.log_lines();
    match report["status"].as_str().unwrap() {
        "completed" => {
            assert_eq!(code, Some(0));
            assert_eq!(report["final_answer"], FINAL_ANSWER, "{}", point.what);
            assert_eq!(report["steps"], 7, "{}: {report}", point.what);
            assert_eq!(
                log,
                ["first", "second"],
                "{}: each line exactly once",
                point.what
            );
        }
        "waiting_human" => {
            // The kill landed between an append_line's intent and its recorded outcome: its
            // effect is unknown, so it must not have been run again.
            assert_eq!(code, Some(2));
            assert_eq!(after["pending_human"]["kind"], "reconciliation", "{after}");
            assert_eq!(
                after["pending_human"]["calls"][0]["tool"], "append_line",
                "{after}"
            );
            for line in ["first", "second"] {
                assert!(
                    log.iter().filter(|l| *l == line).count() <= 1,
                    "{}: {line} at most once: {log:?}",
                    point.what
                );
            }
        }
        other => panic!("{}: resume left the run {other}: {report}", point.what),
    }
}

#[test]
fn runs_killed_at_any_point_resume_without_loss_or_repetition() {
    std::thread::scope(|scope| {
        let handles: Vec<_> = KILL_POINTS
            .iter()
            .map(|point| (point.what, scope.spawn(move || kill_and_resume(point))))
            .collect();
        let failures: Vec<String> = handles
            .into_iter()
            .filter_map(|(what, handle)| handle.join().err().map(|e| format!("{what}: {e:?}")))
            .collect();
        assert!(
            failures.is_empty(),
            "kill points that failed: {failures:#?}"
        );
    });
}

/// A `sleep_ms` of ten minutes, made a `never` tool by the configuration: the intent is
/// durable, the effect has begun and does not finish while the test runs. Two such calls run
/// in one parallel batch, beside a safe one. After a kill, resume must run none of them again
/// — a re-run would outlast the test's deadline — but wait for a human, and `runs show` must
/// name both calls in doubt.
#[test]
fn never_replay_calls_with_unknown_outcomes_wait_for_reconciliation() {
    let script = json!({"replies": [
        {"tool_calls": [
            {"name": "sleep_ms", "arguments": {"ms": 600000}},
            {"name": "add", "arguments": {"a": 1, "b": 1}},
            {"name": "sleep_ms", "arguments": {"ms": 600000}}
        ]},
        {"text": "done"}
    ]});
    let sandbox = Sandbox::new(&script);
    let config = sandbox.workspace.with_file_name("ratchet.toml");
    std::fs::write(&config, "[tools.sleep_ms]\nreplay = \"never\"\n").unwrap();
    let (mut child, progress) = sandbox.start_run_with(&["--config", config.to_str().unwrap()]);
    wait_for(&progress, "[call_0_0] sleep_ms", &mut child);
    wait_for(&progress, "[call_0_2] sleep_ms", &mut child);
    child.kill().unwrap();
    assert_eq!(child.wait().unwrap().signal(), Some(9));

    let (code, reports) = sandbox.resume();
    assert_eq!(code, Some(2), "waiting for a human exits 2: {reports:?}");
    assert_eq!(reports[0]["status"], "waiting_human");
    let run_id = reports[0]["run_id"].as_str().unwrap();
    let shown = sandbox.show(run_id);
    let request = &shown["pending_human"];
    assert_eq!(request["kind"], "reconciliation", "{shown}");
    let calls = request["calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2, "both calls in doubt are named: {request}");
    for (call, (index, id)) in calls.iter().zip([(0, "call_0_0"), (2, "call_0_2")]) {
        assert_eq!(call["tool"], "sleep_ms");
        assert_eq!(call["call_index"], index);
        assert_eq!(call["call_id"], id);
        assert_eq!(call["idempotency_key"], format!("{run_id}#2#{index}"));
    }
    let text = sandbox.ratchet(&["runs", "show", run_id]);
    let text = String::from_utf8_lossy(&text.stdout);
    for line in ["call #0 call_0_0: sleep_ms", "call #2 call_0_2: sleep_ms"] {
        assert!(text.contains(line), "{line:?} not in:\n{text}");
    }

    // A second resume finds nothing to do and leaves the run waiting.
    let (code, reports) = sandbox.resume();
    assert_eq!((code, reports.len()), (Some(0), 0), "{reports:?}");
    assert_eq!(sandbox.show(run_id)["status"], "waiting_human");

    // A human answers for each call in doubt; only then does the run go on, without running
    // either call again (a re-run would sleep past `resume`'s deadline).
    let reconcile = |call: &str, outcome: &str| {
        sandbox.ratchet(&[
            "runs",
            "reconcile",
            run_id,
            "--call",
            call,
            "--outcome",
            outcome,
        ])
    };
    let wrong = reconcile("call_0_1", "skip");
    assert_eq!(wrong.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&wrong.stderr);
    assert!(stderr.contains("awaiting: call_0_0, call_0_2"), "{stderr}");
    assert!(reconcile("call_0_0", "succeeded").status.success());
    assert_eq!(
        sandbox.show(run_id)["status"],
        "waiting_human",
        "call_0_2 is still in doubt"
    );
    assert!(reconcile("call_0_2", "skip").status.success());
    let (code, reports) = sandbox.resume();
    assert_eq!(code, Some(0), "{reports:?}");
    assert_eq!(reports[0]["status"], "completed");
    assert_eq!(reports[0]["final_answer"], "done");
    let shown = sandbox.show(run_id);
    let steps = shown["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 4, "model, doubt, batch, answer: {shown}");
    assert_eq!(
        steps[2]["instruction"], "call_tools_batch",
        "the batch ends through a tools step"
    );
    assert_eq!(
        steps[2]["summary"]["errors"], 1,
        "only the skipped call failed: {shown}"
    );
    assert_eq!(
        shown["counters"]["tool_calls"], 3,
        "all three results reached the model"
    );
}

#[test]
fn resume_of_an_idle_database_does_nothing_and_of_a_missing_one_fails() {
    let sandbox = Sandbox::new(&json!({"replies": [{"text": "hello"}]}));
    let path = Path::new(sandbox.db.trim_start_matches("sqlite://")).to_path_buf();
    let out = Command::new(BIN)
        .args(["resume", "--db", &sandbox.db])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("does not exist"),
        "{out:?}"
    );
    assert!(!path.exists(), "resume must not create a database");

    let (mut child, _) = sandbox.start_run();
    assert!(child.wait().unwrap().success());
    let (code, reports) = sandbox.resume();
    assert_eq!((code, reports.len()), (Some(0), 0), "{reports:?}");
}

/// `ratchet run` drives its own run only: a crashed run in the same database waits for
/// `resume` instead of being taken over (and its effects replayed) by an unrelated command.
#[test]
fn run_leaves_other_runs_in_the_database_alone() {
    let sandbox = Sandbox::new(&slow_script());
    let (mut child, progress) = sandbox.start_run();
    // Killed mid model stream, with no `never` effect in doubt, so that resume completes.
    wait_for(&progress, "Now adding", &mut child);
    child.kill().unwrap();
    child.wait().unwrap();
    let crashed = sandbox.only_run_id();
    // As if the dead process's lease had run out: the crashed run's job is free for anyone.
    let db = rusqlite::Connection::open(sandbox.db.trim_start_matches("sqlite://")).unwrap();
    let freed = db
        .execute("UPDATE step_jobs SET lease_owner = NULL, ready_at = 0", [])
        .unwrap();
    assert_eq!(freed, 1);
    let before = sandbox.show(&crashed);
    let lines_before = sandbox.log_lines();

    let out = Command::new(BIN)
        .args([
            "run",
            "--json",
            "--db",
            &sandbox.db,
            "--model",
            "scripted:demo",
        ])
        .arg("--workspace")
        .arg(&sandbox.workspace)
        .arg("What is 2 + 3?")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let after = sandbox.show(&crashed);
    assert_eq!(after["status"], "running");
    assert_eq!(
        after["step_index"], before["step_index"],
        "the crashed run was not driven"
    );
    assert_eq!(sandbox.log_lines(), lines_before, "no effect was replayed");

    let (code, reports) = sandbox.resume();
    assert_eq!(code, Some(0), "{reports:?}");
    assert_eq!(reports[0]["run_id"], crashed.as_str());
    assert_eq!(sandbox.log_lines(), ["first", "second"]);
}
