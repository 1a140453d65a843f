//! Traces through the binary: `ratchet serve` with `OTEL_EXPORTER_OTLP_ENDPOINT` exports its
//! spans over OTLP — HTTP/protobuf, and gRPC — to a receiver in this test, which decodes them
//! with the protocol's own messages and service. A run that a caller's `traceparent` starts,
//! that calls a tool, is killed with SIGKILL in the middle of a step, resumes in a new
//! process, delegates to a child agent (whose model is an OpenAI-compatible server here) and
//! ends, is one span tree of the caller's trace.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use futures::StreamExt;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use ratchet_core::RunId;
use ratchet_core::trace::{call_span_id, run_span_id};
use ratchet_llm::sse::SseParser;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::common::{DEADLINE, SECRETS_KEY, free_port, json_of};

const BIN: &str = env!("CARGO_BIN_EXE_ratchet");
const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

/// A span as the test reads it: ids in hex, attributes as text.
#[derive(Debug, Clone)]
struct Received {
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
    attributes: HashMap<String, String>,
    failed: bool,
}

impl Received {
    fn of(span: &Span) -> Received {
        let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
        let attributes = (span.attributes.iter())
            .map(|kv| {
                let value = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                    Some(AnyValue::StringValue(s)) => s.clone(),
                    Some(AnyValue::IntValue(i)) => i.to_string(),
                    Some(AnyValue::BoolValue(b)) => b.to_string(),
                    Some(AnyValue::DoubleValue(d)) => d.to_string(),
                    other => format!("{other:?}"),
                };
                (kv.key.clone(), value)
            })
            .collect();
        Received {
            name: span.name.clone(),
            trace_id: hex(&span.trace_id),
            span_id: hex(&span.span_id),
            parent: hex(&span.parent_span_id),
            attributes,
            // STATUS_CODE_ERROR
            failed: span.status.as_ref().is_some_and(|s| s.code == 2),
        }
    }

    fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

/// What the test's servers were sent.
enum Heard {
    Spans(Vec<Received>),
    ModelCall { traceparent: Option<String> },
}

async fn otlp_traces(State(heard): State<mpsc::UnboundedSender<Heard>>, body: Bytes) -> Vec<u8> {
    let request = ExportTraceServiceRequest::decode(body).expect("an OTLP trace export");
    let spans = (request.resource_spans.iter())
        .flat_map(|r| &r.scope_spans)
        .flat_map(|s| &s.spans)
        .map(Received::of)
        .collect();
    let _ = heard.send(Heard::Spans(spans));
    ExportTraceServiceResponse::default().encode_to_vec()
}

/// An OpenAI-compatible chat completions endpoint that answers every call the same.
async fn chat_completions(
    State(heard): State<mpsc::UnboundedSender<Heard>>,
    headers: HeaderMap,
) -> axum::Json<Value> {
    let traceparent = (headers.get("traceparent")).map(|v| v.to_str().unwrap().to_owned());
    let _ = heard.send(Heard::ModelCall { traceparent });
    axum::Json(json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "helper-model",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "part done"}}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    }))
}

/// OTLP's gRPC trace service.
struct GrpcReceiver(mpsc::UnboundedSender<Heard>);

#[tonic::async_trait]
impl TraceService for GrpcReceiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans = (request.get_ref().resource_spans.iter())
            .flat_map(|r| &r.scope_spans)
            .flat_map(|s| &s.spans)
            .map(Received::of)
            .collect();
        let _ = self.0.send(Heard::Spans(spans));
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[derive(Debug, Clone, Copy)]
enum Protocol {
    HttpProtobuf,
    Grpc,
}

/// The model server, with the OTLP receiver of `protocol`: on the same port for HTTP, on a
/// port of its own for gRPC. Returns the model server's port and the receiver's endpoint.
async fn receivers(protocol: Protocol) -> (u16, String, mpsc::UnboundedReceiver<Heard>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let app = axum::Router::new()
        .route("/v1/traces", axum::routing::post(otlp_traces))
        .route(
            "/v1/chat/completions",
            axum::routing::post(chat_completions),
        )
        .with_state(tx.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let endpoint = match protocol {
        Protocol::HttpProtobuf => format!("http://127.0.0.1:{port}"),
        Protocol::Grpc => {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let grpc = listener.local_addr().unwrap().port();
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let service = TraceServiceServer::new(GrpcReceiver(tx));
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(service)
                    .serve_with_incoming(incoming),
            );
            format!("http://127.0.0.1:{grpc}")
        }
    };
    (port, endpoint, rx)
}

/// `boss` sleeps in a tool call (long enough to be killed in), then delegates one task to
/// `helper` and answers; `helper` answers through the OpenAI-compatible server.
fn write_setup(dir: &Path, receiver: u16) {
    let agents = dir.join("agents");
    std::fs::create_dir(&agents).unwrap();
    let boss = json!({"replies": [
        {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 2000}}]},
        {"tool_calls": [{"name": "delegate", "arguments": {"mode": "foreground",
            "tasks": [{"agent": "helper", "task": "do a part"}]}}]},
        {"text": "boss done"}
    ]});
    std::fs::write(agents.join("boss.json"), boss.to_string()).unwrap();
    std::fs::write(
        agents.join("boss.md"),
        "---\nid: boss\ndescription: hands out work\nmodel: scripted:boss.json\ntools: [sleep_ms]\ndelegates: [helper]\n---\nYou hand out work.\n",
    )
    .unwrap();
    std::fs::write(
        agents.join("helper.md"),
        "---\nid: helper\ndescription: does a part\nmodel: local\n---\nYou do a part.\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("ratchet.toml"),
        format!(
            "[models.local]\nprovider = \"openai\"\nmodel = \"helper-model\"\n\
             base_url = \"http://127.0.0.1:{receiver}/v1\"\nstream = false\n"
        ),
    )
    .unwrap();
}

fn serve(dir: &Path, port: u16, endpoint: &str, protocol: Protocol) -> Child {
    let protocol = match protocol {
        Protocol::HttpProtobuf => "http/protobuf",
        Protocol::Grpc => "grpc",
    };
    Command::new(BIN)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .arg("--db")
        .arg(format!("sqlite://{}", dir.join("ratchet.db").display()))
        .arg("--agents")
        .arg(dir.join("agents"))
        .arg("--config")
        .arg(dir.join("ratchet.toml"))
        .arg("--workspace")
        .arg(dir)
        .args(["--lease-ms", "1500"])
        .env("RATCHET_SECRETS_KEY", SECRETS_KEY)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        .env("OTEL_BSP_SCHEDULE_DELAY", "50")
        .env("OTEL_SERVICE_NAME", "ratchet-under-test")
        .env_remove("RATCHET_OTEL_CAPTURE_CONTENT")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

async fn ready(http: &reqwest::Client, base: &str) {
    let started = Instant::now();
    while !(http.get(format!("{base}/readyz")).send().await).is_ok_and(|r| r.status().is_success())
    {
        assert!(started.elapsed() < DEADLINE, "ratchet serve was not ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Reads a run's event stream until `until` says stop.
async fn read_until(http: &reqwest::Client, url: &str, mut until: impl FnMut(&Value) -> bool) {
    let response = http.get(url).send().await.unwrap();
    let mut body = response.bytes_stream();
    let mut parser = SseParser::default();
    let read = async {
        while let Some(chunk) = body.next().await {
            for event in parser.feed(&chunk.unwrap()) {
                if event.event != "activity" && until(&serde_json::from_str(&event.data).unwrap()) {
                    return;
                }
            }
        }
        panic!("the stream ended");
    };
    tokio::time::timeout(DEADLINE, read)
        .await
        .expect("the awaited event never came");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_across_a_crash_and_a_delegation_is_one_span_tree_over_http() {
    span_tree_across_a_crash(Protocol::HttpProtobuf).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_across_a_crash_and_a_delegation_is_one_span_tree_over_grpc() {
    span_tree_across_a_crash(Protocol::Grpc).await;
}

/// A run that a caller's `traceparent` starts, killed in the middle of a step and resumed,
/// that delegates: every span is in the caller's trace, in one tree.
async fn span_tree_across_a_crash(protocol: Protocol) {
    let dir = tempfile::tempdir().unwrap();
    let (model_port, endpoint, mut heard) = receivers(protocol).await;
    write_setup(dir.path(), model_port);
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let mut server = serve(dir.path(), port, &endpoint, protocol);
    ready(&http, &base).await;

    let session = json_of(
        http.post(format!("{base}/v1/sessions"))
            .json(&json!({"agent": "boss"})),
    )
    .await;
    let session = session["id"].as_str().unwrap();
    let accepted = json_of(
        (http.post(format!("{base}/v1/sessions/{session}/messages")))
            .header("traceparent", format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01"))
            .json(&json!({"content": "hand out the work"})),
    )
    .await;
    let root = accepted["run_id"].as_str().unwrap().to_owned();
    let events = format!("{base}/v1/runs/{root}/events");
    // The model's step is committed: the tool's step sleeps now, and dies with the process.
    read_until(&http, &events, |e| e["kind"] == "step.committed").await;
    server.kill().unwrap();
    server.wait().unwrap();
    let mut server = serve(dir.path(), port, &endpoint, protocol);
    ready(&http, &base).await;
    read_until(&http, &events, |e| e["kind"] == "run.finished").await;

    // Every span of the two runs, and the model call's header: the last spans leave with the
    // next export after the run's end.
    let root_run = RunId::parse(&root).unwrap();
    let mut spans: Vec<Received> = Vec::new();
    let mut model_calls = Vec::new();
    let collected = async {
        loop {
            match heard.recv().await.unwrap() {
                Heard::Spans(more) => spans.extend(more),
                Heard::ModelCall { traceparent } => model_calls.push(traceparent),
            }
            let runs_ended = spans
                .iter()
                .filter(|s| s.name.starts_with("invoke_agent"))
                .count();
            if runs_ended == 2 && !model_calls.is_empty() {
                return;
            }
        }
    };
    tokio::time::timeout(DEADLINE, collected)
        .await
        .unwrap_or_else(|_| panic!("the spans of both runs never came: {spans:#?}"));
    server.kill().unwrap();
    let _ = server.wait();

    let everything = format!("{spans:#?}");
    assert!(
        spans.iter().all(|s| s.trace_id == CALLER_TRACE),
        "every span is in the caller's trace: {everything}"
    );
    let one = |name: &str| -> &Received {
        let found: Vec<&Received> = spans.iter().filter(|s| s.name == name).collect();
        assert_eq!(found.len(), 1, "one {name} span: {everything}");
        found[0]
    };

    let boss = one("invoke_agent boss");
    assert_eq!(
        boss.parent, CALLER_SPAN,
        "the run is a child of the caller's span"
    );
    assert_eq!(boss.span_id, run_span_id(&root_run).to_string());
    assert_eq!(boss.attr("gen_ai.operation.name"), Some("invoke_agent"));
    assert_eq!(boss.attr("gen_ai.agent.name"), Some("boss"));
    assert_eq!(boss.attr("ratchet.run_id"), Some(root.as_str()));
    assert_eq!(boss.attr("ratchet.status"), Some("completed"));
    assert!(!boss.failed);

    let steps_of = |run: &Received| -> Vec<&Received> {
        (spans.iter())
            .filter(|s| s.name == "step" && s.parent == run.span_id)
            .collect()
    };
    let boss_steps = steps_of(boss);
    assert!(
        boss_steps
            .iter()
            .all(|s| s.attr("ratchet.run_id") == Some(root.as_str())),
        "{everything}"
    );
    // The tool's step died with the first process; the second ran it again, attempt 2,
    // under the same run span.
    let resumed = (boss_steps.iter())
        .find(|s| s.attr("ratchet.attempt") == Some("2"))
        .unwrap_or_else(|| panic!("the resumed step's span: {everything}"));
    let sleep = one("execute_tool sleep_ms");
    assert_eq!(
        sleep.parent, resumed.span_id,
        "the call ran in the resumed step"
    );
    assert_eq!(sleep.attr("gen_ai.operation.name"), Some("execute_tool"));
    assert_eq!(sleep.attr("gen_ai.tool.name"), Some("sleep_ms"));
    assert_eq!(sleep.attr("ratchet.replay_policy"), Some("safe"));
    assert!(
        sleep
            .attr("gen_ai.tool.call.id")
            .is_some_and(|id| !id.is_empty())
    );
    let step_index: u64 = resumed.attr("ratchet.step_index").unwrap().parse().unwrap();
    assert_eq!(
        sleep.span_id,
        call_span_id(&root_run, step_index, 0).to_string()
    );

    let delegate = one("execute_tool delegate");
    assert!(
        boss_steps.iter().any(|s| s.span_id == delegate.parent),
        "the delegating call is in one of the run's steps: {everything}"
    );
    let helper = one("invoke_agent helper");
    assert_eq!(
        helper.parent, delegate.span_id,
        "the child run hangs under the delegating call"
    );
    assert_eq!(helper.attr("gen_ai.agent.name"), Some("helper"));
    assert_eq!(helper.attr("ratchet.status"), Some("completed"));

    let helper_steps = steps_of(helper);
    assert!(!helper_steps.is_empty(), "{everything}");
    let chat = one("chat helper-model");
    assert!(
        helper_steps.iter().any(|s| s.span_id == chat.parent),
        "{everything}"
    );
    assert_eq!(chat.attr("gen_ai.operation.name"), Some("chat"));
    assert_eq!(chat.attr("gen_ai.provider.name"), Some("openai"));
    assert_eq!(chat.attr("gen_ai.request.model"), Some("helper-model"));
    assert_eq!(chat.attr("gen_ai.usage.input_tokens"), Some("11"));
    assert_eq!(chat.attr("gen_ai.usage.output_tokens"), Some("3"));
    assert_eq!(
        model_calls,
        vec![Some(format!("00-{CALLER_TRACE}-{}-01", chat.span_id))],
        "the provider was told the model call's span"
    );
    // The scripted model's calls are spans too, with its provider named as Ratchet's.
    assert!(
        (spans.iter()).any(|s| s.name.starts_with("chat ")
            && s.name.ends_with("boss.json")
            && s.attr("gen_ai.provider.name") == Some("ratchet.scripted")),
        "{everything}"
    );
    assert!(
        spans
            .iter()
            .all(|s| s.attr("gen_ai.input.messages").is_none()
                && s.attr("gen_ai.output.messages").is_none()),
        "no content without RATCHET_OTEL_CAPTURE_CONTENT: {everything}"
    );
}
