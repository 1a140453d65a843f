//! The transaction bodies. Each function runs inside the writer's transaction (or on a read
//! connection) and is the whole of one `Store` operation.

use ratchet_core::step::{Reconciliation, Resumption, cancel_idle, start_run};
use ratchet_core::{
    AgentState, ApprovalAnswer, ApprovalId, EventDraft, EventKind, HumanRequest, Message, Millis,
    Origin, Phase, RunConfigSnapshot, RunId, RunStatus, SessionId, StepJob, StepRecord, StepResult,
    StopReason, ToolOutcome,
};
use ratchet_store::{
    Answered, Approval, ApprovalStatus, CancelOutcome, Claim, ClaimedStep, Commit, Error, Intent,
    IntentKind, IntentRecord, Lease, NewRun, Reconciled, RecordedIntents, RunSummary, Session,
    SessionSpec, Stale, StoreStats, StoredEvent, StoredMessage, Submitted, WhenBusy,
};
use rusqlite::{OptionalExtension, params};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::{Result, Tx, backend};

fn to_json(value: &impl Serialize) -> Result<String> {
    serde_json::to_string(value).map_err(|e| Error::Corrupt(format!("cannot encode: {e}")))
}

fn from_json<T: DeserializeOwned>(text: &str, what: &str) -> Result<T> {
    serde_json::from_str(text).map_err(|e| Error::Corrupt(format!("{what}: {e}")))
}

pub(crate) fn sql_enum<T: DeserializeOwned>(text: &str) -> Result<T> {
    from_json(&format!("\"{text}\""), "stored enum")
}

fn sql_str<T: Serialize>(value: &T) -> Result<String> {
    Ok(to_json(value)?.trim_matches('"').to_owned())
}

fn run_not_found(run_id: &RunId) -> Error {
    Error::NotFound {
        kind: "run",
        id: run_id.to_string(),
    }
}

pub(crate) fn create_session(
    c: &Tx<'_>,
    id: &SessionId,
    spec: SessionSpec,
    now: Millis,
) -> Result<Session> {
    let metadata = spec.metadata.as_ref().map(to_json).transpose()?;
    let inserted = c
        .prepare_cached(
            "INSERT OR IGNORE INTO sessions (id, created_at, tenant, agent, metadata_json) VALUES (?1, ?2, ?3, ?4, ?5)",
        )
        .and_then(|mut s| s.execute(params![id.as_str(), now, spec.tenant, spec.agent, metadata]))
        .map_err(backend)?;
    if inserted == 0 {
        return Err(Error::Conflict(format!("session {id} already exists")));
    }
    Ok(Session {
        id: id.clone(),
        tenant: spec.tenant,
        agent: spec.agent,
        metadata: spec.metadata,
        created_at: now,
        active_run_id: None,
    })
}

const SESSION_COLUMNS: &str = "id, tenant, agent, metadata_json, created_at, active_run_id";

type SessionColumns = (
    String,
    String,
    Option<String>,
    Option<String>,
    i64,
    Option<String>,
);

fn session_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SessionColumns> {
    r.try_into()
}

fn to_session(row: SessionColumns) -> Result<Session> {
    let (id, tenant, agent, metadata, created_at, active) = row;
    let corrupt = |e: ratchet_core::IdError| Error::Corrupt(e.to_string());
    Ok(Session {
        id: SessionId::parse(&id).map_err(corrupt)?,
        tenant,
        agent,
        metadata: metadata
            .map(|m| from_json(&m, "session metadata"))
            .transpose()?,
        created_at,
        active_run_id: active
            .map(|r| RunId::parse(&r))
            .transpose()
            .map_err(corrupt)?,
    })
}

pub(crate) fn get_session(c: &Tx<'_>, id: &SessionId) -> Result<Session> {
    let row = c
        .prepare_cached(&format!(
            "SELECT {SESSION_COLUMNS} FROM sessions WHERE id = ?1"
        ))
        .and_then(|mut s| s.query_row([id.as_str()], session_row).optional())
        .map_err(backend)?
        .ok_or_else(|| Error::NotFound {
            kind: "session",
            id: id.to_string(),
        })?;
    to_session(row)
}

pub(crate) fn list_sessions(
    c: &Tx<'_>,
    tenant: &str,
    after: Option<&SessionId>,
    limit: u32,
) -> Result<Vec<Session>> {
    let mut stmt = c
        .prepare_cached(&format!(
            "SELECT {SESSION_COLUMNS} FROM sessions WHERE tenant = ?1 AND id > ?2 ORDER BY id LIMIT ?3"
        ))
        .map_err(backend)?;
    let rows = stmt
        .query_map(
            params![tenant, after.map_or("", |a| a.as_str()), limit],
            session_row,
        )
        .map_err(backend)?;
    rows.map(|row| to_session(row.map_err(backend)?)).collect()
}

pub(crate) fn submit_message(c: &Tx<'_>, new: NewRun, now: Millis) -> Result<Submitted> {
    let active: Option<Option<String>> = c
        .prepare_cached("SELECT active_run_id FROM sessions WHERE id = ?1")
        .and_then(|mut s| {
            s.query_row([new.session_id.as_str()], |r| r.get(0))
                .optional()
        })
        .map_err(backend)?;
    let Some(active) = active else {
        return Err(Error::NotFound {
            kind: "session",
            id: new.session_id.to_string(),
        });
    };
    let active = active
        .map(|id| RunId::parse(&id))
        .transpose()
        .map_err(|e| Error::Corrupt(e.to_string()))?;
    if let Some(active) = active
        .as_ref()
        .filter(|_| new.when_busy == WhenBusy::Reject)
    {
        return Err(Error::Conflict(format!(
            "session {} has an active run ({active}); send with multitask \"enqueue\" to queue behind it",
            new.session_id
        )));
    }
    if let Some(active) = active.as_ref().filter(|_| new.when_busy == WhenBusy::Steer) {
        let frozen = to_json(&new.config)?;
        c.prepare_cached(
            "INSERT INTO steers (message_id, session_id, run_id, content, config_json, created_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )
        .and_then(|mut s| {
            s.execute(params![
                new.message_id.as_str(),
                new.session_id.as_str(),
                new.run_id.as_str(),
                new.content,
                frozen,
                now
            ])
        })
        .map_err(backend)?;
        return Ok(Submitted {
            status: run_row(c, active)?.status,
            events: Vec::new(),
            interrupted: None,
            steered_into: Some(active.clone()),
        });
    }
    let (state, created) = insert_queued_run(
        c,
        &new.session_id,
        &new.run_id,
        new.message_id.as_str(),
        &new.content,
        new.config,
        now,
    )?;
    let mut drafts = vec![created];
    let Some(active) = active else {
        drafts.extend(start_queued_run(c, state, now)?);
        let events = insert_events(c, &new.session_id, Some(&new.run_id), &drafts, now)?;
        return Ok(Submitted {
            status: RunStatus::Running,
            events,
            interrupted: None,
            steered_into: None,
        });
    };
    let mut events = insert_events(c, &new.session_id, Some(&new.run_id), &drafts, now)?;
    let mut interrupted = None;
    if new.when_busy == WhenBusy::Interrupt {
        // A cancel that ends the active run at once frees the session, and the queue (this
        // run included) moves on inside the same transaction.
        match request_cancel(c, &active, now)? {
            CancelOutcome::Cancelled { events: more, .. }
            | CancelOutcome::Cancelling { events: more } => {
                events.extend(more);
            }
            CancelOutcome::AlreadyTerminal(_) => {}
        }
        interrupted = Some(active);
    }
    let status = run_row(c, &new.run_id)?.status;
    Ok(Submitted {
        status,
        events,
        interrupted,
        steered_into: None,
    })
}

/// Inserts a run waiting in its session's queue, with the message that will start it.
fn insert_queued_run(
    c: &Tx<'_>,
    session_id: &SessionId,
    run_id: &RunId,
    message_id: &str,
    content: &str,
    config: RunConfigSnapshot,
    created_at: Millis,
) -> Result<(AgentState, EventDraft)> {
    let input = json!({"message_id": message_id, "content": content});
    let state = AgentState::new(session_id.clone(), run_id.clone(), config, created_at);
    let (config_json, state_json, input_json) = (
        to_json(state.config.as_ref())?,
        to_json(&state)?,
        to_json(&input)?,
    );
    c.prepare_cached(
        "INSERT INTO runs (id, session_id, status, step_index, config_json, state_json, input_json, created_at)
         VALUES (?1, ?2, 'queued', 0, ?3, ?4, ?5, ?6)",
    )
    .and_then(|mut s| {
        s.execute(params![run_id.as_str(), session_id.as_str(), config_json, state_json, input_json, created_at])
    })
    .map_err(backend)?;
    let created = EventDraft::new(
        EventKind::RunCreated,
        json!({"run_id": run_id, "message_id": message_id}),
    );
    Ok((state, created))
}

struct Steer {
    message_id: String,
    run_id: String,
    content: String,
    config_json: String,
    created_at: Millis,
}

/// Takes the session's waiting steers out of their table, oldest first.
fn take_steers(c: &Tx<'_>, session_id: &SessionId) -> Result<Vec<Steer>> {
    let steers = c
        .prepare_cached(
            "SELECT message_id, run_id, content, config_json, created_at FROM steers
             WHERE session_id = ?1 ORDER BY position",
        )
        .and_then(|mut s| {
            s.query_map([session_id.as_str()], |r| {
                Ok(Steer {
                    message_id: r.get(0)?,
                    run_id: r.get(1)?,
                    content: r.get(2)?,
                    config_json: r.get(3)?,
                    created_at: r.get(4)?,
                })
            })?
            .collect::<rusqlite::Result<Vec<_>>>()
        })
        .map_err(backend)?;
    if !steers.is_empty() {
        c.prepare_cached("DELETE FROM steers WHERE session_id = ?1")
            .and_then(|mut s| s.execute([session_id.as_str()]))
            .map_err(backend)?;
    }
    Ok(steers)
}

/// The run's next step calls the model: the session's waiting steers join its history now.
fn absorb_steers(c: &Tx<'_>, state: &AgentState, now: Millis) -> Result<Vec<EventDraft>> {
    let mut drafts = Vec::new();
    for steer in take_steers(c, &state.session_id)? {
        insert_message(
            c,
            &steer.message_id,
            state,
            &Message {
                origin: Origin::Steer,
                ..Message::user(steer.content.clone())
            },
            now,
        )?;
        drafts.push(EventDraft::new(
            EventKind::MessageSteered,
            json!({"run_id": state.run_id, "message_id": steer.message_id, "content": steer.content}),
        ));
    }
    Ok(drafts)
}

/// Makes a queued run the session's active run: its user message enters history, its first
/// job is enqueued.
fn start_queued_run(c: &Tx<'_>, mut state: AgentState, now: Millis) -> Result<Vec<EventDraft>> {
    let input: String = c
        .prepare_cached("SELECT input_json FROM runs WHERE id = ?1")
        .and_then(|mut s| s.query_row([state.run_id.as_str()], |r| r.get(0)))
        .map_err(backend)?;
    #[derive(serde::Deserialize)]
    struct Input {
        message_id: String,
        content: String,
    }
    let input: Input = from_json(&input, "run input")?;
    insert_message(
        c,
        &input.message_id,
        &state,
        &Message::user(input.content),
        now,
    )?;
    let (job, event) = start_run(&mut state, now);
    write_state(c, &state)?;
    insert_job(c, &job, now)?;
    c.prepare_cached("UPDATE sessions SET active_run_id = ?2 WHERE id = ?1")
        .and_then(|mut s| s.execute(params![state.session_id.as_str(), state.run_id.as_str()]))
        .map_err(backend)?;
    Ok(vec![event])
}

fn write_state(c: &Tx<'_>, state: &AgentState) -> Result<()> {
    let stop_reason = state.stop_reason.map(|r| r.as_str());
    let state_json = to_json(state)?;
    c.prepare_cached(
        "UPDATE runs SET status = ?2, step_index = ?3, stop_reason = ?4, state_json = ?5, finished_at = ?6
         WHERE id = ?1",
    )
    .and_then(|mut s| {
        s.execute(params![
            state.run_id.as_str(),
            state.status.as_str(),
            state.step_index as i64,
            stop_reason,
            state_json,
            state.finished_at
        ])
    })
    .map_err(backend)?;
    Ok(())
}

fn insert_message(
    c: &Tx<'_>,
    id: &str,
    state: &AgentState,
    message: &Message,
    now: Millis,
) -> Result<()> {
    let tool_calls = if message.tool_calls.is_empty() {
        None
    } else {
        Some(to_json(&message.tool_calls)?)
    };
    let (role, visibility, origin) = (
        sql_str(&message.role)?,
        sql_str(&message.visibility)?,
        sql_str(&message.origin)?,
    );
    c.prepare_cached(
        "INSERT INTO messages (id, session_id, run_id, role, content, tool_calls_json, tool_call_id, visibility, origin, created_at, keeps_from, is_error)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
    )
    .and_then(|mut s| {
        s.execute(params![
            id,
            state.session_id.as_str(),
            state.run_id.as_str(),
            role,
            message.content,
            tool_calls,
            message.tool_call_id,
            visibility,
            origin,
            now,
            message.keeps_from,
            message.is_error
        ])
    })
    .map_err(backend)?;
    Ok(())
}

/// How a new job row starts: leased to the committer that continues with it (its first
/// claim, epoch 1), or free for any worker from `now`.
struct NewJob<'a> {
    attempt: u32,
    epoch: i64,
    owner: Option<&'a str>,
    ready_at: Millis,
}

impl<'a> NewJob<'a> {
    fn new(lease: Option<&'a Lease>, now: Millis) -> NewJob<'a> {
        match lease {
            Some(lease) => NewJob {
                attempt: 1,
                epoch: 1,
                owner: Some(&lease.owner),
                ready_at: lease.expires_at,
            },
            None => NewJob {
                attempt: 0,
                epoch: 0,
                owner: None,
                ready_at: now,
            },
        }
    }
}

fn insert_job(c: &Tx<'_>, job: &StepJob, now: Millis) -> Result<()> {
    let row = NewJob::new(None, now);
    c.prepare_cached(
        "INSERT INTO step_jobs (run_id, step_index, phase, attempt, epoch, lease_owner, ready_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )
    .and_then(|mut s| {
        s.execute(params![
            job.run_id.as_str(),
            job.step_index as i64,
            job.phase.as_str(),
            row.attempt,
            row.epoch,
            row.owner,
            row.ready_at
        ])
    })
    .map_err(backend)?;
    Ok(())
}

/// Moves the claimed job on to `next` (or deletes it) if `claim` still holds it; false when
/// the claim was lost and nothing was written.
fn advance_job(
    c: &Tx<'_>,
    claim: &Claim,
    next: Option<&StepJob>,
    row: &NewJob<'_>,
) -> Result<bool> {
    let (run_id, step_index) = (claim.run_id.as_str(), claim.step_index as i64);
    let changed = match next {
        None => c
            .prepare_cached("DELETE FROM step_jobs WHERE run_id = ?1 AND step_index = ?2 AND epoch = ?3")
            .and_then(|mut s| s.execute(params![run_id, step_index, claim.epoch])),
        Some(next) => c
            .prepare_cached(
                "UPDATE step_jobs SET step_index = ?4, phase = ?5, attempt = ?6, epoch = ?7, lease_owner = ?8, ready_at = ?9
                 WHERE run_id = ?1 AND step_index = ?2 AND epoch = ?3",
            )
            .and_then(|mut s| {
                s.execute(params![
                    run_id,
                    step_index,
                    claim.epoch,
                    next.step_index as i64,
                    next.phase.as_str(),
                    row.attempt,
                    row.epoch,
                    row.owner,
                    row.ready_at
                ])
            }),
    }
    .map_err(backend)?;
    Ok(changed == 1)
}

pub(crate) fn insert_events(
    c: &Tx<'_>,
    session_id: &SessionId,
    run_id: Option<&RunId>,
    drafts: &[EventDraft],
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    if drafts.is_empty() {
        return Ok(Vec::new());
    }
    let last: i64 = c
        .prepare_cached(
            "UPDATE sessions SET last_seq = last_seq + ?2 WHERE id = ?1 RETURNING last_seq",
        )
        .and_then(|mut s| {
            s.query_row(params![session_id.as_str(), drafts.len() as i64], |r| {
                r.get(0)
            })
        })
        .optional()
        .map_err(backend)?
        .ok_or_else(|| Error::NotFound {
            kind: "session",
            id: session_id.to_string(),
        })?;
    let first = last - drafts.len() as i64 + 1;
    let mut insert = c
        .prepare_cached(
            "INSERT INTO events (session_id, seq, run_id, kind, payload_json, created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )
        .map_err(backend)?;
    let mut stored = Vec::with_capacity(drafts.len());
    for (seq, draft) in (first..).zip(drafts) {
        let payload = to_json(&draft.payload)?;
        insert
            .execute(params![
                session_id.as_str(),
                seq,
                run_id.map(|r| r.as_str()),
                draft.kind.as_str(),
                payload,
                now
            ])
            .map_err(backend)?;
        stored.push(StoredEvent {
            session_id: session_id.clone(),
            seq,
            run_id: run_id.cloned(),
            kind: draft.kind.as_str().to_owned(),
            payload: draft.payload.clone(),
            created_at: now,
        });
    }
    Ok(stored)
}

struct JobRow {
    step_index: u64,
    phase: String,
    attempt: u32,
    epoch: i64,
}

fn lease_job(c: &Tx<'_>, run_id: &RunId, job: JobRow, lease: &Lease) -> Result<ClaimedStep> {
    let attempt = job.attempt + 1;
    let epoch = job.epoch + 1;
    c.prepare_cached(
        "UPDATE step_jobs SET attempt = ?3, epoch = ?4, lease_owner = ?5, ready_at = ?6
         WHERE run_id = ?1 AND step_index = ?2",
    )
    .and_then(|mut s| {
        s.execute(params![
            run_id.as_str(),
            job.step_index as i64,
            attempt,
            epoch,
            lease.owner,
            lease.expires_at
        ])
    })
    .map_err(backend)?;
    let phase = Phase::parse(&job.phase)
        .ok_or_else(|| Error::Corrupt(format!("unknown phase {:?}", job.phase)))?;
    let state = load_state(c, run_id)?;
    Ok(ClaimedStep {
        job: StepJob {
            run_id: run_id.clone(),
            step_index: job.step_index,
            phase,
            attempt,
        },
        claim: Claim {
            run_id: run_id.clone(),
            step_index: job.step_index,
            epoch,
        },
        state,
    })
}

fn job_row(r: &rusqlite::Row<'_>, offset: usize) -> rusqlite::Result<JobRow> {
    Ok(JobRow {
        step_index: r.get::<_, i64>(offset)? as u64,
        phase: r.get(offset + 1)?,
        attempt: r.get(offset + 2)?,
        epoch: r.get(offset + 3)?,
    })
}

/// How long a job whose run cannot be loaded is set aside before it is tried again.
const QUARANTINE_MS: Millis = 60_000;
/// Most unloadable jobs one claim sets aside before giving up until the next claim.
const MAX_SET_ASIDE: usize = 16;

pub(crate) fn claim_next(
    c: &Tx<'_>,
    lease: &Lease,
    run: Option<&RunId>,
    now: Millis,
) -> Result<Option<ClaimedStep>> {
    for _ in 0..MAX_SET_ASIDE {
        let found = match run {
            None => c
                .prepare_cached(
                    "SELECT run_id, step_index, phase, attempt, epoch FROM step_jobs
                     WHERE ready_at <= ?1 ORDER BY ready_at LIMIT 1",
                )
                .and_then(|mut s| {
                    s.query_row([now], |r| Ok((r.get::<_, String>(0)?, job_row(r, 1)?)))
                        .optional()
                }),
            Some(run) => c
                .prepare_cached(
                    "SELECT run_id, step_index, phase, attempt, epoch FROM step_jobs
                     WHERE run_id = ?1 AND ready_at <= ?2 ORDER BY step_index LIMIT 1",
                )
                .and_then(|mut s| {
                    s.query_row(params![run.as_str(), now], |r| {
                        Ok((r.get::<_, String>(0)?, job_row(r, 1)?))
                    })
                    .optional()
                }),
        }
        .map_err(backend)?;
        let Some((run_id, job)) = found else {
            return Ok(None);
        };
        let step_index = job.step_index;
        statement(c, "SAVEPOINT claim")?;
        let leased = RunId::parse(&run_id)
            .map_err(|e| Error::Corrupt(e.to_string()))
            .and_then(|id| lease_job(c, &id, job, lease));
        match leased {
            Ok(claimed) => {
                statement(c, "RELEASE claim")?;
                return Ok(Some(claimed));
            }
            Err(error) => {
                statement(c, "ROLLBACK TO claim")?;
                statement(c, "RELEASE claim")?;
                if !matches!(error, Error::Corrupt(_) | Error::NotFound { .. }) {
                    return Err(error);
                }
                // One unreadable run must not stop every worker: set its job aside.
                tracing::error!(run = %run_id, step = step_index, %error, "cannot load the run of a job; setting it aside");
                c.prepare_cached(
                    "UPDATE step_jobs SET ready_at = ?3 WHERE run_id = ?1 AND step_index = ?2",
                )
                .and_then(|mut s| {
                    s.execute(params![run_id, step_index as i64, now + QUARANTINE_MS])
                })
                .map_err(backend)?;
            }
        }
    }
    Ok(None)
}

fn statement(c: &Tx<'_>, sql: &str) -> Result<()> {
    c.prepare_cached(sql)
        .and_then(|mut s| s.execute([]))
        .map_err(backend)?;
    Ok(())
}

pub(crate) fn heartbeat(c: &Tx<'_>, claim: &Claim, expires_at: Millis) -> Result<bool> {
    let changed = c
        .prepare_cached("UPDATE step_jobs SET ready_at = ?4 WHERE run_id = ?1 AND step_index = ?2 AND epoch = ?3")
        .and_then(|mut s| s.execute(params![claim.run_id.as_str(), claim.step_index as i64, claim.epoch, expires_at]))
        .map_err(backend)?;
    Ok(changed == 1)
}

fn claim_holds(c: &Tx<'_>, claim: &Claim) -> Result<bool> {
    let epoch: Option<i64> = c
        .prepare_cached("SELECT epoch FROM step_jobs WHERE run_id = ?1 AND step_index = ?2")
        .and_then(|mut s| {
            s.query_row(
                params![claim.run_id.as_str(), claim.step_index as i64],
                |r| r.get(0),
            )
            .optional()
        })
        .map_err(backend)?;
    Ok(epoch == Some(claim.epoch))
}

struct RunRow {
    session_id: SessionId,
    status: RunStatus,
    step_index: u64,
    cancel_requested: bool,
}

fn run_row(c: &Tx<'_>, run_id: &RunId) -> Result<RunRow> {
    let row = c
        .prepare_cached(
            "SELECT session_id, status, step_index, cancel_requested FROM runs WHERE id = ?1",
        )
        .and_then(|mut s| {
            s.query_row([run_id.as_str()], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, bool>(3)?,
                ))
            })
            .optional()
        })
        .map_err(backend)?
        .ok_or_else(|| run_not_found(run_id))?;
    Ok(RunRow {
        session_id: SessionId::parse(&row.0).map_err(|e| Error::Corrupt(e.to_string()))?,
        status: RunStatus::parse(&row.1)
            .ok_or_else(|| Error::Corrupt(format!("unknown status {:?}", row.1)))?,
        step_index: row.2 as u64,
        cancel_requested: row.3,
    })
}

pub(crate) fn commit_step(
    c: &Tx<'_>,
    claim: &Claim,
    mut result: StepResult,
    continue_with: Option<Lease>,
    now: Millis,
) -> Result<Commit> {
    if result.record.index != claim.step_index || result.state.run_id != claim.run_id {
        return Err(Error::Conflict(format!(
            "result of {}#{} committed under the claim of {}#{}",
            result.state.run_id, result.record.index, claim.run_id, claim.step_index
        )));
    }
    let stored = run_row(c, &claim.run_id)?;
    if stored.cancel_requested {
        result.yield_to_cancel();
    }
    let refused = if stored.step_index + 1 != claim.step_index {
        Some(Stale::StepMismatch {
            committed: stored.step_index,
            job: claim.step_index,
        })
    } else {
        stored
            .status
            .edge(result.state.status)
            .err()
            .map(Stale::Edge)
    };
    if let Some(refused) = refused {
        let reason = if claim_holds(c, claim)? {
            refused
        } else {
            Stale::LeaseLost
        };
        return Ok(Commit::Stale(reason));
    }
    // The fence, and the first write: the claimed job becomes the next one (or goes) only
    // while the claim's epoch still holds it.
    let next_row = NewJob::new(continue_with.as_ref(), now);
    if !advance_job(c, claim, result.next.as_ref(), &next_row)? {
        return Ok(Commit::Stale(Stale::LeaseLost));
    }
    let steer_boundary = result.accepts_steer();
    let state = &result.state;
    write_state(c, state)?;
    if let Some(HumanRequest::Approval { approval_id, calls }) = &state.pending_human {
        let calls_json = to_json(calls)?;
        c.prepare_cached(
            "INSERT INTO approvals (id, run_id, session_id, status, calls_json, created_at) VALUES (?1, ?2, ?3, 'pending', ?4, ?5)",
        )
        .and_then(|mut s| {
            s.execute(params![
                approval_id.as_str(),
                state.run_id.as_str(),
                stored.session_id.as_str(),
                calls_json,
                now
            ])
        })
        .map_err(backend)?;
    }
    for (i, message) in result.messages.iter().enumerate() {
        let id = format!(
            "msg_{}-{}-{}",
            &state.run_id.as_str()[4..],
            claim.step_index,
            i
        );
        insert_message(c, &id, state, message, now)?;
    }
    let record = &result.record;
    let summary_json = to_json(&record.summary)?;
    c.prepare_cached(
        "INSERT INTO steps (run_id, step_index, instruction, started_at, finished_at, summary_json) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )
    .and_then(|mut s| {
        s.execute(params![
            state.run_id.as_str(),
            record.index as i64,
            record.instruction,
            record.started_at,
            record.finished_at,
            summary_json
        ])
    })
    .map_err(backend)?;
    let mut enqueued = false;
    let mut continued = None;
    if let Some(next) = &result.next {
        match continue_with {
            Some(_) => {
                // The state as a claim would load it: the frozen config and the store's
                // cancel flag, never the ones the result carried.
                continued = Some(ClaimedStep {
                    job: StepJob {
                        attempt: 1,
                        ..next.clone()
                    },
                    claim: Claim {
                        run_id: next.run_id.clone(),
                        step_index: next.step_index,
                        epoch: next_row.epoch,
                    },
                    state: AgentState {
                        config: frozen_config(c, &claim.run_id)?,
                        cancel_requested: stored.cancel_requested,
                        ..result.state.clone()
                    },
                });
            }
            None => enqueued = true,
        }
    }
    let mut drafts = std::mem::take(&mut result.events);
    if steer_boundary {
        drafts.extend(absorb_steers(c, &result.state, now)?);
    }
    let mut events = insert_events(c, &stored.session_id, Some(&claim.run_id), &drafts, now)?;
    let state = &result.state;
    if state.status.is_terminal() {
        c.configs.forget(&claim.run_id);
        events.extend(release_session(c, &stored.session_id, &mut enqueued, now)?);
    }
    Ok(Commit::Committed {
        events,
        continued,
        enqueued,
    })
}

/// The session's active run has ended: the oldest queued run (if any) starts now. Its events
/// are stored under its own id, after the events of the run that ended.
fn release_session(
    c: &Tx<'_>,
    session_id: &SessionId,
    enqueued: &mut bool,
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    c.prepare_cached("UPDATE sessions SET active_run_id = NULL WHERE id = ?1")
        .and_then(|mut s| s.execute([session_id.as_str()]))
        .map_err(backend)?;
    // Steers the ended run never reached become runs of their own, in the order they were sent.
    let mut fell_through = Vec::new();
    for steer in take_steers(c, session_id)? {
        let run_id = RunId::parse(&steer.run_id).map_err(|e| Error::Corrupt(e.to_string()))?;
        let config = from_json(&steer.config_json, "steer config")?;
        let (_, created) = insert_queued_run(
            c,
            session_id,
            &run_id,
            &steer.message_id,
            &steer.content,
            config,
            steer.created_at,
        )?;
        fell_through.push((run_id, created));
    }
    let next: Option<String> = c
        .prepare_cached("SELECT id FROM runs WHERE session_id = ?1 AND status = 'queued' ORDER BY created_at, rowid LIMIT 1")
        .and_then(|mut s| s.query_row([session_id.as_str()], |r| r.get(0)).optional())
        .map_err(backend)?;
    let mut events = Vec::new();
    for (run_id, created) in fell_through {
        events.extend(insert_events(
            c,
            session_id,
            Some(&run_id),
            &[created],
            now,
        )?);
    }
    let Some(next) = next else {
        return Ok(events);
    };
    let next = RunId::parse(&next).map_err(|e| Error::Corrupt(e.to_string()))?;
    let state = load_state(c, &next)?;
    *enqueued = true;
    let drafts = start_queued_run(c, state, now)?;
    events.extend(insert_events(c, session_id, Some(&next), &drafts, now)?);
    Ok(events)
}

pub(crate) fn retry_later(
    c: &Tx<'_>,
    claim: &Claim,
    available_at: Millis,
    event: EventDraft,
    now: Millis,
) -> Result<Option<Vec<StoredEvent>>> {
    if !claim_holds(c, claim)? {
        return Ok(None);
    }
    c.prepare_cached("UPDATE step_jobs SET lease_owner = NULL, ready_at = ?3 WHERE run_id = ?1 AND step_index = ?2")
        .and_then(|mut s| s.execute(params![claim.run_id.as_str(), claim.step_index as i64, available_at]))
        .map_err(backend)?;
    let stored = run_row(c, &claim.run_id)?;
    insert_events(c, &stored.session_id, Some(&claim.run_id), &[event], now).map(Some)
}

fn fenced(c: &Tx<'_>, claim: &Claim) -> Result<()> {
    if claim_holds(c, claim)? {
        Ok(())
    } else {
        Err(Error::LeaseLost {
            run_id: claim.run_id.clone(),
            step_index: claim.step_index,
        })
    }
}

pub(crate) fn record_intents(
    c: &Tx<'_>,
    claim: &Claim,
    intents: &[Intent],
    events: &[EventDraft],
    now: Millis,
) -> Result<RecordedIntents> {
    // The fence and the cancel check in one read: the claim must still hold the step, and
    // no cancel may have been accepted.
    let held: Option<(i64, String, bool)> = c
        .prepare_cached(
            "SELECT j.epoch, r.session_id, r.cancel_requested FROM step_jobs j JOIN runs r ON r.id = j.run_id
             WHERE j.run_id = ?1 AND j.step_index = ?2",
        )
        .and_then(|mut s| {
            s.query_row(params![claim.run_id.as_str(), claim.step_index as i64], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })
            .optional()
        })
        .map_err(backend)?;
    let lost = || Error::LeaseLost {
        run_id: claim.run_id.clone(),
        step_index: claim.step_index,
    };
    let (epoch, session, cancel_requested) = held.ok_or_else(lost)?;
    if epoch != claim.epoch {
        return Err(lost());
    }
    if cancel_requested {
        return Err(Error::CancelRequested {
            run_id: claim.run_id.clone(),
        });
    }
    let session_id = SessionId::parse(&session).map_err(|e| Error::Corrupt(e.to_string()))?;
    let mut insert = c
        .prepare_cached(
            "INSERT INTO intents (run_id, step_index, slot, kind, name, idempotency_key, attempts, started_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, 1, ?7)
             ON CONFLICT (run_id, step_index, slot) DO UPDATE SET attempts = attempts + 1, started_at = ?7
             RETURNING attempts",
        )
        .map_err(backend)?;
    let mut attempts = Vec::with_capacity(intents.len());
    for intent in intents {
        let count: u32 = insert
            .query_row(
                params![
                    claim.run_id.as_str(),
                    claim.step_index as i64,
                    intent.slot,
                    intent.kind.as_str(),
                    intent.name,
                    intent.idempotency_key,
                    now
                ],
                |r| r.get(0),
            )
            .map_err(backend)?;
        attempts.push(count);
    }
    let events = insert_events(c, &session_id, Some(&claim.run_id), events, now)?;
    Ok(RecordedIntents { events, attempts })
}

pub(crate) fn record_outcome(
    c: &Tx<'_>,
    claim: &Claim,
    slot: u32,
    outcome: &ToolOutcome,
    now: Millis,
) -> Result<()> {
    fenced(c, claim)?;
    let outcome_json = to_json(outcome)?;
    let (run_id, step_index) = (&claim.run_id, claim.step_index);
    let changed = c
        .prepare_cached(
            "UPDATE intents SET outcome_json = ?4, finished_at = ?5 WHERE run_id = ?1 AND step_index = ?2 AND slot = ?3",
        )
        .and_then(|mut s| {
            s.execute(params![run_id.as_str(), step_index as i64, slot, outcome_json, now])
        })
        .map_err(backend)?;
    if changed == 0 {
        return Err(Error::Conflict(format!(
            "no intent at {run_id}#{step_index}#{slot} to record an outcome for"
        )));
    }
    Ok(())
}

pub(crate) fn intents(c: &Tx<'_>, run_id: &RunId, step_index: u64) -> Result<Vec<IntentRecord>> {
    let mut stmt = c
        .prepare_cached(
            "SELECT slot, kind, name, attempts, outcome_json FROM intents WHERE run_id = ?1 AND step_index = ?2 ORDER BY slot",
        )
        .map_err(backend)?;
    let rows = stmt
        .query_map(params![run_id.as_str(), step_index as i64], |r| {
            Ok((
                r.get::<_, u32>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, u32>(3)?,
                r.get::<_, Option<String>>(4)?,
            ))
        })
        .map_err(backend)?;
    let mut records = Vec::new();
    for row in rows {
        let (slot, kind, name, attempts, outcome) = row.map_err(backend)?;
        let kind = match kind.as_str() {
            "model" => IntentKind::Model,
            "tool" => IntentKind::Tool,
            other => return Err(Error::Corrupt(format!("unknown intent kind {other:?}"))),
        };
        let outcome = outcome
            .map(|o| from_json(&o, "intent outcome"))
            .transpose()?;
        records.push(IntentRecord {
            slot,
            kind,
            name,
            attempts,
            outcome,
        });
    }
    Ok(records)
}

pub(crate) fn request_cancel(c: &Tx<'_>, run_id: &RunId, now: Millis) -> Result<CancelOutcome> {
    let stored = run_row(c, run_id)?;
    let mut state = load_state(c, run_id)?;
    match stored.status {
        RunStatus::Running | RunStatus::Cancelling => {
            c.prepare_cached("UPDATE runs SET cancel_requested = 1 WHERE id = ?1")
                .and_then(|mut s| s.execute([run_id.as_str()]))
                .map_err(backend)?;
            let mut drafts = Vec::new();
            if stored.status == RunStatus::Running {
                state.status = RunStatus::Cancelling;
                write_state(c, &state)?;
                drafts.push(EventDraft::new(
                    EventKind::RunStatus,
                    json!({"run_id": run_id, "status": state.status}),
                ));
            }
            let events = insert_events(c, &stored.session_id, Some(run_id), &drafts, now)?;
            Ok(CancelOutcome::Cancelling { events })
        }
        RunStatus::Queued | RunStatus::WaitingHuman | RunStatus::WaitingChildren => {
            let held_session = stored.status != RunStatus::Queued;
            let drafts = cancel_idle(&mut state, now);
            c.configs.forget(run_id);
            c.prepare_cached("UPDATE runs SET cancel_requested = 1 WHERE id = ?1")
                .and_then(|mut s| s.execute([run_id.as_str()]))
                .map_err(backend)?;
            write_state(c, &state)?;
            c.prepare_cached("DELETE FROM step_jobs WHERE run_id = ?1")
                .and_then(|mut s| s.execute([run_id.as_str()]))
                .map_err(backend)?;
            let mut events = insert_events(c, &stored.session_id, Some(run_id), &drafts, now)?;
            let mut enqueued = false;
            if held_session {
                events.extend(release_session(c, &stored.session_id, &mut enqueued, now)?);
            }
            Ok(CancelOutcome::Cancelled { events, enqueued })
        }
        RunStatus::Completed | RunStatus::Failed | RunStatus::Cancelled => {
            Ok(CancelOutcome::AlreadyTerminal(stored.status))
        }
    }
}

pub(crate) fn load_state(c: &Tx<'_>, run_id: &RunId) -> Result<AgentState> {
    let (state, cancel_requested): (String, bool) = c
        .prepare_cached("SELECT state_json, cancel_requested FROM runs WHERE id = ?1")
        .and_then(|mut s| {
            s.query_row([run_id.as_str()], |r| Ok((r.get(0)?, r.get(1)?)))
                .optional()
        })
        .map_err(backend)?
        .ok_or_else(|| run_not_found(run_id))?;
    let mut state: AgentState = from_json(&state, "run state")?;
    state.config = frozen_config(c, run_id)?;
    state.cancel_requested = cancel_requested;
    Ok(state)
}

/// The configuration the run was created with; the only source of `state.config`.
fn frozen_config(c: &Tx<'_>, run_id: &RunId) -> Result<std::sync::Arc<RunConfigSnapshot>> {
    c.configs.get_or_load(run_id, || {
        let config: String = c
            .prepare_cached("SELECT config_json FROM runs WHERE id = ?1")
            .and_then(|mut s| s.query_row([run_id.as_str()], |r| r.get(0)))
            .optional()
            .map_err(backend)?
            .ok_or_else(|| run_not_found(run_id))?;
        from_json::<RunConfigSnapshot>(&config, "run config")
    })
}

pub(crate) fn visible_messages(
    c: &Tx<'_>,
    session_id: &SessionId,
    after_position: i64,
    limit: u32,
) -> Result<Vec<StoredMessage>> {
    let mut stmt = c
        .prepare_cached(
            "SELECT rowid, id, run_id, role, content, tool_calls_json, tool_call_id, visibility, origin, keeps_from, is_error, created_at
             FROM messages WHERE session_id = ?1 AND visibility = 'visible' AND rowid > ?2
             ORDER BY rowid LIMIT ?3",
        )
        .map_err(backend)?;
    let rows = stmt
        .query_map(
            params![session_id.as_str(), after_position, limit],
            stored_message_columns,
        )
        .map_err(backend)?;
    to_stored_messages(rows)
}

type StoredMessageColumns = (i64, String, String, MessageColumns, Millis);

fn stored_message_columns(r: &rusqlite::Row<'_>) -> rusqlite::Result<StoredMessageColumns> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        message_columns(r, 3)?,
        r.get(11)?,
    ))
}

/// What the model sees of a session: the latest summary (if the context was ever compacted)
/// in place of every message before the first one it keeps, then the messages from there on.
pub(crate) fn context(c: &Tx<'_>, session_id: &SessionId) -> Result<Vec<StoredMessage>> {
    let mut stmt = c
        .prepare_cached(
            "SELECT rowid, id, run_id, role, content, tool_calls_json, tool_call_id, visibility, origin, keeps_from, is_error, created_at
             FROM messages
             WHERE session_id = ?1
               AND rowid >= COALESCE((SELECT MAX(keeps_from) FROM messages
                                      WHERE session_id = ?1 AND keeps_from IS NOT NULL), 0)
             ORDER BY rowid",
        )
        .map_err(backend)?;
    let rows = stmt
        .query_map([session_id.as_str()], stored_message_columns)
        .map_err(backend)?;
    let mut messages = to_stored_messages(rows)?;
    // Only the latest summary stands; it leads, in place of what it replaced.
    let summaries: Vec<usize> = (messages.iter().enumerate())
        .filter(|(_, m)| m.message.keeps_from.is_some())
        .map(|(i, _)| i)
        .collect();
    if let Some(&latest) = summaries.last() {
        let summary = messages.remove(latest);
        messages.retain(|m| m.message.keeps_from.is_none());
        messages.insert(0, summary);
    }
    Ok(messages)
}

fn to_stored_messages(
    rows: impl Iterator<Item = rusqlite::Result<StoredMessageColumns>>,
) -> Result<Vec<StoredMessage>> {
    let mut messages = Vec::new();
    for row in rows {
        let (position, id, run_id, columns, created_at) = row.map_err(backend)?;
        messages.push(StoredMessage {
            id,
            run_id: RunId::parse(&run_id).map_err(|e| Error::Corrupt(e.to_string()))?,
            position,
            message: to_message(columns)?,
            created_at,
        });
    }
    Ok(messages)
}

type MessageColumns = (
    String,
    String,
    Option<String>,
    Option<String>,
    String,
    String,
    Option<i64>,
    bool,
);

fn message_columns(r: &rusqlite::Row<'_>, at: usize) -> rusqlite::Result<MessageColumns> {
    Ok((
        r.get(at)?,
        r.get(at + 1)?,
        r.get(at + 2)?,
        r.get(at + 3)?,
        r.get(at + 4)?,
        r.get(at + 5)?,
        r.get(at + 6)?,
        r.get(at + 7)?,
    ))
}

fn to_message(columns: MessageColumns) -> Result<Message> {
    let (role, content, tool_calls, tool_call_id, visibility, origin, keeps_from, is_error) =
        columns;
    Ok(Message {
        role: sql_enum(&role)?,
        content,
        tool_calls: tool_calls
            .map(|t| from_json(&t, "tool calls"))
            .transpose()?
            .unwrap_or_default(),
        tool_call_id,
        visibility: sql_enum(&visibility)?,
        origin: sql_enum(&origin)?,
        keeps_from,
        is_error,
    })
}

pub(crate) fn history(c: &Tx<'_>, session_id: &SessionId) -> Result<Vec<Message>> {
    let mut stmt = c
        .prepare_cached(
            "SELECT role, content, tool_calls_json, tool_call_id, visibility, origin, keeps_from, is_error FROM messages
             WHERE session_id = ?1 ORDER BY rowid",
        )
        .map_err(backend)?;
    let rows = stmt
        .query_map([session_id.as_str()], |r| message_columns(r, 0))
        .map_err(backend)?;
    rows.map(|row| to_message(row.map_err(backend)?)).collect()
}

const RUN_COLUMNS: &str =
    "id, session_id, status, stop_reason, step_index, created_at, finished_at";

type RunColumns = (
    String,
    String,
    String,
    Option<String>,
    i64,
    i64,
    Option<i64>,
);

fn run_columns(r: &rusqlite::Row<'_>) -> rusqlite::Result<RunColumns> {
    r.try_into()
}

fn to_run_summary(row: RunColumns) -> Result<RunSummary> {
    let (id, session, status, stop_reason, step_index, created_at, finished_at) = row;
    Ok(RunSummary {
        run_id: RunId::parse(&id).map_err(|e| Error::Corrupt(e.to_string()))?,
        session_id: SessionId::parse(&session).map_err(|e| Error::Corrupt(e.to_string()))?,
        status: RunStatus::parse(&status)
            .ok_or_else(|| Error::Corrupt(format!("unknown status {status:?}")))?,
        stop_reason: stop_reason
            .map(|r| sql_enum::<StopReason>(&r))
            .transpose()?,
        step_index: step_index as u64,
        created_at,
        finished_at,
    })
}

pub(crate) fn list_runs(c: &Tx<'_>) -> Result<Vec<RunSummary>> {
    let mut stmt = c
        .prepare_cached(&format!("SELECT {RUN_COLUMNS} FROM runs ORDER BY rowid"))
        .map_err(backend)?;
    let rows = stmt.query_map([], run_columns).map_err(backend)?;
    rows.map(|row| to_run_summary(row.map_err(backend)?))
        .collect()
}

pub(crate) fn session_runs(
    c: &Tx<'_>,
    session_id: &SessionId,
    after: Option<&RunId>,
    limit: u32,
) -> Result<Vec<RunSummary>> {
    let mut stmt = c
        .prepare_cached(&format!(
            "SELECT {RUN_COLUMNS} FROM runs WHERE session_id = ?1 AND id > ?2 ORDER BY id LIMIT ?3"
        ))
        .map_err(backend)?;
    let rows = stmt
        .query_map(
            params![session_id.as_str(), after.map_or("", |a| a.as_str()), limit],
            run_columns,
        )
        .map_err(backend)?;
    rows.map(|row| to_run_summary(row.map_err(backend)?))
        .collect()
}

pub(crate) fn steps(c: &Tx<'_>, run_id: &RunId) -> Result<Vec<StepRecord>> {
    let mut stmt = c
        .prepare_cached(
            "SELECT step_index, instruction, started_at, finished_at, summary_json FROM steps WHERE run_id = ?1 ORDER BY step_index",
        )
        .map_err(backend)?;
    let rows = stmt
        .query_map([run_id.as_str()], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, i64>(3)?,
                r.get::<_, String>(4)?,
            ))
        })
        .map_err(backend)?;
    let mut steps = Vec::new();
    for row in rows {
        let (index, instruction, started_at, finished_at, summary) = row.map_err(backend)?;
        steps.push(StepRecord {
            index: index as u64,
            instruction,
            started_at,
            finished_at,
            summary: from_json(&summary, "step summary")?,
        });
    }
    Ok(steps)
}

const EVENT_COLUMNS: &str = "session_id, seq, run_id, kind, payload_json, created_at";

type EventColumns = (String, i64, Option<String>, String, String, i64);

fn event_columns(r: &rusqlite::Row<'_>) -> rusqlite::Result<EventColumns> {
    r.try_into()
}

fn to_event(row: EventColumns) -> Result<StoredEvent> {
    let (session, seq, run_id, kind, payload, created_at) = row;
    let corrupt = |e: ratchet_core::IdError| Error::Corrupt(e.to_string());
    Ok(StoredEvent {
        session_id: SessionId::parse(&session).map_err(corrupt)?,
        seq,
        run_id: run_id
            .map(|r| RunId::parse(&r))
            .transpose()
            .map_err(corrupt)?,
        kind,
        payload: from_json(&payload, "event payload")?,
        created_at,
    })
}

pub(crate) fn events_after(
    c: &Tx<'_>,
    session_id: &SessionId,
    after_seq: i64,
    limit: u32,
) -> Result<Vec<StoredEvent>> {
    let mut stmt = c
        .prepare_cached(&format!(
            "SELECT {EVENT_COLUMNS} FROM events WHERE session_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3"
        ))
        .map_err(backend)?;
    let rows = stmt
        .query_map(
            params![session_id.as_str(), after_seq, limit],
            event_columns,
        )
        .map_err(backend)?;
    rows.map(|row| to_event(row.map_err(backend)?)).collect()
}

pub(crate) fn run_events_after(
    c: &Tx<'_>,
    run_id: &RunId,
    after_seq: i64,
    limit: u32,
) -> Result<Vec<StoredEvent>> {
    let mut stmt = c
        .prepare_cached(&format!(
            "SELECT {EVENT_COLUMNS} FROM events
             WHERE session_id = (SELECT session_id FROM runs WHERE id = ?1) AND seq > ?2 AND run_id = ?1
             ORDER BY seq LIMIT ?3"
        ))
        .map_err(backend)?;
    let rows = stmt
        .query_map(params![run_id.as_str(), after_seq, limit], event_columns)
        .map_err(backend)?;
    rows.map(|row| to_event(row.map_err(backend)?)).collect()
}

pub(crate) fn lease_owners(c: &Tx<'_>) -> Result<Vec<String>> {
    let mut stmt = c
        .prepare_cached("SELECT DISTINCT lease_owner FROM step_jobs WHERE lease_owner IS NOT NULL")
        .map_err(backend)?;
    let owners = stmt.query_map([], |r| r.get(0)).map_err(backend)?;
    owners.collect::<rusqlite::Result<_>>().map_err(backend)
}

pub(crate) fn release_leases(c: &Tx<'_>, owner: &str) -> Result<u64> {
    let released = c
        .prepare_cached(
            "UPDATE step_jobs SET lease_owner = NULL, ready_at = 0 WHERE lease_owner = ?1",
        )
        .and_then(|mut s| s.execute([owner]))
        .map_err(backend)?;
    Ok(released as u64)
}

pub(crate) fn runs_with_jobs(c: &Tx<'_>) -> Result<Vec<RunId>> {
    let mut stmt = c
        .prepare_cached("SELECT DISTINCT run_id FROM step_jobs")
        .map_err(backend)?;
    let ids = stmt
        .query_map([], |r| r.get::<_, String>(0))
        .map_err(backend)?;
    let mut runs = Vec::new();
    for id in ids {
        runs.push(RunId::parse(&id.map_err(backend)?).map_err(|e| Error::Corrupt(e.to_string()))?);
    }
    Ok(runs)
}

pub(crate) fn stats(c: &Tx<'_>, now: Millis) -> Result<StoreStats> {
    let mut stmt = c
        .prepare_cached("SELECT status, count(*) FROM runs GROUP BY status")
        .map_err(backend)?;
    let rows = stmt
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))
        .map_err(backend)?;
    let mut runs_by_status = Vec::new();
    for row in rows {
        let (status, count) = row.map_err(backend)?;
        let status = RunStatus::parse(&status)
            .ok_or_else(|| Error::Corrupt(format!("unknown status {status:?}")))?;
        runs_by_status.push((status, count as u64));
    }
    let (ready, held): (i64, i64) = c
        .prepare_cached(
            "SELECT count(*) FILTER (WHERE ready_at <= ?1), count(*) FILTER (WHERE ready_at > ?1) FROM step_jobs",
        )
        .and_then(|mut s| s.query_row([now], |r| Ok((r.get(0)?, r.get(1)?))))
        .map_err(backend)?;
    Ok(StoreStats {
        runs_by_status,
        ready_jobs: ready as u64,
        held_jobs: held as u64,
    })
}

pub(crate) fn reconcile(
    c: &Tx<'_>,
    run_id: &RunId,
    call_id: &str,
    answer: Reconciliation,
    result: Option<String>,
    now: Millis,
) -> Result<Reconciled> {
    let mut state = load_state(c, run_id)?;
    let (drafts, job) = ratchet_core::step::reconcile(&mut state, call_id, answer, result)?;
    write_state(c, &state)?;
    if let Some(job) = &job {
        insert_job(c, job, now)?;
    }
    let events = insert_events(c, &state.session_id, Some(run_id), &drafts, now)?;
    Ok(Reconciled {
        events,
        resumed: job.is_some(),
    })
}

pub(crate) fn resume_failed(
    c: &Tx<'_>,
    run_id: &RunId,
    how: Resumption,
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    let mut state = load_state(c, run_id)?;
    let (drafts, job) = ratchet_core::step::resume_failed(&mut state, how, now)?;
    // The run takes its session back only if nobody else holds it: one active run each.
    let taken = c
        .prepare_cached(
            "UPDATE sessions SET active_run_id = ?2 WHERE id = ?1 AND active_run_id IS NULL",
        )
        .and_then(|mut s| s.execute([state.session_id.as_str(), run_id.as_str()]))
        .map_err(backend)?;
    if taken == 0 {
        let session = get_session(c, &state.session_id)?;
        return Err(Error::Conflict(format!(
            "session {} has another active run ({}); continue {run_id} once it has ended",
            state.session_id,
            session
                .active_run_id
                .map_or("-".to_owned(), |r| r.to_string())
        )));
    }
    write_state(c, &state)?;
    insert_job(c, &job, now)?;
    insert_events(c, &state.session_id, Some(run_id), &drafts, now)
}

const APPROVAL_COLUMNS: &str = "a.id, a.run_id, a.session_id, a.status, r.status, a.calls_json, a.answer_json, a.created_at, a.decided_at";

type ApprovalColumns = (
    String,
    String,
    String,
    String,
    String,
    String,
    Option<String>,
    Millis,
    Option<Millis>,
);

fn approval_columns(r: &rusqlite::Row<'_>) -> rusqlite::Result<ApprovalColumns> {
    r.try_into()
}

fn to_approval(row: ApprovalColumns) -> Result<Approval> {
    let (id, run_id, session_id, status, run_status, calls, answer, created_at, decided_at) = row;
    let corrupt = |e: ratchet_core::IdError| Error::Corrupt(e.to_string());
    let mut status = ApprovalStatus::parse(&status)
        .ok_or_else(|| Error::Corrupt(format!("unknown approval status {status:?}")))?;
    if status == ApprovalStatus::Pending && run_status != RunStatus::WaitingHuman.as_str() {
        status = ApprovalStatus::Cancelled;
    }
    Ok(Approval {
        id: ApprovalId::parse(&id).map_err(corrupt)?,
        run_id: RunId::parse(&run_id).map_err(corrupt)?,
        session_id: SessionId::parse(&session_id).map_err(corrupt)?,
        status,
        calls: from_json(&calls, "approval calls")?,
        answer: answer
            .map(|a| from_json(&a, "approval answer"))
            .transpose()?,
        created_at,
        decided_at,
    })
}

pub(crate) fn approvals(
    c: &Tx<'_>,
    tenant: &str,
    status: Option<ApprovalStatus>,
    after: Option<&ApprovalId>,
    limit: u32,
) -> Result<Vec<Approval>> {
    // A pending row is pending only while its run waits; otherwise it reads as cancelled.
    let filter = match status {
        None => "",
        Some(ApprovalStatus::Pending) => "AND a.status = 'pending' AND r.status = 'waiting_human'",
        Some(ApprovalStatus::Cancelled) => {
            "AND a.status = 'pending' AND r.status <> 'waiting_human'"
        }
        Some(ApprovalStatus::Decided) => "AND a.status = 'decided'",
        Some(ApprovalStatus::Aborted) => "AND a.status = 'aborted'",
    };
    let sql = format!(
        "SELECT {APPROVAL_COLUMNS} FROM approvals a
         JOIN runs r ON r.id = a.run_id
         JOIN sessions s ON s.id = a.session_id
         WHERE s.tenant = ?1
           AND a.position > COALESCE((SELECT position FROM approvals WHERE id = ?2), 0)
           {filter}
         ORDER BY a.position LIMIT ?3"
    );
    let rows = c
        .prepare_cached(&sql)
        .and_then(|mut s| {
            s.query_map(
                params![tenant, after.map(ApprovalId::as_str), limit],
                approval_columns,
            )?
            .collect::<rusqlite::Result<Vec<_>>>()
        })
        .map_err(backend)?;
    rows.into_iter().map(to_approval).collect()
}

pub(crate) fn get_approval(c: &Tx<'_>, id: &ApprovalId) -> Result<Approval> {
    let sql = format!(
        "SELECT {APPROVAL_COLUMNS} FROM approvals a JOIN runs r ON r.id = a.run_id WHERE a.id = ?1"
    );
    let row = c
        .prepare_cached(&sql)
        .and_then(|mut s| s.query_row([id.as_str()], approval_columns).optional())
        .map_err(backend)?
        .ok_or_else(|| Error::NotFound {
            kind: "approval",
            id: id.to_string(),
        })?;
    to_approval(row)
}

pub(crate) fn answer_approval(
    c: &Tx<'_>,
    id: &ApprovalId,
    answer: ApprovalAnswer,
    now: Millis,
) -> Result<Answered> {
    let approval = get_approval(c, id)?;
    let answer = answer.normalized();
    if let Some(given) = approval.answer {
        if given == answer {
            return Ok(Answered {
                events: Vec::new(),
                resumed: false,
                enqueued: false,
                repeated: true,
            });
        }
        return Err(Error::Conflict(format!(
            "approval {id} was already answered with {}",
            to_json(&given)?
        )));
    }
    let mut state = load_state(c, &approval.run_id)?;
    let (drafts, job) = ratchet_core::approval::answer_approval(&mut state, id, &answer, now)?;
    write_state(c, &state)?;
    let status = match answer {
        ApprovalAnswer::Abort => ApprovalStatus::Aborted,
        ApprovalAnswer::Decisions(_) => ApprovalStatus::Decided,
    };
    let answer_json = to_json(&answer)?;
    c.prepare_cached(
        "UPDATE approvals SET status = ?2, answer_json = ?3, decided_at = ?4 WHERE id = ?1",
    )
    .and_then(|mut s| s.execute(params![id.as_str(), status.as_str(), answer_json, now]))
    .map_err(backend)?;
    if let Some(job) = &job {
        insert_job(c, job, now)?;
    }
    let mut events = insert_events(c, &state.session_id, Some(&state.run_id), &drafts, now)?;
    let mut enqueued = false;
    if state.status.is_terminal() {
        c.configs.forget(&state.run_id);
        c.prepare_cached("UPDATE runs SET cancel_requested = 1 WHERE id = ?1")
            .and_then(|mut s| s.execute([state.run_id.as_str()]))
            .map_err(backend)?;
        events.extend(release_session(c, &state.session_id, &mut enqueued, now)?);
    }
    Ok(Answered {
        events,
        resumed: job.is_some(),
        enqueued,
        repeated: false,
    })
}
