//! Embedded migrations, applied in order and recorded in `ratchet_schema`, one row per
//! version applied.
//!
//! Column names are SQLite's (`ratchet-sqlite/src/schema.rs`), since the transaction bodies
//! are shared. Every integer is a BIGINT, flags included (0 or 1, as in SQLite); JSON stays
//! TEXT. `messages` and `runs` get an identity column named `rowid`: the bodies order by
//! SQLite's implicit rowid, the order of insertion.

use postgres::Client;
use ratchet_store::{Error, Migrated};

use crate::{Result, backend_error};

/// Each entry moves the schema from version `i` to `i + 1`. Never edit a released entry:
/// append a new one.
/// Ids are compared and ordered byte-wise (`COLLATE "C"`), as in SQLite, whatever the
/// database's default collation: pages of sessions and runs follow their time-ordered ids.
const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE sessions (
    id            TEXT COLLATE "C" PRIMARY KEY,
    created_at    BIGINT NOT NULL,
    last_seq      BIGINT NOT NULL DEFAULT 0,
    active_run_id TEXT COLLATE "C",
    tenant        TEXT NOT NULL DEFAULT 'default',
    agent         TEXT,
    metadata_json TEXT
);
CREATE INDEX sessions_by_tenant ON sessions (tenant, id);

CREATE TABLE runs (
    rowid            BIGINT GENERATED ALWAYS AS IDENTITY,
    id               TEXT COLLATE "C" PRIMARY KEY,
    session_id       TEXT COLLATE "C" NOT NULL REFERENCES sessions (id),
    status           TEXT NOT NULL,
    step_index       BIGINT NOT NULL,
    cancel_requested BIGINT NOT NULL DEFAULT 0,
    stop_reason      TEXT,
    -- Frozen at creation; no statement ever updates it.
    config_json      TEXT NOT NULL,
    state_json       TEXT NOT NULL,
    -- The user message that starts the run, inserted into history when the run starts.
    input_json       TEXT NOT NULL,
    created_at       BIGINT NOT NULL,
    finished_at      BIGINT
);
CREATE INDEX runs_by_session_id ON runs (session_id, id);
-- Queued runs start in the order their messages were sent; its prefix also serves the
-- lookups of a session's runs by status.
CREATE INDEX runs_queued ON runs (session_id, status, created_at);

CREATE TABLE messages (
    rowid           BIGINT GENERATED ALWAYS AS IDENTITY,
    id              TEXT COLLATE "C" PRIMARY KEY,
    session_id      TEXT COLLATE "C" NOT NULL,
    run_id          TEXT COLLATE "C" NOT NULL,
    role            TEXT NOT NULL,
    content         TEXT NOT NULL,
    tool_calls_json TEXT,
    tool_call_id    TEXT,
    visibility      TEXT NOT NULL,
    origin          TEXT NOT NULL,
    created_at      BIGINT NOT NULL,
    -- A summary written by a compaction keeps the messages from this position on; in the
    -- model's view it replaces every message before it.
    keeps_from      BIGINT,
    -- A tool result whose call failed.
    is_error        BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX messages_by_session ON messages (session_id, rowid);
CREATE INDEX messages_summaries ON messages (session_id) WHERE keeps_from IS NOT NULL;
-- Full-text search (see `search.rs`) reads only the messages it may find, through this
-- expression; a search must repeat it and the predicate word for word to use the index.
CREATE INDEX messages_search ON messages USING GIN (to_tsvector('english', content))
    WHERE visibility = 'visible' AND role IN ('user', 'assistant');

CREATE TABLE steps (
    run_id       TEXT COLLATE "C" NOT NULL,
    step_index   BIGINT NOT NULL,
    instruction  TEXT NOT NULL,
    started_at   BIGINT NOT NULL,
    finished_at  BIGINT NOT NULL,
    summary_json TEXT NOT NULL,
    PRIMARY KEY (run_id, step_index)
);

-- A run's events are read through the session's range of the primary key.
CREATE TABLE events (
    session_id   TEXT COLLATE "C" NOT NULL,
    seq          BIGINT NOT NULL,
    run_id       TEXT COLLATE "C",
    kind         TEXT NOT NULL,
    payload_json TEXT NOT NULL,
    created_at   BIGINT NOT NULL,
    PRIMARY KEY (session_id, seq)
);

-- The transactional outbox of the execution bus. A job is claimable when `ready_at` has
-- passed: it is the lease expiry while held, the retry time after a failed attempt.
CREATE TABLE step_jobs (
    run_id      TEXT COLLATE "C" NOT NULL,
    step_index  BIGINT NOT NULL,
    phase       TEXT NOT NULL,
    attempt     BIGINT NOT NULL,
    epoch       BIGINT NOT NULL,
    lease_owner TEXT,
    ready_at    BIGINT NOT NULL,
    PRIMARY KEY (run_id, step_index)
);
CREATE INDEX step_jobs_ready ON step_jobs (ready_at);

CREATE TABLE intents (
    run_id          TEXT COLLATE "C" NOT NULL,
    step_index      BIGINT NOT NULL,
    slot            BIGINT NOT NULL,
    kind            TEXT NOT NULL,
    name            TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    attempts        BIGINT NOT NULL,
    outcome_json    TEXT,
    started_at      BIGINT NOT NULL,
    finished_at     BIGINT,
    PRIMARY KEY (run_id, step_index, slot)
);

-- One row per gated tool batch. `status` is 'pending' until answered ('decided' or
-- 'aborted'); a pending approval whose run has ended reads as 'cancelled'.
CREATE TABLE approvals (
    position    BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id          TEXT COLLATE "C" NOT NULL UNIQUE,
    run_id      TEXT COLLATE "C" NOT NULL,
    session_id  TEXT COLLATE "C" NOT NULL,
    status      TEXT NOT NULL,
    calls_json  TEXT NOT NULL,
    answer_json TEXT,
    created_at  BIGINT NOT NULL,
    decided_at  BIGINT
);
CREATE INDEX approvals_by_status ON approvals (status, position);

-- Messages sent with multitask "steer", waiting for the active run's next model call. If
-- that run ends first, each becomes a queued run with `run_id`, in the order they were sent.
CREATE TABLE steers (
    position    BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id  TEXT NOT NULL UNIQUE,
    session_id  TEXT COLLATE "C" NOT NULL,
    run_id      TEXT COLLATE "C" NOT NULL,
    content     TEXT NOT NULL,
    config_json TEXT NOT NULL,
    created_at  BIGINT NOT NULL
);
CREATE INDEX steers_by_session ON steers (session_id, position);
"#,
    r#"
-- Sub-agents. A child run lives in a session of its own, below its root session: writes to any
-- session of a tree lock the root's row. NULL parents and roots mean "a root itself".
ALTER TABLE sessions ADD COLUMN parent_session_id TEXT COLLATE "C";
ALTER TABLE sessions ADD COLUMN root_session_id TEXT COLLATE "C";
ALTER TABLE runs ADD COLUMN parent_run_id TEXT COLLATE "C";
ALTER TABLE runs ADD COLUMN parent_step BIGINT;
ALTER TABLE runs ADD COLUMN parent_slot BIGINT;
ALTER TABLE runs ADD COLUMN task_index BIGINT;
ALTER TABLE runs ADD COLUMN root_run_id TEXT COLLATE "C";
ALTER TABLE runs ADD COLUMN agent TEXT;
ALTER TABLE runs ADD COLUMN depth BIGINT NOT NULL DEFAULT 0;
CREATE INDEX runs_children ON runs (parent_run_id, parent_step) WHERE parent_run_id IS NOT NULL;
CREATE INDEX runs_by_root ON runs (root_run_id) WHERE root_run_id IS NOT NULL;
CREATE INDEX sessions_by_root ON sessions (root_session_id) WHERE root_session_id IS NOT NULL;
-- Run quotas count the non-terminal runs.
CREATE INDEX runs_by_status ON runs (status);
"#,
    r#"
-- Background work and the inbox. A background run carries its `delegate` call's group; what it
-- reports lands in its root session's inbox. An event's place is taken when the work is
-- admitted ('reserved'), so an accepted run always has room to report. Rows are never deleted:
-- consumed, dead and superseded events stay as the audit trail.
ALTER TABLE runs ADD COLUMN inbox_group TEXT COLLATE "C";
CREATE INDEX runs_by_inbox_group ON runs (inbox_group) WHERE inbox_group IS NOT NULL;
ALTER TABLE sessions ADD COLUMN archived_at BIGINT;
ALTER TABLE sessions ADD COLUMN deleted_at BIGINT;
-- User turns started since the session's last continuation turn (fairness).
ALTER TABLE sessions ADD COLUMN user_turns_in_a_row BIGINT NOT NULL DEFAULT 0;
CREATE TABLE inbox (
    id            BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    session_id    TEXT COLLATE "C" NOT NULL,
    kind          TEXT NOT NULL,
    status        TEXT NOT NULL,
    delivery      TEXT NOT NULL,
    parent_run_id TEXT COLLATE "C" NOT NULL,
    source_run_id TEXT COLLATE "C",
    group_id      TEXT COLLATE "C",
    -- Set once the event has something to report (NULL while reserved).
    payload_json  TEXT,
    -- A signal's: one per emitting call, and its dedupe key.
    call_key      TEXT UNIQUE,
    dedupe_key    TEXT,
    attempts      BIGINT NOT NULL DEFAULT 0,
    max_attempts  BIGINT NOT NULL,
    available_at  BIGINT,
    lease_run_id  TEXT COLLATE "C",
    reason        TEXT,
    created_at    BIGINT NOT NULL,
    updated_at    BIGINT NOT NULL
);
CREATE INDEX inbox_by_session ON inbox (session_id, status, available_at);
CREATE INDEX inbox_due ON inbox (status, available_at);
CREATE INDEX inbox_by_source ON inbox (source_run_id) WHERE source_run_id IS NOT NULL;
CREATE INDEX inbox_by_group ON inbox (group_id) WHERE group_id IS NOT NULL;
CREATE INDEX inbox_by_lease ON inbox (lease_run_id) WHERE lease_run_id IS NOT NULL;
"#,
    r#"
-- Pause and resume. Like `cancel_requested`, the flag is the store's: a pause asked for while
-- a step is in flight, honoured by that step's commit.
ALTER TABLE runs ADD COLUMN pause_requested BIGINT NOT NULL DEFAULT 0;
"#,
    r#"
-- Webhooks, the observation plane's plugins. A cursor follows each session's events for each
-- webhook; a delivery is one event's trip to one webhook. Nothing here is read by a step.
CREATE TABLE webhooks (
    id           TEXT COLLATE "C" PRIMARY KEY,
    tenant       TEXT NOT NULL,
    url          TEXT NOT NULL,
    -- The event kinds it wants, a JSON array; NULL for every kind.
    events_json  TEXT,
    secret       TEXT NOT NULL,
    max_attempts BIGINT NOT NULL,
    created_at   BIGINT NOT NULL
);
CREATE INDEX webhooks_by_tenant ON webhooks (tenant, created_at);
CREATE TABLE webhook_cursors (
    webhook_id TEXT COLLATE "C" NOT NULL,
    session_id TEXT COLLATE "C" NOT NULL,
    -- The session's events up to here were queued (or passed over, when not wanted).
    seq        BIGINT NOT NULL,
    PRIMARY KEY (webhook_id, session_id)
);
CREATE TABLE webhook_deliveries (
    id               BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    webhook_id       TEXT COLLATE "C" NOT NULL,
    session_id       TEXT COLLATE "C" NOT NULL,
    seq              BIGINT NOT NULL,
    event_kind       TEXT NOT NULL,
    status           TEXT NOT NULL,
    attempts         BIGINT NOT NULL DEFAULT 0,
    available_at     BIGINT,
    lease_owner      TEXT,
    lease_expires_at BIGINT,
    last_status      BIGINT,
    last_error       TEXT,
    delivered_at     BIGINT,
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL,
    UNIQUE (webhook_id, session_id, seq)
);
CREATE INDEX webhook_deliveries_open ON webhook_deliveries (webhook_id, session_id, seq)
    WHERE status IN ('pending', 'delivering');
CREATE INDEX webhook_deliveries_log ON webhook_deliveries (webhook_id, id);
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
ALTER TABLE runs ADD COLUMN deadline_at BIGINT;
CREATE INDEX runs_by_deadline ON runs (deadline_at) WHERE deadline_at IS NOT NULL;
"#,
    r#"
-- A run's frozen configuration is stored once for all the runs frozen with it (an agent's
-- runs share one): a run's row stays small, and a step's update of its state no longer
-- rewrites the configuration with it. `id` is the SHA-256 of the JSON; the runs created
-- before keep theirs under 'run:' and their own id. Rows are never updated.
CREATE TABLE run_configs (
    id          TEXT COLLATE "C" PRIMARY KEY,
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
ALTER TABLE messages ADD COLUMN draft_of TEXT COLLATE "C";
"#,
    r#"
-- An operator may requeue a dead letter (of the inbox, of a webhook's deliveries): when they
-- last did, so that a repeat of the request changes nothing.
ALTER TABLE inbox ADD COLUMN requeued_at BIGINT;
ALTER TABLE webhook_deliveries ADD COLUMN requeued_at BIGINT;
"#,
    r#"
-- When a pending report expires untold (its inbox policy's `max_age_ms` after it was written
-- or requeued); idle workers dead-letter it then.
ALTER TABLE inbox ADD COLUMN expires_at BIGINT;
CREATE INDEX inbox_expiring ON inbox(expires_at) WHERE status = 'pending';
"#,
    r#"
-- A session's title: its first message's opening words until someone renames it. Sessions
-- that have messages take their first visible user message's first line.
ALTER TABLE sessions ADD COLUMN title TEXT;
UPDATE sessions SET title = (
    SELECT left(btrim(split_part(m.content, E'\n', 1)), 80)
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
    attempt BIGINT NOT NULL,
    held_until BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    effect_json TEXT,
    response_status BIGINT,
    response_body TEXT,
    PRIMARY KEY (tenant, idempotency_key)
);
CREATE INDEX idempotent_requests_expiry ON idempotent_requests(expires_at);
"#,
    r#"
-- A run forked from another records where from: the source run and the step it continues.
ALTER TABLE runs ADD COLUMN forked_from_run_id TEXT COLLATE "C";
ALTER TABLE runs ADD COLUMN forked_from_step BIGINT;
"#,
    r#"
-- Schedules: a definition (its cadence, message, session, overlap and catch-up rules), the
-- configuration its runs are frozen with (in `run_configs`), and `next_fire_at`, before which
-- every slot has been decided. A row of `schedule_slots` per decided slot — fired, skipped or
-- refused — written in the transaction that starts its run: the primary key makes a slot fire
-- at most once whichever process reaches it. A run fired by a schedule names it and its slot.
CREATE TABLE schedules (
    id           TEXT COLLATE "C" PRIMARY KEY,
    tenant       TEXT NOT NULL,
    agent        TEXT,
    message      TEXT NOT NULL,
    cron         TEXT,
    timezone     TEXT,
    every_ms     BIGINT,
    session_id   TEXT COLLATE "C",
    overlap      TEXT NOT NULL,
    catch_up     TEXT NOT NULL,
    paused       BIGINT NOT NULL DEFAULT 0,
    run_config   TEXT COLLATE "C" NOT NULL,
    next_fire_at BIGINT NOT NULL,
    last_slot    BIGINT,
    last_run_id  TEXT COLLATE "C",
    created_at   BIGINT NOT NULL,
    updated_at   BIGINT NOT NULL,
    deleted_at   BIGINT
);
CREATE INDEX schedules_by_tenant ON schedules (tenant, id) WHERE deleted_at IS NULL;
CREATE INDEX schedules_due ON schedules (next_fire_at) WHERE paused = 0 AND deleted_at IS NULL;
CREATE TABLE schedule_slots (
    schedule_id  TEXT COLLATE "C" NOT NULL,
    manual       BIGINT NOT NULL,
    slot         BIGINT NOT NULL,
    through_slot BIGINT NOT NULL,
    outcome      TEXT NOT NULL,
    run_id       TEXT COLLATE "C",
    session_id   TEXT COLLATE "C",
    reason       TEXT,
    decided_at   BIGINT NOT NULL,
    PRIMARY KEY (schedule_id, manual, slot)
);
ALTER TABLE runs ADD COLUMN schedule_id TEXT COLLATE "C";
ALTER TABLE runs ADD COLUMN schedule_slot BIGINT;
"#,
];

/// The advisory lock that makes processes opening one database at once migrate it one
/// after another ("ratchet" in ASCII). Advisory locks are per database.
const MIGRATION_LOCK: i64 = 0x0072_6174_6368_6574;

/// The schema version this build writes.
pub const LATEST: u32 = MIGRATIONS.len() as u32;

/// Applies the migrations the database lacks, in one transaction, and returns the version.
pub(crate) fn migrate(client: &mut Client) -> Result<Migrated> {
    let mut tx = client.transaction().map_err(|e| backend_error(&e))?;
    // The lock comes first and alone: every statement after it takes a fresh snapshot, so a
    // process that waited sees the migrations the one before it committed.
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .map_err(|e| backend_error(&e))?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS ratchet_schema (version BIGINT PRIMARY KEY)")
        .map_err(|e| backend_error(&e))?;
    let version = recorded_version(&mut tx)?;
    if version > LATEST {
        return Err(newer(version));
    }
    for (index, sql) in MIGRATIONS.iter().enumerate().skip(version as usize) {
        let next = index as i64 + 1;
        tx.batch_execute(sql)
            .and_then(|()| tx.execute("INSERT INTO ratchet_schema (version) VALUES ($1)", &[&next]))
            .map_err(|e| {
                Error::Backend(format!(
                    "migration to schema version {next} failed: {}",
                    backend_error(&e)
                ))
            })?;
    }
    tx.commit().map_err(|e| backend_error(&e))?;
    Ok(Migrated {
        from: version,
        to: LATEST,
    })
}

/// Checks, without changing anything, that the schema is the one this build writes.
pub(crate) fn check(client: &mut Client) -> Result<()> {
    let exists: bool = client
        .query_one("SELECT to_regclass('ratchet_schema') IS NOT NULL", &[])
        .and_then(|row| row.try_get(0))
        .map_err(|e| backend_error(&e))?;
    let version = if exists { recorded_version(client)? } else { 0 };
    match version.cmp(&LATEST) {
        std::cmp::Ordering::Less => Err(Error::Conflict(format!(
            "the database schema is at version {version} and this build needs version {}; \
             run `ratchet migrate` first",
            LATEST
        ))),
        std::cmp::Ordering::Greater => Err(newer(version)),
        std::cmp::Ordering::Equal => Ok(()),
    }
}

fn recorded_version(client: &mut impl postgres::GenericClient) -> Result<u32> {
    let version: i64 = client
        .query_one("SELECT COALESCE(MAX(version), 0) FROM ratchet_schema", &[])
        .and_then(|row| row.try_get(0))
        .map_err(|e| backend_error(&e))?;
    u32::try_from(version)
        .map_err(|_| Error::Corrupt(format!("ratchet_schema holds version {version}")))
}

fn newer(version: u32) -> Error {
    Error::Conflict(format!(
        "database schema version {version} is newer than this build supports ({}); upgrade \
         ratchet",
        LATEST
    ))
}
