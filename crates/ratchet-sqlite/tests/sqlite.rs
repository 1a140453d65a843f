//! SQLite-specific behaviour that the backend-neutral conformance suite cannot reach: what
//! happens when rows on disk are damaged.

use ratchet_core::{MessageId, RunConfigSnapshot, RunId, SessionId};
use ratchet_store::{Lease, NewRun, SessionSpec, Store, WhenBusy};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_run_cannot_be_loaded_is_set_aside_and_the_rest_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.db");
    let store = ratchet_sqlite::open_url(&format!("sqlite://{}", path.display())).unwrap();
    let mut runs = Vec::new();
    for (i, at) in [(0, 1_000), (1, 2_000)] {
        let session = SessionId::from_suffix(&format!("s{i}")).unwrap();
        store
            .create_session(&session, SessionSpec::default(), at)
            .await
            .unwrap();
        let run_id = RunId::from_suffix(&format!("r{i}")).unwrap();
        let new = NewRun {
            session_id: session,
            run_id: run_id.clone(),
            message_id: MessageId::from_suffix(&format!("m{i}")).unwrap(),
            content: "hi".into(),
            config: RunConfigSnapshot::default(),
            when_busy: WhenBusy::Enqueue,
            quota: Default::default(),
        };
        store.submit_message(new, at).await.unwrap();
        runs.push(run_id);
    }
    // Damage the older run's state: its job is first in line.
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute(
        "UPDATE runs SET state_json = '{\"status\": \"paused\"}' WHERE id = ?1",
        [runs[0].as_str()],
    )
    .unwrap();

    let lease = |at: i64| Lease {
        owner: "w".into(),
        expires_at: at + 30_000,
    };
    let claimed = store
        .claim_next(lease(3_000), None, 3_000)
        .await
        .unwrap()
        .expect("a job");
    assert_eq!(
        claimed.job.run_id, runs[1],
        "the healthy run is claimed past the damaged one"
    );
    let nothing = store.claim_next(lease(3_001), None, 3_001).await.unwrap();
    assert!(
        nothing.is_none(),
        "the damaged job is set aside for a while: {nothing:?}"
    );
    let ready_at: i64 = conn
        .query_row(
            "SELECT ready_at FROM step_jobs WHERE run_id = ?1",
            [runs[0].as_str()],
            |r| r.get(0),
        )
        .unwrap();
    assert!(ready_at > 3_000, "set aside until {ready_at}");
    assert!(
        store.load_state(&runs[0]).await.is_err(),
        "the damage is reported, not hidden"
    );
}

/// A process told not to migrate refuses a database that is missing or behind this build,
/// and changes neither; an explicit migration brings it up to date once.
#[test]
fn opening_without_migrating_refuses_a_missing_or_old_database() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.db");
    let url = format!("sqlite://{}", path.display());
    let without_migrating = || ratchet_sqlite::SqliteOptions {
        migrate: false,
        ..ratchet_sqlite::SqliteOptions::from_url(&url).unwrap()
    };
    let missing = ratchet_sqlite::open(without_migrating()).err().unwrap();
    assert!(missing.to_string().contains("not found"), "{missing}");
    assert!(!path.exists(), "nothing was created");

    rusqlite::Connection::open(&path)
        .unwrap()
        .pragma_update(None, "user_version", 2)
        .unwrap();
    let behind = ratchet_sqlite::open(without_migrating()).err().unwrap();
    assert!(
        behind.to_string().contains("schema version 2 is behind"),
        "{behind}"
    );
    let version = |path: &std::path::Path| -> u32 {
        rusqlite::Connection::open(path)
            .unwrap()
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap()
    };
    assert_eq!(version(&path), 2, "the refused database is unchanged");

    // Version 2's tables do not exist in this file: migrating from a bare version would fail,
    // so start again from an empty file.
    std::fs::remove_file(&path).unwrap();
    let options = ratchet_sqlite::SqliteOptions::from_url(&url).unwrap();
    let migrated = ratchet_sqlite::migrate(&options).unwrap();
    assert_eq!(
        (migrated.from, migrated.to),
        (0, ratchet_sqlite::SCHEMA_VERSION)
    );
    let again = ratchet_sqlite::migrate(&options).unwrap();
    assert_eq!((again.from, again.to), (migrated.to, migrated.to));
    ratchet_sqlite::open(without_migrating()).unwrap();
    assert_eq!(version(&path), ratchet_sqlite::SCHEMA_VERSION);
}
