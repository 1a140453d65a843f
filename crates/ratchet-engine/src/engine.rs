//! The Engine executes the one instruction of a step and returns its `StepResult`. It writes
//! only write-ahead intents, tool outcomes and streamed deltas — never state, never jobs; the
//! worker hands the result to the Coordinator to commit.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{self, StreamExt};
use opentelemetry::Context;
use opentelemetry::trace::FutureExt as _;
use ratchet_core::batch::{SlotPlan, call_key, plan_batch, step_key, unknown_call};
use ratchet_core::bounds::sent_to_model;
use ratchet_core::brain::PromptFit;
use ratchet_core::delegation::{
    AGENT_TASK_TOOL, ChildRun, DELEGATE_TOOL, DelegationMode, EMIT_SIGNAL_TOOL, await_children,
    background_started, start_in_background,
};
use ratchet_core::step::{
    CallEnding, Compaction, after_compaction, after_model, after_tools, ask_approval_step,
    await_reconciliation, cut_off_step, finish_step, untold_endings,
};
use ratchet_core::timer::{WAIT_TOOL, await_timer, plan_waits, wake_step};
use ratchet_core::{
    AfterUnknown, AgentState, CallLimits, EventDraft, EventKind, HumanRequest, Instruction,
    Message, ReplayPolicy, RunConfigSnapshot, RunStatus, SessionId, StepJob, StepResult,
    StopReason, ToolCall, ToolDelegation, ToolOutcome, UnknownCall, after_unknown, decide,
};
use ratchet_llm::ModelRequest;
use ratchet_store::{Claim, ClaimedStep, Intent, IntentKind, IntentRecord, StoredMessage};
use ratchet_telemetry::{Capture, ToolCallSpan};
use ratchet_tools::{InputWatch, MemorySearch, Registry, Tool, ToolContext};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::delegation::{AgentTask, Delegation, EmitSignal, admit, read_delegate};
use crate::gates::{PermitLimits, StepPermits};
use crate::input::SessionInput;
use crate::memory::StoreMemory;
use crate::{Coordinator, Models};

/// What the model is asked to do with the older part of a context that outgrew its budget.
const SUMMARY_SYSTEM_PROMPT: &str = "You compress conversations. Write a faithful, compact \
summary of the conversation you are given: the user's goals and requests, decisions made, \
facts and tool results that still matter, and open questions. Do not add anything new.";
const SUMMARY_REQUEST: &str =
    "Summarize the conversation above; the summary will replace it in your context.";

/// How often streamed text is written as an `assistant.delta` event while a model talks.
const DELTA_FLUSH: Duration = Duration::from_millis(100);

/// Why a step produced no result to commit.
#[derive(Debug, thiserror::Error)]
pub enum StepFailure {
    /// Worth another attempt later (a model's HTTP 5xx or timeout). `attempt` is how many
    /// times this model call has now been tried.
    #[error("{message}")]
    Transient {
        message: String,
        attempt: u32,
        /// The provider's own wait before another attempt.
        retry_after: Option<Duration>,
    },
    /// Will not get better by retrying (the run's model cannot be loaded here).
    #[error("{0}")]
    Fatal(String),
    #[error("step cancelled")]
    Cancelled,
    /// The step's tool batch was cut off (its token cancelled, or the store refused a call
    /// because a cancel was accepted): how each call of the batch stood, in the batch's order,
    /// and the events the calls left for the commit that ends the run.
    #[error("tool batch cut off")]
    CutOff {
        endings: Vec<CallEnding>,
        events: Vec<EventDraft>,
    },
    /// Another worker holds the step now; this one must drop it without a word.
    #[error("lease lost")]
    LeaseLost,
    #[error(transparent)]
    Infrastructure(crate::Error),
}

impl From<ratchet_store::Error> for StepFailure {
    fn from(error: ratchet_store::Error) -> Self {
        match error {
            ratchet_store::Error::LeaseLost { .. } => StepFailure::LeaseLost,
            ratchet_store::Error::CancelRequested { .. } => StepFailure::Cancelled,
            other => StepFailure::Infrastructure(other.into()),
        }
    }
}

impl From<crate::Error> for StepFailure {
    fn from(error: crate::Error) -> Self {
        match error {
            crate::Error::Store(store) => store.into(),
            other => StepFailure::Infrastructure(other),
        }
    }
}

/// An executed step: its result, and the model's context as it stood before the step's own
/// messages (`None` when unknown). The commit's added messages extend it for the next step of
/// a streak, which then calls the model without reading the history back.
#[derive(Debug)]
pub struct Executed {
    pub result: StepResult,
    pub context: Option<Vec<Message>>,
}

/// The context after a commit that added `added`, or `None` when the commit put a summary in
/// place of older messages (the store then has to say what the model sees).
pub(crate) fn context_after(
    context: Option<Vec<Message>>,
    added: &[Message],
) -> Option<Vec<Message>> {
    let mut context = context?;
    if added.iter().any(|m| m.keeps_from.is_some()) {
        return None;
    }
    context.extend_from_slice(added);
    Some(context)
}

pub struct Engine {
    coordinator: Arc<Coordinator>,
    models: Arc<Models>,
    tools: Arc<Registry>,
    permits: StepPermits,
    capture: Capture,
}

/// How long a cut-off call may take to stop on its own before its task is aborted.
pub const DEFAULT_CANCEL_GRACE: Duration = Duration::from_secs(5);

impl Engine {
    pub fn new(coordinator: Arc<Coordinator>, models: Arc<Models>, tools: Arc<Registry>) -> Engine {
        Engine {
            coordinator,
            models,
            tools,
            permits: StepPermits::default(),
            capture: Capture::default(),
        }
    }

    /// Puts prompts and answers into model calls' spans (`RATCHET_OTEL_CAPTURE_CONTENT`).
    pub fn with_capture(mut self, capture: Capture) -> Engine {
        self.capture = capture;
        self
    }

    /// Limits the model calls and tool calls this engine makes at once.
    pub fn with_permits(mut self, limits: PermitLimits) -> Engine {
        self.permits = StepPermits::new(limits);
        self
    }

    /// Executes the claimed step's instruction. Cancelling `cancel` cuts the step off: a tool
    /// call then has `grace` to stop on its own before its task is aborted.
    pub async fn execute(
        &self,
        claimed: &ClaimedStep,
        cancel: &CancellationToken,
        grace: Duration,
    ) -> Result<Executed, StepFailure> {
        let started = self.coordinator.now();
        let decided = decide(&claimed.state, claimed.job.phase, started);
        let instruction =
            crate::delegation::within_tree_budget(&self.coordinator, &claimed.state, decided)
                .await?;
        let result = match instruction {
            // A batch the model was not handed yet is settled as the run ends (invariant 24),
            // with what an earlier attempt recorded of its `never` calls: an earlier attempt
            // of this step, or the step that parked the batch when a cancel came.
            Instruction::Finish(reason) => {
                let (state, job) = (&claimed.state, &claimed.job);
                let endings = untold_endings(state, job.phase);
                let endings = match endings {
                    Some(endings)
                        if job.attempt > 1 || job.phase == ratchet_core::Phase::Cancel =>
                    {
                        let batch_step = (state.checkpoint.as_ref())
                            .and_then(|c| c.key_step)
                            .unwrap_or(job.step_index);
                        let store = self.coordinator.store();
                        let intents = store.intents(&state.run_id, batch_step).await?;
                        Some(with_intents(endings, &intents))
                    }
                    endings => endings,
                };
                cut_off_step(
                    claimed.state.clone(),
                    &claimed.job,
                    reason,
                    endings,
                    started,
                    self.coordinator.now(),
                )
            }
            Instruction::CallLlm { conclude } => {
                return self.call_model(claimed, conclude, started, cancel).await;
            }
            // The step that ends a wait runs nothing: the batch's other calls ran before the
            // run parked, and the wait's result is what ended it.
            Instruction::CallToolsBatch if claimed.state.status == RunStatus::WaitingTimer => {
                wake_step(
                    claimed.state.clone(),
                    &claimed.job,
                    started,
                    self.coordinator.now(),
                )
            }
            Instruction::CallToolsBatch => self.run_batch(claimed, started, cancel, grace).await?,
            Instruction::AskApproval => ask_approval_step(
                claimed.state.clone(),
                &claimed.job,
                started,
                self.coordinator.now(),
            ),
            // A compaction puts a summary in place of older messages: the next step reads
            // the context as the store has it.
            Instruction::CompressContext => {
                let result = self.compress(claimed, started, cancel).await?;
                return Ok(Executed {
                    result,
                    context: None,
                });
            }
        };
        Ok(Executed {
            result,
            context: claimed.context.clone(),
        })
    }

    /// The model's context as the store has it, unless this streak's commits kept it.
    async fn context_of(&self, claimed: &ClaimedStep) -> Result<Vec<Message>, StepFailure> {
        match &claimed.context {
            Some(context) => Ok(context.clone()),
            None => Ok(self
                .coordinator
                .store()
                .context(&claimed.state.session_id, &claimed.state.run_id)
                .await?
                .into_iter()
                .map(|m| m.message)
                .collect()),
        }
    }

    async fn call_model(
        &self,
        claimed: &ClaimedStep,
        conclude: bool,
        started: ratchet_core::Millis,
        cancel: &CancellationToken,
    ) -> Result<Executed, StepFailure> {
        let state = &claimed.state;
        self.coordinator
            .announce(claimed, &ratchet_core::Activity::LoadingContext);
        let context = self.context_of(claimed).await?;
        let tools = if conclude {
            Vec::new()
        } else {
            state.config.tools.clone()
        };
        let messages = sent_to_model(context.clone(), state.config.limits.max_tool_result_bytes);
        let system_prompt = state.config.system_prompt.clone();
        // Before its first model call a run has no measure of its prompt: the context it
        // would send is measured, and compacted first when it is over the budget.
        if state.counters.context_tokens == 0 {
            let tokens = ratchet_core::brain::prompt_estimate(&system_prompt, &messages);
            match ratchet_core::brain::prompt_fit(state, tokens) {
                PromptFit::Fits => {}
                PromptFit::Compact => {
                    let mut measured = claimed.clone();
                    measured.state.counters.context_tokens = tokens;
                    let result = self.compress(&measured, started, cancel).await?;
                    return Ok(Executed {
                        result,
                        context: None,
                    });
                }
                PromptFit::TooLong => {
                    let reason = StopReason::BudgetExhausted;
                    let now = self.coordinator.now();
                    let result = finish_step(state.clone(), &claimed.job, reason, started, now);
                    return Ok(Executed {
                        result,
                        context: Some(context),
                    });
                }
            }
        }
        let (reply, delta) = self
            .invoke_model(claimed, system_prompt, messages, tools, true, cancel)
            .await?;
        let mut result = after_model(
            state.clone(),
            &claimed.job,
            reply,
            conclude,
            started,
            self.coordinator.now(),
        );
        if let Some(delta) = delta {
            result.events.insert(0, delta);
        }
        Ok(Executed {
            result,
            context: Some(context),
        })
    }

    /// Asks the model to summarise the older part of the context, keeping the most recent
    /// messages (up to half the prompt budget) verbatim. The kept part never starts with a
    /// tool result, so no call is separated from its result.
    async fn compress(
        &self,
        claimed: &ClaimedStep,
        started: ratchet_core::Millis,
        cancel: &CancellationToken,
    ) -> Result<StepResult, StepFailure> {
        let state = &claimed.state;
        self.coordinator
            .announce(claimed, &ratchet_core::Activity::LoadingContext);
        let context = (self.coordinator.store())
            .context(&state.session_id, &state.run_id)
            .await?;
        let budget = state.limits().max_prompt_tokens.unwrap_or(u64::MAX) / 2;
        let cut = compaction_cut(&context, budget);
        if cut == 0 {
            let result = after_compaction(
                state.clone(),
                &claimed.job,
                None,
                started,
                self.coordinator.now(),
            );
            return Ok(result);
        }
        let keeps_from = context
            .get(cut)
            .map_or_else(|| context[cut - 1].position + 1, |m| m.position);
        let kept_tokens = context[cut..]
            .iter()
            .map(|m| m.message.estimated_tokens())
            .sum();
        let mut messages = sent_to_model(
            context[..cut].iter().map(|m| m.message.clone()).collect(),
            state.config.limits.max_tool_result_bytes,
        );
        messages.push(Message::user(SUMMARY_REQUEST));
        let (reply, _) = self
            .invoke_model(
                claimed,
                SUMMARY_SYSTEM_PROMPT.to_owned(),
                messages,
                Vec::new(),
                false,
                cancel,
            )
            .await?;
        let compaction = Compaction {
            reply,
            keeps_from,
            summarized: cut,
            kept_tokens,
        };
        Ok(after_compaction(
            state.clone(),
            &claimed.job,
            Some(compaction),
            started,
            self.coordinator.now(),
        ))
    }

    /// One model call of the claimed step, written ahead as its intent (slot 0). Streamed
    /// text becomes `assistant.delta` events every `DELTA_FLUSH` when `show_deltas`; the
    /// returned event holds what was not flushed yet.
    async fn invoke_model(
        &self,
        claimed: &ClaimedStep,
        system_prompt: String,
        messages: Vec<Message>,
        tools: Vec<ratchet_core::ToolSpec>,
        show_deltas: bool,
        cancel: &CancellationToken,
    ) -> Result<(ratchet_core::ModelReply, Option<EventDraft>), StepFailure> {
        let state = &claimed.state;
        self.coordinator
            .announce(claimed, &ratchet_core::Activity::calling_model(state));
        let model = self
            .models
            .for_config(&state.config)
            .map_err(|e| StepFailure::Fatal(e.to_string()))?;
        // A model call is replay-safe: nothing is written before it, and it becomes durable
        // with the step's commit. Only a failed attempt is recorded (as the step's model
        // intent), so the retries it uses up survive a crash; claims lost to crashes do not
        // use them up.
        let attempt = self.failed_model_attempts(claimed).await? + 1;
        let chat = ratchet_telemetry::start_chat(&Context::current(), state);
        let prompt = self
            .capture
            .content
            .then(|| json!({"system": system_prompt, "messages": messages}).to_string());
        let request = ModelRequest {
            run_id: state.run_id.clone(),
            call_index: state.counters.model_calls,
            attempt,
            system_prompt,
            messages,
            tools,
            traceparent: ratchet_telemetry::traceparent(&chat),
        };
        let _permit = tokio::select! {
            permit = self.permits.model_call(root_session(state)) => permit,
            () = cancel.cancelled() => return Err(StepFailure::Cancelled),
        };
        let (deltas, mut incoming) = mpsc::unbounded_channel();
        let completion = model.complete(request, deltas, cancel.clone());
        tokio::pin!(completion);
        let mut pending = String::new();
        let mut last_flush = Instant::now();
        let reply = loop {
            tokio::select! {
                reply = &mut completion => break reply,
                Some(chunk) = incoming.recv() => {
                    if !show_deltas {
                        continue;
                    }
                    pending.push_str(&chunk);
                    if last_flush.elapsed() >= DELTA_FLUSH {
                        let text = std::mem::take(&mut pending);
                        self.coordinator
                            .append_events(&state.session_id, &state.run_id, vec![delta_event(state, text)])
                            .await?;
                        last_flush = Instant::now();
                        #[cfg(feature = "failpoints")]
                        fail::fail_point!("model.mid_stream", |_| std::process::abort());
                    }
                }
            }
        };
        while let Ok(chunk) = incoming.try_recv() {
            if show_deltas {
                pending.push_str(&chunk);
            }
        }
        let failure = reply.as_ref().err().map(ToString::to_string);
        let outcome = match (&reply, &failure) {
            (Ok(reply), _) => Ok(&reply.usage),
            (Err(_), failure) => Err(failure.as_deref().unwrap_or_default()),
        };
        ratchet_telemetry::end_chat(&chat, outcome, self.capture, || {
            let answer = (reply.as_ref())
                .map(|r| json!(r).to_string())
                .unwrap_or_default();
            (prompt.unwrap_or_default(), answer)
        });
        let reply = match reply {
            Ok(reply) => reply,
            Err(_) if cancel.is_cancelled() => return Err(StepFailure::Cancelled),
            Err(ratchet_llm::Error::Transient {
                message,
                retry_after,
            }) => {
                return Err(StepFailure::Transient {
                    message,
                    attempt: self.record_failed_model_attempt(claimed).await?,
                    retry_after,
                });
            }
            // The model stopped on its own, not because this run was cancelled: retry it.
            Err(ratchet_llm::Error::Cancelled) => {
                let message = "the model call was interrupted".to_owned();
                return Err(StepFailure::Transient {
                    message,
                    attempt: self.record_failed_model_attempt(claimed).await?,
                    retry_after: None,
                });
            }
            Err(ratchet_llm::Error::Fatal(message)) => return Err(StepFailure::Fatal(message)),
            Err(other) => return Err(StepFailure::Fatal(other.to_string())),
        };
        let delta = (!pending.is_empty()).then(|| delta_event(state, pending));
        Ok((reply, delta))
    }

    /// How many attempts of this step's model call have failed, as recorded by
    /// `record_failed_model_attempt`. Only a job claimed before can have any.
    async fn failed_model_attempts(&self, claimed: &ClaimedStep) -> Result<u32, StepFailure> {
        if claimed.job.attempt <= 1 {
            return Ok(0);
        }
        let recorded = (self.coordinator.store())
            .intents(&claimed.state.run_id, claimed.job.step_index)
            .await?;
        Ok(recorded
            .iter()
            .find(|r| r.slot == 0 && r.kind == IntentKind::Model)
            .map_or(0, |r| r.attempts))
    }

    /// Counts a failed attempt of this step's model call, durably, and returns how many have
    /// failed now: the number of the attempt that just failed.
    async fn record_failed_model_attempt(&self, claimed: &ClaimedStep) -> Result<u32, StepFailure> {
        let (state, job) = (&claimed.state, &claimed.job);
        let intent = Intent {
            slot: 0,
            kind: IntentKind::Model,
            name: state.config.model.clone(),
            idempotency_key: step_key(job, 0),
        };
        let attempts = self
            .coordinator
            .record_intents(&claimed.claim, vec![intent], Vec::new())
            .await?;
        Ok(attempts.first().copied().unwrap_or(1))
    }

    /// Runs the pending calls of the checkpoint, honouring what earlier attempts of this same
    /// step already did: recorded outcomes are reused, and a `never` call with an intent but
    /// no outcome is not run again — the run waits for reconciliation instead.
    async fn run_batch(
        &self,
        claimed: &ClaimedStep,
        started: ratchet_core::Millis,
        cancel: &CancellationToken,
        grace: Duration,
    ) -> Result<StepResult, StepFailure> {
        self.coordinator.announce(
            claimed,
            &ratchet_core::Activity::executing_tools(&claimed.state),
        );
        let (state, job) = (claimed.state.clone(), &claimed.job);
        let calls: Vec<ToolCall> = (state.checkpoint.iter())
            .flat_map(|c| c.calls.iter().map(|p| p.call.clone()))
            .collect();
        // Only a step claimed before may have left intents behind.
        let earlier: HashMap<u32, Option<ToolOutcome>> = if job.attempt > 1 {
            self.coordinator
                .store()
                .intents(&state.run_id, job.step_index)
                .await?
                .into_iter()
                .map(|r| (r.slot, r.outcome))
                .collect()
        } else {
            HashMap::new()
        };
        let plan = plan_batch(&state, job, &earlier, |name| {
            self.drift(&state.config, name)
        });
        let mut outcomes: Vec<Option<ToolOutcome>> = Vec::with_capacity(calls.len());
        let mut to_run = Vec::new();
        let mut invalid = 0;
        let mut unknown = Vec::new();
        let mut delegations = Vec::new();
        let mut waits = Vec::new();
        for ((slot, call), planned) in (0u32..).zip(&calls).zip(plan) {
            match planned {
                SlotPlan::Known(known) => {
                    outcomes.push(Some(known));
                    continue;
                }
                SlotPlan::InDoubt(in_doubt) => {
                    unknown.push(in_doubt);
                    outcomes.push(None);
                    continue;
                }
                SlotPlan::Run => {}
            }
            let injected = (state.config.tool(&call.name))
                .is_some_and(|spec| spec.delegation == ToolDelegation::RuntimeInjected);
            let checked = match call.name.as_str() {
                // A wait is performed by parking the run once the rest of the batch has run.
                WAIT_TOOL => match self.check_call(&state.config, call) {
                    Ok(_) => {
                        waits.push(slot);
                        outcomes.push(None);
                        continue;
                    }
                    Err(message) => Err(message),
                },
                DELEGATE_TOOL if injected => match read_delegate(&state, &call.arguments) {
                    Ok(request) => {
                        delegations.push(Delegation {
                            slot,
                            call_id: call.id.clone(),
                            request,
                        });
                        outcomes.push(None);
                        continue;
                    }
                    Err(message) => Err(message),
                },
                EMIT_SIGNAL_TOOL if injected => match &state.config.signal {
                    Some(contract) => Ok(Arc::new(EmitSignal {
                        coordinator: Arc::clone(&self.coordinator),
                        claim: claimed.claim.clone(),
                        contract: contract.clone(),
                        agent: state.lineage.as_ref().map(|l| l.agent.clone()),
                    }) as Arc<dyn Tool>),
                    None => Err("this run has no signal contract".to_owned()),
                },
                AGENT_TASK_TOOL if injected => Ok(Arc::new(AgentTask::for_run(
                    Arc::clone(&self.coordinator),
                    &state,
                )) as Arc<dyn Tool>),
                _ => self.check_call(&state.config, call),
            };
            match checked {
                Err(message) => {
                    invalid += 1;
                    outcomes.push(Some(ToolOutcome::error(message)));
                }
                Ok(tool) => {
                    to_run.push((slot, tool, call.clone()));
                    outcomes.push(None);
                }
            }
        }
        // Nothing of the batch runs while any outcome is in doubt: the human answers first.
        if !unknown.is_empty() {
            return Ok(ask_reconciliation(
                state,
                job,
                outcomes,
                unknown,
                started,
                self.coordinator.now(),
            ));
        }
        if !delegations.is_empty()
            && let Err(refusal) = admit(&self.coordinator, &state, &delegations).await?
        {
            for refused in delegations.drain(..) {
                outcomes[refused.slot as usize] = Some(ToolOutcome::error(refusal.clone()));
            }
        }
        // A delegating call's span is where the spans of the runs it starts hang (its id is
        // derived, see `ratchet_core::trace`); it lasts while the batch runs.
        let delegation_spans: Vec<Context> = (delegations.iter())
            .map(|delegation| {
                let call = ToolCallSpan {
                    tool: DELEGATE_TOOL,
                    call_id: &delegation.call_id,
                    slot: delegation.slot,
                    replay: ReplayPolicy::Safe,
                };
                ratchet_telemetry::start_tool(&Context::current(), &state, job, call)
            })
            .collect();
        let workspace = state.config.workspace.as_ref().map(PathBuf::from);
        let parallel = state.config.limits.max_parallel.max(1) as usize;
        let memory: Arc<dyn MemorySearch> = Arc::new(StoreMemory::new(
            Arc::clone(self.coordinator.store()),
            state.config.memory_scope,
        ));
        let runs = to_run
            .into_iter()
            .map(|(slot, tool, call)| {
                let spec = state.config.tool(&call.name);
                // A runtime-injected tool is not in the registry's specs; it never leaves
                // an effect outside the store, so it replays safely.
                let replay = spec.map_or(ReplayPolicy::Safe, |s| s.replay);
                let limits = spec.map_or_else(CallLimits::default, |s| s.calls);
                let span = ratchet_telemetry::start_tool(
                    &Context::current(),
                    &state,
                    job,
                    ToolCallSpan {
                        tool: &call.name,
                        call_id: &call.id,
                        slot,
                        replay,
                    },
                );
                let context = ToolContext {
                    workspace: workspace.clone(),
                    idempotency_key: call_key(&state, job, slot),
                    cancel: cancel.child_token(),
                    session_id: state.session_id.clone(),
                    memory: Some(Arc::clone(&memory)),
                    input: state.lineage.is_none().then(|| {
                        Arc::new(SessionInput::new(
                            Arc::clone(&self.coordinator),
                            state.session_id.clone(),
                            state.checkpoint.as_ref().and_then(|c| c.asked_at),
                        )) as Arc<dyn InputWatch>
                    }),
                    traceparent: ratchet_telemetry::traceparent(&span),
                };
                let planned = PlannedCall {
                    slot,
                    tool,
                    call,
                    replay,
                    limits,
                    context,
                };
                let run = run_call(
                    Arc::clone(&self.coordinator),
                    &self.permits,
                    root_session(&state),
                    claimed.claim.clone(),
                    planned,
                    grace,
                )
                .with_context(span.clone());
                async move {
                    let finished = run.await;
                    let error = match &finished {
                        Ok(CallRun {
                            end: CallEnd::Known(outcome),
                            ..
                        }) => outcome.is_error.then_some(outcome.content.as_str()),
                        Ok(CallRun {
                            end: CallEnd::InDoubt,
                            ..
                        }) => Some("the call's outcome is unknown"),
                        Ok(CallRun {
                            end: CallEnd::NotStarted,
                            ..
                        }) => Some("the step was cut off before the call started"),
                        Err(_) => Some("the call could not be recorded"),
                    };
                    ratchet_telemetry::end_tool(&span, error);
                    finished
                }
            })
            .collect::<Vec<_>>();
        let mut finished: Vec<CallRun> = stream::iter(runs)
            .buffer_unordered(parallel)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()?;
        // The calls' events go to the commit in the batch's order, before the step's own.
        finished.sort_by_key(|run| run.slot);
        let cut_off = cancel.is_cancelled()
            || (finished.iter()).any(|run| matches!(run.end, CallEnd::NotStarted));
        if cut_off {
            return Err(cut_off_batch(outcomes, finished));
        }
        let mut call_events = Vec::new();
        for CallRun { slot, end, events } in finished {
            call_events.extend(events);
            match end {
                CallEnd::Known(outcome) => outcomes[slot as usize] = Some(outcome),
                CallEnd::InDoubt | CallEnd::NotStarted => {
                    unknown.push(unknown_call(&state, job, slot, &calls[slot as usize]));
                }
            }
        }
        // A call in doubt stops the batch where a crash would have: the human answers first,
        // and nothing else of the batch (no child run) starts.
        if !unknown.is_empty() {
            let result = ask_reconciliation(
                state,
                job,
                outcomes,
                unknown,
                started,
                self.coordinator.now(),
            );
            return Ok(with_call_events(result, call_events));
        }
        for span in &delegation_spans {
            ratchet_telemetry::end_tool(span, None);
        }
        let children = crate::delegation::children(&state, job, &delegations)
            .map_err(|e| StepFailure::Fatal(e.to_string()))?;
        // A background call's outcome is known now: the runs it starts, with their ids.
        for delegation in &delegations {
            if delegation.request.mode == DelegationMode::Background {
                let started: Vec<&ChildRun> = children
                    .iter()
                    .filter(|c| c.lineage.parent_slot == delegation.slot)
                    .collect();
                let policy = delegation.request.completion_policy.unwrap_or_default();
                outcomes[delegation.slot as usize] = Some(background_started(&started, policy));
            }
        }
        let awaits_children = delegations
            .iter()
            .any(|d| d.request.mode == DelegationMode::Foreground);
        let now = self.coordinator.now();
        let wait_calls: Vec<(u32, &serde_json::Value)> = (waits.iter())
            .map(|&slot| (slot, &calls[slot as usize].arguments))
            .collect();
        let waits = plan_waits(&state, &wait_calls, awaits_children, now);
        for (slot, refusal) in waits.refused {
            outcomes[slot as usize] = Some(refusal);
        }
        if awaits_children {
            let result = await_children(
                state,
                job,
                outcomes,
                children,
                started,
                self.coordinator.now(),
            );
            return Ok(with_call_events(result, call_events));
        }
        if let Some(parks) = waits.parks {
            let mut result = await_timer(state, job, outcomes, parks, started, now);
            start_in_background(&mut result, children);
            return Ok(with_call_events(result, call_events));
        }
        let outcomes = outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| ToolOutcome::error("the call produced no outcome")))
            .collect();
        // Background runs start even when this step ends the run: the call's outcome named them,
        // and they report to the session, not to this run.
        let mut result = after_tools(
            state,
            job,
            outcomes,
            invalid,
            started,
            self.coordinator.now(),
        );
        start_in_background(&mut result, children);
        Ok(with_call_events(result, call_events))
    }

    /// How the tool a call names differs from what the model was offered, if it does: gone
    /// from this process, or with another argument schema (a new version, a reloaded MCP
    /// server). Such a call does not run before a human has looked at it.
    fn drift(&self, config: &RunConfigSnapshot, name: &str) -> Option<String> {
        let offered = config.tool(name)?;
        match self.tools.parameters(name) {
            None => Some(format!(
                "tool {name:?} was offered to the model but this process does not have it"
            )),
            Some(current) if current != offered.parameters => Some(format!(
                "tool {name:?} takes other arguments now than when it was offered to the model"
            )),
            Some(_) => None,
        }
    }

    /// A call may run when the run's frozen config offers the tool, this process has it, and
    /// the arguments match its schema. The error text is shown to the model.
    fn check_call(
        &self,
        config: &RunConfigSnapshot,
        call: &ToolCall,
    ) -> Result<Arc<dyn Tool>, String> {
        if config.tool(&call.name).is_none() {
            let offered: Vec<&str> = config.tools.iter().map(|t| t.name.as_str()).collect();
            return Err(ratchet_tools::unknown_tool(&call.name, &offered));
        }
        self.tools.validate(&call.name, &call.arguments)
    }
}

/// How a call of a batch ended.
enum CallEnd {
    /// Its outcome, recorded: the model will read it.
    Known(ToolOutcome),
    /// Nobody knows whether it took effect, and its replay policy forbids trying again (or
    /// the step was cut off while it ran): a human must say what happened before the batch
    /// goes on.
    InDoubt,
    /// The step was cut off before it started.
    NotStarted,
}

/// One call of a batch with what it needs to run.
struct PlannedCall {
    slot: u32,
    tool: Arc<dyn Tool>,
    call: ToolCall,
    replay: ReplayPolicy,
    limits: CallLimits,
    context: ToolContext,
}

/// Runs one call of a batch. A panicking tool is an error outcome, never a crashed worker. An
/// attempt whose outcome is unknown (it timed out, lost its connection, or ignored a cancel
/// past the grace period) is tried again or not as `effect::after_unknown` says; an unknown
/// outcome is never recorded as the call's.
///
/// Only a `never` call writes ahead: its intent (with the `tool.call` event) is durable before
/// each attempt and its outcome right after — even when the step was cancelled meanwhile, for
/// the effect happened. A `safe` or `keyed` call may simply run again after a crash (a keyed
/// one under the same key), so it writes nothing of its own: its events are handed back
/// and become durable with the step's commit, and its outcome with the step's messages.
async fn run_call(
    coordinator: Arc<Coordinator>,
    permits: &StepPermits,
    session: &SessionId,
    claim: Claim,
    planned: PlannedCall,
    grace: Duration,
) -> Result<CallRun, StepFailure> {
    let PlannedCall {
        slot,
        tool,
        call,
        replay,
        limits,
        context,
    } = planned;
    let not_started = |events| CallRun {
        slot,
        end: CallEnd::NotStarted,
        events,
    };
    let permit = tokio::select! {
        permit = permits.tool_call(session) => permit,
        () = context.cancel.cancelled() => return Ok(not_started(Vec::new())),
    };
    let writes_ahead = replay == ReplayPolicy::Never;
    let mut events = Vec::new();
    let mut attempt = 0;
    let end = loop {
        attempt += 1;
        // Read before the token: an attempt that starts is stamped no later than any cancel
        // that this process accepted after it.
        let started_at = coordinator.now();
        // A retry after an unknown outcome is not a first start: the call stays in doubt.
        if context.cancel.is_cancelled() && attempt == 1 {
            return Ok(not_started(events));
        }
        if context.cancel.is_cancelled() {
            break CallEnd::InDoubt;
        }
        let announce = EventDraft::new(
            EventKind::ToolCall,
            json!({
                "run_id": claim.run_id,
                "step_index": claim.step_index,
                "call_id": call.id,
                "tool": call.name,
                "arguments": call.arguments,
                "attempt": attempt,
                // A replay-safe call's event is stored with its step's commit, later than the
                // call started: the payload says when it did.
                "started_at": started_at,
            }),
        );
        if writes_ahead {
            let intent = Intent {
                slot,
                kind: IntentKind::Tool,
                name: call.name.clone(),
                idempotency_key: context.idempotency_key.clone(),
            };
            match coordinator
                .record_intents(&claim, vec![intent], vec![announce])
                .await
            {
                Ok(_) => {}
                // A cancel accepted by any process refuses the intent: the call never starts.
                Err(crate::Error::Store(ratchet_store::Error::CancelRequested { .. }))
                    if attempt == 1 =>
                {
                    return Ok(not_started(events));
                }
                Err(crate::Error::Store(ratchet_store::Error::CancelRequested { .. })) => {
                    break CallEnd::InDoubt;
                }
                Err(error) => return Err(error.into()),
            }
        } else {
            events.push(announce);
        }
        let outcome = attempt_call(&tool, &call, &context, limits, grace).await;
        if !outcome.unknown {
            break CallEnd::Known(outcome);
        }
        let unknown = unknown_event(&claim, &call, attempt, &outcome.content);
        if writes_ahead {
            coordinator
                .append_events(&context.session_id, &claim.run_id, vec![unknown])
                .await?;
        } else {
            events.push(unknown);
        }
        match after_unknown(replay, attempt, limits) {
            AfterUnknown::Retry if !context.cancel.is_cancelled() => {}
            AfterUnknown::Retry | AfterUnknown::Reconcile => break CallEnd::InDoubt,
            AfterUnknown::Fail => {
                break CallEnd::Known(ToolOutcome::error(format!(
                    "the outcome stayed unknown after {attempt} attempt(s): {}",
                    outcome.content
                )));
            }
        }
    };
    drop(permit);
    if let (true, CallEnd::Known(outcome)) = (writes_ahead, &end) {
        coordinator
            .record_outcome(&claim, slot, outcome.clone())
            .await?;
    }
    #[cfg(feature = "failpoints")]
    fail::fail_point!("tools.between_calls", |_| std::process::abort());
    Ok(CallRun { slot, end, events })
}

/// How each call of a batch stood when the batch was cut off: the outcomes known before it ran
/// (recorded earlier, refused, invalid) and what each call that was run came to.
fn cut_off_batch(known: Vec<Option<ToolOutcome>>, finished: Vec<CallRun>) -> StepFailure {
    let mut endings: Vec<CallEnding> = (known.into_iter())
        .map(|outcome| outcome.map_or(CallEnding::NotStarted, CallEnding::Known))
        .collect();
    let mut events = Vec::new();
    for CallRun {
        slot,
        end,
        events: left,
    } in finished
    {
        events.extend(left);
        endings[slot as usize] = match end {
            CallEnd::Known(outcome) => CallEnding::Known(outcome),
            CallEnd::InDoubt => CallEnding::CutOff,
            CallEnd::NotStarted => CallEnding::NotStarted,
        };
    }
    StepFailure::CutOff { endings, events }
}

/// `endings` with what the step's intents recorded: an outcome is known whatever this attempt
/// saw, and a `never` call with an intent and no outcome started.
pub(crate) fn with_intents(
    mut endings: Vec<CallEnding>,
    intents: &[IntentRecord],
) -> Vec<CallEnding> {
    for intent in intents.iter().filter(|i| i.kind == IntentKind::Tool) {
        let Some(ending) = endings.get_mut(intent.slot as usize) else {
            continue;
        };
        *ending = match (&intent.outcome, &ending) {
            (Some(outcome), _) => CallEnding::Known(outcome.clone()),
            (None, CallEnding::Known(_)) => continue,
            (None, _) => CallEnding::CutOff,
        };
    }
    endings
}

/// Puts the events the batch's calls left for the commit ahead of the step's own, so each
/// `tool.call` precedes the result that answers it.
fn with_call_events(mut result: StepResult, call_events: Vec<EventDraft>) -> StepResult {
    result.events.splice(0..0, call_events);
    result
}

/// What running one call of a batch gave: how it ended, and the events it left for the
/// step's commit (none for a `never` call, whose events were written ahead).
struct CallRun {
    slot: u32,
    end: CallEnd,
    events: Vec<EventDraft>,
}

async fn attempt_call(
    tool: &Arc<dyn Tool>,
    call: &ToolCall,
    context: &ToolContext,
    limits: CallLimits,
    grace: Duration,
) -> ToolOutcome {
    let task = {
        let (tool, arguments, context) =
            (Arc::clone(tool), call.arguments.clone(), context.clone());
        tokio::spawn(async move { tool.call(arguments, &context).await })
    };
    let aborter = task.abort_handle();
    let joined = |joined: Result<ToolOutcome, tokio::task::JoinError>| {
        joined.unwrap_or_else(|_| ToolOutcome::error(format!("tool {} panicked", call.name)))
    };
    let timeout = Duration::from_millis(limits.timeout_ms);
    tokio::pin!(task);
    let outcome = tokio::select! {
        done = &mut task => return joined(done),
        () = tokio::time::sleep(timeout) => ToolOutcome::unknown(format!(
            "no answer within its timeout of {} ms",
            limits.timeout_ms
        )),
        () = context.cancel.cancelled() => {
            match tokio::time::timeout(grace, &mut task).await {
                Ok(done) => return joined(done),
                Err(_) => ToolOutcome::unknown(format!(
                    "cut off {} ms after the step was cancelled",
                    grace.as_millis()
                )),
            }
        }
    };
    aborter.abort();
    outcome
}

fn unknown_event(claim: &Claim, call: &ToolCall, attempt: u32, reason: &str) -> EventDraft {
    EventDraft::new(
        EventKind::ToolOutcomeUnknown,
        json!({
            "run_id": claim.run_id,
            "step_index": claim.step_index,
            "call_id": call.id,
            "tool": call.name,
            "attempt": attempt,
            "reason": reason,
        }),
    )
}

/// Parks the batch until a human has said what happened to each call in `unknown`; the
/// outcomes known so far are kept.
fn ask_reconciliation(
    state: AgentState,
    job: &StepJob,
    outcomes: Vec<Option<ToolOutcome>>,
    mut unknown: Vec<UnknownCall>,
    started: ratchet_core::Millis,
    now: ratchet_core::Millis,
) -> StepResult {
    unknown.sort_by_key(|c| c.call_index);
    let request = HumanRequest::Reconciliation { calls: unknown };
    await_reconciliation(state, job, outcomes, request, started, now)
}

/// The session a run's permits are counted against: its tree's root session.
fn root_session(state: &AgentState) -> &SessionId {
    state
        .lineage
        .as_ref()
        .map_or(&state.session_id, |l| &l.root_session_id)
}

/// Where a context is cut for a compaction: the earliest index from which the messages fit
/// in `budget` estimated tokens, moved later past any tool result (a tool result stays with
/// the call it answers). 0 when there is nothing before it to summarise.
fn compaction_cut(context: &[StoredMessage], budget: u64) -> usize {
    let mut kept = 0u64;
    let mut cut = context.len();
    for (i, stored) in context.iter().enumerate().rev() {
        kept += stored.message.estimated_tokens();
        if kept > budget {
            break;
        }
        cut = i;
    }
    while context
        .get(cut)
        .is_some_and(|m| m.message.role == ratchet_core::Role::Tool)
    {
        cut += 1;
    }
    cut
}

fn delta_event(state: &AgentState, text: String) -> EventDraft {
    EventDraft::new(
        EventKind::AssistantDelta,
        json!({"run_id": state.run_id, "text": text}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_context_grows_by_what_a_commit_added_and_a_summary_drops_it() {
        let asked = vec![Message::user("hi")];
        let answer = Message::assistant("hello", Vec::new());
        assert_eq!(
            context_after(Some(asked.clone()), std::slice::from_ref(&answer)),
            Some(vec![
                Message::user("hi"),
                Message::assistant("hello", Vec::new())
            ])
        );
        assert_eq!(
            context_after(None, &[answer]),
            None,
            "nothing kept to extend"
        );
        let summary = Message {
            keeps_from: Some(7),
            ..Message::assistant("summary", Vec::new())
        };
        assert_eq!(context_after(Some(asked), &[summary]), None);
    }
}
