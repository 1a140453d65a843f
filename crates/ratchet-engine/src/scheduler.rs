//! The scheduler: a loop every worker pool runs (`ratchet serve`, `ratchet worker`) that sleeps
//! until the earliest schedule's next slot — at most a second, so that schedules other
//! processes create or change are seen — and then asks the Coordinator to decide the due
//! slots. Processes race for the same slots freely: the store decides each slot once, under
//! the schedule's lock, and a pass that lost the race is told so (`Fired::stale`) and moves on.
//!
//! It computes the slots (`cadence`) and the plan (`ratchet_core::schedule::plan_slots`); it
//! never writes but through the Coordinator.

use std::sync::Arc;
use std::time::Duration;

use ratchet_core::Millis;
use ratchet_core::schedule::plan_slots;
use ratchet_store::{DuePass, PlannedSlot, Schedule};
use tokio_util::sync::CancellationToken;

use crate::cadence::Cadence;
use crate::{Coordinator, Result};

/// The longest the scheduler sleeps: how late it may notice a schedule another process made.
const POLL_MS: Millis = 1_000;
/// The shortest, so that a slot due in a moment is not waited for in a busy loop.
const MIN_SLEEP_MS: Millis = 20;
/// Schedules decided in one pass.
const DUE_PER_PASS: u32 = 100;

/// Decides the slots of every schedule due now; returns how many runs it fired.
pub async fn fire_due(coordinator: &Coordinator) -> Result<usize> {
    let now = coordinator.now();
    let due = coordinator.store().due_schedules(now, DUE_PER_PASS).await?;
    let mut fired = 0;
    for schedule in due {
        match fire_one(coordinator, &schedule, now).await {
            Ok(count) => fired += count,
            Err(error) => {
                tracing::warn!(%error, schedule = %schedule.id, "deciding a schedule's due slots failed");
            }
        }
    }
    Ok(fired)
}

async fn fire_one(coordinator: &Coordinator, schedule: &Schedule, now: Millis) -> Result<usize> {
    let cadence = Cadence::of(&schedule.spec.cadence).map_err(crate::Error::Invalid)?;
    let due = cadence.due(schedule.next_fire_at, now);
    let plans = plan_slots(schedule.spec.catch_up, due.earlier, &due.latest, now);
    let slots = (plans.into_iter())
        .map(|plan| {
            Ok(PlannedSlot {
                plan,
                ids: coordinator.fire_ids()?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let pass = DuePass {
        expected_next: schedule.next_fire_at,
        slots,
        // A cron expression that never matches again is never due again.
        next_fire_at: cadence.next_after(now).unwrap_or(Millis::MAX),
    };
    let fired = coordinator.fire_schedule(&schedule.id, pass).await?;
    if fired.stale {
        tracing::debug!(schedule = %schedule.id, "its due slots were decided by another process");
    }
    Ok((fired.slots.iter())
        .filter(|slot| slot.run_id.is_some())
        .count())
}

/// Runs the scheduler until `shutdown`.
pub(crate) async fn run(coordinator: Arc<Coordinator>, shutdown: CancellationToken) {
    while !shutdown.is_cancelled() {
        if let Err(error) = fire_due(&coordinator).await {
            tracing::warn!(%error, "reading the due schedules failed");
        }
        let now = coordinator.now();
        let wait = match coordinator.store().next_schedule_fire().await {
            // Still overdue right after a pass: a schedule this process cannot fire (its
            // failure was logged) is not tried again at once, in a loop.
            Ok(Some(at)) if at < now - POLL_MS => POLL_MS,
            Ok(Some(at)) => (at.saturating_sub(now)).clamp(MIN_SLEEP_MS, POLL_MS),
            Ok(None) | Err(_) => POLL_MS,
        };
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(wait as u64)) => {}
            () = shutdown.cancelled() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use ratchet_core::{CatchUp, Overlap, RunConfigSnapshot, SlotOutcome};
    use ratchet_store::{Cadence, DEFAULT_TENANT, RunQuota, ScheduleSpec};
    use ratchet_store_memory::MemoryStore;

    use super::*;
    use crate::Clock;

    /// 2024-03-01T00:00:00Z, a whole minute.
    const T: Millis = 1_709_251_200_000;

    /// After downtime, a pass decides every missed slot once, as each schedule's `catch_up`
    /// says, and moves its next fire past now; a second pass finds nothing due.
    #[tokio::test(start_paused = true)]
    async fn missed_slots_are_caught_up_as_each_schedule_says() {
        let store = std::sync::Arc::new(MemoryStore::new());
        // Slots at T, T+60 s and T+120 s, the latest 30 s late: all three were missed.
        let now = T + 150_000;
        let coordinator =
            Coordinator::with_clock(store.clone(), RunQuota::default(), Clock::tokio_from(now));
        let mut ids = Vec::new();
        for catch_up in CatchUp::ALL {
            let spec = ScheduleSpec {
                agent: None,
                message: "tick".into(),
                cadence: Cadence::Every { ms: 60_000 },
                session: None,
                overlap: Overlap::Enqueue,
                catch_up,
                paused: false,
            };
            let schedule = coordinator
                .create_schedule(
                    DEFAULT_TENANT.into(),
                    spec,
                    RunConfigSnapshot::default(),
                    T,
                    None,
                )
                .await
                .unwrap();
            ids.push((catch_up, schedule.id));
        }
        assert_eq!(fire_due(&coordinator).await.unwrap(), 1 + 3);
        for (catch_up, id) in &ids {
            let mut slots = coordinator
                .store()
                .schedule_slots(id, None, 10)
                .await
                .unwrap();
            slots.reverse();
            let decided: Vec<(Millis, SlotOutcome)> =
                slots.iter().map(|s| (s.slot, s.outcome)).collect();
            let (skip, fire) = (SlotOutcome::SkippedCatchUp, SlotOutcome::Fired);
            let expected = match catch_up {
                CatchUp::Skip => [(T, skip), (T + 60_000, skip), (T + 120_000, skip)],
                CatchUp::One => [(T, skip), (T + 60_000, skip), (T + 120_000, fire)],
                CatchUp::All => [(T, fire), (T + 60_000, fire), (T + 120_000, fire)],
            };
            assert_eq!(decided, expected, "{catch_up:?}");
            let schedule = coordinator.store().get_schedule(id).await.unwrap();
            assert_eq!(schedule.next_fire_at, T + 180_000, "{catch_up:?}");
        }
        assert_eq!(
            fire_due(&coordinator).await.unwrap(),
            0,
            "nothing is due twice"
        );
    }
}
