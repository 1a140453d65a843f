//! Schedules: a definition kept and changed, and each due slot decided exactly once — fired as
//! a message would be, skipped (overlap, catch-up) or refused — with a row that explains it,
//! however many writers race for it.

use std::sync::Arc;

use ratchet_core::schedule::SlotPlan;
use ratchet_core::{
    CatchUp, MessageId, Millis, Overlap, RunId, RunStatus, ScheduleId, SessionId, SlotOutcome,
};
use ratchet_store::{
    Cadence, DEFAULT_TENANT, DuePass, Error, FireIds, Fired, NewSchedule, PlannedSlot, RunQuota,
    Schedule, ScheduleChange, ScheduleSpec, SlotCursor, Store,
};

use super::{T0, config, load, new_session, unique};

const EVERY: Millis = 1_000;

fn spec(session: Option<SessionId>, overlap: Overlap, catch_up: CatchUp) -> ScheduleSpec {
    ScheduleSpec {
        agent: None,
        message: "the daily report".into(),
        cadence: Cadence::Every { ms: EVERY as u64 },
        session,
        overlap,
        catch_up,
        paused: false,
    }
}

async fn create(store: &dyn Store, spec: ScheduleSpec, next_fire_at: Millis) -> Schedule {
    let new = NewSchedule {
        id: ScheduleId::from_suffix(&unique()).unwrap(),
        tenant: DEFAULT_TENANT.into(),
        spec,
        config: config(),
        next_fire_at,
        request: None,
    };
    store
        .create_schedule(new, T0)
        .await
        .unwrap_or_else(|e| panic!("create_schedule: {e}"))
}

fn ids() -> FireIds {
    FireIds {
        run_id: RunId::from_suffix(&unique()).unwrap(),
        message_id: MessageId::from_suffix(&unique()).unwrap(),
        session_id: SessionId::from_suffix(&unique()).unwrap(),
    }
}

fn fire_at(slot: Millis) -> PlannedSlot {
    PlannedSlot {
        plan: SlotPlan {
            slot,
            through: slot,
            fire: true,
        },
        ids: ids(),
    }
}

fn pass(expected_next: Millis, slots: Vec<PlannedSlot>) -> DuePass {
    let next_fire_at = slots.last().map_or(expected_next, |s| s.plan.through) + EVERY;
    DuePass {
        expected_next,
        slots,
        next_fire_at,
    }
}

async fn fire(store: &dyn Store, id: &ScheduleId, pass: DuePass, now: Millis) -> Fired {
    store
        .fire_schedule(id, pass, RunQuota::default(), now)
        .await
        .unwrap_or_else(|e| panic!("fire_schedule {id}: {e}"))
}

fn outcomes(fired: &Fired) -> Vec<(Millis, SlotOutcome)> {
    fired.slots.iter().map(|s| (s.slot, s.outcome)).collect()
}

/// A schedule is kept as created, listed per tenant, changed whole, paused and resumed, and
/// reads as missing once deleted.
pub async fn a_schedule_is_kept_changed_paused_and_deleted(store: &dyn Store) {
    let created = create(store, spec(None, Overlap::Skip, CatchUp::One), T0 + EVERY).await;
    assert_eq!(store.get_schedule(&created.id).await.unwrap(), created);
    assert_eq!(created.next_fire_at, T0 + EVERY);
    assert_eq!(
        (created.last_slot, created.last_run_id.clone()),
        (None, None)
    );
    let listed = store.schedules(DEFAULT_TENANT, None, 10).await.unwrap();
    assert_eq!(listed, std::slice::from_ref(&created));
    assert!(store.schedules("acme", None, 10).await.unwrap().is_empty());
    assert!(
        (store
            .schedules(DEFAULT_TENANT, Some(&created.id), 10)
            .await
            .unwrap())
        .is_empty(),
        "a page starts after its cursor"
    );

    let mut changed = spec(None, Overlap::CancelPrevious, CatchUp::All);
    changed.cadence = Cadence::Cron {
        expression: "0 * * * *".into(),
        timezone: Some("Europe/Paris".into()),
    };
    changed.message = "the hourly report".into();
    let change = ScheduleChange {
        spec: changed.clone(),
        config: config(),
        next_fire_at: None,
    };
    let updated = store
        .update_schedule(&created.id, change, T0 + 5)
        .await
        .unwrap();
    assert_eq!(updated.spec, changed);
    assert_eq!(
        updated.next_fire_at,
        T0 + EVERY,
        "None keeps when it is due"
    );
    assert_eq!(updated.updated_at, T0 + 5);

    let paused = (store.set_schedule_paused(&created.id, true, None, T0 + 6))
        .await
        .unwrap();
    assert!(paused.spec.paused);
    assert_eq!(store.next_schedule_fire().await.unwrap(), None);
    assert!(
        store
            .due_schedules(T0 + EVERY, 10)
            .await
            .unwrap()
            .is_empty()
    );
    let resumed = (store.set_schedule_paused(&created.id, false, Some(T0 + 60_000), T0 + 7))
        .await
        .unwrap();
    assert_eq!(
        (resumed.spec.paused, resumed.next_fire_at),
        (false, T0 + 60_000)
    );
    assert_eq!(store.next_schedule_fire().await.unwrap(), Some(T0 + 60_000));
    assert!(
        store
            .due_schedules(T0 + 59_999, 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        store.due_schedules(T0 + 60_000, 10).await.unwrap(),
        [resumed]
    );

    store.delete_schedule(&created.id, T0 + 8).await.unwrap();
    assert!(matches!(
        store.get_schedule(&created.id).await,
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        store.delete_schedule(&created.id, T0 + 9).await,
        Err(Error::NotFound { .. })
    ));
    assert!(
        store
            .schedules(DEFAULT_TENANT, None, 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(store.next_schedule_fire().await.unwrap(), None);
    let gone = fire(
        store,
        &created.id,
        pass(T0 + 60_000, vec![fire_at(T0 + 60_000)]),
        T0 + 60_000,
    )
    .await;
    assert!(gone.stale, "a deleted schedule fires nothing");
    assert!(matches!(
        store
            .trigger_schedule(&created.id, ids(), RunQuota::default(), None, T0)
            .await,
        Err(Error::NotFound { .. })
    ));
}

/// A due slot fires once: its run starts in a new session of the schedule's tenant and names
/// the schedule and the slot; the same pass again (another process that read the schedule
/// before) writes nothing; the listing shows the slot with its run.
pub async fn a_due_slot_fires_once_as_a_run_that_names_its_schedule_and_slot(store: &dyn Store) {
    let schedule = create(
        store,
        spec(None, Overlap::Enqueue, CatchUp::One),
        T0 + EVERY,
    )
    .await;
    let slot = T0 + EVERY;
    let planned = fire_at(slot);
    let run = planned.ids.run_id.clone();
    let fired = fire(store, &schedule.id, pass(slot, vec![planned]), slot + 5).await;
    assert!(!fired.stale);
    assert!(fired.enqueued, "its run started");
    assert_eq!(outcomes(&fired), [(slot, SlotOutcome::Fired)]);
    assert_eq!(fired.slots[0].run_id.as_ref(), Some(&run));
    assert!(
        fired.events.iter().any(|e| e.kind == "run.created"),
        "it publishes what a message would"
    );
    let state = load(store, &run).await;
    assert_eq!(state.status, RunStatus::Running);
    let origin = state.schedule.clone().expect("the run names its schedule");
    assert_eq!(
        (origin.schedule_id, origin.slot, origin.manual),
        (schedule.id.clone(), slot, false)
    );
    let session = store.get_session(&state.session_id).await.unwrap();
    assert_eq!(session.tenant, DEFAULT_TENANT);
    assert_eq!(
        session.metadata,
        Some(serde_json::json!({"schedule_id": schedule.id}))
    );
    let summary = store
        .session_runs(&state.session_id, None, 10)
        .await
        .unwrap();
    assert_eq!(
        (summary[0].schedule_id.as_ref(), summary[0].slot),
        (Some(&schedule.id), Some(slot))
    );
    let after = store.get_schedule(&schedule.id).await.unwrap();
    assert_eq!(
        (
            after.next_fire_at,
            after.last_slot,
            after.last_run_id.as_ref()
        ),
        (slot + EVERY, Some(slot), Some(&run))
    );

    let again = fire(
        store,
        &schedule.id,
        pass(slot, vec![fire_at(slot)]),
        slot + 6,
    )
    .await;
    assert!(again.stale && again.slots.is_empty() && again.events.is_empty());
    assert_eq!(store.list_runs().await.unwrap().len(), 1, "no second run");

    let listed = store.schedule_slots(&schedule.id, None, 10).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (
            listed[0].outcome,
            listed[0].run_id.as_ref(),
            listed[0].run_status
        ),
        (SlotOutcome::Fired, Some(&run), Some(RunStatus::Running))
    );
}

/// What a pass plans is written as planned: missed slots skipped as one range or one by one,
/// the others fired, each slot listed newest first with why it was skipped.
pub async fn missed_slots_are_recorded_as_skipped_and_listed_newest_first(store: &dyn Store) {
    let schedule = create(store, spec(None, Overlap::Enqueue, CatchUp::One), T0).await;
    let skipped = |slot, through| PlannedSlot {
        plan: SlotPlan {
            slot,
            through,
            fire: false,
        },
        ids: ids(),
    };
    let slots = vec![
        skipped(T0, T0 + 5 * EVERY),
        skipped(T0 + 6 * EVERY, T0 + 6 * EVERY),
        fire_at(T0 + 7 * EVERY),
    ];
    let now = T0 + 7 * EVERY + 20_000;
    let fired = fire(store, &schedule.id, pass(T0, slots), now).await;
    assert_eq!(
        outcomes(&fired),
        [
            (T0, SlotOutcome::SkippedCatchUp),
            (T0 + 6 * EVERY, SlotOutcome::SkippedCatchUp),
            (T0 + 7 * EVERY, SlotOutcome::Fired),
        ]
    );
    assert_eq!(fired.slots[0].through, T0 + 5 * EVERY);
    assert!(
        (fired.slots[0].reason.as_deref()).is_some_and(|r| r.contains("catch_up: one")),
        "{:?}",
        fired.slots[0].reason
    );
    let listed = store.schedule_slots(&schedule.id, None, 2).await.unwrap();
    assert_eq!(
        listed.iter().map(|s| s.slot).collect::<Vec<_>>(),
        [T0 + 7 * EVERY, T0 + 6 * EVERY]
    );
    let cursor = SlotCursor {
        slot: listed[1].slot,
        manual: listed[1].manual,
    };
    let rest = store
        .schedule_slots(&schedule.id, Some(cursor), 10)
        .await
        .unwrap();
    assert_eq!(rest.iter().map(|s| s.slot).collect::<Vec<_>>(), [T0]);
    let after = store.get_schedule(&schedule.id).await.unwrap();
    assert_eq!(after.last_slot, Some(T0 + 7 * EVERY));
    assert_eq!(after.next_fire_at, T0 + 8 * EVERY);
}

/// While the previous run is active, `skip` records the slot as skipped, `enqueue` queues the
/// run behind it in a shared session, and `cancel_previous` cancels it in the same write and
/// then fires.
pub async fn overlap_skips_queues_behind_or_cancels_the_previous_run(store: &dyn Store) {
    for overlap in Overlap::ALL {
        let session = new_session(store).await;
        let schedule = create(
            store,
            spec(Some(session.clone()), overlap, CatchUp::One),
            T0,
        )
        .await;
        let first = fire_at(T0);
        let first_run = first.ids.run_id.clone();
        let fired = fire(store, &schedule.id, pass(T0, vec![first]), T0 + 1).await;
        assert_eq!(outcomes(&fired), [(T0, SlotOutcome::Fired)], "{overlap:?}");
        assert_eq!(load(store, &first_run).await.session_id, session);

        let second = fire_at(T0 + EVERY);
        let second_run = second.ids.run_id.clone();
        let fired = fire(
            store,
            &schedule.id,
            pass(T0 + EVERY, vec![second]),
            T0 + EVERY,
        )
        .await;
        let (outcome, first_status, second_status) = match overlap {
            Overlap::Skip => (SlotOutcome::SkippedOverlap, RunStatus::Running, None),
            Overlap::Enqueue => (
                SlotOutcome::Fired,
                RunStatus::Running,
                Some(RunStatus::Queued),
            ),
            // A running run is asked to cancel (its next step ends it) in the same write, and
            // the new run queues behind it in the shared session.
            Overlap::CancelPrevious => (
                SlotOutcome::Fired,
                RunStatus::Cancelling,
                Some(RunStatus::Queued),
            ),
        };
        assert_eq!(outcomes(&fired), [(T0 + EVERY, outcome)], "{overlap:?}");
        assert_eq!(
            load(store, &first_run).await.status,
            first_status,
            "{overlap:?}"
        );
        let second_state = store.load_state(&second_run).await.ok();
        assert_eq!(second_state.map(|s| s.status), second_status, "{overlap:?}");
        if overlap == Overlap::Skip {
            let reason = fired.slots[0].reason.clone().unwrap_or_default();
            assert!(reason.contains(first_run.as_str()), "{reason}");
            let after = store.get_schedule(&schedule.id).await.unwrap();
            assert_eq!(
                after.last_run_id,
                Some(first_run),
                "a skip keeps the previous run"
            );
        }
    }
}

/// A slot whose run the quota refuses is recorded as refused with the reason, writes no run
/// and no session, and the schedule moves on; so does one whose session was archived.
pub async fn a_refused_slot_is_recorded_and_the_schedule_moves_on(store: &dyn Store) {
    let schedule = create(store, spec(None, Overlap::Enqueue, CatchUp::One), T0).await;
    let full = RunQuota {
        global: Some(0),
        per_session: None,
    };
    let fired = store
        .fire_schedule(&schedule.id, pass(T0, vec![fire_at(T0)]), full, T0)
        .await
        .unwrap();
    assert_eq!(outcomes(&fired), [(T0, SlotOutcome::Refused)]);
    assert!(fired.slots[0].run_id.is_none() && fired.slots[0].session_id.is_none());
    assert!(fired.events.is_empty() && !fired.enqueued);
    assert!(
        store.list_runs().await.unwrap().is_empty(),
        "no run written"
    );
    let listed = (store.list_sessions(DEFAULT_TENANT, &Default::default(), 10))
        .await
        .unwrap();
    assert!(listed.is_empty(), "no session left behind: {listed:?}");
    assert_eq!(
        store.get_schedule(&schedule.id).await.unwrap().next_fire_at,
        T0 + EVERY
    );

    let session = new_session(store).await;
    let shared = create(
        store,
        spec(Some(session.clone()), Overlap::Enqueue, CatchUp::One),
        T0,
    )
    .await;
    store
        .close_session(&session, ratchet_store::Closing::Archive, T0)
        .await
        .unwrap();
    let fired = fire(store, &shared.id, pass(T0, vec![fire_at(T0)]), T0 + 1).await;
    assert_eq!(outcomes(&fired), [(T0, SlotOutcome::Refused)]);
    assert!(
        (fired.slots[0].reason.as_deref()).is_some_and(|r| r.contains("archived")),
        "{:?}",
        fired.slots[0].reason
    );
}

/// A trigger fires now as a manual slot, paused or not, under the same overlap rule, and moves
/// no due time; a second trigger at the same millisecond is a conflict.
pub async fn a_trigger_fires_a_manual_slot_and_moves_nothing(store: &dyn Store) {
    let mut paused = spec(None, Overlap::Skip, CatchUp::One);
    paused.paused = true;
    let schedule = create(store, paused, T0 + 60_000).await;
    let first = ids();
    let run = first.run_id.clone();
    let fired = store
        .trigger_schedule(&schedule.id, first, RunQuota::default(), None, T0 + 10)
        .await
        .unwrap();
    assert_eq!(outcomes(&fired), [(T0 + 10, SlotOutcome::Fired)]);
    assert!(fired.slots[0].manual);
    let origin = load(store, &run).await.schedule.unwrap();
    assert!(origin.manual && origin.slot == T0 + 10);
    assert!(matches!(
        store
            .trigger_schedule(&schedule.id, ids(), RunQuota::default(), None, T0 + 10)
            .await,
        Err(Error::Conflict(_))
    ));
    let fired = store
        .trigger_schedule(&schedule.id, ids(), RunQuota::default(), None, T0 + 11)
        .await
        .unwrap();
    assert_eq!(
        outcomes(&fired),
        [(T0 + 11, SlotOutcome::SkippedOverlap)],
        "the first run is still running"
    );
    let after = store.get_schedule(&schedule.id).await.unwrap();
    assert_eq!(
        (after.next_fire_at, after.last_slot, after.last_run_id),
        (T0 + 60_000, None, Some(run))
    );
}

/// Writers racing to decide the same due slot (each with ids of its own, as processes would
/// be): exactly one fires it, every other is told it is stale, and one run exists.
pub async fn racing_passes_decide_each_slot_once(store: Arc<dyn Store>) {
    let schedule = create(&*store, spec(None, Overlap::Enqueue, CatchUp::All), T0).await;
    for round in 0..3 {
        let slot = T0 + round * EVERY;
        let racers: Vec<_> = (0..8)
            .map(|_| {
                let (store, id) = (Arc::clone(&store), schedule.id.clone());
                tokio::spawn(async move {
                    store
                        .fire_schedule(
                            &id,
                            pass(slot, vec![fire_at(slot)]),
                            RunQuota::default(),
                            slot,
                        )
                        .await
                })
            })
            .collect();
        let mut winners = 0;
        for racer in racers {
            let fired = racer.await.expect("racer panicked").expect("no racer errs");
            if !fired.stale {
                winners += 1;
                assert_eq!(outcomes(&fired), [(slot, SlotOutcome::Fired)]);
            }
        }
        assert_eq!(winners, 1, "slot {slot}: exactly one pass decides it");
    }
    let runs = store.list_runs().await.unwrap();
    assert_eq!(runs.len(), 3, "one run per slot");
    let mut slots: Vec<_> = runs.iter().map(|r| r.slot.unwrap()).collect();
    slots.sort();
    assert_eq!(slots, [T0, T0 + EVERY, T0 + 2 * EVERY]);
}
