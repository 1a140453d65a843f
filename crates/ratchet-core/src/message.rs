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
}

impl ToolOutcome {
    pub fn ok(content: impl Into<String>) -> Self {
        ToolOutcome {
            content: content.into(),
            is_error: false,
        }
    }

    pub fn error(content: impl Into<String>) -> Self {
        ToolOutcome {
            content: content.into(),
            is_error: true,
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
        }
    }
}
