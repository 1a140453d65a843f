//! The OpenAI-compatible provider against a local server replaying chat completion answers
//! the way OpenAI, vLLM, Ollama and proxies send them: the request's wire format, streamed
//! text, reasoning kept apart from it, usage, tool calls in every known shape, and each kind of failure.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::common::*;
use ratchet_core::{Message, ModelSettings, ToolOutcome, Usage};
use ratchet_llm::{Error, Model, from_settings};
use serde_json::{Value, json};

fn model(settings: &ModelSettings, key: Option<&str>) -> Arc<dyn Model> {
    from_settings(settings, key.map(str::to_owned)).unwrap()
}

/// A model streaming from `server`, with `/v1` as its base path like OpenAI's.
fn streaming(server: &Server) -> Arc<dyn Model> {
    model(&settings("openai", &format!("{}/v1", server.url)), None)
}

fn text_chunk(text: &str) -> String {
    data(json!({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]}))
}

fn calls_chunk(calls: Value) -> String {
    data(json!({"choices": [{"index": 0, "delta": {"tool_calls": calls}, "finish_reason": null}]}))
}

fn finish_chunk(reason: &str) -> String {
    data(json!({"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}))
}

fn done() -> String {
    "data: [DONE]\n\n".to_owned()
}

/// A stream saying `text` and stopping.
fn says(text: &str) -> Reply {
    Reply::stream([text_chunk(text), finish_chunk("stop"), done()])
}

#[tokio::test]
async fn the_request_carries_the_conversation_in_chat_completions_terms() {
    let server = Server::start(vec![says("ok")]).await;
    let mut settings = settings("openai", &format!("{}/v1/", server.url));
    settings.max_output_tokens = Some(512);
    let model = model(&settings, Some("sk-test"));
    let mut request = request(
        vec![
            Message::user("What is in a?"),
            Message::assistant("", vec![call("call_1", "fs.read", json!({"path": "a"}))]),
            Message::tool_result("call_1", &ToolOutcome::ok("A")),
            Message::assistant(
                "Two more.",
                vec![
                    call("call_2", "fs.read", json!({"path": "b"})),
                    call("call_3", "fs_read", json!("{\"path\": ")),
                ],
            ),
            Message::tool_result("call_2", &ToolOutcome::ok("B")),
            Message::tool_result("call_3", &ToolOutcome::error("invalid arguments")),
            Message::assistant("It holds A.", Vec::new()),
            Message::user("Thanks."),
        ],
        vec![tool("fs.read"), tool("fs_read")],
    );
    request.system_prompt = "Be brief.".into();
    reply(model.as_ref(), request).await;

    let received = server.only_request();
    assert_eq!(received.path, "/v1/chat/completions");
    assert_eq!(received.header("authorization"), Some("Bearer sk-test"));
    assert_eq!(received.header("content-type"), Some("application/json"));
    // `fs_read` is a real tool: it keeps its name, and `fs.read` is sent as `fs_read_2`.
    let parameters = json!({"type": "object", "properties": {"path": {"type": "string"}}});
    assert_eq!(
        received.body,
        json!({
            "model": "test-model",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is in a?"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "fs_read_2", "arguments": "{\"path\":\"a\"}"}},
                ]},
                {"role": "tool", "tool_call_id": "call_1", "content": "A"},
                {"role": "assistant", "content": "Two more.", "tool_calls": [
                    {"id": "call_2", "type": "function", "function": {"name": "fs_read_2", "arguments": "{\"path\":\"b\"}"}},
                    {"id": "call_3", "type": "function", "function": {"name": "fs_read", "arguments": "{\"path\": "}},
                ]},
                {"role": "tool", "tool_call_id": "call_2", "content": "B"},
                {"role": "tool", "tool_call_id": "call_3", "content": "invalid arguments"},
                {"role": "assistant", "content": "It holds A."},
                {"role": "user", "content": "Thanks."},
            ],
            "tools": [
                {"type": "function", "function": {"name": "fs_read_2", "description": "The fs.read tool.", "parameters": parameters}},
                {"type": "function", "function": {"name": "fs_read", "description": "The fs_read tool.", "parameters": parameters}},
            ],
            "max_tokens": 512,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    );
}

#[tokio::test]
async fn without_a_key_or_tools_neither_is_sent() {
    let server = Server::start(vec![says("ok")]).await;
    reply(streaming(&server).as_ref(), question()).await;
    let received = server.only_request();
    assert_eq!(received.header("authorization"), None);
    assert_eq!(
        received.body,
        json!({
            "model": "test-model",
            "messages": [{"role": "user", "content": "Say hello."}],
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    );
    // An empty key is no key.
    let server = Server::start(vec![says("ok")]).await;
    let settings = settings("openai", &server.url);
    reply(model(&settings, Some("")).as_ref(), question()).await;
    assert_eq!(server.only_request().header("authorization"), None);
    assert_eq!(server.only_request().path, "/chat/completions");
}

#[tokio::test]
async fn text_streams_as_deltas_and_reasoning_is_kept_apart_from_it() {
    let server = Server::start(vec![Reply::stream([
        data(json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})),
        data(json!({"choices": [{"index": 0, "delta": {"reasoning_content": "The user wants"}}]})),
        data(json!({"choices": [{"index": 0, "delta": {"content": null, "reasoning": " a greeting."}}]})),
        text_chunk("Hel"),
        text_chunk("lo!"),
        finish_chunk("stop"),
        data(json!({"choices": [], "usage": {
            "prompt_tokens": 12, "completion_tokens": 30,
            "completion_tokens_details": {"reasoning_tokens": 20},
            "prompt_tokens_details": {"cached_tokens": 8},
        }})),
        done(),
    ])])
    .await;
    let (reply, deltas) = reply(streaming(&server).as_ref(), question()).await;
    assert_eq!(reply.text, "Hello!");
    assert_eq!(deltas, ["Hel", "lo!"]);
    assert_eq!(reply.reasoning, "The user wants a greeting.");
    assert!(reply.tool_calls.is_empty());
    assert_eq!(
        reply.usage,
        Usage {
            input_tokens: 12,
            output_tokens: 30,
            reasoning_tokens: 20,
            cache_write_tokens: 0,
            cache_read_tokens: 8
        }
    );
}

#[tokio::test]
async fn interleaved_tool_calls_are_assembled_from_partial_arguments() {
    let server = Server::start(vec![Reply::stream([
        text_chunk("Reading both."),
        calls_chunk(
            json!([{"index": 0, "id": "call_a", "type": "function", "function": {"name": "fs_read", "arguments": ""}}]),
        ),
        calls_chunk(json!([{"index": 0, "function": {"arguments": "{\"pa"}}])),
        calls_chunk(
            json!([{"index": 1, "id": "call_b", "type": "function", "function": {"name": "add", "arguments": "{\"a\""}}]),
        ),
        calls_chunk(json!([{"index": 0, "function": {"arguments": "th\": \"a\"}"}}])),
        calls_chunk(json!([{"index": 1, "function": {"arguments": ": 2}"}}])),
        finish_chunk("tool_calls"),
        data(json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}})),
        done(),
    ])])
    .await;
    let request = request(
        vec![Message::user("Read a and add.")],
        vec![tool("fs.read"), tool("add")],
    );
    let (reply, deltas) = reply(streaming(&server).as_ref(), request).await;
    assert_eq!(reply.text, "Reading both.");
    assert_eq!(deltas, ["Reading both."]);
    // The wire name `fs_read` is mapped back to the tool's own name.
    assert_eq!(
        reply.tool_calls,
        [
            call("call_a", "fs.read", json!({"path": "a"})),
            call("call_b", "add", json!({"a": 2}))
        ]
    );
    assert_eq!(
        reply.usage,
        Usage {
            input_tokens: 5,
            output_tokens: 9,
            reasoning_tokens: 0,
            cache_write_tokens: 0,
            cache_read_tokens: 0
        }
    );
    let sent = server.only_request().body;
    assert_eq!(sent["tools"][0]["function"]["name"], "fs_read");
}

#[tokio::test]
async fn parallel_calls_all_at_index_zero_are_told_apart_by_id() {
    // Ollama: every call complete in one piece, each at index 0.
    let server = Server::start(vec![Reply::stream([
        calls_chunk(
            json!([{"index": 0, "id": "call_x1", "type": "function", "function": {"name": "add", "arguments": "{\"a\":1}"}}]),
        ),
        calls_chunk(
            json!([{"index": 0, "id": "call_x2", "type": "function", "function": {"name": "add", "arguments": "{\"a\":2}"}}]),
        ),
        calls_chunk(
            json!([{"index": 0, "id": "call_x3", "type": "function", "function": {"name": "now", "arguments": "{}"}}]),
        ),
        finish_chunk("tool_calls"),
        done(),
    ])])
    .await;
    let request = request(vec![Message::user("go")], vec![tool("add"), tool("now")]);
    let (reply, _) = reply(streaming(&server).as_ref(), request).await;
    assert_eq!(
        reply.tool_calls,
        [
            call("call_x1", "add", json!({"a": 1})),
            call("call_x2", "add", json!({"a": 2})),
            call("call_x3", "now", json!({})),
        ]
    );
}

#[tokio::test]
async fn pieces_without_arguments_empty_call_lists_and_a_late_type_are_read() {
    // vLLM: `tool_calls: []` on text chunks, a first piece without `arguments`; some
    // deployments send `type` after the arguments.
    let server = Server::start(vec![Reply::stream([
        data(json!({"choices": [{"index": 0, "delta": {"content": "Let me ", "tool_calls": []}}]})),
        data(json!({"choices": [{"index": 0, "delta": {"content": "check.", "tool_calls": []}}]})),
        calls_chunk(json!([{"index": 0, "id": "chatcmpl-tool-1", "function": {"name": "add"}}])),
        calls_chunk(json!([{"index": 0, "function": {"arguments": "{\"a\": 1,"}}])),
        calls_chunk(json!([{"index": 0, "function": {"arguments": " \"b\": 2}"}}])),
        calls_chunk(json!([{"index": 0, "type": "function"}])),
        finish_chunk("tool_calls"),
        done(),
    ])])
    .await;
    let request = request(vec![Message::user("go")], vec![tool("add")]);
    let (reply, deltas) = reply(streaming(&server).as_ref(), request).await;
    assert_eq!(reply.text, "Let me check.");
    assert_eq!(deltas, ["Let me ", "check."]);
    assert_eq!(
        reply.tool_calls,
        [call("chatcmpl-tool-1", "add", json!({"a": 1, "b": 2}))]
    );
}

#[tokio::test]
async fn object_arguments_and_non_standard_finish_reasons_are_accepted() {
    let server = Server::start(vec![
        // Arguments as an object, `stop` after tool calls, and `[DONE]`.
        Reply::stream([
            calls_chunk(
                json!([{"index": 0, "id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]),
            ),
            finish_chunk("stop"),
            done(),
        ]),
        // A server's own finish reason, and no `[DONE]`: the finish reason is enough.
        Reply::stream([text_chunk("Done."), finish_chunk("eos")]),
    ])
    .await;
    let model = streaming(&server);
    let request = || request(vec![Message::user("go")], vec![tool("add")]);
    let (first, _) = reply(model.as_ref(), request()).await;
    assert_eq!(
        first.tool_calls,
        [call("c1", "add", json!({"a": 1, "b": 2}))]
    );
    let (second, _) = reply(model.as_ref(), request()).await;
    assert_eq!(second.text, "Done.");
    assert!(second.tool_calls.is_empty());
}

#[tokio::test]
async fn missing_ids_are_generated_and_unparsable_arguments_are_kept_raw() {
    let server = Server::start(vec![Reply::stream([
        calls_chunk(json!([{"index": 0, "function": {"name": "add", "arguments": "{\"a\": 1}"}}])),
        calls_chunk(json!([{"index": 1, "function": {"name": "add", "arguments": "{\"a\": on"}}])),
        finish_chunk("tool_calls"),
        done(),
    ])])
    .await;
    let request = request(vec![Message::user("go")], vec![tool("add")]);
    let (reply, _) = reply(streaming(&server).as_ref(), request).await;
    // The raw text goes to the engine, whose schema check rejects it for the model to see.
    assert_eq!(
        reply.tool_calls,
        [
            call("call_0", "add", json!({"a": 1})),
            call("call_1", "add", json!("{\"a\": on"))
        ]
    );
}

#[tokio::test]
async fn a_stream_that_ends_before_it_finishes_is_transient() {
    let server = Server::start(vec![Reply::stream([text_chunk("Hel"), text_chunk("lo")])]).await;
    let error = failure(streaming(&server).as_ref(), question()).await;
    assert!(
        matches!(&error, Error::Transient { message, retry_after: None } if message.contains("ended early")),
        "{error:?}"
    );
}

#[tokio::test]
async fn a_chunk_that_is_not_json_is_fatal_not_an_end() {
    // The stream goes on normally after the broken chunk: it must not be read past.
    let server = Server::start(vec![Reply::stream([
        text_chunk("Hel"),
        "data: {\"choices\": [{\"delta\": \n\n".to_owned(),
        text_chunk("lo"),
        finish_chunk("stop"),
        done(),
    ])])
    .await;
    let error = failure(streaming(&server).as_ref(), question()).await;
    let Error::Fatal(message) = &error else {
        panic!("expected a fatal error, got {error:?}");
    };
    assert!(message.contains("malformed stream"), "{message}");
    assert!(
        message.contains(r#"{\"choices\": [{\"delta\":"#),
        "{message}"
    );
}

#[tokio::test]
async fn an_error_inside_the_stream_is_transient_or_fatal_by_its_kind() {
    let server = Server::start(vec![
        Reply::stream([
            text_chunk("Hel"),
            data(json!({"error": {"message": "Provider disconnected", "code": "server_error"}})),
        ]),
        Reply::stream([data(
            json!({"error": {"message": "Context too long", "type": "invalid_request_error", "code": 400}}),
        )]),
    ])
    .await;
    let model = streaming(&server);
    let error = failure(model.as_ref(), question()).await;
    assert!(
        matches!(&error, Error::Transient { message, .. } if message.contains("Provider disconnected")),
        "{error:?}"
    );
    let error = failure(model.as_ref(), question()).await;
    assert_eq!(
        error,
        Error::Fatal(
            "the provider reported an error: invalid_request_error: Context too long".into()
        )
    );
}

#[tokio::test]
async fn http_failures_are_transient_with_the_provider_s_wait_or_fatal_with_its_message() {
    let in_30s = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(30));
    let rate_limited = json!({"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}});
    let server = Server::start(vec![
        Reply::json(429, rate_limited.clone()).header("retry-after", "7"),
        Reply::json(429, rate_limited.clone()).header("retry-after", &in_30s),
        Reply::json(429, rate_limited).header("retry-after-ms", "1500"),
        Reply::text(500, "Internal Server Error"),
        Reply::text(503, ""),
        Reply::json(
            400,
            json!({"error": {"message": "Invalid 'messages': empty array.", "type": "invalid_request_error", "param": "messages", "code": null}}),
        ),
        Reply::json(401, json!({"error": "unauthorized"})),
    ])
    .await;
    let model = streaming(&server);
    let mut waits = Vec::new();
    for _ in 0..3 {
        match failure(model.as_ref(), question()).await {
            Error::Transient {
                message,
                retry_after,
            } => {
                assert_eq!(
                    message,
                    "HTTP 429 Too Many Requests: requests: Rate limit reached"
                );
                waits.push(retry_after.expect("Retry-After was read"));
            }
            other => panic!("expected a transient error, got {other:?}"),
        }
    }
    assert_eq!(waits[0], Duration::from_secs(7));
    assert!(
        waits[1] > Duration::from_secs(27) && waits[1] <= Duration::from_secs(30),
        "{:?}",
        waits[1]
    );
    assert_eq!(waits[2], Duration::from_millis(1500));
    assert_eq!(
        failure(model.as_ref(), question()).await,
        Error::Transient {
            message: "HTTP 500 Internal Server Error: Internal Server Error".into(),
            retry_after: None
        }
    );
    assert_eq!(
        failure(model.as_ref(), question()).await,
        Error::Transient {
            message: "HTTP 503 Service Unavailable".into(),
            retry_after: None
        }
    );
    assert_eq!(
        failure(model.as_ref(), question()).await,
        Error::Fatal(
            "HTTP 400 Bad Request: invalid_request_error: Invalid 'messages': empty array.".into()
        )
    );
    assert_eq!(
        failure(model.as_ref(), question()).await,
        Error::Fatal("HTTP 401 Unauthorized: unauthorized".into())
    );
    assert_eq!(server.received().len(), 7, "each failure was one request");
}

#[tokio::test]
async fn a_refused_connection_is_transient() {
    let settings = settings("openai", &closed_port_url().await);
    let error = failure(model(&settings, None).as_ref(), question()).await;
    assert!(
        matches!(&error, Error::Transient { message, .. } if message.starts_with("cannot connect")),
        "{error:?}"
    );
}

#[tokio::test]
async fn silence_longer_than_the_read_timeout_is_transient() {
    let server = Server::start(vec![
        Reply::stream([text_chunk("Hel")]).then(Then::Stall),
        Reply::Hang,
    ])
    .await;
    let mut settings = settings("openai", &server.url);
    settings.read_timeout_ms = 300;
    let model = model(&settings, None);
    // Mid-stream, and before any answer at all.
    for _ in 0..2 {
        let started = Instant::now();
        let error = failure(model.as_ref(), question()).await;
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
}

#[tokio::test]
async fn a_cancelled_call_returns_at_once_and_closes_the_stream() {
    let server = Server::start(vec![
        Reply::stream([text_chunk("Hel")]).then(Then::KeepAlive),
    ])
    .await;
    cancel_after_first_delta(streaming(&server), question()).await;
    server.wait_for_a_closed_stream().await;
}

#[tokio::test]
async fn without_streaming_the_whole_answer_is_one_delta() {
    let answer = json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant",
            "content": "Reading it.",
            "reasoning_content": "They want the file.",
            "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "fs_read", "arguments": "{\"path\": \"a\"}"}}],
        }}],
        "usage": {"prompt_tokens": 20, "completion_tokens": 7, "completion_tokens_details": {"reasoning_tokens": 3},
                  "prompt_tokens_details": {"cached_tokens": 16, "audio_tokens": 0}},
    });
    let server = Server::start(vec![Reply::json(200, answer)]).await;
    let mut settings = settings("openai", &server.url);
    settings.stream = false;
    let request = request(vec![Message::user("Read a.")], vec![tool("fs.read")]);
    let (reply, deltas) = reply(model(&settings, None).as_ref(), request).await;
    assert_eq!(reply.text, "Reading it.");
    assert_eq!(deltas, ["Reading it."]);
    assert_eq!(reply.reasoning, "They want the file.");
    assert_eq!(
        reply.tool_calls,
        [call("call_9", "fs.read", json!({"path": "a"}))]
    );
    assert_eq!(
        reply.usage,
        Usage {
            input_tokens: 20,
            output_tokens: 7,
            reasoning_tokens: 3,
            cache_write_tokens: 0,
            cache_read_tokens: 16
        }
    );
    let sent = server.only_request().body;
    assert_eq!(sent["stream"], json!(false));
    assert!(sent.get("stream_options").is_none(), "{sent}");
}

#[tokio::test]
async fn a_json_answer_to_a_stream_request_is_read_whole() {
    // Some servers ignore `stream: true`.
    let answer =
        json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi."}}]});
    let server = Server::start(vec![
        Reply::json(200, answer),
        Reply::text(200, "{\"choices\": "),
    ])
    .await;
    let model = streaming(&server);
    let (reply, deltas) = reply(model.as_ref(), question()).await;
    assert_eq!(
        (reply.text.as_str(), deltas),
        ("Hi.", vec!["Hi.".to_owned()])
    );
    let error = failure(model.as_ref(), question()).await;
    assert!(
        matches!(&error, Error::Fatal(m) if m.starts_with("malformed answer: expected a chat completion")),
        "{error:?}"
    );
}
