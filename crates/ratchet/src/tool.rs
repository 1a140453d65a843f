//! A tool written as a Rust closure: `tool_fn`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use async_trait::async_trait;
use ratchet_core::{ApprovalPolicy, ReplayPolicy, ToolDelegation, ToolOutcome};
use ratchet_tools::{Tool, ToolContext};
use serde_json::{Value, json};

type Handler =
    dyn Fn(Value, ToolContext) -> Pin<Box<dyn Future<Output = ToolOutcome> + Send>> + Send + Sync;

/// A tool whose call runs a closure. Made by [`tool_fn`]; its arguments are any JSON object
/// until [`FnTool::parameters`] gives their schema, and no call waits for a person until
/// [`FnTool::approval`] says so.
pub struct FnTool {
    name: String,
    description: String,
    replay: ReplayPolicy,
    parameters: Value,
    approval: ApprovalPolicy,
    delegation: ToolDelegation,
    handler: Arc<Handler>,
}

/// A tool named `name` that the model reads `description` of, whose calls run `handler` with
/// the call's arguments (already checked against its parameter schema) and its context: the
/// call's idempotency key, the same after a crash, and a cancellation token. `replay` says
/// what happens to a call a crash cut off: run it again (`Safe`), again with the same key
/// (`Keyed`), or never, asking a person what happened (`Never`).
///
/// The handler answers with a [`ToolOutcome`]: `ToolOutcome::ok`, `ToolOutcome::error` (the
/// model reads it), or one whose `unknown` is set when it cannot tell whether its effect
/// happened.
///
/// ```
/// use ratchet::{ReplayPolicy, ToolOutcome, tool_fn};
/// use serde_json::json;
///
/// let weather = tool_fn(
///     "weather",
///     "Tells the weather in a city today.",
///     ReplayPolicy::Safe, // reading it twice does no harm
///     |arguments, _context| async move {
///         match arguments["city"].as_str() {
///             Some("Oslo") => ToolOutcome::ok(json!({"sky": "snow", "celsius": -3}).to_string()),
///             Some(city) => ToolOutcome::error(format!("no forecast for {city}")),
///             None => ToolOutcome::error("expected a city"),
///         }
///     },
/// )
/// .parameters(json!({
///     "type": "object",
///     "properties": {"city": {"type": "string"}},
///     "required": ["city"],
/// }));
/// # let _ = weather;
/// ```
pub fn tool_fn<F, Fut>(
    name: impl Into<String>,
    description: impl Into<String>,
    replay: ReplayPolicy,
    handler: F,
) -> FnTool
where
    F: Fn(Value, ToolContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ToolOutcome> + Send + 'static,
{
    FnTool {
        name: name.into(),
        description: description.into(),
        replay,
        parameters: json!({"type": "object"}),
        approval: ApprovalPolicy::Never,
        delegation: ToolDelegation::RootOnly,
        handler: Arc::new(move |arguments, context| Box::pin(handler(arguments, context))),
    }
}

impl FnTool {
    /// The JSON Schema of the arguments object; a call whose arguments do not match it is
    /// refused before the handler runs, and the model reads why.
    pub fn parameters(mut self, schema: Value) -> FnTool {
        self.parameters = schema;
        self
    }

    /// When a call waits for a person before its batch runs.
    pub fn approval(mut self, policy: ApprovalPolicy) -> FnTool {
        self.approval = policy;
        self
    }

    /// Whether runs an agent delegates to may be offered it (root runs only by default).
    pub fn delegation(mut self, delegation: ToolDelegation) -> FnTool {
        self.delegation = delegation;
        self
    }
}

#[async_trait]
impl Tool for FnTool {
    fn name(&self) -> &str {
        &self.name
    }

    fn description(&self) -> &str {
        &self.description
    }

    fn parameters(&self) -> Value {
        self.parameters.clone()
    }

    fn replay(&self) -> ReplayPolicy {
        self.replay
    }

    fn approval(&self) -> ApprovalPolicy {
        self.approval.clone()
    }

    fn delegation(&self) -> ToolDelegation {
        self.delegation
    }

    async fn call(&self, arguments: Value, context: &ToolContext) -> ToolOutcome {
        (self.handler)(arguments, context.clone()).await
    }
}
