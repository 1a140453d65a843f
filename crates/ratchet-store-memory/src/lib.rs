//! The strict reference model of the Ratchet store: every operation of every role of
//! `Store` over plain Rust collections, written to be read and believed rather than to be
//! fast. It is the storage port's meaning in its simplest form — what a SQL backend must
//! agree with, and what a test that needs a store but no database can run against.
//!
//! **Atomic.** All data sits behind one mutex, held for the whole of each read or write and
//! never across an `.await`. A write works on a copy of the data and puts it in place only
//! when it succeeds: a write that fails, at any point, changes nothing — the transaction of
//! the SQL backends, without a database. An operation the SQL backends run as several
//! transactions (the overdue sweep, serving the inboxes) is as many writes here.
//!
//! **Strict.** It refuses exactly what the SQLite and PostgreSQL backends refuse, with the
//! same `ratchet_store::Error` variants: missing entities (`NotFound`), duplicates and stale
//! states (`Conflict`), lost claims (`LeaseLost`, or `Commit::Stale`), and the primary key,
//! unique column and foreign key violations their schemas raise (`Backend`), so that a test
//! cannot pass here and fail on a real backend. Decisions — status edges, step transitions,
//! budgets, the inbox's turns — are `ratchet-core`'s, called as the SQL backends call them.
//!
//! What SQL numbers itself counts up the same way here (message positions and inbox event
//! ids from 1, event seqs from 1 in each session), and an event page's byte budget counts a
//! payload as the SQL backends store it. Search is a word matcher ranked by bm25, as SQLite's
//! FTS5 ranks, without the backends' stemming (see `search`). No other process can write its
//! data, so `changes` has nothing to follow.

mod approvals;
mod delegation;
mod events;
mod fork;
mod inbox;
mod jobs;
mod messages;
mod requests;
mod runs;
mod schedules;
mod search;
mod sessions;
mod steers;
mod steps;
mod tables;
mod webhooks;

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use ratchet_core::step::{Reconciliation, Resumption};
use ratchet_core::{
    AgentState, ApprovalAnswer, ApprovalId, DeliveryStatus, EventDraft, InboxStatus, Message,
    Millis, RunId, ScheduleId, SessionId, StepRecord, StepResult, ToolOutcome, TreeSpend,
    WebhookId,
};
use ratchet_store::{
    Admission, Answered, Approval, ApprovalStatus, AttemptOutcome, CancelOutcome, Changes, Claim,
    ClaimedDelivery, ClaimedStep, Closed, Closing, Commit, DeadLetterAction, Deliveries,
    DeliveryBounds, DeliveryClaim, DuePass, Effect, EmittedSignal, Error, FireIds, Fired, Forked,
    InboxChange, InboxEvent, Intent, IntentRecord, KeyedRequest, Keyring, Lease, MessageHit,
    NewFork, NewRun, NewSchedule, NewSignal, NewWebhook, PauseOutcome, PendingInput, Reads,
    Reconciled, RecordedIntents, RequestClaim, RequestMark, Result, ResumeOutcome, RunQuota,
    RunSummary, Schedule, ScheduleChange, ScheduleSlot, SearchScope, Served, Session, SessionQuery,
    SessionSpec, SlotCursor, StepMessages, StoreStats, StoredEvent, StoredMessage, StoredResponse,
    Submitted, TimedOut, TreeNode, Webhook, WebhookAdmin, WebhookDelivery, Writes,
};

use crate::tables::Tables;

/// An in-memory store. A clone is another handle on the same data, as a second process
/// opening the same database would be; `with_secrets` gives a handle its own keys.
#[derive(Clone, Default)]
pub struct MemoryStore {
    tables: Arc<Mutex<Tables>>,
    /// Seals webhook secrets; without it, nothing that reads or writes one works.
    secrets: Option<Arc<Keyring>>,
}

impl MemoryStore {
    /// A new, empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// The same store, sealing webhook secrets with `keyring`.
    pub fn with_secrets(self, keyring: Keyring) -> MemoryStore {
        MemoryStore {
            secrets: Some(Arc::new(keyring)),
            ..self
        }
    }

    /// The keyring, for the operations that seal or open a webhook secret.
    fn keyring(&self) -> Result<Arc<Keyring>> {
        (self.secrets.clone()).ok_or_else(|| Error::no_keyring("MemoryStore::with_secrets"))
    }

    fn lock(&self) -> MutexGuard<'_, Tables> {
        // A panic inside an operation could only have touched a write's copy, never the data
        // itself, so the data behind a poisoned lock is whole.
        self.tables.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn read<R>(&self, body: impl FnOnce(&Tables) -> R) -> R {
        body(&self.lock())
    }

    /// Runs `body` on a copy of the data, which replaces the data only when `body` succeeds.
    fn write<R>(&self, body: impl FnOnce(&mut Tables) -> Result<R>) -> Result<R> {
        let mut tables = self.lock();
        let mut draft = tables.clone();
        let outcome = body(&mut draft)?;
        *tables = draft;
        Ok(outcome)
    }
}

#[async_trait]
impl Reads for MemoryStore {
    async fn get_session(&self, id: &SessionId) -> Result<Session> {
        self.read(|t| t.get_session(id))
    }

    async fn list_sessions(
        &self,
        tenant: &str,
        query: &SessionQuery,
        limit: u32,
    ) -> Result<Vec<Session>> {
        self.read(|t| t.list_sessions(tenant, query, limit))
    }

    async fn visible_messages(
        &self,
        session_id: &SessionId,
        after_position: i64,
        limit: u32,
    ) -> Result<Vec<StoredMessage>> {
        Ok(self.read(|t| t.visible_messages(session_id, after_position, limit)))
    }

    async fn search_messages(
        &self,
        scope: SearchScope,
        query: &str,
        limit: u32,
    ) -> Result<Vec<MessageHit>> {
        self.read(|t| t.search_messages(&scope, query, limit))
    }

    async fn session_runs(
        &self,
        session_id: &SessionId,
        after: Option<&RunId>,
        limit: u32,
    ) -> Result<Vec<RunSummary>> {
        Ok(self.read(|t| t.session_runs(session_id, after, limit)))
    }

    async fn run_events_after(
        &self,
        run_id: &RunId,
        after_seq: i64,
        limit: u32,
    ) -> Result<Vec<StoredEvent>> {
        Ok(self.read(|t| t.run_events_after(run_id, after_seq, limit)))
    }

    async fn intents(&self, run_id: &RunId, step_index: u64) -> Result<Vec<IntentRecord>> {
        Ok(self.read(|t| t.intents(run_id, step_index)))
    }

    async fn approvals(
        &self,
        tenant: &str,
        status: Option<ApprovalStatus>,
        after: Option<&ApprovalId>,
        limit: u32,
    ) -> Result<Vec<Approval>> {
        Ok(self.read(|t| t.approvals(tenant, status, after, limit)))
    }

    async fn get_approval(&self, id: &ApprovalId) -> Result<Approval> {
        self.read(|t| t.get_approval(id))
    }

    async fn load_state(&self, run_id: &RunId) -> Result<AgentState> {
        self.read(|t| t.load_state(run_id))
    }

    async fn run_tree(&self, run_id: &RunId) -> Result<Vec<TreeNode>> {
        self.read(|t| t.run_tree(run_id))
    }

    async fn admission(&self, run_id: &RunId) -> Result<Admission> {
        self.read(|t| t.admission(run_id))
    }

    async fn tree_spend(&self, run_id: &RunId) -> Result<TreeSpend> {
        self.read(|t| t.tree_spend(run_id))
    }

    async fn inbox(
        &self,
        session_id: &SessionId,
        status: Option<InboxStatus>,
        after: i64,
        limit: u32,
    ) -> Result<Vec<InboxEvent>> {
        Ok(self.read(|t| t.inbox(session_id, status, after, limit)))
    }

    async fn pending_input(&self, session_id: &SessionId, now: Millis) -> Result<PendingInput> {
        Ok(self.read(|t| t.pending_input(session_id, now)))
    }

    async fn history(&self, session_id: &SessionId) -> Result<Vec<Message>> {
        Ok(self.read(|t| t.history(session_id)))
    }

    async fn context(&self, session_id: &SessionId, run: &RunId) -> Result<Vec<StoredMessage>> {
        Ok(self.read(|t| t.context(session_id, run)))
    }

    async fn step_messages(&self, run_id: &RunId, step_index: u64) -> Result<StepMessages> {
        self.read(|t| t.step_messages(run_id, step_index))
    }

    async fn list_runs(&self) -> Result<Vec<RunSummary>> {
        Ok(self.read(Tables::list_runs))
    }

    async fn steps(&self, run_id: &RunId) -> Result<Vec<StepRecord>> {
        Ok(self.read(|t| t.steps(run_id)))
    }

    async fn events_after(
        &self,
        session_id: &SessionId,
        after_seq: i64,
        limit: u32,
    ) -> Result<Vec<StoredEvent>> {
        Ok(self.read(|t| t.events_after(session_id, after_seq, limit)))
    }

    async fn events_within(
        &self,
        session_id: &SessionId,
        after_seq: i64,
        limit: u32,
        max_bytes: u64,
    ) -> Result<Vec<StoredEvent>> {
        Ok(self.read(|t| t.events_within(session_id, after_seq, limit, max_bytes)))
    }

    async fn lease_owners(&self) -> Result<Vec<String>> {
        Ok(self.read(Tables::lease_owners))
    }

    async fn runs_with_jobs(&self) -> Result<Vec<RunId>> {
        Ok(self.read(Tables::runs_with_jobs))
    }

    async fn stats(&self, now: Millis) -> Result<StoreStats> {
        Ok(self.read(|t| t.stats(now)))
    }

    async fn get_schedule(&self, id: &ScheduleId) -> Result<Schedule> {
        self.read(|t| t.get_schedule(id))
    }

    async fn schedules(
        &self,
        tenant: &str,
        after: Option<&ScheduleId>,
        limit: u32,
    ) -> Result<Vec<Schedule>> {
        Ok(self.read(|t| t.list_schedules(tenant, after, limit)))
    }

    async fn due_schedules(&self, now: Millis, limit: u32) -> Result<Vec<Schedule>> {
        Ok(self.read(|t| t.due_schedules(now, limit)))
    }

    async fn next_schedule_fire(&self) -> Result<Option<Millis>> {
        Ok(self.read(Tables::next_schedule_fire))
    }

    async fn schedule_slots(
        &self,
        id: &ScheduleId,
        before: Option<SlotCursor>,
        limit: u32,
    ) -> Result<Vec<ScheduleSlot>> {
        Ok(self.read(|t| t.schedule_slots(id, before, limit)))
    }
}

#[async_trait]
impl Writes for MemoryStore {
    async fn create_session(
        &self,
        id: &SessionId,
        spec: SessionSpec,
        now: Millis,
    ) -> Result<Session> {
        let request = spec.request.clone();
        self.write(|t| {
            let session = t.create_session(id, spec, now)?;
            if let Some(mark) = &request {
                let session_id = id.clone();
                t.record_effect(mark, Effect::SessionCreated { session_id })?;
            }
            Ok(session)
        })
    }

    async fn rename_session(&self, id: &SessionId, title: &str) -> Result<Session> {
        self.write(|t| t.rename_session(id, title))
    }

    async fn submit_message(&self, mut new: NewRun, now: Millis) -> Result<Submitted> {
        let request = new.request.take();
        self.write(|t| {
            let (message_id, run_id) = (new.message_id.clone(), new.run_id.clone());
            let submitted = t.submit_message(new, now)?;
            if let Some(mark) = &request {
                t.record_effect(mark, Effect::submitted(message_id, run_id, &submitted))?;
            }
            Ok(submitted)
        })
    }

    async fn fork_run(&self, mut fork: NewFork, now: Millis) -> Result<Forked> {
        let request = fork.request.take();
        self.write(|t| {
            let (source, at_step) = (fork.source.clone(), fork.at_step);
            let (session_id, run_id) = (fork.session_id.clone(), fork.run_id.clone());
            let forked = t.fork_run(fork, now)?;
            if let Some(mark) = &request {
                let effect = Effect::Forked {
                    source,
                    at_step,
                    session_id,
                    run_id,
                    status: forked.status,
                };
                t.record_effect(mark, effect)?;
            }
            Ok(forked)
        })
    }

    async fn claim_next(
        &self,
        lease: Lease,
        run: Option<&RunId>,
        now: Millis,
    ) -> Result<Option<ClaimedStep>> {
        self.write(|t| t.claim_next(&lease, run, now))
    }

    async fn heartbeat(&self, claim: &Claim, expires_at: Millis) -> Result<bool> {
        self.write(|t| Ok(t.heartbeat(claim, expires_at)))
    }

    async fn commit_step_within(
        &self,
        claim: &Claim,
        result: StepResult,
        continue_with: Option<Lease>,
        quota: RunQuota,
        now: Millis,
    ) -> Result<Commit> {
        self.write(|t| t.commit_step(claim, result, continue_with, quota, now))
    }

    async fn retry_later(
        &self,
        claim: &Claim,
        available_at: Millis,
        event: EventDraft,
        now: Millis,
    ) -> Result<Option<Vec<StoredEvent>>> {
        self.write(|t| t.retry_later(claim, available_at, event, now))
    }

    async fn append_events(
        &self,
        session_id: &SessionId,
        run_id: &RunId,
        events: Vec<EventDraft>,
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        self.write(|t| t.insert_events(session_id, Some(run_id), events, now))
    }

    async fn record_intents(
        &self,
        claim: &Claim,
        intents: Vec<Intent>,
        events: Vec<EventDraft>,
        now: Millis,
    ) -> Result<RecordedIntents> {
        self.write(|t| t.record_intents(claim, intents, events, now))
    }

    async fn record_outcome(
        &self,
        claim: &Claim,
        slot: u32,
        outcome: ToolOutcome,
        _now: Millis,
    ) -> Result<()> {
        self.write(|t| t.record_outcome(claim, slot, outcome))
    }

    async fn request_cancel(&self, run_id: &RunId, now: Millis) -> Result<CancelOutcome> {
        self.write(|t| t.request_cancel(run_id, now))
    }

    async fn request_pause(&self, run_id: &RunId, now: Millis) -> Result<PauseOutcome> {
        self.write(|t| t.request_pause(run_id, now))
    }

    async fn resume_paused(&self, run_id: &RunId, now: Millis) -> Result<ResumeOutcome> {
        self.write(|t| t.resume_paused(run_id, now))
    }

    async fn reconcile(
        &self,
        run_id: &RunId,
        call_id: &str,
        answer: Reconciliation,
        result: Option<String>,
        now: Millis,
    ) -> Result<Reconciled> {
        self.write(|t| t.reconcile(run_id, call_id, answer, result, now))
    }

    async fn resume_failed(
        &self,
        run_id: &RunId,
        how: Resumption,
        request: Option<RequestMark>,
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        self.write(|t| {
            let events = t.resume_failed(run_id, how, now)?;
            if let Some(mark) = &request {
                let run_id = run_id.clone();
                t.record_effect(mark, Effect::Resumed { run_id })?;
            }
            Ok(events)
        })
    }

    async fn answer_approval(
        &self,
        id: &ApprovalId,
        answer: ApprovalAnswer,
        by: &str,
        now: Millis,
    ) -> Result<Answered> {
        self.write(|t| t.answer_approval(id, answer, by, now))
    }

    async fn act_on_dead_letter(
        &self,
        session_id: &SessionId,
        event_id: i64,
        action: DeadLetterAction,
        by: &str,
        now: Millis,
    ) -> Result<InboxChange> {
        self.write(|t| t.act_on_dead_letter(session_id, event_id, action, by, now))
    }

    async fn emit_signal(
        &self,
        claim: &Claim,
        signal: NewSignal,
        now: Millis,
    ) -> Result<EmittedSignal> {
        self.write(|t| t.emit_signal(claim, signal, now))
    }

    /// Expires what is overdue, then starts each free session's continuation in a write of
    /// its own, as the SQL backends do.
    async fn serve_inboxes(&self, now: Millis) -> Result<Served> {
        let mut served = Served {
            events: self.write(|t| t.expire(now))?,
            started: Vec::new(),
        };
        for session in self.read(|t| t.servable_sessions(now)) {
            let (events, started) = self.write(|t| t.serve_session(&session, now))?;
            served.events.extend(events);
            served.started.extend(started);
        }
        Ok(served)
    }

    /// Ends each overdue run in a write of its own; a run that moved on since it was found
    /// overdue is left alone.
    async fn time_out_overdue(&self, now: Millis) -> Result<TimedOut> {
        let mut timed_out = TimedOut::default();
        for run in self.read(|t| t.overdue_runs(now)) {
            let ended = self.write(|t| t.time_out_run(&run, now))?;
            timed_out.events.extend(ended.events);
            timed_out.ended.extend(ended.ended);
            timed_out.enqueued |= ended.enqueued;
        }
        Ok(timed_out)
    }

    async fn close_session(&self, id: &SessionId, how: Closing, now: Millis) -> Result<Closed> {
        self.write(|t| t.close_session(id, how, now))
    }

    async fn release_leases(&self, owner: &str) -> Result<u64> {
        self.write(|t| Ok(t.release_leases(owner)))
    }

    async fn begin_request(&self, request: KeyedRequest, now: Millis) -> Result<RequestClaim> {
        self.write(|t| Ok(t.begin_request(request, now)))
    }

    async fn finish_request(&self, mark: &RequestMark, response: StoredResponse) -> Result<bool> {
        self.write(|t| Ok(t.finish_request(mark, response)))
    }

    async fn abandon_request(&self, mark: &RequestMark) -> Result<()> {
        self.write(|t| {
            t.abandon_request(mark);
            Ok(())
        })
    }

    async fn sweep_requests(&self, now: Millis) -> Result<u64> {
        self.write(|t| Ok(t.sweep_requests(now)))
    }

    async fn create_schedule(&self, mut new: NewSchedule, now: Millis) -> Result<Schedule> {
        let request = new.request.take();
        self.write(|t| {
            let schedule_id = new.id.clone();
            let schedule = t.create_schedule(new, now)?;
            if let Some(mark) = &request {
                t.record_effect(mark, Effect::ScheduleCreated { schedule_id })?;
            }
            Ok(schedule)
        })
    }

    async fn update_schedule(
        &self,
        id: &ScheduleId,
        change: ScheduleChange,
        now: Millis,
    ) -> Result<Schedule> {
        self.write(|t| t.update_schedule(id, change, now))
    }

    async fn set_schedule_paused(
        &self,
        id: &ScheduleId,
        paused: bool,
        next_fire_at: Option<Millis>,
        now: Millis,
    ) -> Result<Schedule> {
        self.write(|t| t.set_schedule_paused(id, paused, next_fire_at, now))
    }

    async fn delete_schedule(&self, id: &ScheduleId, now: Millis) -> Result<()> {
        self.write(|t| t.delete_schedule(id, now))
    }

    async fn fire_schedule(
        &self,
        id: &ScheduleId,
        pass: DuePass,
        quota: RunQuota,
        now: Millis,
    ) -> Result<Fired> {
        self.write(|t| t.fire_schedule(id, pass, quota, now))
    }

    async fn trigger_schedule(
        &self,
        id: &ScheduleId,
        ids: FireIds,
        quota: RunQuota,
        request: Option<RequestMark>,
        now: Millis,
    ) -> Result<Fired> {
        self.write(|t| {
            let fired = t.trigger_schedule(id, ids, quota, now)?;
            if let Some(mark) = &request {
                let schedule_id = id.clone();
                t.record_effect(
                    mark,
                    Effect::ScheduleTriggered {
                        schedule_id,
                        slot: now,
                    },
                )?;
            }
            Ok(fired)
        })
    }
}

/// No other process can write its data: there is nothing to follow.
impl Changes for MemoryStore {}

#[async_trait]
impl WebhookAdmin for MemoryStore {
    async fn create_webhook(&self, mut webhook: NewWebhook, now: Millis) -> Result<Webhook> {
        let keyring = self.keyring()?;
        let request = webhook.request.take();
        self.write(|t| {
            let webhook_id = webhook.id.clone();
            let created = t.create_webhook(&keyring, webhook, now)?;
            if let Some(mark) = &request {
                t.record_effect(mark, Effect::WebhookCreated { webhook_id })?;
            }
            Ok(created)
        })
    }

    async fn get_webhook(&self, id: &WebhookId) -> Result<Webhook> {
        self.read(|t| t.get_webhook(id))
    }

    async fn webhooks(&self, tenant: &str) -> Result<Vec<Webhook>> {
        Ok(self.read(|t| t.webhooks(tenant)))
    }

    async fn delete_webhook(&self, id: &WebhookId) -> Result<()> {
        self.write(|t| t.delete_webhook(id))
    }

    async fn rotate_webhook_secret(
        &self,
        id: &WebhookId,
        secret: String,
        request: Option<RequestMark>,
    ) -> Result<()> {
        let keyring = self.keyring()?;
        self.write(|t| {
            t.rotate_webhook_secret(&keyring, id, &secret)?;
            if let Some(mark) = &request {
                let webhook_id = id.clone();
                t.record_effect(mark, Effect::SecretRotated { webhook_id })?;
            }
            Ok(())
        })
    }

    async fn seal_webhook_secrets(&self) -> Result<u64> {
        let keyring = self.keyring()?;
        self.write(|t| t.seal_webhook_secrets(&keyring))
    }

    async fn deliveries(
        &self,
        webhook_id: &WebhookId,
        status: Option<DeliveryStatus>,
        after: i64,
        limit: u32,
    ) -> Result<Vec<WebhookDelivery>> {
        self.read(|t| t.deliveries(webhook_id, status, after, limit))
    }

    async fn requeue_delivery(
        &self,
        webhook_id: &WebhookId,
        delivery_id: i64,
        now: Millis,
    ) -> Result<WebhookDelivery> {
        self.write(|t| t.requeue_delivery(webhook_id, delivery_id, now))
    }

    async fn requeue_dead_deliveries(&self, webhook_id: &WebhookId, now: Millis) -> Result<u64> {
        self.write(|t| t.requeue_dead_deliveries(webhook_id, now))
    }
}

#[async_trait]
impl Deliveries for MemoryStore {
    async fn bound_deliveries(&self, bounds: DeliveryBounds, now: Millis) -> Result<u64> {
        self.write(|t| t.bound_deliveries(bounds, now))
    }

    async fn queue_deliveries(&self, limit: u32, now: Millis) -> Result<u32> {
        self.write(|t| t.queue_deliveries(limit, now))
    }

    async fn claim_deliveries(
        &self,
        owner: &str,
        lease_until: Millis,
        limit: u32,
        now: Millis,
    ) -> Result<Vec<ClaimedDelivery>> {
        let keyring = self.keyring()?;
        self.write(|t| t.claim_deliveries(&keyring, owner, lease_until, limit, now))
    }

    async fn finish_deliveries(
        &self,
        finished: Vec<(DeliveryClaim, AttemptOutcome)>,
        now: Millis,
    ) -> Result<Vec<bool>> {
        self.write(|t| {
            (finished.into_iter())
                .map(|(claim, outcome)| t.finish_delivery(&claim, outcome, now))
                .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use ratchet_core::{MessageId, RunConfigSnapshot};
    use ratchet_store::WhenBusy;

    use super::*;

    fn message(session: &SessionId, run: &str, message: &str) -> NewRun {
        NewRun {
            session_id: session.clone(),
            run_id: RunId::from_suffix(run).unwrap(),
            message_id: MessageId::from_suffix(message).unwrap(),
            content: "hello".into(),
            config: RunConfigSnapshot::default(),
            when_busy: WhenBusy::Enqueue,
            quota: RunQuota::default(),
            trace: None,
            request: None,
        }
    }

    /// A message id is a message's primary key in SQL: a second message under it fails the
    /// submit at its last insert, after the run, the session's title and the run's state were
    /// written — and none of them stays.
    #[tokio::test]
    async fn a_write_refused_part_way_keeps_nothing_it_did() {
        let store = MemoryStore::new();
        let (first, second) = (
            SessionId::from_suffix("first").unwrap(),
            SessionId::from_suffix("second").unwrap(),
        );
        for session in [&first, &second] {
            store
                .create_session(session, SessionSpec::default(), 1)
                .await
                .unwrap();
        }
        store
            .submit_message(message(&first, "a", "same"), 2)
            .await
            .unwrap();
        let refused = store.submit_message(message(&second, "b", "same"), 3).await;
        assert!(matches!(refused, Err(Error::Backend(_))), "{refused:?}");

        let runs = store.list_runs().await.unwrap();
        assert_eq!(runs.len(), 1, "{runs:?}");
        let session = store.get_session(&second).await.unwrap();
        assert_eq!((session.title, session.active_run_id), (None, None));
        assert!(store.events_after(&second, 0, 10).await.unwrap().is_empty());
        assert_eq!(
            store.runs_with_jobs().await.unwrap(),
            [runs[0].run_id.clone()]
        );
    }
}
