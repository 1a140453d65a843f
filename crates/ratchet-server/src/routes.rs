//! The JSON endpoints under `/v1`: the catalog's agents, sessions, messages, runs, run trees,
//! steps, cancellation and forks.

use axum::Extension;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use ratchet_core::bounds::sent_to_model;
use ratchet_core::{
    AgentState, Role, RunConfigSnapshot, RunId, RunStatus, SessionId, TraceContext,
};
use ratchet_engine::Multitask as EngineMultitask;
use ratchet_store::{
    ListOrder, RequestMark, Session, SessionCursor, SessionQuery, SessionSpec, SessionState,
};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::active::{Active, Current, DEFAULT_AGENT};
use crate::api::{
    AgentView, CancelView, ContinueRequest, CreateSession, ErrorBody, ForkEditRequest, ForkRequest,
    ForkedFromView, ForkedView, MessageAccepted, MessageView, ModelCallView, Multitask, Page,
    PageQuery, PauseView, ReconcileOutcome, ReconcileRequest, ReconcileView, ResumedView,
    RunSummaryView, RunTreeView, RunView, SendMessage, SessionOrder, SessionStatusFilter,
    SessionView, SessionsQuery, StepDetailView, StepView, UpdateSession,
};
use crate::auth::Tenant;
use crate::error::{ApiJson, ApiPath, ApiQuery};
use crate::schemas::{RunIdSchema, SessionIdSchema};
use crate::{ApiError, AppState};

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_agents))
        .routes(routes!(create_session, list_sessions))
        .routes(routes!(get_session, update_session))
        .routes(routes!(send_message, list_messages))
        .routes(routes!(list_session_runs))
        .routes(routes!(get_run))
        .routes(routes!(get_run_tree))
        .routes(routes!(list_steps))
        .routes(routes!(get_step))
        .routes(routes!(cancel_run))
        .routes(routes!(reconcile_run))
        .routes(routes!(retry_run))
        .routes(routes!(continue_run))
        .routes(routes!(pause_run))
        .routes(routes!(resume_run))
        .routes(routes!(fork_run))
}

pub(crate) fn parse_session_id(text: &str) -> Result<SessionId, ApiError> {
    SessionId::parse(text).map_err(|e| ApiError::bad_request(e.to_string()))
}

pub(crate) fn parse_run_id(text: &str) -> Result<RunId, ApiError> {
    RunId::parse(text).map_err(|e| ApiError::bad_request(e.to_string()))
}

/// A cursor that is a position (a message's, a step's index); absent means the start.
pub(crate) fn numeric_cursor<T: std::str::FromStr + Default>(
    cursor: Option<&str>,
) -> Result<T, ApiError> {
    match cursor {
        None => Ok(T::default()),
        Some(cursor) => cursor
            .parse()
            .map_err(|_| ApiError::bad_request(format!("invalid cursor {cursor:?}"))),
    }
}

/// The session, if it exists, belongs to the tenant and was not deleted; another tenant's
/// session, or a deleted one, answers exactly as a missing one does.
pub(crate) async fn tenant_session(
    state: &AppState,
    tenant: &Tenant,
    id: &SessionId,
) -> Result<Session, ApiError> {
    match state.coordinator.store().get_session(id).await {
        Ok(session) if session.tenant == tenant.0 && session.deleted_at.is_none() => Ok(session),
        Ok(_) | Err(ratchet_store::Error::NotFound { .. }) => {
            Err(ApiError::not_found(format!("no session {id}")))
        }
        Err(other) => Err(other.into()),
    }
}

pub(crate) async fn tenant_run(
    state: &AppState,
    tenant: &Tenant,
    id: &RunId,
) -> Result<AgentState, ApiError> {
    let missing = || ApiError::not_found(format!("no run {id}"));
    let run = match state.coordinator.store().load_state(id).await {
        Ok(run) => run,
        Err(ratchet_store::Error::NotFound { .. }) => return Err(missing()),
        Err(other) => return Err(other.into()),
    };
    tenant_session(state, tenant, &run.session_id)
        .await
        .map_err(|_| missing())?;
    Ok(run)
}

/// The configuration a new run of a session with `agent` is frozen with: the agent's, or the
/// server's template for a session that names none.
pub(crate) fn run_config(
    active: &Active,
    agent: Option<&str>,
) -> Result<RunConfigSnapshot, ApiError> {
    match agent {
        None | Some(DEFAULT_AGENT) => Ok(active.run_template().clone()),
        Some(id) => match active.agent(id) {
            Some(profile) => Ok(profile.config.clone()),
            None => Err(ApiError::new(
                StatusCode::CONFLICT,
                "conflict",
                format!(
                    "this session's agent {id:?} is no longer in the server's catalog; available agents: {}; start a new session",
                    active.available_agents()
                ),
            )),
        },
    }
}

#[utoipa::path(
    get, path = "/v1/agents", tag = "agents",
    responses(
        (status = 200, body = Page<AgentView>, description = "The whole catalog in id order, on one page (`next_cursor` is always null)"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn list_agents(
    _tenant: Tenant,
    Current(active): Current,
) -> Result<axum::Json<Page<AgentView>>, ApiError> {
    let items = active.agents().iter().map(AgentView::from).collect();
    Ok(axum::Json(Page {
        items,
        next_cursor: None,
    }))
}

#[utoipa::path(
    post, path = "/v1/sessions", tag = "sessions",
    request_body = CreateSession,
    responses(
        (status = 201, body = SessionView),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn create_session(
    State(state): State<AppState>,
    tenant: Tenant,
    Current(active): Current,
    request: Option<Extension<RequestMark>>,
    ApiJson(body): ApiJson<CreateSession>,
) -> Result<(StatusCode, axum::Json<SessionView>), ApiError> {
    if let Some(agent) = body.agent.as_deref()
        && agent != DEFAULT_AGENT
        && active.agent(agent).is_none()
    {
        return Err(ApiError::unprocessable(format!(
            "unknown agent {agent:?}; available agents: {}",
            active.available_agents()
        )));
    }
    let spec = SessionSpec {
        tenant: tenant.0,
        agent: body.agent,
        metadata: body.metadata.map(serde_json::Value::Object),
        request: request.map(|Extension(mark)| mark),
    };
    let session = state.coordinator.create_session(spec).await?;
    Ok((StatusCode::CREATED, axum::Json(session.into())))
}

#[utoipa::path(
    get, path = "/v1/sessions", tag = "sessions",
    params(SessionsQuery),
    responses((status = 200, body = Page<SessionView>), (status = "4XX", body = ErrorBody)),
)]
async fn list_sessions(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiQuery(query): ApiQuery<SessionsQuery>,
) -> Result<axum::Json<Page<SessionView>>, ApiError> {
    let limit = query.limit()?;
    let order = match query.order {
        None | Some(SessionOrder::Oldest) => ListOrder::OldestFirst,
        Some(SessionOrder::Newest) => ListOrder::NewestFirst,
        Some(SessionOrder::Activity) => ListOrder::LatestActivityFirst,
    };
    let after = query
        .cursor
        .as_deref()
        .map(|cursor| session_cursor(order, cursor))
        .transpose()?;
    let text = query.q.as_deref().map(str::trim);
    if let Some(text) = text
        && !(1..=MAX_QUERY_CHARS).contains(&text.chars().count())
    {
        return Err(ApiError::bad_request(format!(
            "q must be 1 to {MAX_QUERY_CHARS} characters besides the white space around them; \
             found {}",
            text.chars().count()
        )));
    }
    if query.agent.as_deref() == Some("") {
        return Err(ApiError::bad_request(
            "agent must name an agent of the catalog, or `default`",
        ));
    }
    if query.created_from.is_some_and(|at| at < 0) || query.created_before.is_some_and(|at| at < 0)
    {
        return Err(ApiError::bad_request(
            "created_from and created_before are times in ms since the epoch, not negative",
        ));
    }
    let store_query = SessionQuery {
        order,
        after,
        state: query.status.map(|status| match status {
            SessionStatusFilter::WaitingHuman => SessionState::WaitingHuman,
            SessionStatusFilter::Active => SessionState::Active,
            SessionStatusFilter::Failed => SessionState::Failed,
            SessionStatusFilter::Idle => SessionState::Idle,
            SessionStatusFilter::Archived => SessionState::Archived,
        }),
        agent: query
            .agent
            .map(|agent| (agent != DEFAULT_AGENT).then_some(agent)),
        created_from: query.created_from,
        created_before: query.created_before,
        text: text.map(str::to_owned),
    };
    let sessions = state
        .coordinator
        .store()
        .list_sessions(&tenant.0, &store_query, limit)
        .await?;
    let items = sessions.into_iter().map(SessionView::from).collect();
    Ok(axum::Json(Page::new(
        items,
        limit,
        |s: &SessionView| match order {
            ListOrder::LatestActivityFirst => format!("{}.{}", s.last_activity_at, s.id),
            ListOrder::OldestFirst | ListOrder::NewestFirst => s.id.clone(),
        },
    )))
}

/// A sessions list's cursor: a session id, or `ACTIVITY.ID` in activity order.
fn session_cursor(order: ListOrder, cursor: &str) -> Result<SessionCursor, ApiError> {
    let invalid = || ApiError::bad_request(format!("invalid cursor {cursor:?}"));
    match order {
        ListOrder::LatestActivityFirst => {
            let (at, id) = cursor.split_once('.').ok_or_else(invalid)?;
            let at = at.parse().map_err(|_| invalid())?;
            Ok(SessionCursor::Activity(at, parse_session_id(id)?))
        }
        ListOrder::OldestFirst | ListOrder::NewestFirst => {
            Ok(SessionCursor::Id(parse_session_id(cursor)?))
        }
    }
}

#[utoipa::path(
    patch, path = "/v1/sessions/{id}", tag = "sessions",
    params(("id" = SessionIdSchema, Path, description = "The session's id")),
    request_body = UpdateSession,
    responses((status = 200, body = SessionView), (status = "4XX", body = ErrorBody)),
)]
async fn update_session(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<UpdateSession>,
) -> Result<axum::Json<SessionView>, ApiError> {
    let id = parse_session_id(&id)?;
    let title = body.title.trim();
    let length = title.chars().count();
    if !(1..=MAX_TITLE_CHARS).contains(&length) || title.chars().any(char::is_control) {
        return Err(ApiError::unprocessable(format!(
            "title must be 1 to {MAX_TITLE_CHARS} characters, not only spaces, without control \
             characters; found {length} characters"
        )));
    }
    tenant_session(&state, &tenant, &id).await?;
    let session = state.coordinator.rename_session(&id, title).await?;
    Ok(axum::Json(session.into()))
}

/// The longest text a sessions list searches for.
const MAX_QUERY_CHARS: usize = 200;

/// The longest title a session may be given.
const MAX_TITLE_CHARS: usize = 200;

#[utoipa::path(
    get, path = "/v1/sessions/{id}", tag = "sessions",
    params(("id" = SessionIdSchema, Path, description = "The session's id")),
    responses((status = 200, body = SessionView), (status = "4XX", body = ErrorBody)),
)]
async fn get_session(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<SessionView>, ApiError> {
    let id = parse_session_id(&id)?;
    Ok(axum::Json(
        tenant_session(&state, &tenant, &id).await?.into(),
    ))
}

#[utoipa::path(
    post, path = "/v1/sessions/{id}/messages", tag = "messages",
    params(
        ("id" = SessionIdSchema, Path, description = "The session's id"),
        ("traceparent" = Option<String>, Header, description = "W3C Trace Context: the run's spans join this trace, under this span. An invalid value is ignored."),
    ),
    request_body = SendMessage,
    responses(
        (status = 202, body = MessageAccepted),
        (status = 409, body = ErrorBody, description = "`multitask: reject` while a run is active, or the session's agent is no longer in the catalog"),
        (status = 429, body = ErrorBody, description = "the run would exceed a run quota (`quota_exceeded`); nothing was recorded"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn send_message(
    State(state): State<AppState>,
    tenant: Tenant,
    Current(active): Current,
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
    request: Option<Extension<RequestMark>>,
    ApiJson(body): ApiJson<SendMessage>,
) -> Result<(StatusCode, axum::Json<MessageAccepted>), ApiError> {
    let id = parse_session_id(&id)?;
    if body.content.trim().is_empty() {
        return Err(ApiError::unprocessable(
            "content is empty; expected the message text",
        ));
    }
    let session = tenant_session(&state, &tenant, &id).await?;
    let config = run_config(&active, session.agent.as_deref())?;
    let multitask = match body.multitask.unwrap_or_default() {
        Multitask::Enqueue => EngineMultitask::Enqueue,
        Multitask::Reject => EngineMultitask::Reject,
        Multitask::Interrupt => EngineMultitask::Interrupt,
        Multitask::Steer => EngineMultitask::Steer,
    };
    let trace = (headers.get("traceparent"))
        .and_then(|value| value.to_str().ok())
        .and_then(TraceContext::from_traceparent);
    let started = state
        .coordinator
        .submit_in_trace(
            &id,
            body.content,
            config,
            multitask,
            trace,
            request.map(|Extension(mark)| mark),
        )
        .await?;
    let accepted = MessageAccepted {
        message_id: started.message_id.to_string(),
        run_id: started.run_id.to_string(),
        run_status: started.status.to_string(),
        steered: started.steered,
    };
    Ok((StatusCode::ACCEPTED, axum::Json(accepted)))
}

#[utoipa::path(
    get, path = "/v1/sessions/{id}/messages", tag = "messages",
    params(("id" = SessionIdSchema, Path, description = "The session's id"), PageQuery),
    responses((status = 200, body = Page<MessageView>), (status = "4XX", body = ErrorBody)),
)]
async fn list_messages(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<PageQuery>,
) -> Result<axum::Json<Page<MessageView>>, ApiError> {
    let id = parse_session_id(&id)?;
    let limit = query.limit()?;
    let after: i64 = numeric_cursor(query.cursor.as_deref())?;
    tenant_session(&state, &tenant, &id).await?;
    let messages = state
        .coordinator
        .store()
        .visible_messages(&id, after, limit)
        .await?;
    let last = messages.last().map(|m| m.position.to_string());
    let items = messages.into_iter().map(MessageView::from).collect();
    Ok(axum::Json(Page::with_last_cursor(items, limit, last)))
}

#[utoipa::path(
    get, path = "/v1/sessions/{id}/runs", tag = "runs",
    params(("id" = SessionIdSchema, Path, description = "The session's id"), PageQuery),
    responses((status = 200, body = Page<RunSummaryView>), (status = "4XX", body = ErrorBody)),
)]
async fn list_session_runs(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<PageQuery>,
) -> Result<axum::Json<Page<RunSummaryView>>, ApiError> {
    let id = parse_session_id(&id)?;
    let limit = query.limit()?;
    let after = query.cursor.as_deref().map(parse_run_id).transpose()?;
    tenant_session(&state, &tenant, &id).await?;
    let runs = state
        .coordinator
        .store()
        .session_runs(&id, after.as_ref(), limit)
        .await?;
    let items = runs.into_iter().map(RunSummaryView::from).collect();
    Ok(axum::Json(Page::new(items, limit, |r: &RunSummaryView| {
        r.id.clone()
    })))
}

#[utoipa::path(
    get, path = "/v1/runs/{id}", tag = "runs",
    params(("id" = RunIdSchema, Path, description = "The run's id")),
    responses((status = 200, body = RunView), (status = "4XX", body = ErrorBody)),
)]
async fn get_run(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<RunView>, ApiError> {
    let id = parse_run_id(&id)?;
    Ok(axum::Json(tenant_run(&state, &tenant, &id).await?.into()))
}

#[utoipa::path(
    get, path = "/v1/runs/{id}/tree", tag = "runs",
    params(("id" = RunIdSchema, Path, description = "The run's id")),
    responses((status = 200, body = RunTreeView), (status = "4XX", body = ErrorBody)),
)]
async fn get_run_tree(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<RunTreeView>, ApiError> {
    let id = parse_run_id(&id)?;
    tenant_run(&state, &tenant, &id).await?;
    let nodes = state.coordinator.store().run_tree(&id).await?;
    Ok(axum::Json(RunTreeView {
        run_id: id.to_string(),
        nodes: nodes.into_iter().map(Into::into).collect(),
    }))
}

#[utoipa::path(
    get, path = "/v1/runs/{id}/steps", tag = "runs",
    params(("id" = RunIdSchema, Path, description = "The run's id"), PageQuery),
    responses((status = 200, body = Page<StepView>), (status = "4XX", body = ErrorBody)),
)]
async fn list_steps(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<PageQuery>,
) -> Result<axum::Json<Page<StepView>>, ApiError> {
    let id = parse_run_id(&id)?;
    let limit = query.limit()?;
    let after: u64 = numeric_cursor(query.cursor.as_deref())?;
    tenant_run(&state, &tenant, &id).await?;
    let steps = state.coordinator.store().steps(&id).await?;
    let items: Vec<StepView> = steps
        .into_iter()
        .filter(|s| s.index > after)
        .take(limit as usize)
        .map(StepView::from)
        .collect();
    Ok(axum::Json(Page::new(items, limit, |s: &StepView| {
        s.index.to_string()
    })))
}

#[utoipa::path(
    get, path = "/v1/runs/{id}/steps/{index}", tag = "runs",
    params(
        ("id" = RunIdSchema, Path, description = "The run's id"),
        ("index" = u64, Path, minimum = 1, description = "The step's index (steps are numbered from 1)"),
    ),
    responses(
        (status = 200, body = StepDetailView, description = "The committed step, with the request its model call was sent and the messages it wrote"),
        (status = 404, body = ErrorBody, description = "no such run, or it has not committed that step"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn get_step(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath((id, index)): ApiPath<(String, String)>,
) -> Result<axum::Json<StepDetailView>, ApiError> {
    let id = parse_run_id(&id)?;
    let index = (index.parse::<u64>().ok().filter(|i| *i >= 1)).ok_or_else(|| {
        ApiError::bad_request(format!(
            "expected a step index (an integer from 1), found {index:?}"
        ))
    })?;
    let run = tenant_run(&state, &tenant, &id).await?;
    let store = state.coordinator.store();
    let step = (store.steps(&id).await?.into_iter())
        .find(|s| s.index == index)
        .ok_or_else(|| {
            ApiError::not_found(format!(
                "run {id} has not committed a step {index}: it has committed {}",
                run.step_index
            ))
        })?;
    let messages = store.step_messages(&id, index).await?;
    let model_call = (step.instruction == "call_llm").then(|| {
        let config = &run.config;
        let conclude = step.summary["conclude"].as_bool().unwrap_or(false);
        let sent = sent_to_model(
            messages.context.into_iter().map(|m| m.message).collect(),
            config.limits.max_tool_result_bytes,
        );
        ModelCallView {
            model: config.model.clone(),
            system_prompt: config.system_prompt.clone(),
            tools: if conclude {
                Vec::new()
            } else {
                config.tools.iter().map(Into::into).collect()
            },
            messages: sent.into_iter().map(Into::into).collect(),
            reply: (messages.written.iter())
                .find(|m| m.message.role == Role::Assistant)
                .map(|m| m.message.clone().into()),
        }
    });
    Ok(axum::Json(StepDetailView {
        step: step.into(),
        model_call,
        written: (messages.written.into_iter())
            .map(|m| m.message.into())
            .collect(),
    }))
}

#[utoipa::path(
    post, path = "/v1/runs/{id}/cancel", tag = "runs",
    params(("id" = RunIdSchema, Path, description = "The run's id")),
    responses((status = 200, body = CancelView), (status = "4XX", body = ErrorBody)),
)]
async fn cancel_run(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<CancelView>, ApiError> {
    let id = parse_run_id(&id)?;
    tenant_run(&state, &tenant, &id).await?;
    let status = match state.coordinator.request_cancel(&id).await? {
        ratchet_store::CancelOutcome::Cancelled { .. } => "cancelled".to_owned(),
        ratchet_store::CancelOutcome::Cancelling { .. } => "cancelling".to_owned(),
        ratchet_store::CancelOutcome::AlreadyTerminal(status) => status.to_string(),
    };
    Ok(axum::Json(CancelView {
        run_id: id.to_string(),
        status,
    }))
}

#[utoipa::path(
    post, path = "/v1/runs/{id}/pause", tag = "runs",
    params(("id" = RunIdSchema, Path, description = "The run's id")),
    responses(
        (status = 200, body = PauseView),
        (status = 409, body = ErrorBody, description = "the run is not running (only a running run can be paused)"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn pause_run(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<PauseView>, ApiError> {
    let id = parse_run_id(&id)?;
    tenant_run(&state, &tenant, &id).await?;
    let status = match state.coordinator.request_pause(&id).await? {
        ratchet_store::PauseOutcome::Paused { .. } => "paused",
        ratchet_store::PauseOutcome::Pausing => "pausing",
    };
    Ok(axum::Json(PauseView {
        run_id: id.to_string(),
        status: status.to_owned(),
    }))
}

#[utoipa::path(
    post, path = "/v1/runs/{id}/resume", tag = "runs",
    params(("id" = RunIdSchema, Path, description = "The run's id")),
    responses(
        (status = 200, body = ResumedView),
        (status = 409, body = ErrorBody, description = "the run is not paused and has no pause pending"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn resume_run(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<ResumedView>, ApiError> {
    let id = parse_run_id(&id)?;
    tenant_run(&state, &tenant, &id).await?;
    state.coordinator.resume_paused(&id).await?;
    Ok(axum::Json(ResumedView {
        run_id: id.to_string(),
        status: "running".to_owned(),
    }))
}

#[utoipa::path(
    post, path = "/v1/runs/{id}/reconcile", tag = "runs",
    params(("id" = RunIdSchema, Path, description = "The run's id")),
    request_body = ReconcileRequest,
    responses(
        (status = 200, body = ReconcileView),
        (status = 409, body = ErrorBody, description = "the run is not waiting for this call"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn reconcile_run(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<ReconcileRequest>,
) -> Result<axum::Json<ReconcileView>, ApiError> {
    use ratchet_core::step::Reconciliation;
    let id = parse_run_id(&id)?;
    tenant_run(&state, &tenant, &id).await?;
    let answer = match body.outcome {
        ReconcileOutcome::Succeeded => Reconciliation::Succeeded,
        ReconcileOutcome::Failed => Reconciliation::Failed,
        ReconcileOutcome::Retry => Reconciliation::Retry,
        ReconcileOutcome::Skip => Reconciliation::Skip,
    };
    let reconciled = state
        .coordinator
        .reconcile(&id, &body.call_id, answer, body.result)
        .await?;
    // Still waiting on other calls, or ended (a call left in doubt by an ended run).
    let status = if reconciled.resumed {
        RunStatus::Running
    } else {
        state.coordinator.store().load_state(&id).await?.status
    };
    Ok(axum::Json(ReconcileView {
        run_id: id.to_string(),
        status: status.to_string(),
    }))
}

#[utoipa::path(
    post, path = "/v1/runs/{id}/retry", tag = "runs",
    params(("id" = RunIdSchema, Path, description = "The run's id")),
    responses(
        (status = 200, body = ResumedView),
        (status = 409, body = ErrorBody, description = "the run has not failed, or its session has another active run"),
        (status = 422, body = ErrorBody, description = "the run did not fail calling the model: continue it instead"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn retry_run(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
    request: Option<Extension<RequestMark>>,
) -> Result<axum::Json<ResumedView>, ApiError> {
    let how = ratchet_core::step::Resumption::Retry;
    resume(&state, &tenant, &id, how, request.map(|r| r.0)).await
}

#[utoipa::path(
    post, path = "/v1/runs/{id}/continue", tag = "runs",
    params(("id" = RunIdSchema, Path, description = "The run's id")),
    request_body = ContinueRequest,
    responses(
        (status = 200, body = ResumedView),
        (status = 409, body = ErrorBody, description = "the run has not failed, or its session has another active run"),
        (status = 422, body = ErrorBody, description = "the run's budget would still be spent"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn continue_run(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
    request: Option<Extension<RequestMark>>,
    ApiJson(body): ApiJson<ContinueRequest>,
) -> Result<axum::Json<ResumedView>, ApiError> {
    let extension = body.extension()?;
    let how = ratchet_core::step::Resumption::Continue { extension };
    resume(&state, &tenant, &id, how, request.map(|r| r.0)).await
}

async fn resume(
    state: &AppState,
    tenant: &Tenant,
    id: &str,
    how: ratchet_core::step::Resumption,
    request: Option<RequestMark>,
) -> Result<axum::Json<ResumedView>, ApiError> {
    let id = parse_run_id(id)?;
    tenant_run(state, tenant, &id).await?;
    state.coordinator.resume_failed(&id, how, request).await?;
    Ok(axum::Json(ResumedView::running(&id)))
}

#[utoipa::path(
    post, path = "/v1/runs/{id}/fork", tag = "runs",
    params(("id" = RunIdSchema, Path, description = "The run's id")),
    request_body = ForkRequest,
    responses(
        (status = 201, body = ForkedView),
        (status = 404, body = ErrorBody, description = "no such run"),
        (status = 422, body = ErrorBody, description = "the step cannot be forked (not committed, waiting for children, nothing to continue), the edit names nothing there, or the agent is unknown"),
        (status = 429, body = ErrorBody, description = "the run quota is full"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn fork_run(
    State(state): State<AppState>,
    tenant: Tenant,
    Current(active): Current,
    ApiPath(id): ApiPath<String>,
    request: Option<Extension<RequestMark>>,
    ApiJson(body): ApiJson<ForkRequest>,
) -> Result<(StatusCode, axum::Json<ForkedView>), ApiError> {
    let id = parse_run_id(&id)?;
    tenant_run(&state, &tenant, &id).await?;
    let config = match body.agent {
        None => None,
        Some(agent) if agent != DEFAULT_AGENT && active.agent(&agent).is_none() => {
            return Err(ApiError::unprocessable(format!(
                "unknown agent {agent:?}; available agents: {}",
                active.available_agents()
            )));
        }
        Some(agent) => Some((run_config(&active, Some(&agent))?, Some(agent))),
    };
    let edit = match body.edit {
        None => None,
        Some(ForkEditRequest::ReplaceUserMessage(text)) if text.trim().is_empty() => {
            return Err(ApiError::unprocessable(
                "replace_user_message is empty; expected the message text",
            ));
        }
        Some(ForkEditRequest::ReplaceUserMessage(text)) => {
            Some(ratchet_core::ForkEdit::ReplaceUserMessage(text))
        }
        Some(ForkEditRequest::ReplaceToolResult(replace)) => {
            Some(ratchet_core::ForkEdit::ReplaceToolResult {
                call_id: replace.call_id,
                result: match replace.result {
                    serde_json::Value::String(text) => text,
                    other => other.to_string(),
                },
            })
        }
    };
    let forked = state
        .coordinator
        .fork(
            &id,
            body.at_step,
            edit,
            config,
            request.map(|Extension(mark)| mark),
        )
        .await?;
    let view = ForkedView {
        session_id: forked.session.id.to_string(),
        run_id: forked.run_id.to_string(),
        status: forked.status.to_string(),
        forked_from: ForkedFromView {
            run_id: id.to_string(),
            step: body.at_step,
        },
    };
    Ok((StatusCode::CREATED, axum::Json(view)))
}
