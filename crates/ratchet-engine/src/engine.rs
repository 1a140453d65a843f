//! The Engine executes the one instruction of a step and returns its `StepResult`. It writes
//! only write-ahead intents, tool outcomes and streamed deltas — never state, never jobs; the
//! worker hands the result to the Coordinator to commit.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::stream::{self, StreamExt};
use ratchet_core::step::{after_model, after_tools, await_reconciliation, finish_step};
use ratchet_core::{
    AgentState, EventDraft, EventKind, HumanRequest, Instruction, ReplayPolicy, SessionId, StepJob,
    StepResult, ToolCall, ToolOutcome, decide,
};
use ratchet_llm::ModelRequest;
use ratchet_store::{ClaimedStep, Intent, IntentKind};
use ratchet_tools::{Registry, Tool, ToolContext};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::{Coordinator, Models, now_ms};

/// How often streamed text is written as an `assistant.delta` event while a model talks.
const DELTA_FLUSH: Duration = Duration::from_millis(100);

/// Why a step produced no result to commit.
#[derive(Debug, thiserror::Error)]
pub enum StepFailure {
    /// Worth another attempt later (a model's HTTP 5xx or timeout).
    #[error("{0}")]
    Transient(String),
    /// Will not get better by retrying (the run's model cannot be loaded here).
    #[error("{0}")]
    Fatal(String),
    #[error("step cancelled")]
    Cancelled,
    /// Another worker holds the step now; this one must drop it without a word.
    #[error("lease lost")]
    LeaseLost,
    #[error(transparent)]
    Infrastructure(#[from] crate::Error),
}

impl From<ratchet_store::Error> for StepFailure {
    fn from(error: ratchet_store::Error) -> Self {
        StepFailure::Infrastructure(error.into())
    }
}

pub struct Engine {
    coordinator: Arc<Coordinator>,
    models: Arc<Models>,
    tools: Arc<Registry>,
}

impl Engine {
    pub fn new(coordinator: Arc<Coordinator>, models: Arc<Models>, tools: Arc<Registry>) -> Engine {
        Engine {
            coordinator,
            models,
            tools,
        }
    }

    pub async fn execute(
        &self,
        claimed: &ClaimedStep,
        cancel: &CancellationToken,
    ) -> Result<StepResult, StepFailure> {
        let started = now_ms();
        let state = claimed.state.clone();
        let job = &claimed.job;
        match decide(&state, job.phase) {
            Instruction::Finish(reason) => Ok(finish_step(state, job, reason, started, now_ms())),
            Instruction::CallLlm { conclude } => {
                self.call_model(state, job, conclude, started, cancel).await
            }
            Instruction::CallToolsBatch => self.run_batch(state, job, started, cancel).await,
        }
    }

    async fn call_model(
        &self,
        state: AgentState,
        job: &StepJob,
        conclude: bool,
        started: ratchet_core::Millis,
        cancel: &CancellationToken,
    ) -> Result<StepResult, StepFailure> {
        let model = self
            .models
            .resolve(&state.config.model)
            .map_err(|e| StepFailure::Fatal(e.to_string()))?;
        let store = self.coordinator.store();
        let intent = Intent {
            run_id: state.run_id.clone(),
            step_index: job.step_index,
            slot: 0,
            kind: IntentKind::Model,
            name: state.config.model.clone(),
            idempotency_key: idempotency_key(job, 0),
        };
        self.coordinator
            .record_intents(&state.session_id, vec![intent], Vec::new())
            .await?;
        let request = ModelRequest {
            run_id: state.run_id.clone(),
            call_index: state.counters.model_calls,
            attempt: job.attempt,
            system_prompt: state.config.system_prompt.clone(),
            messages: store.history(&state.session_id).await?,
            tools: if conclude {
                Vec::new()
            } else {
                state.config.tools.clone()
            },
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
                    pending.push_str(&chunk);
                    if last_flush.elapsed() >= DELTA_FLUSH {
                        let text = std::mem::take(&mut pending);
                        self.coordinator
                            .append_events(&state.session_id, &state.run_id, vec![delta_event(&state, text)])
                            .await?;
                        last_flush = Instant::now();
                    }
                }
            }
        };
        while let Ok(chunk) = incoming.try_recv() {
            pending.push_str(&chunk);
        }
        let reply = match reply {
            Ok(reply) => reply,
            Err(ratchet_llm::Error::Cancelled) => return Err(StepFailure::Cancelled),
            Err(ratchet_llm::Error::Transient(message)) => {
                return Err(StepFailure::Transient(message));
            }
            Err(other) => return Err(StepFailure::Fatal(other.to_string())),
        };
        let delta = (!pending.is_empty()).then(|| delta_event(&state, pending));
        let mut result = after_model(state, job, reply, conclude, started, now_ms());
        if let Some(delta) = delta {
            result.events.insert(0, delta);
        }
        Ok(result)
    }

    /// Runs the pending calls of the checkpoint, honouring what earlier attempts of this same
    /// step already did: recorded outcomes are reused, and a `never` call with an intent but
    /// no outcome is not run again — the run waits for reconciliation instead.
    async fn run_batch(
        &self,
        state: AgentState,
        job: &StepJob,
        started: ratchet_core::Millis,
        cancel: &CancellationToken,
    ) -> Result<StepResult, StepFailure> {
        let store = self.coordinator.store();
        let calls: Vec<(ToolCall, Option<ToolOutcome>)> = state
            .checkpoint
            .as_ref()
            .map(|c| {
                c.calls
                    .iter()
                    .map(|p| (p.call.clone(), p.outcome.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let earlier: HashMap<u32, _> = if job.attempt > 1 {
            store
                .intents(&state.run_id, job.step_index)
                .await?
                .into_iter()
                .map(|r| (r.slot, r))
                .collect()
        } else {
            HashMap::new()
        };
        let mut outcomes: Vec<Option<ToolOutcome>> = Vec::with_capacity(calls.len());
        let mut to_run = Vec::new();
        let mut invalid = 0;
        let mut unknown_outcome = None;
        for (slot, (call, known)) in calls.iter().enumerate() {
            let slot = slot as u32;
            if let Some(known) = known
                .clone()
                .or_else(|| earlier.get(&slot).and_then(|r| r.outcome.clone()))
            {
                outcomes.push(Some(known));
                continue;
            }
            let checked = match state.config.tool(&call.name) {
                None => Err(format!(
                    "unknown tool {:?}; available tools: {}",
                    call.name,
                    state
                        .config
                        .tools
                        .iter()
                        .map(|t| t.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )),
                Some(spec) => self
                    .tools
                    .validate(&call.name, &call.arguments)
                    .map(|tool| (tool, spec.replay)),
            };
            match checked {
                Err(message) => {
                    invalid += 1;
                    outcomes.push(Some(ToolOutcome::error(message)));
                }
                Ok((_, ReplayPolicy::Never)) if earlier.contains_key(&slot) => {
                    unknown_outcome.get_or_insert(slot);
                    outcomes.push(None);
                }
                Ok((tool, _)) => {
                    to_run.push((slot, tool, call.clone()));
                    outcomes.push(None);
                }
            }
        }
        if let Some(slot) = unknown_outcome {
            let call = &calls[slot as usize].0;
            let request = HumanRequest::Reconciliation {
                call_index: slot as usize,
                call_id: call.id.clone(),
                tool: call.name.clone(),
                arguments: call.arguments.clone(),
                idempotency_key: idempotency_key(job, slot),
            };
            return Ok(await_reconciliation(
                state,
                job,
                outcomes,
                request,
                started,
                now_ms(),
            ));
        }
        let workspace = state.config.workspace.as_ref().map(PathBuf::from);
        let parallel = state.config.limits.max_parallel.max(1) as usize;
        let runs = to_run
            .into_iter()
            .map(|(slot, tool, call)| {
                let context = ToolContext {
                    workspace: workspace.clone(),
                    idempotency_key: idempotency_key(job, slot),
                    cancel: cancel.child_token(),
                };
                run_call(
                    Arc::clone(&self.coordinator),
                    state.session_id.clone(),
                    job.clone(),
                    slot,
                    tool,
                    call,
                    context,
                )
            })
            .collect::<Vec<_>>();
        let finished: Vec<Result<(u32, ToolOutcome), StepFailure>> = stream::iter(runs)
            .buffer_unordered(parallel)
            .collect()
            .await;
        for done in finished {
            let (slot, outcome) = done?;
            outcomes[slot as usize] = Some(outcome);
        }
        let outcomes = outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| ToolOutcome::error("the call produced no outcome")))
            .collect();
        Ok(after_tools(
            state,
            job,
            outcomes,
            invalid,
            started,
            now_ms(),
        ))
    }
}

/// Records the intent, runs the call, records its outcome. A panicking tool is an error
/// outcome, never a crashed worker.
async fn run_call(
    coordinator: Arc<Coordinator>,
    session_id: SessionId,
    job: StepJob,
    slot: u32,
    tool: Arc<dyn Tool>,
    call: ToolCall,
    context: ToolContext,
) -> Result<(u32, ToolOutcome), StepFailure> {
    let intent = Intent {
        run_id: job.run_id.clone(),
        step_index: job.step_index,
        slot,
        kind: IntentKind::Tool,
        name: call.name.clone(),
        idempotency_key: context.idempotency_key.clone(),
    };
    let announce = EventDraft::new(
        EventKind::ToolCall,
        json!({
            "run_id": job.run_id,
            "step_index": job.step_index,
            "call_id": call.id,
            "tool": call.name,
            "arguments": call.arguments,
        }),
    );
    coordinator
        .record_intents(&session_id, vec![intent], vec![announce])
        .await?;
    let outcome = std::panic::AssertUnwindSafe(tool.call(call.arguments, &context))
        .catch_unwind()
        .await
        .unwrap_or_else(|_| ToolOutcome::error(format!("tool {} panicked", call.name)));
    if context.cancel.is_cancelled() {
        return Err(StepFailure::Cancelled);
    }
    coordinator
        .store()
        .record_outcome(&job.run_id, job.step_index, slot, outcome.clone(), now_ms())
        .await?;
    Ok((slot, outcome))
}

/// Deterministic per call, so a tool sees the same key after a crash: `{run}#{step}#{slot}`.
fn idempotency_key(job: &StepJob, slot: u32) -> String {
    format!("{}#{}#{}", job.run_id, job.step_index, slot)
}

fn delta_event(state: &AgentState, text: String) -> EventDraft {
    EventDraft::new(
        EventKind::AssistantDelta,
        json!({"run_id": state.run_id, "text": text}),
    )
}
