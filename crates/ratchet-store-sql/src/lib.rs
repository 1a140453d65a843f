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
//! intents), `delegation`, `approvals`, `inbox`, `webhooks` and `schedules`, over `events` (appending and
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
mod fork;
mod inbox;
mod payload;
mod queue;
mod requests;
mod rows;
mod runs;
mod schedules;
mod sessions;
mod steps;
mod timer;
mod webhooks;

use std::future::Future;
use std::sync::Arc;

use async_trait::async_trait;
use ratchet_core::step::{Reconciliation, Resumption};
use ratchet_core::{
    AgentState, ApprovalAnswer, ApprovalId, DeliveryStatus, EventDraft, InboxStatus, Message,
    Millis, RunId, ScheduleId, SessionId, StepRecord, StepResult, ToolOutcome, TreeSpend,
    WebhookId,
};
use ratchet_store::{
    Admission, Answered, Approval, ApprovalStatus, AttemptOutcome, CancelOutcome, ChangeStream,
    Changes, Claim, ClaimedDelivery, ClaimedStep, Closed, Closing, Commit, DeadLetterAction,
    Deliveries, DeliveryBounds, DeliveryClaim, DuePass, EmittedSignal, Error, FireIds, Fired,
    Forked, InboxChange, InboxEvent, Intent, IntentRecord, KeyedRequest, Keyring, Lease,
    MessageHit, NewFork, NewRun, NewSchedule, NewSignal, NewWebhook, PauseOutcome, PendingInput,
    Reads, Reconciled, RecordedIntents, RequestClaim, RequestMark, ResumeOutcome, RunQuota,
    RunSummary, Schedule, ScheduleChange, ScheduleSlot, SearchScope, Served, Session, SessionQuery,
    SessionSpec, SlotCursor, StepMessages, StoreStats, StoredEvent, StoredMessage, StoredResponse,
    Submitted, TimedOut, TreeNode, Webhook, WebhookAdmin, WebhookDelivery, Writes,
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

    /// See `Reads::search_messages`.
    fn search_messages(
        &self,
        scope: SearchScope,
        query: String,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<MessageHit>>> + Send;

    /// See `Changes::changes`.
    fn changes(&self) -> Option<ChangeStream> {
        None
    }

    /// See `Reads::database_now`.
    fn database_now(&self) -> impl Future<Output = Result<Option<Millis>>> + Send {
        std::future::ready(Ok(None))
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
        (self.secrets.clone()).ok_or_else(|| Error::no_keyring("SqlStore::with_secrets"))
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }
}

/// Implements a store role for `SqlStore`: each listed operation becomes a method that runs one
/// transaction body, in a read (`read`) or a write transaction (`write`). The entry
///
/// ```text
/// read name(arg: Type, …) -> Result<T> = module::body(expr, …);
/// ```
///
/// is `async fn name(&self, arg: Type, …) -> Result<T>` calling `module::body(c, expr, …)`, `c`
/// being the body's `&dyn Db`. A body runs apart from the call (it must be `'static`), so an
/// argument the method borrows is listed `arg: &Type => clone` (or `=> to_owned`, `=> cloned`):
/// the method takes that owned copy first, and the expressions use the copy. The methods that
/// do more than forward come after the list, written out.
macro_rules! forward {
    (
        impl $role:ident {
            $(
                $how:ident $name:ident($($arg:ident: $ty:ty $(=> $own:ident)?),*) -> $ret:ty
                    = $module:ident::$body:ident($($pass:expr),*);
            )*
        }
        $($by_hand:tt)*
    ) => {
        #[async_trait]
        impl<B: Backend> $role for SqlStore<B> {
            $(
                async fn $name(&self, $($arg: $ty),*) -> $ret {
                    $($(let $arg = $arg.$own();)?)*
                    self.backend.$how(move |c| $module::$body(c, $($pass),*)).await
                }
            )*
            $($by_hand)*
        }
    };
}

forward! {
    impl Reads {
        read get_session(id: &SessionId => clone) -> Result<Session>
            = sessions::get_session(&id);
        read list_sessions(tenant: &str => to_owned, query: &SessionQuery => clone, limit: u32)
            -> Result<Vec<Session>> = sessions::list_sessions(&tenant, &query, limit);
        read visible_messages(session_id: &SessionId => clone, after_position: i64, limit: u32)
            -> Result<Vec<StoredMessage>>
            = sessions::visible_messages(&session_id, after_position, limit);
        read session_runs(
            session_id: &SessionId => clone,
            after: Option<&RunId> => cloned,
            limit: u32
        ) -> Result<Vec<RunSummary>> = runs::session_runs(&session_id, after.as_ref(), limit);
        read run_events_after(run_id: &RunId => clone, after_seq: i64, limit: u32)
            -> Result<Vec<StoredEvent>> = events::run_events_after(&run_id, after_seq, limit);
        read intents(run_id: &RunId => clone, step_index: u64) -> Result<Vec<IntentRecord>>
            = steps::intents(&run_id, step_index);
        read approvals(
            tenant: &str => to_owned,
            status: Option<ApprovalStatus>,
            after: Option<&ApprovalId> => cloned,
            limit: u32
        ) -> Result<Vec<Approval>> = approvals::approvals(&tenant, status, after.as_ref(), limit);
        read get_approval(id: &ApprovalId => clone) -> Result<Approval>
            = approvals::get_approval(&id);
        read load_state(run_id: &RunId => clone) -> Result<AgentState>
            = runs::load_state(&run_id);
        read run_tree(run_id: &RunId => clone) -> Result<Vec<TreeNode>>
            = delegation::run_tree(&run_id);
        read admission(run_id: &RunId => clone) -> Result<Admission>
            = delegation::admission(&run_id);
        read tree_spend(run_id: &RunId => clone) -> Result<TreeSpend>
            = delegation::tree_spend(&run_id);
        read inbox(
            session_id: &SessionId => clone,
            status: Option<InboxStatus>,
            after: i64,
            limit: u32
        ) -> Result<Vec<InboxEvent>> = inbox::list(&session_id, status, after, limit);
        read pending_input(session_id: &SessionId => clone, now: Millis) -> Result<PendingInput>
            = inbox::pending_input(&session_id, now);
        read context(session_id: &SessionId => clone, run: &RunId => clone)
            -> Result<Vec<StoredMessage>> = sessions::context(&session_id, &run);
        read step_messages(run_id: &RunId => clone, step_index: u64) -> Result<StepMessages>
            = sessions::step_messages(&run_id, step_index);
        read history(session_id: &SessionId => clone) -> Result<Vec<Message>>
            = sessions::history(&session_id);
        read list_runs() -> Result<Vec<RunSummary>> = runs::list_runs();
        read steps(run_id: &RunId => clone) -> Result<Vec<StepRecord>>
            = steps::steps(&run_id);
        read events_after(session_id: &SessionId => clone, after_seq: i64, limit: u32)
            -> Result<Vec<StoredEvent>> = events::events_after(&session_id, after_seq, limit);
        read events_within(
            session_id: &SessionId => clone,
            after_seq: i64,
            limit: u32,
            max_bytes: u64
        ) -> Result<Vec<StoredEvent>>
            = events::events_within(&session_id, after_seq, limit, max_bytes);
        read lease_owners() -> Result<Vec<String>> = steps::lease_owners();
        read stats(now: Millis) -> Result<StoreStats> = runs::stats(now);
        read runs_with_jobs() -> Result<Vec<RunId>> = steps::runs_with_jobs();
        read get_schedule(id: &ScheduleId => clone) -> Result<Schedule>
            = schedules::get_schedule(&id);
        read schedules(tenant: &str => to_owned, after: Option<&ScheduleId> => cloned, limit: u32)
            -> Result<Vec<Schedule>> = schedules::schedules(&tenant, after.as_ref(), limit);
        read due_schedules(now: Millis, limit: u32) -> Result<Vec<Schedule>>
            = schedules::due_schedules(now, limit);
        read next_schedule_fire() -> Result<Option<Millis>> = schedules::next_schedule_fire();
        read schedule_slots(id: &ScheduleId => clone, before: Option<SlotCursor>, limit: u32)
            -> Result<Vec<ScheduleSlot>> = schedules::schedule_slots(&id, before, limit);
    }

    async fn database_now(&self) -> Result<Option<Millis>> {
        self.backend.database_now().await
    }

    // Search is the backend's own.
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
}

forward! {
    impl Writes {
        write create_session(id: &SessionId => clone, spec: SessionSpec, now: Millis)
            -> Result<Session> = sessions::create_session(&id, spec, now);
        write rename_session(id: &SessionId => clone, title: &str => to_owned) -> Result<Session>
            = sessions::rename_session(&id, &title);
        write submit_message(new: NewRun, now: Millis) -> Result<Submitted>
            = queue::submit_message(new, now);
        write fork_run(new: NewFork, now: Millis) -> Result<Forked> = fork::fork_run(new, now);
        write claim_next(lease: Lease, run: Option<&RunId> => cloned, now: Millis)
            -> Result<Option<ClaimedStep>> = steps::claim_next(&lease, run.as_ref(), now);
        write heartbeat(claim: &Claim => clone, expires_at: Millis) -> Result<bool>
            = steps::heartbeat(&claim, expires_at);
        write retry_later(
            claim: &Claim => clone,
            available_at: Millis,
            event: EventDraft,
            now: Millis
        ) -> Result<Option<Vec<StoredEvent>>>
            = steps::retry_later(&claim, available_at, event, now);
        write append_events(
            session_id: &SessionId => clone,
            run_id: &RunId => clone,
            events: Vec<EventDraft>,
            now: Millis
        ) -> Result<Vec<StoredEvent>>
            = events::insert_events(&session_id, Some(&run_id), &events, now);
        write record_intents(
            claim: &Claim => clone,
            intents: Vec<Intent>,
            events: Vec<EventDraft>,
            now: Millis
        ) -> Result<RecordedIntents> = steps::record_intents(&claim, &intents, &events, now);
        write record_outcome(claim: &Claim => clone, slot: u32, outcome: ToolOutcome, now: Millis)
            -> Result<()> = steps::record_outcome(&claim, slot, &outcome, now);
        write request_cancel(run_id: &RunId => clone, now: Millis) -> Result<CancelOutcome>
            = runs::request_cancel(&run_id, now);
        write request_pause(run_id: &RunId => clone, now: Millis) -> Result<PauseOutcome>
            = runs::request_pause(&run_id, now);
        write resume_paused(run_id: &RunId => clone, now: Millis) -> Result<ResumeOutcome>
            = runs::resume_paused(&run_id, now);
        write reconcile(
            run_id: &RunId => clone,
            call_id: &str => to_owned,
            answer: Reconciliation,
            result: Option<String>,
            now: Millis
        ) -> Result<Reconciled> = runs::reconcile(&run_id, &call_id, answer, result, now);
        write resume_failed(
            run_id: &RunId => clone,
            how: Resumption,
            request: Option<RequestMark>,
            now: Millis
        ) -> Result<Vec<StoredEvent>> = runs::resume_failed(&run_id, how, request, now);
        write answer_approval(
            id: &ApprovalId => clone,
            answer: ApprovalAnswer,
            by: &str => to_owned,
            now: Millis
        ) -> Result<Answered> = approvals::answer_approval(&id, answer, &by, now);
        write act_on_dead_letter(
            session_id: &SessionId => clone,
            event_id: i64,
            action: DeadLetterAction,
            by: &str => to_owned,
            now: Millis
        ) -> Result<InboxChange>
            = inbox::act_on_dead_letter(&session_id, event_id, action, &by, now);
        write emit_signal(claim: &Claim => clone, signal: NewSignal, now: Millis)
            -> Result<EmittedSignal> = inbox::emit_signal(&claim, signal, now);
        write close_session(id: &SessionId => clone, how: Closing, now: Millis) -> Result<Closed>
            = inbox::close_session(&id, how, now);
        write release_leases(owner: &str => to_owned) -> Result<u64>
            = steps::release_leases(&owner);
        write begin_request(request: KeyedRequest, now: Millis) -> Result<RequestClaim>
            = requests::begin_request(request, now);
        write finish_request(mark: &RequestMark => clone, response: StoredResponse) -> Result<bool>
            = requests::finish_request(&mark, &response);
        write abandon_request(mark: &RequestMark => clone) -> Result<()>
            = requests::abandon_request(&mark);
        write sweep_requests(now: Millis) -> Result<u64>
            = requests::sweep_requests(now);
        write create_schedule(new: NewSchedule, now: Millis) -> Result<Schedule>
            = schedules::create_schedule(new, now);
        write update_schedule(id: &ScheduleId => clone, change: ScheduleChange, now: Millis)
            -> Result<Schedule> = schedules::update_schedule(&id, change, now);
        write set_schedule_paused(
            id: &ScheduleId => clone,
            paused: bool,
            next_fire_at: Option<Millis>,
            now: Millis
        ) -> Result<Schedule> = schedules::set_schedule_paused(&id, paused, next_fire_at, now);
        write delete_schedule(id: &ScheduleId => clone, now: Millis) -> Result<()>
            = schedules::delete_schedule(&id, now);
        write fire_schedule(id: &ScheduleId => clone, pass: DuePass, quota: RunQuota, now: Millis)
            -> Result<Fired> = schedules::fire_schedule(&id, pass, quota, now);
        write trigger_schedule(id: &ScheduleId => clone, ids: FireIds, quota: RunQuota, request: Option<RequestMark>, now: Millis)
            -> Result<Fired> = schedules::trigger_schedule(&id, ids, quota, request.as_ref(), now);
    }

    // What a step's commit writes as JSON is encoded before its transaction (`EncodedStep`).
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

    // Expiry first, then one write per session that has something to serve.
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

    // One write per overdue run.
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
}

impl<B: Backend> Changes for SqlStore<B> {
    fn changes(&self) -> Option<ChangeStream> {
        self.backend.changes()
    }
}

forward! {
    impl WebhookAdmin {
        read get_webhook(id: &WebhookId => clone) -> Result<Webhook>
            = webhooks::get_webhook(&id);
        read webhooks(tenant: &str => to_owned) -> Result<Vec<Webhook>>
            = webhooks::webhooks(&tenant);
        write delete_webhook(id: &WebhookId => clone) -> Result<()>
            = webhooks::delete_webhook(&id);
        read deliveries(
            webhook_id: &WebhookId => clone,
            status: Option<DeliveryStatus>,
            after: i64,
            limit: u32
        ) -> Result<Vec<WebhookDelivery>>
            = webhooks::deliveries(&webhook_id, status, after, limit);
        write requeue_delivery(webhook_id: &WebhookId => clone, delivery_id: i64, now: Millis)
            -> Result<WebhookDelivery>
            = webhooks::requeue_delivery(&webhook_id, delivery_id, now);
        write requeue_dead_deliveries(webhook_id: &WebhookId => clone, now: Millis)
            -> Result<u64> = webhooks::requeue_dead_deliveries(&webhook_id, now);
    }

    // These seal or open a secret, with the keyring.
    async fn create_webhook(&self, webhook: NewWebhook, now: Millis) -> Result<Webhook> {
        let keyring = self.keyring()?;
        self.backend
            .write(move |c| webhooks::create_webhook(c, &keyring, webhook, now))
            .await
    }

    async fn rotate_webhook_secret(
        &self,
        id: &WebhookId,
        secret: String,
        request: Option<RequestMark>,
    ) -> Result<()> {
        let keyring = self.keyring()?;
        let id = id.clone();
        self.backend
            .write(move |c| webhooks::rotate_webhook_secret(c, &keyring, &id, &secret, request))
            .await
    }

    async fn seal_webhook_secrets(&self) -> Result<u64> {
        let keyring = self.keyring()?;
        self.backend
            .write(move |c| webhooks::seal_webhook_secrets(c, &keyring))
            .await
    }
}

forward! {
    impl Deliveries {
        write bound_deliveries(bounds: DeliveryBounds, now: Millis) -> Result<u64>
            = webhooks::bound_deliveries(bounds, now);
    }

    // A write only when a read found something to queue.
    async fn queue_deliveries(&self, limit: u32, now: Millis) -> Result<u32> {
        if !self.backend.read(webhooks::anything_to_queue).await? {
            return Ok(0);
        }
        self.backend
            .write(move |c| webhooks::queue_deliveries(c, limit, now))
            .await
    }

    // Opens each claimed delivery's secret, with the keyring.
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

    // Every delivery of the batch in one transaction.
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
