//! Run status, its one edge table, and the stop reasons of terminal runs.
//!
//! Status answers only "where has the run stopped"; fine-grained activity (calling the model,
//! executing tools) is reported as events, never as a status.

use std::fmt;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    Queued,
    Running,
    WaitingHuman,
    WaitingChildren,
    /// Parked on a `wait` call until its due time (or until input for its session arrives):
    /// it holds its session and one job, ready at that time, but no worker and no permit.
    WaitingTimer,
    /// Stopped at a step boundary because a client asked; `resume` goes on from there.
    Paused,
    Cancelling,
    Completed,
    Failed,
    Cancelled,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("illegal run status edge: {from} -> {to}")]
pub struct IllegalEdge {
    pub from: RunStatus,
    pub to: RunStatus,
}

impl RunStatus {
    pub const ALL: [RunStatus; 10] = [
        RunStatus::Queued,
        RunStatus::Running,
        RunStatus::WaitingHuman,
        RunStatus::WaitingChildren,
        RunStatus::WaitingTimer,
        RunStatus::Paused,
        RunStatus::Cancelling,
        RunStatus::Completed,
        RunStatus::Failed,
        RunStatus::Cancelled,
    ];

    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RunStatus::Completed | RunStatus::Failed | RunStatus::Cancelled
        )
    }

    /// A waiting run holds its session but has no job: it moves only when something outside
    /// the run (a human, its children, a client resuming it) answers. A run `waiting_timer` is
    /// not one of them: its job wakes it by itself.
    pub fn is_waiting(self) -> bool {
        matches!(
            self,
            RunStatus::WaitingHuman | RunStatus::WaitingChildren | RunStatus::Paused
        )
    }

    /// The one table of legal status edges. Staying in `running` or `cancelling` across a
    /// step is an edge too. `failed -> running` is the `continue`/`retry` path.
    pub fn edge(self, to: RunStatus) -> Result<(), IllegalEdge> {
        use RunStatus::*;
        let legal = match self {
            Queued => matches!(to, Running | Cancelled),
            Running => matches!(
                to,
                Running
                    | WaitingHuman
                    | WaitingChildren
                    | WaitingTimer
                    | Paused
                    | Cancelling
                    | Completed
                    | Failed
                    | Cancelled
            ),
            // A waiting run past its deadline fails (`timed_out`); a paused one does not: time
            // spent paused is not the run's.
            WaitingHuman => matches!(to, Running | Failed | Cancelled),
            // The step its job runs when the wait ends goes on with the batch (and may end the
            // run there: a tool of the batch that completes it, a spent budget, the deadline);
            // a pause or a cancel needs no step.
            WaitingTimer => matches!(to, Running | Paused | Completed | Failed | Cancelled),
            // A run paused while it waited on a timer waits again when resumed.
            Paused => matches!(to, Running | WaitingTimer | Cancelled),
            WaitingChildren => matches!(to, Running | Cancelling | Failed | Cancelled),
            // A step in flight when the cancel arrived may still end the run on its own.
            Cancelling => matches!(to, Cancelling | Completed | Failed | Cancelled),
            Failed => matches!(to, Running),
            Completed | Cancelled => false,
        };
        if legal {
            Ok(())
        } else {
            Err(IllegalEdge { from: self, to })
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Queued => "queued",
            RunStatus::Running => "running",
            RunStatus::WaitingHuman => "waiting_human",
            RunStatus::WaitingChildren => "waiting_children",
            RunStatus::WaitingTimer => "waiting_timer",
            RunStatus::Paused => "paused",
            RunStatus::Cancelling => "cancelling",
            RunStatus::Completed => "completed",
            RunStatus::Failed => "failed",
            RunStatus::Cancelled => "cancelled",
        }
    }

    pub fn parse(text: &str) -> Option<RunStatus> {
        RunStatus::ALL.into_iter().find(|s| s.as_str() == text)
    }
}

impl fmt::Display for RunStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

/// Why a run ended. Every terminal run has exactly one, and it determines the terminal status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model answered without tool calls, or a `completes_run` tool succeeded.
    Completed,
    Cancelled,
    /// The step budget was spent; the run concluded with one tool-less model call.
    BudgetExhausted,
    /// The model produced invalid tool calls too many times in a row.
    ParseFailures,
    /// The model call kept failing after every allowed attempt, or failed for good (the
    /// provider refused the request).
    LlmError,
    /// The model kept trying to finish with a completion criterion unmet.
    CompletionBlocked,
    /// The run's `max_duration_ms` passed: the step in flight was cut off, or the run was
    /// waiting (for a human, for its children, on a timer) when it passed.
    TimedOut,
}

impl StopReason {
    pub fn terminal_status(self) -> RunStatus {
        match self {
            StopReason::Completed => RunStatus::Completed,
            StopReason::Cancelled => RunStatus::Cancelled,
            StopReason::BudgetExhausted
            | StopReason::ParseFailures
            | StopReason::LlmError
            | StopReason::CompletionBlocked
            | StopReason::TimedOut => RunStatus::Failed,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Completed => "completed",
            StopReason::Cancelled => "cancelled",
            StopReason::BudgetExhausted => "budget_exhausted",
            StopReason::ParseFailures => "parse_failures",
            StopReason::LlmError => "llm_error",
            StopReason::CompletionBlocked => "completion_blocked",
            StopReason::TimedOut => "timed_out",
        }
    }
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole edge table, written out as a matrix so that any change to it is a
    /// deliberate, reviewed change here. Rows are `from`, columns are `to`, in `ALL` order.
    const EXPECTED: &str = "\
queued           .X.......X
running          .XXXXXXXXX
waiting_human    .X......XX
waiting_children .X....X.XX
waiting_timer    .X...X.XXX
paused           .X..X....X
cancelling       ......XXXX
completed        ..........
failed           .X........
cancelled        ..........
";

    #[test]
    fn edge_table_is_exactly_the_reviewed_matrix() {
        let mut actual = String::new();
        for from in RunStatus::ALL {
            actual.push_str(&format!("{:<17}", from.as_str()));
            for to in RunStatus::ALL {
                actual.push(if from.edge(to).is_ok() { 'X' } else { '.' });
            }
            actual.push('\n');
        }
        assert_eq!(actual, EXPECTED);
    }

    #[test]
    fn nothing_enters_queued_and_completed_and_cancelled_are_final() {
        for from in RunStatus::ALL {
            assert!(from.edge(RunStatus::Queued).is_err(), "{from} -> queued");
            for done in [RunStatus::Completed, RunStatus::Cancelled] {
                assert!(done.edge(from).is_err(), "{done} -> {from}");
            }
        }
    }

    #[test]
    fn every_non_terminal_status_can_be_cancelled() {
        for from in RunStatus::ALL.into_iter().filter(|s| !s.is_terminal()) {
            assert!(
                from.edge(RunStatus::Cancelled).is_ok(),
                "{from} cannot be cancelled"
            );
        }
    }

    #[test]
    fn every_stop_reason_maps_to_a_terminal_status_reachable_from_running() {
        for reason in [
            StopReason::Completed,
            StopReason::Cancelled,
            StopReason::BudgetExhausted,
            StopReason::ParseFailures,
            StopReason::LlmError,
            StopReason::CompletionBlocked,
            StopReason::TimedOut,
        ] {
            let status = reason.terminal_status();
            assert!(status.is_terminal());
            assert!(RunStatus::Running.edge(status).is_ok());
        }
    }

    #[test]
    fn status_names_round_trip() {
        for status in RunStatus::ALL {
            assert_eq!(RunStatus::parse(status.as_str()), Some(status));
            let json = serde_json::to_string(&status).unwrap();
            assert_eq!(json, format!("\"{}\"", status.as_str()));
        }
        assert_eq!(RunStatus::parse("pausing"), None);
    }
}
