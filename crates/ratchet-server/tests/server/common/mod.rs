//! What the HTTP tests share: a server on 127.0.0.1 with a fresh SQLite file, a real worker
//! pool, a scripted model (or one a test registers) and reloads that yield what a test
//! queued, plain JSON requests with their checks, and a minimal Server-Sent Events reader.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use ratchet_core::delegation::{AGENT_TASK_TOOL, DELEGATE_TOOL};
use ratchet_core::{AgentProfile, Limits, MemoryScope, RunConfigSnapshot};
use ratchet_engine::{Coordinator, Engine, Models, PoolConfig, WorkerPool};
use ratchet_server::reload::Prepared;
use ratchet_server::{
    Active, AppState, GuardedListener, HostPolicy, StreamLimits, Tokens, hash_token,
};
use ratchet_store::{Key, Keyring, Store, WebhookAdmin};
use ratchet_tools::Registry;
use ratchet_webhooks::{DispatcherConfig, WebhookPolicy};
use reqwest::header::CONTENT_TYPE;
use reqwest::{RequestBuilder, StatusCode};
use serde_json::{Value, json};
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;

pub const TOKEN_A: &str = "token-of-tenant-a";
pub const TOKEN_B: &str = "token-of-tenant-b";
/// Also tenant A's: a base64 token, whose `+`, `/` and `=` a URL must percent-encode.
pub const TOKEN_A_BASE64: &str = "q0/Lw+Zk9a==";
/// Bound on anything the tests wait for; a healthy run takes a small fraction of it.
pub const DEADLINE: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------
// Scripts

/// One tool round-trip, then an answer: three steps, no delays.
pub fn quick_script() -> Value {
    json!({"replies": [
        {"text": "Let me add.", "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]},
        {"text": "The sum is 5."}
    ]})
}

/// One answer of `words` words streamed `delay_ms` apart.
pub fn slow_script(words: usize, delay_ms: u64) -> Value {
    let text: Vec<String> = (1..=words).map(|i| format!("w{i}")).collect();
    json!({"replies": [{"text": text.join(" "), "chunk_delay_ms": delay_ms}]})
}

/// A tool call that sleeps for a minute: the run stays active until cancelled.
pub fn sleepy_script() -> Value {
    json!({"replies": [
        {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 60000}}]},
        {"text": "never"}
    ]})
}

// ---------------------------------------------------------------------------------------
// The server

/// The limits `ratchet serve` sets from `[limits]` and `[server]`; the defaults are its own.
pub struct Guards {
    pub streams: StreamLimits,
    pub stall: Duration,
    pub hosts: HostPolicy,
}

impl Default for Guards {
    fn default() -> Guards {
        Guards {
            streams: StreamLimits::default(),
            stall: Duration::from_secs(30),
            hosts: HostPolicy::default(),
        }
    }
}

/// What the server's next reloads prepare, in order; a reload with nothing queued is rejected.
pub type ReloadQueue = Arc<Mutex<VecDeque<Result<Prepared, Vec<String>>>>>;

pub struct Server {
    pub base: String,
    pub http: reqwest::Client,
    pub shutdown: CancellationToken,
    pub coordinator: Arc<Coordinator>,
    /// The store's webhook administration, past the API's checks.
    pub webhooks: Arc<dyn WebhookAdmin>,
    /// The run template the server started with.
    pub template: RunConfigSnapshot,
    /// The server's directory: its database, its scripts.
    pub dir: PathBuf,
    pub reloads: ReloadQueue,
    pub _pool: WorkerPool,
    pub _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Server {
    pub async fn start(script: Value) -> Server {
        Server::start_with(script, |_, _| {}).await
    }

    /// A server whose run template and models `configure` adjusts first.
    pub async fn start_with(
        script: Value,
        configure: impl FnOnce(&mut RunConfigSnapshot, &Models),
    ) -> Server {
        Server::launch(script, configure, |_, _| Vec::new()).await
    }

    /// A server whose catalog holds the agents `catalog` makes from the run template and the
    /// server's directory (where their scripts can go).
    pub async fn start_with_agents(
        script: Value,
        catalog: impl FnOnce(&RunConfigSnapshot, &Path) -> Vec<AgentProfile>,
    ) -> Server {
        Server::launch(script, |_, _| {}, catalog).await
    }

    /// A server that also sends webhook deliveries, as `ratchet serve` does; webhooks are
    /// created where the dispatcher sends (`dispatch.policy`).
    pub async fn start_with_dispatcher(script: Value, dispatch: DispatcherConfig) -> Server {
        let policy = dispatch.policy.clone();
        Server::launch_with(
            script,
            |_, _| {},
            |_, _| Vec::new(),
            Some(dispatch),
            policy,
            Guards::default(),
        )
        .await
    }

    /// A server with other stream limits, stall timeout or names than `ratchet serve`'s
    /// defaults.
    pub async fn start_guarded(script: Value, guards: Guards) -> Server {
        let policy = WebhookPolicy::default().loopback_allowed(true);
        Server::launch_with(script, |_, _| {}, |_, _| Vec::new(), None, policy, guards).await
    }

    /// A server that creates webhooks only where `policy` allows.
    pub async fn start_with_webhook_policy(script: Value, policy: WebhookPolicy) -> Server {
        Server::launch_with(
            script,
            |_, _| {},
            |_, _| Vec::new(),
            None,
            policy,
            Guards::default(),
        )
        .await
    }

    /// Like `ratchet serve` listening on loopback (as this server does), webhooks may be
    /// created to loopback.
    pub async fn launch(
        script: Value,
        configure: impl FnOnce(&mut RunConfigSnapshot, &Models),
        catalog: impl FnOnce(&RunConfigSnapshot, &Path) -> Vec<AgentProfile>,
    ) -> Server {
        let policy = WebhookPolicy::default().loopback_allowed(true);
        Server::launch_with(script, configure, catalog, None, policy, Guards::default()).await
    }

    async fn launch_with(
        script: Value,
        configure: impl FnOnce(&mut RunConfigSnapshot, &Models),
        catalog: impl FnOnce(&RunConfigSnapshot, &Path) -> Vec<AgentProfile>,
        dispatch: Option<DispatcherConfig>,
        policy: WebhookPolicy,
        guards: Guards,
    ) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let script_path = dir.path().join("script.json");
        std::fs::write(&script_path, script.to_string()).unwrap();
        let db = format!("sqlite://{}", dir.path().join("ratchet.db").display());
        let keyring = Keyring::new(Key::generate().unwrap(), Vec::new()).unwrap();
        let store: Arc<dyn Store> =
            Arc::new(ratchet_sqlite::open_url(&db).unwrap().with_secrets(keyring));
        let tools = Arc::new(Registry::builtin());
        // Scripts of delegating agents call the runtime's own tools besides the registry's.
        let mut known_tools: Vec<String> = tools.names();
        known_tools.extend([DELEGATE_TOOL, AGENT_TASK_TOOL].map(str::to_owned));
        let models = Arc::new(Models::new(known_tools));
        let coordinator = Coordinator::new(Arc::clone(&store));
        // As `ratchet serve` does; SQLite has no change stream, so this follows nothing.
        let _follower = coordinator.follow_others();
        let engine = Arc::new(Engine::new(
            Arc::clone(&coordinator),
            Arc::clone(&models),
            tools,
        ));
        let mut run_template = RunConfigSnapshot {
            model: format!("scripted:{}", script_path.display()),
            model_settings: None,
            workspace: None,
            system_prompt: String::new(),
            tools: Registry::builtin().specs(),
            limits: Limits::default(),
            memory_scope: MemoryScope::Session,
            ..RunConfigSnapshot::default()
        };
        configure(&mut run_template, &models);
        let template = run_template.clone();
        let agents = catalog(&run_template, dir.path());
        let tokens = Tokens::new(HashMap::from([
            (hash_token(TOKEN_A), "tenant-a".to_owned()),
            (hash_token(TOKEN_B), "tenant-b".to_owned()),
            (hash_token(TOKEN_A_BASE64), "tenant-a".to_owned()),
        ]))
        .with_admins([hash_token(TOKEN_A), hash_token(TOKEN_B)]);
        let shutdown = CancellationToken::new();
        let reloads = ReloadQueue::default();
        let queued = Arc::clone(&reloads);
        let state = AppState::new(
            Arc::clone(&coordinator),
            Arc::clone(&store) as Arc<dyn WebhookAdmin>,
            Active::new(run_template, agents, tokens),
            shutdown.clone(),
        )
        .with_stream_limits(guards.streams)
        .with_host_policy(guards.hosts)
        .with_reloader(move || {
            queued
                .lock()
                .unwrap()
                .pop_front()
                .unwrap_or_else(|| Err(vec!["the test queued no reload".to_owned()]))
        })
        .with_webhook_policy(policy);
        let pool = WorkerPool::start(
            Arc::clone(&coordinator),
            engine,
            PoolConfig {
                workers: 4,
                poll: Duration::from_millis(10),
                retry_backoff: Duration::from_millis(10),
                ..PoolConfig::default()
            },
        );
        if let Some(dispatch) = dispatch {
            ratchet_webhooks::spawn(store.clone(), dispatch, shutdown.clone()).unwrap();
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let listener = GuardedListener::new(listener, guards.stall);
        let address = listener.local_addr().unwrap();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            axum::serve(listener, ratchet_server::app(state))
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
                .unwrap();
        });
        Server {
            base: format!("http://{address}"),
            http: reqwest::Client::builder().no_proxy().build().unwrap(),
            shutdown,
            coordinator,
            webhooks: store,
            template,
            dir: dir.path().to_path_buf(),
            reloads,
            _pool: pool,
            _dir: dir,
        }
    }

    /// What the next reload prepares.
    pub fn queue_reload(&self, prepared: Result<Prepared, Vec<String>>) {
        self.reloads.lock().unwrap().push_back(prepared);
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn get(&self, token: &str, path: &str) -> RequestBuilder {
        self.http.get(self.url(path)).bearer_auth(token)
    }

    pub fn post(&self, token: &str, path: &str, body: Value) -> RequestBuilder {
        self.http
            .post(self.url(path))
            .bearer_auth(token)
            .json(&body)
    }

    pub fn patch(&self, token: &str, path: &str, body: Value) -> RequestBuilder {
        self.http
            .patch(self.url(path))
            .bearer_auth(token)
            .json(&body)
    }

    pub async fn get_ok(&self, token: &str, path: &str) -> Value {
        let reply = call(self.get(token, path)).await;
        assert_eq!(reply.status, StatusCode::OK, "GET {path}: {}", reply.body);
        reply.body
    }

    /// A new session of tenant A with one message, run to its end: the session, the run, and
    /// the run as it ended.
    pub async fn run_to_end(&self, content: &str) -> (String, String, Value) {
        let session = self.create_session(TOKEN_A).await;
        let accepted = self.send(TOKEN_A, &session, content).await;
        let run = accepted["run_id"].as_str().unwrap().to_owned();
        let ended = self.finish(&run).await;
        (session, run, ended)
    }

    /// Every visible message of one of tenant A's sessions (up to 200), in order.
    pub async fn messages(&self, session: &str) -> Vec<Value> {
        let path = format!("/v1/sessions/{session}/messages?limit=200");
        let page = self.get_ok(TOKEN_A, &path).await;
        page["items"].as_array().unwrap().clone()
    }

    pub async fn create_session(&self, token: &str) -> String {
        let reply = call(self.post(token, "/v1/sessions", json!({}))).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
        reply.body["id"].as_str().unwrap().to_owned()
    }

    /// Posts a message; returns the 202 body.
    pub async fn send(&self, token: &str, session: &str, content: &str) -> Value {
        let path = format!("/v1/sessions/{session}/messages");
        let reply = call(self.post(token, &path, json!({"content": content}))).await;
        assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.body);
        reply.body
    }

    /// Opens an event stream (tenant A) and checks that it is one.
    pub async fn stream(&self, path: &str, last_event_id: Option<&str>) -> Sse {
        let mut request = self.get(TOKEN_A, path);
        if let Some(id) = last_event_id {
            request = request.header("last-event-id", id);
        }
        let response = timeout(DEADLINE, request.send())
            .await
            .expect("no answer in time")
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK, "GET {path}");
        let content_type = response.headers()[CONTENT_TYPE].to_str().unwrap();
        assert!(
            content_type.starts_with("text/event-stream"),
            "{content_type}"
        );
        Sse::new(response)
    }

    /// Reads a stream that must end by itself (`follow=false`) to its end.
    pub async fn replay(&self, path: &str, last_event_id: Option<&str>) -> Vec<Ev> {
        self.stream(path, last_event_id).await.read_to_end().await
    }

    /// Waits for the run's `run.finished` (on its own event stream) and returns the run.
    pub async fn finish(&self, run: &str) -> Value {
        self.finish_again(run, 1).await
    }

    /// Waits for the run's `nth` `run.finished` (a continued run ends more than once).
    pub async fn finish_again(&self, run: &str, nth: usize) -> Value {
        let mut events = self.stream(&format!("/v1/runs/{run}/events"), None).await;
        let mut ends = 0;
        events
            .until(|e| {
                ends += usize::from(e.kind == "run.finished");
                ends == nth
            })
            .await;
        let state = self.get_ok(TOKEN_A, &format!("/v1/runs/{run}")).await;
        assert!(
            ["completed", "failed", "cancelled"].contains(&state["status"].as_str().unwrap()),
            "{state}"
        );
        state
    }
}

// ---------------------------------------------------------------------------------------
// Plain requests

pub struct Reply {
    pub status: StatusCode,
    pub content_type: String,
    pub body: Value,
}

/// Sends a request; the body must be JSON, whatever the status.
pub async fn call(request: RequestBuilder) -> Reply {
    timeout(DEADLINE, call_inner(request))
        .await
        .expect("no complete answer in time")
}

pub async fn call_inner(request: RequestBuilder) -> Reply {
    let response = request.send().await.unwrap();
    let status = response.status();
    let content_type = response
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let text = response.text().await.unwrap();
    let body = serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!("{status}: the body is not JSON ({e}); content-type {content_type:?}: {text:?}")
    });
    Reply {
        status,
        content_type,
        body,
    }
}

pub fn keys(value: &Value) -> Vec<&str> {
    let mut keys: Vec<&str> = value
        .as_object()
        .map(|o| o.keys().map(String::as_str).collect())
        .unwrap_or_default();
    keys.sort_unstable();
    keys
}

/// The status, and a body of exactly `{"error": {"code", "message"}}`.
pub fn assert_error(what: &str, reply: &Reply, status: StatusCode, code: &str) {
    let body = &reply.body;
    assert_eq!(reply.status, status, "{what}: {body}");
    assert!(
        reply.content_type.starts_with("application/json"),
        "{what}: {:?}",
        reply.content_type
    );
    assert_eq!(keys(body), ["error"], "{what}: {body}");
    assert_eq!(keys(&body["error"]), ["code", "message"], "{what}: {body}");
    assert_eq!(body["error"]["code"], code, "{what}: {body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{what}: {body}"
    );
}

pub fn ids(items: &Value) -> Vec<String> {
    items
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap().to_owned())
        .collect()
}

/// Follows `next_cursor` from the first page to the last; returns the pages' items.
pub async fn all_pages(server: &Server, path: &str, limit: u32) -> Vec<Vec<Value>> {
    let mut pages = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let separator = if path.contains('?') { '&' } else { '?' };
        let mut url = format!("{path}{separator}limit={limit}");
        if let Some(cursor) = &cursor {
            url.push_str(&format!("&cursor={cursor}"));
        }
        let page = server.get_ok(TOKEN_A, &url).await;
        assert_eq!(keys(&page), ["items", "next_cursor"], "{page}");
        let items = page["items"].as_array().unwrap().clone();
        assert!(items.len() <= limit as usize);
        pages.push(items);
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => {
                assert!(page["next_cursor"].is_null(), "{page}");
                return pages;
            }
        }
        assert!(pages.len() < 100, "pagination does not end");
    }
}

// ---------------------------------------------------------------------------------------
// A minimal Server-Sent Events reader

/// One event: `id` (the seq), `event` (the kind) and `data` (an EventView), checked to agree.
#[derive(Debug, Clone, PartialEq)]
pub struct Ev {
    /// The server-sent `id`: the `seq`, or on a tree stream the whole cursor.
    pub id: String,
    pub seq: i64,
    pub kind: String,
    pub run_id: Option<String>,
    pub data: Value,
}

/// What an event stream sends: a stored event, or the live activity of a step in flight.
enum Item {
    Stored(Ev),
    Live(Value),
}

pub struct Sse {
    pub body: BoxStream<'static, reqwest::Result<Vec<u8>>>,
    pub buffer: Vec<u8>,
}

impl Sse {
    pub fn new(response: reqwest::Response) -> Sse {
        Sse {
            body: response
                .bytes_stream()
                .map(|chunk| chunk.map(|c| c.to_vec()))
                .boxed(),
            buffer: Vec::new(),
        }
    }

    /// The next stored event, or `None` when the server ended the stream. Live activity
    /// (no `id`, `live: true`) is passed over: what these tests check is the stored events.
    pub async fn next(&mut self) -> Option<Ev> {
        loop {
            match self.next_item().await? {
                Item::Stored(event) => return Some(event),
                Item::Live(_) => {}
            }
        }
    }

    /// Reads until the live activity says a batch running `tool` is in flight (a replay-safe
    /// call's `tool.call` is stored only with its step's commit); returns the stored events
    /// read on the way.
    pub async fn until_running(&mut self, tool: &str) -> Vec<Ev> {
        let mut events = Vec::new();
        let read = async {
            loop {
                match self.next_item().await.expect("the stream ended early") {
                    Item::Stored(event) => events.push(event),
                    Item::Live(data) => {
                        let activity = &data["payload"];
                        let running = activity["activity"] == "executing_tools"
                            && (activity["tools"].as_array())
                                .is_some_and(|tools| tools.iter().any(|t| t == tool));
                        if running {
                            return;
                        }
                    }
                }
            }
        };
        if timeout(DEADLINE, read).await.is_err() {
            panic!("no batch running {tool} was announced; got {events:#?}");
        }
        events
    }

    async fn next_item(&mut self) -> Option<Item> {
        let (mut id, mut kind, mut data) = (None::<String>, None::<String>, None::<String>);
        loop {
            while let Some(end) = self.buffer.iter().position(|b| *b == b'\n') {
                let raw: Vec<u8> = self.buffer.drain(..=end).collect();
                let text = String::from_utf8(raw).unwrap();
                let line = text.trim_end_matches(['\n', '\r']);
                if line.is_empty() {
                    let live = id.is_none() && data.as_deref().is_some_and(is_live);
                    if live {
                        let data = serde_json::from_str(&data.unwrap_or_default()).unwrap();
                        return Some(Item::Live(data));
                    } else if id.is_some() || kind.is_some() || data.is_some() {
                        return Some(Item::Stored(Ev::parse(id, kind, data)));
                    }
                    continue;
                }
                if line.starts_with(':') {
                    continue;
                }
                let (field, value) = line.split_once(':').unwrap_or((line, ""));
                let value = value.strip_prefix(' ').unwrap_or(value).to_owned();
                match field {
                    "id" => id = Some(value),
                    "event" => kind = Some(value),
                    "data" => match &mut data {
                        Some(data) => {
                            data.push('\n');
                            data.push_str(&value);
                        }
                        None => data = Some(value),
                    },
                    _ => {}
                }
            }
            match self.body.next().await {
                Some(chunk) => self.buffer.extend(chunk.expect("the event stream broke")),
                None => return None,
            }
        }
    }

    /// Reads until (and including) the first event matching `last`.
    pub async fn until(&mut self, mut last: impl FnMut(&Ev) -> bool) -> Vec<Ev> {
        let mut events = Vec::new();
        let read = async {
            loop {
                let event = self.next().await.expect("the stream ended early");
                let done = last(&event);
                events.push(event);
                if done {
                    return;
                }
            }
        };
        if timeout(DEADLINE, read).await.is_err() {
            panic!("the expected event never came; got {events:#?}");
        }
        events
    }

    /// Reads until the server ends the stream.
    pub async fn read_to_end(mut self) -> Vec<Ev> {
        let mut events = Vec::new();
        let read = async {
            while let Some(event) = self.next().await {
                events.push(event);
            }
        };
        if timeout(DEADLINE, read).await.is_err() {
            panic!("the stream did not end; got {events:#?}");
        }
        events
    }
}

impl Ev {
    pub fn parse(id: Option<String>, kind: Option<String>, data: Option<String>) -> Ev {
        let id = id.expect("every event has an id");
        let kind = kind.expect("every event has a kind");
        let data: Value = serde_json::from_str(&data.expect("every event has data")).unwrap();
        let seq = data["seq"].as_i64().expect("every event has a seq");
        if data.get("depth").is_none() {
            assert_eq!(id, seq.to_string(), "id and data.seq agree");
        }
        assert_eq!(data["kind"], kind.as_str(), "event and data.kind agree");
        Ev {
            id,
            seq,
            kind,
            run_id: data["run_id"].as_str().map(str::to_owned),
            data,
        }
    }
}

fn is_live(data: &str) -> bool {
    serde_json::from_str::<Value>(data).is_ok_and(|data| data["live"] == true)
}

pub fn seqs(events: &[Ev]) -> Vec<i64> {
    events.iter().map(|e| e.seq).collect()
}

pub fn kinds(events: &[Ev]) -> Vec<&str> {
    events.iter().map(|e| e.kind.as_str()).collect()
}

/// A model whose answer a test writes as a function of the request (no streaming).
pub struct FnModel<F>(pub F);

#[async_trait::async_trait]
impl<F> ratchet_llm::Model for FnModel<F>
where
    F: Fn(ratchet_llm::ModelRequest) -> ratchet_llm::Result<ratchet_core::ModelReply> + Send + Sync,
{
    async fn complete(
        &self,
        request: ratchet_llm::ModelRequest,
        _deltas: tokio::sync::mpsc::UnboundedSender<String>,
        _cancel: CancellationToken,
    ) -> ratchet_llm::Result<ratchet_core::ModelReply> {
        (self.0)(request)
    }
}
