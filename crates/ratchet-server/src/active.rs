//! What a reload replaces, as one value: the run template, the catalog's agents and the
//! tokens. A request reads them from one snapshot taken when it arrives, so it sees the whole
//! set that was active then, never half of an old set and half of a new one.
//!
//! Nothing here builds or checks an `Active`: the binary does (it alone knows the tools,
//! models and catalog files); this module only holds the value and hands it out.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use ratchet_core::{AgentProfile, RunConfigSnapshot};

use crate::{AppState, Tokens};

pub(crate) use ratchet_core::delegation::DEFAULT_AGENT;

/// The run template, the catalog and the tokens a server works with until the next reload.
#[derive(Debug, Default)]
pub struct Active {
    run_template: RunConfigSnapshot,
    agents: Vec<AgentProfile>,
    tokens: Tokens,
}

impl Active {
    /// `run_template` is what a new run is frozen with when its session names no agent; a
    /// session that names one of `agents` has its runs frozen with that agent's
    /// configuration. The agents are kept in id order.
    pub fn new(
        run_template: RunConfigSnapshot,
        mut agents: Vec<AgentProfile>,
        tokens: Tokens,
    ) -> Active {
        agents.sort_by(|a, b| a.id.cmp(&b.id));
        Active {
            run_template,
            agents,
            tokens,
        }
    }

    pub fn run_template(&self) -> &RunConfigSnapshot {
        &self.run_template
    }

    /// In id order.
    pub fn agents(&self) -> &[AgentProfile] {
        &self.agents
    }

    pub fn tokens(&self) -> &Tokens {
        &self.tokens
    }

    pub(crate) fn agent(&self, id: &str) -> Option<&AgentProfile> {
        self.agents.iter().find(|a| a.id == id)
    }

    /// What a session may name, for error messages: `default`, then the catalog's agents.
    pub(crate) fn available_agents(&self) -> String {
        let mut names = vec![DEFAULT_AGENT];
        names.extend(self.agents.iter().map(|a| a.id.as_str()));
        names.join(", ")
    }
}

/// The snapshot this request works with. The first extractor that asks takes it and leaves it
/// in the request's extensions; every later one (the tenant's, the handler's) gets the same.
pub(crate) struct Current(pub Arc<Active>);

impl FromRequestParts<AppState> for Current {
    type Rejection = Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Current, Infallible> {
        if let Some(active) = parts.extensions.get::<Arc<Active>>() {
            return Ok(Current(Arc::clone(active)));
        }
        let active = state.active();
        parts.extensions.insert(Arc::clone(&active));
        Ok(Current(active))
    }
}
