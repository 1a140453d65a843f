//! `AgentState`, the single truth of a run, and the frozen configuration it runs under.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::approval::{ApprovalCall, ApprovalPolicy};
use crate::delegation::{AgentRef, DelegationConfig, Lineage, ToolDelegation};
use crate::{ApprovalId, Millis, RunId, RunStatus, SessionId, StopReason, ToolCall, ToolOutcome};

/// What may happen when a tool call has an intent but no result after a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplayPolicy {
    /// Read-only or naturally idempotent: simply run it again.
    Safe,
    /// Run it again with the same idempotency key; the tool deduplicates.
    Keyed,
    /// Never run it again automatically: a human reconciles the unknown outcome.
    Never,
}

impl ReplayPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            ReplayPolicy::Safe => "safe",
            ReplayPolicy::Keyed => "keyed",
            ReplayPolicy::Never => "never",
        }
    }
}

/// A tool as frozen into a run's configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    pub parameters: Value,
    pub replay: ReplayPolicy,
    /// A successful call of this tool ends the run as completed.
    #[serde(default)]
    pub completes_run: bool,
    /// When a call of this tool waits for a human before its batch runs.
    #[serde(default)]
    pub approval: ApprovalPolicy,
    /// Whether child runs may be offered this tool.
    #[serde(default)]
    pub delegation: ToolDelegation,
    /// How long one call may take, and how often a call with an unknown outcome is tried.
    #[serde(default)]
    pub calls: crate::CallLimits,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Hard cap on committed steps; the last model call before it is made without tools.
    pub max_steps: u64,
    pub max_consecutive_parse_failures: u32,
    /// How many calls of one batch may run at once (1 = serial).
    pub max_parallel: u32,
    /// Attempts of one model call before the run fails with `llm_error`.
    pub max_model_attempts: u32,
    /// Model calls a run may make; the last one is made without tools.
    #[serde(default)]
    pub max_model_calls: Option<u64>,
    /// Tool calls a run may make: once reached, the model is offered no more tools (a batch
    /// asked for below the limit still runs whole).
    #[serde(default)]
    pub max_tool_calls: Option<u64>,
    /// Model tokens (input and output) a run may spend: once reached, no model call is made.
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// Estimated tokens one prompt may hold: a longer one is compacted first (its older turns
    /// summarised by the model).
    #[serde(default)]
    pub max_prompt_tokens: Option<u64>,
    /// Wall-clock time from the run's start (time paused not counted): a hard deadline. Past
    /// it nothing new starts, the step in flight is cut off, and the run ends `timed_out`.
    #[serde(default)]
    pub max_duration_ms: Option<u64>,
    /// Bytes of one tool result (and of one child's answer) the model is shown; the rest is
    /// cut from its view, never from the store. Configs frozen before it existed read 64 KiB.
    #[serde(default = "default_max_tool_result_bytes")]
    pub max_tool_result_bytes: u64,
    /// The longest one `wait` call may park the run (`[tools.wait] max_ms`). Configs frozen
    /// before it existed read seven days.
    #[serde(default = "default_max_wait_ms")]
    pub max_wait_ms: u64,
}

fn default_max_tool_result_bytes() -> u64 {
    crate::bounds::DEFAULT_MAX_TOOL_RESULT_BYTES
}

fn default_max_wait_ms() -> u64 {
    crate::timer::DEFAULT_MAX_WAIT_MS
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_steps: 50,
            max_consecutive_parse_failures: 3,
            max_parallel: 4,
            max_model_attempts: 3,
            max_model_calls: None,
            max_tool_calls: None,
            max_tokens: None,
            max_prompt_tokens: None,
            max_duration_ms: None,
            max_tool_result_bytes: crate::bounds::DEFAULT_MAX_TOOL_RESULT_BYTES,
            max_wait_ms: crate::timer::DEFAULT_MAX_WAIT_MS,
        }
    }
}

/// Which history the `memory_search` tool of a run looks through.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryScope {
    /// The run's own session: every earlier run of it, and this one so far.
    #[default]
    Session,
    /// Every session of the session's tenant.
    Tenant,
}

impl MemoryScope {
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryScope::Session => "session",
            MemoryScope::Tenant => "tenant",
        }
    }
}

/// Prices of a model, in US dollars per million tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prices {
    pub input_per_mtok: f64,
    pub output_per_mtok: f64,
    /// Prompt tokens written to the provider's prompt cache; without it, what Anthropic
    /// charges for five-minute cache writes: `CACHE_WRITE_MULTIPLIER` × `input_per_mtok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write_per_mtok: Option<f64>,
    /// Prompt tokens read from the provider's prompt cache; without it, what Anthropic
    /// charges for cache hits: `CACHE_READ_MULTIPLIER` × `input_per_mtok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read_per_mtok: Option<f64>,
}

impl Prices {
    /// Anthropic's price of a cache write, as a multiple of the input price.
    pub const CACHE_WRITE_MULTIPLIER: f64 = 1.25;
    /// Anthropic's price of a cache read, as a multiple of the input price.
    pub const CACHE_READ_MULTIPLIER: f64 = 0.1;

    /// What `usage` cost, in millionths of a dollar: tokens times dollars per million tokens,
    /// each part of the prompt at its own price (uncached, written to the cache, read from it).
    pub fn cost_microusd(&self, usage: crate::Usage) -> u64 {
        let cache_write = self
            .cache_write_per_mtok
            .unwrap_or(self.input_per_mtok * Prices::CACHE_WRITE_MULTIPLIER);
        let cache_read = self
            .cache_read_per_mtok
            .unwrap_or(self.input_per_mtok * Prices::CACHE_READ_MULTIPLIER);
        let uncached = usage
            .input_tokens
            .saturating_sub(usage.cache_write_tokens)
            .saturating_sub(usage.cache_read_tokens);
        let cost = uncached as f64 * self.input_per_mtok
            + usage.cache_write_tokens as f64 * cache_write
            + usage.cache_read_tokens as f64 * cache_read
            + usage.output_tokens as f64 * self.output_per_mtok;
        cost.round().max(0.0) as u64
    }

    /// Every price given, for checking that each is finite and not negative.
    pub fn all(&self) -> impl Iterator<Item = f64> {
        [self.input_per_mtok, self.output_per_mtok]
            .into_iter()
            .chain(self.cache_write_per_mtok)
            .chain(self.cache_read_per_mtok)
    }
}

/// How to reach a model provider, frozen into a run with everything but the key itself: the
/// key is read from `api_key_env` by the process that makes the call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSettings {
    /// The wire protocol: `openai` (chat completions, any compatible server) or `anthropic`
    /// (Messages).
    pub provider: String,
    pub base_url: String,
    /// The provider's model name.
    pub model: String,
    pub api_key_env: Option<String>,
    pub connect_timeout_ms: u64,
    /// Longest silence allowed while waiting for (more of) an answer.
    pub read_timeout_ms: u64,
    /// Stream answers (server-sent events); false for servers that cannot.
    pub stream: bool,
    /// The most tokens one answer may generate (required by some providers).
    pub max_output_tokens: Option<u32>,
    pub prices: Option<Prices>,
}

/// Everything a run needs to execute, frozen when the run is created and never written again:
/// `resume` in another process needs nothing else.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunConfigSnapshot {
    /// Model spec, for example `scripted:demo`, `scripted:/path/to/script.json`,
    /// `openai:gpt-4o-mini` or a profile's name.
    pub model: String,
    /// How to reach the model, for a provider's model; None for a scripted one.
    #[serde(default)]
    pub model_settings: Option<ModelSettings>,
    /// Directory that file tools are confined to.
    pub workspace: Option<String>,
    pub system_prompt: String,
    pub tools: Vec<ToolSpec>,
    pub limits: Limits,
    /// What `memory_search` searches (configs frozen before it existed read as `session`).
    #[serde(default)]
    pub memory_scope: MemoryScope,
    /// The catalog definition this run was started from, when it was started from one.
    #[serde(default)]
    pub agent: Option<AgentRef>,
    /// What this run may hand to other agents.
    #[serde(default)]
    pub delegation: DelegationConfig,
    /// What this run may report while it runs in the background (`emit_signal`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<crate::inbox::SignalContract>,
    /// What the run must have done before it may complete.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion: Option<crate::CompletionCriteria>,
    /// A continuation turn: the runtime started it to report background work back; its
    /// messages are marked `continuation`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub continuation: bool,
    /// How much steering may wait for this run's next model call, per lane.
    #[serde(default)]
    pub steer: crate::bounds::SteerLimits,
}

impl RunConfigSnapshot {
    pub fn tool(&self, name: &str) -> Option<&ToolSpec> {
        self.tools.iter().find(|t| t.name == name)
    }
}

/// One call of the current batch and, once known, its outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallProgress {
    pub call: ToolCall,
    pub outcome: Option<ToolOutcome>,
    /// A human answered `retry` for this call: it runs against the tool as this process has
    /// it, even when that tool changed since the model was offered it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rerun_approved: bool,
}

/// The tool batch the model asked for, in the model's order. Outcomes are filled in as the
/// batch runs and are always returned to the model in this order.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolCheckpoint {
    pub calls: Vec<CallProgress>,
    /// A human has answered the batch's approval: its gate is open.
    #[serde(default)]
    pub approved: bool,
    /// The step that follows the model call which asked for the batch: the step its calls'
    /// idempotency keys name, however many steps the batch takes (a wait for a human, a
    /// takeover), so a `keyed` call is never sent under a second key. None for a batch from
    /// before this was recorded: its keys name the step that runs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_step: Option<u64>,
    /// The run whose id the calls' idempotency keys name, when not the run that holds the
    /// batch: a fork takes up its source's pending batch under the source's keys, so a `keyed`
    /// tool does the work once across both. None: the holder's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_run: Option<crate::RunId>,
    /// The run ended before the batch's results were handed to the model (its deadline cut
    /// the batch off, or passed while a human was asked about it): a continued run carries the
    /// batch on from here rather than calling the model.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cut_off: bool,
    /// When the model asked for the batch: the last time it looked at the conversation. None
    /// for a batch from before this was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub asked_at: Option<crate::Millis>,
}

impl ToolCheckpoint {
    /// The idempotency key of the call at `slot` of this batch, run in step `step_index`:
    /// `{run}#{step}#{slot}`, the step being the batch's first.
    pub fn idempotency_key(&self, run_id: &crate::RunId, step_index: u64, slot: u32) -> String {
        let step = self.key_step.unwrap_or(step_index);
        let run_id = self.key_run.as_ref().unwrap_or(run_id);
        format!("{run_id}#{step}#{slot}")
    }

    pub fn new(calls: Vec<ToolCall>) -> Self {
        ToolCheckpoint {
            key_step: None,
            key_run: None,
            cut_off: false,
            asked_at: None,
            calls: calls
                .into_iter()
                .map(|call| CallProgress {
                    rerun_approved: false,
                    call,
                    outcome: None,
                })
                .collect(),
            approved: false,
        }
    }

    pub fn has_pending(&self) -> bool {
        self.calls.iter().any(|c| c.outcome.is_none())
    }
}

/// A question the run is waiting on a human for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum HumanRequest {
    /// `never`-replay calls were started but their outcomes are unknown (the process died):
    /// an operator must say what happened to each before the run can go on.
    Reconciliation { calls: Vec<UnknownCall> },
    /// A call of the batch needs a human's approval: no call of the batch runs until every
    /// call that needs it is decided.
    Approval {
        approval_id: ApprovalId,
        calls: Vec<ApprovalCall>,
    },
}

impl HumanRequest {
    /// The approval asked for, with the calls it gates; None for a reconciliation.
    pub fn approval(&self) -> Option<(&ApprovalId, &[ApprovalCall])> {
        match self {
            HumanRequest::Approval { approval_id, calls } => Some((approval_id, calls)),
            HumanRequest::Reconciliation { .. } => None,
        }
    }
}

/// A started call whose outcome nobody knows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnknownCall {
    /// The call's position in its batch.
    pub call_index: usize,
    pub call_id: String,
    pub tool: String,
    pub arguments: Value,
    /// The key the call was started with, for looking its effect up on the other side.
    pub idempotency_key: String,
    /// Set when the call has not run at all but its tool changed since the model was offered
    /// it (gone from this process, or a different argument schema): why a human is asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drift: Option<String>,
}

/// Budget a human added to a failed run when continuing it. The frozen config keeps the
/// limits the run started with; the Brain spends the sum.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetExtension {
    pub steps: u64,
    pub model_calls: u64,
    pub tool_calls: u64,
    pub tokens: u64,
    #[serde(default)]
    pub duration_ms: u64,
}

/// Where a paused run stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pause {
    /// Why the job the pause took away would have woken the run; resuming gives it back.
    pub next: crate::step::Phase,
    pub since: Millis,
}

/// A budget of a run: what it counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetKind {
    Steps,
    ModelCalls,
    ToolCalls,
    /// Input and output tokens together.
    Tokens,
    /// The prompt the next model call sends (compaction keeps it under).
    PromptTokens,
    /// Time running, pauses left out.
    DurationMs,
}

/// How much of one budget a run has used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetUse {
    pub kind: BudgetKind,
    pub used: u64,
    pub limit: u64,
}

impl BudgetUse {
    pub fn spent(&self) -> bool {
        self.used >= self.limit
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    pub model_calls: u64,
    pub tool_calls: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub consecutive_parse_failures: u32,
    /// Estimated size, in tokens, of the prompt the next model call sends.
    #[serde(default)]
    pub context_tokens: u64,
    #[serde(default)]
    pub reasoning_tokens: u64,
    /// The part of `input_tokens` written to the provider's prompt cache.
    #[serde(default)]
    pub cache_write_tokens: u64,
    /// The part of `input_tokens` read from the provider's prompt cache.
    #[serde(default)]
    pub cache_read_tokens: u64,
    /// What the model calls cost, in millionths of a dollar, when the model has prices.
    #[serde(default)]
    pub cost_microusd: u64,
}

/// The state of one run. Only the Coordinator writes it, one committed step at a time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentState {
    pub session_id: SessionId,
    pub run_id: RunId,
    pub status: RunStatus,
    /// The last committed step; the next job must be `step_index + 1`.
    pub step_index: u64,
    /// Stored once at creation, outside the mutable state; adapters fill it in on load.
    #[serde(skip)]
    pub config: Arc<RunConfigSnapshot>,
    /// Owned by the store (a cancel request may arrive while a step is in flight); adapters
    /// fill it in on load and never take it from a committed state.
    #[serde(skip)]
    pub cancel_requested: bool,
    /// Owned by the store like `cancel_requested`: a pause asked for while a step is in
    /// flight, which the step's commit honours.
    #[serde(skip)]
    pub pause_requested: bool,
    pub stop_reason: Option<StopReason>,
    /// Set when the step budget is nearly spent: the next model call is made without tools.
    pub force_finish: bool,
    pub checkpoint: Option<ToolCheckpoint>,
    pub pending_human: Option<HumanRequest>,
    pub counters: Counters,
    /// Budget added by `continue`, on top of the frozen limits.
    #[serde(default)]
    pub extension: BudgetExtension,
    /// The last step compacted the context: another compaction would not help.
    #[serde(default)]
    pub just_compacted: bool,
    /// The last assistant text, so that a finished run can answer without reading history.
    pub final_answer: Option<String>,
    /// Where a child run stands in its tree; None for a run a user started.
    #[serde(default)]
    pub lineage: Option<Lineage>,
    /// The trace a caller or a delegating call put the run in; None for a run that starts a
    /// trace of its own (see `trace`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<crate::trace::TraceContext>,
    /// The run and step this run was forked from; None for a run that was not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<crate::ForkedFrom>,
    /// Set while the run is `paused`: the job it takes up again when resumed.
    #[serde(default)]
    pub pause: Option<Pause>,
    /// Time spent paused, which the duration budget does not count.
    #[serde(default)]
    pub paused_ms: u64,
    /// The `wait` the run is parked on (`waiting_timer`, or paused while it waited), with its
    /// due time frozen when it parked; None otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timer: Option<crate::timer::Timer>,
    /// Where the run stands with its completion criteria (not stored while untouched: most
    /// runs have none, and every step writes the state).
    #[serde(
        default,
        skip_serializing_if = "crate::CompletionProgress::is_untouched"
    )]
    pub completion: crate::CompletionProgress,
    /// `never` calls cut off when the run ended (a deadline, a cancel): nobody knows whether
    /// they took effect. A human may still record what happened (`step::reconcile`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub in_doubt: Vec<UnknownCall>,
    /// The schedule and slot that fired the run; None for a run a message or a delegation
    /// started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<crate::ScheduledSlot>,
    pub created_at: Millis,
    pub started_at: Option<Millis>,
    pub finished_at: Option<Millis>,
}

impl AgentState {
    /// The limits the Brain enforces: the frozen ones plus any extension.
    pub fn limits(&self) -> Limits {
        let frozen = self.config.limits;
        let extension = self.extension;
        Limits {
            max_steps: frozen.max_steps.saturating_add(extension.steps),
            max_model_calls: frozen
                .max_model_calls
                .map(|m| m.saturating_add(extension.model_calls)),
            max_tool_calls: frozen
                .max_tool_calls
                .map(|m| m.saturating_add(extension.tool_calls)),
            max_tokens: frozen
                .max_tokens
                .map(|m| m.saturating_add(extension.tokens)),
            max_duration_ms: frozen
                .max_duration_ms
                .map(|m| m.saturating_add(extension.duration_ms)),
            ..frozen
        }
    }

    /// When the run's duration budget runs out: its start plus `max_duration_ms` plus the
    /// time it spent paused (a client's time, not the run's). None without a budget or before
    /// the run started.
    /// Each budget the run has, with what it has used of it: a person reads which one ran out,
    /// and by how much, before giving it more. Time paused is not counted; a run still going
    /// counts up to `now`.
    pub fn budgets(&self, now: Millis) -> Vec<BudgetUse> {
        let limits = self.limits();
        let counters = &self.counters;
        let elapsed = self.started_at.map(|started| {
            let until = self.finished_at.unwrap_or(now);
            u64::try_from(until.saturating_sub(started))
                .unwrap_or(0)
                .saturating_sub(self.paused_ms)
        });
        let mut budgets = vec![BudgetUse {
            kind: BudgetKind::Steps,
            used: self.step_index,
            limit: limits.max_steps,
        }];
        let optional = [
            (
                BudgetKind::ModelCalls,
                Some(counters.model_calls),
                limits.max_model_calls,
            ),
            (
                BudgetKind::ToolCalls,
                Some(counters.tool_calls),
                limits.max_tool_calls,
            ),
            (
                BudgetKind::Tokens,
                Some(counters.input_tokens.saturating_add(counters.output_tokens)),
                limits.max_tokens,
            ),
            (
                BudgetKind::PromptTokens,
                Some(counters.context_tokens),
                limits.max_prompt_tokens,
            ),
            (BudgetKind::DurationMs, elapsed, limits.max_duration_ms),
        ];
        budgets.extend(optional.into_iter().filter_map(|(kind, used, limit)| {
            Some(BudgetUse {
                kind,
                used: used.unwrap_or(0),
                limit: limit?,
            })
        }));
        budgets
    }

    pub fn deadline(&self) -> Option<Millis> {
        let (duration, started) = self.limits().max_duration_ms.zip(self.started_at)?;
        let allowed = duration.saturating_add(self.paused_ms);
        Some(started.saturating_add(Millis::try_from(allowed).unwrap_or(Millis::MAX)))
    }

    pub fn new(
        session_id: SessionId,
        run_id: RunId,
        config: RunConfigSnapshot,
        now: Millis,
    ) -> AgentState {
        AgentState {
            session_id,
            run_id,
            status: RunStatus::Queued,
            step_index: 0,
            config: Arc::new(config),
            cancel_requested: false,
            pause_requested: false,
            stop_reason: None,
            force_finish: false,
            checkpoint: None,
            pending_human: None,
            counters: Counters::default(),
            extension: BudgetExtension::default(),
            just_compacted: false,
            final_answer: None,
            lineage: None,
            trace: None,
            forked_from: None,
            pause: None,
            paused_ms: 0,
            timer: None,
            completion: crate::CompletionProgress::default(),
            in_doubt: Vec::new(),
            schedule: None,
            created_at: now,
            started_at: None,
            finished_at: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_prompt_tokens_cost_their_own_price_or_anthropics_multiple_of_the_input() {
        let usage = crate::Usage {
            input_tokens: 1_000_000,
            output_tokens: 100_000,
            cache_write_tokens: 200_000,
            cache_read_tokens: 500_000,
            ..crate::Usage::default()
        };
        let defaults = Prices {
            input_per_mtok: 3.0,
            output_per_mtok: 15.0,
            ..Prices::default()
        };
        // 0.3 M uncached × $3 + 0.2 M written × $3.75 + 0.5 M read × $0.30 + 0.1 M × $15
        assert_eq!(
            defaults.cost_microusd(usage),
            900_000 + 750_000 + 150_000 + 1_500_000
        );
        let own = Prices {
            cache_write_per_mtok: Some(6.0),
            cache_read_per_mtok: Some(0.0),
            ..defaults
        };
        assert_eq!(own.cost_microusd(usage), 900_000 + 1_200_000 + 1_500_000);
        // Without cached tokens, the prompt is all at the input price, as before.
        let plain = crate::Usage {
            input_tokens: 1_000,
            output_tokens: 10,
            ..crate::Usage::default()
        };
        assert_eq!(defaults.cost_microusd(plain), 3_000 + 150);
        // Counts a provider got wrong (more cached than the prompt) never go below zero.
        let odd = crate::Usage {
            input_tokens: 10,
            cache_read_tokens: 1_000_000,
            ..crate::Usage::default()
        };
        assert_eq!(defaults.cost_microusd(odd), 300_000);
    }

    /// Every budget a run has is reported with what it used, extensions included; the
    /// optional ones only when set, and the time budget without the time paused.
    #[test]
    fn a_runs_budgets_say_what_each_allows_and_what_was_used() {
        let mut config = RunConfigSnapshot::default();
        config.limits.max_steps = 3;
        config.limits.max_tokens = Some(100);
        config.limits.max_duration_ms = Some(60_000);
        let mut state = AgentState::new(
            SessionId::from_suffix("s").unwrap(),
            RunId::from_suffix("r").unwrap(),
            config,
            0,
        );
        state.step_index = 3;
        state.counters.input_tokens = 70;
        state.counters.output_tokens = 10;
        state.extension.tokens = 50;
        state.started_at = Some(1_000);
        state.paused_ms = 4_000;
        let running = state.budgets(11_000);
        assert_eq!(
            running,
            [
                BudgetUse {
                    kind: BudgetKind::Steps,
                    used: 3,
                    limit: 3
                },
                BudgetUse {
                    kind: BudgetKind::Tokens,
                    used: 80,
                    limit: 150
                },
                BudgetUse {
                    kind: BudgetKind::DurationMs,
                    used: 6_000,
                    limit: 60_000
                },
            ]
        );
        assert_eq!(
            running
                .iter()
                .filter(|b| b.spent())
                .map(|b| b.kind)
                .collect::<Vec<_>>(),
            [BudgetKind::Steps]
        );
        state.finished_at = Some(9_000);
        assert_eq!(
            state.budgets(99_000)[2].used,
            4_000,
            "an ended run stops counting"
        );
    }
}
