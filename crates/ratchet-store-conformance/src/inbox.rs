//! Conformance of background work and the inbox: a place is reserved when background work is
//! admitted (and refused when the inbox is full), the report fills it when the work ends, a
//! continuation turn leases due events and consumes them when it completes, a failed one gives
//! them back for a later attempt and finally to the dead letter, users and the inbox take
//! turns, and a closed session keeps its records but starts nothing.

use ratchet_core::delegation::{BackgroundGroup, ChildRun, background_started};
use ratchet_core::inbox::{Severity, SignalContract};
use ratchet_core::step::{after_model, after_tools};
use ratchet_core::{
    CompletionPolicy, Delivery, EventDraft, EventKind, InboxPolicy, InboxStatus, Lineage,
    MessageId, ModelReply, Origin, Role, RunConfigSnapshot, RunId, RunStatus, SessionId,
    StopReason, ToolCall, Visibility,
};
use serde_json::{Value, json};

use super::delegation::{claim_run, delegating_config, end_child, finish_claimed};
use super::{
    LEASE_MS, OWNER_A, T0, commit, config, kinds, lease, load, new_session, submit, tool_reply,
    unique,
};
use ratchet_store::{
    CancelOutcome, ClaimedStep, Closing, Commit, DeadLetterAction, Error, InboxEvent, NewRun,
    NewSignal, SignalOutcome, Store, WhenBusy,
};

pub(super) fn inbox_config(policy: InboxPolicy) -> RunConfigSnapshot {
    let mut config = delegating_config(64);
    config.delegation.inbox = policy;
    config
}

/// Drives `parent` through a model step asking for `tasks` background tasks and the tools
/// step that starts them; returns the children, or the commit's refusal.
async fn background(
    store: &dyn Store,
    parent: &RunId,
    tasks: usize,
    policy: CompletionPolicy,
    now: i64,
) -> Result<Vec<RunId>, Error> {
    background_signalling(store, parent, tasks, policy, None, now).await
}

/// `background`, with children that may signal under `contract`.
pub(super) async fn background_signalling(
    store: &dyn Store,
    parent: &RunId,
    tasks: usize,
    policy: CompletionPolicy,
    contract: Option<SignalContract>,
    now: i64,
) -> Result<Vec<RunId>, Error> {
    let model = claim_own(store, parent, now).await;
    let list: Vec<_> = (0..tasks)
        .map(|i| json!({"agent": "worker", "task": format!("background {i}")}))
        .collect();
    let reply = ModelReply {
        text: "starting background work".into(),
        tool_calls: vec![ToolCall {
            id: "call-b".into(),
            name: "delegate".into(),
            arguments: json!({"mode": "background", "completion_policy": policy, "tasks": list}),
        }],
        ..ModelReply::default()
    };
    let asked = after_model(model.state, &model.job, reply, false, now, now + 1);
    commit(store, &model.claim, asked, None, now + 1).await;
    let tools = claim_own(store, parent, now + 2).await;
    let state = &tools.state;
    let group = BackgroundGroup::new(&state.run_id, tools.job.step_index, 0, policy);
    let children: Vec<ChildRun> = (0..tasks as u32)
        .map(|index| {
            let suffix = unique();
            ChildRun {
                run_id: RunId::from_suffix(&suffix).unwrap(),
                session_id: SessionId::from_suffix(&suffix).unwrap(),
                message_id: MessageId::from_suffix(&suffix).unwrap(),
                task: format!("background {index}"),
                call_id: "call_0".into(),
                config: RunConfigSnapshot {
                    signal: contract.clone(),
                    ..config()
                },
                lineage: Lineage {
                    parent_run_id: state.run_id.clone(),
                    parent_step: tools.job.step_index,
                    parent_slot: 0,
                    task_index: index,
                    root_run_id: state.run_id.clone(),
                    root_session_id: state.session_id.clone(),
                    depth: 1,
                    agent: "worker".into(),
                    background: Some(group.clone()),
                },
            }
        })
        .collect();
    let ids = children.iter().map(|c| c.run_id.clone()).collect();
    let outcome = background_started(&children.iter().collect::<Vec<_>>(), policy);
    let mut result = after_tools(
        tools.state.clone(),
        &tools.job,
        vec![outcome],
        0,
        now + 2,
        now + 3,
    );
    assert_eq!(
        result.state.status,
        RunStatus::Running,
        "the parent goes on"
    );
    result.children = children;
    match store
        .commit_step(&tools.claim, result, None, now + 3)
        .await?
    {
        Commit::Committed { .. } => Ok(ids),
        Commit::Stale(stale) => panic!("the tools step was refused as stale: {stale:?}"),
    }
}

/// Claims `run`'s own job. A claim limited to a run takes its whole tree's jobs, and the
/// background runs of this suite go on beside their parent: any of theirs claimed on the way
/// is handed back.
pub(super) async fn claim_own(store: &dyn Store, run: &RunId, now: i64) -> ClaimedStep {
    for _ in 0..16 {
        let claimed = store
            .claim_next(lease(OWNER_A, now + LEASE_MS), Some(run), now)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("no job of {run}'s tree at {now}"));
        if &claimed.job.run_id == run {
            return claimed;
        }
        let back = EventDraft::new(EventKind::Activity, json!({"activity": "handed back"}));
        store
            .retry_later(&claimed.claim, now, back, now)
            .await
            .unwrap();
    }
    panic!("{run}'s own job could not be claimed at {now}")
}

pub(super) async fn inbox(store: &dyn Store, session: &SessionId) -> Vec<InboxEvent> {
    store.inbox(session, None, 0, 1_000).await.unwrap()
}

fn statuses(events: &[InboxEvent]) -> Vec<InboxStatus> {
    events.iter().map(|e| e.status).collect()
}

/// The session's active run, which must be a continuation holding exactly `events`.
async fn continuation_holding(store: &dyn Store, session: &SessionId, events: &[i64]) -> RunId {
    let active = store
        .get_session(session)
        .await
        .unwrap()
        .active_run_id
        .expect("a continuation runs");
    assert!(
        load(store, &active).await.config.continuation,
        "{active} is a continuation turn"
    );
    let held: Vec<i64> = inbox(store, session)
        .await
        .into_iter()
        .filter(|e| e.status == InboxStatus::Leased && e.lease_run_id.as_ref() == Some(&active))
        .map(|e| e.id)
        .collect();
    assert_eq!(held, events, "the events {active} holds");
    active
}

pub async fn a_full_inbox_refuses_background_work_and_never_loses_an_accepted_report(
    store: &dyn Store,
) {
    let session = new_session(store).await;
    let policy = InboxPolicy {
        capacity: 2,
        ..InboxPolicy::default()
    };
    let (parent, _) = submit(store, &session, "start work", inbox_config(policy), T0).await;
    let children = background(store, &parent, 2, CompletionPolicy::Each, T0 + 10)
        .await
        .unwrap();
    let reserved = inbox(store, &session).await;
    assert_eq!(statuses(&reserved), [InboxStatus::Reserved; 2]);
    assert_eq!(
        reserved
            .iter()
            .map(|e| e.source_run_id.clone())
            .collect::<Vec<_>>(),
        children.iter().cloned().map(Some).collect::<Vec<_>>(),
        "one place per run (completion_policy each)"
    );
    assert_eq!(store.admission(&parent).await.unwrap().inbox_held, 2);

    let refused = background(store, &parent, 1, CompletionPolicy::All, T0 + 20).await;
    assert!(
        matches!(&refused, Err(Error::QuotaExceeded(m)) if m.contains("may hold 2")),
        "a full inbox refuses more background work: {refused:?}"
    );
    assert_eq!(
        inbox(store, &session).await,
        reserved,
        "nothing was written"
    );
    assert_eq!(store.run_tree(&parent).await.unwrap().len(), 3);
    assert_eq!(
        load(store, &parent).await.step_index,
        3,
        "the refused step did not commit"
    );

    // A report that arrives while the session is busy waits; none is dropped.
    end_child(store, &children[0], Ok("first result"), T0 + 30).await;
    let after_first = inbox(store, &session).await;
    assert_eq!(
        statuses(&after_first),
        [InboxStatus::Pending, InboxStatus::Reserved]
    );
    assert_eq!(
        after_first[0].payload.as_ref().unwrap()["results"][0]["answer"],
        "first result"
    );
    assert_eq!(
        store.get_session(&session).await.unwrap().active_run_id,
        Some(parent.clone()),
        "no continuation while the session's run goes on"
    );
    assert_eq!(store.serve_inboxes(T0 + 35).await.unwrap().started, []);
    // The refused step is redone once its lease has run out, without the delegation; the run
    // ends and the turn is free.
    let redo = claim_own(store, &parent, T0 + 40 + LEASE_MS).await;
    finish_claimed(store, &redo, Ok("working on it"), T0 + 40 + LEASE_MS).await;
    assert_eq!(load(store, &parent).await.status, RunStatus::Completed);
    let first = continuation_holding(store, &session, &[after_first[0].id]).await;

    end_child(store, &children[1], Ok("second result"), T0 + LEASE_MS + 50).await;
    assert_eq!(
        statuses(&inbox(store, &session).await),
        [InboxStatus::Leased, InboxStatus::Pending]
    );
    let step = claim_run(store, &first, T0 + LEASE_MS + 60).await;
    finish_claimed(
        store,
        &step,
        Ok("the first task is done"),
        T0 + LEASE_MS + 60,
    )
    .await;
    let second = continuation_holding(store, &session, &[after_first[1].id]).await;
    assert_ne!(first, second);
    let step = claim_run(store, &second, T0 + LEASE_MS + 70).await;
    finish_claimed(
        store,
        &step,
        Ok("the second task is done"),
        T0 + LEASE_MS + 70,
    )
    .await;

    let done = inbox(store, &session).await;
    assert_eq!(statuses(&done), [InboxStatus::Consumed; 2]);
    assert_eq!(
        done.iter()
            .map(|e| e.lease_run_id.clone())
            .collect::<Vec<_>>(),
        [Some(first.clone()), Some(second.clone())]
    );
    assert_eq!(done.iter().map(|e| e.attempts).collect::<Vec<_>>(), [1, 1]);
    assert_eq!(
        store.get_session(&session).await.unwrap().active_run_id,
        None
    );

    let visible = store.visible_messages(&session, 0, 1_000).await.unwrap();
    let shown: Vec<(Role, Origin, &str)> = visible
        .iter()
        .map(|m| (m.message.role, m.message.origin, m.message.content.as_str()))
        .collect();
    assert_eq!(
        shown[shown.len() - 2..],
        [
            (
                Role::Assistant,
                Origin::Continuation,
                "the first task is done"
            ),
            (
                Role::Assistant,
                Origin::Continuation,
                "the second task is done"
            ),
        ],
        "the continuations' answers are visible, marked as continuation"
    );
    assert!(
        !visible
            .iter()
            .any(|m| m.message.content.contains("[runtime]")),
        "the hidden triggers never reach client history"
    );
    let history = store.history(&session).await.unwrap();
    let triggers: Vec<_> = history
        .iter()
        .filter(|m| m.origin == Origin::Continuation && m.role == Role::User)
        .collect();
    assert_eq!(triggers.len(), 2, "one hidden trigger per continuation");
    assert!(triggers.iter().all(|m| m.visibility == Visibility::Hidden
        && m.content.contains("the user did not write this message")));
    assert!(triggers[0].content.contains("first result"));

    let events = store.events_after(&session, 0, 10_000).await.unwrap();
    let created: Vec<&Value> = events
        .iter()
        .filter(|e| e.kind == EventKind::RunCreated.as_str())
        .map(|e| &e.payload)
        .collect();
    assert_eq!(created.len(), 3, "the user's run and two continuations");
    assert!(
        created[0]["content"].is_string() && created[0].get("origin").is_none(),
        "a user's run is created with its message: {}",
        created[0]
    );
    assert!(
        created[1..]
            .iter()
            .all(|p| p["origin"] == "continuation" && p.get("content").is_none()),
        "a continuation's creation tells its origin, never its hidden trigger: {created:?}"
    );
    let inbox_kinds: Vec<&str> = kinds(&events)
        .into_iter()
        .filter(|k| k.starts_with("inbox."))
        .collect();
    assert_eq!(
        inbox_kinds,
        [
            "inbox.reserved",
            "inbox.reserved",
            "inbox.pending",
            "inbox.leased",
            "inbox.pending",
            "inbox.consumed",
            "inbox.leased",
            "inbox.consumed"
        ]
    );
    assert_eq!(store.admission(&parent).await.unwrap().inbox_held, 0);
}

pub async fn a_group_reports_once_when_its_last_run_ends(store: &dyn Store) {
    let session = new_session(store).await;
    let (parent, _) = submit(
        store,
        &session,
        "start work",
        inbox_config(InboxPolicy::default()),
        T0,
    )
    .await;
    let children = background(store, &parent, 3, CompletionPolicy::All, T0 + 10)
        .await
        .unwrap();
    let step = claim_own(store, &parent, T0 + 20).await;
    finish_claimed(store, &step, Ok("they are running"), T0 + 20).await;
    let place = inbox(store, &session).await;
    assert_eq!(
        statuses(&place),
        [InboxStatus::Reserved],
        "one place for the group"
    );
    assert!(place[0].group.is_some() && place[0].source_run_id.is_none());

    end_child(store, &children[2], Ok("c"), T0 + 30).await;
    end_child(
        store,
        &children[0],
        Err(StopReason::BudgetExhausted),
        T0 + 40,
    )
    .await;
    assert_eq!(
        statuses(&inbox(store, &session).await),
        [InboxStatus::Reserved],
        "the group reports when its last run ends"
    );
    assert_eq!(
        store.get_session(&session).await.unwrap().active_run_id,
        None
    );
    end_child(store, &children[1], Ok("b"), T0 + 50).await;
    let reported = inbox(store, &session).await;
    assert_eq!(statuses(&reported), [InboxStatus::Leased]);
    let results = &reported[0].payload.as_ref().unwrap()["results"];
    assert_eq!(
        (0..3)
            .map(|i| (results[i]["run_id"].clone(), results[i]["status"].clone()))
            .collect::<Vec<_>>(),
        [
            (json!(children[0]), json!("failed")),
            (json!(children[1]), json!("completed")),
            (json!(children[2]), json!("completed")),
        ],
        "every run's outcome, in task order"
    );
    continuation_holding(store, &session, &[reported[0].id]).await;
}

/// A continuation takes only the due events its trigger can carry within its budget (here a
/// prompt budget so small that one event's worth is all it shows); the others stay pending,
/// and the next turn takes them once it has ended.
pub async fn a_continuation_takes_only_the_reports_its_trigger_carries(store: &dyn Store) {
    let session = new_session(store).await;
    let mut config = inbox_config(InboxPolicy::default());
    config.limits.max_prompt_tokens = Some(1);
    let (parent, _) = submit(store, &session, "start work", config, T0).await;
    let children = background(store, &parent, 2, CompletionPolicy::Each, T0 + 10)
        .await
        .unwrap();
    end_child(store, &children[0], Ok("first"), T0 + 20).await;
    end_child(store, &children[1], Ok("second"), T0 + 30).await;
    let reported = inbox(store, &session).await;
    assert_eq!(
        statuses(&reported),
        [InboxStatus::Pending, InboxStatus::Pending],
        "the session is busy: both reports wait"
    );
    let step = claim_own(store, &parent, T0 + 40).await;
    finish_claimed(store, &step, Ok("they ran"), T0 + 40).await;
    let first = continuation_holding(store, &session, &[reported[0].id]).await;
    let trigger = store.context(&session, &first).await.unwrap();
    let shown = &trigger.last().unwrap().message.content;
    assert!(
        shown.contains(&format!("\"event\": {}", reported[0].id))
            && !shown.contains(&format!("\"event\": {}", reported[1].id)),
        "the trigger shows what the turn holds: {shown}"
    );
    assert_eq!(
        inbox(store, &session).await[1].status,
        InboxStatus::Pending,
        "the report the trigger could not carry waits"
    );
    let turn = claim_own(store, &first, T0 + 50).await;
    finish_claimed(store, &turn, Ok("told the first"), T0 + 50).await;
    continuation_holding(store, &session, &[reported[1].id]).await;
}

/// A session whose first run started `tasks` background runs (`each`) and answered, the first
/// of which has reported: a continuation turn holds its report. Returns the session, its first
/// run and the report's event.
async fn first_report(
    store: &dyn Store,
    policy: InboxPolicy,
    tasks: usize,
) -> (SessionId, RunId, i64) {
    let session = new_session(store).await;
    let (parent, _) = submit(store, &session, "start work", inbox_config(policy), T0).await;
    let children = background(store, &parent, tasks, CompletionPolicy::Each, T0 + 10)
        .await
        .unwrap();
    let step = claim_own(store, &parent, T0 + 20).await;
    finish_claimed(store, &step, Ok("it runs"), T0 + 20).await;
    end_child(store, &children[0], Ok("result"), T0 + 30).await;
    let event = inbox(store, &session).await[0].id;
    (session, parent, event)
}

pub async fn a_failing_continuation_is_retried_then_dead_lettered(store: &dyn Store) {
    let policy = InboxPolicy {
        max_attempts: 2,
        retry_backoff_ms: 1_000,
        ..InboxPolicy::default()
    };
    let (session, parent, event) = first_report(store, policy, 1).await;
    let first = continuation_holding(store, &session, &[event]).await;

    let step = claim_run(store, &first, T0 + 40).await;
    finish_claimed(store, &step, Err(StopReason::LlmError), T0 + 40).await;
    let released = inbox(store, &session).await;
    assert_eq!(
        (
            released[0].status,
            released[0].attempts,
            released[0].available_at
        ),
        (InboxStatus::Pending, 1, Some(T0 + 41 + 1_000)),
        "a failed continuation gives its events back for a later attempt"
    );
    assert!(released[0].reason.as_deref().unwrap().contains("llm_error"));
    assert_eq!(
        store.get_session(&session).await.unwrap().active_run_id,
        None
    );
    assert_eq!(
        store.serve_inboxes(T0 + 1_000).await.unwrap().started,
        [],
        "not before its backoff"
    );
    let served = store.serve_inboxes(T0 + 1_041).await.unwrap();
    assert_eq!(served.started.len(), 1);
    let second = continuation_holding(store, &session, &[event]).await;
    assert_eq!(served.started, std::slice::from_ref(&second));
    assert!(kinds(&served.events).contains(&"inbox.leased"));
    assert_eq!(
        store.serve_inboxes(T0 + 1_042).await.unwrap().started,
        [],
        "one continuation at a time"
    );

    let step = claim_run(store, &second, T0 + 1_050).await;
    finish_claimed(store, &step, Err(StopReason::LlmError), T0 + 1_050).await;
    let dead = inbox(store, &session).await;
    assert_eq!(
        (dead[0].status, dead[0].attempts),
        (InboxStatus::DeadLetter, 2),
        "the last attempt's failure dead-letters the event"
    );
    assert_eq!(
        store
            .inbox(&session, Some(InboxStatus::DeadLetter), 0, 10)
            .await
            .unwrap()
            .len(),
        1
    );
    assert_eq!(store.serve_inboxes(T0 + 100_000).await.unwrap().started, []);
    assert_eq!(store.admission(&parent).await.unwrap().inbox_held, 0);
    let refused = store
        .resume_failed(
            &second,
            ratchet_core::step::Resumption::Retry,
            None,
            T0 + 100_000,
        )
        .await;
    assert!(
        matches!(refused, Err(Error::Conflict(_))),
        "a continuation is retried by the inbox, not by hand: {refused:?}"
    );
}

/// Stops a running continuation turn: its cancel, and the cancel step a worker then runs.
async fn stop(store: &dyn Store, run: &RunId, now: i64) {
    if let CancelOutcome::Cancelling { .. } = store.request_cancel(run, now).await.unwrap() {
        let step = claim_run(store, run, now + 1).await;
        finish_claimed(store, &step, Err(StopReason::Cancelled), now + 1).await;
    }
    assert_eq!(load(store, run).await.status, RunStatus::Cancelled);
}

/// A continuation someone stops, by a cancel or by a message that interrupts it, gives its
/// reports back without the attempt counting. They wait for the session's next user turn (a
/// stopped turn does not start again on its own), and the continuation after that turn tells
/// them. Only closing the session dead-letters them.
pub async fn a_stopped_continuation_gives_its_reports_back_for_after_the_next_user_turn(
    store: &dyn Store,
) {
    let policy = InboxPolicy {
        max_attempts: 1,
        ..InboxPolicy::default()
    };
    let (session, _, event) = first_report(store, policy, 1).await;
    let first = continuation_holding(store, &session, &[event]).await;

    stop(store, &first, T0 + 40).await;
    let held = inbox(store, &session).await;
    assert_eq!(
        (held[0].status, held[0].attempts, held[0].available_at),
        (InboxStatus::Pending, 0, None),
        "a cancelled continuation gives its events back, the attempt not counted, held"
    );
    assert!(held[0].reason.as_deref().unwrap().contains("cancelled"));
    assert_eq!(
        store.get_session(&session).await.unwrap().active_run_id,
        None
    );
    assert_eq!(
        store.serve_inboxes(T0 + 10_000_000).await.unwrap().started,
        [],
        "a stopped turn does not start again on its own"
    );

    let (user, _) = submit(store, &session, "something else", config(), T0 + 50).await;
    let step = claim_run(store, &user, T0 + 60).await;
    finish_claimed(store, &step, Ok("answered"), T0 + 60).await;
    let second = continuation_holding(store, &session, &[event]).await;
    assert_eq!(
        inbox(store, &session).await[0].attempts,
        1,
        "the continuation after the user's turn tells the report, on its first counted attempt"
    );

    let interrupting = NewRun {
        session_id: session.clone(),
        run_id: RunId::from_suffix(&unique()).unwrap(),
        message_id: MessageId::from_suffix(&unique()).unwrap(),
        content: "stop, do this instead".into(),
        config: config(),
        when_busy: WhenBusy::Interrupt,
        quota: Default::default(),
        trace: None,
        request: None,
    };
    let user = interrupting.run_id.clone();
    let submitted = store.submit_message(interrupting, T0 + 70).await.unwrap();
    assert_eq!(submitted.interrupted.as_ref(), Some(&second));
    if load(store, &second).await.status == RunStatus::Cancelling {
        let step = claim_run(store, &second, T0 + 71).await;
        finish_claimed(store, &step, Err(StopReason::Cancelled), T0 + 71).await;
    }
    let held = inbox(store, &session).await;
    assert_eq!(
        (held[0].status, held[0].attempts),
        (InboxStatus::Pending, 0),
        "an interrupted continuation gives its events back the same way"
    );
    assert_eq!(
        store.get_session(&session).await.unwrap().active_run_id,
        Some(user.clone()),
        "the interrupting message's turn runs first"
    );
    let step = claim_run(store, &user, T0 + 80).await;
    finish_claimed(store, &step, Ok("done that"), T0 + 80).await;
    let third = continuation_holding(store, &session, &[event]).await;
    let step = claim_run(store, &third, T0 + 90).await;
    finish_claimed(store, &step, Ok("reported"), T0 + 90).await;
    let told = inbox(store, &session).await;
    assert_eq!(
        (told[0].status, told[0].lease_run_id.as_ref()),
        (InboxStatus::Consumed, Some(&third)),
        "the report is told once, by the turn that completed"
    );
}

/// A continuation's messages join the session's history only with the commit that completes
/// it and consumes its reports: attempts that failed after answering in part leave no trigger
/// and no text behind, so the model and the user see the report told once. What the failed
/// attempts said stays in their runs' events.
pub async fn a_continuation_that_fails_after_answering_in_part_tells_its_report_once(
    store: &dyn Store,
) {
    let policy = InboxPolicy {
        max_attempts: 3,
        retry_backoff_ms: 1_000,
        ..InboxPolicy::default()
    };
    let (session, _, event) = first_report(store, policy, 1).await;
    let before = store.history(&session).await.unwrap();

    let mut now = T0 + 40;
    let mut failed = Vec::new();
    for _ in 0..2 {
        let attempt = continuation_holding(store, &session, &[event]).await;
        let model = claim_run(store, &attempt, now).await;
        let answered = after_model(model.state, &model.job, tool_reply(), false, now, now + 1);
        commit(store, &model.claim, answered, None, now + 1).await;
        let context = store.context(&session, &attempt).await.unwrap();
        assert_eq!(
            context.len(),
            before.len() + 2,
            "the turn sees its own trigger and answer"
        );
        let tools = claim_run(store, &attempt, now + 2).await;
        finish_claimed(store, &tools, Err(StopReason::LlmError), now + 2).await;
        assert_eq!(
            store.history(&session).await.unwrap(),
            before,
            "a failed attempt leaves nothing in the session's history"
        );
        now += 10_000;
        store.serve_inboxes(now).await.unwrap();
        failed.push(attempt);
    }
    let last = continuation_holding(store, &session, &[event]).await;
    let model = claim_run(store, &last, now).await;
    assert_eq!(
        store.context(&session, &last).await.unwrap().len(),
        before.len() + 1,
        "the third attempt sees one trigger, its own"
    );
    finish_claimed(store, &model, Ok("the report, told once"), now).await;
    assert_eq!(
        inbox(store, &session).await[0].status,
        InboxStatus::Consumed
    );

    let history = store.history(&session).await.unwrap();
    let triggers = (history.iter())
        .filter(|m| m.origin == Origin::Continuation && m.visibility == Visibility::Hidden)
        .count();
    let told: Vec<&str> = (history.iter())
        .filter(|m| m.origin == Origin::Continuation && m.visibility == Visibility::Visible)
        .map(|m| m.content.as_str())
        .collect();
    assert_eq!(
        (triggers, told),
        (1, vec!["the report, told once"]),
        "the model's history holds the completed turn alone"
    );
    let visible: Vec<String> = (store.visible_messages(&session, 0, 100).await.unwrap())
        .into_iter()
        .map(|m| m.message.content)
        .collect();
    assert_eq!(
        visible.iter().filter(|c| *c == "let me look").count(),
        0,
        "clients never list what a failed attempt said: {visible:?}"
    );
    assert_eq!(
        visible.last().map(String::as_str),
        Some("the report, told once")
    );
    for attempt in &failed {
        let said = store.run_events_after(attempt, 0, 100).await.unwrap();
        assert!(
            kinds(&said).contains(&"assistant.message"),
            "what {attempt} said stays in its events"
        );
    }
}

/// An operator acts on a dead letter: a requeue puts it back to pending with its attempts
/// counted afresh and starts a continuation with it; a discard drops it for good, saying who.
/// Repeats change nothing; an event that is not a dead letter, and a closed session's dead
/// letters, are refused.
pub async fn an_operator_requeues_or_discards_a_dead_letter_once(store: &dyn Store) {
    let policy = InboxPolicy {
        max_attempts: 1,
        ..InboxPolicy::default()
    };
    let (session, _, event) = first_report(store, policy, 2).await;
    let refused = store
        .act_on_dead_letter(&session, event, DeadLetterAction::Discard, "ops", T0 + 31)
        .await;
    assert!(
        matches!(&refused, Err(Error::Conflict(m)) if m.contains("leased")),
        "a leased event: {refused:?}"
    );
    let missing = store
        .act_on_dead_letter(
            &session,
            1_000_000,
            DeadLetterAction::Requeue,
            "ops",
            T0 + 31,
        )
        .await;
    assert!(
        matches!(missing, Err(Error::NotFound { .. })),
        "{missing:?}"
    );
    let first = continuation_holding(store, &session, &[event]).await;
    let step = claim_run(store, &first, T0 + 40).await;
    finish_claimed(store, &step, Err(StopReason::LlmError), T0 + 40).await;
    assert_eq!(
        inbox(store, &session).await[0].status,
        InboxStatus::DeadLetter
    );

    let requeued = store
        .act_on_dead_letter(&session, event, DeadLetterAction::Requeue, "ops", T0 + 50)
        .await
        .unwrap();
    assert!(
        requeued.enqueued,
        "the free session starts a continuation with it"
    );
    assert!(kinds(&requeued.events).contains(&"inbox.requeued"));
    assert_eq!(
        (
            requeued.event.status,
            requeued.event.attempts,
            requeued.event.requeued_at
        ),
        (InboxStatus::Leased, 1, Some(T0 + 50)),
        "pending again, its attempts afresh, and leased to the new turn at once"
    );
    assert!(
        requeued
            .event
            .reason
            .as_deref()
            .unwrap()
            .starts_with("requeued by ops")
    );
    let repeat = store
        .act_on_dead_letter(&session, event, DeadLetterAction::Requeue, "ops", T0 + 51)
        .await
        .unwrap();
    assert_eq!((repeat.event, repeat.events.len()), (requeued.event, 0));
    let second = continuation_holding(store, &session, &[event]).await;
    let step = claim_run(store, &second, T0 + 60).await;
    finish_claimed(store, &step, Err(StopReason::LlmError), T0 + 60).await;

    let discarded = store
        .act_on_dead_letter(&session, event, DeadLetterAction::Discard, "alice", T0 + 70)
        .await
        .unwrap();
    assert_eq!(
        (discarded.event.status, discarded.event.updated_at),
        (InboxStatus::Discarded, T0 + 70)
    );
    assert!(
        discarded
            .event
            .reason
            .as_deref()
            .unwrap()
            .starts_with("discarded by alice")
    );
    assert!(kinds(&discarded.events).contains(&"inbox.discarded"));
    let repeat = store
        .act_on_dead_letter(&session, event, DeadLetterAction::Discard, "alice", T0 + 71)
        .await
        .unwrap();
    assert_eq!((repeat.event, repeat.events.len()), (discarded.event, 0));
    let refused = store
        .act_on_dead_letter(&session, event, DeadLetterAction::Requeue, "ops", T0 + 72)
        .await;
    assert!(matches!(refused, Err(Error::Conflict(_))), "{refused:?}");

    store
        .close_session(&session, Closing::Archive, T0 + 80)
        .await
        .unwrap();
    let reserved = inbox(store, &session).await[1].id;
    let refused = store
        .act_on_dead_letter(
            &session,
            reserved,
            DeadLetterAction::Requeue,
            "ops",
            T0 + 81,
        )
        .await;
    assert!(
        matches!(&refused, Err(Error::Conflict(m)) if m.contains("closed")),
        "a closed session's dead letter: {refused:?}"
    );
}

/// A report nobody tells within its policy's max age goes to the dead letter as expired —
/// one held after a stopped continuation too — and a requeue gives it a fresh max age.
pub async fn a_report_untold_past_its_max_age_expires(store: &dyn Store) {
    let policy = InboxPolicy {
        max_attempts: 1,
        max_age_ms: 1_000,
        ..InboxPolicy::default()
    };
    let (session, _, event) = first_report(store, policy, 1).await;
    let first = continuation_holding(store, &session, &[event]).await;
    stop(store, &first, T0 + 40).await;
    let held = &inbox(store, &session).await[0];
    assert_eq!(
        (held.status, held.available_at, held.expires_at),
        (InboxStatus::Pending, None, Some(T0 + 31 + 1_000)),
        "held for the next user turn; its max age counts from when it was written (T0 + 31)"
    );
    assert!(
        store
            .serve_inboxes(T0 + 1_030)
            .await
            .unwrap()
            .events
            .is_empty()
    );
    let served = store.serve_inboxes(T0 + 1_031).await.unwrap();
    assert!(
        kinds(&served.events).contains(&"inbox.dead_lettered"),
        "{served:?}"
    );
    let expired = &inbox(store, &session).await[0];
    assert_eq!(expired.status, InboxStatus::DeadLetter);
    assert!(
        expired.reason.as_deref().unwrap().starts_with("expired"),
        "{expired:?}"
    );

    let requeued = store
        .act_on_dead_letter(
            &session,
            event,
            DeadLetterAction::Requeue,
            "ops",
            T0 + 2_000,
        )
        .await
        .unwrap();
    assert_eq!(
        requeued.event.expires_at,
        Some(T0 + 3_000),
        "a fresh max age"
    );
}

pub async fn users_and_the_inbox_take_turns(store: &dyn Store) {
    let session = new_session(store).await;
    let policy = InboxPolicy {
        user_turns_before_inbox: 2,
        ..InboxPolicy::default()
    };
    let (parent, _) = submit(store, &session, "start work", inbox_config(policy), T0).await;
    let children = background(store, &parent, 1, CompletionPolicy::Each, T0 + 10)
        .await
        .unwrap();
    let (second_user, _) = submit(store, &session, "next question", config(), T0 + 12).await;
    let (third_user, _) = submit(store, &session, "and another", config(), T0 + 13).await;
    end_child(store, &children[0], Ok("result"), T0 + 20).await;
    let event = inbox(store, &session).await[0].id;

    let step = claim_own(store, &parent, T0 + 30).await;
    finish_claimed(store, &step, Ok("first answer"), T0 + 30).await;
    assert_eq!(
        store.get_session(&session).await.unwrap().active_run_id,
        Some(second_user.clone()),
        "a user turn goes first while the inbox has not waited too long"
    );
    let step = claim_run(store, &second_user, T0 + 40).await;
    finish_claimed(store, &step, Ok("second answer"), T0 + 40).await;
    let continuation = continuation_holding(store, &session, &[event]).await;
    assert_eq!(
        load(store, &third_user).await.status,
        RunStatus::Queued,
        "after two user turns in a row, the due event goes before the third"
    );
    let step = claim_run(store, &continuation, T0 + 50).await;
    finish_claimed(store, &step, Ok("reported"), T0 + 50).await;
    assert_eq!(
        store.get_session(&session).await.unwrap().active_run_id,
        Some(third_user),
        "then the queued user turn"
    );
}

pub async fn closing_a_session_cancels_its_background_work_and_empties_its_inbox(
    store: &dyn Store,
) {
    let session = new_session(store).await;
    let (parent, _) = submit(
        store,
        &session,
        "start work",
        inbox_config(InboxPolicy::default()),
        T0,
    )
    .await;
    let children = background(store, &parent, 2, CompletionPolicy::Each, T0 + 10)
        .await
        .unwrap();
    end_child(store, &children[0], Ok("result"), T0 + 20).await;
    let cancel = store.request_cancel(&parent, T0 + 25).await.unwrap();
    assert!(matches!(
        cancel,
        ratchet_store::CancelOutcome::Cancelling { .. }
    ));
    assert_eq!(
        load(store, &children[1]).await.status,
        RunStatus::Running,
        "a background run outlives its parent's cancel: it belongs to the session"
    );
    let (queued, _) = submit(store, &session, "later", config(), T0 + 26).await;

    let closed = store
        .close_session(&session, Closing::Archive, T0 + 30)
        .await
        .unwrap();
    assert!(kinds(&closed.events).contains(&"session.closed"));
    assert_eq!(
        load(store, &children[1]).await.status,
        RunStatus::Cancelling
    );
    assert_eq!(load(store, &queued).await.status, RunStatus::Cancelled);
    let dead = inbox(store, &session).await;
    assert_eq!(statuses(&dead), [InboxStatus::DeadLetter; 2]);
    assert!(
        dead.iter()
            .all(|e| e.reason.as_deref() == Some("the session was archived"))
    );
    let archived = store.get_session(&session).await.unwrap();
    assert!(archived.archived_at.is_some() && archived.deleted_at.is_none());

    // The runs wind down; nothing reports and nothing starts.
    let step = claim_run(store, &children[1], T0 + 40).await;
    finish_claimed(store, &step, Ok("late"), T0 + 40).await;
    let step = claim_own(store, &parent, T0 + 41).await;
    finish_claimed(store, &step, Ok("late"), T0 + 41).await;
    assert_eq!(
        statuses(&inbox(store, &session).await),
        [InboxStatus::DeadLetter; 2]
    );
    assert_eq!(store.serve_inboxes(T0 + 100_000).await.unwrap().started, []);
    assert_eq!(
        store.get_session(&session).await.unwrap().active_run_id,
        None
    );
    let refused = store
        .submit_message(
            ratchet_store::NewRun {
                session_id: session.clone(),
                run_id: RunId::from_suffix(&unique()).unwrap(),
                message_id: MessageId::from_suffix(&unique()).unwrap(),
                content: "hello?".into(),
                config: config(),
                when_busy: ratchet_store::WhenBusy::Enqueue,
                quota: Default::default(),
                trace: None,
                request: None,
            },
            T0 + 50,
        )
        .await;
    assert!(matches!(refused, Err(Error::Conflict(_))), "{refused:?}");
    assert!(matches!(
        store
            .close_session(&session, Closing::Archive, T0 + 51)
            .await,
        Err(Error::Conflict(_))
    ));

    store
        .close_session(&session, Closing::Delete, T0 + 60)
        .await
        .unwrap();
    assert!(
        store
            .get_session(&session)
            .await
            .unwrap()
            .deleted_at
            .is_some()
    );
    let listed = store
        .list_sessions(
            ratchet_store::DEFAULT_TENANT,
            &ratchet_store::SessionQuery::default(),
            10_000,
        )
        .await
        .unwrap();
    assert!(
        !listed.iter().any(|s| s.id == session),
        "a deleted session is not listed"
    );
    assert_eq!(inbox(store, &session).await.len(), 2, "its records stay");
    assert!(matches!(
        store
            .close_session(&session, Closing::Delete, T0 + 61)
            .await,
        Err(Error::NotFound { .. })
    ));
    let child_session = store.run_tree(&parent).await.unwrap()[1].session_id.clone();
    assert!(matches!(
        store
            .close_session(&child_session, Closing::Archive, T0 + 62)
            .await,
        Err(Error::Invalid(_))
    ));
}

fn contract(delivery: Delivery) -> SignalContract {
    SignalContract {
        max_count: 2,
        min_interval_ms: 100,
        max_bytes: 1_000,
        severities: vec![Severity::Info, Severity::Warning],
        dedupe_window_ms: 1_000,
        delivery,
        max_burst: 1,
        max_depth: 8,
    }
}

/// A signal of the claimed step's call `call` (keys are per run, as the engine's are).
fn signal(step: &ClaimedStep, call: &str, key: &str) -> NewSignal {
    NewSignal {
        call_key: format!("{}#{call}", step.claim.run_id),
        dedupe_key: key.to_owned(),
        payload: json!({"summary": key}),
    }
}

async fn emit(
    store: &dyn Store,
    step: &ClaimedStep,
    call: &str,
    key: &str,
    now: i64,
) -> SignalOutcome {
    store
        .emit_signal(&step.claim, signal(step, call, key), now)
        .await
        .unwrap()
        .outcome
}

/// A new session whose run has started `tasks` background runs (one group, reporting under
/// `policy`) that may signal under `contract(delivery)`, and the first one's first step, claimed.
async fn signalling_child(
    store: &dyn Store,
    delivery: Delivery,
    tasks: usize,
    policy: CompletionPolicy,
) -> (SessionId, RunId, ClaimedStep) {
    let session = new_session(store).await;
    let config = inbox_config(InboxPolicy::default());
    let (parent, _) = submit(store, &session, "start work", config, T0).await;
    let contract = Some(contract(delivery));
    let children = background_signalling(store, &parent, tasks, policy, contract, T0 + 10)
        .await
        .unwrap();
    let child = claim_run(store, &children[0], T0 + 20).await;
    (session, parent, child)
}

pub async fn signals_follow_their_contract_and_a_cancelled_runs_unread_ones_are_superseded(
    store: &dyn Store,
) {
    let (session, parent, child) =
        signalling_child(store, Delivery::Queue, 2, CompletionPolicy::All).await;
    let child_run = child.job.run_id.clone();
    let sent = emit(store, &child, "c1", "half way", T0 + 20).await;
    let SignalOutcome::Sent(first) = sent else {
        panic!("the first signal is sent: {sent:?}");
    };
    assert_eq!(
        emit(store, &child, "c1", "half way", T0 + 21).await,
        SignalOutcome::Duplicate(first),
        "the same call sends nothing twice"
    );
    assert_eq!(
        emit(store, &child, "c2", "half way", T0 + 500).await,
        SignalOutcome::Duplicate(first),
        "a repeat within the dedupe window is not sent"
    );
    assert!(
        matches!(emit(store, &child, "c3", "more", T0 + 50).await, SignalOutcome::Refused(m) if m.contains("100 ms apart")),
        "too soon after the last one"
    );
    let SignalOutcome::Sent(second) = emit(store, &child, "c4", "more", T0 + 200).await else {
        panic!("a signal after the interval is sent");
    };
    assert!(
        matches!(emit(store, &child, "c5", "even more", T0 + 400).await, SignalOutcome::Refused(m) if m.contains("at most 2")),
        "the contract's count is a limit"
    );
    let own = claim_own(store, &parent, T0 + 410).await;
    let foreground = store
        .emit_signal(&own.claim, signal(&own, "p1", "x"), T0 + 410)
        .await
        .unwrap()
        .outcome;
    assert!(
        matches!(foreground, SignalOutcome::Refused(_)),
        "a run that is not in the background sends no signal: {foreground:?}"
    );
    let pending: Vec<(i64, InboxStatus)> = inbox(store, &session)
        .await
        .iter()
        .filter(|e| e.kind == ratchet_core::InboxKind::Signal)
        .map(|e| (e.id, e.status))
        .collect();
    assert_eq!(
        pending,
        [
            (first, InboxStatus::Pending),
            (second, InboxStatus::Pending)
        ],
        "signals wait while the session is busy"
    );

    let cancel = store.request_cancel(&child_run, T0 + 420).await.unwrap();
    assert!(matches!(
        cancel,
        ratchet_store::CancelOutcome::Cancelling { .. }
    ));
    let refused = store
        .emit_signal(&child.claim, signal(&child, "c6", "late"), T0 + 430)
        .await;
    assert!(
        matches!(refused, Err(Error::CancelRequested { .. })),
        "no signal after a cancel: {refused:?}"
    );
    let step = ratchet_core::step::finish_step(
        child.state.clone(),
        &child.job,
        StopReason::Cancelled,
        T0 + 440,
        T0 + 441,
    );
    commit(store, &child.claim, step, None, T0 + 441).await;
    assert_eq!(load(store, &child_run).await.status, RunStatus::Cancelled);
    let after: Vec<(ratchet_core::InboxKind, InboxStatus)> = inbox(store, &session)
        .await
        .iter()
        .map(|e| (e.kind, e.status))
        .collect();
    assert_eq!(
        after,
        [
            (
                ratchet_core::InboxKind::GroupCompletion,
                InboxStatus::Reserved
            ),
            (ratchet_core::InboxKind::Signal, InboxStatus::Superseded),
            (ratchet_core::InboxKind::Signal, InboxStatus::Superseded),
        ],
        "the cancelled run's unread signals are superseded at once; its group reports when its other run ends"
    );
}

pub async fn a_steered_signal_joins_the_active_run_at_its_next_model_call(store: &dyn Store) {
    let (session, parent, child) =
        signalling_child(store, Delivery::Steer, 1, CompletionPolicy::Each).await;
    let SignalOutcome::Sent(id) = emit(store, &child, "c1", "found it", T0 + 20).await else {
        panic!("sent");
    };
    // The parent's next step asks for a tool: not yet a model call.
    let model = claim_own(store, &parent, T0 + 30).await;
    let asked = after_model(
        model.state,
        &model.job,
        super::tool_reply(),
        false,
        T0 + 30,
        T0 + 31,
    );
    commit(store, &model.claim, asked, None, T0 + 31).await;
    assert_eq!(
        statuses(&inbox(store, &session).await)[1],
        InboxStatus::Pending
    );
    // The tools step leads to a model call: the boundary.
    let tools = claim_own(store, &parent, T0 + 40).await;
    let done = after_tools(
        tools.state,
        &tools.job,
        vec![ratchet_core::ToolOutcome::ok("looked up")],
        0,
        T0 + 40,
        T0 + 41,
    );
    let (events, _, _) = commit(store, &tools.claim, done, None, T0 + 41).await;
    assert!(
        kinds(&events).contains(&"inbox.consumed"),
        "{:?}",
        kinds(&events)
    );
    let event = inbox(store, &session)
        .await
        .into_iter()
        .find(|e| e.id == id)
        .unwrap();
    assert_eq!(
        (event.status, event.lease_run_id),
        (InboxStatus::Consumed, Some(parent.clone())),
        "consumed by the run it steered"
    );
    let history = store.history(&session).await.unwrap();
    let steered: Vec<_> = history
        .iter()
        .filter(|m| m.origin == Origin::Steer)
        .collect();
    assert_eq!(steered.len(), 1);
    assert_eq!(steered[0].visibility, Visibility::Hidden);
    assert!(steered[0].content.contains("found it"));
    assert_eq!(
        history.last().map(|m| m.origin),
        Some(Origin::Steer),
        "after the tool result, before the model's next call"
    );
}

/// A steered signal and the commit that ends its session's run, at the same time: the signal
/// is delivered once — never absorbed by the ended run, never lost — by a continuation turn.
pub async fn a_steer_racing_the_end_of_a_run_lands_exactly_once(store: std::sync::Arc<dyn Store>) {
    for round in 0..8 {
        let store = &*store;
        let (session, parent, child) =
            signalling_child(store, Delivery::Steer, 1, CompletionPolicy::Each).await;
        let last = claim_own(store, &parent, T0 + 20).await;
        let ending = after_model(
            last.state.clone(),
            &last.job,
            super::text_reply("done"),
            false,
            T0 + 20,
            T0 + 21,
        );
        let (sent, committed) = tokio::join!(
            store.emit_signal(&child.claim, signal(&child, "c1", "news"), T0 + 21),
            store.commit_step(&last.claim, ending, None, T0 + 21),
        );
        let SignalOutcome::Sent(id) = sent.unwrap().outcome else {
            panic!("round {round}: the signal was not sent");
        };
        assert!(matches!(committed.unwrap(), Commit::Committed { .. }));
        assert_eq!(load(store, &parent).await.status, RunStatus::Completed);
        let event = inbox(store, &session)
            .await
            .into_iter()
            .find(|e| e.id == id)
            .unwrap();
        let holder = event.lease_run_id.clone().expect("someone holds it");
        assert_eq!(event.status, InboxStatus::Leased, "round {round}");
        assert_ne!(
            holder, parent,
            "round {round}: the ended run did not take it"
        );
        assert!(load(store, &holder).await.config.continuation);
        let history = store.history(&session).await.unwrap();
        assert!(
            !history.iter().any(|m| m.origin == Origin::Steer),
            "round {round}: it was not absorbed as well"
        );
        let step = claim_run(store, &holder, T0 + 30).await;
        finish_claimed(store, &step, Ok("told"), T0 + 30).await;
        let after = inbox(store, &session).await;
        let consumed = after
            .iter()
            .filter(|e| e.id == id && e.status == InboxStatus::Consumed)
            .count();
        assert_eq!(consumed, 1, "round {round}");
        let continuations = store.session_runs(&session, None, 100).await.unwrap().len() - 1;
        assert!(continuations >= 1, "round {round}");
    }
}
