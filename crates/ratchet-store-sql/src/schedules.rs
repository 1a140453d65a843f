//! Schedules: their definitions, and the transaction that decides due slots — one row per
//! slot in `schedule_slots`, each fired slot's run submitted exactly as a message would be,
//! and `next_fire_at` moved on, all under the schedule's row lock. The lock is taken before
//! any session's (a fire locks the sessions it submits to after it), and nothing locks a
//! schedule while holding a session, so the order is always schedule → session.
//!
//! A body here computes no slot time: the caller hands it the slots and the next due time.

use ratchet_core::schedule::{OverlapAction, overlap_action};
use ratchet_core::{
    CatchUp, Millis, Overlap, RunConfigSnapshot, RunId, RunStatus, ScheduleId, ScheduledSlot,
    SessionId, SlotOutcome,
};
use ratchet_store::{
    Cadence, CancelOutcome, DuePass, Effect, Error, FireIds, Fired, NewRun, NewSchedule,
    RequestMark, RunQuota, Schedule, ScheduleChange, ScheduleSlot, ScheduleSpec, SessionSpec,
    SlotCursor, WhenBusy, catch_up_reason, overlap_reason,
};
use serde_json::json;

use crate::db::{Db, Row};
use crate::rows::{from_json, parse_run_id, parse_session_id, parse_status, to_json};
use crate::runs::{load_state, request_cancel};
use crate::{Result, params};

const SCHEDULE_COLUMNS: &str = "id, tenant, agent, message, cron, timezone, every_ms, session_id,
     overlap, catch_up, paused, next_fire_at, last_slot, last_run_id, created_at, updated_at";

fn parse_schedule_id(text: &str) -> Result<ScheduleId> {
    ScheduleId::parse(text).map_err(crate::rows::corrupt)
}

fn not_found(id: &ScheduleId) -> Error {
    Error::NotFound {
        kind: "schedule",
        id: id.to_string(),
    }
}

fn to_schedule(mut r: Row) -> Result<Schedule> {
    let id = parse_schedule_id(&r.text(0)?)?;
    let tenant = r.text(1)?;
    let agent = r.opt_text(2)?;
    let message = r.text(3)?;
    let cadence = match (r.opt_text(4)?, r.opt_text(5)?, r.opt_int(6)?) {
        (Some(expression), timezone, None) => Cadence::Cron {
            expression,
            timezone,
        },
        (None, None, Some(ms)) if ms > 0 => Cadence::Every { ms: ms as u64 },
        other => {
            return Err(Error::Corrupt(format!(
                "schedule {id} has neither a cron expression nor an interval: {other:?}"
            )));
        }
    };
    let session = r
        .opt_text(7)?
        .as_deref()
        .map(parse_session_id)
        .transpose()?;
    let overlap = r.text(8)?;
    let catch_up = r.text(9)?;
    let spec = ScheduleSpec {
        agent,
        message,
        cadence,
        session,
        overlap: Overlap::parse(&overlap)
            .ok_or_else(|| Error::Corrupt(format!("unknown overlap {overlap:?}")))?,
        catch_up: CatchUp::parse(&catch_up)
            .ok_or_else(|| Error::Corrupt(format!("unknown catch_up {catch_up:?}")))?,
        paused: r.flag(10)?,
    };
    Ok(Schedule {
        id,
        tenant,
        spec,
        next_fire_at: r.int(11)?,
        last_slot: r.opt_int(12)?,
        last_run_id: r.opt_text(13)?.as_deref().map(parse_run_id).transpose()?,
        created_at: r.int(14)?,
        updated_at: r.int(15)?,
    })
}

/// The cadence as its three columns: cron, timezone, every_ms.
fn cadence_columns(cadence: &Cadence) -> (Option<&str>, Option<&str>, Option<i64>) {
    match cadence {
        Cadence::Cron {
            expression,
            timezone,
        } => (Some(expression), timezone.as_deref(), None),
        Cadence::Every { ms } => (None, None, Some(*ms as i64)),
    }
}

/// Stores a configuration in `run_configs` (once for every schedule and run frozen with it)
/// and returns its id.
fn store_config(c: &dyn Db, config: &RunConfigSnapshot) -> Result<String> {
    let encoded = to_json(config)?;
    let id = crate::queue::config_id(&encoded);
    c.write(
        "INSERT INTO run_configs (id, config_json) VALUES (?1, ?2) ON CONFLICT (id) DO NOTHING",
        &params![&id, &encoded],
    )?;
    Ok(id)
}

pub(crate) fn get_schedule(c: &dyn Db, id: &ScheduleId) -> Result<Schedule> {
    c.query_opt(
        &format!("SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE id = ?1 AND deleted_at IS NULL"),
        &params![id.as_str()],
    )?
    .map(to_schedule)
    .transpose()?
    .ok_or_else(|| not_found(id))
}

/// The schedule's row, held until the transaction ends; None when it is missing or deleted.
fn lock_schedule(c: &dyn Db, id: &ScheduleId) -> Result<Option<Schedule>> {
    c.query_opt(
        &format!(
            "SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE id = ?1 AND deleted_at IS NULL{}",
            c.for_update()
        ),
        &params![id.as_str()],
    )?
    .map(to_schedule)
    .transpose()
}

pub(crate) fn schedules(
    c: &dyn Db,
    tenant: &str,
    after: Option<&ScheduleId>,
    limit: u32,
) -> Result<Vec<Schedule>> {
    c.query(
        &format!(
            "SELECT {SCHEDULE_COLUMNS} FROM schedules
             WHERE tenant = ?1 AND deleted_at IS NULL AND id > ?2 ORDER BY id LIMIT ?3"
        ),
        &params![tenant, after.map_or("", |a| a.as_str()), limit],
    )?
    .into_iter()
    .map(to_schedule)
    .collect()
}

pub(crate) fn due_schedules(c: &dyn Db, now: Millis, limit: u32) -> Result<Vec<Schedule>> {
    c.query(
        &format!(
            "SELECT {SCHEDULE_COLUMNS} FROM schedules
             WHERE paused = 0 AND deleted_at IS NULL AND next_fire_at <= ?1
             ORDER BY next_fire_at, id LIMIT ?2"
        ),
        &params![now, limit],
    )?
    .into_iter()
    .map(to_schedule)
    .collect()
}

pub(crate) fn next_schedule_fire(c: &dyn Db) -> Result<Option<Millis>> {
    match c.query_opt(
        "SELECT min(next_fire_at) FROM schedules WHERE paused = 0 AND deleted_at IS NULL",
        &[],
    )? {
        Some(mut row) => row.opt_int(0),
        None => Ok(None),
    }
}

pub(crate) fn schedule_slots(
    c: &dyn Db,
    id: &ScheduleId,
    before: Option<SlotCursor>,
    limit: u32,
) -> Result<Vec<ScheduleSlot>> {
    let (slot, manual) = before.map_or((Millis::MAX, 2), |b| (b.slot, i64::from(b.manual)));
    c.query(
        "SELECT s.schedule_id, s.slot, s.through_slot, s.manual, s.outcome, s.run_id,
                s.session_id, r.status, s.reason, s.decided_at
         FROM schedule_slots s LEFT JOIN runs r ON r.id = s.run_id
         WHERE s.schedule_id = ?1 AND (s.slot < ?2 OR (s.slot = ?2 AND s.manual < ?3))
         ORDER BY s.slot DESC, s.manual DESC LIMIT ?4",
        &params![id.as_str(), slot, manual, limit],
    )?
    .into_iter()
    .map(|mut r| {
        let outcome = r.text(4)?;
        Ok(ScheduleSlot {
            schedule_id: parse_schedule_id(&r.text(0)?)?,
            slot: r.int(1)?,
            through: r.int(2)?,
            manual: r.flag(3)?,
            outcome: SlotOutcome::parse(&outcome)
                .ok_or_else(|| Error::Corrupt(format!("unknown slot outcome {outcome:?}")))?,
            run_id: r.opt_text(5)?.as_deref().map(parse_run_id).transpose()?,
            session_id: r
                .opt_text(6)?
                .as_deref()
                .map(parse_session_id)
                .transpose()?,
            run_status: r.opt_text(7)?.as_deref().map(parse_status).transpose()?,
            reason: r.opt_text(8)?,
            decided_at: r.int(9)?,
        })
    })
    .collect()
}

pub(crate) fn create_schedule(c: &dyn Db, new: NewSchedule, now: Millis) -> Result<Schedule> {
    let frozen = store_config(c, &new.config)?;
    let spec = &new.spec;
    let (cron, timezone, every_ms) = cadence_columns(&spec.cadence);
    let inserted = c.execute(
        "INSERT INTO schedules (id, tenant, agent, message, cron, timezone, every_ms, session_id,
             overlap, catch_up, paused, run_config, next_fire_at, created_at, updated_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?14)
         ON CONFLICT (id) DO NOTHING",
        &params![
            new.id.as_str(),
            &new.tenant,
            &spec.agent,
            &spec.message,
            cron,
            timezone,
            every_ms,
            spec.session.as_ref().map(SessionId::as_str),
            spec.overlap.as_str(),
            spec.catch_up.as_str(),
            spec.paused,
            &frozen,
            new.next_fire_at,
            now
        ],
    )?;
    if inserted == 0 {
        return Err(Error::Conflict(format!(
            "schedule {} already exists",
            new.id
        )));
    }
    if let Some(mark) = &new.request {
        let effect = Effect::ScheduleCreated {
            schedule_id: new.id.clone(),
        };
        crate::requests::record_effect(c, mark, &effect)?;
    }
    get_schedule(c, &new.id)
}

pub(crate) fn update_schedule(
    c: &dyn Db,
    id: &ScheduleId,
    change: ScheduleChange,
    now: Millis,
) -> Result<Schedule> {
    lock_schedule(c, id)?.ok_or_else(|| not_found(id))?;
    let frozen = store_config(c, &change.config)?;
    let spec = &change.spec;
    let (cron, timezone, every_ms) = cadence_columns(&spec.cadence);
    c.execute(
        "UPDATE schedules SET agent = ?2, message = ?3, cron = ?4, timezone = ?5, every_ms = ?6,
             session_id = ?7, overlap = ?8, catch_up = ?9, paused = ?10, run_config = ?11,
             next_fire_at = COALESCE(?12, next_fire_at), updated_at = ?13
         WHERE id = ?1",
        &params![
            id.as_str(),
            &spec.agent,
            &spec.message,
            cron,
            timezone,
            every_ms,
            spec.session.as_ref().map(SessionId::as_str),
            spec.overlap.as_str(),
            spec.catch_up.as_str(),
            spec.paused,
            &frozen,
            change.next_fire_at,
            now
        ],
    )?;
    get_schedule(c, id)
}

pub(crate) fn set_schedule_paused(
    c: &dyn Db,
    id: &ScheduleId,
    paused: bool,
    next_fire_at: Option<Millis>,
    now: Millis,
) -> Result<Schedule> {
    lock_schedule(c, id)?.ok_or_else(|| not_found(id))?;
    c.execute(
        "UPDATE schedules SET paused = ?2, next_fire_at = COALESCE(?3, next_fire_at), updated_at = ?4
         WHERE id = ?1",
        &params![id.as_str(), paused, next_fire_at, now],
    )?;
    get_schedule(c, id)
}

pub(crate) fn delete_schedule(c: &dyn Db, id: &ScheduleId, now: Millis) -> Result<()> {
    let deleted = c.execute(
        "UPDATE schedules SET deleted_at = ?2, updated_at = ?2 WHERE id = ?1 AND deleted_at IS NULL",
        &params![id.as_str(), now],
    )?;
    if deleted == 0 {
        return Err(not_found(id));
    }
    Ok(())
}

/// The configuration the schedule's runs are frozen with.
fn schedule_config(c: &dyn Db, id: &ScheduleId) -> Result<RunConfigSnapshot> {
    let json = c
        .query_opt(
            "SELECT c.config_json FROM schedules s JOIN run_configs c ON c.id = s.run_config
             WHERE s.id = ?1",
            &params![id.as_str()],
        )?
        .ok_or_else(|| not_found(id))?
        .text(0)?;
    from_json(&json, "schedule config")
}

pub(crate) fn fire_schedule(
    c: &dyn Db,
    id: &ScheduleId,
    pass: DuePass,
    quota: RunQuota,
    now: Millis,
) -> Result<Fired> {
    let stale = Fired {
        stale: true,
        ..Fired::default()
    };
    let Some(schedule) = lock_schedule(c, id)? else {
        return Ok(stale);
    };
    if schedule.spec.paused || schedule.next_fire_at != pass.expected_next {
        return Ok(stale);
    }
    if let (Some(first), Some(last)) = (pass.slots.first(), pass.slots.last()) {
        let decided = crate::rows::count(
            c,
            "SELECT count(*) FROM schedule_slots
             WHERE schedule_id = ?1 AND manual = 0 AND slot >= ?2 AND slot <= ?3",
            &params![id.as_str(), first.plan.slot, last.plan.through],
        )?;
        if decided > 0 {
            return Ok(stale);
        }
    }
    let config = schedule_config(c, id)?;
    let mut firing = Firing {
        schedule: &schedule,
        config: &config,
        last_run: schedule.last_run_id.clone(),
        quota,
        fired: Fired::default(),
        now,
    };
    let mut last_slot = schedule.last_slot;
    for planned in &pass.slots {
        let plan = planned.plan;
        last_slot = Some(plan.through.max(last_slot.unwrap_or(Millis::MIN)));
        if plan.fire {
            firing.fire(c, plan.slot, false, &planned.ids)?;
        } else {
            let range = plan.through != plan.slot;
            firing.record(
                c,
                Decided {
                    slot: plan.slot,
                    through: plan.through,
                    manual: false,
                    outcome: SlotOutcome::SkippedCatchUp,
                    run: None,
                    reason: Some(catch_up_reason(schedule.spec.catch_up, range)),
                },
            )?;
        }
    }
    c.write(
        "UPDATE schedules SET next_fire_at = ?2, last_slot = ?3, last_run_id = ?4 WHERE id = ?1",
        &params![
            id.as_str(),
            pass.next_fire_at,
            last_slot,
            firing.last_run.as_ref().map(RunId::as_str)
        ],
    )?;
    Ok(firing.fired)
}

pub(crate) fn trigger_schedule(
    c: &dyn Db,
    id: &ScheduleId,
    ids: FireIds,
    quota: RunQuota,
    request: Option<&RequestMark>,
    now: Millis,
) -> Result<Fired> {
    let schedule = lock_schedule(c, id)?.ok_or_else(|| not_found(id))?;
    let repeated = crate::rows::count(
        c,
        "SELECT count(*) FROM schedule_slots WHERE schedule_id = ?1 AND manual = 1 AND slot = ?2",
        &params![id.as_str(), now],
    )?;
    if repeated > 0 {
        return Err(Error::Conflict(format!(
            "schedule {id} was already triggered at {now} (ms since the epoch); try again"
        )));
    }
    let config = schedule_config(c, id)?;
    let mut firing = Firing {
        schedule: &schedule,
        config: &config,
        last_run: schedule.last_run_id.clone(),
        quota,
        fired: Fired::default(),
        now,
    };
    firing.fire(c, now, true, &ids)?;
    c.write(
        "UPDATE schedules SET last_run_id = ?2 WHERE id = ?1",
        &params![id.as_str(), firing.last_run.as_ref().map(RunId::as_str)],
    )?;
    if let Some(mark) = request {
        let effect = Effect::ScheduleTriggered {
            schedule_id: id.clone(),
            slot: now,
        };
        crate::requests::record_effect(c, mark, &effect)?;
    }
    Ok(firing.fired)
}

/// A slot as decided, before its row is written.
struct Decided {
    slot: Millis,
    through: Millis,
    manual: bool,
    outcome: SlotOutcome,
    run: Option<(RunId, SessionId, RunStatus)>,
    reason: Option<String>,
}

/// One transaction's firing of a schedule's slots: what it has done so far, and the run each
/// next slot's `overlap` looks at.
struct Firing<'a> {
    schedule: &'a Schedule,
    config: &'a RunConfigSnapshot,
    last_run: Option<RunId>,
    quota: RunQuota,
    fired: Fired,
    now: Millis,
}

impl Firing<'_> {
    /// Fires one slot as `overlap` says against the previous run: skipped, or submitted (after
    /// a cancel of the previous run under `cancel_previous`) as a message would be.
    fn fire(&mut self, c: &dyn Db, slot: Millis, manual: bool, ids: &FireIds) -> Result<()> {
        let previous = match &self.last_run {
            Some(run) => c
                .query_opt(
                    "SELECT status FROM runs WHERE id = ?1",
                    &params![run.as_str()],
                )?
                .map(|mut r| r.text(0))
                .transpose()?
                .as_deref()
                .map(parse_status)
                .transpose()?
                .map(|status| (run.clone(), status)),
            None => None,
        };
        let skipped = |reason| Decided {
            slot,
            through: slot,
            manual,
            outcome: SlotOutcome::SkippedOverlap,
            run: None,
            reason: Some(reason),
        };
        match (
            overlap_action(self.schedule.spec.overlap, previous.as_ref().map(|p| p.1)),
            previous,
        ) {
            (OverlapAction::Skip, Some((run, status))) => {
                return self.record(c, skipped(overlap_reason(&run, status)));
            }
            (OverlapAction::CancelPreviousThenFire, Some((run, _))) => {
                match request_cancel(c, &run, self.now)? {
                    CancelOutcome::Cancelled { events, enqueued } => {
                        self.fired.events.extend(events);
                        self.fired.enqueued |= enqueued;
                    }
                    CancelOutcome::Cancelling { events } => self.fired.events.extend(events),
                    CancelOutcome::AlreadyTerminal(_) => {}
                }
            }
            _ => {}
        }
        let refused = |reason: String| Decided {
            slot,
            through: slot,
            manual,
            outcome: SlotOutcome::Refused,
            run: None,
            reason: Some(reason),
        };
        let session_id = match &self.schedule.spec.session {
            Some(session) => session.clone(),
            None => {
                // Counted before the session exists, so that a refusal leaves none behind.
                if let Err(error) = crate::queue::check_quota(c, &ids.session_id, self.quota, 1) {
                    return match error {
                        Error::QuotaExceeded(reason) => self.record(c, refused(reason)),
                        other => Err(other),
                    };
                }
                let spec = SessionSpec {
                    tenant: self.schedule.tenant.clone(),
                    agent: self.schedule.spec.agent.clone(),
                    metadata: Some(json!({"schedule_id": self.schedule.id})),
                    request: None,
                };
                crate::sessions::create_session(c, &ids.session_id, spec, self.now)?;
                ids.session_id.clone()
            }
        };
        let new = NewRun {
            session_id: session_id.clone(),
            run_id: ids.run_id.clone(),
            message_id: ids.message_id.clone(),
            content: self.schedule.spec.message.clone(),
            config: self.config.clone(),
            when_busy: WhenBusy::Enqueue,
            quota: self.quota,
            trace: None,
            request: None,
        };
        let submitted = match crate::queue::submit_message(c, new, self.now) {
            Ok(submitted) => submitted,
            // Refused as the message would be; nothing of the run was written.
            Err(
                error @ (Error::QuotaExceeded(_)
                | Error::Conflict(_)
                | Error::NotFound { .. }
                | Error::Invalid(_)),
            ) => return self.record(c, refused(error.to_string())),
            Err(other) => return Err(other),
        };
        self.fired.events.extend(submitted.events);
        self.fired.enqueued |= submitted.status == RunStatus::Running;
        let mut state = load_state(c, &ids.run_id)?;
        state.schedule = Some(ScheduledSlot {
            schedule_id: self.schedule.id.clone(),
            slot,
            manual,
        });
        c.write(
            "UPDATE runs SET schedule_id = ?2, schedule_slot = ?3, state_json = ?4 WHERE id = ?1",
            &params![
                ids.run_id.as_str(),
                self.schedule.id.as_str(),
                slot,
                &to_json(&state)?
            ],
        )?;
        self.last_run = Some(ids.run_id.clone());
        self.record(
            c,
            Decided {
                slot,
                through: slot,
                manual,
                outcome: SlotOutcome::Fired,
                run: Some((ids.run_id.clone(), session_id, submitted.status)),
                reason: None,
            },
        )
    }

    /// Writes a decided slot's row; the primary key refuses a second decision of the slot.
    fn record(&mut self, c: &dyn Db, decided: Decided) -> Result<()> {
        let (run_id, session_id, run_status) = match decided.run {
            Some((run, session, status)) => (Some(run), Some(session), Some(status)),
            None => (None, None, None),
        };
        c.write(
            "INSERT INTO schedule_slots (schedule_id, manual, slot, through_slot, outcome, run_id,
                 session_id, reason, decided_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            &params![
                self.schedule.id.as_str(),
                decided.manual,
                decided.slot,
                decided.through,
                decided.outcome.as_str(),
                run_id.as_ref().map(RunId::as_str),
                session_id.as_ref().map(SessionId::as_str),
                &decided.reason,
                self.now
            ],
        )?;
        self.fired.slots.push(ScheduleSlot {
            schedule_id: self.schedule.id.clone(),
            slot: decided.slot,
            through: decided.through,
            manual: decided.manual,
            outcome: decided.outcome,
            run_id,
            session_id,
            run_status,
            reason: decided.reason,
            decided_at: self.now,
        });
        Ok(())
    }
}
