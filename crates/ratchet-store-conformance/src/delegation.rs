//! Conformance of sub-agents: children start in the commit that parks their parent, each in a
//! session of its own; the last child's end joins the parent exactly once; a parent's cancel
//! reaches down its tree; trees and run quotas are bounded.

use ratchet_core::delegation::{ChildRun, await_children, delegate_tool};
use ratchet_core::step::{after_model, after_tools, finish_step};
use ratchet_core::{
    AgentProfile, DelegationConfig, Lineage, MessageId, ModelReply, Phase, RunConfigSnapshot,
    RunId, RunStatus, SessionId, StepResult, StopReason, ToolCall, ToolOutcome, TreeSpend,
};
use serde_json::{Value, json};

use super::{
    LEASE_MS, OWNER_A, Snapshot, T0, assert_attributed, commit, commit_stale, commit_within,
    config, kinds, lease, load, new_session, snapshot, submit, text_reply, unique,
};
use ratchet_store::{CancelOutcome, ClaimedStep, Commit, Error, NewRun, RunQuota, Store, WhenBusy};

/// A configuration that may delegate to `worker` (whose runs start with `config()`), in a
/// tree of at most `max_tree_runs` runs.
pub(super) fn delegating_config(max_tree_runs: u64) -> RunConfigSnapshot {
    let worker = AgentProfile {
        id: "worker".into(),
        description: "does the work".into(),
        config: delegating_child_config(),
    };
    let mut config = config();
    config.tools = vec![delegate_tool(std::slice::from_ref(&worker))];
    config.delegation = DelegationConfig {
        agents: vec![worker],
        max_depth: 3,
        max_tree_runs,
        ..DelegationConfig::default()
    };
    config
}

/// A worker's configuration: it may itself delegate to a plain worker.
fn delegating_child_config() -> RunConfigSnapshot {
    let leaf = AgentProfile {
        id: "worker".into(),
        description: "does the work".into(),
        config: config(),
    };
    let mut config = config();
    config.tools = vec![delegate_tool(std::slice::from_ref(&leaf))];
    config.delegation.agents = vec![leaf];
    config
}

/// The model asks for a delegation of `tasks` tasks (and, in the same batch, a lookup).
fn delegate_reply(tasks: usize) -> ModelReply {
    let tasks: Vec<Value> = (0..tasks)
        .map(|i| json!({"agent": "worker", "task": format!("task {i}")}))
        .collect();
    ModelReply {
        text: "handing out".into(),
        tool_calls: vec![
            ToolCall {
                id: "call-d".into(),
                name: "delegate".into(),
                arguments: json!({"mode": "foreground", "tasks": tasks}),
            },
            ToolCall {
                id: "call-l".into(),
                name: "lookup".into(),
                arguments: json!({"q": "x"}),
            },
        ],
        ..ModelReply::default()
    }
}

/// The children a tools step of `parent` starts for `tasks` tasks of its first call.
fn children_of(parent: &ClaimedStep, tasks: usize) -> Vec<ChildRun> {
    let state = &parent.state;
    let (root_run_id, root_session_id, depth) = match &state.lineage {
        Some(l) => (l.root_run_id.clone(), l.root_session_id.clone(), l.depth),
        None => (state.run_id.clone(), state.session_id.clone(), 0),
    };
    let profile = state
        .config
        .delegation
        .agent("worker")
        .expect("worker profile");
    (0..tasks as u32)
        .map(|index| {
            let suffix = unique();
            ChildRun {
                run_id: RunId::from_suffix(&suffix).unwrap(),
                session_id: SessionId::from_suffix(&suffix).unwrap(),
                message_id: MessageId::from_suffix(&suffix).unwrap(),
                task: format!("task {index}"),
                call_id: "call_0".into(),
                config: profile.config.clone(),
                lineage: Lineage {
                    parent_run_id: state.run_id.clone(),
                    parent_step: parent.job.step_index,
                    parent_slot: 0,
                    task_index: index,
                    root_run_id: root_run_id.clone(),
                    root_session_id: root_session_id.clone(),
                    depth: depth + 1,
                    agent: "worker".into(),
                    background: None,
                },
            }
        })
        .collect()
}

/// Drives `run` to a model step asking for `tasks` tasks and
/// a tools step that starts them; returns the children's ids.
async fn delegate(store: &dyn Store, run: &RunId, tasks: usize, now: i64) -> Vec<RunId> {
    let model = claim_run(store, run, now).await;
    let asked = after_model(
        model.state,
        &model.job,
        delegate_reply(tasks),
        false,
        now,
        now + 1,
    );
    commit(store, &model.claim, asked, None, now + 1).await;
    let tools = claim_run(store, run, now + 2).await;
    let children = children_of(&tools, tasks);
    let ids = children.iter().map(|c| c.run_id.clone()).collect();
    let outcomes = vec![None, Some(ToolOutcome::ok("looked up"))];
    let waiting = await_children(
        tools.state,
        &tools.job,
        outcomes,
        children,
        now + 2,
        now + 3,
    );
    let (events, continued, enqueued) = commit(store, &tools.claim, waiting, None, now + 3).await;
    assert!(continued.is_none(), "a waiting parent has no next job");
    assert!(enqueued, "the children's first jobs were enqueued");
    assert_eq!(
        kinds(&events)
            .iter()
            .filter(|k| **k == "subagent.started")
            .count(),
        tasks,
        "one subagent.started per child: {:?}",
        kinds(&events)
    );
    ids
}

/// Claims the next job of `run` (a claim limited to its tree: it has no delegation running).
pub(super) async fn claim_run(store: &dyn Store, run: &RunId, now: i64) -> ClaimedStep {
    let claimed = store
        .claim_next(lease(OWNER_A, now + LEASE_MS), Some(run), now)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("no job of {run} at {now}"));
    assert_eq!(&claimed.job.run_id, run, "claimed another run of the tree");
    claimed
}

/// A claimed child step answers and completes (`Ok(text)`) or fails with `reason`.
pub(super) async fn finish_claimed(
    store: &dyn Store,
    step: &ClaimedStep,
    ending: Result<&str, StopReason>,
    now: i64,
) {
    let result = match ending {
        Ok(text) => after_model(
            step.state.clone(),
            &step.job,
            text_reply(text),
            false,
            now,
            now + 1,
        ),
        Err(reason) => finish_step(step.state.clone(), &step.job, reason, now, now + 1),
    };
    commit(store, &step.claim, result, None, now + 1).await;
}

pub(super) async fn end_child(
    store: &dyn Store,
    child: &RunId,
    ending: Result<&str, StopReason>,
    now: i64,
) -> ClaimedStep {
    let step = claim_run(store, child, now).await;
    finish_claimed(store, &step, ending, now).await;
    step
}

pub async fn a_delegation_starts_children_in_sessions_of_their_own_and_joins_once(
    store: &dyn Store,
) {
    let session = new_session(store).await;
    let (parent, _) = submit(store, &session, "split the work", delegating_config(16), T0).await;
    let children = delegate(store, &parent, 3, T0 + 10).await;
    let state = load(store, &parent).await;
    assert_eq!(state.status, RunStatus::WaitingChildren);
    let tree = store.run_tree(&parent).await.unwrap();
    assert_eq!(
        tree.iter()
            .map(|n| (&n.run_id, n.depth, n.parent_run_id.as_ref()))
            .collect::<Vec<_>>(),
        [(&parent, 0, None)]
            .into_iter()
            .chain(children.iter().map(|c| (c, 1, Some(&parent))))
            .collect::<Vec<_>>(),
        "the tree lists the parent, then its children in task order"
    );
    assert!(
        tree[1..]
            .iter()
            .all(|n| n.status == RunStatus::Running && n.agent.as_deref() == Some("worker"))
    );
    let child_sessions: Vec<&SessionId> = tree[1..].iter().map(|n| &n.session_id).collect();
    assert!(
        !child_sessions.contains(&&session),
        "each child runs in a session of its own"
    );
    let listed = store
        .list_sessions(
            ratchet_store::DEFAULT_TENANT,
            &ratchet_store::SessionQuery::default(),
            1_000,
        )
        .await
        .unwrap();
    assert!(listed.iter().any(|s| s.id == session));
    assert!(
        !listed.iter().any(|s| child_sessions.contains(&&s.id)),
        "the sessions of delegated runs are reached through their tree, not listed"
    );
    for (i, child_session) in child_sessions.iter().enumerate() {
        let history = store.history(child_session).await.unwrap();
        assert_eq!(
            history
                .iter()
                .map(|m| m.content.as_str())
                .collect::<Vec<_>>(),
            [format!("task {i}")]
        );
        let refused = store
            .submit_message(
                NewRun {
                    session_id: (*child_session).clone(),
                    run_id: RunId::from_suffix(&unique()).unwrap(),
                    message_id: MessageId::from_suffix(&unique()).unwrap(),
                    content: "interfere".into(),
                    config: config(),
                    when_busy: WhenBusy::Enqueue,
                    quota: RunQuota::default(),
                    trace: None,
                    request: None,
                },
                T0 + 20,
            )
            .await;
        assert!(
            matches!(refused, Err(Error::Invalid(_))),
            "a child's session takes no messages: {refused:?}"
        );
    }
    assert!(
        !store.runs_with_jobs().await.unwrap().contains(&parent),
        "a parent waiting for children has no job"
    );

    let through_root = store
        .claim_next(lease(OWNER_A, T0 + 30 + LEASE_MS), Some(&parent), T0 + 30)
        .await
        .unwrap()
        .expect("a claim limited to a run's tree takes its children's jobs");
    let first = children
        .iter()
        .position(|c| c == &through_root.job.run_id)
        .unwrap();
    finish_claimed(store, &through_root, Ok("done"), T0 + 30).await;
    let (second, last) = match first {
        0 => (2, 1),
        1 => (0, 2),
        _ => (0, 1),
    };
    end_child(store, &children[second], Ok("done"), T0 + 40).await;
    assert_eq!(
        load(store, &parent).await.status,
        RunStatus::WaitingChildren,
        "one child still runs"
    );
    let last_step = end_child(
        store,
        &children[last],
        Err(StopReason::BudgetExhausted),
        T0 + 50,
    )
    .await;

    let joined = load(store, &parent).await;
    assert_eq!(
        joined.status,
        RunStatus::Running,
        "the last child's end joins the parent"
    );
    let checkpoint = joined.checkpoint.clone().unwrap();
    let results: Value =
        serde_json::from_str(&checkpoint.calls[0].outcome.as_ref().unwrap().content).unwrap();
    let summary: Vec<(Value, Value)> = results["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["run_id"].clone(), r["status"].clone()))
        .collect();
    let expected: Vec<(Value, Value)> = (0..3)
        .map(|i| {
            (
                json!(children[i]),
                json!(if i == last { "failed" } else { "completed" }),
            )
        })
        .collect();
    assert_eq!(
        summary, expected,
        "one result per task, in request order; a failed child is a result"
    );
    assert_eq!(results["results"][first]["answer"], "done");
    assert_eq!(
        checkpoint.calls[1].outcome,
        Some(ToolOutcome::ok("looked up")),
        "the batch's other call keeps its result"
    );
    let events = store.events_after(&session, 0, 1_000).await.unwrap();
    assert_eq!(
        kinds(&events)
            .iter()
            .filter(|k| **k == "subagent.finished")
            .count(),
        3
    );

    // The child's step committed again (a worker that lost its lease) changes nothing.
    let before = snapshot(store, &parent, &session).await;
    let again = finish_step(
        last_step.state.clone(),
        &last_step.job,
        StopReason::BudgetExhausted,
        T0 + 60,
        T0 + 61,
    );
    commit_stale(store, &last_step.claim, again, None, T0 + 61).await;
    assert_eq!(
        snapshot(store, &parent, &session).await,
        before,
        "the join happens once"
    );

    let resumed = claim_run(store, &parent, T0 + 70).await;
    assert_eq!(
        (resumed.job.step_index, resumed.job.phase),
        (joined.step_index + 1, Phase::ChildrenJoined)
    );
}

pub async fn cancelling_a_waiting_parent_cancels_its_tree(store: &dyn Store) {
    let session = new_session(store).await;
    let (root, _) = submit(store, &session, "split", delegating_config(16), T0).await;
    let children = delegate(store, &root, 2, T0 + 10).await;
    let grandchildren = delegate(store, &children[0], 1, T0 + 20).await;
    assert_eq!(
        load(store, &children[0]).await.status,
        RunStatus::WaitingChildren
    );

    let outcome = store.request_cancel(&root, T0 + 30).await.unwrap();
    let CancelOutcome::Cancelled { events, .. } = outcome else {
        panic!("a waiting run is cancelled at once: {outcome:?}");
    };
    let moved: Vec<(String, Value)> = events
        .iter()
        .filter(|e| e.kind == "run.status")
        .map(|e| {
            (
                e.payload["run_id"].as_str().unwrap().to_owned(),
                e.payload["status"].clone(),
            )
        })
        .collect();
    for (run, status) in [
        (&root, "cancelled"),
        (&children[0], "cancelled"),
        (&grandchildren[0], "cancelling"),
        (&children[1], "cancelling"),
    ] {
        assert!(
            moved.contains(&(run.to_string(), json!(status))),
            "{run} should be {status}: {moved:?}"
        );
        assert_eq!(load(store, run).await.status.as_str(), status);
    }
    // Running descendants finish their step by cancelling; nobody wakes the parents.
    for run in [&grandchildren[0], &children[1]] {
        let step = claim_run(store, run, T0 + 40).await;
        assert_eq!(step.job.phase, Phase::UserInput);
        let ended = finish_step(
            step.state.clone(),
            &step.job,
            StopReason::Cancelled,
            T0 + 40,
            T0 + 41,
        );
        commit(store, &step.claim, ended, None, T0 + 41).await;
    }
    let tree = store.run_tree(&root).await.unwrap();
    assert!(
        tree.iter().all(|n| n.status == RunStatus::Cancelled),
        "{tree:?}"
    );
    assert!(
        store
            .runs_with_jobs()
            .await
            .unwrap()
            .iter()
            .all(|r| !tree.iter().any(|n| &n.run_id == r))
    );
    assert_eq!(
        store.run_tree(&children[0]).await.unwrap().len(),
        2,
        "a subtree is its run and the runs below it"
    );
}

/// A parent waiting for its children past its deadline is ended by the sweep, `timed_out`,
/// and its unfinished children are cancelled with it: a waiting one at once, a running one
/// through `cancelling`. A child's end afterwards wakes nobody.
pub async fn a_parent_waiting_for_its_children_past_its_deadline_times_out_with_its_tree(
    store: &dyn Store,
) {
    let session = new_session(store).await;
    let mut timed = delegating_config(16);
    timed.limits.max_duration_ms = Some(1_000);
    let (root, _) = submit(store, &session, "split", timed, T0).await;
    let children = delegate(store, &root, 2, T0 + 10).await;
    let grandchildren = delegate(store, &children[0], 1, T0 + 20).await;
    let deadline = load(store, &root)
        .await
        .deadline()
        .expect("a started run with a budget");
    assert!(
        store
            .time_out_overdue(deadline - 1)
            .await
            .unwrap()
            .ended
            .is_empty(),
        "nothing is overdue before the deadline"
    );

    let swept = store.time_out_overdue(deadline).await.unwrap();
    assert_eq!(swept.ended, std::slice::from_ref(&root));
    assert_attributed(&swept.events);
    let state = load(store, &root).await;
    assert_eq!(
        (state.status, state.stop_reason),
        (RunStatus::Failed, Some(StopReason::TimedOut))
    );
    for (run, status) in [
        (&children[0], RunStatus::Cancelled),
        (&grandchildren[0], RunStatus::Cancelling),
        (&children[1], RunStatus::Cancelling),
    ] {
        assert_eq!(load(store, run).await.status, status, "{run}");
    }
    for run in [&grandchildren[0], &children[1]] {
        end_child(store, run, Err(StopReason::Cancelled), deadline + 10).await;
    }
    let tree = store.run_tree(&root).await.unwrap();
    assert!(
        tree.iter().all(|n| n.status.is_terminal()),
        "the whole tree ended: {tree:?}"
    );
    assert_eq!(
        load(store, &root).await.stop_reason,
        Some(StopReason::TimedOut),
        "a child that ends afterwards does not wake its timed-out parent"
    );
    assert!(
        store
            .time_out_overdue(deadline + 10_000)
            .await
            .unwrap()
            .ended
            .is_empty(),
        "an ended run is swept once"
    );
}

pub async fn a_delegation_beyond_its_tree_limit_writes_nothing(store: &dyn Store) {
    let session = new_session(store).await;
    let (parent, _) = submit(store, &session, "split", delegating_config(3), T0).await;
    let model = claim_run(store, &parent, T0 + 1).await;
    let asked = after_model(
        model.state,
        &model.job,
        delegate_reply(3),
        false,
        T0 + 1,
        T0 + 2,
    );
    commit(store, &model.claim, asked, None, T0 + 2).await;
    let tools = claim_run(store, &parent, T0 + 3).await;
    let before = snapshot(store, &parent, &session).await;
    let children = children_of(&tools, 3);
    let waiting = await_children(
        tools.state.clone(),
        &tools.job,
        vec![None, None],
        children,
        T0 + 3,
        T0 + 4,
    );
    let refused = store.commit_step(&tools.claim, waiting, None, T0 + 4).await;
    assert!(
        matches!(refused, Err(Error::QuotaExceeded(_))),
        "{refused:?}"
    );
    assert_eq!(
        snapshot(store, &parent, &session).await,
        before,
        "nothing of the step was written"
    );
    let admission = store.admission(&parent).await.unwrap();
    assert_eq!(admission.tree_runs, 1);
    assert_eq!(admission.active_in_session, 1);
}

/// A root run at the tools step of a delegation of `tasks` tasks (and a lookup that
/// answered), with the step's result ready to commit and the state before it.
async fn about_to_delegate(
    store: &dyn Store,
    tasks: usize,
    now: i64,
) -> (SessionId, RunId, ClaimedStep, StepResult, Snapshot) {
    let session = new_session(store).await;
    let (parent, _) = submit(store, &session, "split", delegating_config(16), now).await;
    let model = claim_run(store, &parent, now + 1).await;
    let asked = after_model(
        model.state,
        &model.job,
        delegate_reply(tasks),
        false,
        now + 1,
        now + 2,
    );
    commit(store, &model.claim, asked, None, now + 2).await;
    let tools = claim_run(store, &parent, now + 3).await;
    let before = snapshot(store, &parent, &session).await;
    let waiting = await_children(
        tools.state.clone(),
        &tools.job,
        vec![None, Some(ToolOutcome::ok("looked up"))],
        children_of(&tools, tasks),
        now + 3,
        now + 4,
    );
    (session, parent, tools, waiting, before)
}

/// Two trees delegate at once, each admitted by a count taken before the other committed;
/// together they would pass the global quota. The commit counts again under the quota's lock:
/// one starts its children, the other writes nothing, and its step can still commit with the
/// delegate call's outcome an error.
pub async fn concurrent_delegations_cannot_together_exceed_the_run_quota(store: &dyn Store) {
    let (_, first, first_tools, first_waiting, first_before) =
        about_to_delegate(store, 2, T0).await;
    let (_, second, second_tools, second_waiting, second_before) =
        about_to_delegate(store, 2, T0 + 10).await;
    assert_eq!(
        store.admission(&first).await.unwrap().active_global,
        2,
        "each tree would fit alone"
    );
    let quota = RunQuota {
        global: Some(4),
        per_session: None,
    };
    let (first_commit, second_commit) = futures::join!(
        store.commit_step_within(&first_tools.claim, first_waiting, None, quota, T0 + 20),
        store.commit_step_within(&second_tools.claim, second_waiting, None, quota, T0 + 20),
    );
    let (refused, loser, loser_tools, loser_before) = match (first_commit, second_commit) {
        (Ok(Commit::Committed { .. }), refused) => (refused, &second, &second_tools, second_before),
        (refused, Ok(Commit::Committed { .. })) => (refused, &first, &first_tools, first_before),
        (a, b) => panic!("exactly one delegation fits: {a:?} / {b:?}"),
    };
    let Err(Error::QuotaExceeded(message)) = refused else {
        panic!("the other delegation is refused by the quota: {refused:?}");
    };
    assert!(
        message.contains("4 runs are unfinished and at most 4 may be; 2 more do not fit"),
        "{message}"
    );
    let loser_session = loser_tools.state.session_id.clone();
    // The winner's tree moved on; everything of the loser's is as it was.
    let after = snapshot(store, loser, &loser_session).await;
    assert_eq!(
        (after.state, after.steps, after.history, after.events),
        (
            loser_before.state,
            loser_before.steps,
            loser_before.history,
            loser_before.events
        ),
        "nothing of the refused step was written"
    );
    assert!(
        after.runs_with_jobs.contains(loser),
        "the refused step's job is still there to be done again"
    );
    assert_eq!(
        store.run_tree(loser).await.unwrap().len(),
        1,
        "no child of the refused delegation exists"
    );
    assert_eq!(store.admission(loser).await.unwrap().active_global, 4);

    // Told of the refusal, the step commits with the delegate call's outcome an error.
    let outcomes = vec![
        ToolOutcome::error(message.clone()),
        ToolOutcome::ok("looked up"),
    ];
    let told = after_tools(
        loser_tools.state.clone(),
        &loser_tools.job,
        outcomes,
        0,
        T0 + 21,
        T0 + 22,
    );
    commit_within(store, &loser_tools.claim, told, quota, T0 + 22).await;
    let state = load(store, loser).await;
    assert_eq!(state.status, RunStatus::Running);
    let history = store.history(&loser_session).await.unwrap();
    assert!(
        history
            .iter()
            .any(|m| m.tool_call_id.as_deref() == Some("call-d")
                && m.content.contains("at most 4 may be")),
        "the model reads why its delegation was refused"
    );
}

/// The per-session quota counts the runs of the whole tree, in the commit too.
pub async fn a_delegation_beyond_the_sessions_run_quota_writes_nothing(store: &dyn Store) {
    let (_, parent, tools, waiting, before) = about_to_delegate(store, 3, T0).await;
    let quota = RunQuota {
        global: None,
        per_session: Some(3),
    };
    let refused = store
        .commit_step_within(&tools.claim, waiting.clone(), None, quota, T0 + 5)
        .await;
    let Err(Error::QuotaExceeded(message)) = refused else {
        panic!("a root and three children exceed a session quota of 3: {refused:?}");
    };
    assert!(
        message.contains("has 1 unfinished runs and may have at most 3; 3 more do not fit"),
        "{message}"
    );
    assert_eq!(
        snapshot(store, &parent, &tools.state.session_id).await,
        before,
        "nothing of the step was written"
    );
    let roomier = RunQuota {
        global: None,
        per_session: Some(4),
    };
    commit_within(store, &tools.claim, waiting, roomier, T0 + 6).await;
    assert_eq!(store.run_tree(&parent).await.unwrap().len(), 4);
}

/// A tree's spend sums the counters of its root and of every run below it, from any of them,
/// and nothing of another tree.
pub async fn a_trees_spend_is_what_all_its_runs_spent(store: &dyn Store) {
    let session = new_session(store).await;
    let (parent, _) = submit(store, &session, "split", delegating_config(16), T0).await;
    let children = delegate(store, &parent, 2, T0 + 1).await;
    for (i, child) in (0u64..).zip(&children) {
        let step = claim_run(store, child, T0 + 10).await;
        let mut reply = text_reply("done");
        reply.usage.input_tokens = 100 + i;
        reply.usage.output_tokens = 10;
        let mut answered = after_model(
            step.state.clone(),
            &step.job,
            reply,
            false,
            T0 + 10,
            T0 + 11,
        );
        answered.state.counters.cost_microusd = 1_000;
        commit(store, &step.claim, answered, None, T0 + 11).await;
    }
    let elsewhere = new_session(store).await;
    let (other, _) = submit(store, &elsewhere, "alone", config(), T0 + 20).await;
    let step = claim_run(store, &other, T0 + 21).await;
    let mut reply = text_reply("done");
    reply.usage.input_tokens = 5_000;
    commit(
        store,
        &step.claim,
        after_model(
            step.state.clone(),
            &step.job,
            reply,
            false,
            T0 + 21,
            T0 + 22,
        ),
        None,
        T0 + 22,
    )
    .await;

    let root_spend = load(store, &parent).await.counters;
    let expected = TreeSpend {
        tokens: root_spend.input_tokens + root_spend.output_tokens + 110 + 111,
        cost_microusd: root_spend.cost_microusd + 2_000,
    };
    assert_eq!(store.tree_spend(&parent).await.unwrap(), expected);
    assert_eq!(
        store.tree_spend(&children[1]).await.unwrap(),
        expected,
        "a run below the root reads the same tree"
    );
    assert_eq!(
        store.tree_spend(&other).await.unwrap(),
        TreeSpend {
            tokens: 5_000,
            cost_microusd: 0
        }
    );
    assert!(matches!(
        store
            .tree_spend(&RunId::from_suffix("missing").unwrap())
            .await,
        Err(Error::NotFound { .. })
    ));
}

pub async fn run_quotas_refuse_new_runs_beyond_them(store: &dyn Store) {
    let session = new_session(store).await;
    let send = |quota: RunQuota, at: i64| {
        let session = session.clone();
        async move {
            store
                .submit_message(
                    NewRun {
                        session_id: session,
                        run_id: RunId::from_suffix(&unique()).unwrap(),
                        message_id: MessageId::from_suffix(&unique()).unwrap(),
                        content: "work".into(),
                        config: config(),
                        when_busy: WhenBusy::Enqueue,
                        quota,
                        trace: None,
                        request: None,
                    },
                    at,
                )
                .await
        }
    };
    let per_session = RunQuota {
        per_session: Some(2),
        global: None,
    };
    send(per_session, T0).await.unwrap();
    let queued = send(per_session, T0 + 1).await.unwrap();
    assert_eq!(queued.status, RunStatus::Queued, "a queued run counts too");
    let refused = send(per_session, T0 + 2).await;
    let Err(Error::QuotaExceeded(message)) = refused else {
        panic!("a third unfinished run of the session is refused: {refused:?}");
    };
    assert!(
        message.contains("has 2 unfinished runs and may have at most 2"),
        "{message}"
    );
    let other = new_session(store).await;
    let (first_elsewhere, _) = submit(store, &other, "elsewhere", config(), T0 + 3).await;
    let admission = store.admission(&first_elsewhere).await.unwrap();
    assert_eq!(admission.active_in_session, 1, "sessions are counted apart");
    let global = RunQuota {
        global: Some(admission.active_global),
        per_session: None,
    };
    assert!(matches!(
        send(global, T0 + 4).await,
        Err(Error::QuotaExceeded(_))
    ));
    let queued_run = (store.list_runs().await.unwrap().into_iter())
        .find(|r| r.session_id == session && r.status == RunStatus::Queued)
        .expect("the queued run")
        .run_id;
    store.request_cancel(&queued_run, T0 + 5).await.unwrap();
    send(global, T0 + 6)
        .await
        .expect("an ended run frees its place");
    assert_eq!(
        store.list_runs().await.unwrap().len(),
        4,
        "refused messages left no run behind"
    );
}

pub async fn a_delegated_run_is_not_continued_on_its_own(store: &dyn Store) {
    let session = new_session(store).await;
    let (parent, _) = submit(store, &session, "split", delegating_config(16), T0).await;
    let children = delegate(store, &parent, 1, T0 + 10).await;
    end_child(store, &children[0], Err(StopReason::LlmError), T0 + 20).await;
    assert_eq!(
        load(store, &parent).await.status,
        RunStatus::Running,
        "joined with the failure"
    );
    let refused = store
        .resume_failed(
            &children[0],
            ratchet_core::step::Resumption::Retry,
            None,
            T0 + 30,
        )
        .await;
    let Err(Error::Conflict(message)) = refused else {
        panic!("continuing a delegated run is refused: {refused:?}");
    };
    assert!(message.contains("continue the parent instead"), "{message}");
}
