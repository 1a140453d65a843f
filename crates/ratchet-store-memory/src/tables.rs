//! The model's data: one plain collection per SQL table, holding what the SQL backends keep
//! in their rows that any operation reads back. The integrity rules their schemas enforce
//! (primary keys, unique columns, the foreign key of a run's session) are checked where a row
//! is inserted.
//!
//! Positions and ids that SQL numbers itself (a message's `rowid`, an inbox event's id) are
//! an index into a `Vec` that is only ever appended to, so they count up exactly as SQL's do.

use std::collections::BTreeMap;
use std::sync::Arc;

use ratchet_core::{
    AgentState, ApprovalAnswer, ApprovalCall, Delivery, DeliveryStatus, InboxKind, InboxStatus,
    Lineage, Message, Millis, Phase, RunConfigSnapshot, RunId, RunStatus, SessionId, StepRecord,
    ToolOutcome, WebhookId,
};
use ratchet_store::{ApprovalStatus, Error, IntentKind, Result, StoredEvent};
use serde_json::Value;

#[derive(Debug, Clone, Default)]
pub(crate) struct Tables {
    pub(crate) sessions: BTreeMap<SessionId, SessionRow>,
    pub(crate) runs: BTreeMap<RunId, RunRow>,
    /// Every message of every session, in the order written: a message's position is its
    /// index plus one.
    pub(crate) messages: Vec<MessageRow>,
    pub(crate) steps: BTreeMap<(RunId, u64), StepRecord>,
    pub(crate) jobs: BTreeMap<(RunId, u64), JobRow>,
    pub(crate) intents: BTreeMap<(RunId, u64, u32), IntentRow>,
    /// In the order they were asked for (a cursor's position is the index plus one).
    pub(crate) approvals: Vec<ApprovalRow>,
    /// Waiting steering messages, oldest first.
    pub(crate) steers: Vec<SteerRow>,
    /// Every inbox event ever written: an event's id is its index plus one.
    pub(crate) inbox: Vec<InboxRow>,
    pub(crate) webhooks: BTreeMap<WebhookId, WebhookRow>,
    /// How far each webhook has queued each session's events.
    pub(crate) cursors: BTreeMap<(WebhookId, SessionId), i64>,
    pub(crate) deliveries: BTreeMap<i64, DeliveryRow>,
    /// The id of the latest delivery queued: ids count up, and a deleted delivery's id is
    /// never given out again.
    pub(crate) last_delivery_id: i64,
    pub(crate) requests: crate::requests::Requests,
    pub(crate) schedules: BTreeMap<ratchet_core::ScheduleId, crate::schedules::ScheduleRow>,
    /// Decided slots by (schedule, manual, slot): the primary key of `schedule_slots`.
    pub(crate) schedule_slots:
        BTreeMap<(ratchet_core::ScheduleId, bool, Millis), crate::schedules::SlotRow>,
}

#[derive(Debug, Clone)]
pub(crate) struct SessionRow {
    pub(crate) tenant: String,
    pub(crate) agent: Option<String>,
    pub(crate) metadata: Option<Value>,
    pub(crate) created_at: Millis,
    pub(crate) active_run_id: Option<RunId>,
    pub(crate) archived_at: Option<Millis>,
    pub(crate) deleted_at: Option<Millis>,
    pub(crate) title: Option<String>,
    /// For the session of a delegated run: where it hangs in its tree.
    pub(crate) parent_session_id: Option<SessionId>,
    pub(crate) root_session_id: Option<SessionId>,
    /// User turns started since the session's last continuation turn.
    pub(crate) user_turns_in_a_row: u32,
    /// The session's events: an event's seq is its index plus one.
    pub(crate) events: Vec<StoredEvent>,
}

impl SessionRow {
    pub(crate) fn is_closed(&self) -> bool {
        self.archived_at.is_some() || self.deleted_at.is_some()
    }

    /// The seq of the session's latest event; 0 before any.
    pub(crate) fn last_seq(&self) -> i64 {
        i64::try_from(self.events.len()).unwrap_or(i64::MAX)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct RunRow {
    /// The order runs were created in, across all sessions.
    pub(crate) created_order: u64,
    pub(crate) session_id: SessionId,
    /// The state as last written, whatever configuration and flags it carried: reads put the
    /// store's own (`config`, the two flags) in their place.
    pub(crate) state: AgentState,
    /// Frozen at creation.
    pub(crate) config: Arc<RunConfigSnapshot>,
    pub(crate) cancel_requested: bool,
    pub(crate) pause_requested: bool,
    /// The user message that starts the run, written to history when it starts.
    pub(crate) input: RunInput,
    /// The catalog agent it runs.
    pub(crate) agent: Option<String>,
    /// Where a delegated run was started in its tree, as it was started (a step's result
    /// cannot move it).
    pub(crate) lineage: Option<Lineage>,
    /// When a waiting run passes its duration budget, as of its last written state.
    pub(crate) deadline_at: Option<Millis>,
}

impl RunRow {
    pub(crate) fn status(&self) -> RunStatus {
        self.state.status
    }

    pub(crate) fn root_run_id(&self) -> Option<&RunId> {
        self.lineage.as_ref().map(|l| &l.root_run_id)
    }

    pub(crate) fn parent_run_id(&self) -> Option<&RunId> {
        self.lineage.as_ref().map(|l| &l.parent_run_id)
    }

    /// The group of a background run.
    pub(crate) fn inbox_group(&self) -> Option<&str> {
        (self.lineage.as_ref())
            .and_then(|l| l.background.as_ref())
            .map(|b| b.group.as_str())
    }

    pub(crate) fn depth(&self) -> u32 {
        self.lineage.as_ref().map_or(0, |l| l.depth)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct RunInput {
    pub(crate) message_id: String,
    pub(crate) content: String,
}

#[derive(Debug, Clone)]
pub(crate) struct MessageRow {
    pub(crate) id: String,
    pub(crate) session_id: SessionId,
    pub(crate) run_id: RunId,
    pub(crate) message: Message,
    pub(crate) created_at: Millis,
    /// A continuation turn's message is its run's draft until the turn completes.
    pub(crate) draft_of: Option<RunId>,
}

#[derive(Debug, Clone)]
pub(crate) struct JobRow {
    pub(crate) phase: Phase,
    pub(crate) attempt: u32,
    /// The fencing token: every claim changes it.
    pub(crate) epoch: i64,
    pub(crate) lease_owner: Option<String>,
    /// When the job may be claimed: its lease's expiry while held, its retry time after a
    /// failed attempt.
    pub(crate) ready_at: Millis,
}

#[derive(Debug, Clone)]
pub(crate) struct IntentRow {
    pub(crate) kind: IntentKind,
    pub(crate) name: String,
    pub(crate) attempts: u32,
    pub(crate) outcome: Option<ToolOutcome>,
}

#[derive(Debug, Clone)]
pub(crate) struct ApprovalRow {
    pub(crate) id: ratchet_core::ApprovalId,
    pub(crate) run_id: RunId,
    pub(crate) session_id: SessionId,
    /// Pending, decided or aborted; a pending one whose run no longer waits reads as
    /// cancelled.
    pub(crate) status: ApprovalStatus,
    pub(crate) calls: Vec<ApprovalCall>,
    pub(crate) answer: Option<ApprovalAnswer>,
    pub(crate) created_at: Millis,
    pub(crate) decided_at: Option<Millis>,
}

#[derive(Debug, Clone)]
pub(crate) struct SteerRow {
    pub(crate) message_id: String,
    pub(crate) session_id: SessionId,
    /// The run the message becomes if the active run ends before taking it in.
    pub(crate) run_id: RunId,
    pub(crate) content: String,
    pub(crate) config: RunConfigSnapshot,
    pub(crate) created_at: Millis,
}

#[derive(Debug, Clone)]
pub(crate) struct InboxRow {
    pub(crate) session_id: SessionId,
    pub(crate) kind: InboxKind,
    pub(crate) status: InboxStatus,
    pub(crate) delivery: Delivery,
    pub(crate) parent_run_id: RunId,
    pub(crate) source_run_id: Option<RunId>,
    pub(crate) group: Option<String>,
    pub(crate) payload: Option<Value>,
    /// A signal's: one per emitting call, and its dedupe key.
    pub(crate) call_key: Option<String>,
    pub(crate) dedupe_key: Option<String>,
    pub(crate) attempts: u32,
    pub(crate) max_attempts: u32,
    pub(crate) available_at: Option<Millis>,
    pub(crate) lease_run_id: Option<RunId>,
    pub(crate) reason: Option<String>,
    pub(crate) requeued_at: Option<Millis>,
    pub(crate) expires_at: Option<Millis>,
    pub(crate) created_at: Millis,
    pub(crate) updated_at: Millis,
}

#[derive(Debug, Clone)]
pub(crate) struct WebhookRow {
    pub(crate) tenant: String,
    pub(crate) url: String,
    pub(crate) events: Option<Vec<String>>,
    /// Sealed (`ratchet_store::secrets`).
    pub(crate) secret: String,
    pub(crate) max_attempts: u32,
    pub(crate) created_at: Millis,
}

#[derive(Debug, Clone)]
pub(crate) struct DeliveryRow {
    pub(crate) webhook_id: WebhookId,
    pub(crate) session_id: SessionId,
    pub(crate) seq: i64,
    pub(crate) event_kind: String,
    pub(crate) status: DeliveryStatus,
    pub(crate) attempts: u32,
    pub(crate) available_at: Option<Millis>,
    pub(crate) lease_owner: Option<String>,
    pub(crate) lease_expires_at: Option<Millis>,
    pub(crate) last_status: Option<u16>,
    pub(crate) last_error: Option<String>,
    pub(crate) delivered_at: Option<Millis>,
    pub(crate) requeued_at: Option<Millis>,
    pub(crate) created_at: Millis,
    pub(crate) updated_at: Millis,
}

/// What a SQL backend answers when an insert breaks a primary key or unique column: a
/// database error, the whole transaction kept from committing.
pub(crate) fn duplicate(what: &str, key: impl std::fmt::Display) -> Error {
    Error::Backend(format!(
        "UNIQUE constraint failed: {what} {key} already exists"
    ))
}

pub(crate) fn run_not_found(run_id: &RunId) -> Error {
    Error::NotFound {
        kind: "run",
        id: run_id.to_string(),
    }
}

pub(crate) fn session_not_found(session_id: &SessionId) -> Error {
    Error::NotFound {
        kind: "session",
        id: session_id.to_string(),
    }
}

impl Tables {
    pub(crate) fn session(&self, id: &SessionId) -> Result<&SessionRow> {
        self.sessions.get(id).ok_or_else(|| session_not_found(id))
    }

    pub(crate) fn session_mut(&mut self, id: &SessionId) -> Result<&mut SessionRow> {
        self.sessions
            .get_mut(id)
            .ok_or_else(|| session_not_found(id))
    }

    pub(crate) fn run(&self, id: &RunId) -> Result<&RunRow> {
        self.runs.get(id).ok_or_else(|| run_not_found(id))
    }

    pub(crate) fn run_mut(&mut self, id: &RunId) -> Result<&mut RunRow> {
        self.runs.get_mut(id).ok_or_else(|| run_not_found(id))
    }

    /// The run's state as a reader sees it: with the configuration it was frozen with and
    /// the store's cancel and pause flags.
    pub(crate) fn load_state(&self, id: &RunId) -> Result<AgentState> {
        let run = self.run(id)?;
        Ok(AgentState {
            config: Arc::clone(&run.config),
            cancel_requested: run.cancel_requested,
            pause_requested: run.pause_requested,
            ..run.state.clone()
        })
    }

    pub(crate) fn inbox_event(&self, id: i64) -> Option<&InboxRow> {
        let index = usize::try_from(id.checked_sub(1)?).ok()?;
        self.inbox.get(index)
    }

    pub(crate) fn inbox_event_mut(&mut self, id: i64) -> Option<&mut InboxRow> {
        let index = usize::try_from(id.checked_sub(1)?).ok()?;
        self.inbox.get_mut(index)
    }

    /// The inbox's events with their ids, oldest first.
    pub(crate) fn inbox_rows(&self) -> impl Iterator<Item = (i64, &InboxRow)> {
        (1..).zip(&self.inbox)
    }
}
