//! SQLite-specific behaviour that the backend-neutral conformance suite cannot reach: what
//! happens when rows on disk are damaged, and what the files hold of a webhook's secret.

use ratchet_core::{MessageId, RunConfigSnapshot, RunId, SessionId, WebhookId};
use ratchet_store::{Deliveries, Reads, WebhookAdmin, Writes};
use ratchet_store::{Key, Keyring, Lease, NewRun, NewWebhook, SessionSpec, WhenBusy};

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
            trace: None,
            request: None,
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

fn keyring() -> Keyring {
    Keyring::new(Key::generate().unwrap(), Vec::new()).unwrap()
}

fn new_webhook(id: &str, secret: &str) -> NewWebhook {
    NewWebhook {
        id: WebhookId::from_suffix(id).unwrap(),
        tenant: "default".to_owned(),
        url: "https://example.com/hook".to_owned(),
        events: None,
        secret: secret.to_owned(),
        max_attempts: 3,
        request: None,
    }
}

/// Every byte of the database's files (the WAL too).
fn files_of(dir: &std::path::Path) -> Vec<u8> {
    let mut bytes = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        bytes.extend(std::fs::read(entry.unwrap().path()).unwrap());
    }
    bytes
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle.as_bytes())
}

/// F3/secrets at rest: a webhook's signing secret, first or rotated, never reaches the files
/// in clear; a store opened without a key cannot create one at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_secrets_never_reach_the_database_files_in_clear() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("r.db").display());
    let store = ratchet_sqlite::open_url(&url)
        .unwrap()
        .with_secrets(keyring());
    store
        .create_webhook(new_webhook("w1", "whsec_the-first-secret-of-it"), 1)
        .await
        .unwrap();
    let id = WebhookId::from_suffix("w1").unwrap();
    store
        .rotate_webhook_secret(&id, "whsec_the-rotated-secret".to_owned(), None)
        .await
        .unwrap();
    let files = files_of(dir.path());
    for secret in ["whsec_the-first-secret-of-it", "whsec_the-rotated-secret"] {
        assert!(
            !contains(&files, secret),
            "{secret} is in the files in clear"
        );
    }
    let stored: String = rusqlite::Connection::open(dir.path().join("r.db"))
        .unwrap()
        .query_row("SELECT secret FROM webhooks", [], |r| r.get(0))
        .unwrap();
    assert!(stored.starts_with("v1:"), "{stored}");

    let keyless = ratchet_sqlite::open_url(&url).unwrap();
    let refused = keyless
        .create_webhook(new_webhook("w2", "whsec_never-written"), 2)
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("opened without a key"),
        "{refused}"
    );
    assert!(!contains(&files_of(dir.path()), "whsec_never-written"));
}

/// A secret an older version wrote in clear is still used to sign (the migration marks it
/// `clear:`) until the first store with a key seals it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_written_in_clear_before_sealing_is_sealed_by_the_first_store_with_a_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.db");
    let url = format!("sqlite://{}", path.display());
    drop(ratchet_sqlite::open_url(&url).unwrap());
    {
        // The database as the version before sealing left it.
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute(
            "INSERT INTO webhooks (id, tenant, url, events_json, secret, max_attempts, created_at)
             VALUES ('whk_old', 'default', 'https://example.com/hook', NULL, 'whsec_legacy-secret', 3, 1)",
            [],
        )
        .unwrap();
        // Undo the migrations after sealing, newest first, then mark the version before
        // sealing.
        conn.execute_batch(
            "ALTER TABLE runs DROP COLUMN schedule_slot; ALTER TABLE runs DROP COLUMN schedule_id;
             DROP TABLE schedule_slots; DROP TABLE schedules;
             ALTER TABLE runs DROP COLUMN forked_from_step;
             ALTER TABLE runs DROP COLUMN forked_from_run_id;
             DROP TABLE idempotent_requests;
             ALTER TABLE sessions DROP COLUMN title;
             DROP INDEX inbox_expiring; ALTER TABLE inbox DROP COLUMN expires_at;
             ALTER TABLE webhook_deliveries DROP COLUMN requeued_at;
             ALTER TABLE inbox DROP COLUMN requeued_at;
             ALTER TABLE messages DROP COLUMN draft_of;
             ALTER TABLE runs ADD COLUMN config_json TEXT NOT NULL DEFAULT '';
             ALTER TABLE runs DROP COLUMN config_id; DROP TABLE run_configs;
             DROP INDEX runs_by_deadline; ALTER TABLE runs DROP COLUMN deadline_at;",
        )
        .unwrap();
        conn.pragma_update(None, "user_version", ratchet_sqlite::SCHEMA_VERSION - 10)
            .unwrap();
    }
    let store = ratchet_sqlite::open_url(&url)
        .unwrap()
        .with_secrets(keyring());
    let stored = |path: &std::path::Path| -> String {
        rusqlite::Connection::open(path)
            .unwrap()
            .query_row(
                "SELECT secret FROM webhooks WHERE id = 'whk_old'",
                [],
                |r| r.get(0),
            )
            .unwrap()
    };
    assert_eq!(stored(&path), "clear:whsec_legacy-secret");
    assert_eq!(store.seal_webhook_secrets().await.unwrap(), 1);
    assert_eq!(store.seal_webhook_secrets().await.unwrap(), 0);
    let sealed = stored(&path);
    assert!(
        sealed.starts_with("v1:") && !sealed.contains("legacy"),
        "{sealed}"
    );

    let session = SessionId::from_suffix("s").unwrap();
    store
        .create_session(&session, SessionSpec::default(), 2)
        .await
        .unwrap();
    store
        .submit_message(
            NewRun {
                session_id: session,
                run_id: RunId::from_suffix("r").unwrap(),
                message_id: MessageId::from_suffix("m").unwrap(),
                content: "hi".into(),
                config: RunConfigSnapshot::default(),
                when_busy: WhenBusy::Enqueue,
                quota: Default::default(),
                trace: None,
                request: None,
            },
            3,
        )
        .await
        .unwrap();
    store.queue_deliveries(100, 4).await.unwrap();
    let claimed = store.claim_deliveries("d", 10_000, 10, 5).await.unwrap();
    assert_eq!(claimed.len(), 1, "{claimed:?}");
    assert_eq!(claimed[0].secret, "whsec_legacy-secret");
}
