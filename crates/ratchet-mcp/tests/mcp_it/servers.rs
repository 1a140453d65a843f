//! MCP servers' tools against real servers: a Python stdio server started as a process (and
//! killed by its own `crash` tool), and a streamable-HTTP server in this process.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ratchet_core::{ApprovalPolicy, ReplayPolicy, SessionId, ToolOutcome};
use ratchet_mcp::{Config, Error, McpTools, ServerConfig, ToolPolicy, connect_all};
use ratchet_tools::{Registry, Tool, ToolContext};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::http_server::HttpServer;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/stdio_server.py")
}

/// The Python server, logging what happens to `log`.
fn stdio(log: &Path) -> ServerConfig {
    ServerConfig {
        command: Some("python3".into()),
        args: vec![script().display().to_string()],
        env: [("MCP_TEST_LOG".to_owned(), log.display().to_string())].into(),
        ..ServerConfig::default()
    }
}

fn config(servers: impl IntoIterator<Item = (&'static str, ServerConfig)>) -> Config {
    Config {
        servers: servers
            .into_iter()
            .map(|(name, server)| (name.to_owned(), server))
            .collect(),
    }
}

fn context(cancel: CancellationToken) -> ToolContext {
    ToolContext {
        workspace: None,
        idempotency_key: "run_1#2#0".into(),
        cancel,
        session_id: SessionId::parse("ses_1").unwrap(),
        memory: None,
        input: None,
        traceparent: Some(TRACEPARENT.into()),
    }
}

/// The call span's trace context, as the engine gives it when traces are exported.
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn tool(tools: &McpTools, name: &str) -> Arc<dyn Tool> {
    tools
        .tools()
        .into_iter()
        .find(|t| t.name() == name)
        .unwrap_or_else(|| panic!("no tool {name}; have {:?}", tools.names()))
}

async fn call(tools: &McpTools, name: &str, arguments: Value) -> ToolOutcome {
    tool(tools, name)
        .call(arguments, &context(CancellationToken::new()))
        .await
}

/// Lines of the server's log.
fn log_lines(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

fn starts(log: &Path) -> usize {
    log_lines(log).iter().filter(|l| *l == "start").count()
}

/// Waits until `done` holds, failing the test after a few seconds.
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn ok(content: &str) -> ToolOutcome {
    ToolOutcome::ok(content)
}

#[tokio::test]
async fn stdio_tools_are_listed_from_every_page_and_named_after_their_server() {
    let dir = tempfile::tempdir().unwrap();
    let tools = connect_all(&config([("local", stdio(&dir.path().join("log")))]))
        .await
        .unwrap();
    // "bad name!" is skipped: no model could be given it.
    assert_eq!(
        tools.names(),
        [
            "local.echo",
            "local.add",
            "local.fail",
            "local.slow",
            "local.crash",
            "local.meta",
            "local.env",
            "local.mixed",
            "local.refuse"
        ]
    );
    let registry = Registry::new(
        [
            Registry::builtin_tools(ratchet_tools::DEFAULT_MAX_SNIPPET_BYTES),
            tools.tools(),
        ]
        .into_iter()
        .flatten()
        .collect(),
    )
    .unwrap();
    let specs = registry.specs();
    let spec = |name: &str| specs.iter().find(|s| s.name == name).unwrap().clone();
    let add = spec("local.add");
    assert_eq!(add.description, "Adds two integers.");
    assert_eq!(
        add.parameters,
        json!({"type": "object", "required": ["a", "b"],
               "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})
    );
    // Outside effects: never replayed, and a human approves each call, unless configured.
    assert_eq!(add.replay, ReplayPolicy::Never);
    assert_eq!(add.approval, ApprovalPolicy::Always);
    assert_eq!(
        spec("add").approval,
        ApprovalPolicy::Never,
        "built-ins unchanged"
    );
    // A tool without a description is described by its title.
    assert_eq!(spec("local.slow").description, "Sleeps, then answers");
    // The server's schema is what the registry checks arguments against.
    let err = registry
        .validate("local.add", &json!({"a": "one", "b": 2}))
        .err()
        .unwrap();
    assert!(err.contains("/a"), "{err}");
    let policies = tools.policies();
    assert_eq!(policies.len(), 9);
    assert_eq!(
        policies["local.echo"],
        ToolPolicy {
            replay: ReplayPolicy::Never,
            approval: ApprovalPolicy::Always
        }
    );
}

#[tokio::test]
async fn the_server_configuration_sets_every_tool_default() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = stdio(&dir.path().join("log"));
    server.replay = Some(ReplayPolicy::Keyed);
    server.approval = Some(ratchet_mcp::Approval::Never);
    let tools = connect_all(&config([("keyed", server)])).await.unwrap();
    let expected = ToolPolicy {
        replay: ReplayPolicy::Keyed,
        approval: ApprovalPolicy::Never,
    };
    assert!(tools.policies().values().all(|p| *p == expected));
    let echo = tool(&tools, "keyed.echo");
    assert_eq!(
        (echo.replay(), echo.approval()),
        (expected.replay, expected.approval)
    );
}

#[tokio::test]
async fn a_server_whose_tools_changed_is_listed_again_and_the_new_tools_are_given_to_watchers() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = stdio(&dir.path().join("log"));
    server
        .env
        .insert("MCP_TEST_MODE".into(), "tools_change".into());
    let tools = connect_all(&config([("local", server)])).await.unwrap();
    let before = tools.names();
    assert!(before.contains(&"local.add".to_owned()), "{before:?}");
    assert!(!before.contains(&"local.shout".to_owned()), "{before:?}");
    let add_before = tool(&tools, "local.add");
    let mut watch = tools.watch();

    // The server replaces `add` with `shout`, then sends `notifications/tools/list_changed`.
    assert_eq!(call(&tools, "local.evolve", json!({})).await, ok("evolved"));
    let changed = tokio::time::timeout(Duration::from_secs(10), watch.changed())
        .await
        .expect("the change reaches the watcher")
        .expect("the tools are still connected");
    let names: Vec<&str> = changed.iter().map(|t| t.name()).collect();
    assert!(names.contains(&"local.shout"), "{names:?}");
    assert!(!names.contains(&"local.add"), "{names:?}");
    assert_eq!(
        tools.names(),
        names,
        "what the watcher is given is what is listed now"
    );
    assert_eq!(tools.names().len(), before.len(), "one tool out, one in");
    assert_eq!(
        tool(&tools, "local.shout").parameters()["required"],
        json!(["text"])
    );
    assert_eq!(
        call(&tools, "local.shout", json!({"text": "hi"})).await,
        ok("HI")
    );
    // A tool a run was frozen with before the change is still callable, and the server
    // answers for it as it now stands.
    let outcome = add_before
        .call(json!({"a": 1, "b": 2}), &context(CancellationToken::new()))
        .await;
    assert!(outcome.is_error, "{outcome:?}");
    assert!(outcome.content.contains("unknown tool add"), "{outcome:?}");
    tools.close().await;
}

#[tokio::test]
async fn calls_become_outcomes_with_the_idempotency_key_in_meta() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = stdio(&dir.path().join("log"));
    server
        .env
        .insert("GREETING".into(), "hello from the config".into());
    let tools = connect_all(&config([("local", server)])).await.unwrap();
    assert_eq!(
        call(&tools, "local.echo", json!({"text": "hi"})).await,
        ok("hi")
    );
    assert_eq!(
        call(&tools, "local.add", json!({"a": 2, "b": 3})).await,
        ok("5")
    );
    assert_eq!(
        call(&tools, "local.fail", json!({})).await,
        ToolOutcome::error("it failed on purpose")
    );
    assert_eq!(
        call(&tools, "local.refuse", json!({})).await,
        ToolOutcome::error("server \"local\" refused the call: not today (code -32000)")
    );
    let mixed = call(&tools, "local.mixed", json!({})).await;
    assert!(!mixed.is_error);
    let lines: Vec<&str> = mixed.content.lines().collect();
    assert_eq!(
        lines[..2],
        ["a picture:", "[image image/png, about 9 bytes]"]
    );
    assert_eq!(
        serde_json::from_str::<Value>(lines[2]).unwrap(),
        json!({"width": 1, "height": 1})
    );
    // The idempotency key travels in `_meta`, for servers that deduplicate, and so does the
    // call's trace context.
    let meta = call(&tools, "local.meta", json!({})).await;
    let meta: Value = serde_json::from_str(&meta.content).unwrap();
    assert_eq!(meta["ratchet/idempotency_key"], "run_1#2#0", "{meta}");
    assert_eq!(meta["traceparent"], TRACEPARENT, "{meta}");
    // The configured variables are set; this process's own are not passed on.
    assert_eq!(
        call(&tools, "local.env", json!({"name": "GREETING"})).await,
        ok("hello from the config")
    );
    assert!(std::env::var("CARGO_MANIFEST_DIR").is_ok());
    assert_eq!(
        call(&tools, "local.env", json!({"name": "CARGO_MANIFEST_DIR"})).await,
        ok("<unset>")
    );
    assert_ne!(
        call(&tools, "local.env", json!({"name": "PATH"})).await,
        ok("<unset>")
    );
    let not_an_object = call(&tools, "local.echo", json!([1])).await;
    assert!(not_an_object.is_error, "{not_an_object:?}");
}

#[tokio::test]
async fn a_call_over_its_timeout_has_an_unknown_outcome_and_the_server_is_told_to_stop() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let mut server = stdio(&log);
    server.timeout_ms = Some(300);
    let tools = connect_all(&config([("local", server)])).await.unwrap();
    let started = Instant::now();
    let outcome = call(&tools, "local.slow", json!({"ms": 10_000})).await;
    assert_eq!(
        outcome,
        ToolOutcome::unknown("server \"local\" sent no answer within 300 ms")
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    eventually("the server saw the cancellation", || {
        log_lines(&log).iter().any(|l| l.starts_with("cancelled "))
    })
    .await;
    // The same process answers the next call.
    assert_eq!(
        call(&tools, "local.echo", json!({"text": "still here"})).await,
        ok("still here")
    );
    assert_eq!(starts(&log), 1);
}

#[tokio::test]
async fn cancelling_a_call_returns_at_once_and_cancels_it_on_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let tools = connect_all(&config([("local", stdio(&log))]))
        .await
        .unwrap();
    let slow = tool(&tools, "local.slow");
    let cancel = CancellationToken::new();
    let context = context(cancel.clone());
    let call = tokio::spawn(async move { slow.call(json!({"ms": 30_000}), &context).await });
    eventually("the slow call runs", || {
        log_lines(&log)
            .iter()
            .any(|l| l.starts_with("slow started"))
    })
    .await;
    let cancelled_at = Instant::now();
    cancel.cancel();
    let outcome = call.await.unwrap();
    let took = cancelled_at.elapsed();
    assert_eq!(
        outcome,
        ToolOutcome::unknown("cancelled while the server had the call")
    );
    assert!(took < Duration::from_millis(200), "took {took:?}");
    // The request id the server was told to cancel is the one it started.
    let lines = log_lines(&log);
    let started = lines
        .iter()
        .find_map(|l| l.strip_prefix("slow started "))
        .unwrap()
        .to_owned();
    eventually("the server saw the cancellation", || {
        log_lines(&log).contains(&format!("cancelled {started}"))
    })
    .await;
}

#[tokio::test]
async fn a_crash_mid_call_has_an_unknown_outcome_and_the_next_call_restarts_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let tools = connect_all(&config([("local", stdio(&log))]))
        .await
        .unwrap();
    let outcome = call(&tools, "local.crash", json!({})).await;
    assert!(
        outcome.unknown,
        "the server had the call when it died: {outcome:?}"
    );
    assert_eq!(
        outcome.content,
        "server \"local\": the connection closed after the call was sent"
    );
    assert_eq!(starts(&log), 1);
    assert_eq!(
        call(&tools, "local.echo", json!({"text": "again"})).await,
        ok("again")
    );
    assert_eq!(starts(&log), 2, "restarted once");
    // And again: a server that works between crashes is restarted each time without waiting.
    assert!(call(&tools, "local.crash", json!({})).await.unknown);
    assert_eq!(
        call(&tools, "local.add", json!({"a": 1, "b": 1})).await,
        ok("2")
    );
    assert_eq!(starts(&log), 3);
}

#[tokio::test]
async fn a_server_that_dies_at_every_restart_is_not_restarted_in_a_tight_loop() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let mut server = stdio(&log);
    server
        .env
        .insert("MCP_TEST_MODE".into(), "die_after_first_start".into());
    let tools = connect_all(&config([("flaky", server)])).await.unwrap();
    assert!(call(&tools, "flaky.crash", json!({})).await.is_error);
    // The first restart is immediate; this server dies at once.
    let before_the_failure = Instant::now();
    let outcome = call(&tools, "flaky.echo", json!({"text": "x"})).await;
    assert!(
        outcome.content.starts_with(
            "server \"flaky\" is unavailable: handshake failed: the server closed the connection \
             before it answered `initialize`"
        ),
        "{outcome:?}"
    );
    assert_eq!(starts(&log), 2);
    // Within the backoff, calls fail at once without starting anything.
    let outcome = call(&tools, "flaky.echo", json!({"text": "x"})).await;
    assert!(
        outcome.content.contains("next restart attempt in"),
        "{outcome:?}"
    );
    // Past it, one more attempt — and only one per backoff period.
    loop {
        let outcome = call(&tools, "flaky.echo", json!({"text": "x"})).await;
        assert!(outcome.is_error);
        if starts(&log) == 3 {
            break;
        }
        assert_eq!(starts(&log), 2);
        assert!(
            before_the_failure.elapsed() < Duration::from_secs(5),
            "never restarted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        before_the_failure.elapsed() >= Duration::from_millis(500),
        "restarted after {:?}",
        before_the_failure.elapsed()
    );
    let outcome = call(&tools, "flaky.echo", json!({"text": "x"})).await;
    assert!(
        outcome.content.contains("next restart attempt in"),
        "{outcome:?}"
    );
    assert_eq!(starts(&log), 3);
}

fn start_error(result: Result<McpTools, Error>) -> String {
    match result {
        Ok(tools) => panic!("connected: {:?}", tools.names()),
        Err(error) => error.to_string(),
    }
}

#[tokio::test]
async fn a_server_that_cannot_start_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let good = stdio(&dir.path().join("good.log"));
    let missing = ServerConfig {
        command: Some("/nonexistent/mcp-server".into()),
        ..ServerConfig::default()
    };
    let error =
        start_error(connect_all(&config([("good", good.clone()), ("missing", missing)])).await);
    assert!(
        error.starts_with(
            "MCP server \"missing\" cannot start: cannot run \"/nonexistent/mcp-server\": "
        ),
        "{error}"
    );

    let mut broken = stdio(&dir.path().join("broken.log"));
    broken
        .env
        .insert("MCP_TEST_MODE".into(), "fail_start".into());
    let error = start_error(connect_all(&config([("broken", broken)])).await);
    assert_eq!(
        error,
        "MCP server \"broken\" cannot start: handshake failed: the server closed the connection \
         before it answered `initialize`; its stderr ended with: cannot open the database: \
         permission denied"
    );

    let silent = ServerConfig {
        command: Some("sleep".into()),
        args: vec!["30".into()],
        startup_timeout_ms: Some(300),
        ..ServerConfig::default()
    };
    let started = Instant::now();
    let error = start_error(connect_all(&config([("silent", silent)])).await);
    assert_eq!(
        error,
        "MCP server \"silent\" cannot start: no answer within the startup timeout (300 ms)"
    );
    assert!(started.elapsed() < Duration::from_secs(3));

    let unreachable = ServerConfig {
        url: Some("http://127.0.0.1:1/mcp".into()),
        ..ServerConfig::default()
    };
    let error = start_error(connect_all(&config([("remote", unreachable)])).await);
    assert!(
        error.starts_with(
            "MCP server \"remote\" cannot start: handshake with http://127.0.0.1:1/mcp failed"
        ),
        "{error}"
    );
    assert!(error.contains("Connection refused"), "{error}");
    assert!(!error.contains("rmcp::"), "no Rust type names: {error}");

    let invalid = ServerConfig {
        command: Some("x".into()),
        url: Some("http://h".into()),
        ..ServerConfig::default()
    };
    let error = start_error(connect_all(&config([("both", invalid)])).await);
    assert_eq!(
        error,
        "invalid MCP configuration: mcp.servers.both: give exactly one of `command` (stdio) or `url` (HTTP), not both"
    );
}

fn http(url: String, token: &str) -> ServerConfig {
    ServerConfig {
        url: Some(url),
        headers: BTreeMap::from([("Authorization".to_owned(), format!("Bearer {token}").into())]),
        ..ServerConfig::default()
    }
}

#[tokio::test]
async fn http_tools_are_called_over_streamable_http_with_the_configured_headers() {
    let server = HttpServer::start("s3cret").await;
    let tools = connect_all(&config([("remote", http(server.url(), "s3cret"))]))
        .await
        .unwrap();
    assert_eq!(
        tools.names(),
        ["remote.echo", "remote.add", "remote.fail", "remote.slow"]
    );
    let echo = tool(&tools, "remote.echo");
    assert_eq!(echo.description(), "Echoes its text.");
    assert_eq!(echo.parameters()["required"], json!(["text"]));
    // `echo` is answered as an event stream, `add` and `fail` as JSON bodies.
    assert_eq!(
        call(&tools, "remote.echo", json!({"text": "over http"})).await,
        ok("over http")
    );
    assert_eq!(
        call(&tools, "remote.add", json!({"a": 40, "b": 2})).await,
        ok("42")
    );
    assert_eq!(
        call(&tools, "remote.fail", json!({})).await,
        ToolOutcome::error("it failed on purpose")
    );
    assert_eq!(
        server.seen.lock().unwrap().metas[0]["ratchet/idempotency_key"],
        "run_1#2#0"
    );

    let slow = tool(&tools, "remote.slow");
    let cancel = CancellationToken::new();
    let context = context(cancel.clone());
    let call = tokio::spawn(async move { slow.call(json!({"ms": 30_000}), &context).await });
    eventually("the slow call reaches the server", || {
        server.seen.lock().unwrap().metas.len() == 4
    })
    .await;
    let cancelled_at = Instant::now();
    cancel.cancel();
    assert_eq!(
        call.await.unwrap(),
        ToolOutcome::unknown("cancelled while the server had the call")
    );
    assert!(cancelled_at.elapsed() < Duration::from_millis(200));
    eventually("the server saw the cancellation", || {
        !server.seen.lock().unwrap().cancelled.is_empty()
    })
    .await;

    let error = start_error(connect_all(&config([("remote", http(server.url(), "wrong"))])).await);
    assert!(
        error.starts_with("MCP server \"remote\" cannot start: handshake with"),
        "{error}"
    );
    assert!(error.ends_with("HTTP 401 Unauthorized"), "{error}");
}

#[tokio::test]
async fn an_http_server_that_went_away_is_an_error_outcome_then_reconnected() {
    let server = HttpServer::start("t").await;
    let addr = server.addr;
    let tools = connect_all(&config([("remote", http(server.url(), "t"))]))
        .await
        .unwrap();
    assert_eq!(
        call(&tools, "remote.add", json!({"a": 1, "b": 2})).await,
        ok("3")
    );
    server.stop().await;
    let outcome = call(&tools, "remote.add", json!({"a": 1, "b": 2})).await;
    assert!(
        outcome
            .content
            .starts_with("server \"remote\" is unavailable: ")
            && outcome.content.contains("Connection refused")
            && !outcome.content.contains("rmcp::"),
        "{outcome:?}"
    );
    // Back on the same address, without the old session: a new one is made.
    let server = HttpServer::start_on(addr, "t").await;
    assert_eq!(
        call(&tools, "remote.add", json!({"a": 2, "b": 2})).await,
        ok("4")
    );
    assert_eq!(server.seen.lock().unwrap().metas.len(), 1);
}
