//! Steps: the job that wakes a run, the result a step commits, and the pure functions that
//! turn an executed instruction into that result.
//!
//! The engine performs the I/O of one instruction and hands its outcome to one of these
//! functions; they update the state, build the messages and events, and ask the Brain
//! whether the run goes on (a next job) or ends in this same step.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::{
    AgentState, BudgetExtension, EventDraft, EventKind, HumanRequest, Instruction, Message, Millis,
    ReplayPolicy, RunId, RunStatus, StopReason, ToolCall, ToolCheckpoint, ToolOutcome, decide,
};

/// Why a job woke its run up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    UserInput,
    LlmResult,
    ToolsBatchResult,
    /// A human answered the run's pending request; the batch goes on from its checkpoint.
    HumanDecided,
    Cancel,
    /// A failed run was continued or retried: it carries on the batch its deadline cut off,
    /// if any, else calls the model again.
    Resumed,
    /// The context was compacted: the model is called with the shorter prompt.
    ContextCompacted,
    /// Every child of the run's delegation has ended: the batch goes on with their results.
    ChildrenJoined,
    /// The model tried to finish with a completion criterion unmet: it is called again.
    CompletionBlocked,
    /// The run's `wait` ended (its due time came, or input for its session arrived): the
    /// batch goes on with the wait's result.
    WaitEnded,
}

impl Phase {
    pub const ALL: [Phase; 10] = [
        Phase::UserInput,
        Phase::LlmResult,
        Phase::ToolsBatchResult,
        Phase::HumanDecided,
        Phase::Cancel,
        Phase::Resumed,
        Phase::ContextCompacted,
        Phase::ChildrenJoined,
        Phase::CompletionBlocked,
        Phase::WaitEnded,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::UserInput => "user_input",
            Phase::LlmResult => "llm_result",
            Phase::ToolsBatchResult => "tools_batch_result",
            Phase::HumanDecided => "human_decided",
            Phase::Cancel => "cancel",
            Phase::Resumed => "resumed",
            Phase::ContextCompacted => "context_compacted",
            Phase::ChildrenJoined => "children_joined",
            Phase::CompletionBlocked => "completion_blocked",
            Phase::WaitEnded => "wait_ended",
        }
    }

    pub fn parse(text: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.as_str() == text)
    }
}

/// One unit of progress to make. `(run_id, step_index)` is its idempotency key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepJob {
    pub run_id: RunId,
    pub step_index: u64,
    pub phase: Phase,
    /// How many times this job has been claimed (1 on the first claim).
    pub attempt: u32,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub input_tokens: u64,
    /// Every generated token, reasoning included.
    pub output_tokens: u64,
    /// The part of `output_tokens` spent reasoning, where a provider reports it.
    #[serde(default)]
    pub reasoning_tokens: u64,
    /// The part of `input_tokens` written to the provider's prompt cache (Anthropic).
    #[serde(default)]
    pub cache_write_tokens: u64,
    /// The part of `input_tokens` read from the provider's prompt cache.
    #[serde(default)]
    pub cache_read_tokens: u64,
}

/// A complete model answer.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelReply {
    pub text: String,
    pub tool_calls: Vec<ToolCall>,
    pub usage: Usage,
    /// What the model reasoned before answering, where the provider returns it. Clients are
    /// shown it (`assistant.reasoning`); it is not the answer and is never sent back to the
    /// model.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reasoning: String,
}

/// The row a committed step leaves in the step history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub index: u64,
    pub instruction: String,
    pub started_at: Millis,
    pub finished_at: Millis,
    pub summary: Value,
}

/// Everything one step commits, atomically: the new state, new messages, events, the step's
/// record and — only while the run is still running — the next job.
#[derive(Debug, Clone, PartialEq)]
pub struct StepResult {
    pub state: AgentState,
    pub messages: Vec<Message>,
    pub events: Vec<EventDraft>,
    pub record: StepRecord,
    pub next: Option<StepJob>,
    /// Child runs that start in this commit (the run waits for them).
    pub children: Vec<crate::delegation::ChildRun>,
}

impl StepResult {
    /// A cancel request arrived while this step was in flight. The step's work is kept (its
    /// effects happened), but the run moves to `cancelling` and its next step only finishes.
    /// A wait the step would have started is not announced and not begun: no approval or
    /// reconciliation exists that a client could answer, and no child run starts.
    pub fn yield_to_cancel(&mut self) {
        if self.state.status.is_terminal() || self.state.status == RunStatus::Cancelling {
            return;
        }
        self.state.cancel_requested = true;
        // No run starts after a cancel was accepted, background ones included.
        self.children.clear();
        self.events
            .retain(|event| event.kind != EventKind::SubagentStarted);
        if self.state.status.is_waiting() || self.state.status == RunStatus::WaitingTimer {
            self.state.pending_human = None;
            self.state.timer = None;
            let waiting = serde_json::to_value(self.state.status).unwrap_or_default();
            self.events.retain(|event| match event.kind {
                EventKind::ApprovalRequired
                | EventKind::ReconciliationRequired
                | EventKind::TimerSet => false,
                EventKind::RunStatus => event.payload["status"] != waiting,
                _ => true,
            });
        }
        self.state.status = RunStatus::Cancelling;
        self.events.push(status_event(&self.state));
        self.next = Some(StepJob {
            run_id: self.state.run_id.clone(),
            step_index: self.record.index + 1,
            phase: Phase::Cancel,
            attempt: 0,
        });
    }
}

impl StepResult {
    /// A pause was asked for while this step was in flight. A run that would go on to its
    /// next step stops here instead, keeping that step's phase to take it up when resumed
    /// (background children the step starts still start); so does one the step parks on a
    /// timer, which waits again, for the same due time, when resumed. A step that ends the run
    /// or makes it wait for someone is left as it is. True when the run paused.
    pub fn yield_to_pause(&mut self) -> bool {
        if !matches!(
            self.state.status,
            RunStatus::Running | RunStatus::WaitingTimer
        ) {
            return false;
        }
        let Some(next) = self.next.take() else {
            return false;
        };
        pause_in_place(&mut self.state, next.phase, self.record.finished_at);
        self.events.push(status_event(&self.state));
        true
    }

    /// The run's next step calls the model: a boundary where a user's steering message can
    /// join the history without splitting a tool call from its result. Never in a continuation
    /// turn: its messages are drafts until it completes, and a steer must not be lost with an
    /// attempt that fails; it waits for the turn's end and becomes a run of its own.
    pub fn accepts_steer(&self) -> bool {
        let now = self.record.finished_at;
        !self.state.config.continuation
            && self.next.as_ref().is_some_and(|job| {
                matches!(
                    decide(&self.state, job.phase, now),
                    Instruction::CallLlm { .. }
                )
            })
    }
}

/// Whose words a run's assistant and tool messages are: a continuation turn's are marked so.
fn agent_origin(state: &AgentState) -> crate::Origin {
    if state.config.continuation {
        crate::Origin::Continuation
    } else {
        crate::Origin::Agent
    }
}

/// Moves a run from `queued` to `running` and returns its first job.
pub fn start_run(state: &mut AgentState, now: Millis) -> (StepJob, EventDraft) {
    state.status = RunStatus::Running;
    state.started_at = Some(now);
    let job = StepJob {
        run_id: state.run_id.clone(),
        step_index: state.step_index + 1,
        phase: Phase::UserInput,
        attempt: 0,
    };
    (job, status_event(state))
}

/// The model answered. The answer is committed with the step; tool calls become the next
/// batch unless the run is concluding.
pub fn after_model(
    mut state: AgentState,
    job: &StepJob,
    reply: ModelReply,
    conclude: bool,
    started_at: Millis,
    now: Millis,
) -> StepResult {
    count_model_call(&mut state, reply.usage);
    state.just_compacted = false;
    if conclude {
        state.force_finish = true;
    }
    // The checkpoint keeps every call the model asked for, so the Brain can tell a conclusion
    // that still wanted tools (cut short by the budget) from one that simply answered; a
    // concluding message itself carries no calls, as none will run.
    let offered = if state.force_finish {
        Vec::new()
    } else {
        reply.tool_calls.clone()
    };
    state.checkpoint = (!reply.tool_calls.is_empty()).then(|| ToolCheckpoint {
        key_step: Some(job.step_index + 1),
        asked_at: Some(now),
        ..ToolCheckpoint::new(reply.tool_calls)
    });
    state.final_answer = Some(reply.text.clone());
    let message = Message {
        origin: agent_origin(&state),
        ..Message::assistant(reply.text, offered)
    };
    // The provider measured the prompt it was sent; the answer is now part of the next one.
    let prompt = match reply.usage.input_tokens {
        0 => state.counters.context_tokens,
        measured => measured,
    };
    state.counters.context_tokens = prompt.saturating_add(message.estimated_tokens());
    let cost = (state.config.model_settings.as_ref().and_then(|m| m.prices))
        .map(|prices| prices.cost_microusd(reply.usage));
    let mut events = Vec::with_capacity(2);
    if !reply.reasoning.is_empty() {
        events.push(EventDraft::new(
            EventKind::AssistantReasoning,
            json!({"run_id": state.run_id, "step_index": job.step_index, "text": reply.reasoning}),
        ));
    }
    events.push(EventDraft::new(
        EventKind::AssistantMessage,
        json!({"run_id": state.run_id, "content": message.content, "tool_calls": message.tool_calls,
               "usage": reply.usage, "cost_microusd": cost}),
    ));
    let summary = json!({
        "tool_calls": message.tool_calls.len(),
        "conclude": conclude,
        "input_tokens": reply.usage.input_tokens,
        "output_tokens": reply.usage.output_tokens,
        "reasoning_tokens": reply.usage.reasoning_tokens,
        "cache_write_tokens": reply.usage.cache_write_tokens,
        "cache_read_tokens": reply.usage.cache_read_tokens,
        "cost_microusd": cost,
    });
    close_step(
        state,
        job,
        Instruction::CallLlm { conclude },
        Phase::LlmResult,
        vec![message],
        events,
        summary,
        started_at,
        now,
    )
}

/// What a compaction produced: the model's summary of the messages before position
/// `keeps_from`, and the estimated tokens of the messages it keeps.
#[derive(Debug, Clone, PartialEq)]
pub struct Compaction {
    pub reply: ModelReply,
    pub keeps_from: i64,
    pub summarized: usize,
    pub kept_tokens: u64,
}

/// The context was compacted (or, given `None`, there was nothing older to summarise). The
/// summary is a hidden message; the next step calls the model with the shorter prompt, or —
/// if it is still over budget — ends the run.
pub fn after_compaction(
    mut state: AgentState,
    job: &StepJob,
    compaction: Option<Compaction>,
    started_at: Millis,
    now: Millis,
) -> StepResult {
    state.just_compacted = true;
    let before = state.counters.context_tokens;
    let mut messages = Vec::new();
    let mut events = Vec::new();
    let mut summarized = 0;
    if let Some(compaction) = compaction {
        let reply = compaction.reply;
        count_model_call(&mut state, reply.usage);
        let message = Message::summary(&reply.text, compaction.keeps_from);
        state.counters.context_tokens = message.estimated_tokens() + compaction.kept_tokens;
        summarized = compaction.summarized;
        messages.push(message);
    }
    let summary = json!({
        "summarized_messages": summarized,
        "tokens_before": before,
        "tokens_after": state.counters.context_tokens,
    });
    if summarized > 0 {
        let mut payload = summary.clone();
        payload["run_id"] = json!(state.run_id);
        events.push(EventDraft::new(EventKind::ContextCompacted, payload));
    }
    close_step(
        state,
        job,
        Instruction::CompressContext,
        Phase::ContextCompacted,
        messages,
        events,
        summary,
        started_at,
        now,
    )
}

/// Usage comes from providers: counting saturates rather than overflows.
fn count_model_call(state: &mut AgentState, usage: Usage) {
    let counters = &mut state.counters;
    counters.model_calls += 1;
    counters.input_tokens = counters.input_tokens.saturating_add(usage.input_tokens);
    counters.output_tokens = counters.output_tokens.saturating_add(usage.output_tokens);
    counters.reasoning_tokens = (counters.reasoning_tokens).saturating_add(usage.reasoning_tokens);
    counters.cache_write_tokens =
        (counters.cache_write_tokens).saturating_add(usage.cache_write_tokens);
    counters.cache_read_tokens =
        (counters.cache_read_tokens).saturating_add(usage.cache_read_tokens);
    if let Some(prices) = state.config.model_settings.as_ref().and_then(|m| m.prices) {
        counters.cost_microusd =
            (counters.cost_microusd).saturating_add(prices.cost_microusd(usage));
    }
}

/// The whole batch has outcomes, given in the checkpoint's order. `invalid_calls` counts
/// calls rejected before running (unknown tool, arguments failing the schema).
pub fn after_tools(
    mut state: AgentState,
    job: &StepJob,
    outcomes: Vec<ToolOutcome>,
    invalid_calls: u32,
    started_at: Millis,
    now: Millis,
) -> StepResult {
    let mut checkpoint = state.checkpoint.take().unwrap_or_default();
    checkpoint.cut_off = false;
    let mut messages = Vec::with_capacity(outcomes.len());
    let mut events = Vec::with_capacity(outcomes.len());
    for (progress, outcome) in checkpoint.calls.iter_mut().zip(outcomes) {
        let (message, event) = told_result(&mut state, &progress.call, &outcome);
        messages.push(message);
        events.push(event);
        progress.outcome = Some(outcome);
    }
    crate::completion::record_tools(&mut state, &checkpoint);
    state.counters.tool_calls += checkpoint.calls.len() as u64;
    state.counters.consecutive_parse_failures = if invalid_calls > 0 {
        state.counters.consecutive_parse_failures + 1
    } else {
        0
    };
    let summary = json!({
        "calls": checkpoint.calls.iter().map(|p| &p.call.name).collect::<Vec<_>>(),
        "errors": checkpoint.calls.iter().filter(|p| p.outcome.as_ref().is_some_and(|o| o.is_error)).count(),
        "invalid": invalid_calls,
    });
    state.checkpoint = Some(checkpoint);
    close_step(
        state,
        job,
        Instruction::CallToolsBatch,
        Phase::ToolsBatchResult,
        messages,
        events,
        summary,
        started_at,
        now,
    )
}

/// The result that hands `outcome` of `call` to the model, and its `tool.result` event; the
/// run's context grows by it.
fn told_result(
    state: &mut AgentState,
    call: &ToolCall,
    outcome: &ToolOutcome,
) -> (Message, EventDraft) {
    let message = Message {
        origin: agent_origin(state),
        ..Message::tool_result(&call.id, outcome)
    };
    state.counters.context_tokens += message.estimated_tokens();
    let event = EventDraft::new(
        EventKind::ToolResult,
        json!({
            "run_id": state.run_id,
            "call_id": call.id,
            "tool": call.name,
            "content": outcome.content,
            "is_error": outcome.is_error,
        }),
    );
    (message, event)
}

/// A `never`-replay call was started before a crash and its outcome is unknown. The outcomes
/// known so far are kept in the checkpoint; the run waits for a human.
pub fn await_reconciliation(
    mut state: AgentState,
    job: &StepJob,
    known: Vec<Option<ToolOutcome>>,
    request: HumanRequest,
    started_at: Millis,
    now: Millis,
) -> StepResult {
    let summary = json!({"reconciliation": request});
    let (record, committed) = park_batch(&mut state, job, known, summary, started_at, now);
    state.status = RunStatus::WaitingHuman;
    state.pending_human = Some(request.clone());
    let events = vec![
        EventDraft::new(
            EventKind::ReconciliationRequired,
            json!({"run_id": state.run_id, "request": request}),
        ),
        status_event(&state),
        committed,
    ];
    StepResult {
        record,
        state,
        messages: Vec::new(),
        events,
        next: None,
        children: Vec::new(),
    }
}

/// Commits a tools step that leaves its batch unfinished, waiting on something outside the
/// run: the outcomes known so far (in call order) are kept in the checkpoint.
pub(crate) fn park_batch(
    state: &mut AgentState,
    job: &StepJob,
    known: Vec<Option<ToolOutcome>>,
    summary: Value,
    started_at: Millis,
    now: Millis,
) -> (StepRecord, EventDraft) {
    if let Some(checkpoint) = state.checkpoint.as_mut() {
        for (progress, outcome) in checkpoint.calls.iter_mut().zip(known) {
            progress.outcome = outcome;
        }
    }
    mark_committed(
        state,
        job,
        Instruction::CallToolsBatch,
        summary,
        started_at,
        now,
    )
}

/// What a human says happened to a call whose outcome was unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reconciliation {
    /// It took effect; `result` (or a note) becomes its outcome.
    Succeeded,
    /// It did not take effect; the model sees an error.
    Failed,
    /// Run it again (the human accepts the risk of a second effect).
    Retry,
    /// Do not run it; the model is told it was skipped.
    Skip,
}

/// Why a human's answer was refused. `NotWaiting` and `NotAwaited` are conflicts with the
/// run's state; `Invalid` is an answer that could never be right.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecisionError {
    #[error("run {run_id} is not waiting for {expected} (it is {status})")]
    NotWaiting {
        run_id: RunId,
        status: RunStatus,
        expected: String,
    },
    #[error("call {call_id:?} is not awaiting reconciliation; awaiting: {awaiting}")]
    NotAwaited { call_id: String, awaiting: String },
    /// The run left calls whose outcome nobody knows; a human records each first.
    #[error(
        "run {run_id} left calls in doubt: {calls}; record what happened to each \
         (reconcile) before it goes on"
    )]
    InDoubt { run_id: RunId, calls: String },
    #[error("{0}")]
    Invalid(String),
}

/// Records a human's answer for one call in doubt. When no call is left in doubt, the run
/// goes back to `running` and the returned job resumes the batch from its checkpoint: calls
/// with an outcome are not run again, a `retry` call is.
pub fn reconcile(
    state: &mut AgentState,
    call_id: &str,
    answer: Reconciliation,
    result: Option<String>,
) -> Result<(Vec<EventDraft>, Option<StepJob>), DecisionError> {
    let not_waiting = || DecisionError::NotWaiting {
        run_id: state.run_id.clone(),
        status: state.status,
        expected: "reconciliation".to_owned(),
    };
    if state.status.is_terminal() && !state.in_doubt.is_empty() {
        return record_in_doubt(state, call_id, answer, result);
    }
    if state.status != RunStatus::WaitingHuman {
        return Err(not_waiting());
    }
    let Some(HumanRequest::Reconciliation { calls }) = state.pending_human.as_mut() else {
        return Err(not_waiting());
    };
    let Some(position) = calls.iter().position(|c| c.call_id == call_id) else {
        let awaiting = calls
            .iter()
            .map(|c| c.call_id.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        return Err(DecisionError::NotAwaited {
            call_id: call_id.to_owned(),
            awaiting,
        });
    };
    let call = calls.remove(position);
    let remaining = calls.len();
    let outcome = match answer {
        Reconciliation::Succeeded => {
            Some(ToolOutcome::ok(result.unwrap_or_else(|| {
                "succeeded (confirmed by a human)".into()
            })))
        }
        Reconciliation::Failed => Some(ToolOutcome::error(
            result.unwrap_or_else(|| "failed (confirmed by a human)".into()),
        )),
        Reconciliation::Skip => Some(ToolOutcome::error(
            "skipped by a human; it did not run again",
        )),
        Reconciliation::Retry => None,
    };
    if let Some(progress) = state
        .checkpoint
        .as_mut()
        .and_then(|c| c.calls.get_mut(call.call_index))
    {
        progress.rerun_approved = outcome.is_none();
        progress.outcome = outcome;
    }
    let mut events = vec![EventDraft::new(
        EventKind::ReconciliationDecided,
        json!({"run_id": state.run_id, "call_id": call.call_id, "tool": call.tool, "answer": answer}),
    )];
    if remaining > 0 {
        return Ok((events, None));
    }
    let job = back_to_running(state, Phase::HumanDecided, &mut events);
    Ok((events, Some(job)))
}

/// Records what a human says happened to a call left in doubt when its run ended. The run
/// stays ended: the answer is the record of the effect, and nothing runs again.
fn record_in_doubt(
    state: &mut AgentState,
    call_id: &str,
    answer: Reconciliation,
    result: Option<String>,
) -> Result<(Vec<EventDraft>, Option<StepJob>), DecisionError> {
    let Some(position) = state.in_doubt.iter().position(|c| c.call_id == call_id) else {
        let awaiting = (state.in_doubt.iter())
            .map(|c| c.call_id.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        return Err(DecisionError::NotAwaited {
            call_id: call_id.to_owned(),
            awaiting,
        });
    };
    if answer == Reconciliation::Retry {
        return Err(DecisionError::Invalid(format!(
            "run {} has ended ({}); a call it left in doubt can be recorded as succeeded, \
             failed or skipped, not run again",
            state.run_id, state.status
        )));
    }
    let call = state.in_doubt.remove(position);
    // A failed run that is continued carries its batch on: the recorded outcome is the call's.
    let recorded = match answer {
        Reconciliation::Succeeded => ToolOutcome::ok(
            result
                .clone()
                .unwrap_or_else(|| "succeeded (confirmed by a human)".into()),
        ),
        Reconciliation::Failed => ToolOutcome::error(
            result
                .clone()
                .unwrap_or_else(|| "failed (confirmed by a human)".into()),
        ),
        Reconciliation::Skip | Reconciliation::Retry => {
            ToolOutcome::error("skipped by a human; it did not run again")
        }
    };
    if let Some(progress) = (state.checkpoint.as_mut())
        .and_then(|c| c.calls.get_mut(call.call_index))
        .filter(|p| p.call.id == call.call_id && p.outcome.is_none())
    {
        progress.outcome = Some(recorded);
    }
    let event = EventDraft::new(
        EventKind::ReconciliationDecided,
        json!({
            "run_id": state.run_id,
            "call_id": call.call_id,
            "tool": call.tool,
            "answer": answer,
            "result": result,
            "run_ended": true,
        }),
    );
    Ok((vec![event], None))
}

/// Ends a waiting run whose deadline has passed, as `timed_out`. `never` calls it was waiting
/// on a human to reconcile stay in doubt on the ended run.
pub fn time_out_idle(state: &mut AgentState, now: Millis) -> Vec<EventDraft> {
    end_idle(state, StopReason::TimedOut, now)
}

/// Ends a run with no step in flight. A human request it waited on goes with it, except the
/// calls it asked a human to reconcile: nobody knows whether they took effect, so they stay
/// listed in doubt on the ended run, where a human may still record what happened.
fn end_idle(state: &mut AgentState, reason: StopReason, now: Millis) -> Vec<EventDraft> {
    let mut events = Vec::new();
    if let Some(HumanRequest::Reconciliation { calls }) = state.pending_human.take() {
        state.in_doubt.extend(calls);
    }
    // The run waited in the middle of a batch (for a human, its children, a timer) whose
    // results were never handed to the model: a continued run carries it on (once a human has
    // recorded any call in doubt).
    if let Some(checkpoint) = state.checkpoint.as_mut()
        && checkpoint.has_pending()
        && reason.terminal_status() == RunStatus::Failed
    {
        checkpoint.cut_off = true;
    }
    state.timer = None;
    finish_in_place(state, reason, now, &mut events);
    events
}

/// A human's answer lets a waiting (or failed) run go on: it is `running` again and the
/// returned job, woken by `phase`, is its next step.
pub(crate) fn back_to_running(
    state: &mut AgentState,
    phase: Phase,
    events: &mut Vec<EventDraft>,
) -> StepJob {
    state.pending_human = None;
    state.status = RunStatus::Running;
    events.push(status_event(state));
    StepJob {
        run_id: state.run_id.clone(),
        step_index: state.step_index + 1,
        phase,
        attempt: 0,
    }
}

/// How a failed run goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resumption {
    /// Repeat the model call that kept failing, with a fresh set of attempts. Only for a run
    /// that failed with `llm_error`.
    Retry,
    /// Go on from the last committed step, with `extension` added to the budget: any failed
    /// run, and the only way on for one that spent its budget.
    Continue { extension: BudgetExtension },
}

/// Whether an operator may resume the failed run `state` itself (`resume_failed`): not a
/// delegated run, whose result its parent already has, nor a continuation turn, whose events
/// go to a new one. The refusal says what to do instead.
pub fn may_resume_failed(state: &AgentState) -> Result<(), String> {
    let run_id = &state.run_id;
    if let Some(lineage) = &state.lineage {
        return Err(format!(
            "run {run_id} was delegated by {} and its result was already handed back; continue the parent instead",
            lineage.parent_run_id
        ));
    }
    if state.config.continuation {
        return Err(format!(
            "run {run_id} is a continuation turn: its inbox events are offered to a new one (see the session's inbox)"
        ));
    }
    Ok(())
}

/// Moves a failed run back to `running`; the returned job calls the model again. Refused
/// when the run did not fail, when `Retry` is asked of a run that did not fail calling the
/// model, or when the run's budget would still be spent (nothing would happen but failing
/// again).
pub fn resume_failed(
    state: &mut AgentState,
    how: Resumption,
    now: Millis,
) -> Result<(Vec<EventDraft>, StepJob), DecisionError> {
    let reason = match (state.status, state.stop_reason) {
        (RunStatus::Failed, Some(reason)) => reason,
        _ => {
            return Err(DecisionError::NotWaiting {
                run_id: state.run_id.clone(),
                status: state.status,
                expected: "continue or retry (only a failed run can)".to_owned(),
            });
        }
    };
    if !state.in_doubt.is_empty() {
        return Err(DecisionError::InDoubt {
            run_id: state.run_id.clone(),
            calls: (state.in_doubt.iter())
                .map(|c| format!("{} ({})", c.call_id, c.tool))
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    let mut resumed = state.clone();
    match how {
        Resumption::Retry if reason != StopReason::LlmError => {
            return Err(DecisionError::Invalid(format!(
                "retry repeats a model call that kept failing, but run {} failed with {reason}; use continue",
                state.run_id
            )));
        }
        Resumption::Retry => {}
        // Budgets come from clients: adding them saturates rather than overflows.
        Resumption::Continue { extension } => {
            let added = &mut resumed.extension;
            added.steps = added.steps.saturating_add(extension.steps);
            added.model_calls = added.model_calls.saturating_add(extension.model_calls);
            added.tool_calls = added.tool_calls.saturating_add(extension.tool_calls);
            added.tokens = added.tokens.saturating_add(extension.tokens);
            added.duration_ms = added.duration_ms.saturating_add(extension.duration_ms);
        }
    }
    // The concluding call that spent the budget offered no tools: the calls it still asked
    // for were never shown to the model as made, so none of them may run now.
    if resumed.force_finish {
        resumed.force_finish = false;
        resumed.checkpoint = None;
    }
    if reason == StopReason::ParseFailures {
        resumed.counters.consecutive_parse_failures = 0;
    }
    resumed.status = RunStatus::Running;
    resumed.stop_reason = None;
    resumed.finished_at = None;
    if let Instruction::Finish(again) = decide(&resumed, Phase::Resumed, now) {
        return Err(DecisionError::Invalid(format!(
            "run {} would stop again at once ({again}): its budget is spent; continue it with more (extra steps, model calls, tool calls or tokens)",
            state.run_id
        )));
    }
    *state = resumed;
    let mut events = vec![EventDraft::new(
        EventKind::RunResumed,
        json!({"run_id": state.run_id, "after": reason, "how": how}),
    )];
    let job = back_to_running(state, Phase::Resumed, &mut events);
    Ok((events, job))
}

fn pause_in_place(state: &mut AgentState, next: Phase, now: Millis) {
    state.status = RunStatus::Paused;
    state.pause = Some(crate::state::Pause { next, since: now });
}

/// Pauses a running run that has no step in flight, or one waiting on a timer (which keeps
/// its due time): `next` is the phase of the job that was waiting to be claimed (the caller
/// removes that job).
pub fn pause_idle(
    state: &mut AgentState,
    next: Phase,
    now: Millis,
) -> Result<Vec<EventDraft>, DecisionError> {
    if !matches!(state.status, RunStatus::Running | RunStatus::WaitingTimer) {
        return Err(DecisionError::NotWaiting {
            run_id: state.run_id.clone(),
            status: state.status,
            expected: "pause (only a running run, or one waiting on a timer, can)".to_owned(),
        });
    }
    pause_in_place(state, next, now);
    Ok(vec![status_event(state)])
}

/// Moves a paused run back to `running`; the returned job is the one the pause took away.
/// The time spent paused is not counted against the run's duration budget. A run paused while
/// it waited on a timer waits again, for the same due time (its job is ready then, or at once
/// when that time has passed or input ended the wait meanwhile).
pub fn resume_paused(
    state: &mut AgentState,
    now: Millis,
) -> Result<(Vec<EventDraft>, StepJob), DecisionError> {
    let pause = match (state.status, state.pause) {
        (RunStatus::Paused, Some(pause)) => pause,
        _ => {
            return Err(DecisionError::NotWaiting {
                run_id: state.run_id.clone(),
                status: state.status,
                expected: "resume (only a paused run can)".to_owned(),
            });
        }
    };
    state.pause = None;
    state.paused_ms = state
        .paused_ms
        .saturating_add(u64::try_from(now.saturating_sub(pause.since)).unwrap_or(0));
    let mut events = Vec::new();
    if pause.next == Phase::WaitEnded && state.timer.is_some() {
        state.status = RunStatus::WaitingTimer;
        events.push(status_event(state));
        let job = StepJob {
            run_id: state.run_id.clone(),
            step_index: state.step_index + 1,
            phase: Phase::WaitEnded,
            attempt: 0,
        };
        return Ok((events, job));
    }
    let job = back_to_running(state, pause.next, &mut events);
    Ok((events, job))
}

/// A step whose one instruction is to end the run (a cancel, or a model that kept failing).
pub fn finish_step(
    mut state: AgentState,
    job: &StepJob,
    reason: StopReason,
    started_at: Millis,
    now: Millis,
) -> StepResult {
    let summary = json!({"stop_reason": reason});
    let (record, committed) = mark_committed(
        &mut state,
        job,
        Instruction::Finish(reason),
        summary,
        started_at,
        now,
    );
    let mut events = vec![committed];
    finish_in_place(&mut state, reason, now, &mut events);
    StepResult {
        record,
        state,
        messages: Vec::new(),
        events,
        next: None,
        children: Vec::new(),
    }
}

/// How one call of a batch stood when the batch was cut off.
#[derive(Debug, Clone, PartialEq)]
pub enum CallEnding {
    /// It finished (or an earlier attempt recorded its outcome): what it did is kept.
    Known(ToolOutcome),
    /// It started and did not finish: whether it took effect is unknown.
    CutOff,
    /// It never started.
    NotStarted,
}

/// Ends a run whose batch was cut off (by a cancel or the run's deadline), keeping what the
/// batch did: every known outcome goes into the checkpoint, and a started `never` call without
/// one is listed in doubt on the ended run for a human to record.
///
/// A run that may go on (`failed`: continued later) keeps its batch open: continuing it runs
/// the batch on from the checkpoint, so a call with an outcome does not run again, a `keyed`
/// or `safe` call that was cut off runs again under the same idempotency key, one that never
/// started runs then, and the model is handed every result in order. A run that cannot go on
/// (`cancelled`) closes the batch in its history now, each call told what became of it — a
/// later run of the session reads the truth, never "not run" of a call that started.
///
/// `endings` is how each call of the batch the step ran stood; None for a step that ran no
/// batch (one that ends at its start, or was cut off calling the model): a batch the model
/// has not been handed yet is then settled from what the checkpoint knows (`untold_endings`).
pub fn cut_off_step(
    mut state: AgentState,
    job: &StepJob,
    reason: StopReason,
    endings: Option<Vec<CallEnding>>,
    started_at: Millis,
    now: Millis,
) -> StepResult {
    let Some(endings) = endings.or_else(|| untold_endings(&state, job.phase)) else {
        return finish_step(state, job, reason, started_at, now);
    };
    let (messages, events) = settle_batch(&mut state, job.step_index, reason, endings);
    let mut result = finish_step(state, job, reason, started_at, now);
    result.messages = messages;
    result.events.splice(0..0, events);
    result
}

/// How the calls of the batch the run holds stand, when the model has not been handed its
/// results yet and the step of `phase` ends the run before running it: a model call asked for
/// it (none ran), a human, the children or a wait ended (the rest ran before), or a cancel
/// came while the step that parked the batch (for a human, a timer or children) was in
/// flight. A call with an outcome is known; the wait or the delegation the run waited on ran,
/// with no outcome recorded; any other call never started (a `never` call's intent says
/// otherwise: the engine reads it). None when the model was handed the batch's results (or
/// the calls were never shown to it as made: a concluding call's).
pub fn untold_endings(state: &AgentState, phase: Phase) -> Option<Vec<CallEnding>> {
    let checkpoint = state.checkpoint.as_ref()?;
    let waited = matches!(phase, Phase::ChildrenJoined | Phase::WaitEnded);
    // A cancel's step follows any step: the batch is untold when that step parked it (a call
    // still without an outcome), not when it handed every result to the model.
    let parked = phase == Phase::Cancel && checkpoint.calls.iter().any(|c| c.outcome.is_none());
    let untold = checkpoint.cut_off
        || (matches!(phase, Phase::LlmResult | Phase::HumanDecided) || waited || parked)
            && !state.force_finish;
    untold.then(|| {
        (checkpoint.calls.iter())
            .map(|p| match &p.outcome {
                Some(outcome) => CallEnding::Known(outcome.clone()),
                None if waited => CallEnding::CutOff,
                None => CallEnding::NotStarted,
            })
            .collect()
    })
}

/// Records how each call of the run's open batch ended as the run ends for `reason`: known
/// outcomes go into the checkpoint, a `never` call cut off goes in doubt. A run that cannot go
/// on (`cancelled`) closes the batch: the results returned answer every call with what became
/// of it. Any other keeps the batch open (`ToolCheckpoint::cut_off`) for `continue`.
/// `step_index` is the step the batch's keys name when the batch does not say (an older one).
fn settle_batch(
    state: &mut AgentState,
    step_index: u64,
    reason: StopReason,
    endings: Vec<CallEnding>,
) -> (Vec<Message>, Vec<EventDraft>) {
    let Some(mut checkpoint) = state.checkpoint.take() else {
        return (Vec::new(), Vec::new());
    };
    // The keys name the batch's first step whatever step carries the batch on.
    checkpoint.key_step.get_or_insert(step_index);
    let closes = reason.terminal_status() == RunStatus::Cancelled;
    let cause = match reason {
        StopReason::Cancelled => "the run was cancelled",
        StopReason::TimedOut => "the run's deadline passed",
        _ => "the run ended",
    };
    let mut messages = Vec::new();
    let mut events = Vec::new();
    for (slot, ending) in (0u32..).zip(endings) {
        let key = checkpoint.idempotency_key(&state.run_id, step_index, slot);
        let Some(progress) = checkpoint.calls.get_mut(slot as usize) else {
            continue;
        };
        let replay = (state.config.tool(&progress.call.name)).map(|spec| spec.replay);
        if progress.outcome.is_none()
            && let CallEnding::Known(outcome) = &ending
        {
            progress.outcome = Some(outcome.clone());
        }
        let in_doubt = ending == CallEnding::CutOff && replay == Some(ReplayPolicy::Never);
        if in_doubt && !state.in_doubt.iter().any(|c| c.call_id == progress.call.id) {
            state.in_doubt.push(crate::UnknownCall {
                call_index: slot as usize,
                call_id: progress.call.id.clone(),
                tool: progress.call.name.clone(),
                arguments: progress.call.arguments.clone(),
                idempotency_key: key,
                drift: None,
            });
        }
        if !closes {
            continue;
        }
        let told = match (&progress.outcome, ending) {
            (Some(outcome), _) => outcome.clone(),
            (None, CallEnding::CutOff) if in_doubt => ToolOutcome::error(format!(
                "outcome unknown: {cause} while this call ran. Its tool must never run twice, \
                 so it will not run again: it is listed in doubt on the run for a human to \
                 record what happened"
            )),
            (None, CallEnding::CutOff) => ToolOutcome::error(format!(
                "outcome unknown: {cause} while this call ran, and it did not finish"
            )),
            (None, _) => ToolOutcome::error(format!("not run: {cause} before this call started")),
        };
        let (message, event) = told_result(state, &progress.call, &told);
        messages.push(message);
        events.push(event);
        progress.outcome = Some(told);
    }
    checkpoint.cut_off = !closes;
    state.checkpoint = Some(checkpoint);
    (messages, events)
}

/// A step whose one instruction is to park the run on an approval for its batch.
pub fn ask_approval_step(
    mut state: AgentState,
    job: &StepJob,
    started_at: Millis,
    now: Millis,
) -> StepResult {
    let (record, committed) = mark_committed(
        &mut state,
        job,
        Instruction::AskApproval,
        json!({"asked_approval": true}),
        started_at,
        now,
    );
    let mut events = vec![committed];
    crate::approval::ask_in_place(&mut state, job.step_index, &mut events);
    StepResult {
        record,
        state,
        messages: Vec::new(),
        events,
        next: None,
        children: Vec::new(),
    }
}

/// Ends a run that has no step in flight (queued or waiting) at once, as a cancel does. A
/// batch it held open is closed in its history: the results returned (to be stored after the
/// run's last step) answer each call — its outcome, unknown for a call a human was asked
/// about or a wait in progress, or not run.
pub fn cancel_idle(state: &mut AgentState, now: Millis) -> (Vec<EventDraft>, Vec<Message>) {
    state.cancel_requested = true;
    // What a human was asked about, and a wait in progress, started: neither is "not run".
    let mut started: Vec<String> = match &state.pending_human {
        Some(HumanRequest::Reconciliation { calls }) => {
            calls.iter().map(|c| c.call_id.clone()).collect()
        }
        _ => Vec::new(),
    };
    started.extend(state.timer.as_ref().map(|t| t.call_id.clone()));
    // A run waiting for its children started the delegations that have no outcome yet.
    let delegated = state.status == RunStatus::WaitingChildren;
    let endings: Vec<CallEnding> = (state.checkpoint.iter().flat_map(|c| &c.calls))
        .map(|p| match &p.outcome {
            Some(outcome) => CallEnding::Known(outcome.clone()),
            None if delegated || started.contains(&p.call.id) => CallEnding::CutOff,
            None => CallEnding::NotStarted,
        })
        .collect();
    let mut events = end_idle(state, StopReason::Cancelled, now);
    if !state.checkpoint.as_ref().is_some_and(|c| c.has_pending()) {
        return (events, Vec::new());
    }
    let step_index = state.step_index;
    let (messages, results) = settle_batch(state, step_index, StopReason::Cancelled, endings);
    events.splice(0..0, results);
    (events, messages)
}

#[expect(
    clippy::too_many_arguments,
    reason = "one call site per instruction, all named"
)]
fn close_step(
    mut state: AgentState,
    job: &StepJob,
    instruction: Instruction,
    outcome: Phase,
    mut messages: Vec<Message>,
    mut events: Vec<EventDraft>,
    summary: Value,
    started_at: Millis,
    now: Millis,
) -> StepResult {
    let (mut record, committed) =
        mark_committed(&mut state, job, instruction, summary, started_at, now);
    events.push(committed);
    let next = match decide(&state, outcome, now) {
        Instruction::Finish(StopReason::Completed) => {
            use crate::completion::{Refusal, refuse_completion};
            match refuse_completion(&mut state, job.step_index + 1, now, &mut events) {
                None => {
                    finish_in_place(&mut state, StopReason::Completed, now, &mut events);
                    None
                }
                Some(Refusal::End(reason)) => {
                    finish_in_place(&mut state, reason, now, &mut events);
                    None
                }
                Some(Refusal::Retry { message, job }) => {
                    state.counters.context_tokens += message.estimated_tokens();
                    messages.push(message);
                    Some(job)
                }
            }
        }
        Instruction::Finish(reason) => {
            finish_in_place(&mut state, reason, now, &mut events);
            None
        }
        Instruction::AskApproval => {
            crate::approval::ask_in_place(&mut state, job.step_index, &mut events);
            // The step's record says what the run waits for after it.
            if let Value::Object(summary) = &mut record.summary {
                summary.insert("asked_approval".into(), Value::Bool(true));
            }
            None
        }
        Instruction::CallLlm { .. }
        | Instruction::CallToolsBatch
        | Instruction::CompressContext => Some(StepJob {
            run_id: state.run_id.clone(),
            step_index: job.step_index + 1,
            phase: outcome,
            attempt: 0,
        }),
    };
    StepResult {
        record,
        state,
        messages,
        events,
        next,
        children: Vec::new(),
    }
}

pub(crate) fn finish_in_place(
    state: &mut AgentState,
    reason: StopReason,
    now: Millis,
    events: &mut Vec<EventDraft>,
) {
    state.status = reason.terminal_status();
    state.stop_reason = Some(reason);
    state.finished_at = Some(now);
    events.push(status_event(state));
    let mut finished = json!({
        "run_id": state.run_id,
        "status": state.status,
        "stop_reason": reason,
        "steps": state.step_index,
        "final_answer": state.final_answer,
        "counters": state.counters,
    });
    if !state.in_doubt.is_empty() {
        finished["in_doubt"] = json!(state.in_doubt);
    }
    events.push(EventDraft::new(EventKind::RunFinished, finished));
}

pub(crate) fn status_event(state: &AgentState) -> EventDraft {
    EventDraft::new(
        EventKind::RunStatus,
        json!({"run_id": state.run_id, "status": state.status}),
    )
}

/// Counts `job`'s step as committed in the state; returns its record and its event.
fn mark_committed(
    state: &mut AgentState,
    job: &StepJob,
    instruction: Instruction,
    summary: Value,
    started_at: Millis,
    now: Millis,
) -> (StepRecord, EventDraft) {
    state.step_index = job.step_index;
    let event = EventDraft::new(
        EventKind::StepCommitted,
        json!({"run_id": state.run_id, "step_index": state.step_index, "instruction": instruction.name()}),
    );
    let record = StepRecord {
        index: job.step_index,
        instruction: instruction.name().to_owned(),
        started_at,
        finished_at: now,
        summary,
    };
    (record, event)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Lineage, RunConfigSnapshot, RunId, SessionId};

    /// A run in step 3 of a batch of a `never`, a `keyed` and a `safe` call, and a fourth
    /// `never` call.
    fn cut_batch() -> (AgentState, StepJob) {
        let run = RunId::from_suffix("r").unwrap();
        let session = SessionId::from_suffix("s").unwrap();
        let mut state = AgentState::new(session, run.clone(), Default::default(), 0);
        let tool = |name: &str, replay| crate::ToolSpec {
            name: name.into(),
            description: String::new(),
            parameters: json!({"type": "object"}),
            replay,
            completes_run: false,
            approval: Default::default(),
            delegation: Default::default(),
            calls: Default::default(),
        };
        state.config = std::sync::Arc::new(RunConfigSnapshot {
            tools: vec![
                tool("pay", ReplayPolicy::Never),
                tool("book", ReplayPolicy::Keyed),
                tool("look", ReplayPolicy::Safe),
            ],
            ..Default::default()
        });
        let call = |id: &str, name: &str| ToolCall {
            id: id.into(),
            name: name.into(),
            arguments: json!({}),
        };
        state.status = RunStatus::Running;
        state.step_index = 2;
        state.checkpoint = Some(ToolCheckpoint {
            key_step: Some(3),
            ..ToolCheckpoint::new(vec![
                call("c0", "pay"),
                call("c1", "book"),
                call("c2", "look"),
                call("c3", "pay"),
            ])
        });
        let job = StepJob {
            run_id: run,
            step_index: 3,
            phase: Phase::LlmResult,
            attempt: 1,
        };
        (state, job)
    }

    fn endings(first: CallEnding) -> Vec<CallEnding> {
        vec![
            first,
            CallEnding::Known(ToolOutcome::ok("booked")),
            CallEnding::CutOff,
            CallEnding::NotStarted,
        ]
    }

    fn results(result: &StepResult) -> Vec<(&str, &str)> {
        (result.messages.iter())
            .map(|m| (m.tool_call_id.as_deref().unwrap(), m.content.as_str()))
            .collect()
    }

    #[test]
    fn a_cancel_closes_the_cut_off_batch_telling_each_call_what_became_of_it() {
        let (state, job) = cut_batch();
        for (first, in_doubt) in [
            (CallEnding::Known(ToolOutcome::ok("paid")), false),
            (CallEnding::CutOff, true),
            (CallEnding::NotStarted, false),
        ] {
            let result = cut_off_step(
                state.clone(),
                &job,
                StopReason::Cancelled,
                Some(endings(first.clone())),
                10,
                11,
            );
            assert_eq!(result.state.status, RunStatus::Cancelled);
            let told = results(&result);
            assert_eq!(told.len(), 4, "every call is answered: {told:?}");
            match &first {
                CallEnding::Known(_) => assert_eq!(told[0].1, "paid"),
                CallEnding::CutOff => assert!(told[0].1.contains("in doubt"), "{told:?}"),
                CallEnding::NotStarted => assert!(told[0].1.starts_with("not run"), "{told:?}"),
            }
            assert_eq!(told[1].1, "booked");
            assert!(told[2].1.starts_with("outcome unknown"), "{told:?}");
            assert!(told[3].1.starts_with("not run"), "{told:?}");
            // Only a call that never started is told it did not run.
            let not_run: Vec<&str> = (told.iter())
                .filter(|(_, content)| content.starts_with("not run"))
                .map(|(id, _)| *id)
                .collect();
            let expected_not_run: &[&str] = match first {
                CallEnding::NotStarted => &["c0", "c3"],
                _ => &["c3"],
            };
            assert_eq!(not_run, expected_not_run);
            let doubted: Vec<&str> = (result.state.in_doubt.iter())
                .map(|c| c.call_id.as_str())
                .collect();
            assert_eq!(doubted, if in_doubt { vec!["c0"] } else { vec![] });
            if in_doubt {
                assert_eq!(result.state.in_doubt[0].idempotency_key, "run_r#3#0");
            }
            let checkpoint = result.state.checkpoint.as_ref().unwrap();
            assert!(!checkpoint.has_pending() && !checkpoint.cut_off);
            let results_first = (result.events.iter())
                .position(|e| e.kind == EventKind::ToolResult)
                .unwrap();
            let committed = (result.events.iter())
                .position(|e| e.kind == EventKind::StepCommitted)
                .unwrap();
            assert!(
                results_first < committed,
                "results precede the step's own events"
            );
        }
    }

    #[test]
    fn a_run_that_ends_before_the_model_was_handed_its_batch_settles_it() {
        let (mut state, mut job) = cut_batch();
        // A human answered for every call; the run is cancelled before the step that hands
        // the results to the model.
        for progress in &mut state.checkpoint.as_mut().unwrap().calls {
            progress.outcome = Some(ToolOutcome::ok(format!("{} done", progress.call.id)));
        }
        job.phase = Phase::HumanDecided;
        let result = cut_off_step(state.clone(), &job, StopReason::Cancelled, None, 10, 11);
        let told: Vec<&str> = results(&result).iter().map(|(_, c)| *c).collect();
        assert_eq!(told, ["c0 done", "c1 done", "c2 done", "c3 done"]);
        // Its deadline passes instead: the batch stays open for `continue`.
        let result = cut_off_step(state.clone(), &job, StopReason::TimedOut, None, 10, 11);
        assert!(result.messages.is_empty());
        assert!(result.state.checkpoint.as_ref().unwrap().cut_off);
        // A batch the model was handed is not told twice, and a concluding call's calls were
        // never shown to it as made.
        for (phase, force_finish) in [(Phase::ToolsBatchResult, false), (Phase::LlmResult, true)] {
            job.phase = phase;
            state.force_finish = force_finish;
            let result = cut_off_step(state.clone(), &job, StopReason::Cancelled, None, 10, 11);
            assert!(result.messages.is_empty(), "{phase:?}");
            assert!(
                !result.state.checkpoint.as_ref().unwrap().cut_off,
                "{phase:?}"
            );
        }
        // A cancel came while the step that parked the batch (for a human, a timer, children)
        // was in flight: what ran is told, and the `never` call whose intent the engine found
        // without an outcome is told that its outcome is unknown — never "not run".
        let (mut state, mut job) = cut_batch();
        state.checkpoint.as_mut().unwrap().calls[1].outcome = Some(ToolOutcome::ok("booked"));
        job.phase = Phase::Cancel;
        let mut endings = untold_endings(&state, job.phase).expect("the batch is untold");
        assert_eq!(endings[1], CallEnding::Known(ToolOutcome::ok("booked")));
        assert_eq!(
            endings[0],
            CallEnding::NotStarted,
            "as far as the state knows"
        );
        endings[0] = CallEnding::CutOff;
        let result = cut_off_step(
            state.clone(),
            &job,
            StopReason::Cancelled,
            Some(endings),
            10,
            11,
        );
        let told = results(&result);
        assert!(told[0].1.starts_with("outcome unknown"), "{told:?}");
        assert_eq!(told[1].1, "booked");
        assert!(told[2].1.starts_with("not run"), "{told:?}");
        // A cancel after a step that handed every result to the model tells nothing again.
        for progress in &mut state.checkpoint.as_mut().unwrap().calls {
            progress.outcome = Some(ToolOutcome::ok("done"));
        }
        assert_eq!(untold_endings(&state, Phase::Cancel), None);
        // Asked for but never run: each call is told it did not run.
        let (state, job) = cut_batch();
        let result = cut_off_step(state, &job, StopReason::Cancelled, None, 10, 11);
        let told = results(&result);
        assert!(
            told.iter().all(|(_, c)| c.starts_with("not run")),
            "{told:?}"
        );
    }

    #[test]
    fn a_deadline_keeps_the_cut_off_batch_open_and_continuing_carries_it_on() {
        let (state, job) = cut_batch();
        let result = cut_off_step(
            state,
            &job,
            StopReason::TimedOut,
            Some(endings(CallEnding::CutOff)),
            10,
            11,
        );
        assert!(result.messages.is_empty(), "the batch stays open");
        let mut ended = result.state;
        assert_eq!(ended.status, RunStatus::Failed);
        let checkpoint = ended.checkpoint.clone().unwrap();
        assert!(checkpoint.cut_off);
        let outcomes: Vec<Option<&str>> = (checkpoint.calls.iter())
            .map(|p| p.outcome.as_ref().map(|o| o.content.as_str()))
            .collect();
        assert_eq!(outcomes, [None, Some("booked"), None, None]);
        // The `never` call in doubt must be recorded before the run goes on.
        let more = Resumption::Continue {
            extension: BudgetExtension {
                duration_ms: 60_000,
                ..Default::default()
            },
        };
        let refused = resume_failed(&mut ended.clone(), more, 20).unwrap_err();
        assert!(
            matches!(&refused, DecisionError::InDoubt { calls, .. } if calls == "c0 (pay)"),
            "{refused}"
        );
        reconcile(
            &mut ended,
            "c0",
            Reconciliation::Succeeded,
            Some("paid".into()),
        )
        .unwrap();
        let (_, resumed) = resume_failed(&mut ended, more, 20).unwrap();
        assert_eq!(resumed.phase, Phase::Resumed);
        assert_eq!(
            decide(&ended, Phase::Resumed, 21),
            Instruction::CallToolsBatch,
            "the batch is carried on, not the model asked"
        );
        let carried = ended.checkpoint.as_ref().unwrap();
        assert_eq!(carried.calls[0].outcome, Some(ToolOutcome::ok("paid")));
        // The cut-off `safe` call runs again under the key it first had.
        assert_eq!(carried.idempotency_key(&ended.run_id, 9, 2), "run_r#3#2");
    }

    #[test]
    fn only_a_root_run_that_is_not_a_continuation_is_resumed_after_failing() {
        let run = RunId::from_suffix("r").unwrap();
        let session = SessionId::from_suffix("s").unwrap();
        let mut state = AgentState::new(session.clone(), run.clone(), Default::default(), 0);
        assert_eq!(may_resume_failed(&state), Ok(()));
        let parent = RunId::from_suffix("p").unwrap();
        state.lineage = Some(Lineage {
            parent_run_id: parent.clone(),
            parent_step: 1,
            parent_slot: 0,
            task_index: 0,
            root_run_id: parent,
            root_session_id: session,
            depth: 1,
            agent: "writer".into(),
            background: None,
        });
        assert!(
            may_resume_failed(&state)
                .unwrap_err()
                .contains("delegated by run_p")
        );
        state.lineage = None;
        state.config = std::sync::Arc::new(RunConfigSnapshot {
            continuation: true,
            ..Default::default()
        });
        assert!(
            may_resume_failed(&state)
                .unwrap_err()
                .contains("continuation turn")
        );
    }
}
