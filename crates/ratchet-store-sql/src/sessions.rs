//! Sessions and their messages: creating, reading, listing (its filters and its text match)
//! and renaming a session; writing a message into its history; and reading messages back, as
//! a page of visible ones, as a run's context, as what one step saw and wrote, or as the whole
//! history.

use ratchet_core::{AgentState, Message, Millis, RunId, SessionId};
use ratchet_store::{
    Effect, Error, ListOrder, Session, SessionCursor, SessionQuery, SessionSpec, SessionState,
    StepMessages, StoredMessage, split_step_messages,
};

use crate::db::{Db, Row, Value};
use crate::rows::{
    from_json, parse_run_id, parse_session_id, parse_status, run_not_found, sql_enum, sql_str,
    to_json,
};
use crate::{Result, params};

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
    if let Some(mark) = &spec.request {
        let effect = Effect::SessionCreated {
            session_id: id.clone(),
        };
        crate::requests::record_effect(c, mark, &effect)?;
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

pub(crate) fn encode_tool_calls(message: &Message) -> Result<Option<String>> {
    if message.tool_calls.is_empty() {
        return Ok(None);
    }
    to_json(&message.tool_calls).map(Some)
}

/// `insert_message` with the message's tool calls encoded already.
pub(crate) fn insert_encoded_message(
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
    let Some((through, written)) = split_step_messages(runs_messages, run_id, step_index) else {
        return Ok(StepMessages::default());
    };
    Ok(StepMessages {
        context: context_through(c, &session_id, run_id, through)?,
        written,
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

/// The session's messages in order, as stored, hidden ones included; not a continuation
/// turn's drafts.
pub(crate) fn stored_history(c: &dyn Db, session_id: &SessionId) -> Result<Vec<StoredMessage>> {
    c.query(
        &format!(
            "SELECT {STORED_MESSAGE_COLUMNS} FROM messages
             WHERE session_id = ?1 AND draft_of IS NULL ORDER BY rowid"
        ),
        &params![session_id.as_str()],
    )?
    .into_iter()
    .map(to_stored_message)
    .collect()
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
