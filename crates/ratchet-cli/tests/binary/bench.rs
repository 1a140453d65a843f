//! The `ratchet bench` subcommands (the `ratchet-bench` program, run through `ratchet`), run
//! for real at tiny sizes: each must finish, print one well-formed report, and report figures
//! that agree with what it did (counts match, rates and sizes are positive, derived figures
//! are computed from the measured ones). How fast anything is is never checked here.

use std::path::Path;
use std::process::{Command, Output};

use crate::common::{output_within_deadline, stderr_of, stdout_of};
use ratchet_postgres::testkit::TestDatabase;
use serde_json::Value;

/// Runs `ratchet ARGS` in `dir` within the common deadline.
fn ratchet(dir: &Path, args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ratchet"));
    command
        .args(args)
        .current_dir(dir)
        // The caller's environment must not choose the database, the workers or the logs.
        .env_remove("RATCHET_DB")
        .env_remove("RATCHET_LEASE_MS")
        .env_remove("RATCHET_HEARTBEAT_MS")
        .env_remove("RATCHET_POLL_MS")
        .env_remove("RATCHET_LOG");
    output_within_deadline(&mut command, "")
}

/// The one JSON object a successful `--json` bench prints on stdout.
fn report(output: &Output) -> Value {
    assert_eq!(output.status.code(), Some(0), "{}", stderr_of(output));
    let stdout = stdout_of(output);
    let values: Vec<Value> = serde_json::Deserializer::from_str(&stdout)
        .into_iter()
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {stdout:?}"));
    assert_eq!(values.len(), 1, "one JSON value on stdout: {stdout:?}");
    assert!(values[0].is_object(), "{stdout}");
    values[0].clone()
}

fn number(report: &Value, key: &str) -> f64 {
    report[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {report}"))
}

fn assert_close(found: f64, expected: f64, what: &str) {
    assert!(
        (found - expected).abs() <= 1e-9 * expected.abs().max(1.0),
        "{what}: expected {expected}, found {found}"
    );
}

/// Bytes per step are the database's growth over the runs, divided by the steps committed.
fn assert_bytes_per_step(report: &Value) {
    let (before, after) = (
        number(report, "database_bytes_before"),
        number(report, "database_bytes_after"),
    );
    assert!(before > 0.0 && after > before, "{report}");
    assert_close(
        number(report, "database_bytes_per_step"),
        (after - before) / number(report, "steps"),
        "bytes per step",
    );
}

#[test]
fn steps_on_sqlite_report_the_disks_commit_rate_measured_beside_them_and_bytes_per_step() {
    let dir = tempfile::tempdir().unwrap();
    let figures = report(&ratchet(
        dir.path(),
        &[
            "bench",
            "steps",
            "--runs",
            "4",
            "--concurrency",
            "2",
            "--turns",
            "2",
            "--commits",
            "20",
            "--json",
        ],
    ));
    assert_eq!(
        (&figures["runs"], &figures["steps"]),
        (&4.into(), &20.into())
    );
    assert_eq!(figures["commits"], 20);
    let (steps_per_s, commits_per_s) = (
        number(&figures, "steps_per_s"),
        number(&figures, "commits_per_s"),
    );
    assert!(steps_per_s > 0.0 && commits_per_s > 0.0, "{figures}");
    assert_close(
        number(&figures, "steps_per_s_over_commits_per_s"),
        steps_per_s / commits_per_s,
        "steps/s over commits/s",
    );
    assert_bytes_per_step(&figures);
    // CPU time is counted in 10 ms ticks, so two short runs may round to none; a process
    // holds more than a megabyte at its peak.
    assert!(number(&figures, "cpu_ms_per_run") >= 0.0, "{figures}");
    assert!(number(&figures, "peak_rss_mb") > 1.0, "{figures}");

    // A database of one's own, in its own directory, which the disk probe leaves as it was.
    let own = dir.path().join("own");
    std::fs::create_dir(&own).unwrap();
    let db = format!("sqlite://{}/bench.db?synchronous=normal", own.display());
    let output = ratchet(
        dir.path(),
        &[
            "bench",
            "steps",
            "--db",
            &db,
            "--runs",
            "2",
            "--concurrency",
            "1",
            "--turns",
            "1",
            "--commits",
            "10",
        ],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr_of(&output));
    let line = stdout_of(&output);
    for said in [
        "2 runs x 3 steps, 1 at a time: ",
        " durable steps/s",
        "; the disk: ",
        " fsynced single-row commits/s, so ",
        " ms of CPU per run and ",
        " MB peak resident memory in this process; the database grew ",
        " bytes per step\n",
    ] {
        assert!(line.contains(said), "{said:?} in {line:?}");
    }
    let mut left: Vec<String> = std::fs::read_dir(&own)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .filter(|name| !name.starts_with("bench.db"))
        .collect();
    left.sort();
    assert!(left.is_empty(), "the probe left {left:?} behind");
}

#[test]
fn steps_on_postgres_report_bytes_per_step_and_no_disk_rate() {
    let Some(db) = TestDatabase::create() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let figures = report(&ratchet(
        dir.path(),
        &[
            "bench",
            "steps",
            "--db",
            db.url(),
            "--runs",
            "3",
            "--concurrency",
            "3",
            "--turns",
            "1",
            "--json",
        ],
    ));
    assert_eq!(figures["steps"], 9);
    for key in ["commits", "commits_per_s", "steps_per_s_over_commits_per_s"] {
        assert!(
            figures[key].is_null(),
            "the disk of a server is not this machine's: {key} in {figures}"
        );
    }
    assert_bytes_per_step(&figures);
}

/// The figures every recovery report has, ordered as time runs: the steps started again,
/// were done again (taking at least their own sleep), and the runs then completed.
fn check_recovery(figures: &Value, runs: u64, step_ms: f64) {
    assert_eq!(figures["runs"], runs, "{figures}");
    assert_eq!(number(figures, "step_ms"), step_ms);
    for stage in ["resumed", "redo", "next_step", "completed"] {
        let (p50, max) = (
            number(figures, &format!("{stage}_p50_ms")),
            number(figures, &format!("{stage}_max_ms")),
        );
        assert!(0.0 <= p50 && p50 <= max, "{stage} in {figures}");
    }
    assert!(
        number(figures, "redo_p50_ms") >= step_ms,
        "the interrupted step was done again, sleep and all: {figures}"
    );
    assert!(
        number(figures, "next_step_max_ms")
            >= number(figures, "resumed_max_ms").max(number(figures, "redo_max_ms")),
        "{figures}"
    );
    assert!(
        number(figures, "completed_max_ms") >= number(figures, "next_step_max_ms"),
        "{figures}"
    );
}

#[test]
fn recovery_after_a_restart_times_the_runs_a_killed_worker_had_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let figures = report(&ratchet(
        dir.path(),
        &[
            "bench",
            "recovery",
            "--runs",
            "3",
            "--step-ms",
            "1000",
            "--json",
        ],
    ));
    check_recovery(&figures, 3, 1000.0);
    assert_eq!(figures["mode"], "restart");
    assert_eq!(figures["lease_ms"], 15000, "the workers' default lease");
    assert!(
        number(&figures, "fresh_process_ready_ms") > 0.0,
        "{figures}"
    );
    // The restarted process frees the dead one's leases: nobody waits 15 s for them.
    assert!(
        number(&figures, "resumed_max_ms") < 15000.0,
        "the steps were taken up before the leases expired: {figures}"
    );
}

#[test]
fn recovery_by_takeover_waits_for_the_dead_workers_leases() {
    let dir = tempfile::tempdir().unwrap();
    let figures = report(&ratchet(
        dir.path(),
        &[
            "bench",
            "recovery",
            "--runs",
            "2",
            "--step-ms",
            "1000",
            "--lease-ms",
            "3000",
            "--takeover",
            "--json",
        ],
    ));
    check_recovery(&figures, 2, 1000.0);
    assert_eq!(
        (&figures["mode"], &figures["lease_ms"]),
        (&"takeover".into(), &3000.into())
    );
    assert!(figures["fresh_process_ready_ms"].is_null(), "{figures}");
    // A lease renewed every third of it has at least two thirds left at the kill, give or
    // take a late heartbeat: no step can be taken over before a third of it has passed.
    assert!(
        number(&figures, "resumed_p50_ms") >= 1000.0,
        "the standby waited for the leases: {figures}"
    );
}

#[test]
fn memory_reports_the_servers_growth_per_idle_session_and_per_waiting_run() {
    let dir = tempfile::tempdir().unwrap();
    let figures = report(&ratchet(
        dir.path(),
        &["bench", "memory", "--sessions", "3", "--json"],
    ));
    assert_eq!(figures["sessions"], 3);
    assert_eq!(
        figures["pending_approvals"], 4,
        "one waiting run per session, and the warm-up's"
    );
    let (baseline, idle, waiting) = (
        number(&figures, "baseline_rss_bytes"),
        number(&figures, "idle_rss_bytes"),
        number(&figures, "waiting_rss_bytes"),
    );
    assert!(baseline > 0.0 && idle > 0.0 && waiting > 0.0, "{figures}");
    assert_close(
        number(&figures, "bytes_per_idle_session"),
        (idle - baseline) / 3.0,
        "bytes per idle session",
    );
    assert_close(
        number(&figures, "bytes_per_waiting_run"),
        (waiting - idle) / 3.0,
        "bytes per waiting run",
    );
    let (empty, with_sessions, with_waiting_runs) = (
        number(&figures, "baseline_database_bytes"),
        number(&figures, "idle_database_bytes"),
        number(&figures, "waiting_database_bytes"),
    );
    assert!(
        0.0 < empty && empty < with_sessions && with_sessions <= with_waiting_runs,
        "the database grew with the sessions: {figures}"
    );
}

#[test]
fn benches_refuse_sizes_that_measure_nothing() {
    let dir = tempfile::tempdir().unwrap();
    for (args, said) in [
        (
            &["bench", "steps", "--runs", "2", "--concurrency", "3"][..],
            "--concurrency 3 is more than --runs 2",
        ),
        (
            &["bench", "steps", "--commits", "0"][..],
            "--runs, --concurrency and --commits must be at least 1",
        ),
        (
            &["bench", "recovery", "--runs", "0"][..],
            "--runs and --step-ms must be at least 1",
        ),
        (
            &["bench", "memory", "--sessions", "0"][..],
            "--sessions must be at least 1",
        ),
    ] {
        let output = ratchet(dir.path(), args);
        assert_eq!(output.status.code(), Some(1), "{args:?}");
        assert!(
            stderr_of(&output).contains(said),
            "{args:?}: {}",
            stderr_of(&output)
        );
    }
}

/// `ratchet bench` runs the `ratchet-bench` program beside it; without one it says how to
/// build it, and exits 1.
#[test]
fn bench_without_the_bench_program_beside_it_says_how_to_build_it() {
    let dir = tempfile::tempdir().unwrap();
    let alone = dir.path().join("ratchet");
    std::fs::copy(env!("CARGO_BIN_EXE_ratchet"), &alone).unwrap();
    let mut command = Command::new(&alone);
    command.args(["bench", "commits", "--count", "5"]);
    let output = output_within_deadline(&mut command, "");
    assert_eq!(output.status.code(), Some(1), "{}", stderr_of(&output));
    let said = stderr_of(&output);
    assert!(
        said.contains("cargo build --release -p ratchet-bench")
            && said.contains(&dir.path().join("ratchet-bench").display().to_string()),
        "{said}"
    );
}
