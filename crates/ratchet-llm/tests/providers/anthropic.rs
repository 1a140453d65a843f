//! The Anthropic provider against a local server replaying Messages answers: the request's
//! wire format, the stream's events (pings, thinking, unknown types and errors included),
//! usage, tool calls, and each kind of failure.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use ratchet_core::{Message, ModelSettings, ToolOutcome, Usage};
use ratchet_llm::{DEFAULT_MAX_TOKENS, Error, Model, from_settings};
use serde_json::{Value, json};

fn model(settings: &ModelSettings, key: Option<&str>) -> Arc<dyn Model> {
    from_settings(settings, key.map(str::to_owned)).unwrap()
}

fn streaming(server: &Server) -> Arc<dyn Model> {
    model(&settings("anthropic", &server.url), None)
}

fn message_start(input_tokens: u64) -> String {
    event(json!({"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [],
        "model": "test-model", "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": input_tokens, "output_tokens": 1},
    }}))
}

fn text_block(index: u64) -> String {
    event(
        json!({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}),
    )
}

fn text_delta(index: u64, text: &str) -> String {
    event(
        json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}}),
    )
}

fn tool_block(index: u64, id: &str, name: &str) -> String {
    event(
        json!({"type": "content_block_start", "index": index, "content_block": {
            "type": "tool_use", "id": id, "name": name, "input": {},
        }}),
    )
}

fn json_delta(index: u64, partial: &str) -> String {
    event(
        json!({"type": "content_block_delta", "index": index, "delta": {
            "type": "input_json_delta", "partial_json": partial,
        }}),
    )
}

fn block_stop(index: u64) -> String {
    event(json!({"type": "content_block_stop", "index": index}))
}

fn message_delta(stop_reason: &str, output_tokens: u64) -> String {
    event(json!({"type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": null},
        "usage": {"output_tokens": output_tokens}}))
}

fn message_stop() -> String {
    event(json!({"type": "message_stop"}))
}

fn ping() -> String {
    event(json!({"type": "ping"}))
}

/// A stream saying `text` and stopping.
fn says(text: &str) -> Reply {
    Reply::stream([
        message_start(3),
        text_block(0),
        text_delta(0, text),
        block_stop(0),
        message_delta("end_turn", 2),
        message_stop(),
    ])
}

#[tokio::test]
async fn the_request_carries_the_conversation_in_messages_terms() {
    let server = Server::start(vec![says("ok")]).await;
    let model = model(&settings("anthropic", &server.url), Some("sk-ant-test"));
    let mut request = request(
        vec![
            Message::user("What is in a and b?"),
            Message::assistant(
                "Reading both.",
                vec![
                    call("toolu_1", "fs.read", json!({"path": "a"})),
                    call("toolu_2", "fs.read", json!({"path": "b"})),
                ],
            ),
            Message::tool_result("toolu_1", &ToolOutcome::ok("A")),
            Message::tool_result("toolu_2", &ToolOutcome::error("not run: cancelled")),
            Message::user("Also, be quick."),
            Message::assistant("A, and b was not read.", Vec::new()),
            Message::user("Thanks."),
        ],
        vec![tool("fs.read")],
    );
    request.system_prompt = "Be brief.".into();
    reply(model.as_ref(), request).await;

    let received = server.only_request();
    assert_eq!(received.path, "/v1/messages");
    assert_eq!(received.header("x-api-key"), Some("sk-ant-test"));
    assert_eq!(received.header("anthropic-version"), Some("2023-06-01"));
    assert_eq!(received.header("content-type"), Some("application/json"));
    assert_eq!(received.header("authorization"), None);
    assert_eq!(
        received.body,
        json!({
            "model": "test-model",
            "max_tokens": DEFAULT_MAX_TOKENS,
            "system": "Be brief.",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "What is in a and b?"}]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Reading both."},
                    {"type": "tool_use", "id": "toolu_1", "name": "fs_read", "input": {"path": "a"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "fs_read", "input": {"path": "b"}},
                ]},
                // Both results and the message after them: one user turn.
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "A"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "not run: cancelled", "is_error": true},
                    {"type": "text", "text": "Also, be quick."},
                ]},
                {"role": "assistant", "content": [{"type": "text", "text": "A, and b was not read."}]},
                {"role": "user", "content": [{"type": "text", "text": "Thanks."}]},
            ],
            "tools": [{"name": "fs_read", "description": "The fs.read tool.", "input_schema": {
                "type": "object", "properties": {"path": {"type": "string"}},
            }}],
            "stream": true,
        })
    );
}

#[tokio::test]
async fn without_a_key_none_is_sent_and_the_settings_limit_is_max_tokens() {
    let server = Server::start(vec![says("ok")]).await;
    let mut settings = settings("anthropic", &format!("{}/v1", server.url));
    settings.max_output_tokens = Some(1000);
    reply(model(&settings, None).as_ref(), question()).await;
    let received = server.only_request();
    assert_eq!(received.path, "/v1/messages");
    assert_eq!(received.header("x-api-key"), None);
    assert_eq!(
        received.body,
        json!({
            "model": "test-model",
            "max_tokens": 1000,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
            "stream": true,
        })
    );
}

#[tokio::test]
async fn a_stream_of_text_thinking_and_tool_use_with_pings_and_unknown_events() {
    let server = Server::start(vec![Reply::stream([
        ping(),
        event(json!({"type": "message_start", "message": {"usage": {
            "input_tokens": 10, "cache_creation_input_tokens": 4, "cache_read_input_tokens": 100, "output_tokens": 1,
        }}})),
        event(json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}})),
        event(json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "They want a."}})),
        event(json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": " Both of them."}})),
        event(json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "EqQB"}})),
        block_stop(0),
        text_block(1),
        text_delta(1, "Let me "),
        ping(),
        text_delta(1, "read it."),
        block_stop(1),
        event(json!({"type": "a_future_event", "whatever": [1, 2]})),
        tool_block(2, "toolu_a", "fs_read"),
        json_delta(2, ""),
        json_delta(2, "{\"pa"),
        ping(),
        json_delta(2, "th\": \"a\"}"),
        block_stop(2),
        tool_block(3, "toolu_b", "now"),
        block_stop(3),
        // The final totals, the cache's included, as the API repeats them at the end.
        event(json!({"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {
            "input_tokens": 10, "cache_creation_input_tokens": 4, "cache_read_input_tokens": 100, "output_tokens": 57,
        }})),
        message_stop(),
    ])])
    .await;
    let request = request(
        vec![Message::user("Read a.")],
        vec![tool("fs.read"), tool("now")],
    );
    let (reply, deltas) = reply(streaming(&server).as_ref(), request).await;
    assert_eq!(reply.text, "Let me read it.");
    assert_eq!(deltas, ["Let me ", "read it."]);
    assert_eq!(reply.reasoning, "They want a. Both of them.");
    assert_eq!(
        reply.tool_calls,
        [
            call("toolu_a", "fs.read", json!({"path": "a"})),
            call("toolu_b", "now", json!({}))
        ]
    );
    assert_eq!(
        reply.usage,
        Usage {
            input_tokens: 114,
            output_tokens: 57,
            reasoning_tokens: 0,
            cache_write_tokens: 4,
            cache_read_tokens: 100
        }
    );
}

#[tokio::test]
async fn unparsable_tool_input_is_kept_raw() {
    let server = Server::start(vec![Reply::stream([
        message_start(3),
        tool_block(0, "toolu_a", "fs_read"),
        json_delta(0, "{\"path\": "),
        block_stop(0),
        message_delta("tool_use", 5),
        message_stop(),
    ])])
    .await;
    let request = request(vec![Message::user("Read a.")], vec![tool("fs.read")]);
    let (reply, _) = reply(streaming(&server).as_ref(), request).await;
    assert_eq!(
        reply.tool_calls,
        [call("toolu_a", "fs.read", json!("{\"path\": "))]
    );
}

#[tokio::test]
async fn an_error_event_after_http_200_is_transient_when_overloaded_and_fatal_otherwise() {
    let server = Server::start(vec![
        Reply::stream([
            message_start(3),
            text_block(0),
            text_delta(0, "Hel"),
            event(json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})),
        ]),
        Reply::stream([event(
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long"}}),
        )]),
    ])
    .await;
    let model = streaming(&server);
    assert_eq!(
        failure(model.as_ref(), question()).await,
        Error::Transient {
            message: "the provider reported an error: overloaded_error: Overloaded".into(),
            retry_after: None
        }
    );
    assert_eq!(
        failure(model.as_ref(), question()).await,
        Error::Fatal(
            "the provider reported an error: invalid_request_error: prompt is too long".into()
        )
    );
}

#[tokio::test]
async fn a_stream_without_its_end_is_transient_but_a_stop_reason_is_enough() {
    let server = Server::start(vec![
        Reply::stream([message_start(3), text_block(0), text_delta(0, "Hel")]),
        Reply::stream([
            message_start(3),
            text_block(0),
            text_delta(0, "Hello."),
            block_stop(0),
            message_delta("end_turn", 2),
        ]),
    ])
    .await;
    let model = streaming(&server);
    let error = failure(model.as_ref(), question()).await;
    assert!(
        matches!(&error, Error::Transient { message, .. } if message.contains("ended early")),
        "{error:?}"
    );
    let (reply, _) = reply(model.as_ref(), question()).await;
    assert_eq!(reply.text, "Hello.");
}

#[tokio::test]
async fn a_malformed_event_is_fatal_not_an_end() {
    let server = Server::start(vec![
        Reply::stream([
            message_start(3),
            "event: content_block_delta\ndata: {\"type\": \"content_block_delta\", \"ind\n\n"
                .to_owned(),
            message_delta("end_turn", 2),
            message_stop(),
        ]),
        // A known event missing what it must carry.
        Reply::stream([
            message_start(3),
            event(json!({"type": "content_block_delta", "index": 0})),
            message_stop(),
        ]),
        // Input for a block that is not a tool call.
        Reply::stream([message_start(3), json_delta(4, "{}"), message_stop()]),
    ])
    .await;
    let model = streaming(&server);
    for expected in [
        "content_block_delta",
        "missing field `delta`",
        "not a tool_use block",
    ] {
        let error = failure(model.as_ref(), question()).await;
        assert!(
            matches!(&error, Error::Fatal(m) if m.starts_with("malformed stream") && m.contains(expected)),
            "{error:?}"
        );
    }
}

#[tokio::test]
async fn http_failures_are_transient_with_the_provider_s_wait_or_fatal_with_its_message() {
    let error_body = |kind: &str, message: &str| json!({"type": "error", "error": {"type": kind, "message": message}, "request_id": "req_1"});
    let server = Server::start(vec![
        Reply::json(
            429,
            error_body(
                "rate_limit_error",
                "Number of requests has exceeded your rate limit",
            ),
        )
        .header("retry-after", "12"),
        Reply::json(529, error_body("overloaded_error", "Overloaded")),
        Reply::json(
            400,
            error_body("invalid_request_error", "max_tokens: 999999 > 64000"),
        ),
    ])
    .await;
    let model = streaming(&server);
    assert_eq!(
        failure(model.as_ref(), question()).await,
        Error::Transient {
            message: "HTTP 429 Too Many Requests: rate_limit_error: Number of requests has exceeded your rate limit".into(),
            retry_after: Some(Duration::from_secs(12))
        }
    );
    assert_eq!(
        failure(model.as_ref(), question()).await,
        Error::Transient {
            message: "HTTP 529: overloaded_error: Overloaded".into(),
            retry_after: None
        }
    );
    assert_eq!(
        failure(model.as_ref(), question()).await,
        Error::Fatal(
            "HTTP 400 Bad Request: invalid_request_error: max_tokens: 999999 > 64000".into()
        )
    );
    assert_eq!(server.received().len(), 3, "each failure was one request");
}

#[tokio::test]
async fn a_refused_connection_and_a_stalled_stream_are_transient() {
    let settings_refused = settings("anthropic", &closed_port_url().await);
    let error = failure(model(&settings_refused, None).as_ref(), question()).await;
    assert!(
        matches!(&error, Error::Transient { message, .. } if message.starts_with("cannot connect")),
        "{error:?}"
    );

    let server = Server::start(vec![
        Reply::stream([message_start(3), text_block(0), text_delta(0, "Hel")]).then(Then::Stall),
    ])
    .await;
    let mut settings = settings("anthropic", &server.url);
    settings.read_timeout_ms = 300;
    let started = Instant::now();
    let error = failure(model(&settings, None).as_ref(), question()).await;
    let took = started.elapsed();
    assert!(
        matches!(&error, Error::Transient { message, .. } if message.contains("in time")),
        "{error:?}"
    );
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "{took:?}"
    );
}

#[tokio::test]
async fn a_cancelled_call_returns_at_once_and_closes_the_stream() {
    let server = Server::start(vec![
        Reply::stream([message_start(3), text_block(0), text_delta(0, "Hel")])
            .then(Then::KeepAlive),
    ])
    .await;
    cancel_after_first_delta(streaming(&server), question()).await;
    server.wait_for_a_closed_stream().await;
}

#[tokio::test]
async fn without_streaming_the_whole_answer_is_one_delta() {
    let answer = json!({
        "id": "msg_1", "type": "message", "role": "assistant", "model": "test-model",
        "content": [
            {"type": "thinking", "thinking": "They want a.", "signature": "EqQB"},
            {"type": "redacted_thinking", "data": "EmwKAhgB"},
            {"type": "thinking", "thinking": "Read it first.", "signature": "EqQC"},
            {"type": "text", "text": "Reading it."},
            {"type": "tool_use", "id": "toolu_9", "name": "fs_read", "input": {"path": "a"}},
        ],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 20, "cache_creation_input_tokens": 30, "cache_read_input_tokens": 400, "output_tokens": 7},
    });
    let server = Server::start(vec![Reply::json(200, answer)]).await;
    let mut settings = settings("anthropic", &server.url);
    settings.stream = false;
    let request = request(vec![Message::user("Read a.")], vec![tool("fs.read")]);
    let (reply, deltas) = reply(model(&settings, None).as_ref(), request).await;
    assert_eq!(reply.text, "Reading it.");
    assert_eq!(deltas, ["Reading it."]);
    assert_eq!(reply.reasoning, "They want a.\n\nRead it first.");
    assert_eq!(
        reply.tool_calls,
        [call("toolu_9", "fs.read", json!({"path": "a"}))]
    );
    assert_eq!(
        reply.usage,
        Usage {
            input_tokens: 450,
            output_tokens: 7,
            reasoning_tokens: 0,
            cache_write_tokens: 30,
            cache_read_tokens: 400
        }
    );
    assert_eq!(server.only_request().body["stream"], json!(false));
}

#[tokio::test]
async fn a_concluding_call_declares_the_history_s_tools_and_allows_none() {
    let server = Server::start(vec![says("Done.")]).await;
    let request = request(
        vec![
            Message::user("Read a."),
            Message::assistant("", vec![call("toolu_1", "fs.read", json!({"path": "a"}))]),
            Message::tool_result("toolu_1", &ToolOutcome::ok("A")),
        ],
        Vec::new(),
    );
    reply(streaming(&server).as_ref(), request).await;
    let body: Value = server.only_request().body;
    assert_eq!(body["messages"][1]["content"][0]["name"], "fs_read");
    assert_eq!(
        body["tools"],
        json!([{"name": "fs_read", "description": "Not available for this answer.", "input_schema": {"type": "object"}}])
    );
    assert_eq!(body["tool_choice"], json!({"type": "none"}));
}
