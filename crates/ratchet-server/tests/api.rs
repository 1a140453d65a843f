//! The HTTP API over a real socket: a server on 127.0.0.1 with a fresh SQLite file, a real
//! worker pool and a scripted model, driven with reqwest. Covers every endpoint, tenants and
//! tokens, bad input, and the event streams' promise: resumable without a gap or a duplicate.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use ratchet_core::{ApprovalPolicy, Limits, MemoryScope, RunConfigSnapshot};
use ratchet_engine::{Coordinator, Engine, Models, PoolConfig, WorkerPool};
use ratchet_server::{AppState, Tokens, hash_token};
use ratchet_sqlite::SqliteStore;
use ratchet_store::Store;
use ratchet_tools::Registry;
use reqwest::header::CONTENT_TYPE;
use reqwest::{RequestBuilder, StatusCode};
use serde_json::{Value, json};
use tokio::time::{Instant, timeout};
use tokio_util::sync::CancellationToken;

const TOKEN_A: &str = "token-of-tenant-a";
const TOKEN_B: &str = "token-of-tenant-b";
/// Also tenant A's: a base64 token, whose `+`, `/` and `=` a URL must percent-encode.
const TOKEN_A_BASE64: &str = "q0/Lw+Zk9a==";
/// Bound on anything the tests wait for; a healthy run takes a small fraction of it.
const DEADLINE: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------
// Scripts

/// One tool round-trip, then an answer: three steps, no delays.
fn quick_script() -> Value {
    json!({"replies": [
        {"text": "Let me add.", "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]},
        {"text": "The sum is 5."}
    ]})
}

/// One answer of `words` words streamed `delay_ms` apart.
fn slow_script(words: usize, delay_ms: u64) -> Value {
    let text: Vec<String> = (1..=words).map(|i| format!("w{i}")).collect();
    json!({"replies": [{"text": text.join(" "), "chunk_delay_ms": delay_ms}]})
}

/// A tool call that sleeps for a minute: the run stays active until cancelled.
fn sleepy_script() -> Value {
    json!({"replies": [
        {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 60000}}]},
        {"text": "never"}
    ]})
}

// ---------------------------------------------------------------------------------------
// The server

struct Server {
    base: String,
    http: reqwest::Client,
    shutdown: CancellationToken,
    _pool: WorkerPool,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Server {
    async fn start(script: Value) -> Server {
        Server::start_with(script, |_, _| {}).await
    }

    /// A server whose run template and models `configure` adjusts first.
    async fn start_with(
        script: Value,
        configure: impl FnOnce(&mut RunConfigSnapshot, &Models),
    ) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let script_path = dir.path().join("script.json");
        std::fs::write(&script_path, script.to_string()).unwrap();
        let db = format!("sqlite://{}", dir.path().join("ratchet.db").display());
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open_url(&db).unwrap());
        let tools = Arc::new(Registry::builtin());
        let models = Arc::new(Models::new(
            tools.names().into_iter().map(str::to_owned).collect(),
        ));
        let coordinator = Coordinator::new(store);
        let engine = Arc::new(Engine::new(
            Arc::clone(&coordinator),
            Arc::clone(&models),
            tools,
        ));
        let mut run_template = RunConfigSnapshot {
            model: format!("scripted:{}", script_path.display()),
            workspace: None,
            system_prompt: String::new(),
            tools: Registry::builtin().specs(),
            limits: Limits::default(),
            memory_scope: MemoryScope::Session,
        };
        configure(&mut run_template, &models);
        let tokens = Tokens::new(HashMap::from([
            (hash_token(TOKEN_A), "tenant-a".to_owned()),
            (hash_token(TOKEN_B), "tenant-b".to_owned()),
            (hash_token(TOKEN_A_BASE64), "tenant-a".to_owned()),
        ]));
        let shutdown = CancellationToken::new();
        let state = AppState::new(
            Arc::clone(&coordinator),
            run_template,
            tokens,
            shutdown.clone(),
        );
        let pool = WorkerPool::start(
            coordinator,
            engine,
            PoolConfig {
                workers: 4,
                poll: Duration::from_millis(10),
                retry_backoff: Duration::from_millis(10),
                ..PoolConfig::default()
            },
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
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
            _pool: pool,
            _dir: dir,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn get(&self, token: &str, path: &str) -> RequestBuilder {
        self.http.get(self.url(path)).bearer_auth(token)
    }

    fn post(&self, token: &str, path: &str, body: Value) -> RequestBuilder {
        self.http
            .post(self.url(path))
            .bearer_auth(token)
            .json(&body)
    }

    async fn get_ok(&self, token: &str, path: &str) -> Value {
        let reply = call(self.get(token, path)).await;
        assert_eq!(reply.status, StatusCode::OK, "GET {path}: {}", reply.body);
        reply.body
    }

    async fn create_session(&self, token: &str) -> String {
        let reply = call(self.post(token, "/v1/sessions", json!({}))).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
        reply.body["id"].as_str().unwrap().to_owned()
    }

    /// Posts a message; returns the 202 body.
    async fn send(&self, token: &str, session: &str, content: &str) -> Value {
        let path = format!("/v1/sessions/{session}/messages");
        let reply = call(self.post(token, &path, json!({"content": content}))).await;
        assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.body);
        reply.body
    }

    /// Opens an event stream (tenant A) and checks that it is one.
    async fn stream(&self, path: &str, last_event_id: Option<&str>) -> Sse {
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
    async fn replay(&self, path: &str, last_event_id: Option<&str>) -> Vec<Ev> {
        self.stream(path, last_event_id).await.read_to_end().await
    }

    /// Waits for the run's `run.finished` (on its own event stream) and returns the run.
    async fn finish(&self, run: &str) -> Value {
        self.finish_again(run, 1).await
    }

    /// Waits for the run's `nth` `run.finished` (a continued run ends more than once).
    async fn finish_again(&self, run: &str, nth: usize) -> Value {
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

struct Reply {
    status: StatusCode,
    content_type: String,
    body: Value,
}

/// Sends a request; the body must be JSON, whatever the status.
async fn call(request: RequestBuilder) -> Reply {
    timeout(DEADLINE, call_inner(request))
        .await
        .expect("no complete answer in time")
}

async fn call_inner(request: RequestBuilder) -> Reply {
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

fn keys(value: &Value) -> Vec<&str> {
    let mut keys: Vec<&str> = value
        .as_object()
        .map(|o| o.keys().map(String::as_str).collect())
        .unwrap_or_default();
    keys.sort_unstable();
    keys
}

/// The status, and a body of exactly `{"error": {"code", "message"}}`.
fn assert_error(what: &str, reply: &Reply, status: StatusCode, code: &str) {
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

fn ids(items: &Value) -> Vec<String> {
    items
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap().to_owned())
        .collect()
}

/// Follows `next_cursor` from the first page to the last; returns the pages' items.
async fn all_pages(server: &Server, path: &str, limit: u32) -> Vec<Vec<Value>> {
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
struct Ev {
    seq: i64,
    kind: String,
    run_id: Option<String>,
    data: Value,
}

struct Sse {
    body: BoxStream<'static, reqwest::Result<Vec<u8>>>,
    buffer: Vec<u8>,
}

impl Sse {
    fn new(response: reqwest::Response) -> Sse {
        Sse {
            body: response
                .bytes_stream()
                .map(|chunk| chunk.map(|c| c.to_vec()))
                .boxed(),
            buffer: Vec::new(),
        }
    }

    /// The next event, or `None` when the server ended the stream.
    async fn next(&mut self) -> Option<Ev> {
        let (mut id, mut kind, mut data) = (None::<String>, None::<String>, None::<String>);
        loop {
            while let Some(end) = self.buffer.iter().position(|b| *b == b'\n') {
                let raw: Vec<u8> = self.buffer.drain(..=end).collect();
                let text = String::from_utf8(raw).unwrap();
                let line = text.trim_end_matches(['\n', '\r']);
                if line.is_empty() {
                    if id.is_some() || kind.is_some() || data.is_some() {
                        return Some(Ev::parse(id, kind, data));
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
    async fn until(&mut self, mut last: impl FnMut(&Ev) -> bool) -> Vec<Ev> {
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
    async fn read_to_end(mut self) -> Vec<Ev> {
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
    fn parse(id: Option<String>, kind: Option<String>, data: Option<String>) -> Ev {
        let id = id.expect("every event has an id");
        let kind = kind.expect("every event has a kind");
        let data: Value = serde_json::from_str(&data.expect("every event has data")).unwrap();
        let seq: i64 = id.parse().unwrap();
        assert_eq!(data["seq"], seq, "id and data.seq agree");
        assert_eq!(data["kind"], kind.as_str(), "event and data.kind agree");
        Ev {
            seq,
            kind,
            run_id: data["run_id"].as_str().map(str::to_owned),
            data,
        }
    }
}

fn seqs(events: &[Ev]) -> Vec<i64> {
    events.iter().map(|e| e.seq).collect()
}

fn kinds(events: &[Ev]) -> Vec<&str> {
    events.iter().map(|e| e.kind.as_str()).collect()
}

// ---------------------------------------------------------------------------------------
// Endpoints

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_created_fetched_and_listed_page_by_page() {
    let server = Server::start(quick_script()).await;
    let created = call(server.post(
        TOKEN_A,
        "/v1/sessions",
        json!({"agent": "default", "metadata": {"team": "blue"}}),
    ))
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let first = created.body["id"].as_str().unwrap().to_owned();
    assert!(first.starts_with("ses_"), "{first}");
    assert_eq!(created.body["agent"], "default");
    assert_eq!(created.body["metadata"], json!({"team": "blue"}));
    assert!(created.body["active_run_id"].is_null());
    assert!(created.body["created_at"].as_i64().unwrap() > 0);
    let fetched = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{first}"))
        .await;
    assert_eq!(fetched, created.body);

    let mut created: Vec<String> = vec![first];
    for _ in 0..4 {
        created.push(server.create_session(TOKEN_A).await);
    }
    let pages = all_pages(&server, "/v1/sessions", 2).await;
    let sizes: Vec<usize> = pages.iter().map(Vec::len).collect();
    assert_eq!(sizes, [2, 2, 1], "5 sessions in pages of 2");
    let listed: Vec<String> = pages
        .iter()
        .flat_map(|p| ids(&Value::Array(p.clone())))
        .collect();
    let mut expected = created.clone();
    expected.sort();
    assert_eq!(listed, expected, "every session once, in id order");

    let whole = server.get_ok(TOKEN_A, "/v1/sessions").await;
    assert_eq!(ids(&whole["items"]), expected);
    assert!(whole["next_cursor"].is_null());
    let tail = server
        .get_ok(TOKEN_A, &format!("/v1/sessions?cursor={}", expected[2]))
        .await;
    assert_eq!(ids(&tail["items"]), expected[3..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_runs_to_completion_with_its_messages_runs_and_steps_listed() {
    let server = Server::start(quick_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let accepted = server.send(TOKEN_A, &session, "hello").await;
    assert_eq!(
        keys(&accepted),
        ["message_id", "run_id", "run_status", "steered"],
        "{accepted}"
    );
    assert!(accepted["message_id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(accepted["run_status"], "running");
    let run = accepted["run_id"].as_str().unwrap().to_owned();
    assert!(run.starts_with("run_"));

    let state = server.finish(&run).await;
    assert_eq!(state["id"], run.as_str());
    assert_eq!(state["session_id"], session.as_str());
    assert_eq!(state["status"], "completed", "{state}");
    assert!(state["stop_reason"].is_string(), "{state}");
    assert_eq!(state["step_index"], 3, "llm, tools, llm: {state}");
    assert_eq!(state["usage"]["model_calls"], 2, "{state}");
    assert_eq!(state["usage"]["tool_calls"], 1, "{state}");
    assert!(state["usage"]["output_tokens"].as_u64().unwrap() > 0);
    assert_eq!(state["final_answer"], "The sum is 5.");
    assert!(state["finished_at"].as_i64().unwrap() >= state["created_at"].as_i64().unwrap());
    let session_now = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}"))
        .await;
    assert!(session_now["active_run_id"].is_null(), "{session_now}");

    // Messages: the conversation in order.
    let messages_path = format!("/v1/sessions/{session}/messages");
    let messages = server.get_ok(TOKEN_A, &messages_path).await;
    assert!(messages["next_cursor"].is_null());
    let items = messages["items"].as_array().unwrap();
    let field =
        |name: &str| -> Vec<&str> { items.iter().map(|m| m[name].as_str().unwrap()).collect() };
    assert_eq!(field("role"), ["user", "assistant", "tool", "assistant"]);
    assert_eq!(field("origin"), ["user", "agent", "agent", "agent"]);
    assert_eq!(field("visibility"), ["visible"; 4]);
    assert_eq!(field("run_id"), [run.as_str(); 4]);
    let contents = field("content");
    assert_eq!(contents[0], "hello");
    assert_eq!(contents[1], "Let me add.");
    assert!(
        contents[2].contains('5'),
        "the tool's result: {}",
        contents[2]
    );
    assert_eq!(contents[3], "The sum is 5.");
    assert_eq!(items[0]["id"], accepted["message_id"]);
    let calls = items[1]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["name"], "add");
    assert_eq!(items[2]["tool_call_id"], calls[0]["id"]);
    // One message per page gives the same conversation.
    let pages = all_pages(&server, &messages_path, 1).await;
    let paged: Vec<Value> = pages.concat();
    assert_eq!(&paged, items);

    // Runs of the session.
    let runs = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}/runs"))
        .await;
    assert_eq!(ids(&runs["items"]), [run.as_str()]);
    assert_eq!(runs["items"][0]["status"], "completed");
    assert_eq!(runs["items"][0]["step_index"], 3);

    // Steps, numbered from 1, and paged by index.
    let steps_path = format!("/v1/runs/{run}/steps");
    let steps = server.get_ok(TOKEN_A, &steps_path).await;
    let steps = steps["items"].as_array().unwrap();
    let indexes: Vec<u64> = steps.iter().map(|s| s["index"].as_u64().unwrap()).collect();
    assert_eq!(indexes, [1, 2, 3]);
    for step in steps {
        assert!(step["instruction"].as_str().is_some_and(|i| !i.is_empty()));
        assert!(step["duration_ms"].as_i64().unwrap() >= 0);
    }
    let paged: Vec<Value> = all_pages(&server, &steps_path, 2).await.concat();
    assert_eq!(&paged, steps);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multitask_interrupt_cancels_the_active_run_and_starts_the_new_one() {
    let server = Server::start(sleepy_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let first = server.send(TOKEN_A, &session, "sleep").await;
    let run = first["run_id"].as_str().unwrap().to_owned();
    let mut run_events = server.stream(&format!("/v1/runs/{run}/events"), None).await;
    run_events.until(|e| e.kind == "tool.call").await;

    let messages_path = format!("/v1/sessions/{session}/messages");
    let interrupting = call(server.post(
        TOKEN_A,
        &messages_path,
        json!({"content": "forget that", "multitask": "interrupt"}),
    ))
    .await;
    assert_eq!(
        interrupting.status,
        StatusCode::ACCEPTED,
        "{}",
        interrupting.body
    );
    let newcomer = interrupting.body["run_id"].as_str().unwrap().to_owned();
    let ended = server.finish(&run).await;
    assert_eq!(ended["status"], "cancelled", "{ended}");
    assert_eq!(ended["stop_reason"], "cancelled");
    let mut newcomer_events = server
        .stream(&format!("/v1/runs/{newcomer}/events"), None)
        .await;
    newcomer_events.until(|e| e.kind == "tool.call").await;
    let session_now = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}"))
        .await;
    assert_eq!(
        session_now["active_run_id"],
        newcomer.as_str(),
        "the newcomer holds the session"
    );
    let cancelled = call(
        server
            .http
            .post(server.url(&format!("/v1/runs/{newcomer}/cancel")))
            .bearer_auth(TOKEN_A),
    )
    .await;
    assert_eq!(cancelled.status, StatusCode::OK, "{}", cancelled.body);
    assert_eq!(server.finish(&newcomer).await["status"], "cancelled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multitask_reject_conflicts_enqueue_queues_and_a_slow_run_is_cancelled() {
    let server = Server::start(sleepy_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let first = server.send(TOKEN_A, &session, "sleep").await;
    assert_eq!(first["run_status"], "running");
    let run = first["run_id"].as_str().unwrap().to_owned();
    let mut run_events = server.stream(&format!("/v1/runs/{run}/events"), None).await;
    run_events.until(|e| e.kind == "tool.call").await;

    let messages_path = format!("/v1/sessions/{session}/messages");
    let rejected = call(server.post(
        TOKEN_A,
        &messages_path,
        json!({"content": "now", "multitask": "reject"}),
    ))
    .await;
    assert_error(
        "reject while active",
        &rejected,
        StatusCode::CONFLICT,
        "conflict",
    );
    let queued = call(server.post(
        TOKEN_A,
        &messages_path,
        json!({"content": "later", "multitask": "enqueue"}),
    ))
    .await;
    assert_eq!(queued.status, StatusCode::ACCEPTED, "{}", queued.body);
    assert_eq!(queued.body["run_status"], "queued");
    let queued_run = queued.body["run_id"].as_str().unwrap().to_owned();

    let session_now = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}"))
        .await;
    assert_eq!(session_now["active_run_id"], run.as_str());
    let runs = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}/runs"))
        .await;
    let statuses: BTreeMap<String, String> = runs["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["id"].as_str().unwrap().to_owned(),
                r["status"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        statuses,
        BTreeMap::from([
            (run.clone(), "running".to_owned()),
            (queued_run.clone(), "queued".to_owned()),
        ])
    );
    let contents: Vec<String> = server.get_ok(TOKEN_A, &messages_path).await["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"].as_str().unwrap().to_owned())
        .collect();
    assert!(
        !contents.contains(&"now".to_owned()),
        "a rejected message is not recorded: {contents:?}"
    );

    // The queued run has no step in flight: it ends at once.
    let cancel = |id: &str| {
        server
            .http
            .post(server.url(&format!("/v1/runs/{id}/cancel")))
    };
    let cancelled = call(cancel(&queued_run).bearer_auth(TOKEN_A)).await;
    assert_eq!(cancelled.status, StatusCode::OK, "{}", cancelled.body);
    assert_eq!(
        cancelled.body,
        json!({"run_id": queued_run, "status": "cancelled"})
    );

    // The running one is sleeping inside a tool: it winds down.
    let cancelling = call(cancel(&run).bearer_auth(TOKEN_A)).await;
    assert_eq!(cancelling.status, StatusCode::OK, "{}", cancelling.body);
    assert_eq!(
        cancelling.body,
        json!({"run_id": run, "status": "cancelling"})
    );
    let started = Instant::now();
    run_events.until(|e| e.kind == "run.finished").await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the sleep was interrupted"
    );
    let state = server.get_ok(TOKEN_A, &format!("/v1/runs/{run}")).await;
    assert_eq!(state["status"], "cancelled", "{state}");
    assert_eq!(state["stop_reason"], "cancelled", "{state}");
    assert!(state["finished_at"].is_i64());
    let again = call(cancel(&run).bearer_auth(TOKEN_A)).await;
    assert_eq!(again.body, json!({"run_id": run, "status": "cancelled"}));
    let queued_state = server
        .get_ok(TOKEN_A, &format!("/v1/runs/{queued_run}"))
        .await;
    assert_eq!(queued_state["status"], "cancelled", "{queued_state}");
    let session_now = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}"))
        .await;
    assert!(session_now["active_run_id"].is_null(), "{session_now}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_metrics_and_the_openapi_document() {
    let server = Server::start(quick_script()).await;
    let health = call(server.http.get(server.url("/healthz"))).await;
    assert_eq!(health.status, StatusCode::OK);
    assert_eq!(health.body, json!({"status": "ok"}));
    let ready = call(server.http.get(server.url("/readyz"))).await;
    assert_eq!(ready.status, StatusCode::OK);
    assert_eq!(ready.body, json!({"status": "ready"}));

    let session = server.create_session(TOKEN_A).await;
    let run = server.send(TOKEN_A, &session, "hello").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    server.finish(&run).await;
    let response = server
        .http
        .get(server.url("/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        response.headers()[CONTENT_TYPE]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    let text = response.text().await.unwrap();
    let value_of = |series: &str| -> f64 {
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
            .trim()
            .parse()
            .unwrap()
    };
    assert!(value_of("ratchet_steps_committed_total") >= 3.0);
    assert_eq!(value_of(r#"ratchet_runs{status="completed"}"#), 1.0);
    assert_eq!(value_of(r#"ratchet_runs{status="running"}"#), 0.0);

    let openapi = call(server.http.get(server.url("/openapi.json"))).await;
    assert_eq!(openapi.status, StatusCode::OK);
    assert!(openapi.body["openapi"].as_str().unwrap().starts_with('3'));
    let paths: BTreeMap<&str, Vec<&str>> = openapi.body["paths"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(path, _)| path.starts_with("/v1"))
        .map(|(path, item)| (path.as_str(), keys(item)))
        .collect();
    let expected = BTreeMap::from([
        ("/v1/sessions", vec!["get", "post"]),
        ("/v1/sessions/{id}", vec!["get"]),
        ("/v1/sessions/{id}/messages", vec!["get", "post"]),
        ("/v1/sessions/{id}/runs", vec!["get"]),
        ("/v1/sessions/{id}/events", vec!["get"]),
        ("/v1/runs/{id}", vec!["get"]),
        ("/v1/runs/{id}/steps", vec!["get"]),
        ("/v1/runs/{id}/cancel", vec!["post"]),
        ("/v1/runs/{id}/reconcile", vec!["post"]),
        ("/v1/runs/{id}/retry", vec!["post"]),
        ("/v1/runs/{id}/continue", vec!["post"]),
        ("/v1/approvals", vec!["get"]),
        ("/v1/approvals/{id}", vec!["get", "post"]),
        ("/v1/runs/{id}/events", vec!["get"]),
    ]);
    assert_eq!(paths, expected);
}

/// Reconciliation answers only a run that waits for that call; a finished run says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciling_a_run_that_is_not_in_doubt_is_a_conflict() {
    let server = Server::start(quick_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let run = server.send(TOKEN_A, &session, "hello").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    server.finish(&run).await;
    let path = format!("/v1/runs/{run}/reconcile");
    let post = |body: Value| {
        server
            .http
            .post(server.url(&path))
            .bearer_auth(TOKEN_A)
            .json(&body)
    };
    let answer = call(post(json!({"call_id": "call_0_0", "outcome": "succeeded"}))).await;
    assert_eq!(answer.status, StatusCode::CONFLICT, "{}", answer.body);
    assert_eq!(answer.body["error"]["code"], "conflict");
    let message = answer.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("not waiting for reconciliation"),
        "{message}"
    );
    let bad = call(post(json!({"call_id": "call_0_0", "outcome": "maybe"}))).await;
    assert_eq!(bad.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", bad.body);
    let other_tenant = server
        .http
        .post(server.url(&path))
        .bearer_auth(TOKEN_B)
        .json(&json!({"call_id": "call_0_0", "outcome": "skip"}));
    assert_eq!(call(other_tenant).await.status, StatusCode::NOT_FOUND);
}

// ---------------------------------------------------------------------------------------
// Tenants and tokens

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_sees_nothing_of_another_tenants_sessions_runs_and_events() {
    let server = Server::start(quick_script()).await;
    let a_session = server.create_session(TOKEN_A).await;
    let a_run = server.send(TOKEN_A, &a_session, "hello").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    server.finish(&a_run).await;
    let b_session = server.create_session(TOKEN_B).await;

    let reads = [
        format!("/v1/sessions/{a_session}"),
        format!("/v1/sessions/{a_session}/messages"),
        format!("/v1/sessions/{a_session}/runs"),
        format!("/v1/sessions/{a_session}/events"),
        format!("/v1/sessions/{a_session}/events?follow=false"),
        format!("/v1/runs/{a_run}"),
        format!("/v1/runs/{a_run}/steps"),
        format!("/v1/runs/{a_run}/events"),
    ];
    for path in &reads {
        // A sees it (a followed stream never ends: only its status is read); B gets the same
        // answer as for an id that does not exist.
        let response = timeout(DEADLINE, server.get(TOKEN_A, path).send())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{path}");
        drop(response);
        assert_error(
            path,
            &call(server.get(TOKEN_B, path)).await,
            StatusCode::NOT_FOUND,
            "not_found",
        );
    }
    let post_message = call(server.post(
        TOKEN_B,
        &format!("/v1/sessions/{a_session}/messages"),
        json!({"content": "intrude"}),
    ))
    .await;
    assert_error("B posts", &post_message, StatusCode::NOT_FOUND, "not_found");
    let cancel = call(
        server
            .http
            .post(server.url(&format!("/v1/runs/{a_run}/cancel")))
            .bearer_auth(TOKEN_B),
    )
    .await;
    assert_error("B cancels", &cancel, StatusCode::NOT_FOUND, "not_found");
    let stolen = call(server.http.get(server.url(&format!(
        "/v1/sessions/{a_session}/events?follow=false&access_token={TOKEN_B}"
    ))))
    .await;
    assert_error(
        "B's query token",
        &stolen,
        StatusCode::NOT_FOUND,
        "not_found",
    );

    let b_list = server.get_ok(TOKEN_B, "/v1/sessions").await;
    assert_eq!(ids(&b_list["items"]), [b_session.as_str()]);
    let a_list = server.get_ok(TOKEN_A, "/v1/sessions").await;
    assert_eq!(ids(&a_list["items"]), [a_session.as_str()]);
    // A's messages are untouched by B's attempt.
    let messages = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{a_session}/messages"))
        .await;
    assert_eq!(messages["items"].as_array().unwrap().len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_a_valid_token_are_refused_and_streams_take_a_query_token() {
    let server = Server::start(quick_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let unauthorized = StatusCode::UNAUTHORIZED;
    let missing = call(server.http.get(server.url("/v1/sessions"))).await;
    assert_error("no token", &missing, unauthorized, "unauthorized");
    let wrong = call(server.get("not-a-token", "/v1/sessions")).await;
    assert_error("wrong token", &wrong, unauthorized, "unauthorized");
    let scheme = call(
        server
            .http
            .get(server.url("/v1/sessions"))
            .header("authorization", format!("Basic {TOKEN_A}")),
    )
    .await;
    assert_error("not bearer", &scheme, unauthorized, "unauthorized");
    let post = call(
        server
            .http
            .post(server.url("/v1/sessions"))
            .json(&json!({})),
    )
    .await;
    assert_error("no token, POST", &post, unauthorized, "unauthorized");
    let events = format!("/v1/sessions/{session}/events?follow=false");
    let no_token = call(server.http.get(server.url(&events))).await;
    assert_error("stream, no token", &no_token, unauthorized, "unauthorized");
    let bad_query = call(
        server
            .http
            .get(server.url(&format!("{events}&access_token=nope"))),
    )
    .await;
    assert_error(
        "stream, wrong token",
        &bad_query,
        unauthorized,
        "unauthorized",
    );
    // Nothing was created by the refused requests.
    let listed = server.get_ok(TOKEN_A, "/v1/sessions").await;
    assert_eq!(ids(&listed["items"]), [session.as_str()]);

    let run = server.send(TOKEN_A, &session, "hello").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    server.finish(&run).await;
    let by_header = server.replay(&events, None).await;
    assert!(!by_header.is_empty());
    let response = server
        .http
        .get(server.url(&format!("{events}&access_token={TOKEN_A}")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let by_query = Sse::new(response).read_to_end().await;
    assert_eq!(by_query, by_header);
    // A token with URL-special characters, percent-encoded as a URL requires.
    let response = server
        .http
        .get(server.url(&format!("{events}&access_token=q0%2FLw%2BZk9a%3D%3D")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK, "{}", response.url());
    assert_eq!(Sse::new(response).read_to_end().await, by_header);
    // Only event streams take a token from the URL; elsewhere it would only end up in logs.
    let run_path = format!("/v1/runs/{run}?access_token={TOKEN_A}");
    let response = server.http.get(server.url(&run_path)).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
}

// ---------------------------------------------------------------------------------------
// Bad input

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_the_right_status_and_a_json_error() {
    let server = Server::start(quick_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let messages = format!("/v1/sessions/{session}/messages");
    let raw = |path: &str, body: &'static str| {
        server
            .http
            .post(server.url(path))
            .bearer_auth(TOKEN_A)
            .header(CONTENT_TYPE, "application/json")
            .body(body)
    };
    let (bad, unprocessable) = (StatusCode::BAD_REQUEST, StatusCode::UNPROCESSABLE_ENTITY);

    // Bodies.
    for (what, request, status, code) in [
        ("malformed", raw("/v1/sessions", "{"), bad, "bad_request"),
        (
            "malformed",
            raw(&messages, r#"{"content": "hi""#),
            bad,
            "bad_request",
        ),
        (
            "wrong type",
            raw(&messages, r#"{"content": 5}"#),
            unprocessable,
            "invalid_request",
        ),
        (
            "wrong type",
            raw("/v1/sessions", r#"{"metadata": [1]}"#),
            unprocessable,
            "invalid_request",
        ),
        (
            "bad enum",
            raw(&messages, r#"{"content": "x", "multitask": "maybe"}"#),
            unprocessable,
            "invalid_request",
        ),
        (
            "unknown field",
            raw(&messages, r#"{"content": "x", "colour": "red"}"#),
            unprocessable,
            "invalid_request",
        ),
        (
            "unknown field",
            raw("/v1/sessions", r#"{"name": "x"}"#),
            unprocessable,
            "invalid_request",
        ),
        (
            "missing field",
            raw(&messages, "{}"),
            unprocessable,
            "invalid_request",
        ),
        (
            "empty content",
            raw(&messages, r#"{"content": ""}"#),
            unprocessable,
            "invalid_request",
        ),
        (
            "blank content",
            raw(&messages, r#"{"content": " \n\t "}"#),
            unprocessable,
            "invalid_request",
        ),
        (
            "unknown agent",
            raw("/v1/sessions", r#"{"agent": "nobody"}"#),
            unprocessable,
            "invalid_request",
        ),
    ] {
        assert_error(what, &call(request).await, status, code);
    }
    for path in ["/v1/sessions", messages.as_str()] {
        let request = server
            .http
            .post(server.url(path))
            .bearer_auth(TOKEN_A)
            .body(r#"{"content": "hi"}"#);
        assert_error(
            "no content type",
            &call(request).await,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        );
    }
    let huge = json!({"content": "a".repeat(1 << 20)});
    assert_error(
        "oversized",
        &call(server.post(TOKEN_A, &messages, huge)).await,
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
    );

    // Ids.
    let missing_session = "ses_0000000000000000000000000000000";
    let missing_run = "run_0000000000000000000000000000000";
    let mut gets: Vec<(String, StatusCode)> = Vec::new();
    for bad_session in [
        "nope",
        "ses_",
        "ses_a.b",
        "run_abc",
        format!("ses_{}", "a".repeat(65)).as_str(),
    ] {
        for suffix in ["", "/messages", "/runs", "/events"] {
            gets.push((format!("/v1/sessions/{bad_session}{suffix}"), bad));
        }
    }
    for bad_run in ["nope", "run_", "ses_abc"] {
        for suffix in ["", "/steps", "/events"] {
            gets.push((format!("/v1/runs/{bad_run}{suffix}"), bad));
        }
    }
    for suffix in ["", "/messages", "/runs", "/events"] {
        gets.push((
            format!("/v1/sessions/{missing_session}{suffix}"),
            StatusCode::NOT_FOUND,
        ));
    }
    for suffix in ["", "/steps", "/events"] {
        gets.push((
            format!("/v1/runs/{missing_run}{suffix}"),
            StatusCode::NOT_FOUND,
        ));
    }
    // Query strings: limits, cursors, stream positions, unknown parameters.
    for list in [
        "/v1/sessions".to_owned(),
        messages.clone(),
        format!("/v1/sessions/{session}/runs"),
    ] {
        for query in [
            "limit=0",
            "limit=201",
            "limit=-1",
            "limit=abc",
            "colour=red",
        ] {
            gets.push((format!("{list}?{query}"), bad));
        }
        gets.push((format!("{list}?limit=200"), StatusCode::OK));
    }
    for query in ["cursor=garbage", "cursor=ses_a.b"] {
        gets.push((format!("/v1/sessions?{query}"), bad));
    }
    gets.push((format!("{messages}?cursor=abc"), bad));
    gets.push((format!("/v1/sessions/{session}/runs?cursor=nope"), bad));
    let events = format!("/v1/sessions/{session}/events");
    for query in [
        "after=-1",
        "after=abc",
        "after=1.5",
        "follow=maybe",
        "colour=red",
    ] {
        gets.push((format!("{events}?{query}"), bad));
    }
    gets.push(("/v1/nope".to_owned(), StatusCode::NOT_FOUND));
    gets.push(("/nope".to_owned(), StatusCode::NOT_FOUND));
    gets.push(("/v1/sessions/a/b/c".to_owned(), StatusCode::NOT_FOUND));
    for (path, status) in gets {
        let reply = call(server.get(TOKEN_A, &path)).await;
        if status == StatusCode::OK {
            assert_eq!(reply.status, status, "{path}: {}", reply.body);
        } else {
            let code = if status == bad {
                "bad_request"
            } else {
                "not_found"
            };
            assert_error(&path, &reply, status, code);
        }
    }
    for (id, status, code) in [
        ("nope", bad, "bad_request"),
        (missing_run, StatusCode::NOT_FOUND, "not_found"),
    ] {
        let cancel = server
            .http
            .post(server.url(&format!("/v1/runs/{id}/cancel")))
            .bearer_auth(TOKEN_A);
        assert_error("cancel", &call(cancel).await, status, code);
    }
    let post_missing = call(server.post(
        TOKEN_A,
        &format!("/v1/sessions/{missing_session}/messages"),
        json!({"content": "hi"}),
    ))
    .await;
    assert_error("post", &post_missing, StatusCode::NOT_FOUND, "not_found");
    // Run steps' cursor and stream positions need a run.
    let run = server.send(TOKEN_A, &session, "hello").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    server.finish(&run).await;
    for query in ["cursor=-1", "cursor=x", "limit=0", "limit=201"] {
        let path = format!("/v1/runs/{run}/steps?{query}");
        assert_error(
            &path,
            &call(server.get(TOKEN_A, &path)).await,
            bad,
            "bad_request",
        );
    }
    for path in [events.clone(), format!("/v1/runs/{run}/events")] {
        for header in ["-1", "abc", "", "1.5"] {
            let request = server.get(TOKEN_A, &path).header("last-event-id", header);
            assert_error(
                &format!("{path} Last-Event-ID {header:?}"),
                &call(request).await,
                bad,
                "bad_request",
            );
        }
        let path = format!("{path}?after=-3");
        assert_error(
            &path,
            &call(server.get(TOKEN_A, &path)).await,
            bad,
            "bad_request",
        );
    }
    // Only the one good message was recorded.
    let recorded = server.get_ok(TOKEN_A, &messages).await;
    let users: Vec<&str> = recorded["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "user")
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(users, ["hello"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_method_gets_a_json_error() {
    let server = Server::start(quick_script()).await;
    let reply = call(
        server
            .http
            .delete(server.url("/v1/sessions"))
            .bearer_auth(TOKEN_A),
    )
    .await;
    assert_error(
        "DELETE /v1/sessions",
        &reply,
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
    );
}

// ---------------------------------------------------------------------------------------
// Event streams

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnecting_client_gets_exactly_the_events_it_missed() {
    // 25 words 40 ms apart: the run streams for about 1 s, its deltas flushed every ~100 ms.
    let server = Server::start(slow_script(25, 40)).await;
    let session = server.create_session(TOKEN_A).await;
    let path = format!("/v1/sessions/{session}/events");
    let mut first = server.stream(&path, None).await;
    server.send(TOKEN_A, &session, "talk slowly").await;
    let mut deltas = 0;
    let seen = first
        .until(|e| {
            deltas += usize::from(e.kind == "assistant.delta");
            deltas == 3
        })
        .await;
    drop(first);
    let last = seen.last().unwrap().seq;
    assert_eq!(seqs(&seen), (1..=last).collect::<Vec<_>>());
    assert!(
        !kinds(&seen).contains(&"run.finished"),
        "disconnected mid-run"
    );

    // The run goes on without the client; wait until it has produced events it missed.
    let deadline = Instant::now() + DEADLINE;
    loop {
        let missed = server
            .replay(&format!("{path}?after={last}&follow=false"), None)
            .await;
        if !missed.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "the run stalled");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let mut second = server.stream(&path, Some(&last.to_string())).await;
    let mut resumed = second.until(|e| e.kind == "run.finished").await;
    let full = server.replay(&format!("{path}?follow=false"), None).await;
    let total = full.last().unwrap().seq;
    if resumed.last().unwrap().seq < total {
        resumed.extend(second.until(|e| e.seq == total).await);
    }
    assert_eq!(seqs(&full), (1..=total).collect::<Vec<_>>(), "dense seqs");
    assert_eq!(
        resumed[0].seq,
        last + 1,
        "resumed right after the last seen"
    );
    assert!(
        kinds(&resumed).contains(&"assistant.delta"),
        "missed deltas"
    );
    let union: Vec<Ev> = seen.into_iter().chain(resumed).collect();
    assert_eq!(union, full, "no gap, no duplicate, same events");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_from_any_seq_is_the_suffix_of_the_full_stream() {
    let server = Server::start(quick_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let run = server.send(TOKEN_A, &session, "hello").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    server.finish(&run).await;
    let path = format!("/v1/sessions/{session}/events");
    let full = server.replay(&format!("{path}?follow=false"), None).await;
    let n = full.len();
    assert!(n >= 10, "a run of three steps has many events: {n}");
    assert_eq!(seqs(&full), (1..=n as i64).collect::<Vec<_>>());
    assert_eq!(full[0].kind, "run.created");
    assert_eq!(full[n - 1].kind, "run.finished");
    for k in 0..=n + 2 {
        let suffix = &full[k.min(n)..];
        let by_query = server
            .replay(&format!("{path}?after={k}&follow=false"), None)
            .await;
        assert_eq!(by_query, suffix, "after={k}");
        let by_header = server
            .replay(&format!("{path}?follow=false"), Some(&k.to_string()))
            .await;
        assert_eq!(by_header, suffix, "Last-Event-ID: {k}");
    }
    // The header wins over the query parameter.
    let both = server
        .replay(&format!("{path}?after=7&follow=false"), Some("3"))
        .await;
    assert_eq!(both, full[3..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_subscribers_see_the_same_ordered_stream() {
    // About half a second of streaming, while subscribers come and go.
    let server = Server::start(slow_script(20, 25)).await;
    let session = server.create_session(TOKEN_A).await;
    let path = format!("/v1/sessions/{session}/events");
    // Half subscribe before the run starts, half while it runs.
    let mut streams = Vec::new();
    for _ in 0..25 {
        streams.push(server.stream(&path, None).await);
    }
    server.send(TOKEN_A, &session, "hello everyone").await;
    let late = futures::future::join_all((0..25).map(|_| server.stream(&path, None))).await;
    streams.extend(late);
    let readers: Vec<_> = streams
        .into_iter()
        .map(|mut stream| {
            tokio::spawn(async move { stream.until(|e| e.kind == "run.finished").await })
        })
        .collect();
    let mut seen = Vec::new();
    for reader in readers {
        seen.push(reader.await.unwrap());
    }
    let full = server.replay(&format!("{path}?follow=false"), None).await;
    assert_eq!(seqs(&full), (1..=full.len() as i64).collect::<Vec<_>>());
    assert!(
        kinds(&full)
            .iter()
            .filter(|k| **k == "assistant.delta")
            .count()
            >= 2
    );
    for (i, events) in seen.iter().enumerate() {
        assert_eq!(events, &full[..events.len()], "subscriber {i}");
        assert_eq!(events.len(), seen[0].len(), "subscriber {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_stream_carries_only_that_runs_events() {
    let server = Server::start(quick_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let first = server.send(TOKEN_A, &session, "one").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let second = server.send(TOKEN_A, &session, "two").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    // Followed live from the start, until the run's own end.
    let mut live_second = server
        .stream(&format!("/v1/runs/{second}/events"), None)
        .await;
    let live = live_second.until(|e| e.kind == "run.finished").await;
    server.finish(&first).await;
    server.finish(&second).await;

    let full = server
        .replay(&format!("/v1/sessions/{session}/events?follow=false"), None)
        .await;
    assert_eq!(seqs(&full), (1..=full.len() as i64).collect::<Vec<_>>());
    let mut covered = BTreeSet::new();
    for run in [&first, &second] {
        let own: Vec<Ev> = full
            .iter()
            .filter(|e| e.run_id.as_deref() == Some(run.as_str()))
            .cloned()
            .collect();
        assert!(kinds(&own).contains(&"run.finished"), "{run}");
        let replayed = server
            .replay(&format!("/v1/runs/{run}/events?follow=false"), None)
            .await;
        assert_eq!(replayed, own, "{run}");
        // Resuming a run stream counts in session seqs.
        let middle = own[own.len() / 2].seq;
        let resumed = server
            .replay(
                &format!("/v1/runs/{run}/events?follow=false"),
                Some(&middle.to_string()),
            )
            .await;
        let after_middle: Vec<Ev> = own.iter().filter(|e| e.seq > middle).cloned().collect();
        assert_eq!(resumed, after_middle, "{run} after {middle}");
        covered.extend(seqs(&own));
    }
    assert_eq!(covered.len(), full.len(), "every event belongs to one run");
    let second_own: Vec<Ev> = full
        .iter()
        .filter(|e| e.run_id.as_deref() == Some(second.as_str()))
        .cloned()
        .collect();
    assert_eq!(live, second_own[..live.len()]);
    assert_eq!(live.last().unwrap().kind, "run.finished");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follow_false_ends_after_the_backlog_while_a_run_is_still_active() {
    let server = Server::start(sleepy_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let run = server.send(TOKEN_A, &session, "sleep").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut live = server.stream(&format!("/v1/runs/{run}/events"), None).await;
    let so_far = live.until(|e| e.kind == "tool.call").await;

    let backlog = server
        .replay(&format!("/v1/sessions/{session}/events?follow=false"), None)
        .await;
    assert_eq!(
        seqs(&backlog),
        (1..=backlog.len() as i64).collect::<Vec<_>>()
    );
    assert_eq!(backlog[..so_far.len()], so_far);
    assert!(!kinds(&backlog).contains(&"run.finished"), "still running");
    let run_backlog = server
        .replay(&format!("/v1/runs/{run}/events?follow=false"), None)
        .await;
    assert_eq!(run_backlog, backlog);
    // A followed stream, by contrast, stays open while the run sleeps.
    let mut followed = server
        .stream(&format!("/v1/sessions/{session}/events"), None)
        .await;
    for expected in &backlog {
        let next = timeout(DEADLINE, followed.next()).await.unwrap();
        assert_eq!(next.as_ref(), Some(expected));
    }
    assert!(
        timeout(Duration::from_millis(200), followed.next())
            .await
            .is_err(),
        "a followed stream does not end after the backlog"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_longer_than_one_store_page_is_replayed_whole() {
    // The stream reads the store 500 events at a time; 40 queued runs make more than that.
    let server = Server::start(quick_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let path = format!("/v1/sessions/{session}/events");
    let mut live = server.stream(&path, None).await;
    let mut runs = Vec::new();
    for i in 0..40 {
        let accepted = server.send(TOKEN_A, &session, &format!("turn {i}")).await;
        runs.push(accepted["run_id"].as_str().unwrap().to_owned());
    }
    let last_run = runs.last().unwrap().clone();
    let followed = live
        .until(|e| e.kind == "run.finished" && e.run_id.as_deref() == Some(&last_run))
        .await;
    let full = server.replay(&format!("{path}?follow=false"), None).await;
    let n = full.len();
    assert!(n > 500, "more than one page: {n}");
    assert_eq!(seqs(&full), (1..=n as i64).collect::<Vec<_>>());
    assert_eq!(followed, full, "the live follower saw the same");
    let finished = full.iter().filter(|e| e.kind == "run.finished").count();
    assert_eq!(finished, 40);
    for k in [1, 499, 500, 501, n - 1, n] {
        let suffix = server
            .replay(&format!("{path}?after={k}&follow=false"), None)
            .await;
        assert_eq!(suffix, full[k..], "after={k}");
    }
}

// ---------------------------------------------------------------------------------------
// Approvals

/// `add` needs approval when `a` has three digits; `now` never does.
async fn gated_server() -> Server {
    let script = json!({"replies": [
        {"text": "Three calls.", "tool_calls": [
            {"name": "add", "arguments": {"a": 100, "b": 1}},
            {"name": "add", "arguments": {"a": 2, "b": 3}},
            {"name": "now"}
        ]},
        {"text": "Done."}
    ]});
    Server::start_with(script, |template, _| {
        let add = template.tools.iter_mut().find(|t| t.name == "add").unwrap();
        add.approval = ApprovalPolicy::WhenArguments([("a".into(), "???".into())].into());
    })
    .await
}

/// Sends a message and waits for the approval its run asks for; returns (run, approval id,
/// the run's events so far).
async fn gated_message(server: &Server, session: &str) -> (String, String, Vec<Ev>) {
    let accepted = server.send(TOKEN_A, session, "add things").await;
    let run = accepted["run_id"].as_str().unwrap().to_owned();
    let mut stream = server.stream(&format!("/v1/runs/{run}/events"), None).await;
    let events = stream
        .until(|e| e.kind == "run.status" && e.data["payload"]["status"] == "waiting_human")
        .await;
    let required = events
        .iter()
        .find(|e| e.kind == "approval.required")
        .expect("the gate is announced");
    let approval = required.data["payload"]["approval_id"]
        .as_str()
        .unwrap()
        .to_owned();
    (run, approval, events)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gated_batch_runs_only_what_a_human_approved_and_the_model_sees_every_result() {
    let server = gated_server().await;
    let session = server.create_session(TOKEN_A).await;
    let (run, approval, events) = gated_message(&server, &session).await;
    assert!(
        !kinds(&events).contains(&"tool.call"),
        "no call of a gated batch starts: {:?}",
        kinds(&events)
    );
    let state = server.get_ok(TOKEN_A, &format!("/v1/runs/{run}")).await;
    assert_eq!(state["status"], "waiting_human");
    assert_eq!(state["pending_human"]["kind"], "approval", "{state}");

    let pending = server.get_ok(TOKEN_A, "/v1/approvals?status=pending").await;
    let item = &pending["items"][0];
    assert_eq!(pending["items"].as_array().unwrap().len(), 1, "{pending}");
    assert_eq!(item["id"], approval.as_str());
    assert_eq!(item["run_id"], run.as_str());
    assert_eq!(item["status"], "pending");
    let calls = item["calls"].as_array().unwrap();
    let shape: Vec<(&str, bool)> = calls
        .iter()
        .map(|c| (c["name"].as_str().unwrap(), c["needs_approval"] == true))
        .collect();
    assert_eq!(shape, [("add", true), ("add", false), ("now", false)]);
    assert_eq!(calls[0]["arguments"], json!({"a": 100, "b": 1}));
    let call_ids: Vec<&str> = calls
        .iter()
        .map(|c| c["call_id"].as_str().unwrap())
        .collect();

    // Another tenant sees nothing of it.
    let theirs = server.get_ok(TOKEN_B, "/v1/approvals").await;
    assert_eq!(theirs["items"], json!([]));
    let path = format!("/v1/approvals/{approval}");
    let body = json!({"decisions": [{"call_id": call_ids[0], "decision": "approve"}]});
    assert_error(
        "other tenant's approval",
        &call(server.get(TOKEN_B, &path)).await,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    assert_error(
        "other tenant's answer",
        &call(server.post(TOKEN_B, &path, body)).await,
        StatusCode::NOT_FOUND,
        "not_found",
    );

    // Answers that cannot be right change nothing.
    for (bad, status, code) in [
        (
            json!({"decisions": [{"call_id": call_ids[1], "decision": "approve"}]}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            json!({"decisions": [{"call_id": "nope", "decision": "deny"}]}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            json!({"decisions": [{"call_id": call_ids[0], "decision": "maybe"}]}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            json!({"decisions": [], "abort": true}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            json!({}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            json!({"abort": false}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
    ] {
        let reply = call(server.post(TOKEN_A, &path, bad.clone())).await;
        assert_error(&bad.to_string(), &reply, status, code);
    }
    let unknown = call(server.get(TOKEN_A, "/v1/approvals/apr_nope-1")).await;
    assert_error(
        "unknown approval",
        &unknown,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    let malformed = call(server.get(TOKEN_A, "/v1/approvals/run_x")).await;
    assert_error(
        "malformed id",
        &malformed,
        StatusCode::BAD_REQUEST,
        "bad_request",
    );
    let status = call(server.get(TOKEN_A, "/v1/approvals?status=open")).await;
    assert_error(
        "unknown status",
        &status,
        StatusCode::BAD_REQUEST,
        "bad_request",
    );
    assert_eq!(
        server.get_ok(TOKEN_A, &path).await["status"],
        "pending",
        "refused answers leave it pending"
    );

    // Deny the gated call; the others, not named, run.
    let answer =
        json!({"decisions": [{"call_id": call_ids[0], "decision": "deny", "note": "too big"}]});
    let reply = call(server.post(TOKEN_A, &path, answer.clone())).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body["status"], "decided");
    let decided: Vec<&str> = reply.body["calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["decision"].as_str().unwrap())
        .collect();
    assert_eq!(decided, ["deny", "approve", "approve"]);
    assert_eq!(reply.body["calls"][0]["note"], "too big");
    let state = server.finish(&run).await;
    assert_eq!(state["status"], "completed", "{state}");
    assert_eq!(state["final_answer"], "Done.");

    // The model saw one result per call, in its order; the denied call never ran.
    let messages = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}/messages"))
        .await;
    let tool_results: Vec<(String, String)> = messages["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            (
                m["tool_call_id"].as_str().unwrap().to_owned(),
                m["content"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let order: Vec<&str> = tool_results.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(order, call_ids);
    assert!(
        tool_results[0].1.contains("denied by a human: too big"),
        "{tool_results:?}"
    );
    assert!(tool_results[1].1.contains('5'), "{tool_results:?}");
    let all = server
        .replay(&format!("/v1/runs/{run}/events?follow=false"), None)
        .await;
    let decided_at = all
        .iter()
        .position(|e| e.kind == "approval.decided")
        .expect("approval.decided");
    let started: Vec<(usize, &str)> = all
        .iter()
        .enumerate()
        .filter(|(_, e)| e.kind == "tool.call")
        .map(|(i, e)| (i, e.data["payload"]["call_id"].as_str().unwrap()))
        .collect();
    assert_eq!(
        started.iter().map(|(_, id)| *id).collect::<Vec<_>>(),
        call_ids[1..],
        "only the approved calls started"
    );
    assert!(
        started.iter().all(|(i, _)| *i > decided_at),
        "and only after the answer"
    );

    // The same answer again is fine; a different one is a conflict.
    let again = call(server.post(TOKEN_A, &path, answer)).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.body);
    let different = json!({"decisions": [{"call_id": call_ids[0], "decision": "approve"}]});
    assert_error(
        "a different answer",
        &call(server.post(TOKEN_A, &path, different)).await,
        StatusCode::CONFLICT,
        "conflict",
    );
    let decided = server.get_ok(TOKEN_A, "/v1/approvals?status=decided").await;
    assert_eq!(ids(&decided["items"]), [approval.as_str()]);
    let pending = server.get_ok(TOKEN_A, "/v1/approvals?status=pending").await;
    assert_eq!(pending["items"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborting_an_approval_cancels_the_run_and_the_next_message_runs() {
    let server = gated_server().await;
    let session = server.create_session(TOKEN_A).await;
    let (run, approval, _) = gated_message(&server, &session).await;
    let path = format!("/v1/approvals/{approval}");
    let reply = call(server.post(TOKEN_A, &path, json!({"abort": true}))).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body["status"], "aborted");
    let state = server.get_ok(TOKEN_A, &format!("/v1/runs/{run}")).await;
    assert_eq!(
        (&state["status"], &state["stop_reason"]),
        (&json!("cancelled"), &json!("cancelled")),
        "{state}"
    );
    assert_eq!(state["usage"]["tool_calls"], 0, "{state}");
    // The session is free: the next message runs (and is gated in its turn).
    let (next, next_approval, _) = gated_message(&server, &session).await;
    assert_ne!(next, run);
    let cancelled = call(server.post(TOKEN_A, &format!("/v1/runs/{next}/cancel"), json!({}))).await;
    assert_eq!(cancelled.status, StatusCode::OK, "{}", cancelled.body);
    let listed = server
        .get_ok(TOKEN_A, "/v1/approvals?status=cancelled")
        .await;
    assert_eq!(ids(&listed["items"]), [next_approval.as_str()]);
    let late = json!({"abort": true});
    let reply = call(server.post(TOKEN_A, &format!("/v1/approvals/{next_approval}"), late)).await;
    assert_error(
        "answer after cancel",
        &reply,
        StatusCode::CONFLICT,
        "conflict",
    );
}

// ---------------------------------------------------------------------------------------
// Continue and retry

/// A model that fails its first `failures` calls with a transient error, then answers.
struct Flaky {
    failures: std::sync::atomic::AtomicU32,
}

#[async_trait::async_trait]
impl ratchet_llm::Model for Flaky {
    async fn complete(
        &self,
        _request: ratchet_llm::ModelRequest,
        _deltas: tokio::sync::mpsc::UnboundedSender<String>,
        _cancel: CancellationToken,
    ) -> ratchet_llm::Result<ratchet_core::ModelReply> {
        use std::sync::atomic::Ordering;
        let left = self.failures.load(Ordering::SeqCst);
        if left > 0 {
            self.failures.store(left - 1, Ordering::SeqCst);
            return Err(ratchet_llm::Error::Transient(
                "HTTP 503 from the flaky model".into(),
            ));
        }
        Ok(ratchet_core::ModelReply {
            text: "recovered".into(),
            ..Default::default()
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_failed_calling_the_model_is_retried_with_fresh_attempts() {
    let server = Server::start_with(quick_script(), |template, models| {
        template.model = "flaky".into();
        template.limits.max_model_attempts = 2;
        let flaky = Flaky {
            failures: std::sync::atomic::AtomicU32::new(2),
        };
        models.register("flaky", Arc::new(flaky));
    })
    .await;
    let session = server.create_session(TOKEN_A).await;
    let accepted = server.send(TOKEN_A, &session, "hello").await;
    let run = accepted["run_id"].as_str().unwrap().to_owned();
    let failed = server.finish(&run).await;
    assert_eq!(
        (&failed["status"], &failed["stop_reason"]),
        (&json!("failed"), &json!("model_error")),
        "{failed}"
    );
    let steps = failed["step_index"].as_u64().unwrap();

    let continue_path = format!("/v1/runs/{run}/continue");
    let retry_path = format!("/v1/runs/{run}/retry");
    let theirs = call(server.post(TOKEN_B, &retry_path, json!({}))).await;
    assert_error(
        "another tenant's run",
        &theirs,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    let extra = call(server.post(TOKEN_A, &continue_path, json!({"extra_stepz": 1}))).await;
    assert_error(
        "unknown field",
        &extra,
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_request",
    );

    let reply = call(server.post(TOKEN_A, &retry_path, json!({}))).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body["status"], "running");
    let done = server.finish_again(&run, 2).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["final_answer"], "recovered");
    assert_eq!(
        done["step_index"],
        steps + 1,
        "the failed step stays; one new step answers"
    );
    let events = server
        .replay(&format!("/v1/runs/{run}/events?follow=false"), None)
        .await;
    assert_eq!(
        kinds(&events)
            .iter()
            .filter(|k| **k == "run.resumed")
            .count(),
        1
    );
    let finished = kinds(&events)
        .iter()
        .filter(|k| **k == "run.finished")
        .count();
    assert_eq!(finished, 2, "one per end: failed, then completed");

    let again = call(server.post(TOKEN_A, &retry_path, json!({}))).await;
    assert_error(
        "retry of a completed run",
        &again,
        StatusCode::CONFLICT,
        "conflict",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_spent_its_budget_is_continued_with_more() {
    let forever = json!({"replies": [
        {"text": "More.", "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 1}}]}
    ]});
    let server = Server::start_with(forever, |template, _| template.limits.max_steps = 3).await;
    let session = server.create_session(TOKEN_A).await;
    let accepted = server.send(TOKEN_A, &session, "loop").await;
    let run = accepted["run_id"].as_str().unwrap().to_owned();
    let failed = server.finish(&run).await;
    assert_eq!(
        (&failed["stop_reason"], &failed["step_index"]),
        (&json!("budget_exhausted"), &json!(3)),
        "{failed}"
    );

    let continue_path = format!("/v1/runs/{run}/continue");
    let retry = call(server.post(TOKEN_A, &format!("/v1/runs/{run}/retry"), json!({}))).await;
    assert_error(
        "retry of a spent budget",
        &retry,
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_request",
    );
    let nothing = call(server.post(TOKEN_A, &continue_path, json!({}))).await;
    assert_error(
        "continue without budget",
        &nothing,
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_request",
    );
    assert!(
        nothing.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("budget is spent"),
        "{}",
        nothing.body
    );

    let reply = call(server.post(TOKEN_A, &continue_path, json!({"extra_steps": 3}))).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    let again = server.finish_again(&run, 2).await;
    assert_eq!(
        (
            &again["status"],
            &again["stop_reason"],
            &again["step_index"]
        ),
        (&json!("failed"), &json!("budget_exhausted"), &json!(6)),
        "three more steps: a model call, its tools, a concluding call: {again}"
    );
    assert_eq!(again["usage"]["tool_calls"], 2, "{again}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steering_message_joins_the_active_run_after_its_tool_results() {
    let script = json!({"replies": [
        {"text": "Sleeping.", "tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 300}}]},
        {"text": "Awake."}
    ]});
    let server = Server::start(script).await;
    let session = server.create_session(TOKEN_A).await;
    let accepted = server.send(TOKEN_A, &session, "sleep").await;
    let run = accepted["run_id"].as_str().unwrap().to_owned();
    let mut events = server.stream(&format!("/v1/runs/{run}/events"), None).await;
    events.until(|e| e.kind == "tool.call").await;
    let path = format!("/v1/sessions/{session}/messages");
    let body = json!({"content": "and then say hi", "multitask": "steer"});
    let reply = call(server.post(TOKEN_A, &path, body)).await;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.body);
    assert_eq!(reply.body["steered"], true);
    assert_eq!(
        reply.body["run_id"],
        run.as_str(),
        "it joins the active run"
    );
    let seen = events.until(|e| e.kind == "run.finished").await;
    let steered = seen
        .iter()
        .position(|e| e.kind == "message.steered")
        .expect("message.steered");
    let result = seen.iter().position(|e| e.kind == "tool.result").unwrap();
    assert!(
        result < steered,
        "after the tool's result: {:?}",
        kinds(&seen)
    );
    assert_eq!(
        seen[steered].data["payload"]["message_id"],
        reply.body["message_id"]
    );
    let messages = server.get_ok(TOKEN_A, &path).await;
    let shape: Vec<(&str, &str)> = messages["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["role"].as_str().unwrap(), m["run_id"].as_str().unwrap()))
        .collect();
    let r = run.as_str();
    assert_eq!(
        shape,
        [
            ("user", r),
            ("assistant", r),
            ("tool", r),
            ("user", r),
            ("assistant", r)
        ]
    );
    let runs = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}/runs"))
        .await;
    assert_eq!(ids(&runs["items"]), [r], "no run of its own");
}

// ---------------------------------------------------------------------------------------
// Context compaction

/// Calls `add` on each of its first `rounds` calls, then answers; summarises when asked to
/// compress. Keeps every request it was sent.
struct Recorder {
    rounds: usize,
    requests: std::sync::Mutex<Vec<ratchet_llm::ModelRequest>>,
}

#[async_trait::async_trait]
impl ratchet_llm::Model for Recorder {
    async fn complete(
        &self,
        request: ratchet_llm::ModelRequest,
        _deltas: tokio::sync::mpsc::UnboundedSender<String>,
        _cancel: CancellationToken,
    ) -> ratchet_llm::Result<ratchet_core::ModelReply> {
        let summarizing =
            request.tools.is_empty() && request.system_prompt.starts_with("You compress");
        let mut requests = self.requests.lock().unwrap();
        let turns = requests
            .iter()
            .filter(|r| !r.system_prompt.starts_with("You compress"))
            .count();
        requests.push(request);
        let reply = if summarizing {
            ratchet_core::ModelReply {
                text: "SUMMARY-TEXT".into(),
                ..Default::default()
            }
        } else if turns < self.rounds {
            ratchet_core::ModelReply {
                text: format!("round {turns}"),
                tool_calls: vec![ratchet_core::ToolCall {
                    id: format!("call-{turns}"),
                    name: "add".into(),
                    arguments: json!({"a": turns, "b": 1}),
                }],
                ..Default::default()
            }
        } else {
            ratchet_core::ModelReply {
                text: "done".into(),
                ..Default::default()
            }
        };
        Ok(reply)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_over_its_budget_is_compacted_into_a_hidden_summary() {
    let recorder = Arc::new(Recorder {
        rounds: 6,
        requests: std::sync::Mutex::new(Vec::new()),
    });
    let model = Arc::clone(&recorder);
    let server = Server::start_with(quick_script(), move |template, models| {
        template.model = "recorder".into();
        template.limits.max_prompt_tokens = Some(80);
        models.register("recorder", model);
    })
    .await;
    let session = server.create_session(TOKEN_A).await;
    let accepted = server.send(TOKEN_A, &session, "add things up").await;
    let run = accepted["run_id"].as_str().unwrap().to_owned();
    let done = server.finish(&run).await;
    assert_eq!(
        (&done["status"], &done["final_answer"]),
        (&json!("completed"), &json!("done")),
        "{done}"
    );

    let steps = server
        .get_ok(TOKEN_A, &format!("/v1/runs/{run}/steps?limit=200"))
        .await;
    let instructions: Vec<&str> = steps["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["instruction"].as_str().unwrap())
        .collect();
    assert!(
        instructions.contains(&"compress_context"),
        "{instructions:?}"
    );
    let events = server
        .replay(&format!("/v1/runs/{run}/events?follow=false"), None)
        .await;
    let compacted: Vec<&Ev> = events
        .iter()
        .filter(|e| e.kind == "context.compacted")
        .collect();
    assert!(!compacted.is_empty());
    let payload = &compacted[0].data["payload"];
    assert!(
        payload["tokens_after"].as_u64().unwrap() < payload["tokens_before"].as_u64().unwrap(),
        "{payload}"
    );

    let requests = recorder.requests.lock().unwrap().clone();
    let summarize = requests
        .iter()
        .position(|r| r.system_prompt.starts_with("You compress"))
        .unwrap();
    assert!(
        requests[summarize].tools.is_empty(),
        "a summary call offers no tools"
    );
    let before = &requests[summarize - 1];
    let after = &requests[summarize + 1];
    assert!(
        after.messages[0].content.contains("SUMMARY-TEXT"),
        "the summary leads the next prompt"
    );
    assert!(
        after.messages.len() < before.messages.len() + 2,
        "older messages are gone from the prompt"
    );
    assert_ne!(
        after.messages[1].role,
        ratchet_core::Role::Tool,
        "no tool result without its call"
    );
    let estimate: u64 = after.messages.iter().map(|m| m.estimated_tokens()).sum();
    assert!(
        estimate < 80,
        "the compacted prompt fits its budget: {estimate}"
    );
    for request in requests
        .iter()
        .filter(|r| !r.system_prompt.starts_with("You compress"))
    {
        let estimate: u64 = request.messages.iter().map(|m| m.estimated_tokens()).sum();
        assert!(
            estimate < 80 + 20,
            "every prompt stays near its budget: {estimate}"
        );
    }
    drop(requests);

    // The summary is hidden: clients see the conversation as it happened.
    let messages = server
        .get_ok(
            TOKEN_A,
            &format!("/v1/sessions/{session}/messages?limit=200"),
        )
        .await;
    let contents: Vec<&str> = messages["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert!(
        !contents.iter().any(|c| c.contains("SUMMARY-TEXT")),
        "{contents:?}"
    );
    assert_eq!(contents[0], "add things up");
}
