//! Ratchet as a library: the pieces a program assembles a durable agent runtime from — a
//! store opened from a database url, the tools and models its runs are offered, and the
//! runtime that recovers dead processes' steps and runs workers. The `ratchet` binary
//! (`ratchet-cli`) is one such program.

mod runtime;

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
    #[error(transparent)]
    Model(#[from] ratchet_llm::Error),
    #[error(transparent)]
    Tools(#[from] ratchet_tools::Error),
    #[error(transparent)]
    Mcp(#[from] ratchet_mcp::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
