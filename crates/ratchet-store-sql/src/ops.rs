//! The transaction bodies. Each function runs inside one write transaction (or on a read
//! connection) and is the whole of one `Store` operation.
//!
//! A write that changes anything of a session locks the session first (`Db::lock_session`):
//! with several processes on one database, that makes the writes of one session serial, so
//! every check below (the active run, the committed step, the cancel flag) still holds when
//! the write lands. Claims never take that lock (they take only their job's row), so that a
//! commit, which holds the session and then waits for its job's row, cannot deadlock with one.

use ratchet_core::delegation::{ChildResult, ChildRun, child_finished, join_children};
use ratchet_core::inbox::NextTurn;
use ratchet_core::step::{Reconciliation, Resumption, cancel_idle, start_run};
use ratchet_core::{
    AgentState, ApprovalAnswer, ApprovalId, EventDraft, EventKind, HumanRequest, IdError, Message,
    Millis, Origin, Phase, RunConfigSnapshot, RunId, RunStatus, SessionId, StepJob, StepRecord,
    StepResult, StopReason, ToolOutcome, TreeSpend, Visibility,
};
use ratchet_store::{
    Admission, Answered, Approval, ApprovalStatus, CancelOutcome, Claim, ClaimedStep, Commit,
    Error, Intent, IntentKind, IntentRecord, Lease, ListOrder, NewRun, PauseOutcome, Reconciled,
    RecordedIntents, ResumeOutcome, RunSummary, Session, SessionCursor, SessionQuery, SessionSpec,
    SessionState, Stale, StepMessages, StoreStats, StoredEvent, StoredMessage, Submitted, TimedOut,
    TreeNode, WhenBusy,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::db::{Announcement, Db, Row, StoredConfig, Value};
use crate::{Result, params};

pub(crate) fn to_json(value: &impl Serialize) -> Result<String> {
    serde_json::to_string(value).map_err(|e| Error::Corrupt(format!("cannot encode: {e}")))
}

pub(crate) fn from_json<T: DeserializeOwned>(text: &str, what: &str) -> Result<T> {
    serde_json::from_str(text).map_err(|e| Error::Corrupt(format!("{what}: {e}")))
}

/// Reads an enum stored as its serde name.
pub fn sql_enum<T: DeserializeOwned>(text: &str) -> Result<T> {
    from_json(&format!("\"{text}\""), "stored enum")
}

fn sql_str<T: Serialize>(value: &T) -> Result<String> {
    Ok(to_json(value)?.trim_matches('"').to_owned())
}

pub(crate) fn corrupt(error: IdError) -> Error {
    Error::Corrupt(error.to_string())
}

pub(crate) fn parse_run_id(text: &str) -> Result<RunId> {
    RunId::parse(text).map_err(corrupt)
}

pub(crate) fn parse_session_id(text: &str) -> Result<SessionId> {
    SessionId::parse(text).map_err(corrupt)
}

fn parse_status(text: &str) -> Result<RunStatus> {
    RunStatus::parse(text).ok_or_else(|| Error::Corrupt(format!("unknown status {text:?}")))
}

fn run_not_found(run_id: &RunId) -> Error {
    Error::NotFound {
        kind: "run",
        id: run_id.to_string(),
    }
}

/// Locks the session a run belongs to (see the module's doc).
fn lock_session_of_run(c: &dyn Db, run_id: &RunId) -> Result<()> {
    c.lock_session_of_run(run_id.as_str())
}

pub(crate) fn create_session(
    c: &dyn Db,
    id: &SessionId,
    spec: SessionSpec,
    now: Millis,
) -> Result<Session> {
    let metadata = spec.metadata.as_ref().map(to_json).transpose()?;
    let inserted = c.execute(
        "INSERT INTO sessions (id, created_at, tenant, agent, metadata_json) VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT (id) DO NOTHING",
        &params![id.as_str(), now, &spec.tenant, &spec.agent, &metadata],
    )?;
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
        archived_at: None,
        deleted_at: None,
        active_run_status: None,
        last_activity_at: now,
        title: None,
        last_run_status: None,
        parent_session_id: None,
    })
}

// The last two read the active run's status and the latest event's time, each by a primary key.
/// A session as read: its columns, its active run's status, when it was last active, and its
/// latest run's status (run ids are time-ordered), named so that a list can filter on them.
const SELECT_SESSION: &str = "SELECT id, tenant, agent, metadata_json, created_at, active_run_id, archived_at, deleted_at,
     (SELECT status FROM runs WHERE runs.id = sessions.active_run_id) AS active_status,
     COALESCE((SELECT created_at FROM events WHERE events.session_id = sessions.id ORDER BY seq DESC LIMIT 1), created_at) AS activity,
     title,
     (SELECT status FROM runs WHERE runs.session_id = sessions.id ORDER BY id DESC LIMIT 1) AS last_status,
     parent_session_id
     FROM sessions";

fn to_session(mut row: Row) -> Result<Session> {
    let created_at = row.int(4)?;
    Ok(Session {
        id: parse_session_id(&row.text(0)?)?,
        tenant: row.text(1)?,
        agent: row.opt_text(2)?,
        metadata: row
            .opt_text(3)?
            .map(|m| from_json(&m, "session metadata"))
            .transpose()?,
        created_at,
        active_run_id: row.opt_text(5)?.as_deref().map(parse_run_id).transpose()?,
        archived_at: row.opt_int(6)?,
        deleted_at: row.opt_int(7)?,
        active_run_status: row.opt_text(8)?.as_deref().map(parse_status).transpose()?,
        last_activity_at: row.opt_int(9)?.unwrap_or(created_at),
        title: row.opt_text(10)?,
        last_run_status: row.opt_text(11)?.as_deref().map(parse_status).transpose()?,
        parent_session_id: (row.opt_text(12)?.as_deref())
            .map(parse_session_id)
            .transpose()?,
    })
}

pub(crate) fn get_session(c: &dyn Db, id: &SessionId) -> Result<Session> {
    let row = c
        .query_opt(
            &format!("{SELECT_SESSION} WHERE id = ?1"),
            &params![id.as_str()],
        )?
        .ok_or_else(|| Error::NotFound {
            kind: "session",
            id: id.to_string(),
        })?;
    to_session(row)
}

pub(crate) fn list_sessions(
    c: &dyn Db,
    tenant: &str,
    query: &SessionQuery,
    limit: u32,
) -> Result<Vec<Session>> {
    let mut args = vec![Value::Text(tenant.to_owned())];
    // The values bound to the statement as it is built, each as a column would read back.
    let mut bind = |arg: Value| {
        args.push(arg);
        format!("?{}", args.len())
    };
    let mut sql = format!(
        "SELECT * FROM ({SELECT_SESSION} WHERE tenant = ?1 AND root_session_id IS NULL AND deleted_at IS NULL) s
         WHERE 1 = 1"
    );
    if let Some(state) = query.state {
        sql.push_str(match state {
            SessionState::Archived => " AND archived_at IS NOT NULL",
            SessionState::WaitingHuman => {
                " AND archived_at IS NULL AND active_status = 'waiting_human'"
            }
            SessionState::Active => {
                " AND archived_at IS NULL AND active_status IS NOT NULL AND active_status <> 'waiting_human'"
            }
            SessionState::Failed => {
                " AND archived_at IS NULL AND active_status IS NULL AND last_status = 'failed'"
            }
            SessionState::Idle => {
                " AND archived_at IS NULL AND active_status IS NULL AND (last_status IS NULL OR last_status <> 'failed')"
            }
        });
    }
    match &query.agent {
        Some(Some(agent)) => {
            let agent = bind(Value::Text(agent.clone()));
            sql.push_str(&format!(" AND agent = {agent}"));
        }
        Some(None) => sql.push_str(" AND agent IS NULL"),
        None => {}
    }
    if let Some(from) = query.created_from {
        let from = bind(Value::Int(from));
        sql.push_str(&format!(" AND created_at >= {from}"));
    }
    if let Some(before) = query.created_before {
        let before = bind(Value::Int(before));
        sql.push_str(&format!(" AND created_at < {before}"));
    }
    if let Some(text) = &query.text {
        // LIKE's wildcards in the text are matched as themselves.
        let escaped: String = (text.to_lowercase().chars())
            .flat_map(|ch| match ch {
                '%' | '_' | '\\' => vec!['\\', ch],
                ch => vec![ch],
            })
            .collect();
        let pattern = bind(Value::Text(format!("%{escaped}%")));
        sql.push_str(&format!(
            " AND (LOWER(id) LIKE {pattern} ESCAPE '\\' OR LOWER(COALESCE(title, '')) LIKE {pattern} ESCAPE '\\'
               OR EXISTS (SELECT 1 FROM messages m WHERE m.session_id = s.id AND m.visibility = 'visible'
                          AND m.draft_of IS NULL AND m.role IN ('user', 'assistant')
                          AND LOWER(m.content) LIKE {pattern} ESCAPE '\\'))"
        ));
    }
    let order = match (query.order, &query.after) {
        (ListOrder::OldestFirst, None) => "ORDER BY id",
        (ListOrder::NewestFirst, None) => "ORDER BY id DESC",
        (ListOrder::LatestActivityFirst, None) => "ORDER BY activity DESC, id DESC",
        (ListOrder::OldestFirst, Some(SessionCursor::Id(after))) => {
            let after = bind(Value::Text(after.to_string()));
            sql.push_str(&format!(" AND id > {after}"));
            "ORDER BY id"
        }
        (ListOrder::NewestFirst, Some(SessionCursor::Id(after))) => {
            let after = bind(Value::Text(after.to_string()));
            sql.push_str(&format!(" AND id < {after}"));
            "ORDER BY id DESC"
        }
        (ListOrder::LatestActivityFirst, Some(SessionCursor::Activity(at, after))) => {
            let at = bind(Value::Int(*at));
            let after = bind(Value::Text(after.to_string()));
            sql.push_str(&format!(
                " AND (activity < {at} OR (activity = {at} AND id < {after}))"
            ));
            "ORDER BY activity DESC, id DESC"
        }
        (order, Some(cursor)) => {
            return Err(Error::Invalid(format!(
                "a cursor of a list in {order:?} order, found {cursor:?}"
            )));
        }
    };
    let limit = bind(Value::Int(i64::from(limit)));
    sql.push_str(&format!(" {order} LIMIT {limit}"));
    let params: Vec<crate::db::Param<'_>> = args.iter().map(crate::db::Param::from).collect();
    c.query(&sql, &params)?
        .into_iter()
        .map(to_session)
        .collect()
}

pub(crate) fn rename_session(c: &dyn Db, id: &SessionId, title: &str) -> Result<Session> {
    let renamed = c.execute(
        "UPDATE sessions SET title = ?2 WHERE id = ?1 AND deleted_at IS NULL",
        &params![id.as_str(), title],
    )?;
    if renamed == 0 {
        return Err(Error::NotFound {
            kind: "session",
            id: id.to_string(),
        });
    }
    get_session(c, id)
}

pub(crate) fn submit_message(c: &dyn Db, new: NewRun, now: Millis) -> Result<Submitted> {
    c.lock_session(new.session_id.as_str())?;
    let Some(mut row) = c
        .query_opt(
            "SELECT active_run_id, root_session_id, archived_at FROM sessions WHERE id = ?1 AND deleted_at IS NULL",
            &params![new.session_id.as_str()],
        )?
    else {
        return Err(Error::NotFound {
            kind: "session",
            id: new.session_id.to_string(),
        });
    };
    if row.opt_int(2)?.is_some() {
        return Err(Error::Conflict(format!(
            "session {} is archived and takes no more messages; start a new session",
            new.session_id
        )));
    }
    let active = row.opt_text(0)?.as_deref().map(parse_run_id).transpose()?;
    if let Some(root) = row.opt_text(1)? {
        return Err(Error::Invalid(format!(
            "session {} holds a delegated run; send messages to its root session {root}",
            new.session_id
        )));
    }
    if new.when_busy != WhenBusy::Steer || active.is_none() {
        check_quota(c, &new.session_id, new.quota, 1)?;
    }
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
        crate::bounds::admit_user_steer(c, &new.session_id, active, &new.content)?;
        let frozen = to_json(&new.config)?;
        c.execute(
            "INSERT INTO steers (message_id, session_id, run_id, content, config_json, created_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            &params![
                new.message_id.as_str(),
                new.session_id.as_str(),
                new.run_id.as_str(),
                &new.content,
                &frozen,
                now
            ],
        )?;
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
    // A session is called by its first message until someone renames it.
    c.execute(
        "UPDATE sessions SET title = ?2 WHERE id = ?1 AND title IS NULL",
        &params![
            new.session_id.as_str(),
            &ratchet_core::message::title_of(&new.content)
        ],
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

/// The statuses a run quota counts.
pub(crate) const ACTIVE_STATUSES: &str =
    "('queued', 'running', 'waiting_human', 'waiting_children', 'paused', 'cancelling')";

/// Non-terminal runs of a root session, the runs of its delegations included.
fn active_in_session(c: &dyn Db, root_session: &SessionId) -> Result<u64> {
    count(
        c,
        &format!(
            "SELECT count(*) FROM runs r JOIN sessions s ON s.id = r.session_id
             WHERE (s.id = ?1 OR s.root_session_id = ?1) AND r.status IN {ACTIVE_STATUSES}"
        ),
        &params![root_session.as_str()],
    )
}

pub(crate) fn count(c: &dyn Db, sql: &str, params: &[crate::db::Param<'_>]) -> Result<u64> {
    let n = c
        .query_opt(sql, params)?
        .ok_or_else(|| Error::Backend("a count returned no row".into()))?
        .int(0)?;
    Ok(n.max(0) as u64)
}

/// Refuses to admit `adding` more runs to `root_session` beyond the quota. The caller holds
/// the session's lock, which makes the per-session count exact; the global count is made
/// exact by the quota's own lock, taken here and held until the transaction ends.
fn check_quota(
    c: &dyn Db,
    root_session: &SessionId,
    quota: ratchet_store::RunQuota,
    adding: u64,
) -> Result<()> {
    if let Some(max) = quota.per_session {
        let active = active_in_session(c, root_session)?;
        if active + adding > max {
            return Err(Error::QuotaExceeded(format!(
                "session {root_session} has {active} unfinished runs and may have at most {max}; {adding} more do not fit — wait for some to end"
            )));
        }
    }
    if let Some(max) = quota.global {
        c.lock_run_quota()?;
        let active = count(
            c,
            &format!("SELECT count(*) FROM runs WHERE status IN {ACTIVE_STATUSES}"),
            &[],
        )?;
        if active + adding > max {
            return Err(Error::QuotaExceeded(format!(
                "{active} runs are unfinished and at most {max} may be; {adding} more do not fit — wait for some to end"
            )));
        }
    }
    Ok(())
}

/// Runs of the tree whose root run is `root`, ended ones included.
fn tree_runs(c: &dyn Db, root: &RunId) -> Result<u64> {
    count(
        c,
        "SELECT count(*) FROM runs WHERE id = ?1 OR root_run_id = ?1",
        &params![root.as_str()],
    )
}

/// Starts the children a parent's step created, each the active run of a new session below
/// the parent's, with its task as its first message and its first job enqueued — all of them,
/// or none when the tree's size or the run quota has no room for them all.
fn start_children(
    c: &dyn Db,
    parent: &AgentState,
    children: &[ChildRun],
    quota: ratchet_store::RunQuota,
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    let (root, root_session) = match &parent.lineage {
        Some(l) => (&l.root_run_id, &l.root_session_id),
        None => (&parent.run_id, &parent.session_id),
    };
    let limit = parent.config.delegation.max_tree_runs;
    let existing = tree_runs(c, root)?;
    if existing + children.len() as u64 > limit {
        return Err(Error::QuotaExceeded(format!(
            "the run tree of {root} has {existing} runs and may have at most {limit}"
        )));
    }
    check_quota(c, root_session, quota, children.len() as u64)?;
    let tenant = c
        .query_opt(
            "SELECT tenant FROM sessions WHERE id = ?1",
            &params![parent.session_id.as_str()],
        )?
        .ok_or_else(|| Error::NotFound {
            kind: "session",
            id: parent.session_id.to_string(),
        })?
        .text(0)?;
    let mut events = crate::inbox::reserve(c, parent, children, now)?;
    for child in children {
        let lineage = &child.lineage;
        c.execute(
            "INSERT INTO sessions (id, created_at, tenant, agent, parent_session_id, root_session_id)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            &params![
                child.session_id.as_str(),
                now,
                &tenant,
                &lineage.agent,
                parent.session_id.as_str(),
                lineage.root_session_id.as_str()
            ],
        )?;
        let (mut state, created) = insert_queued_run(
            c,
            &child.session_id,
            &child.run_id,
            child.message_id.as_str(),
            &child.task,
            child.config.clone(),
            now,
        )?;
        c.execute(
            "UPDATE runs SET parent_run_id = ?2, parent_step = ?3, parent_slot = ?4, task_index = ?5,
                             root_run_id = ?6, agent = ?7, depth = ?8, inbox_group = ?9
             WHERE id = ?1",
            &params![
                child.run_id.as_str(),
                lineage.parent_run_id.as_str(),
                lineage.parent_step as i64,
                lineage.parent_slot,
                lineage.task_index,
                lineage.root_run_id.as_str(),
                &lineage.agent,
                lineage.depth,
                lineage.background.as_ref().map(|b| b.group.as_str())
            ],
        )?;
        state.lineage = Some(lineage.clone());
        let mut drafts = vec![created];
        drafts.extend(start_queued_run(c, state, now)?);
        events.extend(insert_events(
            c,
            &child.session_id,
            Some(&child.run_id),
            &drafts,
            now,
        )?);
    }
    Ok(events)
}

/// A run has just ended (its terminal state written): its session's queue moves on, and — if
/// it is a child — its parent hears of it and, when this was the last of the children it
/// waits for, is joined: running again with every child's result, its next job enqueued.
fn run_ended(
    c: &dyn Db,
    state: &AgentState,
    enqueued: &mut bool,
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    c.configs().forget(&state.run_id);
    let mut events = Vec::new();
    if state.config.continuation {
        events.extend(crate::inbox::continuation_ended(c, state, now)?);
    }
    events.extend(release_session(c, &state.session_id, enqueued, now)?);
    let (Some(lineage), Some(finished)) = (&state.lineage, ChildResult::of(state)) else {
        return Ok(events);
    };
    let parent_id = &lineage.parent_run_id;
    let mut parent = load_state(c, parent_id)?;
    let mut drafts = vec![child_finished(parent_id, &finished)];
    let waiting_on_this = lineage.background.is_none()
        && parent.status == RunStatus::WaitingChildren
        && parent.step_index == lineage.parent_step;
    if waiting_on_this {
        let unfinished = count(
            c,
            &format!(
                "SELECT count(*) FROM runs WHERE parent_run_id = ?1 AND parent_step = ?2
                 AND inbox_group IS NULL AND status IN {ACTIVE_STATUSES}"
            ),
            &params![parent_id.as_str(), lineage.parent_step as i64],
        )?;
        if unfinished == 0 {
            let results = children_results(c, parent_id, lineage.parent_step)?;
            let (joined, job) = join_children(&mut parent, results)?;
            write_state(c, &parent)?;
            insert_job(c, &job, now)?;
            *enqueued = true;
            drafts.extend(joined);
        }
    }
    events.extend(insert_events(
        c,
        &parent.session_id,
        Some(parent_id),
        &drafts,
        now,
    )?);
    events.extend(crate::inbox::background_ended(c, state, enqueued, now)?);
    Ok(events)
}

/// How every child of a parent's step ended, read from their states.
fn children_results(c: &dyn Db, parent: &RunId, step: u64) -> Result<Vec<ChildResult>> {
    let ids = c
        .query(
            "SELECT id FROM runs WHERE parent_run_id = ?1 AND parent_step = ?2 AND inbox_group IS NULL",
            &params![parent.as_str(), step as i64],
        )?
        .into_iter()
        .map(|mut r| parse_run_id(&r.text(0)?))
        .collect::<Result<Vec<_>>>()?;
    ids.iter()
        .map(|id| {
            ChildResult::of(&load_state(c, id)?)
                .ok_or_else(|| Error::Corrupt(format!("child run {id} has no lineage")))
        })
        .collect()
}

/// The part of a stored state a run's spend is read from.
#[derive(serde::Deserialize)]
struct Spent {
    counters: ratchet_core::Counters,
}

pub(crate) fn run_tree(c: &dyn Db, run_id: &RunId) -> Result<Vec<TreeNode>> {
    let root = c
        .query_opt(
            "SELECT COALESCE(root_run_id, id) FROM runs WHERE id = ?1",
            &params![run_id.as_str()],
        )?
        .ok_or_else(|| run_not_found(run_id))?
        .text(0)?;
    let nodes = c
        .query(
            "SELECT id, session_id, parent_run_id, agent, depth, status, stop_reason, step_index, created_at, finished_at, inbox_group IS NOT NULL, state_json
             FROM runs WHERE id = ?1 OR root_run_id = ?1 ORDER BY depth, created_at, id",
            &params![&root],
        )?
        .into_iter()
        .map(|mut r| {
            Ok(TreeNode {
                run_id: parse_run_id(&r.text(0)?)?,
                session_id: parse_session_id(&r.text(1)?)?,
                parent_run_id: r.opt_text(2)?.as_deref().map(parse_run_id).transpose()?,
                agent: r.opt_text(3)?,
                depth: u32::try_from(r.int(4)?)
                    .map_err(|_| Error::Corrupt("a run's depth is out of range".into()))?,
                status: parse_status(&r.text(5)?)?,
                stop_reason: r
                    .opt_text(6)?
                    .map(|reason| sql_enum::<StopReason>(&reason))
                    .transpose()?,
                step_index: r.int(7)? as u64,
                created_at: r.int(8)?,
                finished_at: r.opt_int(9)?,
                background: r.flag(10)?,
                counters: from_json::<Spent>(&r.text(11)?, "run state")?.counters,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    // Only the asked-for run and what lies below it: parents come before their children.
    let mut below = vec![run_id.clone()];
    Ok(nodes
        .into_iter()
        .filter(|node| {
            let inside = node.run_id == *run_id
                || node
                    .parent_run_id
                    .as_ref()
                    .is_some_and(|p| below.contains(p));
            if inside && node.run_id != *run_id {
                below.push(node.run_id.clone());
            }
            inside
        })
        .collect())
}

pub(crate) fn admission(c: &dyn Db, run_id: &RunId) -> Result<Admission> {
    let mut row = c
        .query_opt(
            "SELECT COALESCE(r.root_run_id, r.id), COALESCE(s.root_session_id, s.id)
             FROM runs r JOIN sessions s ON s.id = r.session_id WHERE r.id = ?1",
            &params![run_id.as_str()],
        )?
        .ok_or_else(|| run_not_found(run_id))?;
    let root_run = parse_run_id(&row.text(0)?)?;
    let root_session = parse_session_id(&row.text(1)?)?;
    Ok(Admission {
        active_global: count(
            c,
            &format!("SELECT count(*) FROM runs WHERE status IN {ACTIVE_STATUSES}"),
            &[],
        )?,
        active_in_session: active_in_session(c, &root_session)?,
        tree_runs: tree_runs(c, &root_run)?,
        inbox_held: crate::inbox::held(c, &root_session)?,
    })
}

pub(crate) fn tree_spend(c: &dyn Db, run_id: &RunId) -> Result<TreeSpend> {
    let root = c
        .query_opt(
            "SELECT COALESCE(root_run_id, id) FROM runs WHERE id = ?1",
            &params![run_id.as_str()],
        )?
        .ok_or_else(|| run_not_found(run_id))?
        .text(0)?;
    let mut spend = TreeSpend::default();
    for mut row in c.query(
        "SELECT state_json FROM runs WHERE id = ?1 OR root_run_id = ?1",
        &params![&root],
    )? {
        let counters = from_json::<Spent>(&row.text(0)?, "run state")?.counters;
        spend.tokens = spend
            .tokens
            .saturating_add(counters.input_tokens.saturating_add(counters.output_tokens));
        spend.cost_microusd = spend.cost_microusd.saturating_add(counters.cost_microusd);
    }
    Ok(spend)
}

/// Inserts a run waiting in its session's queue, with the message that will start it.
pub(crate) fn insert_queued_run(
    c: &dyn Db,
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
    let stored_as = config_id(&config_json);
    c.write(
        "INSERT INTO run_configs (id, config_json) VALUES (?1, ?2) ON CONFLICT (id) DO NOTHING",
        &params![&stored_as, &config_json],
    )?;
    let agent = state.config.agent.as_ref().map(|a| a.id.as_str());
    c.execute(
        "INSERT INTO runs (id, session_id, status, step_index, config_id, state_json, input_json, created_at, agent)
         VALUES (?1, ?2, 'queued', 0, ?3, ?4, ?5, ?6, ?7)",
        &params![
            run_id.as_str(),
            session_id.as_str(),
            &stored_as,
            &state_json,
            &input_json,
            created_at,
            agent
        ],
    )?;
    // The message rides along so that a client can draw a queued turn from the events alone;
    // a continuation's trigger is hidden from clients, so only its origin is told.
    let created = if state.config.continuation {
        json!({"run_id": run_id, "message_id": message_id, "origin": "continuation"})
    } else {
        json!({"run_id": run_id, "message_id": message_id, "content": content})
    };
    let created = EventDraft::new(EventKind::RunCreated, created);
    Ok((state, created))
}

pub(crate) struct Steer {
    pub message_id: String,
    pub run_id: String,
    pub content: String,
    pub config_json: String,
    pub created_at: Millis,
}

/// Takes the session's waiting steers out of their table, oldest first.
pub(crate) fn take_steers(c: &dyn Db, session_id: &SessionId) -> Result<Vec<Steer>> {
    let steers = c
        .query(
            "SELECT message_id, run_id, content, config_json, created_at FROM steers
             WHERE session_id = ?1 ORDER BY position",
            &params![session_id.as_str()],
        )?
        .into_iter()
        .map(|mut r| {
            Ok(Steer {
                message_id: r.text(0)?,
                run_id: r.text(1)?,
                content: r.text(2)?,
                config_json: r.text(3)?,
                created_at: r.int(4)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if !steers.is_empty() {
        c.execute(
            "DELETE FROM steers WHERE session_id = ?1",
            &params![session_id.as_str()],
        )?;
    }
    Ok(steers)
}

/// The run's next step calls the model: the session's waiting steers join its history now.
fn absorb_steers(
    c: &dyn Db,
    state: &AgentState,
    added: &mut Vec<Message>,
    now: Millis,
) -> Result<Vec<EventDraft>> {
    let mut drafts = Vec::new();
    for steer in take_steers(c, &state.session_id)? {
        let message = Message {
            origin: Origin::Steer,
            ..Message::user(steer.content.clone())
        };
        insert_message(c, &steer.message_id, state, &message, now)?;
        added.push(message);
        drafts.push(EventDraft::new(
            EventKind::MessageSteered,
            json!({"run_id": state.run_id, "message_id": steer.message_id, "content": steer.content}),
        ));
    }
    Ok(drafts)
}

/// Makes a queued run the session's active run: its user message enters history, its first
/// job is enqueued.
pub(crate) fn start_queued_run(
    c: &dyn Db,
    mut state: AgentState,
    now: Millis,
) -> Result<Vec<EventDraft>> {
    let input = c
        .query_opt(
            "SELECT input_json FROM runs WHERE id = ?1",
            &params![state.run_id.as_str()],
        )?
        .ok_or_else(|| run_not_found(&state.run_id))?
        .text(0)?;
    #[derive(serde::Deserialize)]
    struct Input {
        message_id: String,
        content: String,
    }
    let input: Input = from_json(&input, "run input")?;
    // A continuation's first message is the runtime's trigger: the model reads it, clients never.
    let continuation = state.config.continuation;
    let message = if continuation {
        Message {
            visibility: Visibility::Hidden,
            origin: Origin::Continuation,
            ..Message::user(input.content)
        }
    } else {
        Message::user(input.content)
    };
    insert_message(c, &input.message_id, &state, &message, now)?;
    if !continuation && state.lineage.is_none() {
        crate::inbox::wake_held(c, &state.session_id, now)?;
    }
    let (job, event) = start_run(&mut state, now);
    write_state(c, &state)?;
    insert_job(c, &job, now)?;
    c.execute(
        "UPDATE sessions SET active_run_id = ?2,
                user_turns_in_a_row = CASE WHEN ?3 = 1 THEN 0 ELSE user_turns_in_a_row + 1 END
         WHERE id = ?1",
        &params![
            state.session_id.as_str(),
            state.run_id.as_str(),
            continuation
        ],
    )?;
    Ok(vec![event])
}

fn write_state(c: &dyn Db, state: &AgentState) -> Result<()> {
    write_encoded_state(c, None, state, &to_json(state)?)
}

/// `write_state` with the state's JSON encoded already, for a run whose stored status is
/// `was` when known. A step of a run that stays running changes only its step and state: its
/// indexed columns (status, deadline) are left alone, so no index of `runs` is rewritten. The
/// full update below is the only writer of a run's status, and it leaves a running run's stop
/// reason, end and deadline empty, so there is nothing else to keep true.
fn write_encoded_state(
    c: &dyn Db,
    was: Option<RunStatus>,
    state: &AgentState,
    state_json: &str,
) -> Result<()> {
    if was == Some(RunStatus::Running) && state.status == RunStatus::Running {
        return c.write(
            "UPDATE runs SET step_index = ?2, state_json = ?3 WHERE id = ?1",
            &params![state.run_id.as_str(), state.step_index as i64, state_json],
        );
    }
    let stop_reason = state.stop_reason.map(|r| r.as_str());
    // Only a waiting run needs the sweep to end it in time: a running one is cut off by the
    // worker that holds its step.
    let waits = matches!(
        state.status,
        RunStatus::WaitingHuman | RunStatus::WaitingChildren
    );
    let deadline_at = state.deadline().filter(|_| waits);
    c.write(
        "UPDATE runs SET status = ?2, step_index = ?3, stop_reason = ?4, state_json = ?5, finished_at = ?6,
         deadline_at = ?7
         WHERE id = ?1",
        &params![
            state.run_id.as_str(),
            state.status.as_str(),
            state.step_index as i64,
            stop_reason,
            state_json,
            state.finished_at,
            deadline_at
        ],
    )?;
    Ok(())
}

/// Waiting runs whose deadline is at or before `now`, oldest deadline first.
pub(crate) fn overdue_runs(c: &dyn Db, now: Millis) -> Result<Vec<RunId>> {
    c.query(
        "SELECT id FROM runs WHERE deadline_at <= ?1 ORDER BY deadline_at, id LIMIT 100",
        &params![now],
    )?
    .into_iter()
    .map(|mut r| parse_run_id(&r.text(0)?))
    .collect()
}

/// Ends a waiting run past its deadline as `timed_out`, cancelling the children it waited
/// for. A run that moved on meanwhile (a human answered, its children joined) is left alone.
pub(crate) fn time_out_run(c: &dyn Db, run_id: &RunId, now: Millis) -> Result<TimedOut> {
    lock_session_of_run(c, run_id)?;
    let stored = run_row(c, run_id)?;
    let mut state = load_state(c, run_id)?;
    let waiting = matches!(
        stored.status,
        RunStatus::WaitingHuman | RunStatus::WaitingChildren
    );
    if !waiting || state.deadline().is_none_or(|deadline| deadline > now) {
        return Ok(TimedOut::default());
    }
    let mut ended = TimedOut {
        ended: vec![run_id.clone()],
        ..TimedOut::default()
    };
    let children = unfinished_foreground_children(c, run_id)?;
    let drafts = ratchet_core::step::time_out_idle(&mut state, now);
    write_state(c, &state)?;
    c.execute(
        "DELETE FROM step_jobs WHERE run_id = ?1",
        &params![run_id.as_str()],
    )?;
    ended.events = insert_events(c, &stored.session_id, Some(run_id), &drafts, now)?;
    for child in children {
        match request_cancel(c, &child, now)? {
            CancelOutcome::Cancelled { events, enqueued } => {
                ended.events.extend(events);
                ended.enqueued |= enqueued;
            }
            CancelOutcome::Cancelling { events } => ended.events.extend(events),
            CancelOutcome::AlreadyTerminal(_) => {}
        }
    }
    let events = run_ended(c, &state, &mut ended.enqueued, now)?;
    ended.events.extend(events);
    Ok(ended)
}

pub(crate) fn insert_message(
    c: &dyn Db,
    id: &str,
    state: &AgentState,
    message: &Message,
    now: Millis,
) -> Result<()> {
    let tool_calls = encode_tool_calls(message)?;
    insert_encoded_message(c, id, state, message, tool_calls.as_deref(), now)
}

fn encode_tool_calls(message: &Message) -> Result<Option<String>> {
    if message.tool_calls.is_empty() {
        return Ok(None);
    }
    to_json(&message.tool_calls).map(Some)
}

/// `insert_message` with the message's tool calls encoded already.
fn insert_encoded_message(
    c: &dyn Db,
    id: &str,
    state: &AgentState,
    message: &Message,
    tool_calls: Option<&str>,
    now: Millis,
) -> Result<()> {
    let (role, visibility, origin) = (
        sql_str(&message.role)?,
        sql_str(&message.visibility)?,
        sql_str(&message.origin)?,
    );
    // A continuation turn's messages are drafts until it completes (`inbox::continuation_ended`).
    let draft_of = state.config.continuation.then(|| state.run_id.as_str());
    c.write(
        "INSERT INTO messages (id, session_id, run_id, role, content, tool_calls_json, tool_call_id, visibility, origin, created_at, keeps_from, is_error, draft_of)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
        &params![
            id,
            state.session_id.as_str(),
            state.run_id.as_str(),
            &role,
            &message.content,
            tool_calls,
            &message.tool_call_id,
            &visibility,
            &origin,
            now,
            message.keeps_from,
            message.is_error,
            draft_of
        ],
    )
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

fn insert_job(c: &dyn Db, job: &StepJob, now: Millis) -> Result<()> {
    let row = NewJob::new(None, now);
    c.execute(
        "INSERT INTO step_jobs (run_id, step_index, phase, attempt, epoch, lease_owner, ready_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        &params![
            job.run_id.as_str(),
            job.step_index as i64,
            job.phase.as_str(),
            row.attempt,
            row.epoch,
            row.owner,
            row.ready_at
        ],
    )?;
    c.announce(Announcement::JobsReady)
}

/// Moves the claimed job on to `next` (or deletes it). The caller has checked, holding the
/// job's row, that `claim` still holds it.
fn advance_job(c: &dyn Db, claim: &Claim, next: Option<&StepJob>, row: &NewJob<'_>) -> Result<()> {
    let (run_id, step_index) = (claim.run_id.as_str(), claim.step_index as i64);
    match next {
        None => c.write(
            "DELETE FROM step_jobs WHERE run_id = ?1 AND step_index = ?2 AND epoch = ?3",
            &params![run_id, step_index, claim.epoch],
        )?,
        Some(next) => c.write(
            "UPDATE step_jobs SET step_index = ?4, phase = ?5, attempt = ?6, epoch = ?7, lease_owner = ?8, ready_at = ?9
             WHERE run_id = ?1 AND step_index = ?2 AND epoch = ?3",
            &params![
                run_id,
                step_index,
                claim.epoch,
                next.step_index as i64,
                next.phase.as_str(),
                row.attempt,
                row.epoch,
                row.owner,
                row.ready_at
            ],
        )?,
    }
    if next.is_some() && row.owner.is_none() {
        c.announce(Announcement::JobsReady)?;
    }
    Ok(())
}

pub(crate) fn insert_events(
    c: &dyn Db,
    session_id: &SessionId,
    run_id: Option<&RunId>,
    drafts: &[EventDraft],
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    if drafts.is_empty() {
        return Ok(Vec::new());
    }
    let last = c
        .query_opt(
            "UPDATE sessions SET last_seq = last_seq + ?2 WHERE id = ?1 RETURNING last_seq",
            &params![session_id.as_str(), drafts.len() as i64],
        )?
        .ok_or_else(|| Error::NotFound {
            kind: "session",
            id: session_id.to_string(),
        })?
        .int(0)?;
    let before = last - drafts.len() as i64;
    store_events(
        c,
        session_id,
        run_id,
        drafts.to_vec(),
        Vec::new(),
        before,
        now,
    )
}

/// `insert_events` for a caller that read the session's `last_seq` under its lock, which
/// no other transaction can move before this one ends. The first of `drafts` may come with
/// their payloads encoded already (`encoded`).
fn append_events(
    c: &dyn Db,
    session_id: &SessionId,
    run_id: Option<&RunId>,
    drafts: Vec<EventDraft>,
    encoded: Vec<String>,
    last_seq: i64,
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    if drafts.is_empty() {
        return Ok(Vec::new());
    }
    c.write(
        "UPDATE sessions SET last_seq = ?2 WHERE id = ?1",
        &params![session_id.as_str(), last_seq + drafts.len() as i64],
    )?;
    store_events(c, session_id, run_id, drafts, encoded, last_seq, now)
}

/// Writes the events after `before`, the session's `last_seq` before them; the first of
/// `drafts` with the payloads `encoded` already.
fn store_events(
    c: &dyn Db,
    session_id: &SessionId,
    run_id: Option<&RunId>,
    drafts: Vec<EventDraft>,
    encoded: Vec<String>,
    before: i64,
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    let first = before + 1;
    let count = drafts.len() as i64;
    let mut encoded = encoded.into_iter();
    let mut stored = Vec::with_capacity(drafts.len());
    for (seq, mut draft) in (first..).zip(drafts) {
        crate::payload::name_run(&mut draft.payload, run_id);
        let payload = match encoded.next() {
            Some(payload) => payload,
            None => crate::payload::encode(&draft.payload, run_id)?,
        };
        c.write(
            "INSERT INTO events (session_id, seq, run_id, kind, payload_json, created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            &params![
                session_id.as_str(),
                seq,
                run_id.map(|r| r.as_str()),
                draft.kind.as_str(),
                &payload,
                now
            ],
        )?;
        stored.push(StoredEvent {
            session_id: session_id.clone(),
            seq,
            run_id: run_id.cloned(),
            kind: draft.kind.as_str().to_owned(),
            payload: draft.payload,
            created_at: now,
        });
    }
    c.announce(Announcement::Events {
        session_id: session_id.as_str(),
        first_seq: first,
        last_seq: before + count,
    })?;
    Ok(stored)
}

struct JobRow {
    step_index: u64,
    phase: String,
    attempt: u32,
    epoch: i64,
}

fn lease_job(c: &dyn Db, run_id: &RunId, job: JobRow, lease: &Lease) -> Result<ClaimedStep> {
    let attempt = job.attempt + 1;
    let epoch = job.epoch + 1;
    c.write(
        "UPDATE step_jobs SET attempt = ?3, epoch = ?4, lease_owner = ?5, ready_at = ?6
         WHERE run_id = ?1 AND step_index = ?2",
        &params![
            run_id.as_str(),
            job.step_index as i64,
            attempt,
            epoch,
            &lease.owner,
            lease.expires_at
        ],
    )?;
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
        context: None,
    })
}

fn to_claimable(mut r: Row) -> Result<(String, JobRow)> {
    let run_id = r.text(0)?;
    let job = JobRow {
        step_index: r.int(1)? as u64,
        phase: r.text(2)?,
        attempt: u32::try_from(r.int(3)?)
            .map_err(|_| Error::Corrupt("a job's attempt is out of range".into()))?,
        epoch: r.int(4)?,
    };
    Ok((run_id, job))
}

/// How long a job whose run cannot be loaded is set aside before it is tried again.
const QUARANTINE_MS: Millis = 60_000;
/// Most unloadable jobs one claim sets aside before giving up until the next claim.
const MAX_SET_ASIDE: usize = 16;

pub(crate) fn claim_next(
    c: &dyn Db,
    lease: &Lease,
    run: Option<&RunId>,
    now: Millis,
) -> Result<Option<ClaimedStep>> {
    for _ in 0..MAX_SET_ASIDE {
        let found = match run {
            None => c.query_opt(
                &format!(
                    "SELECT run_id, step_index, phase, attempt, epoch FROM step_jobs
                     WHERE ready_at <= ?1 ORDER BY ready_at LIMIT 1{}",
                    c.skip_locked()
                ),
                &params![now],
            )?,
            Some(run) => c.query_opt(
                &format!(
                    "SELECT run_id, step_index, phase, attempt, epoch FROM step_jobs
                     WHERE run_id IN (SELECT id FROM runs WHERE id = ?1 OR root_run_id = ?1)
                       AND ready_at <= ?2 ORDER BY ready_at LIMIT 1{}",
                    c.skip_locked()
                ),
                &params![run.as_str(), now],
            )?,
        };
        let Some(found) = found else {
            return Ok(None);
        };
        let (run_id, job) = to_claimable(found)?;
        let step_index = job.step_index;
        c.write("SAVEPOINT claim", &[])?;
        let leased = parse_run_id(&run_id).and_then(|id| lease_job(c, &id, job, lease));
        match leased {
            Ok(claimed) => {
                c.write("RELEASE claim", &[])?;
                return Ok(Some(claimed));
            }
            Err(error) => {
                c.execute("ROLLBACK TO claim", &[])?;
                c.execute("RELEASE claim", &[])?;
                if !matches!(error, Error::Corrupt(_) | Error::NotFound { .. }) {
                    return Err(error);
                }
                // One unreadable run must not stop every worker: set its job aside.
                tracing::error!(run = %run_id, step = step_index, %error, "cannot load the run of a job; setting it aside");
                c.execute(
                    "UPDATE step_jobs SET ready_at = ?3 WHERE run_id = ?1 AND step_index = ?2",
                    &params![&run_id, step_index as i64, now + QUARANTINE_MS],
                )?;
            }
        }
    }
    Ok(None)
}

pub(crate) fn heartbeat(c: &dyn Db, claim: &Claim, expires_at: Millis) -> Result<bool> {
    let changed = c.execute(
        "UPDATE step_jobs SET ready_at = ?4 WHERE run_id = ?1 AND step_index = ?2 AND epoch = ?3",
        &params![
            claim.run_id.as_str(),
            claim.step_index as i64,
            claim.epoch,
            expires_at
        ],
    )?;
    Ok(changed == 1)
}

fn claim_holds(c: &dyn Db, claim: &Claim) -> Result<bool> {
    let epoch = c
        .query_opt(
            "SELECT epoch FROM step_jobs WHERE run_id = ?1 AND step_index = ?2",
            &params![claim.run_id.as_str(), claim.step_index as i64],
        )?
        .map(|mut r| r.int(0))
        .transpose()?;
    Ok(epoch == Some(claim.epoch))
}

struct RunRow {
    session_id: SessionId,
    status: RunStatus,
    step_index: u64,
    cancel_requested: bool,
    pause_requested: bool,
}

fn run_row(c: &dyn Db, run_id: &RunId) -> Result<RunRow> {
    let mut row = c
        .query_opt(
            "SELECT session_id, status, step_index, cancel_requested, pause_requested FROM runs WHERE id = ?1",
            &params![run_id.as_str()],
        )?
        .ok_or_else(|| run_not_found(run_id))?;
    Ok(RunRow {
        session_id: parse_session_id(&row.text(0)?)?,
        status: parse_status(&row.text(1)?)?,
        step_index: row.int(2)? as u64,
        cancel_requested: row.flag(3)?,
        pause_requested: row.flag(4)?,
    })
}

/// What a commit reads besides the run's row, in the same statement: one round trip where
/// the database is across a network.
struct CommitView {
    /// The job's epoch now (its row held until the commit), if the job is still there.
    epoch: Option<i64>,
    /// The session's last event, which no one else can move while its lock is held.
    last_seq: i64,
    steers_waiting: bool,
    signals_waiting: bool,
}

fn commit_row(c: &dyn Db, claim: &Claim) -> Result<(RunRow, CommitView)> {
    let mut row = c
        .query_opt(
            &format!(
                "SELECT r.session_id, r.status, r.step_index, r.cancel_requested, r.pause_requested,
                        (SELECT epoch FROM step_jobs WHERE run_id = ?1 AND step_index = ?2{}),
                        s.last_seq,
                        EXISTS (SELECT 1 FROM steers WHERE session_id = r.session_id),
                        EXISTS (SELECT 1 FROM inbox WHERE session_id = r.session_id
                                  AND status = 'pending' AND delivery = 'steer')
                 FROM runs r JOIN sessions s ON s.id = r.session_id WHERE r.id = ?1",
                c.for_update()
            ),
            &params![claim.run_id.as_str(), claim.step_index as i64],
        )?
        .ok_or_else(|| run_not_found(&claim.run_id))?;
    let run = RunRow {
        session_id: parse_session_id(&row.text(0)?)?,
        status: parse_status(&row.text(1)?)?,
        step_index: row.int(2)? as u64,
        cancel_requested: row.flag(3)?,
        pause_requested: row.flag(4)?,
    };
    let view = CommitView {
        epoch: row.opt_int(5)?,
        last_seq: row.int(6)?,
        steers_waiting: row.flag(7)?,
        signals_waiting: row.flag(8)?,
    };
    Ok((run, view))
}

/// What a step's commit writes as JSON, encoded before its transaction: a writer that many
/// steps share (SQLite's one thread) then spends its time on the statements alone.
pub(crate) struct EncodedStep {
    state: String,
    summary: String,
    /// Each of the result's messages' tool calls.
    tool_calls: Vec<Option<String>>,
    /// Each of the result's events' payload.
    events: Vec<String>,
}

impl EncodedStep {
    pub(crate) fn of(result: &StepResult) -> Result<EncodedStep> {
        Ok(EncodedStep {
            state: to_json(&result.state)?,
            summary: to_json(&result.record.summary)?,
            tool_calls: result
                .messages
                .iter()
                .map(encode_tool_calls)
                .collect::<Result<_>>()?,
            events: result
                .events
                .iter()
                .map(|draft| crate::payload::encode(&draft.payload, Some(&result.state.run_id)))
                .collect::<Result<_>>()?,
        })
    }
}

pub(crate) fn commit_step(
    c: &dyn Db,
    claim: &Claim,
    mut result: StepResult,
    encoded: EncodedStep,
    continue_with: Option<Lease>,
    quota: ratchet_store::RunQuota,
    now: Millis,
) -> Result<Commit> {
    if result.record.index != claim.step_index || result.state.run_id != claim.run_id {
        return Err(Error::Conflict(format!(
            "result of {}#{} committed under the claim of {}#{}",
            result.state.run_id, result.record.index, claim.run_id, claim.step_index
        )));
    }
    lock_session_of_run(c, &claim.run_id)?;
    let (stored, seen) = commit_row(c, claim)?;
    if stored.cancel_requested {
        result.yield_to_cancel();
    }
    let paused = stored.pause_requested && result.yield_to_pause();
    // A cancel or a pause that arrived during the step changed the result it was encoded from.
    let encoded = if stored.cancel_requested || paused {
        EncodedStep::of(&result)?
    } else {
        encoded
    };
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
    // The fence: the claimed job becomes the next one (or goes) only while the claim's
    // epoch still holds it, and the row stays held until the commit.
    if seen.epoch != Some(claim.epoch) {
        return Ok(Commit::Stale(Stale::LeaseLost));
    }
    if let Some(refused) = refused {
        return Ok(Commit::Stale(refused));
    }
    let next_row = NewJob::new(continue_with.as_ref(), now);
    #[cfg(feature = "failpoints")]
    fail::fail_point!("commit.before_outbox", |_| injected("commit.before_outbox"));
    advance_job(c, claim, result.next.as_ref(), &next_row)?;
    #[cfg(feature = "failpoints")]
    fail::fail_point!("commit.after_outbox", |_| injected("commit.after_outbox"));
    let steer_boundary = result.accepts_steer();
    let state = &result.state;
    write_encoded_state(c, Some(stored.status), state, &encoded.state)?;
    if paused {
        set_pause_requested(c, &state.run_id, false)?;
    }
    if let Some(HumanRequest::Approval { approval_id, calls }) = &state.pending_human {
        let calls_json = to_json(calls)?;
        c.write(
            "INSERT INTO approvals (id, run_id, session_id, status, calls_json, created_at) VALUES (?1, ?2, ?3, 'pending', ?4, ?5)",
            &params![
                approval_id.as_str(),
                state.run_id.as_str(),
                stored.session_id.as_str(),
                &calls_json,
                now
            ],
        )?;
    }
    for (i, (message, tool_calls)) in result.messages.iter().zip(&encoded.tool_calls).enumerate() {
        let id = step_message_id(&state.run_id, claim.step_index, i);
        insert_encoded_message(c, &id, state, message, tool_calls.as_deref(), now)?;
    }
    let record = &result.record;
    c.write(
        "INSERT INTO steps (run_id, step_index, instruction, started_at, finished_at, summary_json) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        &params![
            state.run_id.as_str(),
            record.index as i64,
            &record.instruction,
            record.started_at,
            record.finished_at,
            &encoded.summary
        ],
    )?;
    let mut enqueued = result.next.is_some() && continue_with.is_none();
    let mut drafts = std::mem::take(&mut result.events);
    let mut added = std::mem::take(&mut result.messages);
    if steer_boundary && seen.steers_waiting {
        drafts.extend(absorb_steers(c, &result.state, &mut added, now)?);
    }
    if steer_boundary && seen.signals_waiting {
        drafts.extend(crate::inbox::absorb_signals(
            c,
            &result.state,
            claim.step_index,
            &mut added,
            now,
        )?);
    }
    let mut events = append_events(
        c,
        &stored.session_id,
        Some(&claim.run_id),
        drafts,
        encoded.events,
        seen.last_seq,
        now,
    )?;
    if !result.children.is_empty() {
        events.extend(start_children(
            c,
            &result.state,
            &result.children,
            quota,
            now,
        )?);
        enqueued = true;
    }
    if result.state.status.is_terminal() {
        events.extend(run_ended(c, &result.state, &mut enqueued, now)?);
    }
    let continued = match (result.next, continue_with.is_some()) {
        (Some(next), true) => Some(ClaimedStep {
            claim: Claim {
                run_id: next.run_id.clone(),
                step_index: next.step_index,
                epoch: next_row.epoch,
            },
            job: StepJob { attempt: 1, ..next },
            // The state as a claim would load it: the frozen config and the store's cancel
            // flag, never the ones the result carried.
            state: AgentState {
                config: frozen_config(c, &claim.run_id)?,
                cancel_requested: stored.cancel_requested,
                pause_requested: stored.pause_requested,
                ..result.state
            },
            context: None,
        }),
        _ => None,
    };
    Ok(Commit::Committed {
        events,
        continued,
        added,
        enqueued,
    })
}

/// What a commit transaction fails with where a failpoint is told to fail it: a database
/// error, so that the transaction keeps nothing and the worker gives the step back.
#[cfg(feature = "failpoints")]
fn injected<T>(failpoint: &str) -> Result<T> {
    Err(Error::Backend(format!("failpoint {failpoint}")))
}

/// The session's active run has ended: the oldest queued run (if any) starts now, or a
/// continuation turn when due inbox events have waited their turn (`NextTurn`). The new run's
/// events are stored under its own id, after the events of the run that ended.
fn release_session(
    c: &dyn Db,
    session_id: &SessionId,
    enqueued: &mut bool,
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    c.execute(
        "UPDATE sessions SET active_run_id = NULL WHERE id = ?1",
        &params![session_id.as_str()],
    )?;
    // Steers the ended run never reached become runs of their own, in the order they were sent.
    let mut fell_through = Vec::new();
    for steer in take_steers(c, session_id)? {
        let run_id = parse_run_id(&steer.run_id)?;
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
    let next = c
        .query_opt(
            "SELECT id FROM runs WHERE session_id = ?1 AND status = 'queued' ORDER BY created_at, rowid LIMIT 1",
            &params![session_id.as_str()],
        )?
        .map(|mut r| r.text(0))
        .transpose()?;
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
    match crate::inbox::choose_next_turn(c, session_id, next.is_some(), now)? {
        NextTurn::Idle => {}
        NextTurn::Continuation => {
            *enqueued = true;
            events.extend(crate::inbox::start_continuation(c, session_id, now)?);
        }
        NextTurn::User => {
            let next = parse_run_id(next.as_deref().unwrap_or_default())?;
            let state = load_state(c, &next)?;
            *enqueued = true;
            let drafts = start_queued_run(c, state, now)?;
            events.extend(insert_events(c, session_id, Some(&next), &drafts, now)?);
        }
    }
    Ok(events)
}

pub(crate) fn retry_later(
    c: &dyn Db,
    claim: &Claim,
    available_at: Millis,
    event: EventDraft,
    now: Millis,
) -> Result<Option<Vec<StoredEvent>>> {
    lock_session_of_run(c, &claim.run_id)?;
    let released = c.execute(
        "UPDATE step_jobs SET lease_owner = NULL, ready_at = ?4
         WHERE run_id = ?1 AND step_index = ?2 AND epoch = ?3",
        &params![
            claim.run_id.as_str(),
            claim.step_index as i64,
            claim.epoch,
            available_at
        ],
    )?;
    if released == 0 {
        return Ok(None);
    }
    let stored = run_row(c, &claim.run_id)?;
    let mut events = insert_events(c, &stored.session_id, Some(&claim.run_id), &[event], now)?;
    // Waiting out a backoff is a step boundary too.
    if stored.pause_requested && stored.status == RunStatus::Running {
        events.extend(
            pause_if_unclaimed(c, &claim.run_id, &stored.session_id, now)?.unwrap_or_default(),
        );
    }
    Ok(Some(events))
}

pub(crate) fn fenced(c: &dyn Db, claim: &Claim) -> Result<()> {
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
    c: &dyn Db,
    claim: &Claim,
    intents: &[Intent],
    events: &[EventDraft],
    now: Millis,
) -> Result<RecordedIntents> {
    lock_session_of_run(c, &claim.run_id)?;
    // The fence and the cancel check in one read: the claim must still hold the step, and
    // no cancel may have been accepted.
    let held = c.query_opt(
        "SELECT j.epoch, r.session_id, r.cancel_requested FROM step_jobs j JOIN runs r ON r.id = j.run_id
         WHERE j.run_id = ?1 AND j.step_index = ?2",
        &params![claim.run_id.as_str(), claim.step_index as i64],
    )?;
    let lost = || Error::LeaseLost {
        run_id: claim.run_id.clone(),
        step_index: claim.step_index,
    };
    let mut held = held.ok_or_else(lost)?;
    if held.int(0)? != claim.epoch {
        return Err(lost());
    }
    let session_id = parse_session_id(&held.text(1)?)?;
    if held.flag(2)? {
        return Err(Error::CancelRequested {
            run_id: claim.run_id.clone(),
        });
    }
    let mut attempts = Vec::with_capacity(intents.len());
    for intent in intents {
        let count = c
            .query_opt(
                "INSERT INTO intents (run_id, step_index, slot, kind, name, idempotency_key, attempts, started_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, 1, ?7)
                 ON CONFLICT (run_id, step_index, slot) DO UPDATE SET attempts = intents.attempts + 1, started_at = ?7
                 RETURNING attempts",
                &params![
                    claim.run_id.as_str(),
                    claim.step_index as i64,
                    intent.slot,
                    intent.kind.as_str(),
                    &intent.name,
                    &intent.idempotency_key,
                    now
                ],
            )?
            .ok_or_else(|| Error::Backend("recording an intent returned no row".into()))?
            .int(0)?;
        attempts.push(
            u32::try_from(count)
                .map_err(|_| Error::Corrupt("an intent's attempts are out of range".into()))?,
        );
    }
    let events = insert_events(c, &session_id, Some(&claim.run_id), events, now)?;
    Ok(RecordedIntents { events, attempts })
}

pub(crate) fn record_outcome(
    c: &dyn Db,
    claim: &Claim,
    slot: u32,
    outcome: &ToolOutcome,
    now: Millis,
) -> Result<()> {
    lock_session_of_run(c, &claim.run_id)?;
    fenced(c, claim)?;
    let outcome_json = to_json(outcome)?;
    let (run_id, step_index) = (&claim.run_id, claim.step_index);
    let changed = c.execute(
        "UPDATE intents SET outcome_json = ?4, finished_at = ?5 WHERE run_id = ?1 AND step_index = ?2 AND slot = ?3",
        &params![run_id.as_str(), step_index as i64, slot, &outcome_json, now],
    )?;
    if changed == 0 {
        return Err(Error::Conflict(format!(
            "no intent at {run_id}#{step_index}#{slot} to record an outcome for"
        )));
    }
    Ok(())
}

pub(crate) fn intents(c: &dyn Db, run_id: &RunId, step_index: u64) -> Result<Vec<IntentRecord>> {
    let out_of_range = |what: &str| Error::Corrupt(format!("an intent's {what} is out of range"));
    c.query(
        "SELECT slot, kind, name, attempts, outcome_json FROM intents WHERE run_id = ?1 AND step_index = ?2 ORDER BY slot",
        &params![run_id.as_str(), step_index as i64],
    )?
    .into_iter()
    .map(|mut r| {
        let kind = match r.text(1)?.as_str() {
            "model" => IntentKind::Model,
            "tool" => IntentKind::Tool,
            other => return Err(Error::Corrupt(format!("unknown intent kind {other:?}"))),
        };
        Ok(IntentRecord {
            slot: u32::try_from(r.int(0)?).map_err(|_| out_of_range("slot"))?,
            kind,
            name: r.text(2)?,
            attempts: u32::try_from(r.int(3)?).map_err(|_| out_of_range("attempts"))?,
            outcome: r
                .opt_text(4)?
                .map(|o| from_json(&o, "intent outcome"))
                .transpose()?,
        })
    })
    .collect()
}

/// The runs a parent's foreground delegations started that have not ended, oldest first (a
/// background run belongs to the root session, not to its parent).
fn unfinished_foreground_children(c: &dyn Db, parent: &RunId) -> Result<Vec<RunId>> {
    c.query(
        &format!(
            "SELECT id FROM runs WHERE parent_run_id = ?1 AND inbox_group IS NULL AND status IN {ACTIVE_STATUSES} ORDER BY created_at, id"
        ),
        &params![parent.as_str()],
    )?
    .into_iter()
    .map(|mut r| parse_run_id(&r.text(0)?))
    .collect()
}

pub(crate) fn request_cancel(c: &dyn Db, run_id: &RunId, now: Millis) -> Result<CancelOutcome> {
    lock_session_of_run(c, run_id)?;
    let mut outcome = cancel_one(c, run_id, now)?;
    let children = unfinished_foreground_children(c, run_id)?;
    for child in children {
        let (more, child_enqueued) = match request_cancel(c, &child, now)? {
            CancelOutcome::Cancelled { events, enqueued } => (events, enqueued),
            CancelOutcome::Cancelling { events } => (events, false),
            CancelOutcome::AlreadyTerminal(_) => (Vec::new(), false),
        };
        match &mut outcome {
            CancelOutcome::Cancelled { events, enqueued } => {
                events.extend(more);
                *enqueued |= child_enqueued;
            }
            CancelOutcome::Cancelling { events } => events.extend(more),
            CancelOutcome::AlreadyTerminal(_) => {}
        }
    }
    Ok(outcome)
}

/// Cancels one run, without looking at its children.
pub(crate) fn cancel_one(c: &dyn Db, run_id: &RunId, now: Millis) -> Result<CancelOutcome> {
    let stored = run_row(c, run_id)?;
    let mut state = load_state(c, run_id)?;
    match stored.status {
        RunStatus::Running | RunStatus::Cancelling => {
            mark_cancel_requested(c, run_id)?;
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
        RunStatus::Queued
        | RunStatus::WaitingHuman
        | RunStatus::WaitingChildren
        | RunStatus::Paused => {
            let held_session = stored.status != RunStatus::Queued;
            let drafts = cancel_idle(&mut state, now);
            mark_cancel_requested(c, run_id)?;
            write_state(c, &state)?;
            c.execute(
                "DELETE FROM step_jobs WHERE run_id = ?1",
                &params![run_id.as_str()],
            )?;
            let mut events = insert_events(c, &stored.session_id, Some(run_id), &drafts, now)?;
            let mut enqueued = false;
            if held_session {
                events.extend(run_ended(c, &state, &mut enqueued, now)?);
            } else {
                c.configs().forget(run_id);
            }
            Ok(CancelOutcome::Cancelled { events, enqueued })
        }
        RunStatus::Completed | RunStatus::Failed | RunStatus::Cancelled => {
            Ok(CancelOutcome::AlreadyTerminal(stored.status))
        }
    }
}

pub(crate) fn request_pause(c: &dyn Db, run_id: &RunId, now: Millis) -> Result<PauseOutcome> {
    lock_session_of_run(c, run_id)?;
    let stored = run_row(c, run_id)?;
    match stored.status {
        RunStatus::Paused => return Ok(PauseOutcome::Paused { events: Vec::new() }),
        RunStatus::Running => {}
        status => {
            return Err(Error::Conflict(format!(
                "run {run_id} is {status}; only a running run can be paused"
            )));
        }
    }
    if let Some(events) = pause_if_unclaimed(c, run_id, &stored.session_id, now)? {
        return Ok(PauseOutcome::Paused { events });
    }
    set_pause_requested(c, run_id, true)?;
    Ok(PauseOutcome::Pausing)
}

/// A job nobody has claimed is a step boundary: the run pauses now, and its job goes. A claim
/// may take the job between the two statements (PostgreSQL); then the delete finds nothing,
/// None is returned, and the claimed step's commit pauses the run instead.
fn pause_if_unclaimed(
    c: &dyn Db,
    run_id: &RunId,
    session_id: &SessionId,
    now: Millis,
) -> Result<Option<Vec<StoredEvent>>> {
    let unclaimed = c
        .query_opt(
            "SELECT step_index, phase FROM step_jobs WHERE run_id = ?1 AND lease_owner IS NULL",
            &params![run_id.as_str()],
        )?
        .map(|mut r| Ok::<_, Error>((r.int(0)?, r.text(1)?)))
        .transpose()?;
    if let Some((step_index, phase)) = unclaimed {
        let phase = Phase::parse(&phase)
            .ok_or_else(|| Error::Corrupt(format!("unknown phase {phase:?}")))?;
        let taken = c.execute(
            "DELETE FROM step_jobs WHERE run_id = ?1 AND step_index = ?2 AND lease_owner IS NULL",
            &params![run_id.as_str(), step_index],
        )?;
        if taken == 1 {
            let mut state = load_state(c, run_id)?;
            let drafts = ratchet_core::step::pause_idle(&mut state, phase, now)?;
            write_state(c, &state)?;
            set_pause_requested(c, run_id, false)?;
            return insert_events(c, session_id, Some(run_id), &drafts, now).map(Some);
        }
    }
    Ok(None)
}

pub(crate) fn resume_paused(c: &dyn Db, run_id: &RunId, now: Millis) -> Result<ResumeOutcome> {
    lock_session_of_run(c, run_id)?;
    let stored = run_row(c, run_id)?;
    if stored.status == RunStatus::Running && stored.pause_requested {
        set_pause_requested(c, run_id, false)?;
        return Ok(ResumeOutcome::PauseWithdrawn);
    }
    let mut state = load_state(c, run_id)?;
    let (mut drafts, job) = ratchet_core::step::resume_paused(&mut state, now)?;
    write_state(c, &state)?;
    insert_job(c, &job, now)?;
    if matches!(
        ratchet_core::decide(&state, job.phase, now),
        ratchet_core::Instruction::CallLlm { .. }
    ) {
        let mut added = Vec::new();
        drafts.extend(absorb_steers(c, &state, &mut added, now)?);
        drafts.extend(crate::inbox::absorb_signals(
            c,
            &state,
            state.step_index,
            &mut added,
            now,
        )?);
    }
    let events = insert_events(c, &stored.session_id, Some(run_id), &drafts, now)?;
    Ok(ResumeOutcome::Resumed { events })
}

fn set_pause_requested(c: &dyn Db, run_id: &RunId, requested: bool) -> Result<()> {
    c.write(
        "UPDATE runs SET pause_requested = ?2 WHERE id = ?1",
        &params![run_id.as_str(), i64::from(requested)],
    )?;
    Ok(())
}

fn mark_cancel_requested(c: &dyn Db, run_id: &RunId) -> Result<()> {
    c.execute(
        "UPDATE runs SET cancel_requested = 1 WHERE id = ?1",
        &params![run_id.as_str()],
    )?;
    Ok(())
}

pub(crate) fn load_state(c: &dyn Db, run_id: &RunId) -> Result<AgentState> {
    let mut row = c
        .query_opt(
            "SELECT state_json, cancel_requested, pause_requested FROM runs WHERE id = ?1",
            &params![run_id.as_str()],
        )?
        .ok_or_else(|| run_not_found(run_id))?;
    let mut state: AgentState = from_json(&row.text(0)?, "run state")?;
    state.config = frozen_config(c, run_id)?;
    state.cancel_requested = row.flag(1)?;
    state.pause_requested = row.flag(2)?;
    Ok(state)
}

/// The configuration the run was created with; the only source of `state.config`.
pub(crate) fn frozen_config(
    c: &dyn Db,
    run_id: &RunId,
) -> Result<std::sync::Arc<RunConfigSnapshot>> {
    c.configs().get_or_load(
        run_id,
        || {
            let mut row = c
                .query_opt(
                    "SELECT c.id, c.config_json FROM runs r JOIN run_configs c ON c.id = r.config_id
                     WHERE r.id = ?1",
                    &params![run_id.as_str()],
                )?
                .ok_or_else(|| run_not_found(run_id))?;
            Ok(StoredConfig {
                id: row.text(0)?,
                json: row.text(1)?,
            })
        },
        |json| from_json::<RunConfigSnapshot>(json, "run config"),
    )
}

/// The key a configuration is stored under in `run_configs`: the SHA-256 of its JSON, so that
/// every run frozen with the same configuration refers to one row.
fn config_id(config_json: &str) -> String {
    Sha256::digest(config_json.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

const STORED_MESSAGE_COLUMNS: &str = "rowid, id, run_id, role, content, tool_calls_json, tool_call_id, visibility, origin, keeps_from, is_error, created_at";

pub(crate) fn visible_messages(
    c: &dyn Db,
    session_id: &SessionId,
    after_position: i64,
    limit: u32,
) -> Result<Vec<StoredMessage>> {
    c.query(
        &format!(
            "SELECT {STORED_MESSAGE_COLUMNS}
             FROM messages WHERE session_id = ?1 AND visibility = 'visible' AND rowid > ?2
               AND draft_of IS NULL
             ORDER BY rowid LIMIT ?3"
        ),
        &params![session_id.as_str(), after_position, limit],
    )?
    .into_iter()
    .map(to_stored_message)
    .collect()
}

fn to_stored_message(mut r: Row) -> Result<StoredMessage> {
    Ok(StoredMessage {
        position: r.int(0)?,
        id: r.text(1)?,
        run_id: parse_run_id(&r.text(2)?)?,
        message: to_message(&mut r, 3)?,
        created_at: r.int(11)?,
    })
}

/// What the model sees of a session in `run`'s turn: the latest summary (if the context was
/// ever compacted) in place of every message before the first one it keeps, then the messages
/// from there on — drafts left out, but the turn's own.
pub(crate) fn context(
    c: &dyn Db,
    session_id: &SessionId,
    run: &RunId,
) -> Result<Vec<StoredMessage>> {
    context_through(c, session_id, run, i64::MAX)
}

/// The context as it stood when the session's messages ended at position `through`.
fn context_through(
    c: &dyn Db,
    session_id: &SessionId,
    run: &RunId,
    through: i64,
) -> Result<Vec<StoredMessage>> {
    let mut messages = c
        .query(
            &format!(
                "SELECT {STORED_MESSAGE_COLUMNS}
                 FROM messages
                 WHERE session_id = ?1 AND (draft_of IS NULL OR draft_of = ?2) AND rowid <= ?3
                   AND rowid >= COALESCE((SELECT MAX(keeps_from) FROM messages
                                          WHERE session_id = ?1 AND keeps_from IS NOT NULL
                                            AND (draft_of IS NULL OR draft_of = ?2)
                                            AND rowid <= ?3), 0)
                 ORDER BY rowid"
            ),
            &params![session_id.as_str(), run.as_str(), through],
        )?
        .into_iter()
        .map(to_stored_message)
        .collect::<Result<Vec<_>>>()?;
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

/// The id of a message a step's commit writes, `msg_{run}-{step}-{slot}`: named after its step,
/// so that `step_messages` can tell which step wrote it.
pub(crate) fn step_message_id(
    run_id: &RunId,
    step_index: u64,
    slot: impl std::fmt::Display,
) -> String {
    format!("{}{step_index}-{slot}", step_message_prefix(run_id))
}

fn step_message_prefix(run_id: &RunId) -> String {
    format!("msg_{}-", &run_id.as_str()[4..])
}

/// What the model was shown at step `step_index` of `run`, and what that step wrote under its
/// own name. While a run is active only its own commits add to its session's history, and a
/// step's messages are named after it (`msg_{run}-{step}-…`), so the step's context ends just
/// before the first message of this step or a later one; with none, at the run's last message.
pub(crate) fn step_messages(c: &dyn Db, run_id: &RunId, step_index: u64) -> Result<StepMessages> {
    let session_id = c
        .query_opt(
            "SELECT session_id FROM runs WHERE id = ?1",
            &params![run_id.as_str()],
        )?
        .ok_or_else(|| run_not_found(run_id))?
        .text(0)?;
    let session_id = parse_session_id(&session_id)?;
    let prefix = step_message_prefix(run_id);
    let written_by = |id: &str| {
        (id.strip_prefix(&prefix))
            .and_then(|rest| rest.split('-').next())
            .and_then(|step| step.parse::<u64>().ok())
    };
    let runs_messages = c
        .query(
            &format!(
                "SELECT {STORED_MESSAGE_COLUMNS} FROM messages
                 WHERE session_id = ?1 AND run_id = ?2 ORDER BY rowid"
            ),
            &params![session_id.as_str(), run_id.as_str()],
        )?
        .into_iter()
        .map(to_stored_message)
        .collect::<Result<Vec<_>>>()?;
    let first_from = (runs_messages.iter())
        .position(|m| written_by(&m.id).is_some_and(|step| step >= step_index));
    let through = match first_from {
        Some(first) => runs_messages[first].position - 1,
        None => match runs_messages.last() {
            Some(last) => last.position,
            None => return Ok(StepMessages::default()),
        },
    };
    Ok(StepMessages {
        context: context_through(c, &session_id, run_id, through)?,
        written: (runs_messages.into_iter())
            .filter(|m| written_by(&m.id) == Some(step_index))
            .collect(),
    })
}

/// Reads the message columns `role, content, tool_calls_json, tool_call_id, visibility,
/// origin, keeps_from, is_error` starting at column `at`.
fn to_message(r: &mut Row, at: usize) -> Result<Message> {
    Ok(Message {
        role: sql_enum(&r.text(at)?)?,
        content: r.text(at + 1)?,
        tool_calls: r
            .opt_text(at + 2)?
            .map(|t| from_json(&t, "tool calls"))
            .transpose()?
            .unwrap_or_default(),
        tool_call_id: r.opt_text(at + 3)?,
        visibility: sql_enum(&r.text(at + 4)?)?,
        origin: sql_enum(&r.text(at + 5)?)?,
        keeps_from: r.opt_int(at + 6)?,
        is_error: r.flag(at + 7)?,
    })
}

pub(crate) fn history(c: &dyn Db, session_id: &SessionId) -> Result<Vec<Message>> {
    c.query(
        "SELECT role, content, tool_calls_json, tool_call_id, visibility, origin, keeps_from, is_error FROM messages
         WHERE session_id = ?1 AND draft_of IS NULL ORDER BY rowid",
        &params![session_id.as_str()],
    )?
    .into_iter()
    .map(|mut r| to_message(&mut r, 0))
    .collect()
}

const RUN_COLUMNS: &str =
    "id, session_id, status, stop_reason, step_index, created_at, finished_at";

fn to_run_summary(mut r: Row) -> Result<RunSummary> {
    Ok(RunSummary {
        run_id: parse_run_id(&r.text(0)?)?,
        session_id: parse_session_id(&r.text(1)?)?,
        status: parse_status(&r.text(2)?)?,
        stop_reason: r
            .opt_text(3)?
            .map(|reason| sql_enum::<StopReason>(&reason))
            .transpose()?,
        step_index: r.int(4)? as u64,
        created_at: r.int(5)?,
        finished_at: r.opt_int(6)?,
    })
}

pub(crate) fn list_runs(c: &dyn Db) -> Result<Vec<RunSummary>> {
    c.query(
        &format!("SELECT {RUN_COLUMNS} FROM runs ORDER BY rowid"),
        &[],
    )?
    .into_iter()
    .map(to_run_summary)
    .collect()
}

pub(crate) fn session_runs(
    c: &dyn Db,
    session_id: &SessionId,
    after: Option<&RunId>,
    limit: u32,
) -> Result<Vec<RunSummary>> {
    c.query(
        &format!(
            "SELECT {RUN_COLUMNS} FROM runs WHERE session_id = ?1 AND id > ?2 ORDER BY id LIMIT ?3"
        ),
        &params![session_id.as_str(), after.map_or("", |a| a.as_str()), limit],
    )?
    .into_iter()
    .map(to_run_summary)
    .collect()
}

pub(crate) fn steps(c: &dyn Db, run_id: &RunId) -> Result<Vec<StepRecord>> {
    c.query(
        "SELECT step_index, instruction, started_at, finished_at, summary_json FROM steps WHERE run_id = ?1 ORDER BY step_index",
        &params![run_id.as_str()],
    )?
    .into_iter()
    .map(|mut r| {
        Ok(StepRecord {
            index: r.int(0)? as u64,
            instruction: r.text(1)?,
            started_at: r.int(2)?,
            finished_at: r.int(3)?,
            summary: from_json(&r.text(4)?, "step summary")?,
        })
    })
    .collect()
}

pub(crate) const EVENT_COLUMNS: &str = "session_id, seq, run_id, kind, payload_json, created_at";

pub(crate) fn to_event(mut r: Row) -> Result<StoredEvent> {
    let run_id = r.opt_text(2)?.as_deref().map(parse_run_id).transpose()?;
    Ok(StoredEvent {
        session_id: parse_session_id(&r.text(0)?)?,
        seq: r.int(1)?,
        kind: r.text(3)?,
        payload: crate::payload::decode(&r.text(4)?, run_id.as_ref())?,
        run_id,
        created_at: r.int(5)?,
    })
}

pub(crate) fn events_after(
    c: &dyn Db,
    session_id: &SessionId,
    after_seq: i64,
    limit: u32,
) -> Result<Vec<StoredEvent>> {
    c.query(
        &format!(
            "SELECT {EVENT_COLUMNS} FROM events WHERE session_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3"
        ),
        &params![session_id.as_str(), after_seq, limit],
    )?
    .into_iter()
    .map(to_event)
    .collect()
}

/// Events after `after_seq` in `seq` order, at most `limit` of them, and no more than fit in
/// `max_bytes` of payload — but always the first, however large, so a page never stalls.
/// The page's end is found from each row's stored length alone, so no more payloads are read
/// than the page returns (a window over whole rows would buffer up to `limit` of them).
pub(crate) fn events_within(
    c: &dyn Db,
    session_id: &SessionId,
    after_seq: i64,
    limit: u32,
    max_bytes: u64,
) -> Result<Vec<StoredEvent>> {
    let max_bytes = i64::try_from(max_bytes).unwrap_or(i64::MAX);
    c.query(
        &format!(
            "SELECT {EVENT_COLUMNS} FROM events
             WHERE session_id = ?1 AND seq > ?2 AND seq <= (
                 SELECT COALESCE(MAX(seq), ?2) FROM (
                     SELECT seq, octet_length(payload_json) AS size,
                            SUM(octet_length(payload_json)) OVER (ORDER BY seq) - octet_length(payload_json) AS before
                     FROM events WHERE session_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3
                 ) AS page
                 WHERE before = 0 OR before + size <= ?4
             )
             ORDER BY seq"
        ),
        &params![session_id.as_str(), after_seq, limit, max_bytes],
    )?
    .into_iter()
    .map(to_event)
    .collect()
}

pub(crate) fn run_events_after(
    c: &dyn Db,
    run_id: &RunId,
    after_seq: i64,
    limit: u32,
) -> Result<Vec<StoredEvent>> {
    c.query(
        &format!(
            "SELECT {EVENT_COLUMNS} FROM events
             WHERE session_id = (SELECT session_id FROM runs WHERE id = ?1) AND seq > ?2 AND run_id = ?1
             ORDER BY seq LIMIT ?3"
        ),
        &params![run_id.as_str(), after_seq, limit],
    )?
    .into_iter()
    .map(to_event)
    .collect()
}

pub(crate) fn lease_owners(c: &dyn Db) -> Result<Vec<String>> {
    c.query(
        "SELECT DISTINCT lease_owner FROM step_jobs WHERE lease_owner IS NOT NULL",
        &[],
    )?
    .into_iter()
    .map(|mut r| r.text(0))
    .collect()
}

pub(crate) fn release_leases(c: &dyn Db, owner: &str) -> Result<u64> {
    let released = c.execute(
        "UPDATE step_jobs SET lease_owner = NULL, ready_at = 0 WHERE lease_owner = ?1",
        &params![owner],
    )?;
    if released > 0 {
        c.announce(Announcement::JobsReady)?;
    }
    Ok(released)
}

pub(crate) fn runs_with_jobs(c: &dyn Db) -> Result<Vec<RunId>> {
    c.query("SELECT DISTINCT run_id FROM step_jobs", &[])?
        .into_iter()
        .map(|mut r| parse_run_id(&r.text(0)?))
        .collect()
}

pub(crate) fn stats(c: &dyn Db, now: Millis) -> Result<StoreStats> {
    let runs_by_status = c
        .query("SELECT status, count(*) FROM runs GROUP BY status", &[])?
        .into_iter()
        .map(|mut r| Ok((parse_status(&r.text(0)?)?, r.int(1)? as u64)))
        .collect::<Result<Vec<_>>>()?;
    let mut jobs = c
        .query_opt(
            "SELECT count(*) FILTER (WHERE ready_at <= ?1), count(*) FILTER (WHERE ready_at > ?1) FROM step_jobs",
            &params![now],
        )?
        .ok_or_else(|| Error::Backend("counting jobs returned no row".into()))?;
    Ok(StoreStats {
        runs_by_status,
        ready_jobs: jobs.int(0)? as u64,
        held_jobs: jobs.int(1)? as u64,
    })
}

pub(crate) fn reconcile(
    c: &dyn Db,
    run_id: &RunId,
    call_id: &str,
    answer: Reconciliation,
    result: Option<String>,
    now: Millis,
) -> Result<Reconciled> {
    lock_session_of_run(c, run_id)?;
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
    c: &dyn Db,
    run_id: &RunId,
    how: Resumption,
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    lock_session_of_run(c, run_id)?;
    let mut state = load_state(c, run_id)?;
    if let Some(lineage) = &state.lineage {
        return Err(Error::Conflict(format!(
            "run {run_id} was delegated by {} and its result was already handed back; continue the parent instead",
            lineage.parent_run_id
        )));
    }
    if state.config.continuation {
        return Err(Error::Conflict(format!(
            "run {run_id} is a continuation turn: its inbox events are offered to a new one (see the session's inbox)"
        )));
    }
    let (drafts, job) = ratchet_core::step::resume_failed(&mut state, how, now)?;
    // The run takes its session back only if nobody else holds it: one active run each.
    let taken = c.execute(
        "UPDATE sessions SET active_run_id = ?2 WHERE id = ?1 AND active_run_id IS NULL",
        &params![state.session_id.as_str(), run_id.as_str()],
    )?;
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

fn to_approval(mut r: Row) -> Result<Approval> {
    let status = r.text(3)?;
    let mut status = ApprovalStatus::parse(&status)
        .ok_or_else(|| Error::Corrupt(format!("unknown approval status {status:?}")))?;
    if status == ApprovalStatus::Pending && r.text(4)? != RunStatus::WaitingHuman.as_str() {
        status = ApprovalStatus::Cancelled;
    }
    Ok(Approval {
        id: ApprovalId::parse(&r.text(0)?).map_err(corrupt)?,
        run_id: parse_run_id(&r.text(1)?)?,
        session_id: parse_session_id(&r.text(2)?)?,
        status,
        calls: from_json(&r.text(5)?, "approval calls")?,
        answer: r
            .opt_text(6)?
            .map(|a| from_json(&a, "approval answer"))
            .transpose()?,
        created_at: r.int(7)?,
        decided_at: r.opt_int(8)?,
    })
}

pub(crate) fn approvals(
    c: &dyn Db,
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
    c.query(&sql, &params![tenant, after.map(ApprovalId::as_str), limit])?
        .into_iter()
        .map(to_approval)
        .collect()
}

pub(crate) fn get_approval(c: &dyn Db, id: &ApprovalId) -> Result<Approval> {
    let row = c
        .query_opt(
            &format!(
                "SELECT {APPROVAL_COLUMNS} FROM approvals a JOIN runs r ON r.id = a.run_id WHERE a.id = ?1"
            ),
            &params![id.as_str()],
        )?
        .ok_or_else(|| approval_not_found(id))?;
    to_approval(row)
}

fn approval_not_found(id: &ApprovalId) -> Error {
    Error::NotFound {
        kind: "approval",
        id: id.to_string(),
    }
}

pub(crate) fn answer_approval(
    c: &dyn Db,
    id: &ApprovalId,
    answer: ApprovalAnswer,
    by: &str,
    now: Millis,
) -> Result<Answered> {
    let session = c
        .query_opt(
            "SELECT session_id FROM approvals WHERE id = ?1",
            &params![id.as_str()],
        )?
        .ok_or_else(|| approval_not_found(id))?
        .text(0)?;
    c.lock_session(&session)?;
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
    let (drafts, job) = ratchet_core::approval::answer_approval(&mut state, id, &answer, by, now)?;
    write_state(c, &state)?;
    let status = match answer {
        ApprovalAnswer::Abort => ApprovalStatus::Aborted,
        ApprovalAnswer::Decisions(_) => ApprovalStatus::Decided,
    };
    let answer_json = to_json(&answer)?;
    c.execute(
        "UPDATE approvals SET status = ?2, answer_json = ?3, decided_at = ?4 WHERE id = ?1",
        &params![id.as_str(), status.as_str(), &answer_json, now],
    )?;
    if let Some(job) = &job {
        insert_job(c, job, now)?;
    }
    let mut events = insert_events(c, &state.session_id, Some(&state.run_id), &drafts, now)?;
    let mut enqueued = false;
    if state.status.is_terminal() {
        mark_cancel_requested(c, &state.run_id)?;
        events.extend(run_ended(c, &state, &mut enqueued, now)?);
    }
    Ok(Answered {
        events,
        resumed: job.is_some(),
        enqueued,
        repeated: false,
    })
}
