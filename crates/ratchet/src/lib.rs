//! Ratchet as a library: a durable runtime for LLM agents inside your own program.
//!
//! [`Ratchet::builder`] opens a database, registers your Rust tools ([`tool_fn`]) beside the
//! built-in ones and starts workers; every message sent starts a run that moves one durable
//! step at a time, so the process may die at any instant and a new one on the same database
//! goes on with nothing lost and nothing done twice. The lower pieces — a store opened from a
//! url, the [`Toolbox`], the [`Runtime`] — are what the `ratchet` binary (`ratchet-cli`) is
//! assembled from.

pub mod agents;
mod config;
mod embed;
mod runtime;
pub mod serving;
mod tool;

pub use async_trait::async_trait;
pub use config::{CallLimitsOverride, Config, ConfigError, SecretsSettings, TokenConfig};
pub use embed::{Approval, Builder, Outcome, Ratchet, Run, Session};
pub use ratchet_core::{
    ApprovalCall, ApprovalId, ApprovalPolicy, CallDecision, Limits, ReplayPolicy, RunId, RunStatus,
    SessionId, StopReason, ToolDelegation, ToolOutcome, Verdict,
};
pub use ratchet_core::{Message, ModelReply, ToolCall, Usage};
pub use ratchet_llm::{Error as ModelError, Model, ModelRequest};
pub use ratchet_store::StoredEvent;
pub use ratchet_tools::{Tool, ToolContext};
pub use tokio_util::sync::CancellationToken;
pub use tool::{FnTool, tool_fn};

pub use runtime::{
    Runtime, Schema, ToolOverrides, Toolbox, announces_changes, database_bytes, database_directory,
    migrate, open_existing_store, open_sealed_store, open_store, own_key_file,
};

/// What the library refuses or fails at. Each message says what was expected and what was
/// found, or what was being done when the store failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Input refused before anything was opened or started: a database url, a limit, a
    /// workspace, a model spec, a tool's policy.
    #[error("{0}")]
    Invalid(String),
    /// The store failed while doing `what`.
    #[error("{what}: {cause}")]
    Store {
        what: String,
        cause: ratchet_store::Error,
    },
    /// The runtime failed while doing `what`.
    #[error("{what}: {cause}")]
    Runtime {
        what: String,
        cause: ratchet_engine::Error,
    },
    /// An agent catalog with problems; each names its file and line.
    #[error("the agent catalog {} was rejected ({} problems):\n{}", .dir.display(), .problems.len(), .problems.join("\n"))]
    Catalog {
        dir: std::path::PathBuf,
        problems: Vec<String>,
    },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Model(#[from] ratchet_llm::Error),
    #[error(transparent)]
    Tools(#[from] ratchet_tools::Error),
    #[error(transparent)]
    Mcp(#[from] ratchet_mcp::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
