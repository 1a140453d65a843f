//! A session's queue of runs: submitting a message (a run started, queued behind the active
//! one, steering it or interrupting it), the run quotas a new run is admitted under, steers
//! waiting for the active run's next model call, and the next run started when the active one
//! ends.

use ratchet_core::inbox::{NextTurn, input_message, wakes_held_events};
use ratchet_core::step::start_run;
use ratchet_core::{
    AgentState, EventDraft, EventKind, Message, Millis, Origin, RunConfigSnapshot, RunId,
    RunStatus, SessionId, TraceContext,
};
use ratchet_store::{CancelOutcome, Effect, Error, NewRun, StoredEvent, Submitted, WhenBusy};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::db::Db;
use crate::events::insert_events;
use crate::rows::{count, from_json, parse_run_id, run_not_found, to_json};
use crate::runs::{load_state, request_cancel, run_row, write_state};
use crate::sessions::insert_message;
use crate::steps::insert_job;
use crate::{Result, params};

pub(crate) fn submit_message(c: &dyn Db, mut new: NewRun, now: Millis) -> Result<Submitted> {
    let request = new.request.take();
    let (message_id, run_id) = (new.message_id.clone(), new.run_id.clone());
    let submitted = submit(c, new, now)?;
    if let Some(mark) = &request {
        let effect = Effect::submitted(message_id, run_id, &submitted);
        crate::requests::record_effect(c, mark, &effect)?;
        // The process dies with the message and its key's effect written but not committed.
        #[cfg(feature = "failpoints")]
        fail::fail_point!("request.before_commit", |_| std::process::abort());
    }
    Ok(submitted)
}

fn submit(c: &dyn Db, new: NewRun, now: Millis) -> Result<Submitted> {
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
        let woke = crate::timer::wake_on_input(c, &new.session_id, now)?;
        return Ok(Submitted {
            status: run_row(c, active)?.status,
            events: Vec::new(),
            interrupted: None,
            steered_into: Some(active.clone()),
            woke,
        });
    }
    let (state, created) = insert_queued_run(
        c,
        &new.session_id,
        &new.run_id,
        new.message_id.as_str(),
        &new.content,
        new.config,
        new.trace,
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
            woke: None,
        });
    };
    let mut events = insert_events(c, &new.session_id, Some(&new.run_id), &drafts, now)?;
    let mut interrupted = None;
    let mut woke = None;
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
    } else {
        woke = crate::timer::wake_on_input(c, &new.session_id, now)?;
    }
    let status = run_row(c, &new.run_id)?.status;
    Ok(Submitted {
        status,
        events,
        interrupted,
        steered_into: None,
        woke,
    })
}

/// The statuses a run quota counts.
pub(crate) const ACTIVE_STATUSES: &str = "('queued', 'running', 'waiting_human', 'waiting_children', 'waiting_timer', 'paused', 'cancelling')";

/// Non-terminal runs of a root session, the runs of its delegations included.
pub(crate) fn active_in_session(c: &dyn Db, root_session: &SessionId) -> Result<u64> {
    count(
        c,
        &format!(
            "SELECT count(*) FROM runs r JOIN sessions s ON s.id = r.session_id
             WHERE (s.id = ?1 OR s.root_session_id = ?1) AND r.status IN {ACTIVE_STATUSES}"
        ),
        &params![root_session.as_str()],
    )
}

/// Refuses to admit `adding` more runs to `root_session` beyond the quota. The caller holds
/// the session's lock, which makes the per-session count exact; the global count is made
/// exact by the quota's own lock, taken here and held until the transaction ends.
pub(crate) fn check_quota(
    c: &dyn Db,
    root_session: &SessionId,
    quota: ratchet_store::RunQuota,
    adding: u64,
) -> Result<()> {
    quota.check(
        root_session,
        adding,
        || active_in_session(c, root_session),
        || {
            c.lock_run_quota()?;
            count(
                c,
                &format!("SELECT count(*) FROM runs WHERE status IN {ACTIVE_STATUSES}"),
                &[],
            )
        },
    )
}

/// Inserts a run waiting in its session's queue, with the message that will start it.
#[expect(
    clippy::too_many_arguments,
    reason = "each is a field of the new run's row or state, given by every kind of run creation"
)]
pub(crate) fn insert_queued_run(
    c: &dyn Db,
    session_id: &SessionId,
    run_id: &RunId,
    message_id: &str,
    content: &str,
    config: RunConfigSnapshot,
    trace: Option<TraceContext>,
    created_at: Millis,
) -> Result<(AgentState, EventDraft)> {
    let input = json!({"message_id": message_id, "content": content});
    let mut state = AgentState::new(session_id.clone(), run_id.clone(), config, created_at);
    state.trace = trace;
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
pub(crate) fn absorb_steers(
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
    let message = input_message(&state, input.content);
    insert_message(c, &input.message_id, &state, &message, now)?;
    if wakes_held_events(&state) {
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
            state.config.continuation
        ],
    )?;
    Ok(vec![event])
}

/// The session's active run has ended: the oldest queued run (if any) starts now, or a
/// continuation turn when due inbox events have waited their turn (`NextTurn`). The new run's
/// events are stored under its own id, after the events of the run that ended.
pub(crate) fn release_session(
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
            None,
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

/// The key a configuration is stored under in `run_configs`: the SHA-256 of its JSON, so that
/// every run frozen with the same configuration refers to one row.
pub(crate) fn config_id(config_json: &str) -> String {
    Sha256::digest(config_json.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
