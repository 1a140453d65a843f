//! Models behind one streaming trait: the scripted model (specs `scripted:FILE`,
//! `scripted:demo`) and the providers a run's settings name (`openai`: chat completions,
//! `anthropic`: Messages).
//!
//! A model never touches the store: it streams text deltas into a channel and returns the
//! complete reply; the engine records both. A model never retries either: it says whether a
//! failure is worth another try, and the engine retries durably.

mod anthropic;
mod http;
mod openai;
pub mod profiles;
mod scripted;
pub mod sse;
mod wire;

use async_trait::async_trait;
use ratchet_core::{Message, ModelReply, ModelSettings, RunId, ToolSpec};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub use anthropic::{Anthropic, DEFAULT_MAX_TOKENS};
pub use openai::OpenAi;
pub use scripted::{DEMO_SCRIPT, Script, ScriptedModel};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The call failed in a way that may succeed if tried again (HTTP 408, 429 or 5xx, a
    /// refused or broken connection, a timeout, a stream that ended early, an overloaded
    /// provider). `retry_after` is the provider's own wait (`Retry-After`, `retry-after-ms`).
    #[error("model call failed (retryable): {message}")]
    Transient {
        message: String,
        retry_after: Option<std::time::Duration>,
    },
    /// The provider refused the call (a 4xx other than 408 and 429), or its answer was
    /// malformed: trying again would not help. The message is the provider's own, or says what
    /// was expected and what was found.
    #[error("model call failed: {0}")]
    Fatal(String),
    #[error("model call cancelled")]
    Cancelled,
    #[error("invalid model spec {spec:?}: {reason}")]
    Spec { spec: String, reason: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A retryable failure with no wait asked for by the provider.
    pub fn transient(message: impl Into<String>) -> Error {
        Error::Transient {
            message: message.into(),
            retry_after: None,
        }
    }
}

/// Everything a model call needs. `call_index` counts the run's committed model calls, so a
/// call redone after a crash carries the same index; `attempt` counts tries of this step.
#[derive(Debug, Clone)]
pub struct ModelRequest {
    pub run_id: RunId,
    pub call_index: u64,
    pub attempt: u32,
    pub system_prompt: String,
    pub messages: Vec<Message>,
    /// Empty when the run is concluding: the model must answer without tools.
    pub tools: Vec<ToolSpec>,
    /// The W3C `traceparent` of the call's span, sent along when traces are exported.
    pub traceparent: Option<String>,
}

#[async_trait]
pub trait Model: Send + Sync {
    /// Streams text deltas into `deltas` as they arrive and returns the complete reply.
    /// Must return `Error::Cancelled` promptly once `cancel` fires.
    async fn complete(
        &self,
        request: ModelRequest,
        deltas: mpsc::UnboundedSender<String>,
        cancel: CancellationToken,
    ) -> Result<ModelReply>;
}

/// Parses a model spec. `known_tools` lets a script be checked before any run uses it.
pub fn from_spec(spec: &str, known_tools: &[&str]) -> Result<std::sync::Arc<dyn Model>> {
    let bad = |reason: String| Error::Spec {
        spec: spec.to_owned(),
        reason,
    };
    let (kind, arg) = spec.split_once(':').ok_or_else(|| {
        bad("expected KIND:ARGUMENT, for example scripted:demo or scripted:script.json".into())
    })?;
    match kind {
        "scripted" => {
            let script = if arg == "demo" {
                Script::parse(DEMO_SCRIPT).map_err(|e| bad(format!("built-in demo script: {e}")))?
            } else {
                let text = std::fs::read_to_string(arg)
                    .map_err(|e| bad(format!("cannot read script file {arg:?}: {e}")))?;
                Script::parse(&text).map_err(|e| bad(format!("script file {arg:?}: {e}")))?
            };
            script
                .check_tools(known_tools)
                .map_err(|e| bad(format!("script file {arg:?}: {e}")))?;
            Ok(std::sync::Arc::new(ScriptedModel::new(script)))
        }
        other => Err(bad(format!(
            "unknown model kind {other:?}; expected scripted"
        ))),
    }
}

/// Builds the model a run's frozen settings describe. `api_key` is the value of the settings'
/// `api_key_env`, read by the caller (the settings never hold a secret); without one, no key
/// is sent (local servers need none).
pub fn from_settings(
    settings: &ModelSettings,
    api_key: Option<String>,
) -> Result<std::sync::Arc<dyn Model>> {
    match settings.provider.as_str() {
        "openai" => Ok(std::sync::Arc::new(OpenAi::new(settings, api_key)?)),
        "anthropic" => Ok(std::sync::Arc::new(Anthropic::new(settings, api_key)?)),
        other => Err(Error::Spec {
            spec: format!("{}:{}", settings.provider, settings.model),
            reason: format!("unknown provider {other:?}; expected openai or anthropic"),
        }),
    }
}
