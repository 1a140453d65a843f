//! `/v1/approvals`: the gated tool batches of a tenant, and the one request that answers one.

use axum::extract::State;
use ratchet_core::{ApprovalAnswer, ApprovalId, CallDecision, Verdict};
use ratchet_store::{Approval, ApprovalStatus};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::api::{
    ApprovalRequestBody, ApprovalView, ApprovalsQuery, DecisionBody, ErrorBody, Page, PageQuery,
};
use crate::auth::Tenant;
use crate::error::{ApiJson, ApiPath, ApiQuery};
use crate::routes::tenant_session;
use crate::schemas::ApprovalIdSchema;
use crate::{ApiError, AppState};

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_approvals))
        .routes(routes!(get_approval, answer_approval))
}

fn parse_approval_id(text: &str) -> Result<ApprovalId, ApiError> {
    ApprovalId::parse(text).map_err(|e| ApiError::bad_request(e.to_string()))
}

/// The approval, if it exists and its session belongs to the tenant; another tenant's
/// approval answers exactly as a missing one does.
async fn tenant_approval(
    state: &AppState,
    tenant: &Tenant,
    id: &ApprovalId,
) -> Result<Approval, ApiError> {
    let missing = || ApiError::not_found(format!("no approval {id}"));
    let approval = match state.coordinator.store().get_approval(id).await {
        Ok(approval) => approval,
        Err(ratchet_store::Error::NotFound { .. }) => return Err(missing()),
        Err(other) => return Err(other.into()),
    };
    tenant_session(state, tenant, &approval.session_id)
        .await
        .map_err(|_| missing())?;
    Ok(approval)
}

#[utoipa::path(
    get, path = "/v1/approvals", tag = "approvals",
    params(ApprovalsQuery),
    responses((status = 200, body = Page<ApprovalView>), (status = "4XX", body = ErrorBody)),
)]
async fn list_approvals(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiQuery(query): ApiQuery<ApprovalsQuery>,
) -> Result<axum::Json<Page<ApprovalView>>, ApiError> {
    let status = match query.status.as_deref() {
        None => None,
        Some(text) => Some(ApprovalStatus::parse(text).ok_or_else(|| {
            let known: Vec<&str> = ApprovalStatus::ALL.iter().map(|s| s.as_str()).collect();
            ApiError::bad_request(format!(
                "unknown status {text:?}; expected one of {}",
                known.join(", ")
            ))
        })?),
    };
    let page = PageQuery {
        cursor: query.cursor,
        limit: query.limit,
    };
    let limit = page.limit()?;
    let after = page.cursor.as_deref().map(parse_approval_id).transpose()?;
    let approvals = state
        .coordinator
        .store()
        .approvals(&tenant.0, status, after.as_ref(), limit)
        .await?;
    let items: Vec<ApprovalView> = approvals.into_iter().map(ApprovalView::from).collect();
    Ok(axum::Json(Page::new(items, limit, |a: &ApprovalView| {
        a.id.clone()
    })))
}

#[utoipa::path(
    get, path = "/v1/approvals/{id}", tag = "approvals",
    params(("id" = ApprovalIdSchema, Path, description = "The approval's id")),
    responses((status = 200, body = ApprovalView), (status = "4XX", body = ErrorBody)),
)]
async fn get_approval(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<ApprovalView>, ApiError> {
    let id = parse_approval_id(&id)?;
    Ok(axum::Json(
        tenant_approval(&state, &tenant, &id).await?.into(),
    ))
}

#[utoipa::path(
    post, path = "/v1/approvals/{id}", tag = "approvals",
    params(("id" = ApprovalIdSchema, Path, description = "The approval's id")),
    request_body = ApprovalRequestBody,
    responses(
        (status = 200, body = ApprovalView, description = "answered (or the same answer again)"),
        (status = 409, body = ErrorBody, description = "already answered differently, or the run has ended"),
        (status = 422, body = ErrorBody, description = "the decisions do not fit the approval's calls"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn answer_approval(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<ApprovalRequestBody>,
) -> Result<axum::Json<ApprovalView>, ApiError> {
    let id = parse_approval_id(&id)?;
    let answer = match (body.decisions, body.abort) {
        (None, Some(true)) => ApprovalAnswer::Abort,
        (Some(decisions), None | Some(false)) => ApprovalAnswer::Decisions(
            decisions
                .into_iter()
                .map(|d| CallDecision {
                    call_id: d.call_id,
                    decision: match d.decision {
                        DecisionBody::Approve => Verdict::Approve,
                        DecisionBody::Deny => Verdict::Deny,
                    },
                    note: d.note,
                })
                .collect(),
        ),
        (Some(_), Some(true)) => {
            return Err(ApiError::unprocessable(
                "give either `decisions` or `\"abort\": true`, not both",
            ));
        }
        (None, None | Some(false)) => {
            return Err(ApiError::unprocessable(
                "expected `decisions` (one per call that needs approval) or `\"abort\": true`",
            ));
        }
    };
    tenant_approval(&state, &tenant, &id).await?;
    state
        .coordinator
        .answer_approval(&id, answer, &tenant.0)
        .await?;
    Ok(axum::Json(
        tenant_approval(&state, &tenant, &id).await?.into(),
    ))
}
