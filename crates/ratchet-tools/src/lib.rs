//! Tools: the `Tool` trait, the registry that validates arguments against each tool's JSON
//! schema before anything runs, and the built-in tools.
//!
//! A tool never writes the store and never decides about replay: it only runs. The engine
//! records intents and outcomes around it and applies its replay policy after a crash.

mod builtin;
mod memory;
mod workspace;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use async_trait::async_trait;
use ratchet_core::{
    ApprovalPolicy, CallLimits, ReplayPolicy, SessionId, ToolDelegation, ToolOutcome, ToolSpec,
};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

pub use builtin::{Add, AppendLine, Now, Sleep, SleepMs, Wait};
pub use memory::{DEFAULT_MAX_SNIPPET_BYTES, MemoryHit, MemorySearch, MemorySearchTool};

/// What a running tool call may know about its surroundings.
#[derive(Debug, Clone)]
pub struct ToolContext {
    /// Directory file tools are confined to; None when the run has no workspace.
    pub workspace: Option<PathBuf>,
    /// Deterministic per call (`{run}#{step}#{slot}`): the same after a crash and a retry.
    pub idempotency_key: String,
    pub cancel: CancellationToken,
    /// The session of the run making the call.
    pub session_id: SessionId,
    /// The history `memory_search` may look through; None when this runtime offers none.
    pub memory: Option<Arc<dyn MemorySearch>>,
    /// New input for the run's session (a user message, a steer, an inbox report), which ends
    /// a `sleep` early. None for a child run: its sleep ends on its timer or its cancel only.
    pub input: Option<Arc<dyn InputWatch>>,
    /// The W3C `traceparent` of the call's span, when traces are exported.
    pub traceparent: Option<String>,
}

/// Tells a waiting tool that input for its session has arrived.
#[async_trait]
pub trait InputWatch: Send + Sync + std::fmt::Debug {
    /// Returns once new input is waiting for the session (at once if some already is), with
    /// what it is: counts, never contents.
    async fn arrived(&self) -> Value;
}

#[async_trait]
pub trait Tool: Send + Sync {
    fn name(&self) -> &str;
    fn description(&self) -> &str;
    /// JSON Schema of the arguments object.
    fn parameters(&self) -> Value;
    fn replay(&self) -> ReplayPolicy;
    /// Whether a call waits for a human unless the configuration says otherwise. Built-ins
    /// never do; tools of outside servers do, so that forgetting to configure one never
    /// lets it act unseen.
    fn approval(&self) -> ApprovalPolicy {
        ApprovalPolicy::Never
    }
    /// Whether child runs may be offered this tool. Root runs only unless the tool says
    /// otherwise: a tool nobody thought about is never handed down a delegation.
    fn delegation(&self) -> ToolDelegation {
        ToolDelegation::RootOnly
    }
    /// How long a call may run and how often one whose outcome stays unknown is tried, unless
    /// the configuration says otherwise. A tool that waits by design waits longer.
    fn call_limits(&self) -> CallLimits {
        CallLimits::default()
    }
    /// Runs the call with arguments already validated against `parameters`. Failures are
    /// outcomes the model sees, not errors of the runtime.
    async fn call(&self, arguments: Value, context: &ToolContext) -> ToolOutcome;
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("tool {name:?} has an invalid parameter schema: {reason}")]
    Schema { name: String, reason: String },
    #[error("tool {0:?} is registered twice")]
    Duplicate(String),
}

struct Entry {
    tool: Arc<dyn Tool>,
    validator: jsonschema::Validator,
}

/// The tools a runtime offers, by name, with their compiled argument validators.
///
/// The set may be replaced while the runtime runs (an MCP server's tools changed): what runs
/// are offered is frozen into each run when it is created, so a replacement only reaches the
/// runs created after it, and a call of a tool that has gone or changed meanwhile is drift.
pub struct Registry {
    /// Held only for moments, never across an await.
    entries: RwLock<Arc<Entries>>,
}

type Entries = BTreeMap<String, Arc<Entry>>;

impl Registry {
    pub fn new(tools: Vec<Arc<dyn Tool>>) -> Result<Registry, Error> {
        Ok(Registry {
            entries: RwLock::new(Arc::new(compile(tools)?)),
        })
    }

    /// Replaces every tool with `tools`, all at once; on an error nothing changes.
    pub fn replace(&self, tools: Vec<Arc<dyn Tool>>) -> Result<(), Error> {
        let entries = Arc::new(compile(tools)?);
        *self.entries.write().unwrap_or_else(|e| e.into_inner()) = entries;
        Ok(())
    }

    fn entries(&self) -> Arc<Entries> {
        Arc::clone(&self.entries.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// The built-in tools: `add`, `now`, `sleep_ms`, `sleep`, `wait`, `append_line` and
    /// `memory_search`.
    pub fn builtin() -> Registry {
        Registry::new(Registry::builtin_tools(memory::DEFAULT_MAX_SNIPPET_BYTES))
            .expect("built-in tool schemas are valid and their names unique")
    }

    /// The built-in tools as a list, to register together with others; `memory_search` shows
    /// at most `max_snippet_bytes` of a matching message.
    pub fn builtin_tools(max_snippet_bytes: usize) -> Vec<Arc<dyn Tool>> {
        vec![
            Arc::new(Add),
            Arc::new(Now),
            Arc::new(SleepMs),
            Arc::new(Sleep),
            Arc::new(Wait),
            Arc::new(AppendLine),
            Arc::new(MemorySearchTool::new(max_snippet_bytes)),
        ]
    }

    /// The JSON schema of a tool's arguments, as this registry has it now.
    pub fn parameters(&self, name: &str) -> Option<Value> {
        self.entries().get(name).map(|e| e.tool.parameters())
    }

    pub fn names(&self) -> Vec<String> {
        self.entries().keys().cloned().collect()
    }

    pub fn specs(&self) -> Vec<ToolSpec> {
        self.entries()
            .values()
            .map(|e| ToolSpec {
                name: e.tool.name().to_owned(),
                description: e.tool.description().to_owned(),
                parameters: e.tool.parameters(),
                replay: e.tool.replay(),
                completes_run: false,
                approval: e.tool.approval(),
                delegation: e.tool.delegation(),
                calls: e.tool.call_limits(),
            })
            .collect()
    }

    /// Checks a call before it runs: the tool must exist and the arguments match its schema.
    /// The error text is shown to the model so that it can correct itself.
    pub fn validate(&self, name: &str, arguments: &Value) -> Result<Arc<dyn Tool>, String> {
        let entries = self.entries();
        let entry = entries.get(name).ok_or_else(|| {
            let names: Vec<&str> = entries.keys().map(String::as_str).collect();
            unknown_tool(name, &names)
        })?;
        let problems: Vec<String> = entry
            .validator
            .iter_errors(arguments)
            .map(|e| {
                let path = e.instance_path().to_string();
                if path.is_empty() {
                    e.to_string()
                } else {
                    format!("{path}: {e}")
                }
            })
            .collect();
        if problems.is_empty() {
            Ok(Arc::clone(&entry.tool))
        } else {
            Err(format!(
                "invalid arguments for {name}: {}",
                problems.join("; ")
            ))
        }
    }
}

/// Compiles each tool's argument validator; names must be unique.
fn compile(tools: Vec<Arc<dyn Tool>>) -> Result<Entries, Error> {
    let mut entries = BTreeMap::new();
    for tool in tools {
        let name = tool.name().to_owned();
        let validator =
            jsonschema::validator_for(&tool.parameters()).map_err(|e| Error::Schema {
                name: name.clone(),
                reason: e.to_string(),
            })?;
        if entries
            .insert(name.clone(), Arc::new(Entry { tool, validator }))
            .is_some()
        {
            return Err(Error::Duplicate(name));
        }
    }
    Ok(entries)
}

/// What the model is told when it calls a tool it was not offered.
pub fn unknown_tool(name: &str, available: &[&str]) -> String {
    format!(
        "unknown tool {name:?}; available tools: {}",
        available.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_replacement_is_whole_or_nothing() {
        let registry = Registry::builtin();
        registry
            .replace(vec![Arc::new(Add), Arc::new(Now)])
            .unwrap();
        assert_eq!(registry.names(), ["add", "now"]);
        assert!(registry.validate("sleep", &json!({})).is_err());
        let twice = registry.replace(vec![Arc::new(Add), Arc::new(Add), Arc::new(Sleep)]);
        assert!(matches!(twice, Err(Error::Duplicate(name)) if name == "add"));
        assert_eq!(
            registry.names(),
            ["add", "now"],
            "a refused set changes nothing"
        );
    }

    #[test]
    fn validation_names_the_problem() {
        let registry = Registry::builtin();
        assert_eq!(
            registry.names(),
            [
                "add",
                "append_line",
                "memory_search",
                "now",
                "sleep",
                "sleep_ms",
                "wait"
            ]
        );
        assert!(registry.validate("add", &json!({"a": 1, "b": 2.5})).is_ok());
        // A wait names exactly one of its two arguments; its value is checked where it parks.
        assert!(registry.validate("wait", &json!({"ms": 5})).is_ok());
        assert!(
            registry
                .validate("wait", &json!({"until": "later"}))
                .is_ok()
        );
        for bad in [
            json!({}),
            json!({"ms": 5, "until": "2030-01-01T00:00:00Z"}),
            json!({"ms": 0}),
            json!({"seconds": 5}),
        ] {
            assert!(registry.validate("wait", &bad).is_err(), "{bad}");
        }
        let err = registry
            .validate("add", &json!({"a": "one", "b": 2}))
            .err()
            .unwrap();
        assert!(err.contains("/a") && err.contains("number"), "{err}");
        let err = registry.validate("add", &json!({"a": 1})).err().unwrap();
        assert!(err.contains("\"b\" is a required property"), "{err}");
        let err = registry
            .validate("add", &json!({"a": 1, "b": 2, "c": 3}))
            .err()
            .unwrap();
        assert!(err.contains("Additional properties"), "{err}");
        for bad in [
            json!({}),
            json!({"query": ""}),
            json!({"query": "x", "limit": 0}),
            json!({"query": "x", "limit": 21}),
            json!({"query": "x".repeat(1001)}),
        ] {
            assert!(registry.validate("memory_search", &bad).is_err(), "{bad}");
        }
        assert!(
            registry
                .validate("memory_search", &json!({"query": "x", "limit": 20}))
                .is_ok()
        );
        let err = registry.validate("rm", &json!({})).err().unwrap();
        assert!(err.contains("unknown tool \"rm\""), "{err}");
    }

    struct Gated;

    #[async_trait]
    impl Tool for Gated {
        fn name(&self) -> &str {
            "gated"
        }
        fn description(&self) -> &str {
            "Waits for a human by default."
        }
        fn parameters(&self) -> Value {
            json!({"type": "object"})
        }
        fn replay(&self) -> ReplayPolicy {
            ReplayPolicy::Never
        }
        fn approval(&self) -> ApprovalPolicy {
            ApprovalPolicy::Always
        }
        async fn call(&self, _: Value, _: &ToolContext) -> ToolOutcome {
            ToolOutcome::ok("ran")
        }
    }

    #[test]
    fn specs_carry_each_tools_default_approval() {
        let tools = [
            Registry::builtin_tools(DEFAULT_MAX_SNIPPET_BYTES),
            vec![Arc::new(Gated) as Arc<dyn Tool>],
        ]
        .concat();
        let specs = Registry::new(tools).unwrap().specs();
        for spec in &specs {
            let expected = if spec.name == "gated" {
                ApprovalPolicy::Always
            } else {
                ApprovalPolicy::Never
            };
            assert_eq!(spec.approval, expected, "{}", spec.name);
        }
        assert_eq!(specs.len(), 8);
    }

    #[test]
    fn a_sleep_may_run_its_longest_wait_before_it_counts_as_cut_off() {
        let specs = Registry::builtin().specs();
        let timeout = |n: &str| specs.iter().find(|s| s.name == n).unwrap().calls.timeout_ms;
        for sleeping in ["sleep", "sleep_ms"] {
            assert!(timeout(sleeping) > 600_000, "{sleeping}");
        }
        assert_eq!(
            timeout("add"),
            ratchet_core::effect::DEFAULT_TOOL_TIMEOUT_MS
        );
    }

    #[test]
    fn specs_carry_replay_policies() {
        let specs = Registry::builtin().specs();
        let policy = |n: &str| specs.iter().find(|s| s.name == n).unwrap().replay;
        assert_eq!(policy("append_line"), ReplayPolicy::Never);
        assert_eq!(policy("add"), ReplayPolicy::Safe);
        assert_eq!(policy("memory_search"), ReplayPolicy::Safe);
    }
}
