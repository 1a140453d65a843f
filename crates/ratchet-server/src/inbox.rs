//! A session's inbox (what background work reported, dead letters included) and the end of a
//! session's life: archive and delete.

use axum::extract::State;
use axum::http::StatusCode;
use ratchet_core::Millis;
use ratchet_store::{Closing, DeadLetterAction, InboxEvent};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::api::{ErrorBody, InboxQuery, Page, SessionView};
use crate::auth::Tenant;
use crate::error::{ApiJson, ApiPath, ApiQuery};
use crate::routes::{parse_session_id, tenant_session};
use crate::schemas::{InboxStatusSchema, RunIdSchema, SessionIdSchema};
use crate::{ApiError, AppState};

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_inbox))
        .routes(routes!(requeue_inbox_event))
        .routes(routes!(discard_inbox_event))
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
    /// holds it), `consumed`, `dead_letter`, `superseded` or `discarded` (a dead letter an
    /// operator dropped).
    #[schema(value_type = InboxStatusSchema)]
    pub status: String,
    /// `queue` or `steer`.
    pub delivery: String,
    /// The run whose `delegate` call started the work.
    #[schema(value_type = RunIdSchema)]
    pub parent_run_id: String,
    #[schema(value_type = Option<RunIdSchema>)]
    pub source_run_id: Option<String>,
    pub group: Option<String>,
    /// What the work reported; absent while the event is a reservation.
    pub payload: Option<Value>,
    pub attempts: u32,
    pub max_attempts: u32,
    pub available_at: Option<Millis>,
    /// The continuation run holding it, or that consumed it.
    #[schema(value_type = Option<RunIdSchema>)]
    pub lease_run_id: Option<String>,
    /// Why it was dead-lettered, superseded or discarded, why its last attempt failed, or who
    /// requeued it.
    pub reason: Option<String>,
    /// When an operator last requeued it from the dead letter.
    pub requeued_at: Option<Millis>,
    /// When it goes to the dead letter (`expired`) if it is still pending untold.
    pub expires_at: Option<Millis>,
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
            requeued_at: event.requeued_at,
            expires_at: event.expires_at,
            created_at: event.created_at,
            updated_at: event.updated_at,
        }
    }
}

#[utoipa::path(
    get, path = "/v1/sessions/{id}/inbox", tag = "sessions",
    params(("id" = SessionIdSchema, Path, description = "The session's id"), InboxQuery),
    responses(
        (status = 200, body = Page<InboxEventView>, description = "The session's inbox events in the order they were created, dead letters included"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn list_inbox(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<InboxQuery>,
) -> Result<axum::Json<Page<InboxEventView>>, ApiError> {
    let id = parse_session_id(&id)?;
    let (after, limit, status) = query.checked()?;
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

/// Who acts on a dead letter, for the record.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OperatorBody {
    /// Who requeues or discards it: 1–200 characters, not only white space, no control
    /// characters; the caller's tenant when absent.
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = r"^[^\x00-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f][^\x00-\x1f\x7f-\x9f]*$"
    )]
    pub by: Option<String>,
}

impl OperatorBody {
    /// The name to record: `by` when given, checked, or the tenant.
    pub fn operator(body: Option<OperatorBody>, tenant: &Tenant) -> Result<String, ApiError> {
        match body.and_then(|b| b.by) {
            None => Ok(format!("tenant {}", tenant.0)),
            Some(by) if by.trim().is_empty() || by.chars().count() > 200 => Err(
                ApiError::unprocessable("`by` must be 1 to 200 characters, not blank"),
            ),
            Some(by) if by.chars().any(char::is_control) => Err(ApiError::unprocessable(
                "`by` must not contain control characters",
            )),
            Some(by) => Ok(by),
        }
    }
}

/// An inbox event's place in a session's inbox: the session's id and the event's.
fn inbox_event_path(
    (session, event): (String, String),
) -> Result<(ratchet_core::SessionId, i64), ApiError> {
    let event = event.parse::<i64>().map_err(|_| {
        ApiError::bad_request(format!(
            "expected an inbox event id (an integer), found {event:?}"
        ))
    })?;
    Ok((parse_session_id(&session)?, event))
}

#[utoipa::path(
    post, path = "/v1/sessions/{id}/inbox/{event_id}/requeue", tag = "sessions",
    params(
        ("id" = SessionIdSchema, Path, description = "The session's id"),
        ("event_id" = i64, Path, minimum = 1, description = "The inbox event's id"),
    ),
    request_body(content = Option<OperatorBody>, description = "Optional: who requeues it"),
    responses(
        (status = 200, body = InboxEventView, description = "Requeued: pending again, due now, its attempts counted afresh — and leased to a continuation turn that started with it when the session was free. A repeat of the request changes nothing and answers the same."),
        (status = 404, body = ErrorBody, description = "no such session, or no such event in its inbox"),
        (status = 409, body = ErrorBody, description = "the event is not a dead letter (or was discarded), or the session is closed"),
        (status = 429, body = ErrorBody, description = "the session's inbox is full"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn requeue_inbox_event(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(path): ApiPath<(String, String)>,
    body: Option<ApiJson<OperatorBody>>,
) -> Result<axum::Json<InboxEventView>, ApiError> {
    act_on_dead_letter(state, tenant, path, body, DeadLetterAction::Requeue).await
}

#[utoipa::path(
    post, path = "/v1/sessions/{id}/inbox/{event_id}/discard", tag = "sessions",
    params(
        ("id" = SessionIdSchema, Path, description = "The session's id"),
        ("event_id" = i64, Path, minimum = 1, description = "The inbox event's id"),
    ),
    request_body(content = Option<OperatorBody>, description = "Optional: who discards it"),
    responses(
        (status = 200, body = InboxEventView, description = "Discarded for good: `reason` says by whom, `updated_at` when. A repeat changes nothing and answers the same."),
        (status = 404, body = ErrorBody, description = "no such session, or no such event in its inbox"),
        (status = 409, body = ErrorBody, description = "the event is not a dead letter"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn discard_inbox_event(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(path): ApiPath<(String, String)>,
    body: Option<ApiJson<OperatorBody>>,
) -> Result<axum::Json<InboxEventView>, ApiError> {
    act_on_dead_letter(state, tenant, path, body, DeadLetterAction::Discard).await
}

async fn act_on_dead_letter(
    state: AppState,
    tenant: Tenant,
    path: (String, String),
    body: Option<ApiJson<OperatorBody>>,
    action: DeadLetterAction,
) -> Result<axum::Json<InboxEventView>, ApiError> {
    let (id, event) = inbox_event_path(path)?;
    let by = OperatorBody::operator(body.map(|ApiJson(b)| b), &tenant)?;
    tenant_session(&state, &tenant, &id).await?;
    let event = (state.coordinator)
        .act_on_dead_letter(&id, event, action, &by)
        .await?;
    Ok(axum::Json(event.into()))
}

#[utoipa::path(
    post, path = "/v1/sessions/{id}/archive", tag = "sessions",
    params(("id" = SessionIdSchema, Path, description = "The session's id")),
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
    params(("id" = SessionIdSchema, Path, description = "The session's id")),
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
