//! What the provider tests share: a local HTTP server on 127.0.0.1 that answers each request
//! with the next canned reply (a JSON body, or server-sent events paced as a provider sends
//! them) and records every request it received; and the settings, requests and calls of a
//! model under test.
#![allow(
    dead_code,
    reason = "each test binary uses its own part of the harness"
)]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::Response;
use ratchet_core::{Message, ModelReply, ModelSettings, ReplayPolicy, RunId, ToolCall, ToolSpec};
use ratchet_llm::{Model, ModelRequest};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

/// Bound on anything a test waits for; a healthy exchange takes a small fraction of it.
pub const DEADLINE: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------
// Canned replies

/// What the server answers one request with.
pub enum Reply {
    Json {
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: String,
    },
    /// Pieces of a `text/event-stream` body, each sent after its delay, then `then`.
    Stream {
        pieces: Vec<(Duration, String)>,
        then: Then,
    },
    /// No answer at all, not even a status line.
    Hang,
}

/// How a stream goes on after its pieces.
#[derive(Debug, Clone, Copy)]
pub enum Then {
    /// The body ends.
    End,
    /// Nothing more is sent, and the body does not end.
    Stall,
    /// An SSE comment every 20 ms until the client goes away.
    KeepAlive,
}

impl Reply {
    pub fn json(status: u16, body: Value) -> Reply {
        Reply::text(status, &body.to_string())
    }

    pub fn text(status: u16, body: &str) -> Reply {
        Reply::Json {
            status,
            headers: vec![("content-type", "application/json".into())],
            body: body.to_owned(),
        }
    }

    pub fn header(mut self, name: &'static str, value: &str) -> Reply {
        if let Reply::Json { headers, .. } = &mut self {
            headers.push((name, value.to_owned()));
        }
        self
    }

    /// A stream of these pieces of SSE text (see [`data`] and [`event`]), sent at once.
    pub fn stream(pieces: impl IntoIterator<Item = String>) -> Reply {
        Reply::Stream {
            pieces: pieces.into_iter().map(|p| (Duration::ZERO, p)).collect(),
            then: Then::End,
        }
    }

    pub fn then(mut self, after: Then) -> Reply {
        if let Reply::Stream { then, .. } = &mut self {
            *then = after;
        }
        self
    }
}

/// One `data:` event.
pub fn data(json: Value) -> String {
    format!("data: {json}\n\n")
}

/// One event with a type (`event:`) and JSON data, as Anthropic sends them.
pub fn event(json: Value) -> String {
    let kind = json["type"].as_str().unwrap_or("message").to_owned();
    format!("event: {kind}\ndata: {json}\n\n")
}

// ---------------------------------------------------------------------------------------
// The server

/// A request as the server received it.
#[derive(Debug, Clone)]
pub struct Received {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Value,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

struct Shared {
    replies: Mutex<VecDeque<Reply>>,
    received: Mutex<Vec<Received>>,
    /// How many streams have seen their client go away.
    closed: watch::Sender<usize>,
}

pub struct Server {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    shared: Arc<Shared>,
}

impl Server {
    /// A server answering its requests with `replies`, in order.
    pub async fn start(replies: Vec<Reply>) -> Server {
        let shared = Arc::new(Shared {
            replies: Mutex::new(replies.into()),
            received: Mutex::new(Vec::new()),
            closed: watch::channel(0).0,
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let app = Router::new()
            .fallback(answer)
            .with_state(Arc::clone(&shared));
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Server { url, shared }
    }

    /// Every request received so far.
    pub fn received(&self) -> Vec<Received> {
        self.shared.received.lock().unwrap().clone()
    }

    /// The one request received.
    pub fn only_request(&self) -> Received {
        let received = self.received();
        assert_eq!(received.len(), 1, "expected exactly one request");
        received.into_iter().next().unwrap()
    }

    /// Waits until a stream's client has gone away (the connection was closed).
    pub async fn wait_for_a_closed_stream(&self) {
        let mut closed = self.shared.closed.subscribe();
        tokio::time::timeout(DEADLINE, closed.wait_for(|n| *n > 0))
            .await
            .expect("the client never closed the stream")
            .unwrap();
    }
}

async fn answer(
    State(shared): State<Arc<Shared>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    shared.received.lock().unwrap().push(Received {
        path: uri.path().to_owned(),
        headers,
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
    });
    let reply = shared.replies.lock().unwrap().pop_front();
    match reply {
        None => response(
            500,
            &[],
            Body::from("the test gave no reply for this request"),
        ),
        Some(Reply::Json {
            status,
            headers,
            body,
        }) => response(status, &headers, Body::from(body)),
        Some(Reply::Hang) => std::future::pending().await,
        Some(Reply::Stream { pieces, then }) => {
            let (sender, receiver) = mpsc::channel::<Bytes>(1);
            tokio::spawn(send_stream(pieces, then, sender, Arc::clone(&shared)));
            let stream = futures::stream::unfold(receiver, |mut receiver| async move {
                let bytes = receiver.recv().await?;
                Some((Ok::<_, Infallible>(bytes), receiver))
            });
            let headers = [("content-type", "text/event-stream".to_owned())];
            response(200, &headers, Body::from_stream(stream))
        }
    }
}

async fn send_stream(
    pieces: Vec<(Duration, String)>,
    then: Then,
    sender: mpsc::Sender<Bytes>,
    shared: Arc<Shared>,
) {
    let gone = || shared.closed.send_modify(|n| *n += 1);
    for (delay, piece) in pieces {
        tokio::time::sleep(delay).await;
        if sender.send(Bytes::from(piece)).await.is_err() {
            return gone();
        }
    }
    match then {
        Then::End => {}
        Then::Stall => {
            sender.closed().await;
            gone();
        }
        Then::KeepAlive => loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            if sender.send(Bytes::from(": keep-alive\n\n")).await.is_err() {
                return gone();
            }
        },
    }
}

fn response(status: u16, headers: &[(&'static str, String)], body: Body) -> Response {
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::from_u16(status).unwrap();
    for (name, value) in headers {
        response.headers_mut().insert(*name, value.parse().unwrap());
    }
    response
}

// ---------------------------------------------------------------------------------------
// The model under test

/// Settings for `provider` at `base_url`: streaming, short timeouts, no limit on the answer.
pub fn settings(provider: &str, base_url: &str) -> ModelSettings {
    ModelSettings {
        provider: provider.into(),
        base_url: base_url.into(),
        model: "test-model".into(),
        api_key_env: Some("TEST_KEY".into()),
        connect_timeout_ms: 2_000,
        read_timeout_ms: 5_000,
        stream: true,
        max_output_tokens: None,
        prices: None,
    }
}

pub fn tool(name: &str) -> ToolSpec {
    ToolSpec {
        calls: Default::default(),
        name: name.into(),
        description: format!("The {name} tool."),
        parameters: json!({"type": "object", "properties": {"path": {"type": "string"}}}),
        replay: ReplayPolicy::Safe,
        completes_run: false,
        approval: Default::default(),
        delegation: Default::default(),
    }
}

pub fn call(id: &str, name: &str, arguments: Value) -> ToolCall {
    ToolCall {
        id: id.into(),
        name: name.into(),
        arguments,
    }
}

pub fn request(messages: Vec<Message>, tools: Vec<ToolSpec>) -> ModelRequest {
    ModelRequest {
        run_id: RunId::from_suffix("test").unwrap(),
        call_index: 0,
        attempt: 1,
        system_prompt: String::new(),
        messages,
        tools,
        traceparent: None,
    }
}

/// A one-question request without tools.
pub fn question() -> ModelRequest {
    request(vec![Message::user("Say hello.")], Vec::new())
}

/// Makes one call; returns its result and the deltas streamed meanwhile.
pub async fn complete(
    model: &dyn Model,
    request: ModelRequest,
) -> (ratchet_llm::Result<ModelReply>, Vec<String>) {
    let (deltas, mut streamed) = mpsc::unbounded_channel();
    let result = tokio::time::timeout(
        DEADLINE,
        model.complete(request, deltas, CancellationToken::new()),
    )
    .await
    .expect("the model call did not finish in time");
    let mut texts = Vec::new();
    while let Ok(text) = streamed.try_recv() {
        texts.push(text);
    }
    (result, texts)
}

/// The reply of a call that must succeed, and its deltas.
pub async fn reply(model: &dyn Model, request: ModelRequest) -> (ModelReply, Vec<String>) {
    let (result, deltas) = complete(model, request).await;
    (result.expect("the model call failed"), deltas)
}

/// The error of a call that must fail.
pub async fn failure(model: &dyn Model, request: ModelRequest) -> ratchet_llm::Error {
    let (result, _) = complete(model, request).await;
    result.expect_err("the model call succeeded")
}

/// A port on 127.0.0.1 that nothing listens on.
pub async fn closed_port_url() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    url
}

/// Cancels a call once its first delta has arrived; checks that it returns `Cancelled`
/// within 100 ms of the cancellation.
pub async fn cancel_after_first_delta(model: Arc<dyn Model>, request: ModelRequest) {
    let (deltas, mut streamed) = mpsc::unbounded_channel();
    let cancel = CancellationToken::new();
    let call = tokio::spawn({
        let cancel = cancel.clone();
        async move { model.complete(request, deltas, cancel).await }
    });
    tokio::time::timeout(DEADLINE, streamed.recv())
        .await
        .expect("no delta arrived")
        .expect("the call ended without a delta");
    let cancelled_at = std::time::Instant::now();
    cancel.cancel();
    let result = tokio::time::timeout(DEADLINE, call)
        .await
        .expect("the call did not return after the cancellation")
        .unwrap();
    let took = cancelled_at.elapsed();
    assert!(
        matches!(result, Err(ratchet_llm::Error::Cancelled)),
        "{result:?}"
    );
    assert!(
        took < Duration::from_millis(100),
        "returned {took:?} after the cancellation"
    );
}
