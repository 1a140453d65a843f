//! Durable timers: a run parked on a `wait` call holds its session and one job, ready at its
//! due time; input for its session makes that job ready now; cancel and pause take effect at
//! once; the deadline sweep ends it; and one claim wins the job when it is due.

use std::sync::Arc;

use ratchet_core::step::after_model;
use ratchet_core::timer::{await_timer, wake_step};
use ratchet_core::{
    Millis, ModelReply, Phase, RunConfigSnapshot, RunId, RunStatus, SessionId, StepResult,
    StopReason, ToolCall, ToolOutcome,
};
use serde_json::{Value, json};

use super::{
    LEASE_MS, OWNER_A, OWNER_B, T0, assert_nothing_claimable, assert_one_active, claim, commit,
    commit_stale, config, kinds, lease, load, new_session, submit, submit_as, unique,
};
use ratchet_store::{
    CancelOutcome, ClaimedStep, Error, NewRun, PauseOutcome, ResumeOutcome, RunQuota, Stale, Store,
    WhenBusy,
};

/// How long after it parks each run of these tests waits.
const WAIT_MS: Millis = 60_000;

/// The model step of a run asking for `[lookup, wait]`, committed; returns the claimed tools
/// step that runs that batch.
async fn tools_step(
    store: &dyn Store,
    session: &SessionId,
    config: RunConfigSnapshot,
) -> ClaimedStep {
    submit(store, session, "remind me in a minute", config, T0).await;
    let model = claim(store, OWNER_A, T0 + 1).await;
    let reply = ModelReply {
        text: "I will look, then wait".into(),
        tool_calls: vec![
            ToolCall {
                id: "call-look".into(),
                name: "lookup".into(),
                arguments: json!({"q": "x"}),
            },
            ToolCall {
                id: "call-wait".into(),
                name: "wait".into(),
                arguments: json!({"ms": WAIT_MS}),
            },
        ],
        ..ModelReply::default()
    };
    let asked = after_model(
        model.state.clone(),
        &model.job,
        reply,
        false,
        T0 + 1,
        T0 + 2,
    );
    commit(store, &model.claim, asked, None, T0 + 2).await;
    claim(store, OWNER_A, T0 + 3).await
}

/// The tools step of `tools_step` parks the run on its wait (committed at `T0 + 4` with a
/// lease offered, which a parked run must not take), due `due`.
fn parks(tools: &ClaimedStep, due: Millis) -> StepResult {
    await_timer(
        tools.state.clone(),
        &tools.job,
        vec![Some(ToolOutcome::ok("42")), None],
        (1, due),
        T0 + 3,
        T0 + 4,
    )
}

/// A run of `session` parked on a wait of `WAIT_MS`; returns it and its due time.
async fn parked_run(store: &dyn Store, session: &SessionId) -> (RunId, Millis) {
    parked_run_with(store, session, config(), T0 + 4 + WAIT_MS).await
}

async fn parked_run_with(
    store: &dyn Store,
    session: &SessionId,
    config: RunConfigSnapshot,
    due: Millis,
) -> (RunId, Millis) {
    let tools = tools_step(store, session, config).await;
    let run = tools.job.run_id.clone();
    let (events, continued, enqueued) = commit(
        store,
        &tools.claim,
        parks(&tools, due),
        Some(lease(OWNER_A, T0 + 4 + LEASE_MS)),
        T0 + 4,
    )
    .await;
    assert_eq!(
        kinds(&events),
        ["timer.set", "run.status", "step.committed"],
        "the parking commit tells of the wait"
    );
    assert!(
        continued.is_none() && !enqueued,
        "a parked run's job is nobody's until it is due"
    );
    (run, due)
}

/// The wait's result in the wake step's messages.
fn wait_result(result: &ratchet_core::StepResult) -> Value {
    serde_json::from_str(&result.messages[1].content).expect("the wait's result is JSON")
}

/// A wait parks the run `waiting_timer`: it keeps its session and counts as unfinished, its
/// one job is nobody's and claimable at the due time and not a moment before, and the step
/// of that job records the wait's result and hands the batch to the model.
pub async fn a_wait_parks_the_run_with_one_job_ready_at_its_due_time(store: &dyn Store) {
    let session = new_session(store).await;
    let (run, due) = parked_run(store, &session).await;
    let state = load(store, &run).await;
    assert_eq!(state.status, RunStatus::WaitingTimer);
    let timer = state.timer.clone().expect("the state keeps the timer");
    assert_eq!((timer.due_at, timer.since, timer.slot), (due, T0 + 4, 1));
    assert_eq!(timer.woken_by_input, None);
    assert_eq!(
        store.runs_with_jobs().await.unwrap(),
        std::slice::from_ref(&run)
    );
    assert!(store.lease_owners().await.unwrap().is_empty());
    assert_eq!(
        store.get_session(&session).await.unwrap().active_run_id,
        Some(run.clone()),
        "a waiting run holds its session"
    );
    let refused = store
        .submit_message(
            NewRun {
                session_id: session.clone(),
                run_id: RunId::from_suffix(&unique()).unwrap(),
                message_id: ratchet_core::MessageId::from_suffix(&unique()).unwrap(),
                content: "one more".into(),
                config: config(),
                when_busy: WhenBusy::Enqueue,
                quota: RunQuota {
                    global: None,
                    per_session: Some(1),
                },
                trace: None,
                request: None,
            },
            T0 + 5,
        )
        .await;
    assert!(
        matches!(refused, Err(Error::QuotaExceeded(_))),
        "a waiting run is unfinished and counts against the run quota: {refused:?}"
    );
    assert_nothing_claimable(store, due - 1, "the timer is not due").await;

    let fired = claim(store, OWNER_B, due).await;
    assert_eq!(
        (&fired.job.run_id, fired.job.step_index, fired.job.phase),
        (&run, 3, Phase::WaitEnded)
    );
    assert_eq!(fired.state.status, RunStatus::WaitingTimer);
    let result = wake_step(fired.state.clone(), &fired.job, due, due + 5);
    assert_eq!(wait_result(&result)["woke"], "timer");
    assert_eq!(wait_result(&result)["waited_ms"], WAIT_MS + 5);
    let (events, _, enqueued) = commit(store, &fired.claim, result, None, due + 5).await;
    assert_eq!(kinds(&events)[..2], ["timer.woke", "run.status"]);
    assert_eq!(events[0].payload["woke"], "timer");
    assert!(enqueued, "the next step calls the model at once");
    let state = load(store, &run).await;
    assert_eq!((state.status, state.timer), (RunStatus::Running, None));
    assert_eq!(state.counters.tool_calls, 2, "the whole batch, once");
    let next = claim(store, OWNER_A, due + 6).await;
    assert_eq!(
        (&next.job.run_id, next.job.phase),
        (&run, Phase::ToolsBatchResult)
    );
}

/// Input for the session — a queued message, a steer — ends a wait at once, once: the
/// submit says which run it woke, that run's job is ready now, and the wake step says the
/// wait ended by input. Input that arrived while the parking step ran ends the wait in the
/// parking commit itself. A steer sent meanwhile joins the run at the wake step's commit,
/// the boundary before its next model call.
pub async fn input_for_its_session_ends_a_wait_early_once(store: &dyn Store) {
    let session = new_session(store).await;
    let (run, due) = parked_run(store, &session).await;
    let (queued, sent) = submit_as(
        store,
        &session,
        "are you there?",
        WhenBusy::Enqueue,
        T0 + 10,
    )
    .await;
    assert_eq!(sent.status, RunStatus::Queued);
    assert_eq!(
        sent.woke,
        Some(run.clone()),
        "the message woke the waiting run"
    );
    let timer = load(store, &run)
        .await
        .timer
        .expect("still parked until its step");
    assert_eq!((timer.due_at, timer.woken_by_input), (due, Some(T0 + 10)));
    let (_, steered) = submit_as(store, &session, "be brief", WhenBusy::Steer, T0 + 11).await;
    assert_eq!(steered.steered_into, Some(run.clone()));
    assert_eq!(steered.woke, None, "a wait ends once");
    let other = new_session(store).await;
    let (_, unrelated) = submit_as(store, &other, "elsewhere", WhenBusy::Enqueue, T0 + 11).await;
    assert_eq!(unrelated.woke, None);
    // The other session's run started at once; the woken run's job is ready too.
    let mut claimed = vec![
        claim(store, OWNER_B, T0 + 12).await,
        claim(store, OWNER_B, T0 + 12).await,
    ];
    claimed.retain(|c| c.job.run_id == run);
    let woken = claimed.pop().expect("the woken run's job is claimable now");
    assert_eq!(woken.job.phase, Phase::WaitEnded);
    let result = wake_step(woken.state.clone(), &woken.job, T0 + 12, T0 + 13);
    assert_eq!(wait_result(&result)["woke"], "input");
    assert_eq!(wait_result(&result)["waited_ms"], 9);
    let (events, _, _) = commit(store, &woken.claim, result, None, T0 + 13).await;
    assert_eq!(events[0].payload["woke"], "input");
    assert!(
        kinds(&events).contains(&"message.steered"),
        "the steer joins before the next model call: {:?}",
        kinds(&events)
    );
    assert_eq!(load(store, &queued).await.status, RunStatus::Queued);
    assert_one_active(store, &session).await;

    // A message queued while the parking step ran: the wait ends as it begins.
    let session = new_session(store).await;
    let tools = tools_step(store, &session, config()).await;
    let (_, early) = submit_as(store, &session, "meanwhile", WhenBusy::Enqueue, T0 + 3).await;
    assert_eq!(early.woke, None, "the run is not waiting yet");
    commit(
        store,
        &tools.claim,
        parks(&tools, T0 + 4 + WAIT_MS),
        None,
        T0 + 4,
    )
    .await;
    let state = load(store, &tools.job.run_id).await;
    assert_eq!(state.status, RunStatus::WaitingTimer);
    assert_eq!(state.timer.unwrap().woken_by_input, Some(T0 + 4));
    let woken = claim(store, OWNER_B, T0 + 5).await;
    assert_eq!(
        (&woken.job.run_id, woken.job.phase),
        (&tools.job.run_id, Phase::WaitEnded)
    );
}

/// A message queued behind a waiting run ends that wait, and the model is asked again; a wait
/// it asks for then is not ended by the same message: the model cannot see a queued message
/// before its turn ends, so waking every later wait for it would spin the turn.
pub async fn a_queued_message_ends_one_wait_of_the_turn_not_the_next(store: &dyn Store) {
    let session = new_session(store).await;
    let (run, _) = parked_run(store, &session).await;
    submit_as(
        store,
        &session,
        "are you there?",
        WhenBusy::Enqueue,
        T0 + 10,
    )
    .await;
    let woken = claim(store, OWNER_B, T0 + 12).await;
    let result = wake_step(woken.state.clone(), &woken.job, T0 + 12, T0 + 13);
    let held = Some(lease(OWNER_B, T0 + 13 + LEASE_MS));
    let (_, model, _) = commit(store, &woken.claim, result, held, T0 + 13).await;
    let model = model.expect("the model is asked next");
    let reply = ModelReply {
        tool_calls: vec![ToolCall {
            id: "call-wait-again".into(),
            name: "wait".into(),
            arguments: json!({"ms": WAIT_MS}),
        }],
        ..ModelReply::default()
    };
    let asked = after_model(
        model.state.clone(),
        &model.job,
        reply,
        false,
        T0 + 14,
        T0 + 15,
    );
    let held = Some(lease(OWNER_B, T0 + 15 + LEASE_MS));
    let (_, tools, _) = commit(store, &model.claim, asked, held, T0 + 15).await;
    let tools = tools.expect("the wait's step");
    let due = T0 + 16 + WAIT_MS;
    let parks = await_timer(
        tools.state.clone(),
        &tools.job,
        vec![None],
        (0, due),
        T0 + 16,
        T0 + 17,
    );
    commit(store, &tools.claim, parks, None, T0 + 17).await;
    let state = load(store, &run).await;
    assert_eq!(state.status, RunStatus::WaitingTimer);
    let timer = state.timer.expect("parked");
    assert_eq!(
        (timer.due_at, timer.woken_by_input),
        (due, None),
        "the message already ended a wait of this turn"
    );
}

/// A pause takes a waiting run's job away at once (even from a worker holding it: that step
/// has no effect outside the store, and its commit is refused) and keeps the due time; resumed
/// before it, the run waits again for that same time, and after it, wakes at once. Input sent
/// while it is paused ends the wait when it is resumed. A cancel ends a waiting run at once
/// and frees its session.
pub async fn a_waiting_run_is_paused_and_cancelled_at_once(store: &dyn Store) {
    let session = new_session(store).await;
    let (run, due) = parked_run(store, &session).await;
    let PauseOutcome::Paused { events } = store.request_pause(&run, T0 + 10).await.unwrap() else {
        panic!("a waiting run pauses at once");
    };
    assert_eq!(events[0].payload["status"], "paused");
    assert!(
        store.runs_with_jobs().await.unwrap().is_empty(),
        "a paused run holds no job"
    );
    assert_nothing_claimable(store, due + 1, "the pause took the timer's job").await;
    let ResumeOutcome::Resumed { events } = store.resume_paused(&run, T0 + 20).await.unwrap()
    else {
        panic!("a paused run resumes");
    };
    assert_eq!(events[0].payload["status"], "waiting_timer");
    assert_eq!(
        load(store, &run).await.timer.unwrap().due_at,
        due,
        "the same due time"
    );
    assert_nothing_claimable(store, due - 1, "it waits for the same due time").await;
    let fired = claim(store, OWNER_A, due).await;
    assert!(matches!(
        store.request_pause(&run, due + 1).await.unwrap(),
        PauseOutcome::Paused { .. }
    ));
    let late = wake_step(fired.state.clone(), &fired.job, due, due + 2);
    assert_eq!(
        commit_stale(store, &fired.claim, late, None, due + 2).await,
        Stale::LeaseLost
    );
    assert_eq!(load(store, &run).await.status, RunStatus::Paused);
    store.resume_paused(&run, due + 100).await.unwrap();
    let fired = claim(store, OWNER_A, due + 100).await;
    assert_eq!(
        (&fired.job.run_id, fired.job.phase),
        (&run, Phase::WaitEnded)
    );

    let (next, behind) = submit(store, &session, "next", config(), due + 101).await;
    assert_eq!(behind.status, RunStatus::Queued);
    let CancelOutcome::Cancelled { events, enqueued } =
        store.request_cancel(&run, due + 102).await.unwrap()
    else {
        panic!("a waiting run is cancelled at once, even while its job is held");
    };
    assert!(enqueued, "the queued run starts");
    assert!(events.iter().any(|e| e.kind == "run.finished"));
    let state = load(store, &run).await;
    assert_eq!(
        (state.status, state.stop_reason, state.timer),
        (RunStatus::Cancelled, Some(StopReason::Cancelled), None)
    );
    let late = wake_step(fired.state.clone(), &fired.job, due + 100, due + 103);
    assert_eq!(
        commit_stale(store, &fired.claim, late, None, due + 103).await,
        Stale::LeaseLost
    );
    assert_eq!(load(store, &next).await.status, RunStatus::Running);
    assert_one_active(store, &session).await;

    // Input while paused: the wait has ended when the run is resumed.
    let session = new_session(store).await;
    let (run, due) = parked_run(store, &session).await;
    store.request_pause(&run, T0 + 10).await.unwrap();
    let (_, sent) = submit_as(store, &session, "wake up", WhenBusy::Steer, T0 + 11).await;
    assert_eq!(sent.woke, Some(run.clone()));
    assert_nothing_claimable(store, T0 + 12, "a paused run has no job").await;
    store.resume_paused(&run, T0 + 13).await.unwrap();
    let woken = claim(store, OWNER_A, T0 + 14).await;
    assert_eq!(woken.job.run_id, run);
    assert!(T0 + 14 < due);
    let result = wake_step(woken.state.clone(), &woken.job, T0 + 14, T0 + 14);
    assert_eq!(wait_result(&result)["woke"], "input");
}

/// A run whose deadline falls while it waits on a timer is ended `timed_out` by the sweep at
/// the deadline, its job gone and its session freed. (The runtime refuses a wait that would
/// outlast the deadline; the sweep holds whatever state a run was left in.)
pub async fn a_run_waiting_on_a_timer_past_its_deadline_times_out(store: &dyn Store) {
    let session = new_session(store).await;
    let mut timed = config();
    timed.limits.max_duration_ms = Some(30_000);
    let (run, _) = parked_run_with(store, &session, timed, T0 + 4 + WAIT_MS).await;
    let deadline = load(store, &run).await.deadline().expect("a budget");
    assert_eq!(deadline, T0 + 30_000);
    let early = store.time_out_overdue(deadline - 1).await.unwrap();
    assert!(early.ended.is_empty(), "{early:?}");
    let swept = store.time_out_overdue(deadline).await.unwrap();
    assert_eq!(swept.ended, std::slice::from_ref(&run));
    let state = load(store, &run).await;
    assert_eq!(
        (state.status, state.stop_reason),
        (RunStatus::Failed, Some(StopReason::TimedOut))
    );
    assert!(store.runs_with_jobs().await.unwrap().is_empty());
    assert_eq!(
        store.get_session(&session).await.unwrap().active_run_id,
        None
    );
}

/// When a timer is due, many workers (of as many processes) may try to claim its job at once:
/// exactly one wins.
pub async fn concurrent_claims_of_a_due_timer_have_one_winner(store: Arc<dyn Store>) {
    let session = new_session(&*store).await;
    let (run, due) = parked_run(&*store, &session).await;
    let racers: Vec<_> = (0..8)
        .map(|i| {
            let store = Arc::clone(&store);
            let run = run.clone();
            tokio::spawn(async move {
                let only = (i % 2 == 0).then_some(&run);
                store
                    .claim_next(lease(&format!("racer-{i}"), due + LEASE_MS), only, due)
                    .await
            })
        })
        .collect();
    let mut winners = Vec::new();
    for racer in racers {
        if let Some(claimed) = racer
            .await
            .expect("claim task panicked")
            .expect("claim_next")
        {
            winners.push(claimed);
        }
    }
    assert_eq!(
        winners.len(),
        1,
        "exactly one claim takes a due timer's job"
    );
    assert_eq!(
        (
            &winners[0].job.run_id,
            winners[0].job.phase,
            winners[0].job.attempt
        ),
        (&run, Phase::WaitEnded, 1)
    );
}
