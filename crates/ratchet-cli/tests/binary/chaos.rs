//! The chaos program in its short form, as CI runs it: real `ratchet` processes killed with
//! SIGKILL at random instants for a while, on SQLite (one server) and on PostgreSQL (a server
//! and a worker process), with MCP calls that hang, drop their connection or stall, then every
//! invariant checked. The seed is printed, so a failure
//! replays with `ratchet-chaos --seed N`.

use std::time::Duration;

use ratchet_chaos::{Database, Options, Report};
use ratchet_postgres::testkit::TestDatabase;

const BIN: &str = env!("CARGO_BIN_EXE_ratchet");

fn options(dir: &std::path::Path, database: Database, worker_processes: usize) -> Options {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    Options {
        ratchet: BIN.into(),
        database,
        duration: Duration::from_secs(40),
        runs: 2000,
        concurrency: 6,
        worker_processes,
        uptime_ms: (300, 2500),
        seed,
        dir: dir.to_owned(),
        settle: Duration::from_secs(60),
    }
}

fn assert_clean(report: &Report) {
    println!("{report}");
    assert!(report.violations.is_empty(), "violations:\n{report}");
    assert!(
        report.kills >= 5,
        "expected kills all along, found {}",
        report.kills
    );
    assert!(
        report.tally.runs >= 20,
        "expected at least 20 runs through the kills, found {}",
        report.tally.runs
    );
    assert!(
        report.tally.appends > 0,
        "expected never-replay effects to have happened"
    );
    for tool in ["hang", "drop", "flaky"] {
        assert!(
            report.tally.mcp_executions.get(tool) > Some(&0),
            "expected the MCP server to have executed {tool} calls: {:?}",
            report.tally.mcp_executions
        );
    }
    assert!(
        report.tally.calls_in_doubt > 0,
        "expected calls whose outcome was unknown to have waited for an answer"
    );
    assert!(
        report.tally.children > 0 && report.tally.reports_told > 0,
        "expected background work told in continuation turns: {} helper runs, {} reports told",
        report.tally.children,
        report.tally.reports_told
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_server_killed_at_random_keeps_every_invariant() {
    let dir = tempfile::tempdir().unwrap();
    let report = ratchet_chaos::run(options(dir.path(), Database::Sqlite, 0))
        .await
        .unwrap();
    assert_clean(&report);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_server_and_worker_killed_at_random_keep_every_invariant() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let postgres = Database::Postgres {
        url: database.url().to_owned(),
    };
    let report = ratchet_chaos::run(options(dir.path(), postgres, 1))
        .await
        .unwrap();
    assert_clean(&report);
}
