//! A small Rust client of Ratchet's HTTP API, for the CLI (`run --server`, `chat`,
//! `approvals`, `schedules`) and the benchmarks: JSON calls, event streams that reconnect with
//! `Last-Event-ID`, and a Server-Sent Events parser that follows the WHATWG rules.

use std::collections::VecDeque;
use std::time::Duration;

use ratchet_core::{ApprovalAnswer, ApprovalId, RunStatus, StopReason};
use reqwest::StatusCode;
use reqwest::header::{ACCEPT, CONTENT_TYPE};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

pub use ratchet_llm::sse::{SseEvent, SseParser};

/// How long a JSON call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The server sends a keep-alive comment every 15 s: a stream silent for longer is dead.
const READ_TIMEOUT: Duration = Duration::from_secs(60);
/// First wait before reconnecting an event stream (unless the server sent `retry:`); it
/// doubles on each failure up to `MAX_RECONNECT_DELAY`.
const RECONNECT_DELAY: Duration = Duration::from_millis(250);
const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(5);
/// Failed connections and dropped streams in a row (with no byte received in between) before
/// a stream is given up.
const MAX_RECONNECTS: u32 = 12;
/// How long `follow_run` waits on a silent stream before asking for the run's state.
pub const IDLE_CHECK: Duration = Duration::from_secs(30);

/// Why a call to the server failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// A server address that is not an `http://` or `https://` URL.
    #[error("{0}")]
    Invalid(String),
    /// No HTTP answer: refused, unresolvable, timed out, or the connection broke.
    #[error(
        "cannot reach the Ratchet server at {server}: {reason} (is `ratchet serve` running there?)"
    )]
    Unreachable { server: String, reason: String },
    /// The API answered with an error status and (usually) its `{"error": …}` body.
    #[error("{}", refusal(*status, code, message))]
    Api {
        status: StatusCode,
        code: String,
        message: String,
    },
    /// An answer that is not what the API sends.
    #[error("unexpected answer from the server: {0}")]
    Protocol(String),
}

/// How often a keyed request is sent at most, and the first wait before sending it again.
const KEYED_ATTEMPTS: u32 = 4;
const KEYED_BACKOFF: Duration = Duration::from_millis(250);

/// Whether a keyed request that failed this way may be sent again under its key: nothing
/// came back, or the server is still carrying out the first request with the key.
fn may_resend(error: &ClientError) -> bool {
    match error {
        ClientError::Unreachable { .. } => true,
        ClientError::Api { status, code, .. } => {
            *status == StatusCode::CONFLICT && code == "request_in_progress"
        }
        ClientError::Invalid(_) | ClientError::Protocol(_) => false,
    }
}

fn refusal(status: StatusCode, code: &str, message: &str) -> String {
    let mut said = format!("the server answered {status}: {message}");
    if !code.is_empty() {
        said.push_str(&format!(" ({code})"));
    }
    if status == StatusCode::UNAUTHORIZED {
        said.push_str("; give a valid token with --token or RATCHET_TOKEN");
    }
    said
}

/// A session as the API returns it (the fields this client reads).
#[derive(Debug, Clone, Deserialize)]
pub struct SessionView {
    pub id: String,
}

/// The answer to `POST /v1/sessions/{id}/messages`.
#[derive(Debug, Clone, Deserialize)]
pub struct MessageAccepted {
    pub run_id: String,
}

/// `GET /v1/runs/{id}` (the fields this client reads).
#[derive(Debug, Clone, Deserialize)]
pub struct RunView {
    pub id: String,
    pub session_id: String,
    pub status: RunStatus,
    pub stop_reason: Option<StopReason>,
    pub step_index: u64,
    pub final_answer: Option<String>,
    /// What the run waits on a human for.
    pub pending_human: Option<ratchet_core::HumanRequest>,
}

/// The answer to `POST /v1/runs/{id}/fork`: the fork's new session and run.
#[derive(Debug, Clone, Deserialize)]
pub struct ForkedView {
    pub session_id: String,
    pub run_id: String,
    pub status: RunStatus,
}

/// The `data` of one server-sent event (the fields this client reads).
#[derive(Debug, Clone, Deserialize)]
pub struct EventView {
    pub seq: i64,
    pub kind: String,
    pub payload: Value,
    /// When the event was written, in ms since the epoch (the server's clock).
    pub created_at: i64,
    /// On a tree stream, levels below the followed run's root (0: a root run's own event).
    #[serde(default)]
    pub depth: u32,
}

/// The `data` of a live `activity` event: what a step in flight is doing. It is never stored
/// and has no `seq` (its server-sent event has no `id`), so it never moves the cursor.
#[derive(Debug, Clone, Deserialize)]
pub struct LiveView {
    pub payload: Value,
}

/// What an event stream sends: the session's stored events, and between them the live
/// activity of its steps in flight.
#[derive(Debug, Clone)]
pub enum Streamed {
    Stored(EventView),
    Live(LiveView),
}

/// One server; cheap to clone (the connection pool is shared).
#[derive(Clone)]
pub struct Api {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl Api {
    /// `server` is `http(s)://HOST:PORT` (a bare `HOST:PORT` means `http://`). `connections`
    /// sizes the pool for that many concurrent streams.
    pub fn new(
        server: &str,
        token: Option<String>,
        connections: usize,
    ) -> Result<Api, ClientError> {
        let server = server.trim().trim_end_matches('/');
        let base = if server.contains("://") {
            server.to_owned()
        } else {
            format!("http://{server}")
        };
        let url = reqwest::Url::parse(&base)
            .map_err(|e| ClientError::Invalid(format!("--server {server:?} is not a URL: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err(ClientError::Invalid(format!(
                "--server {server:?} must be an http:// or https:// URL"
            )));
        }
        let token = token.map(|t| t.trim().to_owned()).filter(|t| !t.is_empty());
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .read_timeout(READ_TIMEOUT)
            .pool_max_idle_per_host(connections.max(1))
            .tcp_nodelay(true)
            .user_agent(concat!("ratchet/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| ClientError::Invalid(format!("cannot build the HTTP client: {e}")))?;
        Ok(Api { http, base, token })
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// A request to `path` carrying the token, for what this client has no method for.
    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let request = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    fn unreachable(&self, error: &reqwest::Error) -> ClientError {
        ClientError::Unreachable {
            server: self.base.clone(),
            reason: describe(error),
        }
    }

    async fn call<T: DeserializeOwned>(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<T, ClientError> {
        let response = request
            .timeout(CALL_TIMEOUT)
            .send()
            .await
            .map_err(|e| self.unreachable(&e))?;
        if !response.status().is_success() {
            return Err(api_error(response).await);
        }
        let bytes = response.bytes().await.map_err(|e| self.unreachable(&e))?;
        serde_json::from_slice(&bytes).map_err(|e| {
            ClientError::Protocol(format!(
                "{e} in {:?}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
            ))
        })
    }

    /// A new session of the catalog agent `agent`, or of the server's model without one.
    /// Sent under an `Idempotency-Key` of its own, and sent again under it when no answer came
    /// (see `keyed_call`): a retry never creates a second session.
    pub async fn create_session(&self, agent: Option<&str>) -> Result<SessionView, ClientError> {
        let body = match agent {
            Some(agent) => json!({"agent": agent}),
            None => json!({}),
        };
        self.keyed_call("/v1/sessions", &body).await
    }

    /// Sends a message under an `Idempotency-Key` of its own, sent again under it when no
    /// answer came (see `keyed_call`): a retry never starts a second run.
    pub async fn send_message(
        &self,
        session_id: &str,
        content: &str,
    ) -> Result<MessageAccepted, ClientError> {
        let path = format!("/v1/sessions/{session_id}/messages");
        self.keyed_call(&path, &json!({"content": content})).await
    }

    /// `POST path` with a fresh `Idempotency-Key`, sent again with the same key — up to
    /// `KEYED_ATTEMPTS` times, waits doubling from `KEYED_BACKOFF` — when the server could not
    /// be reached or answered that the first request with the key is still in progress: the
    /// server carries the request out once and answers every repeat with its first response.
    async fn keyed_call<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &Value,
    ) -> Result<T, ClientError> {
        let key = format!("ratchet-cli-{}", uuid::Uuid::new_v4());
        let mut wait = KEYED_BACKOFF;
        let mut attempt = 1;
        loop {
            let request = (self.request(reqwest::Method::POST, path))
                .header("idempotency-key", &key)
                .json(body);
            match self.call(request).await {
                Err(error) if attempt < KEYED_ATTEMPTS && may_resend(&error) => {
                    tokio::time::sleep(wait).await;
                    wait *= 2;
                    attempt += 1;
                }
                answer => return answer,
            }
        }
    }

    /// Every approval of the tenant (all pages), only those with `status` when given.
    pub async fn approvals(&self, status: Option<&str>) -> Result<Vec<Value>, ClientError> {
        let mut items = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            // Statuses and cursors (approval ids) need no escaping in a query string.
            let mut path = "/v1/approvals?limit=200".to_owned();
            if let Some(status) = status {
                path.push_str(&format!("&status={status}"));
            }
            if let Some(cursor) = cursor {
                path.push_str(&format!("&cursor={cursor}"));
            }
            let page: Value = self.call(self.request(reqwest::Method::GET, &path)).await?;
            items.extend(page["items"].as_array().cloned().unwrap_or_default());
            cursor = page["next_cursor"].as_str().map(str::to_owned);
            if cursor.is_none() {
                return Ok(items);
            }
        }
    }

    /// `POST /v1/approvals/{id}` with `answer`.
    pub async fn answer_approval(
        &self,
        id: &ApprovalId,
        answer: &ApprovalAnswer,
    ) -> Result<Value, ClientError> {
        let body = match answer {
            ApprovalAnswer::Abort => json!({"abort": true}),
            ApprovalAnswer::Decisions(decisions) => json!({"decisions": decisions}),
        };
        let path = format!("/v1/approvals/{id}");
        self.call(self.request(reqwest::Method::POST, &path).json(&body))
            .await
    }

    /// `POST path` with a JSON body, answering the JSON the server answers.
    pub async fn post(&self, path: &str, body: &Value) -> Result<Value, ClientError> {
        self.call(self.request(reqwest::Method::POST, path).json(body))
            .await
    }

    /// `POST /v1/runs/{id}/{action}` with no body (`pause`, `resume`).
    pub async fn run_action(&self, run_id: &str, action: &str) -> Result<Value, ClientError> {
        let path = format!("/v1/runs/{run_id}/{action}");
        self.call(self.request(reqwest::Method::POST, &path)).await
    }

    /// Forks a run at its committed step `at_step`: a new session with its history as that
    /// step left it, and a run that continues from there — after `message` replaces the last
    /// user message, when given; as the catalog agent `agent`, when given.
    pub async fn fork_run(
        &self,
        run_id: &str,
        at_step: u64,
        message: Option<&str>,
        agent: Option<&str>,
    ) -> Result<ForkedView, ClientError> {
        let mut body = serde_json::json!({"at_step": at_step});
        if let Some(message) = message {
            body["edit"] = serde_json::json!({"replace_user_message": message});
        }
        if let Some(agent) = agent {
            body["agent"] = serde_json::json!(agent);
        }
        let path = format!("/v1/runs/{run_id}/fork");
        self.call(self.request(reqwest::Method::POST, &path).json(&body))
            .await
    }

    /// `POST /v1/schedules`: creates a schedule (the body as `docs/API.md` describes it).
    pub async fn create_schedule(&self, body: &Value) -> Result<Value, ClientError> {
        self.post("/v1/schedules", body).await
    }

    /// Every schedule of the caller, following the pages.
    pub async fn schedules(&self) -> Result<Vec<Value>, ClientError> {
        self.pages("/v1/schedules", 200).await
    }

    pub async fn schedule(&self, id: &str) -> Result<Value, ClientError> {
        let path = format!("/v1/schedules/{id}");
        self.call(self.request(reqwest::Method::GET, &path)).await
    }

    /// `PATCH /v1/schedules/{id}`: the fields of `change` replace the schedule's.
    pub async fn update_schedule(&self, id: &str, change: &Value) -> Result<Value, ClientError> {
        let path = format!("/v1/schedules/{id}");
        self.call(self.request(reqwest::Method::PATCH, &path).json(change))
            .await
    }

    pub async fn delete_schedule(&self, id: &str) -> Result<(), ClientError> {
        let path = format!("/v1/schedules/{id}");
        let response = (self.request(reqwest::Method::DELETE, &path))
            .timeout(CALL_TIMEOUT)
            .send()
            .await
            .map_err(|e| self.unreachable(&e))?;
        if !response.status().is_success() {
            return Err(api_error(response).await);
        }
        Ok(())
    }

    /// `POST /v1/schedules/{id}/{action}` with no body (`pause`, `resume`, `trigger`).
    pub async fn schedule_action(&self, id: &str, action: &str) -> Result<Value, ClientError> {
        let path = format!("/v1/schedules/{id}/{action}");
        self.call(self.request(reqwest::Method::POST, &path)).await
    }

    /// A schedule's decided slots, newest first: the latest `limit` of them.
    pub async fn schedule_runs(&self, id: &str, limit: u32) -> Result<Vec<Value>, ClientError> {
        let path = format!("/v1/schedules/{id}/runs?limit={}", limit.clamp(1, 200));
        let page: Value = self.call(self.request(reqwest::Method::GET, &path)).await?;
        Ok(page["items"].as_array().cloned().unwrap_or_default())
    }

    /// Every item of a paged list, following `next_cursor`.
    async fn pages(&self, path: &str, limit: u32) -> Result<Vec<Value>, ClientError> {
        let mut items = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            // Cursors the server issues are ids and numbers: nothing in them needs escaping.
            let url = match &cursor {
                Some(cursor) => format!("{path}?limit={limit}&cursor={cursor}"),
                None => format!("{path}?limit={limit}"),
            };
            let page: Value = (self.call(self.request(reqwest::Method::GET, &url))).await?;
            items.extend(page["items"].as_array().cloned().unwrap_or_default());
            match page["next_cursor"].as_str() {
                Some(next) => cursor = Some(next.to_owned()),
                None => return Ok(items),
            }
        }
    }

    pub async fn get_run(&self, run_id: &str) -> Result<RunView, ClientError> {
        self.call(self.request(reqwest::Method::GET, &format!("/v1/runs/{run_id}")))
            .await
    }

    /// Follows an event stream (`/v1/sessions/{id}/events` or `/v1/runs/{id}/events`) from
    /// its beginning; nothing is sent until the first `next` or `open`.
    pub fn follow(&self, path: &str) -> Follower {
        Follower {
            api: self.clone(),
            path: path.to_owned(),
            parser: SseParser::default(),
            response: None,
            pending: VecDeque::new(),
            failures: 0,
        }
    }
}

/// The innermost cause of a transport error is the useful one ("Connection refused").
fn describe(error: &reqwest::Error) -> String {
    let mut source: &dyn std::error::Error = error;
    while let Some(next) = source.source() {
        source = next;
    }
    let cause = source.to_string();
    if error.is_timeout() {
        format!("timed out ({cause})")
    } else {
        cause
    }
}

/// An error answer, with the API's `{"error": {"code", "message"}}` when it has one.
async fn api_error(response: reqwest::Response) -> ClientError {
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    let parsed: Option<Value> = serde_json::from_str(&body).ok();
    let field = |name: &str| {
        parsed
            .as_ref()
            .and_then(|v| v["error"][name].as_str())
            .map(str::to_owned)
    };
    let message = field("message").unwrap_or_else(|| {
        let text = body.trim();
        if text.is_empty() {
            status.canonical_reason().unwrap_or("no message").to_owned()
        } else {
            text.chars().take(200).collect()
        }
    });
    ClientError::Api {
        status,
        code: field("code").unwrap_or_default(),
        message,
    }
}

/// One event stream, reconnecting with `Last-Event-ID` whenever the connection drops; the
/// server resumes exactly after the last event received, so nothing is missed or repeated.
pub struct Follower {
    api: Api,
    path: String,
    parser: SseParser,
    response: Option<reqwest::Response>,
    pending: VecDeque<SseEvent>,
    /// Connection attempts and dropped streams since the last bytes received.
    failures: u32,
}

impl Follower {
    /// Connects now (if not connected): when it returns, the server is subscribed, so every
    /// later event will be delivered.
    pub async fn open(&mut self) -> Result<(), ClientError> {
        let mut last_error = None;
        while self.response.is_none() {
            if self.failures >= MAX_RECONNECTS {
                return Err(last_error.unwrap_or_else(|| {
                    ClientError::Protocol(format!(
                        "the event stream {} kept closing without sending anything",
                        self.path
                    ))
                }));
            }
            if self.failures > 0 {
                let delay = self.parser.retry().unwrap_or_else(|| {
                    RECONNECT_DELAY.saturating_mul(1u32 << (self.failures - 1).min(5))
                });
                tokio::time::sleep(delay.min(MAX_RECONNECT_DELAY)).await;
            }
            self.failures += 1;
            let mut request = self
                .api
                .request(reqwest::Method::GET, &self.path)
                .header(ACCEPT, "text/event-stream");
            if !self.parser.last_event_id().is_empty() {
                request = request.header("Last-Event-ID", self.parser.last_event_id());
            }
            let response = match request.send().await {
                Ok(response) => response,
                Err(error) => {
                    last_error = Some(self.api.unreachable(&error));
                    continue;
                }
            };
            let status = response.status();
            if status.is_client_error() {
                // A 4xx does not get better by asking again.
                return Err(api_error(response).await);
            }
            if !status.is_success() {
                last_error = Some(api_error(response).await);
                continue;
            }
            let content_type = response
                .headers()
                .get(CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            if !content_type.starts_with("text/event-stream") {
                return Err(ClientError::Protocol(format!(
                    "{} answered {content_type:?}, not an event stream",
                    self.path
                )));
            }
            self.parser.restart();
            self.response = Some(response);
        }
        Ok(())
    }

    /// The next stored event, passing live activity over; reconnects as often as needed.
    /// Fails on a 4xx, or when the server stays unreachable.
    pub async fn next(&mut self) -> Result<EventView, ClientError> {
        loop {
            if let Streamed::Stored(event) = self.next_streamed().await? {
                return Ok(event);
            }
        }
    }

    /// The next stored event or live activity (told apart by `live: true` in its data).
    pub async fn next_streamed(&mut self) -> Result<Streamed, ClientError> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                let bad_data = |e: serde_json::Error| {
                    ClientError::Protocol(format!("event {:?} has bad data: {e}", event.id))
                };
                let data: Value = serde_json::from_str(&event.data).map_err(bad_data)?;
                return if data["live"] == true {
                    serde_json::from_value(data).map(Streamed::Live)
                } else {
                    serde_json::from_value(data).map(Streamed::Stored)
                }
                .map_err(bad_data);
            }
            self.open().await?;
            let Some(response) = self.response.as_mut() else {
                continue;
            };
            match response.chunk().await {
                Ok(Some(bytes)) => {
                    // Anything received, even a keep-alive comment, shows the stream works.
                    self.failures = 0;
                    self.pending.extend(self.parser.feed(&bytes));
                }
                // The stream ended or broke: open it again, after a pause, from the last
                // event received.
                Ok(None) | Err(_) => {
                    self.response = None;
                    self.failures += 1;
                }
            }
        }
    }
}

/// Follows a run's events after `after_seq` until it ends or waits for someone, handing each
/// event to `on_event`, then returns the run as `GET /v1/runs/{id}` reports it.
pub async fn follow_run(
    api: &Api,
    run_id: &str,
    after_seq: i64,
    on_event: impl FnMut(&EventView),
) -> Result<RunView, ClientError> {
    follow_run_live(api, run_id, after_seq, on_event, |_| {}).await
}

/// `follow_run` that also hands the live activity of the run's steps to `on_live`.
pub async fn follow_run_live(
    api: &Api,
    run_id: &str,
    after_seq: i64,
    mut on_event: impl FnMut(&EventView),
    mut on_live: impl FnMut(&LiveView),
) -> Result<RunView, ClientError> {
    let mut events = api.follow(&format!("/v1/runs/{run_id}/events?after={after_seq}"));
    loop {
        let settled = match tokio::time::timeout(IDLE_CHECK, events.next_streamed()).await {
            Ok(streamed) => {
                let event = match streamed? {
                    Streamed::Stored(event) => event,
                    Streamed::Live(activity) => {
                        on_live(&activity);
                        continue;
                    }
                };
                on_event(&event);
                matches!(event.kind.as_str(), "run.status" | "run.finished")
                    && event.payload["status"]
                        .as_str()
                        .and_then(RunStatus::parse)
                        .is_some_and(|s| s.is_terminal() || s.is_waiting())
            }
            // Silence: ask for the run's state rather than trust the stream blindly.
            Err(_) => true,
        };
        if settled {
            let run = api.get_run(run_id).await?;
            if run.status.is_terminal() || run.status.is_waiting() {
                return Ok(run);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message whose first answer is "still in progress" is sent again under the same key;
    /// one that the server refuses for good is not sent again.
    #[tokio::test]
    async fn a_keyed_message_is_sent_again_under_its_key_while_in_progress() {
        use std::sync::{Arc, Mutex};

        use axum::http::HeaderMap;

        let keys: Arc<Mutex<Vec<String>>> = Arc::default();
        let log = Arc::clone(&keys);
        let app = axum::Router::new().route(
            "/v1/sessions/{id}/messages",
            axum::routing::post(move |headers: HeaderMap| {
                let key = headers["idempotency-key"].to_str().unwrap().to_owned();
                let mut keys = log.lock().unwrap();
                keys.push(key);
                let answer = match keys.len() {
                    1 => (
                        StatusCode::CONFLICT,
                        json!({"error": {"code": "request_in_progress", "message": "wait"}}),
                    ),
                    _ => (
                        StatusCode::ACCEPTED,
                        json!({"message_id": "msg_a", "run_id": "run_a", "run_status": "running", "steered": false}),
                    ),
                };
                async move { (answer.0, axum::Json(answer.1)) }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let api = Api::new(&address.to_string(), None, 2).unwrap();
        let accepted = api.send_message("ses_a", "hello").await.unwrap();
        assert_eq!(accepted.run_id, "run_a");
        let sent = keys.lock().unwrap().clone();
        assert_eq!(sent.len(), 2, "{sent:?}");
        assert_eq!(sent[0], sent[1], "the same key both times");
        assert!(sent[0].starts_with("ratchet-cli-"), "{sent:?}");

        let conflict = ClientError::Api {
            status: StatusCode::CONFLICT,
            code: "conflict".into(),
            message: "busy".into(),
        };
        assert!(!may_resend(&conflict), "a refusal for good is final");
    }

    #[tokio::test]
    async fn a_dropped_stream_is_resumed_with_the_last_event_id() {
        use std::sync::{Arc, Mutex};

        use axum::http::HeaderMap;

        fn sse(seq: i64) -> String {
            let data = json!({"seq": seq, "kind": "k", "payload": {}, "created_at": 0});
            format!("id: {seq}\nevent: k\ndata: {data}\n\n")
        }
        let asked: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
        let log = Arc::clone(&asked);
        let app = axum::Router::new()
            .route(
                "/events",
                axum::routing::get(move |headers: HeaderMap| {
                    let last = headers
                        .get("last-event-id")
                        .map(|v| v.to_str().unwrap().to_owned());
                    log.lock().unwrap().push(last.clone());
                    let body = match last.as_deref() {
                        None => format!("{}{}data: {{\"seq\": 3", sse(1), sse(2)),
                        Some("2") => sse(3),
                        _ => ": nothing more\n\n".to_owned(),
                    };
                    async move { ([(CONTENT_TYPE, "text/event-stream")], body) }
                }),
            )
            .route(
                "/denied",
                axum::routing::get(|| async {
                    (
                        StatusCode::UNAUTHORIZED,
                        axum::Json(json!({"error": {"code": "unauthorized", "message": "unknown bearer token"}})),
                    )
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });

        let api = Api::new(&address.to_string(), Some("t0k".into()), 2).unwrap();
        let mut events = api.follow("/events");
        let seqs = [
            events.next().await.unwrap().seq,
            events.next().await.unwrap().seq,
            events.next().await.unwrap().seq,
        ];
        assert_eq!(seqs, [1, 2, 3]);
        assert_eq!(*asked.lock().unwrap(), [None, Some("2".to_owned())]);

        let denied = api.follow("/denied").next().await.unwrap_err();
        assert!(
            matches!(&denied, ClientError::Api { status, message, .. }
                if *status == StatusCode::UNAUTHORIZED && message == "unknown bearer token"),
            "{denied:?}"
        );
        assert!(
            denied
                .to_string()
                .contains("401 Unauthorized: unknown bearer token")
        );
    }
}
