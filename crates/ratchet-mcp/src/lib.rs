//! Tools served by MCP servers, offered as Ratchet tools through the same durable dispatch as
//! the built-ins: the engine records an intent before each call and its outcome after.
//!
//! `connect_all` starts (stdio) or reaches (streamable HTTP) every configured server, lists
//! its tools and returns one `ratchet_tools::Tool` per tool, named `SERVER.TOOL`. A server
//! that sends `notifications/tools/list_changed` has its tools listed again, and whoever
//! follows `McpTools::watch` is given the new set; a run already frozen with the old set
//! keeps it. The rmcp SDK stays inside this crate: no rmcp type appears in its API, so a new
//! major version of it changes this crate only.
//!
//! This crate never decides about replay or approval; it only states each tool's defaults
//! (replay `never`, approval `always`, unless the server's configuration says otherwise),
//! which the runtime freezes into a run's config and may override per tool.

mod config;
mod content;
mod server;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use async_trait::async_trait;
use ratchet_core::{ApprovalPolicy, ReplayPolicy, ToolOutcome};
use ratchet_tools::{Tool, ToolContext};
use serde_json::Value;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use config::{
    Approval, Config, DEFAULT_CALL_TIMEOUT, DEFAULT_STARTUP_TIMEOUT, HeaderSource, ServerConfig,
};
pub use server::{IDEMPOTENCY_KEY_META, TRACEPARENT_META};

use server::{RemoteTool, Server};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid MCP configuration: {0}")]
    Config(String),
    #[error("MCP server {server:?} cannot start: {reason}")]
    Start { server: String, reason: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a tool does by default when the configuration of the tool itself says nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolPolicy {
    pub replay: ReplayPolicy,
    pub approval: ApprovalPolicy,
}

/// The tools of every configured server, connected, as last listed.
pub struct McpTools {
    servers: Vec<Arc<Server>>,
    tools: Arc<watch::Sender<Vec<Arc<McpTool>>>>,
    /// One task per server, listing its tools again when it says they changed.
    followers: Vec<JoinHandle<()>>,
}

/// Follows the MCP servers' tools as they change.
pub struct ToolsWatch {
    tools: watch::Receiver<Vec<Arc<McpTool>>>,
}

impl ToolsWatch {
    /// Every MCP tool once a server's tools have changed since this was last called; `None`
    /// once the `McpTools` it follows is gone.
    pub async fn changed(&mut self) -> Option<Vec<Arc<dyn Tool>>> {
        self.tools.changed().await.ok()?;
        Some(as_tools(&self.tools.borrow_and_update()))
    }
}

fn as_tools(tools: &[Arc<McpTool>]) -> Vec<Arc<dyn Tool>> {
    tools
        .iter()
        .map(|tool| Arc::clone(tool) as Arc<dyn Tool>)
        .collect()
}

/// Lists a server's tools again each time it says they changed, in place of those it listed
/// before. A list that fails keeps the tools it had: a server's hiccup never takes its tools
/// away from the runs that start next.
async fn follow_changes(server: Arc<Server>, tools: Arc<watch::Sender<Vec<Arc<McpTool>>>>) {
    let name = server.config().name.clone();
    loop {
        server.tools_changed().await;
        let listed = match server.list().await.and_then(|l| tools_of(&server, l)) {
            Ok(listed) => listed,
            Err(reason) => {
                tracing::warn!(server = %name, %reason,
                    "the server's tools changed, but listing them again failed: its previous tools stay");
                continue;
            }
        };
        tracing::info!(server = %name, tools = listed.len(),
            "the server's tools changed: runs that start from now on are offered the new ones");
        // In the place of the server's previous tools, which are listed together.
        tools.send_modify(|all| {
            let at = (all.iter())
                .position(|tool| Arc::ptr_eq(&tool.server, &server))
                .unwrap_or(all.len());
            all.retain(|tool| !Arc::ptr_eq(&tool.server, &server));
            all.splice(at..at, listed);
        });
    }
}

/// Checks the configuration, then starts or reaches every server at once and lists its
/// tools. Any server that cannot start within its startup timeout is an error naming it
/// (the others are stopped again): a runtime does not start with part of its tools missing.
pub async fn connect_all(config: &Config) -> Result<McpTools> {
    let servers: Vec<Arc<Server>> = config
        .checked()?
        .into_iter()
        .map(|checked| Arc::new(Server::new(checked)))
        .collect();
    let started = futures::future::join_all(servers.iter().map(|server| server.start())).await;
    let mut tools = Vec::new();
    let mut failure = None;
    for (server, listed) in servers.iter().zip(started) {
        let name = &server.config().name;
        match listed.and_then(|listed| tools_of(server, listed)) {
            Ok(mut listed) => tools.append(&mut listed),
            Err(reason) => {
                tracing::error!(server = %name, %reason, "MCP server cannot start");
                failure.get_or_insert(Error::Start {
                    server: name.clone(),
                    reason,
                });
            }
        }
    }
    let tools = Arc::new(watch::Sender::new(tools));
    let followers = (servers.iter())
        .map(|server| tokio::spawn(follow_changes(Arc::clone(server), Arc::clone(&tools))))
        .collect();
    let all = McpTools {
        servers,
        tools,
        followers,
    };
    if let Some(error) = failure {
        all.close().await;
        return Err(error);
    }
    Ok(all)
}

/// One server's listed tools as Ratchet tools. A name the model could not be given is
/// skipped with a warning; a name listed twice means a broken server.
fn tools_of(server: &Arc<Server>, listed: Vec<RemoteTool>) -> Result<Vec<Arc<McpTool>>, String> {
    let prefix = &server.config().name;
    let mut seen = BTreeSet::new();
    let mut tools = Vec::new();
    for remote in listed {
        if !valid_tool_name(&remote.name) {
            tracing::warn!(server = %prefix, tool = ?remote.name,
                "skipping a tool whose name is not 1-128 letters, digits, `_`, `-` or `.`");
            continue;
        }
        if !seen.insert(remote.name.clone()) {
            return Err(format!("tools/list lists the tool {:?} twice", remote.name));
        }
        tools.push(Arc::new(McpTool {
            name: format!("{prefix}.{}", remote.name),
            remote,
            server: Arc::clone(server),
        }));
    }
    Ok(tools)
}

/// The character set the MCP specification recommends for tool names.
fn valid_tool_name(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

impl McpTools {
    /// The tools, to register together with the built-ins.
    pub fn tools(&self) -> Vec<Arc<dyn Tool>> {
        as_tools(&self.tools.borrow())
    }

    /// The tools from now on, each time a server's tools change.
    pub fn watch(&self) -> ToolsWatch {
        ToolsWatch {
            tools: self.tools.subscribe(),
        }
    }

    /// The names of the tools, `SERVER.TOOL`, in the order the servers listed them.
    pub fn names(&self) -> Vec<String> {
        (self.tools.borrow().iter())
            .map(|tool| tool.name.clone())
            .collect()
    }

    /// Each tool's defaults, by name, for the runtime to apply its per-tool overrides to.
    pub fn policies(&self) -> BTreeMap<String, ToolPolicy> {
        self.tools
            .borrow()
            .iter()
            .map(|tool| {
                (
                    tool.name.clone(),
                    ToolPolicy {
                        replay: tool.replay(),
                        approval: tool.approval(),
                    },
                )
            })
            .collect()
    }

    /// Ends every connection; stdio servers are stopped. Calls made afterwards connect again;
    /// a change of a server's tools is no longer followed.
    pub async fn close(&self) {
        for follower in &self.followers {
            follower.abort();
        }
        for server in &self.servers {
            server.close().await;
        }
    }
}

impl Drop for McpTools {
    fn drop(&mut self) {
        for follower in &self.followers {
            follower.abort();
        }
    }
}

/// One tool of one server.
struct McpTool {
    name: String,
    remote: RemoteTool,
    server: Arc<Server>,
}

#[async_trait]
impl Tool for McpTool {
    fn name(&self) -> &str {
        &self.name
    }

    fn description(&self) -> &str {
        &self.remote.description
    }

    fn parameters(&self) -> Value {
        self.remote.input_schema.clone()
    }

    fn replay(&self) -> ReplayPolicy {
        self.server.config().replay
    }

    fn approval(&self) -> ApprovalPolicy {
        self.server.config().approval.clone()
    }

    async fn call(&self, arguments: Value, context: &ToolContext) -> ToolOutcome {
        let arguments = match arguments {
            Value::Object(arguments) => Some(arguments),
            Value::Null => None,
            other => {
                return ToolOutcome::error(format!(
                    "the arguments of {} must be a JSON object, found {other}",
                    self.name
                ));
            }
        };
        self.server
            .call(&self.remote.name, arguments, context)
            .await
    }
}
