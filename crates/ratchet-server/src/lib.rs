//! The HTTP + SSE server: the JSON API under `/v1`, event streams that resume without a gap
//! or a duplicate, tenants by bearer token, the OpenAPI document, health and metrics.
//!
//! Handlers only translate: wire types in, calls on the Coordinator and the store, wire
//! types out. They never decide what a run does and never write the store directly.

mod api;
mod approvals;
mod auth;
mod config;
mod console;
mod error;
mod inbox;
mod metrics;
mod routes;
mod sse;

use std::sync::Arc;

use axum::Router;
use ratchet_core::{AgentProfile, RunConfigSnapshot};
use ratchet_engine::Coordinator;
use tokio_util::sync::CancellationToken;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;

pub use auth::{Tokens, hash_token};
pub use config::{Config, ConfigError, TokenConfig};
pub use error::ApiError;

/// Everything a request handler can reach.
#[derive(Clone)]
pub struct AppState {
    pub coordinator: Arc<Coordinator>,
    /// The configuration a new run is frozen with when its session names no agent.
    pub run_template: Arc<RunConfigSnapshot>,
    /// The catalog's agents in id order: a session that names one has its runs frozen with
    /// that agent's configuration.
    pub agents: Arc<Vec<AgentProfile>>,
    pub tokens: Arc<Tokens>,
    /// Cancelled when the server shuts down: event streams end cleanly.
    pub shutdown: CancellationToken,
    pub metrics: metrics::Metrics,
}

impl AppState {
    pub fn new(
        coordinator: Arc<Coordinator>,
        run_template: RunConfigSnapshot,
        tokens: Tokens,
        shutdown: CancellationToken,
    ) -> AppState {
        AppState {
            coordinator,
            run_template: Arc::new(run_template),
            agents: Arc::new(Vec::new()),
            tokens: Arc::new(tokens),
            shutdown,
            metrics: metrics::Metrics::install(),
        }
    }

    /// The same state with the catalog's agents.
    pub fn with_agents(mut self, mut agents: Vec<AgentProfile>) -> AppState {
        agents.sort_by(|a, b| a.id.cmp(&b.id));
        self.agents = Arc::new(agents);
        self
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

/// The agent name that means the server's run template, like naming none.
pub(crate) const DEFAULT_AGENT: &str = "default";

#[derive(OpenApi)]
#[openapi(
    info(title = "Ratchet", description = "A durable runtime for LLM agents."),
    components(schemas(api::ErrorBody, api::EventView))
)]
struct ApiDoc;

/// The whole HTTP surface, ready to serve (or to test without a socket).
pub fn app(state: AppState) -> Router {
    let (router, openapi) = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .merge(routes::router())
        .merge(approvals::router())
        .merge(inbox::router())
        .merge(sse::router())
        .merge(metrics::router())
        .split_for_parts();
    let openapi = Arc::new(openapi);
    router
        .route(
            "/openapi.json",
            axum::routing::get(move || {
                let openapi = Arc::clone(&openapi);
                async move { axum::Json(openapi.as_ref().clone()) }
            }),
        )
        .merge(console::router())
        .fallback(error::not_found)
        .method_not_allowed_fallback(error::method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(api::MAX_BODY_BYTES))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(
            error::panicked,
        ))
        .with_state(state)
}
