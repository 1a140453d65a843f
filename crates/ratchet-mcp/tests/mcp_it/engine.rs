//! MCP tools through the real engine: a scripted model calls them, the engine records an
//! intent and an outcome around each call, and the results reach the session's history.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ratchet_core::step::Reconciliation;
use ratchet_core::{
    AgentState, HumanRequest, Limits, MemoryScope, Role, RunConfigSnapshot, RunId, RunStatus,
};
use ratchet_engine::{Coordinator, Engine, Models, Multitask, PoolConfig, WorkerPool};
use ratchet_mcp::{Approval, Config, McpTools, ServerConfig, connect_all};
use ratchet_store::{SessionSpec, Store};
use ratchet_tools::Registry;
use serde_json::{Value, json};

use crate::rmcp_server::{self, RmcpHttpServer};

struct Node {
    coordinator: Arc<Coordinator>,
    pool: WorkerPool,
    registry: Arc<Registry>,
}

/// A runtime whose registry holds the built-ins and the MCP tools, as the CLI will build it.
fn node(dir: &Path, mcp: &McpTools) -> Node {
    let db = format!("sqlite://{}", dir.join("r.db").display());
    let store: Arc<dyn Store> = Arc::new(ratchet_sqlite::open_url(&db).unwrap());
    let registry = Arc::new(
        Registry::new(
            [
                Registry::builtin_tools(ratchet_tools::DEFAULT_MAX_SNIPPET_BYTES),
                mcp.tools(),
            ]
            .into_iter()
            .flatten()
            .collect(),
        )
        .unwrap(),
    );
    let models = Arc::new(Models::new(registry.names()));
    let coordinator = Coordinator::new(store);
    let engine = Arc::new(Engine::new(
        Arc::clone(&coordinator),
        models,
        Arc::clone(&registry),
    ));
    let pool = WorkerPool::start(
        Arc::clone(&coordinator),
        engine,
        PoolConfig {
            workers: 2,
            poll: Duration::from_millis(10),
            ..PoolConfig::default()
        },
    );
    Node {
        coordinator,
        pool,
        registry,
    }
}

fn server(log: &Path) -> ServerConfig {
    ServerConfig {
        command: Some("python3".into()),
        args: vec![
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/stdio_server.py")
                .display()
                .to_string(),
        ],
        env: [("MCP_TEST_LOG".to_owned(), log.display().to_string())].into(),
        ..ServerConfig::default()
    }
}

fn script(dir: &Path, replies: Value) -> PathBuf {
    let path = dir.join("script.json");
    std::fs::write(&path, json!({ "replies": replies }).to_string()).unwrap();
    path
}

async fn run(node: &Node, script: &Path, message: &str) -> (RunId, AgentState) {
    let config = RunConfigSnapshot {
        model: format!("scripted:{}", script.display()),
        model_settings: None,
        workspace: None,
        system_prompt: String::new(),
        tools: node.registry.specs(),
        limits: Limits::default(),
        memory_scope: MemoryScope::Session,
        ..RunConfigSnapshot::default()
    };
    let session = node
        .coordinator
        .create_session(SessionSpec::default())
        .await
        .unwrap()
        .id;
    let run = node
        .coordinator
        .submit(&session, message.into(), config, Multitask::Enqueue)
        .await
        .unwrap()
        .run_id;
    let state = settle(node, &run).await;
    (run, state)
}

/// Waits until the run has ended or waits for someone.
async fn settle(node: &Node, run: &RunId) -> AgentState {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut events = node.coordinator.subscribe();
    loop {
        let state = node.coordinator.store().load_state(run).await.unwrap();
        if state.status.is_terminal() || state.status.is_waiting() {
            return state;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "run stuck in {}",
            state.status
        );
        let _ = tokio::time::timeout(Duration::from_millis(50), events.recv()).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_calls_mcp_tools_and_their_results_reach_the_history() {
    let dir = tempfile::tempdir().unwrap();
    let mut local = server(&dir.path().join("log"));
    local.approval = Some(Approval::Never);
    let mcp = connect_all(&Config {
        servers: [("local".to_owned(), local)].into(),
    })
    .await
    .unwrap();
    let node = node(dir.path(), &mcp);
    let call = |name: &str, arguments: Value| json!({"tool_calls": [{"name": name, "arguments": arguments}]});
    let script = script(
        dir.path(),
        json!([
            {"tool_calls": [
                {"name": "local.echo", "arguments": {"text": "from the MCP server"}},
                {"name": "local.meta"}
            ]},
            call("local.crash", json!({})),
            call("local.add", json!({"a": 20, "b": 22})),
            {"text": "done"}
        ]),
    );
    let (run, waiting) = run(&node, &script, "use the server").await;
    // The server died with the call in hand: nobody knows whether it took effect, and an MCP
    // tool is `never` by default, so a human says what happened before the model goes on.
    assert_eq!(waiting.status, RunStatus::WaitingHuman);
    let Some(HumanRequest::Reconciliation { calls }) = &waiting.pending_human else {
        panic!("expected a reconciliation: {:?}", waiting.pending_human);
    };
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].tool, "local.crash");
    assert_eq!(waiting.counters.model_calls, 2);
    node.coordinator
        .reconcile(
            &run,
            &calls[0].call_id,
            Reconciliation::Failed,
            Some("the server crashed before acting".into()),
        )
        .await
        .unwrap();
    let state = settle(&node, &run).await;
    assert_eq!(
        state.status,
        RunStatus::Completed,
        "{:?}",
        state.stop_reason
    );
    assert_eq!(state.final_answer.as_deref(), Some("done"));
    let history = node
        .coordinator
        .store()
        .history(&state.session_id)
        .await
        .unwrap();
    let results: Vec<&str> = history
        .iter()
        .filter(|m| m.role == Role::Tool)
        .map(|m| m.content.as_str())
        .collect();
    assert_eq!(results.len(), 4, "{history:?}");
    assert_eq!(results[0], "from the MCP server");
    // The engine's idempotency key of the call (`{run}#{step}#{slot}`) reached the server.
    let meta: Value = serde_json::from_str(results[1]).unwrap();
    assert_eq!(meta["ratchet/idempotency_key"], format!("{run}#2#1"));
    // What the human recorded is the outcome the model reads, and the run goes on with a
    // restarted server.
    assert_eq!(results[2], "the server crashed before acting");
    assert_eq!(results[3], "42");
    // The engine recorded an intent before each call and its outcome after.
    let intents = node.coordinator.store().intents(&run, 2).await.unwrap();
    let recorded: Vec<(&str, Option<&str>)> = intents
        .iter()
        .map(|i| {
            (
                i.name.as_str(),
                i.outcome.as_ref().map(|o| o.content.as_str()),
            )
        })
        .collect();
    assert_eq!(
        recorded,
        [
            ("local.echo", Some("from the MCP server")),
            ("local.meta", Some(results[1]))
        ]
    );
    node.pool.shutdown().await;
}

/// A real stdio server that holds a `never` call past `call_timeout`: the call's outcome is
/// unknown, the run waits for a human, and the model is not asked again until one answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_never_call_the_server_holds_past_its_timeout_waits_for_a_human() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let mut local = server(&log);
    local.approval = Some(Approval::Never);
    local.timeout_ms = Some(300);
    let mcp = connect_all(&Config {
        servers: [("local".to_owned(), local)].into(),
    })
    .await
    .unwrap();
    let node = node(dir.path(), &mcp);
    let script = script(
        dir.path(),
        json!([
            {"tool_calls": [{"name": "local.slow", "arguments": {"ms": 60_000}}]},
            {"text": "done"}
        ]),
    );
    let (run, waiting) = run(&node, &script, "pay once").await;
    assert_eq!(waiting.status, RunStatus::WaitingHuman);
    let Some(HumanRequest::Reconciliation { calls }) = &waiting.pending_human else {
        panic!("expected a reconciliation: {:?}", waiting.pending_human);
    };
    assert_eq!(calls[0].tool, "local.slow");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let later = node.coordinator.store().load_state(&run).await.unwrap();
    assert_eq!(later.status, RunStatus::WaitingHuman);
    assert_eq!(
        later.counters.model_calls, 1,
        "the model was not asked again"
    );
    let started = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        started
            .lines()
            .filter(|l| l.starts_with("slow started"))
            .count(),
        1,
        "the call was sent once: {started}"
    );
    node.coordinator
        .reconcile(&run, &calls[0].call_id, Reconciliation::Succeeded, None)
        .await
        .unwrap();
    let done = settle(&node, &run).await;
    assert_eq!(done.status, RunStatus::Completed);
    assert_eq!(done.counters.model_calls, 2);
    mcp.close().await;
    node.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_an_mcp_tool_waits_for_a_human_before_it_runs() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let mcp = connect_all(&Config {
        servers: [("local".to_owned(), server(&log))].into(),
    })
    .await
    .unwrap();
    let node = node(dir.path(), &mcp);
    let script = script(
        dir.path(),
        json!([{"tool_calls": [{"name": "local.meta"}]}, {"text": "done"}]),
    );
    let (_, state) = run(&node, &script, "use the server").await;
    assert_eq!(state.status, RunStatus::WaitingHuman);
    let Some(HumanRequest::Approval { calls, .. }) = &state.pending_human else {
        panic!("expected an approval, found {:?}", state.pending_human);
    };
    assert_eq!(calls.len(), 1);
    assert!(calls[0].needs_approval);
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(!log.contains("meta"), "the call ran: {log}");
    node.pool.shutdown().await;
}

/// Not a test: the stdio MCP server written with rmcp. The stdio tests below start this
/// very test binary again as the server's command, asking it to run only this function,
/// with `rmcp_server::STDIO_PID_FILE` set; the function then serves MCP on stdin/stdout and
/// ends the process (the harness's "running 1 test" line before it is not JSON, and rmcp's
/// client skips unparsable lines). Run as part of the suite, without the variable, it does
/// nothing.
#[test]
fn rmcp_stdio_server() {
    rmcp_server::serve_stdio_if_asked();
}

/// A stdio server config that starts `rmcp_stdio_server` in a new process of this binary,
/// which writes its pid to `pid_file`.
fn rmcp_stdio_server_config(pid_file: &Path) -> ServerConfig {
    ServerConfig {
        command: Some(std::env::current_exe().unwrap().display().to_string()),
        args: ["engine::rmcp_stdio_server", "--exact", "--nocapture"]
            .map(str::to_owned)
            .to_vec(),
        env: [(
            rmcp_server::STDIO_PID_FILE.to_owned(),
            pid_file.display().to_string(),
        )]
        .into(),
        approval: Some(Approval::Never),
        ..ServerConfig::default()
    }
}

/// A run calls `NAME.echo`, the server is stopped by `stop` once that result is in, while
/// the model's next answer is still streaming, and that answer calls `NAME.add`: the model
/// reads the echo, then an error result for the add, and the run completes.
async fn a_run_goes_on_after_its_rmcp_server_is_stopped<F>(
    name: &str,
    config: ServerConfig,
    stop: impl FnOnce() -> F + Send + 'static,
) where
    F: Future<Output = ()> + Send,
{
    let dir = tempfile::tempdir().unwrap();
    let mcp = connect_all(&Config {
        servers: [(name.to_owned(), config)].into(),
    })
    .await
    .unwrap();
    let node = node(dir.path(), &mcp);
    let script = script(
        dir.path(),
        json!([
            {"tool_calls": [{"name": format!("{name}.echo"), "arguments": {"text": "from rmcp"}}]},
            // Streamed slowly: the server is gone before this answer's call is made.
            {"text": "Now the sum, please.", "chunk_delay_ms": 200,
             "tool_calls": [{"name": format!("{name}.add"), "arguments": {"a": 20, "b": 22}}]},
            {"text": "done without it"}
        ]),
    );
    let mut events = node.coordinator.subscribe();
    let stopper = tokio::spawn(async move {
        while let Ok(event) = events.recv().await {
            if event.kind == "tool.result" {
                break;
            }
        }
        stop().await;
    });
    let (_, state) = run(&node, &script, "use the rmcp server").await;
    stopper.await.unwrap();
    assert_eq!(
        state.status,
        RunStatus::Completed,
        "{:?}",
        state.stop_reason
    );
    assert_eq!(state.final_answer.as_deref(), Some("done without it"));
    let history = node
        .coordinator
        .store()
        .history(&state.session_id)
        .await
        .unwrap();
    let results: Vec<(&str, bool)> = history
        .iter()
        .filter(|m| m.role == Role::Tool)
        .map(|m| (m.content.as_str(), m.is_error))
        .collect();
    assert_eq!(results.len(), 2, "{results:?}");
    assert_eq!(results[0], ("from rmcp", false));
    assert!(
        results[1].1,
        "the call to a server that went away is an error: {results:?}"
    );
    assert!(
        results[1]
            .0
            .starts_with(&format!("server \"{name}\" is unavailable")),
        "{results:?}"
    );
    mcp.close().await;
    node.pool.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_over_stdio_goes_on_when_its_rmcp_server_is_killed_mid_run() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("server.pid");
    let config = rmcp_stdio_server_config(&pid_file);
    a_run_goes_on_after_its_rmcp_server_is_stopped("local", config, move || async move {
        let pid = std::fs::read_to_string(&pid_file).unwrap();
        let killed = std::process::Command::new("kill")
            .args(["-9", pid.trim()])
            .status()
            .unwrap();
        assert!(killed.success(), "kill -9 {pid}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_over_streamable_http_goes_on_when_its_rmcp_server_stops_mid_run() {
    let http = RmcpHttpServer::start().await;
    let config = ServerConfig {
        url: Some(http.url()),
        approval: Some(Approval::Never),
        ..ServerConfig::default()
    };
    a_run_goes_on_after_its_rmcp_server_is_stopped("remote", config, move || http.stop()).await;
}
