//! Completion criteria: what a run must have done before it may complete, and what happens
//! when the model tries to finish too early.
//!
//! When the Brain would complete a run whose criteria are unmet, the run does not complete:
//! the step commits the model's answer together with a hidden message naming every blocker,
//! and the next step calls the model again, within its budgets. After `max_attempts` refused
//! completions the run fails with `completion_blocked`.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::step::{Phase, StepJob};
use crate::{AgentState, EventDraft, EventKind, Instruction, Message, Millis, StopReason};

/// The conditions of an agent's `completion` block, frozen with each run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompletionCriteria {
    /// Tools the run must have called successfully (an error result does not count).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub required_tools: Vec<String>,
    /// Fields the final answer must carry as a JSON object (a fenced ```json block counts);
    /// `a.b` names field `b` of object `a`. A `null` field is missing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub required_fields: Vec<String>,
    /// Steps the run must have committed, the completing one included.
    #[serde(default)]
    pub min_steps: u64,
    /// Completions that may be refused before the run fails with `completion_blocked`.
    pub max_attempts: u32,
}

impl CompletionCriteria {
    pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
}

/// One unmet condition, as the API shows it and the model is told it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Blocker {
    ToolNotCalled { tool: String },
    AnswerNotJson,
    FieldMissing { field: String },
    TooFewSteps { required: u64, taken: u64 },
}

impl fmt::Display for Blocker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Blocker::ToolNotCalled { tool } => {
                write!(
                    f,
                    "call the tool `{tool}` successfully (it has not been yet)"
                )
            }
            Blocker::AnswerNotJson => write!(
                f,
                "give the final answer as one JSON object (it was not valid JSON)"
            ),
            Blocker::FieldMissing { field } => {
                write!(f, "include the field `{field}` in the final JSON answer")
            }
            Blocker::TooFewSteps { required, taken } => write!(
                f,
                "keep working: at least {required} steps are required before finishing ({taken} so far)"
            ),
        }
    }
}

/// Where a run stands with its criteria: the tools it has called successfully (those the
/// criteria name), how many completions were refused, and the blockers of the last one.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompletionProgress {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools_called: Vec<String>,
    #[serde(default)]
    pub refused: u32,
    /// Empty once the run completes with every condition met.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blockers: Vec<Blocker>,
}

impl CompletionProgress {
    pub fn is_untouched(&self) -> bool {
        *self == CompletionProgress::default()
    }
}

/// Every condition `state` does not meet, in the order the criteria name them.
pub fn blockers(state: &AgentState) -> Vec<Blocker> {
    let Some(criteria) = &state.config.completion else {
        return Vec::new();
    };
    let mut found: Vec<Blocker> = criteria
        .required_tools
        .iter()
        .filter(|tool| !state.completion.tools_called.contains(tool))
        .map(|tool| Blocker::ToolNotCalled { tool: tool.clone() })
        .collect();
    if !criteria.required_fields.is_empty() {
        match json_answer(state.final_answer.as_deref().unwrap_or_default()) {
            Some(answer) => found.extend(
                criteria
                    .required_fields
                    .iter()
                    .filter(|field| field_of(&answer, field).is_none())
                    .map(|field| Blocker::FieldMissing {
                        field: field.clone(),
                    }),
            ),
            None => found.push(Blocker::AnswerNotJson),
        }
    }
    if state.step_index < criteria.min_steps {
        found.push(Blocker::TooFewSteps {
            required: criteria.min_steps,
            taken: state.step_index,
        });
    }
    found
}

/// The answer as a JSON object: the whole text, or the one fenced block in it.
fn json_answer(text: &str) -> Option<Value> {
    let text = text.trim();
    let parsed = serde_json::from_str::<Value>(text).ok().or_else(|| {
        let (_, fenced) = text.split_once("```")?;
        let fenced = fenced.strip_prefix("json").unwrap_or(fenced);
        let (inside, _) = fenced.split_once("```")?;
        serde_json::from_str(inside.trim()).ok()
    })?;
    parsed.is_object().then_some(parsed)
}

fn field_of<'a>(answer: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.')
        .try_fold(answer, |value, key| value.get(key))
        .filter(|value| !value.is_null())
}

/// Notes the required tools among a batch's successful calls.
pub(crate) fn record_tools(state: &mut AgentState, checkpoint: &crate::ToolCheckpoint) {
    let Some(criteria) = &state.config.completion else {
        return;
    };
    for progress in &checkpoint.calls {
        let name = &progress.call.name;
        let succeeded = progress.outcome.as_ref().is_some_and(|o| !o.is_error);
        if succeeded
            && criteria.required_tools.contains(name)
            && !state.completion.tools_called.contains(name)
        {
            state.completion.tools_called.push(name.clone());
        }
    }
}

/// What a step that would complete the run does instead when conditions are unmet.
pub(crate) enum Refusal {
    /// Call the model again with `message`, which names the blockers.
    Retry { message: Message, job: StepJob },
    /// The run ends: too many refusals, or no budget for another call.
    End(StopReason),
}

/// The run would complete now: refuses when a condition is unmet (recording the blockers and
/// announcing them), or clears the last blockers and returns None.
pub(crate) fn refuse_completion(
    state: &mut AgentState,
    next_step: u64,
    now: Millis,
    events: &mut Vec<EventDraft>,
) -> Option<Refusal> {
    let found = blockers(state);
    if found.is_empty() {
        state.completion.blockers.clear();
        return None;
    }
    let max_attempts = state
        .config
        .completion
        .as_ref()
        .map_or(0, |c| c.max_attempts);
    state.completion.refused += 1;
    state.completion.blockers = found;
    let refused = state.completion.refused;
    events.push(EventDraft::new(
        EventKind::CompletionBlocked,
        json!({
            "run_id": state.run_id,
            "blockers": state.completion.blockers,
            "attempt": refused,
            "max_attempts": max_attempts,
        }),
    ));
    if refused > max_attempts {
        return Some(Refusal::End(StopReason::CompletionBlocked));
    }
    match crate::decide(state, Phase::CompletionBlocked, now) {
        Instruction::Finish(reason) => Some(Refusal::End(reason)),
        _ => Some(Refusal::Retry {
            message: observation(&state.completion.blockers),
            job: StepJob {
                run_id: state.run_id.clone(),
                step_index: next_step,
                phase: Phase::CompletionBlocked,
                attempt: 0,
            },
        }),
    }
}

/// The hidden message that tells the model why it may not finish yet.
fn observation(blockers: &[Blocker]) -> Message {
    let mut text = String::from("You cannot finish yet. Before your final answer:\n");
    for blocker in blockers {
        text.push_str(&format!("- {blocker}\n"));
    }
    text.push_str("Do what is missing, then answer again.");
    Message {
        visibility: crate::Visibility::Hidden,
        origin: crate::Origin::Runtime,
        ..Message::user(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RunConfigSnapshot, RunId, SessionId};

    fn state_with(criteria: CompletionCriteria, answer: &str, steps: u64) -> AgentState {
        let config = RunConfigSnapshot {
            completion: Some(criteria),
            ..RunConfigSnapshot::default()
        };
        let mut state = AgentState::new(
            SessionId::from_suffix("s").unwrap(),
            RunId::from_suffix("r").unwrap(),
            config,
            0,
        );
        state.final_answer = Some(answer.to_owned());
        state.step_index = steps;
        state
    }

    fn fields(names: &[&str]) -> CompletionCriteria {
        CompletionCriteria {
            required_tools: Vec::new(),
            required_fields: names.iter().map(|n| (*n).to_owned()).collect(),
            min_steps: 0,
            max_attempts: 3,
        }
    }

    #[test]
    fn required_fields_are_read_from_a_json_answer_fenced_or_not() {
        let criteria = fields(&["summary", "score.value"]);
        for answer in [
            r#"{"summary": "ok", "score": {"value": 3}}"#,
            "Here it is:\n```json\n{\"summary\": \"ok\", \"score\": {\"value\": 0}}\n```\nThanks.",
            "```\n{\"summary\": \"\", \"score\": {\"value\": false}}\n```",
        ] {
            assert_eq!(
                blockers(&state_with(criteria.clone(), answer, 1)),
                [],
                "{answer}"
            );
        }
        let missing = |field: &str| Blocker::FieldMissing {
            field: field.to_owned(),
        };
        for (answer, expected) in [
            (r#"{"summary": "ok"}"#, vec![missing("score.value")]),
            (
                r#"{"summary": null, "score": {"value": null}}"#,
                vec![missing("summary"), missing("score.value")],
            ),
            (
                r#"{"score": 3}"#,
                vec![missing("summary"), missing("score.value")],
            ),
            ("[1, 2]", vec![Blocker::AnswerNotJson]),
            ("All done!", vec![Blocker::AnswerNotJson]),
            ("```json\n{broken\n```", vec![Blocker::AnswerNotJson]),
        ] {
            assert_eq!(
                blockers(&state_with(criteria.clone(), answer, 1)),
                expected,
                "{answer}"
            );
        }
    }

    #[test]
    fn tools_and_steps_are_counted_from_the_run() {
        let criteria = CompletionCriteria {
            required_tools: vec!["save".into(), "check".into()],
            required_fields: Vec::new(),
            min_steps: 4,
            max_attempts: 1,
        };
        let mut state = state_with(criteria, "done", 3);
        state.completion.tools_called.push("check".into());
        assert_eq!(
            blockers(&state),
            [
                Blocker::ToolNotCalled {
                    tool: "save".into()
                },
                Blocker::TooFewSteps {
                    required: 4,
                    taken: 3
                }
            ]
        );
        state.step_index = 4;
        state.completion.tools_called.push("save".into());
        assert_eq!(blockers(&state), []);
        state.config = std::sync::Arc::new(RunConfigSnapshot::default());
        state.completion.tools_called.clear();
        assert_eq!(blockers(&state), [], "no criteria, nothing blocks");
    }

    #[test]
    fn blockers_read_as_instructions_and_serialize_with_their_kind() {
        let blocker = Blocker::TooFewSteps {
            required: 5,
            taken: 2,
        };
        assert_eq!(
            serde_json::to_value(&blocker).unwrap(),
            json!({"kind": "too_few_steps", "required": 5, "taken": 2})
        );
        let message = observation(&[
            Blocker::ToolNotCalled {
                tool: "save".into(),
            },
            blocker,
        ]);
        assert_eq!(message.visibility, crate::Visibility::Hidden);
        assert_eq!(message.origin, crate::Origin::Runtime);
        assert_eq!(
            message.content,
            "You cannot finish yet. Before your final answer:\n\
             - call the tool `save` successfully (it has not been yet)\n\
             - keep working: at least 5 steps are required before finishing (2 so far)\n\
             Do what is missing, then answer again."
        );
    }
}
