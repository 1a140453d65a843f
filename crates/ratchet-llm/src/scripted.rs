//! The scripted model: deterministic replies read from a JSON file, for tests, demos and
//! benchmarks. Reply `i` answers the run's `i`-th model call; past the end the last reply
//! repeats. A reply's `error` makes the first attempt of that call fail.

use std::time::Duration;

use async_trait::async_trait;
use ratchet_core::{ModelReply, ToolCall, Usage};
use serde::Deserialize;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::{Error, Model, ModelRequest, Result};

/// Used when no model is given: one tool round-trip, then an answer.
pub const DEMO_SCRIPT: &str = r#"{"replies": [
  {"text": "Let me add those numbers.", "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}], "chunk_delay_ms": 30},
  {"text": "2 + 3 = 5. This answer came from Ratchet's built-in demo model, one durable step at a time.", "chunk_delay_ms": 30}
]}"#;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    replies: Vec<Reply>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Reply {
    #[serde(default)]
    text: String,
    #[serde(default)]
    tool_calls: Vec<ScriptedCall>,
    #[serde(default)]
    chunk_delay_ms: u64,
    #[serde(default)]
    error: Option<ScriptedError>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScriptedCall {
    name: String,
    #[serde(default = "empty_object")]
    arguments: Value,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
enum ScriptedError {
    #[serde(rename = "http_500")]
    Http500,
    #[serde(rename = "http_429")]
    Http429,
    Timeout,
}

impl Script {
    pub fn parse(text: &str) -> std::result::Result<Script, String> {
        let script: Script = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if script.replies.is_empty() {
            return Err("`replies` is empty; expected at least one reply".into());
        }
        for (i, reply) in script.replies.iter().enumerate() {
            if reply.text.is_empty() && reply.tool_calls.is_empty() && reply.error.is_none() {
                return Err(format!("reply {i} has neither `text` nor `tool_calls`"));
            }
        }
        Ok(script)
    }

    /// Rejects a script that calls a tool the runtime does not have.
    pub fn check_tools(&self, known: &[&str]) -> std::result::Result<(), String> {
        for (i, reply) in self.replies.iter().enumerate() {
            for call in &reply.tool_calls {
                if !known.contains(&call.name.as_str()) {
                    return Err(format!(
                        "reply {i} calls unknown tool {:?}; known tools: {}",
                        call.name,
                        known.join(", ")
                    ));
                }
            }
        }
        Ok(())
    }
}

pub struct ScriptedModel {
    script: Script,
}

impl ScriptedModel {
    pub fn new(script: Script) -> Self {
        ScriptedModel { script }
    }
}

#[async_trait]
impl Model for ScriptedModel {
    async fn complete(
        &self,
        request: ModelRequest,
        deltas: mpsc::UnboundedSender<String>,
        cancel: CancellationToken,
    ) -> Result<ModelReply> {
        let last = self.script.replies.len() - 1;
        let index = usize::try_from(request.call_index).map_or(last, |i| i.min(last));
        let reply = &self.script.replies[index];
        if let Some(error) = reply.error.filter(|_| request.attempt <= 1) {
            return Err(Error::transient(match error {
                ScriptedError::Http500 => "HTTP 500 from the scripted model",
                ScriptedError::Http429 => "HTTP 429 from the scripted model",
                ScriptedError::Timeout => "the scripted model timed out",
            }));
        }
        let delay = Duration::from_millis(reply.chunk_delay_ms);
        for chunk in reply.text.split_inclusive(' ') {
            if !delay.is_zero() {
                tokio::select! {
                    () = cancel.cancelled() => return Err(Error::Cancelled),
                    () = tokio::time::sleep(delay) => {}
                }
            }
            if cancel.is_cancelled() {
                return Err(Error::Cancelled);
            }
            let _ = deltas.send(chunk.to_owned());
        }
        let tool_calls = reply
            .tool_calls
            .iter()
            .enumerate()
            .map(|(i, call)| ToolCall {
                id: format!("call_{}_{}", request.call_index, i),
                name: call.name.clone(),
                arguments: call.arguments.clone(),
            })
            .collect();
        let words = |text: &str| text.split_whitespace().count() as u64;
        let usage = Usage {
            input_tokens: request.messages.iter().map(|m| words(&m.content)).sum(),
            output_tokens: words(&reply.text),
            reasoning_tokens: 0,
        };
        Ok(ModelReply {
            text: reply.text.clone(),
            tool_calls,
            usage,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratchet_core::RunId;

    fn request(call_index: u64, attempt: u32) -> ModelRequest {
        ModelRequest {
            run_id: RunId::from_suffix("r").unwrap(),
            call_index,
            attempt,
            system_prompt: String::new(),
            messages: Vec::new(),
            tools: Vec::new(),
        }
    }

    async fn complete(model: &ScriptedModel, req: ModelRequest) -> (Result<ModelReply>, String) {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let reply = model.complete(req, tx, CancellationToken::new()).await;
        let mut streamed = String::new();
        while let Ok(chunk) = rx.try_recv() {
            streamed.push_str(&chunk);
        }
        (reply, streamed)
    }

    #[tokio::test]
    async fn replies_follow_the_call_index_and_the_last_repeats() {
        let script = Script::parse(
            r#"{"replies": [{"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]}, {"text": "The sum is 5."}]}"#,
        )
        .unwrap();
        let model = ScriptedModel::new(script);
        let (first, _) = complete(&model, request(0, 1)).await;
        let first = first.unwrap();
        assert_eq!(first.tool_calls[0].name, "add");
        assert_eq!(first.tool_calls[0].id, "call_0_0");
        for index in [1, 2, 9] {
            let (reply, streamed) = complete(&model, request(index, 1)).await;
            assert_eq!(reply.unwrap().text, "The sum is 5.");
            assert_eq!(
                streamed, "The sum is 5.",
                "streamed chunks add up to the text"
            );
        }
    }

    #[tokio::test]
    async fn an_error_fails_only_the_first_attempt() {
        let model = ScriptedModel::new(
            Script::parse(r#"{"replies": [{"text": "ok", "error": "http_500"}]}"#).unwrap(),
        );
        let (first, _) = complete(&model, request(0, 1)).await;
        assert!(matches!(first, Err(Error::Transient { .. })), "{first:?}");
        let (second, _) = complete(&model, request(0, 2)).await;
        assert_eq!(second.unwrap().text, "ok");
    }

    #[tokio::test]
    async fn a_cancelled_stream_stops() {
        let model = ScriptedModel::new(
            Script::parse(r#"{"replies": [{"text": "a b c d", "chunk_delay_ms": 10000}]}"#)
                .unwrap(),
        );
        let cancel = CancellationToken::new();
        cancel.cancel();
        let (tx, _rx) = mpsc::unbounded_channel();
        assert_eq!(
            model.complete(request(0, 1), tx, cancel).await,
            Err(Error::Cancelled)
        );
    }

    #[test]
    fn bad_scripts_are_rejected_with_a_reason() {
        for (text, expected) in [
            ("{", "EOF"),
            (r#"{"replies": []}"#, "empty"),
            (r#"{"replies": [{}]}"#, "neither"),
            (
                r#"{"replies": [{"text": "x", "colour": 1}]}"#,
                "unknown field",
            ),
            (
                r#"{"replies": [{"text": "x", "error": "boom"}]}"#,
                "unknown variant",
            ),
        ] {
            let err = Script::parse(text).unwrap_err();
            assert!(err.contains(expected), "{text}: {err}");
        }
        let script =
            Script::parse(r#"{"replies": [{"tool_calls": [{"name": "rm_rf"}]}]}"#).unwrap();
        let err = script.check_tools(&["add"]).unwrap_err();
        assert!(err.contains("unknown tool \"rm_rf\""), "{err}");
    }

    #[test]
    fn the_demo_script_is_valid() {
        Script::parse(DEMO_SCRIPT)
            .unwrap()
            .check_tools(&["add"])
            .unwrap();
    }

    #[test]
    fn specs_are_parsed_with_clear_errors() {
        assert!(crate::from_spec("scripted:demo", &["add"]).is_ok());
        let err = crate::from_spec("openai:gpt", &[]).err().unwrap();
        assert!(err.to_string().contains("unknown model kind"), "{err}");
        let err = crate::from_spec("scripted:/no/such/file.json", &[])
            .err()
            .unwrap();
        assert!(err.to_string().contains("cannot read script file"), "{err}");
        let err = crate::from_spec("demo", &[]).err().unwrap();
        assert!(err.to_string().contains("expected KIND:ARGUMENT"), "{err}");
    }
}
