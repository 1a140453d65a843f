//! The inbox's transaction bodies: places reserved when background work is admitted, reports
//! written when background runs end, continuation turns that lease due events and consume
//! them when they complete, and closing a session.
//!
//! Every status change goes through `move_events`, which asks the core's edge table first.
//! All of a root session's inbox is written under its tree lock (the root session's), so the
//! capacity count and the choice of the next turn cannot race.

use ratchet_core::delegation::{ChildResult, ChildRun, completion_report};
use ratchet_core::inbox::{
    DueEvent, EXPIRED, EarlierSignal, InboxRoom, NextTurn, RUN_CANCELLED, SESSION_CLOSED,
    SignalAdmission, Waiting, admit_signal, continuation_config, continuation_ids,
    continuation_release_reason, continuation_trigger, dead_lettered, next_turn, places_to_reserve,
    signal_not_sent, signal_to_closed, steered_signal, trigger_budget,
};
use ratchet_core::{
    AgentState, CompletionPolicy, Delivery, EventDraft, EventKind, InboxKind, InboxPolicy,
    InboxStatus, Millis, RunId, RunStatus, SessionId,
};
use ratchet_store::{
    Claim, Closed, Closing, DeadLetterAction, EmittedSignal, Error, InboxChange, InboxEvent,
    NewSignal, SignalOutcome, StoredEvent,
};
use serde_json::json;

use crate::db::{Db, Row};
use crate::events::insert_events;
use crate::queue::{ACTIVE_STATUSES, insert_queued_run, start_queued_run, take_steers};
use crate::rows::{count, from_json, parse_run_id, parse_session_id, sql_enum, to_json};
use crate::runs::{cancel_one, frozen_config, load_state};
use crate::sessions::insert_message;
use crate::steps::fenced;
use crate::{Result, params};

const HELD: &str = "('reserved', 'pending', 'leased')";

/// Events and reservations a root session's inbox holds.
pub(crate) fn held(c: &dyn Db, root_session: &SessionId) -> Result<u64> {
    count(
        c,
        &format!("SELECT count(*) FROM inbox WHERE session_id = ?1 AND status IN {HELD}"),
        &params![root_session.as_str()],
    )
}

/// Moves the events `ids` that are still in `from` to `to`, noting `reason` when given.
/// Returns the ids that moved.
fn move_events(
    c: &dyn Db,
    ids: &[i64],
    from: InboxStatus,
    to: InboxStatus,
    reason: Option<&str>,
    now: Millis,
) -> Result<Vec<i64>> {
    from.edge(to)
        .map_err(|e| Error::Conflict(format!("inbox: {e}")))?;
    let mut moved = Vec::new();
    for id in ids {
        let changed = c.execute(
            "UPDATE inbox SET status = ?3, reason = COALESCE(?4, reason), updated_at = ?5
             WHERE id = ?1 AND status = ?2",
            &params![*id, from.as_str(), to.as_str(), reason, now],
        )?;
        if changed == 1 {
            moved.push(*id);
        }
    }
    Ok(moved)
}

fn ids_where(c: &dyn Db, sql: &str, params: &[crate::db::Param<'_>]) -> Result<Vec<i64>> {
    c.query(sql, params)?
        .into_iter()
        .map(|mut r| r.int(0))
        .collect()
}

/// Reserves the inbox places the background children of a parent's step will report to: one
/// per child (`each`) or one per call (`all`). Refused with `Error::QuotaExceeded` when the
/// root session's inbox has no room for them all.
pub(crate) fn reserve(
    c: &dyn Db,
    parent: &AgentState,
    children: &[ChildRun],
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    let Some((root, places)) = places_to_reserve(children) else {
        return Ok(Vec::new());
    };
    let policy = parent.config.delegation.inbox;
    (InboxRoom::new(root, held(c, root)?, &policy).reserve(places.len()))
        .map_err(Error::QuotaExceeded)?;
    let mut drafts = Vec::new();
    for place in places {
        let (kind, source, group) = (place.kind, place.source, place.group);
        let id = c
            .query_opt(
                "INSERT INTO inbox (session_id, kind, status, delivery, parent_run_id, source_run_id, group_id, max_attempts, created_at, updated_at)
                 VALUES (?1, ?2, 'reserved', 'queue', ?3, ?4, ?5, ?6, ?7, ?7) RETURNING id",
                &params![
                    root.as_str(),
                    kind.as_str(),
                    parent.run_id.as_str(),
                    source.map(|r| r.as_str()),
                    group,
                    policy.max_attempts,
                    now
                ],
            )?
            .ok_or_else(|| Error::Backend("an insert returned no id".into()))?
            .int(0)?;
        drafts.push(EventDraft::new(
            EventKind::InboxReserved,
            json!({"event": id, "kind": kind, "source_run_id": source, "group": group, "delegated_by": parent.run_id}),
        ));
    }
    insert_events(c, root, None, &drafts, now)
}

/// Whether a session was closed (archived or deleted).
fn is_closed(c: &dyn Db, session: &SessionId) -> Result<bool> {
    Ok(c.query_opt(
        "SELECT 1 FROM sessions WHERE id = ?1 AND (archived_at IS NOT NULL OR deleted_at IS NOT NULL)",
        &params![session.as_str()],
    )?
    .is_some())
}

/// A background run has ended: if it was cancelled, its unread signals are superseded; its
/// report fills its reserved place — its own (`each`), or its group's once the group's last run
/// has ended (`all`) — and, when the root session is free, a continuation turn starts with it
/// in this same transaction.
pub(crate) fn background_ended(
    c: &dyn Db,
    child: &AgentState,
    enqueued: &mut bool,
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    let Some(lineage) = &child.lineage else {
        return Ok(Vec::new());
    };
    let Some(group) = &lineage.background else {
        return Ok(Vec::new());
    };
    let root = &lineage.root_session_id;
    let mut events = Vec::new();
    if child.status == RunStatus::Cancelled {
        let unread = ids_where(
            c,
            "SELECT id FROM inbox WHERE source_run_id = ?1 AND kind = 'signal' AND status = 'pending' ORDER BY id",
            &params![child.run_id.as_str()],
        )?;
        let superseded = move_events(
            c,
            &unread,
            InboxStatus::Pending,
            InboxStatus::Superseded,
            Some(RUN_CANCELLED),
            now,
        )?;
        if !superseded.is_empty() {
            let draft = EventDraft::new(
                EventKind::InboxSuperseded,
                json!({"events": superseded, "source_run_id": child.run_id}),
            );
            events.extend(insert_events(c, root, None, &[draft], now)?);
        }
    }
    let (place, results) = match group.policy {
        CompletionPolicy::Each => (
            ids_where(
                c,
                "SELECT id FROM inbox WHERE source_run_id = ?1 AND kind = 'completion' AND status = 'reserved'",
                &params![child.run_id.as_str()],
            )?,
            ChildResult::of(child).into_iter().collect(),
        ),
        CompletionPolicy::All => {
            let unfinished = count(
                c,
                &format!(
                    "SELECT count(*) FROM runs WHERE inbox_group = ?1 AND status IN {ACTIVE_STATUSES}"
                ),
                &params![group.group.as_str()],
            )?;
            if unfinished > 0 {
                return Ok(events);
            }
            let members = c
                .query(
                    "SELECT id FROM runs WHERE inbox_group = ?1",
                    &params![group.group.as_str()],
                )?
                .into_iter()
                .map(|mut r| parse_run_id(&r.text(0)?))
                .collect::<Result<Vec<_>>>()?;
            let mut results = Vec::new();
            for member in &members {
                results.extend(ChildResult::of(&load_state(c, member)?));
            }
            (
                ids_where(
                    c,
                    "SELECT id FROM inbox WHERE group_id = ?1 AND kind = 'group_completion' AND status = 'reserved'",
                    &params![group.group.as_str()],
                )?,
                results,
            )
        }
    };
    let report = to_json(&completion_report(&lineage.parent_run_id, results))?;
    let closed = is_closed(c, root)?;
    let expires_at = policy_of(c, lineage.parent_run_id.as_str())?.expires_at(now);
    let mut drafts = Vec::new();
    for id in place {
        c.execute(
            "UPDATE inbox SET payload_json = ?2, available_at = ?3, expires_at = ?4 WHERE id = ?1",
            &params![id, &report, now, expires_at],
        )?;
        if closed {
            let dead = move_events(
                c,
                &[id],
                InboxStatus::Reserved,
                InboxStatus::DeadLetter,
                Some(SESSION_CLOSED),
                now,
            )?;
            drafts.push(dead_lettered(&dead, SESSION_CLOSED));
        } else {
            move_events(
                c,
                &[id],
                InboxStatus::Reserved,
                InboxStatus::Pending,
                None,
                now,
            )?;
            drafts.push(EventDraft::new(
                EventKind::InboxPending,
                json!({"event": id, "kind": group.policy.report_kind(), "source_run_id": child.run_id}),
            ));
        }
    }
    events.extend(insert_events(c, root, None, &drafts, now)?);
    if !closed {
        events.extend(serve_if_free(c, root, enqueued, now)?);
    }
    Ok(events)
}

/// An inbox event became due in a root session: a session that has no active run starts a
/// continuation turn; one whose active run waits on a timer wakes it (the report is input,
/// as it is for `sleep`).
fn serve_if_free(
    c: &dyn Db,
    session: &SessionId,
    enqueued: &mut bool,
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    let free = c
        .query_opt(
            "SELECT 1 FROM sessions WHERE id = ?1 AND active_run_id IS NULL
             AND archived_at IS NULL AND deleted_at IS NULL",
            &params![session.as_str()],
        )?
        .is_some();
    if !free {
        if oldest_due(c, session, now)?.is_some()
            && crate::timer::wake_on_input(c, session, now)?.is_some()
        {
            *enqueued = true;
        }
        return Ok(Vec::new());
    }
    if oldest_due(c, session, now)?.is_none() {
        return Ok(Vec::new());
    }
    *enqueued = true;
    start_continuation(c, session, now)
}

fn oldest_due(c: &dyn Db, session: &SessionId, now: Millis) -> Result<Option<Millis>> {
    c.query_opt(
        "SELECT MIN(available_at) FROM inbox WHERE session_id = ?1 AND status = 'pending' AND available_at <= ?2",
        &params![session.as_str(), now],
    )?
    .map(|mut r| r.opt_int(0))
    .transpose()
    .map(Option::flatten)
}

/// The inbox rules an event follows: those frozen with the run that delegated its work.
fn policy_of(c: &dyn Db, delegated_by: &str) -> Result<InboxPolicy> {
    Ok(frozen_config(c, &parse_run_id(delegated_by)?)?
        .delegation
        .inbox)
}

/// What a freed session does next (see `ratchet_core::inbox::next_turn`, under the rules of
/// the oldest due event): the oldest queued user run, a continuation turn, or nothing. A
/// closed session starts nothing.
pub(crate) fn choose_next_turn(
    c: &dyn Db,
    session: &SessionId,
    queued_user: bool,
    now: Millis,
) -> Result<NextTurn> {
    let mut row = c
        .query_opt(
            "SELECT archived_at IS NOT NULL OR deleted_at IS NOT NULL, user_turns_in_a_row FROM sessions WHERE id = ?1",
            &params![session.as_str()],
        )?
        .ok_or_else(|| Error::NotFound {
            kind: "session",
            id: session.to_string(),
        })?;
    if row.flag(0)? {
        return Ok(NextTurn::Idle);
    }
    let oldest = c
        .query_opt(
            "SELECT available_at, parent_run_id FROM inbox
             WHERE session_id = ?1 AND status = 'pending' AND available_at <= ?2
             ORDER BY available_at, id LIMIT 1",
            &params![session.as_str(), now],
        )?
        .map(|mut r| Ok::<_, Error>((r.int(0)?, r.text(1)?)))
        .transpose()?;
    let policy = match &oldest {
        Some((_, delegated_by)) => policy_of(c, delegated_by)?,
        None => InboxPolicy::default(),
    };
    let waiting = Waiting {
        queued_user,
        oldest_due: oldest.map(|(due, _)| due),
        user_turns_in_a_row: u32::try_from(row.int(1)?).unwrap_or(u32::MAX),
    };
    Ok(next_turn(waiting, &policy, now))
}

/// Most events one continuation turn is handed.
const EVENTS_PER_TURN: u32 = 32;

/// Starts a continuation run in a free root session: its due events (oldest first) are leased
/// to it, and it starts with a hidden trigger that carries their reports.
pub(crate) fn start_continuation(
    c: &dyn Db,
    session: &SessionId,
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    let due = c
        .query(
            "SELECT id, kind, payload_json, attempts FROM inbox
             WHERE session_id = ?1 AND status = 'pending' AND available_at <= ?2
             ORDER BY id LIMIT ?3",
            &params![session.as_str(), now, EVENTS_PER_TURN],
        )?
        .into_iter()
        .map(|mut r| {
            let kind = r.text(1)?;
            Ok((
                DueEvent {
                    id: r.int(0)?,
                    kind: InboxKind::parse(&kind)
                        .ok_or_else(|| Error::Corrupt(format!("unknown inbox kind {kind:?}")))?,
                    payload: from_json(&r.text(2)?, "inbox payload")?,
                },
                r.int(3)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let Some((first, attempts)) = due.first() else {
        return Ok(Vec::new());
    };
    let latest = c
        .query_opt(
            "SELECT id FROM runs WHERE session_id = ?1 ORDER BY created_at DESC, id DESC LIMIT 1",
            &params![session.as_str()],
        )?
        .ok_or_else(|| Error::Corrupt(format!("session {session} has inbox events but no run")))?
        .text(0)?;
    let config = continuation_config(&*frozen_config(c, &parse_run_id(&latest)?)?);
    let (run_id, message_id) =
        continuation_ids(now, first.id, *attempts).map_err(|e| Error::Corrupt(e.to_string()))?;
    let events: Vec<DueEvent> = due.iter().map(|(e, _)| e.clone()).collect();
    // The turn takes the events its trigger carries; the rest wait for the next one.
    let (trigger, carried) = continuation_trigger(&events, trigger_budget(&config.limits));
    let events = &events[..carried];
    let (state, created) = insert_queued_run(
        c,
        session,
        &run_id,
        message_id.as_str(),
        &trigger,
        config,
        None,
        now,
    )?;
    let ids: Vec<i64> = events.iter().map(|e| e.id).collect();
    let leased = move_events(
        c,
        &ids,
        InboxStatus::Pending,
        InboxStatus::Leased,
        None,
        now,
    )?;
    for id in &leased {
        c.execute(
            "UPDATE inbox SET lease_run_id = ?2, attempts = attempts + 1 WHERE id = ?1",
            &params![*id, run_id.as_str()],
        )?;
    }
    let mut drafts = vec![created];
    drafts.extend(start_queued_run(c, state, now)?);
    drafts.push(EventDraft::new(
        EventKind::InboxLeased,
        json!({"events": leased, "run_id": run_id}),
    ));
    insert_events(c, session, Some(&run_id), &drafts, now)
}

/// A continuation run has ended: the events it held are consumed when it completed; when it
/// failed each goes back to pending for a later attempt (or to the dead letter after its last).
/// When someone stopped it (a cancel, an interrupting message) they go back to pending without
/// the attempt counting, held for the session's next user turn: the turn after that tells
/// them, and a stopped turn does not start again on its own (`wake_held`).
pub(crate) fn continuation_ended(
    c: &dyn Db,
    state: &AgentState,
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    let held = c
        .query(
            "SELECT id, attempts, parent_run_id FROM inbox WHERE lease_run_id = ?1 AND status = 'leased' ORDER BY id",
            &params![state.run_id.as_str()],
        )?
        .into_iter()
        .map(|mut r| Ok((r.int(0)?, r.int(1)?, r.text(2)?)))
        .collect::<Result<Vec<_>>>()?;
    let ids: Vec<i64> = held.iter().map(|(id, _, _)| *id).collect();
    let run = &state.run_id;
    let mut drafts = Vec::new();
    match state.status {
        RunStatus::Completed => {
            // The turn's messages join the session's history in the commit that consumes what
            // they tell; an attempt that failed or was stopped leaves its drafts out of it.
            c.write(
                "UPDATE messages SET draft_of = NULL WHERE session_id = ?1 AND draft_of = ?2",
                &params![state.session_id.as_str(), run.as_str()],
            )?;
            let consumed = move_events(
                c,
                &ids,
                InboxStatus::Leased,
                InboxStatus::Consumed,
                None,
                now,
            )?;
            drafts.push(EventDraft::new(
                EventKind::InboxConsumed,
                json!({"events": consumed, "run_id": run}),
            ));
        }
        RunStatus::Cancelled => {
            let reason = continuation_release_reason(run, state.status, state.stop_reason);
            let held = move_events(
                c,
                &ids,
                InboxStatus::Leased,
                InboxStatus::Pending,
                Some(&reason),
                now,
            )?;
            for id in &held {
                c.execute(
                    "UPDATE inbox SET attempts = attempts - 1, available_at = NULL WHERE id = ?1",
                    &params![*id],
                )?;
            }
            if !held.is_empty() {
                let released: Vec<_> = held
                    .iter()
                    .map(|id| json!({"event": id, "available_at": null}))
                    .collect();
                drafts.push(EventDraft::new(
                    EventKind::InboxReleased,
                    json!({"events": released, "run_id": run, "reason": reason}),
                ));
            }
        }
        _ => {
            let reason = continuation_release_reason(run, state.status, state.stop_reason);
            let (mut released, mut dead) = (Vec::new(), Vec::new());
            for (id, attempts, delegated_by) in held {
                let policy = policy_of(c, &delegated_by)?;
                match policy.retry_at(u32::try_from(attempts).unwrap_or(u32::MAX), now) {
                    Some(at) => {
                        move_events(
                            c,
                            &[id],
                            InboxStatus::Leased,
                            InboxStatus::Pending,
                            Some(&reason),
                            now,
                        )?;
                        c.execute(
                            "UPDATE inbox SET available_at = ?2 WHERE id = ?1",
                            &params![id, at],
                        )?;
                        released.push(json!({"event": id, "available_at": at}));
                    }
                    None => {
                        dead.extend(move_events(
                            c,
                            &[id],
                            InboxStatus::Leased,
                            InboxStatus::DeadLetter,
                            Some(&reason),
                            now,
                        )?);
                    }
                }
            }
            if !released.is_empty() {
                drafts.push(EventDraft::new(
                    EventKind::InboxReleased,
                    json!({"events": released, "run_id": run, "reason": reason}),
                ));
            }
            if !dead.is_empty() {
                drafts.push(dead_lettered(&dead, &reason));
            }
        }
    }
    insert_events(c, &state.session_id, Some(run), &drafts, now)
}

/// A user turn starts in `session`: the events a stopped continuation gave back become due, so
/// the continuation after this turn tells them.
pub(crate) fn wake_held(c: &dyn Db, session: &SessionId, now: Millis) -> Result<()> {
    c.write(
        "UPDATE inbox SET available_at = ?2
         WHERE session_id = ?1 AND status = 'pending' AND available_at IS NULL",
        &params![session.as_str(), now],
    )
}

/// Most pending reports one pass of `expire` dead-letters.
const EXPIRED_PER_PASS: u32 = 256;

/// Whether a pending report has outlived its max age as of `now`: a read, so that an idle
/// worker finding none does not take the writer.
pub(crate) fn anything_expired(c: &dyn Db, now: Millis) -> Result<bool> {
    Ok(c.query_opt(
        "SELECT 1 FROM inbox WHERE status = 'pending' AND expires_at <= ?1 LIMIT 1",
        &params![now],
    )?
    .is_some())
}

/// Dead-letters the pending reports that have outlived their max age (`expired`), at most
/// `EXPIRED_PER_PASS`, under each root session's lock.
pub(crate) fn expire(c: &dyn Db, now: Millis) -> Result<Vec<StoredEvent>> {
    let rows = c.query(
        "SELECT session_id, id FROM inbox WHERE status = 'pending' AND expires_at <= ?1
         ORDER BY session_id, id LIMIT ?2",
        &params![now, EXPIRED_PER_PASS],
    )?;
    let mut by_session: Vec<(SessionId, Vec<i64>)> = Vec::new();
    for mut row in rows {
        let (session, id) = (parse_session_id(&row.text(0)?)?, row.int(1)?);
        match by_session.last_mut() {
            Some((last, ids)) if *last == session => ids.push(id),
            _ => by_session.push((session, vec![id])),
        }
    }
    let reason = EXPIRED;
    let mut events = Vec::new();
    for (session, ids) in by_session {
        c.lock_session(session.as_str())?;
        let dead = move_events(
            c,
            &ids,
            InboxStatus::Pending,
            InboxStatus::DeadLetter,
            Some(reason),
            now,
        )?;
        if !dead.is_empty() {
            events.extend(insert_events(
                c,
                &session,
                None,
                &[dead_lettered(&dead, reason)],
                now,
            )?);
        }
    }
    Ok(events)
}

/// Root sessions a continuation could start in now.
pub(crate) fn servable_sessions(c: &dyn Db, now: Millis) -> Result<Vec<SessionId>> {
    c.query(
        "SELECT DISTINCT i.session_id FROM inbox i JOIN sessions s ON s.id = i.session_id
         WHERE i.status = 'pending' AND i.available_at <= ?1 AND s.active_run_id IS NULL
           AND s.archived_at IS NULL AND s.deleted_at IS NULL
         ORDER BY i.session_id LIMIT 64",
        &params![now],
    )?
    .into_iter()
    .map(|mut r| parse_session_id(&r.text(0)?))
    .collect()
}

/// Starts a continuation in `session` if it is still free with due events.
pub(crate) fn serve_session(
    c: &dyn Db,
    session: &SessionId,
    now: Millis,
) -> Result<(Vec<StoredEvent>, Option<RunId>)> {
    c.lock_session(session.as_str())?;
    let mut enqueued = false;
    let events = serve_if_free(c, session, &mut enqueued, now)?;
    let started = c
        .query_opt(
            "SELECT active_run_id FROM sessions WHERE id = ?1",
            &params![session.as_str()],
        )?
        .map(|mut r| r.opt_text(0))
        .transpose()?
        .flatten()
        .filter(|_| enqueued)
        .map(|id| parse_run_id(&id))
        .transpose()?;
    Ok((events, started))
}

pub(crate) fn close_session(
    c: &dyn Db,
    session: &SessionId,
    how: Closing,
    now: Millis,
) -> Result<Closed> {
    c.lock_session(session.as_str())?;
    let not_found = || Error::NotFound {
        kind: "session",
        id: session.to_string(),
    };
    let mut row = c
        .query_opt(
            "SELECT root_session_id, archived_at, deleted_at FROM sessions WHERE id = ?1",
            &params![session.as_str()],
        )?
        .ok_or_else(not_found)?;
    if row.opt_int(2)?.is_some() {
        return Err(not_found());
    }
    if let Some(root) = row.opt_text(0)? {
        return Err(Error::Invalid(format!(
            "session {session} holds a delegated run; close its root session {root}"
        )));
    }
    if how == Closing::Archive && row.opt_int(1)?.is_some() {
        return Err(Error::Conflict(format!(
            "session {session} is already archived"
        )));
    }
    c.execute(
        "UPDATE sessions SET archived_at = COALESCE(archived_at, ?2), deleted_at = ?3 WHERE id = ?1",
        &params![
            session.as_str(),
            now,
            (how == Closing::Delete).then_some(now)
        ],
    )?;
    // Waiting steers are user messages: they stay on record, as runs cancelled with the rest.
    for steer in take_steers(c, session)? {
        let run_id = parse_run_id(&steer.run_id)?;
        let config = from_json(&steer.config_json, "steer config")?;
        insert_queued_run(
            c,
            session,
            &run_id,
            &steer.message_id,
            &steer.content,
            config,
            None,
            steer.created_at,
        )?;
    }
    let runs = c
        .query(
            &format!(
                "SELECT r.id FROM runs r JOIN sessions s ON s.id = r.session_id
                 WHERE (s.id = ?1 OR s.root_session_id = ?1) AND r.status IN {ACTIVE_STATUSES}
                 ORDER BY r.depth, r.created_at, r.id"
            ),
            &params![session.as_str()],
        )?
        .into_iter()
        .map(|mut r| parse_run_id(&r.text(0)?))
        .collect::<Result<Vec<_>>>()?;
    let mut events = Vec::new();
    let mut enqueued = false;
    for run in runs {
        match cancel_one(c, &run, now)? {
            ratchet_store::CancelOutcome::Cancelled {
                events: more,
                enqueued: more_enqueued,
            } => {
                events.extend(more);
                enqueued |= more_enqueued;
            }
            ratchet_store::CancelOutcome::Cancelling { events: more } => events.extend(more),
            ratchet_store::CancelOutcome::AlreadyTerminal(_) => {}
        }
    }
    let reason = format!("the session was {}", how.as_str());
    let mut drafts = Vec::new();
    for from in [
        InboxStatus::Reserved,
        InboxStatus::Pending,
        InboxStatus::Leased,
    ] {
        let ids = ids_where(
            c,
            "SELECT id FROM inbox WHERE session_id = ?1 AND status = ?2 ORDER BY id",
            &params![session.as_str(), from.as_str()],
        )?;
        let dead = move_events(c, &ids, from, InboxStatus::DeadLetter, Some(&reason), now)?;
        if !dead.is_empty() {
            drafts.push(dead_lettered(&dead, &reason));
        }
    }
    drafts.push(EventDraft::new(
        EventKind::SessionClosed,
        json!({"session_id": session, "how": how.as_str()}),
    ));
    events.extend(insert_events(c, session, None, &drafts, now)?);
    Ok(Closed { events, enqueued })
}

const INBOX_COLUMNS: &str = "id, session_id, kind, status, delivery, parent_run_id, source_run_id, group_id, payload_json, attempts, max_attempts, available_at, lease_run_id, reason, created_at, updated_at, requeued_at, expires_at";

fn to_inbox_event(mut r: Row) -> Result<InboxEvent> {
    let kind = r.text(2)?;
    let status = r.text(3)?;
    Ok(InboxEvent {
        id: r.int(0)?,
        session_id: parse_session_id(&r.text(1)?)?,
        kind: InboxKind::parse(&kind)
            .ok_or_else(|| Error::Corrupt(format!("unknown inbox kind {kind:?}")))?,
        status: InboxStatus::parse(&status)
            .ok_or_else(|| Error::Corrupt(format!("unknown inbox status {status:?}")))?,
        delivery: sql_enum::<Delivery>(&r.text(4)?)?,
        parent_run_id: parse_run_id(&r.text(5)?)?,
        source_run_id: r.opt_text(6)?.as_deref().map(parse_run_id).transpose()?,
        group: r.opt_text(7)?,
        payload: r
            .opt_text(8)?
            .map(|p| from_json(&p, "inbox payload"))
            .transpose()?,
        attempts: u32::try_from(r.int(9)?).unwrap_or(u32::MAX),
        max_attempts: u32::try_from(r.int(10)?).unwrap_or(u32::MAX),
        available_at: r.opt_int(11)?,
        lease_run_id: r.opt_text(12)?.as_deref().map(parse_run_id).transpose()?,
        reason: r.opt_text(13)?,
        created_at: r.int(14)?,
        updated_at: r.int(15)?,
        requeued_at: r.opt_int(16)?,
        expires_at: r.opt_int(17)?,
    })
}

/// The event `id` of `session`'s inbox, as it stands.
fn inbox_event(c: &dyn Db, session: &SessionId, id: i64) -> Result<InboxEvent> {
    c.query_opt(
        &format!("SELECT {INBOX_COLUMNS} FROM inbox WHERE session_id = ?1 AND id = ?2"),
        &params![session.as_str(), id],
    )?
    .map(to_inbox_event)
    .transpose()?
    .ok_or_else(|| Error::NotFound {
        kind: "inbox event",
        id: format!("{id} of session {session}"),
    })
}

/// See `Writes::act_on_dead_letter`.
pub(crate) fn act_on_dead_letter(
    c: &dyn Db,
    session: &SessionId,
    id: i64,
    action: DeadLetterAction,
    by: &str,
    now: Millis,
) -> Result<InboxChange> {
    c.lock_session(session.as_str())?;
    let event = inbox_event(c, session, id)?;
    if !action.applies_to(&event)? {
        return Ok(InboxChange {
            event,
            events: Vec::new(),
            enqueued: false,
        });
    }
    let reason = action.reason(by, &event);
    let (dead, to) = (InboxStatus::DeadLetter, action.target());
    let kind = match action {
        DeadLetterAction::Requeue => {
            if is_closed(c, session)? {
                return Err(DeadLetterAction::closed(session));
            }
            let policy = policy_of(c, event.parent_run_id.as_str())?;
            (InboxRoom::new(session, held(c, session)?, &policy).requeue(id))
                .map_err(Error::QuotaExceeded)?;
            move_events(c, &[id], dead, to, Some(&reason), now)?;
            c.write(
                "UPDATE inbox SET attempts = 0, available_at = ?2, requeued_at = ?2, expires_at = ?3,
                                  lease_run_id = NULL
                 WHERE id = ?1",
                &params![id, now, policy.expires_at(now)],
            )?;
            EventKind::InboxRequeued
        }
        DeadLetterAction::Discard => {
            move_events(c, &[id], dead, to, Some(&reason), now)?;
            EventKind::InboxDiscarded
        }
    };
    let told = EventDraft::new(kind, json!({"events": [id], "by": by}));
    let mut events = insert_events(c, session, None, &[told], now)?;
    let mut enqueued = false;
    if action == DeadLetterAction::Requeue {
        events.extend(serve_if_free(c, session, &mut enqueued, now)?);
    }
    Ok(InboxChange {
        event: inbox_event(c, session, id)?,
        events,
        enqueued,
    })
}

pub(crate) fn list(
    c: &dyn Db,
    session: &SessionId,
    status: Option<InboxStatus>,
    after: i64,
    limit: u32,
) -> Result<Vec<InboxEvent>> {
    let rows = match status {
        None => c.query(
            &format!(
                "SELECT {INBOX_COLUMNS} FROM inbox WHERE session_id = ?1 AND id > ?2 ORDER BY id LIMIT ?3"
            ),
            &params![session.as_str(), after, limit],
        )?,
        Some(status) => c.query(
            &format!(
                "SELECT {INBOX_COLUMNS} FROM inbox WHERE session_id = ?1 AND id > ?2 AND status = ?3 ORDER BY id LIMIT ?4"
            ),
            &params![session.as_str(), after, status.as_str(), limit],
        )?,
    };
    rows.into_iter().map(to_inbox_event).collect()
}

pub(crate) fn emit_signal(
    c: &dyn Db,
    claim: &Claim,
    signal: NewSignal,
    now: Millis,
) -> Result<EmittedSignal> {
    c.lock_session_of_run(claim.run_id.as_str())?;
    fenced(c, claim)?;
    let state = load_state(c, &claim.run_id)?;
    if state.cancel_requested {
        return Err(Error::CancelRequested {
            run_id: claim.run_id.clone(),
        });
    }
    let refused = |why: String| EmittedSignal {
        outcome: SignalOutcome::Refused(why),
        events: Vec::new(),
        enqueued: false,
    };
    let (Some(lineage), Some(contract)) = (&state.lineage, &state.config.signal) else {
        return Ok(refused(
            "only a background run whose agent has a signal contract may send signals".into(),
        ));
    };
    if lineage.background.is_none() {
        return Ok(refused(
            "only a background run may send signals; a foreground run reports in its answer".into(),
        ));
    }
    let duplicate = |id| EmittedSignal {
        outcome: SignalOutcome::Duplicate(id),
        events: Vec::new(),
        enqueued: false,
    };
    if let Some(mut same_call) = c.query_opt(
        "SELECT id FROM inbox WHERE call_key = ?1",
        &params![&signal.call_key],
    )? {
        return Ok(duplicate(same_call.int(0)?));
    }
    let earlier = c
        .query(
            "SELECT id, dedupe_key, created_at FROM inbox WHERE source_run_id = ?1 AND kind = 'signal' ORDER BY id",
            &params![claim.run_id.as_str()],
        )?
        .into_iter()
        .map(|mut r| {
            Ok(EarlierSignal {
                event: r.int(0)?,
                dedupe_key: r.opt_text(1)?.unwrap_or_default(),
                created_at: r.int(2)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    match admit_signal(contract, &earlier, &signal.dedupe_key, now) {
        SignalAdmission::Accept => {}
        SignalAdmission::Duplicate(id) => return Ok(duplicate(id)),
        SignalAdmission::Refuse(why) => return Ok(refused(why)),
    }
    let root = &lineage.root_session_id;
    if is_closed(c, root)? {
        return Ok(refused(signal_to_closed(root)));
    }
    let policy = policy_of(c, lineage.parent_run_id.as_str())?;
    if let Err(why) = InboxRoom::new(root, held(c, root)?, &policy).signal() {
        return Ok(refused(why));
    }
    let payload = to_json(&signal.payload)?;
    if contract.delivery == Delivery::Steer {
        let limits = frozen_config(c, &lineage.parent_run_id)?.steer;
        if let Err(why) = crate::bounds::admit_agent_steer(c, root, &limits, payload.len())? {
            return Ok(refused(signal_not_sent(&why)));
        }
    }
    let id = c
        .query_opt(
            "INSERT INTO inbox (session_id, kind, status, delivery, parent_run_id, source_run_id, payload_json, call_key, dedupe_key, max_attempts, available_at, created_at, updated_at, expires_at)
             VALUES (?1, 'signal', 'pending', ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?9, ?9, ?10) RETURNING id",
            &params![
                root.as_str(),
                contract.delivery.as_str(),
                lineage.parent_run_id.as_str(),
                claim.run_id.as_str(),
                &payload,
                &signal.call_key,
                &signal.dedupe_key,
                policy.max_attempts,
                now,
                policy.expires_at(now)
            ],
        )?
        .ok_or_else(|| Error::Backend("an insert returned no id".into()))?
        .int(0)?;
    let drafts = [
        EventDraft::new(
            EventKind::SignalEmitted,
            json!({"event": id, "source_run_id": claim.run_id, "delivery": contract.delivery, "signal": signal.payload}),
        ),
        EventDraft::new(
            EventKind::InboxPending,
            json!({"event": id, "kind": InboxKind::Signal, "source_run_id": claim.run_id}),
        ),
    ];
    let mut events = insert_events(c, root, None, &drafts, now)?;
    let mut enqueued = false;
    events.extend(serve_if_free(c, root, &mut enqueued, now)?);
    Ok(EmittedSignal {
        outcome: SignalOutcome::Sent(id),
        events,
        enqueued,
    })
}

/// The root session's run reaches a model call: the steered signals waiting for it join its
/// history now, hidden, and are consumed by it — in the commit that reached the boundary.
pub(crate) fn absorb_signals(
    c: &dyn Db,
    state: &AgentState,
    step_index: u64,
    added: &mut Vec<ratchet_core::Message>,
    now: Millis,
) -> Result<Vec<EventDraft>> {
    if state.lineage.is_some() {
        return Ok(Vec::new());
    }
    let waiting = c
        .query(
            "SELECT id, payload_json FROM inbox
             WHERE session_id = ?1 AND status = 'pending' AND delivery = 'steer' ORDER BY id",
            &params![state.session_id.as_str()],
        )?
        .into_iter()
        .map(|mut r| Ok((r.int(0)?, r.text(1)?)))
        .collect::<Result<Vec<_>>>()?;
    if waiting.is_empty() {
        return Ok(Vec::new());
    }
    for (id, payload) in &waiting {
        let payload: serde_json::Value = from_json(payload, "signal payload")?;
        let message = ratchet_core::Message {
            visibility: ratchet_core::Visibility::Hidden,
            origin: ratchet_core::Origin::Steer,
            ..ratchet_core::Message::user(steered_signal(&payload))
        };
        let message_id =
            ratchet_store::step_message_id(&state.run_id, step_index, format!("s{id}"));
        insert_message(c, &message_id, state, &message, now)?;
        added.push(message);
    }
    let ids: Vec<i64> = waiting.iter().map(|(id, _)| *id).collect();
    let consumed = move_events(
        c,
        &ids,
        InboxStatus::Pending,
        InboxStatus::Consumed,
        None,
        now,
    )?;
    for id in &consumed {
        c.execute(
            "UPDATE inbox SET lease_run_id = ?2 WHERE id = ?1",
            &params![*id, state.run_id.as_str()],
        )?;
    }
    Ok(vec![EventDraft::new(
        EventKind::InboxConsumed,
        json!({"events": consumed, "run_id": state.run_id, "steered": true}),
    )])
}

pub(crate) fn pending_input(
    c: &dyn Db,
    session: &SessionId,
    now: Millis,
) -> Result<ratchet_store::PendingInput> {
    let counted = |sql: &str| count(c, sql, &params![session.as_str(), now]);
    Ok(ratchet_store::PendingInput {
        queued_messages: counted(
            "SELECT count(*) FROM runs WHERE session_id = ?1 AND status = 'queued' AND created_at <= ?2",
        )?,
        steers: counted("SELECT count(*) FROM steers WHERE session_id = ?1 AND created_at <= ?2")?,
        inbox_events: counted(
            "SELECT count(*) FROM inbox WHERE session_id = ?1 AND status = 'pending' AND available_at <= ?2",
        )?,
        newest_queued_at: newest(
            c,
            "SELECT max(created_at) FROM runs WHERE session_id = ?1 AND status = 'queued' AND created_at <= ?2",
            session,
            now,
        )?,
        newest_due_at: newest(
            c,
            "SELECT max(available_at) FROM inbox WHERE session_id = ?1 AND status = 'pending' AND available_at <= ?2",
            session,
            now,
        )?,
    })
}

fn newest(c: &dyn Db, sql: &str, session: &SessionId, now: Millis) -> Result<Option<Millis>> {
    match c.query_opt(sql, &params![session.as_str(), now])? {
        Some(mut row) => row.opt_int(0),
        None => Ok(None),
    }
}
