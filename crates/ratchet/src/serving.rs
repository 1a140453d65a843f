//! What `ratchet serve` makes of its configuration, at start and at each reload alike: the run
//! template, the catalog's agents and the tokens, all checked before any of it is used.

use std::net::SocketAddr;

use ratchet_catalog::Catalog;
use ratchet_core::{AgentProfile, Limits, RunConfigSnapshot};
use ratchet_server::Active;

use crate::{Config, Result, ToolOverrides, Toolbox};

/// The run template, the catalog's agents and the tokens `config` asks for, checked against
/// the running tools and models, or every problem found: at start, and at each reload.
/// Tokens may not be dropped while the server listens beyond loopback.
pub fn prepare_active(
    config: &Config,
    toolbox: &Toolbox,
    address: SocketAddr,
) -> Result<Active, Vec<String>> {
    let mut problems = Vec::new();
    let tokens = match config.tokens(|key| std::env::var(key).ok()) {
        Ok(tokens) if tokens.is_empty() && !address.ip().is_loopback() => {
            problems.push(format!(
                "refusing to listen on {address} without authentication: configure [[tokens]] in \
                 the config file, or listen on a loopback address such as 127.0.0.1"
            ));
            None
        }
        Ok(tokens) => Some(tokens),
        Err(error) => {
            problems.push(error.to_string());
            None
        }
    };
    let template = run_template(config, toolbox)
        .map_err(|error| problems.push(error.to_string()))
        .ok();
    let catalog = match &config.agents {
        Some(dir) => match Catalog::load(std::path::Path::new(dir), toolbox) {
            Ok(catalog) => Some(Some(catalog)),
            Err(found) => {
                problems.extend(found.iter().map(ToString::to_string));
                None
            }
        },
        None => Some(None),
    };
    let (Some(tokens), Some(template), Some(catalog)) = (tokens, template, catalog) else {
        return Err(problems);
    };
    let agents: Vec<AgentProfile> = match &catalog {
        Some(catalog) => {
            let limits =
                crate::agents::TreeLimits::of(config).map_err(|error| vec![error.to_string()])?;
            crate::agents::profiles(catalog, toolbox, &template, limits)
                .map_err(|error| vec![error.to_string()])?
        }
        None => Vec::new(),
    };
    Ok(Active::new(template, agents, tokens))
}

/// The configuration a run is frozen with when its session names no agent.
pub fn run_template(config: &Config, toolbox: &Toolbox) -> Result<RunConfigSnapshot> {
    let mut template = toolbox.run_template(
        config.model.as_deref().unwrap_or("scripted:demo"),
        config.workspace.as_deref().map(std::path::Path::new),
        Limits {
            max_steps: config.max_steps.unwrap_or(50),
            max_model_calls: config.max_model_calls,
            max_tool_calls: config.max_tool_calls,
            max_tokens: config.max_tokens,
            max_prompt_tokens: config.max_prompt_tokens,
            max_duration_ms: config.max_duration_ms,
            max_wait_ms: config.max_wait_ms()?,
            ..Limits::default()
        },
        &ToolOverrides {
            approval: config.approval_policies()?,
            replay: config.replay_policies(),
            calls: config.call_limits()?,
        },
        config.memory_scope.unwrap_or_default(),
    )?;
    template.delegation.inbox = config.inbox_policy()?;
    template.delegation.tree_budget = config.tree_budget()?;
    (template.limits.max_tool_result_bytes, template.steer) = config.input_bounds()?;
    Ok(template)
}

/// The settings a running process cannot change, by configuration key, that differ between
/// `started` and `now`: the listener, the database, the worker pool, the gates (the
/// coordinator's quota and the engine's permits), the webhook dispatcher, the toolbox
/// (MCP servers, model profiles), the stream limits and the names the server answers to.
pub fn restart_required(started: &Config, now: &Config) -> Vec<String> {
    let fixed = [
        ("listen", started.listen == now.listen),
        ("db", started.db == now.db),
        ("workers", started.workers == now.workers),
        ("lease_ms", started.lease_ms == now.lease_ms),
        ("heartbeat_ms", started.heartbeat_ms == now.heartbeat_ms),
        ("poll_ms", started.poll_ms == now.poll_ms),
        ("gates", started.gates == now.gates),
        ("mcp", started.mcp == now.mcp),
        ("webhooks", started.webhooks == now.webhooks),
        ("secrets", started.secrets == now.secrets),
        ("models", started.models == now.models),
        ("limits", started.limits == now.limits),
        ("server", started.server == now.server),
    ];
    (fixed.into_iter())
        .filter(|(_, same)| !same)
        .map(|(key, _)| key.to_owned())
        .collect()
}
