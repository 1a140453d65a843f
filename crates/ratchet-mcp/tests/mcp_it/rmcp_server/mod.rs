//! An MCP server written with rmcp's own server side, with two tools, `echo {text}` and
//! `add {a, b}`: served on stdin/stdout by a re-executed test binary (see `serve_stdio`),
//! or over streamable HTTP in-process (see `RmcpHttpServer`).
//!
//! `ServerHandler` is implemented by hand, without rmcp's macros and their schema derives.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorData,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{RoleServer, ServerHandler, ServiceExt};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// Set (to the path of a file) in a re-executed test binary's environment: it then serves
/// MCP on stdin/stdout, after writing its process id to that file.
pub const STDIO_PID_FILE: &str = "RATCHET_TEST_RMCP_STDIO_PID_FILE";

#[derive(Clone, Copy)]
pub struct EchoAdd;

fn tool(name: &'static str, description: &'static str, schema: Value) -> Tool {
    let Value::Object(schema) = schema else {
        unreachable!("a schema is an object")
    };
    Tool::new(name, description, schema)
}

fn text(result: String) -> CallToolResponse {
    CallToolResult::success(vec![ContentBlock::text(result)]).into()
}

impl ServerHandler for EchoAdd {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(vec![
            tool(
                "echo",
                "Echoes its text.",
                json!({"type": "object", "properties": {"text": {"type": "string"}},
                       "required": ["text"]}),
            ),
            tool(
                "add",
                "Adds two numbers.",
                json!({"type": "object",
                       "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                       "required": ["a", "b"]}),
            ),
        ]))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let arguments = request.arguments.unwrap_or_default();
        match request.name.as_ref() {
            "echo" => match arguments.get("text") {
                Some(Value::String(echoed)) => Ok(text(echoed.clone())),
                _ => Err(ErrorData::invalid_params("echo needs a text", None)),
            },
            "add" => match (arguments.get("a"), arguments.get("b")) {
                (Some(Value::Number(a)), Some(Value::Number(b))) => {
                    let sum = a.as_f64().unwrap_or(f64::NAN) + b.as_f64().unwrap_or(f64::NAN);
                    Ok(text(sum.to_string()))
                }
                _ => Err(ErrorData::invalid_params("add needs numbers a and b", None)),
            },
            other => Err(ErrorData::invalid_params(
                format!("no tool named {other:?}"),
                None,
            )),
        }
    }
}

/// Serves on stdin/stdout until the client goes, if `STDIO_PID_FILE` is set, and then ends
/// the process; returns at once otherwise.
///
/// A server once killed stays down: when the pid file already exists, the process exits
/// with an error before answering, so that the restart a client attempts after a kill
/// fails, as it would for a server that cannot come back.
pub fn serve_stdio_if_asked() {
    let Some(pid_file) = std::env::var_os(STDIO_PID_FILE) else {
        return;
    };
    let created = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&pid_file);
    let Ok(mut file) = created else {
        eprintln!("this server was killed once and stays down");
        std::process::exit(1);
    };
    std::io::Write::write_all(&mut file, std::process::id().to_string().as_bytes()).unwrap();
    drop(file);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let service = EchoAdd.serve(rmcp::transport::stdio()).await.unwrap();
        let _ = service.waiting().await;
    });
    // Before the test harness prints its summary on stdout.
    std::process::exit(0);
}

/// The server over streamable HTTP on a free local port, at `/mcp`.
pub struct RmcpHttpServer {
    pub addr: SocketAddr,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl RmcpHttpServer {
    pub async fn start() -> RmcpHttpServer {
        let stop = CancellationToken::new();
        let service = StreamableHttpService::new(
            || Ok(EchoAdd),
            Arc::new(LocalSessionManager::default()),
            StreamableHttpServerConfig::default()
                .with_sse_keep_alive(None)
                .with_cancellation_token(stop.child_token()),
        );
        let app = axum::Router::new().nest_service("/mcp", service);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = stop.clone().cancelled_owned();
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
                .unwrap();
        });
        RmcpHttpServer { addr, stop, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}/mcp", self.addr)
    }

    /// Ends the sessions, closes the listener and the open connections.
    pub async fn stop(self) {
        self.stop.cancel();
        let task = self.task;
        let abort = task.abort_handle();
        if tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .is_err()
        {
            abort.abort();
        }
    }
}
