//! Forking a run: which step of a run may be forked, what the fork's history is, what an edit
//! replaces, and the state the fork starts in.
//!
//! A run's state is stored only as of its last step, so the state "as committed by step N" is
//! derived here from what every step leaves behind for good: the session's messages, named
//! after the step that wrote them, and what the source recorded of the `never` calls it
//! started. Nothing here reads the store; the store hands the pieces in and writes the plan.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::step::{start_run, status_event};
use crate::{
    AgentState, EventDraft, EventKind, HumanRequest, Message, Millis, Origin, Phase, ReplayPolicy,
    Role, RunConfigSnapshot, RunId, RunStatus, SessionId, StepJob, StepRecord, ToolCheckpoint,
    ToolOutcome, UnknownCall,
};

/// Where a fork came from: its source run and the step of it the fork continues from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkedFrom {
    pub run_id: RunId,
    pub step: u64,
}

/// What a fork changes before its first model call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum ForkEdit {
    /// The last user message at or before the fork's step says this instead; what answered
    /// the old text is left out, and the fork calls the model first.
    ReplaceUserMessage(String),
    /// The call `call_id` (of the batch pending at the fork's step, or answered at or before
    /// it) returned `result`; the fork's history ends with that call's batch, and the model is
    /// called with every result of it.
    ReplaceToolResult { call_id: String, result: String },
}

/// A message of the source's session as the fork's history may copy it.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceMessage {
    pub message: Message,
    /// The step of the source run that wrote it; None for what was there before the run's
    /// first step (earlier turns, the run's own input).
    pub step: Option<u64>,
}

/// The source run, as the store read it under the source session's lock.
#[derive(Debug, Clone)]
pub struct Source<'a> {
    pub run_id: &'a RunId,
    /// Its last committed step.
    pub committed: u64,
    /// A continuation turn: its messages are drafts, and its job is the inbox's.
    pub continuation: bool,
    /// The record of the step forked at, when that step is committed.
    pub step: Option<&'a StepRecord>,
    /// The session's history as step N left it, in order (see `history_through`).
    pub history: &'a [SourceMessage],
    /// What the source recorded, by slot, of the calls of the batch pending at the step (its
    /// intents: an outcome, or None for a call started and never heard of again).
    pub started: &'a HashMap<u32, Option<ToolOutcome>>,
    /// The source's state as it stands: its frozen configuration decides which of its calls
    /// are `never`, and its open batch, if any, is one it may still run calls of.
    pub state: &'a AgentState,
}

impl Source<'_> {
    /// The source's checkpoint when it is the batch `calls` asked for.
    fn checkpoint_of(&self, calls: &[crate::ToolCall]) -> Option<&ToolCheckpoint> {
        (self.state.checkpoint.as_ref())
            .filter(|c| (c.calls.iter().map(|p| &p.call.id)).eq(calls.iter().map(|c| &c.id)))
    }

    /// Whether the source holds open the batch `calls` asked for and may yet run calls of it:
    /// while it has not ended, or when it failed with the batch cut off (`continue` carries it
    /// on).
    fn still_runs(&self, calls: &[crate::ToolCall]) -> bool {
        self.checkpoint_of(calls).is_some_and(|checkpoint| {
            (!self.state.status.is_terminal() || checkpoint.cut_off) && checkpoint.has_pending()
        })
    }
}

/// Why a fork was refused; the request could never succeed as given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForkError {
    #[error("at_step must be a committed step of run {run_id}, 1 to {committed}; found {at_step}")]
    NoSuchStep {
        run_id: RunId,
        at_step: u64,
        committed: u64,
    },
    #[error(
        "run {run_id} is a continuation turn, which reports background work to its session's inbox; fork a user's turn instead"
    )]
    Continuation { run_id: RunId },
    #[error(
        "step {at_step} of run {run_id} waits for the child runs its delegation started, and a fork does not adopt another run's children: fork at step {} to delegate anew, or at a step after they joined",
        .at_step.saturating_sub(1)
    )]
    WaitsForChildren { run_id: RunId, at_step: u64 },
    #[error(
        "step {at_step} of run {run_id} ended the run with its answer: there is nothing to continue; fork with an edit (replace_user_message or replace_tool_result), or at an earlier step"
    )]
    NothingToContinue { run_id: RunId, at_step: u64 },
    #[error("replace_user_message: run {run_id} has no user message at or before step {at_step}")]
    NoUserMessage { run_id: RunId, at_step: u64 },
    #[error(
        "replace_tool_result: no call {call_id:?} was asked for at or before step {at_step} of run {run_id}; calls there: {known}"
    )]
    UnknownCall {
        run_id: RunId,
        at_step: u64,
        call_id: String,
        known: String,
    },
}

/// How a fork begins.
#[derive(Debug, Clone, PartialEq)]
pub enum ForkStart {
    /// Its first job wakes it with this phase.
    Step(Phase),
    /// A `never` call the source started has no known outcome: like a resume, the fork waits
    /// for a human to say what happened before anything of the batch runs.
    Reconcile(Vec<UnknownCall>),
}

/// What a fork is created with.
#[derive(Debug, Clone, PartialEq)]
pub struct ForkPlan {
    /// The fork's history, in order: each message with the index in `Source::history` it was
    /// copied from (for a summary's `keeps_from`, which names a position).
    pub messages: Vec<(usize, Message)>,
    /// The batch pending at the fork's step, with the outcomes already known.
    pub checkpoint: Option<ToolCheckpoint>,
    pub start: ForkStart,
}

/// The messages of a session that step `at_step` of the source left, given the session's
/// messages in order and which step of the source wrote each: everything up to the last
/// message written at or before that step, or before the first one written after it. Ends
/// before the first message a later step wrote; nothing else of the session follows a run's
/// messages while it is active, and what later turns wrote comes after the run's last.
pub fn history_through(messages: Vec<SourceMessage>, at_step: u64) -> Vec<SourceMessage> {
    let end = (messages.iter()).position(|m| m.step.is_some_and(|s| s > at_step));
    let last_of_run = (messages.iter()).rposition(|m| m.step.is_some());
    let end = match (end, last_of_run) {
        (Some(end), _) => end,
        (None, Some(last)) => last + 1,
        (None, None) => messages.len(),
    };
    messages.into_iter().take(end).collect()
}

/// The step of the source that asked for the batch still pending at the end of `history`
/// (an assistant message with calls and no results after it), if any: the store reads the
/// source's intents of that batch from the steps after it.
pub fn pending_batch_step(history: &[SourceMessage]) -> Option<u64> {
    pending_batch(history).and_then(|i| history[i].step)
}

fn pending_batch(history: &[SourceMessage]) -> Option<usize> {
    let last = history.len().checked_sub(1)?;
    let message = &history[last].message;
    (message.role == Role::Assistant && !message.tool_calls.is_empty()).then_some(last)
}

/// Decides whether the source may be forked at `at_step` and how: the fork's history, the batch
/// it picks up and how it begins.
pub fn plan(
    source: &Source<'_>,
    at_step: u64,
    edit: Option<&ForkEdit>,
) -> Result<ForkPlan, ForkError> {
    let run_id = source.run_id.clone();
    if source.continuation {
        return Err(ForkError::Continuation { run_id });
    }
    let Some(step) = source
        .step
        .filter(|_| at_step >= 1 && at_step <= source.committed)
    else {
        return Err(ForkError::NoSuchStep {
            run_id,
            at_step,
            committed: source.committed,
        });
    };
    if step.summary.get("children").is_some() {
        return Err(ForkError::WaitsForChildren { run_id, at_step });
    }
    let history = source.history;
    let copy = |end: usize| -> Vec<(usize, Message)> {
        (history.iter().take(end).enumerate())
            .map(|(i, m)| (i, m.message.clone()))
            .collect()
    };
    let pending = pending_batch(history);
    match edit {
        Some(ForkEdit::ReplaceUserMessage(text)) => {
            let Some(at) = (history.iter())
                .rposition(|m| m.message.role == Role::User && m.message.origin == Origin::User)
            else {
                return Err(ForkError::NoUserMessage { run_id, at_step });
            };
            let mut messages = copy(at + 1);
            messages[at].1.content = text.clone();
            Ok(ForkPlan {
                messages,
                checkpoint: None,
                start: ForkStart::Step(Phase::UserInput),
            })
        }
        Some(ForkEdit::ReplaceToolResult { call_id, result }) => {
            let in_pending = pending
                .filter(|&p| (history[p].message.tool_calls.iter()).any(|c| &c.id == call_id));
            if let Some(at) = in_pending {
                let given = (call_id.as_str(), ToolOutcome::ok(result.clone()));
                return Ok(pick_up_batch(source, history, at, Some(given)));
            }
            let Some(at) = (history.iter()).rposition(|m| {
                m.message.role == Role::Tool && m.message.tool_call_id.as_ref() == Some(call_id)
            }) else {
                let known = (history.iter())
                    .flat_map(|m| &m.message.tool_calls)
                    .map(|c| format!("{:?} ({})", c.id, c.name))
                    .collect::<Vec<_>>();
                return Err(ForkError::UnknownCall {
                    run_id,
                    at_step,
                    call_id: call_id.clone(),
                    known: if known.is_empty() {
                        "none".to_owned()
                    } else {
                        known.join(", ")
                    },
                });
            };
            // The batch's results were written together, one after another.
            let end = (history.iter().skip(at))
                .take_while(|m| m.message.role == Role::Tool)
                .count()
                + at;
            let mut messages = copy(end);
            let replaced = &mut messages[at].1;
            replaced.content = result.clone();
            replaced.is_error = false;
            Ok(ForkPlan {
                messages,
                checkpoint: None,
                start: ForkStart::Step(Phase::ToolsBatchResult),
            })
        }
        None => {
            if let Some(at) = pending {
                return Ok(pick_up_batch(source, history, at, None));
            }
            let phase = match history.last().map(|m| &m.message) {
                None
                | Some(Message {
                    role: Role::Assistant,
                    ..
                }) => {
                    return Err(ForkError::NothingToContinue { run_id, at_step });
                }
                Some(Message {
                    role: Role::Tool, ..
                }) => Phase::ToolsBatchResult,
                Some(Message {
                    keeps_from: Some(_),
                    ..
                }) => Phase::ContextCompacted,
                Some(_) => Phase::UserInput,
            };
            Ok(ForkPlan {
                messages: copy(history.len()),
                checkpoint: None,
                start: ForkStart::Step(phase),
            })
        }
    }
}

/// The fork takes up the batch the assistant message at `at` asked for. Each call keeps the
/// source's idempotency key, so a `keyed` tool does the work once across source and fork; a
/// call the source recorded an outcome for does not run again (a `never` call's effect
/// happened); a `never` call the source started without an outcome is in doubt — and while
/// the source may still run calls of the batch, so is every `never` call it has no outcome
/// for, started or not: the source may carry it out after the fork was made, and a `never`
/// effect must not happen in both runs without a human's say. Unless `given` supplies its
/// result. Which calls are `never` is the source's frozen configuration's say, whatever the
/// fork's is.
fn pick_up_batch(
    source: &Source<'_>,
    history: &[SourceMessage],
    at: usize,
    given: Option<(&str, ToolOutcome)>,
) -> ForkPlan {
    let asked = &history[at];
    let source_runs_it = source.still_runs(&asked.message.tool_calls);
    // A batch the source took up from its own source (a fork of a fork) keeps the keys it
    // has there: the first run's, so a `keyed` tool does the work once across all three.
    let inherited = (asked.step.is_none())
        .then(|| source.checkpoint_of(&asked.message.tool_calls))
        .flatten();
    let (key_run, key_step) = match inherited {
        Some(checkpoint) => (
            checkpoint
                .key_run
                .clone()
                .unwrap_or_else(|| source.run_id.clone()),
            checkpoint.key_step,
        ),
        None => (source.run_id.clone(), asked.step.map(|s| s + 1)),
    };
    let config = source.state.config.as_ref();
    let mut checkpoint = ToolCheckpoint {
        key_step,
        key_run: Some(key_run),
        ..ToolCheckpoint::new(asked.message.tool_calls.clone())
    };
    let mut in_doubt = Vec::new();
    for (slot, progress) in (0u32..).zip(checkpoint.calls.iter_mut()) {
        let call = &progress.call;
        if let Some((_, outcome)) = given.as_ref().filter(|(id, _)| *id == call.id) {
            progress.outcome = Some(outcome.clone());
            continue;
        }
        let never = config.tool(&call.name).map(|t| t.replay) == Some(ReplayPolicy::Never);
        match source.started.get(&slot) {
            Some(Some(outcome)) => progress.outcome = Some(outcome.clone()),
            Some(None) | None
                if never && (source_runs_it || source.started.contains_key(&slot)) =>
            {
                in_doubt.push(UnknownCall {
                    call_index: slot as usize,
                    call_id: call.id.clone(),
                    tool: call.name.clone(),
                    arguments: call.arguments.clone(),
                    idempotency_key: String::new(),
                    drift: None,
                });
            }
            _ => {}
        }
    }
    for unknown in &mut in_doubt {
        unknown.idempotency_key = checkpoint.idempotency_key(
            source.run_id,
            checkpoint.key_step.unwrap_or_default(),
            unknown.call_index as u32,
        );
    }
    let messages = (history.iter().enumerate())
        .map(|(i, m)| (i, m.message.clone()))
        .collect();
    let start = if in_doubt.is_empty() {
        ForkStart::Step(Phase::LlmResult)
    } else {
        ForkStart::Reconcile(in_doubt)
    };
    ForkPlan {
        messages,
        checkpoint: Some(checkpoint),
        start,
    }
}

/// The fork's run as it is created: a fresh state — fresh counters and budgets, a fresh
/// deadline — under `config`, holding the plan's batch, started at once, with its first job;
/// or waiting for a human when the plan starts with calls in doubt (no job).
pub struct Started {
    pub state: AgentState,
    pub job: Option<StepJob>,
    pub events: Vec<EventDraft>,
}

pub fn start(
    plan: &ForkPlan,
    session_id: SessionId,
    run_id: RunId,
    config: RunConfigSnapshot,
    forked_from: ForkedFrom,
    now: Millis,
) -> Started {
    let mut state = AgentState::new(session_id, run_id, config, now);
    state.checkpoint = plan.checkpoint.clone();
    state.forked_from = Some(forked_from);
    state.counters.context_tokens = (plan.messages.iter())
        .map(|(_, m)| m.estimated_tokens())
        .sum();
    let (mut job, running) = start_run(&mut state, now);
    match &plan.start {
        ForkStart::Step(phase) => {
            job.phase = *phase;
            Started {
                state,
                job: Some(job),
                events: vec![running],
            }
        }
        ForkStart::Reconcile(calls) => {
            let request = HumanRequest::Reconciliation {
                calls: calls.clone(),
            };
            state.status = RunStatus::WaitingHuman;
            state.pending_human = Some(request.clone());
            let events = vec![
                running,
                EventDraft::new(
                    EventKind::ReconciliationRequired,
                    json!({"run_id": state.run_id, "request": request}),
                ),
                status_event(&state),
            ];
            Started {
                state,
                job: None,
                events,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::{ApprovalPolicy, CallLimits, ToolCall, ToolDelegation, ToolSpec, brain, decide};

    fn run() -> RunId {
        RunId::from_suffix("src").unwrap()
    }

    fn config() -> RunConfigSnapshot {
        let tool = |name: &str, replay| ToolSpec {
            name: name.into(),
            description: String::new(),
            parameters: json!({"type": "object"}),
            replay,
            completes_run: false,
            approval: ApprovalPolicy::Never,
            delegation: ToolDelegation::default(),
            calls: CallLimits::default(),
        };
        RunConfigSnapshot {
            tools: vec![
                tool("look", ReplayPolicy::Safe),
                tool("pay", ReplayPolicy::Never),
            ],
            ..RunConfigSnapshot::default()
        }
    }

    /// The source as it stands after it completed.
    fn ended() -> AgentState {
        let session = SessionId::from_suffix("s").unwrap();
        let mut state = AgentState::new(session, run(), config(), 0);
        state.status = RunStatus::Completed;
        state
    }

    fn call(id: &str, name: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: name.into(),
            arguments: json!({}),
        }
    }

    fn at(step: Option<u64>, message: Message) -> SourceMessage {
        SourceMessage { message, step }
    }

    /// A finished run of four steps after an earlier turn: 1 asks for two calls, 2 runs them,
    /// 3 asks for one more, 4 answers.
    fn finished() -> Vec<SourceMessage> {
        vec![
            at(None, Message::user("earlier")),
            at(None, Message::assistant("earlier answer", vec![])),
            at(None, Message::user("question")),
            at(
                Some(1),
                Message::assistant("", vec![call("a", "look"), call("b", "pay")]),
            ),
            at(Some(2), Message::tool_result("a", &ToolOutcome::ok("A"))),
            at(Some(2), Message::tool_result("b", &ToolOutcome::ok("B"))),
            at(Some(3), Message::assistant("", vec![call("c", "look")])),
            at(Some(4), Message::tool_result("c", &ToolOutcome::ok("C"))),
            at(Some(5), Message::assistant("done", vec![])),
        ]
    }

    fn records(n: u64) -> Vec<StepRecord> {
        (1..=n)
            .map(|index| StepRecord {
                index,
                instruction: "call_llm".into(),
                started_at: 0,
                finished_at: 0,
                summary: json!({}),
            })
            .collect()
    }

    fn plan_at(
        history: &[SourceMessage],
        steps: &[StepRecord],
        at_step: u64,
        started: &HashMap<u32, Option<ToolOutcome>>,
        edit: Option<&ForkEdit>,
    ) -> Result<ForkPlan, ForkError> {
        plan_from(&ended(), history, steps, at_step, started, edit)
    }

    fn plan_from(
        state: &AgentState,
        history: &[SourceMessage],
        steps: &[StepRecord],
        at_step: u64,
        started: &HashMap<u32, Option<ToolOutcome>>,
        edit: Option<&ForkEdit>,
    ) -> Result<ForkPlan, ForkError> {
        let through = history_through(history.to_vec(), at_step);
        let source = Source {
            run_id: &run(),
            committed: steps.len() as u64,
            continuation: false,
            step: steps.get((at_step as usize).wrapping_sub(1)),
            history: &through,
            started,
            state,
        };
        plan(&source, at_step, edit)
    }

    fn contents(plan: &ForkPlan) -> Vec<String> {
        (plan.messages.iter())
            .map(|(_, m)| m.content.clone())
            .collect()
    }

    #[test]
    fn the_history_through_a_step_ends_before_the_first_message_of_a_later_step() {
        let all = finished();
        let lens: Vec<usize> = (0..=6)
            .map(|n| history_through(all.clone(), n).len())
            .collect();
        // Step 0 is the run's input; step 5 wrote the last message, and step 6 wrote none.
        assert_eq!(lens, [3, 4, 6, 7, 8, 9, 9]);
        // What a later turn of the session wrote after the run is never part of it.
        let mut later = all.clone();
        later.push(at(None, Message::user("next turn")));
        assert_eq!(history_through(later, 9).len(), 9);
    }

    #[test]
    fn every_step_of_a_run_forks_to_what_comes_next_and_nothing_is_invented() {
        let history = finished();
        let steps = records(5);
        let none = HashMap::new();
        let expected = [
            (1, ForkStart::Step(Phase::LlmResult), 4, true),
            (2, ForkStart::Step(Phase::ToolsBatchResult), 6, false),
            (3, ForkStart::Step(Phase::LlmResult), 7, true),
            (4, ForkStart::Step(Phase::ToolsBatchResult), 8, false),
        ];
        for (step, start, len, batch) in expected {
            let plan = plan_at(&history, &steps, step, &none, None).unwrap();
            assert_eq!(plan.start, start, "step {step}");
            assert_eq!(plan.messages.len(), len, "step {step}");
            assert_eq!(plan.checkpoint.is_some(), batch, "step {step}");
            let copied: Vec<_> = plan.messages.iter().map(|(i, m)| (*i, m.clone())).collect();
            let source: Vec<_> = (history.iter().take(len).enumerate())
                .map(|(i, m)| (i, m.message.clone()))
                .collect();
            assert_eq!(copied, source, "step {step}: a copy, unchanged");
        }
        assert_eq!(
            plan_at(&history, &steps, 5, &none, None),
            Err(ForkError::NothingToContinue {
                run_id: run(),
                at_step: 5
            })
        );
    }

    #[test]
    fn a_step_that_is_not_committed_or_a_continuation_is_refused() {
        let history = finished();
        let steps = records(5);
        let none = HashMap::new();
        for bad in [0, 6, u64::MAX] {
            assert_eq!(
                plan_at(&history, &steps, bad, &none, None),
                Err(ForkError::NoSuchStep {
                    run_id: run(),
                    at_step: bad,
                    committed: 5
                })
            );
        }
        let source = Source {
            run_id: &run(),
            committed: 5,
            continuation: true,
            step: steps.first(),
            history: &history,
            started: &none,
            state: &ended(),
        };
        assert_eq!(
            plan(&source, 1, None),
            Err(ForkError::Continuation { run_id: run() })
        );
    }

    #[test]
    fn a_step_waiting_for_children_is_refused_and_the_message_names_the_step_before() {
        let history = finished();
        let mut steps = records(5);
        steps[1].summary = json!({"children": ["run_x"]});
        let error = plan_at(&history, &steps, 2, &HashMap::new(), None).unwrap_err();
        assert_eq!(
            error,
            ForkError::WaitsForChildren {
                run_id: run(),
                at_step: 2
            }
        );
        assert!(error.to_string().contains("fork at step 1"), "{error}");
    }

    #[test]
    fn the_pending_batch_keeps_the_sources_keys_and_the_outcomes_it_recorded() {
        let history = finished();
        let steps = records(5);
        // The source ran `pay` (a `never` call) to the end, and `look` left no intent.
        let started = HashMap::from([(1, Some(ToolOutcome::ok("paid")))]);
        let plan = plan_at(&history, &steps, 1, &started, None).unwrap();
        let checkpoint = plan.checkpoint.unwrap();
        assert_eq!(checkpoint.calls[0].outcome, None, "a safe call runs again");
        assert_eq!(checkpoint.calls[1].outcome, Some(ToolOutcome::ok("paid")));
        let fork = RunId::from_suffix("fork").unwrap();
        assert_eq!(
            checkpoint.idempotency_key(&fork, 1, 1),
            format!("{}#2#1", run()),
            "the source's key, so a keyed tool does the work once"
        );
    }

    /// The source, `status`, holding the batch step 1 asked for.
    fn holding(status: RunStatus, cut_off: bool) -> AgentState {
        let mut state = ended();
        state.status = status;
        state.checkpoint = Some(ToolCheckpoint {
            key_step: Some(2),
            cut_off,
            ..ToolCheckpoint::new(vec![call("a", "look"), call("b", "pay")])
        });
        state
    }

    /// The calls of the fork's batch in doubt, by id.
    fn doubted(plan: &ForkPlan) -> Vec<&str> {
        match &plan.start {
            ForkStart::Reconcile(calls) => calls.iter().map(|c| c.call_id.as_str()).collect(),
            ForkStart::Step(_) => Vec::new(),
        }
    }

    #[test]
    fn a_never_call_the_source_may_still_run_is_in_doubt_in_the_fork() {
        let history = finished();
        let steps = records(5);
        let none = HashMap::new();
        let live = [
            (RunStatus::Running, false),
            (RunStatus::Cancelling, false),
            (RunStatus::WaitingHuman, false),
            (RunStatus::Paused, false),
            (RunStatus::Failed, true),
        ];
        for (status, cut_off) in live {
            let source = holding(status, cut_off);
            let plan = plan_from(&source, &history, &steps, 1, &none, None).unwrap();
            assert_eq!(
                doubted(&plan),
                ["b"],
                "{status}: `pay` may yet run in the source"
            );
            // The edit that gives its result settles it.
            let edit = ForkEdit::ReplaceToolResult {
                call_id: "b".into(),
                result: "B'".into(),
            };
            let plan = plan_from(&source, &history, &steps, 1, &none, Some(&edit)).unwrap();
            assert_eq!(plan.start, ForkStart::Step(Phase::LlmResult));
        }
        // Ended (or failed with nothing to carry on), the source runs nothing more of it.
        for status in [
            RunStatus::Cancelled,
            RunStatus::Failed,
            RunStatus::Completed,
        ] {
            let source = holding(status, false);
            let plan = plan_from(&source, &history, &steps, 1, &none, None).unwrap();
            assert!(doubted(&plan).is_empty(), "{status}");
        }
        // A later batch of a running source is not the one forked at.
        let mut later = holding(RunStatus::Running, false);
        later.checkpoint = Some(ToolCheckpoint::new(vec![call("c", "look")]));
        let plan = plan_from(&later, &history, &steps, 1, &none, None).unwrap();
        assert!(doubted(&plan).is_empty());
        // The source's frozen configuration says what is `never`: where it calls `pay` safe,
        // the fork runs it whatever the fork's own configuration would say.
        let mut lenient = holding(RunStatus::Running, false);
        let mut frozen = config();
        frozen.tools[1].replay = ReplayPolicy::Safe;
        lenient.config = std::sync::Arc::new(frozen);
        let plan = plan_from(&lenient, &history, &steps, 1, &none, None).unwrap();
        assert!(doubted(&plan).is_empty());
    }

    #[test]
    fn a_fork_of_a_fork_keys_the_batch_it_took_up_by_the_first_run() {
        // The fork's history starts with the batch it took up from its own source: the
        // message was copied (no step of the fork wrote it) and the fork ran nothing yet.
        let first = RunId::from_suffix("first").unwrap();
        let history = vec![
            at(None, Message::user("go")),
            at(
                None,
                Message::assistant("", vec![call("a", "look"), call("b", "pay")]),
            ),
            at(Some(1), Message::tool_result("a", &ToolOutcome::ok("A"))),
            at(Some(1), Message::tool_result("b", &ToolOutcome::ok("B"))),
            at(Some(2), Message::assistant("done", vec![])),
        ];
        let mut source = ended();
        source.checkpoint = Some(ToolCheckpoint {
            key_step: Some(4),
            key_run: Some(first.clone()),
            calls: ToolCheckpoint::new(vec![call("a", "look"), call("b", "pay")])
                .calls
                .into_iter()
                .map(|mut p| {
                    p.outcome = Some(ToolOutcome::ok("done"));
                    p
                })
                .collect(),
            ..ToolCheckpoint::default()
        });
        let edit = ForkEdit::ReplaceToolResult {
            call_id: "a".into(),
            result: "A'".into(),
        };
        // Forked where the batch is still pending in the fork's history (step 0 is not a
        // step, so through an edit of a result at step 1, which takes the batch up again).
        let through = history_through(history.clone(), 0);
        let steps = records(2);
        let from = Source {
            run_id: &run(),
            committed: 2,
            continuation: false,
            step: steps.first(),
            history: &through,
            started: &HashMap::new(),
            state: &source,
        };
        let plan = plan(&from, 1, Some(&edit)).unwrap();
        let checkpoint = plan.checkpoint.unwrap();
        let fork = RunId::from_suffix("fork2").unwrap();
        assert_eq!(
            checkpoint.idempotency_key(&fork, 1, 1),
            format!("{first}#4#1"),
            "the first run's key, not the intermediate fork's"
        );
    }

    #[test]
    fn a_never_call_in_doubt_waits_for_a_human_unless_the_edit_gives_its_result() {
        let history = finished();
        let steps = records(5);
        let started = HashMap::from([(1, None)]);
        let plan = plan_at(&history, &steps, 1, &started, None).unwrap();
        let ForkStart::Reconcile(calls) = &plan.start else {
            panic!("expected a reconciliation, found {:?}", plan.start);
        };
        assert_eq!(calls.len(), 1);
        assert_eq!((calls[0].call_id.as_str(), calls[0].call_index), ("b", 1));
        assert_eq!(calls[0].idempotency_key, format!("{}#2#1", run()));
        // A safe call started without an outcome simply runs again.
        let safe = HashMap::from([(0, None)]);
        let plan = plan_at(&history, &steps, 1, &safe, None).unwrap();
        assert_eq!(plan.start, ForkStart::Step(Phase::LlmResult));
        // The edit answers the call in doubt.
        let edit = ForkEdit::ReplaceToolResult {
            call_id: "b".into(),
            result: "not paid".into(),
        };
        let plan = plan_at(&history, &steps, 1, &started, Some(&edit)).unwrap();
        assert_eq!(plan.start, ForkStart::Step(Phase::LlmResult));
        let checkpoint = plan.checkpoint.unwrap();
        assert_eq!(
            checkpoint.calls[1].outcome,
            Some(ToolOutcome::ok("not paid"))
        );
        assert_eq!(checkpoint.calls[0].outcome, None);
    }

    #[test]
    fn replacing_the_user_message_drops_what_answered_it_and_calls_the_model() {
        let history = finished();
        let steps = records(5);
        let edit = ForkEdit::ReplaceUserMessage("another question".into());
        for step in 1..=5 {
            let plan = plan_at(&history, &steps, step, &HashMap::new(), Some(&edit)).unwrap();
            assert_eq!(
                contents(&plan),
                ["earlier", "earlier answer", "another question"],
                "step {step}"
            );
            assert_eq!(plan.start, ForkStart::Step(Phase::UserInput));
            assert_eq!(plan.checkpoint, None);
        }
        let only_answers = vec![at(None, Message::assistant("hi", vec![]))];
        assert_eq!(
            plan_at(&only_answers, &records(1), 1, &HashMap::new(), Some(&edit)),
            Err(ForkError::NoUserMessage {
                run_id: run(),
                at_step: 1
            })
        );
    }

    #[test]
    fn replacing_an_answered_result_ends_the_history_with_its_batch() {
        let history = finished();
        let steps = records(5);
        let edit = ForkEdit::ReplaceToolResult {
            call_id: "a".into(),
            result: "other A".into(),
        };
        let plan = plan_at(&history, &steps, 4, &HashMap::new(), Some(&edit)).unwrap();
        assert_eq!(
            contents(&plan),
            ["earlier", "earlier answer", "question", "", "other A", "B"]
        );
        assert_eq!(plan.start, ForkStart::Step(Phase::ToolsBatchResult));
        // A call answered only after the step is unknown there; so is a made-up one.
        let later = ForkEdit::ReplaceToolResult {
            call_id: "c".into(),
            result: "x".into(),
        };
        let error = plan_at(&history, &steps, 2, &HashMap::new(), Some(&later)).unwrap_err();
        assert!(
            matches!(&error, ForkError::UnknownCall { call_id, .. } if call_id == "c"),
            "{error:?}"
        );
        assert!(error.to_string().contains("\"a\" (look)"), "{error}");
    }

    #[test]
    fn a_fork_starts_fresh_running_or_waiting_and_the_brain_takes_it_from_there() {
        let history = finished();
        let steps = records(5);
        let session = SessionId::from_suffix("fs").unwrap();
        let fork = RunId::from_suffix("fork").unwrap();
        let from = ForkedFrom {
            run_id: run(),
            step: 1,
        };
        let plan = plan_at(&history, &steps, 1, &HashMap::new(), None).unwrap();
        let started = start(
            &plan,
            session.clone(),
            fork.clone(),
            config(),
            from.clone(),
            7,
        );
        assert_eq!(started.state.status, RunStatus::Running);
        assert_eq!(started.state.step_index, 0);
        assert_eq!(started.state.counters.model_calls, 0);
        assert_eq!(started.state.started_at, Some(7));
        assert_eq!(started.state.forked_from, Some(from.clone()));
        let job = started.job.unwrap();
        assert_eq!((job.step_index, job.phase), (1, Phase::LlmResult));
        assert_eq!(
            decide(&started.state, job.phase, 7),
            brain::Instruction::CallToolsBatch
        );

        let plan = plan_at(&history, &steps, 1, &HashMap::from([(1, None)]), None).unwrap();
        let waiting = start(&plan, session, fork, config(), from, 7);
        assert_eq!(waiting.state.status, RunStatus::WaitingHuman);
        assert!(waiting.job.is_none());
        assert!(matches!(
            waiting.state.pending_human,
            Some(HumanRequest::Reconciliation { .. })
        ));
        let kinds: Vec<_> = waiting.events.iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            [
                EventKind::RunStatus,
                EventKind::ReconciliationRequired,
                EventKind::RunStatus
            ]
        );
    }
}
