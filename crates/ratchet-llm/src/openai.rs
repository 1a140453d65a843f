//! OpenAI-compatible chat completions (`POST {base_url}/chat/completions`): OpenAI itself and
//! the servers that speak its protocol (vLLM, Ollama, llama.cpp, proxies).
//!
//! Answers are read leniently, because real servers deviate from OpenAI in known ways (each
//! deviation is named where it is handled): every field has a default, tool calls are
//! assembled by `index` but split by `id`, arguments may be a string or an object. What is not
//! JSON is an error, never the end of a stream. Nothing here retries: a failure is sorted into
//! transient or fatal and handed to the engine.

use std::collections::HashMap;

use async_trait::async_trait;
use ratchet_core::{Message, ModelReply, ModelSettings, Role, ToolCall, Usage};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::http::{self, Events};
use crate::wire::{WireNames, arguments_text, nullable, parse_arguments, preview};
use crate::{Error, Model, ModelRequest, Result};

/// A model behind an OpenAI-compatible chat completions endpoint.
pub struct OpenAi {
    http: reqwest::Client,
    url: String,
    /// Sent as `Authorization: Bearer`; local servers need none.
    api_key: Option<String>,
    model: String,
    stream: bool,
    /// The field that limits the answer's length, and the limit.
    max_tokens: Option<(&'static str, u32)>,
}

impl OpenAi {
    /// `max_output_tokens` is sent as `max_completion_tokens` to OpenAI itself
    /// (`api.openai.com`), whose reasoning models refuse the older `max_tokens`, and as
    /// `max_tokens` to every other server, which all know that one and not always the newer.
    pub fn new(settings: &ModelSettings, api_key: Option<String>) -> Result<OpenAi> {
        let field = if is_openai_itself(&settings.base_url) {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        Ok(OpenAi {
            http: http::client(settings)?,
            url: http::endpoint(&settings.base_url, "chat/completions"),
            api_key: api_key.filter(|k| !k.is_empty()),
            model: settings.model.clone(),
            stream: settings.stream,
            max_tokens: settings.max_output_tokens.map(|n| (field, n)),
        })
    }

    fn body(&self, request: &ModelRequest, names: &WireNames) -> Value {
        let mut body = json!({
            "model": self.model,
            "messages": messages(request, names),
        });
        if !request.tools.is_empty() {
            body["tools"] = request
                .tools
                .iter()
                .map(|tool| {
                    json!({"type": "function", "function": {
                        "name": names.wire(&tool.name),
                        "description": tool.description,
                        "parameters": tool.parameters,
                    }})
                })
                .collect();
        }
        if let Some((field, limit)) = self.max_tokens {
            body[field] = json!(limit);
        }
        body["stream"] = json!(self.stream);
        if self.stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        body
    }
}

fn is_openai_itself(base_url: &str) -> bool {
    reqwest::Url::parse(base_url).is_ok_and(|url| url.host_str() == Some("api.openai.com"))
}

#[async_trait]
impl Model for OpenAi {
    async fn complete(
        &self,
        request: ModelRequest,
        deltas: mpsc::UnboundedSender<String>,
        cancel: CancellationToken,
    ) -> Result<ModelReply> {
        let names = WireNames::for_request(&request);
        let mut call = self.http.post(&self.url).json(&self.body(&request, &names));
        if let Some(key) = &self.api_key {
            call = call.bearer_auth(key);
        }
        if let Some(traceparent) = &request.traceparent {
            call = call.header("traceparent", traceparent);
        }
        let response = http::send(call, &cancel).await?;
        if self.stream && !http::is_json(&response) {
            read_stream(Events::new(response), &names, &deltas, &cancel).await
        } else {
            let body = http::read_body(response, &cancel).await?;
            let reply = parse_completion(&body, &names)?;
            if !reply.text.is_empty() {
                let _ = deltas.send(reply.text.clone());
            }
            Ok(reply)
        }
    }
}

/// The conversation in chat completions' terms: the system prompt first (when there is one),
/// then each message; an assistant's tool calls with their arguments as a string of JSON and
/// `content: null` when it said nothing else; each tool result as a `tool` message.
fn messages(request: &ModelRequest, names: &WireNames) -> Vec<Value> {
    let mut wire = Vec::with_capacity(request.messages.len() + 1);
    if !request.system_prompt.is_empty() {
        wire.push(json!({"role": "system", "content": request.system_prompt}));
    }
    wire.extend(request.messages.iter().map(|m| message(m, names)));
    wire
}

fn message(message: &Message, names: &WireNames) -> Value {
    match message.role {
        Role::System => json!({"role": "system", "content": message.content}),
        Role::User => json!({"role": "user", "content": message.content}),
        Role::Tool => json!({
            "role": "tool",
            "tool_call_id": message.tool_call_id.as_deref().unwrap_or_default(),
            "content": message.content,
        }),
        Role::Assistant if message.tool_calls.is_empty() => {
            json!({"role": "assistant", "content": message.content})
        }
        Role::Assistant => {
            let calls: Vec<Value> = (message.tool_calls.iter())
                .map(|call| {
                    json!({"id": call.id, "type": "function", "function": {
                        "name": names.wire(&call.name),
                        "arguments": arguments_text(&call.arguments),
                    }})
                })
                .collect();
            let content = (!message.content.is_empty()).then_some(message.content.as_str());
            json!({"role": "assistant", "content": content, "tool_calls": calls})
        }
    }
}

// ---------------------------------------------------------------------------------------
// Answers

/// One chunk of a streamed answer. Every field may be missing or `null`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Chunk {
    #[serde(deserialize_with = "nullable")]
    choices: Vec<StreamChoice>,
    usage: Option<WireUsage>,
    error: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StreamChoice {
    #[serde(deserialize_with = "nullable")]
    index: u64,
    delta: Option<Delta>,
    finish_reason: Option<String>,
}

/// What a chunk adds. `reasoning_content` (DeepSeek, vLLM) and `reasoning` (Ollama,
/// OpenRouter, newer vLLM) carry the model's reasoning: it is kept apart from the answer.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Delta {
    content: Option<Value>,
    reasoning_content: Option<Value>,
    reasoning: Option<Value>,
    #[serde(deserialize_with = "nullable")]
    tool_calls: Vec<CallPiece>,
}

impl Delta {
    /// The reasoning this delta adds. A server that sends both fields sends the same text in
    /// each, so only one is read.
    fn take_reasoning(&mut self) -> String {
        let first = content_text(self.reasoning_content.take());
        let second = content_text(self.reasoning.take());
        if first.is_empty() { second } else { first }
    }
}

/// A piece of a tool call: its first piece usually carries `id` and `function.name`, later
/// ones more of `function.arguments`. `type` is not read: some servers send it last.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct CallPiece {
    index: Option<u64>,
    id: Option<String>,
    function: Option<FunctionPiece>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct FunctionPiece {
    name: Option<String>,
    /// A string of (partial) JSON; some proxies send the whole object instead.
    arguments: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct WireUsage {
    #[serde(deserialize_with = "nullable")]
    prompt_tokens: u64,
    #[serde(deserialize_with = "nullable")]
    completion_tokens: u64,
    completion_tokens_details: Option<UsageDetails>,
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct UsageDetails {
    #[serde(deserialize_with = "nullable")]
    reasoning_tokens: u64,
}

/// The part of the prompt read from OpenAI's prompt cache (`cached_tokens`); OpenAI has no
/// price for writing to it.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PromptDetails {
    #[serde(deserialize_with = "nullable")]
    cached_tokens: u64,
}

impl From<WireUsage> for Usage {
    fn from(usage: WireUsage) -> Usage {
        Usage {
            input_tokens: usage.prompt_tokens,
            output_tokens: usage.completion_tokens,
            reasoning_tokens: usage
                .completion_tokens_details
                .map_or(0, |d| d.reasoning_tokens),
            cache_write_tokens: 0,
            cache_read_tokens: usage.prompt_tokens_details.map_or(0, |d| d.cached_tokens),
        }
    }
}

/// A whole (not streamed) answer.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Completion {
    #[serde(deserialize_with = "nullable")]
    choices: Vec<WholeChoice>,
    usage: Option<WireUsage>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct WholeChoice {
    #[serde(deserialize_with = "nullable")]
    index: u64,
    message: Option<Delta>,
}

/// The text of a `content`: a string, or (some servers) a list of parts with `text`.
fn content_text(content: Option<Value>) -> String {
    match content {
        Some(Value::String(text)) => text,
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

/// Tool calls assembled from their pieces.
///
/// Pieces are accumulated by `index`, except that a different non-empty `id` at an index that
/// already has a call starts a new call (Ollama sends every parallel call at index 0, told
/// apart only by `id`). A piece without `index` takes its position in its chunk's list. A call
/// keeps the first `id` and name it is given; a missing `id` becomes `call_{i}`, `i` its
/// position in the reply, so the same answer always gets the same ids.
#[derive(Debug, Default)]
struct Calls {
    calls: Vec<PartialCall>,
    /// The call each index most recently started.
    latest_at: HashMap<u64, usize>,
}

#[derive(Debug, Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
    /// Arguments sent as a JSON value rather than a string.
    whole: Option<Value>,
}

impl Calls {
    fn add(&mut self, position: usize, piece: CallPiece) {
        let index = piece.index.unwrap_or(position as u64);
        let id = piece.id.filter(|id| !id.is_empty());
        let at = match (self.latest_at.get(&index), &id) {
            (Some(&at), Some(id)) if !self.calls[at].id.is_empty() && self.calls[at].id != *id => {
                None
            }
            (Some(&at), _) => Some(at),
            (None, _) => None,
        };
        let at = at.unwrap_or_else(|| {
            self.calls.push(PartialCall::default());
            self.latest_at.insert(index, self.calls.len() - 1);
            self.calls.len() - 1
        });
        let call = &mut self.calls[at];
        if let Some(id) = id
            && call.id.is_empty()
        {
            call.id = id;
        }
        let Some(function) = piece.function else {
            return;
        };
        if let Some(name) = function.name.filter(|n| !n.is_empty())
            && call.name.is_empty()
        {
            call.name = name;
        }
        match function.arguments {
            Some(Value::String(text)) => call.arguments.push_str(&text),
            None | Some(Value::Null) => {}
            Some(value) => call.whole = Some(value),
        }
    }

    fn finish(self, names: &WireNames) -> Vec<ToolCall> {
        (self.calls.into_iter())
            .filter(|c| {
                !(c.id.is_empty() && c.name.is_empty() && c.arguments.is_empty())
                    || c.whole.is_some()
            })
            .enumerate()
            .map(|(i, call)| ToolCall {
                id: if call.id.is_empty() {
                    format!("call_{i}")
                } else {
                    call.id
                },
                name: names.real(&call.name),
                arguments: match call.whole {
                    Some(value) if call.arguments.trim().is_empty() => value,
                    _ => parse_arguments(&call.arguments),
                },
            })
            .collect()
    }
}

/// A streamed answer as it accumulates.
#[derive(Debug, Default)]
struct Answer {
    text: String,
    reasoning: String,
    calls: Calls,
    /// A `finish_reason` arrived (`stop`, `tool_calls`, `length`, or one of a server's own,
    /// such as `eos`): the answer is whole even if `[DONE]` never comes.
    finished: bool,
    usage: Usage,
}

impl Answer {
    fn apply(&mut self, chunk: Chunk, deltas: &mpsc::UnboundedSender<String>) {
        // Any chunk may carry usage (the last one, with no choices, when `include_usage` is
        // on; every one, on some servers, each time the totals so far).
        if let Some(usage) = chunk.usage {
            self.usage = usage.into();
        }
        for choice in chunk.choices.into_iter().filter(|c| c.index == 0) {
            if let Some(mut delta) = choice.delta {
                self.reasoning.push_str(&delta.take_reasoning());
                let text = content_text(delta.content);
                if !text.is_empty() {
                    self.text.push_str(&text);
                    let _ = deltas.send(text);
                }
                for (position, piece) in delta.tool_calls.into_iter().enumerate() {
                    self.calls.add(position, piece);
                }
            }
            if choice.finish_reason.is_some_and(|r| !r.is_empty()) {
                self.finished = true;
            }
        }
    }

    fn finish(self, names: &WireNames) -> ModelReply {
        ModelReply {
            text: self.text,
            tool_calls: self.calls.finish(names),
            usage: self.usage,
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
            if answer.finished {
                break;
            }
            return Err(Error::transient(
                "the stream ended early: no `finish_reason` and no `data: [DONE]`",
            ));
        };
        let data = event.data.trim();
        if data.is_empty() {
            continue;
        }
        if data == "[DONE]" {
            break;
        }
        let json: Value = serde_json::from_str(data).map_err(|e| {
            Error::Fatal(format!(
                "malformed stream: expected a chat completion chunk (JSON), found {:?}: {e}",
                preview(data)
            ))
        })?;
        if event.event == "error" || json.get("error").is_some_and(|e| !e.is_null()) {
            return Err(http::in_band_error(&json));
        }
        let chunk: Chunk = serde_json::from_value(json).map_err(|e| {
            Error::Fatal(format!(
                "malformed stream: expected a chat completion chunk, found {:?}: {e}",
                preview(data)
            ))
        })?;
        answer.apply(chunk, deltas);
    }
    Ok(answer.finish(names))
}

fn parse_completion(body: &[u8], names: &WireNames) -> Result<ModelReply> {
    let text = String::from_utf8_lossy(body);
    let malformed = |e: &dyn std::fmt::Display| {
        Error::Fatal(format!(
            "malformed answer: expected a chat completion (JSON), found {:?}: {e}",
            preview(&text)
        ))
    };
    let json: Value = serde_json::from_str(&text).map_err(|e| malformed(&e))?;
    if json.get("error").is_some_and(|e| !e.is_null()) {
        return Err(http::in_band_error(&json));
    }
    let completion: Completion = serde_json::from_value(json).map_err(|e| malformed(&e))?;
    let Some(mut message) = (completion.choices.into_iter())
        .find(|c| c.index == 0)
        .and_then(|c| c.message)
    else {
        return Err(malformed(&"no choice with a message"));
    };
    let reasoning = message.take_reasoning();
    let mut calls = Calls::default();
    for (position, piece) in message.tool_calls.into_iter().enumerate() {
        calls.add(position, piece);
    }
    Ok(ModelReply {
        reasoning,
        text: content_text(message.content),
        tool_calls: calls.finish(names),
        usage: completion.usage.map(Usage::from).unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds tool-call pieces, one list per chunk, and returns the calls assembled.
    fn assemble(chunks: &[Value]) -> Vec<ToolCall> {
        let mut calls = Calls::default();
        for chunk in chunks {
            let pieces: Vec<CallPiece> = serde_json::from_value(chunk.clone()).unwrap();
            for (position, piece) in pieces.into_iter().enumerate() {
                calls.add(position, piece);
            }
        }
        calls.finish(&WireNames::default())
    }

    fn call(id: &str, name: &str, arguments: Value) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: name.into(),
            arguments,
        }
    }

    #[test]
    fn arguments_accumulate_by_index_across_pieces() {
        let calls = assemble(&[
            json!([{"index": 0, "id": "a", "type": "function", "function": {"name": "add", "arguments": ""}}]),
            json!([{"index": 0, "function": {"arguments": "{\"a\":"}}]),
            json!([{"index": 1, "id": "b", "function": {"name": "now", "arguments": "{"}}]),
            json!([{"index": 0, "function": {"arguments": " 2, \"b\": 3}"}}]),
            json!([{"index": 1, "function": {"arguments": "}"}}]),
        ]);
        assert_eq!(
            calls,
            [
                call("a", "add", json!({"a": 2, "b": 3})),
                call("b", "now", json!({}))
            ]
        );
    }

    #[test]
    fn a_different_id_at_an_occupied_index_starts_a_new_call() {
        let calls = assemble(&[
            json!([{"index": 0, "id": "a", "function": {"name": "add", "arguments": "{\"a\":1}"}}]),
            json!([{"index": 0, "id": "b", "function": {"name": "add", "arguments": "{\"a\":2}"}}]),
            // The same id again continues its call; an empty id continues the latest one.
            json!([{"index": 0, "id": "b", "function": {"arguments": ""}}]),
            json!([{"index": 0, "id": "", "function": {"arguments": ""}}]),
        ]);
        assert_eq!(
            calls,
            [
                call("a", "add", json!({"a": 1})),
                call("b", "add", json!({"a": 2}))
            ]
        );
    }

    #[test]
    fn missing_fields_default_and_ids_are_generated_by_position() {
        let calls = assemble(&[
            // No index: the position in the chunk's list. No id: `call_{i}`.
            json!([{"function": {"name": "add"}}, {"function": {"name": "now"}}]),
            json!([{"function": {"arguments": "{\"a\":1}"}}]),
            json!([{"index": 0, "type": "function"}]),
            // A piece carrying nothing at a fresh index makes no call.
            json!([{"index": 5}]),
        ]);
        assert_eq!(
            calls,
            [
                call("call_0", "add", json!({"a": 1})),
                call("call_1", "now", json!({}))
            ]
        );
    }

    #[test]
    fn arguments_as_an_object_or_unparsable_text() {
        let calls = assemble(&[
            json!([{"index": 0, "id": "a", "function": {"name": "add", "arguments": {"a": 1}}}]),
            json!([{"index": 1, "id": "b", "function": {"name": "add", "arguments": "{\"a\": tr"}}]),
        ]);
        assert_eq!(
            calls,
            [
                call("a", "add", json!({"a": 1})),
                call("b", "add", json!("{\"a\": tr"))
            ]
        );
    }

    #[test]
    fn the_first_name_given_is_kept() {
        // Some servers repeat the name in every piece.
        let calls = assemble(&[
            json!([{"index": 0, "id": "a", "function": {"name": "add", "arguments": "{"}}]),
            json!([{"index": 0, "function": {"name": "add", "arguments": "}"}}]),
        ]);
        assert_eq!(calls, [call("a", "add", json!({}))]);
    }

    #[test]
    fn max_tokens_field_depends_on_the_server() {
        assert!(is_openai_itself("https://api.openai.com/v1"));
        assert!(!is_openai_itself("http://localhost:11434/v1"));
        assert!(!is_openai_itself("https://openrouter.ai/api/v1"));
    }
}
