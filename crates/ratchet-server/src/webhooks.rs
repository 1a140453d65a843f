//! A tenant's webhooks: where its events are sent (signed), which kinds, and the log of
//! every delivery. Sending is the webhook dispatcher's (`ratchet-webhooks`); these handlers
//! only configure it and read what it did.
//!
//! A webhook's URL is checked against the server's `WebhookPolicy` when it is created, so a
//! tenant cannot point the server's requests inside (its loopback, the metadata service, the
//! private network); the dispatcher checks the addresses again as it connects.

use axum::Extension;
use axum::extract::State;
use axum::http::StatusCode;
use ratchet_core::{EventKind, Millis, WebhookId};
use ratchet_store::{NewWebhook, RequestMark, Webhook, WebhookDelivery};
use ratchet_webhooks::WebhookPolicy;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::api::{DeliveriesQuery, ErrorBody, Page};
use crate::auth::Tenant;
use crate::error::{ApiJson, ApiPath, ApiQuery};
use crate::metrics::now_ms;
use crate::schemas::{DeliveryStatusSchema, EventKindSchema, SessionIdSchema, WebhookIdSchema};
use crate::{ApiError, AppState};

/// Attempts of one delivery when the webhook names none.
const DEFAULT_MAX_ATTEMPTS: u32 = 10;
const MAX_ATTEMPTS_LIMIT: u32 = 50;
const MIN_SECRET_LEN: usize = 16;
const MAX_SECRET_LEN: usize = 256;
const MAX_URL_LEN: usize = 2048;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create_webhook, list_webhooks))
        .routes(routes!(get_webhook, delete_webhook))
        .routes(routes!(rotate_secret))
        .routes(routes!(list_deliveries))
        .routes(routes!(requeue_delivery))
        .routes(routes!(requeue_dead_deliveries))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateWebhook {
    /// Where each event is POSTed: an absolute `http://` or `https://` URL without
    /// credentials, to a public address unless the server's `[webhooks] allow` permits
    /// another. It is stored as it will be requested (`http://2130706433` is
    /// `http://127.0.0.1/`).
    #[schema(max_length = 2048, pattern = "^[hH][tT][tT][pP][sS]?://")]
    pub url: String,
    /// The event kinds to send (for example `run.finished`); every kind when absent.
    #[schema(value_type = Option<Vec<EventKindSchema>>, min_items = 1)]
    pub events: Option<Vec<String>>,
    /// The key deliveries are signed with, 16–256 printable ASCII characters without spaces;
    /// one is made when absent.
    #[schema(min_length = 16, max_length = 256, pattern = "^[!-~]{16,256}$")]
    pub secret: Option<String>,
    /// Attempts of one delivery before it is dead-lettered, 1–50 (default 10).
    #[schema(minimum = 1, maximum = 50)]
    pub max_attempts: Option<u32>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RotateSecret {
    /// The new key, 16–256 printable ASCII characters without spaces; one is made when absent.
    #[schema(min_length = 16, max_length = 256, pattern = "^[!-~]{16,256}$")]
    pub secret: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RotatedSecret {
    #[schema(value_type = WebhookIdSchema)]
    pub id: String,
    /// The new signing key, shown this once; absent when `secret_withheld`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    /// True only in the answer to a repeat of a keyed rotation whose first answer was lost
    /// (its process died after the rotation committed): the store keeps no secret in clear,
    /// so the secret cannot be shown again. Rotate again if you did not choose it.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub secret_withheld: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct WebhookView {
    #[schema(value_type = WebhookIdSchema)]
    pub id: String,
    pub url: String,
    /// The event kinds it is sent; null for every kind.
    #[schema(value_type = Option<Vec<EventKindSchema>>)]
    pub events: Option<Vec<String>>,
    pub max_attempts: u32,
    pub created_at: Millis,
    /// The signing key: in the answer to the creation only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    /// True only in the answer to a repeat of a keyed creation whose first answer was lost
    /// (its process died after the webhook was created): the store keeps no secret in clear,
    /// so the secret cannot be shown again. Rotate it if you did not choose it.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub secret_withheld: bool,
}

impl From<Webhook> for WebhookView {
    fn from(webhook: Webhook) -> WebhookView {
        WebhookView {
            id: webhook.id.to_string(),
            url: webhook.url,
            events: webhook.events,
            max_attempts: webhook.max_attempts,
            created_at: webhook.created_at,
            secret: None,
            secret_withheld: false,
        }
    }
}

/// One event's delivery to the webhook.
#[derive(Debug, Serialize, ToSchema)]
pub struct DeliveryView {
    /// Also the `Ratchet-Delivery` header of every attempt.
    pub id: i64,
    #[schema(value_type = SessionIdSchema)]
    pub session_id: String,
    pub seq: i64,
    #[schema(value_type = EventKindSchema)]
    pub event_kind: String,
    /// `pending` (waiting for its attempt, behind the session's earlier events),
    /// `delivering`, `delivered` or `dead_letter`.
    #[schema(value_type = DeliveryStatusSchema)]
    pub status: String,
    pub attempts: u32,
    pub max_attempts: u32,
    /// When a pending delivery's next attempt is due.
    pub available_at: Option<Millis>,
    /// The HTTP status of the last answered attempt.
    pub last_status: Option<u16>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    pub delivered_at: Option<Millis>,
    /// When an operator last requeued it from the dead letter.
    pub requeued_at: Option<Millis>,
    pub created_at: Millis,
    pub updated_at: Millis,
}

impl From<WebhookDelivery> for DeliveryView {
    fn from(d: WebhookDelivery) -> DeliveryView {
        DeliveryView {
            id: d.id,
            session_id: d.session_id.to_string(),
            seq: d.seq,
            event_kind: d.event_kind,
            status: d.status.as_str().to_owned(),
            attempts: d.attempts,
            max_attempts: d.max_attempts,
            available_at: d.available_at,
            last_status: d.last_status,
            last_error: d.last_error,
            delivered_at: d.delivered_at,
            requeued_at: d.requeued_at,
            created_at: d.created_at,
            updated_at: d.updated_at,
        }
    }
}

fn checked_url(policy: &WebhookPolicy, url: &str) -> Result<String, ApiError> {
    if url.len() > MAX_URL_LEN {
        return Err(ApiError::unprocessable(format!(
            "url must be at most {MAX_URL_LEN} bytes, found {}",
            url.len()
        )));
    }
    policy
        .check(url)
        .map(String::from)
        // The URL is not repeated: it may carry credentials, and error messages get logged.
        .map_err(|refusal| ApiError::unprocessable(format!("url is refused: {refusal}")))
}

fn checked_events(events: Option<Vec<String>>) -> Result<Option<Vec<String>>, ApiError> {
    let Some(events) = events else {
        return Ok(None);
    };
    if events.is_empty() {
        return Err(ApiError::unprocessable(
            "events must name at least one event kind; leave it out for every kind",
        ));
    }
    let unknown: Vec<&str> = events
        .iter()
        .map(String::as_str)
        .filter(|kind| EventKind::parse(kind).is_none())
        .collect();
    if !unknown.is_empty() {
        let known: Vec<&str> = EventKind::ALL.iter().map(|k| k.as_str()).collect();
        return Err(ApiError::unprocessable(format!(
            "unknown event kinds {unknown:?}; expected any of {}",
            known.join(", ")
        )));
    }
    let mut kinds = Vec::with_capacity(events.len());
    for kind in events {
        if !kinds.contains(&kind) {
            kinds.push(kind);
        }
    }
    Ok(Some(kinds))
}

fn checked_secret(secret: Option<String>) -> Result<String, ApiError> {
    match secret {
        None => Ok(format!(
            "whsec_{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        )),
        Some(secret)
            if (MIN_SECRET_LEN..=MAX_SECRET_LEN).contains(&secret.chars().count())
                && secret.chars().all(|c| c.is_ascii_graphic()) =>
        {
            Ok(secret)
        }
        Some(secret) => Err(ApiError::unprocessable(format!(
            "secret must be {MIN_SECRET_LEN}–{MAX_SECRET_LEN} printable ASCII characters without \
             spaces, found {} characters",
            secret.chars().count()
        ))),
    }
}

fn parse_webhook_id(text: &str) -> Result<WebhookId, ApiError> {
    WebhookId::parse(text).map_err(|e| ApiError::bad_request(e.to_string()))
}

/// The tenant's webhook; another tenant's is as absent as a missing one.
async fn tenant_webhook(
    state: &AppState,
    tenant: &Tenant,
    id: &WebhookId,
) -> Result<Webhook, ApiError> {
    match state.webhooks.get_webhook(id).await {
        Ok(webhook) if webhook.tenant == tenant.0 => Ok(webhook),
        Ok(_) | Err(ratchet_store::Error::NotFound { .. }) => {
            Err(ApiError::not_found(format!("no webhook {id}")))
        }
        Err(other) => Err(other.into()),
    }
}

#[utoipa::path(
    post, path = "/v1/webhooks", tag = "webhooks",
    request_body = CreateWebhook,
    responses(
        (status = 201, body = WebhookView, description = "Created, with its secret (shown this once). It is sent the events written from now on, in `seq` order per session."),
        (status = 422, body = ErrorBody, description = "a bad url (the message names the rule: a destination inside, credentials, a bad port), an unknown event kind, a secret too short or long, max_attempts out of range"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn create_webhook(
    State(state): State<AppState>,
    tenant: Tenant,
    request: Option<Extension<RequestMark>>,
    ApiJson(body): ApiJson<CreateWebhook>,
) -> Result<(StatusCode, axum::Json<WebhookView>), ApiError> {
    let max_attempts = body.max_attempts.unwrap_or(DEFAULT_MAX_ATTEMPTS);
    if !(1..=MAX_ATTEMPTS_LIMIT).contains(&max_attempts) {
        return Err(ApiError::unprocessable(format!(
            "max_attempts must be 1–{MAX_ATTEMPTS_LIMIT}, found {max_attempts}"
        )));
    }
    let new = NewWebhook {
        id: WebhookId::from_suffix(&uuid::Uuid::now_v7().to_string())
            .map_err(|e| ApiError::bad_request(e.to_string()))?,
        tenant: tenant.0,
        url: checked_url(&state.webhook_policy, &body.url)?,
        events: checked_events(body.events)?,
        secret: checked_secret(body.secret)?,
        max_attempts,
        request: request.map(|r| r.0),
    };
    let secret = new.secret.clone();
    let webhook = state.webhooks.create_webhook(new, now_ms()).await?;
    let view = WebhookView {
        secret: Some(secret),
        ..webhook.into()
    };
    Ok((StatusCode::CREATED, axum::Json(view)))
}

#[utoipa::path(
    get, path = "/v1/webhooks", tag = "webhooks",
    responses(
        (status = 200, body = Page<WebhookView>, description = "The tenant's webhooks in creation order"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn list_webhooks(
    State(state): State<AppState>,
    tenant: Tenant,
) -> Result<axum::Json<Page<WebhookView>>, ApiError> {
    let webhooks = state.webhooks.webhooks(&tenant.0).await?;
    Ok(axum::Json(Page {
        items: webhooks.into_iter().map(WebhookView::from).collect(),
        next_cursor: None,
    }))
}

#[utoipa::path(
    get, path = "/v1/webhooks/{id}", tag = "webhooks",
    params(("id" = WebhookIdSchema, Path, description = "The webhook's id")),
    responses((status = 200, body = WebhookView), (status = "4XX", body = ErrorBody)),
)]
async fn get_webhook(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<WebhookView>, ApiError> {
    let id = parse_webhook_id(&id)?;
    let webhook = tenant_webhook(&state, &tenant, &id).await?;
    Ok(axum::Json(webhook.into()))
}

#[utoipa::path(
    delete, path = "/v1/webhooks/{id}", tag = "webhooks",
    params(("id" = WebhookIdSchema, Path, description = "The webhook's id")),
    responses(
        (status = 204, description = "Deleted with its delivery log: nothing more is sent to it"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn delete_webhook(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    let id = parse_webhook_id(&id)?;
    tenant_webhook(&state, &tenant, &id).await?;
    state.webhooks.delete_webhook(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(
    post, path = "/v1/webhooks/{id}/rotate-secret", tag = "webhooks",
    params(("id" = WebhookIdSchema, Path, description = "The webhook's id")),
    request_body = Option<RotateSecret>,
    responses(
        (status = 200, body = RotatedSecret, description = "The new secret, shown this once: every attempt from now on is signed with it, those of deliveries already failing included"),
        (status = 422, body = ErrorBody, description = "a secret too short or long"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn rotate_secret(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
    request: Option<Extension<RequestMark>>,
    body: Option<ApiJson<RotateSecret>>,
) -> Result<axum::Json<RotatedSecret>, ApiError> {
    let id = parse_webhook_id(&id)?;
    let secret = checked_secret(body.and_then(|ApiJson(body)| body.secret))?;
    tenant_webhook(&state, &tenant, &id).await?;
    (state.webhooks)
        .rotate_webhook_secret(&id, secret.clone(), request.map(|r| r.0))
        .await?;
    Ok(axum::Json(RotatedSecret {
        id: id.to_string(),
        secret: Some(secret),
        secret_withheld: false,
    }))
}

#[utoipa::path(
    get, path = "/v1/webhooks/{id}/deliveries", tag = "webhooks",
    params(("id" = WebhookIdSchema, Path, description = "The webhook's id"), DeliveriesQuery),
    responses(
        (status = 200, body = Page<DeliveryView>, description = "The webhook's deliveries in the order they were queued, dead letters included"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn list_deliveries(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<DeliveriesQuery>,
) -> Result<axum::Json<Page<DeliveryView>>, ApiError> {
    let id = parse_webhook_id(&id)?;
    let (after, limit, status) = query.checked()?;
    tenant_webhook(&state, &tenant, &id).await?;
    let deliveries = state.webhooks.deliveries(&id, status, after, limit).await?;
    let items = deliveries.into_iter().map(DeliveryView::from).collect();
    Ok(axum::Json(Page::new(items, limit, |d: &DeliveryView| {
        d.id.to_string()
    })))
}

/// How many dead letters a bulk requeue put back.
#[derive(Debug, Serialize, ToSchema)]
pub struct RequeuedView {
    pub requeued: u64,
}

#[utoipa::path(
    post, path = "/v1/webhooks/{id}/deliveries/{delivery_id}/requeue", tag = "webhooks",
    params(
        ("id" = WebhookIdSchema, Path, description = "The webhook's id"),
        ("delivery_id" = i64, Path, minimum = 1, description = "The delivery's id"),
    ),
    responses(
        (status = 200, body = DeliveryView, description = "Requeued: pending again, due now, its attempts counted afresh; sent in its session's `seq` order. A repeat of the request changes nothing and answers the delivery as it stands."),
        (status = 404, body = ErrorBody, description = "no such webhook, or no such delivery of it"),
        (status = 409, body = ErrorBody, description = "the delivery is not a dead letter"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn requeue_delivery(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath((id, delivery)): ApiPath<(String, String)>,
) -> Result<axum::Json<DeliveryView>, ApiError> {
    let id = parse_webhook_id(&id)?;
    let delivery = delivery.parse::<i64>().map_err(|_| {
        ApiError::bad_request(format!(
            "expected a delivery id (an integer), found {delivery:?}"
        ))
    })?;
    tenant_webhook(&state, &tenant, &id).await?;
    let requeued = state
        .webhooks
        .requeue_delivery(&id, delivery, now_ms())
        .await?;
    Ok(axum::Json(requeued.into()))
}

#[utoipa::path(
    post, path = "/v1/webhooks/{id}/deliveries/requeue", tag = "webhooks",
    params(("id" = WebhookIdSchema, Path, description = "The webhook's id")),
    responses(
        (status = 200, body = RequeuedView, description = "Every dead letter of the webhook requeued; a repeat finds none left"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn requeue_dead_deliveries(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<RequeuedView>, ApiError> {
    let id = parse_webhook_id(&id)?;
    tenant_webhook(&state, &tenant, &id).await?;
    let requeued = state
        .webhooks
        .requeue_dead_deliveries(&id, now_ms())
        .await?;
    Ok(axum::Json(RequeuedView { requeued }))
}
