//! Conversation messages and tool calls as the model and the store see them.

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

/// Hidden messages feed the model but never reach client history.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Visibility {
    Visible,
    Hidden,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    User,
    Agent,
    Continuation,
    Steer,
    /// A summary of older turns, written when the context was compacted.
    Summary,
    /// The runtime speaking to the model: why it may not finish yet.
    Runtime,
}

/// One tool call as the model asked for it. `id` is the model's own call id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: Value,
}

/// What a tool call produced. A failing tool is an outcome the model sees, not an error of
/// the runtime.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolOutcome {
    pub content: String,
    pub is_error: bool,
    /// Nobody knows whether the call took effect: it was cut off after it was sent (a
    /// timeout, a lost connection, a cancel). The engine decides by the tool's replay policy
    /// what happens next (`effect::after_unknown`); such an outcome is never a call's result.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unknown: bool,
}

impl ToolOutcome {
    pub fn ok(content: impl Into<String>) -> Self {
        ToolOutcome {
            content: content.into(),
            is_error: false,
            unknown: false,
        }
    }

    pub fn error(content: impl Into<String>) -> Self {
        ToolOutcome {
            content: content.into(),
            is_error: true,
            unknown: false,
        }
    }

    /// The call may or may not have taken effect; `reason` says why nobody knows.
    pub fn unknown(reason: impl Into<String>) -> Self {
        ToolOutcome {
            content: reason.into(),
            is_error: true,
            unknown: true,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    pub content: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    pub visibility: Visibility,
    pub origin: Origin,
    /// For a summary: the position of the first message it keeps. In the model's view the
    /// summary takes the place of every message before that one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keeps_from: Option<i64>,
    /// For a tool result: the call failed (providers that can say so are told).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub is_error: bool,
}

impl Message {
    pub fn user(content: impl Into<String>) -> Self {
        Message {
            role: Role::User,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            visibility: Visibility::Visible,
            origin: Origin::User,
            keeps_from: None,
            is_error: false,
        }
    }

    /// The hidden summary that replaces the messages before position `keeps_from`.
    pub fn summary(text: &str, keeps_from: i64) -> Self {
        Message {
            role: Role::User,
            content: format!("Summary of the earlier conversation:\n{text}"),
            tool_calls: Vec::new(),
            tool_call_id: None,
            visibility: Visibility::Hidden,
            origin: Origin::Summary,
            keeps_from: Some(keeps_from),
            is_error: false,
        }
    }

    /// Tokens this message adds to a prompt, estimated (about four characters a token, and
    /// a little for the message's framing): the core has no tokenizer.
    pub fn estimated_tokens(&self) -> u64 {
        let calls: usize = (self.tool_calls.iter())
            .map(|c| c.name.len() + c.arguments.to_string().len())
            .sum();
        ((self.content.len() + calls) as u64).div_ceil(4) + 4
    }

    pub fn assistant(content: impl Into<String>, tool_calls: Vec<ToolCall>) -> Self {
        Message {
            role: Role::Assistant,
            content: content.into(),
            tool_calls,
            tool_call_id: None,
            visibility: Visibility::Visible,
            origin: Origin::Agent,
            keeps_from: None,
            is_error: false,
        }
    }

    pub fn tool_result(call_id: &str, outcome: &ToolOutcome) -> Self {
        Message {
            role: Role::Tool,
            content: outcome.content.clone(),
            tool_calls: Vec::new(),
            tool_call_id: Some(call_id.to_owned()),
            visibility: Visibility::Visible,
            origin: Origin::Agent,
            keeps_from: None,
            is_error: outcome.is_error,
        }
    }
}

/// The conversation as a model may be sent it: every tool call answered by a result before the
/// next message. A run that ended while its calls waited (cancelled, aborted at an approval)
/// leaves calls without results; providers refuse such a conversation, so each gets a result
/// saying it never ran, right after its batch's results.
pub fn answer_dangling_calls(messages: Vec<Message>) -> Vec<Message> {
    let mut answered: Vec<Message> = Vec::with_capacity(messages.len());
    let mut waiting: Vec<String> = Vec::new();
    for message in messages {
        let is_result = message.role == Role::Tool;
        if is_result {
            waiting.retain(|id| Some(id) != message.tool_call_id.as_ref());
        } else {
            close_batch(&mut answered, &mut waiting);
        }
        if message.role == Role::Assistant {
            waiting = message.tool_calls.iter().map(|c| c.id.clone()).collect();
        }
        answered.push(message);
    }
    close_batch(&mut answered, &mut waiting);
    answered
}

fn close_batch(answered: &mut Vec<Message>, waiting: &mut Vec<String>) {
    for call_id in waiting.drain(..) {
        let never = ToolOutcome::error("not run: the run ended before this call ran");
        answered.push(Message::tool_result(&call_id, &never));
    }
}

/// Most characters of a title a session takes from its first message.
pub const TITLE_CHARS: usize = 80;

/// The title a session takes from its first message: the first line that has text, trimmed,
/// cut to `TITLE_CHARS` characters (with an ellipsis when cut).
pub fn title_of(content: &str) -> String {
    let line = (content.lines())
        .map(str::trim)
        .find(|line| !line.is_empty())
        .unwrap_or_default();
    let mut title: String = line.chars().take(TITLE_CHARS).collect();
    if line.chars().count() > TITLE_CHARS {
        title.pop();
        title.push('…');
    }
    title
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asks(ids: &[&str]) -> Message {
        let calls = ids
            .iter()
            .map(|id| ToolCall {
                id: (*id).into(),
                name: "add".into(),
                arguments: Value::Null,
            })
            .collect();
        Message::assistant("", calls)
    }

    fn shape(messages: &[Message]) -> Vec<String> {
        messages
            .iter()
            .map(|m| match (m.role, &m.tool_call_id) {
                (Role::Tool, Some(id)) if m.content.starts_with("not run") => format!("never:{id}"),
                (Role::Tool, Some(id)) => format!("result:{id}"),
                (role, _) => format!("{role:?}"),
            })
            .collect()
    }

    #[test]
    fn calls_left_without_a_result_are_answered_in_place() {
        let done = ToolOutcome::ok("5");
        let messages = vec![
            Message::user("one"),
            asks(&["a", "b"]),
            Message::tool_result("a", &done),
            Message::user("two"),
            asks(&["c"]),
            Message::tool_result("c", &done),
            Message::assistant("fine", Vec::new()),
            asks(&["d"]),
        ];
        let answered = answer_dangling_calls(messages);
        assert_eq!(
            shape(&answered),
            [
                "User",
                "Assistant",
                "result:a",
                "never:b",
                "User",
                "Assistant",
                "result:c",
                "Assistant",
                "Assistant",
                "never:d"
            ]
        );
        let complete = answered.clone();
        assert_eq!(
            answer_dangling_calls(complete),
            answered,
            "nothing left to answer"
        );
    }

    #[test]
    fn a_title_is_the_first_line_with_text_cut_to_its_length() {
        assert_eq!(title_of("\n  Plan my trip  \nto Rome"), "Plan my trip");
        assert_eq!(title_of(""), "");
        let long = "é".repeat(100);
        let title = title_of(&long);
        assert_eq!(title.chars().count(), TITLE_CHARS);
        assert!(title.ends_with('…') && title.starts_with("éé"));
        assert_eq!(title_of(&"a".repeat(TITLE_CHARS)), "a".repeat(TITLE_CHARS));
    }
}
