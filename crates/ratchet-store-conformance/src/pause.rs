//! Pause and resume: a paused run stops at a step boundary, keeps its session, and takes up
//! the very job its pause took away.

use std::sync::Arc;

use ratchet_core::step::{after_model, after_tools};
use ratchet_core::{EventDraft, EventKind, Origin, Phase, RunId, RunStatus, ToolOutcome};
use serde_json::json;

use super::{
    LEASE_MS, OWNER_A, OWNER_B, T0, assert_nothing_claimable, claim, commit, config, kinds, lease,
    load, new_session, submit, submit_as, tool_reply,
};
use ratchet_store::{
    CancelOutcome, Error, PauseOutcome, ResumeOutcome, Store, StoredEvent, WhenBusy,
};

async fn pause(store: &dyn Store, run: &RunId, now: i64) -> PauseOutcome {
    store
        .request_pause(run, now)
        .await
        .unwrap_or_else(|e| panic!("request_pause {run}: {e}"))
}

async fn resume(store: &dyn Store, run: &RunId, now: i64) -> ResumeOutcome {
    store
        .resume_paused(run, now)
        .await
        .unwrap_or_else(|e| panic!("resume_paused {run}: {e}"))
}

fn statuses(events: &[StoredEvent]) -> Vec<&str> {
    events
        .iter()
        .filter(|e| e.kind == EventKind::RunStatus.as_str())
        .filter_map(|e| e.payload["status"].as_str())
        .collect()
}

async fn assert_conflict(outcome: ratchet_store::Result<impl std::fmt::Debug>, says: &str) {
    match outcome {
        Err(Error::Conflict(message)) => assert!(message.contains(says), "{message}"),
        other => panic!("expected a conflict saying {says:?}, got {other:?}"),
    }
}

/// A pause asked for while a step is in flight is honoured by that step's commit: the step's
/// work is kept, the run is `paused` with no job and still holds its session, and resuming
/// gives back exactly the job the commit would have enqueued. A pause asked for between steps
/// takes effect at once.
pub async fn a_pause_stops_a_run_at_its_next_step_boundary_and_resume_takes_it_up(
    store: &dyn Store,
) {
    let session = new_session(store).await;
    let (run, _) = submit(store, &session, "work", config(), T0).await;
    let model = claim(store, OWNER_A, T0 + 1).await;
    assert!(matches!(
        pause(store, &run, T0 + 2).await,
        PauseOutcome::Pausing
    ));
    let state = load(store, &run).await;
    assert_eq!(
        state.status,
        RunStatus::Running,
        "the step in flight goes on"
    );
    assert!(state.pause_requested);

    let asked = asks_for_a_tool(&model);
    let would_run = asked.next.clone().unwrap();
    let (events, continued, enqueued) = commit(
        store,
        &model.claim,
        asked,
        Some(lease(OWNER_A, T0 + LEASE_MS)),
        T0 + 3,
    )
    .await;
    assert_eq!(statuses(&events), ["paused"]);
    assert!(
        continued.is_none() && !enqueued,
        "a paused run has no next step"
    );
    let state = load(store, &run).await;
    assert_eq!(state.status, RunStatus::Paused);
    assert!(!state.pause_requested, "the request is spent");
    assert_eq!(state.step_index, 1, "the step's work was committed");
    assert!(!store.runs_with_jobs().await.unwrap().contains(&run));
    assert_nothing_claimable(store, T0 + 4, "a paused run has no job").await;
    let again = pause(store, &run, T0 + 4).await;
    assert!(
        matches!(&again, PauseOutcome::Paused { events } if events.is_empty()),
        "pausing a paused run changes nothing: {again:?}"
    );

    let (queued, behind) = submit(store, &session, "next", config(), T0 + 5).await;
    assert_eq!(
        behind.status,
        RunStatus::Queued,
        "a paused run holds its session"
    );
    assert_eq!(
        store.get_session(&session).await.unwrap().active_run_id,
        Some(run.clone())
    );

    let ResumeOutcome::Resumed { events } = resume(store, &run, T0 + 6).await else {
        panic!("a paused run is resumed");
    };
    assert_eq!(statuses(&events), ["running"]);
    let tools = claim(store, OWNER_B, T0 + 7).await;
    assert_eq!(
        (&tools.job.run_id, tools.job.step_index, tools.job.phase),
        (&run, would_run.step_index, would_run.phase),
        "resuming gives back the job the pause took"
    );
    assert_conflict(
        store.resume_paused(&run, T0 + 7).await,
        "only a paused run can",
    )
    .await;

    // Between steps: the job nobody holds goes at once, and with it the run's place in line.
    let done = after_tools(
        tools.state.clone(),
        &tools.job,
        vec![ToolOutcome::ok("42")],
        0,
        T0 + 7,
        T0 + 8,
    );
    commit(store, &tools.claim, done, None, T0 + 8).await;
    let PauseOutcome::Paused { events } = pause(store, &run, T0 + 9).await else {
        panic!("a run between steps pauses at once");
    };
    assert_eq!(statuses(&events), ["paused"]);
    assert_nothing_claimable(store, T0 + 10, "the pause took the unclaimed job").await;
    assert_eq!(load(store, &queued).await.status, RunStatus::Queued);

    // A steer sent while paused joins the run when it resumes before a model call.
    let (_, steered) = submit_as(
        store,
        &session,
        "use metric units",
        WhenBusy::Steer,
        T0 + 11,
    )
    .await;
    assert_eq!(steered.steered_into, Some(run.clone()));
    let ResumeOutcome::Resumed { events } = resume(store, &run, T0 + 12).await else {
        panic!("a paused run is resumed");
    };
    assert_eq!(kinds(&events), ["run.status", "message.steered"]);
    let history = store.history(&session).await.unwrap();
    assert!(
        history
            .iter()
            .any(|m| m.origin == Origin::Steer && m.content == "use metric units")
    );
    let model = claim(store, OWNER_A, T0 + 13).await;
    assert_eq!(model.job.phase, Phase::ToolsBatchResult);
    assert_eq!(model.job.step_index, 3);

    assert_conflict(store.request_pause(&queued, T0 + 14).await, "is queued").await;
    let finished = after_model(
        model.state,
        &model.job,
        super::text_reply("done"),
        false,
        T0 + 14,
        T0 + 15,
    );
    commit(store, &model.claim, finished, None, T0 + 15).await;
    assert_eq!(load(store, &run).await.status, RunStatus::Completed);
    assert_conflict(
        store.request_pause(&run, T0 + 16).await,
        "is completed; only a running run can be paused",
    )
    .await;
    assert_eq!(load(store, &queued).await.status, RunStatus::Running);
}

/// A resume that reaches a run before its pause did withdraws the pause; a model call that
/// failed and waits out its backoff is a boundary where a pending pause applies.
pub async fn a_pending_pause_is_withdrawn_by_resume_and_honoured_by_a_backoff(store: &dyn Store) {
    let session = new_session(store).await;
    let (run, _) = submit(store, &session, "work", config(), T0).await;
    let model = claim(store, OWNER_A, T0 + 1).await;
    assert!(matches!(
        pause(store, &run, T0 + 2).await,
        PauseOutcome::Pausing
    ));
    assert!(matches!(
        resume(store, &run, T0 + 3).await,
        ResumeOutcome::PauseWithdrawn
    ));
    assert!(!load(store, &run).await.pause_requested);
    let asked = asks_for_a_tool(&model);
    let (events, _, _) = commit(store, &model.claim, asked, None, T0 + 4).await;
    assert!(
        statuses(&events).is_empty(),
        "a withdrawn pause does not apply"
    );
    assert_eq!(load(store, &run).await.status, RunStatus::Running);

    let tools = claim(store, OWNER_A, T0 + 5).await;
    assert!(matches!(
        pause(store, &run, T0 + 6).await,
        PauseOutcome::Pausing
    ));
    let failure = EventDraft::new(
        EventKind::ModelError,
        json!({"run_id": run, "error": "rate limited"}),
    );
    let events = store
        .retry_later(&tools.claim, T0 + 500, failure, T0 + 7)
        .await
        .unwrap()
        .expect("the holder gives its job back");
    assert_eq!(kinds(&events), ["model.error", "run.status"]);
    assert_eq!(statuses(&events), ["paused"]);
    assert_eq!(load(store, &run).await.status, RunStatus::Paused);
    assert_nothing_claimable(store, T0 + 600, "the backoff's job went with the pause").await;
    let ResumeOutcome::Resumed { .. } = resume(store, &run, T0 + 700).await else {
        panic!("a paused run is resumed");
    };
    let again = claim(store, OWNER_B, T0 + 701).await;
    assert_eq!(
        (again.job.step_index, again.job.phase),
        (tools.job.step_index, tools.job.phase)
    );
}

/// Cancel works on a paused run at once, and the session moves on to its next run.
pub async fn cancel_of_a_paused_run_frees_the_session(store: &dyn Store) {
    let session = new_session(store).await;
    let (run, _) = submit(store, &session, "work", config(), T0).await;
    let PauseOutcome::Paused { .. } = pause(store, &run, T0 + 1).await else {
        panic!("an unclaimed first job pauses at once");
    };
    let (next, _) = submit(store, &session, "after", config(), T0 + 2).await;
    let CancelOutcome::Cancelled { events, enqueued } =
        store.request_cancel(&run, T0 + 3).await.unwrap()
    else {
        panic!("a paused run has no step in flight: the cancel is immediate");
    };
    assert!(enqueued);
    assert_eq!(statuses(&events), ["cancelled", "running"]);
    assert_eq!(load(store, &run).await.status, RunStatus::Cancelled);
    assert_eq!(load(store, &next).await.status, RunStatus::Running);
    assert_conflict(store.resume_paused(&run, T0 + 4).await, "it is cancelled").await;
}

/// A pause racing the commit of the step in flight, or the claim of an unclaimed job, pauses
/// the run at one boundary, exactly once: one `paused` event, no job left behind, and the
/// resumed run goes on from the next step.
pub async fn a_pause_racing_a_step_pauses_the_run_exactly_once(store: Arc<dyn Store>) {
    let store = &*store;
    for round in 0..8 {
        let session = new_session(store).await;
        let (run, _) = submit(store, &session, "race", config(), T0).await;
        let model = claim(store, OWNER_A, T0 + 1).await;
        let asked = asks_for_a_tool(&model);
        let continue_with = (round % 2 == 0).then(|| lease(OWNER_A, T0 + LEASE_MS));
        let (paused, committed) = tokio::join!(
            store.request_pause(&run, T0 + 2),
            store.commit_step(&model.claim, asked, continue_with, T0 + 2),
        );
        let ratchet_store::Commit::Committed { continued, .. } = committed.unwrap() else {
            panic!("round {round}: the commit was refused");
        };
        // The commit saw the request, or the request found the next job unclaimed, or the
        // worker kept the next step and that step's commit pauses the run.
        let committed_steps = match (paused.unwrap(), continued) {
            (PauseOutcome::Pausing, Some(next)) => {
                assert_eq!(load(store, &run).await.status, RunStatus::Running);
                commit(store, &next.claim, goes_on(&next), None, T0 + 2).await;
                2
            }
            (_, None) => 1,
            (PauseOutcome::Paused { .. }, Some(_)) => {
                panic!("round {round}: paused at once while a worker holds the next step")
            }
        };
        assert_paused_once(store, &session, &run, committed_steps, round).await;

        let ResumeOutcome::Resumed { .. } = resume(store, &run, T0 + 3).await else {
            panic!("round {round}: a paused run is resumed");
        };
        let (paused, claimed) = tokio::join!(
            store.request_pause(&run, T0 + 4),
            store.claim_next(lease(OWNER_B, T0 + 4 + LEASE_MS), None, T0 + 4),
        );
        match (paused.unwrap(), claimed.unwrap()) {
            (PauseOutcome::Paused { .. }, None) => {}
            (PauseOutcome::Pausing, Some(step)) => {
                commit(store, &step.claim, goes_on(&step), None, T0 + 5).await;
            }
            other => {
                panic!("round {round}: the claim and the pause both won or both lost: {other:?}")
            }
        }
        assert_eq!(load(store, &run).await.status, RunStatus::Paused);
        let events = store.events_after(&session, 0, 1_000).await.unwrap();
        assert_eq!(
            statuses(&events).iter().filter(|s| **s == "paused").count(),
            2,
            "round {round}: one pause per request"
        );
        assert!(!store.runs_with_jobs().await.unwrap().contains(&run));
    }
}

async fn assert_paused_once(
    store: &dyn Store,
    session: &ratchet_core::SessionId,
    run: &RunId,
    committed_steps: u64,
    round: u32,
) {
    let state = load(store, run).await;
    assert_eq!(state.status, RunStatus::Paused, "round {round}");
    assert!(
        !state.pause_requested,
        "round {round}: the request is spent"
    );
    assert_eq!(
        state.step_index, committed_steps,
        "round {round}: the steps were committed"
    );
    let events = store.events_after(session, 0, 1_000).await.unwrap();
    assert_eq!(
        statuses(&events),
        ["running", "paused"],
        "round {round}: paused exactly once"
    );
    assert!(
        !store.runs_with_jobs().await.unwrap().contains(run),
        "round {round}: no job is left behind"
    );
}

fn asks_for_a_tool(model: &ratchet_store::ClaimedStep) -> ratchet_core::StepResult {
    after_model(
        model.state.clone(),
        &model.job,
        tool_reply(),
        false,
        T0 + 1,
        T0 + 2,
    )
}

/// A result for a claimed step that keeps the run going: a tool call asked for, or run.
fn goes_on(step: &ratchet_store::ClaimedStep) -> ratchet_core::StepResult {
    match ratchet_core::decide(&step.state, step.job.phase, T0) {
        ratchet_core::Instruction::CallToolsBatch => after_tools(
            step.state.clone(),
            &step.job,
            vec![ToolOutcome::ok("1")],
            0,
            T0,
            T0,
        ),
        _ => asks_for_a_tool(step),
    }
}
