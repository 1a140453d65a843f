//! The Brain: a pure decision table from (state, phase) to the one instruction a step runs.
//!
//! The stop ladder is checked in a fixed order: cancellation, then budget admission, then
//! parse failures, then the completion verdict. Every path that ends a run names exactly one
//! `StopReason`.

use crate::approval::approval_needed;
use crate::{AgentState, Millis, Phase, StopReason};

/// The one main instruction of a step. A step never chains model → tools → model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Instruction {
    /// Call the model. With `conclude` the tools are withheld: the budget leaves no room for
    /// another tool round-trip, so this call must produce the final answer.
    CallLlm {
        conclude: bool,
    },
    /// Run the pending calls of the state's tool checkpoint.
    CallToolsBatch,
    /// A call of the batch needs a human's approval: the run waits, and no call runs.
    AskApproval,
    /// The next prompt would exceed its budget: the model summarises the older turns first.
    CompressContext,
    Finish(StopReason),
}

impl Instruction {
    pub fn name(self) -> &'static str {
        match self {
            Instruction::CallLlm { .. } => "call_llm",
            Instruction::CallToolsBatch => "call_tools_batch",
            Instruction::AskApproval => "ask_approval",
            Instruction::CompressContext => "compress_context",
            Instruction::Finish(_) => "finish",
        }
    }
}

/// Decides what the step woken by `phase` must do at `now`. Past the run's deadline nothing
/// new starts: what would call the model, run tools, compact or ask a human ends the run
/// `timed_out` instead (a run that has its answer still completes).
pub fn decide(state: &AgentState, phase: Phase, now: Millis) -> Instruction {
    if state.cancel_requested || phase == Phase::Cancel {
        return Instruction::Finish(StopReason::Cancelled);
    }
    let instruction = decide_in_time(state, phase);
    let late = state.deadline().is_some_and(|deadline| now >= deadline);
    match instruction {
        Instruction::Finish(_) => instruction,
        _ if late => Instruction::Finish(StopReason::TimedOut),
        _ => instruction,
    }
}

fn decide_in_time(state: &AgentState, phase: Phase) -> Instruction {
    let pending_tools = state.checkpoint.as_ref().is_some_and(|c| c.has_pending());
    match phase {
        Phase::LlmResult => {
            // A concluding call that still asked for tools was cut short by the budget; one
            // that answered is simply done.
            if state.force_finish && pending_tools {
                Instruction::Finish(StopReason::BudgetExhausted)
            } else if state.force_finish {
                Instruction::Finish(StopReason::Completed)
            } else if approval_needed(state) {
                Instruction::AskApproval
            } else if pending_tools {
                Instruction::CallToolsBatch
            } else {
                Instruction::Finish(StopReason::Completed)
            }
        }
        // The batch a human was asked about (or whose children ran, or whose `wait` ended) is
        // finished by a tools step even when every other outcome is known: that step is what
        // hands the results to the model, in order.
        Phase::HumanDecided | Phase::ChildrenJoined | Phase::WaitEnded
            if state.checkpoint.is_some() =>
        {
            Instruction::CallToolsBatch
        }
        // A run continued after its batch was cut off (by its deadline) carries the batch on.
        Phase::Resumed if state.checkpoint.as_ref().is_some_and(|c| c.cut_off) => {
            if approval_needed(state) {
                Instruction::AskApproval
            } else {
                Instruction::CallToolsBatch
            }
        }
        Phase::ToolsBatchResult
            if state.counters.consecutive_parse_failures
                >= state.limits().max_consecutive_parse_failures =>
        {
            Instruction::Finish(StopReason::ParseFailures)
        }
        Phase::ToolsBatchResult if completed_by_tool(state) => {
            Instruction::Finish(StopReason::Completed)
        }
        Phase::UserInput
        | Phase::ToolsBatchResult
        | Phase::HumanDecided
        | Phase::ChildrenJoined
        | Phase::WaitEnded
        | Phase::Resumed
        | Phase::ContextCompacted
        | Phase::CompletionBlocked => next_model_call(state),
        Phase::Cancel => Instruction::Finish(StopReason::Cancelled),
    }
}

/// Budget admission for a model call. A model call at step `s` may offer tools only when
/// steps `s + 1` (the tools) and `s + 2` (a concluding call) still fit under `max_steps`.
///
/// The other budgets work the same way: the last model call a budget allows is made without
/// tools, and none is made past it. A prompt over its budget is compacted first; if it is still over right after a compaction, the
/// run stops.
fn next_model_call(state: &AgentState) -> Instruction {
    let limits = &state.limits();
    let counters = &state.counters;
    let reached = |used: u64, limit: Option<u64>| limit.is_some_and(|max| used >= max);
    let spent = state.force_finish
        || state.step_index >= limits.max_steps
        || reached(counters.model_calls, limits.max_model_calls)
        || reached(
            counters.input_tokens.saturating_add(counters.output_tokens),
            limits.max_tokens,
        );
    if spent {
        return Instruction::Finish(StopReason::BudgetExhausted);
    }
    match prompt_fit(state, counters.context_tokens) {
        PromptFit::Fits => {}
        PromptFit::Compact => return Instruction::CompressContext,
        PromptFit::TooLong => return Instruction::Finish(StopReason::BudgetExhausted),
    }
    let model_step = state.step_index + 1;
    let conclude = model_step + 2 > limits.max_steps
        || reached(counters.model_calls + 1, limits.max_model_calls)
        || reached(counters.tool_calls, limits.max_tool_calls);
    Instruction::CallLlm { conclude }
}

/// How a prompt of `tokens` stands against the run's prompt budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptFit {
    Fits,
    /// Over the budget: compact the context before the model is called.
    Compact,
    /// Still over right after a compaction: the run stops.
    TooLong,
}

/// Judged before every model call: by the run's estimate of its prompt, or — before its first
/// model call, when it has none yet — by the size of the context the call would send
/// (`prompt_estimate`), so that a long history or a large trigger is compacted too.
pub fn prompt_fit(state: &AgentState, tokens: u64) -> PromptFit {
    let over =
        (state.limits().max_prompt_tokens).is_some_and(|max| tokens.saturating_add(1) >= max);
    match (over, state.just_compacted) {
        (false, _) => PromptFit::Fits,
        (true, false) => PromptFit::Compact,
        (true, true) => PromptFit::TooLong,
    }
}

/// The estimated tokens of a prompt: the system prompt and `messages`.
pub fn prompt_estimate(system_prompt: &str, messages: &[crate::Message]) -> u64 {
    let system = (system_prompt.len() as u64).div_ceil(4);
    system
        + messages
            .iter()
            .map(crate::Message::estimated_tokens)
            .sum::<u64>()
}

fn completed_by_tool(state: &AgentState) -> bool {
    let Some(checkpoint) = &state.checkpoint else {
        return false;
    };
    checkpoint.calls.iter().any(|progress| {
        let succeeded = progress.outcome.as_ref().is_some_and(|o| !o.is_error);
        succeeded
            && state
                .config
                .tool(&progress.call.name)
                .is_some_and(|t| t.completes_run)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        AgentState, ApprovalPolicy, Limits, ReplayPolicy, RunConfigSnapshot, RunId, SessionId,
        ToolCall, ToolCheckpoint, ToolOutcome, ToolSpec,
    };

    fn state(max_steps: u64) -> AgentState {
        let config = RunConfigSnapshot {
            model: "scripted:demo".into(),
            tools: vec![
                ToolSpec {
                    calls: Default::default(),
                    name: "done".into(),
                    description: String::new(),
                    parameters: serde_json::json!({"type": "object"}),
                    replay: ReplayPolicy::Safe,
                    completes_run: true,
                    approval: ApprovalPolicy::Never,
                    delegation: Default::default(),
                },
                ToolSpec {
                    calls: Default::default(),
                    name: "guarded".into(),
                    description: String::new(),
                    parameters: serde_json::json!({"type": "object"}),
                    replay: ReplayPolicy::Never,
                    completes_run: false,
                    approval: ApprovalPolicy::Always,
                    delegation: Default::default(),
                },
            ],
            limits: Limits {
                max_steps,
                ..Limits::default()
            },
            ..RunConfigSnapshot::default()
        };
        AgentState::new(
            SessionId::from_suffix("s").unwrap(),
            RunId::from_suffix("r").unwrap(),
            config,
            0,
        )
    }

    fn call(name: &str) -> ToolCall {
        ToolCall {
            id: "c1".into(),
            name: name.into(),
            arguments: serde_json::json!({}),
        }
    }

    #[test]
    fn a_prompt_is_judged_against_its_budget_once_compacted_or_not() {
        let mut s = state(50);
        assert_eq!(
            prompt_fit(&s, u64::MAX),
            PromptFit::Fits,
            "no budget, no limit"
        );
        let mut config = s.config.as_ref().clone();
        config.limits.max_prompt_tokens = Some(100);
        s.config = std::sync::Arc::new(config);
        for (tokens, compacted, fit) in [
            (0, false, PromptFit::Fits),
            (98, false, PromptFit::Fits),
            (99, false, PromptFit::Compact),
            (5_000, false, PromptFit::Compact),
            (98, true, PromptFit::Fits),
            (99, true, PromptFit::TooLong),
        ] {
            s.just_compacted = compacted;
            assert_eq!(
                prompt_fit(&s, tokens),
                fit,
                "{tokens} tokens, compacted {compacted}"
            );
        }
        let messages = [crate::Message::user("x".repeat(40))];
        assert_eq!(prompt_estimate(&"y".repeat(8), &messages), 2 + 10 + 4);
    }

    /// Every combination of the inputs the Brain looks at, with the expected instruction
    /// computed independently from the written rules.
    #[test]
    fn decision_table_is_exhaustive_over_its_inputs() {
        let phases = Phase::ALL;
        let mut cases = 0;
        for phase in phases {
            for cancel in [false, true] {
                for force in [false, true] {
                    for checkpoint in 0..6 {
                        for parse_failures in [0, 3] {
                            for step_index in [0, 7, 8, 10] {
                                let mut s = state(10);
                                s.cancel_requested = cancel;
                                s.force_finish = force;
                                s.step_index = step_index;
                                s.counters.consecutive_parse_failures = parse_failures;
                                s.checkpoint = match checkpoint {
                                    0 => None,
                                    1 => Some(ToolCheckpoint::new(vec![call("add")])),
                                    2 => {
                                        let mut c = ToolCheckpoint::new(vec![call("done")]);
                                        c.calls[0].outcome = Some(ToolOutcome::ok("ok"));
                                        Some(c)
                                    }
                                    3 => {
                                        let mut c = ToolCheckpoint::new(vec![call("done")]);
                                        c.calls[0].outcome = Some(ToolOutcome::error("no"));
                                        Some(c)
                                    }
                                    4 => Some(ToolCheckpoint::new(vec![
                                        call("add"),
                                        call("guarded"),
                                    ])),
                                    _ => {
                                        let mut c = ToolCheckpoint::new(vec![call("guarded")]);
                                        c.approved = true;
                                        Some(c)
                                    }
                                };
                                let expected = expected(
                                    phase,
                                    cancel,
                                    force,
                                    checkpoint,
                                    parse_failures,
                                    step_index,
                                );
                                assert_eq!(
                                    decide(&s, phase, 0),
                                    expected,
                                    "phase={phase:?} cancel={cancel} force={force} checkpoint={checkpoint} parse_failures={parse_failures} step={step_index}"
                                );
                                cases += 1;
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(cases, Phase::ALL.len() * 2 * 2 * 6 * 2 * 4);
    }

    fn expected(
        phase: Phase,
        cancel: bool,
        force: bool,
        checkpoint: u8,
        parse_failures: u32,
        step_index: u64,
    ) -> Instruction {
        use Instruction::*;
        if cancel || phase == Phase::Cancel {
            return Finish(StopReason::Cancelled);
        }
        let pending = matches!(checkpoint, 1 | 4 | 5);
        let gated = checkpoint == 4;
        let model_call = || {
            if force || step_index >= 10 {
                Finish(StopReason::BudgetExhausted)
            } else {
                CallLlm {
                    conclude: step_index + 3 > 10,
                }
            }
        };
        match phase {
            Phase::LlmResult if force && pending => Finish(StopReason::BudgetExhausted),
            Phase::LlmResult if force => Finish(StopReason::Completed),
            Phase::LlmResult if gated => AskApproval,
            Phase::LlmResult if pending => CallToolsBatch,
            Phase::LlmResult => Finish(StopReason::Completed),
            Phase::HumanDecided | Phase::ChildrenJoined | Phase::WaitEnded if checkpoint != 0 => {
                CallToolsBatch
            }
            Phase::ToolsBatchResult if parse_failures >= 3 => Finish(StopReason::ParseFailures),
            Phase::ToolsBatchResult if checkpoint == 2 => Finish(StopReason::Completed),
            _ => model_call(),
        }
    }

    #[test]
    fn model_call_tool_call_and_token_budgets_conclude_then_stop() {
        let with = |limits: Limits| {
            let mut s = state(50);
            s.config = std::sync::Arc::new(RunConfigSnapshot {
                limits: Limits {
                    max_steps: 50,
                    ..limits
                },
                ..s.config.as_ref().clone()
            });
            s
        };
        let mut s = with(Limits {
            max_model_calls: Some(3),
            ..Limits::default()
        });
        s.counters.model_calls = 1;
        assert_eq!(
            decide(&s, Phase::ToolsBatchResult, 0),
            Instruction::CallLlm { conclude: false }
        );
        s.counters.model_calls = 2;
        assert_eq!(
            decide(&s, Phase::ToolsBatchResult, 0),
            Instruction::CallLlm { conclude: true }
        );
        s.counters.model_calls = 3;
        assert_eq!(
            decide(&s, Phase::ToolsBatchResult, 0),
            Instruction::Finish(StopReason::BudgetExhausted)
        );

        let mut s = with(Limits {
            max_tool_calls: Some(4),
            ..Limits::default()
        });
        s.counters.tool_calls = 3;
        assert_eq!(
            decide(&s, Phase::ToolsBatchResult, 0),
            Instruction::CallLlm { conclude: false }
        );
        s.counters.tool_calls = 5;
        assert_eq!(
            decide(&s, Phase::ToolsBatchResult, 0),
            Instruction::CallLlm { conclude: true },
            "no more tools, one last answer"
        );

        let mut s = with(Limits {
            max_tokens: Some(1000),
            ..Limits::default()
        });
        s.counters.input_tokens = 600;
        s.counters.output_tokens = 399;
        assert_eq!(
            decide(&s, Phase::UserInput, 0),
            Instruction::CallLlm { conclude: false }
        );
        s.counters.output_tokens = 400;
        assert_eq!(
            decide(&s, Phase::UserInput, 0),
            Instruction::Finish(StopReason::BudgetExhausted)
        );
    }

    #[test]
    fn past_the_deadline_nothing_new_starts_and_a_long_prompt_is_compacted_once() {
        let mut s = state(50);
        let mut config = s.config.as_ref().clone();
        config.limits.max_duration_ms = Some(500);
        config.limits.max_prompt_tokens = Some(100);
        s.config = std::sync::Arc::new(config);
        s.started_at = Some(1_000);
        let call = |conclude| Instruction::CallLlm { conclude };
        let timed_out = Instruction::Finish(StopReason::TimedOut);
        assert_eq!(decide(&s, Phase::ToolsBatchResult, 1_499), call(false));
        let works = |p: &Phase| !matches!(p, Phase::Cancel | Phase::LlmResult);
        for phase in Phase::ALL.into_iter().filter(works) {
            assert_eq!(decide(&s, phase, 1_500), timed_out, "{phase:?}");
        }
        s.paused_ms = 100;
        assert_eq!(
            decide(&s, Phase::ToolsBatchResult, 1_599),
            call(false),
            "time spent paused moves the deadline"
        );
        assert_eq!(decide(&s, Phase::ToolsBatchResult, 1_600), timed_out);
        s.paused_ms = 0;
        s.checkpoint = None;
        assert_eq!(
            decide(&s, Phase::LlmResult, 1_500),
            Instruction::Finish(StopReason::Completed),
            "an answer that came in late still completes the run"
        );
        assert_eq!(
            decide(&s, Phase::Cancel, 1_500),
            Instruction::Finish(StopReason::Cancelled)
        );
        s.counters.context_tokens = 98;
        assert_eq!(decide(&s, Phase::ToolsBatchResult, 0), call(false));
        s.counters.context_tokens = 99;
        assert_eq!(
            decide(&s, Phase::ToolsBatchResult, 0),
            Instruction::CompressContext
        );
        s.just_compacted = true;
        assert_eq!(
            decide(&s, Phase::ContextCompacted, 0),
            Instruction::Finish(StopReason::BudgetExhausted),
            "still too long right after a compaction"
        );
    }

    #[test]
    fn a_budget_of_three_steps_leaves_room_for_exactly_one_tool_round_trip() {
        let mut s = state(3);
        assert_eq!(
            decide(&s, Phase::UserInput, 0),
            Instruction::CallLlm { conclude: false }
        );
        s.step_index = 2;
        assert_eq!(
            decide(&s, Phase::ToolsBatchResult, 0),
            Instruction::CallLlm { conclude: true }
        );
        let s = state(1);
        assert_eq!(
            decide(&s, Phase::UserInput, 0),
            Instruction::CallLlm { conclude: true }
        );
    }
}
