//! The HTTP + SSE server: the JSON API under `/v1`, event streams that resume without a gap
//! or a duplicate, tenants by bearer token, the OpenAPI document, health and metrics.
//!
//! Handlers only translate: wire types in, calls on the Coordinator and the store, wire
//! types out. They never decide what a run does and never write the store directly.

mod active;
mod api;
mod approvals;
mod auth;
mod console;
mod error;
mod feed;
mod hosts;
mod idempotency;
mod inbox;
mod listener;
mod metrics;
pub mod reload;
mod routes;
mod schedules;
mod schemas;
mod sse;
mod streams;
mod webhooks;

use std::sync::Arc;

use axum::Router;
use ratchet_engine::Coordinator;
use ratchet_store::WebhookAdmin;
use ratchet_webhooks::WebhookPolicy;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;

pub use active::Active;
pub use auth::{Caller, Tokens, hash_token};
pub use error::ApiError;
pub use hosts::HostPolicy;
pub use idempotency::{
    DEFAULT_HOLD_MS as DEFAULT_IDEMPOTENCY_HOLD_MS, DEFAULT_TTL_MS as DEFAULT_IDEMPOTENCY_TTL_MS,
    IDEMPOTENCY_KEY,
};
pub use listener::GuardedListener;
pub use reload::{Reloader, Reloads};
pub use streams::StreamLimits;

/// Everything a request handler can reach.
#[derive(Clone)]
pub struct AppState {
    pub coordinator: Arc<Coordinator>,
    /// The webhook administration role of the store; everything else is read through the
    /// Coordinator (`Coordinator::store`) or asked of it.
    webhooks: Arc<dyn WebhookAdmin>,
    /// The run template, catalog and tokens in force; a reload replaces them whole.
    active: Arc<watch::Sender<Arc<Active>>>,
    /// Absent when the server was assembled without a way to read its configuration again.
    reloads: Option<Reloads>,
    /// Cancelled when the server shuts down: event streams end cleanly.
    pub shutdown: CancellationToken,
    pub metrics: metrics::Metrics,
    /// The event streams open now, and how many may be.
    streams: Arc<streams::StreamGate>,
    /// The names requests may address the server by.
    hosts: Arc<HostPolicy>,
    /// Where webhooks may be created to send; the dispatcher checks the same policy again as
    /// it connects.
    webhook_policy: Arc<WebhookPolicy>,
    /// How long `Idempotency-Key`s are kept.
    keys: Arc<idempotency::KeyPolicy>,
}

impl AppState {
    pub fn new(
        coordinator: Arc<Coordinator>,
        webhooks: Arc<dyn WebhookAdmin>,
        active: Active,
        shutdown: CancellationToken,
    ) -> AppState {
        AppState {
            coordinator,
            webhooks,
            active: Arc::new(watch::Sender::new(Arc::new(active))),
            reloads: None,
            shutdown,
            metrics: metrics::Metrics::install(),
            streams: streams::StreamGate::new(StreamLimits::default()),
            hosts: Arc::new(HostPolicy::default()),
            webhook_policy: Arc::new(WebhookPolicy::default()),
            keys: idempotency::KeyPolicy::new(
                idempotency::DEFAULT_TTL_MS,
                idempotency::DEFAULT_HOLD_MS,
            ),
        }
    }

    /// The same state, keeping `Idempotency-Key`s and their responses for `ttl_ms` (default
    /// a day), each held for `hold_ms` by the request carrying it out (default 30 s).
    pub fn with_idempotency(
        mut self,
        ttl_ms: ratchet_core::Millis,
        hold_ms: ratchet_core::Millis,
    ) -> AppState {
        self.keys = idempotency::KeyPolicy::new(ttl_ms, hold_ms);
        self
    }

    /// The same state, creating webhooks only where `policy` allows (by default: public
    /// addresses only; `ratchet serve` adds `[webhooks] allow`, and loopback when it listens
    /// only on loopback).
    pub fn with_webhook_policy(self, policy: WebhookPolicy) -> AppState {
        AppState {
            webhook_policy: Arc::new(policy),
            ..self
        }
    }

    /// The same state, answering to the names of `hosts` instead of loopback's.
    pub fn with_host_policy(mut self, hosts: HostPolicy) -> AppState {
        self.hosts = Arc::new(hosts);
        self
    }

    /// The same state, allowing `limits` event streams instead of the defaults.
    pub fn with_stream_limits(mut self, limits: StreamLimits) -> AppState {
        self.streams = streams::StreamGate::new(limits);
        self
    }

    /// The same state, reloadable through `reloader` (`POST /v1/admin/reload`, and whatever
    /// else holds `reloads()`). Must be called inside a tokio runtime: it starts the task that
    /// performs reloads one at a time, until `shutdown` is cancelled.
    pub fn with_reloader(mut self, reloader: impl Reloader) -> AppState {
        self.reloads = Some(Reloads::start(
            reloader,
            Arc::clone(&self.active),
            self.shutdown.clone(),
        ));
        self
    }

    /// What is active now. A request takes this once (`active::Current`) and uses only it.
    pub fn active(&self) -> Arc<Active> {
        Arc::clone(&self.active.borrow())
    }

    pub fn reloads(&self) -> Option<Reloads> {
        self.reloads.clone()
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "Ratchet", description = "A durable runtime for LLM agents."),
    // Schemas that only parameters or encoded stream data name: the routes collect those
    // of bodies by themselves.
    components(schemas(
        api::ErrorBody,
        api::EventView,
        api::LiveActivityView,
        api::TreeEventView,
        api::TreeActivityView,
        api::SessionOrder,
        api::SessionStatusFilter,
        schemas::SessionIdSchema,
        schemas::RunIdSchema,
        schemas::ApprovalIdSchema,
        schemas::WebhookIdSchema,
        schemas::ScheduleIdSchema,
        schemas::ApprovalStatusSchema,
        schemas::InboxStatusSchema,
        schemas::DeliveryStatusSchema,
    ))
)]
struct ApiDoc;

/// The document with each optional request body described as what it is: absent, or the
/// object. utoipa writes an `Option<T>` body as `T` or `null`, but the server reads an empty
/// body as none and refuses a `null` one like any body that is not an object.
fn optional_bodies_without_null(mut openapi: utoipa::openapi::OpenApi) -> utoipa::openapi::OpenApi {
    use utoipa::openapi::schema::{Schema, Type};
    use utoipa::openapi::{RefOr, Required};
    let is_null = |schema: &RefOr<Schema>| {
        matches!(schema, RefOr::T(Schema::Object(object))
            if object.schema_type == Type::Null.into())
    };
    for item in openapi.paths.paths.values_mut() {
        let operations = [&mut item.post, &mut item.put, &mut item.patch];
        let bodies = (operations.into_iter().flatten())
            .filter_map(|operation| match operation.request_body.as_mut() {
                Some(RefOr::T(body)) => Some(body),
                Some(RefOr::Ref(_)) | None => None,
            })
            .filter(|body| body.required != Some(Required::True));
        for body in bodies {
            for content in body.content.values_mut() {
                let RefOr::T(content) = content else {
                    continue;
                };
                if let Some(RefOr::T(Schema::OneOf(one_of))) = &mut content.schema {
                    one_of.items.retain(|branch| !is_null(branch));
                    if let [only] = &one_of.items[..] {
                        content.schema = Some(only.clone());
                    }
                }
            }
        }
    }
    openapi
}

/// The document with the `Idempotency-Key` header on every `POST` under `/v1`, which the
/// middleware reads (`idempotency::keyed`) rather than any handler.
fn with_idempotency_keys(mut openapi: utoipa::openapi::OpenApi) -> utoipa::openapi::OpenApi {
    use utoipa::openapi::path::{Parameter, ParameterBuilder, ParameterIn};
    use utoipa::openapi::{ObjectBuilder, Required, Type};
    let key: Parameter = ParameterBuilder::new()
        .name("Idempotency-Key")
        .parameter_in(ParameterIn::Header)
        .required(Required::False)
        .description(Some(
            "Names this request (1 to 255 printable ASCII characters, per tenant): a repeat \
             within `[api] idempotency_ttl_ms` gets the first response back with \
             `Idempotent-Replayed: true` and does nothing again; the same key with another \
             method, path or body is 422, and a repeat while the first is carried out is 409 \
             (`request_in_progress`). Responses 409, 429 and 5xx are not kept.",
        ))
        .schema(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .min_length(Some(1))
                .max_length(Some(idempotency::MAX_KEY_CHARS))
                .pattern(Some("^[\\x20-\\x7E]+$")),
        ))
        .build();
    for (path, item) in openapi.paths.paths.iter_mut() {
        if let Some(post) = item.post.as_mut().filter(|_| path.starts_with("/v1/")) {
            post.parameters
                .get_or_insert_with(Vec::new)
                .push(key.clone().into());
        }
    }
    openapi
}

/// The whole HTTP surface, ready to serve (or to test without a socket).
pub fn app(state: AppState) -> Router {
    let (router, openapi) = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .merge(routes::router())
        .merge(approvals::router())
        .merge(inbox::router())
        .merge(sse::router())
        .merge(webhooks::router())
        .merge(schedules::router())
        .merge(metrics::router())
        .merge(reload::router())
        .split_for_parts();
    let openapi = Arc::new(with_idempotency_keys(optional_bodies_without_null(openapi)));
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
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            idempotency::keyed,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(api::MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn(error::refuse_oversized_bodies))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            hosts::check,
        ))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(
            error::panicked,
        ))
        .with_state(state)
}
