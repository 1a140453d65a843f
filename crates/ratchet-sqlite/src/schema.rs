//! Embedded migrations, applied in order and recorded in `PRAGMA user_version`.

use rusqlite::Connection;

use crate::{Result, backend};

/// Each entry moves the schema from version `i` to `i + 1`. Never edit a released entry:
/// append a new one.
const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE sessions (
    id            TEXT PRIMARY KEY,
    created_at    INTEGER NOT NULL,
    last_seq      INTEGER NOT NULL DEFAULT 0,
    active_run_id TEXT
);

CREATE TABLE runs (
    id               TEXT PRIMARY KEY,
    session_id       TEXT NOT NULL REFERENCES sessions(id),
    status           TEXT NOT NULL,
    step_index       INTEGER NOT NULL,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    stop_reason      TEXT,
    -- Frozen at creation; no statement ever updates it.
    config_json      TEXT NOT NULL,
    state_json       TEXT NOT NULL,
    -- The user message that starts the run, inserted into history when the run starts.
    input_json       TEXT NOT NULL,
    created_at       INTEGER NOT NULL,
    finished_at      INTEGER
);
CREATE INDEX runs_by_session ON runs(session_id, status);

CREATE TABLE messages (
    id              TEXT PRIMARY KEY,
    session_id      TEXT NOT NULL,
    run_id          TEXT NOT NULL,
    role            TEXT NOT NULL,
    content         TEXT NOT NULL,
    tool_calls_json TEXT,
    tool_call_id    TEXT,
    visibility      TEXT NOT NULL,
    origin          TEXT NOT NULL,
    created_at      INTEGER NOT NULL
);
CREATE INDEX messages_by_session ON messages(session_id);

CREATE TABLE steps (
    run_id       TEXT NOT NULL,
    step_index   INTEGER NOT NULL,
    instruction  TEXT NOT NULL,
    started_at   INTEGER NOT NULL,
    finished_at  INTEGER NOT NULL,
    summary_json TEXT NOT NULL,
    PRIMARY KEY (run_id, step_index)
) WITHOUT ROWID;

CREATE TABLE events (
    session_id   TEXT NOT NULL,
    seq          INTEGER NOT NULL,
    run_id       TEXT,
    kind         TEXT NOT NULL,
    payload_json TEXT NOT NULL,
    created_at   INTEGER NOT NULL,
    PRIMARY KEY (session_id, seq)
) WITHOUT ROWID;

-- The transactional outbox of the execution bus. A job is claimable when `ready_at` has
-- passed: it is the lease expiry while held, the retry time after a failed attempt.
CREATE TABLE step_jobs (
    run_id      TEXT NOT NULL,
    step_index  INTEGER NOT NULL,
    phase       TEXT NOT NULL,
    attempt     INTEGER NOT NULL,
    epoch       INTEGER NOT NULL,
    lease_owner TEXT,
    ready_at    INTEGER NOT NULL,
    PRIMARY KEY (run_id, step_index)
) WITHOUT ROWID;
CREATE INDEX step_jobs_ready ON step_jobs(ready_at);

CREATE TABLE intents (
    run_id          TEXT NOT NULL,
    step_index      INTEGER NOT NULL,
    slot            INTEGER NOT NULL,
    kind            TEXT NOT NULL,
    name            TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    attempts        INTEGER NOT NULL,
    outcome_json    TEXT,
    started_at      INTEGER NOT NULL,
    finished_at     INTEGER,
    PRIMARY KEY (run_id, step_index, slot)
) WITHOUT ROWID;
"#,
    r#"
ALTER TABLE sessions ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default';
ALTER TABLE sessions ADD COLUMN agent TEXT;
ALTER TABLE sessions ADD COLUMN metadata_json TEXT;
CREATE INDEX sessions_by_tenant ON sessions(tenant, id);
CREATE INDEX runs_by_session_id ON runs(session_id, id);
CREATE INDEX events_by_run ON events(run_id, seq);
"#,
    r#"
-- Every event of a run lies in its session's range of the primary key: reading a run's events
-- through it costs less than maintaining a second index on every event written.
DROP INDEX events_by_run;
"#,
    r#"
-- One row per gated tool batch. `status` is 'pending' until answered ('decided' or
-- 'aborted'); a pending approval whose run has ended reads as 'cancelled'.
CREATE TABLE approvals (
    position    INTEGER PRIMARY KEY,
    id          TEXT NOT NULL UNIQUE,
    run_id      TEXT NOT NULL,
    session_id  TEXT NOT NULL,
    status      TEXT NOT NULL,
    calls_json  TEXT NOT NULL,
    answer_json TEXT,
    created_at  INTEGER NOT NULL,
    decided_at  INTEGER
);
CREATE INDEX approvals_by_status ON approvals(status, position);
"#,
    r#"
-- Messages sent with multitask "steer", waiting for the active run's next model call. If
-- that run ends first, each becomes a queued run with `run_id`, in the order they were sent.
CREATE TABLE steers (
    position    INTEGER PRIMARY KEY,
    message_id  TEXT NOT NULL UNIQUE,
    session_id  TEXT NOT NULL,
    run_id      TEXT NOT NULL,
    content     TEXT NOT NULL,
    config_json TEXT NOT NULL,
    created_at  INTEGER NOT NULL
);
CREATE INDEX steers_by_session ON steers(session_id, position);
-- Queued runs start in the order their messages were sent, steers that fell through included.
CREATE INDEX runs_queued ON runs(session_id, status, created_at);
"#,
    r#"
-- Full-text index of message contents. External content: the text is stored once, in
-- `messages`, and the index refers to its rows by rowid. Messages are only ever inserted, so
-- one trigger keeps the index whole; the rebuild indexes the messages written before it.
-- (A rowid that is not an INTEGER PRIMARY KEY may be renumbered by VACUUM: rebuild the index
-- after one.)
CREATE VIRTUAL TABLE messages_fts USING fts5(
    content,
    content = 'messages',
    tokenize = 'porter unicode61 remove_diacritics 2'
);
CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts(rowid, content) VALUES (new.rowid, new.content);
END;
INSERT INTO messages_fts(messages_fts) VALUES ('rebuild');
"#,
    r#"
-- A summary written by a compaction keeps the messages from this position on; in the model's
-- view it replaces every message before it.
ALTER TABLE messages ADD COLUMN keeps_from INTEGER;
CREATE INDEX messages_summaries ON messages(session_id) WHERE keeps_from IS NOT NULL;
"#,
    r#"
-- The search index is no longer kept by a trigger inside every step's transaction (FTS5 flushes
-- at each savepoint, and the writer takes one per operation): a search first indexes what was
-- written since `indexed_through`, on the writer, then reads.
DROP TRIGGER messages_fts_insert;
CREATE TABLE messages_fts_progress (indexed_through INTEGER NOT NULL);
INSERT INTO messages_fts_progress SELECT COALESCE(MAX(rowid), 0) FROM messages;
"#,
    r#"
-- A tool result whose call failed.
ALTER TABLE messages ADD COLUMN is_error INTEGER NOT NULL DEFAULT 0;
"#,
    r#"
-- Sub-agents. A child run lives in a session of its own, below its root session: writes to any
-- session of a tree lock the root's row. NULL parents and roots mean "a root itself".
ALTER TABLE sessions ADD COLUMN parent_session_id TEXT;
ALTER TABLE sessions ADD COLUMN root_session_id TEXT;
ALTER TABLE runs ADD COLUMN parent_run_id TEXT;
ALTER TABLE runs ADD COLUMN parent_step INTEGER;
ALTER TABLE runs ADD COLUMN parent_slot INTEGER;
ALTER TABLE runs ADD COLUMN task_index INTEGER;
ALTER TABLE runs ADD COLUMN root_run_id TEXT;
ALTER TABLE runs ADD COLUMN agent TEXT;
ALTER TABLE runs ADD COLUMN depth INTEGER NOT NULL DEFAULT 0;
CREATE INDEX runs_children ON runs(parent_run_id, parent_step) WHERE parent_run_id IS NOT NULL;
CREATE INDEX runs_by_root ON runs(root_run_id) WHERE root_run_id IS NOT NULL;
CREATE INDEX sessions_by_root ON sessions(root_session_id) WHERE root_session_id IS NOT NULL;
-- Run quotas count the non-terminal runs.
CREATE INDEX runs_by_status ON runs(status);
"#,
    r#"
-- Background work and the inbox. A background run carries its `delegate` call's group; what it
-- reports lands in its root session's inbox. An event's place is taken when the work is
-- admitted ('reserved'), so an accepted run always has room to report. Rows are never deleted:
-- consumed, dead and superseded events stay as the audit trail.
ALTER TABLE runs ADD COLUMN inbox_group TEXT;
CREATE INDEX runs_by_inbox_group ON runs(inbox_group) WHERE inbox_group IS NOT NULL;
ALTER TABLE sessions ADD COLUMN archived_at INTEGER;
ALTER TABLE sessions ADD COLUMN deleted_at INTEGER;
-- User turns started since the session's last continuation turn (fairness).
ALTER TABLE sessions ADD COLUMN user_turns_in_a_row INTEGER NOT NULL DEFAULT 0;
CREATE TABLE inbox (
    id            INTEGER PRIMARY KEY,
    session_id    TEXT NOT NULL,
    kind          TEXT NOT NULL,
    status        TEXT NOT NULL,
    delivery      TEXT NOT NULL,
    parent_run_id TEXT NOT NULL,
    source_run_id TEXT,
    group_id      TEXT,
    -- Set once the event has something to report (NULL while reserved).
    payload_json  TEXT,
    -- A signal's: one per emitting call, and its dedupe key.
    call_key      TEXT UNIQUE,
    dedupe_key    TEXT,
    attempts      INTEGER NOT NULL DEFAULT 0,
    max_attempts  INTEGER NOT NULL,
    available_at  INTEGER,
    lease_run_id  TEXT,
    reason        TEXT,
    created_at    INTEGER NOT NULL,
    updated_at    INTEGER NOT NULL
);
CREATE INDEX inbox_by_session ON inbox(session_id, status, available_at);
CREATE INDEX inbox_due ON inbox(status, available_at);
CREATE INDEX inbox_by_source ON inbox(source_run_id) WHERE source_run_id IS NOT NULL;
CREATE INDEX inbox_by_group ON inbox(group_id) WHERE group_id IS NOT NULL;
CREATE INDEX inbox_by_lease ON inbox(lease_run_id) WHERE lease_run_id IS NOT NULL;
"#,
    r#"
-- Pause and resume. Like `cancel_requested`, the flag is the store's: a pause asked for while
-- a step is in flight, honoured by that step's commit.
ALTER TABLE runs ADD COLUMN pause_requested INTEGER NOT NULL DEFAULT 0;
"#,
    r#"
-- Webhooks, the observation plane's plugins. A cursor follows each session's events for each
-- webhook; a delivery is one event's trip to one webhook. Nothing here is read by a step.
CREATE TABLE webhooks (
    id           TEXT PRIMARY KEY,
    tenant       TEXT NOT NULL,
    url          TEXT NOT NULL,
    -- The event kinds it wants, a JSON array; NULL for every kind.
    events_json  TEXT,
    secret       TEXT NOT NULL,
    max_attempts INTEGER NOT NULL,
    created_at   INTEGER NOT NULL
);
CREATE INDEX webhooks_by_tenant ON webhooks(tenant, created_at);
CREATE TABLE webhook_cursors (
    webhook_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    -- The session's events up to here were queued (or passed over, when not wanted).
    seq        INTEGER NOT NULL,
    PRIMARY KEY (webhook_id, session_id)
);
CREATE TABLE webhook_deliveries (
    id               INTEGER PRIMARY KEY,
    webhook_id       TEXT NOT NULL,
    session_id       TEXT NOT NULL,
    seq              INTEGER NOT NULL,
    event_kind       TEXT NOT NULL,
    status           TEXT NOT NULL,
    attempts         INTEGER NOT NULL DEFAULT 0,
    available_at     INTEGER,
    lease_owner      TEXT,
    lease_expires_at INTEGER,
    last_status      INTEGER,
    last_error       TEXT,
    delivered_at     INTEGER,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    UNIQUE (webhook_id, session_id, seq)
);
CREATE INDEX webhook_deliveries_open ON webhook_deliveries(webhook_id, session_id, seq)
    WHERE status IN ('pending', 'delivering');
CREATE INDEX webhook_deliveries_log ON webhook_deliveries(webhook_id, id);
"#,
    r#"
-- Webhook secrets are stored sealed from now on (`ratchet_store::secrets`: v1:<key id>:…).
-- Those written before are marked as being in clear; a process with a key seals them when it
-- starts (`seal_webhook_secrets`).
UPDATE webhooks SET secret = 'clear:' || secret;
"#,
    r#"
-- When a waiting run (for a human, for its children) passes its duration budget; NULL for a
-- run that is not waiting or has no budget. Idle workers end such runs `timed_out`.
ALTER TABLE runs ADD COLUMN deadline_at INTEGER;
CREATE INDEX runs_by_deadline ON runs(deadline_at) WHERE deadline_at IS NOT NULL;
"#,
    r#"
-- A run's frozen configuration is stored once for all the runs frozen with it (an agent's
-- runs share one): a run's row stays small, and a step's update of its state no longer
-- rewrites the configuration with it. `id` is the SHA-256 of the JSON; the runs created
-- before keep theirs under 'run:' and their own id. Rows are never updated.
CREATE TABLE run_configs (
    id          TEXT PRIMARY KEY,
    config_json TEXT NOT NULL
);
INSERT INTO run_configs (id, config_json) SELECT 'run:' || id, config_json FROM runs;
ALTER TABLE runs ADD COLUMN config_id TEXT NOT NULL DEFAULT '';
UPDATE runs SET config_id = 'run:' || id;
ALTER TABLE runs DROP COLUMN config_json;
"#,
    r#"
-- A continuation turn's messages are drafts of its run (`draft_of`) until it completes: other
-- turns' context, clients and search leave them out, so a failed or stopped attempt leaves
-- nothing in the session's history and the attempt that completes tells its reports once.
ALTER TABLE messages ADD COLUMN draft_of TEXT;
"#,
    r#"
-- An operator may requeue a dead letter (of the inbox, of a webhook's deliveries): when they
-- last did, so that a repeat of the request changes nothing.
ALTER TABLE inbox ADD COLUMN requeued_at INTEGER;
ALTER TABLE webhook_deliveries ADD COLUMN requeued_at INTEGER;
"#,
    r#"
-- When a pending report expires untold (its inbox policy's `max_age_ms` after it was written
-- or requeued); idle workers dead-letter it then.
ALTER TABLE inbox ADD COLUMN expires_at INTEGER;
CREATE INDEX inbox_expiring ON inbox(expires_at) WHERE status = 'pending';
"#,
    r#"
-- A session's title: its first message's opening words until someone renames it. Sessions
-- that have messages take their first visible user message's first line.
ALTER TABLE sessions ADD COLUMN title TEXT;
UPDATE sessions SET title = (
    SELECT substr(trim(CASE WHEN instr(m.content, char(10)) > 0
                            THEN substr(m.content, 1, instr(m.content, char(10)) - 1)
                            ELSE m.content END), 1, 80)
    FROM messages m
    WHERE m.session_id = sessions.id AND m.role = 'user' AND m.origin = 'user'
      AND m.visibility = 'visible'
    ORDER BY m.rowid LIMIT 1
);
"#,
    r#"
-- Requests sent with an `Idempotency-Key`, per tenant: what the key was first used for, who
-- holds it while the request is carried out (`attempt`, `held_until`), the effect its
-- transaction recorded and the response it was answered with. Swept once `expires_at` passed.
CREATE TABLE idempotent_requests (
    tenant TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    method TEXT NOT NULL,
    path TEXT NOT NULL,
    body_hash TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    held_until INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    effect_json TEXT,
    response_status INTEGER,
    response_body TEXT,
    PRIMARY KEY (tenant, idempotency_key)
);
CREATE INDEX idempotent_requests_expiry ON idempotent_requests(expires_at);
"#,
    r#"
-- A run forked from another records where from: the source run and the step it continues.
ALTER TABLE runs ADD COLUMN forked_from_run_id TEXT;
ALTER TABLE runs ADD COLUMN forked_from_step INTEGER;
"#,
    r#"
-- Schedules: a definition (its cadence, message, session, overlap and catch-up rules), the
-- configuration its runs are frozen with (in `run_configs`), and `next_fire_at`, before which
-- every slot has been decided. A row of `schedule_slots` per decided slot — fired, skipped or
-- refused — written in the transaction that starts its run: the primary key makes a slot fire
-- at most once whichever process reaches it. A run fired by a schedule names it and its slot.
CREATE TABLE schedules (
    id           TEXT PRIMARY KEY,
    tenant       TEXT NOT NULL,
    agent        TEXT,
    message      TEXT NOT NULL,
    cron         TEXT,
    timezone     TEXT,
    every_ms     INTEGER,
    session_id   TEXT,
    overlap      TEXT NOT NULL,
    catch_up     TEXT NOT NULL,
    paused       INTEGER NOT NULL DEFAULT 0,
    run_config   TEXT NOT NULL,
    next_fire_at INTEGER NOT NULL,
    last_slot    INTEGER,
    last_run_id  TEXT,
    created_at   INTEGER NOT NULL,
    updated_at   INTEGER NOT NULL,
    deleted_at   INTEGER
);
CREATE INDEX schedules_by_tenant ON schedules(tenant, id) WHERE deleted_at IS NULL;
CREATE INDEX schedules_due ON schedules(next_fire_at) WHERE paused = 0 AND deleted_at IS NULL;
CREATE TABLE schedule_slots (
    schedule_id  TEXT NOT NULL,
    manual       INTEGER NOT NULL,
    slot         INTEGER NOT NULL,
    through_slot INTEGER NOT NULL,
    outcome      TEXT NOT NULL,
    run_id       TEXT,
    session_id   TEXT,
    reason       TEXT,
    decided_at   INTEGER NOT NULL,
    PRIMARY KEY (schedule_id, manual, slot)
);
ALTER TABLE runs ADD COLUMN schedule_id TEXT;
ALTER TABLE runs ADD COLUMN schedule_slot INTEGER;
"#,
];

/// The schema version this build migrates a database to.
pub const VERSION: u32 = MIGRATIONS.len() as u32;

pub use ratchet_store::Migrated;

fn version_of(conn: &Connection) -> Result<u32> {
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(backend)?;
    let version = u32::try_from(version).unwrap_or(u32::MAX);
    if version > VERSION {
        return Err(ratchet_store::Error::Conflict(format!(
            "database schema version {version} is newer than this build supports ({VERSION}); upgrade ratchet"
        )));
    }
    Ok(version)
}

/// Applies every migration the database lacks, in one transaction.
pub(crate) fn migrate(conn: &mut Connection) -> Result<Migrated> {
    let tx = conn
        .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
        .map_err(backend)?;
    let from = version_of(&tx)?;
    for (index, sql) in MIGRATIONS.iter().enumerate().skip(from as usize) {
        tx.execute_batch(sql).map_err(backend)?;
        tx.pragma_update(None, "user_version", (index + 1) as i64)
            .map_err(backend)?;
    }
    tx.commit().map_err(backend)?;
    Ok(Migrated { from, to: VERSION })
}

/// Refuses a database whose schema is not this build's, without changing it: for processes
/// told not to migrate, so that only an explicit migration ever changes the schema.
pub(crate) fn require_current(conn: &Connection) -> Result<()> {
    let version = version_of(conn)?;
    if version < VERSION {
        return Err(ratchet_store::Error::Conflict(format!(
            "database schema version {version} is behind this build's ({VERSION}): its migrations have not been applied"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The search index covers messages written before it existed, and a catch-up those
    /// written since.
    #[test]
    fn the_search_index_is_built_over_existing_messages() {
        let mut conn = Connection::open_in_memory().unwrap();
        let before = MIGRATIONS
            .iter()
            .position(|sql| sql.contains("CREATE VIRTUAL TABLE messages_fts"))
            .expect("a migration creates the search index");
        for sql in &MIGRATIONS[..before] {
            conn.execute_batch(sql).unwrap();
        }
        conn.pragma_update(None, "user_version", before as i64)
            .unwrap();
        let insert = "INSERT INTO messages (id, session_id, run_id, role, content, visibility, origin, created_at)
                      VALUES (?1, 'ses_s', 'run_r', 'user', ?2, 'visible', 'user', 0)";
        conn.execute(insert, ["msg_old", "an old zebra"]).unwrap();

        assert!(require_current(&conn).is_err(), "the schema is behind");
        let migrated = migrate(&mut conn).unwrap();
        assert_eq!(
            migrated,
            Migrated {
                from: before as u32,
                to: VERSION
            }
        );
        require_current(&conn).unwrap();
        conn.execute(insert, ["msg_new", "a new zebra"]).unwrap();
        let tx = crate::Tx {
            conn: &conn,
            configs: &crate::Configs::default(),
        };
        crate::search::catch_up(&tx).unwrap();
        let found: Vec<String> = conn
            .prepare(
                "SELECT m.id FROM messages_fts JOIN messages m ON m.rowid = messages_fts.rowid
                 WHERE messages_fts MATCH 'zebra' ORDER BY m.rowid",
            )
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert_eq!(
            found,
            ["msg_old", "msg_new"],
            "the rebuild indexes old messages, the catch-up new ones"
        );
    }

    /// A run created before configurations were stored apart keeps its own after the
    /// migration; runs created since with one configuration share one stored row.
    #[tokio::test]
    async fn runs_keep_their_frozen_config_when_configs_move_to_their_own_table() {
        use ratchet_core::{AgentState, MessageId, RunConfigSnapshot, RunId, SessionId};
        use ratchet_store::{NewRun, Reads, SessionSpec, WhenBusy, Writes};

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.db");
        let conn = Connection::open(&path).unwrap();
        let before = MIGRATIONS
            .iter()
            .position(|sql| sql.contains("CREATE TABLE run_configs"))
            .expect("a migration moves configurations to their own table");
        for sql in &MIGRATIONS[..before] {
            conn.execute_batch(sql).unwrap();
        }
        conn.pragma_update(None, "user_version", before as i64)
            .unwrap();
        let old_config = RunConfigSnapshot {
            system_prompt: "frozen before the move".into(),
            ..RunConfigSnapshot::default()
        };
        let (session, old_run) = (
            SessionId::from_suffix("s").unwrap(),
            RunId::from_suffix("old").unwrap(),
        );
        let state = AgentState::new(session.clone(), old_run.clone(), old_config, 1);
        conn.execute(
            "INSERT INTO sessions (id, created_at) VALUES (?1, 1)",
            [session.as_str()],
        )
        .unwrap();
        conn.execute(
            "INSERT INTO runs (id, session_id, status, step_index, config_json, state_json, input_json, created_at)
             VALUES (?1, ?2, 'completed', 0, ?3, ?4, '{}', 1)",
            [
                old_run.as_str(),
                session.as_str(),
                &serde_json::to_string(state.config.as_ref()).unwrap(),
                &serde_json::to_string(&state).unwrap(),
            ],
        )
        .unwrap();
        drop(conn);

        let store = crate::open_url(&format!("sqlite://{}", path.display())).unwrap();
        let loaded = store.load_state(&old_run).await.unwrap();
        assert_eq!(loaded.config.system_prompt, "frozen before the move");

        let shared = RunConfigSnapshot {
            system_prompt: "one agent's".into(),
            ..RunConfigSnapshot::default()
        };
        let mut new_runs = Vec::new();
        for i in 0..3 {
            let session = SessionId::from_suffix(&format!("n{i}")).unwrap();
            store
                .create_session(&session, SessionSpec::default(), 2)
                .await
                .unwrap();
            let run_id = RunId::from_suffix(&format!("new{i}")).unwrap();
            let new = NewRun {
                session_id: session,
                run_id: run_id.clone(),
                message_id: MessageId::from_suffix(&format!("m{i}")).unwrap(),
                content: "hi".into(),
                config: shared.clone(),
                when_busy: WhenBusy::Enqueue,
                quota: Default::default(),
                trace: None,
                request: None,
            };
            store.submit_message(new, 2).await.unwrap();
            new_runs.push(run_id);
        }
        for run_id in &new_runs {
            let loaded = store.load_state(run_id).await.unwrap();
            assert_eq!(loaded.config.system_prompt, "one agent's");
        }
        let rows: i64 = Connection::open(&path)
            .unwrap()
            .query_row("SELECT count(*) FROM run_configs", [], |r| r.get(0))
            .unwrap();
        assert_eq!(
            rows, 2,
            "expected the old run's config and one shared by the three new runs"
        );
    }
}
