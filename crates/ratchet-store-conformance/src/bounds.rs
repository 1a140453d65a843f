//! Conformance of the steering lanes' caps: a steer past its lane's count or bytes is refused
//! in the transaction that would have queued it, and nothing is written; the lane has room
//! again once the run's next model call has taken what waited.

use ratchet_core::bounds::{LaneLimit, SteerLimits};
use ratchet_core::inbox::{Severity, SignalContract};
use ratchet_core::step::{after_model, after_tools};
use ratchet_core::{
    CompletionPolicy, Delivery, InboxKind, InboxPolicy, MessageId, RunConfigSnapshot, RunId,
    SessionId, ToolOutcome,
};
use serde_json::json;

use super::delegation::claim_run;
use super::inbox::{background_signalling, claim_own, inbox, inbox_config};
use super::{T0, commit, config, new_session, submit, tool_reply, unique};
use ratchet_store::{Error, NewRun, NewSignal, SignalOutcome, Store, Submitted, WhenBusy};

fn steer_limits(user: LaneLimit, agent: LaneLimit) -> SteerLimits {
    SteerLimits { user, agent }
}

async fn steer(
    store: &dyn Store,
    session: &SessionId,
    content: &str,
    now: i64,
) -> ratchet_store::Result<Submitted> {
    store
        .submit_message(
            NewRun {
                session_id: session.clone(),
                run_id: RunId::from_suffix(&unique()).unwrap(),
                message_id: MessageId::from_suffix(&unique()).unwrap(),
                content: content.into(),
                config: config(),
                when_busy: WhenBusy::Steer,
                quota: Default::default(),
                trace: None,
                request: None,
            },
            now,
        )
        .await
}

async fn waiting_steers(store: &dyn Store, session: &SessionId) -> u64 {
    store.pending_input(session, i64::MAX).await.unwrap().steers
}

/// Takes `run` through a tools round trip: the commit before its next model call absorbs
/// what waits in both lanes.
async fn reach_the_next_model_call(store: &dyn Store, run: &RunId, now: i64) {
    let model = claim_run(store, run, now).await;
    let asked = after_model(model.state, &model.job, tool_reply(), false, now, now + 1);
    commit(store, &model.claim, asked, None, now + 1).await;
    let tools = claim_run(store, run, now + 2).await;
    let ran = after_tools(
        tools.state,
        &tools.job,
        vec![ToolOutcome::ok("42")],
        0,
        now + 2,
        now + 3,
    );
    commit(store, &tools.claim, ran, None, now + 3).await;
}

pub async fn a_users_steers_past_the_lanes_count_or_bytes_are_refused_and_nothing_is_written(
    store: &dyn Store,
) {
    let session = new_session(store).await;
    let frozen = RunConfigSnapshot {
        steer: steer_limits(
            LaneLimit {
                max_messages: 2,
                max_bytes: 20,
            },
            SteerLimits::default().agent,
        ),
        ..config()
    };
    let (active, _) = submit(store, &session, "start", frozen, T0).await;
    steer(store, &session, "0123456789", T0 + 1).await.unwrap();
    let refused = |outcome: ratchet_store::Result<Submitted>, says: &str| match outcome {
        Err(Error::SteerQueueFull(message)) => {
            assert!(message.contains(says), "{message:?} should say {says:?}")
        }
        other => panic!("expected SteerQueueFull ({says}), got {other:?}"),
    };
    refused(
        steer(store, &session, "0123456789a", T0 + 2).await,
        "21 bytes, more than the 20 allowed",
    );
    assert_eq!(waiting_steers(store, &session).await, 1, "nothing written");
    steer(store, &session, "abc", T0 + 3).await.unwrap();
    refused(
        steer(store, &session, "d", T0 + 4).await,
        "2 steering messages from users already wait",
    );
    assert_eq!(waiting_steers(store, &session).await, 2);

    reach_the_next_model_call(store, &active, T0 + 10).await;
    assert_eq!(
        waiting_steers(store, &session).await,
        0,
        "the run took them"
    );
    steer(store, &session, "d", T0 + 20)
        .await
        .expect("the lane has room again");
    let history: Vec<String> = (store.history(&session).await.unwrap().into_iter())
        .map(|m| m.content)
        .collect();
    assert!(history.contains(&"abc".to_owned()), "{history:?}");
    assert!(!history.contains(&"0123456789a".to_owned()), "{history:?}");
}

pub async fn a_background_runs_steered_signals_past_the_agent_lane_are_refused(store: &dyn Store) {
    let session = new_session(store).await;
    let mut frozen = inbox_config(InboxPolicy::default());
    frozen.steer = steer_limits(
        SteerLimits::default().user,
        LaneLimit {
            max_messages: 2,
            max_bytes: 40,
        },
    );
    let (parent, _) = submit(store, &session, "start work", frozen, T0).await;
    let contract = SignalContract {
        max_count: 10,
        min_interval_ms: 0,
        max_bytes: 1_000,
        severities: vec![Severity::Info],
        dedupe_window_ms: 0,
        delivery: Delivery::Steer,
        max_burst: 1,
        max_depth: 8,
    };
    let children = background_signalling(
        store,
        &parent,
        1,
        CompletionPolicy::Each,
        Some(contract),
        T0 + 10,
    )
    .await
    .unwrap();
    let child = claim_run(store, &children[0], T0 + 20).await;
    let emit = |call: &'static str, summary: &'static str| {
        let signal = NewSignal {
            call_key: format!("{}#{call}", child.claim.run_id),
            dedupe_key: call.to_owned(),
            payload: json!({"summary": summary}),
        };
        let claim = child.claim.clone();
        async move {
            store
                .emit_signal(&claim, signal, T0 + 21)
                .await
                .unwrap()
                .outcome
        }
    };
    // {"summary":"first"} is 19 bytes.
    assert!(matches!(emit("c1", "first").await, SignalOutcome::Sent(_)));
    let too_big = emit("c2", "a much longer summary").await;
    assert!(
        matches!(&too_big, SignalOutcome::Refused(m) if m.contains("more than the 40 allowed")),
        "{too_big:?}"
    );
    assert!(matches!(emit("c3", "third").await, SignalOutcome::Sent(_)));
    let too_many = emit("c4", "x").await;
    assert!(
        matches!(&too_many, SignalOutcome::Refused(m) if m.contains("2 steered signals from background runs already wait")),
        "{too_many:?}"
    );
    let signals = (inbox(store, &session).await.into_iter())
        .filter(|e| e.kind == InboxKind::Signal)
        .count();
    assert_eq!(signals, 2, "a refused signal writes nothing");

    let model = claim_own(store, &parent, T0 + 30).await;
    let asked = after_model(
        model.state,
        &model.job,
        tool_reply(),
        false,
        T0 + 30,
        T0 + 31,
    );
    commit(store, &model.claim, asked, None, T0 + 31).await;
    let tools = claim_own(store, &parent, T0 + 32).await;
    let ran = after_tools(
        tools.state,
        &tools.job,
        vec![ToolOutcome::ok("42")],
        0,
        T0 + 32,
        T0 + 33,
    );
    commit(store, &tools.claim, ran, None, T0 + 33).await;
    assert!(
        matches!(emit("c5", "again").await, SignalOutcome::Sent(_)),
        "the parent's model call took what waited: the lane has room again"
    );
}
