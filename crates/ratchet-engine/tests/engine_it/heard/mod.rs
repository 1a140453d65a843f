//! A store that hears other processes' changes the way a PostgreSQL store does with
//! LISTEN/NOTIFY, except that the test is the notifier: it sends each `Change` itself. Every
//! other method is the wrapped store's.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use ratchet_core::step::{Reconciliation, Resumption};
use ratchet_core::{
    AgentState, ApprovalAnswer, ApprovalId, DeliveryStatus, EventDraft, Message, Millis, RunId,
    SessionId, StepRecord, StepResult, ToolOutcome, WebhookId,
};
use ratchet_store::{
    Answered, Approval, ApprovalStatus, CancelOutcome, Change, ChangeStream, Claim, ClaimedStep,
    Commit, DeadLetterAction, InboxChange, Intent, IntentRecord, Lease, MessageHit, NewRun,
    PauseOutcome, Reconciled, RecordedIntents, Result, ResumeOutcome, RunSummary, SearchScope,
    Session, SessionQuery, SessionSpec, StepMessages, Store, StoreStats, StoredEvent,
    StoredMessage, Submitted,
};
use ratchet_store::{
    AttemptOutcome, ClaimedDelivery, DeliveryBounds, DeliveryClaim, NewWebhook, Observation,
    Webhook, WebhookDelivery,
};
use tokio::sync::mpsc;

pub struct Heard {
    inner: Arc<dyn Store>,
    changes: Mutex<Option<mpsc::UnboundedReceiver<Change>>>,
}

impl Heard {
    /// The store, and the sender through which the test announces changes to it. Its change
    /// stream can be taken once; it ends when the sender is dropped.
    pub fn new(inner: Arc<dyn Store>) -> (Heard, mpsc::UnboundedSender<Change>) {
        let (sender, receiver) = mpsc::unbounded_channel();
        let heard = Heard {
            inner,
            changes: Mutex::new(Some(receiver)),
        };
        (heard, sender)
    }
}

#[async_trait]
impl Observation for Heard {
    async fn create_webhook(&self, webhook: NewWebhook, now: Millis) -> Result<Webhook> {
        self.inner.create_webhook(webhook, now).await
    }

    async fn get_webhook(&self, id: &WebhookId) -> Result<Webhook> {
        self.inner.get_webhook(id).await
    }

    async fn webhooks(&self, tenant: &str) -> Result<Vec<Webhook>> {
        self.inner.webhooks(tenant).await
    }

    async fn delete_webhook(&self, id: &WebhookId) -> Result<()> {
        self.inner.delete_webhook(id).await
    }

    async fn rotate_webhook_secret(&self, id: &WebhookId, secret: String) -> Result<()> {
        self.inner.rotate_webhook_secret(id, secret).await
    }

    async fn seal_webhook_secrets(&self) -> Result<u64> {
        self.inner.seal_webhook_secrets().await
    }

    async fn deliveries(
        &self,
        webhook_id: &WebhookId,
        status: Option<DeliveryStatus>,
        after: i64,
        limit: u32,
    ) -> Result<Vec<WebhookDelivery>> {
        self.inner
            .deliveries(webhook_id, status, after, limit)
            .await
    }

    async fn requeue_delivery(
        &self,
        webhook_id: &WebhookId,
        delivery_id: i64,
        now: Millis,
    ) -> Result<WebhookDelivery> {
        self.inner
            .requeue_delivery(webhook_id, delivery_id, now)
            .await
    }

    async fn requeue_dead_deliveries(&self, webhook_id: &WebhookId, now: Millis) -> Result<u64> {
        self.inner.requeue_dead_deliveries(webhook_id, now).await
    }

    async fn bound_deliveries(&self, bounds: DeliveryBounds, now: Millis) -> Result<u64> {
        self.inner.bound_deliveries(bounds, now).await
    }

    async fn queue_deliveries(&self, limit: u32, now: Millis) -> Result<u32> {
        self.inner.queue_deliveries(limit, now).await
    }

    async fn claim_deliveries(
        &self,
        owner: &str,
        lease_until: Millis,
        limit: u32,
        now: Millis,
    ) -> Result<Vec<ClaimedDelivery>> {
        self.inner
            .claim_deliveries(owner, lease_until, limit, now)
            .await
    }

    async fn finish_deliveries(
        &self,
        finished: Vec<(DeliveryClaim, AttemptOutcome)>,
        now: Millis,
    ) -> Result<Vec<bool>> {
        self.inner.finish_deliveries(finished, now).await
    }
}

#[async_trait]
impl Store for Heard {
    fn changes(&self) -> Option<ChangeStream> {
        let mut receiver = self.changes.lock().unwrap().take()?;
        Some(Box::pin(futures::stream::poll_fn(move |cx| {
            receiver.poll_recv(cx)
        })))
    }

    async fn create_session(
        &self,
        id: &SessionId,
        spec: SessionSpec,
        now: Millis,
    ) -> Result<Session> {
        self.inner.create_session(id, spec, now).await
    }

    async fn get_session(&self, id: &SessionId) -> Result<Session> {
        self.inner.get_session(id).await
    }

    async fn list_sessions(
        &self,
        tenant: &str,
        query: &SessionQuery,
        limit: u32,
    ) -> Result<Vec<Session>> {
        self.inner.list_sessions(tenant, query, limit).await
    }

    async fn rename_session(&self, id: &SessionId, title: &str) -> Result<Session> {
        self.inner.rename_session(id, title).await
    }

    async fn visible_messages(
        &self,
        session_id: &SessionId,
        after_position: i64,
        limit: u32,
    ) -> Result<Vec<StoredMessage>> {
        self.inner
            .visible_messages(session_id, after_position, limit)
            .await
    }

    async fn search_messages(
        &self,
        scope: SearchScope,
        query: &str,
        limit: u32,
    ) -> Result<Vec<MessageHit>> {
        self.inner.search_messages(scope, query, limit).await
    }

    async fn session_runs(
        &self,
        session_id: &SessionId,
        after: Option<&RunId>,
        limit: u32,
    ) -> Result<Vec<RunSummary>> {
        self.inner.session_runs(session_id, after, limit).await
    }

    async fn run_events_after(
        &self,
        run_id: &RunId,
        after_seq: i64,
        limit: u32,
    ) -> Result<Vec<StoredEvent>> {
        self.inner.run_events_after(run_id, after_seq, limit).await
    }

    async fn submit_message(&self, new: NewRun, now: Millis) -> Result<Submitted> {
        self.inner.submit_message(new, now).await
    }

    async fn claim_next(
        &self,
        lease: Lease,
        run: Option<&RunId>,
        now: Millis,
    ) -> Result<Option<ClaimedStep>> {
        self.inner.claim_next(lease, run, now).await
    }

    async fn heartbeat(&self, claim: &Claim, expires_at: Millis) -> Result<bool> {
        self.inner.heartbeat(claim, expires_at).await
    }

    async fn commit_step_within(
        &self,
        claim: &Claim,
        result: StepResult,
        continue_with: Option<Lease>,
        quota: ratchet_store::RunQuota,
        now: Millis,
    ) -> Result<Commit> {
        self.inner
            .commit_step_within(claim, result, continue_with, quota, now)
            .await
    }

    async fn retry_later(
        &self,
        claim: &Claim,
        available_at: Millis,
        event: EventDraft,
        now: Millis,
    ) -> Result<Option<Vec<StoredEvent>>> {
        self.inner
            .retry_later(claim, available_at, event, now)
            .await
    }

    async fn append_events(
        &self,
        session_id: &SessionId,
        run_id: &RunId,
        events: Vec<EventDraft>,
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        self.inner
            .append_events(session_id, run_id, events, now)
            .await
    }

    async fn record_intents(
        &self,
        claim: &Claim,
        intents: Vec<Intent>,
        events: Vec<EventDraft>,
        now: Millis,
    ) -> Result<RecordedIntents> {
        self.inner.record_intents(claim, intents, events, now).await
    }

    async fn record_outcome(
        &self,
        claim: &Claim,
        slot: u32,
        outcome: ToolOutcome,
        now: Millis,
    ) -> Result<()> {
        self.inner.record_outcome(claim, slot, outcome, now).await
    }

    async fn intents(&self, run_id: &RunId, step_index: u64) -> Result<Vec<IntentRecord>> {
        self.inner.intents(run_id, step_index).await
    }

    async fn request_cancel(&self, run_id: &RunId, now: Millis) -> Result<CancelOutcome> {
        self.inner.request_cancel(run_id, now).await
    }

    async fn request_pause(&self, run_id: &RunId, now: Millis) -> Result<PauseOutcome> {
        self.inner.request_pause(run_id, now).await
    }

    async fn resume_paused(&self, run_id: &RunId, now: Millis) -> Result<ResumeOutcome> {
        self.inner.resume_paused(run_id, now).await
    }

    async fn reconcile(
        &self,
        run_id: &RunId,
        call_id: &str,
        answer: Reconciliation,
        result: Option<String>,
        now: Millis,
    ) -> Result<Reconciled> {
        self.inner
            .reconcile(run_id, call_id, answer, result, now)
            .await
    }

    async fn resume_failed(
        &self,
        run_id: &RunId,
        how: Resumption,
        now: Millis,
    ) -> Result<Vec<StoredEvent>> {
        self.inner.resume_failed(run_id, how, now).await
    }

    async fn approvals(
        &self,
        tenant: &str,
        status: Option<ApprovalStatus>,
        after: Option<&ApprovalId>,
        limit: u32,
    ) -> Result<Vec<Approval>> {
        self.inner.approvals(tenant, status, after, limit).await
    }

    async fn get_approval(&self, id: &ApprovalId) -> Result<Approval> {
        self.inner.get_approval(id).await
    }

    async fn answer_approval(
        &self,
        id: &ApprovalId,
        answer: ApprovalAnswer,
        by: &str,
        now: Millis,
    ) -> Result<Answered> {
        self.inner.answer_approval(id, answer, by, now).await
    }

    async fn load_state(&self, run_id: &RunId) -> Result<AgentState> {
        self.inner.load_state(run_id).await
    }

    async fn run_tree(&self, run_id: &RunId) -> Result<Vec<ratchet_store::TreeNode>> {
        self.inner.run_tree(run_id).await
    }

    async fn admission(&self, run_id: &RunId) -> Result<ratchet_store::Admission> {
        self.inner.admission(run_id).await
    }

    async fn tree_spend(&self, run_id: &RunId) -> Result<ratchet_core::TreeSpend> {
        self.inner.tree_spend(run_id).await
    }

    async fn inbox(
        &self,
        session_id: &SessionId,
        status: Option<ratchet_core::InboxStatus>,
        after: i64,
        limit: u32,
    ) -> Result<Vec<ratchet_store::InboxEvent>> {
        self.inner.inbox(session_id, status, after, limit).await
    }

    async fn act_on_dead_letter(
        &self,
        session_id: &SessionId,
        event_id: i64,
        action: DeadLetterAction,
        by: &str,
        now: Millis,
    ) -> Result<InboxChange> {
        self.inner
            .act_on_dead_letter(session_id, event_id, action, by, now)
            .await
    }

    async fn emit_signal(
        &self,
        claim: &Claim,
        signal: ratchet_store::NewSignal,
        now: Millis,
    ) -> Result<ratchet_store::EmittedSignal> {
        self.inner.emit_signal(claim, signal, now).await
    }

    async fn pending_input(
        &self,
        session_id: &SessionId,
        now: Millis,
    ) -> Result<ratchet_store::PendingInput> {
        self.inner.pending_input(session_id, now).await
    }

    async fn serve_inboxes(&self, now: Millis) -> Result<ratchet_store::Served> {
        self.inner.serve_inboxes(now).await
    }

    async fn time_out_overdue(&self, now: Millis) -> Result<ratchet_store::TimedOut> {
        self.inner.time_out_overdue(now).await
    }

    async fn close_session(
        &self,
        id: &SessionId,
        how: ratchet_store::Closing,
        now: Millis,
    ) -> Result<ratchet_store::Closed> {
        self.inner.close_session(id, how, now).await
    }

    async fn history(&self, session_id: &SessionId) -> Result<Vec<Message>> {
        self.inner.history(session_id).await
    }

    async fn context(&self, session_id: &SessionId, run: &RunId) -> Result<Vec<StoredMessage>> {
        self.inner.context(session_id, run).await
    }

    async fn step_messages(&self, run_id: &RunId, step_index: u64) -> Result<StepMessages> {
        self.inner.step_messages(run_id, step_index).await
    }

    async fn list_runs(&self) -> Result<Vec<RunSummary>> {
        self.inner.list_runs().await
    }

    async fn steps(&self, run_id: &RunId) -> Result<Vec<StepRecord>> {
        self.inner.steps(run_id).await
    }

    async fn events_after(
        &self,
        session_id: &SessionId,
        after_seq: i64,
        limit: u32,
    ) -> Result<Vec<StoredEvent>> {
        self.inner.events_after(session_id, after_seq, limit).await
    }

    async fn events_within(
        &self,
        session_id: &SessionId,
        after_seq: i64,
        limit: u32,
        max_bytes: u64,
    ) -> Result<Vec<StoredEvent>> {
        self.inner
            .events_within(session_id, after_seq, limit, max_bytes)
            .await
    }

    async fn lease_owners(&self) -> Result<Vec<String>> {
        self.inner.lease_owners().await
    }

    async fn release_leases(&self, owner: &str) -> Result<u64> {
        self.inner.release_leases(owner).await
    }

    async fn runs_with_jobs(&self) -> Result<Vec<RunId>> {
        self.inner.runs_with_jobs().await
    }

    async fn stats(&self, now: Millis) -> Result<StoreStats> {
        self.inner.stats(now).await
    }
}
