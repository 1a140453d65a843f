//! The store's transaction bodies, written once for every SQL backend.
//!
//! An adapter (SQLite, PostgreSQL) supplies a `Backend`: how a body gets a transaction (or a
//! read connection), how its dialect differs (`Db`), its full-text search, and how it hears
//! of other processes' changes. `SqlStore` turns any backend into a `Store`; the decisions
//! stay in `ratchet-core`, the bodies only read, check fences and write.
//!
//! Each body runs inside one write transaction (or on a read connection) and is the whole of
//! one store operation. They live by aggregate: `sessions` (sessions and messages), `queue`
//! (submitting, quotas, steers, the next run), `runs`, `steps` (jobs, leases, the commit,
//! intents), `delegation`, `approvals`, `inbox` and `webhooks`, over `events` (appending and
//! reading a session's events) and `rows` (decoding columns).
//!
//! A write that changes anything of a session locks the session first (`Db::lock_session`):
//! with several processes on one database, that makes the writes of one session serial, so
//! every check a body makes (the active run, the committed step, the cancel flag) still holds
//! when the write lands. Claims never take that lock (they take only their job's row), so that
//! a commit, which holds the session and then waits for its job's row, cannot deadlock with one.

mod approvals;
mod bounds;
mod db;
mod delegation;
mod events;
mod inbox;
mod payload;
mod queue;
mod rows;
mod runs;
mod sessions;
mod steps;
mod webhooks;

use std::future::Future;
use std::sync::Arc;

use async_trait::async_trait;
use ratchet_core::step::{Reconciliation, Resumption};
use ratchet_core::{
    AgentState, ApprovalAnswer, ApprovalId, DeliveryStatus, EventDraft, InboxStatus, Message,
    Millis, RunId, SessionId, StepRecord, StepResult, ToolOutcome, TreeSpend, WebhookId,
};
use ratchet_store::{
    Admission, Answered, Approval, ApprovalStatus, AttemptOutcome, CancelOutcome, ChangeStream,
    Changes, Claim, ClaimedDelivery, ClaimedStep, Closed, Closing, Commit, DeadLetterAction,
    Deliveries, DeliveryBounds, DeliveryClaim, EmittedSignal, Error, InboxChange, InboxEvent,
    Intent, IntentRecord, Keyring, Lease, MessageHit, NewRun, NewSignal, NewWebhook, PauseOutcome,
    PendingInput, Reads, Reconciled, RecordedIntents, ResumeOutcome, RunQuota, RunSummary,
    SearchScope, Served, Session, SessionQuery, SessionSpec, StepMessages, StoreStats, StoredEvent,
    StoredMessage, Submitted, TimedOut, TreeNode, Webhook, WebhookAdmin, WebhookDelivery, Writes,
};

pub use db::{Announcement, Configs, Db, Param, Row, Value};
pub use rows::sql_enum;

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How an adapter runs the transaction bodies.
pub trait Backend: Send + Sync + 'static {
    /// Runs `body` in a write transaction that commits when it returns `Ok` and keeps
    /// nothing when it returns an error.
    fn write<R, F>(&self, body: F) -> impl Future<Output = Result<R>> + Send
    where
        R: Send + 'static,
        F: FnOnce(&dyn Db) -> Result<R> + Send + 'static;

    /// Runs `body` on a connection that sees committed data.
    fn read<R, F>(&self, body: F) -> impl Future<Output = Result<R>> + Send
    where
        R: Send + 'static,
        F: FnOnce(&dyn Db) -> Result<R> + Send + 'static;

    /// See `Store::search_messages`.
    fn search_messages(
        &self,
        scope: SearchScope,
        query: String,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<MessageHit>>> + Send;

    /// See `Store::changes`.
    fn changes(&self) -> Option<ChangeStream> {
        None
    }
}

/// A `Store` over a SQL backend.
pub struct SqlStore<B> {
    backend: B,
    /// Seals webhook secrets; without it, nothing that reads or writes one works.
    secrets: Option<Arc<Keyring>>,
}

impl<B: Backend> SqlStore<B> {
    pub fn new(backend: B) -> SqlStore<B> {
        SqlStore {
            backend,
            secrets: None,
        }
    }

    /// The same store, sealing webhook secrets with `keyring`.
    pub fn with_secrets(self, keyring: Keyring) -> SqlStore<B> {
        SqlStore {
            secrets: Some(Arc::new(keyring)),
            ..self
        }
    }

    /// The keyring, for the operations that seal or open a webhook secret.
    fn keyring(&self) -> Result<Arc<Keyring>> {
        self.secrets.clone().ok_or_else(|| {
            Error::Secrets(
                "this store was opened without a key, and webhook secrets are only stored \
                 sealed; open it with one (`SqlStore::with_secrets`)"
                    .to_owned(),
            )
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }
}

#[async_trait]
impl<B: Backend> Reads for SqlStore<B> {
    async fn get_session(&self, id: &SessionId) -> Result<Session> {
        let id = id.clone();
        self.backend
            .read(move |c| sessions::get_session(c, &id))
            .await
    }

    async fn list_sessions(
        &self,
        tenant: &str,
        query: &SessionQuery,
        limit: u32,
    ) -> Result<Vec<Session>> {
        let (tenant, query) = (tenant.to_owned(), query.clone());
        self.backend
            .read(move |c| sessions::list_sessions(c, &tenant, &query, limit))
            .await
    }

    async fn visible_messages(
        &self,
        session_id: &SessionId,
        after_position: i64,
        limit: u32,
    ) -> Result<Vec<StoredMessage>> {
        let session_id = session_id.clone();
        self.backend
            .read(move |c| sessions::visible_messages(c, &session_id, after_position, limit))
            .await
    }

    async fn search_messages(
        &self,
        scope: SearchScope,
        query: &str,
        limit: u32,
    ) -> Result<Vec<MessageHit>> {
        self.backend
            .search_messages(scope, query.to_owned(), limit)
            .await
    }

    async fn session_runs(
        &self,
        session_id: &SessionId,
        after: Option<&RunId>,
        limit: u32,
    ) -> Result<Vec<RunSummary>> {
        let (session_id, after) = (session_id.clone(), after.cloned());
        self.backend
            .read(move |c| runs::session_runs(c, &session_id, after.as_ref(), limit))
            .await
    }

    async fn run_events_after(
        &self,
        run_id: &RunId,
        after_seq: i64,
        limit: u32,
    ) -> Result<Vec<StoredEvent>> {
        let run_id = run_id.clone();
        self.backend
            .read(move |c| events::run_events_after(c, &run_id, after_seq, limit))
            .await
    }

    async fn intents(&self, run_id: &RunId, step_index: u64) -> Result<Vec<IntentRecord>> {
        let run_id = run_id.clone();
        self.backend
            .read(move |c| steps::intents(c, &run_id, step_index))
            .await
    }

    async fn approvals(
        &self,
        tenant: &str,
        status: Option<ApprovalStatus>,
        after: Option<&ApprovalId>,
        limit: u32,
    ) -> Result<Vec<Approval>> {
        let (tenant, after) = (tenant.to_owned(), after.cloned());
        self.backend
            .read(move |c| approvals::approvals(c, &tenant, status, after.as_ref(), limit))
            .await
    }

    async fn get_approval(&self, id: &ApprovalId) -> Result<Approval> {
        let id = id.clone();
        self.backend
            .read(move |c| approvals::get_approval(c, &id))
            .await
    }

    async fn load_state(&self, run_id: &RunId) -> Result<AgentState> {
        let run_id = run_id.clone();
        self.backend
            .read(move |c| runs::load_state(c, &run_id))
            .await
    }

    async fn run_tree(&self, run_id: &RunId) -> Result<Vec<TreeNode>> {
        let run_id = run_id.clone();
        self.backend
            .read(move |c| delegation::run_tree(c, &run_id))
            .await
    }

    async fn admission(&self, run_id: &RunId) -> Result<Admission> {
        let run_id = run_id.clone();
        self.backend
            .read(move |c| delegation::admission(c, &run_id))
            .await
    }

    async fn tree_spend(&self, run_id: &RunId) -> Result<TreeSpend> {
        let run_id = run_id.clone();
        self.backend
            .read(move |c| delegation::tree_spend(c, &run_id))
            .await
    }

    async fn inbox(
        &self,
        session_id: &SessionId,
        status: Option<InboxStatus>,
        after: i64,
        limit: u32,
    ) -> Result<Vec<InboxEvent>> {
        let session_id = session_id.clone();
        self.backend
            .read(move |c| inbox::list(c, &session_id, status, after, limit))
            .await
    }

    async fn pending_input(&self, session_id: &SessionId, now: Millis) -> Result<PendingInput> {
        let session_id = session_id.clone();
        self.backend
            .read(move |c| inbox::pending_input(c, &session_id, now))
            .await
    }

    async fn context(&self, session_id: &SessionId, run: &RunId) -> Result<Vec<StoredMessage>> {
        let (session_id, run) = (session_id.clone(), run.clone());
        self.backend
            .read(move |c| sessions::context(c, &session_id, &run))
            .await
    }

    async fn step_messages(&self, run_id: &RunId, step_index: u64) -> Result<StepMessages> {
        let run_id = run_id.clone();
        self.backend
            .read(move |c| sessions::step_messages(c, &run_id, step_index))
            .await
    }

    async fn history(&self, session_id: &SessionId) -> Result<Vec<Message>> {
        let session_id = session_id.clone();
        self.backend
            .read(move |c| sessions::history(c, &session_id))
            .await
    }

    async fn list_runs(&self) -> Result<Vec<RunSummary>> {
        self.backend.read(runs::list_runs).await
    }

    async fn steps(&self, run_id: &RunId) -> Result<Vec<StepRecord>> {
        let run_id = run_id.clone();
        self.backend.read(move |c| steps::steps(c, &run_id)).await
    }

    async fn events_after(
        &self,
        session_id: &SessionId,
        after_seq: i64,
        limit: u32,
    ) -> Result<Vec<StoredEvent>> {
        let session_id = session_id.clone();
        self.backend
            .read(move |c| events::events_after(c, &session_id, after_seq, limit))
            .await
    }

    async fn events_within(
        &self,
        session_id: &SessionId,
        after_seq: i64,
        limit: u32,
        max_bytes: u64,
    ) -> Result<Vec<StoredEvent>> {
        let session_id = session_id.clone();
        self.backend
            .read(move |c| events::events_within(c, &session_id, after_seq, limit, max_bytes))
            .await
    }

    async fn lease_owners(&self) -> Result<Vec<String>> {
        self.backend.read(steps::lease_owners).await
    }

    async fn stats(&self, now: Millis) -> Result<StoreStats> {
        self.backend.read(move |c| runs::stats(c, now)).await
    }

    async fn runs_with_jobs(&self) -> Result<Vec<RunId>> {
        self.backend.read(steps::runs_with_jobs).await
    }
}

#[async_trait]
impl<B: Backend> Writes for SqlStore<B> {
    async fn create_session(
        &self,
        id: &SessionId,
        spec: SessionSpec,
        now: Millis,
    ) -> Result<Session> {
        let id = id.clone();
        self.backend
            .write(move |c| sessions::create_session(c, &id, spec, now))
            .await
    }

    async fn rename_session(&self, id: &SessionId, title: &str) -> Result<Session> {
        let (id, title) = (id.clone(), title.to_owned());
        self.backend
            .write(move |c| sessions::rename_session(c, &id, &title))
            .await
    }

    async fn submit_message(&self, new: NewRun, now: Millis) -> Result<Submitted> {
        self.backend
            .write(move |c| queue::submit_message(c, new, now))
            .await
    }

    async fn claim_next(
        &self,
        lease: Lease,
        run: Option<&RunId>,
        now: Millis,
    ) -> Result<Option<ClaimedStep>> {
        let run = run.cloned();
        self.backend
            .write(move |c| steps::claim_next(c, &lease, run.as_ref(), now))
            .await
    }

    async fn heartbeat(&self, claim: &Claim, expires_at: Millis) -> Result<bool> {
        let claim = claim.clone();
        self.backend
            .write(move |c| steps::heartbeat(c, &claim, expires_at))
            .await
    }

    async fn commit_step_within(
        &self,
        claim: &Claim,
        result: StepResult,
        continue_with: Option<Lease>,
        quota: RunQuota,
        now: Millis,
    ) -> Result<Commit> {
        let claim = claim.clone();
        let encoded = steps::EncodedStep::of(&result)?;
        self.backend
            .write(move |c| {
                steps::commit_step(c, &claim, result, encoded, continue_with, quota, now)
            })
            .await
    }

    async fn retry_later(
        &self,
        claim: &Claim,
        available_at: Millis,
        event: EventDraft,
        now: Millis,
    ) -> Result<Option<Vec<StoredEvent>>> {
        let claim = claim.clone();
        self.backend
            .write(move |c| steps::retry_later(c, &claim, available_at, event, now))
            .await
    }

    async fn append_events(
        &self,
        session_id: &SessionId,
        run_id: &RunId,
        events: Vec<EventDraft>,
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        let (session_id, run_id) = (session_id.clone(), run_id.clone());
        self.backend
            .write(move |c| events::insert_events(c, &session_id, Some(&run_id), &events, now))
            .await
    }

    async fn record_intents(
        &self,
        claim: &Claim,
        intents: Vec<Intent>,
        events: Vec<EventDraft>,
        now: Millis,
    ) -> Result<RecordedIntents> {
        let claim = claim.clone();
        self.backend
            .write(move |c| steps::record_intents(c, &claim, &intents, &events, now))
            .await
    }

    async fn record_outcome(
        &self,
        claim: &Claim,
        slot: u32,
        outcome: ToolOutcome,
        now: Millis,
    ) -> Result<()> {
        let claim = claim.clone();
        self.backend
            .write(move |c| steps::record_outcome(c, &claim, slot, &outcome, now))
            .await
    }

    async fn request_cancel(&self, run_id: &RunId, now: Millis) -> Result<CancelOutcome> {
        let run_id = run_id.clone();
        self.backend
            .write(move |c| runs::request_cancel(c, &run_id, now))
            .await
    }

    async fn request_pause(&self, run_id: &RunId, now: Millis) -> Result<PauseOutcome> {
        let run_id = run_id.clone();
        self.backend
            .write(move |c| runs::request_pause(c, &run_id, now))
            .await
    }

    async fn resume_paused(&self, run_id: &RunId, now: Millis) -> Result<ResumeOutcome> {
        let run_id = run_id.clone();
        self.backend
            .write(move |c| runs::resume_paused(c, &run_id, now))
            .await
    }

    async fn reconcile(
        &self,
        run_id: &RunId,
        call_id: &str,
        answer: Reconciliation,
        result: Option<String>,
        now: Millis,
    ) -> Result<Reconciled> {
        let (run_id, call_id) = (run_id.clone(), call_id.to_owned());
        self.backend
            .write(move |c| runs::reconcile(c, &run_id, &call_id, answer, result, now))
            .await
    }

    async fn resume_failed(
        &self,
        run_id: &RunId,
        how: Resumption,
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        let run_id = run_id.clone();
        self.backend
            .write(move |c| runs::resume_failed(c, &run_id, how, now))
            .await
    }

    async fn answer_approval(
        &self,
        id: &ApprovalId,
        answer: ApprovalAnswer,
        by: &str,
        now: Millis,
    ) -> Result<Answered> {
        let (id, by) = (id.clone(), by.to_owned());
        self.backend
            .write(move |c| approvals::answer_approval(c, &id, answer, &by, now))
            .await
    }

    async fn act_on_dead_letter(
        &self,
        session_id: &SessionId,
        event_id: i64,
        action: DeadLetterAction,
        by: &str,
        now: Millis,
    ) -> Result<InboxChange> {
        let (session_id, by) = (session_id.clone(), by.to_owned());
        self.backend
            .write(move |c| inbox::act_on_dead_letter(c, &session_id, event_id, action, &by, now))
            .await
    }

    async fn emit_signal(
        &self,
        claim: &Claim,
        signal: NewSignal,
        now: Millis,
    ) -> Result<EmittedSignal> {
        let claim = claim.clone();
        self.backend
            .write(move |c| inbox::emit_signal(c, &claim, signal, now))
            .await
    }

    async fn serve_inboxes(&self, now: Millis) -> Result<Served> {
        let mut served = Served::default();
        if self
            .backend
            .read(move |c| inbox::anything_expired(c, now))
            .await?
        {
            served.events = self.backend.write(move |c| inbox::expire(c, now)).await?;
        }
        let candidates = self
            .backend
            .read(move |c| inbox::servable_sessions(c, now))
            .await?;
        for session in candidates {
            let (events, started) = self
                .backend
                .write(move |c| inbox::serve_session(c, &session, now))
                .await?;
            served.events.extend(events);
            served.started.extend(started);
        }
        Ok(served)
    }

    async fn time_out_overdue(&self, now: Millis) -> Result<TimedOut> {
        let overdue = self
            .backend
            .read(move |c| runs::overdue_runs(c, now))
            .await?;
        let mut timed_out = TimedOut::default();
        for run in overdue {
            let ended = self
                .backend
                .write(move |c| runs::time_out_run(c, &run, now))
                .await?;
            timed_out.events.extend(ended.events);
            timed_out.ended.extend(ended.ended);
            timed_out.enqueued |= ended.enqueued;
        }
        Ok(timed_out)
    }

    async fn close_session(&self, id: &SessionId, how: Closing, now: Millis) -> Result<Closed> {
        let id = id.clone();
        self.backend
            .write(move |c| inbox::close_session(c, &id, how, now))
            .await
    }

    async fn release_leases(&self, owner: &str) -> Result<u64> {
        let owner = owner.to_owned();
        self.backend
            .write(move |c| steps::release_leases(c, &owner))
            .await
    }
}

impl<B: Backend> Changes for SqlStore<B> {
    fn changes(&self) -> Option<ChangeStream> {
        self.backend.changes()
    }
}

#[async_trait]
impl<B: Backend> WebhookAdmin for SqlStore<B> {
    async fn create_webhook(&self, webhook: NewWebhook, now: Millis) -> Result<Webhook> {
        let keyring = self.keyring()?;
        self.backend
            .write(move |c| webhooks::create_webhook(c, &keyring, webhook, now))
            .await
    }

    async fn get_webhook(&self, id: &WebhookId) -> Result<Webhook> {
        let id = id.clone();
        self.backend
            .read(move |c| webhooks::get_webhook(c, &id))
            .await
    }

    async fn webhooks(&self, tenant: &str) -> Result<Vec<Webhook>> {
        let tenant = tenant.to_owned();
        self.backend
            .read(move |c| webhooks::webhooks(c, &tenant))
            .await
    }

    async fn delete_webhook(&self, id: &WebhookId) -> Result<()> {
        let id = id.clone();
        self.backend
            .write(move |c| webhooks::delete_webhook(c, &id))
            .await
    }

    async fn rotate_webhook_secret(&self, id: &WebhookId, secret: String) -> Result<()> {
        let keyring = self.keyring()?;
        let id = id.clone();
        self.backend
            .write(move |c| webhooks::rotate_webhook_secret(c, &keyring, &id, &secret))
            .await
    }

    async fn seal_webhook_secrets(&self) -> Result<u64> {
        let keyring = self.keyring()?;
        self.backend
            .write(move |c| webhooks::seal_webhook_secrets(c, &keyring))
            .await
    }

    async fn deliveries(
        &self,
        webhook_id: &WebhookId,
        status: Option<DeliveryStatus>,
        after: i64,
        limit: u32,
    ) -> Result<Vec<WebhookDelivery>> {
        let webhook_id = webhook_id.clone();
        self.backend
            .read(move |c| webhooks::deliveries(c, &webhook_id, status, after, limit))
            .await
    }

    async fn requeue_delivery(
        &self,
        webhook_id: &WebhookId,
        delivery_id: i64,
        now: Millis,
    ) -> Result<WebhookDelivery> {
        let webhook_id = webhook_id.clone();
        self.backend
            .write(move |c| webhooks::requeue_delivery(c, &webhook_id, delivery_id, now))
            .await
    }

    async fn requeue_dead_deliveries(&self, webhook_id: &WebhookId, now: Millis) -> Result<u64> {
        let webhook_id = webhook_id.clone();
        self.backend
            .write(move |c| webhooks::requeue_dead_deliveries(c, &webhook_id, now))
            .await
    }
}

#[async_trait]
impl<B: Backend> Deliveries for SqlStore<B> {
    async fn bound_deliveries(&self, bounds: DeliveryBounds, now: Millis) -> Result<u64> {
        self.backend
            .write(move |c| webhooks::bound_deliveries(c, bounds, now))
            .await
    }

    async fn queue_deliveries(&self, limit: u32, now: Millis) -> Result<u32> {
        if !self.backend.read(webhooks::anything_to_queue).await? {
            return Ok(0);
        }
        self.backend
            .write(move |c| webhooks::queue_deliveries(c, limit, now))
            .await
    }

    async fn claim_deliveries(
        &self,
        owner: &str,
        lease_until: Millis,
        limit: u32,
        now: Millis,
    ) -> Result<Vec<ClaimedDelivery>> {
        let keyring = self.keyring()?;
        let owner = owner.to_owned();
        self.backend
            .write(move |c| {
                webhooks::claim_deliveries(c, &keyring, &owner, lease_until, limit, now)
            })
            .await
    }

    async fn finish_deliveries(
        &self,
        finished: Vec<(DeliveryClaim, AttemptOutcome)>,
        now: Millis,
    ) -> Result<Vec<bool>> {
        self.backend
            .write(move |c| {
                (finished.into_iter())
                    .map(|(claim, outcome)| webhooks::finish_delivery(c, &claim, outcome, now))
                    .collect()
            })
            .await
    }
}
