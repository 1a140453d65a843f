//! Wire types: what the API accepts and returns. They are converted from core and store
//! types here, so the API stays stable while the core changes.

use ratchet_core::{
    AgentProfile, AgentState, ApprovalPolicy, Counters, Message, Millis, RunStatus, StepRecord,
    ToolSpec,
};
use ratchet_core::{DeliveryStatus, InboxStatus};
use ratchet_store::{Approval, RunSummary, Session, StoredEvent, StoredMessage, TreeNode};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use utoipa::ToSchema;

use crate::schemas::{
    ApprovalIdSchema, ApprovalStatusSchema, DeliveryStatusSchema, InboxStatusSchema,
    MessageIdSchema, RunIdSchema, RunStatusSchema, SessionIdSchema, SessionStatusSchema,
};

/// Largest request body accepted, in bytes.
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Default and largest page of every listing.
pub const DEFAULT_PAGE: u32 = 50;
pub const MAX_PAGE: u32 = 200;

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable machine-readable code: `bad_request`, `invalid_request`, `unauthorized`,
    /// `not_found`, `conflict`, `payload_too_large`, `unsupported_media_type`,
    /// `quota_exceeded`, `unavailable`, `internal`.
    pub code: String,
    pub message: String,
    /// Every problem found, when one request can have several (a rejected reload); absent
    /// otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
}

/// Every listing: a page of items and the cursor of the next page (null on the last).
#[derive(Debug, Serialize, ToSchema)]
pub struct Page<T> {
    pub items: Vec<T>,
    /// An opaque cursor: pass it as `cursor` for the next page, unchanged. Null on the last
    /// page.
    pub next_cursor: Option<String>,
}

impl<T> Page<T> {
    /// A full page may have a successor; its cursor is the last item's.
    pub fn new(items: Vec<T>, limit: u32, cursor_of: impl Fn(&T) -> String) -> Page<T> {
        let last = items.last().map(cursor_of);
        Page::with_last_cursor(items, limit, last)
    }

    /// `last` is the cursor of the last item, for items that do not carry their own.
    pub fn with_last_cursor(items: Vec<T>, limit: u32, last: Option<String>) -> Page<T> {
        let next_cursor = last.filter(|_| items.len() as u32 == limit);
        Page { items, next_cursor }
    }
}

#[derive(Debug, Deserialize, ToSchema, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct PageQuery {
    /// An opaque cursor the server issued: the `next_cursor` of the previous page, unchanged.
    #[param(min_length = 1)]
    pub cursor: Option<String>,
    /// Items per page, 1–200 (default 50).
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<u32>,
}

impl PageQuery {
    pub fn limit(&self) -> Result<u32, crate::ApiError> {
        page_limit(self.limit)
    }
}

/// `GET /v1/sessions/{id}/inbox`: a page of a session's inbox, in id order.
#[derive(Debug, Deserialize, ToSchema, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct InboxQuery {
    /// An opaque cursor the server issued: the `next_cursor` of the previous page, unchanged.
    #[param(min_length = 1)]
    pub cursor: Option<String>,
    /// Items per page, 1–200 (default 50).
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<u32>,
    /// Only events in this status (`dead_letter` lists the dead letters).
    #[param(value_type = Option<InboxStatusSchema>)]
    pub status: Option<String>,
}

impl InboxQuery {
    /// The id the page starts after (0 for the first page), its size, and the status asked for.
    pub fn checked(&self) -> Result<(i64, u32, Option<InboxStatus>), crate::ApiError> {
        let status = status_named(self.status.as_deref(), "inbox", &InboxStatus::ALL, |s| {
            s.as_str()
        })?;
        let after = crate::routes::numeric_cursor(self.cursor.as_deref())?;
        Ok((after, page_limit(self.limit)?, status))
    }
}

/// `GET /v1/webhooks/{id}/deliveries`: a page of a webhook's delivery log, in id order.
#[derive(Debug, Deserialize, ToSchema, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct DeliveriesQuery {
    /// An opaque cursor the server issued: the `next_cursor` of the previous page, unchanged.
    #[param(min_length = 1)]
    pub cursor: Option<String>,
    /// Items per page, 1–200 (default 50).
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<u32>,
    /// Only deliveries in this status (`dead_letter` lists the dead letters).
    #[param(value_type = Option<DeliveryStatusSchema>)]
    pub status: Option<String>,
}

impl DeliveriesQuery {
    /// The id the page starts after (0 for the first page), its size, and the status asked for.
    pub fn checked(&self) -> Result<(i64, u32, Option<DeliveryStatus>), crate::ApiError> {
        let status = status_named(
            self.status.as_deref(),
            "delivery",
            &DeliveryStatus::ALL,
            |s| s.as_str(),
        )?;
        let after = crate::routes::numeric_cursor(self.cursor.as_deref())?;
        Ok((after, page_limit(self.limit)?, status))
    }
}

/// The status of `all` that `name_of` names `text`; `what` names the statuses in errors.
fn status_named<T: Copy>(
    text: Option<&str>,
    what: &str,
    all: &[T],
    name_of: impl Fn(T) -> &'static str,
) -> Result<Option<T>, crate::ApiError> {
    let Some(text) = text else {
        return Ok(None);
    };
    let found = all.iter().copied().find(|status| name_of(*status) == text);
    found.map(Some).ok_or_else(|| {
        let known: Vec<&str> = all.iter().map(|s| name_of(*s)).collect();
        crate::ApiError::bad_request(format!(
            "unknown {what} status {text:?}; expected one of {}",
            known.join(", ")
        ))
    })
}

/// `GET /v1/sessions`: a page of the tenant's sessions that match every filter given, in
/// the order asked for.
#[derive(Debug, Deserialize, ToSchema, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct SessionsQuery {
    /// An opaque cursor the server issued: the `next_cursor` of the previous page of the same
    /// order and filters, unchanged.
    #[param(min_length = 1)]
    pub cursor: Option<String>,
    /// Items per page, 1–200 (default 50).
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<u32>,
    /// `oldest` first (the default) or `newest` first (ids are time-ordered), or the latest
    /// `activity` first.
    pub order: Option<SessionOrder>,
    /// What the session is doing: `waiting_human` (its active run waits for a person),
    /// `active` (any other active run), `failed` (no active run; its latest failed), `idle`
    /// (no active run; its latest did not fail, or it has none) or `archived`.
    pub status: Option<SessionStatusFilter>,
    /// Sessions of this catalog agent; `default` for those of the server's own model.
    #[param(min_length = 1)]
    pub agent: Option<String>,
    /// Created at or after this time (ms since the epoch).
    #[param(minimum = 0)]
    pub created_from: Option<i64>,
    /// Created before this time (ms since the epoch).
    #[param(minimum = 0)]
    pub created_before: Option<i64>,
    /// Text found, in any case, in the session's id, its title or its visible messages: 1–200
    /// characters besides the white space around them.
    #[param(min_length = 1, max_length = 200, pattern = "\\S")]
    pub q: Option<String>,
}

#[derive(Debug, Clone, Copy, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SessionOrder {
    Oldest,
    Newest,
    Activity,
}

#[derive(Debug, Clone, Copy, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SessionStatusFilter {
    WaitingHuman,
    Active,
    Failed,
    Idle,
    Archived,
}

/// `PATCH /v1/sessions/{id}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateSession {
    /// The session's new title: 1–200 characters once the white space around it is trimmed,
    /// not only white space, no control characters.
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = r"^[^\x00-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f][^\x00-\x1f\x7f-\x9f]*$"
    )]
    pub title: String,
}

impl SessionsQuery {
    pub fn limit(&self) -> Result<u32, crate::ApiError> {
        page_limit(self.limit)
    }
}

fn page_limit(limit: Option<u32>) -> Result<u32, crate::ApiError> {
    match limit {
        None => Ok(DEFAULT_PAGE),
        Some(limit @ 1..=MAX_PAGE) => Ok(limit),
        Some(other) => Err(crate::ApiError::bad_request(format!(
            "limit must be between 1 and {MAX_PAGE}, found {other}"
        ))),
    }
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    /// The agent that answers in this session: the id of an agent of the catalog
    /// (`GET /v1/agents`), or `default` (the same as leaving it out) for the server's own run
    /// configuration. Its runs are frozen with that agent's configuration.
    pub agent: Option<String>,
    /// Free-form JSON object kept with the session.
    pub metadata: Option<serde_json::Map<String, Value>>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SessionView {
    #[schema(value_type = SessionIdSchema)]
    pub id: String,
    pub created_at: Millis,
    pub agent: Option<String>,
    pub metadata: Option<Value>,
    /// The run currently holding the session, if any.
    #[schema(value_type = Option<RunIdSchema>)]
    pub active_run_id: Option<String>,
    /// When the session was archived: it takes no more messages.
    pub archived_at: Option<Millis>,
    /// `archived`, the active run's status (`running`, `waiting_human`, …), or `idle`.
    #[schema(value_type = SessionStatusSchema)]
    pub status: String,
    /// When the session's latest event was written (its creation, before any).
    pub last_activity_at: Millis,
    /// Its first message's first line until someone renames it (`PATCH`); null before any.
    pub title: Option<String>,
    /// How its latest run stands (`completed`, `failed`, …); null before any.
    pub last_run_status: Option<String>,
    /// For a delegated run's session: the session of the run that delegated it. Such a
    /// session is read-only: messages go to its root session.
    #[schema(value_type = Option<SessionIdSchema>)]
    pub parent_session_id: Option<String>,
}

impl From<Session> for SessionView {
    fn from(session: Session) -> SessionView {
        SessionView {
            id: session.id.to_string(),
            created_at: session.created_at,
            agent: session.agent,
            metadata: session.metadata,
            active_run_id: session.active_run_id.map(|r| r.to_string()),
            archived_at: session.archived_at,
            status: match (session.archived_at, session.active_run_status) {
                (Some(_), _) => "archived".to_owned(),
                (None, Some(status)) => status.as_str().to_owned(),
                (None, None) => "idle".to_owned(),
            },
            last_activity_at: session.last_activity_at,
            title: session.title,
            last_run_status: session.last_run_status.map(|s| s.as_str().to_owned()),
            parent_session_id: session.parent_session_id.map(|s| s.to_string()),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Multitask {
    /// Queue behind the session's active run (the default).
    #[default]
    Enqueue,
    /// Answer 409 while the session has an active run.
    Reject,
    /// Cancel the active run; this message's run starts as soon as it has ended.
    Interrupt,
    /// Join the active run before its next model call; if that run ends first, the message
    /// becomes the session's next run (announced by `run.created` with its `message_id`).
    Steer,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SendMessage {
    /// The message; it must have some text besides white space.
    #[schema(pattern = "\\S")]
    pub content: String,
    pub multitask: Option<Multitask>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct MessageAccepted {
    #[schema(value_type = MessageIdSchema)]
    pub message_id: String,
    /// The message's run; for a steering message, the active run it will join.
    #[schema(value_type = RunIdSchema)]
    pub run_id: String,
    /// `running` when the run started at once, `queued` behind the session's active run (for
    /// a steering message, the active run's status).
    pub run_status: String,
    /// True when the message waits to join the active run (`multitask: "steer"`).
    pub steered: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct MessageView {
    #[schema(value_type = MessageIdSchema)]
    pub id: String,
    #[schema(value_type = RunIdSchema)]
    pub run_id: String,
    /// `user`, `assistant` or `tool`.
    pub role: String,
    pub content: String,
    /// `user`, `agent`, `continuation` or `steer`.
    pub origin: String,
    /// Always `visible`: hidden messages are never listed.
    pub visibility: String,
    #[schema(value_type = Vec<Object>)]
    pub tool_calls: Vec<Value>,
    pub tool_call_id: Option<String>,
    pub created_at: Millis,
}

fn name_of(value: &impl Serialize) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

impl From<StoredMessage> for MessageView {
    fn from(stored: StoredMessage) -> MessageView {
        let message = ModelMessageView::from(stored.message);
        MessageView {
            id: stored.id,
            run_id: stored.run_id.to_string(),
            role: message.role,
            content: message.content,
            origin: message.origin,
            visibility: message.visibility,
            tool_calls: message.tool_calls,
            tool_call_id: message.tool_call_id,
            created_at: stored.created_at,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct UsageView {
    pub model_calls: u64,
    pub tool_calls: u64,
    pub input_tokens: u64,
    /// Generated tokens, reasoning included.
    pub output_tokens: u64,
    pub reasoning_tokens: u64,
    /// The part of `input_tokens` written to the provider's prompt cache.
    pub cache_write_tokens: u64,
    /// The part of `input_tokens` read from the provider's prompt cache.
    pub cache_read_tokens: u64,
    /// In US dollars, from the prices of the run's model profile; absent without prices.
    pub cost_usd: Option<f64>,
}

impl UsageView {
    fn of(counters: &Counters, priced: bool) -> UsageView {
        UsageView {
            model_calls: counters.model_calls,
            tool_calls: counters.tool_calls,
            input_tokens: counters.input_tokens,
            output_tokens: counters.output_tokens,
            reasoning_tokens: counters.reasoning_tokens,
            cache_write_tokens: counters.cache_write_tokens,
            cache_read_tokens: counters.cache_read_tokens,
            cost_usd: priced.then(|| counters.cost_microusd as f64 / 1e6),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RunView {
    #[schema(value_type = RunIdSchema)]
    pub id: String,
    #[schema(value_type = SessionIdSchema)]
    pub session_id: String,
    /// `queued`, `running`, `waiting_human`, `waiting_children`, `waiting_timer`, `paused`,
    /// `cancelling`, `completed`, `failed` or `cancelled`.
    #[schema(value_type = RunStatusSchema)]
    pub status: String,
    pub stop_reason: Option<String>,
    /// A pause was asked for while a step was in flight: the run pauses when that step ends.
    pub pause_requested: bool,
    /// Completions refused because a criterion of the run's agent was unmet.
    pub completion_refusals: u32,
    /// What blocked the last refused completion (`{"kind", …}` each); empty once met.
    #[schema(value_type = Vec<Object>)]
    pub completion_blockers: Vec<Value>,
    /// The last committed step (steps are numbered from 1).
    pub step_index: u64,
    pub usage: UsageView,
    /// What the run waits on a human for, if anything.
    #[schema(value_type = Option<Object>)]
    pub pending_human: Option<Value>,
    /// The `wait` call the run is parked on (`waiting_timer`, or paused while it waited).
    pub wait: Option<WaitView>,
    /// `never` calls cut off when the run ended (its deadline, a cancel): nobody knows whether
    /// they took effect. `POST /v1/runs/{id}/reconcile` records what happened to each
    /// (`succeeded`, `failed` or `skip`; the run stays ended).
    #[schema(value_type = Vec<Object>)]
    pub in_doubt: Vec<Value>,
    /// The run's answer, once it has completed.
    pub final_answer: Option<String>,
    /// Each budget the run has (`steps` always; the others when set), with what it used of
    /// it, extensions given by `continue` included: which one ran out, and by how much.
    pub budgets: Vec<BudgetView>,
    pub created_at: Millis,
    pub started_at: Option<Millis>,
    pub finished_at: Option<Millis>,
    /// The catalog agent the run was started from: its id and the SHA-256 of its definition
    /// file as it was then.
    pub agent: Option<RunAgentView>,
    /// The run that delegated this one, for a child run.
    #[schema(value_type = Option<RunIdSchema>)]
    pub parent_run_id: Option<String>,
    /// The run and step this run was forked from, for a fork.
    pub forked_from: Option<ForkedFromView>,
    /// The schedule that fired the run and the slot it fired for; null for a run a message or
    /// a delegation started.
    pub schedule: Option<RunScheduleView>,
}

/// Where a fork came from: its source run and the step of it the fork continues from.
#[derive(Debug, Serialize, ToSchema)]
pub struct ForkedFromView {
    #[schema(value_type = RunIdSchema)]
    pub run_id: String,
    pub step: u64,
}

impl From<ratchet_core::ForkedFrom> for ForkedFromView {
    fn from(from: ratchet_core::ForkedFrom) -> ForkedFromView {
        ForkedFromView {
            run_id: from.run_id.to_string(),
            step: from.step,
        }
    }
}

/// `POST /v1/runs/{id}/fork`: a new session whose history is the run's as step `at_step`
/// left it, and a run in it that continues from there.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// The committed step of the run to fork at (steps are numbered from 1).
    pub at_step: u64,
    /// What the fork changes before its first model call.
    pub edit: Option<ForkEditRequest>,
    /// The catalog agent the fork runs as; without it, the run's own frozen configuration.
    pub agent: Option<String>,
}

/// One edit: `{"replace_user_message": "text"}` or `{"replace_tool_result": {"call_id", "result"}}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum ForkEditRequest {
    /// The last user message at or before the step says this instead; what answered the old
    /// text is left out, and the fork calls the model first.
    ReplaceUserMessage(String),
    /// The call returned this instead (a string as it is, any other JSON as its text); the
    /// fork's history ends with that call's batch, and the model is called next.
    ReplaceToolResult(ReplaceToolResult),
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplaceToolResult {
    /// A call of the batch pending at the step, or of one answered at or before it.
    pub call_id: String,
    pub result: Value,
}

/// A fork, created: its new session and run.
#[derive(Debug, Serialize, ToSchema)]
pub struct ForkedView {
    #[schema(value_type = SessionIdSchema)]
    pub session_id: String,
    #[schema(value_type = RunIdSchema)]
    pub run_id: String,
    /// `running`, or `waiting_human` when a `never` call the source started has no known
    /// outcome: reconcile it on the fork (`POST /v1/runs/{run_id}/reconcile`).
    #[schema(value_type = RunStatusSchema)]
    pub status: String,
    pub forked_from: ForkedFromView,
}

/// A run's wait on a timer: when it began and when it ends, unless input ended it sooner.
#[derive(Debug, Serialize, ToSchema)]
pub struct WaitView {
    /// The `wait` call the run parked on.
    pub call_id: String,
    /// When the run parked (ms since the epoch).
    pub since: Millis,
    /// When the wait ends (ms since the epoch), frozen when the run parked.
    pub due_at: Millis,
    /// When input for the session ended the wait early; its job is then ready at once.
    pub woken_by_input: Option<Millis>,
}

/// Where a run fired by a schedule came from.
#[derive(Debug, Serialize, ToSchema)]
pub struct RunScheduleView {
    #[schema(value_type = crate::schemas::ScheduleIdSchema)]
    pub schedule_id: String,
    /// When the slot was due (ms since the epoch); for a manual trigger, when it was asked for.
    pub slot: Millis,
    /// Fired by `POST /v1/schedules/{id}/trigger` rather than by the schedule's cadence.
    pub manual: bool,
}

/// One budget of a run and what it used.
#[derive(Debug, Serialize, ToSchema)]
pub struct BudgetView {
    /// `steps`, `model_calls`, `tool_calls`, `tokens` (input and output), `prompt_tokens`
    /// or `duration_ms` (time running, pauses left out).
    #[schema(value_type = String)]
    pub kind: ratchet_core::BudgetKind,
    pub used: u64,
    pub limit: u64,
    /// `used` has reached `limit`.
    pub spent: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RunAgentView {
    pub id: String,
    pub hash: String,
}

impl From<AgentState> for RunView {
    fn from(state: AgentState) -> RunView {
        let budgets = (state.budgets(crate::metrics::now_ms()).into_iter())
            .map(|budget| BudgetView {
                kind: budget.kind,
                used: budget.used,
                limit: budget.limit,
                spent: budget.spent(),
            })
            .collect();
        RunView {
            id: state.run_id.to_string(),
            session_id: state.session_id.to_string(),
            status: state.status.to_string(),
            stop_reason: state.stop_reason.map(|r| r.to_string()),
            pause_requested: state.pause_requested && state.status == RunStatus::Running,
            completion_refusals: state.completion.refused,
            completion_blockers: (state.completion.blockers.iter())
                .filter_map(|b| serde_json::to_value(b).ok())
                .collect(),
            step_index: state.step_index,
            usage: UsageView::of(
                &state.counters,
                (state.config.model_settings.as_ref()).is_some_and(|m| m.prices.is_some()),
            ),
            pending_human: state
                .pending_human
                .and_then(|h| serde_json::to_value(h).ok()),
            wait: state.timer.map(|timer| WaitView {
                call_id: timer.call_id,
                since: timer.since,
                due_at: timer.due_at,
                woken_by_input: timer.woken_by_input,
            }),
            in_doubt: (state.in_doubt.iter())
                .filter_map(|c| serde_json::to_value(c).ok())
                .collect(),
            // Only a completed run has an answer: the text before a cancel or a failure is
            // what the model said on its way, not its answer.
            final_answer: state
                .final_answer
                .filter(|_| state.status == RunStatus::Completed),
            budgets,
            created_at: state.created_at,
            started_at: state.started_at,
            finished_at: state.finished_at,
            agent: state.config.agent.as_ref().map(|a| RunAgentView {
                id: a.id.clone(),
                hash: a.hash.clone(),
            }),
            parent_run_id: state.lineage.map(|l| l.parent_run_id.to_string()),
            forked_from: state.forked_from.map(ForkedFromView::from),
            schedule: state.schedule.map(|s| RunScheduleView {
                schedule_id: s.schedule_id.to_string(),
                slot: s.slot,
                manual: s.manual,
            }),
        }
    }
}

/// An agent of the server's catalog, as a session can name it.
#[derive(Debug, Serialize, ToSchema)]
pub struct AgentView {
    pub id: String,
    pub description: String,
    /// The hash of the definition its runs are frozen from; absent for an agent that was not
    /// read from a catalog file.
    pub hash: Option<String>,
    /// The model spec its runs call.
    pub model: String,
    /// The tools its runs are offered, by name.
    pub tools: Vec<String>,
    /// The agents its runs may delegate to, by id.
    pub delegates: Vec<String>,
    /// Its tools whose calls wait for a person: `{"tool", "policy"}`, the policy `always` or
    /// `{"when_arguments": {argument: glob}}`.
    #[schema(value_type = Vec<Object>)]
    pub approvals: Vec<Value>,
    /// The limits its runs are frozen with (`max_steps`, `max_model_calls`, `max_tokens`,
    /// `max_duration_ms`, …; null for one not set).
    #[schema(value_type = Object)]
    pub limits: Value,
}

impl From<&AgentProfile> for AgentView {
    fn from(profile: &AgentProfile) -> AgentView {
        let config = &profile.config;
        AgentView {
            id: profile.id.clone(),
            description: profile.description.clone(),
            hash: config.agent.as_ref().map(|a| a.hash.clone()),
            model: config.model.clone(),
            tools: config.tools.iter().map(|t| t.name.clone()).collect(),
            delegates: config
                .delegation
                .agents
                .iter()
                .map(|a| a.id.clone())
                .collect(),
            approvals: (config.tools.iter())
                .filter(|t| t.approval != ApprovalPolicy::Never)
                .map(|t| json!({"tool": t.name, "policy": t.approval}))
                .collect(),
            limits: serde_json::to_value(config.limits).unwrap_or(Value::Null),
        }
    }
}

/// A run and every run below it: the children its delegations started, theirs, and so on.
#[derive(Debug, Serialize, ToSchema)]
pub struct RunTreeView {
    /// The run asked about: the first node.
    #[schema(value_type = RunIdSchema)]
    pub run_id: String,
    /// Parents before their children, each level in creation order.
    pub nodes: Vec<TreeNodeView>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TreeNodeView {
    #[schema(value_type = RunIdSchema)]
    pub run_id: String,
    /// Each delegated run has a session of its own.
    #[schema(value_type = SessionIdSchema)]
    pub session_id: String,
    /// The run whose delegation started it; absent for a run started by a message.
    #[schema(value_type = Option<RunIdSchema>)]
    pub parent_run_id: Option<String>,
    /// The catalog agent it runs, when it was started from one.
    pub agent: Option<String>,
    /// Levels below the run a message started, at the top of its whole tree (0 for that run),
    /// also when the tree is asked about a run further down.
    pub depth: u32,
    /// Started with `mode: "background"`: it reports to the session's inbox.
    pub background: bool,
    #[schema(value_type = RunStatusSchema)]
    pub status: String,
    pub stop_reason: Option<String>,
    /// Its committed steps.
    pub steps: u64,
    /// What this run itself spent (not its children); `cost_usd` is absent until a priced
    /// model call has cost something.
    pub usage: UsageView,
    pub created_at: Millis,
    pub finished_at: Option<Millis>,
}

impl From<TreeNode> for TreeNodeView {
    fn from(node: TreeNode) -> TreeNodeView {
        TreeNodeView {
            run_id: node.run_id.to_string(),
            session_id: node.session_id.to_string(),
            parent_run_id: node.parent_run_id.map(|r| r.to_string()),
            agent: node.agent,
            background: node.background,
            depth: node.depth,
            status: node.status.to_string(),
            stop_reason: node.stop_reason.map(|r| r.to_string()),
            steps: node.step_index,
            usage: UsageView::of(&node.counters, node.counters.cost_microusd > 0),
            created_at: node.created_at,
            finished_at: node.finished_at,
        }
    }
}

/// A run as listed: its state without usage details.
#[derive(Debug, Serialize, ToSchema)]
pub struct RunSummaryView {
    #[schema(value_type = RunIdSchema)]
    pub id: String,
    #[schema(value_type = SessionIdSchema)]
    pub session_id: String,
    #[schema(value_type = RunStatusSchema)]
    pub status: String,
    pub stop_reason: Option<String>,
    pub step_index: u64,
    pub created_at: Millis,
    pub finished_at: Option<Millis>,
    /// The run and step this run was forked from, for a fork.
    pub forked_from: Option<ForkedFromView>,
    /// The schedule that fired the run, and the slot it fired for.
    #[schema(value_type = Option<crate::schemas::ScheduleIdSchema>)]
    pub schedule_id: Option<String>,
    pub slot: Option<Millis>,
}

impl From<RunSummary> for RunSummaryView {
    fn from(run: RunSummary) -> RunSummaryView {
        RunSummaryView {
            id: run.run_id.to_string(),
            session_id: run.session_id.to_string(),
            status: run.status.to_string(),
            stop_reason: run.stop_reason.map(|r| r.to_string()),
            step_index: run.step_index,
            created_at: run.created_at,
            finished_at: run.finished_at,
            forked_from: run.forked_from.map(ForkedFromView::from),
            schedule_id: run.schedule_id.map(|id| id.to_string()),
            slot: run.slot,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct StepView {
    pub index: u64,
    /// `call_llm`, `call_tools_batch` or `finish`.
    pub instruction: String,
    pub started_at: Millis,
    pub finished_at: Millis,
    pub duration_ms: i64,
    #[schema(value_type = Object)]
    pub summary: Value,
}

impl From<StepRecord> for StepView {
    fn from(step: StepRecord) -> StepView {
        StepView {
            index: step.index,
            instruction: step.instruction,
            started_at: step.started_at,
            finished_at: step.finished_at,
            duration_ms: step.finished_at - step.started_at,
            summary: step.summary,
        }
    }
}

/// One committed step, opened up: what it sent to the model and what came back.
#[derive(Debug, Serialize, ToSchema)]
pub struct StepDetailView {
    #[serde(flatten)]
    pub step: StepView,
    /// For a `call_llm` step: the request the model was sent, rebuilt from the run's frozen
    /// configuration and the session's history as it stood before the step's commit.
    pub model_call: Option<ModelCallView>,
    /// What the step's commit wrote to the session's history: a model call's reply, a batch's
    /// results, a compaction's summary, the reports it handed on. Hidden ones included.
    pub written: Vec<ModelMessageView>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ModelCallView {
    /// The model spec the run calls (`provider:model` or a profile name).
    pub model: String,
    pub system_prompt: String,
    /// The tools offered; none when the step asked for a final answer (`conclude`).
    pub tools: Vec<OfferedToolView>,
    /// The messages in the order sent, as the model saw them: the latest compaction summary
    /// first, long tool results cut to the run's limit, a call left without a result answered.
    pub messages: Vec<ModelMessageView>,
    /// The model's reply as the step committed it; its usage and cost are in the step's
    /// `summary`. Absent when the call failed.
    pub reply: Option<ModelMessageView>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct OfferedToolView {
    pub name: String,
    pub description: String,
    /// The JSON Schema of its arguments.
    #[schema(value_type = Object)]
    pub parameters: Value,
}

impl From<&ToolSpec> for OfferedToolView {
    fn from(tool: &ToolSpec) -> OfferedToolView {
        OfferedToolView {
            name: tool.name.clone(),
            description: tool.description.clone(),
            parameters: tool.parameters.clone(),
        }
    }
}

/// A message as a model reads it.
#[derive(Debug, Serialize, ToSchema)]
pub struct ModelMessageView {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    pub content: String,
    /// `user`, `agent`, `continuation`, `steer` or `summary`.
    pub origin: String,
    /// `visible`, or `hidden` for what only the model reads.
    pub visibility: String,
    #[schema(value_type = Vec<Object>)]
    pub tool_calls: Vec<Value>,
    pub tool_call_id: Option<String>,
    /// A tool result whose call failed.
    pub is_error: bool,
}

impl From<Message> for ModelMessageView {
    fn from(message: Message) -> ModelMessageView {
        ModelMessageView {
            role: name_of(&message.role),
            origin: name_of(&message.origin),
            visibility: name_of(&message.visibility),
            tool_calls: (message.tool_calls.iter())
                .filter_map(|c| serde_json::to_value(c).ok())
                .collect(),
            tool_call_id: message.tool_call_id,
            is_error: message.is_error,
            content: message.content,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CancelView {
    #[schema(value_type = RunIdSchema)]
    pub run_id: String,
    /// `cancelled` when the run ended at once, `cancelling` while its step winds down, or the
    /// terminal status it already had.
    #[schema(value_type = RunStatusSchema)]
    pub status: String,
}

/// The `data` of every server-sent event (its `id` is `seq`, its `event` is `kind`).
#[derive(Debug, Serialize, ToSchema)]
pub struct EventView {
    /// Per-session, gap-free and increasing: resume with `Last-Event-ID` or `?after=`.
    pub seq: i64,
    #[schema(value_type = SessionIdSchema)]
    pub session_id: String,
    #[schema(value_type = Option<RunIdSchema>)]
    pub run_id: Option<String>,
    pub kind: String,
    #[schema(value_type = Object)]
    pub payload: Value,
    pub created_at: Millis,
}

impl From<&StoredEvent> for EventView {
    fn from(event: &StoredEvent) -> EventView {
        EventView {
            seq: event.seq,
            session_id: event.session_id.to_string(),
            run_id: event.run_id.as_ref().map(|r| r.to_string()),
            kind: event.kind.clone(),
            payload: event.payload.clone(),
            created_at: event.created_at,
        }
    }
}

/// One event as an event stream sends it: `id: <seq>`, `event: <kind>`, `data: <EventView>`.
#[derive(Debug, ToSchema)]
pub struct ServerSentEvent {
    /// The event's `seq`: a client that reconnects sends the last one as `Last-Event-ID`.
    pub id: String,
    /// The event's kind.
    pub event: String,
    /// The whole event: an `EventView` as JSON.
    #[schema(schema_with = event_view_json)]
    pub data: String,
}

/// A string that holds an `EventView` in JSON, as OpenAPI 3.1 describes encoded content.
fn event_view_json() -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .content_media_type("application/json")
        .content_schema(Some(utoipa::openapi::Ref::from_schema_name("EventView")))
        .description(Some("The whole event: an `EventView` as JSON."))
        .build()
}

/// The `data` of a live `activity` event: what a step in flight is doing right now
/// (`loading_context`, `calling_model` with `model`, `executing_tools` with `tools`). It is
/// never stored, so it has no `seq` and its server-sent event no `id`: it never moves a
/// client's cursor, and no replay contains it.
#[derive(Debug, Serialize, ToSchema)]
pub struct LiveActivityView {
    #[schema(value_type = SessionIdSchema)]
    pub session_id: String,
    #[schema(value_type = RunIdSchema)]
    pub run_id: String,
    /// Always `activity`.
    pub kind: &'static str,
    /// Always `true`: tells it from stored events, which have a `seq`.
    pub live: bool,
    #[schema(value_type = Object)]
    pub payload: Value,
    pub created_at: Millis,
}

impl From<&ratchet_engine::LiveActivity> for LiveActivityView {
    fn from(activity: &ratchet_engine::LiveActivity) -> LiveActivityView {
        LiveActivityView {
            session_id: activity.session_id.to_string(),
            run_id: activity.run_id.to_string(),
            kind: "activity",
            live: true,
            payload: activity.payload.clone(),
            created_at: activity.at,
        }
    }
}

/// The `data` of a tree stream's event: the event, with where its run sits in the tree.
#[derive(Debug, Serialize, ToSchema)]
pub struct TreeEventView {
    #[serde(flatten)]
    pub event: EventView,
    /// The run that started this event's run; `null` for the tree's root.
    #[schema(value_type = Option<RunIdSchema>)]
    pub parent_run_id: Option<String>,
    /// Levels below the run a message started (0).
    pub depth: u32,
}

impl TreeEventView {
    pub(crate) fn new(event: EventView, place: crate::feed::Place) -> TreeEventView {
        TreeEventView {
            event,
            parent_run_id: place.parent_run_id.map(|run| run.to_string()),
            depth: place.depth,
        }
    }
}

/// The `data` of a tree stream's live `activity` event, with where its run sits in the tree.
#[derive(Debug, Serialize, ToSchema)]
pub struct TreeActivityView {
    #[serde(flatten)]
    pub activity: LiveActivityView,
    #[schema(value_type = Option<RunIdSchema>)]
    pub parent_run_id: Option<String>,
    pub depth: u32,
}

impl TreeActivityView {
    pub(crate) fn new(activity: LiveActivityView, place: crate::feed::Place) -> TreeActivityView {
        TreeActivityView {
            activity,
            parent_run_id: place.parent_run_id.map(|run| run.to_string()),
            depth: place.depth,
        }
    }
}

/// One event as a tree stream sends it: `id: <cursor>`, `event: <kind>`,
/// `data: <TreeEventView>`.
#[derive(Debug, ToSchema)]
pub struct ServerSentTreeEvent {
    /// The stream's cursor after this event, `SESSION:SEQ` pairs joined by commas: a client
    /// that reconnects sends the last one as `Last-Event-ID`.
    pub id: String,
    /// The event's kind.
    pub event: String,
    /// The whole event: a `TreeEventView` as JSON.
    #[schema(schema_with = tree_event_view_json)]
    pub data: String,
}

impl ServerSentTreeEvent {
    pub(crate) fn new(
        event: &StoredEvent,
        place: crate::feed::Place,
        cursor: String,
    ) -> ServerSentTreeEvent {
        let view = TreeEventView::new(EventView::from(event), place);
        ServerSentTreeEvent {
            id: cursor,
            event: event.kind.clone(),
            data: serde_json::to_string(&view).unwrap_or_default(),
        }
    }
}

/// A string that holds a `TreeEventView` in JSON.
fn tree_event_view_json() -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .content_media_type("application/json")
        .content_schema(Some(utoipa::openapi::Ref::from_schema_name(
            "TreeEventView",
        )))
        .description(Some("The whole event: a `TreeEventView` as JSON."))
        .build()
}

impl From<&StoredEvent> for ServerSentEvent {
    fn from(event: &StoredEvent) -> ServerSentEvent {
        ServerSentEvent {
            id: event.seq.to_string(),
            event: event.kind.clone(),
            data: serde_json::to_string(&EventView::from(event)).unwrap_or_default(),
        }
    }
}

/// A human's answer for a call whose outcome is unknown after a crash.
#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReconcileOutcome {
    /// It took effect; `result` becomes its outcome.
    Succeeded,
    /// It did not take effect; the model sees an error.
    Failed,
    /// Run it again.
    Retry,
    /// Do not run it; the model is told it was skipped.
    Skip,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReconcileRequest {
    pub call_id: String,
    pub outcome: ReconcileOutcome,
    /// What the call produced, for `succeeded` or `failed`.
    pub result: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ReconcileView {
    #[schema(value_type = RunIdSchema)]
    pub run_id: String,
    /// `running` once every call in doubt is answered; `waiting_human` before. A call left in
    /// doubt by an ended run is recorded and the run keeps its terminal status.
    #[schema(value_type = RunStatusSchema)]
    pub status: String,
}

/// A gated tool batch: no call of it runs until a human answers.
#[derive(Debug, Serialize, ToSchema)]
pub struct ApprovalView {
    #[schema(value_type = ApprovalIdSchema)]
    pub id: String,
    #[schema(value_type = RunIdSchema)]
    pub run_id: String,
    #[schema(value_type = SessionIdSchema)]
    pub session_id: String,
    /// `pending`, `decided`, `aborted`, or `cancelled` (its run ended unanswered).
    #[schema(value_type = ApprovalStatusSchema)]
    pub status: String,
    /// Every call of the batch, in the model's order.
    pub calls: Vec<ApprovalCallView>,
    pub created_at: Millis,
    pub decided_at: Option<Millis>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ApprovalCallView {
    pub call_id: String,
    /// The tool's name.
    pub name: String,
    #[schema(value_type = Object)]
    pub arguments: Value,
    /// False for a call held only because another call of its batch needs approval.
    pub needs_approval: bool,
    /// `approve` or `deny` once decided (a call left out of a decision is approved).
    pub decision: Option<String>,
    pub note: Option<String>,
}

impl From<Approval> for ApprovalView {
    fn from(approval: Approval) -> ApprovalView {
        use ratchet_core::{ApprovalAnswer, Verdict};
        let decided = |call_id: &str| match &approval.answer {
            Some(ApprovalAnswer::Decisions(decisions)) => {
                let given = decisions.iter().find(|d| d.call_id == call_id);
                let verdict = given.map_or(Verdict::Approve, |d| d.decision);
                let name = match verdict {
                    Verdict::Approve => "approve",
                    Verdict::Deny => "deny",
                };
                (Some(name.to_owned()), given.and_then(|d| d.note.clone()))
            }
            Some(ApprovalAnswer::Abort) | None => (None, None),
        };
        let calls = approval
            .calls
            .iter()
            .map(|call| {
                let (decision, note) = decided(&call.call_id);
                ApprovalCallView {
                    call_id: call.call_id.clone(),
                    name: call.tool.clone(),
                    arguments: call.arguments.clone(),
                    needs_approval: call.needs_approval,
                    decision,
                    note,
                }
            })
            .collect();
        ApprovalView {
            id: approval.id.to_string(),
            run_id: approval.run_id.to_string(),
            session_id: approval.session_id.to_string(),
            status: approval.status.as_str().to_owned(),
            calls,
            created_at: approval.created_at,
            decided_at: approval.decided_at,
        }
    }
}

#[derive(Debug, Deserialize, ToSchema, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ApprovalsQuery {
    /// Only approvals with this status.
    #[param(value_type = Option<ApprovalStatusSchema>)]
    pub status: Option<String>,
    /// An opaque cursor the server issued: the `next_cursor` of the previous page, unchanged.
    #[param(min_length = 1)]
    pub cursor: Option<String>,
    /// Items per page, 1–200 (default 50).
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<u32>,
}

#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DecisionBody {
    Approve,
    Deny,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CallDecisionBody {
    pub call_id: String,
    pub decision: DecisionBody,
    /// Shown to the model with a denied call's result.
    pub note: Option<String>,
}

/// Either `decisions` (every call that needs approval, once) or `"abort": true`, which ends
/// the run as cancelled by a human.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalRequestBody {
    pub decisions: Option<Vec<CallDecisionBody>>,
    pub abort: Option<bool>,
}

/// Written by hand: the derive would make both fields optional, and `{}` (or both given) is
/// refused. One of two shapes, exactly as `answer_approval` reads the body.
impl utoipa::PartialSchema for ApprovalRequestBody {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        let decisions = json!({
            "type": "array",
            "items": {"$ref": "#/components/schemas/CallDecisionBody"},
            "description": "One decision per call that needs approval; a call left out is approved.",
        });
        let schema = json!({
            "description": "Either `decisions` (every call that needs approval, once) or \
                            `\"abort\": true`, which ends the run as cancelled by a human.",
            "oneOf": [
                {
                    "type": "object",
                    "title": "Decisions",
                    "required": ["decisions"],
                    "properties": {
                        "decisions": decisions,
                        "abort": {"type": ["boolean", "null"], "enum": [false, null]},
                    },
                    "additionalProperties": false,
                },
                {
                    "type": "object",
                    "title": "Abort",
                    "required": ["abort"],
                    "properties": {
                        "abort": {"type": "boolean", "enum": [true]},
                        "decisions": {"type": "null"},
                    },
                    "additionalProperties": false,
                },
            ],
        });
        serde_json::from_value(schema).expect("the approval body's schema is a schema")
    }
}

impl ToSchema for ApprovalRequestBody {
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        use utoipa::PartialSchema;
        schemas.push((
            CallDecisionBody::name().into_owned(),
            CallDecisionBody::schema(),
        ));
        <CallDecisionBody as ToSchema>::schemas(schemas);
    }
}

/// Budget to add when continuing a failed run; each field is added to the run's limit of
/// the same name (a run without such a limit stays without one).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ContinueRequest {
    #[serde(default, deserialize_with = "whole_number")]
    pub extra_steps: Option<u64>,
    #[serde(default, deserialize_with = "whole_number")]
    pub extra_model_calls: Option<u64>,
    #[serde(default, deserialize_with = "whole_number")]
    pub extra_tool_calls: Option<u64>,
    #[serde(default, deserialize_with = "whole_number")]
    pub extra_tokens: Option<u64>,
    #[serde(default, deserialize_with = "whole_number")]
    pub extra_duration_ms: Option<u64>,
}

/// A JSON integer, which JSON Schema lets a client write with a zero fraction (`3.0`) and some
/// clients' numbers always do.
fn whole_number<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<u64>, D::Error> {
    let Some(number) = Option::<serde_json::Number>::deserialize(deserializer)? else {
        return Ok(None);
    };
    let whole = number.as_u64().or_else(|| {
        let float = number.as_f64()?;
        (float.fract() == 0.0 && (0.0..=u64::MAX as f64).contains(&float)).then_some(float as u64)
    });
    whole.map(Some).ok_or_else(|| {
        serde::de::Error::custom(format!("expected a whole number from 0, found {number}"))
    })
}

impl ContinueRequest {
    /// The extension asked for. Each amount is at most `i64::MAX`, as the document says
    /// (`int64`): what every client's JSON numbers can be trusted to hold.
    pub fn extension(&self) -> Result<ratchet_core::BudgetExtension, crate::ApiError> {
        let amount = |name: &str, extra: Option<u64>| match extra {
            Some(extra) if extra > i64::MAX as u64 => Err(crate::ApiError::unprocessable(format!(
                "{name} must be at most {}, found {extra}",
                i64::MAX
            ))),
            extra => Ok(extra.unwrap_or(0)),
        };
        Ok(ratchet_core::BudgetExtension {
            steps: amount("extra_steps", self.extra_steps)?,
            model_calls: amount("extra_model_calls", self.extra_model_calls)?,
            tool_calls: amount("extra_tool_calls", self.extra_tool_calls)?,
            tokens: amount("extra_tokens", self.extra_tokens)?,
            duration_ms: amount("extra_duration_ms", self.extra_duration_ms)?,
        })
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ResumedView {
    #[schema(value_type = RunIdSchema)]
    pub run_id: String,
    /// `running`: the run's next step is enqueued (or, for a pause not reached yet, the run
    /// simply goes on).
    pub status: String,
}

impl ResumedView {
    /// The answer to a continue or retry that went through.
    pub fn running(run_id: &ratchet_core::RunId) -> ResumedView {
        ResumedView {
            run_id: run_id.to_string(),
            status: RunStatus::Running.to_string(),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PauseView {
    #[schema(value_type = RunIdSchema)]
    pub run_id: String,
    /// `paused` when the run stopped at once (or was paused already), `pausing` while the
    /// step in flight finishes: its commit pauses the run.
    pub status: String,
}
