//! Property tests: drive runs through random model replies, tool outcomes and cancel
//! requests using only the pure core, and check the run-lifecycle invariants at every step.

use proptest::prelude::*;
use ratchet_core::approval::answer_approval;
use ratchet_core::step::{
    Compaction, Resumption, after_compaction, after_model, after_tools, ask_approval_step,
    finish_step, pause_idle, resume_failed, resume_paused, start_run,
};
use ratchet_core::{
    AgentState, ApprovalAnswer, ApprovalPolicy, BudgetExtension, CallDecision, HumanRequest,
    Instruction, Limits, ModelReply, Phase, ReplayPolicy, RunConfigSnapshot, RunId, RunStatus,
    SessionId, StepJob, StopReason, ToolCall, ToolOutcome, ToolSpec, Verdict, decide,
};

#[derive(Debug, Clone)]
enum Reply {
    Text,
    Calls {
        count: usize,
        invalid: u32,
        finishing: bool,
        guarded: bool,
    },
}

/// What a human answers when a run waits for approval.
#[derive(Debug, Clone, Copy)]
enum Answer {
    ApproveAll,
    DenyAll,
    Abort,
}

fn reply_strategy() -> impl Strategy<Value = Reply> {
    prop_oneof![
        1 => Just(Reply::Text),
        4 => (1usize..4, 0u32..2, proptest::bool::weighted(0.1), proptest::bool::weighted(0.3))
            .prop_map(|(count, invalid, finishing, guarded)| Reply::Calls { count, invalid, finishing, guarded }),
    ]
}

fn fresh(max_steps: u64) -> AgentState {
    let tool = |name: &str, completes_run, approval| ToolSpec {
        calls: Default::default(),
        name: name.into(),
        description: String::new(),
        parameters: serde_json::json!({"type": "object"}),
        replay: ReplayPolicy::Safe,
        completes_run,
        approval,
        delegation: Default::default(),
    };
    let config = RunConfigSnapshot {
        model: "scripted:demo".into(),
        tools: vec![
            tool("add", false, ApprovalPolicy::Never),
            tool("finish_task", true, ApprovalPolicy::Never),
            tool("guarded", false, ApprovalPolicy::Always),
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_runs_keep_the_lifecycle_invariants(
        replies in proptest::collection::vec(reply_strategy(), 1..40),
        max_steps in 1u64..30,
        cancel_at in proptest::option::of(1u64..40),
        max_model_calls in proptest::option::of(1u64..12),
        max_tool_calls in proptest::option::of(0u64..12),
        answers in proptest::collection::vec(prop_oneof![
            Just(Answer::ApproveAll), Just(Answer::DenyAll), Just(Answer::Abort)
        ], 1..8),
        continues in 0u32..3,
        max_prompt_tokens in proptest::option::of(30u64..200),
        max_duration_ms in proptest::option::of(0u64..30),
        pause_at in proptest::option::of(1u64..40),
    ) {
        let mut taken_by_pause = None;
        let mut compactions_in_a_row = 0;
        let mut continues_left = continues;
        let mut answers = answers.into_iter().cycle();
        let mut denied: Vec<(u64, String)> = Vec::new();
        let mut state = fresh(max_steps);
        let mut config = state.config.as_ref().clone();
        config.limits.max_model_calls = max_model_calls;
        config.limits.max_tool_calls = max_tool_calls;
        config.limits.max_prompt_tokens = max_prompt_tokens;
        config.limits.max_duration_ms = max_duration_ms;
        state.config = std::sync::Arc::new(config);
        let (mut job, _) = start_run(&mut state, 1);
        let mut replies = replies.into_iter().cycle();
        let mut now = 1;
        loop {
            prop_assert_eq!(job.step_index, state.step_index + 1, "next job is the next step");
            if cancel_at == Some(job.step_index) {
                state.cancel_requested = true;
            }
            now += 1;
            let instruction = decide(&state, job.phase, now);
            let late = max_duration_ms.is_some_and(|d| {
                state.started_at.is_some_and(|started| now >= started + (d + state.paused_ms) as i64)
            });
            if late {
                prop_assert!(
                    matches!(instruction, Instruction::Finish(_)),
                    "past the deadline nothing new starts, found {:?}", instruction
                );
            }
            if instruction == Instruction::Finish(StopReason::TimedOut) {
                prop_assert!(late, "a run times out only past its deadline");
            }
            compactions_in_a_row = if instruction == Instruction::CompressContext { compactions_in_a_row + 1 } else { 0 };
            prop_assert!(compactions_in_a_row <= 1, "a compaction is never followed by another");
            let mut result = match instruction {
                Instruction::CallLlm { conclude } => {
                    if let Some(max) = max_prompt_tokens {
                        prop_assert!(state.counters.context_tokens < max, "prompt {} over its budget {max}", state.counters.context_tokens);
                    }
                    let reply = match replies.next().unwrap() {
                        Reply::Text => ModelReply { text: "done".into(), ..ModelReply::default() },
                        Reply::Calls { count, invalid, finishing, guarded } => {
                            let calls = (0..count).map(|i| ToolCall {
                                id: format!("c{i}"),
                                name: if finishing && i == 0 { "finish_task".into() } else if guarded && i + 1 == count { "guarded".into() } else if (i as u32) < invalid { "nope".into() } else { "add".into() },
                                arguments: serde_json::json!({}),
                            }).collect();
                            ModelReply { text: String::new(), tool_calls: calls, ..ModelReply::default() }
                        }
                    };
                    after_model(state.clone(), &job, reply, conclude, now, now)
                }
                Instruction::CallToolsBatch => {
                    let checkpoint = state.checkpoint.as_ref().unwrap();
                    prop_assert!(!state.force_finish, "no tools after force_finish");
                    let calls = &checkpoint.calls;
                    for p in calls.iter().filter(|p| p.outcome.is_none()) {
                        prop_assert!(p.call.name != "guarded" || checkpoint.approved, "a guarded call runs only once approved");
                        prop_assert!(!denied.contains(&(state.step_index, p.call.id.clone())), "a denied call never runs");
                    }
                    let outcomes: Vec<_> = calls.iter().map(|p| p.outcome.clone().unwrap_or_else(|| if p.call.name == "nope" {
                        ToolOutcome::error("unknown tool")
                    } else {
                        ToolOutcome::ok("5")
                    })).collect();
                    let invalid = calls.iter().filter(|p| p.call.name == "nope").count() as u32;
                    after_tools(state.clone(), &job, outcomes, invalid, now, now)
                }
                Instruction::Finish(reason) => finish_step(state.clone(), &job, reason, now, now),
                Instruction::AskApproval => ask_approval_step(state.clone(), &job, now, now),
                Instruction::CompressContext => {
                    let compaction = Compaction {
                        reply: ModelReply { text: "summary".into(), ..ModelReply::default() },
                        keeps_from: 0,
                        summarized: 2,
                        kept_tokens: state.counters.context_tokens / 3,
                    };
                    after_compaction(state.clone(), &job, Some(compaction), now, now)
                }
            };
            if pause_at == Some(job.step_index) {
                let would_run = result.next.clone();
                if result.yield_to_pause() {
                    prop_assert!(would_run.is_some(), "only a run that would go on pauses");
                    taken_by_pause = would_run;
                } else {
                    prop_assert_eq!(&result.next, &would_run, "a refused pause changes nothing");
                }
            }
            prop_assert_eq!(result.state.step_index, state.step_index + 1);
            prop_assert_eq!(result.record.index, job.step_index);
            prop_assert!(state.status.edge(result.state.status).is_ok());
            prop_assert!(result.state.step_index <= state.limits().max_steps.max(1) + 1, "budget is a hard cap");
            let terminal = result.state.status.is_terminal();
            prop_assert_eq!(terminal, result.state.stop_reason.is_some());
            prop_assert_eq!(terminal, result.state.finished_at.is_some());
            let waiting = result.state.status == RunStatus::WaitingHuman;
            prop_assert_eq!(
                result.record.summary.get("asked_approval").and_then(|a| a.as_bool()) == Some(true),
                matches!(result.state.pending_human, Some(HumanRequest::Approval { .. })),
                "a step's record says when it left the run waiting for an approval"
            );
            let paused = result.state.status == RunStatus::Paused;
            prop_assert_eq!(paused, result.state.pause.is_some());
            prop_assert_eq!(terminal || waiting || paused, result.next.is_none(), "a job exactly while not terminal, waiting or paused");
            let finished_events = result.events.iter().filter(|e| e.kind.as_str() == "run.finished").count();
            prop_assert_eq!(finished_events, usize::from(terminal));
            state = result.state;
            match result.next {
                Some(next) => job = next,
                None if paused => {
                    let since = now;
                    now += 1_000;
                    let before = state.paused_ms;
                    let (events, next) = resume_paused(&mut state, now).unwrap();
                    prop_assert_eq!(Some(&next), taken_by_pause.as_ref(), "resuming gives back the job the pause took");
                    prop_assert_eq!(state.status, RunStatus::Running);
                    prop_assert_eq!(state.pause, None);
                    prop_assert_eq!(state.paused_ms, before + (now - since) as u64);
                    prop_assert_eq!(events[0].payload["status"].as_str(), Some("running"));
                    job = next;
                }
                None if waiting => {
                    let Some(HumanRequest::Approval { approval_id, calls }) = state.pending_human.clone() else {
                        return Err(TestCaseError::fail("waiting without an approval"));
                    };
                    prop_assert!(calls.iter().any(|c| c.needs_approval));
                    let decide_all = |decision| ApprovalAnswer::Decisions(calls.iter().map(|c| CallDecision {
                        call_id: c.call_id.clone(), decision, note: None,
                    }).collect());
                    let answer = match answers.next().unwrap() {
                        Answer::ApproveAll => decide_all(Verdict::Approve),
                        Answer::DenyAll => {
                            denied.extend(calls.iter().map(|c| (state.step_index, c.call_id.clone())));
                            decide_all(Verdict::Deny)
                        }
                        Answer::Abort => ApprovalAnswer::Abort,
                    };
                    let before = state.status;
                    now += 1;
                    let (events, next) = answer_approval(&mut state, &approval_id, &answer, "a human", now).unwrap();
                    prop_assert!(before.edge(state.status).is_ok());
                    prop_assert_eq!(events[0].kind.as_str(), "approval.decided");
                    match next {
                        Some(next) => job = next,
                        None => {
                            prop_assert_eq!(state.stop_reason, Some(StopReason::Cancelled), "only an abort ends a run waiting for approval");
                            break;
                        }
                    }
                }
                None if state.status == RunStatus::Failed && continues_left > 0 => {
                    continues_left -= 1;
                    let extension = BudgetExtension { steps: 4, model_calls: 2, tool_calls: 3, ..BudgetExtension::default() };
                    match resume_failed(&mut state, Resumption::Continue { extension }, now) {
                        Ok((events, next)) => {
                            prop_assert_eq!(state.status, RunStatus::Running);
                            prop_assert_eq!(state.stop_reason, None);
                            prop_assert_eq!(events[0].kind.as_str(), "run.resumed");
                            prop_assert_eq!(next.step_index, state.step_index + 1);
                            job = next;
                        }
                        Err(refused) => {
                            prop_assert_eq!(state.status, RunStatus::Failed, "a refused continue changes nothing: {}", refused);
                            break;
                        }
                    }
                }
                None => break,
            }
        }
        let limits = state.limits();
        let max_steps = limits.max_steps;
        let (max_model_calls, max_tool_calls) = (limits.max_model_calls, limits.max_tool_calls);
        let reason = state.stop_reason.unwrap();
        prop_assert_eq!(state.status, reason.terminal_status());
        if cancel_at.is_some_and(|at| at <= state.step_index) {
            prop_assert_eq!(reason, StopReason::Cancelled);
        }
        prop_assert!(state.step_index <= max_steps, "steps {} > max {}", state.step_index, max_steps);
        if let Some(max) = max_model_calls {
            prop_assert!(state.counters.model_calls <= max, "model calls {} > max {max}", state.counters.model_calls);
        }
        if let Some(max) = max_tool_calls {
            // A batch asked for below the limit runs whole: at most one batch (3 calls) over.
            prop_assert!(state.counters.tool_calls <= max + 3, "tool calls {} > max {max} + one batch", state.counters.tool_calls);
        }
    }
}

#[test]
fn a_tool_round_trip_takes_three_steps() {
    let mut state = fresh(50);
    let (job, _) = start_run(&mut state, 0);
    let reply = ModelReply {
        tool_calls: vec![ToolCall {
            id: "c0".into(),
            name: "add".into(),
            arguments: serde_json::json!({"a": 2, "b": 3}),
        }],
        ..ModelReply::default()
    };
    let step1 = after_model(state, &job, reply, false, 0, 1);
    let job2 = step1.next.clone().unwrap();
    assert_eq!((job2.step_index, job2.phase), (2, Phase::LlmResult));
    assert_eq!(
        decide(&step1.state, job2.phase, 0),
        Instruction::CallToolsBatch
    );
    let step2 = after_tools(step1.state, &job2, vec![ToolOutcome::ok("5")], 0, 1, 2);
    assert_eq!(step2.messages[0].tool_call_id.as_deref(), Some("c0"));
    let job3: StepJob = step2.next.clone().unwrap();
    assert_eq!(
        decide(&step2.state, job3.phase, 0),
        Instruction::CallLlm { conclude: false }
    );
    let reply = ModelReply {
        text: "The sum is 5.".into(),
        ..ModelReply::default()
    };
    let step3 = after_model(step2.state, &job3, reply, false, 2, 3);
    assert_eq!(step3.next, None);
    assert_eq!(step3.state.status, RunStatus::Completed);
    assert_eq!(step3.state.step_index, 3);
    assert_eq!(step3.state.final_answer.as_deref(), Some("The sum is 5."));
}

#[test]
fn a_cancel_during_a_step_keeps_the_work_and_finishes_next() {
    let mut state = fresh(50);
    let (job, _) = start_run(&mut state, 0);
    let reply = ModelReply {
        tool_calls: vec![ToolCall {
            id: "c0".into(),
            name: "add".into(),
            arguments: serde_json::json!({}),
        }],
        ..ModelReply::default()
    };
    let mut result = after_model(state, &job, reply, false, 0, 1);
    result.yield_to_cancel();
    assert_eq!(result.state.status, RunStatus::Cancelling);
    assert_eq!(
        result.messages.len(),
        1,
        "the model's answer is still committed"
    );
    let next = result.next.clone().unwrap();
    assert_eq!(next.phase, Phase::Cancel);
    assert_eq!(
        decide(&result.state, next.phase, 0),
        Instruction::Finish(StopReason::Cancelled)
    );
}

#[test]
fn a_cancel_during_a_step_that_would_wait_for_a_human_announces_no_wait() {
    let mut state = fresh(50);
    let (job, _) = start_run(&mut state, 0);
    let reply = ModelReply {
        tool_calls: vec![ToolCall {
            id: "c0".into(),
            name: "guarded".into(),
            arguments: serde_json::json!({}),
        }],
        ..ModelReply::default()
    };
    let mut result = after_model(state, &job, reply, false, 0, 1);
    let kinds = |result: &ratchet_core::StepResult| -> Vec<String> {
        result
            .events
            .iter()
            .map(|e| e.kind.as_str().to_owned())
            .collect()
    };
    assert!(
        kinds(&result).contains(&"approval.required".to_owned()),
        "the batch asks for approval: {:?}",
        kinds(&result)
    );
    result.yield_to_cancel();
    assert_eq!(result.state.pending_human, None);
    assert!(
        !kinds(&result).contains(&"approval.required".to_owned()),
        "no approval exists to answer: {:?}",
        kinds(&result)
    );
    let statuses: Vec<&serde_json::Value> = result
        .events
        .iter()
        .filter(|e| e.kind.as_str() == "run.status")
        .map(|e| &e.payload["status"])
        .collect();
    assert_eq!(statuses, ["cancelling"]);
}

#[test]
fn a_concluding_answer_completes_and_a_concluding_tool_request_exhausts_the_budget() {
    let mut state = fresh(1);
    let (job, _) = start_run(&mut state, 0);
    assert_eq!(
        decide(&state, job.phase, 0),
        Instruction::CallLlm { conclude: true }
    );
    let answer = ModelReply {
        text: "42".into(),
        ..ModelReply::default()
    };
    let answered = after_model(state.clone(), &job, answer, true, 0, 1);
    assert_eq!(answered.state.status, RunStatus::Completed);
    assert_eq!(answered.state.stop_reason, Some(StopReason::Completed));

    let wants_tools = ModelReply {
        tool_calls: vec![ToolCall {
            id: "c0".into(),
            name: "add".into(),
            arguments: serde_json::json!({}),
        }],
        ..ModelReply::default()
    };
    let cut = after_model(state, &job, wants_tools, true, 0, 1);
    assert_eq!(cut.state.status, RunStatus::Failed);
    assert_eq!(cut.state.stop_reason, Some(StopReason::BudgetExhausted));
    assert!(
        cut.messages[0].tool_calls.is_empty(),
        "no call is offered to run"
    );
}

#[test]
fn reconciliation_answers_each_call_in_doubt_then_resumes_the_batch() {
    use ratchet_core::step::{DecisionError, Reconciliation, await_reconciliation, reconcile};
    use ratchet_core::{HumanRequest, UnknownCall};

    let mut state = fresh(50);
    let (job, _) = start_run(&mut state, 0);
    let call = |i: usize| ToolCall {
        id: format!("c{i}"),
        name: "add".into(),
        arguments: serde_json::json!({}),
    };
    let reply = ModelReply {
        tool_calls: vec![call(0), call(1), call(2)],
        ..ModelReply::default()
    };
    let asked = after_model(state, &job, reply, false, 0, 1);
    let batch_job = asked.next.clone().unwrap();
    let doubt = |i: usize| UnknownCall {
        drift: None,
        call_index: i,
        call_id: format!("c{i}"),
        tool: "add".into(),
        arguments: serde_json::json!({}),
        idempotency_key: format!("k{i}"),
    };
    let request = HumanRequest::Reconciliation {
        calls: vec![doubt(0), doubt(2)],
    };
    let known = vec![None, Some(ToolOutcome::ok("2")), None];
    let mut waiting = await_reconciliation(asked.state, &batch_job, known, request, 1, 2).state;
    assert_eq!(waiting.status, RunStatus::WaitingHuman);

    let wrong = reconcile(&mut waiting, "c1", Reconciliation::Skip, None).unwrap_err();
    assert!(matches!(wrong, DecisionError::NotAwaited { .. }), "{wrong}");
    assert!(wrong.to_string().contains("awaiting: c0, c2"), "{wrong}");

    let (events, job) = reconcile(
        &mut waiting,
        "c0",
        Reconciliation::Succeeded,
        Some("7".into()),
    )
    .unwrap();
    assert_eq!(job, None, "c2 is still in doubt");
    assert_eq!(events[0].kind.as_str(), "reconciliation.decided");
    assert_eq!(waiting.status, RunStatus::WaitingHuman);

    let (_, job) = reconcile(&mut waiting, "c2", Reconciliation::Retry, None).unwrap();
    let job = job.expect("all answered: the batch goes on");
    assert_eq!(
        (job.step_index, job.phase),
        (waiting.step_index + 1, Phase::HumanDecided)
    );
    assert_eq!(waiting.status, RunStatus::Running);
    assert_eq!(waiting.pending_human, None);
    let outcomes: Vec<_> = waiting
        .checkpoint
        .as_ref()
        .unwrap()
        .calls
        .iter()
        .map(|c| c.outcome.clone())
        .collect();
    assert_eq!(
        outcomes,
        [Some(ToolOutcome::ok("7")), Some(ToolOutcome::ok("2")), None],
        "retry runs c2 again"
    );
    assert_eq!(decide(&waiting, job.phase, 0), Instruction::CallToolsBatch);

    let again = reconcile(&mut waiting, "c2", Reconciliation::Skip, None).unwrap_err();
    assert!(matches!(again, DecisionError::NotWaiting { .. }), "{again}");
}

fn failed_with(reason: StopReason) -> AgentState {
    let mut state = fresh(3);
    state.status = RunStatus::Failed;
    state.stop_reason = Some(reason);
    state.step_index = 3;
    state.finished_at = Some(9);
    state
}

#[test]
fn retry_repeats_a_failed_model_call_and_continue_needs_budget_to_go_on() {
    let mut completed = fresh(3);
    completed.status = RunStatus::Completed;
    completed.stop_reason = Some(StopReason::Completed);
    let error = resume_failed(&mut completed, Resumption::Retry, 0).unwrap_err();
    assert!(error.to_string().contains("only a failed run"), "{error}");

    let mut llm_error = failed_with(StopReason::LlmError);
    llm_error.step_index = 1;
    let (events, job) = resume_failed(&mut llm_error, Resumption::Retry, 0).unwrap();
    assert_eq!((job.step_index, job.phase), (2, Phase::Resumed));
    assert_eq!(llm_error.status, RunStatus::Running);
    assert_eq!((llm_error.stop_reason, llm_error.finished_at), (None, None));
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds, ["run.resumed", "run.status"]);
    assert_eq!(
        decide(&llm_error, job.phase, 0),
        Instruction::CallLlm { conclude: true }
    );

    let mut spent = failed_with(StopReason::BudgetExhausted);
    spent.force_finish = true;
    spent.checkpoint = Some(ratchet_core::ToolCheckpoint::new(vec![ToolCall {
        id: "never-offered".into(),
        name: "add".into(),
        arguments: serde_json::json!({}),
    }]));
    let before = spent.clone();
    let retry = resume_failed(&mut spent, Resumption::Retry, 0).unwrap_err();
    assert!(retry.to_string().contains("use continue"), "{retry}");
    let nothing = Resumption::Continue {
        extension: BudgetExtension::default(),
    };
    let still = resume_failed(&mut spent, nothing, 0).unwrap_err();
    assert!(still.to_string().contains("budget is spent"), "{still}");
    assert_eq!(spent, before, "a refused resumption changes nothing");
    let more = Resumption::Continue {
        extension: BudgetExtension {
            steps: 5,
            ..BudgetExtension::default()
        },
    };
    let (_, job) = resume_failed(&mut spent, more, 0).unwrap();
    assert_eq!(spent.limits().max_steps, 8);
    assert_eq!(
        spent.config.limits.max_steps, 3,
        "the frozen config is untouched"
    );
    assert!(
        !spent.force_finish && spent.checkpoint.is_none(),
        "calls never offered do not run"
    );
    assert_eq!(
        decide(&spent, job.phase, 0),
        Instruction::CallLlm { conclude: false }
    );

    let mut huge = failed_with(StopReason::BudgetExhausted);
    let mut deadline = huge.config.as_ref().clone();
    deadline.limits.max_duration_ms = Some(500);
    huge.config = std::sync::Arc::new(deadline);
    let all = BudgetExtension {
        steps: u64::MAX,
        model_calls: u64::MAX,
        tool_calls: u64::MAX,
        tokens: u64::MAX,
        duration_ms: u64::MAX,
    };
    resume_failed(&mut huge, Resumption::Continue { extension: all }, 0).unwrap();
    huge.status = RunStatus::Failed;
    huge.stop_reason = Some(StopReason::BudgetExhausted);
    resume_failed(&mut huge, Resumption::Continue { extension: all }, 0).unwrap();
    assert_eq!(
        huge.limits().max_steps,
        u64::MAX,
        "budgets saturate, never overflow"
    );
    huge.started_at = Some(1_000);
    assert_eq!(
        decide(&huge, Phase::Resumed, 2_000),
        Instruction::CallLlm { conclude: false },
        "an endless deadline is never reached"
    );
    // Whatever a provider reports, counting never overflows.
    let absurd = ModelReply {
        text: "x".into(),
        usage: ratchet_core::Usage {
            input_tokens: u64::MAX,
            output_tokens: u64::MAX,
            reasoning_tokens: u64::MAX,
            cache_write_tokens: 0,
            cache_read_tokens: 0,
        },
        ..ModelReply::default()
    };
    let job = StepJob {
        run_id: huge.run_id.clone(),
        step_index: huge.step_index + 1,
        phase: Phase::Resumed,
        attempt: 1,
    };
    let once = after_model(huge.clone(), &job, absurd.clone(), false, 0, 1).state;
    assert_eq!(once.counters.input_tokens, u64::MAX);
    decide(&once, Phase::ToolsBatchResult, 2);

    let mut parse = failed_with(StopReason::ParseFailures);
    parse.counters.consecutive_parse_failures = 3;
    parse.step_index = 1;
    let nothing = Resumption::Continue {
        extension: BudgetExtension::default(),
    };
    resume_failed(&mut parse, nothing, 0).unwrap();
    assert_eq!(parse.counters.consecutive_parse_failures, 0);
}

fn one_add_call() -> ModelReply {
    ModelReply {
        tool_calls: vec![ToolCall {
            id: "c0".into(),
            name: "add".into(),
            arguments: serde_json::json!({}),
        }],
        ..ModelReply::default()
    }
}

#[test]
fn a_pause_during_a_step_keeps_the_work_and_resume_gives_back_the_next_job() {
    let mut state = fresh(50);
    let (job, _) = start_run(&mut state, 0);
    let mut result = after_model(state, &job, one_add_call(), false, 0, 10);
    let would_run = result.next.clone().unwrap();
    assert!(result.yield_to_pause());
    assert_eq!(result.state.status, RunStatus::Paused);
    assert_eq!(result.next, None, "a paused run has no job");
    assert_eq!(
        result.messages.len(),
        1,
        "the model's answer is still committed"
    );
    let last = result.events.last().unwrap();
    assert_eq!(
        (last.kind.as_str(), last.payload["status"].as_str()),
        ("run.status", Some("paused"))
    );
    assert!(!result.yield_to_pause(), "a paused run is not paused twice");

    let mut state = result.state;
    let (events, job) = resume_paused(&mut state, 2_010).unwrap();
    assert_eq!(
        job,
        StepJob {
            attempt: 0,
            ..would_run
        }
    );
    assert_eq!(state.status, RunStatus::Running);
    assert_eq!(state.paused_ms, 2_000);
    assert_eq!(events.len(), 1);
    let refused = resume_paused(&mut state, 2_020).unwrap_err();
    assert!(
        refused.to_string().contains("only a paused run can"),
        "{refused}"
    );
}

#[test]
fn a_pause_leaves_ending_cancelling_and_waiting_steps_alone() {
    let mut state = fresh(50);
    let (job, _) = start_run(&mut state, 0);
    let text = ModelReply {
        text: "done".into(),
        ..ModelReply::default()
    };
    let mut ending = after_model(state.clone(), &job, text, false, 0, 1);
    assert!(!ending.yield_to_pause());
    assert_eq!(ending.state.status, RunStatus::Completed);

    let mut cancelling = after_model(state.clone(), &job, one_add_call(), false, 0, 1);
    cancelling.yield_to_cancel();
    assert!(!cancelling.yield_to_pause(), "a cancel wins over a pause");
    assert_eq!(cancelling.state.status, RunStatus::Cancelling);

    let asking = after_model(state, &job, one_add_call(), false, 0, 1);
    let mut waiting = ask_approval_step(asking.state, asking.next.as_ref().unwrap(), 1, 2);
    assert!(!waiting.yield_to_pause());
    assert_eq!(waiting.state.status, RunStatus::WaitingHuman);
}

#[test]
fn an_idle_pause_takes_only_a_running_run_and_paused_time_is_not_spent() {
    let mut state = fresh(50);
    let mut config = state.config.as_ref().clone();
    config.limits.max_duration_ms = Some(500);
    state.config = std::sync::Arc::new(config);
    let refused = pause_idle(&mut state.clone(), Phase::UserInput, 0).unwrap_err();
    assert!(refused.to_string().contains("it is queued"), "{refused}");
    let (job, _) = start_run(&mut state, 0);
    let events = pause_idle(&mut state, job.phase, 100).unwrap();
    assert_eq!(events[0].payload["status"].as_str(), Some("paused"));
    assert!(pause_idle(&mut state.clone(), job.phase, 100).is_err());
    let (_, resumed) = resume_paused(&mut state, 60_100).unwrap();
    assert_eq!(resumed.phase, job.phase);
    assert_eq!(
        decide(&state, resumed.phase, 60_200),
        Instruction::CallLlm { conclude: false },
        "200 ms of work is inside a 500 ms budget, whatever the pause took"
    );
    assert_eq!(
        decide(&state, resumed.phase, 60_600),
        Instruction::Finish(ratchet_core::StopReason::TimedOut)
    );
}

fn with_criteria(required_tools: &[&str], max_attempts: u32) -> AgentState {
    let mut state = fresh(50);
    let mut config = state.config.as_ref().clone();
    config.completion = Some(ratchet_core::CompletionCriteria {
        required_tools: required_tools.iter().map(|t| (*t).to_owned()).collect(),
        required_fields: Vec::new(),
        min_steps: 0,
        max_attempts,
    });
    state.config = std::sync::Arc::new(config);
    state
}

#[test]
fn a_completion_with_an_unmet_criterion_is_refused_and_the_model_goes_on() {
    let mut state = with_criteria(&["add"], 3);
    let (job, _) = start_run(&mut state, 0);
    let done = ModelReply {
        text: "done".into(),
        ..ModelReply::default()
    };
    let refused = after_model(state, &job, done.clone(), false, 0, 1);
    assert_eq!(refused.state.status, RunStatus::Running);
    let next = refused.next.clone().expect("the model is called again");
    assert_eq!(next.phase, Phase::CompletionBlocked);
    let blocked = refused
        .events
        .iter()
        .find(|e| e.kind.as_str() == "completion.blocked")
        .unwrap();
    assert_eq!(
        blocked.payload["blockers"],
        serde_json::json!([{"kind": "tool_not_called", "tool": "add"}])
    );
    let hint = refused.messages.last().unwrap();
    assert_eq!(hint.visibility, ratchet_core::Visibility::Hidden);
    assert!(hint.content.contains("`add`"), "{}", hint.content);
    assert!(matches!(
        decide(&refused.state, next.phase, 1),
        Instruction::CallLlm { conclude: false }
    ));

    let asked = after_model(refused.state, &next, one_add_call(), false, 1, 2);
    let tools = asked.next.clone().unwrap();
    let ran = after_tools(asked.state, &tools, vec![ToolOutcome::ok("5")], 0, 2, 3);
    let answer = ran.next.clone().unwrap();
    let completed = after_model(ran.state, &answer, done, false, 3, 4);
    assert_eq!(completed.state.status, RunStatus::Completed);
    assert_eq!(completed.state.completion.refused, 1);
    assert!(
        completed.state.completion.blockers.is_empty(),
        "met at last"
    );
}

#[test]
fn refusing_more_than_max_attempts_fails_the_run_with_its_blockers() {
    let mut state = with_criteria(&["add"], 1);
    let (mut job, _) = start_run(&mut state, 0);
    let done = ModelReply {
        text: "done".into(),
        ..ModelReply::default()
    };
    for attempt in 1..=2 {
        let result = after_model(state, &job, done.clone(), false, attempt, attempt);
        state = result.state;
        if let Some(next) = result.next {
            job = next;
        }
    }
    assert_eq!(state.status, RunStatus::Failed);
    assert_eq!(state.stop_reason, Some(StopReason::CompletionBlocked));
    assert_eq!(state.completion.refused, 2);
    assert_eq!(
        state.completion.blockers.len(),
        1,
        "the blockers stay visible"
    );
}
