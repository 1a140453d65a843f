//! Agent catalogs frozen into the configurations their runs start with: each agent the root
//! of a tree, its delegates frozen the same way one level down.

use std::path::Path;

use ratchet_catalog::{AgentDefinition, Catalog};
use ratchet_core::delegation::{agent_task_tool, child_tools, delegate_tool};
use ratchet_core::{AgentProfile, AgentRef, DelegationConfig, RunConfigSnapshot, TreeBudget};

use crate::{Config, Error, Result, Toolbox};

/// How deep delegation trees may grow and how many runs they may hold, unless the agent at a
/// tree's root says less, and what all the runs of a tree may spend together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeLimits {
    pub max_depth: u32,
    pub max_tree_runs: u64,
    pub budget: TreeBudget,
}

impl TreeLimits {
    pub fn of(config: &Config) -> Result<TreeLimits> {
        let defaults = DelegationConfig::default();
        Ok(TreeLimits {
            max_depth: config.delegation.max_depth.unwrap_or(defaults.max_depth),
            max_tree_runs: config
                .delegation
                .max_tree_runs
                .unwrap_or(defaults.max_tree_runs),
            budget: config.tree_budget()?,
        })
    }
}

/// Loads the catalog in `dir` against this process's tools and models, or fails listing
/// every problem.
pub fn load(dir: &Path, toolbox: &Toolbox) -> Result<Catalog> {
    Catalog::load(dir, toolbox).map_err(|problems| Error::Catalog {
        dir: dir.to_path_buf(),
        problems: problems.iter().map(ToString::to_string).collect(),
    })
}

/// Every agent of the catalog as the root of a tree: the configuration its runs are frozen
/// with, built on `template` (the process's workspace, memory scope, budget and tool policies)
/// — its model, prompt, tools, approvals and limits from its definition, and the agents it may
/// delegate to, each frozen the same way one level down. A child is offered only the tools
/// of its definition that are delegatable; `delegate` and `agent_task` only where the tree's
/// depth leaves room for another level.
pub fn profiles(
    catalog: &Catalog,
    toolbox: &Toolbox,
    template: &RunConfigSnapshot,
    limits: TreeLimits,
) -> Result<Vec<AgentProfile>> {
    catalog
        .agents()
        .map(|definition| {
            let tree = TreeLimits {
                max_depth: definition
                    .limits
                    .max_depth
                    .map_or(limits.max_depth, |d| d.min(limits.max_depth)),
                max_tree_runs: (definition.limits.max_tree_runs)
                    .map_or(limits.max_tree_runs, |n| n.min(limits.max_tree_runs)),
                budget: limits.budget,
            };
            profile(catalog, definition, toolbox, template, 0, tree)
        })
        .collect()
}

fn profile(
    catalog: &Catalog,
    definition: &AgentDefinition,
    toolbox: &Toolbox,
    template: &RunConfigSnapshot,
    depth: u32,
    tree: TreeLimits,
) -> Result<AgentProfile> {
    let id = &definition.id;
    let resolved = toolbox
        .resolve_model(&definition.model)
        .map_err(|e| Error::Invalid(format!("agent {id}: model {:?}: {e}", definition.model)))?;
    let mut config = template.clone();
    config.model = definition.model.clone();
    config.model_settings = resolved.settings;
    if let Some(attempts) = resolved.max_attempts {
        config.limits.max_model_attempts = attempts;
    }
    config.system_prompt = definition.system_prompt.clone();
    let listed: Vec<_> = (template.tools.iter())
        .filter(|tool| definition.tools.contains(&tool.name))
        .cloned()
        .collect();
    config.tools = if depth == 0 {
        listed
    } else {
        child_tools(&listed, &definition.tools)
    };
    for tool in &mut config.tools {
        if let Some(policy) = definition.approval.get(&tool.name) {
            tool.approval = policy.clone();
        }
    }
    let own = definition.limits;
    let limits = &mut config.limits;
    limits.max_steps = own.max_steps.unwrap_or(limits.max_steps);
    limits.max_model_calls = own.max_model_calls.or(limits.max_model_calls);
    limits.max_tool_calls = own.max_tool_calls.or(limits.max_tool_calls);
    limits.max_tokens = own.max_tokens.or(limits.max_tokens);
    limits.max_prompt_tokens = own.max_prompt_tokens.or(limits.max_prompt_tokens);
    limits.max_duration_ms = own.max_duration_ms.or(limits.max_duration_ms);
    limits.max_parallel = own.max_parallel.unwrap_or(limits.max_parallel);
    limits.max_tool_result_bytes = own
        .max_tool_result_bytes
        .unwrap_or(limits.max_tool_result_bytes);
    config.signal = definition.signal.clone();
    config.completion = definition.completion.clone();
    config.agent = Some(AgentRef {
        id: id.clone(),
        hash: definition.hash.clone(),
    });
    config.delegation = DelegationConfig {
        agents: Vec::new(),
        max_depth: tree.max_depth,
        max_tree_runs: tree.max_tree_runs,
        tree_budget: tree.budget,
        inbox: template.delegation.inbox,
    };
    if !definition.delegates.is_empty() && depth < tree.max_depth {
        let agents = (definition.delegates.iter())
            .map(|delegate| {
                let below = catalog.get(delegate).ok_or_else(|| {
                    Error::Invalid(format!("agent {id} delegates to unknown agent {delegate}"))
                })?;
                profile(catalog, below, toolbox, template, depth + 1, tree)
            })
            .collect::<Result<Vec<_>>>()?;
        config.tools.push(delegate_tool(&agents));
        config.tools.push(agent_task_tool());
        config.delegation.agents = agents;
    }
    Ok(AgentProfile {
        id: id.clone(),
        description: definition.description.clone(),
        config,
    })
}
