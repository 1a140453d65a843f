//! Fault injection at every commit boundary (feature `failpoints`). A `ratchet run` is made to
//! fail at exactly one failpoint — outside a transaction its process aborts there (SIGABRT:
//! no destructor, no graceful stop, as with `kill -9`); inside the commit transaction the
//! transaction fails — and the run must still end correct: after `ratchet resume` when the
//! process died, in the same process when only the transaction failed. Correct means no step
//! lost or repeated (steps 1..n, each `step.committed` once), the `never`-replay `append_line`
//! effects each exactly once, tool results in call order, one reply per model call, the final
//! answer and one stop reason. Each scenario runs on SQLite and, when
//! `RATCHET_TEST_POSTGRES_URL` names a server, on PostgreSQL.

#![cfg(feature = "failpoints")]

use std::collections::BTreeSet;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

use crate::common::{Database, output_within_deadline, postgres, sqlite};
use ratchet_core::{AgentState, Message, Role, RunStatus, StepRecord, StopReason};
use ratchet_store::{IntentRecord, Store, StoredEvent};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_ratchet");
const SIGABRT: i32 = 6;
const FINAL_ANSWER: &str = "All done: the sum is 5.";
/// Four model calls and three tool batches: seven steps.
const STEPS: u64 = 7;
/// Every tool call of the script, in the order its result must reach the model.
const CALLS: [&str; 4] = ["call_0_0", "call_0_1", "call_1_0", "call_2_0"];

/// Every reply streams for longer than the engine's 100 ms between stored deltas, so a model
/// call stores deltas before its reply is complete. In the first batch, `append_line` is done
/// long before `sleep_ms`.
fn replies() -> Value {
    json!({"replies": [
        {"text": "Starting the job now, one careful step at a time.", "chunk_delay_ms": 20,
         "tool_calls": [
            {"name": "append_line", "arguments": {"path": "log.txt", "line": "first"}},
            {"name": "sleep_ms", "arguments": {"ms": 300}}]},
        {"text": "Now adding the two numbers together for you.", "chunk_delay_ms": 20,
         "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]},
        {"text": "Recording the second line in the log file now.", "chunk_delay_ms": 20,
         "tool_calls": [{"name": "append_line", "arguments": {"path": "log.txt", "line": "second"}}]},
        {"text": FINAL_ANSWER, "chunk_delay_ms": 20}
    ]})
}

/// One failpoint and what firing it must lead to.
struct Case {
    failpoint: &'static str,
    /// Its `FAILPOINTS` actions: which hit fires.
    actions: &'static str,
    recovery: Recovery,
}

enum Recovery {
    /// The process aborts at the failpoint with `committed` steps durable and `log` written
    /// to the workspace; `at_crash` checks what else the database must show then. `ratchet
    /// resume` finishes the run.
    Resume {
        committed: u64,
        log: &'static [&'static str],
        at_crash: fn(&Snapshot),
    },
    /// The commit of step `step` fails once and keeps nothing; the same process gives the
    /// step back, runs it again and finishes the run.
    Retry { step: u64 },
}

/// Failpoints of keyed requests, fired by `idempotency.rs` (a keyed message, not a run).
const TESTED_ELSEWHERE: [&str; 2] = ["request.before_commit", "request.before_response"];

const CASES: &[Case] = &[
    Case {
        failpoint: "step.before_commit",
        actions: "1*off->return",
        recovery: Recovery::Resume {
            committed: 1,
            log: &["first"],
            at_crash: the_first_batch_ran_in_full,
        },
    },
    Case {
        failpoint: "step.after_commit",
        actions: "5*off->return",
        recovery: Recovery::Resume {
            committed: 6,
            log: &["first", "second"],
            at_crash: step_six_is_committed_and_its_next_job_waits,
        },
    },
    Case {
        failpoint: "commit.before_outbox",
        actions: "1*off->1*return",
        recovery: Recovery::Retry { step: 2 },
    },
    Case {
        failpoint: "commit.after_outbox",
        actions: "1*off->1*return",
        recovery: Recovery::Retry { step: 2 },
    },
    Case {
        failpoint: "tools.between_calls",
        actions: "return",
        recovery: Recovery::Resume {
            committed: 1,
            log: &["first"],
            at_crash: the_first_call_has_its_outcome_and_the_second_none,
        },
    },
    Case {
        failpoint: "events.publish",
        actions: "1*off->return",
        recovery: Recovery::Resume {
            committed: 2,
            log: &["first"],
            at_crash: step_two_is_committed,
        },
    },
    Case {
        failpoint: "model.mid_stream",
        actions: "return",
        recovery: Recovery::Resume {
            committed: 0,
            log: &[],
            at_crash: deltas_are_stored_but_no_reply,
        },
    },
];

macro_rules! scenarios {
    ($backend:ident) => {
        mod $backend {
            #[test]
            fn a_crash_before_a_step_commits_reuses_the_outcomes_its_batch_recorded() {
                super::inject(super::$backend(), "step.before_commit");
            }

            #[test]
            fn a_crash_right_after_a_commit_leaves_the_next_step_to_resume() {
                super::inject(super::$backend(), "step.after_commit");
            }

            #[test]
            fn a_commit_failing_before_its_outbox_write_is_retried_in_process() {
                super::inject(super::$backend(), "commit.before_outbox");
            }

            #[test]
            fn a_commit_failing_after_its_outbox_write_keeps_nothing_and_is_retried() {
                super::inject(super::$backend(), "commit.after_outbox");
            }

            #[test]
            fn a_crash_between_two_calls_of_a_batch_runs_only_the_unfinished_one_again() {
                super::inject(super::$backend(), "tools.between_calls");
            }

            #[test]
            fn a_crash_while_a_commit_is_broadcast_loses_no_event() {
                super::inject(super::$backend(), "events.publish");
            }

            #[test]
            fn a_crash_mid_model_stream_makes_the_call_again_in_full() {
                super::inject(super::$backend(), "model.mid_stream");
            }
        }
    };
}

scenarios!(sqlite);
scenarios!(postgres);

/// What the database and the workspace hold about the one run, read while no `ratchet`
/// process runs.
struct Snapshot {
    state: AgentState,
    steps: Vec<StepRecord>,
    events: Vec<StoredEvent>,
    history: Vec<Message>,
    /// The intents of steps 1..=`STEPS`, by step.
    intents: Vec<Vec<IntentRecord>>,
    log: Vec<String>,
}

impl Snapshot {
    fn of_kind<'a>(&'a self, kind: &'a str) -> impl Iterator<Item = &'a StoredEvent> {
        self.events.iter().filter(move |e| e.kind == kind)
    }

    fn committed_steps(&self) -> Vec<u64> {
        self.of_kind("step.committed")
            .map(|e| e.payload["step_index"].as_u64().unwrap())
            .collect()
    }

    fn intents_of_step(&self, step: u64) -> &[IntentRecord] {
        &self.intents[step as usize - 1]
    }
}

struct Sandbox {
    database: Database,
    _dir: tempfile::TempDir,
    workspace: PathBuf,
    script: PathBuf,
}

impl Sandbox {
    fn new(database: Database) -> Sandbox {
        let dir = tempfile::tempdir().unwrap();
        let workspace = dir.path().join("ws");
        std::fs::create_dir(&workspace).unwrap();
        let script = dir.path().join("script.json");
        std::fs::write(&script, replies().to_string()).unwrap();
        Sandbox {
            database,
            _dir: dir,
            workspace,
            script,
        }
    }

    /// `ratchet run --json` with `failpoints` configured.
    fn run(&self, failpoints: &str) -> Output {
        let mut command = Command::new(BIN);
        command
            .args(["run", "--json", "--db", &self.database.url])
            .arg("--model")
            .arg(format!("scripted:{}", self.script.display()))
            .arg("--workspace")
            .arg(&self.workspace)
            .arg("Write the log and add 2 and 3.")
            .env("FAILPOINTS", failpoints);
        output_within_deadline(&mut command, "")
    }

    /// `ratchet resume --json`, configured with no failpoint: its one JSON line per run that
    /// was active.
    fn resume(&self) -> Vec<Value> {
        let mut command = Command::new(BIN);
        command
            .args(["resume", "--json", "--db", &self.database.url])
            .env_remove("FAILPOINTS");
        let out = output_within_deadline(&mut command, "");
        assert_eq!(
            out.status.code(),
            Some(0),
            "resume failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}")))
            .collect()
    }

    fn snapshot(&self) -> Snapshot {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let log = std::fs::read_to_string(self.workspace.join("log.txt"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect();
        runtime.block_on(async {
            let store = open(&self.database.url);
            let runs = store.list_runs().await.unwrap();
            assert_eq!(runs.len(), 1, "one run: {runs:?}");
            let run_id = &runs[0].run_id;
            let state = store.load_state(run_id).await.unwrap();
            let mut intents = Vec::new();
            for step in 1..=STEPS {
                intents.push(store.intents(run_id, step).await.unwrap());
            }
            Snapshot {
                steps: store.steps(run_id).await.unwrap(),
                events: store
                    .events_after(&state.session_id, 0, 10_000)
                    .await
                    .unwrap(),
                history: store.history(&state.session_id).await.unwrap(),
                intents,
                log,
                state,
            }
        })
    }
}

fn open(url: &str) -> Arc<dyn Store> {
    if url.starts_with("sqlite:") {
        return Arc::new(ratchet_sqlite::open_url(url).unwrap());
    }
    if url.starts_with("postgres:") {
        return Arc::new(ratchet_postgres::open_url(url).unwrap());
    }
    panic!("no test backend for {url}")
}

/// Runs the script with the failpoint's case configured, checks that it fired as the case
/// says, lets the run recover as the case says, and checks that the run ended correct.
fn inject(database: Option<Database>, failpoint: &str) {
    let Some(database) = database else { return };
    let case = CASES
        .iter()
        .find(|c| c.failpoint == failpoint)
        .unwrap_or_else(|| panic!("no case for failpoint {failpoint}"));
    let sandbox = Sandbox::new(database);
    let run = sandbox.run(&format!("{}={}", case.failpoint, case.actions));
    let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
    let report = match case.recovery {
        Recovery::Resume {
            committed,
            log,
            at_crash,
        } => {
            assert_eq!(
                run.status.signal(),
                Some(SIGABRT),
                "{failpoint}: the run must die at the failpoint, not end with {}: {stderr}",
                run.status
            );
            let crashed = sandbox.snapshot();
            assert_eq!(crashed.state.status, RunStatus::Running, "{failpoint}");
            assert_eq!(
                crashed.state.step_index, committed,
                "{failpoint}: steps committed before the crash"
            );
            assert_eq!(crashed.log, log, "{failpoint}: effects before the crash");
            assert_eq!(
                crashed.committed_steps(),
                (1..=committed).collect::<Vec<_>>(),
                "{failpoint}: step.committed of each durable step"
            );
            at_crash(&crashed);
            let reports = sandbox.resume();
            assert_eq!(reports.len(), 1, "{failpoint}: one active run: {reports:?}");
            reports[0].clone()
        }
        Recovery::Retry { step } => {
            assert_eq!(
                run.status.code(),
                Some(0),
                "{failpoint}: the process recovers by itself: {stderr}"
            );
            let after = sandbox.snapshot();
            let released: Vec<&StoredEvent> = after
                .of_kind("activity")
                .filter(|e| e.payload["activity"] == "step_released")
                .collect();
            assert_eq!(
                released.len(),
                1,
                "{failpoint}: the commit failed once: {released:?}"
            );
            let payload = &released[0].payload;
            assert_eq!(payload["step_index"], step, "{failpoint}: {payload}");
            assert_eq!(
                payload["error"],
                format!("database error: failpoint {failpoint}"),
                "{failpoint}: {payload}"
            );
            assert!(
                sandbox.resume().is_empty(),
                "{failpoint}: nothing is left for resume"
            );
            crate::common::report(&run)
        }
    };
    ends_correct(failpoint, &report, &sandbox.snapshot());
}

fn ends_correct(failpoint: &str, report: &Value, after: &Snapshot) {
    assert_eq!(report["status"], "completed", "{failpoint}: {report}");
    assert_eq!(report["stop_reason"], "completed", "{failpoint}: {report}");
    assert_eq!(
        report["final_answer"], FINAL_ANSWER,
        "{failpoint}: {report}"
    );
    assert_eq!(report["steps"], STEPS, "{failpoint}: {report}");

    let state = &after.state;
    assert_eq!(state.status, RunStatus::Completed, "{failpoint}");
    assert_eq!(
        state.stop_reason,
        Some(StopReason::Completed),
        "{failpoint}"
    );
    assert!(
        state.finished_at.is_some(),
        "{failpoint}: finished, and when"
    );
    assert_eq!(state.step_index, STEPS, "{failpoint}");
    let indexes: Vec<u64> = after.steps.iter().map(|s| s.index).collect();
    assert_eq!(
        indexes,
        (1..=STEPS).collect::<Vec<_>>(),
        "{failpoint}: steps 1..n, none lost or repeated"
    );
    assert_eq!(
        after.committed_steps(),
        (1..=STEPS).collect::<Vec<_>>(),
        "{failpoint}: each step.committed once, in order"
    );
    let seqs: Vec<i64> = after.events.iter().map(|e| e.seq).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as i64).collect::<Vec<_>>(),
        "{failpoint}: event seqs are dense"
    );
    assert_eq!(
        after.of_kind("run.finished").count(),
        1,
        "{failpoint}: one end"
    );

    assert_eq!(
        after.log,
        ["first", "second"],
        "{failpoint}: each never-replay effect exactly once"
    );
    let results: Vec<&str> = after
        .history
        .iter()
        .filter(|m| m.role == Role::Tool)
        .map(|m| m.tool_call_id.as_deref().unwrap())
        .collect();
    assert_eq!(results, CALLS, "{failpoint}: tool results in call order");
    let replies: Vec<&str> = after
        .history
        .iter()
        .filter(|m| m.role == Role::Assistant)
        .map(|m| m.content.as_str())
        .collect();
    assert_eq!(
        replies.len(),
        4,
        "{failpoint}: one reply per model call: {replies:?}"
    );
    assert_eq!(replies.last(), Some(&FINAL_ANSWER), "{failpoint}");
}

/// Only the `never` call writes ahead: `append_line` (slot 0) has its intent and outcome
/// recorded before the commit; the replay-safe `sleep_ms` left nothing of its own, its outcome
/// was to be durable with the commit that never came.
fn the_first_batch_ran_in_full(crashed: &Snapshot) {
    let recorded: Vec<(u32, &str, bool)> = crashed
        .intents_of_step(2)
        .iter()
        .map(|i| (i.slot, i.name.as_str(), i.outcome.is_some()))
        .collect();
    assert_eq!(
        recorded,
        [(0, "append_line", true)],
        "the never call of step 2 had its outcome recorded before the commit, and only it"
    );
}

fn step_six_is_committed_and_its_next_job_waits(crashed: &Snapshot) {
    assert!(
        crashed.intents_of_step(7).is_empty(),
        "nothing of step 7 had started"
    );
}

fn the_first_call_has_its_outcome_and_the_second_none(crashed: &Snapshot) {
    let intents = crashed.intents_of_step(2);
    let first = intents.iter().find(|i| i.slot == 0).unwrap();
    assert_eq!(first.name, "append_line");
    assert!(
        first.outcome.is_some(),
        "the first call's outcome is recorded"
    );
    assert!(
        intents.iter().all(|i| i.slot == 0 || i.outcome.is_none()),
        "the crash came before the rest of the batch finished: {intents:?}"
    );
}

fn step_two_is_committed(crashed: &Snapshot) {
    assert!(
        crashed.intents_of_step(3).is_empty(),
        "the crash came before step 3 started"
    );
}

fn deltas_are_stored_but_no_reply(crashed: &Snapshot) {
    assert!(
        crashed.of_kind("assistant.delta").count() > 0,
        "some deltas were streamed and stored"
    );
    assert_eq!(
        crashed.of_kind("assistant.message").count(),
        0,
        "the reply never completed"
    );
}

/// The failpoints in the code, the cases above and the list in docs/ARCHITECTURE.md name the
/// same points: none is placed without a test, and none is documented that does not exist.
#[test]
fn every_failpoint_is_documented_and_injected() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut in_code = BTreeSet::new();
    let mut pending: Vec<PathBuf> = std::fs::read_dir(root.join("crates"))
        .unwrap()
        .map(|krate| krate.unwrap().path().join("src"))
        .collect();
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                for (start, _) in text.match_indices("fail_point!(") {
                    let name = text[start..].split('"').nth(1).unwrap();
                    in_code.insert(name.to_owned());
                }
            }
        }
    }
    let tested: BTreeSet<String> = (CASES.iter().map(|c| c.failpoint))
        .chain(TESTED_ELSEWHERE)
        .map(str::to_owned)
        .collect();
    assert_eq!(
        in_code, tested,
        "every failpoint in the code has a case here"
    );
    let doc = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).unwrap();
    let section = doc
        .split_once("**Fault injection.**")
        .expect("docs/ARCHITECTURE.md has a \"Fault injection\" section")
        .1;
    for name in &tested {
        assert!(
            section.contains(&format!("`{name}`")),
            "docs/ARCHITECTURE.md's \"Fault injection\" does not list `{name}`"
        );
    }
}
