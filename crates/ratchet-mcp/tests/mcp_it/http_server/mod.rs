//! A minimal streamable-HTTP MCP server for the tests: one axum handler that speaks the
//! protocol's JSON-RPC over POST, answering with `application/json` bodies, and with a
//! one-event `text/event-stream` body for `echo`, so that both answer forms are exercised.
//!
//! The tests also run against a server written with rmcp's own server side
//! (`rmcp_server/mod.rs`); this handler is a second, independent implementation that
//! does not check rmcp's client against rmcp itself, and lets the tests see and shape the
//! raw exchanges (sessions, bearer tokens, `_meta`, cancellations), like the Python stdio
//! server next to it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

/// What the server saw, for the tests to check.
#[derive(Default)]
pub struct Seen {
    /// `params` of every `notifications/cancelled`.
    pub cancelled: Vec<Value>,
    /// `params._meta` of every `tools/call`.
    pub metas: Vec<Value>,
}

struct Shared {
    token: String,
    next_session: AtomicU64,
    sessions: Mutex<Vec<String>>,
    seen: Arc<Mutex<Seen>>,
}

pub struct HttpServer {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Seen>>,
    task: tokio::task::JoinHandle<()>,
}

impl HttpServer {
    /// Serves on a free local port; every request must carry `Authorization: Bearer TOKEN`.
    pub async fn start(token: &str) -> HttpServer {
        HttpServer::start_on("127.0.0.1:0".parse().unwrap(), token).await
    }

    pub async fn start_on(addr: SocketAddr, token: &str) -> HttpServer {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let shared = Arc::new(Shared {
            token: format!("Bearer {token}"),
            next_session: AtomicU64::new(1),
            sessions: Mutex::new(Vec::new()),
            seen: Arc::clone(&seen),
        });
        let app = Router::new()
            .route(
                "/mcp",
                post(handle)
                    // No stream for server-initiated messages is offered.
                    .get(|| async { StatusCode::METHOD_NOT_ALLOWED })
                    .delete(|| async { StatusCode::OK }),
            )
            .with_state(shared);
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        HttpServer { addr, seen, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}/mcp", self.addr)
    }

    /// Stops serving at once, like a server that went away.
    pub async fn stop(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

fn tools() -> Value {
    let object = |properties: Value, required: Value| json!({"type": "object", "properties": properties, "required": required});
    json!([
        {"name": "echo", "description": "Echoes its text.",
         "inputSchema": object(json!({"text": {"type": "string"}}), json!(["text"]))},
        {"name": "add", "description": "Adds two integers.",
         "inputSchema": object(json!({"a": {"type": "integer"}, "b": {"type": "integer"}}), json!(["a", "b"]))},
        {"name": "fail", "description": "Always fails.", "inputSchema": object(json!({}), json!([]))},
        {"name": "slow", "description": "Sleeps, then answers.",
         "inputSchema": object(json!({"ms": {"type": "integer"}}), json!(["ms"]))},
    ])
}

fn json_response(body: Value, session: Option<&str>) -> Response {
    let mut response = (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response();
    if let Some(session) = session {
        response
            .headers_mut()
            .insert("mcp-session-id", session.parse().unwrap());
    }
    response
}

fn sse_response(body: Value) -> Response {
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        format!("event: message\ndata: {body}\n\n"),
    )
        .into_response()
}

fn text(value: &str, is_error: bool) -> Value {
    json!({"content": [{"type": "text", "text": value}], "isError": is_error})
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    axum::Json(message): axum::Json<Value>,
) -> Response {
    if headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        != Some(&shared.token)
    {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    let method = message["method"].as_str().unwrap_or_default();
    let params = &message["params"];
    let Some(id) = message.get("id").cloned() else {
        // A notification (or a client's response): accepted, nothing to answer.
        if method == "notifications/cancelled" {
            shared.seen.lock().unwrap().cancelled.push(params.clone());
        }
        return StatusCode::ACCEPTED.into_response();
    };
    let answer = |result: Value| json!({"jsonrpc": "2.0", "id": id, "result": result});
    if method == "initialize" {
        let session = format!(
            "session-{}",
            shared.next_session.fetch_add(1, Ordering::Relaxed)
        );
        shared.sessions.lock().unwrap().push(session.clone());
        let result = answer(json!({
            "protocolVersion": params["protocolVersion"].as_str().unwrap_or("2025-11-25"),
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "ratchet-test-http", "version": "1"},
        }));
        return json_response(result, Some(&session));
    }
    let session = headers
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if !shared.sessions.lock().unwrap().iter().any(|s| s == session) {
        return StatusCode::NOT_FOUND.into_response();
    }
    match method {
        "ping" => json_response(answer(json!({})), None),
        "tools/list" => json_response(answer(json!({"tools": tools()})), None),
        "tools/call" => {
            shared
                .seen
                .lock()
                .unwrap()
                .metas
                .push(params["_meta"].clone());
            let arguments = &params["arguments"];
            match params["name"].as_str().unwrap_or_default() {
                "echo" => sse_response(answer(text(
                    arguments["text"].as_str().unwrap_or_default(),
                    false,
                ))),
                "add" => {
                    let sum =
                        arguments["a"].as_i64().unwrap_or(0) + arguments["b"].as_i64().unwrap_or(0);
                    json_response(answer(text(&sum.to_string(), false)), None)
                }
                "fail" => json_response(answer(text("it failed on purpose", true)), None),
                "slow" => {
                    let ms = arguments["ms"].as_u64().unwrap_or(0);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    json_response(answer(text(&format!("slept {ms} ms"), false)), None)
                }
                other => json_response(
                    json!({"jsonrpc": "2.0", "id": id,
                           "error": {"code": -32602, "message": format!("unknown tool {other}")}}),
                    None,
                ),
            }
        }
        other => json_response(
            json!({"jsonrpc": "2.0", "id": id,
                   "error": {"code": -32601, "message": format!("method not found: {other}")}}),
            None,
        ),
    }
}
