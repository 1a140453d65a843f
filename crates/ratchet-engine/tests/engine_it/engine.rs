//! The engine end to end on the in-memory reference store (each `MemoryStore` clone is another
//! "process" on the same data): worker pools in competition, cancellation of an in-flight
//! step, model retries, takeover of a step whose worker vanished, the relay of other
//! processes' changes, and a lease that expires on tokio's paused clock.

use std::sync::Arc;
use std::time::Duration;

use ratchet_core::{Limits, MemoryScope, RunConfigSnapshot, RunId, RunStatus, StopReason};
use ratchet_engine::{
    Clock, Coordinator, Engine, LiveActivity, Models, Multitask, PoolConfig, WorkerPool,
};
use ratchet_store::{Lease, SessionSpec, Store};
use ratchet_store_memory::MemoryStore;
use ratchet_tools::Registry;
use serde_json::json;

struct Node {
    coordinator: Arc<Coordinator>,
    pool: WorkerPool,
}

/// One "process": its own handle on the store, coordinator and worker pool.
fn node(store: &MemoryStore, config: PoolConfig) -> Node {
    let store: Arc<dyn Store> = Arc::new(store.clone());
    let tools = Arc::new(Registry::builtin());
    let models = Arc::new(Models::new(tools.names()));
    let coordinator = Coordinator::new(store);
    let engine = Arc::new(Engine::new(Arc::clone(&coordinator), models, tools));
    let pool = WorkerPool::start(Arc::clone(&coordinator), engine, config);
    Node { coordinator, pool }
}

fn fast_pool() -> PoolConfig {
    PoolConfig {
        workers: 4,
        poll: Duration::from_millis(10),
        retry_backoff: Duration::from_millis(10),
        max_streak: 2,
        ..PoolConfig::default()
    }
}

fn config(script: &std::path::Path) -> RunConfigSnapshot {
    RunConfigSnapshot {
        model: format!("scripted:{}", script.display()),
        model_settings: None,
        workspace: None,
        system_prompt: String::new(),
        tools: Registry::builtin().specs(),
        limits: Limits::default(),
        memory_scope: MemoryScope::Session,
        ..RunConfigSnapshot::default()
    }
}

fn write_script(dir: &std::path::Path, script: serde_json::Value) -> std::path::PathBuf {
    let path = dir.join("script.json");
    std::fs::write(&path, script.to_string()).unwrap();
    path
}

/// A new session with one message; returns the message's run.
async fn start_run(coordinator: &Coordinator, text: String, config: RunConfigSnapshot) -> RunId {
    let session = coordinator
        .create_session(SessionSpec::default())
        .await
        .unwrap()
        .id;
    coordinator
        .submit(&session, text, config, Multitask::Enqueue)
        .await
        .unwrap()
        .run_id
}

/// Waits until this process announces a batch running `tool`: a replay-safe call's
/// `tool.call` is stored only with its step's commit, so the live activity is what tells that
/// it runs.
async fn until_running(activity: &mut tokio::sync::broadcast::Receiver<LiveActivity>, tool: &str) {
    loop {
        let announced = tokio::time::timeout(Duration::from_secs(30), activity.recv())
            .await
            .unwrap_or_else(|_| panic!("no batch running {tool} was announced"))
            .unwrap();
        let tools = announced.payload["tools"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if announced.payload["activity"] == "executing_tools" && tools.iter().any(|t| t == tool) {
            return;
        }
    }
}

async fn wait_until_terminal(coordinator: &Coordinator, run: &RunId) -> ratchet_core::AgentState {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut events = coordinator.subscribe();
    loop {
        let state = coordinator.store().load_state(run).await.unwrap();
        if state.status.is_terminal() || state.status.is_waiting() {
            return state;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "run {run} stuck in {}",
            state.status
        );
        let _ = tokio::time::timeout(Duration::from_millis(50), events.recv()).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pools_on_one_database_commit_every_step_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let db = MemoryStore::new();
    let turns = 4;
    let mut replies: Vec<_> = (0..turns)
        .map(|i| json!({"tool_calls": [{"name": "add", "arguments": {"a": i, "b": 1}}]}))
        .collect();
    replies.push(json!({"text": "done"}));
    let script = write_script(dir.path(), json!({"replies": replies}));
    // Short streaks make the two pools hand runs back and forth through the outbox.
    let a = node(&db, fast_pool());
    let b = node(&db, fast_pool());
    let mut runs = Vec::new();
    for i in 0..24 {
        let submitter = if i % 2 == 0 { &a } else { &b };
        let session = submitter
            .coordinator
            .create_session(SessionSpec::default())
            .await
            .unwrap()
            .id;
        let started = submitter
            .coordinator
            .submit(
                &session,
                format!("run {i}"),
                config(&script),
                Multitask::Enqueue,
            )
            .await
            .unwrap();
        runs.push((session, started.run_id));
    }
    for (session, run) in &runs {
        let state = wait_until_terminal(&a.coordinator, run).await;
        assert_eq!(state.status, RunStatus::Completed, "{run}");
        assert_eq!(state.step_index, 2 * turns + 1);
        let steps = a.coordinator.store().steps(run).await.unwrap();
        let indexes: Vec<u64> = steps.iter().map(|s| s.index).collect();
        assert_eq!(
            indexes,
            (1..=2 * turns + 1).collect::<Vec<_>>(),
            "one record per step"
        );
        let events = a
            .coordinator
            .store()
            .events_after(session, 0, 10_000)
            .await
            .unwrap();
        let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
        assert_eq!(
            seqs,
            (1..=events.len() as i64).collect::<Vec<_>>(),
            "dense per-session seq"
        );
        let committed = events.iter().filter(|e| e.kind == "step.committed").count() as u64;
        assert_eq!(committed, 2 * turns + 1, "exactly one commit per step");
        let history = a.coordinator.store().history(session).await.unwrap();
        assert_eq!(
            history.len() as u64,
            1 + 2 * turns + 1,
            "user + (assistant, tool) per turn + answer"
        );
    }
    a.pool.shutdown().await;
    b.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_run_stops_its_in_flight_step() {
    let dir = tempfile::tempdir().unwrap();
    let db = MemoryStore::new();
    let script = write_script(
        dir.path(),
        json!({"replies": [{"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 600000}}]}, {"text": "never"}]}),
    );
    let node = node(&db, fast_pool());
    let mut activity = node.coordinator.observe().activity;
    let run = start_run(&node.coordinator, "sleep".into(), config(&script)).await;
    until_running(&mut activity, "sleep_ms").await;
    // An observer that joins now learns what the step in flight is doing.
    let joined = node.coordinator.observe().in_flight;
    assert_eq!(joined.len(), 1, "{joined:?}");
    assert_eq!(
        (&joined[0].run_id, &joined[0].payload["activity"]),
        (&run, &json!("executing_tools"))
    );
    assert!(node.coordinator.still_in_flight(&joined[0]));
    node.coordinator.request_cancel(&run).await.unwrap();
    let state = wait_until_terminal(&node.coordinator, &run).await;
    assert_eq!(state.status, RunStatus::Cancelled);
    assert_eq!(state.stop_reason, Some(StopReason::Cancelled));
    assert!(state.finished_at.is_some());
    let store = node.coordinator.store();
    assert!(
        store.runs_with_jobs().await.unwrap().is_empty(),
        "no job left behind"
    );
    let kinds: Vec<String> = store
        .events_after(&state.session_id, 0, 1000)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(
        kinds.iter().filter(|k| *k == "run.finished").count(),
        1,
        "{kinds:?}"
    );
    assert_eq!(
        store.intents(&run, 2).await.unwrap(),
        [],
        "the interrupted call is replay-safe: it wrote nothing ahead, and the run ended"
    );
    // Once the workers are done, the step is over: nobody joining learns of it any more.
    node.pool.shutdown().await;
    assert!(!node.coordinator.still_in_flight(&joined[0]));
    assert_eq!(node.coordinator.observe().in_flight, []);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_model_call_is_retried_then_fails_the_run_when_attempts_run_out() {
    let dir = tempfile::tempdir().unwrap();
    let db = MemoryStore::new();
    let script = write_script(
        dir.path(),
        json!({"replies": [{"text": "ok", "error": "http_500"}]}),
    );
    let node = node(&db, fast_pool());
    let run = start_run(&node.coordinator, "hi".into(), config(&script)).await;
    let state = wait_until_terminal(&node.coordinator, &run).await;
    assert_eq!(
        state.status,
        RunStatus::Completed,
        "the second attempt succeeds"
    );
    assert_eq!(state.step_index, 1);
    let errors = node
        .coordinator
        .store()
        .events_after(&state.session_id, 0, 1000)
        .await
        .unwrap();
    let errors: Vec<_> = errors.iter().filter(|e| e.kind == "model.error").collect();
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].payload["attempt"], 1);

    let mut one_attempt = config(&script);
    one_attempt.limits.max_model_attempts = 1;
    let run = start_run(&node.coordinator, "hi".into(), one_attempt).await;
    let state = wait_until_terminal(&node.coordinator, &run).await;
    assert_eq!(
        (state.status, state.stop_reason),
        (RunStatus::Failed, Some(StopReason::LlmError))
    );
    node.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_whose_worker_vanished_is_taken_over_after_its_lease_expires() {
    let dir = tempfile::tempdir().unwrap();
    let db = MemoryStore::new();
    let script = write_script(dir.path(), json!({"replies": [{"text": "recovered"}]}));
    let store: Arc<dyn Store> = Arc::new(db.clone());
    let coordinator = Coordinator::new(Arc::clone(&store));
    let run = start_run(&coordinator, "hi".into(), config(&script)).await;
    // A worker claims the first step with a short lease and is never heard from again.
    let lease = Lease {
        owner: "gone:1:x".into(),
        expires_at: now_ms() + 300,
    };
    let lost = store
        .claim_next(lease, None, now_ms())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(lost.job.attempt, 1);
    let node = node(&db, fast_pool());
    let state = wait_until_terminal(&node.coordinator, &run).await;
    assert_eq!(state.status, RunStatus::Completed);
    assert_eq!(state.final_answer.as_deref(), Some("recovered"));
    assert_eq!(
        node.coordinator.store().intents(&run, 1).await.unwrap(),
        [],
        "a model call writes nothing ahead, and none of its attempts failed"
    );
    let commit = store
        .commit_step(
            &lost.claim,
            ratchet_core::step::finish_step(
                lost.state.clone(),
                &lost.job,
                StopReason::Cancelled,
                now_ms(),
                now_ms(),
            ),
            None,
            now_ms(),
        )
        .await
        .unwrap();
    assert!(
        matches!(commit, ratchet_store::Commit::Stale(_)),
        "the vanished worker's late commit is refused"
    );
    assert_eq!(
        node.coordinator
            .store()
            .load_state(&run)
            .await
            .unwrap()
            .status,
        RunStatus::Completed
    );
    node.pool.shutdown().await;
}

/// The same takeover on tokio's paused clock, with the pool's real 15-second lease: the
/// runtime reads the time only from its `Clock`, so the lease expires when tokio's time passes
/// it — with nothing else to do, tokio skips ahead to the workers' next poll — and the test
/// waits for nothing real. What the run records is stamped by that clock too.
#[tokio::test(start_paused = true)]
async fn a_vanished_workers_lease_expires_on_the_runtimes_clock() {
    const EPOCH: i64 = 1_000_000;
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(dir.path(), json!({"replies": [{"text": "recovered"}]}));
    let clock = Clock::tokio_from(EPOCH);
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let coordinator = Coordinator::with_clock(
        Arc::clone(&store),
        ratchet_store::RunQuota::default(),
        clock,
    );
    let run = start_run(&coordinator, "hi".into(), config(&script)).await;
    let pool_config = PoolConfig::default();
    let lease_ms = pool_config.lease.as_millis() as i64;
    let lease = Lease {
        owner: "gone:1:x".into(),
        expires_at: clock.now() + lease_ms,
    };
    store
        .claim_next(lease, None, clock.now())
        .await
        .unwrap()
        .expect("the first step, claimed by a worker that then vanishes");
    let tools = Arc::new(Registry::builtin());
    let models = Arc::new(Models::new(tools.names()));
    let engine = Arc::new(Engine::new(Arc::clone(&coordinator), models, tools));
    let pool = WorkerPool::start(Arc::clone(&coordinator), engine, pool_config);

    let state = wait_until_terminal(&coordinator, &run).await;
    assert_eq!(state.status, RunStatus::Completed);
    let finished = state.finished_at.expect("a finished run has its timestamp");
    assert!(
        (EPOCH + lease_ms..EPOCH + 2 * lease_ms).contains(&finished),
        "the run finished at {finished} by the runtime's clock: after the lease that ended at \
         {} expired, and soon after",
        EPOCH + lease_ms
    );
    pool.shutdown().await;
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_during_a_slow_model_stream_ends_the_run_within_a_second() {
    let dir = tempfile::tempdir().unwrap();
    let db = MemoryStore::new();
    let words = vec!["word"; 100].join(" ");
    let script = write_script(
        dir.path(),
        json!({"replies": [{"text": words, "chunk_delay_ms": 100}]}),
    );
    let node = node(&db, fast_pool());
    let mut events = node.coordinator.subscribe();
    let run = start_run(&node.coordinator, "talk".into(), config(&script)).await;
    loop {
        let event = tokio::time::timeout(Duration::from_secs(10), events.recv())
            .await
            .unwrap()
            .unwrap();
        if event.kind == "assistant.delta" {
            break;
        }
    }
    let asked = std::time::Instant::now();
    node.coordinator.request_cancel(&run).await.unwrap();
    let state = wait_until_terminal(&node.coordinator, &run).await;
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "the stream of ~10 s was cut short, took {:?}",
        asked.elapsed()
    );
    assert_eq!(state.status, RunStatus::Cancelled);
    assert_eq!(state.stop_reason, Some(StopReason::Cancelled));
    node.pool.shutdown().await;
}

/// What another process commits reaches this one through the store's change stream: its
/// events are read back and published on this process's bus, in order and unchanged, and its
/// new jobs wake workers that would otherwise sleep until their next poll. The relay holds
/// the Coordinator weakly: it ends with the stream, or when the Coordinator is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_follower_relays_other_processes_events_and_wakes_idle_workers() {
    let dir = tempfile::tempdir().unwrap();
    let db = MemoryStore::new();
    let script = write_script(dir.path(), json!({"replies": [{"text": "heard you"}]}));
    let sqlite: Arc<dyn Store> = Arc::new(db.clone());
    let (heard, announce) = crate::heard::Heard::over(sqlite);
    let here = Coordinator::new(heard);
    let follower = here
        .follow_others()
        .expect("the store hears other processes");
    let mut bus = here.subscribe();
    // Workers that would not look for a minute unless woken.
    let tools = Arc::new(Registry::builtin());
    let models = Arc::new(Models::new(tools.names()));
    let engine = Arc::new(Engine::new(Arc::clone(&here), models, tools));
    let sleepy = PoolConfig {
        workers: 2,
        poll: Duration::from_secs(60),
        ..PoolConfig::default()
    };
    let pool = WorkerPool::start(Arc::clone(&here), engine, sleepy);

    // Another process (no workers) starts a run; nothing of it reaches this bus by itself.
    let elsewhere = Coordinator::new(Arc::new(db.clone()));
    let mut their_bus = elsewhere.subscribe();
    let run = start_run(&elsewhere, "hello".into(), config(&script)).await;
    let mut theirs = Vec::new();
    while let Ok(event) = their_bus.try_recv() {
        theirs.push(event);
    }
    let session = theirs[0].session_id.clone();
    assert_eq!(theirs.first().map(|e| e.seq), Some(1));
    let last_seq = theirs.last().unwrap().seq;
    announce
        .send(ratchet_store::Change::Events {
            session_id: session.clone(),
            first_seq: 1,
            last_seq,
        })
        .unwrap();
    for expected in &theirs {
        let relayed = tokio::time::timeout(Duration::from_secs(10), bus.recv())
            .await
            .expect("the announced events were not relayed")
            .unwrap();
        assert_eq!(&relayed, expected, "relayed as stored, in order");
    }

    announce.send(ratchet_store::Change::JobsReady).unwrap();
    let state = wait_until_terminal(&here, &run).await;
    assert_eq!(state.final_answer.as_deref(), Some("heard you"));
    let worker = here
        .store()
        .events_after(&session, 0, 100)
        .await
        .unwrap()
        .into_iter()
        .find(|e| e.kind == "step.committed")
        .map(|e| e.payload["worker"].clone());
    assert_eq!(
        worker,
        Some(json!(pool.owner())),
        "a step names the process that ran it"
    );

    pool.shutdown().await;
    drop(here);
    tokio::time::timeout(Duration::from_secs(10), follower)
        .await
        .expect("the relay ended with its Coordinator")
        .unwrap();

    let (heard, announce) = crate::heard::Heard::over(Arc::new(db.clone()));
    let coordinator = Coordinator::new(heard);
    let follower = coordinator.follow_others().unwrap();
    drop(announce);
    tokio::time::timeout(Duration::from_secs(10), follower)
        .await
        .expect("the relay ended with its stream")
        .unwrap();
}

/// `sleep` ends when input for the session arrives: a run sleeping for ten minutes answers as
/// soon as a second message is queued behind it, and tells the model what woke it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sleeping_run_wakes_when_a_message_is_queued_behind_it() {
    let dir = tempfile::tempdir().unwrap();
    let db = MemoryStore::new();
    let node = node(&db, fast_pool());
    let script = write_script(
        dir.path(),
        json!({"replies": [
            {"tool_calls": [{"name": "sleep", "arguments": {"ms": 600000}}]},
            {"text": "awake"}
        ]}),
    );
    let mut activity = node.coordinator.observe().activity;
    let first = start_run(&node.coordinator, "wait for me".into(), config(&script)).await;
    let session = node
        .coordinator
        .store()
        .load_state(&first)
        .await
        .unwrap()
        .session_id;
    until_running(&mut activity, "sleep").await;
    let answer = dir.path().join("answer.json");
    std::fs::write(&answer, json!({"replies": [{"text": "hello"}]}).to_string()).unwrap();
    let second = node
        .coordinator
        .submit(
            &session,
            "here I am".into(),
            config(&answer),
            Multitask::Enqueue,
        )
        .await
        .unwrap()
        .run_id;
    let ended = wait_until_terminal(&node.coordinator, &first).await;
    assert_eq!(ended.final_answer.as_deref(), Some("awake"));
    let history = node.coordinator.store().history(&session).await.unwrap();
    let result = history
        .iter()
        .find(|m| m.role == ratchet_core::Role::Tool)
        .expect("the sleep's result");
    let woke: serde_json::Value = serde_json::from_str(&result.content).unwrap();
    assert_eq!(woke["woke"], "input", "{woke}");
    assert_eq!(woke["waiting"]["queued_messages"], 1, "{woke}");
    assert!(woke["slept_ms"].as_u64().unwrap() < 600_000);
    wait_until_terminal(&node.coordinator, &second).await;
    node.pool.shutdown().await;
}

/// A run parked on a `wait` holds no worker: with a pool of one, another session's run starts
/// and completes while it waits. At its due time it wakes, and the model reads the batch's
/// results in order — the call that ran before it parked, then the wait's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_run_holds_no_worker_and_wakes_with_its_batch_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let waits = dir.path().join("waits");
    let answers = dir.path().join("answers");
    std::fs::create_dir_all(&waits).unwrap();
    std::fs::create_dir_all(&answers).unwrap();
    let waiting = write_script(
        &waits,
        json!({"replies": [
            {"tool_calls": [
                {"name": "add", "arguments": {"a": 1, "b": 2}},
                {"name": "wait", "arguments": {"ms": 1_500}}]},
            {"text": "waited"}
        ]}),
    );
    let answering = write_script(&answers, json!({"replies": [{"text": "answered"}]}));
    let one = node(
        &MemoryStore::new(),
        PoolConfig {
            workers: 1,
            ..fast_pool()
        },
    );
    let coordinator = &one.coordinator;
    let run = start_run(coordinator, "wait".into(), config(&waiting)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let parked = loop {
        let state = coordinator.store().load_state(&run).await.unwrap();
        if state.status == RunStatus::WaitingTimer {
            break state;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never parked: {}",
            state.status
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let due = parked.timer.expect("parked on its timer").due_at;
    let other = start_run(coordinator, "answer".into(), config(&answering)).await;
    let answered = wait_until_terminal(coordinator, &other).await;
    assert_eq!(answered.status, RunStatus::Completed);
    assert!(
        answered.finished_at.unwrap() < due,
        "the only worker answered another session while the run waited"
    );
    let woke = wait_until_terminal(coordinator, &run).await;
    assert_eq!(
        (woke.status, woke.final_answer.as_deref()),
        (RunStatus::Completed, Some("waited"))
    );
    let session = woke.session_id.clone();
    let history = coordinator.store().history(&session).await.unwrap();
    let results: Vec<&str> = (history.iter())
        .filter(|m| m.role == ratchet_core::Role::Tool)
        .map(|m| m.content.as_str())
        .collect();
    assert_eq!(results.len(), 2, "{results:?}");
    assert_eq!(results[0], "3");
    let waited: serde_json::Value = serde_json::from_str(results[1]).unwrap();
    assert_eq!(waited["woke"], "timer");
    assert!(waited["waited_ms"].as_i64().unwrap() >= 1_500, "{waited}");
    one.pool.shutdown().await;
}
