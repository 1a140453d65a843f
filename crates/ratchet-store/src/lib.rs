//! The storage port of the state plane: the one contract every backend (SQLite, PostgreSQL)
//! implements; `ratchet-store-conformance` is the suite they all must pass.
//!
//! Every method that writes is one transaction. The store never decides what a run does
//! next: decisions come from `ratchet-core`, and the store only checks the fences (step
//! index, status edge, lease epoch) and writes atomically.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use ratchet_core::fork::SourceMessage;
use ratchet_core::step::Reconciliation;
use ratchet_core::step::{DecisionError, Resumption};
use ratchet_core::{
    AgentState, ApprovalAnswer, ApprovalCall, ApprovalId, Counters, Delivery, EventDraft, ForkEdit,
    ForkedFrom, IllegalEdge, InboxKind, InboxStatus, Message, MessageId, Millis, Role,
    RunConfigSnapshot, RunId, RunStatus, ScheduleId, SessionId, StepJob, StepRecord, StepResult,
    StopReason, ToolOutcome, TraceContext, TreeSpend,
};
use serde::Serialize;
use serde_json::Value;

pub mod requests;
mod schedules;
pub mod secrets;
mod webhooks;

pub use requests::{
    Effect, KeyRecord, KeyedRequest, RequestClaim, RequestKey, RequestMark, StoredResponse,
};
pub use schedules::{
    Cadence, DuePass, FireIds, Fired, NewSchedule, PlannedSlot, Schedule, ScheduleChange,
    ScheduleSlot, ScheduleSpec, SlotCursor, catch_up_reason, overlap_reason,
};
pub use secrets::{Key, Keyring};
pub use webhooks::{
    AttemptOutcome, ClaimedDelivery, Deliveries, DeliveryBounds, DeliveryClaim, NewWebhook,
    Webhook, WebhookAdmin, WebhookDelivery,
};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{kind} {id} not found")]
    NotFound { kind: &'static str, id: String },
    #[error("{0}")]
    Conflict(String),
    /// The request could never succeed as given (for example an answer naming a call that
    /// is not in the approval); nothing was written.
    #[error("{0}")]
    Invalid(String),
    /// The claim no longer holds its step (its lease expired and the job was claimed again,
    /// or the step was committed): the caller must drop the step without effects.
    #[error("the claim on {run_id}#{step_index} was lost")]
    LeaseLost { run_id: RunId, step_index: u64 },
    /// A cancel of the run was accepted: no new effect may start.
    #[error("run {run_id} is being cancelled")]
    CancelRequested { run_id: RunId },
    /// Admitting the run would exceed a run quota; nothing was written.
    #[error("{0}")]
    QuotaExceeded(String),
    /// The steering queue of the session's active run is full; nothing was written.
    #[error("{0}")]
    SteerQueueFull(String),
    #[error("invalid database url {url:?}: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    #[error("database error: {0}")]
    Backend(String),
    /// A webhook secret cannot be sealed or opened: no key, a key this process lacks, a
    /// malformed key, or a sealed secret that was altered.
    #[error("webhook secrets: {0}")]
    Secrets(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<ratchet_core::fork::ForkError> for Error {
    fn from(error: ratchet_core::fork::ForkError) -> Error {
        Error::Invalid(error.to_string())
    }
}

impl From<DecisionError> for Error {
    fn from(error: DecisionError) -> Error {
        match error {
            DecisionError::Invalid(message) => Error::Invalid(message),
            other => Error::Conflict(other.to_string()),
        }
    }
}

/// Who holds a step and until when. `owner` names a worker of a process, so that recovery
/// can tell the leases of dead processes apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub owner: String,
    pub expires_at: Millis,
}

/// Proof of a claim. `epoch` is the fencing token: it changes on every claim of the job, so
/// a commit by an earlier holder is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub run_id: RunId,
    pub step_index: u64,
    pub epoch: i64,
}

/// A claimed job with the state it must run against.
#[derive(Debug, Clone)]
pub struct ClaimedStep {
    pub job: StepJob,
    pub claim: Claim,
    pub state: AgentState,
    /// The model's context — the messages `Reads::context` returns — when the worker's own
    /// commits kept it through a streak; `None` when the step must read it from the store.
    pub context: Option<Vec<Message>>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StoredEvent {
    pub session_id: SessionId,
    pub seq: i64,
    pub run_id: Option<RunId>,
    pub kind: String,
    pub payload: Value,
    pub created_at: Millis,
}

/// The tenant of sessions created without authentication (a server with no tokens, the CLI).
pub const DEFAULT_TENANT: &str = "default";

/// What a new session is created with.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionSpec {
    /// Whose session it is: only requests of this tenant can see it.
    pub tenant: String,
    pub agent: Option<String>,
    pub metadata: Option<Value>,
    /// The keyed request that creates it: recorded with the key in the same transaction.
    pub request: Option<RequestMark>,
}

impl Default for SessionSpec {
    fn default() -> Self {
        SessionSpec {
            tenant: DEFAULT_TENANT.to_owned(),
            agent: None,
            metadata: None,
            request: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Session {
    pub id: SessionId,
    pub tenant: String,
    pub agent: Option<String>,
    pub metadata: Option<Value>,
    pub created_at: Millis,
    /// The session's one non-terminal, non-queued run, if any.
    pub active_run_id: Option<RunId>,
    /// Closed: its runs were cancelled, its inbox emptied, and it takes no more messages.
    pub archived_at: Option<Millis>,
    /// Closed like an archived session, and hidden from its tenant; its records stay.
    pub deleted_at: Option<Millis>,
    /// The status of `active_run_id`'s run, read with the session.
    pub active_run_status: Option<RunStatus>,
    /// When the session's latest event was written (its creation, before any).
    pub last_activity_at: Millis,
    /// What the session is called: its first message's opening words until someone renames
    /// it; None before its first message.
    pub title: Option<String>,
    /// The status of its latest run (how its last turn ended, when none is active).
    pub last_run_status: Option<RunStatus>,
    /// For the session of a delegated run: the session of the run that delegated it.
    pub parent_session_id: Option<SessionId>,
}

/// Which end of the id order a list starts from (ids are time-ordered), or the latest
/// activity first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ListOrder {
    #[default]
    OldestFirst,
    NewestFirst,
    LatestActivityFirst,
}

/// Where a page of sessions starts: after this session, in the query's order (for
/// `LatestActivityFirst`, after this activity time, ties broken by id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionCursor {
    Id(SessionId),
    Activity(Millis, SessionId),
}

/// What a session is doing, as the list filters it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionState {
    /// Its active run waits for a person (an approval, a reconciliation).
    WaitingHuman,
    /// A run of it is active (running, waiting for its children, paused, cancelling).
    Active,
    /// No run is active and its latest run failed.
    Failed,
    /// No run is active, and its latest run did not fail (or it has none).
    Idle,
    Archived,
}

/// Which of a tenant's sessions a list holds, and in what order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionQuery {
    pub order: ListOrder,
    pub after: Option<SessionCursor>,
    pub state: Option<SessionState>,
    /// The catalog agent its runs are of (`Some(None)`: sessions of the server's model).
    pub agent: Option<Option<String>>,
    /// Created at or after, and before, these times.
    pub created_from: Option<Millis>,
    pub created_before: Option<Millis>,
    /// Found in its id, its title or the text of its visible messages (case-insensitive).
    pub text: Option<String>,
}

/// How a session is closed (see `Writes::close_session`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closing {
    Archive,
    Delete,
}

impl Closing {
    pub fn as_str(self) -> &'static str {
        match self {
            Closing::Archive => "archived",
            Closing::Delete => "deleted",
        }
    }
}

/// What closing a session did.
#[derive(Debug, Clone)]
pub struct Closed {
    pub events: Vec<StoredEvent>,
    /// Cancelling the session's runs enqueued jobs (runs winding down, parents joined).
    pub enqueued: bool,
}

/// What an operator does with a dead letter of an inbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadLetterAction {
    /// Back to `pending`: due now, its attempts counted afresh; a continuation turn starts
    /// with it when the session is free.
    Requeue,
    /// Dropped for good (`discarded`, `now` in `updated_at`).
    Discard,
}

impl DeadLetterAction {
    /// The request's name: `requeue` or `discard`.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterAction::Requeue => "requeue",
            DeadLetterAction::Discard => "discard",
        }
    }

    /// The status the action moves a dead letter to.
    pub fn target(self) -> InboxStatus {
        match self {
            DeadLetterAction::Requeue => InboxStatus::Pending,
            DeadLetterAction::Discard => InboxStatus::Discarded,
        }
    }

    /// What was done to an event: `requeued` or `discarded`.
    pub fn verb(self) -> &'static str {
        match self {
            DeadLetterAction::Requeue => "requeued",
            DeadLetterAction::Discard => "discarded",
        }
    }

    /// Whether the action applies to `event` as it stands: true for a dead letter; false for
    /// an event the action was done to already (discarded, or requeued and on its way
    /// since), which it leaves as it is; `Error::Conflict` for any other.
    pub fn applies_to(self, event: &InboxEvent) -> Result<bool> {
        if event.status == InboxStatus::DeadLetter {
            return Ok(true);
        }
        let done = match self {
            DeadLetterAction::Discard => event.status == InboxStatus::Discarded,
            DeadLetterAction::Requeue => {
                event.requeued_at.is_some()
                    && matches!(
                        event.status,
                        InboxStatus::Pending | InboxStatus::Leased | InboxStatus::Consumed
                    )
            }
        };
        if done {
            return Ok(false);
        }
        Err(Error::Conflict(format!(
            "inbox event {} is {}: only a dead letter can be {}",
            event.id,
            event.status.as_str(),
            self.verb()
        )))
    }

    /// The reason the dead letter `event` notes when `by` acts on it, after the one it had.
    pub fn reason(self, by: &str, event: &InboxEvent) -> String {
        format!(
            "{} by {by}, after: {}",
            self.verb(),
            event.reason.as_deref().unwrap_or("no reason recorded")
        )
    }

    /// The refusal of a requeue in the closed `session`.
    pub fn closed(session: &SessionId) -> Error {
        Error::Conflict(format!(
            "session {session} is closed: it starts no continuation, so its dead letters stay"
        ))
    }
}

/// What an operator's requeue or discard of an inbox event did.
#[derive(Debug, Clone)]
pub struct InboxChange {
    /// The event as it stands now.
    pub event: InboxEvent,
    /// What the change published (none when it was a repeat that changed nothing).
    pub events: Vec<StoredEvent>,
    /// A continuation turn started with the requeued event.
    pub enqueued: bool,
}

/// An event of a root session's inbox, as `Reads::inbox` lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InboxEvent {
    pub id: i64,
    pub session_id: SessionId,
    pub kind: InboxKind,
    pub status: InboxStatus,
    pub delivery: Delivery,
    /// The run whose `delegate` call started the work reported on.
    pub parent_run_id: RunId,
    /// The run reported on (a completion's, a signal's); None for a group's.
    pub source_run_id: Option<RunId>,
    pub group: Option<String>,
    /// None while the event is a reservation.
    pub payload: Option<Value>,
    /// Continuation turns that held it so far, and how many may.
    pub attempts: u32,
    pub max_attempts: u32,
    /// When a pending event is due.
    pub available_at: Option<Millis>,
    /// The continuation run holding (or, once consumed, that consumed) it.
    pub lease_run_id: Option<RunId>,
    /// Why it was dead-lettered, superseded or discarded, why its last attempt failed, or who
    /// requeued it.
    pub reason: Option<String>,
    /// When an operator last requeued it from the dead letter.
    pub requeued_at: Option<Millis>,
    /// When it goes to the dead letter if it is still pending untold (None before it is
    /// written, for a reservation).
    pub expires_at: Option<Millis>,
    pub created_at: Millis,
    pub updated_at: Millis,
}

/// Input waiting for a session besides its active run (counts only).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PendingInput {
    /// User messages queued behind the active run.
    pub queued_messages: u64,
    /// Messages waiting to steer the active run.
    pub steers: u64,
    /// Inbox events due (reports of background work, signals).
    pub inbox_events: u64,
    /// When the latest queued message came, and when the latest due inbox event became due.
    #[serde(skip)]
    pub newest_queued_at: Option<Millis>,
    #[serde(skip)]
    pub newest_due_at: Option<Millis>,
}

impl PendingInput {
    pub fn any(&self) -> bool {
        self.queued_messages + self.steers + self.inbox_events > 0
    }

    /// Whether this input ends a wait of a run whose model last looked at the conversation at
    /// `asked_at` (None: not known, any input does): a steer, which the model's next call
    /// takes in, or a queued message or a report that came after it asked. One that came
    /// before reaches the model only after its turn ends: a wait it woke once, telling the
    /// model so, it never wakes again.
    pub fn wakes(&self, asked_at: Option<Millis>) -> bool {
        let Some(asked_at) = asked_at else {
            return self.any();
        };
        let since = |newest: Option<Millis>| newest.is_some_and(|at| at >= asked_at);
        self.steers > 0 || since(self.newest_queued_at) || since(self.newest_due_at)
    }
}

/// A signal a background run's `emit_signal` call sends (see `Writes::emit_signal`).
#[derive(Debug, Clone, PartialEq)]
pub struct NewSignal {
    /// The call's idempotency key: one signal per call, however often its step is redone.
    pub call_key: String,
    pub dedupe_key: String,
    pub payload: Value,
}

/// What became of a signal.
#[derive(Debug, Clone, PartialEq)]
pub enum SignalOutcome {
    /// Sent: the inbox event that carries it.
    Sent(i64),
    /// The same signal went out within the dedupe window (or this call already sent it): the
    /// earlier event stands for it.
    Duplicate(i64),
    /// The contract or the inbox's capacity refuses it; nothing was written.
    Refused(String),
}

#[derive(Debug, Clone)]
pub struct EmittedSignal {
    pub outcome: SignalOutcome,
    pub events: Vec<StoredEvent>,
    /// A continuation turn started with it (the root session was free).
    pub enqueued: bool,
}

/// What `Writes::time_out_overdue` ended.
#[derive(Debug, Clone, Default)]
pub struct TimedOut {
    pub events: Vec<StoredEvent>,
    /// The runs that ended `timed_out`.
    pub ended: Vec<RunId>,
    /// Ending them enqueued jobs (children winding down, parents joined, queued turns).
    pub enqueued: bool,
}

/// What `Writes::serve_inboxes` started.
#[derive(Debug, Clone, Default)]
pub struct Served {
    pub events: Vec<StoredEvent>,
    /// The continuation runs started (their first jobs enqueued).
    pub started: Vec<RunId>,
}

/// A message as stored: its id, run and place in the session (`position`, increasing; the
/// cursor of message listings).
#[derive(Debug, Clone, PartialEq)]
pub struct StoredMessage {
    pub id: String,
    pub run_id: RunId,
    pub position: i64,
    pub message: Message,
    pub created_at: Millis,
}

/// The id of a message step `step_index` of `run_id` writes, `slot` telling its messages
/// apart: named after the step, so that `step_messages` can tell which step wrote it.
pub fn step_message_id(run_id: &RunId, step_index: u64, slot: impl std::fmt::Display) -> String {
    format!("{}{step_index}-{slot}", step_message_prefix(run_id))
}

fn step_message_prefix(run_id: &RunId) -> String {
    let bare = (run_id.as_str().strip_prefix(RunId::PREFIX)).unwrap_or(run_id.as_str());
    format!("msg_{bare}-")
}

/// The step of `run_id` that wrote the message `id`, when a step of that run wrote it.
pub fn message_step(run_id: &RunId, id: &str) -> Option<u64> {
    (id.strip_prefix(&step_message_prefix(run_id)))
        .and_then(|rest| rest.split('-').next())
        .and_then(|step| step.parse::<u64>().ok())
}

/// Splits a run's messages (in history order) for `Reads::step_messages` of step
/// `step_index`: the position the step's context ends at — just before the first message of
/// this step or a later one, or with none, at the run's last message — and the messages the
/// step wrote. None when the run has no messages.
pub fn split_step_messages(
    runs_messages: Vec<StoredMessage>,
    run_id: &RunId,
    step_index: u64,
) -> Option<(i64, Vec<StoredMessage>)> {
    let written_by = |id: &str| message_step(run_id, id);
    let first_from = (runs_messages.iter())
        .position(|m| written_by(&m.id).is_some_and(|step| step >= step_index));
    let through = match first_from {
        Some(first) => runs_messages[first].position - 1,
        None => runs_messages.last()?.position,
    };
    let written = (runs_messages.into_iter())
        .filter(|m| written_by(&m.id) == Some(step_index))
        .collect();
    Some((through, written))
}

/// A step's messages, for inspecting it: see `Reads::step_messages`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepMessages {
    /// What the model was shown at the step, in order.
    pub context: Vec<StoredMessage>,
    /// What the step's commit wrote under the step's name: a model call's reply, a batch's
    /// results, the reports it handed on.
    pub written: Vec<StoredMessage>,
}

/// Which messages a search looks through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SearchScope {
    /// One session's messages.
    Session(SessionId),
    /// The messages of every session of one tenant.
    Tenant(String),
}

/// A message found by `Reads::search_messages`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MessageHit {
    pub session_id: SessionId,
    pub run_id: RunId,
    pub message_id: String,
    pub role: Role,
    /// The message's place in its session, as in `StoredMessage::position`.
    pub position: i64,
    pub created_at: Millis,
    /// The part of the message around the matched words, which are marked `**like this**`.
    pub snippet: String,
    /// Relevance (bm25): lower is better. Comparable only within one answer.
    pub rank: f64,
}

/// A user message that starts (or queues) a run.
#[derive(Debug, Clone)]
pub struct NewRun {
    pub session_id: SessionId,
    pub run_id: RunId,
    pub message_id: MessageId,
    pub content: String,
    pub config: RunConfigSnapshot,
    pub when_busy: WhenBusy,
    /// Refused with `Error::QuotaExceeded` when admitting the run would exceed it.
    pub quota: RunQuota,
    /// The trace the caller's request was part of; the run's spans join it.
    pub trace: Option<TraceContext>,
    /// The keyed request this message came with: its effect is recorded with the key in the
    /// same transaction (refused with `Conflict` when the mark no longer holds the key).
    pub request: Option<RequestMark>,
}

/// A fork of a run at one of its steps (see `Writes::fork_run`).
#[derive(Debug, Clone)]
pub struct NewFork {
    pub source: RunId,
    pub at_step: u64,
    /// The fork's new session and run.
    pub session_id: SessionId,
    pub run_id: RunId,
    /// The configuration the fork is frozen with, and the catalog agent its session names;
    /// None: the source's frozen configuration and its session's agent.
    pub config: Option<(RunConfigSnapshot, Option<String>)>,
    pub edit: Option<ForkEdit>,
    /// Refused with `Error::QuotaExceeded` when admitting the fork would exceed it.
    pub quota: RunQuota,
    /// The keyed request that forks: its effect is recorded with the key in the same
    /// transaction.
    pub request: Option<RequestMark>,
}

/// What `Writes::fork_run` created.
#[derive(Debug, Clone)]
pub struct Forked {
    pub session: Session,
    /// `running` (its first job enqueued) or `waiting_human` (a call in doubt to reconcile).
    pub status: RunStatus,
    pub events: Vec<StoredEvent>,
}

/// A session's messages in order, each with the step of `run_id` that wrote it, as
/// `ratchet_core::fork` reads a source's history.
pub fn source_messages(messages: Vec<StoredMessage>, run_id: &RunId) -> Vec<(i64, SourceMessage)> {
    (messages.into_iter())
        .map(|m| {
            let step = (m.run_id == *run_id)
                .then(|| message_step(run_id, &m.id))
                .flatten();
            (
                m.position,
                SourceMessage {
                    message: m.message,
                    step,
                },
            )
        })
        .collect()
}

/// The steps whose intents hold what the source did of the batch its step `batch_step` asked
/// for: from the next step to the first later one that wrote messages (the step that ran the
/// batch to its end), or to the step in flight (`committed + 1`) when none has yet.
pub fn batch_steps(
    messages: &[(i64, SourceMessage)],
    batch_step: u64,
    committed: u64,
) -> std::ops::RangeInclusive<u64> {
    let ran = (messages.iter())
        .filter_map(|(_, m)| m.step)
        .filter(|&step| step > batch_step)
        .min();
    (batch_step + 1)..=ran.unwrap_or(committed + 1)
}

/// What a source recorded of a batch's tool calls by slot, from its intents in step order: the
/// last attempt's outcome, or None for a call started without one.
pub fn batch_started(
    intents: impl IntoIterator<Item = IntentRecord>,
) -> HashMap<u32, Option<ToolOutcome>> {
    (intents.into_iter())
        .filter(|intent| intent.kind == IntentKind::Tool)
        .map(|intent| (intent.slot, intent.outcome))
        .collect()
}

/// Limits on non-terminal runs (queued, running, waiting, cancelling). A session's count
/// includes the runs of its delegations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunQuota {
    pub global: Option<u64>,
    pub per_session: Option<u64>,
}

impl RunQuota {
    /// Refuses to admit `adding` more runs to `root_session` beyond the quota, with
    /// `Error::QuotaExceeded`. Each count is read only when its limit is set: `in_session`
    /// counts the session's unfinished runs (its delegations' included), `global` the
    /// store's.
    pub fn check(
        self,
        root_session: &SessionId,
        adding: u64,
        in_session: impl FnOnce() -> Result<u64>,
        global: impl FnOnce() -> Result<u64>,
    ) -> Result<()> {
        if let Some(max) = self.per_session {
            let active = in_session()?;
            if active.saturating_add(adding) > max {
                return Err(Error::QuotaExceeded(format!(
                    "session {root_session} has {active} unfinished runs and may have at most {max}; {adding} more do not fit — wait for some to end"
                )));
            }
        }
        if let Some(max) = self.global {
            let active = global()?;
            if active.saturating_add(adding) > max {
                return Err(Error::QuotaExceeded(format!(
                    "{active} runs are unfinished and at most {max} may be; {adding} more do not fit — wait for some to end"
                )));
            }
        }
        Ok(())
    }
}

/// Counts a delegation is admitted against.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Admission {
    /// Non-terminal runs in the whole database.
    pub active_global: u64,
    /// Non-terminal runs of the run's root session, its delegations included.
    pub active_in_session: u64,
    /// Runs of the run's tree, ended ones included.
    pub tree_runs: u64,
    /// Events and reservations the root session's inbox holds.
    pub inbox_held: u64,
}

/// One run of a tree, as `Reads::run_tree` lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TreeNode {
    pub run_id: RunId,
    pub session_id: SessionId,
    pub parent_run_id: Option<RunId>,
    /// The catalog agent it runs, when it was started from one.
    pub agent: Option<String>,
    pub depth: u32,
    /// Started in the background: it reports to the root session's inbox.
    pub background: bool,
    pub status: RunStatus,
    pub stop_reason: Option<StopReason>,
    pub step_index: u64,
    pub created_at: Millis,
    pub finished_at: Option<Millis>,
    /// What it has spent so far: calls, tokens, cost.
    pub counters: Counters,
}

/// The nodes of a tree that are `run_id` or lie below it, as `Reads::run_tree` lists them:
/// parents before their children, each level in creation order.
pub fn subtree(mut nodes: Vec<TreeNode>, run_id: &RunId) -> Vec<TreeNode> {
    nodes.sort_by(|a, b| {
        (a.depth, a.created_at, &a.run_id).cmp(&(b.depth, b.created_at, &b.run_id))
    });
    let mut below = vec![run_id.clone()];
    nodes.retain(|node| {
        let inside = node.run_id == *run_id
            || (node.parent_run_id.as_ref()).is_some_and(|p| below.contains(p));
        if inside && node.run_id != *run_id {
            below.push(node.run_id.clone());
        }
        inside
    });
    nodes
}

/// What a message does when its session already has an active run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WhenBusy {
    /// Queue behind the runs before it.
    #[default]
    Enqueue,
    /// Refuse with `Error::Conflict`; nothing is recorded.
    Reject,
    /// Cancel the active run (in the same transaction) and queue behind it: the new run
    /// starts as soon as the cancelled one has ended.
    Interrupt,
    /// Join the active run's history at its next step that calls the model (never between a
    /// tool call and its result). If the active run ends first, the message becomes a queued
    /// run of its own (with `NewRun::run_id`), in the order it was sent: never lost, never
    /// delivered twice.
    Steer,
}

#[derive(Debug, Clone)]
pub struct Submitted {
    pub status: RunStatus,
    pub events: Vec<StoredEvent>,
    /// The active run this message interrupted: cancelled now, or `cancelling` while its
    /// step in flight winds down.
    pub interrupted: Option<RunId>,
    /// The active run this message will steer (`status` is that run's).
    pub steered_into: Option<RunId>,
    /// The active run whose wait on a timer this message ended: its job is ready now.
    pub woke: Option<RunId>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stale {
    /// The job is gone or was claimed again since (the fencing token no longer matches).
    LeaseLost,
    /// The run's committed step is not the one before this job.
    StepMismatch {
        committed: u64,
        job: u64,
    },
    Edge(IllegalEdge),
}

#[derive(Debug, Clone)]
#[expect(
    clippy::large_enum_variant,
    reason = "one value per step commit, matched at once by its caller; boxing buys nothing"
)]
pub enum Commit {
    Committed {
        events: Vec<StoredEvent>,
        /// The next job, already leased to the committer when it asked to continue.
        continued: Option<ClaimedStep>,
        /// The messages the commit added to the run's session, in their order: the step's
        /// own, then the steers and steered signals it took in.
        added: Vec<Message>,
        /// Jobs were enqueued that nobody holds (the next queued run of the session started,
        /// or the committer did not ask to continue): wake the workers.
        enqueued: bool,
    },
    Stale(Stale),
}

/// A write-ahead record: this effect of the claimed step is about to happen at `slot`.
#[derive(Debug, Clone, PartialEq)]
pub struct Intent {
    /// The call's position in its batch; model calls use slot 0 of their step.
    pub slot: u32,
    pub kind: IntentKind,
    pub name: String,
    pub idempotency_key: String,
}

/// What recording intents stored: the announcing events, and for each intent (in order) how
/// many times it has now been recorded — its attempt number.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedIntents {
    pub events: Vec<StoredEvent>,
    pub attempts: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntentKind {
    Model,
    Tool,
}

impl IntentKind {
    pub fn as_str(self) -> &'static str {
        match self {
            IntentKind::Model => "model",
            IntentKind::Tool => "tool",
        }
    }
}

/// An intent as stored, with its outcome once recorded.
#[derive(Debug, Clone, PartialEq)]
pub struct IntentRecord {
    pub slot: u32,
    pub kind: IntentKind,
    pub name: String,
    pub attempts: u32,
    pub outcome: Option<ToolOutcome>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunSummary {
    pub run_id: RunId,
    pub session_id: SessionId,
    pub status: RunStatus,
    pub stop_reason: Option<StopReason>,
    pub step_index: u64,
    pub created_at: Millis,
    pub finished_at: Option<Millis>,
    /// The run and step it was forked from.
    pub forked_from: Option<ForkedFrom>,
    /// The schedule that fired the run, and the slot it fired for.
    pub schedule_id: Option<ScheduleId>,
    pub slot: Option<Millis>,
}

#[derive(Debug, Clone)]
pub struct Reconciled {
    pub events: Vec<StoredEvent>,
    /// Every call in doubt is answered: the run is running again and its job enqueued.
    pub resumed: bool,
}

/// Where an approval stands. `Cancelled` is an approval nobody answered before its run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalStatus {
    Pending,
    Decided,
    Aborted,
    Cancelled,
}

impl ApprovalStatus {
    pub const ALL: [ApprovalStatus; 4] = [
        ApprovalStatus::Pending,
        ApprovalStatus::Decided,
        ApprovalStatus::Aborted,
        ApprovalStatus::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ApprovalStatus::Pending => "pending",
            ApprovalStatus::Decided => "decided",
            ApprovalStatus::Aborted => "aborted",
            ApprovalStatus::Cancelled => "cancelled",
        }
    }

    pub fn parse(text: &str) -> Option<ApprovalStatus> {
        ApprovalStatus::ALL.into_iter().find(|s| s.as_str() == text)
    }
}

/// A gated tool batch and, once given, the human's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Approval {
    pub id: ApprovalId,
    pub run_id: RunId,
    pub session_id: SessionId,
    pub status: ApprovalStatus,
    pub calls: Vec<ApprovalCall>,
    pub answer: Option<ApprovalAnswer>,
    pub created_at: Millis,
    pub decided_at: Option<Millis>,
}

#[derive(Debug, Clone)]
pub struct Answered {
    pub events: Vec<StoredEvent>,
    /// The run is running again and its job enqueued.
    pub resumed: bool,
    /// The answer ended the run and the session's next queued run started.
    pub enqueued: bool,
    /// The same answer had already been recorded: nothing changed.
    pub repeated: bool,
}

impl Approval {
    /// `answer` (normalised) against the answer this approval already has: None when it has
    /// none yet, and the answer is to be applied; a repeat that changes nothing when it is the
    /// same; `Error::Conflict` when it is another.
    pub fn answered_again(&self, answer: &ApprovalAnswer) -> Result<Option<Answered>> {
        let Some(given) = &self.answer else {
            return Ok(None);
        };
        if given == answer {
            return Ok(Some(Answered {
                events: Vec::new(),
                resumed: false,
                enqueued: false,
                repeated: true,
            }));
        }
        let given = serde_json::to_string(given).map_err(|e| {
            Error::Corrupt(format!(
                "approval {}'s answer cannot be written: {e}",
                self.id
            ))
        })?;
        Err(Error::Conflict(format!(
            "approval {} was already answered with {given}",
            self.id
        )))
    }
}

impl Error {
    /// The refusal of an operation that seals or opens a webhook secret in a store opened
    /// without a key; `opener` names how to open it with one.
    pub fn no_keyring(opener: &str) -> Error {
        Error::Secrets(format!(
            "this store was opened without a key, and webhook secrets are only stored sealed; \
             open it with one (`{opener}`)"
        ))
    }
}

/// A change another process sharing the database has committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Jobs nobody holds were enqueued: idle workers should try to claim.
    JobsReady,
    /// Events `first_seq..=last_seq` were appended to the session.
    Events {
        session_id: SessionId,
        first_seq: i64,
        last_seq: i64,
    },
    /// Changes may have been missed (the connection that hears them was re-established):
    /// whoever follows the store should look again at whatever it is waiting for.
    Missed,
}

/// The changes of other processes, in the order they committed.
pub type ChangeStream = std::pin::Pin<Box<dyn futures::Stream<Item = Change> + Send>>;

/// What a migration did: the schema version before and after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migrated {
    pub from: u32,
    pub to: u32,
}

/// Counts for monitoring.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StoreStats {
    pub runs_by_status: Vec<(RunStatus, u64)>,
    /// Jobs any worker could claim now.
    pub ready_jobs: u64,
    /// Jobs held under a lease or waiting for a retry.
    pub held_jobs: u64,
}

#[derive(Debug, Clone)]
pub enum CancelOutcome {
    /// The run had no step in flight and is now cancelled.
    Cancelled {
        events: Vec<StoredEvent>,
        enqueued: bool,
    },
    /// A step may be in flight: the run is `cancelling` and its next step finishes it.
    Cancelling {
        events: Vec<StoredEvent>,
    },
    AlreadyTerminal(RunStatus),
}

impl CancelOutcome {
    /// Adds what cancelling one of the run's children did to what cancelling the run did.
    pub fn absorb(&mut self, child: CancelOutcome) {
        let (more, child_enqueued) = match child {
            CancelOutcome::Cancelled { events, enqueued } => (events, enqueued),
            CancelOutcome::Cancelling { events } => (events, false),
            CancelOutcome::AlreadyTerminal(_) => (Vec::new(), false),
        };
        match self {
            CancelOutcome::Cancelled { events, enqueued } => {
                events.extend(more);
                *enqueued |= child_enqueued;
            }
            CancelOutcome::Cancelling { events } => events.extend(more),
            CancelOutcome::AlreadyTerminal(_) => {}
        }
    }
}

#[derive(Debug, Clone)]
pub enum PauseOutcome {
    /// The run had no step in flight (or was paused already) and is `paused` now.
    Paused { events: Vec<StoredEvent> },
    /// A step is in flight: its commit pauses the run, unless it ends the run or makes it wait.
    Pausing,
}

#[derive(Debug, Clone)]
pub enum ResumeOutcome {
    /// The run is `running` again, with the job its pause took away enqueued (or waits on its
    /// timer again, its job ready at the due time).
    Resumed { events: Vec<StoredEvent> },
    /// The run had not reached its pause yet: the request is withdrawn and it goes on.
    PauseWithdrawn,
}

/// What a handler, the console, a client view or a worker reads: committed state, never a
/// write. Everyone who observes a run is handed this role alone.
#[async_trait]
pub trait Reads: Send + Sync + 'static {
    /// The database's clock, in milliseconds since the epoch, where processes on several
    /// machines share the database (PostgreSQL): the one clock their due times, leases and
    /// deadlines are judged by. None where the process's own clock is that clock (SQLite: one
    /// machine; the in-memory store).
    async fn database_now(&self) -> Result<Option<Millis>> {
        Ok(None)
    }

    async fn get_session(&self, id: &SessionId) -> Result<Session>;

    /// A tenant's sessions that `query` selects, in its order, past its cursor. The sessions
    /// of delegated runs are not listed: they are reached through their run tree.
    async fn list_sessions(
        &self,
        tenant: &str,
        query: &SessionQuery,
        limit: u32,
    ) -> Result<Vec<Session>>;

    /// A session's visible messages (hidden ones never leave the store this way), in order,
    /// after `after_position`.
    async fn visible_messages(
        &self,
        session_id: &SessionId,
        after_position: i64,
        limit: u32,
    ) -> Result<Vec<StoredMessage>>;

    /// Full-text search of the messages in `scope`, best match first, at most `limit` hits.
    ///
    /// `query` is plain text (it may come from a model), never a query language: each
    /// whitespace-separated word is searched as a literal term, so quotes, `*`, `-`, `:` or
    /// `NEAR(` can never make the search fail. A message matching *any* word is found, and the
    /// ones matching more, and rarer, words rank first: recall over precision, since the
    /// caller reads only the best few. An adapter may stem words (`zebras` finds `zebra`). A
    /// query without a word is `Error::Invalid`.
    ///
    /// Only visible user and assistant messages are searched. Hidden messages never are:
    /// whatever a search finds is shown to the model in a visible tool result, which would
    /// carry hidden text into client history. Tool results are not searched either: they are
    /// raw outputs, and earlier search results among them would echo back.
    async fn search_messages(
        &self,
        scope: SearchScope,
        query: &str,
        limit: u32,
    ) -> Result<Vec<MessageHit>>;

    /// A session's runs in id order, after `after` when given.
    async fn session_runs(
        &self,
        session_id: &SessionId,
        after: Option<&RunId>,
        limit: u32,
    ) -> Result<Vec<RunSummary>>;

    /// One run's events after `after_seq`, in order.
    async fn run_events_after(
        &self,
        run_id: &RunId,
        after_seq: i64,
        limit: u32,
    ) -> Result<Vec<StoredEvent>>;

    async fn intents(&self, run_id: &RunId, step_index: u64) -> Result<Vec<IntentRecord>>;

    /// A tenant's approvals in the order they were asked for, after `after` when given,
    /// with the given status only when given.
    async fn approvals(
        &self,
        tenant: &str,
        status: Option<ApprovalStatus>,
        after: Option<&ApprovalId>,
        limit: u32,
    ) -> Result<Vec<Approval>>;

    async fn get_approval(&self, id: &ApprovalId) -> Result<Approval>;

    async fn load_state(&self, run_id: &RunId) -> Result<AgentState>;

    /// The run and every run below it (the children its delegations started, theirs, …),
    /// parents before their children, each level in creation order.
    async fn run_tree(&self, run_id: &RunId) -> Result<Vec<TreeNode>>;

    /// What admitting more runs below `run_id` is checked against.
    async fn admission(&self, run_id: &RunId) -> Result<Admission>;

    /// What every run of `run_id`'s tree — its root run and all the runs below it, ended ones
    /// included — has spent so far, their counters summed.
    async fn tree_spend(&self, run_id: &RunId) -> Result<TreeSpend>;

    /// A root session's inbox events in order, after `after` (an event id), with the given
    /// status only when given.
    async fn inbox(
        &self,
        session_id: &SessionId,
        status: Option<InboxStatus>,
        after: i64,
        limit: u32,
    ) -> Result<Vec<InboxEvent>>;

    /// What waits for `session_id` besides its active run, as of `now`.
    async fn pending_input(&self, session_id: &SessionId, now: Millis) -> Result<PendingInput>;

    /// The session's messages in order, hidden ones included; not the drafts of a continuation
    /// turn that has not completed.
    async fn history(&self, session_id: &SessionId) -> Result<Vec<Message>>;

    /// What the model is shown of a session in `run`'s turn: the latest compaction summary in
    /// place of the messages before the first one it keeps, then every message from there on,
    /// in order. Without a compaction, the whole history. A continuation turn's messages are
    /// drafts until it completes: only that turn sees them.
    async fn context(&self, session_id: &SessionId, run: &RunId) -> Result<Vec<StoredMessage>>;

    /// What `run` showed the model at its step `step_index` — the context as `context` read it
    /// then, before that step's commit — and the messages that step wrote. Empty for a run
    /// with no messages.
    async fn step_messages(&self, run_id: &RunId, step_index: u64) -> Result<StepMessages>;

    async fn list_runs(&self) -> Result<Vec<RunSummary>>;

    async fn steps(&self, run_id: &RunId) -> Result<Vec<StepRecord>>;

    async fn events_after(
        &self,
        session_id: &SessionId,
        after_seq: i64,
        limit: u32,
    ) -> Result<Vec<StoredEvent>>;

    /// Like `events_after`, but stops before the page's payloads, as stored, would pass
    /// `max_bytes`; the first event comes whatever its size. Readers that must hold little in
    /// memory (event streams) page with it.
    async fn events_within(
        &self,
        session_id: &SessionId,
        after_seq: i64,
        limit: u32,
        max_bytes: u64,
    ) -> Result<Vec<StoredEvent>>;

    /// Owners of leases currently held, live or not.
    async fn lease_owners(&self) -> Result<Vec<String>>;

    /// Runs that still have work the workers can do: a job exists for them.
    async fn runs_with_jobs(&self) -> Result<Vec<RunId>>;

    async fn stats(&self, now: Millis) -> Result<StoreStats>;

    /// A schedule; `Error::NotFound` once deleted.
    async fn get_schedule(&self, id: &ScheduleId) -> Result<Schedule>;

    /// A tenant's schedules in id order, after `after` when given (deleted ones left out).
    async fn schedules(
        &self,
        tenant: &str,
        after: Option<&ScheduleId>,
        limit: u32,
    ) -> Result<Vec<Schedule>>;

    /// The schedules not paused whose next slot is due by `now`, the most overdue first.
    async fn due_schedules(&self, now: Millis, limit: u32) -> Result<Vec<Schedule>>;

    /// When the earliest slot of a schedule not paused is due; None with no such schedule.
    async fn next_schedule_fire(&self) -> Result<Option<Millis>>;

    /// A schedule's decided slots, newest first, before `before` when given.
    async fn schedule_slots(
        &self,
        id: &ScheduleId,
        before: Option<SlotCursor>,
        limit: u32,
    ) -> Result<Vec<ScheduleSlot>>;
}

/// The state plane's transactions. Only the Coordinator holds this role: every other part
/// of a process reads (`Reads`) and asks the Coordinator to act, so that each write is
/// followed by the events and wake-ups it owes (see `ratchet_engine::Coordinator`).
#[async_trait]
pub trait Writes: Send + Sync + 'static {
    async fn create_session(
        &self,
        id: &SessionId,
        spec: SessionSpec,
        now: Millis,
    ) -> Result<Session>;

    /// Renames a session (`title`, already checked by the caller) and answers it.
    async fn rename_session(&self, id: &SessionId, title: &str) -> Result<Session>;

    /// Inserts the user message and its run in one transaction. The run starts at once
    /// (its first job enqueued) when the session has no non-terminal run; otherwise it waits
    /// `queued` until the runs before it end. A message that queues or steers is input for the
    /// active run: if it waits on a timer, its wait ends now (`Submitted::woke`).
    async fn submit_message(&self, new: NewRun, now: Millis) -> Result<Submitted>;

    /// Forks `source` at its committed step `at_step` in one transaction: a new session of the
    /// source session's tenant, holding a copy of the source's history as that step left it
    /// (edited as asked; see `ratchet_core::fork::plan`), and a new run in it that continues
    /// from there with fresh budgets, recording `forked_from`. Its first job is enqueued, or it
    /// waits for a human when a `never` call the source started has no known outcome. The
    /// source is only read. Refused with `Error::Invalid` for a step that cannot be forked,
    /// `Error::QuotaExceeded` past `quota` and `Error::NotFound` for an unknown run (nothing
    /// written).
    async fn fork_run(&self, fork: NewFork, now: Millis) -> Result<Forked>;

    /// Claims the oldest available job — of `run` and the runs of its delegations only, when
    /// given: never claimed, released for retry, or with an expired lease. A reclaim increments the job's attempt and epoch.
    /// A job whose run cannot be loaded is set aside for a while instead of blocking the
    /// jobs behind it.
    async fn claim_next(
        &self,
        lease: Lease,
        run: Option<&RunId>,
        now: Millis,
    ) -> Result<Option<ClaimedStep>>;

    /// Extends a lease; false when the claim was lost.
    async fn heartbeat(&self, claim: &Claim, expires_at: Millis) -> Result<bool>;

    /// Commits a step: checks the claim's epoch, that the run's committed step is
    /// `job.step_index - 1` and the status edge, then writes state, messages, events, the
    /// step record and the next job in one transaction. A stale commit writes nothing.
    /// A cancel request recorded meanwhile turns a still-running result into `cancelling`.
    ///
    /// The result's child runs start in the same transaction, each in a session of its own;
    /// `Error::QuotaExceeded` (nothing written) when they would make the tree larger than its
    /// frozen `max_tree_runs`. A run that ends in this commit and is a child is reported to its
    /// parent (`subagent.finished`); when it is the last of its parent's waiting children, the
    /// parent is joined and its next job enqueued, in this same transaction.
    ///
    /// No run quota is checked: this is `commit_step_within` an unlimited quota.
    async fn commit_step(
        &self,
        claim: &Claim,
        result: StepResult,
        continue_with: Option<Lease>,
        now: Millis,
    ) -> Result<Commit> {
        self.commit_step_within(claim, result, continue_with, RunQuota::default(), now)
            .await
    }

    /// `commit_step`, admitting the result's child runs within `quota` as well: the count is
    /// taken in the committing transaction, under the locks a message's admission takes, so
    /// concurrent delegations (in any process) cannot together exceed it. Past it, the commit
    /// is refused with `Error::QuotaExceeded` and writes nothing.
    async fn commit_step_within(
        &self,
        claim: &Claim,
        result: StepResult,
        continue_with: Option<Lease>,
        quota: RunQuota,
        now: Millis,
    ) -> Result<Commit>;

    /// Gives a claimed job back to be retried at `available_at` after a failed attempt,
    /// recording `event`. Returns None when the claim was already lost.
    async fn retry_later(
        &self,
        claim: &Claim,
        available_at: Millis,
        event: EventDraft,
        now: Millis,
    ) -> Result<Option<Vec<StoredEvent>>>;

    /// Appends events outside a step commit (streamed deltas), returning them with `seq`.
    async fn append_events(
        &self,
        session_id: &SessionId,
        run_id: &RunId,
        events: Vec<EventDraft>,
        now: Millis,
    ) -> Result<Vec<StoredEvent>>;

    /// Records intents of the claimed step durably before their effects, with the events that
    /// announce them; recording one again counts an attempt. Fenced: refused with
    /// `Error::LeaseLost` once `claim` no longer holds the step, and with
    /// `Error::CancelRequested` once a cancel of the run was accepted — so no effect starts
    /// after a cancel, whichever process accepted it.
    async fn record_intents(
        &self,
        claim: &Claim,
        intents: Vec<Intent>,
        events: Vec<EventDraft>,
        now: Millis,
    ) -> Result<RecordedIntents>;

    /// Records the outcome of an intent of the claimed step. Fenced like `record_intents`.
    async fn record_outcome(
        &self,
        claim: &Claim,
        slot: u32,
        outcome: ToolOutcome,
        now: Millis,
    ) -> Result<()>;

    /// Cancels a run (see `CancelOutcome`) and, in the same transaction, every non-terminal run
    /// its delegations started, down the tree.
    async fn request_cancel(&self, run_id: &RunId, now: Millis) -> Result<CancelOutcome>;

    /// Pauses a running run at its next step boundary (see `PauseOutcome`), or a run waiting
    /// on a timer at once, keeping its due time; the run keeps its session. `Error::Conflict`
    /// unless the run is running, waiting on a timer or paused.
    async fn request_pause(&self, run_id: &RunId, now: Millis) -> Result<PauseOutcome>;

    /// Takes a paused run up again from where it stopped, with the session's waiting steers
    /// joining it if its next step calls the model (see `ResumeOutcome`). `Error::Conflict`
    /// unless the run is paused or has a pause pending.
    async fn resume_paused(&self, run_id: &RunId, now: Millis) -> Result<ResumeOutcome>;

    /// Records a human's answer for one call whose outcome was unknown (see
    /// `ratchet_core::step::reconcile`); once every call in doubt is answered, the run's next
    /// job is enqueued. A run not waiting for that call is `Error::Conflict`.
    async fn reconcile(
        &self,
        run_id: &RunId,
        call_id: &str,
        answer: Reconciliation,
        result: Option<String>,
        now: Millis,
    ) -> Result<Reconciled>;

    /// Continues or retries a failed run (see `ratchet_core::step::resume_failed`): it becomes
    /// its session's active run again, with its next job enqueued, and `request`'s key records
    /// `Effect::Resumed` in the same transaction. `Error::Conflict` when the run did not fail,
    /// its session has another active run now, or `request` no longer holds its key.
    async fn resume_failed(
        &self,
        run_id: &RunId,
        how: Resumption,
        request: Option<RequestMark>,
        now: Millis,
    ) -> Result<Vec<StoredEvent>>;

    /// Records a human's answer to a pending approval (see
    /// `ratchet_core::approval::answer_approval`) in one transaction with the run's new state
    /// and its next job. The same answer again is accepted and changes nothing; a different
    /// one is `Error::Conflict`, as is an answer to an approval whose run has ended. `by` says
    /// who answered, in `approval.decided`.
    async fn answer_approval(
        &self,
        id: &ApprovalId,
        answer: ApprovalAnswer,
        by: &str,
        now: Millis,
    ) -> Result<Answered>;

    /// An operator acts on a dead letter of a root session's inbox, `by` noted in its reason
    /// (see `DeadLetterAction`). A repeat of the action (the event was discarded, or requeued
    /// and no dead letter since) changes nothing. Refused with `Error::Conflict` for any other
    /// event, and for a requeue in a closed session; with `Error::QuotaExceeded` for a requeue
    /// into a full inbox; with `Error::NotFound` for an event the session does not have.
    async fn act_on_dead_letter(
        &self,
        session_id: &SessionId,
        event_id: i64,
        action: DeadLetterAction,
        by: &str,
        now: Millis,
    ) -> Result<InboxChange>;

    /// Sends a signal of the claimed step's run (a background run with a signal contract) to
    /// its root session's inbox, under the contract's count, interval and dedupe window and
    /// the inbox's capacity. Fenced like `record_intents`. A `steer` signal joins the root
    /// session's active run at its next model call; with none, or if that run ends first, it
    /// is reported by a continuation turn like a `queue` one — started now when the session is
    /// free.
    async fn emit_signal(
        &self,
        claim: &Claim,
        signal: NewSignal,
        now: Millis,
    ) -> Result<EmittedSignal>;

    /// Dead-letters the pending reports past their max age (`expired`; a few hundred a pass),
    /// then starts a continuation turn in every open root session that has no active run and
    /// has inbox events due by `now` (an event released for a later attempt becomes due without
    /// a commit to start it). Each start is its own transaction under the session's lock.
    async fn serve_inboxes(&self, now: Millis) -> Result<Served>;

    /// Ends every run that waits (for a human, for its children, on a timer) past its deadline as
    /// `timed_out`: its children are cancelled, `never` calls it was waiting on a human to
    /// reconcile stay in doubt on it, and a parent sees it as a failed task. Each run is its
    /// own transaction; a run that moved on meanwhile is left alone.
    async fn time_out_overdue(&self, now: Millis) -> Result<TimedOut>;

    /// Archives or deletes a root session in one transaction: every non-terminal run of its
    /// tree is cancelled (background runs included), its waiting steers are recorded as
    /// cancelled runs, and every held inbox event — reservations included — is dead-lettered.
    /// No continuation starts in it afterwards and it takes no more messages; nothing is
    /// erased. Closing a closed session again is `Error::Conflict`.
    async fn close_session(&self, id: &SessionId, how: Closing, now: Millis) -> Result<Closed>;

    /// Releases every lease of an owner known to be dead, so its jobs are claimable now.
    async fn release_leases(&self, owner: &str) -> Result<u64>;

    /// Takes `request`'s key, or says why not (`RequestClaim::decide`): a key taken is held
    /// until `request.held_until`. Two requests with one key at once: one takes it, the other
    /// finds it in progress.
    async fn begin_request(&self, request: KeyedRequest, now: Millis) -> Result<RequestClaim>;

    /// Keeps `response` as the answer to the key `mark` holds; false (nothing written) when
    /// the mark no longer holds it.
    async fn finish_request(&self, mark: &RequestMark, response: StoredResponse) -> Result<bool>;

    /// Gives the key `mark` holds back, when the request did nothing worth repeating (it was
    /// refused for now, or failed): the next request with the key is carried out. A key
    /// whose effect was recorded is kept.
    async fn abandon_request(&self, mark: &RequestMark) -> Result<()>;

    /// Forgets the keys that expired by `now`; how many.
    async fn sweep_requests(&self, now: Millis) -> Result<u64>;

    /// Creates a schedule, its runs' configuration frozen now. `Error::Conflict` for an id
    /// that exists.
    async fn create_schedule(&self, new: NewSchedule, now: Millis) -> Result<Schedule>;

    /// Replaces a schedule's definition and frozen configuration (see `ScheduleChange`).
    async fn update_schedule(
        &self,
        id: &ScheduleId,
        change: ScheduleChange,
        now: Millis,
    ) -> Result<Schedule>;

    /// Pauses or resumes a schedule; a resume sets when its next slot is due (the slots of
    /// the pause are not caught up).
    async fn set_schedule_paused(
        &self,
        id: &ScheduleId,
        paused: bool,
        next_fire_at: Option<Millis>,
        now: Millis,
    ) -> Result<Schedule>;

    /// Deletes a schedule: it fires no more and reads as missing; its slots and runs stay.
    async fn delete_schedule(&self, id: &ScheduleId, now: Millis) -> Result<()>;

    /// Decides a schedule's due slots in one transaction, under the schedule's lock: a row
    /// per slot (unique per schedule and slot), each fired slot's run submitted as a message
    /// would be (within `quota`; a refusal is recorded on its row), `overlap` applied against
    /// the previous run, and `next_fire_at` moved on. When the schedule's `next_fire_at` is no
    /// longer `pass.expected_next` (someone decided these slots first), or it was paused or
    /// deleted meanwhile, nothing is written and the answer is `stale`.
    async fn fire_schedule(
        &self,
        id: &ScheduleId,
        pass: DuePass,
        quota: RunQuota,
        now: Millis,
    ) -> Result<Fired>;

    /// Fires a schedule now, whatever its cadence and even paused: a manual slot at `now`,
    /// decided as a due slot is (`overlap`, the quota). Its `next_fire_at` does not move.
    /// `Error::Conflict` when it was triggered at this same millisecond already. A keyed
    /// request's effect is recorded with its key in the same transaction.
    async fn trigger_schedule(
        &self,
        id: &ScheduleId,
        ids: FireIds,
        quota: RunQuota,
        request: Option<RequestMark>,
        now: Millis,
    ) -> Result<Fired>;
}

/// How a process hears what other processes sharing the database commit.
pub trait Changes: Send + Sync + 'static {
    /// Follows what other processes sharing this database commit. `None` when no other
    /// process can write it (each call is a new, independent follower). Hearing of a change
    /// is a hint for latency only: a follower still polls, since a change can be missed.
    fn changes(&self) -> Option<ChangeStream> {
        None
    }
}

/// A whole backend: every role of the state and observation planes over one database.
/// Backends implement the roles; this name is for what opens, tests or assembles a store.
pub trait Store: Reads + Writes + Changes + WebhookAdmin + Deliveries {}

impl<S: Reads + Writes + Changes + WebhookAdmin + Deliveries + ?Sized> Store for S {}

/// One store, by role. Whoever assembles a process hands each part the roles it needs and no
/// more: `writes` to the Coordinator alone, `reads` to whatever observes, `deliveries` to the
/// webhook dispatcher, `webhooks` to the administration API. A test double replaces one role
/// and keeps the backend's others (`Roles { changes, ..Roles::of(store) }`).
#[derive(Clone)]
pub struct Roles {
    pub reads: Arc<dyn Reads>,
    pub writes: Arc<dyn Writes>,
    pub changes: Arc<dyn Changes>,
    pub webhooks: Arc<dyn WebhookAdmin>,
    pub deliveries: Arc<dyn Deliveries>,
}

impl Roles {
    pub fn of(store: Arc<dyn Store>) -> Roles {
        Roles {
            reads: store.clone(),
            writes: store.clone(),
            changes: store.clone(),
            webhooks: store.clone(),
            deliveries: store,
        }
    }
}

impl<S: Store> From<Arc<S>> for Roles {
    fn from(store: Arc<S>) -> Roles {
        Roles::of(store)
    }
}

impl From<Arc<dyn Store>> for Roles {
    fn from(store: Arc<dyn Store>) -> Roles {
        Roles::of(store)
    }
}
