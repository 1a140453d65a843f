//! The `ratchet` binary against a local server that speaks OpenAI's chat-completions wire
//! protocol: `--model openai:MODEL` with `OPENAI_BASE_URL`, a profile from `--config`, streamed
//! tool calls split across chunks, usage, and a refused call ending the run with `llm_error`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

use crate::common::{output_within_deadline, report, stderr_of, stdout_of};
use serde_json::{Value, json};

/// One canned HTTP answer: status line and body (SSE or JSON).
struct Canned {
    status: &'static str,
    content_type: &'static str,
    body: String,
}

/// A local HTTP server answering each request with the next canned answer (the last one
/// repeats) and keeping every request body it received.
struct FakeProvider {
    url: String,
    bodies: Arc<Mutex<Vec<Value>>>,
}

impl FakeProvider {
    fn start(answers: Vec<Canned>) -> FakeProvider {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&bodies);
        std::thread::spawn(move || {
            for (i, stream) in listener.incoming().enumerate() {
                let Ok(mut stream) = stream else { return };
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut length = 0;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    let lower = line.to_ascii_lowercase();
                    if let Some(value) = lower.strip_prefix("content-length:") {
                        length = value.trim().parse().unwrap_or(0);
                    }
                }
                let mut body = vec![0; length];
                let _ = reader.read_exact(&mut body);
                if let Ok(value) = serde_json::from_slice(&body) {
                    seen.lock().unwrap().push(value);
                }
                let answer = &answers[i.min(answers.len() - 1)];
                let _ = write!(
                    stream,
                    "HTTP/1.1 {}\r\ncontent-type: {}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{}",
                    answer.status,
                    answer.content_type,
                    answer.body.len(),
                    answer.body
                );
            }
        });
        FakeProvider { url, bodies }
    }

    fn bodies(&self) -> Vec<Value> {
        self.bodies.lock().unwrap().clone()
    }
}

fn sse(chunks: &[Value]) -> Canned {
    let mut body: String = chunks.iter().map(|c| format!("data: {c}\n\n")).collect();
    body.push_str("data: [DONE]\n\n");
    Canned {
        status: "200 OK",
        content_type: "text/event-stream",
        body,
    }
}

/// A call of `add` whose arguments arrive in six pieces (the first without any, as vLLM
/// sends it), then usage in a chunk of its own (OpenAI's `include_usage`).
fn tool_call_stream() -> Canned {
    let piece =
        |delta: Value| json!({"choices": [{"index": 0, "delta": delta, "finish_reason": null}]});
    let arguments =
        |text: &str| piece(json!({"tool_calls": [{"index": 0, "function": {"arguments": text}}]}));
    sse(&[
        piece(json!({"role": "assistant", "content": "Adding."})),
        piece(
            json!({"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "add"}}]}),
        ),
        arguments("{\"a"),
        arguments("\": "),
        arguments("2, "),
        arguments("\"b\""),
        arguments(": 3"),
        arguments("}"),
        json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
        json!({"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29}}),
    ])
}

/// An answer as llama.cpp's server streams it: chunk metadata on every chunk, and usage and
/// timings in the chunk that finishes.
fn answer_stream() -> Canned {
    let meta = |choices: Value| {
        json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1764460800,
               "model": "local", "system_fingerprint": "b4000", "choices": choices})
    };
    let piece =
        |text: &str| meta(json!([{"index": 0, "delta": {"content": text}, "finish_reason": null}]));
    let mut last = meta(json!([{"index": 0, "delta": {}, "finish_reason": "stop"}]));
    last["usage"] = json!({"prompt_tokens": 40, "completion_tokens": 5, "total_tokens": 45});
    last["timings"] = json!({"prompt_n": 40, "predicted_n": 5, "predicted_ms": 12.5});
    sse(&[piece("The sum "), piece("is 5."), last])
}

fn ratchet(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ratchet"));
    command.args(args).current_dir(dir);
    for var in [
        "RATCHET_DB",
        "RATCHET_LOG",
        "OPENAI_BASE_URL",
        "OPENAI_API_KEY",
    ] {
        command.env_remove(var);
    }
    command
        .env("NO_PROXY", "127.0.0.1")
        .env("no_proxy", "127.0.0.1");
    for (key, value) in env {
        command.env(key, value);
    }
    output_within_deadline(&mut command, "")
}

#[test]
fn an_openai_compatible_server_runs_a_tool_round_trip() {
    let provider = FakeProvider::start(vec![tool_call_stream(), answer_stream()]);
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}/r.db", dir.path().display());
    let output = ratchet(
        dir.path(),
        &[
            "run",
            "--db",
            &db,
            "--model",
            "openai:test-model",
            "--json",
            "What is 2 + 3?",
        ],
        &[
            ("OPENAI_BASE_URL", &provider.url),
            ("OPENAI_API_KEY", "sk-test"),
        ],
    );
    assert!(output.status.success(), "{}", stderr_of(&output));
    let report = report(&output);
    assert_eq!(report["final_answer"], "The sum is 5.");
    assert_eq!(report["steps"], 3, "model, tools, model");

    let bodies = provider.bodies();
    assert_eq!(bodies.len(), 2, "{bodies:#?}");
    assert_eq!(bodies[0]["model"], "test-model");
    assert_eq!(bodies[0]["stream"], true);
    let second = bodies[1]["messages"].as_array().unwrap();
    let tool = second
        .iter()
        .find(|m| m["role"] == "tool")
        .expect("the tool result is sent back");
    assert_eq!(tool["tool_call_id"], "call_a");
    assert!(tool["content"].as_str().unwrap().contains('5'), "{tool}");

    let run_id = report["run_id"].as_str().unwrap();
    let shown = ratchet(
        dir.path(),
        &["runs", "show", run_id, "--db", &db, "--json"],
        &[],
    );
    let shown: Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(
        (
            &shown["counters"]["input_tokens"],
            &shown["counters"]["output_tokens"]
        ),
        (&json!(60), &json!(14)),
        "{shown}"
    );
}

#[test]
fn a_profile_names_the_server_and_a_refusal_ends_the_run_with_the_providers_message() {
    let refusal = Canned {
        status: "401 Unauthorized",
        content_type: "application/json",
        body: json!({"error": {"message": "Incorrect API key provided: sk-bad", "type": "invalid_request_error"}})
            .to_string(),
    };
    let provider = FakeProvider::start(vec![refusal]);
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "[models.local]\nprovider = \"openai\"\nmodel = \"m\"\nbase_url = \"{}\"\napi_key_env = \"LOCAL_KEY\"\n",
        provider.url
    );
    std::fs::write(dir.path().join("ratchet.toml"), config).unwrap();
    let db = format!("sqlite://{}/r.db", dir.path().display());
    let args = [
        "run",
        "--db",
        &db,
        "--config",
        "ratchet.toml",
        "--model",
        "local",
        "--json",
        "hi",
    ];
    let unset = ratchet(dir.path(), &args, &[]);
    assert_eq!(unset.status.code(), Some(1));
    assert!(
        stderr_of(&unset).contains("LOCAL_KEY is not set"),
        "{}",
        stderr_of(&unset)
    );
    assert!(
        provider.bodies().is_empty(),
        "nothing is sent with a missing key"
    );

    let output = ratchet(dir.path(), &args, &[("LOCAL_KEY", "sk-bad")]);
    assert_eq!(output.status.code(), Some(1), "{}", stdout_of(&output));
    let report = report(&output);
    assert_eq!(
        (&report["status"], &report["stop_reason"]),
        (&json!("failed"), &json!("llm_error"))
    );
    let stderr = stderr_of(&output);
    assert!(stderr.contains("Incorrect API key provided"), "{stderr}");
    assert_eq!(provider.bodies().len(), 1, "a refusal is not retried");
}

#[test]
fn a_rate_limited_call_waits_as_long_as_the_provider_asks_then_succeeds() {
    let limited = Canned {
        status: "429 Too Many Requests\r\nretry-after: 2",
        content_type: "application/json",
        body: json!({"error": {"message": "Rate limit reached", "type": "requests"}}).to_string(),
    };
    let provider = FakeProvider::start(vec![limited, tool_call_stream(), answer_stream()]);
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}/r.db", dir.path().display());
    let started = std::time::Instant::now();
    let output = ratchet(
        dir.path(),
        &[
            "run",
            "--db",
            &db,
            "--model",
            "openai:test-model",
            "--json",
            "What is 2 + 3?",
        ],
        &[("OPENAI_BASE_URL", &provider.url)],
    );
    let waited = started.elapsed();
    let stderr = stderr_of(&output);
    assert!(output.status.success(), "{stderr}");
    assert_eq!(report(&output)["final_answer"], "The sum is 5.");
    assert!(
        stderr.contains("Rate limit reached") && stderr.contains("retrying"),
        "{stderr}"
    );
    assert!(
        waited >= std::time::Duration::from_secs(2),
        "Retry-After: 2 honoured, waited {waited:?}"
    );
    assert_eq!(
        provider.bodies().len(),
        3,
        "one refused call, then the two calls of the run"
    );
}

#[test]
fn bad_provider_configuration_is_refused_at_start() {
    for (profile, expected) in [
        (
            "provider = \"gemini\"\nmodel = \"m\"",
            "unknown provider \"gemini\"",
        ),
        (
            "provider = \"openai\"\nmodel = \"m\"\nbase_url = \"localhost:8080\"",
            "not an http:// or https:// URL",
        ),
        (
            "provider = \"anthropic\"\nmodel = \"m\"\napi_key_env = \"NO_SUCH_KEY\"",
            "NO_SUCH_KEY is not set",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("ratchet.toml"),
            format!("[models.p]\n{profile}\n"),
        )
        .unwrap();
        let db = format!("sqlite://{}/r.db", dir.path().display());
        let output = ratchet(
            dir.path(),
            &[
                "run",
                "--db",
                &db,
                "--config",
                "ratchet.toml",
                "--model",
                "p",
                "hi",
            ],
            &[],
        );
        assert_eq!(output.status.code(), Some(1), "{profile}");
        assert!(
            stderr_of(&output).contains(expected),
            "{profile}: {}",
            stderr_of(&output)
        );
        assert!(
            !dir.path().join("r.db").exists(),
            "nothing written for {profile}"
        );
    }
}
