//! The server against an attacker's probes (docs/API.md, "Security"): streams that cannot
//! exhaust it, names it answers to, tokens with one spelling, bodies refused before they are
//! read, and who may administer it. Each test reproduces a probe that once got through.

use std::time::Duration;

use crate::common::*;
use ratchet_server::{HostPolicy, StreamLimits};
use reqwest::StatusCode;
use reqwest::header::{AUTHORIZATION, HOST, ORIGIN};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Sends `content` to tenant A's `session` and waits for its run to complete by polling, not
/// by a stream: these tests count streams.
async fn run_polled(server: &Server, session: &str, content: &str) -> String {
    let sent = server.send(TOKEN_A, session, content).await;
    let run = sent["run_id"].as_str().unwrap().to_owned();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while server.get_ok(TOKEN_A, &format!("/v1/runs/{run}")).await["status"] != "completed" {
        assert!(
            tokio::time::Instant::now() < deadline,
            "run {run} did not complete"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    run
}

/// Opens a following event stream of `session` and returns its status (the body is kept
/// open, unread, in `held` when it was accepted).
async fn open_stream(
    server: &Server,
    token: &str,
    session: &str,
    held: &mut Vec<reqwest::Response>,
) -> (StatusCode, serde_json::Value) {
    let response = server
        .get(token, &format!("/v1/sessions/{session}/events"))
        .send()
        .await
        .unwrap();
    let status = response.status();
    if status == StatusCode::OK {
        held.push(response);
        return (status, json!(null));
    }
    (status, response.json().await.unwrap())
}

/// Waits until the stream at `path` can be opened (a place has come back), and opens it.
async fn until_a_stream_opens(
    server: &Server,
    token: &str,
    path: &str,
    last_event_id: Option<i64>,
) -> Sse {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let mut request = server.get(token, path);
        if let Some(id) = last_event_id {
            request = request.header("last-event-id", id.to_string());
        }
        let response = request.send().await.unwrap();
        if response.status() == StatusCode::OK {
            return Sse::new(response);
        }
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(
            tokio::time::Instant::now() < deadline,
            "no stream's place came back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// F2: any tenant could open as many streams as it liked. Past the tenant's cap and past the
/// server's, a stream is refused with 429 naming the cap, and a closed stream's place comes
/// back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_past_the_tenants_or_the_servers_cap_are_refused_and_places_come_back() {
    let server = Server::start_guarded(
        quick_script(),
        Guards {
            streams: StreamLimits {
                max_streams: 3,
                max_streams_per_tenant: 2,
            },
            ..Guards::default()
        },
    )
    .await;
    let a = server.create_session(TOKEN_A).await;
    let run = run_polled(&server, &a, "hi").await;
    let b = server.create_session(TOKEN_B).await;
    let mut held = Vec::new();
    for _ in 0..2 {
        let (status, _) = open_stream(&server, TOKEN_A, &a, &mut held).await;
        assert_eq!(status, StatusCode::OK);
    }
    let (status, body) = open_stream(&server, TOKEN_A, &a, &mut held).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert_eq!(body["error"]["code"], "too_many_streams");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_streams_per_tenant"),
        "{body}"
    );
    let (status, _) = open_stream(&server, TOKEN_B, &b, &mut held).await;
    assert_eq!(status, StatusCode::OK, "another tenant has room of its own");
    let (status, body) = open_stream(&server, TOKEN_B, &b, &mut held).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("[limits] max_streams)"),
        "the server's cap: {body}"
    );
    // A run-scoped stream counts the same.
    let refused = call(server.get(TOKEN_A, &format!("/v1/runs/{run}/events"))).await;
    assert_error(
        "a run's stream past the cap",
        &refused,
        StatusCode::TOO_MANY_REQUESTS,
        "too_many_streams",
    );

    drop(held.remove(0));
    until_a_stream_opens(&server, TOKEN_B, &format!("/v1/sessions/{b}/events"), None).await;
}

/// Sends `GET path` on a raw socket with a tiny receive buffer and reads nothing: a client
/// that stopped reading.
async fn stalled_client(server: &Server, path: &str, last_event_id: Option<i64>) -> TcpStream {
    let address: std::net::SocketAddr = server.base.trim_start_matches("http://").parse().unwrap();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(address).await.unwrap();
    let resume = last_event_id.map_or(String::new(), |id| format!("Last-Event-ID: {id}\r\n"));
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {TOKEN_A}\r\n{resume}\r\n",
        address
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    stream
}

/// The ids of the complete events in a raw SSE response.
fn complete_event_ids(raw: &[u8]) -> Vec<i64> {
    let text = String::from_utf8_lossy(raw);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    let mut ids = Vec::new();
    let blocks: Vec<&str> = body.split("\n\n").collect();
    // The last block may be cut short: only those followed by a blank line are whole.
    for block in &blocks[..blocks.len().saturating_sub(1)] {
        for line in block.lines() {
            if let Some(id) = line.strip_prefix("id: ") {
                ids.push(id.trim().parse().unwrap());
            }
        }
    }
    ids
}

/// F2: a stream whose client stops reading used to keep its whole backlog in memory for
/// good. Now the server stops reading the backlog when the client does, and once its writes
/// have stalled for `stream_stall_ms` it lets the client go: the stream's place comes back,
/// and the client, reconnecting with `Last-Event-ID`, gets the rest without a gap or a repeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_let_go_and_resumes_by_last_event_id() {
    let server = Server::start_guarded(
        json!({"replies": [{"text": "noted"}]}),
        Guards {
            streams: StreamLimits {
                max_streams: 16,
                max_streams_per_tenant: 1,
            },
            stall: Duration::from_millis(500),
            ..Guards::default()
        },
    )
    .await;
    let session = server.create_session(TOKEN_A).await;
    let large = "x".repeat(900 * 1024);
    for _ in 0..4 {
        run_polled(&server, &session, &large).await;
    }
    let path = format!("/v1/sessions/{session}/events?follow=false");
    let all = seqs(&server.replay(&path, None).await);

    let mut stalled = stalled_client(&server, &path, None).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let refused = call(server.get(TOKEN_A, &path)).await;
    assert_error(
        "a second stream while the stalled one holds the tenant's place",
        &refused,
        StatusCode::TOO_MANY_REQUESTS,
        "too_many_streams",
    );
    // The place comes back only when the server has let the stalled client go.
    let meanwhile = until_a_stream_opens(&server, TOKEN_A, &path, None).await;
    assert_eq!(seqs(&meanwhile.read_to_end().await), all);

    let mut received = Vec::new();
    let read = tokio::time::timeout(DEADLINE, async {
        let mut chunk = vec![0; 64 * 1024];
        loop {
            match stalled.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => received.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the server closed the stalled connection");
    let before = complete_event_ids(&received);
    assert!(
        before.len() < all.len(),
        "the stalled client got only part of the backlog before it was let go: {before:?} of {all:?}"
    );
    let resumed = until_a_stream_opens(&server, TOKEN_A, &path, before.last().copied())
        .await
        .read_to_end()
        .await;
    let mut seen = before.clone();
    seen.extend(seqs(&resumed));
    assert_eq!(
        seen, all,
        "every event once, in order, across the reconnection"
    );
}

/// F4: a page whose own name is made to resolve to 127.0.0.1 reached the API with its name
/// in `Host` and `Origin`. Such requests are refused; the server's own names still work, and
/// so do names the operator allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_name_another_host_or_origin_are_refused() {
    let server = Server::start(quick_script()).await;
    let port = server.base.rsplit(':').next().unwrap().to_owned();
    let create = |host: Option<String>, origin: Option<String>| {
        let mut request = server.post(TOKEN_A, "/v1/sessions", json!({}));
        if let Some(host) = host {
            request = request.header(HOST, host);
        }
        if let Some(origin) = origin {
            request = request.header(ORIGIN, origin);
        }
        call(request)
    };

    let rebound = create(
        Some(format!("attacker.example:{port}")),
        Some(format!("http://attacker.example:{port}")),
    )
    .await;
    assert_error(
        "a foreign Host",
        &rebound,
        StatusCode::MISDIRECTED_REQUEST,
        "misdirected_request",
    );
    let message = rebound.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("allowed_hosts"),
        "says how to allow it: {message}"
    );
    let foreign_origin = create(None, Some(format!("http://attacker.example:{port}"))).await;
    assert_error(
        "a foreign Origin",
        &foreign_origin,
        StatusCode::FORBIDDEN,
        "forbidden_origin",
    );
    let null_origin = create(None, Some("null".to_owned())).await;
    assert_error(
        "Origin: null",
        &null_origin,
        StatusCode::FORBIDDEN,
        "forbidden_origin",
    );

    for (host, origin) in [
        (None, None),
        (
            Some(format!("localhost:{port}")),
            Some(format!("http://localhost:{port}")),
        ),
        (None, Some(format!("http://127.0.0.1:{port}"))),
    ] {
        let created = create(host.clone(), origin.clone()).await;
        assert_eq!(
            created.status,
            StatusCode::CREATED,
            "{host:?} {origin:?}: {:?}",
            created.body
        );
    }
    let console = server
        .http
        .get(server.url("/"))
        .header(HOST, format!("localhost:{port}"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        console.status(),
        StatusCode::OK,
        "the console by its own name"
    );

    let named = Server::start_guarded(
        quick_script(),
        Guards {
            hosts: HostPolicy::new(
                "127.0.0.1:0".parse().unwrap(),
                &["ratchet.example".to_owned()],
            )
            .unwrap(),
            ..Guards::default()
        },
    )
    .await;
    let allowed = call(
        named
            .post(TOKEN_A, "/v1/sessions", json!({}))
            .header(HOST, "ratchet.example")
            .header(ORIGIN, "https://ratchet.example"),
    )
    .await;
    assert_eq!(allowed.status, StatusCode::CREATED, "{:?}", allowed.body);
}

/// F6, F7, F10: an empty `access_token` authenticated wherever the empty token's hash was
/// configured; of two `Authorization` headers the first won; `Bearer` was case-sensitive and
/// whitespace around the token was trimmed. Now a token has one spelling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_is_read_from_one_header_with_one_spelling() {
    let server = Server::start(quick_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let sessions = || server.http.get(server.url("/v1/sessions"));

    let twice = call(
        sessions()
            .header(AUTHORIZATION, format!("Bearer {TOKEN_A}"))
            .header(AUTHORIZATION, "Bearer garbage"),
    )
    .await;
    assert_error(
        "two Authorization headers",
        &twice,
        StatusCode::BAD_REQUEST,
        "bad_request",
    );
    let twice_same = call(
        sessions()
            .header(AUTHORIZATION, format!("Bearer {TOKEN_A}"))
            .header(AUTHORIZATION, format!("Bearer {TOKEN_A}")),
    )
    .await;
    assert_eq!(
        twice_same.status,
        StatusCode::BAD_REQUEST,
        "even when they agree"
    );

    for scheme in ["bearer", "BEARER", "Bearer"] {
        let ok = call(sessions().header(AUTHORIZATION, format!("{scheme} {TOKEN_A}"))).await;
        assert_eq!(ok.status, StatusCode::OK, "{scheme}: {:?}", ok.body);
    }
    for spelling in [
        format!("Bearer  {TOKEN_A}"),
        format!("Bearer\t{TOKEN_A}"),
        format!("Bearer {TOKEN_A}\tx"),
    ] {
        let refused = call(sessions().header(AUTHORIZATION, spelling.as_str())).await;
        assert_error(
            &spelling,
            &refused,
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        );
    }

    let empty = call(server.http.get(server.url(&format!(
        "/v1/sessions/{session}/events?follow=false&access_token="
    ))))
    .await;
    assert_error(
        "an empty access_token",
        &empty,
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    );
    assert!(
        empty.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("missing"),
        "{:?}",
        empty.body
    );
}

/// F10: a `Content-Length` of 10 GB with no body kept the connection waiting for it. Now it is
/// answered 413 at once, from the header alone, and the connection is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_declared_too_large_is_refused_before_it_is_read() {
    let server = Server::start(quick_script()).await;
    let address = server.base.trim_start_matches("http://").to_owned();
    let mut stream = TcpStream::connect(&address).await.unwrap();
    let request = format!(
        "POST /v1/sessions HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer {TOKEN_A}\r\n\
         Content-Type: application/json\r\nContent-Length: 10000000000\r\n\r\n{{}}"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = vec![0; 4096];
    let n = tokio::time::timeout(DEADLINE, stream.read(&mut answer))
        .await
        .expect("the server waited for the body")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("payload_too_large"), "{answer}");
    // The unread body makes the connection unusable; a client told so opens a new one
    // instead of sending its next request down this one.
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("\r\nconnection: close\r\n"),
        "{answer}"
    );
}

/// Any tenant could reload the server's configuration. Now only a token configured with
/// `admin = true` may; another token of the same tenant is refused with 403.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_an_administrators_token_may_reload() {
    let server = Server::start(quick_script()).await;
    let refused = call(server.post(TOKEN_A_BASE64, "/v1/admin/reload", json!({}))).await;
    assert_error(
        "a tenant's token",
        &refused,
        StatusCode::FORBIDDEN,
        "forbidden",
    );
    assert!(
        refused.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("admin = true"),
        "{:?}",
        refused.body
    );
    let admitted = call(server.post(TOKEN_A, "/v1/admin/reload", json!({}))).await;
    assert_eq!(
        admitted.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "an administrator's reload is attempted (the test queued none): {:?}",
        admitted.body
    );
}
