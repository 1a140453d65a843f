//! Effects whose outcome nobody knows, end to end on real SQLite files: a tool that answers
//! *unknown* under each replay policy, a tool that hangs past its timeout, a tool that
//! ignores its cancellation, and a run whose deadline passes while a call is in flight or
//! while it waits for a human.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use ratchet_core::step::Reconciliation;
use ratchet_core::{
    CallLimits, HumanRequest, Limits, MemoryScope, ReplayPolicy, RunConfigSnapshot, RunId,
    RunStatus, StopReason, ToolOutcome,
};
use ratchet_engine::{Coordinator, Engine, Models, Multitask, PoolConfig, WorkerPool};
use ratchet_store::{SessionSpec, Store};
use ratchet_tools::{Registry, Tool, ToolContext};
use serde_json::{Value, json};

/// What a test tool does when called.
#[derive(Clone, Copy)]
enum Behaviour {
    /// Answers that nobody knows whether it took effect (a lost connection).
    Unknown,
    /// Never answers and never looks at its cancellation token.
    Hang,
    /// Answers at once that it was done.
    Done,
    /// Hangs as `Hang` on its first call, answers as `Done` on every later one.
    HangOnce,
}

/// A tool that records every call's idempotency key.
struct Probe {
    name: &'static str,
    replay: ReplayPolicy,
    behaviour: Behaviour,
    keys: Arc<Mutex<Vec<String>>>,
}

#[async_trait]
impl Tool for Probe {
    fn name(&self) -> &str {
        self.name
    }
    fn description(&self) -> &str {
        "A test tool."
    }
    fn parameters(&self) -> Value {
        json!({"type": "object"})
    }
    fn replay(&self) -> ReplayPolicy {
        self.replay
    }
    async fn call(&self, _: Value, context: &ToolContext) -> ToolOutcome {
        let first = {
            let mut keys = self.keys.lock().unwrap();
            keys.push(context.idempotency_key.clone());
            keys.iter()
                .filter(|k| **k == context.idempotency_key)
                .count()
                == 1
        };
        match self.behaviour {
            Behaviour::Unknown => ToolOutcome::unknown("the connection dropped mid-call"),
            Behaviour::Done => ToolOutcome::ok(format!("{} done", self.name)),
            Behaviour::HangOnce if !first => ToolOutcome::ok(format!("{} done", self.name)),
            Behaviour::Hang | Behaviour::HangOnce => {
                // Deaf to its token: only an abort stops it.
                tokio::time::sleep(Duration::from_secs(3600)).await;
                ToolOutcome::ok("too late")
            }
        }
    }
}

struct Node {
    coordinator: Arc<Coordinator>,
    store: Arc<dyn Store>,
    pool: WorkerPool,
    specs: Vec<ratchet_core::ToolSpec>,
    keys: Arc<Mutex<Vec<String>>>,
    _dir: tempfile::TempDir,
    script: std::path::PathBuf,
}

const GRACE: Duration = Duration::from_millis(300);

fn node(replies: Value) -> Node {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("script.json");
    std::fs::write(&script, json!({ "replies": replies }).to_string()).unwrap();
    let store: Arc<dyn Store> = Arc::new(ratchet_store_memory::MemoryStore::new());
    let keys = Arc::new(Mutex::new(Vec::new()));
    let mut tools = Registry::builtin_tools(1024);
    for (name, replay, behaviour) in [
        ("unknown_never", ReplayPolicy::Never, Behaviour::Unknown),
        ("unknown_keyed", ReplayPolicy::Keyed, Behaviour::Unknown),
        ("unknown_safe", ReplayPolicy::Safe, Behaviour::Unknown),
        ("hang_never", ReplayPolicy::Never, Behaviour::Hang),
        ("hang_safe", ReplayPolicy::Safe, Behaviour::Hang),
        ("done_never", ReplayPolicy::Never, Behaviour::Done),
        ("done_keyed", ReplayPolicy::Keyed, Behaviour::Done),
        ("hang_once_keyed", ReplayPolicy::Keyed, Behaviour::HangOnce),
    ] {
        tools.push(Arc::new(Probe {
            name,
            replay,
            behaviour,
            keys: Arc::clone(&keys),
        }));
    }
    let tools = Arc::new(Registry::new(tools).unwrap());
    let specs = tools.specs();
    // The scripted model may also call `vanished`, a tool a run can be frozen with but this
    // process does not have.
    let mut names: Vec<String> = tools.names();
    names.push("vanished".to_owned());
    let models = Arc::new(Models::new(names));
    let coordinator = Coordinator::new(Arc::clone(&store));
    let engine = Arc::new(Engine::new(Arc::clone(&coordinator), models, tools));
    let config = PoolConfig {
        workers: 2,
        poll: Duration::from_millis(20),
        cancel_grace: GRACE,
        ..PoolConfig::default()
    };
    let pool = WorkerPool::start(Arc::clone(&coordinator), engine, config);
    Node {
        coordinator,
        store,
        pool,
        specs,
        keys,
        _dir: dir,
        script,
    }
}

impl Node {
    /// The run configuration, with each named tool's call limits set.
    fn config(&self, limits: Limits, calls: &[(&str, CallLimits)]) -> RunConfigSnapshot {
        let mut tools = self.specs.clone();
        for (name, set) in calls {
            tools.iter_mut().find(|t| t.name == *name).unwrap().calls = *set;
        }
        RunConfigSnapshot {
            model: format!("scripted:{}", self.script.display()),
            tools,
            limits,
            memory_scope: MemoryScope::Session,
            ..RunConfigSnapshot::default()
        }
    }

    async fn start(&self, config: RunConfigSnapshot) -> RunId {
        let session = (self.coordinator.create_session(SessionSpec::default()))
            .await
            .unwrap()
            .id;
        (self
            .coordinator
            .submit(&session, "go".into(), config, Multitask::Enqueue))
        .await
        .unwrap()
        .run_id
    }

    /// Waits until the run has ended or waits for someone.
    async fn settle(&self, run: &RunId) -> ratchet_core::AgentState {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let state = self.coordinator.store().load_state(run).await.unwrap();
            if state.status.is_terminal() || state.status == RunStatus::WaitingHuman {
                return state;
            }
            assert!(
                Instant::now() < deadline,
                "run {run} stuck in {}",
                state.status
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn keys(&self) -> Vec<String> {
        self.keys.lock().unwrap().clone()
    }

    async fn tool_results(&self, run: &RunId) -> Vec<(String, bool)> {
        let state = self.coordinator.store().load_state(run).await.unwrap();
        let history = self
            .coordinator
            .store()
            .history(&state.session_id)
            .await
            .unwrap();
        history
            .into_iter()
            .filter(|m| m.role == ratchet_core::Role::Tool)
            .map(|m| (m.content, m.is_error))
            .collect()
    }
}

fn call(name: &str) -> Value {
    json!({"tool_calls": [{"name": name, "arguments": {}}]})
}

fn answer() -> Value {
    json!({"text": "done"})
}

fn in_doubt_tools(state: &ratchet_core::AgentState) -> Vec<&str> {
    state.in_doubt.iter().map(|c| c.tool.as_str()).collect()
}

fn reconciliation_tools(state: &ratchet_core::AgentState) -> Vec<String> {
    match &state.pending_human {
        Some(HumanRequest::Reconciliation { calls }) => {
            calls.iter().map(|c| c.tool.clone()).collect()
        }
        other => panic!("expected a reconciliation, found {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_of_a_never_tool_waits_for_a_human_and_the_model_is_not_asked_again() {
    let node = node(json!([call("unknown_never"), answer()]));
    let run = node.start(node.config(Limits::default(), &[])).await;
    let state = node.settle(&run).await;
    assert_eq!(state.status, RunStatus::WaitingHuman);
    assert_eq!(reconciliation_tools(&state), ["unknown_never"]);
    assert_eq!(node.keys().len(), 1, "a never call is tried once");
    assert_eq!(
        state.counters.model_calls, 1,
        "the model was not asked again"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let later = node.coordinator.store().load_state(&run).await.unwrap();
    assert_eq!(later.status, RunStatus::WaitingHuman, "it stays waiting");
    assert_eq!(later.counters.model_calls, 1);
    // The human says what happened; only then does the model read it.
    let call_id = state.checkpoint.as_ref().unwrap().calls[0].call.id.clone();
    node.coordinator
        .reconcile(
            &run,
            &call_id,
            Reconciliation::Succeeded,
            Some("paid".into()),
        )
        .await
        .unwrap();
    let done = node.settle(&run).await;
    assert_eq!(done.status, RunStatus::Completed);
    assert_eq!(node.keys().len(), 1, "reconciling did not run it again");
    assert_eq!(node.tool_results(&run).await, [("paid".to_owned(), false)]);
    node.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_call_with_an_unknown_outcome_is_retried_with_its_key_then_waits_for_a_human() {
    let node = node(json!([call("unknown_keyed"), answer()]));
    let limits = CallLimits {
        max_attempts: 3,
        ..CallLimits::default()
    };
    let run = node
        .start(node.config(Limits::default(), &[("unknown_keyed", limits)]))
        .await;
    let state = node.settle(&run).await;
    assert_eq!(state.status, RunStatus::WaitingHuman);
    assert_eq!(reconciliation_tools(&state), ["unknown_keyed"]);
    let keys = node.keys();
    assert_eq!(keys.len(), 3, "{keys:?}");
    assert!(
        keys.iter().all(|k| *k == keys[0]),
        "every attempt carries the same idempotency key: {keys:?}"
    );
    assert_eq!(state.counters.model_calls, 1);
    let events = node
        .coordinator
        .store()
        .events_after(&state.session_id, 0, 1000)
        .await
        .unwrap();
    let unknown: Vec<i64> = events
        .iter()
        .filter(|e| e.kind == "tool.outcome_unknown")
        .map(|e| e.payload["attempt"].as_i64().unwrap())
        .collect();
    assert_eq!(unknown, [1, 2, 3], "each unknown attempt is reported");
    node.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_safe_call_with_an_unknown_outcome_is_retried_then_the_model_reads_an_error() {
    let node = node(json!([call("unknown_safe"), answer()]));
    let limits = CallLimits {
        max_attempts: 2,
        ..CallLimits::default()
    };
    let run = node
        .start(node.config(Limits::default(), &[("unknown_safe", limits)]))
        .await;
    let state = node.settle(&run).await;
    assert_eq!(state.status, RunStatus::Completed);
    assert_eq!(node.keys().len(), 2);
    let results = node.tool_results(&run).await;
    assert_eq!(results.len(), 1);
    assert!(results[0].1, "an error result: {results:?}");
    assert!(
        results[0]
            .0
            .starts_with("the outcome stayed unknown after 2 attempt(s): the connection dropped"),
        "{results:?}"
    );
    node.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_timeout_is_cut_off_with_an_unknown_outcome() {
    let node = node(json!([call("hang_never"), answer()]));
    let limits = CallLimits {
        timeout_ms: 200,
        max_attempts: 3,
    };
    let run = node
        .start(node.config(Limits::default(), &[("hang_never", limits)]))
        .await;
    let state = node.settle(&run).await;
    assert_eq!(state.status, RunStatus::WaitingHuman);
    assert_eq!(reconciliation_tools(&state), ["hang_never"]);
    assert_eq!(node.keys().len(), 1);
    node.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_ends_the_run_within_the_grace_period_whatever_its_tool_does() {
    let node = node(json!([call("hang_never"), answer()]));
    let run = node.start(node.config(Limits::default(), &[])).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while node.keys().is_empty() {
        assert!(Instant::now() < deadline, "the tool never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let asked = Instant::now();
    node.coordinator.request_cancel(&run).await.unwrap();
    let state = node.settle(&run).await;
    let took = asked.elapsed();
    assert_eq!(state.status, RunStatus::Cancelled);
    assert!(
        took < GRACE + Duration::from_secs(1),
        "took {took:?} with a grace of {GRACE:?}"
    );
    assert_eq!(
        in_doubt_tools(&state),
        ["hang_never"],
        "the never call cut off is in doubt, not reported as not done"
    );
    node.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_cuts_off_the_step_in_flight_and_leaves_its_never_call_in_doubt() {
    let node = node(json!([
        {"tool_calls": [
            {"name": "hang_never", "arguments": {}},
            {"name": "hang_safe", "arguments": {}},
        ]},
        answer(),
    ]));
    let limits = Limits {
        max_duration_ms: Some(800),
        ..Limits::default()
    };
    let run = node.start(node.config(limits, &[])).await;
    let state = node.settle(&run).await;
    assert_eq!(state.status, RunStatus::Failed);
    assert_eq!(state.stop_reason, Some(StopReason::TimedOut));
    assert_eq!(in_doubt_tools(&state), ["hang_never"]);
    assert_eq!(state.counters.model_calls, 1);
    // A human records what happened; the run stays ended and nothing runs again.
    let call_id = state.in_doubt[0].call_id.clone();
    let refused = node
        .coordinator
        .reconcile(&run, &call_id, Reconciliation::Retry, None)
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("not run again"), "{refused}");
    node.coordinator
        .reconcile(&run, &call_id, Reconciliation::Failed, None)
        .await
        .unwrap();
    let after = node.coordinator.store().load_state(&run).await.unwrap();
    assert_eq!(after.status, RunStatus::Failed);
    assert!(after.in_doubt.is_empty());
    assert_eq!(node.keys().len(), 2);
    node.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_waiting_for_a_human_past_its_deadline_ends_timed_out() {
    let node = node(json!([call("unknown_never"), answer()]));
    let limits = Limits {
        max_duration_ms: Some(1_000),
        ..Limits::default()
    };
    let run = node.start(node.config(limits, &[])).await;
    let waiting = node.settle(&run).await;
    assert_eq!(waiting.status, RunStatus::WaitingHuman);
    let deadline = Instant::now() + Duration::from_secs(10);
    let ended = loop {
        let state = node.coordinator.store().load_state(&run).await.unwrap();
        if state.status.is_terminal() {
            break state;
        }
        assert!(Instant::now() < deadline, "still {}", state.status);
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(ended.stop_reason, Some(StopReason::TimedOut));
    assert_eq!(
        in_doubt_tools(&ended),
        ["unknown_never"],
        "the call it waited on stays in doubt"
    );
    assert!(ended.pending_human.is_none());
    assert_eq!(ended.counters.model_calls, 1);
    node.pool.shutdown().await;
}

/// A run frozen with tools this process now has differently (an upgrade, a reloaded MCP
/// server): a call of such a tool does not run before a human has looked at it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_of_a_tool_that_drifted_since_the_model_saw_it_waits_for_a_human() {
    let node = node(json!([
        {"tool_calls": [
            {"name": "add", "arguments": {"a": 1, "b": 2}},
            {"name": "vanished", "arguments": {}},
            {"name": "now", "arguments": {}},
        ]},
        answer(),
    ]));
    let mut config = node.config(Limits::default(), &[]);
    let add = config.tools.iter_mut().find(|t| t.name == "add").unwrap();
    add.parameters = json!({"type": "object", "properties": {"a": {"type": "string"}}});
    let mut vanished = config.tools[0].clone();
    vanished.name = "vanished".into();
    config.tools.push(vanished);
    let run = node.start(config).await;
    let state = node.settle(&run).await;
    assert_eq!(state.status, RunStatus::WaitingHuman);
    let Some(HumanRequest::Reconciliation { calls }) = &state.pending_human else {
        panic!("expected a reconciliation: {:?}", state.pending_human);
    };
    let drifted: Vec<(&str, &str)> = calls
        .iter()
        .map(|c| (c.tool.as_str(), c.drift.as_deref().unwrap_or("no drift")))
        .collect();
    assert_eq!(
        drifted,
        [
            (
                "add",
                "tool \"add\" takes other arguments now than when it was offered to the model"
            ),
            (
                "vanished",
                "tool \"vanished\" was offered to the model but this process does not have it"
            ),
        ]
    );
    let calls = calls.clone();
    // A human lets `add` run as this process has it, and skips the one that is gone.
    node.coordinator
        .reconcile(&run, &calls[0].call_id, Reconciliation::Retry, None)
        .await
        .unwrap();
    node.coordinator
        .reconcile(&run, &calls[1].call_id, Reconciliation::Skip, None)
        .await
        .unwrap();
    let done = node.settle(&run).await;
    assert_eq!(done.status, RunStatus::Completed);
    let results = node.tool_results(&run).await;
    assert_eq!(results[0], ("3".to_owned(), false));
    assert!(results[1].1, "{results:?}");
    assert!(
        !results[2].1,
        "an undrifted call of the batch ran: {results:?}"
    );
    node.pool.shutdown().await;
}

/// A batch that waits for a human goes on in a later step; a call run again there keeps the
/// idempotency key it was first sent under, so a server that deduplicates by key acts once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_run_again_after_a_wait_keeps_its_first_idempotency_key() {
    let node = node(json!([
        {"tool_calls": [
            {"name": "unknown_never", "arguments": {}},
            {"name": "unknown_keyed", "arguments": {}},
        ]},
        answer(),
    ]));
    let once = CallLimits {
        max_attempts: 1,
        ..CallLimits::default()
    };
    let run = node
        .start(node.config(Limits::default(), &[("unknown_keyed", once)]))
        .await;
    let waiting = node.settle(&run).await;
    assert_eq!(
        reconciliation_tools(&waiting),
        ["unknown_never", "unknown_keyed"]
    );
    let first_step = waiting.step_index;
    let calls = match &waiting.pending_human {
        Some(HumanRequest::Reconciliation { calls }) => calls.clone(),
        other => panic!("{other:?}"),
    };
    node.coordinator
        .reconcile(&run, &calls[0].call_id, Reconciliation::Failed, None)
        .await
        .unwrap();
    node.coordinator
        .reconcile(&run, &calls[1].call_id, Reconciliation::Retry, None)
        .await
        .unwrap();
    let again = node.settle(&run).await;
    assert!(
        again.step_index > first_step,
        "the batch went on in a later step"
    );
    let keys = node.keys();
    assert_eq!(keys.len(), 3, "{keys:?}");
    let under_first_key = keys
        .iter()
        .filter(|k| **k == calls[1].idempotency_key)
        .count();
    assert_eq!(
        under_first_key, 2,
        "the keyed call was sent again under its first key: {keys:?}"
    );
    node.pool.shutdown().await;
}

/// A model's batch of a `never` and a `keyed` call that finish and a `keyed` call that hangs.
fn mixed_batch() -> Value {
    json!({"tool_calls": [
        {"name": "done_never", "arguments": {}},
        {"name": "done_keyed", "arguments": {}},
        {"name": "hang_once_keyed", "arguments": {}},
    ]})
}

impl Node {
    /// Waits until `calls` calls have started.
    async fn started(&self, calls: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.keys().len() < calls {
            assert!(Instant::now() < deadline, "{calls} calls never started");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// The batch's deadline passes while one call hangs: the two calls that finished keep their
/// outcomes, and `continue` carries the batch on — the finished calls do not run again, the
/// cut-off `keyed` one runs again under its first key, and the model reads every real result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_cut_off_batch_keeps_its_outcomes_and_continue_carries_it_on() {
    let node = node(json!([mixed_batch(), answer()]));
    let limits = Limits {
        max_duration_ms: Some(800),
        ..Limits::default()
    };
    let run = node.start(node.config(limits, &[])).await;
    let ended = node.settle(&run).await;
    assert_eq!(ended.stop_reason, Some(StopReason::TimedOut));
    assert!(ended.in_doubt.is_empty(), "{:?}", ended.in_doubt);
    let kept: Vec<Option<String>> = (ended.checkpoint.as_ref().unwrap().calls.iter())
        .map(|p| p.outcome.as_ref().map(|o| o.content.clone()))
        .collect();
    assert_eq!(
        kept,
        [
            Some("done_never done".to_owned()),
            Some("done_keyed done".to_owned()),
            None
        ]
    );
    assert!(
        node.tool_results(&run).await.is_empty(),
        "the batch stays open"
    );
    let more = ratchet_core::step::Resumption::Continue {
        extension: ratchet_core::BudgetExtension {
            duration_ms: 60_000,
            ..Default::default()
        },
    };
    node.coordinator
        .resume_failed(&run, more, None)
        .await
        .unwrap();
    let done = node.settle(&run).await;
    assert_eq!(done.status, RunStatus::Completed);
    assert_eq!(
        done.counters.model_calls, 2,
        "the model was asked once more, after the batch"
    );
    assert_eq!(
        node.tool_results(&run).await,
        [
            ("done_never done".to_owned(), false),
            ("done_keyed done".to_owned(), false),
            ("hang_once_keyed done".to_owned(), false),
        ]
    );
    let keys = node.keys();
    assert_eq!(keys.len(), 4, "only the cut-off call ran again: {keys:?}");
    let cut_off_key = &(ended.checkpoint.as_ref().unwrap()).idempotency_key(&run, 0, 2);
    let under_it = keys.iter().filter(|k| *k == cut_off_key).count();
    assert_eq!(under_it, 2, "it ran again under its first key: {keys:?}");
    node.pool.shutdown().await;
}

/// A cancel cuts a batch off: the cancelled run's history answers every call with what
/// became of it — the finished calls' real outcomes, the hanging call's unknown outcome —
/// and never "not run" of a call that started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_batch_tells_each_call_what_became_of_it() {
    let node = node(json!([mixed_batch(), answer()]));
    let run = node.start(node.config(Limits::default(), &[])).await;
    node.started(3).await;
    node.coordinator.request_cancel(&run).await.unwrap();
    let ended = node.settle(&run).await;
    assert_eq!(ended.status, RunStatus::Cancelled);
    let results = node.tool_results(&run).await;
    assert_eq!(results.len(), 3, "{results:?}");
    assert_eq!(results[0].0, "done_never done");
    assert_eq!(results[1].0, "done_keyed done");
    assert!(
        results[2]
            .0
            .starts_with("outcome unknown: the run was cancelled"),
        "{results:?}"
    );
    assert!(
        ended.in_doubt.is_empty(),
        "a keyed call is not a human's to record"
    );
    node.pool.shutdown().await;
}

/// A cancel accepted by another process (another Coordinator on the same store, with no
/// change stream between them) reaches the step in flight here: it is cut off within the
/// grace period and about a second, whatever its tool does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_accepted_by_another_process_reaches_the_step_in_flight() {
    let node = node(json!([call("hang_never"), answer()]));
    let run = node.start(node.config(Limits::default(), &[])).await;
    node.started(1).await;
    let other = Coordinator::new(node.store.clone());
    let asked = Instant::now();
    other.request_cancel(&run).await.unwrap();
    let state = node.settle(&run).await;
    let took = asked.elapsed();
    assert_eq!(state.status, RunStatus::Cancelled);
    assert!(
        took < GRACE + Duration::from_secs(2),
        "took {took:?} with a grace of {GRACE:?}"
    );
    assert_eq!(in_doubt_tools(&state), ["hang_never"]);
    node.pool.shutdown().await;
}

/// Every worker of the pool is busy with a long call: a run waiting for a human still ends at
/// its deadline, swept on the pool's own cadence rather than only by an idle worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_run_ends_at_its_deadline_while_every_worker_is_busy() {
    let node = node(json!([call("unknown_never"), answer()]));
    let limits = Limits {
        max_duration_ms: Some(1_500),
        ..Limits::default()
    };
    let waiting = node.start(node.config(limits, &[])).await;
    assert_eq!(node.settle(&waiting).await.status, RunStatus::WaitingHuman);
    let busy = node.script.with_file_name("busy.json");
    std::fs::write(
        &busy,
        json!({"replies": [call("hang_safe"), answer()]}).to_string(),
    )
    .unwrap();
    let hour = CallLimits {
        timeout_ms: 3_600_000,
        ..CallLimits::default()
    };
    for _ in 0..2 {
        let config = RunConfigSnapshot {
            model: format!("scripted:{}", busy.display()),
            ..node.config(Limits::default(), &[("hang_safe", hour)])
        };
        node.start(config).await;
    }
    node.started(3).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let ended = loop {
        let state = node.coordinator.store().load_state(&waiting).await.unwrap();
        if state.status.is_terminal() {
            break state;
        }
        assert!(
            Instant::now() < deadline,
            "still {} long after its deadline",
            state.status
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(ended.stop_reason, Some(StopReason::TimedOut));
}

/// A message queued behind a sleeping run wakes its `sleep` once — the model is told input is
/// waiting — and never again: the model cannot see a queued message before its turn ends, so a
/// second `sleep` of the turn runs to its time instead of returning at once, forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_message_wakes_one_sleep_of_the_turn_and_not_the_next() {
    let node = node(json!([
        {"tool_calls": [{"name": "sleep", "arguments": {"ms": 20_000}}]},
        {"tool_calls": [{"name": "sleep", "arguments": {"ms": 300}}]},
        answer(),
    ]));
    let run = node.start(node.config(Limits::default(), &[])).await;
    let session = node
        .coordinator
        .store()
        .load_state(&run)
        .await
        .unwrap()
        .session_id;
    // Inside the first sleep.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let state = node.coordinator.store().load_state(&run).await.unwrap();
        if state.step_index >= 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the model never asked to sleep");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let later = node.script.with_file_name("later.json");
    std::fs::write(&later, json!({"replies": [answer()]}).to_string()).unwrap();
    let queued = RunConfigSnapshot {
        model: format!("scripted:{}", later.display()),
        ..node.config(Limits::default(), &[])
    };
    node.coordinator
        .submit(&session, "later".into(), queued, Multitask::Enqueue)
        .await
        .unwrap();
    let done = node.settle(&run).await;
    assert_eq!(done.status, RunStatus::Completed);
    let results = node.tool_results(&run).await;
    assert_eq!(results.len(), 2, "{results:?}");
    assert!(results[0].0.contains(r#""woke":"input""#), "{results:?}");
    assert!(
        results[1].0.contains(r#""woke":"timer""#),
        "the second sleep is not woken by the message the first was: {results:?}"
    );
}
