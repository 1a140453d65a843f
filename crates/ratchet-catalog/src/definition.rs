//! What one agent definition holds once its file has been checked: the agent's identity,
//! model, tools, delegates, budgets, approval policies, signal contract and system prompt.
//!
//! The budget and signal types carry their own range checks in `Deserialize`, so a value
//! out of range is refused wherever it is read, with the parser's line.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use ratchet_core::inbox::{DEFAULT_SIGNAL_DEPTH, Severity, SignalContract};
use ratchet_core::{ApprovalPolicy, Delivery};
use serde::de::{self, Error as _, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

/// One agent of a catalog, from its Markdown file.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentDefinition {
    pub id: String,
    /// What a delegating model is shown to choose this agent.
    pub description: String,
    /// A model spec; a scripted model's file is an absolute path.
    pub model: String,
    pub tools: Vec<String>,
    /// Ids of the agents of the same catalog this one may hand work to.
    pub delegates: Vec<String>,
    pub limits: AgentLimits,
    pub approval: BTreeMap<String, ApprovalPolicy>,
    pub signal: Option<SignalContract>,
    /// What a run of this agent must have done before it may complete.
    pub completion: Option<ratchet_core::CompletionCriteria>,
    /// The file's body, trimmed.
    pub system_prompt: String,
    /// Lowercase hex SHA-256 of the file's bytes: any edit of the file changes it.
    pub hash: String,
    /// The definition file, absolute.
    pub path: PathBuf,
}

/// The budgets an agent's runs get. Every value is at least 1; an absent one is left to the
/// runtime's default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AgentLimits {
    #[serde(default, deserialize_with = "at_least_one")]
    pub max_steps: Option<u64>,
    #[serde(default, deserialize_with = "at_least_one")]
    pub max_model_calls: Option<u64>,
    #[serde(default, deserialize_with = "at_least_one")]
    pub max_tool_calls: Option<u64>,
    #[serde(default, deserialize_with = "at_least_one")]
    pub max_tokens: Option<u64>,
    #[serde(default, deserialize_with = "at_least_one")]
    pub max_prompt_tokens: Option<u64>,
    #[serde(default, deserialize_with = "at_least_one")]
    pub max_duration_ms: Option<u64>,
    /// Tool calls of one batch run at once.
    #[serde(default, deserialize_with = "at_least_one")]
    pub max_parallel: Option<u32>,
    /// How deep delegation below this agent may go.
    #[serde(default, deserialize_with = "at_least_one")]
    pub max_depth: Option<u32>,
    /// Runs the whole tree of delegations under one run of this agent may start.
    #[serde(default, deserialize_with = "at_least_one")]
    pub max_tree_runs: Option<u64>,
    /// Bytes of one tool result, or of one child's answer, the model is shown.
    #[serde(default, deserialize_with = "at_least_one")]
    pub max_tool_result_bytes: Option<u64>,
}

/// Largest signal payload a contract may allow.
pub const MAX_SIGNAL_BYTES: u32 = 65536;

/// Deepest nesting of a signal's details a contract may allow.
pub const MAX_SIGNAL_DEPTH: u32 = 64;

/// A `signal` block as written: each value range-checked as it is read. It becomes the
/// core's `SignalContract`, which runs are frozen with.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SignalSpec {
    /// Signals one run may send in all (at least 1).
    #[serde(deserialize_with = "positive")]
    max_count: u32,
    /// Least time between two signals.
    #[serde(deserialize_with = "non_negative")]
    min_interval_ms: u64,
    /// Largest payload of one signal, 1 to 65536 bytes.
    #[serde(deserialize_with = "signal_bytes")]
    max_bytes: u32,
    /// The severities a signal may carry; not empty, each at most once.
    #[serde(deserialize_with = "severities")]
    severities: Vec<Severity>,
    /// A signal with the key of one sent this recently is not sent again.
    #[serde(deserialize_with = "non_negative")]
    dedupe_window_ms: u64,
    #[serde(default)]
    delivery: Delivery,
    /// Signals that may go out back to back before `min_interval_ms` spaces them (default 1).
    #[serde(default, deserialize_with = "at_least_one")]
    max_burst: Option<u32>,
    /// Deepest nesting of a signal's `details`, 1 to 64 (default 8).
    #[serde(default, deserialize_with = "signal_depth")]
    max_depth: Option<u32>,
}

impl From<SignalSpec> for SignalContract {
    fn from(spec: SignalSpec) -> SignalContract {
        SignalContract {
            max_count: spec.max_count,
            min_interval_ms: spec.min_interval_ms,
            max_bytes: spec.max_bytes,
            severities: spec.severities,
            dedupe_window_ms: spec.dedupe_window_ms,
            delivery: spec.delivery,
            max_burst: spec.max_burst.unwrap_or(1),
            max_depth: spec.max_depth.unwrap_or(DEFAULT_SIGNAL_DEPTH),
        }
    }
}

/// A `completion` block as written; required tools are checked against the agent's tools.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CompletionSpec {
    #[serde(default)]
    pub(crate) require_tools: Vec<String>,
    #[serde(default)]
    pub(crate) require_fields: Vec<String>,
    #[serde(default, deserialize_with = "non_negative")]
    pub(crate) min_steps: u64,
    #[serde(default = "default_max_attempts", deserialize_with = "positive")]
    pub(crate) max_attempts: u32,
}

fn default_max_attempts() -> u32 {
    ratchet_core::CompletionCriteria::DEFAULT_MAX_ATTEMPTS
}

impl From<CompletionSpec> for ratchet_core::CompletionCriteria {
    fn from(spec: CompletionSpec) -> ratchet_core::CompletionCriteria {
        ratchet_core::CompletionCriteria {
            required_tools: spec.require_tools,
            required_fields: spec.require_fields,
            min_steps: spec.min_steps,
            max_attempts: spec.max_attempts,
        }
    }
}

/// Reads any integer, so that the error for a negative or oversized one can name it.
struct Integer;

impl Visitor<'_> for Integer {
    type Value = i128;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an integer")
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<i128, E> {
        Ok(value.into())
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<i128, E> {
        Ok(value.into())
    }
}

/// An integer of at least `least` that fits a `T`.
fn integer<'de, D, T>(deserializer: D, least: i128) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<i128>,
{
    let value = deserializer.deserialize_any(Integer)?;
    if value < least {
        return Err(D::Error::custom(format!(
            "expected an integer of at least {least}, found {value}"
        )));
    }
    T::try_from(value).map_err(|_| {
        D::Error::custom(format!(
            "expected an integer that fits a {}, found {value}",
            std::any::type_name::<T>()
        ))
    })
}

fn positive<'de, D: Deserializer<'de>, T: TryFrom<i128>>(deserializer: D) -> Result<T, D::Error> {
    integer(deserializer, 1)
}

fn at_least_one<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<i128>,
{
    integer(deserializer, 1).map(Some)
}

fn non_negative<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    integer(deserializer, 0)
}

fn signal_bytes<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
    let bytes: u32 = integer(deserializer, 1)?;
    if bytes > MAX_SIGNAL_BYTES {
        return Err(D::Error::custom(format!(
            "expected at most {MAX_SIGNAL_BYTES} bytes, found {bytes}"
        )));
    }
    Ok(bytes)
}

fn signal_depth<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u32>, D::Error> {
    let depth: u32 = integer(deserializer, 1)?;
    if depth > MAX_SIGNAL_DEPTH {
        return Err(D::Error::custom(format!(
            "expected a depth of at most {MAX_SIGNAL_DEPTH}, found {depth}"
        )));
    }
    Ok(Some(depth))
}

fn severities<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<Severity>, D::Error> {
    let severities = Vec::<Severity>::deserialize(deserializer)?;
    if severities.is_empty() {
        return Err(D::Error::custom(
            "expected at least one severity, found an empty list",
        ));
    }
    for (i, severity) in severities.iter().enumerate() {
        if severities[..i].contains(severity) {
            return Err(D::Error::custom(format!(
                "severity `{}` is listed twice; list each at most once",
                severity.as_str()
            )));
        }
    }
    Ok(severities)
}
