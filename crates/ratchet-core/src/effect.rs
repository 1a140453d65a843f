//! Tool calls whose outcome nobody knows, and the limits on one call.
//!
//! A call cut off after it was sent — a timeout, a lost connection, a cancel that had to
//! abort it — may or may not have taken effect. Its tool's replay policy decides what
//! follows: a `never` call waits for a human, exactly as after a crash; a `keyed` call is
//! tried again with the same idempotency key and then waits for a human; a `safe` call is
//! tried again and then becomes an error the model reads.

use serde::{Deserialize, Serialize};

use crate::ReplayPolicy;

/// How long one call of a tool may run before it is cut off (its outcome is then unknown).
pub const DEFAULT_TOOL_TIMEOUT_MS: u64 = 5 * 60 * 1_000;
/// How many times a call is tried in one step while its outcome stays unknown.
pub const DEFAULT_TOOL_ATTEMPTS: u32 = 3;

/// A tool's limits, frozen with the run like the rest of its spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CallLimits {
    /// Wall-clock time one attempt of a call may take.
    pub timeout_ms: u64,
    /// Attempts of a `keyed` or `safe` call whose outcome stays unknown; a `never` call is
    /// tried once.
    pub max_attempts: u32,
}

impl Default for CallLimits {
    fn default() -> Self {
        CallLimits {
            timeout_ms: DEFAULT_TOOL_TIMEOUT_MS,
            max_attempts: DEFAULT_TOOL_ATTEMPTS,
        }
    }
}

/// What follows an attempt whose outcome is unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterUnknown {
    /// Try the call again (with the same idempotency key).
    Retry,
    /// Nothing more runs: a human says what happened (`waiting_human`, reconciliation).
    Reconcile,
    /// Give the model an error result: running it again was harmless, and it kept failing.
    Fail,
}

/// Decides what follows the `attempt`-th attempt (counting from 1) of a call that ended with
/// its outcome unknown.
pub fn after_unknown(replay: ReplayPolicy, attempt: u32, limits: CallLimits) -> AfterUnknown {
    let attempts_left = attempt < limits.max_attempts;
    match replay {
        ReplayPolicy::Never => AfterUnknown::Reconcile,
        ReplayPolicy::Keyed if attempts_left => AfterUnknown::Retry,
        ReplayPolicy::Keyed => AfterUnknown::Reconcile,
        ReplayPolicy::Safe if attempts_left => AfterUnknown::Retry,
        ReplayPolicy::Safe => AfterUnknown::Fail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every policy at every attempt up to past the limit, against the rule written out.
    #[test]
    fn unknown_outcomes_follow_the_replay_policy_exhaustively() {
        for max_attempts in 0..=4 {
            let limits = CallLimits {
                timeout_ms: 1,
                max_attempts,
            };
            for attempt in 1..=5 {
                let more = attempt < max_attempts;
                assert_eq!(
                    after_unknown(ReplayPolicy::Never, attempt, limits),
                    AfterUnknown::Reconcile,
                    "a never call is never tried twice"
                );
                let keyed = after_unknown(ReplayPolicy::Keyed, attempt, limits);
                let safe = after_unknown(ReplayPolicy::Safe, attempt, limits);
                if more {
                    assert_eq!((keyed, safe), (AfterUnknown::Retry, AfterUnknown::Retry));
                } else {
                    assert_eq!((keyed, safe), (AfterUnknown::Reconcile, AfterUnknown::Fail));
                }
            }
        }
    }

    #[test]
    fn limits_missing_from_a_frozen_spec_take_the_defaults() {
        let limits: CallLimits = serde_json::from_str("{}").unwrap();
        assert_eq!(limits, CallLimits::default());
        let limits: CallLimits = serde_json::from_str(r#"{"timeout_ms": 10}"#).unwrap();
        assert_eq!(limits.max_attempts, DEFAULT_TOOL_ATTEMPTS);
    }
}
