//! A small client of Ratchet's HTTP API, for `run --server`, `chat` and `bench sse`: JSON
//! calls, event streams that reconnect with `Last-Event-ID`, and a Server-Sent Events parser
//! that follows the WHATWG rules.

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

use ratchet_core::{RunStatus, StopReason};
use reqwest::StatusCode;
use reqwest::header::{ACCEPT, CONTENT_TYPE};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

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
const IDLE_CHECK: Duration = Duration::from_secs(30);

/// Why a call to the server failed.
#[derive(Debug)]
pub enum ClientError {
    /// No HTTP answer: refused, unresolvable, timed out, or the connection broke.
    Unreachable { server: String, reason: String },
    /// The API answered with an error status and (usually) its `{"error": …}` body.
    Api {
        status: StatusCode,
        code: String,
        message: String,
    },
    /// An answer that is not what the API sends.
    Protocol(String),
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientError::Unreachable { server, reason } => write!(
                f,
                "cannot reach the Ratchet server at {server}: {reason} (is `ratchet serve` running there?)"
            ),
            ClientError::Api {
                status,
                code,
                message,
            } => {
                write!(f, "the server answered {status}: {message}")?;
                if !code.is_empty() {
                    write!(f, " ({code})")?;
                }
                if *status == StatusCode::UNAUTHORIZED {
                    write!(f, "; give a valid token with --token or RATCHET_TOKEN")?;
                }
                Ok(())
            }
            ClientError::Protocol(what) => write!(f, "unexpected answer from the server: {what}"),
        }
    }
}

impl std::error::Error for ClientError {}

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

/// The `data` of one server-sent event (the fields this client reads).
#[derive(Debug, Clone, Deserialize)]
pub struct EventView {
    pub seq: i64,
    pub kind: String,
    pub payload: Value,
    /// When the event was written, in ms since the epoch (the server's clock).
    pub created_at: i64,
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
    pub fn new(server: &str, token: Option<String>, connections: usize) -> anyhow::Result<Api> {
        let server = server.trim().trim_end_matches('/');
        let base = if server.contains("://") {
            server.to_owned()
        } else {
            format!("http://{server}")
        };
        let url = reqwest::Url::parse(&base)
            .map_err(|e| anyhow::anyhow!("--server {server:?} is not a URL: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            anyhow::bail!("--server {server:?} must be an http:// or https:// URL");
        }
        let token = token.map(|t| t.trim().to_owned()).filter(|t| !t.is_empty());
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .read_timeout(READ_TIMEOUT)
            .pool_max_idle_per_host(connections.max(1))
            .tcp_nodelay(true)
            .user_agent(concat!("ratchet/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| anyhow::anyhow!("cannot build the HTTP client: {e}"))?;
        Ok(Api { http, base, token })
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
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

    pub async fn create_session(&self) -> Result<SessionView, ClientError> {
        self.call(
            self.request(reqwest::Method::POST, "/v1/sessions")
                .json(&json!({})),
        )
        .await
    }

    pub async fn send_message(
        &self,
        session_id: &str,
        content: &str,
    ) -> Result<MessageAccepted, ClientError> {
        let path = format!("/v1/sessions/{session_id}/messages");
        self.call(
            self.request(reqwest::Method::POST, &path)
                .json(&json!({"content": content})),
        )
        .await
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

    pub async fn answer_approval(&self, id: &str, body: &Value) -> Result<Value, ClientError> {
        let path = format!("/v1/approvals/{id}");
        self.call(self.request(reqwest::Method::POST, &path).json(body))
            .await
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

    /// The next event; reconnects as often as needed. Fails on a 4xx, or when the server
    /// stays unreachable.
    pub async fn next(&mut self) -> Result<EventView, ClientError> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return serde_json::from_str(&event.data).map_err(|e| {
                    ClientError::Protocol(format!("event {:?} has bad data: {e}", event.id))
                });
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
    mut on_event: impl FnMut(&EventView),
) -> Result<RunView, ClientError> {
    let mut events = api.follow(&format!("/v1/runs/{run_id}/events?after={after_seq}"));
    loop {
        let settled = match tokio::time::timeout(IDLE_CHECK, events.next()).await {
            Ok(event) => {
                let event = event?;
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

/// One dispatched server-sent event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The event type (`message` when the stream gave none).
    pub event: String,
    pub data: String,
    /// The last event ID at dispatch (it persists across events until changed).
    pub id: String,
}

/// An incremental parser of `text/event-stream`, following the WHATWG rules: lines end with
/// CR, LF or CRLF (also split across chunks); a leading BOM is dropped; lines starting with
/// `:` are comments; `id` persists across events and an empty `id` resets it; an `id`
/// containing NUL is ignored; an event without `data` is not dispatched; a final event not
/// closed by an empty line is discarded.
#[derive(Debug, Default)]
pub struct SseParser {
    line: Vec<u8>,
    /// The previous chunk ended with CR: a LF starting this one ends no new line.
    after_cr: bool,
    /// The stream's first line has been seen (only it can start with a BOM).
    started: bool,
    event: String,
    data: String,
    last_event_id: String,
    retry: Option<Duration>,
}

const BOM: &[u8] = b"\xEF\xBB\xBF";

impl SseParser {
    /// Feeds the next bytes of the stream; returns the events they complete.
    pub fn feed(&mut self, mut bytes: &[u8]) -> Vec<SseEvent> {
        let mut events = Vec::new();
        while !bytes.is_empty() {
            if self.after_cr {
                self.after_cr = false;
                if bytes[0] == b'\n' {
                    bytes = &bytes[1..];
                    continue;
                }
            }
            match bytes.iter().position(|b| matches!(b, b'\r' | b'\n')) {
                None => {
                    self.line.extend_from_slice(bytes);
                    break;
                }
                Some(end) => {
                    self.line.extend_from_slice(&bytes[..end]);
                    self.after_cr = bytes[end] == b'\r';
                    bytes = &bytes[end + 1..];
                    let mut line = std::mem::take(&mut self.line);
                    self.process_line(&line, &mut events);
                    line.clear();
                    self.line = line;
                }
            }
        }
        events
    }

    /// A new connection: what was pending is dropped; the last event ID and the reconnection
    /// time are kept.
    pub fn restart(&mut self) {
        self.line.clear();
        self.after_cr = false;
        self.started = false;
        self.event.clear();
        self.data.clear();
    }

    /// What to send as `Last-Event-ID` when reconnecting (empty: send none).
    pub fn last_event_id(&self) -> &str {
        &self.last_event_id
    }

    /// The reconnection time the server asked for with `retry:`.
    pub fn retry(&self) -> Option<Duration> {
        self.retry
    }

    fn process_line(&mut self, line: &[u8], events: &mut Vec<SseEvent>) {
        let line = if self.started {
            line
        } else {
            self.started = true;
            line.strip_prefix(BOM).unwrap_or(line)
        };
        if line.is_empty() {
            self.dispatch(events);
            return;
        }
        if line[0] == b':' {
            return;
        }
        let line = String::from_utf8_lossy(line);
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line.as_ref(), ""),
        };
        match field {
            "event" => value.clone_into(&mut self.event),
            "data" => {
                self.data.push_str(value);
                self.data.push('\n');
            }
            "id" if !value.contains('\0') => value.clone_into(&mut self.last_event_id),
            "retry" if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) => {
                if let Ok(ms) = value.parse() {
                    self.retry = Some(Duration::from_millis(ms));
                }
            }
            _ => {}
        }
    }

    fn dispatch(&mut self, events: &mut Vec<SseEvent>) {
        let event = std::mem::take(&mut self.event);
        if self.data.is_empty() {
            return;
        }
        let mut data = std::mem::take(&mut self.data);
        if data.ends_with('\n') {
            data.pop();
        }
        events.push(SseEvent {
            event: if event.is_empty() {
                "message".to_owned()
            } else {
                event
            },
            data,
            id: self.last_event_id.clone(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(event: &str, data: &str, id: &str) -> SseEvent {
        SseEvent {
            event: event.into(),
            data: data.into(),
            id: id.into(),
        }
    }

    fn parse(text: &[u8]) -> Vec<SseEvent> {
        SseParser::default().feed(text)
    }

    /// The same bytes fed whole, one byte at a time, and split at every position give the
    /// same events.
    fn parse_every_way(text: &[u8]) -> Vec<SseEvent> {
        let whole = parse(text);
        let mut parser = SseParser::default();
        let bytewise: Vec<SseEvent> = text.iter().flat_map(|b| parser.feed(&[*b])).collect();
        assert_eq!(bytewise, whole, "fed byte by byte");
        for split in 0..=text.len() {
            let mut parser = SseParser::default();
            let mut events = parser.feed(&text[..split]);
            events.extend(parser.feed(&text[split..]));
            assert_eq!(events, whole, "split at {split}");
        }
        whole
    }

    #[test]
    fn lf_cr_and_crlf_all_end_lines() {
        let expected = vec![event("a", "1", "7"), event("message", "2", "7")];
        for eol in ["\n", "\r", "\r\n"] {
            let text = format!("event: a{eol}id: 7{eol}data: 1{eol}{eol}data: 2{eol}{eol}");
            assert_eq!(parse_every_way(text.as_bytes()), expected, "{eol:?}");
        }
        // Mixed in one stream, and a CR followed by LF in the next chunk is one line end.
        assert_eq!(
            parse_every_way(b"data: x\r\n\rdata: y\n\r\n"),
            vec![event("message", "x", ""), event("message", "y", "")]
        );
    }

    #[test]
    fn a_leading_bom_is_dropped_once() {
        assert_eq!(
            parse_every_way(b"\xEF\xBB\xBFdata: x\n\n"),
            vec![event("message", "x", "")]
        );
        // A BOM anywhere else makes an unknown field name, which is ignored.
        assert_eq!(
            parse_every_way(b"data: x\n\n\xEF\xBB\xBFdata: y\n\ndata: z\n\n"),
            vec![event("message", "x", ""), event("message", "z", "")]
        );
        // Only one BOM is stripped.
        assert_eq!(
            parse(b"\xEF\xBB\xBF\xEF\xBB\xBFdata: x\n\n"),
            Vec::<SseEvent>::new()
        );
    }

    #[test]
    fn the_id_persists_until_changed_and_an_empty_id_resets_it() {
        let mut parser = SseParser::default();
        let events = parser.feed(b"id: 1\ndata: a\n\ndata: b\n\nid\ndata: c\n\nid: 4\ndata: d\n\n");
        assert_eq!(
            events,
            vec![
                event("message", "a", "1"),
                event("message", "b", "1"),
                event("message", "c", ""),
                event("message", "d", "4"),
            ]
        );
        assert_eq!(parser.last_event_id(), "4");
        // `id:` with an empty value resets too; an id containing NUL is ignored.
        assert_eq!(parser.feed(b"id:\n\n"), vec![]);
        assert_eq!(parser.last_event_id(), "");
        parser.feed(b"id: 9\nid: 1\x002\ndata: e\n\n");
        assert_eq!(parser.last_event_id(), "9");
    }

    #[test]
    fn an_event_without_data_is_not_dispatched_but_its_id_counts() {
        let mut parser = SseParser::default();
        assert_eq!(parser.feed(b"event: ping\nid: 5\n\n"), vec![]);
        assert_eq!(parser.last_event_id(), "5");
        // The type of the undispatched event does not leak into the next one.
        assert_eq!(
            parser.feed(b"data: x\n\n"),
            vec![event("message", "x", "5")]
        );
    }

    #[test]
    fn comments_fields_and_values() {
        let text =
            b": keep-alive\n:\ndata:no space\ndata:  two spaces\ndata\nunknown: x\nevent:e\n\n";
        assert_eq!(
            parse_every_way(text),
            vec![event("e", "no space\n two spaces\n", "")]
        );
        // `data:` alone is an empty data line: the event is dispatched with empty data.
        assert_eq!(parse(b"data:\n\n"), vec![event("message", "", "")]);
        // A value may contain colons.
        assert_eq!(
            parse(b"data: {\"a\":1}\n\n"),
            vec![event("message", "{\"a\":1}", "")]
        );
    }

    #[test]
    fn an_unfinished_event_is_held_back_and_dropped_on_restart() {
        let mut parser = SseParser::default();
        assert_eq!(
            parser.feed(b"id: 3\ndata: a\n\ndata: partial\n"),
            vec![event("message", "a", "3")]
        );
        parser.restart();
        assert_eq!(parser.last_event_id(), "3");
        assert_eq!(
            parser.feed(b"data: b\n\n"),
            vec![event("message", "b", "3")]
        );
    }

    #[test]
    fn retry_takes_only_digits() {
        let mut parser = SseParser::default();
        parser.feed(b"retry: 1500\n\n");
        assert_eq!(parser.retry(), Some(Duration::from_millis(1500)));
        parser.feed(b"retry: 1.5\nretry: x\nretry:\n\n");
        assert_eq!(parser.retry(), Some(Duration::from_millis(1500)));
    }

    /// A server whose stream breaks twice: after two events and half of a third, then
    /// after the third. The follower reconnects with the last id each time and sees every
    /// event once; a 4xx is returned as the API's error, with its message.
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

    #[test]
    fn multibyte_text_split_across_chunks_survives() {
        let text = "data: 2 + 3 = 5 ✓ — fin\n\n".as_bytes();
        assert_eq!(
            parse_every_way(text),
            vec![event("message", "2 + 3 = 5 ✓ — fin", "")]
        );
    }
}
