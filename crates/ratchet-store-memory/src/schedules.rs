//! Schedules: their definitions and the write that decides due slots — a row per slot, each
//! fired slot's run submitted as a message would be, `next_fire_at` moved on — refusing and
//! reporting exactly what the SQL backends do (`ratchet-store-sql`'s `schedules.rs`).

use ratchet_core::schedule::{OverlapAction, overlap_action};
use ratchet_core::{
    Millis, RunConfigSnapshot, RunId, RunStatus, ScheduleId, ScheduledSlot, SessionId, SlotOutcome,
};
use ratchet_store::{
    CancelOutcome, DuePass, Error, FireIds, Fired, NewRun, NewSchedule, Result, RunQuota, Schedule,
    ScheduleChange, ScheduleSlot, SessionSpec, SlotCursor, WhenBusy, catch_up_reason,
    overlap_reason,
};
use serde_json::json;

use crate::tables::Tables;

#[derive(Debug, Clone)]
pub(crate) struct ScheduleRow {
    pub(crate) schedule: Schedule,
    pub(crate) config: RunConfigSnapshot,
    pub(crate) deleted_at: Option<Millis>,
}

#[derive(Debug, Clone)]
pub(crate) struct SlotRow {
    pub(crate) through: Millis,
    pub(crate) outcome: SlotOutcome,
    pub(crate) run_id: Option<RunId>,
    pub(crate) session_id: Option<SessionId>,
    pub(crate) reason: Option<String>,
    pub(crate) decided_at: Millis,
}

fn not_found(id: &ScheduleId) -> Error {
    Error::NotFound {
        kind: "schedule",
        id: id.to_string(),
    }
}

impl Tables {
    fn live_schedule(&self, id: &ScheduleId) -> Option<&ScheduleRow> {
        self.schedules
            .get(id)
            .filter(|row| row.deleted_at.is_none())
    }

    fn live_schedule_mut(&mut self, id: &ScheduleId) -> Result<&mut ScheduleRow> {
        (self.schedules.get_mut(id))
            .filter(|row| row.deleted_at.is_none())
            .ok_or_else(|| not_found(id))
    }

    pub(crate) fn get_schedule(&self, id: &ScheduleId) -> Result<Schedule> {
        (self.live_schedule(id))
            .map(|row| row.schedule.clone())
            .ok_or_else(|| not_found(id))
    }

    pub(crate) fn list_schedules(
        &self,
        tenant: &str,
        after: Option<&ScheduleId>,
        limit: u32,
    ) -> Vec<Schedule> {
        (self.schedules.iter())
            .filter(|(id, row)| {
                row.deleted_at.is_none()
                    && row.schedule.tenant == tenant
                    && after.is_none_or(|a| *id > a)
            })
            .take(limit as usize)
            .map(|(_, row)| row.schedule.clone())
            .collect()
    }

    fn active_schedules(&self) -> impl Iterator<Item = &Schedule> {
        (self.schedules.values())
            .filter(|row| row.deleted_at.is_none() && !row.schedule.spec.paused)
            .map(|row| &row.schedule)
    }

    pub(crate) fn due_schedules(&self, now: Millis, limit: u32) -> Vec<Schedule> {
        let mut due: Vec<&Schedule> = (self.active_schedules())
            .filter(|s| s.next_fire_at <= now)
            .collect();
        due.sort_by(|a, b| (a.next_fire_at, &a.id).cmp(&(b.next_fire_at, &b.id)));
        due.into_iter().take(limit as usize).cloned().collect()
    }

    pub(crate) fn next_schedule_fire(&self) -> Option<Millis> {
        self.active_schedules().map(|s| s.next_fire_at).min()
    }

    pub(crate) fn schedule_slots(
        &self,
        id: &ScheduleId,
        before: Option<SlotCursor>,
        limit: u32,
    ) -> Vec<ScheduleSlot> {
        let before = before.map(|b| (b.slot, b.manual));
        let mut slots: Vec<ScheduleSlot> = (self.schedule_slots.iter())
            .filter(|((schedule, manual, slot), _)| {
                schedule == id && before.is_none_or(|b| (*slot, *manual) < b)
            })
            .map(|((schedule, manual, slot), row)| ScheduleSlot {
                schedule_id: schedule.clone(),
                slot: *slot,
                through: row.through,
                manual: *manual,
                outcome: row.outcome,
                run_id: row.run_id.clone(),
                session_id: row.session_id.clone(),
                run_status: (row.run_id.as_ref())
                    .and_then(|run| self.runs.get(run))
                    .map(|run| run.status()),
                reason: row.reason.clone(),
                decided_at: row.decided_at,
            })
            .collect();
        slots.sort_by_key(|s| std::cmp::Reverse((s.slot, s.manual)));
        slots.truncate(limit as usize);
        slots
    }

    pub(crate) fn create_schedule(&mut self, new: NewSchedule, now: Millis) -> Result<Schedule> {
        if self.schedules.contains_key(&new.id) {
            return Err(Error::Conflict(format!(
                "schedule {} already exists",
                new.id
            )));
        }
        let schedule = Schedule {
            id: new.id.clone(),
            tenant: new.tenant,
            spec: new.spec,
            next_fire_at: new.next_fire_at,
            last_slot: None,
            last_run_id: None,
            created_at: now,
            updated_at: now,
        };
        self.schedules.insert(
            new.id,
            ScheduleRow {
                schedule: schedule.clone(),
                config: new.config,
                deleted_at: None,
            },
        );
        Ok(schedule)
    }

    pub(crate) fn update_schedule(
        &mut self,
        id: &ScheduleId,
        change: ScheduleChange,
        now: Millis,
    ) -> Result<Schedule> {
        let row = self.live_schedule_mut(id)?;
        row.schedule.spec = change.spec;
        row.config = change.config;
        if let Some(next) = change.next_fire_at {
            row.schedule.next_fire_at = next;
        }
        row.schedule.updated_at = now;
        Ok(row.schedule.clone())
    }

    pub(crate) fn set_schedule_paused(
        &mut self,
        id: &ScheduleId,
        paused: bool,
        next_fire_at: Option<Millis>,
        now: Millis,
    ) -> Result<Schedule> {
        let row = self.live_schedule_mut(id)?;
        row.schedule.spec.paused = paused;
        if let Some(next) = next_fire_at {
            row.schedule.next_fire_at = next;
        }
        row.schedule.updated_at = now;
        Ok(row.schedule.clone())
    }

    pub(crate) fn delete_schedule(&mut self, id: &ScheduleId, now: Millis) -> Result<()> {
        let row = self.live_schedule_mut(id)?;
        row.deleted_at = Some(now);
        row.schedule.updated_at = now;
        Ok(())
    }

    pub(crate) fn fire_schedule(
        &mut self,
        id: &ScheduleId,
        pass: DuePass,
        quota: RunQuota,
        now: Millis,
    ) -> Result<Fired> {
        let stale = Fired {
            stale: true,
            ..Fired::default()
        };
        let Some(row) = self.live_schedule(id) else {
            return Ok(stale);
        };
        let (schedule, config) = (row.schedule.clone(), row.config.clone());
        if schedule.spec.paused || schedule.next_fire_at != pass.expected_next {
            return Ok(stale);
        }
        if let (Some(first), Some(last)) = (pass.slots.first(), pass.slots.last()) {
            let (from, to) = (first.plan.slot, last.plan.through);
            let decided = (self.schedule_slots.keys())
                .any(|(s, manual, slot)| s == id && !manual && (from..=to).contains(slot));
            if decided {
                return Ok(stale);
            }
        }
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
                firing.fire(self, plan.slot, false, &planned.ids)?;
            } else {
                let reason = catch_up_reason(schedule.spec.catch_up, plan.through != plan.slot);
                firing.record(
                    self,
                    Decided {
                        slot: plan.slot,
                        through: plan.through,
                        manual: false,
                        outcome: SlotOutcome::SkippedCatchUp,
                        run: None,
                        reason: Some(reason),
                    },
                )?;
            }
        }
        let last_run = firing.last_run.clone();
        let fired = firing.fired;
        let row = self.live_schedule_mut(id)?;
        row.schedule.next_fire_at = pass.next_fire_at;
        row.schedule.last_slot = last_slot;
        row.schedule.last_run_id = last_run;
        Ok(fired)
    }

    pub(crate) fn trigger_schedule(
        &mut self,
        id: &ScheduleId,
        ids: FireIds,
        quota: RunQuota,
        now: Millis,
    ) -> Result<Fired> {
        let row = self.live_schedule(id).ok_or_else(|| not_found(id))?;
        let (schedule, config) = (row.schedule.clone(), row.config.clone());
        if self.schedule_slots.contains_key(&(id.clone(), true, now)) {
            return Err(Error::Conflict(format!(
                "schedule {id} was already triggered at {now} (ms since the epoch); try again"
            )));
        }
        let mut firing = Firing {
            schedule: &schedule,
            config: &config,
            last_run: schedule.last_run_id.clone(),
            quota,
            fired: Fired::default(),
            now,
        };
        firing.fire(self, now, true, &ids)?;
        let last_run = firing.last_run.clone();
        let fired = firing.fired;
        self.live_schedule_mut(id)?.schedule.last_run_id = last_run;
        Ok(fired)
    }
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

/// One write's firing of a schedule's slots, as in the SQL backends.
struct Firing<'a> {
    schedule: &'a Schedule,
    config: &'a RunConfigSnapshot,
    last_run: Option<RunId>,
    quota: RunQuota,
    fired: Fired,
    now: Millis,
}

impl Firing<'_> {
    fn fire(&mut self, t: &mut Tables, slot: Millis, manual: bool, ids: &FireIds) -> Result<()> {
        let previous = (self.last_run.as_ref())
            .and_then(|run| t.runs.get(run).map(|row| (run.clone(), row.status())));
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
                return self.record(t, skipped(overlap_reason(&run, status)));
            }
            (OverlapAction::CancelPreviousThenFire, Some((run, _))) => {
                match t.request_cancel(&run, self.now)? {
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
                if let Err(error) = t.check_quota(&ids.session_id, self.quota, 1) {
                    return match error {
                        Error::QuotaExceeded(reason) => self.record(t, refused(reason)),
                        other => Err(other),
                    };
                }
                let spec = SessionSpec {
                    tenant: self.schedule.tenant.clone(),
                    agent: self.schedule.spec.agent.clone(),
                    metadata: Some(json!({"schedule_id": self.schedule.id})),
                    request: None,
                };
                t.create_session(&ids.session_id, spec, self.now)?;
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
        let submitted = match t.submit_message(new, self.now) {
            Ok(submitted) => submitted,
            Err(
                error @ (Error::QuotaExceeded(_)
                | Error::Conflict(_)
                | Error::NotFound { .. }
                | Error::Invalid(_)),
            ) => return self.record(t, refused(error.to_string())),
            Err(other) => return Err(other),
        };
        self.fired.events.extend(submitted.events);
        self.fired.enqueued |= submitted.status == RunStatus::Running;
        t.run_mut(&ids.run_id)?.state.schedule = Some(ScheduledSlot {
            schedule_id: self.schedule.id.clone(),
            slot,
            manual,
        });
        self.last_run = Some(ids.run_id.clone());
        self.record(
            t,
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

    /// Writes a decided slot's row; a second decision of a slot breaks the primary key.
    fn record(&mut self, t: &mut Tables, decided: Decided) -> Result<()> {
        let key = (self.schedule.id.clone(), decided.manual, decided.slot);
        if t.schedule_slots.contains_key(&key) {
            return Err(crate::tables::duplicate(
                "schedule slot",
                format!("{}@{}", key.0, key.2),
            ));
        }
        let (run_id, session_id, run_status) = match decided.run {
            Some((run, session, status)) => (Some(run), Some(session), Some(status)),
            None => (None, None, None),
        };
        t.schedule_slots.insert(
            key,
            SlotRow {
                through: decided.through,
                outcome: decided.outcome,
                run_id: run_id.clone(),
                session_id: session_id.clone(),
                reason: decided.reason.clone(),
                decided_at: self.now,
            },
        );
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
