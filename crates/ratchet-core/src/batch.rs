//! How a tool batch is planned before anything of it runs: which calls already have their
//! outcome, which are in doubt and must be answered by a human first, and which may run now.
//! The engine performs the plan (it checks each runnable call against its tool and runs it);
//! the decisions are here, where they can be tested without I/O.

use std::collections::HashMap;

use crate::{
    AgentState, ReplayPolicy, StepJob, ToolCall, ToolDelegation, ToolOutcome, UnknownCall,
};

/// What becomes of one call of a batch before the batch runs.
#[derive(Debug, Clone, PartialEq)]
pub enum SlotPlan {
    /// Its outcome is known: kept in the checkpoint, or recorded by an earlier attempt of the
    /// step. It does not run again.
    Known(ToolOutcome),
    /// A human must say what happened to it before the batch goes on: a `never` call an
    /// earlier attempt started without recording how it ended, or a call of a tool that
    /// changed since the model was offered it (`drift` says how).
    InDoubt(UnknownCall),
    /// It may run now.
    Run,
}

/// Plans the batch of `state`'s checkpoint, in the model's order. `started` holds what earlier
/// attempts of this step recorded, by slot (an intent, with its outcome once known); `drift`
/// says how the tool a call names changed since the model was offered it, if it did — asked
/// only of calls a human has not already approved to run again, and never of the runtime's
/// own tools.
pub fn plan_batch(
    state: &AgentState,
    job: &StepJob,
    started: &HashMap<u32, Option<ToolOutcome>>,
    drift: impl Fn(&str) -> Option<String>,
) -> Vec<SlotPlan> {
    let calls = state.checkpoint.iter().flat_map(|c| &c.calls);
    (0u32..)
        .zip(calls)
        .map(|(slot, progress)| {
            let call = &progress.call;
            let earlier = started.get(&slot);
            if let Some(known) = (progress.outcome.clone()).or_else(|| earlier.cloned().flatten()) {
                return SlotPlan::Known(known);
            }
            let spec = state.config.tool(&call.name);
            if earlier.is_some() && spec.is_some_and(|s| s.replay == ReplayPolicy::Never) {
                return SlotPlan::InDoubt(unknown_call(state, job, slot, call));
            }
            let injected = spec.is_some_and(|s| s.delegation == ToolDelegation::RuntimeInjected);
            match (!injected && !progress.rerun_approved)
                .then(|| drift(&call.name))
                .flatten()
            {
                Some(drift) => SlotPlan::InDoubt(UnknownCall {
                    drift: Some(drift),
                    ..unknown_call(state, job, slot, call)
                }),
                None => SlotPlan::Run,
            }
        })
        .collect()
}

/// A started call whose outcome is unknown, as a human is asked about it.
pub fn unknown_call(state: &AgentState, job: &StepJob, slot: u32, call: &ToolCall) -> UnknownCall {
    UnknownCall {
        drift: None,
        call_index: slot as usize,
        call_id: call.id.clone(),
        tool: call.name.clone(),
        arguments: call.arguments.clone(),
        idempotency_key: call_key(state, job, slot),
    }
}

/// Deterministic per call of a step, so a provider or a tool sees the same key after a crash:
/// `{run}#{step}#{slot}`.
pub fn step_key(job: &StepJob, slot: u32) -> String {
    format!("{}#{}#{}", job.run_id, job.step_index, slot)
}

/// Deterministic per tool call, so a tool sees the same key after a crash, a takeover or a
/// wait for a human that moved its batch to a later step: `{run}#{step}#{slot}`, the step
/// being the batch's first.
pub fn call_key(state: &AgentState, job: &StepJob, slot: u32) -> String {
    match &state.checkpoint {
        Some(checkpoint) => checkpoint.idempotency_key(&job.run_id, job.step_index, slot),
        None => step_key(job, slot),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::state::{ToolCheckpoint, ToolSpec};
    use crate::{ApprovalPolicy, CallLimits, Phase, RunConfigSnapshot, RunId, SessionId};

    const REPLAYS: [ReplayPolicy; 3] =
        [ReplayPolicy::Safe, ReplayPolicy::Keyed, ReplayPolicy::Never];

    fn state_with(
        replay: ReplayPolicy,
        delegation: ToolDelegation,
        outcome: Option<ToolOutcome>,
        rerun_approved: bool,
    ) -> (AgentState, StepJob) {
        let run_id = RunId::parse("run_plan").unwrap();
        let config = RunConfigSnapshot {
            tools: vec![ToolSpec {
                name: "lookup".into(),
                description: String::new(),
                parameters: json!({"type": "object"}),
                replay,
                completes_run: false,
                approval: ApprovalPolicy::Never,
                delegation,
                calls: CallLimits::default(),
            }],
            ..RunConfigSnapshot::default()
        };
        let mut state = AgentState::new(
            SessionId::parse("ses_plan").unwrap(),
            run_id.clone(),
            config,
            0,
        );
        let mut checkpoint = ToolCheckpoint::new(vec![ToolCall {
            id: "call-1".into(),
            name: "lookup".into(),
            arguments: json!({"q": 1}),
        }]);
        checkpoint.calls[0].outcome = outcome;
        checkpoint.calls[0].rerun_approved = rerun_approved;
        checkpoint.key_step = Some(3);
        state.checkpoint = Some(checkpoint);
        let job = StepJob {
            run_id,
            step_index: 5,
            phase: Phase::ToolsBatchResult,
            attempt: 2,
        };
        (state, job)
    }

    /// Every combination of what is known of the one call, what an earlier attempt recorded,
    /// its replay policy, its tool's origin, whether a human approved a rerun and whether its
    /// tool drifted — against the rule, stated once here.
    #[test]
    fn every_call_is_known_in_doubt_or_run_as_the_rule_says() {
        let ok = ToolOutcome::ok("42");
        for replay in REPLAYS {
            for delegation in [ToolDelegation::RootOnly, ToolDelegation::RuntimeInjected] {
                for in_checkpoint in [None, Some(ok.clone())] {
                    for earlier in [None, Some(None), Some(Some(ToolOutcome::ok("from intent")))] {
                        for rerun_approved in [false, true] {
                            for drifted in [false, true] {
                                let (state, job) = state_with(
                                    replay,
                                    delegation,
                                    in_checkpoint.clone(),
                                    rerun_approved,
                                );
                                let started: HashMap<u32, Option<ToolOutcome>> =
                                    earlier.clone().map(|e| (0, e)).into_iter().collect();
                                let plan = plan_batch(&state, &job, &started, |_| {
                                    drifted.then(|| "changed".to_owned())
                                });
                                let injected = delegation == ToolDelegation::RuntimeInjected;
                                let expected = match (&in_checkpoint, &earlier) {
                                    (Some(known), _) => SlotPlan::Known(known.clone()),
                                    (None, Some(Some(recorded))) => {
                                        SlotPlan::Known(recorded.clone())
                                    }
                                    (None, Some(None)) if replay == ReplayPolicy::Never => {
                                        SlotPlan::InDoubt(unknown_call(
                                            &state,
                                            &job,
                                            0,
                                            &state.checkpoint.as_ref().unwrap().calls[0].call,
                                        ))
                                    }
                                    _ if drifted && !injected && !rerun_approved => {
                                        SlotPlan::InDoubt(UnknownCall {
                                            drift: Some("changed".into()),
                                            ..unknown_call(
                                                &state,
                                                &job,
                                                0,
                                                &state.checkpoint.as_ref().unwrap().calls[0].call,
                                            )
                                        })
                                    }
                                    _ => SlotPlan::Run,
                                };
                                assert_eq!(
                                    plan,
                                    [expected],
                                    "{replay:?} {delegation:?} checkpoint {in_checkpoint:?} earlier {earlier:?} rerun {rerun_approved} drift {drifted}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_call_in_doubt_carries_the_key_its_batch_was_started_with() {
        let (state, job) = state_with(ReplayPolicy::Never, ToolDelegation::RootOnly, None, false);
        let started = HashMap::from([(0, None)]);
        let plan = plan_batch(&state, &job, &started, |_| None);
        let [SlotPlan::InDoubt(unknown)] = plan.as_slice() else {
            panic!("a never call started without an outcome is in doubt: {plan:?}");
        };
        assert_eq!(
            (unknown.idempotency_key.as_str(), unknown.call_id.as_str()),
            ("run_plan#3#0", "call-1"),
            "the key of the batch's first step, not of the step retrying it"
        );
        assert_eq!(step_key(&job, 1), "run_plan#5#1");
    }

    #[test]
    fn a_step_without_a_batch_plans_nothing() {
        let (mut state, job) =
            state_with(ReplayPolicy::Safe, ToolDelegation::RootOnly, None, false);
        state.checkpoint = None;
        assert!(plan_batch(&state, &job, &HashMap::new(), |_| None).is_empty());
    }
}
