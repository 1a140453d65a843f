//! The Coordinator: the only writer of run state and the only publisher to both buses.
//!
//! Every write goes through the store in one transaction; events are broadcast only after
//! that transaction has committed, and new jobs wake the workers only then. Observers may
//! lag or drop events (they replay from the store); the execution path never waits on them.
//!
//! When other processes share the database, `follow_others` relays what they commit: their
//! events are read back from the store and published on the same bus, and their new jobs wake
//! this process's workers. It never writes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use futures::StreamExt;

use ratchet_core::{
    MessageId, Millis, RunConfigSnapshot, RunId, RunStatus, ScheduleId, SessionId, StepResult,
    TraceContext,
};
use ratchet_store::{
    CancelOutcome, Change, ChangeStream, Changes, Claim, ClaimedStep, Commit, DuePass, FireIds,
    Fired, KeyedRequest, Lease, NewRun, NewSchedule, Reads, RequestClaim, RequestMark, Roles,
    RunQuota, Schedule, ScheduleChange, ScheduleSpec, Session, SessionSpec, StoredEvent,
    StoredResponse, WhenBusy, Writes,
};
use tokio::sync::{Notify, broadcast};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::activity::{ActivityBus, LiveActivity, Observed};
use crate::{Clock, Result};

/// Live events; a subscriber that falls this far behind is told it lagged and replays.
const EVENT_BUFFER: usize = 8192;
/// Events of another process read back from the store per query.
const RELAY_PAGE: i64 = 500;
/// How often a process reads the database's clock again (`follow_database_clock`).
const CLOCK_SYNC: std::time::Duration = std::time::Duration::from_secs(10);

/// What a message does when its session already has an active run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Multitask {
    /// Queue a run that starts when the runs before it have ended.
    #[default]
    Enqueue,
    /// Refuse the message.
    Reject,
    /// Cancel the active run and start this one as soon as it has ended.
    Interrupt,
    /// Join the active run before its next model call (or, if it ends first, run next).
    Steer,
}

/// A fork's new session and run (see `Coordinator::fork`).
#[derive(Debug, Clone)]
pub struct ForkedRun {
    pub session: Session,
    pub run_id: RunId,
    /// `running`, or `waiting_human` when a call of the source is in doubt.
    pub status: RunStatus,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartedRun {
    pub session_id: SessionId,
    /// The message's run: its own, or — when `steered` — the active run it joins.
    pub run_id: RunId,
    pub message_id: MessageId,
    pub status: RunStatus,
    pub steered: bool,
}

pub struct Coordinator {
    /// The store's transactions: no other part of a process is handed this role.
    writes: Arc<dyn Writes>,
    reads: Arc<dyn Reads>,
    changes: Arc<dyn Changes>,
    events: broadcast::Sender<StoredEvent>,
    wake: Notify,
    in_flight: Mutex<HashMap<RunId, CancellationToken>>,
    /// Cancelled when the Coordinator is dropped: its follower of other processes stops.
    dropped: CancellationToken,
    /// Limits on unfinished runs, checked when a message or a delegation admits new ones.
    quota: RunQuota,
    /// What the steps in flight here are doing; never stored (see `activity.rs`).
    activity: ActivityBus,
    /// What time it is for everything this process stamps and measures.
    clock: Clock,
    /// Added to `clock`: how far the database's clock is ahead of it, where the database has a
    /// clock of its own (`follow_database_clock`); 0 otherwise.
    clock_offset: AtomicI64,
    /// Stored events sent on the observation bus so far; held while one is sent, so a
    /// subscriber knows exactly which ones it will receive.
    published: Mutex<u64>,
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        self.dropped.cancel();
    }
}

pub(crate) fn fresh_suffix() -> String {
    Uuid::now_v7().simple().to_string()
}

/// Whether `events` end `run`.
fn finished_in(events: &[StoredEvent], run: &RunId) -> bool {
    let finished = ratchet_core::EventKind::RunFinished.as_str();
    (events.iter()).any(|e| e.kind == finished && e.run_id.as_ref() == Some(run))
}

impl Coordinator {
    pub fn new(store: impl Into<Roles>) -> Arc<Coordinator> {
        Coordinator::with_quota(store, RunQuota::default())
    }

    /// A Coordinator that admits new runs only within `quota`.
    pub fn with_quota(store: impl Into<Roles>, quota: RunQuota) -> Arc<Coordinator> {
        Coordinator::with_clock(store, quota, Clock::System)
    }

    /// A Coordinator that admits new runs only within `quota` and reads the time from
    /// `clock`, as do the engine and the workers it serves.
    pub fn with_clock(store: impl Into<Roles>, quota: RunQuota, clock: Clock) -> Arc<Coordinator> {
        let Roles {
            reads,
            writes,
            changes,
            ..
        } = store.into();
        Arc::new(Coordinator {
            writes,
            reads,
            changes,
            events: broadcast::channel(EVENT_BUFFER).0,
            wake: Notify::new(),
            in_flight: Mutex::new(HashMap::new()),
            dropped: CancellationToken::new(),
            quota,
            activity: ActivityBus::new(),
            clock,
            clock_offset: AtomicI64::new(0),
            published: Mutex::new(0),
        })
    }

    pub fn quota(&self) -> RunQuota {
        self.quota
    }

    /// Now, in milliseconds since the epoch: by the database's clock where the database has
    /// one (see `follow_database_clock`), by this process's otherwise.
    pub fn now(&self) -> Millis {
        self.clock.now() + self.clock_offset.load(Ordering::Relaxed)
    }

    /// Reads the database's clock and sets this process's offset from it (half the query's
    /// round trip counted as the way there); returns the offset, or None where the process's
    /// own clock is the clock.
    pub async fn sync_clock(&self) -> Result<Option<Millis>> {
        let before = self.clock.now();
        let Some(database) = self.reads.database_now().await? else {
            return Ok(None);
        };
        let after = self.clock.now();
        let offset = database - (before + after) / 2;
        self.clock_offset.store(offset, Ordering::Relaxed);
        Ok(Some(offset))
    }

    /// Keeps this process on the database's clock where processes on several machines share
    /// it (PostgreSQL): an owned task reads it now and every `CLOCK_SYNC` (a clock stepped or
    /// drifting is caught up with then), so due times, leases and deadlines set and judged by
    /// any process agree whatever each machine's clock says. Ends at once where the process's
    /// clock is the clock, and when the Coordinator is dropped.
    pub fn follow_database_clock(self: &Arc<Self>) -> JoinHandle<()> {
        let this = Arc::downgrade(self);
        let dropped = self.dropped.clone();
        tokio::spawn(async move {
            let follow = async {
                loop {
                    let Some(coordinator) = this.upgrade() else {
                        return;
                    };
                    match coordinator.sync_clock().await {
                        Ok(None) => return,
                        Ok(Some(_)) => {}
                        Err(error) => tracing::warn!(%error, "reading the database's clock failed"),
                    }
                    drop(coordinator);
                    tokio::time::sleep(CLOCK_SYNC).await;
                }
            };
            tokio::select! {
                () = follow => {}
                () = dropped.cancelled() => {}
            }
        })
    }

    /// Relays what other processes sharing the database commit, when the store can tell
    /// (`Changes::changes`; `None` otherwise, and then workers and event streams find others'
    /// work by polling alone). An owned task publishes their events on the observation bus as
    /// if they were local — read back from the store, in the order they were announced — and
    /// wakes the workers when they enqueue jobs or when changes may have been missed. The task
    /// holds the Coordinator weakly: it ends when the Coordinator is dropped or the change
    /// stream ends. Call once per Coordinator, inside a tokio runtime.
    pub fn follow_others(self: &Arc<Self>) -> Option<JoinHandle<()>> {
        let changes = self.changes.changes()?;
        let this = Arc::downgrade(self);
        let dropped = self.dropped.clone();
        Some(tokio::spawn(async move {
            tokio::select! {
                () = relay(this, changes) => {}
                () = dropped.cancelled() => {}
            }
        }))
    }

    /// The store, to read: every write goes through the Coordinator's own methods.
    pub fn store(&self) -> &Arc<dyn Reads> {
        &self.reads
    }

    /// The observation bus. Subscribe before acting to see every event of the action.
    pub fn subscribe(&self) -> broadcast::Receiver<StoredEvent> {
        self.events.subscribe()
    }

    /// The observation bus and the live activity of steps in flight in this process,
    /// subscribed together so that the two can be merged in the order they were sent (see
    /// `LiveActivity::published_before`). Activity is not a stored event and has no `seq`:
    /// a stream sends it between stored events, and no replay contains it.
    pub fn observe(&self) -> Observed {
        let published = self.published.lock().unwrap_or_else(|e| e.into_inner());
        let (activity, in_flight) = self.activity.subscribe();
        Observed {
            events: self.events.subscribe(),
            activity,
            published: *published,
            in_flight,
        }
    }

    /// Tells whoever watches the claimed step's session what the step is about to do.
    pub fn announce(&self, claimed: &ClaimedStep, activity: &ratchet_core::Activity) {
        let published = self.published.lock().unwrap_or_else(|e| e.into_inner());
        self.activity
            .announce(claimed, activity, *published, self.clock.now());
    }

    /// Whether `activity` is still what its run's step in flight here last announced (a
    /// stream that took it from `Observed::in_flight` sends it only then).
    pub fn still_in_flight(&self, activity: &LiveActivity) -> bool {
        self.activity.still_in_flight(activity)
    }

    pub async fn create_session(&self, spec: SessionSpec) -> Result<Session> {
        let id = SessionId::from_suffix(&fresh_suffix())
            .map_err(|e| crate::Error::Invalid(e.to_string()))?;
        Ok(self.writes.create_session(&id, spec, self.now()).await?)
    }

    /// Renames a session (`title`, already checked by the caller). No event: a title is
    /// not part of any run.
    pub async fn rename_session(&self, id: &SessionId, title: &str) -> Result<Session> {
        Ok(self.writes.rename_session(id, title).await?)
    }

    /// Records a user message and its run; the run starts now, or — following `multitask` —
    /// queues behind the session's active run or is refused.
    pub async fn submit(
        &self,
        session_id: &SessionId,
        content: String,
        config: RunConfigSnapshot,
        multitask: Multitask,
    ) -> Result<StartedRun> {
        self.submit_in_trace(session_id, content, config, multitask, None, None)
            .await
    }

    /// Forks `source` at its step `at_step` (see `Writes::fork_run`): a new session and a
    /// run in it that continues from there, frozen with `config` (and its session naming the
    /// agent) when given, with the source's configuration otherwise.
    pub async fn fork(
        &self,
        source: &RunId,
        at_step: u64,
        edit: Option<ratchet_core::ForkEdit>,
        config: Option<(RunConfigSnapshot, Option<String>)>,
        request: Option<RequestMark>,
    ) -> Result<ForkedRun> {
        let invalid = |e: ratchet_core::IdError| crate::Error::Invalid(e.to_string());
        let session_id = SessionId::from_suffix(&fresh_suffix()).map_err(invalid)?;
        let run_id = RunId::from_suffix(&fresh_suffix()).map_err(invalid)?;
        let fork = ratchet_store::NewFork {
            source: source.clone(),
            at_step,
            session_id,
            run_id: run_id.clone(),
            config,
            edit,
            quota: self.quota,
            request,
        };
        let forked = self.writes.fork_run(fork, self.now()).await?;
        self.publish(forked.events);
        if forked.status == RunStatus::Running {
            self.wake.notify_one();
        }
        Ok(ForkedRun {
            session: forked.session,
            run_id,
            status: forked.status,
        })
    }

    /// `submit`, with the run's spans in the caller's `trace` (from its `traceparent`).
    pub async fn submit_in_trace(
        &self,
        session_id: &SessionId,
        content: String,
        config: RunConfigSnapshot,
        multitask: Multitask,
        trace: Option<TraceContext>,
        request: Option<RequestMark>,
    ) -> Result<StartedRun> {
        let invalid = |e: ratchet_core::IdError| crate::Error::Invalid(e.to_string());
        let run_id = RunId::from_suffix(&fresh_suffix()).map_err(invalid)?;
        let message_id = MessageId::from_suffix(&fresh_suffix()).map_err(invalid)?;
        let new = NewRun {
            session_id: session_id.clone(),
            run_id: run_id.clone(),
            message_id: message_id.clone(),
            content,
            config,
            when_busy: match multitask {
                Multitask::Enqueue => WhenBusy::Enqueue,
                Multitask::Reject => WhenBusy::Reject,
                Multitask::Interrupt => WhenBusy::Interrupt,
                Multitask::Steer => WhenBusy::Steer,
            },
            quota: self.quota,
            trace,
            request,
        };
        // An interrupt cancels the session's active run. As in `request_cancel`, its step here
        // is cancelled before the message is stamped, so no call of it starts later than the
        // time its cancel is recorded at.
        let interrupting = match multitask {
            Multitask::Interrupt => self.reads.get_session(session_id).await?.active_run_id,
            _ => None,
        };
        let registered_here = interrupting.as_ref().is_some_and(|run| {
            let (token, registered_here) = self.cancel_token(run);
            token.cancel();
            registered_here
        });
        let submitted = self.writes.submit_message(new, self.now()).await;
        // The token stays registered while the run winds down (a worker claiming it adopts
        // it), as in `request_cancel`; otherwise no step of the run is left to cancel.
        if let Some(run) = interrupting.as_ref().filter(|_| registered_here) {
            let winding_down = submitted
                .as_ref()
                .is_ok_and(|s| s.interrupted.as_ref() == Some(run) && !finished_in(&s.events, run));
            if !winding_down {
                self.forget_token(run);
            }
        }
        let submitted = submitted?;
        self.publish(submitted.events);
        if let Some(interrupted) = &submitted.interrupted {
            let token = self
                .in_flight
                .lock()
                .ok()
                .and_then(|m| m.get(interrupted).cloned());
            if let Some(token) = token {
                token.cancel();
            }
        }
        // A new run, or a run whose wait on a timer this message ended, has a job ready now.
        if submitted.status == RunStatus::Running || submitted.woke.is_some() {
            self.wake.notify_one();
        }
        Ok(StartedRun {
            session_id: session_id.clone(),
            run_id: submitted.steered_into.clone().unwrap_or(run_id),
            message_id,
            status: submitted.status,
            steered: submitted.steered_into.is_some(),
        })
    }

    pub async fn claim_next(
        &self,
        lease: Lease,
        run: Option<&RunId>,
    ) -> Result<Option<ClaimedStep>> {
        Ok(self.writes.claim_next(lease, run, self.now()).await?)
    }

    pub async fn heartbeat(&self, claim: &Claim, lease: &Lease) -> Result<bool> {
        Ok(self.writes.heartbeat(claim, lease.expires_at).await?)
    }

    /// Commits a step and publishes its events; the `Commit` returned keeps everything else
    /// (its events have gone to the bus, not copied).
    pub async fn commit(
        &self,
        claim: &Claim,
        result: StepResult,
        continue_with: Option<Lease>,
    ) -> Result<Commit> {
        #[cfg(feature = "failpoints")]
        fail::fail_point!("step.before_commit", |_| std::process::abort());
        let commit = self
            .writes
            .commit_step_within(claim, result, continue_with, self.quota, self.now())
            .await;
        self.activity.step_over(&claim.run_id);
        let mut commit = commit?;
        if let Commit::Committed {
            events, enqueued, ..
        } = &mut commit
        {
            #[cfg(feature = "failpoints")]
            fail::fail_point!("step.after_commit", |_| std::process::abort());
            self.publish(std::mem::take(events));
            if *enqueued {
                self.wake.notify_one();
            }
        }
        Ok(commit)
    }

    pub async fn retry_later(
        &self,
        claim: &Claim,
        available_at: ratchet_core::Millis,
        event: ratchet_core::EventDraft,
    ) -> Result<bool> {
        let events = self
            .writes
            .retry_later(claim, available_at, event, self.now())
            .await;
        self.activity.step_over(&claim.run_id);
        let events = events?;
        let kept = events.is_some();
        self.publish(events.unwrap_or_default());
        Ok(kept)
    }

    pub async fn append_events(
        &self,
        session_id: &SessionId,
        run_id: &RunId,
        events: Vec<ratchet_core::EventDraft>,
    ) -> Result<()> {
        let stored = self
            .writes
            .append_events(session_id, run_id, events, self.now())
            .await?;
        self.publish(stored);
        Ok(())
    }

    /// Records write-ahead intents of a claimed step with the events that announce them, in
    /// one transaction; returns each intent's attempt number.
    pub async fn record_intents(
        &self,
        claim: &Claim,
        intents: Vec<ratchet_store::Intent>,
        events: Vec<ratchet_core::EventDraft>,
    ) -> Result<Vec<u32>> {
        let recorded = self
            .writes
            .record_intents(claim, intents, events, self.now())
            .await?;
        self.publish(recorded.events);
        Ok(recorded.attempts)
    }

    pub async fn record_outcome(
        &self,
        claim: &Claim,
        slot: u32,
        outcome: ratchet_core::ToolOutcome,
    ) -> Result<()> {
        Ok(self
            .writes
            .record_outcome(claim, slot, outcome, self.now())
            .await?)
    }

    /// Cancels a run: at once when it has no step in flight, otherwise by marking it
    /// `cancelling` and cancelling the step running in this process.
    pub async fn request_cancel(&self, run_id: &RunId) -> Result<CancelOutcome> {
        // The token goes in first: a worker that claims the run while the store is being
        // told adopts it, so the cancel cannot fall between its claim and its registration.
        // It is cancelled before the cancel is stamped, so no call of a step here starts later
        // than the time the cancel is recorded at; should the store fail to record it, the
        // step's worker finds no cancel recorded and gives the step back.
        let (token, registered_here) = self.cancel_token(run_id);
        token.cancel();
        let outcome = match self.writes.request_cancel(run_id, self.now()).await {
            Ok(outcome) => outcome,
            Err(error) => {
                if registered_here {
                    self.forget_token(run_id);
                }
                return Err(error.into());
            }
        };
        match &outcome {
            CancelOutcome::Cancelled { events, enqueued } => {
                self.forget_token(run_id);
                self.cancel_moved(events);
                self.publish(events.clone());
                if *enqueued {
                    self.wake.notify_one();
                }
            }
            CancelOutcome::Cancelling { events } => {
                self.cancel_moved(events);
                self.publish(events.clone());
            }
            CancelOutcome::AlreadyTerminal(_) => self.forget_token(run_id),
        }
        Ok(outcome)
    }

    /// Runs that `events` move to `cancelling` have their step in this process (if any)
    /// cancelled now: the runs a cancel's delegations started, and runs another process
    /// accepted a cancel for.
    fn cancel_moved(&self, events: &[StoredEvent]) {
        let cancelling = RunStatus::Cancelling.as_str();
        let tokens = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        for event in events {
            let moved = event.kind == ratchet_core::EventKind::RunStatus.as_str()
                && event.payload["status"] == cancelling;
            if let Some(token) = event
                .run_id
                .as_ref()
                .filter(|_| moved)
                .and_then(|r| tokens.get(r))
            {
                token.cancel();
            }
        }
    }

    /// Pauses a run at its next step boundary (see `Writes::request_pause`). A step in flight
    /// is not interrupted: its commit pauses the run.
    pub async fn request_pause(&self, run_id: &RunId) -> Result<ratchet_store::PauseOutcome> {
        let outcome = self.writes.request_pause(run_id, self.now()).await?;
        if let ratchet_store::PauseOutcome::Paused { events } = &outcome {
            self.publish(events.clone());
        }
        Ok(outcome)
    }

    /// Takes a paused run up again; its next step is picked up by any worker.
    pub async fn resume_paused(&self, run_id: &RunId) -> Result<ratchet_store::ResumeOutcome> {
        let outcome = self.writes.resume_paused(run_id, self.now()).await?;
        if let ratchet_store::ResumeOutcome::Resumed { events } = &outcome {
            self.publish(events.clone());
            self.wake.notify_one();
        }
        Ok(outcome)
    }

    /// Records a human's answer for a call in doubt; once all are answered the run goes on.
    pub async fn reconcile(
        &self,
        run_id: &RunId,
        call_id: &str,
        answer: ratchet_core::step::Reconciliation,
        result: Option<String>,
    ) -> Result<ratchet_store::Reconciled> {
        let reconciled = self
            .writes
            .reconcile(run_id, call_id, answer, result, self.now())
            .await?;
        self.publish(reconciled.events.clone());
        if reconciled.resumed {
            self.wake.notify_one();
        }
        Ok(reconciled)
    }

    /// Continues or retries a failed run; its next step is picked up by any worker. A keyed
    /// request records it with its key (see `Writes::resume_failed`).
    pub async fn resume_failed(
        &self,
        run_id: &RunId,
        how: ratchet_core::step::Resumption,
        request: Option<RequestMark>,
    ) -> Result<Vec<ratchet_store::StoredEvent>> {
        let events = (self.writes)
            .resume_failed(run_id, how, request, self.now())
            .await?;
        self.publish(events.clone());
        self.wake.notify_one();
        Ok(events)
    }

    /// Records a human's answer to an approval: the run goes on with the approved calls, or
    /// ends when aborted (and the session's next run starts). `by` is who answered.
    pub async fn answer_approval(
        &self,
        id: &ratchet_core::ApprovalId,
        answer: ratchet_core::ApprovalAnswer,
        by: &str,
    ) -> Result<ratchet_store::Answered> {
        let answered = self
            .writes
            .answer_approval(id, answer, by, self.now())
            .await?;
        self.publish(answered.events.clone());
        if answered.resumed || answered.enqueued {
            self.wake.notify_one();
        }
        Ok(answered)
    }

    /// Sends a background run's signal to its root session's inbox (see `Writes::emit_signal`).
    pub async fn emit_signal(
        &self,
        claim: &Claim,
        signal: ratchet_store::NewSignal,
    ) -> Result<ratchet_store::SignalOutcome> {
        let emitted = self.writes.emit_signal(claim, signal, self.now()).await?;
        self.publish(emitted.events);
        if emitted.enqueued {
            self.wake.notify_one();
        }
        Ok(emitted.outcome)
    }

    /// Starts the continuation turns that are due: in every free root session with inbox
    /// events whose time has come (a released event's retry, one that fell due while nothing
    /// committed). Returns how many started.
    pub async fn serve_inboxes(&self) -> Result<usize> {
        let served = self.writes.serve_inboxes(self.now()).await?;
        self.publish(served.events);
        if !served.started.is_empty() {
            self.wake.notify_one();
        }
        Ok(served.started.len())
    }

    /// Takes the key of a request sent with an `Idempotency-Key`, or says why not.
    pub async fn begin_request(&self, request: KeyedRequest) -> Result<RequestClaim> {
        Ok(self.writes.begin_request(request, self.now()).await?)
    }

    /// Keeps the response a keyed request was answered with; false when its key was taken
    /// over meanwhile.
    pub async fn finish_request(
        &self,
        mark: &RequestMark,
        response: StoredResponse,
    ) -> Result<bool> {
        // The process dies after the request's effect committed, before its answer is kept.
        #[cfg(feature = "failpoints")]
        fail::fail_point!("request.before_response", |_| std::process::abort());
        Ok(self.writes.finish_request(mark, response).await?)
    }

    /// Gives back the key of a request that did nothing worth repeating.
    pub async fn abandon_request(&self, mark: &RequestMark) -> Result<()> {
        Ok(self.writes.abandon_request(mark).await?)
    }

    /// Forgets the request keys that expired; how many.
    pub async fn sweep_requests(&self) -> Result<u64> {
        Ok(self.writes.sweep_requests(self.now()).await?)
    }

    /// Ends the runs that wait past their deadline (`timed_out`), cancelling their children
    /// (in this process too). Returns how many ended.
    pub async fn time_out_overdue(&self) -> Result<usize> {
        let timed_out = self.writes.time_out_overdue(self.now()).await?;
        self.cancel_moved(&timed_out.events);
        self.publish(timed_out.events);
        if timed_out.enqueued {
            self.wake.notify_one();
        }
        Ok(timed_out.ended.len())
    }

    /// Archives or deletes a root session: its runs are cancelled (their steps in this
    /// process too) and its inbox emptied into the dead letter.
    pub async fn close_session(
        &self,
        id: &SessionId,
        how: ratchet_store::Closing,
    ) -> Result<ratchet_store::Closed> {
        let closed = self.writes.close_session(id, how, self.now()).await?;
        self.cancel_moved(&closed.events);
        self.publish(closed.events.clone());
        if closed.enqueued {
            self.wake.notify_one();
        }
        Ok(closed)
    }

    /// An operator requeues or discards a dead letter of a root session's inbox; what it
    /// publishes goes out, and a continuation it started wakes a worker.
    pub async fn act_on_dead_letter(
        &self,
        session: &SessionId,
        event_id: i64,
        action: ratchet_store::DeadLetterAction,
        by: &str,
    ) -> Result<ratchet_store::InboxEvent> {
        let changed = (self.writes)
            .act_on_dead_letter(session, event_id, action, by, self.now())
            .await?;
        self.publish(changed.events);
        if changed.enqueued {
            self.wake.notify_one();
        }
        Ok(changed.event)
    }

    /// Creates a schedule of `tenant`, its runs frozen with `config`, its first slot due at
    /// `next_fire_at`; a keyed request's effect is recorded with its key.
    pub async fn create_schedule(
        &self,
        tenant: String,
        spec: ScheduleSpec,
        config: RunConfigSnapshot,
        next_fire_at: Millis,
        request: Option<RequestMark>,
    ) -> Result<Schedule> {
        let id = ScheduleId::from_suffix(&fresh_suffix())
            .map_err(|e| crate::Error::Invalid(e.to_string()))?;
        let new = NewSchedule {
            id,
            tenant,
            spec,
            config,
            next_fire_at,
            request,
        };
        Ok(self.writes.create_schedule(new, self.now()).await?)
    }

    /// Replaces a schedule's definition (see `Writes::update_schedule`).
    pub async fn update_schedule(
        &self,
        id: &ScheduleId,
        change: ScheduleChange,
    ) -> Result<Schedule> {
        Ok(self.writes.update_schedule(id, change, self.now()).await?)
    }

    /// Pauses or resumes a schedule; a resumed one's next slot is due at `next_fire_at`.
    pub async fn set_schedule_paused(
        &self,
        id: &ScheduleId,
        paused: bool,
        next_fire_at: Option<Millis>,
    ) -> Result<Schedule> {
        Ok(self
            .writes
            .set_schedule_paused(id, paused, next_fire_at, self.now())
            .await?)
    }

    pub async fn delete_schedule(&self, id: &ScheduleId) -> Result<()> {
        Ok(self.writes.delete_schedule(id, self.now()).await?)
    }

    /// Fresh ids for a run a schedule may fire, and for its session when it gets a new one.
    pub fn fire_ids(&self) -> Result<FireIds> {
        let invalid = |e: ratchet_core::IdError| crate::Error::Invalid(e.to_string());
        Ok(FireIds {
            run_id: RunId::from_suffix(&fresh_suffix()).map_err(invalid)?,
            message_id: MessageId::from_suffix(&fresh_suffix()).map_err(invalid)?,
            session_id: SessionId::from_suffix(&fresh_suffix()).map_err(invalid)?,
        })
    }

    /// Decides a schedule's due slots (see `Writes::fire_schedule`): what it started is
    /// published, the previous runs it cancels are cut off here too, and workers woken.
    pub async fn fire_schedule(&self, id: &ScheduleId, pass: DuePass) -> Result<Fired> {
        let fired = (self.writes)
            .fire_schedule(id, pass, self.quota, self.now())
            .await?;
        Ok(self.after_firing(fired))
    }

    /// Fires a schedule now, as a manual slot (see `Writes::trigger_schedule`).
    pub async fn trigger_schedule(
        &self,
        id: &ScheduleId,
        request: Option<RequestMark>,
    ) -> Result<Fired> {
        let ids = self.fire_ids()?;
        let fired = (self.writes)
            .trigger_schedule(id, ids, self.quota, request, self.now())
            .await?;
        Ok(self.after_firing(fired))
    }

    fn after_firing(&self, mut fired: Fired) -> Fired {
        // A previous run that `cancel_previous` moved to `cancelling` has its step here cut off.
        self.cancel_moved(&fired.events);
        self.publish(std::mem::take(&mut fired.events));
        if fired.enqueued {
            self.wake.notify_one();
        }
        fired
    }

    /// Releases the leases of processes on this machine that no longer exist, so their steps
    /// are taken over now instead of after lease expiry. Returns how many jobs were freed.
    pub async fn recover(&self, is_dead: impl Fn(&str) -> bool) -> Result<u64> {
        let mut released = 0;
        for owner in self.reads.lease_owners().await? {
            if is_dead(&owner) {
                released += self.writes.release_leases(&owner).await?;
            }
        }
        self.wake.notify_waiters();
        Ok(released)
    }

    pub(crate) async fn woken(&self) {
        self.wake.notified().await;
    }

    /// Wakes every idle worker, and leaves a permit for one that is about to wait.
    fn wake_all(&self) {
        self.wake.notify_waiters();
        self.wake.notify_one();
    }

    /// Reads events `first_seq..=last_seq` of another process from the store and publishes
    /// them. A failed read is only logged: event streams catch up from the store by
    /// themselves.
    async fn relay_events(&self, session_id: &SessionId, first_seq: i64, last_seq: i64) {
        let mut after = first_seq - 1;
        while after < last_seq {
            let limit = (last_seq - after).min(RELAY_PAGE) as u32;
            let page = match self.reads.events_after(session_id, after, limit).await {
                Ok(page) => page,
                Err(error) => {
                    tracing::warn!(%error, session = %session_id, "cannot read another process's events");
                    return;
                }
            };
            let Some(last) = page.last() else {
                return;
            };
            after = last.seq;
            self.cancel_moved(&page);
            self.publish(page);
        }
    }

    pub(crate) fn wake_one(&self) {
        self.wake.notify_one();
    }

    /// The run's cancellation token for a streak of steps in this process.
    pub(crate) fn streak_started(&self, run_id: &RunId) -> CancellationToken {
        self.cancel_token(run_id).0
    }

    pub(crate) fn streak_ended(&self, run_id: &RunId) {
        self.activity.step_over(run_id);
        self.forget_token(run_id);
    }

    fn cancel_token(&self, run_id: &RunId) -> (CancellationToken, bool) {
        let mut tokens = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        match tokens.get(run_id) {
            Some(token) => (token.clone(), false),
            None => {
                let token = CancellationToken::new();
                tokens.insert(run_id.clone(), token.clone());
                (token, true)
            }
        }
    }

    fn forget_token(&self, run_id: &RunId) {
        self.in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(run_id);
    }

    fn publish(&self, events: Vec<StoredEvent>) {
        for event in events {
            #[cfg(feature = "failpoints")]
            fail::fail_point!("events.publish", event.kind == "step.committed", |_| {
                std::process::abort()
            });
            let mut published = self.published.lock().unwrap_or_else(|e| e.into_inner());
            // No subscriber is not an error: events are durable and replayable.
            let _ = self.events.send(event);
            *published += 1;
        }
    }
}

/// The follower task's body: one change at a time, in the order other processes committed.
async fn relay(coordinator: Weak<Coordinator>, mut changes: ChangeStream) {
    while let Some(change) = changes.next().await {
        let Some(coordinator) = coordinator.upgrade() else {
            return;
        };
        match change {
            Change::JobsReady | Change::Missed => coordinator.wake_all(),
            Change::Events {
                session_id,
                first_seq,
                last_seq,
            } => {
                coordinator
                    .relay_events(&session_id, first_seq, last_seq)
                    .await;
            }
        }
    }
    tracing::info!("the change stream of other processes ended");
}
