//! `ratchet.toml`: the configuration file of `ratchet serve` and `ratchet worker`, with
//! `RATCHET_*` environment overrides.
//! Unknown keys are errors, so a typo never silently falls back to a default.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use ratchet_core::bounds::{LaneLimit, SteerLimits};
use ratchet_core::{ApprovalPolicy, ReplayPolicy};

use ratchet_core::MemoryScope;
use serde::Deserialize;

use ratchet_webhooks::{Rule, WebhookPolicy};

use ratchet_server::{StreamLimits, Tokens, hash_token};

/// What is wrong with a token a person chose, said after "the token …"; None for a good one.
pub(crate) fn token_problem(token: &str) -> Option<String> {
    let chars = token.chars().count();
    if chars < MIN_TOKEN_CHARS {
        return Some(format!(
            "has {chars} characters; expected at least {MIN_TOKEN_CHARS}"
        ));
    }
    token.chars().any(char::is_whitespace).then(|| {
        "contains whitespace, which no `Authorization: Bearer` header can carry".to_owned()
    })
}

/// A lease shorter than this would lapse between a busy machine's heartbeats.
const MIN_LEASE_MS: u64 = 100;
/// The shortest token `env =` may hold: a shorter one can be guessed.
const MIN_TOKEN_CHARS: usize = 16;
/// More concurrent steps than any machine needs: a typo, not a setting.
const MAX_WORKERS: u64 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Address to listen on (default `127.0.0.1:7700`).
    pub listen: Option<String>,
    /// Database URL (default `sqlite://ratchet.db`).
    pub db: Option<String>,
    /// Model every new run is frozen with: `scripted:FILE`, `openai:MODEL`, `anthropic:MODEL`
    /// or a profile's name (default `scripted:demo`).
    pub model: Option<String>,
    /// Directory file tools may write in (default: the working directory).
    pub workspace: Option<String>,
    /// Step budget of every new run (default 50).
    pub max_steps: Option<u64>,
    /// Model calls every new run may make (default: no limit).
    pub max_model_calls: Option<u64>,
    /// Tool calls after which a run is offered no more tools (default: no limit).
    pub max_tool_calls: Option<u64>,
    /// Model tokens every new run may spend (default: no limit).
    pub max_tokens: Option<u64>,
    /// Estimated prompt tokens beyond which a run compacts its context (default: no limit).
    pub max_prompt_tokens: Option<u64>,
    /// Wall-clock milliseconds a run may take before it ends `timed_out`, cut off mid-step if
    /// need be (default: no limit).
    pub max_duration_ms: Option<u64>,
    /// What `memory_search` looks through: `session` (the run's session, the default) or
    /// `tenant` (every session of the session's tenant).
    pub memory_scope: Option<MemoryScope>,
    /// Steps this process runs at once (default 16); 0 on `serve` means the API only.
    pub workers: Option<u64>,
    /// How long a claimed step stays this process's without a heartbeat (default 15000 ms);
    /// after it, another process takes the step over.
    pub lease_ms: Option<u64>,
    /// How often a running step renews its lease (default a third of the lease).
    pub heartbeat_ms: Option<u64>,
    /// How often an idle worker looks for work nobody announced (default 250 ms).
    pub poll_ms: Option<u64>,
    /// How long a tool call may go on after its step was cut off (a cancel, the run's
    /// deadline, a shutdown) before it is aborted with its outcome unknown (default 5000 ms).
    pub cancel_grace_ms: Option<u64>,
    #[serde(default)]
    pub tokens: Vec<TokenConfig>,
    /// Per-tool settings, `[tools.NAME]`.
    #[serde(default)]
    pub tools: BTreeMap<String, ToolConfig>,
    /// Model profiles, `[models.NAME]`: `model = "NAME"` (or `--model NAME`) picks one.
    #[serde(default)]
    pub models: BTreeMap<String, ratchet_llm::profiles::Profile>,
    /// MCP servers whose tools runs are offered, `[mcp.servers.NAME]`.
    #[serde(default)]
    pub mcp: ratchet_mcp::Config,
    /// Directory of agent definitions (Markdown with YAML frontmatter) sessions may pick.
    pub agents: Option<String>,
    /// How many runs may be unfinished and how many calls may be in flight, `[gates]`.
    #[serde(default)]
    pub gates: GatesConfig,
    /// The limits of every delegation tree, `[delegation]`.
    #[serde(default)]
    pub delegation: DelegationLimits,
    /// How background work reports back, `[inbox]`.
    #[serde(default)]
    pub inbox: InboxSettings,
    /// How events are sent to webhooks, and where they may go, `[webhooks]`.
    #[serde(default)]
    pub webhooks: WebhookSettings,
    /// The key that seals webhook secrets at rest, `[secrets]`.
    #[serde(default)]
    pub secrets: SecretsSettings,
    /// What one client or tenant may hold of the server, `[limits]`.
    #[serde(default)]
    pub limits: LimitSettings,
    /// The HTTP server, `[server]`.
    #[serde(default)]
    pub server: ServerSettings,
    /// The HTTP API's own settings, `[api]`.
    #[serde(default)]
    pub api: ApiSettings,
}

/// `[api]`: how the HTTP API treats requests. Absent keys keep their defaults.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiSettings {
    /// How long the response to a request sent with an `Idempotency-Key` is kept and sent
    /// again to a repeat (default 86400000, a day). At least 1000.
    pub idempotency_ttl_ms: Option<u64>,
    /// How long such a request holds its key while it is carried out (default 30000): a
    /// repeat meanwhile is 409, and after the process carrying it out died, a repeat waits
    /// this long at most. At least 1000, and less than the TTL.
    pub idempotency_hold_ms: Option<u64>,
}

/// `[limits]`: how much of the server a client, a tenant or a tool result may take. Absent
/// keys keep their defaults.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSettings {
    /// Event streams open at once in this process (default 1024); past it, 429.
    pub max_streams: Option<u64>,
    /// Event streams one tenant may hold open at once (default 64); past it, 429.
    pub max_streams_per_tenant: Option<u64>,
    /// How long a connection may leave the server's writes unread before it is closed
    /// (default 30000): a stalled client gives its stream and memory back, and resumes by
    /// `Last-Event-ID` when it reconnects.
    pub stream_stall_ms: Option<u64>,
    /// The most text `memory_search` shows of one matching message (default 2048 bytes).
    pub max_snippet_bytes: Option<u64>,
    /// Bytes of one tool result, or of one child's answer, a model is shown (default 65536);
    /// the store and the API keep the whole value. Frozen into each run.
    pub max_tool_result_bytes: Option<u64>,
    /// Steering messages from users that may wait for a run's next model call (default 32).
    pub max_user_steers: Option<u32>,
    /// Their bytes in all (default 65536).
    pub max_user_steer_bytes: Option<u64>,
    /// Steered signals from background runs that may wait for a run's next model call
    /// (default 8).
    pub max_agent_steers: Option<u32>,
    /// Their bytes in all (default 32768).
    pub max_agent_steer_bytes: Option<u64>,
}

/// `[server]`: who may address the HTTP server.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSettings {
    /// Host names (`ratchet.example.com`, `*.example.com`) requests may name in `Host` and
    /// `Origin` besides the addresses the server listens on; `["*"]` turns the check off.
    pub allowed_hosts: Option<Vec<String>>,
}

/// The limits of `[limits]`, checked and with their defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerLimits {
    pub streams: StreamLimits,
    pub stream_stall: Duration,
    pub max_snippet_bytes: usize,
}

/// `[secrets]`: where the key that seals webhook signing secrets at rest comes from.
/// `RATCHET_SECRETS_KEY` (the key itself, 64 hex digits) takes the place of `key_file`, and
/// `RATCHET_SECRETS_PREVIOUS_KEYS` (comma-separated) of `previous_key_files`. Without a key,
/// `serve` on SQLite makes one in a file beside the database on first start, and on PostgreSQL
/// refuses to start.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretsSettings {
    /// A file holding the key as 64 hex digits, readable by its owner only.
    pub key_file: Option<String>,
    /// Files of keys that sealed secrets before this one: at start, what they sealed is sealed
    /// again under the current key. Drop them once a start has done so.
    #[serde(default)]
    pub previous_key_files: Vec<String>,
}

/// `[webhooks]`: the dispatcher that sends events to the tenants' webhooks, and where they may
/// send. Absent keys keep their defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookSettings {
    /// Whether this process sends webhook deliveries (default true). With several processes
    /// on one database any number may; each attempt is made by one.
    pub enabled: Option<bool>,
    /// How often the dispatcher looks for new events when nothing else wakes it (default 250).
    pub poll_ms: Option<u64>,
    /// How long an attempt may take before it counts as failed (default 10000).
    pub timeout_ms: Option<u64>,
    /// Attempts in flight at once (default 8).
    pub concurrency: Option<u32>,
    /// Wait before a delivery's second attempt, doubling after (default 1000).
    pub retry_backoff_ms: Option<u64>,
    /// The longest wait between two attempts (default 600000).
    pub max_backoff_ms: Option<u64>,
    /// How long a delivery may wait to be delivered before it is dead-lettered as expired
    /// (default 604800000, seven days).
    pub max_age_ms: Option<u64>,
    /// Open deliveries a webhook may hold for one session; past it the oldest pending ones are
    /// dead-lettered (default 10000).
    pub max_open_per_session: Option<u32>,
    /// Destinations allowed besides public addresses: CIDR blocks (`10.1.0.0/16`), addresses,
    /// host names (`hooks.example.internal`, with every address it resolves to) and `*.domain`
    /// patterns (every name below the domain). Default: none; loopback is allowed without a
    /// rule when the server listens only on loopback.
    #[serde(default)]
    pub allow: Vec<String>,
}

/// `[inbox]`: each root session's inbox of background reports, and its continuation turns.
/// Absent keys keep their defaults (see `ratchet_core::InboxPolicy`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InboxSettings {
    /// Reports and reservations a session's inbox may hold (default 64).
    pub capacity: Option<u32>,
    /// Continuation turns a report is offered to before it is dead-lettered (default 3).
    pub max_attempts: Option<u32>,
    /// Wait before a report's second attempt, doubling after (default 5000).
    pub retry_backoff_ms: Option<u64>,
    /// User turns that may start in a row while reports are due (default 3).
    pub user_turns_before_inbox: Option<u32>,
    /// How long a due report may wait before it goes ahead of queued user turns (default
    /// 60000).
    pub max_wait_ms: Option<u64>,
    /// How long a continuation turn may take (default 300000).
    pub continuation_max_duration_ms: Option<u64>,
    /// How long a report may wait to be told before it is dead-lettered as expired (default
    /// 604800000, seven days).
    pub max_age_ms: Option<u64>,
}

/// `[gates]`: a run quota (unfinished runs: queued, running, waiting, cancelling) and step
/// permits (model and tool calls in flight in this process), each global and per session
/// (a session's count includes its delegations' runs). Absent means no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatesConfig {
    pub max_active_runs: Option<u64>,
    pub max_active_runs_per_session: Option<u64>,
    pub model_calls: Option<u64>,
    pub model_calls_per_session: Option<u64>,
    pub tool_calls: Option<u64>,
    pub tool_calls_per_session: Option<u64>,
}

/// A limit of `[gates]`: absent for none, never 0.
fn gate(name: &str, value: Option<u64>) -> Result<Option<u64>, ConfigError> {
    if value == Some(0) {
        return Err(ConfigError::Invalid(format!(
            "gates.{name} must be at least 1 (or absent for no limit), found 0"
        )));
    }
    Ok(value)
}

/// `[delegation]`: how deep a tree of delegated runs may grow below its root run, how many
/// runs it may hold (an agent's own `limits` may lower both for the trees it roots), and what
/// all the runs of a tree may spend together: tokens and dollars. Absent budgets mean none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DelegationLimits {
    pub max_depth: Option<u32>,
    pub max_tree_runs: Option<u64>,
    pub max_tree_tokens: Option<u64>,
    pub max_tree_cost_usd: Option<f64>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolConfig {
    /// `"always"`, `"never"` (the default), or a table of argument globs such as
    /// `{ path = "secrets/**" }`: a call waits for approval when any of them matches.
    pub approval: Option<toml::Value>,
    /// What a call with an unknown outcome after a crash may do: `safe` (run again), `keyed`
    /// (run again with the same idempotency key) or `never` (a human reconciles). Default:
    /// the tool's own.
    pub replay: Option<ReplayPolicy>,
    /// How long one call may run before it is cut off with its outcome unknown (default
    /// 300000, five minutes).
    pub timeout_ms: Option<u64>,
    /// Attempts of a `keyed` or `safe` call whose outcome stays unknown (timeouts, lost
    /// connections) before a human is asked (`keyed`) or the model gets an error (`safe`);
    /// default 3. A `never` call is tried once.
    pub max_attempts: Option<u32>,
    /// `[tools.wait]` only: the longest one `wait` call may park its run (default 604800000,
    /// seven days). Frozen into each run.
    pub max_ms: Option<u64>,
}

/// The call limits `[tools.NAME]` sets over the tool's defaults.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallLimitsOverride {
    pub timeout_ms: Option<u64>,
    pub max_attempts: Option<u32>,
}

impl CallLimitsOverride {
    /// The limits of a tool with these settings applied.
    pub fn apply(self, limits: &mut ratchet_core::CallLimits) {
        if let Some(timeout_ms) = self.timeout_ms {
            limits.timeout_ms = timeout_ms;
        }
        if let Some(max_attempts) = self.max_attempts {
            limits.max_attempts = max_attempts;
        }
    }
}

/// One accepted bearer token: its SHA-256 (`ratchet` never stores the token itself) or the
/// name of an environment variable holding it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenConfig {
    pub tenant: String,
    pub sha256: Option<String>,
    pub env: Option<String>,
    /// Whether the token may also administer the server (`POST /v1/admin/reload`); default
    /// false.
    pub admin: Option<bool>,
}

impl Config {
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Invalid(e.to_string()))
    }

    pub fn load(path: &str) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        Config::from_toml(&text)
    }

    /// The file at `path`, or the defaults when no file is given.
    pub fn load_or_default(path: Option<&std::path::Path>) -> Result<Config, ConfigError> {
        path.map_or_else(
            || Ok(Config::default()),
            |path| Config::load(&path.display().to_string()),
        )
    }

    /// `RATCHET_LISTEN`, `RATCHET_DB`, `RATCHET_MODEL`, `RATCHET_WORKSPACE`,
    /// `RATCHET_MAX_STEPS`, `RATCHET_WORKERS`, `RATCHET_LEASE_MS`, `RATCHET_HEARTBEAT_MS` and
    /// `RATCHET_POLL_MS` override the file.
    pub fn with_env(mut self, env: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        for (key, slot) in [
            ("RATCHET_LISTEN", &mut self.listen),
            ("RATCHET_DB", &mut self.db),
            ("RATCHET_MODEL", &mut self.model),
            ("RATCHET_WORKSPACE", &mut self.workspace),
        ] {
            if let Some(value) = env(key) {
                *slot = Some(value);
            }
        }
        for (key, slot) in [
            ("RATCHET_MAX_STEPS", &mut self.max_steps),
            ("RATCHET_WORKERS", &mut self.workers),
            ("RATCHET_LEASE_MS", &mut self.lease_ms),
            ("RATCHET_HEARTBEAT_MS", &mut self.heartbeat_ms),
            ("RATCHET_POLL_MS", &mut self.poll_ms),
            ("RATCHET_CANCEL_GRACE_MS", &mut self.cancel_grace_ms),
        ] {
            if let Some(value) = env(key) {
                let number = value.parse().map_err(|_| {
                    ConfigError::Invalid(format!(
                        "{key} must be a non-negative integer, found {value:?}"
                    ))
                })?;
                *slot = Some(number);
            }
        }
        Ok(self)
    }

    /// The worker pool's settings, checked: a heartbeat shorter than the lease (or the lease
    /// would lapse while its step runs), no zero durations. `workers` may be 0 here; whether a
    /// command can do without workers is the command's to say.
    pub fn pool(&self) -> Result<ratchet_engine::PoolConfig, ConfigError> {
        let defaults = ratchet_engine::PoolConfig::default();
        let invalid = |why: String| Err(ConfigError::Invalid(why));
        let lease = self.lease_ms.unwrap_or(defaults.lease.as_millis() as u64);
        if lease < MIN_LEASE_MS {
            return invalid(format!(
                "lease_ms (--lease-ms) must be at least {MIN_LEASE_MS}, found {lease}"
            ));
        }
        let heartbeat = self.heartbeat_ms.unwrap_or(lease / 3);
        if heartbeat == 0 || heartbeat >= lease {
            return invalid(format!(
                "heartbeat_ms (--heartbeat-ms) must be at least 1 and shorter than the lease \
                 ({lease} ms), found {heartbeat}"
            ));
        }
        let poll = self.poll_ms.unwrap_or(defaults.poll.as_millis() as u64);
        if poll == 0 {
            return invalid("poll_ms (--poll-ms) must be at least 1".to_owned());
        }
        let workers = self.workers.unwrap_or(defaults.workers as u64);
        if workers > MAX_WORKERS {
            return invalid(format!(
                "workers (--workers) must be at most {MAX_WORKERS}, found {workers}"
            ));
        }
        let cancel_grace = self
            .cancel_grace_ms
            .map_or(defaults.cancel_grace, Duration::from_millis);
        Ok(ratchet_engine::PoolConfig {
            workers: workers as usize,
            lease: Duration::from_millis(lease),
            heartbeat: Duration::from_millis(heartbeat),
            poll: Duration::from_millis(poll),
            cancel_grace,
            ..defaults
        })
    }

    /// The run quota of `[gates]`, checked: a limit of 0 would refuse every run.
    pub fn quota(&self) -> Result<ratchet_store::RunQuota, ConfigError> {
        let gates = &self.gates;
        Ok(ratchet_store::RunQuota {
            global: gate("max_active_runs", gates.max_active_runs)?,
            per_session: gate(
                "max_active_runs_per_session",
                gates.max_active_runs_per_session,
            )?,
        })
    }

    /// The tree budget of `[delegation]`, checked: a budget of nothing would let no tree call
    /// a model with its tools. Dollars become the millionths the runs' counters count.
    pub fn tree_budget(&self) -> Result<ratchet_core::TreeBudget, ConfigError> {
        let limits = &self.delegation;
        if limits.max_tree_tokens == Some(0) {
            return Err(ConfigError::Invalid(
                "delegation.max_tree_tokens must be at least 1 (or absent for no limit), found 0"
                    .into(),
            ));
        }
        let max_cost_microusd = match limits.max_tree_cost_usd {
            None => None,
            Some(dollars) if dollars.is_finite() && dollars * 1e6 >= 1.0 => {
                Some((dollars * 1e6).round() as u64)
            }
            Some(dollars) => {
                return Err(ConfigError::Invalid(format!(
                    "delegation.max_tree_cost_usd must be a positive number of dollars, at least 0.000001 (or absent for no limit), found {dollars}"
                )));
            }
        };
        Ok(ratchet_core::TreeBudget {
            max_tokens: limits.max_tree_tokens,
            max_cost_microusd,
        })
    }

    /// The rules of `[inbox]`, checked: a capacity or attempt count of 0 would drop reports.
    pub fn inbox_policy(&self) -> Result<ratchet_core::InboxPolicy, ConfigError> {
        let settings = &self.inbox;
        let defaults = ratchet_core::InboxPolicy::default();
        let at_least_one = |name: &str, value: Option<u32>| match value {
            Some(0) => Err(ConfigError::Invalid(format!(
                "inbox.{name} must be at least 1, found 0"
            ))),
            _ => Ok(value),
        };
        Ok(ratchet_core::InboxPolicy {
            capacity: at_least_one("capacity", settings.capacity)?.unwrap_or(defaults.capacity),
            max_attempts: at_least_one("max_attempts", settings.max_attempts)?
                .unwrap_or(defaults.max_attempts),
            retry_backoff_ms: settings
                .retry_backoff_ms
                .unwrap_or(defaults.retry_backoff_ms),
            user_turns_before_inbox: settings
                .user_turns_before_inbox
                .unwrap_or(defaults.user_turns_before_inbox),
            max_wait_ms: settings.max_wait_ms.unwrap_or(defaults.max_wait_ms),
            continuation_max_duration_ms: settings
                .continuation_max_duration_ms
                .unwrap_or(defaults.continuation_max_duration_ms),
            max_age_ms: match settings.max_age_ms {
                Some(0) => {
                    return Err(ConfigError::Invalid(
                        "inbox.max_age_ms must be at least 1, found 0".into(),
                    ));
                }
                age => age.unwrap_or(defaults.max_age_ms),
            },
        })
    }

    /// Where webhooks may send: public addresses, what `[webhooks] allow` names (every entry
    /// checked), and loopback when `loopback` (the server listens only on loopback).
    pub fn webhook_policy(&self, loopback: bool) -> Result<WebhookPolicy, ConfigError> {
        let mut rules = Vec::new();
        let mut bad = Vec::new();
        for (i, entry) in self.webhooks.allow.iter().enumerate() {
            match Rule::parse(entry) {
                Ok(rule) => rules.push(rule),
                Err(error) => bad.push(format!("webhooks.allow[{i}] {error}")),
            }
        }
        if !bad.is_empty() {
            return Err(ConfigError::Invalid(bad.join("; ")));
        }
        Ok(WebhookPolicy::new(rules).loopback_allowed(loopback))
    }

    /// The webhook dispatcher's settings, checked, sending only where `policy` allows; None
    /// when `[webhooks] enabled = false`.
    pub fn webhooks(
        &self,
        policy: WebhookPolicy,
    ) -> Result<Option<ratchet_webhooks::DispatcherConfig>, ConfigError> {
        let settings = &self.webhooks;
        if settings.enabled == Some(false) {
            return Ok(None);
        }
        let defaults = ratchet_webhooks::DispatcherConfig::default();
        let positive = |name: &str, value: Option<u64>, default: u64| match value {
            Some(0) => Err(ConfigError::Invalid(format!(
                "webhooks.{name} must be at least 1, found 0"
            ))),
            _ => Ok(value.unwrap_or(default)),
        };
        let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let poll = positive("poll_ms", settings.poll_ms, millis(defaults.poll))?;
        let timeout = positive("timeout_ms", settings.timeout_ms, millis(defaults.timeout))?;
        let concurrency = positive(
            "concurrency",
            settings.concurrency.map(u64::from),
            u64::from(defaults.concurrency),
        )?;
        let first = positive(
            "retry_backoff_ms",
            settings.retry_backoff_ms,
            defaults.backoff.first_ms,
        )?;
        let max = positive(
            "max_backoff_ms",
            settings.max_backoff_ms,
            defaults.backoff.max_ms.max(first),
        )?;
        if max < first {
            return Err(ConfigError::Invalid(format!(
                "webhooks.max_backoff_ms ({max}) must be at least webhooks.retry_backoff_ms \
                 ({first})"
            )));
        }
        let max_age_ms = positive(
            "max_age_ms",
            settings.max_age_ms,
            defaults.bounds.max_age_ms,
        )?;
        let max_open = positive(
            "max_open_per_session",
            settings.max_open_per_session.map(u64::from),
            u64::from(defaults.bounds.max_open_per_session),
        )?;
        Ok(Some(ratchet_webhooks::DispatcherConfig {
            bounds: ratchet_store::DeliveryBounds {
                max_age_ms,
                max_open_per_session: u32::try_from(max_open).unwrap_or(u32::MAX),
            },
            poll: Duration::from_millis(poll),
            timeout: Duration::from_millis(timeout),
            concurrency: u32::try_from(concurrency).unwrap_or(u32::MAX),
            backoff: ratchet_core::Backoff {
                first_ms: first,
                max_ms: max,
            },
            policy,
            ..defaults
        }))
    }

    /// The step permits of `[gates]`, checked: a limit of 0 would let no call through.
    pub fn permits(&self) -> Result<ratchet_engine::PermitLimits, ConfigError> {
        let gates = &self.gates;
        let permits = |name, value| {
            gate(name, value).map(|n| n.map(|n| usize::try_from(n).unwrap_or(usize::MAX)))
        };
        Ok(ratchet_engine::PermitLimits {
            model_calls: permits("model_calls", gates.model_calls)?,
            model_calls_per_session: permits(
                "model_calls_per_session",
                gates.model_calls_per_session,
            )?,
            tool_calls: permits("tool_calls", gates.tool_calls)?,
            tool_calls_per_session: permits(
                "tool_calls_per_session",
                gates.tool_calls_per_session,
            )?,
        })
    }

    /// The approval policy of every tool the file configures, by tool name. Whether the tools
    /// exist is checked where the tools are known.
    pub fn approval_policies(&self) -> Result<BTreeMap<String, ApprovalPolicy>, ConfigError> {
        let mut policies = BTreeMap::new();
        for (tool, settings) in &self.tools {
            let Some(approval) = &settings.approval else {
                continue;
            };
            let invalid =
                |why: String| ConfigError::Invalid(format!("tools.{tool}.approval: {why}"));
            let policy = match approval {
                toml::Value::String(mode) if mode == "always" => ApprovalPolicy::Always,
                toml::Value::String(mode) if mode == "never" => ApprovalPolicy::Never,
                toml::Value::Table(rules) if !rules.is_empty() => {
                    let mut globs = BTreeMap::new();
                    for (argument, glob) in rules {
                        let toml::Value::String(glob) = glob else {
                            return Err(invalid(format!(
                                "the rule for argument {argument:?} must be a glob string, found {glob}"
                            )));
                        };
                        globs.insert(argument.clone(), glob.clone());
                    }
                    ApprovalPolicy::WhenArguments(globs)
                }
                other => {
                    return Err(invalid(format!(
                        "expected \"always\", \"never\" or a table of argument globs, found {other}"
                    )));
                }
            };
            policy.validate().map_err(invalid)?;
            policies.insert(tool.clone(), policy);
        }
        Ok(policies)
    }

    /// The call limits the file sets, by tool name, checked: no zero timeout or attempts.
    pub fn call_limits(&self) -> Result<BTreeMap<String, CallLimitsOverride>, ConfigError> {
        let mut limits = BTreeMap::new();
        for (tool, settings) in &self.tools {
            let zero = match (settings.timeout_ms, settings.max_attempts) {
                (Some(0), _) => Some("timeout_ms"),
                (_, Some(0)) => Some("max_attempts"),
                _ => None,
            };
            if let Some(key) = zero {
                return Err(ConfigError::Invalid(format!(
                    "tools.{tool}.{key} must be at least 1, found 0"
                )));
            }
            if settings.timeout_ms.is_some() || settings.max_attempts.is_some() {
                let set = CallLimitsOverride {
                    timeout_ms: settings.timeout_ms,
                    max_attempts: settings.max_attempts,
                };
                limits.insert(tool.clone(), set);
            }
        }
        Ok(limits)
    }

    /// The longest one `wait` may park a run, `[tools.wait] max_ms`, checked: at least 1, and
    /// set for `wait` alone (no other tool waits).
    pub fn max_wait_ms(&self) -> Result<u64, ConfigError> {
        for (tool, settings) in &self.tools {
            match (settings.max_ms, tool == ratchet_core::WAIT_TOOL) {
                (Some(_), false) => {
                    return Err(ConfigError::Invalid(format!(
                        "tools.{tool}.max_ms is not a setting of {tool}; only [tools.wait] takes max_ms"
                    )));
                }
                (Some(0), true) => {
                    return Err(ConfigError::Invalid(
                        "tools.wait.max_ms must be at least 1, found 0".into(),
                    ));
                }
                _ => {}
            }
        }
        Ok((self.tools.get(ratchet_core::WAIT_TOOL))
            .and_then(|settings| settings.max_ms)
            .unwrap_or(ratchet_core::timer::DEFAULT_MAX_WAIT_MS))
    }

    /// The replay policies the file sets, by tool name.
    pub fn replay_policies(&self) -> BTreeMap<String, ReplayPolicy> {
        (self.tools.iter())
            .filter_map(|(tool, settings)| settings.replay.map(|r| (tool.clone(), r)))
            .collect()
    }

    /// `[limits]`, checked: no zeros (a cap of 0 would refuse every stream).
    pub fn limits(&self) -> Result<ServerLimits, ConfigError> {
        let settings = &self.limits;
        let at_least_one = |name: &str, value: Option<u64>, default: u64| match value {
            Some(0) => Err(ConfigError::Invalid(format!(
                "limits.{name} must be at least 1, found 0"
            ))),
            _ => Ok(value.unwrap_or(default)),
        };
        let size = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
        let defaults = StreamLimits::default();
        let max_streams = at_least_one(
            "max_streams",
            settings.max_streams,
            defaults.max_streams as u64,
        )?;
        let per_tenant = at_least_one(
            "max_streams_per_tenant",
            settings.max_streams_per_tenant,
            defaults.max_streams_per_tenant as u64,
        )?;
        let stall = at_least_one("stream_stall_ms", settings.stream_stall_ms, 30_000)?;
        let snippet = at_least_one("max_snippet_bytes", settings.max_snippet_bytes, 2048)?;
        Ok(ServerLimits {
            streams: StreamLimits {
                max_streams: size(max_streams),
                max_streams_per_tenant: size(per_tenant),
            },
            stream_stall: Duration::from_millis(stall),
            max_snippet_bytes: size(snippet),
        })
    }

    /// How long `Idempotency-Key`s are kept and held (`[api] idempotency_ttl_ms` and
    /// `idempotency_hold_ms`), checked.
    pub fn idempotency(&self) -> Result<(i64, i64), ConfigError> {
        let at_least_a_second = |name: &str, value: Option<u64>, default: i64| match value {
            None => Ok(default),
            Some(ms) if ms < 1000 => Err(ConfigError::Invalid(format!(
                "api.{name} must be at least 1000 (a second), found {ms}"
            ))),
            Some(ms) => Ok(i64::try_from(ms).unwrap_or(i64::MAX)),
        };
        let ttl = at_least_a_second(
            "idempotency_ttl_ms",
            self.api.idempotency_ttl_ms,
            ratchet_server::DEFAULT_IDEMPOTENCY_TTL_MS,
        )?;
        let hold = at_least_a_second(
            "idempotency_hold_ms",
            self.api.idempotency_hold_ms,
            ratchet_server::DEFAULT_IDEMPOTENCY_HOLD_MS,
        )?;
        if hold >= ttl {
            return Err(ConfigError::Invalid(format!(
                "api.idempotency_hold_ms ({hold}) must be less than api.idempotency_ttl_ms ({ttl})"
            )));
        }
        Ok((ttl, hold))
    }

    /// What `[limits]` bounds of a run's inputs, checked (no zeros): the bytes of a tool result
    /// the model is shown, and the steering each lane may queue. Frozen into each run.
    pub fn input_bounds(&self) -> Result<(u64, SteerLimits), ConfigError> {
        let settings = &self.limits;
        let at_least_one = |name: &str, value: Option<u64>, default: u64| match value {
            Some(0) => Err(ConfigError::Invalid(format!(
                "limits.{name} must be at least 1, found 0"
            ))),
            _ => Ok(value.unwrap_or(default)),
        };
        let count = |name: &str, value: Option<u32>, default: u32| {
            at_least_one(name, value.map(u64::from), u64::from(default))
                .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
        };
        let defaults = SteerLimits::default();
        let tool_result = at_least_one(
            "max_tool_result_bytes",
            settings.max_tool_result_bytes,
            ratchet_core::bounds::DEFAULT_MAX_TOOL_RESULT_BYTES,
        )?;
        let steer = SteerLimits {
            user: LaneLimit {
                max_messages: count(
                    "max_user_steers",
                    settings.max_user_steers,
                    defaults.user.max_messages,
                )?,
                max_bytes: at_least_one(
                    "max_user_steer_bytes",
                    settings.max_user_steer_bytes,
                    defaults.user.max_bytes,
                )?,
            },
            agent: LaneLimit {
                max_messages: count(
                    "max_agent_steers",
                    settings.max_agent_steers,
                    defaults.agent.max_messages,
                )?,
                max_bytes: at_least_one(
                    "max_agent_steer_bytes",
                    settings.max_agent_steer_bytes,
                    defaults.agent.max_bytes,
                )?,
            },
        };
        Ok((tool_result, steer))
    }

    /// The accepted tokens, reading `env` tokens from the environment now.
    pub fn tokens(&self, env: impl Fn(&str) -> Option<String>) -> Result<Tokens, ConfigError> {
        let mut by_hash = HashMap::new();
        let mut admins = Vec::new();
        for (i, token) in self.tokens.iter().enumerate() {
            if token.tenant.trim().is_empty() {
                return Err(ConfigError::Invalid(format!(
                    "tokens[{i}]: tenant is empty"
                )));
            }
            let hash = match (&token.sha256, &token.env) {
                (Some(hash), None) => {
                    let valid = hash.len() == 64 && hash.chars().all(|c| c.is_ascii_hexdigit());
                    if !valid {
                        return Err(ConfigError::Invalid(format!(
                            "tokens[{i}]: sha256 must be 64 hex digits, found {hash:?}"
                        )));
                    }
                    let hash = hash.to_ascii_lowercase();
                    if hash == hash_token("") {
                        return Err(ConfigError::Invalid(format!(
                            "tokens[{i}]: sha256 is the hash of the empty token, which anyone \
                             can send; hash a random token of at least {MIN_TOKEN_CHARS} characters"
                        )));
                    }
                    hash
                }
                (None, Some(var)) => {
                    let value = env(var).filter(|v| !v.is_empty()).ok_or_else(|| {
                        ConfigError::Invalid(format!(
                            "tokens[{i}]: environment variable {var} is not set"
                        ))
                    })?;
                    if let Some(problem) = token_problem(&value) {
                        return Err(ConfigError::Invalid(format!(
                            "tokens[{i}]: the token in {var} {problem}"
                        )));
                    }
                    hash_token(&value)
                }
                _ => {
                    return Err(ConfigError::Invalid(format!(
                        "tokens[{i}]: give exactly one of `sha256` or `env`"
                    )));
                }
            };
            if token.admin == Some(true) {
                admins.push(hash.clone());
            }
            if by_hash.insert(hash, token.tenant.clone()).is_some() {
                return Err(ConfigError::Invalid(format!(
                    "tokens[{i}]: the same token is configured twice"
                )));
            }
        }
        Ok(Tokens::new(by_hash).with_admins(admins))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_file_with_env_overrides_and_tokens() {
        let config = Config::from_toml(
            r#"
            listen = "0.0.0.0:8080"
            model = "scripted:demo"
            memory_scope = "tenant"
            [[tokens]]
            tenant = "acme"
            env = "ACME_TOKEN"
            [[tokens]]
            tenant = "globex"
            sha256 = "2BB80D537B1DA3E38BD30361AA855686BDE0EACD7162FEF6A25FE97BF527A25B"
            "#,
        )
        .unwrap();
        let env = |key: &str| match key {
            "RATCHET_LISTEN" => Some("127.0.0.1:9000".to_owned()),
            "ACME_TOKEN" => Some("acme-secret-token".to_owned()),
            _ => None,
        };
        let config = config.with_env(env).unwrap();
        assert_eq!(config.listen.as_deref(), Some("127.0.0.1:9000"));
        assert_eq!(config.model.as_deref(), Some("scripted:demo"));
        assert_eq!(config.memory_scope, Some(MemoryScope::Tenant));
        let tokens = config.tokens(env).unwrap();
        assert!(!tokens.is_empty());
    }

    #[test]
    fn model_profiles_are_read_strictly() {
        let config = Config::from_toml(
            r#"
            model = "fast"
            [models.fast]
            provider = "openai"
            model = "llama3"
            base_url = "http://127.0.0.1:11434/v1"
            max_retries = 5
            prices = { input_per_mtok = 0.1, output_per_mtok = 0.2 }
            "#,
        )
        .unwrap();
        let fast = &config.models["fast"];
        assert_eq!(
            (fast.provider.as_str(), fast.max_retries),
            ("openai", Some(5))
        );
        let typo = Config::from_toml("[models.fast]\nprovider = \"openai\"\nmodle = \"x\"");
        assert!(
            typo.unwrap_err()
                .to_string()
                .contains("unknown field `modle`")
        );
    }

    #[test]
    fn approval_policies_by_tool() {
        let config = Config::from_toml(
            r#"
            [tools.append_line]
            approval = { path = "secrets/**" }
            [tools.add]
            approval = "always"
            [tools.now]
            approval = "never"
            replay = "keyed"
            "#,
        )
        .unwrap();
        let policies = config.approval_policies().unwrap();
        assert_eq!(policies["add"], ApprovalPolicy::Always);
        assert_eq!(policies["now"], ApprovalPolicy::Never);
        assert_eq!(
            config.replay_policies(),
            BTreeMap::from([("now".to_owned(), ReplayPolicy::Keyed)])
        );
        let bad = Config::from_toml("[tools.now]\nreplay = \"sometimes\"").unwrap_err();
        assert!(
            bad.to_string().contains("unknown variant `sometimes`"),
            "{bad}"
        );
        assert_eq!(
            policies["append_line"],
            ApprovalPolicy::WhenArguments([("path".into(), "secrets/**".into())].into())
        );
    }

    #[test]
    fn mistakes_are_named() {
        let unknown = Config::from_toml("listn = \"x\"").unwrap_err();
        assert!(
            unknown.to_string().contains("unknown field `listn`"),
            "{unknown}"
        );
        let scope = Config::from_toml("memory_scope = \"everything\"").unwrap_err();
        assert!(
            scope.to_string().contains("expected `session` or `tenant`"),
            "{scope}"
        );
        let both =
            Config::from_toml("[[tokens]]\ntenant = \"a\"\nsha256 = \"00\"\nenv = \"X\"").unwrap();
        assert!(
            both.tokens(|_| None)
                .unwrap_err()
                .to_string()
                .contains("exactly one")
        );
        let short = Config::from_toml("[[tokens]]\ntenant = \"a\"\nsha256 = \"00\"").unwrap();
        assert!(
            short
                .tokens(|_| None)
                .unwrap_err()
                .to_string()
                .contains("64 hex digits")
        );
        let unset = Config::from_toml("[[tokens]]\ntenant = \"a\"\nenv = \"NOPE\"").unwrap();
        assert!(
            unset
                .tokens(|_| None)
                .unwrap_err()
                .to_string()
                .contains("NOPE is not set")
        );
        for (approval, expected) in [
            ("\"sometimes\"", "expected \"always\", \"never\" or a table"),
            ("{}", "expected \"always\""),
            ("{ path = 3 }", "must be a glob string"),
            ("{ path = \"[\" }", "invalid glob"),
        ] {
            let config =
                Config::from_toml(&format!("[tools.append_line]\napproval = {approval}")).unwrap();
            let error = config.approval_policies().unwrap_err().to_string();
            assert!(
                error.contains("tools.append_line.approval") && error.contains(expected),
                "{approval}: {error}"
            );
        }
        let typo = Config::from_toml("[tools.add]\napprovl = \"always\"").unwrap_err();
        assert!(
            typo.to_string().contains("unknown field `approvl`"),
            "{typo}"
        );
        let steps =
            Config::default().with_env(|k| (k == "RATCHET_MAX_STEPS").then(|| "many".into()));
        assert!(steps.unwrap_err().to_string().contains("RATCHET_MAX_STEPS"));
        let lease = Config::default().with_env(|k| (k == "RATCHET_LEASE_MS").then(|| "-1".into()));
        assert!(lease.unwrap_err().to_string().contains("RATCHET_LEASE_MS"));
    }

    #[test]
    fn inbox_settings_are_read_checked_and_default_the_rest() {
        let config: Config =
            toml::from_str("[inbox]\ncapacity = 8\nmax_wait_ms = 10\nmax_age_ms = 99\n").unwrap();
        let policy = config.inbox_policy().unwrap();
        assert_eq!(
            (policy.capacity, policy.max_wait_ms, policy.max_age_ms),
            (8, 10, 99)
        );
        assert_eq!(
            policy.max_attempts,
            ratchet_core::InboxPolicy::default().max_attempts
        );
        for zero in ["capacity", "max_attempts", "max_age_ms"] {
            let config: Config = toml::from_str(&format!("[inbox]\n{zero} = 0\n")).unwrap();
            let error = config.inbox_policy().unwrap_err().to_string();
            assert!(
                error.contains(&format!("inbox.{zero} must be at least 1")),
                "{error}"
            );
        }
        assert!(toml::from_str::<Config>("[inbox]\ncapasity = 8\n").is_err());
    }

    #[test]
    fn the_longest_wait_is_read_from_tools_wait_alone_and_defaults_to_seven_days() {
        assert_eq!(Config::default().max_wait_ms().unwrap(), 604_800_000);
        let set = Config::from_toml("[tools.wait]\nmax_ms = 3600000").unwrap();
        assert_eq!(set.max_wait_ms().unwrap(), 3_600_000);
        let zero = Config::from_toml("[tools.wait]\nmax_ms = 0").unwrap();
        let error = zero.max_wait_ms().unwrap_err().to_string();
        assert!(
            error.contains("tools.wait.max_ms must be at least 1"),
            "{error}"
        );
        let elsewhere = Config::from_toml("[tools.sleep]\nmax_ms = 10").unwrap();
        let error = elsewhere.max_wait_ms().unwrap_err().to_string();
        assert!(error.contains("only [tools.wait] takes max_ms"), "{error}");
    }

    #[test]
    fn input_bounds_are_read_checked_and_default_the_rest() {
        let (tool_result, steer) = Config::default().input_bounds().unwrap();
        assert_eq!(tool_result, 65_536);
        assert_eq!(steer, SteerLimits::default());
        let config: Config = toml::from_str(
            "[limits]\nmax_tool_result_bytes = 100\nmax_user_steers = 2\nmax_agent_steer_bytes = 9\n",
        )
        .unwrap();
        let (tool_result, steer) = config.input_bounds().unwrap();
        assert_eq!(tool_result, 100);
        assert_eq!(steer.user.max_messages, 2);
        assert_eq!(steer.user.max_bytes, SteerLimits::default().user.max_bytes);
        assert_eq!(steer.agent.max_bytes, 9);
        for zero in [
            "max_tool_result_bytes",
            "max_user_steers",
            "max_user_steer_bytes",
            "max_agent_steers",
            "max_agent_steer_bytes",
        ] {
            let config: Config = toml::from_str(&format!("[limits]\n{zero} = 0\n")).unwrap();
            let error = config.input_bounds().unwrap_err().to_string();
            assert!(
                error.contains(&format!("limits.{zero} must be at least 1")),
                "{error}"
            );
        }
    }

    #[test]
    fn webhook_settings_are_read_checked_and_default_the_rest() {
        let defaults = ratchet_webhooks::DispatcherConfig::default();
        let config: Config = toml::from_str(
            "[webhooks]\ntimeout_ms = 500\nretry_backoff_ms = 20\nmax_open_per_session = 7\n",
        )
        .unwrap();
        let dispatch = config
            .webhooks(WebhookPolicy::default())
            .unwrap()
            .expect("enabled by default");
        assert_eq!(dispatch.timeout, Duration::from_millis(500));
        assert_eq!(
            (
                dispatch.bounds.max_open_per_session,
                dispatch.bounds.max_age_ms
            ),
            (7, defaults.bounds.max_age_ms)
        );
        assert_eq!(dispatch.backoff.first_ms, 20);
        assert_eq!(dispatch.backoff.max_ms, defaults.backoff.max_ms);
        assert_eq!(
            (dispatch.poll, dispatch.concurrency),
            (defaults.poll, defaults.concurrency)
        );
        let off: Config = toml::from_str("[webhooks]\nenabled = false\n").unwrap();
        assert!(off.webhooks(WebhookPolicy::default()).unwrap().is_none());
        for zero in [
            "poll_ms",
            "timeout_ms",
            "concurrency",
            "retry_backoff_ms",
            "max_age_ms",
            "max_open_per_session",
        ] {
            let config: Config = toml::from_str(&format!("[webhooks]\n{zero} = 0\n")).unwrap();
            let error = config
                .webhooks(WebhookPolicy::default())
                .unwrap_err()
                .to_string();
            assert!(
                error.contains(&format!("webhooks.{zero} must be at least 1")),
                "{error}"
            );
        }
        let inverted: Config =
            toml::from_str("[webhooks]\nretry_backoff_ms = 100\nmax_backoff_ms = 50\n").unwrap();
        let error = inverted
            .webhooks(WebhookPolicy::default())
            .unwrap_err()
            .to_string();
        assert!(error.contains("max_backoff_ms (50)"), "{error}");
        let raised: Config = toml::from_str("[webhooks]\nretry_backoff_ms = 900000\n").unwrap();
        assert_eq!(
            raised
                .webhooks(WebhookPolicy::default())
                .unwrap()
                .unwrap()
                .backoff
                .max_ms,
            900_000,
            "a first wait above the default cap raises the cap with it"
        );
        assert!(toml::from_str::<Config>("[webhooks]\ntimeout = 5\n").is_err());
    }

    #[test]
    fn limits_are_read_checked_and_default_the_rest() {
        let defaults = Config::default().limits().unwrap();
        assert_eq!(defaults.streams, StreamLimits::default());
        assert_eq!(defaults.stream_stall, Duration::from_secs(30));
        assert_eq!(defaults.max_snippet_bytes, 2048);
        let config: Config =
            toml::from_str("[limits]\nmax_streams_per_tenant = 3\nstream_stall_ms = 250\n")
                .unwrap();
        let limits = config.limits().unwrap();
        assert_eq!(limits.streams.max_streams_per_tenant, 3);
        assert_eq!(limits.streams.max_streams, defaults.streams.max_streams);
        assert_eq!(limits.stream_stall, Duration::from_millis(250));
        for zero in [
            "max_streams",
            "max_streams_per_tenant",
            "stream_stall_ms",
            "max_snippet_bytes",
        ] {
            let config: Config = toml::from_str(&format!("[limits]\n{zero} = 0\n")).unwrap();
            let error = config.limits().unwrap_err().to_string();
            assert!(
                error.contains(&format!("limits.{zero} must be at least 1")),
                "{error}"
            );
        }
        assert!(toml::from_str::<Config>("[limits]\nmax_stream = 5\n").is_err());
        let hosts: Config =
            toml::from_str("[server]\nallowed_hosts = [\"ratchet.example\", \"*.example.org\"]\n")
                .unwrap();
        assert_eq!(
            hosts.server.allowed_hosts.as_deref(),
            Some(&["ratchet.example".to_owned(), "*.example.org".to_owned()][..])
        );
        assert!(toml::from_str::<Config>("[server]\nallowed_host = []\n").is_err());
    }

    /// F6: the empty token's hash let an empty `?access_token=` in; a short token can be
    /// guessed. Both are refused when tokens are read, and `admin` marks administrators.
    #[test]
    fn guessable_tokens_are_refused_and_administrators_are_marked() {
        let empty_hash = Config::from_toml(&format!(
            "[[tokens]]\ntenant = \"a\"\nsha256 = \"{}\"",
            hash_token("").to_uppercase()
        ))
        .unwrap();
        let error = empty_hash.tokens(|_| None).unwrap_err().to_string();
        assert!(error.contains("hash of the empty token"), "{error}");

        let by_env =
            Config::from_toml("[[tokens]]\ntenant = \"a\"\nenv = \"T\"\nadmin = true").unwrap();
        let short = by_env
            .tokens(|_| Some("fifteen-chars-x".to_owned()))
            .unwrap_err();
        assert!(
            short
                .to_string()
                .contains("has 15 characters; expected at least 16"),
            "{short}"
        );
        let spaced = by_env
            .tokens(|_| Some("sixteen chars xx".to_owned()))
            .unwrap_err();
        assert!(spaced.to_string().contains("whitespace"), "{spaced}");
        let tokens = by_env
            .tokens(|_| Some("sixteen-chars-xx".to_owned()))
            .unwrap();
        let caller = tokens.caller("sixteen-chars-xx").unwrap();
        assert!(caller.admin && caller.tenant == "a");
    }

    #[test]
    fn the_webhook_policy_is_read_from_allow_and_every_bad_entry_is_named() {
        let config: Config = toml::from_str(
            "[webhooks]\nallow = [\"10.1.0.0/16\", \"hooks.corp.internal\", \"*.lab.internal\"]\n",
        )
        .unwrap();
        let policy = config.webhook_policy(false).unwrap();
        for (url, allowed) in [
            ("http://10.1.2.3/", true),
            ("http://hooks.corp.internal/", true),
            ("http://a.lab.internal/", true),
            ("http://10.2.0.1/", false),
            ("http://127.0.0.1/", false),
        ] {
            assert_eq!(policy.check(url).is_ok(), allowed, "{url}");
        }
        let on_loopback = config.webhook_policy(true).unwrap();
        assert!(on_loopback.check("http://127.0.0.1:9000/").is_ok());
        assert_eq!(
            config
                .webhooks(on_loopback.clone())
                .unwrap()
                .unwrap()
                .policy,
            on_loopback,
            "the dispatcher checks the same policy as the API"
        );

        let bad: Config =
            toml::from_str("[webhooks]\nallow = [\"10.1.2.3/16\", \"ok.example\", \"a b\"]\n")
                .unwrap();
        let error = bad.webhook_policy(false).unwrap_err().to_string();
        assert!(
            error.contains("webhooks.allow[0] \"10.1.2.3/16\"")
                && error.contains("expected 10.1.0.0/16")
                && error.contains("webhooks.allow[2] \"a b\""),
            "{error}"
        );
        let secrets: Config =
            toml::from_str("[secrets]\nkey_file = \"/k\"\nprevious_key_files = [\"/old\"]\n")
                .unwrap();
        assert_eq!(secrets.secrets.previous_key_files, ["/old"]);
        assert!(toml::from_str::<Config>("[secrets]\nkey = \"00\"\n").is_err());
    }

    #[test]
    fn gates_and_delegation_limits_are_read_and_checked() {
        let config = Config::from_toml(
            "agents = \"agents\"\n[gates]\nmax_active_runs = 100\nmax_active_runs_per_session = 8\nmodel_calls = 4\ntool_calls_per_session = 2\n[delegation]\nmax_depth = 2\nmax_tree_runs = 40\n",
        )
        .unwrap();
        assert_eq!(config.agents.as_deref(), Some("agents"));
        let quota = config.quota().unwrap();
        assert_eq!((quota.global, quota.per_session), (Some(100), Some(8)));
        let permits = config.permits().unwrap();
        assert_eq!(
            (
                permits.model_calls,
                permits.model_calls_per_session,
                permits.tool_calls,
                permits.tool_calls_per_session
            ),
            (Some(4), None, None, Some(2))
        );
        assert_eq!(
            config.delegation,
            DelegationLimits {
                max_depth: Some(2),
                max_tree_runs: Some(40),
                ..DelegationLimits::default()
            }
        );
        assert_eq!(config.tree_budget().unwrap(), Default::default());
        let zero = Config::from_toml("[gates]\nmodel_calls_per_session = 0\n").unwrap();
        assert_eq!(
            zero.permits().unwrap_err().to_string(),
            "invalid configuration: gates.model_calls_per_session must be at least 1 (or absent for no limit), found 0"
        );
        let zero = Config::from_toml("[gates]\nmax_active_runs = 0\n").unwrap();
        assert!(zero.quota().is_err());
        let unknown = Config::from_toml("[gates]\nmodel_call = 3\n").unwrap_err();
        assert!(
            unknown.to_string().contains("unknown field `model_call`"),
            "{unknown}"
        );
    }

    #[test]
    fn the_tree_budget_is_read_in_dollars_and_tokens_and_checked() {
        let config =
            Config::from_toml("[delegation]\nmax_tree_tokens = 20000\nmax_tree_cost_usd = 0.25\n")
                .unwrap();
        assert_eq!(
            config.tree_budget().unwrap(),
            ratchet_core::TreeBudget {
                max_tokens: Some(20_000),
                max_cost_microusd: Some(250_000),
            }
        );
        let zero = Config::from_toml("[delegation]\nmax_tree_tokens = 0\n").unwrap();
        assert_eq!(
            zero.tree_budget().unwrap_err().to_string(),
            "invalid configuration: delegation.max_tree_tokens must be at least 1 (or absent for no limit), found 0"
        );
        for dollars in ["0.0", "-1.0", "nan", "inf", "0.0000001"] {
            let bad = Config::from_toml(&format!("[delegation]\nmax_tree_cost_usd = {dollars}\n"))
                .unwrap();
            let error = bad.tree_budget().unwrap_err().to_string();
            assert!(
                error.contains("delegation.max_tree_cost_usd must be a positive number"),
                "{dollars}: {error}"
            );
        }
    }

    #[test]
    fn pool_settings_come_from_the_file_and_the_environment_and_are_checked() {
        let config = Config::from_toml("workers = 4\nlease_ms = 1500\npoll_ms = 100")
            .unwrap()
            .with_env(|k| (k == "RATCHET_WORKERS").then(|| "0".into()))
            .unwrap();
        let pool = config.pool().unwrap();
        assert_eq!(pool.workers, 0, "the environment overrides the file");
        assert_eq!(pool.lease, Duration::from_millis(1500));
        assert_eq!(
            pool.heartbeat,
            Duration::from_millis(500),
            "a third of the lease"
        );
        assert_eq!(pool.poll, Duration::from_millis(100));
        let defaults = Config::default().pool().unwrap();
        assert!(defaults.heartbeat < defaults.lease && defaults.workers > 0);

        for (toml, expected) in [
            (
                "lease_ms = 50",
                "lease_ms (--lease-ms) must be at least 100",
            ),
            (
                "lease_ms = 1000\nheartbeat_ms = 1000",
                "shorter than the lease",
            ),
            (
                "heartbeat_ms = 0",
                "heartbeat_ms (--heartbeat-ms) must be at least 1",
            ),
            ("poll_ms = 0", "poll_ms (--poll-ms) must be at least 1"),
            ("workers = 100000", "workers (--workers) must be at most"),
        ] {
            let error = Config::from_toml(toml).unwrap().pool().unwrap_err();
            assert!(error.to_string().contains(expected), "{toml}: {error}");
        }
    }

    /// Numbers a TOML integer holds.
    fn count() -> impl Strategy<Value = u64> {
        0..=i64::MAX as u64
    }

    fn approval() -> impl Strategy<Value = toml::Value> {
        let glob = prop_oneof!["[a-z*?/]{0,12}", any::<String>()];
        prop_oneof![
            Just(toml::Value::from("always")),
            Just(toml::Value::from("never")),
            any::<String>().prop_map(toml::Value::from),
            any::<i64>().prop_map(toml::Value::from),
            proptest::collection::btree_map(any::<String>(), glob, 0..3).prop_map(|rules| {
                toml::Value::Table(rules.into_iter().map(|(k, v)| (k, v.into())).collect())
            }),
        ]
    }

    fn replay() -> impl Strategy<Value = ReplayPolicy> {
        prop_oneof![
            Just(ReplayPolicy::Safe),
            Just(ReplayPolicy::Keyed),
            Just(ReplayPolicy::Never)
        ]
    }

    fn token() -> impl Strategy<Value = TokenConfig> {
        let hash = prop_oneof!["[0-9a-fA-F]{64}", any::<String>()];
        let env = prop_oneof![Just("TOKEN_ONE".to_owned()), Just("UNSET".to_owned())];
        (
            prop_oneof!["[a-z]{1,8}", any::<String>()],
            proptest::option::of(hash),
            proptest::option::of(env),
            proptest::option::of(any::<bool>()),
        )
            .prop_map(|(tenant, sha256, env, admin)| TokenConfig {
                tenant,
                sha256,
                env,
                admin,
            })
    }

    fn profile() -> impl Strategy<Value = ratchet_llm::profiles::Profile> {
        (
            any::<String>(),
            any::<String>(),
            proptest::option::of(any::<String>()),
            proptest::option::of(count()),
            proptest::option::of(any::<u32>()),
            proptest::option::of((0.0f64..1000.0, 0.0f64..1000.0)),
        )
            .prop_map(|(provider, model, base_url, read, retries, prices)| {
                ratchet_llm::profiles::Profile {
                    provider,
                    model,
                    base_url,
                    api_key_env: None,
                    connect_timeout_ms: None,
                    read_timeout_ms: read,
                    max_retries: retries,
                    stream: None,
                    max_output_tokens: None,
                    prices: prices.map(|(input_per_mtok, output_per_mtok)| ratchet_core::Prices {
                        input_per_mtok,
                        output_per_mtok,
                        ..ratchet_core::Prices::default()
                    }),
                }
            })
    }

    fn mcp_server() -> impl Strategy<Value = ratchet_mcp::ServerConfig> {
        (
            proptest::option::of(any::<String>()),
            proptest::collection::vec(any::<String>(), 0..3),
            proptest::option::of(any::<String>()),
            proptest::option::of(count()),
        )
            .prop_map(
                |(command, args, url, timeout_ms)| ratchet_mcp::ServerConfig {
                    command,
                    args,
                    url,
                    timeout_ms,
                    ..Default::default()
                },
            )
    }

    /// A whole configuration, every field possibly set, valid or not beyond its types.
    fn config() -> impl Strategy<Value = Config> {
        let text = || proptest::option::of(any::<String>());
        let number = || proptest::option::of(count());
        let small = || proptest::option::of(0u64..5000);
        let scope = proptest::option::of(prop_oneof![
            Just(MemoryScope::Session),
            Just(MemoryScope::Tenant)
        ]);
        let tool = (
            proptest::option::of(approval()),
            proptest::option::of(replay()),
            small(),
            proptest::option::of(0u32..5),
            small(),
        )
            .prop_map(
                |(approval, replay, timeout_ms, max_attempts, max_ms)| ToolConfig {
                    approval,
                    replay,
                    timeout_ms,
                    max_attempts,
                    max_ms,
                },
            );
        (
            (text(), text(), text(), text()),
            (number(), number(), number(), number(), number(), number()),
            (scope, small(), small(), small(), small(), small()),
            (
                proptest::collection::vec(token(), 0..3),
                proptest::collection::btree_map(any::<String>(), tool, 0..3),
                proptest::collection::btree_map(any::<String>(), profile(), 0..2),
                proptest::collection::btree_map(any::<String>(), mcp_server(), 0..2),
            ),
        )
            .prop_map(
                |(
                    (listen, db, model, workspace),
                    (
                        max_steps,
                        max_model_calls,
                        max_tool_calls,
                        max_tokens,
                        max_prompt_tokens,
                        max_duration_ms,
                    ),
                    (memory_scope, workers, lease_ms, heartbeat_ms, poll_ms, cancel_grace_ms),
                    (tokens, tools, models, servers),
                )| Config {
                    listen,
                    db,
                    model,
                    workspace,
                    max_steps,
                    max_model_calls,
                    max_tool_calls,
                    max_tokens,
                    max_prompt_tokens,
                    max_duration_ms,
                    memory_scope,
                    workers,
                    lease_ms,
                    heartbeat_ms,
                    poll_ms,
                    cancel_grace_ms,
                    tokens,
                    tools,
                    models,
                    mcp: ratchet_mcp::Config { servers },
                    agents: None,
                    gates: GatesConfig::default(),
                    delegation: DelegationLimits::default(),
                    inbox: InboxSettings::default(),
                    webhooks: WebhookSettings::default(),
                    limits: LimitSettings::default(),
                    server: ServerSettings::default(),
                    secrets: SecretsSettings::default(),
                    api: ApiSettings::default(),
                },
            )
    }

    /// `config` as a `ratchet.toml`, written with the TOML library's own serializer so that
    /// any string is quoted and escaped as TOML requires.
    fn to_toml(config: &Config) -> String {
        fn put<T: Into<toml::Value>>(table: &mut toml::Table, key: &str, value: Option<T>) {
            if let Some(value) = value {
                table.insert(key.to_owned(), value.into());
            }
        }
        let int = |n: Option<u64>| n.map(|n| i64::try_from(n).unwrap());
        let mut root = toml::Table::new();
        put(&mut root, "listen", config.listen.clone());
        put(&mut root, "db", config.db.clone());
        put(&mut root, "model", config.model.clone());
        put(&mut root, "workspace", config.workspace.clone());
        for (key, value) in [
            ("max_steps", config.max_steps),
            ("max_model_calls", config.max_model_calls),
            ("max_tool_calls", config.max_tool_calls),
            ("max_tokens", config.max_tokens),
            ("max_prompt_tokens", config.max_prompt_tokens),
            ("max_duration_ms", config.max_duration_ms),
            ("workers", config.workers),
            ("lease_ms", config.lease_ms),
            ("heartbeat_ms", config.heartbeat_ms),
            ("poll_ms", config.poll_ms),
            ("cancel_grace_ms", config.cancel_grace_ms),
        ] {
            put(&mut root, key, int(value));
        }
        put(
            &mut root,
            "memory_scope",
            config.memory_scope.map(|s| s.as_str()),
        );
        let tokens: Vec<toml::Value> = (config.tokens.iter())
            .map(|token| {
                let mut table = toml::Table::new();
                put(&mut table, "tenant", Some(token.tenant.clone()));
                put(&mut table, "sha256", token.sha256.clone());
                put(&mut table, "env", token.env.clone());
                put(&mut table, "admin", token.admin);
                table.into()
            })
            .collect();
        if !tokens.is_empty() {
            root.insert("tokens".into(), tokens.into());
        }
        let mut tools = toml::Table::new();
        for (name, tool) in &config.tools {
            let mut table = toml::Table::new();
            put(&mut table, "approval", tool.approval.clone());
            put(&mut table, "replay", tool.replay.map(|r| r.as_str()));
            put(&mut table, "timeout_ms", int(tool.timeout_ms));
            put(&mut table, "max_attempts", tool.max_attempts.map(i64::from));
            put(&mut table, "max_ms", int(tool.max_ms));
            tools.insert(name.clone(), table.into());
        }
        root.insert("tools".into(), tools.into());
        let mut models = toml::Table::new();
        for (name, profile) in &config.models {
            let mut table = toml::Table::new();
            put(&mut table, "provider", Some(profile.provider.clone()));
            put(&mut table, "model", Some(profile.model.clone()));
            put(&mut table, "base_url", profile.base_url.clone());
            put(&mut table, "read_timeout_ms", int(profile.read_timeout_ms));
            put(
                &mut table,
                "max_retries",
                profile.max_retries.map(i64::from),
            );
            if let Some(prices) = profile.prices {
                let mut price = toml::Table::new();
                put(&mut price, "input_per_mtok", Some(prices.input_per_mtok));
                put(&mut price, "output_per_mtok", Some(prices.output_per_mtok));
                table.insert("prices".into(), price.into());
            }
            models.insert(name.clone(), table.into());
        }
        root.insert("models".into(), models.into());
        let mut servers = toml::Table::new();
        for (name, server) in &config.mcp.servers {
            let mut table = toml::Table::new();
            put(&mut table, "command", server.command.clone());
            put(&mut table, "args", Some(server.args.clone()));
            put(&mut table, "url", server.url.clone());
            put(&mut table, "timeout_ms", int(server.timeout_ms));
            servers.insert(name.clone(), table.into());
        }
        let mut mcp = toml::Table::new();
        mcp.insert("servers".into(), servers.into());
        root.insert("mcp".into(), mcp.into());
        toml::to_string(&root).unwrap()
    }

    /// One edit of a document at a char position taken modulo its length.
    fn mutate(text: &str, edits: &[(usize, usize, String)]) -> String {
        let mut chars: Vec<char> = text.chars().collect();
        for (at, delete, insert) in edits {
            let start = at % (chars.len() + 1);
            let end = (start + delete).min(chars.len());
            chars.splice(start..end, insert.chars());
        }
        chars.into_iter().collect()
    }

    fn edit() -> impl Strategy<Value = (usize, usize, String)> {
        let insert = prop_oneof![
            Just(String::new()),
            Just("[".to_owned()),
            Just("]]".to_owned()),
            Just("\"".to_owned()),
            Just("=".to_owned()),
            Just("\n".to_owned()),
            Just("-1".to_owned()),
            Just("99999999999999999999".to_owned()),
            Just("inf".to_owned()),
            Just("{ path = \"[\" }".to_owned()),
            any::<String>(),
        ];
        (any::<usize>(), 0usize..6, insert)
    }

    /// What an error says beyond its kind.
    fn reason(error: &ConfigError) -> &str {
        match error {
            ConfigError::Read { reason, .. } | ConfigError::Invalid(reason) => reason,
        }
    }

    /// Whatever a file said, the checks that follow loading never panic, and an error says why.
    fn checks_hold(config: Config) {
        let env = |key: &str| (key == "TOKEN_ONE").then(|| "one".to_owned());
        let named = |error: ConfigError| assert!(!reason(&error).trim().is_empty(), "{error:?}");
        if let Err(error) = config.clone().with_env(env) {
            named(error);
        }
        match config.pool() {
            Ok(pool) => {
                assert!(pool.lease >= Duration::from_millis(MIN_LEASE_MS));
                assert!(!pool.heartbeat.is_zero() && pool.heartbeat < pool.lease);
                assert!(!pool.poll.is_zero() && pool.workers as u64 <= MAX_WORKERS);
            }
            Err(error) => named(error),
        }
        match config.approval_policies() {
            Ok(policies) => {
                for policy in policies.values() {
                    assert!(policy.validate().is_ok(), "{policy:?}");
                }
            }
            Err(error) => named(error),
        }
        if let Err(error) = config.tokens(env) {
            named(error);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn any_text_is_a_configuration_or_a_reason(text in any::<String>()) {
            match Config::from_toml(&text) {
                Ok(config) => checks_hold(config),
                Err(error) => prop_assert!(!reason(&error).trim().is_empty()),
            }
        }

        /// A written configuration reads back as exactly what was written.
        #[test]
        fn a_written_configuration_reads_back_the_same(config in config()) {
            let text = to_toml(&config);
            let read = Config::from_toml(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
            prop_assert_eq!(&read, &config);
            checks_hold(read);
        }

        #[test]
        fn a_damaged_configuration_is_read_or_refused_with_a_reason(
            config in config(),
            edits in proptest::collection::vec(edit(), 1..4),
        ) {
            match Config::from_toml(&mutate(&to_toml(&config), &edits)) {
                Ok(config) => checks_hold(config),
                Err(error) => prop_assert!(!reason(&error).trim().is_empty()),
            }
        }

        /// Each `RATCHET_*` variable replaces the file's value; a number that is not one is
        /// refused, naming the variable and the value.
        #[test]
        fn the_environment_overrides_the_file(
            config in config(),
            env in proptest::collection::btree_map(
                proptest::sample::select(vec![
                    "RATCHET_LISTEN", "RATCHET_DB", "RATCHET_MODEL", "RATCHET_WORKSPACE",
                    "RATCHET_MAX_STEPS", "RATCHET_WORKERS", "RATCHET_LEASE_MS",
                    "RATCHET_HEARTBEAT_MS", "RATCHET_POLL_MS", "RATCHET_OTHER",
                ]),
                prop_oneof![count().prop_map(|n| n.to_string()), any::<String>()],
                0..5,
            ),
        ) {
            let overlaid = config.clone().with_env(|key| env.get(key).cloned());
            let numbers = ["RATCHET_MAX_STEPS", "RATCHET_WORKERS", "RATCHET_LEASE_MS", "RATCHET_HEARTBEAT_MS", "RATCHET_POLL_MS"];
            let refused: Vec<_> = env.iter()
                .filter(|(key, value)| numbers.contains(key) && value.parse::<u64>().is_err())
                .collect();
            let overlaid = match (overlaid, refused.is_empty()) {
                (Err(error), false) => {
                    let message = error.to_string();
                    let named = refused.iter().any(|(key, value)| {
                        message.contains(*key) && message.contains(&format!("{value:?}"))
                    });
                    prop_assert!(named, "{} names none of {:?}", message, refused);
                    return Ok(());
                }
                (Ok(overlaid), true) => overlaid,
                (result, refused) => {
                    return Err(TestCaseError::fail(format!("{result:?} for {refused:?}")));
                }
            };
            let text = |key: &str, file: &Option<String>| env.get(key).cloned().or_else(|| file.clone());
            let number = |key: &str, file: Option<u64>| env.get(key).map(|v| v.parse().unwrap()).or(file);
            let expected = Config {
                listen: text("RATCHET_LISTEN", &config.listen),
                db: text("RATCHET_DB", &config.db),
                model: text("RATCHET_MODEL", &config.model),
                workspace: text("RATCHET_WORKSPACE", &config.workspace),
                max_steps: number("RATCHET_MAX_STEPS", config.max_steps),
                workers: number("RATCHET_WORKERS", config.workers),
                lease_ms: number("RATCHET_LEASE_MS", config.lease_ms),
                heartbeat_ms: number("RATCHET_HEARTBEAT_MS", config.heartbeat_ms),
                poll_ms: number("RATCHET_POLL_MS", config.poll_ms),
                ..config.clone()
            };
            prop_assert_eq!(overlaid, expected);
        }
    }
}
