//! Durable timers in the store: a run parked on a `wait` call has one job, ready at its due
//! time, and input for its session — a message, a steer, a report or a signal of background
//! work — makes that job ready now, in the transaction that brought the input. The decision
//! (whether the wait ends, and what it says) is `ratchet_core::timer`'s; this only reads,
//! writes and moves the job.

use ratchet_core::timer::{job_ready_at, wake_by_input};
use ratchet_core::{Millis, RunId, RunStatus, SessionId};

use crate::db::{Announcement, Db};
use crate::rows::parse_run_id;
use crate::runs::{load_state, write_state};
use crate::{Result, params};

/// Input arrived for `session` (the caller holds its lock): its active run, if it waits on a
/// timer that has not ended (or is paused while it does), wakes. Returns the run woken; its
/// job is ready now (a paused run's job is written when it is resumed).
pub(crate) fn wake_on_input(c: &dyn Db, session: &SessionId, now: Millis) -> Result<Option<RunId>> {
    let Some(mut row) = c.query_opt(
        "SELECT r.id FROM sessions s JOIN runs r ON r.id = s.active_run_id
         WHERE s.id = ?1 AND r.status IN ('waiting_timer', 'paused')",
        &params![session.as_str()],
    )?
    else {
        return Ok(None);
    };
    let run_id = parse_run_id(&row.text(0)?)?;
    let mut state = load_state(c, &run_id)?;
    if !wake_by_input(&mut state, now) {
        return Ok(None);
    }
    write_state(c, &state)?;
    if state.status == RunStatus::WaitingTimer {
        ready_now(c, &run_id, job_ready_at(&state, now))?;
    }
    Ok(Some(run_id))
}

/// Brings the run's unclaimed job forward to `at`.
fn ready_now(c: &dyn Db, run_id: &RunId, at: Millis) -> Result<()> {
    let moved = c.execute(
        "UPDATE step_jobs SET ready_at = ?2 WHERE run_id = ?1 AND lease_owner IS NULL AND ready_at > ?2",
        &params![run_id.as_str(), at],
    )?;
    if moved > 0 {
        c.announce(Announcement::JobsReady)?;
    }
    Ok(())
}
