//! The PostgreSQL backend against a real server (`RATCHET_TEST_POSTGRES_URL`), each test on
//! a database of its own. Without a server a test is skipped and says so (outside CI).
//!
//! Concurrency is ordered by channels and by the server's own view of who waits on a lock,
//! never by sleeping.

use std::collections::BTreeMap;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use futures::StreamExt;
use ratchet_postgres::testkit::TestDatabase;
use ratchet_postgres::{PgBackend, PgOptions};
use ratchet_store::{Change, ChangeStream, Error, MessageHit, SearchScope};
use ratchet_store_sql::{Announcement, Backend, Param, Row, Value, params};
use tokio::sync::oneshot;

/// The longest any test waits for what it expects.
const DEADLINE: Duration = Duration::from_secs(30);

fn open(database: &TestDatabase) -> Arc<PgBackend> {
    let backend = PgBackend::open_url(database.url())
        .unwrap_or_else(|e| panic!("open {}: {e}", database.url()));
    Arc::new(backend)
}

fn open_with(
    database: &TestDatabase,
    change: impl FnOnce(&mut PgOptions),
) -> Result<PgBackend, Error> {
    let mut options = PgOptions::from_url(database.url()).unwrap();
    change(&mut options);
    PgBackend::open(options)
}

/// Runs one statement in a write of its own.
async fn execute(backend: &PgBackend, sql: &'static str) {
    backend
        .write(move |db| db.execute(sql, &[]))
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

async fn query(backend: &PgBackend, sql: &'static str) -> Vec<Row> {
    backend
        .read(move |db| db.query(sql, &[]))
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

async fn count(backend: &PgBackend, sql: &'static str) -> i64 {
    let mut rows = query(backend, sql).await;
    assert_eq!(rows.len(), 1, "{sql} returns one row");
    rows[0].int(0).unwrap()
}

/// Waits until `sql` counts `expected`, failing after the deadline.
async fn wait_for_count(backend: &PgBackend, sql: &'static str, expected: i64, what: &str) {
    let started = Instant::now();
    loop {
        if count(backend, sql).await == expected {
            return;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "{what} did not happen in time"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn versions(backend: &PgBackend) -> Vec<i64> {
    query(
        backend,
        "SELECT version FROM ratchet_schema ORDER BY version",
    )
    .await
    .into_iter()
    .map(|mut row| row.int(0).unwrap())
    .collect()
}

async fn next(changes: &mut ChangeStream) -> Change {
    tokio::time::timeout(DEADLINE, changes.next())
        .await
        .expect("a change within the deadline")
        .expect("the stream of changes goes on")
}

async fn oneshot_within<T>(receiver: oneshot::Receiver<T>, what: &str) -> T {
    tokio::time::timeout(DEADLINE, receiver)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen in time"))
        .unwrap_or_else(|_| panic!("{what}: the sender is gone"))
}

// ---------------------------------------------------------------------------------------
// Migrations

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_apply_once_when_three_processes_open_at_once() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let start = Barrier::new(3);
    let opened: Vec<Result<PgBackend, Error>> = std::thread::scope(|scope| {
        let openers: Vec<_> = (0..3)
            .map(|_| {
                scope.spawn(|| {
                    start.wait();
                    PgBackend::open_url(database.url())
                })
            })
            .collect();
        openers.into_iter().map(|o| o.join().unwrap()).collect()
    });
    for backend in &opened {
        if let Err(error) = backend {
            panic!("every concurrent open succeeds: {error}");
        }
    }

    let backend = open(&database);
    let every: Vec<i64> = (1..=i64::from(ratchet_postgres::SCHEMA_VERSION)).collect();
    assert_eq!(
        versions(&backend).await,
        every,
        "each version was applied once"
    );
    assert_eq!(
        ratchet_postgres::migrate(&PgOptions::from_url(database.url()).unwrap())
            .unwrap()
            .to,
        ratchet_postgres::SCHEMA_VERSION
    );
    drop(open(&database));
    assert_eq!(
        versions(&backend).await,
        every,
        "opening again changes nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_behind_or_ahead_of_the_build_is_a_clear_error() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    match open_with(&database, |o| o.migrate = false) {
        Err(Error::Conflict(message)) => {
            assert!(message.contains("run `ratchet migrate`"), "{message}")
        }
        Err(other) => panic!("an unmigrated database: expected Conflict, got {other}"),
        Ok(_) => panic!("an unmigrated database must not open without migrating"),
    }
    assert_eq!(
        ratchet_postgres::migrate(&PgOptions::from_url(database.url()).unwrap()).unwrap(),
        ratchet_store::Migrated {
            from: 0,
            to: ratchet_postgres::SCHEMA_VERSION
        }
    );
    let backend = open_with(&database, |o| o.migrate = false)
        .unwrap_or_else(|e| panic!("a migrated database opens without migrating: {e}"));

    let newer = format!(
        "INSERT INTO ratchet_schema (version) VALUES ({})",
        ratchet_postgres::SCHEMA_VERSION + 1
    );
    execute(&backend, newer.leak()).await;
    for migrate in [true, false] {
        match open_with(&database, |o| o.migrate = migrate) {
            Err(Error::Conflict(message)) => {
                assert!(message.contains("newer than this build"), "{message}")
            }
            Err(other) => panic!("a newer database: expected Conflict, got {other}"),
            Ok(_) => panic!("a database newer than the build must not open"),
        }
    }
}

// ---------------------------------------------------------------------------------------
// The Db the bodies see

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_parameter_and_value_kind_round_trips() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let backend = open(&database);
    execute(
        &backend,
        "CREATE TABLE kinds (a BIGINT, b BIGINT, i4 INTEGER, i2 SMALLINT, f8 DOUBLE PRECISION,
                             f4 REAL, t TEXT, u TEXT, v VARCHAR(40), flag BOOLEAN)",
    )
    .await;
    // PostgreSQL gives a parameter one type: a reused `?N` stands where that type fits.
    let insert = "INSERT INTO kinds (a, b, i4, i2, f8, f4, t, u, v, flag)
                  VALUES (?1, ?1, ?2, ?3, ?4, ?5, ?6, ?6, ?7, ?8 > 0)";
    let text = "héllo 'q' ?1";
    backend
        .write(move |db| {
            db.execute(
                insert,
                &params![7_i64, 7_i64, 7_i64, 1.5, 1.5, text, text, 1_i64],
            )?;
            db.execute(
                insert,
                &[
                    Param::Int(None),
                    Param::Int(None),
                    Param::Int(None),
                    Param::Real(None),
                    Param::Real(None),
                    Param::Text(None),
                    Param::Text(None),
                    Param::Int(None),
                ],
            )?;
            db.execute(
                "INSERT INTO kinds (a, f8) VALUES (?1, ?2)",
                &params![i64::MIN, 0.1],
            )
        })
        .await
        .unwrap();

    let rows = query(
        &backend,
        "SELECT a, b, i4, i2, f8, f4, t, u, v, flag FROM kinds ORDER BY a NULLS LAST",
    )
    .await;
    let mut lowest = vec![Value::Null; 10];
    lowest[0] = Value::Int(i64::MIN);
    lowest[4] = Value::Real(0.1);
    let text = || Value::Text("héllo 'q' ?1".into());
    assert_eq!(
        rows,
        [
            Row::new(lowest),
            Row::new(vec![
                Value::Int(7),
                Value::Int(7),
                Value::Int(7),
                Value::Int(7),
                Value::Real(1.5),
                Value::Real(1.5),
                text(),
                text(),
                text(),
                Value::Int(1),
            ]),
            Row::new(vec![Value::Null; 10]),
        ]
    );

    let quoted = backend
        .read(|db| db.query("SELECT '?1' AS literal, ?1 AS param", &params!["x"]))
        .await
        .unwrap();
    assert_eq!(
        quoted,
        [Row::new(vec![
            Value::Text("?1".into()),
            Value::Text("x".into())
        ])],
        "a `?1` inside quotes is text, not a parameter"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_of_the_wrong_kind_are_errors_that_say_what_was_expected() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let backend = open(&database);
    execute(&backend, "CREATE TABLE small (v SMALLINT)").await;

    let numeric = backend
        .read(|db| db.query("SELECT 1.5::numeric AS amount", &[]))
        .await;
    match numeric {
        Err(Error::Backend(message)) => assert!(
            message.contains("amount") && message.contains("numeric") && message.contains("cast"),
            "{message}"
        ),
        other => panic!("a NUMERIC column: expected an error asking for a cast, got {other:?}"),
    }
    let too_big = backend
        .write(|db| db.execute("INSERT INTO small (v) VALUES (?1)", &params![40_000_i64]))
        .await;
    match too_big {
        Err(Error::Backend(message)) => {
            assert!(
                message.contains("40000") && message.contains("int2"),
                "{message}"
            )
        }
        other => panic!("40000 in a SMALLINT: expected an error, got {other:?}"),
    }
    let text_for_int = backend
        .write(|db| db.execute("INSERT INTO small (v) VALUES (?1)", &params!["seven"]))
        .await;
    match text_for_int {
        Err(Error::Backend(message)) => assert!(
            message.contains("text cannot be bound") && message.contains("INSERT INTO small"),
            "{message}"
        ),
        other => panic!("text for a SMALLINT: expected an error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_is_prepared_once_per_connection() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let backend = open_with(&database, |o| o.pool = 1).unwrap();
    for n in 0..3_i64 {
        let sum = backend
            .read(move |db| db.query("SELECT ?1::bigint + 1", &params![n]))
            .await
            .unwrap();
        assert_eq!(sum, [Row::new(vec![Value::Int(n + 1)])]);
    }
    let prepared = backend
        .read(|db| {
            db.query(
                "SELECT generic_plans + custom_plans FROM pg_prepared_statements
                 WHERE statement = 'SELECT $1::bigint + 1'",
                &[],
            )
        })
        .await
        .unwrap();
    assert_eq!(
        prepared,
        [Row::new(vec![Value::Int(3)])],
        "three runs of one statement on the one connection ran one prepared statement"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_body_fails_keeps_nothing() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    // One connection: each failure below must leave it fit for the next write.
    let backend = open_with(&database, |o| o.pool = 1).unwrap();
    execute(&backend, "CREATE TABLE t (v BIGINT)").await;
    let insert = "INSERT INTO t (v) VALUES (?1)";

    let refused = backend
        .write(move |db| {
            db.execute(insert, &params![1_i64])?;
            Err::<(), _>(Error::Invalid("refused by the body".into()))
        })
        .await;
    assert!(
        matches!(&refused, Err(Error::Invalid(m)) if m == "refused by the body"),
        "the body's error reaches the caller as it was: {refused:?}"
    );

    let panicked: Result<(), Error> = backend
        .write(move |db| {
            db.execute(insert, &params![2_i64])?;
            panic!("a bug in a body");
        })
        .await;
    assert!(
        matches!(&panicked, Err(Error::Backend(m)) if m.contains("panicked")),
        "{panicked:?}"
    );

    let swallowed = backend
        .write(move |db| {
            db.execute(insert, &params![3_i64])?;
            let _ = db.execute("INSERT INTO missing_table (v) VALUES (1)", &[]);
            Ok(())
        })
        .await;
    assert!(
        matches!(&swallowed, Err(Error::Backend(m)) if m.contains("aborted")),
        "a body that goes on past a failed statement is told its transaction was lost: \
         {swallowed:?}"
    );

    backend
        .write(move |db| {
            db.execute("SAVEPOINT attempt", &[])?;
            assert!(
                db.execute("INSERT INTO missing_table (v) VALUES (1)", &[])
                    .is_err()
            );
            db.execute("ROLLBACK TO attempt", &[])?;
            db.execute("RELEASE attempt", &[])?;
            db.execute(insert, &params![4_i64])
        })
        .await
        .unwrap_or_else(|e| panic!("a failure rolled back to a savepoint is recovered: {e}"));

    let kept: Vec<i64> = query(&backend, "SELECT v FROM t ORDER BY v")
        .await
        .into_iter()
        .map(|mut row| row.int(0).unwrap())
        .collect();
    assert_eq!(kept, [4], "only the write that succeeded kept anything");
}

/// The server process of whichever pooled connection serves the read.
async fn backend_pid(backend: &PgBackend) -> Result<i64, Error> {
    backend
        .read(|db| {
            db.query_opt("SELECT pg_backend_pid()::bigint", &[])?
                .expect("a row")
                .int(0)
        })
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_the_server_closed_is_replaced_not_reused() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let backend = open_with(&database, |o| o.pool = 1).unwrap();
    let other = open(&database);
    let before = backend_pid(&backend).await.unwrap();
    let killed = other
        .write(move |db| db.query("SELECT pg_terminate_backend(?1::integer)", &params![before]))
        .await
        .unwrap();
    assert_eq!(
        killed,
        [Row::new(vec![Value::Int(1)])],
        "the idle connection was killed"
    );
    wait_for_count(
        &other,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'ratchet'
         AND datname = current_database() AND pid <> pg_backend_pid()",
        0,
        "the killed connection going away",
    )
    .await;

    let after = backend_pid(&backend)
        .await
        .unwrap_or_else(|e| panic!("a body is not failed by a connection closed while idle: {e}"));
    assert_ne!(before, after, "a new connection served the read");
    assert_eq!(
        backend_pid(&backend).await.unwrap(),
        after,
        "and went back to the pool"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_sees_one_snapshot_and_cannot_write() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let backend = open(&database);
    execute(&backend, "CREATE TABLE t (v BIGINT)").await;

    let (read_once, first_read) = oneshot::channel();
    let (wrote_tx, wrote) = oneshot::channel::<()>();
    let reader = {
        let backend = Arc::clone(&backend);
        tokio::spawn(async move {
            backend
                .read(move |db| {
                    let before = db.query("SELECT count(*) FROM t", &[])?;
                    read_once.send(()).unwrap();
                    wrote.blocking_recv().unwrap();
                    let after = db.query("SELECT count(*) FROM t", &[])?;
                    Ok((before, after))
                })
                .await
        })
    };
    oneshot_within(first_read, "the first read").await;
    execute(&backend, "INSERT INTO t (v) VALUES (1)").await;
    wrote_tx.send(()).unwrap();
    let (before, after) = reader.await.unwrap().unwrap();
    assert_eq!(
        before, after,
        "a commit between two statements of a read is not seen"
    );

    let write_in_read = backend
        .read(|db| db.execute("INSERT INTO t (v) VALUES (2)", &[]))
        .await;
    assert!(
        matches!(&write_in_read, Err(Error::Backend(m)) if m.contains("read-only")),
        "{write_in_read:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Locks between writers

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_lock_makes_a_second_writer_wait_for_the_first_to_commit() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let backend = open(&database);
    execute(
        &backend,
        "INSERT INTO sessions (id, created_at) VALUES ('ses_a', 0)",
    )
    .await;

    let (locked, first_locked) = oneshot::channel();
    let (release, released) = oneshot::channel::<()>();
    let first = {
        let backend = Arc::clone(&backend);
        tokio::spawn(async move {
            backend
                .write(move |db| {
                    db.lock_session("ses_a")?;
                    db.execute("UPDATE sessions SET last_seq = 1 WHERE id = 'ses_a'", &[])?;
                    locked.send(()).unwrap();
                    released.blocking_recv().unwrap();
                    Ok(())
                })
                .await
        })
    };
    oneshot_within(first_locked, "the first writer's lock").await;

    let second = {
        let backend = Arc::clone(&backend);
        tokio::spawn(async move {
            backend
                .write(|db| {
                    db.lock_session("ses_a")?;
                    db.query_opt("SELECT last_seq FROM sessions WHERE id = 'ses_a'", &[])?
                        .expect("the session exists")
                        .int(0)
                })
                .await
        })
    };
    wait_for_count(
        &backend,
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
        1,
        "the second writer waiting for the session's lock",
    )
    .await;
    assert!(!second.is_finished(), "the second writer waits");

    release.send(()).unwrap();
    first.await.unwrap().unwrap();
    let seen = second.await.unwrap().unwrap();
    assert_eq!(
        seen, 1,
        "the second writer went on only once the first had committed, and saw its write"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_take_different_rows() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let backend = open(&database);
    execute(
        &backend,
        "INSERT INTO step_jobs (run_id, step_index, phase, attempt, epoch, ready_at)
         VALUES ('run_a', 0, 'model', 0, 0, 1), ('run_b', 0, 'model', 0, 0, 2)",
    )
    .await;
    let claim = |db: &dyn ratchet_store_sql::Db| -> Result<String, Error> {
        let sql = format!(
            "SELECT run_id FROM step_jobs WHERE ready_at <= ?1 ORDER BY ready_at LIMIT 1{}",
            db.skip_locked()
        );
        let mut row = db
            .query_opt(&sql, &params![10_i64])?
            .expect("a job is claimable");
        let run_id = row.text(0)?;
        db.execute(
            "UPDATE step_jobs SET lease_owner = 'me', epoch = epoch + 1 WHERE run_id = ?1",
            &params![&run_id],
        )?;
        Ok(run_id)
    };

    let (claimed, first_claimed) = oneshot::channel();
    let (release, released) = oneshot::channel::<()>();
    let first = {
        let backend = Arc::clone(&backend);
        tokio::spawn(async move {
            backend
                .write(move |db| {
                    let run_id = claim(db)?;
                    claimed.send(()).unwrap();
                    released.blocking_recv().unwrap();
                    Ok(run_id)
                })
                .await
        })
    };
    oneshot_within(first_claimed, "the first claim").await;
    let second = tokio::time::timeout(DEADLINE, backend.write(claim))
        .await
        .expect("a claim passes over a row another claim holds instead of waiting for it")
        .unwrap();
    release.send(()).unwrap();
    let first = first.await.unwrap().unwrap();
    assert_eq!((first.as_str(), second.as_str()), ("run_a", "run_b"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_is_reported_as_a_conflict_worth_retrying() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let backend = open(&database);
    execute(
        &backend,
        "INSERT INTO sessions (id, created_at) VALUES ('ses_a', 0), ('ses_b', 0)",
    )
    .await;
    // Each writer takes one session, waits until the other has taken the other, then asks
    // for the other's: PostgreSQL breaks the cycle by failing one of them.
    let (a_taken, a_has) = oneshot::channel();
    let (b_taken, b_has) = oneshot::channel();
    let writer = |mine: &'static str,
                  theirs: &'static str,
                  taken: oneshot::Sender<()>,
                  other: oneshot::Receiver<()>| {
        let backend = Arc::clone(&backend);
        tokio::spawn(async move {
            backend
                .write(move |db| {
                    // A lock goes out with the body's next statement that answers.
                    db.lock_session(mine)?;
                    db.query("SELECT 1", &[])?;
                    taken.send(()).unwrap();
                    other.blocking_recv().unwrap();
                    db.lock_session(theirs)
                })
                .await
        })
    };
    let a = writer("ses_a", "ses_b", a_taken, b_has);
    let b = writer("ses_b", "ses_a", b_taken, a_has);
    let outcomes = [a.await.unwrap(), b.await.unwrap()];
    let failures: Vec<&Error> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
    assert_eq!(failures.len(), 1, "one writer wins: {outcomes:?}");
    let message = failures[0].to_string();
    assert!(
        message.contains("deadlock") && message.contains("tried again"),
        "{message}"
    );
}

// ---------------------------------------------------------------------------------------
// Changes of other processes

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announcements_reach_other_processes_once_committed_and_never_their_sender() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let one = open(&database);
    let two = open(&database);
    let mut heard_by_one = one.changes().expect("PostgreSQL follows other processes");
    let mut heard_by_two = two.changes().expect("PostgreSQL follows other processes");
    for heard in [&mut heard_by_one, &mut heard_by_two] {
        assert_eq!(
            next(heard).await,
            Change::Missed,
            "a follower starts by saying it may have missed what came before it listened"
        );
    }
    let events = |session_id: &'static str, first_seq: i64, last_seq: i64| {
        move |db: &dyn ratchet_store_sql::Db| {
            db.announce(Announcement::Events {
                session_id,
                first_seq,
                last_seq,
            })
        }
    };

    one.write(move |db| {
        db.announce(Announcement::JobsReady)?;
        events("ses_one", 1, 3)(db)
    })
    .await
    .unwrap();
    let rolled_back = one
        .write(move |db| {
            events("ses_never", 9, 9)(db)?;
            Err::<(), _>(Error::Invalid("rolled back".into()))
        })
        .await;
    assert!(rolled_back.is_err());
    one.write(events("ses_after", 4, 4)).await.unwrap();
    two.write(events("ses_two", 1, 1)).await.unwrap();

    let session = |id: &str| ratchet_core::SessionId::parse(id).unwrap();
    assert_eq!(next(&mut heard_by_two).await, Change::JobsReady);
    assert_eq!(
        next(&mut heard_by_two).await,
        Change::Events {
            session_id: session("ses_one"),
            first_seq: 1,
            last_seq: 3
        }
    );
    assert_eq!(
        next(&mut heard_by_two).await,
        Change::Events {
            session_id: session("ses_after"),
            first_seq: 4,
            last_seq: 4
        },
        "a rolled back transaction announced nothing, and a process does not hear itself"
    );
    assert_eq!(
        next(&mut heard_by_one).await,
        Change::Events {
            session_id: session("ses_two"),
            first_seq: 1,
            last_seq: 1
        },
        "a process hears the others but not itself"
    );
}

const LISTENERS: &str = "SELECT count(*) FROM pg_stat_activity
                         WHERE datname = current_database() AND query LIKE 'LISTEN%'";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_whose_connection_is_killed_reconnects_and_says_it_missed_changes() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let backend = open(&database);
    let other = open(&database);
    let mut changes = backend.changes().unwrap();
    assert_eq!(next(&mut changes).await, Change::Missed, "listening");

    let killed = backend
        .write(|db| {
            db.query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                 WHERE datname = current_database() AND query LIKE 'LISTEN%'",
                &[],
            )
        })
        .await
        .unwrap();
    assert_eq!(
        killed,
        [Row::new(vec![Value::Int(1)])],
        "one listener was killed"
    );
    assert_eq!(
        next(&mut changes).await,
        Change::Missed,
        "after reconnecting, the follower owns up to what it may have missed"
    );
    other
        .write(|db| db.announce(Announcement::JobsReady))
        .await
        .unwrap();
    assert_eq!(
        next(&mut changes).await,
        Change::JobsReady,
        "listening again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_stops_listening_once_its_stream_is_dropped() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let backend = open(&database);
    let mut changes = backend.changes().unwrap();
    assert_eq!(next(&mut changes).await, Change::Missed);
    assert_eq!(count(&backend, LISTENERS).await, 1);
    drop(changes);
    wait_for_count(&backend, LISTENERS, 0, "the follower's connection closing").await;
}

// ---------------------------------------------------------------------------------------
// Search

/// Inserts a session of `tenant` and its messages `(role, visibility, content)`, returning
/// each message's position.
async fn session_with(
    backend: &PgBackend,
    session: &'static str,
    tenant: &'static str,
    messages: &[(&'static str, &'static str, &'static str)],
) -> Vec<i64> {
    let messages = messages.to_vec();
    backend
        .write(move |db| {
            db.execute(
                "INSERT INTO sessions (id, created_at, tenant) VALUES (?1, 0, ?2)",
                &params![session, tenant],
            )?;
            let mut positions = Vec::new();
            for (n, (role, visibility, content)) in messages.into_iter().enumerate() {
                let id = format!("msg_{session}_{n}");
                let mut row = db
                    .query_opt(
                        "INSERT INTO messages
                             (id, session_id, run_id, role, content, visibility, origin, created_at)
                         VALUES (?1, ?2, 'run_r', ?3, ?4, ?5, 'user', ?6)
                         RETURNING rowid",
                        &params![&id, session, role, content, visibility, 100 + n as i64],
                    )?
                    .expect("an insert returns its row");
                positions.push(row.int(0)?);
            }
            Ok(positions)
        })
        .await
        .unwrap()
}

async fn search(
    backend: &PgBackend,
    scope: &SearchScope,
    query: &str,
    limit: u32,
) -> Vec<MessageHit> {
    backend
        .search_messages(scope.clone(), query.to_owned(), limit)
        .await
        .unwrap_or_else(|e| panic!("search {query:?} in {scope:?}: {e}"))
}

fn snippets(hits: &[MessageHit]) -> Vec<&str> {
    hits.iter().map(|h| h.snippet.as_str()).collect()
}

fn in_session(id: &str) -> SearchScope {
    SearchScope::Session(ratchet_core::SessionId::parse(id).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_stems_words_and_finds_messages_matching_any_of_them() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let backend = open(&database);
    let positions = session_with(
        &backend,
        "ses_s",
        "t",
        &[
            ("user", "visible", "the zebra grazes"),
            ("assistant", "visible", "a pelican flies"),
            ("user", "visible", "nothing to see"),
        ],
    )
    .await;
    let scope = in_session("ses_s");

    let hits = search(&backend, &scope, "zebras", 10).await;
    assert_eq!(
        snippets(&hits),
        ["the **zebra** grazes"],
        "zebras finds zebra"
    );
    let hit = &hits[0];
    assert_eq!(
        (
            hit.message_id.as_str(),
            hit.position,
            hit.created_at,
            hit.run_id.as_str()
        ),
        ("msg_ses_s_0", positions[0], 100, "run_r"),
        "a hit says where its message lies"
    );
    assert_eq!(hit.role, ratchet_core::Role::User);

    let mut found = snippets(&search(&backend, &scope, "grazing pelicans", 10).await)
        .into_iter()
        .map(str::to_owned)
        .collect::<Vec<_>>();
    found.sort();
    assert_eq!(
        found,
        ["a **pelican** flies", "the zebra **grazes**"],
        "a message matching any word is found"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_ranks_messages_matching_more_words_first_and_keeps_the_limit() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let backend = open(&database);
    session_with(
        &backend,
        "ses_r",
        "t",
        &[
            ("user", "visible", "the quokka ate bread today"),
            ("user", "visible", "the cat ate fish today"),
            ("user", "visible", "the quokka ate marzipan today"),
            ("assistant", "visible", "the dog ate meat today"),
        ],
    )
    .await;
    let scope = in_session("ses_r");

    let hits = search(&backend, &scope, "marzipan quokka", 10).await;
    assert_eq!(
        snippets(&hits),
        [
            "the **quokka** ate **marzipan** today",
            "the **quokka** ate bread today"
        ]
    );
    assert!(hits[0].rank < hits[1].rank, "lower is better: {hits:?}");
    assert_eq!(
        search(&backend, &scope, "marzipan quokka", 1).await,
        hits[..1]
    );
    assert_eq!(search(&backend, &scope, "today", 10).await.len(), 4);
    assert_eq!(search(&backend, &scope, "today", 3).await.len(), 3);
    assert!(search(&backend, &scope, "today", 0).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_reads_any_input_as_plain_words() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let backend = open(&database);
    session_with(
        &backend,
        "ses_h",
        "t",
        &[(
            "user",
            "visible",
            r#"he said "halt" -- NEAR(the door): see *notes* & more"#,
        )],
    )
    .await;
    let scope = in_session("ses_h");

    for query in [
        "\"",
        "\"\"",
        "*",
        "-",
        "--",
        ":",
        "NEAR(",
        "NEAR(the door, 2)",
        "'",
        "''",
        "&|!()",
        "!",
        "&",
        "|",
        "<->",
        "a:*",
        "content:door",
        "AND",
        "OR NOT",
        "(",
        ")",
        "^door",
        "{content}",
        "\\",
        "$1",
        "?1",
        "\u{0}x",
        "x\u{0}",
    ] {
        if let Err(e) = backend
            .search_messages(scope.clone(), query.to_owned(), 10)
            .await
        {
            panic!("query {query:?} must not fail: {e}");
        }
    }
    for query in [
        "\"halt",
        "door:",
        "*notes*",
        "NEAR(the",
        "halt\" OR \"x",
        "halt\u{0}\"",
        "&|!()door",
        "'door'",
        "door:*",
    ] {
        let hits = search(&backend, &scope, query, 10).await;
        assert_eq!(hits.len(), 1, "query {query:?} finds the message: {hits:?}");
    }
    for query in ["", "   ", "\n\t", "\u{0}"] {
        match backend
            .search_messages(scope.clone(), query.to_owned(), 10)
            .await
        {
            Err(Error::Invalid(_)) => {}
            other => panic!("query {query:?}: expected Error::Invalid, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_keeps_to_its_scope_and_to_visible_user_and_assistant_messages() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let backend = open(&database);
    session_with(
        &backend,
        "ses_mine",
        "tenant_a",
        &[
            ("user", "visible", "my wombat digs"),
            ("user", "hidden", "a hidden wombat"),
            ("tool", "visible", "wombat facts from a tool"),
            ("system", "visible", "system wombat"),
        ],
    )
    .await;
    session_with(
        &backend,
        "ses_theirs",
        "tenant_a",
        &[("assistant", "visible", "their wombat sleeps")],
    )
    .await;
    session_with(
        &backend,
        "ses_other",
        "tenant_b",
        &[("user", "visible", "another tenant's wombat")],
    )
    .await;

    assert_eq!(
        snippets(&search(&backend, &in_session("ses_mine"), "wombat", 10).await),
        ["my **wombat** digs"],
        "hidden messages, tool results and other sessions are never found"
    );
    let mut tenant: Vec<String> = search(
        &backend,
        &SearchScope::Tenant("tenant_a".into()),
        "wombat",
        10,
    )
    .await
    .into_iter()
    .map(|h| h.session_id.to_string())
    .collect();
    tenant.sort();
    assert_eq!(
        tenant,
        ["ses_mine", "ses_theirs"],
        "a tenant search sees its sessions only"
    );
    assert_eq!(
        snippets(
            &search(
                &backend,
                &SearchScope::Tenant("tenant_b".into()),
                "wombat",
                10
            )
            .await
        ),
        ["another tenant's **wombat**"]
    );
    assert!(
        search(
            &backend,
            &SearchScope::Tenant("nobody".into()),
            "wombat",
            10
        )
        .await
        .is_empty()
    );
}

/// PostgreSQL text cannot hold a NUL: text that has one (a model's or a tool's output) is
/// still written, with U+FFFD in the NUL's place, instead of failing its whole commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_with_a_nul_is_written_with_a_replacement_character() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let backend = open(&database);
    execute(&backend, "CREATE TABLE notes (body TEXT NOT NULL)").await;
    backend
        .write(|db| db.execute("INSERT INTO notes (body) VALUES (?1)", &params!["a\0b"]))
        .await
        .expect("text with a NUL is written");
    let mut rows = query(&backend, "SELECT body FROM notes").await;
    assert_eq!(rows[0].text(0).unwrap(), "a\u{FFFD}b");
}

// ---------------------------------------------------------------------------------------
// TLS
//
// The test server is Debian's PostgreSQL with `ssl = on` and the snakeoil certificate made
// at install: self-signed, so its own root, and valid for the name `localhost` only.

/// The certificate the test server presents.
const SERVER_CERT: &str = "/etc/ssl/certs/ssl-cert-snakeoil.pem";

/// A root certificate that signed no server.
const UNRELATED_ROOT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/unrelated-root.pem"
);

/// `url` with its options replaced by `options`, so that a test decides them all.
fn with_options(url: &str, options: &str) -> String {
    let base = url.split_once('?').map_or(url, |(base, _)| base);
    format!("{base}?{options}")
}

/// `url` with its host replaced, its port and the rest kept.
fn with_host(url: &str, host: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    let (user, address) = match authority.rsplit_once('@') {
        Some((user, address)) => (format!("{user}@"), address),
        None => (String::new(), authority),
    };
    let port = address.rsplit_once(':').map_or("", |(_, port)| port);
    let port = if port.is_empty() {
        String::new()
    } else {
        format!(":{port}")
    };
    format!("{scheme}://{user}{host}{port}{path}")
}

/// Whether the server presents `SERVER_CERT`, which these tests trust. When it does not, the
/// test is skipped on a developer's machine and fails in CI, as `TestDatabase` does.
async fn presents_server_cert(database: &TestDatabase) -> bool {
    let plain = PgBackend::open_url(&with_options(database.url(), "sslmode=disable")).unwrap();
    let mut rows = query(
        &plain,
        "SELECT current_setting('ssl'), current_setting('ssl_cert_file')",
    )
    .await;
    let (ssl, cert_file) = (rows[0].text(0).unwrap(), rows[0].text(1).unwrap());
    if ssl == "on" && cert_file == SERVER_CERT && std::path::Path::new(SERVER_CERT).exists() {
        return true;
    }
    let why = format!(
        "the server has ssl = {ssl} with {cert_file:?}; these tests expect ssl = on with \
         {SERVER_CERT} on this machine"
    );
    assert!(std::env::var("CI").as_deref() != Ok("true"), "{why}");
    eprintln!("skipped: {why}");
    false
}

/// Whether the connection serving a read is encrypted, as the server sees it.
async fn encrypted(backend: &PgBackend) -> bool {
    count(
        backend,
        "SELECT ssl::int FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
    )
    .await
        == 1
}

/// Opens `url` and starts its change follower, then counts the connections of its
/// application that are encrypted, and those that are not.
async fn connections_by_encryption(url: &str) -> (i64, i64) {
    let backend = PgBackend::open_url(url).unwrap_or_else(|e| panic!("open {url}: {e}"));
    let mut changes = backend.changes().unwrap();
    assert_eq!(
        next(&mut changes).await,
        Change::Missed,
        "the follower listens"
    );
    let mut rows = query(
        &backend,
        "SELECT count(*) FILTER (WHERE s.ssl), count(*) FILTER (WHERE NOT s.ssl)
         FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
         WHERE a.datname = current_database()
           AND a.application_name = current_setting('application_name')",
    )
    .await;
    (rows[0].int(0).unwrap(), rows[0].int(1).unwrap())
}

/// The error opening `url` gives.
fn open_error(url: &str) -> Error {
    match PgBackend::open_url(url) {
        Err(error) => error,
        Ok(_) => panic!("{url} must not open"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_says_whether_every_connection_is_encrypted() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    if !presents_server_cert(&database).await {
        return;
    }
    let required = with_options(database.url(), "sslmode=require");
    let backend = PgBackend::open_url(&required).unwrap();
    assert!(encrypted(&backend).await, "sslmode=require encrypts");
    let plain = PgBackend::open_url(&with_options(database.url(), "sslmode=disable")).unwrap();
    assert!(!encrypted(&plain).await, "sslmode=disable does not");
    assert_eq!(
        ratchet_postgres::migrate(&PgOptions::from_url(&required).unwrap())
            .unwrap()
            .to,
        ratchet_postgres::SCHEMA_VERSION
    );

    // The pool's connection and the follower's, told apart from other tests' by name.
    for (options, expected) in [
        ("sslmode=require&application_name=tls_require", (2, 0)),
        ("application_name=tls_default", (2, 0)),
        ("sslmode=disable&application_name=tls_disable", (0, 2)),
    ] {
        assert_eq!(
            connections_by_encryption(&with_options(database.url(), options)).await,
            expected,
            "{options}: (encrypted, plain)"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_verify_ca_trusts_the_given_root_and_no_other() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    if !presents_server_cert(&database).await {
        return;
    }
    // Connected by address: the chain is checked, the name is not.
    let url = with_host(database.url(), "127.0.0.1");
    for mode in ["verify-ca", "require"] {
        let trusted = with_options(&url, &format!("sslmode={mode}&sslrootcert={SERVER_CERT}"));
        let backend =
            PgBackend::open_url(&trusted).unwrap_or_else(|e| panic!("open {trusted}: {e}"));
        assert!(encrypted(&backend).await, "{mode}");

        let untrusted = with_options(
            &url,
            &format!("sslmode={mode}&sslrootcert={UNRELATED_ROOT}"),
        );
        match open_error(&untrusted) {
            Error::Backend(message) => assert!(
                message.contains(&format!("sslmode={mode}, sslrootcert={UNRELATED_ROOT}"))
                    && message.contains("invalid peer certificate: UnknownIssuer"),
                "{mode}: {message}"
            ),
            other => panic!("{mode}: expected a refused certificate, got {other}"),
        }
        assert!(
            PgOptions::from_url(&untrusted)
                .and_then(|options| ratchet_postgres::migrate(&options))
                .is_err(),
            "{mode}: migrating connects the same way"
        );
    }

    let missing = with_options(&url, "sslmode=verify-ca&sslrootcert=/nowhere/root.pem");
    match open_error(&missing) {
        Error::BadUrl { reason, .. } => {
            assert!(
                reason.contains("/nowhere/root.pem cannot be read"),
                "{reason}"
            )
        }
        other => panic!("a missing root file: expected BadUrl, got {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_verify_full_also_checks_the_host_name() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    if !presents_server_cert(&database).await {
        return;
    }
    let verified = format!("sslmode=verify-full&sslrootcert={SERVER_CERT}");
    let named = with_options(&with_host(database.url(), "localhost"), &verified);
    let backend = PgBackend::open_url(&named).unwrap_or_else(|e| panic!("open {named}: {e}"));
    assert!(encrypted(&backend).await);
    let mut changes = backend.changes().unwrap();
    assert_eq!(
        next(&mut changes).await,
        Change::Missed,
        "the follower connects the same way"
    );

    let by_address = with_options(&with_host(database.url(), "127.0.0.1"), &verified);
    match open_error(&by_address) {
        Error::Backend(message) => assert!(
            message.contains(
                "certificate not valid for name \"127.0.0.1\"; certificate is only valid for \
                 DnsName(\"localhost\")"
            ),
            "{message}"
        ),
        other => panic!("a name the certificate does not hold: expected Backend, got {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_write_that_fails_fails_its_transaction_and_keeps_nothing() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let backend = open(&database);
    let insert = "INSERT INTO sessions (id, created_at) VALUES (?1, 0)";
    // Failing with the next statement that answers: the body hears it there.
    let heard = backend
        .write(move |db| {
            db.write(insert, &params!["ses_a"])?;
            db.write(insert, &params!["ses_a"])?;
            db.query("SELECT 1", &[])
        })
        .await
        .expect_err("the duplicate insert fails the query it went with");
    let heard = heard.to_string();
    assert!(
        heard.contains("duplicate key") && heard.contains("INSERT INTO sessions"),
        "the error names the held statement that failed: {heard}"
    );
    // Failing with the COMMIT: the body returned Ok, and the write still fails.
    let committed = backend
        .write(move |db| {
            db.write(insert, &params!["ses_b"])?;
            db.write(insert, &params!["ses_b"])
        })
        .await
        .expect_err("the duplicate insert fails the commit it went with");
    assert!(
        committed.to_string().contains("duplicate key"),
        "{committed}"
    );
    assert_eq!(count(&backend, "SELECT count(*) FROM sessions").await, 0);
    // The connection serves the next transaction, whose held writes commit.
    backend
        .write(move |db| db.write(insert, &params!["ses_c"]))
        .await
        .unwrap();
    assert_eq!(count(&backend, "SELECT count(*) FROM sessions").await, 1);
}

/// What a column holds, in terms both backends share: SQLite's declared type and PostgreSQL's
/// `data_type`, each mapped to its kind.
fn column_kind(declared: &str) -> &'static str {
    match declared.to_ascii_lowercase().as_str() {
        "integer" | "bigint" => "integer",
        "text" => "text",
        "real" | "double precision" => "real",
        "blob" | "bytea" => "bytes",
        other => panic!("a column type the parity test does not know: {other:?}"),
    }
}

/// Table and column, to its kind and whether it refuses NULL.
type Columns = BTreeMap<(String, String), (&'static str, bool)>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_and_postgresql_migrations_build_the_same_tables_and_columns() {
    let Some(database) = TestDatabase::create() else {
        return;
    };
    let backend = open(&database);
    let mut postgres = Columns::new();
    for mut row in query(
        &backend,
        "SELECT table_name::text, column_name::text, data_type::text, is_nullable::text
         FROM information_schema.columns WHERE table_schema = current_schema()",
    )
    .await
    {
        let key = (row.text(0).unwrap(), row.text(1).unwrap());
        let kind = column_kind(&row.text(2).unwrap());
        postgres.insert(key, (kind, row.text(3).unwrap() == "NO"));
    }

    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("parity.db").display());
    ratchet_sqlite::migrate(&ratchet_sqlite::SqliteOptions::from_url(&url).unwrap()).unwrap();
    let sqlite_db = rusqlite::Connection::open(dir.path().join("parity.db")).unwrap();
    let mut sqlite = Columns::new();
    let tables: Vec<String> = sqlite_db
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    for table in tables {
        let mut columns = sqlite_db
            .prepare("SELECT name, type, \"notnull\" OR pk > 0 FROM pragma_table_info(?1)")
            .unwrap();
        let rows = columns
            .query_map([&table], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, bool>(2)?,
                ))
            })
            .unwrap();
        for row in rows {
            let (column, declared, not_null) = row.unwrap();
            // A full-text index's shadow tables declare no types.
            let kind = if declared.is_empty() {
                "text"
            } else {
                column_kind(&declared)
            };
            sqlite.insert((table.clone(), column), (kind, not_null));
        }
    }

    let keys = |columns: &Columns, other: &Columns| -> Vec<String> {
        (columns.keys())
            .filter(|key| !other.contains_key(*key))
            .map(|(table, column)| format!("{table}.{column}"))
            .collect()
    };
    // What each backend does its own way, and only that.
    assert_eq!(
        keys(&sqlite, &postgres),
        [
            // Message search: SQLite's FTS5 index and how far it has indexed; PostgreSQL
            // searches an expression index over the messages themselves.
            "messages_fts.content",
            "messages_fts_config.k",
            "messages_fts_config.v",
            "messages_fts_data.block",
            "messages_fts_data.id",
            "messages_fts_docsize.id",
            "messages_fts_docsize.sz",
            "messages_fts_idx.pgno",
            "messages_fts_idx.segid",
            "messages_fts_idx.term",
            "messages_fts_progress.indexed_through",
        ],
        "columns only SQLite's migrations make"
    );
    assert_eq!(
        keys(&postgres, &sqlite),
        [
            // SQLite's implicit rowid, which the shared statements order by, made explicit.
            "messages.rowid",
            // SQLite keeps its schema version in `PRAGMA user_version`.
            "ratchet_schema.version",
            "runs.rowid",
        ],
        "columns only PostgreSQL's migrations make"
    );
    let differ: Vec<String> = (sqlite.iter())
        .filter_map(|(key, lite)| {
            let pg = postgres.get(key)?;
            (pg != lite).then(|| format!("{}.{}: SQLite {lite:?}, PostgreSQL {pg:?}", key.0, key.1))
        })
        .collect();
    assert!(
        differ.is_empty(),
        "a column both backends have holds the same kind and refuses NULL alike: {differ:#?}"
    );
}
