//! The budget a whole delegation tree shares: tokens and dollars spent by its root run and by
//! every run below it, checked before each model call of any of them.
//!
//! A run's own `Limits` cannot bound a tree: each child starts with fresh counters, so a
//! parent that delegates can spend many times its own budget through its children. The tree's
//! spend is the sum of its runs' counters, which the engine reads from the store and hands in
//! here; this module only decides.

use serde::{Deserialize, Serialize};

use crate::Instruction;

/// What every run of one tree may spend together, frozen into each run's configuration (a
/// child carries its root's). Absent means no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TreeBudget {
    /// Prompt and generated tokens, as a run's own `max_tokens` counts them.
    pub max_tokens: Option<u64>,
    /// Model cost in millionths of a dollar, as the runs' counters count it.
    pub max_cost_microusd: Option<u64>,
}

/// What the runs of one tree have spent so far, their counters summed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TreeSpend {
    pub tokens: u64,
    pub cost_microusd: u64,
}

impl TreeSpend {
    /// The spend with one more run's `counters` added: its input and output tokens, and its
    /// cost.
    pub fn with_run(self, counters: &crate::Counters) -> TreeSpend {
        TreeSpend {
            tokens: (self.tokens)
                .saturating_add(counters.input_tokens.saturating_add(counters.output_tokens)),
            cost_microusd: self.cost_microusd.saturating_add(counters.cost_microusd),
        }
    }
}

impl TreeBudget {
    /// Whether there is anything to check, and so a reason to read the tree's spend.
    pub fn is_limited(&self) -> bool {
        self.max_tokens.is_some() || self.max_cost_microusd.is_some()
    }

    /// Whether `spend` has reached one of the limits.
    pub fn is_spent(&self, spend: TreeSpend) -> bool {
        let reached = |used: u64, limit: Option<u64>| limit.is_some_and(|max| used >= max);
        reached(spend.tokens, self.max_tokens)
            || reached(spend.cost_microusd, self.max_cost_microusd)
    }

    /// The Brain's instruction, admitted against the tree's budget: once the tree has spent
    /// it, a model call is made without tools, so it must conclude — exactly as when a run's
    /// own budget leaves room for one last call. A concluding call that still asks for tools
    /// then ends the run `budget_exhausted`, one that answers completes it.
    pub fn admit(&self, instruction: Instruction, spend: TreeSpend) -> Instruction {
        match instruction {
            Instruction::CallLlm { conclude: false } if self.is_spent(spend) => {
                Instruction::CallLlm { conclude: true }
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StopReason;

    const TOOLS: Instruction = Instruction::CallLlm { conclude: false };
    const CONCLUDE: Instruction = Instruction::CallLlm { conclude: true };

    fn spend(tokens: u64, cost_microusd: u64) -> TreeSpend {
        TreeSpend {
            tokens,
            cost_microusd,
        }
    }

    #[test]
    fn a_tree_without_a_budget_is_never_spent() {
        let unlimited = TreeBudget::default();
        assert!(!unlimited.is_limited());
        assert_eq!(unlimited.admit(TOOLS, spend(u64::MAX, u64::MAX)), TOOLS);
    }

    #[test]
    fn a_model_call_concludes_once_the_tree_reaches_its_token_budget() {
        let budget = TreeBudget {
            max_tokens: Some(1_000),
            max_cost_microusd: None,
        };
        assert!(budget.is_limited());
        assert_eq!(budget.admit(TOOLS, spend(999, u64::MAX)), TOOLS);
        assert_eq!(budget.admit(TOOLS, spend(1_000, 0)), CONCLUDE);
        assert_eq!(budget.admit(TOOLS, spend(5_000, 0)), CONCLUDE);
    }

    #[test]
    fn a_model_call_concludes_once_the_tree_reaches_its_cost_budget() {
        let budget = TreeBudget {
            max_tokens: None,
            max_cost_microusd: Some(500_000),
        };
        assert_eq!(budget.admit(TOOLS, spend(u64::MAX, 499_999)), TOOLS);
        assert_eq!(budget.admit(TOOLS, spend(0, 500_000)), CONCLUDE);
    }

    #[test]
    fn instructions_other_than_a_model_call_with_tools_are_left_alone() {
        let budget = TreeBudget {
            max_tokens: Some(1),
            max_cost_microusd: Some(1),
        };
        let spent = spend(10, 10);
        for instruction in [
            CONCLUDE,
            Instruction::CallToolsBatch,
            Instruction::AskApproval,
            Instruction::CompressContext,
            Instruction::Finish(StopReason::Completed),
            Instruction::Finish(StopReason::BudgetExhausted),
        ] {
            assert_eq!(budget.admit(instruction, spent), instruction);
        }
    }
}
