//! What the chaos MCP server (`mcp_server.py`) records: one JSON line per call it executed,
//! written and fsynced before the call goes on, so that a kill loses none.

use std::path::Path;

use serde::Deserialize;

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecutionKind {
    /// The call did its work.
    Exec,
    /// A `keyed` call whose key had done its work already: answered without doing it again.
    Replay,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Execution {
    pub kind: ExecutionKind,
    /// The tool's name on the server (`hang`, `drop`, `flaky`).
    pub tool: String,
    /// The idempotency key the runtime sent in `_meta`.
    pub key: String,
    /// The model's call id, which the plan passes as the `line` argument.
    pub line: String,
}

/// The executions recorded so far, and the lines that are not one (which no server wrote).
pub fn read(path: &Path) -> std::io::Result<(Vec<Execution>, Vec<String>)> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(error) => return Err(error),
    };
    let mut executions = Vec::new();
    let mut strays = Vec::new();
    for line in text.lines() {
        match serde_json::from_str(line) {
            Ok(execution) => executions.push(execution),
            Err(_) => strays.push(line.to_owned()),
        }
    }
    Ok((executions, strays))
}

/// Whether the server executed the call with this idempotency key.
pub fn executed(path: &Path, key: &str) -> std::io::Result<bool> {
    Ok(read(path)?
        .0
        .iter()
        .any(|e| e.key == key && e.kind == ExecutionKind::Exec))
}
