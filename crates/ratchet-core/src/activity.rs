//! What a step is doing right now, for people watching it: loading the session's context,
//! calling the model, running tools.
//!
//! Activity is observation only. It is never a `RunStatus` (the status says where a run has
//! stopped, not what its step is busy with), it is never written to the store, and nothing
//! decides anything from it: a lost announcement costs a status line, never a step.

use serde_json::{Value, json};

use crate::state::AgentState;

/// One announcement of what the step in flight is about to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Activity {
    /// The step reads the session's messages to build the prompt.
    LoadingContext,
    /// The step sends its request to `model`.
    CallingModel { model: String },
    /// The step runs a tool batch: the tools still to run, each named once, in batch order.
    ExecutingTools { tools: Vec<String> },
}

impl Activity {
    /// The model call of a run's step, named as the run's configuration names its model.
    pub fn calling_model(state: &AgentState) -> Activity {
        Activity::CallingModel {
            model: state.config.model.clone(),
        }
    }

    /// The batch of a run's checkpoint: the tools of calls without an outcome yet (an earlier
    /// attempt of the step may have run the others), each once.
    pub fn executing_tools(state: &AgentState) -> Activity {
        let mut tools: Vec<String> = Vec::new();
        let pending = state
            .checkpoint
            .iter()
            .flat_map(|checkpoint| &checkpoint.calls)
            .filter(|progress| progress.outcome.is_none());
        for progress in pending {
            if !tools.contains(&progress.call.name) {
                tools.push(progress.call.name.clone());
            }
        }
        Activity::ExecutingTools { tools }
    }

    /// The name clients read in the payload's `activity` field.
    pub fn name(&self) -> &'static str {
        match self {
            Activity::LoadingContext => "loading_context",
            Activity::CallingModel { .. } => "calling_model",
            Activity::ExecutingTools { .. } => "executing_tools",
        }
    }

    /// The payload of an `activity` event: the same shape as the stored `step_released`
    /// activity (`run_id`, `activity`, `step_index`), plus what this activity names.
    pub fn payload(&self, state: &AgentState, step_index: u64) -> Value {
        let mut payload = json!({
            "run_id": state.run_id,
            "activity": self.name(),
            "step_index": step_index,
        });
        match self {
            Activity::LoadingContext => {}
            Activity::CallingModel { model } => payload["model"] = json!(model),
            Activity::ExecutingTools { tools } => payload["tools"] = json!(tools),
        }
        payload
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{ToolCall, ToolOutcome};
    use crate::state::ToolCheckpoint;
    use crate::{RunConfigSnapshot, RunId, SessionId};

    fn state_with_batch(calls: &[(&str, bool)]) -> AgentState {
        let mut state = AgentState::new(
            SessionId::parse("ses_a").unwrap(),
            RunId::parse("run_a").unwrap(),
            RunConfigSnapshot {
                model: "gpt-x".to_owned(),
                ..RunConfigSnapshot::default()
            },
            0,
        );
        let mut checkpoint = ToolCheckpoint::new(
            calls
                .iter()
                .enumerate()
                .map(|(i, (name, _))| ToolCall {
                    id: format!("call_{i}"),
                    name: (*name).to_owned(),
                    arguments: json!({}),
                })
                .collect(),
        );
        for (progress, (_, done)) in checkpoint.calls.iter_mut().zip(calls) {
            if *done {
                progress.outcome = Some(ToolOutcome::ok("done"));
            }
        }
        state.checkpoint = Some(checkpoint);
        state
    }

    #[test]
    fn a_batch_names_each_tool_still_to_run_once_in_batch_order() {
        let state = state_with_batch(&[
            ("read_file", false),
            ("shell", true),
            ("fetch", false),
            ("read_file", false),
        ]);
        assert_eq!(
            Activity::executing_tools(&state),
            Activity::ExecutingTools {
                tools: vec!["read_file".to_owned(), "fetch".to_owned()]
            }
        );
    }

    #[test]
    fn a_state_without_a_batch_names_no_tools() {
        let mut state = state_with_batch(&[]);
        state.checkpoint = None;
        assert_eq!(
            Activity::executing_tools(&state),
            Activity::ExecutingTools { tools: Vec::new() }
        );
    }

    #[test]
    fn payloads_carry_the_run_the_step_and_what_the_activity_names() {
        let state = state_with_batch(&[("shell", false)]);
        assert_eq!(
            Activity::LoadingContext.payload(&state, 3),
            json!({"run_id": "run_a", "activity": "loading_context", "step_index": 3})
        );
        assert_eq!(
            Activity::calling_model(&state).payload(&state, 4),
            json!({"run_id": "run_a", "activity": "calling_model", "step_index": 4, "model": "gpt-x"})
        );
        assert_eq!(
            Activity::executing_tools(&state).payload(&state, 5),
            json!({"run_id": "run_a", "activity": "executing_tools", "step_index": 5, "tools": ["shell"]})
        );
    }
}
