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
            cache_write_tokens: 0,
            cache_read_tokens: 0,
        };
        Ok(ModelReply {
            text: reply.text.clone(),
            tool_calls,
            usage,
            reasoning: String::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use ratchet_core::RunId;

    fn request(call_index: u64, attempt: u32) -> ModelRequest {
        ModelRequest {
            run_id: RunId::from_suffix("r").unwrap(),
            call_index,
            attempt,
            system_prompt: String::new(),
            messages: Vec::new(),
            tools: Vec::new(),
            traceparent: None,
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

    /// A generated reply and what it must mean once parsed.
    #[derive(Debug, Clone)]
    struct Generated {
        text: Option<String>,
        calls: Vec<(String, Option<Value>)>,
        delay: Option<u64>,
        error: Option<&'static str>,
    }

    impl Generated {
        fn json(&self) -> Value {
            let mut reply = serde_json::Map::new();
            if let Some(text) = &self.text {
                reply.insert("text".into(), text.clone().into());
            }
            if !self.calls.is_empty() {
                let calls = self.calls.iter().map(|(name, arguments)| {
                    let mut call = serde_json::json!({ "name": name });
                    if let Some(arguments) = arguments {
                        call["arguments"] = arguments.clone();
                    }
                    call
                });
                reply.insert("tool_calls".into(), calls.collect());
            }
            if let Some(delay) = self.delay {
                reply.insert("chunk_delay_ms".into(), delay.into());
            }
            if let Some(error) = self.error {
                reply.insert("error".into(), error.into());
            }
            Value::Object(reply)
        }

        fn is_valid(&self) -> bool {
            self.text.as_ref().is_some_and(|t| !t.is_empty())
                || !self.calls.is_empty()
                || self.error.is_some()
        }
    }

    /// JSON without floats, whose text form does not always come back bit for bit.
    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<String>().prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 5, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::from),
                proptest::collection::btree_map(any::<String>(), inner, 0..5)
                    .prop_map(|map| Value::Object(map.into_iter().collect())),
            ]
        })
    }

    fn reply() -> impl Strategy<Value = Generated> {
        let call = ("[a-z_]{1,8}", proptest::option::of(json_value()));
        let error = prop_oneof![Just("http_500"), Just("http_429"), Just("timeout")];
        (
            proptest::option::of(any::<String>()),
            proptest::collection::vec(call, 0..4),
            proptest::option::of(any::<u64>()),
            proptest::option::weighted(0.2, error),
        )
            .prop_map(|(text, calls, delay, error)| Generated {
                text,
                calls,
                delay,
                error,
            })
    }

    /// A script's text and the replies it was written from.
    fn script(
        replies: impl Strategy<Value = Vec<Generated>>,
    ) -> impl Strategy<Value = (String, Vec<Generated>)> {
        replies.prop_map(|replies| {
            let json = serde_json::json!({
                "replies": replies.iter().map(Generated::json).collect::<Vec<_>>()
            });
            (json.to_string(), replies)
        })
    }

    /// A script whose replies each say something.
    fn valid_script() -> impl Strategy<Value = (String, Vec<Generated>)> {
        let valid = reply().prop_filter("says something", Generated::is_valid);
        script(proptest::collection::vec(valid, 1..5))
    }

    /// One edit of a document, at a char position taken modulo its length.
    #[derive(Debug, Clone)]
    enum Mutation {
        Delete { at: usize, len: usize },
        Insert { at: usize, text: String },
        Replace { at: usize, with: char },
    }

    fn mutation() -> impl Strategy<Value = Mutation> {
        let structural = prop_oneof![
            Just(String::from("{")),
            Just(String::from("}")),
            Just(String::from("[")),
            Just(String::from("\"")),
            Just(String::from(",")),
            Just(String::from(":")),
            Just(String::from("null")),
            Just(String::from("-1")),
            Just(String::from("1e999")),
            Just(String::from("\"\\ud800\"")),
            any::<String>(),
        ];
        prop_oneof![
            (any::<usize>(), 1usize..8).prop_map(|(at, len)| Mutation::Delete { at, len }),
            (any::<usize>(), structural).prop_map(|(at, text)| Mutation::Insert { at, text }),
            (any::<usize>(), any::<char>()).prop_map(|(at, with)| Mutation::Replace { at, with }),
        ]
    }

    fn mutate(text: &str, mutations: &[Mutation]) -> String {
        let mut chars: Vec<char> = text.chars().collect();
        for mutation in mutations {
            let at = |at: usize| at % (chars.len() + 1);
            match mutation {
                Mutation::Delete { at: start, len } => {
                    let start = at(*start);
                    let end = (start + len).min(chars.len());
                    chars.drain(start..end);
                }
                Mutation::Insert { at: start, text } => {
                    let start = at(*start);
                    chars.splice(start..start, text.chars());
                }
                Mutation::Replace { at: start, with } => {
                    let start = at(*start);
                    if start < chars.len() {
                        chars[start] = *with;
                    }
                }
            }
        }
        chars.into_iter().collect()
    }

    /// What a parsed script must always hold, however it was written.
    fn check_parsed(parsed: &std::result::Result<Script, String>) {
        match parsed {
            Ok(script) => {
                assert!(!script.replies.is_empty(), "an accepted script has replies");
                for reply in &script.replies {
                    assert!(
                        !reply.text.is_empty()
                            || !reply.tool_calls.is_empty()
                            || reply.error.is_some(),
                        "an accepted reply says something: {reply:?}"
                    );
                }
            }
            Err(message) => assert!(!message.trim().is_empty(), "an error says why"),
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        #[test]
        fn any_text_is_a_script_or_a_reason(text in any::<String>()) {
            check_parsed(&Script::parse(&text));
        }

        #[test]
        fn a_damaged_script_is_a_script_or_a_reason(
            (text, _) in valid_script(),
            mutations in proptest::collection::vec(mutation(), 1..4),
        ) {
            check_parsed(&Script::parse(&mutate(&text, &mutations)));
        }

        #[test]
        fn a_generated_script_parses_to_what_it_says(
            (text, replies) in script(proptest::collection::vec(reply(), 0..5)),
            known in proptest::collection::vec("[a-z_]{1,8}", 0..6),
        ) {
            let parsed = Script::parse(&text);
            let refused = if replies.is_empty() {
                Some("`replies` is empty".to_owned())
            } else {
                let silent = replies.iter().position(|r| !r.is_valid());
                silent.map(|i| format!("reply {i} has neither"))
            };
            if let Some(reason) = refused {
                let message = parsed.unwrap_err();
                prop_assert!(message.starts_with(&reason), "{}", message);
                return Ok(());
            }
            let script = parsed.unwrap();
            prop_assert_eq!(script.replies.len(), replies.len());
            for (parsed, generated) in script.replies.iter().zip(&replies) {
                prop_assert_eq!(&parsed.text, generated.text.as_deref().unwrap_or(""));
                prop_assert_eq!(parsed.chunk_delay_ms, generated.delay.unwrap_or(0));
                let error = parsed.error.map(|e| match e {
                    ScriptedError::Http500 => "http_500",
                    ScriptedError::Http429 => "http_429",
                    ScriptedError::Timeout => "timeout",
                });
                prop_assert_eq!(error, generated.error);
                let calls: Vec<(&str, &Value)> = parsed.tool_calls.iter()
                    .map(|c| (c.name.as_str(), &c.arguments))
                    .collect();
                let empty = serde_json::json!({});
                let expected: Vec<(&str, &Value)> = generated.calls.iter()
                    .map(|(name, arguments)| (name.as_str(), arguments.as_ref().unwrap_or(&empty)))
                    .collect();
                prop_assert_eq!(calls, expected);
            }

            let known: Vec<&str> = known.iter().map(String::as_str).collect();
            let unknown = replies.iter().enumerate().find_map(|(i, reply)| {
                reply.calls.iter().find(|(name, _)| !known.contains(&name.as_str())).map(|(name, _)| (i, name))
            });
            match (script.check_tools(&known), unknown) {
                (Ok(()), None) => {}
                (Err(message), Some((i, name))) => prop_assert!(
                    message.starts_with(&format!("reply {i} calls unknown tool {name:?}")),
                    "{}", message
                ),
                (checked, unknown) => prop_assert!(false, "check_tools said {:?}; first unknown call {:?}", checked, unknown),
            }
        }

        /// Reply `i` answers call `i` (the last one every call after it), streamed in chunks
        /// that add up to its text; a scripted error fails only the first attempt.
        #[test]
        fn the_model_answers_each_call_with_its_reply(
            (_, replies) in valid_script(),
            call_index in 0u64..8,
            attempt in 1u32..3,
        ) {
            let replies: Vec<Generated> = replies.into_iter().map(|r| Generated { delay: None, ..r }).collect();
            let text = serde_json::json!({"replies": replies.iter().map(Generated::json).collect::<Vec<_>>()});
            let model = ScriptedModel::new(Script::parse(&text.to_string()).unwrap());
            let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
            let (reply, streamed) = runtime.block_on(complete(&model, request(call_index, attempt)));
            let expected = &replies[usize::try_from(call_index).unwrap().min(replies.len() - 1)];
            if expected.error.is_some() && attempt == 1 {
                prop_assert!(matches!(reply, Err(Error::Transient { .. })), "{:?}", reply);
                return Ok(());
            }
            let reply = reply.unwrap();
            let text = expected.text.clone().unwrap_or_default();
            prop_assert_eq!(&reply.text, &text);
            prop_assert_eq!(streamed, text);
            let names: Vec<&str> = reply.tool_calls.iter().map(|c| c.name.as_str()).collect();
            let expected_names: Vec<&str> = expected.calls.iter().map(|(n, _)| n.as_str()).collect();
            prop_assert_eq!(names, expected_names);
            for (i, call) in reply.tool_calls.iter().enumerate() {
                prop_assert_eq!(&call.id, &format!("call_{call_index}_{i}"));
            }
        }
    }
}
