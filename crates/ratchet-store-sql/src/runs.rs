//! A run past its start: its state and frozen config read and written, its end (`run_ended`),
//! waiting runs timed out, cancel, pause and resume, reconciliation, resuming a failed run, and
//! the run listings and counts.

use ratchet_core::delegation::{ChildResult, child_finished, join_children};
use ratchet_core::step::{Reconciliation, Resumption, cancel_idle};
use ratchet_core::{
    AgentState, EventDraft, EventKind, Millis, Phase, RunConfigSnapshot, RunId, RunStatus,
    ScheduleId, SessionId, StopReason,
};
use ratchet_store::{
    CancelOutcome, Effect, Error, PauseOutcome, Reconciled, RequestMark, ResumeOutcome, RunSummary,
    StoreStats, StoredEvent, TimedOut,
};
use serde_json::json;

use crate::db::{Db, Row, StoredConfig};
use crate::delegation::{children_results, unfinished_foreground_children};
use crate::events::insert_events;
use crate::queue::{ACTIVE_STATUSES, absorb_steers, release_session};
use crate::rows::{
    count, from_json, parse_run_id, parse_session_id, parse_status, run_not_found, sql_enum,
    to_json,
};
use crate::sessions::get_session;
use crate::steps::{insert_job, insert_job_ready_at};
use crate::{Result, params};

/// Locks the session a run belongs to (see the crate's doc).
pub(crate) fn lock_session_of_run(c: &dyn Db, run_id: &RunId) -> Result<()> {
    c.lock_session_of_run(run_id.as_str())
}

/// A run has just ended (its terminal state written): its session's queue moves on, and — if
/// it is a child — its parent hears of it and, when this was the last of the children it
/// waits for, is joined: running again with every child's result, its next job enqueued.
pub(crate) fn run_ended(
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

pub(crate) fn write_state(c: &dyn Db, state: &AgentState) -> Result<()> {
    write_encoded_state(c, None, state, &to_json(state)?)
}

/// `write_state` with the state's JSON encoded already, for a run whose stored status is
/// `was` when known. A step of a run that stays running changes only its step and state: its
/// indexed columns (status, deadline) are left alone, so no index of `runs` is rewritten. The
/// full update below is the only writer of a run's status, and it leaves a running run's stop
/// reason, end and deadline empty, so there is nothing else to keep true.
pub(crate) fn write_encoded_state(
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
        RunStatus::WaitingHuman | RunStatus::WaitingChildren | RunStatus::WaitingTimer
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
    // A run's end closes the approvals it still waited on: a continue cannot revive them.
    if state.status.is_terminal() {
        c.execute(
            "UPDATE approvals SET status = 'cancelled', decided_at = ?2 WHERE run_id = ?1 AND status = 'pending'",
            &params![state.run_id.as_str(), state.finished_at],
        )?;
    }
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
        RunStatus::WaitingHuman | RunStatus::WaitingChildren | RunStatus::WaitingTimer
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

pub(crate) struct RunRow {
    pub(crate) session_id: SessionId,
    pub(crate) status: RunStatus,
    pub(crate) step_index: u64,
    pub(crate) cancel_requested: bool,
    pub(crate) pause_requested: bool,
}

pub(crate) fn run_row(c: &dyn Db, run_id: &RunId) -> Result<RunRow> {
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

pub(crate) fn request_cancel(c: &dyn Db, run_id: &RunId, now: Millis) -> Result<CancelOutcome> {
    lock_session_of_run(c, run_id)?;
    let mut outcome = cancel_one(c, run_id, now)?;
    let children = unfinished_foreground_children(c, run_id)?;
    for child in children {
        outcome.absorb(request_cancel(c, &child, now)?);
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
        // A run waiting on a timer has a job, but the step it runs has no effect outside the
        // store: even while a worker holds it, the run ends now and that step's commit finds
        // its job gone.
        RunStatus::Queued
        | RunStatus::WaitingHuman
        | RunStatus::WaitingChildren
        | RunStatus::WaitingTimer
        | RunStatus::Paused => {
            let held_session = stored.status != RunStatus::Queued;
            let (drafts, closing) = cancel_idle(&mut state, now);
            mark_cancel_requested(c, run_id)?;
            write_state(c, &state)?;
            // The closed batch's results come after the run's last step.
            for (slot, message) in closing.iter().enumerate() {
                let id = ratchet_store::step_message_id(run_id, state.step_index + 1, slot);
                crate::sessions::insert_message(c, &id, &state, message, now)?;
            }
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
        RunStatus::WaitingTimer => {
            return pause_waiting(c, run_id, &stored.session_id, now)
                .map(|events| PauseOutcome::Paused { events });
        }
        status => {
            return Err(Error::Conflict(format!(
                "run {run_id} is {status}; only a running run can be paused (or one waiting on a timer)"
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
pub(crate) fn pause_if_unclaimed(
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

/// A run waiting on a timer pauses at once, keeping its due time; its job goes. The step of
/// that job has no effect outside the store, so it goes even when a worker holds it (whose
/// commit then finds it gone).
fn pause_waiting(
    c: &dyn Db,
    run_id: &RunId,
    session_id: &SessionId,
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    c.execute(
        "DELETE FROM step_jobs WHERE run_id = ?1",
        &params![run_id.as_str()],
    )?;
    let mut state = load_state(c, run_id)?;
    let drafts = ratchet_core::step::pause_idle(&mut state, Phase::WaitEnded, now)?;
    write_state(c, &state)?;
    set_pause_requested(c, run_id, false)?;
    insert_events(c, session_id, Some(run_id), &drafts, now)
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
    insert_job_ready_at(c, &job, ratchet_core::timer::job_ready_at(&state, now))?;
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

pub(crate) fn set_pause_requested(c: &dyn Db, run_id: &RunId, requested: bool) -> Result<()> {
    c.write(
        "UPDATE runs SET pause_requested = ?2 WHERE id = ?1",
        &params![run_id.as_str(), i64::from(requested)],
    )?;
    Ok(())
}

pub(crate) fn mark_cancel_requested(c: &dyn Db, run_id: &RunId) -> Result<()> {
    c.execute(
        "UPDATE runs SET cancel_requested = 1 WHERE id = ?1",
        &params![run_id.as_str()],
    )?;
    Ok(())
}

/// The `traceparent` of `run_id`'s span, read from its state's trace context alone.
pub(crate) fn run_traceparent(c: &dyn Db, run_id: &RunId) -> Result<String> {
    #[derive(serde::Deserialize)]
    struct TraceOnly {
        #[serde(default)]
        trace: Option<ratchet_core::TraceContext>,
    }
    let mut row = c
        .query_opt(
            "SELECT state_json FROM runs WHERE id = ?1",
            &params![run_id.as_str()],
        )?
        .ok_or_else(|| run_not_found(run_id))?;
    let stored: TraceOnly = from_json(&row.text(0)?, "run state")?;
    Ok(ratchet_core::trace::run_traceparent(
        run_id,
        stored.trace.as_ref(),
    ))
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

const RUN_COLUMNS: &str =
    "id, session_id, status, stop_reason, step_index, created_at, finished_at,
     forked_from_run_id, forked_from_step, schedule_id, schedule_slot";

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
        forked_from: match (r.opt_text(7)?, r.opt_int(8)?) {
            (Some(run_id), Some(step)) => Some(ratchet_core::ForkedFrom {
                run_id: parse_run_id(&run_id)?,
                step: step as u64,
            }),
            _ => None,
        },
        schedule_id: (r.opt_text(9)?)
            .map(|id| ScheduleId::parse(&id).map_err(crate::rows::corrupt))
            .transpose()?,
        slot: r.opt_int(10)?,
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
    request: Option<RequestMark>,
    now: Millis,
) -> Result<Vec<StoredEvent>> {
    lock_session_of_run(c, run_id)?;
    let mut state = load_state(c, run_id)?;
    ratchet_core::step::may_resume_failed(&state).map_err(Error::Conflict)?;
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
    if let Some(mark) = &request {
        let effect = Effect::Resumed {
            run_id: run_id.clone(),
        };
        crate::requests::record_effect(c, mark, &effect)?;
    }
    insert_events(c, &state.session_id, Some(run_id), &drafts, now)
}
