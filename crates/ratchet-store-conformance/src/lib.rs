//! The store conformance suite: the behaviour every `Store` backend (SQLite, PostgreSQL, …)
//! must show, written once against the trait so that backends cannot drift apart.
//!
//! Each public function is one test. It takes a fresh, empty store, drives it through the
//! trait only, and panics with a message naming the broken rule. A backend runs the whole
//! suite with [`store_conformance_tests!`](crate::store_conformance_tests).
//!
//! Time is always passed in explicitly (lease expiry is tested by choosing `now`), so nothing
//! here sleeps. Step results are built with the pure functions of `ratchet_core::step`, the
//! same ones the engine uses, so the store is exercised with realistic transitions.

mod bounds;
mod delegation;
mod fork;
mod inbox;
mod pause;
mod requests;
mod schedules;
mod timer;
mod webhooks;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ratchet_core::step::{
    Reconciliation, Resumption, after_model, after_tools, await_reconciliation, finish_step,
};
use ratchet_core::{
    AgentState, ApprovalAnswer, ApprovalPolicy, BudgetExtension, CallDecision, EventDraft,
    EventKind, HumanRequest, Limits, MemoryScope, Message, MessageId, Millis, ModelReply, Phase,
    ReplayPolicy, Role, RunConfigSnapshot, RunId, RunStatus, SessionId, StepJob, StepRecord,
    StepResult, StopReason, ToolCall, ToolDelegation, ToolOutcome, ToolSpec, UnknownCall, Usage,
    Verdict, Visibility,
};
use serde_json::{Value, json};

pub use bounds::*;
pub use delegation::*;
pub use fork::*;
pub use inbox::*;
pub use pause::*;
pub use requests::*;
pub use schedules::*;
pub use timer::*;
pub use webhooks::*;

use ratchet_store::{
    Approval, ApprovalStatus, CancelOutcome, Claim, ClaimedStep, Commit, DEFAULT_TENANT, Error,
    Intent, IntentKind, IntentRecord, Lease, ListOrder, MessageHit, NewRun, RunQuota, RunSummary,
    SearchScope, Session, SessionSpec, Stale, Store, StoredEvent, Submitted, WhenBusy,
};

/// Expands to one `#[tokio::test]` per conformance test. `$make` is an expression of a
/// future resolving to `Some((store, guard))`: `store` an `Arc` of the backend (fresh and
/// empty; it implements every role of `Store`), `guard` anything that must outlive the test (a temp dir, a dropped-on-exit
/// database; `()` when nothing). It resolves to `None` when the backend is not available
/// here (no database server configured), and each test then returns at once; whoever made
/// that choice says so. The expression is evaluated once per test. The calling crate needs
/// `tokio` with the `macros` and `rt-multi-thread` features.
///
/// ```text
/// async fn fresh_store() -> Option<(Arc<SqliteStore>, TempDir)> { … }
/// ratchet_store::store_conformance_tests!(fresh_store());
/// ```
#[macro_export]
macro_rules! store_conformance_tests {
    ($make:expr) => {
        $crate::store_conformance_tests!(@borrowed $make;
            submit_starts_a_run_or_queues_it_behind_the_active_one,
            a_run_keeps_the_trace_its_message_came_with,
            sessions_are_titled_found_and_ordered_by_activity,
            commit_writes_the_step_and_continues_under_lease,
            stale_and_duplicate_commits_change_nothing,
            intents_keep_slot_order_attempts_and_outcomes,
            cancel_of_a_queued_run_is_immediate,
            cancel_of_a_running_run_goes_through_cancelling,
            cancel_of_a_waiting_run_frees_the_session,
            a_run_waiting_past_its_deadline_times_out_and_frees_the_session,
            a_run_cancelled_while_a_call_is_in_doubt_tells_the_truth_of_its_batch,
            retry_later_delays_the_next_claim,
            release_leases_frees_a_dead_owners_jobs,
            missing_and_duplicate_entities_are_errors,
            config_and_cancel_flag_are_owned_by_the_store,
            a_claim_for_one_run_takes_only_its_jobs,
            a_cancelled_run_starts_no_new_effect,
            an_interrupting_message_cancels_the_active_run_and_follows_it,
            sessions_are_listed_per_tenant_in_pages,
            client_reads_show_visible_messages_runs_and_run_events,
            event_pages_stop_at_their_byte_budget_but_never_come_back_empty,
            a_run_events_payload_names_its_run_as_published_and_read_back,
            an_approval_holds_the_whole_batch_until_a_human_answers,
            an_aborted_or_cancelled_approval_ends_its_run_and_frees_the_session,
            an_approval_of_a_run_that_ended_is_closed_with_it,
            a_failed_run_is_retried_or_continued_once_its_session_is_free,
            a_steer_joins_the_active_run_before_its_next_model_call_or_runs_next,
            search_finds_earlier_user_and_assistant_messages,
            search_in_a_session_never_sees_another_session,
            search_in_a_tenant_never_sees_another_tenant,
            search_ranks_better_matches_first_and_respects_the_limit,
            search_reads_query_syntax_as_plain_words,
            the_model_sees_the_latest_summary_in_place_of_what_it_replaces,
            a_steps_context_is_what_the_model_was_shown_at_that_step,
            a_delegation_starts_children_in_sessions_of_their_own_and_joins_once,
            cancelling_a_waiting_parent_cancels_its_tree,
            a_parent_waiting_for_its_children_past_its_deadline_times_out_with_its_tree,
            a_delegation_beyond_its_tree_limit_writes_nothing,
            run_quotas_refuse_new_runs_beyond_them,
            concurrent_delegations_cannot_together_exceed_the_run_quota,
            a_delegation_beyond_the_sessions_run_quota_writes_nothing,
            a_trees_spend_is_what_all_its_runs_spent,
            a_delegated_run_is_not_continued_on_its_own,
            a_full_inbox_refuses_background_work_and_never_loses_an_accepted_report,
            a_group_reports_once_when_its_last_run_ends,
            a_continuation_takes_only_the_reports_its_trigger_carries,
            a_failing_continuation_is_retried_then_dead_lettered,
            a_stopped_continuation_gives_its_reports_back_for_after_the_next_user_turn,
            a_continuation_that_fails_after_answering_in_part_tells_its_report_once,
            an_operator_requeues_or_discards_a_dead_letter_once,
            a_report_untold_past_its_max_age_expires,
            users_and_the_inbox_take_turns,
            closing_a_session_cancels_its_background_work_and_empties_its_inbox,
            signals_follow_their_contract_and_a_cancelled_runs_unread_ones_are_superseded,
            a_steered_signal_joins_the_active_run_at_its_next_model_call,
            a_pause_stops_a_run_at_its_next_step_boundary_and_resume_takes_it_up,
            a_pending_pause_is_withdrawn_by_resume_and_honoured_by_a_backoff,
            cancel_of_a_paused_run_frees_the_session,
            a_users_steers_past_the_lanes_count_or_bytes_are_refused_and_nothing_is_written,
            a_background_runs_steered_signals_past_the_agent_lane_are_refused,
            a_keyed_request_is_carried_out_once_and_its_response_replayed,
            a_keyed_effect_is_recorded_with_its_key_and_recovered_after_its_holder_died,
            keyed_resumes_webhooks_and_rotations_record_their_effect,
            a_fork_at_each_step_holds_the_sources_history_through_it_and_leaves_it_alone,
            a_forks_edit_replaces_the_user_message_or_a_tool_result,
            a_fork_counts_against_the_run_quota,
            a_fork_never_runs_a_never_call_in_doubt_again,
            a_fork_of_a_live_batch_never_runs_its_never_call_without_a_human,
            a_wait_parks_the_run_with_one_job_ready_at_its_due_time,
            input_for_its_session_ends_a_wait_early_once,
            a_queued_message_ends_one_wait_of_the_turn_not_the_next,
            a_waiting_run_is_paused_and_cancelled_at_once,
            a_run_waiting_on_a_timer_past_its_deadline_times_out,
            a_schedule_is_kept_changed_paused_and_deleted,
            a_due_slot_fires_once_as_a_run_that_names_its_schedule_and_slot,
            missed_slots_are_recorded_as_skipped_and_listed_newest_first,
            overlap_skips_queues_behind_or_cancels_the_previous_run,
            a_refused_slot_is_recorded_and_the_schedule_moves_on,
            a_trigger_fires_a_manual_slot_and_moves_nothing,
        );
        $crate::store_conformance_tests!(@shared $make;
            concurrent_claims_of_one_step_have_one_winner,
            concurrent_commits_of_one_claim_have_one_winner,
            event_seqs_are_dense_per_session,
            a_steer_racing_the_end_of_a_run_lands_exactly_once,
            a_pause_racing_a_step_pauses_the_run_exactly_once,
            concurrent_requests_with_one_key_have_one_holder,
            concurrent_claims_of_a_due_timer_have_one_winner,
            racing_passes_decide_each_slot_once,
        );
        $crate::store_conformance_tests!(@observed $make;
            a_webhook_is_queued_each_wanted_event_once_from_its_creation_on,
            a_sessions_deliveries_are_attempted_strictly_in_seq_order,
            a_delivery_is_dead_lettered_after_its_last_attempt_and_the_rest_go_on,
            an_operator_requeues_dead_deliveries_once,
            open_deliveries_are_kept_within_their_age_and_count,
            an_expired_attempt_is_taken_over_and_the_old_claim_is_refused,
            webhooks_are_listed_per_tenant_and_deleted_with_their_deliveries,
            a_rotated_secret_signs_the_attempts_claimed_after_it,
        );
        $crate::store_conformance_tests!(@observed_shared $make;
            concurrent_dispatchers_claim_each_attempt_once,
        );
    };
    (@borrowed $make:expr; $($name:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let Some((store, _guard)) = $make.await else {
                    return;
                };
                $crate::$name(&*store).await;
            }
        )+
    };
    (@observed $make:expr; $($name:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let Some((store, _guard)) = $make.await else {
                    return;
                };
                $crate::$name(&*store, &*store).await;
            }
        )+
    };
    (@observed_shared $make:expr; $($name:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let Some((store, _guard)) = $make.await else {
                    return;
                };
                $crate::$name(store.clone(), store).await;
            }
        )+
    };
    (@shared $make:expr; $($name:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let Some((store, _guard)) = $make.await else {
                    return;
                };
                $crate::$name(store).await;
            }
        )+
    };
}

/// The clock of every test starts here; later instants are `T0 + …`.
const T0: Millis = 1_000_000;
/// The lease length of ordinary claims in this suite.
const LEASE_MS: Millis = 30_000;
const OWNER_A: &str = "worker-a";
const OWNER_B: &str = "worker-b";
const OWNER_C: &str = "worker-c";

/// Ids are unique across the whole process (and across processes sharing a database), so a
/// backend whose "fresh" store shares tables with other tests still cannot mix them up.
fn unique() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    format!(
        "conf-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

fn lease(owner: &str, expires_at: Millis) -> Lease {
    Lease {
        owner: owner.to_owned(),
        expires_at,
    }
}

fn config() -> RunConfigSnapshot {
    RunConfigSnapshot {
        model: "scripted:conformance".into(),
        ..RunConfigSnapshot::default()
    }
}

fn text_reply(text: &str) -> ModelReply {
    ModelReply {
        text: text.into(),
        ..ModelReply::default()
    }
}

/// A reply asking for one tool call: the run stays `running` and its next step runs tools.
fn tool_reply() -> ModelReply {
    ModelReply {
        text: "let me look".into(),
        tool_calls: vec![ToolCall {
            id: "call-1".into(),
            name: "lookup".into(),
            arguments: json!({"q": "answer"}),
        }],
        usage: Usage {
            input_tokens: 12,
            output_tokens: 5,
            reasoning_tokens: 2,
            cache_write_tokens: 0,
            cache_read_tokens: 0,
        },
        reasoning: String::new(),
    }
}

async fn new_session(store: &dyn Store) -> SessionId {
    let id = SessionId::from_suffix(&unique()).unwrap();
    store
        .create_session(&id, SessionSpec::default(), T0)
        .await
        .unwrap_or_else(|e| panic!("create_session {id}: {e}"));
    id
}

async fn submit(
    store: &dyn Store,
    session: &SessionId,
    content: &str,
    config: RunConfigSnapshot,
    now: Millis,
) -> (RunId, Submitted) {
    let run_id = RunId::from_suffix(&unique()).unwrap();
    let new = NewRun {
        session_id: session.clone(),
        run_id: run_id.clone(),
        message_id: MessageId::from_suffix(&unique()).unwrap(),
        content: content.into(),
        config,
        when_busy: WhenBusy::Enqueue,
        quota: Default::default(),
        trace: None,
        request: None,
    };
    let submitted = store
        .submit_message(new, now)
        .await
        .unwrap_or_else(|e| panic!("submit_message {run_id} to {session}: {e}"));
    assert_attributed(&submitted.events);
    (run_id, submitted)
}

async fn claim(store: &dyn Store, owner: &str, now: Millis) -> ClaimedStep {
    store
        .claim_next(lease(owner, now + LEASE_MS), None, now)
        .await
        .unwrap_or_else(|e| panic!("claim_next by {owner} at {now}: {e}"))
        .unwrap_or_else(|| panic!("claim_next by {owner} at {now}: expected a job, found none"))
}

async fn assert_nothing_claimable(store: &dyn Store, now: Millis, why: &str) {
    let found = store
        .claim_next(lease(OWNER_C, now + LEASE_MS), None, now)
        .await
        .unwrap();
    if let Some(claimed) = found {
        panic!("{why}, yet claim_next at {now} returned {:?}", claimed.job);
    }
}

/// Commits a step whose children are admitted within `quota`; panics unless it committed.
async fn commit_within(
    store: &dyn Store,
    claim: &Claim,
    result: StepResult,
    quota: RunQuota,
    now: Millis,
) -> Vec<StoredEvent> {
    match store
        .commit_step_within(claim, result, None, quota, now)
        .await
    {
        Ok(Commit::Committed { events, .. }) => events,
        other => panic!(
            "commit of {}#{} within {quota:?}: {other:?}",
            claim.run_id, claim.step_index
        ),
    }
}

async fn commit(
    store: &dyn Store,
    claim: &Claim,
    result: StepResult,
    continue_with: Option<Lease>,
    now: Millis,
) -> (Vec<StoredEvent>, Option<ClaimedStep>, bool) {
    match store.commit_step(claim, result, continue_with, now).await {
        Ok(Commit::Committed {
            events,
            continued,
            added,
            enqueued,
        }) => {
            assert_attributed(&events);
            if let Some(next) = &continued {
                assert_context_ends_with(store, next, &added).await;
            }
            (events, continued, enqueued)
        }
        Ok(Commit::Stale(stale)) => {
            panic!(
                "commit of {}#{} refused as stale: {stale:?}",
                claim.run_id, claim.step_index
            )
        }
        Err(e) => panic!(
            "commit of {}#{} failed: {e}",
            claim.run_id, claim.step_index
        ),
    }
}

/// A streak's worker extends the context it had with what its commit added, instead of
/// reading it back: that must be what the store's context ends with.
async fn assert_context_ends_with(store: &dyn Store, next: &ClaimedStep, added: &[Message]) {
    let context: Vec<Message> = (store
        .context(&next.state.session_id, &next.state.run_id)
        .await)
        .expect("context")
        .into_iter()
        .map(|m| m.message)
        .collect();
    assert!(
        context.ends_with(added),
        "the commit said it added {added:?}, but the context of {} ends {:?}",
        next.state.session_id,
        &context[context.len().saturating_sub(added.len())..]
    );
}

async fn commit_stale(
    store: &dyn Store,
    claim: &Claim,
    result: StepResult,
    continue_with: Option<Lease>,
    now: Millis,
) -> Stale {
    match store.commit_step(claim, result, continue_with, now).await {
        Ok(Commit::Stale(stale)) => stale,
        Ok(Commit::Committed { .. }) => panic!(
            "commit of {}#{} at epoch {} should have been refused as stale, but was committed",
            claim.run_id, claim.step_index, claim.epoch
        ),
        Err(e) => panic!(
            "commit of {}#{} failed instead of being stale: {e}",
            claim.run_id, claim.step_index
        ),
    }
}

/// Loads a run's state and checks that `list_runs` tells the same story about it.
async fn load(store: &dyn Store, run: &RunId) -> AgentState {
    let state = store
        .load_state(run)
        .await
        .unwrap_or_else(|e| panic!("load_state {run}: {e}"));
    let runs = store.list_runs().await.expect("list_runs");
    let summary = runs
        .iter()
        .find(|r| &r.run_id == run)
        .unwrap_or_else(|| panic!("list_runs does not list {run}"));
    assert_eq!(
        (
            summary.status,
            summary.stop_reason,
            summary.step_index,
            &summary.session_id,
            &summary.forked_from
        ),
        (
            state.status,
            state.stop_reason,
            state.step_index,
            &state.session_id,
            &state.forked_from
        ),
        "list_runs and load_state disagree about {run}"
    );
    state
}

async fn user_messages(store: &dyn Store, session: &SessionId) -> Vec<String> {
    let history = store.history(session).await.expect("history");
    history
        .into_iter()
        .filter(|m| m.role == Role::User)
        .map(|m| m.content)
        .collect()
}

/// The invariant of sessions: at most one run that is neither queued nor terminal.
async fn assert_one_active(store: &dyn Store, session: &SessionId) {
    let runs = store.list_runs().await.expect("list_runs");
    let active: Vec<&RunId> = runs
        .iter()
        .filter(|r| &r.session_id == session)
        .filter(|r| r.status != RunStatus::Queued && !r.status.is_terminal())
        .map(|r| &r.run_id)
        .collect();
    assert!(
        active.len() <= 1,
        "session {session} has several active runs: {active:?}"
    );
}

/// An event about a run (its payload names the run) is stored under that run, so that a
/// client following one run sees all of its events, including the start of a queued run
/// that another run's commit or cancel triggered.
fn assert_attributed(events: &[StoredEvent]) {
    for event in events {
        if let Some(about) = event.payload.get("run_id").and_then(Value::as_str) {
            assert_eq!(
                event.run_id.as_ref().map(RunId::as_str),
                Some(about),
                "event #{} ({}) is about {about} but stored under {:?}",
                event.seq,
                event.kind,
                event.run_id
            );
        }
    }
}

fn kinds(events: &[StoredEvent]) -> Vec<&str> {
    events.iter().map(|e| e.kind.as_str()).collect()
}

/// Everything a stale commit must leave untouched, as seen through the trait.
#[derive(Debug, PartialEq)]
struct Snapshot {
    state: AgentState,
    steps: Vec<StepRecord>,
    history: Vec<Message>,
    events: Vec<StoredEvent>,
    runs: Vec<RunSummary>,
    runs_with_jobs: Vec<RunId>,
    lease_owners: Vec<String>,
}

async fn snapshot(store: &dyn Store, run: &RunId, session: &SessionId) -> Snapshot {
    let mut runs_with_jobs = store.runs_with_jobs().await.unwrap();
    runs_with_jobs.sort();
    let mut lease_owners = store.lease_owners().await.unwrap();
    lease_owners.sort();
    Snapshot {
        state: store.load_state(run).await.unwrap(),
        steps: store.steps(run).await.unwrap(),
        history: store.history(session).await.unwrap(),
        events: store.events_after(session, 0, 10_000).await.unwrap(),
        runs: store.list_runs().await.unwrap(),
        runs_with_jobs,
        lease_owners,
    }
}

/// A submit on an idle session starts its run; a submit behind an active run waits, with
/// no job and no message in history, until the active run ends.
pub async fn a_run_keeps_the_trace_its_message_came_with(store: &dyn Store) {
    let session = new_session(store).await;
    let trace = ratchet_core::TraceContext::from_traceparent(
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    );
    let traced = RunId::from_suffix(&unique()).unwrap();
    let new = NewRun {
        session_id: session.clone(),
        run_id: traced.clone(),
        message_id: MessageId::from_suffix(&unique()).unwrap(),
        content: "traced".into(),
        config: config(),
        when_busy: WhenBusy::Enqueue,
        quota: Default::default(),
        trace,
        request: None,
    };
    store.submit_message(new, T0).await.unwrap();
    assert_eq!(load(store, &traced).await.trace, trace);
    let claimed = claim(store, OWNER_A, T0).await;
    assert_eq!(claimed.job.run_id, traced);
    assert_eq!(
        claimed.state.trace, trace,
        "the claimed state carries it too"
    );
    let (untraced, _) = submit(store, &new_session(store).await, "untraced", config(), T0).await;
    assert_eq!(load(store, &untraced).await.trace, None);
}

pub async fn submit_starts_a_run_or_queues_it_behind_the_active_one(store: &dyn Store) {
    let session = new_session(store).await;
    let (first, submitted) = submit(store, &session, "first question", config(), T0).await;
    assert_eq!(
        submitted.status,
        RunStatus::Running,
        "a submit on an idle session starts its run"
    );
    assert!(!submitted.events.is_empty(), "a submit publishes events");
    assert_eq!(load(store, &first).await.status, RunStatus::Running);
    assert_eq!(user_messages(store, &session).await, ["first question"]);

    let refused = NewRun {
        session_id: session.clone(),
        run_id: RunId::from_suffix(&unique()).unwrap(),
        message_id: MessageId::from_suffix(&unique()).unwrap(),
        content: "not now".into(),
        config: config(),
        when_busy: WhenBusy::Reject,
        quota: Default::default(),
        trace: None,
        request: None,
    };
    match store.submit_message(refused, T0 + 1).await {
        Err(Error::Conflict(message)) => assert!(message.contains("active run"), "{message}"),
        other => panic!("a busy session must refuse when asked to: {other:?}"),
    }
    assert_eq!(
        user_messages(store, &session).await,
        ["first question"],
        "a refused message leaves nothing behind"
    );

    let (second, queued) = submit(store, &session, "second question", config(), T0 + 1).await;
    assert_eq!(
        queued.status,
        RunStatus::Queued,
        "a submit behind an active run is queued"
    );
    assert_eq!(load(store, &second).await.status, RunStatus::Queued);
    assert_eq!(
        user_messages(store, &session).await,
        ["first question"],
        "a queued run's message must not enter history before the run starts"
    );
    let early = store
        .claim_next(lease(OWNER_B, T0 + LEASE_MS), Some(&second), T0 + 1)
        .await
        .unwrap();
    assert!(early.is_none(), "a queued run must have no claimable job");
    assert!(
        !store.runs_with_jobs().await.unwrap().contains(&second),
        "a queued run has no job"
    );
    assert_one_active(store, &session).await;

    let claimed = claim(store, OWNER_A, T0 + 2).await;
    assert_eq!(
        claimed.job,
        StepJob {
            run_id: first.clone(),
            step_index: 1,
            phase: Phase::UserInput,
            attempt: 1
        }
    );
    assert_eq!(claimed.state.run_id, first);
    assert_nothing_claimable(
        store,
        T0 + 2,
        "the only job is leased and the other run is queued",
    )
    .await;

    let result = after_model(
        claimed.state,
        &claimed.job,
        text_reply("first answer"),
        false,
        T0 + 2,
        T0 + 3,
    );
    assert_eq!(
        result.state.status,
        RunStatus::Completed,
        "precondition: a text reply completes"
    );
    let (events, continued, enqueued) = commit(store, &claimed.claim, result, None, T0 + 3).await;
    assert!(continued.is_none(), "a finished run has no next job");
    assert!(
        enqueued,
        "ending the active run starts the queued one, whose job must wake workers"
    );
    assert!(
        events
            .iter()
            .any(|e| e.run_id.as_ref() == Some(&second) && e.kind == "run.status"),
        "the start of the queued run is published with the commit, got {:?}",
        kinds(&events)
    );
    assert_eq!(load(store, &first).await.status, RunStatus::Completed);
    let started = load(store, &second).await;
    assert_eq!(
        started.status,
        RunStatus::Running,
        "the queued run starts when the active one ends"
    );
    assert_eq!(started.started_at, Some(T0 + 3));
    assert_eq!(
        user_messages(store, &session).await,
        ["first question", "second question"],
        "the started run's message enters history after the first run's messages"
    );
    let roles: Vec<Role> = store
        .history(&session)
        .await
        .unwrap()
        .iter()
        .map(|m| m.role)
        .collect();
    assert_eq!(roles, [Role::User, Role::Assistant, Role::User]);
    assert_one_active(store, &session).await;

    let next = claim(store, OWNER_B, T0 + 4).await;
    assert_eq!(
        next.job,
        StepJob {
            run_id: second.clone(),
            step_index: 1,
            phase: Phase::UserInput,
            attempt: 1
        }
    );
}

/// A commit writes state, messages, step record, events and next job together; steps are
/// numbered 1..n; a job continued under lease is the committer's until the lease expires.
pub async fn commit_writes_the_step_and_continues_under_lease(store: &dyn Store) {
    let session = new_session(store).await;
    let (run, _) = submit(store, &session, "what is the answer?", config(), T0).await;
    let first = claim(store, OWNER_A, T0).await;

    let result = after_model(
        first.state.clone(),
        &first.job,
        tool_reply(),
        false,
        T0,
        T0 + 10,
    );
    assert_eq!(
        result.next.as_ref().map(|j| j.phase),
        Some(Phase::LlmResult),
        "precondition"
    );
    let sent = result.clone();
    let expires = T0 + 10 + LEASE_MS;
    let (events, continued, enqueued) = commit(
        store,
        &first.claim,
        result,
        Some(lease(OWNER_A, expires)),
        T0 + 10,
    )
    .await;
    assert!(
        !enqueued,
        "a job leased to its committer must not wake other workers"
    );
    let continued = continued.expect("continue_with must return the next job already leased");
    assert_eq!(
        continued.job,
        StepJob {
            run_id: run.clone(),
            step_index: 2,
            phase: Phase::LlmResult,
            attempt: 1
        }
    );
    assert_eq!(
        continued.claim,
        Claim {
            run_id: run.clone(),
            step_index: 2,
            epoch: continued.claim.epoch
        }
    );
    assert_eq!(
        continued.state, sent.state,
        "the continued step runs against the committed state"
    );

    assert_eq!(
        load(store, &run).await,
        sent.state,
        "load_state returns the committed state"
    );
    assert_eq!(
        store.steps(&run).await.unwrap(),
        std::slice::from_ref(&sent.record)
    );
    let history = store.history(&session).await.unwrap();
    assert_eq!(history.len(), 1 + sent.messages.len());
    assert_eq!(
        history[1..],
        sent.messages[..],
        "the step's messages follow the user message"
    );
    let expected: Vec<(&str, &Value)> = sent
        .events
        .iter()
        .map(|e| (e.kind.as_str(), &e.payload))
        .collect();
    let written: Vec<(&str, &Value)> = events
        .iter()
        .map(|e| (e.kind.as_str(), &e.payload))
        .collect();
    assert_eq!(
        written, expected,
        "the commit publishes exactly the step's events, in order"
    );
    let stored = store.events_after(&session, 0, 10_000).await.unwrap();
    assert!(
        stored.ends_with(&events),
        "the returned events are the stored ones"
    );

    assert_nothing_claimable(
        store,
        expires - 1,
        "a continued job is leased until it expires",
    )
    .await;
    let early = store
        .claim_next(lease(OWNER_B, expires + LEASE_MS), Some(&run), expires - 1)
        .await;
    assert!(
        early.unwrap().is_none(),
        "a claim of the run's own job must respect the continued lease"
    );
    let reclaimed = claim(store, OWNER_B, expires).await;
    assert_eq!(
        reclaimed.job,
        StepJob {
            run_id: run.clone(),
            step_index: 2,
            phase: Phase::LlmResult,
            attempt: 2
        },
        "an expired lease makes the job claimable again, with its attempt incremented"
    );
    assert_ne!(
        reclaimed.claim.epoch, continued.claim.epoch,
        "a reclaim changes the epoch"
    );

    let tools = after_tools(
        reclaimed.state,
        &reclaimed.job,
        vec![ToolOutcome::ok("42")],
        0,
        expires,
        expires + 1,
    );
    let (_, continued, enqueued) = commit(store, &reclaimed.claim, tools, None, expires + 1).await;
    assert!(
        continued.is_none(),
        "without continue_with nothing is leased"
    );
    assert!(enqueued, "an unleased next job must wake the workers");
    let third = claim(store, OWNER_A, expires + 2).await;
    assert_eq!(
        third.job,
        StepJob {
            run_id: run.clone(),
            step_index: 3,
            phase: Phase::ToolsBatchResult,
            attempt: 1
        }
    );
    let last = after_model(
        third.state,
        &third.job,
        text_reply("42"),
        false,
        expires + 2,
        expires + 3,
    );
    commit(store, &third.claim, last, None, expires + 3).await;

    let steps = store.steps(&run).await.unwrap();
    let numbered: Vec<(u64, &str)> = steps
        .iter()
        .map(|s| (s.index, s.instruction.as_str()))
        .collect();
    assert_eq!(
        numbered,
        [(1, "call_llm"), (2, "call_tools_batch"), (3, "call_llm")]
    );
    let state = load(store, &run).await;
    assert_eq!(
        (state.status, state.stop_reason),
        (RunStatus::Completed, Some(StopReason::Completed))
    );
    assert_eq!(
        (state.step_index, state.finished_at),
        (3, Some(expires + 3))
    );
    let roles: Vec<Role> = store
        .history(&session)
        .await
        .unwrap()
        .iter()
        .map(|m| m.role)
        .collect();
    assert_eq!(
        roles,
        [Role::User, Role::Assistant, Role::Tool, Role::Assistant]
    );
    assert!(
        !store.runs_with_jobs().await.unwrap().contains(&run),
        "a finished run has no job"
    );
    assert_nothing_claimable(
        store,
        expires + 10 * LEASE_MS,
        "a finished run leaves no job",
    )
    .await;
}

/// Fencing of claims: of many workers racing for one job — some asking for any job, some for
/// this run's — exactly one gets it.
pub async fn concurrent_claims_of_one_step_have_one_winner(store: Arc<dyn Store>) {
    let session = new_session(&*store).await;
    let (run, _) = submit(&*store, &session, "race", config(), T0).await;
    let racers: Vec<_> = (0..8)
        .map(|i| {
            let (store, run) = (Arc::clone(&store), run.clone());
            let owner = format!("racer-{i}");
            tokio::spawn(async move {
                let only = (i % 2 == 0).then_some(&run);
                let won = store
                    .claim_next(lease(&owner, T0 + LEASE_MS), only, T0)
                    .await;
                (owner, won)
            })
        })
        .collect();
    let mut winners = Vec::new();
    for racer in racers {
        let (owner, won) = racer.await.expect("claim task panicked");
        if let Some(claimed) = won.expect("claim_next failed") {
            winners.push((owner, claimed));
        }
    }
    assert_eq!(
        winners.len(),
        1,
        "exactly one racer may claim the job, got {}",
        winners.len()
    );
    let (owner, claimed) = &winners[0];
    assert_eq!(claimed.job.attempt, 1);
    assert_eq!(
        store.lease_owners().await.unwrap(),
        std::slice::from_ref(owner),
        "only the winner holds a lease"
    );
}

/// Sessions belong to a tenant: a listing shows only that tenant's, in id order from either
/// end, a page at a time after a cursor; a session keeps its agent and metadata and tells its
/// active run's status and when its latest event was written.
pub async fn sessions_are_listed_per_tenant_in_pages(store: &dyn Store) {
    let prefix = unique();
    let spec = |tenant: &str, i: usize| SessionSpec {
        tenant: tenant.into(),
        agent: Some(format!("agent-{i}")),
        metadata: Some(json!({"n": i})),
        request: None,
    };
    let mut acme = Vec::new();
    for i in 0..5 {
        let id = SessionId::from_suffix(&format!("{prefix}-a{i:03}")).unwrap();
        let created = store
            .create_session(&id, spec("acme", i), T0 + i as i64)
            .await
            .unwrap();
        assert_eq!(
            (created.tenant.as_str(), created.active_run_id.as_ref()),
            ("acme", None)
        );
        acme.push(id);
    }
    for i in 0..2 {
        let id = SessionId::from_suffix(&format!("{prefix}-g{i:03}")).unwrap();
        store
            .create_session(&id, spec("globex", i), T0)
            .await
            .unwrap();
    }
    let first = store
        .list_sessions("acme", &by_id(ListOrder::OldestFirst, None), 2)
        .await
        .unwrap();
    let ids = |page: &[Session]| page.iter().map(|s| s.id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&first), acme[..2]);
    let second = store
        .list_sessions("acme", &by_id(ListOrder::OldestFirst, Some(&acme[1])), 2)
        .await
        .unwrap();
    assert_eq!(ids(&second), acme[2..4]);
    let last = store
        .list_sessions("acme", &by_id(ListOrder::OldestFirst, Some(&acme[3])), 2)
        .await
        .unwrap();
    assert_eq!(ids(&last), acme[4..]);
    assert!(
        store
            .list_sessions("acme", &by_id(ListOrder::OldestFirst, Some(&acme[4])), 2)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        store
            .list_sessions("globex", &by_id(ListOrder::OldestFirst, None), 10)
            .await
            .unwrap()
            .len(),
        2
    );
    assert!(
        store
            .list_sessions("initech", &by_id(ListOrder::OldestFirst, None), 10)
            .await
            .unwrap()
            .is_empty()
    );

    let third = store.get_session(&acme[3]).await.unwrap();
    assert_eq!(third.tenant, "acme");
    assert_eq!(third.agent.as_deref(), Some("agent-3"));
    assert_eq!(third.metadata, Some(json!({"n": 3})));
    assert_eq!(third.created_at, T0 + 3);
    assert_eq!(
        (third.last_activity_at, third.active_run_status),
        (T0 + 3, None),
        "a session without events was last active when it was created"
    );
    let newest = store
        .list_sessions("acme", &by_id(ListOrder::NewestFirst, None), 2)
        .await
        .unwrap();
    assert_eq!(ids(&newest), [acme[4].clone(), acme[3].clone()]);
    let older = store
        .list_sessions("acme", &by_id(ListOrder::NewestFirst, Some(&acme[3])), 2)
        .await
        .unwrap();
    assert_eq!(ids(&older), [acme[2].clone(), acme[1].clone()]);
    let oldest = store
        .list_sessions("acme", &by_id(ListOrder::NewestFirst, Some(&acme[1])), 2)
        .await
        .unwrap();
    assert_eq!(ids(&oldest), [acme[0].clone()]);

    let (run, _) = submit(store, &acme[3], "hello", config(), T0 + 10).await;
    let busy = store.get_session(&acme[3]).await.unwrap();
    assert_eq!(busy.active_run_id, Some(run));
    assert_eq!(busy.active_run_status, Some(RunStatus::Running));
    assert_eq!(
        busy.last_activity_at,
        T0 + 10,
        "run.created is its latest event"
    );
    let listed = store
        .list_sessions("acme", &by_id(ListOrder::NewestFirst, None), 2)
        .await
        .unwrap();
    assert_eq!(
        (listed[1].active_run_status, listed[1].last_activity_at),
        (Some(RunStatus::Running), T0 + 10),
        "a listing reads them too"
    );
    let missing = SessionId::from_suffix(&format!("{prefix}-none")).unwrap();
    assert!(matches!(
        store.get_session(&missing).await,
        Err(Error::NotFound { .. })
    ));
}

fn by_id(order: ListOrder, after: Option<&SessionId>) -> ratchet_store::SessionQuery {
    ratchet_store::SessionQuery {
        order,
        after: after.cloned().map(ratchet_store::SessionCursor::Id),
        ..ratchet_store::SessionQuery::default()
    }
}

/// A session is titled by its first message's first line until it is renamed, and a list
/// finds sessions by what they are doing, their agent, when they were made and any text of
/// their id, title or visible messages (wildcards in it matched as themselves), and orders
/// them by their latest activity with a cursor that carries it.
pub async fn sessions_are_titled_found_and_ordered_by_activity(store: &dyn Store) {
    let prefix = unique();
    let make = |name: &str, agent: Option<&str>, at: Millis| {
        let id = SessionId::from_suffix(&format!("{prefix}-{name}")).unwrap();
        let spec = SessionSpec {
            tenant: "find".into(),
            agent: agent.map(str::to_owned),
            metadata: None,
            request: None,
        };
        async move {
            store.create_session(&id, spec, at).await.unwrap();
            id
        }
    };
    let trip = make("trip", Some("planner"), T0).await;
    let fare = make("fare", None, T0 + 1).await;
    let quiet = make("quiet", Some("planner"), T0 + 2).await;
    let gated = make("gated", None, T0 + 3).await;
    let closed = make("closed", None, T0 + 4).await;
    let broken = make("broken", None, T0 + 5).await;

    submit(
        store,
        &trip,
        "\n Plan my trip to Rome \nwith two stops",
        config(),
        T0 + 10,
    )
    .await;
    submit(
        store,
        &fare,
        "Find the cheapest 100% refundable fare",
        config(),
        T0 + 11,
    )
    .await;
    // Only the first message names a session.
    submit(store, &fare, "and a hotel", config(), T0 + 12).await;
    gated_run(store, &gated, T0 + 20).await;
    store
        .close_session(&closed, ratchet_store::Closing::Archive, T0 + 30)
        .await
        .unwrap();
    let (failing, _) = submit(store, &broken, "flaky", config(), T0 + 40).await;
    let step = store
        .claim_next(lease(OWNER_A, T0 + 41 + LEASE_MS), Some(&failing), T0 + 41)
        .await
        .unwrap()
        .expect("its first job");
    let failed = finish_step(
        step.state,
        &step.job,
        StopReason::LlmError,
        T0 + 41,
        T0 + 42,
    );
    commit(store, &step.claim, failed, None, T0 + 42).await;

    let title = |id: &SessionId| {
        let id = id.clone();
        async move { store.get_session(&id).await.unwrap().title }
    };
    assert_eq!(title(&trip).await.as_deref(), Some("Plan my trip to Rome"));
    assert_eq!(
        title(&fare).await.as_deref(),
        Some("Find the cheapest 100% refundable fare")
    );
    assert_eq!(title(&quiet).await, None, "no message, no title yet");
    let renamed = store
        .rename_session(&quiet, "Renamed by hand")
        .await
        .unwrap();
    assert_eq!(renamed.title.as_deref(), Some("Renamed by hand"));
    let missing = SessionId::from_suffix(&format!("{prefix}-none")).unwrap();
    assert!(matches!(
        store.rename_session(&missing, "x").await,
        Err(Error::NotFound { .. })
    ));

    let find = |query: ratchet_store::SessionQuery| async move {
        let listed = store.list_sessions("find", &query, 100).await.unwrap();
        listed.into_iter().map(|s| s.id).collect::<Vec<_>>()
    };
    let state = |state| ratchet_store::SessionQuery {
        state: Some(state),
        ..Default::default()
    };
    use ratchet_store::SessionState::*;
    assert_eq!(
        find(state(WaitingHuman)).await,
        std::slice::from_ref(&gated)
    );
    // (Ids sort by name here: `…-broken` < `…-closed` < `…-fare` < `…-gated` < …)
    assert_eq!(find(state(Active)).await, [fare.clone(), trip.clone()]);
    assert_eq!(find(state(Failed)).await, std::slice::from_ref(&broken));
    assert_eq!(find(state(Idle)).await, std::slice::from_ref(&quiet));
    assert_eq!(find(state(Archived)).await, std::slice::from_ref(&closed));
    let agent = |agent: Option<&str>| ratchet_store::SessionQuery {
        agent: Some(agent.map(str::to_owned)),
        ..Default::default()
    };
    assert_eq!(
        find(agent(Some("planner"))).await,
        [quiet.clone(), trip.clone()]
    );
    assert_eq!(
        find(agent(None)).await,
        [broken.clone(), closed.clone(), fare.clone(), gated.clone()]
    );
    let made = ratchet_store::SessionQuery {
        created_from: Some(T0 + 1),
        created_before: Some(T0 + 3),
        ..Default::default()
    };
    assert_eq!(find(made).await, [fare.clone(), quiet.clone()]);
    let text = |text: &str| ratchet_store::SessionQuery {
        text: Some(text.to_owned()),
        ..Default::default()
    };
    assert_eq!(
        find(text("ROME")).await,
        std::slice::from_ref(&trip),
        "titles, any case"
    );
    assert_eq!(
        find(text("TWO stops")).await,
        std::slice::from_ref(&trip),
        "any visible message"
    );
    assert_eq!(find(text("100%")).await, std::slice::from_ref(&fare));
    assert_eq!(
        find(text("0_")).await,
        Vec::<SessionId>::new(),
        "`_` is no wildcard"
    );
    assert_eq!(
        find(text(&format!("{prefix}-qui"))).await,
        std::slice::from_ref(&quiet),
        "ids"
    );
    assert_eq!(find(text("renamed by")).await, std::slice::from_ref(&quiet));

    // Latest activity first, two at a time: the cursor carries the activity.
    let mut order = Vec::new();
    let mut after = None;
    loop {
        let query = ratchet_store::SessionQuery {
            order: ListOrder::LatestActivityFirst,
            after: after.clone(),
            ..Default::default()
        };
        let page = store.list_sessions("find", &query, 2).await.unwrap();
        let Some(last) = page.last() else { break };
        after = Some(ratchet_store::SessionCursor::Activity(
            last.last_activity_at,
            last.id.clone(),
        ));
        order.extend(page.iter().map(|s| s.id.clone()));
    }
    assert_eq!(
        order,
        [broken, closed, gated, fare, trip, quiet],
        "by their latest events; one without any by its creation"
    );
    let mismatched = ratchet_store::SessionQuery {
        order: ListOrder::LatestActivityFirst,
        after: Some(ratchet_store::SessionCursor::Id(missing)),
        ..Default::default()
    };
    assert!(matches!(
        store.list_sessions("find", &mismatched, 2).await,
        Err(Error::Invalid(_))
    ));
}

/// What a client reads back: visible messages in order (never hidden ones) with a position
/// cursor, a session's runs in id order, and one run's events only.
pub async fn client_reads_show_visible_messages_runs_and_run_events(store: &dyn Store) {
    let session = new_session(store).await;
    let (run, _) = submit(store, &session, "first", config(), T0).await;
    let first = claim(store, OWNER_A, T0).await;
    let mut result = after_model(
        first.state,
        &first.job,
        text_reply("answer"),
        false,
        T0,
        T0 + 1,
    );
    result.messages.push(Message {
        visibility: Visibility::Hidden,
        ..Message::user("a hidden trigger")
    });
    commit(store, &first.claim, result, None, T0 + 1).await;
    let (second_run, _) = submit(store, &session, "second", config(), T0 + 2).await;

    let messages = store.visible_messages(&session, 0, 100).await.unwrap();
    let texts: Vec<&str> = messages
        .iter()
        .map(|m| m.message.content.as_str())
        .collect();
    assert_eq!(
        texts,
        ["first", "answer", "second"],
        "hidden messages never reach a client"
    );
    assert!(messages.windows(2).all(|w| w[0].position < w[1].position));
    assert_eq!(messages[0].run_id, run);
    assert_eq!(messages[2].run_id, second_run);
    let rest = store
        .visible_messages(&session, messages[0].position, 1)
        .await
        .unwrap();
    assert_eq!(rest.len(), 1);
    assert_eq!(rest[0].message.content, "answer");
    assert_eq!(
        store.history(&session).await.unwrap().len(),
        4,
        "the model's history keeps the hidden message"
    );

    let runs = store.session_runs(&session, None, 10).await.unwrap();
    let ids: Vec<&RunId> = runs.iter().map(|r| &r.run_id).collect();
    let mut expected = vec![&run, &second_run];
    expected.sort();
    assert_eq!(ids, expected);
    let after_first = store
        .session_runs(&session, Some(expected[0]), 10)
        .await
        .unwrap();
    assert_eq!(after_first.len(), 1);

    let all = store.events_after(&session, 0, 1000).await.unwrap();
    let of_run = store.run_events_after(&run, 0, 1000).await.unwrap();
    let expected: Vec<&StoredEvent> = all
        .iter()
        .filter(|e| e.run_id.as_ref() == Some(&run))
        .collect();
    assert_eq!(of_run.iter().collect::<Vec<_>>(), expected);
    assert!(!of_run.is_empty() && of_run.len() < all.len());
    let tail = store
        .run_events_after(&run, of_run[0].seq, 1000)
        .await
        .unwrap();
    assert_eq!(tail, of_run[1..]);
}

/// A page bounded by bytes holds whole events up to the budget, always at least one (an
/// event larger than the budget comes alone), and paging by it reads every event once.
/// Every event of a run names its run in its payload, as published and as read back, however
/// its writer built it; a payload naming another run keeps it.
pub async fn a_run_events_payload_names_its_run_as_published_and_read_back(store: &dyn Store) {
    let session = new_session(store).await;
    let run = RunId::from_suffix("named").unwrap();
    let other = RunId::from_suffix("other").unwrap();
    let drafts = vec![
        EventDraft::new(EventKind::Activity, json!({"run_id": run, "n": 1})),
        EventDraft::new(EventKind::Activity, json!({"n": 2})),
        EventDraft::new(EventKind::Activity, json!({"run_id": other, "n": 3})),
        EventDraft::new(EventKind::Activity, json!(["not", "an", "object"])),
    ];
    let published = store
        .append_events(&session, &run, drafts, T0)
        .await
        .unwrap();
    let payloads: Vec<Value> = published.iter().map(|e| e.payload.clone()).collect();
    assert_eq!(
        payloads,
        [
            json!({"run_id": run, "n": 1}),
            json!({"run_id": run, "n": 2}),
            json!({"run_id": other, "n": 3}),
            json!(["not", "an", "object"]),
        ]
    );
    assert_eq!(
        store.events_after(&session, 0, 100).await.unwrap(),
        published
    );
    assert_eq!(
        store
            .events_within(&session, 0, 100, u64::MAX)
            .await
            .unwrap(),
        published
    );
}

pub async fn event_pages_stop_at_their_byte_budget_but_never_come_back_empty(store: &dyn Store) {
    let session = new_session(store).await;
    let run = RunId::from_suffix("paged").unwrap();
    let sizes = [10usize, 10, 5000, 10, 10, 10];
    let drafts = sizes
        .iter()
        .map(|&n| EventDraft::new(EventKind::Activity, json!({"text": "x".repeat(n)})))
        .collect();
    let stored = store
        .append_events(&session, &run, drafts, T0)
        .await
        .unwrap();
    let payload_bytes = |e: &StoredEvent| e.payload.to_string().len() as u64;
    let small = payload_bytes(&stored[0]);

    let page = store
        .events_within(&session, 0, 100, 2 * small)
        .await
        .unwrap();
    assert_eq!(page, stored[..2], "two small events fit a budget of two");
    let page = store
        .events_within(&session, 2, 100, 2 * small)
        .await
        .unwrap();
    assert_eq!(page, stored[2..3], "an event over the budget comes alone");
    let page = store.events_within(&session, 0, 100, 1).await.unwrap();
    assert_eq!(page, stored[..1], "the first event whatever the budget");
    let page = store.events_within(&session, 3, 2, u64::MAX).await.unwrap();
    assert_eq!(page, stored[3..5], "the count limit still holds");

    let mut seen = Vec::new();
    let mut after = 0;
    loop {
        let page = store
            .events_within(&session, after, 100, 3 * small)
            .await
            .unwrap();
        let Some(last) = page.last() else { break };
        after = last.seq;
        seen.extend(page);
    }
    assert_eq!(
        seen, stored,
        "paging by bytes reads every event once, in order"
    );
}

/// Once a cancel is accepted, the step in flight can no longer record an intent — so no
/// new effect starts, whichever process holds the step — though outcomes of effects already
/// started are still recorded.
pub async fn a_cancelled_run_starts_no_new_effect(store: &dyn Store) {
    let session = new_session(store).await;
    let (run, _) = submit(store, &session, "busy", config(), T0).await;
    let first = claim(store, OWNER_A, T0).await;
    let started = Intent {
        slot: 0,
        kind: IntentKind::Tool,
        name: "started".into(),
        idempotency_key: format!("{run}#1#0"),
    };
    store
        .record_intents(&first.claim, vec![started], Vec::new(), T0)
        .await
        .unwrap();
    match store.request_cancel(&run, T0 + 1).await.unwrap() {
        CancelOutcome::Cancelling { .. } => {}
        other => panic!("a running run goes through cancelling, got {other:?}"),
    }
    let late = Intent {
        slot: 1,
        kind: IntentKind::Tool,
        name: "late".into(),
        idempotency_key: format!("{run}#1#1"),
    };
    let refused = store
        .record_intents(&first.claim, vec![late], Vec::new(), T0 + 2)
        .await;
    assert!(
        matches!(refused, Err(Error::CancelRequested { .. })),
        "no effect may start after a cancel: {refused:?}"
    );
    store
        .record_outcome(&first.claim, 0, ToolOutcome::ok("done anyway"), T0 + 3)
        .await
        .unwrap();
    let recorded = store.intents(&run, 1).await.unwrap();
    assert_eq!(recorded.len(), 1, "the late intent left nothing behind");
    assert_eq!(recorded[0].outcome, Some(ToolOutcome::ok("done anyway")));
}

/// `interrupt` cancels the session's active run in the submit's own transaction: a waiting run
/// ends at once and the new run starts; a running one goes `cancelling` and the new run
/// starts when its last step has committed.
pub async fn an_interrupting_message_cancels_the_active_run_and_follows_it(store: &dyn Store) {
    let interrupt = |session: &SessionId, content: &str| NewRun {
        session_id: session.clone(),
        run_id: RunId::from_suffix(&unique()).unwrap(),
        message_id: MessageId::from_suffix(&unique()).unwrap(),
        content: content.into(),
        config: config(),
        when_busy: WhenBusy::Interrupt,
        quota: Default::default(),
        trace: None,
        request: None,
    };
    // A running run with a step in flight.
    let session = new_session(store).await;
    let (busy, _) = submit(store, &session, "long job", config(), T0).await;
    let in_flight = claim(store, OWNER_A, T0).await;
    let next = interrupt(&session, "stop, do this instead");
    let newcomer = next.run_id.clone();
    let submitted = store.submit_message(next, T0 + 1).await.unwrap();
    assert_eq!(submitted.interrupted.as_ref(), Some(&busy));
    assert_eq!(
        submitted.status,
        RunStatus::Queued,
        "it waits for the cancelled run to end"
    );
    assert_eq!(load(store, &busy).await.status, RunStatus::Cancelling);
    // The step in flight asked for tools: not an end of its own, so it yields to the cancel.
    let step = after_model(
        in_flight.state,
        &in_flight.job,
        tool_reply(),
        false,
        T0,
        T0 + 2,
    );
    let (_, _, enqueued) = commit(store, &in_flight.claim, step, None, T0 + 2).await;
    assert!(enqueued, "the cancel step is due");
    let cancel = claim(store, OWNER_A, T0 + 3).await;
    assert_eq!(cancel.job.run_id, busy);
    let finish = finish_step(
        cancel.state,
        &cancel.job,
        StopReason::Cancelled,
        T0 + 3,
        T0 + 4,
    );
    commit(store, &cancel.claim, finish, None, T0 + 4).await;
    assert_eq!(load(store, &busy).await.status, RunStatus::Cancelled);
    assert_eq!(
        load(store, &newcomer).await.status,
        RunStatus::Running,
        "then the newcomer starts"
    );

    // A run waiting for a human is cancelled at once and the newcomer starts right away.
    let session = new_session(store).await;
    let (waiting, _) = submit(store, &session, "risky", config(), T0).await;
    let model = claim(store, OWNER_A, T0).await;
    let asked = after_model(model.state, &model.job, tool_reply(), false, T0, T0 + 1);
    commit(store, &model.claim, asked, None, T0 + 1).await;
    let tools = claim(store, OWNER_A, T0 + 2).await;
    let request = HumanRequest::Reconciliation { calls: Vec::new() };
    let parked = await_reconciliation(tools.state, &tools.job, vec![None], request, T0 + 2, T0 + 3);
    commit(store, &tools.claim, parked, None, T0 + 3).await;
    let next = interrupt(&session, "never mind");
    let newcomer = next.run_id.clone();
    let submitted = store.submit_message(next, T0 + 4).await.unwrap();
    assert_eq!(submitted.status, RunStatus::Running);
    assert_eq!(load(store, &waiting).await.status, RunStatus::Cancelled);
    assert_eq!(load(store, &newcomer).await.status, RunStatus::Running);
    assert_one_active(store, &session).await;
}

/// A claim scoped to one run (a driver that must not execute other runs' steps) takes only
/// that run's job, even when another run's job has waited longer.
pub async fn a_claim_for_one_run_takes_only_its_jobs(store: &dyn Store) {
    let older = new_session(store).await;
    let (older_run, _) = submit(store, &older, "waiting longer", config(), T0).await;
    let mine = new_session(store).await;
    let (my_run, _) = submit(store, &mine, "mine", config(), T0 + 1).await;
    let claimed = store
        .claim_next(lease(OWNER_A, T0 + 2 + LEASE_MS), Some(&my_run), T0 + 2)
        .await
        .unwrap()
        .expect("my run's job");
    assert_eq!(claimed.job.run_id, my_run);
    let nothing = store
        .claim_next(lease(OWNER_A, T0 + 3 + LEASE_MS), Some(&my_run), T0 + 3)
        .await
        .unwrap();
    assert!(nothing.is_none(), "my run has no other job: {nothing:?}");
    let other = claim(store, OWNER_B, T0 + 3).await;
    assert_eq!(
        other.job.run_id, older_run,
        "the older job was left for an unscoped claim"
    );
}

/// Fencing of commits: a commit under an expired and reclaimed lease, or of a step already
/// committed, is refused and writes nothing.
pub async fn stale_and_duplicate_commits_change_nothing(store: &dyn Store) {
    let session = new_session(store).await;
    let (run, _) = submit(store, &session, "fence me", config(), T0).await;
    let old = claim(store, OWNER_A, T0).await;
    let extended = T0 + LEASE_MS + 100;
    assert!(
        store.heartbeat(&old.claim, extended).await.unwrap(),
        "the holder may extend its lease"
    );
    assert_nothing_claimable(store, T0 + LEASE_MS, "a heartbeat extends the lease").await;
    let new = claim(store, OWNER_B, extended).await;
    assert_eq!(new.job.attempt, 2);
    assert_ne!(
        new.claim.epoch, old.claim.epoch,
        "a reclaim changes the fencing token"
    );
    assert!(
        !store
            .heartbeat(&old.claim, extended + LEASE_MS)
            .await
            .unwrap(),
        "a lost claim cannot heartbeat"
    );

    let old_result = after_model(
        old.state.clone(),
        &old.job,
        tool_reply(),
        false,
        T0,
        extended + 1,
    );
    let before = snapshot(store, &run, &session).await;
    let stale = commit_stale(
        store,
        &old.claim,
        old_result.clone(),
        Some(lease(OWNER_A, extended + LEASE_MS)),
        extended + 1,
    )
    .await;
    assert_eq!(stale, Stale::LeaseLost);
    assert_eq!(
        snapshot(store, &run, &session).await,
        before,
        "a stale commit must write nothing"
    );

    let new_result = after_model(
        new.state.clone(),
        &new.job,
        tool_reply(),
        false,
        extended,
        extended + 2,
    );
    commit(store, &new.claim, new_result.clone(), None, extended + 2).await;
    let before = snapshot(store, &run, &session).await;
    let duplicate = commit_stale(store, &new.claim, new_result, None, extended + 3).await;
    assert_eq!(duplicate, Stale::LeaseLost, "a step commits once");
    let stale = commit_stale(store, &old.claim, old_result, None, extended + 3).await;
    assert_eq!(stale, Stale::LeaseLost);
    assert_eq!(
        snapshot(store, &run, &session).await,
        before,
        "a duplicate commit must write nothing"
    );

    let next = claim(store, OWNER_A, extended + 4).await;
    assert_eq!(
        (next.job.step_index, next.job.attempt),
        (2, 1),
        "the one commit enqueued one job"
    );
    assert_nothing_claimable(store, extended + 4, "refused commits must not enqueue jobs").await;
}

/// Of two tasks committing the same claim at once, exactly one commits.
pub async fn concurrent_commits_of_one_claim_have_one_winner(store: Arc<dyn Store>) {
    let session = new_session(&*store).await;
    let (run, _) = submit(&*store, &session, "commit twice", config(), T0).await;
    let claimed = claim(&*store, OWNER_A, T0).await;
    let result = after_model(claimed.state, &claimed.job, tool_reply(), false, T0, T0 + 1);
    let committers: Vec<_> = (0..2)
        .map(|_| {
            let (store, claim, result) =
                (Arc::clone(&store), claimed.claim.clone(), result.clone());
            tokio::spawn(async move { store.commit_step(&claim, result, None, T0 + 1).await })
        })
        .collect();
    let mut committed = 0;
    for committer in committers {
        match committer
            .await
            .expect("commit task panicked")
            .expect("commit_step failed")
        {
            Commit::Committed { .. } => committed += 1,
            Commit::Stale(stale) => assert_eq!(stale, Stale::LeaseLost, "the loser's job is gone"),
        }
    }
    assert_eq!(
        committed, 1,
        "exactly one of two identical commits may succeed"
    );
    assert_eq!(store.steps(&run).await.unwrap().len(), 1);
    assert_eq!(
        store.history(&session).await.unwrap().len(),
        2,
        "the step's message is written once"
    );
    let next = claim(&*store, OWNER_B, T0 + 2).await;
    assert_eq!(next.job.step_index, 2);
    assert_nothing_claimable(&*store, T0 + 2, "one commit enqueues one next job").await;
}

/// Event seqs of a session are 1, 2, 3, … across submits, commits and appends, even when
/// appends race; `events_after` returns exactly the suffix after a seq.
pub async fn event_seqs_are_dense_per_session(store: Arc<dyn Store>) {
    let session = new_session(&*store).await;
    let other = new_session(&*store).await;
    let mut seen = Vec::new();
    let (first, submitted) = submit(&*store, &session, "one", config(), T0).await;
    seen.extend(submitted.events);
    let (other_run, _) = submit(&*store, &other, "elsewhere", config(), T0).await;
    let (second, submitted) = submit(&*store, &session, "two", config(), T0 + 1).await;
    seen.extend(submitted.events);
    let drafts = |n: usize, run: &RunId| -> Vec<EventDraft> {
        (0..n)
            .map(|i| {
                EventDraft::new(
                    EventKind::AssistantDelta,
                    json!({"run_id": run, "delta": i}),
                )
            })
            .collect()
    };
    seen.extend(
        store
            .append_events(&session, &first, drafts(3, &first), T0 + 2)
            .await
            .unwrap(),
    );
    let claimed = claim(&*store, OWNER_A, T0 + 3).await;
    let done = after_model(
        claimed.state,
        &claimed.job,
        text_reply("done"),
        false,
        T0 + 3,
        T0 + 4,
    );
    let (events, _, _) = commit(&*store, &claimed.claim, done, None, T0 + 4).await;
    seen.extend(events);

    let appenders: Vec<_> = (0..4)
        .map(|_| {
            let (store, session, run) = (Arc::clone(&store), session.clone(), second.clone());
            tokio::spawn(async move {
                let mut stored = Vec::new();
                for _ in 0..5 {
                    let batch = drafts(2, &run);
                    stored.extend(
                        store
                            .append_events(&session, &run, batch, T0 + 5)
                            .await
                            .unwrap(),
                    );
                }
                stored
            })
        })
        .collect();
    for appender in appenders {
        seen.extend(appender.await.expect("append task panicked"));
    }

    seen.sort_by_key(|e| e.seq);
    let seqs: Vec<i64> = seen.iter().map(|e| e.seq).collect();
    let dense: Vec<i64> = (1..=seen.len() as i64).collect();
    assert_eq!(
        seqs, dense,
        "seqs returned by writes must be 1..n without gaps or duplicates"
    );
    let all = store.events_after(&session, 0, 10_000).await.unwrap();
    assert_eq!(
        all, seen,
        "events_after(0) returns exactly the events the writes returned"
    );
    assert_attributed(&all);
    for after in 0..=all.len() {
        let suffix = store
            .events_after(&session, after as i64, 10_000)
            .await
            .unwrap();
        assert_eq!(
            suffix,
            all[after..],
            "events_after({after}) must be the suffix after it"
        );
        let page = store.events_after(&session, after as i64, 3).await.unwrap();
        assert_eq!(
            page,
            all[after..all.len().min(after + 3)],
            "events_after({after}, 3)"
        );
    }

    let elsewhere = store.events_after(&other, 0, 10_000).await.unwrap();
    let seqs: Vec<i64> = elsewhere.iter().map(|e| e.seq).collect();
    let dense: Vec<i64> = (1..=elsewhere.len() as i64).collect();
    assert_eq!(seqs, dense, "each session numbers its own events from 1");
    assert!(
        elsewhere
            .iter()
            .all(|e| e.session_id == other && e.run_id.as_ref() == Some(&other_run))
    );
}

/// Intents come back in slot order with their outcomes; recording one again counts an
/// attempt; an outcome needs its intent; and both are fenced: a claim that was lost can
/// record neither.
pub async fn intents_keep_slot_order_attempts_and_outcomes(store: &dyn Store) {
    let session = new_session(store).await;
    let (run, _) = submit(store, &session, "do things", config(), T0).await;
    let first = claim(store, OWNER_A, T0).await;
    let intent = |slot: u32, kind: IntentKind, name: &str| Intent {
        slot,
        kind,
        name: name.into(),
        idempotency_key: format!("{run}#1#{slot}"),
    };
    let record =
        |slot: u32, kind: IntentKind, name: &str, attempts: u32, outcome: Option<ToolOutcome>| {
            IntentRecord {
                slot,
                kind,
                name: name.into(),
                attempts,
                outcome,
            }
        };
    let batch = vec![
        intent(2, IntentKind::Tool, "write"),
        intent(0, IntentKind::Model, "model"),
        intent(1, IntentKind::Tool, "read"),
    ];
    let announce = EventDraft::new(EventKind::ToolCall, json!({"run_id": run}));
    let recorded = store
        .record_intents(&first.claim, batch, vec![announce], T0)
        .await
        .unwrap();
    assert_eq!(
        recorded.attempts,
        [1, 1, 1],
        "first attempts, in the order given"
    );
    let announced = recorded.events;
    assert_eq!(
        announced.len(),
        1,
        "the announcing event is stored with the intents"
    );
    assert_eq!(announced[0].kind, "tool.call");
    assert_eq!(announced[0].run_id.as_ref(), Some(&run));
    assert_eq!(announced[0].session_id, session);
    let replayed = store
        .events_after(&session, announced[0].seq - 1, 1)
        .await
        .unwrap();
    assert_eq!(
        replayed, announced,
        "and it is durable like any other event"
    );
    assert_eq!(
        store.intents(&run, 1).await.unwrap(),
        [
            record(0, IntentKind::Model, "model", 1, None),
            record(1, IntentKind::Tool, "read", 1, None),
            record(2, IntentKind::Tool, "write", 1, None),
        ],
        "intents come back in slot order, whatever the order they were recorded in"
    );

    store
        .record_outcome(&first.claim, 1, ToolOutcome::ok("read ok"), T0 + 1)
        .await
        .unwrap();
    let again = store
        .record_intents(
            &first.claim,
            vec![intent(0, IntentKind::Model, "model")],
            Vec::new(),
            T0 + 2,
        )
        .await
        .unwrap();
    assert_eq!(
        again.attempts,
        [2],
        "recording an intent again counts an attempt"
    );
    assert!(again.events.is_empty());
    let missing = store
        .record_outcome(&first.claim, 7, ToolOutcome::ok("ghost"), T0 + 3)
        .await;
    assert!(
        missing.is_err(),
        "an outcome without its intent must be refused"
    );

    // The lease runs out and another worker takes the step over: the first claim is dead.
    let expired = T0 + LEASE_MS;
    let second = claim(store, OWNER_B, expired).await;
    let late_intent = store
        .record_intents(
            &first.claim,
            vec![intent(3, IntentKind::Tool, "late")],
            Vec::new(),
            expired,
        )
        .await;
    assert!(
        matches!(late_intent, Err(Error::LeaseLost { .. })),
        "an intent under a lost claim is refused: {late_intent:?}"
    );
    let late_outcome = store
        .record_outcome(&first.claim, 2, ToolOutcome::ok("late write"), expired)
        .await;
    assert!(
        matches!(late_outcome, Err(Error::LeaseLost { .. })),
        "an outcome under a lost claim is refused: {late_outcome:?}"
    );
    store
        .record_outcome(
            &second.claim,
            2,
            ToolOutcome::error("disk full"),
            expired + 1,
        )
        .await
        .unwrap();
    assert_eq!(
        store.intents(&run, 1).await.unwrap(),
        [
            record(0, IntentKind::Model, "model", 2, None),
            record(
                1,
                IntentKind::Tool,
                "read",
                1,
                Some(ToolOutcome::ok("read ok"))
            ),
            record(
                2,
                IntentKind::Tool,
                "write",
                1,
                Some(ToolOutcome::error("disk full"))
            ),
        ],
        "nothing of the lost claim's late writes was kept"
    );
    assert!(store.intents(&run, 9).await.unwrap().is_empty());
}

/// A queued run has nothing in flight: a cancel ends it at once, and it never starts.
pub async fn cancel_of_a_queued_run_is_immediate(store: &dyn Store) {
    let session = new_session(store).await;
    let (first, _) = submit(store, &session, "first", config(), T0).await;
    let (second, _) = submit(store, &session, "second", config(), T0 + 1).await;

    match store.request_cancel(&second, T0 + 2).await.unwrap() {
        CancelOutcome::Cancelled { events, enqueued } => {
            assert!(!enqueued, "cancelling a queued run starts nothing");
            assert_attributed(&events);
            assert!(
                kinds(&events).contains(&"run.finished"),
                "got {:?}",
                kinds(&events)
            );
        }
        other => panic!("cancel of a queued run: expected Cancelled, got {other:?}"),
    }
    let state = load(store, &second).await;
    assert_eq!(
        (state.status, state.stop_reason),
        (RunStatus::Cancelled, Some(StopReason::Cancelled))
    );
    assert_eq!(
        (state.finished_at, state.cancel_requested),
        (Some(T0 + 2), true)
    );
    assert!(!store.runs_with_jobs().await.unwrap().contains(&second));
    assert_eq!(
        load(store, &first).await.status,
        RunStatus::Running,
        "other runs are untouched"
    );
    // The session is still held by the first run, so a later submit must still queue.
    let (third, submitted) = submit(store, &session, "third", config(), T0 + 3).await;
    assert_eq!(
        submitted.status,
        RunStatus::Queued,
        "cancelling a queued run must not free the session"
    );
    assert_one_active(store, &session).await;

    let claimed = claim(store, OWNER_A, T0 + 4).await;
    assert_eq!(claimed.job.run_id, first, "only the active run has a job");
    assert_nothing_claimable(
        store,
        T0 + 4,
        "the cancelled and the queued run have no job",
    )
    .await;
    let done = after_model(
        claimed.state,
        &claimed.job,
        text_reply("done"),
        false,
        T0 + 4,
        T0 + 5,
    );
    let (_, _, enqueued) = commit(store, &claimed.claim, done, None, T0 + 5).await;
    assert!(
        enqueued,
        "the next queued run starts when the session frees up"
    );
    assert_eq!(
        load(store, &second).await.status,
        RunStatus::Cancelled,
        "a cancelled run never starts"
    );
    assert_eq!(
        load(store, &third).await.status,
        RunStatus::Running,
        "the cancelled run is skipped"
    );
    assert_eq!(
        user_messages(store, &session).await,
        ["first", "third"],
        "a run that never started leaves no message"
    );
    let next = claim(store, OWNER_B, T0 + 6).await;
    assert_eq!(next.job.run_id, third);

    for (run, status) in [
        (&first, RunStatus::Completed),
        (&second, RunStatus::Cancelled),
    ] {
        match store.request_cancel(run, T0 + 6).await.unwrap() {
            CancelOutcome::AlreadyTerminal(found) => assert_eq!(found, status),
            other => panic!("cancel of a {status} run: expected AlreadyTerminal, got {other:?}"),
        }
    }
}

/// A running run may have a step in flight: a cancel marks it `cancelling`, the in-flight
/// step's commit keeps its work but yields to the cancel, and a Cancel step ends the run.
pub async fn cancel_of_a_running_run_goes_through_cancelling(store: &dyn Store) {
    let session = new_session(store).await;
    let (run, _) = submit(store, &session, "long task", config(), T0).await;
    let in_flight = claim(store, OWNER_A, T0).await;

    match store.request_cancel(&run, T0 + 1).await.unwrap() {
        CancelOutcome::Cancelling { events } => {
            assert_attributed(&events);
            assert!(
                events
                    .iter()
                    .any(|e| e.kind == "run.status" && e.payload["status"] == "cancelling"),
                "the move to cancelling is published, got {events:?}"
            );
        }
        other => panic!("cancel of a running run: expected Cancelling, got {other:?}"),
    }
    let state = load(store, &run).await;
    assert_eq!(
        (state.status, state.cancel_requested),
        (RunStatus::Cancelling, true)
    );

    // The in-flight step knows nothing of the cancel: its result still says `running`.
    let result = after_model(
        in_flight.state,
        &in_flight.job,
        tool_reply(),
        false,
        T0,
        T0 + 2,
    );
    assert_eq!(result.state.status, RunStatus::Running, "precondition");
    let mut expected = result.clone();
    expected.yield_to_cancel();
    let (_, continued, enqueued) = commit(store, &in_flight.claim, result, None, T0 + 2).await;
    assert!(continued.is_none() && enqueued);
    assert_eq!(
        load(store, &run).await,
        expected.state,
        "the commit yields to the cancel"
    );
    let history = store.history(&session).await.unwrap();
    assert_eq!(
        history.last(),
        expected.messages.last(),
        "the in-flight step's work is kept"
    );

    let cancel = claim(store, OWNER_B, T0 + 3).await;
    assert_eq!(
        cancel.job,
        StepJob {
            run_id: run.clone(),
            step_index: 2,
            phase: Phase::Cancel,
            attempt: 1
        }
    );
    assert!(
        cancel.state.cancel_requested,
        "the claimed state carries the cancel request"
    );
    let finish = finish_step(
        cancel.state,
        &cancel.job,
        StopReason::Cancelled,
        T0 + 3,
        T0 + 4,
    );
    commit(store, &cancel.claim, finish, None, T0 + 4).await;
    let state = load(store, &run).await;
    assert_eq!(
        (state.status, state.stop_reason),
        (RunStatus::Cancelled, Some(StopReason::Cancelled))
    );
    match store.request_cancel(&run, T0 + 5).await.unwrap() {
        CancelOutcome::AlreadyTerminal(status) => assert_eq!(status, RunStatus::Cancelled),
        other => panic!("cancel of a cancelled run: expected AlreadyTerminal, got {other:?}"),
    }
}

/// A run cancelled while it waits for a human to reconcile a call of its batch closes the
/// batch in its history: every call is answered, the one in doubt as unknown (and listed in
/// doubt on the run), the others with their outcome or as not run — so the next run of the
/// session is never told "not run" of a call that started.
pub async fn a_run_cancelled_while_a_call_is_in_doubt_tells_the_truth_of_its_batch(
    store: &dyn Store,
) {
    let session = new_session(store).await;
    let (run, _) = submit(store, &session, "risky", config(), T0).await;
    let model = claim(store, OWNER_A, T0 + 1).await;
    let mut reply = tool_reply();
    reply.tool_calls.push(ToolCall {
        id: "call-2".into(),
        name: "lookup".into(),
        arguments: json!({"q": "more"}),
    });
    let asked = after_model(model.state, &model.job, reply, false, T0 + 1, T0 + 2);
    commit(store, &model.claim, asked, None, T0 + 2).await;
    let tools = claim(store, OWNER_A, T0 + 3).await;
    let doubt = UnknownCall {
        drift: None,
        call_index: 0,
        call_id: "call-1".into(),
        tool: "lookup".into(),
        arguments: json!({"q": "answer"}),
        idempotency_key: format!("{run}#2#0"),
    };
    let request = HumanRequest::Reconciliation { calls: vec![doubt] };
    let waiting = await_reconciliation(
        tools.state,
        &tools.job,
        vec![None, None],
        request,
        T0 + 3,
        T0 + 4,
    );
    commit(store, &tools.claim, waiting, None, T0 + 4).await;
    match store.request_cancel(&run, T0 + 5).await.unwrap() {
        CancelOutcome::Cancelled { events, .. } => {
            let results: Vec<&str> = (events.iter())
                .filter(|e| e.kind == "tool.result")
                .map(|e| e.payload["call_id"].as_str().unwrap())
                .collect();
            assert_eq!(
                results,
                ["call-1", "call-2"],
                "announced with the run's end"
            );
        }
        other => panic!("cancel of a run waiting for a human: got {other:?}"),
    }
    let history = store.history(&session).await.unwrap();
    let told: Vec<(&str, &str)> = (history.iter())
        .filter(|m| m.role == Role::Tool)
        .map(|m| (m.tool_call_id.as_deref().unwrap(), m.content.as_str()))
        .collect();
    assert_eq!(told.len(), 2, "{told:?}");
    assert_eq!(told[0].0, "call-1");
    assert!(told[0].1.starts_with("outcome unknown"), "{told:?}");
    assert_eq!(told[1].0, "call-2");
    assert!(told[1].1.starts_with("not run"), "{told:?}");
    let state = load(store, &run).await;
    assert_eq!(state.status, RunStatus::Cancelled);
    let doubted: Vec<&str> = state.in_doubt.iter().map(|c| c.call_id.as_str()).collect();
    assert_eq!(doubted, ["call-1"]);
}

/// A run waiting on a human past its deadline ends `timed_out` at the sweep, not before; the
/// call it waited on stays in doubt on it, and the next queued run starts.
pub async fn a_run_waiting_past_its_deadline_times_out_and_frees_the_session(store: &dyn Store) {
    let session = new_session(store).await;
    let mut timed = config();
    timed.limits.max_duration_ms = Some(1_000);
    let (first, _) = submit(store, &session, "risky", timed, T0).await;
    let (second, _) = submit(store, &session, "next", config(), T0 + 1).await;
    let model = claim(store, OWNER_A, T0 + 2).await;
    let asked = after_model(model.state, &model.job, tool_reply(), false, T0 + 2, T0 + 3);
    commit(store, &model.claim, asked, None, T0 + 3).await;
    let tools = claim(store, OWNER_A, T0 + 4).await;
    let doubt = UnknownCall {
        drift: None,
        call_index: 0,
        call_id: "call-1".into(),
        tool: "lookup".into(),
        arguments: json!({"q": "answer"}),
        idempotency_key: format!("{first}-2-0"),
    };
    let request = HumanRequest::Reconciliation {
        calls: vec![doubt.clone()],
    };
    let waiting =
        await_reconciliation(tools.state, &tools.job, vec![None], request, T0 + 4, T0 + 5);
    commit(store, &tools.claim, waiting, None, T0 + 5).await;
    let deadline = load(store, &first)
        .await
        .deadline()
        .expect("a started run with a budget");

    let early = store.time_out_overdue(deadline - 1).await.unwrap();
    assert!(
        early.ended.is_empty() && early.events.is_empty(),
        "{early:?}"
    );
    assert_eq!(load(store, &first).await.status, RunStatus::WaitingHuman);

    let swept = store.time_out_overdue(deadline).await.unwrap();
    assert_eq!(swept.ended, std::slice::from_ref(&first));
    assert!(
        swept.enqueued,
        "the queued run starts and its job must wake the workers"
    );
    assert_attributed(&swept.events);
    let finished = swept
        .events
        .iter()
        .find(|e| e.kind == "run.finished")
        .expect("a run.finished event");
    assert_eq!(finished.payload["stop_reason"], "timed_out");
    assert_eq!(finished.payload["in_doubt"][0]["call_id"], "call-1");
    let state = load(store, &first).await;
    assert_eq!(
        (state.status, state.stop_reason),
        (RunStatus::Failed, Some(StopReason::TimedOut))
    );
    assert_eq!(state.pending_human, None);
    assert_eq!(state.in_doubt, [doubt]);
    assert_eq!(load(store, &second).await.status, RunStatus::Running);
    assert_one_active(store, &session).await;
    let again = store.time_out_overdue(deadline + 10_000).await.unwrap();
    assert!(again.ended.is_empty(), "an ended run is swept once");

    // What happened to the call can still be recorded; the run stays ended.
    store
        .reconcile(
            &first,
            "call-1",
            Reconciliation::Succeeded,
            None,
            deadline + 1,
        )
        .await
        .unwrap();
    let state = load(store, &first).await;
    assert_eq!(state.status, RunStatus::Failed);
    assert!(state.in_doubt.is_empty());
}

/// A run waiting on a human holds its session but has nothing in flight: a cancel ends it
/// at once and the next queued run starts. The calls it waited to have reconciled stay in
/// doubt on the ended run.
pub async fn cancel_of_a_waiting_run_frees_the_session(store: &dyn Store) {
    let session = new_session(store).await;
    let (first, _) = submit(store, &session, "risky", config(), T0).await;
    let (second, _) = submit(store, &session, "next", config(), T0 + 1).await;
    let model = claim(store, OWNER_A, T0 + 2).await;
    let asked = after_model(model.state, &model.job, tool_reply(), false, T0 + 2, T0 + 3);
    commit(store, &model.claim, asked, None, T0 + 3).await;
    let tools = claim(store, OWNER_A, T0 + 4).await;
    let request = HumanRequest::Reconciliation {
        calls: vec![UnknownCall {
            drift: None,
            call_index: 0,
            call_id: "call-1".into(),
            tool: "lookup".into(),
            arguments: json!({"q": "answer"}),
            idempotency_key: format!("{first}-2-0"),
        }],
    };
    let waiting = await_reconciliation(
        tools.state,
        &tools.job,
        vec![None],
        request.clone(),
        T0 + 4,
        T0 + 5,
    );
    let (_, continued, enqueued) = commit(store, &tools.claim, waiting, None, T0 + 5).await;
    assert!(continued.is_none() && !enqueued, "a waiting run has no job");
    let state = load(store, &first).await;
    assert_eq!(
        (state.status, state.pending_human),
        (RunStatus::WaitingHuman, Some(request.clone()))
    );
    assert_eq!(
        load(store, &second).await.status,
        RunStatus::Queued,
        "a waiting run holds its session"
    );
    assert_nothing_claimable(
        store,
        T0 + 10 * LEASE_MS,
        "neither a waiting nor a queued run has a job",
    )
    .await;
    assert_one_active(store, &session).await;

    match store.request_cancel(&first, T0 + 6).await.unwrap() {
        CancelOutcome::Cancelled { events, enqueued } => {
            assert!(
                enqueued,
                "the queued run starts and its job must wake the workers"
            );
            assert_attributed(&events);
        }
        other => panic!("cancel of a waiting run: expected Cancelled, got {other:?}"),
    }
    let state = load(store, &first).await;
    assert_eq!(
        (state.status, state.stop_reason),
        (RunStatus::Cancelled, Some(StopReason::Cancelled))
    );
    assert_eq!(
        state.pending_human, None,
        "a cancelled run waits for no one"
    );
    let HumanRequest::Reconciliation { calls } = request else {
        unreachable!("the request above asks for a reconciliation")
    };
    assert_eq!(
        state.in_doubt, calls,
        "nobody knows whether the call took effect: the cancelled run still lists it in doubt"
    );
    assert_eq!(
        load(store, &second).await.status,
        RunStatus::Running,
        "the session is free again"
    );
    assert_eq!(user_messages(store, &session).await, ["risky", "next"]);
    assert_one_active(store, &session).await;
    let next = claim(store, OWNER_B, T0 + 7).await;
    assert_eq!(
        next.job,
        StepJob {
            run_id: second.clone(),
            step_index: 1,
            phase: Phase::UserInput,
            attempt: 1
        }
    );
}

/// `retry_later` gives a job back until `available_at`; the next claim is a new attempt. A
/// claim already lost cannot give anything back.
pub async fn retry_later_delays_the_next_claim(store: &dyn Store) {
    let session = new_session(store).await;
    let (run, _) = submit(store, &session, "flaky model", config(), T0).await;
    let first = claim(store, OWNER_A, T0).await;
    let available_at = T0 + 500;
    let failure = EventDraft::new(
        EventKind::ModelError,
        json!({"run_id": run, "error": "rate limited"}),
    );
    let events = store
        .retry_later(&first.claim, available_at, failure.clone(), T0 + 10)
        .await
        .unwrap()
        .expect("the holder of a claim may give its job back");
    assert_eq!(kinds(&events), ["model.error"]);
    assert_attributed(&events);
    assert!(
        store.lease_owners().await.unwrap().is_empty(),
        "a job given back is held by nobody"
    );
    assert_nothing_claimable(
        store,
        available_at - 1,
        "a retried job waits for available_at",
    )
    .await;

    let second = claim(store, OWNER_B, available_at).await;
    assert_eq!(
        second.job,
        StepJob {
            run_id: run.clone(),
            step_index: 1,
            phase: Phase::UserInput,
            attempt: 2
        }
    );
    assert_ne!(second.claim.epoch, first.claim.epoch);
    let lost = store
        .retry_later(&first.claim, available_at, failure, available_at + 1)
        .await
        .unwrap();
    assert!(lost.is_none(), "a lost claim cannot give the job back");
    assert_eq!(
        store.lease_owners().await.unwrap(),
        [OWNER_B],
        "the new holder keeps its lease"
    );
    assert_nothing_claimable(
        store,
        available_at + 1,
        "the job is still leased to its new holder",
    )
    .await;
}

/// A dead owner's leases are released at once, so its jobs need not wait for expiry.
pub async fn release_leases_frees_a_dead_owners_jobs(store: &dyn Store) {
    let mut runs = Vec::new();
    for content in ["one", "two", "three"] {
        let session = new_session(store).await;
        runs.push(submit(store, &session, content, config(), T0).await.0);
    }
    let far = T0 + 100 * LEASE_MS;
    let mut held = Vec::new();
    for owner in [OWNER_A, OWNER_A, OWNER_B] {
        let claimed = store
            .claim_next(lease(owner, far), None, T0)
            .await
            .unwrap()
            .expect("a job per run");
        held.push(claimed);
    }
    let mut owners = store.lease_owners().await.unwrap();
    owners.sort();
    assert_eq!(owners, [OWNER_A, OWNER_B]);
    assert_nothing_claimable(store, T0 + 1, "every job is leased").await;

    assert_eq!(
        store.release_leases(OWNER_A).await.unwrap(),
        2,
        "owner A held two jobs"
    );
    assert_eq!(store.lease_owners().await.unwrap(), [OWNER_B]);
    let mut freed = Vec::new();
    for _ in 0..2 {
        let claimed = claim(store, OWNER_C, T0 + 1).await;
        assert_eq!(
            claimed.job.attempt, 2,
            "a released job is claimed again as a new attempt"
        );
        freed.push(claimed.job.run_id);
    }
    freed.sort();
    let mut released: Vec<RunId> = held[..2].iter().map(|c| c.job.run_id.clone()).collect();
    released.sort();
    assert_eq!(freed, released, "exactly owner A's jobs were released");
    assert_nothing_claimable(store, T0 + 1, "owner B's job is still leased").await;
    assert_eq!(store.release_leases("nobody").await.unwrap(), 0);

    let dead = &held[0];
    let late = after_model(
        dead.state.clone(),
        &dead.job,
        text_reply("late"),
        false,
        T0,
        T0 + 2,
    );
    let stale = commit_stale(store, &dead.claim, late, None, T0 + 2).await;
    assert_eq!(
        stale,
        Stale::LeaseLost,
        "a released and reclaimed job fences out its old owner"
    );
}

/// Unknown runs and sessions are NotFound; a session is created once.
pub async fn missing_and_duplicate_entities_are_errors(store: &dyn Store) {
    let ghost_run = RunId::from_suffix(&unique()).unwrap();
    let ghost_session = SessionId::from_suffix(&unique()).unwrap();
    match store.load_state(&ghost_run).await {
        Err(Error::NotFound { .. }) => {}
        other => panic!("load_state of an unknown run: expected NotFound, got {other:?}"),
    }
    match store.request_cancel(&ghost_run, T0).await {
        Err(Error::NotFound { .. }) => {}
        other => panic!("request_cancel of an unknown run: expected NotFound, got {other:?}"),
    }
    let new = NewRun {
        session_id: ghost_session.clone(),
        run_id: ghost_run.clone(),
        message_id: MessageId::from_suffix(&unique()).unwrap(),
        content: "hello?".into(),
        config: config(),
        when_busy: WhenBusy::Enqueue,
        quota: Default::default(),
        trace: None,
        request: None,
    };
    match store.submit_message(new, T0).await {
        Err(Error::NotFound { .. }) => {}
        other => panic!("submit to an unknown session: expected NotFound, got {other:?}"),
    }
    assert!(
        store.list_runs().await.unwrap().is_empty(),
        "a refused submit writes no run"
    );
    let appended = store
        .append_events(
            &ghost_session,
            &ghost_run,
            vec![EventDraft::new(EventKind::Activity, json!({}))],
            T0,
        )
        .await;
    match appended {
        Err(Error::NotFound { .. }) => {}
        other => panic!("append_events to an unknown session: expected NotFound, got {other:?}"),
    }

    let session = new_session(store).await;
    match store
        .create_session(&session, SessionSpec::default(), T0 + 1)
        .await
    {
        Err(Error::Conflict(_)) => {}
        other => panic!("create_session twice: expected Conflict, got {other:?}"),
    }
    let (_, submitted) = submit(store, &session, "still usable", config(), T0 + 2).await;
    assert_eq!(
        submitted.status,
        RunStatus::Running,
        "a refused duplicate leaves the session intact"
    );
}

/// The store owns two parts of the state a step may not change: the run's configuration,
/// frozen at submit, and the cancel flag. Whatever a committed result carries, loads and
/// continued claims see the store's values.
pub async fn config_and_cancel_flag_are_owned_by_the_store(store: &dyn Store) {
    let frozen = RunConfigSnapshot {
        model: "scripted:frozen".into(),
        model_settings: Some(ratchet_core::ModelSettings {
            provider: "openai".into(),
            base_url: "http://127.0.0.1:9/v1".into(),
            model: "frozen-1".into(),
            api_key_env: Some("FROZEN_KEY".into()),
            connect_timeout_ms: 1_000,
            read_timeout_ms: 2_000,
            stream: true,
            max_output_tokens: Some(512),
            prices: Some(ratchet_core::Prices {
                input_per_mtok: 0.5,
                output_per_mtok: 1.5,
                cache_write_per_mtok: None,
                cache_read_per_mtok: Some(0.05),
            }),
        }),
        workspace: Some("/srv/workspace".into()),
        system_prompt: "answer briefly".into(),
        tools: vec![ToolSpec {
            calls: Default::default(),
            name: "lookup".into(),
            description: "looks things up".into(),
            parameters: json!({"type": "object", "properties": {"q": {"type": "string"}}}),
            replay: ReplayPolicy::Keyed,
            completes_run: false,
            approval: ApprovalPolicy::WhenArguments(
                [("q".to_owned(), "secret*".to_owned())].into(),
            ),
            delegation: ToolDelegation::Delegatable,
        }],
        limits: Limits {
            max_steps: 7,
            ..Limits::default()
        },
        memory_scope: MemoryScope::Tenant,
        ..RunConfigSnapshot::default()
    };
    let tampered = RunConfigSnapshot {
        model: "scripted:tampered".into(),
        ..RunConfigSnapshot::default()
    };
    let session = new_session(store).await;
    let (run, _) = submit(store, &session, "configured", frozen.clone(), T0).await;
    assert_eq!(*load(store, &run).await.config, frozen);
    let first = claim(store, OWNER_A, T0).await;
    assert_eq!(
        *first.state.config, frozen,
        "a claim runs under the frozen config"
    );

    let mut result = after_model(first.state, &first.job, tool_reply(), false, T0, T0 + 1);
    result.state.config = Arc::new(tampered.clone());
    result.state.cancel_requested = true;
    let (_, continued, _) = commit(
        store,
        &first.claim,
        result,
        Some(lease(OWNER_A, T0 + 1 + LEASE_MS)),
        T0 + 1,
    )
    .await;
    let continued = continued.expect("continued job");
    assert_eq!(
        *continued.state.config, frozen,
        "a continued step runs under the frozen config"
    );
    assert!(
        !continued.state.cancel_requested,
        "no cancel was requested of the store"
    );
    let state = load(store, &run).await;
    assert_eq!(
        *state.config, frozen,
        "a commit never changes the frozen config"
    );
    assert!(
        !state.cancel_requested,
        "the cancel flag is never taken from a committed state"
    );

    let mut result = after_tools(
        continued.state,
        &continued.job,
        vec![ToolOutcome::ok("x")],
        0,
        T0 + 1,
        T0 + 2,
    );
    result.state.config = Arc::new(tampered);
    commit(store, &continued.claim, result, None, T0 + 2).await;
    let third = claim(store, OWNER_B, T0 + 3).await;
    assert_eq!(
        *third.state.config, frozen,
        "a claim after commits still sees the frozen config"
    );
    assert_eq!(*load(store, &run).await.config, frozen);
}

/// A config whose `lookup` needs approval and whose `note` does not.
fn guarded_config() -> RunConfigSnapshot {
    let tool = |name: &str, approval| ToolSpec {
        calls: Default::default(),
        name: name.into(),
        description: String::new(),
        parameters: json!({"type": "object"}),
        replay: ReplayPolicy::Never,
        completes_run: false,
        approval,
        delegation: Default::default(),
    };
    RunConfigSnapshot {
        tools: vec![
            tool("lookup", ApprovalPolicy::Always),
            tool("note", ApprovalPolicy::Never),
        ],
        ..config()
    }
}

/// Submits a message to a guarded run and commits the model step that asks for `lookup`
/// and `note` in one batch.
async fn gated_run(store: &dyn Store, session: &SessionId, now: Millis) -> (RunId, Approval) {
    let (run, _) = submit(store, session, "look it up", guarded_config(), now).await;
    (run.clone(), ask_approval_in(store, &run, now).await)
}

/// Claims the run's next job, a model call, and commits its reply asking for `lookup` and
/// `note` in one batch; returns the approval the run then waits on.
async fn ask_approval_in(store: &dyn Store, run: &RunId, now: Millis) -> Approval {
    let model = store
        .claim_next(lease(OWNER_A, now + LEASE_MS), Some(run), now)
        .await
        .unwrap()
        .expect("the gated run's model job");
    let mut reply = tool_reply();
    reply.tool_calls.push(ToolCall {
        id: "call-2".into(),
        name: "note".into(),
        arguments: json!({"text": "looked"}),
    });
    let asked = after_model(model.state, &model.job, reply, false, now, now + 1);
    let (events, continued, enqueued) = commit(store, &model.claim, asked, None, now + 1).await;
    assert!(
        continued.is_none() && !enqueued,
        "a gated batch leaves no job behind"
    );
    assert!(
        kinds(&events).contains(&"approval.required"),
        "the gate is announced: {:?}",
        kinds(&events)
    );
    let state = load(store, run).await;
    let Some(HumanRequest::Approval { approval_id, .. }) = state.pending_human else {
        panic!(
            "a batch with a guarded call waits for approval, found {:?} / {:?}",
            state.status, state.pending_human
        );
    };
    store.get_approval(&approval_id).await.unwrap()
}

/// A run that ends while it waits on an approval (here its deadline passes) closes the
/// approval in the transaction that ends it: continued, the run asks again under a new
/// approval, and the first stays cancelled — it never reads as pending again, and answering
/// it is a conflict.
pub async fn an_approval_of_a_run_that_ended_is_closed_with_it(store: &dyn Store) {
    let session = new_session(store).await;
    let guarded = guarded_config();
    let limited = RunConfigSnapshot {
        limits: Limits {
            max_duration_ms: Some(1_000),
            ..guarded.limits
        },
        ..guarded
    };
    let (run, _) = submit(store, &session, "look it up", limited, T0).await;
    let first = ask_approval_in(store, &run, T0).await;
    let timed_out = store.time_out_overdue(T0 + 2_000).await.unwrap();
    assert_eq!(timed_out.ended, std::slice::from_ref(&run));
    let closed = store.get_approval(&first.id).await.unwrap();
    assert_eq!(
        (closed.status, closed.decided_at),
        (ApprovalStatus::Cancelled, Some(T0 + 2_000))
    );
    let more = Resumption::Continue {
        extension: BudgetExtension {
            duration_ms: 60_000,
            ..Default::default()
        },
    };
    store
        .resume_failed(&run, more, None, T0 + 3_000)
        .await
        .unwrap();
    let second = ask_approval_in(store, &run, T0 + 3_000).await;
    assert_ne!(second.id, first.id);
    assert_eq!(second.status, ApprovalStatus::Pending);
    assert_eq!(
        store.get_approval(&first.id).await.unwrap().status,
        ApprovalStatus::Cancelled,
        "the ended run's approval stays closed"
    );
    let pending = store
        .approvals(DEFAULT_TENANT, Some(ApprovalStatus::Pending), None, 100)
        .await
        .unwrap();
    let pending: Vec<&ratchet_core::ApprovalId> = pending.iter().map(|a| &a.id).collect();
    assert_eq!(pending, [&second.id]);
    let answer = decisions(&[("call-1", Verdict::Approve, None)]);
    match store
        .answer_approval(&first.id, answer, "a human", T0 + 3_001)
        .await
    {
        Err(Error::Conflict(_)) => {}
        other => panic!("answering a closed approval: expected Conflict, got {other:?}"),
    }
}

fn decisions(pairs: &[(&str, Verdict, Option<&str>)]) -> ApprovalAnswer {
    ApprovalAnswer::Decisions(
        pairs
            .iter()
            .map(|(call_id, decision, note)| CallDecision {
                call_id: (*call_id).into(),
                decision: *decision,
                note: note.map(str::to_owned),
            })
            .collect(),
    )
}

/// If any call of a batch needs approval, none runs: the run waits with one approval holding
/// every call. A wrong answer changes nothing; a right one resumes the batch with denied
/// calls answered; the same answer again is harmless and a different one is a conflict.
pub async fn an_approval_holds_the_whole_batch_until_a_human_answers(store: &dyn Store) {
    let session = new_session(store).await;
    let (run, approval) = gated_run(store, &session, T0).await;
    assert_eq!(approval.status, ApprovalStatus::Pending);
    assert_eq!((&approval.run_id, &approval.session_id), (&run, &session));
    let gated: Vec<(&str, bool)> = approval
        .calls
        .iter()
        .map(|c| (c.call_id.as_str(), c.needs_approval))
        .collect();
    assert_eq!(gated, [("call-1", true), ("call-2", false)]);
    assert_eq!(load(store, &run).await.status, RunStatus::WaitingHuman);
    assert_nothing_claimable(store, T0 + 10 * LEASE_MS, "no call of a gated batch runs").await;
    let pending = store
        .approvals(DEFAULT_TENANT, Some(ApprovalStatus::Pending), None, 100)
        .await
        .unwrap();
    assert!(pending.contains(&approval), "pending approvals list it");
    let elsewhere = store
        .approvals("another-tenant", None, None, 100)
        .await
        .unwrap();
    assert!(
        elsewhere.iter().all(|a| a.id != approval.id),
        "another tenant never sees it"
    );

    let before = snapshot(store, &run, &session).await;
    for (wrong, why) in [
        (
            decisions(&[("call-2", Verdict::Approve, None)]),
            "a call that needs approval is undecided",
        ),
        (
            decisions(&[
                ("call-1", Verdict::Approve, None),
                ("call-9", Verdict::Approve, None),
            ]),
            "an unknown call is decided",
        ),
        (
            decisions(&[
                ("call-1", Verdict::Approve, None),
                ("call-1", Verdict::Deny, None),
            ]),
            "a call is decided twice",
        ),
    ] {
        match store
            .answer_approval(&approval.id, wrong, "a human", T0 + 2)
            .await
        {
            Err(Error::Invalid(_)) => {}
            other => panic!("{why}: expected Error::Invalid, got {other:?}"),
        }
    }
    assert_eq!(
        snapshot(store, &run, &session).await,
        before,
        "a refused answer writes nothing"
    );

    let answer = decisions(&[
        ("call-2", Verdict::Approve, None),
        ("call-1", Verdict::Deny, Some("not today")),
    ]);
    let answered = store
        .answer_approval(&approval.id, answer.clone(), "a human", T0 + 3)
        .await
        .unwrap();
    assert!(answered.resumed && !answered.repeated);
    assert_attributed(&answered.events);
    assert_eq!(
        kinds(&answered.events),
        ["approval.decided", "run.status"],
        "the answer and the run's return to running"
    );
    assert_eq!(
        answered.events[0].payload["by"], "a human",
        "the answer says who gave it"
    );
    let state = load(store, &run).await;
    assert_eq!(
        (state.status, state.pending_human.clone()),
        (RunStatus::Running, None)
    );
    let checkpoint = state.checkpoint.clone().expect("the batch is kept");
    assert!(checkpoint.approved);
    let denied = checkpoint.calls[0]
        .outcome
        .clone()
        .expect("a denied call is answered");
    assert!(
        denied.is_error && denied.content.contains("denied by a human: not today"),
        "{denied:?}"
    );
    assert_eq!(
        checkpoint.calls[1].outcome, None,
        "an approved call is still to run"
    );
    let tools = claim(store, OWNER_B, T0 + 4).await;
    assert_eq!(
        (&tools.job.run_id, tools.job.step_index, tools.job.phase),
        (&run, 2, Phase::HumanDecided)
    );

    let reordered = decisions(&[
        ("call-1", Verdict::Deny, Some("not today")),
        ("call-2", Verdict::Approve, None),
    ]);
    let again = store
        .answer_approval(&approval.id, reordered, "a human", T0 + 5)
        .await
        .unwrap();
    assert!(
        again.repeated && !again.resumed && again.events.is_empty(),
        "the same answer again changes nothing"
    );
    let different = decisions(&[
        ("call-1", Verdict::Approve, None),
        ("call-2", Verdict::Approve, None),
    ]);
    match store
        .answer_approval(&approval.id, different, "a human", T0 + 6)
        .await
    {
        Err(Error::Conflict(message)) => {
            assert!(message.contains("already answered"), "{message}")
        }
        other => {
            panic!("a different answer to a decided approval: expected Conflict, got {other:?}")
        }
    }
    let decided = store.get_approval(&approval.id).await.unwrap();
    assert_eq!(decided.status, ApprovalStatus::Decided);
    assert_eq!(decided.answer, Some(answer.normalized()));
    assert_eq!(decided.decided_at, Some(T0 + 3));
    let listed = store
        .approvals(DEFAULT_TENANT, Some(ApprovalStatus::Pending), None, 100)
        .await
        .unwrap();
    assert!(
        listed.iter().all(|a| a.id != approval.id),
        "no longer pending"
    );
    match store
        .get_approval(&ratchet_core::approval::approval_id(&run, 99))
        .await
    {
        Err(Error::NotFound {
            kind: "approval", ..
        }) => {}
        other => panic!("an unknown approval: expected NotFound, got {other:?}"),
    }
}

/// Abort ends a gated run as cancelled and starts the session's next run; an approval whose
/// run was cancelled reads as cancelled and can no longer be answered.
pub async fn an_aborted_or_cancelled_approval_ends_its_run_and_frees_the_session(
    store: &dyn Store,
) {
    let session = new_session(store).await;
    let (run, approval) = gated_run(store, &session, T0).await;
    let (next, _) = submit(store, &session, "after", config(), T0 + 2).await;
    let aborted = store
        .answer_approval(&approval.id, ApprovalAnswer::Abort, "a human", T0 + 3)
        .await
        .unwrap();
    assert!(aborted.enqueued && !aborted.resumed);
    assert_attributed(&aborted.events);
    let state = load(store, &run).await;
    assert_eq!(
        (state.status, state.stop_reason, state.pending_human),
        (RunStatus::Cancelled, Some(StopReason::Cancelled), None)
    );
    assert_eq!(load(store, &next).await.status, RunStatus::Running);
    assert_one_active(store, &session).await;
    assert_eq!(
        store.get_approval(&approval.id).await.unwrap().status,
        ApprovalStatus::Aborted
    );
    let repeat = store
        .answer_approval(&approval.id, ApprovalAnswer::Abort, "a human", T0 + 4)
        .await
        .unwrap();
    assert!(repeat.repeated, "aborting twice is the same answer");

    let other = new_session(store).await;
    let (run, approval) = gated_run(store, &other, T0 + 10).await;
    match store.request_cancel(&run, T0 + 12).await.unwrap() {
        CancelOutcome::Cancelled { .. } => {}
        outcome => panic!("cancel of a run waiting for approval: got {outcome:?}"),
    }
    assert_eq!(
        store.get_approval(&approval.id).await.unwrap().status,
        ApprovalStatus::Cancelled
    );
    let cancelled = store
        .approvals(DEFAULT_TENANT, Some(ApprovalStatus::Cancelled), None, 100)
        .await
        .unwrap();
    assert!(cancelled.iter().any(|a| a.id == approval.id));
    let answer = decisions(&[("call-1", Verdict::Approve, None)]);
    match store
        .answer_approval(&approval.id, answer, "a human", T0 + 13)
        .await
    {
        Err(Error::Conflict(message)) => assert!(message.contains("not waiting"), "{message}"),
        other => panic!("answering a cancelled run's approval: expected Conflict, got {other:?}"),
    }
    let page = store
        .approvals(DEFAULT_TENANT, None, None, 1)
        .await
        .unwrap();
    assert_eq!(page.len(), 1, "limit");
    let rest = store
        .approvals(DEFAULT_TENANT, None, Some(&page[0].id), 100)
        .await
        .unwrap();
    assert!(
        rest.iter().all(|a| a.id != page[0].id),
        "the page after a cursor starts after it"
    );
}

/// A failed run goes on only as its session's active run: refused while another run holds
/// the session, accepted once it is free, with the next job enqueued after the failed step.
pub async fn a_failed_run_is_retried_or_continued_once_its_session_is_free(store: &dyn Store) {
    let session = new_session(store).await;
    let (run, _) = submit(store, &session, "flaky", config(), T0).await;
    let (next, _) = submit(store, &session, "queued behind", config(), T0 + 1).await;
    let first = claim(store, OWNER_A, T0 + 2).await;
    let failed = finish_step(
        first.state,
        &first.job,
        StopReason::LlmError,
        T0 + 2,
        T0 + 3,
    );
    commit(store, &first.claim, failed, None, T0 + 3).await;
    assert_eq!(load(store, &run).await.status, RunStatus::Failed);
    assert_eq!(
        load(store, &next).await.status,
        RunStatus::Running,
        "the session moved on"
    );

    let before = snapshot(store, &run, &session).await;
    match store
        .resume_failed(&run, Resumption::Retry, None, T0 + 4)
        .await
    {
        Err(Error::Conflict(message)) => {
            assert!(message.contains("another active run"), "{message}")
        }
        other => panic!("retry while the session is busy: expected Conflict, got {other:?}"),
    }
    assert_eq!(
        snapshot(store, &run, &session).await,
        before,
        "nothing written"
    );

    let busy = claim(store, OWNER_A, T0 + 5).await;
    assert_eq!(busy.job.run_id, next);
    let done = after_model(
        busy.state,
        &busy.job,
        text_reply("done"),
        false,
        T0 + 5,
        T0 + 6,
    );
    commit(store, &busy.claim, done, None, T0 + 6).await;

    let extension = BudgetExtension {
        steps: 1,
        ..BudgetExtension::default()
    };
    match store
        .resume_failed(&next, Resumption::Continue { extension }, None, T0 + 7)
        .await
    {
        Err(Error::Conflict(message)) => {
            assert!(message.contains("only a failed run"), "{message}")
        }
        other => panic!("continue of a completed run: expected Conflict, got {other:?}"),
    }
    let events = store
        .resume_failed(&run, Resumption::Retry, None, T0 + 8)
        .await
        .unwrap();
    assert_attributed(&events);
    assert_eq!(kinds(&events), ["run.resumed", "run.status"]);
    let state = load(store, &run).await;
    assert_eq!(
        (state.status, state.stop_reason, state.finished_at),
        (RunStatus::Running, None, None)
    );
    assert_eq!(
        store.get_session(&session).await.unwrap().active_run_id,
        Some(run.clone())
    );
    assert_one_active(store, &session).await;
    let again = claim(store, OWNER_B, T0 + 9).await;
    assert_eq!(
        again.job,
        StepJob {
            run_id: run.clone(),
            step_index: 2,
            phase: Phase::Resumed,
            attempt: 1
        }
    );
    match store
        .resume_failed(&run, Resumption::Retry, None, T0 + 10)
        .await
    {
        Err(Error::Conflict(_)) => {}
        other => panic!("retry of a running run: expected Conflict, got {other:?}"),
    }
}

async fn submit_as(
    store: &dyn Store,
    session: &SessionId,
    content: &str,
    when_busy: WhenBusy,
    now: Millis,
) -> (RunId, Submitted) {
    let run_id = RunId::from_suffix(&unique()).unwrap();
    let new = NewRun {
        session_id: session.clone(),
        run_id: run_id.clone(),
        message_id: MessageId::from_suffix(&unique()).unwrap(),
        content: content.into(),
        config: config(),
        when_busy,
        quota: Default::default(),
        trace: None,
        request: None,
    };
    let submitted = store
        .submit_message(new, now)
        .await
        .unwrap_or_else(|e| panic!("submit_message {content:?}: {e}"));
    assert_attributed(&submitted.events);
    (run_id, submitted)
}

fn roles_and_contents(history: &[Message]) -> Vec<(Role, String)> {
    history
        .iter()
        .map(|m| (m.role, m.content.clone()))
        .collect()
}

/// A steering message never lands between a tool call and its result: it joins the active
/// run's history at the commit before its next model call. If the run ends first, the
/// message becomes the next run, ahead of messages queued after it.
pub async fn a_steer_joins_the_active_run_before_its_next_model_call_or_runs_next(
    store: &dyn Store,
) {
    let session = new_session(store).await;
    let (first, _) = submit(store, &session, "start", config(), T0).await;
    let model = claim(store, OWNER_A, T0 + 1).await;
    let asked = after_model(model.state, &model.job, tool_reply(), false, T0 + 1, T0 + 2);
    commit(store, &model.claim, asked, None, T0 + 2).await;

    let (unused, steered) = submit_as(store, &session, "also this", WhenBusy::Steer, T0 + 3).await;
    assert_eq!(steered.steered_into, Some(first.clone()));
    assert_eq!(
        steered.status,
        RunStatus::Running,
        "the active run's status"
    );
    assert!(steered.events.is_empty());
    assert!(
        store.load_state(&unused).await.is_err(),
        "a steer that joins creates no run"
    );
    assert_eq!(
        user_messages(store, &session).await,
        ["start"],
        "not before the boundary"
    );

    let tools = claim(store, OWNER_A, T0 + 4).await;
    let ran = after_tools(
        tools.state,
        &tools.job,
        vec![ToolOutcome::ok("42")],
        0,
        T0 + 4,
        T0 + 5,
    );
    let (events, _, _) = commit(store, &tools.claim, ran, None, T0 + 5).await;
    assert!(
        kinds(&events).contains(&"message.steered"),
        "{:?}",
        kinds(&events)
    );
    let history = store.history(&session).await.unwrap();
    let shape: Vec<Role> = history.iter().map(|m| m.role).collect();
    assert_eq!(
        shape,
        [Role::User, Role::Assistant, Role::Tool, Role::User],
        "after the tool result, before the next model call"
    );
    assert_eq!(history[3].content, "also this");

    // A steer the run never reaches (it ends first) becomes the next run, before a message
    // queued after it.
    let (fallback, steered) =
        submit_as(store, &session, "late steer", WhenBusy::Steer, T0 + 6).await;
    assert_eq!(steered.steered_into, Some(first.clone()));
    let (queued, _) = submit_as(store, &session, "queued after", WhenBusy::Enqueue, T0 + 7).await;
    let answer = claim(store, OWNER_A, T0 + 8).await;
    let done = after_model(
        answer.state,
        &answer.job,
        text_reply("done"),
        false,
        T0 + 8,
        T0 + 9,
    );
    let (events, _, enqueued) = commit(store, &answer.claim, done, None, T0 + 9).await;
    assert!(enqueued);
    assert!(
        !kinds(&events).contains(&"message.steered"),
        "a finishing step is no boundary"
    );
    assert_eq!(load(store, &first).await.status, RunStatus::Completed);
    assert_eq!(
        load(store, &fallback).await.status,
        RunStatus::Running,
        "the steer runs next"
    );
    assert_eq!(load(store, &queued).await.status, RunStatus::Queued);
    assert_one_active(store, &session).await;
    let history = roles_and_contents(&store.history(&session).await.unwrap());
    let users: Vec<&str> = history
        .iter()
        .filter(|(role, _)| *role == Role::User)
        .map(|(_, content)| content.as_str())
        .collect();
    assert_eq!(
        users,
        ["start", "also this", "late steer"],
        "each message once"
    );
    let runs = store.session_runs(&session, None, 10).await.unwrap();
    assert_eq!(
        runs.len(),
        3,
        "start, the fallen-through steer, the queued message"
    );

    // With no active run, a steer simply starts a run.
    let idle = new_session(store).await;
    let (run, started) = submit_as(store, &idle, "hello", WhenBusy::Steer, T0 + 10).await;
    assert_eq!(
        (started.status, started.steered_into),
        (RunStatus::Running, None)
    );
    assert_eq!(load(store, &run).await.status, RunStatus::Running);
}

// ---------------------------------------------------------------------------------------
// Message search

/// One completed exchange in `session`: the user's message, then the model's answer (and
/// `extra` messages committed with it); the run ends in that one step.
async fn exchange(
    store: &dyn Store,
    session: &SessionId,
    user: &str,
    answer: &str,
    extra: Vec<Message>,
    now: Millis,
) -> RunId {
    let (run, _) = submit(store, session, user, config(), now).await;
    let claimed = store
        .claim_next(lease(OWNER_A, now + LEASE_MS), Some(&run), now)
        .await
        .unwrap_or_else(|e| panic!("claim_next of {run}: {e}"))
        .unwrap_or_else(|| panic!("run {run} did not start: its session is busy"));
    let mut result = after_model(
        claimed.state,
        &claimed.job,
        text_reply(answer),
        false,
        now,
        now + 1,
    );
    result.messages.extend(extra);
    commit(store, &claimed.claim, result, None, now + 1).await;
    assert!(
        load(store, &run).await.status.is_terminal(),
        "precondition: an answer without tool calls ends run {run}"
    );
    run
}

async fn search(store: &dyn Store, scope: SearchScope, query: &str, limit: u32) -> Vec<MessageHit> {
    store
        .search_messages(scope.clone(), query, limit)
        .await
        .unwrap_or_else(|e| panic!("search_messages({scope:?}, {query:?}, {limit}): {e}"))
}

fn snippets(hits: &[MessageHit]) -> Vec<&str> {
    hits.iter().map(|h| h.snippet.as_str()).collect()
}

/// A word of an earlier run's user message and of its answer is found, with where each hit
/// lies; hidden messages and tool results are never searched.
pub async fn search_finds_earlier_user_and_assistant_messages(store: &dyn Store) {
    let session = new_session(store).await;
    let hidden = Message {
        visibility: Visibility::Hidden,
        ..Message::user("a hidden quokka trigger")
    };
    let tool = Message::tool_result("call-1", &ToolOutcome::ok("quokka facts from a tool"));
    let first = exchange(
        store,
        &session,
        "my favourite animal is the quokka",
        "Noted: the quokka, a small marsupial.",
        vec![hidden, tool],
        T0,
    )
    .await;
    let second = exchange(
        store,
        &session,
        "and my second?",
        "Tell me.",
        vec![],
        T0 + 10,
    )
    .await;

    let hits = search(store, SearchScope::Session(session.clone()), "quokka", 10).await;
    let mut found: Vec<(Role, &str)> = hits.iter().map(|h| (h.role, h.snippet.as_str())).collect();
    found.sort_by_key(|(role, _)| *role == Role::Assistant);
    assert_eq!(
        found,
        [
            (Role::User, "my favourite animal is the **quokka**"),
            (Role::Assistant, "Noted: the **quokka**, a small marsupial."),
        ],
        "the user's and the assistant's message are found, with the matched word marked; \
         hidden messages and tool results are not searched"
    );
    let visible = store.visible_messages(&session, 0, 100).await.unwrap();
    for hit in &hits {
        assert_eq!(hit.session_id, session);
        assert_eq!(hit.run_id, first, "{hit:?} belongs to the first run");
        let stored = visible
            .iter()
            .find(|m| m.id == hit.message_id)
            .unwrap_or_else(|| panic!("{hit:?} names no visible message of the session"));
        assert_eq!(
            (hit.position, hit.created_at, hit.role),
            (stored.position, stored.created_at, stored.message.role),
            "a hit tells where its message lies"
        );
    }
    let later = search(store, SearchScope::Session(session.clone()), "second", 10).await;
    assert_eq!(snippets(&later), ["and my **second**?"]);
    assert_eq!(later[0].run_id, second);
    assert!(
        search(store, SearchScope::Session(session.clone()), "hidden", 10)
            .await
            .is_empty(),
        "a hidden message is never found"
    );
    assert!(
        search(store, SearchScope::Session(session), "tool", 10)
            .await
            .is_empty(),
        "a tool result is never found"
    );
}

/// A session-scoped search sees its own session only, even within one tenant.
pub async fn search_in_a_session_never_sees_another_session(store: &dyn Store) {
    let mine = new_session(store).await;
    let theirs = new_session(store).await;
    let my_run = exchange(
        store,
        &mine,
        "the wombat digs",
        "A wombat indeed.",
        vec![],
        T0,
    )
    .await;
    exchange(
        store,
        &theirs,
        "their wombat sleeps",
        "Their wombat.",
        vec![],
        T0 + 10,
    )
    .await;

    let hits = search(store, SearchScope::Session(mine.clone()), "wombat", 10).await;
    assert_eq!(hits.len(), 2, "{hits:?}");
    assert!(
        hits.iter()
            .all(|h| h.session_id == mine && h.run_id == my_run),
        "another session's messages leaked into a session search: {hits:?}"
    );
    assert!(
        search(store, SearchScope::Session(mine), "sleeps", 10)
            .await
            .is_empty(),
        "a word only another session used is not found"
    );
}

/// A tenant-scoped search sees every session of its tenant and nothing of another tenant.
pub async fn search_in_a_tenant_never_sees_another_tenant(store: &dyn Store) {
    let (tenant, other) = (unique(), unique());
    let mut sessions = Vec::new();
    for owner in [&tenant, &tenant, &other] {
        let id = SessionId::from_suffix(&unique()).unwrap();
        let spec = SessionSpec {
            tenant: owner.clone(),
            ..SessionSpec::default()
        };
        store.create_session(&id, spec, T0).await.unwrap();
        sessions.push(id);
    }
    for (i, session) in sessions.iter().enumerate() {
        let user = format!("platypus number {i}");
        exchange(store, session, &user, "ok", vec![], T0 + 10 * i as Millis).await;
    }

    let hits = search(store, SearchScope::Tenant(tenant.clone()), "platypus", 10).await;
    let mut seen: Vec<&SessionId> = hits.iter().map(|h| &h.session_id).collect();
    seen.sort();
    let mut expected = vec![&sessions[0], &sessions[1]];
    expected.sort();
    assert_eq!(
        seen, expected,
        "a tenant search finds every session of the tenant, and only those"
    );
    let hits = search(store, SearchScope::Tenant(other), "platypus", 10).await;
    assert_eq!(snippets(&hits), ["**platypus** number 2"]);
    assert_eq!(hits[0].session_id, sessions[2]);
    assert!(
        search(store, SearchScope::Tenant(unique()), "platypus", 10)
            .await
            .is_empty(),
        "a tenant without sessions finds nothing"
    );
}

/// Hits come best first, a message matching more (and rarer) words before one matching
/// fewer, a message matching any word is found, and `limit` is respected.
pub async fn search_ranks_better_matches_first_and_respects_the_limit(store: &dyn Store) {
    let session = new_session(store).await;
    let texts = [
        "the quokka ate bread today",
        "the cat ate fish today",
        "the quokka ate marzipan today",
        "the dog ate meat today",
    ];
    for (i, text) in texts.iter().enumerate() {
        exchange(store, &session, text, "ok", vec![], T0 + 10 * i as Millis).await;
    }
    let scope = SearchScope::Session(session);

    let hits = search(store, scope.clone(), "marzipan quokka", 10).await;
    assert_eq!(
        snippets(&hits),
        [
            "the **quokka** ate **marzipan** today",
            "the **quokka** ate bread today"
        ],
        "the message matching both words ranks first; one matching any word is found"
    );
    assert!(
        hits[0].rank < hits[1].rank,
        "ranks are ordered, lower is better: {hits:?}"
    );
    let best = search(store, scope.clone(), "marzipan quokka", 1).await;
    assert_eq!(best, hits[..1], "a limit keeps the best hits");

    assert_eq!(search(store, scope.clone(), "today", 10).await.len(), 4);
    assert_eq!(search(store, scope.clone(), "today", 3).await.len(), 3);
    assert!(search(store, scope, "today", 0).await.is_empty());
}

/// Query text is words, never syntax: quotes, `*`, `NEAR(`, `-`, `:` and operators are
/// searched as text and never fail; a query without a word is `Error::Invalid`.
pub async fn search_reads_query_syntax_as_plain_words(store: &dyn Store) {
    let session = new_session(store).await;
    let text = r#"he said "halt" -- NEAR(the door): see *notes*"#;
    exchange(store, &session, text, "ok", vec![], T0).await;
    let scope = SearchScope::Session(session);

    for query in [
        r#"""#,
        r#""""#,
        "*",
        "NEAR(",
        "NEAR(the door, 2)",
        "-",
        "--",
        ":",
        "content:door",
        "AND",
        "OR NOT",
        "(",
        ")",
        "^door",
        "{content}",
        "door +",
        "'",
    ] {
        if let Err(e) = store.search_messages(scope.clone(), query, 10).await {
            panic!("query {query:?} must not fail: {e}");
        }
    }
    for query in [
        r#""halt"#,
        "door:",
        "*notes*",
        "NEAR(the",
        r#"halt" OR "x"#,
        "halt\u{0}\"",
    ] {
        let hits = search(store, scope.clone(), query, 10).await;
        assert_eq!(hits.len(), 1, "query {query:?} finds the message: {hits:?}");
    }
    for query in ["", "   ", "\n\t", "\u{0}"] {
        match store.search_messages(scope.clone(), query, 10).await {
            Err(Error::Invalid(_)) => {}
            other => panic!("query {query:?}: expected Error::Invalid, got {other:?}"),
        }
    }
}

/// The context is the history with the latest summary standing in for the messages before
/// the first one it keeps; earlier summaries disappear with what they replaced. Clients'
/// history and visible messages are unchanged.
pub async fn the_model_sees_the_latest_summary_in_place_of_what_it_replaces(store: &dyn Store) {
    let session = new_session(store).await;
    let (run, _) = submit(store, &session, "one", config(), T0).await;
    let context = store.context(&session, &run).await.unwrap();
    assert_eq!(context.len(), 1);
    assert_eq!(context[0].message.content, "one");
    assert_eq!(context[0].run_id, run);

    let step = claim(store, OWNER_A, T0 + 1).await;
    let mut asked = after_model(step.state, &step.job, tool_reply(), false, T0 + 1, T0 + 2);
    asked.messages.push(Message::user("two"));
    asked.messages.push(Message::user("three"));
    commit(store, &step.claim, asked, None, T0 + 2).await;
    let full = store.context(&session, &run).await.unwrap();
    let texts = |messages: &[ratchet_store::StoredMessage]| -> Vec<String> {
        messages.iter().map(|m| m.message.content.clone()).collect()
    };
    assert_eq!(texts(&full), ["one", "let me look", "two", "three"]);
    let positions: Vec<i64> = full.iter().map(|m| m.position).collect();
    assert!(positions.windows(2).all(|w| w[0] < w[1]), "{positions:?}");

    // A summary keeping "two" on.
    let step = claim(store, OWNER_A, T0 + 3).await;
    let mut ran = after_tools(
        step.state,
        &step.job,
        vec![ToolOutcome::error("4")],
        0,
        T0 + 3,
        T0 + 4,
    );
    ran.messages
        .push(Message::summary("one and a look", full[2].position));
    commit(store, &step.claim, ran, None, T0 + 4).await;
    let context = store.context(&session, &run).await.unwrap();
    assert_eq!(
        texts(&context),
        [
            "Summary of the earlier conversation:\none and a look",
            "two",
            "three",
            "4"
        ],
        "the summary first, then what it keeps, then what came after"
    );
    assert_eq!(context[0].message.origin, ratchet_core::Origin::Summary);
    assert!(
        context[3].message.is_error,
        "a failed call's result keeps saying so"
    );

    // A later summary replaces the first one and everything before its own cut.
    let step = claim(store, OWNER_A, T0 + 5).await;
    let mut answered = after_model(
        step.state,
        &step.job,
        text_reply("five"),
        false,
        T0 + 5,
        T0 + 6,
    );
    answered
        .messages
        .push(Message::summary("up to three", context[3].position));
    commit(store, &step.claim, answered, None, T0 + 6).await;
    let context = store.context(&session, &run).await.unwrap();
    assert_eq!(
        texts(&context),
        [
            "Summary of the earlier conversation:\nup to three",
            "4",
            "five"
        ]
    );
    let history = store.history(&session).await.unwrap();
    assert_eq!(
        history.len(),
        8,
        "history keeps every message, summaries included"
    );
    let visible = store.visible_messages(&session, 0, 100).await.unwrap();
    assert!(
        visible
            .iter()
            .all(|m| m.message.origin != ratchet_core::Origin::Summary),
        "summaries are hidden from clients"
    );
}

pub async fn a_steps_context_is_what_the_model_was_shown_at_that_step(store: &dyn Store) {
    let texts = |messages: Vec<ratchet_store::StoredMessage>| -> Vec<String> {
        messages.into_iter().map(|m| m.message.content).collect()
    };
    let shown = async |run: &RunId, step: u64| -> Vec<String> {
        texts(store.step_messages(run, step).await.unwrap().context)
    };
    let session = new_session(store).await;
    let earlier = exchange(store, &session, "hello", "hi", Vec::new(), T0).await;
    let (run, _) = submit(store, &session, "one", config(), T0 + 10).await;

    let step = claim(store, OWNER_A, T0 + 11).await;
    let mut asked = after_model(step.state, &step.job, tool_reply(), false, T0 + 11, T0 + 12);
    asked.messages.push(Message::user("two"));
    commit(store, &step.claim, asked, None, T0 + 12).await;
    let before_summary = store.context(&session, &run).await.unwrap();

    let step = claim(store, OWNER_A, T0 + 13).await;
    let mut ran = after_tools(
        step.state,
        &step.job,
        vec![ToolOutcome::error("4")],
        0,
        T0 + 13,
        T0 + 14,
    );
    ran.messages
        .push(Message::summary("so far", before_summary[4].position));
    commit(store, &step.claim, ran, None, T0 + 14).await;

    let step = claim(store, OWNER_A, T0 + 15).await;
    let answered = after_model(
        step.state,
        &step.job,
        text_reply("five"),
        false,
        T0 + 15,
        T0 + 16,
    );
    commit(store, &step.claim, answered, None, T0 + 16).await;
    exchange(store, &session, "later", "much later", Vec::new(), T0 + 20).await;

    assert_eq!(
        shown(&run, 1).await,
        ["hello", "hi", "one"],
        "the first step saw the session's earlier turns and the run's message"
    );
    assert_eq!(
        shown(&run, 2).await,
        ["hello", "hi", "one", "let me look", "two"],
        "the second step saw what the first one added, not what it added itself"
    );
    assert_eq!(
        shown(&run, 3).await,
        ["Summary of the earlier conversation:\nso far", "two", "4"],
        "a summary written before the step stands in for what it replaced"
    );
    assert_eq!(
        shown(&run, 4).await,
        [
            "Summary of the earlier conversation:\nso far",
            "two",
            "4",
            "five"
        ],
        "a step past the run's last writes sees the run's last message, not a later run's"
    );
    assert_eq!(
        shown(&earlier, 1).await,
        ["hello"],
        "an earlier run's step never sees what came after it"
    );
    let expected_writes: [(u64, &[&str], &str); 4] = [
        (
            1,
            &["let me look", "two"],
            "a model call's reply, and what its commit added",
        ),
        (
            2,
            &["4", "Summary of the earlier conversation:\nso far"],
            "a batch's results and the summary it wrote",
        ),
        (3, &["five"], "the answer"),
        (4, &[], "a step not taken wrote nothing"),
    ];
    for (step, expected, why) in expected_writes {
        let written = texts(store.step_messages(&run, step).await.unwrap().written);
        assert_eq!(written, expected, "step {step}: {why}");
    }
    let unknown = RunId::from_suffix(&unique()).unwrap();
    assert!(
        matches!(
            store.step_messages(&unknown, 1).await,
            Err(Error::NotFound { .. })
        ),
        "a run that does not exist is not found"
    );
}
