//! A tenant's schedules: runs started by a cron expression or an interval, each due slot fired
//! once across every process on the database (the scheduler is `ratchet_engine::scheduler`;
//! the store decides each slot once). These handlers check a definition — the cadence, the
//! time zone, the session, the agent — freeze the agent's configuration into it, and read back
//! what each slot became.

use axum::Extension;
use axum::extract::State;
use axum::http::StatusCode;
use ratchet_core::{CatchUp, Millis, Overlap, ScheduleId, SessionId, SlotOutcome};
use ratchet_engine::cadence::Cadence as Slots;
use ratchet_store::{
    Cadence, RequestMark, Schedule, ScheduleChange, ScheduleSlot, ScheduleSpec, SlotCursor,
};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::active::{Active, Current, DEFAULT_AGENT};
use crate::api::{ErrorBody, Page, PageQuery};
use crate::auth::Tenant;
use crate::error::{ApiJson, ApiPath, ApiQuery};
use crate::routes::{parse_session_id, run_config, tenant_session};
use crate::schemas::{RunIdSchema, RunStatusSchema, ScheduleIdSchema, SessionIdSchema};
use crate::{ApiError, AppState};

/// The longest message a schedule sends, in characters.
const MAX_MESSAGE_CHARS: usize = 100_000;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create_schedule, list_schedules))
        .routes(routes!(get_schedule, update_schedule, delete_schedule))
        .routes(routes!(pause_schedule))
        .routes(routes!(resume_schedule))
        .routes(routes!(trigger_schedule))
        .routes(routes!(list_schedule_runs))
}

/// What a due slot does while the schedule's previous run has not finished.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OverlapView {
    /// Record the slot as skipped.
    Skip,
    /// Start the run anyway: behind the previous one in a shared session, beside it in a new
    /// session.
    Enqueue,
    /// Cancel the previous run, then start.
    CancelPrevious,
}

/// What becomes of the slots missed while no scheduler ran (more than 10 s late).
#[derive(Debug, Clone, Copy, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CatchUpView {
    /// Record them as skipped.
    Skip,
    /// Fire the latest one only (none when a slot on time fires).
    One,
    /// Fire each of them, the latest 100 at most.
    All,
}

impl From<OverlapView> for Overlap {
    fn from(view: OverlapView) -> Overlap {
        match view {
            OverlapView::Skip => Overlap::Skip,
            OverlapView::Enqueue => Overlap::Enqueue,
            OverlapView::CancelPrevious => Overlap::CancelPrevious,
        }
    }
}

impl From<Overlap> for OverlapView {
    fn from(overlap: Overlap) -> OverlapView {
        match overlap {
            Overlap::Skip => OverlapView::Skip,
            Overlap::Enqueue => OverlapView::Enqueue,
            Overlap::CancelPrevious => OverlapView::CancelPrevious,
        }
    }
}

impl From<CatchUpView> for CatchUp {
    fn from(view: CatchUpView) -> CatchUp {
        match view {
            CatchUpView::Skip => CatchUp::Skip,
            CatchUpView::One => CatchUp::One,
            CatchUpView::All => CatchUp::All,
        }
    }
}

impl From<CatchUp> for CatchUpView {
    fn from(catch_up: CatchUp) -> CatchUpView {
        match catch_up {
            CatchUp::Skip => CatchUpView::Skip,
            CatchUp::One => CatchUpView::One,
            CatchUp::All => CatchUpView::All,
        }
    }
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSchedule {
    /// The catalog agent its runs are of (`default`, or absent, for the server's run
    /// template); with an existing `session`, that session's agent or absent.
    pub agent: Option<String>,
    /// The message each run starts with.
    #[schema(min_length = 1)]
    pub message: String,
    /// A cron expression: 5 fields (minute hour day-of-month month day-of-week) or 6 (seconds
    /// first). Exactly one of `cron` and `every_ms`.
    pub cron: Option<String>,
    /// An interval in milliseconds, at least 1000; slots fall on its multiples since the Unix
    /// epoch. Exactly one of `cron` and `every_ms`.
    #[schema(minimum = 1000)]
    pub every_ms: Option<u64>,
    /// The IANA time zone the cron expression is read in (default `UTC`); only with `cron`.
    pub timezone: Option<String>,
    /// `new` (each run in a new session of its own) or the id of a session of yours, which
    /// every run goes to.
    pub session: String,
    pub overlap: OverlapView,
    pub catch_up: CatchUpView,
    /// Created paused: it fires nothing until resumed (default false).
    pub paused: Option<bool>,
}

/// A change of a schedule: each field given replaces the one it has; the agent's configuration
/// is frozen again from the catalog in force.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateSchedule {
    pub agent: Option<String>,
    #[schema(min_length = 1)]
    pub message: Option<String>,
    /// Replaces the cadence (and drops `every_ms`).
    pub cron: Option<String>,
    /// Replaces the cadence (and drops `cron` and `timezone`).
    #[schema(minimum = 1000)]
    pub every_ms: Option<u64>,
    pub timezone: Option<String>,
    /// `new` or a session id.
    pub session: Option<String>,
    pub overlap: Option<OverlapView>,
    pub catch_up: Option<CatchUpView>,
    pub paused: Option<bool>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ScheduleView {
    #[schema(value_type = ScheduleIdSchema)]
    pub id: String,
    pub agent: Option<String>,
    pub message: String,
    pub cron: Option<String>,
    pub every_ms: Option<u64>,
    /// The cron expression's time zone (null: UTC).
    pub timezone: Option<String>,
    /// `new`, or the session every run goes to.
    pub session: String,
    pub overlap: OverlapView,
    pub catch_up: CatchUpView,
    pub paused: bool,
    /// When its next slot is due (ms since the epoch); null when paused or when its cron
    /// expression matches no time to come.
    pub next_fire_at: Option<Millis>,
    /// The latest slot its cadence decided.
    pub last_slot: Option<Millis>,
    /// The latest run it fired.
    #[schema(value_type = Option<RunIdSchema>)]
    pub last_run_id: Option<String>,
    pub created_at: Millis,
    pub updated_at: Millis,
}

impl From<Schedule> for ScheduleView {
    fn from(schedule: Schedule) -> ScheduleView {
        let spec = schedule.spec;
        let (cron, timezone, every_ms) = match spec.cadence {
            Cadence::Cron {
                expression,
                timezone,
            } => (Some(expression), timezone, None),
            Cadence::Every { ms } => (None, None, Some(ms)),
        };
        ScheduleView {
            id: schedule.id.to_string(),
            agent: spec.agent,
            message: spec.message,
            cron,
            every_ms,
            timezone,
            session: spec
                .session
                .map_or_else(|| "new".to_owned(), |s| s.to_string()),
            overlap: spec.overlap.into(),
            catch_up: spec.catch_up.into(),
            paused: spec.paused,
            next_fire_at: (!spec.paused && schedule.next_fire_at != Millis::MAX)
                .then_some(schedule.next_fire_at),
            last_slot: schedule.last_slot,
            last_run_id: schedule.last_run_id.map(|r| r.to_string()),
            created_at: schedule.created_at,
            updated_at: schedule.updated_at,
        }
    }
}

/// What a decided slot became.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SlotOutcomeView {
    /// A run started (or queued) for it.
    Fired,
    /// The previous run had not finished (`overlap: skip`).
    SkippedOverlap,
    /// Missed while no scheduler ran, and left out by `catch_up`.
    SkippedCatchUp,
    /// The run was refused as a message would be (a run quota, a closed session).
    Refused,
}

impl From<SlotOutcome> for SlotOutcomeView {
    fn from(outcome: SlotOutcome) -> SlotOutcomeView {
        match outcome {
            SlotOutcome::Fired => SlotOutcomeView::Fired,
            SlotOutcome::SkippedOverlap => SlotOutcomeView::SkippedOverlap,
            SlotOutcome::SkippedCatchUp => SlotOutcomeView::SkippedCatchUp,
            SlotOutcome::Refused => SlotOutcomeView::Refused,
        }
    }
}

/// A decided slot of a schedule and its run, if it fired one.
#[derive(Debug, Serialize, ToSchema)]
pub struct ScheduleRunView {
    /// The run it fired; null for a slot skipped or refused.
    #[schema(value_type = Option<RunIdSchema>)]
    pub run_id: Option<String>,
    /// When the slot was due (ms since the epoch); for a manual trigger, when it was asked for.
    pub slot: Millis,
    /// The last slot of missed slots skipped together; `slot` otherwise.
    pub through: Millis,
    /// Fired by a trigger rather than by the cadence.
    pub manual: bool,
    pub outcome: SlotOutcomeView,
    /// The run's status now; null without a run.
    #[schema(value_type = Option<RunStatusSchema>)]
    pub status: Option<String>,
    #[schema(value_type = Option<SessionIdSchema>)]
    pub session_id: Option<String>,
    /// Why it was skipped or refused.
    pub reason: Option<String>,
    pub decided_at: Millis,
}

impl From<ScheduleSlot> for ScheduleRunView {
    fn from(slot: ScheduleSlot) -> ScheduleRunView {
        ScheduleRunView {
            run_id: slot.run_id.map(|r| r.to_string()),
            slot: slot.slot,
            through: slot.through,
            manual: slot.manual,
            outcome: slot.outcome.into(),
            status: slot.run_status.map(|s| s.to_string()),
            session_id: slot.session_id.map(|s| s.to_string()),
            reason: slot.reason,
            decided_at: slot.decided_at,
        }
    }
}

fn parse_schedule_id(text: &str) -> Result<ScheduleId, ApiError> {
    ScheduleId::parse(text).map_err(|e| ApiError::bad_request(e.to_string()))
}

/// The schedule, if it exists and belongs to the tenant: another tenant's answers as a missing
/// one does.
async fn tenant_schedule(
    state: &AppState,
    tenant: &Tenant,
    id: &ScheduleId,
) -> Result<Schedule, ApiError> {
    match state.coordinator.store().get_schedule(id).await {
        Ok(schedule) if schedule.tenant == tenant.0 => Ok(schedule),
        Ok(_) | Err(ratchet_store::Error::NotFound { .. }) => {
            Err(ApiError::not_found(format!("no schedule {id}")))
        }
        Err(other) => Err(other.into()),
    }
}

/// The cadence a body names: exactly one of `cron` and `every_ms`, a time zone only with cron.
fn cadence_of(
    cron: Option<String>,
    every_ms: Option<u64>,
    timezone: Option<String>,
) -> Result<Cadence, ApiError> {
    let cadence = match (cron, every_ms, timezone) {
        (Some(_), Some(ms), _) => {
            return Err(ApiError::unprocessable(format!(
                "expected exactly one of cron and every_ms; found both (every_ms {ms})"
            )));
        }
        (None, None, _) => {
            return Err(ApiError::unprocessable(
                "expected exactly one of cron (a cron expression) and every_ms (an interval); found neither",
            ));
        }
        (None, Some(_), Some(zone)) => {
            return Err(ApiError::unprocessable(format!(
                "timezone applies to a cron expression only; found timezone {zone:?} with every_ms"
            )));
        }
        (Some(expression), None, timezone) => Cadence::Cron {
            expression: expression.trim().to_owned(),
            timezone,
        },
        (None, Some(ms), None) => Cadence::Every { ms },
    };
    Ok(cadence)
}

/// When a schedule of `cadence` is next due after `now`; a cron expression that matches no
/// time to come is refused.
fn next_fire(cadence: &Cadence, now: Millis) -> Result<Millis, ApiError> {
    let slots = Slots::of(cadence).map_err(ApiError::unprocessable)?;
    slots.next_after(now).ok_or_else(|| {
        ApiError::unprocessable("the cron expression matches no time to come; it would never fire")
    })
}

/// Checks a definition against the catalog and the tenant's sessions; answers it with the
/// configuration its runs are frozen with.
async fn checked(
    state: &AppState,
    tenant: &Tenant,
    active: &Active,
    mut spec: ScheduleSpec,
) -> Result<(ScheduleSpec, ratchet_core::RunConfigSnapshot), ApiError> {
    let message_chars = spec.message.chars().count();
    if spec.message.trim().is_empty() || message_chars > MAX_MESSAGE_CHARS {
        return Err(ApiError::unprocessable(format!(
            "message must be 1 to {MAX_MESSAGE_CHARS} characters, not only spaces; found {message_chars}"
        )));
    }
    if let Some(session) = &spec.session {
        let found = tenant_session(state, tenant, session).await.map_err(|_| {
            ApiError::unprocessable(format!("session names no session of yours: {session}"))
        })?;
        if found.parent_session_id.is_some() {
            return Err(ApiError::unprocessable(format!(
                "session {session} holds a delegated run; name its root session or \"new\""
            )));
        }
        if found.archived_at.is_some() {
            return Err(ApiError::unprocessable(format!(
                "session {session} is archived and takes no more messages; name another or \"new\""
            )));
        }
        match (spec.agent.as_deref(), found.agent.as_deref()) {
            (None, _) => spec.agent = found.agent.clone(),
            (Some(asked), session_agent) if session_agent.unwrap_or(DEFAULT_AGENT) != asked => {
                return Err(ApiError::unprocessable(format!(
                    "agent {asked:?} is not session {session}'s agent ({:?}); leave agent out to use the session's",
                    session_agent.unwrap_or(DEFAULT_AGENT)
                )));
            }
            _ => {}
        }
    }
    if let Some(agent) = spec.agent.as_deref()
        && agent != DEFAULT_AGENT
        && active.agent(agent).is_none()
    {
        return Err(ApiError::unprocessable(format!(
            "unknown agent {agent:?}; available agents: {}",
            active.available_agents()
        )));
    }
    if spec.agent.as_deref() == Some(DEFAULT_AGENT) {
        spec.agent = None;
    }
    let config = run_config(active, spec.agent.as_deref())?;
    Ok((spec, config))
}

fn session_of(text: &str) -> Result<Option<SessionId>, ApiError> {
    if text == "new" {
        return Ok(None);
    }
    parse_session_id(text).map(Some).map_err(|_| {
        ApiError::unprocessable(format!(
            "session must be \"new\" or a session id (ses_…); found {text:?}"
        ))
    })
}

#[utoipa::path(
    post, path = "/v1/schedules", tag = "schedules",
    request_body = CreateSchedule,
    responses(
        (status = 201, body = ScheduleView),
        (status = 422, body = ErrorBody, description = "the cadence, time zone, session, agent or message is not valid: the message says what is expected and what was found"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn create_schedule(
    State(state): State<AppState>,
    tenant: Tenant,
    Current(active): Current,
    request: Option<Extension<RequestMark>>,
    ApiJson(body): ApiJson<CreateSchedule>,
) -> Result<(StatusCode, axum::Json<ScheduleView>), ApiError> {
    let cadence = cadence_of(body.cron, body.every_ms, body.timezone)?;
    let now = state.coordinator.now();
    let next_fire_at = next_fire(&cadence, now)?;
    let spec = ScheduleSpec {
        agent: body.agent,
        message: body.message,
        cadence,
        session: session_of(&body.session)?,
        overlap: body.overlap.into(),
        catch_up: body.catch_up.into(),
        paused: body.paused.unwrap_or(false),
    };
    let (spec, config) = checked(&state, &tenant, &active, spec).await?;
    let schedule = state
        .coordinator
        .create_schedule(tenant.0, spec, config, next_fire_at, request.map(|r| r.0))
        .await?;
    Ok((StatusCode::CREATED, axum::Json(schedule.into())))
}

#[utoipa::path(
    get, path = "/v1/schedules", tag = "schedules",
    params(PageQuery),
    responses((status = 200, body = Page<ScheduleView>), (status = "4XX", body = ErrorBody)),
)]
async fn list_schedules(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiQuery(query): ApiQuery<PageQuery>,
) -> Result<axum::Json<Page<ScheduleView>>, ApiError> {
    let limit = query.limit()?;
    let after = query.cursor.as_deref().map(parse_schedule_id).transpose()?;
    let schedules = state
        .coordinator
        .store()
        .schedules(&tenant.0, after.as_ref(), limit)
        .await?;
    let items = schedules.into_iter().map(ScheduleView::from).collect();
    Ok(axum::Json(Page::new(items, limit, |s: &ScheduleView| {
        s.id.clone()
    })))
}

#[utoipa::path(
    get, path = "/v1/schedules/{id}", tag = "schedules",
    params(("id" = ScheduleIdSchema, Path, description = "The schedule's id")),
    responses((status = 200, body = ScheduleView), (status = "4XX", body = ErrorBody)),
)]
async fn get_schedule(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<ScheduleView>, ApiError> {
    let id = parse_schedule_id(&id)?;
    Ok(axum::Json(
        tenant_schedule(&state, &tenant, &id).await?.into(),
    ))
}

#[utoipa::path(
    patch, path = "/v1/schedules/{id}", tag = "schedules",
    params(("id" = ScheduleIdSchema, Path, description = "The schedule's id")),
    request_body = UpdateSchedule,
    responses(
        (status = 200, body = ScheduleView),
        (status = 409, body = ErrorBody, description = "the schedule's agent is no longer in the catalog: name another"),
        (status = 422, body = ErrorBody, description = "a field is not valid: the message says what is expected and what was found"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn update_schedule(
    State(state): State<AppState>,
    tenant: Tenant,
    Current(active): Current,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<UpdateSchedule>,
) -> Result<axum::Json<ScheduleView>, ApiError> {
    let id = parse_schedule_id(&id)?;
    let schedule = tenant_schedule(&state, &tenant, &id).await?;
    let now = state.coordinator.now();
    let mut spec = schedule.spec.clone();
    let new_cadence = body.cron.is_some() || body.every_ms.is_some() || body.timezone.is_some();
    if new_cadence {
        let (cron, timezone) = match &spec.cadence {
            Cadence::Cron {
                expression,
                timezone,
            } => (Some(expression.clone()), timezone.clone()),
            Cadence::Every { .. } => (None, None),
        };
        spec.cadence = match (body.cron, body.every_ms) {
            (None, Some(ms)) => cadence_of(None, Some(ms), body.timezone)?,
            (cron_given, every) => {
                cadence_of(cron_given.or(cron), every, body.timezone.or(timezone))?
            }
        };
    }
    if let Some(session) = &body.session {
        spec.session = session_of(session)?;
        if body.agent.is_none() {
            // The agent follows the session unless one is named.
            spec.agent = None;
        }
    }
    if let Some(agent) = body.agent {
        spec.agent = Some(agent);
    }
    spec.message = body.message.unwrap_or(spec.message);
    spec.overlap = body.overlap.map_or(spec.overlap, Overlap::from);
    spec.catch_up = body.catch_up.map_or(spec.catch_up, CatchUp::from);
    let resumes = schedule.spec.paused && body.paused == Some(false);
    spec.paused = body.paused.unwrap_or(spec.paused);
    let next_fire_at = if new_cadence || resumes {
        Some(next_fire(&spec.cadence, now)?)
    } else {
        None
    };
    let (spec, config) = checked(&state, &tenant, &active, spec).await?;
    let change = ScheduleChange {
        spec,
        config,
        next_fire_at,
    };
    let updated = state.coordinator.update_schedule(&id, change).await?;
    Ok(axum::Json(updated.into()))
}

#[utoipa::path(
    delete, path = "/v1/schedules/{id}", tag = "schedules",
    params(("id" = ScheduleIdSchema, Path, description = "The schedule's id")),
    responses(
        (status = 204, description = "Deleted: it fires no more; the runs it fired stay"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn delete_schedule(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    let id = parse_schedule_id(&id)?;
    tenant_schedule(&state, &tenant, &id).await?;
    state.coordinator.delete_schedule(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(
    post, path = "/v1/schedules/{id}/pause", tag = "schedules",
    params(("id" = ScheduleIdSchema, Path, description = "The schedule's id")),
    responses(
        (status = 200, body = ScheduleView, description = "Paused (again): it fires nothing by its cadence until resumed"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn pause_schedule(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<ScheduleView>, ApiError> {
    let id = parse_schedule_id(&id)?;
    tenant_schedule(&state, &tenant, &id).await?;
    let paused = state
        .coordinator
        .set_schedule_paused(&id, true, None)
        .await?;
    Ok(axum::Json(paused.into()))
}

#[utoipa::path(
    post, path = "/v1/schedules/{id}/resume", tag = "schedules",
    params(("id" = ScheduleIdSchema, Path, description = "The schedule's id")),
    responses(
        (status = 200, body = ScheduleView, description = "Resumed from its next slot after now: the slots of the pause are not caught up"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn resume_schedule(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<ScheduleView>, ApiError> {
    let id = parse_schedule_id(&id)?;
    let schedule = tenant_schedule(&state, &tenant, &id).await?;
    if !schedule.spec.paused {
        return Ok(axum::Json(schedule.into()));
    }
    let next = next_fire(&schedule.spec.cadence, state.coordinator.now())?;
    let resumed = state
        .coordinator
        .set_schedule_paused(&id, false, Some(next))
        .await?;
    Ok(axum::Json(resumed.into()))
}

#[utoipa::path(
    post, path = "/v1/schedules/{id}/trigger", tag = "schedules",
    params(("id" = ScheduleIdSchema, Path, description = "The schedule's id")),
    responses(
        (status = 202, body = ScheduleRunView, description = "A manual slot at now, decided as a due slot is: fired, skipped by `overlap`, or refused"),
        (status = 409, body = ErrorBody, description = "triggered at this same millisecond already"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn trigger_schedule(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
    request: Option<Extension<RequestMark>>,
) -> Result<(StatusCode, axum::Json<ScheduleRunView>), ApiError> {
    let id = parse_schedule_id(&id)?;
    tenant_schedule(&state, &tenant, &id).await?;
    let fired = (state.coordinator)
        .trigger_schedule(&id, request.map(|r| r.0))
        .await?;
    // A trigger decides exactly one slot, whatever becomes of it.
    let slot = fired
        .slots
        .into_iter()
        .next()
        .expect("a trigger decides one slot");
    Ok((StatusCode::ACCEPTED, axum::Json(slot.into())))
}

/// A page of a schedule's slots starts before this one: `SLOT` or `SLOT.manual`.
fn slot_cursor(cursor: &str) -> Result<SlotCursor, ApiError> {
    let invalid = || ApiError::bad_request(format!("invalid cursor {cursor:?}"));
    let (slot, manual) = match cursor.strip_suffix(".manual") {
        Some(slot) => (slot, true),
        None => (cursor, false),
    };
    Ok(SlotCursor {
        slot: slot.parse().map_err(|_| invalid())?,
        manual,
    })
}

#[utoipa::path(
    get, path = "/v1/schedules/{id}/runs", tag = "schedules",
    params(("id" = ScheduleIdSchema, Path, description = "The schedule's id"), PageQuery),
    responses(
        (status = 200, body = Page<ScheduleRunView>, description = "Every decided slot, newest first: those that fired with their run, and those skipped or refused with `run_id` null and the reason"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn list_schedule_runs(
    State(state): State<AppState>,
    tenant: Tenant,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<PageQuery>,
) -> Result<axum::Json<Page<ScheduleRunView>>, ApiError> {
    let id = parse_schedule_id(&id)?;
    let limit = query.limit()?;
    let before = query.cursor.as_deref().map(slot_cursor).transpose()?;
    tenant_schedule(&state, &tenant, &id).await?;
    let slots = state
        .coordinator
        .store()
        .schedule_slots(&id, before, limit)
        .await?;
    let items = slots.into_iter().map(ScheduleRunView::from).collect();
    Ok(axum::Json(Page::new(
        items,
        limit,
        |s: &ScheduleRunView| {
            if s.manual {
                format!("{}.manual", s.slot)
            } else {
                s.slot.to_string()
            }
        },
    )))
}
