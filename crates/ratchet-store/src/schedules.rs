//! Schedules as the store keeps them: a definition, its frozen run configuration, when its
//! next slot is due, and one row per decided slot — the row that makes a slot fire at most
//! once, however many processes share the database.
//!
//! The store computes no slot time (that needs a calendar): whoever fires hands it the slots
//! and the next due time, and the store checks, under the schedule's lock, that nobody decided
//! them first.

use ratchet_core::schedule::SlotPlan;
use ratchet_core::{
    CatchUp, MessageId, Millis, Overlap, RunConfigSnapshot, RunId, RunStatus, ScheduleId,
    SessionId, SlotOutcome,
};
use serde::Serialize;

use crate::StoredEvent;

/// When a schedule's slots are due.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cadence {
    /// A cron expression of 5 fields (minute first) or 6 (seconds first), in `timezone` (an
    /// IANA name; UTC when None).
    Cron {
        expression: String,
        timezone: Option<String>,
    },
    /// Every `ms` milliseconds, at the multiples of `ms` since the Unix epoch.
    Every { ms: u64 },
}

/// What a schedule is defined with: what it sends, where, when, and what it does with
/// overlaps and missed slots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScheduleSpec {
    /// The catalog agent its runs are of (None: the server's run template).
    pub agent: Option<String>,
    /// The message each run starts with.
    pub message: String,
    pub cadence: Cadence,
    /// The session its runs go to; None: each run in a new session of its own.
    pub session: Option<SessionId>,
    pub overlap: Overlap,
    pub catch_up: CatchUp,
    /// A paused schedule fires nothing by itself (its slots are not recorded); `trigger` still
    /// fires it.
    pub paused: bool,
}

/// A new schedule: its definition, the configuration its runs are frozen with, and when its
/// first slot is due.
#[derive(Debug, Clone)]
pub struct NewSchedule {
    pub id: ScheduleId,
    pub tenant: String,
    pub spec: ScheduleSpec,
    pub config: RunConfigSnapshot,
    pub next_fire_at: Millis,
    /// The keyed request creating it: its effect is recorded with the key, in the same
    /// transaction.
    pub request: Option<crate::RequestMark>,
}

/// A schedule's definition replaced whole (an update), with the configuration frozen again.
#[derive(Debug, Clone)]
pub struct ScheduleChange {
    pub spec: ScheduleSpec,
    pub config: RunConfigSnapshot,
    /// When the next slot is due from now on: Some when the cadence changed or the schedule
    /// resumes; None keeps the stored one.
    pub next_fire_at: Option<Millis>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Schedule {
    pub id: ScheduleId,
    pub tenant: String,
    #[serde(flatten)]
    pub spec: ScheduleSpec,
    /// When its next slot is due: every slot before it has been decided.
    pub next_fire_at: Millis,
    /// The latest slot decided by its cadence.
    pub last_slot: Option<Millis>,
    /// The latest run it fired (by its cadence or a trigger), which `overlap` looks at.
    pub last_run_id: Option<RunId>,
    pub created_at: Millis,
    pub updated_at: Millis,
}

/// The ids a fired slot's run is created with (the store makes none): its run, its message,
/// and the session it gets when the schedule's runs go to new sessions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FireIds {
    pub run_id: RunId,
    pub message_id: MessageId,
    pub session_id: SessionId,
}

/// One slot of a pass, as planned (`ratchet_core::schedule::plan_slots`), with the ids its run
/// takes if it fires.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedSlot {
    pub plan: SlotPlan,
    pub ids: FireIds,
}

/// The due slots of a schedule, decided in one transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DuePass {
    /// The `next_fire_at` the slots were computed from: if the schedule's is another now,
    /// someone decided them first (or the schedule changed) and nothing is written.
    pub expected_next: Millis,
    pub slots: Vec<PlannedSlot>,
    /// The first slot after the pass: the schedule's `next_fire_at` once it commits.
    pub next_fire_at: Millis,
}

/// A decided slot, with its run's status as it is now.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScheduleSlot {
    pub schedule_id: ScheduleId,
    pub slot: Millis,
    /// The last slot of a range of missed slots skipped together; `slot` otherwise.
    pub through: Millis,
    /// Fired by a trigger rather than by the cadence.
    pub manual: bool,
    pub outcome: SlotOutcome,
    pub run_id: Option<RunId>,
    pub session_id: Option<SessionId>,
    pub run_status: Option<RunStatus>,
    /// Why it was skipped or refused.
    pub reason: Option<String>,
    pub decided_at: Millis,
}

/// Where a page of a schedule's slots starts: before this slot, newest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotCursor {
    pub slot: Millis,
    pub manual: bool,
}

/// What deciding slots did.
#[derive(Debug, Clone, Default)]
pub struct Fired {
    /// The slots decided, in time order; empty when `stale`.
    pub slots: Vec<ScheduleSlot>,
    /// Someone decided these slots first, or the schedule was paused, changed or deleted
    /// meanwhile: nothing was written.
    pub stale: bool,
    pub events: Vec<StoredEvent>,
    /// Jobs were enqueued (a run started, a cancel freed a session): wake the workers.
    pub enqueued: bool,
}

/// The reason recorded on a slot skipped because the previous run had not finished.
pub fn overlap_reason(previous: &RunId, status: RunStatus) -> String {
    format!("the previous run {previous} was still {status} (overlap: skip)")
}

/// The reason recorded on missed slots skipped under `catch_up`.
pub fn catch_up_reason(catch_up: CatchUp, range: bool) -> String {
    let beyond = if range && catch_up == CatchUp::All {
        format!(
            "beyond the {} latest missed slots a pass fires",
            ratchet_core::schedule::MAX_CATCH_UP
        )
    } else {
        format!("catch_up: {}", catch_up.as_str())
    };
    format!("missed while no scheduler ran ({beyond})")
}
