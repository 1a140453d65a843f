//! One MCP server's connection: made when the runtime starts, shared by every call of the
//! server's tools, and made again (the process restarted, the HTTP session renewed) after
//! it broke — never in a tight loop: a connection that keeps failing waits longer each time.
//! A server's `notifications/tools/list_changed` is passed on, for its tools to be listed
//! again.
//!
//! Whatever a server does (exit mid-call, never answer, answer garbage), a call ends with an
//! outcome within its timeout or as soon as it is cancelled: an error when the server never
//! had the request, *unknown* when it may have (a timeout, a connection lost after sending),
//! for the engine to settle by the tool's replay policy. Nothing here
//! panics on a server's behalf or returns an error that would fail a step.

use std::collections::VecDeque;
use std::process::Stdio;
use std::sync::{Arc, Mutex as SyncMutex};
use std::time::Duration;

use ratchet_core::ToolOutcome;
use ratchet_tools::ToolContext;
use rmcp::ClientHandler;
use rmcp::model::{
    CallToolRequestParams, ClientCapabilities, ClientConfig, Implementation, JsonObject,
    MetaObject, PaginatedRequestParams, ProtocolVersion, RequestMetaObject,
};
use rmcp::service::{
    ClientInitializeError, NotificationContext, RoleClient, RunningService, ServiceError,
    ServiceExt,
};
use rmcp::transport::streamable_http_client::{
    StreamableHttpClientTransportConfig, StreamableHttpError,
};
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::ChildStderr;
use tokio::sync::{Mutex, Notify};
use tokio::time::Instant;

use crate::config::{Checked, Transport};
use crate::content;

/// The `_meta` key that carries a call's idempotency key (`{run}#{step}#{slot}`, the same on
/// every attempt), so that a server configured `replay = "keyed"` can deduplicate.
pub const IDEMPOTENCY_KEY_META: &str = "ratchet/idempotency_key";
/// The `_meta` key of a call's W3C trace context, when traces are exported.
pub const TRACEPARENT_META: &str = "traceparent";

/// The wait before restarting a server whose last connection also failed; it doubles with
/// every further failure, up to `MAX_BACKOFF`. The first restart after a break is immediate.
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Tool lists longer than this many pages are taken for a server that loops.
const MAX_PAGES: usize = 100;
/// Lines of a server's stderr kept for error messages (every line is also logged).
const STDERR_LINES: usize = 8;
/// Variables a stdio server inherits from this process; everything else (API keys of this
/// runtime above all) stays here. The official SDKs pass the same set.
const INHERITED_ENV: &[&str] = &[
    "HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER", "LANG", "TMPDIR",
];

/// A tool as a server lists it.
#[derive(Debug, Clone)]
pub(crate) struct RemoteTool {
    pub name: String,
    pub description: String,
    pub input_schema: Value,
}

pub(crate) struct Server {
    config: Checked,
    /// Held only for moments, never across an await.
    state: SyncMutex<State>,
    /// Held while a new connection is made, so that calls waiting for one make one between
    /// them; calls on a live connection never wait for it.
    connecting: Mutex<()>,
    /// Told when the server says its tools changed, on any of its connections.
    tools_changed: Arc<Notify>,
}

/// Ratchet's side of a connection: it answers nothing a server may ask (no sampling, roots
/// or elicitation) and listens for one notification, that the server's tools changed.
struct Handler {
    tools_changed: Arc<Notify>,
}

impl ClientHandler for Handler {
    fn get_info(&self) -> ClientConfig {
        client_config()
    }

    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.tools_changed.notify_one();
    }
}

#[derive(Default)]
struct State {
    live: Option<Arc<Connection>>,
    /// Connections that broke, and connection attempts that failed, since a call last got
    /// an answer.
    failures: u32,
    /// No new connection is attempted before this instant.
    retry_at: Option<Instant>,
    last_error: String,
}

struct Connection {
    service: RunningService<RoleClient, Handler>,
    stderr: Arc<Tail>,
}

impl Connection {
    /// Closed by us, or ended by itself (a process that exited, a transport that failed).
    fn is_closed(&self) -> bool {
        self.service.is_closed() || self.service.peer().is_transport_closed()
    }
}

impl Server {
    pub(crate) fn new(config: Checked) -> Server {
        Server {
            config,
            state: SyncMutex::new(State::default()),
            connecting: Mutex::new(()),
            tools_changed: Arc::new(Notify::new()),
        }
    }

    /// Returns once the server has said its tools changed since this was last awaited (at
    /// once if it said so meanwhile: a notification is never lost, several count as one).
    pub(crate) async fn tools_changed(&self) {
        self.tools_changed.notified().await;
    }

    /// Lists the server's tools again, on its connection (made again if it broke), within
    /// the startup timeout.
    pub(crate) async fn list(&self) -> Result<Vec<RemoteTool>, String> {
        let work = async {
            let connection = self.connection().await?;
            list_tools(&connection.service).await
        };
        tokio::time::timeout(self.config.startup_timeout, work)
            .await
            .unwrap_or_else(|_| Err(self.no_answer()))
    }

    pub(crate) fn config(&self) -> &Checked {
        &self.config
    }

    /// Connects and lists the server's tools, within the startup timeout: what a runtime
    /// checks before it starts. The error says why, with the end of a process's stderr.
    pub(crate) async fn start(&self) -> Result<Vec<RemoteTool>, String> {
        let tail = Arc::new(Tail::default());
        let work = async {
            let connection = self.connect(&tail).await?;
            let tools = list_tools(&connection.service).await?;
            Ok::<_, String>((connection, tools))
        };
        let started = tokio::time::timeout(self.config.startup_timeout, work).await;
        match started {
            Ok(Ok((connection, tools))) => {
                self.state().live = Some(Arc::new(connection));
                Ok(tools)
            }
            Ok(Err(reason)) => Err(tail.explain(reason).await),
            Err(_) => Err(tail.explain(self.no_answer()).await),
        }
    }

    /// Runs one `tools/call`. Cancelling `cancel` abandons the request at once (the server
    /// is sent `notifications/cancelled`).
    pub(crate) async fn call(
        &self,
        tool: &str,
        arguments: Option<JsonObject>,
        context: &ToolContext,
    ) -> ToolOutcome {
        tokio::select! {
            biased;
            () = context.cancel.cancelled() => ToolOutcome::unknown("cancelled while the server had the call"),
            outcome = self.call_until_done(tool, arguments, context) => outcome,
        }
    }

    async fn call_until_done(
        &self,
        tool: &str,
        arguments: Option<JsonObject>,
        context: &ToolContext,
    ) -> ToolOutcome {
        let connection = match self.connection().await {
            Ok(connection) => connection,
            Err(reason) => return self.unavailable(&reason),
        };
        let mut params = CallToolRequestParams::new(tool.to_owned());
        params.arguments = arguments;
        let mut meta = MetaObject::new();
        meta.insert(
            IDEMPOTENCY_KEY_META.to_owned(),
            Value::String(context.idempotency_key.clone()),
        );
        // MCP carries trace context in a request's `_meta`, on every transport.
        if let Some(traceparent) = &context.traceparent {
            meta.insert(
                TRACEPARENT_META.to_owned(),
                Value::String(traceparent.clone()),
            );
        }
        params.meta = Some(RequestMetaObject(meta));
        // Dropping the request future (timeout or cancellation) makes rmcp send
        // `notifications/cancelled` for it.
        let timeout = self.config.call_timeout;
        let answer = tokio::time::timeout(timeout, connection.service.peer().call_tool(params));
        // From here on the request may have reached the server: a timeout or a lost
        // connection leaves its effect unknown, never a plain error.
        match answer.await {
            Err(_) => ToolOutcome::unknown(format!(
                "server {:?} sent no answer within {}",
                self.config.name,
                show(timeout)
            )),
            Ok(Ok(result)) => {
                self.answered();
                content::outcome(&result)
            }
            Ok(Err(ServiceError::McpError(error))) => {
                self.answered();
                ToolOutcome::error(format!(
                    "server {:?} refused the call: {} (code {})",
                    self.config.name, error.message, error.code.0
                ))
            }
            // The request could not be written: the server never had it.
            Ok(Err(ServiceError::TransportSend(error))) => {
                let reason = with_causes(error.error.as_ref());
                self.broke(&connection, reason.clone());
                self.unavailable(&reason)
            }
            Ok(Err(error)) => {
                let (reason, broken) = match &error {
                    ServiceError::TransportClosed => ("the connection closed".to_owned(), true),
                    other => (other.to_string(), connection.is_closed()),
                };
                if broken {
                    self.broke(&connection, reason.clone());
                    ToolOutcome::unknown(format!(
                        "server {:?}: {reason} after the call was sent",
                        self.config.name
                    ))
                } else {
                    ToolOutcome::error(format!("server {:?}: {reason}", self.config.name))
                }
            }
        }
    }

    /// Ends the connection (a stdio server's process is killed if it does not exit).
    pub(crate) async fn close(&self) {
        let live = self.state().live.take();
        if let Some(connection) = live {
            connection.service.cancellation_token().cancel();
        }
    }

    /// The live connection, or a new one once the backoff allows.
    async fn connection(&self) -> Result<Arc<Connection>, String> {
        if let Some(live) = self.live() {
            return Ok(live);
        }
        let _connecting = self.connecting.lock().await;
        // Another call may have connected while this one waited.
        if let Some(live) = self.live() {
            return Ok(live);
        }
        let (retry_at, last_error) = {
            let state = self.state();
            (state.retry_at, state.last_error.clone())
        };
        if let Some(at) = retry_at {
            let now = Instant::now();
            if now < at {
                return Err(format!(
                    "{last_error}; next restart attempt in {}",
                    show(at - now)
                ));
            }
        }
        tracing::info!(server = %self.config.name, "connecting to the MCP server again");
        let tail = Arc::new(Tail::default());
        let connected =
            tokio::time::timeout(self.config.startup_timeout, self.connect(&tail)).await;
        let mut state = self.state();
        match connected {
            Ok(Ok(connection)) => {
                let connection = Arc::new(connection);
                state.live = Some(Arc::clone(&connection));
                state.retry_at = None;
                Ok(connection)
            }
            Ok(Err(reason)) => Err(self.record_failure(&mut state, &tail, reason)),
            Err(_) => Err(self.record_failure(&mut state, &tail, self.no_answer())),
        }
    }

    /// The connection in use, unless it has closed (then it is recorded as broken).
    fn live(&self) -> Option<Arc<Connection>> {
        let mut state = self.state();
        let live = Arc::clone(state.live.as_ref()?);
        if !live.is_closed() {
            return Some(live);
        }
        self.record_break(&mut state, &live, "the connection closed".to_owned());
        None
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A call got an answer: the server works, so the next break restarts it at once.
    fn answered(&self) {
        let mut state = self.state();
        state.failures = 0;
        state.retry_at = None;
    }

    fn broke(&self, connection: &Arc<Connection>, reason: String) {
        self.record_break(&mut self.state(), connection, reason);
    }

    /// Forgets a broken connection (unless another call already replaced it).
    fn record_break(&self, state: &mut State, connection: &Arc<Connection>, reason: String) {
        let current = state
            .live
            .as_ref()
            .is_some_and(|live| Arc::ptr_eq(live, connection));
        if !current {
            return;
        }
        connection.service.cancellation_token().cancel();
        state.live = None;
        self.record_failure(state, &connection.stderr, reason);
    }

    /// Remembers why the server is down and when it may be tried again; the log gets the
    /// end of its stderr too (the model is only told the reason).
    fn record_failure(&self, state: &mut State, stderr: &Arc<Tail>, reason: String) -> String {
        state.failures += 1;
        let wait = backoff(state.failures);
        state.retry_at = Some(Instant::now() + wait);
        state.last_error.clone_from(&reason);
        let (server, stderr, logged) =
            (self.config.name.clone(), Arc::clone(stderr), reason.clone());
        tokio::spawn(async move {
            let detail = stderr.explain(logged).await;
            tracing::warn!(%server, reason = %detail, retry_in = ?wait, "MCP server is down");
        });
        reason
    }

    fn unavailable(&self, reason: &str) -> ToolOutcome {
        ToolOutcome::error(format!(
            "server {:?} is unavailable: {reason}",
            self.config.name
        ))
    }

    fn no_answer(&self) -> String {
        format!(
            "no answer within the startup timeout ({})",
            show(self.config.startup_timeout)
        )
    }

    /// Starts the process or opens the HTTP session, and makes the MCP handshake.
    async fn connect(&self, tail: &Arc<Tail>) -> Result<Connection, String> {
        let handler = Handler {
            tools_changed: Arc::clone(&self.tools_changed),
        };
        let service = match &self.config.transport {
            Transport::Stdio { command, args, env } => {
                let mut process = tokio::process::Command::new(command);
                process.args(args).env_clear();
                for key in INHERITED_ENV {
                    if let Some(value) = std::env::var_os(key) {
                        process.env(key, value);
                    }
                }
                process.envs(env);
                let mut wrapped = process_wrap::tokio::CommandWrap::from(process);
                wrapped.wrap(process_wrap::tokio::KillOnDrop);
                // Its own process group: a server's children (`npx` starts node) go when it
                // is killed, and a terminal's Ctrl-C reaches Ratchet, which stops it, first.
                #[cfg(unix)]
                wrapped.wrap(process_wrap::tokio::ProcessGroup::leader());
                let (transport, stderr) = TokioChildProcess::builder(wrapped)
                    .stderr(Stdio::piped())
                    .spawn()
                    .map_err(|e| format!("cannot run {command:?}: {e}"))?;
                if let Some(stderr) = stderr {
                    tail.follow(self.config.name.clone(), stderr);
                }
                handler
                    .serve(transport)
                    .await
                    .map_err(|e| format!("handshake failed: {}", handshake_error(&e)))?
            }
            Transport::Http { url, headers } => {
                let config = StreamableHttpClientTransportConfig::with_uri(url.as_str())
                    .custom_headers(headers.iter().cloned().collect());
                let transport = StreamableHttpClientTransport::from_config(config);
                handler
                    .serve(transport)
                    .await
                    .map_err(|e| format!("handshake with {url} failed: {}", handshake_error(&e)))?
            }
        };
        Ok(Connection {
            service,
            stderr: Arc::clone(tail),
        })
    }
}

/// Ratchet as an MCP client: the `initialize` handshake of the newest revision that has one,
/// and no client capabilities (no sampling, roots or elicitation for servers to use).
fn client_config() -> ClientConfig {
    let mut config = ClientConfig::new(
        ClientCapabilities::default(),
        Implementation::new("ratchet", env!("CARGO_PKG_VERSION")),
    );
    config.protocol_version = ProtocolVersion::LATEST_WITH_INITIALIZE;
    config
}

/// Every page of `tools/list`.
async fn list_tools(
    service: &RunningService<RoleClient, Handler>,
) -> Result<Vec<RemoteTool>, String> {
    let mut tools = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..MAX_PAGES {
        let params = cursor
            .clone()
            .map(|cursor| PaginatedRequestParams::default().with_cursor(Some(cursor)));
        let page = service
            .peer()
            .list_tools(params)
            .await
            .map_err(|e| format!("tools/list failed: {e}"))?;
        for tool in page.tools {
            let description = tool
                .description
                .map(|d| d.into_owned())
                .or(tool.title)
                .unwrap_or_default();
            tools.push(RemoteTool {
                name: tool.name.into_owned(),
                description,
                input_schema: Value::Object((*tool.input_schema).clone()),
            });
        }
        match page.next_cursor {
            Some(next) if Some(&next) == cursor.as_ref() => {
                return Err(format!("tools/list returned the cursor {next:?} twice"));
            }
            Some(next) => cursor = Some(next),
            None => return Ok(tools),
        }
    }
    Err(format!("tools/list has more than {MAX_PAGES} pages"))
}

/// Why a handshake failed, in words: rmcp's own messages name Rust types.
fn handshake_error(error: &ClientInitializeError) -> String {
    match error {
        ClientInitializeError::ConnectionClosed(_) => {
            "the server closed the connection before it answered `initialize`".to_owned()
        }
        ClientInitializeError::TransportError { error, .. } => with_causes(error.error.as_ref()),
        other => other.to_string(),
    }
}

/// An error followed by those of its causes that add something (`a: b: c`).
fn with_causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = String::new();
    let mut next = Some(error);
    while let Some(current) = next {
        // rmcp's HTTP error holds reqwest's without naming it as its source.
        if let Some(StreamableHttpError::Client(inner)) =
            current.downcast_ref::<StreamableHttpError<reqwest::Error>>()
        {
            next = Some(inner);
            continue;
        }
        // Some messages end in `: ` when the body they quote is empty.
        let more = current.to_string().trim_end_matches([':', ' ']).to_owned();
        if text.is_empty() {
            text = more;
        } else if !text.contains(&more) {
            text = format!("{text}: {more}");
        }
        next = current.source();
    }
    text
}

fn backoff(failures: u32) -> Duration {
    match failures {
        0 | 1 => Duration::ZERO,
        n => FIRST_BACKOFF
            .saturating_mul(1 << (n - 2).min(16))
            .min(MAX_BACKOFF),
    }
}

fn show(duration: Duration) -> String {
    let ms = duration.as_millis();
    if ms < 10_000 {
        format!("{ms} ms")
    } else {
        format!("{:.0} s", duration.as_secs_f64())
    }
}

/// The last lines a server process wrote on stderr (its log), kept to explain failures.
#[derive(Default)]
struct Tail {
    lines: SyncMutex<VecDeque<String>>,
    reader: SyncMutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Tail {
    fn follow(self: &Arc<Self>, server: String, stderr: ChildStderr) {
        let tail = Arc::clone(self);
        let reader = tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                tracing::debug!(server = %server, "{line}");
                let mut kept = tail.lines.lock().unwrap_or_else(|e| e.into_inner());
                if kept.len() == STDERR_LINES {
                    kept.pop_front();
                }
                kept.push_back(line.chars().take(300).collect());
            }
        });
        *self.reader.lock().unwrap_or_else(|e| e.into_inner()) = Some(reader);
    }

    /// `reason`, followed by the end of the process's stderr once it has been read to its
    /// end (briefly waited for: a process that just died has usually written it all).
    async fn explain(&self, reason: String) -> String {
        let reader = self.reader.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(mut reader) = reader
            && tokio::time::timeout(Duration::from_millis(300), &mut reader)
                .await
                .is_err()
        {
            // Still running: keep following it for later failures.
            *self.reader.lock().unwrap_or_else(|e| e.into_inner()) = Some(reader);
        }
        let lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        if lines.is_empty() {
            reason
        } else {
            let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
            format!("{reason}; its stderr ended with: {}", lines.join(" | "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restarts_wait_longer_after_each_failure_up_to_a_cap() {
        let waits: Vec<u128> = (1..=9).map(|n| backoff(n).as_millis()).collect();
        assert_eq!(waits, [0, 500, 1000, 2000, 4000, 8000, 16000, 30000, 30000]);
        assert_eq!(backoff(u32::MAX), MAX_BACKOFF);
    }
}
