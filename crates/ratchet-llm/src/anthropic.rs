//! Anthropic Messages (`POST {base_url}/v1/messages`), streamed or whole.
//!
//! The conversation is rewritten into what the API insists on: the system prompt beside the
//! messages, not among them; strictly alternating user and assistant turns (tool results are
//! user content, so a batch's results and anything said after them make one user turn); tool
//! calls and text as content blocks. In a stream, `ping` and event types this client does not
//! know are skipped, thinking is kept apart from the answer, and an `error` event after HTTP
//! 200 is a failure like any other. Nothing here retries.

use std::collections::BTreeMap;

use async_trait::async_trait;
use ratchet_core::{ModelReply, ModelSettings, Role, ToolCall, Usage};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::http::{self, Events};
use crate::wire::{WireNames, parse_arguments, preview};
use crate::{Error, Model, ModelRequest, Result};

/// The API version this client speaks.
const API_VERSION: &str = "2023-06-01";

/// `max_tokens` when the settings give none: the API requires one.
pub const DEFAULT_MAX_TOKENS: u32 = 4096;

/// A model behind the Anthropic Messages API.
pub struct Anthropic {
    http: reqwest::Client,
    url: String,
    /// Sent as `x-api-key`; a proxy that holds the key itself needs none.
    api_key: Option<String>,
    model: String,
    stream: bool,
    max_tokens: u32,
}

impl Anthropic {
    /// The endpoint is `{base_url}/v1/messages`; a `base_url` that already ends in `/v1` is
    /// not given a second one.
    pub fn new(settings: &ModelSettings, api_key: Option<String>) -> Result<Anthropic> {
        let base = settings.base_url.trim_end_matches('/');
        let path = if base.ends_with("/v1") {
            "messages"
        } else {
            "v1/messages"
        };
        Ok(Anthropic {
            http: http::client(settings)?,
            url: http::endpoint(base, path),
            api_key: api_key.filter(|k| !k.is_empty()),
            model: settings.model.clone(),
            stream: settings.stream,
            max_tokens: settings.max_output_tokens.unwrap_or(DEFAULT_MAX_TOKENS),
        })
    }

    fn body(&self, request: &ModelRequest, names: &WireNames) -> Value {
        let (system, messages) = conversation(request, names);
        let mut body = json!({
            "model": self.model,
            "max_tokens": self.max_tokens,
            "messages": messages,
        });
        if !system.is_empty() {
            body["system"] = json!(system);
        }
        if !request.tools.is_empty() {
            body["tools"] = (request.tools.iter())
                .map(|tool| {
                    json!({
                        "name": names.wire(&tool.name),
                        "description": tool.description,
                        "input_schema": tool.parameters,
                    })
                })
                .collect();
        } else if let Some(tools) = placeholder_tools(request, names) {
            // The API refuses a conversation with tool calls in it unless tools are defined,
            // even when this answer must be given without them (a concluding call, a
            // summary): the tools the history names are declared, and none may be used.
            body["tools"] = tools;
            body["tool_choice"] = json!({"type": "none"});
        }
        body["stream"] = json!(self.stream);
        body
    }
}

fn placeholder_tools(request: &ModelRequest, names: &WireNames) -> Option<Value> {
    let mut called: Vec<&str> = (request.messages.iter())
        .flat_map(|m| &m.tool_calls)
        .map(|c| names.wire(&c.name))
        .collect();
    called.sort_unstable();
    called.dedup();
    (!called.is_empty()).then(|| {
        called
            .into_iter()
            .map(|name| {
                json!({
                    "name": name,
                    "description": "Not available for this answer.",
                    "input_schema": {"type": "object"},
                })
            })
            .collect()
    })
}

#[async_trait]
impl Model for Anthropic {
    async fn complete(
        &self,
        request: ModelRequest,
        deltas: mpsc::UnboundedSender<String>,
        cancel: CancellationToken,
    ) -> Result<ModelReply> {
        let names = WireNames::for_request(&request);
        let mut call = (self.http.post(&self.url))
            .header("anthropic-version", API_VERSION)
            .json(&self.body(&request, &names));
        if let Some(key) = &self.api_key {
            call = call.header("x-api-key", key);
        }
        if let Some(traceparent) = &request.traceparent {
            call = call.header("traceparent", traceparent);
        }
        let response = http::send(call, &cancel).await?;
        if self.stream && !http::is_json(&response) {
            read_stream(Events::new(response), &names, &deltas, &cancel).await
        } else {
            let body = http::read_body(response, &cancel).await?;
            let reply = parse_message(&body, &names)?;
            if !reply.text.is_empty() {
                let _ = deltas.send(reply.text.clone());
            }
            Ok(reply)
        }
    }
}

/// The system text and the messages, as the API takes them.
///
/// System messages in the history join the system prompt. Each other message becomes content
/// blocks of its role's turn (a tool result is a user's `tool_result` block), and blocks of
/// the same role in a row make one turn, so turns alternate. Empty text makes no block: the API
/// refuses empty text blocks. A failed call's result says so with `is_error`.
fn conversation(request: &ModelRequest, names: &WireNames) -> (String, Vec<Value>) {
    let mut system = Vec::new();
    if !request.system_prompt.is_empty() {
        system.push(request.system_prompt.as_str());
    }
    let mut turns: Vec<(&'static str, Vec<Value>)> = Vec::new();
    let mut add = |role: &'static str, block: Value| match turns.last_mut() {
        Some((last, blocks)) if *last == role => blocks.push(block),
        _ => turns.push((role, vec![block])),
    };
    for message in &request.messages {
        let text = || json!({"type": "text", "text": message.content});
        match message.role {
            Role::System if !message.content.is_empty() => system.push(&message.content),
            Role::System => {}
            Role::User if !message.content.is_empty() => add("user", text()),
            Role::User => {}
            Role::Tool => add("user", {
                let mut block = json!({
                    "type": "tool_result",
                    "tool_use_id": wire_id(message.tool_call_id.as_deref().unwrap_or_default()),
                    "content": message.content,
                });
                if message.is_error {
                    block["is_error"] = json!(true);
                }
                block
            }),
            Role::Assistant => {
                if !message.content.is_empty() {
                    add("assistant", text());
                }
                for call in &message.tool_calls {
                    add(
                        "assistant",
                        json!({
                            "type": "tool_use",
                            "id": wire_id(&call.id),
                            "name": names.wire(&call.name),
                            "input": input_object(&call.arguments),
                        }),
                    );
                }
            }
        }
    }
    let messages = (turns.into_iter())
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect();
    (system.join("\n\n"), messages)
}

/// A call's arguments as the object `tool_use.input` must be. Arguments kept as raw text
/// because they were not an object (see `wire::parse_arguments`) go as `{}`: the result of
/// that call, right after it, tells the model what was wrong.
fn input_object(arguments: &Value) -> Value {
    match arguments {
        Value::Object(_) => arguments.clone(),
        Value::String(raw) => match parse_arguments(raw) {
            value @ Value::Object(_) => value,
            _ => json!({}),
        },
        _ => json!({}),
    }
}

/// A call id the API accepts (`^[a-zA-Z0-9_-]+$`): other providers' ids may hold other
/// characters (`functions.add:0`). The same id always maps to the same wire id, so a call and
/// its result still match.
fn wire_id(id: &str) -> String {
    if id.is_empty() {
        return "call".to_owned();
    }
    id.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Answers

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum StreamEvent {
    MessageStart {
        message: StartedMessage,
    },
    ContentBlockStart {
        index: u64,
        content_block: Block,
    },
    ContentBlockDelta {
        index: u64,
        delta: BlockDelta,
    },
    MessageDelta {
        #[serde(default)]
        delta: MessageChange,
        #[serde(default)]
        usage: WireUsage,
    },
    MessageStop,
    /// `ping`, `content_block_stop`, and types added to the API later.
    #[serde(other)]
    Other,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StartedMessage {
    usage: WireUsage,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block {
    Text {
        #[serde(default)]
        text: String,
    },
    ToolUse {
        #[serde(default)]
        id: String,
        name: String,
        #[serde(default)]
        input: Value,
    },
    Thinking {
        #[serde(default)]
        thinking: String,
    },
    /// `redacted_thinking`, and what the API adds later: not the answer.
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum BlockDelta {
    TextDelta {
        text: String,
    },
    InputJsonDelta {
        #[serde(default)]
        partial_json: String,
    },
    ThinkingDelta {
        #[serde(default)]
        thinking: String,
    },
    /// `signature_delta`, `citations_delta`, and later ones.
    #[serde(other)]
    Other,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct MessageChange {
    stop_reason: Option<String>,
}

/// Token counts; each is the total so far when present. The prompt's tokens are split into
/// uncached, written to the cache and read from it: all three are the prompt.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct WireUsage {
    input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
    output_tokens: Option<u64>,
}

impl WireUsage {
    /// Takes the counts `later` has.
    fn update(&mut self, later: WireUsage) {
        let fields = [
            (&mut self.input_tokens, later.input_tokens),
            (
                &mut self.cache_creation_input_tokens,
                later.cache_creation_input_tokens,
            ),
            (
                &mut self.cache_read_input_tokens,
                later.cache_read_input_tokens,
            ),
            (&mut self.output_tokens, later.output_tokens),
        ];
        for (field, value) in fields {
            if value.is_some() {
                *field = value;
            }
        }
    }

    fn usage(&self) -> Usage {
        let count = |n: Option<u64>| n.unwrap_or(0);
        Usage {
            input_tokens: count(self.input_tokens)
                + count(self.cache_creation_input_tokens)
                + count(self.cache_read_input_tokens),
            output_tokens: count(self.output_tokens),
            // Thinking is counted in `output_tokens` and not reported apart.
            reasoning_tokens: 0,
            cache_write_tokens: count(self.cache_creation_input_tokens),
            cache_read_tokens: count(self.cache_read_input_tokens),
        }
    }
}

#[derive(Debug, Default)]
struct ToolUse {
    id: String,
    name: String,
    /// The input the block started with; `partial_json` pieces, when any, replace it.
    input: Value,
    json: String,
}

/// A streamed answer as it accumulates. Tool calls are kept by block index, which is their
/// order in the answer.
#[derive(Debug, Default)]
struct Answer {
    text: String,
    /// The thinking blocks' text, a blank line between blocks.
    reasoning: String,
    tools: BTreeMap<u64, ToolUse>,
    /// `message_delta` gave the stop reason: the answer is whole even if `message_stop`
    /// never comes.
    stopped: bool,
    usage: WireUsage,
}

impl Answer {
    fn add_text(&mut self, text: String, deltas: &mpsc::UnboundedSender<String>) {
        if !text.is_empty() {
            self.text.push_str(&text);
            let _ = deltas.send(text);
        }
    }

    fn add_block(&mut self, index: u64, block: Block, deltas: &mpsc::UnboundedSender<String>) {
        match block {
            Block::Text { text } => self.add_text(text, deltas),
            Block::Thinking { thinking } => {
                if !self.reasoning.is_empty() {
                    self.reasoning.push_str("\n\n");
                }
                self.reasoning.push_str(&thinking);
            }
            Block::ToolUse { id, name, input } => {
                let call = ToolUse {
                    id,
                    name,
                    input,
                    json: String::new(),
                };
                self.tools.insert(index, call);
            }
            Block::Other => {}
        }
    }

    fn finish(self, names: &WireNames) -> ModelReply {
        let tool_calls = (self.tools.into_values().enumerate())
            .map(|(i, call)| ToolCall {
                id: if call.id.is_empty() {
                    format!("call_{i}")
                } else {
                    call.id
                },
                name: names.real(&call.name),
                arguments: if call.json.trim().is_empty() {
                    match call.input {
                        value @ Value::Object(_) => value,
                        _ => json!({}),
                    }
                } else {
                    parse_arguments(&call.json)
                },
            })
            .collect();
        ModelReply {
            text: self.text,
            tool_calls,
            usage: self.usage.usage(),
            reasoning: self.reasoning,
        }
    }
}

async fn read_stream(
    mut events: Events,
    names: &WireNames,
    deltas: &mpsc::UnboundedSender<String>,
    cancel: &CancellationToken,
) -> Result<ModelReply> {
    let mut answer = Answer::default();
    loop {
        let Some(event) = events.next(cancel).await? else {
            if answer.stopped {
                break;
            }
            return Err(Error::transient(
                "the stream ended early: no `message_stop` and no stop reason",
            ));
        };
        let data = event.data.trim();
        if data.is_empty() {
            continue;
        }
        let malformed = |e: &dyn std::fmt::Display| {
            Error::Fatal(format!(
                "malformed stream: expected a Messages stream event (JSON), found {:?}: {e}",
                preview(data)
            ))
        };
        let json: Value = serde_json::from_str(data).map_err(|e| malformed(&e))?;
        if json.get("type").and_then(Value::as_str) == Some("error") || event.event == "error" {
            return Err(http::in_band_error(&json));
        }
        match serde_json::from_value(json).map_err(|e| malformed(&e))? {
            StreamEvent::MessageStart { message } => answer.usage.update(message.usage),
            StreamEvent::ContentBlockStart {
                index,
                content_block,
            } => answer.add_block(index, content_block, deltas),
            StreamEvent::ContentBlockDelta { index, delta } => match delta {
                BlockDelta::TextDelta { text } => answer.add_text(text, deltas),
                BlockDelta::ThinkingDelta { thinking } => answer.reasoning.push_str(&thinking),
                BlockDelta::InputJsonDelta { partial_json } => {
                    let Some(call) = answer.tools.get_mut(&index) else {
                        return Err(malformed(&format!(
                            "input_json_delta for block {index}, which is not a tool_use block"
                        )));
                    };
                    call.json.push_str(&partial_json);
                }
                BlockDelta::Other => {}
            },
            StreamEvent::MessageDelta { delta, usage } => {
                answer.usage.update(usage);
                answer.stopped |= delta.stop_reason.is_some();
            }
            StreamEvent::MessageStop => break,
            StreamEvent::Other => {}
        }
    }
    Ok(answer.finish(names))
}

#[derive(Debug, Deserialize)]
struct WholeMessage {
    content: Vec<Block>,
    #[serde(default)]
    usage: WireUsage,
}

fn parse_message(body: &[u8], names: &WireNames) -> Result<ModelReply> {
    let text = String::from_utf8_lossy(body);
    let malformed = |e: &dyn std::fmt::Display| {
        Error::Fatal(format!(
            "malformed answer: expected a Messages response (JSON), found {:?}: {e}",
            preview(&text)
        ))
    };
    let json: Value = serde_json::from_str(&text).map_err(|e| malformed(&e))?;
    if json.get("type").and_then(Value::as_str) == Some("error") {
        return Err(http::in_band_error(&json));
    }
    let message: WholeMessage = serde_json::from_value(json).map_err(|e| malformed(&e))?;
    let mut answer = Answer {
        usage: message.usage,
        ..Answer::default()
    };
    let (no_deltas, _) = mpsc::unbounded_channel();
    for (index, block) in message.content.into_iter().enumerate() {
        answer.add_block(index as u64, block, &no_deltas);
    }
    Ok(answer.finish(names))
}

#[cfg(test)]
mod tests {
    use ratchet_core::{Message, RunId, ToolOutcome, ToolSpec};

    use super::*;

    fn request(messages: Vec<Message>) -> ModelRequest {
        ModelRequest {
            run_id: RunId::from_suffix("r").unwrap(),
            call_index: 0,
            attempt: 1,
            system_prompt: "Be brief.".into(),
            messages,
            tools: Vec::new(),
            traceparent: None,
        }
    }

    fn call(id: &str, name: &str, arguments: Value) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: name.into(),
            arguments,
        }
    }

    #[test]
    fn turns_alternate_and_system_messages_join_the_system_prompt() {
        let mut system = Message::user("Answer in French.");
        system.role = Role::System;
        let request = request(vec![
            Message::user("one"),
            Message::user("two"),
            system,
            Message::assistant(
                "",
                vec![
                    call("c.1", "fs.read", json!({"p": "a"})),
                    call("c.2", "fs.read", json!({"p": "b"})),
                ],
            ),
            Message::tool_result("c.1", &ToolOutcome::ok("A")),
            Message::tool_result("c.2", &ToolOutcome::error("no such file")),
            Message::user("three"),
            Message::assistant("fine", Vec::new()),
            Message::assistant("", Vec::new()),
        ]);
        let names = WireNames::for_request(&request);
        let (system, messages) = conversation(&request, &names);
        assert_eq!(system, "Be brief.\n\nAnswer in French.");
        assert_eq!(
            Value::Array(messages),
            json!([
                {"role": "user", "content": [
                    {"type": "text", "text": "one"},
                    {"type": "text", "text": "two"},
                ]},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "c_1", "name": "fs_read", "input": {"p": "a"}},
                    {"type": "tool_use", "id": "c_2", "name": "fs_read", "input": {"p": "b"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "c_1", "content": "A"},
                    {"type": "tool_result", "tool_use_id": "c_2", "content": "no such file",
                     "is_error": true},
                    {"type": "text", "text": "three"},
                ]},
                {"role": "assistant", "content": [{"type": "text", "text": "fine"}]},
            ])
        );
    }

    #[test]
    fn inputs_are_objects_and_ids_are_in_the_api_alphabet() {
        assert_eq!(input_object(&json!({"a": 1})), json!({"a": 1}));
        assert_eq!(input_object(&json!(r#"{"a": 1}"#)), json!({"a": 1}));
        assert_eq!(input_object(&json!("{\"a\": tr")), json!({}));
        assert_eq!(input_object(&json!([1])), json!({}));
        assert_eq!(wire_id("toolu_01A-b"), "toolu_01A-b");
        assert_eq!(wire_id("functions.add:0"), "functions_add_0");
        assert_eq!(wire_id(""), "call");
    }

    #[test]
    fn a_call_without_tools_declares_the_history_s_tools_and_allows_none() {
        let mut request = request(vec![
            Message::user("one"),
            Message::assistant("", vec![call("c1", "fs.read", json!({}))]),
            Message::tool_result("c1", &ToolOutcome::ok("A")),
        ]);
        let settings = ModelSettings {
            provider: "anthropic".into(),
            base_url: "http://127.0.0.1:1".into(),
            model: "m".into(),
            api_key_env: None,
            connect_timeout_ms: 1000,
            read_timeout_ms: 1000,
            stream: true,
            max_output_tokens: None,
            prices: None,
        };
        let model = Anthropic::new(&settings, None).unwrap();
        let names = WireNames::for_request(&request);
        let body = model.body(&request, &names);
        assert_eq!(
            body["tools"],
            json!([{"name": "fs_read", "description": "Not available for this answer.", "input_schema": {"type": "object"}}])
        );
        assert_eq!(body["tool_choice"], json!({"type": "none"}));
        assert_eq!(body["max_tokens"], json!(DEFAULT_MAX_TOKENS));

        // With tools given, they are sent and no choice is imposed.
        request.tools = vec![ToolSpec {
            calls: Default::default(),
            name: "fs.read".into(),
            description: "Reads".into(),
            parameters: json!({"type": "object"}),
            replay: ratchet_core::ReplayPolicy::Safe,
            completes_run: false,
            approval: Default::default(),
            delegation: Default::default(),
        }];
        let body = model.body(&request, &WireNames::for_request(&request));
        assert_eq!(
            body["tools"],
            json!([{"name": "fs_read", "description": "Reads", "input_schema": {"type": "object"}}])
        );
        assert!(body.get("tool_choice").is_none());

        // Without any tool call in the history, no tools at all.
        let plain = super::tests::request(vec![Message::user("hi")]);
        let body = model.body(&plain, &WireNames::for_request(&plain));
        assert!(body.get("tools").is_none() && body.get("tool_choice").is_none());
    }

    #[test]
    fn the_endpoint_gets_one_v1() {
        let mut settings = ModelSettings {
            provider: "anthropic".into(),
            base_url: "https://api.anthropic.com".into(),
            model: "m".into(),
            api_key_env: None,
            connect_timeout_ms: 1000,
            read_timeout_ms: 1000,
            stream: true,
            max_output_tokens: Some(99),
            prices: None,
        };
        let model = Anthropic::new(&settings, None).unwrap();
        assert_eq!(model.url, "https://api.anthropic.com/v1/messages");
        assert_eq!(model.max_tokens, 99);
        settings.base_url = "https://proxy.example/anthropic/v1/".into();
        let model = Anthropic::new(&settings, None).unwrap();
        assert_eq!(model.url, "https://proxy.example/anthropic/v1/messages");
    }

    #[test]
    fn usage_counts_cached_prompt_tokens_and_takes_the_latest_totals() {
        let mut usage = WireUsage::default();
        usage.update(
            serde_json::from_value(json!({"input_tokens": 10, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 5, "output_tokens": 1}))
                .unwrap(),
        );
        usage.update(serde_json::from_value(json!({"output_tokens": 42})).unwrap());
        assert_eq!(
            usage.usage(),
            Usage {
                input_tokens: 115,
                output_tokens: 42,
                reasoning_tokens: 0,
                cache_write_tokens: 5,
                cache_read_tokens: 100
            }
        );
    }
}
