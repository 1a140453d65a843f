//! A session's inbox (what background work reported, dead letters included) and the end of a
//! session's life: archive and delete.

use axum::extract::State;
use axum::http::StatusCode;
use ratchet_core::{InboxStatus, Millis};
use ratchet_store::{Closing, InboxEvent};
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::api::{ErrorBody, Page, SessionView, StatusPageQuery};
use crate::auth::Tenant;
use crate::error::{ApiPath, ApiQuery};
use crate::routes::{parse_session_id, tenant_session};
use crate::{ApiError, AppState};

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_inbox))
        .routes(routes!(archive_session))
        .routes(routes!(delete_session))
}

/// One event of a session's inbox.
#[derive(Debug, Serialize, ToSchema)]
pub struct InboxEventView {
    pub id: i64,
    /// `completion`, `group_completion` or `signal`.
    pub kind: String,
    /// `reserved` (a place held for running work), `pending`, `leased` (a continuation turn
    /// holds it), `consumed`, `dead_letter` or `superseded`.
    pub status: String,
    /// `queue` or `steer`.
    pub delivery: String,
    /// The run whose `delegate` call started the work.
    pub parent_run_id: String,
    pub source_run_id: Option<String>,
    pub group: Option<String>,
    /// What the work reported; absent while the event is a reservation.
    pub payload: Option<Value>,
    pub attempts: u32,
    pub max_attempts: u32,
    pub available_at: Option<Millis>,
    /// The continuation run holding it, or that consumed it.
    pub lease_run_id: Option<String>,
    /// Why it was dead-lettered or superseded, or why its last attempt failed.
    pub reason: Option<String>,
    pub created_at: Millis,
    pub updated_at: Millis,
}

impl From<InboxEvent> for InboxEventView {
    fn from(event: InboxEvent) -> InboxEventView {
        InboxEventView {
            id: event.id,
            kind: event.kind.as_str().to_owned(),
            status: event.status.as_str().to_owned(),
            delivery: event.delivery.as_str().to_owned(),
            parent_run_id: event.parent_run_id.to_string(),
            source_run_id: event.source_run_id.map(|r| r.to_string()),
            group: event.group,
            payload: event.payload,
            attempts: event.attempts,
            max_attempts: event.max_attempts,
            available_at: event.available_at,
            lease_run_id: event.lease_run_id.map(|r| r.to_string()),
            reason: event.reason,
            created_at: event.created_at,
            updated_at: event.updated_at,
        }
    }
}

#[utoipa::path(
    get, path = "/v1/sessions/{id}/inbox", tag = "sessions",
    params(("id" = String, Path, description = "Session id (`ses_…`)", pattern = "^ses_[A-Za-z0-9-]{1,64}$"), StatusPageQuery),
    responses(
        (status = 200, body = Page<InboxEventView>, description = "The session's inbox events in the order they were created, dead letters included"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn list_inbox(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<StatusPageQuery>,
) -> Result<axum::Json<Page<InboxEventView>>, ApiError> {
    let id = parse_session_id(&id)?;
    let (after, limit, status) = query.checked("inbox", &InboxStatus::ALL, InboxStatus::as_str)?;
    tenant_session(&state, &tenant, &id).await?;
    let events = state
        .coordinator
        .store()
        .inbox(&id, status, after, limit)
        .await?;
    let items = events.into_iter().map(InboxEventView::from).collect();
    Ok(axum::Json(Page::new(items, limit, |e: &InboxEventView| {
        e.id.to_string()
    })))
}

#[utoipa::path(
    post, path = "/v1/sessions/{id}/archive", tag = "sessions",
    params(("id" = String, Path, description = "Session id (`ses_…`)", pattern = "^ses_[A-Za-z0-9-]{1,64}$")),
    responses(
        (status = 200, body = SessionView, description = "Archived: its runs (background ones included) are cancelled, its inbox dead-lettered; it takes no more messages and starts no continuation. Everything stays readable."),
        (status = 409, body = ErrorBody, description = "the session is already archived"),
        (status = 422, body = ErrorBody, description = "the session holds a delegated run: archive its root session"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn archive_session(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<SessionView>, ApiError> {
    let id = parse_session_id(&id)?;
    tenant_session(&state, &tenant, &id).await?;
    state
        .coordinator
        .close_session(&id, Closing::Archive)
        .await?;
    let session = state.coordinator.store().get_session(&id).await?;
    Ok(axum::Json(session.into()))
}

#[utoipa::path(
    delete, path = "/v1/sessions/{id}", tag = "sessions",
    params(("id" = String, Path, description = "Session id (`ses_…`)", pattern = "^ses_[A-Za-z0-9-]{1,64}$")),
    responses(
        (status = 204, description = "Deleted: closed as by archive, and no longer listed or readable through the API; its records stay in the database"),
        (status = 422, body = ErrorBody, description = "the session holds a delegated run: delete its root session"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn delete_session(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    let id = parse_session_id(&id)?;
    tenant_session(&state, &tenant, &id).await?;
    state
        .coordinator
        .close_session(&id, Closing::Delete)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}
