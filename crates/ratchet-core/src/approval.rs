//! Approvals: which tool calls need a human's yes before they run, the request a gated batch
//! leaves on its run, and the one transition that applies a human's answer.
//!
//! The gate holds the whole batch (seed 001): if any call of a batch needs approval, no call
//! of it runs until a human has answered for every call that needs it. Denied calls become
//! error results, so the model still sees one result per call, in its own order.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::step::{DecisionError, Phase, StepJob, back_to_running, finish_in_place, status_event};
use crate::{
    AgentState, ApprovalId, EventDraft, EventKind, HumanRequest, Millis, RunId, RunStatus,
    StopReason, ToolOutcome,
};

/// When a call of a tool must wait for a human.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalPolicy {
    #[default]
    Never,
    Always,
    /// Only when an argument matches its glob (`{"path": "secrets/**"}`); any match is
    /// enough. A string argument is matched as is, a number or boolean by its JSON text, an
    /// array when any of its items matches.
    WhenArguments(BTreeMap<String, String>),
}

impl ApprovalPolicy {
    /// Every glob must compile; called when a configuration is loaded, so that a typo is an
    /// error at start rather than a silent "never matches".
    pub fn validate(&self) -> Result<(), String> {
        if let ApprovalPolicy::WhenArguments(rules) = self {
            for (argument, pattern) in rules {
                glob::Pattern::new(pattern).map_err(|e| {
                    format!(
                        "approval rule for argument {argument:?}: invalid glob {pattern:?}: {e}"
                    )
                })?;
            }
        }
        Ok(())
    }

    pub fn requires(&self, arguments: &Value) -> bool {
        match self {
            ApprovalPolicy::Never => false,
            ApprovalPolicy::Always => true,
            ApprovalPolicy::WhenArguments(rules) => rules.iter().any(|(argument, pattern)| {
                // A glob that does not compile fails closed: the call waits for a human.
                let Ok(pattern) = glob::Pattern::new(pattern) else {
                    return true;
                };
                arguments
                    .get(argument)
                    .is_some_and(|value| value_matches(&pattern, value))
            }),
        }
    }
}

fn value_matches(pattern: &glob::Pattern, value: &Value) -> bool {
    let options = glob::MatchOptions {
        require_literal_separator: true,
        ..glob::MatchOptions::new()
    };
    match value {
        Value::String(text) => pattern.matches_with(text, options),
        Value::Number(_) | Value::Bool(_) => pattern.matches_with(&value.to_string(), options),
        Value::Array(items) => items.iter().any(|item| value_matches(pattern, item)),
        Value::Null | Value::Object(_) => false,
    }
}

/// One call of a gated batch, as the human sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApprovalCall {
    pub call_id: String,
    pub tool: String,
    pub arguments: Value,
    /// False for the calls that are only held because another call of their batch needs
    /// approval; they run unless denied.
    pub needs_approval: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Approve,
    Deny,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallDecision {
    pub call_id: String,
    pub decision: Verdict,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// A human's answer to an approval: a decision per call, or ending the run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalAnswer {
    Decisions(Vec<CallDecision>),
    Abort,
}

impl ApprovalAnswer {
    /// The same answer whatever order its decisions were given in: a repeated request is
    /// recognised as the same one.
    pub fn normalized(self) -> ApprovalAnswer {
        match self {
            ApprovalAnswer::Decisions(mut decisions) => {
                decisions.sort_by(|a, b| a.call_id.cmp(&b.call_id));
                ApprovalAnswer::Decisions(decisions)
            }
            ApprovalAnswer::Abort => ApprovalAnswer::Abort,
        }
    }
}

/// The approval a batch asked for by the model at `step_index` is known by: one per batch.
pub fn approval_id(run_id: &RunId, step_index: u64) -> ApprovalId {
    let suffix = run_id.as_str().strip_prefix(RunId::PREFIX).unwrap_or("");
    ApprovalId::from_suffix(&format!("{suffix}-{step_index}"))
        .unwrap_or_else(|_| unreachable!("a run id's suffix and a number form a valid id"))
}

/// True when the checkpoint's batch has not been answered by a human and some call of it
/// needs approval under the run's frozen policies.
pub fn approval_needed(state: &AgentState) -> bool {
    let Some(checkpoint) = &state.checkpoint else {
        return false;
    };
    !checkpoint.approved
        && checkpoint.calls.iter().any(|progress| {
            progress.outcome.is_none()
                && state
                    .config
                    .tool(&progress.call.name)
                    .is_some_and(|spec| spec.approval.requires(&progress.call.arguments))
        })
}

/// Parks the run on an approval for its checkpoint's batch, asked for at `step_index`.
pub(crate) fn ask_in_place(state: &mut AgentState, step_index: u64, events: &mut Vec<EventDraft>) {
    let calls = state
        .checkpoint
        .iter()
        .flat_map(|c| &c.calls)
        .map(|progress| ApprovalCall {
            call_id: progress.call.id.clone(),
            tool: progress.call.name.clone(),
            arguments: progress.call.arguments.clone(),
            needs_approval: state
                .config
                .tool(&progress.call.name)
                .is_some_and(|spec| spec.approval.requires(&progress.call.arguments)),
        })
        .collect::<Vec<_>>();
    let approval_id = approval_id(&state.run_id, step_index);
    events.push(EventDraft::new(
        EventKind::ApprovalRequired,
        json!({"run_id": state.run_id, "approval_id": approval_id, "calls": calls}),
    ));
    state.status = RunStatus::WaitingHuman;
    state.pending_human = Some(HumanRequest::Approval { approval_id, calls });
    events.push(status_event(state));
}

/// Applies a human's answer to the run's pending approval `id`. Decisions must name every
/// call that needs approval, and only calls of the batch, each once. The run goes back to
/// `running` with a job that runs the approved calls (denied ones get their error result),
/// or — on `Abort` — ends as cancelled. `by` (who answered: a tenant, the command line) is
/// kept with the answer in `approval.decided`.
pub fn answer_approval(
    state: &mut AgentState,
    id: &ApprovalId,
    answer: &ApprovalAnswer,
    by: &str,
    now: Millis,
) -> Result<(Vec<EventDraft>, Option<StepJob>), DecisionError> {
    let calls = match &state.pending_human {
        Some(HumanRequest::Approval { approval_id, calls })
            if approval_id == id && state.status == RunStatus::WaitingHuman =>
        {
            calls.clone()
        }
        _ => {
            return Err(DecisionError::NotWaiting {
                run_id: state.run_id.clone(),
                status: state.status,
                expected: format!("approval {id}"),
            });
        }
    };
    let mut events = vec![EventDraft::new(
        EventKind::ApprovalDecided,
        json!({"run_id": state.run_id, "approval_id": id, "answer": answer, "by": by}),
    )];
    let decisions = match answer {
        ApprovalAnswer::Abort => {
            state.cancel_requested = true;
            state.pending_human = None;
            finish_in_place(state, StopReason::Cancelled, now, &mut events);
            return Ok((events, None));
        }
        ApprovalAnswer::Decisions(decisions) => check_decisions(&calls, decisions)?,
    };
    if let Some(checkpoint) = state.checkpoint.as_mut() {
        checkpoint.approved = true;
        for progress in &mut checkpoint.calls {
            if let Some(CallDecision {
                decision: Verdict::Deny,
                note,
                ..
            }) = decisions.get(progress.call.id.as_str())
            {
                let because = note
                    .as_deref()
                    .map(|n| format!(": {n}"))
                    .unwrap_or_default();
                progress.outcome = Some(ToolOutcome::error(format!(
                    "denied by a human{because}; the call did not run"
                )));
            }
        }
    }
    let job = back_to_running(state, Phase::HumanDecided, &mut events);
    Ok((events, Some(job)))
}

/// The decisions by call id, or what is wrong with them.
fn check_decisions<'a>(
    calls: &[ApprovalCall],
    decisions: &'a [CallDecision],
) -> Result<BTreeMap<&'a str, &'a CallDecision>, DecisionError> {
    let mut by_call = BTreeMap::new();
    for decision in decisions {
        if !calls.iter().any(|c| c.call_id == decision.call_id) {
            let known = calls.iter().map(|c| c.call_id.as_str()).collect::<Vec<_>>();
            return Err(DecisionError::Invalid(format!(
                "call {:?} is not in this approval; its calls are: {}",
                decision.call_id,
                known.join(", ")
            )));
        }
        if by_call
            .insert(decision.call_id.as_str(), decision)
            .is_some()
        {
            return Err(DecisionError::Invalid(format!(
                "call {:?} is decided twice",
                decision.call_id
            )));
        }
    }
    let undecided = calls
        .iter()
        .filter(|c| c.needs_approval && !by_call.contains_key(c.call_id.as_str()))
        .map(|c| c.call_id.as_str())
        .collect::<Vec<_>>();
    if !undecided.is_empty() {
        return Err(DecisionError::Invalid(format!(
            "every call that needs approval must be decided; missing: {}",
            undecided.join(", ")
        )));
    }
    Ok(by_call)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rules(pairs: &[(&str, &str)]) -> ApprovalPolicy {
        ApprovalPolicy::WhenArguments(
            pairs
                .iter()
                .map(|(a, g)| ((*a).to_owned(), (*g).to_owned()))
                .collect(),
        )
    }

    #[test]
    fn policies_match_arguments_by_glob() {
        assert!(!ApprovalPolicy::Never.requires(&json!({"path": "x"})));
        assert!(ApprovalPolicy::Always.requires(&json!({})));
        let secrets = rules(&[("path", "secrets/**")]);
        assert!(secrets.requires(&json!({"path": "secrets/a/b.txt"})));
        assert!(!secrets.requires(&json!({"path": "notes/secrets/a"})));
        assert!(
            !secrets.requires(&json!({"file": "secrets/a"})),
            "other argument"
        );
        assert!(!secrets.requires(&json!({})));
        let star = rules(&[("path", "*.env")]);
        assert!(star.requires(&json!({"path": ".env"})));
        assert!(
            !star.requires(&json!({"path": "conf/.env"})),
            "* stops at /"
        );
        assert!(
            star.requires(&json!({"path": ["a.txt", "b.env"]})),
            "any item"
        );
        let big = rules(&[("amount", "1????")]);
        assert!(big.requires(&json!({"amount": 10000})));
        assert!(!big.requires(&json!({"amount": 999})));
        assert!(!big.requires(&json!({"amount": {"value": 10000}})));
    }

    #[test]
    fn a_bad_glob_is_rejected_at_load_and_fails_closed_at_run() {
        let bad = rules(&[("path", "[")]);
        let error = bad.validate().unwrap_err();
        assert!(
            error.contains("\"path\"") && error.contains("\"[\""),
            "{error}"
        );
        assert!(bad.requires(&json!({"path": "anything"})));
        assert!(rules(&[("path", "a/**")]).validate().is_ok());
    }

    #[test]
    fn answers_compare_equal_whatever_their_order() {
        let decision = |id: &str, decision| CallDecision {
            call_id: id.into(),
            decision,
            note: None,
        };
        let a = ApprovalAnswer::Decisions(vec![
            decision("b", Verdict::Deny),
            decision("a", Verdict::Approve),
        ]);
        let b = ApprovalAnswer::Decisions(vec![
            decision("a", Verdict::Approve),
            decision("b", Verdict::Deny),
        ]);
        assert_ne!(a, b);
        assert_eq!(a.normalized(), b.normalized());
    }

    #[test]
    fn approval_ids_are_per_run_and_step() {
        let run = RunId::from_suffix("0192-abc").unwrap();
        assert_eq!(approval_id(&run, 7).as_str(), "apr_0192-abc-7");
        assert_ne!(approval_id(&run, 7), approval_id(&run, 9));
    }
}
