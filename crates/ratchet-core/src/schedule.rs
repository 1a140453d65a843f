//! Schedules: what a schedule does with the slots that have come due, decided from plain
//! times. Which slots a cron expression or an interval names is computed outside the core
//! (it needs a calendar and time zones); this module is handed the slots as `Millis` and says
//! which fire and which are skipped, and what a fire does with the schedule's previous run.
//!
//! It never reads the clock: `now` is passed in like everywhere else in the core.

use serde::{Deserialize, Serialize};

use crate::{Millis, RunStatus, ScheduleId};

/// A slot is on time while at most this late: a scheduler that runs polls at least every
/// second, so a slot later than this was due while no scheduler ran (downtime), and `CatchUp`
/// decides what becomes of it.
pub const MISFIRE_GRACE_MS: Millis = 10_000;

/// The most missed slots `CatchUp::All` fires in one pass; older ones are skipped, recorded as
/// one range.
pub const MAX_CATCH_UP: usize = 100;

/// The shortest interval of an `every_ms` schedule.
pub const MIN_EVERY_MS: u64 = 1_000;

/// What a due slot does while the schedule's previous run has not finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// The slot is recorded as skipped; no run starts.
    Skip,
    /// The run starts anyway: in a shared session it queues behind the runs before it, in a
    /// new session it runs beside the previous one.
    Enqueue,
    /// The previous run is asked to cancel, in the same transaction, and the run starts.
    CancelPrevious,
}

impl Overlap {
    pub const ALL: [Overlap; 3] = [Overlap::Skip, Overlap::Enqueue, Overlap::CancelPrevious];

    pub fn as_str(self) -> &'static str {
        match self {
            Overlap::Skip => "skip",
            Overlap::Enqueue => "enqueue",
            Overlap::CancelPrevious => "cancel_previous",
        }
    }

    pub fn parse(text: &str) -> Option<Overlap> {
        Overlap::ALL.into_iter().find(|o| o.as_str() == text)
    }
}

/// What becomes of the slots that came due while no scheduler ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CatchUp {
    /// Missed slots are recorded as skipped; only a slot on time fires.
    Skip,
    /// One run stands for the whole backlog: the slot on time, or else the latest missed one.
    One,
    /// Every missed slot fires, the latest `MAX_CATCH_UP` of them at most.
    All,
}

impl CatchUp {
    pub const ALL: [CatchUp; 3] = [CatchUp::Skip, CatchUp::One, CatchUp::All];

    pub fn as_str(self) -> &'static str {
        match self {
            CatchUp::Skip => "skip",
            CatchUp::One => "one",
            CatchUp::All => "all",
        }
    }

    pub fn parse(text: &str) -> Option<CatchUp> {
        CatchUp::ALL.into_iter().find(|c| c.as_str() == text)
    }
}

/// What became of a decided slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SlotOutcome {
    /// A run started (or queued) for it.
    Fired,
    /// The previous run had not finished and the schedule's overlap is `skip`.
    SkippedOverlap,
    /// It was missed while no scheduler ran, and `catch_up` left it out.
    SkippedCatchUp,
    /// The run was refused as a message would be (a run quota, a closed session); the refusal
    /// is the slot's reason, and the slot is not tried again.
    Refused,
}

impl SlotOutcome {
    pub const ALL: [SlotOutcome; 4] = [
        SlotOutcome::Fired,
        SlotOutcome::SkippedOverlap,
        SlotOutcome::SkippedCatchUp,
        SlotOutcome::Refused,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SlotOutcome::Fired => "fired",
            SlotOutcome::SkippedOverlap => "skipped_overlap",
            SlotOutcome::SkippedCatchUp => "skipped_catch_up",
            SlotOutcome::Refused => "refused",
        }
    }

    pub fn parse(text: &str) -> Option<SlotOutcome> {
        SlotOutcome::ALL.into_iter().find(|o| o.as_str() == text)
    }
}

/// Where a run fired by a schedule came from: kept in its state for as long as it lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduledSlot {
    pub schedule_id: ScheduleId,
    /// The time the slot was due (for a manual trigger, when it was asked for).
    pub slot: Millis,
    /// Fired by `trigger`, not by the schedule's cadence.
    #[serde(default)]
    pub manual: bool,
}

/// What a pass does with one due slot (or, for `Skip` with `through`, a range of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotPlan {
    pub slot: Millis,
    /// The last slot of a range skipped as one (the missed slots older than the ones a pass
    /// looks at one by one); `slot` itself otherwise.
    pub through: Millis,
    pub fire: bool,
}

/// Which due slots fire. `latest` are the latest due slots in time order (at most
/// `MAX_CATCH_UP` of them); `earlier`, the first and last of the due slots before those,
/// when there are any. A slot is on time when it is at most `MISFIRE_GRACE_MS` late; the
/// others were missed and `catch_up` decides (see `CatchUp`). The earlier range is beyond
/// the bound and always skipped. The answer is in time order, every slot decided once.
pub fn plan_slots(
    catch_up: CatchUp,
    earlier: Option<(Millis, Millis)>,
    latest: &[Millis],
    now: Millis,
) -> Vec<SlotPlan> {
    let on_time = |slot: Millis| now - slot <= MISFIRE_GRACE_MS;
    let any_on_time = latest.iter().any(|s| on_time(*s));
    let latest_missed = latest.iter().copied().filter(|s| !on_time(*s)).max();
    let fires = |slot: Millis| match catch_up {
        CatchUp::Skip => on_time(slot),
        CatchUp::One => on_time(slot) || (!any_on_time && Some(slot) == latest_missed),
        CatchUp::All => true,
    };
    let skipped_range = earlier.map(|(slot, through)| SlotPlan {
        slot,
        through,
        fire: false,
    });
    let each = latest.iter().map(|&slot| SlotPlan {
        slot,
        through: slot,
        fire: fires(slot),
    });
    skipped_range.into_iter().chain(each).collect()
}

/// What firing a slot does, given the schedule's previous run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverlapAction {
    Fire,
    /// Record the slot as skipped (`SlotOutcome::SkippedOverlap`).
    Skip,
    /// Ask the previous run to cancel, then fire.
    CancelPreviousThenFire,
}

/// What a slot does under `overlap` when the schedule's previous run is in `previous` (None
/// when it has fired none). A finished previous run never holds a slot back; one already
/// cancelling needs no second cancel.
pub fn overlap_action(overlap: Overlap, previous: Option<RunStatus>) -> OverlapAction {
    let Some(previous) = previous.filter(|status| !status.is_terminal()) else {
        return OverlapAction::Fire;
    };
    match (overlap, previous) {
        (Overlap::Skip, _) => OverlapAction::Skip,
        (Overlap::Enqueue, _) | (Overlap::CancelPrevious, RunStatus::Cancelling) => {
            OverlapAction::Fire
        }
        (Overlap::CancelPrevious, _) => OverlapAction::CancelPreviousThenFire,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: Millis = 1_000_000;

    fn fired(plans: &[SlotPlan]) -> Vec<Millis> {
        plans.iter().filter(|p| p.fire).map(|p| p.slot).collect()
    }

    #[test]
    fn names_round_trip() {
        for o in Overlap::ALL {
            assert_eq!(Overlap::parse(o.as_str()), Some(o));
            assert_eq!(serde_json::to_value(o).unwrap(), o.as_str());
        }
        for c in CatchUp::ALL {
            assert_eq!(CatchUp::parse(c.as_str()), Some(c));
            assert_eq!(serde_json::to_value(c).unwrap(), c.as_str());
        }
        for s in SlotOutcome::ALL {
            assert_eq!(SlotOutcome::parse(s.as_str()), Some(s));
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
        assert_eq!(Overlap::parse("Skip"), None);
    }

    #[test]
    fn a_slot_on_time_fires_under_every_policy() {
        for catch_up in CatchUp::ALL {
            for late in [0, 1, MISFIRE_GRACE_MS] {
                let plans = plan_slots(catch_up, None, &[NOW - late], NOW);
                assert_eq!(fired(&plans), [NOW - late], "{catch_up:?}, {late} ms late");
            }
        }
    }

    #[test]
    fn missed_slots_follow_catch_up() {
        let missed = [NOW - 50_000, NOW - 40_000, NOW - 30_000];
        let skip = plan_slots(CatchUp::Skip, None, &missed, NOW);
        assert_eq!(fired(&skip), [] as [Millis; 0]);
        let one = plan_slots(CatchUp::One, None, &missed, NOW);
        assert_eq!(fired(&one), [NOW - 30_000], "only the latest missed");
        let all = plan_slots(CatchUp::All, None, &missed, NOW);
        assert_eq!(fired(&all), missed);
        for plans in [skip, one, all] {
            let decided: Vec<_> = plans.iter().map(|p| p.slot).collect();
            assert_eq!(decided, missed, "every slot is decided once, in order");
        }
    }

    #[test]
    fn with_a_slot_on_time_one_fires_it_and_skips_the_backlog() {
        let slots = [NOW - 60_000, NOW - 30_000, NOW - 2_000];
        assert_eq!(
            fired(&plan_slots(CatchUp::One, None, &slots, NOW)),
            [NOW - 2_000]
        );
        assert_eq!(
            fired(&plan_slots(CatchUp::Skip, None, &slots, NOW)),
            [NOW - 2_000]
        );
        assert_eq!(fired(&plan_slots(CatchUp::All, None, &slots, NOW)), slots);
    }

    #[test]
    fn the_range_beyond_the_bound_is_skipped_as_one() {
        for catch_up in CatchUp::ALL {
            let plans = plan_slots(catch_up, Some((10, 20)), &[NOW - 20_000], NOW);
            assert_eq!(
                plans[0],
                SlotPlan {
                    slot: 10,
                    through: 20,
                    fire: false
                }
            );
            assert_eq!(plans.len(), 2);
        }
    }

    #[test]
    fn nothing_due_decides_nothing() {
        for catch_up in CatchUp::ALL {
            assert!(plan_slots(catch_up, None, &[], NOW).is_empty());
        }
    }

    /// Every overlap policy against every status the previous run can be in, and none.
    #[test]
    fn overlap_is_decided_for_every_previous_status() {
        for overlap in Overlap::ALL {
            assert_eq!(overlap_action(overlap, None), OverlapAction::Fire);
            for status in RunStatus::ALL {
                let action = overlap_action(overlap, Some(status));
                let expected = if status.is_terminal() {
                    OverlapAction::Fire
                } else {
                    match overlap {
                        Overlap::Skip => OverlapAction::Skip,
                        Overlap::Enqueue => OverlapAction::Fire,
                        Overlap::CancelPrevious if status == RunStatus::Cancelling => {
                            OverlapAction::Fire
                        }
                        Overlap::CancelPrevious => OverlapAction::CancelPreviousThenFire,
                    }
                };
                assert_eq!(action, expected, "{overlap:?} after a {status:?} run");
            }
        }
    }
}
