//! Forks: a new session holding a run's history as one of its steps left it, and a run that
//! continues from there — the source only read, the fork independent, the run quota counted,
//! and a `never` call in doubt never run again without a human.

use ratchet_core::step::Reconciliation;
use ratchet_core::step::{after_model, after_tools};
use ratchet_core::{
    ApprovalPolicy, CallLimits, ForkEdit, ForkedFrom, HumanRequest, Message, Phase, ReplayPolicy,
    Role, RunConfigSnapshot, RunId, RunStatus, SessionId, ToolCall, ToolDelegation, ToolOutcome,
    ToolSpec,
};
use ratchet_store::{Error, Forked, Intent, IntentKind, NewFork, RunQuota, Store, StoredMessage};
use serde_json::json;

use super::{
    LEASE_MS, OWNER_A, T0, assert_attributed, claim, commit, config, lease, load, new_session,
    submit, text_reply, tool_reply, unique,
};

async fn fork_with(
    store: &dyn Store,
    source: &RunId,
    at_step: u64,
    edit: Option<ForkEdit>,
    quota: RunQuota,
    now: i64,
) -> (SessionId, RunId, ratchet_store::Result<Forked>) {
    let session_id = SessionId::from_suffix(&unique()).unwrap();
    let run_id = RunId::from_suffix(&unique()).unwrap();
    let fork = NewFork {
        source: source.clone(),
        at_step,
        session_id: session_id.clone(),
        run_id: run_id.clone(),
        config: None,
        edit,
        quota,
        request: None,
    };
    let forked = store.fork_run(fork, now).await;
    (session_id, run_id, forked)
}

/// Forks and panics unless the fork was created.
async fn fork(
    store: &dyn Store,
    source: &RunId,
    at_step: u64,
    edit: Option<ForkEdit>,
    now: i64,
) -> (SessionId, RunId, Forked) {
    let (session, run, forked) =
        fork_with(store, source, at_step, edit, RunQuota::default(), now).await;
    let forked = forked.unwrap_or_else(|e| panic!("fork of {source} at {at_step}: {e}"));
    assert_attributed(&forked.events);
    assert_eq!(forked.session.id, session);
    (session, run, forked)
}

async fn invalid(
    store: &dyn Store,
    source: &RunId,
    at_step: u64,
    edit: Option<ForkEdit>,
) -> String {
    let (session, _, refused) =
        fork_with(store, source, at_step, edit, RunQuota::default(), T0 + 50).await;
    let Err(Error::Invalid(message)) = refused else {
        panic!("a fork of {source} at {at_step} is refused as invalid: {refused:?}");
    };
    assert!(
        matches!(
            store.get_session(&session).await,
            Err(Error::NotFound { .. })
        ),
        "a refused fork writes no session"
    );
    message
}

fn plain(messages: Vec<StoredMessage>) -> Vec<Message> {
    messages.into_iter().map(|m| m.message).collect()
}

/// A three-step run: 1 asks for `lookup`, 2 runs it, 3 answers. Returns the run and its
/// session, and the session's history after each step (index 0: before the first).
async fn three_steps(store: &dyn Store) -> (RunId, SessionId, Vec<Vec<Message>>) {
    let session = new_session(store).await;
    let (run, _) = submit(store, &session, "what is the answer?", config(), T0).await;
    let mut seen = vec![store.history(&session).await.unwrap()];
    let model = claim(store, OWNER_A, T0 + 1).await;
    let asked = after_model(model.state, &model.job, tool_reply(), false, T0 + 1, T0 + 2);
    let (_, tools, _) = commit(
        store,
        &model.claim,
        asked,
        Some(lease(OWNER_A, T0 + LEASE_MS)),
        T0 + 2,
    )
    .await;
    seen.push(store.history(&session).await.unwrap());
    let tools = tools.expect("continued");
    let ran = after_tools(
        tools.state,
        &tools.job,
        vec![ToolOutcome::ok("42")],
        0,
        T0 + 3,
        T0 + 4,
    );
    let (_, model, _) = commit(
        store,
        &tools.claim,
        ran,
        Some(lease(OWNER_A, T0 + LEASE_MS)),
        T0 + 4,
    )
    .await;
    seen.push(store.history(&session).await.unwrap());
    let model = model.expect("continued");
    let answered = after_model(
        model.state,
        &model.job,
        text_reply("42."),
        false,
        T0 + 5,
        T0 + 6,
    );
    commit(store, &model.claim, answered, None, T0 + 6).await;
    seen.push(store.history(&session).await.unwrap());
    assert_eq!(load(store, &run).await.status, RunStatus::Completed);
    (run, session, seen)
}

/// A fork at each step of a run holds exactly the source's history as that step left it, in a
/// session of the source's tenant, and its run — fresh, recording where it came from — picks
/// up what the source did next: the pending batch after a model step, a model call after a
/// tools step. The source is only read: its state, steps, history and events are the same
/// after every fork and after the forks ran on.
pub async fn a_fork_at_each_step_holds_the_sources_history_through_it_and_leaves_it_alone(
    store: &dyn Store,
) {
    let (source, source_session, seen) = three_steps(store).await;
    let before = super::snapshot(store, &source, &source_session).await;
    for (at_step, phase, has_batch) in [
        (1, Phase::LlmResult, true),
        (2, Phase::ToolsBatchResult, false),
    ] {
        let (session, run, forked) = fork(store, &source, at_step, None, T0 + 10).await;
        assert_eq!(forked.status, RunStatus::Running, "step {at_step}");
        assert_eq!(
            store.history(&session).await.unwrap(),
            seen[at_step as usize],
            "the fork at step {at_step} holds the source's history as that step left it"
        );
        assert_eq!(
            forked.session.tenant,
            store.get_session(&source_session).await.unwrap().tenant
        );
        assert_eq!(forked.session.active_run_id.as_ref(), Some(&run));
        let state = load(store, &run).await;
        assert_eq!(
            state.forked_from,
            Some(ForkedFrom {
                run_id: source.clone(),
                step: at_step
            })
        );
        assert_eq!(
            (state.step_index, state.counters.model_calls),
            (0, 0),
            "fresh budgets"
        );
        assert_eq!(
            state.config.as_ref(),
            &config(),
            "the source's frozen configuration"
        );
        assert_eq!(state.checkpoint.is_some(), has_batch, "step {at_step}");
        let first = store
            .claim_next(lease(OWNER_A, T0 + 20 + LEASE_MS), Some(&run), T0 + 20)
            .await
            .unwrap()
            .expect("the fork's first job");
        assert_eq!((first.job.step_index, first.job.phase), (1, phase));
        // The fork goes on by itself: what it commits is its own.
        let result = if has_batch {
            after_tools(
                first.state,
                &first.job,
                vec![ToolOutcome::ok("43 in the fork")],
                0,
                T0 + 20,
                T0 + 21,
            )
        } else {
            after_model(
                first.state,
                &first.job,
                text_reply("fork answer"),
                false,
                T0 + 20,
                T0 + 21,
            )
        };
        commit(store, &first.claim, result, None, T0 + 21).await;
        let history = store.history(&session).await.unwrap();
        assert_eq!(history.len(), seen[at_step as usize].len() + 1);
        if has_batch {
            // A fork of a fork is a fork like any other.
            let (again, _, _) = fork(store, &run, 1, None, T0 + 22).await;
            let copied = plain(store.visible_messages(&again, 0, 100).await.unwrap());
            assert_eq!(copied, history, "a fork of the fork at its step 1");
        }
    }
    for bad in [0, 4, 99] {
        let message = invalid(store, &source, bad, None).await;
        assert!(message.contains("1 to 3"), "{message}");
    }
    let message = invalid(store, &source, 3, None).await;
    assert!(message.contains("nothing to continue"), "{message}");
    let unknown = RunId::from_suffix(&unique()).unwrap();
    let (_, _, missing) = fork_with(store, &unknown, 1, None, RunQuota::default(), T0).await;
    assert!(
        matches!(missing, Err(Error::NotFound { .. })),
        "{missing:?}"
    );
    let mut after = super::snapshot(store, &source, &source_session).await;
    after
        .runs
        .retain(|r| before.runs.iter().any(|b| b.run_id == r.run_id));
    after
        .runs_with_jobs
        .retain(|r| before.runs_with_jobs.contains(r));
    after.lease_owners = before.lease_owners.clone();
    assert_eq!(after, before, "the source is untouched");
}

/// `replace_user_message` rewrites the last user message and drops what answered it; the fork
/// calls the model first. `replace_tool_result` rewrites a call's result and ends the history
/// with its batch. A call the history does not have is refused, saying which it has.
pub async fn a_forks_edit_replaces_the_user_message_or_a_tool_result(store: &dyn Store) {
    let (source, _, seen) = three_steps(store).await;
    let edit = ForkEdit::ReplaceUserMessage("what is the question?".into());
    let (session, run, _) = fork(store, &source, 3, Some(edit), T0 + 10).await;
    let history = store.history(&session).await.unwrap();
    assert_eq!(
        history
            .iter()
            .map(|m| (m.role, m.content.as_str()))
            .collect::<Vec<_>>(),
        [(Role::User, "what is the question?")]
    );
    let first = store
        .claim_next(lease(OWNER_A, T0 + 11 + LEASE_MS), Some(&run), T0 + 11)
        .await
        .unwrap()
        .expect("the fork's first job");
    assert_eq!(first.job.phase, Phase::UserInput);

    let edit = ForkEdit::ReplaceToolResult {
        call_id: "call-1".into(),
        result: "41".into(),
    };
    let (session, _, _) = fork(store, &source, 3, Some(edit), T0 + 12).await;
    let history = store.history(&session).await.unwrap();
    assert_eq!(history.len(), seen[2].len());
    assert_eq!(history.last().map(|m| m.content.as_str()), Some("41"));
    assert_eq!(history[..history.len() - 1], seen[2][..seen[2].len() - 1]);

    let edit = ForkEdit::ReplaceToolResult {
        call_id: "call-9".into(),
        result: "x".into(),
    };
    let message = invalid(store, &source, 3, Some(edit)).await;
    assert!(message.contains("\"call-1\" (lookup)"), "{message}");
}

/// A fork is an unfinished run like any other: past the run quota it is refused, and nothing
/// of it is written.
pub async fn a_fork_counts_against_the_run_quota(store: &dyn Store) {
    let session = new_session(store).await;
    let (source, _) = submit(store, &session, "work", config(), T0).await;
    let model = claim(store, OWNER_A, T0 + 1).await;
    let asked = after_model(model.state, &model.job, tool_reply(), false, T0 + 1, T0 + 2);
    commit(store, &model.claim, asked, None, T0 + 2).await;
    let quota = RunQuota {
        global: Some(1),
        per_session: None,
    };
    let (refused_session, refused_run, refused) =
        fork_with(store, &source, 1, None, quota, T0 + 3).await;
    let Err(Error::QuotaExceeded(message)) = refused else {
        panic!("a second unfinished run is refused: {refused:?}");
    };
    assert!(message.contains("at most 1"), "{message}");
    assert!(matches!(
        store.get_session(&refused_session).await,
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        store.load_state(&refused_run).await,
        Err(Error::NotFound { .. })
    ));
    let room = RunQuota {
        global: Some(2),
        per_session: Some(1),
    };
    let (_, _, admitted) = fork_with(store, &source, 1, None, room, T0 + 4).await;
    assert_eq!(admitted.unwrap().status, RunStatus::Running);
}

fn paying() -> RunConfigSnapshot {
    RunConfigSnapshot {
        tools: vec![ToolSpec {
            name: "pay".into(),
            description: String::new(),
            parameters: json!({"type": "object"}),
            replay: ReplayPolicy::Never,
            completes_run: false,
            approval: ApprovalPolicy::Never,
            delegation: ToolDelegation::default(),
            calls: CallLimits::default(),
        }],
        ..config()
    }
}

/// A run of `paying()` whose model asked for `pay` (`never`) and whose worker holds the step
/// that runs it, nothing of the call recorded yet: the source and the claimed tools step.
async fn paying_in_flight(store: &dyn Store) -> (RunId, ratchet_store::ClaimedStep) {
    let session = new_session(store).await;
    let (source, _) = submit(store, &session, "pay the bill", paying(), T0).await;
    let model = claim(store, OWNER_A, T0 + 1).await;
    let reply = ratchet_core::ModelReply {
        tool_calls: vec![ToolCall {
            id: "pay-1".into(),
            name: "pay".into(),
            arguments: json!({"amount": 5}),
        }],
        ..text_reply("paying")
    };
    let asked = after_model(model.state, &model.job, reply, false, T0 + 1, T0 + 2);
    let (_, tools, _) = commit(
        store,
        &model.claim,
        asked,
        Some(lease(OWNER_A, T0 + LEASE_MS)),
        T0 + 2,
    )
    .await;
    (source, tools.expect("the source holds its batch's step"))
}

/// A `never` call the source started without an outcome is not run again by a fork: the fork
/// waits for a human (a reconciliation of its own, under the source's idempotency key) unless
/// the edit gives the call's result; one the source finished keeps its outcome.
pub async fn a_fork_never_runs_a_never_call_in_doubt_again(store: &dyn Store) {
    let (source, tools) = paying_in_flight(store).await;
    let key = format!("{source}#2#0");
    store
        .record_intents(
            &tools.claim,
            vec![Intent {
                slot: 0,
                kind: IntentKind::Tool,
                name: "pay".into(),
                idempotency_key: key.clone(),
            }],
            Vec::new(),
            T0 + 3,
        )
        .await
        .unwrap();
    // The source's worker dies here: the call's outcome is unknown.
    let (_, run, forked) = fork(store, &source, 1, None, T0 + 4).await;
    assert_eq!(forked.status, RunStatus::WaitingHuman);
    let state = load(store, &run).await;
    let Some(HumanRequest::Reconciliation { calls }) = &state.pending_human else {
        panic!(
            "the fork waits for a reconciliation: {:?}",
            state.pending_human
        );
    };
    assert_eq!(
        calls
            .iter()
            .map(|c| (c.call_id.as_str(), c.idempotency_key.as_str()))
            .collect::<Vec<_>>(),
        [("pay-1", key.as_str())]
    );
    assert!(!store.runs_with_jobs().await.unwrap().contains(&run));
    let reconciled = store
        .reconcile(
            &run,
            "pay-1",
            Reconciliation::Succeeded,
            Some("paid".into()),
            T0 + 5,
        )
        .await
        .unwrap();
    assert!(reconciled.resumed, "answered, the fork goes on");
    let next = store
        .claim_next(lease(OWNER_A, T0 + 6 + LEASE_MS), Some(&run), T0 + 6)
        .await
        .unwrap()
        .expect("the fork's job after the reconciliation");
    assert_eq!(next.job.phase, Phase::HumanDecided);

    let edit = ForkEdit::ReplaceToolResult {
        call_id: "pay-1".into(),
        result: "declined".into(),
    };
    let (_, edited, forked) = fork(store, &source, 1, Some(edit), T0 + 7).await;
    assert_eq!(
        forked.status,
        RunStatus::Running,
        "the edit answered the call"
    );
    let checkpoint = load(store, &edited).await.checkpoint.unwrap();
    assert_eq!(
        checkpoint.calls[0].outcome,
        Some(ToolOutcome::ok("declined"))
    );

    store
        .record_outcome(&tools.claim, 0, ToolOutcome::ok("paid 5"), T0 + 8)
        .await
        .unwrap();
    let (_, known, forked) = fork(store, &source, 1, None, T0 + 9).await;
    assert_eq!(forked.status, RunStatus::Running);
    let checkpoint = load(store, &known).await.checkpoint.unwrap();
    assert_eq!(
        checkpoint.calls[0].outcome,
        Some(ToolOutcome::ok("paid 5")),
        "the source's effect happened: its outcome is kept, the call does not run again"
    );
}

/// A fork of a run that is still carrying out the batch forked at: the source has not started
/// its `never` call yet, but may once the fork exists, so the fork does not run it without a
/// human (under the source's key).
pub async fn a_fork_of_a_live_batch_never_runs_its_never_call_without_a_human(store: &dyn Store) {
    let (source, _) = paying_in_flight(store).await;
    let (_, run, forked) = fork(store, &source, 1, None, T0 + 3).await;
    assert_eq!(forked.status, RunStatus::WaitingHuman);
    let state = load(store, &run).await;
    let Some(HumanRequest::Reconciliation { calls }) = &state.pending_human else {
        panic!("the fork waits for a human: {:?}", state.pending_human);
    };
    let doubted: Vec<&str> = calls.iter().map(|c| c.call_id.as_str()).collect();
    assert_eq!(doubted, ["pay-1"]);
    assert_eq!(calls[0].idempotency_key, format!("{source}#2#0"));
}
